"""IncrementalDetokenizer against full decodes with the real SmolLM2 tokenizer."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compile_engine.runtime.detokenizer import IncrementalDetokenizer
from compile_engine.runtime.sampling_params import SamplingParams

FFFD = "\ufffd"
# ASCII, accents, CJK, emoji (one with a skin-tone modifier, a flag) and a multi-char word.
UNICODE = ["é", "ü", "ß", "ñ", "你", "好", "語", "🎉", "👍🏽", "🇫🇷", "é🎉"]
PIECES = [*"ab xyz,.!\n", *UNICODE, " the"]
texts = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream(tok, ids, params=None, prompt=(), chunks=None):
    """Feed ids (one per update, or in the given chunk sizes); return deltas, flush, detok."""
    detok = IncrementalDetokenizer(tok, list(prompt), params or SamplingParams())
    deltas = []
    sizes = chunks or [1] * len(ids)
    at = 0
    for size in sizes:
        deltas.append(detok.update(ids[at : at + size]))
        at += size
    if at < len(ids):
        deltas.append(detok.update(ids[at:]))
    return deltas, detok.flush(), detok


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Reference: the stop that completes first in the text, earliest start on ties."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    return None if not found else min(found)[1:]


# --- decoding ---------------------------------------------------------------------------------


def test_multibyte_character_split_across_tokens_is_held(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("ok 🎉 你好", add_special_tokens=False)
    assert any(tok.decode([i]).endswith(FFFD) for i in ids)  # the case under test exists
    deltas, tail, detok = stream(tok, ids)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == "ok 🎉 你好" and tail == ""
    assert detok.text == "ok 🎉 你好"


@HYPOTHESIS
@given(text=texts, prompt=texts)
def test_stream_of_encoded_text_matches_full_decode_at_every_step(
    smollm2_tokenizer, text: str, prompt: str
) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    for i, token in enumerate(ids):
        delta = detok.update([token])
        assert FFFD not in delta
        # Where the full decode is complete, the stream equals it; mid-character it lags
        # only by the unfinished character.
        assert detok.text == tok.decode(ids[: i + 1]).rstrip(FFFD)
    assert detok.flush() == ""
    assert detok.text == text == tok.decode(ids)


@HYPOTHESIS
@given(
    ids=st.lists(st.integers(0, 49151), max_size=40),
    skip_special=st.booleans(),
    prompt=st.lists(st.integers(0, 49151), max_size=6),
    chunk=st.integers(1, 4),
)
def test_random_ids_deltas_plus_flush_equal_full_decode(
    smollm2_tokenizer, ids: list[int], skip_special: bool, prompt: list[int], chunk: int
) -> None:
    tok = smollm2_tokenizer
    params = SamplingParams(skip_special_tokens=skip_special)
    chunks = [chunk] * (len(ids) // chunk)
    deltas, tail, detok = stream(tok, ids, params, prompt, chunks)
    expected = tok.decode(ids, skip_special_tokens=skip_special)
    assert "".join(deltas) + tail == expected == detok.text


def test_special_tokens_follow_skip_special_tokens(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = [*tok.encode("Hi", add_special_tokens=False), 2, *tok.encode(" there")]
    skipped, _, _ = stream(tok, ids)
    kept, _, _ = stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(skipped) == "Hi there"
    assert "".join(kept) == "Hi<|im_end|> there"


def test_window_stays_short(smollm2_tokenizer) -> None:
    class Counting:
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.longest = max(Counting.longest, len(ids))
            return smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "A long enough answer, with 🎉 emoji and 你好 characters, repeated. " * 20
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    deltas, _, _ = stream(Counting(), ids, prompt=list(range(100, 200)))
    assert "".join(deltas) == text
    assert len(ids) > 300 and Counting.longest <= 12


# --- stop strings -------------------------------------------------------------------------


def test_stop_string_split_across_tokens(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("The answer is 42. END of story", add_special_tokens=False)
    params = SamplingParams(stop=["42. EN"])
    deltas, tail, detok = stream(tok, ids, params)
    assert detok.stopped and detok.stop_reason == "42. EN"
    assert "".join(deltas) == "The answer is " == detok.text and tail == ""
    assert detok.update(tok.encode(" more")) == ""  # tokens after the stop are ignored

    params = SamplingParams(stop=["42. EN"], include_stop_str_in_output=True)
    deltas, _, detok = stream(tok, ids, params)
    assert "".join(deltas) == "The answer is 42. EN" == detok.text


def test_possible_stop_prefix_is_held_then_flushed(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("see you lat", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["later!"]))
    released = "".join(detok.update([i]) for i in ids)
    assert released == "see you " and not detok.stopped
    assert detok.flush() == "lat" and detok.text == "see you lat"


def test_stop_strings_ignored_before_min_tokens(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("stop now, stop again", add_special_tokens=False)
    params = SamplingParams(stop=["stop"], min_tokens=3, max_tokens=20)
    deltas, _, detok = stream(tok, ids, params)
    assert detok.stop_reason == "stop" and detok.text == "stop now, "


def test_first_completed_stop_wins(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("xx abcd", add_special_tokens=False)
    _, _, detok = stream(tok, ids, SamplingParams(stop=["abcd", "bc"]), chunks=[len(ids)])
    assert detok.stop_reason == "bc" and detok.text == "xx a"


@HYPOTHESIS
@given(data=st.data(), text=texts.filter(bool), include=st.booleans(), chunk=st.integers(1, 3))
def test_stop_strings_are_found_and_text_before_them_is_exact(
    smollm2_tokenizer, data, text: str, include: bool, chunk: int
) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    start = data.draw(st.integers(0, len(full) - 1))
    end = data.draw(st.integers(start + 1, min(len(full), start + 6)))
    stops = [full[start:end], data.draw(texts.filter(bool))]
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    deltas, tail, detok = stream(tok, ids, params, chunks=[chunk] * (len(ids) // chunk))

    at, stop = first_stop(full, stops)
    assert detok.stopped and detok.stop_reason == stop
    assert detok.text == full[: at + len(stop) if include else at]
    assert "".join(deltas) + tail == detok.text
    assert all(FFFD not in d for d in deltas)
