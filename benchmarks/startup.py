"""`bench startup`: cold build versus a fresh process serving from the artifact.

Each phase runs in its own Python process, as a user would run it:

1. `compile-engine build MODEL --out ARTIFACT` into an empty artifact directory (cold: a fresh
   Inductor cache, nothing compiled before);
2. a new process that constructs `LLM(ARTIFACT)` and reports when it is ready to serve, with
   the time split into weights, compile-from-artifact and CUDA-graph capture, and whether
   Inductor compiled anything (it must not: every piece is a cache hit).

Writes `startup_ready_s` (the second process, from interpreter start) with the breakdown.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results import DEFAULT_DIRECTORY, write_result

_READY = """
import json, sys, time
t0 = time.perf_counter()
from runtime import LLM
t_import = time.perf_counter() - t0
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
ready = time.perf_counter() - t0
e = llm.engine
stats = e.compiled.backend.stats.as_dict() if e.compiled else None
graphs = e.runner.graphs
print("RESULT " + json.dumps({
    "ready_s": ready,
    "import_s": t_import,
    "compile_from_artifact_s": e.compiled.capture_seconds if e.compiled else None,
    "graph_capture_s": graphs.capture_seconds if graphs else None,
    "num_graphs": len(graphs.graphs) if graphs else 0,
    "graph_pool_gib": graphs.pool_bytes / 2**30 if graphs else 0,
    "pieces": stats["pieces"] if stats else [],
    "engine_timings": e.timings,
}))
"""


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=3600)


def bench_startup(model: str, target: str, dtype: str, out: Path | None, engine: dict) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ce-startup-"))
    artifact = out or work / "artifact"
    if artifact.exists():
        shutil.rmtree(artifact)
    start = time.perf_counter()
    build = run(
        [
            sys.executable,
            "-m",
            "runtime.cli",
            "build",
            model,
            "--target",
            target,
            "--dtype",
            dtype,
            "--out",
            str(artifact),
        ]
    )
    build_s = time.perf_counter() - start
    if build.returncode != 0:
        raise RuntimeError(f"build failed:\n{build.stderr[-3000:]}")
    manifest = json.loads((artifact / "manifest.json").read_text())
    ready = run([sys.executable, "-c", _READY, str(artifact), json.dumps(engine)])
    if ready.returncode != 0:
        raise RuntimeError(f"loading the artifact failed:\n{ready.stderr[-3000:]}")
    result = json.loads(ready.stdout.split("RESULT ", 1)[1])
    misses = [p for p in result["pieces"] if p["cache"] != "hit"]
    return {
        "model": model,
        "target": target,
        "cold_build_s": round(build_s, 2),
        "build_timings": manifest["timings"],
        "build_compile": manifest["compile"],
        "startup_ready_s": round(result["ready_s"], 2),
        "ready_breakdown": {k: v for k, v in result.items() if k not in ("pieces", "ready_s")},
        "inductor_compiles_at_load": len(misses),
        "load_over_cold_build": round(result["ready_s"] / build_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench startup", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--target", default="cpu", choices=["cpu", "h100"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default=None, help="artifact directory (default: a temp dir)")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--results-dir", default=str(DEFAULT_DIRECTORY))
    args = p.parse_args(argv)
    engine = {"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}
    out = Path(args.out) if args.out else None
    payload = bench_startup(args.model, args.target, args.dtype, out, engine)
    print(f"{'cold build':<28}{payload['cold_build_s']:>8.1f} s")
    print(f"{'ready from artifact':<28}{payload['startup_ready_s']:>8.1f} s")
    for k, v in payload["ready_breakdown"].items():
        if isinstance(v, float):
            print(f"  {k:<26}{v:>8.2f}")
    print(f"{'Inductor compiles at load':<28}{payload['inductor_compiles_at_load']:>8d}")
    path = write_result("startup", payload, directory=args.results_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
