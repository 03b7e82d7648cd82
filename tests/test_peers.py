"""benchmarks/peers/speculators_train.py end to end on a tiny target (CPU): eyas prepare ->
capture -> vocab, speculators' own trainer on that capture for a few steps, the vLLM-layout
folder it writes read back by `eyas eval`, and that folder computing the same logits as
speculators' own checkpoint (so the key mapping and the EAGLE 3.1 flags are right).

Needs `speculators==0.9.0` importable (e.g. `pip install --target DIR` its wheels without
torch/transformers, then PYTHONPATH=DIR); skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                       reason="speculators is not importable (pip install --target DIR "
                              "speculators==0.9.0 hs-connectors ... and set PYTHONPATH=DIR)"),
]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "speculators_train.py"


def _run(args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def peer_run(llama_dir, tmp_path_factory):
    from eyas.targets.corpus import synthetic_chats

    work = tmp_path_factory.mktemp("peers")
    chats = work / "chats.jsonl"
    chats.write_text("\n".join(json.dumps(r) for r in synthetic_chats(24, seed=0)) + "\n")
    eyas = ["-m", "eyas"]
    _run([*eyas, "prepare", "--target", str(llama_dir), "--data", str(chats), "--out",
          "prepared"], work)
    _run([*eyas, "capture", "--target", str(llama_dir), "--data", "prepared", "--out",
          "captured"], work)
    _run([*eyas, "vocab", "--data", "prepared", "--out", "vocab", "--draft-vocab-size", "128"],
         work)
    _run([str(SCRIPT), "--capture", "captured", "--vocab", "vocab", "--target", str(llama_dir),
          "--out", "peer", "--epochs", "2", "--batch-tokens", "512", "--device", "cpu",
          "--num-workers", "0"], work)
    return work


def test_peer_json_records_speculators_recipe_and_split(peer_run):
    peer = json.loads((peer_run / "peer" / "peer.json").read_text())
    assert peer["speculators_version"] == "0.9.0"
    recipe = peer["recipe"]
    assert recipe["optimizer"] == "muon" and recipe["lr"] == 1e-3
    assert recipe["ttt_steps"] == 3 and recipe["ttt_step_loss_decay"] == 1.0
    assert recipe["scheduler_type"] == "linear" and recipe["loss_implementation"] == "eager"
    assert recipe["norm_before_fc"] and recipe["norm_output"] and recipe["norm_before_residual"]
    assert peer["steps"] > 0 and Path(peer["train_log"]).is_file()
    # eyas's split: 23 captured train samples, one held out (eyas train's --eval-fraction)
    assert (peer["train_samples"], peer["eval_samples"]) == (22, 1)
    assert peer["final_norm_inversion_max_rel_error"] < 1e-2
    assert peer["wall_s"]["convert_data"] >= 0 and peer["convert_jobs"] >= 1
    config = json.loads((peer_run / "peer" / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["norm_before_fc"] and config["norm_output"] and config["norm_before_residual"]
    assert "target_hidden_size" not in config
    captured = json.loads((peer_run / "captured" / "eyas.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == captured["aux_layer_ids"]


def test_vllm_folder_computes_speculators_logits(peer_run, llama_dir):
    """Step 0 on the same inputs: eyas's reader of the written folder against speculators'
    own model loaded from its checkpoint (input_norm included, flags as trained)."""
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from transformers import AutoModelForCausalLM

    from eyas.draft.eagle3 import Eagle3Draft

    peer = json.loads((peer_run / "peer" / "peer.json").read_text())
    ckpt = Path(peer["checkpoint"])
    assert "input_norm.weight" in load_file(str(peer_run / "peer" / "draft" /
                                                 "model.safetensors"))
    config = Eagle3SpeculatorConfig.from_pretrained(ckpt)
    config.transformer_layer_config._attn_implementation = "sdpa"
    theirs = Eagle3DraftModel.from_pretrained(ckpt, config=config).float().eval()
    target = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ours = Eagle3Draft.from_pretrained(peer_run / "peer" / "draft",
                                       embed_tokens=target.model.embed_tokens).float().eval()

    torch.manual_seed(0)
    t, h = 12, target.config.hidden_size
    aux = torch.randn(1, t, 3 * h)
    ids = torch.randint(0, target.config.vocab_size, (1, t))
    pos = torch.arange(1, t + 1)[None]
    seen = []
    hook = theirs.lm_head.register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        theirs(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, t, dtype=torch.long),
               position_ids=pos, ttt_steps=1)
        mine = ours(ids, aux, pos).logits
    hook.remove()
    torch.testing.assert_close(mine, seen[0], rtol=2e-3, atol=2e-3)


def test_eyas_eval_reads_the_peer_draft(peer_run, llama_dir):
    _run(["-m", "eyas", "eval", "--target", str(llama_dir), "--draft", "peer/draft",
          "--data", "prepared", "--out", "report", "--max-new-tokens", "16"], peer_run)
    report = json.loads((peer_run / "report" / "eyas.json").read_text())
    text = json.dumps(report)
    assert "mean_acceptance_length" in text and report.get("lossless", True) is True


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_parallel_data_conversion_equals_serial(peer_run, llama_dir, tmp_path):
    """--jobs only changes who writes which file: the data folder is byte for byte the one the
    serial loop writes, hs_{i} and dataset row i hold sample ids[i] (train samples first)."""
    from datasets import load_from_disk
    from safetensors.torch import load_file
    from transformers import AutoConfig

    spec = importlib.util.spec_from_file_location("speculators_train", SCRIPT)
    st = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = st  # its dataclass looks its module up while the file executes
    spec.loader.exec_module(st)
    src, train_ids, eval_ids = st.eyas_split(peer_run / "captured", None, None)
    ids = torch.cat([torch.as_tensor(train_ids), torch.as_tensor(eval_ids)]).numpy()
    norm_w = st.verifier_norm_weight(str(llama_dir))
    eps = float(AutoConfig.from_pretrained(llama_dir).rms_norm_eps)
    errors = [st.write_speculators_data(src, ids, norm_w, eps, tmp_path / f"jobs{j}", jobs=j)
              for j in (1, 3)]
    assert errors[0] == errors[1] < 1e-2
    serial = _files(tmp_path / "jobs1")
    assert len([n for n in serial if n.startswith("hidden_states/")]) == len(ids)
    assert _files(tmp_path / "jobs3") == serial
    # the script's own run (default --jobs) wrote the same folder
    assert _files(peer_run / "peer" / "speculators-data") == serial
    rows = load_from_disk(str(tmp_path / "jobs1"))
    for i in (0, len(ids) - 1):
        sample = src.capture.sample(int(ids[i]))
        hs = load_file(str(tmp_path / "jobs1" / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(hs["token_ids"], sample["input_ids"].long())
        assert torch.equal(hs["hidden_states"][:, :3], sample["aux_hidden"])
        assert rows[i]["input_ids"].tolist() == sample["input_ids"].tolist()
        assert rows[i]["loss_mask"].tolist() == sample["loss_mask"].tolist()


SPECFORGE_SCRIPT = SCRIPT.with_name("specforge_train.py")


@pytest.mark.skipif(importlib.util.find_spec("specforge") is None,
                    reason="specforge is not importable (pip install --no-deps --target DIR "
                           "specforge==0.2.0 and set PYTHONPATH=DIR)")
def test_specforge_peer_trains_exports_and_matches_its_draft(peer_run, llama_dir):
    """benchmarks/peers/specforge_train.py on the same capture: SpecForge's own trainer runs
    (its defaults), its feature files hold eyas's post-norm final state and the aux states
    low to high, the layer ids are SpecForge's (vLLM's - 1, as its own default for this target
    gives), and the vLLM folder computes SpecForge's own step-0 logits and is read by eyas eval."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from eyas.draft.eagle3 import Eagle3Draft
    from specforge.algorithms.model_providers import resolve_eagle_capture_layers
    from specforge.export.checkpoint_io import resolve_training_state
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    _run([str(SPECFORGE_SCRIPT), "--capture", "captured", "--vocab", "vocab", "--target",
          str(llama_dir), "--out", "peer-specforge", "--epochs", "2", "--batch-tokens", "512",
          "--device", "cpu", "--num-workers", "0"], peer_run)
    out = peer_run / "peer-specforge"
    peer = json.loads((out / "peer.json").read_text())
    assert peer["specforge_version"] == "0.2.0" and peer["steps"] > 0
    recipe = peer["recipe"]
    assert (recipe["learning_rate"], recipe["warmup_ratio"], recipe["max_grad_norm"],
            recipe["ttt_length"], recipe["lr_scheduler"]) == (1e-4, 0.015, 0.5, 7, "cosine")
    assert (peer["train_samples"], peer["eval_samples"]) == (22, 1)

    # layer ids: the capture's (vLLM) ids minus one, equal to SpecForge's own default
    captured = json.loads((peer_run / "captured" / "eyas.json").read_text())
    aux = captured["aux_layer_ids"]
    spec = json.loads((out / "draft_config.json").read_text())
    assert peer["specforge_aux_layer_ids"] == [k - 1 for k in aux]
    assert resolve_eagle_capture_layers(
        _SpecForgeRun(), {}, LlamaConfig(**json.loads((llama_dir / "config.json").read_text()))
    ) == [k - 1 for k in aux]
    config = json.loads((out / "draft" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == aux and "norm_output" not in config

    # feature file 0 = eyas's first train sample: post-norm final state, aux low -> high
    spec_train = importlib.util.spec_from_file_location("specforge_train", SPECFORGE_SCRIPT)
    sf = importlib.util.module_from_spec(spec_train)
    spec_train.loader.exec_module(sf)
    src, train_ids, _ = sf.eyas_split(peer_run / "captured", None, None)
    sample = src.capture.sample(int(train_ids[0]))
    feat = torch.load(out / "specforge-data" / "data_00000000.ckpt")
    assert torch.equal(feat["hidden_state"][0], sample["final_hidden"])
    assert torch.equal(feat["aux_hidden_state"][0].unflatten(-1, (3, -1)), sample["aux_hidden"])
    assert torch.equal(feat["input_ids"], sample["input_ids"].long())
    # only the sample's bytes: torch.save writes a view's whole storage, and safetensors >= 0.8
    # slices are views of their part file (the H200 lease's disk filled so, 2026-12-02)
    data_bytes = sum(t.numel() * t.element_size() for t in feat.values())
    assert (out / "specforge-data" / "data_00000000.ckpt").stat().st_size < data_bytes + 4096

    # step 0 on the same inputs: SpecForge's model from its checkpoint against eyas's reader
    theirs = LlamaForCausalLMEagle3(LlamaConfig(**spec), attention_backend="sdpa")
    missing, unexpected = theirs.load_state_dict(
        resolve_training_state(peer["checkpoint"])["draft_state_dict"], strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected
    theirs = theirs.float().eval()
    target = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    theirs.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    ours = Eagle3Draft.from_pretrained(out / "draft",
                                       embed_tokens=target.model.embed_tokens).float().eval()
    torch.manual_seed(0)
    t, h = 12, target.config.hidden_size
    aux_in = torch.randn(1, t, 3 * h)
    ids = torch.randint(0, target.config.vocab_size, (1, t))
    pos = torch.arange(t)[None]
    with torch.no_grad():
        g = theirs.project_hidden_states(aux_in)
        mask = theirs.prepare_decoder_attention_mask(torch.ones(1, t, dtype=torch.bool), g,
                                                     1, t, 0)
        ref = theirs.compute_logits(theirs.backbone(theirs.embed_input_ids(ids), g, [[], []],
                                                    mask, pos))
        mine = ours(ids, aux_in, pos).logits
    torch.testing.assert_close(mine, ref, rtol=2e-3, atol=2e-3)

    _run(["-m", "eyas", "eval", "--target", str(llama_dir), "--draft", "peer-specforge/draft",
          "--data", "prepared", "--out", "report-specforge", "--max-new-tokens", "16"], peer_run)
    assert "mean_acceptance_length" in (peer_run / "report-specforge" / "eyas.json").read_text()


class _SpecForgeRun:
    """The one field of SpecForge's run config its capture-layer default reads (none set)."""

    class model:
        aux_hidden_state_layer_ids = None
