"""The serving runtime: scheduler, KV cache manager, model runner, sampler, engine, server.

The public offline API is re-exported by the root package: `from compile_engine import LLM,
SamplingParams`. The scheduler and the KV cache manager import no torch.
"""
