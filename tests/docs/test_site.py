"""The documentation site builds strictly, and a reader finds every page: in the nav, and within two clicks of the
home page. README.md's relative links and images point at files that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.docs.blocks import DOCS, ROOT

# Inline links and images `[text](target "title")`, reference definitions `[id]: target`, and HTML src/href.
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.MULTILINE)
_HTML = re.compile(r"""<(?:img|a|source)\b[^>]*?\s(?:src|href)=["']([^"']+)["']""", re.IGNORECASE)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


class _MkdocsLoader(yaml.SafeLoader):
    """mkdocs.yml as data: `!!python/name:` and the like (mkdocs resolves them) are read as their names."""


_MkdocsLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)
_MkdocsLoader.add_multi_constructor("!", lambda loader, suffix, node: None)  # !ENV and friends


def mkdocs_config() -> dict[str, Any]:
    return dict(yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_MkdocsLoader))


def pages() -> list[Path]:
    """Every page of the site, as a path relative to docs/ (hidden files are not: mkdocs leaves them out too)."""
    found = (path.relative_to(DOCS) for path in DOCS.rglob("*.md"))
    return sorted(path for path in found if not any(part.startswith(".") for part in path.parts))


def nav_pages(nav: Any) -> Iterator[str]:
    """The pages a mkdocs nav names (its external links left out)."""
    if isinstance(nav, str):
        if "://" not in nav:
            yield nav
    elif isinstance(nav, list):
        for item in nav:
            yield from nav_pages(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            yield from nav_pages(value)


def prose(text: str) -> str:
    """`text` without its fenced code blocks (a link in an example is not a link of the page)."""
    kept, fence = [], None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None and match is not None:
            fence = match[1]
        elif fence is not None and line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
            fence = None
        elif fence is None:
            kept.append(line)
    return re.sub(r"`[^`\n]*`", "", "\n".join(kept))


def link_targets(text: str) -> list[str]:
    """Every link and image target of a Markdown text, in order."""
    body = prose(text)
    return [*_INLINE_LINK.findall(body), *_REFERENCE.findall(body), *_HTML.findall(body)]


def relative_target(target: str) -> str | None:
    """The file part of a relative link (None: an absolute URL, a mail address or an anchor of the same page)."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    return target.split("#", 1)[0].split("?", 1)[0] or None


def linked_pages(page: Path) -> set[Path]:
    """The pages of the site that `page` (relative to docs/) links to, as paths relative to docs/."""
    found = set()
    for target in link_targets((DOCS / page).read_text(encoding="utf-8")):
        file = relative_target(target)
        if file is None or not file.endswith(".md"):
            continue
        resolved = (DOCS / page).parent.joinpath(file).resolve()
        if resolved.is_relative_to(DOCS.resolve()) and resolved.is_file():
            found.add(resolved.relative_to(DOCS.resolve()))
    return found


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.fail(f"{mkdocs} is missing: install the docs extra (pip install -e '.[dev]' includes it)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))]
    if result.returncode != 0:
        pytest.fail("mkdocs build --strict failed:\n" + "\n".join(warnings or output.splitlines()[-30:]), pytrace=False)
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_page_is_in_the_nav() -> None:
    named = list(nav_pages(mkdocs_config().get("nav", [])))
    missing_files = [page for page in named if not (DOCS / page).is_file()]
    assert missing_files == [], f"mkdocs.yml's nav names pages that do not exist: {missing_files}"
    left_out = [str(page) for page in pages() if page.as_posix() not in named]
    assert left_out == [], f"pages missing from mkdocs.yml's nav: {left_out}"


def test_every_page_is_two_clicks_from_the_home_page() -> None:
    home = Path("index.md")
    one_click = linked_pages(home)
    two_clicks = set().union(*(linked_pages(page) for page in one_click)) if one_click else set()
    reached = {home} | one_click | two_clicks
    far = [str(page) for page in pages() if page not in reached]
    assert far == [], f"pages more than two clicks from docs/index.md (link them from it or a page it links): {far}"


def test_readme_links_and_images_exist() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [target for target in link_targets(text) if relative_target(target) is not None]
    assert targets, "README.md links nothing relative: the link extraction is broken"
    broken = sorted({target for target in targets if not (ROOT / str(relative_target(target))).exists()})
    assert broken == [], f"README.md links files that do not exist: {broken}"
    into_docs = [target for target in targets if "#" in target and target.split("#")[0].endswith(".md")]
    no_anchor = [target for target in into_docs if target.split("#", 1)[1] not in anchors(ROOT / target.split("#")[0])]
    assert no_anchor == [], f"README.md links sections that do not exist: {no_anchor}"


def anchors(page: Path) -> set[str]:
    """The ids of a page's headings, as the site makes them (Python-Markdown's toc), and its explicit HTML ids."""
    import markdown

    text = page.read_text(encoding="utf-8")
    converter = markdown.Markdown(extensions=["toc", "attr_list", "fenced_code", "tables", "admonition"])
    converter.convert(text)

    def ids(tokens: list[dict[str, Any]]) -> Iterator[str]:
        for token in tokens:
            yield token["id"]
            yield from ids(token["children"])

    return {*ids(converter.toc_tokens), *re.findall(r"""\bid=["']([^"']+)["']""", text)}


def test_anchors_are_the_sites(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# The agent\n\n## Ports: `8000` and 8001\n\n```sh\n# not a heading\n```\n## Own {#own-id}\n"
                    '<a id="raw"></a>\n## The agent\n', encoding="utf-8")  # fmt: skip
    assert anchors(page) == {"the-agent", "ports-8000-and-8001", "own-id", "raw", "the-agent_1"}


def test_links_are_extracted_as_a_reader_follows_them() -> None:
    text = (
        'See [the agent](agent/index.md#ports), ![a chart](screenshots/fleet.png "Fleet") and [REST][rest].\n'
        "<img src='docs/screenshots/device.png' width=400> and [the site](https://example.com/x.md), [top](#top).\n"
        "`[not](code.md)`\n```text\n[not a link](example.md)\n```\n\n[rest]: api/rest.md\n"
    )
    targets = [relative_target(target) for target in link_targets(text)]
    assert targets == [
        "agent/index.md",
        "screenshots/fleet.png",
        None,
        None,
        "api/rest.md",
        "docs/screenshots/device.png",
    ]
    nav = ["index.md", {"Agent": ["agent/index.md", {"Models": "agent/models.md"}]}, {"GitHub": "https://x.org/y"}]
    assert list(nav_pages(nav)) == ["index.md", "agent/index.md", "agent/models.md"]
