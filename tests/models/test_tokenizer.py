"""The GGUF tokenizer, converted once and then loaded from the engine's cache, behaves exactly
like transformers' own conversion of the file."""

from __future__ import annotations

import pytest

from compile_engine.models.gguf import SMOLLM2_ALIAS, resolve_alias
from compile_engine.models.tokenizer import load_tokenizer

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


def _saved_bpe_tokenizer(directory):
    """A small byte-level BPE tokenizer with special tokens and a chat template, saved the way
    a build saves an artifact's: what transformers writes, read back by AutoTokenizer."""
    import tokenizers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(TEXTS * 20, trainer)
    tokenizer = TokenizersBackend(
        tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    tokenizer.save_pretrained(str(directory))


def test_saved_tokenizer_loads_through_its_recorded_class_exactly_as_autotokenizer(tmp_path):
    """An artifact records the class AutoTokenizer resolves its saved tokenizer to, and a load
    calls that class directly (skipping AutoTokenizer's imports): the same tokenizer."""
    import transformers

    from compile_engine.models.tokenizer import tokenizer_class_name

    _saved_bpe_tokenizer(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    recorded = tokenizer_class_name(auto)
    direct = load_tokenizer("hf", tmp_path / "elsewhere", saved=tmp_path, saved_class=recorded)
    assert type(direct) is type(auto)
    messages = [{"role": "user", "content": TEXTS[0]}]
    for text in TEXTS:
        ids = auto.encode(text)
        assert direct.encode(text) == ids
        assert direct.decode(ids) == auto.decode(ids)
        assert direct.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    assert direct.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(
        messages, tokenize=False
    )
    assert (direct.bos_token_id, direct.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
    # A recorded class outside transformers is not imported: AutoTokenizer decides.
    fallback = load_tokenizer("hf", tmp_path, saved=tmp_path, saved_class="os.path.join")
    assert type(fallback) is type(auto)
    assert fallback.encode(TEXTS[1]) == auto.encode(TEXTS[1])
