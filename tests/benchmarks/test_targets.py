"""benchmarks/targets.py: the targets table and plot read the newest comparable H200 run of each
row, and say plainly what is met; render.py's change log of those numbers keeps what was
written by hand."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from compile_engine.benchmarks import cli, render, targets

H200 = {"type": "cuda", "name": "NVIDIA H200"}
LLAMA3_8B = {
    "architecture": "LlamaForCausalLM",
    "num_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
}


def _run(name, timestamp, commit="c0ffee0", device=H200, model="/tmp/l3", **keys) -> dict:
    return {
        "name": name,
        "benchmark": name.split("-")[0],
        "timestamp": timestamp,
        "commit": commit,
        "device": device,
        "model": model,
        "command": f"bench {name} --at {commit}",
        **keys,
    }


def _results() -> list[dict]:
    return [
        _run("latency", "2026-11-30T01:00:00", commit="old", decode_bs1_tok_s=230.0,
             model_config=LLAMA3_8B),
        _run("latency", "2026-11-30T02:00:00", commit="new", model_config=LLAMA3_8B,
             decode_bs1_tok_s=240.0, decode_bs64_tok_s=13_500.0, decode_bs256_tok_s=29_900.0,
             hf_eager_decode_bs1_tok_s=40.0),
        # Later, but a named variant, another model and another device: none of them counts.
        _run("latency-pinned-copies", "2026-11-30T03:00:00", decode_bs1_tok_s=999.0,
             model_config=LLAMA3_8B),
        _run("latency", "2026-11-30T03:00:00", model="/tmp/tiny", decode_bs1_tok_s=999.0),
        _run("latency", "2026-11-30T03:00:00", device={"type": "cpu", "cpu": "EPYC"},
             decode_bs1_tok_s=999.0, model_config=LLAMA3_8B),
        # Runs that record no model config count by the model's name.
        _run("startup", "2026-11-30T02:30:00", commit="boot", cold_build_s=65.0,
             startup_ready_minus_weights_s=7.9, startup_ready_s=9.9),
        _run("throughput", "2026-11-30T02:10:00", offline_output_tok_s=10_500.0),
    ]  # fmt: skip


def _probes() -> list[dict]:
    """_results() as a kind the page details generically: they carry only the keys tested here."""
    probes = []
    for run in _results():
        name = run["name"].replace(run["benchmark"], "probe")
        probes.append({**run, "name": name, "benchmark": "probe"})
    return probes


def test_latest_takes_the_newest_comparable_run_of_each_row():
    found = targets.latest(_results())
    assert {k: v for k, (v, _) in found.items()} == {
        "decode_bs1_tok_s": 240.0,
        "decode_bs64_tok_s": 13_500.0,
        "decode_bs256_tok_s": 29_900.0,
        "offline_output_tok_s": 10_500.0,
        "startup_ready_minus_weights_s": 7.9,
        "cold_build_s": 65.0,
    }
    assert found["decode_bs1_tok_s"][1]["commit"] == "new"
    # With no H200 run of the Llama-3-8B shape there is no model to compare.
    assert targets.latest([r for r in _results() if "model_config" not in r]) == {}


def test_table_says_what_is_met():
    lines = targets.table(_results(), "performance.svg")
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ")}
    assert rows["decode batch 1, tok/s"].endswith("| >= 250 | **no** |")
    assert "latency @ `new`" in rows["decode batch 1, tok/s"]
    assert rows["decode batch 64, tok/s"].endswith("| >= 13,000 | yes |")
    assert rows["decode batch 256, tok/s"].endswith("| >= 30,000 | **no** |")
    assert rows["serve ready besides the weight read, s"].endswith("| <= 10 | yes |")
    assert rows["cold build, s"].endswith("| 162 | 104 | <= 90 | yes |")
    assert "serve 512/256 at concurrency 256, output tok/s" not in rows  # no serve run here
    assert lines[-2] == "![ours and the peers as a share of each target](performance.svg)"
    assert targets.table([], None) == []


def test_plot_is_an_svg_with_a_bar_for_each_number():
    svg = targets.plot_svg(_results())
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    bars = [r for r in root.iter(f"{ns}rect") if r.find(f"{ns}title") is not None]
    titles = [r.find(f"{ns}title").text for r in bars]
    # batch 1: ours, vLLM, static compile, HF eager; 64 and 256: three each; offline: two.
    assert len(bars) == 4 + 3 + 3 + 2
    assert "ours: 240" in titles and "HF eager (same run): 40" in titles
    assert "vLLM 0.26.0: 9,778" in titles
    widths = {t: float(r.get("width")) for t, r in zip(titles, bars, strict=True)}
    # Bars are shares of the target: batch 1's 240 / 250 is longer than vLLM's 204 / 250.
    assert widths["ours: 240"] > widths["vLLM 0.26.0: 204"] > 0
    assert targets.plot_svg([]) is None


def test_render_writes_the_plot_beside_the_page(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for i, run in enumerate(_probes()):
        (results / f"{run['name']}-{i}.json").write_text(json.dumps(run))
    out = tmp_path / "docs" / "performance.md"
    assert cli.main(["render", "--results-dir", str(results), "--output", str(out)]) == 0
    assert ET.parse(out.with_suffix(".svg")).getroot().tag.endswith("svg")
    text = out.read_text()
    assert "## Against the targets" in text and "(performance.svg)" in text
    # No comparable run, no plot: the page says nothing of one.
    for path in results.glob("*.json"):
        path.unlink()
    out.with_suffix(".svg").unlink()
    assert cli.main(["render", "--results-dir", str(results), "--output", str(out)]) == 0
    assert not out.with_suffix(".svg").exists() and "performance.svg" not in out.read_text()


def test_the_commands_of_the_table_s_runs_newest_first():
    assert render.headline_commands(_results()) == [
        "- `startup`: `bench startup --at boot`",
        "- `throughput`: `bench throughput --at c0ffee0`",
        "- `latency`: `bench latency --at new`",
    ]


def _page_with_log(*rows: str) -> str:
    header = "| commit | date | " + " | ".join(render.LOG_COLUMNS.values()) + " | what changed |"
    return "\n".join(
        ["# Performance", "", render.CHANGE_LOG, "", header, "|---|", *rows, "",
         "## Latest record of each benchmark", "", "| `c0ffee0` | not the log |"]
    )  # fmt: skip


def test_change_log_keeps_hand_rows_and_refreshes_measured_ones():
    by_hand = "| `0ld0ld0` | 2026-11-01 | 100.0 | — | — | — | — | — | — | a kernel by hand |"
    stale = "| `new` | 2026-11-30 | 1.0 | — | — | — | — | — | — | kept note |"
    lines = render.change_log(_results(), _page_with_log(by_hand, stale))
    rows = [line for line in lines if line.startswith("| `")]
    # A commit the results no longer hold keeps its row as written.
    assert rows[0] == by_hand
    # A commit in the results gets its numbers from them and keeps its note.
    assert (
        rows[1]
        == "| `new` | 2026-11-30 | 240.0 | 13,500.0 | 29,900.0 | — | — | — | — | kept note |"
    )
    # Commits not yet in the log follow, oldest first, with the numbers measured at each.
    assert rows[2:] == [
        "| `old` | 2026-11-30 | 230.0 | — | — | — | — | — | — |  |",
        "| `c0ffee0` | 2026-11-30 | — | — | — | 10,500.0 | — | — | — |  |",
        "| `boot` | 2026-11-30 | — | — | — | — | — | 7.90 | 65.0 |  |",
    ]
    # Rendering the page again from itself changes nothing.
    page = render.render(_probes(), None, _page_with_log(by_hand, stale))
    assert render.render(_probes(), None, page) == page
    assert page.count("a kernel by hand") == 1 and "| `c0ffee0` | not the log |" not in page
