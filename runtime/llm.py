"""The offline API, mirroring vLLM's: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence

from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.runtime.engine import EngineConfig, LLMEngine, RequestOutput
from compile_engine.runtime.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, str]]

# The offline API's token budget a step: larger than the server's 2,048 (which keeps
# inter-token latency low), as vLLM's LLM class also takes a larger one. Offline, steps of many
# prefill tokens run the GEMMs nearer their peak (benchmarks/results/throughput-*.json record
# the budget of each run).
OFFLINE_MAX_NUM_BATCHED_TOKENS = 16384


class LLM:
    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        target: str | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = OFFLINE_MAX_NUM_BATCHED_TOKENS,
        max_cuda_graph_tokens: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        seed: int = 0,
        passes: str | None = None,
        kernel_config: KernelConfig | dict | str | None = None,
        cuda_graphs: bool = True,
        async_scheduling: bool = True,
        reasoning_parser: str | None = None,
        grammar_compile_timeout_s: float = 5.0,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        distributed_timeout_s: float = 20.0,
        speculative_config: dict | str | None = None,
    ) -> None:
        config = EngineConfig(
            model=str(model),
            dtype=dtype,
            target=target,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_cuda_graph_tokens=max_cuda_graph_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
            seed=seed,
            passes=passes,
            kernel_config=kernel_config,
            cuda_graphs=cuda_graphs,
            async_scheduling=async_scheduling,
            reasoning_parser=reasoning_parser,
            grammar_compile_timeout_s=grammar_compile_timeout_s,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            tensor_parallel_size=tensor_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            distributed_timeout_s=distributed_timeout_s,
            speculative_config=speculative_config,
        )
        self.engine = LLMEngine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        engine = self.engine
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            rid = engine.next_request_id()
            engine.add_request(rid, prompt, p)
            ids.append(rid)
        done: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]

    def apply_chat_template(self, messages: Messages) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a prompt")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in conversations], params)
