"""CPU smoke tests of the benchmark suite on a 2-layer random model.

They check that every benchmark runs end to end and writes what docs/performance.md is built
from. No test asserts a time: timings on a shared 2-core machine mean nothing. The latency,
throughput and KV-waste runs are eager (`--enforce-eager`): what they record is counted the same
either way, and a cold Inductor build of the tiny model was ~45 s of CI's 2 cores; the one
compile here is the breakdown's (its kernel config reaches our ops through the passes), of the
pieces only; the compiled engine is test_compiler's, and the benchmarks run it on the device.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from compile_engine.benchmarks import (
    breakdown,
    cli,
    kv_waste,
    latency,
    make_model,
    render,
    throughput,
)
from compile_engine.benchmarks.results import (
    device_slug,
    environment_settings,
    write_result,
)
from compile_engine.kernels_generated.tuning import KernelConfig

RECORD_KEYS = {"command", "commit", "dirty", "timestamp", "device", "versions"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    # Small shards so the index + multi-file loading path runs, as it does at 8B.
    out = tmp_path_factory.mktemp("tiny-llama")
    return make_model.make_model("tiny-llama", out, shard_bytes=150_000)


def _only_json(directory: Path) -> dict:
    files = list(directory.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_make_model_writes_sharded_hf_directory(tiny_model):
    index = json.loads((tiny_model / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all((tiny_model / s).is_file() for s in shards)
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 2
    assert not (tiny_model / "tokenizer.json").exists()
    specs = dict(make_model.tensor_specs(make_model.hf_config("tiny-llama")))
    assert set(index["weight_map"]) == set(specs)


def test_constant_logits_greedy_emits_token_zero_under_speculation(tmp_path):
    """--constant-logits (bench speculative --replay's model): the final norm is zero, so the
    logits are exactly 0 and greedy emits token 0 at any step shape; a replay of that
    continuation is accepted whole (k drafts a step), which random weights' flat logits
    broke on the H200 (accept length 1.13 of 5)."""
    from safetensors.torch import load_file

    from compile_engine import LLM, SamplingParams

    out = make_model.make_model("tiny-llama", tmp_path / "c", constant_logits=True)
    tensors = load_file(str(out / "model.safetensors"))
    assert not tensors["model.norm.weight"].any()
    assert tensors["model.layers.0.input_layernorm.weight"].all()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "adaptive": False}  # fmt: skip
    llm = LLM(str(out), enforce_eager=True, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([[5, 0, 7], [9, 10, 11, 12]], params)
    assert [o.outputs[0].token_ids for o in outputs] == [[0] * 12] * 2


def test_llama3_8b_preset_matches_llama31_shapes():
    config = make_model.hf_config("llama3-8b")
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        4096,
        32,
        14336,
    )
    assert (config.num_attention_heads, config.num_key_value_heads) == (32, 8)
    assert config.vocab_size == 128256 and config.max_position_embeddings == 131072
    rope = config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    assert rope["factor"] == 8.0 and rope["original_max_position_embeddings"] == 8192
    # Planning the shards needs only shapes: ~16 GB of bf16 in ~5 GB shards.
    specs = make_model.tensor_specs(config)
    shards = make_model.plan_shards(specs, 2, make_model.SHARD_BYTES)
    total = sum(2 * make_model._numel(s) for _, s in specs)
    assert 16.0e9 < total < 16.1e9
    assert len(shards) == 4


def test_latency_end_to_end(tiny_model, tmp_path):
    rc = latency.main(
        [
            "--model",
            str(tiny_model),
            "--target",
            "cpu",
            "--batch-sizes",
            "1,3",
            "--input-len",
            "5",
            "--output-len",
            "6",
            "--num-iters",
            "1",
            "--copy-rate",
            "1e10",
            "--results-dir",
            str(tmp_path),
            "--enforce-eager",
        ]
    )
    assert rc == 0
    data = _only_json(tmp_path)
    assert set(data) >= RECORD_KEYS
    assert data["decode_bs1_tok_s"] > 0 and data["decode_bs3_tok_s"] > 0
    run = data["batches"]["3"]["runs"][0]
    # Decode counts exactly the tokens after every request's first one, at full batch.
    assert run["decode_tokens"] == 3 * (6 - 1)
    assert run["min_decode_batch"] == 3 and run["preemptions"] == 0
    # The slowest step, where a one-off stall would show.
    assert run["max_step_ms"] >= run["median_step_ms"] > 0
    assert data["batches"]["1"]["roofline_pct"] > 0
    assert data["copy_rate_B_s"] == 1e10 and data["copy_rate_source"] == "given"


def test_throughput_end_to_end(tiny_model, tmp_path):
    rc = throughput.main(
        [
            "--model",
            str(tiny_model),
            "--target",
            "cpu",
            "--num-requests",
            "6",
            "--input-len",
            "12",
            "--output-len",
            "5",
            "--num-warmup-requests",
            "2",
            "--results-dir",
            str(tmp_path),
            "--enforce-eager",
        ]
    )
    assert rc == 0
    data = _only_json(tmp_path)
    assert set(data) >= RECORD_KEYS
    assert data["offline_output_tok_s"] > 0
    assert data["output_tokens"] == 6 * 5 and data["prompt_tokens"] == 6 * 12
    # Every scheduled token of the run is in exactly one kind of step: 6 x 12 prompt tokens
    # plus the 6 x 4 decode steps' tokens (the first output token comes with the prefill).
    steps = data["steps"]
    assert set(steps) == set(throughput.STEP_KINDS)
    assert sum(x["tokens"] for x in steps.values()) == 6 * 12 + 6 * 4
    assert steps["with prefill"]["steps"] >= 1 and steps["decode only"]["steps"] >= 4
    assert sum(x["seconds"] for x in steps.values()) <= data["elapsed_s"] + 0.05
    assert "Engine steps by kind" in render.render(render.load_results(tmp_path))


def test_throughput_uses_the_offline_token_budget(tiny_model, tmp_path):
    # bench throughput measures LLM.generate as a user runs it: with LLM's own default budget.
    from compile_engine.runtime.llm import LLM, OFFLINE_MAX_NUM_BATCHED_TOKENS

    args = throughput.build_parser().parse_args(["--model", str(tiny_model)])
    assert args.max_num_batched_tokens == OFFLINE_MAX_NUM_BATCHED_TOKENS
    llm = LLM(str(tiny_model), target="cpu", enforce_eager=True)
    assert llm.engine.config.max_num_batched_tokens == OFFLINE_MAX_NUM_BATCHED_TOKENS


@pytest.mark.slow
def test_breakdown_end_to_end(tiny_model, tmp_path):
    # --kernel-config as serve takes it: the engine's passes give its key to our kernel ops, and
    # the record says which config that was.
    rc = breakdown.main(
        ["--model", str(tiny_model), "--target", "cpu", "--batch-sizes", "1,3", "--steps", "4",
         "--kernels", "--kernel-config", '{"pdl": false}', "--results-dir", str(tmp_path),
         "--passes=-paged_attention_cpu"]
    )  # fmt: skip
    assert rc == 0
    data = _only_json(tmp_path)
    recorded = data["settings"]["kernel_config"]
    assert recorded["key"] == KernelConfig(pdl=False).key and not recorded["settings"]["pdl"]
    assert [r["batch"] for r in data["results"]] == [1, 3]
    for r in data["results"]:
        assert r["step_ms"] > 0 and "schedule" in r["phases_ms"]
        assert r["kernels"] is None  # no CUDA here: no kernel profile, and none invented


def test_breakdown_kernel_kinds():
    assert breakdown.kernel_kind("_paged_attention_kernel") == "attention"
    assert breakdown.kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "GEMM"
    assert breakdown.kernel_kind("void cublasLt::splitKreduce_kernel<32, 16, int>") == "GEMM"
    assert breakdown.kernel_kind("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == (
        "fused elementwise (Inductor)"
    )
    assert breakdown.kernel_kind("_rotary_kernel") == "rotary"
    assert breakdown.kernel_kind("Memcpy DtoD (Device -> Device)") == "copies"
    assert breakdown.kernel_kind("something_else") == "other"


def test_breakdown_critical_path_charges_overlaps_once():
    # A GEMM, an attention kernel launched early (PDL) that waits inside the GEMM's time, a
    # gap with no kernel, then two kernels side by side.
    intervals = [
        (0.0, 10.0, "GEMM"),
        (8.0, 13.0, "attention"),
        (15.0, 20.0, "GEMM"),
        (16.0, 18.0, "copies"),
        (17.0, 22.0, "attention"),
    ]
    advance, idle, gaps = breakdown.critical_path(intervals)
    assert advance == {"GEMM": 15.0, "attention": 5.0}
    assert idle == 2.0
    assert gaps == {("attention", "GEMM"): 2.0}  # the kernel that ended last, the next to start
    assert sum(advance.values()) + idle == 22.0  # first start to last end
    assert breakdown.critical_path([]) == ({}, 0.0, {})


def test_breakdown_layer_positions_tell_one_kernels_roles_apart():
    # Two batch-1 layers: qkv, attention, o_proj, gate_up, down, all but attention the same
    # kernel; each relabelled by its count since the last attention kernel, so the critical
    # path charges o_proj, gate_up, down and the next qkv apart (out of order on purpose).
    gemm, attn = "_skinny_gemm_kernel", "_paged_attention_kernel"
    layer = [(0, 4, gemm), (4, 5, attn), (5, 7, gemm), (7, 15, gemm), (15, 19, gemm)]
    intervals = layer + [(start + 19, end + 19, name) for start, end, name in layer]
    labels = [label for _, _, label in breakdown.layer_positions(intervals[::-1])]
    assert labels == [
        f"{gemm} #0", attn, f"{gemm} #0", f"{gemm} #1", f"{gemm} #2",
        f"{gemm} #3", attn, f"{gemm} #0", f"{gemm} #1", f"{gemm} #2",
    ]  # fmt: skip
    positions = breakdown.layer_positions(intervals)
    assert breakdown.layer_timeline(positions, 0) == [
        {"kernel": attn, "start_us": 0, "end_us": 1},
        {"kernel": f"{gemm} #0", "start_us": 1, "end_us": 3},
        {"kernel": f"{gemm} #1", "start_us": 3, "end_us": 11},
        {"kernel": f"{gemm} #2", "start_us": 11, "end_us": 15},
        {"kernel": f"{gemm} #3", "start_us": 15, "end_us": 19},
        {"kernel": attn, "start_us": 19, "end_us": 20},
    ]
    assert breakdown.layer_timeline(positions, 1) == []  # no attention kernel after it
    advance, _, _ = breakdown.critical_path(positions)
    assert advance == {
        f"{gemm} #0": 4 + 2 + 2,
        attn: 2,
        f"{gemm} #1": 16,
        f"{gemm} #2": 8,
        f"{gemm} #3": 4,
    }


def test_render_breakdown_shows_the_critical_path(tmp_path):
    kernels = {
        "device_us_per_step": 30.0,
        "by_kind_us": {"GEMM": 20.0, "attention": 10.0},
        "critical_path_us": {"GEMM": 18.0, "attention": 4.5},
        "device_idle_us_per_step": 1.25,
        "idle_gaps": [{"after": "Memcpy HtoD", "before": "triton_red_fused", "us_per_step": 1.25}],
        "top_kernels": [
            {"name": "_skinny_gemm_kernel", "us_per_step": 20.0, "calls_per_step": 4.0},
            {"name": "_paged_attention_kernel", "us_per_step": 10.0, "calls_per_step": 1.0},
        ],
        "critical_path_by_position": [
            {
                "kernel": "_skinny_gemm_kernel #1",
                "calls_per_step": 1.0,
                "us_per_step": 8.5,
                "us_per_call": 8.5,
            }
        ],
    }
    step = {
        "batch": 1,
        "step_ms": 0.03,
        "phases_ms": {"schedule": 0.01},
        "model_device_ms": 0.02,
        "kernels": kernels,
    }
    write_result("breakdown", {"settings": {}, "results": [step]}, tmp_path, device="cpu")
    text = render.render(render.load_results(tmp_path))
    assert "| critical path (us a step) | batch 1 |" in text
    assert "| attention | 4.50 |" in text
    assert "| device idle (no kernel) | 1.25 |" in text
    assert "- 1.25 us a step: `Memcpy HtoD` -> `triton_red_fused`" in text
    assert "- 8.50 us a step, 8.50 us a call x 1: `_skinny_gemm_kernel #1`" in text
    # A result from before the critical path was recorded renders without that table.
    del kernels["critical_path_us"], kernels["device_idle_us_per_step"], kernels["idle_gaps"]
    del kernels["critical_path_by_position"]
    for path in tmp_path.glob("*.json"):
        path.unlink()
    write_result("breakdown", {"settings": {}, "results": [step]}, tmp_path, device="cpu")
    text = render.render(render.load_results(tmp_path))
    assert "critical path" not in text and "| attention | 10.0 |" in text


def test_breakdown_counts_device_events_only():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    assert breakdown.is_device_event("_paged_attention_kernel", cuda)
    assert breakdown.is_device_event("Memcpy DtoD (Device -> Device)")
    assert not breakdown.is_device_event("aten::mm", cpu)
    assert not breakdown.is_device_event("aten::mm")
    # torch 2.11 / CUDA 13 files the profiler's step annotation as a device event.
    assert not breakdown.is_device_event("ProfilerStep*", cuda)
    assert not breakdown.is_device_event("ProfilerStep*")


def test_kv_waste_within_one_partial_block(tiny_model, tmp_path):
    # A pool of 20 blocks for ~45 blocks of demand forces preemption, the case most likely to leak.
    rc = kv_waste.main(
        [
            "--model",
            str(tiny_model),
            "--num-requests",
            "16",
            "--prompt-len",
            "3,60",
            "--output-len",
            "2,24",
            "--num-kv-blocks",
            "20",
            "--max-model-len",
            "100",
            "--max-num-batched-tokens",
            "48",
            "--results-dir",
            str(tmp_path),
            "--enforce-eager",
        ]
    )
    data = _only_json(tmp_path)
    assert rc == 0
    assert data["within_one_partial_block"]
    assert data["max_request_waste_slots"] < data["block_size"]
    assert data["steps_measured"] > 0 and data["preemptions"] > 0
    assert 0 <= data["waste_pct_mean"] <= data["waste_pct_max"] < 100
    # A contiguous max-length reservation wastes more than paging, for the same running set.
    assert data["contiguous_max_len_waste_pct"] > data["waste_pct_overall"]


def test_kv_waste_refuses_prefix_caching(tiny_model):
    from compile_engine import LLM

    llm = LLM(
        str(tiny_model),
        target="cpu",
        num_kv_blocks=16,
        enable_prefix_caching=True,
        enforce_eager=True,
    )
    with pytest.raises(ValueError, match="prefix caching off"):
        kv_waste.bench_kv_waste(llm, num_requests=2)


def test_results_record_the_switches_not_the_caches():
    env = {
        "TORCHINDUCTOR_ENABLE_PDL": "1",
        "COMPILE_ENGINE_PDL": "0",
        "TRITON_PTXAS_PATH": "/x/ptxas",
        "TRITON_CACHE_DIR": "/tmp/t",
        "COMPILE_ENGINE_CACHE_DIR": "/tmp/c",
        "COMPILE_ENGINE_COMMIT": "abc",
        "HOME": "/root",
    }
    assert environment_settings(env) == {
        "COMPILE_ENGINE_PDL": "0",
        "TORCHINDUCTOR_ENABLE_PDL": "1",
        "TRITON_PTXAS_PATH": "/x/ptxas",
    }
    line = render._versions({"versions": {"torch": "2.11.0"}, "environment": env})
    assert "`TORCHINDUCTOR_ENABLE_PDL=1`" in line and line.startswith("torch 2.11.0")


def test_write_result_names_and_records(tmp_path):
    path = write_result("unit", {"decode_bs1_tok_s": 1.5}, tmp_path, device="cpu")
    data = json.loads(path.read_text())
    tag = data["commit"][:12] + ("-dirty" if data["dirty"] else "")
    assert re.fullmatch(rf"unit-cpu-[a-z0-9-]+-{re.escape(tag)}\.json", path.name)
    assert set(data) >= RECORD_KEYS and data["decode_bs1_tok_s"] == 1.5
    assert "torch" in data["versions"] and "python" in data["versions"]
    assert isinstance(data["environment"], dict)
    assert device_slug({"type": "cuda", "name": "NVIDIA H200"}) == "nvidia-h200"
    assert device_slug({"type": "cpu", "cpu": "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz"}) == (
        "cpu-intel-xeon-gold-6338"
    )
    # the same name on an AVX2 part and an AVX-512 one: two devices
    assert device_slug({"type": "cpu", "cpu": "AMD EPYC", "isa": "AVX2"}) == "cpu-amd-epyc-avx2"
    assert device_slug({"type": "cpu", "cpu": "AMD EPYC", "isa": "AVX512"}) == "cpu-amd-epyc"


def test_render_markdown(tmp_path):
    results = tmp_path / "results"
    latency_keys = {
        "benchmark": "latency",
        "model": "/m/llama3-8b",
        "input_len": 32,
        "output_len": 128,
        "num_iters": 3,
        "num_warmup": 1,
        "copy_rate_B_s": 4.26e12,
        "copy_rate_source": "given",
        "weight_bytes_per_step": 15_000_000_000,
        "batches": {
            "1": {
                "decode_tok_s": 260.0,
                "ms_per_step": 3.8,
                "roofline_tok_s": 283.0,
                "roofline_pct": 91.9,
                "prefill_s": 0.02,
            }
        },
        "decode_bs1_tok_s": 260.0,
    }
    path = write_result("latency", latency_keys, results, device="cpu")
    write_result("kv-waste-probe", {"benchmark": "kv_waste_probe"}, results, device="cpu")
    out = tmp_path / "performance.md"
    assert cli.main(["render", "--results-dir", str(results), "--output", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Performance")
    # A CPU run is no headline number: no targets table, an empty change log.
    assert "## Against the targets" not in text
    log = text.split(render.CHANGE_LOG)[1].split("## ")[0]
    assert not [line for line in log.splitlines() if line.startswith("| `")]
    # Every record is detailed under its own title with its command, the headline kinds first.
    record = json.loads(path.read_text())
    title = f"### latency: {record['device']['name']} at `{render._commit(record)}`, llama3-8b"
    assert text.index(title) < text.index("### kv-waste-probe:")
    assert f"`{path.name}`, {record['timestamp']}:\n`{record['command']}`" in text
    assert "| 1 | 260.0 | 3.80 | 283.0 | 91.9% | 0.02 |" in text


def test_cli_rejects_unknown_command(capsys):
    assert cli.main(["nonsense"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_the_recorded_command_runs_the_package_module():
    from compile_engine.benchmarks.results import REPO_ROOT, command_line

    main = str(REPO_ROOT / "benchmarks" / "__main__.py")
    assert command_line([main, "latency", "--model", "/m"]) == (
        "python -m compile_engine.benchmarks latency --model /m"
    )
    latency = str(REPO_ROOT / "benchmarks" / "latency.py")
    assert command_line([latency, "--x"]) == "python -m compile_engine.benchmarks.latency --x"
    assert command_line(["/venv/bin/compile-engine", "bench", "latency"]) == (
        "compile-engine bench latency"
    )
