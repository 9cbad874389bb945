"""Paged attention in Triton, by role: kernels.py the @triton.jit kernels and their design,
launch.py the input checks, the shape-only choices and the launches (and the launch code MLA
shares), ops.py the custom ops the passes emit. Importing the package registers the ops."""

from compile_engine.kernels_generated.paged_attention.kernels import INTERPRETED
from compile_engine.kernels_generated.paged_attention.launch import (
    PagedAttentionKernelError,
    choose_num_splits,
    choose_tiled,
    paged_attention_triton,
    tiled_num_splits,
    unsplit_context,
)
from compile_engine.kernels_generated.paged_attention.ops import (
    paged_attention,
    paged_attention_rotary,
    paged_attention_rotary_ref,
)

__all__ = [
    "INTERPRETED",
    "PagedAttentionKernelError",
    "choose_num_splits",
    "choose_tiled",
    "paged_attention",
    "paged_attention_rotary",
    "paged_attention_rotary_ref",
    "paged_attention_triton",
    "tiled_num_splits",
    "unsplit_context",
]
