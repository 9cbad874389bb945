"""bench fusions off the GPU: the verdict that decides a pass's default, and its render block."""

from __future__ import annotations

import json

from compile_engine.benchmarks import fusions, render


def _row(op: str, num_tokens: int, inductor_us: float, **kernels: float) -> dict:
    row = {"op": op, "T": num_tokens, "bytes": 1000, "inductor": {"us": inductor_us, "gb_s": 1.0}}
    for name, us in kernels.items():
        row[name] = {"us": us, "gb_s": 1.0, "speedup_vs_inductor": inductor_us / us}
    return row


def test_a_pass_wins_only_if_faster_at_every_token_count():
    rows = [
        _row("add_rms_norm", 1, 4.0, triton=3.0),
        _row("add_rms_norm", 2048, 20.0, triton=19.0),
        _row("rotary", 1, 4.0, triton=3.0),
        _row("rotary", 2048, 20.0, triton=25.0),
        _row("silu_and_mul", 1, 4.0, triton=3.0),
        {**_row("silu_and_mul", 2048, 20.0, triton=10.0), "helion": {"error": "boom"}},
    ]
    v = fusions.verdicts(rows)
    assert v["rms_norm_triton"]["beats_inductor_at_every_T"]
    assert not v["rotary_triton"]["beats_inductor_at_every_T"]  # slower at T = 2048
    assert v["silu_and_mul_triton"]["beats_inductor_at_every_T"]
    # A variant that failed at some T did not win there.
    assert not v["silu_and_mul_helion"]["beats_inductor_at_every_T"]
    assert v["rotary_triton"]["speedup_vs_inductor"] == {"1": 4 / 3, "2048": 0.8}


def test_render_block(tmp_path):
    rows = [_row("rotary", 64, 4.0, triton=2.0), _row("silu_and_mul", 64, 5.0, helion=10.0)]
    record = {
        "name": "fusions",
        "timestamp": "2026-11-29T00:00:00+00:00",
        "commit": "abc",
        "device": {"name": "NVIDIA H200", "type": "cuda"},
        "shapes": {"hidden": 4096, "dtype": "bfloat16"},
        "rows": rows,
        "verdicts": fusions.verdicts(rows),
    }
    (tmp_path / "fusions.json").write_text(json.dumps(record))
    text = render.render(render.load_results(tmp_path))
    assert "| rotary | 64 | 4.00 us, 1 GB/s | 2.00 us, 1 GB/s (x2.00) |" in text
    assert "`rotary_triton` beats Inductor at every T (T=64: x2.00)" in text
    assert "`silu_and_mul_helion` does not beat Inductor at every T (T=64: x0.50)" in text
