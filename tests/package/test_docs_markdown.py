"""README.md and docs/*.md render as written: every code fence closes where a reader thinks it does.

A closing fence followed by text (```` ``` snake_case aliases...````) is not a closing fence in
CommonMark, so GitHub shows the rest of the file, headings included, as code. The oracle: a reader's
scan (a line starting with ``` opens or closes a block) and a CommonMark parser (markdown-it-py) must
find the same headings, and no fenced block may contain a heading line or a would-be fence.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
HEADING = re.compile(r"^(#{1,6}) +(\S.*?)\s*#*\s*$")


def _headings_as_a_reader_sees_them(text: str) -> list[str]:
    headings, in_code = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and (match := HEADING.match(line)):
            headings.append(match.group(2))
    return headings


def _parse(text: str) -> list:
    return MarkdownIt("commonmark").parse(text)


def _headings_as_commonmark_sees_them(text: str) -> list[str]:
    tokens = _parse(text)
    return [tokens[i + 1].content for i, tok in enumerate(tokens) if tok.type == "heading_open"]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_fenced_blocks_hold_no_headings_and_close_cleanly(path: Path) -> None:
    text = path.read_text()
    for token in _parse(text):
        if token.type != "fence":
            continue
        where = f"{path.name}:{token.map[0] + 1}"
        for line in token.content.splitlines():
            assert not re.match(r"^#{2,6} +\S", line), f"{where}: a fenced block swallows the heading {line!r}"
            assert not line.lstrip().startswith("```"), f"{where}: a fence with text after it does not close: {line!r}"
    assert _headings_as_commonmark_sees_them(text) == _headings_as_a_reader_sees_them(text)


def test_the_check_catches_text_after_a_closing_fence() -> None:
    broken = "# Top\n\n```python\nx = 1\n``` aliases: y\n\n## Use 2\n\n```bash\nls\n```\n"
    assert _headings_as_a_reader_sees_them(broken) == ["Top", "Use 2"]
    assert _headings_as_commonmark_sees_them(broken) == ["Top"]
