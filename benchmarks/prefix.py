"""`bench prefix`: TTFT with a shared prompt prefix, caching on against off, and a step-time sweep.

Issue 32's measurements. One engine (LLM(...), the offline API), token-id prompts, max_tokens 1,
so a request's time is its time to first token.

TTFT. For each prompt size S (`--sizes`, 1k/4k/16k) and share p (`--shares`, 0/50/90/99%)
the first P = floor(p * S) tokens are a prefix common to the cell's requests and the rest is
fresh random tokens per request, so only the intended prefix can hit (a hit covers whole blocks:
floor(P / block_size) of them, at most (S - 1) // block_size). Caching on: the prefix is warmed
first by one untimed request that shares it, then each measured request is timed. Caching off:
the same prompts, nothing reused. The cache is reset before every cell, so no cell sees another
cell's blocks, and on/off of one cell run back to back. Two ways of submitting:

- sequential: `--num-iters` requests one at a time, each timed as one `LLM.generate` call with
  the device drained on both ends; the median counts;
- concurrent (`--concurrency`, 16 and 64): all of the cell's requests added at once and the engine
  stepped as LLM.generate steps it, each request's TTFT from the submission to the step that
  returns its token; mean, p50 and p99. A cell whose requests cannot all be held in the KV pool
  at once, or that exceeds max_num_seqs, is skipped and says why.

Each cell runs at every step budget of `--budgets` (the offline API's 16,384 and the server's
2,048), set on the one engine between cells, as is caching: one compile and one set of CUDA
graphs, so that on against off and 16,384 against 2,048 differ in that setting alone (the
graphs' sizes do not depend on the budget above 2,048). The engine's own counters (vLLM's
prefix_cache_queries / hits) give each measured request's hit tokens, recorded beside the
number they should be.

Step sweep (`--sweep`; `--sweep-only` for the sweep alone). The time of one engine step
(`LLMEngine.step()`, scheduling through the sampled token on the host, the device drained on
both ends) over `--sweep-tokens` tokens a step, with async scheduling off for the sweep so that
a timed step() is one whole step and carries exactly the tokens it was built with:

- prefill: one fresh prompt of N tokens alone;
- cached: N fresh tokens after a cached `--sweep-prefix` (3,680) token prefix (the issue's probe);
- decode: N running sequences of `--sweep-context` tokens, one token each;
- mixed: min(N // 2, max_num_seqs - 1) decode rows beside one prompt of the rest of N.

Each point is warmed once, then timed `--sweep-iters` times; the median counts, and the shape of
every timed step (tokens, rows, prompt rows) is checked and recorded. Points above the budget
or, for decode rows, above max_num_seqs are skipped with the reason. `step_time_monotone` is
the issue's check, no step of n tokens more than 5% slower than one of 2n, n = 1..4,096, in
decode and prefill; `inversions` lists, in every mode, each point more than 5% slower than a
larger one (the worst such larger one).

Parts run sequential, sweep, concurrent (the issue's targets first) and the JSON is written after
each, so a run cut short keeps what it finished (`parts_done`). docs/benchmarks.md has the keys.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from compile_engine.benchmarks.common import (
    add_engine_flags,
    engine_kwargs,
    engine_settings,
    model_summary,
    random_prompts,
    synchronize,
    timed,
)
from compile_engine.benchmarks.results import write_result
from compile_engine.benchmarks.telemetry import GpuSampler
from compile_engine.runtime.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS

DEFAULT_SWEEP_TOKENS = (
    "1,2,4,8,16,32,64,128,256,384,416,448,480,512,513,544,576,640,768,1024,1536,2048,2049,"
    "2304,3072,4096,8192"
)
SWEEP_MODES = ("prefill", "cached", "decode", "mixed")
TOLERANCE = 1.05  # a step more than 5% slower than a larger one is an inversion, not noise


# -- sizes and keys -----------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'4k' -> 4096, '416' -> 416."""
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def size_label(n: int) -> str:
    """4096 -> '4k' (the issue's names), 416 -> '416'."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def budget_tag(budget: int) -> str:
    """'' for the offline API's own budget (the issue's measurements), '_b2048' otherwise."""
    return "" if budget == OFFLINE_MAX_NUM_BATCHED_TOKENS else f"_b{budget}"


def shared_tokens(size: int, share: int) -> int:
    return size * share // 100


def expected_hit_tokens(size: int, share: int, block_size: int) -> int:
    """Tokens a request of the cell finds cached: the prefix's full blocks, leaving at least
    the last token to compute."""
    return min(shared_tokens(size, share) // block_size, (size - 1) // block_size) * block_size


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# -- the one engine's settings ------------------------------------------------------------------


@contextmanager
def engine_setting(
    llm, *, budget: int | None = None, caching: bool | None = None, overlap: bool | None = None
) -> Iterator[None]:
    """Set the step budget, prefix caching or async scheduling of an idle engine for a block.

    These are read every step (the scheduler's budget, the KV manager's switch, the engine's
    overlap), so setting them here equals building an engine with them, without a second
    compile and capture; nothing else the engine built depends on them."""
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("engine settings change only between requests")
    sched, kv, config = engine.scheduler.config, engine.scheduler.kv, engine.config
    saved = sched.max_num_batched_tokens, kv.enable_prefix_caching, config.async_scheduling
    if budget is not None:
        sched.max_num_batched_tokens = budget
    if caching is not None:
        kv.enable_prefix_caching = caching
    if overlap is not None:
        config.async_scheduling = overlap
    try:
        yield
    finally:
        sched.max_num_batched_tokens, kv.enable_prefix_caching, config.async_scheduling = saved


def kv_room(llm) -> int:
    """Blocks the pool can hand out."""
    return llm.engine.scheduler.config.num_blocks - 1


class StepShapes:
    """The shape of every step the engine's scheduler hands out while active: (tokens, rows,
    rows carrying prompt tokens). Wraps `schedule` as throughput's StepLog does."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.shapes: list[tuple[int, int, int]] = []

    def __enter__(self) -> StepShapes:
        schedule = self.scheduler.schedule

        def logged():
            out = schedule()
            prompt_rows = sum(
                it.num_computed_tokens < it.request.num_prompt_tokens for it in out.scheduled
            )
            self.shapes.append((out.num_batched_tokens, len(out.scheduled), prompt_rows))
            return out

        self.scheduler.schedule = logged  # an instance attribute, over the method
        return self

    def __exit__(self, *exc) -> None:
        del self.scheduler.schedule


# -- TTFT ---------------------------------------------------------------------------------------


def cell_prompts(
    size: int, share: int, count: int, vocab: int, rng: random.Random
) -> tuple[list[int], list[list[int]]]:
    """(warm prompt, `count` measured prompts): one random prefix, a fresh suffix each."""
    prefix = random_prompts(1, shared_tokens(size, share), vocab, rng)[0]
    rest = size - len(prefix)
    warm, *measured = (prefix + s for s in random_prompts(count + 1, rest, vocab, rng))
    return warm, measured


def _counters(llm) -> tuple[int, int, int]:
    stats = llm.engine.stats()
    return stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions_total


def sequential_cell(llm, warm: list[int], prompts: list[list[int]], caching: bool) -> dict:
    """Each prompt alone through LLM.generate, after `warm` (caching on)."""
    from compile_engine.runtime.sampling_params import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    device = llm.engine.config.device
    llm.engine.scheduler.reset_prefix_cache()
    if caching:
        llm.generate(warm, one)
    ms, hits, queries, computed = [], [], [], []
    preempted = _counters(llm)[2]
    for prompt in prompts:
        q0, h0, _ = _counters(llm)
        with StepShapes(llm.engine.scheduler) as shapes, timed(device) as t:
            llm.generate(prompt, one)
        q1, h1, _ = _counters(llm)
        ms.append(1e3 * t[0])
        hits.append(h1 - h0)
        queries.append(q1 - q0)
        computed.append(sum(tokens for tokens, _, _ in shapes.shapes))
    return {
        "ttft_ms": statistics.median(ms),
        "runs_ms": ms,
        "hit_tokens": hits,
        "queried_tokens": queries,
        # What the steps computed, apart from the counters: the prompt less its hit.
        "computed_tokens": computed,
        "preemptions": _counters(llm)[2] - preempted,
    }


def generate_stamped(llm, prompts: list[list[int]], params) -> tuple[list[float], float]:
    """LLM.generate's loop over prompts submitted at once, stamping when each request's first
    token reaches the host: (TTFT ms per prompt, wall ms)."""
    engine = llm.engine
    synchronize(engine.config.device)
    t0 = time.perf_counter()
    ids = []
    for prompt in prompts:
        rid = engine.next_request_id()
        engine.add_request(rid, prompt, params)
        ids.append(rid)
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = now
    wall = time.perf_counter() - t0
    return [1e3 * (first[rid] - t0) for rid in ids], 1e3 * wall


def concurrent_cell(llm, warm: list[int], prompts: list[list[int]], caching: bool) -> dict:
    from compile_engine.runtime.sampling_params import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.engine.scheduler.reset_prefix_cache()
    if caching:
        llm.generate(warm, one)
    q0, h0, p0 = _counters(llm)
    ttft, wall = generate_stamped(llm, prompts, one)
    q1, h1, p1 = _counters(llm)
    return {
        "mean_ms": statistics.fmean(ttft),
        "p50_ms": percentile(ttft, 50),
        "p99_ms": percentile(ttft, 99),
        "wall_ms": wall,
        "ttft_ms": ttft,
        "hit_tokens": h1 - h0,  # all of the cell's requests together
        "queried_tokens": q1 - q0,
        "preemptions": p1 - p0,
    }


def concurrent_skip(llm, size: int, concurrency: int) -> str | None:
    """Why a concurrent cell cannot run as asked, or None."""
    cfg = llm.engine.scheduler.config
    if concurrency > cfg.max_num_seqs:
        return f"{concurrency} requests exceed max_num_seqs={cfg.max_num_seqs}"
    blocks = concurrency * -(-size // cfg.block_size)
    if blocks > kv_room(llm):
        return f"{concurrency} x {size} tokens need {blocks} KV blocks, the pool has {kv_room(llm)}"
    return None


def _check_sizes(llm, sizes: list[int]) -> None:
    limit = llm.engine.scheduler.config.max_model_len
    if too_long := [s for s in sizes if s >= limit]:
        raise SystemExit(f"--sizes {too_long}: leave no room to generate in max_model_len={limit}")


def _warm_sizes(llm, sizes: list[int], rng: random.Random) -> None:
    """First calls of each size (allocator growth, kernels' first launches), untimed."""
    vocab = llm.engine.model_config.vocab_size
    with engine_setting(llm, caching=False):
        for size in sizes:
            sequential_cell(llm, [], random_prompts(1, size, vocab, rng), caching=False)


def _cell_head(size: int, share: int, expected: int) -> dict:
    return {
        "prompt_tokens": size,
        "shared_tokens": shared_tokens(size, share),
        "expected_hit_tokens": expected,
    }


def bench_sequential(
    llm, *, sizes: list[int], shares: list[int], budgets: list[int], num_iters: int, seed: int
) -> dict:
    """One request at a time: cells[budget][f"{size}_{share}"], and the flat keys."""
    _check_sizes(llm, sizes)
    vocab, bs = llm.engine.model_config.vocab_size, llm.engine.config.block_size
    rng = random.Random(seed)
    # One prompt set per (size, share) for both modes and budgets: the reset keeps cells apart.
    prompts = {(s, p): cell_prompts(s, p, num_iters, vocab, rng) for s in sizes for p in shares}
    cells: dict = {}
    flat: dict = {}
    for budget in budgets:
        tag = budget_tag(budget)
        with engine_setting(llm, budget=budget):
            _warm_sizes(llm, sizes, rng)
        for size in sizes:
            for share in shares:
                name = f"{size_label(size)}_{share}"
                cell = _cell_head(size, share, expected_hit_tokens(size, share, bs))
                warm, measured = prompts[size, share]
                for caching in (True, False):  # back to back, so drift lands on both
                    with engine_setting(llm, budget=budget, caching=caching):
                        result = sequential_cell(llm, warm, measured, caching)
                    cell["cached" if caching else "nocache"] = result
                cells.setdefault(str(budget), {})[name] = cell
                on, off = cell["cached"]["ttft_ms"], cell["nocache"]["ttft_ms"]
                flat[f"prefix_ttft_{name}{tag}_ms"] = on
                flat[f"prefix_ttft_{name}_nocache{tag}_ms"] = off
                flat[f"prefix_hit_ttft_speedup_{name}{tag}"] = off / on
                if share == 0:
                    flat[f"prefix_miss_cost_{size_label(size)}{tag}"] = on / off - 1
    out: dict = {"cells": cells}
    if 0 in shares:
        # The one miss-cost number: the size nearest 4k at the first (headline) budget.
        nearest = min(sizes, key=lambda s: abs(math.log(s / 4096)))
        headline = f"prefix_miss_cost_{size_label(nearest)}{budget_tag(budgets[0])}"
        flat["prefix_miss_cost"] = flat[headline]
        out["prefix_miss_cost_from"] = headline
    out["flat"] = flat
    return out


def bench_concurrent(
    llm,
    *,
    sizes: list[int],
    shares: list[int],
    budgets: list[int],
    concurrency: list[int],
    seed: int,
) -> dict:
    """All of a cell's requests at once: cells[budget][c][f"{size}_{share}"], the flat keys."""
    _check_sizes(llm, sizes)
    vocab, bs = llm.engine.model_config.vocab_size, llm.engine.config.block_size
    rng = random.Random(seed)
    cells: dict = {}
    flat: dict = {}
    for budget in budgets:
        tag = budget_tag(budget)
        with engine_setting(llm, budget=budget):
            _warm_sizes(llm, sizes, rng)
        for c in concurrency:
            for size in sizes:
                skip = concurrent_skip(llm, size, c)
                for share in shares:
                    name = f"{size_label(size)}_{share}"
                    cell = _cell_head(size, share, c * expected_hit_tokens(size, share, bs))
                    cells.setdefault(str(budget), {}).setdefault(str(c), {})[name] = cell
                    if skip:
                        cell["skipped"] = skip
                        continue
                    warm, measured = cell_prompts(size, share, c, vocab, rng)
                    for caching in (True, False):
                        with engine_setting(llm, budget=budget, caching=caching):
                            result = concurrent_cell(llm, warm, measured, caching)
                        cell["cached" if caching else "nocache"] = result
                    on, off = cell["cached"], cell["nocache"]
                    for stat in ("mean", "p50", "p99"):
                        flat[f"prefix_c{c}_ttft_{name}{tag}_{stat}_ms"] = on[f"{stat}_ms"]
                        flat[f"prefix_c{c}_ttft_{name}_nocache{tag}_{stat}_ms"] = off[f"{stat}_ms"]
                    flat[f"prefix_hit_c{c}_ttft_speedup_{name}{tag}"] = (
                        off["mean_ms"] / on["mean_ms"]
                    )
    return {"cells": cells, "flat": flat}


# -- the step sweep -----------------------------------------------------------------------------


def _timed_step(llm, shapes: StepShapes) -> tuple[float, tuple[int, int, int]]:
    with timed(llm.engine.config.device) as t:
        llm.engine.step()
    return 1e3 * t[0], shapes.shapes[-1]


def _start_decoding(llm, count: int, context: int, max_tokens: int, rng) -> list[str]:
    """`count` requests of `context` random tokens, stepped until every one holds a token (all
    decode from the next step on); returns their ids."""
    from compile_engine.runtime.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = []
    for prompt in random_prompts(count, context, engine.model_config.vocab_size, rng):
        rid = engine.next_request_id()
        engine.add_request(rid, prompt, params)
        ids.append(rid)
    started: set[str] = set()
    while len(started) < count:
        for out in engine.step():
            started.add(out.request_id)
    return ids


def _abort(llm, ids: list[str]) -> None:
    for rid in ids:
        llm.engine.abort_request(rid)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def sweep_point(
    llm,
    mode: str,
    n: int,
    *,
    iters: int,
    context: int,
    prefix: list[int],
    shapes: StepShapes,
    rng: random.Random,
) -> dict:
    """Time one sweep point; the engine is idle before and after."""
    from compile_engine.runtime.sampling_params import SamplingParams

    engine = llm.engine
    cfg = engine.scheduler.config
    vocab = engine.model_config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    runs: list[tuple[float, tuple[int, int, int]]] = []
    hits: list[int] = []
    if mode in ("prefill", "cached"):
        head = prefix if mode == "cached" else []
        if len(head) + n >= cfg.max_model_len:
            return {"skipped": f"{len(head) + n} tokens reach max_model_len={cfg.max_model_len}"}
        if mode == "cached":  # warm the prefix (again: a decode point may have evicted it)
            llm.generate(head + random_prompts(1, n, vocab, rng)[0], one)
        for i in range(iters + 1):  # the first is the point's warmup
            engine.add_request(
                engine.next_request_id(), head + random_prompts(1, n, vocab, rng)[0], one
            )
            h0 = engine.stats().prefix_cache_hits
            ms, shape = _timed_step(llm, shapes)
            if i:
                runs.append((ms, shape))
                hits.append(engine.stats().prefix_cache_hits - h0)
            assert not engine.has_unfinished_requests(), "a one-step request did not finish"
        want = (n + len(head) - (len(head) // cfg.block_size) * cfg.block_size, 1, 1)
    else:
        rows = n if mode == "decode" else min(n // 2, cfg.max_num_seqs - 1)
        chunk = n - rows
        if mode == "mixed" and n < 2:
            return {"skipped": "a mixed step needs a decode row and a prompt token"}
        if rows + (chunk > 0) > cfg.max_num_seqs:
            return {"skipped": f"{rows} decode rows exceed max_num_seqs={cfg.max_num_seqs}"}
        prefill_steps = -(-rows * context // cfg.max_num_batched_tokens)
        max_tokens = prefill_steps + 2 * (iters + 1) + 2
        blocks = rows * -(-(context + max_tokens) // cfg.block_size) + -(-chunk // cfg.block_size)
        if blocks > engine.scheduler.kv.num_free_blocks:
            return {"skipped": f"{blocks} KV blocks needed, {kv_room(llm)} in the pool"}
        ids = _start_decoding(llm, rows, context, max_tokens, rng)
        for i in range(iters + 1):
            if chunk:
                engine.add_request(
                    engine.next_request_id(), random_prompts(1, chunk, vocab, rng)[0], one
                )
            ms, shape = _timed_step(llm, shapes)
            if i:
                runs.append((ms, shape))
        _abort(llm, ids)
        want = (n, rows + (chunk > 0), int(chunk > 0))
    ms = [m for m, _ in runs]
    point = {
        "ms": statistics.median(ms),
        "runs_ms": ms,
        "tokens": want[0],
        "rows": want[1],
        # Every timed step had the shape it was built for (tokens, rows, prompt rows).
        "shape_ok": all(shape == want for _, shape in runs),
        "shapes": sorted({shape for _, shape in runs}),
    }
    if mode == "cached":
        point["hit_tokens"] = hits
    return point


def inversions(points: dict[int, float], tolerance: float = TOLERANCE) -> list[dict]:
    """Each point more than `tolerance` times slower than some larger point, with the
    worst such larger point."""
    found = []
    ns = sorted(points)
    for i, small in enumerate(ns):
        larger = ns[i + 1 :]
        if not larger:
            continue
        worst = min(larger, key=lambda m: points[m])
        ratio = points[small] / points[worst]
        if ratio > tolerance:
            found.append(
                {
                    "n": small,
                    "vs_n": worst,
                    "ms": points[small],
                    "vs_ms": points[worst],
                    "ratio": ratio,
                }
            )
    return found


def doubling_check(modes: dict[str, dict[int, float]], top: int = 4096) -> dict:
    """The issue's target: t(n) <= t(2n) (within TOLERANCE) for n = 1, 2, 4 .. top, decode and
    prefill, where both were measured."""
    worst = {"ratio": 0.0}
    checked = 0
    for mode in ("decode", "prefill"):
        points = modes.get(mode, {})
        n = 1
        while n <= top:
            if n in points and 2 * n in points:
                checked += 1
                ratio = points[n] / points[2 * n]
                if ratio > worst["ratio"]:
                    worst = {"ratio": ratio, "mode": mode, "n": n}
            n *= 2
    return {"monotone": worst["ratio"] <= TOLERANCE, "pairs_checked": checked, "worst": worst}


def bench_sweep(
    llm,
    *,
    tokens: list[int],
    modes: list[str],
    iters: int,
    prefix_len: int,
    context: int,
    seed: int,
) -> dict:
    engine = llm.engine
    cfg = engine.scheduler.config
    rng = random.Random(seed + 2)
    prefix = random_prompts(1, prefix_len, engine.model_config.vocab_size, rng)[0]
    out: dict = {
        "tokens": tokens,
        "iters": iters,
        "prefix_tokens": prefix_len,
        "decode_context": context,
        "budget": cfg.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs,
        "modes": {},
    }
    flat: dict = {}
    timed_points: dict[str, dict[int, float]] = {}
    with engine_setting(llm, overlap=False), StepShapes(engine.scheduler) as shapes:
        for mode in modes:
            rows = out["modes"][mode] = {}
            for n in tokens:
                if n > cfg.max_num_batched_tokens:
                    rows[str(n)] = {
                        "skipped": f"above the step budget {cfg.max_num_batched_tokens}"
                    }
                    continue
                point = sweep_point(
                    llm,
                    mode,
                    n,
                    iters=iters,
                    context=context,
                    prefix=prefix,
                    shapes=shapes,
                    rng=rng,
                )
                rows[str(n)] = point
                if "ms" in point:
                    flat[f"step_{mode}_{n}_ms"] = point["ms"]
                    timed_points.setdefault(mode, {})[n] = point["ms"]
    out["inversions"] = {mode: inversions(points) for mode, points in timed_points.items()}
    check = doubling_check(timed_points)
    out["doubling"] = check
    flat["step_time_monotone"] = check["monotone"]
    flat["step_time_monotone_worst_ratio"] = check["worst"]["ratio"]
    if "step_prefill_416_ms" in flat:
        flat["prefill_416_ms"] = flat["step_prefill_416_ms"]
    out["flat"] = flat
    return out


# -- the command --------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench prefix", description=__doc__.splitlines()[0])
    # LLM's own budget: the engine is the offline API's; --budgets sets smaller ones per cell.
    add_engine_flags(p, max_num_seqs=256, max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS)
    p.add_argument(
        "--sizes", default="1k,4k,16k", help="prompt tokens, comma-separated (4k = 4096)"
    )
    p.add_argument("--shares", default="0,50,90,99", help="shared prefix, percent of the prompt")
    p.add_argument(
        "--budgets",
        default=f"{OFFLINE_MAX_NUM_BATCHED_TOKENS},2048",
        help="step budgets (tokens), each <= --max-num-batched-tokens; the first is the headline",
    )
    p.add_argument("--concurrency", default="16,64", help="requests at once; '' for none")
    p.add_argument(
        "--concurrent-sizes",
        default=None,
        help="sizes of the concurrent cells (default: --sizes)",
    )
    p.add_argument(
        "--concurrent-shares",
        default=None,
        help="shares of the concurrent cells (default: --shares)",
    )
    p.add_argument("--num-iters", type=int, default=3, help="sequential requests a cell; median")
    p.add_argument("--sweep", action="store_true", help="then the step-time sweep")
    p.add_argument("--sweep-only", action="store_true", help="only the step-time sweep")
    p.add_argument("--sweep-tokens", default=DEFAULT_SWEEP_TOKENS, help="tokens a step")
    p.add_argument(
        "--sweep-modes", default=",".join(SWEEP_MODES), help="of " + ",".join(SWEEP_MODES)
    )
    p.add_argument("--sweep-iters", type=int, default=5, help="timed steps a point; median")
    p.add_argument("--sweep-prefix", type=int, default=3680, help="cached tokens in 'cached'")
    p.add_argument("--sweep-context", type=int, default=32, help="tokens of each decode row")
    p.add_argument("--name", default="prefix", help="result file name prefix")
    return p


def main(argv: list[str] | None = None) -> int:
    from compile_engine.runtime.llm import LLM

    args = build_parser().parse_args(argv)
    if not args.enable_prefix_caching:
        raise SystemExit("bench prefix compares caching on and off itself: leave caching on")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    shares = _ints(args.shares)
    budgets = _ints(args.budgets)
    concurrency = _ints(args.concurrency)
    modes = [m for m in args.sweep_modes.split(",") if m]
    if bad := [m for m in modes if m not in SWEEP_MODES]:
        raise SystemExit(f"--sweep-modes: unknown {bad}; choose from {', '.join(SWEEP_MODES)}")
    if bad := [b for b in budgets if not 0 < b <= args.max_num_batched_tokens]:
        raise SystemExit(f"--budgets {bad} must be in [1, --max-num-batched-tokens]")
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    device = llm.engine.config.device
    payload: dict = {
        "benchmark": "prefix",
        "model": args.model,
        "model_config": model_summary(llm),
        "engine": engine_settings(llm),
        "llm_init_s": time.perf_counter() - t0,
        "sizes": sizes,
        "shares": shares,
        "budgets": budgets,
        "concurrency": concurrency,
        "num_iters": args.num_iters,
        "parts_done": [],
        "gpu": {},
    }

    def save(part: str, result: dict) -> None:
        payload.update(result.pop("flat"))
        payload[part] = result
        payload["parts_done"].append(part)
        # Written after each part: a run cut short keeps what it finished.
        path = write_result(args.name, payload, args.results_dir, device=device.type)
        print(f"wrote {path} ({part})")

    if not args.sweep_only:
        with GpuSampler(device) as gpu:
            result = bench_sequential(
                llm,
                sizes=sizes,
                shares=shares,
                budgets=budgets,
                num_iters=args.num_iters,
                seed=args.seed,
            )
        payload["gpu"]["sequential"] = gpu.summary
        save("sequential", result)
        print_sequential(payload)
    # Before the concurrent cells, the longest part: the targets come first.
    if args.sweep or args.sweep_only:
        with GpuSampler(device) as gpu:
            result = bench_sweep(
                llm,
                tokens=_ints(args.sweep_tokens),
                modes=modes,
                iters=args.sweep_iters,
                prefix_len=args.sweep_prefix,
                context=args.sweep_context,
                seed=args.seed,
            )
        payload["gpu"]["sweep"] = gpu.summary
        save("sweep", result)
        print_sweep(payload)
    if not args.sweep_only and concurrency:
        c_sizes = sizes
        if args.concurrent_sizes:
            c_sizes = [parse_size(s) for s in args.concurrent_sizes.split(",") if s.strip()]
        with GpuSampler(device) as gpu:
            result = bench_concurrent(
                llm,
                sizes=c_sizes,
                shares=_ints(args.concurrent_shares) if args.concurrent_shares else shares,
                budgets=budgets,
                concurrency=concurrency,
                seed=args.seed + 1,
            )
        payload["gpu"]["concurrent"] = gpu.summary
        save("concurrent", result)
        print_concurrent(payload)
    return 0


# -- tables -------------------------------------------------------------------------------------


def print_sequential(payload: dict) -> None:
    print("prefix TTFT, one request at a time (ms, median): cached / uncached / speedup, hits")
    for budget, cells in payload["sequential"]["cells"].items():
        for name, cell in cells.items():
            on, off = cell["cached"], cell["nocache"]
            hit, want = statistics.median(on["hit_tokens"]), cell["expected_hit_tokens"]
            print(
                f"  budget {budget:>6}  {name:>8}%  {on['ttft_ms']:>9.2f} {off['ttft_ms']:>9.2f} "
                f"{off['ttft_ms'] / on['ttft_ms']:>6.2f}x  hits {hit:.0f}/{want}"
            )


def print_concurrent(payload: dict) -> None:
    print("prefix TTFT, all at once (ms): cached mean/p50/p99 | uncached mean/p50/p99")
    for budget, by_c in payload["concurrent"]["cells"].items():
        for c, cells in by_c.items():
            for name, cell in cells.items():
                head = f"  budget {budget:>6}  c{c:<3} {name:>8}%"
                if "skipped" in cell:
                    print(f"{head}  skipped: {cell['skipped']}")
                    continue
                on, off = cell["cached"], cell["nocache"]
                print(
                    f"{head}  {on['mean_ms']:>8.1f} {on['p50_ms']:>8.1f} {on['p99_ms']:>8.1f} | "
                    f"{off['mean_ms']:>8.1f} {off['p50_ms']:>8.1f} {off['p99_ms']:>8.1f}"
                )


def print_sweep(payload: dict) -> None:
    sweep = payload["sweep"]
    modes = list(sweep["modes"])
    print("step time (ms, median of " + str(sweep["iters"]) + "), by tokens a step")
    print("  " + f"{'tokens':>7}" + "".join(f" {m:>9}" for m in modes))
    for n in sweep["tokens"]:
        cells = [sweep["modes"][m].get(str(n), {}) for m in modes]
        print(
            "  "
            + f"{n:>7}"
            + "".join(f" {c['ms']:>9.2f}" if "ms" in c else f" {'-':>9}" for c in cells)
        )
    check = sweep["doubling"]
    worst = check["worst"]
    where = f" ({worst['mode']} {worst['n']} vs {2 * worst['n']})" if "mode" in worst else ""
    print(f"  monotone (n vs 2n, 5%): {check['monotone']}, worst ratio {worst['ratio']:.3f}{where}")
    for mode, found in sweep["inversions"].items():
        for inv in found:
            print(
                f"  inversion {mode}: {inv['n']} tokens {inv['ms']:.2f} ms > {inv['vs_n']} tokens "
                f"{inv['vs_ms']:.2f} ms ({inv['ratio']:.2f}x)"
            )


if __name__ == "__main__":
    sys.exit(main())
