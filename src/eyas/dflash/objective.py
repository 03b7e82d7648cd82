"""DFlash's training objective: random anchors, one block per anchor, same-position
cross-entropy on slots 1..B-1 (SpecForge's `OnlineDFlashModel.forward`, docs/dflash.md
section 6).

Per packed document of a micro-batch, up to `num_anchors` anchors `a` are drawn without
replacement among the loss-masked tokens that have context before them and a token after them
in the same document. Anchor a's block is `[x_a, MASK, ..., MASK]` at positions
`pos_a .. pos_a + B-1`; it attends to the fused target context of its document's tokens
before a (strictly: at serving time x_a is the bonus token, which has no target state yet)
and to its own block, never to another block. Slot j (1 <= j < B) predicts the token at
a+j with weight `loss_mask[a+j] * exp(-(j-1)/gamma)` (0 past the document's end); the loss of
an optimizer step is the weighted sum over all its blocks divided by the sum of the weights.

Labels are the data tokens x[a+j] (SpecForge's choice) or, with `labels="target"`, the target's
own greedy token there (captured top-1 at a+j-1). Acceptance is always counted against the
target's greedy tokens, as vLLM verifies at temperature 0: a block's accepted length is its
number of leading slots whose argmax equals the target's top-1 (a masked or out-of-document
slot ends the chain).

Memory: the (N, V) logits never exist beyond one chunk of rows; backward recomputes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.dflash.model import DFlashDraft


@dataclass
class Blocks:
    """The blocks of one micro-batch, flat: N = blocks * B slots, block by block."""

    ids: torch.Tensor  # (N,) slot 0 the anchor token, others the mask token
    positions: torch.Tensor  # (N,) the target's positions a..a+B-1 (document-local)
    lo: torch.Tensor  # (N,) first visible context key (flat B*T index: the document's start)
    hi: torch.Tensor  # (N,) last visible context key (the token before the anchor)
    labels: torch.Tensor  # (N,) the token each slot is trained to predict
    weight: torch.Tensor  # (N,) float loss weight; 0 at slot 0, past the document, unmasked
    greedy: torch.Tensor  # (N,) the target's greedy token at the slot's position
    valid: torch.Tensor  # (N,) bool: the slot's position is in the document and loss-masked

    def to(self, device) -> Blocks:
        return Blocks(**{k: v.to(device, non_blocking=True) for k, v in vars(self).items()})

    @property
    def num_blocks(self) -> int:
        return int(self.ids.shape[0])


def _documents(doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) flat spans of the packed documents of doc_ids (B, T); padding is -1."""
    flat = doc_ids.flatten()
    row = torch.arange(doc_ids.numel()) // doc_ids.shape[1]
    key = torch.where(flat >= 0, row * (int(flat.max()) + 2) + flat, -1)
    _, counts = torch.unique_consecutive(key, return_counts=True)
    ends = counts.cumsum(0)
    spans = zip((ends - counts).tolist(), ends.tolist())
    return [(s, e) for s, e in spans if flat[s] >= 0]


def sample_blocks(batch, *, block: int, num_anchors: int, mask_token_id: int, gamma: float,
                  labels: str, generator: torch.Generator) -> Blocks:
    """The blocks of a (host) micro-batch with input_ids, target_top1, loss_mask,
    position_ids, doc_ids (B, T): anchors drawn with `generator` (so a resumed run draws the
    same ones). gamma <= 0: every slot weighs 1."""
    ids, top1 = batch["input_ids"].flatten(), batch["target_top1"].flatten()
    mask, pos = batch["loss_mask"].flatten() > 0, batch["position_ids"].flatten()
    anchors, starts, ends = [], [], []
    for s, e in _documents(batch["doc_ids"]):
        # context before a (a > s), a token after it in the document (a < e - 1), a masked
        cand = torch.arange(s + 1, e - 1)
        cand = cand[mask[s + 1:e - 1]]
        if len(cand) > num_anchors:
            cand = cand[torch.randperm(len(cand), generator=generator)[:num_anchors]].sort()[0]
        anchors.append(cand)
        starts.append(torch.full_like(cand, s))
        ends.append(torch.full_like(cand, e))
    a = torch.cat(anchors) if anchors else torch.zeros(0, dtype=torch.long)
    j = torch.arange(block)
    at = a[:, None] + j  # (nb, B) flat position of each slot
    inside = at < torch.cat(ends)[:, None] if anchors else at < 0
    safe = at.clamp(max=ids.numel() - 1)
    block_ids = torch.full_like(at, mask_token_id)
    block_ids[:, 0] = ids[a]
    greedy = top1[(safe - 1).clamp(min=0)].long()
    valid = inside & mask[safe] & (j > 0)
    decay = torch.exp(-(j - 1).clamp(min=0).float() / gamma) if gamma > 0 else \
        torch.ones(block)
    return Blocks(
        ids=block_ids.flatten(), positions=(pos[a][:, None] + j).flatten(),
        lo=torch.cat(starts).repeat_interleave(block) if anchors else a,
        hi=(a - 1).repeat_interleave(block),
        labels=(ids[safe].long() if labels == "data" else greedy).flatten(),
        weight=(valid.float() * decay).flatten(), greedy=greedy.flatten(),
        valid=valid.flatten())


@dataclass
class DFlashOutput:
    loss_sum: torch.Tensor  # () sum of weight * CE over all slots (divide by the step's weight)
    weight_sum: torch.Tensor  # () sum of the weights
    slot_correct: torch.Tensor  # (B,) argmax == label at weighted slots
    slot_count: torch.Tensor  # (B,) weighted slots (slot 0 always 0)
    accepted: torch.Tensor  # (B,) blocks whose chain accepted at least j drafts (j = 0..B-1)


def dflash_forward(draft: DFlashDraft, batch, blocks: Blocks, *, chunk: int = 4096
                   ) -> DFlashOutput:
    """The loss and counts of one micro-batch (device tensors; batch has aux_hidden
    (B, T, n*H) and position_ids (B, T))."""
    b = draft.cfg.block_size
    # 1. The fused context of every token, and each layer's keys/values of it (once).
    c = draft.context(batch["aux_hidden"].flatten(0, 1))  # (B*T, H)
    kv = draft.context_kv(c, batch["position_ids"].flatten())
    if blocks.num_blocks == 0:
        # Nothing to learn here. One placeholder block (all mask tokens over the first
        # context key, weight 0) still runs every layer, so every parameter gets a (zero)
        # gradient: DDP's reducer and FSDP2's reduce-scatter expect the same parameters on
        # every rank, and a rank without blocks would otherwise send fewer.
        dev = c.device
        first = torch.zeros(b, dtype=torch.long, device=dev)
        ids = torch.full((b,), draft.cfg.mask_token_id, dtype=torch.long, device=dev)
        h = draft(ids, torch.arange(1, b + 1, device=dev), kv, first, first)  # (B, H)
        zero = (h.float().sum() + c.float().sum()) * 0.0
        counts = torch.zeros(b, device=dev)
        return DFlashOutput(zero, zero.detach(), counts, counts, counts)
    # 2. All blocks in one forward: each sees its context band and itself.
    h = draft(blocks.ids, blocks.positions, kv, blocks.lo, blocks.hi)  # (N, H)
    # 3. Cross-entropy through the target's lm_head, a chunk of rows at a time.
    loss_sum, top = ChunkedCE.apply(h, draft.lm_head, blocks.labels, blocks.weight, chunk)
    # 4. Per-slot accuracy and the accepted chain of each block.
    weighted = (blocks.weight > 0).view(-1, b)
    correct = (top == blocks.labels).view(-1, b) & weighted
    hits = ((top == blocks.greedy) & blocks.valid).view(-1, b)
    hits[:, 0] = True  # slot 0 is the bonus token: not drafted
    chain = hits.long().cumprod(1)  # (nb, B): 1 while every slot so far was accepted
    return DFlashOutput(loss_sum, blocks.weight.sum(), correct.sum(0).float(),
                        weighted.sum(0).float(), chain.sum(0).float())


class ChunkedCE(torch.autograd.Function):
    """sum_n weight[n] * CE(h[n] @ W.T, labels[n]) and argmax per row, the (rows, V) logits
    made one chunk at a time in forward and again in backward (never all at once). W, the
    target's lm_head, is frozen: no gradient."""

    @staticmethod
    def forward(ctx, h, w, labels, weight, chunk: int):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        top = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
        for s in range(0, h.shape[0], chunk):
            # in the head's dtype (bf16 on GPU): never an fp32 copy of the (V, H) head
            logits = (h[s:s + chunk].to(w.dtype) @ w.t()).float()  # (C, V)
            lse = logits.logsumexp(-1)
            picked = logits.gather(1, labels[s:s + chunk, None])[:, 0]
            total += (weight[s:s + chunk] * (lse - picked)).sum()
            top[s:s + chunk] = logits.argmax(-1)
        ctx.save_for_backward(h, w, labels, weight)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(top)
        return total, top

    @staticmethod
    def backward(ctx, grad, _):
        h, w, labels, weight = ctx.saved_tensors
        dh = torch.empty_like(h)
        for s in range(0, h.shape[0], ctx.chunk):
            p = (h[s:s + ctx.chunk].to(w.dtype) @ w.t()).float().softmax(-1)  # (C, V)
            p[torch.arange(p.shape[0], device=p.device), labels[s:s + ctx.chunk]] -= 1
            p *= (grad * weight[s:s + ctx.chunk])[:, None]
            dh[s:s + ctx.chunk] = (p.to(w.dtype) @ w).to(h.dtype)
        return dh, None, None, None, None
