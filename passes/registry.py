"""The ordered pass registry. Order of registration is order of application."""

from __future__ import annotations

from compile_engine.passes.base import GraphPass

REGISTRY: dict[str, GraphPass] = {}


class UnknownPassError(ValueError):
    """A --passes entry names a pass that is not registered."""


def register(cls: type[GraphPass]) -> type[GraphPass]:
    if not cls.name:
        raise TypeError(f"{cls.__name__} must set a name")
    if cls.name in REGISTRY:
        raise ValueError(f"pass {cls.name!r} is registered twice")
    REGISTRY[cls.name] = cls()
    return cls


def select(spec: str | None) -> list[GraphPass]:
    """Resolve `+name,-name` (relative to the defaults) or `name,name` (exactly these)."""
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
    # lower_to_reference always runs last: without it Inductor sees opaque Python kernels.
    ordered = [p for name, p in REGISTRY.items() if name in chosen and name != "lower_to_reference"]
    return ordered + [REGISTRY["lower_to_reference"]]


def load_all() -> None:
    """Import every pass module so that its @register runs (explicit, not at import of passes)."""
    import compile_engine.passes.add_rms_norm_into_gemm  # noqa: F401  (before rms_norm_triton, skinny_gemm)
    import compile_engine.passes.fuse_rotary_attention  # noqa: F401  (before paged_attention, rotary_triton)
    import compile_engine.passes.lower_to_reference  # noqa: F401
    import compile_engine.passes.mla_absorb  # noqa: F401
    import compile_engine.passes.moe_grouped_gemm  # noqa: F401  (before the silu_and_mul passes)
    import compile_engine.passes.paged_attention  # noqa: F401
    import compile_engine.passes.rms_norm_triton  # noqa: F401
    import compile_engine.passes.rotary_triton  # noqa: F401
    import compile_engine.passes.silu_and_mul_helion  # noqa: F401
    import compile_engine.passes.silu_and_mul_triton  # noqa: F401
    import compile_engine.passes.skinny_gemm  # noqa: F401
