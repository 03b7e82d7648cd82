"""Time of `eyas.store.manifest.weights_fingerprint` on a checkpoint with as many tensors as a
big one: writes --files safetensors files of --tensors tensors each (--kib KiB of random
bytes per tensor, so the folder fits a small disk), then fingerprints it warm (page cache)
and cold (the files dropped from the page cache with posix_fadvise DONTNEED), with the
default number of readers and with one.

    python benchmarks/weights_fingerprint.py --dir /tmp/eyas-wfp --files 64 --tensors 3000

Kimi-K2.5 (61 layers, 384 experts, INT4 with scales) has ~2 x 10^5 tensors in 64 files:
`--files 64 --tensors 3000`. Its tensors are megabytes apart, these are --kib apart; the
fingerprint turns readahead off, so each sample is its own read either way, but a disk
seeks further on the real checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from eyas.store import manifest
from hash_speed import drop_cache  # benchmarks/hash_speed.py


def write_folder(folder: Path, files: int, tensors: int, kib: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(files):
        path = folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        if path.is_file():
            continue
        n = kib * 1024
        header = {f"layers.{i}.t{j}.weight": {"dtype": "U8", "shape": [n],
                                               "data_offsets": [j * n, (j + 1) * n]}
                  for j in range(tensors)}
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(path.with_suffix(".tmp"), "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            for _ in range(0, tensors, 256):
                f.write(rng.integers(0, 256, size=min(256, tensors) * n, dtype=np.uint8)
                        .tobytes())
            f.truncate(8 + len(blob) + tensors * n)
        os.replace(path.with_suffix(".tmp"), path)


def timed(folder: Path, cold: bool) -> tuple[float, str]:
    if cold:
        for path in folder.glob("*.safetensors"):
            drop_cache(path)
    manifest._WEIGHTS_SEEN.clear()
    t = time.perf_counter()
    fp = manifest.weights_fingerprint(folder)
    return time.perf_counter() - t, fp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/eyas-wfp")
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--tensors", type=int, default=3000)
    ap.add_argument("--kib", type=int, default=16)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    folder = Path(args.dir)
    write_folder(folder, args.files, args.tensors, args.kib)
    rows = []
    for readers in (manifest.WEIGHT_READERS, 1):
        manifest.WEIGHT_READERS = readers
        for cold in (True, False):
            seconds, fp = timed(folder, cold)
            rows.append({"readers": readers, "cold": cold, "seconds": round(seconds, 3),
                         "fingerprint": fp})
            print(json.dumps(rows[-1]), flush=True)
    result = {"files": args.files, "tensors": args.files * args.tensors, "kib": args.kib,
              "bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
              "cpus": os.cpu_count(), "runs": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
