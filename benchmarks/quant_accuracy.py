"""`bench quant-accuracy`: a quantized model's next-token accuracy against the same model in its
dtype, teacher-forced over a fixed English text.

    compile-engine bench quant-accuracy smollm2-135m --quantization fp8 [--text FILE]

Both models run eagerly (every op its reference: what the compiled kernels are checked
against) over the text's first --tokens tokens in one prefill. Reported: each model's
perplexity of the text's next tokens, the quantized one's relative to the reference, the top-1
agreement of the two models' predictions and the logits' mean cosine similarity. Issue 28 asks
perplexity within 2% and top-1 agreement >= 95% for FP8 W8A8 on SmolLM2.

The default text is this repository's docs/compiler.md (English prose, in every checkout);
the record names the file and its sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from compile_engine.benchmarks.results import DEFAULT_DIRECTORY, write_result

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "docs" / "compiler.md"


@torch.inference_mode()
def logits_over(loaded, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits [T, V] at every position of one sequence `ids` [T], in one prefill
    through a paged cache of 16-token blocks (block 0 left as the scratch block)."""
    from compile_engine.models.layers import AttentionMetadata

    model, cfg = loaded.model, loaded.config
    tokens, block = ids.numel(), 16
    blocks = -(-tokens // block) + 1
    shape = model.kv_cache_shape(blocks, block)
    caches = [torch.zeros(shape, dtype=loaded.dtype) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(block, block + tokens),
        block_tables=torch.arange(1, blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
    )
    hidden = model(ids, torch.arange(tokens), caches, meta)
    return model.compute_logits(hidden).float()


def compare(reference: torch.Tensor, quantized: torch.Tensor, ids: torch.Tensor) -> dict:
    targets = ids[1:]
    ref, quant = reference[:-1], quantized[:-1]
    nll_ref = F.cross_entropy(ref, targets).item()
    nll_quant = F.cross_entropy(quant, targets).item()
    return {
        "tokens_scored": int(targets.numel()),
        "perplexity": math.exp(nll_ref),
        "perplexity_quantized": math.exp(nll_quant),
        "perplexity_ratio": math.exp(nll_quant - nll_ref),
        "top1_agreement": (ref.argmax(-1) == quant.argmax(-1)).float().mean().item(),
        "top1_accuracy": (ref.argmax(-1) == targets).float().mean().item(),
        "top1_accuracy_quantized": (quant.argmax(-1) == targets).float().mean().item(),
        "mean_cosine": F.cosine_similarity(ref, quant, dim=-1).mean().item(),
    }


def main(argv: list[str] | None = None) -> int:
    from compile_engine.models.loader import load_model
    from compile_engine.models.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(prog="bench quant-accuracy", description=__doc__.splitlines()[0])
    p.add_argument("model", help="HF directory, .gguf file or alias (smollm2-135m)")
    p.add_argument(
        "--quantization",
        default="fp8",
        choices=["fp8", "gguf"],
        help="gguf: a GGUF file kept quantized (dtype auto on the CPU: int4 projections, Q8_0 "
        "embedding, bfloat16 activations) against the file dequantized in --dtype",
    )
    p.add_argument("--dtype", default="float32", help="the reference's (and the model's) dtype")
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument(
        "--tokens",
        type=int,
        default=2049,
        help="the text's first N tokens; N - 1 are scored (the first has no prediction), so "
        "the default scores the issues' 2,048",
    )
    p.add_argument("--results-dir", default=str(DEFAULT_DIRECTORY))
    args = p.parse_args(argv)
    text_path = Path(args.text)
    text = text_path.read_text()
    reference = load_model(args.model, dtype=args.dtype)
    tokenizer = load_tokenizer(reference.source.kind, reference.source.path)
    ids = torch.tensor(tokenizer.encode(text)[: args.tokens])
    if ids.numel() < args.tokens:
        raise SystemExit(f"{text_path} has {ids.numel()} tokens, fewer than --tokens {args.tokens}")
    t0 = time.perf_counter()
    ref_logits = logits_over(reference, ids)
    del reference
    baseline = None
    if args.quantization == "gguf":
        # The quantized path computes in bfloat16; the file dequantized in bfloat16 says how
        # much of the difference is the activations' dtype, not the kept-quantized weights.
        dequantized = load_model(args.model, dtype="bfloat16")  # explicit: dequantized
        baseline = compare(ref_logits, logits_over(dequantized, ids), ids)
        del dequantized
        quantized = load_model(args.model, dtype="auto")
        if quantized.quant is None or quantized.quant.method != "gguf":
            raise SystemExit(f"{args.model} does not load kept quantized (not a quantized GGUF)")
    else:
        quantized = load_model(args.model, dtype=args.dtype, quantization=args.quantization)
    quant_logits = logits_over(quantized, ids)
    result = compare(ref_logits, quant_logits, ids)
    if baseline is not None:
        result["bfloat16_dequantized"] = baseline
    result.update(
        model=args.model,
        dtype=args.dtype,
        quantization=quantized.quant.describe(),
        text=str(text_path.name),
        text_sha256=hashlib.sha256(text.encode()).hexdigest()[:16],
        seconds=round(time.perf_counter() - t0, 1),
    )
    print(
        f"{args.model} {args.dtype} vs {result['quantization']['scheme']} over "
        f"{result['tokens_scored']} tokens: perplexity {result['perplexity']:.3f} -> "
        f"{result['perplexity_quantized']:.3f} (x{result['perplexity_ratio']:.4f}), top-1 "
        f"agreement {result['top1_agreement']:.4f}, mean cosine {result['mean_cosine']:.5f}"
    )
    write_result("quant-accuracy", {"benchmark": "quant_accuracy", **result}, args.results_dir)
    return 0
