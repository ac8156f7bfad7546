"""Tiny random-weight reasoning models with their authors' real chat templates.

``qwen3-thinking``: Qwen3's architecture and Qwen3-0.6B's hybrid template (the model opens its own
``<think>`` block; ``enable_thinking: false`` closes an empty one in the prompt). ``deepseek-r1``: the
Llama architecture with DeepSeek-R1-Distill-Llama-8B's template, whose generation prompt opens the
block. As in the released tokenizers, ``<think>``, ``</think>`` and the tool-call tags are added
tokens not marked special (their text is part of the output); the turn markers are special.
"""

from __future__ import annotations

from pathlib import Path

from tests.models.checkpoints import INIT_RANGE, SEED, _llama_config, _qwen3_config, build_tokenizer

__all__ = ["build_deepseek_r1", "build_qwen3_thinking", "real_template"]

_TEMPLATES = Path(__file__).parent.parent / "data" / "chat_templates"
_THINK_CORPUS = ("<think>\nLet me think about it. The answer is short.\n</think>\n\n",)


def real_template(name: str) -> str:
    return (_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def _build(
    folder: Path, model_class: str, make_config: object, specials: list[str], added: list[str], **kw: str
) -> Path:
    import torch
    import transformers
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(specials, extra_corpus=_THINK_CORPUS, **kw)  # type: ignore[arg-type]
    tokenizer.add_tokens(added)  # not special: their text is written, as in the released tokenizers
    ids = [tokenizer.convert_tokens_to_ids(s) for s in specials]
    config = make_config(ids)  # type: ignore[operator]
    torch.manual_seed(SEED)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, INIT_RANGE)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=[tokenizer.convert_tokens_to_ids(kw["eos"])]
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_qwen3_thinking(folder: Path) -> Path:
    return _build(
        folder,
        "Qwen3ForCausalLM",
        _qwen3_config,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        chat_template=real_template("Qwen-Qwen3-0.6B"),
        bos=None,  # type: ignore[arg-type]
        eos="<|im_end|>",
    )


def build_deepseek_r1(folder: Path) -> Path:
    return _build(
        folder,
        "LlamaForCausalLM",
        _llama_config({"rope_type": "default", "rope_theta": 10_000.0}),
        ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
        ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
        chat_template=real_template("deepseek-ai-DeepSeek-R1-Distill-Llama-8B"),
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
    )
