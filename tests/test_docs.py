"""The documentation stands on its own and stays usable.

- README.md, BENCHMARKS.md, docs/**/*.md and src/**/*.py never send a reader to a team's notes,
  a work session or a commit hash in place of an explanation ("see issue 12's note",
  "session 3", "commit abc1234", "(abc1234)"). Hex elsewhere (sha256 digests in data files,
  JSON, ``0x...`` literals) is not a reference and is not looked at: only Markdown and Python
  files are read, and only the phrasings of a reference are matched.
- README.md stays short and keeps the two commands that matter.
- Every relative link in README.md, BENCHMARKS.md and docs/**/*.md points at a file that exists.
- Every JSON directly under docs/bench/ is named in docs/benchmarks.md, which says what it answers.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 12_288

# 7 to 40 hex digits with at least one letter and one digit: how git abbreviates a commit.
_HEX = r"(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}"

REFERENCES = [
    ("an issue's note", re.compile(r"\bissues?\s+#?\d+(?:'s)?\s+notes?\b", re.IGNORECASE)),
    ("the issue notes", re.compile(r"\bissue\s+notes?\b", re.IGNORECASE)),
    ("a note", re.compile(r"\b(?:in|to|see|from)\s+the\s+(?:team's\s+)?notes?\b", re.IGNORECASE)),
    ("a work session", re.compile(r"\bsessions?\s+#?\d+\b", re.IGNORECASE)),
    ("a commit", re.compile(rf"\bcommits?\s+`?{_HEX}\b")),
    ("a commit", re.compile(rf"\(`?{_HEX}`?[),;:]")),
    ("a commit", re.compile(rf"\b{_HEX}'s\b")),
    ("a throwaway measurement", re.compile(r"/tmp\s+(?:script|measurement|timing)s?\b|\bthrowaway\s+"
                                           r"(?:script|measurement|timing|profile)s?\b", re.IGNORECASE)),
]
# Prose only: which work session of the project's authors measured something means nothing to a reader.
MARKDOWN_ONLY = [
    ("a work session", re.compile(r"\b(?:first|later|earlier|previous|next|other|this|that|GPU|CPU)\s+sessions?\b",
                                  re.IGNORECASE)),
]


def _markdown() -> list[Path]:
    return [p for p in (README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))) if p.is_file()]


def _sources() -> list[Path]:
    return sorted((ROOT / "src").rglob("*.py"))


def _offences(paths: list[Path], patterns: list[tuple[str, re.Pattern[str]]]) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for what, pattern in patterns:
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}")
    return found


def test_the_patterns_catch_references_and_spare_hex_that_is_not_one() -> None:
    def flagged(text: str) -> bool:
        return any(p.search(text) for _, p in REFERENCES + MARKDOWN_ONLY)

    for text in ("see issue 13's note of 2026-11-23", "in issue 12 note", "the issue notes", "in the note",
                 "session 4 measured", "commit 731df23's blocks.json", "commits d7470fe and 302b6fb",
                 "(bcb42a8)", "(`f8ac83c`)", "4a45bcb's copy", "/tmp script", "throwaway measurements",
                 "the first sessions"):
        assert flagged(text), text
    for text in ("sha256 4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04", "0x1f2e3d4c5b",
                 "(1234567)", "(deadbeef)", "a long fit in several runs", "_Session", "for note in notes",
                 "issue a warning", "2026-11-23"):
        assert not flagged(text), text


def test_markdown_never_points_to_notes_sessions_or_commits() -> None:
    found = _offences(_markdown(), REFERENCES + MARKDOWN_ONLY)
    assert not found, "explain instead of pointing to notes, sessions or commits:\n" + "\n".join(found)


def test_sources_never_point_to_notes_sessions_or_commits() -> None:
    found = _offences(_sources(), REFERENCES)
    assert not found, "explain instead of pointing to notes, sessions or commits:\n" + "\n".join(found)


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, more than {README_MAX_BYTES}: move detail to docs/"
    text = README.read_text(encoding="utf-8")
    assert "make run" in text and "make test" in text


_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")
_INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)


def _relative_links(path: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", path.read_text(encoding="utf-8")))
    targets = _INLINE_LINK.findall(text) + _REFERENCE_LINK.findall(text)
    return [t for t in targets if not re.match(r"^(?:[a-z][a-z0-9+.-]*:|#|//)", t, re.IGNORECASE)]


def test_relative_links_point_to_existing_files() -> None:
    broken = []
    for path in _markdown():
        for target in _relative_links(path):
            file = target.split("#", 1)[0].split("?", 1)[0]
            if file and not (path.parent / file).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_link_finder_sees_links_and_skips_code(tmp_path: Path) -> None:
    sample = tmp_path / "sample.md"
    sample.write_text("[a](engine.md#x) ![b](figures/x.png) [c](https://example.com) [d](#anchor)\n"
                      "`[e](not-a-link.md)`\n```\n[f](nor-this.md)\n```\n[g]: ../README.md\n")
    assert _relative_links(sample) == ["engine.md#x", "figures/x.png", "../README.md"]


def test_every_committed_measurement_is_listed() -> None:
    """docs/benchmarks.md's table says what each JSON under docs/bench/ answers and which command
    wrote it; a JSON committed without a row there is a number a reader cannot place."""
    listed = (ROOT / "docs" / "benchmarks.md").read_text()
    unlisted = [p.name for p in sorted((ROOT / "docs" / "bench").glob("*.json")) if f"`{p.name}`" not in listed]
    assert not unlisted, f"docs/bench JSONs missing from docs/benchmarks.md: {unlisted}"
