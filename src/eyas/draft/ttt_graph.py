"""One TTT forward + backward replayed from a CUDA graph (`eyas train --cuda-graph`).

A TTT-7 iteration issues ~2,000 kernels. At a few thousand tokens they are short, and the
CPU queueing them (Python, autograd, torch.compile's guards) becomes the limit: at 2K tokens
on an H200 the host took longer to queue an iteration than the GPU to run it. Captured once
as a CUDA graph, the whole iteration is one launch.

A graph replays fixed kernels on fixed memory, so everything that shapes the iteration must
be the same at every call: the batch's tensor shapes and the plan's row counts. Plans made
with `ttt_plan(..., static=True)` depend only on the batch's shape (every step computes
every position; masks enter as 0/1 weights), and on whether a row holds one document (the
attention kernel differs): two graphs serve a packed training run. Any plan works: a plan
unlike those captured is captured anew (logged; a graph only pays when replayed many times).

Gradients accumulate into the parameters' `.grad` as with eager backward; the graph owns
those tensors (`.grad` set to None is restored as zeros; replaced, it is copied in).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch

from eyas.draft.ttt import TTTBatch, TTTOutput, TTTPlan

log = logging.getLogger(__name__)


def plan_signature(plan: TTTPlan) -> tuple:
    """What of `plan` ttt_forward reads on the host (and so a graph bakes in): the row count,
    first and last position of each step, the attention path and, for steps that gather
    their loss rows, those rows' count and first position."""
    steps = len(plan.loss_on_all)
    counts = [c.numel() for c in plan.cols]
    gathered = [None if plan.loss_on_all[j] else (counts[steps + j], plan.first[steps + j])
                for j in range(steps)]
    return (tuple(plan.valid.shape), tuple(counts[:steps]), tuple(plan.first[:steps]),
            tuple(plan.last), plan.one_document, tuple(plan.loss_on_all), tuple(gathered))


def _batch_signature(batch: TTTBatch) -> tuple:
    return tuple((f.name, tuple(getattr(batch, f.name).shape), getattr(batch, f.name).dtype)
                 for f in fields(batch))


@dataclass
class _Captured:
    """One captured graph and the tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    batch: TTTBatch  # static copies of the inputs, refilled before each replay
    plan: TTTPlan
    cols_used: list[bool]  # which plan.cols entries the forward reads
    weights: torch.Tensor | None
    out: TTTOutput  # written by each replay


class GraphedTTT:
    """`forward(batch, plan) -> TTTOutput` (ttt_forward or a module around it) and the
    backward of its loss, captured as CUDA graphs and replayed.

    `call(batch, plan, weights=None)`: weights None backpropagates `out.loss`; a (S,) tensor
    backpropagates `(weights * out.step_loss_sum).sum()` (eyas train's normalisation over a
    whole optimizer step). Returns the TTTOutput with detached tensors (the loss already
    backpropagated). One graph per kind of call (batch shapes, the plan's host-side facts,
    autocast): static plans of packed rows and of rows holding one document take different
    attention kernels, so a run alternating them keeps two graphs (sharing one memory pool:
    they never run at once, and each replay's outputs are copied out before the next).
    At most `max_graphs` are kept; the oldest is dropped first.

    Call it with autocast as the forward needs it. Before the first call, drop eager outputs
    whose autograd graphs are still alive (e.g. a loss from an eager step): their
    gradient-accumulation nodes stay bound to the stream that made them, which a capture
    cannot use. The parameters, and the tensors `forward` reads besides the batch and plan
    (weights, the teacher head, vocab maps), must stay the same tensor objects, updated in
    place (as optimizers do): a graph reads the memory they had when it was captured.
    """

    def __init__(self, forward, params: list[torch.nn.Parameter], warmup: int = 2,
                 max_graphs: int = 4):
        self.forward = forward
        self.params = [p for p in params if p.requires_grad]
        self.warmup, self.max_graphs = max(1, warmup), max_graphs
        self.graphs: dict[tuple, _Captured] = {}
        self.grads: list[torch.Tensor] | None = None  # .grad tensors, shared by all graphs
        self.unreached: list[int] = []  # indices into params that no gradient reached
        self.pool = None  # the memory pool all graphs share
        self.captures = 0
        self.replays = 0

    def __call__(self, batch: TTTBatch, plan: TTTPlan,
                 weights: torch.Tensor | None = None) -> TTTOutput:
        dev = batch.input_ids.device
        if dev.type != "cuda":
            raise ValueError(f"CUDA graphs need the batch on a CUDA device; it is on {dev}")
        if plan is None:
            raise ValueError("GraphedTTT needs the step plan (ttt_plan(..., static=True))")
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        key = (str(dev), autocast, _batch_signature(batch), plan_signature(plan),
               weights is None)
        captured = self.graphs.pop(key, None)  # popped and put back: the newest last
        if captured is None:
            captured = self._capture(batch, plan, weights)
        self.graphs[key] = captured
        self._feed(captured, batch, plan, weights)
        captured.graph.replay()
        self.replays += 1
        out = captured.out
        return TTTOutput(*(x.detach().clone() for x in (out.loss, out.step_loss_sum,
                                                         out.step_loss, out.step_acc,
                                                         out.step_count)), list(out.step_rows))

    # ---- internals

    def _feed(self, captured: _Captured, batch: TTTBatch, plan: TTTPlan, weights):
        """Copy this call's inputs into the captured ones; point .grad at the graph's."""
        for f in fields(batch):
            getattr(captured.batch, f.name).copy_(getattr(batch, f.name), non_blocking=True)
        captured.plan.valid.copy_(plan.valid, non_blocking=True)
        captured.plan.rank.copy_(plan.rank, non_blocking=True)
        for mine, theirs, used in zip(captured.plan.cols, plan.cols, captured.cols_used):
            if used:
                mine.copy_(theirs, non_blocking=True)
        if weights is not None:
            captured.weights.copy_(weights, non_blocking=True)
        for p, g in zip(self.params, self.grads):
            if p.grad is None:
                g.zero_()
            elif p.grad is not g:
                g.copy_(p.grad)
            p.grad = g

    def _run(self, captured: _Captured):
        out = self.forward(captured.batch, captured.plan)
        loss = out.loss if captured.weights is None else \
            (captured.weights * out.step_loss_sum).sum()
        loss.backward()
        return out

    def _capture(self, batch: TTTBatch, plan: TTTPlan, weights) -> _Captured:
        if self.captures:
            log.warning("TTT CUDA graph %d captured: this call's batch shapes or step plan "
                        "differ from those of the %d graph(s) kept; plans made with "
                        "ttt_plan(..., static=True) need one graph per batch shape (two when "
                        "rows holding one document alternate with packed rows)",
                        self.captures + 1, len(self.graphs))
        if len(self.graphs) >= self.max_graphs:
            self.graphs.pop(next(iter(self.graphs)))  # the least recently used
        steps = len(plan.loss_on_all)
        captured = _Captured(
            torch.cuda.CUDAGraph(),
            TTTBatch(**{f.name: getattr(batch, f.name).clone() for f in fields(batch)}),
            TTTPlan(plan.valid.clone(), plan.rank.clone(), tuple(c.clone() for c in plan.cols),
                    plan.one_document, list(plan.last), list(plan.first),
                    list(plan.loss_on_all)),
            [i < steps or not plan.loss_on_all[i - steps] for i in range(len(plan.cols))],
            None if weights is None else weights.clone(), None)
        # what .grad holds now is kept across the warm-up and the capture
        saved = [None if p.grad is None else p.grad.clone() for p in self.params]
        self._warm_up(captured, batch.input_ids.device)
        # autocast caches casts of parameters until the outermost autocast region ends:
        # the graph must cast them itself, and no eager code may reuse its casts later
        torch.clear_autocast_cache()
        # thread_local: a data loader's pinning thread may allocate while this captures
        with torch.cuda.graph(captured.graph, pool=self.pool,
                              capture_error_mode="thread_local"):
            captured.out = self._run(captured)
        torch.clear_autocast_cache()
        if self.pool is None:
            self.pool = captured.graph.pool()
        if any(p.grad is not g for p, g in zip(self.params, self.grads)):
            raise RuntimeError("autograd replaced a parameter's .grad during the captured "
                               "backward instead of accumulating into it; run without CUDA "
                               "graphs")
        for g, s in zip(self.grads, saved):
            if s is None:
                g.zero_()
            else:
                g.copy_(s)
        self.captures += 1
        return captured

    def _warm_up(self, captured: _Captured, device: torch.device):
        """Run the step eagerly a few times on a side stream (torch.compile, autotuning,
        cuDNN plans, lazy inits), leaving every parameter a .grad for the capture to
        accumulate into (in place, as autograd does into an existing .grad). The first
        warm-up, from no gradients at all, records which parameters none reaches."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(self.warmup):
                if i == 0 and self.grads is None:
                    for p in self.params:
                        p.grad = None
                torch.clear_autocast_cache()
                self._run(captured)
                if i == 0 and self.grads is None:
                    self.unreached = [j for j, p in enumerate(self.params) if p.grad is None]
                    self.grads = [torch.zeros_like(p) if p.grad is None else p.grad
                                  for p in self.params]
                for p, g in zip(self.params, self.grads):
                    p.grad = g
        torch.cuda.current_stream().wait_stream(side)
