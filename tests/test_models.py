"""eyas.targets.models: structural discovery on real transformers models, the aux-id convention checked
against a real forward of every fixture, config-only inspection, and clear load errors."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from eyas.config import ConfigError
from eyas.errors import EyasError
from eyas.targets.models import (build_meta_model, inspect_model, load_config, load_target,
                                load_tokenizer, submodule, text_config)
from eyas.targets.taps import default_aux_layer_ids, validate_aux_layer_ids
from eyas.targets.tiny import TINY_ARCHS, tiny_config

FIXTURES = (*TINY_ARCHS, "kimi_like")
# fixture -> (text model path, lm_head path, is_wrapper, is_moe, is_mla, text model_type)
EXPECTED = {
    "llama": ("model", "lm_head", False, False, False, "llama"),
    "qwen3": ("model", "lm_head", False, False, False, "qwen3"),
    "qwen3_moe": ("model", "lm_head", False, True, False, "qwen3_moe"),
    "deepseek_v3": ("model", "lm_head", False, True, True, "deepseek_v3"),
    "qwen2_5_vl": ("model.language_model", "lm_head", True, False, False, "qwen2_5_vl_text"),
    "kimi_like": ("language_model.model", "language_model.lm_head", True, True, True,
                  "deepseek_v3"),
}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, kimi_like_dir):
    return lambda name: kimi_like_dir if name == "kimi_like" else tiny_model_dir(name)


# ----------------------------------------------------------------------------- aux layer ids

def test_default_aux_ids_match_vllm_for_real_depths():
    assert default_aux_layer_ids(61) == (2, 30, 58)  # DeepSeek-V3 / Kimi-K2.5
    assert default_aux_layer_ids(32) == (2, 16, 29)  # Llama-3.1-8B
    assert default_aux_layer_ids(7) == (2, 3, 4)


@pytest.mark.parametrize("num_layers", range(2, 130))
def test_default_aux_ids_always_valid(num_layers):
    ids = default_aux_layer_ids(num_layers)
    assert validate_aux_layer_ids(ids, num_layers) == ids


def test_default_aux_ids_small_targets():
    assert default_aux_layer_ids(4) == (1, 2, 3)
    assert default_aux_layer_ids(6) == (1, 3, 5)
    assert default_aux_layer_ids(2) == (0, 1, 2)
    with pytest.raises(ConfigError, match="num_hidden_layers >= 2"):
        default_aux_layer_ids(1)


@pytest.mark.parametrize("ids, match", [
    ((2, 16), "exactly 3"),
    ((2, 16, 29, 30), "exactly 3"),
    ((2, 16.0, 29), "exactly 3"),
    ((True, 16, 29), "exactly 3"),
    ((2, 16, 33), "out of range"),
    ((-1, 16, 29), "out of range"),
    ((2, 16, 16), "strictly ascending"),
    ((29, 16, 2), "strictly ascending"),
])
def test_validate_aux_ids_rejects_with_fix(ids, match):
    with pytest.raises(ConfigError, match=match) as err:
        validate_aux_layer_ids(ids, 32)
    assert "2,16,29" in str(err.value)  # the message names the default to use instead


def test_validate_aux_ids_accepts_bounds():
    assert validate_aux_layer_ids([0, 16, 32], 32) == (0, 16, 32)  # id L = last layer output
    assert validate_aux_layer_ids((2, 40, 99), None) == (2, 40, 99)  # no upper bound known yet


# ----------------------------------------------------------------------------- discovery

@pytest.mark.parametrize("name", FIXTURES)
def test_inspect_finds_decoder_in_every_fixture(model_dir, name):
    path = model_dir(name)
    config = load_config(path, trust_remote_code=True)
    info = inspect_model(config, trust_remote_code=True)
    text_path, head, wrapper, moe, mla, text_type = EXPECTED[name]
    assert (info.text_model_path, info.lm_head_path, info.is_wrapper) == (text_path, head, wrapper)
    assert (info.is_moe, info.is_mla, info.text_model_type) == (moe, mla, text_type)
    assert info.layers_path == f"{text_path}.layers"
    assert info.embed_path == f"{text_path}.embed_tokens"
    assert info.norm_path == f"{text_path}.norm"
    tc = text_config(config)
    assert info.num_layers == tc.num_hidden_layers and info.hidden_size == tc.hidden_size
    assert info.vocab_size == tc.vocab_size and not info.tied_embeddings
    assert info.default_aux_layer_ids == default_aux_layer_ids(info.num_layers)
    model = build_meta_model(config, trust_remote_code=True)
    assert isinstance(submodule(model, info.embed_path), nn.Embedding)
    assert len(submodule(model, info.layers_path)) == info.num_layers


def test_kimi_like_is_the_remote_code_wrapper(kimi_like_dir):
    info = inspect_model(load_config(kimi_like_dir, trust_remote_code=True),
                         trust_remote_code=True)
    assert info.architecture == "KimiK25ForConditionalGeneration"
    assert info.model_type == "kimi_k25_like" and info.num_experts == 4


def test_inspect_from_config_reads_no_weights(model_dir, tmp_path):
    # Only config.json (+ the remote code) is copied: there is no weight file to read.
    for name in ("deepseek_v3", "kimi_like"):
        src, dst = model_dir(name), tmp_path / name
        dst.mkdir()
        for f in src.glob("*"):
            if f.suffix in (".json", ".py") and f.name != "model.safetensors.index.json":
                shutil.copy(f, dst / f.name)
        assert not list(dst.glob("*.safetensors")) and not list(dst.glob("*.bin"))
        config = load_config(dst, trust_remote_code=True)
        model = build_meta_model(config, trust_remote_code=True)
        assert {p.device.type for p in model.parameters()} == {"meta"}
        assert inspect_model(config, trust_remote_code=True) == inspect_model(model)


def test_vision_tower_as_deep_as_decoder_is_not_mistaken(tmp_path):
    # Same block count in the vision tower and the text decoder: the decoder is the list
    # beside the vocabulary embedding.
    import transformers as tf

    config = tiny_config("qwen2_5_vl", num_layers=3)
    config.vision_config.depth = 3
    config.vision_config.fullatt_block_indexes = [2]
    model = build_meta_model(config)
    assert len(model.model.visual.blocks) == 3
    info = inspect_model(model)
    assert isinstance(model, tf.Qwen2_5_VLForConditionalGeneration)
    assert info.layers_path == "model.language_model.layers"


def test_layer_count_mismatch_lists_what_was_found():
    model = build_meta_model(tiny_config("llama", num_layers=4))
    model.config.num_hidden_layers = 5  # as if the config lied about the depth
    with pytest.raises(EyasError, match=r"model\.layers \(4 x LlamaDecoderLayer\)"):
        inspect_model(model)


def test_tied_embeddings_detected():
    config = tiny_config("llama", num_layers=2)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    info = inspect_model(AutoModelForCausalLM.from_config(config))
    assert info.tied_embeddings and info.lm_head_path == "lm_head"


def test_text_config_of_wrappers(model_dir):
    llama = load_config(model_dir("llama"))
    assert text_config(llama) is llama
    vl = load_config(model_dir("qwen2_5_vl"))
    assert text_config(vl) is vl.text_config
    kimi = load_config(model_dir("kimi_like"), trust_remote_code=True)
    assert text_config(kimi).model_type == "deepseek_v3"


def test_submodule_error_names_children():
    model = build_meta_model(tiny_config("llama", num_layers=2))
    assert submodule(model, "") is model
    with pytest.raises(EyasError, match=r"no submodule 'language_model'.*\['model', 'lm_head'\]"):
        submodule(model, "language_model")


# ----------------------------------------------------------------------------- layer ids vs HF

def _hook_all_layers(layers: nn.ModuleList):
    """Record the input of every layer and the output of the last one."""
    seen, handles = {}, []
    for k, layer in enumerate(layers):
        def before(_mod, args, kwargs, k=k):
            seen[k] = (args[0] if args else kwargs["hidden_states"]).clone()
        handles.append(layer.register_forward_pre_hook(before, with_kwargs=True))

    def after(_mod, _args, output):
        seen[len(layers)] = (output[0] if isinstance(output, tuple) else output).clone()
    handles.append(layers[-1].register_forward_hook(after))
    return seen, handles


@pytest.mark.parametrize("name", FIXTURES)
def test_aux_id_k_is_hf_hidden_state_k(model_dir, name):
    model, info = load_target(model_dir(name), trust_remote_code=True, dtype="float32")
    layers = submodule(model, info.layers_path)
    seen, handles = _hook_all_layers(layers)
    torch.manual_seed(0)
    ids = torch.randint(0, info.vocab_size - 1, (2, 9))  # text-only, also for the VL wrappers
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    for h in handles:
        h.remove()
    hidden = out.hidden_states
    L = info.num_layers
    assert len(hidden) == L + 1
    for k in range(L):  # id k < L: the residual stream entering layer k
        assert torch.equal(seen[k], hidden[k]), f"{name}: aux id {k}"
    # id L: the last layer's output BEFORE the final norm; HF's hidden_states[L] is after it.
    norm = submodule(model, info.norm_path)
    assert torch.equal(norm(seen[L]), hidden[L])
    assert not torch.equal(seen[L], hidden[L])
    # and the teacher: final norm -> lm_head gives the model's logits
    head = submodule(model, info.lm_head_path)
    assert torch.allclose(head(hidden[L]), out.logits, atol=1e-5)


def test_load_target_dtype_and_device(model_dir):
    model, info = load_target(model_dir("llama"), dtype=torch.bfloat16, device="cpu")
    assert info.dtype == "bfloat16" and next(model.parameters()).dtype == torch.bfloat16
    assert not model.training
    with pytest.raises(ConfigError, match="dtype"):
        load_target(model_dir("llama"), dtype="float8")


# ----------------------------------------------------------------------------- load errors

def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(EyasError, match="does not exist"):
        load_config(tmp_path / "no-such-model")
    with pytest.raises(EyasError, match="does not exist"):
        load_tokenizer(str(tmp_path / "no" / "such" / "model"))
    # a file of the model (its config.json) where its folder belongs: the folder is named
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EyasError, match=rf"config.json is a file, not a model folder: pass the "
                                        rf"folder .*\({tmp_path}, if this file is one of them\)"):
        load_config(tmp_path / "config.json")


def test_weights_cut_short_or_missing_are_a_clear_error(model_dir, tmp_path):
    """A weights file cut short (a download or copy stopped) raised safetensors' own
    "incomplete metadata" from deep in transformers, in every step that loads the target; a
    shard its index names that is gone, an OSError naming the file only. Both now say which
    file, how many bytes it has against its header's, and what to do."""
    from eyas.store.manifest import weights_damage

    src = model_dir("llama")
    folder = tmp_path / "cut"
    shutil.copytree(src, folder)
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    assert weights_damage(folder) is None
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(EyasError, match=rf"cannot load the weights from the folder {folder}: "
                                        rf"model.safetensors has {size // 2:,} bytes where its "
                                        rf"header says {size:,}: the file was cut short\. "
                                        rf"Download or copy the model again"):
        load_target(folder, dtype="float32", device="cpu")
    with open(weights, "r+b") as f:  # a header cut short too
        f.truncate(20)
    assert weights_damage(folder) == "model.safetensors has 20 bytes, too few for its header: " \
                                     "the file was cut short"
    shutil.copyfile(src / "model.safetensors", weights)
    with open(weights, "ab") as f:
        f.write(b"\0" * 3)
    assert weights_damage(folder).endswith(f"{size + 3:,} bytes where its header says "
                                           f"{size:,}: the file was given bytes after its "
                                           f"last tensor")
    # sharded: one shard of the index gone
    model, _ = load_target(src, dtype="float32", device="cpu")
    sharded = tmp_path / "sharded"
    shutil.copytree(src, sharded)
    (sharded / "model.safetensors").unlink()
    model.save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) >= 3 and weights_damage(sharded) is None
    shards[1].unlink()
    with pytest.raises(EyasError, match=rf"1 of the {len(shards)} files "
                                        rf"model.safetensors.index.json names is missing "
                                        rf"\({shards[1].name}\)"):
        load_target(sharded, dtype="float32", device="cpu")


def test_remote_code_needs_trust(kimi_like_dir):
    with pytest.raises(EyasError, match="--trust-remote-code"):
        load_config(kimi_like_dir)


def test_offline_hub_name_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(EyasError, match="`hf download eyas-test/no-such-model`.*`hf auth login`"):
        load_config("eyas-test/no-such-model")


# ----------------------------------------------------------------------------- the fixture

def test_kimi_like_loads_like_kimi_and_round_trips(kimi_like_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(kimi_like_dir, trust_remote_code=True)
    assert config.architectures == ["KimiK25ForConditionalGeneration"]
    assert "AutoModelForCausalLM" in config.auto_map
    torch.manual_seed(0)  # build_kimi_like's default seed: the same random weights
    fresh = AutoModelForCausalLM.from_config(config, trust_remote_code=True).eval()
    loaded = AutoModelForCausalLM.from_pretrained(kimi_like_dir, trust_remote_code=True).eval()
    ids = torch.randint(0, 2000, (1, 10))
    with torch.no_grad():
        text_only = loaded(input_ids=ids).logits
        assert torch.equal(fresh(input_ids=ids).logits, text_only)
        # an image fills the placeholder positions: logits change there and after, not before
        ids[0, 4:8] = config.media_placeholder_token_id
        plain = loaded(input_ids=ids).logits
        with_image = loaded(input_ids=ids, pixel_values=torch.randn(1, 3, 4, 16)).logits
    assert torch.allclose(plain[0, :4], with_image[0, :4], atol=1e-5)  # MoE batching: not bitwise
    assert not torch.allclose(plain[0, 4:], with_image[0, 4:])


def test_full_size_kimi_k25_from_config_alone(tmp_path):
    # 61 layers, 384 experts, ~1T parameters: built on the meta device in seconds, no weights.
    from eyas.targets.kimi_like import kimi_k25_text_config, write_kimi_like_config

    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    path = write_kimi_like_config(tmp_path / "kimi-k25", kimi_k25_text_config(),
                                  quantization_config=quant)
    info = inspect_model(load_config(path, trust_remote_code=True), trust_remote_code=True)
    assert info.default_aux_layer_ids == (2, 30, 58)
    assert (info.layers_path, info.num_layers, info.num_experts) == (
        "language_model.model.layers", 61, 384)
    assert (info.hidden_size, info.vocab_size, info.head_dim) == (7168, 163840, 192)
    assert info.rope_scaling["rope_type"] == "yarn" and info.rope_theta == 50000.0
    assert info.dtype == "bfloat16" and info.quantization == quant


def test_hybrid_decoder_with_mixed_layer_classes():
    # Jamba interleaves Mamba and attention decoder layers in one list.
    from transformers import JambaConfig

    config = JambaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=2, attn_layer_period=2, attn_layer_offset=1,
                         expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                         mamba_dt_rank=8, mamba_expand=2, mamba_d_conv=4)
    info = inspect_model(config)
    assert (info.layers_path, info.norm_path, info.num_layers) == ("model.layers",
                                                                   "model.final_layernorm", 4)
    assert info.is_moe and info.num_experts == 2
