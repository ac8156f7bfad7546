"""What a running pipeline holds, read without changing it: the ``Resources`` snapshot that tests
check for leaks, and the figures of its caches (encoder, image pixels, KV prefix) that ``/metrics`` reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.core.preparation import Preparation
from pipeline.engine.client import ProcessEngine
from pipeline.engine.factory import Engine
from pipeline.observability.metrics import Metrics
from stages.encoder_cache import CacheStats

__all__ = ["Resources", "cache_counters", "cache_stats", "resources"]


@dataclass(frozen=True, slots=True)
class Resources:
    """What the pipeline holds now; every field is 0 once it is idle (tests assert exactly that)."""

    pending_requests: int  # admitted, not yet out of the stages
    running_requests: int  # handles not yet done
    grammar_compiles: int  # compile jobs in flight
    limiter_tokens: dict[str, int]  # per stage limiter: tokens borrowed (threads and slots in use)
    queued: dict[str, int]  # per stage inbox: jobs waiting
    in_flight: dict[str, int]  # per stage: jobs a worker is on
    engine: dict[str, int]  # engine requests, output streams, KV blocks in use, adds waiting for room

    @property
    def is_released(self) -> bool:
        counts = [self.pending_requests, self.running_requests, self.grammar_compiles]
        counts += [*self.limiter_tokens.values(), *self.queued.values(), *self.in_flight.values()]
        counts += list(self.engine.values())
        return not any(counts)


def resources(prep: Preparation, metrics: Metrics, engine: Engine | None, pending: int, running: int) -> Resources:
    """What the pipeline holds now: ``pending`` requests in the stages, ``running`` handles not done."""
    return Resources(
        pending_requests=pending,
        running_requests=running,
        grammar_compiles=prep.grammar.num_compiling,
        limiter_tokens={name: int(limiter.borrowed_tokens) for name, limiter in prep.limiters().items()},
        queued={stage.name: stage.queue_depth() for stage in prep.stages} | prep.side_queues(),
        in_flight={name: stage.in_flight for name, stage in metrics.stages.items()},
        engine=engine.resources() if engine is not None else {},
    )


def cache_stats(prep: Preparation, engine: Engine | None) -> dict[str, CacheStats]:
    """Hits, misses, evictions and bytes held of the encoder cache and the KV prefix cache (a
    cache that is off is absent). With the vision encoder in the engine process, the encoder cache
    is what that process holds (as the serving process's index says) and the pixels kept here for
    a hit's preparation are ``image_pixels``."""
    out = {}
    cache = prep.encoder_cache
    index = engine.images if isinstance(engine, ProcessEngine) else None
    if index is not None:
        out["encoder"] = replace(index.stats)
        if cache is not None:
            out["image_pixels"] = replace(cache.stats)
    elif cache is not None:
        out["encoder"] = replace(cache.stats)
    kv = engine.prefix_cache_figures() if engine is not None else None
    if kv is not None:
        out["kv_prefix"] = CacheStats(
            hits=kv["hits"],
            misses=kv["misses"],
            evictions=kv["evictions"],
            bytes_held=kv["blocks_held"] * kv["block_bytes"],
            bytes_bound=kv["num_blocks"] * kv["block_bytes"],
            entries=kv["blocks_held"],
        )
    return out


def cache_counters(stats: CacheStats | None) -> dict[str, float]:
    """One cache's figures as the metrics' cache counters (none for a cache that is off)."""
    if stats is None:
        return {}
    return {
        "hits": stats.hits,
        "misses": stats.misses,
        "evictions": stats.evictions,
        "bytes": stats.bytes_held,
        "bytes_bound": stats.bytes_bound,
        "entries": stats.entries,
    }
