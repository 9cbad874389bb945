"""Tensor parallelism in the runtime: one process per rank, the engine's process is rank 0.

Rank 0 runs the scheduler, the model runner and the sampler. Ranks 1..N-1 are workers that
the engine starts (torch.multiprocessing, spawn), or the other processes of a torchrun launch.
Each rank builds its shard of the model (models/parallel.py) and of the KV cache, then the
workers loop: take a command from rank 0, run it, count it done.

A step is two messages from rank 0. On the control group (gloo, host memory, no practical
timeout, since workers wait there while the engine idles) a header: the command and the sizes.
On the data group (gloo on CPU, NCCL on CUDA, `distributed_timeout_s`) the payload: the step's
token ids, positions and attention metadata packed into one int64 tensor, or, for logits, the
hidden rows that sample. Every rank then runs its shard of the same forward (or lm_head), and
their all-reduces and all-gathers meet on the data group. Sending the hidden rows rather than
their indices keeps the runner's sampling code as it is (it calls `compute_logits(hidden[rows])`);
it costs S x H numbers a step, against the S x V logits it gathers.

Failure: a watchdog thread on rank 0 watches the worker processes. A worker that exits, or one
that has not finished a command `distributed_timeout_s` after it was sent (hung), is named; the
watchdog then kills the workers, so that every collective still waiting fails at once instead
of at its timeout, and the step raises `TensorParallelError` naming the rank. The engine cannot
continue after that: every later step that reaches the ranks raises the same error (the
engine's own bookkeeping of the step that never landed may complain first).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compile_engine.models.layers import AttentionMetadata
from compile_engine.models.parallel import TensorParallel

log = logging.getLogger(__name__)

FORWARD, LOGITS, STOP = 1, 2, 3
# Workers wait on the control group while the engine is idle, for as long as it idles.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# The process group's own timeout, past the watchdog's: the watchdog names the rank first.
PG_TIMEOUT_MARGIN_S = 10.0
WATCH_INTERVAL_S = 0.2


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung, or failed to start; the message names it. The
    engine cannot continue: start a new one."""


@dataclass(frozen=True, slots=True)
class Launch:
    """How this process joins the group: rank, size, and the rendezvous."""

    rank: int
    world_size: int
    init_method: str  # file://... for spawned workers, env:// under torchrun
    backend: str  # gloo | nccl

    @property
    def torchrun(self) -> bool:
        return self.init_method == "env://"


def torchrun_launch(world_size: int, backend: str) -> Launch | None:
    """This process's rank when torchrun (or another launcher setting its variables) started
    it; None otherwise. The one place product code reads the environment: RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT are torchrun's interface, not settings of ours."""
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != world_size:
        raise TensorParallelError(
            f"launched with WORLD_SIZE={world} but tensor_parallel_size={world_size}; launch "
            f"as many processes as tensor_parallel_size (torchrun --nproc-per-node {world_size})"
        )
    return Launch(int(os.environ["RANK"]), world, "env://", backend)


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to build its shard, picklable: the model as rank 0 resolved
    it (its config included, so workers do not ask transformers), how to compile it, and the
    group's settings."""

    model: str
    dtype: str
    device_type: str
    max_model_len: int | None
    model_config: dict  # models.config.config_to_dict
    block_size: int
    enforce_eager: bool
    target: str
    passes: str | None
    cache_dir: str | None
    kernel_config: dict  # KernelConfig.to_dict()
    expert_parallel: bool
    timeout_s: float


def init_groups(launch: Launch, timeout_s: float) -> tuple[TensorParallel, object]:
    """Join the default (data) group and create the control group; every rank calls this in
    the same order. Returns the rank's TensorParallel and the control group."""
    dist.init_process_group(
        launch.backend,
        init_method=launch.init_method,
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=timeout_s + PG_TIMEOUT_MARGIN_S),
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    tp = TensorParallel(launch.rank, launch.world_size, dist.group.WORLD.group_name)
    return tp, control


def agree_num_blocks(control, candidate: int) -> int:
    """The KV pool every rank can hold: the smallest rank's candidate."""
    value = torch.tensor([candidate], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=control)
    return int(value.item())


def sizing_request(
    control, needed_tokens: int = 0, reserve_bytes: int = 0, num_blocks: int = 0
) -> list[int]:
    """Rank 0's numbers for sizing the KV pool (tokens to hold, bytes to leave free, the
    pool size the user set or 0), sent to every rank; workers pass nothing and receive them."""
    value = torch.tensor([needed_tokens, reserve_bytes, num_blocks], dtype=torch.int64)
    dist.broadcast(value, src=0, group=control)
    return value.tolist()


def _pack(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    parts = (
        ids,
        positions,
        meta.slot_mapping,
        meta.block_tables.flatten(),
        meta.seq_lens,
        meta.query_start_loc,
    )
    return torch.cat([p.to(torch.int64) for p in parts])


def _unpack(payload: torch.Tensor, num_tokens: int, batch: int, width: int):
    ids, positions, slots, tables, seq_lens, starts = payload.split(
        [num_tokens, num_tokens, num_tokens, batch * width, batch, batch + 1]
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables.view(batch, width).to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        query_start_loc=starts.to(torch.int32),
    )
    return ids, positions, meta


# --------------------------------------------------------------------------- rank 0


class WorkerGroup:
    """Rank 0's side: the workers (when it started them), the groups, the watchdog."""

    def __init__(
        self,
        launch: Launch,
        tp: TensorParallel,
        control,
        processes: dict[int, mp.Process],
        heartbeat,
        failures,
        timeout_s: float,
        rendezvous: Path | None = None,
    ) -> None:
        """rendezvous: the folder of the file store the spawned workers met at, removed at
        shutdown (None under torchrun)."""
        self.launch, self.tp, self.control = launch, tp, control
        self.rendezvous = rendezvous
        self.processes, self.heartbeat, self.failures = processes, heartbeat, failures
        self.timeout_s = timeout_s
        self.issued = 0  # commands sent
        self.issued_at = time.monotonic()
        self.error: TensorParallelError | None = None
        self._reasons: dict[int, str] = {}
        self._messages: dict[int, str] = {}
        self._closed = threading.Event()
        self._watchdog = None
        if processes:
            self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
            self._watchdog.start()

    # -- start -----------------------------------------------------------------------------

    @classmethod
    def start(cls, spec: WorkerSpec, world_size: int, launch: Launch | None) -> WorkerGroup:
        """Spawn ranks 1..world_size-1 as engine workers (unless a launcher started them:
        `launch`) and join the group as rank 0; raises TensorParallelError naming a rank that
        fails to join."""
        backend = backend_for(spec.device_type)
        return cls.spawn(
            world_size, backend, spec.timeout_s, spec.expert_parallel, worker_main, (spec,), launch
        )

    @classmethod
    def spawn(
        cls,
        world_size: int,
        backend: str,
        timeout_s: float,
        expert_parallel: bool,
        target: Callable,
        args: tuple,
        launch: Launch | None = None,
    ) -> WorkerGroup:
        """Start `target(launch, *args, heartbeat, failures)` as ranks 1..world_size-1 and
        join the group as rank 0."""
        _shut_down_previous()
        processes: dict[int, mp.Process] = {}
        context = mp.get_context("spawn")
        heartbeat = context.Array("q", world_size, lock=False)
        failures = context.Queue()
        rendezvous = None
        if launch is None:
            rendezvous = Path(tempfile.mkdtemp(prefix="ce-tp-"))
            launch = Launch(0, world_size, f"file://{rendezvous / 'store'}", backend)
        try:
            for rank in range(1, world_size if rendezvous is not None else 1):
                worker = Launch(rank, world_size, launch.init_method, backend)
                process = context.Process(
                    target=target,
                    args=(worker, *args, heartbeat, failures),
                    name=f"ce-tp-rank{rank}",
                    daemon=True,
                )
                process.start()
                processes[rank] = process
            _wait_for_workers(processes, heartbeat)
            tp, control = init_groups(launch, timeout_s)
        except Exception as exc:
            group = cls(launch, None, None, processes, heartbeat, failures, timeout_s, rendezvous)
            error = group.failure(exc, "joining the group")
            group.shutdown(stop=False)
            raise error from exc
        tp = TensorParallel(tp.rank, tp.world_size, tp.group_name, expert_parallel)
        group = cls(launch, tp, control, processes, heartbeat, failures, timeout_s, rendezvous)
        _ACTIVE.append(group)
        atexit.register(group.shutdown)  # workers blocked in a wait must not outlive us
        return group

    # -- the step's messages ---------------------------------------------------------------

    def send(self, command: int, sizes: tuple[int, ...], payload: torch.Tensor | None) -> None:
        """One command to every rank: the header on the control group, then the payload."""
        self.issued += 1
        self.issued_at = time.monotonic()
        header = torch.tensor([command, *sizes, 0, 0, 0][:4], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        if payload is not None:
            dist.broadcast(payload, src=0)

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run a step's collectives; a failure among them becomes the error naming the rank."""
        if self.error is not None:
            raise self.error
        try:
            yield
        except RuntimeError as exc:
            if isinstance(exc, TensorParallelError):
                raise
            raise self.failure(exc, what) from exc

    def forward(self, inner: Callable) -> ParallelForward:
        return ParallelForward(self, inner)

    def logits(self, inner: Callable) -> ParallelLogits:
        return ParallelLogits(self, inner)

    def sizing(
        self, needed_tokens: int, reserve_bytes: int, requested: int | None, candidate: int
    ) -> int:
        """The pool size every rank holds: the user's, or the smallest rank's from memory."""
        with self.guard("sizing the KV cache"):
            sizing_request(self.control, needed_tokens, reserve_bytes, requested or 0)
            return agree_num_blocks(self.control, candidate)

    def barrier(self, what: str = "waiting for every rank to compile") -> None:
        with self.guard(what):
            dist.barrier(group=self.control)

    # -- failure ---------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_INTERVAL_S):
            for rank, process in self.processes.items():
                if rank in self._reasons:
                    continue
                if not process.is_alive():
                    self._reasons[rank] = _exit_reason(process.exitcode)
                elif (
                    self.heartbeat[rank] < self.issued
                    and time.monotonic() - self.issued_at > self.timeout_s
                ):
                    self._reasons[rank] = (
                        f"hung: command {self.issued} unfinished after {self.timeout_s:g} s "
                        "(distributed_timeout_s)"
                    )
            if self._reasons:
                # The others wait in collectives that cannot complete: end them now, so that
                # rank 0's own wait fails at once rather than at the group's timeout.
                for process in self.processes.values():
                    if process.is_alive():
                        process.kill()
                return

    def failure(self, exc: BaseException, what: str) -> TensorParallelError:
        """The error naming the rank(s) that failed, once the watchdog has seen them."""
        deadline = time.monotonic() + 3.0
        while self.processes and not self._reasons and time.monotonic() < deadline:
            time.sleep(0.05)
        self._drain()
        if self._reasons:
            named = "; ".join(
                f"rank {rank} {reason}"
                + (f": {self._messages[rank]}" if rank in self._messages else "")
                for rank, reason in sorted(self._reasons.items())
            )
        elif self._messages:
            named = "; ".join(f"rank {r} failed: {m}" for r, m in sorted(self._messages.items()))
        else:
            named = f"a rank failed or timed out ({type(exc).__name__}: {exc})"
        if what == "joining the group" and self._reasons and not self._messages:
            # Died before running any of our code: most often spawn re-importing a script.
            named += (
                " (a script that starts an engine with tensor_parallel_size > 1 must do so "
                'under `if __name__ == "__main__":`, since spawned ranks import it again)'
            )
        self.error = TensorParallelError(
            f"tensor parallelism ({self.launch.world_size} ranks) failed while {what}: {named}. "
            "The engine cannot continue; start a new one"
        )
        self._stop_workers()
        return self.error

    def _drain(self) -> None:
        while True:
            try:
                rank, message = self.failures.get_nowait()
            except (queue.Empty, OSError, ValueError):
                return
            self._messages[rank] = message.strip().splitlines()[-1]

    # -- end -------------------------------------------------------------------------------

    def _stop_workers(self) -> None:
        self._closed.set()
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
        for process in self.processes.values():
            process.join(timeout=5)

    def shutdown(self, stop: bool = True) -> None:
        """Stop the workers (a STOP command unless they end by themselves, then kill what
        lingers) and leave the groups."""
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        atexit.unregister(self.shutdown)
        if stop and self.error is None and self.control is not None and not self._closed.is_set():
            with contextlib.suppress(Exception):
                self._closed.set()
                self.send(STOP, (), None)
            for process in self.processes.values():
                process.join(timeout=5)
        self._stop_workers()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if self.rendezvous is not None:
            shutil.rmtree(self.rendezvous, ignore_errors=True)


def _wait_for_workers(processes: dict[int, mp.Process], heartbeat) -> None:
    """Wait until every spawned worker is about to join (it sets its heartbeat to -1 then),
    so that one dying on the way (an import error; a script without a __main__ guard) fails
    the start at once rather than after the group's timeout in init_process_group."""
    while any(heartbeat[rank] != -1 for rank in processes):
        dead = [rank for rank, process in processes.items() if not process.is_alive()]
        if dead:
            raise RuntimeError(f"rank(s) {dead} exited before joining the group")
        time.sleep(0.05)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"died (killed by signal {-code})"
    return f"died (exit code {code})"


# The live group of this process: torch.distributed's default group is one per process, so a
# second tensor-parallel engine in the same process (tests) ends the first one's group.
_ACTIVE: list[WorkerGroup] = []


def _shut_down_previous() -> None:
    for group in list(_ACTIVE):
        log.info("ending the previous tensor-parallel group of this process")
        group.shutdown()


def shutdown_active() -> None:
    """End this process's tensor-parallel group, if one runs (at exit, and for tests)."""
    _shut_down_previous()


class ParallelForward:
    """The model's forward on rank 0: send the step to every rank, then run this rank's shard;
    the shards' collectives meet inside."""

    def __init__(self, group: WorkerGroup, inner: Callable) -> None:
        self.group, self.inner = group, inner

    def __call__(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        with self.group.guard("running a step"):
            batch, width = meta.block_tables.shape
            sizes = (input_ids.shape[0], batch, width)
            self.group.send(FORWARD, sizes, _pack(input_ids, positions, meta))
            return self.inner(input_ids, positions, kv_caches, meta)


class ParallelLogits:
    """compute_logits on rank 0: send the rows to every rank; each scores its part of the
    vocabulary and the all-gather inside gives every rank all of it."""

    def __init__(self, group: WorkerGroup, inner: Callable) -> None:
        self.group, self.inner = group, inner

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.group.guard("computing logits"):
            self.group.send(LOGITS, tuple(hidden.shape), hidden.contiguous())
            return self.inner(hidden)


# --------------------------------------------------------------------------- workers


def worker_main(launch: Launch, spec: WorkerSpec, heartbeat, failures) -> None:
    """A spawned worker's process: build the shard, serve rank 0's commands, report a failure
    (its traceback's last line reaches rank 0's error)."""
    try:
        if spec.device_type == "cpu":
            # The ranks share the machine's cores; one full set of threads each would thrash.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.world_size))
        else:
            torch.cuda.set_device(launch.rank)  # before NCCL binds the rank to a device
        heartbeat[launch.rank] = -1  # about to join: rank 0 waits for this before it does
        tp, control = init_groups(launch, spec.timeout_s)
        heartbeat[launch.rank] = 0
        run_worker(launch, tp, control, spec, heartbeat)
    except BaseException:
        failures.put((launch.rank, traceback.format_exc()))
        raise SystemExit(1) from None


def run_worker(launch: Launch, tp: TensorParallel, control, spec: WorkerSpec, heartbeat) -> None:
    """Build this rank's shard as rank 0 builds its own (the same collectives in the same
    order), then run rank 0's commands until STOP."""
    from compile_engine.models.config import config_from_dict
    from compile_engine.models.loader import load_model
    from compile_engine.runtime.model_runner import allocate_kv_caches, default_num_blocks

    tp = TensorParallel(tp.rank, tp.world_size, tp.group_name, spec.expert_parallel)
    device = torch.device(spec.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", launch.rank)
        torch.cuda.set_device(device)
    loaded = load_model(
        spec.model,
        dtype=spec.dtype,
        device=device,
        max_model_len=spec.max_model_len,
        config=config_from_dict(spec.model_config),
        parallel=tp,
    )
    compiled = None
    if not spec.enforce_eager:
        from compile_engine.compiler.compiled_model import CompiledForward
        from compile_engine.compiler.config import CompileConfig
        from compile_engine.kernels_generated.tuning import KernelConfig

        compile_config = CompileConfig(
            target=spec.target,
            passes=spec.passes,
            cache_dir=Path(spec.cache_dir) if spec.cache_dir else None,
            kernel=KernelConfig.from_dict(spec.kernel_config),
        )
        compiled = CompiledForward(loaded.model, compile_config, loaded.dtype)
    needed, reserve, requested = sizing_request(control)
    candidate = requested or default_num_blocks(loaded, spec.block_size, device, needed, reserve)
    num_blocks = agree_num_blocks(control, candidate)
    kv_caches = allocate_kv_caches(loaded, num_blocks, spec.block_size, device)
    forward = loaded.model.forward
    if compiled is not None:
        compiled.capture(kv_caches, before_first_run=lambda: dist.barrier(group=control))
        forward = compiled
    header = torch.zeros(4, dtype=torch.int64)
    with torch.inference_mode():
        while True:
            dist.broadcast(header, src=0, group=control)
            command, a, b, c = header.tolist()
            if command == STOP:
                return
            if command == FORWARD:
                payload = torch.empty(3 * a + b * c + 2 * b + 1, dtype=torch.int64, device=device)
                dist.broadcast(payload, src=0)
                ids, positions, meta = _unpack(payload, a, b, c)
                forward(ids, positions, kv_caches, meta)
            elif command == LOGITS:
                hidden = torch.empty(a, b, dtype=loaded.dtype, device=device)
                dist.broadcast(hidden, src=0)
                loaded.model.compute_logits(hidden)
            else:
                raise TensorParallelError(f"rank {launch.rank} got unknown command {command}")
            if heartbeat is not None:  # None under torchrun: no watchdog to read it
                heartbeat[launch.rank] += 1


# --------------------------------------------------------------------------- build


def build_parallel(
    model: str,
    out: str | Path,
    *,
    tensor_parallel_size: int,
    enable_expert_parallel: bool = False,
    timeout_s: float = 20.0,
    shard_settings: dict,
    **rank0_settings,
):
    """`compile-engine build --tensor-parallel-size N`: every rank compiles its shard into one
    artifact, rank 0 (this process) writes it. `shard_settings` (picklable: target, dtype,
    max_model_len, block_size, passes, kernel_config as a dict) reach every rank;
    `rank0_settings` only build_artifact here (progress, the step sizes, ...)."""
    from compile_engine.compiler.build import build_artifact, prepare_output
    from compile_engine.kernels_generated.tuning import KernelConfig

    out = prepare_output(out)
    device_type = "cuda" if shard_settings.get("target") == "h100" else "cpu"
    group = WorkerGroup.spawn(
        tensor_parallel_size,
        backend_for(device_type),
        timeout_s,
        enable_expert_parallel,
        _build_worker,
        (str(model), str(out), shard_settings, timeout_s, enable_expert_parallel),
    )
    try:
        settings = dict(shard_settings)
        kernel = settings.pop("kernel_config", None)
        manifest = build_artifact(
            model,
            out,
            parallel=group.tp,
            before_first_run=group.barrier,
            kernel_config=KernelConfig.from_dict(kernel) if kernel else None,
            **settings,
            **rank0_settings,
        )
        group.barrier("waiting for every rank to finish compiling")
    except RuntimeError as exc:
        if isinstance(exc, TensorParallelError):
            raise
        raise group.failure(exc, "building") from exc
    finally:
        group.shutdown(stop=False)
    return manifest


def _build_worker(
    launch: Launch,
    model: str,
    out: str,
    settings: dict,
    timeout_s: float,
    expert_parallel: bool,
    heartbeat,
    failures,
) -> None:
    """A build's rank > 0: compile its shard into the artifact's cache, then meet rank 0."""
    try:
        from compile_engine.compiler.build import compile_shard

        if launch.backend == "gloo":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.world_size))
        heartbeat[launch.rank] = -1  # about to join (see _wait_for_workers)
        tp, control = init_groups(launch, timeout_s)
        heartbeat[launch.rank] = 0
        tp = TensorParallel(tp.rank, tp.world_size, tp.group_name, expert_parallel)
        compile_shard(
            model, out, parallel=tp, before_first_run=lambda: dist.barrier(group=control),
            **settings,
        )  # fmt: skip
        dist.barrier(group=control)
    except BaseException:
        failures.put((launch.rank, traceback.format_exc()))
        raise SystemExit(1) from None
