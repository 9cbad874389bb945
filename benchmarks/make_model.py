"""Write random-weight HF safetensors directories of real model shapes.

Speed work needs 8B-sized checkpoints that load through the real path (sharded safetensors with
an index, HF names), and nothing can be downloaded. The tensor names and shapes come from the HF
model class built on the meta device (no memory, no init); every tensor is then drawn on its own
with `randn * 0.02` in the target dtype on the chosen device, one ~5 GB shard at a time, so
neither an fp32 8B model nor a full bf16 copy is ever held. Norm weights are ones, as in a real
init, so activations keep a sane scale through 32 layers.

    compile-engine bench make-model llama3-8b --out /tmp/llama3-8b --device cuda

`--quantize LAYOUT` writes an FP8 checkpoint instead (models/quant.py's CHECKPOINT_LAYOUTS):
`ct-channel` is compressed-tensors FP8_DYNAMIC as llm-compressor saves it (per-channel weight
scales, dynamic per-token activations), `ct-tensor` static per-tensor scales with an input
scale, `ct-block` / `fp8-block` 128 x 128 block scales (compressed-tensors, or DeepSeek-V3's
`weight_scale_inv`), `fp8-tensor` the "fp8" method's per-tensor form. Each projection is drawn
in the model dtype and quantized on the drawing device; lm_head, embeddings and norms stay.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHARD_BYTES = 5 * 1024**3

# Shapes of the public checkpoints' config.json (Llama-3.1-8B, Qwen3-8B); token ids only, so no
# tokenizer is written and the engine takes token-id prompts.
PRESETS: dict[str, tuple[str, dict]] = {
    "llama3-8b": (
        "LlamaConfig",
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_id=[128001, 128008, 128009],
            dtype="bfloat16",
        ),
    ),
    "qwen3-8b": (
        "Qwen3Config",
        dict(
            architectures=["Qwen3ForCausalLM"],
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            attention_bias=False,
            tie_word_embeddings=False,
            bos_token_id=151643,
            eos_token_id=151645,
            dtype="bfloat16",
        ),
    ),
    # For CPU smoke tests: Llama-3 layout at toy width, float32 (what the CPU path runs).
    "tiny-llama": (
        "LlamaConfig",
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            dtype="float32",
        ),
    ),
}

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_config(preset: str, layers: int | None = None):
    import transformers

    if preset not in PRESETS:
        raise SystemExit(f"unknown model {preset!r}; choose one of {', '.join(PRESETS)}")
    cls_name, values = PRESETS[preset]
    values = dict(values)
    if layers is not None:
        values["num_hidden_layers"] = layers
    return getattr(transformers, cls_name)(**values)


def tensor_specs(config) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor save_pretrained would write, read off the HF
    model built on the meta device (tied weights appear once, as save_pretrained writes them)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def plan_shards(
    specs: list[tuple[str, tuple[int, ...]]], element_size: int, shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Cut the tensor list, in order, into shards of at most shard_bytes (a larger tensor gets
    its own shard)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = element_size * _numel(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _random_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    t = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    return t.mul_(0.02)


def _checkpoint_tensors(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
    quantize: str | None,
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one model tensor, on the host: itself, or quantized."""
    tensor = _random_tensor(name, shape, dtype, device, gen)
    if quantize is None:
        return {name: tensor.cpu()}
    from compile_engine.models.quant import quantize_checkpoint_tensor

    parts = quantize_checkpoint_tensor(name, tensor, quantize)
    return {k: v.cpu() for k, v in parts.items()}


def make_model(
    preset: str,
    out: str | Path,
    *,
    device: str = "cpu",
    layers: int | None = None,
    dtype: str | None = None,
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    quantize: str | None = None,
) -> Path:
    """Write the model directory and return it; `quantize` names an FP8 checkpoint layout."""
    from safetensors.torch import save_file

    config = hf_config(preset, layers)
    if dtype is not None:
        config.dtype = dtype
    dtype_name = str(config.dtype).removeprefix("torch.")
    torch_dtype = _DTYPES[dtype_name]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if quantize is not None:
        from compile_engine.models.quant import checkpoint_quantization_config

        config.quantization_config = checkpoint_quantization_config(quantize)
    config.save_pretrained(out)

    specs = tensor_specs(config)
    element = torch.empty((), dtype=torch_dtype).element_size()
    shards = plan_shards(specs, element, shard_bytes)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for name, s in shard:
            tensors.update(_checkpoint_tensors(name, s, torch_dtype, device, gen, quantize))
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench make-model", description=__doc__.splitlines()[0])
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--device", default="cpu", help="where to draw the tensors (cuda is fast)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="override the dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantize",
        default=None,
        choices=["ct-tensor", "ct-channel", "ct-block", "fp8-block", "fp8-tensor"],
        help="write an FP8 checkpoint in this layout (module docstring)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    out = make_model(
        args.preset,
        args.out,
        device=args.device,
        layers=args.layers,
        dtype=args.dtype,
        seed=args.seed,
        quantize=args.quantize,
    )
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
