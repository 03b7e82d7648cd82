"""eyas capture: captured tensors against the target's own forward, packing, shard files,
--shard jobs, resume after a real SIGKILL, NaN reporting and refusing a foreign prepared folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from eyas.store import shard_state, shard_writer, shards
from eyas.capture import CaptureConfig, capture
from eyas.targets import sdpa
from eyas.targets.capture_forward import capture_samples, iter_captured_batches
from eyas.targets.capture_forward import batch_inputs, plan_batches
from eyas.config import ConfigError
from eyas.errors import EyasError
from eyas.store.manifest import read_manifest, target_record, write_manifest
from eyas.targets.models import load_target, load_tokenizer, submodule

SRC = str(Path(__file__).resolve().parents[1] / "src")


def make_prepared(folder: Path, model_dir, *, n_train=14, n_eval=4, seed=0, max_len=40,
                  bad_token: int | None = None, tokenizer_hash: str | None = None) -> Path:
    """A prepared/ folder in the documented format, with random token rows of mixed lengths.
    With `bad_token`, rows 3 and 7 of train contain it."""
    g = torch.Generator().manual_seed(seed)

    def rows(n, prefix):
        cols = {"input_ids": [], "loss_mask": [], "sample_id": [], "num_tokens": [],
                "messages_json": []}
        for i in range(n):
            length = int(torch.randint(2, max_len, (1,), generator=g))
            ids = torch.randint(10, 2000, (length,), generator=g)
            if bad_token is not None:
                ids[ids == bad_token] = 11
                if prefix == "train" and i in (3, 7):
                    ids[length // 2] = bad_token
            cols["input_ids"].append(ids.tolist())
            cols["loss_mask"].append(torch.randint(0, 2, (length,), generator=g).tolist())
            cols["sample_id"].append(f"{prefix}:{i}")
            cols["num_tokens"].append(length)
            cols["messages_json"].append("[]")
        return datasets.Dataset.from_dict(cols)

    datasets.DatasetDict({"train": rows(n_train, "train"), "eval": rows(n_eval, "eval")}
                         ).save_to_disk(str(folder / "dataset"))
    target = target_record(str(model_dir), tokenizer=load_tokenizer(str(model_dir)))
    if tokenizer_hash is not None:
        target["tokenizer_hash"] = tokenizer_hash
    write_manifest(folder, "prepare", {"seed": seed}, target=target, max_length=max_len)
    return folder


def load_fp32(model_dir, trust_remote_code=False):
    return load_target(str(model_dir), dtype="float32", trust_remote_code=trust_remote_code)


@pytest.fixture(scope="module")
def llama_prepared(llama_dir, tmp_path_factory):
    return make_prepared(tmp_path_factory.mktemp("prepared"), llama_dir)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    from eyas.targets.kimi_like import build_kimi_like

    return build_kimi_like(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    """Tiny DeepSeek-V3 with num_key_value_heads == num_attention_heads, as MLA requires
    (HF's MLA attention gives keys all heads; fewer kv heads breaks any padding-masked forward)."""
    from eyas.targets.tiny import save_tiny_tokenizer, tiny_config

    config = tiny_config("deepseek_v3")
    config.num_key_value_heads = config.num_attention_heads
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-deepseek")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    save_tiny_tokenizer(out)
    return out


def _cfg(model_dir, prepared, out, **kw):
    base = dict(target=str(model_dir), data=str(prepared), out=str(out), model_dtype="fp32",
                batch_tokens=96, file_mb=0.02)
    return CaptureConfig(**{**base, **kw})


def _by_row(folder) -> dict[int, dict]:
    cs = shards.open_capture(folder)
    return {int(cs.sample_index[i]): cs.sample(i, dtype=torch.float32)
            for i in range(cs.num_samples)}


def _reference(model, info, ids: list[int]):
    """Unpadded single-sample forward of the text decoder with output_hidden_states."""
    out = submodule(model, info.text_model_path)(input_ids=torch.tensor([ids]),
                                                output_hidden_states=True, use_cache=False)
    logits = submodule(model, info.lm_head_path)(out.last_hidden_state[0])
    return [h[0] for h in out.hidden_states], logits.argmax(-1)


# ------------------------------------------------------------------ exactness of the taps

@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "qwen2_5_vl", "kimi_like"])
def test_taps_equal_output_hidden_states_of_the_same_forward(arch, tiny_model_dir, kimi_dir,
                                                             deepseek_dir, tmp_path):
    """Bit-identical to output_hidden_states[k] of the same (padded) forward, id L before the
    final norm, final hidden after it, top-1 from the full lm_head."""
    model_dir = {"kimi_like": kimi_dir, "deepseek_v3": deepseek_dir}.get(arch) or tiny_model_dir(arch)
    model, info = load_fp32(model_dir, trust_remote_code=arch == "kimi_like")
    ds = datasets.load_from_disk(str(make_prepared(tmp_path, model_dir) / "dataset"))["train"]
    L = info.num_layers
    for ids in [(0, L // 2, L), tuple(info.default_aux_layer_ids)]:
        for batch in iter_captured_batches(model, info, ds, ids, batch_tokens=200,
                                           packing="padded"):
            rows = batch["sample_index"].tolist()
            samples = [(ds[r]["input_ids"], ds[r]["loss_mask"]) for r in rows]
            inputs, host = batch_inputs(samples, flat=False)
            out = submodule(model, info.text_model_path)(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                output_hidden_states=True, use_cache=False)
            hs = [h.reshape(-1, h.shape[-1])[inputs["gather"]] for h in out.hidden_states]
            for j, k in enumerate(ids):
                if k < L:
                    assert torch.equal(batch["aux_hidden"][:, j], hs[k]), (arch, k)
                else:  # id L: the last layer's output, i.e. the final norm's input
                    norm = submodule(model, info.norm_path)
                    assert not torch.equal(batch["aux_hidden"][:, j], hs[L])
                    assert torch.equal(norm(batch["aux_hidden"][:, j]), hs[L]), arch
            assert torch.equal(batch["final_hidden"], hs[L])
            logits = submodule(model, info.lm_head_path)(hs[L])
            assert torch.equal(batch["target_top1"], logits.argmax(-1).int())
            assert torch.equal(batch["input_ids"], host["input_ids"])
            assert batch["loss_mask"].dtype == torch.uint8
            assert batch["target_top1"].dtype == torch.int32


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("packing", ["padded", "flat"])
def test_batched_capture_equals_unpadded_per_sample_forward(arch, packing, tiny_model_dir,
                                                            tmp_path):
    model, info = load_fp32(tiny_model_dir(arch))
    ds = datasets.load_from_disk(str(make_prepared(tmp_path, tiny_model_dir(arch))
                                     / "dataset"))["train"]
    ids = (1, 4, 8)
    seen = []
    for batch in iter_captured_batches(model, info, ds, ids, batch_tokens=120, packing=packing):
        off = batch["sample_offsets"].tolist()
        for j, row in enumerate(batch["sample_index"].tolist()):
            s, e = off[j], off[j + 1]
            hs, top1 = _reference(model, info, ds[row]["input_ids"])
            for a, k in enumerate(ids[:2]):
                torch.testing.assert_close(batch["aux_hidden"][s:e, a], hs[k], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(batch["final_hidden"][s:e], hs[-1], rtol=1e-5, atol=1e-5)
            assert torch.equal(batch["target_top1"][s:e], top1.int())
            assert batch["loss_mask"][s:e].tolist() == ds[row]["loss_mask"]
            seen.append(row)
    assert sorted(seen) == list(range(len(ds)))


def test_flat_packing_refused_where_attention_ignores_position_resets(tiny_model_dir, tmp_path):
    """Qwen2.5-VL's text model only isolates packed samples given 4-row mrope positions: the
    self-check must catch the leak instead of capturing cross-sample attention."""
    model, info = load_fp32(tiny_model_dir("qwen2_5_vl"))
    ds = datasets.load_from_disk(str(make_prepared(tmp_path, tiny_model_dir("qwen2_5_vl"))
                                     / "dataset"))["train"]
    with pytest.raises(EyasError, match="--packing padded"):
        next(iter_captured_batches(model, info, ds, (1, 4, 8), 100, packing="flat"))


def test_capture_samples_returns_rows_in_order(llama_dir, llama_prepared):
    model, info = load_fp32(llama_dir)
    ds = datasets.load_from_disk(str(llama_prepared / "dataset"))["train"].select([5, 1, 9])
    got = capture_samples(model, info, ds, (1, 4, 6), dtype=torch.bfloat16)
    assert [g["input_ids"].tolist() for g in got] == [list(r) for r in ds["input_ids"]]
    assert got[0]["aux_hidden"].dtype == torch.bfloat16
    assert got[0]["aux_hidden"].shape == (ds[0]["num_tokens"], 3, info.hidden_size)


def test_capture_forward_leaves_cudnn_attention_out(llama_dir, llama_prepared, monkeypatch,
                                                    cudnn_seen):
    # capture and online training run the target on padded batches of ever new shapes, which
    # cuDNN's attention plans one by one on the host (eyas.targets.sdpa): it is left out, and
    # EYAS_TARGET_SDPA=torch gives torch its choice back, with the same states
    model, info = load_fp32(llama_dir)
    ds = datasets.load_from_disk(str(llama_prepared / "dataset"))["train"].select([5, 1, 9])
    seen = cudnn_seen(model.model.layers[0].self_attn)
    ours = capture_samples(model, info, ds, (1, 4, 6))
    assert seen and not any(seen)
    monkeypatch.setenv("EYAS_TARGET_SDPA", "torch")
    theirs = capture_samples(model, info, ds, (1, 4, 6))
    assert seen[-1] is True or sdpa._open > 0  # (unless another thread holds it off)
    for a, b in zip(ours, theirs):
        assert torch.equal(a["aux_hidden"], b["aux_hidden"])


# ------------------------------------------------------------------ shards on disk

def _captured_beside_reference(model_dir, prepared, out):
    """Each captured sample of `out` with the fp32 target's hidden states of the same row and
    (its row, the target's top-1 ids)."""
    model, info = load_fp32(model_dir)
    ds = datasets.load_from_disk(str(prepared / "dataset"))["train"]
    for row, got in _by_row(out).items():
        hs, top1 = _reference(model, info, ds[row]["input_ids"])
        yield got, hs, (row, top1)


def test_capture_writes_verified_shards_matching_the_forward(llama_dir, llama_prepared, tmp_path):
    out = tmp_path / "cap"
    stats = capture(_cfg(llama_dir, llama_prepared, out))
    index = shards.verify(out)
    manifest = read_manifest(out, step="capture")
    assert manifest["complete"] is True and manifest["aux_layer_ids"] == [2, 4, 5]
    assert manifest["layer_id_convention"].startswith("vllm")
    assert index["num_samples"] == 14 == stats["samples"] and len(index["files"]) > 1
    assert stats["bytes_per_token"] > (3 * 64 + 64) * 2
    ds = datasets.load_from_disk(str(llama_prepared / "dataset"))["train"]
    for got, hs, (row, top1) in _captured_beside_reference(llama_dir, llama_prepared, out):
        want = torch.stack([hs[2], hs[4], hs[5]], dim=1).bfloat16().float()
        torch.testing.assert_close(got["aux_hidden"], want, rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(got["final_hidden"], hs[-1].bfloat16().float(), rtol=1e-2,
                                   atol=1e-3)
        assert torch.equal(got["target_top1"], top1.int())
        assert got["input_ids"].tolist() == ds[row]["input_ids"]
        assert got["loss_mask"].tolist() == ds[row]["loss_mask"]
    # index integrity: a flipped byte, then a missing file, are both caught
    victim = out / index["files"][0]["file"]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(EyasError, match="sha256"):
        shards.verify(out)
    victim.unlink()
    with pytest.raises(EyasError, match="missing"):
        shards.verify(out)


def test_device_map_capture_equals_single_device(llama_dir, llama_prepared, tmp_path):
    """--device-map: transformers + accelerate place the layers (on this CPU box all on the
    cpu) and capture moves nothing after them; the files hold the same states bit for bit.
    Split over 2 GPUs: benchmarks/multigpu.py (bitwise equal on 2 H200s)."""
    capture(_cfg(llama_dir, llama_prepared, tmp_path / "one", device="cpu"))
    capture(_cfg(llama_dir, llama_prepared, tmp_path / "mapped", device_map="auto"))
    one, mapped = _by_row(tmp_path / "one"), _by_row(tmp_path / "mapped")
    assert sorted(one) == sorted(mapped) == list(range(14))
    for row in one:
        for key, value in one[row].items():
            assert torch.equal(mapped[row][key], value), (row, key)


@pytest.mark.usefixtures("without_accelerate")
def test_device_map_without_accelerate_names_the_install(llama_dir, llama_prepared, tmp_path):
    with pytest.raises(EyasError, match=r"device_map 'auto' \(capture --device-map.*needs "
                                        r"the accelerate package.*pip install accelerate"):
        capture(_cfg(llama_dir, llama_prepared, tmp_path / "cap", device_map="auto"))
    assert not (tmp_path / "cap").exists()  # refused before anything was written


def test_fp8_storage_and_split_all(llama_dir, llama_prepared, tmp_path):
    capture(_cfg(llama_dir, llama_prepared, tmp_path / "bf16", split="all"))
    capture(_cfg(llama_dir, llama_prepared, tmp_path / "fp8", split="all", dtype="fp8"))
    shards.verify(tmp_path / "fp8")
    ref, q = _by_row(tmp_path / "bf16"), _by_row(tmp_path / "fp8")
    assert sorted(q) == list(range(18))
    for row, got in q.items():
        want = ref[row]["aux_hidden"]
        err = (got["aux_hidden"] - want).abs().amax(-1) / want.abs().amax(-1)
        assert float(err.max()) < 0.07  # e4m3: 3 mantissa bits, scaled per token per layer
        assert torch.equal(got["final_hidden"], ref[row]["final_hidden"])
    cs = shards.open_capture(tmp_path / "fp8")
    assert sorted(cs.sample_index[cs.positions("eval")].tolist()) == [14, 15, 16, 17]
    sizes = [json.loads((tmp_path / d / "index.json").read_text())["num_bytes"]
             for d in ("bf16", "fp8")]
    assert sizes[1] < sizes[0]


def test_fp8_aux_states_reach_the_step_as_the_host_would_dequantize_them(
        llama_dir, llama_prepared, tmp_path):
    # training's loader keeps an fp8 capture's aux states in fp8 (dequantizing them on the
    # host bound eyas train at ~138 K tokens/s on the H200, session 25); on_device gives
    # the very values the loader before gave (each sample dequantized to bf16 on the host,
    # then collated into hidden_dtype), padding included, in bf16 and in fp32 runs
    from eyas.draft import data, data_loader

    capture(_cfg(llama_dir, llama_prepared, tmp_path / "fp8", split="all", dtype="fp8"))
    source = data.OfflineSource(tmp_path / "fp8")
    plan = [[0, 1], [2]]  # two rows: two samples packed, then one sample and padding
    width = int(max(source.lengths[0] + source.lengths[1], source.lengths[2])) + 5
    for dtype in (torch.bfloat16, torch.float32):
        mb = data_loader.MicroBatches(source, [plan], width, dtype)[0]
        assert mb["aux_hidden"].dtype == torch.float8_e4m3fn
        assert mb["aux_scale"].shape == mb["aux_hidden"].shape[:2] + (3,)
        got = data_loader.on_device(mb, torch.device("cpu"))
        host = [[source.capture.sample(i) for i in row] for row in plan]  # as before
        want = data_loader.collate(host, width, dtype)
        assert set(got) == set(want) and "aux_scale" not in got
        for key in want:
            assert got[key].dtype == want[key].dtype, key
            assert torch.equal(got[key], want[key]), key
        assert data_loader.host_fields(mb).keys() == want.keys()


def test_shard_jobs_fill_one_folder(llama_dir, llama_prepared, tmp_path, caplog, monkeypatch):
    out = tmp_path / "cap"
    capture(_cfg(llama_dir, llama_prepared, out, shard="1/2"))
    assert read_manifest(out, step="capture")["complete"] is False
    with pytest.raises(EyasError, match="not finished"):
        shards.verify(out)
    with pytest.raises(EyasError, match="incomplete"):
        shards.open_capture(out)
    # the other half from a fine-tune of the target (same shape and tokenizer): refused
    tuned = tmp_path / "tuned"
    shutil.copytree(llama_dir, tuned)
    weights = load_file(str(tuned / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"] *= 1.01
    save_file(weights, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    from eyas.targets import models

    with monkeypatch.context() as patch:  # refused from the config, before the weights load
        patch.setattr(models, "load_target", lambda *a, **k: pytest.fail("target loaded"))
        with pytest.raises(EyasError, match=r"other settings \(target weights_fingerprint "
                                            r"'\w+' there, '\w+' now\)"):
            capture(_cfg(tuned, llama_prepared, out, shard="0/2"))
    capture(_cfg(llama_dir, llama_prepared, out, shard="0/2"))
    index = shards.verify(out)
    assert index["complete"] and index["num_samples"] == 14
    # a finished shard run again rebuilds the index and keeps the capture's id (an audit: the
    # id followed the last job's --shard, and a resumed training lost its best checkpoint)
    made = read_manifest(out, step="capture")["id"]
    capture(_cfg(llama_dir, llama_prepared, out, shard="1/2"))
    assert read_manifest(out, step="capture")["id"] == made
    capture(_cfg(llama_dir, llama_prepared, tmp_path / "one"))
    whole, split = _by_row(tmp_path / "one"), _by_row(out)
    assert sorted(split) == sorted(whole)
    for row in whole:
        torch.testing.assert_close(split[row]["aux_hidden"], whole[row]["aux_hidden"],
                                   rtol=1e-2, atol=1e-3)
    with pytest.raises(EyasError, match=r"other settings \(aux_layer_ids: \[.*\] there, "
                                        r"\[1, 2, 3\] now; shard count 2 there, 1 now\)"):
        capture(_cfg(llama_dir, llama_prepared, out, aux_layer_ids=(1, 2, 3)))
    with caplog.at_level("WARNING", logger="eyas"):
        capture(_cfg(llama_dir, llama_prepared, out, aux_layer_ids=(1, 2, 3), overwrite=True))
    assert "--overwrite: deleting the capture in" in caplog.text
    assert shards.verify(out)["settings"]["aux_layer_ids"] == [1, 2, 3]


def test_parts_left_by_a_capture_of_other_layers_are_captured_again(llama_dir, llama_prepared,
                                                                    tmp_path, caplog):
    """From an audit: with a capture's state file moved away (as the refusal of a damaged one
    said), a capture with other --aux-layer-ids adopted its part files unread and finished
    with nothing captured: the manifest said layers 1,6,7, the states were of 2,4,5."""
    out = tmp_path / "cap"
    capture(_cfg(llama_dir, llama_prepared, out))
    (tmp_path / "aside").mkdir()
    for name in ("shard-00000-of-00001.json", "index.json", "eyas.json"):
        (out / name).rename(tmp_path / "aside" / name)
    with caplog.at_level(logging.WARNING, logger="eyas"):
        capture(_cfg(llama_dir, llama_prepared, out, aux_layer_ids=(1, 5, 6)))
    assert "it was captured with aux_layer_ids 2,4,5 (this run: 1,5,6)" in caplog.text
    for got, hs, _ in _captured_beside_reference(llama_dir, llama_prepared, out):
        want = torch.stack([hs[1], hs[5], hs[6]], dim=1).bfloat16().float()
        torch.testing.assert_close(got["aux_hidden"], want, rtol=1e-2, atol=1e-3)
    # parts of this run's own settings that its state file does not list yet (renamed just
    # before a kill) are kept, not captured again
    state_file = out / "shard-00000-of-00001.json"
    state = json.loads(state_file.read_text())
    state["parts"], state["complete"] = [], False
    state_file.write_text(json.dumps(state))
    for name in ("index.json", "eyas.json"):
        (out / name).unlink()
    parts = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eyas"):
        capture(_cfg(llama_dir, llama_prepared, out, aux_layer_ids=(1, 5, 6)))
    assert "deleting it" not in caplog.text
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == parts
    assert shards.verify(out)["num_samples"] == 14


def test_resume_after_sigkill_loses_and_duplicates_nothing(llama_dir, llama_prepared, tmp_path):
    out = tmp_path / "cap"
    argv = [sys.executable, "-m", "eyas", "capture", "--target", str(llama_dir),
            "--data", str(llama_prepared), "--out", str(out), "--model-dtype", "fp32",
            "--batch-tokens", "96", "--file-mb", "0.02"]
    env = {**os.environ, "EYAS_TEST_KILL_AFTER_FILES": "2",
           "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    killed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    parts = sorted(p.name for p in out.glob("*.part-*.safetensors"))
    assert len(parts) == 2 and not (out / "eyas.json").exists()
    state = json.loads((out / "shard-00000-of-00001.json").read_text())
    assert len(state["parts"]) == 1  # killed after renaming part 2, before recording it
    capture(_cfg(llama_dir, llama_prepared, out))  # resume
    index = shards.verify(out)  # every row exactly once
    assert [e["file"] for e in index["files"]][:2] == parts
    capture(_cfg(llama_dir, llama_prepared, tmp_path / "clean"))
    resumed, clean = _by_row(out), _by_row(tmp_path / "clean")
    assert sorted(resumed) == sorted(clean) == list(range(14))
    for row in clean:
        for key in ("aux_hidden", "final_hidden"):
            torch.testing.assert_close(resumed[row][key], clean[row][key], rtol=1e-2, atol=1e-3)
        for key in ("target_top1", "input_ids", "loss_mask"):
            assert torch.equal(resumed[row][key], clean[row][key])


def test_nonfinite_samples_are_set_aside_and_reported(llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(str(llama_dir))
    bad_token = 1234
    with torch.no_grad():
        model.get_input_embeddings().weight[bad_token] = float("inf")
    broken = tmp_path / "broken"
    model.save_pretrained(broken)
    load_tokenizer(str(llama_dir)).save_pretrained(broken)
    prepared = make_prepared(tmp_path / "prep", broken, bad_token=bad_token)
    stats = capture(_cfg(broken, prepared, tmp_path / "cap", packing="padded"))
    assert stats["nonfinite"] == 2 and stats["samples"] == 12
    report = shards.read_report(tmp_path / "cap")
    assert sorted(r["sample_id"] for r in report) == ["train:3", "train:7"]
    assert sorted(r["sample_index"] for r in report) == [3, 7]
    shards.verify(tmp_path / "cap")  # the set-aside rows count as accounted for
    got = _by_row(tmp_path / "cap")
    assert 3 not in got and 7 not in got
    assert all(bool(g["aux_hidden"].isfinite().all()) for g in got.values())
    # online use: the sample comes back zeroed with no loss, the others untouched
    model, info = load_fp32(broken)
    ds = datasets.load_from_disk(str(prepared / "dataset"))["train"].select([2, 3])
    online = capture_samples(model, info, ds, (2, 4, 5))
    assert int(online[1]["loss_mask"].sum()) == 0 and not online[1]["aux_hidden"].any()
    torch.testing.assert_close(online[0]["aux_hidden"].bfloat16().float(), got[2]["aux_hidden"])


def test_an_empty_split_is_refused_before_the_target_loads(llama_dir, tmp_path, monkeypatch):
    """A prepared folder without eval rows (--eval-fraction 0) captured with --split eval was a
    complete capture of 0 samples, refused only by `eyas train`."""
    from eyas.targets import models
    from eyas.targets.corpus import synthetic_chats
    from eyas.prepare import PrepareConfig, prepare

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(4, seed=3)))
    prepare(PrepareConfig(target=str(llama_dir), data=(str(chats),), out=str(tmp_path / "prep"),
                          eval_fraction=0.0))

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(models, "load_target", no_load)
    with pytest.raises(EyasError, match=r"--split eval of .*prep has 0 rows, so its capture "
                                        r"would hold no samples; prepare again with "
                                        r"--eval-fraction above 0.*--split train or all") as e:
        capture(_cfg(llama_dir, tmp_path / "prep", tmp_path / "cap", split="eval"))
    assert e.value.flag == "--split"
    assert not (tmp_path / "cap").exists()


def test_capture_of_a_real_prepare_output(llama_dir, tmp_path):
    """The folder `eyas prepare` writes (its column types, its manifest) captures as is."""
    from eyas.targets.corpus import synthetic_chats
    from eyas.prepare import PrepareConfig, prepare

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(12, seed=3)))
    prepare(PrepareConfig(target=str(llama_dir), data=(str(chats),), out=str(tmp_path / "prep"),
                          eval_fraction=0.2))
    stats = capture(_cfg(llama_dir, tmp_path / "prep", tmp_path / "cap", split="all"))
    index = shards.verify(tmp_path / "cap")
    ds = datasets.load_from_disk(str(tmp_path / "prep" / "dataset"))
    assert stats["samples"] == index["num_samples"] == len(ds["train"]) + len(ds["eval"])
    cs = shards.open_capture(tmp_path / "cap")
    s = cs.sample(0)
    row = int(s["sample_index"])
    assert row < len(ds["train"]) and s["input_ids"].tolist() == list(ds["train"][row]["input_ids"])
    assert s["loss_mask"].tolist() == list(ds["train"][row]["loss_mask"])
    # each tensor owns just its sample's bytes (safetensors >= 0.8 slices view the whole part:
    # torch.save of one would write the part); copy=False is the view, for training's collate
    for key, t in s.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
        saved = tmp_path / f"{key}.pt"
        torch.save(t, saved)
        assert saved.stat().st_size < t.numel() * t.element_size() + 2048, key
    view = cs.sample(0, copy=False)
    assert all(torch.equal(view[k], s[k]) for k in s)


def test_malformed_prepared_rows_are_set_aside_and_the_rest_captured(llama_dir, llama_prepared,
                                                                     tmp_path):
    """A row with no tokens, or with lengths that disagree, stopped the capture at its batch
    (after every longer row) with an error, and again at every rerun: it never completed."""
    prepared = tmp_path / "prep"
    shutil.copytree(llama_prepared, prepared)
    dd = datasets.load_from_disk(str(llama_prepared / "dataset"))
    train = dd["train"].to_dict()
    train["input_ids"][5], train["loss_mask"][5], train["num_tokens"][5] = [], [], 0
    train["loss_mask"][9] = train["loss_mask"][9][:-1]
    shutil.rmtree(prepared / "dataset")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(train, features=dd["train"].features),
                          "eval": dd["eval"]}).save_to_disk(str(prepared / "dataset"))
    stats = capture(_cfg(llama_dir, prepared, tmp_path / "cap"))
    assert stats["samples"] == 12 and stats["nonfinite"] == 2
    report = {r["sample_index"]: r for r in shards.read_report(tmp_path / "cap")}
    assert sorted(report) == [5, 9] and report[9]["sample_id"] == "train:9"
    assert "num_tokens 0, 0 input_ids, 0 loss_mask values" in report[5]["reason"]
    assert "malformed prepared row" in report[9]["reason"]
    assert shards.verify(tmp_path / "cap")["num_samples"] == 12  # every row accounted for
    assert capture(_cfg(llama_dir, prepared, tmp_path / "cap"))["nonfinite"] == 2  # not twice


def test_aux_ids_beyond_the_target_are_refused_before_it_loads(llama_dir, llama_prepared,
                                                               tmp_path, monkeypatch):
    """They were refused once the target's weights had loaded (minutes, for a large one)."""
    from eyas.targets import models

    monkeypatch.setattr(models, "load_target", lambda *a, **k: pytest.fail("target loaded"))
    with pytest.raises(ConfigError, match=r"out of range.*this target has L = 8"):
        capture(_cfg(llama_dir, llama_prepared, tmp_path / "cap", aux_layer_ids=(2, 4, 99)))
    assert not (tmp_path / "cap").exists()


def test_a_prepared_folder_of_another_shape_is_refused_before_the_target_loads(
        llama_dir, llama_prepared, tmp_path, monkeypatch):
    """From an audit: the same tokenizer behind a model of another shape (an 8B's prepared
    folder used with the 70B) was refused only once the weights had loaded."""
    import shutil

    from eyas.targets import models

    prepared = tmp_path / "prep"  # as prepare records its target: with the config's shape
    shutil.copytree(llama_prepared, prepared)
    manifest = json.loads((prepared / "eyas.json").read_text())
    manifest["target"] = target_record(str(llama_dir), config=models.load_config(str(llama_dir)),
                                       tokenizer=load_tokenizer(str(llama_dir)))
    (prepared / "eyas.json").write_text(json.dumps(manifest))
    other = tmp_path / "deeper"
    shutil.copytree(llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] += 2
    (other / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(models, "load_target", lambda *a, **k: pytest.fail("target loaded"))
    with pytest.raises(EyasError, match=r"made for target .* \(num_hidden_layers=8\) but this "
                                        r"run uses .*deeper \(num_hidden_layers=10\)"):
        capture(_cfg(other, prepared, tmp_path / "cap"))
    assert not (tmp_path / "cap").exists()


def test_refuses_prepared_folder_from_another_tokenizer(llama_dir, tmp_path):
    prepared = make_prepared(tmp_path / "prep", llama_dir, tokenizer_hash="0123456789abcdef")
    with pytest.raises(EyasError, match=r"tokenizer_hash.*--target"):
        capture(_cfg(llama_dir, prepared, tmp_path / "cap"))
    assert not (tmp_path / "cap").exists()


# ------------------------------------------------------------------ small units

def test_plan_batches_respects_the_token_budget():
    lengths = [5, 30, 12, 12, 40, 3, 7, 100]
    rows = list(range(len(lengths)))
    for flat in (False, True):
        batches = plan_batches(lengths, rows, 48, flat)
        assert sorted(r for b in batches for r in b) == rows
        for b in batches:
            cost = sum(lengths[r] for r in b) if flat else max(lengths[r] for r in b) * len(b)
            assert cost <= 48 or len(b) == 1
        assert batches[0] == [7]  # longest first; over budget, alone


def test_fp8_roundtrip_and_batch_helpers():
    torch.manual_seed(0)
    x = torch.randn(10, 3, 32) * torch.logspace(-3, 3, 10)[:, None, None]
    x[4, 1] = 0
    q, scale = shards.quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (10, 3)
    back = shards.dequantize_fp8(q, scale, torch.float32)
    assert float(((back - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)).max()) < 0.07
    assert torch.equal(back[4, 1], torch.zeros(32))
    batch = {"input_ids": torch.arange(9), "sample_offsets": torch.tensor([0, 2, 5, 9]),
             "sample_index": torch.tensor([7, 3, 5])}
    bad = torch.zeros(9, dtype=torch.bool)
    bad[3] = True
    kept, dropped = shards.drop_samples(batch, bad)
    assert dropped == [1] and kept["input_ids"].tolist() == [0, 1, 5, 6, 7, 8]
    assert kept["sample_offsets"].tolist() == [0, 2, 6] and kept["sample_index"].tolist() == [7, 5]
    merged = shards.merge_batches([kept, batch])
    assert merged["sample_offsets"].tolist() == [0, 2, 6, 8, 11, 15]
    assert merged["sample_index"].tolist() == [7, 5, 7, 3, 5]


def test_config_validation():
    with pytest.raises(ConfigError, match="I/N"):
        CaptureConfig(target="t", data="d", out="o", shard="2")
    with pytest.raises(ConfigError, match="0 <= I < N"):
        CaptureConfig(target="t", data="d", out="o", shard="2/2")
    # any number of taps (DFlash reads N; the EAGLE-3 trainer refuses a count other than 3)
    assert CaptureConfig(target="t", data="d", out="o", aux_layer_ids=(1, 2)).aux_layer_ids == (1, 2)
    with pytest.raises(ConfigError, match="strictly ascending"):
        CaptureConfig(target="t", data="d", out="o", aux_layer_ids=(2, 1))
    assert CaptureConfig(target="t", data="d", out="o", shard="3/4").shard_index() == (3, 4)


def test_writer_thread_errors_reach_the_caller(tmp_path):
    state = {"shard": 0, "num_shards": 1, "parts": [], "nonfinite": 0}
    writer = shard_writer.PartWriter(tmp_path, state, 1, {})
    writer.put(None, {"nonfinite": torch.zeros(2, dtype=torch.bool)}, ["a"])  # no sample_index
    with pytest.raises(EyasError, match="writing capture parts"):
        writer.close()
    assert not writer.thread.is_alive()
    # a failure in a part-writing thread (here: the folder is gone) reaches the caller too
    writer = shard_writer.PartWriter(tmp_path / "gone", dict(state, parts=[]), 1, {}, threads=2)
    batch = _host_batch(4, [0, 1])
    with pytest.raises(EyasError, match="writing capture parts.*FileNotFound"):
        try:  # as the capture loop does: put raises once the writer failed, close re-raises
            for _ in range(50):
                writer.put(None, {**batch, "nonfinite": torch.zeros(4, dtype=torch.bool)},
                           ["a", "b"])
        finally:
            writer.close()
    assert not writer.thread.is_alive()


def _host_batch(n: int, rows: list[int], hidden: int = 16, fp8: bool = False, seed: int = 0):
    """A flattened host batch as the capture loop hands it to PartWriter (samples split 1:n-1)."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(n, 3, hidden, generator=g)
    batch = {"final_hidden": torch.randn(n, hidden, generator=g).bfloat16(),
             "target_top1": torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
             "input_ids": torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
             "loss_mask": torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8),
             "sample_offsets": torch.tensor([0, 1, n]), "sample_index": torch.tensor(rows)}
    if fp8:
        batch["aux_hidden"], batch["aux_scale"] = shards.quantize_fp8(aux)
    else:
        batch["aux_hidden"] = aux.bfloat16()
    return batch


@pytest.mark.parametrize("fp8", [False, True])
def test_part_files_are_exactly_what_safetensors_writes(fp8, tmp_path):
    """The part writer builds the safetensors header itself (to write and hash the tensors'
    own memory, batch by batch, with no copies): the layout, header and data must equal
    safetensors' own output for the concatenated batches, and read back through it."""
    from safetensors.torch import load, save

    batches = [_host_batch(5, [4, 9], fp8=fp8, seed=1), _host_batch(7, [2, 3], fp8=fp8, seed=2)]
    meta = {"format": shards.FORMAT, "dtype": "fp8" if fp8 else "bf16"}
    timings: dict = {}
    entry = shard_writer.write_part(tmp_path, shards.part_name(0, 1, 0), batches, meta, timings)
    raw = (tmp_path / entry["file"]).read_bytes()
    merged = shards.merge_batches(batches)
    ref = save(merged, metadata=meta)
    n = int.from_bytes(raw[:8], "little")
    assert len(raw) == len(ref) and raw[:8] == ref[:8] and raw[8 + n:] == ref[8 + n:]
    assert json.loads(raw[8:8 + n]) == json.loads(ref[8:8 + n])  # its metadata order varies
    back = load(raw)
    for k, v in merged.items():
        assert torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)), k
    assert back["sample_offsets"].tolist() == [0, 1, 5, 6, 12]
    assert entry["sha256"] == shards.file_sha256(tmp_path / entry["file"])
    assert entry["bytes"] == len(raw) and entry["tokens"] == 12 and entry["samples"] == 4
    assert {"write", "fsync", "hash"} <= set(timings)
    assert not list(tmp_path.glob("*.tmp"))


def test_parallel_part_writer_commits_parts_in_order(tmp_path):
    """Parts written by several threads at once are renamed and recorded strictly in order
    (a big first part finishes last), with every sample once, in the order it was put."""
    state = {"shard": 0, "num_shards": 1, "parts": [], "nonfinite": 0}
    writer = shard_writer.PartWriter(tmp_path, state, file_bytes=1, metadata={}, threads=3)
    sizes = [60000, 3, 4, 5, 6, 7, 8]
    for i, n in enumerate(sizes):
        batch = _host_batch(n, [2 * i, 2 * i + 1], hidden=64)
        writer.put(None, {**batch, "nonfinite": torch.zeros(n, dtype=torch.bool)}, ["a", "b"])
    writer.close()
    assert [e["part"] for e in state["parts"]] == list(range(len(sizes)))
    assert shard_state.read_state(tmp_path, 0, 1)["parts"] == state["parts"]
    rows = [shards.part_sample_index(tmp_path, e["file"]).tolist() for e in state["parts"]]
    assert rows == [[2 * i, 2 * i + 1] for i in range(len(sizes))]
    assert [e["tokens"] for e in state["parts"]] == sizes
    assert all(shards.file_sha256(tmp_path / e["file"]) == e["sha256"] for e in state["parts"])
    assert not list(tmp_path.glob("*.tmp")) and writer.bytes_written == sum(
        e["bytes"] for e in state["parts"])
