"""What a batch-1 decode layer's attention costs on the critical path, by ablation: 32 layers
of the engine's decode kernels at Llama-3-8B shapes (the fused norm + qkv GEMM, attention with
rotary and the cache write fused, o_proj, the fused norm + gate_up + silu, down; each with its
own weights, so every weight streams from HBM, and its own KV cache), captured in one CUDA
graph, with PDL as the engine sets it. The full chain is the engine's short-context graph at
context 100 (a block table UNSPLIT_KEYS wide, one split; before d5dedfa the table was
max_model_len's, 33 splits). Each variant changes one thing about attention and reports the
replay's time a layer against the full chain:
  - none: o_proj reads a fixed tensor, no attention kernel at all (attention's whole cost);
  - alone: attention's 32 launches by themselves in a graph (its latency with nothing ahead);
  - own key only: one cached key fewer than the token (context 1: no key loop);
  - unrotated: q and k arrive rotated (no position and cos/sin loads);
  - wide table (33 splits): max_model_len's table, as the engine ran before d5dedfa;
  - o_proj released at once (COMPILE_ENGINE_PDL_TRIGGER_ATTENTION=1: attention, now 8
    programs, releases o_proj right after its wait, so o_proj's programs take the idle SMs and
    put their first K-tile into L2 while attention runs), o_proj prefetched whole
    (COMPILE_ENGINE_PDL_PREFETCH_MB=34), and both (both lost at db83b9a with 33 splits);
  - PDL off: every launch plain.
Then the split choice from short contexts to long (40 to 4,000 keys): the wide table's, with
a larger MIN_SPLIT_KEYS, and one split; and at 40-160 keys, where the engine now runs
unsplit, 2-3 splits sharing the keys and the unsplit launch's BLOCK_N, warps and stages.
--ablation-only skips the sweeps.
Context 100 keys (the latency benchmark's decode runs 33-160). Run at bc18130 (the wide
table, 33 splits, of which 2 hold keys at this context, and "one split" in place of the
wide-table and PDL rows) on the H200 (us a layer, two rounds): full chain
121.70 / 122.73, none 114.03 / 114.76 (attention costs 7.8), alone 6.31 / 6.26, own key only
118.57 / 118.54 (the 100 cached keys cost 3.65), unrotated 122.13 / 122.36 (rotary costs
nothing), one split 121.17 / 121.28 (1 us less), PDL off 126.06 / 126.11 (docs/compiler.md,
section 6, item 10); that run timed its own graph replays, since then `bench gemm`'s. At
908d9f3 (the sweep's first run; a removed variant, splits without keys returning before the
PDL wait, lost 0.3-0.6 us a layer everywhere), one split against the table's 33: -0.75 /
-1.38 / +0.05 / +19.4 / +89.0 us a layer at 40 / 100 / 160 / 1,000 / 4,000 keys, hence a
batch-1 launch on a table of <= 160 keys runs unsplit (`UNSPLIT_KEYS`). At 0cf8407 (full
chain the short-context graph): full chain 118.80 / 119.63, none -5.99, own key only -3.24,
wide table +1.83, o_proj released at once +0.18, prefetched whole +2.61, both +1.60, PDL off
+3.92; on the short table, against one split, 2-3 splits +0.6 to +1.2 except 3 splits at 160
keys (-0.88), BLOCK_N 128 -0.30 at 100 keys but +0.45 at 160, 8 warps / 3 stages / BLOCK_N 32
+0.02 to +2.8: nothing to change. At a805b06, two removed variants: attention reading its
metadata and prefetching its cached K/V into L2 before the PDL wait +0.42, with the qkv GEMM
releasing it at once (so the prefetch runs during the whole GEMM) +0.20, the release alone
+0.76 (engine: 246.6 / 246.7 and 246.7 / 246.7 tok/s against 246.5 / 246.2). At 631cf3c / 8dedeb8
attention fused into the o_proj launch (removed; the kernel is in 8dedeb8's
kernels_generated/attention_o_proj.py): program (n, h) computed KV head h's attention (the
same in all 32 programs of the head, keys from L2), multiplied its 128 rows of o_proj's
columns for that head by it, and the last of the 8 programs of rows n summed the partials;
+2.87 / +2.84 us a layer with its o_proj slice prefetched into L2 before the PDL wait, +1.29
without the prefetch, +4.6 / +5.6 with 4 warps / BLOCK_N 32, and +9.8 to +21.6 holding the
first weight tile in registers across the attention or pipelining the weight loop (register
pressure): the weight cannot start streaming into the SMs before the attention is done, and
staging 32 MiB of it in L2 meanwhile loses, as the prefetch rows above do. On the
device, after decode_bench.sh's wheel install line (carry [".whl"]):
    python3 scripts/device/attention_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

import torch

import compile_engine.kernels_generated.paged_attention as pa
from compile_engine.benchmarks.gemm import graph_time_us
from compile_engine.kernels_generated import skinny_gemm as sg
from compile_engine.kernels_generated.device import (
    PDL_ATTENTION_TRIGGER_ENV,
    PDL_ENV,
    PDL_PREFETCH_ENV,
    ab_switch,
    pdl_settings,
)

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 32, 4096, 32, 8, 128, 14336
BLOCK, TABLE_WIDTH, CONTEXT = 16, 131072 // 16, 100
SWEEP_CONTEXTS = (40, 100, 160, 1000, 4000)
SHORT_CONTEXTS = (40, 100, 160)
NUM_BLOCKS = -(-(max(SWEEP_CONTEXTS) + 1) // BLOCK) + 2  # each layer's cache, scratch block 0
DEV, DT = "cuda", torch.bfloat16


def weights(gen: torch.Generator) -> list[dict]:
    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=DEV) * shape[-1] ** -0.5).to(DT)

    return [
        {
            "qkv": rand((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            "o": rand(HIDDEN, HEADS * HEAD_DIM),
            "gate_up": rand(2 * INTER, HIDDEN),
            "down": rand(HIDDEN, INTER),
            "norm1": torch.ones(HIDDEN, device=DEV, dtype=DT),
            "norm2": torch.ones(HIDDEN, device=DEV, dtype=DT),
            "cache": torch.randn(
                2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen, device=DEV
            ).to(DT),
        }
        for _ in range(LAYERS)
    ]


def step_inputs(context: int, table_width: int = TABLE_WIDTH) -> dict:
    """One decode token at position `context` (its sequence context + 1 keys long), its block
    table `table_width` blocks wide (the split choice follows the width)."""
    layout = pa.paged_layout(
        [1], [context + 1], block_size=BLOCK, device=DEV, table_width=table_width,
        num_blocks=NUM_BLOCKS,
    )  # fmt: skip
    batch = pa.make_batch([1], [context + 1], dtype=DT, device=DEV, num_q_heads=HEADS,
                          num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK)  # fmt: skip
    _, _, _, positions, table = pa.rotary_inputs(batch, HEAD_DIM)
    return {
        "slots": layout.slot_mapping,
        "block_tables": layout.block_tables,
        "seq_lens": layout.seq_lens,
        "query_start_loc": layout.query_start_loc,
        "positions": positions,
        "cos_sin": table,
        "scale": batch.scale,
    }


def forward(layers, meta, x, residual, attention="full", num_splits=None, rotary=True):
    fixed = torch.zeros(1, HEADS, HEAD_DIM, device=DEV, dtype=DT)
    for w in layers:
        qkv, residual = sg.add_rms_norm_linear(x, residual, w["norm1"], 1e-5, w["qkv"], False)
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
        if attention == "none":
            out = fixed
        else:
            rot = (
                {"positions": meta["positions"], "cos_sin_cache": meta["cos_sin"]} if rotary else {}
            )
            out = pa.paged_attention_triton(
                q.view(1, HEADS, HEAD_DIM), k.view(1, KV_HEADS, HEAD_DIM),
                v.view(1, KV_HEADS, HEAD_DIM), w["cache"], meta["slots"], meta["block_tables"],
                meta["seq_lens"], meta["query_start_loc"], meta["scale"], num_splits=num_splits,
                **rot,
            )  # fmt: skip
        x = sg.linear(out.reshape(1, -1), w["o"])
        up, residual = sg.add_rms_norm_linear(x, residual, w["norm2"], 1e-5, w["gate_up"], True)
        x = sg.linear(up, w["down"])
    return x


def attention_alone(layers, meta, q, k, v):
    for w in layers:
        pa.paged_attention_triton(
            q, k, v, w["cache"], meta["slots"], meta["block_tables"], meta["seq_lens"],
            meta["query_start_loc"], meta["scale"], positions=meta["positions"],
            cos_sin_cache=meta["cos_sin"],
        )  # fmt: skip


def replay_us(fn) -> float:
    """Median time of `fn` replayed from a CUDA graph (`bench gemm`'s timing), in us a layer."""
    return graph_time_us([fn], replays=30) / LAYERS


@contextlib.contextmanager
def attention_setting(env: dict | None = None, **overrides):
    """The batch-1 config's entries (MIN_SPLIT_KEYS, BLOCK_N, num_warps, ...) and PDL's
    environment settings (device.py) for a while."""
    config = pa._CONFIGS["cuda"][0][1]  # the config of launches from 1 token
    saved = dict(config)
    config.update(overrides)
    saved_env = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    pdl_settings.cache_clear()
    ab_switch.cache_clear()
    try:
        yield
    finally:
        config.clear()
        config.update(saved)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
        pdl_settings.cache_clear()
        ab_switch.cache_clear()


def timed(fn, **setting) -> float:
    with attention_setting(**setting):
        return replay_us(fn)


def print_rows(title: str, results: dict, base: str) -> None:
    print(title)
    ref = statistics.mean(results[base])
    for name, us in results.items():
        mean = statistics.mean(us)
        print(f"  {name:<34} {us[0]:7.2f} {us[1]:7.2f}   vs {base} {mean - ref:+6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--ablation-only", action="store_true", help="skip the split sweeps")
    args = p.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    layers = weights(gen)
    x = torch.randn(1, HIDDEN, generator=gen, device=DEV).to(DT)
    residual = torch.randn(1, HIDDEN, generator=gen, device=DEV).to(DT)
    # The engine's short-context graph at CONTEXT: a table UNSPLIT_KEYS wide, one split.
    short_width = pa.decode_config(1, torch.device(DEV))["UNSPLIT_KEYS"] // BLOCK
    meta, short = step_inputs(CONTEXT, short_width), step_inputs(0, short_width)
    wide = step_inputs(CONTEXT)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=gen, device=DEV).to(DT)
    k = torch.randn(1, KV_HEADS, HEAD_DIM, generator=gen, device=DEV).to(DT)
    v = torch.randn(1, KV_HEADS, HEAD_DIM, generator=gen, device=DEV).to(DT)
    splits = pa.choose_num_splits(1, KV_HEADS, short_width * BLOCK, torch.device(DEV))
    released = {PDL_ATTENTION_TRIGGER_ENV: "1"}  # attention releases o_proj right after its wait
    whole = {PDL_PREFETCH_ENV: "34"}  # o_proj (32 MiB) prefetches its whole slice into L2
    ablations = {
        "full chain": (lambda: forward(layers, meta, x, residual), {}),
        "none": (lambda: forward(layers, meta, x, residual, attention="none"), {}),
        "alone": (lambda: attention_alone(layers, meta, q, k, v), {}),
        "own key only": (lambda: forward(layers, short, x, residual), {}),
        "unrotated": (lambda: forward(layers, meta, x, residual, rotary=False), {}),
        "wide table (33 splits)": (lambda: forward(layers, wide, x, residual), {}),
        "o_proj released at once": (lambda: forward(layers, meta, x, residual), {"env": released}),
        "o_proj prefetched whole": (lambda: forward(layers, meta, x, residual), {"env": whole}),
        "both": (
            lambda: forward(layers, meta, x, residual),
            {"env": {**released, **whole}},
        ),
    }
    ablation = {}
    for _ in range(2):  # two rounds, variants alternating, against clock drift
        for name, (fn, setting) in ablations.items():
            ablation.setdefault(name, []).append(timed(fn, **setting))
    sweep_contexts, short_contexts = (
        ((), ()) if args.ablation_only else (SWEEP_CONTEXTS, SHORT_CONTEXTS)
    )
    # How a batch-1 split choice fares from short contexts to long: the table's (33 splits
    # sharing a sequence's keys at least MIN_SPLIT_KEYS each), with a larger MIN_SPLIT_KEYS,
    # and no split at all.
    choices = {
        "table": {},
        "MIN_SPLIT_KEYS 128": {"MIN_SPLIT_KEYS": 128},
        "MIN_SPLIT_KEYS 256": {"MIN_SPLIT_KEYS": 256},
        "one split": {"num_splits": 1},
    }
    sweep: dict[int, dict] = {}
    for context in sweep_contexts:
        step = step_inputs(context)
        for _ in range(2):
            for name, choice in choices.items():
                splits_arg = {"num_splits": choice["num_splits"]} if "num_splits" in choice else {}
                setting = {key: val for key, val in choice.items() if key != "num_splits"}
                fn = lambda step=step, kw=splits_arg: forward(layers, step, x, residual, **kw)  # noqa: E731
                sweep.setdefault(context, {}).setdefault(name, []).append(timed(fn, **setting))
    # Where the engine now runs unsplit (a table of <= UNSPLIT_KEYS keys, the short-context
    # graphs): a few splits sharing the keys instead, and the unsplit launch's config.
    short_choices = {
        "one split": {"num_splits": 1},
        "2 splits": {"num_splits": 2},
        "2 splits, MIN_SPLIT_KEYS 32": {"num_splits": 2, "MIN_SPLIT_KEYS": 32},
        "3 splits, MIN_SPLIT_KEYS 32": {"num_splits": 3, "MIN_SPLIT_KEYS": 32},
        "one split, BLOCK_N 32": {"num_splits": 1, "BLOCK_N": 32},
        "one split, BLOCK_N 128": {"num_splits": 1, "BLOCK_N": 128},
        "one split, 8 warps": {"num_splits": 1, "num_warps": 8},
        "one split, 3 stages": {"num_splits": 1, "num_stages": 3},
        "one split, BLOCK_N 32, 2 warps": {"num_splits": 1, "BLOCK_N": 32, "num_warps": 2},
    }
    short_sweep: dict[int, dict] = {}
    for context in short_contexts:
        step = step_inputs(context)
        for _ in range(2):
            for name, choice in short_choices.items():
                setting = {key: val for key, val in choice.items() if key != "num_splits"}
                fn = lambda step=step, n=choice["num_splits"]: forward(  # noqa: E731
                    layers, step, x, residual, num_splits=n
                )
                short_sweep.setdefault(context, {}).setdefault(name, []).append(
                    timed(fn, **setting)
                )
    os.environ[PDL_ENV] = "0"
    pdl_settings.cache_clear()
    ablation["PDL off (full chain)"] = [replay_us(ablations["full chain"][0]) for _ in range(2)]
    print_rows(
        f"batch 1, context {CONTEXT}, {splits} splits chosen; us a layer (2 rounds):",
        ablation,
        "full chain",
    )
    for context, results in sweep.items():
        print_rows(f"context {context}, us a layer (2 rounds):", results, "table")
    for context, results in short_sweep.items():
        print_rows(f"context {context}, short table, us a layer (2 rounds):", results, "one split")
    if args.out:
        record = {
            "context": CONTEXT,
            "splits": splits,
            "us_per_layer": ablation,
            "sweep": sweep,
            "short_sweep": short_sweep,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
