"""The README's and docs' benchmark tables are what the committed result files render.

Model-free: it reads Markdown and ``benchmarks/results/*.json`` only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks import tables
from benchmarks.report import RESULTS, Results

PAGE = """# Page

<!-- table:write-through -->
{body}<!-- /table:write-through -->
"""


def test_every_generated_table_matches_its_committed_results() -> None:
    assert tables.drift() == []  # run `tools/run python benchmarks/tables.py` after a benchmark


def test_every_block_in_the_pages_has_a_renderer_and_every_renderer_a_block() -> None:
    used = {match["name"] for page in tables.PAGES for match in tables.BLOCK.finditer(page.read_text())}
    assert used == set(tables.RENDERERS)


def test_a_changed_number_in_a_table_is_drift(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    body, problems = tables.rendered(PAGE.format(body=""), Results())
    assert problems == []
    page.write_text(body)
    assert tables.drift([page], Results()) == []
    edited = body.replace("| on | ", "| on | 1", 1)
    assert edited != body
    page.write_text(edited)
    assert len(tables.drift([page], Results())) == 1


def test_a_block_whose_result_file_is_missing_is_reported_not_kept(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE.format(body="| stale | table |\n"))
    (found,) = tables.drift([page], Results(tmp_path / "empty"))
    assert "write_through.json is missing" in found


def test_a_number_comes_from_the_result_file(tmp_path: Path) -> None:
    copy = tmp_path / "results"
    copy.mkdir()
    run = json.loads((RESULTS / "write_through.json").read_text())
    run["cost_ms"] = 1234.0
    (copy / "write_through.json").write_text(json.dumps(run))
    body, _ = tables.rendered(PAGE.format(body=""), Results(copy))
    assert "adds 1,234.0 ms" in body
    shutil.rmtree(copy)


def test_a_result_file_of_an_interrupted_run_is_reported(tmp_path: Path) -> None:
    partial = tmp_path / "results"
    partial.mkdir()
    run = json.loads((RESULTS / "write_through.json").read_text())
    del run["summary"]  # a script writes its file as it goes: an interrupted run has no summary yet
    (partial / "write_through.json").write_text(json.dumps(run))
    page = tmp_path / "page.md"
    page.write_text(PAGE.format(body="| kept | as it was |\n"))
    (found,) = tables.drift([page], Results(partial))
    assert "lacks what the table shows" in found and "summary" in found


def test_the_headline_names_every_machine_its_rows_were_measured_on(tmp_path: Path) -> None:
    from benchmarks import table_blocks

    def measured_on(name: str, cpu: str, cores: int) -> None:
        result = json.loads((RESULTS / f"{name}.json").read_text())
        result["machine"] = {**result.get("machine", {}), "cpu": cpu, "physical_cores": cores}
        (tmp_path / f"{name}.json").write_text(json.dumps(result))

    for name in table_blocks.HEADLINE_SCRIPTS:
        measured_on(name, "CPU A", 2)
    one = table_blocks._machines(Results(tmp_path), table_blocks.HEADLINE_SCRIPTS)  # noqa: SLF001
    assert one == "CPU A, 2 cores"
    measured_on("serve", "CPU B", 4)
    both = table_blocks._machines(Results(tmp_path), {"lookup": "a", "bench": "b", "serve": "c"})  # noqa: SLF001
    assert both == "CPU A, 2 cores (`a`, `b`); CPU B, 4 cores (`c`)"
    assert "CPU B, 4 cores (`benchmarks/serve.py`)" in table_blocks.headline(Results(tmp_path))
