"""A DFlash draft fed the way vLLM's DFlashProposer feeds it (docs/dflash.md, section 4), for
eyas.serve.speculate's batch-1 loop (`eyas eval`).

Each call receives the target's aux states of the positions verified since the last call;
they are fused (fc + hidden_norm) and projected into every layer's context keys/values once,
appended to a per-layer cache that only ever holds positions with target states. The block
[last token, MASK x k] at positions S-1 .. S-1+k attends to that whole cache and to itself
(non-causal) in ONE forward; slot j's logits give draft j (argmax at T=0, else a sample whose
distribution goes to the exact rejection sampler). Nothing of the block is cached: the next
call's context overwrites those positions, as vLLM's slots are overwritten.
"""

from __future__ import annotations

import torch

from eyas.errors import EyasError
from eyas.serve.speculate import Proposal, Sampling, pick


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
        drafts, dists = zip(*(pick(row, sampling) for row in logits))
        q = torch.stack(dists) if sampling.temperature > 0 else None  # (k, V)
        return Proposal(list(drafts), q)
