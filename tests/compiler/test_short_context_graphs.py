"""Short-context CUDA graphs (compiler/cuda_graphs.py): which capture sizes get one, and which
graph a step replays. On the CPU: the graphs are stand-ins that record their replay, so what is
checked is the choice and the buffers it reads; tests/gpu/test_h100.py replays real ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compile_engine.compiler import cuda_graphs
from compile_engine.compiler.cuda_graphs import CUDAGraphRunner, prefill_rows, short_table_widths
from compile_engine.kernels_generated import paged_attention as pa
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.device import CPU_SM_COUNT
from compile_engine.kernels_generated.paged_attention import launch
from compile_engine.kernels_generated.tuning import AttentionTuning, KernelConfig
from compile_engine.models.layers import AttentionMetadata

CPU = torch.device("cpu")
SIZES = [1, 2, 4, 8, 16]
PAGED = {"paged_attention_triton": 0, "rotary_into_attention": 2}


@pytest.fixture
def unsplit_48() -> KernelConfig:
    """A kernel config whose CPU decode tier has a 48-key unsplit bound (the CUDA one sets 160)."""
    attention = AttentionTuning()
    [tier] = attention.decode_cpu
    cpu = (dataclasses.replace(tier, unsplit_keys=48),)
    return KernelConfig(attention=dataclasses.replace(attention, decode_cpu=cpu))


def test_widths_where_a_narrow_table_runs_unsplit(unsplit_48):
    # 2 KV heads on CPU_SM_COUNT (8) "SMs": sizes 1 and 2 split a wide table, 4 and up do not.
    assert CPU_SM_COUNT == 8
    assert short_table_widths(PAGED, unsplit_48, 2, SIZES, 16, 1000, CPU) == {1: 3, 2: 3}
    assert short_table_widths(PAGED, unsplit_48, 2, SIZES, 5, 1000, CPU) == {1: 9, 2: 9}  # 45 keys
    # A full table no wider than the short one, a block wider than the bound, no paged
    # attention kernel in the compiled forward (an MLA model, the CPU target): none.
    assert short_table_widths(PAGED, unsplit_48, 2, SIZES, 16, 3, CPU) == {}
    assert short_table_widths(PAGED, unsplit_48, 2, SIZES, 64, 1000, CPU) == {}
    assert short_table_widths({"mla_absorb": 3}, unsplit_48, 2, SIZES, 16, 1000, CPU) == {}


def test_for_compiled_sizes_the_tables_and_the_short_graphs(unsplit_48):
    # What the build and the engine construct: blocks from max_model_len, short widths from
    # the compiled forward's passes.
    import types

    compiled = types.SimpleNamespace(
        pass_manager=types.SimpleNamespace(match_counts=PAGED),
        config=types.SimpleNamespace(kernel=unsplit_48),
    )
    runner = CUDAGraphRunner.for_compiled(
        compiled, [], capture_sizes=SIZES, max_num_seqs=4, max_model_len=1000, block_size=16,
        num_kv_heads=2, device=CPU,
    )  # fmt: skip
    # 16 sequence slots, not 4: a paged-attention forward replays steps of up to 16 tokens
    # as a row a token (write_first_max_tokens).
    assert runner.block_tables.shape == (16, 63) and runner.short_widths == {1: 3, 2: 3}
    assert runner.decode_rows_max == 16
    compiled.pass_manager.match_counts = {"mla_absorb": 3}
    runner = CUDAGraphRunner.for_compiled(
        compiled, [], capture_sizes=SIZES, max_num_seqs=4, max_model_len=1000, block_size=16,
        num_kv_heads=2, device=CPU,
    )  # fmt: skip
    assert runner.short_widths == {} and runner.decode_rows_max == 0
    assert runner.block_tables.shape == (4, 63)


def test_widths_none_without_the_bound():
    # The default CPU tier sets none.
    assert short_table_widths(PAGED, tuning.default(), 2, SIZES, 16, 1000, CPU) == {}


class _Graph:
    def __init__(self, log: list, key) -> None:
        self.log, self.key = log, key

    def replay(self) -> None:
        self.log.append(self.key)


def _runner(
    short_widths: dict[int, int],
    prefill: dict[int, int] | None = None,
    sizes=(1, 4),
    decode_rows: bool = False,
    kernel_config: KernelConfig | None = None,
) -> tuple[CUDAGraphRunner, list]:
    runner = CUDAGraphRunner(
        lambda *args: None,
        [],
        capture_sizes=list(sizes),
        max_num_seqs=4,
        max_blocks_per_seq=20,
        device=CPU,
        short_widths=short_widths,
        prefill_rows=prefill,
        kernel_config=kernel_config or tuning.default(),
        decode_rows=decode_rows,
    )
    replayed: list = []
    for key in runner._keys():
        runner.graphs[key] = _Graph(replayed, key)
        runner.outputs[key] = torch.full((key[0], 2), float(key[0] * 100 + (key[1] or 0)))
    return runner, replayed


def _meta(lens: list[int], width: int) -> AttentionMetadata:
    tables = torch.arange(1, 1 + len(lens) * width, dtype=torch.int32).view(len(lens), width)
    return AttentionMetadata(
        slot_mapping=torch.arange(len(lens)),
        block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
    )


def test_a_step_within_the_short_width_replays_the_short_graph():
    runner, replayed = _runner({1: 10, 4: 10, 64: 10})  # 64 is not a capture size: dropped
    assert runner.short_widths == {1: 10, 4: 10}
    assert runner._keys() == [(4, None, None), (4, 10, None), (1, None, None), (1, 10, None)]
    ids = torch.tensor([5, 6, 7])
    out = runner.run(ids, ids, _meta([150, 3, 160], 10))
    assert replayed == [(4, 10, None)]  # the one short replay
    assert out.shape == (3, 2) and out[0, 0].item() == 410
    # One block wider than the short graph's table: the full-table graph.
    assert runner.run(ids[:1], ids[:1], _meta([161], 11))[0, 0].item() == 100
    assert replayed[-1] == (1, None, None) and runner.last_key == (1, None, None)
    assert [key for key in replayed if key[1] is not None] == [(4, 10, None)]  # still the one
    # The short graph reads the first columns of the one block-table buffer the step filled.
    runner.run(ids[:2], ids[:2], _meta([20, 30], 2))
    assert replayed[-1] == (4, 10, None)
    short_view = runner._meta(4, 10).block_tables
    assert short_view.data_ptr() == runner.block_tables.data_ptr() and short_view.shape[1] == 10
    assert short_view[:2, :2].tolist() == [[1, 2], [3, 4]]


def test_without_short_widths_every_step_replays_the_full_table():
    runner, replayed = _runner({})
    ids = torch.tensor([5])
    runner.run(ids, ids, _meta([3], 1))
    assert replayed == [(1, None, None)]  # no short replay


def test_replay_inputs_fill_the_buffers_with_the_padding():
    # 3 tokens padded to the 4-token graph, 3 of 4 sequence slots: the real values in front,
    # then the padding the kernels expect (slot 0, length 0, no tokens) over stale values.
    runner, _ = _runner({})
    for buf in (runner.slot_mapping, runner.seq_lens, runner.query_start_loc):
        buf.fill_(7)
    meta = _meta([150, 3, 160], 10)
    meta.slot_mapping = torch.tensor([40, 41, 42])
    runner.run(torch.tensor([5, 6, 9]), torch.tensor([149, 2, 159]), meta)
    assert runner.input_ids[:3].tolist() == [5, 6, 9]
    assert runner.positions[:3].tolist() == [149, 2, 159]
    assert runner.slot_mapping[:4].tolist() == [40, 41, 42, 0]
    assert runner.seq_lens.tolist() == [150, 3, 160, 0]
    assert runner.query_start_loc.tolist() == [0, 1, 2, 3, 3]
    assert torch.equal(runner.block_tables[:3, :10], meta.block_tables)


@pytest.mark.parametrize("staged_table_bytes", [64 << 10, 0])
def test_consecutive_steps_refill_the_staging_in_turn(monkeypatch, staged_table_bytes):
    # Two host stagings taken in turn, each step's values whole in the buffers; the block
    # table staged while small, copied as its used columns otherwise.
    monkeypatch.setattr(cuda_graphs, "STAGED_TABLE_BYTES", staged_table_bytes)
    runner, _ = _runner({})
    assert runner._stages[0].table_rows == (4 if staged_table_bytes else 1)
    for step, lens in enumerate(([150, 3, 160], [20], [7, 8])):
        meta = _meta(lens, 10 - step)
        meta.slot_mapping = torch.arange(len(lens)) + 10 * step
        ids = torch.arange(len(lens)) + 100 * step
        runner.run(ids, ids + 1, meta)
        n = len(lens)
        assert runner.input_ids[:n].tolist() == ids.tolist()
        assert runner.positions[:n].tolist() == (ids + 1).tolist()
        assert runner.seq_lens.tolist() == lens + [0] * (4 - n)
        assert runner.query_start_loc.tolist() == list(range(n + 1)) + [n] * (4 - n)
        assert torch.equal(runner.block_tables[:n, : 10 - step], meta.block_tables)


def test_the_cuda_policy_gives_the_one_token_graph_a_short_table(monkeypatch):
    # The H200's 132 SMs and Llama-3-8B's 8 KV heads (shapes only, no device touched): 1-16
    # tokens run unsplit on a table of <= 160 keys and get a 10-block short graph, and split
    # a wider one as one token does (a verification step's rows attend as decodes); from 17
    # tokens nothing splits.
    cuda = torch.device("cuda")
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    config = tuning.default()
    assert pa.choose_num_splits(config, 1, 8, 160, cuda) == 1
    assert pa.choose_num_splits(config, 1, 8, 176, cuda) == 3  # 176 keys, 64 a split
    assert pa.choose_num_splits(config, 2, 8, 160, cuda) == 1
    assert pa.choose_num_splits(config, 8, 8, 176, cuda) == 3
    assert pa.choose_num_splits(config, 1, 8, 131072, cuda) == 33
    assert pa.choose_num_splits(config, 16, 8, 131072, cuda) == 33
    assert [pa.unsplit_context(config, t, 8, cuda) for t in (1, 2, 16, 17)] == [160, 160, 160, 0]
    sizes = [1, 2, 4, 8, 12, 16, 24, 32]
    assert short_table_widths(PAGED, config, 8, sizes, 16, 8192, cuda) == dict.fromkeys(
        [1, 2, 4, 8, 12, 16], 10
    )


def test_a_verification_step_replays_as_one_token_rows():
    # 1 + k tokens of one sequence (and a decode beside it) in at most write_first_max_tokens
    # tokens: replayed as one row a token over its sequence's table, each row's length the
    # keys its token sees, so that it attends as the one-token decode of that token.
    runner, replayed = _runner({}, sizes=(1, 4, 8), decode_rows=True)
    # 4 sequences, but a row a token of up to 16 tokens needs 16 slots: the graphs have them.
    assert runner.max_num_seqs == 16 and runner.block_tables.shape[0] == 16
    meta = _meta([40, 160], 3)
    meta.query_start_loc = torch.tensor([0, 4, 5], dtype=torch.int32)
    meta.slot_mapping = torch.arange(5)
    ids = torch.arange(5)
    runner.run(ids, ids, meta)
    assert replayed == [(8, None, None)]
    assert runner.seq_lens[:5].tolist() == [37, 38, 39, 40, 160]
    assert runner.query_start_loc[:7].tolist() == [0, 1, 2, 3, 4, 5, 5]
    assert runner.block_tables[:5, :3].tolist() == [[1, 2, 3]] * 4 + [[4, 5, 6]]
    # Without the flag (no paged-attention kernel that writes first), the step as it came.
    plain, _ = _runner({}, sizes=(1, 4, 8))
    plain.run(ids, ids, meta)
    assert plain.seq_lens[:2].tolist() == [40, 160] and plain.query_start_loc[:3].tolist() == [
        0, 4, 5
    ]  # fmt: skip
    # More tokens than write_first_max_tokens: the step as it came too.
    small = KernelConfig.coerce({"attention": {"write_first_max_tokens": 4}})
    bounded, _ = _runner({}, sizes=(1, 4, 8), decode_rows=True, kernel_config=small)
    assert bounded.max_num_seqs == 4
    bounded.run(ids, ids, meta)
    assert bounded.seq_lens[:2].tolist() == [40, 160]


def test_a_head_follows_the_graph_its_step_replayed():
    # Head graphs (the lm_head and argmax after the model) on the small graphs but the
    # prefill ones; a step replays the head of the graph it ran, and none after a step that
    # ran no graph.
    runner, replayed = _runner({1: 10, 4: 10}, prefill={4: 2}, sizes=(1, 4, 8))
    assert runner.head_keys(4) == [(4, None, None), (4, 10, None), (1, None, None), (1, 10, None)]
    for key in runner.head_keys(4):
        logits = torch.full((key[0], 3), float(key[0]))
        runner.heads[key] = (_Graph(replayed, ("head", *key)), logits, torch.arange(key[0]))
    assert runner.replay_head(1) is None  # nothing replayed yet
    ids = torch.tensor([5, 6, 7])
    runner.run(ids, ids, _meta([150, 3, 160], 10))
    logits, tokens = runner.replay_head(3)
    assert replayed[-2:] == [(4, 10, None), ("head", 4, 10, None)]
    assert logits.shape == (3, 3) and logits[0, 0].item() == 4 and tokens.tolist() == [0, 1, 2]
    eight, meta = torch.arange(8), _meta([9] * 4, 2)
    meta.slot_mapping, meta.query_start_loc = eight, torch.arange(0, 9, 2, dtype=torch.int32)
    runner.run(eight, eight, meta)  # the 8-token graph: no head
    assert replayed[-1] == (8, None, None) and runner.replay_head(8) is None
    wide = torch.arange(9)
    assert runner.run(wide, wide, _meta([9] * 4, 2)) is None  # no graph fits
    assert runner.last_key is None and runner.replay_head(9) is None


def _prefill_from(tokens: int) -> KernelConfig:
    return KernelConfig.coerce({"attention": {"prefill_graph_min_tokens": tokens}})


def test_prefill_graphs_below_twice_the_slots():
    # 8 sequence slots, tiled from 2 tokens a slot: a full graph of fewer than 16 tokens runs
    # the single-token kernel whatever the step, so sizes 2..12 get a prefill graph of
    # size // 2 slots (whose shapes choose tiled); 16 tokens choose tiled on the full table.
    config = _prefill_from(1)
    sizes = [1, 2, 4, 8, 12, 16, 24]
    assert prefill_rows(PAGED, config, sizes, 8) == {2: 1, 4: 2, 8: 4, 12: 6}
    for size, slots in prefill_rows(PAGED, config, sizes, 8).items():
        assert not pa.choose_tiled(config, size, 8) and pa.choose_tiled(config, size, slots)
    assert prefill_rows({"mla_absorb": 3}, config, sizes, 8) == {}  # no paged attention kernel
    # The default starts at 32 tokens: serve's 256 slots give 32..480 tokens one each.
    assert prefill_rows(PAGED, _prefill_from(8), sizes, 8) == {8: 4, 12: 6}
    serve = prefill_rows(PAGED, tuning.default(), list(range(16, 1025, 16)), 256)
    assert min(serve) == 32 and max(serve) == 496 and serve[416] == 208


def test_a_prefill_heavy_step_replays_the_prefill_graph():
    # Sizes 1, 4 and 8 on 4 slots: size 4 gets a 2-slot prefill graph; 8 tokens are tiled on
    # the full table already.
    runner, replayed = _runner({}, prefill_rows(PAGED, _prefill_from(4), [1, 4, 8], 4), (1, 4, 8))
    assert runner.prefill_rows == {4: 2}
    assert runner._keys() == [(8, None, None), (4, None, None), (4, None, 2), (1, None, None)]
    ids = torch.tensor([5, 6, 7])
    # One sequence's 3-token chunk: the step's own shapes choose tiled.
    runner.run(ids, ids, _chunks([40], [0, 3]))
    assert replayed[-1] == (4, None, 2)
    meta = runner._meta(4, None, 2)  # views of the one set of buffers, 2 slots
    assert meta.block_tables.shape == (2, 20) and meta.seq_lens.tolist() == [40, 0]
    assert meta.query_start_loc.tolist() == [0, 3, 3]
    assert meta.block_tables.data_ptr() == runner.block_tables.data_ptr()
    # Three one-token decodes: the full graph (single-token kernel, its splits).
    runner.run(ids, ids, _meta([40, 5, 9], 1))
    assert replayed[-1] == (4, None, None)
    # 3 tokens of 2 sequences (a chunk of 2 beside a decode) is not tiled: 3 < 2 x 2.
    runner.run(ids, ids, _chunks([40, 5], [0, 2, 3]))
    assert replayed[-1] == (4, None, None)


def _chunks(lens: list[int], starts: list[int]) -> AttentionMetadata:
    """One-block tables for sequences of `lens` with query tokens between `starts`."""
    return dataclasses.replace(
        _meta(lens, 1),
        slot_mapping=torch.arange(starts[-1]),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
    )


def test_inspect_names_the_prefill_graphs():
    # What `compile-engine inspect` prints for an h100 artifact, from its manifest alone.
    import types

    from compile_engine.cli import _prefill_graphs

    manifest = types.SimpleNamespace(
        passes=[{"name": "rotary_into_attention", "matches": 32}],
        kernel=tuning.default,
        engine_args={"max_num_seqs": 32},
        capture_sizes=[1, 2, 4, 8, 16, 32, 48, 64, 128],
    )
    assert _prefill_graphs(manifest).endswith("beside sizes 32 (16 slots), 48 (24 slots)")
    manifest.passes = [{"name": "mla_absorb", "matches": 3}]
    assert _prefill_graphs(manifest).startswith("prefill graphs: none")
