"""The engine on the real default model: shared prefix cells, batching, the tiers, eviction, preemption."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from llama_cache import Llama, LlamaRAMCache, default_model_path
from llama_cache import Engine
from llama_cache.engine.requests import EngineRequest
from llama_cache.engine.residency import Residency
from llama_cache.engine.text import StopText

pytestmark = [pytest.mark.model]

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6


@pytest.fixture(scope="module")
def reference() -> Iterator[Llama]:
    llama = Llama(model_path=str(default_model_path()), verbose=False, n_ctx=1024, n_batch=512, n_ubatch=512,
                  flash_attn=True)
    yield llama
    llama.close()


def _greedy(engine: Engine, prompt: list[int], n: int = 8) -> tuple[str, int]:
    completions = engine.completions()
    text = completions.create_completion(prompt, max_tokens=n, temperature=0)["choices"][0]["text"]
    return text, completions.last_prompt_tokens_evaluated


def test_a_shared_head_is_taken_from_another_sequence_and_answers_as_a_single_context(reference: Llama) -> None:
    head = reference.tokenize(SYSTEM.encode())
    first = head + reference.tokenize(b" Question: what is a river?", add_bos=False)
    second = head + reference.tokenize(b" Question: what is a lake?", add_bos=False)
    with Engine(n_ctx=1024, parallel=2) as engine:
        _greedy(engine, first)
        text, evaluated = _greedy(engine, second)
        assert 0 < evaluated <= len(second) - len(head)  # the head came from the first sequence's cells
        assert engine.scheduler.stats.shared_tokens >= len(head)
        # Its cells in position order, the answer is a single context's, bit for bit.
        expected = reference.create_completion(second, max_tokens=8, temperature=0)["choices"][0]["text"]
        assert text == expected


def test_an_exact_repeat_evaluates_nothing_and_samples_the_same_token() -> None:
    with Engine(n_ctx=512, parallel=1) as engine:
        prompt = engine.model.tokenize(b"The three primary colours are")
        first, _ = _greedy(engine, prompt, 4)
        tokens = engine.scheduler.stats.tokens
        again, evaluated = _greedy(engine, prompt, 4)
        assert (again, evaluated) == (first, 0)
        assert engine.scheduler.stats.tokens - tokens == 3  # the sampled tokens but the last, nothing else


def test_sequences_decoded_together_each_get_their_own_tokens() -> None:
    with Engine(n_ctx=1024, parallel=4) as engine:
        words = [b" apple", b" river", b" stone", b" cloud"]
        ids = [engine.model.tokenize(word, add_bos=False)[0] for word in words]
        answers: dict[int, str] = {}

        def ask(index: int) -> None:
            from llama_cache.engine.sequences import LogitBias

            bias = LogitBias({ids[index]: 100.0})
            answers[index] = engine.completions().create_completion(
                f"Client {index}:", max_tokens=12, temperature=0, logits_processor=[bias])["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert answers == {i: (words[i].decode() * 12) for i in range(4)}
        assert engine.scheduler.stats.steps < 4 * 12  # decoded together, not one sequence at a time


def test_a_short_prompt_is_read_before_a_long_one_admitted_with_it() -> None:
    # Shortest remaining prompt first: a later turn's few new tokens do not wait behind a long first
    # prompt read 16 rows a step beside a generating sequence (oldest first, they would wait ~40 steps).
    entered, released = threading.Event(), threading.Event()
    first_sampled: list[str] = []

    def hold(input_ids: object, scores: object) -> object:  # stops the step loop until both are queued
        entered.set()
        released.wait(30)
        return scores

    def marks(name: str) -> list[object]:
        def mark(input_ids: object, scores: object) -> object:
            if name not in first_sampled:
                first_sampled.append(name)
            return scores
        return [mark]

    with Engine(n_ctx=2048, parallel=3, prompt_rows_per_step=16) as engine:
        running = engine.submit("Tell me a story about a dog.", max_tokens=48, temperature=0,
                                logits_processor=[hold])
        assert entered.wait(60)
        long = engine.submit("Summarise: " + "the river runs to the sea and " * 90, max_tokens=2,
                             temperature=0, logits_processor=marks("long"))
        short = engine.submit("Hi!", max_tokens=2, temperature=0, logits_processor=marks("short"))
        released.set()
        for request in (running, long, short):
            request.result()
        assert first_sampled == ["short", "long"]
        # The context's batch holds what a step can carry, no more: a token per sequence, 16 prompt rows.
        assert engine.context.n_batch == engine.context.params.n_ubatch == len(engine.residency.residents) + 16
        # and the long prompt was read 16 rows a step at most, in as many steps.
        assert engine.scheduler.stats.steps >= long.result()["usage"]["prompt_tokens"] // 16


class _Held:
    """A logits processor that holds the step loop at its first call until released, and records
    the scheduler's evaluated-token count at every call (the rows of each step up to its own)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.entered, self.released = threading.Event(), threading.Event()
        self.tokens: list[int] = []

    def __call__(self, input_ids: object, scores: object) -> object:
        self.tokens.append(self.engine.scheduler.stats.tokens)
        self.entered.set()
        self.released.wait(30)
        return scores

    def hold_costly_prompt_rows(self) -> None:
        """While held, make prompt rows look costly: beside a sampling row a step may carry the floor."""
        assert self.entered.wait(60)
        budget = self.engine.scheduler.step_budget
        budget.decode_step, budget.prompt_row = 0.001, 1.0
        assert budget.rows(1) == budget.floor == 8

    def hold_cheap_prompt_rows(self) -> None:
        """While held, make prompt rows look cheap: beside a sampling row a step may carry the cap."""
        assert self.entered.wait(60)
        budget = self.engine.scheduler.step_budget
        budget.decode_step, budget.prompt_row = 1.0, 0.001
        assert budget.rows(1) == budget.cap


def test_after_an_answer_ends_another_prompt_is_read_from_the_floor_up() -> None:
    # An answer's conversation often sends its next request at once: the steps after an answer ends
    # read another request's long prompt in chunks of 8, 16, 32 rows, then the cap, so that such a
    # follow-up finds a short step begun, not a full chunk.
    with Engine(n_ctx=2048, parallel=2, prompt_rows_per_step=64) as engine:
        held = _Held(engine)
        steps: dict[str, list[int]] = {"short": [], "long": []}

        def recorder(name: str) -> object:
            def record(input_ids: object, scores: object) -> object:
                steps[name].append(engine.scheduler.stats.steps)
                return scores
            return record

        short = engine.submit("Name a colour, please.", max_tokens=2, temperature=0,
                              logits_processor=[held, recorder("short")])
        # While held, rows look cheap: beside the short answer's next token the long prompt reads the cap.
        held.hold_cheap_prompt_rows()
        long = engine.submit("Summarise: " + "the river runs to the sea and " * 75, max_tokens=1, temperature=0,
                             logits_processor=[recorder("long")])
        held.released.set()
        assert short.result()["choices"][0]["finish_reason"] == "length"
        rows = long.result()["usage"]["prompt_tokens"] - long.cached_tokens
        # The step of the short answer's last token read 64 rows of the long prompt; the answer ended
        # in it, so the rest went 8, 16, 32, 64, ... rows a step, its last chunk whole.
        expected = _steps_to_read(rows - 64, [8, 16, 32])
        # The prompt's length tells that ramp from none, from one starting at 16, and from one skipping 16.
        assert expected not in {_steps_to_read(rows - 64, ramp) for ramp in ([], [16, 32], [8, 32])}
        assert steps["long"][0] - steps["short"][1] == expected


def _steps_to_read(rows: int, ramp: list[int], cap: int = 64) -> int:
    """Steps that read ``rows`` prompt rows alone: chunks of ``ramp``'s sizes, then of the cap, the
    last one whole once it fits the cap."""
    steps = 0
    while rows > 0:
        rows -= rows if rows <= cap else min(ramp[steps] if steps < len(ramp) else cap, rows)
        steps += 1
    return steps


def test_once_nothing_runs_the_ramp_is_over() -> None:
    # One user: an answer ends, nothing runs, then a long first prompt comes: it is read at the cap
    # from its first step, not 8, 16, 32 rows.
    with Engine(n_ctx=2048, parallel=2, prompt_rows_per_step=64) as engine:
        engine.submit("Name a colour, please.", max_tokens=2, temperature=0).result(timeout=120)
        time.sleep(0.2)  # the loop finds nothing running
        before = engine.scheduler.stats.steps
        long = engine.submit("Summarise: " + "the river runs to the sea and " * 80, max_tokens=1, temperature=0)
        rows = long.result(timeout=120)["usage"]["prompt_tokens"] - long.cached_tokens
        assert engine.scheduler.stats.steps - before == _steps_to_read(rows, []) < _steps_to_read(rows, [8, 16, 32])


def test_prompts_that_finish_go_whole_and_a_long_one_beside_them_reads_the_floor() -> None:
    # Three later turns arriving together while a sequence generates are read in one step, beyond
    # the time budget (read 8 rows a step, they would start one after another); the long first
    # prompt admitted with them reads only the floor in that step.
    with Engine(n_ctx=2048, parallel=5, prompt_rows_per_step=64) as engine:
        held = _Held(engine)
        running = engine.submit("Once upon a time, a small dog lived by the river and", max_tokens=24, temperature=0,
                                logits_processor=[held])
        held.hold_costly_prompt_rows()
        first_steps: dict[str, int] = {}

        def marks(name: str) -> list[object]:
            def mark(input_ids: object, scores: object) -> object:
                first_steps.setdefault(name, engine.scheduler.stats.steps)
                return scores
            return [mark]

        long = engine.submit("Summarise: " + "the river runs to the sea and " * 60, max_tokens=2, temperature=0)
        shorts = [engine.submit(text, max_tokens=2, temperature=0, logits_processor=marks(text))
                  for text in ("Name a colour, please.", "What is two plus two?", "Say hello to the sea.")]
        held.released.set()
        for request in (running, long, *shorts):
            request.result()
        assert len(set(first_steps.values())) == 1  # every short prompt sampled in the same step
        short_rows = sum(r.result()["usage"]["prompt_tokens"] - r.cached_tokens for r in shorts)
        assert short_rows > 8
        # The rows of the step after the hold (the generating sequence's, the short prompts', the long
        # prompt's chunk) are what its sampler's next call counts beyond the one before.
        step_rows = held.tokens[2] - held.tokens[1]
        assert 1 <= step_rows - 1 - short_rows <= 8


def test_a_long_prompt_beside_a_finishing_one_reads_the_floor_when_nothing_generates() -> None:
    # A later turn's first token waits for the step that reads its few tokens: that step does not
    # also read a cap's worth of another request's long prompt, though no sequence generates.
    with Engine(n_ctx=2048, parallel=3, prompt_rows_per_step=64) as engine:
        held = _Held(engine)
        first = engine.submit("Tell me a story about a dog.", max_tokens=1, temperature=0, logits_processor=[held])
        held.hold_costly_prompt_rows()
        second = _Held(engine)
        second.released.set()
        long = engine.submit("Summarise: " + "the river runs to the sea and " * 60, max_tokens=2, temperature=0)
        short = engine.submit("Name a colour, please.", max_tokens=2, temperature=0, logits_processor=[second])
        held.released.set()
        for request in (first, long, short):
            request.result()
        short_rows = short.result()["usage"]["prompt_tokens"] - short.cached_tokens
        # The step after the hold read the short prompt and a chunk of the long one; the short
        # sequence's second sample counts that step and its own next row.
        step_rows = second.tokens[1] - 1 - held.tokens[0]
        assert 1 <= step_rows - short_rows <= 8


def test_an_evicted_sequence_goes_to_the_tiers_and_comes_back_from_them() -> None:
    cache = LlamaRAMCache(capacity_bytes=1 << 30)
    with Engine(n_ctx=512, parallel=1, idle_sequences=0, cache=cache) as engine:
        long = engine.model.tokenize(b"A long preamble about the harbours of the Baltic sea and their ships. " * 4)
        _greedy(engine, long, 2)
        other = engine.model.tokenize(b"Something else entirely, about mountains.")
        _greedy(engine, other, 2)  # one sequence id: the first is evicted, its state stored first
        assert engine.scheduler.stats.evicted >= 1 and len(cache) >= 1
        more = long + engine.model.tokenize(b" Name one:", add_bos=False)
        _, evaluated = _greedy(engine, more, 2)
        assert engine.scheduler.stats.restored_tokens >= len(long) - 1
        assert evaluated <= len(more) - len(long) + 1


def test_a_long_prompt_moves_the_idle_sequences_to_the_tiers_and_a_short_one_leaves_them(reference: Llama) -> None:
    cache = LlamaRAMCache(capacity_bytes=1 << 30)
    with Engine(n_ctx=2048, parallel=1, idle_sequences=3, cache=cache, clear_idle_rows=64) as engine:
        first = engine.model.tokenize(b"A long preamble about the harbours of the Baltic sea and their ships. " * 5)
        short = engine.model.tokenize(b"Hello there.")
        other = engine.model.tokenize(b"Another long text, this one about the mountains of Norway and goats. " * 5)
        assert len(first) >= 64 and len(other) >= 64 and len(short) < 64
        _greedy(engine, first, 2)
        _greedy(engine, short, 2)  # too short to clear: the first stays idle in the context
        assert engine.scheduler.stats.evicted == 0 and len(engine.residency.idle()) == 2
        _greedy(engine, other, 2)  # long: both idle sequences go to the tiers before it is read
        assert engine.scheduler.stats.evicted == 2 and len(cache) == 2
        idle = engine.residency.idle()
        assert len(idle) == 1 and engine.residency.cells_in_use() == idle[0].n
        more = first + engine.model.tokenize(b" Name one:", add_bos=False)
        text, evaluated = _greedy(engine, more, 8)
        assert engine.scheduler.stats.restored_tokens >= len(first) - 1
        assert evaluated <= len(more) - len(first) + 1
        assert text == reference.create_completion(more, max_tokens=8, temperature=0)["choices"][0]["text"]


def _held_generation(engine: Engine) -> tuple[threading.Event, threading.Event, threading.Event, threading.Thread]:
    """A running generation whose cancellation check, once armed, holds the scheduler's thread until
    released, then cancels it (its sequence is left idle): (armed, inside, release, its thread)."""
    armed, inside, release = threading.Event(), threading.Event(), threading.Event()

    def cancelled() -> bool:
        if not armed.is_set():
            return False
        inside.set()
        release.wait(60)
        return True

    thread = threading.Thread(target=lambda: engine.completions(cancelled=cancelled).create_completion(
        "Count: 1, 2, 3,", max_tokens=400, temperature=0))
    thread.start()
    deadline = time.monotonic() + 60
    while engine.scheduler.running == 0 and time.monotonic() < deadline:  # it holds a sequence
        time.sleep(0.01)
    assert engine.scheduler.running == 1
    return armed, inside, release, thread


def _turn_sent_beside(engine: Engine, first: list[int], other_prompt: bytes) -> EngineRequest:
    """Send ``other_prompt`` and then ``first``'s next turn while the scheduler's thread is held (so
    the turn's caller sees its conversation in the context), let them run together; the turn."""
    armed, inside, release, thread = _held_generation(engine)
    armed.set()
    assert inside.wait(60)  # the scheduler's thread is held: nothing is admitted meanwhile
    other = engine.submit(engine.model.tokenize(other_prompt), max_tokens=2, temperature=0)
    turn = engine.submit(first + engine.model.tokenize(b" Name one:", add_bos=False), max_tokens=2, temperature=0)
    release.set()  # the held generation ends: the other request is admitted first, the turn after it
    thread.join(120)
    for request in (other, turn):
        request.result(timeout=120)
    return turn


@pytest.mark.parametrize(("parallel", "clear_idle_rows", "repeat", "restored"), [
    # Both sequence ids hold tokens when the other request is admitted: the oldest, the turn's
    # conversation, is evicted to the tiers after the turn's caller saw it, and comes back from them.
    pytest.param(1, None, 1, True, id="evicted-after-the-turn-was-sent"),
    # A long prompt admitted alone clears idle sequences, but the one the waiting turn goes on from.
    pytest.param(3, 64, 10, False, id="kept-for-the-waiting-turn"),
])
def test_a_turn_sent_beside_another_request_starts_from_its_whole_conversation(
        parallel: int, clear_idle_rows: int | None, repeat: int, restored: bool) -> None:
    cache = LlamaRAMCache(capacity_bytes=1 << 30)
    with Engine(n_ctx=2048, parallel=parallel, idle_sequences=1, cache=cache,
                clear_idle_rows=clear_idle_rows) as engine:
        first = engine.model.tokenize(b"A long preamble about the harbours of the Baltic sea and their ships. " * 5)
        _greedy(engine, first, 2)
        turn = _turn_sent_beside(engine, first, b"Mountains of Norway, their goats and their snow. " * repeat)
        assert turn.cached_tokens >= len(first) - 1
        if restored:
            assert engine.scheduler.stats.evicted >= 1
            assert engine.scheduler.stats.restored_tokens >= len(first) - 1
        else:
            assert engine.scheduler.stats.restored_tokens == 0  # the turn went on in its own sequence


def test_a_long_prompt_beside_a_running_generation_leaves_the_idle_sequences() -> None:
    # Reading idle states out holds the step loop: not while another generation would wait for it.
    cache = LlamaRAMCache(capacity_bytes=1 << 30)
    with Engine(n_ctx=2048, parallel=3, idle_sequences=1, cache=cache, clear_idle_rows=64) as engine:
        first = engine.model.tokenize(b"The harbours of the Baltic sea and their ships. " * 8)
        _greedy(engine, first, 2)
        armed, inside, release, thread = _held_generation(engine)
        long = engine.submit(engine.model.tokenize(b"Mountains of Norway, their goats and their snow. " * 10),
                             max_tokens=2, temperature=0)
        long.result(timeout=120)  # admitted and answered while the other generation runs
        assert engine.scheduler.running >= 1
        assert engine.scheduler.stats.evicted == 0
        assert engine.reusable(np.asarray(first, dtype=np.int32), engine.fingerprint()) >= len(first) - 1
        armed.set()
        release.set()
        thread.join(120)


class _RefusingCache(LlamaRAMCache):
    def __setitem__(self, key: Any, value: Any) -> None:
        raise OSError("the tier is full")


def test_an_idle_sequence_whose_state_the_tiers_refuse_stays_in_the_context() -> None:
    with Engine(n_ctx=2048, parallel=1, idle_sequences=2, cache=_RefusingCache(capacity_bytes=1 << 30),
                clear_idle_rows=64) as engine:
        first = engine.model.tokenize(b"A long preamble about the harbours of the Baltic sea and their ships. " * 5)
        _greedy(engine, first, 2)
        _greedy(engine, engine.model.tokenize(b"Mountains of Norway, their goats and their snow. " * 10), 2)
        assert engine.scheduler.stats.evicted == 0  # clearing it would have lost it
        assert engine.reusable(np.asarray(first, dtype=np.int32), engine.fingerprint()) >= len(first) - 1


def test_without_tiers_or_with_clearing_off_idle_sequences_stay() -> None:
    prompts = [f"Text {i}: the harbours of the Baltic sea and their ships, ".encode() * 12 for i in range(3)]
    for options in ({}, {"cache": LlamaRAMCache(capacity_bytes=1 << 30), "clear_idle_rows": None}):
        with Engine(n_ctx=2048, parallel=1, idle_sequences=3, **options) as engine:
            for prompt in prompts:
                tokens = engine.model.tokenize(prompt)
                assert len(tokens) >= 128  # long enough to clear, were clearing on
                _greedy(engine, tokens, 2)
            assert engine.scheduler.stats.evicted == 0 and len(engine.residency.idle()) == 3


@pytest.mark.parametrize("rows", [0, -5, True, 1.5, "128"])
def test_clear_idle_rows_must_be_a_positive_int_or_none(rows: Any) -> None:
    with pytest.raises(ValueError, match="clear_idle_rows"):
        Engine(clear_idle_rows=rows)


def test_a_full_pool_preempts_and_every_request_is_answered_whole() -> None:
    # Four requests whose prompts and answers cannot all fit the pool at once.
    with Engine(n_ctx=512, parallel=4) as engine:
        prompts = [engine.model.tokenize(f"Story {i}: ".encode() + b"once upon a time there was a king. " * 12)
                   for i in range(4)]
        assert sum(len(p) + 64 for p in prompts) > engine.n_ctx
        results: dict[int, dict] = {}

        def ask(index: int) -> None:
            results[index] = engine.completions().create_completion(prompts[index], max_tokens=64, temperature=0)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert sorted(results) == [0, 1, 2, 3]
        assert all(r["choices"][0]["finish_reason"] in ("stop", "length") for r in results.values())
        assert engine.residency.cells_in_use() <= engine.n_ctx


def test_a_cancelled_generation_stops_and_leaves_its_sequence_idle() -> None:
    with Engine(n_ctx=512, parallel=1) as engine:
        stop = threading.Event()
        seen: list[int] = []

        def watch(token: int) -> None:
            seen.append(token)
            if len(seen) == 3:
                stop.set()

        completions = engine.completions(cancelled=stop.is_set, token_watcher=watch)
        completions.create_completion("Count: 1, 2, 3,", max_tokens=200, temperature=0)
        assert len(seen) < 10
        assert engine.scheduler.running == 0 and engine.residency.idle()
        assert _greedy(engine, engine.model.tokenize(b"Hi"), 2)[0]  # the engine goes on


def test_the_cells_in_use_count_shared_cells_once() -> None:
    residency = Residency(3)
    a, b, c = residency.residents
    residency.claim(a, "ns")
    residency.appended(a, np.arange(100, dtype=np.int32))
    residency.copied(a, b, 60)
    residency.appended(b, np.arange(10, dtype=np.int32))
    assert residency.cells_in_use() == 110
    residency.emptied(a)
    assert residency.cells_in_use() == 70  # b still holds 60 of a's cells and 10 of its own
    residency.copied(b, c, 70)
    residency.cut(b, 20)
    assert residency.cells_in_use() == 70
    assert residency.reusable(np.arange(80, dtype=np.int32), "ns")[1] == 60
    assert residency.reusable(np.arange(80, dtype=np.int32), "other")[0] is None


def test_stop_sequences_hold_back_what_may_start_one_and_cut_the_text() -> None:
    text = StopText(["STOP", "\n\n"])
    released = [text.add(piece) for piece in (b"Hello ", b"ST", b"O", b"P after")]
    assert released == [b"Hello ", b"", b"", b""] and text.stopped and bytes(text.text) == b"Hello "
    text = StopText(["STOP"])
    assert text.add(b"a ST") == b"a " and text.add(b"ay") == b"STay"
    text = StopText([])
    assert text.add("é".encode()[:1]) == b"" and text.add("é".encode()[1:]) == "é".encode()
    assert text.finish() == b""


def test_a_long_prompt_is_not_starved_by_a_stream_of_shorter_ones() -> None:
    # Twenty prompts that each take two steps are all shorter than the long one admitted first:
    # shortest first alone, the long prompt would wait for all of them; passed over STALLED_STEPS
    # steps, it reads its chunk first.
    from llama_cache.engine.scheduler import STALLED_STEPS

    with Engine(n_ctx=8192, parallel=24, prompt_rows_per_step=64) as engine:
        held = _Held(engine)
        progress: list[int] = []
        long_generation: list[Any] = []

        def watch(input_ids: object, scores: object) -> object:
            if long_generation:
                progress.append(long_generation[0].prompt_evaluated)
            return held(input_ids, scores)

        running = engine.submit("Once upon a time, a small dog lived by the river and", max_tokens=40, temperature=0,
                                logits_processor=[watch])
        held.hold_costly_prompt_rows()
        completions = engine.completions()
        stream = completions.create_completion("Summarise: " + "the river runs to the sea and " * 40, max_tokens=1,
                                               temperature=0, stream=True)
        long_generation.append(completions.last_generation)
        mediums = [engine.submit(f"Medium {i}: " + "a stone, a leaf, a cloud and " * 9, max_tokens=1, temperature=0)
                   for i in range(20)]
        long_tokens = len(long_generation[0].prompt)
        assert all(64 < len(engine.model.tokenize(f"Medium {i}: {'a stone, a leaf, a cloud and ' * 9}".encode()))
                   < long_tokens for i in range(20))
        held.released.set()
        list(stream)
        for request in (running, *mediums):
            request.result()
        # The long prompt read its first chunk within STALLED_STEPS + 1 steps of the release.
        first = next(i for i, evaluated in enumerate(progress) if evaluated > 0)
        assert first <= STALLED_STEPS + 2
