"""The exit and fork hooks' registry: caches are flushed and forked in the write pipeline's order.

Each test uses a registry of its own, or forks in a subprocess: the process's registry holds the caches
other tests left alive, whose hooks must not run here.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from llama_cache.caches import lifecycle


class _Recorded:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def flush(self) -> None:
        self.log.append(f"flush {self.name}")

    def before_fork(self) -> None:
        self.log.append(f"before {self.name}")

    def after_fork_in_parent(self) -> None:
        self.log.append(f"parent {self.name}")

    def reset_after_fork(self) -> None:
        self.log.append(f"child {self.name}")


def test_the_front_drains_first_and_is_released_last() -> None:
    log: list[str] = []
    registry = lifecycle.Registry()
    back = _Recorded("disk", log)
    front = _Recorded("tiered", log)
    registry.register(back, stage=lifecycle.BACK)  # registered first, still after the front
    registry.register(front, stage=lifecycle.FRONT)
    registry.flush_all()
    registry.before_fork()
    registry.after_fork_in_parent()
    registry.after_fork_in_child()
    assert log == ["flush tiered", "flush disk", "before tiered", "before disk",
                   "parent disk", "parent tiered", "child disk", "child tiered"]
    with pytest.raises(ValueError):
        registry.register(front, stage=2)
    with pytest.raises(ValueError):
        lifecycle.register(front, stage=2)


def test_registration_keeps_nothing_alive_and_a_failing_flush_does_not_stop_the_others() -> None:
    log: list[str] = []
    registry = lifecycle.Registry()

    class _Failing(_Recorded):
        def flush(self) -> None:
            raise OSError("disk full")

    failing = _Failing("failing", log)
    survivor = _Recorded("survivor", log)
    registry.register(failing, stage=lifecycle.FRONT)
    registry.register(survivor, stage=lifecycle.BACK)
    registry.flush_all()
    assert log == ["flush survivor"]
    gone = _Recorded("gone", log)
    registry.register(gone, stage=lifecycle.BACK)
    del gone, failing
    gc.collect()
    log.clear()
    registry.flush_all()
    assert log == ["flush survivor"]


class _Held(lifecycle.HeldAcrossFork):
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.drained = 0
        self.fail = False

    @property
    def fork_lock(self) -> lifecycle.Lock:
        return self.lock

    def drain(self) -> None:
        if self.fail:
            raise OSError("disk full")
        self.drained += 1


def _held_elsewhere(lock: threading.RLock) -> bool:
    """Whether another thread holds ``lock`` (it cannot take it without waiting)."""
    taken: list[bool] = []

    def attempt() -> None:
        taken.append(lock.acquire(blocking=False))
        if taken[0]:
            lock.release()

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join()
    return not taken[0]


def test_held_across_fork_drains_holds_and_lets_go_only_what_it_took() -> None:
    cache = _Held()
    cache.before_fork()
    assert cache.drained == 1 and _held_elsewhere(cache.lock)
    cache.after_fork_in_parent()
    assert not _held_elsewhere(cache.lock)

    cache.fail = True
    with pytest.raises(OSError):
        cache.before_fork()  # drained nothing, took nothing...
    cache.after_fork_in_parent()  # ...so nothing is released (an unheld RLock would raise)
    assert not _held_elsewhere(cache.lock)

    cache.fail = False
    cache.before_fork()
    cache.lock = threading.RLock()  # what a child's reset does: a fresh lock, the inherited hold void
    cache.reset_after_fork()
    cache.after_fork_in_parent()  # nothing held any more: nothing released
    assert not _held_elsewhere(cache.lock)


_FORKING = """
import os
from llama_cache.caches import lifecycle

log = []

class Recorded:
    def flush(self): print("flushed at exit")
    def before_fork(self): log.append("before")
    def after_fork_in_parent(self): log.append("parent")
    def reset_after_fork(self): log.append("child")

cache = Recorded()
lifecycle.register(cache, stage=lifecycle.BACK)
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child reports what it saw, then leaves without running the parent's atexit hooks
    os.close(read)
    os.write(write, ",".join(log).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read, "rb") as pipe:
    print(pipe.read().decode())
os.waitpid(pid, 0)
print(",".join(log))
"""


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="needs fork")
def test_a_real_fork_and_exit_run_the_process_hooks() -> None:
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_FORKING)], env=env, capture_output=True,
                            text=True, timeout=120, check=True)
    assert result.stdout.splitlines() == ["before,child", "before,parent", "flushed at exit"]
