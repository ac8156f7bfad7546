"""The compiled decode forward (torch.compile, inductor) of the families whose attention or positions
differ from Mistral's gives the eager logits: Gemma 2's soft-capping, Gemma 3's sliding windows and
qk-norm, Qwen 3's qk-norm, Qwen2.5-VL's M-RoPE positions. Each compiles its decoder whole around the
opaque paged attention (a graph break would fail the compile)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from sampling.families import build_runner
from tests.sampling.test_compiled_decode import ATOL, needs_compiler
from vision.checkpoint import Checkpoint

# (family, M-RoPE offset of the decode rows: the step carries M-RoPE positions when it is not 0)
CASES = [("gemma2", 0), ("gemma3", 0), ("qwen3", 0), ("qwen2.5-vl", -7)]
LENGTHS = (70, 9, 41)  # rows of different lengths, past Gemma's sliding window in the first


@pytest.fixture(autouse=True)
def _forget_the_graphs() -> Iterator[None]:
    """The compiler keeps its graphs per function for the whole process, every runner class's
    together: each family's would count against the other tests' graph bounds."""
    yield
    torch._dynamo.reset()


@needs_compiler
@pytest.mark.slow  # each family's compile: about 10 s with an empty inductor cache
@pytest.mark.parametrize(("family", "rope_delta"), CASES)
def test_the_compiled_decode_gives_the_eager_logits(
    family_dir: Callable[[str], Path], family: str, rope_delta: int
) -> None:
    checkpoint = Checkpoint(family_dir(family))
    runners = [
        build_runner(checkpoint, device="cpu", max_model_len=512, num_blocks=32, block_size=16) for _ in range(2)
    ]
    runners[1].compile_decode()
    gen = torch.Generator().manual_seed(11)
    vocab = runners[0].cfg.vocab_size
    seqs = [torch.randint(20, vocab, (n,), generator=gen).tolist() for n in LENGTHS]
    tables = [[0, 1, 2, 3, 4], [5], [6, 7, 8]]
    positions = [n - 1 for n in LENGTHS]
    ids = torch.tensor([s[-1] for s in seqs])
    logits = []
    for runner in runners:
        for seq, table in zip(seqs, tables, strict=True):
            runner.prefill(seq[:-1], 0, table, None)
        batch = runner.decode_inputs(positions, tables)
        if rope_delta:
            batch.rope_positions = (torch.tensor(positions) + rope_delta).expand(3, -1)
        logits.append(runner.decode(ids, batch))
    torch.testing.assert_close(logits[1], logits[0], atol=ATOL, rtol=0)
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))
