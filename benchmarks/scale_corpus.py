"""The scaling curve's corpus (benchmarks/scale.py): regenerated parts read as one id ->
conversation map, the seeded curve order over the training prompts, the ids regenerate
refused for good, and the nested subsets. A part that a regeneration beside the reader is
still writing counts up to its last complete line."""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import random
from pathlib import Path

# files a regeneration beside this process is still writing (--wait): their last line may be
# half-written, so only what ends in a newline counts; every other file must parse whole
LIVE = "regen-p"


def jsonl_lines(path: Path, raw: bytes | None = None) -> list[str]:
    """The file's complete lines (a live regeneration output is cut after its last newline,
    even inside a multi-byte character); `raw`: its bytes, if already read."""
    raw = path.read_bytes() if raw is None else raw
    data = gzip.decompress(raw) if path.suffix == ".gz" else raw
    if path.parent.parent.name.startswith(LIVE):
        data = data[:data.rfind(b"\n") + 1]
    return [line for line in data.decode("utf-8").split("\n") if line.strip()]


def read_corpus(patterns: list[str]) -> tuple[dict[str, str], list[dict]]:
    """id -> JSON line over every part (files in name order; the first row of an id wins),
    and per file its name, rows and sha256."""
    paths = sorted({Path(p) for pat in patterns for p in glob.glob(pat)},
                   key=lambda p: p.name)
    rows, files = {}, []
    for path in paths:
        raw = path.read_bytes()
        lines = jsonl_lines(path, raw)
        for line in lines:
            rows.setdefault(json.loads(line)["id"], line)
        files.append({"file": path.name, "rows": len(lines),
                      "sha256": hashlib.sha256(raw).hexdigest()})
    return rows, files


def curve_order(prompts: Path, seed: int) -> list[str]:
    """The ids of the training prompts in a seeded shuffle: size N is the first N."""
    ids = sorted(json.loads(line)["id"] for line in prompts.open() if line.strip())
    random.Random(seed).shuffle(ids)
    return ids


def sources_first(order: list[str], sources: list[str]) -> list[str]:
    """The curve order with the ids of `sources` (an id's first part) first, each group in
    the order's own order: size N is then N of those sources while they last."""
    chosen = set(sources)
    return [i for i in order if i.split("/")[0] in chosen] + \
        [i for i in order if i.split("/")[0] not in chosen]


# reject kinds that the same prompt meets again on any run; server errors and out-of-memory are
# retried (`--retry-rejects`), so their ids stay in the curve order
FINAL_REJECTS = ("length", "input", "empty")


def read_rejects(patterns: list[str]) -> set[str]:
    """Ids that eyas regenerate refused for good (its rejects.jsonl, kept beside each part as
    rejects-pNN-ROWS.jsonl; kinds FINAL_REJECTS): they never get an answer, so the curve order
    skips them (counted in the JSON) instead of every later size waiting for them."""
    out = set()
    for path in sorted({Path(p) for pat in patterns for p in glob.glob(pat)}):
        for line in jsonl_lines(path):
            row = json.loads(line)
            row_id = row.get("sample_id") or row.get("id")
            if row_id is not None and row.get("kind") in FINAL_REJECTS:
                out.add(str(row_id))
    return out


def available(order: list[str], corpus: dict[str, str]) -> int:
    """How many ids of the curve order have arrived without a gap."""
    n = 0
    while n < len(order) and order[n] in corpus:
        n += 1
    return n


def subset(order: list[str], corpus: dict[str, str], n: int) -> tuple[list[str], str]:
    """The first n conversations of the curve order and their fingerprint."""
    lines = [corpus[i] for i in order[:n]]
    return lines, hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def next_prompts(order: list[str], corpus: dict[str, str], prompts: Path, n: int) -> list[str]:
    """The JSON lines of the next n prompts of the curve order not yet in the corpus."""
    want = [i for i in order if i not in corpus][:n]
    rank = {i: r for r, i in enumerate(want)}
    lines = {}
    for line in prompts.open():
        if line.strip() and (row_id := json.loads(line)["id"]) in rank:
            lines[row_id] = line.rstrip("\n")
    return [lines[i] for i in want]
