"""The everyday fusions on CUDA: our kernels against Inductor's fusion of the reference.

    compile-engine bench fusions [--tokens 1 64 256 2048] [--out DIR]

Issue 5's rule: a kernel pass is on by default only if it beats what Inductor makes of the
op's plain-PyTorch reference, which is what a build gets with the pass off (lower_to_reference
hands Inductor the reference). So each op is timed, at Llama-3-8B shapes in bf16 (hidden 4096,
32 / 8 heads of 128, intermediate 14336) and T tokens, as

- `inductor`: `torch.compile` of the reference, the token dimension dynamic as the engine
  compiles it (T = 1 specialised apart, as Dynamo does);
- `triton` (and `helion` for silu_and_mul): the custom op the pass swaps in, with its tuned
  configs from kernels_generated/configs/ (the default KernelConfig's key as its last
  argument, as a build's passes give it the engine's);
- `eager`: the reference op by op, for scale.

Every variant is replayed from a CUDA graph (benchmarks/timing.py), as the engine runs a
step, and reported in microseconds per call and GB/s of the bytes the op must move. Inputs are
the same every call, so at small T they sit in L2 (as a layer's activations mostly do).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch

from compile_engine.benchmarks.results import DEFAULT_DIRECTORY, write_result
from compile_engine.models.ops import add_rms_norm_ref, rotary_ref, silu_and_mul_ref

HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
EPS = 1e-5
PEAK_GB_S = 4260.0  # the H200's measured copy rate (BRIEF.md)
# The pass each kernel variant belongs to: what the default on/off decision is about.
PASS_OF = {
    ("add_rms_norm", "triton"): "rms_norm_triton",
    ("rotary", "triton"): "rotary_triton",
    ("silu_and_mul", "triton"): "silu_and_mul_triton",
    ("silu_and_mul", "helion"): "silu_and_mul_helion",
}


def _mark_tokens_dynamic(args: tuple, token_args: tuple[int, ...]) -> None:
    """Mark dim 0 of the token-indexed arguments dynamic, as the engine's capture does, so that
    Inductor compiles the reference once for every T > 1; T = 1 stays static (Dynamo's 0/1
    specialisation: the engine compiles it apart too)."""
    for i in token_args:
        if args[i].shape[0] > 1:
            torch._dynamo.mark_dynamic(args[i], 0)


def _with_key(op: Callable, key: str) -> Callable:
    """A kernel op called as the reference is, the kernel config's key appended."""
    return lambda *args: op(*args, key)


def _ops(num_tokens: int, dev: str) -> dict[str, dict]:
    """Per op: inputs at T tokens, bytes it must move, and its variants (name -> callable)."""
    import compile_engine.kernels_generated.add_rms_norm  # noqa: F401  (registers the ce_kernels ops)
    import compile_engine.kernels_generated.rotary  # noqa: F401
    import compile_engine.kernels_generated.silu_and_mul  # noqa: F401
    from compile_engine.benchmarks import kernel_specs as specs
    from compile_engine.kernels_generated import tuning

    key = tuning.default().key

    bf16 = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter: no bf16
    x = torch.randn(num_tokens, HIDDEN, device=dev, dtype=bf16)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(HIDDEN, device=dev)).to(bf16)
    size = bf16.itemsize
    rotary_args = specs.rotary_inputs(
        num_tokens, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype=bf16, device=dev
    )
    gate_up = torch.randn(num_tokens, 2 * INTER, device=dev, dtype=bf16)
    ops = {
        "add_rms_norm": {
            "args": (x, residual, weight, EPS),
            "bytes": specs.add_rms_norm_bytes(num_tokens, HIDDEN, size),
            "reference": add_rms_norm_ref,
            "token_args": (0, 1),
            "kernels": {"triton": _with_key(torch.ops.ce_kernels.add_rms_norm, key)},
        },
        "rotary": {
            "args": rotary_args,
            "bytes": specs.rotary_bytes(num_tokens, NUM_Q_HEADS + NUM_KV_HEADS, HEAD_DIM, size),
            "reference": rotary_ref,
            "token_args": (0, 1, 2),
            "kernels": {"triton": _with_key(torch.ops.ce_kernels.rotary, key)},
        },
        "silu_and_mul": {
            "args": (gate_up,),
            "bytes": specs.silu_and_mul_bytes(num_tokens, INTER, size),
            "reference": silu_and_mul_ref,
            "token_args": (0,),
            "kernels": {"triton": _with_key(torch.ops.ce_kernels.silu_and_mul, key)},
        },
    }
    helion = _helion_op()
    if helion is not None:
        ops["silu_and_mul"]["kernels"]["helion"] = _with_key(helion, key)
    return ops


@functools.cache
def _helion_op() -> Callable | None:
    try:
        import compile_engine.kernels_generated.silu_and_mul_helion  # noqa: F401  (registers the op)
    except ImportError as err:  # helion missing or not importable with this torch
        print(f"helion silu_and_mul skipped: {err}")
        return None
    return torch.ops.ce_kernels.silu_and_mul_helion


def _check(name: str, got, want) -> None:
    """A kernel that is fast and wrong must not win: compare with the reference first."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")


def run(tokens: list[int], device: str = "cuda") -> list[dict]:
    """Time every op's variants at each token count; `device` other than cuda is for smoke
    tests of this script under the Triton interpreter (float32, tiny T)."""
    from compile_engine.benchmarks.timing import graph_us

    inductor = {}
    rows = []
    for num_tokens in tokens:
        for op, spec in _ops(num_tokens, device).items():
            args, moved = spec["args"], spec["bytes"]
            if op not in inductor:  # one compiled function per op, serving every T
                inductor[op] = torch.compile(spec["reference"], dynamic=False, fullgraph=True)
            _mark_tokens_dynamic(args, spec["token_args"])
            want = spec["reference"](*args)
            variants = {
                "inductor": inductor[op],
                **spec["kernels"],
                "eager": spec["reference"],
            }
            row: dict = {"op": op, "T": num_tokens, "bytes": moved}
            for name, fn in variants.items():
                try:
                    _check(f"{op} {name} T={num_tokens}", fn(*args), want)
                    us = graph_us(functools.partial(fn, *args))
                except Exception as err:  # one broken variant must not hide the others
                    print(f"{op} {name} T={num_tokens}: FAILED {type(err).__name__}: {err}")
                    row[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                    continue
                gb_s = moved / us / 1e3
                row[name] = {
                    "us": round(us, 3),
                    "gb_s": round(gb_s, 1),
                    "pct_of_peak": round(100 * gb_s / PEAK_GB_S, 1),
                }
            base = row.get("inductor", {}).get("us")
            for name in spec["kernels"]:
                if base and "us" in row.get(name, {}):
                    row[name]["speedup_vs_inductor"] = round(base / row[name]["us"], 3)
            rows.append(row)
            print_row(row)
    return rows


def verdicts(rows: list[dict]) -> dict[str, dict]:
    """Per pass: its speed-up over Inductor at each T, and whether it wins at every T (the
    condition for default on)."""
    out: dict[str, dict] = {}
    for (op, variant), pass_name in PASS_OF.items():
        speedups = {
            str(r["T"]): r[variant].get("speedup_vs_inductor")
            for r in rows
            if r["op"] == op and variant in r
        }
        if not speedups:
            continue
        measured = [s for s in speedups.values() if s is not None]
        out[pass_name] = {
            "op": op,
            "speedup_vs_inductor": speedups,
            "beats_inductor_at_every_T": bool(measured)
            and len(measured) == len(speedups)
            and all(s > 1.0 for s in measured),
        }
    return out


def print_row(row: dict) -> None:
    cells = []
    for name in ("inductor", "triton", "helion", "eager"):
        m = row.get(name)
        if m is None:
            continue
        if "us" not in m:
            cells.append(f"{name} FAILED")
            continue
        x = f" x{m['speedup_vs_inductor']:.2f}" if "speedup_vs_inductor" in m else ""
        cells.append(f"{name} {m['us']:8.2f} us {m['gb_s']:7.0f} GB/s{x}")
    print(f"{row['op']:<13} T={row['T']:<5} | " + " | ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 2048])
    p.add_argument("--out", default=str(DEFAULT_DIRECTORY), help="where the JSON goes")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench fusions needs a CUDA device")
    rows = run(args.tokens)
    decided = verdicts(rows)
    for pass_name, v in decided.items():
        word = "beats" if v["beats_inductor_at_every_T"] else "does not beat"
        print(f"{pass_name}: {word} Inductor at every T  {v['speedup_vs_inductor']}")
    payload = {
        "shapes": {
            "hidden": HIDDEN,
            "num_q_heads": NUM_Q_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "intermediate": INTER,
            "dtype": "bfloat16",
        },
        "tokens": args.tokens,
        "peak_gb_s": PEAK_GB_S,
        "timing": "CUDA-graph replay of back-to-back calls (triton.testing.do_bench_cudagraph), "
        "median per call; same inputs every call (L2-resident below 60 MB)",
        "bytes_counted": "add_rms_norm: x, residual in, out, residual out, weight; rotary: q, k "
        "in and out, float32 cos/sin rows; silu_and_mul: 2I in, I out per token",
        "inductor": "torch.compile(reference, fullgraph) with the token dim marked dynamic "
        "(T = 1 static)",
        "rows": rows,
        "verdicts": decided,
    }
    print(f"wrote {write_result('fusions', payload, directory=args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
