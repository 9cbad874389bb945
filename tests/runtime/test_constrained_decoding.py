"""Constrained decoding in the engine (runtime/structured_output.py), on the CPU: the bitmask
against a per-token reference, the sampler under a mask, and a tiny random model given a
byte-level tokenizer, whose every answer must satisfy its grammar with async scheduling on or
off, under preemption, with n > 1, stop strings and logprobs, and after a reasoning part."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from compile_engine.runtime.sampler import Sampler, SamplingBatch
from compile_engine.runtime.sampling_params import (
    InvalidSamplingParams,
    SamplingParams,
    StructuredOutputsParams,
)
from compile_engine.runtime.structured_output import GrammarError, apply_token_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["kind", "n", "tags"],
    "additionalProperties": False,
}


def _mask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    words = (vocab + 31) // 32
    mask = torch.zeros(len(allowed), words, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            mask[row, t // 32] |= 1 << (t % 32)
    return mask.to(torch.int32)  # bit 31 wraps to the sign, as llguidance writes it


def test_bitmask_matches_a_per_token_reference():
    vocab = 70  # three words, the last one partly past the vocabulary
    allowed = [[0, 31, 32, 69], list(range(vocab)), [5]]
    logits = torch.randn(3, vocab)
    masked = apply_token_bitmask(logits, _mask(allowed, vocab))
    for row, tokens in enumerate(allowed):
        for t in range(vocab):
            expected = logits[row, t] if t in tokens else float("-inf")
            assert masked[row, t] == expected
    # A mask narrower than the logits (a tokenizer smaller than the model's vocabulary)
    # forbids the tokens it does not cover.
    wide = apply_token_bitmask(torch.zeros(1, 100), _mask([list(range(64))], 64))
    assert torch.isinf(wide[0, 64:]).all() and not torch.isinf(wide[0, :64]).any()


def test_sampler_only_picks_allowed_tokens():
    vocab, rows = 64, 6
    allowed = [[3, 40], [63], [0, 1, 2], [10], list(range(vocab)), [7, 8]]
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 3 + [
        SamplingParams(temperature=1.5, seed=s) for s in range(3)
    ]
    for trial in range(20):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(trial))
        batch = SamplingBatch.build(
            params,
            [[1]] * rows,
            [[]] * rows,
            [None] * 3 + [torch.Generator().manual_seed(trial + s) for s in range(3)],
            vocab_size=vocab,
            device="cpu",
            token_bitmask=_mask(allowed, vocab),
        )
        out = Sampler()(logits, batch)
        for row, token in enumerate(out.token_ids.tolist()):
            assert token in allowed[row]
        greedy = [max(a, key=lambda t: logits[r, t].item()) for r, a in enumerate(allowed)][:3]
        assert out.token_ids[:3].tolist() == greedy
        # Logprobs are of the constrained distribution (vLLM's): the masked-out tokens have
        # none left, so the only token of row 1 is certain.
        assert out.logprobs[1].item() == 0.0


def test_params_need_exactly_one_constraint():
    with pytest.raises(InvalidSamplingParams, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(InvalidSamplingParams, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidSamplingParams, match="not JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(InvalidSamplingParams, match="structured_outputs"):
        SamplingParams(structured_outputs={"jsonn": {}})
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs.kind == "choice"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny-llama (vocabulary 512) with the bench's byte-level tokenizer."""
    from compile_engine.benchmarks.make_model import make_model
    from compile_engine.benchmarks.structured import add_byte_level_tokenizer

    model = make_model("tiny-llama", tmp_path_factory.mktemp("tiny"))
    add_byte_level_tokenizer(model)
    return model


def _llm(model, **kwargs):
    from compile_engine import LLM

    settings = dict(target="cpu", dtype="float32", enforce_eager=True, num_kv_blocks=256)
    return LLM(str(model), **(settings | kwargs))


@pytest.fixture(scope="module")
def llm(tiny):
    return _llm(tiny)


PROMPTS = [[i + 1, i + 2, i + 3] * (i + 1) for i in range(6)]


def _json_params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=80, structured_outputs={"json": SCHEMA}, **kwargs)


def test_answers_follow_the_schema_and_async_changes_nothing(llm, tiny):
    greedy = llm.generate(PROMPTS, _json_params(temperature=0.0))
    for out in greedy:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    sync = _llm(tiny, async_scheduling=False).generate(PROMPTS, _json_params(temperature=0.0))
    assert [o.outputs[0].token_ids for o in sync] == [o.outputs[0].token_ids for o in greedy]


def test_preemption_keeps_the_grammar(llm, tiny):
    """Recompute preemption keeps the output tokens, so the matchers need no rollback: the
    tokens equal those of an engine with room for everyone."""
    small = _llm(tiny, num_kv_blocks=12, max_num_seqs=6)
    outs = small.generate(PROMPTS, _json_params(temperature=0.0, min_tokens=20))
    assert small.engine.stats().num_preemptions_total > 0
    roomy = llm.generate(PROMPTS, _json_params(temperature=0.0, min_tokens=20))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]


def test_siblings_stops_and_logprobs(llm):
    """n=3 sampled siblings each satisfy the regex; a stop string ends one early; logprobs
    name only tokens the grammar allowed."""
    regex = r"[0-9]{2,4}-[a-c]{3}"
    params = SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=30, logprobs=3,
        structured_outputs={"regex": regex},
    )  # fmt: skip
    (out,) = llm.generate([PROMPTS[0]], params)
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert re.fullmatch(regex, c.text), c.text
        for entry in c.logprobs:
            assert entry.logprob > float("-inf")
    stopped = llm.generate(
        [PROMPTS[1]],
        SamplingParams(
            temperature=0.0, max_tokens=30, stop=["-"], structured_outputs={"regex": regex}
        ),
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and re.fullmatch(r"[0-9]{2,4}", stopped.text)


def test_choice_and_lark_grammar(llm):
    choice, lark = llm.generate(
        PROMPTS[:2],
        [
            SamplingParams(temperature=0.0, structured_outputs={"choice": ["alpha", "beta"]}),
            SamplingParams(
                temperature=0.0,
                max_tokens=40,
                structured_outputs={"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'},
            ),
        ],
    )
    assert choice.outputs[0].text in ("alpha", "beta")
    text = lark.outputs[0].text
    assert lark.outputs[0].finish_reason != "stop" or re.fullmatch(
        r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", text
    )


def test_bad_grammar_is_refused_before_anything_queues(llm):
    with pytest.raises(GrammarError) as info:
        llm.generate([PROMPTS[0]], SamplingParams(structured_outputs={"regex": "(a"}))
    assert info.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured.states


class _Request:
    def __init__(self, rid: str, eos: int) -> None:
        self.request_id, self.eos_token_id, self.output_token_ids = rid, eos, []


def test_grammar_applies_after_the_reasoning(llm):
    """With a reasoning parser the grammar starts once the reasoning ends (deepseek_r1:
    `</think>` in the output), or at once when the prompt already closed it."""
    from compile_engine.runtime.reasoning_parsers import reasoning_parser
    from compile_engine.runtime.structured_output import StructuredOutputs

    engine = llm.engine
    tok = engine.tokenizer
    manager = StructuredOutputs(
        engine.structured.compiler, reasoning=reasoning_parser("deepseek_r1")
    )
    spec = StructuredOutputsParams(regex="[0-9]+")
    manager.add(["r"], spec)
    manager.add(["closed"], spec, prompt_tail="<think>\nok\n</think>\n\n")
    request, closed = _Request("r", engine.eos_token_id), _Request("closed", engine.eos_token_id)
    assert manager.bitmask([request]) is None  # free while thinking
    assert manager.bitmask([closed]) is not None
    text = ""
    for piece in ["I think", " so.</th", "ink>"]:
        request.output_token_ids += tok.encode(piece)
        text += piece
        assert manager.advance(request, text) is False
    mask = manager.bitmask([request])
    digit = tok.encode("7")[0]
    letter = tok.encode("x")[0]
    assert (
        mask[0, digit // 32] >> (digit % 32) & 1 and not mask[0, letter // 32] >> (letter % 32) & 1
    )
