"""docs/architecture.md cannot drift from the code: its lists of architectures and passes are
generated from the registries, and every module its layer table names exists.

A generated section sits between `<!-- generated: NAME ... -->` and `<!-- end: NAME -->`; the
architectures come from models/registry.py, the passes from passes/pipeline.py and the
registered passes. After changing either, rewrite the sections with

    python tests/test_architecture_doc.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from test_layers import LAYERS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SECTION = re.compile(r"(<!-- generated: (\w+)[^>]*-->\n)(.*?)(<!-- end: \2 -->)", re.S)


def _source_file(obj: object) -> str:
    """`compile_engine.passes.skinny_gemm` -> `passes/skinny_gemm.py` (the layer folders are
    mapped to subpackages of compile_engine by package-dir)."""
    return obj.__module__.removeprefix("compile_engine.").replace(".", "/") + ".py"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def architectures() -> str:
    from compile_engine.models.registry import ARCHITECTURES

    rows = ["| config.json `architectures` | class | file |", "|---|---|---|"]
    for name, cls in ARCHITECTURES.items():
        rows.append(f"| `{name}` | `{cls.__name__}` | `{_source_file(cls)}` |")
    return "\n".join(rows) + "\n"


def pipeline() -> str:
    from compile_engine.passes.pipeline import PIPELINE
    from compile_engine.passes.registry import REGISTRY, load_all

    load_all()
    rows = [
        "| # | pass | file | targets | default | rewrites | why here |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, (name, why) in enumerate(PIPELINE, 1):
        p = REGISTRY[name]
        rows.append(
            f"| {number} | `{name}` | `{_source_file(type(p))}` | {', '.join(p.targets)} | "
            f"{'on' if p.default_on else 'off'} | {_cell(p.description)} | {_cell(why)} |"
        )
    return "\n".join(rows) + "\n"


RENDER = {"architectures": architectures, "pipeline": pipeline}


def rendered(text: str) -> str:
    return SECTION.sub(lambda m: m[1] + RENDER[m[2]]() + m[4], text)


def test_generated_sections_match_the_registries():
    text = DOC.read_text()
    assert {m[2] for m in SECTION.finditer(text)} == set(RENDER), "a generated section is missing"
    assert rendered(text) == text, (
        "docs/architecture.md is stale against the registries; run "
        "`python tests/test_architecture_doc.py` to rewrite its generated sections"
    )


def test_every_module_the_layer_table_names_exists():
    """The Layers table has a row per layer and the root package, and a `name.py` in a row is a
    module of that row's folder."""
    text = DOC.read_text()
    table = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w/]+)/` \| (.*) \|$", table, re.M)
    assert {folder for folder, _ in rows} == {*LAYERS, "compile_engine"}
    missing = []
    for folder, cells in rows:
        for name in re.findall(r"`([\w/]+\.py)`", cells):
            if not (ROOT / folder / name).is_file():
                missing.append(f"{folder}/{name}")
    assert not missing, f"docs/architecture.md's Layers table names missing modules: {missing}"


if __name__ == "__main__":
    DOC.write_text(rendered(DOC.read_text()))
    sys.exit(0)
