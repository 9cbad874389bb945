"""`compile-engine bench <command> ...`, and later `compile-engine bench <command> ...`.

The runtime CLI mounts this by passing the words after `bench` to `main(argv)`. Commands are
imported only when chosen, so `render` and `make-model` never load the engine.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "latency": (
        "compile_engine.benchmarks.latency",
        "decode tok/s per batch size vs the bandwidth roofline",
    ),
    "throughput": (
        "compile_engine.benchmarks.throughput",
        "offline N requests through LLM.generate",
    ),
    "speculative": (
        "compile_engine.benchmarks.speculative",
        "tok/s with and without speculative decoding: the rewrite/summarise/code-edit "
        "workload, or --replay's all/none-accepted bounds",
    ),
    "serve": (
        "compile_engine.benchmarks.serve",
        "TTFT/TPOT/ITL/E2EL and tok/s against an OpenAI server",
    ),
    "prefix": (
        "compile_engine.benchmarks.prefix",
        "TTFT with a shared prefix, caching on vs off; --sweep: step time vs tokens a step",
    ),
    "structured": (
        "compile_engine.benchmarks.structured",
        "output tok/s with every request under a JSON schema vs none; mask and compile times",
    ),
    "soak": (
        "compile_engine.benchmarks.soak",
        "minutes of many streaming, hanging-up, slow and hostile clients against serve",
    ),
    "kv-waste": ("compile_engine.benchmarks.kv_waste", "allocated-but-unused KV slots under load"),
    "kernel": (
        "compile_engine.benchmarks.kernel_harness",
        "one kernel: check vs its reference, bench, --tune its table",
    ),
    "fusions": (
        "compile_engine.benchmarks.fusions",
        "norm/rotary/silu kernels vs Inductor's fusion, per T",
    ),
    "breakdown": (
        "compile_engine.benchmarks.breakdown",
        "where one decode step's time goes, host vs device",
    ),
    "startup": (
        "compile_engine.benchmarks.startup",
        "cold build vs a fresh process ready from the artifact",
    ),
    "moe": (
        "compile_engine.benchmarks.moe",
        "fused MoE kernel vs a per-expert loop; MoE model decode",
    ),
    "mla": (
        "compile_engine.benchmarks.mla",
        "MLA absorbed kernel vs naive reference; KV bytes; DeepSeek decode",
    ),
    "paged-attention": (
        "compile_engine.benchmarks.paged_attention",
        "the Triton kernel vs gather+SDPA, GB/s",
    ),
    "gemm": (
        "compile_engine.benchmarks.gemm",
        "decode-size GEMMs: cuBLAS vs the Triton skinny GEMM sweep",
    ),
    "fp8-gemm": (
        "compile_engine.benchmarks.fp8_gemm",
        "the FP8 skinny GEMM's config sweep, and _scaled_mm above 16 rows",
    ),
    "int-gemm": (
        "compile_engine.benchmarks.int_gemm",
        "the integer weight-only GEMM's config sweep (int4 / int8, groups of 128)",
    ),
    "quant-accuracy": (
        "compile_engine.benchmarks.quant_accuracy",
        "a quantized model's perplexity and top-1 agreement vs its dtype",
    ),
    "gemm-norm": (
        "compile_engine.benchmarks.gemm_norm",
        "the fused add_rms_norm + skinny GEMM vs unfused",
    ),
    "offline-floor": (
        "compile_engine.benchmarks.offline_floor",
        "the offline row's kernels alone, least time",
    ),
    "make-model": (
        "compile_engine.benchmarks.make_model",
        "write a random-weight safetensors model",
    ),
    "render": (
        "compile_engine.benchmarks.render",
        "docs/performance.md from benchmarks/results/*.json",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: bench <command> [options]  (<command> --help for its options)", ""]
    lines += [f"  {name:<{width}}  {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"bench: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest)
