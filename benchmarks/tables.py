"""Write the benchmark tables of the README and ``docs/`` from the committed result files.

Every table (and every number in the sentences beside it) is rendered from
``benchmarks/results/<script>.json``, which each script in ``benchmarks/`` writes, so a table cannot
drift from its data. In the Markdown, a generated block sits between ``<!-- table:NAME -->`` and
``<!-- /table:NAME -->``; the rest of the page is written by hand and carries no measured number.

    python benchmarks/tables.py          # rewrite every block from the result files
    python benchmarks/tables.py --check  # exit 1, naming each block that differs (tests/test_docs.py runs it)

The renderers are in ``benchmarks/table_blocks.py``; a block whose result file is absent is reported,
never left silently stale.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import table_blocks  # noqa: E402,F401  (registers every block)
from benchmarks.report import REPO, RENDERERS, MissingResult, Results  # noqa: E402

PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
BLOCK = re.compile(r"(<!-- table:(?P<name>[a-z0-9_-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.DOTALL)


# Writing -----------------------------------------------------------------------------------------


def rendered(page: str, results: Results) -> tuple[str, list[str]]:
    """``page`` with every block rendered, and the problems found (unknown blocks, missing files)."""
    problems: list[str] = []

    def fill(match: re.Match[str]) -> str:
        name = match["name"]
        renderer = RENDERERS.get(name)
        if renderer is None:
            problems.append(f"no renderer for block {name!r}")
            return match[0]
        try:
            body = renderer(results).rstrip("\n") + "\n"
        except MissingResult as missing:
            problems.append(f"{name}: {missing}")
            return match[0]
        except (KeyError, IndexError, TypeError) as error:  # a file of an interrupted run, or of an older script
            problems.append(f"{name}: its result file lacks what the table shows ({type(error).__name__}: {error})")
            return match[0]
        return match[1] + body + match[4]

    return BLOCK.sub(fill, page), problems


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def drift(pages: Sequence[Path] = PAGES, results: Results | None = None) -> list[str]:
    """Each block whose text differs from what its result files render, and each problem found."""
    results = results or Results()
    found: list[str] = []
    for path in pages:
        text = path.read_text()
        new, problems = rendered(text, results)
        shown = _shown(path)
        found += [f"{shown}: {p}" for p in problems]
        old_blocks = {m["name"]: m["body"] for m in BLOCK.finditer(text)}
        for match in BLOCK.finditer(new):
            if old_blocks.get(match["name"]) != match["body"]:
                found.append(f"{shown}: block {match['name']!r} differs from its results")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    args = parser.parse_args(argv)
    if args.check:
        found = drift()
        print("\n".join(found) or "every table matches its results")
        return 1 if found else 0
    results = Results()
    status = 0
    for path in PAGES:
        text = path.read_text()
        new, problems = rendered(text, results)
        for problem in problems:
            print(f"{_shown(path)}: {problem}", file=sys.stderr)
            status = 1
        if new != text:
            path.write_text(new)
            print(f"rewrote {_shown(path)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
