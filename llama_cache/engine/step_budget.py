"""How many prompt rows a step may carry: bounded chunks, sized by measured time while rows sample.

With one unified KV pool every row attends over all the cells in use, so a prompt row's cost grows
with what other sequences hold: beside four 2,000-token conversations a 128-row prompt chunk takes
about a second on the project's 2-core machine, and every generating sequence waits that long for its
next token. A fixed row count cannot be right both for a short pool and a full one; a time can. So,
while any row of a step samples (a generating sequence's next token, or for the scheduler a prompt
finishing in the step), a prompt chunk carries at most as many rows as fit in ``slack`` times a step
of decode rows alone, both measured as the engine runs (exponentially weighted means); prompts still
advance by at least ``floor`` rows a step, so none waits forever behind a stream of short requests.

A step that carries no decode row reads at most ``cap`` rows: llama.cpp's CPU prefill is no faster in
larger ubatches (one run each of ``llama-batched-bench -m MODEL -c 4096 -b N -ub N -npp 1024 -ntg 1
-npl 1 -t 2 -fa off``, the default model: 286 tokens/s with N = 128, 242 with N = 512), and a request
arriving meanwhile waits for the whole step. Right after an answer ends, a step's prompt rows start
again from the floor and double each step back to the cap, until nothing runs (:attr:`StepBudget.ramp`):
the answer's conversation often sends its next request at once, and it should not find a full chunk
of another request's prompt just begun.

Owned by the scheduler's thread; its figures (:attr:`StepBudget.decode_step`, :attr:`StepBudget.prompt_row`,
:meth:`StepBudget.rows`) may be read from any thread for metrics (a read may miss the latest step).
"""

from __future__ import annotations

__all__ = ["StepBudget"]


class StepBudget:
    """Prompt rows per step (see the module's docstring). O(1) per call.

    Args:
        cap: the most prompt rows in a step (at least 1), but for the floor of a prompt that cannot
            finish, which may go beyond it.
        slack: while rows sample, a step may take ``1 + slack`` times a decode-only step.
        floor: the fewest prompt rows a step with prompts to read carries (at most ``cap``).
        smoothing: weight of the newest measurement in the running means (0 < smoothing <= 1).
    """

    def __init__(self, cap: int, *, slack: float = 1.0, floor: int = 8, smoothing: float = 0.2) -> None:
        if cap < 1:
            raise ValueError(f"cap must be at least 1, got {cap}")
        if slack < 0 or not 0 < smoothing <= 1:
            raise ValueError(f"slack must be >= 0 and smoothing in (0, 1], got {slack}, {smoothing}")
        self.cap = cap
        self.slack = slack
        self.floor = max(1, min(floor, cap))
        self.smoothing = smoothing
        self.decode_step: float | None = None
        """Mean seconds of a step of decode rows alone (None: none measured yet)."""
        self.prompt_row: float | None = None
        """Mean seconds a prompt row adds to a step (None: none measured yet)."""
        self.ramp = cap
        """The most prompt rows the next step may carry (prompts that finish in it go whole all the
        same, and others still read the floor): :attr:`floor` after an answer ends, doubled each
        step back up to :attr:`cap` (see :meth:`answer_ended`)."""

    def rows(self, decode_rows: int) -> int:
        """The most prompt rows a step beside ``decode_rows`` rows that sample may carry."""
        decode_step, prompt_row = self.decode_step, self.prompt_row  # read once: metrics call this too
        if decode_rows == 0 or decode_step is None or prompt_row is None or prompt_row <= 0:
            return self.cap
        fit = self.slack * decode_step / prompt_row
        return self.cap if fit >= self.cap else max(self.floor, int(fit))

    def answer_ended(self) -> None:
        """An answer just ended: the next steps' chunks start again from the floor.

        Its conversation's next request (an agent's next call, a client going on at once) often comes
        within milliseconds, while the loop has already begun its next step; a chunk of another
        request's long prompt in that step would hold its first token for the whole chunk (a 64-row
        chunk: about 0.3 s on the project's 2-core machine). Each ending costs a few steps' fixed
        cost (an 8-, 16- and 32-row step instead of a full one); answers ending every step or two keep
        other prompts near the floor a step, which protects the streams' follow-ups but slows those
        prompts, never below the floor.
        """
        self.ramp = self.floor

    def take_ramp(self) -> int:
        """The ramp for the step being planned; the next step's is twice it, up to the cap. Call it
        once a step, before its decode (an answer ending in that decode starts the ramp again)."""
        ramp, self.ramp = self.ramp, min(self.cap, self.ramp * 2)
        return ramp

    def idle(self) -> None:
        """Nothing runs: the ramp is over (the next request is read at the cap from its first step)."""
        self.ramp = self.cap

    def observe(self, decode_rows: int, prompt_rows: int, seconds: float) -> None:
        """Record a step's decode: ``decode_rows`` generated tokens' rows and ``prompt_rows`` prompt
        rows took ``seconds``.

        A step of both kinds updates both means, each from what the other leaves of its time (a step
        time modelled as a decode part plus a cost per prompt row), so neither goes stale while steps
        without prompt rows are rare (a busy server). A prompt-only step counts for a row's cost only
        once it has :attr:`floor` rows, less the decode part: a step's fixed cost spread over a row or
        two would count as an expensive row. A sample that leaves no time for the other part tells
        nothing and is skipped.
        """
        if seconds <= 0 or decode_rows + prompt_rows == 0:
            return
        if prompt_rows == 0:
            self.decode_step = self._mean(self.decode_step, seconds)
            return
        if decode_rows == 0:
            if prompt_rows < self.floor:
                return
            extra = seconds - (self.decode_step or 0.0)
            if extra > 0:
                self.prompt_row = self._mean(self.prompt_row, extra / prompt_rows)
            return
        if self.decode_step is None:
            return
        extra = seconds - self.decode_step
        if extra > 0:
            self.prompt_row = self._mean(self.prompt_row, extra / prompt_rows)
        if self.prompt_row is not None:
            rest = seconds - prompt_rows * self.prompt_row
            if rest > 0:
                self.decode_step = self._mean(self.decode_step, rest)

    def _mean(self, mean: float | None, value: float) -> float:
        return value if mean is None else mean + self.smoothing * (value - mean)
