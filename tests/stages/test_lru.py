"""The bounded LRU map the stages' caches share: recency, weights, replacement and eviction counts."""

from __future__ import annotations

from stages.lru import Lru


def test_counted_entries_leave_least_recently_used_first() -> None:
    lru: Lru[str, int] = Lru(2)
    assert lru.put("a", 1) == 0 and lru.put("b", 2) == 0
    assert lru.get("a") == 1  # "b" is now the least recently used
    assert lru.put("c", 3) == 1
    assert ("b" in lru, "a" in lru, "c" in lru, len(lru), lru.weight) == (False, True, True, 2, 2)
    assert lru.get("b") is None


def test_a_peek_leaves_the_order_alone() -> None:
    lru: Lru[str, int] = Lru(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.peek("a") == 1 and lru.peek("missing") is None
    lru.put("c", 3)
    assert "a" not in lru and lru.peek("b") == 2


def test_weights_bound_the_sum_and_one_put_may_evict_several() -> None:
    lru: Lru[str, bytes] = Lru(10, len)
    for key in "abc":
        lru.put(key, b"xxx")
    assert lru.weight == 9
    assert lru.put("d", b"yyyyyyy") == 2  # 16 > 10, then 13 > 10: "a" and "b" go
    assert (list(filter(lru.__contains__, "abcd")), lru.weight) == (["c", "d"], 10)


def test_a_put_replaces_the_value_and_its_weight_and_refreshes_it() -> None:
    lru: Lru[str, bytes] = Lru(10, len)
    lru.put("a", b"xxxx")
    lru.put("b", b"xxxx")
    assert lru.put("a", b"x") == 0 and (lru.peek("a"), lru.weight, len(lru)) == (b"x", 5, 2)
    assert lru.put("c", b"xxxxxx") == 1  # "b" was the least recent
    assert "b" not in lru and lru.weight == 7
