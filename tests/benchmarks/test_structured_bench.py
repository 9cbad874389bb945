"""`bench structured` on a tiny random model with the bench's byte-level tokenizer (CPU, tiny
sizes): the record's keys, masks computed every constrained step, and every answer the grammar
finished parsing as a JSON object. No time is asserted."""

from __future__ import annotations

import json

from compile_engine.benchmarks import make_model, structured


def test_byte_level_tokenizer_spells_every_byte(tmp_path):
    tok = structured.byte_level_tokenizer(600, seed=1)
    assert len(tok) == 600 and tok.convert_ids_to_tokens(599) == structured.EOS_TOKEN
    text = '{"a": "x\\n\\u00e9"}\n\t ~'
    assert tok.decode(tok.encode(text)) == text


def test_bench_structured_record(tmp_path):
    model = make_model.make_model("tiny-llama", tmp_path / "tiny")
    out = tmp_path / "results"
    rc = structured.main(
        [
            "--model", str(model), "--target", "cpu", "--enforce-eager", "--add-tokenizer",
            "--num-kv-blocks", "128", "--max-num-seqs", "4", "--num-requests", "4",
            "--input-len", "8", "--output-len", "24", "--repeats", "1",
            "--results-dir", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    (path,) = out.glob("structured-*.json")
    record = json.loads(path.read_text())
    assert record["batch"] == 4 and "structured_overhead_bs4" in record
    assert record["mask_steps"] > 0 and record["grammar_step_mask_p99_ms"] > 0
    # One mask a position of every timed answer until its grammar stops.
    assert 0 < record["masks_timed"] <= 4 * 24 and record["grammar_mask_p99_ms"] > 0
    assert record["grammar_compile_p99_ms"] > 0
    assert record["json_schema_complete_valid"] == record["json_schema_complete"]
    assert record["json_schema_accepted"] == record["json_schema_answers"] == 4
    assert record["plain_mean_output_len"] == 24  # ignore_eos: every plain answer runs to length
