"""The cache look-ups both grammar stages share: a hit is counted and made the most recent, a peek is neither."""

from __future__ import annotations

from pipeline.errors import GrammarError
from stages.grammar.answer_check import MatchCheck
from stages.grammar.cache import GrammarCache
from stages.grammar.types import CompiledConstraint, GrammarStats, cached_entry, counted_hit

KB = 1024  # a cached refusal's nominal size; the caches below hold four such entries


def constraint(nbytes: int = KB) -> CompiledConstraint:
    check = MatchCheck(lambda text: text == "x", "not x", "regex")
    return CompiledConstraint("regex", "xgrammar", "test", None, check, nbytes)


def test_a_hit_is_counted_and_becomes_the_most_recent_and_a_miss_is_counted() -> None:
    stats, cache = GrammarStats(), GrammarCache[CompiledConstraint](max_bytes=4 * KB)
    first, refusal = constraint(), GrammarError("bad", field="regex")
    for key, entry in (("a", first), ("b", refusal), ("c", constraint()), ("d", constraint())):
        cache.store(key, entry)
    assert counted_hit(stats, cache, "missing") is None
    assert counted_hit(stats, cache, "a") is first and counted_hit(stats, cache, "b") is refusal
    assert (stats.hits, stats.misses) == (2, 1)
    cache.store("e", constraint())  # over the bound: the least recent ("c") goes
    assert cached_entry(cache, "c") is None and cached_entry(cache, "a") is first
    assert cached_entry(cache, "b") is refusal


def test_a_peek_neither_counts_nor_refreshes() -> None:
    stats, cache = GrammarStats(), GrammarCache[CompiledConstraint](max_bytes=4 * KB)
    first = constraint()
    for key, entry in (("a", first), ("b", constraint()), ("c", constraint()), ("d", constraint())):
        cache.store(key, entry)
    assert cached_entry(cache, "a") is first and cached_entry(cache, "missing") is None
    assert (stats.hits, stats.misses) == (0, 0)
    cache.store("e", constraint())  # "a" is still the least recent
    assert cached_entry(cache, "a") is None and cached_entry(cache, "b") is not None
