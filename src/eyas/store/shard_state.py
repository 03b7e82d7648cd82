"""Capture's per-shard bookkeeping: each shard's state file (`shard-{i:05d}-of-{n:05d}.json`)
and what capture does with it to resume a shard: the settings check, recovering finished parts
from disk and dropping damaged ones, taking set-aside rows out of the report to capture them
again, the rows already done, and `build_index`, which combines the state files into
`index.json`.

File names, formats and the set-aside report are eyas.store.shards'; the part files are written
by eyas.store.shard_writer.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eyas.errors import EyasError
from eyas.store.integrity import check_parts
from eyas.store.manifest import MANIFEST, file_sha256
from eyas.store.shards import (FORMAT, INDEX, ST_DTYPES, part_entry, part_sample_index, read_report,
                               report_name, state_name, write_json_atomic)

log = logging.getLogger(__name__)


def read_state(folder: Path, shard: int, num_shards: int) -> dict[str, Any] | None:
    path = Path(folder) / state_name(shard, num_shards)
    return json.loads(path.read_text()) if path.is_file() else None


def all_states(folder: Path) -> list[dict[str, Any]]:
    """Every shard state file in `folder` (any shard count), sorted by shard; a file of that
    name that capture did not write is refused by name."""
    states = []
    for path in sorted(Path(folder).glob("shard-*-of-*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            state = None
        if not isinstance(state, dict) or state.get("format") != FORMAT or \
                path.name != state_name(state.get("shard", -1), state.get("num_shards", -1)):
            raise EyasError(f"{path} is damaged (cut short, edited) or not a shard state "
                            f"written by `eyas capture` (no {FORMAT!r} format, or another "
                            f"shard's name), so its shard cannot be resumed from it; move it "
                            f"out of {folder} (the shard's part files are then checked against "
                            f"this run's settings, and captured again where they differ) or "
                            f"capture into another --out.", flag="--out")
        states.append(state)
    return sorted(states, key=lambda s: (s["num_shards"], s["shard"]))


def recover_parts(folder: Path, shard: int, num_shards: int,
                  known: list[dict] | None, settings: dict | None = None) -> list[dict[str, Any]]:
    """Index entries of this shard's complete part files, after removing unfinished `.tmp` files.

    `known` are the entries the state file lists; a part renamed just before a kill is not
    listed yet and is hashed here instead. A listed part of another size than written (cut
    short, replaced), an unlisted one that cannot be opened, and an unlisted one whose own
    header says other layers or another dtype than `settings` (this run's: a part left by a
    capture with other settings whose state file is gone) are removed, named in a warning
    (their samples are captured again).
    """
    folder = Path(folder)
    prefix = f"shard-{shard:05d}-of-{num_shards:05d}."
    for tmp in folder.glob(prefix + "part-*.tmp"):
        tmp.unlink()
    by_name = {e["file"]: e for e in (known or [])}
    entries = []
    for path in sorted(folder.glob(prefix + "part-*.safetensors")):
        entry, why = by_name.get(path.name), None
        if entry is not None and entry["bytes"] != path.stat().st_size:
            why = f"it has {path.stat().st_size} bytes, {entry['bytes']} were written"
        elif entry is None:
            try:
                why = _other_settings(path, settings or {}) or None
                entry = None if why else _describe_existing(path)
            except Exception as err:  # noqa: BLE001 - any unreadable file is redone, never trusted
                why = f"it cannot be read ({str(err)[:120]})"
        if why is not None:
            log.warning("%s: %s; deleting it, its samples are captured again", path.name, why)
            path.unlink()
            continue
        entries.append(entry)
    return entries


def _other_settings(path: Path, settings: dict) -> str:
    """How an unlisted part's own header (the layers and dtype capture writes into it)
    differs from this run's `settings` ("" where it does not, or does not say)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    now = {"aux_layer_ids": ",".join(map(str, settings.get("aux_layer_ids") or [])) or None,
           "dtype": settings.get("dtype")}
    differ = [f"{k} {meta[k]} (this run: {v})" for k, v in now.items()
              if v is not None and k in meta and meta[k] != v]
    return f"it was captured with {', '.join(differ)}" if differ else ""


def _describe_existing(path: Path) -> dict[str, Any]:
    """Index entry of a complete part file found on disk (hashes it; reads only headers)."""
    with safe_open(str(path), framework="pt") as f:
        fake = {k: torch.empty(f.get_slice(k).get_shape(), dtype=_slice_dtype(f, k), device="meta")
                for k in f.keys()}
    return part_entry(path.name, fake, path.stat().st_size, file_sha256(path))


def _slice_dtype(f, key: str) -> torch.dtype:
    return {name: dtype for dtype, name in ST_DTYPES.items()}[f.get_slice(key).get_dtype()]


def retry_set_aside(folder: Path, state: dict, retry) -> None:
    """Take the rows of this shard's set-aside report for which `retry(row)` holds out of it
    (rewritten atomically; its count in `state` too), so that they are captured again: rows
    set aside for a setting the user has since changed (vLLM's --max-model-len)."""
    keep, again = [], []
    for r in read_report(folder, state["shard"], state["num_shards"]):
        (again if retry(r) else keep).append(r)
    if not again:
        return
    log.info("%d row(s) set aside before as too long for vLLM's max_model_len %s are captured "
             "again", len(again), sorted({r.get("max_model_len") for r in again}))
    path = Path(folder) / report_name(state["shard"], state["num_shards"])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)
    state["nonfinite"] = len(keep)
    write_json_atomic(folder / state_name(state["shard"], state["num_shards"]), state)


def check_settings(folder: Path, settings: dict, num_shards: int, *,
                   overwrite: bool = False) -> tuple[list[dict], list[str]]:
    """The shard states in `folder` made with other settings or another shard count, and how
    they differ; EyasError naming the differences unless `overwrite` (they are deleted then).
    Capture asks before it loads the target too (from the target's config)."""
    clash = [s for s in all_states(folder)
             if s["settings"] != settings or s["num_shards"] != num_shards]
    if not clash:
        return [], []
    old = clash[0]
    keys = [_differs(k, old["settings"].get(k), settings[k])
            for k in settings if old["settings"].get(k) != settings[k]]
    if old["num_shards"] != num_shards:
        keys.append(f"shard count {old['num_shards']} there, {num_shards} now")
    if not overwrite:
        raise EyasError(f"{folder} already holds a capture made with other settings "
                        f"({'; '.join(keys)}); resume it with the same flags, use another "
                        f"--out, or pass --overwrite to delete it.", flag="--out")
    return clash, keys


def start_shard(folder: Path, shard: int, num_shards: int, settings: dict, rows: int, *,
                overwrite: bool = False) -> dict[str, Any]:
    """This shard's state, with its finished parts recovered from disk, after checking that
    `folder` holds nothing captured with other settings (deleted instead if `overwrite`)."""
    folder = Path(folder)
    clash, keys = check_settings(folder, settings, num_shards, overwrite=overwrite)
    if clash:
        log.warning("--overwrite: deleting the capture in %s made with other settings (%s): "
                    "%d shard(s)", folder, "; ".join(keys), len(clash))
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
    state["parts"] = recover_parts(folder, shard, num_shards, state["parts"], settings)
    state["nonfinite"] = len(read_report(folder, shard, num_shards))
    state["complete"] = False
    write_json_atomic(folder / state_name(shard, num_shards), state)
    return state


def _differs(key: str, there: Any, now: Any) -> str:
    """How setting `key` differs, for a message: each differing entry of a record (the
    target's: weights_fingerprint, ...), or the two values, cut to a line."""
    def short(value: Any) -> str:
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."

    if isinstance(there, dict) and isinstance(now, dict):
        return f"{key} " + ", ".join(
            f"{k} {short(there.get(k))} there, {short(now.get(k))} now"
            for k in sorted(set(there) | set(now)) if there.get(k) != now.get(k))
    return f"{key}: {short(there)} there, {short(now)} now"


def drop_damaged(folder: Path, state: dict) -> None:
    """Capture's resume: remove this shard's parts that fail `check_parts` (sha256, header,
    size) from disk and from `state`, so their samples are captured again."""
    bad = check_parts(folder, state["parts"])
    for e, why in bad:
        log.warning("%s: %s; deleting it, its %d samples are captured again", e["file"], why,
                    e["samples"])
        (Path(folder) / e["file"]).unlink(missing_ok=True)
    names = {e["file"] for e, _ in bad}
    state["parts"] = [e for e in state["parts"] if e["file"] not in names]


def done_rows(folder: Path, state: dict) -> set[int]:
    """Rows this shard already captured (in its finished parts) or set aside."""
    done: set[int] = set()
    for e in state["parts"]:
        done.update(part_sample_index(folder, e["file"]).tolist())
    done.update(r["sample_index"] for r in read_report(folder, state["shard"], state["num_shards"]))
    return done


# ---------------------------------------------------------------------------------------------
# the index


def build_index(folder: Path) -> dict[str, Any]:
    """Combine the shard state files into `index.json`'s content (every shard's finished files)."""
    states = all_states(folder)
    if not states:
        raise EyasError(f"{folder} holds no capture shards; run `eyas capture --out {folder}`.",
                        flag="--out")
    first = states[0]
    for s in states[1:]:
        if s["settings"] != first["settings"] or s["num_shards"] != first["num_shards"]:
            raise EyasError(f"{folder} mixes captures made with different settings or --shard "
                            f"counts ({state_name(s['shard'], s['num_shards'])} vs "
                            f"{state_name(first['shard'], first['num_shards'])}); capture into "
                            f"an empty --out folder.", flag="--out")
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
