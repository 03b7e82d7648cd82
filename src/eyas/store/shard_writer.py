"""Writing capture part files: `write_part` / `write_part_tmp`, which stream tensors into a
safetensors file without copying them and hash the same memory on a second thread, and
`PartWriter`, the background writer capture hands its batches to.

Formats and file names are eyas.store.shards' (docs/architecture.md, "captured/"): every file is
written under a `.tmp` name, fsynced and renamed once complete, and a shard's parts are
recorded in its state file strictly in part order, so a killed run leaves parts 0..k.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.store.integrity import remember_written
from eyas.store.shards import (FORMAT, ST_DTYPES, drop_samples, merged_offsets, part_entry, part_name,
                               report_name, state_name, write_json_atomic)


def write_part(folder: Path, name: str, tensors: dict[str, torch.Tensor] | list[dict],
               metadata: dict[str, str], timings: dict[str, float] | None = None) -> dict:
    """Write one part file atomically (`name.tmp`, fsync, rename) and return its index entry.
    `tensors` may be a list of flattened batches: the part is their concatenation."""
    entry = write_part_tmp(folder, name, tensors, metadata, timings)
    os.replace(Path(folder) / (name + ".tmp"), Path(folder) / name)
    return entry


def write_part_tmp(folder: Path, name: str, tensors: dict[str, torch.Tensor] | list[dict],
                   metadata: dict[str, str], timings: dict[str, float] | None = None) -> dict:
    """Write `name.tmp` in safetensors format, fsync it, return its index entry (sha256 of the
    bytes written); the caller renames it. Adds seconds per stage to `timings` if given.

    Why not `safetensors.torch.save_file`: depending on its version it copies every tensor
    to `bytes` first, it needs one dict (so batches would be concatenated: another copy), and
    the sha256 would then have to re-read the file. Here the header is built from the format
    spec (8-byte little-endian header length, JSON header, tensors back to back, largest
    element size first so every tensor is aligned) and the tensors' own memory is handed to
    `os.write`, while a second thread hashes the same memory. Both release the GIL. The files
    are read back with safetensors itself; the tests check that.
    """
    batches = [tensors] if isinstance(tensors, dict) else list(tensors)
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    head, chunks, merged = _layout(batches, metadata)
    digest: dict[str, Any] = {}
    hasher = threading.Thread(target=_sha256_into, args=([head, *chunks], digest),
                              name="eyas-sha256", daemon=True)
    hasher.start()
    tmp = Path(folder) / (name + ".tmp")
    t1 = time.perf_counter()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk in (memoryview(head), *chunks):
            _write_all(fd, chunk)
        t2 = time.perf_counter()
        os.fsync(fd)  # the rename must never name a file whose bytes are not on disk yet
    finally:
        os.close(fd)
    t3 = time.perf_counter()
    hasher.join()
    t4 = time.perf_counter()
    if "error" in digest:
        raise digest["error"]
    for key, seconds in (("layout", t1 - t0), ("write", t2 - t1), ("fsync", t3 - t2),
                         ("hash", digest["seconds"]), ("hash_wait", t4 - t3)):
        timings[key] = timings.get(key, 0.0) + seconds
    return part_entry(name, merged, len(head) + sum(c.nbytes for c in chunks), digest["hex"])


def _layout(batches: list[dict[str, torch.Tensor]], metadata: dict[str, str]):
    """(header bytes, data chunks in file order, {key: meta tensor of the merged shape}) of the
    concatenation of `batches` along dim 0, `sample_offsets` re-based. No tensor data is copied."""
    first = batches[0]
    keys = sorted(first, key=lambda k: (-first[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    chunks: list[memoryview] = []
    merged: dict[str, torch.Tensor] = {}
    offset = 0
    for key in keys:
        parts = ([merged_offsets(batches)] if key == "sample_offsets"
                 else [b[key] for b in batches])
        shape = [sum(int(p.shape[0]) for p in parts), *first[key].shape[1:]]
        views = [_bytes_of(p) for p in parts]
        size = sum(v.nbytes for v in views)
        header[key] = {"dtype": ST_DTYPES[first[key].dtype], "shape": shape,
                       "data_offsets": [offset, offset + size]}
        merged[key] = torch.empty(shape, dtype=first[key].dtype, device="meta")
        chunks.extend(v for v in views if v.nbytes)
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # spaces pad the header so the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text, chunks, merged


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without copying it (if it is contiguous)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        data = data[os.write(fd, data[: 1 << 30]):]  # one call writes at most ~2 GiB on Linux


def _sha256_into(chunks: list, out: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    try:
        h = hashlib.sha256()
        for chunk in chunks:
            h.update(chunk)
        out["hex"] = h.hexdigest()
    except BaseException as err:  # noqa: BLE001 - re-raised by the writing thread
        out["error"] = err
    out["seconds"] = time.perf_counter() - t0


class PartWriter:
    """Writes one shard's part files in background threads, so that copying into the page
    cache, fsync and sha256 overlap the next forward and each other.

    `put(event, batch, sample_ids)` hands over a flattened host batch (whose device-to-host
    copy may still be running until `event`). A collector thread sets aside samples with a
    `nonfinite` token (in the shard's report) and cuts a part every `file_bytes`; up to
    `threads` parts are then written at once (`write_part_tmp`), but renamed into place and
    recorded in the shard state strictly in part order, so the finished parts of a killed
    run are always parts 0..k and nothing but `.tmp` files is left half-written. In flight at
    most: 2 queued batches, one part being collected, `threads` parts being written."""

    def __init__(self, folder: Path, state: dict, file_bytes: int, metadata: dict[str, str],
                 threads: int = 3):
        self.folder, self.state, self.file_bytes = Path(folder), state, file_bytes
        self.metadata = {"format": FORMAT, **metadata}
        self.next_part = max((e["part"] for e in state["parts"]), default=-1) + 1
        self.next_commit = self.next_part
        self.pending: list[dict] = []
        self.pending_bytes = 0
        self.bytes_written = 0
        self.busy_s = 0.0       # summed over the writing threads (may exceed wall time)
        self.put_wait_s = 0.0   # time the caller spent blocked in `put`: storage falling behind
        self.timings: dict[str, float] = {}  # seconds per stage, summed over parts
        self.files_written = 0
        # Test hook: SIGKILL this process right after the N-th part file is renamed into place
        # (before the shard state lists it), to test resume after a real crash.
        self.kill_after = int(os.environ.get("EYAS_TEST_KILL_AFTER_FILES", "0") or 0)
        self.error: BaseException | None = None
        self.cond = threading.Condition()  # guards commits, error, counters
        self.slots = threading.Semaphore(threads)  # parts being written: bounds host memory
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="eyas-part")
        self.queue: queue.Queue = queue.Queue(maxsize=2)  # bounds pinned memory in flight
        self.thread = threading.Thread(target=self._loop, name="eyas-capture-writer", daemon=True)
        self.thread.start()

    def put(self, event, batch: dict[str, torch.Tensor], sample_ids: list[str]) -> None:
        t0 = time.perf_counter()
        self._put((event, batch, sample_ids))
        self.put_wait_s += time.perf_counter() - t0

    def close(self) -> None:
        """Write what is pending, wait for every part, re-raise the first error if any."""
        self._put(None, closing=True)
        self.thread.join()
        if self.error is not None:
            raise self._failed() from self.error

    def _put(self, item, closing: bool = False) -> None:
        while True:
            if self.error is not None and not closing:
                raise self._failed() from self.error
            try:
                self.queue.put(item, timeout=1.0)
                return
            except queue.Full:
                continue

    def _failed(self) -> EyasError:
        """The writer thread's error, with the way on where the disk is full: the parts
        written are kept, and capture resumes from them."""
        full = isinstance(self.error, OSError) and self.error.errno in (errno.ENOSPC,
                                                                         errno.EDQUOT)
        return EyasError(f"writing capture parts into {self.folder} failed: {self.error!r}"
                         + ("; free some space there, then run the same command again: it "
                            "resumes after the parts already written" if full else ""))

    def _fail(self, err: BaseException) -> None:
        with self.cond:
            self.error = self.error or err
            self.cond.notify_all()

    def _loop(self) -> None:
        closed = False
        try:
            while (item := self.queue.get()) is not None:
                event, batch, sample_ids = item
                if event is not None:
                    t0 = time.perf_counter()
                    event.synchronize()
                    self._add_time("copy_wait", time.perf_counter() - t0)
                self._add(batch, sample_ids)
            closed = True
            self._submit()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            self._fail(err)
            while not closed and self.queue.get() is not None:  # never block the producer
                pass
        finally:
            self.pool.shutdown(wait=True)

    def _add(self, batch: dict[str, torch.Tensor], sample_ids: list[str]) -> None:
        bad = batch.pop("nonfinite")
        if bool(bad.any()):
            rows = batch["sample_index"].tolist()
            batch, dropped = drop_samples(batch, bad)
            with open(self.folder / report_name(self.state["shard"], self.state["num_shards"]),
                      "a") as f:
                for i in dropped:
                    f.write(json.dumps({"sample_index": rows[i], "sample_id": sample_ids[i],
                                        "reason": "NaN or Inf in the captured hidden states"})
                            + "\n")
                f.flush()
                os.fsync(f.fileno())
            with self.cond:
                self.state["nonfinite"] += len(dropped)
        if batch["sample_index"].numel():
            self.pending.append(batch)
            self.pending_bytes += sum(v.numel() * v.element_size() for v in batch.values())
        if self.pending_bytes >= self.file_bytes:
            self._submit()

    def _submit(self) -> None:
        """Hand the pending batches to a writing thread as the next part (waits for a slot)."""
        if not self.pending:
            return
        self.slots.acquire()
        if self.error is not None:
            self.slots.release()
            raise self.error
        part, batches = self.next_part, self.pending
        self.next_part += 1
        self.pending, self.pending_bytes = [], 0
        self.pool.submit(self._write, part, [batches])

    def _write(self, part: int, holder: list[list[dict]]) -> None:
        try:
            t0 = time.perf_counter()
            timings: dict[str, float] = {}
            name = part_name(self.state["shard"], self.state["num_shards"], part)
            # popped, so the host memory is freed before waiting for earlier parts' commits
            entry = write_part_tmp(self.folder, name, holder.pop(), self.metadata, timings)
            t1 = time.perf_counter()
            with self.cond:
                while self.next_commit != part and self.error is None:
                    self.cond.wait()
                if self.error is not None:
                    return  # an earlier part failed; this one stays a .tmp (removed on resume)
                t2 = time.perf_counter()
                self._commit(name, entry)
                self.next_commit += 1
                for key, seconds in (*timings.items(), ("order_wait", t2 - t1),
                                     ("commit", time.perf_counter() - t2)):
                    self.timings[key] = self.timings.get(key, 0.0) + seconds
                self.busy_s += time.perf_counter() - t0 - (t2 - t1)
                self.cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            self._fail(err)
        finally:
            self.slots.release()

    def _commit(self, name: str, entry: dict) -> None:
        """Rename a written part into place and record it in the shard state (holding `cond`)."""
        os.replace(self.folder / (name + ".tmp"), self.folder / name)
        remember_written(self.folder, name, entry["sha256"])  # its resume need not re-hash it
        self.files_written += 1
        self.bytes_written += entry["bytes"]
        if self.kill_after and self.files_written >= self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        self.state["parts"].append(entry)
        write_json_atomic(self.folder / state_name(self.state["shard"], self.state["num_shards"]),
                          self.state)

    def _add_time(self, key: str, seconds: float) -> None:
        with self.cond:
            self.timings[key] = self.timings.get(key, 0.0) + seconds
