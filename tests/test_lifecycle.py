"""The exit and fork hooks' registry: caches are flushed and forked in the write pipeline's order."""

from __future__ import annotations

import gc
import os
import sys

import pytest

from llama_cache.caches import lifecycle


class _Recorded:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def flush(self) -> None:
        self.log.append(f"flush {self.name}")

    def _before_fork(self) -> None:
        self.log.append(f"before {self.name}")

    def _after_fork_in_parent(self) -> None:
        self.log.append(f"parent {self.name}")

    def _reset_after_fork(self) -> None:
        self.log.append(f"child {self.name}")


def test_the_front_drains_first_and_is_released_last() -> None:
    log: list[str] = []
    back = _Recorded("disk", log)
    front = _Recorded("tiered", log)
    lifecycle.register(back, stage=lifecycle.BACK)  # registered first, still after the front
    lifecycle.register(front, stage=lifecycle.FRONT)
    lifecycle._flush_all()  # noqa: SLF001
    lifecycle._before_fork()  # noqa: SLF001
    lifecycle._after_fork_in_parent()  # noqa: SLF001
    lifecycle._after_fork_in_child()  # noqa: SLF001
    ours = [line for line in log if line.endswith(("disk", "tiered"))]
    assert ours == ["flush tiered", "flush disk", "before tiered", "before disk",
                    "parent disk", "parent tiered", "child disk", "child tiered"]
    with pytest.raises(ValueError):
        lifecycle.register(front, stage=2)


def test_registration_keeps_nothing_alive_and_a_failing_flush_does_not_stop_the_others() -> None:
    log: list[str] = []

    class _Failing(_Recorded):
        def flush(self) -> None:
            raise OSError("disk full")

    failing = _Failing("failing", log)
    survivor = _Recorded("survivor", log)
    lifecycle.register(failing, stage=lifecycle.FRONT)
    lifecycle.register(survivor, stage=lifecycle.BACK)
    lifecycle._flush_all()  # noqa: SLF001
    assert "flush survivor" in log
    gone = _Recorded("gone", log)
    lifecycle.register(gone, stage=lifecycle.BACK)
    del gone, failing
    gc.collect()
    log.clear()
    lifecycle._flush_all()  # noqa: SLF001
    assert "flush gone" not in log and "flush survivor" in log


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="needs fork")
def test_a_real_fork_runs_the_hooks_in_parent_and_child() -> None:
    log: list[str] = []
    cache = _Recorded("forked", log)
    lifecycle.register(cache, stage=lifecycle.BACK)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports what it saw, then leaves without running the parent's atexit hooks
        os.close(read)
        os.write(write, ",".join(line for line in log if line.endswith("forked")).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child_log = pipe.read().decode()
    os.waitpid(pid, 0)
    assert child_log == "before forked,child forked"
    assert [line for line in log if line.endswith("forked")] == ["before forked", "parent forked"]
