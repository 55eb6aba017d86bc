"""The engine's sampler on the real default model: its greedy shortcut picks what llama.cpp's chain picks."""

from __future__ import annotations

from collections.abc import Iterator

import llama_cpp
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
def decoded() -> Iterator[tuple[BatchContext, int, npt.NDArray[np.float32]]]:
    """A context whose batch row ``row`` holds the logits after a short prompt, and a copy of them."""
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
        yield context, n - 1, context.logits_row(n - 1).copy()
    finally:
        context.close()
        model.close()


def _sample(settings: SamplerSettings, decoded: tuple[BatchContext, int, npt.NDArray[np.float32]],
            edit: dict[int, float]) -> int:
    """``settings``' token from the decoded row with the logits ``edit`` names set (by a processor, as
    a logit bias would; the row is llama.cpp's buffer, put back as decoded first)."""
    context, row, original = decoded
    np.copyto(context.logits_row(row), original)

    def processor(_: npt.NDArray[np.intc], logits: npt.NDArray[np.float32]) -> None:
        for token, value in edit.items():
            logits[token] = value

    sampler = Sampler(settings, context.n_vocab, [processor])
    try:
        return sampler.sample(context, row, np.zeros(0, dtype=np.intc))
    finally:
        sampler.close()


def _chain_refused(*_: object) -> int:
    raise AssertionError("the greedy shortcut should have answered without llama.cpp's sampler chain")


EDITS = {
    "as decoded": lambda top, n: {},
    "tie": lambda top, n: {900: top + 50.0, 300: top + 50.0},  # the first of equal largest logits
    "infinite tie": lambda top, n: {900: float("inf"), 300: float("inf"), 5: top + 1.0},
    "all minus infinity": lambda top, n: dict.fromkeys(range(n), float("-inf")),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_greedy_without_penalties_answers_alone_with_the_chains_token(
        decoded: tuple[BatchContext, int, npt.NDArray[np.float32]], case: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    edit = EDITS[case](float(np.max(decoded[2])), len(decoded[2]))
    chain = _sample(CHAIN_GREEDY, decoded, edit)
    with monkeypatch.context() as patched:
        patched.setattr(llama_cpp, "llama_sampler_sample", _chain_refused)
        fast = _sample(GREEDY, decoded, edit)
    assert fast == chain
    expected = {"tie": 300, "infinite tie": 300, "all minus infinity": 0}.get(case)
    assert expected is None or fast == expected


@pytest.mark.parametrize("case", ["nan first", "nan at the top"])
def test_a_row_with_nans_goes_through_the_chain(decoded: tuple[BatchContext, int, npt.NDArray[np.float32]],
                                                case: str) -> None:
    top = float(np.max(decoded[2]))
    edit = {"nan first": {0: float("nan"), 700: top + 50.0},
            "nan at the top": {5: float("nan"), 6: float("nan"), 800: top + 40.0}}[case]
    calls: list[object] = []
    real = llama_cpp.llama_sampler_sample
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(llama_cpp, "llama_sampler_sample", lambda *a: calls.append(a) or real(*a))
        fast = _sample(GREEDY, decoded, edit)
    assert calls, "a row whose largest value numpy finds is NaN is llama.cpp's to answer"
    assert fast == _sample(CHAIN_GREEDY, decoded, edit)
