"""Issue 7's targets against our latest H200 runs: the table at the top of docs/performance.md
and its plot (an SVG written beside the page, no plotting library needed).

"Latest" is per row: the newest run (by its timestamp) on an H200, on the Llama-3-8B-shaped
model, not a named variant, that carries the row's key. Rows can therefore come from different
commits and machines; the table says which run each number is from. Peers' numbers are the
ones BRIEF.md records (same H200 model, 2026-11-29).
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

from compile_engine.benchmarks.results import result_kind, result_model, result_variant

# The peers, measured on the H200 with Llama-3-8B-shaped random bf16 weights (BRIEF.md).
VLLM = "vLLM 0.26.0"
STATIC = "static-cache torch.compile"
PEERS: dict[str, dict[str, float]] = {
    STATIC: {
        "decode_bs1_tok_s": 199,
        "decode_bs64_tok_s": 6_572,
        "decode_bs256_tok_s": 10_629,
        "cold_build_s": 104,
    },
    VLLM: {
        "decode_bs1_tok_s": 204,
        "decode_bs64_tok_s": 10_250,
        "decode_bs256_tok_s": 21_428,
        "offline_output_tok_s": 9_778,
        "cold_build_s": 162,
    },
}


@dataclass(frozen=True, slots=True)
class Target:
    key: str
    label: str
    bound: float | None  # None: reported, no target
    higher_is_better: bool = True
    short: str = ""  # the plot's label
    percent: bool = False  # the key is a fraction, shown as a percentage

    def show(self, value: float) -> str:
        return f"{value:.1%}" if self.percent else number(value)

    def met(self, value: float) -> bool | None:
        if self.bound is None:
            return None
        return value >= self.bound if self.higher_is_better else value <= self.bound

    @property
    def text(self) -> str:
        if self.bound is None:
            return "— (reported)"
        return f"{'>=' if self.higher_is_better else '<='} {self.show(self.bound)}"


TARGETS = (
    Target("decode_bs1_tok_s", "decode batch 1, tok/s", 250, short="decode, batch 1"),
    Target("decode_bs64_tok_s", "decode batch 64, tok/s", 13_000, short="decode, batch 64"),
    Target("decode_bs256_tok_s", "decode batch 256, tok/s", 30_000, short="decode, batch 256"),
    Target(
        "offline_output_tok_s",
        "offline 1000 x (512 in / 256 out), output tok/s",
        12_500,
        short="offline, output",
    ),
    Target("serve_output_tok_s", "serve 512/256 at concurrency 256, output tok/s", None),
    Target("startup_ready_minus_weights_s", "serve ready besides the weight read, s", 10, False),
    Target("cold_build_s", "cold build, s", 90, False),
    Target(
        "structured_overhead_bs64",
        "output throughput lost with every request under a JSON schema, batch 64",
        0.05,
        False,
        percent=True,
    ),
    Target("grammar_mask_p99_ms", "one sequence's grammar mask, 128k vocabulary, p99 ms", 1, False),
    Target(
        "spec_ceiling_speedup_bs1_k4",
        "speculation, every draft accepted (replay, benchmark-only), k = 4, batch 1, speed-up",
        3.2,
    ),
    Target(
        "spec_zero_accept_cost_bs1",
        "speculation, no draft accepted (replay, benchmark-only), batch 1, tok/s lost",
        0.03,
        False,
        percent=True,
    ),
    Target("spec_zero_accept_speedup_bs256", "speculation, none accepted, batch 256", 0.98),
    Target("spec_ceiling_speedup_bs256_k4", "speculation, all accepted, batch 256", 0.98),
)
PLOTTED = ("decode_bs1_tok_s", "decode_bs64_tok_s", "decode_bs256_tok_s", "offline_output_tok_s")


def number(value: float) -> str:
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.1f}" if abs(value) >= 1 else f"{value:.2g}"  # 0.034 ms, not 0.0


def is_llama3_8b_shape(run: dict) -> bool:
    m = run.get("model_config") or {}
    shape = ("hidden_size", "num_layers", "num_kv_heads", "intermediate_size", "vocab_size")
    return tuple(m.get(k) for k in shape) == (4096, 32, 8, 14336, 128256)


def _on_h200(run: dict) -> bool:
    device = run.get("device") or {}
    return "H200" in str(device.get("name", "")) if isinstance(device, dict) else False


def comparable_runs(results: list[dict]) -> list[dict]:
    """H200 runs of no named variant on a model that some H200 run with a Llama-3-8B-shaped
    `model_config` used (the runs that record no config, serve and startup, are matched by
    those models' names), oldest first. Every such model runs the same shapes: bench
    speculative --replay's has constant logits (make-model --constant-logits), the others
    random ones."""
    shaped = [r for r in results if _on_h200(r) and is_llama3_8b_shape(r)]
    models = {result_model(r) for r in shaped}
    runs = [
        r for r in results if _on_h200(r) and result_model(r) in models and not result_variant(r)
    ]
    return sorted(runs, key=lambda r: str(r.get("timestamp", "")))


def latest(results: list[dict]) -> dict[str, tuple[float, dict]]:
    """{key: (value, run)}: each target's key from the newest comparable run carrying it."""
    found: dict[str, tuple[float, dict]] = {}
    for run in comparable_runs(results):  # oldest first: newer runs overwrite
        for target in TARGETS:
            value = run.get(target.key)
            if isinstance(value, int | float):
                found[target.key] = (float(value), run)
    return found


def _run_name(run: dict) -> str:
    return f"{result_kind(run)} @ `{run.get('commit', '?')}`"


def table(results: list[dict], plot_file: str | None) -> list[str]:
    """Markdown: each target's row from its latest comparable run, the peers, met or not."""
    values = latest(results)
    if not values:
        return []
    lines = [
        "## Against the targets (latest H200 run of each row)",
        "",
        "Each row's number is the newest run on an H200 with the Llama-3-8B-shaped model that "
        "carries it (not a named variant); rows can come from different commits and machines, "
        "and the same code has read a few percent apart on different H200s (docs/compiler.md, "
        '"Machines differ").',
        "",
        f"| metric | ours | run | {VLLM} | {STATIC} | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for target in TARGETS:
        if target.key not in values:
            continue
        value, run = values[target.key]
        met = target.met(value)
        peers = [PEERS[p].get(target.key) for p in (VLLM, STATIC)]
        cells = [
            target.label,
            f"**{target.show(value)}**",
            _run_name(run),
            *(number(p) if p is not None else "—" for p in peers),
            target.text,
            "—" if met is None else ("yes" if met else "**no**"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if plot_file:
        lines += ["", f"![ours and the peers as a share of each target]({plot_file})"]
    return lines + [""]


# --------------------------------------------------------------------------- the plot

_COLOURS = {"ours": "#1f77b4", VLLM: "#ff7f0e", STATIC: "#2ca02c", "HF eager (same run)": "#888"}


def plot_svg(results: list[dict]) -> str | None:
    """Horizontal bars, a group per throughput target: ours, vLLM, static-cache compile and HF
    eager (from our decode run itself) as a percentage of the target, a dashed line at 100%.
    None when no comparable run carries a plotted key."""
    values = latest(results)
    rows = [t for t in TARGETS if t.key in PLOTTED and t.key in values]
    if not rows:
        return None
    groups = []
    for target in rows:
        value, run = values[target.key]
        bars = [("ours", value)]
        bars += [
            (peer, PEERS[peer][target.key]) for peer in (VLLM, STATIC) if target.key in PEERS[peer]
        ]
        hf = run.get(f"hf_eager_{target.key}")
        if isinstance(hf, int | float):
            bars.append(("HF eager (same run)", float(hf)))
        groups.append((target, [(name, v, 100 * v / target.bound) for name, v in bars]))
    top = max(110.0, max(pct for _, bars in groups for _, _, pct in bars) * 1.05)
    left, width, bar, gap = 250, 420, 14, 12
    height = 40 + sum(len(bars) * bar + gap for _, bars in groups) + 30
    x = lambda pct: left + width * pct / top  # noqa: E731
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 130}" '
        f'height="{height}" font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{left}" y="16" font-size="13">Share of issue 7\'s target (H200, '
        "Llama-3-8B shape, bf16)</text>",
    ]
    legend_x = left
    for name, colour in _COLOURS.items():
        out.append(f'<rect x="{legend_x}" y="24" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{legend_x + 14}" y="33">{escape(name)}</text>')
        legend_x += 14 + 7 * len(name) + 12
    y = 44
    for target, bars in groups:
        label = f"{target.short} (target {number(target.bound)} tok/s)"
        mid = y + len(bars) * bar / 2 + 4
        out.append(f'<text x="{left - 8}" y="{mid:.0f}" text-anchor="end">{escape(label)}</text>')
        for name, value, pct in bars:
            out.append(
                f'<rect x="{left}" y="{y}" width="{x(pct) - left:.1f}" height="{bar - 2}" '
                f'fill="{_COLOURS[name]}"><title>{escape(name)}: {number(value)}</title></rect>'
            )
            out.append(
                f'<text x="{x(pct) + 4:.1f}" y="{y + bar - 4}">{number(value)} ({pct:.1f}%)</text>'
            )
            y += bar
        y += gap
    out.append(
        f'<line x1="{x(100):.1f}" y1="40" x2="{x(100):.1f}" y2="{y}" stroke="black" '
        'stroke-dasharray="4 3"/>'
    )
    out.append(f'<text x="{x(100):.1f}" y="{y + 14}" text-anchor="middle">100% of target</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
