from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from eyas.config import option
from eyas.errors import EyasError
from eyas.store.manifest import (LAYER_ID_CONVENTION, check_same_target, read_manifest, target_record,
                                 write_manifest)


@dataclass(frozen=True)
class Cfg:
    x: int = option(1, "x")


def test_write_read_roundtrip_and_step_check(tmp_path):
    m = write_manifest(tmp_path / "a", "capture", Cfg(), target={"name_or_path": "t"},
                       aux_layer_ids=[2, 4, 5])
    assert m["layer_id_convention"] == LAYER_ID_CONVENTION
    back = read_manifest(tmp_path / "a", step="capture")
    assert back["id"] == m["id"] and back["config"] == {"x": 1}
    assert "torch" in back["versions"]
    with pytest.raises(EyasError, match="output of `eyas capture`.*run `eyas train`"):
        read_manifest(tmp_path / "a", step="train")
    with pytest.raises(EyasError, match="missing does not exist. Point this option at the "
                                        "output folder of `eyas prepare`"):
        read_manifest(tmp_path / "missing", step="prepare")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EyasError, match="no eyas.json"):
        read_manifest(tmp_path / "empty", step="prepare")
    downstream = write_manifest(tmp_path / "b", "train", Cfg(x=2), inputs=[back])
    assert json.loads((tmp_path / "b" / "eyas.json").read_text())["inputs"][0]["id"] == m["id"]
    assert downstream["id"] != m["id"]


def test_a_data_files_stamp_leaves_the_manifest_id_alone(tmp_path):
    """A data file's size and mtime say when to hash it again; the same rows under another
    mtime (a copy, a checkout) are the same input, so capture, which resumes only on the same
    prepared id, still resumes."""
    rows = {"path": "chats.jsonl", "sha256": "ab" * 32}
    old = write_manifest(tmp_path / "a", "prepare", Cfg(), data_files=[rows])
    new = write_manifest(tmp_path / "b", "prepare", Cfg(),
                         data_files=[{**rows, "size": 10, "mtime_ns": 1}])
    assert new["id"] == old["id"] and new["data_files"][0]["mtime_ns"] == 1
    other = write_manifest(tmp_path / "c", "prepare", Cfg(),
                           data_files=[{**rows, "sha256": "cd" * 32}])
    assert other["id"] != old["id"]
    # nor a reader's, whose record of prepare holds those data_files (eyas run's check of
    # a removed prepared/)
    reads = [write_manifest(tmp_path / f"r{n}", "capture", Cfg(), inputs=[m])
             for n, m in enumerate((old, new, other))]
    assert reads[1]["inputs"][0]["data_files"] == new["data_files"]
    assert reads[0]["id"] == reads[1]["id"] != reads[2]["id"]


def test_how_a_capture_batched_or_wrote_leaves_its_id_alone(tmp_path):
    """A capture repeated with another --batch-tokens (after an out-of-memory), --file-mb or
    --writer-threads stores the same states: its id, which the training runs on it recorded,
    stays; another dtype is another capture."""
    from eyas.capture import CaptureConfig

    base = dict(target="t", data="p", out=str(tmp_path / "cap"))
    ids = [write_manifest(tmp_path / f"m{n}", "capture", CaptureConfig(**base, **extra))["id"]
           for n, extra in enumerate(({}, {"batch_tokens": 1000, "file_mb": 8.0,
                                           "writer_threads": 1}, {"dtype": "fp8"}))]
    assert ids[0] == ids[1] != ids[2]


def test_target_mismatch_is_refused(tiny_tok):
    rec = target_record("a", tokenizer=tiny_tok)
    other = dict(rec, name_or_path="b", tokenizer_hash="0" * 16)
    check_same_target(rec, dict(rec), "prepared data")
    with pytest.raises(EyasError, match="made for target a.*--target b"):
        check_same_target(rec, other, "prepared data")


def test_another_architecture_of_the_same_shape_is_refused(tiny_tok):
    """A Qwen3 and a Llama of one tokenizer, hidden size, depth and vocab are two targets,
    not one model's other weights: refused before the weights are compared (so
    --accept-other-weights does not let one stand for the other)."""
    import transformers

    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=100)
    llama, qwen3 = (target_record(name, config=cfg(**shape), tokenizer=tiny_tok)
                    for name, cfg in (("llama", transformers.LlamaConfig),
                                      ("qwen3", transformers.Qwen3Config)))
    assert {k: v for k, v in llama.items() if v != qwen3[k]} == {
        "name_or_path": "llama", "model_type": "llama"}
    with pytest.raises(EyasError, match=r"made for target llama \(model_type=llama\) but this "
                                        r"run uses qwen3 \(model_type=qwen3\)"):
        check_same_target(llama, qwen3, "the capture", weights=False)


def _perturbed(src, out, name="model.layers.1.self_attn.q_proj.weight", scale=1.01):
    """A copy of the saved model in `src` with one tensor changed, as a fine-tune changes it."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    weights = load_file(str(out / "model.safetensors"))
    weights[name] = weights[name] * scale
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_weights_fingerprint_tells_checkpoints_apart(llama_dir, tmp_path):
    import torch
    import transformers as tf

    from eyas.store.manifest import weights_fingerprint
    from eyas.targets.tiny import build_tiny_model

    base = weights_fingerprint(llama_dir)
    assert base == weights_fingerprint(build_tiny_model("llama", tmp_path / "again"))
    # one tensor changed (a LoRA merged into one projection): another fingerprint
    assert weights_fingerprint(_perturbed(llama_dir, tmp_path / "tuned")) != base
    assert weights_fingerprint(build_tiny_model("llama", tmp_path / "s1", seed=1)) != base
    # the same tensors re-sharded keep it; the same model stored in bf16 does not
    model = tf.AutoModelForCausalLM.from_pretrained(llama_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert weights_fingerprint(tmp_path / "sharded") == base
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert weights_fingerprint(tmp_path / "bf16") != base
    # a download under way (a shard its index names is missing), or no weights: none
    next((tmp_path / "sharded").glob("*-00002-of-*.safetensors")).unlink()
    assert weights_fingerprint(tmp_path / "sharded") is None
    assert weights_fingerprint(tmp_path / "nothing-here") is None
    # a pickled checkpoint: its bytes
    (tmp_path / "pt").mkdir()
    torch.save(model.state_dict(), tmp_path / "pt" / "pytorch_model.bin")
    first = weights_fingerprint(tmp_path / "pt")
    torch.save({k: v * 2 for k, v in model.state_dict().items()},
               tmp_path / "pt" / "pytorch_model.bin")
    assert first is not None and weights_fingerprint(tmp_path / "pt") != first


def test_hub_name_and_its_local_copy_are_one_target(llama_dir, tmp_path, monkeypatch):
    import shutil

    import huggingface_hub

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(llama_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub, local = target_record("org/tiny"), target_record(str(llama_dir))
    assert hub["weights_fingerprint"] == local["weights_fingerprint"] is not None
    assert "weights_fingerprint" not in target_record("org/not-downloaded")


def test_other_weights_of_one_shape_are_refused_unless_accepted(tiny_tok):
    made = dict(target_record("base", tokenizer=tiny_tok), weights_fingerprint="1" * 16)
    used = dict(made, name_or_path="tuned", weights_fingerprint="2" * 16)
    with pytest.raises(EyasError, match=r"made with the weights of base .*same tokenizer and "
                                        r"shape but other weights.*--target tuned.*"
                                        r"--accept-other-weights"):
        check_same_target(made, used, "the capture c")
    check_same_target(made, used, "the capture c", weights=False)
    check_same_target(made, dict(used, weights_fingerprint=None), "an older capture")


@pytest.mark.parametrize("text, why", [("{", "Expecting property name"), ("[1]", "a JSON list"),
                                       (b"\xff\xfe", "'utf-8' codec can't decode")])
def test_damaged_manifest_is_named_with_the_fix(tmp_path, text, why):
    write_manifest(tmp_path / "a", "capture", Cfg(), target={"name_or_path": "t"})
    path = tmp_path / "a" / "eyas.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(EyasError, match=rf"eyas.json is damaged \({why}.*run the step that made "
                                        rf".*a again"):
        read_manifest(tmp_path / "a", step="capture")
    with pytest.raises(EyasError, match="is damaged"):  # a --target folder that has one
        target_record(str(tmp_path / "a"))


def test_owner_only_files_get_the_umasks_mode_and_others_are_left(tmp_path):
    from safetensors.torch import save_file

    from eyas.store.permissions import as_umask

    (tmp_path / "sub").mkdir()
    save_file({"a": torch.zeros(1)}, str(tmp_path / "sub" / "w.safetensors"))
    (tmp_path / "private.txt").write_text("x")
    (tmp_path / "private.txt").chmod(0o400)  # a mode someone chose: not 0600, left alone
    mask = os.umask(0o027)
    try:
        as_umask(tmp_path)
    finally:
        os.umask(mask)
    assert (tmp_path / "sub" / "w.safetensors").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "private.txt").stat().st_mode & 0o777 == 0o400


def test_an_out_inside_another_steps_folder_is_refused(tmp_path):
    """From an audit: `eyas export --out run/draft` was accepted, and the training run, now
    holding a folder it did not write, could no longer resume."""
    from eyas.store.manifest import check_out

    write_manifest(tmp_path / "run", "train", Cfg())
    for out in (tmp_path / "run" / "draft", tmp_path / "run" / "checkpoints" / "x"):
        with pytest.raises(EyasError, match=r"is inside .*run, the output of `eyas train`.*"
                                            r"choose an --out outside it"):
            check_out(out, "export")
    assert not (tmp_path / "run" / "draft").exists()
    assert check_out(tmp_path / "draft", "export") == tmp_path / "draft"  # beside it: fine
    (tmp_path / "work").mkdir()  # a plain folder above is no step's
    assert check_out(tmp_path / "work" / "draft", "export") == tmp_path / "work" / "draft"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_that_cannot_be_written_is_refused_before_the_step_starts():
    # a read-only --out ended prepare, capture, train, export and eval in an OSError
    # traceback, capture and train only after loading the target (root ignores chmod, so
    # /proc, where no file can be made, stands for a read-only file system)
    from eyas.store.manifest import check_out

    with pytest.raises(EyasError, match=r"--out /proc/eyas-test/out: eyas capture cannot "
                                        r"write there \(/proc: .*\); give a folder it can "
                                        r"write into"):
        check_out("/proc/eyas-test/out", "capture")
