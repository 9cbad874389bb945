"""The MoE stage ops (models/moe.py) against oracles written apart from them: routing against
a per-token hand-written selection and against transformers' own DeepSeek-V2/V3 routers,
alignment against its invariants, the grouped GEMM against a per-slot matmul, and the chain
against transformers' Mixtral experts."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from compile_engine.models import ops, vocabulary
from compile_engine.models.moe import (
    align_capacity,
    moe_align,
    moe_combine,
    moe_grouped_gemm,
    moe_route,
)


def _hand_route(scores_row, bias_row, top_k, method, n_group, topk_group, norm, scale):
    """One token, plain Python: which experts, with which weights."""
    num_experts = len(scores_row)
    choice = [s + (bias_row[e] if bias_row is not None else 0.0) for e, s in enumerate(scores_row)]
    allowed = list(range(num_experts))
    if method != "greedy" and n_group > 1:
        size = num_experts // n_group
        groups = [choice[g * size : (g + 1) * size] for g in range(n_group)]
        if method == "group_limited_greedy":
            group_score = [max(g) for g in groups]
        else:
            group_score = [sum(sorted(g, reverse=True)[:2]) for g in groups]
        best = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        allowed = [e for e in allowed if e // size in best]
    chosen = sorted(allowed, key=lambda e: -choice[e])[:top_k]
    weights = [scores_row[e] for e in chosen]
    if norm:
        total = sum(weights)
        weights = [w / total for w in weights]
    return dict(zip(chosen, [w * scale for w in weights], strict=True))


CASES = [
    # (scoring, topk_method, n_group, topk_group, norm, scale, bias, E, K)
    ("softmax", "greedy", 1, 1, True, 1.0, False, 8, 2),  # Mixtral
    ("softmax", "greedy", 1, 1, False, 1.0, False, 12, 4),  # Qwen2-MoE
    ("softmax", "group_limited_greedy", 4, 2, False, 16.0, False, 16, 6),  # DeepSeek-V2
    ("sigmoid", "noaux_tc", 4, 2, True, 2.5, True, 16, 4),  # DeepSeek-V3
    ("sigmoid", "noaux_tc", 1, 1, True, 2.5, True, 8, 3),  # V3 with one group
    ("sigmoid", "greedy", 1, 1, False, 1.0, True, 8, 2),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-g{c[2]}" for c in CASES])
def test_route_matches_hand_written_selection(case):
    scoring, method, n_group, topk_group, norm, scale, with_bias, num_experts, top_k = case
    gen = torch.Generator().manual_seed(num_experts * 7 + top_k)
    logits = torch.randn(9, num_experts, generator=gen) * 2
    # A bias large enough to change the selection, so that ignoring it fails.
    bias = torch.randn(num_experts, generator=gen) * 0.5 if with_bias else None
    weights, ids = moe_route(logits, bias, top_k, scoring, method, n_group, topk_group, norm, scale)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (9, top_k)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    for t in range(9):
        want = _hand_route(
            scores[t].tolist(), None if bias is None else bias.tolist(), top_k, method,
            n_group, topk_group, norm, scale,
        )  # fmt: skip
        got = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        assert set(got) == set(want), f"token {t}"
        for e, w in want.items():
            assert math.isclose(got[e], w, rel_tol=1e-5), f"token {t} expert {e}"


def _hf_router(arch: str, **overrides):
    cfg_cls = {"v2": "DeepseekV2Config", "v3": "DeepseekV3Config"}[arch]
    mod = {"v2": "deepseek_v2", "v3": "deepseek_v3"}[arch]
    cls = {"v2": "DeepseekV2TopkRouter", "v3": "DeepseekV3TopkRouter"}[arch]
    config = getattr(transformers, cfg_cls)(hidden_size=32, **overrides)
    module = getattr(transformers.models, mod)
    return getattr(getattr(module, f"modeling_{mod}"), cls)(config).eval()


@pytest.mark.parametrize(
    "arch, knobs",
    [
        ("v2", dict(topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0)),
        (
            "v2",
            dict(
                topk_method="group_limited_greedy",
                n_group=4,
                topk_group=2,
                routed_scaling_factor=16.0,
            ),
        ),  # fmt: skip
        ("v3", dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
        ("v3", dict(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
    ],
)
def test_route_matches_transformers_deepseek_routers(arch, knobs):
    num_experts = 16
    router = _hf_router(arch, n_routed_experts=num_experts, num_experts_per_tok=4, **knobs)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, 32, generator=gen) * 0.5)
        if arch == "v3":
            router.e_score_correction_bias.copy_(torch.randn(num_experts, generator=gen) * 0.3)
    x = torch.randn(11, 32, generator=gen)
    with torch.no_grad():
        logits, want_w, want_ids = router(x)
    if arch == "v2":  # transformers 5 applies no renormalisation in DeepSeek-V2's router
        scoring, method, bias, norm = "softmax", knobs["topk_method"], None, False
    else:
        scoring, method, bias, norm = (
            "sigmoid",
            "noaux_tc",
            router.e_score_correction_bias,
            (knobs["norm_topk_prob"]),
        )
    weights, ids = moe_route(
        logits, bias, 4, scoring, method, knobs["n_group"], knobs["topk_group"], norm,
        knobs["routed_scaling_factor"],
    )  # fmt: skip
    # Same experts per token (transformers returns them unsorted) with the same weights.
    order_got, order_want = ids.long().sort(-1), want_ids.sort(-1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(
        weights.gather(1, order_got.indices), want_w.gather(1, order_want.indices),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block", [(1, 2, 8, 4), (13, 3, 6, 16),
                                                                    (40, 4, 64, 16), (0, 2, 8, 16),
                                                                    (7, 1, 3, 1)])  # fmt: skip
def test_align_invariants(num_tokens, top_k, num_experts, block):
    gen = torch.Generator().manual_seed(num_tokens)
    rows = [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.long)
    ids = ids.to(torch.int32)
    sorted_ids, block_expert = moe_align(ids, num_experts, block)
    slots = num_tokens * top_k
    assert sorted_ids.numel() == align_capacity(slots, num_experts, block)
    assert block_expert.numel() * block == sorted_ids.numel()
    real = sorted_ids[sorted_ids < slots]
    assert sorted(real.tolist()) == list(range(slots))  # every slot exactly once
    assert torch.all(sorted_ids[sorted_ids >= slots] == slots)  # padding is the sentinel
    flat = ids.flatten()
    for b, expert in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * block : (b + 1) * block]
        rows = rows[rows < slots]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and torch.all(flat[rows.long()] == expert)
    # Active blocks come first, then only -1.
    active = (block_expert >= 0).int()
    assert torch.equal(active, active.sort(descending=True, stable=True).values)


def test_grouped_gemm_and_combine_against_per_slot_matmul():
    gen = torch.Generator().manual_seed(0)
    num_tokens, top_k, num_experts, hidden, inter = 9, 3, 5, 12, 10
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    sorted_ids, block_expert = moe_align(ids, num_experts, 4)
    h = moe_grouped_gemm(x, w13, sorted_ids, block_expert, top_k)
    flat = ids.flatten().long()
    want = torch.stack([x[s // top_k] @ w13[flat[s]].t() for s in range(num_tokens * top_k)])
    torch.testing.assert_close(h, want)
    # The second GEMM reads one row per slot.
    w2 = torch.randn(num_experts, hidden, 2 * inter, generator=gen)
    y = moe_grouped_gemm(h, w2, sorted_ids, block_expert, 1)
    want_y = torch.stack([h[s] @ w2[flat[s]].t() for s in range(num_tokens * top_k)])
    torch.testing.assert_close(y, want_y)
    out = moe_combine(y, weights)
    want_out = torch.stack(
        [sum(weights[t, k] * y[t * top_k + k] for k in range(top_k)) for t in range(num_tokens)]
    )
    torch.testing.assert_close(out, want_out)


def test_stacked_experts_match_transformers_mixtral_experts():
    """The whole align -> GEMM -> silu -> GEMM -> combine chain against HF's experts loop."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=6)
    hf = MixtralExperts(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.randn(6, 48, 16, generator=gen))
        hf.down_proj.copy_(torch.randn(6, 16, 24, generator=gen))
    x = torch.randn(10, 16, generator=gen)
    weights, ids = moe_route(torch.randn(10, 6, generator=gen), None, 2, "softmax", "greedy",
                             1, 1, True, 1.0)  # fmt: skip
    with torch.no_grad():
        want = hf(x, ids.long(), weights)
    sorted_ids, block_expert = moe_align(ids, 6, 16)
    h = moe_grouped_gemm(x, hf.gate_up_proj.detach(), sorted_ids, block_expert, 2)
    y = moe_grouped_gemm(ops.silu_and_mul(h), hf.down_proj.detach(), sorted_ids, block_expert, 1)
    torch.testing.assert_close(moe_combine(y, weights), want, rtol=1e-5, atol=1e-5)


def test_ops_join_the_vocabulary():
    for name in ("moe_route", "moe_align", "moe_grouped_gemm", "moe_combine"):
        op, ref = vocabulary.OPS[name]
        assert op._qualname == f"ce::{name}" and callable(ref)
    assert "moe_grouped_gemm" in vocabulary.HOST_SYNC_OPS
