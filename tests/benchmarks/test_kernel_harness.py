"""The shared kernel harness (benchmarks/kernel_harness.py) and `bench kernel`, without a GPU.

Check, bench and tune run on a toy spec whose kernel is plain PyTorch, so every rule is tested
in this process: a wrong or failing candidate never wins, an entry replaces only its own key,
the table is written after every class and not at all on a dry run, a search's winner must
check. The cases marked interpreted_child run a real kernel (silu_and_mul) under the Triton
interpreter, with a fake timer, in the child that test_triton_fusions_interpreted.py starts."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from compile_engine.benchmarks import cli, kernel_harness
from compile_engine.benchmarks.kernel_harness import HarnessError, KernelSpec, bench, check, tune
from compile_engine.benchmarks.kernel_specs import KERNELS, spec_of
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import CONFIG_DIR, ConfigTable, bucket_tokens

interpreted = pytest.mark.interpreted_child("TRITON_INTERPRET")
INFO = {"device": "fake GPU", "dtype": "float32"}  # the provenance a test's entries record
# The toy's candidates by number: the fastest is wrong, the next fails to launch, so 4 wins.
TIMES = {1: 5.0, 2: 0.5, 3: 1.0, 4: 3.0}


def toy(launched: list | None = None, **changes) -> KernelSpec:
    """A kernel that doubles x: the launch config's factor (3 is wrong), `broken` raises."""
    launched = [] if launched is None else launched

    def launch(inputs: tuple, config: dict | None) -> torch.Tensor:
        launched.append(config)
        if config is None:
            return inputs[0] * 2
        if config.get("broken"):
            raise RuntimeError("out of resources")
        return inputs[0] * config["factor"]

    def make_inputs(shape, dtype, device, seed):
        return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype),)

    fields = dict(
        name="toy",
        fields=("T", "H"),
        cpu_shapes=((3, 8), (1, 5)),
        gpu_shapes=((64, 8),),
        make_inputs=make_inputs,
        launch=launch,
        reference=lambda inputs: inputs[0] * 2,
        moved_bytes=lambda shape, size: 2 * shape[0] * shape[1] * size,
        interpreted=lambda: True,
        shape_key=lambda shape: {"H": shape[1], "T": bucket_tokens(shape[0])},
        candidates=lambda shape: [
            {"factor": 2, "n": 1},
            {"factor": 3, "n": 2},
            {"broken": True, "n": 3},
            {"factor": 2, "n": 4},
        ],
    )
    return KernelSpec(**{**fields, **changes})


def timer_of(launched: list):
    """A fake timer: runs the call once, as the real one does, and returns the time of the
    config it launched (TIMES by its number)."""

    def timer(fn, graph: bool = True) -> float:
        fn()
        return TIMES[launched[-1]["n"]]

    return timer


@pytest.fixture
def table_file(tmp_path):
    """A toy table: an h100 entry the tuning replaces (T 64) and one it must keep (T 2)."""
    entries = [
        {"key": {"H": 8, "T": 64}, "config": {"factor": 2, "n": 1}, "old": True},
        {"key": {"H": 8, "T": 2}, "config": {"factor": 2, "n": 1}, "old": True},
    ]
    data = {
        "kernel": "toy",
        "key": ["H", "T"],
        "default": {"factor": 2, "n": 1},
        "targets": {
            "h100": {"tuned": True, "entries": entries},
            "cpu": {"tuned": False, "note": "untouched", "entries": []},
        },
    }
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(data))
    return path


# --------------------------------------------------------------------------- check


def test_check_compares_every_launch_and_sibling_with_the_reference():
    launched = []
    spec = toy(
        launched,
        check_configs=lambda shape, device: (None, {"factor": 2, "n": 1}),
        also=lambda inputs: [(inputs[0] + 1, inputs[0] + 1)],
    )
    assert check(spec, device="cpu") == 0.0
    assert launched == [None, {"factor": 2, "n": 1}] * 2  # both configs at both CPU shapes
    assert check(spec, device="cpu", shapes=((2, 4),), config={"factor": 2, "n": 9}) == 0.0


def test_check_names_the_shape_and_config_that_differ():
    with pytest.raises(AssertionError, match=r"toy T=3 H=8 torch.float32 \{'factor': 3\}"):
        check(toy(), device="cpu", config={"factor": 3})
    wrong = toy(also=lambda inputs: [(inputs[0], inputs[0] * 5)])
    with pytest.raises(AssertionError, match="toy T=3 H=8"):
        check(wrong, device="cpu")


def test_check_with_an_error_measure_of_its_own():
    def relative(got, want, dtype):
        err = ((got - want).abs().max() / want.abs().max()).item()
        if err > 0.4:
            raise AssertionError(f"relative error {err:.2f}")
        return err

    spec = toy(compare=relative, check_configs=lambda shape, device: ({"factor": 2.5},))
    assert check(spec, device="cpu") == pytest.approx(0.25)
    with pytest.raises(AssertionError, match=r"toy T=3 H=8 .*relative error 0.50"):
        check(spec, device="cpu", config={"factor": 3})


def test_cpu_needs_the_interpreter_and_timing_a_gpu():
    spec = toy(interpreted=lambda: False)
    with pytest.raises(HarnessError, match="TRITON_INTERPRET=1 compile-engine bench kernel toy"):
        check(spec, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(HarnessError, match="CUDA device"):
            bench(spec)
        with pytest.raises(HarnessError, match="CUDA device"):
            tune(spec)


# --------------------------------------------------------------------------- bench


def test_bench_rows_time_the_kernel_and_the_baseline():
    seen = []

    def timer(fn, graph=True):
        seen.append(graph)
        return 2.0 if graph else 8.0

    rows = bench(toy(), device="cpu", shapes=((4, 8),), timer=timer)
    assert rows == [
        {
            "T": 4,
            "H": 8,
            "bytes": 256,
            "triton_us": 2.0,
            "triton_gbs": 0.1,
            "reference_us": 2.0,
            "reference_gbs": 0.1,
            "speedup": 1.0,
        }
    ]
    # A baseline that synchronises the host is timed eagerly, not captured.
    loop = toy(baseline=("loop", lambda inputs: inputs[0] * 2, False), label="helion")
    row = bench(loop, device="cpu", shapes=((4, 8),), timer=timer)[0]
    assert (row["helion_us"], row["loop_us"], row["speedup"]) == (2.0, 8.0, 4.0)
    assert seen == [True, True, True, False]


# --------------------------------------------------------------------------- tune


def test_tune_keeps_the_fastest_candidate_that_matches(table_file, capsys):
    launched = []
    spec = toy(launched)
    before = tuning.default()
    table = tune(spec, shapes=((64, 8),), path=table_file, device="cpu",
                 timer=timer_of(launched), info=INFO)  # fmt: skip
    out = capsys.readouterr().out
    assert "does not match the reference" in out and "RuntimeError: out of resources" in out
    written = ConfigTable.load(table_file)
    assert written.as_dict() == table.as_dict()
    section = written.targets["h100"]
    assert section.tuned
    assert section.note == "tuned on fake GPU by `compile-engine bench kernel toy --tune`"
    entries = {e.key["T"]: e for e in section.entries}
    assert entries[2].config == {"factor": 2, "n": 1} and entries[2].info == {"old": True}
    tuned = entries[64]  # the key the shape class maps to: replaced, not doubled
    assert [e.key for e in section.entries].count({"H": 8, "T": 64}) == 1
    assert tuned.config == {"factor": 2, "n": 4}
    assert tuned.info == {**INFO, "us": 3.0, "worst_us": 5.0, "timed": 2}
    assert written.targets["cpu"].note == "untouched" and not written.targets["cpu"].entries
    assert tuning.default() is not before  # rebuilt: a retuned table is a new config's


def test_tune_adds_a_target_and_a_dry_run_writes_nothing(table_file):
    launched = []
    text = table_file.read_text()
    table = tune(toy(launched), shapes=((5, 8),), target="b200", path=table_file, write=False,
                 device="cpu", timer=timer_of(launched), info=INFO)  # fmt: skip
    assert table_file.read_text() == text
    assert [e.key for e in table.targets["b200"].entries] == [{"H": 8, "T": 8}]


def test_a_search_of_its_own_and_a_run_cut_short(table_file):
    calls = []

    def search(inputs, shape, *, timer, default):
        calls.append(shape)
        if shape[0] == 16:
            raise RuntimeError("the time limit")
        return dict(default), {"chosen": "default"}

    spec = toy(search=search, candidates=None)
    with pytest.raises(RuntimeError, match="the time limit"):
        tune(spec, shapes=((4, 8), (16, 8)), path=table_file, device="cpu", info=INFO)
    assert calls == [(4, 8), (16, 8)]
    # The first class was written before the second failed.
    entry = ConfigTable.load(table_file).nearest("h100", {"H": 8, "T": 4})
    assert entry.key == {"H": 8, "T": 4} and entry.info == {**INFO, "chosen": "default"}


def test_a_searched_config_must_match_the_reference(table_file):
    text = table_file.read_text()
    spec = toy(search=lambda inputs, shape, *, timer, default: ({"factor": 3}, {}))
    with pytest.raises(AssertionError, match="toy T=4 H=8"):
        tune(spec, shapes=((4, 8),), path=table_file, device="cpu", info=INFO)
    assert table_file.read_text() == text


def test_a_tuner_of_its_own_and_kernels_without_a_table(table_file):
    given = []
    spec = toy(tuner=given.append)
    assert tune(spec, path=table_file).kernel == "toy"
    tune(spec, path=table_file, write=False)
    assert given == [table_file, None]
    with pytest.raises(HarnessError, match="no tuned table"):
        tune(toy(shape_key=None), path=table_file, device="cpu")


# --------------------------------------------------------------------------- the specs, the CLI


def test_every_kernel_lists_its_shape_fields():
    for name, (summary, _) in KERNELS.items():
        if name == "silu_and_mul_helion" and importlib.util.find_spec("helion") is None:
            continue
        spec = spec_of(name)
        assert spec.name == name and summary.endswith(f"shape {','.join(spec.fields)}")
        assert spec.shape_key is None or (CONFIG_DIR / f"{name}.json").is_file()
        for shape in (*spec.cpu_shapes, *spec.gpu_shapes, *spec.tune_shapes):
            assert len(shape) == len(spec.fields), (name, shape)


def test_cli_lists_the_kernels(capsys):
    assert "kernel" in cli.usage()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["kernel", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in KERNELS)


def test_cli_refuses_what_it_cannot_do(capsys):
    with pytest.raises(SystemExit):
        kernel_harness.main(["add_rms_norm", "--dry-run"])  # --dry-run goes with --tune
    with pytest.raises(SystemExit):
        kernel_harness.main(["no_such_kernel"])
    assert kernel_harness.main(["rotary", "--shapes", "1,2"]) == 2
    assert "a rotary shape is T,Hq,Hkv,D" in capsys.readouterr().err
    assert kernel_harness.main(["argmax", "--tune"]) == 2
    assert "no tuned table" in capsys.readouterr().err
    if not spec_of("add_rms_norm").interpreted() and not torch.cuda.is_available():
        assert kernel_harness.main(["add_rms_norm"]) == 2
        assert "TRITON_INTERPRET=1" in capsys.readouterr().err


# --------------------------------------------------------------------------- a real kernel


@interpreted
def test_interpreted_tune_of_a_real_kernel_with_a_fake_timer(tmp_path):
    spec = spec_of("silu_and_mul")
    path = tmp_path / "silu_and_mul.json"
    path.write_bytes((CONFIG_DIR / "silu_and_mul.json").read_bytes())
    candidates = spec.candidates((5, 40))
    times = iter([9.0, 8.0, 7.0, 1.0, *[5.0] * (len(candidates) - 4)])

    def timer(fn, graph=True):
        fn()  # the candidate runs under the interpreter, as it would on the GPU
        return next(times)

    tune(spec, shapes=((5, 40),), path=path, device="cpu", timer=timer, info=INFO)
    section = ConfigTable.load(path).targets["h100"]
    entry = {e.key["I"]: e for e in section.entries}[40]
    assert entry.key == {"I": 40, "T": 8} and entry.config == candidates[3]
    assert entry.info["us"] == 1.0 and entry.info["timed"] == len(candidates)
    shipped = ConfigTable.load(CONFIG_DIR / "silu_and_mul.json").targets["h100"].entries
    assert [e for e in section.entries if e.key["I"] != 40] == shipped  # kept as they were


@interpreted
def test_interpreted_cli_checks_on_cpu_and_records(tmp_path, capsys):
    assert kernel_harness.main(["silu_and_mul", "--shapes", "5,40", "--out", str(tmp_path)]) == 0
    assert "check on cpu: largest error" in capsys.readouterr().out
    (record,) = tmp_path.glob("kernel-silu_and_mul-*.json")
    data = json.loads(record.read_text())
    assert data["kernel"] == "silu_and_mul" and data["check_device"] == "cpu"
    assert data["check_error"] < 1e-5 and data["rows"] == []
