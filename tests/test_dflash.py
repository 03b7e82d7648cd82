"""DFlash drafts: captures of N target layers, the draft model as vLLM's DFlashDraftModel runs
it, its block training objective, `eyas train --draft dflash` and the exported folder."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.config import ConfigError
from eyas.errors import EyasError
from eyas.target.models import dflash_aux_layer_ids, validate_aux_layer_ids

# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def dflash_inputs(tmp_path_factory):
    """The real pipeline on test_train's predictable tiny Llama (8 layers): 40 synthetic chats,
    prepared, captured with 5 taps (--split all)."""
    from test_train import copy_target

    from eyas.capture import CaptureConfig, capture
    from eyas.prepare import PrepareConfig, prepare
    from eyas.target.corpus import synthetic_chats

    root = tmp_path_factory.mktemp("dflash-inputs")
    model = copy_target(root / "target")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(40, seed=0)))
    prepare(PrepareConfig(target=str(model), data=(str(chats),), out=str(root / "prepared"),
                          max_length=256, eval_fraction=0.15))
    capture(CaptureConfig(target=str(model), data=str(root / "prepared"),
                          out=str(root / "captured"), split="all", model_dtype="fp32",
                          batch_tokens=2048, aux_layer_ids=TAPS))
    return {k: str(root / k) for k in ("target", "prepared", "captured")}


TAPS = (1, 2, 4, 6, 8)  # 8-layer target: id 8 is the last layer's output (before the norm)

# ----------------------------------------------------------------------------- capture


def test_default_taps_are_the_reference_layout_plus_one():
    # SpecForge / z-lab `build_target_layer_ids` outputs, each +1 into vLLM's aux-id convention
    # (docs/dflash.md section 7): Qwen3-8B, Llama-3.1-8B, Qwen2.5-0.5B with 5 draft layers
    assert dflash_aux_layer_ids(36, 5) == (2, 10, 18, 26, 34)
    assert dflash_aux_layer_ids(32, 5) == (2, 9, 16, 23, 30)
    assert dflash_aux_layer_ids(24, 5) == (2, 7, 12, 17, 22)
    assert dflash_aux_layer_ids(36, 1) == (19,)  # one tap: output of layer L//2
    for depth in range(5, 100):
        for taps in range(1, min(depth - 3, 8)):
            ids = dflash_aux_layer_ids(depth, taps)
            assert validate_aux_layer_ids(ids, depth, count=None) == ids
    with pytest.raises(ConfigError, match="fewer --dflash-taps"):
        dflash_aux_layer_ids(6, 5)


def test_aux_ids_any_count_for_capture_exactly_three_for_eagle3():
    assert validate_aux_layer_ids((2, 4, 6, 7, 8), 8, count=None) == (2, 4, 6, 7, 8)
    assert validate_aux_layer_ids((5,), 8, count=None) == (5,)
    with pytest.raises(ConfigError, match="exactly 3"):
        validate_aux_layer_ids((2, 4, 6, 7, 8), 8)
    with pytest.raises(ConfigError, match="ascending"):
        validate_aux_layer_ids((2, 6, 4, 7), 8, count=None)
    with pytest.raises(ConfigError, match="at least one"):
        validate_aux_layer_ids((), 8, count=None)


def test_capture_config_takes_n_taps_or_the_dflash_default():
    from eyas.capture import CaptureConfig

    base = dict(target="t", data="d", out="o")
    assert CaptureConfig(**base, aux_layer_ids=(1, 2, 3, 4, 5)).aux_layer_ids == (1, 2, 3, 4, 5)
    with pytest.raises(ConfigError, match="--dflash-taps"):
        CaptureConfig(**base, aux_layer_ids=(1, 2, 3), dflash_taps=5)
    with pytest.raises(ConfigError, match="--dflash-taps"):
        CaptureConfig(**base, dflash_taps=-1)


def test_capture_stores_n_taps_equal_to_hidden_states(dflash_inputs):
    """Five taps land in the manifest and in the shards, each equal to HF's
    output_hidden_states[k] (id L: the final norm's input); training collates (T, 5*Ht)."""
    from transformers import AutoModelForCausalLM

    from eyas.draft import data
    from eyas.store.manifest import read_manifest

    man = read_manifest(dflash_inputs["captured"], step="capture")
    assert man["aux_layer_ids"] == list(TAPS)
    src = data.OfflineSource(dflash_inputs["captured"])
    sample = src.fetch([0])[0]
    n = sample["input_ids"].shape[0]
    assert sample["aux_hidden"].shape == (n, len(TAPS), 64)
    model = AutoModelForCausalLM.from_pretrained(dflash_inputs["target"], dtype=torch.float32)
    with torch.no_grad():
        out = model(sample["input_ids"][None].long(), output_hidden_states=True)
    for j, k in enumerate(TAPS):
        want = out.hidden_states[k][0] if k < 8 else None
        if want is None:  # id L: HF's hidden_states[L] is after the norm; ours before it
            want = out.hidden_states[8][0]
            got = model.model.norm(sample["aux_hidden"][:, j].float())
        else:
            got = sample["aux_hidden"][:, j].float()
        torch.testing.assert_close(got, want.float(), atol=2e-2, rtol=2e-2)  # bf16 storage
    batch = data.collate([[sample]], 256, torch.float32)
    assert batch["aux_hidden"].shape == (1, 256, len(TAPS) * 64)
    assert torch.equal(batch["aux_hidden"][0, :n].view(n, len(TAPS), 64),
                       sample["aux_hidden"].float())


def test_capture_dflash_taps_default(dflash_inputs, tmp_path):
    from eyas.capture import CaptureConfig, capture
    from eyas.store.manifest import read_manifest

    capture(CaptureConfig(target=dflash_inputs["target"], data=dflash_inputs["prepared"],
                          out=str(tmp_path / "cap"), split="eval", model_dtype="fp32",
                          dflash_taps=3, limit=2))
    # 8 layers: outputs of layers 1, 3, 5 (round(1 + i*4/2)) -> vLLM ids 2, 4, 6
    assert read_manifest(tmp_path / "cap", step="capture")["aux_layer_ids"] == [2, 4, 6]


def test_eagle3_training_refuses_a_five_tap_capture_with_the_fix(dflash_inputs, tmp_path):
    from eyas.train import TrainConfig, train

    cfg = TrainConfig(data=dflash_inputs["captured"], out=str(tmp_path / "run"), max_steps=1,
                      batch_tokens=256, num_workers=0, lm_head="scratch")
    with pytest.raises(EyasError, match=r"holds 5 target layer.*exactly 3.*Re-capture.*"
                                        r"--aux-layer-ids.*--draft dflash"):
        train(cfg)
