"""The engine process's frames and messages: what crosses comes back equal."""

from __future__ import annotations

import pickle

import pytest
import torch

from pipeline.engine.arena import EngineArena
from pipeline.engine.images import ImagePlan
from pipeline.engine.wire import DECODER, ENCODER, FrameReader, Step, decode_input, encode_input, frame
from pipeline.types import GrammarSpec
from sampling.inputs import EngineInput, ImageKey, SeqOutput
from sampling.logits_process import TokenLogprob
from sampling.params import SamplingParams
from vision.mrope import MRopePositions


def test_frames_split_anywhere_come_out_whole_and_in_order() -> None:
    bodies = [b"", b"a", bytes(range(256)) * 40]
    stream = b"".join(frame(b) for b in bodies)
    reader = FrameReader()
    out = [body for i in range(0, len(stream), 7) for body in reader.feed(stream[i : i + 7])]
    assert out == bodies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_input_crosses_with_its_embeddings_and_grammar_source(dtype: torch.dtype) -> None:
    embeds = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    spec = GrammarSpec("regex", "[a-z]+")
    inp = EngineInput(
        request_id="r1",
        prompt_token_ids=[5, 9, 9, 9, 6],
        image_token_id=9,
        image_embeds=embeds,
        sampling=SamplingParams(max_tokens=4, n=2, stop=("x",)),
        grammar=object(),  # the serving process's compiled grammar: it stays there
        grammar_source=("llguidance", spec),
        image_keys=[ImageKey("abc", 3)],
        mrope=MRopePositions(torch.arange(15).view(3, 5), 2),
        extra_prefill={"deepstack_visual_embeds": torch.randn(3, 2, 8).to(dtype)},
    )
    back = decode_input(pickle.loads(pickle.dumps(encode_input(inp))))
    assert back.mrope is not None and inp.mrope is not None and back.mrope.delta == 2
    assert torch.equal(back.mrope.positions, inp.mrope.positions)
    assert torch.equal(back.extra_prefill["deepstack_visual_embeds"], inp.extra_prefill["deepstack_visual_embeds"])
    assert back.grammar is None and back.grammar_source == ("llguidance", spec)
    assert back.image_embeds is not None and back.image_embeds.dtype == dtype
    assert torch.equal(back.image_embeds, embeds)
    kept = (back.prompt_token_ids, back.sampling, back.image_keys)
    assert kept == (inp.prompt_token_ids, inp.sampling, inp.image_keys)


def test_a_grammar_without_its_source_cannot_cross() -> None:
    inp = EngineInput("r2", [1], -1, None, SamplingParams(), grammar=object())
    with pytest.raises(ValueError, match="without its source"):
        encode_input(inp)


def test_a_step_message_keeps_outputs_and_logprobs() -> None:
    outputs = [
        SeqOutput("r1", 0, [7], "x", logprobs=[TokenLogprob(7, -0.5, ((7, -0.5), (3, -1.0)))]),
        SeqOutput("r2", 1, [], "", finish_reason="error", error="boom", error_kind="constraint"),
    ]
    step = Step(outputs, 3, {"running_seqs": 1}, {"engine_requests": 2}, None)
    assert DECODER.decode(ENCODER.encode(step)) == step


def test_an_input_crosses_through_the_arena_with_no_tensor_bytes_in_its_frame() -> None:
    embeds = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))  # 8 KiB
    deepstack = torch.randn(64, 3, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    inp = EngineInput(
        "r3", [1] + [9] * 64, 9, embeds, SamplingParams(), extra_prefill={"deepstack_visual_embeds": deepstack}
    )
    arena = EngineArena.create(1 << 16)
    try:
        add = encode_input(inp, arena)
        assert add.embeds is None and add.values["extra_prefill"] == {}
        assert add.shared == (
            ("image_embeds", 0, (64, 32), "float32"),
            ("extra_prefill.deepstack_visual_embeds", 8192, (64, 3, 32), "bfloat16"),
        )
        assert len(pickle.dumps(add)) < 1024  # only where the tensors lie crosses, not their 20 KiB
        back = decode_input(pickle.loads(pickle.dumps(add)), arena)
        assert back.image_embeds is not None and torch.equal(back.image_embeds, embeds)
        assert torch.equal(back.extra_prefill["deepstack_visual_embeds"], deepstack)
        with pytest.raises(ValueError, match="arena"):
            decode_input(add)
    finally:
        arena.close()


def test_an_input_that_does_not_fit_the_arena_crosses_inline() -> None:
    embeds = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    deepstack = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(5))
    inp = EngineInput(
        "r4", [9, 9, 9, 9], 9, embeds, SamplingParams(), extra_prefill={"deepstack_visual_embeds": deepstack}
    )
    arena = EngineArena.create(256)  # 128 + 256 bytes wanted
    try:
        add = encode_input(inp, arena)
        assert add.shared is None and add.embeds is not None and arena.num_regions == 0
        back = decode_input(pickle.loads(pickle.dumps(add)), arena)
        assert back.image_embeds is not None and torch.equal(back.image_embeds, embeds)
        assert torch.equal(back.extra_prefill["deepstack_visual_embeds"], deepstack)
    finally:
        arena.close()


@pytest.mark.parametrize("arena_bytes", [1 << 20, 64], ids=["arena", "inline"])
def test_only_the_pixels_the_plan_sends_cross(arena_bytes: int) -> None:
    """The vision encoder in the engine process: pixels cross where the plan says (the engine holds
    the others), in the arena when they fit, inline when not; the plan crosses with them."""
    gen = torch.Generator().manual_seed(1)
    pixels = [torch.randn(3, 32, 16, generator=gen), torch.randn(3, 16, 16, generator=gen)]
    keys = [ImageKey("held", 2, (1, 1, 2)), ImageKey("new", 1, (1, 1, 1))]
    inp = EngineInput("r5", [1, 9, 9, 9, 2], 9, None, SamplingParams(), image_keys=keys, image_pixels=list(pixels))
    plan = ImagePlan(send=(False, True), keep=(False, True), drop=("old",))
    arena = EngineArena.create(arena_bytes)
    try:
        add = encode_input(inp, arena, plan)
        assert (add.shared is not None) == (arena_bytes > 64)
        raw = pickle.dumps(add)
        assert (len(raw) > pixels[1].numel() * 4) == (arena_bytes == 64)  # inline: the sent pixels' bytes
        assert len(raw) < pixels[0].numel() * 4  # the held image's never cross
        back = decode_input(pickle.loads(raw), arena)
    finally:
        arena.close()
    assert back.image_pixels[0] is None and back.image_embeds is None
    assert back.image_pixels[1] is not None and torch.equal(back.image_pixels[1], pixels[1])
    assert pickle.loads(raw).images == plan and back.image_keys == keys
    with pytest.raises(ValueError, match="with their plan"):
        encode_input(inp)
