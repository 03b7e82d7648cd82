"""The whole pipeline on a real target and real prompts, and the fidelity table.

    python benchmarks/real_model.py --target SmolLM2-135M-Instruct.Q4_1.gguf \
        --data realdata/ --work /tmp/run --out benchmarks/results/real-smollm2.json

`--data` is a folder written by benchmarks/real_data.py: prompt-only rows in train.jsonl
(training sources) and heldout.jsonl (whole held-out sources). The steps, each through the
`eyas` CLI as a user runs them:

    regenerate (the target answers every training prompt, greedy)
    -> prepare (--eval-fraction: held-out in-distribution samples = the eval split)
    -> capture (train and eval splits) -> vocab -> train -> export
    -> eval on the eval split (in-distribution) and on heldout.jsonl

and the JSON holds, per split, training's simulated acceptance (its eval's chain replay at
the exported checkpoint: in-distribution only, training never sees the held-out sources),
eval's replay on its own continuations and eval's measured acceptance with 95 % intervals,
n-gram's, and speed. A step already finished in --work is skipped (the CLI's own resume).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from scale_corpus import curve_order, jsonl_lines, sources_first  # noqa: E402

EVALS = ("indist", "heldout", "bench")  # the evals after export, --eval-order's names
LOG_TAIL = 40  # lines of a failed step's log printed with its error
# A training that dies on one of these is run once more, and eyas train resumes from its last
# checkpoint: on the H200 three trainings sharing the GPU with others have died so, at steps
# ~320, ~2,150 and ~3,450, inside torch's own flex-attention mask code ("unspecified launch
# failure"; sessions 13, 19 and 20), and the session-20 one, run again, resumed from step 3,000
# and finished; in session 46 one of three side by side died at step 3,730 of 4,833 in torch's
# Muon (a cuBLAS bf16 GEMM: CUBLAS_STATUS_EXECUTION_FAILED, 10 of 141 GiB in use) and, run
# again by hand, resumed from step 3,500 and finished. A CUDA fault poisons the process, so
# only a new process can go on.
RETRY_ON = ("CUDA error: unspecified launch failure", "CUDA error: an illegal memory access",
            "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED")


def done_before(out: Path) -> bool:
    """The step that writes `out` ended there: its manifest is written and not marked
    incomplete (a killed step's is)."""
    manifest = out / "eyas.json"
    return manifest.is_file() and json.loads(manifest.read_text()).get("complete", True)


def run(step: str, *args: str, log: Path, out: Path) -> float:
    """One `eyas STEP ...` in a subprocess, its output appended to `log`; seconds taken. A
    step whose `out` folder holds a complete manifest from an earlier call is skipped (0).
    An eval that fails its lossless check has still written its report: that is recorded
    (`lossless: false` with the mismatches and their margins), not an abort."""
    if done_before(out):
        print(f"{step}: done before, skipped", flush=True)
        return 0.0
    cmd = [sys.executable, "-m", "eyas", step, *map(str, args)]
    start = time.perf_counter()
    for attempt in (1, 2):
        with log.open("a") as f:
            f.write(f"\n$ {' '.join(cmd)}\n")
            f.flush()
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
        took = time.perf_counter() - start
        print(f"{step}: {took:.1f} s (rc {done.returncode})", flush=True)
        if not done.returncode or step == "eval" and (out / "report.json").is_file():
            break
        # the step's own last lines, into this process's output: a lease brings that back,
        # the work folder's logs are lost with the machine (session 19's control training
        # died at step 2,150 and nothing said why)
        tail = log.read_text(errors="replace").rsplit(f"\n$ {' '.join(cmd)}\n", 1)[-1]
        lines = [x for x in tail.splitlines()  # progress bars' \r pieces left out
                 if x.strip() and "it/s]" not in x and "s/it]" not in x][-LOG_TAIL:]
        print(f"eyas {step} failed (rc {done.returncode}); the last lines of {log}:\n"
              + "\n".join(f"  | {x}" for x in lines), flush=True)
        if attempt == 1 and step == "train" and any(e in tail for e in RETRY_ON):
            print("eyas train died on a CUDA fault: run again, from its last checkpoint",
                  flush=True)
            continue
        raise SystemExit(f"eyas {step} failed (rc {done.returncode}); see {log}")
    if done.returncode:
        print("eval: lossless check failed; its report is kept (see mismatches)", flush=True)
    return took


def _best_eval(run_dir: Path) -> dict:
    """Training's eval record at the checkpoint export takes (the run's best step)."""
    best = json.loads((run_dir / "eyas.json").read_text())["best"]["step"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    evals = [r for r in records if r.get("kind") == "eval"]
    return next((r for r in evals if r["step"] == best), evals[-1])


def _split_summary(report: dict, ks: list[int]) -> dict:
    res = {(r["method"], r["k"]): r for r in report["results"]}
    out = {"prompts": report["num_prompts"], "lossless": report["lossless"],
           "mismatches": report["mismatches"], "batch_size": report.get("batch_size", 1),
           "target_tokens_per_s": res["target", 0]["tokens_per_s"],
           "measured_al": {}, "measured_per_position": {}, "measured_ci95": report["ci95"],
           "replayed_al": {}, "replayed_per_position": {}, "replayed_ci95": {},
           "ngram_al": {}, "speedup": {}, "ngram_speedup": {}}
    for k in ks:
        e, n = res.get(("eagle3", k)), res.get(("ngram", k))
        out["measured_al"][str(k)] = e["mean_acceptance_length"]
        out["measured_per_position"][str(k)] = e["per_position_acceptance"]
        out["speedup"][str(k)] = e["speedup"]
        if n:
            out["ngram_al"][str(k)] = n["mean_acceptance_length"]
            out["ngram_speedup"][str(k)] = n["speedup"]
        rep = report.get("replayed", {}).get(str(k))
        if rep:
            out["replayed_al"][str(k)] = rep["mean_acceptance_length"]
            out["replayed_per_position"][str(k)] = rep["per_position_acceptance"]
            out["replayed_ci95"][str(k)] = rep["ci95"]
    return out


def train_subset(prompts: Path, n: int, order: str, out: Path,
                 first: list[str] | None = None) -> Path:
    """The first `n` rows of `prompts` (a real_data.py train.jsonl) written to `out`, in the
    file's order or in the scaling curve's ("curve": benchmarks/scale.py's seeded shuffle of
    the ids, seed 0, so that N here is the curve's size N; with the ids of the sources
    `first` first, as scale.py --sources-first orders them)."""
    lines = jsonl_lines(prompts)
    if order == "curve":
        by_id = _ids(prompts)
        lines = [by_id[i] for i in sources_first(curve_order(prompts, seed=0), first or [])]
    out.write_text("\n".join(lines[:n]) + "\n")
    return out


def _ids(path: Path) -> dict[str, str]:
    """id -> row of a JSONL file (the first row of an id wins; no file: none)."""
    rows: dict[str, str] = {}
    for line in jsonl_lines(path) if path.is_file() else []:
        rows.setdefault(json.loads(line)["id"], line)
    return rows


def missing_prompts(conversations: Path, prompts: Path, out: Path) -> int:
    """The rows of `prompts` whose id no row of `conversations` has, written to `out`; their
    count."""
    have = _ids(conversations)
    rest = [line for i, line in _ids(prompts).items() if i not in have]
    out.write_text("".join(line + "\n" for line in rest))
    return len(rest)


def merge_conversations(parts: list[Path], prompts: Path, out: Path) -> Path:
    """One conversation per id of `prompts` that some part answered (the first part's row of
    an id wins), in `prompts`' order, written to `out`."""
    answered: dict[str, str] = {}
    for part in parts:
        for i, line in _ids(part).items():
            answered.setdefault(i, line)
    out.write_text("".join(answered[i] + "\n" for i in _ids(prompts) if i in answered))
    return out


def keep_gzipped(src: Path, dest: Path) -> None:
    """src gzipped to dest through a temporary file: a dest that exists is whole."""
    tmp = dest.with_name(dest.name + ".tmp")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with src.open("rb") as f, gzip.open(tmp, "wb") as g:
        while chunk := f.read(1 << 20):
            g.write(chunk)
    tmp.replace(dest)


def eval_schedule(order: list[str], first: list[str]) -> tuple[list[str], list[str]]:
    """The evals run before the command after export (--evals-first's, in --eval-order's
    order) and those run after it."""
    return [n for n in order if n in first], [n for n in order if n not in first]


def evals_around(before: list[str], after: list[str], run_eval, command):
    """The evals `before`, then `command()` (what it returns is returned), then those `after`.
    An eval before it that fails is reported and skipped, not the end: the command (the
    serving a lease exists for) runs anyway, and the eval's absence shows in the result."""
    for name in before:
        try:
            run_eval(name)
        except SystemExit as err:
            print(f"eval {name} before the command after export failed ({err}); going on",
                  flush=True)
    rc = command()
    for name in after:
        run_eval(name)
    return rc


def _command(argv) -> str:
    """This run's command line, for its result."""
    return " ".join(["python", "benchmarks/real_model.py", *(argv or sys.argv[1:])])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target (.gguf file, folder or hub name)")
    p.add_argument("--data", required=True, help="benchmarks/real_data.py output folder")
    p.add_argument("--work", required=True, help="folder for every step's output")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--max-train", type=int, default=0, help="first N training prompts (0 = all)")
    p.add_argument("--train-order", choices=("file", "curve"), default="file",
                   help="which N --max-train takes: the file's first (real_data.py writes it "
                        "source by source), or the scaling curve's (benchmarks/scale.py: a "
                        "seeded shuffle of the ids, seed 0; size N's prompts)")
    p.add_argument("--regen-tokens", type=int, default=256)
    p.add_argument("--regen-batch", type=int, default=256)
    p.add_argument("--regen-batching", default="padded", help="eyas regenerate --batching")
    p.add_argument("--regen-args", default="",
                   help="more eyas regenerate flags, e.g. '--backend vllm "
                        "--gpu-memory-utilization 0.4' (the target must then be a folder)")
    p.add_argument("--conversations", default=None,
                   help="train on this conversations.jsonl (an earlier, possibly partial "
                        "`eyas regenerate` output) instead of regenerating")
    p.add_argument("--top-up", action="store_true",
                   help="with --conversations: regenerate only the training prompts they lack "
                        "(by id) and train on both, in the prompts' order (written to "
                        "WORK/conversations.jsonl): a corpus that grows lease by lease")
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--capture-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="eyas capture --dtype: fp8 stores the aux layers in 8 bits (7.7 KB "
                        "per token for a 1.5B Qwen2 against 12.3 KB in bf16)")
    p.add_argument("--regenerate-only", action="store_true",
                   help="stop once the conversations exist (and --keep-conversations has them): "
                        "a lease that grows the corpus and leaves the GPU to other work")
    p.add_argument("--online", action="store_true",
                   help="no capture: eyas train --online runs the target on each batch "
                        "(its states rounded to bf16, not to --capture-dtype). For a corpus "
                        "whose capture the disk cannot hold: ~20 K of the 1.5B's multi-turn "
                        "chats would need ~60-80 GB in fp8")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=200,
                   help="eyas train --eval-every and --save-every (online, each eval runs the "
                        "target over the eval split again)")
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--sources-first", default="",
                   help="with --train-order curve: these sources' prompts first (as "
                        "benchmarks/scale.py --sources-first), e.g. sharegpt,chitchat,chatterbot")
    p.add_argument("--lr", type=float, default=None,
                   help="eyas train --lr (default: eyas train's own, 1e-3 since issue 31; the "
                        "runs recorded before 2026-12-02 used 3e-4)")
    p.add_argument("--after-export", default=None, metavar="CMD",
                   help="a shell command run once the draft is exported, before the evals "
                        "(e.g. benchmarks/served_speed.py: timed alone on the GPU, not beside "
                        "an eval); its seconds and exit status go in the result")
    p.add_argument("--eval-tokens", type=int, default=96)
    p.add_argument("--indist-prompts", type=int, default=300)
    p.add_argument("--heldout-prompts", type=int, default=200)
    p.add_argument("--bench", default=None, metavar="SETS",
                   help="also measure the draft on these standard prompt sets (eyas eval "
                        "--bench, e.g. mt-bench,gsm8k,humaneval; archives from "
                        "$EYAS_BENCH_CACHE), --bench-prompts each, after the other evals")
    p.add_argument("--bench-prompts", type=int, default=80)
    p.add_argument("--eval-order", default="indist,heldout,bench",
                   help="the order of the evals after export (a lease that may end during "
                        "them puts first the one it needs most)")
    p.add_argument("--keep-conversations", default=None, metavar="FILE.jsonl.gz",
                   help="the conversations trained on (regenerated, or merged with --top-up), "
                        "gzipped to this file as soon as they exist: a lease sends them home "
                        "before the hours of work after them")
    p.add_argument("--evals-first", default="", metavar="NAMES",
                   help="evals (of --eval-order's names, comma-separated) run before "
                        "--after-export's command instead of after it, e.g. bench: a lease that "
                        "serves and may end while serving still has the acceptance to set "
                        "beside the served rows")
    p.add_argument("--k", default="3,6")
    p.add_argument("--workers", type=int, default=1, help="eyas eval --workers")
    p.add_argument("--eval-batch", type=int, default=64, help="eyas eval --batch-size")
    p.add_argument("--train-args", default="",
                   help="more eyas train flags, split on spaces (e.g. '--online-cache gpu "
                        "--online-cache-dtype fp8')")
    p.add_argument("--eval-args", default="",
                   help="more eyas eval flags for every eval, e.g. --no-ngram (n-gram measured "
                        "elsewhere: a shorter eval)")
    p.add_argument("--dtype", default="float32", help="target dtype for regenerate/capture/eval")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    if a.top_up and not a.conversations:
        p.error("--top-up adds to --conversations: give them (without, every prompt is "
                "regenerated anyway)")
    if a.sources_first and not (a.train_order == "curve" and a.max_train):
        p.error("--sources-first orders the prompts that --max-train N takes with "
                "--train-order curve: give both")
    order = a.eval_order.split(",")  # (checked before hours of work, not after)
    if sorted(order) != sorted(EVALS):
        p.error(f"--eval-order {a.eval_order!r}: name each of {', '.join(EVALS)} once")
    first = [x for x in a.evals_first.split(",") if x]
    if set(first) - set(EVALS):
        p.error(f"--evals-first {a.evals_first!r}: name some of {', '.join(EVALS)}")

    work, data = Path(a.work), Path(a.data)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    t = {}
    train_prompts = data / "train.jsonl"
    if a.max_train:
        train_prompts = train_subset(train_prompts, a.max_train, a.train_order,
                                     work / "train-prompts.jsonl",
                                     [x for x in a.sources_first.split(",") if x])
    model_dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[a.dtype]
    common = ["--target", a.target]
    conversations = Path(a.conversations) if a.conversations else \
        work / "regenerated/conversations.jsonl"
    prompts = train_prompts
    if a.top_up:  # only the prompts the given conversations lack
        prompts = work / "top-up-prompts.jsonl"
    t["regenerate"] = 0.0
    if not a.conversations or (a.top_up and missing_prompts(conversations, train_prompts,
                                                            prompts)):
        try:
            t["regenerate"] = run("regenerate", *common, "--data", prompts,
                                  "--out", work / "regenerated", "--max-new-tokens",
                                  a.regen_tokens, "--batch-size", a.regen_batch, "--batching",
                                  a.regen_batching, "--dtype", a.dtype, "--device", a.device,
                                  *a.regen_args.split(), log=log, out=work / "regenerated")
        except SystemExit as err:  # e.g. every missing prompt refused again (too long)
            if not a.top_up:
                raise
            print(f"top-up regeneration failed ({err}); training on the given "
                  f"conversations alone", flush=True)
            t["top_up_failed"] = 1.0
    if a.top_up:
        conversations = merge_conversations(
            [conversations, work / "regenerated/conversations.jsonl"], train_prompts,
            work / "conversations.jsonl")
    if a.keep_conversations and conversations.is_file():
        keep_gzipped(conversations, Path(a.keep_conversations))
    if a.regenerate_only:
        # (a run that exists to grow the corpus fails when it did not: the lease must know)
        if t.get("top_up_failed"):
            raise SystemExit("--regenerate-only: the top-up regeneration failed (above)")
        rows = 0
        if conversations.is_file():
            with conversations.open() as f:
                rows = sum(1 for _ in f)
        if not rows:
            raise SystemExit(f"--regenerate-only: no conversations in {conversations}")
        result = {"target": a.target, "date": time.strftime("%Y-%m-%d"), "device": _device(),
                  "command": _command(argv),
                  "regenerate_only": {"conversations": str(conversations),
                                      "conversations_used": rows},
                  "seconds": {k: round(v, 1) for k, v in t.items()}}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"regenerate only: {rows} conversations in {conversations}", flush=True)
        return
    t["prepare"] = run("prepare", *common, "--data", conversations,
                       "--out", work / "prepared", "--eval-fraction", a.eval_fraction, log=log,
                       out=work / "prepared")
    t["capture"] = 0.0 if a.online else run(
        "capture", *common, "--data", work / "prepared", "--out", work / "captured", "--split",
        "all", "--model-dtype", model_dtype, "--dtype", a.capture_dtype, log=log,
        out=work / "captured")
    source = ["--data", work / "prepared", "--online", *common] if a.online else \
        ["--data", work / "captured"]
    t["vocab"] = run("vocab", "--data", work / "prepared", "--out", work / "vocab", log=log,
                     out=work / "vocab")
    t["train"] = run("train", *source, "--vocab", work / "vocab",
                     "--out", work / "run", "--epochs", a.epochs, "--batch-tokens",
                     a.batch_tokens, *(["--lr", a.lr] if a.lr else []), "--eval-every",
                     a.eval_every, "--save-every", a.eval_every, *a.train_args.split(),
                     log=log, out=work / "run")
    t["export"] = run("export", "--checkpoint", work / "run", "--out", work / "draft", log=log,
                      out=work / "draft")
    ks = [int(k) for k in a.k.split(",")]
    ev = ["--target", a.target, "--draft", work / "draft", "--k", a.k, "--max-new-tokens",
          a.eval_tokens, "--dtype", a.dtype, "--workers", a.workers, "--device", a.device,
          "--batch-size", a.eval_batch, *a.eval_args.split()]
    evals = {"indist": ["--data", work / "prepared", "--split", "eval",
                        "--num-prompts", a.indist_prompts],
             "heldout": ["--data", data / "heldout.jsonl", "--num-prompts", a.heldout_prompts],
             # its report has one table per set (report.json: by_set)
             "bench": ["--bench", a.bench, "--num-prompts", a.bench_prompts] if a.bench else None}

    def run_eval(name: str) -> None:
        if evals[name] is not None:
            t[f"eval_{name}"] = run("eval", *ev, *evals[name], "--out", work / f"eval-{name}",
                                    log=log, out=work / f"eval-{name}")

    def after_export() -> int | None:
        if not a.after_export:
            return None
        start = time.perf_counter()
        with log.open("a") as f:
            f.write(f"\n$ {a.after_export}\n")
        rc = subprocess.run(a.after_export, shell=True).returncode
        t["after_export"] = time.perf_counter() - start
        print(f"after export: {t['after_export']:.1f} s (rc {rc})", flush=True)
        return rc

    after_export_rc = evals_around(*eval_schedule(order, first), run_eval, after_export)

    regen_manifest = work / "regenerated/eyas.json" if a.top_up else \
        conversations.parent / "eyas.json"  # (a top-up's: the prompts it regenerated)
    regen = json.loads(regen_manifest.read_text()) if regen_manifest.is_file() else {}
    prep = json.loads((work / "prepared/eyas.json").read_text())
    best = _best_eval(work / "run")
    indist = json.loads((work / "eval-indist/report.json").read_text())
    heldout = json.loads((work / "eval-heldout/report.json").read_text())
    sources = json.loads((data / "sources.json").read_text()) \
        if (data / "sources.json").is_file() else None
    chain = best.get("chain", {})
    result = {
        "target": a.target,
        "command": _command(argv),
        "date": time.strftime("%Y-%m-%d"),
        "device": _device(),
        "samples": prep.get("stats", {}),
        "regenerate": {**regen.get("stats", {}), "complete": regen.get("complete"),
                       "conversations_used": sum(1 for _ in conversations.open())},
        "tokens": prep.get("stats", {}).get("tokens"),
        "seconds": {k: round(v, 1) for k, v in t.items()},
        **({"after_export": {"command": a.after_export, "rc": after_export_rc}}
           if a.after_export else {}),
        "training_eval": {"step": best["step"], "per_step_acc": best["acc"],
                          "sim_acceptance_length_product": best["sim_acceptance_length"],
                          "positions": best["positions"]},
        "indist": {"simulated_source": "training eval (chain replay at the exported step)",
                   "simulated_al": {str(k): chain.get("acceptance_length", {}).get(str(k))
                                    for k in ks},
                   "simulated_per_position": {str(k): chain.get("per_position", {}).get(str(k))
                                              for k in ks},
                   **_split_summary(indist, ks)},
        # training never saw the held-out sources: their simulated side is the replay of
        # chain decoding on training's TTT forward over eval's own continuations
        "heldout": {**_split_summary(heldout, ks), "simulated_source": "replayed"},
        "data_sources": sources,
    }
    if a.bench:  # per set (and MT-bench turn): AL per method and k, beside n-gram
        report = json.loads((work / "eval-bench/report.json").read_text())
        result["bench"] = {name: {f"{r['method']}_k{r['k']}": r["mean_acceptance_length"]
                                  for r in v["results"] if r["method"] != "target"}
                           | {"prompts": v["prompts"]}
                           for name, v in (report.get("by_set") or {}).items()}
    held = result["heldout"]
    held["simulated_al"], held["simulated_per_position"] = (held["replayed_al"],
                                                            held["replayed_per_position"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("training_eval", "seconds")}, indent=1))
    for split in ("indist", "heldout"):
        r = result[split]
        print(split, "sim", r["simulated_per_position"], "replayed", r["replayed_per_position"],
              "measured", r["measured_per_position"], "AL", r["measured_al"], "ngram",
              r["ngram_al"], "speedup", r["speedup"], flush=True)


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
            f"CPU ({os.cpu_count()} cores)"
    except ImportError:
        return "unknown"


if __name__ == "__main__":
    main()
