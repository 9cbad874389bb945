"""`bench speculative`: what speculative decoding buys, with it and without it in one process.

Two engines over one loaded model, one with --speculative-config and one without, run the
same requests greedily, their runs alternating (off, on, off, on, ...) so that a CPU shared
with other work or a GPU's clocks drift onto both. Decode tok/s counts the tokens after each
request's first over the time after every request of the run holds one (bench latency's
clock), so prefill, which speculation does not change, does not dilute the ratio.

- The workload (default): speculative_workload.json beside this file, rewrite, summarise and
  code-edit chats written for this benchmark (300-700 prompt tokens with SmolLM2's template),
  up to --max-tokens each, eos ending them as it would for a user. At batch 1 every request
  runs alone; at batch B > 1, B requests at once (the workload repeated to fill B). Keys:
  `spec_<method>_speedup_bs<B>` (on / off), `spec_<method>_mean_acceptance_length_bs<B>`.
- `--replay` (the mechanism's bounds, issue 33): random token prompts (--input-len,
  --output-len, ignore_eos) and `ReplayProposer`, a BENCHMARK-ONLY proposer that replays the
  target's own greedy continuation (recorded from the previous run of the same prompts), so
  that every draft is accepted (`spec_ceiling_speedup_bs<B>_k<k>`), or that continuation with
  every token shifted, so that none is (`spec_zero_accept_speedup_bs<B>`, and
  `spec_zero_accept_cost_bs1` = 1 - that speedup at batch 1). It cannot be chosen through
  `speculative_config` (LLM, the server): the benchmark hands it to `LLMEngine(proposer=...)`,
  in place of the config's method (ngram, whose settings then only carry k and the policy).

Both modes run speculative_config as given: the default adaptive k (runtime/spec_policy.py)
and acceptance cut-off included, so that the numbers are what a user gets. A JSON list of
configs runs each beside the first (the keys are the first's): e.g. a fixed k against the
adaptive one, in the same alternation. Each run checks
that the speculative engine's tokens equal the plain engine's; the count that differ is
recorded (`outputs_differ`: rounding at other step shapes can flip a near-tied argmax in
bfloat16, which is not speculation changing an output).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from compile_engine.benchmarks.common import (
    add_engine_flags,
    engine_kwargs,
    engine_settings,
    model_summary,
    random_prompts,
    synchronize,
)
from compile_engine.benchmarks.results import write_result

WORKLOAD = Path(__file__).with_name("speculative_workload.json")
# The workload engines' KV pool holds this many tokens a sequence (prompts reach ~720).
WORKLOAD_MAX_LEN = 2048
# k = 6: on the CPU (SmolLM2 GGUF, 0275610, one round-alternating run) k = 6 read 1.50x at
# acceptance length 4.09 where k = 4 read 1.32-1.33x at 3.3-3.8 (prompt_lookup_min 1: 1.33x
# at 2.85); the adaptive policy takes fewer where they do not pay.
DEFAULT_NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 6,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


class ReplayProposer:
    """BENCHMARK ONLY, never a user's method: proposes the target's own greedy continuation
    of a prompt, recorded from an earlier run (`record`), so that every draft is accepted; or,
    with `wrong`, each of those tokens plus one (mod the vocabulary), so that none is. A
    request whose prompt has no record, or whose output left the record, gets no drafts
    beyond it. DraftModelProposer's interface (`propose(wanted)`, `release`, `draft_probs`),
    so the Speculator batches it like a device proposer; the drafts are point masses."""

    label = "replay (benchmark-only: the target's own greedy continuation)"

    def __init__(self, vocab_size: int, *, wrong: bool = False) -> None:
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.records: dict[tuple[int, ...], list[int]] = {}
        self._by_request: dict[str, list[int] | None] = {}
        self.draft_probs: dict = {}  # point masses: the verifier's q is None

    def record(self, prompt: list[int], continuation: list[int]) -> None:
        self.records[tuple(prompt)] = list(continuation)

    def propose(self, wanted: list) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for request, k in wanted:
            rid = request.request_id
            if rid not in self._by_request:
                self._by_request[rid] = self.records.get(tuple(request.prompt_token_ids))
            record = self._by_request[rid]
            if record is None:
                continue
            n = request.num_output_tokens
            drafts = record[n : n + k]
            if self.wrong:
                drafts = [(t + 1) % self.vocab_size for t in drafts]
            out[rid] = drafts
        return out

    def release(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)


def load_workload(path: Path = WORKLOAD) -> list[dict]:
    """The workload's prompts: each {"id", "kind", "messages"}."""
    return json.loads(Path(path).read_text())["prompts"]


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat as the model sees it: its template with the generation prompt, or the
    messages' text joined for a model without one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text, add_special_tokens=True))


def run_batch(engine, prompts: list[list[int]], params) -> dict:
    """All prompts at once, stepped to completion: decode time from when every request holds
    its first token, and each request's tokens."""
    device = engine.config.device
    before = engine.stats()
    ids = []
    synchronize(device)
    t_start = time.perf_counter()
    for prompt in prompts:
        rid = engine.next_request_id()
        engine.add_request(rid, prompt, params)
        ids.append(rid)
    waiting_first = set(ids)
    tokens: dict[str, list[int]] = {}
    t_decode = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
            if t_decode is None and out.outputs[0].token_ids:
                waiting_first.discard(out.request_id)
        if t_decode is None and not waiting_first:
            synchronize(device)
            t_decode = time.perf_counter()
    synchronize(device)
    t_end = time.perf_counter()
    outputs = [tokens[rid] for rid in ids]
    after = engine.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    decode_tokens = sum(max(len(o) - 1, 0) for o in outputs)
    decode_s = t_end - t_decode
    return {
        "decode_s": decode_s,
        "decode_tokens": decode_tokens,
        "prefill_s": t_decode - t_start,
        "e2e_s": t_end - t_start,
        "output_tokens": sum(map(len, outputs)),
        "spec_drafts": drafts,
        "spec_draft_tokens": after.spec_num_draft_tokens - before.spec_num_draft_tokens,
        "spec_accepted_tokens": accepted,
        "outputs": outputs,
    }


def run_pass(engine, batches: list[list[list[int]]], params) -> dict:
    """Batches one after another; their sums, and every output in prompt order."""
    runs = [run_batch(engine, batch, params) for batch in batches]
    total = {
        key: sum(r[key] for r in runs)
        for key in runs[0]
        if key != "outputs" and isinstance(runs[0][key], int | float)
    }
    total["decode_tok_s"] = total["decode_tokens"] / total["decode_s"] if total["decode_s"] else 0
    drafts = total["spec_drafts"]
    total["mean_acceptance_length"] = 1 + total["spec_accepted_tokens"] / drafts if drafts else None
    total["outputs"] = [o for r in runs for o in r["outputs"]]
    return total


def batches_of(prompts: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """Batch 1: every prompt alone; B > 1: one batch of B, the prompts repeated to fill it."""
    if batch_size == 1:
        return [[p] for p in prompts]
    return [[prompts[i % len(prompts)] for i in range(batch_size)]]


def kv_blocks_needed(max_batch: int, max_len: int, block_size: int) -> int:
    """A pool for max_batch sequences of max_len tokens (plus drafts and the null block)."""
    return max_batch * math.ceil((max_len + 16) / block_size) + 2


def build_engines(args, variants: dict[str, tuple[dict, object | None]], max_len: int) -> dict:
    """`off` and one speculative engine per variant (name -> its speculative_config and a
    proposer, None for the config's), all around one loaded model, each with its own KV pool
    and compile."""
    from compile_engine.runtime.engine import EngineConfig, LLMEngine

    kwargs = engine_kwargs(args)
    kwargs.pop("speculative_config", None)
    if kwargs["num_kv_blocks"] is None:
        # Several engines share the device: each gets what its runs need, not the memory left.
        kwargs["num_kv_blocks"] = kv_blocks_needed(args.max_num_seqs, max_len, args.block_size)
    engines = {"off": LLMEngine(EngineConfig(model=args.model, **kwargs))}
    loaded = engines["off"].loaded
    for name, (spec, proposer) in variants.items():
        config = EngineConfig(model=args.model, speculative_config=spec, **kwargs)
        engines[name] = LLMEngine(config, loaded=loaded, proposer=proposer)
    return engines


def summarize(passes: list[dict]) -> dict:
    """Median over rounds, and each round's numbers without the outputs."""
    rounds = [{k: v for k, v in p.items() if k != "outputs"} for p in passes]
    lengths = [p["mean_acceptance_length"] for p in passes if p["mean_acceptance_length"]]
    return {
        "decode_tok_s": statistics.median(p["decode_tok_s"] for p in passes),
        "mean_acceptance_length": statistics.median(lengths) if lengths else None,
        "rounds": rounds,
    }


def bench(
    args,
    engines: dict,
    prompts: dict[int, list[list[int]]],
    params,
    on_pass=None,
    warmup_params=None,
) -> dict:
    """Every batch size: one warmup pass per engine (with `warmup_params`, the first two
    batches only: compiles and the step-cost table, not a full pass), then --rounds rounds of
    one pass per engine in turn. Returns per batch size and engine the summary, with the
    speedups."""
    results: dict = {}
    for b, batch_prompts in prompts.items():
        batches = batches_of(batch_prompts, b)
        passes: dict[str, list[dict]] = {name: [] for name in engines}
        for warm in (True, *([False] * args.rounds)):
            for name, engine in engines.items():
                if warm and warmup_params is not None:
                    run_pass(engine, batches[:2], warmup_params)
                    continue
                policy = engine.spec_policy
                before = list(policy.chosen) if policy is not None else None
                done = run_pass(engine, batches, params)
                length = done["mean_acceptance_length"]
                chosen = ""
                if policy is not None:  # which k the pass's steps took, and what it knew
                    done["steps_by_k"] = [n - m for n, m in zip(policy.chosen, before, strict=True)]
                    done["step_s_by_tokens"] = policy.describe()["step_s_by_tokens"]
                    chosen = f", steps by k {done['steps_by_k']}"
                print(
                    f"  batch {b} {'warmup' if warm else 'round'} {name}: "
                    f"{done['decode_tok_s']:,.1f} tok/s"
                    + (f", accept len {length:.2f}" if length else "")
                    + chosen,
                    flush=True,
                )
                if on_pass is not None:
                    on_pass(name, [p for batch in batches for p in batch], done["outputs"])
                if not warm:
                    passes[name].append(done)
        off_outputs = passes["off"][-1]["outputs"]
        entry: dict = {}
        for name, runs in passes.items():
            entry[name] = summarize(runs)
            if name != "off":
                entry[name]["speedup"] = entry[name]["decode_tok_s"] / entry["off"]["decode_tok_s"]
                entry[name]["outputs_differ"] = sum(
                    a != b for a, b in zip(runs[-1]["outputs"], off_outputs, strict=True)
                )
        for name, engine in engines.items():
            if engine.spec_policy is not None:  # what the per-step choice of k saw and chose
                entry[name]["policy"] = engine.spec_policy.describe()
        results[b] = entry
        print_batch(b, entry)
        if getattr(args, "profile", None):
            profile_engines(Path(args.profile), engines, batches, params, b)
    return results


def profile_engines(out: Path, engines: dict, batches, params, b: int) -> None:
    """--profile: one more pass of each engine under cProfile (its top functions by own and
    by cumulative time, as text in `out`), and on CUDA each captured graph of <= 16 tokens
    replayed alone (device time a replay, CUDA events): where a step's time goes, host or
    device."""
    import cProfile
    import io
    import pstats

    out.mkdir(parents=True, exist_ok=True)
    for name, engine in engines.items():
        profiler = cProfile.Profile()
        profiler.enable()
        done = run_pass(engine, batches, params)
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        text.write(f"{name}: {done['decode_tok_s']:,.1f} tok/s under the profiler\n")
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(60)
        (out / f"profile-bs{b}-{name}.txt").write_text(text.getvalue())
    graphs = getattr(engines["off"].runner, "graphs", None)
    if graphs is None or not torch.cuda.is_available():
        return
    lines = []
    for key, graph in sorted(graphs.graphs.items(), key=lambda kv: kv[0][0]):
        if key[0] > 16:
            continue
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        lines.append(f"graph {key}: {start.elapsed_time(end) / 50 * 1000:.1f} us a replay")
    (out / f"graphs-bs{b}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def print_batch(b: int, entry: dict) -> None:
    off = entry["off"]["decode_tok_s"]
    print(f"  batch {b}: off {off:,.1f} tok/s")
    for name, r in entry.items():
        if name == "off":
            continue
        length = r["mean_acceptance_length"]
        print(
            f"    {name:<12} {r['decode_tok_s']:>10,.1f} tok/s  {r['speedup']:.2f}x  "
            f"accept len {f'{length:.2f}' if length else '-'}  "
            f"outputs differing {r['outputs_differ']}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench speculative", description=__doc__.splitlines()[0])
    add_engine_flags(p, max_num_seqs=None, max_num_batched_tokens=4096)
    p.add_argument("--batch-sizes", default="1", help="comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="measured runs of each engine")
    p.add_argument("--max-tokens", type=int, default=128, help="workload: the most per request")
    p.add_argument("--workload", default=str(WORKLOAD), help="workload: the prompts' JSON")
    p.add_argument("--num-prompts", type=int, default=None, help="workload: only the first N")
    p.add_argument("--replay", action="store_true", help="the replay proposer's bounds instead")
    p.add_argument("--input-len", type=int, default=32, help="replay: random prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="replay: tokens per request")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--name", default=None, help="result file name (speculative[-replay])")
    p.add_argument(
        "--profile", default=None, help="a folder: one more pass of each engine under cProfile"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from compile_engine.runtime.sampling_params import SamplingParams
    from compile_engine.runtime.speculative_config import SpeculativeConfig

    args = build_parser().parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if args.max_num_seqs is None:
        args.max_num_seqs = max(batch_sizes)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # --replay's default k is the key's, 4 (spec_ceiling_speedup_bs1_k4).
    default = dict(DEFAULT_NGRAM, num_speculative_tokens=4) if args.replay else DEFAULT_NGRAM
    specs = json.loads(args.speculative_config) if args.speculative_config else dict(default)
    specs = specs if isinstance(specs, list) else [specs]
    spec = specs[0]
    k = SpeculativeConfig.coerce(dict(spec)).num_speculative_tokens
    t0 = time.perf_counter()
    if args.replay:
        ceiling, zero = ReplayProposer(0), ReplayProposer(0, wrong=True)
        max_len = args.input_len + args.output_len
        engines = build_engines(args, {"ceiling": (spec, ceiling), "zero": (spec, zero)}, max_len)
        vocab = engines["off"].model_config.vocab_size
        ceiling.vocab_size = zero.vocab_size = vocab
        rng = random.Random(args.seed)
        prompts = {b: random_prompts(b, args.input_len, vocab, rng) for b in batch_sizes}
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

        def record(name: str, batch: list[list[int]], outputs: list[list[int]]) -> None:
            # The ceiling replays its own last tokens once it has run (the same step shapes,
            # so the same rounding), the plain engine's before; the zero case shifts those.
            for prompt, out in zip(batch, outputs, strict=True):
                if name == "ceiling" or (name == "off" and tuple(prompt) not in ceiling.records):
                    ceiling.record(prompt, out)
                if name == "off":
                    zero.record(prompt, out)

        init_s = time.perf_counter() - t0
        results = bench(args, engines, prompts, params, record)
        payload = replay_payload(results, k)
        payload.update(input_len=args.input_len, output_len=args.output_len)
        name = args.name or "speculative-replay"
    else:
        items = load_workload(Path(args.workload))[: args.num_prompts]
        engines = build_engines(args, workload_variants(specs), WORKLOAD_MAX_LEN)
        tokenizer = engines["off"].tokenizer
        token_ids = [chat_token_ids(tokenizer, it["messages"]) for it in items]
        longest = max(map(len, token_ids)) + args.max_tokens
        if longest > WORKLOAD_MAX_LEN:
            raise SystemExit(f"a request may reach {longest} tokens, over {WORKLOAD_MAX_LEN}")
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        init_s = time.perf_counter() - t0
        warmup = SamplingParams(temperature=0.0, max_tokens=min(16, args.max_tokens))
        results = bench(args, engines, dict.fromkeys(batch_sizes, token_ids), params, None, warmup)
        payload = workload_payload(results, spec["method"])
        payload.update(
            workload=Path(args.workload).name,
            prompts=[
                {"id": it["id"], "kind": it["kind"], "prompt_tokens": len(ids)}
                for it, ids in zip(items, token_ids, strict=True)
            ],
            max_tokens=args.max_tokens,
        )
        name = args.name or "speculative"
    first = engines[next(n for n in engines if n != "off")]
    payload.update(
        # Two kinds, so that the replay record is no named variant of the workload's (render).
        benchmark="speculative_replay" if args.replay else "speculative",
        model=args.model,
        model_config=model_summary(_Wrap(engines["off"])),
        engine=engine_settings(_Wrap(first)),
        speculative_config=first.config.speculative_config.to_dict(),
        proposers={"ceiling": ReplayProposer.label, "zero": ReplayProposer.label + ", shifted"}
        if args.replay
        else {name: v[0] for name, v in workload_variants(specs).items()},
        rounds=args.rounds,
        engines_init_s=init_s,
        torch_threads=torch.get_num_threads(),
        load_average=_load_average(),
    )
    device = engines["off"].config.device
    path = write_result(name, payload, args.results_dir, device=device.type)
    print(f"wrote {path}")
    return 0


class _Wrap:
    """engine_settings / model_summary take an LLM; an engine dressed as one."""

    def __init__(self, engine) -> None:
        self.engine = engine


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def workload_variants(specs: list[dict]) -> dict[str, tuple[dict, None]]:
    """The first config under its method's name (the recorded keys'), each further one (an
    A/B beside it) as `<method>-k<k>[-fixed]`."""
    variants = {specs[0]["method"]: (specs[0], None)}
    for spec in specs[1:]:
        fixed = "-fixed" if spec.get("adaptive") is False else ""
        variants[f"{spec['method']}-k{spec['num_speculative_tokens']}{fixed}"] = (spec, None)
    return variants


def workload_payload(results: dict, method: str) -> dict:
    payload: dict = {"batches": {}}
    for b, entry in results.items():
        on, off = entry[method], entry["off"]
        payload["batches"][str(b)] = entry
        payload[f"spec_{method}_speedup_bs{b}"] = on["speedup"]
        payload[f"spec_{method}_decode_bs{b}_tok_s"] = on["decode_tok_s"]
        payload[f"spec_off_decode_bs{b}_tok_s"] = off["decode_tok_s"]
        payload[f"spec_{method}_mean_acceptance_length_bs{b}"] = on["mean_acceptance_length"]
    return payload


def replay_payload(results: dict, k: int) -> dict:
    payload: dict = {"batches": {}}
    for b, entry in results.items():
        payload["batches"][str(b)] = entry
        payload[f"spec_off_decode_bs{b}_tok_s"] = entry["off"]["decode_tok_s"]
        payload[f"spec_ceiling_speedup_bs{b}_k{k}"] = entry["ceiling"]["speedup"]
        payload[f"spec_ceiling_mean_acceptance_length_bs{b}_k{k}"] = entry["ceiling"][
            "mean_acceptance_length"
        ]
        payload[f"spec_zero_accept_speedup_bs{b}"] = entry["zero"]["speedup"]
        if b == 1:
            payload["spec_zero_accept_cost_bs1"] = 1 - entry["zero"]["speedup"]
    return payload


if __name__ == "__main__":
    sys.exit(main())
