"""The GGUF tokenizer, converted once and then loaded from the engine's cache, behaves exactly
like transformers' own conversion of the file."""

from __future__ import annotations

import pytest

from models.gguf import SMOLLM2_ALIAS, resolve_alias
from models.tokenizer import load_tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "naïve café – 東京 🚀 <|im_start|>user\nhi<|im_end|>",
    "def f(x):\n\treturn x ** 2  # 42",
]


@pytest.mark.slow
def test_cached_gguf_tokenizer_equals_fresh_conversion(smollm2_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = resolve_alias(SMOLLM2_ALIAS)
    first = load_tokenizer("gguf", path)  # converts and saves
    assert any((tmp_path / "compile-engine" / "tokenizers").iterdir())
    cached = load_tokenizer("gguf", path)  # loads the saved one
    for tok in (first, cached):
        for text in TEXTS:
            ids = smollm2_tokenizer.encode(text)
            assert tok.encode(text) == ids
            assert tok.decode(ids, skip_special_tokens=True) == smollm2_tokenizer.decode(
                ids, skip_special_tokens=True
            )
        assert tok.chat_template == smollm2_tokenizer.chat_template
        assert tok.eos_token_id == smollm2_tokenizer.eos_token_id
