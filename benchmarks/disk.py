"""Disk tier benchmark: lookups as entries grow, save/load throughput, time to first token from disk.

    tools/run python benchmarks/disk.py              # everything (a few minutes on 2 cores)
    tools/run python benchmarks/disk.py --quick      # smaller sizes, for a smoke run

Prints a table per section and writes ``benchmarks/results/disk.json``. Sections:

1. **Lookup latency** at 10 / 1,000 / 10,000 entries whose keys are ~2,000 tokens with realistic shared
   prefixes (8 system prompts x 64 documents x unique tails; payloads are small so set-up is fast):
   ``key in cache`` and a full hit ``cache[key]`` for :class:`llama_cache.caches.disk.LlamaDiskCache`
   against ``key in cache`` for llama-cpp-python's ``llama_cpp.llama_cache.LlamaDiskCache`` (its
   ``__getitem__`` pops the entry, so membership is what can be timed repeatedly; it scans every key).
   Also the time to open a directory holding that many entries (index rebuild), the set-up time, how
   many entries each side really held (llama-cpp-python's set-up stops at a time budget, and diskcache
   may cull), and each side's memory measured the same way: each side runs in its own fresh process
   (resident memory growth from after the imports to the end, and the peak), and the order of the two
   set-ups alternates from one size to the next.
2. **Throughput** for a real default-model state of ~1,500 tokens stored as one file (``chunk_tokens=0``:
   each store then writes every byte, and a cold read reads one dropped file; the chunked default is
   measured by ``benchmarks/dedup.py`` and ``benchmarks/disk_io.py``): ``cache[key] = state`` (synchronous,
   with and without fsync) and ``cache[key]`` (read + checksum + decode), with the page cache hot and cold
   (``posix_fadvise(DONTNEED)``), against writing / reading the same bytes to / from a plain file in the
   same directory; the caller's stall with write-behind; zlib level 1 ratio and speed.
3. **Time to first token** for that prompt when a freshly started process finds its state on disk,
   against a RAM hit (``LlamaRAMCache``) in a warm process; exact repeat and prompt + suffix.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.machine import finish, machine, write

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "disk.json"
VOCAB = 49_152


def median_time(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


# -- 1. lookups -------------------------------------------------------------------------------------


class Keys:
    """~2,000-token keys sharing prefixes: system prompt (600) + document (800) + unique tail (600)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.systems = [rng.integers(0, VOCAB, 600, dtype=np.int32) for _ in range(8)]
        self.docs = [rng.integers(0, VOCAB, 800, dtype=np.int32) for _ in range(64)]

    def key(self, i: int) -> np.ndarray:
        tail = np.random.default_rng(i + 1).integers(0, VOCAB, 600, dtype=np.int32)
        return np.concatenate([self.systems[i % 8], self.docs[(i // 8) % 64], tail])

    def query(self, i: int) -> list[int]:
        """Entry i's key followed by 100 new tokens: entry i is the unique best answer.

        (The payloads are small opaque states, which answer only queries their key prefixes.)
        """
        fresh = np.random.default_rng(10**6 + i).integers(0, VOCAB, 100, dtype=np.int32)
        return np.concatenate([self.key(i), fresh]).tolist()


def _rss_mib() -> float:
    """Resident memory of this process now (Linux ``/proc``), in MiB."""
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


_LOOKUP_CHILD = "--lookup-child"


def lookup_child(side: str, n: int, directory: str, budget_s: float) -> None:
    """Run in a fresh process: fill one side's cache with ``n`` entries, time its lookups, report memory.

    Both sides run the same code path, in the same kind of process, and have their memory measured
    the same way: resident memory after the imports, after the set-up and after the lookups, and the
    peak (``ru_maxrss``) over the whole run.
    """
    from llama_cpp.llama import LlamaState as UpstreamState
    from llama_cpp.llama_cache import LlamaDiskCache as TheirDiskCache

    from llama_cache.caches.disk import LlamaDiskCache
    from llama_cache.state.llama_state import LlamaState

    keys = Keys()
    rng = np.random.default_rng(n)
    picks = [int(i) for i in rng.integers(0, n, 200)]
    queries = [keys.query(i) for i in picks]
    out: dict[str, Any] = {"side": side, "entries": n, "rss_base_mib": _rss_mib()}
    start = time.perf_counter()
    if side == "ours":
        payload = np.zeros(256, dtype=np.uint8)
        cache = LlamaDiskCache(directory, capacity_bytes=1 << 34)
        for i in range(n):
            key = keys.key(i)
            cache[key] = LlamaState(key, None, 0, "bench", opaque=payload)
        cache.flush()
        out["setup_s"] = time.perf_counter() - start
        cache.close()
        out["attempted"] = n
        start = time.perf_counter()
        cache = LlamaDiskCache(directory, capacity_bytes=1 << 34)
        _ = queries[0] in cache
        out["open_ms"] = (time.perf_counter() - start) * 1e3
        out["held"] = len(cache)
        out["rss_setup_mib"] = _rss_mib()
        it = iter(queries * 10)
        out["contains_us"] = median_time(lambda: next(it) in cache, 200) * 1e6
        it = iter(queries * 10)
        out["getitem_us"] = median_time(lambda: cache[next(it)], 100) * 1e6
        assert all(cache[q].n_tokens == 2000 for q in queries[:5])
        cache.close()
    else:
        theirs = TheirDiskCache(directory, capacity_bytes=1 << 34)
        small = UpstreamState(np.zeros(8, np.intc), np.zeros((1, 8), np.single), 8, bytes(256), 256, 0)
        attempted = 0
        # llama-cpp-python's disk cache prints on every store: silence it while filling.
        with contextlib.redirect_stderr(io.StringIO()):
            for i in range(n):
                theirs[keys.key(i).tolist()] = small
                attempted += 1
                if time.perf_counter() - start > budget_s:
                    break
        out["setup_s"] = time.perf_counter() - start
        out["attempted"] = attempted
        out["held"] = len(theirs.cache)  # what diskcache kept (its own size limit may cull)
        out["rss_setup_mib"] = _rss_mib()
        held_keys = {tuple(k) for k in theirs.cache.iterkeys()}
        their_queries = [q for q, i in zip(queries, picks) if tuple(keys.key(i).tolist()) in held_keys] or queries
        reps = 30 if out["held"] <= 100 else 7 if out["held"] <= 2000 else 3
        it = iter(their_queries * 10)
        out["contains_us"] = median_time(lambda: next(it) in theirs, reps) * 1e6
        theirs.cache.close()
    out["rss_end_mib"] = _rss_mib()
    out["peak_rss_mib"] = max(_peak_rss_mib(), out["rss_end_mib"])
    print(json.dumps(out))


def bench_lookups(sizes: list[int], workdir: Path, their_budget_s: float) -> list[dict[str, Any]]:
    """Each side in its own fresh process, the order of the two set-ups rotating from one size to the next."""
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for position, n in enumerate(sizes):
        order = ("ours", "theirs") if position % 2 == 0 else ("theirs", "ours")
        runs: dict[str, dict[str, Any]] = {}
        for side in order:
            child = subprocess.run(
                [sys.executable, __file__, _LOOKUP_CHILD, side, str(n), str(workdir / f"{side}-{n}"), str(their_budget_s)],
                capture_output=True, text=True, check=True, cwd=ROOT,
            )
            runs[side] = json.loads(child.stdout.strip().splitlines()[-1])
        ours, theirs = runs["ours"], runs["theirs"]
        results.append(
            {
                "entries": n,
                "first": order[0],
                "ours_setup_s": ours["setup_s"],
                "ours_open_ms": ours["open_ms"],
                "ours_contains_us": ours["contains_us"],
                "ours_getitem_us": ours["getitem_us"],
                "ours_held": ours["held"],
                "ours_rss_growth_mib": ours["rss_end_mib"] - ours["rss_base_mib"],
                "ours_peak_rss_mib": ours["peak_rss_mib"],
                "theirs_attempted": theirs["attempted"],
                "theirs_entries": theirs["held"],
                "theirs_setup_s": theirs["setup_s"],
                "theirs_contains_us": theirs["contains_us"],
                "theirs_rss_growth_mib": theirs["rss_end_mib"] - theirs["rss_base_mib"],
                "theirs_peak_rss_mib": theirs["peak_rss_mib"],
            }
        )
        print(f"  lookups: {n} entries done", file=sys.stderr)
    table(
        "Lookup latency (keys of 2,000 tokens sharing prefixes; median; each side in a fresh process)",
        ["entries", "ours: in", "ours: get (hit)", "ours: open", "ours: set-up", "ours: RSS +/peak",
         "theirs: held/tried", "theirs: in", "theirs set-up", "theirs: RSS +/peak", "first"],
        [
            [
                r["entries"],
                f"{r['ours_contains_us']:.0f} us",
                f"{r['ours_getitem_us']:.0f} us",
                f"{r['ours_open_ms']:.0f} ms",
                f"{r['ours_setup_s']:.1f} s",
                f"{r['ours_rss_growth_mib']:.0f}/{r['ours_peak_rss_mib']:.0f} MiB",
                f"{r['theirs_entries']}/{r['theirs_attempted']}",
                f"{r['theirs_contains_us'] / 1e3:.2f} ms",
                f"{r['theirs_setup_s']:.1f} s",
                f"{r['theirs_rss_growth_mib']:.0f}/{r['theirs_peak_rss_mib']:.0f} MiB",
                r["first"],
            ]
            for r in results
        ],
    )
    return results


# -- 2. throughput ----------------------------------------------------------------------------------


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cold_time(fn: Callable[[], Any], path: Path, repeat: int) -> float:
    """Median time of ``fn`` with ``path`` evicted from the page cache before each run."""
    times = []
    for _ in range(repeat):
        drop_from_page_cache(path)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def first_data_file(directory: Path) -> Path:
    from llama_cache.caches.disk import DATA_DIR, LlamaDiskCache

    with LlamaDiskCache(directory, write_behind=False) as cache:
        return directory / DATA_DIR / cache.entries()[0].file


def real_state(n_tokens: int) -> tuple[Any, Any, list[int], float]:
    """Load the default model and make the state of an ``n_tokens`` prompt the way a server does: a
    completion with a RAM cache attached (so the state carries its last logits row).

    Returns:
        The model, the prompt's state, the prompt tokens and the cold time to first token.
    """
    import llama_cache
    from llama_cache.caches.ram import LlamaRAMCache
    from llama_cache.llama import Llama
    from llama_cache.measure import timed_completion

    llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=2048, n_threads=2, verbose=False, seed=0)
    text = "The quick brown fox jumps over the lazy dog while the cache keeps every state it saw. " * 200
    tokens = llm.tokenize(text.encode())[:n_tokens]
    ram = LlamaRAMCache(capacity_bytes=1 << 32)
    llm.set_cache(ram)
    cold = timed_completion(llm, tokens, max_tokens=1, temperature=0)
    llm.set_cache(None)
    state = ram[tokens]
    assert state.n_tokens == len(tokens) and state.logits is not None
    return llm, state, tokens, cold.ttft_s


def variant(state: Any, i: int) -> Any:
    """``state`` with its last token replaced by ``i``: the same bytes under a key the cache does not
    hold yet, so that storing it is a real write (a store of tokens already held is only a touch)."""
    from llama_cache.state.llama_state import LlamaState

    tokens = state.tokens.copy()
    tokens[-1] = i
    return LlamaState.from_seq_bytes(tokens, state.logits, state.seed, state.fingerprint, state.seq_bytes())


def store(cache: Any, state: Any) -> None:
    cache[state.tokens] = state


def bench_throughput(state: Any, workdir: Path, repeat: int) -> dict[str, Any]:
    from llama_cache.caches.disk import DATA_DIR, LlamaDiskCache
    from llama_cache.state.format import encode

    blob = b"".join(bytes(p) for p in encode(state))
    size = len(blob)
    mb = size / 1e6
    out: dict[str, Any] = {"state_bytes": size, "n_tokens": state.n_tokens}
    plain_dir = workdir / "plain"
    plain_dir.mkdir(parents=True)

    def plain_write(path: Path, fsync: bool) -> None:
        with open(path, "wb") as file:
            file.write(blob)
            if fsync:
                file.flush()
                os.fsync(file.fileno())

    for fsync in (False, True):
        counter = iter(range(10**6))
        out[f"plain_write_mbps_fsync_{fsync}"] = mb / median_time(
            lambda: plain_write(plain_dir / f"w{fsync}{next(counter)}", fsync), repeat
        )
        # Whole-state files (chunk_tokens=0): the variants share all but their last chunk, so a chunked store
        # would write one chunk of the bytes counted here.
        cache = LlamaDiskCache(workdir / f"ours-fsync-{fsync}", capacity_bytes=1 << 33, write_behind=False, fsync=fsync,
                               chunk_tokens=0)
        variants = iter([variant(state, i) for i in range(repeat)])  # made outside the timed calls
        out[f"ours_save_mbps_fsync_{fsync}"] = mb / median_time(lambda: store(cache, next(variants)), repeat)
        assert cache.stats().writes == repeat  # every store was a real write
        cache.close()

    # One file, so that dropping it from the page cache makes the whole read cold.
    cache = LlamaDiskCache(workdir / "ours-load", capacity_bytes=1 << 33, write_behind=False, chunk_tokens=0)
    key = state.tokens.tolist()
    cache[key] = state
    data_file = cache.cache_dir / DATA_DIR / cache.entries()[0].file
    plain_file = plain_dir / "read.bin"
    plain_file.write_bytes(blob)

    def plain_read() -> None:
        with open(plain_file, "rb") as file:
            assert len(file.read()) == size

    def ours_read() -> None:
        loaded = cache[key]
        assert loaded.n_tokens == state.n_tokens

    out["plain_read_mbps_hot"] = mb / median_time(plain_read, repeat)
    out["ours_load_mbps_hot"] = mb / median_time(ours_read, repeat)
    # Without the checksum pass a load only reads the file.
    cache.verify = False
    out["ours_load_noverify_mbps_hot"] = mb / median_time(ours_read, repeat)
    cache.verify = True

    out["plain_read_mbps_cold"] = mb / cold_time(plain_read, plain_file, repeat)
    out["ours_load_mbps_cold"] = mb / cold_time(ours_read, data_file, repeat)
    cache.close()

    # The caller's stall with write-behind: queueing only (the writer works in the background).
    cache = LlamaDiskCache(workdir / "ours-behind", capacity_bytes=1 << 33, max_pending=64, chunk_tokens=0)
    pending = [variant(state, i) for i in range(repeat)]
    it = iter(pending)
    out["write_behind_stall_ms"] = 1e3 * median_time(lambda: store(cache, next(it)), repeat)
    start = time.perf_counter()
    cache.flush()
    out["write_behind_drain_ms_per_state"] = 1e3 * (time.perf_counter() - start) / repeat
    cache.close()

    # Compression: zlib level 1 on the real bytes, and the cache with compress=1.
    start = time.perf_counter()
    packed = zlib.compress(blob, 1)
    out["zlib1_ratio"] = len(packed) / size
    out["zlib1_compress_mbps"] = mb / (time.perf_counter() - start)
    start = time.perf_counter()
    zlib.decompress(packed)
    out["zlib1_decompress_mbps"] = mb / (time.perf_counter() - start)
    cache = LlamaDiskCache(workdir / "ours-zlib", capacity_bytes=1 << 33, write_behind=False, compress=1,
                           chunk_tokens=0)
    variants = iter([variant(state, i) for i in range(3)])
    out["ours_save_mbps_zlib1"] = mb / median_time(lambda: store(cache, next(variants)), 3)
    out["ours_load_mbps_zlib1"] = mb / median_time(lambda: cache[key + [0]], 3)
    cache.close()

    out["save_vs_plain"] = out["ours_save_mbps_fsync_False"] / out["plain_write_mbps_fsync_False"]
    out["save_vs_plain_fsync"] = out["ours_save_mbps_fsync_True"] / out["plain_write_mbps_fsync_True"]
    out["load_vs_plain_hot"] = out["ours_load_mbps_hot"] / out["plain_read_mbps_hot"]
    out["load_vs_plain_cold"] = out["ours_load_mbps_cold"] / out["plain_read_mbps_cold"]
    table(
        f"Throughput, real default-model state ({state.n_tokens} tokens, {mb:.1f} MB; median of {repeat})",
        ["operation", "llama-cache", "plain file", "ratio"],
        [
            ["save", f"{out['ours_save_mbps_fsync_False']:.0f} MB/s", f"{out['plain_write_mbps_fsync_False']:.0f} MB/s",
             f"{out['save_vs_plain']:.0%}"],
            ["save + fsync", f"{out['ours_save_mbps_fsync_True']:.0f} MB/s", f"{out['plain_write_mbps_fsync_True']:.0f} MB/s",
             f"{out['save_vs_plain_fsync']:.0%}"],
            ["load, page cache hot", f"{out['ours_load_mbps_hot']:.0f} MB/s", f"{out['plain_read_mbps_hot']:.0f} MB/s",
             f"{out['load_vs_plain_hot']:.0%}"],
            ["load, page cache cold", f"{out['ours_load_mbps_cold']:.0f} MB/s", f"{out['plain_read_mbps_cold']:.0f} MB/s",
             f"{out['load_vs_plain_cold']:.0%}"],
            ["load, hot, verify=False", f"{out['ours_load_noverify_mbps_hot']:.0f} MB/s", "", "(maps only)"],
            ["save, zlib 1", f"{out['ours_save_mbps_zlib1']:.0f} MB/s", "", f"size x{out['zlib1_ratio']:.2f}"],
            ["load, zlib 1", f"{out['ours_load_mbps_zlib1']:.0f} MB/s", "", ""],
            ["write-behind: caller stall", f"{out['write_behind_stall_ms']:.2f} ms", "", ""],
            ["write-behind: drain / state", f"{out['write_behind_drain_ms_per_state']:.0f} ms", "", ""],
        ],
    )
    return out


# -- 3. time to first token ---------------------------------------------------------------------------

_CHILD = "--ttft-child"


def ttft_child(directory: str, tokens_file: str, suffix_file: str) -> None:
    """Run in a fresh process: load the model, open the disk cache, time the first token."""
    import llama_cache
    from llama_cache.caches.disk import LlamaDiskCache
    from llama_cache.llama import Llama
    from llama_cache.measure import timed_completion

    tokens = json.loads(Path(tokens_file).read_text())
    suffix = json.loads(Path(suffix_file).read_text())
    llm = Llama(model_path=str(llama_cache.default_model_path()), n_ctx=2048, n_threads=2, verbose=False, seed=0)
    start = time.perf_counter()
    cache = LlamaDiskCache(directory, fingerprint=llm.fingerprint)
    open_s = time.perf_counter() - start
    llm.set_cache(cache)
    prompt = tokens + suffix if suffix else tokens
    timing = timed_completion(llm, prompt, max_tokens=1, temperature=0)
    cache.close()
    print(json.dumps({"ttft_s": timing.ttft_s, "evaluated": timing.prompt_tokens_evaluated, "open_s": open_s}))


def bench_ttft(llm: Any, state: Any, tokens: list[int], workdir: Path, repeat: int) -> dict[str, Any]:
    from llama_cache.caches.disk import LlamaDiskCache
    from llama_cache.caches.ram import LlamaRAMCache
    from llama_cache.measure import timed_completion

    suffix = llm.tokenize(b" And then the story ends.", add_bos=False)
    workdir.mkdir(parents=True, exist_ok=True)
    directory = workdir / "ttft-cache"
    tokens_file = workdir / "tokens.json"
    tokens_file.write_text(json.dumps(tokens))

    def probe_directory() -> Path:
        """A directory holding only the prompt's state (a child's completion stores more entries)."""
        shutil.rmtree(directory, ignore_errors=True)
        with LlamaDiskCache(directory, fingerprint=llm.fingerprint) as cache:
            cache[tokens] = state
        return first_data_file(directory)

    out: dict[str, Any] = {}
    for label, extra in (("exact", []), ("suffix", suffix)):
        suffix_file = workdir / f"suffix-{label}.json"
        suffix_file.write_text(json.dumps(extra))
        # A RAM hit in a warm process.
        ram = LlamaRAMCache(capacity_bytes=1 << 32)
        llm.set_cache(ram)
        ram_runs = []
        for _ in range(repeat):
            llm.reset()
            ram.clear()
            ram[tokens] = state
            ram_runs.append(timed_completion(llm, tokens + extra, max_tokens=1, temperature=0))
        llm.set_cache(None)
        for mode in ("hot", "cold"):
            runs = []
            for _ in range(repeat):
                data_file = probe_directory()
                if mode == "cold":
                    drop_from_page_cache(data_file)
                else:
                    fsync_file(data_file)  # no writeback of the fresh file during the measurement
                child = subprocess.run(
                    [sys.executable, __file__, _CHILD, str(directory), str(tokens_file), str(suffix_file)],
                    capture_output=True, text=True, check=True, cwd=ROOT,
                )
                runs.append(json.loads(child.stdout))
            out[f"{label}_disk_{mode}_ttft_ms"] = 1e3 * statistics.median(r["ttft_s"] for r in runs)
            out[f"{label}_disk_{mode}_open_ms"] = 1e3 * statistics.median(r["open_s"] for r in runs)
            out[f"{label}_disk_{mode}_evaluated"] = max(r["evaluated"] for r in runs)
        out[f"{label}_ram_ttft_ms"] = 1e3 * statistics.median(r.ttft_s for r in ram_runs)
        out[f"{label}_ram_evaluated"] = max(r.prompt_tokens_evaluated for r in ram_runs)
        out[f"{label}_disk_hot_vs_ram"] = out[f"{label}_disk_hot_ttft_ms"] / out[f"{label}_ram_ttft_ms"]
        out[f"{label}_disk_cold_vs_ram"] = out[f"{label}_disk_cold_ttft_ms"] / out[f"{label}_ram_ttft_ms"]
    rows = []
    for label, name in (("exact", "exact repeat"), ("suffix", f"prompt + {len(suffix)} tokens")):
        rows.append([
            name,
            f"{out[f'{label}_ram_ttft_ms']:.0f} ms",
            f"{out[f'{label}_disk_hot_ttft_ms']:.0f} ms ({out[f'{label}_disk_hot_vs_ram']:.2f}x)",
            f"{out[f'{label}_disk_cold_ttft_ms']:.0f} ms ({out[f'{label}_disk_cold_vs_ram']:.2f}x)",
            f"{out[f'{label}_disk_hot_open_ms']:.0f} ms",
            out[f"{label}_disk_hot_evaluated"],
        ])
    table(
        f"Time to first token, {len(tokens)}-token prompt (median of {repeat})",
        ["prompt", "RAM hit (warm process)", "disk hit, new process, hot", "... page cache cold", "cache open",
         "tokens evaluated"],
        rows,
    )
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == _CHILD:
        ttft_child(*sys.argv[2:5])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == _LOOKUP_CHILD:
        lookup_child(sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sizes = [10, 100] if args.quick else [10, 1_000, 10_000]
    n_tokens = 300 if args.quick else 1_500
    repeat = 3 if args.quick else 5
    results: dict[str, Any] = {"machine": machine(), "settings": {"quick": args.quick, "sizes": sizes,
                                                                  "prompt_tokens": n_tokens, "repeat": repeat}}
    with tempfile.TemporaryDirectory(prefix="llama-cache-disk-bench-") as tmp:
        workdir = Path(tmp)
        results["lookup"] = bench_lookups(sizes, workdir / "lookup", their_budget_s=60 if args.quick else 150)
        write(args.out, results)  # each section as it is done, if a later one fails
        llm, state, tokens, eval_s = real_state(n_tokens)
        results["cold_ttft_s"] = eval_s
        print(f"\n(cold time to first token of the {len(tokens)}-token prompt: {eval_s:.1f} s)")
        results["throughput"] = bench_throughput(state, workdir / "throughput", repeat)
        write(args.out, results)
        results["ttft"] = bench_ttft(llm, state, tokens, workdir / "ttft", repeat)
    finish(results)
    write(args.out, results)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
