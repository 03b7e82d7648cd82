"""What `eyas train` sets up before its loop: the process group and device (`init_env`), the
draft with its vocabulary, head and embedding (`build_draft`), the module DDP or FSDP2 wraps
(`TTTModule`, one forward per micro-batch) and the wrapping itself (`wrap`), and the pieces
both draft families' loops share (the data plan, the LR schedule, resume, sums over ranks).
One process and `torchrun` with any number of ranks share all of it; only `wrap` differs
between DDP and FSDP2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from eyas.draft import data
from eyas.store import checkpoint
from eyas.kernels import fp8
from eyas.draft.config import DraftConfig
from eyas.draft.eagle3 import Eagle3Draft
from eyas.errors import EyasError
from eyas.draft.loss import Objective
from eyas.draft.ttt import ttt_forward
from eyas.draft.ttt_graph import GraphedTTT

# TrainConfig: from the step eyas.train, named in annotations only (a layer never imports a step)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Env:
    rank: int
    world_size: int
    device: torch.device
    autocast: bool  # bf16 autocast (CUDA + --precision bf16 or fp8)
    fp8: bool = False  # the draft's matmuls in fp8 (--precision fp8)
    joined: bool = False  # init_env joined the process group (finish_env leaves it)

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_env(cfg: TrainConfig) -> Env:
    """Join the torchrun process group if there is one (gloo on CPU, nccl on GPU)."""
    kind = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise EyasError("--device cuda but no CUDA device is visible; use --device cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and cfg.target_device_map is not None:
        # torchrun shows every rank the same GPUs: N ranks would place N copies of the target
        # over them (and rank r's draft goes to cuda:r, inside some other rank's target)
        raise EyasError(
            f"--target-device-map {cfg.target_device_map} under torchrun (WORLD_SIZE={world}) "
            f"would make every rank load its own copy of the target over the same GPUs. Run "
            f"one process instead (`eyas train --online --target-device-map "
            f"{cfg.target_device_map} ...` without torchrun): it spreads the target over the "
            f"GPUs that CUDA_VISIBLE_DEVICES shows and trains the draft on the first. A target "
            f"that fits one GPU can use torchrun without --target-device-map.")
    if cfg.cuda_graph and (kind != "cuda" or world > 1):
        raise EyasError(
            f"--cuda-graph runs on one GPU (this run: {world} process(es) on {kind}): a graph "
            f"cannot hold DDP's or FSDP's gradient communication. Drop --cuda-graph under "
            f"torchrun; with one process it needs a CUDA device.")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(kind, local) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    joined = world > 1 and not dist.is_initialized()
    if joined:
        dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if cfg.precision == "fp8":
        check_fp8(device)
    return Env(rank, world, device, kind == "cuda" and cfg.precision in ("bf16", "fp8"),
               cfg.precision == "fp8", joined)


def finish_env(env: Env) -> None:
    """The end of a run: every rank waits for the others (rank 0 writes the last files), then
    leaves the process group that init_env joined. A process that exits still in a gloo group
    can abort in the group's destructor (`terminate called without an active exception`,
    seen once under torchrun on the 2-core CI machine), and torchrun then reports the
    finished run as failed."""
    if dist.is_initialized():
        dist.barrier()
        if env.joined:
            dist.destroy_process_group()


class StopOnSignal:
    """SIGTERM or SIGINT (a preempted job, a lease's end, Ctrl-C) asks the training loop to
    save the step it is on and exit, so that the same command resumes with nothing lost; a
    second signal acts at once, as it would have without eyas. Every rank must agree on the
    step (saving is collective): one process reads its own flag after each step; with several,
    each rank's flag rides on the sum that every step makes over ranks anyway (`sum_with`),
    so all of them stop after the step that follows the signal (within seconds: torchrun
    kills its workers 30 s after passing a SIGTERM on). A signal within `REPEAT_S` of the
    first is the same request arriving twice, not a second one: a scheduler's SIGTERM to
    every process of a job reaches a rank directly and again through torchrun, which passes
    on what it gets; Ctrl-C reaches a rank from the terminal and as torchrun's SIGTERM."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    REPEAT_S = 2.0

    def __init__(self):
        self.signum: int | None = None
        self._first_at = 0.0  # time.monotonic() of the first signal
        self._old: dict = {}
        self._votes: torch.Tensor | None = None  # [SIGTERM, SIGINT] summed over ranks, on host
        self._event = None  # set when the copy of the votes to the host is done
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                if signal.getsignal(s) is signal.SIG_IGN:
                    continue  # ignored by whoever started us (e.g. SIGINT of `cmd &`): kept so
                self._old[s] = signal.signal(s, self._ask)

    def _ask(self, signum, frame) -> None:
        since = time.monotonic() - self._first_at
        if self.signum is not None and since < self.REPEAT_S:
            log.warning("%s %.1f s after the first signal: the same request (send another "
                        "after %g s to stop at once)", signal.Signals(signum).name, since,
                        self.REPEAT_S)
            return
        if self.signum is not None:  # the second: what it would have done without us
            old = self._old.get(signum)
            old = signal.SIG_DFL if old is None else old  # None: set outside Python
            signal.signal(signum, old)
            if callable(old):
                old(signum, frame)
            else:
                os.kill(os.getpid(), signum)
            return
        self.signum, self._first_at = signum, time.monotonic()
        log.warning("%s: saving at the end of this step, then stopping (another one, %g s "
                    "or more from now, stops at once)", signal.Signals(signum).name,
                    self.REPEAT_S)

    def sum_with(self, local: torch.Tensor) -> torch.Tensor:
        """`all_sum(local)`, this rank's votes to stop summed in the same collective. Their
        copy to the host does not wait for the GPU; `agreed` waits for it at the step's end."""
        if not dist.is_initialized():
            return local
        votes = [self.signum == signal.SIGTERM, self.signum == signal.SIGINT]
        both = torch.cat([local.reshape(-1), local.new_tensor(votes)])
        dist.all_reduce(both)
        if self._votes is None:
            self._votes = torch.zeros(2, dtype=both.dtype, pin_memory=both.is_cuda)
        self._votes.copy_(both[-2:], non_blocking=True)
        if both.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        return both[:-2].reshape(local.shape)

    def agreed(self) -> bool:
        """Whether every rank stops after this step: one process, its own flag; several, the
        votes of this step's `sum_with` (the same on every rank)."""
        if not dist.is_initialized():
            return self.signum is not None
        if self._event is not None:
            self._event.synchronize()
        term, intr = (0, 0) if self._votes is None else self._votes.tolist()
        if term or intr:
            # another rank's stop: the signal on its way here (torchrun's forward) is that
            # same request, so the repeat window starts now
            if self.signum is None:
                self._first_at = time.monotonic()
            self.signum = signal.SIGINT if intr else signal.SIGTERM
        return bool(term or intr)

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, signal.SIG_DFL if old is None else old)
        self._old = {}

    def after_last_step(self) -> None:
        """A signal that came during the last step: the run is complete and saved, but whoever
        sent it wants the process gone, not the next stage of `eyas run`: exit 128 + it."""
        if self.signum is not None:
            log.warning("%s came during the last step: the run is complete; exiting",
                        signal.Signals(self.signum).name)
            raise SystemExit(128 + self.signum)

    def exit(self, env: Env, step: int, total: int, run_dir: Path) -> None:
        """The step is saved: leave the process group and exit 128 + the signal."""
        name = signal.Signals(self.signum).name
        if env.main:
            log.warning("stopped by %s after step %d of %d, saved in %s: run the same command "
                        "again to resume", name, step, total, run_dir / "checkpoints")
        finish_env(env)
        self.restore()
        raise SystemExit(128 + self.signum)


def check_fp8(device: torch.device) -> None:
    """--precision fp8: refused on a GPU without fp8 matrix units; allowed on CPU, where
    torch runs the same fp8 products (slowly: it is there to test the path, not for speed)."""
    if not fp8.supported(device):
        raise EyasError(f"--precision fp8 needs fp8 matrix units (CUDA compute capability "
                        f"8.9+: L4/L40, H100/H200, B200); {device} has none. Use "
                        f"--precision bf16.")
    if device.type == "cpu":
        log.warning("--precision fp8 on CPU runs the real fp8 products, but slower than fp32: "
                    "use it to test the path, not for speed")


def build_draft(cfg: TrainConfig, inputs: data.Inputs, env: Env):
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


def compute_dtype(env: Env) -> torch.dtype:
    return torch.bfloat16 if env.autocast else torch.float32


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
        for s, st in zip(self.each, states):
            s.load_state_dict(st)


def all_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def peak_gib(env: Env) -> list[float]:
    """Peak GPU memory allocated so far on each rank (GiB, rank order); a collective."""
    peaks = torch.zeros(env.world_size, dtype=torch.float64, device=env.device)
    peaks[env.rank] = torch.cuda.max_memory_allocated(env.device) / 2**30
    return [round(x, 2) for x in all_sum(peaks).tolist()]


def autocast(env: Env):
    if env.autocast:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# draft_config.json keys a train flag sets, for the message that refuses another draft
_DRAFT_FLAGS = {"norm_before_fc": "--norm-before-fc", "fc_norm": "--fc-norm",
                "norm_output": "--norm-output", "norm_before_residual": "--norm-before-residual",
                "block_size": "--block-size", "mask_token_id": "--mask-token-id"}


def check_same_draft(resume: Path, record: dict) -> None:
    """Refuse to resume `resume` when the draft it holds differs from this run's (`record`, the
    draft_config.json this run writes), naming what differs and the flags that resume it: e.g.
    a run started before EAGLE 3.1 became the default resumes with --no-norm-before-fc
    --no-norm-output, a DFlash run with its --block-size and --mask-token-id."""
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
    raise EyasError(f"{resume} holds a draft with other settings than this run's: "
                    + ", ".join(f"{k} {old} there, {new} now" for k, (old, new) in differ.items())
                    + (f". Resume it with {' '.join(fix)}" if fix else
                       ". Resume it with the settings it was started with")
                    + ", or start over with --resume never (or another --out).",
                    flag="--resume")


def resume_path(cfg: TrainConfig, env: Env) -> Path | None:
    """Rank 0 decides (only it needs the run folder) and tells the others."""
    path = None
    if env.main:
        path = checkpoint.resolve_resume(cfg.out, cfg.resume)
        if cfg.resume == "never" and (Path(cfg.out) / "checkpoints").is_dir():
            log.warning("--resume never: deleting the old checkpoints in %s", cfg.out)
            checkpoint.clear_after(cfg.out, -1)
        elif path is not None:
            checkpoint.clear_after(cfg.out, int(path.name.split("-")[-1]))
    if dist.is_initialized():
        box = [path]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    return path


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


def resume(cfg: TrainConfig, env: Env, model, optimizer, scheduler, plan,
           record: dict, draft=None) -> dict | None:
    """The trainer state of the checkpoint this run continues (weights, optimizer, schedule
    and RNG restored into the given objects), or None for a fresh run. A checkpoint of another
    draft (`record`: this run's draft_config.json), of another draft vocabulary than `draft`'s
    (its d2t/t2d, from --vocab) or of another data plan is refused; another --epochs or
    --max-steps is warned about."""
    path = resume_path(cfg, env)
    if path is None:
        return None
    check_same_draft(path, record)
    t2d = None if draft is None else draft.t2d.clone()  # (--vocab's, before the load)
    if env.main:
        _warn_recipe_changes(cfg)
    try:
        state = checkpoint.load(path, model, optimizer, scheduler)
    except (KeyError, RuntimeError, ValueError) as err:  # torch names only the missing state
        started = _started_with(cfg)
        raise EyasError(f"the optimizer state in {path} does not fit this run's trained "
                        f"parameters and optimizer (--optimizer {cfg.optimizer}, "
                        f"{'--freeze-lm-head' if cfg.freeze_lm_head else '--no-freeze-lm-head'}"
                        f"; {err}): it was saved by another. Resume with the settings the run "
                        f"started with"
                        + (f" ({started})" if started else "")
                        + ", or start over with --resume never.", flag="--resume") from err
    check_same_vocab(path, draft, t2d)
    if state["plan"] != plan.fingerprint:
        raise EyasError(f"{path} was trained with other data or batching (samples, "
                        f"--batch-tokens, --row-tokens, --truncate, --seed, ranks x "
                        f"--grad-accum); resume with the same settings or use --resume never.",
                        flag="--resume")
    return state


def check_same_vocab(path: Path, draft, t2d: torch.Tensor | None) -> None:
    """Refuse a checkpoint whose draft vocabulary (restored with its weights) is not the one
    of --vocab (`t2d`, this run's): its head rows and the teacher's would be other tokens."""
    if t2d is not None and not torch.equal(draft.t2d.cpu(), t2d.cpu()):
        raise EyasError(f"{path} was trained with another draft vocabulary than --vocab's (same "
                        f"size, other tokens): give the --vocab folder the run started with "
                        f"(its eyas.json lists it under inputs), or start over with --resume "
                        f"never (or a new --out).", flag="--resume")


def started_config(out: str | Path) -> dict:
    """The train config the run in `out` was started with (its eyas.json), or {} for none."""
    try:
        return json.loads((Path(out) / "eyas.json").read_text()).get("config") or {}
    except (OSError, ValueError):
        return {}


def _started_with(cfg: TrainConfig) -> str:
    """The optimizer and lm_head flags of the run this one continues, or ''."""
    old = started_config(cfg.out)
    flags = []
    if "optimizer" in old:
        flags.append(f"--optimizer {old['optimizer']}")
    if "freeze_lm_head" in old:
        flags.append("--freeze-lm-head" if old["freeze_lm_head"] else "--no-freeze-lm-head")
    return " ".join(flags)


# what a resumed run may change, but then trains the rest of the run another way
_RECIPE = ("lr", "muon_lr", "betas", "weight_decay", "lr_decay", "warmup_ratio", "min_lr_ratio",
           "grad_clip", "ttt_steps", "step_weight", "loss", "loss_mask_at", "vocab_filter",
           "freeze_lm_head")


def _warn_recipe_changes(cfg: TrainConfig) -> None:
    """Say which recipe options differ from the run this one continues (its eyas.json): the
    steps before the checkpoint were trained the old way; and a new --epochs / --max-steps (a
    run may be lengthened, but its learning-rate schedule then jumps to the new length's)."""
    old = started_config(cfg.out)
    new = dataclasses.asdict(cfg)
    changed = [f"--{k.replace('_', '-')} {old[k]} -> {new[k]}" for k in _RECIPE
               if k in old and json.loads(json.dumps(new[k])) != old[k]]
    if changed:
        log.warning("resuming %s with another recipe than it was started with (%s): the steps "
                    "before the checkpoint were trained the old way", cfg.out, "; ".join(changed))
    for name in ("epochs", "max_steps"):
        if name in old and old[name] != new[name]:
            flag = name.replace("_", "-")
            log.warning("the run in %s was started with --%s %s, resumed with %s: the learning "
                        "rate follows the new length's schedule from here (it jumps); resume "
                        "with --%s %s to keep the old one, or start over with --resume never",
                        cfg.out, flag, old[name], new[name], flag, old[name])


def save_step(run_dir: Path, step: int, model, optimizer, scheduler, *, cfg: TrainConfig,
              env: Env, plan, best: dict, record: dict, last_train, last_eval,
              eval_due: bool = False) -> None:
    """Checkpoint `step`: weights, optimizer, schedule, data position, RNG, this run's
    draft_config.json (`record`) and metrics; keep the last --keep-last and the best.
    `eval_due`: the step's eval was left for the resumed run (a stop on an eval step saves
    first: torchrun kills a rank 30 s after passing a SIGTERM on)."""
    checkpoint.save(run_dir, step, model, optimizer, scheduler, draft_config=record,
                    keep_last=cfg.keep_last,
                    state={"step": step, "data_position": step * plan.per_step,
                           "plan": plan.fingerprint, "best": best,
                           "world_size": env.world_size, "eval_due": eval_due},
                    metrics={"train": last_train, "eval": last_eval}, best_step=best["step"])


@dataclass(frozen=True)
class Plan:
    """The run's data order (see eyas.draft.data): every global micro-batch, and the eval batches
    of this rank."""

    packing: data.Packing
    batches: list  # global micro-batches -> rows -> sample ids
    epoch_of: list[int]
    per_step: int  # global micro-batches per optimizer step (ranks x grad_accum)
    total_steps: int
    fingerprint: str
    eval_batches: list  # this rank's, padded with None to the same count on every rank


def plan_data(cfg: TrainConfig, inputs: data.Inputs, env: Env) -> Plan:
    row = cfg.row_tokens or cfg.batch_tokens
    packing = data.Packing(row, cfg.batch_tokens // row, cfg.truncate)
    lengths, per_step = inputs.train.lengths, env.world_size * cfg.grad_accum
    data.check_lengths(lengths, inputs.train_ids, packing, "the training data")
    batches, epoch_of = data.plan_run(inputs.train_ids, lengths, packing, seed=cfg.seed,
                                      per_step=per_step, epochs=cfg.epochs,
                                      max_steps=cfg.max_steps)
    eval_batches = []
    if inputs.eval is not None:
        data.check_lengths(inputs.eval.lengths, inputs.eval_ids, packing, "the eval data")
        eval_batches = data.eval_rank_batches(
            data.pack(inputs.eval_ids, inputs.eval.lengths, packing),
            rank=env.rank, world_size=env.world_size)
    return Plan(packing, batches, epoch_of, per_step, len(batches) // per_step,
                data.plan_fingerprint(lengths, inputs.train_ids, packing, cfg.seed, per_step),
                eval_batches)
