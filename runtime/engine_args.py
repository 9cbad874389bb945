"""The engine's command-line flags (vLLM's names), shared by every command that runs a model:
`compile-engine generate` and `serve`, and the benchmarks. Torch-free: the CLI parses its
arguments before the heavy imports."""

from __future__ import annotations

import argparse

from compile_engine.runtime.reasoning_parsers import REASONING_PARSERS


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the LLM(...) settings, shared by every subcommand that runs a model."""
    parser.add_argument("model", help="HF directory, .gguf file, alias (smollm2-135m)")
    add_engine_options(parser)


def add_engine_options(
    parser: argparse.ArgumentParser,
    *,
    max_num_seqs: int | None = 256,
    max_num_batched_tokens: int = 2048,
) -> None:
    """The LLM(...) settings as flags, with these defaults for the step's size (the
    benchmarks take their own)."""
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--target", default=None, choices=["cpu", "h100"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens)
    parser.add_argument(
        "--max-cuda-graph-tokens",
        type=int,
        default=None,
        help="largest step (tokens) that replays a CUDA graph on h100 (default 2048); give "
        "`build` the same, so that the artifact holds those sizes' kernels",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of shared prompt prefixes (on by default)",
    )
    # The spelling of earlier releases, kept working.
    parser.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="the share of the GPU's memory the engine may use, weights, activations and KV "
        "cache together (default 0.9); the KV pool gets what is left (h100; ignored on cpu)",
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--passes", default=None, help="+name,-name relative to the defaults")
    parser.add_argument(
        "--kernel-config",
        default=None,
        help="our kernels' launch choices as JSON, e.g. '{\"pdl\": false}' "
        "(kernels_generated/tuning.py; default: the tuned defaults)",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="fp8: quantize a bf16/fp16 checkpoint's linear layers to FP8 at load (per-channel "
        "weights, dynamic per-token activations, as vLLM's); FP8 checkpoints need no flag",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="the KV cache's element type (vLLM's): auto, the model dtype (an artifact's own); "
        "fp8 (= fp8_e4m3), scaled by the checkpoint's k/v scales or 1.0: twice the blocks",
    )
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split the model's thinking into reasoning_content; a structured-output grammar "
        "applies after it (vLLM's names)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="shard the model over this many ranks, one process each (default 1)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size > 1: spread MoE experts whole over the ranks",
    )
    parser.add_argument(
        "--distributed-timeout",
        type=float,
        default=20.0,
        help="seconds before a rank that has not finished a step is declared hung (default 20)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help="speculative decoding as JSON (vLLM's), e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        'or a draft_model with "model" (runtime/speculative_config.py)',
    )
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="step synchronously instead of preparing step N+1 while step N runs",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        target=args.target,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_cuda_graph_tokens=args.max_cuda_graph_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        passes=args.passes,
        kernel_config=args.kernel_config,
        quantization=getattr(args, "quantization", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        cuda_graphs=not args.no_cuda_graphs,
        async_scheduling=not getattr(args, "no_async_scheduling", False),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        distributed_timeout_s=args.distributed_timeout,
        speculative_config=getattr(args, "speculative_config", None),
    )
