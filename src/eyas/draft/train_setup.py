"""What `eyas train` builds before its loop: the draft with its vocabulary, head and embedding
(`build_draft`), the module DDP or FSDP2 wraps (`TTTModule`, one forward per micro-batch), the
wrapping itself (`wrap`, `grad_sync`, `check_gradients`), and the optimizers and LR schedule
both draft families' loops share (`build_optimizers`, `warmup_cosine`, `Schedules`). Only `wrap`
differs between DDP and FSDP2. The rest of the set-up lies beside it: the processes and stop
signals (eyas.draft.processes), the inputs (eyas.draft.data), the data plan
(eyas.draft.data_plan), resume and checkpoints (eyas.draft.resume).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.distributed as dist

from eyas.draft.config import DraftConfig
from eyas.draft.data import Inputs
from eyas.draft.eagle3 import Eagle3Draft
from eyas.draft.loss import Objective
from eyas.draft.processes import Env, compute_dtype
from eyas.draft.ttt import ttt_forward
from eyas.draft.ttt_graph import GraphedTTT
from eyas.errors import EyasError
from eyas.draft.train_config import TrainConfig


def build_draft(cfg: TrainConfig, inputs: Inputs, env: Env):
    """The draft (fp32 master weights, on the device) and its DraftConfig."""
    check_eagle3_taps(inputs.aux_layer_ids, cfg.data)
    overrides = {k: v for k, v in (
        ("hidden_size", cfg.draft_hidden_size), ("intermediate_size", cfg.draft_intermediate_size),
        ("num_attention_heads", cfg.draft_num_attention_heads),
        ("num_key_value_heads", cfg.draft_num_key_value_heads)) if v}
    if "hidden_size" in overrides or "num_attention_heads" in overrides:
        heads = overrides.get("num_attention_heads", inputs.info.num_attention_heads)
        overrides["head_dim"] = overrides.get("hidden_size", inputs.info.hidden_size) // heads
    vd = int(inputs.d2t.numel()) if inputs.d2t is not None else inputs.info.vocab_size
    dcfg = DraftConfig.from_target(inputs.info, draft_vocab_size=vd,
                                   aux_layer_ids=inputs.aux_layer_ids,
                                   norm_before_residual=cfg.norm_before_residual,
                                   norm_before_fc=cfg.norm_before_fc, fc_norm=cfg.fc_norm,
                                   norm_output=cfg.norm_output,
                                   num_hidden_layers=cfg.draft_layers, **overrides)
    if dcfg.hidden_size != inputs.info.hidden_size:
        raise EyasError(f"--draft-hidden-size {dcfg.hidden_size} differs from the target's "
                        f"{inputs.info.hidden_size}, but the draft reads the target's token "
                        f"embedding (width {inputs.info.hidden_size}); leave it at 0.")
    torch.manual_seed(cfg.seed)  # same init on every rank
    draft = Eagle3Draft(dcfg)
    if inputs.d2t is not None:
        draft.set_vocab(inputs.d2t, inputs.t2d)
    if cfg.lm_head == "target":
        # index on the head's own device (with --target-device-map maybe another GPU), so
        # only the (Vd, Ht) rows travel to the draft's device, never the whole (V, Ht) head
        rows = inputs.lm_head[draft.t2d.to(inputs.lm_head.device)]  # (Vd, Ht)
        draft.init_lm_head_from_target(rows.float(), freeze=cfg.freeze_lm_head)
    draft.to(env.device)
    # a copy on the draft's device: with --target-device-map the target's own may be elsewhere
    draft.set_embed_tokens(inputs.embed.to(env.device, compute_dtype(env)))
    return draft, dcfg


def check_eagle3_taps(aux_layer_ids, folder: str) -> None:
    """EAGLE-3's fc fuses exactly 3 target layers; a capture made for DFlash (N taps) is
    refused here, before anything is built, with the two ways out."""
    ids = tuple(aux_layer_ids)
    if len(ids) != 3:
        raise EyasError(
            f"{folder} holds {len(ids)} target layer(s) {list(ids)}, but an EAGLE-3 draft fuses "
            f"exactly 3. Re-capture for EAGLE-3 with `eyas capture ... --aux-layer-ids` left "
            f"out (the default (2, L//2, L-3)) or given 3 ids, or train a DFlash draft on this "
            f"capture with `eyas train --draft dflash`.")


class TTTModule(torch.nn.Module):
    """The draft plus its teacher head as one forward, so DDP and FSDP2 see a single call per
    micro-batch (TTT runs the draft layer `ttt_steps` times inside it)."""

    def __init__(self, draft, teacher: torch.Tensor, steps: int, fp8: bool = False,
                 objective: Objective = Objective(), mask_at: str = "predicted",
                 vocab_filter: bool = True):
        super().__init__()
        self.draft = draft
        self.teacher = teacher  # (Vd, Ht) frozen; a plain attribute: never synced or sharded
        self.steps = steps
        self.fp8 = fp8
        self.objective = objective
        self.positions = {"mask_at": mask_at, "vocab_filter": vocab_filter}

    def forward(self, batch, plan=None, record_hits: bool = False):
        # fp8 and the chosen loss positions for training only: eval (no grad) measures the
        # model as it is served, in bf16, on the same positions for every recipe
        training = torch.is_grad_enabled()
        positions = self.positions if training else {}
        return ttt_forward(self.draft, batch, self.teacher, steps=self.steps,
                           fp8=self.fp8 and training, plan=plan, record_hits=record_hits,
                           objective=self.objective, **positions)


def wrap(module: torch.nn.Module, cfg: TrainConfig, env: Env) -> torch.nn.Module:
    """DDP or FSDP2 around the TTT module under torchrun; the module itself otherwise."""
    if cfg.compile:
        module.compile()
    if env.world_size == 1:
        return module
    if cfg.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(env.device.type, (env.world_size,))
        return fully_shard(module, mesh=mesh)
    from torch.nn.parallel import DistributedDataParallel as DDP

    # buffers (d2t, t2d, the frozen embedding) are equal everywhere: no per-step broadcast
    return DDP(module, device_ids=[env.device.index] if env.device.type == "cuda" else None,
               broadcast_buffers=False)


def grad_sync(model: torch.nn.Module, sync: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if hasattr(model, "no_sync") and not sync:  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def check_finite(record: dict, cfg: TrainConfig, run_dir: Path) -> None:
    """A logged loss or gradient norm that is NaN or Inf ends the run (both families): every
    later step trains on NaN weights, and it used to end "done" with a NaN draft as its best
    (a DFlash run until 2026-12-07: export then wrote its NaN weights)."""
    bad = {k: record[k] for k in ("loss", "grad_norm")
           if record.get(k) is not None and not math.isfinite(record[k])}
    if bad:
        raise diverged(f"at step {record['step']} "
                       f"({', '.join(f'{k} {v}' for k, v in bad.items())})", cfg, run_dir)


def check_finite_weights(model: torch.nn.Module, step: int, cfg: TrainConfig,
                         run_dir: Path) -> None:
    """Before checkpoint `step` is saved (on every rank: saving is collective): weights that
    are no longer finite end the run unsaved. Only logged steps' losses are looked at, so a
    step between two of them that diverged was saved, became `last`, and a rerun with a lower
    --lr resumed its NaN weights and diverged again, as often as it was tried."""
    if not weights_finite(model):
        raise diverged(f"before step {step} (its weights are not saved)", cfg, run_dir)


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every weight of `model` is finite, on every rank (one reduction where several;
    each rank looks at its own shards)."""
    flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()
             for p in model.parameters()]
    ok = torch.stack(flags).all().to(torch.float32) if flags else torch.ones(())
    if dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok)


def diverged(when: str, cfg: TrainConfig, run_dir: Path) -> EyasError:
    """The error that ends a run whose weights stopped being finite, with what to change and
    where it resumes (its last checkpoint: saved only while the weights were finite)."""
    from eyas.store import checkpoint

    last = checkpoint.read_pointer(run_dir, "last")
    where = (f"run the same command again: it resumes from the run's last checkpoint, "
             f"{last.name}, saved before it; or start over with --resume never"
             if last is not None else
             "run the same command again (nothing was saved before it: it starts over)")
    return EyasError(f"training diverged {when}: the draft's weights are no longer finite. "
                     f"Lower --lr (now {cfg.lr}"
                     + (f", --muon-lr {cfg.muon_lr or cfg.lr}" if cfg.optimizer == "muon"
                        else "") + f") or raise --warmup-ratio, and {where}")


def check_gradients(model: torch.nn.Module, cfg: TrainConfig,
                    graphed: GraphedTTT | None = None) -> None:
    """After the first backward every trainable parameter holds a gradient; a wrapper that
    silently skips the gradient reduction would otherwise leave the draft untrained. Under
    --cuda-graph every .grad exists (zeros where none arrived): the graph's own record of
    the parameters its warm-up reached counts instead."""
    if graphed is None:
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    else:
        unreached = {id(graphed.params[i]) for i in graphed.unreached}
        missing = [n for n, p in model.named_parameters() if id(p) in unreached]
    if missing:
        fix = (f"--parallel {cfg.parallel} dropped them under torch {torch.__version__}; use "
               f"--parallel {'ddp' if cfg.parallel == 'fsdp' else 'fsdp'} and report it"
               if dist.is_initialized() else "please report this as an eyas bug")
        raise EyasError(f"no gradient reached {len(missing)} trainable parameter(s) after the "
                        f"first backward ({', '.join(missing[:4])}): {fix}.")


# ----------------------------------------------------------------- shared by both loops

def warmup_cosine(total_steps: int, warmup_ratio: float, min_ratio: float,
                  decay: str = "cosine"):
    """LR multiplier at step s: linear warmup over warmup_ratio * total, then a cosine (or,
    with decay="linear", a straight line) down to min_ratio at the last step."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        left = 1 - progress if decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return min_ratio + (1 - min_ratio) * left
    return factor


# 2-D weights that stay on AdamW under --optimizer muon: the vocabulary matrices (Muon's
# orthogonalised update is for hidden-to-hidden maps; speculators and Muon's authors keep
# embeddings and output heads on AdamW)
_ADAMW_ONLY = ("lm_head", "embed_tokens")


def build_optimizers(cfg: TrainConfig, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW over every trainable parameter (--optimizer adamw), or Muon over the 2-D hidden
    weight matrices (fc, attention, MLP) and AdamW over the rest (--optimizer muon: norms,
    a trained lm_head). Stepped together; eyas.store.checkpoint saves them as one state."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    adamw = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW([p for _, p in named], **adamw)]
    matrix = [p.ndim == 2 and min(p.shape) > 1 and not any(k in n for k in _ADAMW_ONLY)
              for n, p in named]
    rest = [p for (_, p), m in zip(named, matrix) if not m]
    muon = torch.optim.Muon([p for (_, p), m in zip(named, matrix) if m],
                            lr=cfg.muon_lr or cfg.lr, momentum=cfg.muon_momentum,
                            weight_decay=cfg.muon_weight_decay, adjust_lr_fn="match_rms_adamw")
    return [muon, torch.optim.AdamW(rest, **adamw)] if rest else [muon]


class Schedules:
    """One LambdaLR per optimizer (each warms up and decays its own peak lr), stepped, saved
    and restored as one; a single optimizer's state is its scheduler's own (older
    checkpoints load)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], factor):
        self.each = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizers]
        # this run's settings of each param group (peak lr, betas, weight decay, momentum):
        # loading a checkpoint's optimizer state brings back the settings it was saved with,
        # and a resumed run trains on with these instead (load_state_dict)
        self.settings = [[{k: v for k, v in g.items() if k not in ("params", "lr")}
                          for g in o.param_groups] for o in optimizers]

    def step(self) -> None:
        for s in self.each:
            s.step()

    def get_last_lr(self) -> list[float]:
        """The last lr of every param group (the first is the main group's: Muon's or AdamW's)."""
        return [lr for s in self.each for lr in s.get_last_lr()]

    def state_dict(self) -> dict:
        if len(self.each) == 1:
            return self.each[0].state_dict()
        return {"schedules": [s.state_dict() for s in self.each]}

    def load_state_dict(self, state: dict) -> None:
        states = state.get("schedules", [state])
        if len(states) != len(self.each):
            raise EyasError(f"the checkpoint holds {len(states)} optimizer schedule(s), this "
                            f"run has {len(self.each)}: resume with the checkpoint's "
                            f"--optimizer or start over with --resume never", flag="--resume")
        for s, st, settings in zip(self.each, states, self.settings):
            s.load_state_dict({k: v for k, v in st.items() if k != "base_lrs"})
            # the schedule's position is the checkpoint's, the settings and peak lr this run's
            # (the same when the run is resumed as it was started: the same lr, bit for bit)
            for g, mine, base, f in zip(s.optimizer.param_groups, settings, s.base_lrs,
                                        s.lr_lambdas):
                g.update(mine)
                g["lr"] = base * f(s.last_epoch)
            s._last_lr = [g["lr"] for g in s.optimizer.param_groups]  # as LambdaLR.step sets it
