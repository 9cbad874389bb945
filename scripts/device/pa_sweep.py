"""Sweep the query-tiled prefill kernel's configs at the engine's own shapes.

Device call: carry [".whl"], command: the install line (README.md), then
`python3 scripts/device/pa_sweep.py` (a minute or two on the H200). Prints one line per config and
writes $OUT/pa_sweep.json; the chosen configs live in kernels_generated/paged_attention.py.
The single-token (decode) kernel has its own sweep, scripts/device/pa_decode_sweep.py.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.getcwd())
import compile_engine.kernels_generated.paged_attention as pa  # noqa: E402

LLAMA8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


def batch(q_lens: list[int], seq_lens: list[int]) -> pa.PagedBatch:
    return pa.make_batch(q_lens, seq_lens, dtype=torch.bfloat16, device="cuda", **LLAMA8B)


def micros(b: pa.PagedBatch, **kwargs) -> tuple[float, float]:
    def fn(*args):
        return pa.paged_attention_triton(*args, **kwargs)

    r = pa.bench(b, fn=fn, cuda_graph=True, iters=10, inner=5)
    return round(r["seconds"] * 1e6, 1), round(r["gb_s"])


def sweep(table: dict, key: str, grid: list[dict], shapes: dict, **kwargs) -> list[dict]:
    base, rows = dict(table[key]), []
    for config in grid:
        table[key] = config
        row = dict(config)
        try:
            for name, b in shapes.items():
                row[name], row[name + "_gbs"] = micros(b, **kwargs)
        except Exception as e:  # a config that does not compile or fit: record it, go on
            row["error"] = str(e)[:200]
        rows.append(row)
        print(row, flush=True)
    table[key] = base
    return rows


def main() -> None:
    rng = random.Random(0)
    out: dict = {}
    decodes = [rng.randint(513, 768) for _ in range(237)]
    mixed = {
        "prefill4x512": batch([512] * 4, [512] * 4),
        "mixed_3x600_237dec": batch([600] * 3 + [1] * 237, [600] * 3 + decodes),
    }
    grid = [
        {"ROWS": r, "BLOCK_N": n, "num_warps": w, "num_stages": s}
        for r, n, w, s in itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3])
    ]
    out["tiled"] = sweep(pa._TILED_CONFIGS, "cuda", grid, mixed, tiled=True)
    for name, b in mixed.items():
        out[name + "_untiled_us"] = micros(b, tiled=False)[0]
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "pa_sweep.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
