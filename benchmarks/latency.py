"""`bench latency`: decode speed at fixed batch sizes, against the bandwidth roofline.

For each batch size B: B random token-id prompts of --input-len, greedy, ignore_eos,
--output-len new tokens each, all submitted at once. One warmup run of the same shape, then
--num-iters measured runs. The clock for decode starts when every request holds its first token
(prefill done, device drained) and stops when the last finishes, so

    decode tok/s = tokens produced after that point / decode seconds  (= B * (output_len - 1) / s)

and prefill is reported on its own. Decode at these sizes is bound by memory bandwidth: each
step reads every weight once (the embedding table aside, which only gathers B rows) plus each
request's KV so far. The roofline is B tokens per (those bytes / copy rate); the copy rate is the
H200's measured 4.26e12 B/s on CUDA (BRIEF.md) and is measured here on a CPU.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time

import torch

from benchmarks.common import (
    add_engine_flags,
    engine_kwargs,
    engine_settings,
    model_summary,
    random_prompts,
    synchronize,
    timed,
)
from benchmarks.results import write_result

H200_COPY_RATE = 4.26e12  # B/s, copy read+write, measured on the H200 on 2026-11-29


def measure_copy_rate(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes moved (read + write) per second by a large device-to-device copy, best of repeats."""
    if nbytes is None:
        nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        with timed(device) as t:
            dst.copy_(src)
        best = min(best, t[0])
    return 2 * nbytes / best


def weight_bytes_per_step(llm) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied
    embedding table, of which a step gathers only its batch's rows."""
    model = llm.engine.loaded.model
    tied = llm.engine.model_config.tie_word_embeddings
    total = 0
    for name, p in model.named_parameters():  # tied parameters are listed once
        if name.endswith("embed_tokens.weight") and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(llm) -> int:
    """From the model's own cache layout (K and V per head, or an MLA latent)."""
    loaded = llm.engine.loaded
    element = torch.empty((), dtype=loaded.dtype).element_size()
    per_layer = math.prod(loaded.model.kv_cache_shape(1, 1))
    return loaded.config.num_layers * per_layer * element


def run_once(llm, prompts: list[list[int]], params, device: torch.device) -> dict:
    """Drive the engine step by step; split prefill from decode at the first step after which
    every request holds a token."""
    from runtime.engine import RequestOutput

    engine = llm.engine
    preempted_before = engine.stats().num_preemptions_total
    remaining_first = set()
    synchronize(device)
    t_start = time.perf_counter()
    for prompt in prompts:
        rid = engine.next_request_id()
        engine.add_request(rid, prompt, params)
        remaining_first.add(rid)
    t_decode = None
    decode_tokens = decode_steps = 0
    batch_sizes: list[int] = []
    step_s: list[float] = []
    while engine.has_unfinished_requests():
        decoding = t_decode is not None
        if decoding:
            batch_sizes.append(len(engine.scheduler.running))
        t0 = time.perf_counter()
        outs: list[RequestOutput] = engine.step()
        if not decoding:
            for out in outs:
                if out.outputs[0].token_ids:
                    remaining_first.discard(out.request_id)
            if not remaining_first:
                synchronize(device)
                t_decode = time.perf_counter()
            continue
        # The runner returns token ids to the host each step, so a step's host time is its
        # device time too; no extra synchronize that would hide future overlap.
        step_s.append(time.perf_counter() - t0)
        decode_steps += 1
        decode_tokens += sum(len(c.delta_token_ids) for o in outs for c in o.outputs)
    synchronize(device)
    t_end = time.perf_counter()
    prefill_s = t_decode - t_start
    decode_s = t_end - t_decode
    return {
        "prefill_s": prefill_s,
        "prefill_tok_s": sum(map(len, prompts)) / prefill_s,
        "decode_s": decode_s,
        "decode_steps": decode_steps,
        "decode_tokens": decode_tokens,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "ms_per_step": 1e3 * decode_s / max(decode_steps, 1),
        "median_step_ms": 1e3 * statistics.median(step_s) if step_s else 0.0,
        "min_decode_batch": min(batch_sizes, default=0),
        "max_decode_batch": max(batch_sizes, default=0),
        "preemptions": engine.stats().num_preemptions_total - preempted_before,
        "e2e_s": t_end - t_start,
    }


def bench_latency(
    llm,
    *,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    num_iters: int = 3,
    num_warmup: int = 1,
    copy_rate: float | None = None,
    seed: int = 0,
) -> dict:
    """Run every batch size; return the payload for write_result."""
    from runtime import SamplingParams

    if output_len < 2:
        raise ValueError("--output-len must be >= 2: decode starts after the first token")
    device = llm.engine.config.device
    if copy_rate is None:
        copy_rate = H200_COPY_RATE if device.type == "cuda" else measure_copy_rate(device)
        source = "BRIEF.md (H200)" if device.type == "cuda" else "measured"
    else:
        source = "given"
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    weights = weight_bytes_per_step(llm)
    kv_token = kv_bytes_per_token(llm)
    # Keys a decode step reads, averaged over decode steps j = 1..output_len-1 (input_len + j).
    mean_context = input_len + output_len / 2
    payload: dict = {
        "benchmark": "latency",
        "input_len": input_len,
        "output_len": output_len,
        "num_iters": num_iters,
        "num_warmup": num_warmup,
        "copy_rate_B_s": copy_rate,
        "copy_rate_source": source,
        "weight_bytes_per_step": weights,
        "kv_bytes_per_token": kv_token,
        "batches": {},
    }
    for b in batch_sizes:
        for _ in range(num_warmup):
            run_once(llm, random_prompts(b, input_len, vocab, rng), params, device)
        runs = [
            run_once(llm, random_prompts(b, input_len, vocab, rng), params, device)
            for _ in range(num_iters)
        ]
        tok_s = statistics.median(r["decode_tok_s"] for r in runs)
        step_bytes = weights + b * mean_context * kv_token
        roofline = b * copy_rate / step_bytes
        payload["batches"][str(b)] = {
            "decode_tok_s": tok_s,
            "ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
            "prefill_s": statistics.median(r["prefill_s"] for r in runs),
            "bytes_per_step": step_bytes,
            "roofline_tok_s": roofline,
            "roofline_pct": 100 * tok_s / roofline,
            "runs": runs,
        }
        payload[f"decode_bs{b}_tok_s"] = tok_s
    return payload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench latency", description=__doc__.splitlines()[0])
    add_engine_flags(p, max_num_seqs=None)
    p.add_argument("--batch-sizes", default="1,64,256", help="comma-separated")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3, help="measured runs; the median counts")
    p.add_argument("--num-warmup", type=int, default=1)
    p.add_argument(
        "--copy-rate",
        default=None,
        help="bytes/s for the roofline, or 'measure'; default 4.26e12 on CUDA, measured on CPU",
    )
    p.add_argument("--name", default="latency", help="result file name prefix")
    return p


def main(argv: list[str] | None = None) -> int:
    from runtime import LLM

    args = build_parser().parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if args.max_num_seqs is None:
        args.max_num_seqs = max(batch_sizes)
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    init_s = time.perf_counter() - t0
    copy_rate = None
    if args.copy_rate == "measure":
        copy_rate = measure_copy_rate(llm.engine.config.device)
    elif args.copy_rate is not None:
        copy_rate = float(args.copy_rate)
    payload = bench_latency(
        llm,
        batch_sizes=batch_sizes,
        input_len=args.input_len,
        output_len=args.output_len,
        num_iters=args.num_iters,
        num_warmup=args.num_warmup,
        copy_rate=copy_rate,
        seed=args.seed,
    )
    if args.copy_rate == "measure":
        payload["copy_rate_source"] = "measured"
    payload.update(model=args.model, model_config=model_summary(llm), engine=engine_settings(llm))
    payload["llm_init_s"] = init_s
    path = write_result(args.name, payload, args.results_dir, device=llm.engine.config.device.type)
    print_latency(payload)
    print(f"wrote {path}")
    return 0


def print_latency(payload: dict) -> None:
    print(
        f"latency: input {payload['input_len']}, output {payload['output_len']}, "
        f"copy rate {payload['copy_rate_B_s'] / 1e9:,.0f} GB/s ({payload['copy_rate_source']})"
    )
    print(f"  {'batch':>6} {'decode tok/s':>13} {'ms/step':>9} {'roofline':>9} {'prefill s':>10}")
    for b, r in payload["batches"].items():
        print(
            f"  {b:>6} {r['decode_tok_s']:>13,.1f} {r['ms_per_step']:>9.2f} "
            f"{r['roofline_pct']:>8.1f}% {r['prefill_s']:>10.3f}"
        )


if __name__ == "__main__":
    sys.exit(main())
