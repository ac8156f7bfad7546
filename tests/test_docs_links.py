"""The README and docs/*.md link only to what exists: every relative link names a file or folder of the
repository, and every ``#anchor`` (in the page or on another page) names one of that page's headings.

Anchors follow GitHub's rule: the heading's text lower-cased, punctuation other than ``-`` and ``_``
dropped, spaces turned into ``-``, and a repeated heading suffixed ``-1``, ``-2``, ... External
``http(s)`` and ``mailto`` links are not fetched. Links inside code (fenced blocks and inline code)
are not links.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the target may carry a "title"
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def _prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor the headings of ``page`` define, repeated headings numbered as GitHub numbers them."""
    seen: Counter[str] = Counter()
    found: set[str] = set()
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match is None:
            continue
        base = github_anchor(match.group(2))
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return found


def links(page: Path) -> list[str]:
    """The link targets of ``page``, outside code."""
    targets: list[str] = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        targets += _LINK.findall(_INLINE_CODE.sub("", line))
    return targets


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each of ``page``'s relative links, inside the repository at ``root`` (empty: nothing)."""
    problems: list[str] = []
    for target in links(page):
        if _EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not resolved.is_relative_to(root):
            problems.append(f"{target}: leaves the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor:
            if resolved.suffix != ".md" or resolved.is_dir():
                problems.append(f"{target}: an anchor into a file that is not a Markdown page")
            elif unquote(anchor) not in anchors(resolved):
                problems.append(f"{target}: no heading '#{anchor}' in {resolved.relative_to(root)}")
    return problems


def test_the_pages_exist() -> None:
    names = {page.name for page in PAGES}
    assert "README.md" in names
    assert len(PAGES) > 1, "docs/ holds no pages"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_anchor_rule_is_githubs() -> None:
    assert github_anchor("Prefill cadence (`decode_steps_per_prefill`)") == "prefill-cadence-decode_steps_per_prefill"
    assert github_anchor("On a GPU (NVIDIA H100)") == "on-a-gpu-nvidia-h100"
    assert github_anchor("Tokenize and detokenize") == "tokenize-and-detokenize"
    assert github_anchor("`tpot-under-load`") == "tpot-under-load"
    assert github_anchor("What it supports?") == "what-it-supports"


def test_a_broken_link_and_a_missing_anchor_are_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Part one\n\n## Part one\n\n"
        "[ok](#part-one) [ok too](#part-one-1) [bad](#part-two) [gone](missing.md)\n\n"
        "```\n[not a link](nowhere.md)\n```\n\n`[code](nowhere.md)` [web](https://example.com/x#y)\n"
        "[out](../elsewhere.md) [no anchor there](other.md#nothing) [fine](other.md#other)\n",
        encoding="utf-8",
    )
    (tmp_path / "other.md").write_text("# Other\n", encoding="utf-8")
    assert anchors(page) == {"title", "part-one", "part-one-1"}
    assert broken_links(page, root=tmp_path) == [
        "#part-two: no heading '#part-two' in page.md",
        "missing.md: no such file",
        "../elsewhere.md: leaves the repository",
        "other.md#nothing: no heading '#nothing' in other.md",
    ]
