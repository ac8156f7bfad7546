"""The data URL memo: bounded, least recently used out, keyed by the whole text's SHA-256."""

from __future__ import annotations

import hashlib

import anyio
import pytest

from stages.content_hash import INLINE_HASH_BYTES
from stages.data_url_keys import DataUrlKeys, is_data_url, url_digest
from stages.encoder_cache import CacheStats


def test_least_recently_used_leaves_first() -> None:
    keys = DataUrlKeys(max_entries=2)
    keys.put(b"a", "hash-a")
    keys.put(b"b", "hash-b")
    assert keys.get(b"a") == "hash-a"  # now b is the least recently used
    keys.put(b"c", "hash-c")
    assert [keys.get(k) for k in (b"a", b"b", b"c")] == ["hash-a", None, "hash-c"]
    assert keys.stats == CacheStats(hits=3, misses=1, evictions=1, entries=2)


def test_a_put_again_refreshes_its_entry() -> None:
    keys = DataUrlKeys(max_entries=2)
    keys.put(b"a", "hash-a")
    keys.put(b"b", "hash-b")
    keys.put(b"a", "hash-a")
    keys.put(b"c", "hash-c")
    assert (keys.get(b"a"), keys.get(b"b")) == ("hash-a", None)


def test_at_least_one_entry() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        DataUrlKeys(max_entries=0)


@pytest.mark.parametrize("url", ["data:image/png;base64,AAAA", "DATA:image/png;base64,AAAA", "Data:x"])
def test_data_urls_in_any_case(url: str) -> None:
    assert is_data_url(url)


@pytest.mark.parametrize("url", ["http://example.com/data:", "/data:x", "dat:x", ""])
def test_other_urls(url: str) -> None:
    assert not is_data_url(url)


# on the loop; in a thread; in a thread, over several slices of text
@pytest.mark.parametrize("size", [100, INLINE_HASH_BYTES + 1, 3 * INLINE_HASH_BYTES + 7])
async def test_the_digest_is_the_sha256_of_the_whole_text(size: int) -> None:
    url = "data:image/png;base64," + "A" * size
    changed = url[:-1] + "B"  # the same text up to its last character
    limiter = anyio.CapacityLimiter(1)
    with anyio.fail_after(10):
        digest, other = await url_digest(url, limiter), await url_digest(changed, limiter)
    assert digest == hashlib.sha256(url.encode()).digest()
    assert other == hashlib.sha256(changed.encode()).digest()
    assert digest != other
    assert limiter.borrowed_tokens == 0


async def test_a_lone_surrogate_has_a_digest_of_its_own() -> None:
    limiter = anyio.CapacityLimiter(1)
    a, b = await url_digest("data:\ud800", limiter), await url_digest("data:\ud801", limiter)
    assert a != b


async def test_the_digest_of_text_beyond_ascii_is_that_of_its_utf8() -> None:
    # characters of 2, 3 and 4 bytes and a lone surrogate across the thread's slice boundaries
    url = "data:image/png;base64," + "é€😀\udc80" * (INLINE_HASH_BYTES // 2)
    expected = hashlib.sha256(url.encode("utf-8", "surrogatepass")).digest()
    with anyio.fail_after(10):
        assert await url_digest(url, anyio.CapacityLimiter(1)) == expected
