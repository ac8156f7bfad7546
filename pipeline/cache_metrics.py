"""The two caches' counters as Prometheus text, apart from the other metrics so either can move."""

from __future__ import annotations

from stages.encoder_cache import CacheStats

__all__ = ["render_cache_metrics"]


def render_cache_metrics(stats: dict[str, CacheStats]) -> str:
    """``stats`` by cache name (``encoder``, ``kv_prefix``); hits and misses count images for the
    encoder cache and full prompt blocks for the KV prefix cache."""
    series = {
        "pipeline_cache_hits_total": ("counter", lambda s: s.hits),
        "pipeline_cache_misses_total": ("counter", lambda s: s.misses),
        "pipeline_cache_evictions_total": ("counter", lambda s: s.evictions),
        "pipeline_cache_bytes": ("gauge", lambda s: s.bytes_held),
        "pipeline_cache_bytes_bound": ("gauge", lambda s: s.bytes_bound),
    }
    out = []
    for name, (kind, value) in series.items():
        out.append(f"# TYPE {name} {kind}")
        out += [f'{name}{{cache="{cache}"}} {value(s)}' for cache, s in sorted(stats.items())]
    return "\n".join(out) + "\n"
