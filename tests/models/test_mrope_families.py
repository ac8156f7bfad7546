"""Qwen2.5-VL and Qwen3-VL through the adapter: M-RoPE positions computed in preparation and sliced
per prefill chunk, DeepStack features carried as an extra prefill input. Logits within 1e-4 of
transformers' through chunked prefill (chunks that cut through images), a decode batch of different
lengths, a prefix-cache hit; preemption with replay and ``n = 3`` equal to ``generate``; an identical
image request reuses the first one's blocks; a guided answer about an image validates; a bad image
is a 400 naming its field."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
import torch

from pipeline import PipelineConfig
from pipeline.core.pipeline import Pipeline
from pipeline.engine.factory import build_llm_engine
from pipeline.errors import ImageDecodeError
from pipeline.stage_factory import encoder_cache_namespace
from sampling.engine import LLMEngine
from sampling.hf_adapter import HFModelRunner
from sampling.inputs import EngineInput, ImageKey, SeqOutput
from sampling.kv_cache import blocks_needed
from sampling.params import SamplingParams
from tests.images import data_url, encode, image_request, make_image
from tests.sampling.helpers import run_all
from vision.checkpoint import Checkpoint
from vision.encoder import VisionEncoder, split_deepstack
from vision.mrope import MRopeIndex, MRopePositions
from vision.preprocess import preprocess_image

FamilyDir = Callable[[str], Path]
FAMILIES = ["qwen2.5-vl", "qwen3-vl"]
ATOL = 1e-4
MAX_TOKENS = 12
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@dataclass
class Case:
    """One image prompt as the processor builds it for transformers, and as our preparation does."""

    ids: list[int]
    hf_inputs: dict[str, torch.Tensor]
    embeds: torch.Tensor  # [image tokens, hidden]
    deepstack: torch.Tensor | None  # [image tokens, layers, hidden]
    mrope: MRopePositions
    keys: list[ImageKey]


def _case(folder: Path, question: str, sizes: list[tuple[int, int, int]]) -> Case:
    from transformers import AutoProcessor

    checkpoint = Checkpoint(folder)
    images = [make_image(w, h, seed=s) for w, h, s in sizes]
    processor = AutoProcessor.from_pretrained(folder)
    parts = [{"type": "text", "text": question}, *({"type": "image"} for _ in images), {"type": "text", "text": "ok"}]
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    hf_inputs = dict(processor(text=text, images=images, return_tensors="pt"))
    ids = hf_inputs["input_ids"][0].tolist()
    prepared = [preprocess_image(checkpoint.image_processor, image) for image in images]
    rows = torch.cat(VisionEncoder(checkpoint).encode(prepared))
    embeds, deepstack = split_deepstack(rows, int(checkpoint.text_config.hidden_size))
    token = checkpoint.image_token_id
    assert token is not None
    mrope = MRopeIndex(checkpoint.config, token)([*ids], [p.grid_thw for p in prepared])
    assert mrope is not None
    keys = [ImageKey(f"img{s}", p.num_patches, p.grid_thw) for (_, _, s), p in zip(sizes, prepared, strict=True)]
    return Case(ids, hf_inputs, embeds, deepstack, mrope, keys)


def _reference(folder: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder).eval()


def _reference_logits(model: Any, case: Case, more: list[int]) -> torch.Tensor:
    """transformers' logits ``[L + len(more), vocab]`` of the prompt followed by ``more`` text tokens."""
    inputs = dict(case.hf_inputs)
    extra = torch.tensor([more], dtype=torch.long)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra)], dim=1)
    with torch.inference_mode():
        return model(**inputs).logits[0].float()


def _chunk_inputs(case: Case, start: int, end: int, token: int) -> dict[str, Any]:
    before = case.ids[:start].count(token)
    inside = case.ids[start:end].count(token)
    rows = case.embeds[before : before + inside]
    extra = {"deepstack_visual_embeds": case.deepstack[before : before + inside]} if case.deepstack is not None else {}
    return {"image_rows": rows, "rope_positions": case.mrope.positions[:, start:end], "extra_inputs": extra}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family: str, family_dir: FamilyDir) -> None:
    """Chunks cutting through both images, a decode batch beside a text sequence, a prefix-cache hit."""
    folder = family_dir(family)
    reference = _reference(folder)
    case = _case(folder, "Describe the quick brown fox.", [(96, 64, 1), (40, 80, 2)])
    token = int(Checkpoint(folder).image_token_id or 0)
    image_at = [i for i, t in enumerate(case.ids) if t == token]
    cuts = [0, image_at[2], image_at[-2], len(case.ids)]  # inside the first image, inside the second
    assert len(case.ids) > 16 and case.mrope.delta != 0
    more = [int(t) for t in torch.randint(10, 300, (5,), generator=torch.Generator().manual_seed(1))]
    expected = _reference_logits(reference, case, more)
    runner = HFModelRunner(Checkpoint(folder), device="cpu", max_model_len=512, num_blocks=32, block_size=16)
    tables = [[5, 9, 3, 11], [7, 1]]
    for start, end in zip(cuts, cuts[1:], strict=False):
        logits = runner.prefill(case.ids[start:end], start, tables[0], **_chunk_inputs(case, start, end, token))
        torch.testing.assert_close(logits[0], expected[end - 1], atol=ATOL, rtol=0)
    # a text sequence of another length decodes beside it at 1-D positions (no delta)
    text = [int(t) for t in torch.randint(10, 300, (13,), generator=torch.Generator().manual_seed(2))]
    with torch.inference_mode():
        text_expected = reference(input_ids=torch.tensor([text + more])).logits[0].float()
    runner.prefill(text[:12], 0, tables[1], None)
    length = len(case.ids)
    for step in range(4):
        positions = [length - 1 + step, 12 + step]
        batch = runner.decode_inputs(positions, tables)
        batch.rope_positions = torch.tensor([positions[0] + case.mrope.delta, positions[1]]).expand(3, -1)
        ids = [([*case.ids, *more])[positions[0]], (text + more)[positions[1]]]
        logits = runner.decode(ids, batch)
        torch.testing.assert_close(logits[0], expected[positions[0]], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1], text_expected[positions[1]], atol=ATOL, rtol=0)
    # the same prompt again, its first block (image tokens in it) taken from the first one's
    logits = runner.prefill(case.ids[16:], 16, [5, 20, 21, 22], **_chunk_inputs(case, 16, length, token))
    torch.testing.assert_close(logits[0], expected[length - 1], atol=ATOL, rtol=0)


def _engine(folder: Path, num_kv_blocks: int, prefix_caching: bool = True, one_step_ahead: bool = False) -> LLMEngine:
    config = PipelineConfig(
        model=str(folder),
        device="cpu",
        max_running_seqs=8,
        num_kv_blocks=num_kv_blocks,
        max_model_len=256,
        prefill_chunk_tokens=16,  # every image prompt prefills in chunks that cut through its images
        prefix_caching=prefix_caching,
        engine_one_step_ahead=one_step_ahead,
    )
    return build_llm_engine(Checkpoint(folder), config, device="cpu")


def _input(name: str, case: Case, token: int, **params: Any) -> EngineInput:
    extra = {"deepstack_visual_embeds": case.deepstack} if case.deepstack is not None else {}
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    return EngineInput(
        name, case.ids, token, case.embeds, sampling, image_keys=case.keys, mrope=case.mrope, extra_prefill=extra
    )


def _run(engine: LLMEngine, inputs: list[EngineInput]) -> dict[tuple[str, int], SeqOutput]:
    for inp in inputs:
        engine.add(inp)
    merged = run_all(engine, max_steps=2000)  # raises when the engine does not become idle
    assert all(o.finish_reason == "length" for o in merged.values()), merged
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks
    return merged


def _generate(model: Any, case: Case, stop_ids: list[int] | None) -> list[int]:
    """transformers' greedy answer; ``stop_ids``: banned, as the engine's ``ignore_eos`` does (None: stop there)."""
    banned = {} if stop_ids is None else {"eos_token_id": None, "suppress_tokens": stop_ids}
    with torch.inference_mode():
        out = model.generate(**case.hf_inputs, max_new_tokens=MAX_TOKENS, do_sample=False, **banned)
    return list(out[0, len(case.ids) :].tolist())


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_n3_and_a_prefix_hit_answer_as_generate(family: str, family_dir: FamilyDir) -> None:
    folder = family_dir(family)
    checkpoint = Checkpoint(folder)
    token = int(checkpoint.image_token_id or 0)
    stop_ids = [int(t) for t in checkpoint.tokenizer_info.stop_token_ids]  # ignore_eos bans them
    reference = _reference(folder)
    cases = {
        "two": _case(folder, "Describe the quick brown fox.", [(96, 64, 1), (40, 80, 2)]),
        "one": _case(folder, "What is in this image? Describe the picture.", [(64, 96, 3)]),
        "wide": _case(folder, "Hello world!", [(120, 40, 4)]),
    }
    expected = {name: _generate(reference, case, stop_ids) for name, case in cases.items()}
    # preemption: room for the longest sequence and one more block, the rest replays
    longest = max(blocks_needed(len(c.ids) + MAX_TOKENS, 16) for c in cases.values())
    engine = _engine(folder, num_kv_blocks=longest + 1)
    outputs = _run(engine, [_input(n, c, token, temperature=0.0) for n, c in cases.items()])
    assert engine.scheduler.num_preemptions > 0
    assert {k[0]: o.token_ids for k, o in outputs.items()} == expected
    # the one-step-ahead loop: each decode row's RoPE offset goes with its launch
    ahead = _run(
        _engine(folder, 64, one_step_ahead=True), [_input(n, c, token, temperature=0.0) for n, c in cases.items()]
    )
    assert {k[0]: o.token_ids for k, o in ahead.items()} == expected
    # n = 3: one prefill forked into three greedy copies
    engine = _engine(folder, num_kv_blocks=64)
    greedy = _run(engine, [_input("g", cases["two"], token, temperature=0.0, n=3)])
    assert sorted(greedy) == [("g", i) for i in range(3)]
    assert all(o.token_ids == expected["two"] for o in greedy.values())
    # the identical request again: its full prompt blocks come from the cache, its logits are the same
    stats = engine.scheduler.allocator.stats
    hits = stats.hits
    again = _run(engine, [_input("again", cases["two"], token, temperature=0.0, logprobs=5)])[("again", 0)]
    assert stats.hits - hits == (len(cases["two"].ids) - 1) // 16
    cold = _run(
        _engine(folder, 64, prefix_caching=False), [_input("cold", cases["two"], token, temperature=0.0, logprobs=5)]
    )
    assert again.token_ids == cold[("cold", 0)].token_ids == expected["two"]
    for hit, miss in zip(again.logprobs or [], cold[("cold", 0)].logprobs or [], strict=True):
        assert [t for t, _ in hit.top] == [t for t, _ in miss.top]
        assert max(abs(a - b) for (_, a), (_, b) in zip(hit.top, miss.top, strict=True)) <= ATOL


@pytest.mark.parametrize("family", FAMILIES)
async def test_one_image_answers_as_generate_and_a_guided_answer_validates(family: str, family_dir: FamilyDir) -> None:
    folder = family_dir(family)
    image = make_image(64, 96, seed=3)
    case = _case(folder, "What is in this image? Describe the picture.", [(64, 96, 3)])
    expected = _generate(_reference(folder), case, None)
    content: list[dict[str, Any]] = [
        {"type": "text", "text": "What is in this image? Describe the picture."},
        {"type": "image_url", "image_url": {"url": data_url(encode(image))}},
        {"type": "text", "text": "ok"},
    ]
    messages = [{"role": "user", "content": content}]
    guided = {
        "messages": messages,
        "max_tokens": 64,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
    }
    config = PipelineConfig(
        model=str(folder),
        device="cpu",
        max_running_seqs=4,
        num_kv_blocks=64,
        max_model_len=512,
        prep_workers=1,
        engine_mode="thread",
    )
    with anyio.fail_after(180):
        async with Pipeline(config) as pipe:
            prepared = await pipe.prepare({"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
            answer = await (
                await pipe.submit({"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
            ).result()
            structured = await (await pipe.submit(guided)).result()
            cache = pipe.preparation.encoder_cache
            assert cache is not None and cache.stats.hits == 2  # both answers' image: positions from the cached grid
    assert prepared.prompt_token_ids == case.ids
    assert prepared.mrope is not None and torch.equal(prepared.mrope.positions, case.mrope.positions)
    assert answer.token_ids == expected
    assert structured.finish_reason == "stop"
    jsonschema.validate(json.loads(structured.text), SCHEMA)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=["thread", "process"])
async def qwen25_vl(request: pytest.FixtureRequest, family_dir: FamilyDir) -> AsyncIterator[Pipeline]:
    """One Qwen2.5-VL pipeline per preparation mode for the refused images (a refusal holds nothing)."""
    config = PipelineConfig(
        model=str(family_dir("qwen2.5-vl")),
        device="cpu",
        preparation_mode=request.param,
        prep_workers=1,
        num_kv_blocks=16,
        engine_mode="thread",
    )
    async with Pipeline(config) as pipe:
        yield pipe


@pytest.mark.parametrize(
    ("width", "height", "why"),
    [(1, 300, "aspect ratio must be smaller than 200"), (8, 1590, "over its limit of")],
)
async def test_an_image_the_processor_cannot_patch_is_a_400_naming_its_field(
    qwen25_vl: Pipeline, width: int, height: int, why: str
) -> None:
    body = image_request([data_url(encode(make_image(width, height, seed=1)))], max_tokens=4)
    with anyio.fail_after(120):
        with pytest.raises(ImageDecodeError, match=why) as info:
            await (await qwen25_vl.submit(body)).result()
    assert info.value.status == 400 and info.value.field == "messages[0].content[1].image_url.url"


def test_encoder_cache_keys_change_with_the_processors_pixel_budget(family_dir: FamilyDir) -> None:
    """The same checkpoint folder under another ``max_pixels`` gives other grids: other cache keys."""
    from transformers import AutoImageProcessor

    folder = family_dir("qwen2.5-vl")
    first, second, other = Checkpoint(folder), Checkpoint(folder), Checkpoint(folder)
    size = dict(first.image_processor.size)
    budget = {"shortest_edge": size["shortest_edge"], "longest_edge": 2 * size["longest_edge"]}
    other.__dict__["image_processor"] = AutoImageProcessor.from_pretrained(folder, size=budget)
    assert other.image_processor.size["longest_edge"] == 2 * size["longest_edge"]
    assert encoder_cache_namespace(first) == encoder_cache_namespace(second) != encoder_cache_namespace(other)


def test_the_same_tokens_and_image_under_another_grid_share_no_blocks() -> None:
    """M-RoPE positions follow the grid: 2 x 3 and 3 x 2 tokens of one image are not the same K/V."""
    from sampling.prefix_cache import compute_block_hashes
    from sampling.sequence import Sequence

    ids = [1, 2, 3, 4, 5, 6, 7, 8, *[9] * 6, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]

    def hashes(grid: tuple[int, int, int]) -> list[bytes]:
        seq = Sequence(0, "r", 0, ids, None, SamplingParams(), None, None, None, None)  # type: ignore[arg-type]
        seq.image_keys = [ImageKey("same", 6, grid)]
        return compute_block_hashes(seq, 3, 8, image_token_id=9)

    assert len(hashes((1, 2, 3))) == 3
    assert hashes((1, 2, 3))[0] == hashes((1, 3, 2))[0]  # the block before the image
    assert not set(hashes((1, 2, 3))[1:]) & set(hashes((1, 3, 2))[1:])
    assert hashes((1, 2, 3)) == hashes((1, 2, 3))


async def test_text_that_writes_the_image_token_is_text_or_a_400_naming_it(family_dir: FamilyDir) -> None:
    """Typed ``<|image_pad|>`` is text; where control tokens are allowed, a 400 (no image for it)."""
    from pipeline.errors import InvalidRequest

    config = PipelineConfig(model=str(family_dir("qwen2.5-vl")), device="cpu", preparation_mode="thread")
    body = {"messages": [{"role": "user", "content": "Hi <|image_pad|> there"}], "max_tokens": 4}
    with anyio.fail_after(120):
        async with Pipeline(config, with_engine=False) as pipe:
            image_pad = pipe.checkpoint.tokenizer.convert_tokens_to_ids("<|image_pad|>")
            assert image_pad not in (await pipe.prepare(body)).prompt_token_ids
        async with Pipeline(replace(config, allow_control_tokens_in_content=True), with_engine=False) as pipe:
            with pytest.raises(InvalidRequest, match="may not contain '<\\|image_pad\\|>'") as info:
                await pipe.prepare(body)
    assert info.value.status == 400 and info.value.field == "messages"
