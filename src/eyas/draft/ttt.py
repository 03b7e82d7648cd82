"""Training-time test (TTT): the EAGLE-3 draft run `steps` times in a chain over a packed
batch, as it will run at serving time, with one loss over all steps.

`ttt_forward` is one function with numbered steps: step 0 reads the target's fused aux
states, step j > 0 reads the draft's own hidden state of step j-1 at the same position and
attends to the step-0 keys of its document up to itself plus the keys its position
produced at steps 1..j (the "diagonal", see eyas.kernels.attention). A draft of several
decoder layers does this in each layer over that layer's own keys. docs/draft.md has the math
and the shift convention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas.kernels.attention import attention, causal_attention
from eyas.draft.eagle3 import Eagle3Draft
from eyas.kernels.fp8 import Fp8Matrix
from eyas.kernels.fused import cuda_compiled
from eyas.draft.loss import (Objective, mean_acceptance, row_logsumexp,
                             simulated_acceptance_length, soft_cross_entropy)


@dataclass
class TTTBatch:
    """A packed micro-batch (see eyas.draft.data_loader.collate). Every tensor is (B, T) unless
    noted."""

    input_ids: torch.Tensor  # long
    aux_hidden: torch.Tensor  # (B, T, 3*Ht) any float dtype
    final_hidden: torch.Tensor  # (B, T, Ht): target hidden after its final norm
    target_top1: torch.Tensor  # target argmax at t = its prediction of token t+1
    loss_mask: torch.Tensor  # 1 where token t is one the target generated (assistant)
    position_ids: torch.Tensor  # reset to 0 at each packed document
    doc_ids: torch.Tensor  # packed document id; -1 = padding


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar: sum_j step_weight**j * mean loss of step j
    # (S,) differentiable loss summed (not averaged) over step j's positions: train divides
    # by counts over the whole optimizer step, so accumulation and ranks do not change it
    step_loss_sum: torch.Tensor
    step_loss: torch.Tensor  # (S,) detached mean loss per step
    step_acc: torch.Tensor  # (S,) top-1 agreement with the target per step
    step_count: torch.Tensor  # (S,) positions that carried a loss per step
    step_rows: list[int]  # positions computed per step (after pruning)
    # (S, N) bool with record_hits: the draft's top-1 at step j, position n equals the
    # target's top-1 (False where step j carries no loss at n); None otherwise
    hits: torch.Tensor | None = None

    @property
    def sim_acceptance_length(self) -> float:
        return simulated_acceptance_length(self.step_acc)


# FSDP2 hooks its gradient reduce-scatter on the tensors it finds by flattening the module's
# output; torch < 2.12 flattens with pytree, to which an unregistered dataclass is one opaque
# leaf, and FSDP2 then silently never reduces a gradient (the draft does not learn).
torch.export.register_dataclass(TTTOutput)


def _segments(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) doc ids -> flat (N,) index of the first and of the last token of each token's
    document (a run of equal ids within a row)."""
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = first.reshape(-1)
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    idx = torch.arange(first.shape[0], device=doc_ids.device)
    start = torch.where(first, idx, 0).cummax(0).values
    end = torch.where(last, idx, idx.shape[0]).flip(0).cummin(0).values.flip(0)
    return start, end


# Which token's loss mask decides whether step j at position n carries a loss: "predicted"
# (eyas's default): the token n+2+j the step predicts is an assistant token; "input"
# (speculators'): the token n+1+j the step reads (and at whose position the teacher stands)
# is one. They differ by one position per assistant span: "input" drops the prediction of a
# span's first token and adds the prediction after its last one. "all": every position whose
# teacher n+1+j is in the same document (one with any loss-mask token), prompt and template
# tokens too (the target's distribution is known there as well; NVIDIA Model-Optimizer's
# EAGLE-3 recipe trains on user turns): more supervised positions from the same
# conversations, on text the target reads rather than writes.
LOSS_MASK_AT = ("predicted", "input", "all")


def ttt_positions(batch: TTTBatch, t2d: torch.Tensor, steps: int, mask_at: str = "predicted",
                  vocab_filter: bool = True) -> torch.Tensor:
    """(S, N) bool: does position n carry a loss at step j? Step j at n predicts token
    n+2+j from the teacher at n+1+j; it counts when the token `mask_at` names (LOSS_MASK_AT)
    is an assistant token of the same document and, with `vocab_filter`, the target's top-1
    at the teacher is in the draft vocab (without it, the loss still targets the teacher's
    distribution renormalised over the draft vocab, and such a position is never right)."""
    if mask_at not in LOSS_MASK_AT:
        raise ValueError(f"mask_at must be one of {LOSS_MASK_AT}, got {mask_at!r}")
    top1 = batch.target_top1.reshape(-1).long()
    mask = batch.loss_mask.reshape(-1).bool()
    doc = batch.doc_ids.reshape(-1)
    start, end = _segments(batch.doc_ids)
    n = torch.arange(top1.shape[0], device=top1.device)
    if mask_at == "all":  # a document without any loss-mask token carries none (a sample the
        # capture zeroed for non-finite states has its mask cleared so that it adds no loss)
        seen = torch.cat([mask.new_zeros(1, dtype=torch.long), mask.long().cumsum(0)])
        has_mask = seen[end + 1] > seen[start]
    last = top1.shape[0] - 1
    in_vocab = t2d.to(top1.device)[top1]  # (N,)
    rows = []
    for j in range(steps):
        pred, teach = n + 2 + j, n + 1 + j
        at = pred if mask_at == "predicted" else teach
        row = (at <= end) & (doc >= 0)
        row &= has_mask if mask_at == "all" else mask[at.clamp(max=last)]
        if vocab_filter:
            row &= in_vocab[teach.clamp(max=last)]
        rows.append(row)
    return torch.stack(rows)


# A step whose kept positions fill at least this share of the span from the first to the
# last of them computes the whole span, and one whose loss positions fill this share of its
# rows takes the loss on every row, weighted 0 or 1: indexing by a run is a slice (a view),
# by index tensors a gather (and a sort and scatter in backward), which costs more than the
# few extra rows (all-ones masks; 3 % of top-1s outside the draft vocab leave gaps).
RUN_FILL = 0.9


@dataclass
class TTTPlan:
    """What each step of ttt_forward computes on one batch (ttt_plan)."""

    valid: torch.Tensor  # (S, N) bool: position n carries a loss at step j
    rank: torch.Tensor  # (S, N): where a kept position sits among its step's rows
    cols: tuple[torch.Tensor, ...]  # 2S index tensors: kept positions per step, then valid
    one_document: bool  # one row holding one document (no packing; padding only at the end)
    last: list[int]  # (S,) the last position each step keeps
    # per entry of cols: its first position when it is a contiguous run (then gathers by it
    # are slices, views), else None
    first: list[int | None]
    loss_on_all: list[bool]  # (S,) step j takes its loss on all its rows (a run), weighted

    def offset(self, i: int, within: int) -> int | None:
        """Where cols[i] starts among the rows of cols[within] when both are runs (cols[i]
        lies inside cols[within]), else None: indexing by it is then a slice."""
        a, b = self.first[i], self.first[within]
        return None if a is None or b is None else a - b


def ttt_plan(batch: TTTBatch, t2d: torch.Tensor, steps: int = 7, prune: bool = True,
             device: torch.device | str | None = None, static: bool = False,
             mask_at: str = "predicted", vocab_filter: bool = True) -> TTTPlan:
    """The plan of ttt_forward on `batch` (which positions each step computes and where its
    loss is), for `ttt_forward(..., plan=)`. Made where the batch lives and its index tensors
    sent to `device`: made on the CPU before the batch moves to the GPU, it costs the GPU no
    sync (made from GPU tensors, reading its row counts waits for all queued GPU work, e.g.
    the previous step's backward, and the GPU then idles while the CPU queues the next
    forward; with it, a TTT-7 iteration at 8K tokens on an H200 took ~5 % longer than the
    GPU was busy).

    static: every step computes every position and takes its loss on all of them, weighted
    0/1 (no pruning, `prune` ignored): the plan's shapes then depend only on the batch's
    shape and on whether it is one document, so one CUDA graph serves every batch of that
    shape (eyas.draft.ttt_graph). The same loss and gradients; more rows where masks are sparse.

    On the CPU the plan is made on one thread: its ~40 ops on (steps, N) tensors are too
    small to gain from more (8K tokens: 2.4 ms on one thread, 5.9 on two), and an intra-op
    pool spinning on a busy host is the suspected cause of stalls seen on an H200 host (in
    ~40 % of benchmark runs the host took ~360 ms to queue a graphed 8K iteration the GPU
    ran in ~165; docs/benchmarks.md)."""
    # (compiled, dynamo cannot trace the thread switch: a graph break each way)
    threads = torch.get_num_threads() if batch.target_top1.device.type == "cpu" \
        and not torch.compiler.is_compiling() else 1
    if threads > 1:
        torch.set_num_threads(1)
    try:
        plan = _plan(batch, t2d.to(batch.target_top1.device), steps, prune, static, mask_at,
                     vocab_filter)
    finally:
        if threads > 1:
            torch.set_num_threads(threads)
    if device is not None and torch.device(device) != plan.valid.device:
        counts = [c.numel() for c in plan.cols]
        plan.valid, plan.rank, flat = (x.to(device, non_blocking=True) for x in
                                       (plan.valid, plan.rank, torch.cat(plan.cols)))
        plan.cols = flat.split(counts)
    return plan


def _checked(plan: TTTPlan, steps: int, positions: int, device: torch.device) -> TTTPlan:
    if plan.valid.shape != (steps, positions) or plan.valid.device != device:
        raise ValueError(f"ttt_forward: the plan is for {tuple(plan.valid.shape)} (steps, "
                         f"positions) on {plan.valid.device}, the call for ({steps}, "
                         f"{positions}) on {device}")
    return plan


def _ends(mask: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, N) bool, idx = arange(N) -> each row's first and last True position (N and 0 for
    a row without any)."""
    return torch.where(mask, idx, mask.shape[1]).amin(1), (mask * idx).amax(1)


def _plan(batch: TTTBatch, t2d: torch.Tensor, steps: int, prune: bool,
          static: bool = False, mask_at: str = "predicted", vocab_filter: bool = True) -> TTTPlan:
    """What each step computes: all positions at step 0 (its keys serve every later step),
    then (with `prune`) those that still carry a loss at this or a later step, or the span
    from the first to the last of them when they nearly fill it (RUN_FILL; extra positions
    change nothing but the work: a position's chain reads only its own earlier steps). The
    row counts fix every shape, so they reach the host together, here, with the facts that
    pick the attention kernel and the indexing, rather than through a sync at every step."""
    valid = ttt_positions(batch, t2d, steps, mask_at, vocab_filter)  # (S, N)
    keep = valid.flip(0).cummax(0).values.flip(0) if prune and not static else \
        torch.ones_like(valid)
    keep[0] = True
    idx = torch.arange(keep.shape[1], device=keep.device)
    lo, hi = _ends(keep, idx)  # (S,)
    span = (idx >= lo[:, None]) & (idx <= hi[:, None])  # (S, N)
    keep = torch.where((span.sum(1) * RUN_FILL <= keep.sum(1))[:, None], span, keep)
    keep = keep.flip(0).cummax(0).values.flip(0)  # step j's rows among step j-1's
    both = torch.cat([keep, valid])  # (2S, N)
    doc = batch.doc_ids.reshape(-1)
    # one row: document 0, then only padding (-1; it sees no real key and carries no loss)
    one_doc = ((doc[0] == 0) & (doc >= -1).all() & (doc <= 0).all() & (doc.diff() <= 0).all()
               & (batch.doc_ids.shape[0] == 1)).long().reshape(1)
    first, final = _ends(both, idx)  # (2S,); final[:S]: the last position each step keeps
    host = torch.cat([both.sum(1), one_doc, final, first]).tolist()
    counts, one_doc, final, first = (host[:2 * steps], host[2 * steps],
                                     host[2 * steps + 1: 4 * steps + 1], host[4 * steps + 1:])
    cols = both.nonzero()[:, 1].contiguous().split(counts)
    runs = [a if n and b - a + 1 == n else None for n, a, b in zip(counts, first, final)]
    loss_on_all = [runs[j] is not None and (static or counts[steps + j] >= RUN_FILL * counts[j])
                   for j in range(steps)]
    return TTTPlan(valid, keep.cumsum(1) - 1, cols, bool(one_doc), final[:steps], runs,
                 loss_on_all)


def ttt_forward(draft: Eagle3Draft, batch: TTTBatch, target_lm_head: torch.Tensor, *,
                steps: int = 7, step_weight: float = 0.8, vocab_chunk: int = 4096,
                prune: bool = True, fp8: bool = False, plan: TTTPlan | None = None,
                record_hits: bool = False, objective: Objective = Objective(),
                mask_at: str = "predicted", vocab_filter: bool = True) -> TTTOutput:
    """Training-time test: `steps` chained draft passes over a packed batch, one loss.

    target_lm_head: (V, Ht) or its draft-vocab rows (Vd, Ht). vocab_chunk: rows per chunk of
    the (rows, Vd) vocab projections. prune: from step 1 on, compute only positions that
    still carry a loss at this or a later step (exact: a position's chain reads only its own
    earlier steps and the step-0 keys). fp8: the draft's matmuls (fc, q/k/v, o, MLP,
    lm_head) in fp8 with per-tensor scales (eyas.kernels.fp8); the teacher stays as it is. plan:
    from ttt_plan (same batch, t2d, steps and prune), made here when not given. record_hits:
    also return which (step, position) pairs the draft got right (TTTOutput.hits), for
    eyas.draft.loss.chain_acceptance (eval only). mask_at, vocab_filter: which positions
    carry a loss when the plan is made here (ttt_positions).
    """
    dev = batch.input_ids.device
    # 1. Flatten the packed rows into one token stream of N positions.
    ids = batch.input_ids.reshape(-1).long()
    pos = batch.position_ids.reshape(-1).long()
    top1 = batch.target_top1.reshape(-1).long()
    n_all = ids.shape[0]
    seg_start, seg_end = _segments(batch.doc_ids)
    # 2. Which (step, position) pairs carry a loss, and which positions each step computes.
    plan = ttt_plan(batch, draft.t2d, steps, prune, mask_at=mask_at,
                    vocab_filter=vocab_filter) if plan is None else \
        _checked(plan, steps, n_all, dev)
    cols, rank = plan.cols, plan.rank
    # 3. Teacher logits over the draft vocab, once for all positions (no grad), and their
    #    row logsumexps (every step reads the same teacher rows).
    teacher = _teacher_logits(draft, batch.final_hidden.reshape(n_all, -1), target_lm_head)
    teacher_lse = row_logsumexp(teacher)  # (N,)
    draft_id = torch.cumsum(draft.t2d.long(), 0) - 1  # target id -> draft id (where t2d)
    # (N,) the target's top-1 as a draft id; -1 (never right) where it is outside the vocab
    top1_draft = torch.where(draft.t2d[top1], draft_id[top1], -1)
    layers = draft.cfg.num_hidden_layers
    # once for all steps; layer 0's with q/k/v's embedding and hidden columns apart
    weights = [draft.layer_weights(dev.type, fp8=fp8, split=True)] + [
        draft.layer_weights(dev.type, fp8=fp8, layer=i) for i in range(1, layers)]
    head, head_fp8 = _head(draft, weights[0].qkv.dtype, fp8)
    sums, correct, rows_per_step = [], [], []
    hits = torch.zeros(steps, n_all, dtype=torch.bool, device=dev) if record_hits else None
    # 4. Step 0: fused target states + the next token, causal within each document.
    rows = cols[0]
    hidden = draft.fuse(batch.aux_hidden, fp8=fp8).reshape(n_all, -1)  # (N, H)
    # every position's token's share of q/k/v, once: step j's token at a row is the token
    # of some position (ground truth, shifted), so the steps gather rows of it
    shares = _Shares(draft.embed_share(ids, weights[0], hidden.dtype))  # (N, C)
    # per layer: keys/values of step 0 (every position) and of steps 1..j at the kept positions
    k0, v0 = [None] * layers, [None] * layers
    diag_k, diag_v = [[] for _ in range(layers)], [[] for _ in range(layers)]
    for j in range(steps):
        if cols[j].numel() == 0:  # nothing left to predict
            break
        if j > 0:  # 5. Step j: own hidden of step j-1, keep only positions still needed
            sel = _index(plan, j, j - 1, cols[j].numel()) or rank[j - 1][cols[j]]
            rows, hidden = cols[j], _take(hidden, sel)  # sel: into the previous step's rows
            diag_k = [[_take(t, sel) for t in layer] for layer in diag_k]
            diag_v = [[_take(t, sel) for t in layer] for layer in diag_v]
        token_at = torch.minimum(rows + 1 + j, seg_end[rows])  # (n,) its ground-truth token
        at_pos = pos[rows] + j
        h = hidden  # layer 0's hidden input, then the residual stream between layers
        for i in range(layers):  # each layer attends over its own keys
            q, k, v, residual = draft.project(
                None, h, at_pos, weights[i], layer=i,
                add_embed=shares.adder(token_at) if i == 0 else None)
            if j == 0:
                k0[i], v0[i] = k, v
            else:
                diag_k[i].append(k)
                diag_v[i].append(v)
            out = _attend(plan, j, q, k0[i], v0[i], rows, seg_start, diag_k[i], diag_v[i])
            h = draft.finish(out, residual, weights[i], layer=i)  # (n, H) pre-norm
        # 6. Loss of step j: soft CE against the teacher at rows+1+j, where valid.
        loss_sum, right = _step_loss(draft, plan, j, rows, h, (teacher, teacher_lse), head,
                                     head_fp8, top1_draft, vocab_chunk,
                                     None if hits is None else hits[j], objective)
        sums.append(loss_sum)
        correct.append(right)
        rows_per_step.append(rows.numel())
        hidden = draft.next_hidden(h)
    # 7. Weighted sum of per-step means; steps never reached (nothing left to predict) are 0.
    out = _ttt_output(sums, correct, plan.valid.sum(1), rows_per_step, step_weight)
    out.hits = hits
    return out


def _head(draft: Eagle3Draft, dtype: torch.dtype, fp8: bool):
    """The lm_head as the steps use it (a frozen one cast once) and its fp8 copy or None."""
    head = draft.lm_head.weight
    if not head.requires_grad:
        head = head.to(dtype)
    return head, Fp8Matrix.of(head.to(dtype)) if fp8 else None


def _step_loss(draft: Eagle3Draft, plan: TTTPlan, j: int, rows, h, teacher_and_lse, head,
               head_fp8, top1_draft, chunk: int, record=None, objective=Objective()):
    """Step j's soft CE summed over its loss positions, against the teacher at rows + 1 + j,
    and how many of them the draft's top-1 gets right. h (n, H) pre-norm at `rows`;
    teacher_and_lse: the teacher logits (N, Vd) and their row logsumexps (N,). record (N,)
    bool or None: set True at the loss positions the draft gets right."""
    steps = len(plan.loss_on_all)
    teacher, lse = teacher_and_lse
    if plan.loss_on_all[j]:  # rows are a run: every row, weighted 1 where it counts
        at = plan.first[j]  # the run's first position
        # the rows whose teacher position exists (the rows after them carry no loss; h is
        # passed whole, not sliced: a slice's backward is a zero fill and a copy)
        n = max(0, min(rows.numel(), teacher.shape[0] - 1 - j - at))  # 0: a batch <= j+1 long
        counted, t = plan.valid[j, at: at + n], slice(at + 1 + j, at + 1 + j + n)
        normed = draft.norm(h)
        lk = objective.for_step(lambda: mean_acceptance(
            normed, head, teacher[t], row_weight=counted, teacher_lse=lse[t], chunk=chunk))
        loss, pred = soft_cross_entropy(normed, head, teacher[t], chunk=chunk,
                                        fp8_weight=head_fp8, row_weight=counted,
                                        teacher_lse=lse[t], lk=lk)
        right = (pred == top1_draft[t]) & counted
        if record is not None:
            record[at: at + n] = right
        return loss, right.sum()
    n_valid = plan.cols[steps + j].numel()
    here = _index(plan, steps + j, j, n_valid) or plan.rank[j][plan.cols[steps + j]]
    teach = rows[here] + 1 + j  # here: indices into this step's rows
    at = plan.first[steps + j]
    t = slice(None) if at is None else slice(at + 1 + j, at + 1 + j + n_valid)
    teach_rows = teach if at is None else None  # a run: views, no gather
    normed = draft.norm(_take(h, here))
    lk = objective.for_step(lambda: mean_acceptance(
        normed, head, teacher[t], rows=teach_rows, teacher_lse=lse[t], chunk=chunk))
    loss, pred = soft_cross_entropy(normed, head, teacher[t], rows=teach_rows, chunk=chunk,
                                    fp8_weight=head_fp8, teacher_lse=lse[t], lk=lk)
    right = pred == top1_draft[teach]
    if record is not None:
        record[teach - 1 - j] = right
    return loss, right.sum()


class _Shares:
    """The (N, C) embedding shares of q/k/v that every TTT step reads rows of (see
    _AddShare). The autograd nodes hold only a _GradSum, not the table: held by them, it
    would live as long as the graph's output (eyas train keeps that into the next
    micro-batch's forward)."""

    def __init__(self, shares: torch.Tensor):
        self.shares, self.calls = shares, 0
        self.sum = _GradSum(shares.shape, shares.dtype, shares.device)

    def adder(self, at: torch.Tensor):
        """A function: the hidden state's share of q/k/v (n, C) -> plus shares[at]."""
        self.calls += 1
        table, total, first = self.shares, self.sum, self.calls == 1
        if torch.compiler.is_compiling():  # autograd's own sum: _AddShare's state would be a
            return lambda qkv_hidden: qkv_hidden + table.index_select(0, at)  # graph break
        return lambda qkv_hidden: _AddShare.apply(qkv_hidden, table, at, total, first)


@dataclass
class _GradSum:
    """The sum of the steps' gradients for the shares table, filled in backward."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    grad: torch.Tensor | None = None


@cuda_compiled
def _gather_add(a, table, at):
    """a (n, C) + table[at] (n, C): one kernel on CUDA."""
    return a + table.index_select(0, at)


class _AddShare(torch.autograd.Function):
    """qkv_hidden + shares[at]: one step's q/k/v. Backward adds the step's gradient rows into
    one (N, C) sum for all steps (autograd would scatter each step's into its own zeroed
    (N, C) tensor and add those up). The step that ran first hands the sum to `shares`: its
    backward runs last, since each step's gradient needs the next step's (through the hidden
    state the next step reads), so every other step has added its rows by then."""

    @staticmethod
    def forward(ctx, qkv_hidden, shares, at, total: _GradSum, first: bool):
        ctx.save_for_backward(at)
        ctx.total, ctx.first = total, first
        return _gather_add(qkv_hidden, shares, at)

    @staticmethod
    def backward(ctx, grad):
        total, summed = ctx.total, None
        if ctx.needs_input_grad[1]:
            (at,) = ctx.saved_tensors
            if total.grad is None:
                total.grad = torch.zeros(total.shape, dtype=total.dtype, device=total.device)
            # rows that share a token (at a document's end) carry no loss: their gradients
            # are exact zeros, so the order of accumulation cannot change the sum
            total.grad.index_put_((at,), grad.to(total.dtype), accumulate=True)
            if ctx.first:
                summed, total.grad = total.grad, None
        return grad, summed, None, None, None


def _take(x: torch.Tensor, sel) -> torch.Tensor:
    """x[sel], or x itself when sel is a slice of all its rows (static plans): autograd
    turns even a whole-tensor slice into a zero fill and a copy in backward."""
    whole = isinstance(sel, slice) and sel.start == 0 and sel.stop == x.shape[0]
    return x if whole else x[sel]


def _index(plan: TTTPlan, i: int, within: int, n: int) -> slice | None:
    """cols[i]'s rows among those of cols[within] as a slice when both are runs (indexing
    by a slice is a view; by an index tensor a gather, and a scatter in backward)."""
    at = plan.offset(i, within)
    return None if at is None else slice(at, at + n)


def _attend(plan: TTTPlan, j: int, q, k0, v0, rows, seg_start, diag_k: list, diag_v: list):
    """Step j's attention: each row's causal band over the step-0 keys of its document plus
    its own keys of steps 1..j. For one document whose kept positions fill at least half of
    the prefix up to the last of them, the fused causal kernel over that prefix (the other
    positions as zero queries, dropped) beats a block-sparse band; otherwise the band
    (packed documents, sparse rows)."""
    dk, dv = (torch.stack(diag_k), torch.stack(diag_v)) if diag_k else (None, None)
    span = plan.last[j] + 1
    if plan.one_document and 2 * rows.numel() >= span:
        return causal_attention(q, k0, v0, dk, dv, None if rows.numel() == span else rows, span)
    return attention(q, k0, v0, seg_start[rows], rows, dk, dv)


@torch.no_grad()
def _teacher_logits(draft: Eagle3Draft, final: torch.Tensor, lm_head: torch.Tensor):
    """final (N, Ht) target states after its final norm; lm_head (V, Ht) or its draft rows
    (Vd, Ht) -> (N, Vd) target logits restricted to the draft vocab."""
    cfg = draft.cfg
    selected = lm_head.shape[0] == cfg.draft_vocab_size and cfg.draft_vocab_size != cfg.vocab_size
    # the t2d rows, found through d2t: a boolean index would wait for the GPU
    rows = draft.to_target_ids(torch.arange(cfg.draft_vocab_size, device=lm_head.device))
    w = lm_head if selected else lm_head.index_select(0, rows)  # (Vd, Ht)
    if not torch.is_autocast_enabled(final.device.type):
        final = final.to(w.dtype)
    return F.linear(final, w)


def _ttt_output(sums, correct, step_count, rows, step_weight: float) -> TTTOutput:
    """step_count (S,): counted positions per step, 0 for the steps never reached."""
    steps, done = step_count.shape[0], len(sums)
    missing = sums[0].new_zeros(steps - done)
    step_loss_sum = torch.cat([torch.stack(sums), missing])
    per_position = step_count.clamp(min=1)
    loss = (step_weight ** torch.arange(steps, device=step_count.device) * step_loss_sum
            / per_position).sum()
    step_correct = torch.cat([torch.stack(correct), missing.long()])
    return TTTOutput(loss, step_loss_sum, step_loss_sum.detach() / per_position,
                     step_correct.float() / per_position.float(), step_count,
                     rows + [0] * (steps - done))
