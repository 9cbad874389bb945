"""Progress of start-up's long phases (weights, compiling, CUDA graphs) for the command line.

The layers below take a plain callback, `progress(task, done, total)` (total None while it is
unknown), so none of them imports this: the builder hands it to the weight read, the compiler's
backend and the CUDA-graph capture. On a terminal the phases show as a live rich display; in a
log (not a terminal) each finished phase is one plain line with its count and time. A phase is
finished when `done` reaches `total`.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from compile_engine.runtime.engine import EngineConfig, LLMEngine


class StartupProgress:
    """The callable the builder passes down; `close()` ends the display (finishing what is
    still open)."""

    def __init__(
        self, label: str = "start", stream: TextIO | None = None, *, live: bool | None = None
    ) -> None:
        self.label = label  # what the plain lines start with: [start], [build]
        self.stream = stream or sys.stderr
        self._lock = threading.Lock()  # the weight read reports from its own thread
        self._started: dict[str, float] = {}
        self._counts: dict[str, tuple[int, int | None]] = {}
        self._ended: set[str] = set()
        self._display = None
        self._rich_tasks: dict[str, object] = {}
        if live if live is not None else self.stream.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._display = Progress(
                SpinnerColumn(),
                TextColumn("{task.description:<12}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
            )
            self._display.start()

    def __call__(self, task: str, done: int, total: int | None = None) -> None:
        with self._lock:
            if task in self._ended:
                return
            self._started.setdefault(task, time.perf_counter())
            self._counts[task] = (done, total)
            if self._display is not None:
                if task not in self._rich_tasks:
                    self._rich_tasks[task] = self._display.add_task(task, total=total)
                self._display.update(self._rich_tasks[task], completed=done, total=total)
            if total is not None and done >= total:
                self._end(task)

    def finish(self, task: str) -> None:
        """The phase is over: its count so far is its total."""
        with self._lock:
            if task in self._started and task not in self._ended:
                done, _ = self._counts[task]
                self._counts[task] = (done, done)
                if self._display is not None:
                    self._display.update(self._rich_tasks[task], completed=done, total=done)
                self._end(task)

    def close(self) -> None:
        for task in list(self._started):
            self.finish(task)
        if self._display is not None:
            self._display.stop()
            self._display = None

    def _end(self, task: str) -> None:
        self._ended.add(task)
        if self._display is None:
            done, total = self._counts[task]
            seconds = time.perf_counter() - self._started[task]
            line = f"[{self.label}] {task:<13} {done}/{total} in {seconds:.1f} s"
            print(line, file=self.stream, flush=True)


def start_engine(config: EngineConfig) -> LLMEngine:
    """An engine started as the command line starts one: its long phases shown on stderr as
    they run (a live display on a terminal, a line each otherwise), then a line saying when it
    was ready."""
    progress = StartupProgress()
    try:
        engine = LLMEngine(config, progress=progress)
    finally:
        progress.close()
    print(f"[start] ready in {engine.timings['ready_s']:.1f} s", file=sys.stderr)
    return engine
