"""Runs the selected passes over a captured graph and records what each one did."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

from torch import fx

from compile_engine.passes.base import GraphPass, PassContext

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PassManager:
    passes: list[GraphPass]
    ctx: PassContext
    match_counts: dict[str, int] = field(default_factory=dict)

    def __call__(self, graph: fx.Graph) -> None:
        for p in self.passes:
            if not p.applies(self.ctx):
                self.match_counts[p.name] = 0
                continue
            count = p.apply(graph, self.ctx)
            self.match_counts[p.name] = self.match_counts.get(p.name, 0) + count
            log.info("pass %s: %d matches", p.name, count)
            if count:
                # What a rewrite left dead (rotary_into_attention's rotary nodes) goes before
                # the next pass, which would otherwise match it and count it as its own.
                graph.eliminate_dead_code()
        graph.eliminate_dead_code()
        graph.lint()

    def uuid(self) -> str:
        """Feeds the artifact's cache key: which passes, in which order, with which code, and
        the kernel config their kernels launch with."""
        h = hashlib.sha256()
        for p in self.passes:
            h.update(f"{p.name}:{p.uuid()};".encode())
        h.update(f"{self.ctx.target}:{self.ctx.dtype}:{self.ctx.kernel.key}".encode())
        return h.hexdigest()[:16]

    def describe(self) -> list[dict]:
        return [
            {
                "name": p.name,
                "uuid": p.uuid(),
                "applies": p.applies(self.ctx),
                "matches": self.match_counts.get(p.name, 0),
            }
            for p in self.passes
        ]
