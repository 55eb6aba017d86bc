"""The engine's sampler on the real default model: its greedy shortcut picks what llama.cpp's chain picks."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest

from llama_cache import default_model_path
from llama_cache.engine.context import BatchContext, ContextSettings
from llama_cache.engine.model import Model
from llama_cache.engine.sampling import Sampler, SamplerSettings

pytestmark = [pytest.mark.model]

GREEDY = SamplerSettings(temperature=0.0)
# A presence penalty turns llama.cpp's penalties sampler on: the row then goes through the chain. A fresh
# sampler has accepted no token yet, so the penalty changes nothing and the chain answers plain greedy.
CHAIN_GREEDY = SamplerSettings(temperature=0.0, presence_penalty=0.5)


@pytest.fixture(scope="module")
def decoded() -> Iterator[BatchContext]:
    """A context whose batch row 0 holds the logits after a short prompt."""
    model = Model(default_model_path())
    context = BatchContext(model, ContextSettings(n_ctx=256, n_seq_max=1, n_batch=64))
    try:
        prompt = model.tokenize(b"The three primary colours are")
        n = len(prompt)
        context.tokens[:n] = prompt
        context.positions[:n] = np.arange(n, dtype=np.int32)
        context.sequences[:n] = 0
        context.wants_logits[:n] = 0
        context.wants_logits[n - 1] = 1
        context.decode(n)
        yield context
    finally:
        context.close()
        model.close()


def _sample(settings: SamplerSettings, context: BatchContext, row: int, edit: dict[int, float]) -> int:
    """``settings``' token from ``row`` after setting the logits ``edit`` names (idempotent: the row is
    llama.cpp's buffer, and each sampler writes the same values into it)."""

    def processor(_: npt.NDArray[np.intc], logits: npt.NDArray[np.float32]) -> None:
        for token, value in edit.items():
            logits[token] = value

    sampler = Sampler(settings, context.n_vocab, [processor])
    try:
        return sampler.sample(context, row, np.zeros(0, dtype=np.intc))
    finally:
        sampler.close()


def _row(context: BatchContext) -> int:
    return int(np.flatnonzero(context.wants_logits)[-1])


def test_greedy_without_penalties_takes_the_chains_token(decoded: BatchContext) -> None:
    row = _row(decoded)
    assert _sample(GREEDY, decoded, row, {}) == _sample(CHAIN_GREEDY, decoded, row, {})


@pytest.mark.parametrize("case", ["tie", "nan_first", "nan_at_the_top", "all_minus_infinity"])
def test_ties_infinities_and_nans_are_picked_as_the_chain_picks_them(decoded: BatchContext, case: str) -> None:
    row = _row(decoded)
    top = float(np.max(decoded.logits_row(row)[:1000]))
    edit = {
        "tie": {900: top + 50.0, 300: top + 50.0},  # the first of equal largest logits
        # NaNs: whatever llama.cpp's chain makes of them (the shortcut hands such a row to it)
        "nan_first": {0: float("nan"), 700: top + 50.0},
        "nan_at_the_top": {5: float("nan"), 6: float("nan"), 800: top + 40.0},
        "all_minus_infinity": dict.fromkeys(range(decoded.n_vocab), float("-inf")),
    }[case]
    fast, chain = _sample(GREEDY, decoded, row, edit), _sample(CHAIN_GREEDY, decoded, row, edit)
    assert fast == chain
    if case in ("tie", "all_minus_infinity"):
        assert fast == {"tie": 300, "all_minus_infinity": 0}[case]
