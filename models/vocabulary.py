"""The whole op vocabulary: every `torch.ops.ce` op with its reference, gathered from the
modules that define them (models/ops.py, models/moe.py, models/mla.py, models/quant.py, and
the tensor-parallel all_reduce_add_rms_norm of models/parallel.py).

Importing this module registers every op. Each defining module keeps its own table and none
adds to another's, so the imports go one way: moe.py and mla.py import ops.py (silu_and_mul, the
block gather), this module imports all three, and a model imports only the ops it calls. Code
that handles any op (the compiler's backend, the cache key of the references) reads it here.
"""

from __future__ import annotations

from compile_engine.models import mla, moe, ops, parallel, quant

# name -> (op, reference): the reference is the eager implementation and every lowering's oracle.
OPS = {**ops.OPS, **moe.MOE_OPS, **mla.MLA_OPS, **quant.QUANT_OPS, **parallel.PARALLEL_OPS}

# Ops whose reference reads device values on the host (sequence lengths, experts present): a
# graph that still calls one cannot be captured in a CUDA graph; their kernel lowerings can.
HOST_SYNC_OPS = ops.HOST_SYNC_OPS | moe.HOST_SYNC_OPS | mla.HOST_SYNC_OPS
