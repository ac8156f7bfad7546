"""Scale-out on Ray Serve: an ingress and N pipeline replicas answering through ``pipeline.api``,
routed by cache affinity.

Only the parts that need no Ray are imported here (routing keys, the hash ring, merged metrics);
``ray_serve`` (the application), ``ingress``, ``replica``, ``router`` and ``launch`` import ``ray`` (the
``ray`` extra) and are imported by path: ``serve run pipeline.scaleout.ray_serve:app``.
"""

from __future__ import annotations

from pipeline.scaleout.affinity import HashRing, routing_key
from pipeline.scaleout.replica_metrics import merge_expositions

__all__ = ["HashRing", "merge_expositions", "routing_key"]
