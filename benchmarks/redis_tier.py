"""Redis tier benchmark (issue #11): time to first token, round trips per lookup, transfer, memory.

    tools/run python benchmarks/redis_tier.py                    # everything, one run (~10 min, 2 quiet cores)
    tools/run python benchmarks/redis_tier.py --quick            # small sizes, for a smoke run
    tools/run python benchmarks/redis_tier.py --sections rtt,transfer    # some sections only

(Not named ``redis.py``: a script's directory comes first on ``sys.path``, so every script in
``benchmarks/`` would import that file instead of redis-py.)

One ``redis-server`` on loopback (:class:`llama_cache.testing.redis_server.RedisServer`: no persistence,
no ``maxmemory``) serves every section, emptied (``FLUSHALL``) before each. Sections:

1. **ttft** - time to first token of a ~1,500-token prompt on the default model, the exact prompt and the
   prompt + a short suffix (a next turn's shape): cold (no cache), a RAM hit (``LlamaRAMCache``, warm
   process), a disk hit (``LlamaDiskCache``, page cache hot) and a Redis hit (``LlamaRedisCache`` alone,
   same server), the last two each in a freshly started process (model load and cache connect not
   timed, then one streamed completion timed to its first chunk). Before each run the cache holds only
   the prompt's state (made the way a completion makes it). Median of ``--repeat``, set-ups in rotating
   order. Target: a Redis hit at least 20x faster than cold.
2. **rtt** - round trips per lookup at 10 / 1,000 / 10,000 entries. Synthetic transformer states (llama.cpp's
   sequence format, 2 layers, 8 bytes of KV per token: fast to fill, small in Redis) under 288-token keys
   (a 96-token system prompt, a 128-token document, a unique 64-token tail), 16-token chunks as the
   default model's, in two shapes: *tree* (8 system prompts x 64 documents, as ``benchmarks/disk.py``'s
   keys) and *one prefix* (every entry shares its first 224 tokens: one node with n children, a chat
   server's single system prompt). Entries are added up to each size; then, with a new client,
   ``stats().round_trips`` per call and median latency of: a hit ``cache[query]`` (an entry's key + 32
   new tokens: answered at chunk granularity), ``match_length(query)`` and a miss (a query sharing no
   chunk). The first lookup of the new client is reported apart (it also reads the namespace record).
   Target: round trips per lookup the same from 10 to 10,000 entries.
3. **transfer** - MB/s of the chunk values a store writes and a lookup reads, with real default-model
   chunks (16 tokens, ~368 KB each): the prompt's state stored under a first token changed per
   repetition (every chunk new, a real write), then looked up whole (fetch, checksum, assemble; also
   with ``verify=False``). Against the practical limit: ``redis-benchmark -t set,get -d <chunk value size>``
   on the same server (``-c 1 -P 1``, ``-c 1 -P 16`` and ``-c 4``: the best of them), and redis-py's own
   pipelined SET / GET of the same values (the client library's share). Target: at least 50% of
   redis-benchmark's MB/s, for stores and for lookups. Where the time goes: one more store and lookup
   under ``cProfile``, the functions taking most of it (own time) in the JSON's ``transfer.profile``.
   (redis-benchmark sets and gets one key over and over, so its value is in the CPU's caches; the
   tier's 95 values are not.) Where a store's time goes, measured apart (medians of ``--repeat`` x 3,
   in the JSON's ``transfer.phases``): framing every chunk (``encode_frame`` into one reused buffer),
   then sending the framed values as ``SET`` commands to keys just deleted (Redis reuses that memory),
   overwriting the same keys, and to new keys in an empty server; and writing a buffer of the state's
   size: ``np.empty`` (memory freed before, or new), new pages (a page fault per page), already touched.
4. **memory** - the workload of the chunk-storage issue (#10), from ``benchmarks/dedup.py`` (its generator
   and its run): ``--conversations`` users (20) sharing a ``--system-tokens`` system prompt (1,000),
   ``--turns`` questions each (5; 40-100 words), interleaved round-robin as greedy streamed chat
   completions (``--max-tokens`` 48) on one default-model ``llama_cache.Llama`` (``n_ctx`` 4096) whose
   only cache is ``LlamaRedisCache``. Reported: ``INFO memory``
   ``used_memory`` after the workload minus before (the server idle both times), the keys' own
   ``MEMORY USAGE``, and the cache's unique bytes (chunk and head values, each once), against the floor
   ``unique tokens x KV bytes per token`` (unique tokens: the distinct prefixes of every stored state's
   tokens; KV bytes per token: ``layout.bytes_per_token``). Target: used_memory at most 1.2x the floor.

Prints a table per section with the targets (met / not met) and writes ``benchmarks/results/redis_tier.json``.
The machine running it may be shared: round trips and bytes are exact, times are medians of few runs
(the load average at the start and the end is recorded).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.disk import fsync_file, table
from benchmarks.machine import finish, machine, write

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "redis_tier.json"
SECTIONS = ("ttft", "rtt", "transfer", "memory")
TTFT_TARGET = 20.0  # cold / Redis hit
TRANSFER_TARGET = 0.5  # ours / redis-benchmark
MEMORY_TARGET = 1.2  # used_memory / (unique tokens x KV bytes per token)
CHUNK_TOKENS = 16  # the default model's (llama_cache.state.chunks.default_chunk_tokens)
SUFFIX = b" And then the story ends."


def verdict(met: bool) -> str:
    return "met" if met else "NOT MET"


def rotated(items: list[Any], shift: int) -> list[Any]:
    shift %= len(items)
    return items[shift:] + items[:shift]


def load_model(n_ctx: int, threads: int) -> Any:
    import llama_cache

    return llama_cache.Llama(model_path=str(llama_cache.default_model_path()), n_ctx=n_ctx, n_threads=threads,
                             verbose=False, seed=0)


class RoundTrips:
    """Counts a Redis cache's round trips from now on, without those of ``stats()`` itself.

    ``stats()`` talks to Redis too, and whether its reply counts its own round trips is the library's
    business: what one call adds to later readings is measured here, twice in a row. Nothing else
    may call ``stats()`` on the cache between the construction and :meth:`since`.
    """

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        first = cache.stats().round_trips
        self.own = cache.stats().round_trips - first
        self.calls = 2
        self.start = self._read()

    def _read(self) -> int:
        value = self.cache.stats().round_trips - self.own * self.calls
        self.calls += 1
        return int(value)

    def since(self) -> int:
        """Round trips made since the construction (by anything but these readings)."""
        return self._read() - self.start


def used_memory(server: Any) -> dict[str, int]:
    """``INFO memory``'s byte counts."""
    fields = {}
    for line in server.cli("info", "memory").splitlines():
        name, _, value = line.strip().partition(":")
        if value.isdigit():
            fields[name] = int(value)
    return fields


# -- 1. time to first token ---------------------------------------------------------------------------


def ttft_child(kind: str, where: str, prompt_file: str, threads: int) -> None:
    """In a fresh process: load the model, open one cache (not timed), time one streamed completion."""
    import llama_cache
    from llama_cache.measure import recording_restores, timed_completion

    prompt = json.loads(Path(prompt_file).read_text())
    llm = load_model(2048, threads)
    start = time.perf_counter()
    if kind == "disk":
        cache: Any = llama_cache.LlamaDiskCache(where, fingerprint=llm.fingerprint)
    else:
        cache = llama_cache.LlamaRedisCache(where, capacity_bytes=1 << 40, fingerprint=llm.fingerprint)
        cache.stats()  # connects
    open_s = time.perf_counter() - start
    lookups: list[float] = []
    lookup_prefix = cache.lookup_prefix

    def timed_lookup(key: Any, *args: Any, **kwargs: Any) -> Any:  # as the cache's (Llama passes namespace=)
        started = time.perf_counter()
        try:
            return lookup_prefix(key, *args, **kwargs)
        finally:
            lookups.append(time.perf_counter() - started)

    cache.lookup_prefix = timed_lookup  # only this instance
    llm.set_cache(cache)
    with recording_restores(llm) as restores:
        timing = timed_completion(llm, prompt, max_tokens=1, temperature=0)
    cache.close()
    print(json.dumps({
        "ttft_s": timing.ttft_s, "evaluated": timing.prompt_tokens_evaluated, "open_s": open_s,
        "lookup_s": lookups[0] if lookups else None,
        "restore_s": restores[0].seconds if restores else None,
    }))


def first_lookup_round_trips(url: str, fingerprint: str, prompt: list[int]) -> int:
    """Round trips of a new client's first lookup of ``prompt`` (what the fresh process's lookup makes)."""
    from llama_cache import LlamaRedisCache

    cache = LlamaRedisCache(url, fingerprint=fingerprint)
    cache.stats()  # connects
    counter = RoundTrips(cache)
    cache.lookup_prefix(prompt)
    trips = counter.since()
    cache.close()
    return trips


def fsync_tree(directory: Path) -> None:
    """fsync every file under ``directory``: no writeback of fresh files during a measurement."""
    for base, _, names in os.walk(directory):
        for name in names:
            fsync_file(Path(base) / name)


def bench_ttft(server: Any, llm: Any, state: Any, tokens: list[int], workdir: Path, repeat: int,
               threads: int) -> dict[str, Any]:
    import llama_cache
    from llama_cache.measure import timed_completion

    suffix = llm.tokenize(SUFFIX, add_bos=False)
    shapes = {"exact": tokens, "suffix": tokens + suffix}
    setups = ["cold", "ram", "disk", "redis"]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {shape: {s: [] for s in setups} for shape in shapes}
    directory = workdir / "disk"
    lookup_trips: dict[str, int] = {}
    redis_cache = llama_cache.LlamaRedisCache(server.url, capacity_bytes=1 << 40, fingerprint=llm.fingerprint)
    for rep in range(repeat):
        for n, (shape, prompt) in enumerate(shapes.items()):
            prompt_file = workdir / f"prompt-{shape}.json"
            prompt_file.write_text(json.dumps(prompt))
            for setup in rotated(setups, rep + n):
                if setup in ("cold", "ram"):
                    ram = llama_cache.LlamaRAMCache(capacity_bytes=1 << 33)
                    if setup == "ram":
                        ram[tokens] = state
                    llm.set_cache(ram if setup == "ram" else None)
                    llm.reset()
                    timing = timed_completion(llm, prompt, max_tokens=1, temperature=0)
                    llm.set_cache(None)
                    result = {"ttft_s": timing.ttft_s, "evaluated": timing.prompt_tokens_evaluated}
                else:
                    if setup == "disk":
                        shutil.rmtree(directory, ignore_errors=True)
                        with llama_cache.LlamaDiskCache(directory, fingerprint=llm.fingerprint) as disk:
                            disk[tokens] = state
                        fsync_tree(directory)
                        where = str(directory)
                    else:
                        redis_cache.clear()  # the child's own stores are gone: only the prompt's state
                        redis_cache[tokens] = state
                        if shape not in lookup_trips:
                            lookup_trips[shape] = first_lookup_round_trips(server.url, llm.fingerprint, prompt)
                        where = server.url
                    child = subprocess.run(
                        [sys.executable, __file__, "--ttft-child", setup, where, str(prompt_file),
                         "--threads", str(threads)],
                        capture_output=True, text=True, check=True, cwd=ROOT,
                    )
                    result = json.loads(child.stdout.strip().splitlines()[-1])
                runs[shape][setup].append(result)
        print(f"  ttft: repetition {rep + 1}/{repeat} done", file=sys.stderr)
    redis_cache.clear()
    redis_cache.close()

    out: dict[str, Any] = {"prompt_tokens": len(tokens), "suffix_tokens": len(suffix), "repeat": repeat, "runs": runs}
    rows = []
    for shape, by_setup in runs.items():
        summary = {}
        for setup, items in by_setup.items():
            summary[f"{setup}_ttft_ms"] = 1e3 * statistics.median(r["ttft_s"] for r in items)
            summary[f"{setup}_evaluated"] = max(r["evaluated"] for r in items)
        for setup in ("disk", "redis"):
            items = by_setup[setup]
            summary[f"{setup}_lookup_ms"] = 1e3 * statistics.median(r["lookup_s"] or 0.0 for r in items)
            summary[f"{setup}_restore_ms"] = 1e3 * statistics.median(r["restore_s"] or 0.0 for r in items)
            summary[f"{setup}_open_ms"] = 1e3 * statistics.median(r["open_s"] for r in items)
        summary["redis_lookup_round_trips"] = lookup_trips[shape]
        summary["cold_vs_redis"] = summary["cold_ttft_ms"] / summary["redis_ttft_ms"]
        summary["redis_vs_ram"] = summary["redis_ttft_ms"] / summary["ram_ttft_ms"]
        summary["redis_vs_disk"] = summary["redis_ttft_ms"] / summary["disk_ttft_ms"]
        summary["target_met"] = summary["cold_vs_redis"] >= TTFT_TARGET
        out[shape] = summary
        name = "exact prompt" if shape == "exact" else f"prompt + {len(suffix)} tokens"
        rows.append([
            name, f"{summary['cold_ttft_ms']:.0f} ms", f"{summary['ram_ttft_ms']:.0f} ms",
            f"{summary['disk_ttft_ms']:.0f} ms", f"{summary['redis_ttft_ms']:.0f} ms",
            f"{summary['redis_lookup_ms']:.0f} / {summary['redis_restore_ms']:.0f} ms",
            summary["redis_lookup_round_trips"],
            f"{summary['cold_evaluated']}/{summary['ram_evaluated']}/{summary['disk_evaluated']}/"
            f"{summary['redis_evaluated']}",
            f"{summary['cold_vs_redis']:.0f}x ({verdict(summary['target_met'])})",
        ])
    table(
        f"Time to first token, {len(tokens)}-token prompt (median of {repeat}; disk and Redis: a fresh process)",
        ["prompt", "cold", "RAM hit", "disk hit", "Redis hit", "Redis lookup / restore", "round trips",
         "evaluated c/r/d/R", f"cold / Redis (target >= {TTFT_TARGET:.0f}x)"],
        rows,
    )
    return out


# -- 2. round trips per lookup --------------------------------------------------------------------------


class TreeKeys:
    """Keys sharing prefixes like a server's: system prompt + document + a unique tail (token ids)."""

    def __init__(self, system: int = 96, document: int = 128, tail: int = 64, systems: int = 8,
                 documents: int = 64, vocab: int = 49_152) -> None:
        rng = np.random.default_rng(0)
        self.systems = [rng.integers(0, vocab, system, dtype=np.int32) for _ in range(systems)]
        self.documents = [rng.integers(0, vocab, document, dtype=np.int32) for _ in range(documents)]
        self.tail, self.vocab = tail, vocab

    def key(self, i: int) -> np.ndarray:
        tail = np.random.default_rng(i + 1).integers(0, self.vocab, self.tail, dtype=np.int32)
        return np.concatenate([self.systems[i % len(self.systems)],
                               self.documents[(i // len(self.systems)) % len(self.documents)], tail])

    def query(self, i: int) -> np.ndarray:
        """Entry i's key + 32 new tokens."""
        fresh = np.random.default_rng(10**7 + i).integers(0, self.vocab, 32, dtype=np.int32)
        return np.concatenate([self.key(i), fresh])

    def miss(self, i: int) -> np.ndarray:
        return np.random.default_rng(10**8 + i).integers(0, self.vocab, len(self.key(0)) + 32, dtype=np.int32)


def synthetic_state(tokens: np.ndarray, fingerprint: str, row: int = 2) -> Any:
    """A transformer state in llama.cpp's sequence format: 2 layers of ``row``-byte K and V rows.

    Tiny (``4 * row`` bytes of KV per token), so 10,000 entries fill fast; its chunk ids, and so the
    lookups' work, are what a real model's would be.
    """
    from llama_cache.testing.states import synthetic_state as build

    return build(tokens, row, np.random.default_rng(int(tokens[-1]) + len(tokens)), fingerprint=fingerprint)


def _per_call(cache: Any, calls: list[Any]) -> tuple[float, float]:
    """Round trips per call and median microseconds per call of ``calls`` (zero-argument functions)."""
    times = []
    counter = RoundTrips(cache)
    for call in calls:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    trips = counter.since()
    return trips / len(calls), 1e6 * statistics.median(times)


SHAPES = {
    # 8 system prompts x 64 documents: branch points of 64 and of ~n / 512 children.
    "tree": dict(systems=8, documents=64),
    # Every entry shares its first 224 tokens (one system prompt, one document): one branch point of n.
    "one prefix": dict(systems=1, documents=1),
}


def round_trips_for(server: Any, shape: str, sizes: list[int], lookups: int) -> list[dict[str, Any]]:
    """Entries added up to each size; then a new client's lookups: round trips per call and latency."""
    from llama_cache import LlamaRedisCache

    fingerprint = f"redis-bench-synthetic-{shape}"
    keys = TreeKeys(**SHAPES[shape])
    filler = LlamaRedisCache(server.url, capacity_bytes=1 << 40, fingerprint=fingerprint, chunk_tokens=CHUNK_TOKENS,
                             timeout=10)
    filler.clear()
    results = []
    held, fill_s = 0, 0.0
    for n in sizes:
        start = time.perf_counter()
        counter = RoundTrips(filler)
        for i in range(held, n):
            key = keys.key(i)
            filler[key] = synthetic_state(key, fingerprint)
        fill_s += time.perf_counter() - start
        store_trips = counter.since() / max(1, n - held)
        held = n
        assert len(filler) == n, (len(filler), n)
        # A new client, as another process would be: its first lookup also reads the namespace record.
        cache = LlamaRedisCache(server.url, fingerprint=fingerprint, chunk_tokens=CHUNK_TOKENS, timeout=10)
        rng = np.random.default_rng(n)
        queries = [keys.query(int(i)) for i in rng.integers(0, n, lookups)]
        misses = [keys.miss(i) for i in range(lookups)]
        expected = len(keys.key(0))
        counter = RoundTrips(cache)
        start = time.perf_counter()
        assert cache[queries[0]].n_tokens == expected
        first_us = 1e6 * (time.perf_counter() - start)
        first_trips = counter.since()
        hit_trips, hit_us = _per_call(cache, [lambda q=q: cache[q] for q in queries])
        match_trips, match_us = _per_call(cache, [lambda q=q: cache.match_length(q) for q in queries])
        miss_trips, miss_us = _per_call(cache, [lambda q=q: q in cache for q in misses])
        assert all(cache.match_length(q) == expected for q in queries[:5]) and not any(q in cache for q in misses[:5])
        cache.close()
        results.append({
            "shape": shape, "entries": n, "redis_keys": int(server.cli("dbsize").strip() or 0),
            "used_memory": used_memory(server).get("used_memory", 0),
            "store_round_trips": store_trips, "first_lookup_round_trips": first_trips, "first_lookup_us": first_us,
            "hit_round_trips": hit_trips, "hit_us": hit_us, "match_round_trips": match_trips, "match_us": match_us,
            "miss_round_trips": miss_trips, "miss_us": miss_us, "fill_s": fill_s,
        })
        print(f"  round trips, {shape}: {n} entries done ({fill_s:.0f} s of stores so far)", file=sys.stderr)
    filler.clear()
    filler.close()
    return results


def bench_round_trips(server: Any, sizes: list[int], lookups: int) -> dict[str, Any]:
    results = [row for shape in SHAPES for row in round_trips_for(server, shape, sizes, lookups)]
    kinds = ("hit_round_trips", "match_round_trips", "miss_round_trips")
    constant = all(len({row[kind] for row in results}) == 1 for kind in kinds)
    table(
        f"Round trips per lookup ({len(TreeKeys().key(0))}-token keys, {CHUNK_TOKENS}-token chunks; {lookups} "
        f"lookups of each kind, a new client; latency: median)",
        ["keys", "entries", "Redis keys", "hit: trips / latency", "match_length", "miss", "first lookup of a client",
         "store: trips"],
        [[r["shape"], r["entries"], r["redis_keys"], f"{r['hit_round_trips']:.2f} / {r['hit_us']:,.0f} us",
          f"{r['match_round_trips']:.2f} / {r['match_us']:,.0f} us",
          f"{r['miss_round_trips']:.2f} / {r['miss_us']:,.0f} us",
          f"{r['first_lookup_round_trips']} / {r['first_lookup_us']:,.0f} us", f"{r['store_round_trips']:.2f}"]
         for r in results],
    )
    print(f"  target: round trips per lookup constant from {sizes[0]:,} to {sizes[-1]:,} entries: {verdict(constant)}")
    return {"sizes": results, "target_met": constant}


# -- 3. transfer ------------------------------------------------------------------------------------------


def redis_benchmark(port: int, size: int, requests: int, clients: int, pipeline: int) -> dict[str, float]:
    """``redis-benchmark -t set,get`` with values of ``size`` bytes: requests per second per test."""
    done = subprocess.run(
        ["redis-benchmark", "-p", str(port), "-t", "set,get", "-d", str(size), "-n", str(requests),
         "-c", str(clients), "-P", str(pipeline), "--csv"],
        capture_output=True, text=True, check=True, timeout=600,
    )
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    return {row["test"].lower(): float(row["rps"]) for row in rows}


def variant(state: Any, i: int) -> Any:
    """``state`` with its first token replaced: the same KV under chunk ids no store has seen."""
    from llama_cache.state.llama_state import LlamaState

    tokens = state.tokens.copy()
    tokens[0] = (int(tokens[0]) + 1 + i) % 49_152
    return LlamaState.from_seq_bytes(tokens, state.logits, state.seed, state.fingerprint, state.seq_bytes())


def bench_transfer(server: Any, state: Any, repeat: int, requests: int) -> dict[str, Any]:
    import redis

    from llama_cache import LlamaRedisCache

    cache = LlamaRedisCache(server.url, capacity_bytes=1 << 40, fingerprint=state.fingerprint,
                            chunk_tokens=CHUNK_TOKENS, timeout=30)
    client = redis.Redis.from_url(server.url, socket_timeout=30)
    bench_configs = [(1, 1), (1, 16), (4, 1)]
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    chunk_values: list[bytes] = []
    for rep in range(repeat):
        for step in rotated(["ours", "redis-py", "redis-benchmark"], rep):
            if step == "ours":
                cache.clear()
                fresh = variant(state, rep)
                writes = cache.stats().writes
                counter = RoundTrips(cache)
                start = time.perf_counter()
                cache[fresh.tokens] = fresh
                store_s = time.perf_counter() - start
                add("store_round_trips", counter.since())
                assert cache.stats().writes == writes + 1
                keys = sorted(client.scan_iter(match=b"llc:c:*", count=1000))
                sizes = _pipelined(client, "strlen", keys)
                chunk_bytes = sum(sizes)
                add("chunks", len(keys))
                add("chunk_bytes", chunk_bytes)
                add("store_mbps", chunk_bytes / 1e6 / store_s)
                for verify in (True, False):
                    cache.verify = verify
                    start = time.perf_counter()
                    got = cache[fresh.tokens]
                    add(f"lookup_mbps_verify_{verify}", chunk_bytes / 1e6 / (time.perf_counter() - start))
                    assert got.n_tokens == fresh.n_tokens
                cache.verify = True
                if not chunk_values:  # the full chunks' values, for the baselines
                    chunk_values = [v for v, size in zip(_pipelined(client, "get", keys), sizes) if size == max(sizes)]
            elif step == "redis-py" and chunk_values:
                raw_keys = [f"bench:raw:{i}".encode() for i in range(len(chunk_values))]
                moved = sum(len(v) for v in chunk_values) / 1e6
                start = time.perf_counter()
                pipe = client.pipeline(transaction=False)
                for key, value in zip(raw_keys, chunk_values):
                    pipe.set(key, value)
                pipe.execute()
                add("redis_py_set_mbps", moved / (time.perf_counter() - start))
                start = time.perf_counter()
                _pipelined(client, "get", raw_keys)
                add("redis_py_get_mbps", moved / (time.perf_counter() - start))
                client.delete(*raw_keys)
            elif step == "redis-benchmark" and chunk_values:
                size = len(chunk_values[0])
                for clients, pipeline in bench_configs:
                    rps = redis_benchmark(server.port, size, requests, clients, pipeline)
                    for test in ("set", "get"):
                        add(f"bench_{test}_mbps_c{clients}_P{pipeline}", rps[test] * size / 1e6)
                client.delete("key:__rand_int__")
        print(f"  transfer: repetition {rep + 1}/{repeat} done", file=sys.stderr)
    profile = profile_transfer(cache, state)
    phases = store_phases(server, state, repeat)
    cache.clear()
    cache.close()
    client.close()

    out: dict[str, Any] = {name: statistics.median(values) for name, values in samples.items()}
    out["profile"] = profile
    out["phases"] = phases
    out["samples"] = samples
    out["chunk_value_bytes"] = len(chunk_values[0])
    out["state_tokens"] = state.n_tokens
    for test in ("set", "get"):
        best = max(bench_configs, key=lambda c: out[f"bench_{test}_mbps_c{c[0]}_P{c[1]}"])
        out[f"bench_{test}_best"] = f"-c {best[0]} -P {best[1]}"
        out[f"bench_{test}_mbps"] = out[f"bench_{test}_mbps_c{best[0]}_P{best[1]}"]
    out["store_vs_bench"] = out["store_mbps"] / out["bench_set_mbps"]
    # A client's bound for new data: the same values framed in advance, sent to new keys (Redis faults
    # their pages in; redis-benchmark sets one key again and again, which allocates nothing).
    out["send_new_keys_mbps"] = phases["bytes"] / 1e3 / phases["send_new_keys_ms"]
    out["store_vs_new_keys"] = out["store_mbps"] / out["send_new_keys_mbps"]
    out["new_keys_vs_bench"] = out["send_new_keys_mbps"] / out["bench_set_mbps"]
    out["lookup_vs_bench"] = out["lookup_mbps_verify_True"] / out["bench_get_mbps"]
    out["target_met"] = out["store_vs_bench"] >= TRANSFER_TARGET and out["lookup_vs_bench"] >= TRANSFER_TARGET
    bench_cells = {test: " / ".join(f"{out[f'bench_{test}_mbps_c{c}_P{p}']:.0f}" for c, p in bench_configs)
                   for test in ("set", "get")}
    table(
        f"Transfer: {int(out['chunks'])} chunks of {out['chunk_value_bytes'] / 1e3:.0f} KB "
        f"({out['chunk_bytes'] / 1e6:.1f} MB, a {state.n_tokens}-token state; median of {repeat}; MB/s)",
        ["operation", "LlamaRedisCache", "redis-py pipeline", "redis-benchmark c1P1 / c1P16 / c4P1",
         f"ours / best (target >= {TRANSFER_TARGET:.0%})"],
        [
            ["store (SET)", f"{out['store_mbps']:.0f}", f"{out['redis_py_set_mbps']:.0f}", bench_cells["set"],
             f"{out['store_vs_bench']:.0%} ({verdict(out['store_vs_bench'] >= TRANSFER_TARGET)})"],
            ["lookup (GET)", f"{out['lookup_mbps_verify_True']:.0f}", f"{out['redis_py_get_mbps']:.0f}",
             bench_cells["get"],
             f"{out['lookup_vs_bench']:.0%} ({verdict(out['lookup_vs_bench'] >= TRANSFER_TARGET)})"],
            ["lookup, verify=False", f"{out['lookup_mbps_verify_False']:.0f}", "", "", ""],
            ["SET of values framed in advance, new keys", f"{out['send_new_keys_mbps']:.0f}", "", "",
             f"{out['new_keys_vs_bench']:.0%} (a client's bound for new data)"],
        ],
    )
    print(f"  stores / a client's bound for new data: {out['store_vs_new_keys']:.0%}", file=sys.stderr)
    return out


def store_phases(server: Any, state: Any, repeat: int) -> dict[str, float]:
    """Milliseconds (medians) of the parts of a store, measured apart (see the module docstring)."""
    import redis

    from llama_cache.caches.redis_frames import encode_frame, frame_size, layer_stacks
    from llama_cache.state.chunks import pieces

    chain = pieces(state.fingerprint, np.asarray(state.tokens, dtype=np.int32), CHUNK_TOKENS)
    frame = np.empty(frame_size(state.layout, CHUNK_TOKENS), dtype=np.uint8)
    stacks = [layer_stacks(segment) for segment in state.segments]
    frames = [bytes(encode_frame(state.fingerprint, piece, state.layout, state.segments, frame, stacks))
              for piece in chain]
    client = redis.Redis.from_url(server.url, socket_timeout=30)
    keys = [f"bench:phase:{i}".encode() for i in range(len(frames))]

    def send() -> None:
        connection = client.connection_pool.get_connection()
        try:
            for key, value in zip(keys, frames):
                connection.send_packed_command(
                    [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value)), value, b"\r\n"],
                    check_health=False)
            for _ in frames:
                connection.read_response()
        finally:
            client.connection_pool.release(connection)

    def encode() -> None:
        for piece in chain:
            encode_frame(state.fingerprint, piece, state.layout, state.segments, frame, stacks)

    size = sum(len(value) for value in frames)
    touched = np.ones(size, dtype=np.uint8)
    source = np.ones(size, dtype=np.uint8)

    def write_fresh() -> None:  # np.empty: glibc may hand back memory freed before, or map new pages
        target = np.empty(size, dtype=np.uint8)
        target[:] = source

    def write_new_pages() -> None:  # memory never touched: a page fault per page
        import mmap

        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        target = np.frombuffer(mapping, dtype=np.uint8)
        target[:] = source
        del target
        mapping.close()

    def write_touched() -> None:
        touched[:] = source

    samples: dict[str, list[float]] = {}
    for _ in range(3 * repeat):
        for name, before, run in (
            ("frame_ms", None, encode),
            ("send_new_keys_ms", lambda: server.cli("flushall"), send),
            ("send_freed_keys_ms", lambda: client.delete(*keys), send),
            ("send_overwrite_ms", None, send),
            ("write_fresh_buffer_ms", None, write_fresh),
            ("write_new_pages_ms", None, write_new_pages),
            ("write_touched_buffer_ms", None, write_touched),
        ):
            if before is not None:
                before()
            start = time.perf_counter()
            run()
            samples.setdefault(name, []).append(1e3 * (time.perf_counter() - start))
    client.delete(*keys)
    client.close()
    out = {name: statistics.median(values) for name, values in samples.items()}
    out["bytes"] = size
    print("  store phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in out.items() if k != "bytes"),
          file=sys.stderr)
    return out


def profile_transfer(cache: Any, state: Any, top: int = 8) -> dict[str, Any]:
    """One store and one lookup of a fresh variant of ``state`` under cProfile: the ``top`` functions by
    own time (ms, calls), and each call's whole time."""
    import cProfile
    import pstats

    fresh = variant(state, 10**4)
    out: dict[str, Any] = {}
    for name, call in (("store", lambda: cache.__setitem__(fresh.tokens, fresh)), ("lookup", lambda: cache[fresh.tokens])):
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.runcall(call)
        whole = time.perf_counter() - start
        stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
        out[name] = {"ms": 1e3 * whole, "functions": [
            {"function": f"{Path(file).name}:{line}({function})", "calls": calls, "own_ms": 1e3 * own}
            for (file, line, function), (calls, _, own, _, _) in rows]}
        print(f"  profile, {name} ({1e3 * whole:.0f} ms under cProfile): " + ", ".join(
            f"{row['function']} {row['own_ms']:.1f} ms" for row in out[name]["functions"][:4]), file=sys.stderr)
    cache.clear()
    return out


def _pipelined(client: Any, command: str, keys: list[bytes]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        getattr(pipe, command)(key)
    return list(pipe.execute())


# -- 4. memory for the dedup workload ---------------------------------------------------------------------

def bench_memory(server: Any, conversations: int, turns: int, system_tokens: int, max_tokens: int,
                 threads: int) -> dict[str, Any]:
    """``benchmarks/dedup.py``'s workload, run the same way, with ``LlamaRedisCache`` as the only cache."""
    import redis

    from benchmarks.dedup import PrefixSet, RecordingCache, Workload, _questions, _system_text, run_ours
    from llama_cache import LlamaRedisCache

    server.cli("flushall")
    llm = load_model(4096, threads)
    system, system_count = _system_text(llm, system_tokens)
    workload = Workload(system, system_count, [_questions(user, turns) for user in range(conversations)], turns)
    time.sleep(0.5)
    before = used_memory(server)
    cache = LlamaRedisCache(server.url, capacity_bytes=1 << 40, fingerprint=llm.fingerprint, timeout=30)
    recorder = RecordingCache(cache, keep_states=False)
    llm.set_cache(recorder)
    start = time.perf_counter()
    rows = run_ours(llm, recorder, workload, conversations, max_tokens)
    prefixes = PrefixSet()
    for store in recorder.stores:
        prefixes.add(store.tokens)
    assert recorder.last is not None
    bytes_per_token = recorder.last[1].layout.bytes_per_token
    llm.set_cache(None)
    stats = cache.stats()
    unique_bytes = cache.cache_size
    cache.close()  # its connection's buffers are not the cache's memory
    client = redis.Redis.from_url(server.url, socket_timeout=30)
    keys = list(client.scan_iter(count=1000))
    chunk_keys = [key for key in keys if key.startswith(b"llc:c:")]
    key_bytes = sum(_pipelined_command(client, [("MEMORY", "USAGE", key, "SAMPLES", "0") for key in keys]))
    chunk_value_bytes = sum(_pipelined_command(client, [("STRLEN", key) for key in chunk_keys]))
    client.close()
    time.sleep(0.5)
    after = used_memory(server)
    floor = len(prefixes) * bytes_per_token
    out = {
        "conversations": conversations, "turns": turns, "system_tokens": system_count, "max_tokens": max_tokens,
        "completions": rows, "stores": len(recorder.stores), "entries": stats.entries, "chunks": len(chunk_keys),
        "redis_keys": len(keys), "unique_tokens": len(prefixes), "kv_bytes_per_token": bytes_per_token,
        "floor_bytes": floor, "used_memory_before": before.get("used_memory", 0),
        "used_memory_after": after.get("used_memory", 0),
        "used_memory_delta": after.get("used_memory", 0) - before.get("used_memory", 0),
        "used_memory_rss_after": after.get("used_memory_rss", 0), "keys_memory_usage": key_bytes,
        "cache_unique_bytes": unique_bytes, "chunk_value_bytes": chunk_value_bytes,
        "round_trips": stats.round_trips, "hits": stats.hits, "misses": stats.misses,
        "store_errors": stats.store_errors, "evictions": stats.evictions,
        "evaluated_mean": statistics.fmean(r["evaluated"] for r in rows),
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in rows),
        "ttft_ms_median_after_first": statistics.median(r["ttft_ms"] for r in rows[1:]) if len(rows) > 1 else None,
        "seconds": time.perf_counter() - start,
    }
    for name in ("used_memory_delta", "keys_memory_usage", "cache_unique_bytes", "chunk_value_bytes"):
        out[f"{name}_vs_floor"] = out[name] / floor if floor else None
    out["target_met"] = floor > 0 and out["used_memory_delta"] <= MEMORY_TARGET * floor
    server.cli("flushall")
    mib = 2**20
    table(
        f"Redis memory, dedup workload: {conversations} conversations x {turns} turns, {system_count}-token system "
        f"prompt ({len(rows)} completions, {len(recorder.stores)} states stored, {stats.entries} entries, "
        f"{len(chunk_keys)} chunks)",
        ["measure", "MiB", "x floor"],
        [
            [f"floor: {len(prefixes):,} unique tokens x {bytes_per_token:,} B", f"{floor / mib:.1f}",
             "1.00"],
            ["INFO used_memory, after - before", f"{out['used_memory_delta'] / mib:.1f}",
             f"{out['used_memory_delta_vs_floor']:.3f} (target <= {MEMORY_TARGET}: {verdict(out['target_met'])})"],
            ["MEMORY USAGE of every key", f"{key_bytes / mib:.1f}", f"{out['keys_memory_usage_vs_floor']:.3f}"],
            ["the cache's unique bytes (chunks + heads)", f"{unique_bytes / mib:.1f}",
             f"{out['cache_unique_bytes_vs_floor']:.3f}"],
            ["chunk values alone", f"{chunk_value_bytes / mib:.1f}", f"{out['chunk_value_bytes_vs_floor']:.3f}"],
        ],
    )
    print(f"  prompt tokens evaluated per completion: {out['evaluated_mean']:.0f} of {out['prompt_tokens_mean']:.0f} "
          f"(mean); {stats.hits} hits, {stats.misses} misses, {stats.store_errors} store errors")
    return out


def _pipelined_command(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return [value or 0 for value in pipe.execute()]


# -- the run ------------------------------------------------------------------------------------------------


def prompt_state(llm: Any, n_tokens: int) -> tuple[Any, list[int]]:
    """The state of a ~``n_tokens`` document prompt, made the way a completion makes it (with its logits)."""
    from llama_cache import LlamaRAMCache
    from llama_cache.bench import document_tokens
    from llama_cache.measure import timed_completion

    tokens = document_tokens(llm, n_tokens)
    ram = LlamaRAMCache(capacity_bytes=1 << 33)
    llm.set_cache(ram)
    llm.reset()
    timed_completion(llm, tokens, max_tokens=1, temperature=0)
    llm.set_cache(None)
    state = ram[tokens]
    assert state.n_tokens == len(tokens) and state.logits is not None and state.layout is not None
    return state, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--repeat", type=int, help="repetitions of timed runs (default 3; quick 2)")
    parser.add_argument("--prompt-tokens", type=int, help="ttft and transfer prompt (default 1500; quick 300)")
    parser.add_argument("--sizes", help="rtt: entry counts (default 10,1000,10000; quick 10,100,1000)")
    parser.add_argument("--lookups", type=int, help="rtt: lookups per kind and size (default 200; quick 50)")
    parser.add_argument("--requests", type=int, help="redis-benchmark -n per test (default 2000; quick 300)")
    parser.add_argument("--conversations", type=int, help="memory: conversations (default 20; quick 3)")
    parser.add_argument("--turns", type=int, help="memory: turns per conversation (default 5; quick 2)")
    parser.add_argument("--system-tokens", type=int, help="memory: system prompt tokens (default 1000; quick 300)")
    parser.add_argument("--max-tokens", type=int, help="memory: tokens per answer (default 48; quick 16)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2; 1 on a loaded machine)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--ttft-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ttft_child:
        ttft_child(*args.ttft_child, args.threads)
        return 0
    quick = args.quick

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if quick else full)

    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    repeat = pick(args.repeat, 3, 2)
    prompt_tokens = pick(args.prompt_tokens, 1500, 300)
    sizes = [int(s) for s in pick(args.sizes, "10,1000,10000", "10,100,1000").split(",")]

    from llama_cache.testing.redis_server import RedisServer

    started = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "redis_tier", "command": "tools/run python benchmarks/redis_tier.py " + " ".join(sys.argv[1:]),
        "machine": machine() | {"llama_threads": args.threads},
    }
    with RedisServer() as server, tempfile.TemporaryDirectory(prefix="llama-cache-redis-bench-") as tmp:
        results["redis_server"] = server.cli("info", "server").split("redis_version:")[-1].split()[0]
        llm = state = tokens = None
        if "ttft" in sections or "transfer" in sections:
            llm = load_model(2048, args.threads)
            state, tokens = prompt_state(llm, prompt_tokens)
            print(f"  state of the {len(tokens)}-token prompt made "
                  f"({state.layout.bytes_per_token:,} B of KV per token)", file=sys.stderr)
        if "ttft" in sections:
            server.cli("flushall")
            results["ttft"] = bench_ttft(server, llm, state, tokens, Path(tmp), repeat, args.threads)
            write(args.out, results)  # what is done so far, if a later section fails
        if "rtt" in sections:
            server.cli("flushall")
            results["round_trips"] = bench_round_trips(server, sizes, pick(args.lookups, 200, 50))
            write(args.out, results)  # what is done so far, if a later section fails
        if "transfer" in sections:
            server.cli("flushall")
            results["transfer"] = bench_transfer(server, state, repeat, pick(args.requests, 2000, 300))
            write(args.out, results)  # what is done so far, if a later section fails
        if llm is not None:
            llm.close()
        if "memory" in sections:
            results["memory"] = bench_memory(server, pick(args.conversations, 20, 3), pick(args.turns, 5, 2),
                                             pick(args.system_tokens, 1000, 300), pick(args.max_tokens, 48, 16),
                                             args.threads)
    finish(results)
    results["seconds"] = time.perf_counter() - started

    targets = []
    if "ttft" in results:
        for shape in ("exact", "suffix"):
            r = results["ttft"][shape]
            targets.append([f"Redis hit >= {TTFT_TARGET:.0f}x faster than cold ({shape})", f"{r['cold_vs_redis']:.0f}x",
                            verdict(r["target_met"])])
    if "round_trips" in results:
        r = results["round_trips"]
        trips = sorted({s["hit_round_trips"] for s in r["sizes"]})
        targets.append([f"round trips per lookup constant, {sizes[0]:,} to {sizes[-1]:,} entries",
                        f"hit {'/'.join(f'{t:g}' for t in trips)}", verdict(r["target_met"])])
    if "transfer" in results:
        r = results["transfer"]
        for op, key in (("stores", "store_vs_bench"), ("lookups", "lookup_vs_bench")):
            targets.append([f"chunk {op} >= {TRANSFER_TARGET:.0%} of redis-benchmark's MB/s", f"{r[key]:.0%}",
                            verdict(r[key] >= TRANSFER_TARGET)])
    if "memory" in results:
        r = results["memory"]
        targets.append([f"Redis memory, dedup workload <= {MEMORY_TARGET}x unique tokens x KV bytes/token",
                        f"{r['used_memory_delta_vs_floor']:.3f}x", verdict(r["target_met"])])
    results["targets"] = targets
    table(f"Targets of issue #11 (one run, {results['seconds'] / 60:.1f} min; load average "
          f"{results['machine']['load_average_start'][0]:.1f} at the start, "
          f"{results['machine']['load_average_end'][0]:.1f} at the end)", ["target", "measured", ""], targets)
    write(args.out, results)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
