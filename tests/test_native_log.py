"""llama.cpp's log lines: in Python logging, on stderr only when llama-cpp-python is asked to be verbose.

Each case runs in a process of its own: the log callback is global to llama.cpp. A context longer than
the default model was trained on (8,192 tokens) makes llama.cpp warn (``possible training context
overflow``), a warning llama-cpp-python 0.3.36's own callback prints even when quiet.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

WARNING_TEXT = "possible training context overflow"

LOAD_LLAMA = (
    "import llama_cache\n"
    "llm = llama_cache.Llama(str(llama_cache.default_model_path()), n_ctx=16384, n_threads=1, verbose={verbose})\n"
    "llm.close()\n"
)
LOAD_ENGINE = (
    "import llama_cache\n"
    "llama_cache.Engine(n_ctx=16384, parallel=1, n_threads=1).close()\n"
)


def _run(script: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.parametrize("script", [LOAD_LLAMA.format(verbose=False), LOAD_ENGINE], ids=["Llama", "Engine"])
def test_a_quiet_load_that_makes_llama_cpp_warn_prints_nothing(script: str) -> None:
    result = _run(script)
    assert result.stdout == ""
    assert result.stderr == ""


@pytest.mark.parametrize("script", [LOAD_LLAMA.format(verbose=False), LOAD_ENGINE], ids=["Llama", "Engine"])
def test_llama_cpp_warnings_reach_python_logging_at_their_level(script: str) -> None:
    configured = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format='%(name)s|%(levelname)s|%(message)s')\n"
        + script
    )
    result = _run(configured)
    lines = [line for line in result.stdout.splitlines() if WARNING_TEXT in line]
    assert len(lines) == 1, result.stdout
    name, level, message = lines[0].split("|", 2)
    assert (name, level) == ("llama_cache.llama_cpp", "WARNING")
    assert not message.endswith("\n")
    assert result.stderr == ""


def test_a_verbose_llama_still_prints_llama_cpps_lines() -> None:
    result = _run(LOAD_LLAMA.format(verbose=True))
    assert WARNING_TEXT in result.stderr
    assert "llama_model_loader" in result.stderr  # its info lines too, as llama-cpp-python prints them


BAD_DECODE = (
    "import llama_cpp, llama_cache\n"
    "llm = llama_cache.Llama(str(llama_cache.default_model_path()), n_ctx=256, n_threads=1, verbose=False)\n"
    "tokens = (llama_cpp.llama_token * 1)(10**8)\n"
    "print(llama_cpp.llama_decode(llm._ctx.ctx, llama_cpp.llama_batch_get_one(tokens, 1)))\n"
    "llm.close()\n"
)


def test_llama_cpp_errors_of_a_quiet_library_are_logged_not_printed() -> None:
    # A token outside the vocabulary: llama.cpp refuses the decode and logs errors about it.
    quiet = _run(BAD_DECODE)
    assert (quiet.stdout, quiet.stderr) == ("-1\n", "")
    configured = _run("import logging, sys\n"
                      "logging.basicConfig(stream=sys.stdout, level=logging.ERROR, format='%(name)s|%(levelname)s|%(message)s')\n"
                      + BAD_DECODE)
    assert "llama_cache.llama_cpp|ERROR|init: invalid token[0] = 100000000" in configured.stdout.splitlines()
    assert configured.stderr == ""

