"""One TTT forward + backward replayed from a CUDA graph (`eyas train --cuda-graph`).

A TTT-7 iteration issues ~2,000 kernels. At a few thousand tokens they are short, and the
CPU queueing them (Python, autograd, torch.compile's guards) becomes the limit: at 2K tokens
on an H200 the host took longer to queue an iteration than the GPU to run it. Captured once
as a CUDA graph, the whole iteration is one launch.

A graph replays fixed kernels on fixed memory, so everything that shapes the iteration must
be the same at every call: the batch's tensor shapes and the plan's row counts. Plans made
with `ttt_plan(..., static=True)` depend only on the batch's shape (every step computes
every position; masks enter as 0/1 weights). Any plan works: a plan unlike the captured one
is captured anew (logged; a captured graph is only worth it when it is replayed many times).

Gradients accumulate into the parameters' `.grad` as with eager backward; the graph owns
those tensors (`.grad` set to None is restored as zeros; replaced, it is copied in).
"""

from __future__ import annotations

import logging
from dataclasses import fields

import torch

from eyas.ttt import TTTBatch, TTTOutput, TTTPlan

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


class GraphedTTT:
    """`forward(batch, plan) -> TTTOutput` (ttt_forward or a module around it) and the
    backward of its loss, captured as one CUDA graph and replayed.

    `call(batch, plan, weights=None)`: weights None backpropagates `out.loss`; a (S,) tensor
    backpropagates `(weights * out.step_loss_sum).sum()` (eyas train's normalisation over a
    whole optimizer step). Returns the TTTOutput with detached tensors (the loss already
    backpropagated). Call it with autocast as the forward needs it. Before the first call,
    drop eager outputs whose autograd graphs are still alive (e.g. a loss from an eager
    step): their gradient-accumulation nodes stay bound to the stream that made them, which
    a capture cannot use.
    """

    def __init__(self, forward, params: list[torch.nn.Parameter], warmup: int = 2):
        self.forward = forward
        self.params = [p for p in params if p.requires_grad]
        self.warmup = warmup
        self.key = None
        self.graph = None
        self.captures = 0
        self.replays = 0

    def __call__(self, batch: TTTBatch, plan: TTTPlan,
                 weights: torch.Tensor | None = None) -> TTTOutput:
        if batch.input_ids.device.type != "cuda":
            raise ValueError("CUDA graphs need the batch on a CUDA device; "
                             f"it is on {batch.input_ids.device}")
        if plan is None:
            raise ValueError("GraphedTTT needs the step plan (ttt_plan(..., static=True))")
        key = (_batch_signature(batch), plan_signature(plan), weights is None)
        if key != self.key:
            self._capture(batch, plan, weights, key)
        self._feed(batch, plan, weights)
        self.graph.replay()
        self.replays += 1
        out = self.out
        return TTTOutput(*(x.detach().clone() for x in (out.loss, out.step_loss_sum,
                                                         out.step_loss, out.step_acc,
                                                         out.step_count)), list(out.step_rows))

    # ---- internals

    def _feed(self, batch: TTTBatch, plan: TTTPlan, weights):
        """Copy this call's inputs into the captured ones; point .grad at the graph's."""
        for f in fields(batch):
            getattr(self.batch, f.name).copy_(getattr(batch, f.name), non_blocking=True)
        self.plan.valid.copy_(plan.valid, non_blocking=True)
        self.plan.rank.copy_(plan.rank, non_blocking=True)
        for mine, theirs, used in zip(self.plan.cols, plan.cols, self.cols_used):
            if used:
                mine.copy_(theirs, non_blocking=True)
        if weights is not None:
            self.weights.copy_(weights, non_blocking=True)
        for p, g in zip(self.params, self.grads):
            if p.grad is None:
                g.zero_()
            elif p.grad is not g:
                g.copy_(p.grad)
            p.grad = g

    def _run(self):
        out = self.forward(self.batch, self.plan)
        loss = out.loss if self.weights is None else (self.weights * out.step_loss_sum).sum()
        loss.backward()
        return out

    def _capture(self, batch: TTTBatch, plan: TTTPlan, weights, key):
        if self.key is not None:
            log.warning("TTT CUDA graph captured again (%d so far): this batch's shapes or "
                        "step plan differ from the last one; plans made with "
                        "ttt_plan(..., static=True) keep one graph for all batches of a "
                        "shape", self.captures)
        self.graph = self.out = None  # free the previous graph's memory first
        self.batch = TTTBatch(**{f.name: getattr(batch, f.name).clone() for f in fields(batch)})
        steps = len(plan.loss_on_all)
        self.cols_used = [i < steps or not plan.loss_on_all[i - steps]
                          for i in range(len(plan.cols))]
        self.plan = TTTPlan(plan.valid.clone(), plan.rank.clone(),
                            tuple(c.clone() for c in plan.cols), plan.one_document,
                            list(plan.last), list(plan.first), list(plan.loss_on_all))
        self.weights = None if weights is None else weights.clone()
        # gradients: the graph accumulates into these tensors (in place, as autograd does
        # into an existing .grad); what .grad holds now is kept across the warm-up
        saved = [None if p.grad is None else p.grad.clone() for p in self.params]
        self.grads = [torch.zeros_like(p) for p in self.params]
        for p, g in zip(self.params, self.grads):
            p.grad = g
        # warm up on a side stream (torch.compile, autotuning, cuDNN plans, lazy inits)
        side = torch.cuda.Stream(batch.input_ids.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                torch.clear_autocast_cache()
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        # autocast caches casts of parameters until the outermost autocast region ends:
        # the graph must cast them itself, and no eager code may reuse its casts later
        torch.clear_autocast_cache()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a data loader's pinning thread may allocate while this captures
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = self._run()
        torch.clear_autocast_cache()
        if any(p.grad is not g for p, g in zip(self.params, self.grads)):
            raise RuntimeError("autograd replaced a parameter's .grad during the captured "
                               "backward instead of accumulating into it; run without CUDA "
                               "graphs")
        for g, s in zip(self.grads, saved):
            if s is None:
                g.zero_()
            else:
                g.copy_(s)
        self.key = key
        self.captures += 1
