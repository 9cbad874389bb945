"""The layers import downward only, the modules import no cycle, and a wheel holds every package.

Layers, lowest first: models < kernels_generated < passes < compiler < runtime < benchmarks, and
the root package compile_engine (__init__.py with the public API, cli.py, __main__.py) above
them all. A module may import its own layer and those below it, always as `compile_engine.<layer>`
(a bare `import passes` only worked while the checkout's top level was on sys.path).

What counts, read from the source with ast (nothing is imported):
- for the layers, every import a module can run: import statements anywhere (module level,
  inside functions and methods, under `if TYPE_CHECKING:`), and `importlib.import_module` calls
  whose module name is written in the call (a string, or an f-string's leading text);
- for cycles, the imports that run while a module is being imported: statements outside every
  function, not under `if TYPE_CHECKING:`. An import inside a function runs at its first call,
  when both modules have finished initialising, so it cannot meet a half-initialised module.
  The implicit import of a module's parent packages is not an edge either: Python puts a
  package in sys.modules before its __init__ runs, so a submodule may import a sibling while
  the package's __init__ is importing it.
"""

from __future__ import annotations

import ast
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "compile_engine"
LAYERS = ("models", "kernels_generated", "passes", "compiler", "runtime", "benchmarks")
RANK = {name: rank for rank, name in enumerate(LAYERS)} | {PACKAGE: len(LAYERS)}


@dataclass(frozen=True, slots=True)
class Import:
    module: str  # the absolute name imported, resolved to a module of ours where it names one
    line: int
    at_import_time: bool  # runs while the importing module is being imported


def package_dirs() -> dict[str, Path]:
    """`[tool.setuptools.package-dir]`: each installed package name -> its folder."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}


def modules() -> dict[str, Path]:
    """Every module of the distribution by its installed name, e.g. compile_engine.passes.base,
    a layer's subpackages (kernels_generated/paged_attention/) included. The walk does not
    follow links: compile_engine/'s links to the layer folders are the layers' own packages."""
    found = {}
    for package, folder in package_dirs().items():
        for directory, subdirectories, files in os.walk(folder):
            here = Path(directory)
            if not (here / "__init__.py").is_file():
                subdirectories.clear()  # a data folder (configs/, results/), not a package
                continue
            prefix = [package, *here.relative_to(folder).parts]
            for file in files:
                if file.endswith(".py"):
                    stem = file.removesuffix(".py")
                    found[".".join(prefix if stem == "__init__" else [*prefix, stem])] = here / file
    return found


def layer_of(module: str) -> str:
    """The layer of one of our modules; the root package's own modules are `compile_engine`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else PACKAGE


def _resolve(name: str, known: set[str]) -> str:
    """`name`, or its longest prefix that is one of our modules (an attribute was imported)."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _leading_text(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> list[Import]:
    """The imports of `module` (whose source is `source`) that name our package or a layer."""
    found: list[Import] = []
    base = module if is_package else module.rpartition(".")[0]

    def add(name: str, line: int, at_import_time: bool) -> None:
        top = name.split(".")[0]
        if top == PACKAGE or top in LAYERS:
            found.append(Import(_resolve(name, known), line, at_import_time))

    def visit(node: ast.AST, at_import_time: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            at_import_time = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, at_import_time)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, at_import_time)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - node.level + 1]
                source_module = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                source_module = node.module or ""
            # `from compile_engine.models import ops` imports the module models.ops.
            names = {f"{source_module}.{alias.name}" for alias in node.names}
            for name in sorted({n if n in known else source_module for n in names}):
                add(name, node.lineno, at_import_time)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            text = _leading_text(node.args[0]) if name == "import_module" else None
            if text:
                add(text.rstrip("."), node.lineno, False)
        for child in ast.iter_child_nodes(node):
            visit(child, at_import_time)

    visit(ast.parse(source), True)
    return found


def all_imports() -> dict[str, list[Import]]:
    table = modules()
    known = set(table)
    return {
        name: imports_of(path.read_text(), name, path.stem == "__init__", known)
        for name, path in table.items()
    }


def test_no_import_up_the_layers():
    table = modules()
    problems = []
    for module, imports in all_imports().items():
        where = table[module].relative_to(ROOT)
        for imp in imports:
            if imp.module.split(".")[0] != PACKAGE:
                problems.append(f"{where}:{imp.line}: {imp.module}: write {PACKAGE}.{imp.module}")
                continue
            own, theirs = layer_of(module), layer_of(imp.module)
            if RANK[theirs] > RANK[own]:
                problems.append(f"{where}:{imp.line}: {own} imports {imp.module} ({theirs})")
    assert not problems, "imports up the layers (" + " < ".join(RANK) + "):\n" + "\n".join(problems)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or a module importing itself
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def import_time_graph() -> dict[str, set[str]]:
    return {
        module: {i.module for i in imports if i.at_import_time and i.module.startswith(PACKAGE)}
        for module, imports in all_imports().items()
    }


def test_no_import_cycles():
    found = cycles(import_time_graph())
    assert not found, "modules that import each other while being imported:\n" + "\n".join(
        "{" + ", ".join(component) + "}" for component in found
    )


def test_wheel_lists_every_package():
    """`packages` is written out rather than found, so a new folder with an __init__.py under a
    mapped folder must be listed there, or a wheel (unlike the editable install) lacks it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = set()
    for package, folder in package_dirs().items():
        for init in folder.rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                relative = init.parent.relative_to(folder).parts
                on_disk.add(".".join([package, *relative]))
    assert listed == on_disk, (
        f"pyproject.toml [tool.setuptools] packages: missing {sorted(on_disk - listed)}, "
        f"listed without an __init__.py {sorted(listed - on_disk)}"
    )
    assert set(package_dirs()) <= listed


# --------------------------------------------------------------------------- the checker itself


def test_the_checker_sees_imports_in_functions_and_type_checking_blocks():
    source = """
from typing import TYPE_CHECKING
import torch
from compile_engine.models import ops
from compile_engine import kernels_generated
if TYPE_CHECKING:
    from compile_engine.runtime.engine import LLMEngine
def f():
    import compile_engine.compiler.backend
    importlib.import_module(f"benchmarks.{kind}")
class C:
    from compile_engine.passes.base import GraphPass
"""
    known = {
        "compile_engine.models.ops",
        "compile_engine.kernels_generated",
        "compile_engine.runtime.engine",
        "compile_engine.compiler.backend",
        "compile_engine.passes.base",
    }
    got = [(i.module, i.at_import_time) for i in imports_of(source, "x.y", False, known)]
    assert got == [
        ("compile_engine.models.ops", True),
        ("compile_engine.kernels_generated", True),
        ("compile_engine.runtime.engine", False),
        ("compile_engine.compiler.backend", False),
        ("benchmarks", False),
        ("compile_engine.passes.base", True),
    ]


def test_the_checker_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c"], ["e"]]
