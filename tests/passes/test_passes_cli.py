"""`compile-engine passes --json` lists a pass for each fusion family of issue 5."""

from __future__ import annotations

import json

from compile_engine.cli import main

FAMILIES = ("paged_attention", "rms_norm", "silu_and_mul", "rotary")


def test_passes_json_lists_every_family_with_description_and_targets(capsys):
    assert main(["passes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for family in FAMILIES:
        # lower_to_reference names no family: each needs a pass of its own that lowers it to
        # a kernel on the GPU target.
        # (A family may also have CPU passes, as paged_attention_cpu.)
        passes = [r for r in rows if family in r["name"]]
        assert any("h100" in r["targets"] for r in passes), f"no GPU pass for {family}: {passes}"
        for row in passes:
            assert row["description"] and row["targets"], row
            assert isinstance(row["default"], bool) and len(row["uuid"]) == 16, row
