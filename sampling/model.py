"""A Mistral/Llama-family decoder over a paged KV cache, in plain torch.

Tokens of a step are flattened (``N`` rows); each query row attends to the keys of its own
sequence, gathered from the cache through that sequence's block table. The same forward serves a
prefill chunk (one sequence, ``N`` new tokens), several chunks of several sequences, and a decode
step (``B`` sequences, one token each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sampling.paged_attention import AttentionBatch, attend_tokens

__all__ = ["AttentionBatch", "LMConfig", "MistralLM", "stack_projections"]


@dataclass(frozen=True, slots=True)
class LMConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, text_config: Any) -> LMConfig:
        rope = getattr(text_config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
        head_dim = getattr(text_config, "head_dim", None)
        return cls(
            vocab_size=text_config.vocab_size,
            hidden_size=text_config.hidden_size,
            intermediate_size=text_config.intermediate_size,
            num_layers=text_config.num_hidden_layers,
            num_heads=text_config.num_attention_heads,
            num_kv_heads=text_config.num_key_value_heads,
            head_dim=head_dim or text_config.hidden_size // text_config.num_attention_heads,
            rms_norm_eps=text_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(text_config, "rope_theta", 10_000.0))),
            tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
        )


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in fp32, rounded to the input's dtype, then scaled: transformers' order
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Attention(nn.Module):
    """Q, K and V come out of one matrix product (the checkpoint's three weights stacked at load),
    and one RoPE pass rotates Q and K together: a decode step's cost on a GPU is its kernel launches."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,  # [N, 1, head_dim]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
        v_cache: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        rotated = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
        qk = qkv[:, :rotated].view(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        v = qkv[:, rotated:].view(n, cfg.num_kv_heads, cfg.head_dim)
        out = attend_tokens(q, k, v, k_cache, v_cache, batch)
        return self.o_proj(out.reshape(n, cfg.num_heads * cfg.head_dim))


class _MLP(nn.Module):
    """Gate and up projections as one matrix product (stacked at load)."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _Layer(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)


# the fused projections and the checkpoint's weights they stack, in order
_STACKED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def stack_projections(weights: dict[str, torch.Tensor], num_layers: int) -> None:
    """Replace, in ``weights``, the checkpoint's per-projection weights (Hugging Face names) by the fused
    ones. In place: each layer's parts are dropped as its stack is made, so a 7B model's host memory
    holds one extra layer's projections at a time, not a second copy of them all."""
    for i in range(num_layers):
        for fused, parts in _STACKED_PROJECTIONS.items():
            names = [f"layers.{i}.{part}.weight" for part in parts]
            if all(name in weights for name in names):
                weights[f"layers.{i}.{fused}.weight"] = torch.cat([weights.pop(name) for name in names])


class MistralLM(nn.Module):
    """Decoder-only language model; parameter names follow Hugging Face's Mistral/Llama layout."""

    def __init__(self, cfg: LMConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # on the CPU by name: the runner builds the parameters on the meta device, but these tables
        # are not in the checkpoint and must hold numbers
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device="cpu").float() / cfg.head_dim))
        freqs = torch.outer(torch.arange(max_positions, device="cpu").float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    def forward(
        self,
        embeds: torch.Tensor,  # [N, hidden] the step's tokens
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` after the final norm."""
        positions = batch.token_positions()
        cos = self.rope_cos[positions].unsqueeze(1).to(embeds.dtype)
        sin = self.rope_sin[positions].unsqueeze(1).to(embeds.dtype)
        h = embeds
        layers: list[_Layer] = list(self.layers)  # type: ignore[arg-type]
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, k_cache, v_cache, batch)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in fp32 (sampling and masking want full precision)."""
        return self.lm_head(hidden).float()
