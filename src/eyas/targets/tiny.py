"""Tiny targets and a tiny tokenizer for tests and the CPU demo (no downloads).

`tiny_tokenizer()` trains a small byte-level BPE with `tokenizers` on eyas's own synthetic chat
corpus and wraps it as a transformers `PreTrainedTokenizerFast` with a Llama-3-style chat
template (system, user, assistant and tool roles). `build_tiny_model(arch, out_dir)` builds a
random model of a real transformers architecture from its config and saves it with
`save_pretrained`, so code under test loads it by path exactly as it loads a real model.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from eyas.targets.corpus import synthetic_chats

TINY_VOCAB = 2048
SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
)
# Llama-3 style: a header per turn, the turn's text, then <|eot_id|> (which the model generates).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TINY_ARCHS = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "qwen2_5_vl")


def _corpus_text(n: int = 3000) -> list[str]:
    texts = []
    for row in synthetic_chats(n, seed=1234):
        texts.extend(m["content"] for m in row["messages"])
    return texts


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus_text(), trainer=trainer)
    return tok.to_str()


def tiny_tokenizer():
    """A fresh ~2k-token byte-level BPE `PreTrainedTokenizerFast` with a chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|pad|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS
                                   if t not in ("<|begin_of_text|>", "<|eot_id|>", "<|pad|>")],
    )
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def save_tiny_tokenizer(out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    tiny_tokenizer().save_pretrained(out_dir)
    return out_dir


def tiny_config(arch: str, vocab_size: int = TINY_VOCAB, num_layers: int = 8, hidden: int = 64):
    """A transformers config of architecture `arch` with tiny shapes."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=4, pad_token_id=5)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, decoder_sparse_step=1)
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(
            **{**common, "num_hidden_layers": num_layers - 1, "num_key_value_heads": 4},
            moe_intermediate_size=32,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16)  # kv heads = heads, as in DeepSeek-V3 / Kimi
    if arch == "qwen2_5_vl":
        text = {**common, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=hidden, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=112, fullatt_block_indexes=[0])
        return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                   tie_word_embeddings=False)
    raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")


def build_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, *, num_layers: int = 8,
                     hidden: int = 64, dtype: torch.dtype = torch.float32) -> Path:
    """Build a random `arch` model, save it with its tokenizer into `out_dir`, return the path."""
    import transformers as tf

    out_dir = Path(out_dir)
    config = tiny_config(arch, num_layers=num_layers, hidden=hidden)
    torch.manual_seed(seed)
    if arch == "qwen2_5_vl":
        model = tf.Qwen2_5_VLForConditionalGeneration(config)
    else:
        model = tf.AutoModelForCausalLM.from_config(config)
    model.to(dtype).save_pretrained(out_dir)
    save_tiny_tokenizer(out_dir)
    return out_dir
