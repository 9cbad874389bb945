"""Where a speculative step's time goes: SmolLM2 (or any model) on the shipped n-gram workload at
batch 1, each engine.step() call timed whole and by phase (propose, schedule, prepare, the
graph's inputs and replay, sampling, the wait for the device, the scheduler update, the text),
with the graph's span on the device from CUDA events; medians by step kind (prefill, plain,
verify). What found the 1.85 ms verification step's parts on the H200 (docs/compiler.md,
section 8).

    python3 scripts/device/spec_step_probe.py MODEL K [TARGET [NUM_PROMPTS]]

K: fixed n-gram k (0: no speculation). TARGET h100 by default (cpu works, without graph times).
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time

import torch

from compile_engine.benchmarks.speculative import (
    WORKLOAD_MAX_LEN,
    chat_token_ids,
    kv_blocks_needed,
    load_workload,
)
from compile_engine.runtime.engine import EngineConfig, LLMEngine
from compile_engine.runtime.sampling_params import SamplingParams


def main() -> None:
    model, k = sys.argv[1], int(sys.argv[2])
    target = sys.argv[3] if len(sys.argv) > 3 else "h100"
    limit = int(sys.argv[4]) if len(sys.argv) > 4 else None
    spec = None
    if k:
        spec = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=2,
                    prompt_lookup_max=4, adaptive=False)  # fmt: skip
    blocks = kv_blocks_needed(1, WORKLOAD_MAX_LEN, 16)
    engine = LLMEngine(
        EngineConfig(
            model=model,
            target=target,
            speculative_config=spec,
            max_num_seqs=1,
            num_kv_blocks=blocks,
        )  # fmt: skip
    )
    items = load_workload()[:limit]
    prompts = [chat_token_ids(engine.tokenizer, it["messages"]) for it in items]
    phases, info, spans = {}, {}, []
    runner, graphs = engine.runner, engine.runner.graphs

    def timed(obj, name: str) -> None:
        inner = getattr(obj, name)

        def call(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
            return out

        setattr(obj, name, call)

    for obj, name in (
        (runner, "propose"), (engine.scheduler, "schedule"), (runner, "prepare"),
        (runner, "_run_model"), (runner, "_sample_into"), (runner, "collect"),
        (engine, "_advance"), (engine, "_deliver"), (engine, "_process"),
        (engine.scheduler, "update_from_output"),
    ):  # fmt: skip
        timed(obj, name)
    launch = runner.launch

    def launch_noting(step, *args, **kwargs):
        info["tokens"] = step.num_batched_tokens
        info["drafts"] = sum(len(it.draft_token_ids) for it in step.scheduled)
        return launch(step, *args, **kwargs)

    runner.launch = launch_noting
    if graphs is not None:
        timed(graphs, "prepare_for_replay")
        timed(graphs, "replay_head")
        run = graphs.run

        def run_spanned(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = run(*args, **kwargs)
            end.record()
            spans.append((start, end))
            return out

        graphs.run = run_spanned
    rows = []
    params = SamplingParams(temperature=0.0, max_tokens=128)
    for rep in range(2):  # the first pass warms up
        for prompt in prompts:
            engine.add_request(engine.next_request_id(), prompt, params)
            while engine.has_unfinished_requests():
                phases.clear(), spans.clear(), info.clear()
                start = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - start
                if graphs is not None:
                    torch.cuda.synchronize()
                if rep and info:
                    span = [a.elapsed_time(b) for a, b in spans]
                    rows.append(dict(step=seconds, span=span, **info, **phases))
    kinds = collections.defaultdict(list)
    for row in rows:
        kind = "prefill" if row["tokens"] > 16 else ("verify" if row["drafts"] else "plain")
        kinds[kind].append(row)
    print(f"k={k}: {len(rows)} steps, {runner.counters}")
    for kind, picked in kinds.items():
        names = sorted({n for row in picked for n in row} - {"span", "tokens", "drafts"})
        line = {n: round(1e3 * statistics.median(r.get(n, 0.0) for r in picked), 3) for n in names}
        span = [r["span"][0] for r in picked if r["span"]]
        line["graph_span_ms"] = round(statistics.median(span), 3) if span else None
        total = sum(r["step"] for r in picked)
        print(f"{kind}: {len(picked)} steps, {total:.3f} s; medians, ms: {json.dumps(line)}")


if __name__ == "__main__":
    main()
