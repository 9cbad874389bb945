"""`bench structured`: what structured output costs. Offline output tok/s at one batch size with
every request carrying a JSON schema against the same requests with none, runs alternating in
one process; the per-step mask time (all rows of a step, filled in parallel) and the schemas'
compile times.

A random-weight model (bench make-model) has no tokenizer, and a grammar needs one that spells
every token in bytes: `byte_level_tokenizer` writes a byte-level BPE of the model's vocabulary
size (256 byte tokens, then merges of word pieces, as real vocabularies mostly are), so a
128k-vocabulary mask costs about what a real one does. Random weights under a schema write long
strings; the schemas leave strings unbounded so most requests run to --output-len, and the
record keeps each mode's mean output length.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from compile_engine.benchmarks.common import (
    add_engine_flags,
    engine_kwargs,
    engine_settings,
    model_summary,
    random_prompts,
    timed,
)
from compile_engine.benchmarks.results import print_table, write_result

EOS_TOKEN = "<|end|>"

# The bench's schemas: what apps send (an extraction record, a list, enums and bounds, a
# pattern, the 7-field nested schema the BRIEF's mask timings used).
SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "email": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "email", "age"],
    },
    {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "summary": {"type": "string"},
        },
        "required": ["sentiment", "score", "summary"],
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
            "note": {"type": "string"},
        },
        "required": ["id", "note"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "year": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "rating": {"type": "number"},
            "available": {"type": "boolean"},
            "author": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
                "required": ["name"],
            },
            "description": {"type": "string"},
        },
        "required": ["title", "year", "tags", "author", "description"],
    },
]


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes are themselves, the
    rest (controls, space, ...) take code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


# What a real vocabulary is mostly made of: word pieces of letters, digits and a space, with
# some punctuation. A vocabulary of uniformly random byte strings (the first version) defeats
# llguidance's token slices, which handle the tokens that fit a lexeme's character class in
# bulk: its masks took 7.5 ms a step at batch 64 on the H200 host, a cost no real tokenizer
# has (SmolLM2's real 49k vocabulary: 1.2 ms a step for 64 rows on one of this CPU's cores).
_PIECE_CHARS = "etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789      .,-'_:;()"


def byte_level_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens, the last one EOS_TOKEN: the
    256 byte tokens, then merges of two earlier word-piece tokens (_PIECE_CHARS, up to 12
    characters), 1 in 50 of any two earlier tokens (punctuation runs such as '\"}' or '{\n')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258:
        raise ValueError(f"a byte-level vocabulary needs >= 258 tokens, got {vocab_size}")
    rng = random.Random(seed)
    chars = _byte_chars()
    tokens = list(chars)
    vocab = {t: i for i, t in enumerate(tokens)}
    stand_in = {c: chars[ord(c)] for c in set(_PIECE_CHARS)}
    piece_chars = set(stand_in.values())
    pieces = [stand_in[c] for c in _PIECE_CHARS]  # weighted: repeated characters recur
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size - 1:
        pool = tokens if rng.random() < 0.02 else pieces
        a, b = rng.choice(pool), rng.choice(pool)
        if len(a) + len(b) > 12 or a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        tokens.append(a + b)
        if pool is pieces or piece_chars.issuperset(a + b):
            pieces.append(a + b)
        merges.append((a, b))
    model = models.BPE(vocab=vocab, merges=merges)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN)


def add_byte_level_tokenizer(model_dir: str | Path) -> bool:
    """Write `byte_level_tokenizer` into a tokenizer-less HF directory (False: it has one)."""
    from compile_engine.models.tokenizer import has_tokenizer

    path = Path(model_dir)
    if has_tokenizer(path):
        return False
    config = json.loads((path / "config.json").read_text())
    byte_level_tokenizer(int(config["vocab_size"])).save_pretrained(str(path))
    return True


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def compile_times(llm, repeats: int) -> list[float]:
    """Seconds to compile each bench schema from scratch (the cache bypassed), `repeats` times."""
    from compile_engine.runtime.sampling_params import StructuredOutputsParams

    compiler = llm.engine.structured.compiler
    compiler.tokenizer()  # built once per engine, not per grammar
    times = []
    for _ in range(repeats):
        for schema in SCHEMAS:
            started = time.perf_counter()
            compiler._compile(StructuredOutputsParams(json=schema))
            times.append(time.perf_counter() - started)
    return times


MASK_SAMPLE = 64  # answers whose every mask `one_mask_times` times


def one_mask_times(compiler, answers: list[tuple]) -> list[float]:
    """Milliseconds of each single mask along `answers` ((structured_outputs, token ids)): a
    fresh matcher per answer computes the mask at every position, on this thread, then takes
    the answer's token, so the states timed are those the run went through."""
    import torch

    words = (compiler.vocab_size + 31) // 32
    buffer = torch.empty(words, dtype=torch.int32)
    times = []
    for spec, tokens in answers:
        matcher = compiler.compile(spec).deep_copy()
        for token in tokens:
            if matcher.is_stopped():
                break
            started = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(buffer.data_ptr(), words * 4)
            times.append((time.perf_counter() - started) * 1e3)
            if not matcher.consume_token(token):
                break
    return times


def bench_structured(
    llm,
    *,
    num_requests: int,
    input_len: int,
    output_len: int,
    repeats: int,
    seed: int = 0,
) -> dict:
    from compile_engine.runtime.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    device = llm.engine.config.device
    prompts = random_prompts(num_requests, input_len, vocab, rng)

    def params(constrained: bool) -> list[SamplingParams]:
        return [
            SamplingParams(
                temperature=0.0,
                max_tokens=output_len,
                ignore_eos=True,
                structured_outputs={"json": SCHEMAS[i % len(SCHEMAS)]} if constrained else None,
            )
            for i in range(num_requests)
        ]

    warm = prompts[: min(16, num_requests)]
    for constrained in (False, True):  # compiles the schemas, warms both paths
        llm.generate(warm, params(constrained)[: len(warm)])
    structured = llm.engine.structured
    structured.mask_times.clear()
    runs: dict[str, list[dict]] = {"plain": [], "json_schema": []}
    complete = valid = accepted = 0
    compiler = llm.engine.structured.compiler
    for _ in range(repeats):
        for mode in runs:
            with timed(device) as t:
                outputs = llm.generate(prompts, params(mode == "json_schema"))
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            runs[mode].append(
                {"elapsed_s": t[0], "output_tokens": tokens, "output_tok_s": tokens / t[0]}
            )
            if mode == "json_schema":  # the grammar held: every finished answer parses
                done = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
                complete += len(done)
                valid += sum(_parses(text) for text in done)
                # and every answer, cut by length or not, is tokens its schema accepts
                for i, o in enumerate(outputs):
                    matcher = compiler.compile(params(True)[i].structured_outputs).deep_copy()
                    accepted += matcher.consume_tokens(o.outputs[0].token_ids)
                answers = [
                    (params(True)[i].structured_outputs, o.outputs[0].token_ids)
                    for i, o in enumerate(outputs)
                ]
    plain = statistics.mean(r["output_tok_s"] for r in runs["plain"])
    constrained = statistics.mean(r["output_tok_s"] for r in runs["json_schema"])
    steps = [s * 1e3 for s in structured.mask_times]
    masks = one_mask_times(compiler, answers[:MASK_SAMPLE])
    compiles = [s * 1e3 for s in compile_times(llm, 3)]
    batch = llm.engine.config.max_num_seqs
    return {
        "benchmark": "structured",
        "num_requests": num_requests,
        "input_len": input_len,
        "output_len": output_len,
        "repeats": repeats,
        "batch": batch,
        "vocab_size": vocab,
        "runs": runs,
        "plain_output_tok_s": plain,
        "json_schema_output_tok_s": constrained,
        f"structured_overhead_bs{batch}": 1 - constrained / plain,
        "plain_mean_output_len": statistics.mean(
            r["output_tokens"] / num_requests for r in runs["plain"]
        ),
        "json_schema_mean_output_len": statistics.mean(
            r["output_tokens"] / num_requests for r in runs["json_schema"]
        ),
        "json_schema_complete": complete,  # answers the grammar finished (not cut by length)
        "json_schema_complete_valid": valid,  # of those, how many parse as JSON objects
        "json_schema_accepted": accepted,  # answers whose tokens their grammar accepts
        "json_schema_answers": repeats * num_requests,
        # One sequence's mask (the measure), over every position of MASK_SAMPLE
        # answers of the last constrained run, replayed on one thread.
        "masks_timed": len(masks),
        "grammar_mask_p50_ms": _percentile(masks, 0.5),
        "grammar_mask_p99_ms": _percentile(masks, 0.99),
        "grammar_mask_max_ms": max(masks, default=float("nan")),
        # A step's masks, all `batch` rows on llguidance's threads, as the engine computed them
        # while the device ran the step's forward.
        "mask_steps": len(steps),
        "grammar_step_mask_p50_ms": _percentile(steps, 0.5),
        "grammar_step_mask_p99_ms": _percentile(steps, 0.99),
        "grammar_step_mask_max_ms": max(steps, default=float("nan")),
        "grammar_compile_p50_ms": _percentile(compiles, 0.5),
        "grammar_compile_p99_ms": _percentile(compiles, 0.99),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench structured", description=__doc__.splitlines()[0])
    add_engine_flags(p, max_num_seqs=64, max_num_batched_tokens=16384)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of each mode")
    p.add_argument(
        "--add-tokenizer",
        action="store_true",
        help="write a byte-level BPE tokenizer into a tokenizer-less HF directory first",
    )
    p.add_argument("--name", default="structured", help="result file name prefix")
    return p


def main(argv: list[str] | None = None) -> int:
    from compile_engine.runtime.llm import LLM

    args = build_parser().parse_args(argv)
    if args.add_tokenizer:
        add_byte_level_tokenizer(args.model)
    llm = LLM(args.model, **engine_kwargs(args))
    payload = bench_structured(
        llm,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        repeats=args.repeats,
        seed=args.seed,
    )
    payload.update(model=args.model, model_config=model_summary(llm), engine=engine_settings(llm))
    path = write_result(args.name, payload, args.results_dir, device=llm.engine.config.device.type)
    batch = payload["batch"]
    print_table(
        [
            ("requests", f"{args.num_requests} x ({args.input_len} in / {args.output_len} out)"),
            ("plain output tok/s", payload["plain_output_tok_s"]),
            ("json schema output tok/s", payload["json_schema_output_tok_s"]),
            (f"overhead at batch {batch}", payload[f"structured_overhead_bs{batch}"]),
            ("mean output len plain / json", f"{payload['plain_mean_output_len']:.0f} / "
             f"{payload['json_schema_mean_output_len']:.0f}"),
            ("one mask ms p50 / p99 / max", f"{payload['grammar_mask_p50_ms']:.3f} / "
             f"{payload['grammar_mask_p99_ms']:.3f} / {payload['grammar_mask_max_ms']:.3f}"),
            (f"a step's {batch} masks ms p50 / p99", f"{payload['grammar_step_mask_p50_ms']:.3f}"
             f" / {payload['grammar_step_mask_p99_ms']:.3f}"),
            ("finished answers valid", f"{payload['json_schema_complete_valid']} / "
             f"{payload['json_schema_complete']}"),
            ("answers the grammar accepts", f"{payload['json_schema_accepted']} / "
             f"{payload['json_schema_answers']}"),
            ("compile ms p50 / p99", f"{payload['grammar_compile_p50_ms']:.2f} / "
             f"{payload['grammar_compile_p99_ms']:.2f}"),
        ],
        title="structured output cost (offline, LLM.generate)",
    )  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
