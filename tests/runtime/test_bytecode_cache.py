"""runtime.bytecode_cache against what the interpreter actually does: each case runs a fresh
Python (sys.pycache_prefix is process-wide) on a throwaway package and checks where its
bytecode went and whether a second start finds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import json, os, sys
from pathlib import Path
from compile_engine.runtime import bytecode_cache
needed = bytecode_cache.needed("ce_probe_pkg")
prefix = bytecode_cache.enable(Path(sys.argv[1]), probe="ce_probe_pkg")
import importlib.util
spec = importlib.util.find_spec("ce_probe_pkg")
cached = importlib.util.cache_from_source(spec.origin)
existed = os.path.exists(cached)
import ce_probe_pkg
print(json.dumps({"needed": needed, "prefix": str(prefix) if prefix else None,
                  "cached": cached, "existed_before_import": existed,
                  "exists_after_import": os.path.exists(cached)}))
"""


def _package(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "ce_probe_pkg").mkdir(parents=True)
    (site / "ce_probe_pkg" / "__init__.py").write_text("VALUE = 42\n")
    return site


def _child(site: Path, root: Path, **env: str) -> dict:
    environ = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    environ.pop("PYTHONPYCACHEPREFIX", None)
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root)],
        capture_output=True, text=True, env=environ, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_install_that_writes_no_bytecode_gets_the_engines_cache(tmp_path):
    site, root = _package(tmp_path), tmp_path / "cache"
    first = _child(site, root, PYTHONDONTWRITEBYTECODE="1")
    assert first["needed"] and first["prefix"] == str(root / "pycache")
    assert first["cached"].startswith(str(root / "pycache"))
    assert not first["existed_before_import"] and first["exists_after_import"]
    assert not (site / "ce_probe_pkg" / "__pycache__").exists()  # the install stays clean
    second = _child(site, root, PYTHONDONTWRITEBYTECODE="1")
    assert second["existed_before_import"]  # the next start reads what the first wrote


def test_an_install_with_its_bytecode_is_left_alone(tmp_path):
    site, root = _package(tmp_path), tmp_path / "cache"
    first = _child(site, root)  # writes __pycache__ beside the source, as Python does
    assert first["prefix"] is None and first["exists_after_import"]
    second = _child(site, root)
    assert not second["needed"] and second["prefix"] is None
    assert second["cached"].startswith(str(site))
    assert not (root / "pycache").exists()


def test_a_prefix_of_the_users_own_is_left_alone(tmp_path):
    site, root, own = _package(tmp_path), tmp_path / "cache", tmp_path / "own"
    out = _child(site, root, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(own))
    assert out["needed"] and out["prefix"] is None
    assert out["cached"].startswith(str(own)) and not (root / "pycache").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_install_gets_the_engines_cache(tmp_path):
    site, root = _package(tmp_path), tmp_path / "cache"
    pkg = site / "ce_probe_pkg"
    pkg.chmod(0o555)
    try:
        out = _child(site, root)
    finally:
        pkg.chmod(0o755)
    assert out["needed"] and out["prefix"] == str(root / "pycache") and out["exists_after_import"]
