"""`eyas train`: the EAGLE-3 draft training recipe, one function with one visible loop.

Setup (inputs, draft, DDP/FSDP2, optimizer, schedule, resume), then per optimizer step:
load `grad_accum` micro-batches -> forward (TTT, `ttt_steps` chained draft passes) -> loss
-> backward -> clip -> AdamW step -> log -> eval -> checkpoint. One process or `torchrun`
with any number of ranks and nodes runs the same code; eyas.draft's processes, data,
data_plan, train_setup and resume modules hold what runs before the loop (only train_setup's
`wrap` differs between DDP and FSDP2); its train_config module, TrainConfig: the flags, their
defaults and checks.

The loss of an optimizer step is  sum_j w^j * (summed soft-CE of step j) / N_j  where N_j
counts the positions carrying a step-j loss in the WHOLE step (every micro-batch on every
rank). Normalising by the global count, not per micro-batch, is what makes batch 4 x
accumulation 1, batch 1 x accumulation 4 and 4 ranks x batch 1 the same update.

Defaults and where they come from (docs/train.md has the discussion): AdamW betas
(0.9, 0.999), cosine decay after 1.5% linear warmup, grad clip 0.5, no weight decay are
SpecForge's EAGLE-3 defaults (its schedule is stated as a fraction of the run, so it scales
to any data size); TTT length 7 with step weight 0.8 is common to SpecForge and EAGLE. The
peak lr is 1e-3 (speculators' default), not SpecForge's 1e-4: issue 31's ablation on a real
target found the learning rate to be what made speculators' drafts better than eyas's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch

from eyas.config import ConfigError, coerce, field_types
from eyas.kernels import band_kernels
from eyas.store import checkpoint, locks
from eyas.draft import data, data_loader
from eyas.draft.loss import Objective, chain_acceptance, simulated_acceptance_length
from eyas.store.manifest import check_out, train_run, write_manifest
from eyas.draft.data_plan import plan_data, rank_slice
from eyas.draft.processes import (Env, StopOnSignal, all_sum, autocast, compute_dtype,
                                  finish_env, init_env, peak_gib)
from eyas.draft.resume import best_on_this_eval, resume, run_of, save_step, started_config
from eyas.draft.train_setup import (Schedules, TTTModule, build_draft, build_optimizers,
                                    check_finite, check_gradients, grad_sync, warmup_cosine,
                                    wrap)
from eyas.draft.train_config import PREVIOUS_RECIPE, TrainConfig
from eyas.draft.ttt import TTTBatch, ttt_plan, ttt_positions
from eyas.draft.ttt_graph import GraphedTTT

log = logging.getLogger(__name__)


def _item(t: torch.Tensor) -> float:
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)  # FSDP2: a DTensor


def _on(mb: dict, env: Env):
    """A micro-batch on the draft's device. Online, captured states arrive on the device of
    the target's final norm, which --target-device-map may put on another GPU."""
    return TTTBatch(**data_loader.on_device(mb, env.device))


def _summary(stats: torch.Tensor, steps: int, weights: torch.Tensor) -> dict:
    """stats = [loss sums (S), correct (S), counts (S), positions scored (S: those counted
    plus those whose target token is outside the draft vocab, misses)] summed over batches and
    ranks, then (eval) the chain counts of _chain_stats."""
    sums, correct, counts = stats[:steps], stats[steps:2 * steps], stats[2 * steps:3 * steps]
    acc = (correct / stats[3 * steps:4 * steps].clamp(min=1)).tolist()
    out = {"loss": float((weights * sums / counts.clamp(min=1)).sum()),
           "acc": [round(a, 5) for a in acc],
           "sim_acceptance_length": round(simulated_acceptance_length(acc), 5),
           "positions": int(counts[0])}
    if stats.shape[0] > 4 * steps:
        out["chain"] = _chain_summary(stats[4 * steps:].tolist(), steps)
    return out


def _batch_stats(out, steps: int) -> torch.Tensor:
    """(3S,) loss sums, correct and counts of one TTT forward (detached, float64)."""
    counts = out.step_count.double()
    return torch.cat([out.step_loss_sum.detach().double(),
                      (out.step_acc.double() * counts).round(), counts])


def _chain_stats(out, batch: TTTBatch, steps: int) -> torch.Tensor:
    """For k = 1..S: [drafts, accepted at positions 0..k-1] of chain decoding replayed on
    the batch (eyas.draft.loss.chain_acceptance), flat (S + S(S+1)/2,) float64."""
    counts = []
    for k in range(1, steps + 1):
        drafts, accepted = chain_acceptance(out.hits, batch.loss_mask, batch.doc_ids, k)
        counts += [drafts, *accepted]
    return torch.tensor(counts, dtype=torch.float64, device=out.hits.device)


def _chain_summary(counts: list[float], steps: int) -> dict:
    """Per k: the simulated mean acceptance length and per-position acceptance as vLLM
    counts them (what `eyas eval` measures), from the _chain_stats sums."""
    al, per_position, at = {}, {}, 0
    for k in range(1, steps + 1):
        drafts, accepted = counts[at], counts[at + 1: at + 1 + k]
        at += 1 + k
        al[str(k)] = round(1 + sum(accepted) / drafts, 5) if drafts else None
        per_position[str(k)] = [round(a / drafts, 5) if drafts else None for a in accepted]
    return {"drafts": int(counts[0]), "acceptance_length": al, "per_position": per_position}


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, env: Env, steps: int,
             weights: torch.Tensor, t2d: torch.Tensor) -> dict:
    """Per-step accuracy, loss and simulated acceptance length over the whole eval set, and
    chain decoding replayed on it for every k <= steps (`chain`: vLLM's counting). The loss
    leaves out the positions whose target token is outside the draft vocab (`t2d`); accuracy
    counts them as misses, since the draft cannot propose that token (a tiny vocab would
    otherwise score perfect), as the chain replay does."""
    model.eval()
    stats = torch.zeros(4 * steps + steps + steps * (steps + 1) // 2, dtype=torch.float64,
                        device=env.device)
    for mb in loader:
        batch = _on(mb, env)
        with autocast(env):
            out = model(batch, record_hits=True)
        scored = ttt_positions(batch, t2d, steps, vocab_filter=False).sum(1).double()  # (S,)
        stats += torch.cat([_batch_stats(out, steps), scored, _chain_stats(out, batch, steps)])
    model.train()
    return _summary(all_sum(stats), steps, weights.to(stats))


def _progress(rec: dict, total: int, elapsed: float, start: int) -> str:
    done = rec["step"] - start
    eta = elapsed / max(done, 1) * (total - rec["step"])
    acc = "/".join(f"{a:.2f}" for a in rec["acc"][:4])
    return (f"step {rec['step']}/{total} | loss {rec['loss']:.4f} | acc {acc} | "
            f"AL {rec['sim_acceptance_length']:.2f} | {rec['tokens_per_s']:.0f} tok/s | "
            f"lr {rec['lr']:.2e} | ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")


# what a run folder holds besides its eyas.json (docs/train.md, "The run folder")
RUN_FILES = ("checkpoints", "metrics.jsonl", "curves.png", "tensorboard", ".train.lock")


def keep_run_recipe(cfg: TrainConfig) -> TrainConfig:
    """A resumed run keeps its own recipe: each option of it left unset here (RESUMED: the
    learning rate and schedule, the optimizer's settings, the loss, the run's length, ...)
    takes the value the run was started with (its eyas.json; a run from before a recipe
    option existed trained with the previous recipe's value, one from before another option
    with today's default), so that neither a change of eyas's defaults nor a flag left out of
    the command changes a run halfway. Options given here win (warned about at resume); a
    length given as --epochs or --max-steps is the run's whole length (the other keeps its
    default)."""
    unset = getattr(cfg, "_unset", frozenset())
    if {"epochs", "max_steps"} - unset:
        unset -= {"epochs", "max_steps"}
    if cfg.resume == "never" or not unset:
        return cfg
    path = checkpoint.resolve_resume(cfg.out, cfg.resume)
    if path is None:
        return cfg
    run = run_of(path, cfg.out) or Path(cfg.out)  # (--resume of another run's step: that run)
    old = started_config(run)
    # a run of the other draft family: its recipe does not apply here, and resume() refuses
    # the checkpoint naming --draft (check_same_draft)
    if not old or old.get("draft", "eagle3") != cfg.draft:
        return cfg
    types = field_types(TrainConfig)
    keep = {k: coerce(k, types[k], old[k] if k in old else PREVIOUS_RECIPE[k])
            for k in sorted(unset) if k in old or k in PREVIOUS_RECIPE}
    keep = {k: v for k, v in keep.items() if v != getattr(cfg, k)}
    if not keep:
        return cfg
    flags = ", ".join(_as_flag(k, v) for k, v in keep.items())
    log.info("resuming %s with the recipe it was started with for the options not given here "
             "(%s); give them to change them", run, flags)
    try:
        return dataclasses.replace(cfg, **keep)
    except ConfigError as err:  # e.g. --lm-head scratch given, the run's head frozen
        raise ConfigError(f"{run} resumes with the recipe it was started with for the options "
                          f"not given here ({flags}), and with those given here it is "
                          f"refused: {err}. Give the option that conflicts the run's value, or "
                          f"drop it (a resume continues the checkpoint's weights), or train a "
                          f"new run in another --out") from None


def _as_flag(key: str, value) -> str:
    """An option's value as the flag that sets it: --freeze-lm-head / --no-freeze-lm-head."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} " + (",".join(map(str, value)) if isinstance(value, tuple) else str(value))


def _best_at(best: dict, k: int, quiet: bool = False) -> dict:
    """A resumed run's best record, compared at k = its --ttt-steps: replayed acceptance lengths
    at another k do not compare (a longer chain accepts more tokens). Resumed with fewer TTT
    steps than the best was chosen at, the best's own length at k comes from its eval (which
    replayed every k up to its own: chain_by_k); with more, it was never measured at k, so the
    next eval becomes the best."""
    by_k = best.get("chain_by_k")
    if best.get("step") is None or not by_k or best.get("chain_acceptance_length") == \
            by_k.get(str(k)):
        return best
    al = by_k.get(str(k))
    if not quiet and al is None:
        reached = max(by_k, key=int)
        log.warning("the run's best checkpoint (step %d) has no replayed chain acceptance "
                    "length at k = %d, this run's --ttt-steps (its eval replayed k = 1..%s): "
                    "the next eval becomes the best. Resume with --ttt-steps %s or fewer to "
                    "keep comparing with it", best["step"], k, reached, reached)
    elif not quiet:
        log.info("the run's best checkpoint (step %d) is compared at k = %d (--ttt-steps) from "
                 "here: its replayed chain acceptance length there is %s", best["step"], k, al)
    return {**best, "chain_acceptance_length": al}


def train(cfg: TrainConfig) -> dict:
    """Train an EAGLE-3 draft (or with --draft dflash a DFlash one, eyas.dflash.train)
    into `cfg.out` (see docs/train.md). Returns the run summary:
    steps, best {step, chain_acceptance_length, chain_by_k, sim_acceptance_length}, and the
    last train and eval metrics."""
    # --out: empty, new, or an earlier run of this step (resumed); never a user's files. A
    # killed run can leave its files before its manifest, so they count as its own then too
    check_out(cfg.out, "train", own=RUN_FILES, unfinished=RUN_FILES)
    # one run at a time in a folder (rank 0 holds it for a torchrun job's ranks)
    busy = (f"another eyas train is writing into {cfg.out} (its process id is in "
            f"{Path(cfg.out) / '.train.lock'}); wait for it to end or stop it (it saves its "
            f"step and resumes), or give another --out")
    with locks.exclusive(Path(cfg.out) / ".train.lock", busy) if locks.main_process() \
            else contextlib.nullcontext():
        cfg = keep_run_recipe(cfg)
        if cfg.draft == "dflash":  # its own loop, on the same setup pieces (docs/dflash.md)
            from eyas.dflash.train import train_dflash

            return train_dflash(cfg)
        return _train_eagle3(cfg)


def _train_eagle3(cfg: TrainConfig) -> dict:
    """`train` for an EAGLE-3 draft: set-up, the loop, the finish."""
    # ---- setup: processes, inputs, draft, parallelism, data plan, optimizer, resume
    band_kernels.attention_choice()  # a bad EYAS_ATTENTION stops here, not at the first step
    env = init_env(cfg)
    run_dir, dtype = Path(cfg.out), compute_dtype(env)
    inputs = data.open_inputs(cfg, env.device, "bfloat16" if env.autocast else "float32")
    draft, dcfg = build_draft(cfg, inputs, env)
    teacher = inputs.lm_head[draft.t2d.to(inputs.lm_head.device)]  # (Vd, Ht) frozen
    teacher = teacher.to(env.device, dtype)  # from the target's (maybe other) GPU to the draft's
    objective = Objective(cfg.loss, cfg.lk_kl_scale, cfg.lk_kl_decay)
    positions = {"mask_at": cfg.loss_mask_at, "vocab_filter": cfg.vocab_filter}
    model = wrap(TTTModule(draft, teacher, cfg.ttt_steps, env.fp8, objective, **positions),
                 cfg, env)
    plan = plan_data(cfg, inputs, env)
    total, steps, row = plan.total_steps, cfg.ttt_steps, plan.packing.row_tokens
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizers(cfg, model)  # a list: AdamW, or Muon + AdamW
    if cfg.optimizer == "muon" and env.device.type == "cpu":
        log.warning("Muon on the CPU is slow: torch.optim.Muon orthogonalises each update in "
                    "bfloat16 (measured: 35 s per step for one 4864 x 896 matrix on 2 cores, "
                    "where three whole AdamW steps of that draft took 2 s); --optimizer adamw "
                    "trains much faster here, with another recipe than the GPU default")
    scheduler = Schedules(optimizer, warmup_cosine(total, cfg.warmup_ratio, cfg.min_lr_ratio,
                                                   cfg.lr_decay))
    start, best = 0, {"step": None, "sim_acceptance_length": None}
    record = dcfg.to_dict()  # the run's draft_config.json
    state = resume(cfg, env, model, optimizer, scheduler, plan, record, draft, inputs.target)
    if state is not None:  # (its best compared at this run's k: _best_at)
        best = best_on_this_eval(state, plan, "chain_acceptance_length", run_dir,
                                 quiet=not env.main)
        start, best = state["step"], best if best.get("chain_acceptance_length") is None \
            else _best_at(best, steps, quiet=not env.main)
    run = train_run(run_dir, resumed=state is not None)  # one id from first step to last
    eval_due = bool(state and state.get("eval_due"))  # stopped on an eval step: run it first
    workers = 0 if cfg.online else cfg.num_workers  # online: the target runs in this process
    pin = env.device.type == "cuda" and not cfg.online
    mine = rank_slice(plan.batches, rank=env.rank, world_size=env.world_size,
                      start=start * plan.per_step)
    # fixed shapes only where a replay or compiled graph needs them; else a micro-batch is as
    # wide as its longest row (a small dataset is not padded to --batch-tokens)
    static = cfg.cuda_graph or cfg.compile
    batches = iter(data_loader.loader(inputs.train, mine, row, dtype, num_workers=workers,
                                      pin_memory=pin, static=static))
    metrics = checkpoint.MetricsLog(run_dir, start, eval_due) if env.main else None
    weights = cfg.step_weight ** torch.arange(steps, dtype=torch.float32, device=env.device)
    t2d_host = draft.t2d.cpu()
    graphed = GraphedTTT(model, params) if cfg.cuda_graph else None

    def run_eval(step: int) -> dict:
        loader = data_loader.loader(inputs.eval, plan.eval_batches, row, dtype,
                                    num_workers=workers, pin_memory=pin, static=static)
        record = {"kind": "eval", "step": step,
                  **evaluate(model, loader, env, steps, weights, draft.t2d)}
        if metrics:
            metrics.write(record)
            chain = record["chain"]["acceptance_length"]
            ks = sorted({1, min(3, steps), steps})
            log.info("eval step %d | loss %.4f | acc %s | simulated AL %.3f | replayed "
                     "chain AL %s (k=%s)", step, record["loss"], record["acc"],
                     record["sim_acceptance_length"],
                     "/".join(str(chain.get(str(k))) for k in ks), "/".join(map(str, ks)))
        return record

    def judge(step: int) -> tuple[dict, bool]:
        """Step `step`'s eval, and whether it is the best so far: the highest acceptance
        length of chain decoding replayed on the eval set with k = ttt_steps (counted as
        vLLM counts it; the per-step product overstates it: docs/train.md)."""
        nonlocal best
        ev = run_eval(step)
        al = ev["chain"]["acceptance_length"][str(steps)] or 1.0
        known = best.get("chain_acceptance_length")  # None: not measured at this k (_best_at)
        new = best["step"] is None or known is None or al > known
        if new:
            best = {"step": step, "chain_acceptance_length": al,
                    "chain_by_k": ev["chain"]["acceptance_length"],
                    "sim_acceptance_length": ev["sim_acceptance_length"]}
        return ev, new

    if env.main:
        write_manifest(run_dir, "train", cfg, target=inputs.target, inputs=inputs.manifests,
                       truncated=plan.truncated or {},
                       aux_layer_ids=list(inputs.aux_layer_ids), run=run, complete=False)
        log.info("training steps %d..%d on %d samples: %d micro-batch(es) of %d x %d tokens "
                 "per step over %d rank(s) on %s", start + 1, total, len(inputs.train_ids),
                 plan.per_step, plan.packing.rows, row, env.world_size, env.device.type)
    last_train, last_eval = {}, (run_eval(0) if plan.eval_batches and start == 0 else {})
    # the eval a stop left; a best it finds is recorded by the next save, which keeps that
    # step's folder
    if eval_due and plan.eval_batches:
        last_eval, _ = judge(start)
    window = torch.zeros(4 * steps + 1, dtype=torch.float64, device=env.device)  # + tokens
    t_window = t_start = time.perf_counter()
    before = metrics.elapsed_before if metrics else 0.0  # the earlier parts' seconds
    model.train()
    stop = StopOnSignal()  # SIGTERM / SIGINT: save this step, then exit
    try:
        # ---- the loop: one optimizer step per iteration
        for step in range(start + 1, total + 1):
            # 1. This rank's micro-batches; N_j = positions with a step-j loss in the whole step.
            micro = [next(batches) for _ in range(cfg.grad_accum)]
            # plans made from the host batch need no GPU sync per forward (ttt_plan; online, the
            # batch is on the GPU already and its plan syncs as before); not under --compile,
            # whose graphs would be specialised on each plan's row counts
            plans = [None if cfg.compile else ttt_plan(TTTBatch(**data_loader.host_fields(mb)),
                                                        t2d_host, steps, device=env.device,
                                                        static=cfg.cuda_graph, **positions)
                     for mb in micro]
            micro = [_on(mb, env) for mb in micro]
            counted = [ttt_positions(b, draft.t2d, steps, **positions) if p is None else p.valid
                       for b, p in zip(micro, plans)]
            denom = stop.sum_with(sum(c.sum(1) for c in counted).float())  # an all_sum
            # the positions accuracy counts, (S, N) each: the loss's plus, under --vocab-filter,
            # those it leaves out (the target's token is outside the draft vocab) as misses, as
            # eval counts them; a few elementwise ops where the batch is, no sync
            scored = [ttt_positions(b, draft.t2d, steps, cfg.loss_mask_at, vocab_filter=False)
                      if cfg.vocab_filter else c for b, c in zip(micro, counted)]
            # 2. Forward -> loss -> backward; gradients all-reduce on the last micro-batch only.
            #    DDP/FSDP average gradients over ranks, hence the world_size factor.
            scale = weights / denom.clamp(min=1) * env.world_size
            for a, batch in enumerate(micro):
                if graphed is not None:  # forward + backward of the same loss, replayed
                    with autocast(env):
                        out = graphed(batch, plans[a], scale)
                else:
                    with grad_sync(model, a == len(micro) - 1):
                        with autocast(env):
                            out = model(batch, plans[a])
                        (scale * out.step_loss_sum).sum().backward()
                window[:-1] += torch.cat([_batch_stats(out, steps), scored[a].sum(1).double()])
                window[-1] += (batch.doc_ids >= 0).sum()  # real tokens; no host sync
            if step == start + 1:
                check_gradients(model, cfg, graphed)
            # 3. Clip the global gradient norm, step the optimizer(s) and the schedule.
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))
            lr = scheduler.get_last_lr()[0]  # this step's (after the step: the next one's)
            for opt in optimizer:
                opt.step()
                opt.zero_grad(set_to_none=graphed is None)  # a graph keeps its .grad tensors
            scheduler.step()
            # 4. Log (window sums over all ranks); a stop agreed by every rank logs its
            #    step too, so no step's tokens and losses go unlogged across the resume.
            stopping = stop.agreed()
            if step % cfg.log_every == 0 or step == total or stopping:
                stats, now = all_sum(window).tolist(), time.perf_counter()
                last_train = {"kind": "train", "step": step,
                              "epoch": plan.epoch_of[(step - 1) * plan.per_step],
                              **_summary(torch.tensor(stats[:-1]), steps, weights.double().cpu()),
                              "lr": lr, "grad_norm": _item(norm),
                              "tokens": int(stats[-1]),
                              "tokens_per_s": stats[-1] / (now - t_window),
                              "elapsed_s": round(before + now - t_start, 2)}
                if env.device.type == "cuda":
                    last_train["peak_gpu_gib"] = peak_gib(env)
                check_finite(last_train, cfg, run_dir)
                window.zero_()
                t_window = now
                if metrics:
                    metrics.write(last_train)
                    log.info(_progress(last_train, total, now - t_start, start))
            # 5. Evaluate (the best checkpoint: `judge`); a stop saves first and leaves the
            #    eval to the resumed run, which runs it before its first step.
            new_best = eval_due = False
            if plan.eval_batches and (step % cfg.eval_every == 0 or step == total):
                if stopping and step < total:
                    eval_due = True
                else:
                    last_eval, new_best = judge(step)
            # 6. Checkpoint: weights, optimizer, schedule, data position, RNG; keep last N + best.
            if step % cfg.save_every == 0 or step == total or new_best or stopping:
                save_step(run_dir, step, model, optimizer, scheduler, cfg=cfg, env=env, plan=plan,
                          best=best, record=record, last_train=last_train, last_eval=last_eval,
                          eval_due=eval_due)
            if stopping and step < total:
                stop.exit(env, step, total, run_dir)
    finally:
        stop.restore()
        batches.close()  # its reading threads finish the reads under way and end
    # ---- finish: curves, manifest, summary
    if metrics:
        metrics.close()
        checkpoint.plot_curves(run_dir)
        write_manifest(run_dir, "train", cfg, target=inputs.target, inputs=inputs.manifests,
                       truncated=plan.truncated or {},
                       aux_layer_ids=list(inputs.aux_layer_ids), run=run, complete=True,
                       best=best, steps=total, draft_config=record)
        log.info("done: best step %s (replayed chain AL %s at k=%d) in %s", best["step"],
                 best.get("chain_acceptance_length"), steps, run_dir / "checkpoints")
        if cfg.online and cfg.online_cache != "off":
            log.info(inputs.train.cache.summary())
    finish_env(env)
    stop.after_last_step()
    return {"steps": total, "best": best, "train": last_train, "eval": last_eval}
