"""`bench render`: docs/performance.md from the JSON in benchmarks/results/.

benchmarks/results/ holds the latest record of each benchmark on each device; the records it
replaced are in git history. The page is generated, so edit this file, not the page, with one
exception: the change log's last column ("what changed") is written by hand and kept.

The page, top to bottom: issue 7's targets against the newest comparable H200 run of each row
(targets.py: ours, the peers, met or not) with its plot and the commands of those runs; the
change log, a row for each commit whose runs made headline numbers (rows of commits no longer
in the results are kept from the page as it was, a commit in the results gets its numbers from
them, a new one is appended); then the latest record of each benchmark in detail.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from pathlib import Path

from compile_engine.benchmarks import targets
from compile_engine.benchmarks.results import (
    DEFAULT_DIRECTORY,
    FLAT_KEYS,
    REPO_ROOT,
    result_kind,
    result_model,
)

DEFAULT_OUTPUT = REPO_ROOT / "docs" / "performance.md"

CHANGE_LOG = "## Change log of the headline numbers"

# The change log's number columns: targets.TARGETS' keys, labelled short.
LOG_COLUMNS = {
    "decode_bs1_tok_s": "decode 1",
    "decode_bs64_tok_s": "decode 64",
    "decode_bs256_tok_s": "decode 256",
    "offline_output_tok_s": "offline",
    "serve_output_tok_s": "serve",
    "startup_ready_minus_weights_s": "ready − weights, s",
    "cold_build_s": "cold build, s",
}

# The order of the detailed records: the headline benchmarks first, then the kernels'.
KIND_ORDER = (
    "latency",
    "throughput",
    "serve",
    "startup",
    "breakdown",
    "offline_floor",
    "paged_attention",
    "paged_attention_fp8",
    "paged_attention_prefill",
    "gemm",
    "gemm_norm",
    "fusions",
    "moe",
    "mla",
    "kv_waste",
)


def load_results(directory: str | Path) -> list[dict]:
    results = []
    for path in sorted(Path(directory).glob("*.json")):
        record = json.loads(path.read_text())
        record["_file"] = path.name
        results.append(record)
    return sorted(results, key=lambda r: r.get("timestamp", ""))


def _commit(r: dict) -> str:
    return r.get("commit", "unknown")[:12] + ("-dirty" if r.get("dirty") else "")


def _device(r: dict) -> str:
    return r.get("device", {}).get("name", "?")


def _command(r: dict) -> str:
    command = r.get("command", "?")
    return shlex.join(command) if isinstance(command, list) else str(command)


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _step_masks(r: dict) -> str:
    """A structured record's per-step mask times (records before 2026-12-02 timed only steps,
    under the one-mask keys)."""
    if "grammar_step_mask_p50_ms" not in r:
        return "—"
    return f"{r['grammar_step_mask_p50_ms']:.2f} / {r['grammar_step_mask_p99_ms']:.2f}"


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:,.2f}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def headline_commands(results: list[dict]) -> list[str]:
    """The command of each run the targets table takes a number from, newest first."""
    runs = {id(run): run for _, run in targets.latest(results).values()}
    ordered = sorted(runs.values(), key=lambda r: str(r.get("timestamp", "")), reverse=True)
    return [f"- `{r.get('_file', result_kind(r))}`: `{_command(r)}`" for r in ordered]


# --------------------------------------------------------------------------- the change log


def _short(commit: str) -> str:
    return commit[:7]


def measured_rows(results: list[dict]) -> dict[str, list[str]]:
    """{commit: the change log's cells but the last} for each commit whose comparable runs
    (targets.comparable_runs) carry a headline number, oldest first."""
    rows: dict[str, list[str]] = {}
    values: dict[str, dict[str, float]] = {}
    for run in targets.comparable_runs(results):
        commit = _short(str(run.get("commit", "?")))
        found = {k: float(run[k]) for k in LOG_COLUMNS if isinstance(run.get(k), int | float)}
        if not found:
            continue
        values.setdefault(commit, {}).update(found)
        date = str(run.get("timestamp", ""))[:10]
        row = [f"`{commit}`", date, *(_fmt(values[commit].get(k)) for k in LOG_COLUMNS)]
        rows[commit] = row
    return rows


def previous_log(page: str) -> list[tuple[str, str, str]]:
    """The change log of a page as it was: (commit, its row's text, its last cell) a row."""
    rows = []
    inside = False
    for line in page.splitlines():
        if line.startswith("## "):
            inside = line == CHANGE_LOG
        elif inside and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append((cells[0].strip("`"), line, cells[-1]))
    return rows


def change_log(results: list[dict], previous_page: str = "") -> list[str]:
    """The change log: the previous page's rows in their order, those of commits measured in
    `results` with their numbers from them and their note kept, then new commits appended."""
    measured = measured_rows(results)
    lines = []
    for commit, line, note in previous_log(previous_page):
        row = measured.pop(commit, None)
        lines.append(line if row is None else "| " + " | ".join([*row, note]) + " |")
    lines += ["| " + " | ".join([*row, ""]) + " |" for row in measured.values()]
    header = ["commit", "date", *LOG_COLUMNS.values(), "what changed"]
    return [
        CHANGE_LOG,
        "",
        "A row for each commit whose runs (H200, the Llama-3-8B-shaped model, no named variant)",
        "set a headline number: the numbers measured at that commit, `—` where it measured none.",
        "The records themselves are in git history; the last column is written by hand.",
        "",
        *_table(header, []),
        *lines,
    ]


# --------------------------------------------------------------------------- the page


def _order(r: dict) -> tuple:
    kind = result_kind(r)
    rank = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
    return ("H200" not in _device(r), rank, r.get("_file", ""))


def _record_title(r: dict) -> str:
    model = result_model(r)
    what = f", {model}" if model else ""
    return f"### {r.get('name') or result_kind(r)}: {_device(r)} at `{_commit(r)}`{what}"


def render(results: list[dict], plot_file: str | None = None, previous_page: str = "") -> str:
    """The page; `plot_file`: the targets plot's file name beside it, if one was written;
    `previous_page`: the page as it was, whose change log is kept."""
    lines = [
        "# Performance",
        "",
        "Generated by `compile-engine bench render` from `benchmarks/results/*.json`, the latest",
        "record of each benchmark on each device (earlier ones are in git history); edit",
        "benchmarks/render.py, not this page, except the change log's last column. The protocol",
        "is in [benchmarks.md](benchmarks.md); experiments measured against the defaults, won",
        "or lost, are in [compiler.md](compiler.md)'s table.",
        "",
    ]
    if any(_command(r).startswith("python -m benchmarks ") for r in results):
        lines += [
            "Commands recorded before 802a0e4 start `python -m benchmarks`; today the same",
            "command is `compile-engine bench` (or `python -m compile_engine.benchmarks`).",
            "",
        ]
    table = targets.table(results, plot_file)
    if table:
        lines += [*table, "The commands of those runs:", "", *headline_commands(results), ""]
    lines += [*change_log(results, previous_page), "", "## Latest record of each benchmark"]
    if not results:
        lines += ["", "_No results yet: run a benchmark (see benchmarks.md)._"]
    for r in sorted(results, key=_order):
        lines += ["", _record_title(r), "", f"`{r.get('_file', '?')}`, {r.get('timestamp', '?')}:"]
        lines += [f"`{_command(r)}`", "", *_details(r)]
    return "\n".join(lines).rstrip() + "\n"


def _versions(r: dict) -> str:
    text = ", ".join(f"{k} {v}" for k, v in r.get("versions", {}).items())
    if env := r.get("environment"):
        text += "; environment " + " ".join(f"`{k}={v}`" for k, v in env.items())
    return text


def _model_line(r: dict) -> str:
    m = r.get("model_config", {})
    e = r.get("engine", {})
    if not m:
        what = ""
        if "model" in r and not isinstance(r["model"], dict):
            what = f"Model `{r['model']}`, target {r.get('target', '?')}. "
        return f"{what}Versions: {_versions(r)}." if r.get("versions") else what
    return (
        f"Model `{r.get('model', '?')}`: {m.get('architecture')}, {m.get('num_layers')} layers, "
        f"hidden {m.get('hidden_size')}, {m.get('num_heads')}/{m.get('num_kv_heads')} heads; "
        f"{e.get('dtype')} on {e.get('target')}, block {e.get('block_size')}, "
        f"{e.get('num_kv_blocks')} KV blocks, max_num_seqs {e.get('max_num_seqs')}, "
        f"eager {e.get('enforce_eager')}. Versions: {_versions(r)}."
    )


def _engine_line(r: dict) -> str:
    """How the runs' engine was compiled: passes, pieces, CUDA graphs, start-up time."""
    e = r.get("engine", {})
    if not e.get("compiled"):
        return ""
    c = e.get("compile") or {}
    passes = ", ".join(f"{p['name']} {p['matches']}" for p in e.get("passes", []) if p["applies"])
    g = e.get("cuda_graphs")
    if g:
        sizes = g["capture_sizes"]
        graphs = (
            f"{g['num_graphs']} CUDA graphs ({sizes[0]}..{sizes[-1]} tokens) captured in "
            f"{g['capture_seconds']:.1f} s, pool {g['pool_gib']:.3f} GiB"
        )
    else:
        graphs = "no CUDA graphs"
    text = (
        f"Compiled: {c.get('num_pieces')} pieces ({c.get('num_attention_pieces')} attention, "
        f"{c.get('num_compiled_pieces')} compiled by Inductor), {c.get('compilations')} "
        f"Dynamo compilation(s); pass matches: {passes or 'none'}; {graphs}."
    )
    if "llm_init_s" in r:
        text += f" `LLM(...)` ready in {r['llm_init_s']:.1f} s."
    return text


def _gpu_cell(g: dict) -> str:
    """benchmarks.telemetry's summary in a table cell."""
    if not g.get("samples"):
        return g.get("error", "—")
    clock, power = g["sm_clock_mhz"], g["power_w"]
    return (
        f"SM {clock['median']:,.0f} MHz median ({clock['min']:,}-{clock['max']:,}), "
        f"{power['median']:,.0f} W median, power-capped {g['power_capped_fraction']:.0%}"
    )


def _details(r: dict) -> list[str]:
    kind = result_kind(r)
    model_line = _model_line(r)
    lines = [model_line, ""] if model_line else []
    if engine := _engine_line(r):
        lines += [engine, ""]
    if kind == "latency":
        lines.append(
            f"Prompt {r['input_len']}, {r['output_len']} new tokens, greedy; median of "
            f"{r['num_iters']} runs after {r['num_warmup']} warmup. Roofline: "
            f"{_bytes(r['weight_bytes_per_step'])} of weights + KV per step at "
            f"{_bytes(r['copy_rate_B_s'])}/s ({r['copy_rate_source']})."
        )
        if hf := r.get("hf_reference"):
            lines.append(
                f"Same-run reference: HF transformers on {hf['model_path']}, "
                f"{hf['attn_implementation']} attention, {hf['dtype']}, our engine freed first; "
                "tok/s = B × (output_len − 1) / (t_generate(output_len) − t_generate(1))."
            )
        lines.append("")
        header = ["batch", "decode tok/s", "ms/step", "roofline tok/s", "of roofline", "prefill s"]
        if hf:
            header += ["HF eager tok/s (same run)", "ours / HF"]
        gpu = any("samples" in x.get("gpu", {}) for x in r["batches"].values())
        if gpu:
            header += ["GPU during the runs"]
        rows = []
        for b, x in r["batches"].items():
            row = [
                b,
                _fmt(x["decode_tok_s"]),
                _fmt(x["ms_per_step"]),
                _fmt(x["roofline_tok_s"]),
                f"{x['roofline_pct']:.1f}%",
                _fmt(x["prefill_s"]),
            ]
            if hf:
                theirs = x["hf_decode_tok_s"]
                ratio = f"{x['decode_tok_s'] / theirs:.2f}x" if theirs > 0 else "—"
                row += [_fmt(theirs), ratio]
            if gpu:
                row.append(_gpu_cell(x.get("gpu", {})))
            rows.append(row)
        lines += _table(header, rows)
    elif kind == "structured":
        batch = r["batch"]
        header = ["batch", "requests", "plain tok/s", "JSON schema tok/s", "overhead"]
        header += ["one mask ms p50 / p99 / max", "a step's masks ms p50 / p99"]
        header += ["compile ms p50 / p99", "grammar accepts"]
        row = [
            str(batch),
            f"{r['num_requests']} x ({r['input_len']} / {r['output_len']}), {r['repeats']} each",
            _fmt(r["plain_output_tok_s"]),
            _fmt(r["json_schema_output_tok_s"]),
            f"{r[f'structured_overhead_bs{batch}']:.1%}",
            f"{r['grammar_mask_p50_ms']:.2f} / {r['grammar_mask_p99_ms']:.2f} / "
            f"{r['grammar_mask_max_ms']:.2f}",
            _step_masks(r),
            f"{r['grammar_compile_p50_ms']:.2f} / {r['grammar_compile_p99_ms']:.2f}",
            f"{r.get('json_schema_accepted', '—')} / {r.get('json_schema_answers', '—')}",
        ]
        lines += _table(header, [row])
    elif kind == "throughput":
        header = ["requests", "in / out", "elapsed s", "req/s", "output tok/s", "total tok/s"]
        row = [
            str(r["num_requests"]),
            f"{r['input_len']} / {r['output_len']} (+-{r['range_ratio']:.0%})",
            _fmt(r["elapsed_s"]),
            _fmt(r["requests_per_s"]),
            _fmt(r["output_tok_s"]),
            _fmt(r["total_tok_s"]),
        ]
        if "samples" in r.get("gpu", {}):
            header.append("GPU during the run")
            row.append(_gpu_cell(r["gpu"]))
        lines += _table(header, [row])
        if r.get("steps"):
            lines.append("")
            lines.append(
                "Engine steps by kind (each timed from its schedule call to the next: with "
                "async scheduling, the device time of the step before, so at a change of kind "
                "one step lands in the other row):"
            )
            lines.append("")
            step_rows = [
                [
                    kind,
                    _fmt(x["steps"]),
                    _fmt(x["seconds"]),
                    _fmt(x["ms_per_step"]),
                    _fmt(x["tokens_per_step"]),
                    _fmt(x["sequences_per_step"]),
                ]
                for kind, x in r["steps"].items()
            ]
            header = ["steps", "count", "seconds", "ms a step", "tokens a step", "sequences a step"]
            lines += _table(header, step_rows)
    elif kind == "kv_waste":
        lo, hi = r["prompt_len_range"]
        olo, ohi = r["output_len_range"]
        lines.append(
            f"{r['num_requests']} requests, prompts {lo}-{hi} and outputs {olo}-{ohi} tokens "
            f"(uniform), prefix caching off, block {r['block_size']}, max_model_len "
            f"{r['max_model_len']}; measured every step after allocation "
            f"({r['steps_measured']} steps, {r['mean_running']:.1f} running on average, "
            f"at most {r['max_running']}, {r['preemptions']} preemptions)."
        )
        lines.append("")
        ok = "yes" if r["within_one_partial_block"] else "**NO**"
        lines += _table(
            ["measure", "value"],
            [
                [
                    "largest waste of one request, slots",
                    f"{r['max_request_waste_slots']} (< {r['block_size']}: {ok})",
                ],
                ["paged: unused / allocated, mean over steps", f"{r['waste_pct_mean']:.2f}%"],
                ["paged: unused / allocated, worst step", f"{r['waste_pct_max']:.2f}%"],
                ["paged: unused / allocated, all steps", f"{r['waste_pct_overall']:.2f}%"],
                [
                    "contiguous, max_model_len reserved per request",
                    f"{r['contiguous_max_len_waste_pct']:.1f}%",
                ],
                [
                    "contiguous, prompt + max_tokens reserved per request",
                    f"{r['contiguous_request_max_waste_pct']:.1f}%",
                ],
            ],
        )
    elif kind == "startup":
        lines += _startup(r)
    elif kind in ("paged_attention", "paged_attention_fp8"):  # the second over an FP8 cache
        lines += _paged_attention(r)
    elif kind == "paged_attention_prefill":
        lines += _paged_attention_prefill(r)
    elif kind == "fusions":
        lines += _fusions(r)
    elif kind == "breakdown":
        lines += _breakdown(r)
    elif kind == "serve":
        lines += _serve(r)
    elif kind == "gemm":
        lines += _gemm(r)
    elif kind == "gemm_norm":
        lines += _gemm_norm(r)
    elif kind == "offline_floor":
        lines += _offline_floor(r)
    elif kind in ("speculative", "speculative_replay"):
        lines += _speculative(r)
    elif kind in ("moe", "mla"):
        # Their modules import torch; only a result of that kind pays for it.
        module = importlib.import_module(f"compile_engine.benchmarks.{kind}")
        lines += module.render_details(r)
    else:
        flat = [[k, _fmt(r[k])] for k in FLAT_KEYS if k in r]
        lines += _table(["key", "value"], flat) if flat else []
    return lines


def _speculative(r: dict) -> list[str]:
    """bench speculative: per batch size, the plain engine's decode tok/s and each
    speculative engine's, its speed-up and acceptance length."""
    spec = r.get("speculative_config") or {}
    what = (
        f"random {r['input_len']}-token prompts, {r['output_len']} tokens each, the replay "
        "proposer (benchmark-only: all / none of the target's own continuation accepted)"
        if "input_len" in r
        else f"{len(r.get('prompts', []))} prompts of {r.get('workload')}, up to "
        f"{r.get('max_tokens')} tokens each"
    )
    lines = [
        f"{what}; k = {spec.get('num_speculative_tokens')}, adaptive {spec.get('adaptive')}; "
        f"median of {r['rounds']} alternating rounds; load average {r.get('load_average')}.",
        "",
    ]
    rows = []
    for b, entry in r["batches"].items():
        for name, x in entry.items():
            if name == "off":
                continue
            length = x.get("mean_acceptance_length")
            rows.append(
                [b, _fmt(entry["off"]["decode_tok_s"]), name, _fmt(x["decode_tok_s"]),
                 f"{x['speedup']:.2f}x", f"{length:.2f}" if length else "—",
                 str(x.get("outputs_differ", "—"))]
            )  # fmt: skip
    header = ["batch", "off tok/s", "speculative", "tok/s", "speed-up", "accept len"]
    return lines + _table([*header, "outputs differing"], rows)


def _gemm(r: dict) -> list[str]:
    """bench gemm: per (weight, rows) cell cuBLAS against the fastest Triton config, and the
    fastest with the even row partition (a name ending /r<programs per SM>) where swept."""
    rows = []
    for c in r.get("cells", []):
        variants = c.get("variants", {})
        cublas = variants.get("cublas", {}).get("us")
        timed = sorted(
            (v["us"], name)
            for name, v in variants.items()
            if name.startswith("triton") and v.get("us")
        )
        ragged = [t for t in timed if "/r" in t[1]]

        def cell(t: tuple[float, str] | None) -> str:
            return f"{t[0]:.2f} (`{t[1].removeprefix('triton:')}`)" if t else "—"

        best = timed[0] if timed else None
        ratio = f"x{cublas / best[0]:.3f}" if best and cublas else "—"
        rows.append(
            [c["shape"], str(c["M"]), _fmt(cublas), cell(best), ratio,
             cell(ragged[0] if ragged else None)]
        )  # fmt: skip
    header = ["weight", "rows", "cuBLAS us", "best Triton us", "cuBLAS / best", "best ragged us"]
    return [
        "CUDA-graph replay over weight copies that miss L2, median per call "
        f"({r.get('timing', 'see benchmarks/gemm.py')}).",
        "",
        *_table(header, rows),
    ]


def _gemm_norm(r: dict) -> list[str]:
    """bench gemm-norm: per (weight, rows) cell the unfused chain against the fastest fused
    config."""
    rows = []
    for c in r.get("cells", []):
        best = c.get("variants", {}).get(c.get("best", ""), {}).get("us")
        ratio = f"x{c['speedup_vs_unfused']:.3f}" if "speedup_vs_unfused" in c else "—"
        fused = f"{best:.2f} (`{c['best']}`)" if best else "—"
        rows.append(
            [c["shape"] + (" + silu" if c.get("gated") else ""), str(c["M"]),
             f"{c['unfused_us']:.2f} ({c.get('gemm', '?')})", fused, ratio]
        )  # fmt: skip
    header = ["weight", "rows", "unfused us (GEMM)", "best fused us", "unfused / fused"]
    return [
        "The norm kernel, the tuned GEMM [and silu_and_mul] against the fused launch; "
        f"CUDA-graph replay over weight copies that miss L2 ({r.get('timing', '')}).",
        "",
        *_table(header, rows),
    ]


def _offline_floor(r: dict) -> list[str]:
    """bench offline-floor: the offline run's parts at their measured rates, settled and burst."""
    settled, burst, m = r["floor_s"], r["floor_burst_s"], r["measured"]
    rows = [
        [part, f"{settled[part]:.2f}", f"{burst[part]:.2f}",
         _gpu_cell(m[part]["gpu"]) if part in m else ""]
        for part in settled
    ]  # fmt: skip
    step = m.get("decode_step_gemm")
    return [
        f"The run's kernels alone, one after another, at this GPU's rates (GEMMs at "
        f"{r['gemm_tflops_settled']:.0f} TFLOP/s settled): at most "
        f"{r['floor_output_tok_s']:,.0f} output tok/s; the target needs {r['target_s']:.2f} s.",
        "",
        *_table(["part", "seconds, settled", "seconds, burst", "GPU while settled"], rows),
        "",
        (
            f"A decode-only step's GEMMs (256 rows, lm_head included): {step['ms']:.2f} ms settled."
            if step
            else ""
        ),
    ]


def _breakdown(r: dict) -> list[str]:
    """One decode step's host phases (median ms) beside the model's device time."""
    results = r["results"]
    names = list(results[0]["phases_ms"])
    header = ["phase (ms, median)"] + [f"batch {x['batch']}" for x in results]
    rows = [[n] + [f"{x['phases_ms'][n]:.3f}" for x in results] for n in names]
    rows.append(["**whole step**"] + [f"**{x['step_ms']:.2f}**" for x in results])
    rows.append(["model on device (graph replay)"] + [_fmt(x["model_device_ms"]) for x in results])
    lines = _table(header, rows)
    profiled = [x for x in results if x.get("kernels")]
    if profiled:
        # By kind from the kernel rows themselves: results from 3fb7708 and before also
        # counted CPU-side ops (aten::mm, the profiler's step annotation) in their totals.
        from compile_engine.benchmarks.breakdown import is_device_event, kernel_kind

        by_batch = []
        for x in profiled:
            by_kind: dict[str, float] = {}
            for row in x["kernels"]["top_kernels"]:
                if is_device_event(row["name"]):
                    kind = kernel_kind(row["name"])
                    by_kind[kind] = by_kind.get(kind, 0.0) + row["us_per_step"]
            by_batch.append(dict(sorted(by_kind.items(), key=lambda kv: -kv[1])))
        kinds = list(dict.fromkeys(k for by_kind in by_batch for k in by_kind))
        title = (
            "Device time a step by kind of kernel (torch.profiler over engine steps; the "
            "top kernels recorded, which hold nearly all of it):"
        )
        lines += ["", title, ""]
        header = ["kernels (us a step)"] + [f"batch {x['batch']}" for x in profiled]
        rows = [[kind] + [_fmt(by_kind.get(kind, 0.0)) for by_kind in by_batch] for kind in kinds]
        rows.append(["**all device kernels**"] + [f"**{sum(b.values()):,.1f}**" for b in by_batch])
        lines += _table(header, rows)
    charged = [x for x in profiled if "critical_path_us" in x["kernels"]]
    if charged:
        lines += ["", (
            "The same steps on the critical path: each kernel charged only for the time after "
            "every kernel that started before it ended (with programmatic dependent launch a "
            "kernel starts early and waits, so the durations above overlap), and the time the "
            "device ran no kernel:"
        ), ""]  # fmt: skip
        paths = [x["kernels"]["critical_path_us"] for x in charged]
        kinds = list(dict.fromkeys(k for path in paths for k in path))
        header = ["critical path (us a step)"] + [f"batch {x['batch']}" for x in charged]
        rows = [[kind] + [_fmt(path.get(kind, 0.0)) for path in paths] for kind in kinds]
        rows.append(
            ["device idle (no kernel)"]
            + [_fmt(x["kernels"]["device_idle_us_per_step"]) for x in charged]
        )
        lines += _table(header, rows)
        for x in charged:
            gaps = x["kernels"].get("idle_gaps") or []
            if gaps:
                lines += ["", f"Batch {x['batch']}'s idle time by the kernels around each gap:", ""]
                lines += [
                    f"- {_fmt(g['us_per_step'])} us a step: `{g['after']}` -> `{g['before']}`"
                    for g in gaps[:5]
                ]
            places = x["kernels"].get("critical_path_by_position") or []
            if places:
                lines += ["", (
                    f"Batch {x['batch']}'s critical path by each kernel's place in a layer "
                    "(`#k`: the k-th of that name after the attention kernel):"
                ), ""]  # fmt: skip
                lines += [
                    f"- {_fmt(p['us_per_step'])} us a step, {p['us_per_call']:.2f} us a call x "
                    f"{p['calls_per_step']:g}: `{p['kernel']}`"
                    for p in places[:8]
                ]
    return lines


def _serve(r: dict) -> list[str]:
    """bench serve: the load, then vLLM's latency table and the throughputs."""
    if r.get("dataset") == "random":
        ratio = r.get("random_range_ratio") or 0
        shape = f"{r['input_len']} in / {r['output_len']} out" + (
            f" (+-{ratio:.0%})" if ratio else ""
        )
    else:
        shape = f"{r.get('dataset')} lengths"
    rate = r.get("request_rate")
    load = "all at once" if rate == "inf" else f"Poisson at {rate} req/s"
    server = r.get("server") or {}
    where = (
        f"`compile-engine serve` launched by the benchmark (dtype {r.get('dtype')}, healthy "
        f"after {server.get('ready_s', 0):.1f} s)"
        if server.get("launched")
        else f"the server at {r.get('base_url')}"
    )
    preempted = (r.get("server_counters") or {}).get("preemptions")
    text = (
        f"{r['num_prompts']} streaming /v1/completions requests of random token ids, {shape}, "
        f"sent {load}, at most {r.get('max_concurrency') or 'unbounded'} in flight, "
        f"{r.get('num_warmup', 0)} warmup requests first, temperature {r.get('temperature')}, "
        f"ignore_eos; {where}. {r['completed']} completed, {r['failed']} failed"
    )
    text += f" (first error: {r['first_error']})." if r.get("first_error") else "."
    text += f" Duration {r['duration_s']:.1f} s"
    text += f", {preempted:.0f} preemptions on the server." if preempted is not None else "."
    lines = [text, ""]
    if not r.get("per_token_stream", True):
        lines += [
            f"**Streams carried {r['tokens_per_chunk']:.1f} tokens per chunk**: TTFT, TPOT and "
            "ITL below are not per token.",
            "",
        ]
    rows = []
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2el_ms", "E2EL"),
    ):
        s = r.get(key) or {}
        rows.append([label] + [_fmt(s.get(k)) for k in ("mean", "median", "p90", "p99")])
    lines += _table(["ms", "mean", "median", "p90", "p99"], rows)
    slos = r.get("goodput_slos_ms") or {}
    goodput = "—"
    if r.get("request_goodput") is not None:
        met = ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items())
        goodput = f"{_fmt(r['request_goodput'])} ({met})"
    lines += [""]
    lines += _table(
        ["requests/s", "output tok/s", "total tok/s", "goodput req/s"],
        [
            [
                _fmt(r["request_throughput"]),
                _fmt(r["output_throughput"]),
                _fmt(r["total_token_throughput"]),
                goodput,
            ]
        ],
    )
    return lines


def _seconds(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def _startup(r: dict) -> list[str]:
    build, ready = r.get("build_timings", {}), r.get("ready_breakdown", {})
    engine = ready.get("engine_timings") or {}
    c = r.get("build_compile", {})
    lines = [
        "Two processes, as a user runs them: `compile-engine build` into an empty artifact "
        "(fresh Inductor cache), then a new process constructing `LLM(artifact)` until it is "
        "ready to serve (from interpreter start).",
        "",
    ]
    rows = [
        ["cold build (whole process)", _seconds(r.get("cold_build_s"))],
        ["  load weights", _seconds(build.get("load_s"))],
        ["  Dynamo trace + passes", _seconds(build.get("trace_and_passes_s"))],
        ["  Inductor compile", _seconds(build.get("compile_s"))],
        ["  build total (in process)", _seconds(build.get("total_s"))],
        ["ready from the artifact (whole process)", _seconds(r.get("startup_ready_s"))],
    ]
    if "warm_up_s" in build:
        rows.insert(
            4, ["  run every CUDA-graph size (Triton kernels)", _seconds(build["warm_up_s"])]
        )
    if "ready_phases" in r:  # disjoint phases, from bench startup at 898f03e on
        rows += [[f"  {_PHASES.get(k, k)}", _seconds(v)] for k, v in r["ready_phases"].items()]
        if "weights_wait_s" in r["ready_phases"]:  # the read overlaps the phases above
            beside = _seconds(r.get("weights_read_in_engine_s"))
            rows.append(["  (weight read, on a thread beside them)", beside])
            rows.append(["weight read alone (own process)", _seconds(r.get("weights_read_s"))])
        minus = _seconds(r.get("startup_ready_minus_weights_s"))
        rows.append(["ready minus the weight read", minus])
        if "warm_ready_s" in r:  # a second start, finding what the first cached
            rows += [
                ["second start from the artifact (warm)", _seconds(r["warm_ready_s"])],
                ["  minus the weight read", _seconds(r["warm_ready_minus_weights_s"])],
            ]
        lines += _table(["stage", "seconds"], rows)
        return lines + _startup_notes(r, c, ready)
    rows.append(["  Python start + `import runtime`", _seconds(ready.get("import_s"))])
    for key, label in (
        ("weights_s", "weights"),
        ("tokenizer_s", "tokenizer"),
        ("kv_cache_s", "memory profile + KV cache allocation"),
    ):
        if key in engine:
            rows.append([f"  {label}", _seconds(engine[key])])
    rows.append(
        ["  trace + compile from the artifact", _seconds(ready.get("compile_from_artifact_s"))]
    )
    if ready.get("graph_capture_s") is not None:
        rows.append(["  CUDA graph capture", _seconds(ready["graph_capture_s"])])
    if not engine:
        rows.append(["  (weights, tokenizer, KV cache: not split out by this run)", "—"])
    lines += _table(["stage", "seconds"], rows)
    return lines + _startup_notes(r, c, ready)


_PHASES = {
    "import_s": "`import runtime` (torch)",
    "artifact_check_s": "artifact manifest check",
    "cuda_init_s": "CUDA context",
    "model_config_s": "model config (imports transformers)",
    "model_init_s": "model config + construction (storage uninitialised)",
    "weights_s": "weight read",
    "weights_wait_s": "waiting for the weight read (a thread since 2026-11-30)",
    "tokenizer_s": "tokenizer",
    "activation_profile_s": "activation memory profile",
    "kv_cache_s": "KV cache allocation",
    "compile_s": "trace + compile from the artifact",
    "cuda_graphs_s": "CUDA graph capture",
    "gc_s": "garbage collection + freeze",
    "unaccounted_s": "not in any phase",
}


def _startup_notes(r: dict, c: dict, ready: dict) -> list[str]:
    lines = []
    pieces = "; ".join(
        f"{p['nodes']} nodes {p['seconds']:.2f} s, used x{p['reused_by'] + 1}"
        for p in c.get("pieces", [])
    )
    graphs = "no CUDA graphs"
    if ready.get("num_graphs"):
        graphs = f"{ready['num_graphs']} CUDA graphs in a {ready['graph_pool_gib']:.3f} GiB pool"
    lines += [
        "",
        f"Build: {c.get('num_pieces')} pieces ({c.get('num_attention_pieces')} attention), "
        f"{c.get('num_compiled_pieces')} compiled by Inductor ({pieces}). At load: "
        f"{r.get('inductor_compiles_at_load')} Inductor compiles, {graphs}; ready / cold build "
        f"= {r.get('load_over_cold_build')}.",
    ]
    caches = ready.get("inductor_caches")
    if caches:
        split = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in ready["compile_breakdown"].items())
        lines[-1] += (
            f" {caches['aot_autograd_hits']} pieces came whole from AOTAutograd's cache; "
            f"{r.get('triton_kernels_compiled_at_load')} Triton kernels were compiled at load. "
            f"Trace + compile from the artifact, s: {split}."
        )
    return lines


def _paged_attention_prefill(r: dict) -> list[str]:
    """Prefill chunks: the query-tiled kernel against the single-token one and the reference."""
    lines = [
        f"Prefill chunks, {r['shapes'].get('dtype')}; FLOPs counted: {r['flops_counted']}. "
        f"Timing: {r['timing']} ({r['iters']} iters).",
        "",
    ]
    header = ["chunks x tokens", "context", "tiled ms (TFLOP/s)", "single-token ms (TFLOP/s)"]
    header += ["reference ms", "tiled speed-up"]

    def cell(m: dict | None) -> str:
        return "—" if m is None else f"{m['ms']:.3f} ({m['tflops']:.0f})"

    rows = [
        [
            f"{x['chunks']} x {x['chunk_len']}",
            f"{x['context']:,}",
            cell(x.get("tiled")),
            cell(x.get("untiled")),
            cell(x.get("reference")),
            f"{x['tiled_speedup']:.1f}x" if x.get("tiled_speedup") else "—",
        ]
        for x in r["rows"]
    ]
    return lines + _table(header, rows)


def _paged_attention(r: dict) -> list[str]:
    s = r.get("shapes", {})
    lines = [
        f"Decode (q_len {s.get('q_len')}), {s.get('dtype')}, {s.get('num_q_heads')} query / "
        f"{s.get('num_kv_heads')} KV heads, head_dim {s.get('head_dim')}, block "
        f"{s.get('block_size')}. Bytes counted: {r.get('bytes_counted')}; % of the "
        f"{r.get('peak_gb_s'):,.0f} GB/s copy rate. Timing: {r.get('timing')} "
        f"({r.get('iters')} iters).",
        "",
    ]
    rows = []
    for x in r.get("rows", []):
        ours, eager, ref = x["ours"], x.get("ours_eager", {}), x["reference"]
        rows.append(
            [
                str(x["batch"]),
                f"{x['context']:,}",
                str(x["num_splits"]),
                f"{ours['ms']:.3f}",
                f"{ours['gb_s']:,.0f}",
                f"{ours['pct_of_peak']:.1f}%",
                f"{eager['ms']:.3f}" if eager else "—",
                f"{ref['ms']:.3f}",
                f"{x['speedup']:.1f}x",
            ]
        )
    lines += _table(
        [
            "batch",
            "context",
            "splits",
            "ours ms (graph)",
            "ours GB/s",
            "of copy rate",
            "ours ms (launches)",
            "reference ms",
            "speed-up",
        ],
        rows,
    )
    return lines


def _fusions(r: dict) -> list[str]:
    """One row per (op, T): microseconds (and GB/s) of each variant, the kernels' speed-up over
    Inductor's fusion of the reference, then each pass's verdict (its default-on condition)."""
    s = r.get("shapes", {})
    lines = [
        f"Llama-3-8B shapes ({s.get('dtype')}): hidden {s.get('hidden')}, "
        f"{s.get('num_q_heads')} / {s.get('num_kv_heads')} heads of {s.get('head_dim')}, "
        f"intermediate {s.get('intermediate')}. Inductor: {r.get('inductor')}. Timing: "
        f"{r.get('timing')}. Bytes: {r.get('bytes_counted')}.",
        "",
    ]
    variants = ("inductor", "triton", "helion", "eager")

    def cell(m: dict | None) -> str:
        if not m:
            return "—"
        if "us" not in m:
            return "failed"
        x = f" (x{m['speedup_vs_inductor']:.2f})" if "speedup_vs_inductor" in m else ""
        return f"{m['us']:.2f} us, {m['gb_s']:,.0f} GB/s{x}"

    rows = [[x["op"], str(x["T"])] + [cell(x.get(v)) for v in variants] for x in r["rows"]]
    lines += _table(["op", "T", *variants], rows)
    verdicts = r.get("verdicts", {})
    if verdicts:
        lines.append("")
        for name, v in verdicts.items():
            word = "beats" if v["beats_inductor_at_every_T"] else "does not beat"
            speedups = ", ".join(
                f"T={t}: x{x:.2f}" if x is not None else f"T={t}: —"
                for t, x in v["speedup_vs_inductor"].items()
            )
            lines.append(f"- `{name}` {word} Inductor at every T ({speedups}).")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench render", description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", default=str(DEFAULT_DIRECTORY))
    p.add_argument("--output", default=str(DEFAULT_OUTPUT))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = load_results(args.results_dir)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = targets.plot_svg(results)
    plot_path = out.with_suffix(".svg")
    if plot is not None:
        plot_path.write_text(plot)
        print(f"wrote {plot_path}")
    previous = out.read_text() if out.exists() else ""
    out.write_text(render(results, plot_path.name if plot is not None else None, previous))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
