"""The run folder: checkpoints (save, find, load, prune `checkpoints/step-NNNNNNNN/`), the
metrics log and the training curves.

A step folder holds `draft.safetensors` (the draft state dict in fp32 master precision, the
names `eyas export` reads), `draft_config.json`, `trainer_state.pt` (optimizer, scheduler,
data position, the RNG state of every rank) and `metrics.json`. It is written under a `.tmp`
name and renamed when complete, then the `checkpoints/last` pointer (a one-line text file) is
replaced atomically, so a run killed at any moment resumes from the last complete step.
`checkpoints/best` names the step with the highest chain acceptance length replayed on the
eval split (docs/train.md).

Saving and loading are collective under torch.distributed: the full (unsharded) state is
gathered to rank 0, which alone writes; on load rank 0 reads and broadcasts, so multi-node runs
need the run folder only on the first node.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

from eyas.errors import EyasError
from eyas.store.manifest import inside
from eyas.store.permissions import as_umask

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


# ---------------------------------------------------------------- RNG

def rng_state() -> dict:
    """Every generator a training step may draw from, in a form `torch.load` reads safely."""
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_rng() -> list[dict]:
    mine = rng_state()
    if not _distributed():
        return [mine]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


# ---------------------------------------------------------------- pointers

def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_pointer(run_dir: str | Path, name: str) -> Path | None:
    """The step folder named by `checkpoints/last` or `checkpoints/best`, if it exists."""
    ptr = Path(run_dir) / "checkpoints" / name
    if not ptr.is_file():
        return None
    text = ptr.read_text().strip()
    if not STEP_DIR.match(text):
        raise EyasError(f"{ptr} names {text!r}, not a step-NNNNNNNN folder beside it (eyas "
                        f"writes only such names there; the file was edited). Delete {ptr} "
                        f"(`last`: training then resumes from the latest complete step "
                        f"folder, or pass --resume "
                        f"{ptr.parent}/step-NNNNNNNN; `best`: export with --which step-N).",
                        flag="--resume")
    target = inside(ptr.parent, text, f"checkpoints/{name}")
    return target if (target / "trainer_state.pt").is_file() else None


def damage(path: Path) -> str | None:
    """What keeps step folder `path` from being a whole checkpoint, or None: one of its four
    files missing, the weights' header or the draft config unreadable, the trainer state's zip
    directory broken (both at the files' ends: a file cut short fails)."""
    files = ("draft.safetensors", "draft_config.json", "metrics.json", "trainer_state.pt")
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        return f"{', '.join(missing)} missing"
    try:
        with safe_open(path / "draft.safetensors", "pt"):
            pass
    except (OSError, ValueError, SafetensorError) as err:
        return f"draft.safetensors unreadable: {str(err)[:100]}"
    try:
        json.loads((path / "draft_config.json").read_text())
    except (OSError, ValueError) as err:
        return f"draft_config.json unreadable: {str(err)[:100]}"
    if not zipfile.is_zipfile(path / "trainer_state.pt"):
        return "trainer_state.pt is not a whole torch.save file (cut short or overwritten)"
    return None


def complete(path: Path) -> bool:
    """Whether step folder `path` holds a whole checkpoint (`damage` finds nothing)."""
    return damage(path) is None


def latest_complete(run_dir: str | Path, before: str | None = None) -> Path | None:
    """The newest complete step folder of the run in `run_dir` (older than the step folder
    named `before`, if given), or None."""
    ckpt = Path(run_dir) / "checkpoints"
    steps = sorted((p for p in ckpt.iterdir() if p.is_dir() and STEP_DIR.match(p.name)
                    and (before is None or p.name < before)),
                   reverse=True) if ckpt.is_dir() else []
    return next((p for p in steps if complete(p)), None)


def resolve_resume(run_dir: str | Path, resume: str) -> Path | None:
    """`auto`: the checkpoint `last` names, else (a run killed before its first `last` was
    written, or with the pointer gone) its latest complete step folder, if any; `never`:
    none; else a path."""
    if resume == "never":
        return None
    if resume == "auto":
        path = read_pointer(run_dir, "last") or latest_complete(run_dir)
    else:
        path = Path(resume)
        if not (path / "trainer_state.pt").is_file():
            raise EyasError(f"--resume {resume}: no checkpoint there (expected a "
                            f"checkpoints/step-NNNNNNNN folder holding trainer_state.pt); use "
                            f"--resume auto to continue the run in --out, or --resume never.",
                            flag="--resume")
    if path is not None and (why := damage(path)) is not None:
        # the `last` pointer names it, or it was given: damaged after it was written whole
        # (a copy cut short, a disk error), so resuming elsewhere is the user's choice
        older = latest_complete(path.parent.parent, before=path.name)
        fix = (f"resume from {older}, the latest whole checkpoint before it, with --resume "
               f"{older} (the steps after it are trained again)" if older else
               "no whole checkpoint before it is left: start over with --resume never (or "
               "another --out)")
        raise EyasError(f"checkpoint {path} is damaged ({why}), so the run cannot resume from "
                        f"it: {fix}. Copying the run folder again from where it was written "
                        f"also repairs it.", flag="--resume")
    return path


# ---------------------------------------------------------------- save / load

def save(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer, scheduler, *,
         draft_config: dict, state: dict, metrics: dict, keep_last: int,
         best_step: int | None, prefix: str = "draft.") -> Path | None:
    """Write checkpoint `step` (collective; rank 0 writes) and prune old ones.

    `model` may be wrapped by DDP or FSDP2; the draft's weights are those under `prefix`,
    saved without it. `state` is the trainer's small dict (step, data position, plan
    fingerprint, best record); the optimizer, scheduler and every rank's RNG are added here.
    """
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)
    optim = get_optimizer_state_dict(model, optimizer, options=opts)
    rngs = _gather_rng()
    if _rank() != 0:
        return None
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file({k.removeprefix(prefix): v.detach().contiguous() for k, v in weights.items()},
                  tmp / "draft.safetensors", metadata={"format": "pt", "step": str(step)})
        (tmp / "draft_config.json").write_text(json.dumps(draft_config, indent=2) + "\n")
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        torch.save({**state, "optimizer": optim, "scheduler": scheduler.state_dict(),
                    "rng": rngs}, tmp / "trainer_state.pt")
    except (OSError, RuntimeError, SafetensorError) as err:  # a full disk, a quota
        shutil.rmtree(tmp, ignore_errors=True)
        last = (final.parent / "last").read_text().strip() if (final.parent / "last").is_file() \
            else "none yet"
        raise EyasError(f"cannot write checkpoint {final.name} into {final.parent} ("
                        f"{str(err).splitlines()[0] if str(err) else type(err).__name__}): "
                        f"free space there (or make it writable) and run the same command "
                        f"again; it resumes from the last checkpoint saved ({last})") from err
    as_umask(tmp)  # safetensors writes owner-only; export reads these as any other user may
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_text(final.parent / "last", final.name + "\n")
    if best_step is not None and step_dir(run_dir, best_step).is_dir():
        _write_text(final.parent / "best", f"step-{best_step:08d}\n")
    prune(run_dir, keep_last)
    return final


def load(path: str | Path, model: torch.nn.Module, optimizer, scheduler, *,
         prefix: str = "draft.") -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG from checkpoint `path`
    (collective); returns the trainer state dict (step, data position, ...)."""
    distributed = _distributed()
    rank0 = _rank() == 0
    path = Path(path)
    weights = {prefix + k: v for k, v in load_file(path / "draft.safetensors").items()} \
        if rank0 or not distributed else {}
    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True) \
        if rank0 or not distributed else {}
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    set_model_state_dict(model, weights, options=opts)
    set_optimizer_state_dict(model, optimizer, state.get("optimizer", {}), options=opts)
    if distributed:  # the small rest of the state travels as a Python object
        box = [{k: v for k, v in state.items() if k != "optimizer"}]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    scheduler.load_state_dict(state["scheduler"])
    rngs = state["rng"]
    if len(rngs) != (dist.get_world_size() if distributed else 1):
        log.warning("checkpoint was written by %d ranks, resuming on a different count: RNG "
                    "streams restart from rank 0's state", len(rngs))
    set_rng_state(rngs[_rank()] if _rank() < len(rngs) else rngs[0])
    if _rank() == 0:
        log.info("resumed from %s (step %d)", path, state["step"])
    return state


def prune(run_dir: str | Path, keep_last: int) -> None:
    """Delete step folders except the newest `keep_last` and the best; clear stale temps."""
    ckpt = Path(run_dir) / "checkpoints"
    best = read_pointer(run_dir, "best")
    steps = sorted(p for p in ckpt.iterdir() if p.is_dir() and STEP_DIR.match(p.name))
    for p in steps[:-keep_last]:
        if best is None or p.name != best.name:
            shutil.rmtree(p)
    for p in ckpt.glob("step-*.tmp"):
        if p.is_dir():
            shutil.rmtree(p)


def clear_after(run_dir: str | Path, step: int) -> None:
    """Remove checkpoints newer than `step` (left by a run that is now being restarted from
    an earlier point, e.g. with --resume PATH), so pointers never name a future step."""
    ckpt = Path(run_dir) / "checkpoints"
    if not ckpt.is_dir():
        return
    for p in ckpt.iterdir():
        m = STEP_DIR.match(p.name)
        if p.is_dir() and m and int(m.group(1)) > step:
            shutil.rmtree(p)
    for name in ("last", "best"):
        ptr = ckpt / name
        if ptr.is_file() and read_pointer(run_dir, name) is None:
            ptr.unlink()


# ---------------------------------------------------------------- metrics

class MetricsLog:
    """metrics.jsonl (always), TensorBoard scalars (if installed); rank 0 only."""

    def __init__(self, run_dir: Path, resume_step: int, eval_due: bool = False):
        """`eval_due`: the resumed step's eval runs again (a stop left it): a record of it
        from an earlier resume that was killed before its next save is dropped too."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        kept = []
        # the training seconds of the parts before this one (the last kept train record's
        # elapsed_s): a resumed run's elapsed_s goes on from there rather than from 0
        self.elapsed_before = 0.0
        if self.path.is_file() and resume_step > 0:  # drop records of steps lost with a kill
            rows = []
            for ln in self.path.read_text().splitlines():
                try:
                    rows.append((ln, json.loads(ln)))
                except ValueError:  # a line torn by a crash or power loss: not a record
                    if ln.strip():
                        log.warning("%s: an unreadable line dropped on resume: %.80s",
                                    self.path, ln)
            kept_rows = [(ln, r) for ln, r in rows if r.get("step", 0) <= resume_step
                         and not (eval_due and r.get("kind") == "eval"
                                  and r.get("step") == resume_step)]
            kept = [ln for ln, _ in kept_rows]
            trained = [r["elapsed_s"] for _, r in kept_rows
                       if r.get("kind") == "train" and "elapsed_s" in r]
            self.elapsed_before = float(trained[-1]) if trained else 0.0
        self.path.write_text("".join(ln + "\n" for ln in kept))
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: on resume, TensorBoard drops the events of the steps lost with the
            # kill (the same cut as metrics.jsonl above)
            if resume_step == 0:  # a run started over: the old run's events go with it
                shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
            self.tb = SummaryWriter(str(run_dir / "tensorboard"),
                                    purge_step=resume_step + 1 if resume_step > 0 else None)
        except ImportError:
            log.debug("tensorboard not installed: metrics go to metrics.jsonl only")

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(f"{record['kind']}/{key}", value, record["step"])
                elif isinstance(value, list):
                    for j, v in enumerate(value):
                        self.tb.add_scalar(f"{record['kind']}/{key}_{j}", v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plot_curves(run_dir: Path) -> Path | None:
    """curves.png: loss, step-0 accuracy and simulated acceptance length, train and eval."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed: no curves.png (pip install matplotlib)")
        return None
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for kind, style in (("train", "-"), ("eval", "o-")):
        got = [r for r in rows if r["kind"] == kind]
        if not got:
            continue
        steps = [r["step"] for r in got]
        axes[0].plot(steps, [r["loss"] for r in got], style, label=kind)
        axes[1].plot(steps, [r["acc"][0] for r in got], style, label=kind)
        axes[2].plot(steps, [r["sim_acceptance_length"] for r in got], style, label=kind)
    titles = ("TTT loss", "step-0 top-1 accuracy", "simulated acceptance length")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    path = run_dir / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
