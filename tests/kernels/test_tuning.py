"""kernels_generated/tuning.py: a KernelConfig is validated at construction (unknown fields and
bad values are KernelConfigError, saying what is allowed), its key covers the settings and
every tuned table's bytes, and the key a kernel op receives resolves to the config."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import CONFIG_DIR
from compile_engine.kernels_generated.tuning import (
    AttentionTuning,
    DecodeConfig,
    KernelConfig,
    KernelConfigError,
    LatentConfig,
    MlaTuning,
)


def _table_copy(tmp_path, kernel: str = "skinny_gemm", name: str = "t.json"):
    path = tmp_path / name
    path.write_bytes((CONFIG_DIR / f"{kernel}.json").read_bytes())
    return path


@pytest.mark.parametrize(
    "data, match",
    [
        ({"pdl_trigger": "late"}, r"unknown kernel config fields \['pdl_trigger'\]"),
        ({"attention": {"fused_reduce": False}}, r"unknown attention fields \['fused_reduce'\]"),
        ({"mla": {"block_n": 32}}, r"unknown mla fields \['block_n'\]"),
        ({"tables": {"cutlass": "x.json"}}, r"tables names unknown kernels \['cutlass'\]"),
        ("[1, 2]", "a kernel config is a JSON object"),
        ("{pdl: false}", "is not JSON"),
    ],
    ids=["field", "attention-field", "mla-field", "table-kernel", "not-an-object", "not-json"],
)
def test_unknown_fields_are_an_error_naming_the_known_ones(data, match):
    with pytest.raises(KernelConfigError, match=match):
        KernelConfig.coerce(data)


TILED = {"rows": 16, "block_n": 16, "num_warps": 1, "num_stages": 1}
TIER = {"least": 1, "block_n": 16, "num_warps": 1, "num_stages": 1, "min_split_keys": 16}
LATENT = {"block_n": 16, "block_h": 16, "num_warps": 1, "num_stages": 1, "reduce_warps": 1}


@pytest.mark.parametrize(
    "data, match",
    [
        ({"pdl": "yes"}, "pdl='yes': want true or false"),
        ({"pdl_max_rows": -1}, "pdl_max_rows=-1: want a whole number >= 0"),
        ({"pdl_prefetch_tiles": 1.5}, "pdl_prefetch_tiles=1.5: want a whole number"),
        ({"pdl_prefetch_tiles": True}, "pdl_prefetch_tiles=True: want a whole number"),
        ({"tables": {"rotary": "/no/such/table.json"}}, "tables.rotary: .* is not a file"),
        ({"attention": {"max_splits": 0}}, "attention.max_splits must be >= 1"),
        ({"attention": {"tiled_cpu": {**TILED, "rows": 8}}}, "rows must be >= 16"),
        ({"attention": {"decode_cpu": [{**TIER, "block_n": 24}]}}, "block_n=24 must be a power"),
        ({"attention": {"decode_cuda": [{**TIER, "least": 2}]}}, "first tier with least 1"),
        ({"attention": {"decode_cpu": [{"least": 1, "block": 16}]}}, "attention .*block"),
        ({"mla": {"min_split_keys": 0}}, "mla.min_split_keys must be >= 1"),
        ({"mla": {"reduce_block_r": 96}}, "reduce_block_r=96 must be a power"),
        ({"mla": {"latent_cpu": {**LATENT, "block_n": 8}}}, "block_n must be >= 16"),
        ({"mla": {"latent_cuda": {**LATENT, "block_h": 12}}}, "block_h=12 must be a power"),
        ({"mla": {"latent_cpu": {**LATENT, "num_warps": 0}}}, "num_warps must be >= 1"),
        ({"mla": {"latent_cpu": {"block_n": 16}}}, "mla .*missing"),
        ({"mla": 3}, "mla must be an object"),
    ],
    ids=lambda v: None if isinstance(v, str) else json.dumps(v)[:40],
)
def test_bad_values_are_an_error(data, match):
    with pytest.raises(KernelConfigError, match=match):
        KernelConfig.from_dict(data)


def test_decode_tiers_must_grow():
    tier = DecodeConfig(1, 16, 1, 1, min_split_keys=16)
    attention = dataclasses.replace(AttentionTuning(), decode_cpu=(tier, tier))
    with pytest.raises(KernelConfigError, match="tiers must grow"):
        KernelConfig(attention=attention)


def test_key_changes_when_a_table_changes_its_bytes(tmp_path):
    path = _table_copy(tmp_path)
    before = KernelConfig(tables={"skinny_gemm": str(path)})
    assert KernelConfig(tables={"skinny_gemm": str(path)}).key == before.key  # same bytes
    data = json.loads(path.read_text())
    data["targets"]["h100"]["entries"][0]["config"] = {"kernel": "cublas"}
    path.write_text(json.dumps(data))
    after = KernelConfig(tables={"skinny_gemm": str(path)})
    assert after.key != before.key
    assert after == before  # the same settings: only the key tells the tables apart
    # Both stay resolvable: a graph captured with the first keeps its key.
    assert tuning.resolve(before.key) is before and tuning.resolve(after.key) is after


def test_key_changes_with_each_setting():
    default = tuning.default()
    keys = {
        default.key,
        KernelConfig(pdl=False).key,
        KernelConfig(pdl_max_rows=8).key,
        KernelConfig(pdl_prefetch_tiles=0).key,
        KernelConfig(attention=dataclasses.replace(AttentionTuning(), combine_splits=4)).key,
        KernelConfig(mla=dataclasses.replace(MlaTuning(), max_splits=32)).key,
    }
    assert len(keys) == 6
    assert KernelConfig().key == default.key  # content, not identity


def test_round_trips_through_its_dict_and_json(tmp_path):
    path = _table_copy(tmp_path, "rotary")
    config = KernelConfig(
        pdl=False,
        pdl_prefetch_tiles=2,
        tables={"rotary": str(path)},
        attention=dataclasses.replace(AttentionTuning(), max_splits=16),
        mla=MlaTuning(latent_cpu=LatentConfig(32, 16, num_warps=2, num_stages=1, reduce_warps=1)),
    )
    again = KernelConfig.coerce(json.dumps(config.to_dict()))
    assert again == config and again.key == config.key
    assert KernelConfig.coerce(config) is config
    assert KernelConfig.coerce(None) == tuning.default()
    partial = KernelConfig.coerce('{"pdl": false}')  # the rest default
    assert partial == KernelConfig(pdl=False)


def test_describe_names_each_table_and_its_hash(tmp_path):
    path = _table_copy(tmp_path, "silu_and_mul")
    described = KernelConfig(tables={"silu_and_mul": str(path)}).describe()
    assert set(described["tables"]) == set(tuning.TABLES)
    assert described["tables"]["silu_and_mul"]["file"] == str(path)
    assert described["tables"]["rotary"]["file"] == "configs/rotary.json"
    sha = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    assert described["tables"]["silu_and_mul"]["sha256"] == sha
    assert described["settings"]["tables"] == {"silu_and_mul": str(path)}


def test_table_reads_the_named_file(tmp_path):
    path = _table_copy(tmp_path, "silu_and_mul")
    data = json.loads(path.read_text())
    data["default"] = {"BLOCK": 64, "num_warps": 2}
    path.write_text(json.dumps(data))
    config = KernelConfig(tables={"silu_and_mul": str(path)})
    assert config.table("silu_and_mul").default == {"BLOCK": 64, "num_warps": 2}
    assert tuning.default().table("silu_and_mul").default != config.table("silu_and_mul").default
    assert config.table_path("rotary") == CONFIG_DIR / "rotary.json"


def test_unknown_key_is_an_error():
    with pytest.raises(KernelConfigError, match="unknown in this process"):
        tuning.resolve("0123456789abcdef")
    assert tuning.resolve(tuning.default().key) == tuning.default()


def test_a_table_path_may_be_a_path_and_a_bad_tables_value_is_named(tmp_path):
    path = _table_copy(tmp_path, "rotary")
    assert KernelConfig(tables={"rotary": path}) == KernelConfig(tables={"rotary": str(path)})
    with pytest.raises(KernelConfigError, match="want an object of kernel -> table file"):
        KernelConfig.from_dict({"tables": "rotary.json"})
    with pytest.raises(KernelConfigError, match=r"attention.max_splits=1.5: want a whole number"):
        KernelConfig.from_dict({"attention": {"max_splits": 1.5}})
    with pytest.raises(KernelConfigError, match=r"decode_cpu.block_n=True: want a whole number"):
        KernelConfig.from_dict({"attention": {"decode_cpu": [{**_tier(), "block_n": True}]}})


def _tier() -> dict:
    return dataclasses.asdict(AttentionTuning().decode_cpu[0])


def test_the_tables_a_config_uses_are_the_bytes_its_key_covers(tmp_path):
    path = _table_copy(tmp_path, "rotary")
    before = KernelConfig(tables={"rotary": str(path)})
    data = json.loads(path.read_text())
    data["default"]["num_warps"] = 8
    path.write_text(json.dumps(data))  # rewritten after the config was built
    assert before.table("rotary").default != data["default"]
    after = KernelConfig(tables={"rotary": str(path)})
    assert after.table("rotary").default == data["default"] and after.key != before.key


def test_mla_defaults_are_the_measured_tiles_and_split_policy():
    # The values the MLA kernel launched with before they were kernel config: H200 tiles
    # (docs/mla.md), the interpreter's, 256 keys a split at least, 64 splits, 128 columns.
    mla = tuning.default().mla
    assert mla.latent("cuda") == LatentConfig(64, 16, num_warps=8, num_stages=2, reduce_warps=4)
    assert mla.latent("cpu") == LatentConfig(16, 16, num_warps=1, num_stages=1, reduce_warps=1)
    assert (mla.min_split_keys, mla.max_splits, mla.reduce_block_r) == (256, 64, 128)
