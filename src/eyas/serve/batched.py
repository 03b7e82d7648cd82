"""Speculative decoding of many prompts at once: the loop of eyas.serve.speculate over a batch.

Each row accepts its own number of drafts, so rows fall out of step. Rather than cropping a
shared KV cache per row, the target's cache keeps every slot it was given and masks the ones
that do not count (left padding of the prompts, padding of short draft blocks, rejected
drafts): the attention mask marks a row's live slots, and position ids are the row's own
count of live tokens, so each row sees exactly the keys, at exactly the positions, it would
see alone. A finished row leaves the batch (its cache rows dropped).

    start:  prompts left-padded -> one prefill -> each row's first token (the target's own)
    loop:   drafter proposes m_r <= k tokens per row
            target runs once on every row's [last, d_1..d_m_r] (padded to the longest block)
            accept a prefix per row (as `speculate.verify`), one more token from the target
            mask the rejected slots; rows that reached their end leave

At T=0 every row's tokens and counters equal those of `speculate.generate_speculative` on
that prompt alone, up to floating-point ties: batched matmuls round differently
(tests/test_batched.py checks the equality in float32). The EAGLE-3 drafter's cache is
per row and position-indexed (slot p holds position p), so cutting it back is free.

A batch drafter has `aux_layer_ids`, `begin(rows, capacity)`, `select(rows)` and
`propose(seqs, new_aux, k, sampling) -> list[Proposal]` (`sampling`: one per row, each row
sampling from its own generator); the two below follow it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from eyas.errors import EyasError
from eyas.serve.speculate import (Eagle3Drafter, Generation, NgramDrafter, Proposal, Sampling,
                                  SpecStats, TargetRunner, _cut, _finished, drafts_sampled,
                                  pick, verify)
from eyas.targets.sdpa import target_attention


class BatchTarget:
    """A transformers causal LM over B rows sharing one KV cache with masked slots."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList, final_norm: nn.Module,
                 aux_layer_ids: tuple[int, ...] = ()):
        # the batch-1 runner's model call (its cache, aux taps and argument names), fed
        # (B, T) ids with a mask and position ids
        self.runner = TargetRunner(model, layers, final_norm, aux_layer_ids)
        self.device = self.runner.device
        self.aux_layer_ids = self.runner.aux_layer_ids
        self.mask = None  # (B, L) bool: slot counts for its row
        self.lengths = None  # (B,) int64: live tokens per row (the next position id)
        self._block = None  # (B,) lengths of the last step's blocks

    def _forward(self, ids, mask, positions, aux: bool, last_only: bool):
        logits, states = self.runner.run(ids, last_only, aux, attention_mask=mask.long(),
                                         position_ids=positions)
        if states is not None:  # (B*T, n*Ht) -> (B, T, n*Ht)
            states = states.view(*ids.shape, -1)
        return logits.float(), states

    @torch.inference_mode()
    def start(self, prompts: list[torch.Tensor], aux: bool = False):
        """Prefill the prompts, left-padded -> (last logits (B, V) fp32, per row the aux
        states of its prompt (n_r, n*Ht), or None)."""
        self.runner.reset()
        n = torch.tensor([len(p) for p in prompts])
        width = int(n.max())
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = p
        mask = torch.arange(width)[None] >= (width - n)[:, None]  # (B, L)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        self.mask, self.lengths = mask.to(self.device), n.to(self.device)
        logits, states = self._forward(ids.to(self.device), self.mask,
                                       positions.to(self.device), aux, last_only=True)
        rows = None if states is None else [states[r, width - len(p):]
                                            for r, p in enumerate(prompts)]
        return logits[:, -1], rows

    @torch.inference_mode()
    def step(self, blocks: list[list[int]], aux: bool = False):
        """Run each row's block after its live slots -> (logits (B, T, V) fp32, aux states
        (B, T, n*Ht) or None); T = the longest block, shorter ones padded (masked)."""
        lengths = torch.tensor([len(b) for b in blocks])
        width = int(lengths.max())
        ids = torch.zeros(len(blocks), width, dtype=torch.long)
        for r, b in enumerate(blocks):
            ids[r, :len(b)] = torch.tensor(b)
        self._block = lengths.to(self.device)
        arange = torch.arange(width, device=self.device)
        new = arange[None] < self._block[:, None]  # (B, T)
        self.mask = torch.cat([self.mask, new], dim=1)
        positions = self.lengths[:, None] + arange[None]
        return self._forward(ids.to(self.device), self.mask, positions, aux, last_only=False)

    def commit(self, keep: list[int]) -> None:
        """Of the last step's blocks, the first keep[r] slots of row r count (the pending
        token and the accepted drafts); the rest become holes."""
        keep_t = torch.tensor(keep, device=self.device)
        width = int(self._block.max())
        arange = torch.arange(width, device=self.device)
        self.mask[:, -width:] = arange[None] < keep_t[:, None]
        self.lengths = self.lengths + keep_t

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (in this order)."""
        index = torch.tensor(rows, device=self.device)
        self.runner.cache.batch_select_indices(index)
        self.mask, self.lengths = self.mask[index], self.lengths[index]


class BatchNgramDrafter:
    """NgramDrafter per row (prompt lookup runs on the host either way)."""

    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.one = NgramDrafter(min_n, max_n)

    def begin(self, rows: int, capacity: int) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        pass

    def propose(self, seqs, new_aux, k: int, sampling: list[Sampling]) -> list[Proposal]:
        return [self.one.propose(torch.tensor(s), None, k, r) for s, r in zip(seqs, sampling)]


class BatchEagle3Drafter:
    """eyas.serve.speculate.Eagle3Drafter over B rows. Its KV cache is (layers, B, capacity,
    hkv, d): one per decoder layer, slot p = position p of the row. Step 0 writes the newly
    accepted positions, chain step j the position S-2+j, and a query at position p attends to
    slots 0..p of its row, so whatever an earlier round's chain left beyond p is never read
    and is overwritten."""

    def __init__(self, draft, device: torch.device | str):
        self.one = Eagle3Drafter(draft, device)  # its vocabulary maps, for every row
        self.draft, self.device = draft, self.one.device
        self.aux_layer_ids, self.dtype = self.one.aux_layer_ids, self.one.dtype
        self.keys = self.values = None  # (layers, B, C, hkv, d)
        self.seen: list[int] = []

    def begin(self, rows: int, capacity: int) -> None:
        c = self.draft.cfg
        shape = (c.num_hidden_layers, rows, capacity, c.num_key_value_heads, c.head_dim)
        self.keys = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.values = torch.zeros_like(self.keys)
        self.seen = [0] * rows

    def select(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self.device)
        self.keys, self.values = self.keys[:, index], self.values[:, index]
        self.seen = [self.seen[r] for r in rows]

    def _layers(self, ids, hidden, positions, rows, write):
        """The draft's decoder layers over queries (B*A,) of rows r at positions p, A per
        row: each layer's keys and values written to its slot (r, p) where `write`,
        attention over its slots 0..p of row r (SDPA with a mask: the shapes change every
        call, which compiled kernels would recompile for) -> pre-norm h (B*A, H)."""
        draft, h = self.draft, hidden
        b, cap = self.keys.shape[1:3]
        a = ids.shape[0] // b
        slots = torch.arange(cap, device=hidden.device)
        mask = slots[None, None, None] <= positions.view(b, 1, a, 1)  # (B, 1, A, C)
        for i in range(draft.cfg.num_hidden_layers):
            keys, values = self.keys[i], self.values[i]  # (B, C, hkv, d) views
            w = draft.layer_weights(h.device.type, layer=i)
            q, k, v, residual = draft.project(ids, h, positions, w, layer=i)
            keys[rows[write], positions[write]] = k[write].to(self.dtype)
            values[rows[write], positions[write]] = v[write].to(self.dtype)
            out = F.scaled_dot_product_attention(
                q.view(b, a, *q.shape[1:]).transpose(1, 2), keys.transpose(1, 2).to(q.dtype),
                values.transpose(1, 2).to(q.dtype), attn_mask=mask, enable_gqa=True)
            h = draft.finish(out.transpose(1, 2).reshape(q.shape), residual, w, layer=i)
        return h  # (N, H)

    def _pick(self, logits: torch.Tensor, sampling: list[Sampling]):
        """(B, Vd) draft logits -> target ids (B,) and, when drafts are sampled (each row from
        its own `sampling`), their distributions."""
        if not drafts_sampled(sampling[0]):  # the rows differ in their generators only
            return self.one.draft_to_target[logits.argmax(-1)].tolist(), None
        picked = [pick(self.one.target_logits(row), r) for row, r in zip(logits, sampling)]
        return [t for t, _ in picked], [p for _, p in picked]

    @torch.inference_mode()
    def propose(self, seqs: list[list[int]], new_aux: list[torch.Tensor], k: int,
                sampling: list[Sampling]) -> list[Proposal]:
        b = len(seqs)
        counts = [a.shape[0] for a in new_aux]
        ends = [len(s) - 1 for s in seqs]  # S-1: position of the pending token
        firsts = [e - a for e, a in zip(ends, counts)]
        if firsts != self.seen:
            raise EyasError(f"draft state out of step: has {self.seen} positions, got aux "
                            f"from {firsts} (internal error in the batched loop)")
        width = max(counts)
        ids = torch.zeros(b, width, dtype=torch.long)
        positions = torch.zeros(b, width, dtype=torch.long)
        for r, (s, first, end) in enumerate(zip(seqs, firsts, ends)):
            ids[r, : end - first] = torch.tensor(s[first + 1: end + 1])
            positions[r] = torch.arange(first, first + width).clamp(max=max(end - 1, 0))
        valid = torch.arange(width)[None] < torch.tensor(counts)[:, None]  # (B, A)
        dev = self.device
        rows = torch.arange(b, device=dev)
        aux = pad_sequence([a.to(device=dev, dtype=self.dtype) for a in new_aux],
                           batch_first=True)  # (B, A, n*Ht)
        g = self.draft.fuse(aux).flatten(0, 1)  # (B*A, H)
        h = self._layers(ids.to(dev).flatten(), g, positions.to(dev).flatten(),
                         rows.repeat_interleave(width), valid.to(dev).flatten())
        h = h.view(b, width, -1)
        h = h[rows, torch.tensor(counts, device=dev) - 1]  # (B, H): each row's last
        self.seen = list(ends)
        everyone = torch.ones(b, dtype=torch.bool, device=dev)
        drafts, dists = [], []
        for j in range(k):
            tokens, p = self._pick(self.draft.lm_head(self.draft.norm(h)), sampling)
            drafts.append(tokens)
            dists.append(p)
            if j + 1 == k:
                break
            positions = torch.tensor(ends, device=dev) + j  # S-1+j
            h = self._layers(torch.tensor(tokens, device=dev), self.draft.next_hidden(h),
                             positions, rows, everyone)
        out = []
        for r in range(b):
            q = torch.stack([d[r] for d in dists]) if drafts_sampled(sampling[r]) else None
            out.append(Proposal([d[r] for d in drafts], q))
        return out


def _accept_greedy(logits: torch.Tensor, proposals: list[Proposal]) -> list[tuple[int, int]]:
    """T=0 verification of every row with one device-to-host copy: (accepted, next token)."""
    top = logits.argmax(-1).tolist()  # (B, T)
    result = []
    for row, proposal in zip(top, proposals):
        accepted = 0
        while accepted < len(proposal.tokens) and proposal.tokens[accepted] == row[accepted]:
            accepted += 1
        result.append((accepted, row[accepted]))
    return result


@torch.inference_mode()
def generate_batch(target: BatchTarget, drafter, prompts: list[torch.Tensor], k: int,
                   max_new_tokens: int, stop_ids: frozenset[int],
                   sampling: Sampling | list[Sampling]) -> list[Generation]:
    """Decode every prompt; `drafter` None = plain decoding (one token per row per step).
    `sampling`: one for every row, or one per prompt (each with its own generator, a row then
    samples as that prompt does alone, whatever the batch). Returns one Generation per
    prompt, in order, counted as speculate.SpecStats counts."""
    aux = drafter is not None and bool(drafter.aux_layer_ids)
    if aux and tuple(drafter.aux_layer_ids) != tuple(target.aux_layer_ids):
        raise EyasError(f"the drafter reads target layers {drafter.aux_layer_ids} but the "
                        f"target captures {target.aux_layer_ids} (internal error)")
    b = len(prompts)
    rows = sampling if isinstance(sampling, list) else [sampling] * b
    stats = [SpecStats(k=k if drafter is not None else 0) for _ in range(b)]
    logits, new_aux = target.start(prompts, aux=aux)
    if drafter is not None:
        drafter.begin(b, max(len(p) for p in prompts) + max_new_tokens + k + 2)
    seqs, outs, news = [], [], []
    for r, p in enumerate(prompts):
        stats[r].observe(0, 0)
        token, _ = pick(logits[r], rows[r])
        seqs.append(p.tolist() + [token])
        outs.append([token])
        news.append([token])
    live = list(range(b))  # prompt index of each batch row
    new_aux = new_aux if aux else None
    while True:
        going = [i for i, r in enumerate(live)
                 if not _finished(outs[r], news[r], max_new_tokens, stop_ids)]
        if not going:
            break
        if len(going) < len(live):
            live = [live[i] for i in going]
            target.select(going)
            if drafter is not None:
                drafter.select(going)
            new_aux = [new_aux[i] for i in going] if new_aux is not None else None
        if drafter is None:
            proposals = [Proposal([]) for _ in live]
        else:
            with target_attention():  # (the draft's cache grows each step as the target's)
                proposals = drafter.propose([seqs[r] for r in live], new_aux, k,
                                            [rows[r] for r in live])
            if any(len(p.tokens) > k for p in proposals):
                raise EyasError(f"drafter {type(drafter).__name__} proposed more than k={k}")
        logits, states = target.step([[seqs[r][-1], *p.tokens]
                                      for r, p in zip(live, proposals)], aux=aux)
        if rows[0].temperature == 0:
            verdicts = _accept_greedy(logits, proposals)
        else:
            verdicts = [verify(logits[i, : len(p.tokens) + 1], p, rows[r])
                        for i, (r, p) in enumerate(zip(live, proposals))]
        target.commit([a + 1 for a, _ in verdicts])
        for i, (r, p, (accepted, token)) in enumerate(zip(live, proposals, verdicts)):
            stats[r].observe(len(p.tokens), accepted)
            news[r] = p.tokens[:accepted] + [token]
            seqs[r] += news[r]
            outs[r] += news[r]
        if states is not None:  # the last token's and the accepted drafts' states
            new_aux = [states[i, : a + 1] for i, (a, _) in enumerate(verdicts)]
    return [Generation(_cut(o, max_new_tokens, stop_ids), s) for o, s in zip(outs, stats)]
