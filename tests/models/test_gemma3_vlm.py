"""Gemma 3 with images through the adapter: the prompt Gemma3Processor builds, logits within 1e-4 of
transformers' own (which let image tokens attend bidirectionally within their image) through prefill
chunks that never split an image, a decode batch of different lengths and a prefix-cache hit; greedy
answers equal to ``generate`` under preemption with replay, prefix-cache hits and ``n = 3``; a
guided answer about an image that validates."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
import torch

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.engine.factory import build_llm_engine
from pipeline.errors import InvalidRequest
from pipeline.protocol.request import parse_chat_request
from sampling.engine import LLMEngine
from sampling.families import build_runner
from sampling.image_spans import chunk_end, span_around
from sampling.inputs import EngineInput, ImageKey
from sampling.kv_cache import blocks_needed
from sampling.params import SamplingParams
from sampling.scheduler import PrefillStep, Schedule
from stages.template import TemplateStage
from tests.images import data_url, encode, image_request, make_image
from tests.models.checkpoints import GEMMA3_MM_TOKENS
from tests.sampling.helpers import run_all
from vision.checkpoint import Checkpoint
from vision.encoder import VisionEncoder
from vision.image_text import ImageText
from vision.preprocess import ImageTokenIds, PreparedImage, preprocess_image

FamilyDir = Callable[[str], Path]
ATOL = 1e-4
MAX_TOKENS = 12
CHUNK = 10  # shorter than an image's 16 tokens: every image is cut, or goes alone in its chunk
IMAGES = [make_image(96, 64, seed=1), make_image(40, 80, seed=2), make_image(64, 64, seed=3)]
# (content parts, images): two images after text, one before, text alone, one image between texts
PROMPTS: list[tuple[list[dict[str, Any]], list[int]]] = [
    ([{"type": "text", "text": "Describe."}, {"type": "image"}, {"type": "image"}], [0, 1]),
    ([{"type": "image"}, {"type": "text", "text": "What is in this image?"}], [2]),
    ([{"type": "text", "text": "The quick brown fox jumps over the lazy dog."}], []),
    ([{"type": "text", "text": "Hello"}, {"type": "image"}, {"type": "text", "text": "world! How are you?"}], [1]),
]


@pytest.fixture(scope="module")
def folder(family_dir: FamilyDir) -> Path:
    return family_dir("gemma3-vlm")


@pytest.fixture(scope="module")
def reference(folder: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder).eval()


def _inputs(folder: Path, parts: list[dict[str, Any]], images: list[int]) -> Any:
    """What the checkpoint's own processor makes of a user turn (ids, pixels, token_type_ids)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    return processor(text=text, images=[IMAGES[i] for i in images] or None, return_tensors="pt")


def _embeds(checkpoint: Checkpoint, images: list[int]) -> tuple[torch.Tensor | None, list[ImageKey]]:
    """Our preparation's image rows (processor + encoder) and their content keys."""
    if not images:
        return None, []
    encoder = VisionEncoder(checkpoint)
    rows = [encoder.encode([preprocess_image(checkpoint.image_processor, IMAGES[i])])[0] for i in images]
    return torch.cat(rows), [ImageKey(f"image-{i}", GEMMA3_MM_TOKENS) for i in images]


def test_the_prompt_is_the_processors_own(folder: Path) -> None:
    """The placeholders expand in text, as Gemma3Processor does: the newlines around an image merge
    with the template's (one token for "\\n\\n\\n" before a leading image, "\\n\\n\\n\\n" between two)."""
    checkpoint = Checkpoint(folder)
    tokenizer = checkpoint.tokenizer
    layout = ImageText.from_checkpoint(checkpoint.config, tokenizer)
    assert layout is not None and layout.num_tokens == GEMMA3_MM_TOKENS
    stage = TemplateStage(
        tokenizer,
        ImageTokenIds.from_tokenizer(tokenizer, checkpoint.image_token_id),
        max_prompt_tokens=400,
        threads=1,
        image_text=layout,
    )
    grid = PreparedImage(None, (1, 4, 4))
    merged = {t: tokenizer.convert_tokens_to_ids(t) for t in ("ĊĊĊ", "ĊĊĊĊ")}
    for parts, images in PROMPTS:
        expected = _inputs(folder, parts, images)["input_ids"][0].tolist()
        content = [{"type": "image_url", "image_url": {"url": "data:,"}} if p["type"] == "image" else p for p in parts]
        request = parse_chat_request({"messages": [{"role": "user", "content": content}]})
        assert stage.render(request.messages, [grid] * len(images)) == expected
    two = _inputs(folder, *PROMPTS[0])["input_ids"][0].tolist()
    lead = _inputs(folder, *PROMPTS[1])["input_ids"][0].tolist()
    assert merged["ĊĊĊĊ"] in two and merged["ĊĊĊ"] in lead  # what an expansion in token ids would miss
    # a prompt of ids expands its <start_of_image> ids; text that writes a placeholder without an image is refused
    boi = tokenizer.convert_tokens_to_ids("<start_of_image>")
    ids = stage.render((), [grid], prompt=[40, boi, 41])
    assert ids == [40, *tokenizer.encode(layout.expansion, add_special_tokens=False), 41]
    with pytest.raises(InvalidRequest, match="placeholders do not match"):
        stage.render((), [], prompt="look: <start_of_image>")
    with pytest.raises(InvalidRequest, match="may not contain image tokens"):
        stage.render((), [grid], prompt="look: <start_of_image><image_soft_token>")


def test_typed_image_markers_are_text_and_only_images_expand(folder: Path) -> None:
    """A client's ``<start_of_image>`` and ``<image_soft_token>`` are text: the prompt holds the image's
    tokens and the template's markers only, as for the same turn without that text."""
    checkpoint = Checkpoint(folder)
    tokenizer = checkpoint.tokenizer
    layout = ImageText.from_checkpoint(checkpoint.config, tokenizer)
    image_ids = ImageTokenIds.from_tokenizer(tokenizer, checkpoint.image_token_id)
    grid = PreparedImage(None, (1, 4, 4))
    specials = {
        tokenizer.convert_tokens_to_ids(t.content) for t in tokenizer.added_tokens_decoder.values() if t.special
    }

    def prompt(text: str, *, sanitize: bool = True) -> list[int]:
        stage = TemplateStage(
            tokenizer, image_ids, max_prompt_tokens=400, threads=1, image_text=layout, sanitize_control_tokens=sanitize
        )
        parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": "data:,"}}]
        return stage.render(parse_chat_request({"messages": [{"role": "user", "content": parts}]}).messages, [grid])

    typed, clean = prompt("typed <start_of_image> and <image_soft_token>"), prompt("typed")
    assert [i for i in typed if i in specials] == [i for i in clean if i in specials]
    assert typed.count(checkpoint.image_token_id) == GEMMA3_MM_TOKENS
    with pytest.raises(InvalidRequest, match="placeholders do not match"):
        prompt("typed <start_of_image>", sanitize=False)


def test_the_turn_ends_at_end_of_turn(folder: Path) -> None:
    checkpoint = Checkpoint(folder)
    end_of_turn = checkpoint.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in checkpoint.stop_token_ids
    assert end_of_turn in checkpoint.tokenizer_info.stop_token_ids


def test_logits_match_transformers(folder: Path, reference: Any) -> None:
    """Chunks cut before an image or holding one alone, a decode batch of different lengths, and a
    prefix-cache hit, each against transformers' forward with the processor's token_type_ids."""
    checkpoint = Checkpoint(folder)
    image = checkpoint.image_token_id
    assert image is not None
    runner = build_runner(
        checkpoint, impl="transformers", device="cpu", max_model_len=256, num_blocks=32, block_size=16
    )
    assert runner.atomic_image_spans
    first, second = _inputs(folder, *PROMPTS[0]), _inputs(folder, *PROMPTS[3])
    ids = [first["input_ids"][0].tolist(), second["input_ids"][0].tolist()]
    rows = [_embeds(checkpoint, PROMPTS[0][1])[0], _embeds(checkpoint, PROMPTS[3][1])[0]]
    assert rows[0] is not None and rows[1] is not None
    tail = [[40, 41, 42, 43, 44], [50, 51, 52, 53, 54]]  # decoded after each prompt
    with torch.inference_mode():
        expected = [
            reference(
                input_ids=torch.tensor([ids[i] + tail[i]]),
                pixel_values=inputs["pixel_values"],
                token_type_ids=torch.nn.functional.pad(inputs["token_type_ids"], (0, len(tail[i]))),
            ).logits[0]
            for i, inputs in enumerate((first, second))
        ]
    tables = [[5, 9, 3, 12], [7, 1, 11]]
    chunks, start = [], 0
    while start < len(ids[0]):
        end = chunk_end(ids[0], image, start, min(len(ids[0]), start + CHUNK))
        before = ids[0][:start].count(image)
        chunk_rows = rows[0][before : before + ids[0][start:end].count(image)]
        logits = runner.prefill(ids[0][start:end], start, tables[0], chunk_rows)
        torch.testing.assert_close(logits[0], expected[0][end - 1], atol=ATOL, rtol=0)
        chunks.append((start, end))
        start = end
    assert any(end - start > CHUNK for start, end in chunks)  # an image alone in its chunk
    assert not any(span_around(ids[0], image, end) for _, end in chunks)
    runner.prefill(ids[1], 0, tables[1], rows[1])
    lengths = [len(ids[0]), len(ids[1])]
    for step in range(len(tail[0])):
        positions = [n + step for n in lengths]
        logits = runner.decode([t[step] for t in tail], runner.decode_inputs(positions, tables))
        for row in range(2):
            torch.testing.assert_close(logits[row], expected[row][positions[row]], atol=ATOL, rtol=0)
    # the first prompt's first two blocks (text, then the first image) under another tail
    third = ids[0][:32] + [60, 61, 62, 63]
    assert span_around(third, image, 32) is None and third[:32].count(image) == GEMMA3_MM_TOKENS
    logits = runner.prefill(third[32:], 32, [5, 9, 20], None)
    with torch.inference_mode():
        want = reference(
            input_ids=torch.tensor([third]),
            pixel_values=first["pixel_values"][:1],
            token_type_ids=torch.tensor([[int(t == image) for t in third]]),
        ).logits[0, -1]
    torch.testing.assert_close(logits[0], want, atol=ATOL, rtol=0)


def _greedy(folder: Path, reference: Any, parts: list[dict[str, Any]], images: list[int]) -> list[int]:
    """transformers' greedy answer with the stop tokens banned (the engine's requests ignore EOS)."""
    inputs = _inputs(folder, parts, images)
    with torch.inference_mode():
        out = reference.generate(
            **inputs,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            suppress_tokens=list(Checkpoint(folder).stop_token_ids),
        )
    return list(out[0, inputs["input_ids"].shape[1] :].tolist())


def test_answers_would_differ_without_bidirectional_images(folder: Path, reference: Any) -> None:
    """The tiny weights are strong enough that a causal mask over the images would show."""
    inputs = _inputs(folder, *PROMPTS[0])
    with torch.inference_mode():
        both = [
            reference.generate(**kwargs, max_new_tokens=MAX_TOKENS, do_sample=False)[0].tolist()
            for kwargs in (inputs, {k: v for k, v in inputs.items() if k != "token_type_ids"})
        ]
    assert both[0] != both[1]


def _engine(folder: Path, num_kv_blocks: int) -> LLMEngine:
    config = PipelineConfig(
        model=str(folder),
        device="cpu",
        model_impl="transformers",
        max_running_seqs=8,
        num_kv_blocks=num_kv_blocks,
        max_model_len=256,
        prefill_chunk_tokens=CHUNK,
    )
    return build_llm_engine(Checkpoint(folder), config, device="cpu")


def _run(engine: LLMEngine, folder: Path, requests: dict[str, int], **params: Any) -> dict[tuple[str, int], list[int]]:
    """Run ``requests`` (name → index in PROMPTS) to the end; every choice's tokens."""
    checkpoint = Checkpoint(folder)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    for name, index in requests.items():
        parts, images = PROMPTS[index]
        ids = _inputs(folder, parts, images)["input_ids"][0].tolist()
        rows, keys = _embeds(checkpoint, images)
        engine.add(EngineInput(name, ids, checkpoint.image_token_id, rows, sampling, image_keys=keys))
    merged = run_all(engine, max_steps=2000)  # raises when the engine does not become idle
    assert all(o.finish_reason == "length" for o in merged.values()), merged
    return {key: out.token_ids for key, out in merged.items()}


def _record_chunks(engine: LLMEngine) -> list[PrefillStep]:
    """Every prefill chunk the scheduler hands out, recorded on the way."""
    chunks: list[PrefillStep] = []
    schedule = engine.scheduler.schedule

    def recorded() -> Schedule:
        decided = schedule()
        if isinstance(decided.step, PrefillStep):
            chunks.append(decided.step)
        return decided

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    return chunks


def test_preempted_chunked_and_cached_answers_equal_generate(folder: Path, reference: Any) -> None:
    expected = {f"p{i}": _greedy(folder, reference, *prompt) for i, prompt in enumerate(PROMPTS)}
    lengths = [len(_inputs(folder, *prompt)["input_ids"][0]) for prompt in PROMPTS]
    # room for the longest answer alone, and one block more: the sequences take turns
    engine = _engine(folder, num_kv_blocks=max(blocks_needed(n + MAX_TOKENS, 16) for n in lengths) + 1)
    chunks = _record_chunks(engine)
    requests = {f"p{i}": i for i in range(len(PROMPTS))}
    outputs = _run(engine, folder, requests, temperature=0.0)
    assert engine.scheduler.num_preemptions > 0
    assert {name: tokens for (name, _), tokens in outputs.items()} == expected
    # in a cache with room, each prompt twice, one at a time: the second finds its prefix cached
    roomy = _engine(folder, num_kv_blocks=64)
    chunks += _record_chunks(roomy)
    for i in range(len(PROMPTS)):
        hits = roomy.scheduler.allocator.stats.hits
        for name in (f"first{i}", f"again{i}"):
            assert _run(roomy, folder, {name: i}, temperature=0.0) == {(name, 0): expected[f"p{i}"]}
        assert roomy.scheduler.allocator.stats.hits > hits
    image = engine.runner.image_token_id
    assert image is not None
    assert any(c.end - c.start > CHUNK for c in chunks)  # an image alone in its chunk
    assert any(c.start > 0 and c.seq.num_preemptions and c.seq.output_ids for c in chunks)  # a replay
    for c in chunks:  # no chunk starts or ends inside an image
        assert span_around(c.seq.prompt_ids, image, c.start) is None
        assert span_around(c.seq.prompt_ids, image, c.end) is None


def test_n3_greedy_choices_about_two_images_equal_generate(folder: Path, reference: Any) -> None:
    expected = _greedy(folder, reference, *PROMPTS[0])
    outputs = _run(_engine(folder, num_kv_blocks=32), folder, {"g": 0}, temperature=0.0, n=3)
    assert sorted(outputs) == [("g", i) for i in range(3)]
    assert all(tokens == expected for tokens in outputs.values())


async def test_a_guided_answer_about_an_image_validates(folder: Path) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    body = image_request(
        [data_url(encode(IMAGES[0]))],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
    )
    config = PipelineConfig(
        model=str(folder),
        device="cpu",
        preparation_mode="thread",
        max_running_seqs=4,
        num_kv_blocks=64,
        engine_mode="thread",
    )
    with anyio.fail_after(120):
        async with Pipeline(config) as pipe:
            result = await (await pipe.submit(body)).result()
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), schema)
