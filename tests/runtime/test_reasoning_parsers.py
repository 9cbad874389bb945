"""Reasoning parsers: exact (reasoning, content) on each format's outputs, and streaming equal to
parsing however the output is split (every character, every 2-way split, random splits)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_engine.runtime.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    reasoning_parser,
)

# (output, expected reasoning, expected content)
DEEPSEEK = [
    # The template put <think> in the prompt: the output opens with the reasoning.
    ("Paris is in France.\n</think>\n\nParis.", "Paris is in France.\n", "\n\nParis."),
    ("<think>\nhmm, 2+2</think>4", "\nhmm, 2+2", "4"),
    ("  <think>x</think>y", "x", "y"),
    ("</think>only content", None, "only content"),
    ("<think>thinking</think>", "thinking", None),
    # No </think>: cut short, all reasoning (a lone <think> is still stripped).
    ("still thinking about </thin", "still thinking about </thin", None),
    ("<think>still", "still", None),
    (" <thi", " <thi", None),
    ("a < b, <think> later", "a < b, <think> later", None),
    ("r</think>c</think>d", "r", "c</think>d"),
    ("日本語の推論</think>答え 🎉", "日本語の推論", "答え 🎉"),
    ("", None, None),
]

QWEN3 = [
    # The Qwen3 template's layout: "<think>\n" ... "\n</think>\n\n" content.
    ("<think>\nThe user greets.\n</think>\n\nHello!", "The user greets.", "Hello!"),
    ("<think>\n\n</think>\n\nHi.", None, "Hi."),
    ("\n<think>a\n\nb\n\n</think>\n\n\nc\n", "a\n\nb\n", "\nc\n"),
    ("<think>r</think>c", "r", "c"),
    ("<think>r</think>\nc", "r", "c"),
    ("<think>\nr\n</think>", "r", None),
    # Thinking off: no leading <think>, all content, verbatim.
    ("Hello there.", None, "Hello there."),
    ("\n\nHello </think> there.", None, "\n\nHello </think> there."),
    ("x<think>y</think>z", None, "x<think>y</think>z"),
    ("<thi", None, "<thi"),
    ("  ", None, "  "),
    # Started, never closed: the rest is reasoning (a held "\n</thi" included).
    ("<think>\nstill going\n</thi", "still going\n</thi", None),
    ("<think>\n", None, None),
    ("<think>推論 🎉\n</think>\n\n答え", "推論 🎉", "答え"),
    ("", None, None),
]

CASES = [(DeepSeekR1ReasoningParser, *c) for c in DEEPSEEK]
CASES += [(Qwen3ReasoningParser, *c) for c in QWEN3]
IDS = [f"{cls.name}-{i}" for i, (cls, *_) in enumerate(CASES)]


def stream(cls: type[ReasoningParser], chunks: list[str]) -> tuple[str, str, ReasoningParser]:
    parser = cls()
    reasoning, content = [], []
    for chunk in chunks:
        r, c = parser.feed(chunk)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c, parser


def check_stream(cls: type[ReasoningParser], text: str, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    want_r, want_c = cls().parse(text)
    reasoning, content, parser = stream(cls, chunks)
    assert (reasoning, content) == (want_r or "", want_c or ""), chunks


@pytest.mark.parametrize(("cls", "text", "reasoning", "content"), CASES, ids=IDS)
def test_parse(cls, text, reasoning, content):
    assert cls().parse(text) == (reasoning, content)


@pytest.mark.parametrize(("cls", "text", "reasoning", "content"), CASES, ids=IDS)
def test_stream_every_split(cls, text, reasoning, content):
    check_stream(cls, text, [text])
    check_stream(cls, text, list(text))
    for at in range(len(text) + 1):
        check_stream(cls, text, [text[:at], text[at:]])


def test_stream_random_splits():
    @given(st.sampled_from(CASES), st.lists(st.integers(0, 100), max_size=6))
    @settings(max_examples=300, deadline=None)
    def run(case, cuts):
        cls, text, _, _ = case
        points = sorted({c % (len(text) + 1) for c in cuts})
        bounds = [0, *points, len(text)]
        check_stream(cls, text, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])

    run()


def test_deltas_go_out_at_once_and_tags_never_leak():
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>Let me") == ("Let me", "")
    assert parser.feed(" see</th") == (" see", "")
    assert not parser.ended
    assert parser.feed("ink>\n\nIt") == ("", "\n\nIt")
    assert parser.ended
    assert parser.feed(" is.") == ("", " is.")
    assert parser.finish() == ("", "")

    parser = Qwen3ReasoningParser()
    assert parser.feed("<think>") == ("", "")
    assert parser.feed("\nStep 1.\n") == ("Step 1.", "")  # the "\n" may precede </think>
    assert parser.feed("\nStep 2.") == ("\n\nStep 2.", "")
    assert parser.feed("\n</think>\n") == ("", "")
    assert parser.ended
    assert parser.feed("\nAnswer") == ("", "Answer")


def test_ended():
    for cls, text in [
        (DeepSeekR1ReasoningParser, "a</think>b"),
        (Qwen3ReasoningParser, "<think>a</think>b"),
    ]:
        parser = cls()
        for i, ch in enumerate(text):
            assert parser.ended == (i > text.index("</think>") + len("</think>") - 1)
            parser.feed(ch)
        assert parser.ended and cls.end_tag == "</think>"
    # Thinking off: known over once the output does not open with <think>.
    parser = Qwen3ReasoningParser()
    parser.feed(" <")
    assert not parser.ended
    parser.feed("b")
    assert parser.ended
    # Cut short: never over.
    parser = DeepSeekR1ReasoningParser()
    parser.feed("thinking </thi")
    parser.finish()
    assert not parser.ended


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("r1")
