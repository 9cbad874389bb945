"""One harness checks, benchmarks and tunes every kernel of kernels_generated/.

    compile-engine bench kernel <name>                    # check; on CUDA, bench too
    compile-engine bench kernel <name> --tune [--dry-run] # time the candidates, write the table
    compile-engine bench kernel --help                    # the kernels

A kernel joins with a `KernelSpec` in benchmarks/kernel_specs.py: its name (that of its table,
kernels_generated/configs/<name>.json), the shape classes to check on CPU and on CUDA and to
tune, how to make inputs for a shape, the kernel call (the op as a pass emits it, or one launch
config), the reference, the bytes the op must move, the table's key of a shape, the candidate
configs and the tolerance per dtype. The kernel file keeps the kernel, its launcher, its
reference and its op (STYLE #15); this file and the specs hold the rest.

- check: the kernel against its reference at every shape of this machine's device (CPU: small
  float32 shapes under the interpreter, TRITON_INTERPRET=1 or HELION_INTERPRET=1 set before
  the kernel module is imported; CUDA: real shapes in bf16); returns the largest error.
- bench: microseconds and GB/s of the kernel and of its eager reference (or the spec's
  baseline), each replayed from a CUDA graph (benchmarks/timing.py): a fusion kernel runs for
  less than one Python launch, so eager timing measures the host. Inductor's fusion of the
  reference is `bench fusions`'s to time.
- tune: per shape class, every candidate config that matches the reference is timed on the GPU
  and the fastest kept (or the spec's own search finds one: Helion's autotuner, the MoE GEMMs'
  two stages; or the spec names a tuner of its own: the skinny GEMM's `bench gemm` sweep). Its
  entry, with provenance (configs.tuning_provenance) and times, replaces the entry of the same
  key under the target; other entries stay. The table is written after every class, so a run
  cut short keeps what it tuned. A retuned table is a new KernelConfig's (the key hashes its
  bytes), so the default config is rebuilt afterwards.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

Shape = tuple[int, ...]
# Microseconds of one call of fn: replayed from a CUDA graph, or with graph=False timed eagerly
# (a baseline that synchronises the host cannot be captured).
Timer = Callable[..., float]


class HarnessError(RuntimeError):
    """A kernel cannot be checked, benchmarked or tuned here; the message says what to do."""


def _no_configs(shape: Shape, device: str) -> Sequence[dict | None]:
    return (None,)


def _torch_defaults(dtype: torch.dtype) -> dict:
    return {}


@dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """What the harness needs of one kernel; every callable takes the spec's own types: a shape
    is a tuple of ints named by `fields`, inputs are the tuple `make_inputs` returns."""

    name: str  # that of its table in kernels_generated/configs/, and of `bench kernel <name>`
    fields: tuple[str, ...]  # the names of a shape's numbers, e.g. ("T", "H")
    cpu_shapes: tuple[Shape, ...]  # checked under the interpreter
    gpu_shapes: tuple[Shape, ...]  # checked and timed on CUDA
    make_inputs: Callable[[Shape, torch.dtype, str, int], tuple]  # (shape, dtype, device, seed)
    # The kernel on these inputs: with None as a pass emits it (the op, the default
    # KernelConfig's key: its tuned table), else with this launch config.
    launch: Callable[[tuple, dict | None], object]
    reference: Callable[[tuple], object]
    moved_bytes: Callable[[Shape, int], int]  # (shape, element size): what the op must move
    interpreted: Callable[[], bool]  # whether the kernel module was imported interpreted
    interpreter: str = "TRITON_INTERPRET"
    label: str = "triton"  # the kernel's column in bench's rows
    tolerance: Callable[[torch.dtype], dict] = _torch_defaults  # assert_close's rtol / atol
    # An error measure of its own (returns the error, raises AssertionError past its bound).
    compare: Callable[[torch.Tensor, torch.Tensor, torch.dtype], float] | None = None
    # The launch configs check() runs at a shape and device (None: the tuned default).
    check_configs: Callable[[Shape, str], Sequence[dict | None]] = _no_configs
    # More (kernel output, reference output) pairs to check: a sibling op of the same kernel.
    also: Callable[[tuple], Sequence[tuple[torch.Tensor, torch.Tensor]]] | None = None
    # What bench times the kernel against, when not the reference; captured=False: it
    # synchronises the host, so it is timed eagerly.
    baseline: tuple[str, Callable[[tuple], object], bool] | None = None
    shape_key: Callable[[Shape], dict[str, int]] | None = None  # None: no tuned table
    tune_shapes: tuple[Shape, ...] = ()  # () : gpu_shapes
    candidates: Callable[[Shape], Sequence[dict]] | None = None
    # A search of its own: (inputs, shape, timer=, default=table default) -> (config, timings)
    # or None when nothing ran.
    search: Callable[..., tuple[dict, dict] | None] | None = None
    # A tuner of its own, given the table to write (None: a dry run).
    tuner: Callable[[Path | None], object] | None = None
    versions: Callable[[], dict] = dict  # versions the provenance records beyond torch, triton


def device_of(spec: KernelSpec) -> str:
    """Where `check` runs by default: CUDA with compiled kernels, else the CPU."""
    return "cuda" if torch.cuda.is_available() and not spec.interpreted() else "cpu"


def _runs_on(spec: KernelSpec, device: str) -> None:
    if device == "cpu" and not spec.interpreted():
        raise HarnessError(
            f"{spec.name} runs on CPU tensors only under its interpreter: set "
            f"{spec.interpreter}=1 before the kernel is imported (`{spec.interpreter}=1 "
            f"compile-engine bench kernel {spec.name}`)"
        )
    if device == "cuda" and (not torch.cuda.is_available() or spec.interpreted()):
        raise HarnessError(
            f"{spec.name}: timing and tuning need a CUDA device and compiled kernels "
            f"({spec.interpreter} unset)"
        )


def _outputs(result: object) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _show(spec: KernelSpec, shape: Shape) -> str:
    return " ".join(f"{name}={value}" for name, value in zip(spec.fields, shape, strict=True))


def compare(
    spec: KernelSpec, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, where: str
) -> float:
    """The spec's error of `got` against `want`; AssertionError, naming `where`, past its
    tolerance."""
    if spec.compare is not None:
        try:
            return spec.compare(got, want, dtype)
        except AssertionError as err:
            raise AssertionError(f"{where}: {err}") from None
    torch.testing.assert_close(got, want, **spec.tolerance(dtype), msg=lambda m: f"{where}: {m}")
    return (got.float() - want.float()).abs().max().item() if got.numel() else 0.0


def check(
    spec: KernelSpec,
    *,
    device: str | None = None,
    shapes: Sequence[Shape] | None = None,
    dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> float:
    """The kernel against its reference at each shape (default: the device's shape classes) in
    `dtype` (float32 on CPU, bf16 on CUDA), with the spec's check configs or only `config`;
    returns the largest error, raises AssertionError past the tolerance."""
    device = device or device_of(spec)
    _runs_on(spec, device)
    if shapes is None:
        shapes = spec.cpu_shapes if device == "cpu" else spec.gpu_shapes
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    worst = 0.0
    for seed, shape in enumerate(shapes):
        inputs = spec.make_inputs(shape, dtype, device, seed)
        want = _outputs(spec.reference(inputs))
        configs = (config,) if config is not None else spec.check_configs(shape, device)
        pairs = [
            (c, got, expected)
            for c in configs
            for got, expected in zip(_outputs(spec.launch(inputs, c)), want, strict=True)
        ]
        if spec.also is not None:
            pairs += [(None, got, expected) for got, expected in spec.also(inputs)]
        for c, got, expected in pairs:
            where = f"{spec.name} {_show(spec, shape)} {dtype}" + (f" {c}" if c else "")
            worst = max(worst, compare(spec, got, expected, dtype, where))
    return worst


def time_us(fn: Callable[[], object], graph: bool = True) -> float:
    """Microseconds of one fn(): replayed from a CUDA graph, or eagerly between CUDA events."""
    from compile_engine.benchmarks.timing import event_seconds, graph_us

    return graph_us(fn) if graph else event_seconds(fn, iters=10, inner=5) * 1e6


def bench(
    spec: KernelSpec,
    *,
    shapes: Sequence[Shape] | None = None,
    device: str = "cuda",
    timer: Timer | None = None,
) -> list[dict]:
    """Per shape (default: the CUDA shape classes, bf16): microseconds and GB/s of the kernel as
    a pass emits it and of the baseline (the eager reference unless the spec names another)."""
    if timer is None:
        _runs_on(spec, device)
    timer = timer or time_us
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base_name, base_fn, captured = spec.baseline or ("reference", spec.reference, True)
    rows = []
    for seed, shape in enumerate(shapes or spec.gpu_shapes):
        inputs = spec.make_inputs(shape, dtype, device, seed)
        moved = spec.moved_bytes(shape, dtype.itemsize)
        row: dict = {**dict(zip(spec.fields, shape, strict=True)), "bytes": moved}
        variants = (
            (spec.label, lambda inputs=inputs: spec.launch(inputs, None), True),
            (base_name, lambda inputs=inputs: base_fn(inputs), captured),
        )
        for name, fn, graph in variants:
            us = timer(fn, graph)
            row[f"{name}_us"], row[f"{name}_gbs"] = round(us, 2), round(moved / us / 1e3, 1)
        row["speedup"] = round(row[f"{base_name}_us"] / row[f"{spec.label}_us"], 2)
        rows.append(row)
        print(
            f"{_show(spec, shape):28s} {spec.label} {row[f'{spec.label}_us']:9.2f} us "
            f"{row[f'{spec.label}_gbs']:7.1f} GB/s   {base_name} {row[f'{base_name}_us']:9.2f} us "
            f"{row[f'{base_name}_gbs']:7.1f} GB/s   x{row['speedup']:.2f}",
            flush=True,
        )
    return rows


def _fastest(
    spec: KernelSpec, inputs: tuple, shape: Shape, dtype: torch.dtype, timer: Timer
) -> tuple[dict, dict] | None:
    """Every candidate config that matches the reference, timed; the fastest and the times."""
    want = _outputs(spec.reference(inputs))
    times = []
    for config in spec.candidates(shape):
        where = f"{spec.name} {_show(spec, shape)} {config}"
        try:
            for got, expected in zip(_outputs(spec.launch(inputs, config)), want, strict=True):
                compare(spec, got, expected, dtype, where)
            us = timer(lambda config=config: spec.launch(inputs, config))
        except AssertionError as err:  # fast and wrong must not win
            print(f"  skip {config}: does not match the reference: {str(err)[:200]}", flush=True)
            continue
        except Exception as err:  # a config that does not compile or launch is data too
            print(f"  skip {config}: {type(err).__name__}: {str(err)[:200]}", flush=True)
            continue
        times.append((us, config))
    if not times:
        return None
    us, best = min(times, key=lambda t: t[0])
    worst = max(t[0] for t in times)
    return dict(best), {"us": round(us, 2), "worst_us": round(worst, 2), "timed": len(times)}


def table_path(spec: KernelSpec) -> Path:
    from compile_engine.kernels_generated.configs import CONFIG_DIR

    return CONFIG_DIR / f"{spec.name}.json"


def provenance(spec: KernelSpec, dtype: torch.dtype) -> dict:
    """configs.tuning_provenance of this CUDA device, with the spec's further versions."""
    from compile_engine.kernels_generated.configs import tuning_provenance

    info = tuning_provenance(str(dtype).removeprefix("torch."))
    info["versions"] = {**info["versions"], **spec.versions()}
    return info


def tune(
    spec: KernelSpec,
    *,
    shapes: Sequence[Shape] | None = None,
    target: str = "h100",
    path: str | Path | None = None,
    write: bool = True,
    device: str = "cuda",
    timer: Timer | None = None,
    info: dict | None = None,
):
    """Tune each shape class (default: the spec's tune shapes, bf16 on CUDA) and record the
    winner under `target` in the table at `path` (default: the kernel's shipped table); see
    the module docstring. `device`, `timer` and `info` (the provenance) are for tests: on CPU
    under the interpreter, a fake timer. Returns the table."""
    from compile_engine.kernels_generated import tuning
    from compile_engine.kernels_generated.configs import ConfigEntry, ConfigTable, TargetConfigs

    path = Path(path or table_path(spec))
    if spec.tuner is not None:
        spec.tuner(path if write else None)
        return ConfigTable.load(path)
    if spec.shape_key is None or (spec.candidates is None and spec.search is None):
        raise HarnessError(f"{spec.name} has no tuned table: nothing to tune")
    _runs_on(spec, device)
    timer = timer or time_us
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    info = info if info is not None else provenance(spec, dtype)
    table = ConfigTable.load(path)
    section = table.targets.setdefault(target, TargetConfigs(True, []))
    section.tuned = True
    section.note = f"tuned on {info['device']} by `compile-engine bench kernel {spec.name} --tune`"
    for seed, shape in enumerate(shapes or spec.tune_shapes or spec.gpu_shapes):
        start = time.perf_counter()
        inputs = spec.make_inputs(shape, dtype, device, seed)
        if spec.search is not None:
            found = spec.search(inputs, shape, timer=timer, default=table.default)
            if found is not None:  # an entry is written only for a config that checks
                check(spec, device=device, shapes=(shape,), dtype=dtype, config=found[0])
        else:
            found = _fastest(spec, inputs, shape, dtype, timer)
        if found is None:
            print(f"{_show(spec, shape)}: no candidate ran; the table keeps what it had")
            continue
        config, times = found
        key = spec.shape_key(shape)
        entry = ConfigEntry(key, config, {**info, **times})
        keys = [e.key for e in section.entries]
        if key in keys:  # in its place, so a retuned table's diff is the entries that changed
            section.entries[keys.index(key)] = entry
        else:
            section.entries.append(entry)
        seconds = time.perf_counter() - start
        print(f"{_show(spec, shape)}: {config} {times} ({seconds:.1f} s)", flush=True)
        if write:
            table.save(path)
    if write:
        print(f"wrote {path}")
        tuning.default.cache_clear()  # the next default config reads the new table
    return table


def _parse_shapes(spec: KernelSpec, texts: Sequence[str]) -> list[Shape]:
    shapes = []
    for text in texts:
        shape = tuple(int(n) for n in text.split(","))
        if len(shape) != len(spec.fields):
            raise HarnessError(
                f"--shapes {text}: a {spec.name} shape is {','.join(spec.fields)} "
                f"({len(spec.fields)} numbers)"
            )
        shapes.append(shape)
    return shapes


def build_parser() -> argparse.ArgumentParser:
    from compile_engine.benchmarks.kernel_specs import KERNELS

    width = max(map(len, KERNELS))
    listing = "\n".join(f"  {name:<{width}}  {summary}" for name, (summary, _) in KERNELS.items())
    p = argparse.ArgumentParser(
        prog="bench kernel",
        description=__doc__.splitlines()[0],
        epilog=f"kernels:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", choices=list(KERNELS), metavar="name", help="the kernel (below)")
    p.add_argument(
        "--tune", action="store_true", help="time the candidates per shape class on this GPU"
    )
    p.add_argument("--dry-run", action="store_true", help="with --tune: print, write no table")
    p.add_argument(
        "--shapes", nargs="+", metavar="N,N", help="shape classes in the kernel's field order"
    )
    p.add_argument("--target", default="h100", help="the table's target tuned for")
    p.add_argument("--table", help="tune into this file (default: configs/<name>.json)")
    p.add_argument("--out", help="also write the check and bench as a JSON record here")
    return p


def main(argv: list[str] | None = None) -> int:
    from compile_engine.benchmarks.kernel_specs import spec_of

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dry_run and not args.tune:
        parser.error("--dry-run goes with --tune")
    spec = spec_of(args.name)
    try:
        shapes = _parse_shapes(spec, args.shapes) if args.shapes else None
        if args.tune:
            tune(spec, shapes=shapes, target=args.target, path=args.table, write=not args.dry_run)
            return 0
        device = device_of(spec)
        start = time.perf_counter()
        error = check(spec, device=device, shapes=shapes)
        print(f"check on {device}: largest error {error:.3g} ({time.perf_counter() - start:.1f} s)")
        rows = bench(spec, shapes=shapes) if device == "cuda" else []
    except HarnessError as err:
        print(f"bench kernel: {err}", file=sys.stderr)
        return 2
    if args.out:
        from compile_engine.benchmarks.results import write_result

        payload = {
            "kernel": spec.name,
            "check_device": device,
            "check_error": error,
            "timing": "CUDA-graph replay (triton.testing.do_bench_cudagraph), median per call",
            "rows": rows,
        }
        print(f"wrote {write_result(f'kernel-{spec.name}', payload, directory=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
