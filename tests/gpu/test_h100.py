"""On the H200 (skipped without CUDA): the compiled bf16 path against HF bf16, and CUDA graph
replay against the graph-free compiled path. Llama-3-8B-shaped layers with random weights,
written as safetensors so the real loading path runs."""

from __future__ import annotations

import pytest
import torch

from paged_harness import PagedHarness, run_schedule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def llama8b_4layers(tmp_path_factory):
    from compile_engine.benchmarks.make_model import make_model

    return make_model("llama3-8b", tmp_path_factory.mktemp("l3"), device="cuda", layers=4)


@pytest.fixture(scope="module")
def llm_4layers(llama8b_4layers):
    """An engine on the 4-layer model with CUDA graphs, shared by the tests that only read it
    (one start, not one a test)."""
    from compile_engine import LLM

    return LLM(
        str(llama8b_4layers),
        target="h100",
        dtype="bfloat16",
        num_kv_blocks=256,
        max_num_seqs=16,
        # Graphs up to 1,024 tokens: 768 and 1,024 are the sizes above 512, where steps with
        # prompt chunks replay a graph too (MAX_GRAPH_TOKENS).
        max_num_batched_tokens=1024,
        # Prefill graphs from 8 tokens (default 32: below 2 x 16 slots none would be made).
        kernel_config={"attention": {"prefill_graph_min_tokens": 8}},
    )


# The default passes (the norm and gate_up's activation fused into the skinny GEMM in the
# decode tail's single-token steps), and without that fusion.
@pytest.mark.parametrize("passes", [None, "-add_rms_norm_into_gemm"])
def test_compiled_bf16_agrees_with_hf_bf16(llama8b_4layers, passes):
    """Teacher-forced logits over 512 positions against HF bf16. With random weights the
    logits over 128k tokens are nearly flat, so bf16 rounding flips near-ties in HF itself: the
    top-1 bar is therefore HF bf16's own agreement with HF float32 (the noise floor), and ours
    must be no further from float32 than HF's bf16 is."""
    import transformers

    from compile_engine.compiler.compiled_model import CompiledForward
    from compile_engine.compiler.config import CompileConfig
    from compile_engine.models.loader import load_model

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128256, (512,), generator=gen).tolist()
    ids = torch.tensor([tokens], device="cuda")
    logits = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf = (
            transformers.AutoModelForCausalLM.from_pretrained(str(llama8b_4layers), dtype=dtype)
            .cuda()
            .eval()
        )
        with torch.no_grad():
            logits[name] = hf(ids).logits[0].float()
        del hf
    loaded = load_model(llama8b_4layers, dtype="bfloat16", device="cuda")
    harness = PagedHarness(loaded.model, block_size=16, num_blocks=64)
    config = CompileConfig(target="h100", passes=passes)
    compiled = CompiledForward(loaded.model, config, torch.bfloat16)
    compiled.capture(harness.kv_caches)
    counts = compiled.pass_manager.match_counts
    assert counts["paged_attention_triton"] + counts.get("rotary_into_attention", 0) == 4
    assert counts.get("add_rms_norm_into_gemm", 0) == (0 if passes else 2 * 4 - 1)
    harness.forward = compiled
    # 448 tokens of chunked prefill, then 64 decode steps: both kernel paths.
    (ours,) = run_schedule(harness, [tokens], prefill_chunk=128, decode_tail=64)
    ours = ours.float()

    def top1(a, b):
        return (a.argmax(-1) == b.argmax(-1)).float().mean().item()

    cosine = torch.nn.functional.cosine_similarity(ours, logits["bf16"], dim=-1)
    agree_hf, floor = top1(ours, logits["bf16"]), top1(logits["bf16"], logits["fp32"])
    ours_fp32 = top1(ours, logits["fp32"])
    print(
        f"top-1 vs HF bf16 {agree_hf:.4f}; vs HF fp32: ours {ours_fp32:.4f}, HF bf16 {floor:.4f}; "
        f"cosine vs HF bf16 mean {cosine.mean():.5f} min {cosine.min():.5f}"
    )
    assert cosine.mean().item() >= 0.999
    assert ours_fp32 >= floor - 0.02


# Mixed batches: a prompt chunk of a sequence with cached tokens beside 3 decodes. 23 tokens
# replay the 24-token size's prefill graph (12 sequence slots, so its shapes pick the tiled
# kernel, as the step's own do); 12 tokens after 88 cached ones (at most 16 tokens) replay as
# 12 one-token rows the 12-token size's short graph (7 blocks); 603 replay the 768-token
# graph, whose full shapes pick the tiled kernel already (no prefill graph above 2 x
# max_num_seqs tokens). One decode token replays the 1-token graph's short-context version
# (10 blocks, one split) while its context fits 160 keys, else the full table's (split-KV);
# 3 decodes within 160 keys replay the 4-token graph's short version.
@pytest.mark.parametrize(
    ("lens", "new", "graph"),
    [
        ([25, 9, 17, 33], [20, 1, 1, 1], (24, None, 12)),
        ([100], [12], (12, 10, None)),
        ([700, 9, 17, 33], [600, 1, 1, 1], (768, None, None)),
        ([150, 40, 160], [1, 1, 1], (4, 10, None)),
        ([100], [1], (1, 10, None)),
        ([160], [1], (1, 10, None)),
        ([161], [1], (1, None, None)),
        ([1500], [1], (1, None, None)),
    ],
)
def test_cuda_graph_replay_matches_compiled_without_graphs(llm_4layers, lens, new, graph):
    from compile_engine.models.layers import AttentionMetadata

    runner = llm_4layers.engine.runner
    graph_size = graph[0]
    assert runner.graphs is not None and graph_size in runner.graphs.sizes
    assert max(runner.graphs.sizes) == 1024
    assert runner.graphs.short_widths == dict.fromkeys([1, 2, 4, 8, 12, 16], 10)
    width = max(-(-n // 16) for n in lens)
    slots, ids, pos, starts, tables = [], [], [], [0], []
    next_block = 1
    for n_ctx, n_new in zip(lens, new, strict=True):
        table = list(range(next_block, next_block + -(-n_ctx // 16)))
        next_block += len(table)
        tables.append(table + [0] * (width - len(table)))
        for p in range(n_ctx - n_new, n_ctx):
            slots.append(table[p // 16] * 16 + p % 16)
            pos.append(p)
            ids.append((p * 7919) % 128256)
        starts.append(starts[-1] + n_new)
    meta = AttentionMetadata(
        torch.tensor(slots),
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
    )
    ids_t, pos_t = torch.tensor(ids), torch.tensor(pos)
    with torch.inference_mode():
        graphed = runner.graphs.run(ids_t, pos_t, meta)
        assert graphed is not None, "the step did not replay a graph"
        assert runner.graphs.last_key == graph
        graphed = graphed.float().clone()
        dev = [
            t.cuda()
            for t in (meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        ]
        plain = runner.forward(
            ids_t.cuda(), pos_t.cuda(), runner.kv_caches, AttentionMetadata(*dev)
        ).float()
    assert graphed.shape == plain.shape == (len(ids), plain.shape[-1])
    cosine = torch.nn.functional.cosine_similarity(graphed, plain, dim=-1)
    assert cosine.min().item() >= 0.999, cosine


def test_engine_reads_every_weight_while_it_compiles(llama8b_4layers, llm_4layers):
    """The engine allocates and reads the weights on a thread (their copies on a stream of
    their own) while it traces and compiles: once ready, every parameter must hold exactly
    what a plain load_model reads with nothing else running."""
    from compile_engine.models.loader import load_model

    llm = llm_4layers
    assert llm.engine.weights_read_s > 0 and "weights_wait_s" in llm.engine.timings
    assert llm.engine.runner.graphs is not None
    reference = dict(
        load_model(llama8b_4layers, dtype="bfloat16", device="cuda").model.named_parameters()
    )
    ours = dict(llm.engine.loaded.model.named_parameters())
    assert sorted(ours) == sorted(reference)
    for name, param in ours.items():
        assert torch.equal(param, reference[name]), name
