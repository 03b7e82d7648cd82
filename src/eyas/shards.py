"""Capture shards on disk: file names, atomic writes, fp8 packing, the index, `verify`, and
`open_capture`, the memory-mapped reader that train uses.

A capture folder (format in docs/architecture.md, "captured/") holds safetensors part files
`shard-{i:05d}-of-{n:05d}.part-{j:05d}.safetensors`, one small JSON state file per shard
(`shard-{i:05d}-of-{n:05d}.json`: its settings, finished parts, whether it is complete),
a report of samples set aside for non-finite values per shard, `index.json` and `eyas.json`.
Every file is written under a `.tmp` name and renamed once complete, so a killed job leaves
only whole files behind and a restart can trust every file it finds.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import queue
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eyas.errors import EyasError
from eyas.manifest import MANIFEST, read_manifest

FORMAT = "eyas-capture-v1"
INDEX = "index.json"
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
TOKEN_KEYS = ("aux_hidden", "final_hidden", "target_top1", "input_ids", "loss_mask")
_PART_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.part-(\d{5})\.safetensors$")


def part_name(shard: int, num_shards: int, part: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}.part-{part:05d}.safetensors"


def state_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}.json"


def report_name(shard: int, num_shards: int) -> str:
    return f"set-aside-{shard:05d}-of-{num_shards:05d}.jsonl"


# ---------------------------------------------------------------------------------------------
# fp8 storage of aux states


def quantize_fp8(aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, A, H) float -> (N, A, H) float8_e4m3fn and (N, A) float32 scales, one per token per layer.

    Each row is scaled so its largest magnitude lands on 448 (e4m3's largest value), which keeps
    the ~2 significant digits e4m3 has for the bulk of the row. All-zero rows get scale 1.
    """
    amax = aux.abs().amax(dim=-1).float()                                   # (N, A)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))    # (N, A)
    q = torch.empty(aux.shape, dtype=torch.float8_e4m3fn, device=aux.device)
    for a in range(aux.shape[1]):  # one layer at a time: an fp32 copy of all three is large
        q[:, a] = (aux[:, a].float() / scale[:, a, None]).clamp_(-FP8_MAX, FP8_MAX)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize_fp8`: (N, A, H) fp8 and (N, A) scales -> (N, A, H) `dtype`."""
    return (q.float() * scale.float()[..., None]).to(dtype)


# ---------------------------------------------------------------------------------------------
# writing


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


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
    return _entry(name, merged, len(head) + sum(c.nbytes for c in chunks), digest["hex"])


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32",
              torch.float16: "F16", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8",
              torch.bool: "BOOL"}


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
        parts = ([_merged_offsets(batches)] if key == "sample_offsets"
                 else [b[key] for b in batches])
        shape = [sum(int(p.shape[0]) for p in parts), *first[key].shape[1:]]
        views = [_bytes_of(p) for p in parts]
        size = sum(v.nbytes for v in views)
        header[key] = {"dtype": _ST_DTYPES[first[key].dtype], "shape": shape,
                       "data_offsets": [offset, offset + size]}
        merged[key] = torch.empty(shape, dtype=first[key].dtype, device="meta")
        chunks.extend(v for v in views if v.nbytes)
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # spaces pad the header so the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text, chunks, merged


def _merged_offsets(batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """(n+1,) sample offsets of the concatenated batches."""
    if len(batches) == 1:
        return batches[0]["sample_offsets"]
    starts = torch.tensor([0, *[int(b["sample_offsets"][-1]) for b in batches]]).cumsum(0)
    return torch.cat([batches[0]["sample_offsets"][:1],
                      *[b["sample_offsets"][1:] + starts[i] for i, b in enumerate(batches)]])


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


def _entry(name: str, tensors: dict[str, torch.Tensor], nbytes: int, digest: str) -> dict:
    shard, num_shards, part = (int(x) for x in _PART_RE.match(name).groups())
    return {
        "file": name, "shard": shard, "num_shards": num_shards, "part": part,
        "samples": int(tensors["sample_index"].shape[0]),
        "tokens": int(tensors["input_ids"].shape[0]),
        "bytes": nbytes, "sha256": digest,
        "shapes": {k: list(v.shape) for k, v in sorted(tensors.items())},
        "dtypes": {k: str(v.dtype).replace("torch.", "") for k, v in sorted(tensors.items())},
    }


def _describe_existing(path: Path) -> dict[str, Any]:
    """Index entry of a complete part file found on disk (hashes it; reads only headers)."""
    with safe_open(str(path), framework="pt") as f:
        fake = {k: torch.empty(f.get_slice(k).get_shape(), dtype=_slice_dtype(f, k), device="meta")
                for k in f.keys()}
    return _entry(path.name, fake, path.stat().st_size, file_sha256(path))


def _slice_dtype(f, key: str) -> torch.dtype:
    return {name: dtype for dtype, name in _ST_DTYPES.items()}[f.get_slice(key).get_dtype()]


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# per-shard state (used for resume and for completeness)


def read_state(folder: Path, shard: int, num_shards: int) -> dict[str, Any] | None:
    path = Path(folder) / state_name(shard, num_shards)
    return json.loads(path.read_text()) if path.is_file() else None


def all_states(folder: Path) -> list[dict[str, Any]]:
    """Every shard state file in `folder` (any shard count), sorted by shard."""
    states = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("shard-*-of-*.json"))]
    return sorted(states, key=lambda s: (s["num_shards"], s["shard"]))


def recover_parts(folder: Path, shard: int, num_shards: int,
                  known: list[dict] | None) -> list[dict[str, Any]]:
    """Index entries of this shard's complete part files, after removing unfinished `.tmp` files.

    `known` are the entries the state file lists; a part renamed just before a kill is not
    listed yet and is hashed here instead. A part that cannot be opened is removed (its
    samples are captured again).
    """
    folder = Path(folder)
    prefix = f"shard-{shard:05d}-of-{num_shards:05d}."
    for tmp in folder.glob(prefix + "part-*.tmp"):
        tmp.unlink()
    by_name = {e["file"]: e for e in (known or [])}
    entries = []
    for path in sorted(folder.glob(prefix + "part-*.safetensors")):
        entry = by_name.get(path.name)
        if entry is None or entry["bytes"] != path.stat().st_size:
            try:
                entry = _describe_existing(path)
            except Exception:  # noqa: BLE001 - any unreadable file is redone, never trusted
                path.unlink()
                continue
        entries.append(entry)
    return entries


def part_sample_index(folder: Path, name: str) -> torch.Tensor:
    with safe_open(str(Path(folder) / name), framework="pt") as f:
        return f.get_tensor("sample_index")


def read_report(folder: Path, shard: int | None = None, num_shards: int | None = None) -> list[dict]:
    """Samples set aside for non-finite values (one shard, or all); a torn last line is skipped."""
    names = ([report_name(shard, num_shards)] if shard is not None
             else [p.name for p in sorted(Path(folder).glob("set-aside-*.jsonl"))])
    rows = []
    for name in names:
        path = Path(folder) / name
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def start_shard(folder: Path, shard: int, num_shards: int, settings: dict, rows: int, *,
                overwrite: bool = False) -> dict[str, Any]:
    """This shard's state, with its finished parts recovered from disk, after checking that
    `folder` holds nothing captured with other settings (deleted instead if `overwrite`)."""
    folder = Path(folder)
    clash = [s for s in all_states(folder)
             if s["settings"] != settings or s["num_shards"] != num_shards]
    if clash and not overwrite:
        old = clash[0]
        keys = [k for k in settings if old["settings"].get(k) != settings[k]]
        if old["num_shards"] != num_shards:
            keys.append(f"shard count {old['num_shards']} vs {num_shards}")
        raise EyasError(f"{folder} already holds a capture made with other settings ({keys}); "
                        f"resume it with the same flags, use another --out, or pass --overwrite "
                        f"to delete it.")
    for old in clash:
        prefix = f"shard-{old['shard']:05d}-of-{old['num_shards']:05d}"
        for path in [*folder.glob(prefix + ".*"), folder / report_name(old["shard"], old["num_shards"])]:
            path.unlink(missing_ok=True)
    if clash:
        for name in (INDEX, MANIFEST):
            (folder / name).unlink(missing_ok=True)
    state = read_state(folder, shard, num_shards) or {
        "format": FORMAT, "shard": shard, "num_shards": num_shards, "settings": settings,
        "rows": rows, "complete": False, "parts": [], "nonfinite": 0}
    state["parts"] = recover_parts(folder, shard, num_shards, state["parts"])
    state["nonfinite"] = len(read_report(folder, shard, num_shards))
    state["complete"] = False
    write_json_atomic(folder / state_name(shard, num_shards), state)
    return state


def done_rows(folder: Path, state: dict) -> set[int]:
    """Rows this shard already captured (in its finished parts) or set aside."""
    done: set[int] = set()
    for e in state["parts"]:
        done.update(part_sample_index(folder, e["file"]).tolist())
    done.update(r["sample_index"] for r in read_report(folder, state["shard"], state["num_shards"]))
    return done


# ---------------------------------------------------------------------------------------------
# flattened batches: a dict of per-token tensors plus sample_offsets (n+1,), sample_index (n,)


def flagged_samples(offsets: torch.Tensor, bad_tokens: torch.Tensor) -> torch.Tensor:
    """(n,) bool: which samples (delimited by `offsets` (n+1,)) have a flagged token."""
    counts = torch.cat([torch.zeros(1, dtype=torch.int64, device=bad_tokens.device),
                        bad_tokens.long().cumsum(0)])                      # (N+1,)
    off = offsets.to(bad_tokens.device)
    return (counts[off[1:]] - counts[off[:-1]]) > 0


def drop_samples(batch: dict[str, torch.Tensor], bad_tokens: torch.Tensor):
    """Remove every sample that has a flagged token (`bad_tokens` (N,) bool) from a batch.

    Returns (batch without them, positions of the removed samples within the batch)."""
    off = batch["sample_offsets"].cpu()
    bad_sample = flagged_samples(off, bad_tokens.cpu())                    # (n,)
    keep = (~bad_sample).nonzero().flatten()
    lengths = (off[1:] - off[:-1])[keep]
    token_idx = (torch.cat([torch.arange(int(off[i]), int(off[i + 1])) for i in keep.tolist()])
                 if keep.numel() else torch.zeros(0, dtype=torch.int64))
    out = {}
    for k, v in batch.items():
        if k == "sample_offsets":
            out[k] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(v.device)
        elif k == "sample_index":
            out[k] = v[keep.to(v.device)]
        else:
            out[k] = v.index_select(0, token_idx.to(v.device))
    return out, bad_sample.nonzero().flatten().tolist()


def merge_batches(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate flattened batches into one (offsets shifted, sample order kept)."""
    if len(batches) == 1:
        return batches[0]
    out = {k: torch.cat([b[k] for b in batches]) for k in batches[0] if k != "sample_offsets"}
    out["sample_offsets"] = _merged_offsets(batches)
    return out


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
            raise EyasError(f"writing capture parts into {self.folder} failed: "
                            f"{self.error!r}") from self.error

    def _put(self, item, closing: bool = False) -> None:
        while True:
            if self.error is not None and not closing:
                raise EyasError(f"writing capture parts into {self.folder} failed: "
                                f"{self.error!r}") from self.error
            try:
                self.queue.put(item, timeout=1.0)
                return
            except queue.Full:
                continue

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


# ---------------------------------------------------------------------------------------------
# index and verification


def build_index(folder: Path) -> dict[str, Any]:
    """Combine the shard state files into `index.json`'s content (every shard's finished files)."""
    states = all_states(folder)
    if not states:
        raise EyasError(f"{folder} holds no capture shards; run `eyas capture --out {folder}`.")
    first = states[0]
    for s in states[1:]:
        if s["settings"] != first["settings"] or s["num_shards"] != first["num_shards"]:
            raise EyasError(f"{folder} mixes captures made with different settings or --shard "
                            f"counts ({state_name(s['shard'], s['num_shards'])} vs "
                            f"{state_name(first['shard'], first['num_shards'])}); capture into "
                            f"an empty --out folder.")
    n = first["num_shards"]
    complete = {i: False for i in range(n)}
    files: list[dict] = []
    for s in states:
        complete[s["shard"]] = bool(s["complete"])
        files.extend(s["parts"])
    files.sort(key=lambda e: (e["shard"], e["part"]))
    return {
        "format": FORMAT, "settings": first["settings"], "num_shards": n,
        "shards": {str(i): c for i, c in complete.items()}, "complete": all(complete.values()),
        "rows": sum(s["rows"] for s in states) if len(states) == n else None,
        "num_samples": sum(e["samples"] for e in files),
        "num_tokens": sum(e["tokens"] for e in files),
        "num_bytes": sum(e["bytes"] for e in files),
        "nonfinite": sum(s.get("nonfinite", 0) for s in states),
        "files": files,
    }


def verify(folder: str | Path, *, checksums: bool = True) -> dict[str, Any]:
    """Check a finished capture: every shard complete, files present with the recorded sizes,
    sha256 (if `checksums`), shapes and dtypes, and every prepared row captured exactly once
    (or set aside in a non-finite report). Returns the index; raises EyasError listing problems."""
    folder = Path(folder)
    manifest = read_manifest(folder, step="capture")
    index_path = folder / INDEX
    if not index_path.is_file():
        raise EyasError(f"{folder} has no {INDEX}; finish the capture (re-run `eyas capture` with "
                        f"the same flags; it resumes).")
    index = json.loads(index_path.read_text())
    problems: list[str] = []
    missing = [i for i, c in index["shards"].items() if not c]
    if missing:
        problems.append(f"shards {missing} of {index['num_shards']} are not finished: run "
                        f"`eyas capture ... --shard I/{index['num_shards']}` for each (it resumes)")
    hidden, num_aux = manifest["hidden_size"], len(manifest["aux_layer_ids"])
    seen: list[torch.Tensor] = []
    for e in index["files"]:
        path = folder / e["file"]
        if not path.is_file():
            problems.append(f"{e['file']} is missing")
            continue
        if path.stat().st_size != e["bytes"]:
            problems.append(f"{e['file']} has {path.stat().st_size} bytes, index says {e['bytes']}")
            continue
        if checksums and file_sha256(path) != e["sha256"]:
            problems.append(f"{e['file']} fails its sha256 check (corrupt copy?)")
            continue
        problems.extend(_check_part(path, e, hidden, num_aux, manifest["dtype"]))
        seen.append(part_sample_index(folder, e["file"]))
    set_aside = torch.tensor([r["sample_index"] for r in read_report(folder)], dtype=torch.int64)
    problems.extend(_check_rows(torch.cat([*seen, set_aside]), index.get("rows")))
    if problems:
        shown = "\n  - ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise EyasError(f"capture {folder} failed verification:\n  - {shown}{more}")
    return index


def _check_part(path: Path, entry: dict, hidden: int, num_aux: int, dtype: str) -> list[str]:
    bad = []
    with safe_open(str(path), framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        n, t = entry["samples"], entry["tokens"]
        want = {"aux_hidden": [t, num_aux, hidden], "final_hidden": [t, hidden],
                "target_top1": [t], "input_ids": [t], "loss_mask": [t],
                "sample_offsets": [n + 1], "sample_index": [n]}
        if dtype == "fp8":
            want["aux_scale"] = [t, num_aux]
        for k, shape in want.items():
            if shapes.get(k) != shape:
                bad.append(f"{path.name}: {k} has shape {shapes.get(k)}, expected {shape}")
        if f.get_slice("aux_hidden").get_dtype() != {"bf16": "BF16", "fp8": "F8_E4M3"}[dtype]:
            bad.append(f"{path.name}: aux_hidden is {f.get_slice('aux_hidden').get_dtype()}, "
                       f"manifest says {dtype}")
        if not bad:
            off = f.get_tensor("sample_offsets")
            if off[0] != 0 or off[-1] != t or bool((off[1:] <= off[:-1]).any()):
                bad.append(f"{path.name}: sample_offsets are not increasing from 0 to {t}")
    return bad


def _check_rows(rows: torch.Tensor, expected: int | None) -> list[str]:
    """Every row 0..expected-1 exactly once across all files and reports."""
    if expected is None:
        return ["the shard state files do not cover every shard"]
    counts = torch.bincount(rows, minlength=expected) if rows.numel() else torch.zeros(expected)
    problems = []
    if counts.numel() > expected:
        problems.append(f"rows beyond the prepared split's {expected} rows were captured")
    dup = (counts[:expected] > 1).nonzero().flatten()
    lost = (counts[:expected] == 0).nonzero().flatten()
    if dup.numel():
        problems.append(f"{dup.numel()} rows captured more than once, e.g. {dup[:5].tolist()}")
    if lost.numel():
        problems.append(f"{lost.numel()} rows were never captured, e.g. {lost[:5].tolist()}")
    return problems


# ---------------------------------------------------------------------------------------------
# reading for training


def open_capture(folder: str | Path) -> CaptureSet:
    """Open a finished capture folder for reading (no checksums; call `.verify()` for those)."""
    folder = Path(folder)
    manifest = read_manifest(folder, step="capture")
    if not (folder / INDEX).is_file():
        raise EyasError(f"{folder} has no {INDEX}; the capture did not finish. Re-run "
                        f"`eyas capture` with the same flags to resume it.")
    index = json.loads((folder / INDEX).read_text())
    if not index["complete"]:
        missing = [i for i, c in index["shards"].items() if not c]
        raise EyasError(f"capture {folder} is incomplete: shards {missing} of "
                        f"{index['num_shards']} are not finished; run `eyas capture ... --shard "
                        f"I/{index['num_shards']}` for each (it resumes where it stopped).")
    return CaptureSet(folder, manifest, index)


class CaptureSet:
    """Random access to the samples of a capture folder, memory-mapped through safetensors.

    `sample(i)` returns one whole sample: `aux_hidden` (T, 3, H) and `final_hidden` (T, H) in
    `dtype` (fp8 files are dequantised), `target_top1`/`input_ids` (T,) int32, `loss_mask`
    (T,) uint8 and `sample_index` (the row in the prepared split). Samples are numbered in
    file order, which is by decreasing length within each batch, not the prepared order.
    """

    max_open_files = 64

    def __init__(self, folder: Path, manifest: dict, index: dict):
        self.folder = Path(folder)
        self.manifest = manifest
        self.index = index
        self.aux_layer_ids = tuple(manifest["aux_layer_ids"])
        self.hidden_size = int(manifest["hidden_size"])
        self.dtype = manifest["dtype"]
        self.split_rows = manifest.get("split_rows", {})
        self._files = [e["file"] for e in index["files"]]
        file_of, starts, ends, rows = [], [], [], []
        for fi, name in enumerate(self._files):
            with safe_open(str(self.folder / name), framework="pt") as f:
                off = f.get_tensor("sample_offsets")
                rows.append(f.get_tensor("sample_index"))
            file_of.append(torch.full((off.numel() - 1,), fi, dtype=torch.int32))
            starts.append(off[:-1])
            ends.append(off[1:])
        empty = torch.zeros(0, dtype=torch.int64)
        self._file_of = torch.cat(file_of) if file_of else empty.int()
        self._start = torch.cat(starts) if starts else empty
        self._end = torch.cat(ends) if ends else empty
        self.sample_index = torch.cat(rows) if rows else empty     # (num_samples,) prepared row
        self.sample_lengths = self._end - self._start               # (num_samples,) tokens
        self._handles: collections.OrderedDict = collections.OrderedDict()
        self._pid = os.getpid()

    @property
    def num_samples(self) -> int:
        return int(self.sample_index.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.sample_lengths.sum())

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.sample(i)

    def positions(self, split: str) -> torch.Tensor:
        """Sample numbers (for `sample`) whose prepared row belongs to `split` of a --split all
        capture; for a single-split capture, all samples if `split` is that split."""
        if self.manifest["split"] != "all":
            if split != self.manifest["split"]:
                raise EyasError(f"{self.folder} holds the {self.manifest['split']} split, not "
                                f"{split}; capture it with `eyas capture --split {split}`.")
            return torch.arange(self.num_samples)
        lo, hi = self.split_rows[split]
        return ((self.sample_index >= lo) & (self.sample_index < hi)).nonzero().flatten()

    def sample(self, i: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        f = self._handle(int(self._file_of[i]))
        s, e = int(self._start[i]), int(self._end[i])
        out = {k: f.get_slice(k)[s:e] for k in TOKEN_KEYS}
        if self.dtype == "fp8":
            out["aux_hidden"] = dequantize_fp8(out["aux_hidden"], f.get_slice("aux_scale")[s:e], dtype)
        else:
            out["aux_hidden"] = out["aux_hidden"].to(dtype)
        out["final_hidden"] = out["final_hidden"].to(dtype)
        out["sample_index"] = self.sample_index[i].clone()
        return out

    def verify(self, *, checksums: bool = True) -> dict[str, Any]:
        return verify(self.folder, checksums=checksums)

    def _handle(self, fi: int):
        if self._pid != os.getpid():  # a DataLoader worker: never share mmaps across fork
            self._handles = collections.OrderedDict()
            self._pid = os.getpid()
        if fi in self._handles:
            self._handles.move_to_end(fi)
            return self._handles[fi]
        handle = safe_open(str(self.folder / self._files[fi]), framework="pt")
        self._handles[fi] = handle
        if len(self._handles) > self.max_open_files:
            self._handles.popitem(last=False)
        return handle

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = collections.OrderedDict()
        return state
