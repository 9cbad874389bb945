"""Decode paged attention on CUDA: the Triton kernel against the reference gather + SDPA.

    compile-engine bench paged-attention [--out DIR]
    compile-engine bench paged-attention --prefill [--chunks 4 --chunk-len 512 --contexts 0 2048]

Llama-3-8B attention shapes (Hq 32, Hkv 8, D 128, bf16, KV block 16), one new token per
sequence, every sequence at the same context. Bandwidth counts the K/V bytes attention must
read (plus q and out), against the H200's 4.26 TB/s; both sides also pay the KV write of the
new tokens, which is negligible at these sizes. Combinations whose cache exceeds --max-kv-gb
are skipped; a reference that runs out of memory is recorded as null.

--prefill times prefill chunks instead (`paged_attention_prefill` JSON): `--chunks` sequences
of `--chunk-len` new tokens after each context, the query-tiled variant (tiled=True) against
the single-token kernel (tiled=False) and the reference, reported as causal attention
TFLOP/s (4 * D flops per query head and visible key).
"""

from __future__ import annotations

import argparse
import functools

import torch

from compile_engine.benchmarks.attention_inputs import PagedBatch, make_batch
from compile_engine.benchmarks.results import DEFAULT_DIRECTORY, write_result
from compile_engine.benchmarks.timing import event_seconds
from compile_engine.kernels_generated import paged_attention as pa
from compile_engine.kernels_generated import tuning
from compile_engine.models.ops import paged_attention_ref

PEAK_GB_S = 4260.0  # H200 HBM3e
SHAPES = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}


def _kv_gb(batch_size: int, context: int) -> float:
    d = SHAPES
    return 2 * batch_size * context * d["num_kv_heads"] * d["head_dim"] * 2 / 1e9


def bench(
    batch: PagedBatch,
    *,
    fn=None,
    warmup: int = 3,
    iters: int = 20,
    inner: int = 10,
    cuda_graph: bool = False,
) -> dict[str, float]:
    """Time `fn(*batch.args())` (default: the Triton kernel) on CUDA: the median over `iters`
    samples of `inner` back-to-back calls between two CUDA events, and the achieved bandwidth
    (K/V bytes read + q and out bytes) / time. cuda_graph=True captures one call and replays
    it, as the engine runs decode: eager timing of a small batch measures Python launch
    overhead, not the kernel. Repeated calls find a context smaller than L2 (60 MB on the
    H200) cached there."""
    fn = pa.paged_attention_triton if fn is None else fn
    call = functools.partial(fn, *batch.args())
    seconds = event_seconds(call, cuda_graph=cuda_graph, warmup=warmup, iters=iters, inner=inner)
    moved = batch.kv_bytes_read() + 2 * batch.q.numel() * batch.q.element_size()
    return {"seconds": seconds, "gb_s": moved / seconds / 1e9}


def _measure(batch: PagedBatch, fn, iters: int, **kwargs) -> dict | None:
    try:
        result = bench(batch, fn=fn, iters=iters, **kwargs)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    return {
        "ms": result["seconds"] * 1e3,
        "gb_s": result["gb_s"],
        "pct_of_peak": 100 * result["gb_s"] / PEAK_GB_S,
    }


def run(
    batches: list[int],
    contexts: list[int],
    iters: int,
    max_kv_gb: float,
    kv_cache_dtype: torch.dtype | None = None,
) -> list[dict]:
    """kv_cache_dtype float8_e4m3fn: an FP8 cache (scales 1.0), the kernel reading half the
    bytes; None: a bf16 cache."""
    rows = []
    for batch_size in batches:
        for context in contexts:
            kv_gb = _kv_gb(batch_size, context)
            if kv_gb > max_kv_gb:
                print(f"skip batch {batch_size} context {context}: KV {kv_gb:.1f} GB")
                continue
            batch = make_batch(
                [1] * batch_size,
                [context] * batch_size,
                dtype=torch.bfloat16,
                device="cuda",
                kv_cache_dtype=kv_cache_dtype,
                **SHAPES,
            )
            max_context = batch.block_tables.shape[1] * SHAPES["block_size"]
            # What the kernel below chooses, with the default kernel config as it runs.
            splits = pa.choose_num_splits(
                tuning.default(), batch_size, SHAPES["num_kv_heads"], max_context, batch.q.device
            )
            row = {
                "batch": batch_size,
                "context": context,
                "kv_gb": kv_gb,
                "num_splits": splits,
                # Ours as the engine runs decode, replayed from a CUDA graph; eager as well.
                "ours": _measure(batch, pa.paged_attention_triton, iters, cuda_graph=True),
                "ours_eager": _measure(batch, pa.paged_attention_triton, iters),
                # The reference syncs on the host (.tolist()), so it cannot be captured.
                "reference": _measure(batch, paged_attention_ref, max(3, iters // 4), inner=1),
            }
            if splits > 1:  # what the split buys over the single-pass kernel

                def single(*args):
                    return pa.paged_attention_triton(*args, num_splits=1)

                row["ours_single_pass"] = _measure(batch, single, iters, cuda_graph=True)
            if row["ours"] and row["reference"]:
                row["speedup"] = row["reference"]["ms"] / row["ours"]["ms"]
            rows.append(row)
            del batch
            torch.cuda.empty_cache()
    return rows


def _prefill_flops(chunks: int, chunk_len: int, context: int) -> float:
    d = SHAPES
    visible = chunk_len * context + chunk_len * (chunk_len + 1) // 2  # keys seen, per chunk
    return 4.0 * d["head_dim"] * d["num_q_heads"] * chunks * visible


def run_prefill(chunks: int, chunk_len: int, contexts: list[int], iters: int) -> list[dict]:
    rows = []
    for context in contexts:
        batch = make_batch(
            [chunk_len] * chunks,
            [context + chunk_len] * chunks,
            dtype=torch.bfloat16,
            device="cuda",
            **SHAPES,
        )
        flops = _prefill_flops(chunks, chunk_len, context)
        row: dict = {"chunks": chunks, "chunk_len": chunk_len, "context": context}
        for name, tiled in (("tiled", True), ("untiled", False)):
            fn = functools.partial(pa.paged_attention_triton, tiled=tiled)
            m = _measure(batch, fn, iters, cuda_graph=True)
            if m is not None:
                m["tflops"] = flops / (m["ms"] / 1e3) / 1e12
            row[name] = m
        ref = _measure(batch, paged_attention_ref, max(3, iters // 4), inner=1)
        if ref is not None:
            ref["tflops"] = flops / (ref["ms"] / 1e3) / 1e12
        row["reference"] = ref
        if row["tiled"] and row["untiled"]:
            row["tiled_speedup"] = row["untiled"]["ms"] / row["tiled"]["ms"]
        rows.append(row)
        del batch
        torch.cuda.empty_cache()
    return rows


def print_prefill_rows(rows: list[dict]) -> None:
    print(
        f"{'chunks':>6} {'len':>5} {'ctx':>6} | {'tiled ms':>8} {'TF/s':>6} | "
        f"{'untiled ms':>10} {'TF/s':>6} | {'ref ms':>8} {'TF/s':>6} | {'x':>5}"
    )
    for r in rows:
        t, u, ref = r["tiled"], r["untiled"], r["reference"]
        print(
            f"{r['chunks']:>6} {r['chunk_len']:>5} {r['context']:>6} | "
            f"{_fmt(t, 'ms', '8.3f')} {_fmt(t, 'tflops', '6.1f')} | "
            f"{_fmt(u, 'ms', '10.3f')} {_fmt(u, 'tflops', '6.1f')} | "
            f"{_fmt(ref, 'ms', '8.3f')} {_fmt(ref, 'tflops', '6.1f')} | "
            f"{r.get('tiled_speedup', float('nan')):>5.2f}"
        )


def _fmt(m: dict | None, key: str, spec: str) -> str:
    return "-" if m is None else format(m[key], spec)


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'batch':>5} {'ctx':>6} {'KV GB':>6} {'S':>3} | {'ours ms':>8} {'GB/s':>7} {'%pk':>5}"
        f" | {'ref ms':>8} {'GB/s':>7} {'%pk':>5} | {'x':>5} | {'eager ms':>8}"
        f" | {'1-pass GB/s':>11}"
    )
    for r in rows:
        o, ref, one = r["ours"], r["reference"], r.get("ours_single_pass")
        eager = r["ours_eager"]
        print(
            f"{r['batch']:>5} {r['context']:>6} {r['kv_gb']:>6.2f} {r['num_splits']:>3} | "
            f"{_fmt(o, 'ms', '8.3f')} {_fmt(o, 'gb_s', '7.0f')} {_fmt(o, 'pct_of_peak', '5.1f')} | "
            f"{_fmt(ref, 'ms', '8.3f')} {_fmt(ref, 'gb_s', '7.0f')} "
            f"{_fmt(ref, 'pct_of_peak', '5.1f')} | "
            f"{r.get('speedup', float('nan')):>5.1f} | {_fmt(eager, 'ms', '8.3f')} | "
            f"{_fmt(one, 'gb_s', '11.0f')}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_DIRECTORY), help="where the JSON goes")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    p.add_argument("--iters", type=int, default=20, help="timed calls; the median is kept")
    p.add_argument("--max-kv-gb", type=float, default=60.0)
    p.add_argument("--prefill", action="store_true", help="time prefill chunks, tiled or not")
    p.add_argument("--chunks", type=int, default=4, help="--prefill: sequences per batch")
    p.add_argument("--chunk-len", type=int, default=512, help="--prefill: new tokens each")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="decode over a bf16 cache (auto) or an FP8 e4m3 one (paged_attention_fp8 JSON)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("compile_engine.benchmarks.paged_attention needs a CUDA device")
    if args.prefill:
        contexts = [0, 2048] if args.contexts == p.get_default("contexts") else args.contexts
        rows = run_prefill(args.chunks, args.chunk_len, contexts, args.iters)
        print_prefill_rows(rows)
        payload = {
            "shapes": {**SHAPES, "dtype": "bfloat16"},
            "flops_counted": "4 * head_dim per query head and causally visible key",
            "timing": "CUDA-graph replay (reference: eager); median of iters samples",
            "iters": args.iters,
            "rows": rows,
        }
        path = write_result("paged_attention_prefill", payload, directory=args.out)
        print(f"wrote {path}")
        return
    fp8 = args.kv_cache_dtype == "fp8"
    rows = run(
        args.batches,
        args.contexts,
        args.iters,
        args.max_kv_gb,
        torch.float8_e4m3fn if fp8 else None,
    )
    print_rows(rows)
    payload = {
        "shapes": {**SHAPES, "dtype": "bfloat16", "q_len": 1},
        "kv_cache_dtype": "float8_e4m3fn" if fp8 else "bfloat16",
        "peak_gb_s": PEAK_GB_S,
        "bytes_counted": "K/V of every context token + q + out",
        "timing": "ours: CUDA-graph replay (ours_eager: Python launches), reference: eager; "
        "median of iters samples of back-to-back calls; KV under 60 MB is L2-resident",
        "iters": args.iters,
        "rows": rows,
    }
    name = "paged_attention_fp8" if fp8 else "paged_attention"
    print(f"wrote {write_result(name, payload, directory=args.out)}")


if __name__ == "__main__":
    main()
