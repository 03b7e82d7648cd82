"""Issue 34: damaged capture parts are refused by train and redone by capture's resume, one
--out policy for every step, and names read from a folder stay inside it."""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path

import pytest

from eyas.capture import capture
from eyas.errors import EyasError
from eyas.store import shards
from eyas.store.manifest import check_out, inside, write_manifest
from test_capture import _cfg, make_prepared


@pytest.fixture(scope="module")
def prepared(llama_dir, tmp_path_factory):
    return make_prepared(tmp_path_factory.mktemp("prepared"), llama_dir)


@pytest.fixture
def captured(llama_dir, prepared, tmp_path):
    out = tmp_path / "cap"
    capture(_cfg(llama_dir, prepared, out))
    return out


def _flip_in(path: Path, key: str) -> None:
    """Flip one byte in the middle of tensor `key`'s data (header untouched, size kept)."""
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    begin, end = json.loads(raw[8:8 + n])[key]["data_offsets"]
    raw[8 + n + (begin + end) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def _first_part(folder: Path) -> Path:
    return folder / json.loads((folder / shards.INDEX).read_text())["files"][0]["file"]


def test_a_flipped_aux_hidden_byte_is_refused_by_train_and_redone_by_capture(
        llama_dir, prepared, captured, caplog):
    from eyas.draft.data import OfflineSource

    OfflineSource(captured)  # hashes every part once and remembers it
    assert (captured / ".verified.json").is_file()
    victim = _first_part(captured)
    st = victim.stat()
    _flip_in(victim, "aux_hidden")
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime restored; ctime still moves
    with pytest.raises(EyasError) as err:
        OfflineSource(captured)  # what `eyas train` opens
    assert victim.name in str(err.value) and "sha256" in str(err.value)
    assert "delete those files and run the same `eyas capture`" in str(err.value)
    with caplog.at_level(logging.WARNING):
        capture(_cfg(llama_dir, prepared, captured))  # resume: the damaged part is redone
    assert victim.name in caplog.text and "captured again" in caplog.text
    index = shards.verify(captured)  # every row exactly once again
    assert index["num_samples"] == 14 and victim.name not in [e["file"] for e in index["files"]]
    assert shards.open_capture(captured).num_samples == 14


def test_capture_remembers_its_own_parts_so_its_resume_hashes_nothing(
        llama_dir, prepared, captured, caplog):
    """The writer hashed each part from the bytes it wrote: recorded as verified at write time,
    so a resume (here of a finished capture) reads no part back to hash it."""
    verified = json.loads((captured / ".verified.json").read_text())
    files = json.loads((captured / shards.INDEX).read_text())["files"]
    assert len(files) > 1
    assert {e["file"]: e["sha256"] for e in files} == \
        {name: v["sha256"] for name, v in verified.items()}
    with caplog.at_level(logging.INFO):
        capture(_cfg(llama_dir, prepared, captured))
    assert "checked sha256" not in caplog.text
    victim = _first_part(captured)  # a part changed since is hashed again, and redone
    _flip_in(victim, "aux_hidden")
    with caplog.at_level(logging.INFO):
        capture(_cfg(llama_dir, prepared, captured))
    assert "checked sha256 of 1 capture part" in caplog.text and "captured again" in caplog.text


def test_a_corrupt_header_names_the_file_not_a_safetensors_traceback(captured):
    victim = _first_part(captured)
    raw = bytearray(victim.read_bytes())
    raw[10:20] = b"\x00garbage\xff\xfe"
    victim.write_bytes(bytes(raw))
    for checksums in (True, False):
        with pytest.raises(EyasError, match=victim.name) as err:
            shards.open_capture(captured, checksums=checksums)
        assert "eyas capture" in str(err.value)
    with pytest.raises(EyasError, match="header is unreadable"):
        shards.open_capture(captured, checksums=False)


def test_a_part_named_outside_the_folder_is_refused(captured, tmp_path):
    index = json.loads((captured / shards.INDEX).read_text())
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(_first_part(captured).read_bytes())
    for name in (str(outside), "../outside.safetensors"):
        index["files"][0]["file"] = name
        (captured / shards.INDEX).write_text(json.dumps(index))
        with pytest.raises(EyasError, match="not a plain name inside"):
            shards.open_capture(captured)
        with pytest.raises(EyasError, match="not a plain name inside"):
            shards.verify(captured)


def test_inside_refuses_absolute_dotdot_and_links_out(tmp_path):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "ok").write_text("x")
    (tmp_path / "secret").write_text("x")
    (tmp_path / "f" / "link").symlink_to(tmp_path / "secret")
    assert inside(tmp_path / "f", "ok", "a list") == tmp_path / "f" / "ok"
    for bad in ("/etc/passwd", "../secret", "a/../../secret", ""):
        with pytest.raises(EyasError, match="not a plain name"):
            inside(tmp_path / "f", bad, "a list")
    with pytest.raises(EyasError, match="outside that folder"):
        inside(tmp_path / "f", "link", "a list")


def test_check_out_is_one_policy(tmp_path):
    new, empty = tmp_path / "new", tmp_path / "empty"
    empty.mkdir()
    assert check_out(new, "vocab", own=("vocab.safetensors",)) == new
    check_out(empty, "vocab", own=("vocab.safetensors",))
    user = tmp_path / "user"
    user.mkdir()
    (user / "vocab.safetensors").write_text("mine")  # a user's file of an eyas name
    with pytest.raises(EyasError, match="files eyas did not write.*vocab.safetensors") as e:
        check_out(user, "vocab", own=("vocab.safetensors",))
    assert e.value.flag == "--out"  # each refusal names the option (eyas run's hint follows it)
    other = tmp_path / "other"
    write_manifest(other, "prepare", {})
    with pytest.raises(EyasError, match="output of `eyas prepare`") as e:
        check_out(other, "vocab", own=("vocab.safetensors",))
    assert e.value.flag == "--out"
    mine = tmp_path / "mine"
    write_manifest(mine, "vocab", {})
    (mine / "vocab.safetensors").write_text("x")
    check_out(mine, "vocab", own=("vocab.safetensors",))  # re-running the step: allowed
    (mine / "NOTES.md").write_text("mine")
    with pytest.raises(EyasError, match="plus files it did not write.*NOTES.md") as e:
        check_out(mine, "vocab", own=("vocab.safetensors",))
    assert e.value.flag == "--out"
    (tmp_path / "file").write_text("x")
    with pytest.raises(EyasError, match="is a file") as e:
        check_out(tmp_path / "file", "vocab")
    assert e.value.flag == "--out"


def test_capture_refuses_a_foreign_folder_and_a_foreign_shard_state(llama_dir, prepared,
                                                                    tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.bin").write_text("mine")
    with pytest.raises(EyasError, match="data.bin"):
        capture(_cfg(llama_dir, prepared, foreign))
    assert sorted(p.name for p in foreign.iterdir()) == ["data.bin"]
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "shard-00000-of-00001.json").write_text('{"hello": 1}')
    with pytest.raises(EyasError, match="not a shard state written by `eyas capture`"):
        capture(_cfg(llama_dir, prepared, fake))


def test_convert_refuses_a_foreign_folder_before_reading_the_gguf(tmp_path):
    from eyas.convert import ConvertConfig, convert

    gguf = tmp_path / "none.gguf"  # never read: the refusal comes first
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(EyasError, match="files eyas did not write.*notes.txt"):
        convert(ConvertConfig(target=str(gguf), out=str(mine)))
    done = tmp_path / "done"
    write_manifest(done, "convert", {}, files={"model.safetensors": 1})
    (done / "model.safetensors").write_text("x")
    (done / "extra").mkdir()
    with pytest.raises(EyasError, match="plus files it did not write.*extra"):
        convert(ConvertConfig(target=str(gguf), out=str(done)))


def test_a_recorded_chat_template_must_match_its_hash(tmp_path):
    from types import SimpleNamespace

    from eyas.store.manifest import chat_template_fingerprint
    from eyas.targets.prompts import check_template_hash

    tok = SimpleNamespace(chat_template="{{ messages }}")
    manifest = {"path": "prepared", "chat_template_hash": chat_template_fingerprint(tok)}
    check_template_hash(tok, manifest, "t.jinja")
    check_template_hash(tok, {"path": "old"}, "t.jinja")  # older manifests record no hash
    tok.chat_template = "{{ messages }} changed"
    with pytest.raises(EyasError, match="t.jinja .* is not the one prepared was prepared with"):
        check_template_hash(tok, manifest, "t.jinja")


def test_a_part_cut_short_or_replaced_is_named_and_redone_by_capture(llama_dir, prepared,
                                                                     captured, caplog):
    """A part of another size than its shard state records was re-read and, if it opened,
    trusted with a new sha256 (a copy of another part: its rows twice, for train too); one that
    did not open was deleted without a word."""
    files = json.loads((captured / shards.INDEX).read_text())["files"]
    victim, other = (captured / e["file"] for e in files[:2])
    assert victim.stat().st_size != other.stat().st_size
    victim.write_bytes(other.read_bytes())
    with caplog.at_level(logging.WARNING):
        capture(_cfg(llama_dir, prepared, captured))
    assert victim.name in caplog.text and "captured again" in caplog.text
    assert shards.verify(captured)["num_samples"] == 14  # every row exactly once
    caplog.clear()
    victim = _first_part(captured)
    victim.write_bytes(victim.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING):
        capture(_cfg(llama_dir, prepared, captured))
    assert f"{victim.name}: it has 1000 bytes" in caplog.text and "captured again" in caplog.text
    assert shards.verify(captured)["num_samples"] == 14


def test_a_damaged_capture_index_or_manifest_is_refused_by_name(captured, tmp_path):
    """An edited or cut index.json, or a capture manifest missing what reading needs, ended
    train in a JSONDecodeError or KeyError traceback ('complete', 'files', 'sha256',
    'aux_layer_ids', 'split_rows', ...)."""
    import shutil

    from eyas.store.manifest import MANIFEST
    from eyas.store.shards import INDEX, open_capture

    good = Path(captured)
    edits = {INDEX: [lambda i: '{"format":', lambda i: "{}", lambda i: json.dumps(
                 {k: v for k, v in i.items() if k != "files"}),
                     lambda i: json.dumps({**i, "files": [{k: v for k, v in e.items()
                                                           if k != "sha256"}
                                                          for e in i["files"]]})],
             MANIFEST: [lambda m: json.dumps({k: v for k, v in m.items()
                                              if k != "aux_layer_ids"}),
                        lambda m: json.dumps({**m, "hidden_size": "64"}),
                        lambda m: json.dumps({**m, "split": "all", "split_rows": "x"}),
                        lambda m: json.dumps({**m, "target": "x"})]}
    for name, changes in edits.items():
        for j, change in enumerate(changes):
            folder = tmp_path / f"{name}-{j}"
            shutil.copytree(good, folder)
            body = json.loads((folder / name).read_text())
            (folder / name).write_text(change(body))
            with pytest.raises(EyasError, match=rf"{folder / name} is damaged \("):
                open_capture(folder)
