"""The recipe ablation of issue 23 on a real target: same data, same steps, one variant at a
time, each trained, exported and measured by `eyas eval` (held-out prompts, k = 1..7).

    python benchmarks/recipe.py --work run --data realdata --target smol.gguf \
        --variants eagle3,eagle3.1,eagle3-lk,eagle3.1-lk,eagle3-ttt3 --out recipe-h200.json

`--work` is a benchmarks/real_model.py work folder (its captured/, vocab/ and prepared/ are
reused: no regeneration or capture per variant). Per variant: `eyas train` with the
variant's flags on top of the shared ones, `eyas export`, then `eyas eval` on the prepared
eval split (in-distribution) and on heldout.jsonl. The JSON holds per variant training
tokens/s, training's replayed AL, and per split the measured AL and per-position acceptance
for every k, with 95 % intervals; the markdown table compares each variant's mean AL over
k with the first variant's (issue 23's goal: +7 %), and under it gives each variant's change
against the first paired prompt by prompt, per split and k, with its 95 % interval (`paired`
in the JSON, from the eval reports' per-prompt counts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from real_model import _best_eval, run  # noqa: E402  (the same CLI runner and records)

from eyas.draft.train_config import PREVIOUS_RECIPE  # noqa: E402


def _flags(recipe: dict) -> list[str]:
    """eyas train flags that set each option of `recipe`."""
    out = []
    for name, value in recipe.items():
        flag = "--" + name.replace("_", "-")
        out += ([flag] if value else ["--no-" + flag[2:]]) if isinstance(value, bool) else \
            [flag, str(value)]
    return out


# Each variant spells out the recipe it changes, so that names keep meaning when eyas train's
# defaults move: the variants below change the recipe eyas trained with before issue 31's
# second lease (AdamW, cosine, clip 0.5, 7 TTT steps of 0.8^j, trained lm_head; the lr is
# the runner's --lr). eyas train's defaults were EAGLE 3.1's norms (norm_before_fc +
# norm_output) since this ablation measured them best, and are speculators' recipe since issue
# 31 (the variant eagle3.1+speculators; `default` runs whatever the defaults are now).
PREVIOUS = _flags(PREVIOUS_RECIPE)
PLAIN = [*PREVIOUS, "--no-norm-before-fc", "--no-norm-output"]
NORMS = [*PREVIOUS, "--norm-before-fc", "--norm-output"]
VARIANTS = {  # name -> eyas train flags on top of the shared ones
    "default": [],
    "eagle3": PLAIN,
    "eagle3.1": NORMS,
    "eagle3.1-fc": [*PREVIOUS, "--fc-norm", "--norm-output"],  # the paper's per-aux fc norm (SGLang too)
    "eagle3-lk": [*PLAIN, "--loss", "lk-lambda"],
    "eagle3-lk-alpha": [*PLAIN, "--loss", "lk-alpha"],
    "eagle3.1-lk": [*NORMS, "--loss", "lk-lambda"],
    "eagle3-ttt3": [*PLAIN, "--ttt-steps", "3"],
    "eagle3.1-ttt3": [*NORMS, "--ttt-steps", "3"],
}
# issue 31: speculators 0.9.0's EAGLE 3.1 recipe, as eyas train flags (its defaults: Muon on
# the hidden matrices + AdamW elsewhere at lr 1e-3, AdamW weight decay 0.01, 3 TTT steps of
# equal weight, the target's lm_head rows frozen, norm_before_residual, 1 % warmup then a
# linear decay, clip 1.0, loss positions where the token a step reads is an assistant token
# and no filter on the target's top-1 being in the draft vocab). Its sliding window of 2,048
# is not among them: no sample here is longer than 2,048 tokens, so it changes nothing.
SPECULATORS = {
    "muon": ["--optimizer", "muon", "--lr", "1e-3", "--weight-decay", "0.01"],
    "ttt3eq": ["--ttt-steps", "3", "--step-weight", "1"],
    "frozen-head": ["--freeze-lm-head"],
    "nbr": ["--norm-before-residual"],
    "linear": ["--lr-decay", "linear", "--warmup-ratio", "0.01"],
    "clip1": ["--grad-clip", "1"],
    "positions": ["--loss-mask-at", "input", "--no-vocab-filter"],
}
VARIANTS.update({f"eagle3.1+{k}": [*NORMS, *v] for k, v in SPECULATORS.items()})
# peer trainers run on the same capture and vocab (benchmarks/peers/), with their own
# recipe; name -> (script, its extra flags). Their wheels may live outside this environment:
# $PEER_SITE is put first on their PYTHONPATH. SpecForge's default micro-batch is one sample
# (its examples'); at one sample its steps ran at ~4.5 samples/s on the H200 (session 22), too
# slow for 20 epochs in a lease, so `-b16` is the same recipe with 16 samples padded per
# micro-batch and a sixteenth of the accumulation (about the same tokens per optimizer step);
# `-b16-4k` steps on one micro-batch (~4 K tokens here: nearer SpecForge's examples, one
# sample per GPU on 8 GPUs, whose lr 1e-4 is set for steps that small; later flags win)
PEERS = {"peer-speculators": ("peers/speculators_train.py", []),
         "peer-specforge": ("peers/specforge_train.py", []),
         "peer-specforge-b16": ("peers/specforge_train.py", ["--batch-size", "16"]),
         "peer-specforge-b16-4k": ("peers/specforge_train.py",
                                   ["--batch-size", "16", "--batch-tokens", "4096"])}
VARIANTS.update({
    "eagle3.1+lr1e-4": [*NORMS, "--lr", "1e-4"],  # SpecForge's lr, eyas's default before issue 31
    "eagle3.1+lr3e-4": [*NORMS, "--lr", "3e-4"],  # the benchmarks' lr before issue 31
    "eagle3.1+lr1e-3": [*NORMS, "--lr", "1e-3"],  # speculators' lr without Muon
    "eagle3.1+lr2e-3": [*NORMS, "--lr", "2e-3"],  # is 1e-3 (the default since) the optimum?
    "eagle3.1+speculators": [*NORMS, *(f for v in SPECULATORS.values() for f in v)],
    # today's defaults on the assistant's positions only: the default until session 46, so a
    # lease measures the change beside the default and against earlier leases' peer runs
    "mask-input": ["--loss-mask-at", "input"],
})


# the evals a variant can have: the prepared eval split, heldout.jsonl, the --bench sets
SPLITS = ("indist", "heldout", "bench")


def _train_speed(run_dir: Path) -> float | None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    speeds = [r["tokens_per_s"] for r in rows if r.get("kind") == "train"][1:]  # no warm-up
    return round(sum(speeds) / len(speeds), 1) if speeds else None


def _split(base: Path, split: str) -> dict:
    """One split's measured AL per k; the bench split's per prompt set (and MT-bench turn)."""
    report = json.loads((base / f"eval-{split}/report.json").read_text())
    if split == "bench" and report.get("by_set"):  # "all": the sets pooled, with intervals
        return {"all": _measured(report),
                **{name: _measured(v) for name, v in report["by_set"].items()}}
    return _measured(report)


def _measured(report: dict) -> dict:
    out = {}
    for r in report["results"]:
        if r["method"] == "eagle3":
            out[str(r["k"])] = {"al": r["mean_acceptance_length"],
                                "per_position": r["per_position_acceptance"],
                                "speedup": r["speedup"],
                                "ci95": (report.get("ci95") or {}).get(str(r["k"]))}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="benchmarks/real_model.py work folder")
    p.add_argument("--data", required=True, help="benchmarks/real_data.py output folder")
    p.add_argument("--target", required=True)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--lr", type=float, default=None,
                   help="shared eyas train --lr (default: eyas train's own; issue 31's ablation "
                        "ran at 3e-4, the pipeline's lr then)")
    p.add_argument("--k", default="1,2,3,4,5,6,7")
    p.add_argument("--eval-tokens", type=int, default=96)
    p.add_argument("--indist-prompts", type=int, default=160)
    p.add_argument("--heldout-prompts", type=int, default=200)
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--splits", default="indist,heldout",
                   help="which evals to run per variant, comma list: indist (the prepared eval "
                        "split), heldout (heldout.jsonl), bench (the --bench sets)")
    p.add_argument("--bench", default="mt-bench,gsm8k,humaneval",
                   help="the standard prompt sets of split bench (eyas eval --bench)")
    p.add_argument("--bench-prompts", type=int, default=80, help="the first N of each set")
    p.add_argument("--indist-for", default=None, metavar="VARIANTS",
                   help="measure the in-distribution split only for these variants (comma "
                        "list; the others: held-out only, with training's replayed AL as their "
                        "in-distribution figure); default: every variant gets --splits")
    p.add_argument("--baseline", default=None, metavar="VARIANT",
                   help="take this variant (e.g. eagle3) from the work folder's own run/ and "
                        "eval-*/ instead of training it again: real_model.py trained it with "
                        "the same data, --epochs, --batch-tokens and --lr, and measured it on "
                        "the same prompts")
    p.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=False,
                   help="also measure n-gram in each variant's eval (the same for all)")
    p.add_argument("--parallel", type=int, default=1,
                   help="variants run at once, each train -> export -> evals in its own "
                        "processes (a small target leaves most of a GPU idle: side by side "
                        "they share it); each variant logs to its own recipe-NAME/log.txt")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    work, data = Path(a.work), Path(a.data)
    log = work / "recipe-log.txt"
    results = {}
    splits = a.splits.split(",")
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS and n not in PEERS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}: use some of "
                         f"{sorted(VARIANTS) + sorted(PEERS)}")
    if set(splits) - set(SPLITS):
        raise SystemExit(f"unknown split(s) {sorted(set(splits) - set(SPLITS))}: use "
                         f"{', '.join(SPLITS)}")
    if a.baseline:  # the work folder's own draft, trained and measured by real_model.py
        results[a.baseline] = _record(a.baseline, work / "run", work, splits, None)
        Path(a.out).write_text(json.dumps(_result(a, results), indent=2) + "\n")
    written = threading.Lock()  # variants finish in their own threads

    def one(name: str) -> None:
        mine = splits if a.indist_for is None or name in a.indist_for.split(",") else \
            [x for x in splits if x != "indist"]
        base = work / f"recipe-{name}"
        base.mkdir(parents=True, exist_ok=True)
        vlog = log if a.parallel == 1 else base / "log.txt"
        t0 = time.perf_counter()
        if name in PEERS:
            _peer(name, a, base, vlog)
        else:
            run("train", "--data", work / "captured", "--vocab", work / "vocab", "--out",
                base / "run", "--epochs", a.epochs, "--batch-tokens", a.batch_tokens,
                *(["--lr", a.lr] if a.lr else []), "--eval-every", 200, "--save-every", 200,
                *VARIANTS[name], log=vlog, out=base / "run")
        train_s = time.perf_counter() - t0
        if name not in PEERS:
            run("export", "--checkpoint", base / "run", "--out", base / "draft", log=vlog,
                out=base / "draft")
        _evals(a, base, mine, vlog)
        record = _peer_record(name, base, mine, train_s) if name in PEERS else \
            _record(name, base / "run", base, mine, train_s)
        with written:
            results[name] = record
            Path(a.out).write_text(json.dumps(_result(a, results), indent=2) + "\n")

    with ThreadPoolExecutor(max(1, a.parallel)) as pool:
        failed = [(n, f.exception()) for n, f in [(n, pool.submit(one, n)) for n in names]
                  if f.exception() is not None]
    for name, err in failed:
        print(f"variant {name} failed: {err}", flush=True)
    result = _result(a, results)
    print(markdown(result))
    return result


def _peer(name: str, a, base: Path, log: Path) -> None:
    """A peer's trainer on the work folder's capture and vocab, for the same epochs and tokens
    per step; it writes base/draft (vLLM layout) and base/peer.json. Skipped when done."""
    if (base / "peer.json").is_file():
        print(f"{name}: done before, skipped", flush=True)
        return
    work = Path(a.work)
    script, extra = PEERS[name]
    cmd = [sys.executable, str(Path(__file__).parent / script), "--capture",
           str(work / "captured"), "--vocab", str(work / "vocab"), "--target", a.target,
           "--out", str(base), "--epochs", str(a.epochs), "--batch-tokens",
           str(a.batch_tokens), "--device", "cuda" if _has_cuda() else "cpu", *extra]
    env = dict(os.environ)
    if env.get("PEER_SITE"):
        env["PYTHONPATH"] = os.pathsep.join([env["PEER_SITE"], env.get("PYTHONPATH", "")])
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        raise SystemExit(f"{name} failed (rc {done.returncode}); see {log}")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _peer_record(name: str, base: Path, splits: list, train_s) -> dict:
    peer = json.loads((base / "peer.json").read_text())
    # its trainer's own time (this call's `train_s` is ~0 when an earlier call trained it)
    train_s = (peer.get("wall_s") or {}).get("train", train_s)
    return {"peer": peer, "train_s": train_s and round(train_s, 1),
            "train_tokens_per_s": None, "best_step": None, "training_replayed_al": None,
            **{split: _split(base, split) for split in splits}}


def _evals(a, base: Path, splits: list, log: Path) -> None:
    """`eyas eval` of base/draft on each split (in-distribution: the prepared eval split;
    held-out: heldout.jsonl)."""
    work, data = Path(a.work), Path(a.data)
    ev = ["--target", a.target, "--draft", base / "draft", "--k", a.k, "--max-new-tokens",
          a.eval_tokens, "--dtype", "float32", "--batch-size", a.eval_batch,
          "--ngram" if a.ngram else "--no-ngram"]
    if "indist" in splits:
        run("eval", *ev, "--data", work / "prepared", "--split", "eval", "--num-prompts",
            a.indist_prompts, "--out", base / "eval-indist", log=log, out=base / "eval-indist")
    if "heldout" in splits:
        run("eval", *ev, "--data", data / "heldout.jsonl", "--num-prompts", a.heldout_prompts,
            "--out", base / "eval-heldout", log=log, out=base / "eval-heldout")
    if "bench" in splits:
        run("eval", *ev, "--bench", a.bench, "--num-prompts", a.bench_prompts, "--out",
            base / "eval-bench", log=log, out=base / "eval-bench")


def _record(name: str, run_dir: Path, base: Path, splits: list, train_s) -> dict:
    best = _best_eval(run_dir)
    return {"flags": VARIANTS.get(name, []), "train_s": train_s and round(train_s, 1),
            "train_tokens_per_s": _train_speed(run_dir), "best_step": best["step"],
            "training_replayed_al": best.get("chain", {}).get("acceptance_length"),
            **{split: _split(base, split) for split in splits}}


def _result(a, results: dict) -> dict:
    return {"benchmark": "recipe", "target": a.target, "work": a.work, "epochs": a.epochs,
            "batch_tokens": a.batch_tokens, "lr": a.lr, "k": a.k, "splits": a.splits,
            "command": " ".join(["python", "benchmarks/recipe.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d"), "variants": results,
            "paired": paired(a, results)}


def _per_prompt(base: Path, split: str) -> dict[str, list]:
    """k -> the per-prompt rows of the draft measured in base's eval of `split` ({} where the
    report or its per-prompt rows are missing)."""
    from eyas.serve.eval_report import primary_per_prompt

    try:
        return primary_per_prompt(json.loads((base / f"eval-{split}/report.json").read_text()))
    except FileNotFoundError:
        return {}


def paired(a, results: dict) -> dict:
    """variant -> split -> k -> its change of AL against the first variant (the --baseline
    when given: the pipeline's own draft) with a 95 % interval, paired prompt by prompt over
    the prompts both evals measured (eval_report.paired_change_ci: at T = 0 two drafts of one
    target continue the same text, so the prompts' own difficulty leaves the interval)."""
    from eyas.serve.eval_report import matched_rows, paired_change_ci

    names = list(results)
    work = Path(a.work)

    def base(name: str) -> Path:
        return work if name == a.baseline else work / f"recipe-{name}"

    out = {}
    for name in names[1:]:
        for split in a.splits.split(","):
            theirs, ours = _per_prompt(base(names[0]), split), _per_prompt(base(name), split)
            for k in sorted(set(theirs) & set(ours), key=int):
                mine, yours = matched_rows(ours[k], theirs[k])
                change = mine and paired_change_ci(mine, yours)
                if change:
                    out.setdefault(name, {}).setdefault(split, {})[k] = change
    return out


def markdown(result: dict) -> str:
    """One row per variant: held-out AL per k (in-distribution when only that split was
    measured), mean over k and its change from the first."""
    variants = result["variants"]
    ks = result["k"].split(",")
    split = "heldout" if "heldout" in result.get("splits", "heldout") else "indist"
    lines = ["| variant | train tok/s | " + " | ".join(f"AL k={k}" for k in ks)
             + " | mean | vs first |", "|---|---:|" + "---:|" * (len(ks) + 2)]
    first = None
    for name, v in variants.items():
        als = [v[split].get(k, {}).get("al") or 0.0 for k in ks]
        mean = sum(als) / len(als)
        first = mean if first is None else first
        lines.append(f"| {name} | {v['train_tokens_per_s']} | "
                     + " | ".join(f"{x:.3f}" for x in als)
                     + f" | {mean:.3f} | {100 * (mean / first - 1):+.1f} % |")
    notes = [f"- {name} against {next(iter(variants))}, paired prompt by prompt: " + "; ".join(
        f"{split} k={k} {100 * c['change']:+.1f} % [{100 * c['ci95'][0]:+.1f}, "
        f"{100 * c['ci95'][1]:+.1f}] over {c['prompts']} prompts"
        for split, by_k in splits_k.items() for k, c in by_k.items())
        for name, splits_k in (result.get("paired") or {}).items()]
    return "\n".join(lines + ([""] + notes if notes else []))


if __name__ == "__main__":
    main()
