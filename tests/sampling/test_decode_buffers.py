"""Decode steps that read their inputs from buffers allocated once, padded to buckets, give the tokens
of today's steps built at their own size: greedy, seeded, guided (both backends), with preemption and
prefix hits, in both decode loops; the runner's logits agree row for row."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sampling.decode_buffers import DecodeBucket, DecodeBuffers, row_buckets
from sampling.detokenizer import TokenBytes
from sampling.model_runner import ModelRunner
from tests.sampling.helpers import NUM_BLOCKS, NUM_TIGHT_BLOCKS, make_engine, two_rounds_tokens


def _buffers(runner: ModelRunner, max_rows: int = 16) -> DecodeBuffers:
    return DecodeBuffers(
        max_rows=max_rows,
        max_model_len=runner.max_model_len,
        block_size=runner.block_size,
        pad_block=runner.pad_block,
        device=runner.device,
    )


def test_row_buckets_hold_every_batch_size() -> None:
    assert row_buckets(1) == (1,)
    assert row_buckets(3) == (1, 2, 3)
    assert row_buckets(4) == (1, 2, 4)
    assert row_buckets(5) == (1, 2, 4, 8)
    assert row_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert row_buckets(33) == (1, 2, 4, 8, 16, 24, 32, 40)


def test_buckets_pad_rows_and_keys(runner: ModelRunner) -> None:
    buffers = _buffers(runner)  # 16 tokens a block, 256 blocks
    assert buffers.bucket(3, 15, False) == buffers.bucket(4, 0, False)  # 4 rows, 1 block
    assert (buffers.bucket(5, 16, False).rows, buffers.bucket(5, 16, False).blocks) == (8, 2)
    assert buffers.bucket(9, 16 * 5, True).blocks == 8  # 6 blocks held: the next power of two
    assert buffers.bucket(1, runner.max_model_len - 1, False).blocks == 256
    with pytest.raises(ValueError, match="33 rows"):
        buffers.bucket(33, 0, False)


@torch.inference_mode()
def test_padding_rows_sit_in_the_pad_block_and_nothing_is_allocated_again(runner: ModelRunner) -> None:
    buffers = _buffers(runner)
    address = buffers.inputs.data_ptr()
    wide = buffers.load([5] * 7, [40] * 7, [[1, 2, 3]] * 7)  # 8 rows, 4 blocks
    assert (wide.rows, wide.blocks) == (8, 4)
    bucket = buffers.load(torch.tensor([7, 8, 9]), [3, 17, 33], [[4], [5, 6], [7, 8, 9]], [0, 0, 0])
    ids, batch = buffers.view(bucket)
    assert buffers.inputs.data_ptr() == address
    assert (bucket.rows, bucket.blocks, bucket.rope) == (4, 4, False)
    assert ids.tolist() == [7, 8, 9, 0]  # ids already on the device, the padding row's reset
    pad = runner.pad_block
    assert batch.positions[:, 0].tolist() == [3, 17, 33, 0]
    assert batch.slot_mapping.tolist() == [4 * 16 + 3, 6 * 16 + 1, 9 * 16 + 1, pad * 16]
    # the last row of the wider step before is the padding row now: its table is the pad block alone
    assert batch.key_slots[3].tolist() == [pad * 16 + i for i in range(16)] * 4
    assert batch.key_slots[0, 16:].tolist() == [pad * 16 + i for i in range(16)] * 3
    assert batch.key_valid.sum(1).tolist() == [4, 18, 34, 1]  # a row sees its keys up to its own position
    rope = buffers.load([1, 2], [10, 20], [[0], [1, 2]], [5, -3])
    assert buffers.view(rope)[1].rope_positions.tolist() == [[15, 17]] * 3


@torch.inference_mode()
def test_the_padded_step_gives_the_runner_s_logits(runner: ModelRunner) -> None:
    """Rows of different lengths, their tables scattered, at sizes that pad (3 -> 4, 5 -> 8) and not (8)."""
    buffers = _buffers(runner)
    gen = torch.Generator().manual_seed(0)
    for size in (3, 5, 8, 1):
        tables = [list(range(100 + 10 * row, 100 + 10 * row + 6))[::-1] for row in range(size)]
        positions = [7 + 9 * row for row in range(size)]
        for table, length in zip(tables, positions, strict=True):
            runner.prefill(torch.randint(20, 1000, (length,), generator=gen).tolist(), 0, table, None)
        ids = torch.randint(20, 1000, (size,), generator=gen).tolist()
        expected = runner.decode(ids, runner.decode_inputs(positions, tables))
        padded_ids, batch = buffers.view(buffers.load(ids, positions, tables))
        padded = runner.decode(padded_ids, batch)
        assert padded.shape[0] == buffers.bucket(size, max(positions), False).rows
        torch.testing.assert_close(padded[:size], expected, atol=1e-5, rtol=0)
        assert torch.equal(padded[:size].argmax(-1), expected.argmax(-1))


def _tokens(
    runner: ModelRunner, token_bytes: TokenBytes, tokenizer: Any, grammar: Any, **engine: Any
) -> dict[str, list[int]]:
    """Two rounds of the same requests in a cache too small for them all (preemptions), the second
    round on the first one's cached prefixes; every sequence's tokens (n = 2 forks included)."""
    built = make_engine(runner, token_bytes, num_blocks=NUM_TIGHT_BLOCKS, max_running=8, **engine)
    padded: list[int] = []  # rows of padding of each buffered step
    if built.parts.buffers is not None:
        load = built.parts.buffers.load

        def load_and_count(ids: Any, positions: list[int], *rest: Any) -> DecodeBucket:
            bucket = load(ids, positions, *rest)
            padded.append(bucket.rows - len(positions))
            return bucket

        built.parts.buffers.load = load_and_count  # type: ignore[method-assign]
    tokens = two_rounds_tokens(built, tokenizer, grammar, n=2)
    assert not engine.get("decode_buffers") or (len(padded) > 20 and max(padded) > 0)
    return tokens


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["synchronous", "one-step-ahead"])
def test_buffered_decode_gives_today_s_tokens(
    runner: ModelRunner, token_bytes: TokenBytes, hf_tokenizer: Any, json_grammar: Any, one_step_ahead: bool
) -> None:
    today = _tokens(runner, token_bytes, hf_tokenizer, json_grammar, one_step_ahead=one_step_ahead)
    buffered = _tokens(
        runner, token_bytes, hf_tokenizer, json_grammar, one_step_ahead=one_step_ahead, decode_buffers=True
    )
    assert buffered == today
    assert len(today) == 12 and all(today.values())


def test_an_engine_s_buffers_cover_its_batches(runner: ModelRunner, token_bytes: TokenBytes) -> None:
    engine = make_engine(runner, token_bytes, num_blocks=NUM_BLOCKS, max_running=5, decode_buffers=True)
    assert engine.parts.buffers is not None
    # 4 running and the last admitted forked into n = 16: 20 rows at most
    assert engine.max_rows == 20 and engine.parts.buffers.row_buckets == (1, 2, 4, 8, 16, 24)
    assert engine.parts.buffers.pad_block == runner.pad_block == NUM_BLOCKS
    assert make_engine(runner, token_bytes).parts.buffers is None


def test_the_step_s_inputs_are_device_work_alone() -> None:
    """On the meta device (shapes, no data) any read of a value by the host raises (``.item()``,
    ``.tolist()``, a tensor's truth): ``view`` runs there, so it reads none, and a captured step could
    run it on the device without a synchronisation."""
    buffers = DecodeBuffers(max_rows=8, max_model_len=256, block_size=16, pad_block=40, device=torch.device("meta"))
    bucket = buffers.load(torch.empty(3, dtype=torch.long, device="meta"), [5, 30, 70], [[1], [2, 3], [4, 5, 6, 7, 8]])
    ids, batch = buffers.view(bucket)
    assert (ids.shape, batch.key_slots.shape, batch.key_valid.shape) == ((4,), (4, 128), (4, 128))
    assert batch.slot_mapping.shape == (4,) and batch.positions.shape == (4, 1)
