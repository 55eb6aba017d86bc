"""The engine on recurrent and hybrid models (the tiny mamba and lfm2): checkpoints per sequence take an
idle sequence back to a head of its history, and the answers are those of a fresh engine."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from llama_cache import Engine

SYSTEM = "You are a careful assistant who answers in one line. " * 12  # 133 tokens
INTERVAL = 32
QUESTIONS = ["Q: first question?", "Q: another one entirely?"]


def _ask(engine: Engine, question: str) -> tuple[str, int, int]:
    """The greedy answer, the prompt tokens not evaluated, and the prompt's tokens."""
    request = engine.submit(SYSTEM + question, max_tokens=8, temperature=0)
    result = request.result()
    return result["choices"][0]["text"], request.cached_tokens, result["usage"]["prompt_tokens"]


def _fresh(path: Path, question: str) -> str:
    with Engine(path, n_ctx=1024, parallel=1, idle_sequences=0) as engine:
        return _ask(engine, question)[0]


@pytest.mark.parametrize("arch", ["mamba", "lfm2"])
def test_a_repeat_and_another_conversation_go_back_to_checkpoints(tiny_model_paths: dict[str, Path],
                                                                   arch: str) -> None:
    path = tiny_model_paths[arch]
    expected = [_fresh(path, question) for question in QUESTIONS]
    with Engine(path, n_ctx=1024, parallel=1, checkpoint_interval=INTERVAL) as engine:
        assert engine.rollback is not None
        first, cached, n = _ask(engine, QUESTIONS[0])
        assert (first, cached) == (expected[0], 0)
        # The sequence holds prompt + answer; the repeat goes back to just before the prompt's last token.
        again, cached, _ = _ask(engine, QUESTIONS[0])
        assert (again, cached) == (expected[0], n - 1)
        # Another question on the same system prompt: back to the last checkpoint inside the shared head.
        shared = len(engine.model.tokenize((SYSTEM + "Q:").encode())) - 1
        other, cached, _ = _ask(engine, QUESTIONS[1])
        assert other == expected[1] and cached == shared // INTERVAL * INTERVAL > 0
        # The first question's checkpoints past the shared head went with its history: going back there
        # again reaches the shared head's checkpoint, and the answer is still the fresh one.
        third, cached, _ = _ask(engine, QUESTIONS[0])
        assert third == expected[0] and cached == shared // INTERVAL * INTERVAL
        assert engine.scheduler.stats.rolled_back_tokens == (n - 1) + 2 * cached


def test_a_sequence_taken_back_leaves_its_history_in_a_free_sequence(tiny_model_paths: dict[str, Path]) -> None:
    with Engine(tiny_model_paths["lfm2"], n_ctx=1024, parallel=1, checkpoint_interval=INTERVAL) as engine:
        prompt = engine.model.tokenize((SYSTEM + QUESTIONS[0]).encode())
        engine.submit(prompt, max_tokens=8, temperature=0).result()
        (history,) = [r.tokens.copy() for r in engine.residency.residents if r.n > len(prompt)]
        assert _ask(engine, QUESTIONS[1])[1] > 0  # the first conversation's sequence went back
        # Its next turn still finds the whole first turn: the history was copied before the rollback.
        turn = [*history.tolist(), *engine.model.tokenize(b" Tell me more.", add_bos=False)]
        fresh = Engine(tiny_model_paths["lfm2"], n_ctx=1024, parallel=1, idle_sequences=0)
        with fresh:
            expected = fresh.submit(turn, max_tokens=8, temperature=0).result()["choices"][0]["text"]
        request = engine.submit(turn, max_tokens=8, temperature=0)
        assert request.result()["choices"][0]["text"] == expected
        assert request.cached_tokens == len(history)


def test_a_busy_sequence_is_never_taken_back(tiny_model_paths: dict[str, Path]) -> None:
    path = tiny_model_paths["mamba"]
    long_question = QUESTIONS[1]
    with Engine(path, n_ctx=1024, parallel=1, idle_sequences=0) as fresh:
        expected_long = fresh.submit(SYSTEM + long_question, max_tokens=32, temperature=0).result()["choices"][0]["text"]
    expected = _fresh(path, QUESTIONS[0])
    with Engine(path, n_ctx=1024, parallel=2, idle_sequences=0, checkpoint_interval=INTERVAL) as engine:
        assert _ask(engine, QUESTIONS[0])[0] == expected  # sequence A: idle, with checkpoints in the shared head
        # The long answer takes A back to the shared head (A's history copied to the other sequence)
        # and generates for 32 steps (held at its first token until the repeat is sent); the repeat could go back to A's checkpoints
        # only by breaking the running answer: it evicts the copy and evaluates its prompt.
        held, submitted = threading.Event(), threading.Event()

        def hold(input_ids: Any, scores: Any) -> Any:  # the running answer waits for the repeat's submission
            held.set()
            submitted.wait(30)
            return scores

        running = engine.submit(SYSTEM + long_question, max_tokens=32, temperature=0,
                                logits_processor=llama_cpp.LogitsProcessorList([hold]))
        assert held.wait(60)  # admitted and at its first token: the repeat cannot be admitted with it
        repeat = engine.submit(SYSTEM + QUESTIONS[0], max_tokens=8, temperature=0)
        submitted.set()
        assert running.result()["choices"][0]["text"] == expected_long
        assert running.cached_tokens > 0
        assert repeat.result()["choices"][0]["text"] == expected
        assert repeat.cached_tokens == 0


def test_transformer_engines_keep_no_checkpoints_and_the_interval_is_checked(tiny_model_paths: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="checkpoint_interval"):
        Engine(tiny_model_paths["mamba"], n_ctx=256, parallel=1, checkpoint_interval=0)
    with pytest.raises(ValueError, match="checkpoint_interval"):
        Engine(tiny_model_paths["mamba"], n_ctx=256, parallel=1, checkpoint_interval=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint_bytes"):
        Engine(tiny_model_paths["mamba"], n_ctx=256, parallel=1, checkpoint_bytes=-1)


def test_checkpoints_larger_than_their_budget_are_not_kept(tiny_model_paths: dict[str, Path]) -> None:
    path = tiny_model_paths["mamba"]
    with Engine(path, n_ctx=1024, parallel=1, checkpoint_interval=INTERVAL, checkpoint_bytes=64) as engine:
        assert engine.rollback is not None
        _ask(engine, QUESTIONS[0])
        assert (len(engine.rollback), engine.rollback.nbytes) == (0, 0)
        assert _ask(engine, QUESTIONS[0])[1] == 0  # nothing to go back to: evaluated again


@pytest.mark.model
def test_a_transformer_engine_has_no_rollback() -> None:
    with Engine(n_ctx=512, parallel=1) as engine:
        assert engine.rollback is None


def test_prompts_stopped_at_checkpoints_all_advance_in_one_step(tiny_model_paths: dict[str, Path]) -> None:
    # Each short prompt stops before its last token (a checkpoint is saved there): that stop does not
    # end the step, so two prompts sent together sample their first tokens in the same step.
    from llama_cache.engine.sequences import LogitBias

    with Engine(tiny_model_paths["mamba"], n_ctx=1024, parallel=3, checkpoint_interval=INTERVAL) as engine:
        entered, released = threading.Event(), threading.Event()
        first_steps: dict[str, int] = {}

        def hold(input_ids: Any, scores: Any) -> Any:
            entered.set()
            released.wait(30)
            return scores

        def mark(name: str) -> list[Any]:
            def record(input_ids: Any, scores: Any) -> Any:
                first_steps.setdefault(name, engine.scheduler.stats.steps)
                return scores
            return [record]

        ends = [t for t in range(engine.model.n_vocab) if engine.model.is_end(t)]
        running = engine.submit(SYSTEM + QUESTIONS[0], max_tokens=16, temperature=0,
                                logits_processor=[LogitBias(dict.fromkeys(ends, -1e9)), hold])
        assert entered.wait(60)
        first = engine.submit("Q: one?", max_tokens=1, temperature=0, logits_processor=mark("one"))
        second = engine.submit("Q: two, please?", max_tokens=1, temperature=0, logits_processor=mark("two"))
        released.set()
        for request in (running, first, second):
            request.result()
        assert len(first_steps) == 2 and first_steps["one"] == first_steps["two"]
