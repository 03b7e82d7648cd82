"""Trained == served: chain decoding replayed on TTT hits (training's forward) against the
real speculative loop (eyas.serve.speculate, the draft run the way vLLM runs it), and
chain_acceptance's counting on hand-made hits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eyas.draft.loss import chain_acceptance
from eyas.targets.models import inspect_model
from eyas.draft.replay import replay
from eyas.serve.speculate import (Eagle3Drafter, Sampling, TargetRunner, generate_plain,
                                  generate_speculative)

pytestmark = pytest.mark.usefixtures("one_thread")

def test_chain_acceptance_counts_rounds_as_vllm_does():
    # one document: 2 prompt tokens, then 8 generated (positions 2..9)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 1])
    doc = torch.zeros(10, dtype=torch.long)
    hits = torch.zeros(3, 10, dtype=torch.bool)
    # round 1 starts at position 1 (before the first generated token): 2 accepted
    hits[0, 1] = hits[1, 1] = True
    # round 2 at 1 + 3 = 4: all 3 accepted; then at 8 the last token (9) is the target's own
    hits[:, 4] = True
    hits[0, 6] = True  # never a round start at k=3: ignored
    hits[1, 7] = True  # past a miss at step 0: ignored
    drafts, accepted = chain_acceptance(hits, mask, doc, 3)
    assert (drafts, accepted) == (2, [2, 2, 1])
    # k=1 from the same hits: rounds at 1 (hit), 3 (miss), 4 (hit), 6 (hit)
    assert chain_acceptance(hits, mask, doc, 1) == (4, [3])
    # a round near the end drafts only what is left: at k=3 with the first round rejected,
    # rounds at 1, 2, ..., 7 (m = 3, 3, 3, 3, 3, 2, 1)
    assert chain_acceptance(torch.zeros(3, 10, dtype=torch.bool), mask, doc, 3) == (7, [0, 0, 0])
    # a second document packed after the first one restarts the chain
    both = chain_acceptance(hits.repeat(1, 2), mask.repeat(2), torch.cat([doc, doc + 1]), 3)
    assert both == (4, [4, 4, 2])
    with pytest.raises(ValueError, match="k=4"):
        chain_acceptance(hits, mask, doc, 4)

@pytest.fixture(scope="module")
def llama(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()

def _rounds(drafter_cls):
    """A drafter class recording the sequence length at each proposal."""
    class Recording(drafter_cls):
        def begin(self):
            super().begin()
            self.starts = []

        def propose(self, tokens, new_aux, k, sampling):
            self.starts.append(tokens.shape[0])
            return super().propose(tokens, new_aux, k, sampling)
    return Recording

@pytest.mark.parametrize("draft_layers", [1, 2])
def test_replay_on_ttt_hits_equals_the_speculative_loop(llama, fit_draft, draft_layers):
    """For several prompts and k, every round of the real loop (where it starts and how many
    drafts it accepts) is the replayed round of chain decoding on training's TTT hits; for a
    draft of 2 decoder layers too (the loop's KV cache per layer, cropped on rejection,
    against the TTT's keys per layer)."""
    info = inspect_model(llama)
    layers, norm, head = llama.model.layers, llama.model.norm, llama.lm_head.weight
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, 2000, (n,), generator=gen) for n in (9, 14, 20, 31)]
    runner = TargetRunner(llama, layers, norm, info.default_aux_layer_ids)
    new = 40
    refs = [generate_plain(runner, p, new, frozenset(), Sampling()).tokens for p in prompts]
    draft = fit_draft(llama, info, prompts, refs, draft_layers)
    total_accepted, deep = 0, 0
    for k in (1, 3, 5):
        for prompt, ref in zip(prompts, refs):
            drafter = _rounds(Eagle3Drafter)(draft, "cpu")
            out = generate_speculative(runner, drafter, prompt, k, new, frozenset(), Sampling())
            assert out.tokens == ref
            # accepted per round from the loop: the sequence grows by accepted + 1
            grown = [b - a - 1 for a, b in zip(drafter.starts, drafter.starts[1:])]
            replayed = _replayed_rounds(llama, draft, prompt, ref, k)
            # every round the loop finished is the replayed round (the loop's last one may
            # draft past the continuation: max_new_tokens cut it)
            assert replayed[:len(grown)] == grown
            drafts, accepted = replay(llama, layers, norm, head, draft, prompt, ref, (k,))[k]
            assert drafts == len(replayed) and sum(accepted) == sum(replayed)
            total_accepted += out.stats.accepted
            deep += sum(out.stats.accepted_per_position[1:])
    # the comparison saw many accepted drafts, at later chain positions too
    assert total_accepted > 60 and deep > 20, (total_accepted, deep)

def _replayed_rounds(llama, draft, prompt, ref, k):
    """The accepted count of each replayed round (chain_acceptance's walk, one document)."""
    from eyas.draft.replay import teacher_forced_batch
    from eyas.draft.ttt import ttt_forward

    batch = teacher_forced_batch(llama, llama.model.layers, llama.model.norm,
                                 tuple(draft.cfg.aux_layer_ids), prompt, ref)
    with torch.inference_mode():
        hits = ttt_forward(draft, batch, llama.lm_head.weight, steps=k, record_hits=True).hits
    at, end, rounds = prompt.shape[0] - 1, prompt.shape[0] + len(ref) - 1, []
    while (m := min(k, end - at - 1)) > 0:
        a = 0
        while a < m and hits[a, at]:
            a += 1
        rounds.append(a)
        at += a + 1
    return rounds
