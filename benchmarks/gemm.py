"""Decode-time GEMMs on CUDA: cuBLAS, cuBLASLt, a transposed weight, and the Triton skinny
GEMM (kernels_generated/skinny_gemm.py) over a sweep of its configs.

    compile-engine bench gemm [--rows 1 2 4 ...] [--budget-s 230] [--write-configs PATH]

y[M, N] = x[M, K] @ W[N, K]^T for the Llama-3-8B linear layers (qkv, o_proj, gate_up, down,
lm_head) in bf16 at M = 1..256 rows. Every variant is replayed from a CUDA graph, as the engine
replays decode: one graph holds many calls, round-robin over enough copies of the weight that
the copies together are several times the 50 MB L2, so each call streams its weight from HBM as
each layer does in the model (a single weight of 34-50 MB would otherwise sit in L2 between
calls). The activation x is one tensor, L2-resident, as a layer's input is.

Variants: `cublas` (torch.mm(x, W.t()), what F.linear and Inductor's extern mm run),
`cublaslt` (the same under preferred_blas_library('cublaslt')), `mm_t` (torch.mm against the
weight stored transposed, [K, N] contiguous) and `triton:<mode>/<BM>x<BN>x<BK>/s<split>/w<warps>/
p<stages>` per config of the sweep. A Triton config must match cuBLAS's output (to bf16
rounding) before and after its timing (the second check catches split-K counters left dirty).
The sweep has a time budget; what it did not reach is recorded as such.

Reported per (shape, M, variant): microseconds per call, TB/s (weight + x + y bytes) and
TFLOP/s. --write-configs writes the swept cells' entries of kernels_generated/configs/
skinny_gemm.json's h100 section: per (N, K, M) the faster of the best Triton config and cuBLASLt
where it beats cuBLAS by at least --min-speedup, else cuBLAS. The other entries, each entry's
`fused` records (`bench gemm-norm`) and a kernel an engine A/B chose (`chosen_by`, which takes
the sweep's best config for that kernel) stay. --from-json rewrites them from a saved sweep,
without a GPU.

`--shared-rows R` (what the SmolLM2 shapes were written with): a shape's cells of at most R
rows all take one Triton config, the one of least summed time over those cells among the
configs timed in every one of them. A row's output is then the same bits at any row count up
to R (the swapped tile is 16 rows whatever M is, the K order the config's), so a speculative
verification step (1 + k rows a sequence) computes each row as the one-row decode step does:
greedy speculation stays lossless in bf16 (issue 33). Per-cell bests differ in their K tiles
and splits, and then a near-tied argmax flips (SmolLM2 on the H200: 5-7 of 14 outputs
differed from plain decode at aa5fafa).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from compile_engine.benchmarks.results import DEFAULT_DIRECTORY, write_result

SHAPES = {  # name: (N, K), Llama-3-8B
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
LLAMA_SHAPES = list(SHAPES)  # the default sweep
# SmolLM2-135M (README's default model; issue 33's GPU n-gram row): fused qkv 9 + 2 x 3 heads
# of 64, fused gate_up 2 x 1536, the tied lm_head.
SHAPES.update(
    smollm2_qkv=(960, 576),
    smollm2_o_proj=(576, 576),
    smollm2_gate_up=(3072, 576),
    smollm2_down=(576, 1536),
    smollm2_lm_head=(49152, 576),
)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PEAK_TB_S = 4.26  # H200 copy rate, measured
PEAK_TFLOP_S = 784.0  # H200 bf16 GEMM, measured
ROTATION_BYTES = 256 << 20  # weight copies per shape fill at least this (L2 is 50 MB)
REPLAY_US = 1500.0  # calls per graph chosen so one replay takes about this long
SMS = 132
TIMING = (  # how graph_time_us times, for the results
    "CUDA-graph replay, round-robin over weight copies >= 256 MB in all, median of 7 replays "
    "of ~1.5 ms"
)


# --------------------------------------------------------------------------- timing


def graph_time_us(calls: list[Callable[[], object]], replays: int = 7) -> float:
    """Median microseconds per call of `calls`, round-robin, replayed from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    probe = torch.cuda.CUDAGraph()
    with torch.cuda.graph(probe):
        for call in calls:
            call()
    probe.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    probe.replay()
    end.record()
    end.synchronize()
    rounds = max(1, round(REPLAY_US / max(start.elapsed_time(end) * 1e3, 1.0)))
    del probe
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (rounds * len(calls)))
    del graph
    return sorted(samples)[len(samples) // 2]


# --------------------------------------------------------------------------- candidates


def time_configs(
    cell: dict,
    configs: list[dict],
    call_of: Callable[[dict], Callable],
    operands: list[tuple],
    want: torch.Tensor,
    moved_bytes: int,
    deadline: float,
    name_of: Callable[[dict], str],
    timer: Callable[[list[Callable[[], object]]], float] = graph_time_us,
) -> dict | None:
    """A kernel's launch configs swept into `cell["variants"]` (name -> us, TB/s, config): each
    config's call (`call_of(config)(*operands[i])`) must match `want` to 2e-2 relative before it
    is timed over every operand set; those that do not, or fail to compile or launch, go to
    `cell["failed"]`, those past `deadline` count in `cell["skipped_over_budget"]`. Returns the
    fastest variant's entry (also `cell["best"]`, by name), None when none was timed."""
    failed, skipped, timed = [], 0, {}
    for config in configs:
        if time.monotonic() > deadline:
            skipped += 1
            continue
        name = name_of(config)
        try:
            call = call_of(config)
            got = call(*operands[0]).float()
            err = ((got - want.float()).abs().max() / want.float().abs().max()).item()
            if err > 2e-2:
                failed.append({"variant": name, "rel_err": err})
                continue
            us = timer([lambda ops=ops, call=call: call(*ops) for ops in operands])
        except Exception as exc:  # a config that does not compile or launch is data too
            failed.append({"variant": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        timed[name] = {"us": us, "tb_s": round(moved_bytes / us / 1e6, 3), "config": config}
    cell["variants"].update(timed)
    cell["failed"], cell["skipped_over_budget"] = failed, skipped
    if not timed:
        return None
    cell["best"] = min(timed, key=lambda k: timed[k]["us"])
    return timed[cell["best"]]


def triton_name(c: dict) -> str:
    ragged = f"/r{c['programs_per_sm']}" if c.get("programs_per_sm") else ""
    tma = "/tma" if c.get("tma") else ""
    return (
        f"triton:{c['mode']}/{c['block_m']}x{c['block_n']}x{c['block_k']}/s{c['split_k']}"
        f"/w{c['num_warps']}/p{c['num_stages']}{ragged}{tma}"
    )


def _tiles(rows: int) -> list[dict]:
    """Launch configs (without split) worth trying at `rows` rows."""
    out: list[dict] = []

    def add(mode, bm, bn, bk, warps, stages, per_sm=0, tma=False):
        config = dict(mode=mode, block_m=bm, block_n=bn, block_k=bk, num_warps=warps)
        config["num_stages"] = stages
        if per_sm:  # the rows shared out evenly, per_sm programs an SM (block_n: the least)
            config["programs_per_sm"] = per_sm
        if tma:  # the weight's tiles through a tensor descriptor (Hopper's TMA unit)
            config["tma"] = True
        out.append(config)

    if rows <= 16:
        for bn, bk, warps, stages in (
            (32, 256, 4, 4),
            (64, 128, 4, 4),
            (64, 256, 4, 4),
            (16, 512, 4, 4),
            (32, 512, 4, 4),
            (128, 128, 4, 4),
            (64, 256, 4, 6),
            (32, 256, 4, 6),
            (128, 128, 8, 4),
        ):
            add("swap", 16, bn, bk, warps, stages)
        # TMA's best tiles at one row (scripts/device/tma_gemv_probe.py at c612c8d).
        for bn, bk, warps, stages in ((64, 128, 4, 4), (128, 128, 4, 4), (64, 256, 4, 4),
                                      (64, 128, 4, 6), (32, 128, 4, 4)):  # fmt: skip
            add("swap", 16, bn, bk, warps, stages, tma=True)
        # A grid of whole block_n tiles leaves SMs idle or a part-empty last wave (o_proj at
        # block_n 64: 64 programs on 132 SMs); an even share of the rows for every SM does not.
        for bk, warps, stages, per_sm in ((256, 4, 4, 1), (256, 4, 4, 2), (128, 4, 4, 2),
                                          (512, 4, 3, 1), (256, 8, 4, 1)):  # fmt: skip
            add("swap", 16, 16, bk, warps, stages, per_sm)
        if rows <= 4:
            add("fma", 1 << (rows - 1).bit_length(), 16, 256, 4, 4)
    elif rows <= 64:
        for bn, bk, stages in ((64, 128, 4), (64, 256, 3), (128, 128, 3), (128, 64, 4)):
            add("swap", rows, bn, bk, 4, stages)
        for bn, bk in ((128, 128), (64, 128)):
            add("dot", rows, bn, bk, 4, 4)
    else:
        for bm, bn, bk, warps, stages in (
            (128, 128, 64, 8, 3),
            (128, 256, 64, 8, 3),
            (64, 128, 64, 4, 4),
            (128, 128, 64, 4, 4),
        ):
            add("dot", bm, bn, bk, warps, stages)
        for bm, bn in ((128, 128), (64, 128)):
            add("swap", bm, bn, 64, 8, 3)
    return out


def candidates(n_size: int, k_size: int, rows: int) -> list[dict]:
    """Every (tile, split) of the sweep for this cell: splits that leave each program at least
    two K tiles and the grid under eight programs per SM; grids nearest two programs per SM
    first, so that a cell cut short by the budget has timed the likeliest winners."""
    out = []
    for tile in _tiles(rows):
        per_sm = tile.get("programs_per_sm", 0)
        row_programs = per_sm * SMS if per_sm else math.ceil(n_size / tile["block_n"])
        tiles = row_programs * math.ceil(rows / tile["block_m"])
        for split in (1, 2, 4, 8):
            if split > 1 and (k_size // split < 2 * tile["block_k"] or tiles * split > 8 * SMS):
                continue
            out.append({**tile, "split_k": split, "_programs": tiles * split})
    out.sort(key=lambda c: abs(math.log2(c["_programs"] / (2 * SMS))))
    for c in out:
        del c["_programs"]
    return out


# --------------------------------------------------------------------------- the sweep


def _cell_bytes(n_size: int, k_size: int, rows: int) -> int:
    return 2 * (n_size * k_size + rows * k_size + rows * n_size)


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def run_cell(name: str, rows: int, weights, weights_t, deadline: float) -> dict:
    from compile_engine.kernels_generated.skinny_gemm import skinny_gemm

    n_size, k_size = SHAPES[name]
    x = torch.randn(rows, k_size, device="cuda", dtype=torch.bfloat16)
    moved, flops = _cell_bytes(n_size, k_size, rows), 2.0 * rows * n_size * k_size
    want = torch.mm(x, weights[0].t())

    def stats(us: float) -> dict:
        return {
            "us": round(us, 2),
            "tb_s": round(moved / us / 1e6, 3),
            "tflop_s": round(flops / us / 1e6, 2),
        }

    cell: dict = {"shape": name, "N": n_size, "K": k_size, "M": rows, "variants": {}}
    variants = cell["variants"]
    variants["cublas"] = stats(graph_time_us([lambda w=w: torch.mm(x, w.t()) for w in weights]))
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        lt = graph_time_us([lambda w=w: torch.mm(x, w.t()) for w in weights])
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
    variants["cublaslt"] = stats(lt)
    variants["mm_t"] = stats(graph_time_us([lambda w=w: torch.mm(x, w) for w in weights_t]))
    skipped, failed = 0, []
    for config in candidates(n_size, k_size, rows):
        if time.monotonic() > deadline:
            skipped += 1
            continue
        label = triton_name(config)
        try:
            err = _close(skinny_gemm(x, weights[0], **config), want)
            if err > 2e-2:
                failed.append({"variant": label, "rel_err": err})
                continue
            us = graph_time_us([lambda w=w, c=config: skinny_gemm(x, w, **c) for w in weights])
            err_after = _close(skinny_gemm(x, weights[-1], **config), x @ weights[-1].t())
        except Exception as exc:  # a config that does not compile or launch is data too
            failed.append({"variant": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        if err_after > 2e-2:
            failed.append({"variant": label, "rel_err_after_timing": err_after})
            continue
        variants[label] = {**stats(us), "config": config, "rel_err": round(err, 5)}
    cell["skipped_over_budget"] = skipped
    cell["failed"] = failed
    triton = {k: v for k, v in variants.items() if k.startswith("triton")}
    if triton:
        best = min(triton, key=lambda k: triton[k]["us"])
        cell["best_triton"] = best
        cell["speedup_vs_cublas"] = round(variants["cublas"]["us"] / triton[best]["us"], 3)
    return cell


def _weights(n_size: int, k_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    copies = max(2, math.ceil(ROTATION_BYTES / (2 * n_size * k_size)))
    scale = k_size**-0.5
    ws = [
        (torch.randn(n_size, k_size, device="cuda") * scale).to(torch.bfloat16)
        for _ in range(copies)
    ]
    return ws, [w.t().contiguous() for w in ws]


def precompile(cells: list[tuple[str, int]], deadline: float) -> dict:
    """Compile every tile config of the sweep once, on a small input with the same
    specialisation (N, K and strides multiples of 16, K split evenly), so that compile time
    does not eat the first cells' share of the timing budget."""
    from compile_engine.kernels_generated.skinny_gemm import skinny_gemm

    tiles = {}
    for name, m in cells:
        for config in candidates(*SHAPES[name], m):
            tiles.setdefault(triton_name({**config, "split_k": 1}), config)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    t0, done, errors = time.monotonic(), 0, {}
    for label, config in tiles.items():
        if time.monotonic() > deadline:
            break
        try:
            skinny_gemm(x, w, **{**config, "split_k": 1})
            done += 1
        except Exception as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"[:300]
    torch.cuda.synchronize()
    info = {"configs": len(tiles), "compiled": done, "seconds": round(time.monotonic() - t0, 1)}
    print(f"precompiled {done}/{len(tiles)} tile configs in {info['seconds']} s", flush=True)
    return {**info, "errors": errors}


def sweep(shapes: list[str], rows: list[int], budget_s: float) -> tuple[list[dict], dict]:
    cells = [(name, m) for name in shapes for m in rows]
    compiled = precompile(cells, time.monotonic() + 0.5 * budget_s)
    start = time.monotonic()
    budget_s -= compiled["seconds"]
    out = []
    current, weights, weights_t = None, [], []
    for i, (name, m) in enumerate(cells):
        if name != current:
            weights = weights_t = None
            torch.cuda.empty_cache()
            weights, weights_t = _weights(*SHAPES[name])
            current = name
        # Each cell may spend its share of the budget; the leftover of fast cells carries on.
        deadline = start + budget_s * (i + 1) / len(cells)
        t0 = time.monotonic()
        try:
            cell = run_cell(name, m, weights, weights_t, deadline)
        except Exception as exc:  # keep the rest of the sweep; the JSON says what broke
            print(f"{name} M={m}: {type(exc).__name__}: {exc}", flush=True)
            out.append({"shape": name, "M": m, "error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        cell["seconds"] = round(time.monotonic() - t0, 2)
        out.append(cell)
        best = cell.get("best_triton", "-")
        cub = cell["variants"]["cublas"]
        print(
            f"{name:8s} M={m:4d}  cublas {cub['us']:8.2f} us {cub['tb_s']:5.2f} TB/s"
            f"  best {best} x{cell.get('speedup_vs_cublas', float('nan')):.3f}"
            f"  ({cell['seconds']:.1f} s, {len(cell['failed'])} failed,"
            f" {cell['skipped_over_budget']} skipped)",
            flush=True,
        )
    return out, compiled


def print_table(cells: list[dict]) -> None:
    print(
        f"\n{'shape':8s} {'M':>4s} | {'cublas us':>9s} {'TB/s':>5s} {'TF/s':>6s} | "
        f"{'lt us':>7s} {'mm_t us':>7s} | {'best triton':46s} {'us':>8s} {'TB/s':>5s} | {'x':>5s}"
    )
    for c in cells:
        if "error" in c:
            continue
        v = c["variants"]
        cub, best = v["cublas"], c.get("best_triton")
        t = v[best] if best else {"us": float("nan"), "tb_s": float("nan")}
        print(
            f"{c['shape']:8s} {c['M']:4d} | {cub['us']:9.2f} {cub['tb_s']:5.2f} "
            f"{cub['tflop_s']:6.1f} | {v['cublaslt']['us']:7.2f} {v['mm_t']['us']:7.2f} | "
            f"{best or '-':46s} {t['us']:8.2f} {t['tb_s']:5.2f} | "
            f"{c.get('speedup_vs_cublas', float('nan')):5.2f}"
        )


def table_entries(cells: list[dict], info: dict, min_speedup: float) -> list:
    """Per cell the fastest of the best Triton config and cuBLASLt where it beats cuBLAS by at
    least `min_speedup`, else cuBLAS; with the times behind the choice."""
    from compile_engine.kernels_generated.configs import ConfigEntry

    entries = []
    for c in cells:
        if "error" in c:
            continue
        variants = c["variants"]
        cublas_us = variants["cublas"]["us"]
        contenders = {"cublaslt": variants["cublaslt"]["us"]}
        if c.get("best_triton"):
            contenders["triton"] = variants[c["best_triton"]]["us"]
        kernel = min(contenders, key=contenders.get)
        timing = {"cublas_us": cublas_us, **{f"{k}_us": v for k, v in contenders.items()}}
        if cublas_us / contenders[kernel] < min_speedup:
            kernel = "cublas"
        config = {"kernel": kernel}
        if kernel == "triton":
            config.update(variants[c["best_triton"]]["config"])
        entries.append(
            ConfigEntry({"N": c["N"], "K": c["K"], "M": c["M"]}, config, {**info, **timing})
        )
    return entries


def shared_entries(cells: list[dict], info: dict, rows: int) -> list:
    """`--shared-rows`: per shape, every swept cell of at most `rows` rows with the Triton
    config of least summed time over them (among those timed in all); none for a shape where
    no config was."""
    from compile_engine.kernels_generated.configs import ConfigEntry

    by_shape: dict[tuple[int, int], list[dict]] = {}
    for c in cells:
        if "error" not in c and c["M"] <= rows:
            by_shape.setdefault((c["N"], c["K"]), []).append(c)
    entries = []
    for group in by_shape.values():
        timed = [{n for n in c["variants"] if n.startswith("triton:")} for c in group]
        common = set.intersection(*timed)
        if not common:
            continue
        name = min(sorted(common), key=lambda n: sum(c["variants"][n]["us"] for c in group))
        for c in group:
            config = {"kernel": "triton", **c["variants"][name]["config"]}
            timing = {
                "cublas_us": c["variants"]["cublas"]["us"],
                "triton_us": c["variants"][name]["us"],
                "shared_rows": rows,
            }
            key = {"N": c["N"], "K": c["K"], "M": c["M"]}
            entries.append(ConfigEntry(key, config, {**info, **timing}))
    return entries


def write_configs(
    cells: list[dict], path: str, min_speedup: float, info: dict, shared_rows: int = 0
) -> None:
    """The swept cells' entries in the h100 section of the skinny GEMM's config table, every
    other entry left as it was (a sweep of some shapes or rows replaces only theirs). A swept
    entry takes the sweep's choice, config and times and keeps its `fused` records (`bench
    gemm-norm`'s). Where an engine A/B chose the kernel (`chosen_by`: the sweep's rule would
    pick another), the entry keeps that kernel and its reason and takes only the sweep's best
    config for it (Triton)."""
    from compile_engine.kernels_generated.configs import ConfigTable, TargetConfigs

    table = ConfigTable.load(path)
    section = table.targets.get("h100") or TargetConfigs(True, [])
    merged = {_key(e.key): e for e in section.entries}
    best = {_key(c): c for c in cells if c.get("best_triton")}
    shared = {_key(e.key): e for e in shared_entries(cells, info, shared_rows)}
    for entry in table_entries(cells, info, min_speedup):
        key = _key(entry.key)
        if key in shared:
            merged[key] = shared[key]
            continue
        old = merged.get(key)
        if old is not None and "fused" in old.info:
            entry.info["fused"] = old.info["fused"]
        if old is not None and "chosen_by" in old.info:
            entry.info["chosen_by"] = old.info["chosen_by"]
            kernel, picked = old.config.get("kernel"), entry.config.get("kernel")
            if kernel == "triton" and key in best:
                cell = best[key]
                entry.config = {"kernel": kernel, **cell["variants"][cell["best_triton"]]["config"]}
            elif kernel != picked:
                entry.config = old.config
            print(f"N={key[0]} K={key[1]} M={key[2]}: {kernel} kept, chosen by an engine A/B "
                  f"(the sweep's rule picked {picked})")  # fmt: skip
        merged[key] = entry
    table.targets["h100"] = TargetConfigs(
        True,
        list(merged.values()),
        note=section.note
        or f"compile-engine bench gemm --write-configs: Triton or cuBLASLt where >= "
        f"x{min_speedup} cuBLAS, else cuBLAS",
    )
    print(f"wrote {table.save(path)}")


def _key(key: dict) -> tuple[int, int, int]:
    return key["N"], key["K"], key["M"]


def provenance_of(record: dict) -> dict:
    """tuning_provenance() as it was when a saved sweep ran, read off its JSON."""
    versions = record.get("versions", {})
    return {
        "device": record["device"]["name"],
        "dtype": record.get("dtype", "bfloat16"),
        "tuned_at": record["timestamp"],
        "versions": {k: versions[k] for k in ("torch", "triton") if k in versions},
        "sweep": f"{record['name']}@{record['commit']}",
    }


def payload_commit() -> str:
    from compile_engine.benchmarks.results import git_state

    return git_state()[0][:12]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_DIRECTORY), help="where the JSON goes")
    p.add_argument("--shapes", nargs="+", default=LLAMA_SHAPES, choices=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--budget-s", type=float, default=230.0, help="for the Triton sweep")
    p.add_argument(
        "--write-configs", metavar="PATH", help="write the swept cells' entries into this table"
    )
    p.add_argument("--min-speedup", type=float, default=1.05)
    p.add_argument(
        "--shared-rows",
        type=int,
        default=0,
        help="cells of at most this many rows share one Triton config (bit-equal rows)",
    )
    p.add_argument("--list", action="store_true", help="print the sweep's configs per cell")
    p.add_argument(
        "--from-json",
        metavar="JSON",
        help="no sweep: rewrite --write-configs from a saved gemm JSON (no GPU needed)",
    )
    args = p.parse_args(argv)
    if args.from_json:
        import json

        if not args.write_configs:
            raise SystemExit("--from-json needs --write-configs PATH")
        record = json.loads(Path(args.from_json).read_text())
        info = provenance_of(record)
        write_configs(record["cells"], args.write_configs, args.min_speedup, info, args.shared_rows)
        return 0
    if args.list:
        for name, m in itertools.product(args.shapes, args.rows):
            configs = candidates(*SHAPES[name], m)
            print(f"{name} M={m}: {len(configs)} configs")
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("compile_engine.benchmarks.gemm needs a CUDA device")
    torch.manual_seed(0)
    cells, compiled = sweep(args.shapes, args.rows, args.budget_s)
    print_table(cells)
    payload = {
        "dtype": "bfloat16",
        "shapes": {k: {"N": n, "K": kk} for k, (n, kk) in SHAPES.items() if k in args.shapes},
        "peak_tb_s": PEAK_TB_S,
        "peak_tflop_s": PEAK_TFLOP_S,
        "bytes_counted": "weight + x + y, bf16",
        "timing": TIMING,
        "budget_s": args.budget_s,
        "precompile": compiled,
        "cells": cells,
    }
    write = functools.partial(write_configs, shared_rows=args.shared_rows)
    return save_sweep("gemm", payload, args, write)


def save_sweep(name: str, payload: dict, args: argparse.Namespace, write: Callable) -> int:
    """The sweep's JSON under args.out and, with --write-configs, `write(cells, path,
    min_speedup, provenance)` into the tuned table."""
    print(f"wrote {write_result(name, payload, directory=args.out)}")
    if args.write_configs:
        from compile_engine.kernels_generated.configs import tuning_provenance

        info = {**tuning_provenance(), "sweep": f"{name}@{payload_commit()}"}
        write(payload["cells"], args.write_configs, args.min_speedup, info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
