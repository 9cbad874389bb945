"""What the kernels' launch choices read of the device: its SM count, and whether kernels
overlap their neighbours by programmatic dependent launch.

Split-KV attention (paged and MLA) and the skinny GEMM's even row partition size their grids
from the number of SMs. On CPU the kernels run under the Triton interpreter, which has no SMs:
a fixed count keeps every choice deterministic there.

Programmatic dependent launch (PDL, sm_90+, on by default; COMPILE_ENGINE_PDL=0 turns it
off): in launches of at most PDL_MAX_ROWS tokens (the skinny GEMM's rows, the decode tokens of
attention and silu_and_mul) our kernels launch as PDL dependents: the kernel may start before
the one ahead of it ends, and each program waits (griddepcontrol.wait) for that kernel to
finish before it touches memory, so launch and set-up overlap the kernel ahead. Read once per
process (pdl_settings), so inside a CUDA graph it is fixed at capture. With gate_up and down
on the skinny GEMM at <= 16 rows too (kernels_generated/configs/skinny_gemm.json), every
kernel of a batch-1 layer but Inductor's fused norms is a dependent.
Each dependent releases the kernel after it late (griddepcontrol.launch_dependents after its
main loop, before its epilogue: the skinny GEMM after its K loop, attention after its key loops,
silu_and_mul after its loads), so the next kernel's programs take each SM as this one's leave it
instead of after the whole grid has ended (COMPILE_ENGINE_PDL_TRIGGER=0 releases it only when
the kernel ends), and each skinny GEMM program puts the first K-tile of its weight slice into L2
before it waits, so its first loads hit L2 when the wait ends (COMPILE_ENGINE_PDL_PREFETCH_TILES:
that many tiles; 0 none). Variants stay behind settings for experiments: releasing the next
kernel at once (griddepcontrol.launch_dependents right after the wait;
COMPILE_ENGINE_PDL_TRIGGER=1), prefetching the whole weight slice of weights up to
COMPILE_ENGINE_PDL_PREFETCH_MB MiB (0, the default, none), and setting the attention kernel's
release apart (COMPILE_ENGINE_PDL_TRIGGER_ATTENTION, the same values: at batch 1 it runs ~7.8 us
on a few SMs, so released at once, the o_proj GEMM after it could take the idle SMs and stream
its weight into L2 meanwhile); all measured as losses.
Measured on the H200 (`bench latency`, variants alternating in one call; docs/compiler.md
section 6): at 57cd701 (Inductor's PDL off) ours with gate_up and down on the skinny GEMM 232.0
/ 232.2 tok/s at batch 1 against 228.8 / 229.3 off and 228.6 / 229.2 ours with those two on
cuBLAS, batch 64 and 256 within 0.4%; at 8ca2af7 with Inductor's PDL on, 235.3 / 235.2 against
230.2 / 230.3; at fe23f5b ours releasing at once 225.7 / 223.8 against 229.2 / 229.6, with the
o_proj prefetch 223.2 / 221.4; at db83b9a releasing late 240.6 / 240.5 against 238.9 / 238.6
when the kernel ends, late with 2 prefetched K-tiles 240.2 / 239.8, attention released at once
with the o_proj prefetch 236.3 / 236.3, all three 236.7 / 236.6; at 9a6247e (late the default)
one prefetched K-tile 241.9 / 242.0 and 241.9 / 241.9 against 240.1 in all four rounds (two
calls, order swapped), attention released at once 238.4 / 238.4.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

CPU_SM_COUNT = 8


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (looked up once per device); CPU_SM_COUNT elsewhere."""
    if device.type != "cuda":
        return CPU_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


PDL_ENV = "COMPILE_ENGINE_PDL"  # 0: off
PDL_PREFETCH_ENV = "COMPILE_ENGINE_PDL_PREFETCH_MB"  # largest weight a GEMM prefetches; 0: none
PDL_TRIGGER_ENV = "COMPILE_ENGINE_PDL_TRIGGER"  # late (default): release the next kernel after
# the main loop; 0: when this one ends; 1: right after the wait
PDL_ATTENTION_TRIGGER_ENV = "COMPILE_ENGINE_PDL_TRIGGER_ATTENTION"  # the same for attention alone
PDL_PREFETCH_TILES_ENV = "COMPILE_ENGINE_PDL_PREFETCH_TILES"  # leading K-tiles into L2; 0: none
PDL_PREFETCH_TILES = 1  # its default
# pdl_mode's values: the PDL constexpr of our kernels.
PDL_OFF, PDL_WAIT, PDL_RELEASE_AT_ONCE, PDL_RELEASE_LATE = 0, 1, 2, 3
_TRIGGERS = {"0": PDL_WAIT, "1": PDL_RELEASE_AT_ONCE, "late": PDL_RELEASE_LATE}
# Launches of more tokens stay plain: measured at batch 64 and 256 (9f6b2fa), ours within the
# spread of off (13,411 against 13,455 and 29,608 against 29,592 tok/s, one run each).
PDL_MAX_ROWS = 16


def env_switch(name: str, default: bool, error: type[Exception] = ValueError) -> bool:
    """An on/off setting from the environment: 1 or 0, unset or empty for `default`; any other
    value raises `error` saying what to set."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise error(f"{name}={value!r}: set it to 1 (on) or 0 (off)")
    return default if value == "" else value == "1"


@functools.cache
def ab_switch(name: str, error: type[Exception] = ValueError, default: bool = False) -> bool:
    """A kernel variant's on/off setting for A/B runs (`env_switch`), read once per process: a
    CUDA graph fixes it at capture (`ab_switch.cache_clear()` re-reads them all)."""
    return env_switch(name, default=default, error=error)


def _whole_number(name: str, what: str, default: int = 0) -> int:
    value = os.environ.get(name, "").strip() or str(default)
    if not value.isdigit():
        raise ValueError(f"{name}={value!r}: want a whole number of {what} (0: none)")
    return int(value)


class PdlSettings(NamedTuple):
    on: bool
    mode: int  # a dependent's PDL constexpr (pdl_mode)
    attention_mode: int  # the same for the attention kernel
    prefetch_bytes: int  # the largest weight a skinny GEMM prefetches whole; 0: none
    prefetch_tiles: int  # else its first K-tiles (1 by default); 0: none


def _trigger(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value not in _TRIGGERS:
        raise ValueError(
            f"{name}={value!r}: set it to 0 (release the next kernel when this one ends), "
            "1 (at once) or late (after the main loop)"
        )
    return _TRIGGERS[value]


@functools.cache
def pdl_settings() -> PdlSettings:
    """The PDL settings from the environment, read once per process, not at every launch
    (`pdl_settings.cache_clear()` re-reads them)."""
    mode = _trigger(PDL_TRIGGER_ENV, PDL_RELEASE_LATE)
    return PdlSettings(
        on=env_switch(PDL_ENV, default=True),
        mode=mode,
        attention_mode=_trigger(PDL_ATTENTION_TRIGGER_ENV, mode),
        prefetch_bytes=_whole_number(PDL_PREFETCH_ENV, "MiB") << 20,
        prefetch_tiles=_whole_number(PDL_PREFETCH_TILES_ENV, "K-tiles", PDL_PREFETCH_TILES),
    )


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on `device` may use programmatic dependent launch (see above)."""
    if device.type != "cuda" or not pdl_settings().on:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= (9, 0)


def pdl_mode(device: torch.device, rows: int, attention: bool = False) -> int:
    """A kernel's PDL constexpr for a launch of `rows` tokens: PDL_OFF (0) a plain launch,
    PDL_WAIT (1) a PDL dependent that waits for the kernel ahead, PDL_RELEASE_AT_ONCE (2) one
    that then releases the next kernel at once (COMPILE_ENGINE_PDL_TRIGGER=1),
    PDL_RELEASE_LATE (3, the default) one that releases it after its main loop. The attention
    kernel may be set apart (COMPILE_ENGINE_PDL_TRIGGER_ATTENTION): at batch 1 it runs on a
    few SMs, so the o_proj GEMM after it could fill the rest early and prefetch its weight."""
    if rows > PDL_MAX_ROWS or not pdl_enabled(device):
        return PDL_OFF
    settings = pdl_settings()
    return settings.attention_mode if attention else settings.mode


def pdl_launch(enabled: bool) -> dict:
    """A kernel launch's options when the kernel is a PDL dependent: it may start before the
    kernel ahead of it ends, so it must wait (gdc_wait) before it touches their memory."""
    return {"launch_pdl": True} if enabled else {}


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
