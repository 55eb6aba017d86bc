"""Every generated block of the README and ``docs/``, one renderer per block, from the result files.

A renderer reads only ``benchmarks/results/*.json`` (through :class:`benchmarks.report.Results`) and
states each number with the conditions of its run and the script's own verdict.
"""

from __future__ import annotations

import statistics
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
        f"One conversation of {settings['turns']} turns on a ~{settings['document_words']}-word document, "
        f"{settings['max_tokens']} tokens per answer; each turn answered once, then asked again in both modes "
        f"(the same greedy answer on {run.get('same_answers', '?')} of {settings['turns']} turns); "
        "median (min-max) over the turns:",
        table(["`--redis-write-through`", "last chunk after the one before it", "whole answer"], rows),
        f"Write-through adds {num(run['cost_ms'], 1)} ms to the last chunk (the median difference"
        + (", at the same position in a turn, averaged)" if "position" in run["raw"]["on"] else ")")
        + (f"; the whole answer takes {num(run['answer_ratio'], 2)}x as long." if "answer_ratio" in run else "."),
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
                 "llama_cache.LlamaRAMCache, numpy query": "ours, `LlamaRAMCache`, int32 numpy query",
                 "llama_cache.LlamaTrieCache, numpy query": "ours, `LlamaTrieCache`, int32 numpy query",
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
        "queries as Python lists (ours also as int32 numpy arrays), a third each a stored key plus new tokens, "
        f"a key diverging in its middle, and a miss; median of {workload['our_repetitions']} repetitions for ours and "
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


# Time to first token against llama-cpp-python's cache (llama-cache bench) ------------------------

def _chat_restore_ratio(run: dict[str, Any]) -> float | None:
    ratios = [row["ratio"] for row in run["chat_restores"]]
    return statistics.median(ratios) if ratios else None


@renders("bench")
def bench(results: Results) -> str:
    run = results["bench"]
    rows = []
    for scenario in run["scenarios"]:
        ttft, evaluated = scenario["ttft_ms"], scenario["evaluated"]
        restore = "-"
        if scenario["median_restore_ratio"] is not None:
            restore = f"{ratio(scenario['median_restore_ratio'])} ({ratio(scenario['max_restore_ratio'])})"
        rows.append([scenario["scenario"].split(") ", 1)[-1]] +
                    [f"{num(ttft[side], 0)} ms ({evaluated[side]:,})" for side in ("cold", "theirs", "ours")] +
                    [ratio(scenario["ours_vs_theirs"], 1), restore])
    chat = run["chat"]
    turns = len(chat["ours"]["evaluated_per_turn"])
    chat_ratio = _chat_restore_ratio(run)
    rows.append([f"{turns}-turn chat, all turns"] +
                [f"{num(sum(chat[side]['ttft_ms_per_turn']), 0)} ms ({sum(chat[side]['evaluated_per_turn']):,})"
                 for side in ("cold", "theirs", "ours")] +
                [ratio(sum(chat["theirs"]["ttft_ms_per_turn"]) / sum(chat["ours"]["ttft_ms_per_turn"]), 1),
                 "-" if chat_ratio is None else f"{ratio(chat_ratio)} "
                 f"({ratio(max(row['ratio'] for row in run['chat_restores']))})"])
    entry = run["bytes_per_entry"]
    return "\n\n".join([
        f"A {run['prompt_tokens']:,}-token prompt; time to first token, median of 3 variants per scenario (prompt "
        "tokens evaluated in brackets); restores: ours against the same state restored in canonical form, "
        "CPU time, median (slowest):",
        table(["scenario", "cold", "llama-cpp-python's cache", "ours", "ours faster by", "restore / canonical"], rows),
        table(["after the first request", "llama-cache", "llama-cpp-python"], [
            ["bytes the entries hold, against llama.cpp's sequence state",
             f"{ratio(entry['ours_ratio'])} ({entry['ours_entries']:.0f} entries)",
             f"{ratio(entry['theirs_ratio'])} ({entry['theirs_entries']:.0f} entry)"],
            [f"saving a state after {entry['save_new_tokens']:.0f} new tokens", f"{num(entry['ours_save_ms'], 1)} ms",
             f"{num(entry['theirs_save_ms'], 1)} ms"],
            *_save_state_rows(entry),
        ]),
        *_save_state_verdicts(entry),
        conditions(run),
    ])


def _save_state_rows(entry: dict[str, Any]) -> list[list[str]]:
    """The ``save_state()`` rows, when the run measured them."""
    if "ours_save_state_ratio" not in entry:
        return []
    return [
        [f"`save_state()` of {entry['save_state_tokens']:,.0f} tokens on a restored history, bytes against "
         "llama.cpp's sequence state", ratio(entry["ours_save_state_ratio"]), ratio(entry["theirs_save_state_ratio"])],
        ["restoring that state, against its canonical twin (CPU time)", ratio(entry["save_state_restore_ratio"]), "-"],
    ]


def _save_state_verdicts(entry: dict[str, Any]) -> list[str]:
    if "ours_save_state_ratio" not in entry:
        return []
    return ["The script's verdicts:\n\n"
            f"- `save_state()` holds at most 1.10x llama.cpp's bytes: {verdict(entry['ours_save_state_ratio'] <= 1.10)}\n"
            f"- and restores within 1.3x of canonical: {verdict(entry['save_state_restore_ratio'] <= 1.3)}"]


# Serving: structured outputs, the engine (benchmarks/constraints.py) -----------------------------

def _gbnf_outcome(other: dict[str, Any]) -> str:
    """llama-cpp-python's GBNF path on one case, from the phases its child process reported."""
    phases = other["phases"]
    if other["outcome"] == "ok":
        generated, plain = phases["generated"], phases["unconstrained"]
        return f"{ratio(generated['cpu_ms_per_token'] / plain['cpu_ms_per_token'])} per token (CPU)"
    refused = "parsed" in phases and not phases["parsed"]["accepted"]
    where = (f"{phases['sampling']['tokens']} tokens sampled in {phases['sampling']['seconds']:.0f} s"
             if "sampling" in phases else f"after the phase '{other['last_phase']}'")
    return ("llama.cpp refused the grammar; " if refused else "") + f"{other['outcome']}, {where}"


@renders("constraints")
def constraints(results: Results) -> str:
    run = results["constraints"]
    cases, theirs, settings = run["ours"]["cases"], run["gbnf"], run["settings"]
    rows = [[f"`{name}`", f"{num(row['compile_ms'], 1)} ms", f"{num(row['constraint_cpu_us_per_token'], 0)} us",
             ratio(row["cpu_ratio"]), "yes" if row["valid_json"] else "**no**", _gbnf_outcome(theirs[name])]
            for name, row in cases.items()]
    slowest_gil = max(row["max_gil_gap_ms"] for row in cases.values())
    return "\n\n".join([
        f"Default model, greedy, at most {settings['max_tokens']} tokens, {settings['n_threads']} threads; ours: "
        f"medians of {settings['rounds']} rounds; llama-cpp-python's GBNF path (`LlamaGrammar.from_json_schema`) in "
        f"a child process per case, stopped after {settings['gbnf_timeout_s']:g} s:",
        table(["schema", "compile (ours)", "mask per token (ours, CPU)", "CPU per token, constrained / not (ours)",
               "valid JSON (ours)", "llama-cpp-python's GBNF path"], rows),
        f"Compiling held the GIL for at most {num(slowest_gil, 1)} ms. The script's verdict: {run['verdict']}.",
        conditions(run),
    ])


# Redis tier (benchmarks/redis_tier.py) -----------------------------------------------------------

@renders("redis-tier")
def redis_tier(results: Results) -> str:
    run = results["redis_tier"]
    parts = []
    if "ttft" in run:
        ttft = run["ttft"]
        rows = [["exact prompt" if shape == "exact" else f"prompt + {ttft['suffix_tokens']} tokens"] +
                [f"{num(ttft[shape][f'{setup}_ttft_ms'], 0)} ms" for setup in ("cold", "ram", "disk", "redis")] +
                [f"{num(ttft[shape]['redis_lookup_ms'], 0)} / {num(ttft[shape]['redis_restore_ms'], 0)} ms",
                 ttft[shape]["redis_lookup_round_trips"]]
                for shape in ("exact", "suffix")]
        parts += [f"Time to first token of a {ttft['prompt_tokens']:,}-token prompt, median of {ttft['repeat']}; the "
                  "disk and Redis hits in a fresh process:",
                  table(["prompt", "cold", "RAM hit", "disk hit", "Redis hit", "Redis lookup / restore",
                         "round trips"], rows)]
    if "round_trips" in run:
        rows = [[r["shape"], f"{r['entries']:,}", f"{r['hit_round_trips']:.2f} / {_us(r['hit_us'])}",
                 f"{r['match_round_trips']:.2f} / {_us(r['match_us'])}", f"{r['miss_round_trips']:.2f} / {_us(r['miss_us'])}"]
                for r in run["round_trips"]["sizes"]]
        parts += ["Round trips and latency per lookup as entries grow:",
                  table(["keys", "entries", "hit", "`match_length`", "miss"], rows)]
    if "transfer" in run:
        transfer = run["transfer"]
        rows = [["store (SET)", num(transfer["store_mbps"], 0), num(transfer["redis_py_set_mbps"], 0),
                 f"{num(transfer['bench_set_mbps'], 0)} (`{transfer['bench_set_best']}`)"],
                ["lookup (GET)", num(transfer["lookup_mbps_verify_True"], 0), num(transfer["redis_py_get_mbps"], 0),
                 f"{num(transfer['bench_get_mbps'], 0)} (`{transfer['bench_get_best']}`)"]]
        parts += [f"Chunk transfer, MB/s ({int(transfer['chunks'])} chunks of "
                  f"{transfer['chunk_value_bytes'] / 1e3:.0f} KB, a {transfer['state_tokens']:,}-token state):",
                  table(["operation", "`LlamaRedisCache`", "redis-py's own pipeline", "`redis-benchmark`, best"],
                        rows)]
        if "send_new_keys_mbps" in transfer:
            parts.append(f"The same values framed in advance and sent as `SET`s to new keys (Redis faults their "
                         f"pages in; `redis-benchmark` sets one key again and again, allocating nothing): "
                         f"{num(transfer['send_new_keys_mbps'], 0)} MB/s, "
                         f"{transfer['new_keys_vs_bench']:.0%} of `redis-benchmark`'s best: the most a client can "
                         f"store new data at. Our stores reach {transfer['store_vs_new_keys']:.0%} of it.")
    if "memory" in run:
        memory = run["memory"]
        parts.append(f"Redis memory for the dedup workload ({memory['conversations']} conversations x {memory['turns']} "
                     f"turns on a {memory['system_tokens']:,}-token system prompt): "
                     f"{num(memory['used_memory_delta'] / 2**20, 1)} MiB, "
                     f"{ratio(memory['used_memory_delta_vs_floor'], 3)} the floor of "
                     f"{memory['unique_tokens']:,} unique tokens x {memory['kv_bytes_per_token']:,} B "
                     f"({num(memory['floor_bytes'] / 2**20, 1)} MiB).")
    parts += ["The script's verdicts:\n\n" + "\n".join(f"- {target}: {measured}: {verdict(met)}"
                                                       for target, measured, met in run["targets"]),
              conditions(run, f"redis-server {run['redis_server']}")]
    return "\n\n".join(parts)


# Chunked disk tier (benchmarks/dedup.py) ---------------------------------------------------------

def _mb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:,.1f} MB"


def _format_name(chunk: str, default: str) -> str:
    if chunk == "0":
        return "whole states (the format before chunks)"
    return f"chunks of {chunk}" + (" (default)" if chunk == default else "")


@renders("dedup")
def dedup(results: Results) -> str:
    run = results["dedup"]
    workload, floor, kv = run["workload"], run["unique_kv_bytes"], run["kv_bytes_per_token"]
    formats, default, ttft = run["formats"], str(run["default_chunk_tokens"]), run["ttft"]
    theirs = run["llama_cpp_python"]
    rows = [[_format_name(c, default), _mb(formats[c]["unique_bytes"]), ratio(formats[c]["unique_bytes"] / floor, 3),
             f"{_mb(formats[c]['written_mean'])} ({_mb(formats[c]['written_max'])})"] for c in (default, "0")]
    rows.append([f"llama-cpp-python's `LlamaDiskCache`, a {theirs['conversations']} x {theirs['turns']} subset "
                 f"({theirs['entries']} entry kept: a hit pops its entry)", _mb(theirs["bytes_on_disk"]),
                 ratio(theirs["bytes_on_disk"] / (theirs["unique_tokens"] * kv)),
                 f"{_mb(theirs['written_mean'])} ({_mb(theirs['written_max'])})"])

    def hit(label: str, warm: dict[str, Any], fresh: dict[str, Any]) -> list[str]:
        return [label, f"{num(warm.get('ttft_ms'), 0)} ms", f"{num(fresh.get('ttft_ms'), 0)} ms",
                f"{num(warm['lookup_ms'], 1)} + {num(warm['restore_ms'], 1)} ms",
                "-" if not fresh else f"{num(fresh['lookup_ms'], 0)} + {num(fresh['restore_ms'], 0)} ms"]

    same = ttft["same_prompt"]
    hits = [hit(f"{_format_name(c, default)}: the next turn", ttft["warm"][c], ttft["fresh"][c]) for c in (default, "0")]
    hits += [hit(f"{label}: user {ttft['same_prompt_user']}'s turn {ttft['same_prompt_after_turns'] + 1}",
                 same[key]["warm"], same[key]["fresh"])
             for key, label in ((default, _format_name(default, default)), ("0", _format_name("0", default)),
                                ("theirs", "llama-cpp-python's `LlamaDiskCache`"))]
    return "\n\n".join([
        f"{workload['conversations']} conversations x {workload['turns']} turns on a {workload['system_tokens']:,}-token "
        f"system prompt, answers of at most {workload['max_tokens']} tokens (greedy); {workload['completions']} "
        f"completions, {workload['stores']} states stored; the floor: {run['unique_tokens']:,} unique tokens x "
        f"{kv:,} KV bytes per token = {_mb(floor)}.",
        table(["set-up", "bytes on disk (index apart)", "/ floor", "written per completion, mean (max)"], rows),
        "Time to first token on a hit, median; warm: this process, files in the page cache; fresh: a new process, "
        "the directory's files dropped from the page cache:",
        table(["set-up, prompt", "warm", "fresh", "lookup + restore, warm", "lookup + restore, fresh"], hits),
        "The script's verdicts:\n\n" + "\n".join(f"- {t['what']}: {t['value']}: {verdict(t['met'])}"
                                                 for t in run["targets"]),
        conditions(run),
    ])


@renders("dedup-chunks")
def dedup_chunks(results: Results) -> str:
    run = results["dedup"]
    formats, default, floor = run["formats"], str(run["default_chunk_tokens"]), run["unique_kv_bytes"]
    rows = []
    for chunk in sorted(formats, key=lambda c: int(c) or 1 << 30):
        f, hit = formats[chunk], run["ttft"]["warm"][chunk]
        n = len(f["completions"])
        within = f"{f['within']} ({f['chunks_within']}) of {n}" if chunk != "0" else "-"
        rows.append([_format_name(chunk, default), f"{f['data_files']:,}", ratio(f["unique_bytes"] / floor, 3),
                     _mb(f["written_mean"]), within, f"{num(hit['lookup_ms'], 1)} + {num(hit['restore_ms'], 1)} ms"])
    return "\n\n".join([
        table(["chunk_tokens", "files", "on disk / floor", "written per completion", "within new KV + one chunk "
               "(chunk files alone)", "warm next-turn hit: lookup + restore"], rows),
        conditions(run),
    ])


# Serving: multi-user chat (benchmarks/serve.py) ---------------------------------------------------

SERVE_LABELS = {"llama-cache": "llama-cache", "llama-cache-key": "llama-cache with `--api-key`",
                "llama-server": "llama-server", "llama-server+fa": "llama-server, flash attention on",
                "llama-server+nofa": "llama-server, flash attention off",
                "llama-cpp-python": "llama-cpp-python (`cache: true`, equal settings, `logits_all` off)",
                "llama-cpp-python-defaults": "llama-cpp-python (`cache: true`, its defaults)"}
SERVE_TARGETS = {
    "later_vs_llama_server": "later turns p50, ours / llama-server's",
    "later_p95_vs_llama_server": "later turns p95, ours / llama-server's",
    "whole_vs_llama_server": "whole run, ours / llama-server's",
    "later_speedup_over_llama-cpp-python": "later turns, llama-cpp-python's (equal settings) / ours",
    "whole_speedup_over_llama-cpp-python": "whole run, llama-cpp-python's (equal settings) / ours",
    "later_speedup_over_llama-cpp-python-defaults": "later turns, llama-cpp-python's (its defaults) / ours",
    "whole_speedup_over_llama-cpp-python-defaults": "whole run, llama-cpp-python's (its defaults) / ours",
    "key_later_vs_no_key": "later turns, with a key / without",
    "key_whole_vs_no_key": "whole run, with a key / without",
}


def _serve_rows(run: dict[str, Any]) -> list[list[str]]:
    def cell(row: dict[str, Any], key: str) -> str:
        low_high = row[f"{key}_spread"]
        return "-" if row[key] is None else f"{num(row[key])} ({num(low_high[0])}-{num(low_high[1])})"

    rows = []
    concurrencies = sorted({c for per_server in run["summary"].values() for c in per_server}, key=int)
    for concurrency in concurrencies:
        for name, per_server in run["summary"].items():
            row = per_server.get(concurrency)
            if row is not None:
                rows.append([SERVE_LABELS.get(name, name), concurrency, cell(row, "ttft_first_p50"),
                             cell(row, "ttft_later_p50"), cell(row, "ttft_later_p95"), cell(row, "whole_run_s")])
    return rows


def _serve_targets(run: dict[str, Any], keys: bool) -> str:
    lines = []
    for concurrency, each in run["targets"].items():
        for name, target in each.items():
            if name.startswith("key_") != keys or target["verdict"] == "not measured":
                continue
            spread_text = ""
            if target["ratio_range"]:
                spread_text = f" (the rounds allow {ratio(target['ratio_range'][0])}-{ratio(target['ratio_range'][1])})"
            lines.append(f"- concurrency {concurrency}, {SERVE_TARGETS[name]}: {ratio(target['ratio'])}{spread_text}; "
                         f"target {target['target']}: {verdict(target['verdict'])}")
    return "\n".join(lines)


def _serve_settings(run: dict[str, Any]) -> str:
    return (f"{run['users']} users x {run['turns']} turns, {run['max_tokens']} tokens per answer; n_ctx {run['n_ctx']} per "
            f"request, {run['parallel']} contexts/slots where a server has them, {run['threads']} threads, batch "
            f"{run['n_batch']}, flash attention {'on' if run['flash_attn'] else 'off'}; {run['rounds']} rounds, servers "
            "in rotating order. Seconds, median over rounds (min-max):")


@renders("serve")
def serve(results: Results) -> str:
    run = results["serve"]
    return "\n\n".join([
        _serve_settings(run),
        table(["server", "concurrency", "TTFT turn 1, p50", "later turns p50", "later turns p95", "whole run"],
              _serve_rows(run)),
        "The script's verdicts (ratios of medians):\n\n" + _serve_targets(run, keys=False),
        conditions(run, f"llama-server {run['llama_server_version']}" if run.get("llama_server_version") else ""),
    ])


@renders("serve-keys")
def serve_keys(results: Results) -> str:
    run = results["serve_keys"]
    return "\n\n".join([
        _serve_settings(run),
        table(["server", "concurrency", "TTFT turn 1, p50", "later turns p50", "later turns p95", "whole run"],
              _serve_rows(run)),
        "The script's verdicts (ratios of medians):\n\n" + _serve_targets(run, keys=True),
        conditions(run),
    ])


# Serving: under hostile traffic (benchmarks/serve_noisy.py) --------------------------------------

NOISY_TARGETS = {"attack_vs_quiet": "ours under attack / ours quiet",
                 "attack_vs_llama_server": "ours under attack / llama-server under attack",
                 "llama_server_attack_vs_quiet": "llama-server under attack / llama-server quiet",
                 "flood_vs_quiet": "ours under a tokenize/detokenize flood / ours quiet",
                 "llama_server_flood_vs_quiet": "llama-server under the flood / llama-server quiet"}


@renders("serve-noisy")
def serve_noisy(results: Results) -> str:
    run = results["serve_noisy"]

    def cell(row: dict[str, Any], key: str) -> str:
        low_high = row[f"{key}_spread"]
        bound = ">" if row[f"{key}_lower_bound"] else ""
        return "-" if row[key] is None else f"{bound}{num(row[key])} ({num(low_high[0])}-{num(low_high[1])})"

    rows = []
    for name, phases in run["summary"].items():
        for phase, row in phases.items():
            failed = sum(v for v in row["failed"].values())
            rows.append([name, phase, cell(row, "ttft_p50"), cell(row, "ttft_p95"), cell(row, "total_p50"),
                         cell(row, "total_p95"), f"{failed}, died: {row['server_died']}"])
    lines = []
    for name, target in run["targets"].items():
        ratios, states = target["ratios"], target["states"]

        def shown(key: str) -> str:
            top, bottom = states[key]
            sign = ">" if top == "lower" and bottom != "lower" else "<" if bottom == "lower" and top != "lower" else ""
            return "-" if ratios[key] is None else f"{sign}{ratio(ratios[key])}"

        judged = "" if target["target"] is None else (f"; target p95s at most {target['target']:g}x: "
                                                      f"{verdict(target['verdict'])}")
        lines.append(f"- {NOISY_TARGETS[name]}: TTFT p50 {shown('ttft_p50')}, p95 {shown('ttft_p95')}; total p50 "
                     f"{shown('total_p50')}, p95 {shown('total_p95')}{judged}")
    settings, normal = run["servers_settings"], run["normal"]
    return "\n\n".join([
        f"{normal['clients']} clients, {normal['max_tokens']} tokens per answer; {run['attack']['attackers']} attackers "
        f"({', '.join(run['attack']['kinds'])})"
        + (f"; flood phase: {run['flood']['attackers']} clients sending /tokenize and /detokenize"
           if "flood" in run else "")
        + f"; every server {settings['parallel']} slots, n_ctx {settings['n_ctx']} "
        f"per request, {settings['threads']} threads, batch {settings['n_batch']}, flash attention "
        f"{'on' if settings['flash_attn'] else 'off'}; {run['rounds']} rounds, order rotated. Seconds, median over "
        "rounds (min-max):",
        table(["server", "phase", "TTFT p50", "TTFT p95", "total p50", "total p95", "normal requests failed"], rows),
        "The script's verdicts:\n\n" + "\n".join(lines),
        conditions(run),
    ])


# The README's headline table ---------------------------------------------------------------------

HEADLINE_SCRIPTS = {"lookup": "benchmarks/lookup.py", "bench": "llama-cache bench", "restore": "benchmarks/restore.py",
                    "recurrent": "benchmarks/recurrent.py", "serve": "benchmarks/serve.py"}
"""The headline's result files, in row order, and the script that writes each."""


def _machines(results: Results, scripts: dict[str, str]) -> str:
    """Each machine the results were measured on, with its cores; when they differ, the scripts run on each."""
    by_machine: dict[str, list[str]] = {}
    for name, script in scripts.items():
        machine = results[name].get("machine", {})
        label = f"{machine.get('cpu', 'unknown CPU')}, {machine.get('physical_cores', '?')} cores"
        by_machine.setdefault(label, []).append(f"`{script}`")
    if len(by_machine) == 1:
        return next(iter(by_machine))
    return "; ".join(f"{label} ({', '.join(names)})" for label, names in by_machine.items())


@renders("headline")
def headline(results: Results) -> str:
    lookups, bench_run, restores = results["lookup"], results["bench"], results["restore"]
    largest = lookups["sizes"][-1]
    ours_ram, ours_trie = (largest["caches"][f"llama_cache.{name}"] for name in ("LlamaRAMCache", "LlamaTrieCache"))
    theirs_ram = largest["caches"]["llama_cpp.LlamaRAMCache"]
    disjoint = lookups["disjoint_keys"]["caches"]
    entry = bench_run["bytes_per_entry"]
    scenarios = {s["scenario"].split(") ", 1)[-1]: s for s in bench_run["scenarios"]}
    exact, suffix, diverging = (scenarios[k] for k in ("same prompt again", "prompt + short suffix", "diverges at 75%"))
    chat = bench_run["chat"]
    turn = restores["summary"]["load_state"]["states"]["turn"]
    mamba = results["recurrent"]["architectures"]["mamba"]
    later = [t for t in mamba["ours"] if t["turn"] > 1]
    theirs_later = [t for t in mamba["theirs"] if t["turn"] > 1]
    serve_run = results["serve"]["summary"]
    rows = [
        [f"lookup at {largest['entries']:,} cached ~2,000-token keys (RAM / trie cache)",
         f"{_us(ours_ram['median_us'])} / {_us(ours_trie['median_us'])}", f"{_us(theirs_ram['median_us'])} (a scan)"],
        ["index memory per cached token, keys sharing nothing",
         f"{num(disjoint['llama_cache.LlamaRAMCache']['traced_bytes_per_token'], 1)} B",
         f"{num(disjoint['llama_cpp.LlamaRAMCache']['traced_bytes_per_token'], 1)} B"],
        [f"memory per cached {bench_run['prompt_tokens']:,}-token prompt, against llama.cpp's state",
         ratio(entry["ours_ratio"]), ratio(entry["theirs_ratio"])],
        [f"saving a state after {entry['save_new_tokens']:.0f} new tokens", f"{num(entry['ours_save_ms'], 1)} ms",
         f"{num(entry['theirs_save_ms'], 1)} ms"],
        [f"time to first token, that prompt again (cold: {num(exact['ttft_ms']['cold'] / 1000)} s)",
         f"{num(exact['ttft_ms']['ours'], 0)} ms", f"{num(exact['ttft_ms']['theirs'], 0)} ms"],
        ["the prompt + a short suffix / diverging at 75%",
         f"{num(suffix['ttft_ms']['ours'], 0)} / {num(diverging['ttft_ms']['ours'], 0)} ms",
         f"{num(suffix['ttft_ms']['theirs'], 0)} / {num(diverging['ttft_ms']['theirs'], 0)} ms"],
        [f"{len(chat['ours']['ttft_ms_per_turn'])}-turn chat, time to first token of all turns",
         f"{num(sum(chat['ours']['ttft_ms_per_turn']) / 1000)} s",
         f"{num(sum(chat['theirs']['ttft_ms_per_turn']) / 1000)} s"],
        ["restoring a chat turn, against restoring the same state in canonical form (CPU time)",
         ratio(turn["later_vs_canonical"]), "-"],
        [f"tiny mamba, {len(mamba['ours'])}-turn chat on a long history: prompt tokens evaluated per later turn",
         f"{min(t['evaluated'] for t in later):,}-{max(t['evaluated'] for t in later):,}",
         f"{min(t['evaluated'] for t in theirs_later):,}-{max(t['evaluated'] for t in theirs_later):,} "
         "(its cache in our `Llama`)"],
    ]
    for concurrency in ("1", "4"):
        ours = serve_run.get("llama-cache", {}).get(concurrency)
        theirs = serve_run.get("llama-cpp-python", {}).get(concurrency)
        # llama-server at its better flash-attention setting, as the script's verdicts take it.
        sides = [serve_run.get(side, {}).get(concurrency) for side in ("llama-server", "llama-server+fa",
                                                                         "llama-server+nofa")]
        server = min((side["ttft_later_p50"] for side in sides if side and side["ttft_later_p50"]), default=None)
        if ours and theirs:
            users = "1 user" if concurrency == "1" else f"{concurrency} users"
            rows.append([f"`llama-cache serve`, {users} at a time: later chat turns, p50 "
                         f"(llama-server at its better flash-attention setting: {_seconds(server)})",
                         _seconds(ours["ttft_later_p50"]), f"{_seconds(theirs['ttft_later_p50'])} (its server)"])
    return "\n\n".join([
        table(["what", "llama-cache", f"llama-cpp-python {bench_run['machine'].get('llama_cpp_python', '')}".strip()],
              rows),
        f"{_machines(results, HEADLINE_SCRIPTS)}, no GPU, the default model; each row's two sides measured in one "
        "run. Rows by script: " + ", ".join(f"`{script}`" for script in HEADLINE_SCRIPTS.values()) + ".",
    ])


# Disk tier (benchmarks/disk.py, benchmarks/disk_io.py) -------------------------------------------

@renders("disk")
def disk(results: Results) -> str:
    run = results["disk"]
    parts = []
    if "lookup" in run:
        rows = [[f"{r['entries']:,}", _us(r["ours_contains_us"]), _us(r["ours_getitem_us"]),
                 f"{num(r['ours_open_ms'], 1)} ms", _us(r["theirs_contains_us"]),
                 f"{r['theirs_entries']:,} of {r['theirs_attempted']:,}"] for r in run["lookup"]]
        parts += ["Lookups among keys of ~2,000 tokens sharing prefixes, median, each side in a fresh process "
                  "(llama-cpp-python's set-up stops at a time budget: the entries it held are given):",
                  table(["entries", "ours: `key in cache`", "ours: `cache[key]` (a full hit)", "ours: open",
                         "llama-cpp-python: `key in cache`", "llama-cpp-python: entries held"], rows)]
    if "throughput" in run:
        t = run["throughput"]
        rows = [["save", f"{num(t['ours_save_mbps_fsync_False'], 0)} MB/s", f"{num(t['plain_write_mbps_fsync_False'], 0)} MB/s",
                 f"{t['save_vs_plain']:.0%}"],
                ["save + fsync", f"{num(t['ours_save_mbps_fsync_True'], 0)} MB/s",
                 f"{num(t['plain_write_mbps_fsync_True'], 0)} MB/s", f"{t['save_vs_plain_fsync']:.0%}"],
                ["load, page cache hot", f"{num(t['ours_load_mbps_hot'], 0)} MB/s", f"{num(t['plain_read_mbps_hot'], 0)} MB/s",
                 f"{t['load_vs_plain_hot']:.0%}"],
                ["load, page cache cold", f"{num(t['ours_load_mbps_cold'], 0)} MB/s",
                 f"{num(t['plain_read_mbps_cold'], 0)} MB/s", f"{t['load_vs_plain_cold']:.0%}"],
                ["load, hot, `verify=False`", f"{num(t['ours_load_noverify_mbps_hot'], 0)} MB/s", "-", "-"],
                ["save / load with zlib level 1", f"{num(t['ours_save_mbps_zlib1'], 0)} / "
                 f"{num(t['ours_load_mbps_zlib1'], 0)} MB/s", "-", f"size {ratio(t['zlib1_ratio'])}"],
                ["write-behind: the caller's stall", f"{num(t['write_behind_stall_ms'])} ms", "-", "-"]]
        parts += [f"A default-model state of {t['n_tokens']:,} tokens ({_mb(t['state_bytes'])}), against plain files in "
                  "the same directory:", table(["operation", "llama-cache", "plain file", "ours / plain"], rows)]
    if "ttft" in run:
        t = run["ttft"]
        rows = [[label, f"{num(t[f'{key}_ram_ttft_ms'], 0)} ms",
                 f"{num(t[f'{key}_disk_hot_ttft_ms'], 0)} ms ({ratio(t[f'{key}_disk_hot_vs_ram'])})",
                 f"{num(t[f'{key}_disk_cold_ttft_ms'], 0)} ms ({ratio(t[f'{key}_disk_cold_vs_ram'])})",
                 t[f"{key}_disk_hot_evaluated"]]
                for key, label in (("exact", "exact repeat"), ("suffix", "prompt + a few tokens"))]
        cold = f" (cold: {num(run['cold_ttft_s'])} s)" if run.get("cold_ttft_s") else ""
        parts += [f"Time to first token of that prompt{cold}:",
                  table(["prompt", "RAM hit, warm process", "disk hit, new process, page cache hot",
                         "page cache cold", "tokens evaluated"], rows)]
    parts.append(conditions(run))
    return "\n\n".join(parts)


@renders("disk-io")
def disk_io(results: Results) -> str:
    run = results["disk_io"]
    before, after = run["medians"]["before"], run["medians"]["after"]
    rows = [[f"{key}", num(before[key]), num(after[key]), ratio(after[key] / before[key])] for key in before]
    settings = run["settings"]
    return "\n\n".join([
        f"Synthetic states sized like the default model's KV; medians of {settings['rounds']} fresh processes per "
        f"side, alternating; \"before\" is commit {settings['before']} (mmap, WAL). A rate (/s) is better higher, a "
        "time better lower; statements and system calls are counted per store:",
        table(["measure", "before", "after", "after / before"], rows),
        *(["Targets (issue #28):\n\n" + "\n".join(
            f"- {t['what']}: {t['value']} **{'met' if t['met'] else 'not met'}**" for t in run["targets"])]
          if run.get("targets") else []),
        conditions(run),
    ])


# Serving: an agent loop over the Responses API (benchmarks/responses_agent.py) --------------------


@renders("responses-agent")
def responses_agent(results: Results) -> str:
    run = results["responses_agent"]
    summary = run["summary"]
    sides = list(summary)
    steps = min(len(summary[side]["steps"]) for side in sides)
    rows = []
    for index in range(steps):
        row: list[object] = [index + 1]
        for side in sides:
            step = summary[side]["steps"][index]
            cached = step.get("cached_tokens")
            tokens = (f", {num(cached, 0)} of {num(step['prompt_tokens'], 0)} cached"
                      if cached is not None and step.get("prompt_tokens") else "")
            row.append(f"{ms(step['ttft'])} ms, {num(step['sent_bytes'], 0)} B{tokens}")
        rows.append(row)
    rows.append(["mean TTFT after step 1", *(f"{ms(summary[side]['ttft_later_mean'])} ms" for side in sides)])
    rows.append(["bytes sent in all", *(f"{num(summary[side]['sent_bytes_total'], 0)} B" for side in sides)])
    settings = run["servers_settings"]
    head = (f"{run['steps']} steps under ~{run['system_words']}-word instructions, each sending a "
            f"~{run['observation_words']}-word tool result and streaming {run['max_tokens']} tokens at temperature 0; "
            f"every server with n_ctx {settings['n_ctx']}, {settings['parallel']} slot(s), {settings['threads']} "
            f"threads, batch {settings['n_batch']}, flash attention {'on' if settings['flash_attn'] else 'off'}, "
            f"started afresh per run; medians over {run['rounds']} rounds, order rotated. Sides: "
            + "; ".join(f"`{side}`: {label}" for side, label in run["sides"].items()) + ".")
    return "\n\n".join([head, table(["step", *(f"`{side}`" for side in sides)], rows), conditions(run)])


# Serving: the engine against llama-server and the batched example server (benchmarks/serve_engine.py) -

ENGINE_SERVERS = {"llama-cache": "llama-cache", "llama-server": "llama-server", "example-server": "example server",
                  "llama-server+fa": "llama-server, flash attention on", "example-server+fa": "example server, flash attention on",
                  "llama-server+nofa": "llama-server, flash attention off",
                  "example-server+nofa": "example server, flash attention off"}
ENGINE_TARGETS = {
    "throughput_vs_llama_server": "generated tokens/s, ours / llama-server's at its better flash-attention setting "
                                  "(8 clients x 2 turns x 256 tokens)",
    "throughput_vs_example_server": "generated tokens/s, ours / the example server's at its better setting",
    "first_ttft_vs_example_server": "first turn's time to first token p50, ours / the example server's",
    "burst_evaluated_per_system_token": "8 requests sent together on one system prompt: prompt tokens evaluated "
                                        "per system-prompt token",
    "burst_cells_per_unique_token": "after them, KV cells in use per unique token held",
    "burst_peak_rss_vs_llama_server": "peak RSS in that run, ours / llama-server's (same pool, same --cache-ram)",
    "burst_serving_peak_rss_vs_llama_server": "the same while serving (from the first request on, without what "
                                              "starting took)",
    "step_vs_batched_bench": "the engine's step with 8 sequences decoding / llama-batched-bench's, the faster of its "
                             "two KV layouts",
}


@renders("serve-engine")
def serve_engine(results: Results) -> str:
    run = results["serve_engine"]
    summary, settings = run["summary"], run["settings"]
    decode = summary.get("decode", {})
    burst = summary.get("burst", {})
    names = [n for n in ENGINE_SERVERS if n in decode]
    burst_names = [n for n in ENGINE_SERVERS if n in burst]

    def cell(scenario: dict[str, Any], name: str, key: str, unit: Any = num, suffix: str = "") -> str:
        return spread(scenario.get(name, {}).get(key), unit, suffix)

    rows = [
        ["generated tokens/s", *(cell(decode, n, "tokens_per_s") for n in names)],
        ["first turn, time to first token p50", *(cell(decode, n, "ttft_first_p50", num, " s") for n in names)],
        ["later turns, time to first token p50", *(cell(decode, n, "ttft_later_p50", num, " s") for n in names)],
        ["later turns, time to first token p95", *(cell(decode, n, "ttft_later_p95", num, " s") for n in names)],
        ["gap between tokens p50", *(cell(decode, n, "gap_p50", ms, " ms") for n in names)],
        ["peak RSS", *(cell(decode, n, "peak_rss", lambda v: num(v / 1e6)) + " MB" for n in names)],
    ]
    burst_rows = [
        ["time to first token p50", *(cell(burst, n, "ttft_p50", num, " s") for n in burst_names)],
        ["peak RSS", *(cell(burst, n, "peak_rss", lambda v: num(v / 1e6)) + " MB" for n in burst_names)],
    ]
    for scenario, scenario_names, scenario_rows in ((decode, names, rows), (burst, burst_names, burst_rows)):
        if any("serving_peak_rss" in scenario.get(n, {}) for n in scenario_names):
            scenario_rows.append(["peak RSS while serving", *(cell(scenario, n, "serving_peak_rss",
                                                                    lambda v: num(v / 1e6)) + " MB"
                                                               for n in scenario_names)])
    flash = "flash attention " + ("on" if settings.get("flash_attn", True) else "off")
    if any(n.endswith("+fa") for n in names):
        flash += " (the columns marked flash attention on: on)"
    if any(n.endswith("+nofa") for n in names):
        flash += " (the columns marked flash attention off: off)"
    parts = [
        f"{settings['clients']} clients x {settings['turns']} turns x {settings['max_tokens']} tokens, streamed at "
        f"temperature 0 on one ~{num(settings['system_tokens'])}-token system prompt; every server `--parallel "
        f"{settings['parallel']}`, {num(settings['n_ctx_per_sequence'])} tokens of KV per sequence in one pool, "
        f"{settings['threads']} threads, {flash}, batch "
        f"{settings['n_batch']}; {settings['rounds']} rounds, "
        "order rotated; median (min-max):",
        table(["", *(ENGINE_SERVERS[n] for n in names)], rows),
        f"{settings['clients']} requests sent together on one ~{num(settings['burst_tokens'])}-token system prompt, "
        "32 tokens each:",
        table(["", *(ENGINE_SERVERS[n] for n in burst_names)], burst_rows),
    ]
    ours = summary.get("burst_llama_cache")
    if ours:
        parts.append(f"Ours evaluated {num(ours['evaluated_per_system_token'], 2)} prompt tokens per system-prompt token "
                     f"({num(ours['system_tokens'])} tokens) and then held "
                     f"{ratio(ours['cells_per_unique_token'], 3)} as many KV cells as unique tokens.")
    step = run.get("engine_step")
    if step:
        line = (f"The engine's step with {step['sequences']} sequences decoding: {num(step['step_s'] * 1000, 1)} ms, of "
                f"which {num(step['decode_s'] * 1000, 1)} ms in `llama_decode` and {num(step['python_s'] * 1000, 2)} ms "
                f"of Python around it ({num(step['tokens_per_s'], 1)} tokens/s)")
        for key, layout in (("batched_bench", "a KV stream per sequence"), ("batched_bench_unified", "unified KV")):
            steps = (run.get(key) or {}).get("steps", {})
            eight = steps.get("8")
            if eight:
                one = steps.get("1", {})
                line += (f"; `llama-batched-bench` on the same batch, {layout}: {num(eight['step_s'] * 1000, 1)} ms "
                         f"a step ({num(eight['tokens_per_s'], 1)} tokens/s; one sequence: "
                         f"{num(one.get('tokens_per_s'), 1)})")
        ratios = [r for r in run.get("step_ratios") or [] if r is not None]
        if len(ratios) > 1:
            line += (f". That is the round with the median ratio of {len(ratios)} alternated rounds "
                     f"(ratios {', '.join(num(r, 2) for r in sorted(ratios))})")
        parts.append(line + ".")
    deterministic = run.get("engine_step_deterministic")
    if deterministic and step:
        parts.append(f"Deterministic mode, the same {deterministic['sequences']} sequences: "
                     f"{num(deterministic['tokens_per_s'], 1)} tokens/s, {ratio(deterministic['tokens_per_s'] / step['tokens_per_s'])} "
                     f"the default mode's (a step {num(deterministic['step_s'] * 1000, 1)} ms: each sequence its own decode).")
    verdicts = [f"- {ENGINE_TARGETS[name]}: {'-' if t['value'] is None else num(t['value'], 2)} (target "
                f"{'>=' if name.startswith('throughput') else '<='} {t['target']}): {verdict(t['met'])}"
                for name, t in run["targets"].items()]
    parts.append("The script's verdicts (issue #26's targets):\n\n" + "\n".join(verdicts))
    parts.append(conditions(run, f"llama-server {run['llama_server_version']}" if run.get("llama_server_version") else ""))
    return "\n\n".join(parts)


# The engine: making a context (benchmarks/kv_pages.py) -------------------------------------------

@renders("kv-pages")
def kv_pages(results: Results) -> str:
    run = results["kv_pages"]
    summary, settings = run["summary"], run["settings"]
    mb = lambda value: num(None if value is None else value / 1e6, 0)  # noqa: E731
    rows = [[f"`{side}`" if side == "llama.cpp" else "the engine (`BatchContext`)",
             spread(summary[side]["seconds"], lambda v: num(v, 3), " s"), spread(summary[side]["peak"], mb, " MB"),
             spread(summary[side]["added_to_peak"], mb, " MB"), spread(summary[side]["released"], mb, " MB")]
            for side in ("engine", "llama.cpp")]
    return "\n\n".join([
        f"One context of {settings['n_ctx']:,} cells ({run['kv_bytes'] / 2**20:,.0f} MiB of KV), "
        f"{settings['n_seq_max']} sequence ids, flash attention on, {settings['threads']} threads, the default "
        f"model loaded first; a fresh process per side, {settings['rounds']} rounds, order alternating; "
        "median (min-max):",
        table(["side", "time to make it", "peak resident set", "added to the peak", "handed back"], rows),
        "The rounds' time ratios, the engine's / llama.cpp's: "
        + ", ".join(num(value, 2) for value in sorted(run["time_ratios"])) + ".",
        "The script's verdicts:\n\n" + "\n".join(f"- {t['what']}: {num(t['value'], 2)}: {verdict(t['met'])}"
                                                 for t in run["targets"]),
        conditions(run),
    ])
