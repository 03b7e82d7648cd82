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

    python keep.py pack SRC NAME STORE [--part-bytes B] [--whole]
                                                         # on the device: STORE/NAME.tar.part-NN
                                                         # and STORE/NAME.SHA256SUMS (--whole:
                                                         # every file, e.g. an exported draft)
    python keep.py send STORE NAME OUT [--max-files N] [--resend last|all|3,4,5]
                                                         # on the device: the next parts to OUT
                                                         # (as many as fit a call's 8 files
                                                         # and 64 MiB)
    python keep.py carry NAME DEST DIR...                # here: join what came back, check it,
                                                         # and cut it into DEST/k0, k1, ... for
                                                         # `h200_lease.sh kpart`
    python keep.py unpack TAR DEST                       # on the device: TAR into DEST

Every piece is checked by sha256 at each end; a missing or damaged piece stops with its name.
A part counts as sent once a call has copied it to $OUT, but a failed call's $OUT never comes
back. If a call failed, run it again with `--resend last` (h200_lease.sh: `KEEP_RESEND=last
bash benchmarks/h200_lease.sh keep SRC NAME`): it sends again what the failed call sent. carry
names the parts that are missing or damaged and the KEEP_RESEND=3,4,5 that sends them again;
`--resend all` sends everything again from the first part. Each resend needs the machine that
packed NAME (the store lives in its /tmp).
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
# What one call's $OUT may bring back at most (the device tool's README, "Limits"): 8 files,
# 64 MiB together. A send fits its parts into what the call has left of both.
OUT_FILES = 8
OUT_BYTES = 64 * 2**20
CARRY_PART = 36_000_000  # one per call beside the tree (22 MB in session 27), under its 64 MiB


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


def split(whole: Path, folder: Path, name: str, size: int) -> list[Path]:
    """`whole` cut into folder/NAME.tar.part-NN of `size` bytes, with folder/NAME.SHA256SUMS
    (named by NAME: two sizes kept in one folder keep their own)."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    with whole.open("rb") as f:
        while chunk := f.read(size):
            part = folder / f"{name}.tar.part-{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    (folder / f"{name}.SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.name}\n"
                                                       for p in parts))
    return parts


def number(part: str) -> int:
    """NAME.tar.part-07 -> 7."""
    return int(part.rsplit("-", 1)[1])


def pack(src: Path, name: str, store: Path, part_bytes: int = SEND_PART,
         whole: bool = False) -> dict:
    """SRC's kept files as STORE/NAME.tar (paths under SRC's own name), cut into parts; with
    `whole`, every file of SRC (a folder that is not a training run, e.g. an exported draft that
    a later lease serves without training it again)."""
    files = sorted(f.relative_to(src) for f in src.rglob("*") if f.is_file()) if whole \
        else kept_files(src)
    if not files:
        raise SystemExit(f"{src} holds no files")
    if not whole and not any(f.parts[-1] == "trainer_state.pt" for f in files):
        raise SystemExit(f"{src} holds no checkpoint to resume from (--whole packs a folder "
                         "that is not a training run, e.g. an exported draft)")
    store.mkdir(parents=True, exist_ok=True)
    tar = store / f"{name}.tar"
    top = src.resolve().name  # `.` and `run/..` have no name of their own
    with tarfile.open(tar, "w") as t:
        for rel in files:
            t.add(src / rel, arcname=str(Path(top) / rel))
    parts = split(tar, store, name, part_bytes)
    info = {"name": name, "source": str(src), "files": len(files), "bytes": tar.stat().st_size,
            "sha256": sha256(tar), "parts": [p.name for p in parts]}
    (store / f"{name}.json").write_text(json.dumps(info, indent=1))
    tar.unlink()
    return info


def send(store: Path, name: str, out: Path, max_files: int | None = None, resend: str = "",
         out_files: int = OUT_FILES, out_bytes: int = OUT_BYTES) -> list[str]:
    """The next parts not yet sent copied into OUT, with NAME.SHA256SUMS and the record: as many
    as fit in what OUT has left of the call's out_files and out_bytes (what a poll of the same
    call put there counts), and at most max_files. A part that would not fit waits for the next
    call; a call with room for none stops with what fills OUT.
    STORE/NAME.sent lists what each call sent. `resend` first marks parts as not
    sent, so that they go again: "last" (what the call before sent), "all", or part numbers
    "3,4,5" (the ones carry names). An older send's NAME.sent (one flat list of the parts sent,
    space-separated or JSON) counts as one call: those parts count as sent, and "last" sends
    all of them again (more than the failed call sent, never less)."""
    info = json.loads((store / f"{name}.json").read_text())
    sent_log = store / f"{name}.sent"
    calls = sent_calls(sent_log)
    again = resent(resend, name, info["parts"], calls)
    calls = [[p for p in c if p not in again] for c in calls]
    sent = {p for c in calls for p in c}
    out.mkdir(parents=True, exist_ok=True)
    records = [store / f"{name}.SHA256SUMS", store / f"{name}.json"]
    replaced = {r.name for r in records}  # (written again below: they do not add up)
    there = [f for f in out.rglob("*") if f.is_file() and f.name not in replaced]
    files_left = out_files - len(there) - len(records)
    bytes_left = out_bytes - sum(f.stat().st_size for f in there + records)
    if max_files is not None:
        files_left = min(files_left, max_files)
    todo = []
    for p in (p for p in info["parts"] if p not in sent):
        size = (store / p).stat().st_size
        if len(todo) >= files_left or size > bytes_left:
            break
        todo.append(p)
        bytes_left -= size
    if not todo and len(sent) < len(info["parts"]):
        raise SystemExit(f"{name}: no room in {out} for a part: it holds {len(there)} files "
                         f"({sum(f.stat().st_size for f in there) / 2**20:.1f} MiB) of the "
                         f"{out_files} files and {out_bytes / 2**20:.0f} MiB a call brings "
                         f"back; send from a call that puts less there")
    for p in todo:
        shutil.copy(store / p, out / p)
    shutil.copy(store / f"{name}.SHA256SUMS", out / f"{name}.SHA256SUMS")
    shutil.copy(store / f"{name}.json", out / f"{name}.json")
    sent_log.write_text(json.dumps(calls + [todo]))
    left = len(info["parts"]) - len(sent) - len(todo)
    numbers = ", ".join(f"{number(p):02d}" for p in todo)
    print(f"{name}: sent {len(todo)} part(s) [{numbers}], {left} left", flush=True)
    return todo


def sent_calls(sent_log: Path) -> list[list[str]]:
    """NAME.sent as a list per call (see send); an old flat list of names is one call."""
    if not sent_log.is_file():
        return []
    text = sent_log.read_text()
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        calls = text.split()  # the first format: names separated by spaces
    if isinstance(calls, list) and all(isinstance(p, str) for p in calls):
        return [calls] if calls else []
    if isinstance(calls, list) and all(isinstance(c, list) and all(isinstance(p, str) for p in c)
                                       for c in calls):
        return calls
    raise SystemExit(f"{sent_log} is not a list of the parts each call sent: `rm {sent_log}` "
                     f"and the next call sends everything again from the first part")


def resent(resend: str, name: str, parts: list[str], calls: list[list[str]]) -> set[str]:
    """The parts `resend` names (see send)."""
    if resend == "":
        return set()
    if resend == "all":
        return set(parts)
    if resend == "last":
        return set(calls[-1]) if calls else set()
    try:
        named = {f"{name}.tar.part-{int(n):02d}" for n in resend.split(",")}
    except ValueError:
        raise SystemExit(f"--resend {resend!r}: give last, all or part numbers, e.g. 3,4,5")
    if named - set(parts):
        raise SystemExit(f"--resend {resend!r}: {name} has parts 0 to {len(parts) - 1}")
    return named


def gather(name: str, dirs: list[Path], parts: list[str]) -> dict[str, Path]:
    """Each part's first copy in `dirs` that matches NAME.SHA256SUMS (a part sent again may
    have come back twice); the missing and the damaged ones end the program, with the
    KEEP_RESEND that sends them again."""
    sums = next((d / f"{name}.SHA256SUMS" for d in dirs if (d / f"{name}.SHA256SUMS").is_file()),
                None)
    if sums is None:
        raise SystemExit(f"no {name}.SHA256SUMS in {', '.join(map(str, dirs))}")
    digests = {p: d for d, p in (line.split(maxsplit=1) for line in sums.read_text().splitlines())}
    found, missing, damaged = {}, [], []
    for p in parts:
        copies = [d / p for d in dirs if (d / p).is_file()]
        found[p] = next((c for c in copies if sha256(c) == digests.get(p)), None)
        if found[p] is None:
            (damaged if copies else missing).append(p)
    said = []
    if missing:
        said.append(f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} not arrived")
    if damaged:
        said.append(f"{', '.join(damaged)} {'is' if len(damaged) == 1 else 'are'} damaged "
                    f"(sha256 differs from {sums.name})")
    if said:
        again = ",".join(str(number(p)) for p in sorted(missing + damaged))
        raise SystemExit(f"{'; '.join(said)}: on the machine that packed {name}, "
                         f"KEEP_RESEND={again} bash benchmarks/h200_lease.sh keep SRC {name} "
                         f"sends them again")
    return found


def carry(name: str, dest: Path, dirs: list[Path], part_bytes: int = CARRY_PART) -> list[Path]:
    """The parts that came back (in any of `dirs`) joined and checked, then cut into
    DEST/k0, k1, ... (one per device call), each with NAME.SHA256SUMS and NAME.tar.sha256, the
    layout `h200_lease.sh kpart` joins and checks into $W/NAME.tar. NAME's folders of an
    earlier carry into DEST go (carried too, they would bring another carry's parts)."""
    info = next((json.loads(d.joinpath(f"{name}.json").read_text()) for d in dirs
                 if d.joinpath(f"{name}.json").is_file()), None)
    if info is None:
        raise SystemExit(f"no {name}.json in {', '.join(map(str, dirs))}: nothing of {name} "
                         f"came back")
    found = gather(name, dirs, info["parts"])
    staging = dest / f".{name}-parts"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    whole = staging / f"{name}.tar"
    with whole.open("wb") as f:
        for p in info["parts"]:
            f.write(found[p].read_bytes())
    if sha256(whole) != info["sha256"]:
        raise SystemExit(f"{name}.tar joined from its parts differs from the one packed")
    cut = split(whole, staging / "carry", name, part_bytes)
    folders = []
    for i, part in enumerate(cut):
        k = dest / f"k{i}"
        shutil.rmtree(k, ignore_errors=True)
        k.mkdir(parents=True)
        shutil.copy(part, k / part.name)
        shutil.copy(staging / f"carry/{name}.SHA256SUMS", k / f"{name}.SHA256SUMS")
        (k / f"{name}.tar.sha256").write_text(f"{info['sha256']}  {name}.tar\n")
        folders.append(k)
    for k in dest.glob("k*"):  # an earlier carry of NAME here, cut into more folders
        if k not in folders and (k / f"{name}.SHA256SUMS").is_file():
            shutil.rmtree(k)
    shutil.rmtree(staging)
    print(f"{name}: {info['files']} files, {info['bytes']:,} bytes, in "
          f"{', '.join(map(str, folders))}", flush=True)
    return folders


def refused(t: tarfile.TarFile, dest: Path) -> list[str]:
    """The members of `t` that may not go into `dest`, each with why: absolute or `..` names,
    and what tarfile's "data" filter refuses (links out of DEST, devices, ...); on a Python
    without that filter (before 3.11.4), every member but regular files and folders (links,
    devices, FIFOs: keep.py packs none)."""
    out = []
    for m in t.getmembers():
        if m.name.startswith("/") or ".." in Path(m.name).parts:
            out.append(f"{m.name} (absolute or through ..)")
        elif hasattr(tarfile, "data_filter"):
            try:
                tarfile.data_filter(m, str(dest))
            except tarfile.FilterError as e:
                out.append(f"{m.name} ({e})")
        elif not (m.isfile() or m.isdir()):
            kind = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link",
                    tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device",
                    tarfile.FIFOTYPE: "a FIFO"}.get(m.type, f"tar type {m.type!r}")
            out.append(f"{m.name} ({kind}, not a regular file or folder)")
    return out


def unpack(tar: Path, dest: Path) -> Path:
    """TAR's folder into DEST (an earlier copy of that folder is replaced)."""
    with tarfile.open(tar) as t:
        top = {Path(m.name).parts[0] for m in t.getmembers()}
        bad = refused(t, dest)
        if len(top) != 1 or bad:
            raise SystemExit(f"{tar} is not one folder packed by keep.py pack"
                             + (f": {', '.join(bad)}" if bad else ""))
        folder = dest / top.pop()
        shutil.rmtree(folder, ignore_errors=True)
        dest.mkdir(parents=True, exist_ok=True)
        if hasattr(tarfile, "data_filter"):
            t.extractall(dest, filter="data")
        else:
            t.extractall(dest)  # refused() has refused absolute names, `..` and all but
            # regular files and folders
    return folder


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("src", type=Path)
    a.add_argument("name")
    a.add_argument("store", type=Path)
    a.add_argument("--part-bytes", type=int, default=SEND_PART)
    a.add_argument("--whole", action="store_true",
                   help="every file of SRC, no checkpoint needed (e.g. an exported draft)")
    a = sub.add_parser("send")
    a.add_argument("store", type=Path)
    a.add_argument("name")
    a.add_argument("out", type=Path)
    a.add_argument("--max-files", type=int, default=None,
                   help="at most this many parts (default: as many as fit in what OUT has "
                        "left of a call's 8 files and 64 MiB)")
    a.add_argument("--resend", default="", help="last, all, or part numbers such as 3,4,5: "
                   "send these again (a failed call's $OUT never came back)")
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
        print(json.dumps(pack(a.src, a.name, a.store, a.part_bytes, a.whole)), flush=True)
    elif a.cmd == "send":
        send(a.store, a.name, a.out, a.max_files, a.resend)
    elif a.cmd == "carry":
        carry(a.name, a.dest, a.dirs, a.part_bytes)
    else:
        print(unpack(a.tar, a.dest), flush=True)


if __name__ == "__main__":
    sys.exit(main())
