"""The pass registry: `@register` records a pass, passes/pipeline.py orders them."""

from __future__ import annotations

import importlib
import pkgutil

from compile_engine.passes.base import GraphPass
from compile_engine.passes.pipeline import ORDER

# Pass name -> instance, in pipeline order once load_all() has run.
REGISTRY: dict[str, GraphPass] = {}

# Runs whether selected or not: without it Inductor sees our ops as opaque Python kernels.
ALWAYS = "lower_to_reference"


class UnknownPassError(ValueError):
    """A --passes entry names a pass that is not registered."""


class PipelineError(RuntimeError):
    """passes/pipeline.py and the registered passes disagree."""


def register(cls: type[GraphPass]) -> type[GraphPass]:
    if not cls.name:
        raise TypeError(f"{cls.__name__} must set a name")
    if cls.name in REGISTRY:
        raise ValueError(f"pass {cls.name!r} is registered twice")
    REGISTRY[cls.name] = cls()
    return cls


def select(spec: str | None) -> list[GraphPass]:
    """Resolve `+name,-name` (relative to the defaults) or `name,name` (exactly these), in
    pipeline order."""
    load_all()
    chosen = {name for name, p in REGISTRY.items() if p.default_on}
    if spec:
        items = [s.strip() for s in spec.split(",") if s.strip()]
        if items and all(not s.startswith(("+", "-")) for s in items):
            chosen = set()
            items = ["+" + s for s in items]
        for item in items:
            sign, name = item[0], item[1:]
            if name not in REGISTRY:
                raise UnknownPassError(f"unknown pass {name!r}; registered: {', '.join(REGISTRY)}")
            (chosen.add if sign == "+" else chosen.discard)(name)
    return [p for name, p in REGISTRY.items() if name in chosen or name == ALWAYS]


def load_all() -> None:
    """Import every module of the passes package, so that each pass's @register runs (here,
    not when the package is imported), then put the registry in pipeline order. Importing by
    discovery keeps file names out of the order: a renamed file registers the same pass."""
    package = importlib.import_module(__package__)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{module.name}")
    registered, listed = set(REGISTRY), set(ORDER)
    if registered != listed or len(ORDER) != len(listed):
        raise PipelineError(
            "passes/pipeline.py must name every registered pass exactly once: "
            f"registered but not listed {sorted(registered - listed)}, "
            f"listed but not registered {sorted(listed - registered)}, "
            f"listed twice {sorted({n for n in ORDER if ORDER.count(n) > 1})}"
        )
    ordered = {name: REGISTRY[name] for name in ORDER}
    REGISTRY.clear()
    REGISTRY.update(ordered)
