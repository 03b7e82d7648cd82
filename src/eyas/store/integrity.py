"""Are a capture's part files the ones capture wrote? Sizes, headers, shapes and sha256.

`check_parts` runs wherever part files are about to be trusted: when train opens a capture
(`eyas.store.shards.open_capture`) and when capture resumes a shard. The cheap checks (the
file is where the index says, with the recorded size, a readable safetensors header and the
recorded shapes and dtypes) run on every part every time. The sha256 of a part is computed
once, over several threads, and remembered in the capture folder's `.verified.json` with the
file's size, inode, mtime and ctime: a part is hashed again as soon as any of those change (a
write into it, a copy, a restore), so a capture of many TB costs one read at the first train,
not one per run. Measured speed and the reasoning: docs/capture.md, "Checksums".
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eyas.errors import EyasError
from eyas.store.manifest import file_sha256, inside

log = logging.getLogger(__name__)

VERIFIED = ".verified.json"
# Threads hashing at once: sha256 runs ~1 GB/s per core, so on a fast disk more threads go
# faster (docs/capture.md, "Checksums": 5.7 GB/s with 8, 10.9 with 16 from the page cache)
HASH_THREADS = min(16, os.cpu_count() or 1)


PART_READ = 1 << 24  # bytes per read when hashing a part (benchmarks/hash_speed.py measures it)


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _read_verified(folder: Path) -> dict:
    try:
        return json.loads((folder / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}


def _remember(folder: Path, done: dict[str, dict]) -> None:
    """Add `done` to `.verified.json` (best effort: a read-only capture is hashed every time).
    Read, merge and replace under an exclusive lock: torchrun's ranks and parallel `--shard
    i/N` capture jobs each add their own parts to the same file."""
    import fcntl

    if not done:
        return
    tmp = folder / f"{VERIFIED}.{os.getpid()}.tmp"
    try:
        with open(folder / f"{VERIFIED}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            body = {**_read_verified(folder), **done}
            tmp.write_text(json.dumps(body, indent=0) + "\n")
            os.replace(tmp, folder / VERIFIED)
    except OSError as err:
        log.info("cannot record verified parts in %s (%s): they are hashed again next time",
                 folder, err)


def remember_written(folder: str | Path, name: str, sha256: str) -> None:
    """Record part `name`, just written and fsynced by this process with digest `sha256`
    (hashed from the bytes it wrote), as verified at its present stamp: capture's resume then
    hashes only the parts it did not write itself, or that changed since."""
    folder = Path(folder)
    _remember(folder, {name: {"stamp": _stamp(folder / name), "sha256": sha256}})


def _structure(path: Path, entry: dict) -> str | None:
    """What is wrong with a part's header (unreadable, other shapes or dtypes), or None."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            got = {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                   for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        return f"its safetensors header is unreadable ({str(err)[:120]})"
    shapes = {k: v[0] for k, v in got.items()}
    if entry.get("shapes") is not None and shapes != entry["shapes"]:
        return f"it holds shapes {shapes}, the index says {entry['shapes']}"
    return None


def check_parts(folder: str | Path, entries: list[dict], *, checksums: bool = True,
                rank: int = 0, world_size: int = 1) -> list[tuple[dict, str]]:
    """The parts among `entries` (index entries: file, bytes, sha256, shapes) that are missing
    or damaged, each with the reason. With `world_size` > 1 this rank hashes every
    `world_size`-th part only (the ranks share the reading); the cheap checks cover all."""
    folder = Path(folder)
    bad: list[tuple[dict, str]] = []
    to_hash: list[tuple[dict, Path]] = []
    verified = _read_verified(folder) if checksums else {}
    for j, e in enumerate(entries):
        path = inside(folder, e["file"], "the capture index")
        if not path.is_file():
            bad.append((e, "it is missing"))
        elif path.stat().st_size != e["bytes"]:
            bad.append((e, f"it has {path.stat().st_size} bytes, the index says {e['bytes']}"))
        elif checksums and j % world_size == rank and \
                verified.get(e["file"]) != {"stamp": _stamp(path), "sha256": e["sha256"]}:
            to_hash.append((e, path))
        elif (why := _structure(path, e)) is not None:
            bad.append((e, why))
    if not to_hash:
        return bad
    start, nbytes = time.perf_counter(), sum(e["bytes"] for e, _ in to_hash)
    with ThreadPoolExecutor(min(HASH_THREADS, len(to_hash))) as pool:
        stamps = [_stamp(p) for _, p in to_hash]  # before reading: a write meanwhile re-hashes
        digests = list(pool.map(lambda ep: file_sha256(ep[1], PART_READ), to_hash))
    seconds = time.perf_counter() - start
    log.info("checked sha256 of %d capture part(s), %.2f GB, in %.1f s (%.0f MB/s)",
             len(to_hash), nbytes / 1e9, seconds, nbytes / 1e6 / max(seconds, 1e-9))
    done = {}
    for (e, path), stamp, digest in zip(to_hash, stamps, digests):
        if digest != e["sha256"]:
            bad.append((e, "its sha256 differs from the one recorded when it was written "
                           "(the file changed on disk or in a copy)"))
        elif (why := _structure(path, e)) is not None:
            bad.append((e, why))
        else:
            done[e["file"]] = {"stamp": stamp, "sha256": digest}
    _remember(folder, done)
    return bad


def refuse_damaged(folder: str | Path, bad: list[tuple[dict, str]]) -> None:
    """Raise an EyasError naming each damaged part, why, and how to capture it again."""
    if not bad:
        return
    lines = [f"{e['file']}: {why}" for e, why in bad[:20]]
    if len(bad) > 20:
        lines.append(f"... and {len(bad) - 20} more")
    shards = sorted({f"{e['shard']}/{e['num_shards']}" for e, _ in bad})
    shown = "\n  - ".join(lines)
    raise EyasError(
        f"capture {folder} has damaged part files, refused:\n  - {shown}\n"
        f"To redo them, delete those files and run the same `eyas capture` command again "
        f"(--shard {', '.join(shards)}): it resumes, captures only their samples and rebuilds "
        f"the index. A part that is merely missing is recaptured the same way. In an `eyas "
        f"run` pipeline, delete them and run it again: it sees them gone and its capture "
        f"step resumes so.")
