"""A bytecode cache of the engine's own for Python installs that keep none.

A process that serves imports about 2,700 modules (torch, Dynamo, Inductor, sympy, triton...).
Python normally compiles each source once and keeps the bytecode beside it in `__pycache__`;
where the install carries no bytecode and cannot take any (a read-only image, or
PYTHONDONTWRITEBYTECODE set), every start compiles every module again. On the lent H200 a
start compiled 2,917 sources (8.6 s under cProfile) and `import torch` took 3.8 s, against
1.1 s on a machine whose install has its bytecode. With this cache a start from the
Llama-3-8B artifact there imported in 1.48 s instead of 2.58 and the compiler's imports took
1.08 s instead of 4.43 (`bench startup`, startup-nvidia-h200-e13d39a.json).

`enable()` then points Python's bytecode cache (`sys.pycache_prefix`, Python 3.8+) at
`pycache/` in the engine's compile cache (compiler.config.default_cache_dir), so the first
start writes the bytecode there and later starts read it. It must run before the heavy
imports: the CLI calls it first thing. Nothing happens when torch's bytecode is already where
Python looks for it or when the user set a prefix of their own (PYTHONPYCACHEPREFIX, Python's
own setting). It imports only the standard library and compiler.config
(torch-free at import): it runs before torch is imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def needed(probe: str = "torch") -> bool:
    """Whether `probe`'s package would be compiled from source on import: no bytecode where
    Python looks for it, and either its directory cannot take any or Python will not write."""
    spec = importlib.util.find_spec(probe)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    cached = importlib.util.cache_from_source(spec.origin)
    if os.path.exists(cached):
        return False
    if sys.dont_write_bytecode:
        return True
    pycache = os.path.dirname(cached)
    writable_dir = pycache if os.path.isdir(pycache) else os.path.dirname(pycache)
    return not os.access(writable_dir, os.W_OK)


def enable(root: Path | None = None, probe: str = "torch") -> Path | None:
    """Give Python a writable bytecode cache under `root` (default: the engine's cache dir) if
    the installed packages need one; returns the directory in use, or None if left alone."""
    if sys.pycache_prefix is not None:
        return None
    if not needed(probe):
        return None
    if root is None:
        from compile_engine.compiler.config import default_cache_dir  # torch-free at import

        root = default_cache_dir()
    prefix = root / "pycache"
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # nowhere to write: Python keeps compiling from source, as before
    sys.pycache_prefix = str(prefix)
    # Child interpreters (Inductor's compile workers at a build) read it too.
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    # PYTHONDONTWRITEBYTECODE keeps bytecode out of the install; this cache lives in ours.
    sys.dont_write_bytecode = False
    return prefix
