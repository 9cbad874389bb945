"""`bench latency`: decode speed at fixed batch sizes, against the bandwidth roofline.

For each batch size B: B random token-id prompts of --input-len, greedy, ignore_eos,
--output-len new tokens each, all submitted at once. One warmup run of the same shape, then
--num-iters measured runs. The clock for decode starts when every request holds its first token
(prefill done, device drained) and stops when the last finishes, so

    decode tok/s = tokens produced after that point / decode seconds  (= B * (output_len - 1) / s)

and prefill is reported on its own. Decode at these sizes is bound by memory bandwidth: each
step reads every weight once (the embedding table aside, which only gathers B rows) plus each
request's KV so far. The roofline is B tokens per (those bytes / copy rate); the copy rate is the
H200's measured 4.26e12 B/s on CUDA (BRIEF.md) and is measured here on a CPU.

With --hf-reference, the same model directory then runs under HF transformers (no
torch.compile, eager attention unless --hf-attn sdpa) in the same process on the same device,
our engine freed first, on the same prompts: issue 7's same-run reference. HF's generate()
cannot be stepped, so its decode rate comes from two calls on the same prompts,

    HF decode tok/s = B * (output_len - 1) / (t_generate(output_len) - t_generate(1))

which cancels prefill, the first token and generate()'s fixed setup cost.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

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

if TYPE_CHECKING:
    from compile_engine.models.loader import ModelSource

H200_COPY_RATE = 4.26e12  # B/s, copy read+write, measured on the H200 on 2026-11-29


def measure_copy_rate(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes moved (read + write) per second by a large device-to-device copy, best of repeats."""
    if nbytes is None:
        nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        with timed(device) as t:
            dst.copy_(src)
        best = min(best, t[0])
    return 2 * nbytes / best


def weight_bytes_per_step(llm) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied
    embedding table, of which a step gathers only its batch's rows."""
    model = llm.engine.loaded.model
    tied = llm.engine.model_config.tie_word_embeddings
    total = 0
    for name, p in model.named_parameters():  # tied parameters are listed once
        if name.endswith("embed_tokens.weight") and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(llm) -> int:
    """From the model's own cache layout (K and V per head, or an MLA latent)."""
    loaded = llm.engine.loaded
    element = torch.empty((), dtype=loaded.cache_dtype).element_size()  # 1 for an FP8 cache
    per_layer = math.prod(loaded.model.kv_cache_shape(1, 1))
    return loaded.config.num_layers * per_layer * element


def run_once(llm, prompts: list[list[int]], params, device: torch.device) -> dict:
    """Drive the engine step by step; split prefill from decode at the first step after which
    every request holds a token."""
    from compile_engine.runtime.engine import RequestOutput

    engine = llm.engine
    before = engine.stats()
    preempted_before = before.num_preemptions_total
    remaining_first = set()
    synchronize(device)
    t_start = time.perf_counter()
    for prompt in prompts:
        rid = engine.next_request_id()
        engine.add_request(rid, prompt, params)
        remaining_first.add(rid)
    t_decode = None
    decode_tokens = decode_steps = 0
    batch_sizes: list[int] = []
    step_s: list[float] = []
    while engine.has_unfinished_requests():
        decoding = t_decode is not None
        if decoding:
            batch_sizes.append(len(engine.scheduler.running))
        t0 = time.perf_counter()
        outs: list[RequestOutput] = engine.step()
        if not decoding:
            for out in outs:
                if out.outputs[0].token_ids:
                    remaining_first.discard(out.request_id)
            if not remaining_first:
                synchronize(device)
                t_decode = time.perf_counter()
            continue
        # The runner returns token ids to the host each step, so a step's host time is its
        # device time too; no extra synchronize that would hide future overlap.
        step_s.append(time.perf_counter() - t0)
        decode_steps += 1
        decode_tokens += sum(len(c.delta_token_ids) for o in outs for c in o.outputs)
    synchronize(device)
    t_end = time.perf_counter()
    prefill_s = t_decode - t_start
    decode_s = t_end - t_decode
    after = engine.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {
        "prefill_s": prefill_s,
        "prefill_tok_s": sum(map(len, prompts)) / prefill_s,
        "decode_s": decode_s,
        "decode_steps": decode_steps,
        "decode_tokens": decode_tokens,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "ms_per_step": 1e3 * decode_s / max(decode_steps, 1),
        "median_step_ms": 1e3 * statistics.median(step_s) if step_s else 0.0,
        # A one-off stall (a compile, a collection) shows here and in the mean, not the median.
        "max_step_ms": 1e3 * max(step_s) if step_s else 0.0,
        "min_decode_batch": min(batch_sizes, default=0),
        "max_decode_batch": max(batch_sizes, default=0),
        "preemptions": after.num_preemptions_total - preempted_before,
        "e2e_s": t_end - t_start,
        # Speculative decoding (vLLM's mean acceptance length: tokens a verifying row emits,
        # 1 + accepted drafts per row); None when no row verified drafts.
        "spec_drafts": drafts,
        "spec_accepted_tokens": accepted,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def latency_prompts(
    batch_sizes: list[int], input_len: int, vocab_size: int, *, num_runs: int, seed: int
) -> dict[int, list[list[list[int]]]]:
    """Every run's prompts per batch size, warmups first, drawn from one generator in the order
    the runs use them: the HF reference replays exactly the prompts our engine saw."""
    rng = random.Random(seed)
    return {
        b: [random_prompts(b, input_len, vocab_size, rng) for _ in range(num_runs)]
        for b in batch_sizes
    }


def bench_latency(
    llm,
    *,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    num_iters: int = 3,
    num_warmup: int = 1,
    copy_rate: float | None = None,
    seed: int = 0,
) -> dict:
    """Run every batch size; return the payload for write_result."""
    from compile_engine.runtime.sampling_params import SamplingParams

    if output_len < 2:
        raise ValueError("--output-len must be >= 2: decode starts after the first token")
    device = llm.engine.config.device
    if copy_rate is None:
        copy_rate = H200_COPY_RATE if device.type == "cuda" else measure_copy_rate(device)
        source = "BRIEF.md (H200)" if device.type == "cuda" else "measured"
    else:
        source = "given"
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    prompts = latency_prompts(
        batch_sizes, input_len, vocab, num_runs=num_warmup + num_iters, seed=seed
    )
    weights = weight_bytes_per_step(llm)
    kv_token = kv_bytes_per_token(llm)
    # Keys a decode step reads, averaged over decode steps j = 1..output_len-1 (input_len + j).
    mean_context = input_len + output_len / 2
    payload: dict = {
        "benchmark": "latency",
        "input_len": input_len,
        "output_len": output_len,
        "num_iters": num_iters,
        "num_warmup": num_warmup,
        "copy_rate_B_s": copy_rate,
        "copy_rate_source": source,
        "weight_bytes_per_step": weights,
        "kv_bytes_per_token": kv_token,
        "batches": {},
    }
    for b in batch_sizes:
        for warmup in prompts[b][:num_warmup]:
            run_once(llm, warmup, params, device)
        with GpuSampler(device) as gpu:
            runs = [run_once(llm, m, params, device) for m in prompts[b][num_warmup:]]
        tok_s = statistics.median(r["decode_tok_s"] for r in runs)
        step_bytes = weights + b * mean_context * kv_token
        roofline = b * copy_rate / step_bytes
        payload["batches"][str(b)] = {
            "decode_tok_s": tok_s,
            "ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
            "prefill_s": statistics.median(r["prefill_s"] for r in runs),
            "bytes_per_step": step_bytes,
            "roofline_tok_s": roofline,
            "roofline_pct": 100 * tok_s / roofline,
            "gpu": gpu.summary,  # clocks and power through the measured runs
            "runs": runs,
        }
        if llm.engine.config.speculative_config is not None:
            lengths = [r["mean_acceptance_length"] for r in runs if r["mean_acceptance_length"]]
            mean_length = statistics.median(lengths) if lengths else None
            payload["batches"][str(b)]["mean_acceptance_length"] = mean_length
        payload[f"decode_bs{b}_tok_s"] = tok_s
    step = draft_step_ms(llm)
    if step is not None:
        payload["spec_draft_step_ms_bs1"] = step
    return payload


def draft_step_ms(llm) -> float | None:
    """One draft step of an EAGLE-3 or MTP head at batch 1, in ms (its one-token forward,
    logits and argmax, the device drained: runtime/speculative_heads.py); None without one."""
    speculator = llm.engine.runner.speculator
    proposer = getattr(speculator, "proposer", None)
    if not hasattr(proposer, "draft_step_seconds"):
        return None
    return 1e3 * proposer.draft_step_seconds()


class HFReferenceError(RuntimeError):
    """--hf-reference cannot run: HF transformers cannot load the model, or decoded other than
    the tokens asked for."""


def hf_reference_path(source: ModelSource) -> Path:
    """The directory our engine read its weights from (an artifact resolves to its source or
    to the HF export of a GGUF it keeps), if transformers can load it."""
    path = source.path
    loadable = (
        source.kind == "hf" and (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    )
    if not loadable:
        raise HFReferenceError(
            f"--hf-reference loads the model with HF transformers, but our engine read it from "
            f"{source.kind} {path}, which is not an HF directory with config.json and "
            "*.safetensors. Pass such a directory (e.g. one `bench make-model` wrote, or a "
            "save_pretrained checkpoint), or an artifact built from one or from a GGUF file; "
            "a GGUF file or alias cannot be the HF reference. Or run without --hf-reference."
        )
    return path


def load_hf_reference(
    path: Path, dtype: torch.dtype, device: torch.device, attn_implementation: str = "eager"
):
    """transformers' own model for `path`, in our engine's dtype, on our engine's device."""
    from transformers import AutoModelForCausalLM

    try:
        # A one-device device_map places weights as they load (no host copy of an 8B model)
        # and needs no accelerate.
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, device_map=device
        )
    except (OSError, ValueError, KeyError) as e:
        raise HFReferenceError(
            f"HF transformers could not load {path} for --hf-reference ({e}); it needs an HF "
            "directory with config.json and *.safetensors of an architecture transformers "
            "knows. Run without --hf-reference, or pass such a directory."
        ) from e
    return model.eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    """Greedy decode of exactly `new_tokens` per prompt (equal-length prompts, no padding);
    returns the new tokens, [B, new_tokens]. min_new_tokens keeps eos from ending a row by
    masking it, where our ignore_eos may emit it and go on: the same work, not always the same
    tokens."""
    input_ids = torch.tensor(prompts, dtype=torch.long, device=model.device)  # [B, input_len]
    pad = model.generation_config.pad_token_id
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        # Never used (no row stops early); set so that generate() does not warn.
        pad_token_id=0 if pad is None else pad,
    )
    new = out[:, input_ids.shape[1] :]  # [B, new_tokens]
    if new.shape != (len(prompts), new_tokens):
        # A rate over tokens that were not produced would flatter the reference.
        raise HFReferenceError(
            f"HF generate returned {tuple(new.shape)} new tokens, expected "
            f"({len(prompts)}, {new_tokens}); its generation config stops early"
        )
    return new


def bench_hf_reference(
    model,
    prompts: dict[int, list[list[list[int]]]],
    *,
    output_len: int,
    num_iters: int,
    device: torch.device,
) -> dict[int, dict]:
    """Per batch size: one warmup generate, then for each of the last `num_iters` prompt sets
    (the ones our measured runs used) t_generate(1) and t_generate(output_len), the device
    drained around each. Decode tok/s from the medians of the two times."""
    results: dict[int, dict] = {}
    with torch.inference_mode():
        for b, sets in prompts.items():
            hf_generate(model, sets[0], output_len)
            t_one: list[float] = []
            t_all: list[float] = []
            for measured in sets[-num_iters:]:
                with timed(device) as t:
                    hf_generate(model, measured, 1)
                t_one.append(t[0])
                with timed(device) as t:
                    hf_generate(model, measured, output_len)
                t_all.append(t[0])
            decode_s = statistics.median(t_all) - statistics.median(t_one)
            results[b] = {
                # <= 0 only when noise swamps decode (a tiny model): report no rate, not a wild one.
                "decode_tok_s": b * (output_len - 1) / decode_s if decode_s > 0 else 0.0,
                "t_generate_1_s": statistics.median(t_one),
                "t_generate_n_s": statistics.median(t_all),
                "runs": [
                    {"t_generate_1_s": a, "t_generate_n_s": n}
                    for a, n in zip(t_one, t_all, strict=True)
                ],
            }
    return results


def free_engine(llm, device: torch.device) -> int | None:
    """Drop our engine's weights, KV pool, CUDA graphs and compiled code so that HF gets the
    memory (nothing else may hold `llm.engine`). Returns the CUDA bytes still allocated, which
    the JSON records: well above zero means something kept the engine alive."""
    llm.engine = None
    # Dynamo's cache keeps the compiled graphs, and through them our weights, alive.
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated(device)
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench latency", description=__doc__.splitlines()[0])
    # LLM's own default budget, as for bench throughput: this times the offline API, and a
    # smaller budget prefills the batch over several steps, so the first-prefilled requests
    # finish steps ahead and the last decode steps run part-empty.
    add_engine_flags(p, max_num_seqs=None, max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--batch-sizes", default="1,64,256", help="comma-separated")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3, help="measured runs; the median counts")
    p.add_argument("--num-warmup", type=int, default=1)
    p.add_argument(
        "--copy-rate",
        default=None,
        help="bytes/s for the roofline, or 'measure'; default 4.26e12 on CUDA, measured on CPU",
    )
    p.add_argument(
        "--hf-reference",
        action="store_true",
        help="then time HF transformers on the same model, device, dtype and prompts",
    )
    p.add_argument(
        "--hf-attn",
        default="eager",
        choices=["eager", "sdpa"],
        help="attn_implementation of the HF reference",
    )
    p.add_argument(
        "--hf-model",
        default=None,
        help="the HF directory HF transformers runs for --hf-reference, for a model our engine "
        "reads from GGUF (an HF export of the file's weights, dequantized); default: our source",
    )
    p.add_argument(
        "--hf-dtype",
        default=None,
        help="HF's dtype for --hf-reference (float32: the issue-29 comparison of a quantized "
        "run); default: our engine's",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for our runs and HF's alike (default: torch's); on a CPU shared "
        "with other work one thread a core that is free beats a thread that waits on a busy one",
    )
    p.add_argument("--name", default="latency", help="result file name prefix")
    return p


def main(argv: list[str] | None = None) -> int:
    from compile_engine.models import loader
    from compile_engine.runtime.llm import LLM

    args = build_parser().parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if args.max_num_seqs is None:
        args.max_num_seqs = max(batch_sizes)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    init_s = time.perf_counter() - t0
    # Checked now so that a model HF cannot load fails before the engine's runs, not after.
    hf_path = None
    if args.hf_reference:
        hf_path = (
            hf_reference_path(loader.ModelSource(Path(args.hf_model), "hf"))
            if args.hf_model
            else hf_reference_path(llm.engine.loaded.source)
        )
    copy_rate = None
    if args.copy_rate == "measure":
        copy_rate = measure_copy_rate(llm.engine.config.device)
    elif args.copy_rate is not None:
        copy_rate = float(args.copy_rate)
    payload = bench_latency(
        llm,
        batch_sizes=batch_sizes,
        input_len=args.input_len,
        output_len=args.output_len,
        num_iters=args.num_iters,
        num_warmup=args.num_warmup,
        copy_rate=copy_rate,
        seed=args.seed,
    )
    if args.copy_rate == "measure":
        payload["copy_rate_source"] = "measured"
    payload.update(model=args.model, model_config=model_summary(llm), engine=engine_settings(llm))
    payload["llm_init_s"] = init_s
    payload["torch_threads"] = torch.get_num_threads()
    device = llm.engine.config.device
    quant = llm.engine.loaded.quant
    payload["quantization"] = quant.describe() if quant is not None else None
    gguf_cpu = device.type == "cpu" and quant is not None and quant.method == "gguf"
    if hf_path is not None:
        dtype, vocab = llm.engine.loaded.dtype, llm.engine.model_config.vocab_size
        if args.hf_dtype is not None:
            dtype = getattr(torch, args.hf_dtype)
        left = free_engine(llm, device)
        del llm
        add_hf_reference(payload, hf_path, dtype, vocab, device, args, batch_sizes, left)
    if gguf_cpu:  # issue 29's recorded keys
        for b in batch_sizes:
            payload[f"cpu_gguf_decode_bs{b}_tok_s"] = payload[f"decode_bs{b}_tok_s"]
            if f"hf_eager_decode_bs{b}_tok_s" in payload:
                payload[f"cpu_hf_decode_bs{b}_tok_s"] = payload[f"hf_eager_decode_bs{b}_tok_s"]
    weight_only = device.type == "cuda" and quant is not None and quant.scheme.activation == "none"
    if weight_only and quant.scheme.weight in ("int4", "uint4_zp", "int8", "uint8_zp"):
        for b in batch_sizes:  # issue 29's recorded keys: int4_decode_bs1_tok_s, ...
            key = f"int{quant.scheme.bits}_decode_bs{b}_tok_s"
            payload[key] = payload[f"decode_bs{b}_tok_s"]
    if device.type == "cuda" and quant is not None and quant.scheme.weight == "fp8_e4m3":
        for b in batch_sizes:  # issue 28's: fp8_decode_bs1_tok_s, ...
            payload[f"fp8_decode_bs{b}_tok_s"] = payload[f"decode_bs{b}_tok_s"]
    path = write_result(args.name, payload, args.results_dir, device=device.type)
    print_latency(payload)
    print(f"wrote {path}")
    return 0


def add_hf_reference(
    payload: dict,
    path: Path,
    dtype: torch.dtype,
    vocab: int,
    device: torch.device,
    args: argparse.Namespace,
    batch_sizes: list[int],
    engine_bytes_left: int | None,
) -> None:
    """Time HF on the prompts our runs used (`vocab` is our engine's, so the same draws) and
    add its numbers beside ours."""
    t0 = time.perf_counter()
    model = load_hf_reference(path, dtype, device, args.hf_attn)
    load_s = time.perf_counter() - t0
    prompts = latency_prompts(
        batch_sizes,
        args.input_len,
        vocab,
        num_runs=args.num_warmup + args.num_iters,
        seed=args.seed,
    )
    results = bench_hf_reference(
        model, prompts, output_len=args.output_len, num_iters=args.num_iters, device=device
    )
    payload["hf_reference"] = {
        "model_path": str(path),
        "attn_implementation": args.hf_attn,
        "dtype": str(dtype).removeprefix("torch."),
        "load_s": load_s,
        "engine_bytes_left_after_free": engine_bytes_left,
    }
    for b, r in results.items():
        batch = payload["batches"][str(b)]
        batch["hf_decode_tok_s"] = r["decode_tok_s"]
        batch["hf_t_generate_1_s"] = r["t_generate_1_s"]
        batch["hf_t_generate_n_s"] = r["t_generate_n_s"]
        batch["hf_runs"] = r["runs"]
        payload[f"hf_eager_decode_bs{b}_tok_s"] = r["decode_tok_s"]
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_latency(payload: dict) -> None:
    print(
        f"latency: input {payload['input_len']}, output {payload['output_len']}, "
        f"copy rate {payload['copy_rate_B_s'] / 1e9:,.0f} GB/s ({payload['copy_rate_source']})"
    )
    hf = "hf_reference" in payload
    spec = any("mean_acceptance_length" in r for r in payload["batches"].values())
    head = f"  {'batch':>6} {'decode tok/s':>13} {'ms/step':>9} {'roofline':>9} {'prefill s':>10}"
    head += f" {'accept len':>10}" if spec else ""
    print(head + (f" {'HF tok/s':>10} {'ours/HF':>8}" if hf else ""))
    for b, r in payload["batches"].items():
        line = (
            f"  {b:>6} {r['decode_tok_s']:>13,.1f} {r['ms_per_step']:>9.2f} "
            f"{r['roofline_pct']:>8.1f}% {r['prefill_s']:>10.3f}"
        )
        if spec:
            length = r.get("mean_acceptance_length")
            line += f" {length:>10.2f}" if length else f" {'-':>10}"
        if hf:
            theirs = r["hf_decode_tok_s"]
            ratio = f"{r['decode_tok_s'] / theirs:>7.2f}x" if theirs > 0 else f"{'-':>8}"
            line += f" {theirs:>10,.1f} {ratio}"
        print(line)
    if payload.get("spec_draft_step_ms_bs1") is not None:
        print(f"  one draft step at batch 1: {payload['spec_draft_step_ms_bs1']:.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
