"""A prefill chunk without image rows builds no image mask, and both kinds of chunk give the logits
they gave when every chunk built one, with either model runner."""

from __future__ import annotations

import pytest
import torch

from sampling.hf_adapter import HFModelRunner
from sampling.model_runner import ModelRunner
from sampling.paged_runner import PagedRunner
from tests.sampling.helpers import NUM_BLOCKS
from vision.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def hf_runner(checkpoint: Checkpoint) -> HFModelRunner:
    return HFModelRunner(checkpoint, device="cpu", max_model_len=4096, num_blocks=NUM_BLOCKS, block_size=16)


def prefill_both_ways(
    model: PagedRunner, ids: list[int], rows: torch.Tensor | None, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The chunk's logits as prefilled now, then with a mask built for every chunk (as before), and
    how many masks the first prefill built."""
    table = [3, 8]
    built = 0
    image_mask = model.image_mask

    def counted(token_ids: torch.Tensor, num_prompt_tokens: int | None) -> torch.Tensor:
        nonlocal built
        built += 1
        return image_mask(token_ids, num_prompt_tokens)

    with monkeypatch.context() as patch:
        patch.setattr(model, "image_mask", counted)
        now = model.prefill(ids, 0, table, rows, num_prompt_tokens=len(ids))
    with monkeypatch.context() as patch:
        patch.setattr(model, "chunk_image_mask", lambda token_ids, num_prompt, _rows: image_mask(token_ids, num_prompt))
        always = model.prefill(ids, 0, table, rows, num_prompt_tokens=len(ids))
    return now, always, built


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_text_and_image_chunks_give_the_same_logits_and_only_image_chunks_build_a_mask(
    impl: str, runner: ModelRunner, hf_runner: HFModelRunner, checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = runner if impl == "native" else hf_runner
    img = checkpoint.image_token_id
    assert img is not None
    text = torch.randint(20, 131_072, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    now, always, built = prefill_both_ways(model, text, None, monkeypatch)
    assert built == 0 and torch.equal(now, always)
    with_image = [*text[:5], img, img, img, *text[5:]]
    rows = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    now, always, built = prefill_both_ways(model, with_image, rows, monkeypatch)
    assert built == 1 and torch.equal(now, always)
    text_now, _, _ = prefill_both_ways(model, [*text[:5], 1, 1, 1, *text[5:]], None, monkeypatch)
    assert not torch.equal(now, text_now)  # the image rows were placed
