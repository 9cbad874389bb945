"""`compile-engine`: generate, serve, build, inspect, passes, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from compile_engine.runtime import bytecode_cache
from compile_engine.runtime.engine_args import add_engine_arguments, engine_kwargs
from compile_engine.runtime.tool_parsers import TOOL_PARSERS


def _generate(args: argparse.Namespace) -> int:
    from compile_engine.runtime.engine import EngineConfig
    from compile_engine.runtime.progress import start_engine
    from compile_engine.runtime.sampling_params import SamplingParams

    # One request: the default KV pool is sized for one sequence of max_model_len rather than
    # max_num_seqs of them (on CPU that pool is 4 GiB, zero-filled at start: ~10 s of page
    # faults on a 2-core machine). --num-kv-blocks still sets it exactly.
    config = EngineConfig(model=args.model, kv_pool_sequences=1, **engine_kwargs(args))
    engine = start_engine(config)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed if args.temperature > 0 else None,
    )
    if args.chat:
        tok = engine.tokenizer
        messages = [{"role": "user", "content": args.prompt}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
    else:
        prompt = args.prompt
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from compile_engine.runtime import server

    return server.main(args)


def _build(args: argparse.Namespace) -> int:
    from compile_engine.runtime.progress import StartupProgress

    def progress(stage: str, seconds: float) -> None:
        print(f"[build] {stage:<13} {seconds:7.1f} s", flush=True)

    out = args.out or f"artifacts/{Path(args.model).name.removesuffix('.gguf')}-{args.target}"
    steps = StartupProgress("build", sys.stdout)
    try:
        manifest = _build_artifact(args, out, progress, steps)
    finally:
        steps.close()
    c = manifest.compile
    print(
        f"[build] wrote {out}: {c['num_pieces']} pieces ({c['num_attention_pieces']} attention), "
        f"{c['num_compiled_pieces']} compiled, {len(manifest.kernels)} kernel files"
    )
    return 0


def _build_artifact(args: argparse.Namespace, out: str, progress, steps):
    from compile_engine.compiler.build import build_artifact
    from compile_engine.kernels_generated.tuning import KernelConfig
    from compile_engine.runtime.activation_profile import build_step
    from compile_engine.runtime.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS

    if args.tensor_parallel_size < 1:
        raise SystemExit(f"--tensor-parallel-size {args.tensor_parallel_size}: must be >= 1")
    if args.enable_expert_parallel and args.tensor_parallel_size < 2:
        raise SystemExit("--enable-expert-parallel needs --tensor-parallel-size >= 2")
    if args.tensor_parallel_size > 1:
        from compile_engine.runtime.parallel import build_parallel

        # No activation profile: it measures one rank's forward alone, which a sharded model
        # cannot run (and serving with tensor parallelism on a GPU takes --num-kv-blocks).
        return build_parallel(
            args.model,
            out,
            tensor_parallel_size=args.tensor_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            shard_settings=dict(
                target=args.target,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                block_size=args.block_size,
                passes=args.passes,
                kernel_config=KernelConfig.coerce(args.kernel_config).to_dict(),
            ),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_cuda_graph_tokens=args.max_cuda_graph_tokens,
            progress=progress,
            steps=steps,
        )
    return build_artifact(
        args.model,
        out,
        target=args.target,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_cuda_graph_tokens=args.max_cuda_graph_tokens,
        block_size=args.block_size,
        passes=args.passes,
        kernel_config=KernelConfig.coerce(args.kernel_config),
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        progress=progress,
        steps=steps,
        # The KV pool's activation reserve for the step sizes of `serve` and of `LLM` with
        # these settings, so that a first start finds it measured.
        extra_steps={
            "activation_profile": build_step(
                [
                    (args.max_num_batched_tokens, args.max_num_seqs),
                    (OFFLINE_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs),
                ]
            )
        },
    )


def _prefill_graphs(manifest) -> str:
    """Which capture sizes also get a prefill graph (compiler/cuda_graphs.py `prefill_rows`),
    from the artifact's passes, kernel config and max_num_seqs."""
    from compile_engine.compiler.cuda_graphs import prefill_rows

    counts = {p["name"]: p["matches"] for p in manifest.passes}
    config = manifest.kernel()
    max_num_seqs = manifest.engine_args.get("max_num_seqs")
    if max_num_seqs is None:
        return "prefill graphs: max_num_seqs not recorded"
    rows = prefill_rows(counts, config, manifest.capture_sizes, max_num_seqs)
    if not rows:
        return "prefill graphs: none (every size's shapes already pick the kernel a chunk needs)"
    spans = ", ".join(f"{size} ({slots} slots)" for size, slots in rows.items())
    return f"prefill graphs (tiled attention, fewer sequence slots) beside sizes {spans}"


def _inspect(args: argparse.Namespace) -> int:
    from compile_engine.compiler.artifact import Manifest

    manifest = Manifest.read(Path(args.artifact))
    data = json.loads((Path(args.artifact) / "manifest.json").read_text())
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    c = manifest.compile
    print(f"artifact   {args.artifact}  (cache key {data['cache_key']})")
    print(f"model      {manifest.model_path} [{manifest.architecture}, {manifest.dtype}]")
    print(f"target     {manifest.target} on {manifest.device}")
    kv_dtype = manifest.kv_cache_dtype or manifest.dtype  # older artifacts: the model dtype
    kv_setting = manifest.engine_args.get("kv_cache_dtype", "auto")
    print(f"kv cache   {kv_dtype} (kv_cache_dtype {kv_setting})")
    print("versions   " + ", ".join(f"{k} {v}" for k, v in manifest.versions.items()))
    print(
        "passes     " + ", ".join(f"{p['name']} ({p['matches']} matches)" for p in manifest.passes)
    )
    print(
        f"pieces     {c['num_pieces']} ({c['num_attention_pieces']} attention, "
        f"{c['num_compiled_pieces']} compiled by Inductor)"
    )
    for piece in c["pieces"]:
        print(f"  piece {piece['key']}: {piece['nodes']} nodes, used {piece['reused_by'] + 1}x")
    sizes = manifest.capture_sizes
    print(f"graphs     {f'captured at serve start for {sizes}' if sizes else 'none (CPU)'}")
    if sizes:
        print(f"           {_prefill_graphs(manifest)}")
    print(f"kernels    {len(manifest.kernels)} files under kernels/")
    tuning = manifest.kernel_config
    settings = tuning.get("settings", {})
    scalars = ", ".join(f"{k} {v}" for k, v in settings.items() if k not in ("attention", "tables"))
    print(f"tuning     key {tuning.get('key')}: {scalars}")
    for kernel, table in tuning.get("tables", {}).items():
        print(f"  table {kernel}: {table['file']} ({table['sha256']})")
    quant = manifest.quantization
    if quant:
        print(
            f"quantized  {quant['method']} {quant['scheme']}: {len(quant['layers'])} layers "
            f"(weight scales per {quant['weight_scale']}, activations {quant['activation']})"
        )
    print("timings    " + ", ".join(f"{k} {v}" for k, v in manifest.timings.items()))
    return 0


def _passes(args: argparse.Namespace) -> int:
    from compile_engine.passes.registry import REGISTRY, load_all

    load_all()
    rows = [
        {
            "name": p.name,
            "description": p.description,
            "targets": list(p.targets),
            "dtypes": [str(d).removeprefix("torch.") for d in p.dtypes],
            "default": p.default_on,
            "uuid": p.uuid(),
        }
        for p in REGISTRY.values()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            flag = "on " if r["default"] else "off"
            print(f"{r['name']:<24} {flag} {','.join(r['targets']):<9} {r['description']}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from compile_engine.benchmarks.cli import main as bench_main

    return bench_main(args.bench_args)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _logging_options(suppress: bool) -> argparse.ArgumentParser:
    """-v and --log-level, taken before the subcommand and after it alike (a subcommand's copy
    leaves the value alone unless given, so the earlier one stands)."""
    options = argparse.ArgumentParser(add_help=False)
    default = argparse.SUPPRESS if suppress else None
    options.add_argument(
        "-v", "--verbose", action="store_true", default=default or False, help="--log-level info"
    )
    options.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        type=str.lower,
        default=default,
        help="how much to log (default warning, or $COMPILE_ENGINE_LOG_LEVEL)",
    )
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compile-engine", description=__doc__, parents=[_logging_options(suppress=False)]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    logging_options = _logging_options(suppress=True)

    def add_parser(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[logging_options], **kwargs)

    gen = add_parser("generate", help="generate text for one prompt, streamed to stdout")
    add_engine_arguments(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.set_defaults(func=_generate)

    serve = add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--api-key", default=None)
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the names the model answers to (default: MODEL); responses carry the first",
    )
    serve.add_argument("--max-waiting", type=int, default=1024)
    # Connection limits (docs/server.md, "Limits"); vLLM's name for the keep-alive one.
    serve.add_argument(
        "--header-timeout",
        type=_seconds,
        default=10.0,
        help="seconds a client has to send a request's headers (default 10)",
    )
    serve.add_argument(
        "--body-timeout",
        type=_seconds,
        default=30.0,
        help="seconds a client has to send a request's body after its headers (default 30)",
    )
    serve.add_argument(
        "--timeout-keep-alive",
        type=_seconds,
        default=5.0,
        help="seconds an idle keep-alive connection stays open (default 5)",
    )
    serve.add_argument(
        "--max-connections",
        type=_positive_int,
        default=None,
        help="open connections beyond which new ones get 503 (default 1024, or fewer if the "
        "open-file limit leaves fewer)",
    )
    serve.add_argument(
        "--tokenizer-workers",
        type=_positive_int,
        default=2,
        help="threads that tokenize requests, each with its own tokenizer copy (default 2)",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="the model's tool-call format, which tool_choice auto parses (vLLM's names)",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let requests with tools leave the choice to the model (needs --tool-call-parser)",
    )
    serve.set_defaults(func=_serve)

    build = add_parser("build", help="compile a model into an artifact directory")
    build.add_argument("model", help="HF directory, .gguf file, alias (smollm2-135m)")
    build.add_argument("--target", default="cpu", choices=["cpu", "h100"])
    build.add_argument("--out", default=None, help="artifact directory (default artifacts/...)")
    build.add_argument("--dtype", default="auto")
    build.add_argument("--max-model-len", type=int, default=None)
    build.add_argument("--max-num-seqs", type=int, default=256)
    build.add_argument("--max-num-batched-tokens", type=int, default=2048)
    build.add_argument(
        "--max-cuda-graph-tokens",
        type=int,
        default=None,
        help="largest CUDA-graph size serve will capture (default 2048): its kernels compiled here",
    )
    build.add_argument("--block-size", type=int, default=16)
    build.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="compile each of this many ranks' shards (one process each); serve the artifact "
        "with the same --tensor-parallel-size",
    )
    build.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size > 1: MoE experts spread whole over the ranks",
    )
    build.add_argument("--passes", default=None, help="+name,-name relative to the defaults")
    build.add_argument(
        "--kernel-config", default=None, help="our kernels' launch choices as JSON (see serve)"
    )
    build.add_argument(
        "--quantization", default=None, choices=["fp8"], help="online FP8 (see serve)"
    )
    build.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="the KV cache's element type the graph is traced over (see serve)",
    )
    build.set_defaults(func=_build)

    inspect = add_parser("inspect", help="describe an artifact")
    inspect.add_argument("artifact")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=_inspect)

    # Everything after `bench` is the benchmarks' own command line (main() splits it off, so
    # that `bench --help` and `bench <command> --help` reach their parsers).
    bench = sub.add_parser(
        "bench",
        help="benchmarks (`bench --help` lists them): latency, throughput, serve, breakdown, "
        "startup, kv-waste, soak, fusions, moe, mla, paged-attention, make-model, render",
        add_help=False,
    )
    bench.set_defaults(func=_bench, bench_args=[])

    passes = add_parser("passes", help="list the registered compiler passes")
    passes.add_argument("--json", action="store_true")
    passes.set_defaults(func=_passes)
    return parser


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0 to 65535)")
    return port


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds > 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


def _log_level(args: argparse.Namespace) -> int:
    if args.log_level:
        return getattr(logging, args.log_level.upper())
    if args.verbose:
        return logging.INFO
    name = os.environ.get("COMPILE_ENGINE_LOG_LEVEL", "warning").lower()
    if name not in LOG_LEVELS:
        raise SystemExit(
            f"compile-engine: error: COMPILE_ENGINE_LOG_LEVEL={name!r}: use one of "
            f"{', '.join(LOG_LEVELS)}"
        )
    return getattr(logging, name.upper())


def _split_bench(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the engine CLI's words, the benchmarks' words): what follows a `bench` that is the
    subcommand (only options before it) belongs to the benchmarks' parser."""
    for i, word in enumerate(argv):
        if not word.startswith("-"):
            return (argv[: i + 1], argv[i + 1 :]) if word == "bench" else (argv, [])
    return argv, []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, bench_args = _split_bench(argv)
    args = build_parser().parse_args(ours)
    if args.command == "bench":
        args.bench_args = bench_args
    logging.basicConfig(
        level=_log_level(args), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Before torch and the compiler are imported: an install without bytecode would compile
    # their ~2,700 modules from source at every start (runtime/bytecode_cache.py).
    if (prefix := bytecode_cache.enable()) is not None:
        logging.getLogger(__name__).info("Python bytecode cached under %s", prefix)
    from compile_engine.compiler.artifact import ArtifactError
    from compile_engine.compiler.config import CompileConfigError
    from compile_engine.kernels_generated.tuning import KernelConfigError
    from compile_engine.models.errors import ModelError
    from compile_engine.passes.registry import UnknownPassError
    from compile_engine.runtime.engine import EngineConfigError
    from compile_engine.runtime.sampling_params import InvalidSamplingParams
    from compile_engine.runtime.server import ServerError

    user_errors = (
        ModelError,
        EngineConfigError,
        InvalidSamplingParams,
        ArtifactError,
        CompileConfigError,
        UnknownPassError,
        KernelConfigError,
        ServerError,
        FileExistsError,
    )
    try:
        return args.func(args)
    except user_errors as exc:
        # One line, no traceback: the message says what to change. Usage errors (a flag
        # argparse refuses) exit 2 before this; a setting that cannot work exits 1.
        print(f"compile-engine: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
