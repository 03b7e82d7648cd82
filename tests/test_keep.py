"""benchmarks/keep.py and h200_lease.sh's keep / kpart steps: a size's training killed at the
end of one lease goes home in pieces, comes back in the next, and resumes there on a capture
made again, ending where the uninterrupted run ends (bit for bit)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.config import to_dict
from eyas.store import checkpoint

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import keep  # noqa: E402

from test_train import KILLER, _cfg, copy_target  # noqa: E402

REPO = Path(__file__).parent.parent


def _inputs(folder: Path, target: Path, chats: Path) -> dict:
    """prepare -> capture -> vocab into `folder`, as scale.py lays out a size."""
    from eyas.capture import CaptureConfig, capture
    from eyas.prepare import PrepareConfig, prepare
    from eyas.vocab import VocabConfig, vocab

    if not (folder / "prepared").is_dir():
        prepare(PrepareConfig(target=str(target), data=(str(chats),),
                              out=str(folder / "prepared"), max_length=256, eval_fraction=0.15))
    capture(CaptureConfig(target=str(target), data=str(folder / "prepared"),
                          out=str(folder / "captured"), split="all", model_dtype="fp32",
                          batch_tokens=2048))
    if not (folder / "vocab").is_dir():
        vocab(VocabConfig(data=(str(folder / "prepared"),), out=str(folder / "vocab"),
                          draft_vocab_size=256))
    return {k: str(folder / k) for k in ("prepared", "captured", "vocab")}


def test_a_killed_size_goes_home_in_pieces_and_resumes_on_a_remade_capture(tmp_path):
    from eyas.targets.corpus import synthetic_chats
    from eyas.train import train

    target = copy_target(tmp_path / "target")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(80, seed=0)))
    kw = dict(max_steps=6, save_every=1, keep_last=3, eval_every=3, lm_head="target")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float sums depend on the thread count: one, like the child
    try:
        whole = tmp_path / "whole"
        train(_cfg(_inputs(whole, target, chats), whole / "run", **kw))

        # lease 1: the size trains and is killed at step 4 (the lease's end)
        size = tmp_path / "lease1/scale/size-80"
        size.mkdir(parents=True)
        (size / "subset.txt").write_text("fingerprint recipe")
        inputs = _inputs(size, target, chats)
        script = tmp_path / "killer.py"
        script.write_text(KILLER)
        cfg = to_dict(_cfg(inputs, size / "run", **kw))
        proc = subprocess.run([sys.executable, str(script), json.dumps(cfg), "4"], timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        steps = sorted(p.name for p in (size / "run/checkpoints").glob("step-*"))
        assert steps == ["step-00000002", "step-00000003", "step-00000004"]

        # its folder packed on the device (the step run from the repo root, as a device call
        # runs), sent back two parts per call
        env = {**os.environ, "W": str(tmp_path / "w"), "KPARTS": str(tmp_path / "kparts"),
               "KEEP_STORE": str(tmp_path / "keepstore"), "KEEP_PART_BYTES": "150000",
               "KEEP_MAX_FILES": "2"}
        outs = []
        while len(outs) < 50:  # one call each, until every part has gone
            outs.append(tmp_path / f"out{len(outs)}")
            outs[-1].mkdir()
            said = subprocess.run(["bash", "benchmarks/h200_lease.sh", "keep", str(size),
                                   "size-80"], cwd=REPO, env={**env, "OUT": str(outs[-1])},
                                  capture_output=True, text=True)
            assert said.returncode == 0, said.stdout + said.stderr
            if said.stdout.endswith(" 0 left\n"):
                break
        parts = json.loads((tmp_path / "keepstore/size-80.json").read_text())["parts"]
        assert len(parts) > 2 and len(outs) == (len(parts) + 1) // 2
        assert sorted(f.name for d in outs for f in d.glob("*.part-*")) == parts

        # here: what came back, joined, checked and cut for the carry; a damaged part stops it
        bad = tmp_path / "bad"
        bad.mkdir()
        for d in outs:
            for f in d.iterdir():
                (bad / f.name).write_bytes(f.read_bytes())
        victim = bad / "size-80.tar.part-01"
        victim.write_bytes(b"x" + victim.read_bytes()[1:])
        with pytest.raises(SystemExit, match="size-80.tar.part-01 is damaged"):
            keep.carry("size-80", tmp_path / "carrybad", [bad])
        folders = keep.carry("size-80", tmp_path / "carry", outs, part_bytes=400_000)
        assert len(folders) >= 2

        # lease 2: a bare machine; kpart call by call, the last unpacks into $W/scale
        for k in folders:
            done = subprocess.run(["bash", "benchmarks/h200_lease.sh", "kpart", str(k)],
                                  cwd=REPO, env=env, capture_output=True, text=True)
            assert done.returncode == 0, done.stdout + done.stderr
        back = tmp_path / "w/scale/size-80"
        assert (back / "subset.txt").read_text() == "fingerprint recipe"
        assert not (back / "captured").exists() and not (back / "prepared").exists()
        kept = sorted(p.name for p in (back / "run/checkpoints").glob("step-*"))
        named = {checkpoint.read_pointer(size / "run", w).name for w in ("last", "best")}
        assert kept == sorted(named) == ["step-00000003", "step-00000004"]  # best, last
        # (the other step folders stayed behind)

        # prepare and capture made again, and the training resumes to the end
        train(_cfg(_inputs(back, target, chats), back / "run", **kw))
    finally:
        torch.set_num_threads(threads)
    a = load_file(str(checkpoint.step_dir(whole / "run", 6) / "draft.safetensors"))
    b = load_file(str(checkpoint.step_dir(back / "run", 6) / "draft.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unpack_refuses_what_keep_did_not_pack(tmp_path):
    import tarfile

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a/x").write_text("x")
    (tmp_path / "b/y").write_text("y")
    with tarfile.open(tmp_path / "two.tar", "w") as t:
        t.add(tmp_path / "a/x", arcname="a/x")
        t.add(tmp_path / "b/y", arcname="b/y")
    with pytest.raises(SystemExit, match="not one folder packed by keep.py"):
        keep.unpack(tmp_path / "two.tar", tmp_path / "dest")
    with pytest.raises(SystemExit, match="holds no checkpoint"):
        keep.pack(tmp_path / "a", "a", tmp_path / "store")
