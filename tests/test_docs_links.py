"""Every document the repository points users at must be in the repository.

Scans ``kvxferd/``, ``docs/``, ``deploy/``, ``bench/``, ``tests/`` and ``README.md`` (every text
file; this file excepted) for:

* references to documents that live outside the repository: ``../shared``, ``nixl-notes``,
  ``perf.md``;
* ``docs/<name>.md`` paths whose file does not exist;
* section references (``domain.md §5``, ``docs/nixl.md §2``, also ``§9, §10``) to a document of
  ``docs/`` that has no such numbered section (``## 5. ...``). Inside a numbered document of
  ``docs/``, a bare ``§N`` must name one of its own sections.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
ROOTS = ("kvxferd", "docs", "deploy", "bench", "tests", "README.md")
SKIP_DIRS = {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".hypothesis"}
SKIP_SUFFIXES = {".pyc", ".so", ".o", ".whl", ".png", ".jpg", ".gz", ".zip"}

OUTSIDE = re.compile(r"\.\./shared|nixl-notes|perf\.md")
DOC_PATH = re.compile(r"\bdocs/((?:[\w-]+/)*[\w.-]+?)\.md\b")
SECTION_REF = re.compile(r"([\w-]+)\.md`?\s*((?:§\s*\d+)(?:\s*,\s*§\s*\d+)*)")
BARE_SECTION = re.compile(r"§\s*(\d+)")
HEADING = re.compile(r"^##\s+(\d+)\.\s", re.MULTILINE)
TOKEN_STOP = set(" \t\n\"'`()<>[]{}")


def _files() -> Iterator[Path]:
    me = Path(__file__).resolve()
    for root in ROOTS:
        top = REPO / root
        paths = [top] if top.is_file() else sorted(top.rglob("*"))
        for p in paths:
            if not p.is_file() or p.resolve() == me or p.suffix in SKIP_SUFFIXES:
                continue
            if SKIP_DIRS.intersection(p.relative_to(REPO).parts):
                continue
            yield p


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@cache
def _sections(name: str) -> frozenset[int] | None:
    """Numbered sections of ``docs/<name>.md``; None when there is no such document."""
    path = DOCS / f"{name}.md"
    if not path.is_file():
        return None
    return frozenset(int(n) for n in HEADING.findall(path.read_text(encoding="utf-8")))


def _in_url(text: str, start: int) -> bool:
    i = start
    while i > 0 and text[i - 1] not in TOKEN_STOP:
        i -= 1
    return "://" in text[i:start] and not text[i:start].startswith("file://")


def find_problems(text: str, own_doc: str | None = None) -> list[tuple[int, str]]:
    """``(offset, what is wrong)`` for each bad reference in ``text``; ``own_doc`` is the name of
    the numbered document of ``docs/`` that ``text`` is, for its bare ``§N`` references."""
    out = [
        (m.start(), f"points outside the repository: {m.group(0)!r}")
        for m in OUTSIDE.finditer(text)
    ]
    for m in DOC_PATH.finditer(text):
        if not _in_url(text, m.start()) and not (DOCS / f"{m.group(1)}.md").is_file():
            out.append((m.start(), f"names a document that does not exist: docs/{m.group(1)}.md"))
    cited: list[tuple[int, int]] = []
    for m in SECTION_REF.finditer(text):
        cited.append(m.span())
        sections = _sections(m.group(1))
        if sections is None:
            if m.group(1) == "domain":
                out.append((m.start(), f"cites {m.group(0)!r} but docs/domain.md does not exist"))
            continue
        for n in BARE_SECTION.findall(m.group(2)):
            if int(n) not in sections:
                out.append((m.start(), f"cites {m.group(1)}.md §{n}, which has no section {n}"))
    own = _sections(own_doc) if own_doc else None
    if own:
        for m in BARE_SECTION.finditer(text):
            if any(a <= m.start() < b for a, b in cited):
                continue
            if int(m.group(1)) not in own:
                out.append((m.start(), f"cites its own §{m.group(1)}, which does not exist"))
    return sorted(out)


def problems(text: str, own_doc: str | None = None) -> list[str]:
    return [what for _, what in find_problems(text, own_doc)]


def test_every_reference_resolves_inside_the_repository() -> None:
    found = []
    for path in _files():
        text = _text(path)
        if text is None:
            continue
        rel = path.relative_to(REPO)
        own = path.stem if path.parent == DOCS and path.suffix == ".md" else None
        for pos, what in find_problems(text, own):
            found.append(f"{rel}:{text.count(chr(10), 0, pos) + 1}: {what}")
    assert not found, "broken documentation references:\n" + "\n".join(found)


def test_domain_and_nixl_docs_exist_with_consecutive_sections() -> None:
    for name in ("domain", "nixl"):
        sections = _sections(name)
        assert sections, f"docs/{name}.md is missing or has no numbered sections"
        assert sorted(sections) == list(range(1, max(sections) + 1)), sections


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("see ../shared/docs/x.md", "outside"),
        ("(docs/nixl-notes.md)", "outside"),
        ("see `perf.md`", "outside"),
        ("see docs/no-such-page.md", "does not exist"),
        ("domain.md §99", "no section 99"),
        ("docs/domain.md §4, §98", "no section 98"),
        ("`docs/nixl.md` §97", "no section 97"),
    ],
)
def test_the_checker_catches(text: str, needle: str) -> None:
    assert any(needle in p for p in problems(text)), problems(text)


@pytest.mark.parametrize(
    "text",
    [
        "docs/domain.md §5 and domain.md §4, §6",
        "`docs/nixl.md` §2",
        "every key: docs/config.md",
        "file:///opt/kvxferd/docs/config.md",
        "https://example.org/docs/elsewhere.md",
        "docs/data/bench.json",
    ],
)
def test_the_checker_accepts(text: str) -> None:
    assert problems(text) == []


def test_bare_sections_inside_a_numbered_doc() -> None:
    assert problems("as in §3", "domain") == []
    assert problems("as in §42", "domain") == ["cites its own §42, which does not exist"]
