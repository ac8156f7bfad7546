"""Several sequences' prefill chunks in one forward for the families with more than token ids: M-RoPE
positions and DeepStack rows (Qwen2.5-VL, Qwen3-VL), image spans that attend bidirectionally
(Gemma 3). Each chunk's logits within 1e-4 of transformers' own, as a lone chunk's are."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sampling.families import build_runner
from sampling.hf_adapter import HFModelRunner
from sampling.paged_runner import PrefillChunk
from tests.models import test_gemma3_vlm as gemma3
from tests.models import test_mrope_families as mrope
from tests.models.test_text_families import TEXT_FAMILIES
from vision.checkpoint import Checkpoint

FamilyDir = Callable[[str], Path]
ATOL = 1e-4


def _chunk(case: mrope.Case, start: int, end: int, token: int, table: list[int]) -> PrefillChunk:
    inputs = mrope._chunk_inputs(case, start, end, token)
    return PrefillChunk(
        case.ids[start:end],
        start,
        table,
        inputs["image_rows"],
        rope_positions=inputs["rope_positions"],
        extra_inputs=inputs["extra_inputs"],
    )


@pytest.mark.parametrize("family", mrope.FAMILIES)
def test_mrope_chunks_share_a_forward(family: str, family_dir: FamilyDir) -> None:
    """The rest of an image prompt after a chunk cut inside its first image, a text prompt at 1-D
    positions, and the whole image prompt again: one forward, each row its own logits."""
    folder = family_dir(family)
    reference = mrope._reference(folder)
    case = mrope._case(folder, "Describe the quick brown fox.", [(96, 64, 1), (40, 80, 2)])
    token = int(Checkpoint(folder).image_token_id or 0)
    cut = [i for i, t in enumerate(case.ids) if t == token][2]
    expected = mrope._reference_logits(reference, case, [])
    text = [int(t) for t in torch.randint(10, 300, (13,), generator=torch.Generator().manual_seed(2))]
    with torch.inference_mode():
        text_expected = reference(input_ids=torch.tensor([text])).logits[0].float()
    runner = HFModelRunner(Checkpoint(folder), device="cpu", max_model_len=512, num_blocks=32, block_size=16)
    length = len(case.ids)
    runner.prefill(case.ids[:cut], 0, [5, 9, 3, 11], **mrope._chunk_inputs(case, 0, cut, token))
    logits = runner.prefill_batch(
        [
            _chunk(case, cut, length, token, [5, 9, 3, 11]),
            PrefillChunk(text, 0, [7], None),
            _chunk(case, 0, length, token, [12, 13, 14, 15]),
        ]
    )
    torch.testing.assert_close(logits[0], expected[length - 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], text_expected[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[2], expected[length - 1], atol=ATOL, rtol=0)


def test_gemma3_image_spans_of_several_chunks_share_a_forward(family_dir: FamilyDir) -> None:
    """Two image prompts whole, each image attending within itself in its own row; then a prefix-cache
    hit after the first prompt's image beside a text prompt."""
    folder = family_dir("gemma3-vlm")
    reference = mrope._reference(folder)  # AutoModelForImageTextToText, as for Gemma 3's own tests
    checkpoint = Checkpoint(folder)
    image = checkpoint.image_token_id
    runner = build_runner(
        checkpoint, impl="transformers", device="cpu", max_model_len=256, num_blocks=32, block_size=16
    )
    first, second = gemma3._inputs(folder, *gemma3.PROMPTS[0]), gemma3._inputs(folder, *gemma3.PROMPTS[3])
    ids = [first["input_ids"][0].tolist(), second["input_ids"][0].tolist()]
    rows = [gemma3._embeds(checkpoint, gemma3.PROMPTS[0][1])[0], gemma3._embeds(checkpoint, gemma3.PROMPTS[3][1])[0]]
    with torch.inference_mode():
        expected = [
            reference(
                input_ids=torch.tensor([ids[i]]),
                pixel_values=inputs["pixel_values"],
                token_type_ids=inputs["token_type_ids"],
            ).logits[0, -1]
            for i, inputs in enumerate((first, second))
        ]
    logits = runner.prefill_batch(
        [PrefillChunk(ids[0], 0, [5, 9, 3, 12], rows[0]), PrefillChunk(ids[1], 0, [7, 1, 11], rows[1])]
    )
    for row in range(2):
        torch.testing.assert_close(logits[row], expected[row], atol=ATOL, rtol=0)
    third = ids[0][:32] + [60, 61, 62, 63]
    text = [2, 40, 41, 42, 43, 44, 45]
    logits = runner.prefill_batch([PrefillChunk(text, 0, [21], None), PrefillChunk(third[32:], 32, [5, 9, 20], None)])
    with torch.inference_mode():
        want = reference(
            input_ids=torch.tensor([third]),
            pixel_values=first["pixel_values"][:1],
            token_type_ids=torch.tensor([[int(t == image) for t in third]]),
        ).logits[0, -1]
        text_want = reference(input_ids=torch.tensor([text])).logits[0, -1]
    torch.testing.assert_close(logits[0], text_want, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_decodes_and_a_chunk_share_a_forward(family: str, family_dir: FamilyDir) -> None:
    """A mixed step (two decodes as one-token chunks beside a prefill chunk) gives the logits of the
    decode step and of the lone chunk, within 1e-4, for every text family (sliding windows, soft-caps)."""
    runner = build_runner(
        Checkpoint(family_dir(family)),
        impl="transformers",
        device="cpu",
        max_model_len=256,
        num_blocks=32,
        block_size=16,
    )
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(10, 300, (n,), generator=gen).tolist() for n in (21, 9, 14)]
    tables = [[3, 4], [5], [6], [13, 14], [15], [16]]  # each sequence twice: alone, then mixed
    for i in range(2):
        runner.prefill(seqs[i][:-1], 0, tables[i], None)
        runner.prefill(seqs[i][:-1], 0, tables[i + 3], None)
    positions = [len(seqs[0]) - 1, len(seqs[1]) - 1]
    decoded = runner.decode([seqs[0][-1], seqs[1][-1]], runner.decode_inputs(positions, tables[:2]))
    alone = runner.prefill(seqs[2], 0, tables[2], None)
    mixed = runner.prefill_batch(
        [
            PrefillChunk([seqs[0][-1]], positions[0], tables[3], None),
            PrefillChunk([seqs[1][-1]], positions[1], tables[4], None),
            PrefillChunk(seqs[2], 0, tables[5], None),
        ]
    )
    torch.testing.assert_close(mixed[:2], decoded, atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[2], alone[0], atol=ATOL, rtol=0)
