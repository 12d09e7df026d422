"""The README and the pages under docs/: every relative link reaches a file of the checkout,
and every ``#anchor`` a heading of the page it names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# [text](target) and [text](target "title"), not images' sources inside code spans.
_LINK = re.compile(r"(?<!\\)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (hyphens
    and underscores kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of ``page``; a repeated heading gets ``-1``, ``-2``, … as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, root: Path) -> list[str]:
    """Each link of ``page`` that leads nowhere, as ``target: why``."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
            continue
        if not destination.resolve().is_relative_to(root.resolve()):
            broken.append(f"{target}: outside the checkout")
            continue
        if anchor and (destination.suffix != ".md" or anchor not in anchors(destination)):
            broken.append(f"{target}: no heading with this anchor")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(page: Path) -> None:
    """Every relative link of the page reaches a file, and its anchor a heading."""
    assert broken_links(page, REPO) == []


def test_the_readme_links_to_every_page_of_the_docs() -> None:
    """No page under docs/ is an orphan: the README or another page links to it."""
    linked = set()
    for page in pages():
        text = _FENCE.sub("", page.read_text(encoding="utf-8"))
        for target in _LINK.findall(text):
            path_part = target.partition("#")[0]
            if path_part and not re.match(r"^[a-z][a-z0-9+.-]*:", path_part):
                linked.add((page.parent / path_part).resolve())
    orphans = [p for p in pages()[1:] if p.resolve() not in linked]
    assert orphans == []


def test_a_broken_link_and_a_missing_anchor_are_reported(tmp_path: Path) -> None:
    """The check can fail: a link to a missing file, to a heading that does not exist and
    out of the checkout are reported; links inside code are not links."""
    root = tmp_path / "checkout"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "a.md").write_text("# Weights and `policy` versions\n\n## Once\n## Once\n")
    page = root / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#weights-and-policy-versions) [ok](docs/a.md#once-1)\n"
        "[gone](docs/b.md) [bad](docs/a.md#weights) [self](#nowhere) [out](../x.md)\n"
        "`[not a link](nowhere.md)`\n```\n[not a link](nowhere.md)\n```\n"
        "[web](https://example.org/x.md)\n"
    )
    (tmp_path / "x.md").write_text("")
    assert broken_links(page, root) == [
        "docs/b.md: no such file",
        "docs/a.md#weights: no heading with this anchor",
        "#nowhere: no heading with this anchor",
        "../x.md: outside the checkout",
    ]
