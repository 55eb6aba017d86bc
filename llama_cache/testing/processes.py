"""Stopping the child processes the test fixtures start (redis-server, nginx, server processes)."""

from __future__ import annotations

import signal
import subprocess

__all__ = ["kill_process", "stop_process"]


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """SIGTERM ``process`` and wait up to ``timeout`` seconds, then SIGKILL it. Idempotent; None is a no-op."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def kill_process(process: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """SIGKILL ``process``, as a crash would, and reap it. Idempotent; None is a no-op."""
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=timeout)
