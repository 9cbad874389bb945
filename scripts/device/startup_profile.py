"""cProfile of LLM(<artifact>) from a fresh interpreter, as `compile-engine serve` starts it
(the bytecode cache first). Usage: startup_profile.py ARTIFACT [OUT_DIR | --no-profile];
writes OUT_DIR/load.prof and OUT_DIR/load_prof.txt (top functions by cumulative and own time)."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.getcwd())


def main(artifact: str, out: str | None) -> None:
    t0 = time.perf_counter()
    prof = cProfile.Profile() if out else None
    if prof:
        prof.enable()
    from compile_engine.runtime import bytecode_cache

    bytecode_cache.enable()
    from compile_engine.runtime.llm import LLM

    llm = LLM(artifact)
    if prof:
        prof.disable()
        prof.dump_stats(os.path.join(out, "load.prof"))
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("cumulative").print_stats(120)
        stats.sort_stats("tottime").print_stats(60)
        with open(os.path.join(out, "load_prof.txt"), "w") as f:
            f.write(buf.getvalue())
    print(f"LLM(artifact) in {time.perf_counter() - t0:.2f} s; phases {llm.engine.timings}")


if __name__ == "__main__":
    target = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OUT", "/tmp")
    main(sys.argv[1], None if target == "--no-profile" else target)
