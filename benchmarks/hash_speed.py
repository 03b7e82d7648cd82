"""sha256 speed of capture part files, as `eyas.store.integrity.check_parts` reads them:
16 MiB reads, one file per thread. Writes N files of M MiB into --dir, then hashes them with
1, 2, 8 and all-core threads, first right after writing (page cache), then, with --cold,
after asking the kernel to drop the files from the cache (posix_fadvise DONTNEED), i.e.
from the disk.

    python benchmarks/hash_speed.py --dir /nvme/tmp --files 8 --mb 1024 --cold
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eyas.store.integrity import PART_READ
from eyas.store.manifest import file_sha256


def sha256_file(path: Path) -> str:  # as eyas.store.integrity.check_parts hashes a part
    return file_sha256(path, PART_READ)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/eyas-hash-speed")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    block = os.urandom(64 << 20)
    for i in range(args.files):
        path = folder / f"part-{i}"
        with open(path, "wb") as f:
            for _ in range(max(1, args.mb // 64)):
                f.write(block)
        files.append(path)
    total = sum(p.stat().st_size for p in files) / 1e6
    cpus = os.cpu_count() or 1
    for cold in (False, True) if args.cold else (False,):
        for threads in sorted({1, 2, min(8, cpus), cpus}):
            if cold:
                for p in files:
                    drop_cache(p)
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(sha256_file, files))
            seconds = time.perf_counter() - start
            print(f"{'disk' if cold else 'page cache'}, {cpus} cpus, {threads} threads: "
                  f"{total / seconds:,.0f} MB/s ({args.files} x {args.mb} MiB)", flush=True)
    for p in files:
        p.unlink()


if __name__ == "__main__":
    main()
