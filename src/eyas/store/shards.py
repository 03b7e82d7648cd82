"""Capture shards on disk: file names, atomic writes, fp8 packing, index entries, the
set-aside reports, flattened batches, `verify`, and `open_capture`, the memory-mapped reader
that train uses. The part files themselves are written by eyas.store.shard_writer; each
shard's state file, capture's resume from it and `index.json` are eyas.store.shard_state's.

A capture folder (format in docs/architecture.md, "captured/") holds safetensors part files
`shard-{i:05d}-of-{n:05d}.part-{j:05d}.safetensors`, one small JSON state file per shard
(`shard-{i:05d}-of-{n:05d}.json`: its settings, finished parts, whether it is complete),
a report of samples set aside for non-finite values per shard, `index.json` and `eyas.json`.
Every file is written under a `.tmp` name and renamed once complete, so a killed job leaves
only whole files behind and a restart can trust every file it finds.
"""

from __future__ import annotations

import collections
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eyas.errors import EyasError
from eyas.store.integrity import check_parts, refuse_damaged
from eyas.store.manifest import MANIFEST, file_sha256, inside, read_manifest

FORMAT = "eyas-capture-v1"
INDEX = "index.json"
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
TOKEN_KEYS = ("aux_hidden", "final_hidden", "target_top1", "input_ids", "loss_mask")
# Every name a capture writes at the top of its folder (eyas.store.manifest.check_out)
FILES = ("shard-*-of-*.*", "set-aside-*-of-*.jsonl*", INDEX, INDEX + ".tmp", ".capture.lock",
         ".shard-*-of-*.lock", ".verified.json*")
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
    return q.float().mul_(scale.float()[..., None]).to(dtype)  # (one float32 copy, not two)


# ---------------------------------------------------------------------------------------------
# files, index entries and set-aside reports (eyas.store.shard_writer writes the part files)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


# torch dtype -> its safetensors name, for the part writer's headers and for reading them back
ST_DTYPES = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32",
             torch.float16: "F16", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8",
             torch.bool: "BOOL"}


def part_entry(name: str, tensors: dict[str, torch.Tensor], nbytes: int, digest: str) -> dict:
    """The index entry (shard state and index.json) of part file `name` holding `tensors`."""
    shard, num_shards, part = (int(x) for x in _PART_RE.match(name).groups())
    return {
        "file": name, "shard": shard, "num_shards": num_shards, "part": part,
        "samples": int(tensors["sample_index"].shape[0]),
        "tokens": int(tensors["input_ids"].shape[0]),
        "bytes": nbytes, "sha256": digest,
        "shapes": {k: list(v.shape) for k, v in sorted(tensors.items())},
        "dtypes": {k: str(v.dtype).replace("torch.", "") for k, v in sorted(tensors.items())},
    }


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


def merged_offsets(batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """(n+1,) sample offsets of the concatenated batches."""
    if len(batches) == 1:
        return batches[0]["sample_offsets"]
    starts = torch.tensor([0, *[int(b["sample_offsets"][-1]) for b in batches]]).cumsum(0)
    return torch.cat([batches[0]["sample_offsets"][:1],
                      *[b["sample_offsets"][1:] + starts[i] for i, b in enumerate(batches)]])


def merge_batches(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate flattened batches into one (offsets shifted, sample order kept)."""
    if len(batches) == 1:
        return batches[0]
    out = {k: torch.cat([b[k] for b in batches]) for k in batches[0] if k != "sample_offsets"}
    out["sample_offsets"] = merged_offsets(batches)
    return out


# ---------------------------------------------------------------------------------------------
# verification


def verify(folder: str | Path, *, checksums: bool = True) -> dict[str, Any]:
    """Check a finished capture: every shard complete, files present with the recorded sizes,
    sha256 (if `checksums`), shapes and dtypes, and every prepared row captured exactly once
    (or set aside in a non-finite report). Returns the index; raises EyasError listing problems."""
    folder = Path(folder)
    manifest, index = _read_capture(folder)
    problems: list[str] = []
    if any(not c for c in index["shards"].values()):
        problems.append(_unfinished(index))
    hidden, num_aux = manifest["hidden_size"], len(manifest["aux_layer_ids"])
    seen: list[torch.Tensor] = []
    for e in index["files"]:
        path = inside(folder, e["file"], INDEX)
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


def read_index(folder: Path) -> dict[str, Any]:
    """The capture's index.json, checked for the fields readers use: a damaged or edited one
    is an EyasError naming it, not a KeyError wherever a field is first read."""
    path = folder / INDEX
    try:
        index = json.loads(path.read_text())
        wrong = [] if isinstance(index, dict) else [f"a JSON {type(index).__name__}"]
        if not wrong:
            wrong = [f"{key} missing or not a JSON {kind.__name__}"
                     for key, kind in (("complete", bool), ("shards", dict), ("num_shards", int),
                                       ("files", list))
                     if not isinstance(index.get(key), kind)]
        if not wrong:
            wrong = [f"files[{j}] lacks {key}" for j, e in enumerate(index["files"])
                     for key in ("file", "bytes", "sha256", "samples", "tokens")
                     if not isinstance(e, dict) or key not in e][:3]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        wrong = [str(err)]
    if wrong:
        raise EyasError(f"{path} is damaged ({'; '.join(wrong)}); eyas writes it whole, so "
                        f"something else changed or cut it. Restore it, or capture again into "
                        f"a new --out")
    return index


def _read_capture(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A capture folder's manifest and index, each checked; one wording for `open_capture`
    and `verify`."""
    manifest = read_manifest(folder, step="capture")
    _check_capture_manifest(folder, manifest)
    if not (folder / INDEX).is_file():
        raise EyasError(f"{folder} has no {INDEX}; the capture did not finish. Re-run "
                        f"`eyas capture` with the same flags to resume it.")
    return manifest, read_index(folder)


def _unfinished(index: dict[str, Any]) -> str:
    missing = [i for i, c in index["shards"].items() if not c]
    n = index["num_shards"]
    return (f"shards {missing} of {n} are not finished; run `eyas capture ... --shard I/{n}` "
            f"for each (it resumes where it stopped)")


def _check_capture_manifest(folder: Path, manifest: dict) -> None:
    """The capture manifest's fields that reading the parts needs, refused by name where an
    edit broke them."""
    ids = manifest.get("aux_layer_ids")
    wrong = [] if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids) else \
        ["aux_layer_ids is not a list of layer ids"]
    if not isinstance(manifest.get("hidden_size"), int) or manifest["hidden_size"] <= 0:
        wrong.append("hidden_size is not a positive integer")
    if manifest.get("dtype") not in ("bf16", "fp8"):
        wrong.append(f"dtype {manifest.get('dtype')!r} is neither bf16 nor fp8")
    if manifest.get("split") not in ("train", "eval", "all"):
        wrong.append(f"split {manifest.get('split')!r} is not train, eval or all")
    elif manifest["split"] == "all" and not (
            isinstance(manifest.get("split_rows"), dict) and manifest["split_rows"]
            and all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r)
                    for r in manifest["split_rows"].values())):
        wrong.append("split_rows is not each split's [start, end) row range")
    if wrong:
        raise EyasError(f"{folder / MANIFEST} is damaged ({'; '.join(wrong)}); eyas writes it "
                        f"whole, so something else changed it. Restore it, or capture again "
                        f"into a new --out")


def open_capture(folder: str | Path, *, checksums: bool = True) -> CaptureSet:
    """Open a finished capture folder for reading, refusing damaged parts (`check_parts`:
    size, header and shapes always; sha256 once per file version if `checksums`; under
    torch.distributed each rank hashes its share). `.verify()` also checks every row."""
    folder = Path(folder)
    manifest, index = _read_capture(folder)
    if not index["complete"]:
        raise EyasError(f"capture {folder} is incomplete: {_unfinished(index)}")
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and \
        dist.is_initialized() else (0, 1)
    bad = check_parts(folder, index["files"], checksums=checksums, rank=rank, world_size=world)
    if world > 1:  # a part only one rank hashed fails every rank, with the same message
        everyone: list = [None] * world
        dist.all_gather_object(everyone, bad)
        bad = list({e["file"]: (e, why) for part in everyone for e, why in part}.values())
    refuse_damaged(folder, bad)
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
        self._lock = threading.Lock()

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

    def sample(self, i: int, dtype: torch.dtype = torch.bfloat16, *,
               copy: bool = True, dequantize: bool = True) -> dict[str, torch.Tensor]:
        """Sample i's tensors. safetensors >= 0.8 slices are views of the whole part file's
        mapped storage, and torch.save or a multiprocessing queue would carry all of it (a
        1 GB part per sample): so each tensor is its own copy unless `copy=False` (for a
        caller that copies them anyway, as training's collate does). An fp8 capture's
        aux_hidden is dequantized to `dtype` unless `dequantize=False`: then it stays fp8,
        with its scales as `aux_scale` (N, A) (training dequantizes on the GPU, where it costs
        nothing; on a CPU it is ~95 ms per 8K tokens of a 576-wide target)."""
        f = self._handle(int(self._file_of[i]))
        s, e = int(self._start[i]), int(self._end[i])
        out = {k: f.get_slice(k)[s:e] for k in TOKEN_KEYS}
        if self.dtype == "fp8" and not dequantize:
            out["aux_scale"] = f.get_slice("aux_scale")[s:e]
        elif self.dtype == "fp8":
            out["aux_hidden"] = dequantize_fp8(out["aux_hidden"], f.get_slice("aux_scale")[s:e], dtype)
        else:
            out["aux_hidden"] = out["aux_hidden"].to(dtype)
        out["final_hidden"] = out["final_hidden"].to(dtype)
        if copy:
            out = {k: v.clone() if v.untyped_storage().nbytes() > v.numel() * v.element_size()
                   else v for k, v in out.items()}
        out["sample_index"] = self.sample_index[i].clone()
        return out

    def verify(self, *, checksums: bool = True) -> dict[str, Any]:
        return verify(self.folder, checksums=checksums)

    def _handle(self, fi: int):
        with self._lock:  # training's loader threads share the open files
            if self._pid != os.getpid():  # a forked process: never share mmaps across fork
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
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
