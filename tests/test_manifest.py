from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

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
    with pytest.raises(EyasError, match="no eyas.json"):
        read_manifest(tmp_path / "missing", step="prepare")
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


def test_target_mismatch_is_refused(tiny_tok):
    rec = target_record("a", tokenizer=tiny_tok)
    other = dict(rec, name_or_path="b", tokenizer_hash="0" * 16)
    check_same_target(rec, dict(rec), "prepared data")
    with pytest.raises(EyasError, match="made for target a.*--target b"):
        check_same_target(rec, other, "prepared data")
