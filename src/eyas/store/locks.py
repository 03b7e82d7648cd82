"""One writer per output folder: an exclusive, non-blocking flock held while a process writes.

Two `eyas train` runs on one --out (a scheduler's requeue while the old job still runs, a
command started twice) trained side by side and overwrote each other's checkpoints and
metrics, and a resume could delete the live run's newer checkpoints. A flock goes with the
process that holds it, SIGKILL included, so a killed run never leaves a stale lock behind.
(Capture's shards have their own locks: eyas.capture.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from eyas.errors import EyasError


@contextlib.contextmanager
def exclusive(path: str | Path, busy: str):
    """Hold an exclusive flock on `path` (created, with its folder, if missing) for the block;
    EyasError(`busy`) at once if another process holds it. A folder made here that holds
    nothing but the lock afterwards (a run refused before writing) is removed again."""
    path = Path(path)
    made = not path.parent.exists()  # removed again if the block leaves nothing else there
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _held(path, busy):
            yield
    finally:
        if made and [p.name for p in path.parent.iterdir()] == [path.name]:
            path.unlink(missing_ok=True)
            path.parent.rmdir()


@contextlib.contextmanager
def _held(path: Path, busy: str):
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EyasError(busy) from None
        try:
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")  # who holds it, for a user who looks
            f.flush()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def holder(path: str | Path) -> str | None:
    """The process id written in lock file `path` while another process holds its lock (None
    where the file is missing or nobody holds it). Takes the lock for an instant to tell."""
    try:
        f = open(path, "r")
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "?"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def main_process() -> bool:
    """Whether this process writes for its job: not a torchrun rank other than 0 (a job's ranks
    share one --out, and only rank 0 writes there)."""
    return int(os.environ.get("RANK", "0")) == 0
