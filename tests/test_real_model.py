"""The real target of the test bed: SmolLM2-135M-Instruct as a Q4_1 GGUF (Llama, 30 layers,
hidden 576, tied embeddings, ChatML) through doctor, prepare and capture on the CPU, passed as
`--target file.gguf`; its `eyas convert` folder; and the GGUF loader's errors, fingerprint and
dtype rule.

The model loads three times (capture's own load, the reference below, `eyas convert`'s) and
its converted folder once; its tokenizer a few times; everything else is two short chats.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import datasets
import pytest
import torch

from eyas.store import shards
from eyas.capture import CaptureConfig, capture
from eyas.targets.capture_forward import batch_inputs, plan_batches
from eyas.cli import main
from eyas.errors import EyasError
from eyas.store.manifest import (check_same_target, gguf_fingerprint, read_manifest, target_record,
                                 tokenizer_fingerprint)
from eyas.targets.convert import convert_gguf
from eyas.targets.models import _load_dtype, load_config, load_target, load_tokenizer, submodule
from eyas.prepare import PrepareConfig, prepare
from eyas.targets.tiny import build_tiny_model

CHATS = [
    [{"role": "user", "content": "What is 2 plus 2?"},
     {"role": "assistant", "content": "2 plus 2 is 4."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a color."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one?"},
     {"role": "assistant", "content": "Red, like a fire truck at night."}],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def prepared(smollm2_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("real-prepare")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    prepare(PrepareConfig(target=str(smollm2_gguf), data=(str(data),), out=str(root / "prepared"),
                          eval_fraction=0.0))
    return root / "prepared"


@pytest.fixture(scope="module")
def captured(smollm2_gguf, prepared, tmp_path_factory):
    """`eyas capture` with the default aux ids, in fp32, padded rows (one batch: both chats)."""
    out = tmp_path_factory.mktemp("real-capture") / "captured"
    capture(CaptureConfig(target=str(smollm2_gguf), data=str(prepared), out=str(out),
                          model_dtype="fp32", packing="padded"))
    return out


@pytest.fixture(scope="module")
def target(smollm2_gguf):
    """The model loaded again, independently of capture's load, with dtype "auto"."""
    return load_target(smollm2_gguf, dtype="auto")


def _train_rows(prepared):
    return datasets.load_from_disk(str(prepared / "dataset"))["train"]


def _runs(ids, mask):
    """The maximal runs of loss-masked tokens, as token lists."""
    runs, cur = [], []
    for token, m in zip(ids, mask):
        if m:
            cur.append(token)
        elif cur:
            runs, cur = runs + [cur], []
    return runs + [cur] if cur else runs


# ------------------------------------------------------------------ doctor

def test_doctor_reads_the_gguf(smollm2_gguf, capsys):
    rc = main(["doctor", str(smollm2_gguf), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    m = report["model"]
    assert (m["architecture"], m["num_layers"], m["hidden_size"], m["vocab_size"]) == (
        "LlamaForCausalLM", 30, 576, 49152)
    assert m["tied_embeddings"] is True and m["lm_head_path"] == "lm_head"
    assert m["default_aux_layer_ids"] == [2, 15, 27]
    assert report["aux_layer_ids"]["ids"] == [2, 15, 27]
    assert report["tokenizer"]["loaded"] is True and report["tokenizer"]["chat_template"] is True
    assert report["tokenizer"]["fits_model_vocab"] is True


# ------------------------------------------------------------------ prepare

def test_prepare_masks_the_assistant_turns_as_chatml_renders_them(prepared, tokenizer):
    rows = _train_rows(prepared)
    assert len(rows) == len(CHATS)
    for row in rows:
        messages = json.loads(row["messages_json"])
        assert messages in CHATS
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        assert rendered.startswith("<|im_start|>")  # the GGUF's own ChatML template
        assert row["input_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        supervised = [tokenizer.decode(run) for run in _runs(row["input_ids"], row["loss_mask"])]
        want = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert supervised == want
        assert all(piece in rendered for piece in want)


def test_prepare_manifest_records_the_gguf(prepared, smollm2_gguf, tokenizer):
    target = read_manifest(prepared, step="prepare")["target"]
    assert target["name_or_path"] == str(smollm2_gguf)
    assert target["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert target["gguf_bytes"] == smollm2_gguf.stat().st_size
    assert target["gguf_fingerprint"] == gguf_fingerprint(smollm2_gguf)
    assert target["tokenizer_hash"] == tokenizer_fingerprint(tokenizer)


def test_prepare_manifest_records_the_gguf_model_shape(prepared):
    target = read_manifest(prepared, step="prepare")["target"]
    assert (target["num_hidden_layers"], target["hidden_size"]) == (30, 576)


# ------------------------------------------------------------------ capture

def test_auto_dtype_loads_the_gguf_in_float32_on_cpu(target):
    model, info = target
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert info.dtype == "float32" and info.tied_embeddings and info.num_layers == 30
    assert isinstance(submodule(model, info.lm_head_path), torch.nn.Linear)  # de-quantized


def test_capture_equals_the_targets_own_forward(captured, prepared, target, smollm2_gguf):
    """Bit-identical: capture ran the same fp32 padded batch as this reference (same rows in
    the same order, same shapes), so its states are these exactly, rounded to its bf16
    storage; target top-1 is the argmax of the full lm_head logits."""
    model, info = target
    manifest = read_manifest(captured, step="capture")
    assert manifest["aux_layer_ids"] == [2, 15, 27] and manifest["complete"] is True
    assert manifest["target"]["gguf_fingerprint"] == gguf_fingerprint(smollm2_gguf)
    got = assert_capture_is_the_forward(captured, model, info, _train_rows(prepared),
                                        (2, 15, 27))
    # the taps are not a copy of one another: three distinct residual streams
    assert not torch.equal(got[0]["aux_hidden"][:, 0], got[0]["aux_hidden"][:, 2])


def assert_capture_is_the_forward(captured, model, info, rows, aux) -> dict:
    """Every captured sample of `rows` (one padded fp32 batch, as capture ran it) equals the
    target's own forward: output_hidden_states[k] at the aux ids and the final (normed) state,
    rounded to capture's bf16 storage, the lm_head's argmax, the ids and the loss mask. Returns
    the samples by row."""
    (batch,) = plan_batches(rows["num_tokens"], range(len(rows)), CaptureConfig.batch_tokens,
                            flat=False)
    inputs, host = batch_inputs([(rows[r]["input_ids"], rows[r]["loss_mask"]) for r in batch],
                                flat=False)
    assert inputs["attention_mask"] is not None  # the chats differ in length: padding is tested
    with torch.inference_mode():
        out = submodule(model, info.text_model_path)(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
            output_hidden_states=True, use_cache=False)
        flat = [h.reshape(-1, info.hidden_size)[inputs["gather"]] for h in out.hidden_states]
        final = out.last_hidden_state.reshape(-1, info.hidden_size)[inputs["gather"]]
        top1 = submodule(model, info.lm_head_path)(final).argmax(-1)
    offsets = host["sample_offsets"].tolist()
    cs = shards.open_capture(captured)
    got = {int(cs.sample_index[i]): cs.sample(i, dtype=torch.float32)
           for i in range(cs.num_samples)}
    assert sorted(got) == list(range(len(rows)))
    for j, row in enumerate(batch):
        s, e = offsets[j], offsets[j + 1]
        sample = got[row]
        for a, k in enumerate(aux):
            want = flat[k][s:e].bfloat16().float()
            assert torch.equal(sample["aux_hidden"][:, a], want), (row, k)
        assert torch.equal(sample["final_hidden"], final[s:e].bfloat16().float()), row
        assert torch.equal(sample["target_top1"], top1[s:e].int()), row
        assert sample["input_ids"].tolist() == rows[row]["input_ids"]
        assert sample["loss_mask"].tolist() == rows[row]["loss_mask"]
    return got


def test_offline_training_reads_embedding_and_head_from_the_gguf(smollm2_gguf, target):
    """eyas train (offline) reads only the two tensors it needs from the GGUF: the values
    transformers' loader gives the model (tied: one matrix)."""
    from eyas.draft.data import target_head_weights

    model, info = target
    embed, head, got_info, _ = target_head_weights(str(smollm2_gguf))
    assert got_info.layers_path == info.layers_path
    assert torch.equal(embed, model.get_input_embeddings().weight.detach().float())
    assert torch.equal(head, model.get_output_embeddings().weight.detach().float())


def test_capture_refuses_a_folder_prepared_from_another_gguf(smollm2_gguf, prepared, tmp_path):
    """Same tokenizer, same shapes, another file behind the name: the fingerprint refuses it
    (before the weights load)."""
    other = tmp_path / "prepared"
    shutil.copytree(prepared, other)
    body = json.loads((other / "eyas.json").read_text())
    body["target"]["gguf_fingerprint"] = "0" * 16
    (other / "eyas.json").write_text(json.dumps(body))
    with pytest.raises(EyasError, match=r"gguf_fingerprint=0{16}.*re-run that step"):
        capture(CaptureConfig(target=str(smollm2_gguf), data=str(other),
                              out=str(tmp_path / "cap"), model_dtype="fp32"))
    assert not (tmp_path / "cap").exists()


# ------------------------------------------------------------------ eyas convert

def test_the_converted_folder_is_the_gguf_exactly(smollm2_gguf, target, tokenizer, prepared,
                                                  tmp_path):
    """`eyas convert` (float32): the folder's logits on a chat equal the GGUF-loaded model's bit
    for bit, its tokenizer renders the chat as the GGUF's does, and it is the GGUF's target
    for the prepared folder made with the GGUF."""
    model, _ = target
    out = convert_gguf(smollm2_gguf, tmp_path / "smol-hf")
    converted = load_tokenizer(out)
    for chat in CHATS:
        assert (converted.apply_chat_template(chat, tokenize=False)
                == tokenizer.apply_chat_template(chat, tokenize=False))
    ids = tokenizer.apply_chat_template(CHATS[1], return_tensors="pt",
                                        return_dict=True)["input_ids"]
    folder_model, info = load_target(out, dtype="float32")
    assert info.num_layers == 30 and info.tied_embeddings
    with torch.inference_mode():
        assert torch.equal(folder_model(ids).logits, model(ids).logits)
    record = target_record(str(out), config=folder_model.config, tokenizer=converted)
    assert record["tokenizer_hash"] == tokenizer_fingerprint(tokenizer)
    assert record["gguf_fingerprint"] == gguf_fingerprint(smollm2_gguf)
    check_same_target(read_manifest(prepared, step="prepare")["target"], record, "prepared")
    shutil.rmtree(out)  # 540 MB


# ------------------------------------------------------------------ errors, fingerprint, dtype

def _fake_gguf(path, body: bytes):
    path.write_bytes(b"GGUF" + body)
    return path


def test_missing_or_foreign_gguf_names_the_fix(tmp_path):
    with pytest.raises(EyasError, match=r"GGUF file .*missing\.gguf does not exist.*local "
                                        r"\.gguf file"):
        load_config(tmp_path / "missing.gguf")
    (tmp_path / "model.gguf").write_text('{"model_type": "llama"}')
    for load in (load_config, load_tokenizer, load_target):
        with pytest.raises(EyasError, match=r"model\.gguf is not a GGUF file.*download it again"):
            load(tmp_path / "model.gguf")


def test_a_cut_or_tensorless_gguf_names_the_fix(tiny_gguf, tmp_path):
    """A download cut short fails in transformers' reader with numpy's or struct's error
    (a raw traceback, or advice to upgrade transformers); a GGUF of metadata only would load as
    the default 7B Llama with random weights."""
    import gguf

    whole = tiny_gguf(0).read_bytes()
    for size in (10, 100, len(whole) // 2, len(whole) - 16):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(whole[:size])
        for load in (load_config, load_tokenizer):
            with pytest.raises(EyasError, match=rf"damaged or cut short \({size:,} bytes.*"
                                                r"download it again"):
                load(cut)
    vocab = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    vocab.add_token_list(["a", "b"])
    for write in (vocab.write_header_to_file, vocab.write_kv_data_to_file,
                  vocab.write_tensors_to_file, vocab.close):
        write()
    for load in (load_config, load_tokenizer, load_target):
        with pytest.raises(EyasError, match=r"vocab\.gguf is a GGUF file without tensors.*not "
                                            r"a model"):
            load(tmp_path / "vocab.gguf")
    assert main(["doctor", str(tmp_path / "vocab.gguf")]) == 2
    # a part of a split GGUF (gguf-split's names): its other parts' layers would be random
    part = tmp_path / "m-00001-of-00002.gguf"
    part.write_bytes(whole)
    for load in (load_config, load_tokenizer, load_target):
        with pytest.raises(EyasError, match=r"part 1 of 2 of a split GGUF.*llama-gguf-split "
                                            r"--merge .*m-00001-of-00002\.gguf merged\.gguf"):
            load(part)
    assert main(["doctor", str(part)]) == 2
    whole_named = tmp_path / "m-00001-of-00001.gguf"  # one part: the whole model
    whole_named.write_bytes(whole)
    assert load_config(whole_named).model_type == "llama"


def test_gguf_without_the_gguf_package_says_pip_install(tmp_path, monkeypatch):
    path = _fake_gguf(tmp_path / "m.gguf", b"\0" * 64)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(EyasError, match=r"needs the gguf package: pip install gguf"):
        load_tokenizer(path)


@pytest.mark.usefixtures("without_accelerate")
def test_gguf_weights_without_accelerate_say_pip_install(tmp_path):
    with pytest.raises(EyasError, match=r"only with accelerate: pip install accelerate"):
        load_target(_fake_gguf(tmp_path / "m.gguf", b"\0" * 64))


def test_gguf_fingerprint_tells_files_behind_one_name_apart(tmp_path):
    """Size and both ends count; the name does not (a moved file is the same target)."""
    big = 9 << 20  # more than both hashed ends: the middle is not read
    base = bytes(big)
    a = _fake_gguf(tmp_path / "m.gguf", base)
    b = _fake_gguf(tmp_path / "b.gguf", base[:-1] + b"\1")
    (tmp_path / "elsewhere").mkdir()
    moved = _fake_gguf(tmp_path / "elsewhere" / "moved.gguf", base)
    longer = _fake_gguf(tmp_path / "longer.gguf", base + b"\0")
    fp = gguf_fingerprint(a)
    assert gguf_fingerprint(moved) == fp
    assert len({fp, gguf_fingerprint(b), gguf_fingerprint(longer)}) == 3
    ra, rb = target_record(str(a)), target_record(str(b))
    assert (ra["gguf_file"], ra["gguf_bytes"]) == ("m.gguf", big + 4)
    check_same_target(ra, target_record(str(moved)), "the prepared folder")
    check_same_target(ra, {"name_or_path": "old manifest, no fingerprint"}, "the old folder")
    with pytest.raises(EyasError, match="gguf_fingerprint"):
        check_same_target(ra, rb, "the prepared folder")


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoints_on_gpu(tmp_path):
    bf16_dir = build_tiny_model("llama", tmp_path / "bf16", dtype=torch.bfloat16)
    model, info = load_target(bf16_dir, dtype="auto")
    assert info.dtype == "float32"  # a bf16 checkpoint, computed in float32 on the CPU
    model, info = load_target(bf16_dir, dtype="bfloat16")
    assert info.dtype == "bfloat16"  # an explicit dtype is kept
    assert _load_dtype("auto", gguf=False, on_cpu=False) == "auto"  # transformers: the checkpoint's
    assert _load_dtype("auto", gguf=True, on_cpu=False) is torch.bfloat16
    assert _load_dtype("auto", gguf=True, on_cpu=True) is torch.float32
    assert _load_dtype("fp16", gguf=True, on_cpu=True) is torch.float16


@pytest.mark.gpu
def test_auto_dtype_loads_the_gguf_in_bfloat16_on_gpu(smollm2_gguf):
    model, info = load_target(smollm2_gguf, dtype="auto", device="cuda")
    assert info.dtype == "bfloat16" and next(model.parameters()).is_cuda


def test_config_and_tokenizer_share_one_parse_of_the_gguf(tiny_gguf, tmp_path, monkeypatch):
    """AutoConfig and AutoTokenizer each parse a GGUF's metadata (the tokenizer twice: its
    config, then its vocabulary; ~11 s a parse for Qwen2.5-Coder's 151,936 tokens): one
    parse serves them all, while a load with tensors and other files still read their own."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    parse = gguf_utils.load_gguf_checkpoint
    calls = []

    def counted(path, return_tensors=False, *args, **kwargs):
        calls.append((Path(path).name, return_tensors))
        return parse(path, return_tensors, *args, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counted)
    path = tmp_path / "fresh.gguf"  # a file no other test has loaded in this process
    shutil.copy(tiny_gguf(0), path)
    config, tok = load_config(path), load_tokenizer(path)
    assert calls == [("fresh.gguf", False)]
    assert config.num_hidden_layers == 2 and tok("hello").input_ids
    assert gguf_utils.load_gguf_checkpoint is counted  # the library's function is back
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_gguf(1), other)
    load_config(other)
    assert calls == [("fresh.gguf", False), ("other.gguf", False)]
    load_target(path, dtype="float32")
    assert calls[-1] == ("fresh.gguf", True)


def test_gguf_config_and_tokenizer_are_parsed_once_and_handed_out_as_copies(smollm2_gguf):
    """A step loads config and tokenizer several times; the GGUF is parsed once per process
    (a second load is fast) and every caller gets its own copy (eval sets chat_template)."""
    import time

    first = load_tokenizer(smollm2_gguf)
    load_config(smollm2_gguf)
    first.chat_template = "changed"
    start = time.perf_counter()
    again, config = load_tokenizer(smollm2_gguf), load_config(smollm2_gguf)
    assert time.perf_counter() - start < 2.0
    assert again.chat_template != "changed" and "im_start" in again.chat_template
    config.num_hidden_layers = 1
    assert load_config(smollm2_gguf).num_hidden_layers == 30
