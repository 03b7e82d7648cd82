"""Tiny quantized MoE targets in the formats the big ones ship in (issue 32, item 4).

Two checkpoint formats, each written from a random bf16 model so that tests can load it with
transformers exactly as a user loads the real one:

- `build_tiny_fp8_deepseek(out_dir)` (`build_tiny_deepseek(out_dir, quant="fp8")`): a
  DeepSeek-V3-shaped MoE in DeepSeek-V3's published FP8 format: every decoder `Linear` weight
  (attention, dense MLP, shared and routed experts) stored as `float8_e4m3fn` with a float32
  `weight_scale_inv` per 128 x 128 block (weight = fp8 * scale_inv), the router, norms,
  embedding and lm_head in bf16, and `quantization_config`
  `{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
  "activation_scheme": "dynamic"}`.
- `build_tiny_kimi_int4(out_dir)`: the Kimi-K2.5-like wrapper (`eyas.targets.kimi_like`) with
  its routed experts INT4 pack-quantized (symmetric, group 32) by compressed-tensors' own
  `PackedQuantizationCompressor` (`weight_packed` int32, `weight_scale` bf16, `weight_shape`),
  and Kimi-K2.5's `quantization_config` (`quant_method: compressed-tensors`, pack-quantized,
  attention, shared experts, the dense MLP and lm_head ignored). Needs `compressed-tensors`.
- `build_tiny_deepseek(out_dir)`: the DeepSeek-V3 MoE unquantized (float32), or with
  `quant="int4"` its routed experts packed as Kimi-K2.5's are; `vllm_mla=True` gives it MLA
  dims vLLM runs (tests/test_capture_vllm.py captures it through vLLM's CPU build).

`check_fp8_blocks` is what `load_target` asks before transformers loads an FP8 block checkpoint:
where transformers de-quantizes it at load (no GPU with FP8 matmuls), it reads a weight whose
dims are not multiples of the block with the wrong blocks, so eyas refuses and names
`dequantize_fp8_checkpoint`, which writes a bf16 copy once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eyas.errors import EyasError

FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# DeepSeek-V3's config.json, quantization_config as published.
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": list(FP8_BLOCK)}
# What DeepSeek-V3's config.json names and transformers' DeepseekV3Config leaves out (its
# router is always this one): vLLM builds the router from them, and without them a softmax
# router without e_score_correction_bias, which then fails to load.
V3_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# MLA dims that vLLM runs: its MLA takes kv_lora_rank + qk_rope_head_dim of 320, 512 or 576
# only (V3: 512 + 64); 384 + 128 = 512 keeps every FP8 weight in whole 128 x 128 blocks.
VLLM_MLA = {"kv_lora_rank": 384, "qk_rope_head_dim": 128, "qk_nope_head_dim": 32,
            "v_head_dim": 32}
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


def _fp8_dequantized_at_load(quantization_config: dict) -> bool:
    # transformers' FineGrainedFP8 quantizer keeps FP8 weights only on an XPU or a CUDA GPU of
    # compute capability >= 8.9; elsewhere (and when asked) it de-quantizes them at load.
    if quantization_config.get("dequantize"):
        return True
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability() < (8, 9)
    return not (hasattr(torch, "xpu") and torch.xpu.is_available())


def _tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}  # headers only: no tensor data is read
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


def check_fp8_blocks(name_or_path, config) -> None:
    """Refuse a local FP8 block checkpoint that transformers would de-quantize wrongly here.

    transformers (5.24) de-quantizes FP8 weights at load without an FP8 GPU, taking each block's
    size from the weight's shape divided by its `weight_scale_inv` grid; for a dim larger than
    the block and not a multiple of it (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows, scales
    [5, 56]) that raises "not divisible by scale grid" or, where it divides, silently uses
    wrong blocks. Only local folders are checked (a hub name's files are not read here)."""
    qc = getattr(config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
    folder = Path(str(name_or_path))
    if (not isinstance(qc, dict) or qc.get("quant_method") != "fp8"
            or not qc.get("weight_block_size") or not folder.is_dir()
            or not _fp8_dequantized_at_load(qc)):
        return
    b0, b1 = qc["weight_block_size"]
    shapes = _tensor_shapes(folder)
    partial = []  # (weight name, its shape, its scale grid)
    for scale, grid in shapes.items():
        weight = scale.removesuffix("_scale_inv")
        if scale.endswith(".weight_scale_inv") and len(grid) == 2 and weight in shapes:
            rows, cols = shapes[weight][-2:]
            # one block over a whole dim (a dim up to the block size) is read right
            if (rows > b0 and rows % b0) or (cols > b1 and cols % b1):
                partial.append((weight, shapes[weight], grid))
    if partial:
        name, shape, grid = partial[0]
        raise EyasError(
            f"{folder}: transformers cannot load this FP8 checkpoint on this machine. Without a "
            f"GPU of compute capability >= 8.9 it de-quantizes the weights at load, and it "
            f"mis-reads a weight with a partial {b0} x {b1} block "
            f"({len(partial)} here, e.g. {name} {list(shape)} with weight_scale_inv "
            f"{list(grid)}). Run this step on an FP8 GPU (H100/H200), or de-quantize the "
            f"checkpoint to bf16 once: python -c \"from eyas.targets.quantized import "
            f"dequantize_fp8_checkpoint; dequantize_fp8_checkpoint('{folder}', 'OUT')\" and "
            f"pass OUT as the target")


def dequantize_fp8_checkpoint(src: str | Path, out: str | Path,
                              dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `src` (an FP8 block checkpoint folder) to `out` with every weight de-quantized to
    `dtype` (block by block, partial blocks included), the scales dropped and config.json
    without `quantization_config`; the other files (tokenizer, remote code) are copied."""
    src, out = Path(src), Path(out)
    if out.exists():
        raise EyasError(f"{out} exists; pass a new folder")
    config = json.loads((src / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    out.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out / path.name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = out / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text())
        meta["weight_map"] = {k: v for k, v in meta["weight_map"].items()
                              if not k.endswith("_scale_inv")}
        index.write_text(json.dumps(meta, indent=2) + "\n")
    for path in sorted(src.glob("*.safetensors")):
        state = load_file(path)
        for name in [n for n in state if n.endswith(".weight_scale_inv")]:
            weight = name.removesuffix("_scale_inv")
            if weight not in state:  # DeepSeek-V3 keeps each weight beside its scales
                raise EyasError(f"{path}: {name} without {weight} in the same file")
            state[weight] = fp8_block_dequantize(state[weight], state.pop(name), block).to(dtype)
        save_file(state, out / path.name, metadata={"format": "pt"})
    return out


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


def build_tiny_deepseek(out_dir: str | Path, seed: int = 0, *, num_layers: int = 4,
                        quant: str | None = None, vllm_mla: bool = False,
                        intermediate_size: int | None = None) -> Path:
    """A random tiny DeepSeek-V3 MoE (`num_layers` decoder layers, the first dense, then routed
    and shared experts) with V3's router named in config.json (`V3_ROUTER`). `quant`: None
    (float32), "fp8" (V3's block format, `FP8_QUANTIZATION_CONFIG`) or "int4" (the routed
    experts pack-quantized as Kimi-K2.5 ships them; needs compressed-tensors). `vllm_mla`: MLA
    dims that vLLM runs (`VLLM_MLA`) instead of the test bed's smaller ones. An
    `intermediate_size` above 128 and not a multiple of it gives the dense MLP a partial FP8
    block, as kv_a_proj_with_mqa has in V3."""
    from transformers import AutoModelForCausalLM

    from eyas.targets.tiny import save_tiny_tokenizer, tiny_config

    formats = {"fp8": (_to_fp8, FP8_QUANTIZATION_CONFIG),
               "int4": (_int4_experts, KIMI_INT4_QUANTIZATION_CONFIG)}
    if quant is not None and quant not in formats:
        raise ValueError(f"quant={quant!r}: use None, 'fp8' or 'int4'")
    config = tiny_config("deepseek_v3", num_layers=num_layers + 1)  # it takes one off
    for key, value in {**V3_ROUTER, **(VLLM_MLA if vllm_mla else {})}.items():
        setattr(config, key, value)
    if vllm_mla:
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        config.head_dim = config.qk_rope_head_dim
    if intermediate_size is not None:
        config.intermediate_size = intermediate_size
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out_dir = Path(out_dir)
    model.to(torch.bfloat16 if quant else torch.float32).save_pretrained(out_dir)
    save_tiny_tokenizer(out_dir)
    if quant is not None:
        convert, quantization_config = formats[quant]
        _rewrite_safetensors(out_dir, convert)
        _set_quantization_config(out_dir, quantization_config)
    return out_dir


def build_tiny_fp8_deepseek(out_dir: str | Path, seed: int = 0, *, num_layers: int = 4,
                            intermediate_size: int | None = None) -> Path:
    """`build_tiny_deepseek` in DeepSeek-V3's FP8 block format, at the test bed's dims."""
    return build_tiny_deepseek(out_dir, seed, num_layers=num_layers, quant="fp8",
                               intermediate_size=intermediate_size)


def _to_fp8(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    if not _is_fp8_linear(name, tensor):
        return {name: tensor}
    q, scale_inv = fp8_block_quantize(tensor)
    return {name: q, name.removesuffix("weight") + "weight_scale_inv": scale_inv}


def _int4_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    if ".mlp.experts." not in name or not name.endswith("_proj.weight"):
        return {name: tensor}
    prefix = name.removesuffix("weight")
    return {prefix + k: v for k, v in int4_pack_expert(tensor).items()}


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
    _rewrite_safetensors(out_dir, _int4_experts)
    _set_quantization_config(out_dir, KIMI_INT4_QUANTIZATION_CONFIG)
    return out_dir
