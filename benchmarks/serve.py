"""`bench serve`: online serving against an OpenAI-compatible server, with vLLM's metrics.

The shape of vLLM's `bench serve`: N requests, each a streaming POST to /v1/completions, sent
by a Poisson arrival process (`--request-rate`, inf = all at once) and/or capped at
`--max-concurrency` requests in flight. Prompts are random token-id lists, so input lengths are
exact and no two prompts share a prefix; `ignore_eos` makes every output exactly its asked
length. The server is one already running (`--base-url`) or, with `--launch`, our own
`compile-engine serve` started here with the engine flags and stopped at the end.

Per request the client records when it sent the request and when each chunk that carries a
choice arrived (the final usage-only chunk and `[DONE]` do not count). From those, as vLLM
defines them:

- TTFT: first chunk - send.  E2EL: last chunk - send.
- ITL: every gap between successive chunks of a request, all requests pooled.
- TPOT: per request (E2EL - TTFT) / (output tokens - 1), for requests of more than one token.
- output tokens: the server's `usage.completion_tokens` (stream_options.include_usage).
- duration: first send opportunity to the last response; request, output-token and total-token
  throughput are completed requests, their output tokens and their prompt + output tokens over
  it. Goodput is the requests/s that met every SLO given with `--goodput` (TPOT counts as 0 for
  one-token outputs). Failed requests count in none of these.

TTFT and ITL are per token only when every chunk carries one token. Our server sends a chunk
when a token adds text, so a model without a tokenizer streams one chunk at the end; the run
then reports tokens per chunk > 1 and warns. `add_word_tokenizer` gives a random-weight model a
one-word-per-token tokenizer for that reason (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from compile_engine.benchmarks.common import add_engine_flags, random_prompts, sampled_lengths
from compile_engine.benchmarks.results import REPO_ROOT, print_table, write_result

# Besides mean and median: vLLM reports p99; p90 is what SLO discussions often use.
PERCENTILES = (90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")
# Tokens per chunk up to which a stream counts as one chunk per token: a token whose text is held
# back (half a UTF-8 character) rides in the next chunk, a finish-only chunk adds one.
PER_TOKEN_TOLERANCE = 1.05
# Counters read off /metrics before and after the timed run (the difference is reported).
_SERVER_COUNTERS = {
    "num_preemptions_total": "preemptions",
    "generation_tokens_total": "generation_tokens",
    "prompt_tokens_total": "prompt_tokens",
    # Ours (runtime/metrics.py): the engine's steps, and whether the host or the device bounds them.
    "engine_steps_total": "steps",
    "engine_step_tokens_total": "step_tokens",
    "engine_graph_steps_total": "graph_steps",
    "engine_busy_seconds_total": "busy_s",
    "engine_device_wait_seconds_total": "device_wait_s",
}


def step_summary(counters: dict[str, float]) -> dict[str, float] | None:
    """The timed requests' engine steps from our server's counters (None from another server):
    tokens a step, the share replayed from CUDA graphs, the engine thread's time a step, and
    the share of it spent waiting for the device (near 1: device-bound; near 0: host-bound)."""
    steps = counters.get("steps")
    if not steps:
        return None
    busy = counters.get("busy_s", 0.0)
    return {
        "steps": int(steps),
        "tokens_per_step": round(counters.get("step_tokens", 0.0) / steps, 1),
        "graph_step_share": round(counters.get("graph_steps", 0.0) / steps, 4),
        "busy_ms_per_step": round(1000 * busy / steps, 3),
        "device_wait_share": round(counters.get("device_wait_s", 0.0) / busy, 4) if busy else 0.0,
    }


class ServeBenchError(RuntimeError):
    """The benchmark cannot run as asked; the message says what to change."""


# -- requests and their timings ---------------------------------------------------------------


@dataclass(slots=True)
class RequestSpec:
    prompt: list[int]
    output_len: int


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. Times are time.perf_counter() seconds."""

    prompt_len: int
    output_len: int  # asked for
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    usage_tokens: int | None = None  # the server's completion_tokens
    text: str = ""
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        """The server's count; without usage in the stream, one token per chunk."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float:
        """0 for a one-token output, as in vLLM's goodput (it has no decode phase)."""
        n = self.output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else 0.0


# -- metrics (pure functions of the results) --------------------------------------------------


def _percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    k = (len(sorted_values) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def summarize_ms(seconds: list[float]) -> dict[str, float | None]:
    """mean, median, std and PERCENTILES of `seconds`, in milliseconds; None when empty."""
    keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES)]
    if not seconds:
        return dict.fromkeys(keys)
    ms = sorted(s * 1000 for s in seconds)
    mean = sum(ms) / len(ms)
    out = {
        "mean": mean,
        "median": _percentile(ms, 50),
        "std": math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms)),
    }
    out.update({f"p{p}": _percentile(ms, p) for p in PERCENTILES})
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or name not in SLO_METRICS or not ms > 0:
            raise ServeBenchError(
                f"--goodput {item!r} is invalid: give METRIC:MILLISECONDS with METRIC one of "
                f"{', '.join(SLO_METRICS)} and a positive number, e.g. ttft:500 tpot:50"
            )
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return all(values[name] * 1000 <= ms for name, ms in slos_ms.items())


def compute_metrics(
    results: list[RequestResult], duration_s: float, slos_ms: dict[str, float] | None = None
) -> dict:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    metrics = {
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        # Requests whose output length differs from what was asked (ignore_eos not honoured,
        # a stop, or a server that caps max_tokens): their timings still count.
        "num_output_len_mismatch": sum(r.output_tokens != r.output_len for r in ok),
        "tokens_per_chunk": output_tokens / chunks if chunks else None,
        # False when streams bunch tokens into chunks: TTFT, TPOT and ITL are then not per token.
        "per_token_stream": bool(chunks) and output_tokens <= PER_TOKEN_TOLERANCE * chunks,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": summarize_ms([r.ttft for r in ok]),
        "tpot_ms": summarize_ms([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": summarize_ms([gap for r in ok for gap in r.itl]),
        "e2el_ms": summarize_ms([r.e2el for r in ok]),
        "goodput_slos_ms": dict(slos_ms or {}),
        "request_goodput": None,
    }
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in ok)
        metrics["request_goodput"] = good / duration_s
    return metrics


# -- datasets ---------------------------------------------------------------------------------

# ShareGPT-shaped lengths: log-normal input and output lengths with the filter vLLM applies to
# ShareGPT (both >= 4 tokens, prompt <= 1024, prompt + output <= 2048). Parameters are ours, set
# so the filtered means land near 220 input and 190 output tokens with a long right tail, the
# shape of vLLM's ShareGPT sample with Llama tokenizers; they are not fitted to the data.
SHAREGPT_INPUT_MEDIAN, SHAREGPT_INPUT_SIGMA = 160.0, 1.05
SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_SIGMA = 125.0, 0.95


def sharegpt_synthetic_lengths(n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    inputs, outputs = [], []
    while len(inputs) < n:
        i = round(rng.lognormvariate(math.log(SHAREGPT_INPUT_MEDIAN), SHAREGPT_INPUT_SIGMA))
        o = round(rng.lognormvariate(math.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA))
        if i < 4 or o < 4 or i > 1024 or i + o > 2048:
            continue
        inputs.append(i)
        outputs.append(o)
    return inputs, outputs


def make_requests(
    dataset: str,
    num_prompts: int,
    vocab_size: int,
    rng: random.Random,
    *,
    input_len: int = 512,
    output_len: int = 256,
    range_ratio: float = 0.0,
) -> list[RequestSpec]:
    if dataset == "random":
        in_lens = sampled_lengths(num_prompts, input_len, range_ratio, rng)
        out_lens = sampled_lengths(num_prompts, output_len, range_ratio, rng)
    elif dataset == "sharegpt-synthetic":
        in_lens, out_lens = sharegpt_synthetic_lengths(num_prompts, rng)
    else:
        raise ServeBenchError(f"unknown dataset {dataset!r}; use random or sharegpt-synthetic")
    prompts = random_prompts(num_prompts, in_lens, vocab_size, rng)
    return [RequestSpec(p, o) for p, o in zip(prompts, out_lens, strict=True)]


def vocab_size_of(model: str) -> int:
    """The vocabulary of an HF directory, or of the model an artifact was built from."""
    path = Path(model)
    candidates = [path]
    manifest = path / "manifest.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        candidates += [Path(p) for p in (data.get("weights_path"), data.get("model_path")) if p]
    for directory in candidates:
        config = directory / "config.json"
        if config.is_file():
            data = json.loads(config.read_text())
            vocab = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
            if vocab:
                return int(vocab)
    raise ServeBenchError(
        f"cannot read the vocabulary size of {model!r} (no config.json): pass --vocab-size"
    )


def add_word_tokenizer(model: str | Path) -> Path | None:
    """Give a tokenizer-less model (bench make-model writes none) a tokenizer in which token i
    is the word `t{i}`, so every token decodes to text and streams as its own chunk. Written
    into an artifact's tokenizer/ folder or the HF directory; returns None when the model
    already has a tokenizer. Tokenizer files are not part of an artifact's fingerprint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from compile_engine.models.tokenizer import SAVED_DIR, has_tokenizer

    path = Path(model)
    if (path / "manifest.json").is_file():
        data = json.loads((path / "manifest.json").read_text())
        source = Path(data.get("weights_path") or data["model_path"])
        if has_tokenizer(path / SAVED_DIR) or has_tokenizer(source):
            return None
        target = path / SAVED_DIR
    else:
        if has_tokenizer(path):
            return None
        target = path
    vocab = {f"t{i}": i for i in range(vocab_size_of(str(path)))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(str(target))
    return target


# -- the client -------------------------------------------------------------------------------


@dataclass(slots=True)
class ClientSettings:
    base_url: str
    model_name: str | None = None
    api_key: str | None = None
    temperature: float = 0.0
    timeout_s: float = 3600.0


async def _send(session, settings: ClientSettings, spec: RequestSpec) -> RequestResult:
    import aiohttp

    result = RequestResult(len(spec.prompt), spec.output_len)
    body = {
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "ignore_eos": True,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.model_name is not None:
        body["model"] = settings.model_name
    parts: list[str] = []
    result.start = time.perf_counter()
    try:
        async with session.post(settings.base_url + "/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return result
            async for raw in response.content:
                now = time.perf_counter()
                line = raw.strip()
                if not line.startswith(b"data:"):  # blank separators, SSE comments
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    result.error = str(
                        error.get("message", error) if isinstance(error, dict) else error
                    )
                    break
                if chunk.get("choices"):
                    result.chunk_times.append(now)
                    parts.append(chunk["choices"][0].get("text") or "")
                elif chunk.get("usage"):
                    result.usage_tokens = chunk["usage"].get("completion_tokens")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.text = "".join(parts)
    if result.error is None and not result.chunk_times:
        result.error = "the stream ended without a chunk carrying a choice"
    return result


async def run_requests(
    settings: ClientSettings,
    specs: list[RequestSpec],
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
) -> tuple[list[RequestResult], float]:
    """Send `specs` in order at Poisson arrivals of `request_rate` per second (inf: all at once),
    at most `max_concurrency` in flight; return the results (in order) and the duration."""
    import aiohttp

    arrivals = random.Random(seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else None
    # aiohttp's default pool holds 100 connections, which would cap concurrency silently.
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as s:

        async def one(spec: RequestSpec) -> RequestResult:
            if semaphore is None:
                return await _send(s, settings, spec)
            async with semaphore:
                return await _send(s, settings, spec)

        tasks = []
        start = time.perf_counter()
        due = start
        for i, spec in enumerate(specs):
            if i and math.isfinite(request_rate):
                # Absolute arrival times: sleeping for each gap would add the loop's lag up.
                due += arrivals.expovariate(request_rate)
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


def _get(url: str, api_key: str | None = None, timeout: float = 10.0) -> bytes:
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def served_model(base_url: str, api_key: str | None) -> dict:
    """The server's one model card (id, max_model_len) from /v1/models."""
    try:
        data = json.loads(_get(base_url + "/v1/models", api_key))
    except (OSError, ValueError) as exc:
        raise ServeBenchError(
            f"no OpenAI-compatible server answers at {base_url} ({exc}); start one "
            "(compile-engine serve MODEL) or pass --launch"
        ) from None
    return data["data"][0]


def server_counters(base_url: str) -> dict[str, float]:
    """A few of our server's Prometheus counters; {} from a server that has none."""
    try:
        text = _get(base_url + "/metrics").decode()
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        key = _SERVER_COUNTERS.get(name.split("{", 1)[0].split(":", 1)[-1])
        if key is None:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


# -- launching our server ---------------------------------------------------------------------


class ServerLaunchError(ServeBenchError):
    """The launched server exited or did not become healthy; its log tail is in the message."""


@dataclass(slots=True)
class LaunchedServer:
    base_url: str
    command: list[str]
    ready_s: float
    log_path: Path
    process: subprocess.Popen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    """`compile-engine serve` with every engine flag the serve CLI defines that `args` holds:
    the flag names are shared (benchmarks/common.py), so the mapping is read off the CLI."""
    from compile_engine.runtime.engine_args import add_engine_arguments

    cli = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(cli)
    command = [sys.executable, "-m", "compile_engine.cli", "serve", str(args.model)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--max-waiting", str(args.max_waiting)]
    for action in cli._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value is None:
            continue
        if action.nargs == 0:  # store_true
            command += [action.option_strings[0]] if value else []
        else:
            command += [action.option_strings[0], str(value)]
    return command


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_server(process: subprocess.Popen, grace_s: float = 30.0) -> int:
    """SIGTERM (the server finishes in-flight requests for up to 10 s), then SIGKILL."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
    return process.returncode


@contextlib.contextmanager
def launch_server(
    args: argparse.Namespace,
    log_path: Path,
    *,
    ready_timeout_s: float = 900.0,
    extra_flags: tuple[str, ...] = (),
) -> Iterator[LaunchedServer]:
    """Start `compile-engine serve` on a free loopback port, wait for /health, yield, stop it.
    The server's stdout and stderr go to `log_path`; `extra_flags` are more serve flags (the
    connection limits `bench soak` sets)."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [*serve_command(args, port), *extra_flags]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            while True:
                if process.poll() is not None:
                    raise ServerLaunchError(
                        f"the server exited with code {process.returncode} before it was "
                        f"ready; the end of its log ({log_path}):\n{_log_tail(log_path)}"
                    )
                try:
                    _get(base_url + "/health", timeout=2.0)
                    break
                except (OSError, urllib.error.HTTPError):
                    pass
                if time.perf_counter() - t0 > ready_timeout_s:
                    raise ServerLaunchError(
                        f"the server was not healthy after {ready_timeout_s:.0f} s (raise "
                        f"--ready-timeout); the end of its log ({log_path}):\n"
                        f"{_log_tail(log_path)}"
                    )
                time.sleep(0.5)
            ready_s = time.perf_counter() - t0
            yield LaunchedServer(base_url, command, ready_s, log_path, process)
        finally:
            stop_server(process)


# -- the command ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench serve", description=__doc__.splitlines()[0])
    add_engine_flags(p, max_num_seqs=256)
    g = p.add_argument_group("server (engine flags above apply only with --launch)")
    g.add_argument("--launch", action="store_true", help="start compile-engine serve here")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server")
    g.add_argument("--api-key", default=os.environ.get("COMPILE_ENGINE_API_KEY"))
    g.add_argument("--max-waiting", type=int, default=None, help="launch: default num-prompts")
    g.add_argument("--server-log", default=None, help="launch: default <results-dir>/...log")
    g.add_argument("--ready-timeout", type=float, default=900.0, help="launch: seconds")
    d = p.add_argument_group("requests")
    d.add_argument("--dataset", default="random", choices=["random", "sharegpt-synthetic"])
    d.add_argument("--num-prompts", type=int, default=1000)
    d.add_argument("--input-len", type=int, default=512, help="random dataset")
    d.add_argument("--output-len", type=int, default=256, help="random dataset")
    d.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths +-ratio")
    d.add_argument("--vocab-size", type=int, default=None, help="default: the model's config")
    d.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson")
    d.add_argument("--max-concurrency", type=int, default=None)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--num-warmup", type=int, default=0, help="untimed requests sent first")
    d.add_argument("--request-timeout", type=float, default=3600.0, help="seconds each")
    d.add_argument(
        "--goodput", nargs="+", default=None, metavar="METRIC:MS", help="e.g. ttft:500 tpot:50"
    )
    d.add_argument("--save-requests", action="store_true", help="per-request rows in the JSON")
    d.add_argument("--name", default="serve", help="result file name prefix")
    return p


def _validate(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ServeBenchError("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        raise ServeBenchError("--request-rate must be > 0 (inf sends everything at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ServeBenchError("--max-concurrency must be >= 1 (leave it out for no cap)")
    if args.input_len < 1 or args.output_len < 1:
        raise ServeBenchError("--input-len and --output-len must be >= 1")
    if not 0 <= args.random_range_ratio < 1:
        raise ServeBenchError("--random-range-ratio must be in [0, 1)")


def _request_rows(results: list[RequestResult]) -> list[dict]:
    return [
        {
            "prompt_len": r.prompt_len,
            "output_len": r.output_len,
            "output_tokens": r.output_tokens if r.success else None,
            "chunks": len(r.chunk_times),
            "ttft_ms": r.ttft * 1000 if r.success else None,
            "e2el_ms": r.e2el * 1000 if r.success else None,
            "error": r.error,
        }
        for r in results
    ]


def benchmark(args: argparse.Namespace, base_url: str) -> dict:
    """Warm up, run the timed requests against `base_url`, return the payload's numbers."""
    card = served_model(base_url, args.api_key)
    vocab = args.vocab_size or vocab_size_of(args.model)
    rng = random.Random(args.seed)
    specs = make_requests(
        args.dataset,
        args.num_prompts,
        vocab,
        rng,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.random_range_ratio,
    )
    max_len = card.get("max_model_len")
    longest = max(len(s.prompt) + s.output_len for s in specs)
    if max_len is not None and longest > max_len:
        raise ServeBenchError(
            f"a request needs {longest} tokens but the server's max_model_len is {max_len}; "
            "shorten --input-len/--output-len or raise the server's --max-model-len"
        )
    settings = ClientSettings(
        base_url,
        model_name=card.get("id"),
        api_key=args.api_key,
        temperature=args.temperature,
        timeout_s=args.request_timeout,
    )
    if args.num_warmup:
        warm = make_requests(
            "random",
            args.num_warmup,
            vocab,
            random.Random(args.seed + 1),
            input_len=len(specs[0].prompt),
            output_len=min(16, specs[0].output_len),
        )
        results, _ = asyncio.run(run_requests(settings, warm, max_concurrency=args.max_concurrency))
        failed = [r for r in results if not r.success]
        if failed:
            raise ServeBenchError(
                f"{len(failed)} of {len(warm)} warmup requests failed: {failed[0].error}"
            )
        print(f"[serve] {len(warm)} warmup requests done", file=sys.stderr)
    before = server_counters(base_url)
    results, duration = asyncio.run(
        run_requests(
            settings,
            specs,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
        )
    )
    after = server_counters(base_url)
    metrics = compute_metrics(results, duration, parse_goodput(args.goodput))
    metrics["server_counters"] = {k: after[k] - before.get(k, 0.0) for k in after}
    metrics["server_steps"] = step_summary(metrics["server_counters"])
    metrics["served_model"] = card.get("id")
    metrics["max_model_len"] = max_len
    if args.save_requests:
        metrics["requests"] = _request_rows(results)
    return metrics


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_waiting is None:
        args.max_waiting = max(1024, args.num_prompts + args.num_warmup)
    # `timeout` and job control send SIGTERM: unwind so a launched server is stopped too.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        _validate(args)
        parse_goodput(args.goodput)
        server: dict = {"launched": args.launch}
        with contextlib.ExitStack() as stack:
            base_url = args.base_url
            if args.launch:
                log_path = Path(args.server_log or Path(args.results_dir) / "serve-server.log")
                launched = stack.enter_context(
                    launch_server(args, log_path, ready_timeout_s=args.ready_timeout)
                )
                base_url = launched.base_url
                server.update(command=["python", *launched.command[1:]], ready_s=launched.ready_s)
                server["log"] = str(log_path)
                print(f"[serve] server ready in {launched.ready_s:.1f} s", file=sys.stderr)
            metrics = benchmark(args, base_url)
            if args.launch:
                server["exit_code"] = stop_server(launched.process)
    except ServeBenchError as exc:
        print(f"bench serve: error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)

    payload = {
        "benchmark": "serve",
        "model": args.model,
        "target": args.target,
        "dtype": args.dtype,
        "base_url": base_url if not args.launch else None,
        "server": server,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len if args.dataset == "random" else None,
        "output_len": args.output_len if args.dataset == "random" else None,
        "random_range_ratio": args.random_range_ratio if args.dataset == "random" else None,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "temperature": args.temperature,
        "num_warmup": args.num_warmup,
        "seed": args.seed,
        **metrics,
    }
    if metrics["failed"] == 0:
        # The headline number only from a run in which every request succeeded.
        payload["serve_output_tok_s"] = metrics["output_throughput"]
    device = {"cpu": "cpu", "h100": "cuda"}.get(args.target) if args.launch else None
    path = write_result(args.name, payload, args.results_dir, device=device)
    _print(payload)
    print(f"wrote {path}")
    if metrics["failed"]:
        print(
            f"bench serve: {metrics['failed']} requests failed; first error: "
            f"{metrics['first_error']}",
            file=sys.stderr,
        )
        return 1
    return 0


def _exit_on_sigterm(signum: int, frame) -> None:
    print("bench serve: terminated (SIGTERM); a launched server is stopped first", file=sys.stderr)
    raise SystemExit(128 + signum)


def _print(p: dict) -> None:
    if p["completed"] and not p["per_token_stream"]:
        print(
            f"warning: {p['tokens_per_chunk']:.1f} tokens per streamed chunk: TTFT, TPOT and ITL "
            "are not per token (a model without a tokenizer streams no text until its last "
            "chunk; see add_word_tokenizer in benchmarks/serve.py)",
            file=sys.stderr,
        )
    shape = (
        f"{p['input_len']} in / {p['output_len']} out"
        if p["dataset"] == "random"
        else "sharegpt-synthetic lengths"
    )
    rows: list[tuple[str, object]] = [
        (
            "requests",
            f"{p['num_prompts']} x ({shape}), rate {p['request_rate']}, "
            f"concurrency {p['max_concurrency'] or 'unbounded'}",
        ),
        ("completed / failed", f"{p['completed']} / {p['failed']}"),
        ("duration s", p["duration_s"]),
        ("requests/s", p["request_throughput"]),
        ("output tok/s", p["output_throughput"]),
        ("total tok/s", p["total_token_throughput"]),
    ]
    if p["request_goodput"] is not None:
        rows.append(("goodput req/s", p["request_goodput"]))
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2el_ms", "E2EL"),
    ):
        s = p[key]
        if s["mean"] is None:
            rows.append((f"{label} ms", "—"))
            continue
        rows.append(
            (
                f"{label} ms mean/median/p90/p99",
                f"{s['mean']:.2f} / {s['median']:.2f} / {s['p90']:.2f} / {s['p99']:.2f}",
            )
        )
    steps = p.get("server_steps")
    if steps:
        rows.append(
            (
                "server steps",
                f"{steps['steps']}, {steps['tokens_per_step']:.1f} tokens and "
                f"{steps['busy_ms_per_step']:.2f} ms each, "
                f"{100 * steps['graph_step_share']:.0f}% from CUDA graphs, "
                f"{100 * steps['device_wait_share']:.0f}% waiting for the device",
            )
        )
    print_table(rows, title="serve (online, streaming /v1/completions)")


if __name__ == "__main__":
    sys.exit(main())
