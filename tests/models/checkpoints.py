"""Tiny random-weight checkpoints of the model families, built offline once per test session.

Each is a normal Hugging Face folder (config, safetensors, generation config, tokenizer with the
family's special tokens and chat template), written with transformers' own classes under a fixed
seed, so the code under test loads it as it loads a user's checkpoint. Hidden size 64, 2 layers,
a byte-level BPE vocabulary of a few hundred tokens: the suite stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FAMILIES",
    "Family",
    "build_family",
    "build_gemma3_vlm",
    "build_llava_clip",
    "build_mistral3",
    "build_tokenizer",
    "family_dirs",
]

SEED = 20
VOCAB_SIZE = 384  # the model's embedding rows; the tokenizer uses fewer (BPE trained below)
# weights larger than transformers' 0.02 default, so a missing feature moves the greedy tokens
INIT_RANGE = 0.2

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    '{"name": "value", "count": 42, "items": [1, 2, 3], "ok": true, "none": null}',
    "user assistant system tool function arguments name content role",
    "What is in this image? Describe the picture in one sentence, please.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def build_tokenizer(
    specials: list[str],
    *,
    chat_template: str,
    bos: str | None,
    eos: str,
    unk: str | None = None,
    pad: str | None = None,
    extra_corpus: tuple[str, ...] = (),
    extra_special_tokens: dict[str, str] | None = None,
) -> Any:
    """A byte-level BPE tokenizer (deterministic: trained on a fixed corpus) with ``specials`` first;
    ``extra_special_tokens`` names some of them as the family's processor reads them (``boi_token``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 16,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*_CORPUS, *extra_corpus] * 4, trainer=trainer)
    named = {"extra_special_tokens": extra_special_tokens} if extra_special_tokens else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad,
        chat_template=chat_template,
        **named,
    )


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# a message's text, whether its content is a string, parts or none
_TEXT = (
    "{% if m['content'] is string %}{% set text = m['content'] %}{% elif m['content'] %}"
    "{% set text = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% else %}{% set text = '' %}{% endif %}"
)

# Llama 3.1's template, shortened: tools in the first user message, one call per assistant turn
# as {"name": ..., "parameters": ...}, results under the ipython role
LLAMA31_TEMPLATE = (
    "{{ bos_token }}{% if tools %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython<|eot_id|>' }}{% endif %}"
    "{% for m in messages %}" + _TEXT + "{% if tools and loop.first and m['role'] == 'user' %}"
    "{{ '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON "
    "for a function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.'
    "\\n\\n' }}{% for t in tools %}{{ t | tojson(indent=4) }}{{ '\\n\\n' }}{% endfor %}{{ text + '<|eot_id|>' }}"
    "{% elif 'tool_calls' in m %}{% if m['tool_calls'] | length != 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
    "{% set call = m['tool_calls'][0]['function'] %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + call['name'] + '\", \"parameters\": ' }}"
    "{{ call['arguments'] | tojson }}{{ '}<|eot_id|>' }}"
    "{% elif m['role'] == 'tool' %}{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + text + '<|eot_id|>' }}"
    "{% else %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + text + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Qwen's ChatML template, shortened: tools in the system turn, each call in <tool_call> tags,
# results in <tool_response> tags inside a user turn
CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}" + _TEXT + "{% if m['role'] == 'system' and tools and loop.first %}"
    "{% elif m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' + text }}"
    "{% for c in m['tool_calls'] or [] %}{% if text or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' }}"
    "{% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}{{ '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + text + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + text + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] is string %}{% set text = m['content'] %}{% else %}"
    "{% set text = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST]' + text + '[/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ text + eos_token }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class Family:
    """How to build one family's tiny checkpoint."""

    name: str
    make_config: Callable[[list[int]], Any]  # special token ids → the transformers config
    model_class: str  # the transformers class that writes (and serves as reference for) it
    specials: list[str]
    chat_template: str
    bos: str | None
    eos: str  # the tokenizer's own eos token
    generation_eos: list[str]  # generation_config.json's eos_token_id (the turn ends)
    unk: str | None = None


def _text_dims() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "initializer_range": INIT_RANGE,
        "tie_word_embeddings": False,
    }


def _llama_config(rope: dict[str, Any]) -> Callable[[list[int]], Any]:
    def make(ids: list[int]) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(**_text_dims(), rope_parameters=rope, bos_token_id=ids[0], eos_token_id=ids[1])

    return make


def _qwen3_config(ids: list[int]) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        **_text_dims(),
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=None,
        eos_token_id=ids[2],
    )


def _mistral_config(ids: list[int]) -> Any:
    from transformers import MistralConfig

    return MistralConfig(
        **_text_dims(),
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        sliding_window=None,
        bos_token_id=ids[1],
        eos_token_id=ids[2],
    )


def _qwen2_config(ids: list[int]) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        **_text_dims(),
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=None,
        eos_token_id=ids[2],
    )


def _gemma_config(version: int) -> Callable[[list[int]], Any]:
    def make(ids: list[int]) -> Any:
        from transformers import Gemma2Config, Gemma3TextConfig

        extra: dict[str, Any] = {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0} if version == 2 else {}
        return (Gemma2Config if version == 2 else Gemma3TextConfig)(
            **_text_dims(),
            sliding_window=8,  # shorter than the test prompts: the sliding layer sees only its window
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            pad_token_id=ids[0],
            eos_token_id=ids[1],
            bos_token_id=ids[2],
            **extra,
        )

    return make


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
_GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]

_LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # short, so positions in a test span the scaled band
}

FAMILIES: dict[str, Family] = {
    # Llama 3.0: default RoPE; the tokenizer has no unk token and ends text with <|end_of_text|>
    "llama3.0": Family(
        "llama3.0",
        _llama_config({"rope_type": "default", "rope_theta": 500_000.0}),
        "LlamaForCausalLM",
        _LLAMA3_SPECIALS,
        LLAMA3_TEMPLATE,
        "<|begin_of_text|>",
        "<|end_of_text|>",
        ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
    ),
    "llama3.1": Family(
        "llama3.1",
        _llama_config(_LLAMA3_ROPE),
        "LlamaForCausalLM",
        _LLAMA3_SPECIALS,
        LLAMA31_TEMPLATE,
        "<|begin_of_text|>",
        "<|end_of_text|>",
        ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
    ),
    "qwen3": Family(
        "qwen3",
        _qwen3_config,
        "Qwen3ForCausalLM",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
        CHATML_TEMPLATE,
        None,
        "<|im_end|>",
        ["<|im_end|>", "<|endoftext|>"],
    ),
    # q/k/v projections with biases
    "qwen2": Family(
        "qwen2",
        _qwen2_config,
        "Qwen2ForCausalLM",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
        CHATML_TEMPLATE,
        None,
        "<|im_end|>",
        ["<|im_end|>", "<|endoftext|>"],
    ),
    # sliding-window layers, attention and final logit soft-capping, scaled embeddings
    "gemma2": Family(
        "gemma2",
        _gemma_config(2),
        "Gemma2ForCausalLM",
        _GEMMA_SPECIALS,
        GEMMA_TEMPLATE,
        "<bos>",
        "<eos>",
        ["<eos>", "<end_of_turn>"],
    ),
    # sliding-window layers with their own RoPE, qk-norm, scaled embeddings
    "gemma3": Family(
        "gemma3",
        _gemma_config(3),
        "Gemma3ForCausalLM",
        _GEMMA_SPECIALS,
        GEMMA_TEMPLATE,
        "<bos>",
        "<eos>",
        ["<eos>", "<end_of_turn>"],
    ),
    "mistral": Family(
        "mistral",
        _mistral_config,
        "MistralForCausalLM",
        ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]"],
        MISTRAL_TEMPLATE,
        "<s>",
        "</s>",
        ["</s>"],
        unk="<unk>",
    ),
}


def build_family(family: Family, folder: Path) -> Path:
    """Write ``family``'s tiny checkpoint into ``folder`` (seeded: the same bytes every time)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(
        family.specials, chat_template=family.chat_template, bos=family.bos, eos=family.eos, unk=family.unk
    )
    ids = [tokenizer.convert_tokens_to_ids(s) for s in family.specials]
    config = family.make_config(ids)
    torch.manual_seed(SEED)
    model = getattr(transformers, family.model_class)(config).eval()
    with torch.no_grad():  # transformers starts biases and norm offsets at zero: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, INIT_RANGE)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in family.generation_eos],
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def family_dirs(tmp_path_factory: Any) -> Callable[[str], Path]:
    """``get(name)``: the folder of family ``name``'s checkpoint, built on first use (the session
    fixture ``family_dir`` wraps this)."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            folder = tmp_path_factory.mktemp(name.replace(".", "_"))
            vlm = _VLM_BUILDERS.get(name)
            built[name] = vlm(folder) if vlm is not None else build_family(FAMILIES[name], folder)
        return built[name]

    return get


MISTRAL3_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "[TOOL_CALLS]"]
MISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '[INST]' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% elif p['type'] == 'image' %}{{ '[IMG]' }}{% endif %}"
    "{% endfor %}{% endif %}{{ '[/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)


def build_mistral3(folder: Path) -> Path:
    """Mistral 3: a Pixtral tower whose patches a merger joins 2 x 2 into one token, a Mistral
    decoder, and the Pixtral processor saved by ``processor.save_pretrained`` (processor_config.json)."""
    import torch
    from transformers import (
        GenerationConfig,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessor,
        PixtralProcessor,
        PixtralVisionConfig,
    )

    tokenizer = build_tokenizer(MISTRAL3_SPECIALS, chat_template=MISTRAL3_TEMPLATE, bos="<s>", eos="</s>", unk="<unk>")
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in MISTRAL3_SPECIALS}
    vision = PixtralVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        num_channels=3,
        image_size=256,
        patch_size=16,
        initializer_range=INIT_RANGE,
    )
    text = MistralConfig(**_text_dims(), sliding_window=None, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"])
    config = Mistral3Config(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["[IMG]"],
        spatial_merge_size=2,
        vision_feature_layer=-1,
        multimodal_projector_bias=False,
    )
    torch.manual_seed(SEED)
    model = Mistral3ForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=ids["<s>"], eos_token_id=[ids["</s>"]])
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    image_processor = PixtralImageProcessor(size={"longest_edge": 256}, patch_size={"height": 16, "width": 16})
    PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=16,
        spatial_merge_size=2,
        image_token="[IMG]",
        image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]",
    ).save_pretrained(folder)
    return folder


LLAVA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'].upper() + ': ' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% elif p['type'] == 'image' %}{{ '<image>\\n' }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def build_llava_clip(folder: Path) -> Path:
    """Llava 1.5: a CLIP tower (CLS dropped: one ``<image>`` token per patch), a two-layer projector,
    a Llama decoder, and the Llava processor over CLIP's fixed-size image processor."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    specials = ["<unk>", "<s>", "</s>", "<image>"]
    tokenizer = build_tokenizer(specials, chat_template=LLAVA_TEMPLATE, bos="<s>", eos="</s>", unk="<unk>")
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in specials}
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        projection_dim=64,
        initializer_range=INIT_RANGE,
    )
    text = LlamaConfig(
        **_text_dims(),
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["<image>"],
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
    )
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=ids["<s>"], eos_token_id=[ids["</s>"]])
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
    ).save_pretrained(folder)
    return folder


# Gemma 3's template, shortened: an image part is <start_of_image>, which the processor expands
GEMMA3_VLM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}{{ '<start_of_image>' }}{% elif p['type'] == 'text' %}{{ p['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
GEMMA3_VLM_SPECIALS = [*_GEMMA_SPECIALS, "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA3_MM_TOKENS = 16  # per image: the tower's 8 x 8 patches average-pooled 2 x 2


def build_gemma3_vlm(folder: Path) -> Path:
    """Gemma 3: a SigLIP tower whose patches the projector average-pools to 16 tokens per image, a
    Gemma 3 decoder with a sliding-window layer, and the Gemma 3 processor (fixed size, no pan and
    scan). Its tokenizer merges runs of newlines, as Gemma's does, so the processor's "\\n\\n" around
    each image joins the template's newline before it."""
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        GenerationConfig,
        SiglipVisionConfig,
    )

    tokenizer = build_tokenizer(
        GEMMA3_VLM_SPECIALS,
        chat_template=GEMMA3_VLM_TEMPLATE,
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        extra_corpus=("one\n\n", "two\n\n\n", "\n\n\n\n") * 4,
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in GEMMA3_VLM_SPECIALS}
    text = _gemma_config(3)([ids["<pad>"], ids["<eos>"], ids["<bos>"]])
    vision = SiglipVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=64,
        patch_size=8,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=GEMMA3_MM_TOKENS,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,  # tied, the tiny model repeats its last token
    )
    torch.manual_seed(SEED)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the projector starts at zero: images would not matter
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, INIT_RANGE)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<bos>"], eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]], pad_token_id=ids["<pad>"]
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    image_processor = Gemma3ImageProcessor(size={"height": 64, "width": 64}, do_pan_and_scan=False)
    Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=GEMMA3_VLM_TEMPLATE,
        image_seq_length=GEMMA3_MM_TOKENS,
    ).save_pretrained(folder)
    return folder


def _build_qwen_vl(version: str) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        from tests.models import qwen_vl_checkpoints as qwen  # it builds on this module's tokenizer

        return qwen.build_qwen2_5_vl(folder) if version == "2.5" else qwen.build_qwen3_vl(folder)

    return build


_VLM_BUILDERS = {
    "mistral3": build_mistral3,
    "llava-clip": build_llava_clip,
    "gemma3-vlm": build_gemma3_vlm,
    "qwen2.5-vl": _build_qwen_vl("2.5"),
    "qwen3-vl": _build_qwen_vl("3"),
    "qwen3-thinking": lambda folder: _reasoning().build_qwen3_thinking(folder),
    "deepseek-r1": lambda folder: _reasoning().build_deepseek_r1(folder),
}


def _reasoning() -> Any:
    from tests.models import reasoning_checkpoints  # imports this module: loaded on first use

    return reasoning_checkpoints
