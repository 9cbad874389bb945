"""Write random-weight HF safetensors directories of real model shapes.

Speed work needs 8B-sized checkpoints that load through the real path (sharded safetensors with
an index, HF names), and nothing can be downloaded. The tensor names and shapes come from the HF
model class built on the meta device (no memory, no init); every tensor is then drawn on its own
with `randn * 0.02` in the target dtype on the chosen device, one ~5 GB shard at a time, so
neither an fp32 8B model nor a full bf16 copy is ever held. Norm weights are ones, as in a real
init, so activations keep a sane scale through 32 layers.

    compile-engine bench make-model llama3-8b --out /tmp/llama3-8b --device cuda
    compile-engine bench make-model llama3-8b-eagle3 --out /tmp/llama3-8b-eagle3 --device cuda
    compile-engine bench make-model deepseek-v3 --layers 3 --out /tmp/dsv3 --device cuda

`--quantize LAYOUT` writes an FP8 checkpoint instead (models/quant.py's CHECKPOINT_LAYOUTS):
`ct-channel` is compressed-tensors FP8_DYNAMIC as llm-compressor saves it (per-channel weight
scales, dynamic per-token activations), `ct-tensor` static per-tensor scales with an input
scale, `ct-block` / `fp8-block` 128 x 128 block scales (compressed-tensors, or DeepSeek-V3's
`weight_scale_inv`), `fp8-tensor` the "fp8" method's per-tensor form, `modelopt-fp8` NVIDIA
ModelOpt's FP8 (quant_method "modelopt": per-tensor 0-d weight and input scales, and the FP8
KV cache's `k_proj.k_scale` / `v_proj.v_scale`, 1.0). Each projection is drawn
in the model dtype and quantized on the drawing device; lm_head, embeddings and norms stay.

Integer weight-only layouts (issue 29, models/quant_formats.py's PACKED_LAYOUTS): `gptq-int4` /
`gptq-int8` (AutoGPTQ, symmetric, no act-order), `awq-int4` (AutoAWQ gemm, zero points),
`ct-w4a16` / `ct-w8a16` (compressed-tensors pack-quantized), in groups of 128 columns (the
largest of 128 / 64 / 32 that divides the hidden and intermediate sizes, for tiny presets),
round-to-nearest from the drawn weights (no calibration: random weights have nothing to fit).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHARD_BYTES = 5 * 1024**3
# models/quant_formats.py's PACKED_LAYOUTS (named here so that the parser imports no torch
# model code).
PACKED_LAYOUT_NAMES = ("gptq-int4", "gptq-int8", "awq-int4", "ct-w4a16", "ct-w8a16")

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
    # DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3) with its one MTP layer, which
    # make_model writes at layer index num_hidden_layers; cut it with --layers (3: the dense
    # layers, then the MTP layer at index 3 is MoE as V3's layer 61 is; ~30 GB in bf16).
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            architectures=["DeepseekV3ForCausalLM"],
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_nextn_predict_layers=1,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_shared_experts=1,
            n_routed_experts=256,
            num_experts_per_tok=8,
            routed_scaling_factor=2.5,
            n_group=8,
            topk_group=4,
            norm_topk_prob=True,
            first_k_dense_replace=3,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            max_position_embeddings=163840,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            rope_interleave=True,
            attention_bias=False,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
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

    if preset.endswith("-eagle3") and preset.removesuffix("-eagle3") in PRESETS:
        preset = preset.removesuffix("-eagle3")
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
    specs = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    # DeepSeek-V3's router bias is a buffer that save_pretrained writes.
    specs += [
        (name, tuple(b.shape))
        for name, b in model.named_buffers()
        if name.endswith("e_score_correction_bias")
    ]
    return specs + mtp_tensor_specs(config)


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
    if isinstance(quantize, str):
        from compile_engine.models.quant import quantize_checkpoint_tensor

        parts = quantize_checkpoint_tensor(name, tensor, quantize)
    else:  # a PackedFormat
        from compile_engine.models.quant_formats import quantize_checkpoint_linear

        parts = quantize_checkpoint_linear(name, tensor, quantize)
    return {k: v.cpu() for k, v in parts.items()}


def _packed_format(name: str, config):
    """The integer layout `name` at the largest group dividing the model's input widths."""
    import dataclasses

    from compile_engine.models.quant_formats import PACKED_LAYOUTS

    widths = (config.hidden_size, config.intermediate_size)
    group = next((g for g in (128, 64, 32) if all(w % g == 0 for w in widths)), None)
    if group is None:
        raise SystemExit(f"{widths}: no group of 128 / 64 / 32 columns divides these widths")
    return dataclasses.replace(PACKED_LAYOUTS[name], group=group)


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
    constant_logits: bool = False,
) -> Path:
    """Write the model directory and return it; `quantize` names an FP8 checkpoint layout.
    `constant_logits` zeroes the final norm: every position's logits are exactly 0, so greedy
    decoding emits token 0 whatever the kernels' rounding (random weights' near-flat logits
    otherwise flip with the step's shape, and `bench speculative --replay`'s recorded
    continuation stops being the target's). Every GEMM and attention runs as before."""
    from safetensors.torch import save_file

    config = hf_config(preset, layers)
    if dtype is not None:
        config.dtype = dtype
    dtype_name = str(config.dtype).removeprefix("torch.")
    torch_dtype = _DTYPES[dtype_name]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    packing = None
    if quantize is not None and quantize in PACKED_LAYOUT_NAMES:
        from compile_engine.models.quant_formats import packed_quantization_config

        packing = _packed_format(quantize, config)
        config.quantization_config = packed_quantization_config(packing)
    elif quantize is not None:
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
            tensors.update(
                _checkpoint_tensors(name, s, torch_dtype, device, gen, packing or quantize)
            )
            if constant_logits and name == "model.norm.weight":
                tensors[name].zero_()
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


# -- draft heads ----------------------------------------------------------------------------
# `<preset>-eagle3` writes an EAGLE-3 head for that preset's target, in the layout published
# for Llama-3.1-8B (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: one layer, a 32000-token draft
# vocabulary, models/eagle3.py); a preset whose config has num_nextn_predict_layers gets its
# MTP layer(s) at layer index num_hidden_layers, as DeepSeek-V3's checkpoint holds them.
EAGLE3_DRAFT_VOCAB = 32000


def eagle3_config(
    target: dict, draft_vocab_size: int = EAGLE3_DRAFT_VOCAB, aux_layer_ids: list | None = None
) -> dict:
    """The head's config.json for a target's config.json (as a dict)."""
    keep = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "bos_token_id",
        "eos_token_id",
        "hidden_act",
    )
    config = {k: target[k] for k in keep if target.get(k) is not None}
    config.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        draft_vocab_size=min(draft_vocab_size, target["vocab_size"]),
        tie_word_embeddings=False,
        torch_dtype=str(target.get("dtype") or target.get("torch_dtype") or "float32"),
    )
    if aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    return config


def eagle3_tensors(
    config: dict,
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
    *,
    std: float = 0.02,
    constant: bool = False,
) -> dict[str, torch.Tensor]:
    """Random tensors of the head's published names and shapes (host tensors). d2t maps a
    random sorted subset of the target vocabulary (always holding token 0); `constant` zeroes
    the final norm, so that every draft is draft id 0, target token 0."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    draft_vocab = config["draft_vocab_size"]
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (draft_vocab, h),
    }
    tensors = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, dtype=dtype, device=device, generator=gen)
        if name.endswith("norm.weight"):
            t = 1 + 0.1 * t if std > 0.02 else torch.ones_like(t)
        else:
            t = t * std
        tensors[name] = t.cpu()
    if constant:
        tensors["norm.weight"].zero_()
    order = torch.randperm(vocab - 1, generator=torch.Generator().manual_seed(0)) + 1
    ids = torch.cat([torch.zeros(1, dtype=torch.long), order[: draft_vocab - 1]]).sort().values
    tensors["d2t"] = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    return tensors


def make_eagle3_head(
    preset: str, out: str | Path, *, device: str = "cpu", dtype: str | None = None, seed: int = 0
) -> Path:
    """Write a random EAGLE-3 head for `preset`'s target shape to `out`."""
    from safetensors.torch import save_file

    target = hf_config(preset).to_dict()
    config = eagle3_config(target)
    if dtype is not None:
        config["torch_dtype"] = dtype
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = eagle3_tensors(config, _DTYPES[config["torch_dtype"]], device, gen)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def mtp_tensor_specs(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the MTP layers' tensors: decoder layers at index num_hidden_layers..
    (as the HF class would build them there: MoE past first_k_dense_replace) with enorm,
    hnorm, eh_proj and shared_head, and the copies of the embedding and head they carry."""
    import copy

    import transformers

    n = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if not n:
        return []
    layers = config.num_hidden_layers
    longer = copy.deepcopy(config)
    longer.num_hidden_layers = layers + n
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(longer)
    h, vocab = config.hidden_size, config.vocab_size
    specs = []
    for index in range(layers, layers + n):
        prefix = f"model.layers.{index}."
        layer = model.model.layers[index]
        state = layer.state_dict()
        specs += [(prefix + name, tuple(t.shape)) for name, t in state.items()]
        specs += [
            (prefix + "enorm.weight", (h,)),
            (prefix + "hnorm.weight", (h,)),
            (prefix + "eh_proj.weight", (h, 2 * h)),
            (prefix + "shared_head.norm.weight", (h,)),
            (prefix + "shared_head.head.weight", (vocab, h)),
            (prefix + "embed_tokens.weight", (vocab, h)),
        ]
    return specs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench make-model", description=__doc__.splitlines()[0])
    p.add_argument(
        "preset",
        choices=sorted([*PRESETS, *(f"{name}-eagle3" for name in PRESETS)]),
        help="a target shape, or <target>-eagle3: an EAGLE-3 head for it",
    )
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--device", default="cpu", help="where to draw the tensors (cuda is fast)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="override the dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantize",
        default=None,
        choices=[
            "ct-tensor",
            "ct-channel",
            "ct-block",
            "fp8-block",
            "fp8-tensor",
            "modelopt-fp8",
            *PACKED_LAYOUT_NAMES,
        ],  # fmt: skip
        help="write an FP8 or integer (GPTQ / AWQ / pack-quantized) checkpoint in this layout "
        "(module docstring)",
    )
    p.add_argument(
        "--constant-logits",
        action="store_true",
        help="zero the final norm: logits all 0, greedy emits token 0 at any rounding (for "
        "bench speculative --replay)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    if args.preset.endswith("-eagle3"):
        out = make_eagle3_head(
            args.preset.removesuffix("-eagle3"),
            args.out,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
        )
        size = (out / "model.safetensors").stat().st_size
        print(f"wrote {out} ({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
        return 0
    out = make_model(
        args.preset,
        args.out,
        device=args.device,
        layers=args.layers,
        dtype=args.dtype,
        seed=args.seed,
        quantize=args.quantize,
        constant_logits=args.constant_logits,
    )
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
