"""The prompt rows a step carries: bounded always, sized by measured time while sequences generate."""

from __future__ import annotations

import pytest

from llama_cache import Engine
from llama_cache.engine.step_budget import StepBudget


def test_without_measurements_or_generating_sequences_a_step_reads_the_cap() -> None:
    budget = StepBudget(128)
    assert budget.rows(0) == 128
    assert budget.rows(4) == 128  # nothing measured yet
    budget.observe(4, 0, 0.05)
    assert budget.rows(4) == 128  # a decode step, but no prompt row's cost yet
    budget.observe(0, 100, 1.0)
    assert budget.rows(0) == 128  # prompt-only steps are bounded by the cap alone


def test_while_sequences_generate_prompt_rows_fit_one_more_decode_step() -> None:
    budget = StepBudget(128, slack=1.0, floor=8, smoothing=1.0)
    budget.observe(4, 0, 0.060)  # a decode step: 60 ms
    budget.observe(4, 20, 0.200)  # 20 prompt rows added 140 ms: 7 ms a row
    assert budget.decode_step == pytest.approx(0.060)
    assert budget.prompt_row == pytest.approx(0.007)
    assert budget.rows(4) == 8  # 60 ms / 7 ms
    budget.observe(0, 128, 0.124)  # a cheap pool: 128 rows took 64 ms more than a decode step
    assert budget.prompt_row == pytest.approx(0.0005)
    assert abs(budget.rows(4) - 120) <= 1  # 60 ms / 0.5 ms
    budget.observe(4, 0, 0.500)  # a slow decode step leaves room for more, within the cap
    assert budget.rows(4) == 128


def test_a_busy_engine_keeps_both_estimates_current_from_mixed_steps() -> None:
    budget = StepBudget(128, smoothing=0.3)
    budget.observe(4, 0, 0.030)
    budget.observe(4, 10, 0.080)
    for _ in range(200):  # the pool fills: every step mixes 4 decode rows and 20 prompt rows
        budget.observe(4, 20, 0.200 + 20 * 0.005)
    # Only the sum is determined by such steps: the model fits it at 20 rows, whatever the split.
    assert budget.decode_step + 20 * budget.prompt_row == pytest.approx(0.300, rel=0.02)
    assert budget.decode_step > 0.09  # not stuck at the 30 ms of an emptier pool


def test_short_prompt_only_steps_and_samples_without_time_tell_nothing() -> None:
    budget = StepBudget(128, floor=8, smoothing=1.0)
    budget.observe(4, 0, 0.040)
    budget.observe(4, 20, 0.080)
    assert budget.prompt_row == pytest.approx(0.002)
    budget.observe(0, 1, 0.050)  # a one-row re-evaluation: mostly a step's fixed cost
    budget.observe(4, 20, 0.030)  # faster than a decode step alone: no time left for the rows
    assert budget.prompt_row == pytest.approx(0.002)


def test_a_vanishing_row_cost_gives_the_cap_never_an_overflow() -> None:
    budget = StepBudget(128, smoothing=1.0)
    budget.observe(2, 0, 1e300)
    budget.observe(2, 10, 1e300 * (1 + 1e-15))
    assert budget.rows(2) == 128


def test_prompts_advance_by_the_floor_however_costly_their_rows() -> None:
    budget = StepBudget(64, floor=8, smoothing=1.0)
    budget.observe(2, 0, 0.010)
    budget.observe(2, 10, 5.0)
    assert budget.rows(2) == 8
    assert StepBudget(4, floor=8).floor == 4  # never above the cap


def test_means_move_by_the_smoothing_weight() -> None:
    budget = StepBudget(128, smoothing=0.5)
    budget.observe(1, 0, 0.100)
    budget.observe(1, 0, 0.200)
    assert budget.decode_step == pytest.approx(0.150)
    budget.observe(1, 0, 0.0)  # no time: ignored
    budget.observe(0, 0, 1.0)  # no rows: ignored
    assert budget.decode_step == pytest.approx(0.150)


def test_after_an_answer_ends_chunks_start_from_the_floor_and_double_back_to_the_cap() -> None:
    budget = StepBudget(64, floor=8)
    assert budget.ramp == 64  # nothing has ended yet
    budget.answer_ended()
    assert [budget.take_ramp() for _ in range(5)] == [8, 16, 32, 64, 64]
    budget.take_ramp()
    budget.answer_ended()  # during a step's decode, after its ramp was taken: the next step's is the floor
    assert budget.take_ramp() == 8
    budget.idle()  # nothing runs: the ramp is over
    assert budget.take_ramp() == 64
    small = StepBudget(4, floor=8)
    small.answer_ended()
    assert small.take_ramp() == small.ramp == 4  # never above the cap


@pytest.mark.parametrize("kwargs", [{"cap": 0}, {"cap": 8, "slack": -1.0}, {"cap": 8, "smoothing": 0.0},
                                    {"cap": 8, "smoothing": 1.5}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        StepBudget(**kwargs)  # type: ignore[arg-type]


@pytest.mark.model
def test_a_long_prompt_alone_is_read_in_chunks_of_the_cap() -> None:
    with Engine(n_ctx=1024, parallel=1, prompt_rows_per_step=64) as engine:
        prompt = engine.model.tokenize(b"The river runs to the sea and the sea runs to the sky. " * 30)
        assert 300 < len(prompt) < 900
        before = engine.scheduler.stats.steps
        engine.submit(prompt, max_tokens=1, temperature=0).result(timeout=120)
        steps = engine.scheduler.stats.steps - before
        assert steps >= -(-len(prompt) // 64)
        assert engine.scheduler.step_budget.prompt_row is not None
