"""eyas.targets.weights: a checkpoint's tensors one at a time (offline training's embedding and
lm_head, the vLLM capture backend's final norm and lm_head)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eyas.errors import EyasError
from eyas.targets.weights import INDEX, TargetWeights


def test_keys_by_name_or_unique_suffix_across_sharded_files(tmp_path):
    embed, head = torch.randn(10, 4), torch.randn(10, 4)
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "a.safetensors"))
    save_file({"lm_head.weight": head, "model.layers.0.mlp.weight": torch.ones(2),
               "model.layers.1.mlp.weight": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    w = TargetWeights(str(tmp_path))
    assert w.key("lm_head.weight") == "lm_head.weight"
    # a wrapper's module path: the checkpoint dropped the language_model level
    assert w.key("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert w.key("mlp.weight") is None  # two layers end so: no guess
    assert w.key("model.norm.weight") is None
    assert torch.equal(w.read("model.embed_tokens.weight"), embed)
    assert torch.equal(w.read("lm_head.weight"), head)
    # an index names the files (and only its keys count)
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"lm_head.weight": "b.safetensors"}}))
    w = TargetWeights(str(tmp_path))
    assert w.key("lm_head.weight") == "lm_head.weight"
    assert w.key("model.embed_tokens.weight") is None


def test_a_key_that_adds_a_prefix_to_the_whole_name(tmp_path):
    """Kimi-K2.5 loaded by transformers' own class (no remote code) names its head lm_head,
    while the checkpoint stores language_model.lm_head.weight: found, as long as it is the only
    key ending so."""
    head = torch.randn(10, 4)
    save_file({"language_model.lm_head.weight": head,
               "language_model.model.norm.weight": torch.ones(4),
               "vision_tower.norm.weight": torch.ones(4)}, str(tmp_path / "a.safetensors"))
    w = TargetWeights(str(tmp_path))
    assert w.key("lm_head.weight") == "language_model.lm_head.weight"
    assert torch.equal(w.read(w.key("lm_head.weight")), head)
    assert w.key("norm.weight") is None  # two keys end so: no guess


def test_a_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(EyasError, match="no safetensors weights"):
        TargetWeights(str(tmp_path))
