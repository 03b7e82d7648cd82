"""A training that outlives its lease: what a size of the scaling curve needs to resume on the
next lent machine, brought back through $OUT and carried again (docs/benchmarks.md, "A size
over two leases").

A lease ends after 30 minutes, and with it /tmp. The curve's largest size trains longer than a
lease holds, so its run folder goes home in pieces and comes back in the next lease, where
scale.py makes again what is cheap to remake (prepare and capture are deterministic: the same
subset gives the same samples) and eyas train resumes from the checkpoint. Kept: everything in
the size's folder but `captured/` and `prepared/`, and of the checkpoints only the step folders
that `last` and `best` name (about 135 MB for SmolLM2's draft, most of it the fp32 weights and
their optimizer state).

    python keep.py pack SRC NAME STORE [--part-bytes B]  # on the device: STORE/NAME.tar.part-NN
    python keep.py send STORE NAME OUT [--max-files N]   # on the device: the next parts to OUT
    python keep.py carry NAME DEST DIR...                # here: join what came back, check it,
                                                         # and cut it into DEST/k0, k1, ... for
                                                         # `h200_lease.sh kpart`
    python keep.py unpack TAR DEST                       # on the device: TAR into DEST

Every piece is checked by sha256 at each end; a missing or damaged piece stops with its name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
from pathlib import Path

REMADE = ("captured", "prepared")  # made again in the next lease, deterministically
SEND_PART = 15_000_000  # under the device's 16 MiB per file that comes back
CARRY_PART = 45_000_000  # one per call beside the tree, under its 64 MiB


def kept_files(src: Path) -> list[Path]:
    """The files of `src` a resume needs, relative to src: all but REMADE and the checkpoint
    step folders that neither `checkpoints/last` nor `checkpoints/best` names."""
    named = set()
    for pointer in src.glob("**/checkpoints/last"), src.glob("**/checkpoints/best"):
        for p in pointer:
            named.add(p.parent / p.read_text().strip())
    out = []
    for f in sorted(src.rglob("*")):
        rel = f.relative_to(src)
        if not f.is_file() or rel.parts[0] in REMADE:
            continue
        step = next((a for a in f.parents if a.parent.name == "checkpoints"
                     and a.name.startswith("step-")), None)
        if step is not None and step not in named:
            continue
        out.append(rel)
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def split(whole: Path, folder: Path, prefix: str, size: int) -> list[Path]:
    """`whole` cut into folder/prefix.part-NN of `size` bytes, with folder/SHA256SUMS."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    with whole.open("rb") as f:
        while chunk := f.read(size):
            part = folder / f"{prefix}.part-{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    (folder / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.name}\n" for p in parts))
    return parts


def check_sums(folder: Path) -> list[str]:
    """The part names SHA256SUMS in `folder` lists, each checked; a missing or damaged one
    ends the program with its name."""
    names = []
    for line in (folder / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        if not (folder / name).is_file():
            raise SystemExit(f"{folder / name} has not arrived")
        if sha256(folder / name) != digest:
            raise SystemExit(f"{folder / name} is damaged (sha256 differs from SHA256SUMS)")
        names.append(name)
    return names


def pack(src: Path, name: str, store: Path, part_bytes: int = SEND_PART) -> dict:
    """SRC's kept files as STORE/NAME.tar (paths under SRC's own name), cut into parts."""
    files = kept_files(src)
    if not any(f.parts[-1] == "trainer_state.pt" for f in files):
        raise SystemExit(f"{src} holds no checkpoint to resume from")
    store.mkdir(parents=True, exist_ok=True)
    tar = store / f"{name}.tar"
    with tarfile.open(tar, "w") as t:
        for rel in files:
            t.add(src / rel, arcname=str(Path(src.name) / rel))
    parts = split(tar, store, f"{name}.tar", part_bytes)
    info = {"name": name, "source": str(src), "files": len(files), "bytes": tar.stat().st_size,
            "sha256": sha256(tar), "parts": [p.name for p in parts]}
    (store / f"{name}.json").write_text(json.dumps(info, indent=1))
    tar.unlink()
    return info


def send(store: Path, name: str, out: Path, max_files: int = 7) -> list[str]:
    """The next parts not yet sent (at most max_files, the first call also the sums and the
    record) copied into OUT; STORE/NAME.sent lists what went."""
    info = json.loads((store / f"{name}.json").read_text())
    sent_log = store / f"{name}.sent"
    sent = sent_log.read_text().split() if sent_log.is_file() else []
    todo = [p for p in info["parts"] if p not in sent][:max_files]
    out.mkdir(parents=True, exist_ok=True)
    for p in todo:
        shutil.copy(store / p, out / p)
    shutil.copy(store / "SHA256SUMS", out / f"{name}.SHA256SUMS")
    shutil.copy(store / f"{name}.json", out / f"{name}.json")
    sent_log.write_text(" ".join(sent + todo))
    left = len(info["parts"]) - len(sent) - len(todo)
    print(f"{name}: sent {len(todo)} part(s), {left} left", flush=True)
    return todo


def carry(name: str, dest: Path, dirs: list[Path], part_bytes: int = CARRY_PART) -> list[Path]:
    """The parts that came back (in any of `dirs`) joined and checked, then cut into
    DEST/k0, k1, ... (one per device call), each with SHA256SUMS and NAME.tar.sha256, the
    layout `h200_lease.sh kpart` joins and checks into $W/NAME.tar."""
    info = next((json.loads(d.joinpath(f"{name}.json").read_text()) for d in dirs
                 if d.joinpath(f"{name}.json").is_file()), None)
    if info is None:
        raise SystemExit(f"no {name}.json in {', '.join(map(str, dirs))}: nothing of {name} "
                         f"came back")
    staging = dest / f".{name}-parts"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for d in dirs:
        for part in d.glob(f"{name}.tar.part-*"):
            shutil.copy(part, staging / part.name)
        if d.joinpath(f"{name}.SHA256SUMS").is_file():
            shutil.copy(d / f"{name}.SHA256SUMS", staging / "SHA256SUMS")
    check_sums(staging)
    whole = staging / f"{name}.tar"
    with whole.open("wb") as f:
        for p in info["parts"]:
            f.write((staging / p).read_bytes())
    if sha256(whole) != info["sha256"]:
        raise SystemExit(f"{name}.tar joined from its parts differs from the one packed")
    cut = split(whole, staging / "carry", f"{name}.tar", part_bytes)
    folders = []
    for i, part in enumerate(cut):
        k = dest / f"k{i}"
        shutil.rmtree(k, ignore_errors=True)
        k.mkdir(parents=True)
        shutil.copy(part, k / part.name)
        shutil.copy(staging / "carry/SHA256SUMS", k / "SHA256SUMS")
        (k / f"{name}.tar.sha256").write_text(f"{info['sha256']}  {name}.tar\n")
        folders.append(k)
    shutil.rmtree(staging)
    print(f"{name}: {info['files']} files, {info['bytes']:,} bytes, in "
          f"{', '.join(map(str, folders))}", flush=True)
    return folders


def unpack(tar: Path, dest: Path) -> Path:
    """TAR's folder into DEST (an earlier copy of that folder is replaced)."""
    with tarfile.open(tar) as t:
        top = {Path(m.name).parts[0] for m in t.getmembers()}
        if len(top) != 1 or any(m.name.startswith("/") or ".." in Path(m.name).parts
                                for m in t.getmembers()):
            raise SystemExit(f"{tar} is not one folder packed by keep.py pack")
        folder = dest / top.pop()
        shutil.rmtree(folder, ignore_errors=True)
        dest.mkdir(parents=True, exist_ok=True)
        t.extractall(dest)
    return folder


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("src", type=Path)
    a.add_argument("name")
    a.add_argument("store", type=Path)
    a.add_argument("--part-bytes", type=int, default=SEND_PART)
    a = sub.add_parser("send")
    a.add_argument("store", type=Path)
    a.add_argument("name")
    a.add_argument("out", type=Path)
    a.add_argument("--max-files", type=int, default=7)
    a = sub.add_parser("carry")
    a.add_argument("name")
    a.add_argument("dest", type=Path)
    a.add_argument("dirs", type=Path, nargs="+")
    a.add_argument("--part-bytes", type=int, default=CARRY_PART)
    a = sub.add_parser("unpack")
    a.add_argument("tar", type=Path)
    a.add_argument("dest", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "pack":
        print(json.dumps(pack(a.src, a.name, a.store, a.part_bytes)), flush=True)
    elif a.cmd == "send":
        send(a.store, a.name, a.out, a.max_files)
    elif a.cmd == "carry":
        carry(a.name, a.dest, a.dirs, a.part_bytes)
    else:
        print(unpack(a.tar, a.dest), flush=True)


if __name__ == "__main__":
    sys.exit(main())
