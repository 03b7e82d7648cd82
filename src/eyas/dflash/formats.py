"""The DFlash folder's config.json <-> DFlashConfig mapping, one function per direction
(`to_dflash_config` / `from_dflash_config`: vLLM's and SGLang's `DFlashDraftModel`,
docs/dflash.md), and reading a DFlash checkpoint or folder back. The tests round-trip it.
"""

from __future__ import annotations
from pathlib import Path

import torch

from eyas.dflash.config import DFlashConfig
from eyas.draft.config import draft_rope_scaling
from eyas.draft.formats import DTYPE_NAMES, DTYPES, REEXPORT, read_json, read_weights, rope_keys
from eyas.errors import EyasError

DFLASH_ARCHITECTURE = "DFlashDraftModel"  # vLLM maps it to qwen3_dflash.DFlashQwen3ForCausalLM


def to_dflash_config(cfg: DFlashConfig, dtype: str = "bf16",
                     num_target_layers: int | None = None) -> dict:
    """config.json of a DFlash draft as z-lab / SpecForge write it and vLLM (`method:
    "dflash"`) and SGLang (`DFLASH`) read it: a Qwen3 config of the draft's layers (all full,
    non-causal attention) plus `dflash_config {mask_token_id, target_layer_ids (layer outputs),
    block_size}`, `block_size` at the top level too (older readers), and the same taps in
    vLLM's convention as `eagle_aux_hidden_state_layer_ids`, which vLLM reads first (so the
    folder does not depend on the +1 conversion vLLM added in PR #40727). No draft vocabulary:
    the target's lm_head is shared. Inverse: `from_dflash_config`."""
    n = cfg.num_hidden_layers
    out = {
        "architectures": [DFLASH_ARCHITECTURE], "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": list(cfg.target_layer_ids),
                          "block_size": cfg.block_size},
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": n, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": False, **rope_keys(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": ["full_attention"] * n, "use_sliding_window": False,
        "sliding_window": None, "vocab_size": cfg.vocab_size, "tie_word_embeddings": False,
        "torch_dtype": DTYPE_NAMES[DTYPES[dtype]],
    }
    if num_target_layers is not None:
        out["num_target_layers"] = int(num_target_layers)  # SpecForge / SGLang defaults only
    return out


def from_dflash_config(config: dict) -> DFlashConfig:
    """DFlashConfig of a DFlash config.json (ours or a z-lab / SpecForge one): the taps from
    `eagle_aux_hidden_state_layer_ids`, else `dflash_config.target_layer_ids` + 1, as vLLM
    resolves them; a config vLLM would run differently from how eyas trains is refused."""
    if DFLASH_ARCHITECTURE not in (config.get("architectures") or []):
        raise EyasError(f"not a DFlash config (architectures {config.get('architectures')})")
    extras = config.get("dflash_config") or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or \
        [i + 1 for i in extras.get("target_layer_ids") or []]
    unsupported = [k for k in ("causal", "use_swa", "attention_sink_bias") if extras.get(k)]
    unsupported += [k for k in ("attention_bias", "use_sliding_window", "is_causal")
                    if config.get(k)]
    if any(t != "full_attention" for t in config.get("layer_types") or []):
        unsupported.append("layer_types")
    if config.get("draft_vocab_size") not in (None, config.get("vocab_size")):
        unsupported.append("draft_vocab_size")
    if unsupported:
        raise EyasError(f"this DFlash config uses {unsupported}, which eyas's DFlash model does "
                        f"not build (it runs full, non-causal attention without biases over "
                        f"the target's whole vocabulary)")
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    scaling = config.get("rope_scaling") or {
        k: v for k, v in (config.get("rope_parameters") or {}).items() if k != "rope_theta"}
    heads = int(config["num_attention_heads"])
    return DFlashConfig(
        hidden_size=int(config["hidden_size"]), num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        intermediate_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
        rope_theta=float(theta or 1e6),  # vLLM's default for DFlash (set_default_rope_theta)
        rope_scaling=draft_rope_scaling(scaling),
        max_position_embeddings=int(config["max_position_embeddings"]),
        vocab_size=int(config["vocab_size"]), aux_layer_ids=tuple(ids),
        block_size=int(extras.get("block_size") or config.get("block_size") or 16),
        mask_token_id=int(extras.get("mask_token_id", config.get("mask_token_id", -1))),
        hidden_act=config.get("hidden_act", "silu"))


def dflash_checkpoint_config(values: dict) -> DFlashConfig | None:
    """The DFlashConfig of a checkpoint's draft_config.json, or None for an EAGLE-3 one."""
    if values.get("draft") != "dflash":
        return None
    return DFlashConfig.from_dict({k: v for k, v in values.items() if k != "draft"})


def read_dflash_folder(folder: str | Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """(DFlashConfig, weights by the draft's own names) of a DFlash folder (`eyas export`, or
    a z-lab / SpecForge one: the same names; an optional `model.` prefix is dropped)."""
    folder = Path(folder)
    config = read_json(folder / "config.json", REEXPORT)
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(read_weights(f, REEXPORT))
    if not tensors:
        raise EyasError(f"{folder} has no *.safetensors weights; re-run `eyas export`")
    return from_dflash_config(config), {k.removeprefix("model."): v for k, v in tensors.items()}


def is_dflash_folder(folder: str | Path) -> bool:
    path = Path(folder) / "config.json"
    return path.is_file() and DFLASH_ARCHITECTURE in (
        read_json(path, REEXPORT).get("architectures") or [])
