"""Batched speculative decoding (eyas.serve.batched) equals the batch-1 loop token for token
and counter for counter at T=0 (float32), for plain, n-gram and EAGLE-3 decoding, on prompts
of different lengths that finish at different steps, on Llama, a multimodal wrapper and an
MoE target; at T>0 it keeps the target's law."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eyas.serve.batched import (BatchEagle3Drafter, BatchNgramDrafter, BatchTarget,
                                generate_batch)
from eyas.serve.speculate import (Eagle3Drafter, NgramDrafter, Sampling, TargetRunner,
                                  generate_plain, generate_speculative)
from eyas.targets.models import inspect_model, load_target, submodule

pytestmark = pytest.mark.usefixtures("one_thread")
NO_STOP = frozenset()
IDS = (2, 4, 5)  # the 8-layer tiny Llama's default aux ids (what fit_draft trains on)


@pytest.fixture(scope="module")
def llama(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    """Five prompts of 3..40 tokens; the third repeats itself so n-gram lookup hits."""
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(10, 2000, (n,), generator=g) for n in (17, 3, 12, 40, 25)]
    ps[2] = torch.cat([ps[2], ps[2], ps[2][:5]])
    return ps


@pytest.fixture(scope="module")
def draft(llama, prompts, fit_draft):
    """Fitted to the greedy continuations of `prompts`, so it is often right (not always)."""
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm)
    refs = [generate_plain(runner, p, 30, NO_STOP, Sampling()).tokens for p in prompts]
    return fit_draft(llama, inspect_model(llama), prompts, refs)


def _one_by_one(runner, drafter, prompts, k, n, stop=NO_STOP):
    if drafter is None:
        return [generate_plain(runner, p, n, stop, Sampling()) for p in prompts]
    return [generate_speculative(runner, drafter, p, k, n, stop, Sampling()) for p in prompts]


def _same(batched, single):
    for b, s in zip(batched, single, strict=True):
        assert b.tokens == s.tokens
        assert (b.stats.drafts, b.stats.accepted, b.stats.target_forwards,
                b.stats.accepted_per_position) == (s.stats.drafts, s.stats.accepted,
                                                   s.stats.target_forwards,
                                                   s.stats.accepted_per_position)


def test_plain_and_ngram_batched_equal_batch_one(llama, prompts):
    layers, norm = llama.model.layers, llama.model.norm
    runner, batch = TargetRunner(llama, layers, norm), BatchTarget(llama, layers, norm)
    plain = _one_by_one(runner, None, prompts, 0, 20)
    _same(generate_batch(batch, None, prompts, 0, 20, NO_STOP, Sampling()), plain)
    for k in (1, 3):
        single = _one_by_one(runner, NgramDrafter(1, 3), prompts, k, 20)
        assert [g.tokens for g in single] == [g.tokens for g in plain]
        assert sum(g.stats.accepted for g in single) > 0  # lookups that hit
        _same(generate_batch(batch, BatchNgramDrafter(1, 3), prompts, k, 20, NO_STOP,
                             Sampling()), single)


def test_eagle3_batched_equals_batch_one(llama, draft, prompts):
    layers, norm, ids = llama.model.layers, llama.model.norm, IDS
    runner = TargetRunner(llama, layers, norm, ids)
    batch = BatchTarget(llama, layers, norm, ids)
    for k in (1, 4):
        single = _one_by_one(runner, Eagle3Drafter(draft, "cpu"), prompts, k, 24)
        # rounds that accept several drafts: step 0 then runs over rows of unequal lengths
        assert sum(g.stats.accepted_per_position[k - 1] for g in single) > 0
        got = generate_batch(batch, BatchEagle3Drafter(draft, "cpu"), prompts, k, 24, NO_STOP,
                             Sampling())
        _same(got, single)


def test_two_layer_eagle3_batched_equals_batch_one(llama, prompts, fit_draft):
    """A draft of 2 decoder layers: the batched drafter's per-layer slot caches give every
    row the tokens and counters of the batch-1 loop (whose cache is cropped per layer)."""
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm)
    refs = [generate_plain(runner, p, 30, NO_STOP, Sampling()).tokens for p in prompts]
    draft = fit_draft(llama, inspect_model(llama), prompts, refs, layers=2)
    layers, norm, ids = llama.model.layers, llama.model.norm, IDS
    runner = TargetRunner(llama, layers, norm, ids)
    batch = BatchTarget(llama, layers, norm, ids)
    single = _one_by_one(runner, Eagle3Drafter(draft, "cpu"), prompts, 4, 24)
    assert sum(g.stats.accepted_per_position[3] for g in single) > 0
    got = generate_batch(batch, BatchEagle3Drafter(draft, "cpu"), prompts, 4, 24, NO_STOP,
                         Sampling())
    _same(got, single)


def test_rows_that_stop_early_leave_the_batch(llama, draft, prompts):
    """Stop ids end rows at different steps; the rows left keep decoding exactly."""
    layers, norm, ids = llama.model.layers, llama.model.norm, IDS
    runner = TargetRunner(llama, layers, norm, ids)
    plain = _one_by_one(runner, None, prompts, 0, 30)
    # a token the 2nd and 4th prompts produce early, and no other prompt before its end
    stop = frozenset({plain[1].tokens[2], plain[3].tokens[5]})
    single = _one_by_one(runner, Eagle3Drafter(draft, "cpu"), prompts, 3, 30, stop)
    lengths = [len(g.tokens) for g in single]
    assert min(lengths) < 30 and max(lengths) == 30, lengths
    got = generate_batch(BatchTarget(llama, layers, norm, ids), BatchEagle3Drafter(draft, "cpu"),
                         prompts, 3, 30, stop, Sampling())
    _same(got, single)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_moe"])
def test_batched_on_wrapper_and_moe_targets(tiny_model_dir, arch, prompts):
    model, info = load_target(tiny_model_dir(arch), dtype="float32")
    layers, norm = submodule(model, info.layers_path), submodule(model, info.norm_path)
    runner = TargetRunner(model, layers, norm)
    single = _one_by_one(runner, NgramDrafter(1, 3), prompts, 3, 16)
    got = generate_batch(BatchTarget(model, layers, norm), BatchNgramDrafter(1, 3), prompts, 3,
                         16, NO_STOP, Sampling())
    _same(got, single)


@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_sampling_in_a_batch_keeps_the_targets_law(llama, draft, draft_sampling):
    """T=1: the first two new tokens of one prompt, decoded as 600 rows of one batch with
    EAGLE-3 k=2, follow the target's own law (total variation against exact probabilities
    under the tolerance of 600 samples)."""
    prompt = torch.randint(10, 2000, (6,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        llama.lm_head.weight.mul_(0.02)  # a flat law: many tokens with mass, drafts rejected
    try:
        first = torch.softmax(llama(prompt[None]).logits[0, -1], -1)
        gen = torch.Generator().manual_seed(0)
        rows = generate_batch(BatchTarget(llama, llama.model.layers, llama.model.norm,
                                          IDS),
                              BatchEagle3Drafter(draft, "cpu"), [prompt] * 600, 2, 2, NO_STOP,
                              Sampling(1.0, gen, draft_sampling))
        counts = torch.bincount(torch.tensor([g.tokens[0] for g in rows]),
                                minlength=first.numel()).float()
        second = [g.tokens[1] for g in rows]
        assert len(set(second)) > 50  # the rows did sample independently
    finally:
        with torch.no_grad():
            llama.lm_head.weight.div_(0.02)
    tv = 0.5 * (counts / counts.sum() - first).abs().sum()
    assert tv < 0.5 * (first.numel() / 600) ** 0.5, tv  # ~ the sampling noise of 600 draws


def test_batched_on_a_remote_code_wrapper(kimi_like_dir, prompts):
    """The Kimi-K2.5-like remote-code wrapper (DeepSeek-V3 decoder inside): batched n-gram
    decoding equals batch 1."""
    model, info = load_target(kimi_like_dir, dtype="float32", trust_remote_code=True)
    layers, norm = submodule(model, info.layers_path), submodule(model, info.norm_path)
    single = _one_by_one(TargetRunner(model, layers, norm), NgramDrafter(1, 3), prompts, 3, 12)
    got = generate_batch(BatchTarget(model, layers, norm), BatchNgramDrafter(1, 3), prompts, 3,
                         12, NO_STOP, Sampling())
    _same(got, single)


def test_batched_target_and_draft_run_without_cudnn_attention(llama, draft, prompts,
                                                              cudnn_seen):
    # both caches grow every step: cuDNN's attention would plan each new length on the host
    # (eyas.targets.sdpa; session 41's H100: 95.5 -> 63.0 ms a step at batch 64, k = 2)
    seen = cudnn_seen(draft, llama.model.layers[0].self_attn)
    layers, norm, ids = llama.model.layers, llama.model.norm, draft.cfg.aux_layer_ids
    generate_batch(BatchTarget(llama, layers, norm, ids), BatchEagle3Drafter(draft, "cpu"),
                   prompts, 3, 6, NO_STOP, Sampling())
    assert len(seen) > 4 and not any(seen)
