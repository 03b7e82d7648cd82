"""Tiny quantized MoE targets in the formats the big ones ship in (issue 32, item 4).

Two checkpoint formats, each written from a random bf16 model so that tests can load it with
transformers exactly as a user loads the real one:

- `build_tiny_fp8_deepseek(out_dir)`: a DeepSeek-V3-shaped MoE in DeepSeek-V3's published FP8
  format: every decoder `Linear` weight (attention, dense MLP, shared and routed experts) stored
  as `float8_e4m3fn` with a float32 `weight_scale_inv` per 128 x 128 block (weight = fp8 *
  scale_inv), the router, norms, embedding and lm_head in bf16, and `quantization_config`
  `{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
  "activation_scheme": "dynamic"}`.
- `build_tiny_kimi_int4(out_dir)`: the Kimi-K2.5-like wrapper (`eyas.targets.kimi_like`) with
  its routed experts INT4 pack-quantized (symmetric, group 32) by compressed-tensors' own
  `PackedQuantizationCompressor` (`weight_packed` int32, `weight_scale` bf16, `weight_shape`),
  and Kimi-K2.5's `quantization_config` (`quant_method: compressed-tensors`, pack-quantized,
  attention, shared experts, the dense MLP and lm_head ignored). Needs `compressed-tensors`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# DeepSeek-V3's config.json, quantization_config as published.
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": list(FP8_BLOCK)}
INT4_GROUP = 32
# Kimi-K2.5's quantization_config: INT4 on every Linear that is not ignored, i.e. the routed
# experts. The ignore list is the one Kimi-K2.6 publishes (quoted in vLLM's tests); a bare
# "lm_head" would not match the wrapper's `language_model.lm_head`, which would then be packed.
KIMI_INT4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": INT4_GROUP, "dynamic": False, "observer": "minmax"}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
               "re:vision_tower.*", "re:mm_projector.*"],
}


def fp8_block_quantize(w: torch.Tensor, block=FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv of shape ceil(out/b0) x ceil(in/b1)), as
    DeepSeek-V3 stores them: the last row/column blocks are partial when a dim is not a multiple
    of the block."""
    out_f, in_f = w.shape
    rows, cols = -(-out_f // block[0]), -(-in_f // block[1])
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32)
    padded[:out_f, :in_f] = w.float()
    blocks = padded.view(rows, block[0], cols, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # (rows, cols)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * block[0], cols * block[1])[:out_f, :in_f].contiguous(), scale


def fp8_block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block=FP8_BLOCK) -> torch.Tensor:
    """The reference de-quantization (float32): each 128 x 128 block times its scale."""
    full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * full[:q.shape[0], :q.shape[1]]


def _is_fp8_linear(name: str, tensor: torch.Tensor) -> bool:
    # DeepSeek-V3 quantizes every Linear inside the decoder layers; the router (`mlp.gate`),
    # norms, embedding and lm_head stay bf16.
    return (tensor.ndim == 2 and ".layers." in name and name.endswith("_proj.weight"))


def _rewrite_safetensors(folder: Path, convert) -> None:
    # The tiny builders save one model.safetensors; rewrite it in place.
    path = folder / "model.safetensors"
    state = load_file(path)
    out = {}
    for name, tensor in state.items():
        out.update(convert(name, tensor))
    save_file(out, path, metadata={"format": "pt"})


def _set_quantization_config(folder: Path, quantization_config: dict) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quantization_config
    path.write_text(json.dumps(config, indent=2) + "\n")


def build_tiny_fp8_deepseek(out_dir: str | Path, seed: int = 0, *, num_layers: int = 4) -> Path:
    """A random tiny DeepSeek-V3 MoE saved in DeepSeek-V3's FP8 block-quantized format."""
    from eyas.targets.tiny import build_tiny_model

    out_dir = build_tiny_model("deepseek_v3", out_dir, seed, num_layers=num_layers,
                               dtype=torch.bfloat16)

    def convert(name, tensor):
        if not _is_fp8_linear(name, tensor):
            return {name: tensor}
        q, scale_inv = fp8_block_quantize(tensor)
        return {name: q, name.removesuffix("weight") + "weight_scale_inv": scale_inv}

    _rewrite_safetensors(out_dir, convert)
    _set_quantization_config(out_dir, FP8_QUANTIZATION_CONFIG)
    return out_dir


def int4_pack_expert(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One routed expert's Linear weight (out, in) -> compressed-tensors' pack-quantized tensors
    (`weight_packed` int32 (out, in/8), `weight_scale` (out, in/32) in the weight's dtype,
    `weight_shape`), made by compressed-tensors' own compressor with min-max group scales."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    group = KIMI_INT4_QUANTIZATION_CONFIG["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    out_f, in_f = weight.shape
    grouped = weight.float().view(out_f, in_f // INT4_GROUP, INT4_GROUP)
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype),
             "weight_zero_point": zero_point}
    return dict(PackedQuantizationCompressor.compress(state, scheme))


def int4_unpack_expert(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference de-quantization of `int4_pack_expert`'s output, by compressed-tensors."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = KIMI_INT4_QUANTIZATION_CONFIG["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    return PackedQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]


def build_tiny_kimi_int4(out_dir: str | Path, seed: int = 0, *, num_layers: int = 4) -> Path:
    """A random tiny Kimi-K2.5-like wrapper whose routed experts are INT4 pack-quantized."""
    from eyas.targets.kimi_like import build_kimi_like

    out_dir = build_kimi_like(out_dir, seed, num_layers=num_layers, dtype=torch.bfloat16)

    def convert(name, tensor):
        if ".mlp.experts." not in name or not name.endswith("_proj.weight"):
            return {name: tensor}
        prefix = name.removesuffix("weight")
        return {prefix + k: v for k, v in int4_pack_expert(tensor).items()}

    _rewrite_safetensors(out_dir, convert)
    _set_quantization_config(out_dir, KIMI_INT4_QUANTIZATION_CONFIG)
    return out_dir
