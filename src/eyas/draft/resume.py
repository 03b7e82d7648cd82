"""Saving a training run and resuming it, for both draft families: which checkpoint a run
continues (`resume_path`: rank 0 decides), restoring it (`resume`) after refusing one of another
draft, draft vocabulary or data plan and warning about a changed recipe (`check_same_draft`,
`check_same_vocab`, the run's `started_config`), and saving a step (`save_step`). The files
themselves are eyas.store.checkpoint's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from eyas.draft.processes import Env
from eyas.errors import EyasError
from eyas.store import checkpoint
from eyas.store.manifest import check_same_target, peek_manifest
from eyas.draft.train_config import DATA_ORDER, RESUMED, TrainConfig

log = logging.getLogger(__name__)


# draft_config.json keys a train flag sets, for the message that refuses another draft
_DRAFT_FLAGS = {"norm_before_fc": "--norm-before-fc", "fc_norm": "--fc-norm",
                "norm_output": "--norm-output", "norm_before_residual": "--norm-before-residual",
                "block_size": "--block-size", "mask_token_id": "--mask-token-id"}


def check_same_draft(resume: Path, record: dict, vocab: str | None = None,
                     given: str | None = None) -> None:
    """Refuse to resume `resume` when the draft it holds differs from this run's (`record`, the
    draft_config.json this run writes), naming what differs and the flags that resume it: e.g.
    a run started before EAGLE 3.1 became the default resumes with --no-norm-before-fc
    --no-norm-output, a DFlash run with its --block-size and --mask-token-id, a run of another
    draft vocabulary with the --vocab it started with (`vocab`, from its eyas.json; `given`:
    this run's, which may be that folder made again since)."""
    saved_file = Path(resume) / "draft_config.json"
    if not saved_file.is_file():
        return
    saved, now = json.loads(saved_file.read_text()), json.loads(json.dumps(record))
    family = saved.get("draft", "eagle3"), now.get("draft", "eagle3")
    if family[0] != family[1]:
        raise EyasError(f"{resume} holds a {family[0]} draft and this run trains {family[1]}: "
                        f"resume it with --draft {family[0]}, or start over with --resume never "
                        f"(or another --out).", flag="--resume")
    flags = dict(_DRAFT_FLAGS, num_hidden_layers="--draft-layers" if family[0] == "eagle3"
                 else "--dflash-layers")
    if family[0] == "eagle3":  # saved before --draft-layers: one layer
        saved.setdefault("num_hidden_layers", 1)
    differ = {k: (saved[k], v) for k, v in now.items() if k in saved and saved[k] != v}
    if not differ:
        return
    fix = [(f"{flags[k]}" if old else f"--no-{flags[k][2:]}")
           if isinstance(old, bool) else f"{flags[k]} {old}"
           for k, (old, _) in differ.items() if k in flags]
    if "draft_vocab_size" in differ:  # (a resume without --vocab: the whole target vocab)
        old = differ["draft_vocab_size"][0]
        fix.append(f"a --vocab of its {old} tokens ({vocab} was made again since the run "
                   f"started: make that vocab again into another folder, `eyas vocab "
                   f"--draft-vocab-size {old}` on the same data)" if vocab and given and
                   Path(given).resolve() == Path(vocab).resolve()
                   else f"--vocab {vocab}" if vocab
                   else "no --vocab (it trained over the whole target vocabulary)")
    if "aux_layer_ids" in differ:  # where the states come from, not a draft flag
        old = ",".join(map(str, differ["aux_layer_ids"][0]))
        fix.append(f"states of layers {old}: a --data capture made with --aux-layer-ids {old} "
                   f"(online: --aux-layer-ids {old})")
    raise EyasError(f"{resume} holds a draft with other settings than this run's: "
                    + ", ".join(f"{k} {old} there, {new} now" for k, (old, new) in differ.items())
                    + (f". Resume it with {' '.join(fix)}" if fix else
                       ". Resume it with the settings it was started with")
                    + ", or train a new run in another --out (--resume never deletes this "
                      "one's checkpoints).",
                    flag="--resume")


def resume_path(cfg: TrainConfig, env: Env) -> Path | None:
    """Rank 0 decides (only it needs the run folder) and tells the others."""
    path = None
    if env.main:
        path = checkpoint.resolve_resume(cfg.out, cfg.resume)
        if cfg.resume == "auto" and path is not None and \
                checkpoint.read_pointer(cfg.out, "last") is None:
            newer = sorted(p.name for p in path.parent.iterdir()
                           if checkpoint.STEP_DIR.match(p.name) and p.name > path.name)
            log.warning("%s has no `last` pointer to a checkpoint (the run was killed before "
                        "writing it, or it was removed): resuming from its latest complete "
                        "checkpoint %s%s",
                        path.parent, path.name, f"; {', '.join(newer)} (incomplete) will be "
                        f"removed" if newer else "")
        if cfg.resume == "never" and (Path(cfg.out) / "checkpoints").is_dir():
            log.warning("--resume never: deleting the old checkpoints in %s", cfg.out)
            checkpoint.clear_after(cfg.out, -1)
    if dist.is_initialized():
        box = [path]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    return path


def resume(cfg: TrainConfig, env: Env, model, optimizer, scheduler, plan,
           record: dict, draft=None, target: dict | None = None) -> dict | None:
    """The trainer state of the checkpoint this run continues (weights, optimizer, schedule
    and RNG restored into the given objects), or None for a fresh run. A run of another
    target than `target` (this run's inputs'), a checkpoint of another draft (`record`: this
    run's draft_config.json), of another draft vocabulary than `draft`'s (its d2t/t2d, from
    --vocab) or of another data plan is refused; another --epochs or --max-steps is warned
    about."""
    path = resume_path(cfg, env)
    if path is None:
        return None
    run = run_of(path, cfg.out)
    if run is None and env.main:
        log.warning("%s is not in a training run's checkpoints folder (RUN/checkpoints/step-N "
                    "beside RUN/eyas.json): the target, vocab and recipe it was trained with "
                    "cannot be checked against this run's", path)
    # the same samples captured from another target (a fine-tune, base for instruct) pass
    # every check below, and the run's manifest would then name the new target
    run = run or Path(cfg.out)
    check_same_target((peek_manifest(run) or {}).get("target"), target,
                      f"the training run in {run}",
                      fix="resume it on the data of the target it was started with, or start "
                          "over with --resume never (or a new --out)",
                      weights=not cfg.accept_other_weights)
    check_same_draft(path, record, started_config(run).get("vocab"), cfg.vocab)
    t2d = None if draft is None else draft.t2d.clone()  # (--vocab's, before the load)
    if env.main:
        _warn_recipe_changes(cfg, run)
    try:
        state = checkpoint.load(path, model, optimizer, scheduler)
    except (KeyError, RuntimeError, ValueError) as err:  # torch names only the missing state
        started = _started_with(cfg, run)
        raise EyasError(f"the optimizer state in {path} does not fit this run's trained "
                        f"parameters and optimizer (--optimizer {cfg.optimizer}, "
                        f"{'--freeze-lm-head' if cfg.freeze_lm_head else '--no-freeze-lm-head'}"
                        f"; {err}): it was saved by another. Resume with the settings the run "
                        f"started with"
                        + (f" ({started})" if started else "")
                        + ", or start over with --resume never.", flag="--resume") from err
    check_same_vocab(path, draft, t2d)
    from eyas.draft.train_setup import weights_finite

    if not weights_finite(model):  # saved before saving checked them (check_finite_weights)
        raise EyasError(f"{path} holds weights that are not finite (the run had diverged "
                        f"before that step was saved): resume from an earlier step folder in "
                        f"{path.parent} with --resume PATH and a lower --lr, or start over "
                        f"with --resume never", flag="--resume")
    if state["plan"] not in (plan.fingerprint, *plan.older_fingerprints):
        changed = _batching_changes(cfg, run)
        raise EyasError(f"{path} was trained with other data or batching "
                        + (f"than this command's: {', '.join(changed)}. Resume with the values "
                           f"it was started with"
                           if changed else
                           "(samples, --batch-tokens, --row-tokens, --truncate, --seed, ranks x "
                           "--grad-accum, --eval-fraction or --eval-data); resume with the same "
                           "settings and data")
                        + ", or train a new run in another --out (--resume never deletes this "
                          "one's checkpoints).", flag="--resume")
    if state["step"] > plan.total_steps:
        raise EyasError(f"{path} is step {state['step']}, past the {plan.total_steps} steps "
                        f"this run's --epochs / --max-steps give: resume with the length it "
                        f"was started with (or longer), or export it as it is", flag="--resume")
    if env.main:  # only now that it resumes: a refused resume deleted the later steps
        checkpoint.clear_after(cfg.out, state["step"])  # (the folder's name may be any)
    return state


def best_on_this_eval(state: dict, plan, metric: str, run_dir: str | Path,
                      quiet: bool = False) -> dict:
    """The resumed run's best record, while its evals measure the samples the best was measured
    on (`state["eval"]`, plan.eval_fingerprint); on other samples (another --eval-data,
    --eval-fraction or capture) its `metric` does not compare, so it is cleared and the next
    eval becomes the best. A checkpoint from before steps recorded their eval is kept as it
    is. So is a best no longer in `run_dir`'s checkpoints: --keep-last removed it when a later
    step became the best, and `--resume` of an earlier step removed that later one."""
    best = state["best"]
    if best.get("step") is not None and \
            not checkpoint.step_dir(run_dir, best["step"]).is_dir():
        if not quiet:
            log.warning("the resumed step's best checkpoint (step %d) is no longer in %s: "
                        "--keep-last removed it when a later step became the best, and "
                        "resuming an earlier step removed that one; the next eval becomes the "
                        "best", best["step"], Path(run_dir) / "checkpoints")
        return {**best, metric: None}
    was = state.get("eval")
    if was is None or was == plan.eval_fingerprint or best.get("step") is None:
        return best
    if not plan.eval_fingerprint:  # this run measures nothing: no next eval to be the best
        if not quiet:
            log.warning("the run's best checkpoint is step %d, measured before; resumed without "
                        "eval samples (--eval-fraction 0, no --eval-data), no later step is "
                        "measured, so it stays the best: `eyas export --which last` exports "
                        "the steps trained since", best["step"])
        return best
    if not quiet:
        log.warning("the run's best checkpoint (step %d) was measured on other eval samples "
                    "than this run's (another --eval-data, --eval-fraction or capture): its "
                    "acceptance does not compare with this run's evals, so the next eval "
                    "becomes the best. Resume with the eval data the run was started with to "
                    "keep comparing with it", best["step"])
    return {**best, metric: None}


def check_same_vocab(path: Path, draft, t2d: torch.Tensor | None) -> None:
    """Refuse a checkpoint whose draft vocabulary (restored with its weights) is not the one
    of --vocab (`t2d`, this run's): its head rows and the teacher's would be other tokens."""
    if t2d is not None and not torch.equal(draft.t2d.cpu(), t2d.cpu()):
        raise EyasError(f"{path} was trained with another draft vocabulary than --vocab's (same "
                        f"size, other tokens): give the --vocab folder the run started with "
                        f"(its eyas.json lists it under inputs), or start over with --resume "
                        f"never (or a new --out).", flag="--resume")


def run_of(path: Path, out: str | Path) -> Path | None:
    """The training run whose eyas.json says how checkpoint `path` was made: --out's where it
    holds the step, else the run around the step folder (RUN/checkpoints/step-N: `--resume`
    of another run's step into a new --out, whose own eyas.json says nothing yet), else None
    (a step folder copied out of its run)."""
    path, out = Path(path).resolve(), Path(out)
    if out.resolve() in path.parents:
        return out
    around = path.parent.parent
    if path.parent.name == "checkpoints" and (around / "eyas.json").is_file():
        return around
    return None


def started_config(out: str | Path) -> dict:
    """The train config the run in `out` was started with (its eyas.json), or {} for none."""
    try:
        return json.loads((Path(out) / "eyas.json").read_text()).get("config") or {}
    except (OSError, ValueError):
        return {}


def _batching_changes(cfg: TrainConfig, run: Path) -> list[str]:
    """The options of the data order and of the held-out samples that differ from those the
    run was started with (`run`'s eyas.json), as `--flag was, now` (ranks are not recorded: a
    count of processes that changed shows as no change here)."""
    old = started_config(run)
    out = []
    # the held-out samples too: --eval-fraction's (or none, with --eval-data) leave training
    for key in (*DATA_ORDER, "eval_fraction", "eval_data"):
        if key in old and old[key] != getattr(cfg, key):
            flag = "--" + key.replace("_", "-")
            was, now = (v if v is not None else "none" for v in (old[key], getattr(cfg, key)))
            out.append(f"{flag} {was} then, {now} now")
    return out


def _started_with(cfg: TrainConfig, run: Path) -> str:
    """The optimizer and lm_head flags of the run this one continues (`run`), or ''."""
    old = started_config(run)
    flags = []
    if "optimizer" in old:
        flags.append(f"--optimizer {old['optimizer']}")
    if "freeze_lm_head" in old:
        flags.append("--freeze-lm-head" if old["freeze_lm_head"] else "--no-freeze-lm-head")
    return " ".join(flags)


# what a resumed run may change, but then trains the rest of the run another way: the options
# it keeps unless given (RESUMED), but for the optimizer (refused at load), the draft's norms
# (check_same_draft) and the length (its own warning below)
_RECIPE = tuple(k for k in RESUMED
                if k not in ("optimizer", "norm_before_residual", "epochs", "max_steps"))


def _warn_recipe_changes(cfg: TrainConfig, run: Path) -> None:
    """Say which recipe options differ from the run this one continues (`run`'s eyas.json):
    the steps before the checkpoint were trained the old way; and a new --epochs / --max-steps
    (a run may be lengthened, but its learning-rate schedule then jumps to the new length's)."""
    old = started_config(run)
    new = dataclasses.asdict(cfg)
    changed = [f"--{k.replace('_', '-')} {old[k]} -> {new[k]}" for k in _RECIPE
               if k in old and json.loads(json.dumps(new[k])) != old[k]]
    if changed:
        log.warning("resuming %s with another recipe than it was started with (%s): the steps "
                    "before the checkpoint were trained the old way", run, "; ".join(changed))
    for name in ("epochs", "max_steps"):
        if name in old and old[name] != new[name]:
            flag = name.replace("_", "-")
            log.warning("the run in %s was started with --%s %s, resumed with %s: the learning "
                        "rate follows the new length's schedule from here (it jumps); resume "
                        "with --%s %s to keep the old one, or start over with --resume never",
                        run, flag, old[name], new[name], flag, old[name])


def save_step(run_dir: Path, step: int, model, optimizer, scheduler, *, cfg: TrainConfig,
              env: Env, plan, best: dict, record: dict, last_train, last_eval,
              eval_due: bool = False) -> None:
    """Checkpoint `step`: weights, optimizer, schedule, data position, RNG, this run's
    draft_config.json (`record`) and metrics; keep the last --keep-last and the best.
    `eval_due`: the step's eval was left for the resumed run (a stop on an eval step saves
    first: torchrun kills a rank 30 s after passing a SIGTERM on)."""
    from eyas.draft.train_setup import check_finite_weights

    check_finite_weights(model, step, cfg, run_dir)
    checkpoint.save(run_dir, step, model, optimizer, scheduler, draft_config=record,
                    keep_last=cfg.keep_last,
                    state={"step": step, "data_position": step * plan.per_step,
                           "plan": plan.fingerprint, "eval": plan.eval_fingerprint,
                           "best": best,
                           "world_size": env.world_size, "eval_due": eval_due},
                    metrics={"train": last_train, "eval": last_eval}, best_step=best["step"])
