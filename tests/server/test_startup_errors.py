"""Start-up mistakes end with one line and the right exit code (issue 31): no traceback, no
abort from a thread still reading weights, and a port that cannot be had refused before the
model loads. Each case runs `compile-engine` as a process on a tiny random model."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny_models import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", directory)
    return str(directory)


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "compile_engine", *args]
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


def one_line_error(result: subprocess.CompletedProcess, code: int, match: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr and "terminate called" not in result.stderr
    assert any(match in line for line in lines), result.stderr
    last = lines[-1]  # "compile-engine: error: ..." or argparse's "compile-engine serve: error:"
    assert last.startswith("compile-engine") and ": error: " in last, last


def test_a_setting_the_model_refuses_ends_before_the_weight_read_with_no_abort(tiny):
    # The case that aborted (exit 134): the error came while the weights were being read on a
    # thread. A process of its own, to see the exit status.
    flags = ["--target", "cpu", "--enforce-eager", "--max-model-len", "99999"]
    one_line_error(run("serve", tiny, *flags), 1, "max_model_len=99999 exceeds what the model")


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--passes", "+nosuchpass"], "unknown pass 'nosuchpass'"),
        (["--num-kv-blocks", "1"], "num_kv_blocks=1 is invalid: must be an integer >= 2"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization=1.5 is invalid"),
        (["--dtype", "float64"], "dtype='float64' is not supported"),
        (["--kernel-config", "{pdl: off"], "is not JSON"),
    ],
)
def test_a_setting_that_cannot_work_is_one_line_and_exit_1(tiny, flags, match, capsys):
    # Refused before anything loads, so in this process: the same main() the script runs.
    from compile_engine.cli import main

    code = main(["serve", tiny, "--target", "cpu", "--enforce-eager", *flags])
    err = capsys.readouterr().err
    result = subprocess.CompletedProcess([], code, "", err)
    one_line_error(result, 1, match)


def test_a_flag_argparse_refuses_is_a_usage_error_exit_2(tiny):
    result = run("serve", tiny, "--port", "80000")
    one_line_error(result, 2, "80000 is not a TCP port")


def test_a_port_in_use_is_refused_before_the_model_loads(tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = run("serve", tiny, "--target", "cpu", "--port", str(port))
        elapsed = time.monotonic() - started
    one_line_error(result, 1, "choose another --port")
    # Bound first: no model load, no compile (the tiny model's compile alone takes longer).
    assert "engine ready" not in result.stderr, elapsed


def test_log_options_before_or_after_the_subcommand_and_bench_help():
    assert run("passes", "-v").returncode == 0
    assert run("--log-level", "debug", "passes").returncode == 0
    assert run("passes", "--log-level", "INFO").returncode == 0
    one_line_error(run("passes", "--log-level", "loud"), 2, "invalid choice")
    listing = run("bench", "--help")
    assert listing.returncode == 0 and "latency" in listing.stdout
    latency = run("bench", "latency", "--help")
    assert latency.returncode == 0 and "--batch-sizes" in latency.stdout
