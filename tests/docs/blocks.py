"""The fenced blocks of the README and the documentation site, with the check each one asks for.

A block's check is an HTML comment on the last non-blank line before its fence (invisible on GitHub and in the site):

    <!-- check: KIND [ARGS] -->

Shell blocks (`sh`) are parsed by default (each `spillway` command against the CLI, each `curl` against the routes,
...); `run` also runs one (in a scratch folder shared by the page's blocks, in order), `background URL` starts one
and waits until URL answers. YAML blocks must name what they are (`agent-config`, `model-config`, `openslo`, ...);
see tests/docs/test_snippets.py for the kinds and what each is checked with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(?P<indent> {0,4})(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
_CHECK = re.compile(r"^\s*<!--\s*check:\s*(?P<kind>[a-z][a-z0-9-]*)(?P<args>[^>]*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path  # the Markdown file
    line: int  # 1-based line of the opening fence
    lang: str  # the info string's first word ("" when the fence names none)
    code: str  # the block's text, its indentation removed
    check: str | None  # the marker's kind, or None
    args: str  # the marker's arguments ("" when none)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[Path]:
    """README.md and every page of the site (docs/**/*.md), in a stable order."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of one Markdown file, with the check marker before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence, info = match["indent"], match["fence"], match["info"].strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1  # the closing fence
        check, args = None, ""
        j = start - 1
        while j >= 0 and lines[j].strip() == "":
            j -= 1
        if j >= 0 and (marker := _CHECK.match(lines[j])) is not None:
            check, args = marker["kind"], marker["args"].strip()
        lang = info.lstrip("{").split()[0].lstrip(".").rstrip("}") if info else ""
        found.append(Block(path, start + 1, lang, "\n".join(body) + "\n", check, args))
    return found


def all_blocks() -> list[Block]:
    return [block for path in markdown_files() for block in blocks(path)]
