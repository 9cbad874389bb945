"""Capture the model's forward once with Dynamo and serve every later call from that graph.

The token dimension (and the batch dimensions of the attention metadata) are dynamic. After
the first capture no guard is evaluated: every guard is dropped through torch.compile's
`guard_filter_fn`, so a step costs no guard checks and can never silently recompile. The
graph is valid for every token count because each dynamic dimension is symbolic in it; the
one assumption Dynamo makes (size >= 2) is covered by the tests that decode one token.
"""

from __future__ import annotations

import itertools
import logging
import time
import types

import torch
from torch import nn

from compiler.backend import PiecewiseBackend
from compiler.config import CompileConfig, apply_inductor_settings
from models.layers import AttentionMetadata
from passes.base import PassContext
from passes.manager import PassManager
from passes.registry import select

log = logging.getLogger(__name__)


def _drop_all_guards(guards) -> list[bool]:
    return [False for _ in guards]


_copies = itertools.count()


def _own_code_object(method):
    """The bound method again, but with a code object of its own. Dynamo keeps compiled
    graphs per code object and our entries carry no guards, so two models in one process
    (tests, a build then a load) must never share one: the second would run the first's
    graph."""
    fn = method.__func__
    code = fn.__code__
    name = f"{code.co_name}_ce{next(_copies)}"
    copy = types.FunctionType(
        code.replace(co_name=name, co_qualname=name),
        fn.__globals__,
        name,
        fn.__defaults__,
        fn.__closure__,
    )
    return types.MethodType(copy, method.__self__)


def dummy_batch(
    vocab_size: int, device: torch.device, num_tokens: int = 7
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A mixed batch (one prefill chunk, one decode) whose dynamic sizes are all distinct and
    >= 2, writing only to the scratch block 0."""
    seq_lens = [num_tokens - 1 + 3, 1 + 4]
    starts = [0, num_tokens - 1, num_tokens]
    ids = torch.arange(num_tokens, device=device) % vocab_size
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        block_tables=torch.zeros(2, 4, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
    )
    return ids, positions, meta


class CompiledForward:
    """Drop-in replacement for `model.forward(input_ids, positions, kv_caches, meta)`."""

    def __init__(self, model: nn.Module, config: CompileConfig, dtype: torch.dtype) -> None:
        self.config = config
        self.cache_dir = apply_inductor_settings(config)
        self.pass_manager = PassManager(select(config.passes), PassContext(config.target, dtype))
        self.backend = PiecewiseBackend(self.pass_manager)
        self.model = model
        self._fn = torch.compile(
            _own_code_object(model.forward),
            backend=self.backend,
            fullgraph=True,
            dynamic=False,
            options={"guard_filter_fn": _drop_all_guards},
        )
        self.capture_seconds = 0.0

    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Trace and compile now, on a dummy batch, so that no request pays for it."""
        device = kv_caches[0].device
        ids, positions, meta = dummy_batch(self.model.config.vocab_size, device)
        for t in (ids, positions, meta.slot_mapping, meta.seq_lens, meta.query_start_loc):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(meta.block_tables, 0)
        torch._dynamo.mark_dynamic(meta.block_tables, 1)
        start = time.perf_counter()
        self.backend.capture_started = start
        with torch.inference_mode():
            self._fn(ids, positions, kv_caches, meta)
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "captured and compiled in %.1f s: %d pieces, %d compiled",
            self.capture_seconds,
            len(self.backend.stats.pieces),
            self.backend.stats.unique_pieces,
        )

    @property
    def recompilations(self) -> int:
        return max(0, self.backend.stats.compilations - 1)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self._fn(input_ids, positions, kv_caches, meta)
