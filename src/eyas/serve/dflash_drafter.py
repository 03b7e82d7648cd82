"""A DFlash draft fed the way vLLM's DFlashProposer feeds it (docs/dflash.md, section 4), for
eyas.serve.speculate's batch-1 loop (`eyas eval`).

Each call receives the target's aux states of the positions verified since the last call;
they are fused (fc + hidden_norm) and projected into every layer's context keys/values once,
appended to a per-layer cache that only ever holds positions with target states. The block
[last token, MASK x k] at positions S-1 .. S-1+k attends to that whole cache and to itself
(non-causal) in ONE forward; slot j's logits give draft j: its argmax (vLLM's default
draft_sample_method "greedy"), or at T > 0 with "probabilistic" a sample whose distribution
goes to the exact rejection sampler. Nothing of the block is cached: the next call's context
overwrites those positions, as vLLM's slots are overwritten.
`BatchDFlashDrafter` is the same over many rows for eyas.serve.batched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from eyas.errors import EyasError
from eyas.serve.speculate import Proposal, Sampling, draft_pick, drafts_sampled


class DFlashDrafter:
    def __init__(self, draft, device: torch.device | str):
        self.draft = draft
        self.device = torch.device(device)
        self.aux_layer_ids = tuple(draft.cfg.aux_layer_ids)
        self.dtype = next(draft.parameters()).dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.seen = 0  # positions whose context K/V are cached

    def begin(self) -> None:
        self.keys, self.values, self.seen = [], [], 0

    @torch.inference_mode()
    def propose(self, tokens: torch.Tensor, new_aux: torch.Tensor, k: int,
                sampling: Sampling) -> Proposal:
        cfg = self.draft.cfg
        if k > cfg.block_size - 1:
            raise EyasError(f"k={k} drafts do not fit this DFlash draft's blocks of "
                            f"{cfg.block_size} (bonus + {cfg.block_size - 1}); use k <= "
                            f"{cfg.block_size - 1}")
        s = tokens.shape[0]
        first = s - 1 - new_aux.shape[0]  # position of the first new aux state
        if first != self.seen:
            raise EyasError(f"draft state out of step: has {self.seen} positions, got aux from "
                            f"{first} (internal error in the speculative loop)")
        # 1. The new context into every layer's cache (projected once per position).
        c = self.draft.context(new_aux.to(device=self.device, dtype=self.dtype))  # (A, H)
        kv = self.draft.context_kv(c, torch.arange(first, s - 1, device=self.device))
        if self.keys:
            self.keys = [torch.cat([a, k_]) for a, (k_, _) in zip(self.keys, kv)]
            self.values = [torch.cat([a, v]) for a, (_, v) in zip(self.values, kv)]
        else:
            self.keys, self.values = [k_ for k_, _ in kv], [v for _, v in kv]
        self.seen = s - 1
        # 2. One block [last token, MASK x k] at positions S-1 .. S-1+k over all of it.
        ids = torch.tensor([int(tokens[-1])] + [cfg.mask_token_id] * k, device=self.device)
        pos = torch.arange(s - 1, s + k, device=self.device)
        lo = torch.zeros(k + 1, dtype=torch.long, device=self.device)
        hi = torch.full((k + 1,), s - 2, dtype=torch.long, device=self.device)
        h = self.draft(ids, pos, list(zip(self.keys, self.values)), lo, hi, block=k + 1)
        logits = self.draft.logits(h[1:]).float()  # (k, V): slot j predicts position S-1+j
        drafts, dists = zip(*(draft_pick(row, sampling) for row in logits))
        q = torch.stack(dists) if drafts_sampled(sampling) else None  # (k, V)
        return Proposal(list(drafts), q)


class BatchDFlashDrafter:
    """DFlashDrafter over B rows for eyas.serve.batched. Each layer's context cache is
    (B, capacity, hkv, d) with slot p = position p of the row (written once, when position p's
    target state arrives); a row's block attends to its slots 0..S-2 and to itself, through
    SDPA with a slot mask (the shapes change at every call)."""

    def __init__(self, draft, device: torch.device | str):
        self.one = DFlashDrafter(draft, device)
        self.draft, self.device = draft, self.one.device
        self.aux_layer_ids, self.dtype = self.one.aux_layer_ids, self.one.dtype
        self.keys: list[torch.Tensor] = []  # per layer (B, C, hkv, d)
        self.values: list[torch.Tensor] = []
        self.seen: list[int] = []

    def begin(self, rows: int, capacity: int) -> None:
        c = self.draft.cfg
        shape = (rows, capacity, c.num_key_value_heads, c.head_dim)
        self.keys = [torch.zeros(shape, device=self.device, dtype=self.dtype)
                     for _ in range(c.num_hidden_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.seen = [0] * rows

    def select(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self.device)
        self.keys = [k[index] for k in self.keys]
        self.values = [v[index] for v in self.values]
        self.seen = [self.seen[r] for r in rows]

    @torch.inference_mode()
    def propose(self, seqs: list[list[int]], new_aux: list[torch.Tensor], k: int,
                sampling: list[Sampling]) -> list[Proposal]:
        draft, cfg, dev = self.draft, self.draft.cfg, self.device
        if k > cfg.block_size - 1:
            raise EyasError(f"k={k} drafts do not fit this DFlash draft's blocks of "
                            f"{cfg.block_size}; use k <= {cfg.block_size - 1}")
        b, counts = len(seqs), [a.shape[0] for a in new_aux]
        ends = [len(s) - 1 for s in seqs]  # S-1: position of the pending (bonus) token
        firsts = [e - a for e, a in zip(ends, counts)]
        if firsts != self.seen:
            raise EyasError(f"draft state out of step: has {self.seen} positions, got aux "
                            f"from {firsts} (internal error in the batched loop)")
        # 1. The new target states into every layer's cache, slot = position.
        width = max(counts)
        pos = torch.stack([torch.arange(f, f + width).clamp(max=max(e - 1, 0))
                           for f, e in zip(firsts, ends)]).to(dev)  # (B, A)
        valid = (torch.arange(width)[None] < torch.tensor(counts)[:, None]).to(dev).flatten()
        rows = torch.arange(b, device=dev).repeat_interleave(width)[valid]
        aux = pad_sequence([a.to(device=dev, dtype=self.dtype) for a in new_aux],
                           batch_first=True)  # (B, A, n*H)
        kv = draft.context_kv(draft.context(aux.flatten(0, 1)), pos.flatten())
        for keys, values, (k_, v_) in zip(self.keys, self.values, kv):
            keys[rows, pos.flatten()[valid]] = k_[valid].to(self.dtype)
            values[rows, pos.flatten()[valid]] = v_[valid].to(self.dtype)
        self.seen = list(ends)
        # 2. One block [last, MASK x k] per row at positions S-1 .. S-1+k over its slots.
        n = k + 1
        ids = torch.tensor([[s[-1]] + [cfg.mask_token_id] * k for s in seqs], device=dev)
        positions = (torch.tensor(ends, device=dev)[:, None] + torch.arange(n, device=dev))
        cap = self.keys[0].shape[1]
        seen = torch.arange(cap, device=dev)[None] < torch.tensor(ends, device=dev)[:, None]
        mask = torch.cat([seen, torch.ones(b, n, dtype=torch.bool, device=dev)], 1)  # (B, C+n)
        x = draft.embed_tokens[ids.flatten()].to(draft.fc.weight.dtype)  # (B*n, H)
        for layer, keys, values in zip(draft.layers, self.keys, self.values):
            q, kb, vb = layer.project(x, positions.flatten(), draft.inv_freq, draft.rope_scale)
            kk = torch.cat([keys.to(q.dtype), kb.view(b, n, *kb.shape[1:])], 1)  # (B, C+n, ...)
            vv = torch.cat([values.to(q.dtype), vb.view(b, n, *vb.shape[1:])], 1)
            out = F.scaled_dot_product_attention(
                q.view(b, n, *q.shape[1:]).transpose(1, 2), kk.transpose(1, 2),
                vv.transpose(1, 2), attn_mask=mask[:, None, None], enable_gqa=True)
            x = layer.finish(x, out.transpose(1, 2).reshape(q.shape))
        logits = draft.logits(draft.norm(x)).float().view(b, n, -1)[:, 1:]  # (B, k, V)
        out = []
        for row, s in zip(logits, sampling):  # each row from its own sampling (generator)
            drafts, dists = zip(*(draft_pick(r, s) for r in row))
            out.append(Proposal(list(drafts), torch.stack(dists) if drafts_sampled(s) else None))
        return out
