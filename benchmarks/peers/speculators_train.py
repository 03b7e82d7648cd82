"""Train the `speculators` library's EAGLE-3 draft on an eyas capture, for a like-for-like
comparison with `eyas train` (GitHub issue 31, item 1).

Same captured tokens (the eyas capture's aux states and final hidden states), same draft
vocabulary (the eyas vocab's d2t/t2d), same train/eval split, same epochs and tokens per step;
everything else is speculators' own default EAGLE-3 recipe, run through its own CLI
(`python -m speculators train`), with its eager loss (its fused Triton loss fails under
torch.compile on torch 2.11). The result is written as a vLLM-layout draft folder that
`eyas eval --draft OUT/draft` reads, plus `peer.json` (versions, recipe as used, steps, time).

    python benchmarks/peers/speculators_train.py --capture run/captured --vocab run/vocab \
        --target smol-hf --out run/peer-speculators --epochs 10 --batch-tokens 16384

Three conversions happen at the edges, nothing else:
1. capture -> speculators' offline data folder (a `datasets` folder with input_ids, loss_mask
   and seq_len, plus hidden_states/hs_{i}.safetensors holding `hidden_states` (T, 4, H) and
   `token_ids` (T,)). The eyas train samples come first and the eval samples last, and
   `--train-data-ratio` is set so speculators' contiguous split falls exactly between them.
   `--jobs` processes write the files (the folder is the same for any number).
2. eyas stores the final hidden state AFTER the target's final norm; speculators applies the
   target's final norm itself (verifier_norm) before its frozen lm_head. We hand it
   `final / norm.weight`, which that norm maps back onto `final` (RMSNorm is scale invariant
   and rms(final / w) = 1 up to eps); the largest relative error is measured and recorded.
3. speculators' saved checkpoint (its own config + `layers.0.*` weights) -> vLLM layout
   (`LlamaForCausalLMEagle3` config.json, every trained weight including `input_norm.weight`,
   d2t and t2d), checked by eyas's own export validator.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
try:
    import eyas  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO / "src"))

log = logging.getLogger("speculators_train")

# speculators 0.9.0's EAGLE-3 defaults (speculators/train/config/schema.py), recorded in
# peer.json; the script passes none of them, so the run uses exactly what the library defaults to.
RECIPE_KEYS = ("optimizer", "lr", "muon_lr", "weight_decay", "muon_momentum",
               "muon_weight_decay", "muon_ns_steps", "muon_adjust_lr_fn", "scheduler_type",
               "scheduler_warmup_steps", "scheduler_warmup_ratio", "ttt_steps",
               "ttt_step_loss_decay", "loss_fn", "loss_implementation", "norm_before_residual",
               "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad",
               "sliding_window", "draft_attn_impl", "num_layers", "total_seq_len",
               "hidden_states_dtype", "seed", "epochs", "train_data_ratio")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capture", required=True, help="`eyas capture` output folder")
    p.add_argument("--vocab", required=True, help="`eyas vocab` output folder (d2t/t2d)")
    p.add_argument("--target", required=True,
                   help="the target's local HF folder (speculators reads its config, "
                        "embedding, final norm and lm_head from it)")
    p.add_argument("--out", required=True, help="output folder (data, checkpoints, draft/)")
    p.add_argument("--epochs", type=int, default=10, help="passes over the train split")
    p.add_argument("--batch-tokens", type=int, default=16384,
                   help="tokens per optimizer step (speculators' --total-seq-len: one packed "
                        "row per step, single GPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0 = all epochs)")
    p.add_argument("--num-workers", type=int, default=4, help="speculators dataloader workers")
    p.add_argument("--jobs", type=int, default=min(6, len(os.sched_getaffinity(0))),
                   help="processes converting the capture into speculators' data folder "
                        "(default: min(6, CPUs)); the folder is the same for any value")
    p.add_argument("--eval-fraction", type=float, default=None,
                   help="held-out share when the capture has no eval split (default: eyas "
                        "train's --eval-fraction default)")
    p.add_argument("--seed", type=int, default=None,
                   help="eyas's split seed (default: eyas train's); speculators keeps its own seed")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ 1. data


def eyas_split(capture: Path, eval_fraction: float | None, seed: int | None):
    """(source, train ids, eval ids) exactly as `eyas train` splits this capture."""
    from eyas.draft.data import OfflineSource, split_eval, split_ids
    from eyas.draft.train_config import TRAINING_DEFAULTS, TrainConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    fraction = defaults["eval_fraction"] if eval_fraction is None else eval_fraction
    seed = TRAINING_DEFAULTS["seed"] if seed is None else seed  # (unset in TrainConfig)
    src = OfflineSource(capture)
    train_ids = split_ids(src, "train")
    if src.manifest.get("split") == "all" and len(split_ids(src, "eval")):
        return src, train_ids, split_ids(src, "eval")
    keep, held = split_eval(len(train_ids), fraction, seed)
    return src, train_ids[keep], train_ids[held]


def verifier_norm_weight(target: str) -> torch.Tensor:
    """The target's final-norm weight, read the way speculators reads it for verifier_norm."""
    from speculators.utils.loading import load_model_layers

    w = load_model_layers(["model.norm.weight"], target)["model.norm.weight"].float()
    if bool((w.abs() < 1e-6).any()):
        raise SystemExit(f"{target}: the final norm has (near-)zero weights, so its input cannot "
                         f"be recovered from eyas's post-norm final hidden states")
    return w


def write_speculators_data(src, ids: np.ndarray, norm_w: torch.Tensor, eps: float,
                           data: Path, jobs: int = 1) -> float:
    """speculators' offline data folder for samples `ids` in that order (hs_{i}.safetensors and
    dataset row i hold sample ids[i]); returns the largest relative error of
    verifier_norm(stored) against eyas's final hidden state, over every token of every sample.

    `jobs` forked processes (one torch thread each) write runs of consecutive samples in
    capture-file order, so each reads its stretch of a shard front to back; the folder is the
    same for any `jobs`."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from datasets import Dataset

    hs_dir = data / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    by_file = np.argsort(ids, kind="stable")     # output positions, in sample (= file) order
    runs = np.array_split(by_file, min(len(ids), max(1, jobs) * 8)) if len(ids) else []
    work = _Conversion(src.capture, ids, norm_w, eps, hs_dir)
    if jobs <= 1:
        threads = torch.get_num_threads()
        _init_worker(work)
        try:
            done = [_convert_run(run) for run in runs]
        finally:
            torch.set_num_threads(threads)
    else:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"),
                                 initializer=_init_worker, initargs=(work,)) as pool:
            done = list(pool.map(_convert_run, runs))
    tokens, masks = [None] * len(ids), [None] * len(ids)
    worst = 0.0
    for run, (run_tokens, run_masks, run_worst) in zip(runs, done):
        for pos, t, m in zip(run, run_tokens, run_masks):
            tokens[pos], masks[pos] = t, m
        worst = max(worst, run_worst)
    rows = {"input_ids": [t.tolist() for t in tokens], "loss_mask": [m.tolist() for m in masks],
            "seq_len": [int(t.size) for t in tokens]}
    ds = Dataset.from_dict(rows).with_format("torch")
    ds.save_to_disk(str(data))
    return worst


@dataclasses.dataclass(frozen=True)
class _Conversion:
    capture: object          # eyas.store.shards.CaptureSet (mmaps reopened in each process)
    ids: np.ndarray          # output position i -> capture sample number
    norm_w: torch.Tensor     # (H,) the target's final-norm weight
    eps: float
    hs_dir: Path


_WORK: _Conversion | None = None  # this process's conversion, set by _init_worker


def _init_worker(work: _Conversion) -> None:
    # per-sample tensors are small (T x H): intra-op threads only add a barrier per op, which
    # made the conversion 5-20x slower on a busy 2-core host (37-172 vs 9-11 ms per 1k tokens)
    torch.set_num_threads(1)
    global _WORK
    _WORK = work


def _convert_run(positions: np.ndarray) -> tuple[list, list, float]:
    """Write hs_{i}.safetensors for each output position i in `positions`; returns their
    input_ids and loss_mask (int64 arrays) and the largest relative norm-inversion error."""
    w = _WORK
    norm_w, eps = w.norm_w, w.eps
    tokens, masks, worst = [], [], 0.0
    for i in positions:
        s = w.capture.sample(int(w.ids[i]))
        final = s["final_hidden"].float()                                     # (T, H) post-norm
        pre = final / norm_w                                                  # (T, H)
        back = pre * torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + eps) * norm_w
        worst = max(worst, float(((back - final).norm(dim=-1) /
                                  final.norm(dim=-1).clamp_min(1e-6)).max()))
        hidden = torch.cat([s["aux_hidden"], pre.to(torch.bfloat16)[:, None]], dim=1)  # (T, 4, H)
        ids_i = s["input_ids"].long()
        save_file({"hidden_states": hidden.contiguous(), "token_ids": ids_i},
                  str(w.hs_dir / f"hs_{i}.safetensors"))
        tokens.append(ids_i.numpy())
        masks.append(s["loss_mask"].long().numpy())
    return tokens, masks, worst


# ------------------------------------------------------------------------------ 2. train


def run_speculators(args, data: Path, out: Path, d2t: torch.Tensor, t2d: torch.Tensor,
                    aux: list[int], ratio: float) -> tuple[Path, list[str]]:
    """`python -m speculators train` with only the data, vocab and size flags; returns its log
    and the command."""
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    # on a CPU machine speculators' Trainer needs _cpu_launch.py's two redirections
    launcher = [str(Path(__file__).with_name("_cpu_launch.py"))] if args.device == "cpu" \
        else ["-m", "speculators"]
    cmd = [sys.executable, *launcher, "train",
           "--speculator-type", "eagle3",
           "--verifier-name-or-path", args.target,
           "--data-path", str(data),
           "--d2t-path", str(out / "d2t.npy"), "--t2d-path", str(out / "t2d.npy"),
           "--draft-vocab-size", str(d2t.numel()),
           "--target-layer-ids", *map(str, aux),
           "--total-seq-len", str(args.batch_tokens),
           "--train-data-ratio", repr(ratio),
           "--epochs", str(args.epochs),
           "--loss-implementation", "eager",
           "--on-missing", "raise",
           "--num-workers", str(args.num_workers),
           "--save-path", str(out / "checkpoints"),
           "--log-dir", str(out / "logs")]
    if args.max_steps:
        cmd += ["--max-steps", str(args.max_steps)]
    if args.device == "cpu":  # FlexAttention (its default) has no backward on CPU
        cmd += ["--draft-attn-impl", "sdpa"]
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return run_logged(cmd, env, out, "speculators"), cmd


def run_logged(cmd: list[str], env: dict, out: Path, peer: str) -> Path:
    """A peer trainer's CLI in `out`, its output in OUT/train.log (returned); a failure ends
    this script with the log's last lines. The peer runners share it."""
    log_path = out / "train.log"
    log.info("running %s", " ".join(cmd))
    with open(log_path, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=out)
    if proc.returncode:
        tail = log_path.read_text().splitlines()[-30:]
        raise SystemExit(f"{peer} train failed (exit {proc.returncode}); "
                         f"{log_path} ends:\n" + "\n".join(tail))
    return log_path


def last_checkpoint(checkpoints: Path) -> Path:
    epochs = sorted((p for p in checkpoints.iterdir() if p.is_dir() and p.name.isdigit()),
                    key=lambda p: int(p.name))
    if not epochs:
        raise SystemExit(f"speculators wrote no checkpoint under {checkpoints}")
    return epochs[-1]


# ------------------------------------------------------------------------------ 3. export


def to_vllm_folder(ckpt: Path, d2t: torch.Tensor, t2d: torch.Tensor, dest: Path) -> dict:
    """speculators checkpoint -> vLLM-layout EAGLE-3 folder; returns the config written."""
    from eyas.draft.formats import from_speculators_config

    spec = json.loads((ckpt / "config.json").read_text())
    if spec.get("target_hidden_size") is None:  # speculators writes null for "= hidden_size"
        spec.pop("target_hidden_size", None)
    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    # frozen copies of the target's rows: the server shares the target's embedding
    tensors.pop("embed_tokens.weight", None)
    for name in [n for n in tensors if n.startswith("verifier_")]:
        tensors.pop(name)
    if spec.get("norm_before_fc") and "input_norm.weight" not in tensors:
        raise SystemExit(f"{ckpt}: norm_before_fc is on but input_norm.weight is missing")
    tensors.setdefault("d2t", d2t)  # a checkpoint without d2t takes eyas's
    # vLLM's convention for the aux ids is speculators' too: the ids go through unchanged
    return write_vllm_folder(dest, from_speculators_config(spec), tensors, d2t, t2d,
                             source=str(ckpt))


def write_vllm_folder(dest: Path, cfg, tensors: dict, d2t: torch.Tensor, t2d: torch.Tensor, *,
                      source: str) -> dict:
    """A peer's draft weights (`tensors`: its names, which vLLM reads, and its d2t, which must
    be the eyas vocab's; `source` names them in the error) with eyas's config for DraftConfig
    `cfg` as a vLLM folder: bf16 weights, eyas's d2t/t2d, checked by eyas's own export
    validator. The peer runners (this one and specforge_train.py) share it. Returns the config
    written."""
    from eyas.draft.formats import to_vllm_config
    from eyas.export import export_state_dict, validate_folder

    if not torch.equal(tensors["d2t"].long().cpu(), d2t.long()):
        raise SystemExit(f"{source}: its d2t is not the eyas vocab's")
    tensors = {**tensors, "d2t": d2t.long(), "t2d": t2d.bool()}
    if not cfg.maps_vocab:  # the whole vocabulary: no maps, as eyas export writes it
        tensors = {n: t for n, t in tensors.items() if n not in ("d2t", "t2d")}
    config = to_vllm_config(cfg, dtype="bf16")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = export_state_dict({n: t.detach().cpu() for n, t in tensors.items()},
                                layout="midlayer", dtype="bf16")  # no renames: bf16, contiguous
    save_file(tensors, str(dest / "model.safetensors"))
    validate_folder(dest)
    return config


# ------------------------------------------------------------------------------ main


def main(argv=None) -> Path:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    from eyas.store.vocab import load_vocab
    from transformers import AutoConfig

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    d2t, t2d, _ = load_vocab(args.vocab)
    src, train_ids, eval_ids = eyas_split(Path(args.capture), args.eval_fraction, args.seed)
    if not len(eval_ids):
        raise SystemExit("the capture has no eval samples and --eval-fraction is 0; speculators "
                         "needs a validation split")
    aux = [int(i) for i in src.manifest["aux_layer_ids"]]
    eps = float(AutoConfig.from_pretrained(args.target).rms_norm_eps)

    norm_w = verifier_norm_weight(args.target)
    t0 = time.time()
    data = out / "speculators-data"
    ids = np.concatenate([train_ids, eval_ids])
    norm_err = write_speculators_data(src, ids, norm_w, eps, data, jobs=args.jobs)
    # speculators splits rows [0, int(N * ratio)) / the rest: land exactly on len(train_ids)
    ratio = (len(train_ids) + 0.5) / len(ids)
    t1 = time.time()
    log.info("converted %d samples (%d tokens) in %.1f s with %d job(s)", len(ids),
             int(src.lengths[ids].sum()), t1 - t0, args.jobs)
    log_path, cmd = run_speculators(args, data, out, d2t, t2d, aux, ratio)
    t2 = time.time()
    ckpt = last_checkpoint(out / "checkpoints")
    config = to_vllm_folder(ckpt, d2t, t2d, out / "draft")

    run_yaml = ckpt.parent / "run.yaml"
    resolved = _resolved_recipe(cmd[cmd.index("train") + 1:])
    steps = _steps(ckpt)
    peer = {
        "peer": "speculators",
        "speculators_version": importlib.metadata.version("speculators"),
        "hs_connectors_version": importlib.metadata.version("hs-connectors"),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "device": args.device,
        "capture": str(Path(args.capture).resolve()), "vocab": str(Path(args.vocab).resolve()),
        "target": args.target,
        "train_samples": int(len(train_ids)), "eval_samples": int(len(eval_ids)),
        "train_tokens": int(src.lengths[train_ids].sum()),
        "aux_layer_ids": aux, "draft_vocab_size": int(d2t.numel()),
        "epochs": args.epochs, "batch_tokens": args.batch_tokens, "max_steps": args.max_steps,
        "recipe": resolved, "steps": steps,
        "final_norm_inversion_max_rel_error": norm_err,  # over every token of every sample
        "convert_jobs": args.jobs, "convert_tokens": int(src.lengths[ids].sum()),
        "checkpoint": str(ckpt), "run_yaml": str(run_yaml) if run_yaml.is_file() else None,
        "draft": str(out / "draft"),
        "draft_config": {k: config.get(k) for k in ("norm_before_residual", "norm_before_fc",
                                                    "fc_norm", "norm_output",
                                                    "eagle_aux_hidden_state_layer_ids")},
        # convert_data: the capture -> speculators data folder step alone (hs files + dataset)
        "wall_s": {"convert_data": round(t1 - t0, 1), "train": round(t2 - t1, 1),
                   "total": round(time.time() - t0, 1)},
        "train_log": str(log_path),
    }
    (out / "peer.json").write_text(json.dumps(peer, indent=1) + "\n")
    log.info("draft written to %s; peer.json beside it", out / "draft")
    return out / "draft"


def _resolved_recipe(train_argv: list[str]) -> dict:
    """The recipe keys of speculators' own resolution of the flags passed (its defaults and
    derived defaults included: loss_fn, norm_before_fc, norm_output, ...)."""
    from speculators.train.config import TrainConfig

    flat = TrainConfig.resolve(train_argv).flatten()
    return {k: flat[k] for k in RECIPE_KEYS if k in flat}


def _steps(ckpt: Path) -> int | None:
    """Optimizer steps speculators took, from the last checkpoint's training_state.json."""
    path = ckpt / "training_state.json"
    return int(json.loads(path.read_text())["global_step"]) if path.is_file() else None


if __name__ == "__main__":
    main()
