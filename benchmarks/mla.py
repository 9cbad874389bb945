"""`bench mla`: the absorbed MLA kernel against the naive up-projected reference, the KV bytes
a token costs in each form, and decode tok/s of a DeepSeek-V2-Lite-shaped model.

    compile-engine bench mla [--out DIR] [--sweep] [--model] [--layers N]

Attention at DeepSeek-V2-Lite's shapes (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128,
bf16, KV block 16), one new token per sequence, every sequence at the same context:

- `latent kernel`: ce_kernels::mla_latent_attention alone (kernels_generated/mla_attention/,
  `bench`), replayed from a CUDA graph, as the engine runs decode; bandwidth counts the latent
  rows read.
- `absorbed`: what the mla_absorb pass puts in the graph: q_nope @ W_UK, the kernel, @ W_UV
  (CUDA graph).
- `naive reference`: models.mla.mla_attention_ref, gather + up-projection of every context
  latent through kv_b_proj + SDPA, eager (it reads lengths on the host, so no graph).

--sweep times a grid of kernel tiles (BLOCK_N, warps, stages: the CUDA `LatentConfig` of the
kernel config's `MlaTuning`) per shape. --model builds a
DeepSeek-V2-Lite-shaped random model in GPU memory (about 31 GB in bf16; drawn in place, not
written to disk: the loader path is covered on CPU) and measures decode tok/s through the
engine (compiled, mla_absorb on, CUDA graphs) at batch 1 and 64. `render_details(result)`
turns the JSON into docs/performance.md lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from compile_engine.benchmarks.results import DEFAULT_DIRECTORY, print_table, write_result
from compile_engine.benchmarks.timing import event_seconds
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.tuning import KernelConfig, MlaTuning
from compile_engine.models import mla

if TYPE_CHECKING:  # imported where used: the CPU path (the bytes table) needs no Triton
    from compile_engine.benchmarks.attention_inputs import LatentBatch

PEAK_GB_S = 4260.0  # H200 HBM3e copy rate, BRIEF.md
V2_LITE = {
    "num_heads": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "block_size": 16,
}
# DeepSeek-V2-Lite's config.json (deepseek-ai/DeepSeek-V2-Lite), token ids only.
V2_LITE_CONFIG = dict(
    architectures=["DeepseekV2ForCausalLM"],
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    topk_method="greedy",
    routed_scaling_factor=1.0,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    bos_token_id=100000,
    eos_token_id=100001,
    tie_word_embeddings=False,
    dtype="bfloat16",
)
TILE_GRID = [
    {"block_n": n, "num_warps": w, "num_stages": s}
    for n in (16, 32, 64)
    for w in (4, 8)
    for s in (2, 3)
]


def kv_bytes_table(element_size: int = 2) -> dict:
    """Latent vs naive KV bytes per token for DeepSeek-V2-Lite, V2 and V3 (all layers)."""
    shapes = {
        "deepseek-v2-lite": (27, 16),
        "deepseek-v2": (60, 128),
        "deepseek-v3": (61, 128),
    }
    out = {}
    for name, (layers, heads) in shapes.items():
        b = mla.kv_bytes_per_token(
            num_layers=layers,
            num_heads=heads,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            element_size=element_size,
        )
        b["ratio"] = b["naive_bytes_per_token"] / b["latent_bytes_per_token"]
        out[name] = b
    return out


# --------------------------------------------------------------------------- kernel


def bench(
    batch: LatentBatch,
    *,
    fn=None,
    warmup: int = 3,
    iters: int = 20,
    inner: int = 10,
    cuda_graph: bool = False,
) -> dict[str, float]:
    """Time `fn(*batch.args())` (default: the Triton kernel) on CUDA: the median over `iters`
    samples of `inner` back-to-back calls between two CUDA events, and the achieved bandwidth
    (latent bytes read + q and out bytes) / time. cuda_graph=True captures one call and
    replays it, as the engine runs decode."""
    from compile_engine.kernels_generated import mla_attention as mk

    fn = mk.mla_latent_attention_triton if fn is None else fn
    call = functools.partial(fn, *batch.args())
    seconds = event_seconds(call, cuda_graph=cuda_graph, warmup=warmup, iters=iters, inner=inner)
    q = batch.q_latent
    moved = batch.latent_bytes_read() + 2 * q.numel() * q.element_size()
    return {"seconds": seconds, "gb_s": moved / seconds / 1e9}


def _latency(fn, *, cuda_graph: bool, iters: int, inner: int) -> float:
    """Median seconds per call of fn() (graph replay when cuda_graph)."""
    return event_seconds(fn, cuda_graph=cuda_graph, iters=iters, inner=inner)


def _tiles_config(tiles: dict) -> KernelConfig:
    """The default kernel config with the CUDA latent tiles `tiles` (block_n, num_warps,
    num_stages)."""
    default = MlaTuning()
    latent = dataclasses.replace(default.latent_cuda, **tiles)
    return KernelConfig(mla=dataclasses.replace(default, latent_cuda=latent))


def _inputs(batch_size: int, context: int):
    from compile_engine.benchmarks.attention_inputs import make_latent_batch

    s = V2_LITE
    qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
    batch = make_latent_batch(
        [1] * batch_size,
        [context] * batch_size,
        num_heads=s["num_heads"],
        kv_lora_rank=s["kv_lora_rank"],
        rope_dim=s["qk_rope_head_dim"],
        block_size=s["block_size"],
        dtype=torch.bfloat16,
        device="cuda",
        qk_head_dim=qk,
    )
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(
        batch_size, s["num_heads"], qk, generator=gen, device="cuda", dtype=torch.bfloat16
    )
    w_kv_b = torch.randn(
        s["num_heads"] * (s["qk_nope_head_dim"] + s["v_head_dim"]),
        s["kv_lora_rank"],
        generator=gen,
        device="cuda",
        dtype=torch.bfloat16,
    ).mul_(0.05)
    return batch, q, w_kv_b


def bench_kernel(batches: list[int], contexts: list[int], iters: int) -> list[dict]:
    from compile_engine.kernels_generated import mla_attention as mk

    rows = []
    for batch_size in batches:
        for context in contexts:
            batch, q, w_kv_b = _inputs(batch_size, context)
            meta = batch.args()[3:7]
            max_context = batch.block_tables.shape[1] * V2_LITE["block_size"]
            # What the kernel chooses with the default kernel config (16 heads: one head block).
            splits = mk.choose_num_splits(tuning.default(), batch_size, 1, max_context, q.device)

            def absorbed(batch=batch, q=q, w=w_kv_b, meta=meta):
                return mla.mla_attention_absorbed(
                    q, batch.kv_latent, batch.latent_cache, *meta, w, batch.scale,
                    latent_attention=mk.mla_latent_attention_triton,
                )  # fmt: skip

            def naive(batch=batch, q=q, w=w_kv_b, meta=meta):
                return mla.mla_attention_ref(
                    q, batch.kv_latent, batch.latent_cache, *meta, w, batch.scale
                )

            row = {
                "batch": batch_size,
                "context": context,
                "latent_mb": batch.latent_bytes_read() / 1e6,
                "num_splits": splits,
            }
            kernel = bench(batch, cuda_graph=True, iters=iters, inner=10)
            row["kernel_ms"] = kernel["seconds"] * 1e3
            row["kernel_gb_s"] = kernel["gb_s"]
            row["kernel_pct_of_peak"] = 100 * row["kernel_gb_s"] / PEAK_GB_S
            row["absorbed_ms"] = _latency(absorbed, cuda_graph=True, iters=iters, inner=10) * 1e3
            row["naive_reference_ms"] = (
                _latency(naive, cuda_graph=False, iters=max(3, iters // 4), inner=1) * 1e3
            )
            row["speedup_absorbed_vs_naive"] = row["naive_reference_ms"] / row["absorbed_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del batch, q, w_kv_b
            torch.cuda.empty_cache()
    return rows


def sweep_tiles(batches: list[int], contexts: list[int], iters: int) -> dict:
    """Kernel time per tile config and shape; the best config per shape and overall."""
    from triton.runtime.errors import OutOfResources

    from compile_engine.kernels_generated import mla_attention as mk

    configs = [(tiles, _tiles_config(tiles)) for tiles in TILE_GRID]
    results = []
    for batch_size in batches:
        for context in contexts:
            batch, _, _ = _inputs(batch_size, context)
            args = batch.args()
            for tiles, config in configs:

                def kernel(args=args, config=config):
                    return mk.mla_latent_attention_triton(*args, kernel_config=config)

                try:
                    ms = _latency(kernel, cuda_graph=True, iters=iters, inner=10) * 1e3
                except OutOfResources:
                    ms = None
                results.append({"batch": batch_size, "context": context, **tiles, "ms": ms})
            del batch
            torch.cuda.empty_cache()
    # Overall: the config with the smallest sum over shapes of time / best time for the shape.
    best_per_shape: dict[tuple[int, int], float] = {}
    for r in results:
        if r["ms"] is not None:
            key = (r["batch"], r["context"])
            best_per_shape[key] = min(best_per_shape.get(key, float("inf")), r["ms"])
    scores: dict[str, float] = {}
    for r in results:
        name = json.dumps({k: r[k] for k in ("block_n", "num_warps", "num_stages")})
        rel = r["ms"] / best_per_shape[(r["batch"], r["context"])] if r["ms"] else float("inf")
        scores[name] = scores.get(name, 0.0) + rel
    best = min(scores, key=scores.get)
    return {"results": results, "best_overall": json.loads(best), "score": scores[best]}


# --------------------------------------------------------------------------- model decode


def _random_loaded_model(layers: int | None, max_model_len: int):
    """DeepSeek-V2-Lite-shaped model with random bf16 weights drawn on the GPU (std 0.02,
    norms 1), and the directory holding its config.json (no weights, no tokenizer)."""
    import transformers

    from compile_engine.models.loader import LoadedModel, ModelSource, build_model
    from compile_engine.models.registry import model_class

    values = dict(V2_LITE_CONFIG)
    if layers is not None:
        values["num_hidden_layers"] = layers
    hf = transformers.DeepseekV2Config(**values)
    directory = tempfile.mkdtemp(prefix="ce-deepseek-v2-lite-")
    hf.save_pretrained(directory)
    cls = model_class(hf.architectures)
    config = cls.config_from_hf(hf)
    model = build_model(config, torch.bfloat16, "cuda", max_model_len)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    source = ModelSource(path=Path(directory), kind="hf")
    return LoadedModel(model, config, hf, source, torch.bfloat16)


def bench_model(layers: int | None, batches: list[int], input_len: int, output_len: int) -> dict:
    from compile_engine.benchmarks.latency import run_once
    from compile_engine.compiler.cuda_graphs import CUDAGraphRunner, default_capture_sizes
    from compile_engine.runtime.engine import EngineConfig, LLMEngine
    from compile_engine.runtime.sampling_params import SamplingParams

    max_model_len = 4096
    max_seqs = max(batches)
    t0 = time.perf_counter()
    loaded = _random_loaded_model(layers, max_model_len)
    build_s = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    config = EngineConfig(
        model=str(loaded.source.path),
        dtype="bfloat16",
        target="h100",
        max_model_len=max_model_len,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=128,
        num_kv_blocks=max_seqs * (input_len + output_len) // 16 + 64,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config, loaded=loaded)
    ready_s = time.perf_counter() - t0
    counts = dict(engine.compiled.pass_manager.match_counts) if engine.compiled else {}
    attached = False
    if engine.runner.graphs is None and counts.get("mla_absorb", 0) > 0:
        # The engine enables CUDA graphs when paged_attention_triton applied; an MLA model
        # has no paged_attention op, yet mla_absorb's kernel is just as graph safe. Until
        # the runtime says so itself, attach the graphs here exactly as the engine would.
        engine.runner.graphs = CUDAGraphRunner(
            engine.compiled,
            engine.runner.kv_caches,
            capture_sizes=default_capture_sizes(max_seqs, config.max_num_batched_tokens),
            max_num_seqs=max_seqs,
            max_blocks_per_seq=-(-engine.max_model_len // config.block_size),
            device=config.device,
        )
        engine.runner.graphs.capture()
        attached = True
    llm = types.SimpleNamespace(engine=engine)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    out: dict = {
        "preset": "deepseek-v2-lite (random bf16 weights, drawn on the GPU)",
        "num_layers": loaded.config.num_layers,
        "weight_gb": weight_bytes / 1e9,
        "input_len": input_len,
        "output_len": output_len,
        "build_s": build_s,
        "engine_ready_s": ready_s,
        "pass_matches": counts,
        "cuda_graphs": engine.runner.graphs is not None,
        "cuda_graphs_attached_by_benchmark": attached,
        "batches": {},
    }
    for b in batches:
        prompts = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(b)]
        run_once(llm, prompts, params, config.device)  # warm-up
        runs = [run_once(llm, prompts, params, config.device) for _ in range(2)]
        tok_s = statistics.median(r["decode_tok_s"] for r in runs)
        out["batches"][str(b)] = {
            "decode_tok_s": tok_s,
            "ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
            "runs": runs,
        }
        out[f"decode_bs{b}_tok_s"] = tok_s
        print(f"model decode batch {b}: {tok_s:,.1f} tok/s", flush=True)
    return out


# --------------------------------------------------------------------------- report


def render_details(result: dict) -> list[str]:
    """Markdown lines for docs/performance.md."""
    s = result.get("shapes", V2_LITE)
    lines = [
        f"MLA attention at DeepSeek-V2-Lite shapes ({s['num_heads']} heads, kv_lora_rank "
        f"{s['kv_lora_rank']}, rope {s['qk_rope_head_dim']}, nope {s['qk_nope_head_dim']}, "
        f"v {s['v_head_dim']}, bf16, block {s['block_size']}), one decode token per sequence. "
        "Kernel and absorbed: CUDA-graph replay; naive reference: eager gather + up-projection "
        "+ SDPA.",
        "",
        "| batch | context | splits | latent kernel ms | GB/s (% of 4.26 TB/s) | absorbed ms "
        "| naive reference ms | naive / absorbed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result.get("kernel", []):
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['num_splits']} | {r['kernel_ms']:.3f} | "
            f"{r['kernel_gb_s']:,.0f} ({r['kernel_pct_of_peak']:.0f}%) | {r['absorbed_ms']:.3f} "
            f"| {r['naive_reference_ms']:.3f} | {r['speedup_absorbed_vs_naive']:.1f}x |"
        )
    kv = result.get("kv_bytes_per_token", {})
    if kv:
        lines += [
            "",
            "KV cache bytes per token (all layers, bf16): the latent row vs up-projected K and V.",
            "",
            "| model | latent | naive | naive / latent |",
            "|---|---|---|---|",
        ]
        for name, b in kv.items():
            lines.append(
                f"| {name} | {b['latent_bytes_per_token']:,} | {b['naive_bytes_per_token']:,} "
                f"| {b['ratio']:.1f}x |"
            )
    model = result.get("model")
    if model and model.get("batches"):
        graphs = "on" if model.get("cuda_graphs") else "off"
        lines += [
            "",
            f"Decode, {model['preset']}, {model['num_layers']} layers, "
            f"{model['weight_gb']:.1f} GB; prompt {model['input_len']}, "
            f"{model['output_len']} new tokens; CUDA graphs {graphs}.",
            "",
            "| batch | decode tok/s | ms per step |",
            "|---|---|---|",
        ]
        for b, row in model["batches"].items():
            lines.append(f"| {b} | {row['decode_tok_s']:,.1f} | {row['ms_per_step']:.2f} |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench mla", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_DIRECTORY), help="where the JSON goes")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--iters", type=int, default=20, help="timed samples; the median is kept")
    p.add_argument("--sweep", action="store_true", help="time a grid of kernel tiles too")
    p.add_argument("--model", action="store_true", help="decode tok/s of a V2-Lite model")
    p.add_argument("--layers", type=int, default=None, help="model layers (default 27)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kv = kv_bytes_table()
    payload: dict = {"shapes": {**V2_LITE, "dtype": "bfloat16", "q_len": 1}, "peak_gb_s": PEAK_GB_S}
    payload["kv_bytes_per_token"] = kv
    lite = kv["deepseek-v2-lite"]
    payload["latent_bytes_per_token"] = lite["latent_bytes_per_token"]
    payload["naive_bytes_per_token"] = lite["naive_bytes_per_token"]
    if not torch.cuda.is_available():
        rows = [
            (k, f"{v['latent_bytes_per_token']:,} vs {v['naive_bytes_per_token']:,}")
            for k, v in kv.items()
        ]
        print_table(rows, "KV bytes per token, latent vs naive (bf16)")
        raise SystemExit("the kernel and model parts of bench mla need a CUDA device")
    payload["kernel"] = bench_kernel(args.batches, args.contexts, args.iters)
    payload["timing"] = (
        "median of iters samples of 10 back-to-back CUDA-graph replays (kernel, absorbed) or "
        "single eager calls (naive reference)"
    )
    if args.sweep:
        payload["tile_sweep"] = sweep_tiles(args.batches, args.contexts, max(5, args.iters // 2))
        print("best tiles overall:", payload["tile_sweep"]["best_overall"], flush=True)
    if args.model:
        payload["model"] = bench_model(args.layers, [1, 64], args.input_len, args.output_len)
    for line in render_details(payload):
        print(line)
    print(f"wrote {write_result('mla', payload, directory=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
