"""`eyas convert`: a GGUF target de-quantized once into a Hugging Face folder, on tiny Q8_0 GGUF
files (conftest.write_tiny_gguf). The folder computes the GGUF's logits exactly, tokenizes and
renders chats as the GGUF does, is written atomically, never overwrites another folder, and is
the same target as its GGUF for every manifest check, while a folder of another GGUF is not.
The real SmolLM2 GGUF's conversion is in test_real_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eyas.capture import CaptureConfig, capture
from eyas.cli import main
from eyas.config import ConfigError
from eyas.convert import ConvertConfig, convert
from eyas.errors import EyasError
from eyas.evaluate import EvalConfig, evaluate
from eyas.prepare import PrepareConfig, prepare
from eyas.store.manifest import (check_same_target, gguf_fingerprint, read_manifest,
                                 target_record, tokenizer_fingerprint)
from eyas.targets import convert as convert_module
from eyas.targets.convert import convert_gguf
from eyas.targets.corpus import synthetic_chats
from eyas.targets.models import load_config, load_target, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "Hello world, count 123 things.\n\n <|eot_id|> and<|start_header_id|> more"
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."}]


@pytest.fixture(scope="module")
def gguf(tiny_gguf):
    return tiny_gguf(0)


@pytest.fixture(scope="module")
def folder(gguf, tmp_path_factory):
    return convert_gguf(gguf, tmp_path_factory.mktemp("convert") / "tiny-hf")


@pytest.fixture(scope="module")
def other_folder(tiny_gguf, tmp_path_factory):
    """A folder converted from another GGUF: same tokenizer and shapes, other weights."""
    return convert_gguf(tiny_gguf(1), tmp_path_factory.mktemp("convert-other") / "other-hf")


def _logits(target, dtype: str) -> torch.Tensor:
    model, _ = load_target(target, dtype=dtype, device="cpu")
    ids = load_tokenizer(target).apply_chat_template(CHAT, return_tensors="pt",
                                                     return_dict=True)["input_ids"]
    with torch.inference_mode():
        return model(ids).logits


def _record(target) -> dict:
    return target_record(str(target), config=load_config(target),
                         tokenizer=load_tokenizer(target))


# ------------------------------------------------------------------ the folder

def test_the_folder_computes_the_ggufs_logits_exactly(gguf, folder):
    want = _logits(gguf, "float32")
    assert torch.equal(_logits(folder, "float32"), want)
    assert not torch.equal(want, torch.zeros_like(want))


def test_a_bfloat16_folder_equals_the_gguf_loaded_in_bfloat16(gguf, tmp_path):
    out = convert_gguf(gguf, tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert torch.equal(_logits(out, "bfloat16"), _logits(gguf, "bfloat16"))


def test_the_folder_tokenizes_and_renders_chats_as_the_gguf(gguf, folder):
    a, b = load_tokenizer(gguf), load_tokenizer(folder)
    assert b(TEXT)["input_ids"] == a(TEXT)["input_ids"]
    assert b.chat_template == a.chat_template
    for prompt in (True, False):
        assert (b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
                == a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt))
    assert (b.bos_token, b.eos_token, b.pad_token) == (a.bos_token, a.eos_token, a.pad_token)
    assert tokenizer_fingerprint(b) == tokenizer_fingerprint(a)


def test_the_folder_is_a_plain_checkpoint_that_names_its_gguf(gguf, folder):
    files = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "eyas.json"} <= files
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    # transformers 4's key beside transformers 5's: an older vLLM or SGLang reading only
    # rope_theta ran RoPE at base 10,000 on the folder
    theta = load_config(gguf).rope_parameters["rope_theta"]
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == theta
    assert "rope_scaling" not in config  # a plain RoPE has none
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 4
    manifest = read_manifest(folder, step="convert")
    assert manifest["config"] == {"target": str(gguf.resolve()), "out": str(folder),
                                  "dtype": "float32"}
    assert manifest["dtype"] == "float32"
    assert manifest["target"]["name_or_path"] == str(gguf.resolve())
    assert manifest["target"]["gguf_bytes"] == gguf.stat().st_size
    assert manifest["target"]["gguf_fingerprint"] == gguf_fingerprint(gguf)
    assert manifest["files"]["model.safetensors"] == (folder / "model.safetensors").stat().st_size
    assert not folder.with_name(folder.name + ".tmp-convert").exists()


def test_a_scaled_rope_gets_transformers_4s_rope_scaling(tmp_path):
    from eyas.targets.convert import with_legacy_rope
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
            "original_max_position_embeddings": 32768}
    per_type = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    mrope = {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}
    plain = {"rope_type": "default", "rope_theta": 1e5}
    for params in (yarn, per_type, mrope, plain):
        (tmp_path / "config.json").write_text(json.dumps({"rope_parameters": params}))
        with_legacy_rope(tmp_path / "config.json")
        written = json.loads((tmp_path / "config.json").read_text())
        if params is yarn:
            assert written["rope_theta"] == 1e6 and written["rope_scaling"] == {
                "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
        elif params is mrope:  # transformers 4 reads the sections from rope_scaling only
            assert written["rope_scaling"] == {"rope_type": "default",
                                               "mrope_section": [16, 24, 24]}
        elif params is plain:
            assert written["rope_theta"] == 1e5 and "rope_scaling" not in written
        else:  # no single base: left as transformers 5 wrote it
            assert written == {"rope_parameters": per_type}
    from transformers import Qwen2Config
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2",
                                                      "rope_parameters": yarn}))
    with_legacy_rope(tmp_path / "config.json")  # transformers 5 still reads it as it was
    assert Qwen2Config.from_pretrained(tmp_path).rope_parameters == yarn


# ------------------------------------------------------------------ atomic, never overwrites

def test_converting_again_does_nothing(gguf, folder, tmp_path):
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(gguf, folder) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    # ... unless a file of it went missing or changed size: then it says so
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    (damaged / "model.safetensors").unlink()
    with pytest.raises(EyasError, match=r"holds this conversion, but model.safetensors is "
                                        r"missing or of another size.*delete .* and convert"):
        convert_gguf(gguf, damaged)


def test_another_existing_folder_is_refused_and_kept(gguf, tiny_gguf, folder, tmp_path):
    with pytest.raises(EyasError, match=r"already holds another conversion: .*in float32, not "
                                        r".*in bfloat16; choose another --out, or delete"):
        convert_gguf(gguf, folder, dtype="bfloat16")
    with pytest.raises(EyasError, match=r"gguf_fingerprint .*choose another --out"):
        convert_gguf(tiny_gguf(1), folder)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(EyasError, match=r"not an `eyas convert` folder; choose a new or empty"):
        convert_gguf(gguf, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("")
    with pytest.raises(EyasError, match="is a file"):
        convert_gguf(gguf, tmp_path / "file")
    assert read_manifest(folder, step="convert")["dtype"] == "float32"


def test_a_damaged_or_unreadable_manifest_is_refused_by_name(gguf, folder, tmp_path):
    # A hand-edited eyas.json that still says step convert but lacks a key was a KeyError
    # traceback; an unreadable one read "holds the output of `eyas an unknown step (...)`".
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    body = json.loads((damaged / "eyas.json").read_text())
    del body["target"]["gguf_fingerprint"], body["dtype"]
    (damaged / "eyas.json").write_text(json.dumps(body))
    for run in (lambda: convert_gguf(gguf, damaged),
                lambda: convert(ConvertConfig(target=str(gguf), out=str(damaged)))):
        with pytest.raises(EyasError, match=r"eyas.json is a damaged `eyas convert` manifest "
                                            r"\(target.gguf_fingerprint, dtype are missing.*"
                                            r"move .*damaged away or pass another --out"):
            run()
    (damaged / "eyas.json").write_text("{not json")
    with pytest.raises(EyasError, match=r"eyas.json is unreadable.*pass another --out"):
        convert_gguf(gguf, damaged)
    with pytest.raises(EyasError, match=r"holds an eyas.json that is unreadable or names no "
                                        r"eyas step, not the output of `eyas convert`") as e:
        convert(ConvertConfig(target=str(gguf), out=str(damaged)))
    assert "an unknown step" not in str(e.value)
    assert (damaged / "model.safetensors").is_file()  # refused and kept


def test_an_empty_folder_is_filled(gguf, tmp_path):
    (tmp_path / "empty").mkdir()
    assert (convert_gguf(gguf, tmp_path / "empty") / "model.safetensors").is_file()


def test_an_empty_folder_that_cannot_be_replaced_is_filled(gguf, tmp_path, monkeypatch):
    """From an audit: into an empty mount point (the rename onto it fails with EBUSY), the
    whole conversion ended in a traceback and was thrown away; its files now move in. (The
    mount point's refusal is stood in for: a test cannot mount.) A folder named as the GGUF
    is said to be one."""
    import errno
    import os

    out = tmp_path / "mnt"
    out.mkdir()
    real = os.replace

    def busy(src, dst):
        if Path(dst) == out:
            raise OSError(errno.EBUSY, "Device or resource busy", str(src), None, str(dst))
        return real(src, dst)

    monkeypatch.setattr(convert_module.os, "replace", busy)
    convert_gguf(gguf, out)
    assert read_manifest(out, step="convert")["step"] == "convert"
    assert not (tmp_path / "mnt.tmp-convert").exists()
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(EyasError, match=r"GGUF file .*dir.gguf is a folder; pass the path"):
        convert_gguf(tmp_path / "dir.gguf", tmp_path / "x")


def test_a_failed_run_leaves_no_folder_and_the_next_clears_its_leftover(gguf, tmp_path,
                                                                         monkeypatch):
    out = tmp_path / "hf"
    real = convert_module.write_manifest

    def killed(folder, *args, **kwargs):  # dies after the weights and tokenizer are written
        assert (folder / "model.safetensors").is_file() and folder != out
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf, out)
    assert not out.exists() and not list(tmp_path.iterdir())
    leftover = tmp_path / "hf.tmp-convert"  # what a SIGKILL would leave
    leftover.mkdir()
    (leftover / "model.safetensors").write_text("half")
    monkeypatch.setattr(convert_module, "write_manifest", real)
    convert_gguf(gguf, out)
    assert not leftover.exists() and read_manifest(out, step="convert")["step"] == "convert"


# ------------------------------------------------------------------ one target, in every check

def test_the_folder_is_its_ggufs_target_and_no_other(gguf, tiny_gguf, folder, other_folder,
                                                      tmp_path):
    from_gguf, from_folder = _record(gguf), _record(folder)
    assert from_folder["gguf_fingerprint"] == from_gguf["gguf_fingerprint"]
    assert from_folder["converted_from"] == str(gguf.resolve())
    check_same_target(from_gguf, from_folder, "the prepared folder")  # made with the GGUF
    check_same_target(from_folder, from_gguf, "the prepared folder")  # made with the folder
    other = _record(other_folder)
    # the test's point: shapes and tokenizer alone cannot tell these two targets apart
    assert {k: v for k, v in other.items() if "gguf" not in k and k not in (
        "name_or_path", "path", "converted_from", "weights_fingerprint")} == {
            k: v for k, v in from_gguf.items() if "gguf" not in k and k not in (
                "name_or_path", "path")}
    for made, used in ((from_gguf, other), (other, from_gguf), (from_folder, other),
                       (_record(tiny_gguf(1)), from_folder)):
        with pytest.raises(EyasError, match="gguf_fingerprint=.*re-run that step"):
            check_same_target(made, used, "the prepared folder")
    # a bf16 conversion is the GGUF's target, but not the fp32 conversion's: a capture
    # resumed on it mixed hidden states of two precisions without a word
    half = _record(convert_gguf(gguf, tmp_path / "tiny-bf16", dtype="bfloat16"))
    check_same_target(from_gguf, half, "the prepared folder")
    with pytest.raises(EyasError, match="same tokenizer and shape but other weights"):
        check_same_target(from_folder, half, "the capture")


def _chats(path):
    path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(4, seed=0)))
    return path


def test_steps_accept_the_folder_for_the_gguf_both_ways(gguf, folder, other_folder, tmp_path):
    chats = _chats(tmp_path / "chats.jsonl")
    by_gguf, by_folder = tmp_path / "prepared-gguf", tmp_path / "prepared-folder"
    prepare(PrepareConfig(target=str(gguf), data=(str(chats),), out=str(by_gguf),
                          eval_fraction=0.5))
    prepare(PrepareConfig(target=str(folder), data=(str(chats),), out=str(by_folder),
                          eval_fraction=0.5))
    capture(CaptureConfig(target=str(folder), data=str(by_gguf), out=str(tmp_path / "c1"),
                          model_dtype="fp32"))
    capture(CaptureConfig(target=str(gguf), data=str(by_folder), out=str(tmp_path / "c2"),
                          model_dtype="fp32"))
    assert (read_manifest(tmp_path / "c1", step="capture")["target"]["gguf_fingerprint"]
            == gguf_fingerprint(gguf))
    report = evaluate(EvalConfig(target=str(folder), data=str(by_gguf), out=str(tmp_path / "r"),
                                 k=(2,), num_prompts=2, max_new_tokens=4, dtype="float32",
                                 device="cpu"))
    assert report.lossless is True
    with pytest.raises(EyasError, match="gguf_fingerprint=.*re-run that step"):
        capture(CaptureConfig(target=str(other_folder), data=str(by_gguf),
                              out=str(tmp_path / "c3"), model_dtype="fp32"))
    with pytest.raises(EyasError, match="gguf_fingerprint=.*re-run that step"):
        evaluate(EvalConfig(target=str(other_folder), data=str(by_folder),
                            out=str(tmp_path / "r2"), k=(2,), num_prompts=2, max_new_tokens=4,
                            dtype="float32", device="cpu"))


# ------------------------------------------------------------------ the command

def test_cli_converts_and_refuses_what_needs_no_conversion(gguf, llama_dir, tmp_path, capsys):
    assert main(["convert", "--target", str(gguf), "--out", str(tmp_path / "hf"),
                 "--dtype", "float16"]) == 0
    assert read_manifest(tmp_path / "hf", step="convert")["dtype"] == "float16"
    assert main(["convert", "--target", str(llama_dir), "--out", str(tmp_path / "x")]) == 2
    assert "is not a .gguf file: only a GGUF target needs converting" in capsys.readouterr().err
    assert main(["convert", "--target", str(tmp_path / "missing.gguf"),
                 "--out", str(tmp_path / "y")]) == 2
    assert "missing.gguf does not exist" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="use one of"):
        ConvertConfig(target=str(gguf), out="o", dtype="int8")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_step_is_the_library_function(gguf, folder):
    assert convert(ConvertConfig(target=str(gguf), out=str(folder))) == folder
