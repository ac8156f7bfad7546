"""The KV prefix cache: outputs identical with it on and off, images keyed by content, eviction,
reference counts back at zero."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import xgrammar as xgr

from sampling.engine import LLMEngine
from sampling.inputs import EngineInput, ImageKey
from sampling.params import SamplingParams
from tests.sampling.conftest import NewEngine
from tests.sampling.helpers import IMAGE_TOKEN, SEEDED, add, prompt, run_all

SYSTEM = "You are a careful assistant who answers in short sentences. " * 6


def add_image(engine: LLMEngine, request_id: str, ids: list[int], images: list[tuple[str, int]], **params: Any) -> None:
    """A prompt whose ``IMAGE_TOKEN`` runs are the images (content key, seed of its embedding rows)."""
    hidden = engine.runner.cfg.hidden_size
    sizes = _image_runs(ids)
    rows = [
        torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))
        for n, (_, seed) in zip(sizes, images, strict=True)
    ]
    keys = [ImageKey(key, n) for n, (key, _) in zip(sizes, images, strict=True)]
    engine.add(EngineInput(request_id, ids, IMAGE_TOKEN, torch.cat(rows), SamplingParams(**params), image_keys=keys))


def _image_runs(ids: list[int]) -> list[int]:
    runs: list[int] = []
    for i, t in enumerate(ids):
        if t == IMAGE_TOKEN:
            if i and ids[i - 1] == IMAGE_TOKEN:
                runs[-1] += 1
            else:
                runs.append(1)
    return runs


def image_prompt(tokenizer: Any, question: str, num_patches: int = 40) -> list[int]:
    head = prompt(tokenizer, SYSTEM)[:-1]
    return head + [IMAGE_TOKEN] * num_patches + prompt(tokenizer, question)[1:]


def workload(engine: LLMEngine, tokenizer: Any, grammar: Any) -> dict[tuple[str, int], list[int]]:
    """Requests added one at a time (each after the last finished), so later ones find earlier
    prefixes: text, images, guided and n > 1; the tokens of every choice."""
    steps: list[tuple[str, Any]] = [
        ("t1", lambda: add(engine, "t1", prompt(tokenizer, SYSTEM + "first"), max_tokens=12, temperature=0)),
        ("t2", lambda: add(engine, "t2", prompt(tokenizer, SYSTEM + "second"), max_tokens=12, temperature=0)),
        ("t1 again", lambda: add(engine, "t3", prompt(tokenizer, SYSTEM + "first"), max_tokens=12, temperature=0)),
        (
            "img a",
            lambda: add_image(engine, "i1", image_prompt(tokenizer, "what?"), [("a", 1)], max_tokens=10, temperature=0),
        ),
        (
            "img a",
            lambda: add_image(engine, "i2", image_prompt(tokenizer, "why?"), [("a", 1)], max_tokens=10, temperature=0),
        ),
        (
            "img b",
            lambda: add_image(engine, "i3", image_prompt(tokenizer, "why?"), [("b", 2)], max_tokens=10, temperature=0),
        ),
        (
            "guided",
            lambda: add(engine, "g1", prompt(tokenizer, SYSTEM + "json"), grammar, max_tokens=40, temperature=0),
        ),
        (
            "guided",
            lambda: add(engine, "g2", prompt(tokenizer, SYSTEM + "json"), grammar, max_tokens=40, temperature=0),
        ),
        ("n=3", lambda: add(engine, "n1", prompt(tokenizer, SYSTEM + "three"), max_tokens=8, n=3, seed=3, **SEEDED)),
        ("n=3", lambda: add(engine, "n2", prompt(tokenizer, SYSTEM + "three"), max_tokens=8, n=3, seed=3, **SEEDED)),
    ]
    tokens: dict[tuple[str, int], list[int]] = {}
    for _, add_one in steps:
        add_one()
        for key, out in run_all(engine).items():
            assert out.finish_reason in ("stop", "length"), out
            tokens[key] = out.token_ids
    return tokens


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "ahead"])
def test_outputs_are_the_same_with_the_cache_on_and_off(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar, one_step_ahead: bool
) -> None:
    off = workload(new_engine(prefix_caching=False, one_step_ahead=one_step_ahead), hf_tokenizer, json_grammar)
    engine = new_engine(one_step_ahead=one_step_ahead, chunk_tokens=24)  # hits land mid-prompt, chunked
    on = workload(engine, hf_tokenizer, json_grammar)
    assert on == off
    assert on[("t3", 0)] == on[("t1", 0)] and on[("g2", 0)] == on[("g1", 0)] and on[("n2", 2)] == on[("n1", 2)]
    assert on[("i3", 0)] != on[("i2", 0)]  # another image, another answer
    stats = engine.scheduler.allocator.stats
    assert stats.hits >= 6 * len(prompt(hf_tokenizer, SYSTEM)) // 16 and stats.blocks_held > 0


def test_different_images_never_share_blocks(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    engine = new_engine()
    stats = engine.scheduler.allocator.stats
    ids = image_prompt(hf_tokenizer, "same words", num_patches=48)
    first_image_block = ids.index(IMAGE_TOKEN) // 16
    full = (len(ids) - 1) // 16
    hits: dict[str, int] = {}
    tables: dict[str, list[int]] = {}
    # "a" still runs while the others are admitted, so its blocks are held, not free for reuse
    add_image(engine, "a", ids, [("img-a", 1)], max_tokens=30, temperature=0, ignore_eos=True)
    engine.step()
    for request_id, image in (("b", ("img-b", 1)), ("a2", ("img-a", 1))):
        before = stats.hits
        add_image(engine, request_id, ids, [image], max_tokens=20, temperature=0, ignore_eos=True)
        for _ in range(3):
            engine.step()
        hits[request_id] = stats.hits - before
        tables[request_id] = list(engine.requests[request_id].seqs[0].block_table)
    tables["a"] = list(engine.requests["a"].seqs[0].block_table)
    run_all(engine)
    assert hits == {"b": first_image_block, "a2": full}
    assert tables["b"][:first_image_block] == tables["a"][:first_image_block]  # the text before the image
    assert not set(tables["b"][first_image_block:]) & set(tables["a"])
    assert tables["a2"][:full] == tables["a"][:full]  # the same image: every full block


def test_images_without_content_keys_are_never_shared(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    engine = new_engine()
    stats = engine.scheduler.allocator.stats
    ids = image_prompt(hf_tokenizer, "no keys", num_patches=32)
    hidden = engine.runner.cfg.hidden_size
    hits = []
    for i in range(2):  # the same embeddings both times: without keys they still must not be shared
        embeds = torch.randn(32, hidden, generator=torch.Generator().manual_seed(0))
        before = stats.hits
        engine.add(EngineInput(f"r{i}", ids, IMAGE_TOKEN, embeds, SamplingParams(max_tokens=2, temperature=0)))
        run_all(engine)
        hits.append(stats.hits - before)
    assert hits == [0, ids.index(IMAGE_TOKEN) // 16]  # the text before the image only


def test_eviction_under_memory_pressure_keeps_outputs_right(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    def answers(engine: LLMEngine) -> list[list[int]]:
        out = []
        for i in [0, 1, 2, 3, 0, 4, 0]:  # 0 is evicted by the others in between
            add(engine, f"r{len(out)}", prompt(hf_tokenizer, f"topic {i} " * 30), max_tokens=6, temperature=0)
            out.append(run_all(engine)[(f"r{len(out)}", 0)].token_ids)
        return out

    small = new_engine(num_blocks=24)
    assert answers(small) == answers(new_engine(prefix_caching=False))
    stats = small.scheduler.allocator.stats
    assert stats.evictions > 0 and stats.hits > 0
    assert stats.blocks_held <= small.scheduler.allocator.num_blocks


def test_aborts_and_preemptions_leave_every_reference_at_zero(new_engine: NewEngine, hf_tokenizer: Any) -> None:
    engine = new_engine(num_blocks=20, chunk_tokens=16)
    shared = prompt(hf_tokenizer, SYSTEM)
    for i in range(6):
        add(engine, f"r{i}", shared + [100 + i] * 20, max_tokens=40, temperature=0, ignore_eos=True, n=1 + i % 3)
    for _ in range(30):
        engine.step()
    engine.abort("r1")  # mid-decode, with shared blocks
    add(engine, "late", shared + [7] * 30, max_tokens=4, temperature=0)
    engine.step()
    engine.abort("late")  # just admitted, its prefix taken from the cache
    seqs = engine.requests.sequences()
    outputs = run_all(engine)
    assert sum(s.num_preemptions for s in seqs) > 0 and engine.scheduler.allocator.stats.hits > 0
    allocator = engine.scheduler.allocator
    assert allocator.num_referenced == 0 and all(allocator.refcount(b) == 0 for b in range(allocator.num_blocks))
    assert all(o.finish_reason == "length" for k, o in outputs.items() if k[0] not in ("r1", "late"))


def test_preemption_with_shared_prefixes_gives_the_uncached_answers(
    new_engine: NewEngine, hf_tokenizer: Any, json_grammar: xgr.CompiledGrammar
) -> None:
    shared = prompt(hf_tokenizer, SYSTEM)

    def run(engine: LLMEngine) -> tuple[dict[tuple[str, int], list[int]], int]:
        preempted: list[int] = []
        preempt = engine.scheduler._preempt
        engine.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))[1]  # type: ignore[method-assign]
        for i in range(5):
            grammar = json_grammar if i % 2 else None
            add(
                engine,
                f"r{i}",
                shared + [200 + i] * 9,
                grammar,
                max_tokens=60,
                temperature=0,
                ignore_eos=grammar is None,
            )
        add(engine, "n", shared + [7] * 5, max_tokens=40, n=2, seed=4, ignore_eos=True, **SEEDED)
        outputs = run_all(engine)
        assert all(o.finish_reason in ("stop", "length") for o in outputs.values()), outputs
        return {k: o.token_ids for k, o in outputs.items()}, len(preempted)

    plain, _ = run(new_engine(prefix_caching=False))
    tight, preemptions = run(new_engine(num_blocks=12, chunk_tokens=32))
    assert preemptions > 0 and tight == plain
