"""The build artifact: a directory a server starts from without compiling.

    ARTIFACT/
      manifest.json        what was built, for what, with what (see `Manifest`)
      inductor-cache/      Inductor's FX-graph and AOTAutograd caches plus the compiled C++
                           libraries (CPU) or Triton cubins (GPU) of every piece
      kernels/<key>.py     the generated code of each compiled piece, readable
      tokenizer/           the model's tokenizer, saved (a GGUF's needs no conversion again)
      weights/             only for GGUF sources: the dequantised weights as safetensors

Why a cache directory and not `standalone_compile(...).save()` or the mega-cache: on CPU both
re-run g++ on every kernel at load (the compiled libraries are not in them), measured on
torch 2.13; the cache directory holds the libraries themselves, and loading is a Dynamo trace
plus one cache hit per distinct piece. Keys are content hashes, so the directory works from
any path.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from compile_engine.kernels_generated.tuning import KernelConfig

# 2: the kernel config recorded (kernel_config), Inductor's PDL setting no longer (always off).
FORMAT_VERSION = 2
ENGINE_VERSION = "0.1.0"
CODE_PACKAGES = ("models", "passes", "compiler", "kernels_generated")


class ArtifactError(ValueError):
    """The artifact is missing, stale, or built for something else; the message says how to
    rebuild it."""


def code_hash() -> str:
    """Hash of the engine code that shapes compiled graphs: changing it invalidates artifacts."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def model_fingerprint(source_path: Path) -> str:
    """Identifies the checkpoint without reading its weights: config and file sizes."""
    h = hashlib.sha256()
    path = Path(source_path)
    if path.is_dir():
        for name in ("config.json", "model.safetensors.index.json"):
            if (path / name).is_file():
                h.update((path / name).read_bytes())
        for f in sorted(path.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    else:
        h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()[:16]


def device_description(target: str) -> str:
    if target == "cpu":
        return f"cpu:{platform.machine()}"
    props = torch.cuda.get_device_properties(0)
    return f"cuda:{props.name}:sm_{props.major}{props.minor}"


def versions() -> dict[str, str]:
    """Installed versions, read from package metadata (importing helion or triton to ask would
    cost seconds at every load)."""
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "helion", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


@dataclass(slots=True)
class Manifest:
    model_path: str
    model_kind: str
    model_fingerprint: str
    architecture: str
    dtype: str
    target: str
    device: str
    code_hash: str
    versions: dict[str, str]
    engine_args: dict
    passes: list[dict]
    pass_manager_uuid: str
    compile: dict
    kernels: list[str]
    timings: dict[str, float]
    capture_sizes: list[int] = field(default_factory=list)
    # The ModelConfig the build resolved (models.config.config_to_dict): a load rebuilds it
    # from here without importing transformers' config classes. None in older artifacts.
    model_config: dict | None = None
    # The class AutoTokenizer gives for tokenizer/ (models.tokenizer.tokenizer_class_name),
    # which a load then uses directly. None: no tokenizer, or an older artifact.
    tokenizer_class: str | None = None
    # Set when the source needed conversion (GGUF): an HF directory inside the artifact.
    weights_path: str | None = None
    # The KernelConfig the build compiled with (kernels_generated/tuning.py, `describe()`): a
    # load runs the same kernels with the same settings, whatever its environment.
    kernel_config: dict = field(default_factory=dict)
    # The model's quantization (models/quant.py, `quantized_layers`): method, scheme, scale
    # kinds and the quantized layers; None for a model run in its dtype.
    quantization: dict | None = None
    # The KV cache's element type the graph was traced over (float8_e4m3fn for
    # kv_cache_dtype "fp8"); None in older artifacts, whose caches are of `dtype`.
    kv_cache_dtype: str | None = None
    format: int = FORMAT_VERSION
    engine_version: str = ENGINE_VERSION

    @property
    def cache_key(self) -> str:
        factors = [
            self.model_fingerprint,
            self.dtype,
            self.target,
            self.device,
            self.code_hash,
            self.versions.get("torch"),
            self.versions.get("triton"),
            self.pass_manager_uuid,
            self.kernel_config.get("key"),
        ]
        if self.quantization is not None:  # unquantized artifacts keep their keys
            factors.append(self.quantization.get("scheme"))
        if self.kv_cache_dtype not in (None, self.dtype):  # so do those of model-dtype caches
            factors.append(f"kv_cache:{self.kv_cache_dtype}")
        return hashlib.sha256(json.dumps(factors).encode()).hexdigest()[:16]

    def write(self, directory: Path) -> Path:
        path = Path(directory) / "manifest.json"
        data = asdict(self)
        data["cache_key"] = self.cache_key
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = Path(directory) / "manifest.json"
        if not path.is_file():
            raise ArtifactError(f"{directory} is not an artifact (no manifest.json)")
        data = json.loads(path.read_text())
        data.pop("cache_key", None)
        if data.get("format") != FORMAT_VERSION:
            raise ArtifactError(
                f"{directory} has artifact format {data.get('format')}, this engine reads "
                f"{FORMAT_VERSION}; rebuild it with `compile-engine build`"
            )
        return cls(**data)

    def kernel(self) -> KernelConfig:
        """The kernel config the artifact was built with, rebuilt from its settings."""
        return KernelConfig.from_dict(self.kernel_config.get("settings", {}))

    def rebuild_hint(self, directory: Path) -> str:
        ranks = self.engine_args.get("tensor_parallel_size", 1)
        parallel = f" --tensor-parallel-size {ranks}" if ranks > 1 else ""
        if self.engine_args.get("enable_expert_parallel"):
            parallel += " --enable-expert-parallel"
        if self.engine_args.get("kv_cache_dtype", "auto") != "auto":
            parallel += f" --kv-cache-dtype {self.engine_args['kv_cache_dtype']}"
        return (
            f"rebuild with: compile-engine build {self.model_path} --target {self.target} "
            f"--dtype {self.dtype}{parallel} --out {directory}"
        )

    def check(self, directory: Path) -> None:
        """Refuse an artifact that this machine and this code would not reproduce."""
        problems = []
        here = versions()
        if self.versions.get("torch") != here["torch"]:
            problems.append(f"torch {self.versions.get('torch')} (this machine: {here['torch']})")
        if self.versions.get("triton") != here["triton"]:
            problems.append(
                f"triton {self.versions.get('triton')} (this machine: {here['triton']})"
            )
        if self.code_hash != code_hash():
            problems.append("engine code that has changed since (models/passes/compiler)")
        if self.kernel().key != self.kernel_config.get("key"):
            problems.append("kernel tuning tables as they were then (a table file changed)")
        if self.target == "h100" and not torch.cuda.is_available():
            problems.append("target h100, but this machine has no CUDA device")
        elif device_description(self.target) != self.device:
            problems.append(
                f"device {self.device} (this machine: {device_description(self.target)})"
            )
        source = Path(self.model_path)
        if not source.exists():
            problems.append(f"model {self.model_path}, which no longer exists")
        elif model_fingerprint(source) != self.model_fingerprint:
            problems.append(f"model {self.model_path} as it was then (its files changed)")
        if problems:
            raise ArtifactError(
                f"artifact {directory} was built for "
                + "; ".join(problems)
                + ". "
                + self.rebuild_hint(directory)
            )


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / "manifest.json").is_file()
