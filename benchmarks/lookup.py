"""Lookup latency and index memory of llama-cache's caches against llama-cpp-python's LlamaRAMCache.

Run from the repository root:

    tools/run python benchmarks/lookup.py [--sizes 10,1000,10000] [--out benchmarks/results/lookup.json]
    tools/run python benchmarks/lookup.py --sizes 10,1000   # a quick sanity check

At 10, 1,000 and 10,000 entries of about 2,000 tokens each, it times ``cache[query]`` for
``llama_cache.LlamaRAMCache``, ``llama_cache.LlamaTrieCache`` and ``llama_cpp.llama_cache.LlamaRAMCache``
side by side in one run, and measures the memory their lookup structures hold per stored token. It prints
a table to stdout (a progress bar goes to stderr) and writes ``benchmarks/results/lookup.json`` (the
machine, the versions, the workload, every size's results and the targets' verdicts), rewritten after every
size, so a failure leaves the sizes done so far.

Workload (seeded, so every run sees the same tokens; ids in 0..49151):

* Keys: a handful of system prompts (300-800 tokens) shared by many conversations; each conversation is a
  system prompt plus an opening user turn (a key of 1,700-1,900 tokens) followed by three more turns of
  100-200 tokens, every key extending the previous one, so keys average about 2,000 tokens. The entries
  of a size are the first N keys of one pool, so the sizes are nested.
* Queries, as Python lists (what llama-cpp-python's ``Llama`` passes), three kinds in equal numbers:
  ``stored+suffix`` (a stored key plus 100-300 new tokens), ``diverging`` (a stored key cut somewhere in
  its middle half, then new tokens up to its length) and ``miss`` (random tokens starting with a token no
  stored key starts with). Ours are also asked the same queries as int32 numpy arrays (the rows
  "numpy query"), which they take without a copy or a per-token conversion.
* Values: tiny objects (``nbytes = llama_state_size = 1``) and a capacity far above their sum, so nothing
  is ever evicted and only the lookup structures are measured.

Timing: ``time.perf_counter_ns`` around each ``cache[query]`` (a ``KeyError`` counts as a lookup), with
the garbage collector paused as ``timeit`` does. Each repetition walks the queries and, for every query,
times the three caches back to back in a rotating order, so machine noise hits them alike. llama-cpp-python
scans every stored key with a Python loop (about 0.1 s per lookup at 10,000 entries), so it gets fewer
repetitions than ours; the table says how many. Reported: median microseconds per lookup, overall and per
query kind, and the ratio of medians (theirs / ours).

Their cache is filled through its ``cache_state`` dict (exactly what their ``__setitem__`` stores when
nothing is evicted) because their ``__setitem__`` costs O(N * K): it re-sums ``cache_size`` over every
entry, re-hashing every tuple key, so building 10,000 entries through it takes about 15 minutes. The
median time of three real ``__setitem__`` calls into each filled cache is reported instead.

Memory:

* both sides are built under ``tracemalloc`` from what ``llama_cpp.Llama`` hands a cache, a fresh
  ``list`` of Python ints per key made inside the traced build, and charged what the build leaves
  allocated (the values are allocated beforehand and not counted, for both). Ours keeps an int32 array
  per key plus the radix tree, LRU list and byte accounting; theirs a tuple per key, the int objects it
  keeps alive and the ``OrderedDict``. tracemalloc counts requested bytes, so the allocator's rounding
  (28-byte ints take 32) comes on top for theirs;
* ours also reports ``cache.index_nbytes()`` (radix tree plus the stored key arrays) per stored token;
* a second workload of 1,000 keys of 2,000 random tokens sharing nothing checks the target of under
  16 bytes of index per stored token where the tree cannot share prefixes.

Targets (from the issue), judged at the largest size run: at 10,000 entries a lookup under 1 ms and at least 1,000x faster than
llama-cpp-python's linear scan (ratio of the overall medians); index memory under 16 B per stored token
where keys share nothing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp.llama_cache as upstream
import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from benchmarks.machine import finish, machine, write
from llama_cache import LlamaRAMCache, LlamaTrieCache

SEED = 20240611
VOCAB = 49_152
SIZES = (10, 1_000, 10_000)
SYSTEM_PROMPTS = 8
SYSTEM_TOKENS = (300, 800)
FIRST_KEY_TOKENS = (1_700, 1_900)
TURNS_AFTER_FIRST = 3
TURN_TOKENS = (100, 200)
SUFFIX_TOKENS = (100, 300)
QUERIES_PER_KIND = 10
OUR_REPS = 30
THEIR_REPS = 5
DISJOINT_ENTRIES = 1_000
DISJOINT_TOKENS = 2_000
CAPACITY_BYTES = 1 << 62
LOOKUP_TARGET_US = 1_000.0
SPEEDUP_TARGET = 1_000.0
BYTES_PER_TOKEN_TARGET = 16.0
KINDS = ("stored+suffix", "diverging", "miss")
OURS_RAM = "llama_cache.LlamaRAMCache"
OURS_TRIE = "llama_cache.LlamaTrieCache"
THEIRS = "llama_cpp.LlamaRAMCache"
CACHE_NAMES = (OURS_RAM, OURS_TRIE, THEIRS)
NUMPY = ", numpy query"
OURS_RAM_NUMPY = OURS_RAM + NUMPY
OURS_TRIE_NUMPY = OURS_TRIE + NUMPY
# What is timed: each built cache with list queries, and ours again with the same queries as int32 arrays.
TIMED = (OURS_RAM, OURS_TRIE, THEIRS, OURS_RAM_NUMPY, OURS_TRIE_NUMPY)
OURS = (OURS_RAM, OURS_TRIE, OURS_RAM_NUMPY, OURS_TRIE_NUMPY)
RESULTS = Path(__file__).resolve().parent / "results" / "lookup.json"

Tokens = npt.NDArray[np.int32]


class State:
    """A stand-in for a saved state: one byte to both caches' accounting, and the key it was saved for."""

    __slots__ = ("input_ids", "nbytes", "llama_state_size")

    def __init__(self, input_ids: Tokens) -> None:
        self.input_ids = input_ids
        self.nbytes = 1
        self.llama_state_size = 1


@dataclass(frozen=True)
class Query:
    kind: str
    tokens: list[int]
    array: Tokens  # the same tokens as an int32 array, for the numpy query rows

    @classmethod
    def of(cls, kind: str, tokens: list[int]) -> Query:
        return cls(kind, tokens, np.array(tokens, dtype=np.int32))


@dataclass
class Built:
    """A cache filled with the first ``entries`` keys, and what building it allocated."""

    name: str
    cache: Any
    traced_bytes: int
    index_bytes: int | None  # ours only


@dataclass
class Timings:
    """Lookup times in nanoseconds per cache and query kind."""

    ns: dict[str, dict[str, list[int]]] = field(
        default_factory=lambda: {name: {kind: [] for kind in KINDS} for name in TIMED}
    )
    hits: dict[str, dict[str, int]] = field(
        default_factory=lambda: {name: dict.fromkeys(KINDS, 0) for name in TIMED}
    )


# ------------------------------------------------------------------------------------------ workload


def random_tokens(rng: np.random.Generator, low_high: tuple[int, int]) -> Tokens:
    length = int(rng.integers(low_high[0], low_high[1] + 1))
    return rng.integers(0, VOCAB, size=length, dtype=np.int32)


def conversation_keys(rng: np.random.Generator, system: Tokens) -> Iterator[Tokens]:
    """The keys of one conversation: system prompt plus turns, each key extending the previous one."""
    first_length = int(rng.integers(FIRST_KEY_TOKENS[0], FIRST_KEY_TOKENS[1] + 1))
    opening = rng.integers(0, VOCAB, size=first_length - len(system), dtype=np.int32)
    key = np.concatenate([system, opening])
    yield key
    for _ in range(TURNS_AFTER_FIRST):
        key = np.concatenate([key, random_tokens(rng, TURN_TOKENS)])
        yield key


def shared_prefix_keys(rng: np.random.Generator, count: int) -> list[Tokens]:
    """``count`` keys from conversations over a few shared system prompts."""
    systems = [random_tokens(rng, SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS)]
    keys: list[Tokens] = []
    while len(keys) < count:
        system = systems[int(rng.integers(len(systems)))]
        keys.extend(conversation_keys(rng, system))
    return keys[:count]


def disjoint_keys(rng: np.random.Generator, count: int) -> list[Tokens]:
    """``count`` keys of random tokens, with distinct first tokens so no two share even one token."""
    firsts = rng.choice(VOCAB, size=count, replace=False).astype(np.int32)
    keys = rng.integers(0, VOCAB, size=(count, DISJOINT_TOKENS), dtype=np.int32)
    keys[:, 0] = firsts
    return [row.copy() for row in keys]


def fresh_token(rng: np.random.Generator, avoid: set[int] | int) -> int:
    banned = {avoid} if isinstance(avoid, int) else avoid
    while True:
        token = int(rng.integers(VOCAB))
        if token not in banned:
            return token


def make_queries(rng: np.random.Generator, keys: Sequence[Tokens]) -> list[Query]:
    """``QUERIES_PER_KIND`` queries of each kind against the stored ``keys``."""
    firsts = {int(key[0]) for key in keys}
    queries: list[Query] = []
    for _ in range(QUERIES_PER_KIND):
        key = keys[int(rng.integers(len(keys)))]
        suffix = random_tokens(rng, SUFFIX_TOKENS)
        queries.append(Query.of("stored+suffix", key.tolist() + suffix.tolist()))
    for _ in range(QUERIES_PER_KIND):
        key = keys[int(rng.integers(len(keys)))]
        cut = int(rng.integers(len(key) // 4, 3 * len(key) // 4))
        tail = rng.integers(0, VOCAB, size=len(key) - cut, dtype=np.int32)
        tail[0] = fresh_token(rng, int(key[cut]))
        queries.append(Query.of("diverging", key[:cut].tolist() + tail.tolist()))
    for _ in range(QUERIES_PER_KIND):
        tokens = rng.integers(0, VOCAB, size=DISJOINT_TOKENS, dtype=np.int32)
        tokens[0] = fresh_token(rng, firsts)
        queries.append(Query.of("miss", tokens.tolist()))
    return queries


# ------------------------------------------------------------------------------------------ building


def traced(build: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``build`` under tracemalloc; return its result and the bytes still allocated afterwards."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = build()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return result, after - before


def fill_ours(cache: Any, keys: Sequence[Tokens], states: Sequence[State], bar: tqdm) -> Any:
    """Fill one of our caches with what ``llama_cpp.Llama`` hands it: a fresh list of ints per key.

    The same input as :func:`fill_theirs`, made inside the traced build as theirs is, so both sides'
    memory is measured the same way: whatever a cache keeps of the key (ours an int32 array, theirs a
    tuple of ints) is counted, and nothing it was handed comes for free.
    """
    for key, state in zip(keys, states):
        cache[key.tolist()] = state
        bar.update()
    return cache


def fill_theirs(keys: Sequence[Tokens], states: Sequence[State], bar: tqdm) -> Any:
    """Fill llama-cpp-python's cache with what ``llama_cpp.Llama`` hands it: a fresh list of ints per key.

    The entries go straight into ``cache_state`` as ``tuple(key)``, which is all their ``__setitem__`` does
    for a new key when nothing is evicted. Their ``__setitem__`` itself is skipped because it recomputes
    ``cache_size`` over every entry, and iterating an ``OrderedDict``'s values re-hashes each 2,000-int
    tuple key: O(N * K) per insert, about 15 minutes to build 10,000 entries (see :func:`their_insert_ms`).
    """
    cache = upstream.LlamaRAMCache(capacity_bytes=CAPACITY_BYTES)
    for key, state in zip(keys, states):
        cache.cache_state[tuple(key.tolist())] = state
        bar.update()
    return cache


def their_insert_ms(cache: Any, rng: np.random.Generator, inserts: int = 3) -> float:
    """Median milliseconds of llama-cpp-python's own ``__setitem__`` for a new key into the filled cache.

    The inserted keys are removed again, so the cache is left as it was.
    """
    times: list[int] = []
    for _ in range(inserts):
        key = rng.integers(0, VOCAB, size=DISJOINT_TOKENS, dtype=np.int32)
        tokens = key.tolist()
        start = time.perf_counter_ns()
        cache[tokens] = State(key)
        times.append(time.perf_counter_ns() - start)
        del cache.cache_state[tuple(tokens)]
    return statistics.median(times) / 1e6


def build_caches(keys: Sequence[Tokens], label: str) -> dict[str, Built]:
    """All three caches over ``keys``, each built under tracemalloc (values allocated beforehand)."""
    states = [State(key) for key in keys]
    built: dict[str, Built] = {}
    with tqdm(total=3 * len(keys), desc=f"building {label}", unit="key", file=sys.stderr) as bar:
        for name, cls in ((OURS_RAM, LlamaRAMCache), (OURS_TRIE, LlamaTrieCache)):
            cache, nbytes = traced(
                lambda cls=cls: fill_ours(cls(capacity_bytes=CAPACITY_BYTES), keys, states, bar)
            )
            built[name] = Built(name, cache, nbytes, cache.index_nbytes())
        cache, nbytes = traced(lambda: fill_theirs(keys, states, bar))
        built[THEIRS] = Built(THEIRS, cache, nbytes, None)
    for item in built.values():
        assert len(item.cache.cache_state if item.name == THEIRS else item.cache) == len(keys)
    return built


# ------------------------------------------------------------------------------------------ timing


def lookup_ns(cache: Any, tokens: list[int] | Tokens) -> tuple[int, State | None]:
    start = time.perf_counter_ns()
    try:
        value = cache[tokens]
    except KeyError:
        value = None
    return time.perf_counter_ns() - start, value


def common_prefix(a: Tokens, b: list[int]) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != np.asarray(b[:m], dtype=np.int32))
    return int(diff[0]) if diff.size else m


def check_answer(name: str, query: Query, value: State | None, answers: dict[str, State | None]) -> None:
    """Each cache must answer by its own rule; ours (RAM) and theirs must agree on the common prefix."""
    answers[name] = value
    if name == OURS_TRIE and value is not None:
        assert common_prefix(value.input_ids, query.tokens) == len(value.input_ids), "trie: not a prefix"
    if name.endswith(NUMPY) and name.removesuffix(NUMPY) in answers:
        assert value is answers[name.removesuffix(NUMPY)], f"{query.kind}: numpy and list queries disagree"
    if len(answers) == len(TIMED):
        ours, theirs = answers[OURS_RAM], answers[THEIRS]
        assert (ours is None) == (theirs is None), f"{query.kind}: hit/miss disagree"
        if ours is not None and theirs is not None:
            ours_common = common_prefix(ours.input_ids, query.tokens)
            theirs_common = common_prefix(theirs.input_ids, query.tokens)
            assert ours_common == theirs_common, f"{query.kind}: different common prefix lengths"


def time_lookups(built: dict[str, Built], queries: Sequence[Query], label: str) -> Timings:
    """Interleaved timing: per query, the caches back to back in an order rotating with the query."""
    timings = Timings()
    for query in queries:  # warm-up, untimed, every cache alike
        for name in TIMED:
            lookup_ns(built[name.removesuffix(NUMPY)].cache, query.array if name.endswith(NUMPY) else query.tokens)
    total = len(queries) * (len(OURS) * OUR_REPS + THEIR_REPS)
    gc.collect()
    gc.disable()
    try:
        with tqdm(total=total, desc=f"timing {label}", unit="lookup", file=sys.stderr) as bar:
            for rep in range(OUR_REPS):
                for index, query in enumerate(queries):
                    shift = (rep + index) % len(TIMED)
                    answers: dict[str, State | None] = {}
                    for name in TIMED[shift:] + TIMED[:shift]:
                        if name == THEIRS and rep >= THEIR_REPS:
                            continue
                        tokens = query.array if name.endswith(NUMPY) else query.tokens
                        ns, value = lookup_ns(built[name.removesuffix(NUMPY)].cache, tokens)
                        timings.ns[name][query.kind].append(ns)
                        if rep == 0:
                            timings.hits[name][query.kind] += value is not None
                            check_answer(name, query, value, answers)
                        bar.update()
    finally:
        gc.enable()
    return timings


# ------------------------------------------------------------------------------------------ results


def median_us(values: Sequence[int]) -> float:
    return statistics.median(values) / 1_000.0


def summarize_size(
    entries: int, keys: Sequence[Tokens], built: dict[str, Built], timings: Timings
) -> dict[str, Any]:
    stored_tokens = int(sum(len(key) for key in keys))
    theirs_all = [ns for kind in KINDS for ns in timings.ns[THEIRS][kind]]
    caches: dict[str, Any] = {}
    for name in TIMED:
        item = built[name.removesuffix(NUMPY)]
        per_kind = timings.ns[name]
        everything = [ns for kind in KINDS for ns in per_kind[kind]]
        row: dict[str, Any] = {
            "repetitions": THEIR_REPS if name == THEIRS else OUR_REPS,
            "lookups": len(everything),
            "median_us": median_us(everything),
            "median_us_by_kind": {kind: median_us(per_kind[kind]) for kind in KINDS},
            "hits_by_kind": timings.hits[name],
            "query_type": "numpy int32 array" if name.endswith(NUMPY) else "list[int]",
            "traced_bytes": item.traced_bytes,
            "traced_bytes_per_token": item.traced_bytes / stored_tokens,
        }
        if name != THEIRS:
            row["speedup_vs_theirs"] = median_us(theirs_all) / row["median_us"]
            row["speedup_vs_theirs_by_kind"] = {
                kind: median_us(timings.ns[THEIRS][kind]) / row["median_us_by_kind"][kind] for kind in KINDS
            }
            index_bytes = item.index_bytes
            assert index_bytes is not None
            row["index_bytes"] = index_bytes
            row["index_bytes_per_token"] = index_bytes / stored_tokens
        caches[name] = row
    return {
        "entries": entries,
        "stored_tokens": stored_tokens,
        "mean_key_tokens": stored_tokens / entries,
        "queries_per_kind": QUERIES_PER_KIND,
        "caches": caches,
    }


def summarize_disjoint(keys: Sequence[Tokens], built: dict[str, Built]) -> dict[str, Any]:
    stored_tokens = int(sum(len(key) for key in keys))
    caches: dict[str, Any] = {}
    for name, item in built.items():
        row: dict[str, Any] = {"traced_bytes_per_token": item.traced_bytes / stored_tokens}
        if item.index_bytes is not None:
            row["index_bytes_per_token"] = item.index_bytes / stored_tokens
        caches[name] = row
    return {"entries": len(keys), "stored_tokens": stored_tokens, "caches": caches}


def check_targets(sizes: list[dict[str, Any]], disjoint: dict[str, Any]) -> dict[str, Any]:
    largest = max(sizes, key=lambda size: size["entries"])
    entries = largest["entries"]
    targets: dict[str, Any] = {}
    for name in OURS:
        row = largest["caches"].get(name)
        if row is None:  # a result from before the numpy rows
            continue
        index_per_token = disjoint["caches"][name.removesuffix(NUMPY)]["index_bytes_per_token"]
        targets[name] = {
            f"lookup_under_{LOOKUP_TARGET_US:.0f}us_at_{entries}": row["median_us"] < LOOKUP_TARGET_US,
            f"speedup_at_least_{SPEEDUP_TARGET:.0f}x_at_{entries}": (
                row["speedup_vs_theirs"] >= SPEEDUP_TARGET
            ),
            f"index_under_{BYTES_PER_TOKEN_TARGET:.0f}_bytes_per_token_disjoint": (
                index_per_token < BYTES_PER_TOKEN_TARGET
            ),
        }
    return targets


def print_latency(sizes: list[dict[str, Any]]) -> None:
    print("Lookup latency: median microseconds per cache[query] (queries: Python lists of ~2,000 tokens; "
          "the numpy rows: the same as int32 arrays)")
    print(f"  ours timed {OUR_REPS} repetitions, llama-cpp-python {THEIR_REPS} (its lookup scans every key);")
    print(f"  {QUERIES_PER_KIND} queries per kind; speedup = llama-cpp-python median / ours, same run")
    header = f"{'entries':>7}  {'cache':<39} {'reps':>4} {'median':>10}"
    header += "".join(f" {kind:>13}" for kind in KINDS) + f" {'speedup':>9}  hits (a/b/c)"
    print(header)
    for size in sizes:
        for name in TIMED:
            row = size["caches"][name]
            line = f"{size['entries']:>7,}  {name:<39} {row['repetitions']:>4} {row['median_us']:>10.1f}"
            line += "".join(f" {row['median_us_by_kind'][kind]:>13.1f}" for kind in KINDS)
            speedup = f"{row['speedup_vs_theirs']:>8.0f}x" if "speedup_vs_theirs" in row else f"{'-':>9}"
            hits = "/".join(str(row["hits_by_kind"][kind]) for kind in KINDS)
            print(f"{line} {speedup}  {hits}")
    inserts = ", ".join(
        f"{size['caches'][THEIRS]['setitem_ms']:.1f} ms at {size['entries']:,}" for size in sizes
    )
    print(f"  llama-cpp-python's own __setitem__ for one new key (median of 3): {inserts}")
    print()


def print_memory(sizes: list[dict[str, Any]], disjoint: dict[str, Any]) -> None:
    print("Memory per stored token (bytes): index = cache.index_nbytes(), traced = tracemalloc of the build")
    print(f"{'workload':<22} {'entries':>7} {'tokens':>11}  {'cache':<26} {'index':>7} {'traced':>7}")
    rows = [("shared prefixes", size) for size in sizes] + [("disjoint (no sharing)", disjoint)]
    for label, size in rows:
        for name in CACHE_NAMES:
            row = size["caches"][name]
            index = f"{row['index_bytes_per_token']:>7.2f}" if "index_bytes_per_token" in row else f"{'-':>7}"
            print(
                f"{label:<22} {size['entries']:>7,} {size['stored_tokens']:>11,}  {name:<26} {index} "
                f"{row['traced_bytes_per_token']:>7.2f}"
            )
    print()


def print_targets(targets: dict[str, Any]) -> None:
    print("Targets")
    for name, checks in targets.items():
        for check, met in checks.items():
            print(f"  {name:<39} {check:<42} {'MET' if met else 'NOT MET'}")


# ------------------------------------------------------------------------------------------ main


def run_size(rng: np.random.Generator, pool: Sequence[Tokens], entries: int) -> dict[str, Any]:
    keys = pool[:entries]
    built = build_caches(keys, f"{entries:,} entries")
    queries = make_queries(rng, keys)
    timings = time_lookups(built, queries, f"{entries:,} entries")
    summary = summarize_size(entries, keys, built, timings)
    summary["caches"][THEIRS]["setitem_ms"] = their_insert_ms(built[THEIRS].cache, rng)
    del built
    gc.collect()
    return summary


def run_disjoint(rng: np.random.Generator) -> dict[str, Any]:
    keys = disjoint_keys(rng, DISJOINT_ENTRIES)
    built = build_caches(keys, "disjoint keys")
    summary = summarize_disjoint(keys, built)
    del built
    gc.collect()
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=lambda text: [int(n) for n in text.split(",")], default=list(SIZES),
                        help="entries per size, comma-separated (default 10,1000,10000; the targets are "
                        "judged at the largest)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rng = np.random.default_rng(SEED)
    report: dict[str, Any] = {
        "benchmark": "lookup",
        "command": "tools/run python benchmarks/lookup.py" + (f" --sizes {','.join(map(str, args.sizes))}"
                                                              if args.sizes != list(SIZES) else ""),
        "machine": machine(),
        "workload": {
            "seed": SEED,
            "vocab": VOCAB,
            "system_prompts": SYSTEM_PROMPTS,
            "system_tokens": SYSTEM_TOKENS,
            "first_key_tokens": FIRST_KEY_TOKENS,
            "turns_after_first": TURNS_AFTER_FIRST,
            "turn_tokens": TURN_TOKENS,
            "suffix_tokens": SUFFIX_TOKENS,
            "query_kinds": KINDS,
            "query_type": "list[int]; ours also numpy int32 arrays (the rows ending in ', numpy query')",
            "our_repetitions": OUR_REPS,
            "their_repetitions": THEIR_REPS,
            "gc_disabled_while_timing": True,
        },
        "sizes": [],
    }
    pool = shared_prefix_keys(rng, max(args.sizes))
    for entries in args.sizes:
        report["sizes"].append(run_size(rng, pool, entries))
        write(args.out, report)  # what is done so far, if a later size fails
    disjoint = run_disjoint(rng)
    report["disjoint_keys"] = disjoint
    report["targets"] = check_targets(report["sizes"], disjoint)
    report["seconds"] = time.perf_counter() - started
    finish(report)
    write(args.out, report)
    print_latency(report["sizes"])
    print_memory(report["sizes"], disjoint)
    print_targets(report["targets"])
    print(f"\nwrote {args.out} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
