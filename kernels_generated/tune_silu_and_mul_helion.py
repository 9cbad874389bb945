"""Autotune the Helion silu_and_mul kernel on the GPU and write its configs file.

Run on the H200 (the `h100` target), from the repository root:

    HELION_AUTOTUNE_EFFORT=quick python -m compile_engine.kernels_generated.tune_silu_and_mul_helion

(add HELION_AUTOTUNE_BUDGET_SECONDS=N to bound each shape class's search to N seconds)

For each shape class (I in 14336 for Llama-3-8B and 1536 for SmolLM2, T in 1, 64, 256, 2048)
it runs Helion's autotuner on bf16 inputs, checks the winner against the reference, times it
and the default from CUDA-graph replay, and records the faster of the two with its provenance
(device, versions, date, both times) in configs/silu_and_mul_helion.json under the target,
marking the target tuned. Other targets in the file are left as they are. `--dry-run` prints
the table without writing.

HELION_AUTOTUNE_EFFORT (none | quick | full) is read when the kernel module is imported,
which is why it is an environment variable and not a flag here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from compile_engine.kernels_generated.configs import (
    ConfigEntry,
    ConfigTable,
    TargetConfigs,
    bucket_tokens,
)

INTERS = (14336, 1536)
TOKENS = (1, 64, 256, 2048)


def tune(
    target: str = "h100",
    inters: tuple[int, ...] = INTERS,
    tokens: tuple[int, ...] = TOKENS,
    write: bool = True,
) -> ConfigTable:
    """Tune every (I, T) class on the current CUDA device; return (and write) the table."""
    import helion
    import triton

    from compile_engine.kernels_generated import silu_and_mul_helion as k
    from compile_engine.kernels_generated.timing import graph_us
    from compile_engine.models.ops import silu_and_mul_ref

    if not torch.cuda.is_available() or k.interpreted():
        raise SystemExit("tuning needs a CUDA device and compiled Helion (HELION_INTERPRET unset)")
    table = ConfigTable.load(k.CONFIG_FILE)
    device_name = torch.cuda.get_device_name()
    provenance = {
        "device": device_name,
        "dtype": "bfloat16",
        "tuned_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "helion": _helion_version(),
            "cuda": torch.version.cuda,
        },
    }
    entries = []
    for inter in inters:
        for num_tokens in tokens:
            x = torch.randn(num_tokens, 2 * inter, dtype=torch.bfloat16, device="cuda")
            gate, up = x.chunk(2, dim=-1)
            config = k.silu_and_mul_kernel.bind((gate, up)).autotune((gate, up), force=True)
            run = k.silu_and_mul_kernel.bind((gate, up)).compile_config(config, allow_print=False)
            torch.testing.assert_close(run(gate, up), silu_and_mul_ref(x))
            default_run = k.silu_and_mul_kernel.bind((gate, up)).compile_config(
                helion.Config(**table.default), allow_print=False
            )
            # Timed as the engine runs them, replayed from a CUDA graph: an eager launch of
            # a Helion kernel costs more host time than the kernel takes on the device.
            us = graph_us(lambda run=run, gate=gate, up=up: run(gate, up))
            default_us = graph_us(lambda r=default_run, gate=gate, up=up: r(gate, up))
            # A short search can end on a config slower than the default: keep the faster.
            chosen = dict(config.config) if us <= default_us else dict(table.default)
            key = {"I": inter, "T": bucket_tokens(num_tokens)}
            info = {
                **provenance,
                "chosen": "autotuned" if us <= default_us else "default",
                "autotuned_us": round(us, 3),
                "default_us": round(default_us, 3),
            }
            entries.append(ConfigEntry(key, chosen, info))
            print(
                f"I={inter:6d} T={num_tokens:5d}: {us:8.2f} us autotuned, "
                f"{default_us:8.2f} us default -> {info['chosen']}  {json.dumps(config.config)}",
                flush=True,
            )
            # Written after every class, so that a run stopped by a time limit keeps what it
            # tuned (HELION_AUTOTUNE_BUDGET_SECONDS bounds each class, not the whole run).
            table.targets[target] = TargetConfigs(
                tuned=True,
                entries=list(entries),
                note=f"tuned on {device_name} by tune_silu_and_mul_helion",
            )
            if write:
                table.save()
    if write:
        print(f"wrote {table.path}")
    return table


def _helion_version() -> str:
    from importlib.metadata import version

    return version("helion")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--inters", type=int, nargs="+", default=list(INTERS))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--dry-run", action="store_true", help="print, do not write the file")
    args = parser.parse_args(argv)
    tune(args.target, tuple(args.inters), tuple(args.tokens), write=not args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
