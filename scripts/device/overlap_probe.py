"""Can decode attention hide behind prompt GEMMs on the H200 (nano-batching, docs/compiler.md
section 6 on the offline row)? Before building it into the engine, the bound it can reach.

One Llama-3-8B layer's GEMMs (qkv, o_proj, gate_up, down; cuBLAS, bf16) and one layer's decode
attention (our paged-attention kernel, 256 sequences at context 640: the offline run's decode
steps), 32 layers:

- `gemm P` / `gemm P+D` / `attention`: each alone, P = 512 prompt tokens, D = 256 decodes;
- `engine now`: what a mixed offline step does today, one GEMM over all 768 rows, then attention;
- `nano`: prompt rows on one stream (their GEMMs), decode rows on another (their GEMMs, then
  attention), so attention can run beside the prompt GEMMs; again with cuBLAS told to leave
  k SMs free (`torch._C._set_sm_carveout_experimental`), so that attention finds SMs.

Prints ms a step (32 layers) and what `nano` saves against `engine now`. Run at 56664d2 on
the H200: engine now 20.58 ms, nano 22.26 (+8.2%), nano with 8 / 16 / 32 / 48 SMs left free
23.09 / 22.94 / 22.86 / 23.08; alone, P 9.82, D 6.08, P+D 15.12, attention 5.38. Nano-batching
loses here (docs/compiler.md section 6). On the device, after decode_bench.sh's wheel install
line (carry [".whl"]):
    python3 scripts/device/overlap_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compile_engine.kernels_generated import paged_attention as pa

DEV, DT, LAYERS = "cuda", torch.bfloat16, 32
HIDDEN, INTER, QKV = 4096, 14336, 6144
LLAMA8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)

torch.manual_seed(0)
weights = [
    (torch.randn(n, k, device=DEV, dtype=DT) * k**-0.5)
    for n, k in ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))
]
batch = pa.make_batch([1] * 256, [640] * 256, dtype=DT, device=DEV, **LLAMA8B)
attn_args = batch.args(batch.kv_cache)


def gemms(rows: int):
    x = torch.randn(rows, HIDDEN, device=DEV, dtype=DT)
    h = torch.randn(rows, INTER, device=DEV, dtype=DT)
    wqkv, wo, wgu, wd = weights

    def run():
        F.linear(x, wqkv)
        F.linear(x, wo)
        F.linear(x, wgu)
        F.linear(h, wd)

    return run


def attention():
    pa.paged_attention_triton(*attn_args)


prompt, decode, mixed = gemms(512), gemms(256), gemms(768)
side = torch.cuda.Stream()


def layers(*work):
    for _ in range(LAYERS):
        for fn in work:
            fn()


def nano():
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        layers(decode, attention)
    layers(prompt)
    main.wait_stream(side)


def timed(fn, carveout: int | None = None, reps: int = 3) -> float:
    if carveout is not None:
        torch._C._set_sm_carveout_experimental(carveout)
    try:
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end))
        return best
    finally:
        if carveout is not None:
            torch._C._set_sm_carveout_experimental(None)


rows = {
    "gemm P (512 rows)": timed(lambda: layers(prompt)),
    "gemm D (256 rows)": timed(lambda: layers(decode)),
    "gemm P+D (768 rows)": timed(lambda: layers(mixed)),
    "attention (256 x 640)": timed(lambda: layers(attention)),
    "engine now (768-row GEMMs, attention)": timed(lambda: layers(mixed, attention)),
    "nano (two streams)": timed(nano),
}
for k in (8, 16, 32, 48):
    try:
        rows[f"nano, cuBLAS leaves {k} SMs"] = timed(nano, carveout=k)
    except Exception as e:  # noqa: BLE001 - report and go on: the probe's other rows stand
        print(f"carveout {k}: {type(e).__name__}: {e}")
now = rows["engine now (768-row GEMMs, attention)"]
print(f"{'variant':<42}{'ms a step':>10}{'vs now':>9}")
for name, ms in rows.items():
    print(f"{name:<42}{ms:>10.2f}{100 * (ms / now - 1):>8.1f}%")
