"""models/vocabulary.py gathers the ops of ops.py, moe.py, mla.py and quant.py, and importing a
model registers every op it calls without importing the vocabulary (the defining modules import
one way: moe and mla import ops, never the reverse)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from compile_engine.models import mla, moe, ops, parallel, quant, vocabulary


def test_the_vocabulary_is_every_module_table():
    tables = (ops.OPS, moe.MOE_OPS, mla.MLA_OPS, quant.QUANT_OPS, parallel.PARALLEL_OPS)
    assert sum(map(len, tables)) == len(vocabulary.OPS)  # no name defined twice
    for table in tables:
        assert table.items() <= vocabulary.OPS.items()
    assert set(vocabulary.HOST_SYNC_OPS) <= set(vocabulary.OPS)
    assert {"paged_attention", "moe_grouped_gemm", "mla_attention"} <= vocabulary.HOST_SYNC_OPS


# Each model module and the op tables its models call.
NEEDS = {
    "llama": ("ops",),
    "moe_models": ("ops", "moe"),
    "deepseek": ("ops", "moe", "mla"),
}
TABLES = {"ops": ops.OPS, "moe": moe.MOE_OPS, "mla": mla.MLA_OPS}


@pytest.mark.parametrize("module", list(NEEDS))
def test_a_model_import_registers_the_ops_it_calls(module):
    names = sorted(name for table in NEEDS[module] for name in TABLES[table])
    # A fresh interpreter: in this one every op is registered already.
    child = (
        "import sys, torch\n"
        f"import compile_engine.models.{module}\n"
        f"missing = [n for n in {names!r} if not hasattr(torch.ops.ce, n)]\n"
        "assert not missing, missing\n"
        "assert 'compile_engine.models.vocabulary' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
