"""What the pipeline tells about itself: counters and histograms (``metrics``), their Prometheus
exposition (``prometheus``) and Chrome-trace stage spans (``trace``).

``metrics`` counts and knows no exporter; ``prometheus`` reads it at scrape time.
"""

from __future__ import annotations

from pipeline.observability.metrics import Metrics, StageMetrics
from pipeline.observability.prometheus import MetricsExporter
from pipeline.observability.trace import Tracer

__all__ = ["Metrics", "MetricsExporter", "StageMetrics", "Tracer"]
