"""Compressed bodies inflated apart from any server: what is read, what is refused, what the budget holds."""

from __future__ import annotations

import gzip
import random
import zlib

import pytest

from pipeline.api.inflate import InflateBudget, inflate
from pipeline.errors import InvalidRequest, Overloaded, PayloadTooLarge

MIB = 1024 * 1024
TEXT = b'{"messages": [{"role": "user", "content": "hi"}]}'


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


def inflated(data: bytes, encoding: str = "gzip", limit: int = 64 * MIB, budget: InflateBudget | None = None) -> bytes:
    budget = budget or InflateBudget(256 * MIB)
    lease = budget.lease()
    try:
        return inflate(data, encoding, limit, lease)
    finally:
        lease.release()
        assert lease.held == 0


@pytest.mark.parametrize(
    ("data", "encoding"),
    [
        (gzip.compress(TEXT), "gzip"),
        (gzip.compress(TEXT[:10]) + gzip.compress(TEXT[10:]), "gzip"),  # two members, as `cat a.gz b.gz`
        (gzip.compress(TEXT) + b"\0" * 512, "gzip"),  # zero padding after the member
        (zlib.compress(TEXT), "deflate"),
        (raw_deflate(TEXT), "deflate"),  # deflate without its zlib wrapper, as some clients send it
    ],
)
def test_a_body_in_its_encoding_is_inflated_whole(data: bytes, encoding: str) -> None:
    assert inflated(data, encoding) == TEXT


def test_a_large_body_is_inflated_whole_across_many_pieces() -> None:
    data = random.Random(3).randbytes(5 * MIB + 17)  # incompressible: many input and output pieces
    assert inflated(gzip.compress(data, compresslevel=1)) == data


@pytest.mark.parametrize(
    ("data", "encoding"),
    [
        (TEXT, "gzip"),
        (gzip.compress(TEXT)[:12], "gzip"),  # cut short
        (gzip.compress(TEXT) + b"trailing", "gzip"),
        (zlib.compress(TEXT) + b"x", "deflate"),
        (gzip.compress(b"") * 2000, "gzip"),  # a decompressor per member: bounded
    ],
)
def test_data_not_in_its_encoding_is_refused_naming_content_encoding(data: bytes, encoding: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        inflated(data, encoding)
    assert caught.value.field == "Content-Encoding" and encoding in caught.value.message


def test_a_bomb_is_refused_at_the_limit_having_inflated_no_more_than_a_piece_past_it() -> None:
    budget = InflateBudget(256 * MIB)
    bomb = gzip.compress(b"a" * (64 * MIB))  # 64 KiB inflating to 64 MiB
    with pytest.raises(PayloadTooLarge) as caught:
        inflated(bomb, limit=4 * MIB, budget=budget)
    assert caught.value.status == 413 and caught.value.field == "body"
    assert budget.stats.most_held <= 4 * MIB and budget.stats.too_large == 1


def test_a_spent_budget_refuses_with_503_and_retry_after_and_a_release_gives_back() -> None:
    budget = InflateBudget(4 * MIB)
    holder = budget.lease()
    holder.take(3 * MIB + 1)
    with pytest.raises(Overloaded) as caught:
        inflated(gzip.compress(b"a" * (2 * MIB)), budget=budget)
    assert caught.value.status == 503 and caught.value.retry_after >= 1 and budget.stats.refused == 1
    assert budget.held == 3 * MIB + 1  # the refused body gave back what it had taken
    holder.release()
    assert budget.held == 0
    assert inflated(gzip.compress(b"a" * (2 * MIB)), budget=budget) == b"a" * (2 * MIB)


def test_budget_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        InflateBudget(1024)
    with pytest.raises(ValueError):
        InflateBudget(256 * MIB, max_inflating=0)
