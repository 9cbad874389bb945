"""`bench moe`: the fused MoE kernel against a per-expert loop, and decode of a MoE model.

Two parts, both on CUDA:

- **kernel**: the routed experts of one layer (align + two grouped GEMMs + combine,
  kernels_generated/moe_grouped_gemm.py, CUDA-graph replay) against transformers' eager
  per-expert loop (a gather, two GEMMs and an index_add per expert hit, after a host
  synchronisation to find them; `per_expert_loop` of benchmarks/kernel_specs.py) at T = 1,
  64, 256, 2048 tokens. Reported with the bytes of the experts the routing touches per call
  (each read once at best) and the achieved bandwidth. Its tiles are tuned by `compile-engine
  bench kernel moe_grouped_gemm --tune`.
- **decode**: a Qwen3-30B-A3B-shaped random model (hidden 2048, 48 layers, 128 experts of width
  768, top-8, 32 heads, 4 KV heads, vocab 151936) built in GPU memory (61 GB in bf16: the GPU
  machine's 64 GB disk cannot hold its safetensors), served by the engine (compiled, CUDA
  graphs, the default passes), decode tok/s at batch 1 and 64 as `bench latency` measures it.
  `--layers N` builds fewer layers (recorded in the JSON). The roofline counts the bytes a step
  really reads: the dense weights plus the experts the batch's tokens can touch (expected
  distinct experts per layer, uniform routing), not all 128 experts.

    compile-engine bench moe                       # both parts
    compile-engine bench moe --part kernel --experts 128,64
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from compile_engine.benchmarks.results import DEFAULT_DIRECTORY, write_result

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    attention_bias=False,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
    dtype="bfloat16",
)
H200_COPY_RATE = 4.26e12


# --------------------------------------------------------------------------- kernel


def expected_busy_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Distinct experts hit by num_tokens tokens choosing top_k of num_experts uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def bench_kernel(shapes: list[tuple[int, int, int, int]], token_counts: list[int]) -> list[dict]:
    from compile_engine.benchmarks import kernel_specs as specs
    from compile_engine.benchmarks.timing import event_seconds
    from compile_engine.kernels_generated import moe_grouped_gemm as mk
    from compile_engine.kernels_generated import tuning

    rows = []
    for num_experts, hidden, inter, top_k in shapes:
        expert_bytes = 3 * hidden * inter * 2  # w13 + w2 of one expert, bf16
        for num_tokens in token_counts:
            inputs = specs.moe_inputs(num_tokens, num_experts, hidden, inter, top_k,
                                      dtype=torch.bfloat16, device="cuda")  # fmt: skip
            got, want = mk.fused_experts(*inputs), mk.fused_experts_ref(*inputs)
            check = specs.moe_errors(got, want, rtol=3e-2)  # ~2 bf16 ulps of the largest output
            # Median seconds a call, events around 5 back-to-back calls; the fused kernel
            # replayed from a CUDA graph (as the engine runs decode), the loop eagerly (it
            # synchronises the host to find the experts hit).
            fused = event_seconds(functools.partial(mk.fused_experts, *inputs), cuda_graph=True,
                                  inner=5)  # fmt: skip
            loop = event_seconds(functools.partial(specs.per_expert_loop, *inputs), iters=10,
                                 inner=5)  # fmt: skip
            busy = int(torch.unique(inputs[4]).numel())
            flops = 2 * num_tokens * top_k * 3 * hidden * inter
            # The tiles fused_experts ran with: the default kernel config's table.
            config = mk.pick_config(tuning.default(), num_experts, hidden, inter,
                                    num_tokens * top_k, torch.device("cuda"))  # fmt: skip
            rows.append(
                {
                    "experts": num_experts,
                    "hidden": hidden,
                    "inter": inter,
                    "top_k": top_k,
                    "tokens": num_tokens,
                    "busy_experts": busy,
                    "fused_ms": fused * 1e3,
                    "loop_ms": loop * 1e3,
                    "speedup": loop / fused,
                    "fused_weight_GB_s": busy * expert_bytes / fused / 1e9,
                    "fused_TFLOP_s": flops / fused / 1e12,
                    "max_abs_err": check["max_abs_err"],
                    "cosine": check["cosine"],
                    "config": config,
                }
            )
            r = rows[-1]
            print(
                f"E{num_experts} H{hidden} I{inter} K{top_k} T{num_tokens:>5}: fused "
                f"{r['fused_ms']:.3f} ms, loop {r['loop_ms']:.3f} ms ({r['speedup']:.1f}x), "
                f"{r['fused_weight_GB_s']:.0f} GB/s of touched experts, "
                f"{r['fused_TFLOP_s']:.1f} TFLOP/s",
                flush=True,
            )
    return rows


# --------------------------------------------------------------------------- decode


def build_random_model(hf_values: dict, directory: Path):
    """The engine's model of these config values, random bf16 weights drawn on the GPU (norms
    ones), nothing written but config.json (which the engine reads for the path)."""
    import transformers

    from compile_engine.models.loader import LoadedModel, ModelSource, build_model
    from compile_engine.models.registry import model_class

    hf = transformers.Qwen3MoeConfig(**hf_values)
    hf.save_pretrained(str(directory))
    config = model_class(hf.architectures).config_from_hf(hf)
    model = build_model(config, torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return LoadedModel(model, config, hf, ModelSource(directory, "hf"), torch.bfloat16)


def active_bytes_per_step(loaded, batch: int) -> int:
    """Dense weights (the embedding table aside: a step gathers B rows) plus the experts a
    batch of `batch` tokens is expected to touch in every sparse layer."""
    from compile_engine.models.moe import StackedExperts

    total = 0
    expert_params = set()
    for module in loaded.model.modules():
        if isinstance(module, StackedExperts):
            expert_params |= {id(module.w13), id(module.w2)}
            per_expert = (module.w13[0].numel() + module.w2[0].numel()) * 2
            cfg = loaded.config
            busy = expected_busy_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)
            total += int(busy * per_expert)
    for name, param in loaded.model.named_parameters():
        if id(param) in expert_params or name.endswith("embed_tokens.weight"):
            continue
        total += param.numel() * param.element_size()
    return total


def bench_decode(
    num_layers: int, batch_sizes: list[int], input_len: int, output_len: int, passes: str | None
) -> dict:
    from compile_engine.benchmarks.common import engine_settings
    from compile_engine.benchmarks.latency import bench_latency
    from compile_engine.runtime.engine import EngineConfig, LLMEngine

    values = {**QWEN3_30B_A3B, "num_hidden_layers": num_layers}
    directory = Path(tempfile.mkdtemp(prefix="ce-qwen3-moe-"))
    t0 = time.perf_counter()
    loaded = build_random_model(values, directory)
    build_s = time.perf_counter() - t0
    config = EngineConfig(
        model=str(directory),
        dtype="bfloat16",
        target="h100",
        max_num_seqs=max(batch_sizes),
        max_model_len=input_len + output_len + 16,
        passes=passes,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config, loaded=loaded)
    ready_s = time.perf_counter() - t0
    llm = types.SimpleNamespace(engine=engine)
    payload = bench_latency(llm, batch_sizes=batch_sizes, input_len=input_len,
                            output_len=output_len, num_iters=2, num_warmup=1)  # fmt: skip
    for b, row in payload["batches"].items():
        step_bytes = active_bytes_per_step(loaded, int(b))
        row["active_bytes_per_step"] = step_bytes
        row["active_roofline_tok_s"] = int(b) * H200_COPY_RATE / step_bytes
        row["active_roofline_pct"] = 100 * row["decode_tok_s"] / row["active_roofline_tok_s"]
        print(
            f"decode batch {b}: {row['decode_tok_s']:.1f} tok/s, {row['ms_per_step']:.2f} ms/step"
            f" ({row['active_roofline_pct']:.0f}% of the active-weight roofline)",
            flush=True,
        )
    payload.update(
        model=f"Qwen3-30B-A3B shape, random bf16 weights built in GPU memory, {num_layers} of 48 "
        "layers",
        num_layers=num_layers,
        full_depth=num_layers == 48,
        total_params=sum(p.numel() for p in loaded.model.parameters()),
        build_s=build_s,
        engine_ready_s=ready_s,
        engine=engine_settings(llm),
    )
    return payload


# --------------------------------------------------------------------------- report


def render_details(result: dict) -> list[str]:
    """Markdown lines for docs/performance.md from one `moe` result."""
    lines: list[str] = []
    kernel = result.get("kernel") or []
    if kernel:
        lines += [
            "| experts | H | I | top-k | tokens | fused ms | per-expert loop ms | speedup "
            "| GB/s (touched experts) | TFLOP/s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in kernel:
            lines.append(
                f"| {r['experts']} | {r['hidden']} | {r['inter']} | {r['top_k']} | {r['tokens']} "
                f"| {r['fused_ms']:.3f} | {r['loop_ms']:.3f} | {r['speedup']:.1f}x "
                f"| {r['fused_weight_GB_s']:.0f} | {r['fused_TFLOP_s']:.1f} |"
            )
    decode = result.get("decode")
    if decode:
        if lines:
            lines.append("")
        lines.append(f"Decode, {decode['model']} (prompt {decode['input_len']}, "
                     f"{decode['output_len']} new tokens):")  # fmt: skip
        lines += ["", "| batch | tok/s | ms/step | % of active-weight roofline |"]
        lines.append("|---|---|---|---|")
        for b, row in decode["batches"].items():
            lines.append(
                f"| {b} | {row['decode_tok_s']:.1f} | {row['ms_per_step']:.2f} "
                f"| {row['active_roofline_pct']:.0f}% |"
            )
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench moe", description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["kernel", "decode", "all"], default="all")
    p.add_argument("--experts", default="128,64", help="expert counts of the kernel shapes")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", default="1,64,256,2048")
    p.add_argument("--layers", type=int, default=48, help="decoder layers of the decode model")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--passes", default=None, help="+name,-name relative to the defaults")
    p.add_argument("--results-dir", default=str(DEFAULT_DIRECTORY))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench moe: needs a CUDA device", file=sys.stderr)
        return 2
    payload: dict = {"benchmark": "moe"}
    if args.part in ("kernel", "all"):
        shapes = [(int(e), args.hidden, args.inter, args.top_k) for e in args.experts.split(",")]
        tokens = [int(t) for t in args.tokens.split(",")]
        payload["kernel"] = bench_kernel(shapes, tokens)
    if args.part in ("decode", "all"):
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        decode = bench_decode(args.layers, batch_sizes, args.input_len, args.output_len,
                              args.passes)  # fmt: skip
        payload["decode"] = decode
        for b in batch_sizes:
            payload[f"moe_decode_bs{b}_tok_s"] = decode["batches"][str(b)]["decode_tok_s"]
    # One file per part run alone (same commit and device would overwrite); kind stays "moe".
    name = "moe" if args.part == "all" else f"moe-{args.part}"
    path = write_result(name, payload, directory=Path(args.results_dir))
    print("\n".join(render_details(payload)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
