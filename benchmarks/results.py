"""One JSON file per benchmark run: what ran, on which commit, on what, and the numbers.

The payload uses flat keys where they apply so that docs/performance.md can be rendered from
any mix of runs without knowing which script wrote what. A reader must be able to reproduce a
number from its file alone, hence the command line, commit, device and versions.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIRECTORY = REPO_ROOT / "benchmarks" / "results"

# The keys issue 7's targets are stated in; render.py tabulates exactly these.
FLAT_KEYS = (
    "decode_bs1_tok_s",
    "decode_bs64_tok_s",
    "decode_bs256_tok_s",
    "offline_output_tok_s",
    "serve_output_tok_s",
    "startup_ready_s",
)

# Packages whose version changes a number. Looked up in the installed metadata, never imported:
# importing helion 1.5 on torch 2.11 fails, and importing triton on a CPU box is slow.
_PACKAGES = ("torch", "triton", "transformers", "helion", "safetensors")

# The GPU machine's tree is a copy without .git; whoever runs there names the commit.
COMMIT_ENV = "COMPILE_ENGINE_COMMIT"

# Environment switches that change what runs (ours, Inductor's, Triton's): a run with
# TORCHINDUCTOR_ENABLE_PDL=1 must not read as the defaults. Not the places caches live.
_SETTING_PREFIXES = ("COMPILE_ENGINE_", "TORCHINDUCTOR_", "TRITON_")
_NOT_SETTINGS = {
    COMMIT_ENV,
    "COMPILE_ENGINE_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
}


def environment_settings(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The switches set in `environ` (the process environment by default)."""
    env = os.environ if environ is None else environ
    return {
        k: v
        for k, v in sorted(env.items())
        if k.startswith(_SETTING_PREFIXES) and k not in _NOT_SETTINGS
    }


# As the benchmark process started: the engine later sets some itself (Triton's ptxas, see
# compiler/config.py), which are not the user's choice.
LAUNCH_SETTINGS = environment_settings()


def git_state(root: Path = REPO_ROOT) -> tuple[str, bool | None]:
    """(commit, dirty); COMMIT_ENV wins when set (the GPU machine's copy of the tree carries
    stale git metadata), else git, else ('unknown', None)."""
    env = os.environ.get(COMMIT_ENV)
    if env:
        return env, None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return commit, bool(status.strip())
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(device: str | None = None) -> dict:
    """What the benchmark ran on. `device` is the engine's device type; None means CUDA when
    present (a CPU-target run on a GPU machine must pass 'cpu')."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    info: dict = {"type": device, "cpu": cpu_model(), "cpu_count": os.cpu_count()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=torch.cuda.get_device_name(0),
            memory_bytes=props.total_memory,
            capability=f"sm_{props.major}{props.minor}",
            cuda=torch.version.cuda,
        )
    else:
        # The vector ISA ATen's kernels run: "AMD EPYC" names a Zen 3 (AVX2) and a Zen 4
        # (AVX-512) alike, and the CPU kernels differ between the two.
        info["isa"] = torch.backends.cpu.get_cpu_capability()
        info["name"] = f"{info['cpu']} ({info['cpu_count']} cores, {info['isa']})"
    return info


def device_slug(info: dict) -> str:
    """'nvidia-h200', 'cpu-amd-epyc' (AVX-512) or 'cpu-amd-epyc-avx2': short, stable, safe in a
    file name; a CPU below AVX-512 is suffixed with its ISA."""
    base = info["name"] if info["type"].startswith("cuda") else "cpu-" + info["cpu"]
    base = re.sub(r"\((r|tm)\)", "", base.lower())
    base = re.sub(r"\bcpu @.*$|@.*$", "", base)
    slug = re.sub(r"[^a-z0-9]+", "-", base).strip("-")[:48].rstrip("-") or "unknown"
    isa = info.get("isa")
    if not info["type"].startswith("cuda") and isa and not isa.startswith("AVX512"):
        slug += "-" + isa.lower()
    return slug


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def command_line(argv: list[str] | None = None) -> str:
    """The command as one could paste it again from the repo root: `python -m
    compile_engine.benchmarks latency ...` is recorded as such rather than as the path of
    benchmarks/__main__.py (benchmarks/ is the package's compile_engine.benchmarks)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    try:
        script = Path(argv[0]).resolve().relative_to(REPO_ROOT)
    except ValueError:
        return shlex.join([Path(argv[0]).name, *argv[1:]])
    if script.suffix == ".py" and script.parts[0] == "benchmarks":
        parts = ("compile_engine", *script.with_suffix("").parts)
        module = ".".join(parts).removesuffix(".__main__")
        return shlex.join(["python", "-m", module, *argv[1:]])
    return shlex.join([str(script), *argv[1:]])


def write_result(
    name: str,
    payload: dict,
    directory: str | Path = DEFAULT_DIRECTORY,
    *,
    device: str | None = None,
) -> Path:
    """Write `<name>-<device-slug>-<commit>.json` (commit gets '-dirty' for an uncommitted
    tree, so a dirty run never overwrites the clean one) and return its path."""
    commit, dirty = git_state()
    info = device_description(device)
    record = {
        "name": name,
        "command": command_line(),
        "commit": commit,
        "dirty": dirty,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": info,
        "versions": versions(),
        "environment": LAUNCH_SETTINGS,
        **payload,
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tag = commit[:12] + ("-dirty" if dirty else "")
    path = directory / f"{name}-{device_slug(info)}-{tag}.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return path


def result_kind(r: dict) -> str:
    """The benchmark a result is from (`latency`, `serve`, ...), dashes as underscores."""
    return str(r.get("benchmark") or r.get("name") or "?").replace("-", "_")


def result_variant(r: dict) -> str:
    """The run's `--name` when it is not the benchmark's own (latency-nographs), else ''."""
    name = str(r.get("name") or "")
    return name if name and name.replace("-", "_") != result_kind(r) else ""


def result_model(r: dict) -> str:
    """The model's name: a path's last part; a model section (a dict, as in `bench mla`)
    names its preset; '' for a result with no model (an op benchmark)."""
    model = r.get("model")
    if not model:
        return ""
    if isinstance(model, dict):
        return str(model.get("preset") or model.get("name") or "model")
    return Path(str(model)).name


def print_table(rows: list[tuple[str, object]], title: str | None = None) -> None:
    """The short two-column table every benchmark prints."""
    if title:
        print(title)
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        if isinstance(value, float):
            value = f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
        print(f"  {key:<{width}}  {value}")
