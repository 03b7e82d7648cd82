"""Chain decoding replayed with training's own TTT forward on the sequences `eyas eval` made.

At temperature 0 a speculative generation emits exactly the target's greedy continuation,
and its acceptance is fixed by which of the draft's chained predictions along that
continuation are right. Training scores the same predictions in its TTT forward
(eyas.draft.ttt.ttt_forward; step j at position n predicts token n+2+j from ground-truth tokens,
which are the draft's own tokens wherever the chain is still accepted). So running the
target once over prompt + continuation, capturing its aux states as `eyas capture` does,
and replaying chain decoding on the TTT's hits (eyas.draft.loss.chain_acceptance) must give the
acceptance `eyas eval` measured: where they differ, the draft is not served as it was
trained (a layer id, a shift, a cache or a RoPE position differs between the two paths),
or numerics flipped near-ties. `eyas eval` reports both (docs/eval.md).
"""

from __future__ import annotations

import torch

from eyas.draft.loss import chain_acceptance
from eyas.targets.sdpa import target_attention
from eyas.targets.taps import AuxTaps
from eyas.draft.ttt import TTTBatch, ttt_forward


def teacher_forced_batch(model, layers, final_norm, aux_layer_ids, prompt: torch.Tensor,
                         continuation: list[int]) -> TTTBatch:
    """One target forward over prompt + continuation -> a one-document TTTBatch whose loss
    mask covers the continuation (the tokens the target generated)."""
    device = model.get_input_embeddings().weight.device
    ids = torch.cat([prompt, torch.tensor(continuation, dtype=torch.long)]).to(device)  # (N,)
    taps = AuxTaps(layers, final_norm, aux_layer_ids, len(layers), final=True)
    with torch.inference_mode(), taps.attached(), target_attention():
        logits = model(input_ids=ids[None], use_cache=False).logits[0]  # (N, V)
    aux, final = taps.collect(device)  # (N, 3, Ht), (N, Ht)
    n = ids.shape[0]
    mask = torch.zeros(n, dtype=torch.long, device=device)
    mask[prompt.shape[0]:] = 1
    return TTTBatch(input_ids=ids[None], aux_hidden=aux.reshape(1, n, -1),
                    final_hidden=final[None], target_top1=logits.argmax(-1)[None],
                    loss_mask=mask[None], position_ids=torch.arange(n, device=device)[None],
                    doc_ids=torch.zeros(1, n, dtype=torch.long, device=device))


@torch.inference_mode()
def replay(model, layers, final_norm, lm_head_weight: torch.Tensor, draft,
           prompt: torch.Tensor, continuation: list[int],
           ks: tuple[int, ...]) -> dict[int, tuple[int, list[int]]]:
    """Per k: (drafts, accepted at each position) of chain decoding replayed on one
    generation. lm_head_weight (V, Ht): the target's output head (the TTT teacher)."""
    batch = teacher_forced_batch(model, layers, final_norm, tuple(draft.cfg.aux_layer_ids),
                                 prompt, continuation)
    out = ttt_forward(draft, batch, lm_head_weight, steps=max(ks), record_hits=True)
    return {k: chain_acceptance(out.hits, batch.loss_mask, batch.doc_ids, k) for k in ks}
