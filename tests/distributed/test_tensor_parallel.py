"""Tensor and expert parallelism on the CPU over gloo: greedy tokens of every tiny architecture
with its weights sharded over 2 (and 4) processes equal TP=1's and HF's, and the logits of a
prompt are within 1e-4 of HF's; a rank that dies or hangs ends the run with an error naming
it; a torchrun launch serves from rank 0.

Eager (no Inductor): each case starts its worker processes, a few seconds on CI's 2 cores.
tests/distributed/test_tensor_parallel_compiled.py shows the compiled path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from compile_engine import LLM, SamplingParams
from compile_engine.models.layers import AttentionMetadata
from compile_engine.runtime import parallel
from compile_engine.runtime.parallel import TensorParallelError

from oracle import hf_greedy
from tiny_deepseek import make_tiny_deepseek
from tiny_models import make_tiny_model
from tiny_moe import make_tiny_moe

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [[5], [7, 11, 13, 17, 19], [3 + (i * 7) % 90 for i in range(21)]]

# case -> (maker, tensor_parallel_size, enable_expert_parallel). Together they cover each
# sharded module and loading path: GQA split (qwen2, qwen3) and replicated KV heads (llama-4), the
# tied vocabulary-parallel head and qkv biases (qwen2), q/k norm with head_dim 24 (qwen3),
# experts sliced from stacked tensors (mixtral) and from per-expert ones (deepseek, with MLA),
# experts distributed whole from per-expert (qwen3_moe) and stacked tensors with a gated
# shared expert and a dense layer (qwen2_moe).
CASES = {
    "llama-tp4": (lambda d: make_tiny_model("llama", d), 4, False),
    "qwen2-tp2": (lambda d: make_tiny_model("qwen2", d), 2, False),
    "qwen3-tp2": (lambda d: make_tiny_model("qwen3", d), 2, False),
    "mixtral-tp2": (lambda d: make_tiny_moe("mixtral", d, stacked=True), 2, False),
    "qwen3_moe-ep2": (lambda d: make_tiny_moe("qwen3_moe", d), 2, True),
    "qwen2_moe-ep2": (lambda d: make_tiny_moe("qwen2_moe", d, stacked=True), 2, True),
    "deepseek-v3-tp2": (lambda d: make_tiny_deepseek("deepseek-v3", d), 2, False),
    # Four ranks for MoE and MLA too: experts sliced four ways, spread whole one a rank, MLA's
    # heads one a rank.
    "mixtral-tp4": (lambda d: make_tiny_moe("mixtral", d, stacked=True), 4, False),
    "qwen2_moe-ep4": (lambda d: make_tiny_moe("qwen2_moe", d, stacked=True), 4, True),
    "deepseek-v3-tp4": (lambda d: make_tiny_deepseek("deepseek-v3", d), 4, False),
}


def _engine(directory, tp: int = 1, ep: bool = False, **kwargs) -> LLM:
    return LLM(
        str(directory),
        dtype="float32",
        target="cpu",
        enforce_eager=True,
        num_kv_blocks=64,
        max_num_batched_tokens=16,  # the 21-token prompt is chunked
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        **kwargs,
    )


def prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """[T, V] logits of every position of `prompt`, through the runner's forward and
    compute_logits (under TP: the broadcast to the workers and the gathered lm_head). The KV
    goes to block 0, the scratch block that no request owns."""
    runner = llm.engine.runner
    n = len(prompt)
    assert n <= runner.block_size
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
    )
    with torch.inference_mode():
        hidden = runner.forward(torch.tensor(prompt), torch.arange(n), runner.kv_caches, meta)
        return runner.compute_logits(hidden)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(autouse=True)
def _end_groups():
    yield
    parallel.shutdown_active()  # the next case's engine starts its own workers


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_logits_equal_tp1_and_hf(case, tmp_path):
    make, tp, ep = CASES[case]
    hf_model = make(tmp_path)
    want = [hf_greedy(hf_model, p, NEW_TOKENS) for p in PROMPTS]
    probe = [3 + (i * 5) % 90 for i in range(12)]
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor([probe])).logits[0]

    single = _engine(tmp_path)
    tp1 = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
    tp1_logits = prompt_logits(single, probe)
    del single

    llm = _engine(tmp_path, tp, ep)
    assert llm.engine.runner.forward.group.tp.world_size == tp
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == tp1 == want, f"{case}: TP={tp} {got}, TP=1 {tp1}, HF {want}"
    logits = prompt_logits(llm, probe)
    assert logits.shape == hf_logits.shape
    assert _relative(logits, hf_logits) <= 1e-4
    assert _relative(logits, tp1_logits) <= 1e-4
    llm.engine.scheduler.check_integrity()


def _long_run(llm: LLM) -> None:
    llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))


@pytest.mark.parametrize(
    ("sig", "timeout_s", "reason"),
    [(signal.SIGKILL, 20.0, "died (killed by signal 9)"), (signal.SIGSTOP, 2.0, "hung")],
    ids=["killed", "hung"],
)
def test_a_failed_rank_ends_the_run_naming_it(sig, timeout_s, reason, tmp_path):
    make_tiny_model("llama", tmp_path)
    llm = _engine(tmp_path, 2, distributed_timeout_s=timeout_s)
    worker = llm.engine.runner.forward.group.processes[1]
    hit = []

    def fail_rank_1():
        time.sleep(0.5)
        hit.append(time.monotonic())
        os.kill(worker.pid, sig)

    threading.Thread(target=fail_rank_1, daemon=True).start()
    with pytest.raises(TensorParallelError) as raised:
        _long_run(llm)
    elapsed = time.monotonic() - hit[0]
    assert "rank 1 " + reason in str(raised.value)
    assert elapsed < 30, f"the failure took {elapsed:.1f} s to surface"
    assert not worker.is_alive()


TORCHRUN_SCRIPT = """
import json, sys
from compile_engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", target="cpu", enforce_eager=True, num_kv_blocks=64,
          tensor_parallel_size=2)
# Only rank 0 gets here: rank 1 serves inside LLM(...) and exits when rank 0 ends.
params = SamplingParams(temperature=0, max_tokens=%d, ignore_eos=True)
out = llm.generate(json.loads(sys.argv[2]), params)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in out]), flush=True)
"""


def test_a_torchrun_launch_serves_from_rank_0(tmp_path):
    """Launched by torchrun, the engine joins the launch's processes instead of spawning."""
    hf_model = make_tiny_model("llama", tmp_path)
    script = tmp_path / "serve.py"
    script.write_text(TORCHRUN_SCRIPT % NEW_TOKENS)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--standalone", str(script), str(tmp_path), json.dumps(PROMPTS)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 1, run.stdout  # rank 0 alone generates
    want = [hf_greedy(hf_model, p, NEW_TOKENS) for p in PROMPTS]
    assert json.loads(lines[0].removeprefix("TOKENS ")) == want
