"""On the H200 (skipped without CUDA): structured output through the CUDA path. The token
bitmask applied on the device picks what the CPU picks, and a compiled engine with CUDA graphs
and async scheduling writes schema-valid JSON with every request constrained."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bitmask_on_the_device_equals_the_host():
    from compile_engine.runtime.structured_output import apply_token_bitmask

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (8, 32), dtype=torch.int32, generator=gen)
    host = apply_token_bitmask(logits, mask)
    device = apply_token_bitmask(logits.cuda().bfloat16(), mask.pin_memory().cuda())
    assert torch.equal(torch.isinf(host), torch.isinf(device.cpu()))
    assert torch.equal(host.argmax(-1), device.float().argmax(-1).cpu())


def test_compiled_engine_writes_valid_json(tmp_path):
    from compile_engine import LLM, SamplingParams
    from compile_engine.benchmarks.make_model import make_model
    from compile_engine.benchmarks.structured import add_byte_level_tokenizer

    model = make_model("llama3-8b", tmp_path / "l3", device="cuda", layers=2)
    add_byte_level_tokenizer(model)
    llm = LLM(str(model), target="h100", dtype="bfloat16", num_kv_blocks=512, max_num_seqs=16)
    # Bounded schemas, so that random weights finish them.
    schemas = [
        {
            "type": "object",
            "properties": {
                "kind": {"enum": ["x", "y", "z"]},
                "n": {"type": "integer", "minimum": 0, "maximum": 99},
                "ok": {"type": "boolean"},
            },
            "required": ["kind", "n", "ok"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"tag": {"type": "string", "maxLength": 6}},
            "required": ["tag"],
            "additionalProperties": False,
        },
    ]
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=64, structured_outputs={"json": s})
        for i, (s, t) in enumerate([(s, t) for s in schemas for t in (0.0, 1.0)] * 4)
    ]
    prompts = [[i + 1] * 8 for i in range(len(params))]
    outputs = llm.generate(prompts, params)
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert isinstance(json.loads(out.outputs[0].text), dict), out.outputs[0].text
    assert llm.engine.runner.counters.graph_steps > 0
