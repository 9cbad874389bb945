"""`bench soak`: many concurrent streaming clients against one server for minutes (issue 31,
item 8): some hang up mid-stream, some read slowly, and a few hostile clients keep sending what
the server must refuse (slowloris headers, short bodies, silent connections, an 8 MB prompt, a
body over the limit, 2M prompt token ids, bytes that are not HTTP).

It passes when there was no 5xx, every stream that ran to its end was well formed (JSON events,
one finish_reason per choice, the usage the request asked for, then [DONE]), every hostile
request was refused (4xx or a closed socket, never an answer it should not get), the gauges came
back to 0 once the clients were gone, and the server's RSS did not grow more than 5% from the
second to the last part of the run (the second and last minute of a run of several minutes; of
a short run, its second and last third).

The server is launched here (`compile-engine serve` with the engine flags, on loopback); the
clients run in this process on asyncio. `run_soak` is the loop, which tests/server/test_soak.py
runs for a short time against its own launched server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from compile_engine.benchmarks.common import add_engine_flags
from compile_engine.benchmarks.results import print_table, write_result
from compile_engine.benchmarks.serve import launch_server

# The limits the soak's server runs with: short, so hostile clients cycle often.
SERVER_FLAGS = (
    "--header-timeout",
    "3",
    "--body-timeout",
    "3",
    "--timeout-keep-alive",
    "5",
)
MAX_RSS_GROWTH = 0.05
WORDS = [
    "the",
    "a",
    "of",
    "river",
    "mountain",
    "quiet",
    "story",
    "engine",
    "light",
    "over",
    "under",
    "slowly",
    "because",
]


@dataclass
class Tally:
    """What the clients saw."""

    kinds: Counter = field(default_factory=Counter)  # requests started, by client kind
    statuses: Counter = field(default_factory=Counter)
    completed: int = 0  # streams read to [DONE] (and whole JSON answers)
    hung_up: int = 0  # streams the client left on purpose
    malformed: list[str] = field(default_factory=list)
    five_xx: list[str] = field(default_factory=list)
    hostile_answered: list[str] = field(default_factory=list)  # a hostile request not refused
    client_errors: Counter = field(default_factory=Counter)  # transport errors, by type
    itl_s: list[float] = field(default_factory=list)


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


def _check_stream(events: list[str], n_choices: int, want_tokens: int, chat: bool) -> str | None:
    """Why a complete stream is malformed, or None."""
    if not events or events[-1] != "[DONE]":
        return "no [DONE] at the end"
    finished: dict[int, str] = {}
    usage = None
    for raw in events[:-1]:
        try:
            chunk = json.loads(raw)
        except ValueError:
            return f"an event is not JSON: {raw[:80]!r}"
        if "error" in chunk:
            return f"an error event: {raw[:200]}"
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            if choice["index"] in finished:
                return f"choice {choice['index']} continued after its finish_reason"
            if choice.get("finish_reason") is not None:
                finished[choice["index"]] = choice["finish_reason"]
            if chat and "delta" not in choice:
                return "a chat chunk without delta"
    if sorted(finished) != list(range(n_choices)):
        return f"finish_reason for choices {sorted(finished)} of {n_choices}"
    if usage is None:
        return "no usage chunk"
    if usage["completion_tokens"] != want_tokens * n_choices:
        return f"usage says {usage['completion_tokens']} tokens, asked {want_tokens * n_choices}"
    return None


async def _stream_client(
    session: aiohttp.ClientSession, base: str, rng: random.Random, tally: Tally, stop: float
) -> None:
    """One client: streams (chat or completions), hanging up on some, reading some slowly."""
    while time.monotonic() < stop:
        kind = rng.choices(["stream", "hang_up", "slow", "whole"], [60, 20, 15, 5])[0]
        chat = rng.random() < 0.4
        max_tokens = rng.randint(4, 48) if kind != "slow" else rng.randint(32, 96)
        n = 2 if rng.random() < 0.1 else 1
        body: dict = {"max_tokens": max_tokens, "n": n, "temperature": 0.8, "ignore_eos": True}
        body["seed"] = rng.randrange(1 << 30)
        if kind != "whole":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [{"role": "user", "content": _prompt(rng)}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = _prompt(rng)
            if rng.random() < 0.3:
                body["logprobs"] = 2
            path = "/v1/completions"
        tally.kinds[kind] += 1
        try:
            await _one_stream(session, base + path, body, kind, chat, rng, tally)
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            tally.client_errors[type(exc).__name__] += 1
        await asyncio.sleep(rng.random() * 0.2)


async def _one_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    kind: str,
    chat: bool,
    rng: random.Random,
    tally: Tally,
) -> None:
    async with session.post(url, json=body) as response:
        tally.statuses[response.status] += 1
        if response.status >= 500:
            tally.five_xx.append(f"{response.status} {url}: {(await response.text())[:200]}")
            return
        if response.status != 200:
            tally.malformed.append(f"{response.status} {url}: {(await response.text())[:200]}")
            return
        if kind == "whole":
            answer = await response.json()
            tokens = answer["usage"]["completion_tokens"]
            if tokens != body["max_tokens"] * body["n"] or len(answer["choices"]) != body["n"]:
                tally.malformed.append(f"whole answer: {json.dumps(answer)[:200]}")
            tally.completed += 1
            return
        hang_up_after = rng.randint(1, 6) if kind == "hang_up" else None
        events: list[str] = []
        last = None
        async for line in response.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            now = time.monotonic()
            if last is not None and kind == "stream":
                tally.itl_s.append(now - last)
            last = now
            events.append(line[6:].decode())
            if hang_up_after is not None and len(events) >= hang_up_after:
                response.close()  # drops the connection mid-stream
                tally.hung_up += 1
                return
            if kind == "slow":
                await asyncio.sleep(rng.uniform(0.05, 0.3))
        problem = _check_stream(events, body["n"], body["max_tokens"], chat)
        if problem is not None:
            tally.malformed.append(f"{url}: {problem}")
        tally.completed += 1


# -- hostile clients ------------------------------------------------------------------------------


async def _raw(host: str, port: int, data: bytes, drip_s: float | None, limit_s: float) -> bytes:
    """Send `data` (one byte per `drip_s`, or at once) and return what comes back before the
    server closes; raises TimeoutError if it keeps the connection past `limit_s`. A dripping
    client stops sending once an answer comes, as a client that reads would."""
    reader, writer = await asyncio.open_connection(host, port)
    received = b""
    try:
        async with asyncio.timeout(limit_s):
            if drip_s is None:
                writer.write(data)
            else:
                for i in range(len(data)):
                    writer.write(data[i : i + 1])
                    await writer.drain()
                    try:
                        chunk = await asyncio.wait_for(reader.read(65536), drip_s)
                    except TimeoutError:
                        continue
                    received += chunk
                    break
            with contextlib.suppress(ConnectionError):
                while chunk := await reader.read(65536):
                    received += chunk
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return received


def _status(raw: bytes) -> int | None:
    if not raw.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")):  # aiohttp's 400 for non-HTTP is 1.0
        return None
    return int(raw.split(b" ", 2)[1])


def hostile_payloads() -> dict[str, bytes]:
    """The hostile bodies, made once: an 8 MB prompt, one over the 8 MiB limit, 2M token ids."""
    return {
        "huge": json.dumps({"prompt": "a " * 4_000_000, "max_tokens": 4}).encode(),
        "too_big": b'{"prompt": "' + b"a" * (9 << 20) + b'"}',
        "ids": json.dumps({"prompt": [5] * 2_000_000, "max_tokens": 4}).encode(),
    }


async def _hostile_client(
    session: aiohttp.ClientSession,
    base: str,
    rng: random.Random,
    tally: Tally,
    stop: float,
    payloads: dict[str, bytes],
) -> None:
    host, port = base.removeprefix("http://").split(":")
    port = int(port)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    while time.monotonic() < stop:
        attack = rng.choice(
            ["slowloris", "short_body", "silent", "huge", "too_big", "ids", "garbage"]
        )
        tally.kinds["hostile:" + attack] += 1
        try:
            if attack in ("slowloris", "short_body", "silent", "garbage"):
                data, drip = {
                    "slowloris": (head.encode(), 0.5),
                    "short_body": ((head + "Content-Length: 500\r\n\r\n{").encode(), None),
                    "silent": (b"", None),
                    "garbage": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" * 50, None),
                }[attack]
                status = _status(await _raw(host, port, data, drip, limit_s=60))
                tally.statuses[f"hostile {status}"] += 1
                if status is not None and status >= 500:
                    tally.five_xx.append(f"hostile {attack}: {status}")
                elif status is not None and not 400 <= status < 500:
                    tally.hostile_answered.append(f"{attack}: {status}")
            else:
                payload = payloads[attack]
                headers = {"Content-Type": "application/json"}
                async with session.post(
                    base + "/v1/completions", data=payload, headers=headers
                ) as r:
                    await r.read()
                    tally.statuses[f"hostile {r.status}"] += 1
                    if r.status >= 500:
                        tally.five_xx.append(f"hostile {attack}: {r.status}")
                    elif not 400 <= r.status < 500:
                        tally.hostile_answered.append(f"{attack}: {r.status}")
        except TimeoutError:
            tally.hostile_answered.append(f"{attack}: held open past 60 s")
        except (aiohttp.ClientError, ConnectionError) as exc:
            tally.client_errors[f"hostile {type(exc).__name__}"] += 1  # a reset is a refusal
        await asyncio.sleep(rng.uniform(0.5, 2.0))


# -- the run --------------------------------------------------------------------------------------


def server_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for our series (labels but model_name kept in the key)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("compile_engine:"):
            continue
        key, _, value = line.rpartition(" ")
        if "{" in key:
            name, _, labels = key.partition("{")
            kept = [p for p in labels.rstrip("}").split(",") if not p.startswith("model_name=")]
            key = name + ("{" + ",".join(kept) + "}" if kept else "")
        out[key] = float(value)
    return out


async def _metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as r:
        return parse_metrics(await r.text())


GAUGES = (
    "compile_engine:num_requests_running",
    "compile_engine:num_requests_waiting",
    "compile_engine:kv_cache_usage_perc",
    "compile_engine:tokenizer_pool_pending",
)


def rss_growth(samples: list[tuple[float, int]], duration_s: float) -> dict[str, float]:
    """Mean RSS over the second and over the last minute (runs of 3 minutes or more) or third
    (shorter runs), and the growth from one to the other."""
    part = 60.0 if duration_s >= 180 else duration_s / 3
    second = [r for t, r in samples if part <= t < 2 * part]
    last = [r for t, r in samples if t >= duration_s - part]
    if not second or not last:
        raise RuntimeError("too few RSS samples for the comparison")
    a, b = sum(second) / len(second), sum(last) / len(last)
    return {"window_s": part, "second_mb": a / 2**20, "last_mb": b / 2**20, "growth": b / a - 1}


async def run_soak(
    base: str,
    pid: int,
    *,
    clients: int,
    hostile: int,
    duration_s: float,
    seed: int = 0,
    sample_every_s: float = 2.0,
) -> dict:
    """The soak against the server at `base` (process `pid`); returns its figures and
    `failures` (empty when it passed)."""
    rng = random.Random(seed)
    tally = Tally()
    payloads = hostile_payloads()
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=600)
    samples: list[tuple[float, int]] = []
    start = time.monotonic()
    stop = start + duration_s
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [
            asyncio.create_task(
                _stream_client(session, base, random.Random(rng.random()), tally, stop)
            )
            for _ in range(clients)
        ]
        tasks += [
            asyncio.create_task(
                _hostile_client(session, base, random.Random(rng.random()), tally, stop, payloads)
            )
            for _ in range(hostile)
        ]
        peak: dict[str, float] = {}
        while time.monotonic() < stop:
            samples.append((time.monotonic() - start, server_rss_bytes(pid)))
            for key, value in (await _metrics(session, base)).items():
                if key in GAUGES or key == "compile_engine:http_connections":
                    peak[key] = max(peak.get(key, 0.0), value)
            await asyncio.sleep(sample_every_s)
        await asyncio.gather(*tasks)
        drained_s = time.monotonic() - stop
    # Every client connection is closed now; the engine frees aborted requests in a cycle.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for _ in range(50):
            final = await _metrics(session, base)
            if (
                all(final.get(g, 0.0) == 0 for g in GAUGES)
                and final.get("compile_engine:http_connections") == 1
            ):
                break
            await asyncio.sleep(0.2)
    elapsed = time.monotonic() - start
    itl = sorted(tally.itl_s)
    rss = rss_growth(samples, duration_s)
    drops = {
        k.split('reason="')[1].rstrip('"}'): v
        for k, v in final.items()
        if k.startswith("compile_engine:http_connections_dropped_total")
    }
    failures = [f"5xx: {x}" for x in tally.five_xx[:20]]
    failures += [f"malformed: {x}" for x in tally.malformed[:20]]
    failures += [f"hostile request answered: {x}" for x in tally.hostile_answered[:20]]
    for gauge in GAUGES:
        if final.get(gauge, 0.0) != 0:
            failures.append(f"{gauge} is {final.get(gauge)} after the run")
    if final.get("compile_engine:http_connections") != 1:
        failures.append(f"{final.get('compile_engine:http_connections')} connections left open")
    if rss["growth"] > MAX_RSS_GROWTH:
        failures.append(f"RSS grew {rss['growth']:.1%} (limit {MAX_RSS_GROWTH:.0%})")
    if tally.completed == 0:
        failures.append("no stream completed")

    def pct(p: float) -> float | None:
        return itl[min(len(itl) - 1, int(p * len(itl)))] * 1e3 if itl else None

    return {
        "clients": clients,
        "hostile_clients": hostile,
        "duration_s": duration_s,
        "drain_s": drained_s,
        "elapsed_s": elapsed,
        "requests_by_kind": dict(tally.kinds),
        "statuses": {str(k): v for k, v in tally.statuses.items()},
        "completed": tally.completed,
        "hung_up": tally.hung_up,
        "client_errors": dict(tally.client_errors),
        "five_xx": len(tally.five_xx),
        "malformed": len(tally.malformed),
        "hostile_answered": len(tally.hostile_answered),
        "itl_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)},
        "generation_tokens": final.get("compile_engine:generation_tokens_total"),
        "peak_gauges": peak,
        "final_gauges": {g: final.get(g) for g in (*GAUGES, "compile_engine:http_connections")},
        "dropped_connections": drops,
        "rss": rss,
        "rss_samples_mb": [(round(t, 1), round(r / 2**20, 1)) for t, r in samples],
        "failures": failures,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench soak", description=__doc__.splitlines()[0])
    add_engine_flags(p, max_num_seqs=256)
    p.add_argument("--clients", type=int, default=256, help="concurrent streaming clients")
    p.add_argument("--hostile", type=int, default=4, help="concurrent hostile clients")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--client-seed", type=int, default=0, help="the clients' choices")
    p.add_argument("--max-waiting", type=int, default=1024)
    p.add_argument("--server-log", default=None, help="default <results-dir>/soak-server.log")
    p.add_argument("--name", default="soak", help="result file name prefix")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results_dir = Path(args.results_dir)
    log_path = Path(args.server_log or results_dir / "soak-server.log")
    with launch_server(args, log_path, extra_flags=SERVER_FLAGS) as server:
        print(
            f"[soak] server ready in {server.ready_s:.1f} s; {args.duration:.0f} s of load "
            f"from {args.clients} clients and {args.hostile} hostile ones",
            file=sys.stderr,
        )
        figures = asyncio.run(
            run_soak(
                server.base_url,
                server.process.pid,
                clients=args.clients,
                hostile=args.hostile,
                duration_s=args.duration,
                seed=args.client_seed,
            )
        )
    payload = {"server_flags": list(SERVER_FLAGS), "model": str(args.model), **figures}
    path = write_result(args.name, payload, results_dir, device=args.target)
    print_table(
        [
            ("clients / hostile", f"{args.clients} / {args.hostile}"),
            ("duration s", figures["duration_s"]),
            ("streams completed", figures["completed"]),
            ("hung up on purpose", figures["hung_up"]),
            ("5xx", figures["five_xx"]),
            ("malformed", figures["malformed"]),
            ("hostile answered", figures["hostile_answered"]),
            (
                "ITL p50 / p99 / max ms",
                "{p50:.0f} / {p99:.0f} / {max:.0f}".format(**figures["itl_ms"]),
            ),
            (
                "RSS 2nd / last window MB",
                "{second_mb:.0f} / {last_mb:.0f}".format(**figures["rss"]),
            ),
            ("RSS growth", f"{figures['rss']['growth']:+.2%}"),
            ("dropped connections", json.dumps(figures["dropped_connections"])),
        ],
        title=f"soak ({path})",
    )
    for failure in figures["failures"]:
        print("FAIL", failure, file=sys.stderr)
    return 1 if figures["failures"] else 0
