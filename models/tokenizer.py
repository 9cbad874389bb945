"""The model's tokenizer: from an HF directory, from a GGUF file, or from where a previous load
saved it.

transformers builds a GGUF file's tokenizer by converting the vocabulary it stores (~7 s for
SmolLM2's 49k tokens on 2 cores); the converted tokenizer is saved once per file under the
engine's cache and loads from there in well under a second afterwards. Artifacts carry it too.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

SAVED_DIR = "tokenizer"


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "compile-engine" / "tokenizers"


def _gguf_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(
        f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]


def has_tokenizer(directory: Path) -> bool:
    return any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def load_tokenizer(
    kind: str, path: Path, saved: Path | None = None, saved_class: str | None = None
):
    """`kind` is "hf" or "gguf"; `saved` is a directory a previous load saved it to (an
    artifact's), `saved_class` the tokenizer class recorded with it. Returns None for an HF
    directory without tokenizer files (token-id prompts only)."""
    if saved is not None and has_tokenizer(saved):
        return _from_pretrained(saved, saved_class)
    if kind == "hf":
        if not has_tokenizer(path):
            return None  # and transformers is not imported at all
        return _from_pretrained(path)
    import transformers

    cached = _cache_root() / _gguf_key(path)
    if has_tokenizer(cached):
        return transformers.AutoTokenizer.from_pretrained(str(cached))
    from compile_engine.models.gguf import GGUFCheckpoint

    tokenizer = GGUFCheckpoint(path).tokenizer()
    # transformers ignores this flag for BPE tokenizers but warns at every load while it is set.
    tokenizer.clean_up_tokenization_spaces = False
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError as exc:  # a read-only home: convert again next time
        log.warning("could not cache the converted tokenizer in %s: %s", cached, exc)
    return tokenizer


def tokenizer_class_name(tokenizer) -> str:
    """What an artifact records of its saved tokenizer: the class AutoTokenizer resolved."""
    cls = type(tokenizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _from_pretrained(directory: Path, class_name: str | None = None):
    """AutoTokenizer's tokenizer of `directory`; given the class AutoTokenizer resolves it to
    (recorded by the build), that class's own from_pretrained, which is what AutoTokenizer
    ends in. AutoTokenizer first imports transformers' auto registries and with them its
    modeling stack: 0.9 s on the 2-core CPU above the 0.4 s of `import transformers`."""
    import importlib

    if class_name is not None:
        module, _, name = class_name.rpartition(".")
        if module.startswith("transformers."):
            cls = getattr(importlib.import_module(module), name, None)
            if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
                return cls.from_pretrained(str(directory))
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(directory))
