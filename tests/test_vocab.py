"""`eyas vocab`: selection order, ties, padding, offsets, coverage, manifests, refusals."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.config import ConfigError, from_dict
from eyas.errors import EyasError
from eyas.store.manifest import read_manifest, write_manifest
from eyas.vocab import VocabConfig, build_vocab, vocab
from eyas.store.vocab import check_vocab, load_vocab


def fake_prepared(folder, counts, *, tokenizer_hash="tok-a", name="tiny/llama"):
    """A folder as `eyas prepare` leaves it, as far as `eyas vocab` reads it."""
    counts = torch.as_tensor(counts, dtype=torch.int64)
    target = {"name_or_path": name, "revision": None, "commit": None, "model_type": "llama",
              "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": counts.numel(),
              "tokenizer_hash": tokenizer_hash}
    write_manifest(folder, "prepare", {"target": name}, target=target,
                   vocab_size=counts.numel())
    save_file({"counts": counts}, str(folder / "token_counts.safetensors"))
    return folder


def test_most_frequent_ids_with_ties_by_lower_id():
    counts = torch.tensor([5, 9, 0, 9, 3, 5, 7, 0])
    d2t, t2d, coverage = build_vocab(counts, 4)
    # 9 (ids 1, 3), 7 (id 6), then the tie at 5 goes to id 0 before id 5; sorted ascending
    chosen = torch.arange(4) + d2t
    assert chosen.tolist() == [0, 1, 3, 6]
    assert d2t.dtype == torch.int64 and d2t.tolist() == [0, 0, 1, 3]
    assert t2d.dtype == torch.bool and t2d.nonzero().squeeze(1).tolist() == [0, 1, 3, 6]
    assert coverage == pytest.approx((5 + 9 + 9 + 7) / counts.sum().item())


def test_pads_with_lowest_unused_ids_when_few_seen():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[7], counts[4] = 3, 1
    d2t, t2d, coverage = build_vocab(counts, 5)
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 4, 7]  # 7, 4 seen; 0, 1, 2 pad
    assert int(t2d.sum()) == 5
    assert coverage == 1.0


def test_full_vocab_is_identity_and_oversize_refused():
    counts = torch.randint(0, 50, (30,))
    d2t, t2d, _ = build_vocab(counts, 30)
    assert torch.equal(d2t, torch.zeros(30, dtype=torch.long)) and bool(t2d.all())
    with pytest.raises(EyasError, match="exceeds the target vocab"):
        build_vocab(counts, 31)


def test_check_vocab_refuses_inconsistent_pairs():
    d2t, t2d, _ = build_vocab(torch.tensor([1, 0, 4, 2, 0, 3]), 3)
    check_vocab(d2t, t2d, 6, 3)
    with pytest.raises(EyasError, match="covers 6 target ids"):
        check_vocab(d2t, t2d, 7, 3)
    with pytest.raises(EyasError, match="d2t has 3"):
        check_vocab(d2t, t2d, 6, 4)
    bad = t2d.clone()
    bad[1] = ~bad[1]
    with pytest.raises(EyasError, match="disagree"):
        check_vocab(d2t, bad)


def test_vocab_step_sums_folders_and_writes_manifest(tmp_path):
    a = fake_prepared(tmp_path / "a", [0, 4, 1, 0, 2, 0, 0, 6])
    b = fake_prepared(tmp_path / "b", [0, 0, 1, 5, 0, 0, 0, 0])
    out = tmp_path / "vocab"
    man = vocab(VocabConfig(data=(str(a), str(b)), out=str(out), draft_vocab_size=3))
    d2t, t2d, loaded = load_vocab(out)
    # summed counts [0, 4, 2, 5, 2, 0, 0, 6]: top 3 = ids 7, 3, 1
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 7]
    assert man["coverage"] == pytest.approx(15 / 19) and loaded["coverage"] == man["coverage"]
    assert man["draft_vocab_size"] == 3 and man["vocab_size"] == 8
    assert [i["step"] for i in man["inputs"]] == ["prepare", "prepare"]
    assert read_manifest(out, step="vocab")["target"]["tokenizer_hash"] == "tok-a"
    assert set(load_file(str(out / "vocab.safetensors"))) == {"d2t", "t2d"}


def test_default_size_on_small_vocab_is_whole_vocab(tmp_path, caplog):
    a = fake_prepared(tmp_path / "a", list(range(100)))
    with caplog.at_level(logging.INFO, logger="eyas.vocab"):
        man = vocab(VocabConfig(data=(str(a),), out=str(tmp_path / "v")))
    assert man["draft_vocab_size"] == 100 and man["coverage"] == 1.0
    assert "whole target vocabulary" in caplog.text
    with pytest.raises(EyasError, match="exceeds the target vocab"):
        vocab(VocabConfig(data=(str(a),), out=str(tmp_path / "w"), draft_vocab_size=101))
    # a size given is the user's, even the default's number: refused like any other over 100
    with pytest.raises(EyasError, match="exceeds the target vocab"):
        vocab(VocabConfig(data=(str(a),), out=str(tmp_path / "w"), draft_vocab_size=32000))


def test_refuses_other_target_missing_counts_and_no_assistant_tokens(tmp_path):
    a = fake_prepared(tmp_path / "a", [1, 2, 3, 4])
    b = fake_prepared(tmp_path / "b", [1, 2, 3, 4], tokenizer_hash="tok-b", name="other/model")
    with pytest.raises(EyasError, match="other/model"):
        vocab(VocabConfig(data=(str(a), str(b)), out=str(tmp_path / "v"), draft_vocab_size=2))
    (a / "token_counts.safetensors").unlink()
    with pytest.raises(EyasError, match="re-run `eyas prepare`"):
        vocab(VocabConfig(data=(str(a),), out=str(tmp_path / "v"), draft_vocab_size=2))
    z = fake_prepared(tmp_path / "z", [0, 0, 0])
    with pytest.raises(EyasError, match="no assistant"):
        vocab(VocabConfig(data=(str(z),), out=str(tmp_path / "v"), draft_vocab_size=2))
    with pytest.raises(EyasError, match="eyas prepare"):  # not a prepared folder at all
        vocab(VocabConfig(data=(str(tmp_path / "v"),), out=str(tmp_path / "w")))


def test_config_from_flags_and_validation():
    # the CLI hands flag strings to from_dict: "--data p1,p2 --draft-vocab-size 64"
    cfg = from_dict(VocabConfig, {"data": "p1,p2", "out": "o", "draft_vocab_size": "64"})
    assert cfg == VocabConfig(data=("p1", "p2"), out="o", draft_vocab_size=64)
    assert from_dict(VocabConfig, {"data": "p", "out": "o"}).draft_vocab_size is None
    with pytest.raises(ConfigError):
        VocabConfig(data=(), out="o")
    with pytest.raises(ConfigError):
        VocabConfig(data=("p",), out="o", draft_vocab_size=0)
    # a folder given twice was counted twice, silently outweighing the others
    with pytest.raises(ConfigError, match="same prepared folder more than once"):
        VocabConfig(data=("p", "q", "./p"), out="o")


def test_out_policy_keeps_a_users_vocab_file_and_reruns_its_own(tmp_path, caplog):
    """Issue 34: a folder holding a user's vocab.safetensors (no eyas.json) is refused, kept.
    Its own earlier vocab is replaced, with a warning when the tokens differ (training runs
    started with it cannot resume with the new one)."""
    a = fake_prepared(tmp_path / "a", [0, 4, 1, 0, 2, 0, 0, 6])
    user = tmp_path / "user"
    user.mkdir()
    (user / "vocab.safetensors").write_bytes(b"mine")
    with pytest.raises(EyasError, match="files eyas did not write.*vocab.safetensors"):
        vocab(VocabConfig(data=(str(a),), out=str(user), draft_vocab_size=3))
    assert (user / "vocab.safetensors").read_bytes() == b"mine"
    out = tmp_path / "v"
    vocab(VocabConfig(data=(str(a),), out=str(out), draft_vocab_size=3))
    with caplog.at_level(logging.WARNING, logger="eyas.vocab"):
        vocab(VocabConfig(data=(str(a),), out=str(out), draft_vocab_size=3))  # the same: quiet
        assert "replacing" not in caplog.text
        vocab(VocabConfig(data=(str(a),), out=str(out), draft_vocab_size=2))  # its own: re-run
    assert load_vocab(out)[0].numel() == 2
    assert "replacing the draft vocabulary" in caplog.text and "(3 tokens)" in caplog.text
    with pytest.raises(EyasError, match="output of `eyas prepare`"):
        vocab(VocabConfig(data=(str(a),), out=str(a), draft_vocab_size=3))


def test_damaged_counts_or_vocab_file_is_an_error_naming_it(tmp_path):
    """A token_counts or vocab.safetensors cut short, of another content or gone raised
    safetensors' or Python's own error (a traceback from `eyas vocab` / `eyas train --vocab`)."""
    a = fake_prepared(tmp_path / "a", [0, 4, 1, 0, 2, 0, 0, 6])
    out = tmp_path / "v"
    vocab(VocabConfig(data=(str(a),), out=str(out), draft_vocab_size=3))
    counts = a / "token_counts.safetensors"
    counts.write_bytes(counts.read_bytes()[:40])
    with pytest.raises(EyasError, match=r"token_counts.safetensors is not a readable safetensors "
                                        r"file .*re-run `eyas prepare`"):
        vocab(VocabConfig(data=(str(a),), out=str(out), draft_vocab_size=3))
    save_file({"other": torch.zeros(8, dtype=torch.int64)}, str(counts))
    with pytest.raises(EyasError, match=r"holds no \['counts'\].*re-run `eyas prepare`"):
        vocab(VocabConfig(data=(str(a),), out=str(out), draft_vocab_size=3))
    fix = f"make it again: eyas vocab --data {a} --out {out}"
    vocab_file = out / "vocab.safetensors"
    vocab_file.write_bytes(vocab_file.read_bytes()[:50])
    with pytest.raises(EyasError, match="not a readable safetensors file") as err:
        load_vocab(out)
    assert fix in str(err.value)
    vocab_file.unlink()
    with pytest.raises(EyasError, match="vocab.safetensors is missing") as err:
        load_vocab(out)
    assert fix in str(err.value)


def test_a_vocab_run_killed_before_its_end_is_made_again_and_refused_meanwhile(tmp_path,
                                                                              monkeypatch):
    """From an audit: killed between vocab.safetensors and its eyas.json, the folder was
    refused by the rerun as "files eyas did not write", and into an earlier vocab's folder
    train said to use the same --draft-vocab-size for vocab and train (a flag train lacks)."""
    import eyas.vocab as module

    (tmp_path / "p").mkdir()
    prepared = fake_prepared(tmp_path / "p", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8])
    out = tmp_path / "v"
    real = module.save_file

    def killed(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt  # stands in for a kill after the file, before the manifest

    monkeypatch.setattr(module, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        vocab(VocabConfig(data=(str(prepared),), out=str(out), draft_vocab_size=8))
    with pytest.raises(EyasError, match=r"holds an `eyas vocab` run that was stopped before it "
                                        r"finished; make it again: eyas vocab --data .* --out"):
        load_vocab(out)
    monkeypatch.setattr(module, "save_file", real)
    vocab(VocabConfig(data=(str(prepared),), out=str(out), draft_vocab_size=8))
    assert load_vocab(out)[0].numel() == 8


def test_a_full_disk_is_one_line_with_the_way_on(tmp_path, monkeypatch, capsys):
    """From an audit: a full disk met outside a step's own checks (a state file, a manifest,
    safetensors) ended in an OSError traceback; every step now says it in one line."""
    import errno

    import eyas.vocab as module
    from eyas.cli import main

    (tmp_path / "p").mkdir()
    prepared = fake_prepared(tmp_path / "p", [3, 1, 4, 1, 5, 9, 2, 6])

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "v"))

    monkeypatch.setattr(module, "save_file", full)
    code = main(["vocab", "--data", str(prepared), "--out", str(tmp_path / "v"),
                 "--draft-vocab-size", "4"])
    err = capsys.readouterr().err
    assert code == 1
    assert re.search(r"eyas vocab: error: no space left on the device \(.*v\): No space left "
                     r"on device\. Free some space .*then run the same command again", err)
    assert "Traceback" not in err
