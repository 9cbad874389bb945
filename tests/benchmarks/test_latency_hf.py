"""`bench latency --hf-reference` on CPU: HF transformers on the same tiny model and prompts.

No test asserts a time (a shared 2-core machine); they check what is run and recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compile_engine.benchmarks import latency, render
from compile_engine.models.loader import ModelSource

from tiny_models import make_tiny_model

EOS = 2  # tests/tiny_models.py


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama-hf")
    make_tiny_model("llama", directory)
    return directory


def test_latency_main_records_hf_reference(tiny_llama, tmp_path):
    rc = latency.main(
        [
            "--model",
            str(tiny_llama),
            "--target",
            "cpu",
            "--dtype",
            "float32",
            "--batch-sizes",
            "1,2",
            "--input-len",
            "5",
            "--output-len",
            # 7 decode steps between t_generate(1) and t_generate(8): clear of timer noise.
            "8",
            "--num-iters",
            "1",
            "--copy-rate",
            "1e10",
            "--hf-reference",
            "--results-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    (file,) = tmp_path.glob("*.json")
    data = json.loads(file.read_text())
    for b in ("1", "2"):
        batch = data["batches"][b]
        assert batch["hf_decode_tok_s"] > 0
        assert data[f"hf_eager_decode_bs{b}_tok_s"] == batch["hf_decode_tok_s"]
        assert len(batch["hf_runs"]) == 1
        assert batch["decode_tok_s"] > 0 and data[f"decode_bs{b}_tok_s"] == batch["decode_tok_s"]
        assert batch["gpu"] == {"error": "no GPU (cpu)"}  # benchmarks.telemetry
    ref = data["hf_reference"]
    assert ref["attn_implementation"] == "eager" and ref["dtype"] == "float32"
    assert Path(ref["model_path"]) == tiny_llama
    assert ref["engine_bytes_left_after_free"] is None  # CPU: nothing to count

    text = render.render(render.load_results(tmp_path))
    assert "| HF eager tok/s (same run) | ours / HF |" in text
    ratio = data["batches"]["2"]["decode_tok_s"] / data["batches"]["2"]["hf_decode_tok_s"]
    assert f"| {ratio:.2f}x |" in text


def test_hf_generate_decodes_exactly_the_tokens_our_engine_does(tiny_llama):
    """The reference must run the same model on the same prompts: its greedy tokens match our
    engine's in float32, and every row gets exactly output_len tokens."""
    from compile_engine import LLM, SamplingParams

    output_len, batch = 6, 3
    (prompts,) = latency.latency_prompts([batch], 5, 96, num_runs=1, seed=0)[batch]
    model = latency.load_hf_reference(tiny_llama, torch.float32, torch.device("cpu"))
    assert model.config._attn_implementation == "eager"
    with torch.inference_mode():
        theirs = latency.hf_generate(model, prompts, output_len)
        first = latency.hf_generate(model, prompts, 1)
    assert theirs.shape == (batch, output_len)
    assert torch.equal(first[:, 0], theirs[:, 0])  # t_generate(1) is a prefix of the same work

    llm = LLM(str(tiny_llama), target="cpu", dtype="float32", enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for row, tokens in zip(theirs.tolist(), ours, strict=True):
        # HF's min_new_tokens masks eos while ignore_eos lets it through: compare up to it.
        cut = tokens.index(EOS) if EOS in tokens else output_len
        assert row[:cut] == tokens[:cut]
        assert EOS not in row


def test_hf_reference_path_refuses_what_transformers_cannot_load(tmp_path):
    with pytest.raises(latency.HFReferenceError, match="GGUF file or alias"):
        latency.hf_reference_path(ModelSource(tmp_path / "m.gguf", "gguf"))
    (tmp_path / "config.json").write_text("{}")  # an HF config without safetensors weights
    with pytest.raises(latency.HFReferenceError, match=r"config\.json and \*\.safetensors"):
        latency.hf_reference_path(ModelSource(tmp_path, "hf"))
