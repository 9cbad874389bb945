"""The offline row's floor: the least time its kernels take on this GPU, one after another.

    compile-engine bench offline-floor [--seconds 6] [--out DIR]

Issue 7's offline row (1000 requests of 512 prompt tokens and 256 output tokens, Llama-3-8B
shape, bf16, at most 256 sequences at once) asks for 12,500 output tok/s: the whole run in
20.48 s. Whatever the schedule, the run's device work is the same: every prompt token and every
fed-back output token is one row of each layer's four GEMMs (qkv, o_proj, gate_up, down), every
sampled token one row of the lm_head, every fed-back token reads its sequence's K/V (contexts
513..767), every prompt attends causally over itself. This times each of those at its best rate
on this GPU and adds them up:

- GEMM rows at the rate of LLM's largest step (16,384 rows, 32 layers of distinct weights in one
  CUDA graph): no schedule gets a row cheaper, and a decode row costs as much as a prompt row
  only when it rides in such a step;
- the lm_head the same way, at 4,096 rows;
- decode attention: our kernel at 256 sequences with contexts spread over 513..767, scaled by the
  K/V the run reads;
- prompt attention: the tiled kernel, 32 prompts of 512 tokens a launch.

Each is replayed for `--seconds`, so that the board settles where the real run sits (at its
power cap: the SM clock drops), and timed over the second half; `burst_ms` is the fastest replay
of the first second. Left out, so the floor is below any real run: norms, rotary, silu, the
embedding, sampling, the host, and the GEMMs' loss at 256 rows (a decode-only step's GEMMs are
timed too, to show it). A floor above 20.48 s means that no schedule of these kernels, one after
another, meets the row; docs/compiler.md section 6 measured overlapping them (nano-batching,
scripts/device/overlap_probe.py) to lose.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from compile_engine.benchmarks.results import DEFAULT_DIRECTORY, print_table, write_result
from compile_engine.benchmarks.timing import captured, warm_up

TARGET_OUTPUT_TOK_S = 12_500.0
# Llama-3-8B.
HIDDEN, INTER, QKV, VOCAB, LAYERS = 4096, 14336, 6144, 128256, 32
ATTENTION = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
PROMPT_ROWS = 16_384  # LLM's token budget a step (OFFLINE_MAX_NUM_BATCHED_TOKENS)
LM_HEAD_ROWS = 4_096
DECODE_BATCH = 256  # max_num_seqs
PREFILL_CHUNKS = 32  # prompts a tiled-attention launch


@dataclass(frozen=True)
class Workload:
    """What the run computes, independent of how it is scheduled."""

    requests: int = 1000
    prompt_len: int = 512
    output_len: int = 256

    @property
    def gemm_rows(self) -> int:
        # The prompt, then each sampled token but the last is fed back.
        return self.requests * (self.prompt_len + self.output_len - 1)

    @property
    def lm_head_rows(self) -> int:
        return self.requests * self.output_len

    @property
    def decode_tokens(self) -> int:
        return self.requests * (self.output_len - 1)

    def decode_contexts(self) -> range:
        """The keys a fed-back token attends over, first to last: prompt + 1 .. prompt +
        output - 1 (it sees itself)."""
        return range(self.prompt_len + 1, self.prompt_len + self.output_len)

    @property
    def decode_key_reads(self) -> int:
        """Keys read by all decode attention of the run, per layer."""
        return self.requests * sum(self.decode_contexts())

    def target_seconds(self, output_tok_s: float = TARGET_OUTPUT_TOK_S) -> float:
        return self.requests * self.output_len / output_tok_s


def spread_contexts(contexts: range, n: int) -> list[int]:
    """n contexts evenly over `contexts` (first and last included), as a decode batch of the
    run holds sequences at every stage of their output."""
    first, last = contexts[0], contexts[-1]
    if n == 1:
        return [first]
    return [first + round(i * (last - first) / (n - 1)) for i in range(n)]


def floor_seconds(
    w: Workload,
    *,
    gemm_ms: float,
    gemm_rows: int,
    lm_head_ms: float,
    lm_head_rows: int,
    decode_attention_ms: float,
    decode_attention_keys: int,
    prefill_attention_ms: float,
    prefill_attention_prompts: int,
) -> dict[str, float]:
    """Seconds each part of the run takes at the measured rates: each time is one replay
    (all layers) of `..._rows` GEMM rows, of decode attention over `decode_attention_keys`
    keys, or of prompt attention for `prefill_attention_prompts` prompts."""
    parts = {
        "gemm": w.gemm_rows / gemm_rows * gemm_ms / 1e3,
        "lm_head": w.lm_head_rows / lm_head_rows * lm_head_ms / 1e3,
        "decode_attention": w.decode_key_reads / decode_attention_keys * decode_attention_ms / 1e3,
        "prefill_attention": w.requests / prefill_attention_prompts * prefill_attention_ms / 1e3,
    }
    parts["total"] = sum(parts.values())
    return parts


def _sustained(fn, seconds: float) -> dict:
    """Replay `fn` (a CUDA graph's replay) for `seconds` of wall time, each replay between two
    events; the median of the second half (the board settled) and the fastest of the first
    second, with the GPU's clocks and power beside it."""
    import torch

    from compile_engine.benchmarks.telemetry import GpuSampler

    fn()
    torch.cuda.synchronize()
    events = []
    with GpuSampler(torch.device("cuda")) as gpu:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            events.append((time.perf_counter() - start, a, b))
            if len(events) > 2:
                events[-3][2].synchronize()  # two replays queued at most: the clock is wall time
        torch.cuda.synchronize()
    times = [(t, a.elapsed_time(b)) for t, a, b in events]
    settled = sorted(ms for t, ms in times[len(times) // 2 :])
    burst = [ms for t, ms in times if t < 1.0] or [times[0][1]]
    return {
        "ms": settled[len(settled) // 2],
        "burst_ms": min(burst),
        "replays": len(times),
        "gpu": gpu.summary,
    }


def _graph(fn):
    """fn captured in a CUDA graph, its lazy initialisation (cuBLAS handles, Triton kernel
    loads) run outside the capture."""
    warm_up(fn, 1)
    return captured(fn)


LINEAR_SHAPES = ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))


def _randn(gen, *shape):
    import torch

    return (
        torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) * shape[-1] ** -0.5
    )


def _measure_gemms(seconds: float) -> dict[str, dict]:
    """The prompt-sized step's GEMMs, the lm_head, and a decode-only step's GEMMs (cuBLAS, as
    the engine runs them above 16 rows), 32 layers of distinct weights as in the model."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [[_randn(gen, n, k) for n, k in LINEAR_SHAPES] for _ in range(LAYERS)]
    lm_head = _randn(gen, VOCAB, HIDDEN)

    def step(rows: int, with_lm_head: bool):
        x, h = _randn(gen, rows, HIDDEN), _randn(gen, rows, INTER)
        outs = [x.new_empty(rows, n) for n, _ in LINEAR_SHAPES]
        logits = x.new_empty(rows, VOCAB) if with_lm_head else None

        def run():
            for weights in layers:
                for wt, out, a in zip(weights, outs, (x, x, x, h), strict=True):
                    torch.mm(a, wt.t(), out=out)
            if logits is not None:
                torch.mm(x, lm_head.t(), out=logits)

        return _graph(run)

    x_lm = _randn(gen, LM_HEAD_ROWS, HIDDEN)
    logits = x_lm.new_empty(LM_HEAD_ROWS, VOCAB)
    return {
        "gemm": _sustained(step(PROMPT_ROWS, False), seconds),
        "lm_head": _sustained(_graph(lambda: torch.mm(x_lm, lm_head.t(), out=logits)), seconds),
        "decode_step_gemm": _sustained(step(DECODE_BATCH, True), seconds),
    }


def _measure_attention(w: Workload, seconds: float) -> dict[str, dict]:
    """Decode attention over the run's contexts and the prompts' tiled attention, 32 layers."""
    import torch

    from compile_engine.benchmarks.attention_inputs import make_batch
    from compile_engine.kernels_generated import paged_attention as pa

    contexts = spread_contexts(w.decode_contexts(), DECODE_BATCH)
    decode = make_batch(
        [1] * DECODE_BATCH, contexts, dtype=torch.bfloat16, device="cuda", **ATTENTION
    ).args()
    prompts = [w.prompt_len] * PREFILL_CHUNKS
    prefill = make_batch(prompts, prompts, dtype=torch.bfloat16, device="cuda", **ATTENTION).args()

    def layers(args, **kwargs):
        def run():
            for _ in range(LAYERS):
                pa.paged_attention_triton(*args, **kwargs)

        return _graph(run)

    return {
        "decode_attention": {**_sustained(layers(decode), seconds), "keys": sum(contexts)},
        "prefill_attention": _sustained(layers(prefill, tiled=True), seconds),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench offline-floor", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=6.0, help="replay time per measurement")
    p.add_argument("--out", default=str(DEFAULT_DIRECTORY), help="where the JSON goes")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: it times the offline row's kernels on the device")
    w = Workload()
    m = _measure_gemms(args.seconds)
    torch.cuda.empty_cache()
    m |= _measure_attention(w, args.seconds)
    kwargs = dict(
        gemm_rows=PROMPT_ROWS, lm_head_rows=LM_HEAD_ROWS,
        decode_attention_keys=m["decode_attention"]["keys"],
        prefill_attention_prompts=PREFILL_CHUNKS,
    )  # fmt: skip
    settled = floor_seconds(
        w, gemm_ms=m["gemm"]["ms"], lm_head_ms=m["lm_head"]["ms"],
        decode_attention_ms=m["decode_attention"]["ms"],
        prefill_attention_ms=m["prefill_attention"]["ms"], **kwargs,
    )  # fmt: skip
    burst = floor_seconds(
        w, gemm_ms=m["gemm"]["burst_ms"], lm_head_ms=m["lm_head"]["burst_ms"],
        decode_attention_ms=m["decode_attention"]["burst_ms"],
        prefill_attention_ms=m["prefill_attention"]["burst_ms"], **kwargs,
    )  # fmt: skip
    flops_row = 2 * LAYERS * sum(n * k for n, k in LINEAR_SHAPES)
    gemm_tflops = PROMPT_ROWS * flops_row / (m["gemm"]["ms"] / 1e3) / 1e12
    target = w.target_seconds()
    payload = {
        "benchmark": "offline_floor",
        "workload": {
            "requests": w.requests,
            "input_len": w.prompt_len,
            "output_len": w.output_len,
        },  # fmt: skip
        "measured": m,
        "gemm_tflops_settled": gemm_tflops,
        "floor_s": settled,
        "floor_burst_s": burst,
        "target_s": target,
        "floor_output_tok_s": w.lm_head_rows / settled["total"],
    }
    path = write_result("offline-floor", payload, args.out)
    rows = [(f"{k} (s)", f"{v:.2f} (burst {burst[k]:.2f})") for k, v in settled.items()]
    rows += [
        ("GEMM TFLOP/s, settled", f"{gemm_tflops:.0f}"),
        ("at most, output tok/s", f"{payload['floor_output_tok_s']:,.0f}"),
        ("the target needs (s)", f"{target:.2f}"),
    ]
    print_table(rows, "offline row: its kernels alone, one after another")
    print(f"wrote {path}")
    return 0
