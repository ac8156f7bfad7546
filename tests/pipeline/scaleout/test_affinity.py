"""Routing keys, the consistent-hash ring and the merged exposition of scale-out (no Ray needed)."""

from __future__ import annotations

import json
import random
from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.parser import text_string_to_metric_families

from pipeline.scaleout.affinity import PREFIX_CHARS, HashRing, routing_key
from pipeline.scaleout.replica_metrics import merge_expositions


def _chat(text: str = "hi", image: str | None = None, **extra: object) -> bytes:
    content: list[dict[str, object]] = [{"type": "text", "text": text}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": image}})
    return json.dumps({"messages": [{"role": "user", "content": content}], **extra}).encode()


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_the_first_image_decides_whatever_the_text_and_schema() -> None:
    a = routing_key(_chat("one", "data:image/png;base64,AAAA", response_format={"type": "json_object"}))
    b = routing_key(_chat("two", "data:image/png;base64,AAAA"))
    c = routing_key(_chat("one", "data:image/png;base64,AAAB"))
    assert a is not None and a.startswith("image:")
    assert a == b and a != c


def test_image_given_as_a_bare_string_url() -> None:
    body = json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "https://x/y.png"}]}]}
    ).encode()
    assert routing_key(body) == routing_key(_chat("other", "https://x/y.png"))


def test_without_images_the_constraint_decides_in_any_spelling_order() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    a = routing_key(_chat("one", response_format=rf))
    b = routing_key(_chat("two", response_format=json.loads(json.dumps(rf, sort_keys=True))))
    c = routing_key(_chat("one", guided_json=SCHEMA))
    d = routing_key(_chat("one", guided_json=SCHEMA, guided_decoding_backend="xgrammar"))
    assert a is not None and a.startswith("constraint:")
    assert a == b
    assert c != a  # another spelling is another key: both are still the same replica's business
    assert c == d  # the backend choice does not change the grammar


def test_without_images_or_constraint_the_prompt_prefix_decides() -> None:
    shared = "s" * PREFIX_CHARS
    a = routing_key(_chat(shared + " first question"))
    b = routing_key(_chat(shared + " second question"))
    c = routing_key(_chat("a different system prompt"))
    assert a is not None and a.startswith("prefix:")
    assert a == b and a != c
    completion = json.dumps({"prompt": "hello there", "max_tokens": 4}).encode()
    assert (routing_key(completion) or "").startswith("prefix:")


def test_bodies_that_do_not_parse_have_no_key() -> None:
    assert routing_key(b"{not json") is None
    assert routing_key(b"[1, 2]") is None
    assert routing_key(b"{}") is None


def test_ring_is_stable_and_moves_only_the_keys_of_a_node_that_left() -> None:
    keys = [f"key-{i}" for i in range(2000)]
    ring = HashRing(["a", "b", "c"])
    assert HashRing(["c", "a", "b"]).node("key-1") == ring.node("key-1")  # order of nodes does not matter
    before = {k: ring.node(k) for k in keys}
    shares = Counter(before.values())
    assert set(shares) == {"a", "b", "c"}
    assert min(shares.values()) > len(keys) / 3 * 0.6  # 64 points per node keep the shares near even
    after = HashRing(["a", "c"])
    for k in keys:
        if before[k] != "b":
            assert after.node(k) == before[k]
        else:
            assert after.node(k) in {"a", "c"}


def test_an_empty_ring_says_so() -> None:
    ring = HashRing([])
    assert len(ring) == 0
    try:
        ring.node("k")
    except LookupError:
        pass
    else:
        raise AssertionError("an empty ring must not pick a node")


def test_merged_exposition_labels_every_sample_with_its_replica() -> None:
    rng = random.Random(7)
    parts, counts = {}, {}
    for replica in ("r1", "r2"):
        registry = CollectorRegistry()
        hits = PromCounter("cache_hits", "hits", ["cache"], registry=registry)
        counts[replica] = rng.randrange(1, 50)
        hits.labels("encoder").inc(counts[replica])
        parts[replica] = generate_latest(registry)
    merged = merge_expositions(parts).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    samples = [s for s in families["cache_hits"].samples if s.name == "cache_hits_total"]
    assert {(s.labels["replica"], s.labels["cache"], s.value) for s in samples} == {
        ("r1", "encoder", counts["r1"]),
        ("r2", "encoder", counts["r2"]),
    }
    assert merged.count("# TYPE cache_hits_total counter") == 1  # one family, samples of both replicas
