"""Prometheus metrics under vLLM's names with the prefix `compile_engine:`, so dashboards built
for vLLM map over by replacing `vllm:` with `compile_engine:`.

Each app gets its own CollectorRegistry (tests build several apps in one process). Gauges and
the scheduler's cumulative counters are read from the latest scheduler snapshot at scrape time
by a custom collector, instead of being pushed every step: the snapshot is taken in the engine
thread after each step, so a scrape never touches the (not thread-safe) scheduler. The
`engine_*` counters are ours (vLLM has no such names), read the same way from the runner's
`StepCounters`: steps, their tokens, how many replayed a CUDA graph, the engine thread's time in
step() and how much of it waited for the device. The HTTP side's are ours too (`HTTPCollector`):
open connections, connections dropped by the server's limits by reason, and tokenizer jobs in
flight, read at scrape time from the app's counters (all changed on the event loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from compile_engine.runtime.model_runner import StepCounters
from compile_engine.runtime.scheduler import SchedulerStats

PREFIX = "compile_engine:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, trimmed a little at the top.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _SchedulerCollector(Collector):
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], SchedulerStats | None],
        counters: Callable[[], StepCounters | None],
    ) -> None:
        self._model_name = model_name
        self._stats = stats
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        stats, steps = self._stats(), self._counters()
        labels = ["model_name"]
        values = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            metric = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            metric = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        if steps is not None:
            yield from self._step_counters(steps, counter)
        if stats is None:
            return
        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 means 100 percent).",
            stats.kv_cache_usage,
        )
        yield counter("num_preemptions", "Preemptions since start.", stats.num_preemptions_total)
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        if stats.spec_accepted_per_pos:  # speculative decoding is on (vLLM's names)
            yield from self._spec_counters(stats, counter)

    def _spec_counters(self, stats: SchedulerStats, counter: Callable) -> Iterator[Metric]:
        yield counter("spec_decode_num_drafts", "Rows that verified drafts.", stats.spec_num_drafts)
        yield counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified.", stats.spec_num_draft_tokens
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            stats.spec_num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of a row's drafts.",
            labels=["model_name", "position"],
        )
        for position, accepted in enumerate(stats.spec_accepted_per_pos):
            per_pos.add_metric([self._model_name, str(position)], accepted)
        yield per_pos

    @staticmethod
    def _step_counters(steps: StepCounters, counter: Callable) -> Iterator[Metric]:
        # Ours (vLLM has no such names): device wait close to the busy time means the device
        # bounds serving, close to 0 the host does; graph steps against all, how many replay.
        yield counter("engine_steps", "Model runs launched.", steps.steps)
        yield counter("engine_step_tokens", "Tokens the model runs computed.", steps.tokens)
        yield counter(
            "engine_graph_steps", "Model runs replayed from a CUDA graph.", steps.graph_steps
        )
        yield counter("engine_busy_seconds", "Engine thread time in step().", steps.busy_s)
        yield counter(
            "engine_device_wait_seconds",
            "Of that, time waiting for the device's sampled tokens.",
            steps.device_wait_s,
        )


@dataclass(slots=True)
class HTTPStats:
    """The HTTP side of one server at scrape time."""

    open_connections: int
    dropped: dict[str, int]  # reason -> connections the server's limits dropped
    tokenizer_pending: int  # tokenizer jobs queued or running


class HTTPCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], HTTPStats]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        name = self._model_name
        connections = GaugeMetricFamily(
            PREFIX + "http_connections", "Open client connections.", labels=["model_name"]
        )
        connections.add_metric([name], stats.open_connections)
        yield connections
        dropped = CounterMetricFamily(
            PREFIX + "http_connections_dropped",
            "Connections the server dropped: a timeout (header, body, keep-alive) or the cap.",
            labels=["model_name", "reason"],
        )
        for reason, count in stats.dropped.items():
            dropped.add_metric([name, reason], count)
        yield dropped
        pending = GaugeMetricFamily(
            PREFIX + "tokenizer_pool_pending",
            "Tokenizer jobs queued or running.",
            labels=["model_name"],
        )
        pending.add_metric([name], stats.tokenizer_pending)
        yield pending


class ServerMetrics:
    """The metric set of one server. `observe_*` are called on the event loop. `collectors`:
    more metrics read at scrape time (the server's HTTPCollector)."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], SchedulerStats | None],
        counters: Callable[[], StepCounters | None],
        collectors: Iterable[Collector] = (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SchedulerCollector(model_name, stats, counters))
        for collector in collectors:
            self.registry.register(collector)
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name, doc, labels, registry=self.registry, buckets=buckets
            ).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to the first generated token.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between successive outputs.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", _E2E_BUCKETS
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
