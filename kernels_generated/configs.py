"""Tuned kernel configs as data: one JSON file per kernel, keyed by target and shape class.

A file looks like

    {
      "kernel": "silu_and_mul_helion",
      "key": ["I", "T"],
      "default": {...},                      # safe everywhere, tuned nowhere
      "targets": {
        "h100": {"tuned": true, "entries": [{"key": {"I": 14336, "T": 256}, "config": {...},
                                              ...provenance: device, versions, ms...}]},
        "cpu": {"tuned": false, "entries": []}
      }
    }

At run time a kernel asks for the entry nearest its shape. Nearness is measured on a log2
scale per key dimension, because kernel behaviour changes with orders of magnitude (a decode
step of 1 token against a prefill of 2048), not with absolute differences. Where a target has
no entry the default is used and one log line says so, once per kernel and target in a
process: the table is loaded once per process, so the "once" lives on the table object.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# The config target a kernel running on a device type reads (targets are the engine's).
TARGET_OF_DEVICE = {"cuda": "h100", "cpu": "cpu"}


def tuning_provenance(dtype: str = "bfloat16") -> dict:
    """What a tuned entry records of where it was tuned: this CUDA device, the dtype timed,
    when, and the torch / triton versions."""
    import datetime

    import torch
    import triton

    return {
        "device": torch.cuda.get_device_name(),
        "dtype": dtype,
        "tuned_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
    }


class ConfigFileError(ValueError):
    """A kernel config file is missing or malformed; the message names the file."""


def bucket_tokens(num_tokens: int) -> int:
    """The shape class of a token count: the next power of two (1, 2, 4, ... 2048, ...)."""
    return 1 if num_tokens <= 1 else 1 << (num_tokens - 1).bit_length()


def key_distance(a: dict[str, int], b: dict[str, int]) -> float:
    """Sum over the key dimensions of |log2 a - log2 b| (sizes below 1 count as 1)."""
    return sum(abs(math.log2(max(a[k], 1)) - math.log2(max(b[k], 1))) for k in a)


@dataclass(slots=True)
class ConfigEntry:
    key: dict[str, int]
    config: dict
    info: dict = field(default_factory=dict)  # provenance: device, versions, measured time

    def as_dict(self) -> dict:
        return {"key": self.key, "config": self.config, **self.info}


@dataclass(slots=True)
class TargetConfigs:
    tuned: bool
    entries: list[ConfigEntry]
    note: str = ""

    def as_dict(self) -> dict:
        out: dict = {"tuned": self.tuned}
        if self.note:
            out["note"] = self.note
        out["entries"] = [e.as_dict() for e in self.entries]
        return out


@dataclass(slots=True)
class ConfigTable:
    kernel: str
    key_names: tuple[str, ...]
    default: dict
    targets: dict[str, TargetConfigs]
    path: Path | None = None
    _warned: set[str] = field(default_factory=set)

    @classmethod
    def load(cls, path: str | Path) -> ConfigTable:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigFileError(f"kernel config file {path} does not exist") from None
        return cls.parse(text, path)

    @classmethod
    def parse(cls, text: str, path: Path | None = None) -> ConfigTable:
        """A table from its file's text (`path` names it in errors and `save`)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigFileError(f"kernel config file {path} is not valid JSON: {err}") from None
        try:
            key_names = tuple(data["key"])
            targets = {}
            for target, section in data.get("targets", {}).items():
                entries = []
                for raw in section.get("entries", []):
                    raw = dict(raw)
                    key, config = raw.pop("key"), raw.pop("config")
                    if set(key) != set(key_names):
                        raise KeyError(f"entry key {sorted(key)} != {sorted(key_names)}")
                    entries.append(ConfigEntry({k: int(key[k]) for k in key_names}, config, raw))
                targets[target] = TargetConfigs(
                    bool(section.get("tuned", False)), entries, section.get("note", "")
                )
            return cls(data["kernel"], key_names, data["default"], targets, path)
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigFileError(f"kernel config file {path} is malformed: {err!r}") from None

    def as_dict(self) -> dict:
        return {
            "kernel": self.kernel,
            "key": list(self.key_names),
            "default": self.default,
            "targets": {t: s.as_dict() for t, s in self.targets.items()},
        }

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path or self.path)
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
        return path

    def nearest(self, target: str, key: dict[str, int]) -> ConfigEntry | None:
        """The entry of `target` nearest `key`; the first listed wins a tie."""
        section = self.targets.get(target)
        if section is None or not section.entries:
            return None
        return min(section.entries, key=lambda e: key_distance(key, e.key))

    def lookup(self, target: str, key: dict[str, int]) -> dict:
        """The config to run `key` with on `target`: the nearest tuned entry, else the default
        (saying so once)."""
        entry = self.nearest(target, key)
        if entry is not None:
            return entry.config
        if target not in self._warned:
            self._warned.add(target)
            log.warning(
                "%s: no tuned config for target %s (%s); using the untuned default %s",
                self.kernel,
                target,
                self.path or "in-memory table",
                self.default,
            )
        return self.default
