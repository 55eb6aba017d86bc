"""llama_cache.measure: the restore recorder (the completion timers are exercised by the CLI tests)."""

from __future__ import annotations

from typing import Any

import pytest

from llama_cache.measure import recording_restores


class _Model:
    def __init__(self) -> None:
        self.loaded: list[Any] = []

    def load_state(self, state: Any) -> None:
        if state == "bad":
            raise KeyError("refused")
        self.loaded.append(state)


def test_restores_are_recorded_in_order_and_the_method_is_put_back() -> None:
    model = _Model()
    with recording_restores(model) as restores:  # type: ignore[arg-type]
        model.load_state("first")
        with pytest.raises(KeyError):
            model.load_state("bad")
        model.load_state("second")
    assert model.loaded == ["first", "second"]
    assert [r.state for r in restores] == ["first", "bad", "second"]
    assert all(r.seconds >= 0 and r.cpu_seconds >= 0 for r in restores)
    assert "load_state" not in vars(model)
    model.load_state("after")
    assert len(restores) == 3
