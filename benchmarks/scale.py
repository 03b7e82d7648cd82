"""The scaling curve of issue 31 (item 4): eyas train's default recipe on nested subsets of
one regenerated corpus, each draft measured by `eyas eval` beside n-gram; resumable across
leases that each start bare.

    python benchmarks/scale.py --target smol-hf --data realdata --corpus 'corpus/*.jsonl*' \
        --work /tmp/w/scale --out results/scale-smollm2.json --sizes 3000,6000,12000,25000,50000

The corpus arrives in parts: `conversations*.jsonl` or `.jsonl.gz` files written by
`eyas regenerate` (`--regenerate N` below writes the next part). Its order is the curve
order: a seeded shuffle of the ids of `--data`/train.jsonl (that file is sorted by source,
so a prefix of it would be a few BIG-bench tasks). Size N trains on the first N ids of the
curve order, and runs only once all of them have arrived: the subsets are nested, and one
never changes as the corpus grows. Rows whose id is not in train.jsonl are not used.
`--sources-first sharegpt,chitchat` moves those sources' ids to the head of the order (each
part in the shuffle's order): a curve of that data mix, in its own --out and size folders.
`--order corpus` makes the order of the corpus itself: a seeded shuffle of every answered id
but those of --data's eval prompts (indist, indist_chat, heldout) and of its held-out sources
(left out, counted in the JSON), for a corpus whose prompts train.jsonl no longer lists (BIG-bench's sdist left PyPI,
so a train.jsonl made today lacks the corpus's 26,943 BIG-bench conversations); `--sizes all`
is then the whole corpus. Its own --out and size folders too (the order's fingerprint in the
JSON: another corpus or --data is another order); nothing is regenerated.

Per size, in its own folder: prepare -> capture -> vocab -> train (eyas train's defaults,
`--train-args` on top) -> export, then one `eyas eval` per prompt set group, at k = `--k`:
  indist     --data/indist.jsonl (and indist_chat.jsonl when present): train's sources
  heldout    --data/heldout.jsonl: whole sources training never sees
  bench      --bench mt-bench,gsm8k,humaneval, greedy
  bench-t1   --bench mt-bench --temperature 1 (exact rejection sampling), greedy drafts
             (vLLM's default draft_sample_method), sets named SET-t1
  bench-t1p  the same with --draft-sampling probabilistic (what docs/eval.md advises to
             serve at T > 0), sets named SET-t1p; with --t1-sampling probabilistic
n-gram is measured once per prompt set (with the first draft that meets it: it does not
depend on the draft) and stored at the top of the JSON.

At once (`--jobs N`, `--eval-jobs M`): a 135M target leaves one GPU mostly idle, so N sizes
train side by side and each runs M of its evals side by side (every step is its own process;
the JSON is changed and written under one lock, and n-gram is measured by the first eval of a
prompt set that starts). A size that fails is reported at the end; the others go on.
Disk: a size deletes its capture shards once its draft is exported and recorded
(`--keep-captures` keeps them), and its capture waits until what it has still to write (its
estimated bytes, less what a killed run left) is free beside what the captures running at
once have still to write (`--disk-wait S`), so sizes side by side take turns on a disk that
holds one of them. A capture fails at once when no size beside it will free disk (every
other size waits too, or keeps its captures: `--keep-captures`, or a training that failed).
`--exec-args` passes eyas train flags that change how it runs, not what it learns
(`--cuda-graph`, `--compile`, `--num-workers N`, ...; anything else is refused): like
`--capture-dtype`, they are recorded per size and sizes recorded without them stand.
Each size's and lever variant's record holds `recipe`: every option eyas train learns by, as
this eyas resolves `--train-args` (and the variant's flags) with its defaults. A record
whose recipe differs from today's is trained again, with what changed printed, so a change of
eyas train's defaults never leaves a curve of two recipes; flags that resolve to the same
recipe keep the records. A record from before recipes were recorded (the curve's 3 K-24 K
points, the 3 K and 12 K levers) is judged as its `--train-args` under today's defaults with
the assistant's positions (`BEFORE_RECIPES`: sessions 14-45 trained so), so today's default
trains such a size again and `--train-args '--loss-mask-at input'` keeps it. A run folder is
resumed only when made for the same recipe (its mark, else its run's own manifest); the
prepared, captured and vocab folders beside it are kept for any recipe (made for the subset,
`--capture-dtype`, the target and `--dtype`), so a new recipe trains on the captures already
there.
`--sizes ''` only regenerates (`--regenerate N`) and leaves the JSON alone, so a vLLM
regeneration can run beside the sizes' process; with `--wait S` that process counts the rows
the regeneration has written so far (WORK/regen-pNN/out/conversations.jsonl) and starts each
size as soon as its rows are there, re-reading every 30 s for up to S seconds. Ids that
`eyas regenerate` rejected (rejects-pNN-N.jsonl beside each part) leave the curve order.

The levers (issue 31 item 5, `--levers 'NAME=FLAGS;...' --lever-sizes N`): variants of the
recipe, each eyas train flags on top of --train-args (`NAME=` alone: the recipe itself, a
control in the same call), trained side by side (`--lever-jobs`) at size N from one capture of
its subset (WORK/levers-N) and measured by `--lever-evals`; the JSON's `levers` holds them, and
the table compares each with the control and with the curve's own point at N.

Resume: the result JSON is the state. Each finished step (training, each eval) is written
into it at once, with what it was run on (the subset's fingerprint, the recipe, the eval's
settings, the draft's id); a later call given the same --out skips every record that still
matches and runs the rest. Sizes run smallest first. A size whose draft is gone (a new lease)
but whose evals are not all done is trained again, and its old evals dropped, unless its
exported draft was carried back into WORK/size-N/draft.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import math
import os
import random
import shlex
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from real_model import _device, done_before, run  # noqa: E402  (the same CLI runner)
from scale_corpus import (available, curve_order, next_prompts, read_corpus,  # noqa: E402
                          read_rejects, sources_first, subset)
from scale_report import markdown, plot  # noqa: E402

POLL_S = 30.0  # --wait: seconds between reads of the corpus
PLOT_EVERY_S = 60.0  # the plot is redrawn at most this often while sizes run

def mix(a) -> list[str]:
    """--sources-first's sources, sorted (their order in the list changes nothing)."""
    return sorted({x for x in a.sources_first.split(",") if x})


def _mix(a) -> str:
    """A size folder's suffix for a curve order with --sources-first or --order corpus (its
    own folders, so that a curve of another order can run beside the default one in one work
    folder)."""
    sources = mix(a)
    return ("-" + "+".join(sources) if sources else "") + \
        ("-corpus" if a.order == "corpus" else "")


def eval_ids(data: Path) -> tuple[set[str], set[str]]:
    """The ids of --data's eval prompts (indist, indist_chat, heldout) and the held-out
    sources (a held-out id without its last "/" part: heldout.jsonl holds whole sources): an
    order made from the corpus leaves out both, so that no size trains on a prompt, or a
    held-out source, that it is measured on."""
    ids, held_out = set(), set()
    names = [n for n in ("indist.jsonl", "indist_chat.jsonl", "heldout.jsonl")
             if (data / n).is_file()]
    if "heldout.jsonl" not in names or "indist.jsonl" not in names:
        raise SystemExit(f"--order corpus leaves out --data's eval prompts, and {data} has no "
                         f"indist.jsonl or heldout.jsonl: pass real_data.py's folder")
    for name in names:
        rows = [json.loads(line)["id"] for line in (data / name).open() if line.strip()]
        ids |= set(rows)
        if name == "heldout.jsonl":
            held_out |= {i.rsplit("/", 1)[0] for i in rows if "/" in i}
    return ids, held_out


def corpus_order(corpus: dict[str, str], left_out: set[str], held_out: set[str],
                 seed: int) -> list[str]:
    """--order corpus: every answered id of the corpus but `left_out` and those of the
    `held_out` sources, in a seeded shuffle (as curve_order shuffles train.jsonl's ids)."""
    ids = sorted(i for i in corpus if i not in left_out and i.rsplit("/", 1)[0] not in held_out)
    random.Random(seed).shuffle(ids)
    return ids


def regenerate_part(a, order: list[str], corpus: dict[str, str], files: list[dict]) -> Path:
    """`eyas regenerate` on the next --regenerate prompts; the answers become a new part
    conversations-pNN-ROWS.jsonl.gz beside the others (parts sort in arrival order)."""
    prompts = Path(a.data) / "train.jsonl"
    todo = next_prompts(order, corpus, prompts, a.regenerate)
    index = sum(1 for f in files if f["file"].startswith("conversations-p")) + 1
    part = Path(a.corpus_dir) / f"conversations-p{index:02d}-{len(todo)}.jsonl.gz"
    work = Path(a.work) / f"regen-p{index:02d}"
    work.mkdir(parents=True, exist_ok=True)
    (work / "prompts.jsonl").write_text("".join(line + "\n" for line in todo))
    start = time.perf_counter()
    try:
        run("regenerate", "--target", a.target, "--data", work / "prompts.jsonl", "--out",
            work / "out", *shlex.split(a.regen_args), log=work / "log.txt", out=work / "out")
    except SystemExit:  # eyas regenerate fails a run whose every row it rejected
        refused = read_rejects([str(work / "out/rejects.jsonl")])
        if not todo or not {json.loads(line)["id"] for line in todo} <= refused:
            raise
        print(f"every one of the {len(todo)} prompts was rejected for good (kept in the "
              f"rejects file)", flush=True)
    part.parent.mkdir(parents=True, exist_ok=True)

    def publish(src: Path, name: str, gz: bool = False) -> None:
        """Copy into the corpus folder under a name no glob there matches, then rename: a
        process reading the folder (--wait) never sees half a file."""
        tmp = part.with_name(f".{name}.tmp")
        with src.open("rb") as f, (gzip.open(tmp, "wb") if gz else tmp.open("wb")) as dst:
            shutil.copyfileobj(f, dst)
        os.replace(tmp, part.with_name(name))

    if (work / "out/rejects.jsonl").is_file():  # first: the part's ids are then all accounted
        publish(work / "out/rejects.jsonl",
                part.name.replace("conversations-", "rejects-").replace(".jsonl.gz", ".jsonl"))
    publish(work / "out/eyas.json", part.name.replace(".jsonl.gz", "-eyas.json"))
    publish(work / "out/conversations.jsonl", part.name, gz=True)
    print(f"regenerated {len(todo)} prompts in {time.perf_counter() - start:.0f} s -> {part}",
          flush=True)
    return part


# -- disk ------------------------------------------------------------------------------------

DISK_POLL_S = 30.0  # seconds between looks at the free disk while a capture waits for it
_DISK = threading.Lock()
_IMPORTS = threading.Lock()
# keyed by size (int), or 'N levers' for size N's shared lever capture
_CAPTURING: dict[int | str, tuple[Path, int]] = {}  # key -> capture folder, estimated bytes
_FREEING: set[int | str] = set()  # captures deleted once their drafts are recorded
_WAITING: set[int | str] = set()  # captures that wait for the disk (they free none yet)


def capture_bytes(target: str, tokens: int, dtype: str = "bf16") -> int:
    """What `eyas capture --dtype DTYPE` (EAGLE-3's three aux states) writes for `tokens`
    tokens of `target`, with 2 % and 1 GiB to spare."""
    with _IMPORTS:  # transformers' lazy imports from two threads at once fail ("module
        # 'transformers' has no attribute 'AutoConfig'", a size and its levers in a CPU run)
        from eyas.doctor import capture_bytes_per_token
        from eyas.targets.models import load_config, text_config

        hidden = int(text_config(load_config(target)).hidden_size)
    per_token = capture_bytes_per_token(hidden)["fp8_aux" if dtype == "fp8" else "bf16"]
    return int(tokens * per_token * 1.02) + 2**30


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def written(folder: Path) -> int:
    """Bytes of the files under `folder` (0 when it does not exist). A running capture writes
    each file under a temporary name and renames it: a file gone between the listing and its
    size is skipped (it is counted under its new name next time)."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


@contextlib.contextmanager
def disk_for(n: int | str, captured: Path, estimate: int, wait: float):
    """Hold the capture of size n into `captured` until its file system has free what the
    capture has still to write (its estimate less what a killed run left there), besides
    what the captures running beside it have still to write. A size that has exported its
    draft deletes its captures: a capture waits up to `wait` seconds for that, and fails at
    once, before writing, when no size beside it will free any disk."""
    deadline, told = time.monotonic() + wait, False
    while True:
        with _DISK:
            _WAITING.discard(n)
            need = max(0, estimate - written(captured))
            if need == 0:  # written whole before (the manifest is what is missing)
                break
            others = sum(max(0, e - written(c)) for m, (c, e) in _CAPTURING.items() if m != n)
            free = free_bytes(captured.parent) - others
            if free >= need:
                _CAPTURING[n] = (captured, estimate)
                break
            hope = bool(_FREEING - _WAITING - {n})
            _WAITING.add(n)
        if not hope or time.monotonic() >= deadline:
            with _DISK:
                _WAITING.discard(n)
            why = f"after {wait:.0f} s (--disk-wait)" if hope else \
                "and no size beside it will free any"
            raise SystemExit(f"size {n}: its capture needs ~{need / 1e9:.1f} GB and "
                             f"{max(free, 0) / 1e9:.1f} GB are free {why}; free disk under "
                             f"{captured.parent}, run fewer --jobs, --capture-dtype fp8 or "
                             f"--online")
        if not told:
            print(f"size {n}: capture waits for {need / 1e9:.1f} GB of disk "
                  f"({max(free, 0) / 1e9:.1f} GB free beside the other captures)", flush=True)
            told = True
        time.sleep(DISK_POLL_S)
    try:
        yield
    finally:  # what it wrote now counts in the disk's own free space
        with _DISK:
            _CAPTURING.pop(n, None)


# -- one size ---------------------------------------------------------------------------------

def eval_plan(a) -> dict[str, tuple[list, list[str]]]:
    """eval name -> (eyas eval arguments, the prompt sets it reports)."""
    data = Path(a.data)
    plan = {"indist": (["--data", data / "indist.jsonl"], ["indist"])}
    if (data / "indist_chat.jsonl").is_file():
        plan["indist-chat"] = (["--data", data / "indist_chat.jsonl"], ["indist-chat"])
    plan["heldout"] = (["--data", data / "heldout.jsonl"], ["heldout"])
    if a.bench:
        plan["bench"] = (["--bench", a.bench], a.bench.split(","))
    for sampling in a.t1_sampling if a.t1_bench else ():
        name = T1_EVALS[sampling]
        plan[f"bench-{name}"] = (["--bench", a.t1_bench, "--temperature", "1"] + (
            ["--draft-sampling", sampling] if sampling != "greedy" else []),
            [f"{s}-{name}" for s in a.t1_bench.split(",")])
    return plan


def eval_settings(a) -> str:
    return (f"k={a.k} prompts={a.prompts} bench_prompts={a.bench_prompts} "
            f"tokens={a.eval_tokens} dtype={a.dtype}")


class Book:
    """The result JSON that sizes and evals running at once share: every change to it and
    every write of it under one lock, and the prompt sets whose n-gram an eval has taken on."""

    def __init__(self, state: dict, write):
        self.state, self._write = state, write
        self.lock = threading.Lock()
        self.ngram_taken: set[str] = set()

    @contextlib.contextmanager
    def change(self):
        """The state, changed under the lock; the JSON is written when the block ends."""
        with self.lock:
            yield self.state
            self._write()

    def save(self) -> None:
        with self.change():
            pass

    def take_ngram(self, sets: list[str]) -> bool:
        """True for the first eval of prompt sets that have no n-gram record yet, or one
        without its tokens per step (recorded since session 27)."""
        with self.lock:
            todo = [s for s in sets if "tokens_per_step" not in self.state["ngram"].get(s, {})
                    and s not in self.ngram_taken]
            self.ngram_taken.update(todo)
            return bool(todo)


# eyas train's options that say where it reads and writes, how its states arrive (online or
# captured, as --capture-dtype: not the recipe), or how it runs rather than what it learns
# (EXEC_FLAGS' options, below, and the device); every other option resolved is the recipe
NOT_RECIPE = ("data", "out", "vocab", "target", "revision", "trust_remote_code",
              "accept_other_weights", "target_device_map", "online", "online_cache",
              "online_cache_dtype", "online_cache_gb", "device", "resume")
# what eyas train's defaults differed by from today's before records held their recipe:
# sessions 14-45 trained speculators' recipe with the assistant's positions
BEFORE_RECIPES = ["--loss-mask-at=input"]


def _not_recipe() -> set[str]:
    return {*NOT_RECIPE, *(f.lstrip("-").removeprefix("no-").replace("-", "_")
                           for f in EXEC_FLAGS)}


def train_recipe(a, flags: list[str] = (), train_args: str | None = None) -> dict:
    """Every option eyas train learns by for --train-args (or `train_args`) then `flags`, the
    unset ones as this eyas resolves them (its defaults), so that a record trained before a
    change of eyas train's defaults is known for another recipe even where --train-args are
    the same. Parsed as train_export passes them (--exec-args and --vocab too), so flags eyas
    train refuses are refused here."""
    from eyas.cli import parse_config
    from eyas.config import to_dict

    source = ["--online", "--target", a.target] if a.online else []
    args = a.train_args if train_args is None else train_args
    cfg = parse_config("train", ["--data", "-", "--out", "-", *source, "--vocab", "-",
                                 *shlex.split(args), *flags, *shlex.split(a.exec_args)])
    skip = _not_recipe()
    return {k: v for k, v in to_dict(cfg).items() if k not in skip}


def _recipe_diff(was: dict, now: dict) -> list[str]:
    """The recipe options whose values differ (eyas's own rule for a run's config against
    its manifest: an option eyas gained since counts only where set off its default)."""
    from eyas.draft.train_config import TrainConfig
    from eyas.freshness import changed_options

    return changed_options(TrainConfig, was, now)


def recorded_recipe(record: dict, a, flags: list[str] = (),
                    train_args: str | None = None) -> dict:
    """The recipe `record` was trained by: its own, or for a record from before recipes were
    recorded, its --train-args (`train_args`: the lever record's) and `flags` under today's
    defaults less what changed since (BEFORE_RECIPES)."""
    if record.get("recipe") is not None:
        return record["recipe"]
    return train_recipe(a, [*BEFORE_RECIPES, *flags], record.get("train_args", train_args))


def recipe_change(record: dict, a, now: dict, flags: list[str] = (),
                  train_args: str | None = None) -> str | None:
    """How the recipe `record` (a size's, or a lever variant's of `flags`) was trained by
    (recorded_recipe) differs from `now`, or None."""
    was = recorded_recipe(record, a, flags, train_args)
    return ", ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}"
                     for k in _recipe_diff(was, now)) or None


def train_size(a, n: int, lines: list[str], folder: Path) -> dict:
    """prepare -> capture -> vocab -> train -> export on the first n conversations."""
    # a training that ended before a kill whose record was not written needs no captures
    # again (export reads only its checkpoint)
    prep, seconds = prepare_capture(a, n, lines, folder, not done_before(folder / "run"))
    return train_export(a, folder, folder, [], prep, seconds)


def prepare_capture(a, key, lines: list[str], folder: Path, capture: bool) -> tuple[dict, dict]:
    """prepare -> capture (when `capture`) -> vocab of `lines` in `folder`: the prepared
    stats and each step's seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    conv = folder / "conversations.jsonl"
    conv.write_text("".join(line + "\n" for line in lines))
    log = folder / "log.txt"
    common = ["--target", a.target]
    model_dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[a.dtype]
    s = {"prepare": run("prepare", *common, "--data", conv, "--out", folder / "prepared",
                        log=log, out=folder / "prepared")}
    prep = json.loads((folder / "prepared/eyas.json").read_text())["stats"]
    captured = folder / "captured"
    if capture and not a.online:
        estimate = capture_bytes(a.target, prep["tokens"], a.capture_dtype)
        with disk_for(key, captured, 0 if done_before(captured) else estimate, a.disk_wait):
            s["capture"] = run("capture", *common, "--data", folder / "prepared", "--out",
                               captured, "--split", "all", "--model-dtype", model_dtype,
                               "--dtype", a.capture_dtype, log=log, out=captured)
    s["vocab"] = run("vocab", "--data", folder / "prepared", "--out", folder / "vocab",
                     log=log, out=folder / "vocab")
    return prep, s


def train_export(a, data: Path, folder: Path, flags: list[str], prep: dict,
                 seconds: dict) -> dict:
    """train (eyas train's defaults, --train-args, then `flags`) -> export into `folder` from
    the prepared, captured and vocab folders in `data`; the training's record."""
    folder.mkdir(parents=True, exist_ok=True)
    log, s = folder / "log.txt", dict(seconds)
    source = ["--data", data / "prepared", "--online", "--target", a.target] if a.online \
        else ["--data", data / "captured"]
    s["train"] = run("train", *source, "--vocab", data / "vocab", "--out", folder / "run",
                     *shlex.split(a.train_args), *flags, *shlex.split(a.exec_args), log=log,
                     out=folder / "run")
    s["export"] = run("export", "--checkpoint", folder / "run", "--out", folder / "draft",
                      log=log, out=folder / "draft")
    manifest = json.loads((folder / "run/eyas.json").read_text())
    records = [json.loads(x) for x in (folder / "run/metrics.jsonl").read_text().splitlines()
               if x.strip()]
    trained = [r for r in records if r.get("kind") == "train"]
    speeds = [r["tokens_per_s"] for r in trained[1:] if r.get("tokens_per_s")]
    epochs = manifest["config"].get("epochs")
    if not s["train"] and trained:  # finished before this call: training's own clock
        s["train"] = max(r.get("elapsed_s", 0.0) for r in trained)
    return {"tokens": prep["tokens"], "assistant_tokens": prep.get("masked_tokens"),
            "prepared": {k: prep.get(k) for k in ("kept", "train", "eval", "truncated_answers")},
            "epochs": epochs, "steps": manifest.get("steps"),
            "train_tokens": round(prep["tokens"] * prep["train"] / max(prep["kept"], 1)
                                  * (epochs or 0)),
            "train_tokens_per_s": round(sum(speeds) / len(speeds)) if speeds else None,
            "best": manifest.get("best"), "seconds": {k: round(v, 1) for k, v in s.items()},
            "gpu_minutes": round((s["train"] + s.get("capture", 0.0)) / 60, 2),
            "draft_id": json.loads((folder / "draft/eyas.json").read_text()).get("id")}


T1_EVALS = {"greedy": "t1", "probabilistic": "t1p"}  # --t1-sampling -> eval and set suffix


def sampled_set(name: str) -> str | None:
    """The prompt set a T = 1 set name measures (mt-bench-t1p -> mt-bench), None for a T = 0
    one."""
    for suffix in T1_EVALS.values():
        if name.endswith(f"-{suffix}"):
            return name.removesuffix(f"-{suffix}")
    return None


def per_set(report: dict, sets: list[str], t1: bool) -> dict[str, dict]:
    """prompt set -> {"eagle3": {k: AL}, "ngram": {k: AL}, "prompts": n, "steps": {method:
    {k: tokens per step}}} from one report (tokens per decode step of the target, the steps
    that drafted nothing included: n-gram's AL leaves those out; reports before it: none)."""
    by_set = report.get("by_set") or {}
    out = {}
    for name in sets:
        src = by_set.get(sampled_set(name) or name if t1 else name) if by_set else report
        if src is None:
            continue
        entry = {"prompts": src.get("prompts", report.get("num_prompts"))}
        for r in src["results"]:
            if r["method"] != "target":
                entry.setdefault(r["method"], {})[str(r["k"])] = r["mean_acceptance_length"]
                steps = r.get("tokens_per_step")
                if steps is None and "target_forwards" in r:
                    # a report from before eyas eval wrote it: from its counts, one
                    # generation (prefill) per prompt
                    from eyas.serve.eval_report import tokens_per_step

                    steps = tokens_per_step(r["new_tokens"], r["target_forwards"],
                                            entry["prompts"])
                if steps is not None:
                    entry.setdefault("steps", {}).setdefault(r["method"], {})[str(r["k"])] = \
                        steps
        out[name] = entry
    return out


def fidelity(report: dict) -> dict:
    """Trained against served, over the eval's whole prompt list (every set it measures):
    the draft's measured AL per k with its 95 % interval, and the same continuations replayed
    on training's forward with theirs (absent at T > 0, where eyas eval replays nothing)."""
    ci = report.get("ci95") or {}
    replayed = report.get("replayed") or {}
    if not replayed:
        return {}
    return {"fidelity": {k: {"measured": report.get("mean_acceptance_length", {}).get(k),
                             "measured_ci95": (ci.get(k) or {}).get("mean_acceptance_length"),
                             "replayed": r.get("mean_acceptance_length"),
                             "replayed_ci95": (r.get("ci95") or {}).get("mean_acceptance_length")}
                         for k, r in replayed.items()}}


def eval_size(a, name: str, args: list, sets: list[str], folder: Path, book: Book,
              size: dict) -> None:
    """One `eyas eval` of the size's draft, recorded (and the JSON written) when it ends;
    n-gram only where the JSON has none yet and no other eval is measuring it."""
    ngram = book.take_ngram(sets)
    out = folder / f"eval-{name}"
    shutil.rmtree(out, ignore_errors=True)  # an eval of another draft or an interrupted one
    count = a.bench_prompts if "--bench" in args else a.prompts
    took = run("eval", "--target", a.target, "--draft", folder / "draft", "--k", a.k,
               "--max-new-tokens", a.eval_tokens, "--dtype", a.dtype, "--device", a.device,
               "--batch-size", a.eval_batch, "--num-prompts", count,
               "--ngram" if ngram else "--no-ngram", *args, "--out", out,
               log=folder / "log.txt", out=out)
    report = json.loads((out / "report.json").read_text())
    measured = per_set(report, sets, "--temperature" in args)
    prompts = keep_per_prompt(a, folder, name, report, size["train"]["draft_id"])
    with book.change() as state:
        for s, entry in measured.items():
            if "ngram" in entry and "tokens_per_step" not in state["ngram"].get(s, {}):
                state["ngram"][s] = {"al": entry["ngram"], "prompts": entry["prompts"],
                                     "settings": eval_settings(a)}
                if "ngram" in entry.get("steps", {}):
                    state["ngram"][s]["tokens_per_step"] = entry["steps"]["ngram"]
        size["evals"][name] = {"draft_id": size["train"]["draft_id"],
                               "settings": eval_settings(a), "seconds": round(took, 1),
                               "lossless": report.get("lossless"),
                               "sets": {s: {"eagle3": e.get("eagle3"), "prompts": e["prompts"],
                                            **({"eagle3_tokens_per_step": e["steps"]["eagle3"]}
                                               if "eagle3" in e.get("steps", {}) else {})}
                                        for s, e in measured.items()},
                               **fidelity(report),
                               **({"per_prompt_file": prompts} if prompts else {})}
    print(f"size {size['conversations']}: eval {name} done", flush=True)


def keep_per_prompt(a, folder: Path, name: str, report: dict, draft_id: str) -> str | None:
    """The draft's per-prompt counts of one eval (per_prompt: per k, [id, drafts, accepted]
    rows), written beside the JSON in OUT-prompts/ (a row a line, as report.json's) so that a
    lever's eval can be set against its control's prompt by prompt
    (scale_report.paired_changes); its path from the JSON's folder, or None for a report
    without per-prompt counts."""
    from eyas.serve.eval_report import primary_per_prompt
    from eyas.serve.report_files import report_json

    rows = {k: [[i, d, sum(acc)] for i, d, acc in v]
            for k, v in primary_per_prompt(report).items()}
    if not rows:
        return None
    out = Path(a.out)
    where = out.with_name(f"{out.stem}-prompts")
    where.mkdir(parents=True, exist_ok=True)
    file = "-".join(folder.relative_to(a.work).parts + (name,)) + ".json"
    tmp = where / f"{file}.tmp"
    tmp.write_text(report_json({"draft_id": draft_id, "per_prompt": rows}))  # a row a line
    tmp.replace(where / file)
    return f"{where.name}/{file}"  # from the JSON's folder


def run_size(a, n: int, lines: list[str], fingerprint: str, book: Book) -> None:
    """Train size n if its record is missing or stale, then every eval it lacks
    (--eval-jobs of them at once)."""
    key, folder = str(n), Path(a.work) / f"size-{n}{_mix(a)}"
    size = book.state["sizes"].get(key)
    now = train_recipe(a)
    if size and size.get("subset") != fingerprint:
        print(f"size {n}: recorded on another subset, run again", flush=True)
        size = None
    elif size and (change := recipe_change(size, a, now)):
        print(f"size {n}: recorded under another recipe ({change}), run again", flush=True)
        size = None
    # a recorded size needs no captures: those an earlier --keep-captures run kept, or a
    # kill between the record and their deletion left, go now
    if size and not a.keep_captures:
        shutil.rmtree(folder / "captured", ignore_errors=True)
    plan = eval_plan(a)
    missing = [e for e in plan if not _eval_done(a, size, e)]
    if size and not missing:
        print(f"size {n}: done before, skipped", flush=True)
        return
    if size is None or not _has_draft(folder, size["train"]["draft_id"]):
        if size and not (folder / "draft/eyas.json").is_file():
            print(f"size {n}: evals missing and its draft is gone: trained again", flush=True)
        # steps made for another subset or capture (_captures_mark): not resumed; the run and
        # draft of another recipe go, the prepared and captured folders stay
        _mark_captures(folder, a, fingerprint)
        _run_made_for(folder, now)
        freeing = not a.keep_captures and not a.online
        with _DISK:
            if freeing:  # captures beside it may wait for the disk this size frees
                _FREEING.add(n)
        try:
            size = {"conversations": n, "subset": fingerprint, "train_args": a.train_args,
                    "recipe": now, "capture_dtype": a.capture_dtype, "exec_args": a.exec_args,
                    "train": train_size(a, n, lines, folder), "evals": {}}
            with book.change() as state:
                state["sizes"][key] = size
            print(f"size {n}: trained", flush=True)
            if freeing:  # the draft is made and recorded: free the disk for the next
                shutil.rmtree(folder / "captured", ignore_errors=True)
        finally:  # a size whose training failed keeps its captures (to resume): none freed
            with _DISK:
                _FREEING.discard(n)
        missing = list(plan)
    measure(a, plan, missing, folder, book, size)


def measure(a, plan: dict, names: list[str], folder: Path, book: Book, record: dict) -> None:
    """The evals `names` of `plan` of the draft in `folder`, --eval-jobs at once, each
    recorded in `record` as it ends."""
    with ThreadPoolExecutor(max(a.eval_jobs, 1)) as pool:
        for done in [pool.submit(eval_size, a, name, *plan[name], folder, book, record)
                     for name in names]:
            done.result()  # the first failure, once every eval has ended


def _has_draft(folder: Path, draft_id: str) -> bool:
    """folder/draft is the exported draft `draft_id`."""
    made = folder / "draft/eyas.json"
    return made.is_file() and json.loads(made.read_text()).get("id") == draft_id


def _captures_mark(a, fingerprint: str) -> str:
    """What a folder's prepared, captured and vocab steps were made for: the subset, the
    capture's storage dtype, the target and the dtype it ran in. Not the training flags: a run
    of another recipe goes by its own mark (_run_made_for), and the captures it trained on
    serve the next recipe as they are. (The storage dtype is not the recipe either, fp8
    measured no change: docs/capture.md, so a record made with the other one stands; a
    half-made folder of it does not.)"""
    return f"{fingerprint} capture={a.capture_dtype} dtype={a.dtype} target={a.target}"


def _mark_captures(folder: Path, a, fingerprint: str) -> None:
    """_made_for with the captures' mark. A mark of the format before session 47 (the subset,
    then --train-args, then ` capture=DTYPE` unless bf16) that names this subset and storage
    dtype is this mark: its captures stand, as a run kept over two leases needs (keep.py
    carries the mark with it); what it trained goes by the recipe's own mark."""
    marker, now = folder / "subset.txt", _captures_mark(a, fingerprint)
    if marker.is_file() and " dtype=" not in (old := marker.read_text()):
        subset, _, rest = old.partition(" ")
        stored = rest.rsplit("capture=", 1)[1] if "capture=" in rest else "bf16"
        if subset == fingerprint and stored == a.capture_dtype:
            marker.write_text(now)
    _made_for(marker, now)


def _made_for(marker: Path, what: str) -> None:
    """Keep marker's folder only when its steps were made for `what` (their resume), else
    start it empty; then mark it as made for `what`."""
    folder = marker.parent
    if folder.exists() and (not marker.is_file() or marker.read_text() != what):
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker.write_text(what)


def _run_made_for(folder: Path, recipe: dict) -> None:
    """The run and draft in `folder` trained by another recipe go (eyas train would resume
    such a run with its own recipe, and a finished one is not trained again); then `folder`
    is marked for `recipe`. Without a mark (a folder made before recipes were), the run's own
    manifest says what it was started with."""
    marker, what = folder / "recipe.json", json.dumps(recipe, sort_keys=True)
    was = json.loads(marker.read_text()) if marker.is_file() else None
    manifest = folder / "run/eyas.json"
    if was is None and manifest.is_file():
        skip = _not_recipe()
        was = {k: v for k, v in json.loads(manifest.read_text()).get("config", {}).items()
               if k not in skip}
    if was is not None and _recipe_diff(was, recipe):
        for sub in ("run", "draft"):
            shutil.rmtree(folder / sub, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    marker.write_text(what)


def _eval_done(a, size: dict | None, name: str) -> bool:
    e = (size or {}).get("evals", {}).get(name)
    return bool(e) and e["draft_id"] == size["train"]["draft_id"] and \
        e["settings"] == eval_settings(a)


# -- the levers (issue 31, item 5) ----------------------------------------------------------

def _pin_recipes(a, rec: dict) -> None:
    """Before a lever set's --train-args change: each variant recorded without its recipe
    (made before recipes were recorded) gets the one it was trained by (recorded_recipe: its
    flags on the old --train-args), so that every variant is judged by its own recipe
    against the new --train-args, not reset for a change of how they are written. A variant
    whose old arguments this eyas train refuses is dropped, with its reason."""
    for name, v in list(rec["variants"].items()):
        if "recipe" not in v:
            try:
                v["recipe"] = recorded_recipe(v, a, v["flags"], rec["train_args"])
            except SystemExit as e:
                print(f"lever {name}: its recorded --train-args {rec['train_args']!r} are "
                      f"refused by this eyas train ({e}), run again", flush=True)
                del rec["variants"][name]
    rec["train_args"] = a.train_args


def parse_levers(parser: argparse.ArgumentParser, text: str) -> dict[str, list[str]]:
    """--levers 'NAME=FLAGS;NAME=FLAGS' -> name -> eyas train flags (`name=` with no flags is
    the recipe itself: a control trained in the same call)."""
    levers = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, sep, flags = item.partition("=")
        name = name.strip()
        if not sep or not name or not name.replace("-", "").replace(".", "").isalnum():
            parser.error(f"--levers {item!r}: write NAME=FLAGS (NAME of letters, digits, "
                         f"'-' and '.'; FLAGS eyas train flags, empty for the recipe itself)")
        if name in levers:
            parser.error(f"--levers names {name!r} twice")
        levers[name] = shlex.split(flags)
    return levers


def run_levers(a, n: int, lines: list[str], fingerprint: str, book: Book) -> None:
    """Each --levers variant trained on size n's subset from one shared capture (WORK/levers-N:
    prepared, captured, vocab, and a folder per variant), then measured by the evals of
    --lever-evals, --eval-jobs at once; --lever-jobs variants train at once. The captures go
    once every variant's training has ended (kept when one failed, for its resume). Records:
    the JSON's levers[N][variants][NAME], redone when the subset changes (every variant),
    when the variant's flags change, or when the recipe that --train-args and its flags
    resolve to does (train_recipe: --train-args written otherwise to the same effect keep
    it; eyas train's defaults moved redo it); variants another call asked for stay."""
    key, folder = f"{n} levers", Path(a.work) / f"levers-{n}{_mix(a)}"
    plan = {e: p for e, p in eval_plan(a).items() if e in a.lever_evals}
    with book.change() as state:
        rec = state.setdefault("levers", {}).get(str(n))
        if rec is None or rec["subset"] != fingerprint:
            rec = state["levers"][str(n)] = {"subset": fingerprint, "train_args": a.train_args,
                                             "variants": {}}
        elif rec["train_args"] != a.train_args:
            _pin_recipes(a, rec)
        now = {name: train_recipe(a, flags) for name, flags in a.levers.items()}
        for name, flags in a.levers.items():
            old = rec["variants"].get(name)
            # the same name for another change, or the same flags under other defaults
            change = old and (f"flags {shlex.join(old['flags'])!r} -> {shlex.join(flags)!r}"
                              if old["flags"] != flags else
                              recipe_change(old, a, now[name], flags, rec["train_args"]))
            if change:
                print(f"size {n} lever {name}: recorded under another recipe ({change}), run "
                      f"again", flush=True)
                del rec["variants"][name]

    def missing(name: str) -> list[str]:
        return [e for e in plan if not _eval_done(a, rec["variants"].get(name), e)]

    todo = [name for name in a.levers if missing(name)]
    if not todo:
        print(f"size {n} levers: done before, skipped", flush=True)
        return
    # the shared steps made for another subset or capture (_captures_mark), a variant's of
    # other flags: not resumed
    _mark_captures(folder, a, fingerprint)
    to_train = [name for name in todo if name not in rec["variants"] or not _has_draft(
        folder / name, rec["variants"][name]["train"]["draft_id"])]
    for name in to_train:
        _made_for(folder / name / "flags.txt", shlex.join(a.levers[name]))
        _run_made_for(folder / name, now[name])
    prep, seconds, left = {}, {}, set(to_train)
    freeing = bool(to_train) and not a.keep_captures and not a.online
    with _DISK:
        if freeing:
            _FREEING.add(key)
    try:
        if to_train:
            prep, seconds = prepare_capture(
                a, key, lines, folder,
                not all(done_before(folder / name / "run") for name in to_train))

        def one(name: str) -> None:
            if name in left:
                try:
                    train = train_export(a, folder, folder / name, a.levers[name], prep, seconds)
                except BaseException:
                    with _DISK:  # its captures stay, for its resume
                        _FREEING.discard(key)
                    raise
                with book.change():
                    rec["variants"][name] = {"conversations": n, "flags": a.levers[name],
                                             "recipe": now[name], "train": train, "evals": {}}
                print(f"size {n} lever {name}: trained", flush=True)
                with _DISK:
                    left.discard(name)
                    last = not left and key in _FREEING
                if last:  # every variant's draft is made: the disk is free for the next
                    shutil.rmtree(folder / "captured", ignore_errors=True)
            measure(a, plan, missing(name), folder / name, book, rec["variants"][name])

        with ThreadPoolExecutor(max(a.lever_jobs, 1)) as pool:
            futures = {name: pool.submit(one, name) for name in todo}
        failed = {name: f.exception() for name, f in futures.items() if f.exception()}
    finally:
        with _DISK:
            _FREEING.discard(key)
    if failed:
        raise SystemExit("levers that failed: " + "; ".join(f"{name}: {e}"
                                                             for name, e in failed.items()))


# how eyas train runs, not what it learns (a CUDA graph replays eager's losses and gradients:
# tests/test_ttt_graph.py; compiled training matches eager: tests/test_train.py), so a size
# trained with or without them is the same point of the curve
EXEC_VALUED = ("--num-workers", "--log-every", "--save-every", "--keep-last")  # take a value
EXEC_FLAGS = ("--cuda-graph", "--no-cuda-graph", "--compile", "--no-compile", *EXEC_VALUED)


def exec_flags(parser: argparse.ArgumentParser, args: str) -> None:
    """Refuse in --exec-args a flag that may change what training learns."""
    words = shlex.split(args)
    for i, word in enumerate(words):
        value = i > 0 and words[i - 1] in EXEC_VALUED
        if not value and word.split("=")[0] not in EXEC_FLAGS:
            parser.error(f"--exec-args {word!r}: only flags that change how eyas train runs "
                         f"({', '.join(EXEC_FLAGS)}); a change of what it learns belongs in "
                         f"--train-args (a new recipe: every size is trained again)")


# -- main -------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target (folder, .gguf or hub name)")
    p.add_argument("--data", required=True,
                   help="benchmarks/real_data.py output (train.jsonl gives the curve order; "
                        "indist*.jsonl and heldout.jsonl the eval prompts)")
    p.add_argument("--corpus", default="",
                   help="comma list of globs of the regenerated parts (conversations*.jsonl, "
                        ".jsonl.gz); default: --corpus-dir/conversations*.jsonl*")
    p.add_argument("--corpus-dir", default="corpus", help="where --regenerate writes parts")
    p.add_argument("--regenerate", type=int, default=0, metavar="N",
                   help="first regenerate the next N prompts of the curve order into a new part")
    p.add_argument("--regen-args", default="--backend vllm --max-new-tokens 256 "
                   "--batch-size 256 --dtype float32",
                   help="eyas regenerate flags for --regenerate")
    p.add_argument("--sizes", default="3000,6000,12000,25000,50000",
                   help="comma list; '' = only --regenerate (the JSON is not touched)")
    p.add_argument("--seed", type=int, default=0, help="seed of the curve order")
    p.add_argument("--order", choices=("train", "corpus"), default="train",
                   help="train: a seeded shuffle of --data/train.jsonl's ids (the curve's own); "
                   "corpus: of every conversation in the corpus but --data's eval prompts, "
                   "for a corpus whose prompts train.jsonl no longer lists (BIG-bench's, gone "
                   "from PyPI); its JSON and size folders are its own, and --sizes may say "
                   "`all`")
    p.add_argument("--sources-first", default="",
                   help="comma list of sources (an id's first part: sharegpt, chitchat, "
                        "chatterbot, bigbench) whose prompts come first in the curve order, "
                        "in the seeded shuffle's order, the rest after: a curve of that data "
                        "mix (e.g. chat only up to the size those sources hold). Its own "
                        "--out: a JSON of another order is refused")
    p.add_argument("--work", required=True, help="folder for every step's output")
    p.add_argument("--out", required=True, help="result JSON (read first: the resume state); "
                                                "the table and plot are written beside it")
    p.add_argument("--train-args", default="",
                   help="eyas train flags on top of its defaults (default: none, the recipe)")
    p.add_argument("--jobs", type=int, default=1, help="sizes trained and measured at once (a size's --levers count as one)")
    p.add_argument("--eval-jobs", type=int, default=1, help="evals of a size run at once")
    p.add_argument("--wait", type=float, default=0, metavar="S",
                   help="sizes whose rows have not arrived yet wait up to S seconds: the corpus "
                        "(and a regeneration's output under --work, while it runs) is read "
                        "again every 30 s, and each size starts once its rows are there")
    p.add_argument("--online", action="store_true",
                   help="train --online on the prepared folder (no capture shards on disk)")
    p.add_argument("--capture-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="eyas capture --dtype: fp8 stores a token in 63 %% of the bytes, "
                        "for a size that does not fit the disk in bf16 (recorded per size; "
                        "sizes recorded with the other dtype stand)")
    p.add_argument("--exec-args", default="",
                   help="eyas train flags that change how it runs, not what it learns ("
                        + ", ".join(EXEC_FLAGS) + "): recorded per size; sizes recorded "
                        "with others stand")
    p.add_argument("--keep-captures", action="store_true",
                   help="keep each size's capture shards (default: deleted once its draft is "
                        "exported, so that the sizes after it find the disk free)")
    p.add_argument("--disk-wait", type=float, default=3600, metavar="S",
                   help="a capture waits up to S seconds for its disk (its estimated bytes "
                        "free beside what the captures running at once still write), then "
                        "its size fails; at once when no size beside it will free disk (a "
                        "size whose training failed keeps its captures, to resume)")
    p.add_argument("--levers", default="",
                   help="issue 31 item 5: 'NAME=FLAGS;NAME=FLAGS', variants of the recipe (eyas "
                        "train flags on top of --train-args; 'NAME=' is the recipe itself, a "
                        "control) trained at each --lever-sizes size from one shared capture "
                        "and measured by --lever-evals; recorded under the JSON's levers")
    p.add_argument("--lever-sizes", default="", help="comma list of sizes for --levers")
    p.add_argument("--lever-evals", default="indist,heldout,bench",
                   help="which evals of the plan measure each lever (of indist, indist-chat, "
                        "heldout, bench, bench-t1, bench-t1p)")
    p.add_argument("--lever-jobs", type=int, default=8, help="levers trained at once")
    p.add_argument("--k", default="3,6")
    p.add_argument("--prompts", type=int, default=200, help="in-distribution / held-out prompts")
    p.add_argument("--bench", default="mt-bench,gsm8k,humaneval")
    p.add_argument("--t1-bench", default="mt-bench", help="sets measured at temperature 1")
    p.add_argument("--t1-sampling", default="greedy",
                   help="comma list of how the draft proposes at temperature 1 (eyas eval "
                        "--draft-sampling): greedy (eval bench-t1, sets SET-t1; vLLM's "
                        "default) and/or probabilistic (bench-t1p, SET-t1p)")
    p.add_argument("--bench-prompts", type=int, default=80)
    p.add_argument("--eval-tokens", type=int, default=96)
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    exec_flags(p, a.exec_args)
    a.levers = parse_levers(p, a.levers)
    from eyas.draft.train_config import EAGLE3_RECIPE

    for flags in [[], *a.levers.values()]:  # flags eyas train refuses: before any work
        try:
            recipe = train_recipe(a, flags)
        except (SystemExit, ValueError) as err:
            p.error(f"--train-args {a.train_args!r} {shlex.join(flags)}: eyas train refuses "
                    f"them ({err})")
        # a torch without Muon resolves eyas train's EAGLE-3 optimizer to AdamW: another
        # recipe than every record made with Muon, which would all be trained again
        asked = " ".join([a.train_args, *flags])
        if recipe["draft"] == "eagle3" and recipe["optimizer"] != \
                EAGLE3_RECIPE["optimizer"] and "--optimizer" not in asked:
            p.error("this torch has no torch.optim.Muon, so eyas train's default recipe "
                    "would train with AdamW alone: another recipe than the records made with "
                    "Muon (all trained again). Use torch >= 2.9, or pass --train-args "
                    "'--optimizer adamw' to train that recipe on purpose")
    a.lever_evals = [e for e in a.lever_evals.split(",") if e]
    a.t1_sampling = [x for x in a.t1_sampling.split(",") if x]
    if not a.t1_sampling or set(a.t1_sampling) - set(T1_EVALS):
        p.error(f"--t1-sampling {','.join(a.t1_sampling)!r}: a comma list of "
                f"{', '.join(T1_EVALS)}")
    lever_sizes = sorted({int(x) for x in a.lever_sizes.split(",") if x.strip()})
    if bool(a.levers) != bool(lever_sizes):
        p.error("--levers and --lever-sizes go together")
    unknown = set(a.lever_evals) - {"indist", "indist-chat", "heldout", "bench", "bench-t1",
                                    "bench-t1p"}
    if unknown:
        p.error(f"--lever-evals: unknown {sorted(unknown)}")

    out = Path(a.out)
    patterns = a.corpus.split(",") if a.corpus else [f"{a.corpus_dir}/conversations*.jsonl*"]
    if a.wait:  # rows a regeneration beside this process has written so far count too
        patterns.append(f"{a.work}/regen-p*/out/conversations.jsonl")
    reject_globs = [f"{a.corpus_dir}/rejects-*.jsonl", f"{a.work}/regen-p*/out/rejects.jsonl"]
    first = mix(a)
    size_words = [x.strip() for x in a.sizes.split(",") if x.strip()]
    if "all" in size_words and a.order != "corpus":
        p.error("--sizes all: only with --order corpus (the curve's own order grows)")
    left_out = 0
    if a.order == "corpus":
        if a.regenerate or a.wait:
            p.error("--order corpus is made of the corpus as it is: no --regenerate or --wait")
        answered = read_corpus(patterns)[0]
        full_order = corpus_order(answered, *eval_ids(Path(a.data)), a.seed)
        left_out = len(answered) - len(full_order)  # counted in the JSON
    else:
        full_order = curve_order(Path(a.data) / "train.jsonl", a.seed)
    known = {i.split("/")[0] for i in full_order}
    if set(first) - known:
        p.error(f"--sources-first: no prompt of {sorted(set(first) - known)} in "
                f"{a.data if a.order == 'train' else 'the corpus'}; "
                f"its sources are {', '.join(sorted(known))}")
    full_order = sources_first(full_order, first)

    def arrived() -> tuple[list[str], dict[str, str], list[dict]]:
        """The curve order without the ids regenerate rejected, the corpus and its files."""
        rejected = read_rejects(reject_globs)
        corpus, files = read_corpus(patterns)
        return [i for i in full_order if i not in rejected], corpus, files

    def corpus_state() -> dict:
        """What the JSON says of the corpus as read last."""
        return {"corpus_files": files, "corpus_rows": len(corpus),
                "curve_prefix_available": available(order, corpus),
                "rejected_by_regenerate": len(full_order) - len(order)}

    order, corpus, files = arrived()
    if a.regenerate:
        regenerate_part(a, order, corpus, files)
        order, corpus, files = arrived()
    sizes = sorted({len(order) if x == "all" else int(x) for x in size_words})
    if a.order == "corpus" and sizes and sizes[-1] > len(order):
        p.error(f"--sizes {sizes[-1]}: the corpus's order holds {len(order)} conversations "
                f"(--sizes all takes them all)")
    if not sizes and not lever_sizes:
        print(f"{available(order, corpus)} of the curve order regenerated; no sizes asked",
              flush=True)
        return {}
    state = json.loads(out.read_text()) if out.is_file() else {}
    if (state.get("sizes") or state.get("levers")) and state.get("sources_first", []) != first:
        raise SystemExit(f"{out} holds sizes of a curve order with sources first: "
                         f"{state.get('sources_first') or 'none'}, not "
                         f"{first or 'none'} as asked; give this order its own --out")
    if (state.get("sizes") or state.get("levers")) and state.get("order", "train") != a.order:
        raise SystemExit(f"{out} holds sizes of the order of {state.get('order', 'train')}, "
                         f"not of {a.order} as asked; give this order its own --out")
    # an order of the corpus changes with the corpus and --data: a JSON holds one of them
    fingerprint = hashlib.sha256("\n".join(full_order).encode()).hexdigest()[:16] \
        if a.order == "corpus" else None
    if state.get("sizes") and state.get("order_fingerprint") != fingerprint:
        raise SystemExit(f"{out} holds sizes of another order of the corpus (another corpus "
                         f"or --data: fingerprint {state.get('order_fingerprint')}, now "
                         f"{fingerprint}); give this one its own --out")
    state = {"benchmark": "scale", "sizes": {}, "ngram": {}, **state, "sources_first": first,
             "order": a.order, **({"order_fingerprint": fingerprint,
                                   "left_out_for_evals": left_out} if fingerprint else {})}
    if state["ngram"] and next(iter(state["ngram"].values()))["settings"] != eval_settings(a):
        state["ngram"] = {}  # measured at other eval settings
    state.update({"target": a.target, "k": a.k, "seed": a.seed, "recipe": a.train_args or
                  "eyas train defaults", "eval": eval_settings(a), **corpus_state(),
                  "command": " ".join(["python", "benchmarks/scale.py",
                                       *(argv if argv is not None else sys.argv[1:])]),
                  "date": time.strftime("%Y-%m-%d"), "device": _device()})
    have = state["curve_prefix_available"]

    plotted = {"at": -math.inf, "final": False}

    def write() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(out)  # a lease taken back mid-write leaves the previous JSON
        out.with_suffix(".md").write_text(markdown(state, out.parent) + "\n")
        # the plot (about a second per k) at most once a minute while sizes run, and at the end
        if not plotted["final"] and time.monotonic() - plotted["at"] < PLOT_EVERY_S:
            return
        plotted["at"] = time.monotonic()
        curve = state["sizes"] or not state.get("levers")  # levers alone: no curve to draw
        for k in a.k.split(",") if curve else ():
            plot(state, out.with_name(f"{out.stem}-k{k}.png"), k)

    at_once = (max(a.jobs, 1) + (max(a.lever_jobs, 1) if lever_sizes else 0)) * \
        max(a.eval_jobs, 1)
    if at_once > 1 and "OMP_NUM_THREADS" not in os.environ:
        # each step is a process with torch's CPU thread pool; as many pools as cores would
        # spin against each other (a CPU dry run of 3 + 3 evals on 2 cores took minutes per eval)
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // at_once))
    book = Book(state, write)
    book.save()
    deadline = time.monotonic() + a.wait
    # the sizes, smallest first; a size's levers count as one more job, started with it
    pending = sorted([(n, str(n), run_size) for n in sizes] +
                     [(n, f"{n} levers", run_levers) for n in lever_sizes],
                     key=lambda u: (u[0], u[1]))
    running = {}
    with ThreadPoolExecutor(max(a.jobs, 1)) as pool:
        while True:
            for unit in [u for u in pending if u[0] <= have]:
                n, name, job = unit
                running[name] = pool.submit(job, a, n, *subset(order, corpus, n), book)
                pending.remove(unit)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
            # the prefix up to `have` never changes: only ids not arrived can be rejected later
            try:
                order, corpus, files = arrived()
            except (OSError, EOFError, ValueError) as err:  # a file replaced while read
                print(f"reading the corpus again next time ({err})", flush=True)
                continue
            with book.change() as state:
                state.update(corpus_state())
            have = state["curve_prefix_available"]
        gap = f", the first missing one being {order[have]}" if have < len(order) else ""
        for n, name, _ in pending:
            print(f"size {name}: waiting for data (the first {have} rows of the curve order are "
                  f"regenerated{gap}; {sum(i in corpus for i in order[:n])} of its {n})",
                  flush=True)
    failed = {}
    for n, done in running.items():
        try:
            done.result()
        except (Exception, SystemExit) as e:  # run() ends a failed step with SystemExit
            failed[n] = e
    plotted["final"] = True
    book.save()
    print(markdown(state))
    if failed:
        raise SystemExit("sizes that failed: " + "; ".join(f"{n}: {e}"
                                                           for n, e in failed.items()))
    return state


if __name__ == "__main__":
    main()
