"""The model adapter: the checkpoint's own transformers class, run over our paged KV cache.

The model is loaded with ``AutoModelForImageTextToText`` (a checkpoint with a vision config) or
``AutoModelForCausalLM``, and its language model's attention is switched to the paged attention
registered with transformers' ``AttentionInterface`` (sampling/paged_attention.py). A step runs as
one flattened row of tokens with our positions; every RoPE variant, qk-norm, bias, soft-capping and
sliding window comes from the model's own code. The vision tower keeps transformers' attention.
"""

from __future__ import annotations

from typing import Any

import torch

from sampling.paged_attention import AttentionBatch, PagedStep, image_span_ids, register_paged_attention
from sampling.paged_runner import ModelShape, PagedRunner, PrefillChunk
from vision.checkpoint import Checkpoint

__all__ = ["HFModelRunner", "UnsupportedModel", "load_hf_model"]


class UnsupportedModel(ValueError):
    """The checkpoint cannot run through the adapter (the message names the architecture and why)."""


def _architecture(checkpoint: Checkpoint) -> str:
    names = getattr(checkpoint.config, "architectures", None) or [type(checkpoint.config).__name__]
    return str(names[0])


def load_hf_model(checkpoint: Checkpoint, *, device: torch.device, dtype: torch.dtype) -> Any:
    """The checkpoint's transformers model, its language model on the paged attention.

    :raises UnsupportedModel: transformers has no class for it, or its attention does not go through
        the ``AttentionInterface``.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    arch = _architecture(checkpoint)
    auto = AutoModelForImageTextToText if checkpoint.vision_config is not None else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(checkpoint.path, dtype=dtype)
    except ValueError as exc:  # an unknown configuration class for this auto class
        raise UnsupportedModel(f"architecture {arch}: transformers has no {auto.__name__} for it ({exc})") from None
    name = register_paged_attention()
    text_config = checkpoint_text_config(model)
    target: str | dict[str, str] = {"text_config": name} if text_config is not model.config else name
    model.set_attn_implementation(target)
    if text_config._attn_implementation != name:
        raise UnsupportedModel(
            f"architecture {arch}: its attention does not go through transformers' AttentionInterface, "
            "so the paged KV cache cannot be plugged into it"
        )
    return model.to(device).eval()  # type: ignore[arg-type]


def checkpoint_text_config(model: Any) -> Any:
    """The language model's config inside ``model``'s (itself for a causal LM)."""
    return getattr(model.config, "text_config", None) or model.config


class HFModelRunner(PagedRunner):
    """Owns the transformers model and the KV cache; every call is synchronous and runs on ``device``."""

    model: Any  # transformers' model class of the checkpoint (load_hf_model)

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
        self.model = load_hf_model(checkpoint, device=self.device, dtype=self.dtype)
        text = checkpoint_text_config(self.model)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.cfg = ModelShape(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
        )
        self.embed_tokens = self.model.get_input_embeddings()
        # the language model alone, then its head: the VLM's wrappers around it cost ~0.5 ms of
        # Python a step and only route to it when there are no pixels
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.final_softcap: float | None = getattr(text, "final_logit_softcapping", None)
        self._allocate(num_blocks)

    def _forward(
        self, embeds: torch.Tensor, batch: AttentionBatch, logits_to_keep: int | torch.Tensor, **inputs: Any
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` in fp32 of the last ``logits_to_keep`` rows (0: all; a tensor: those
        rows) of ``embeds`` ``[N, hidden]``, the step's tokens as one row at the positions of ``batch``
        (``inputs``: more of the language model's inputs)."""
        # position_ids: [1, N], or M-RoPE's [3, 1, N] (the text model expands [1, N] to three equal rows)
        rope = batch.rope_positions
        out = self.decoder(
            inputs_embeds=embeds[None],
            position_ids=rope[:, None] if rope is not None else batch.token_positions()[None],
            use_cache=False,
            paged_step=PagedStep(batch, self.kv_caches),
            **inputs,
        )
        hidden = out.last_hidden_state[0]
        hidden = hidden[logits_to_keep] if isinstance(logits_to_keep, torch.Tensor) else hidden[-logits_to_keep:]
        logits = self.lm_head(hidden).float()
        if self.final_softcap is not None:  # Gemma 2/3: as their ForCausalLM heads do
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: list[int],
        start: int,
        block_table: list[int],
        image_rows: torch.Tensor | None,
        rope_positions: torch.Tensor | None = None,
        extra_inputs: dict[str, torch.Tensor] | None = None,
        *,
        num_prompt_tokens: int | None = None,
    ) -> torch.Tensor:
        """``rope_positions``: the chunk's M-RoPE positions ``[3, len(token_ids)]``; ``extra_inputs``:
        per-image-token inputs of the chunk (the registry's ``extra_prefill_inputs``);
        ``num_prompt_tokens``: how many of ``token_ids`` are the prompt's (see ``image_mask``)."""
        batch = self.prefill_inputs(start, start + len(token_ids), block_table)
        if rope_positions is not None:
            batch.rope_positions = rope_positions.to(self.device)
        ids = torch.tensor(token_ids, device=self.device)
        is_image = self.chunk_image_mask(ids, num_prompt_tokens, image_rows)  # None: no image rows
        if self.atomic_image_spans and self.image_token_id is not None and is_image is not None:
            batch.image_spans = image_span_ids(is_image, start)
        inputs = self._extra_inputs(is_image, extra_inputs or {})
        return self._forward(self._embed(ids, image_rows, is_image), batch, 1, **inputs)

    @torch.inference_mode()
    def prefill_batch(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        batch, ids, is_image, last = self.batch_prefill_inputs(chunks)
        rows = [c.image_rows for c in chunks if c.image_rows is not None and c.image_rows.numel()]
        names = {name for c in chunks for name in c.extra_inputs}
        extra = {name: torch.cat([c.extra_inputs[name] for c in chunks if name in c.extra_inputs]) for name in names}
        inputs = self._extra_inputs(is_image, extra)
        return self._forward(self._embed(ids, torch.cat(rows) if rows else None, is_image), batch, last, **inputs)

    def _extra_inputs(self, is_image: torch.Tensor | None, extra: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The language model's keyword inputs for the chunk's per-image-token rows."""
        deepstack = extra.get("deepstack_visual_embeds")
        if deepstack is None or not deepstack.numel() or self.image_token_id is None or is_image is None:
            return {}
        # Qwen3-VL: rows [image tokens, layers, hidden] -> one [image tokens, hidden] per decoder layer,
        # added to the hidden states at the image tokens (visual_pos_masks [1, N]) after that layer
        rows = deepstack.to(self.device, self.dtype)
        return {
            "visual_pos_masks": is_image[None],
            "deepstack_visual_embeds": list(rows.unbind(1)),
        }

    def decode_forward(self, ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        return self._forward(self.embed_tokens(ids), batch, 0)
