"""The hand-written decoder's runner: loads the language model from a checkpoint and runs prefill
chunks and batched decode steps over the paged KV cache (sampling/paged_runner.py)."""

from __future__ import annotations

import torch

from sampling.model import AttentionBatch, LMConfig, MistralLM, stack_projections
from sampling.paged_runner import ModelShape, PagedRunner, PrefillChunk
from vision.checkpoint import Checkpoint

__all__ = ["ModelRunner"]

# Where a Hugging Face checkpoint keeps the decoder: Llava-style VLMs, then plain causal LMs.
_BODY_PREFIXES = ("language_model.model.", "model.language_model.", "model.")
_HEAD_PREFIXES = ("language_model.lm_head.", "lm_head.")


class ModelRunner(PagedRunner):
    """Owns the weights and the KV cache; every call is synchronous and runs on ``device``."""

    model: MistralLM

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        device: str,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(checkpoint, device=device, max_model_len=max_model_len, block_size=block_size, dtype=dtype)
        self.lm_config = lm = LMConfig.from_hf(checkpoint.text_config)
        self.cfg = ModelShape(lm.vocab_size, lm.hidden_size, lm.num_layers, lm.num_kv_heads, lm.head_dim)
        # parameters without storage: the checkpoint's tensors are assigned in, so a 7B model is not
        # first drawn at random in fp32 on the host (32 GB, a minute) only to be overwritten
        with torch.device("meta"):
            self.model = MistralLM(lm, max_model_len)
        self._load(checkpoint)
        self.embed_tokens = self.model.embed_tokens
        self.model.to(self.device, self.dtype).eval()
        self._allocate(num_blocks)

    def _load(self, checkpoint: Checkpoint) -> None:
        weights = checkpoint.load_weights(_BODY_PREFIXES)
        weights = {k: v for k, v in weights.items() if not k.startswith(("vision_tower", "multi_modal"))}
        head = checkpoint.load_weights(_HEAD_PREFIXES)
        if "weight" in head:
            weights["lm_head.weight"] = head["weight"]
        elif self.lm_config.tie_word_embeddings:
            weights["lm_head.weight"] = weights["embed_tokens.weight"]
        stack_projections(weights, self.lm_config.num_layers)
        missing, unexpected = self.model.load_state_dict(weights, strict=False, assign=True)
        unexpected = [u for u in unexpected if "rotary_emb" not in u]
        if missing or unexpected:
            raise ValueError(f"language model weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: list[int],
        start: int,
        block_table: list[int],
        image_rows: torch.Tensor | None,
        *,
        num_prompt_tokens: int | None = None,
    ) -> torch.Tensor:
        """``num_prompt_tokens``: how many of ``token_ids`` are the prompt's (see ``image_mask``)."""
        batch = self.prefill_inputs(start, start + len(token_ids), block_table)
        ids = torch.tensor(token_ids, device=self.device)
        embeds = self._embed(ids, image_rows, self.chunk_image_mask(ids, num_prompt_tokens, image_rows))
        hidden = self.model(embeds, batch, self.kv_caches)
        return self.model.compute_logits(hidden[-1:])

    @torch.inference_mode()
    def prefill_batch(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        batch, ids, is_image, last = self.batch_prefill_inputs(chunks)
        rows = [c.image_rows for c in chunks if c.image_rows is not None and c.image_rows.numel()]
        embeds = self._embed(ids, torch.cat(rows) if rows else None, is_image)
        hidden = self.model(embeds, batch, self.kv_caches)
        return self.model.compute_logits(hidden[last])

    def decode_forward(self, ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        hidden = self.model(self.embed_tokens(ids), batch, self.kv_caches)
        return self.model.compute_logits(hidden)
