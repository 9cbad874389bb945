"""The vnni_cpu layout's GEMM (issue 29): 4- and 8-bit GGUF weights times 16-bit activations on
AVX-512 VNNI (or AVX2), what the quantized GEMM pass lowers a vnni_cpu `ce.quant_linear` to, and
the quantized tied lm_head's logits.

The kernel is C++ (csrc/vnni_linear.cpp says its arithmetic and layout), built once per source,
torch, flags and ISA into the cache directory with the machine's g++ and loaded as the
`ce_cpu::vnni_linear` op (AVX-512 VNNI) or `ce_cpu::vnni_linear_avx2` (the same source for CPUs
without AVX-512; bit-equal to the first); the fastest build the CPU runs is the one used. Its
oracle is `quant_linear_ref` (dequantize the weight, quantize and dequantize the activation per
group of 32, matmul in float32), which it matches but for the order floats are added
(tests/kernels/test_vnni_linear_cpu.py).

Why ours: ATen's CPU int4 GEMM dequantizes to bfloat16 and runs float FMAs, and per row. One
SmolLM2 layer's four linears on the 2-core EPYC (Zen 4, min of 5 x 50 calls, us) at 1 / 16
rows: ATen int4 124 / 746, this kernel 64 / 394; the [49152, 576] Q8_0 lm_head 1,037 / 5,874
here against 10.6 ms a 16-row step in the compiled Inductor form it replaces. A step's 30 layers
of codes and scales (90 MB) do not stay in cache, so each thread prefetches the block it computes
next while it computes this one: 16 rows went from 14-18 to 7.5-11 ms a step of linears there.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from compile_engine.models.quant import (
    VNNI_BLOCK_N,
    VNNI_CODE_OFFSET,
    VNNI_GROUP,
    QuantScheme,
    pack_vnni,
    vnni_cpu_isas,
    vnni_scales,
)

SOURCE = Path(__file__).parent / "csrc" / "vnni_linear.cpp"
CXX_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp")
# Per build (models/quant.py: VNNI_CPU_ISAS says what each needs of the CPU): its flags, its op.
ISA_FLAGS = {
    "avx512_vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"),
    "avx2": ("-mavx2", "-mfma", "-DCE_VNNI_AVX2"),
}
ISA_OPS = {"avx512_vnni": "vnni_linear", "avx2": "vnni_linear_avx2"}


class KernelBuildError(RuntimeError):
    """The C++ kernel did not build; the message has the compiler's output."""


def extension_dir() -> Path:
    """Where built kernels are kept: beside the Inductor cache (COMPILE_ENGINE_CACHE_DIR's
    parent when it is set, else ~/.cache/compile-engine)."""
    if override := os.environ.get("COMPILE_ENGINE_CACHE_DIR"):
        return Path(override).parent / "cpp_extensions"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "compile-engine" / "cpp_extensions"


def _compile_command(source: Path, flags: tuple[str, ...], output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = ["g++", *flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    command += [str(source), "-o", str(output)]
    command += [f"-I{path}" for path in include_paths()]
    command += [f"-I{sysconfig.get_paths()['include']}"]
    # torch's own libgomp (same soname), so the kernel's threads are torch.set_num_threads's.
    command += [f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-lgomp", f"-Wl,-rpath,{torch_lib}"]
    return command


def build_library(source: Path, name: str, flags: tuple[str, ...]) -> Path:
    """`source` built (once per its text, torch's version and `flags`) into the extension
    directory as a shared library named after `name`, and its path; raises KernelBuildError
    with the compiler's output."""
    key = hashlib.sha256()
    key.update(source.read_bytes())
    key.update(f"{torch.__version__}|{' '.join(flags)}".encode())
    directory = extension_dir()
    library = directory / f"{name}_{key.hexdigest()[:16]}.so"
    if not library.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        # Built beside, then renamed: two processes building at once both end with one file.
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            done = subprocess.run(
                _compile_command(source, flags, partial), capture_output=True, text=True
            )
            if done.returncode != 0:
                raise KernelBuildError(
                    f"building {source.name} ({name}) failed (g++ exit {done.returncode}):\n"
                    f"{done.stderr}"
                )
            os.replace(partial, library)
        finally:
            partial.unlink(missing_ok=True)
    return library


def machine_isa() -> str:
    """The fastest build of the kernel this CPU runs."""
    isas = vnni_cpu_isas()
    if not isas:
        raise KernelBuildError(
            "the vnni_cpu layout needs an x86 CPU with AVX-512 VNNI or AVX2 and g++ on Linux; "
            "use --dtype float32 for the dequantized path"
        )
    return isas[0]


@functools.cache  # called per linear where it runs eagerly: resolved once
def load(isa: str | None = None) -> Callable[..., Tensor]:
    """Build (once per source, torch version, flags and ISA) and load the kernel's build for
    `isa` (default: the machine's fastest); returns its op."""
    return _load(isa or machine_isa())


@functools.cache
def _load(isa: str) -> Callable[..., Tensor]:
    library = build_library(SOURCE, ISA_OPS[isa], (*CXX_FLAGS, *ISA_FLAGS[isa]))
    torch.ops.load_library(str(library))
    name = f"ce_cpu::{ISA_OPS[isa]}"

    @torch.library.register_fake(name)
    def _fake(x: Tensor, weight: Tensor, scales: Tensor, bits: int) -> Tensor:
        return x.new_empty(x.shape[0], scales.shape[0] * scales.shape[3])

    return getattr(torch.ops.ce_cpu, ISA_OPS[isa])


def vnni_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
    scheme: str,
) -> Tensor:
    """quant_linear over a vnni_cpu weight: x [..., K] -> [..., N] in x's dtype."""
    op = load()
    bits = QuantScheme.parse(scheme).bits
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    out = op(rows, weight, weight_scale, bits)
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


class VnniLogits:
    """A tied Q8_0 lm_head (a QuantEmbedding's int8 codes) on the kernel: the codes packed once
    more, into the vnni_cpu layout (+28 MB for SmolLM2's [49152, 576]; the embedding's gather
    keeps reading rows of the plain one), at `warm`: the engine builds this head before the
    weights are read (on a thread, runtime/builder.py) and warms it once they are. Packed at
    construction, a second engine in a process (its imports done, so built sooner) packed codes
    not yet read and answered garbage."""

    def __init__(self, embedding: torch.nn.Module) -> None:
        scheme = embedding.quant_scheme
        if not self.runs(embedding):
            raise ValueError(f"VnniLogits runs int8 group-32 weights of 16k rows, not {scheme}")
        self.op = load()
        self.embedding = embedding
        self.weight: Tensor | None = None
        self.scales: Tensor | None = None

    @staticmethod
    def runs(embedding: torch.nn.Module) -> bool:
        scheme = embedding.quant_scheme
        return (
            scheme.weight == "int8"
            and scheme.layout == "plain"
            and scheme.group == VNNI_GROUP
            and embedding.out_features % VNNI_BLOCK_N == 0
        )

    def __call__(self, hidden: Tensor) -> Tensor:
        if self.weight is None:
            raise RuntimeError("VnniLogits is packed at warm(), once the weights are read")
        rows = hidden.float().contiguous()
        return self.op(rows, self.weight, self.scales, 8).to(hidden.dtype)

    def warm(self, hidden_size: int, dtype: torch.dtype) -> None:
        """Pack the embedding's codes and scales (their values read by now); nothing to
        compile. Q8Logits' interface: the arguments are its."""
        embedding = self.embedding
        codes = (embedding.weight.to(torch.int16) + VNNI_CODE_OFFSET["int8"]).to(torch.uint8)
        self.weight = pack_vnni(codes, 8)
        self.scales = vnni_scales(embedding.weight_scale, embedding.quant_scheme)
