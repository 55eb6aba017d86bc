"""Disk tier deduplication: bytes on disk, bytes written per completion, time to first token on a hit.

    tools/run python benchmarks/dedup.py        # issue #10's workload (21 min on 2 cores at load 4-7)
    tools/run python benchmarks/dedup.py --conversations 3 --turns 2 --repeat 2 --fresh-repeat 1  # smoke

Workload: ``--conversations`` users (default 20) share a system prompt of ``--system-tokens`` tokens
(default 1,000, counted with the model's tokenizer); each asks ``--turns`` questions (default 5; 40-100
words each), interleaved round-robin (user 1 turn 1, user 2 turn 1, ..., user 1 turn 2, ...) as chat
completions on one default-model ``llama_cache.Llama`` (``n_ctx`` 4096, greedy, ``--max-tokens`` 48),
with a chunked ``LlamaDiskCache`` as its prompt cache. A recording wrapper keeps every ``(key, state)``
the model stores, in order: one per completion, prompt + answer (the prompt's own state, with its
logits row, is stored only for a prompt asked again, and no prompt of this workload is).

Those stores are then replayed into fresh directories, one per ``chunk_tokens`` in 8, 16 (the default
for this model), 32, 64, 256 and 0 (every state whole, one payload file each: the disk format before
chunks), synchronously (``write_behind=False``). Per directory:

- **bytes on disk**: ``storage().unique_bytes`` (payload, chain-head and chunk files, each once; the
  SQLite index is reported apart), against the floor ``unique tokens x KV bytes per token``, where
  the unique tokens are the distinct prefixes of every stored state's tokens (a trie over them: the
  tokens whose KV must exist at least once) and KV bytes per token is ``state.layout.bytes_per_token``;
- **bytes written per completion**: the sizes of the files that appeared under ``data/`` during that
  completion's stores (the directory is listed after every store, so a file written and removed by
  later stores still counts), split into chunk files and chain heads; also every byte the process
  passed to ``write()`` meanwhile (``wchar`` of ``/proc/self/io``: the index and its WAL included).
  The bound is the completion's new tokens' KV plus one chunk, new tokens being those of its stored
  states that no earlier store held;
- **time to first token on a hit** (warm: this process, page cache hot), for the next turn of
  ``--repeat`` conversations whose whole history is cached: a streamed chat completion after
  ``reset()``, timed to its first chunk, then closed (nothing is stored by a probe). Also the time of
  the lookup (``lookup_prefix``) and of the restore (``load_state``) inside it.

For the default chunk size and whole states, the same probes also run in fresh processes (model load,
open the directory, one streamed completion), which first drops every file of the directory from the
page cache (``posix_fadvise(DONTNEED)``, as ``benchmarks/disk.py``): ``--fresh-repeat`` times each, the
set-ups in rotating order.

llama-cpp-python's ``llama_cpp.llama_cache.LlamaDiskCache`` on a plain ``llama_cpp.Llama`` runs a
subset (``--theirs-conversations`` x ``--theirs-turns``, default 2 x 2, the same messages, answers
included): its states carry a scores matrix of up to ``n_batch`` x ``n_vocab`` float32 (96 MiB here)
and it pickles each one whole. Its ``__getitem__`` pops the entry it returns, so an entry survives
one hit; its last state is stored again before each probe. Its probe is the next turn of the subset's
last conversation; the chunked and whole-state directories answer the same prompt.

Prints tables (with the targets of issue #10, met or not) and writes ``benchmarks/results/dedup.json``.
The machine running it may be shared: bytes are exact, times are medians of few runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cache as upstream
import numpy as np

from benchmarks.disk import drop_from_page_cache, table
from benchmarks.machine import finish, machine, write
from llama_cache import default_model_path
from llama_cache.caches.base import BaseLlamaCache
from llama_cache.caches.disk import DATA_DIR, INDEX_FILE, LlamaDiskCache
from llama_cache.llama import Llama
from llama_cache.measure import recording_evals, recording_restores, timed_chat_completion
from llama_cache.state.chunks import KIND_CHUNK, KIND_CHUNKED, default_chunk_tokens
from llama_cache.state.format import PREFIX_SIZE, CorruptStateError, encode, encoded_size, payload_kind

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "dedup.json"
CHUNK_SIZES = (8, 16, 32, 64, 256, 0)
DISK_TARGET = 1.15  # bytes on disk / (unique tokens x KV bytes per token)
TTFT_TARGET = 1.2  # chunked hit / whole-state hit
_CHILD = "--child"

# -- the workload -----------------------------------------------------------------------------------

_INTRO = (
    "You are the customer support assistant of Alder & Finch, a company that sells, rents and repairs "
    "bicycles, e-bikes and outdoor gear through twelve shops and an online store. Follow the policies "
    "below exactly. When a policy does not cover a question, say so plainly and offer to forward the "
    "question to a human colleague. Answer in short paragraphs and never invent order details."
)
_TOPICS = [
    "returns", "warranty claims", "repairs", "deliveries", "e-bike batteries", "rentals", "gift cards",
    "price matching", "trade-ins", "accessories", "workshop appointments", "refunds", "frame sizing",
    "tent and sleeping bag care", "child seats and trailers", "loyalty points",
]
_RULES = [
    "For {topic}, ask for the order number and the date of purchase before anything else.",
    "Requests about {topic} made within {days} days of delivery are accepted without discussion; after "
    "that, the shop manager decides case by case.",
    "Never promise a date for {topic}; give the usual range of {lo} to {hi} working days instead.",
    "If a customer is upset about {topic}, apologise once, summarise the problem in one sentence and "
    "propose the next step.",
    "Costs for {topic} above {amount} euros need written approval from the shop manager before any work "
    "starts.",
    "Point customers asking about {topic} to the page called '{page}' on the website and quote its title "
    "exactly.",
    "Do not discuss {topic} for products bought from other retailers, except to say that our workshop can "
    "inspect them for a fee of {fee} euros.",
    "Record every conversation about {topic} in the ticket system under the tag {tag}.",
    "Customers with a premium membership get {topic} handled first and pay no handling fee.",
    "When {topic} involve a safety problem, tell the customer to stop using the product at once and to "
    "bring it to the nearest shop.",
]
_PAGES = ["Our promise", "Care and repair", "Before you ride", "Service and support", "Plan your trip"]
_ITEMS = [
    "a cargo e-bike", "a touring bicycle", "a two-person tent", "a child trailer", "a carbon road bike",
    "a folding bike", "a pair of hiking boots", "an e-bike battery pack", "a down sleeping bag",
    "a gravel bike", "a bike rack for my car", "a set of panniers", "a kids' balance bike",
    "a rain jacket", "a mountain bike with front suspension", "a camping stove",
]
_WHEN = ["three weeks ago", "last spring", "about ten days ago", "in early March", "two months ago", "last week"]
_PROBLEMS = [
    "since yesterday it makes a grinding noise whenever I change gears",
    "the zip broke the second time I used it",
    "the battery now lasts barely half as long as the shop promised",
    "one of the seams started leaking in the first light rain",
    "the brakes squeal loudly and feel much weaker than at the start",
    "it arrived with a scratch on the frame that I only noticed later",
    "the display keeps switching off in the middle of a ride",
    "a strap came loose and one of the buckles cracked",
]
_CONTEXT = [
    "I bought {item} from your {shop} shop {when}, and {problem}.",
    "I use it mainly for {use}, usually {freq}, so I really need it to work reliably.",
    "Before writing to you I already tried {attempt}, but nothing changed at all.",
    "The receipt says the order number is {order}, and I still have the original box and manual.",
    "A friend told me that {rumour}, but I would rather hear it from you directly.",
    "My budget is rather tight this month, so I would like to understand the costs before I decide.",
    "I live about forty minutes away from the nearest shop and do not have a car during the week.",
    "Your colleague on the phone was friendly but could not tell me more than that someone would call back.",
]
_USES = ["commuting to work", "weekend trips with my kids", "camping in the mountains", "grocery shopping"]
_FREQ = ["every day", "three times a week", "most weekends", "twice a month"]
_ATTEMPTS = ["the steps from the manual", "charging it overnight", "cleaning and drying it", "adjusting the screws"]
_RUMOURS = [
    "such problems are always covered for two years", "you replace the whole part instead of repairing it",
    "the workshop is booked out for weeks", "refunds take more than a month",
]
_ASKS = [
    "Could you explain what my options are under your {topic} policy and what I should do first?",
    "How long would that usually take, and can I keep using it in the meantime?",
    "What would it cost me if it turns out not to be covered?",
    "Is there anything I should bring to the shop, or can everything be done online?",
    "Can you summarise the next steps for me in a few short points?",
    "Would it be better to ask for a refund instead, and how exactly does that work?",
    "Could a colleague call me back this week, and what should I tell them?",
]


def _system_text(llm: llama_cpp.Llama, target: int) -> tuple[str, int]:
    """A support policy of at most ``target`` tokens (and within a word of it), and its token count."""
    rng = random.Random(10)
    sections = [_INTRO]
    n = 0
    while len(llm.tokenize(" ".join(sections).encode(), add_bos=False)) < target + 50:
        topic = _TOPICS[n % len(_TOPICS)]
        rules = rng.sample(_RULES, 3)
        body = " ".join(
            f"{n + 1}.{i + 1} " + rule.format(
                topic=topic, days=rng.choice([14, 30, 60]), lo=rng.randint(2, 4), hi=rng.randint(5, 10),
                amount=rng.choice([50, 80, 150]), page=rng.choice(_PAGES), fee=rng.choice([15, 25, 35]),
                tag=f"{topic.split()[0].upper()}-{rng.randint(10, 99)}",
            )
            for i, rule in enumerate(rules)
        )
        sections.append(f"Section {n + 1}, {topic}: {body}")
        n += 1
    words = " ".join(sections).split(" ")
    while True:
        text = " ".join(words)
        count = len(llm.tokenize(text.encode(), add_bos=False))
        if count <= target:
            return text, count
        words.pop()


def _questions(user: int, count: int) -> list[str]:
    """``count`` questions of 40-100 words from one user about one purchase."""
    rng = random.Random(1000 + user)
    slots = {
        "item": _ITEMS[user % len(_ITEMS)], "shop": rng.choice(["Leipzig", "Utrecht", "Ghent", "Basel"]),
        "when": rng.choice(_WHEN), "problem": rng.choice(_PROBLEMS), "use": rng.choice(_USES),
        "freq": rng.choice(_FREQ), "attempt": rng.choice(_ATTEMPTS), "order": f"AF-{rng.randint(100000, 999999)}",
        "rumour": rng.choice(_RUMOURS), "topic": rng.choice(_TOPICS),
    }
    asks = rng.sample(_ASKS, len(_ASKS))
    out = []
    for turn in range(count):
        context = rng.sample(_CONTEXT[1:], len(_CONTEXT) - 1)
        sentences = ([_CONTEXT[0]] if turn == 0 else []) + context
        text: list[str] = []
        ask = asks[turn % len(asks)].format(**slots)
        for sentence in sentences:
            if len(" ".join(text + [sentence, ask]).split()) > 100:
                break
            text.append(sentence.format(**slots))
            if len(" ".join(text + [ask]).split()) >= 40 and rng.random() < 0.5:
                break
        out.append(" ".join(text + [ask]))
    return out


@dataclass
class Workload:
    system: str
    system_tokens: int
    questions: list[list[str]]  # per user: one per turn, then the probe's
    turns: int
    answers: list[list[str]] = field(default_factory=list)  # per user, filled by the run

    def messages(self, user: int, turn: int, question: int | None = None) -> list[dict[str, str]]:
        """User ``user``'s messages up to turn ``turn``'s question (``question``: another one of theirs)."""
        out = [{"role": "system", "content": self.system}]
        for i in range(turn):
            out += [{"role": "user", "content": self.questions[user][i]},
                    {"role": "assistant", "content": self.answers[user][i]}]
        out.append({"role": "user", "content": self.questions[user][turn if question is None else question]})
        return out


# -- recording and measuring ------------------------------------------------------------------------


@dataclass
class Store:
    completion: int
    key: np.ndarray
    tokens: np.ndarray  # the tokens the state holds
    state: Any


class RecordingCache(BaseLlamaCache):
    """Forwards to ``inner``; records each store with the current completion index, times lookups.

    ``read_only`` drops stores instead (probes must leave the directory as the workload left it).
    ``keep_states=False`` keeps only the last state (llama-cpp-python's are ~100 MB each).
    """

    def __init__(self, inner: Any, read_only: bool = False, keep_states: bool = True) -> None:
        super().__init__(inner.capacity_bytes)
        self.inner, self.read_only, self.keep_states = inner, read_only, keep_states
        self.completion = -1
        self.stores: list[Store] = []
        self.last: tuple[np.ndarray, Any] | None = None
        self.lookup_s: list[float] = []

    @property
    def cache_size(self) -> int:
        return int(self.inner.cache_size)

    def _timed(self, fn: Any, key: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(key, **kwargs)
        finally:
            self.lookup_s.append(time.perf_counter() - start)

    def __getitem__(self, key: Any) -> Any:
        return self._timed(self.inner.__getitem__, key)

    def lookup_prefix(self, key: Any, **kwargs: Any) -> Any:
        # The cache's own arguments (llama_cache.Llama looks up with namespace=) pass on unchanged.
        if not hasattr(self.inner, "lookup_prefix"):
            return self._timed(self.inner.__getitem__, key)
        return self._timed(self.inner.lookup_prefix, key, **kwargs)

    def __contains__(self, key: Any) -> bool:
        return key in self.inner

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.read_only:
            return
        held = value.tokens if hasattr(value, "tokens") else value.input_ids[: value.n_tokens]
        key = np.array(key, dtype=np.int32)
        self.stores.append(Store(self.completion, key, np.array(held, dtype=np.int32),
                                 value if self.keep_states else None))
        self.last = (key, value)
        self.inner[key.tolist()] = value

    def __len__(self) -> int:
        return len(self.inner)

    def stats(self) -> Any:
        return self.inner.stats()


class PrefixSet:
    """The distinct prefixes of token sequences (a trie of node ids): tokens whose KV must exist once."""

    def __init__(self) -> None:
        self.edges: dict[tuple[int, int], int] = {}

    def add(self, tokens: np.ndarray) -> int:
        """Add every prefix of ``tokens``; return how many were new."""
        node, new = 0, 0
        for token in tokens.tolist():
            child = self.edges.get((node, token))
            if child is None:
                child = self.edges[(node, token)] = len(self.edges) + 1
                new += 1
            node = child
        return new

    def __len__(self) -> int:
        return len(self.edges)


def _wchar() -> int:
    """Bytes this process has passed to ``write()`` and friends so far (Linux ``/proc``)."""
    with open("/proc/self/io") as file:
        for line in file:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def _files(directory: Path) -> dict[str, tuple[int, int]]:
    """Every regular file under ``directory``: relative path -> (size, allocated bytes)."""
    out: dict[str, tuple[int, int]] = {}
    for base, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(base, name)
            with contextlib.suppress(FileNotFoundError):
                info = os.stat(path, follow_symlinks=False)
                out[os.path.relpath(path, directory)] = (info.st_size, info.st_blocks * 512)
    return out


def _kind(path: Path) -> str:
    with open(path, "rb") as file:
        prefix = file.read(PREFIX_SIZE)
    try:
        kind = payload_kind(prefix)
    except CorruptStateError:
        return "other"
    return {KIND_CHUNK: "chunk", KIND_CHUNKED: "head"}.get(kind, "whole")


def _median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def first_token(llm: llama_cpp.Llama, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One streamed chat completion timed to its first chunk, then closed (before anything is stored).

    Also the process's CPU time over the same span (other processes on a shared machine do not inflate
    it; page-cache misses do not show in it), and the lookups' and restores' share of the wall time.
    """
    cache = llm.cache
    looked = len(cache.lookup_s) if isinstance(cache, RecordingCache) else 0
    with recording_evals(llm) as evals, recording_restores(llm) as restores:
        start, cpu = time.perf_counter(), time.process_time()
        stream = llm.create_chat_completion(messages=messages, max_tokens=8, temperature=0.0, seed=0, stream=True)
        next(iter(stream))  # the role chunk, produced with the first token
        ttft, ttft_cpu = time.perf_counter() - start, time.process_time() - cpu
        stream.close()  # type: ignore[union-attr]
        evaluated = evals.prompt_tokens(llm)
    lookups = cache.lookup_s[looked:] if isinstance(cache, RecordingCache) else []
    return {"ttft_s": ttft, "ttft_cpu_s": ttft_cpu, "evaluated": evaluated,
            "prompt_tokens": getattr(llm, "last_prompt_length", None), "lookup_s": sum(lookups),
            "restore_s": sum(r.seconds for r in restores),
            "restored_tokens": sum(getattr(r.state, "n_tokens", 0) for r in restores)}


def _rotated(items: list[Any], shift: int) -> list[Any]:
    shift %= len(items)
    return items[shift:] + items[:shift]


# -- running the workload ---------------------------------------------------------------------------


def run_ours(llm: Llama, recorder: RecordingCache, workload: Workload, conversations: int, max_tokens: int,
             ) -> list[dict[str, Any]]:
    """The workload, interleaved, on ``llm`` with ``recorder`` as its cache; answers go into ``workload``."""
    workload.answers = [[] for _ in range(conversations)]
    rows = []
    for turn in range(workload.turns):
        for user in range(conversations):
            recorder.completion = len(rows)
            started = time.perf_counter()
            timing = timed_chat_completion(llm, workload.messages(user, turn), max_tokens=max_tokens,
                                           temperature=0.0, seed=0)
            workload.answers[user].append(timing.text)
            rows.append({"user": user, "turn": turn, "prompt_tokens": llm.last_prompt_length,
                         "evaluated": timing.prompt_tokens_evaluated, "ttft_ms": 1e3 * timing.ttft_s,
                         "total_s": time.perf_counter() - started})
            print(f"  completion {len(rows)}/{conversations * workload.turns}: prompt {llm.last_prompt_length} "
                  f"tokens, {timing.prompt_tokens_evaluated} evaluated", file=sys.stderr)
    return rows


def replay(stores: list[Store], directory: Path, chunk_tokens: int, fingerprint: str,
           new_tokens: dict[int, int], bytes_per_token: int) -> tuple[LlamaDiskCache, dict[str, Any]]:
    """Store the recorded states again, in order, into a fresh directory; account for every file."""
    cache = LlamaDiskCache(directory, capacity_bytes=1 << 50, write_behind=False, chunk_tokens=chunk_tokens,
                           fingerprint=fingerprint)
    data = directory / DATA_DIR
    per: dict[int, dict[str, float]] = {}
    before = _files(data)
    for store in stores:
        row = per.setdefault(store.completion, {"files": 0, "bytes": 0, "chunk": 0, "head": 0, "whole": 0,
                                                "wchar": 0, "store_s": 0.0})
        wchar, start = _wchar(), time.perf_counter()
        cache[store.key.tolist()] = store.state
        row["store_s"] += time.perf_counter() - start
        row["wchar"] += _wchar() - wchar
        after = _files(data)
        for name in after.keys() - before.keys():
            size = after[name][0]
            row["files"] += 1
            row["bytes"] += size
            row[_kind(data / name)] += size
        before = after
    storage = cache.storage()
    stats = cache.stats()
    chunk_bytes = chunk_tokens * bytes_per_token if chunk_tokens else 0
    completions = []
    for index, row in sorted(per.items()):
        bound = new_tokens[index] * bytes_per_token + chunk_bytes
        completions.append({"completion": index, **row, "new_tokens": new_tokens[index], "bound": bound,
                            "within": bool(chunk_tokens) and row["bytes"] <= bound,
                            "chunks_within": bool(chunk_tokens) and row["chunk"] <= bound})
    on_disk = _files(directory)
    index_bytes = sum(size for name, (size, _) in on_disk.items() if name.startswith(INDEX_FILE))
    head_bytes = sum(size for name, (size, _) in before.items() if _kind(data / name) == "head")
    written = [c["bytes"] for c in completions]
    result = {
        "chunk_tokens": chunk_tokens, "entries": storage.entries, "chunks": storage.chunks,
        "unique_bytes": storage.unique_bytes, "logical_bytes": storage.logical_bytes,
        "data_file_bytes": sum(size for size, _ in before.values()),
        "data_allocated_bytes": sum(blocks for _, blocks in before.values()), "data_files": len(before),
        "head_bytes": head_bytes,
        "index_bytes": index_bytes, "writes": stats.writes, "store_errors": stats.store_errors,
        "written_mean": statistics.fmean(written), "written_max": max(written),
        "bound_mean": statistics.fmean(c["new_tokens"] * bytes_per_token + chunk_bytes for c in completions),
        "chunk_written_mean": statistics.fmean(c["chunk"] for c in completions),
        "head_written_mean": statistics.fmean(c["head"] for c in completions),
        "wchar_mean": statistics.fmean(c["wchar"] for c in completions),
        "store_ms_mean": 1e3 * statistics.fmean(c["store_s"] for c in completions),
        "within": sum(c["within"] for c in completions), "chunks_within": sum(c["chunks_within"] for c in completions),
        "worst_excess": max(c["bytes"] - c["bound"] for c in completions) if chunk_tokens else None,
        "completions": completions,
    }
    return cache, result


def run_theirs(llm: llama_cpp.Llama, directory: Path, workload: Workload, conversations: int, turns: int,
               max_tokens: int, bytes_per_token: int, chunk_tokens: int) -> tuple[RecordingCache, dict[str, Any]]:
    """The subset on llama-cpp-python's disk cache, with the answers of our run as the history."""
    recorder = RecordingCache(upstream.LlamaDiskCache(str(directory)), keep_states=False)
    llm.set_cache(recorder)
    prefixes = PrefixSet()
    rows = []
    for turn in range(turns):
        for user in range(conversations):
            recorder.completion = len(rows)
            stored = len(recorder.stores)
            before, wchar = _files(directory), _wchar()
            # It prints on every store and lookup: silenced.
            with contextlib.redirect_stderr(io.StringIO()):
                timing = timed_chat_completion(llm, workload.messages(user, turn), max_tokens=max_tokens,
                                               temperature=0.0, seed=0)
            wrote = _wchar() - wchar
            after = _files(directory)
            new = sum(tokens for tokens in (prefixes.add(s.tokens) for s in recorder.stores[stored:]))
            rows.append({"user": user, "turn": turn, "ttft_ms": 1e3 * timing.ttft_s,
                         "evaluated": timing.prompt_tokens_evaluated, "new_tokens": new,
                         "bytes": sum(after[name][0] for name in after.keys() - before.keys()),
                         "wchar": wrote, "entries": len(recorder.inner.cache)})
            print(f"  llama-cpp-python: completion {len(rows)}/{conversations * turns}", file=sys.stderr)
    on_disk = _files(directory)
    return recorder, {
        "conversations": conversations, "turns": turns, "unique_tokens": len(prefixes),
        "bytes_on_disk": sum(size for size, _ in on_disk.values()), "entries": len(recorder.inner.cache),
        "written_mean": statistics.fmean(r["bytes"] for r in rows), "written_max": max(r["bytes"] for r in rows),
        "wchar_mean": statistics.fmean(r["wchar"] for r in rows),
        "bound_mean": statistics.fmean((r["new_tokens"] + chunk_tokens) * bytes_per_token for r in rows),
        "state_bytes": len(recorder.last[1].llama_state) + recorder.last[1].scores.nbytes if recorder.last else 0,
        "completions": rows,
    }


# -- time to first token ----------------------------------------------------------------------------


def _restore_theirs(recorder: RecordingCache) -> None:
    """Put llama-cpp-python's last state back as its only entry: its lookups pop what they return."""
    assert recorder.last is not None
    key, state = recorder.last
    with contextlib.redirect_stderr(io.StringIO()):
        recorder.inner.cache.clear()
        recorder.inner[key.tolist()] = state


def child(kind: str, directory: str, messages_file: str, n_ctx: int, threads: int | None) -> None:
    """In a fresh process: drop the directory from the page cache, load the model, open the directory,
    time one streamed completion.

    The dropping happens here, not in the parent: opening and closing a file descriptor on an SQLite
    database or its ``-wal``/``-shm`` releases every POSIX lock the process holds on it, and the parent
    keeps connections open (a child then took llama-cpp-python's index for empty).
    """
    for name in _files(Path(directory)):
        drop_from_page_cache(Path(directory) / name)
    messages = json.loads(Path(messages_file).read_text())
    with contextlib.redirect_stderr(io.StringIO()):  # llama-cpp-python's cache prints
        model = llama_cpp.Llama if kind == "theirs" else Llama
        llm = model(**_model_args(n_ctx, threads))
        start = time.perf_counter()
        cache: Any = (upstream.LlamaDiskCache(directory) if kind == "theirs"
                      else LlamaDiskCache(directory, fingerprint=llm.fingerprint))  # type: ignore[attr-defined]
        open_s = time.perf_counter() - start
        llm.set_cache(RecordingCache(cache, read_only=True))
        result = first_token(llm, messages)
    print(json.dumps({**result, "open_s": open_s}))


def fresh(kind: str, directory: Path, messages: list[dict[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    """:func:`child` in a new process."""
    messages_file = directory.parent / "probe-messages.json"
    messages_file.write_text(json.dumps(messages))
    command = [sys.executable, __file__, _CHILD, kind, "--dir", str(directory), "--messages", str(messages_file),
               "--n-ctx", str(args.n_ctx)] + (["--threads", str(args.threads)] if args.threads else [])
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm(llm: llama_cpp.Llama, cache: Any, messages: list[dict[str, str]]) -> dict[str, Any]:
    """:func:`first_token` in this process after ``reset()``: the hit must come from the cache."""
    llm.reset()
    llm.set_cache(cache)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return first_token(llm, messages)
    finally:
        llm.set_cache(None)
        llm.reset()  # drops the restored state: no mapping of the directory's files stays alive


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    if not runs:
        return {}
    return {
        "ttft_ms": _median_ms([r["ttft_s"] for r in runs]), "ttft_cpu_ms": _median_ms([r["ttft_cpu_s"] for r in runs]),
        "lookup_ms": _median_ms([r["lookup_s"] for r in runs]), "restore_ms": _median_ms([r["restore_s"] for r in runs]),
        "prompt_tokens": [r["prompt_tokens"] for r in runs], "evaluated": [r["evaluated"] for r in runs],
        "restored_tokens": [r["restored_tokens"] for r in runs], "runs_ms": [1e3 * r["ttft_s"] for r in runs],
    }


def probe_hits(llm: Llama, their_llm: llama_cpp.Llama, caches: dict[str, LlamaDiskCache], theirs: RecordingCache,
               workload: Workload, default: str, sub_conv: int, sub_turns: int, workdir: Path,
               args: argparse.Namespace) -> dict[str, Any]:
    """Hit time to first token: every chunk size warm; default and whole states in fresh processes too;
    then one prompt every set-up (llama-cpp-python's included) can answer, warm and fresh."""
    probes = [workload.messages(k % args.conversations, args.turns) for k in range(args.repeat)]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in caches}
    for rep, messages in enumerate(probes):
        for c in _rotated(list(caches), rep):
            print(f"warm probe {rep + 1}/{len(probes)}, chunk_tokens={c}", file=sys.stderr)
            runs[c].append(warm(llm, RecordingCache(caches[c], read_only=True), messages))
    fresh_runs: dict[str, list[dict[str, Any]]] = {default: [], "0": []}
    for rep in range(args.fresh_repeat):
        for c in _rotated(list(fresh_runs), rep):
            print(f"fresh-process probe {rep + 1}/{args.fresh_repeat}, chunk_tokens={c}", file=sys.stderr)
            fresh_runs[c].append(fresh("ours", workdir / f"chunks-{c}", probes[rep % len(probes)], args))

    subset = workload.messages(sub_conv - 1, sub_turns, question=args.turns)
    same: dict[str, dict[str, list[dict[str, Any]]]] = {k: {"warm": [], "fresh": []} for k in (default, "0", "theirs")}
    for rep in range(max(args.repeat, args.fresh_repeat)):
        for key in _rotated(list(same), rep):
            print(f"same-prompt probe {rep + 1}, {key}", file=sys.stderr)
            if rep < args.repeat:
                if key == "theirs":
                    _restore_theirs(theirs)
                    same[key]["warm"].append(warm(their_llm, theirs, subset))
                else:
                    same[key]["warm"].append(warm(llm, RecordingCache(caches[key], read_only=True), subset))
            if rep < args.fresh_repeat:
                if key == "theirs":
                    _restore_theirs(theirs)
                    same[key]["fresh"].append(fresh("theirs", workdir / "llama-cpp-python", subset, args))
                else:
                    same[key]["fresh"].append(fresh("ours", workdir / f"chunks-{key}", subset, args))
    return {
        "warm": {c: _summary(r) for c, r in runs.items()},
        "fresh": {c: _summary(r) for c, r in fresh_runs.items()},
        "same_prompt": {k: {mode: _summary(r) for mode, r in v.items()} for k, v in same.items()},
        "same_prompt_user": sub_conv, "same_prompt_after_turns": sub_turns,
    }


# -- the report -------------------------------------------------------------------------------------


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


def _ms(n: float | None) -> str:
    return "-" if n is None else f"{n:,.0f} ms"


def _name(c: str, default: str) -> str:
    return "whole states (today's format)" if c == "0" else f"chunks of {c}" + (" (default)" if c == default else "")


def report(out: dict[str, Any]) -> None:
    w, floor, kv = out["workload"], out["unique_kv_bytes"], out["kv_bytes_per_token"]
    formats, default, ttft = out["formats"], str(out["default_chunk_tokens"]), out["ttft"]
    print(f"\nWorkload: {w['conversations']} conversations x {w['turns']} turns, interleaved; system prompt "
          f"{w['system_tokens']} tokens; answers <= {w['max_tokens']} tokens (greedy); n_ctx {w['n_ctx']}; "
          f"{w['completions']} completions, {w['stores']} stores; {out['unique_tokens']:,} unique tokens x "
          f"{kv:,} KV bytes per token = {_mb(floor)} (the floor); load average {out['load_average'][0]} "
          f"before, {out['load_average'][1]} after")

    rows = []
    for c in (default, "0"):
        f = formats[c]
        rows.append([_name(c, default), _mb(f["unique_bytes"]), f"{f['unique_bytes'] / floor:.3f}x",
                     _mb(f["index_bytes"]), _mb(f["written_mean"]), _mb(f["written_max"]), _mb(f["bound_mean"])])
    theirs = out["llama_cpp_python"]
    rows.append([f"llama-cpp-python LlamaDiskCache, {theirs['conversations']} x {theirs['turns']} subset "
                 f"({theirs['entries']} entry kept)", _mb(theirs["bytes_on_disk"]),
                 f"{theirs['bytes_on_disk'] / (theirs['unique_tokens'] * kv):.2f}x", "(in the total)",
                 _mb(theirs["written_mean"]), _mb(theirs["written_max"]), _mb(theirs["bound_mean"])])
    table("Bytes (exact)", ["set-up", "on disk", "/ floor", "+ index", "written per completion", "max",
                            "new KV + one chunk (mean)"], rows)

    def row(label: str, warm: dict[str, Any], cold: dict[str, Any]) -> list[str]:
        def span(values: list[int]) -> str:
            return f"{min(values)}-{max(values)}" if values else "-"

        return [label, _ms(warm.get("ttft_ms")), _ms(warm.get("ttft_cpu_ms")), _ms(cold.get("ttft_ms")),
                f"{span(warm['evaluated'])} / {span(cold.get('evaluated', []))}", f"{warm['lookup_ms']:.1f} ms",
                f"{warm['restore_ms']:.1f} ms",
                "-" if not cold else f"{cold['lookup_ms']:.0f} + {cold['restore_ms']:.0f} ms"]

    same = ttft["same_prompt"]
    rows = [row(f"{_name(c, default)}, next turn after {w['turns']}", ttft["warm"][c], ttft["fresh"][c])
            for c in (default, "0")]
    rows += [row(f"{label}, user {ttft['same_prompt_user']}'s turn {ttft['same_prompt_after_turns'] + 1}",
                 same[key]["warm"], same[key]["fresh"])
             for key, label in ((default, _name(default, default)), ("0", _name("0", default)),
                                ("theirs", "llama-cpp-python"))]
    table("Time to first token on a hit (median; warm: this process, files in the page cache; fresh: a new "
          "process, the directory's files dropped from the page cache)",
          ["set-up, prompt", "warm", "warm, CPU (all threads)", "fresh", "evaluated warm / fresh", "lookup (warm)",
           "restore (warm)",
           "fresh: lookup + restore"], rows)

    rows = []
    for c in map(str, CHUNK_SIZES):
        f, hit = formats[c], ttft["warm"][c]
        n = len(f["completions"])
        rows.append([_name(c, default), f["data_files"], _mb(f["unique_bytes"]), f"{f['unique_bytes'] / floor:.3f}x",
                     _mb(f["head_bytes"]) if c != "0" else "-", _mb(f["written_mean"]), _mb(f["chunk_written_mean"]),
                     f"{f['within']}/{n} ({f['chunks_within']}/{n})" if c != "0" else "-",
                     f"{f['store_ms_mean']:.0f} ms", _ms(hit["ttft_ms"]), _ms(hit["ttft_cpu_ms"]),
                     f"{hit['lookup_ms']:.1f} ms", f"{hit['restore_ms']:.1f} ms"])
    table("Chunk size (the same stores replayed; within: completions whose new files fit their new tokens' KV + "
          "one chunk, in brackets chunk files alone)",
          ["chunk_tokens", "files", "on disk", "/ floor", "of it heads", "written/completion", "of it chunks",
           "within", "store/completion", "hit TTFT warm", "CPU", "lookup", "restore"], rows)

    print("\nTargets (issue #10):")
    for target in out["targets"]:
        print(f"  {target['what']}: {target['value']}  {'MET' if target['met'] else 'NOT MET'}")


def targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    default = str(out["default_chunk_tokens"])
    f = out["formats"][default]
    n = len(f["completions"])
    ratio = f["unique_bytes"] / out["unique_kv_bytes"]
    ttft = out["ttft"]
    warm = ttft["warm"][default]["ttft_ms"] / ttft["warm"]["0"]["ttft_ms"]
    cpu = ttft["warm"][default]["ttft_cpu_ms"] / ttft["warm"]["0"]["ttft_cpu_ms"]
    cold = ttft["fresh"][default]["ttft_ms"] / ttft["fresh"]["0"]["ttft_ms"]
    return [
        {"what": f"bytes on disk <= {DISK_TARGET}x unique tokens x KV bytes per token", "value": f"{ratio:.3f}x",
         "met": ratio <= DISK_TARGET},
        {"what": "bytes written per completion <= its new tokens' KV + one chunk",
         "value": f"{f['within']}/{n} completions within, worst {f['worst_excess'] / 1e3:+,.0f} KB; chunk files "
                  f"alone {f['chunks_within']}/{n}; chain heads (tokens, and a logits row for a prompt asked "
                  f"again) add {f['head_written_mean'] / 1e3:,.1f} KB per completion",
         "met": f["within"] == n},
        {"what": f"hit time to first token <= {TTFT_TARGET}x the whole-state disk hit",
         "value": f"warm {warm:.2f}x (CPU {cpu:.2f}x), fresh process {cold:.2f}x",
         "met": max(warm, cold) <= TTFT_TARGET},
    ]


# -- main -------------------------------------------------------------------------------------------


def _model_args(n_ctx: int, threads: int | None) -> dict[str, Any]:
    args: dict[str, Any] = {"model_path": str(default_model_path()), "n_ctx": n_ctx, "seed": 0, "verbose": False}
    if threads:
        args["n_threads"] = threads
    return args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (greedy; default 48)")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: llama-cpp-python's)")
    parser.add_argument("--repeat", type=int, default=5, help="warm hit probes per set-up (default 5)")
    parser.add_argument("--fresh-repeat", type=int, default=3, help="fresh-process hit probes per set-up (default 3)")
    parser.add_argument("--theirs-conversations", type=int, default=2)
    parser.add_argument("--theirs-turns", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="where the cache directories go (default: $TMPDIR)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(_CHILD, choices=("ours", "theirs"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--messages", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.dir, args.messages, args.n_ctx, args.threads)
        return 0
    sub_conv = min(args.theirs_conversations, args.conversations)
    sub_turns = min(args.theirs_turns, args.turns)
    described = machine()
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        phases[name] = time.perf_counter() - started - sum(phases.values())

    with tempfile.TemporaryDirectory(prefix="llama-cache-dedup-bench-", dir=args.workdir) as tmp:
        workdir = Path(tmp)
        llm = Llama(**_model_args(args.n_ctx, args.threads))
        system, system_tokens = _system_text(llm, args.system_tokens)
        workload = Workload(system, system_tokens, [_questions(u, args.turns + 1) for u in range(args.conversations)],
                            args.turns)

        # 1. The workload on the default chunked disk tier (write-behind, as in use), recording every store.
        live = LlamaDiskCache(workdir / "live", capacity_bytes=1 << 50, fingerprint=llm.fingerprint)
        recorder = RecordingCache(live)
        llm.set_cache(recorder)
        print(f"workload: {args.conversations} x {args.turns} completions...", file=sys.stderr)
        completions = run_ours(llm, recorder, workload, args.conversations, args.max_tokens)
        llm.set_cache(None)
        phase("workload")
        live_storage = live.storage()
        live.close()
        stores = recorder.stores
        layout = stores[0].state.layout
        bytes_per_token = layout.bytes_per_token
        prefixes = PrefixSet()
        new_tokens: dict[int, int] = {}
        for store in stores:
            new_tokens[store.completion] = new_tokens.get(store.completion, 0) + prefixes.add(store.tokens)
        whole_bytes = sum(encoded_size(encode(store.state)) for store in stores)
        need = whole_bytes + len(CHUNK_SIZES) * 2 * len(prefixes) * bytes_per_token + (1 << 30)
        free = shutil.disk_usage(workdir).free
        if free < need:
            raise SystemExit(f"{workdir}: {free / 1e9:.1f} GB free, about {need / 1e9:.1f} GB needed (see --workdir)")

        # 2. The same stores, replayed per chunk size.
        caches: dict[str, LlamaDiskCache] = {}
        formats: dict[str, Any] = {}
        for chunk_tokens in CHUNK_SIZES:
            print(f"replaying {len(stores)} stores, chunk_tokens={chunk_tokens}...", file=sys.stderr)
            caches[str(chunk_tokens)], formats[str(chunk_tokens)] = replay(
                stores, workdir / f"chunks-{chunk_tokens}", chunk_tokens, llm.fingerprint, new_tokens, bytes_per_token)
        default = str(default_chunk_tokens(layout))
        phase("replay")

        # 3. llama-cpp-python's disk cache on the subset.
        print(f"llama-cpp-python: {sub_conv} x {sub_turns} completions...", file=sys.stderr)
        their_llm = llama_cpp.Llama(**_model_args(args.n_ctx, args.threads))
        theirs, their_result = run_theirs(their_llm, workdir / "llama-cpp-python", workload, sub_conv, sub_turns,
                                          args.max_tokens, bytes_per_token, int(default))
        phase("llama_cpp_python")

        # 4. Time to first token on a hit.
        ttft = probe_hits(llm, their_llm, caches, theirs, workload, default, sub_conv, sub_turns, workdir, args)
        for cache in caches.values():
            cache.close()
        phase("hit_probes")

    out: dict[str, Any] = {
        "benchmark": "dedup", "command": " ".join(["tools/run python benchmarks/dedup.py"] + sys.argv[1:]),
        "machine": described,
        "workload": {"conversations": args.conversations, "turns": args.turns, "max_tokens": args.max_tokens,
                     "system_tokens": system_tokens, "n_ctx": args.n_ctx, "completions": len(completions),
                     "stores": len(stores)},
        "kv_bytes_per_token": bytes_per_token, "unique_tokens": len(prefixes),
        "unique_kv_bytes": len(prefixes) * bytes_per_token, "default_chunk_tokens": int(default),
        "formats": formats, "live_storage": dataclasses.asdict(live_storage), "llama_cpp_python": their_result,
        "ttft": ttft, "completions": completions,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "elapsed_s": time.perf_counter() - started, "phases_s": phases,
    }
    out["targets"] = targets(out)
    finish(out)
    write(args.out, out)
    report(out)
    print(f"\n{out['elapsed_s']:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items())
          + f"); JSON written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
