"""`bench kv-waste`: how much allocated KV memory holds nothing (issue 3's acceptance).

64 requests of random prompt and output lengths run through the engine with prefix caching
off (shared blocks would make "allocated" ambiguous) and a pool small enough to be under load.
After the scheduler has allocated each step's slots and before the model runs, every running
request is inspected:

    allocated = blocks in its table * block_size
    used      = tokens whose KV is stored or is written this step
                (num_computed_tokens, which schedule() advances by the tokens it hands out)
    waste     = allocated - used

Paging promises waste < block_size per running request (only the last block is partial). The
report gives the largest per-request waste seen, the waste as a share of allocated slots (mean
and max over steps, and over all steps together), and, for the same running set, the share a
contiguous engine would waste by reserving max_model_len per request (the non-paged baseline of
the vLLM paper) or prompt + max_tokens per request (the best a non-paged engine could do).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from compile_engine.benchmarks.common import engine_settings, model_summary, random_prompts
from compile_engine.benchmarks.results import DEFAULT_DIRECTORY, print_table, write_result


class WasteProbe:
    """Wraps `scheduler.schedule` of one engine and measures every step it hands out.

    Wrapping the bound method leaves the engine untouched: the step the runner executes is
    exactly the one measured.
    """

    def __init__(self, engine, check_integrity: bool = True) -> None:
        self.scheduler = engine.scheduler
        self.block_size = self.scheduler.config.block_size
        self.max_model_len = self.scheduler.config.max_model_len
        self.check_integrity = check_integrity
        self.steps: list[dict] = []
        self._schedule = self.scheduler.schedule
        self.scheduler.schedule = self._measured_schedule

    def close(self) -> None:
        self.scheduler.schedule = self._schedule

    def _measured_schedule(self):
        output = self._schedule()
        kv = self.scheduler.kv
        if self.check_integrity:
            kv.check_integrity()
        allocated = used = reserve_max_len = reserve_request = 0
        worst = 0
        for request in self.scheduler.running:
            rid = request.request_id
            slots = len(kv.get_block_ids(rid)) * self.block_size
            # schedule() already counts this step's tokens as computed (they are being written).
            stored = request.num_computed_tokens
            waste = slots - stored
            worst = max(worst, waste)
            allocated += slots
            used += stored
            reserve_max_len += self.max_model_len
            reserve_request += request.num_prompt_tokens + request.max_tokens
        if allocated:
            self.steps.append(
                {
                    "running": len(self.scheduler.running),
                    "allocated": allocated,
                    "used": used,
                    "max_request_waste": worst,
                    "reserve_max_len": reserve_max_len,
                    "reserve_request": reserve_request,
                }
            )
        return output

    def summary(self) -> dict:
        steps = self.steps
        pct = [100 * (s["allocated"] - s["used"]) / s["allocated"] for s in steps]
        allocated = sum(s["allocated"] for s in steps)
        used = sum(s["used"] for s in steps)
        max_len = sum(s["reserve_max_len"] for s in steps)
        per_request = sum(s["reserve_request"] for s in steps)
        worst = max((s["max_request_waste"] for s in steps), default=0)
        return {
            "steps_measured": len(steps),
            "max_running": max((s["running"] for s in steps), default=0),
            "mean_running": sum(s["running"] for s in steps) / max(len(steps), 1),
            "max_request_waste_slots": worst,
            "within_one_partial_block": worst < self.block_size,
            "waste_pct_mean": sum(pct) / max(len(pct), 1),
            "waste_pct_max": max(pct, default=0.0),
            "waste_pct_overall": 100 * (allocated - used) / max(allocated, 1),
            "contiguous_max_len_waste_pct": 100 * (max_len - used) / max(max_len, 1),
            "contiguous_request_max_waste_pct": 100 * (per_request - used) / max(per_request, 1),
        }


def bench_kv_waste(
    llm,
    *,
    num_requests: int = 64,
    prompt_len: tuple[int, int] = (8, 384),
    output_len: tuple[int, int] = (8, 128),
    seed: int = 0,
    check_integrity: bool = True,
) -> dict:
    from compile_engine.runtime.sampling_params import SamplingParams

    engine = llm.engine
    if engine.config.enable_prefix_caching:
        raise ValueError("run kv-waste with prefix caching off: shared blocks blur 'allocated'")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    in_lens = [rng.randint(*prompt_len) for _ in range(num_requests)]
    out_lens = [rng.randint(*output_len) for _ in range(num_requests)]
    prompts = random_prompts(num_requests, in_lens, vocab, rng)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    probe = WasteProbe(engine, check_integrity)
    preempted_before = engine.stats().num_preemptions_total
    t0 = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params)
    finally:
        probe.close()
    assert [len(o.outputs[0].token_ids) for o in outputs] == out_lens
    return {
        "benchmark": "kv_waste",
        "num_requests": num_requests,
        "prompt_len_range": list(prompt_len),
        "output_len_range": list(output_len),
        "block_size": probe.block_size,
        "max_model_len": probe.max_model_len,
        "preemptions": engine.stats().num_preemptions_total - preempted_before,
        "elapsed_s": time.perf_counter() - t0,
        **probe.summary(),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench kv-waste", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF directory (bench make-model tiny-llama)")
    p.add_argument("--target", default="cpu", choices=["cpu", "h100"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", default="8,384", help="min,max (uniform)")
    p.add_argument("--output-len", default="8,128", help="min,max (uniform)")
    p.add_argument("--block-size", type=int, default=16)
    # 512 blocks of 16 = 8192 slots for ~16k tokens of demand: the pool runs full.
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check-integrity", action="store_true")
    p.add_argument(
        "--enforce-eager", action="store_true", help="no compile: the counts are the same"
    )
    p.add_argument("--results-dir", default=str(DEFAULT_DIRECTORY))
    p.add_argument("--name", default="kv-waste", help="result file name prefix")
    return p


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    from compile_engine.runtime.llm import LLM

    args = build_parser().parse_args(argv)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        target=args.target,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
    )
    payload = bench_kv_waste(
        llm,
        num_requests=args.num_requests,
        prompt_len=_pair(args.prompt_len),
        output_len=_pair(args.output_len),
        seed=args.seed,
        check_integrity=not args.no_check_integrity,
    )
    payload.update(model=args.model, model_config=model_summary(llm), engine=engine_settings(llm))
    path = write_result(args.name, payload, args.results_dir, device=llm.engine.config.device.type)
    print_kv_waste(payload)
    print(f"wrote {path}")
    return 0 if payload["within_one_partial_block"] else 1


def print_kv_waste(p: dict) -> None:
    print_table(
        [
            ("requests", p["num_requests"]),
            ("steps measured", p["steps_measured"]),
            ("running (mean / max)", f"{p['mean_running']:.1f} / {p['max_running']}"),
            ("preemptions", p["preemptions"]),
            (
                "max waste per request",
                f"{p['max_request_waste_slots']} slots (block {p['block_size']}): "
                + ("OK, within one partial block" if p["within_one_partial_block"] else "FAIL"),
            ),
            ("paged waste % (mean / max / overall)", _pcts(p)),
            ("contiguous max_model_len waste %", f"{p['contiguous_max_len_waste_pct']:.1f}"),
            (
                "contiguous prompt+max_tokens waste %",
                f"{p['contiguous_request_max_waste_pct']:.1f}",
            ),
        ],
        title="KV waste: allocated-but-unused slots of running requests, every step",
    )


def _pcts(p: dict) -> str:
    return f"{p['waste_pct_mean']:.2f} / {p['waste_pct_max']:.2f} / {p['waste_pct_overall']:.2f}"


if __name__ == "__main__":
    sys.exit(main())
