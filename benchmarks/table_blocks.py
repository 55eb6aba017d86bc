"""Every generated block of the README and ``docs/``, one renderer per block, from the result files.

A renderer reads only ``benchmarks/results/*.json`` (through :class:`benchmarks.report.Results`) and
states each number with the conditions of its run and the script's own verdict.
"""

from __future__ import annotations

from typing import Any

from benchmarks.report import Results, conditions, ms, num, ratio, renders, spread, table, verdict


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{num(value)} s"


# Serving: structured outputs and n (benchmarks/serve_structured.py) ------------------------------

STRUCTURED_CASES = {"small_object": "small object", "nested_arrays": "nested object with arrays", "enum": "enum",
                    "pattern": "string pattern", "json_object": "`json_object`"}


@renders("serve-structured")
def serve_structured(results: Results) -> str:
    run = results["serve_structured"]
    ours, theirs = run["summary"]["llama-cache"]["structured"], run["summary"]["llama-server"]["structured"]
    targets = run["targets"]["structured"]
    rows = []
    for case, label in STRUCTURED_CASES.items():
        mine, target = ours[case], targets[case]
        rows.append([
            label,
            f"{ratio(target['per_token_overhead']['ratio'])} ({num(mine['constrained']['per_token_ms']['median'])}"
            f" / {num(mine['unconstrained']['per_token_ms']['median'])} ms): "
            f"{verdict(target['per_token_overhead']['verdict'])}",
            f"{ratio(target['per_token_vs_llama_server']['ratio'], 3)}: "
            f"{verdict(target['per_token_vs_llama_server']['verdict'])}",
            f"{num(mine['constrained']['ttft_ms']['median'])} ({num(theirs[case]['constrained']['ttft_ms']['median'])})",
            f"{spread(mine['constrained']['per_token_ms'])} / {spread(theirs[case]['constrained']['per_token_ms'])}",
        ])
    settings = run["servers_settings"]
    head = (f"Both servers with n_ctx {settings['n_ctx']} per request, {settings['parallel']} slots, "
            f"{settings['threads']} threads, batch {settings['n_batch']}, flash attention "
            f"{'on' if settings['flash_attn'] else 'off'}; {run['rounds']} rounds, order rotated, each server started "
            f"afresh per round; greedy, streamed, `max_tokens` {run['structured']['max_tokens']}. Targets: constrained "
            "at most 1.2x unconstrained per token, and no slower than llama-server's constrained path.")
    return "\n\n".join([
        head,
        table(["case", "ours per token, constrained / unconstrained (median ms)",
               "ours / llama-server's constrained path, per token", "TTFT constrained, ms: ours (llama-server's)",
               "per token constrained, ms: ours / llama-server's, median (min-max)"], rows),
        conditions(run),
    ])


@renders("serve-structured-n")
def serve_structured_n(results: Results) -> str:
    run = results["serve_structured"]
    ours, theirs = run["summary"]["llama-cache"]["n"], run["summary"]["llama-server"]["n"]
    target = run["targets"]["n"]
    settings = run["n"]
    rows = [
        ["prompt evaluated once", f"{num(ours['n4']['evaluated']['median'], 0)} of "
         f"{num(ours['n4']['prompt_tokens']['median'], 0)} tokens ({target['prompt_evaluated_once']['rounds']})",
         verdict(target["prompt_evaluated_once"]["verdict"])],
        [f"`n = {settings['n']}` wall time / one prompt evaluation + {settings['n']} generations",
         f"{ratio(target['wall_vs_prompt_plus_4_generations']['ratio'])} ({_seconds(ours['n4']['wall_s']['median'])})",
         f"<= {target['wall_vs_prompt_plus_4_generations']['target']}x: "
         f"{verdict(target['wall_vs_prompt_plus_4_generations']['verdict'])}"],
        [f"`n = {settings['n']}` / {settings['n']} separate requests", ratio(target["wall_vs_separate4"]), "-"],
        [f"`n = {settings['n']}` / llama-server's `n = {settings['n']}`",
         f"{ratio(target['wall_vs_llama_server'])} (llama-server {_seconds(theirs['n4']['wall_s']['median'])})", "-"],
    ]
    return "\n\n".join([
        f"Fresh ~{settings['prompt_words']}-word prompts, {settings['max_tokens']} tokens per choice, temperature "
        f"{settings['temperature']}, medians over {run['rounds']} rounds:",
        table(["what", "measured", "target"], rows),
        conditions(run),
    ])


# Serving: write-through (benchmarks/write_through.py) --------------------------------------------

@renders("write-through")
def write_through(results: Results) -> str:
    run = results["write_through"]
    summary, settings = run["summary"], run["settings"]
    rows = [[mode, spread(summary[mode]["last_chunk"], ms, " ms"), spread(summary[mode]["answer"], ms, " ms")]
            for mode in ("on", "off")]
    return "\n\n".join([
        f"One conversation per mode, {settings['turns']} turns on a ~{settings['document_words']}-word document, "
        f"{settings['max_tokens']} tokens per answer; median (min-max) over the turns:",
        table(["`--redis-write-through`", "last chunk after the one before it", "whole answer"], rows),
        f"Write-through adds {num(run['cost_ms'], 0)} ms to the last chunk (the median difference).",
        conditions(run),
    ])


# Serving: scale-out behind nginx (benchmarks/scale.py) -------------------------------------------

@renders("scale")
def scale(results: Results) -> str:
    run = results["scale"]
    rows = []
    for setup, summary in run["summary"].items():
        rates = " / ".join(f"{rate:.0%}" for rate in summary["hit_rate_per_instance"])
        rows.append([setup, num(summary["ttft_turn1"]["median"]), num(summary["ttft_turn2"]["median"]),
                     num(summary["ttft_later"]["median"]), rates, _seconds(summary["whole_run_s"]["median"])])
    head = (f"{run['conversations']} conversations of {run['turns']} turns on their own ~{run['system_tokens']:,}-token "
            f"documents, {run['max_tokens']} tokens per answer, moved to another instance at every turn; every "
            f"instance `--parallel {run['parallel']}`, {run['threads']} thread(s), n_ctx {run['n_ctx']}; "
            f"{run['rounds']} rounds, order rotated; {run['balancer']}. Time to first token in seconds, median over "
            "every turn of every round:")
    return "\n\n".join([
        head,
        table(["setup", "turn 1 (cold)", "turn 2 (moved)", "later turns", "hit rate per instance", "whole run"], rows),
        "The script's verdicts:\n\n" + "\n".join(_scale_verdict(v) for v in run["verdicts"]),
        conditions(run),
    ])


def _scale_verdict(target: dict[str, Any]) -> str:
    value = target["value"]
    shown = {"x": ratio(value), "s": _seconds(value), "share": f"{value:.0%}"}[target["unit"]]
    extra = ""
    if "single_instance" in target:
        extra = f"; a single instance: {_seconds(target['single_instance'])}"
    if "turn2_vs_ours" in target:
        extra = f"; its turn 2 {ratio(target['turn2_vs_ours'])} ours"
    return f"- {target['target']}: {shown}{extra}: {verdict(target['met'])}"


# Caches: lookups and index memory (benchmarks/lookup.py) -----------------------------------------

LOOKUP_CACHES = {"llama_cache.LlamaRAMCache": "ours, `LlamaRAMCache`", "llama_cache.LlamaTrieCache": "ours, `LlamaTrieCache`",
                 "llama_cpp.LlamaRAMCache": "llama-cpp-python's `LlamaRAMCache`"}
LOOKUP_TARGETS = {"lookup_under_1000us_at_10000": "a lookup under 1 ms at 10,000 entries",
                  "speedup_at_least_1000x_at_10000": "at least 1,000x faster than llama-cpp-python's at 10,000 entries",
                  "index_under_16_bytes_per_token_disjoint": "index under 16 B per stored token, keys sharing nothing"}


def _us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{num(value / 1000)} ms" if value >= 1000 else f"{num(value)} us"


@renders("lookup")
def lookup(results: Results) -> str:
    run = results["lookup"]
    rows = []
    for size in run["sizes"]:
        for name, label in LOOKUP_CACHES.items():
            cache = size["caches"].get(name)
            if cache is None:
                continue
            rows.append([f"{size['entries']:,}", label, _us(cache["median_us"]),
                         ratio(cache.get("speedup_vs_theirs"), 0) if cache.get("speedup_vs_theirs") else "-",
                         num(cache["traced_bytes_per_token"], 1)])
    disjoint = run["disjoint_keys"]
    for name, label in LOOKUP_CACHES.items():
        cache = disjoint["caches"].get(name)
        if cache is not None:
            rows.append([f"{disjoint['entries']:,}, sharing nothing", label, "-", "-",
                         num(cache["traced_bytes_per_token"], 1)])
    verdicts = [f"- {label}: " + ", ".join(f"{name.removeprefix('llama_cache.')} {verdict(met[key])}"
                                            for name, met in run["targets"].items())
                for key, label in LOOKUP_TARGETS.items()]
    workload = run["workload"]
    return "\n\n".join([
        f"Keys of about 2,000 tokens (conversations on {workload['system_prompts']} shared system prompts); "
        "queries as Python lists, a third each a stored key plus new tokens, a key diverging in its middle, "
        f"and a miss; median of {workload['our_repetitions']} repetitions for ours and "
        f"{workload['their_repetitions']} for llama-cpp-python's linear scan. Memory is what building the "
        "cache leaves allocated (tracemalloc), per stored token.",
        table(["entries", "cache", "lookup, median", "faster than llama-cpp-python's", "index bytes per token"], rows),
        "The script's verdicts:\n\n" + "\n".join(verdicts),
        conditions(run),
    ])


# Caches: recurrent models (benchmarks/recurrent.py) ----------------------------------------------

@renders("recurrent")
def recurrent(results: Results) -> str:
    run = results["recurrent"]
    rows = []
    for arch, data in run["architectures"].items():
        for mine, theirs in zip(data["ours"], data["theirs"]):
            rows.append([arch, mine["turn"], f"{mine['evaluated']:,}", "-" if mine["bound"] is None else f"{mine['bound']:,}",
                         f"{theirs['evaluated']:,}", num(mine["ttft_ms"], 1), num(theirs["ttft_ms"], 1),
                         num(mine["total_ms"], 1), num(theirs["total_ms"], 1)])
    memory = [f"- {arch}: after {len(data['ours'])} turns ours holds {num(data['memory']['ours_bytes'] / 2**20, 1)} MiB in "
              f"{data['memory']['ours_entries']} entries (+ {num(data['memory']['ours_checkpoint_bytes'] / 2**20)} MiB of "
              f"checkpoints), llama-cpp-python's cache {num(data['memory']['theirs_bytes'] / 2**20, 1)} MiB in "
              f"{data['memory']['theirs_entries']}; target (from turn 2 on, at most the tokens since the latest "
              f"checkpoint): {run['targets'][arch]['within']} of {run['targets'][arch]['turns']} turns within: "
              f"{verdict(run['targets'][arch]['verdict'])}"
              for arch, data in run["architectures"].items()]
    settings = run["settings"]
    return "\n\n".join([
        f"Tiny models the test fixture writes, a {settings['turns']}-turn chat on a ~{settings['history_tokens']:,}-token "
        f"history, checkpoints every {settings['checkpoint_interval']} tokens. Both columns run in our `llama_cache.Llama`; "
        "\"theirs\" is llama-cpp-python's `LlamaRAMCache` set as its cache:",
        table(["model", "turn", "evaluated: ours", "bound", "theirs", "TTFT ms: ours", "theirs", "turn ms: ours",
               "theirs"], rows),
        "\n".join(memory),
        conditions(run),
    ])


# Caches: prompt tokens evaluated where a cache should hit (benchmarks/missed_hits.py) ------------

@renders("missed-hits")
def missed_hits(results: Results) -> str:
    run = results["missed_hits"]
    rows = []
    for scenario, sides in run["scenarios"].items():
        evaluated = {side: values.get("repeat", values.get("evaluated")) for side, values in sides.items()}
        rows.append([scenario, f"{sides['llama-cache']['prompt']:,}", evaluated["llama-cache"],
                     evaluated["llama-cpp-python"]])
    return "\n\n".join([
        table(["scenario", "prompt tokens", "evaluated: llama-cache", "llama-cpp-python"], rows),
        conditions(run),
    ])


# Model identity (benchmarks/fingerprint.py) ------------------------------------------------------

@renders("fingerprint")
def fingerprint(results: Results) -> str:
    run = results["fingerprint"]
    size = run["bytes"]
    rows = [[what, f"{seconds * 1000:,.2f} ms" if seconds < 1 else f"{seconds:.2f} s",
             f"{size / seconds / 1e9:.2f}" if what.startswith("whole file") else "-"]
            for what, seconds in run["seconds"].items()]
    return "\n\n".join([
        f"A {size / 2**30:.0f} GiB file (a 7B model at 4 bits):",
        table(["identity", "time", "GB/s"], rows),
        conditions(run),
    ])


# Restores (benchmarks/restore.py) ----------------------------------------------------------------

RESTORE_KINDS = ("canonical", "view", "turn", "turn head", "turn, assembled", "turn head, assembled")


@renders("restore")
def restore(results: Results) -> str:
    run = results["restore"]
    rows = []
    for path, summary in run["summary"].items():
        for kind in RESTORE_KINDS:
            row = summary["states"].get(kind)
            if row is None:
                continue
            rows.append([f"`{path}`", kind, num(row["first_cpu_ms"], 1), num(row["later_cpu_ms"], 1),
                         ratio(row["first_vs_canonical"]), ratio(row["later_vs_canonical"])])
    first = run["runs"][0]
    sizes, tokens = first["state_bytes"], first["n_tokens"]
    states = ", ".join(f"{kind} {tokens[kind]:,} tokens ({sizes[kind] / 2**20:.1f} MiB)"
                       for kind in ("canonical", "view", "turn", "turn head"))
    verdicts = "\n".join(
        f"- `{path}`: worst ratio {ratio(summary['max_ratio'])} (assembled turns, the path before restore copies: "
        f"{ratio(summary['max_ratio_before'])}); target at most {run['ratio_target']}x: "
        f"{verdict(summary['within_target'])}" for path, summary in run["summary"].items())
    return "\n\n".join([
        f"A {run['prompt_tokens']:,}-token prompt; states: {states}. CPU ms of the restoring thread, median over "
        f"{run['processes']} fresh processes per path of the first restore and of the {run['later']} later ones; "
        "ratios to the canonical state's later restores in the same path:",
        table(["path", "state", "first, CPU ms", "later, CPU ms", "first / canonical", "later / canonical"], rows),
        f"A turn's restore copy costs {first['restore_copy_bytes'] / 2**20:.1f} MiB (shared with its heads), against "
        f"{first['turn_own_bytes'] / 2**20:.2f} MiB of the turn's own KV. The script's verdicts:\n\n{verdicts}",
        conditions(run),
    ])
