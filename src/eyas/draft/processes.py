"""The processes of a training run, for both draft families: where this one stands (`Env`: rank,
world size, device, precision), joining and leaving the torchrun process group (`init_env`,
`finish_env`), sums over ranks (`all_sum`, `peak_gib`), the compute dtype and autocast, and the
stop that SIGTERM or SIGINT asks for (`StopOnSignal`), on which every rank agrees. One process
and `torchrun` with any number of ranks run the same code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from eyas.errors import EyasError
from eyas.kernels import fp8
from eyas.draft.train_config import TrainConfig

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


def compute_dtype(env: Env) -> torch.dtype:
    return torch.bfloat16 if env.autocast else torch.float32


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
