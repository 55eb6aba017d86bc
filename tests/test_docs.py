"""The README and docs/: relative links resolve, every page is reachable, and the README's commands are CI's.

Fast and model-free: it reads Markdown and shell scripts only. Anchors are checked against GitHub's
heading slugs, the renderer these plain Markdown pages are written for.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _without_code(text: str) -> str:
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (a repeated slug gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    result = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(page: Path) -> list[str]:
    """Link targets outside code that name no scheme (``http:``, ``mailto:``, ...)."""
    return [target for target in _LINK.findall(_without_code(page.read_text(encoding="utf-8")))
            if not _SCHEME.match(target)]


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file, or whose anchor in that file, does not exist."""
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{target}: no heading #{anchor}")
    return broken


def test_every_relative_link_resolves() -> None:
    broken = {page.relative_to(ROOT).as_posix(): broken_links(page) for page in pages()}
    assert {page: links for page, links in broken.items() if links} == {}


def test_the_link_check_finds_a_missing_file_or_heading_and_ignores_code(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading's text\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md) [ok](other.md#a-code-headings-text) [ok](#page) [web](https://example.com)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) `[in code](missing-too.md)`\n\n"
        "```md\n[in a fence](missing-three.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page) == ["missing.md: no such file", "other.md#nowhere: no heading #nowhere"]


def test_every_docs_page_is_listed_in_the_index_and_the_readme_links_the_index() -> None:
    listed = {target.partition("#")[0] for target in relative_links(DOCS / "index.md")}
    assert {page.name for page in DOCS.glob("*.md")} - {"index.md"} <= listed
    assert "docs/index.md" in relative_links(ROOT / "README.md")


def _readme_commands() -> list[list[str]]:
    """The commands in the shell block of the README's "The two commands" section."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## The two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```sh\n(.*?)^```", section, re.M | re.S)
    assert block is not None, "the section has no sh block"
    return [shlex.split(line, comments=True) for line in block.group(1).splitlines() if line.strip()]


def _ci_tools_run_commands() -> list[list[str]]:
    """Each ``tools/run ...`` that .ci/run executes (up to a ``||``), as words."""
    commands = []
    for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["tools/run"]:
            commands.append(words[: words.index("||")] if "||" in words else words)
    return commands


def test_the_readme_commands_are_what_ci_runs() -> None:
    demo, tests = _readme_commands()
    assert demo == ["tools/run", "llama-cache", "demo"]
    assert tests == ["tools/run", "pytest"]
    # CI runs the README's test command, quieter; nothing else through tools/run.
    assert _ci_tools_run_commands() == [tests + ["-q"]]
    # And the demo: .ci/run runs tools/check_wheel, which runs `llama-cache demo` from the installed wheel.
    assert re.search(r"^tools/check_wheel\b", (ROOT / ".ci" / "run").read_text(encoding="utf-8"), re.M)
    check_wheel = (ROOT / "tools" / "check_wheel").read_text(encoding="utf-8")
    assert re.search(r"^step .* llama-cache demo\b", check_wheel, re.M)
