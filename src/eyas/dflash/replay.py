"""Block drafting replayed with training's DFlash forward on the sequences `eyas eval` made.

At temperature 0 a speculative generation emits exactly the target's greedy continuation. Each
round's acceptance is fixed by one block: `[last token, MASK x k]` anchored at that token, its
context the target's tap states before it. Every such block comes from the target's states
over prompt + continuation alone, so one target forward and one draft forward (the blocks of
every anchor at once, each attending to its context band, as `dflash_forward` trains them)
give them all. Walking the rounds over those blocks (eyas.draft.loss.chain_acceptance, vLLM's
counting) must give the acceptance `eyas eval` measured. Where the two differ, the draft is not
served as it was trained, or numerics flipped near-ties (docs/eval.md).
"""

from __future__ import annotations

import torch

from eyas.dflash.model import DFlashDraft
from eyas.draft.loss import chain_acceptance
from eyas.targets.sdpa import target_attention
from eyas.targets.taps import AuxTaps

ANCHORS_PER_CHUNK = 256  # blocks through the lm_head at once: (chunk * k, V) logits


@torch.inference_mode()
def replay_dflash(model, layers, final_norm, draft: DFlashDraft, prompt: torch.Tensor,
                  continuation: list[int], ks: tuple[int, ...]) -> dict[int, tuple[int, list[int]]]:
    """Per k: (drafts, accepted at each position) of block drafting with k drafts per round
    (blocks of k + 1, as vLLM drafts num_speculative_tokens = k) replayed on one generation."""
    device = model.get_input_embeddings().weight.device
    seq = torch.cat([prompt, torch.tensor(continuation, dtype=torch.long)]).to(device)  # (N,)
    n, p = seq.shape[0], prompt.shape[0]
    taps = AuxTaps(layers, final_norm, tuple(draft.cfg.aux_layer_ids), len(layers), final=False)
    with taps.attached(), target_attention():
        top1 = model(input_ids=seq[None], use_cache=False).logits[0].argmax(-1)  # (N,)
    aux = taps.collect(device)[0].flatten(1)  # (N, n_taps * Ht)
    dtype = draft.fc.weight.dtype
    positions = torch.arange(n, device=device)
    kv = draft.context_kv(draft.context(aux.to(dtype)), positions)
    # the first round's anchor is the target's first token (p); the last useful one is n - 2
    anchors = torch.arange(p, n - 1, device=device)
    mask = torch.zeros(n, dtype=torch.long, device=device)
    mask[p:] = 1
    doc = torch.zeros(n, dtype=torch.long, device=device)
    out = {}
    for k in ks:
        # hits (k, N): at n = a - 1, slot j + 1 of the block anchored at a predicted token
        # a + 1 + j, the target's greedy choice there (chain_acceptance's indexing: a round
        # that starts at n drafts the tokens n + 2 ...)
        hits = torch.zeros(k, n, dtype=torch.bool, device=device)
        for chunk in anchors.split(ANCHORS_PER_CHUNK):
            drafted = block_logits(draft, kv, seq, chunk, k).argmax(-1)  # (c, k)
            at = chunk[:, None] + torch.arange(1, k + 1, device=device)  # (c, k) positions
            want = top1[(at - 1).clamp(max=n - 1)]  # (c, k) the greedy token at a+1+j
            inside = at <= n  # a prediction of position n is the target's next token
            hits[:, chunk - 1] = ((drafted == want) & inside).t()
        out[k] = chain_acceptance(hits, mask, doc, k)
    return out


def block_logits(draft: DFlashDraft, kv: list, seq: torch.Tensor, anchors: torch.Tensor,
                 k: int) -> torch.Tensor:
    """(A, k, V) logits of the k drafts of each block [seq[a], MASK x k] at positions
    a..a+k, all A blocks in one forward, each seeing the context keys 0..a-1 (the target's
    states before its anchor) and itself; kv: draft.context_kv over seq's positions."""
    slots = torch.arange(k + 1, device=seq.device)
    ids = torch.full((len(anchors), k + 1), draft.cfg.mask_token_id, device=seq.device)
    ids[:, 0] = seq[anchors]
    at = anchors[:, None] + slots  # (A, k+1) the positions of each block's slots
    h = draft(ids.flatten(), at.flatten(), kv,
              torch.zeros(at.numel(), dtype=torch.long, device=seq.device),
              (anchors - 1).repeat_interleave(k + 1), block=k + 1)  # (A*(k+1), H)
    return draft.logits(h.view(len(anchors), k + 1, -1)[:, 1:])
