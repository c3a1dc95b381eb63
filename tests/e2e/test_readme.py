"""The README stays a page a newcomer reads in five minutes, and stays true: the two commands, every install extra,
and a link to every part of the documentation site (the references it used to carry by hand are generated now:
tests/docs/test_reference.py)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_readme_is_a_page_not_a_manual() -> None:
    assert len(README) < 20_000, f"README.md is {len(README)} characters: move detail into docs/"


def test_the_two_commands_and_every_extra_are_in_the_readme() -> None:
    assert "make demo" in README and "make test" in README
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^([a-z][a-z0-9-]*) = \[", section, re.M)
    assert "controlplane" in extras and "docs" in extras
    missing = [name for name in extras if name != "dev" and f"| `{name}` |" not in README]
    assert missing == [], f"extras missing from the README's install table: {missing}"


def test_the_readme_links_every_section_of_the_site() -> None:
    nav = re.findall(
        r"^  - (?:[^:\n]+: )?(\S+\.md)$|^      - (?:[^:\n]+: )?(\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M
    )
    pages = {a or b for a, b in nav}
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)", README))
    sections = {page.split("/")[0] for page in pages if "/" in page}
    missing = sorted(s for s in sections if not any(link.startswith(s + "/") for link in linked))
    assert missing == [], f"README.md links no page of docs/{missing}"
    assert "index.md" in linked
