"""runtime/progress.py: the start-up phases as plain lines off a terminal, each once, with
its count; and what the builder reports through it on a real (tiny) start."""

from __future__ import annotations

import io
import re

from compile_engine.runtime.engine import EngineConfig, LLMEngine
from compile_engine.runtime.progress import StartupProgress

from tiny_models import make_tiny_model


def test_plain_lines_one_per_finished_phase():
    out = io.StringIO()
    progress = StartupProgress("build", out, live=False)
    progress("compile", 1, 3)
    progress("compile", 3, 3)
    progress("compile", 3, 3)  # reported again after it ended: no second line
    progress("weights", 5, None)
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[0]]
    progress.close()  # what is open ends with its count as the total
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"\[build\] compile +3/3 in \d+\.\d s", lines[0])
    assert re.fullmatch(r"\[build\] weights +5/5 in \d+\.\d s", lines[1])


def test_the_live_display_draws_the_phases():
    out = io.StringIO()
    progress = StartupProgress(stream=out, live=True)
    progress("weights", 2, None)
    progress("weights", 2, 2)
    progress.close()
    assert "weights" in out.getvalue() and "2/2" in out.getvalue()


def test_a_start_reports_the_weight_read_and_the_compile(tmp_path):
    make_tiny_model("llama", tmp_path)
    seen: dict[str, list[tuple[int, int | None]]] = {}

    def progress(task: str, done: int, total: int | None) -> None:
        seen.setdefault(task, []).append((done, total))

    LLMEngine(EngineConfig(model=str(tmp_path), target="cpu", dtype="float32"), progress=progress)
    weights = seen["weights"]
    assert weights[-1][0] == weights[-1][1] > 0  # all read: the count is the total
    assert [d for d, _ in weights] == sorted(d for d, _ in weights)
    compile_ = seen["compile"]
    assert compile_[-1][0] == compile_[-1][1] == len(compile_)  # one report a piece
