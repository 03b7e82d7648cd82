"""Per-step TTT loss and metrics.

The loss of one TTT step is the soft cross-entropy between the target's next-token
distribution restricted to the draft vocabulary (softmax over the `t2d` rows of the target
logits, i.e. renormalised) and the draft's log-softmax over the same `Vd` ids:

    loss_row = -sum_i p_target[i] * log q_draft[i],   q_draft = softmax(lm_head(norm(h)))

`Vd` is 32000 and a 64K-token batch has 64K rows per step, so `(rows, Vd)` logits in fp32
would take 8 GB per step. `soft_cross_entropy` therefore walks the rows in chunks and
computes the gradients of each chunk while its logits exist (d loss / d logits =
softmax(draft) - p_target), keeping only `(rows, H)` and `(Vd, H)` gradients alive. The
chunk's fp32 math is fused by `eyas.kernels.fused.cuda_compiled` on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.kernels import fp8, fused
from eyas.kernels.fp8 import Fp8Matrix
from eyas.kernels.fused import cuda_compiled


def _teacher_probs(teacher, teacher_lse):
    """(c, Vd) teacher logits -> fp32 softmax, from their row logsumexps when known."""
    return torch.softmax(teacher.float(), dim=-1) if teacher_lse is None else \
        (teacher.float() - teacher_lse.float()[:, None]).exp()


def _teacher_rows(teacher, teacher_lse, rows, s: int, e: int):
    """The teacher logits and logsumexps (or None) of scored rows s..e: rows s..e of the
    teacher, or rows[s..e] of it when `rows` indexes it."""
    if rows is None:
        return teacher[s: e], None if teacher_lse is None else teacher_lse[s: e]
    return teacher[rows[s: e]], None if teacher_lse is None else teacher_lse[rows[s: e]]


@cuda_compiled
def _soft_ce_chunk(logits, teacher, with_grad: bool, weight=None, teacher_lse=None):
    """logits, teacher (c, Vd) -> (summed soft CE, draft argmax (c,), d loss / d logits in
    logits' dtype or None). weight (c,): each row's weight (0 / 1). teacher_lse (c,): the
    teacher rows' logsumexp, when known. fp32 math on (c, Vd), fused into few passes when
    compiled."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    p = _teacher_probs(teacher, teacher_lse)
    if weight is None:
        loss = -(p * logq).sum()
        grad = (logq.exp() - p) if with_grad else None
    else:
        w = weight.float()[:, None]  # (c, 1)
        loss = -(p * logq * w).sum()
        grad = (logq.exp() - p) * w if with_grad else None
    return loss, logits.argmax(dim=-1), None if grad is None else grad.to(logits.dtype)


OBJECTIVES = ("kl", "lk-alpha", "lk-lambda")


@dataclass(frozen=True)
class Objective:
    """What each TTT step minimises per position: "kl" (soft cross-entropy, EAGLE-3's),
    "lk-alpha" or "lk-lambda" (LK losses; kl_scale, kl_decay: lk-lambda's KL weight)."""

    name: str = "kl"
    kl_scale: float = 1.0
    kl_decay: float = 1.0

    def __post_init__(self):
        if self.name not in OBJECTIVES:
            raise ValueError(f"loss {self.name!r}: use one of {OBJECTIVES}")

    def for_step(self, mean_alpha) -> Lk | None:
        """The Lk for soft_cross_entropy; mean_alpha: a function giving the step's mean
        acceptance (called only for lk-lambda)."""
        if self.name == "kl":
            return None
        if self.name == "lk-alpha":
            return Lk("alpha")
        return Lk("lambda", self.kl_scale * torch.exp(-self.kl_decay * mean_alpha()))


@dataclass(frozen=True)
class Lk:
    """An LK objective for soft_cross_entropy: mode "alpha" (-log alpha) or "lambda" (KL and
    1 - alpha mixed by kl_weight, a 0-d tensor: see the module docstring)."""

    mode: str
    kl_weight: torch.Tensor | None = None


@cuda_compiled
def _lk_chunk(logits, teacher, with_grad: bool, weight, teacher_lse, mode: str, kl_weight):
    """_soft_ce_chunk for an LK objective: (summed loss, argmax, d loss / d logits)."""
    logq = torch.log_softmax(logits.float(), dim=-1)  # (c, Vd)
    q, p = logq.exp(), _teacher_probs(teacher, teacher_lse)
    alpha = torch.minimum(p, q).sum(-1)  # (c,) expected acceptance of each position
    below = (q < p).float()
    d_alpha = q * (below - (below * q).sum(-1, keepdim=True)) if with_grad else None
    if mode == "alpha":  # -log alpha; a position with alpha 0 (underflow) adds nothing
        alive = alpha > 0
        safe = torch.where(alive, alpha, torch.ones_like(alpha))
        rows = torch.where(alive, -torch.log(safe), torch.zeros_like(alpha))
        grad = -(d_alpha / safe[:, None]) * alive.float()[:, None] if with_grad else None
    else:
        w = kl_weight.float()
        rows = w * -(p * logq).sum(-1) + (1 - w) * (1 - alpha)
        grad = w * (q - p) - (1 - w) * d_alpha if with_grad else None
    if weight is not None:
        rows = rows * weight.float()
        grad = grad * weight.float()[:, None] if with_grad else None
    return rows.sum(), logits.argmax(dim=-1), None if grad is None else grad.to(logits.dtype)


@torch.no_grad()
def mean_acceptance(hidden, weight, teacher, *, rows=None, row_weight=None, teacher_lse=None,
                    chunk: int = 4096) -> torch.Tensor:
    """The mean over counted rows of alpha = sum_i min(p_target, q_draft) (0-d fp32 tensor;
    no host sync), for Lk("lambda")'s weight. Arguments as soft_cross_entropy's."""
    n = teacher.shape[0] if rows is None else rows.shape[0]
    w = weight.to(hidden.dtype)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        t, lse = _teacher_rows(teacher, teacher_lse, rows, s, e)
        q = torch.softmax((hidden[s: e] @ w.t()).float(), dim=-1)
        alpha = torch.minimum(_teacher_probs(t, lse), q).sum(-1)
        total += (alpha if row_weight is None else alpha * row_weight[s: e].float()).sum()
    count = n if row_weight is None else row_weight[:n].float().sum()
    return total / torch.as_tensor(count, dtype=torch.float32, device=hidden.device).clamp(min=1)


@cuda_compiled
def row_logsumexp(x):
    """x (R, C) -> (R,) fp32 logsumexp of each row (one pass over x when compiled)."""
    return torch.logsumexp(x.float(), dim=-1)


def _chunk(logits, teacher, with_grad: bool, weight, grad_fp8: bool, teacher_lse=None,
           lk: Lk | None = None):
    """_soft_ce_chunk -> (loss, argmax, gradient, its fp8 scale or None): on CUDA one Triton
    kernel (eyas.kernels.loss_kernels), which can also write the gradient as fp8 (`grad_fp8`, scaled
    by its bound 1); elsewhere the torch function, and the fp8 copy from eyas.kernels.fp8.quantize."""
    if lk is not None:  # the torch function (compiled on CUDA); no fp8-gradient kernel
        loss, pred, g = _lk_chunk(logits, teacher, with_grad, weight, teacher_lse, lk.mode,
                                  lk.kl_weight)
        if not grad_fp8 or g is None:
            return loss, pred, g, None
        g8, sg, _ = fp8.quantize(g, fp8.E5M2)  # |g| may exceed 1 here: scaled by its amax
        return loss, pred, g8, sg
    if fused.use_kernels(logits) and logits.shape[0] and logits.stride(-1) == 1 \
            and teacher.stride(-1) == 1:
        from eyas.kernels import loss_kernels

        return loss_kernels.soft_ce_chunk(logits, teacher, with_grad, weight, grad_fp8,
                                          teacher_lse)
    loss, pred, g = _soft_ce_chunk(logits, teacher, with_grad, weight, teacher_lse)
    if not grad_fp8 or g is None:
        return loss, pred, g, None
    g8, sg, _ = fp8.quantize(g, fp8.E5M2, bound=1.0)
    return loss, pred, g8, sg


class _ChunkedSoftCE(torch.autograd.Function):
    """Sum over rows of soft CE(lm_head(hidden), softmax(teacher)); gradients made in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher, rows, chunk: int, grad_hidden: bool,
                grad_weight: bool, packed, row_weight, teacher_lse, n: int, lk):
        # hidden (>= n, H) compute dtype, its first n rows scored; weight (Vd, H) master
        # dtype; teacher (M, Vd) logits whose row rows[i] (or i when rows is None) is the
        # teacher of hidden row i; packed: the weight's eyas.kernels.fp8.Fp8Matrix for fp8 products,
        # or None; row_weight (n,) or None; teacher_lse (M,) or None; lk: Lk or None (soft CE)
        w = weight.to(hidden.dtype) if packed is None else None  # what autocast would feed
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        top1 = torch.empty(n, dtype=torch.long, device=hidden.device)  # (n,)
        d_hidden = torch.empty_like(hidden) if grad_hidden else None  # (rows of hidden, H)
        if grad_hidden and n < hidden.shape[0]:
            d_hidden[n:] = 0  # rows past the teacher's carry no loss
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if grad_weight else None  # (Vd, H)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s: e]  # (c, H)
            t, lse = _teacher_rows(teacher, teacher_lse, rows, s, e)
            rw = None if row_weight is None else row_weight[s: e]
            if packed is None:
                loss, pred, g, _ = _chunk(h @ w.t(), t, grad_hidden or grad_weight, rw, False,
                                          lse, lk)
            else:
                h8, sh, h8_t = fp8.quantize(h, transposed=grad_weight)
                logits = fp8.mm(h8, sh, packed.w.t(), packed.scale, hidden.dtype)
                # only dx needs it (frozen lm_head): the gradient straight to fp8
                direct = grad_hidden and not grad_weight
                loss, pred, g, sg = _chunk(logits, t, grad_hidden or grad_weight, rw, direct,
                                           lse, lk)
                if direct:
                    g8 = g
                elif g is not None:  # softmax - p lies in [-1, 1], no amax pass (LK's not)
                    g8, sg, g8_t = fp8.quantize(g, fp8.E5M2, transposed=grad_weight,
                                                bound=None if lk else 1.0,
                                                row_major=grad_hidden)
            total += loss
            top1[s: e] = pred
            if grad_hidden:  # g: d loss / d logits (c, Vd)
                d_hidden[s: e] = g @ w if packed is None else \
                    fp8.mm(g8, sg, packed.w_t.t(), packed.scale, hidden.dtype)
            if grad_weight:
                d_weight += (g.t() @ h).float() if packed is None else \
                    fp8.mm(g8_t, sg, h8_t.t(), sh, torch.float32)
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.mark_non_differentiable(top1)
        ctx.weight_dtype = weight.dtype
        return total, top1

    @staticmethod
    def backward(ctx, grad_total, _grad_top1):
        d_hidden, d_weight = ctx.saved_tensors
        gh = d_hidden * grad_total.to(d_hidden.dtype) if d_hidden is not None else None
        gw = (d_weight * grad_total).to(ctx.weight_dtype) if d_weight is not None else None
        return gh, gw, None, None, None, None, None, None, None, None, None, None


def soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor, *,
                       rows: torch.Tensor | None = None, chunk: int = 4096,
                       fp8_weight: Fp8Matrix | None = None,
                       row_weight: torch.Tensor | None = None,
                       teacher_lse: torch.Tensor | None = None, lk: Lk | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed soft cross-entropy of `hidden @ weight.T` against `softmax(teacher)` (or, with
    `lk`, the LK objective of the module docstring).

    hidden (n, H): the draft's post-norm hidden states; weight (Vd, H): its lm_head;
    teacher (M, Vd): target logits over the draft vocabulary, row `rows[i]` for hidden row i
    (rows (n,) long; None means M == n, row i). Rows are processed `chunk` at a time, so no
    `(n, Vd)` tensor is kept for backward. Returns (loss summed over rows, a differentiable
    scalar; the draft's argmax per row (n,), draft ids). fp8_weight: `weight` quantized
    (eyas.kernels.fp8.Fp8Matrix.of) to run the three vocab products in fp8. row_weight (n,) bool
    or float: each row's weight in the sum (rows weighted 0 add nothing, gradients included).
    teacher_lse (M,): logsumexp of each teacher row, when known (saves the CUDA kernel a
    pass over the teacher). hidden may have more rows than there are teacher rows: those
    past them carry no loss and get a zero gradient (the argmax covers the scored rows).
    """
    n_teacher = teacher.shape[0] if rows is None else rows.shape[0]
    if hidden.shape[0] < n_teacher or weight.shape[0] != teacher.shape[1] or \
            (teacher_lse is not None and teacher_lse.shape != teacher.shape[:1]):
        raise ValueError(f"soft_cross_entropy: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)}, teacher {tuple(teacher.shape)} and its "
                         f"log-sum-exp {None if teacher_lse is None else tuple(teacher_lse.shape)}"
                         f" disagree")
    grad_on = torch.is_grad_enabled()
    return _ChunkedSoftCE.apply(hidden, weight, teacher, rows, max(1, int(chunk)),
                                grad_on and hidden.requires_grad,
                                grad_on and weight.requires_grad, fp8_weight, row_weight,
                                teacher_lse, n_teacher, lk)


def simulated_acceptance_length(step_acc) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the mean accepted length of a chain draft whose step j
    agrees with the target with probability acc_j (the +1 is the target's bonus token)."""
    total, run = 1.0, 1.0
    for a in (step_acc.tolist() if torch.is_tensor(step_acc) else step_acc):
        run *= float(a)
        total += run
    return total


def chain_acceptance(hits: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor,
                     k: int) -> tuple[int, list[int]]:
    """Chain speculative decoding with k draft tokens replayed on teacher-forced sequences,
    counted as vLLM counts it: (number of drafts, accepted drafts at each position (k,)).

    hits (S >= k, N) bool: TTT step j at flat position n predicted token n+2+j right (its
    target's top-1; TTTOutput.hits); loss_mask, doc_ids (N,) or (B, T). Each run of
    loss-masked tokens of one document is one generation: the target makes its first token
    itself, so rounds start at the position before it; a round drafts up to k tokens
    (fewer where the run ends), accepts the leading hits, and the next round starts after
    the accepted tokens and the target's own (correction or bonus) token. Unlike the
    per-step rates of TTT, position i counts only where positions 0..i-1 were accepted, and
    rounds start where the previous draft failed, as they do at serving time.
    """
    if k > hits.shape[0]:
        raise ValueError(f"chain_acceptance: k={k} needs at least k TTT steps, have "
                         f"{hits.shape[0]}")
    hit = hits[:k].cpu().numpy()
    mask = loss_mask.reshape(-1).bool().cpu().numpy()
    doc = doc_ids.reshape(-1).cpu().numpy()
    n_all = mask.shape[0]
    drafts, accepted = 0, [0] * k
    p = 0
    while p < n_all:
        if not mask[p] or doc[p] < 0:
            p += 1
            continue
        end = p  # the run of assistant tokens p..end of one document
        while end + 1 < n_all and mask[end + 1] and doc[end + 1] == doc[p]:
            end += 1
        at = p - 1 if p > 0 and doc[p - 1] == doc[p] else p
        while (m := min(k, end - at - 1)) > 0:
            a = 0
            while a < m and hit[a, at]:
                a += 1
            drafts += 1
            for i in range(a):
                accepted[i] += 1
            at += a + 1
        p = end + 1
    return drafts, accepted
