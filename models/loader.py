"""Load a model from an HF directory, a GGUF file or an alias.

The model is built on the meta device, given real storage once (`to_empty`), and every
parameter is filled from the checkpoint through one declared mapping: checkpoint projection
names that the model fuses (q/k/v -> qkv_proj, gate/up -> gate_up_proj) come from the model's
`packed_modules` table, everything else maps by name. A tensor that is missing, unexpected,
mis-shaped or half of a fused group is an error naming it.

MoE models add two tables. `stacked_modules` says which per-expert projections
(`<experts>.<e>.<proj>.weight`) stack into one [E, ...] parameter of a StackedExperts module
(`{"w13": ("w1", "w3"), "w2": ("w2",)}`); `checkpoint_renames` maps dotted name fragments of
other checkpoint layouts to ours (transformers 5 may save experts already stacked, as
`experts.gate_up_proj`). A parameter loaded whole counts for all of its shards.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compile_engine.models.config import ModelConfig, resolve_dtype
from compile_engine.models.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError
from compile_engine.models.gguf_alias import SMOLLM2_ALIAS, resolve_alias
from compile_engine.models.layers import FusedLinear, LazyTensor
from compile_engine.models.moe import StackedExperts
from compile_engine.models.ops import KV_FP8_DTYPE, kv_cache_torch_dtype
from compile_engine.models.parallel import TensorParallel, is_sharded, shard_model
from compile_engine.models.quant import (
    QuantConfig,
    QuantLinear,
    gguf_quant_config,
    quant_config,
    quantize_model,
    vnni_cpu_supported,
)
from compile_engine.models.registry import model_class

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Checkpoint entries that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True)
class ModelSource:
    """Where a model comes from: an HF directory or a GGUF file."""

    path: Path
    kind: str  # "hf" | "gguf"

    @property
    def directory(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent


def resolve_source(model: str | Path) -> ModelSource:
    alias = resolve_alias(str(model))
    if alias is not None:
        return ModelSource(alias, "gguf")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, "gguf")
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path, "hf")
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        raise UnsupportedModelError(_pickle_message(path))
    if path.is_dir():
        # A directory of pickle weights without config.json: the format is the problem to fix,
        # not the missing config.
        pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise UnsupportedModelError(_pickle_message(pickles[0]))
    raise ModelNotFoundError(
        f"{model!s} is not an HF model directory (with config.json), a .gguf file or a known "
        f"alias ({SMOLLM2_ALIAS}); models are never downloaded from a hub"
    )


def _pickle_message(path: Path) -> str:
    return (
        f"{path} is a pickle checkpoint, which can run arbitrary code and is never loaded; "
        "convert it to safetensors (e.g. save_pretrained(..., safe_serialization=True))"
    )


def read_hf_config(directory: Path):
    """The transformers config of an HF directory, refusing unknown architectures and remote
    code before transformers sees them."""
    import transformers

    raw = json.loads((directory / "config.json").read_text())
    cls = model_class(raw.get("architectures"))  # raises for anything unsupported
    del cls
    return transformers.AutoConfig.from_pretrained(str(directory), trust_remote_code=False)


def resolve_config(model: str | Path) -> ModelConfig:
    """The ModelConfig of a model without building it: what a tensor-parallel engine hands its
    workers, so that they need not ask transformers again."""
    source = resolve_source(model)
    if source.kind == "gguf":
        from compile_engine.models.gguf import GGUFCheckpoint

        hf_config = GGUFCheckpoint(source.path).hf_config()
    else:
        hf_config = read_hf_config(source.path)
    return model_class(hf_config.architectures).config_from_hf(hf_config)


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    pickles = [p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise UnsupportedModelError(_pickle_message(pickles[0]))
    raise CheckpointError(f"{directory} has no *.safetensors weights")


def _iter_safetensors(
    files: list[Path], lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """(name, tensor) of every checkpoint tensor; with `lazy`, a LazyTensor instead, which
    reads only the slice a tensor-parallel rank's parameter asks for."""
    from safetensors import safe_open

    # Host tensors backed by the file's mapping; the parameter copy moves them to the device.
    # Reading onto the GPU instead gives each tensor a temporary device buffer first, which the
    # caching allocator keeps: while the engine reads weights on a thread, the free memory it
    # sizes the KV pool from would then depend on how far the read had got.
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if lazy:
                    part = f.get_slice(name)
                    yield name, LazyTensor(part, tuple(part.get_shape()))
                else:
                    yield name, f.get_tensor(name)


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill every parameter of `model` from (checkpoint name, tensor) pairs."""
    shard_to_fused = {
        shard: fused for fused, shards in model.packed_modules.items() for shard in shards
    }
    proj_to_stacked = {
        proj: stacked
        for stacked, projs in getattr(model, "stacked_modules", {}).items()
        for proj in projs
    }
    renames = [
        (old.split("."), new.split("."))
        for old, new in getattr(model, "checkpoint_renames", {}).items()
    ]
    owners: dict[str, nn.Module] = {}
    expected: dict[tuple[str, str | None], str] = {}  # (param, shard) -> checkpoint name
    for module_name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            owners[full] = module
            if isinstance(module, FusedLinear) or (
                isinstance(module, QuantLinear) and module.shards
            ):
                parent = module_name.rpartition(".")[0]
                for shard in module.shards:
                    expected[(full, shard)] = f"{parent}.{shard}.{pname}".lstrip(".")
            elif isinstance(module, StackedExperts):
                for expert in range(module.num_experts):
                    for proj in module.shards[pname]:
                        ckpt = f"{module_name}.{expert}.{proj}.weight"
                        expected[(full, (proj, expert))] = ckpt
            else:
                expected[(full, None)] = full
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[tuple[str, str | None]] = set()
    skip = getattr(model, "skip_checkpoint_tensor", None)
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if skip is not None and skip(name):
            continue  # a part of the checkpoint the model declares it does not run
        kv_scale = kv_scale_target(name)
        if kv_scale is not None:
            _load_kv_scale(model, *kv_scale, tensor, name)
            continue
        parts = _rename(name.split("."), renames)
        stacked = _stacked_target(parts, proj_to_stacked, params)
        if stacked is not None:
            target, shard = stacked
        else:
            shard = next((p for p in parts if p in shard_to_fused), None)
            target = ".".join(shard_to_fused[p] if p == shard else p for p in parts)
        if target not in params:
            raise CheckpointError(
                f"unexpected tensor {name} in the checkpoint: {model.config.architecture} has "
                "no parameter for it (is the config right for these weights?)"
            )
        owners[target].load_shard(params[target], tensor, shard, name)
        loaded.add((target, shard))
    whole = {target for target, shard in loaded if shard is None}
    missing = [ckpt for key, ckpt in expected.items() if key not in loaded and key[0] not in whole]
    if missing:
        shown = ", ".join(missing[:4]) + (
            f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        )
        raise CheckpointError(f"the checkpoint is missing tensor(s): {shown}")
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.finish_loading()  # a fused per-tensor weight's shards, to one scale


# The checkpoint names of an attention layer's FP8 KV-cache scales, as vLLM reads them:
# compressed-tensors `self_attn.k_scale`, ModelOpt `self_attn.k_proj.k_scale`, older
# llm-compressor `self_attn.k_proj.output_scale`; the deprecated `kv_scale` sets both.
_KV_SCALE_SUFFIXES = {
    ".self_attn.k_scale": ("k_scale",),
    ".self_attn.v_scale": ("v_scale",),
    ".self_attn.k_proj.k_scale": ("k_scale",),
    ".self_attn.v_proj.v_scale": ("v_scale",),
    ".self_attn.k_proj.output_scale": ("k_scale",),
    ".self_attn.v_proj.output_scale": ("v_scale",),
    ".self_attn.kv_scale": ("k_scale", "v_scale"),
}


def kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(attention module, its scale buffers) for a checkpoint KV-cache scale; None otherwise."""
    for suffix, which in _KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".self_attn", which
    return None


def _load_kv_scale(
    model: nn.Module, module_name: str, which: tuple[str, ...], tensor: torch.Tensor, name: str
) -> None:
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        module = None
    if not hasattr(module, "load_kv_scale"):
        raise CheckpointError(
            f"unexpected tensor {name} in the checkpoint: {model.config.architecture} has no "
            "attention layer with KV-cache scales there (MLA layers take none)"
        )
    for buffer in which:
        module.load_kv_scale(buffer, tensor, name)


def _rename(parts: list[str], renames: list[tuple[list[str], list[str]]]) -> list[str]:
    """Replace every run of whole name parts equal to a rename's source by its target."""
    for old, new in renames:
        i = 0
        while i + len(old) <= len(parts):
            if parts[i : i + len(old)] == old:
                parts = parts[:i] + new + parts[i + len(old) :]
                i += len(new)
            else:
                i += 1
    return parts


def _stacked_target(
    parts: list[str], proj_to_stacked: dict[str, str], params: dict
) -> tuple[str, tuple[str, int]] | None:
    """`<experts>.<e>.<proj>.weight` -> (`<experts>.<stacked>`, (proj, e)), when that
    stacked parameter exists; None for every other name."""
    if len(parts) < 4 or parts[-1] != "weight" or not parts[-3].isdigit():
        return None
    stacked = proj_to_stacked.get(parts[-2])
    if stacked is None:
        return None
    target = ".".join([*parts[:-3], stacked])
    return (target, (parts[-2], int(parts[-3]))) if target in params else None


def export_hf_checkpoint(model: nn.Module, hf_config, directory: Path) -> Path:
    """Write the model as an HF safetensors directory (fused parameters split back into the
    checkpoint's projections through the same packed_modules table): what a converted
    checkpoint (GGUF) becomes inside an artifact, so that loading it needs no conversion."""
    from safetensors.torch import save_file

    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise CheckpointError(
            "a quantized model is not exported (its FP8 weights would need a quantization_config"
            "); build the artifact without --quantization, or from an FP8 HF checkpoint"
        )
    if is_sharded(model):
        raise CheckpointError("a tensor-parallel shard cannot be exported as a whole checkpoint")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if isinstance(module, FusedLinear):
                parent = module_name.rpartition(".")[0]
                for shard, (start, end) in module.offsets.items():
                    tensors[f"{parent}.{shard}.{pname}".lstrip(".")] = param[start:end]
            else:
                tensors[full] = param
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(str(directory))
    return directory


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    hf_config: object  # None when the config came from an artifact
    source: ModelSource
    dtype: torch.dtype
    quant: QuantConfig | None = None  # models/quant.py; None: not quantized
    # The paged KV cache's element type (kv_cache_dtype, `kv_cache_torch_dtype`): the model
    # dtype, or float8_e4m3fn scaled by each attention layer's k_scale / v_scale.
    kv_cache_dtype: torch.dtype | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        """What the KV cache tensors hold (the model dtype unless kv_cache_dtype says FP8)."""
        return self.dtype if self.kv_cache_dtype is None else self.kv_cache_dtype


def check_kv_cache_dtype(model: nn.Module, kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for `kv_cache_dtype` ("auto", "fp8", "fp8_e4m3"); an FP8 cache
    of a model whose attention takes no KV scales (MLA's latent cache) is refused by name."""
    torch_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    if torch_dtype == KV_FP8_DTYPE:
        from compile_engine.models.deepseek import MLAttention

        if any(isinstance(m, MLAttention) for m in model.modules()):
            raise UnsupportedModelError(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported for "
                f"{model.config.architecture}: MLA's latent cache has no FP8 form yet; use "
                "kv_cache_dtype 'auto'"
            )
    return torch_dtype


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int | None = None,
    parallel: TensorParallel | None = None,
) -> nn.Module:
    """Construct on the meta device, then give real (uninitialised) storage on `device`."""
    model = build_on_meta(config, dtype, max_positions, parallel)
    materialize(model, device)
    return model


def build_on_meta(
    config: ModelConfig,
    dtype: torch.dtype,
    max_positions: int | None = None,
    parallel: TensorParallel | None = None,
) -> nn.Module:
    """The model with every parameter and buffer on the meta device: shapes, no storage;
    with `parallel`, this rank's shard of it (models/parallel.py)."""
    cls = model_class([config.architecture])
    with torch.device("meta"):
        model = cls(config, max_positions)
        if parallel is not None:
            shard_model(model, parallel)
    return model.to(dtype=dtype).eval().requires_grad_(False)


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Give a meta model real, uninitialised storage on `device`, in place, and compute its
    buffers (rope tables)."""
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()


def dequantized_dtype(device: torch.device) -> torch.dtype:
    """What "auto" means for a quantized (GGUF) checkpoint, which has no float dtype of its
    own: bfloat16 where the hardware multiplies it natively, else float32. On the 2-core
    EPYC CI machine SmolLM2 decodes at 42.0 tok/s in bfloat16 vs 24.4 in float32 (batch 1;
    benchmarks/results/latency-{bf16,fp32}-cpu-*.json): decode streams the weights, and bf16
    halves them."""
    if device.type == "cuda":
        return torch.bfloat16
    try:
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return torch.bfloat16
    except (AttributeError, RuntimeError):
        pass
    return torch.float32


def gguf_quantization(
    checkpoint, device: torch.device, dtype: torch.dtype, quantization: str | None
) -> QuantConfig | None:
    """How a GGUF file runs: kept quantized (its projections int4/int8 quant_linears, its Q8_0
    embedding a QuantEmbedding) by default on a CPU (dtype "auto"; issue 29, docs/compiler.md): in
    the vnni_cpu layout (our integer kernel, activations quantized per group) where the CPU has
    AVX-512 VNNI or AVX2, else in ATen's CPU int4 layout where it multiplies bfloat16 (an Arm CPU).
    None, dequantized, for an explicit dtype (`--dtype float32` / `bfloat16`: today's paths), on
    CUDA (no GPU kernel for GGUF's formats yet), on a CPU with neither (ATen's float32 int4 path is
    30x slower) and with quantization="fp8" (online FP8 of the dequantized weights)."""
    from compile_engine.models.gguf import QUANTIZED_TYPES

    if device.type != "cpu" or quantization is not None:
        return None
    if vnni_cpu_supported():
        layout = "vnni_cpu"
    elif dtype == torch.bfloat16:
        layout = "int4pack_cpu"
    else:
        return None
    types = checkpoint.tensor_types()
    if not any(t in QUANTIZED_TYPES for t in types.values()):
        return None  # an F32 / F16 file
    return gguf_quant_config(types, QUANTIZED_TYPES, layout)


def load_model(
    model: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
    quantization: str | None = None,
    config: ModelConfig | None = None,
    parallel: TensorParallel | None = None,
    kv_cache_dtype: str = "auto",
) -> LoadedModel:
    loaded, tensors = open_model(
        model,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        quantization=quantization,
        config=config,
        parallel=parallel,
        kv_cache_dtype=kv_cache_dtype,
    )
    load_weights(loaded.model, tensors)
    return loaded


def open_model(
    model: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
    config: ModelConfig | None = None,
    storage: bool = True,
    quantization: str | None = None,
    parallel: TensorParallel | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[LoadedModel, Iterator[tuple[str, torch.Tensor]]]:
    """The model built with uninitialised storage (on the meta device with `storage=False`:
    `WeightRead` gives it storage), and the checkpoint's (name, tensor) pairs that
    `load_weights` fills it from, not yet read: the engine reads them on a thread while it
    compiles. A given `config` (an artifact's, resolved at build) is used instead of asking
    transformers for one; `hf_config` is then None. quantization: None, or "fp8" (online FP8 of
    a model-dtype checkpoint); an FP8 checkpoint's own quantization_config applies either way
    (models/quant.py). With `parallel`, the model is this rank's shard and a safetensors
    checkpoint is read slice by slice (GGUF: dequantized whole, then sliced). A GGUF file with
    dtype "auto" on the CPU stays quantized (`gguf_quantization`) unless it is sharded; an
    explicit dtype dequantizes it, as before. kv_cache_dtype: one of KV_CACHE_DTYPES (vLLM's
    names), what `LoadedModel.cache_dtype` then says the KV cache holds."""
    source = resolve_source(model)
    device = torch.device(device)
    hf_config = None
    gguf_quant = None
    if source.kind == "gguf":
        from compile_engine.models.gguf import GGUFCheckpoint

        checkpoint = GGUFCheckpoint(source.path)
        hf_config = checkpoint.hf_config()
        config = model_class(hf_config.architectures).config_from_hf(hf_config)
        auto = dtype == "auto"
        if auto:
            dtype = dequantized_dtype(device)
        torch_dtype = resolve_dtype(dtype, config)
        if auto and (parallel is None or parallel.world_size == 1):
            # Sharded, it is dequantized and sliced (QuantLinear layers are not sharded).
            gguf_quant = gguf_quantization(checkpoint, device, torch_dtype, quantization)
            if gguf_quant is not None:
                # The int4 GEMMs compute in bfloat16 (models/quant.py, INT4PACK_DTYPE), the
                # rest (residual stream, norms, attention, KV) in float32: all in bfloat16, the
                # top-1 agreement with the file dequantized in float32 was 96.3% over 2,047
                # tokens of SmolLM2, float32 around the GEMMs 98.4% (bench quant-accuracy).
                torch_dtype = torch.float32
        if gguf_quant is not None:
            tensors = checkpoint.quantized_tensors()
        else:
            tensors = checkpoint.tensors(torch.float32)
    else:
        if config is None:
            hf_config = read_hf_config(source.path)
            config = model_class(hf_config.architectures).config_from_hf(hf_config)
        torch_dtype = resolve_dtype(dtype, config)
        tensors = _iter_safetensors(_safetensors_files(source.path), lazy=parallel is not None)
    max_positions = max(max_model_len or 0, config.max_position_embeddings)
    net = build_on_meta(config, torch_dtype, max_positions, parallel)
    quant = None
    if source.kind == "hf":
        quant = quant_config(checkpoint_config(source.path), quantization)
    elif gguf_quant is not None:
        quant = gguf_quant
    elif quantization is not None:
        quant = quant_config({}, quantization)
    if quant is not None and parallel is not None and parallel.world_size > 1:
        raise UnsupportedModelError(
            "a quantized model does not run tensor-parallel yet (its QuantLinear layers are "
            "not sharded); use tensor_parallel_size 1, or the checkpoint's bf16 weights"
        )
    if quant is not None:
        quantize_model(net, quant)  # after the dtype cast: FP8 and scales keep theirs
    if quant is not None and quant.packing is not None:
        from compile_engine.models.quant_formats import unpack_checkpoint

        # GPTQ / AWQ / pack-quantized tensors -> the scheme's codes and group scales
        tensors = unpack_checkpoint(tensors, quant)
    kv_dtype = check_kv_cache_dtype(net, kv_cache_dtype, torch_dtype)
    if storage:
        materialize(net, device)
    loaded = LoadedModel(net, config, hf_config, source, torch_dtype, quant, kv_dtype)
    return loaded, tensors


def checkpoint_config(directory: Path) -> dict:
    """A checkpoint's config.json as a dict, with NVIDIA ModelOpt's hf_quant_config.json (its
    "quantization" section, older exports' only record) as the quantization_config where
    config.json has none."""
    raw = json.loads((directory / "config.json").read_text())
    modelopt = directory / "hf_quant_config.json"
    if "quantization_config" not in raw and modelopt.is_file():
        section = json.loads(modelopt.read_text()).get("quantization")
        if not isinstance(section, dict):
            raise CheckpointError(f"{modelopt}: no 'quantization' section")
        raw["quantization_config"] = {"quant_method": "modelopt", **section}
    return raw


def _counted(
    tensors: Iterable[tuple[str, torch.Tensor]], progress: Callable[[str, int, int | None], None]
) -> Iterator[tuple[str, torch.Tensor]]:
    done = 0
    for done, item in enumerate(tensors, 1):
        yield item
        progress("weights", done, None)
    progress("weights", done, done)  # all read: the count is the total


class WeightRead:
    """A meta model given storage on `device` and filled from `tensors` on a thread of its own,
    started at once. `wait_for_storage()` returns once every parameter and buffer has its
    storage on the device: addresses, shapes and dtypes final (what tracing, compiling and
    sizing memory need), values not yet. `wait()` returns once the weights are read. Both
    raise what the thread raised. The thread spends its time in allocation, file reads and
    copies that release the GIL, so the caller's Python work (imports, the Dynamo trace) runs
    alongside. On CUDA the copies go through a stream of their own, so that the caller's work
    on the default stream does not queue behind them; being blocking copies, they convert
    dtypes on the host and allocate nothing on the device."""

    def __init__(
        self,
        model: nn.Module,
        tensors: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        progress: Callable[[str, int, int | None], None] | None = None,
    ) -> None:
        """progress hears ("weights", tensors read, None) from the thread as it reads, and
        (.., n, n) once all n are read."""
        if progress is not None:
            tensors = _counted(tensors, progress)
        self.seconds = 0.0  # the read's own duration (storage included), set when it ends
        self._error: BaseException | None = None
        self._storage = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(model, tensors, device), name="weight-read", daemon=True
        )
        self._thread.start()

    def _run(
        self, model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device
    ) -> None:
        start = time.perf_counter()
        try:
            # Allocated as the caller would, on the current stream: the caching allocator
            # keeps blocks per stream, and parameters are never freed.
            materialize(model, device)
            self._storage.set()
            if device.type == "cuda":
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))  # after the buffers
                with torch.cuda.stream(stream):
                    load_weights(model, tensors)
                stream.synchronize()  # the copies have landed: done means done
            else:
                load_weights(model, tensors)
        except BaseException as exc:  # re-raised by the waits, in the caller's thread
            self._error = exc
        finally:
            self._storage.set()
            self.seconds = time.perf_counter() - start

    def wait_for_storage(self) -> None:
        self._storage.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def join(self) -> None:
        """Wait for the thread to end without raising what it raised."""
        self._thread.join()
