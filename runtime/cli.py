"""`compile-engine`: generate, serve (and, as they land, build / inspect / passes / bench)."""

from __future__ import annotations

import argparse
import logging
import sys


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The LLM(...) settings, shared by every subcommand that runs a model."""
    parser.add_argument("model", help="HF directory, .gguf file, alias (smollm2-135m)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--target", default=None, choices=["cpu", "h100"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        target=args.target,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
    )


def _generate(args: argparse.Namespace) -> int:
    from runtime.engine import EngineConfig, LLMEngine
    from runtime.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, **engine_kwargs(args)))
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
    from runtime import server

    return server.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compile-engine", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    add_engine_arguments(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-waiting", type=int, default=1024)
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from models.errors import ModelError
    from runtime.engine import EngineConfigError
    from runtime.sampling_params import InvalidSamplingParams

    try:
        return args.func(args)
    except (ModelError, EngineConfigError, InvalidSamplingParams) as exc:
        print(f"compile-engine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
