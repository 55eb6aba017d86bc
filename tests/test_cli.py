"""The ``llama-cache`` command on the real default model, with small settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llama_cache.cli import main

pytestmark = pytest.mark.model


def test_demo_prints_a_row_per_turn_and_the_cache_saves_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--turns", "2", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:1] in ("A", "B") and line.split()[1:2] in (["1"], ["2"])]
    assert len(rows) == 4
    # Columns: conv, turn, then (ttft, "(", tokens")") per run; second-turn rows must evaluate fewer
    # tokens with a cache than without.
    for row in rows:
        if row[1] == "2":
            evaluated = [int(cell.strip("()")) for cell in row if cell.endswith(")")]
            assert evaluated[1] < evaluated[0] and evaluated[2] < evaluated[0]
    assert "llama_cache.Llama:" in out


def test_bench_writes_json_and_prints_its_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "bench.json"
    assert main(["bench", "--prompt-tokens", "64", "--turns", "2", "--out", str(out_file)]) == 0
    report = json.loads(out_file.read_text())
    assert {s["scenario"][:3] for s in report["scenarios"]} == {"(a)", "(b)", "(c)"}
    exact = report["scenarios"][0]["evaluated"]
    # The first repeat evaluates the last prompt token again (and caches the prompt's own state), later ones nothing.
    assert exact["ours"] == 1 and exact["cold"] == report["prompt_tokens"]
    assert report["bytes_per_entry"]["ours_ratio"] < report["bytes_per_entry"]["theirs_ratio"]
    assert "JSON written to" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["demo", "--turns", "0"], ["bench", "--prompt-tokens", "3"]])
def test_bad_arguments_exit_with_a_message(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
