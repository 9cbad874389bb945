"""`bench throughput`: offline, N requests at once through LLM.generate.

The shape of vLLM's `bench throughput` with its random dataset: N random token-id prompts of
--input-len tokens and --output-len new tokens each (fixed, or uniform within +-range-ratio),
ignore_eos so every request produces exactly its output length, all handed to one generate call.
Output tok/s is generated tokens over the wall time of that call; total tok/s adds the prompt
tokens. A short warmup generate runs first so first-call costs (allocator, lazy compilation)
are not charged to the measurement. `steps` in the JSON splits the run's time between the
steps that carried prompt tokens and those that only decoded (`StepLog`).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from compile_engine.benchmarks.common import (
    add_engine_flags,
    engine_kwargs,
    engine_settings,
    model_summary,
    random_prompts,
    sampled_lengths,
    timed,
)
from compile_engine.benchmarks.results import print_table, write_result
from compile_engine.benchmarks.telemetry import GpuSampler
from compile_engine.runtime.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS

STEP_KINDS = ("with prefill", "decode only")


class StepLog:
    """Where an offline run's time went, by kind of engine step: steps that carried prompt
    tokens (prefill chunks, with the decodes riding along) and steps that only decoded.

    Wraps the engine scheduler's `schedule` for the run and times each step from its schedule
    call to the next (the last to the end of the run). With async scheduling the host waits
    in between for the step before to finish on the device, so when the device is the
    bottleneck an interval is the device time of the step before it: within a run of steps of
    one kind the times are right, at a change of kind one step lands in the other row."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.marks: list[tuple[float, str, int, int]] = []  # time, kind, tokens, sequences
        self.end = 0.0

    def __enter__(self) -> StepLog:
        schedule = self.scheduler.schedule

        def logged():
            out = schedule()
            if out.scheduled:
                prefill = any(
                    it.num_computed_tokens < it.request.num_prompt_tokens for it in out.scheduled
                )
                kind = STEP_KINDS[0] if prefill else STEP_KINDS[1]
                mark = (time.perf_counter(), kind, out.num_batched_tokens, len(out.scheduled))
                self.marks.append(mark)
            return out

        self.scheduler.schedule = logged  # an instance attribute, over the method
        return self

    def __exit__(self, *exc) -> None:
        self.end = time.perf_counter()
        del self.scheduler.schedule

    def summary(self) -> dict:
        rows = {
            kind: {"steps": 0, "seconds": 0.0, "tokens": 0, "sequences": 0} for kind in STEP_KINDS
        }
        ends = [m[0] for m in self.marks[1:]] + [self.end]
        for (start, kind, tokens, sequences), end in zip(self.marks, ends, strict=True):
            row = rows[kind]
            row["steps"] += 1
            row["seconds"] += end - start
            row["tokens"] += tokens
            row["sequences"] += sequences
        for row in rows.values():
            steps = max(row["steps"], 1)
            row["ms_per_step"] = 1e3 * row["seconds"] / steps
            row["tokens_per_step"] = row["tokens"] / steps
            row["sequences_per_step"] = row.pop("sequences") / steps
        return rows


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
    from compile_engine.runtime.sampling_params import SamplingParams

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
    # StepLog's end comes after timed's final synchronize: the last step is timed whole.
    scheduler = llm.engine.scheduler
    with GpuSampler(device) as gpu, StepLog(scheduler) as steps, timed(device) as t:
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
        "steps": steps.summary(),
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
    from compile_engine.runtime.llm import LLM

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
