"""Kernel tuning as data: every launch choice of our kernels that is not a tensor shape.

One frozen `KernelConfig` is built when an engine or a build starts (from `LLM(kernel_config=
...)`, `--kernel-config '{json}'`, or an artifact's manifest), handed to the passes in their
`PassContext`, and reaches every launch explicitly: a pass that lowers an op to one of our
kernels gives the kernel op the config's `key` as its last argument, and the op resolves the
key to the config (`resolve`). The build records the whole config in the artifact's manifest
and its key in the cache key, so an artifact behaves the same whatever shell loads it, and
`compile-engine inspect` shows it. Nothing here reads the environment.

What it holds:
- PDL (programmatic dependent launch, sm_90+): in launches of at most `pdl_max_rows` tokens
  our kernels launch as PDL dependents: a kernel may start before the one ahead of it ends; each
  program waits (griddepcontrol.wait) for that kernel before it touches memory, and releases the
  kernel after it once its main loop is done (griddepcontrol.launch_dependents before the
  epilogue), so the next kernel's programs take each SM as this one's leave it. Each skinny GEMM
  program puts the first `pdl_prefetch_tiles` K-tiles of its weight slice into L2 before it
  waits. Measured on the H200 (`bench latency`, batch 1, variants alternating in one call):
  ours on against off 232.0 / 232.2 against 228.8 / 229.3 tok/s (57cd701); releasing late
  against when the kernel ends 240.6 / 240.5 against 238.9 / 238.6 (db83b9a); one prefetched
  K-tile against none 241.9 / 242.0 against 240.1 (9a6247e). Launches of more tokens stay
  plain: at batch 64 and 256 PDL was within the spread (9f6b2fa). The variants that lost
  (releasing at once, whole-weight prefetch, attention released apart) are in docs/compiler.md.
- The tuned tables of the table-driven kernels (configs/<kernel>.json, nearest shape key;
  kernels_generated/configs.py): `tables` names another file for a kernel (an experiment's
  table, say). A config reads every table once, when it is built, and its key covers those
  bytes: a retuned table is a new config with a new key.
- Paged attention's launch configs and split policy (`AttentionTuning`), measured on the H200.
- MLA latent attention's tiles and split policy (`MlaTuning`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from compile_engine.kernels_generated.configs import CONFIG_DIR, ConfigTable

# The kernels whose launch configs come from a tuned table, configs/<name>.json by default.
TABLES = (
    "add_rms_norm",
    "fp8_gemm",
    "int_gemm",
    "moe_grouped_gemm",
    "rotary",
    "silu_and_mul",
    "silu_and_mul_helion",
    "skinny_gemm",
)


class KernelConfigError(ValueError):
    """A kernel tuning setting is invalid or unknown; the message says what is allowed."""


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """The single-token paged-attention kernel's config for launches of at least `least` tokens
    (the last tier that fits applies). min_split_keys: the fewest keys a KV split takes.
    unsplit_keys: a block table at most this many keys wide runs in one split (0: no bound).
    maxnreg: a register cap (more programs resident an SM), None for none."""

    least: int
    block_n: int
    num_warps: int
    num_stages: int
    min_split_keys: int
    unsplit_keys: int = 0
    maxnreg: int | None = None


@dataclass(frozen=True, slots=True)
class TiledConfig:
    """The query-tiled prefill kernel's config: `rows` dot rows a program (BLOCK_M query tokens
    x the query-head group rounded up to a power of two)."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int


# CUDA decode tiers, from a sweep on the H200 at 9488c66 (bf16, Llama-3-8B heads, block 16,
# CUDA-graph replay; batch x context): BLOCK_N 32 / 2 warps / 2 stages from 17 tokens, 41 / 174 us
# at 256 x 32-160 / 513-768, 13.0 / 263 / 2,025 us at 64 x 40-160 / 4k / 32k (64 / 2 / 2: 50.8 /
# 178 at batch 256, 15.9 / 249 / 1,904 at batch 64). Below, where T x Hkv programs leave SMs idle
# and split-KV runs, 64 / 4 / 2: 8.5 / 50.4 us at 1 x 100 / 32k, 29.9 at 8 x 1.5k-2.5k, 13.5 at 16
# x 200-400. MIN_SPLIT_KEYS 64 against 256 took 16 x 200-400 from 19.6 to 15.1 us. From 100
# tokens the register cap of 128 gives 8 programs an SM instead of 6 (0c6c8eb: 37.9 / 170 / 985
# us against 38.4 / 174 / 1,012 at 256 x 100 / 640 / 4k; at 64 tokens it lost). One split on a
# table of <= 160 keys at one token (908d9f3, batch 1, contexts 33-160): 247.5 / 247.3 tok/s
# against 245.9 / 245.9 with the wide table's splits. The first tier covers 1-16 tokens with
# one split policy (`choose_num_splits`: the one-token split count), so that a speculative
# verification step's rows (1 + k a sequence) attend exactly as the one-token decode of the
# same token does, bit for bit (issue 33); 2-16 tokens had their own tier before, the same
# tiles with fewer splits and no unsplit bound.
_CUDA_DECODE = (
    DecodeConfig(1, 64, 4, 2, min_split_keys=64, unsplit_keys=160),
    DecodeConfig(17, 32, 2, 2, min_split_keys=64),
    DecodeConfig(100, 32, 2, 2, min_split_keys=64, maxnreg=128),
)
_CPU_DECODE = (DecodeConfig(1, 16, 1, 1, min_split_keys=16),)


@dataclass(frozen=True, slots=True)
class AttentionTuning:
    """Paged attention's launch choices, per device type ("cuda", "cpu": the interpreter).
    combine_splits: the split partials the combining program loads a step. tiled_min_tokens_per_
    seq: the tiled prefill variant runs for batches with at least this many tokens per sequence
    slot (shapes only, so capture and replay agree). Tiled CUDA config: the best of ROWS {64,
    128} x BLOCK_N {32, 64, 128} x warps {4, 8} x stages {2, 3} on the H200 for three 600-token
    chunks beside 237 decodes (321 us) and within 2% of the best on four 512-token chunks.
    prefill_graph_min_tokens: the least capture size given a prefill graph (one whose
    sequence slots make its shapes choose tiled, compiler/cuda_graphs.py `prefill_rows`). On
    the H200 (Llama-3-8B shape, `bench prefix --sweep`, d8ce46a) a chunk after a cached
    3,680-token prefix ran 2-16 tokens in 10.6-10.9 ms tiled against 6.0-6.8 single-token
    (whose splits spread the long context), 32 tokens 10.9 against 11.3 and 128 tokens 11.2
    against 17.1; with no prefix tiled is within 5% below 32 tokens. tiled_min_split_keys:
    the least cached keys a split of the tiled kernel takes (`tiled_num_splits`; chosen, not
    yet swept). write_first_max_tokens: CUDA launches of 2 to this many tokens of the
    single-token kernel write the step's K/V before they attend (a write-only launch first),
    so that a token may read another of the step from the cache; the CUDA-graph runner then
    runs such steps as one-token rows, each attending exactly as a decode does (issue 33:
    greedy speculation lossless in bf16). 0: never."""

    decode_cuda: tuple[DecodeConfig, ...] = _CUDA_DECODE
    decode_cpu: tuple[DecodeConfig, ...] = _CPU_DECODE
    tiled_cuda: TiledConfig = TiledConfig(rows=64, block_n=32, num_warps=4, num_stages=2)
    tiled_cpu: TiledConfig = TiledConfig(rows=16, block_n=16, num_warps=1, num_stages=1)
    tiled_min_tokens_per_seq: int = 2
    prefill_graph_min_tokens: int = 32
    tiled_min_split_keys: int = 256
    max_splits: int = 64
    combine_splits: int = 8
    write_first_max_tokens: int = 16

    def decode(self, num_tokens: int, device_type: str) -> DecodeConfig:
        """The single-token kernel's config for a launch of num_tokens tokens (shapes only)."""
        tiers = self.decode_cpu if device_type == "cpu" else self.decode_cuda
        return [tier for tier in tiers if tier.least <= max(num_tokens, 1)][-1]

    def tiled(self, device_type: str) -> TiledConfig:
        return self.tiled_cpu if device_type == "cpu" else self.tiled_cuda

    def validate(self) -> None:
        for name in ("decode_cuda", "decode_cpu", "tiled_cuda", "tiled_cpu"):
            value = getattr(self, name)
            for item in value if isinstance(value, tuple) else (value,):
                if not isinstance(item, DecodeConfig if name.startswith("decode") else TiledConfig):
                    raise KernelConfigError(f"attention.{name}: {item!r} is not a launch config")
                for field_ in dataclasses.fields(item):
                    if field_.name != "maxnreg" or item.maxnreg is not None:
                        _whole(f"attention.{name}.{field_.name}", getattr(item, field_.name))
        for name in ("tiled_min_tokens_per_seq", "prefill_graph_min_tokens",
                     "tiled_min_split_keys", "max_splits", "combine_splits"):  # fmt: skip
            _whole(f"attention.{name}", getattr(self, name))
        _whole("attention.write_first_max_tokens", self.write_first_max_tokens)
        if self.write_first_max_tokens < 0:
            raise KernelConfigError("attention.write_first_max_tokens must be >= 0 (0: never)")
        for name in ("decode_cuda", "decode_cpu"):
            tiers = getattr(self, name)
            if not tiers or tiers[0].least != 1:
                raise KernelConfigError(f"attention.{name} needs a first tier with least 1")
            if any(a.least >= b.least for a, b in zip(tiers, tiers[1:], strict=False)):
                raise KernelConfigError(f"attention.{name}: tiers must grow in `least`")
            for tier in tiers:
                _powers_of_two(f"attention.{name}", block_n=tier.block_n)
                if tier.min_split_keys < 1:
                    raise KernelConfigError(f"attention.{name}: min_split_keys must be >= 1")
        for name in ("tiled_cuda", "tiled_cpu"):
            tiled = getattr(self, name)
            _powers_of_two(f"attention.{name}", rows=tiled.rows, block_n=tiled.block_n)
            if tiled.rows < 16:
                raise KernelConfigError(f"attention.{name}: rows must be >= 16 (tl.dot's least)")
        for name in ("tiled_min_tokens_per_seq", "prefill_graph_min_tokens",
                     "tiled_min_split_keys", "max_splits", "combine_splits"):  # fmt: skip
            if getattr(self, name) < 1:
                raise KernelConfigError(f"attention.{name} must be >= 1")


@dataclass(frozen=True, slots=True)
class LatentConfig:
    """The MLA latent kernel's launch config: BLOCK_N cached rows a step, BLOCK_H query heads
    a program (bounded by the heads rounded up to a power of two and by tl.dot's 16 rows), and
    the split reduce kernel's warps."""

    block_n: int
    block_h: int
    num_warps: int
    num_stages: int
    reduce_warps: int


@dataclass(frozen=True, slots=True)
class MlaTuning:
    """MLA latent attention's launch choices, per device type ("cuda", "cpu": the
    interpreter). Split-KV runs where a launch's programs would leave SMs idle, by paged
    attention's policy with MLA's numbers: min_split_keys (below it a split's fixed cost
    outweighs the parallelism it adds) and max_splits. reduce_block_r: the latent columns a
    program of the split reduce kernel combines. CUDA tiles: the best of BLOCK_N {16, 32, 64}
    x warps {4, 8} x stages {2, 3} at every one of DeepSeek-V2-Lite's decode shapes (batch
    1/64, context 512/4k) on the H200 (`compile-engine bench mla --sweep`; docs/mla.md)."""

    latent_cuda: LatentConfig = LatentConfig(64, 16, num_warps=8, num_stages=2, reduce_warps=4)
    latent_cpu: LatentConfig = LatentConfig(16, 16, num_warps=1, num_stages=1, reduce_warps=1)
    min_split_keys: int = 256
    max_splits: int = 64
    reduce_block_r: int = 128

    def latent(self, device_type: str) -> LatentConfig:
        return self.latent_cpu if device_type == "cpu" else self.latent_cuda

    def validate(self) -> None:
        for name in ("latent_cuda", "latent_cpu"):
            config = getattr(self, name)
            if not isinstance(config, LatentConfig):
                raise KernelConfigError(f"mla.{name}: {config!r} is not a launch config")
            for field_ in dataclasses.fields(config):
                value = getattr(config, field_.name)
                _whole(f"mla.{name}.{field_.name}", value)
                if value < 1:
                    raise KernelConfigError(f"mla.{name}.{field_.name} must be >= 1")
            _powers_of_two(f"mla.{name}", block_n=config.block_n, block_h=config.block_h)
            if config.block_n < 16:
                raise KernelConfigError(f"mla.{name}: block_n must be >= 16 (tl.dot's least)")
        for name in ("min_split_keys", "max_splits", "reduce_block_r"):
            _whole(f"mla.{name}", getattr(self, name))
            if getattr(self, name) < 1:
                raise KernelConfigError(f"mla.{name} must be >= 1")
        _powers_of_two("mla", reduce_block_r=self.reduce_block_r)


def _whole(where: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise KernelConfigError(f"{where}={value!r}: want a whole number")


def _powers_of_two(where: str, **values: int) -> None:
    for name, value in values.items():
        if value < 1 or value & (value - 1):
            raise KernelConfigError(f"{where}: {name}={value} must be a power of two")


_REGISTRY: dict[str, KernelConfig] = {}


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Our kernels' launch choices (module docstring). Built once per engine or build; `key`
    (a content hash, which the kernel ops receive) is computed at construction, and the config
    is then resolvable from it in this process."""

    pdl: bool = True
    pdl_max_rows: int = 16
    pdl_prefetch_tiles: int = 1
    # kernel -> JSON table file used instead of configs/<kernel>.json
    tables: dict[str, str] = field(default_factory=dict)
    attention: AttentionTuning = field(default_factory=AttentionTuning)
    mla: MlaTuning = field(default_factory=MlaTuning)
    key: str = field(init=False, compare=False, default="")
    # Every table, parsed from the bytes the key hashes: what the kernels launch with.
    _loaded: dict[str, ConfigTable] = field(init=False, compare=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.pdl, bool):
            raise KernelConfigError(f"pdl={self.pdl!r}: want true or false")
        for name in ("pdl_max_rows", "pdl_prefetch_tiles"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise KernelConfigError(f"{name}={value!r}: want a whole number >= 0")
        if not isinstance(self.tables, dict):
            raise KernelConfigError(
                f"tables={self.tables!r}: want an object of kernel -> table file, kernels "
                f"{list(TABLES)}"
            )
        unknown = sorted(set(self.tables) - set(TABLES))
        if unknown:
            raise KernelConfigError(
                f"tables names unknown kernels {unknown}; tuned tables exist for {list(TABLES)}"
            )
        object.__setattr__(self, "tables", {k: str(v) for k, v in self.tables.items()})
        for kernel, path in self.tables.items():
            if not Path(path).is_file():
                raise KernelConfigError(f"tables.{kernel}: {path} is not a file")
        if not isinstance(self.attention, AttentionTuning):
            raise KernelConfigError(f"attention={self.attention!r}: want an AttentionTuning")
        self.attention.validate()
        if not isinstance(self.mla, MlaTuning):
            raise KernelConfigError(f"mla={self.mla!r}: want an MlaTuning")
        self.mla.validate()
        digest = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode())
        loaded = {}
        for kernel in TABLES:
            path = self.table_path(kernel)
            text = path.read_text()
            digest.update(text.encode())
            loaded[kernel] = ConfigTable.parse(text, path)
        object.__setattr__(self, "_loaded", loaded)
        object.__setattr__(self, "key", digest.hexdigest()[:16])
        _REGISTRY.setdefault(self.key, self)

    def table_path(self, kernel: str) -> Path:
        return Path(self.tables.get(kernel) or CONFIG_DIR / f"{kernel}.json")

    def table(self, kernel: str) -> ConfigTable:
        """The tuned table of `kernel`, as the config read it when it was built (a file
        rewritten since is a new config's, with a new key)."""
        return self._loaded[kernel]

    def to_dict(self) -> dict:
        """Every setting, JSON-safe; `from_dict` inverts it."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        data["attention"] = dataclasses.asdict(self.attention)
        data["mla"] = dataclasses.asdict(self.mla)
        data["tables"] = dict(self.tables)
        return data

    def describe(self) -> dict:
        """What the manifest records and `inspect` shows: the settings, the key, and each
        table's file and content hash."""
        tables = {}
        for kernel in TABLES:
            path = self.table_path(kernel)
            shipped = kernel not in self.tables  # configs/<kernel>.json, shown without its root
            tables[kernel] = {
                "file": f"configs/{path.name}" if shipped else str(path),
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest()[:16],
            }
        return {"key": self.key, "settings": self.to_dict(), "tables": tables}

    @classmethod
    def from_dict(cls, data: dict) -> KernelConfig:
        """A config from `to_dict`'s form or a partial one (the rest default); unknown fields
        are an error that lists the known ones."""
        if not isinstance(data, dict):
            raise KernelConfigError(f"a kernel config is a JSON object, got {data!r}")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - names)
        if unknown:
            raise KernelConfigError(
                f"unknown kernel config fields {unknown}; known: {sorted(names)}"
            )
        data = dict(data)
        if "attention" in data:
            data["attention"] = _attention_from_dict(data["attention"])
        if "mla" in data:
            data["mla"] = _mla_from_dict(data["mla"])
        try:
            return cls(**data)
        except TypeError as exc:
            raise KernelConfigError(f"kernel config {data!r}: {exc}") from None

    @classmethod
    def coerce(cls, value: KernelConfig | dict | str | None) -> KernelConfig:
        """A KernelConfig from what an `LLM(...)` argument or a `--kernel-config` flag gives:
        a config, a dict, a JSON string, or None for the defaults."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise KernelConfigError(f"kernel config {value!r} is not JSON: {exc}") from None
        return cls.from_dict(value)


def _attention_from_dict(data: dict | AttentionTuning) -> AttentionTuning:
    if isinstance(data, AttentionTuning):
        return data
    if not isinstance(data, dict):
        raise KernelConfigError(f"attention must be an object, got {data!r}")
    names = {f.name for f in dataclasses.fields(AttentionTuning)}
    if unknown := sorted(set(data) - names):
        raise KernelConfigError(f"unknown attention fields {unknown}; known: {sorted(names)}")
    fields: dict = {}
    try:
        for name, value in data.items():
            if name.startswith("decode_"):
                fields[name] = tuple(DecodeConfig(**tier) for tier in value)
            elif name.startswith("tiled_") and isinstance(value, dict):
                fields[name] = TiledConfig(**value)
            else:
                fields[name] = value
    except TypeError as exc:
        raise KernelConfigError(f"attention {data!r}: {exc}") from None
    return AttentionTuning(**fields)


def _mla_from_dict(data: dict | MlaTuning) -> MlaTuning:
    if isinstance(data, MlaTuning):
        return data
    if not isinstance(data, dict):
        raise KernelConfigError(f"mla must be an object, got {data!r}")
    names = {f.name for f in dataclasses.fields(MlaTuning)}
    if unknown := sorted(set(data) - names):
        raise KernelConfigError(f"unknown mla fields {unknown}; known: {sorted(names)}")
    fields = dict(data)
    try:
        for name, value in data.items():
            if name.startswith("latent_") and isinstance(value, dict):
                fields[name] = LatentConfig(**value)
    except TypeError as exc:
        raise KernelConfigError(f"mla {data!r}: {exc}") from None
    return MlaTuning(**fields)


def resolve(key: str) -> KernelConfig:
    """The config whose `key` a kernel op received. Every config constructed in this process
    resolves (construction registers it)."""
    config = _REGISTRY.get(key)
    if config is None:
        raise KernelConfigError(
            f"kernel config {key!r} is unknown in this process: kernel ops are called with the "
            "key of a KernelConfig built here (the engine's, or one a test constructs)"
        )
    return config


@functools.cache
def default() -> KernelConfig:
    """The defaults, for callers outside an engine (tests, benchmarks of one kernel)."""
    return KernelConfig()
