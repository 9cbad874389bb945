"""`bench throughput`: offline, N requests at once through LLM.generate.

The shape of vLLM's `bench throughput` with its random dataset: N random token-id prompts of
--input-len tokens and --output-len new tokens each (fixed, or uniform within +-range-ratio),
ignore_eos so every request produces exactly its output length, all handed to one generate call.
Output tok/s is generated tokens over the wall time of that call; total tok/s adds the prompt
tokens. A short warmup generate runs first so first-call costs (allocator, lazy compilation)
are not charged to the measurement.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from benchmarks.common import (
    add_engine_flags,
    engine_kwargs,
    engine_settings,
    model_summary,
    random_prompts,
    sampled_lengths,
    timed,
)
from benchmarks.results import print_table, write_result
from benchmarks.telemetry import GpuSampler
from runtime.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS


def bench_throughput(
    llm,
    *,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    num_warmup_requests: int = 16,
    warmup_output_len: int = 8,
    seed: int = 0,
) -> dict:
    from runtime import SamplingParams

    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    device = llm.engine.config.device
    if num_warmup_requests:
        warm = random_prompts(num_warmup_requests, input_len, vocab, rng)
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=warmup_output_len))
    in_lens = sampled_lengths(num_requests, input_len, range_ratio, rng)
    out_lens = sampled_lengths(num_requests, output_len, range_ratio, rng)
    prompts = random_prompts(num_requests, in_lens, vocab, rng)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    preempted_before = llm.engine.stats().num_preemptions_total
    with GpuSampler(device) as gpu, timed(device) as t:
        outputs = llm.generate(prompts, params)
    elapsed = t[0]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(in_lens)
    return {
        "benchmark": "throughput",
        "num_requests": num_requests,
        "input_len": input_len,
        "output_len": output_len,
        "range_ratio": range_ratio,
        "num_warmup_requests": num_warmup_requests,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": num_requests / elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (in_tokens + out_tokens) / elapsed,
        "preemptions": llm.engine.stats().num_preemptions_total - preempted_before,
        "offline_output_tok_s": out_tokens / elapsed,
        "gpu": gpu.summary,  # clocks and power through the timed run
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench throughput", description=__doc__.splitlines()[0])
    # LLM's own default budget: this is the offline API's benchmark.
    add_engine_flags(p, max_num_seqs=256, max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument(
        "--range-ratio", type=float, default=0.0, help="0: fixed lengths; r: uniform +-r"
    )
    p.add_argument("--num-warmup-requests", type=int, default=16)
    p.add_argument("--name", default="throughput", help="result file name prefix")
    return p


def main(argv: list[str] | None = None) -> int:
    from runtime import LLM

    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    init_s = time.perf_counter() - t0
    payload = bench_throughput(
        llm,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_warmup_requests=args.num_warmup_requests,
        seed=args.seed,
    )
    payload.update(
        model=args.model,
        model_config=model_summary(llm),
        engine=engine_settings(llm),
        llm_init_s=init_s,
    )
    path = write_result(args.name, payload, args.results_dir, device=llm.engine.config.device.type)
    print_table(
        [
            ("requests", f"{args.num_requests} x ({args.input_len} in / {args.output_len} out)"),
            ("elapsed s", payload["elapsed_s"]),
            ("requests/s", payload["requests_per_s"]),
            ("output tok/s", payload["output_tok_s"]),
            ("total tok/s", payload["total_tok_s"]),
            ("preemptions", payload["preemptions"]),
        ],
        title="throughput (offline, LLM.generate)",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
