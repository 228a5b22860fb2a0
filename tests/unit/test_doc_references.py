"""Every reference to a section of the documentation names a real heading.

The code and the documents cite sections as ``docs/X.md, "Title"`` (several titles joined by "and"
or commas; in docs/, ``X.md, "Title"`` too) or ``docs/X.md section 3.1``. Oracle: the headings as
the markdown files hold them (a title may cite a heading without its number and by its part
before ": " or " (", e.g. "Frames" for "Frames: the tensors' bytes unpacked"; a number by the
heading it starts).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    [*ROOT.glob("client/**/*.py"), *ROOT.glob("service/**/*.py"), ROOT / "README.md", *ROOT.glob("docs/*.md")]
)
_TITLE = r"[\"“]([^\"”\n]{2,80})[\"”]"
_CITATION = re.compile(
    r"(?<![\w/.-])(docs/)?(\w+)\.md[,;:]?\s*(?:(?:the\s+)?sections?\s+(?P<numbers>\d+(?:\.\d+)?(?:(?:\s*,\s*|\s+and\s+)\d+(?:\.\d+)?)*)"
    rf"|(?:section\s+)?(?P<titles>{_TITLE}(?:(?:\s*,\s*|\s+and\s+|\s*,\s*and\s+){_TITLE})*))"
)


def _headings(name: str) -> list[str]:
    path = ROOT / "docs" / f"{name}.md"
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    fenced, found = False, []
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6}\s+(.+?)\s*$", line)):
            found.append(match.group(1))
    return found


def _resolves(title: str, headings: list[str]) -> bool:
    for heading in headings:
        heading = re.sub(r"^\d+(\.\d+)*\.?\s+", "", heading)  # "## 8. What ..." is cited as "What ..."
        if title in (heading, re.split(r": | \(", heading)[0]):
            return True
    return False


def _numbered(number: str, headings: list[str]) -> bool:
    return any(re.match(rf"{re.escape(number)}(\.|\s)", heading) for heading in headings)


def _flat(path: Path) -> str:
    """The text with each line's indentation and comment marks dropped, so a citation may wrap."""
    return " ".join(re.sub(r"^\s*(#(?!#)\s*)?", "", line) for line in path.read_text(encoding="utf-8").splitlines())


def _citations() -> list[tuple[str, str, str]]:
    found = []
    for path in SOURCES:
        for match in _CITATION.finditer(_flat(path)):
            where, doc = str(path.relative_to(ROOT)), match.group(2)
            if not match.group(1) and not (ROOT / "docs" / f"{doc}.md").is_file():
                continue  # another folder's file (bench/RESULTS.md, an upstream project's)
            if match.group("numbers"):
                found += [(where, doc, f"section {n}") for n in re.findall(r"\d+(?:\.\d+)?", match.group("numbers"))]
            else:
                found += [(where, doc, title) for title in re.findall(_TITLE, match.group("titles"))]
    return found


def test_the_citations_are_found():
    cited = {(doc, title) for _, doc, title in _citations()}
    assert ("accuracy", "Sweeps") in cited and ("semantics", "section 7.1") in cited
    assert len(cited) >= 20


@pytest.mark.parametrize(("where", "doc", "title"), sorted(set(_citations())))
def test_a_cited_section_is_a_heading_of_its_document(where, doc, title):
    headings = _headings(doc)
    assert headings, f"{where} cites docs/{doc}.md, which does not exist"
    if title.startswith("section "):
        assert _numbered(title.removeprefix("section "), headings), f"{where}: docs/{doc}.md has no {title}"
    else:
        assert _resolves(title, headings), f"{where}: docs/{doc}.md has no heading {title!r}"
