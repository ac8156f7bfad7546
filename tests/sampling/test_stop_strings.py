"""Stop strings over streamed deltas, against the same search on the whole text: cut before the stop
string, or after it with ``include``; none may end in the text of the first ``min_tokens`` deltas."""

from __future__ import annotations

import random

import pytest

from sampling.stop import StopChecker

TEXT = "the cat sat on the mat; the dog sat on the log. THE END and more text after it"
STOPS = ("on the l", "END", "sat on", "zzz")


def _expected(stops: tuple[str, ...], include: bool, num_free_chars: int) -> str:
    """The whole text cut at the first stop string that ends past ``num_free_chars`` characters."""
    ends = [(i, s) for s in stops for i in range(len(TEXT)) if TEXT.startswith(s, i) and i + len(s) > num_free_chars]
    if not ends:
        return TEXT
    index, stop = min(ends)
    return TEXT[: index + len(stop)] if include else TEXT[:index]


def _deltas(seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(TEXT):
        n = rng.randint(0, 4)
        out.append(TEXT[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
@pytest.mark.parametrize("min_deltas", [0, 3, 6, 14])
@pytest.mark.parametrize("seed", range(5))
def test_streamed_text_is_the_whole_text_cut_at_the_stop_string(include: bool, min_deltas: int, seed: int) -> None:
    deltas = _deltas(seed)
    checker = StopChecker(STOPS, include=include)
    out = ""
    for i, delta in enumerate(deltas):
        out += checker.feed(delta, can_stop=i >= min_deltas)
        if checker.hit:
            break
    else:
        out += checker.flush()
    assert out == _expected(STOPS, include, len("".join(deltas[:min_deltas])))


def test_include_holds_nothing_back() -> None:
    kept = StopChecker(("END",), include=True)
    cut = StopChecker(("END",))
    assert kept.feed("the E") == "the E"  # may begin "END", but it is written either way
    assert cut.feed("the E") == "the"  # the last len("END") - 1 characters wait
    assert kept.feed("ND!") == "ND" and kept.hit
    assert cut.feed("ND!") == " " and cut.hit
