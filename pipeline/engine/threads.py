"""How many intra-op threads torch gets in the engine process.

A decode step is a few hundred operators. On a small model each is too short to share between
cores: the OpenMP workers of one step spin waiting for each other and for the serving process's
work on the same cores (the embedded model, 2 shared cores: one decode's TPOT 3.5 ms with 1 thread,
48-97 ms with 2). On a real model the step is its matrix products, which one per core speeds up
(SmolLM2-135M served, 16 concurrent requests: 1.6x the throughput with 2 threads than with 1).
"""

from __future__ import annotations

__all__ = ["MIN_PARAMETERS_FOR_ALL_CORES", "engine_threads"]

# the size from which a model's decode step gets one thread per core when none is configured: the
# embedded model has 17M parameters (most of them its 131k-token embedding and head), SmolLM2 135M
MIN_PARAMETERS_FOR_ALL_CORES = 50_000_000


def engine_threads(configured: int | None, num_parameters: int) -> int:
    """The thread count to set, 0 for torch's default (one per core): ``configured`` when given
    (``PipelineConfig.engine_torch_threads``), else by the model's size."""
    if configured is not None:
        return configured
    return 0 if num_parameters >= MIN_PARAMETERS_FOR_ALL_CORES else 1
