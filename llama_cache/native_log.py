"""llama.cpp's own log lines, routed into Python logging instead of stderr.

llama-cpp-python 0.3.36 installs a log callback that prints llama.cpp's lines to stderr when its
``llama-cpp-python`` logger's level is at or below the line's, and ``Llama(verbose=False)`` sets that
logger to ``ERROR``. But its table of llama.cpp's levels is out of date: the vendored ggml numbers
them ``NONE, DEBUG, INFO, WARN, ERROR, CONT`` (0-5), the bindings read ``NONE, INFO, WARN, ERROR,
DEBUG, CONT``, so every llama.cpp *warning* is taken for an error and printed even when quiet (e.g.
``n_ctx_seq (16384) > n_ctx_train (8192) -- possible training context overflow`` for any context
longer than the model was trained on), and each info line for a warning.

:func:`route_llama_cpp_logs` replaces that callback, once per process, with one that reads the levels
right and sends each line to the :data:`LOGGER_NAME` logger (under ``llama_cache``, whose
``NullHandler`` keeps it silent until an application configures logging). A line is also printed to
stderr, as llama-cpp-python would, when that library was asked to be verbose: its logger's level is
set below ``ERROR`` and at or below the line's level (``Llama(verbose=True)`` sets ``DEBUG``; ``verbose=False`` sets
``ERROR``, so a quiet library prints nothing of llama.cpp's, errors included: they still reach the
logger).

Thread-safety: installing is guarded by a lock; llama.cpp may call the callback from any thread, and
it never raises into llama.cpp.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

import llama_cpp

__all__ = ["LOGGER_NAME", "route_llama_cpp_logs"]

LOGGER_NAME = "llama_cache.llama_cpp"
"""The logger llama.cpp's lines go to."""

_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
"""ggml's ``enum ggml_log_level`` in the llama.cpp llama-cpp-python 0.3.36 vendors (``ggml.h``)."""
_CONTINUED = 5  # GGML_LOG_LEVEL_CONT: the previous line goes on, at its level

_logger = logging.getLogger(LOGGER_NAME)
_bindings_logger = logging.getLogger("llama-cpp-python")
_install_lock = threading.Lock()
_installed: list[object] = []  # the ctypes callback, kept alive as long as llama.cpp may call it
_last_level = logging.DEBUG


def _log_line(level: int, text: bytes | None, _user_data: ctypes.c_void_p) -> None:
    global _last_level
    try:
        python_level = _last_level if level == _CONTINUED else _LEVELS.get(level, logging.DEBUG)
        _last_level = python_level
        line = (text or b"").decode("utf-8", "replace")
        verbose = _bindings_logger.level
        # verbose=False sets ERROR: quiet, errors included (they reach the logger); only a level
        # below that is a request for llama.cpp's lines on stderr.
        if logging.NOTSET < verbose < logging.ERROR and verbose <= python_level:
            print(line, end="", flush=True, file=sys.stderr)
        stripped = line.rstrip("\n")
        if stripped and _logger.isEnabledFor(python_level):
            _logger.log(python_level, "%s", stripped)
    except Exception:  # noqa: BLE001 - nothing may be raised into llama.cpp's C frames
        pass


def route_llama_cpp_logs() -> None:
    """Install the callback described in the module's docstring; later calls do nothing. O(1)."""
    with _install_lock:
        if _installed:
            return
        callback = llama_cpp.llama_log_callback(_log_line)
        llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
        _installed.append(callback)
