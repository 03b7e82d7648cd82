"""A tiny Kimi-K2.5-like target: a multimodal wrapper loaded through remote code.

Kimi-K2.5 is the case the rest of eyas must not get wrong: its config needs
`trust_remote_code=True`, its text decoder (DeepSeek-V3: MLA attention, a dense first layer then
MoE layers) sits below a `*ForConditionalGeneration` wrapper at `language_model.model`, and vLLM's
class for it lacked `SupportsEagle3` for several releases. `build_kimi_like(out_dir)` writes a
folder with the same shape: `config.json` with `auto_map`, the remote-code files from
`eyas/assets/kimi_like/`, random weights and the tiny tokenizer, loadable with
`AutoConfig/AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from eyas.targets.tiny import TINY_VOCAB, save_tiny_tokenizer

ASSETS = Path(__file__).parent.parent / "assets" / "kimi_like"
ARCHITECTURE = "KimiK25ForConditionalGeneration"
# Class names as they appear in the copied remote-code files (module.Class).
AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k25.KimiK25Config",
    "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
}


def kimi_like_text_config(num_layers: int = 8, hidden: int = 64, vocab_size: int = TINY_VOCAB):
    """A DeepSeek-V3 text config with tiny shapes, Kimi-K2 style (dense layer 0, then MoE)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=4096, tie_word_embeddings=False,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        bos_token_id=0, eos_token_id=4, pad_token_id=5)


def kimi_k25_text_config():
    """DeepSeek-V3 text config at Kimi-K2.5's published shapes (61 layers, hidden 7168, vocab
    163840, 384 routed experts, MLA, YaRN to 256k), for config-only checks on the meta device.
    Structure and sizes follow the public config; numeric details such as eps may differ."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
        n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
        n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=262144,
        rope_theta=50000.0,
        rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False, dtype="bfloat16")


def write_kimi_like_config(out_dir: str | Path, text_config, *,
                           quantization_config: dict | None = None) -> Path:
    """Write `config.json` (with `auto_map`) and the remote-code files into `out_dir`.

    A folder holding only these is enough for `eyas doctor` / `inspect_model`, which build the
    model on the meta device: pass a DeepSeek-V3 config of Kimi-K2.5's real shapes to see what
    eyas does with the full 61-layer model without any weights.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in ASSETS.glob("*.py"):
        shutil.copy(src, out_dir / src.name)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "kimi_k25_like",
        "auto_map": AUTO_MAP,
        "text_config": text_config.to_dict(),
        "vision_config": {"hidden_size": 32, "patch_size": 4, "num_channels": 3},
        # The last id of the vocabulary stands in for Kimi's <|media_pad|> token.
        "media_placeholder_token_id": text_config.vocab_size - 1,
        "tie_word_embeddings": False,
    }
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def build_kimi_like(out_dir: str | Path, seed: int = 0, *, num_layers: int = 8,
                    hidden: int = 64, dtype: torch.dtype = torch.float32) -> Path:
    """Write a random Kimi-K2.5-like model (remote code + weights + tokenizer) into `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = write_kimi_like_config(out_dir, kimi_like_text_config(num_layers, hidden))
    cfg = AutoConfig.from_pretrained(out_dir, trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=True)
    model.to(dtype).save_pretrained(out_dir)
    save_tiny_tokenizer(out_dir)
    return out_dir
