"""Drive a model through the paged KV cache the way the runtime does, without the runtime:
chunked prefill and decode steps of several sequences packed into one batch, blocks handed
out in a scrambled order. Used by the HF-equivalence tests of every architecture."""

from __future__ import annotations

import random

import torch

from compile_engine.models.layers import AttentionMetadata


class PagedHarness:
    def __init__(
        self,
        model,
        block_size: int,
        num_blocks: int,
        seed: int = 0,
        forward=None,
        kv_cache_dtype: torch.dtype | None = None,  # None: the model's (float8_e4m3fn: FP8)
    ):
        cfg = model.config
        self.model, self.block_size = model, block_size
        self.forward = forward or model  # e.g. a CompiledForward of the same model
        param = next(model.parameters())
        self.device = param.device
        shape = model.kv_cache_shape(num_blocks, block_size)  # K/V, or a latent (MLA)
        dtype = kv_cache_dtype or param.dtype
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_layers)
        ]
        free = list(range(1, num_blocks))  # block 0 is the runtime's scratch block
        random.Random(seed).shuffle(free)
        self.free = free
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """chunks: (sequence id, new token ids). Returns each chunk's logits [len, V]."""
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            ids += tokens
            positions += range(start, end)
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            tables.append(table)
            self.lens[seq] = end
        width = max(len(t) for t in tables)
        block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        )
        with torch.inference_mode():
            ids_t = torch.tensor(ids, device=dev)
            hidden = self.forward(ids_t, torch.tensor(positions, device=dev), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        return [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]


def run_schedule(
    harness: PagedHarness, sequences: list[list[int]], prefill_chunk: int, decode_tail: int
) -> list[torch.Tensor]:
    """Feed each sequence in prefill chunks of `prefill_chunk` tokens, its last `decode_tail`
    tokens one per step, all sequences packed into the same steps. Returns logits per
    sequence, one row per token."""
    fed = [0] * len(sequences)
    out: list[list[torch.Tensor]] = [[] for _ in sequences]
    while any(f < len(s) for f, s in zip(fed, sequences, strict=True)):
        chunks, owners = [], []
        for i, seq in enumerate(sequences):
            remaining = len(seq) - fed[i]
            if remaining <= 0:
                continue
            n = 1 if remaining <= decode_tail else min(prefill_chunk, remaining - decode_tail)
            chunks.append((i, seq[fed[i] : fed[i] + n]))
            owners.append(i)
            fed[i] += n
        for i, logits in zip(owners, harness.step(chunks), strict=True):
            out[i].append(logits)
    return [torch.cat(parts) for parts in out]


def first_divergent_layer(hf_model, model, tokens: list[int], rtol: float = 1e-4) -> str:
    """Name the first decoder layer whose output stream differs from HF's on one prefill."""
    ours, theirs = [], []
    hooks = []
    for layer in model.model.layers:
        hooks.append(layer.register_forward_hook(lambda m, a, o: ours.append(o[0] + o[1])))
    for layer in hf_model.model.layers:
        hooks.append(
            layer.register_forward_hook(
                lambda m, a, o: theirs.append((o[0] if isinstance(o, tuple) else o)[0])
            )
        )
    try:
        harness = PagedHarness(model, block_size=16, num_blocks=64)
        harness.step([(0, tokens)])
        with torch.no_grad():
            hf_model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        err = ((a - b).abs().max() / b.abs().max()).item()
        if err > rtol:
            return f"model.layers.{i} (relative error {err:.2e})"
    return "no single layer (the divergence is in the final norm or lm_head)"
