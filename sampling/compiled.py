"""The decode step's model forward compiled with ``torch.compile`` (inductor).

Everything between attention calls is traced into one graph and fused; the paged attention stays
one opaque operator in it (``paged_attention`` in sampling/paged_attention.py, registered with
``torch.library``). The step's token count (the batch size B) and its key length L (whole KV blocks)
are dynamic and *unbacked*: the compiler may neither guard on their values nor specialize a size of 1,
so every batch size and sequence length shares one graph, and a step with M-RoPE positions one more;
per runner shape (a cache of another size, another rotary table), since those are static. One graph
rather than one for B = 1 and one for B > 1 took 10-28% off a cold start and 13-33% off a warm one
(docs/benchmarks.md).
Inductor keeps what it builds on disk (its FX graph cache), so a restart traces the model again but
compiles no kernel twice.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from sampling.paged_attention import AttentionBatch

if TYPE_CHECKING:
    from sampling.paged_runner import PagedRunner

__all__ = [
    "CompileMode",
    "DecodeForward",
    "compile_decode_forward",
    "is_compile_wanted",
    "num_compiled_graphs",
    "use_inductor_cache",
]

CompileMode = Literal["auto", "on", "off"]
# (token ids [B], where they go) -> logits [B, vocab] in fp32
DecodeForward = Callable[[torch.Tensor, AttentionBatch], torch.Tensor]
# graphs one runner class's forward may hold before the compiler runs new shapes eagerly: with and
# without M-RoPE positions, for the few runner shapes of one process (a benchmark builds two models; a
# class's graphs are kept together), and room for a guard we did not foresee
MAX_GRAPHS = 16


def is_compile_wanted(mode: CompileMode, device: torch.device) -> bool:
    """Whether to compile the decode forward: ``auto`` compiles nowhere yet, because where it has been
    measured (a 2-core CPU, docs/benchmarks.md) it saved 8-16% of an 8-layer model's step at batch 1
    and 8, 4% at 32 and none on the embedded model, against 14-17 s of compile (2.1-2.7 s warm)."""
    del device  # "auto" is per device once a GPU run has measured it (docs/gpu.md)
    return mode == "on"


def use_inductor_cache(cache_dir: Path) -> Path:
    """Point inductor's on-disk cache at ``cache_dir / "inductor"`` unless ``$TORCHINDUCTOR_CACHE_DIR``
    names another folder than torch's default; the folder in use. Process-wide: inductor reads the
    variable at each compile (and writes its default there the first time it looks, so a variable
    holding the default is not taken for the user's choice)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder is None or os.path.abspath(folder) == os.path.abspath(default_cache_dir()):
        folder = str(cache_dir / "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return Path(folder)


def _inference(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as an inference tensor (a copy if it is not): the compiler guards on the kind, and a
    step's inputs may come either way (``decode_inputs`` and ``decode`` make inference tensors; the
    last step's samples or a caller's own tensors may not be), which would otherwise double the graphs."""
    return tensor if tensor.is_inference() else tensor.clone()


def _step_inputs(ids: torch.Tensor, batch: AttentionBatch) -> tuple[torch.Tensor, AttentionBatch]:
    """The step's inputs as inference tensors, their sizes B and L marked unbacked (dynamic, and
    never specialized: a size of 1 included, which a dynamic mark would leave to a graph of its own)."""
    rope = batch.rope_positions
    ids = _inference(ids)
    batch = AttentionBatch(
        positions=_inference(batch.positions),
        slot_mapping=_inference(batch.slot_mapping),
        key_slots=_inference(batch.key_slots),
        key_valid=_inference(batch.key_valid),
        rope_positions=None if rope is None else _inference(rope),
    )
    mark = torch._dynamo.decorators.mark_unbacked
    for tensor in (ids, batch.positions, batch.slot_mapping, batch.key_slots, batch.key_valid):
        mark(tensor, 0)
    mark(batch.key_slots, 1)
    mark(batch.key_valid, 1)
    if batch.rope_positions is not None:
        mark(batch.rope_positions, 1)
    return ids, batch


def compile_decode_forward(forward: DecodeForward) -> DecodeForward:
    """``forward`` compiled by inductor into one graph (``fullgraph``: a graph break is an error,
    not a silent slow path), its inputs' sizes B and L unbacked at every call."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_GRAPHS)
    compiled = torch.compile(forward, fullgraph=True, dynamic=False)

    def run(ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        # a decode step's batch has no image spans, no query index and no masks yet (decode_inputs)
        assert batch.image_spans is None and batch.query_index is None, "compiled: decode steps only"
        return compiled(*_step_inputs(ids, batch))

    return run


def num_compiled_graphs(runner_class: type[PagedRunner]) -> int:
    """Graphs the compiler holds for ``runner_class``'s decode forward: what its recompiles are
    bounded by (the graphs are kept per function, so a class's runners share them)."""
    code = runner_class.decode_forward.__code__
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))
