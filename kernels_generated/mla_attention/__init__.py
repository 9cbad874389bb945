"""MLA latent attention in Triton, by role: kernels.py the @triton.jit kernels and their
design, launch.py the input checks and the launches (on paged attention's launch code),
ops.py the custom op the mla_absorb pass emits. Importing the package registers the op."""

from compile_engine.kernels_generated.mla_attention.kernels import INTERPRETED
from compile_engine.kernels_generated.mla_attention.launch import (
    MLAKernelError,
    choose_num_splits,
    mla_latent_attention_triton,
)
from compile_engine.kernels_generated.mla_attention.ops import mla_latent_attention

__all__ = [
    "INTERPRETED",
    "MLAKernelError",
    "choose_num_splits",
    "mla_latent_attention",
    "mla_latent_attention_triton",
]
