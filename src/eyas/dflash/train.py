"""`eyas train --draft dflash`: the DFlash recipe, one function with one visible loop.

The same setup as EAGLE-3's (eyas.draft's processes, data, data_plan, train_setup and resume
modules: processes, the data plan over the same capture shards, AdamW + warmup/cosine,
DDP/FSDP2, checkpoints with exact resume, keep-last-N + best), then per optimizer step: load
`grad_accum` micro-batches -> draw each one's blocks (eyas.dflash.objective.sample_blocks,
seeded by the global micro-batch index, so a resumed run draws the same blocks, and N ranks x
accumulation A the same as one process x N*A) -> one block-parallel forward each ->
cross-entropy on slots 1..B-1 -> backward -> clip -> step -> log -> eval -> checkpoint.

The loss of a step is  sum(weight * CE) / sum(weight)  over every block of the whole step
(all micro-batches, all ranks), so accumulation and ranks do not change the update. The best
checkpoint has the highest mean acceptance length on the eval set at k = block_size - 1,
counted as vLLM counts it at temperature 0 (1 + leading drafts equal to the target's greedy
token); the eval set's blocks are drawn with fixed seeds, the same at every eval.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from eyas.draft import data, data_loader
from eyas.dflash.config import DFlashConfig
from eyas.dflash.model import DFlashDraft
from eyas.dflash.objective import dflash_forward, sample_blocks
from eyas.draft.data_plan import plan_data, rank_slice
from eyas.draft.processes import (StopOnSignal, all_sum, autocast, compute_dtype, finish_env,
                                  init_env, peak_gib)
from eyas.draft.resume import best_on_this_eval, resume, save_step
from eyas.draft.train_setup import (Schedules, build_optimizers, check_finite,
                                    check_gradients, grad_sync, warmup_cosine, wrap)
from eyas.errors import EyasError
from eyas.store import checkpoint
from eyas.store.manifest import train_run, write_manifest
from eyas.draft.train_config import TrainConfig

log = logging.getLogger(__name__)

HOST_KEYS = ("input_ids", "target_top1", "loss_mask", "position_ids", "doc_ids")


def resolve_mask_token_id(tokenizer, vocab_size: int, given: int = -1) -> int:
    """The mask token: `given` if >= 0, else the tokenizer's mask token, else the first
    embedding row no token uses (len(tokenizer), e.g. 151669 for Qwen3), else pad, else eos
    (SpecForge's `resolve_mask_token_id` order; docs/dflash.md section 6)."""
    if given >= 0:
        return given
    own = [getattr(tokenizer, "mask_token_id", None),
           len(tokenizer) if len(tokenizer) < vocab_size else None]
    for tid in (*own, tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None and 0 <= int(tid) < vocab_size:
            if tid not in own:
                log.warning("DFlash mask token: the tokenizer has no mask token and no unused "
                            "embedding row, so the mask is id %d (%r), a token the data also "
                            "holds; an unused special token may serve better (--mask-token-id)",
                            int(tid), tokenizer.convert_ids_to_tokens(int(tid)))
            return int(tid)
    raise EyasError("no mask token found for DFlash (the tokenizer has no mask, pad or eos "
                    "token and fills the embedding table); give --mask-token-id")


def build_dflash(cfg: TrainConfig, inputs: data.Inputs, env) -> tuple[DFlashDraft, DFlashConfig]:
    """The draft (fp32 master weights, on the device, HF's normal(0, 0.02) init) with the
    target's embedding and lm_head in the compute dtype."""
    from eyas.targets.models import load_tokenizer

    if cfg.vocab is None and inputs.d2t is not None:  # open_inputs never sets it without --vocab
        raise EyasError("internal: a DFlash run got a draft vocabulary")
    name = inputs.target.get("name_or_path")
    tokenizer = load_tokenizer(name, revision=inputs.target.get("revision"),
                               trust_remote_code=cfg.trust_remote_code)
    overrides = {k: v for k, v in (
        ("num_hidden_layers", cfg.dflash_layers), ("intermediate_size", cfg.draft_intermediate_size),
        ("num_attention_heads", cfg.draft_num_attention_heads),
        ("num_key_value_heads", cfg.draft_num_key_value_heads)) if v}
    if "num_attention_heads" in overrides:
        overrides["head_dim"] = inputs.info.hidden_size // overrides["num_attention_heads"]
    dcfg = DFlashConfig.from_target(
        inputs.info, aux_layer_ids=inputs.aux_layer_ids, block_size=cfg.block_size,
        mask_token_id=resolve_mask_token_id(tokenizer, inputs.info.vocab_size, cfg.mask_token_id),
        **overrides)
    torch.manual_seed(cfg.seed)  # same init on every rank
    draft = DFlashDraft(dcfg)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    draft.to(env.device)
    dtype = compute_dtype(env)
    draft.set_target(inputs.embed.to(env.device, dtype), inputs.lm_head.to(env.device, dtype))
    return draft, dcfg


def check_block_fits(block: int, lengths, row_tokens: int) -> None:
    """A block [x_a, MASK x (B-1)] needs one token of context before its anchor and B tokens
    from it on in the same document; in none of them, its last slots would never get a loss."""
    longest = min(int(lengths.max()), row_tokens)
    if block > longest - 1:
        raise EyasError(f"--block-size {block} does not fit the data: the longest training "
                        f"document has {longest} tokens (one of context, then the block), so "
                        f"the last slots of every block would never be trained; use "
                        f"--block-size {longest - 1} or less (the public recipes' 16)",
                        flag="--block-size")


class DFlashModule(torch.nn.Module):
    """The draft's training forward as one call, so DDP and FSDP2 see one per micro-batch."""

    def __init__(self, draft: DFlashDraft):
        super().__init__()
        self.draft = draft

    def forward(self, batch, blocks):
        return dflash_forward(self.draft, batch, blocks)


def block_seed(cfg: TrainConfig, index: int, train: bool) -> int:
    """The anchor generator's seed of global micro-batch `index` (the data plan's: micro-batch
    a of rank r in step s is (s-1) * per_step + a * world_size + r) of the run or its eval."""
    return (cfg.seed * 2**32 + index) * 2 + (0 if train else 1)


def _blocks(cfg: TrainConfig, dcfg: DFlashConfig, mb: dict, seed: int, device):
    host = {k: mb[k].cpu() for k in HOST_KEYS}
    return sample_blocks(host, block=dcfg.block_size, num_anchors=cfg.num_anchors,
                         mask_token_id=dcfg.mask_token_id, gamma=cfg.loss_decay_gamma,
                         labels=cfg.dflash_labels,
                         generator=torch.Generator().manual_seed(seed)).to(device)


def _stats(out) -> torch.Tensor:
    """[loss sum, weight sum, correct (B), counts (B), accepted (B)] of one forward, float64."""
    return torch.cat([out.loss_sum.detach().double()[None], out.weight_sum.double()[None],
                      out.slot_correct.double(), out.slot_count.double(),
                      out.accepted.double()])


def _summary(stats: list[float], b: int) -> dict:
    """Loss, per-slot accuracy (slots 1..B-1) and acceptance as vLLM counts it at T=0: the
    share of blocks accepting >= j drafts, and the mean acceptance length for every k < B."""
    loss_sum, weight_sum = stats[0], stats[1]
    correct, counts, accepted = stats[2:2 + b], stats[2 + b:2 + 2 * b], stats[2 + 2 * b:2 + 3 * b]
    blocks = accepted[0]
    rate = [a / blocks if blocks else 0.0 for a in accepted[1:]]
    lengths = {str(k): round(1 + sum(rate[:k]), 5) for k in range(1, b)}
    return {"loss": loss_sum / weight_sum if weight_sum else 0.0,
            "acc": [round(c / n, 5) if n else 0.0 for c, n in zip(correct[1:], counts[1:])],
            "blocks": int(blocks), "per_position": [round(r, 5) for r in rate],
            "acceptance_length": lengths,
            # what curves.png plots for both families: here the replayed chain at k = B - 1
            "sim_acceptance_length": lengths[str(b - 1)]}


@torch.no_grad()
def evaluate(model, loader, cfg: TrainConfig, dcfg: DFlashConfig, env) -> dict:
    model.eval()
    stats = torch.zeros(2 + 3 * dcfg.block_size, dtype=torch.float64, device=env.device)
    for i, mb in enumerate(loader):
        blocks = _blocks(cfg, dcfg, mb, block_seed(cfg, i * env.world_size + env.rank, False),
                         env.device)
        with autocast(env):
            stats += _stats(model(_on(mb, env), blocks))
    model.train()
    return _summary(all_sum(stats).tolist(), dcfg.block_size)


def _on(mb: dict, env) -> dict:
    return data_loader.on_device(mb, env.device)


def train_dflash(cfg: TrainConfig) -> dict:
    """Train a DFlash draft into `cfg.out` (docs/dflash.md). Returns the run summary: steps,
    best {step, acceptance_length (k = block_size - 1), by_k}, last train and eval metrics."""
    # ---- setup: processes, inputs, draft, parallelism, data plan, optimizer, resume
    env = init_env(cfg)
    run_dir, dtype = Path(cfg.out), compute_dtype(env)
    inputs = data.open_inputs(cfg, env.device, "bfloat16" if env.autocast else "float32")
    draft, dcfg = build_dflash(cfg, inputs, env)
    model = wrap(DFlashModule(draft), cfg, env)
    plan = plan_data(cfg, inputs, env)
    total, row, b = plan.total_steps, plan.packing.row_tokens, dcfg.block_size
    check_block_fits(b, inputs.train.lengths[inputs.train_ids], row)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizers(cfg, model)  # a list: AdamW, or Muon + AdamW
    scheduler = Schedules(optimizer, warmup_cosine(total, cfg.warmup_ratio, cfg.min_lr_ratio,
                                                   cfg.lr_decay))
    start, best = 0, {"step": None, "acceptance_length": None}
    config_record = {"draft": "dflash", **dcfg.to_dict()}  # the run's draft_config.json
    state = resume(cfg, env, model, optimizer, scheduler, plan, config_record,
                   target=inputs.target)
    if state is not None:
        start, best = state["step"], best_on_this_eval(state, plan, "acceptance_length",
                                                        run_dir, quiet=not env.main)
    run = train_run(run_dir, resumed=state is not None)  # one id from first step to last
    eval_due = bool(state and state.get("eval_due"))  # stopped on an eval step: run it first
    workers = 0 if cfg.online else cfg.num_workers
    pin = env.device.type == "cuda" and not cfg.online
    mine = rank_slice(plan.batches, rank=env.rank, world_size=env.world_size,
                      start=start * plan.per_step)
    batches = iter(data_loader.loader(inputs.train, mine, row, dtype, num_workers=workers,
                                      pin_memory=pin, static=False))
    metrics = checkpoint.MetricsLog(run_dir, start, eval_due) if env.main else None

    def run_eval(step: int) -> dict:
        loader = data_loader.loader(inputs.eval, plan.eval_batches, row, dtype,
                                    num_workers=workers, pin_memory=pin, static=False)
        record = {"kind": "eval", "step": step, **evaluate(model, loader, cfg, dcfg, env)}
        if metrics:
            metrics.write(record)
            log.info("eval step %d | loss %.4f | acc %s | acceptance length %s (k=1,3,%d)",
                     step, record["loss"], record["acc"][:4],
                     "/".join(str(record["acceptance_length"].get(str(k))) for k in (1, 3, b - 1)),
                     b - 1)
        return record

    def judge(step: int) -> tuple[dict, bool]:
        """Step `step`'s eval, and whether it is the best so far (the highest acceptance
        length at k = B - 1)."""
        nonlocal best
        ev = run_eval(step)
        al = ev["acceptance_length"][str(b - 1)]
        new = best["step"] is None or best["acceptance_length"] is None or \
            al > best["acceptance_length"]
        if new:
            best = {"step": step, "acceptance_length": al, "by_k": ev["acceptance_length"]}
        return ev, new

    if env.main:
        write_manifest(run_dir, "train", cfg, target=inputs.target, inputs=inputs.manifests,
                       truncated=plan.truncated or {},
                       aux_layer_ids=list(inputs.aux_layer_ids), draft="dflash", run=run,
                       complete=False)
        log.info("DFlash training steps %d..%d on %d samples: %d micro-batch(es) of %d x %d "
                 "tokens per step, blocks of %d, mask token %d, %d layer(s) over taps %s",
                 start + 1, total, len(inputs.train_ids), plan.per_step, plan.packing.rows, row,
                 b, dcfg.mask_token_id, dcfg.num_hidden_layers, list(dcfg.aux_layer_ids))
    last_train, last_eval = {}, (run_eval(0) if plan.eval_batches and start == 0 else {})
    # the eval a stop left; a best it finds is recorded by the next save, which keeps that
    # step's folder
    if eval_due and plan.eval_batches:
        last_eval, _ = judge(start)
    window = torch.zeros(3 + 3 * b, dtype=torch.float64, device=env.device)  # + tokens
    t_window = t_start = time.perf_counter()
    before = metrics.elapsed_before if metrics else 0.0  # the earlier parts' seconds
    model.train()
    stop = StopOnSignal()  # SIGTERM / SIGINT: save this step, then exit
    try:
        # ---- the loop: one optimizer step per iteration
        for step in range(start + 1, total + 1):
            # 1. This rank's micro-batches and their blocks; the step's weight over all ranks.
            micro = [next(batches) for _ in range(cfg.grad_accum)]
            first = (step - 1) * plan.per_step + env.rank
            blocks = [_blocks(cfg, dcfg, mb, block_seed(cfg, first + a * env.world_size, True),
                              env.device) for a, mb in enumerate(micro)]
            denom = stop.sum_with(sum(bl.weight.sum() for bl in blocks).double()).clamp(min=1e-6)
            # 2. Forward -> loss -> backward (DDP/FSDP average over ranks: the world_size factor).
            for a, (mb, bl) in enumerate(zip(micro, blocks)):
                with grad_sync(model, a == len(micro) - 1):
                    with autocast(env):
                        out = model(_on(mb, env), bl)
                    (out.loss_sum * (env.world_size / denom).float()).backward()
                window[:-1] += _stats(out)
                window[-1] += (mb["doc_ids"] >= 0).sum().item()
            if step == start + 1:
                check_gradients(model, cfg)
            # 3. Clip, step the optimizer(s) and the schedule.
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))
            lr = scheduler.get_last_lr()[0]  # this step's (after the step: the next one's)
            for opt in optimizer:
                opt.step()
                opt.zero_grad(set_to_none=True)
            scheduler.step()
            # 4. Log (window sums over all ranks); a stop agreed by every rank logs its
            #    step too, so no step's tokens and losses go unlogged across the resume.
            stopping = stop.agreed()
            if step % cfg.log_every == 0 or step == total or stopping:
                stats, now = all_sum(window).tolist(), time.perf_counter()
                last_train = {"kind": "train", "step": step,
                              "epoch": plan.epoch_of[(step - 1) * plan.per_step],
                              **_summary(stats[:-1], b), "lr": lr,
                              "grad_norm": float(norm), "tokens": int(stats[-1]),
                              "tokens_per_s": stats[-1] / (now - t_window),
                              "elapsed_s": round(before + now - t_start, 2)}
                if env.device.type == "cuda":
                    last_train["peak_gpu_gib"] = peak_gib(env)
                check_finite(last_train, cfg, run_dir)
                window.zero_()
                t_window = now
                if metrics:
                    metrics.write(last_train)
                    log.info("step %d/%d | loss %.4f | acc %s | AL %.2f (k=%d) | %.0f tok/s | "
                             "lr %.2e",
                             step, total, last_train["loss"],
                             "/".join(f"{x:.2f}" for x in last_train["acc"][:4]),
                             last_train["acceptance_length"][str(b - 1)], b - 1,
                             last_train["tokens_per_s"], last_train["lr"])
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
                          best=best, record=config_record, last_train=last_train,
                          last_eval=last_eval, eval_due=eval_due)
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
                       aux_layer_ids=list(inputs.aux_layer_ids), draft="dflash", run=run,
                       complete=True, best=best, steps=total, draft_config=config_record)
        log.info("done: best step %s (acceptance length %s at k=%d) in %s", best["step"],
                 best.get("acceptance_length"), b - 1, run_dir / "checkpoints")
        if cfg.online and cfg.online_cache != "off":
            log.info(inputs.train.cache.summary())
    finish_env(env)
    stop.after_last_step()
    return {"steps": total, "best": best, "train": last_train, "eval": last_eval}
