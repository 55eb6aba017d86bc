"""The benchmark scripts' own logic: the settings they give each side, their order, summaries and verdicts."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import serve, servers
from benchmarks.machine import machine
from llama_cache.testing.redis_server import redis_available

ROOT = Path(__file__).resolve().parent.parent


def _llama_cpp_python_settings(command: list[str]) -> Any:
    """The model settings llama-cpp-python's server builds from ``command`` (``python -m llama_cpp.server ...``),
    parsed the way its ``__main__`` parses them."""
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, Settings

    assert command[1:3] == ["-m", "llama_cpp.server"]
    parser = argparse.ArgumentParser()
    add_args_from_model(parser, Settings)
    return parse_model_from_args(ModelSettings, parser.parse_args(command[3:]))


def test_llama_cpp_python_keeps_no_scores_matrix_in_the_equal_row_only(tmp_path: Path) -> None:
    settings = servers.Settings(n_ctx=2048, parallel=4, threads=2, flash_attn=True)
    model = tmp_path / "model.gguf"
    equal = _llama_cpp_python_settings(servers.server_command("llama-cpp-python", model, settings, 8000, None))
    defaults = _llama_cpp_python_settings(servers.server_command("llama-cpp-python-defaults", model, settings, 8000, None))
    assert equal.logits_all is False
    assert (equal.n_ctx, equal.n_threads, equal.n_threads_batch, equal.n_batch, equal.flash_attn) == (
        2048, 2, 2, 512, True)
    assert defaults.logits_all is True  # its own default, as its users run it
    assert defaults.n_ctx == 2048


def test_every_server_runs_once_in_every_position() -> None:
    names = ["llama-cache", "llama-server", "llama-cpp-python", "llama-cpp-python-defaults"]
    orders = [servers.rotation(names, round_number) for round_number in range(len(names))]
    assert all(sorted(order) == sorted(names) for order in orders)
    for position in range(len(names)):
        assert sorted(order[position] for order in orders) == sorted(names)
    assert servers.rotation(names, len(names)) == names


def _run(server: str, concurrency: int, later_p50: float, whole: float) -> dict[str, Any]:
    return {"server": server, "concurrency": concurrency, "ttft_first_p50": 1.0, "ttft_first_p95": 1.0,
            "ttft_later_p50": later_p50, "ttft_later_p95": later_p50, "whole_run_s": whole,
            "interrupted_streams": 0, "load_average": [1.0, 2.0]}


def test_targets_are_ratios_of_medians_with_spreads_and_verdicts() -> None:
    ours = [(0.10, 20.0), (0.12, 21.0), (0.50, 60.0)]  # one slow round: a mean would miss every target
    theirs = [(0.13, 20.0), (0.14, 22.0), (0.11, 19.0)]
    slow = [(0.70, 45.0), (0.60, 41.0), (0.65, 43.0)]
    runs = {"llama-cache": ours, "llama-server": theirs, "llama-cpp-python": slow}
    results = {"servers": {name: [_run(name, 1, later, whole) for later, whole in rows]
                           for name, rows in runs.items()}}
    summary = serve._summary(results)
    row = summary["llama-cache"]["1"]
    assert row["rounds"] == 3
    assert row["ttft_later_p50"] == 0.12
    assert row["ttft_later_p50_spread"] == [0.10, 0.50]
    assert row["whole_run_s_spread"] == [20.0, 60.0]
    targets = serve._targets(summary)["1"]
    later = targets["later_vs_llama_server"]
    assert later["ratio"] == 0.12 / 0.13
    assert later["ratio_range"] == [0.10 / 0.14, 0.50 / 0.11]
    assert (later["target"], later["verdict"]) == ("<= 0.90x", "not met")  # one user: #26's bound
    assert "later_p95_vs_llama_server" not in targets  # set for 4 users only
    assert targets["whole_vs_llama_server"]["ratio"] == 21.0 / 20.0
    assert targets["whole_vs_llama_server"]["verdict"] == "met"
    assert targets["later_speedup_over_llama-cpp-python"]["ratio"] == 0.65 / 0.12
    assert targets["later_speedup_over_llama-cpp-python"]["verdict"] == "met"
    assert targets["whole_speedup_over_llama-cpp-python"]["ratio"] == 43.0 / 21.0
    assert targets["whole_speedup_over_llama-cpp-python"]["verdict"] == "met"
    assert targets["later_speedup_over_llama-cpp-python-defaults"]["verdict"] == "not measured"
    assert targets["key_whole_vs_no_key"]["verdict"] == "not measured"
    results["servers"]["llama-server"] = [_run("llama-server", 1, 0.20, whole) for _, whole in theirs]
    assert serve._targets(serve._summary(results))["1"]["later_vs_llama_server"]["verdict"] == "met"
    # With flash attention on too (llama-server+fa), the ratio is against the better side.
    results["servers"]["llama-server+fa"] = [_run("llama-server+fa", 1, 0.125, whole) for _, whole in theirs]
    later = serve._targets(serve._summary(results))["1"]["later_vs_llama_server"]
    assert (later["ratio"], later["verdict"]) == (0.12 / 0.125, "not met")
    # With flash attention off too (llama-server+nofa, when ours is on), likewise its better side.
    del results["servers"]["llama-server+fa"]
    results["servers"]["llama-server+nofa"] = [_run("llama-server+nofa", 1, 0.124, whole) for _, whole in theirs]
    later = serve._targets(serve._summary(results))["1"]["later_vs_llama_server"]
    assert (later["ratio"], later["verdict"]) == (0.12 / 0.124, "not met")


def test_machine_names_the_checkouts_version_without_package_metadata() -> None:
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared is not None
    described = machine()
    assert described["llama_cache"] == declared.group(1)
    assert described["logical_cpus"] == os.cpu_count()
    assert described["memory_bytes"] > 0
    assert len(described["load_average_start"]) == 3


def test_lookup_runs_from_a_checkout_that_is_not_installed(tmp_path: Path) -> None:
    """Run from a checkout on PYTHONPATH, as ``tools/run`` runs it, with llama-cache's package metadata
    unreadable (no egg-info, no dist-info), the smallest size: the JSON is written, with the machine."""
    out = tmp_path / "lookup.json"
    hide_metadata = (
        "import importlib.metadata as m, runpy, sys\n"
        "real = m.version\n"
        "def version(name):\n"
        "    if name.replace('_', '-') == 'llama-cache':\n"
        "        raise m.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "m.version = version\n"
        f"sys.argv = ['lookup.py', '--sizes', '10', '--out', {str(out)!r}]\n"
        f"runpy.run_path({str(ROOT / 'benchmarks' / 'lookup.py')!r}, run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", hide_metadata], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [size["entries"] for size in report["sizes"]] == [10]
    assert report["machine"]["llama_cache"] is not None
    assert set(report["targets"]) == {"llama_cache.LlamaRAMCache", "llama_cache.LlamaTrieCache",
                                      "llama_cache.LlamaRAMCache, numpy query", "llama_cache.LlamaTrieCache, numpy query"}


def test_the_engine_benchmark_gives_each_server_the_same_pool_and_judges_medians(tmp_path: Path) -> None:
    from benchmarks import serve_engine

    settings = servers.Settings(n_ctx=4096, parallel=8, threads=2, flash_attn=True)
    model = Path("model.gguf")
    ours = serve_engine.command_for("llama-cache", model, settings, 9000, None, None, tmp_path)
    assert ours is not None and ours[ours.index("--n-ctx") + 1] == str(4096 * 8)
    assert ours[ours.index("--cache-ram") + 1] == str(serve_engine.CACHE_RAM_MIB << 20)
    example = serve_engine.command_for("example-server", model, settings, 9001, None, Path("server.py"), tmp_path)
    assert example is not None and example[1:3] == ["server.py", "--config-file"]
    config = json.loads(Path(example[3]).read_text())["model"]
    assert (config["n_ctx"], config["n_seq_max"], config["threads"], config["kv_unified"]) == (4096 * 8, 8, 2, True)
    assert serve_engine.command_for("llama-server", model, settings, 9002, None, None, tmp_path) is None

    def run(tokens_per_s: float, first: float) -> dict[str, Any]:
        return {"tokens_per_s": tokens_per_s, "ttft_first_p50": first, "ttft_later_p50": 1.0, "ttft_later_p95": 2.0,
                "gap_p50": 0.1, "peak_rss": 1e9, "seconds": 100.0}

    results: dict[str, Any] = {"runs": {"decode": {
        "llama-cache": [run(30.0, 5.0), run(36.0, 6.0), run(10.0, 20.0)],  # one slow round: medians ignore it
        "example-server": [run(25.0, 10.0), run(24.0, 9.0), run(26.0, 11.0)]}}}
    results["summary"] = serve_engine.summarise(results, {})
    results["engine_step"], results["batched_bench"] = {"step_s": 0.1}, {"steps": {"8": {"step_s": 0.09}}}
    targets = serve_engine.targets(results)
    assert targets["throughput_vs_example_server"]["value"] == 30.0 / 25.0
    assert targets["throughput_vs_example_server"]["met"] is True
    assert targets["first_ttft_vs_example_server"]["value"] == 6.0 / 10.0
    assert targets["throughput_vs_llama_server"] == {"value": None, "target": 1.4, "met": None}
    assert targets["step_vs_batched_bench"]["value"] == 0.1 / 0.09 and targets["step_vs_batched_bench"]["met"]
    # The anchor with the other flash-attention setting: its own command, and its better side counts.
    other = serve_engine.command_for("example-server+nofa", model, settings, 9003, None, Path("server.py"), tmp_path)
    assert other is not None and json.loads(Path(other[3]).read_text())["model"]["flash_attn"] is False
    results["runs"]["decode"]["example-server+nofa"] = [run(33.0, 9.0), run(34.0, 9.0), run(32.0, 9.0)]
    results["summary"] = serve_engine.summarise(results, {})
    targets = serve_engine.targets(results)
    assert targets["throughput_vs_example_server"]["value"] == 30.0 / 33.0
    assert targets["throughput_vs_example_server"]["met"] is False


@pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")
def test_the_redis_benchmark_hits_in_its_fresh_processes(tmp_path: Path) -> None:
    """Its disk and Redis rows time a hit in a process of their own: a short prompt's state is found and
    restored there (a wrapper that dropped the cache's arguments once made every such lookup a miss)."""
    out = tmp_path / "redis_tier.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "redis_tier.py"), "--quick", "--sections", "ttft",
                           "--repeat", "1", "--prompt-tokens", "64", "--threads", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads(out.read_text())["ttft"]["runs"]
    for shape, most in (("exact", 0), ("suffix", 12)):
        assert all(run["evaluated"] > 60 for run in runs[shape]["cold"])
        for setup in ("ram", "disk", "redis"):
            assert all(run["evaluated"] <= most for run in runs[shape][setup]), (shape, setup, runs[shape][setup])
        for setup in ("disk", "redis"):
            assert all(run["lookup_s"] is not None and run["restore_s"] is not None for run in runs[shape][setup])


@pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")
def test_the_write_through_benchmark_runs_on_the_engine_server(tmp_path: Path) -> None:
    """It switches the served tiered cache's write-through per turn and times both modes' last chunks
    (it once looked the cache up on an attribute the server no longer has)."""
    out = tmp_path / "write_through.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "write_through.py"), "--turns", "2",
                           "--document-words", "60", "--max-tokens", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    for mode in ("on", "off"):
        assert len(result["raw"][mode]["last_chunk"]) == 2 and result["raw"][mode]["answer"][0] > 0
    assert [verdict["target"] for verdict in result["verdicts"]] == [
        "last chunk <= 10 ms later with write-through on", "whole answer <= 1.05x write-through off"]
