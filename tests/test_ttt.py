"""Training-time test: attention, shifts, masks, loss and pruning against a straightforward
dense-mask TTT written here (fp32), on packed rows with padding."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from eyas.kernels.attention import BLOCK, attention, band_block_mask
from eyas.draft.config import DraftConfig
from eyas.draft.eagle3 import Eagle3Draft
from eyas.draft.loss import simulated_acceptance_length, soft_cross_entropy
from eyas.draft.ttt import TTTBatch, ttt_forward, ttt_positions


def tiny_cfg(**kw) -> DraftConfig:
    base = dict(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=256, vocab_size=50, draft_vocab_size=30,
                aux_layer_ids=(1, 2, 3))
    base.update(kw)
    return DraftConfig(**base)


def make_draft(cfg: DraftConfig, seed=0) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg, torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size))
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]] = True
    draft.set_vocab(t2d.nonzero().squeeze(1) - torch.arange(cfg.draft_vocab_size), t2d)
    return draft


def packed_batch(cfg: DraftConfig, docs: list[list[int]], t: int, seed=0) -> TTTBatch:
    """Rows of packed documents (lengths per row), padded with doc id -1 to length t."""
    g = torch.Generator().manual_seed(seed)
    b = len(docs)
    doc_ids = torch.full((b, t), -1, dtype=torch.long)
    pos = torch.zeros(b, t, dtype=torch.long)
    for r, lengths in enumerate(docs):
        at = 0
        for d, n in enumerate(lengths):
            doc_ids[r, at: at + n], pos[r, at: at + n] = d, torch.arange(n)
            at += n
    # assistant spans: runs of ~60% ones, like chat data
    spans = (torch.rand(b, t, generator=g) < 0.2).cumsum(1) % 2 == 1  # alternating runs
    mask = spans | (torch.rand(b, t, generator=g) < 0.3)
    return TTTBatch(
        input_ids=torch.randint(0, cfg.vocab_size, (b, t), generator=g),
        aux_hidden=torch.randn(b, t, 3 * cfg.target_hidden_size, generator=g),
        final_hidden=torch.randn(b, t, cfg.target_hidden_size, generator=g) * 3,
        target_top1=torch.randint(0, cfg.vocab_size, (b, t), generator=g).to(torch.int32),
        loss_mask=(mask & (doc_ids >= 0)).to(torch.uint8),
        position_ids=pos, doc_ids=doc_ids)


# ---------------------------------------------------------------- the dense reference

def reference_ttt(draft, batch, lm_head, steps, weight=0.8, hits=None, mask_at="predicted",
                  vocab_filter=True):
    """Unpruned TTT with every step's keys concatenated and an explicit (N, N*(j+1)) mask,
    in each decoder layer over that layer's own keys.
    Shift convention: step j at position t reads token t+1+j, RoPE position pos+j and
    predicts token t+2+j against the teacher at t+1+j. hits: a (steps, N) bool tensor to
    mark the loss positions whose top-1 is right. A position counts where the token it
    predicts (mask_at "predicted") or reads ("input") is in the loss mask (any token of the
    document: "all") and, with vocab_filter, the teacher's top-1 is in the draft vocab."""
    b, t = batch.input_ids.shape
    n = b * t
    ids, pos = batch.input_ids.reshape(-1), batch.position_ids.reshape(-1)
    top1, lmask = batch.target_top1.reshape(-1).long(), batch.loss_mask.reshape(-1).bool()
    doc = batch.doc_ids.reshape(-1)
    # segment label of each flat position: (row, document), and its last flat index
    label = [(i // t, int(doc[i])) for i in range(n)]
    last = [max(m for m in range(n) if label[m] == label[i]) for i in range(n)]
    same_doc = torch.tensor([[label[a] == label[c] for c in range(n)] for a in range(n)])
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    t2d = draft.t2d
    probs = torch.softmax((batch.final_hidden.reshape(n, -1) @ lm_head.T)[:, t2d], -1)  # (N, Vd)
    target_of = torch.arange(t2d.sum()) + draft.d2t  # draft id -> target id
    hidden = draft.fuse(batch.aux_hidden).reshape(n, -1)
    total, means, accs, counts = 0.0, [], [], []
    cfg = draft.cfg
    layers = cfg.num_hidden_layers
    keys, values = [[] for _ in range(layers)], [[] for _ in range(layers)]  # per layer
    for j in range(steps):
        # out-of-document inputs get token 0: they must never reach a counted loss
        tok = torch.tensor([int(ids[i + 1 + j]) if i + 1 + j <= last[i] else 0 for i in range(n)])
        allowed = torch.cat([same_doc & causal] + [torch.eye(n, dtype=torch.bool)] * j, 1)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads  # GQA: kv head per query head
        h = hidden
        for layer in range(layers):
            q, k, v, res = draft.project(tok, h, pos + j, layer=layer)
            keys[layer].append(k)
            values[layer].append(v)
            kk = torch.cat(keys[layer]).repeat_interleave(rep, 1)
            vv = torch.cat(values[layer]).repeat_interleave(rep, 1)
            scores = torch.einsum("nhd,mhd->hnm", q, kk) / math.sqrt(cfg.head_dim)
            scores = scores.masked_fill(~allowed, float("-inf"))
            out = torch.einsum("hnm,mhd->nhd", scores.softmax(-1), vv)
            h = draft.finish(out, res, layer=layer)
        logits = draft.lm_head(draft.norm(h))  # (N, Vd) materialised
        shift = 2 + j if mask_at == "predicted" else 1 + j
        rows = [i for i in range(n) if i + shift <= last[i] and doc[i] >= 0
                and (lmask[i + shift] if mask_at != "all" else
                     any(lmask[m] for m in range(n) if label[m] == label[i]))
                and (t2d[top1[i + 1 + j]] or not vocab_filter)]
        if rows:
            r = torch.tensor(rows)
            ce = -(probs[r + 1 + j] * F.log_softmax(logits[r], -1)).sum(-1)
            means.append(ce.mean())
            right = target_of[logits[r].argmax(-1)] == top1[r + 1 + j]
            accs.append(right.float().mean())
            if hits is not None:
                hits[j, r] = right
        else:
            means.append(logits.sum() * 0)
            accs.append(torch.zeros(()))
        counts.append(len(rows))
        total = total + weight ** j * means[-1]
        hidden = draft.next_hidden(h)
    return total, torch.stack(means).detach(), torch.stack(accs), counts


def grads(draft, loss):
    draft.zero_grad()
    loss.backward()
    return {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}


CASES = [  # (rows of document lengths, row length T, steps)
    ([[13]], 16, 1),
    ([[5, 9, 2], [16]], 17, 3),
    ([[7, 1, 11], [4, 4, 4, 3]], 24, 7),
    ([[5, 3, 1]], 11, 5),  # documents shorter than the step count
]


@pytest.mark.parametrize("docs,t,steps", CASES)
@pytest.mark.parametrize("variant", [{}, {"norm_output": True, "norm_before_residual": True},
                                     {"fc_norm": True}, {"norm_before_fc": True}])
def test_ttt_matches_dense_reference(docs, t, steps, variant):
    cfg = tiny_cfg(**variant)
    draft = make_draft(cfg)
    batch = packed_batch(cfg, docs, t, seed=len(docs) + t)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    ref_loss, ref_means, ref_acc, ref_counts = reference_ttt(draft, batch, lm_head, steps)
    ref_grads = grads(draft, ref_loss)
    out = ttt_forward(draft, batch, lm_head, steps=steps, vocab_chunk=7)
    got_grads = grads(draft, out.loss)
    assert out.step_count.tolist() == ref_counts and sum(ref_counts) > 0
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_loss, ref_means, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_acc, ref_acc)
    assert set(got_grads) == set(ref_grads)
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("docs,t,steps", CASES)
@pytest.mark.parametrize("variant", [{}, {"norm_output": True, "norm_before_residual": True}])
@pytest.mark.parametrize("prune", [True, False])
def test_two_layer_ttt_matches_dense_reference(docs, t, steps, variant, prune):
    """A 2-layer draft: each step's attention in each layer over that layer's step-0 keys
    and its own keys of earlier steps, pruned or not; loss, counts, accuracies and every
    gradient (layer 1's included) as the dense reference's."""
    cfg = tiny_cfg(num_hidden_layers=2, **variant)
    draft = make_draft(cfg)
    batch = packed_batch(cfg, docs, t, seed=len(docs) + t)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    ref_loss, ref_means, ref_acc, ref_counts = reference_ttt(draft, batch, lm_head, steps)
    ref_grads = grads(draft, ref_loss)
    out = ttt_forward(draft, batch, lm_head, steps=steps, vocab_chunk=7, prune=prune)
    got_grads = grads(draft, out.loss)
    assert out.step_count.tolist() == ref_counts and sum(ref_counts) > 0
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_loss, ref_means, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_acc, ref_acc)
    assert any(name.startswith("layers.1.") for name in ref_grads)
    assert set(got_grads) == set(ref_grads)
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("docs,t,steps", CASES)
@pytest.mark.parametrize("positions", [{"mask_at": "input"}, {"vocab_filter": False},
                                       {"mask_at": "input", "vocab_filter": False},
                                       {"mask_at": "all", "vocab_filter": False}])
def test_other_loss_positions_match_dense_reference(docs, t, steps, positions):
    """speculators' choice of loss positions (the token a step reads is in the loss mask; a
    top-1 outside the draft vocab kept, and never right) against the dense reference, and
    that it differs from eyas's on these batches."""
    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, docs, t, seed=len(docs) + t)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    ref_loss, ref_means, ref_acc, ref_counts = reference_ttt(draft, batch, lm_head, steps,
                                                             **positions)
    ref_grads = grads(draft, ref_loss)
    out = ttt_forward(draft, batch, lm_head, steps=steps, vocab_chunk=7, **positions)
    got_grads = grads(draft, out.loss)
    assert out.step_count.tolist() == ref_counts
    assert ttt_positions(batch, draft.t2d, steps, **positions).sum(1).tolist() == ref_counts
    assert ref_counts != reference_ttt(draft, batch, lm_head, steps)[3]
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_acc, ref_acc)
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_loss_on_all_positions_leaves_out_a_document_without_a_loss_mask():
    """--loss-mask-at all trains on the prompt's positions, but a document whose loss mask
    is all zero (the capture clears it for a sample whose states were not finite, so that
    it adds no loss) still carries none, while the documents beside it carry every
    position whose teacher is inside them."""
    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[5, 6, 4]], 16, seed=2)
    doc = batch.doc_ids.reshape(-1)
    batch.loss_mask.reshape(-1)[doc == 1] = 0  # the middle document: no loss mask left
    valid = ttt_positions(batch, draft.t2d, 3, "all", vocab_filter=False)
    assert not valid[:, doc == 1].any()
    for d, size in ((0, 5), (2, 4)):
        assert valid[:, doc == d].sum(1).tolist() == [size - 1 - j for j in range(3)]
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    counts = reference_ttt(draft, batch, lm_head, 3, mask_at="all", vocab_filter=False)[3]
    assert counts == valid.sum(1).tolist()


@pytest.mark.parametrize("docs,t,steps", CASES)
def test_recorded_hits_are_the_references(docs, t, steps):
    """record_hits marks exactly the (step, position) pairs whose top-1 the dense reference
    finds right (a 2-token draft vocabulary and teachers drawn from it: many hits), in the
    one-run and the gathered loss paths alike (sparse masks take the gathered one)."""
    cfg = tiny_cfg(draft_vocab_size=2)
    draft = make_draft(cfg)
    batch = packed_batch(cfg, docs, t, seed=len(docs) + t)
    ids = draft.t2d.nonzero().squeeze(1)
    pick = torch.randint(0, 2, batch.target_top1.shape, generator=torch.Generator().manual_seed(1))
    batch.target_top1 = ids[pick].to(torch.int32)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    valid = ttt_positions(batch, draft.t2d, steps)
    ref_hits = torch.zeros_like(valid)
    with torch.no_grad():
        out = ttt_forward(draft, batch, lm_head, steps=steps, vocab_chunk=7, record_hits=True)
        reference_ttt(draft, batch, lm_head, steps, hits=ref_hits)
    assert ref_hits.sum() >= 2
    assert torch.equal(out.hits, ref_hits) and not (out.hits & ~valid).any()


def test_pruning_is_exact_and_prunes():
    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[20, 9, 30], [59]], 64, seed=3)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    full = ttt_forward(draft, batch, lm_head, steps=7, prune=False)
    full_grads = grads(draft, full.loss)
    pruned = ttt_forward(draft, batch, lm_head, steps=7)
    pruned_grads = grads(draft, pruned.loss)
    assert pruned.step_rows[0] == 128 and full.step_rows == [128] * 7
    assert pruned.step_rows[1] < 128 and pruned.step_rows[-1] == int(pruned.step_count[-1])
    torch.testing.assert_close(pruned.loss, full.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pruned.step_acc, full.step_acc)
    for name in full_grads:
        torch.testing.assert_close(pruned_grads[name], full_grads[name], atol=1e-6, rtol=1e-5)


def test_runs_of_rows_are_found_for_slicing():
    """Every position supervised: each step keeps a run of positions 0..T-3-j and its loss
    rows are that run, so ttt_forward indexes by slices (views; the results are checked
    against the dense reference in test_one_document_takes_the_fast_path...). A gap (a
    top-1 outside the draft vocab) breaks the run of every step that loses the row."""
    from eyas.draft.ttt import _plan

    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[40]], 40, seed=5)
    batch.loss_mask[:] = 1
    in_vocab = draft.t2d.nonzero().squeeze(1)
    batch.target_top1 = in_vocab[torch.randint(0, in_vocab.numel(), (1, 40))].int()
    plan = _plan(batch, draft.t2d, 4, prune=True)
    assert plan.first == [0] * 8
    assert [c.tolist() for c in plan.cols[:4]] == [list(range(n)) for n in (40, 37, 36, 35)]
    assert plan.offset(2, 1) == 0 and plan.offset(4 + 3, 3) == 0
    assert plan.loss_on_all == [True] * 4  # step 0: 38 of 40 rows count, the rest weigh 0
    batch.target_top1[0, 9] = int((~draft.t2d).nonzero()[0])  # row 9 teaches nothing
    plan = _plan(batch, draft.t2d, 4, prune=True)
    # step j's loss at n reads the teacher at n+1+j: position 8-j loses step j's loss; the
    # kept rows of step 3 (34 of a span of 35) are the whole span, the loss rows are not runs
    assert plan.first[4:] == [None] * 4 and plan.offset(4, 0) is None
    assert plan.first[:4] == [0] * 4 and [c.numel() for c in plan.cols[:4]] == [40, 37, 36, 35]
    assert plan.loss_on_all == [True] * 4
    batch.loss_mask[0, 10:30] = 0  # a prompt in the middle: 35 % of the span, not filled
    plan = _plan(batch, draft.t2d, 4, prune=True)
    assert plan.first[1:4] == [None] * 3 and plan.loss_on_all == [False] * 4


def test_a_plan_made_ahead_gives_the_same_forward():
    """ttt_plan made ahead (as `eyas train` does, from the host batch) and passed in: the same
    result as the plan ttt_forward makes itself; a plan for another shape is refused."""
    from eyas.draft.ttt import ttt_plan

    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[20, 9, 30], [59]], 64, seed=3)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    own = ttt_forward(draft, batch, lm_head, steps=5)
    plan = ttt_plan(batch, draft.t2d, 5, device="cpu")
    given = ttt_forward(draft, batch, lm_head, steps=5, plan=plan)
    assert torch.equal(own.loss, given.loss) and own.step_rows == given.step_rows
    with pytest.raises(ValueError, match="plan is for"):
        ttt_forward(draft, batch, lm_head, steps=4, plan=plan)


def test_embedding_shares_get_every_steps_gradient():
    """The steps' q/k/v take rows of one table of embedding shares (_Shares/_AddShare, whose
    backward sums all steps' rows into one gradient): with the steps chained as in TTT (each
    reads the previous one's output) and rows repeated, the gradients of plain autograd."""
    from eyas.draft.ttt import _Shares

    g = torch.Generator().manual_seed(0)
    x0, table, w = (torch.randn(*shape, generator=g, dtype=torch.float64)
                    for shape in ((5, 4), (6, 4), (4, 4)))
    picks = [torch.tensor(p) for p in ([1, 2, 3, 4, 5], [2, 3, 4, 5, 5], [3, 4, 5, 5, 5])]

    def run(custom: bool):
        x, t = x0.clone().requires_grad_(), table.clone().requires_grad_()
        shares, h = _Shares(t), x
        for at in picks:
            add = shares.adder(at) if custom else (lambda a, at=at: a + t[at])
            h = torch.tanh(add(h @ w))
        (h * torch.arange(20.0, dtype=h.dtype).view(5, 4)).sum().backward()
        return x.grad, t.grad

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want)


def test_a_host_plan_is_made_on_one_thread_and_the_pool_restored(monkeypatch):
    """ttt_plan on the host runs its small ops on one intra-op thread (see its docstring)
    and gives the process its thread count back, also when making the plan fails."""
    from eyas.draft import ttt as ttt_module

    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[20, 9, 30], [59]], 64, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        real = ttt_module._plan
        monkeypatch.setattr(ttt_module, "_plan",
                            lambda *a: seen.append(torch.get_num_threads()) or real(*a))
        plan = ttt_module.ttt_plan(batch, draft.t2d, 5)
        assert seen == [1] and torch.get_num_threads() == 2
        assert plan.valid.shape == (5, batch.input_ids.numel())

        def broken(*a):
            raise RuntimeError("bad batch")

        monkeypatch.setattr(ttt_module, "_plan", broken)
        with pytest.raises(RuntimeError, match="bad batch"):
            ttt_module.ttt_plan(batch, draft.t2d, 5)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_compiled_kernels_trace_and_agree(monkeypatch):
    """The code CUDA runs through torch.compile (norms, RoPE, SwiGLU, the soft-CE chunk, the
    diagonal merge), compiled here on CPU: it must trace as whole graphs (fullgraph) and
    give the eager results; the row counts that change at every step must not each cost a
    recompile."""
    from torch._dynamo.utils import counters

    import eyas.kernels.fused

    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[20, 9, 30], [59]], 64, seed=3)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    eager = ttt_forward(draft, batch, lm_head, steps=7, vocab_chunk=50)
    eager_grads = grads(draft, eager.loss)
    monkeypatch.setattr(eyas.kernels.fused, "COMPILE_DEVICES", {"cpu"})
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(2):
        out = ttt_forward(draft, batch, lm_head, steps=7, vocab_chunk=50)
        got_grads = grads(draft, out.loss)
    assert len(set(out.step_rows)) == 7  # seven different row counts
    # 10 functions (norms, RoPE, SwiGLU, soft-CE, the diagonal merge, the embedding share's
    # gather-add...), a few layouts each; the merge's diagonal count S grows by one per step
    # and turns dynamic after a recompile
    assert 10 <= counters["stats"]["unique_graphs"] - graphs <= 18
    torch.testing.assert_close(out.loss, eager.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_acc, eager.step_acc)
    for name in eager_grads:
        torch.testing.assert_close(got_grads[name], eager_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_lm_head_frozen_or_trained_and_selected_rows():
    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[30]], 32, seed=5)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    draft.init_lm_head_from_target(lm_head, freeze=True)
    out = ttt_forward(draft, batch, lm_head, steps=3)
    out.loss.backward()
    assert draft.lm_head.weight.grad is None and draft.fc.weight.grad is not None
    # already-selected (Vd, Ht) teacher rows give the same loss
    same = ttt_forward(draft, batch, lm_head[draft.t2d], steps=3)
    torch.testing.assert_close(same.loss, out.loss)
    draft.init_lm_head_from_target(lm_head, freeze=False)
    ttt_forward(draft, batch, lm_head, steps=3).loss.backward()
    assert draft.lm_head.weight.grad is not None and draft.lm_head.weight.grad.abs().sum() > 0


def test_step_weights_metrics_and_sim_acceptance():
    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[40]], 40, seed=6)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    out = ttt_forward(draft, batch, lm_head, steps=4, step_weight=0.5)
    expected = sum(0.5 ** j * out.step_loss[j] for j in range(4))
    torch.testing.assert_close(out.loss.detach(), expected)
    # summed per-step losses (what train normalises over a whole optimizer step)
    assert out.step_loss_sum.requires_grad
    torch.testing.assert_close(out.step_loss_sum.detach(), out.step_loss * out.step_count)
    assert out.sim_acceptance_length == pytest.approx(simulated_acceptance_length(out.step_acc))
    assert simulated_acceptance_length([0.5, 0.5, 0.0]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulated_acceptance_length([1.0] * 3) == 4.0


def test_draft_that_copies_the_teacher_scores_full_agreement():
    """A draft whose logits equal the teacher's agrees everywhere: acc 1, loss = entropy."""
    cfg = tiny_cfg(target_hidden_size=32)
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[24]], 24, seed=7)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    teacher = batch.final_hidden @ lm_head.T
    batch.target_top1 = teacher.argmax(-1).to(torch.int32)
    hidden = batch.final_hidden.reshape(-1, 32)
    loss, top1 = soft_cross_entropy(hidden, lm_head[draft.t2d], (hidden @ lm_head.T)[:, draft.t2d])
    p = torch.softmax((hidden @ lm_head.T)[:, draft.t2d], -1)
    torch.testing.assert_close(loss, -(p * p.log()).sum())
    assert torch.equal(top1, p.argmax(-1))


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("indexed", [False, True])
def test_chunked_soft_ce_matches_autograd(chunk, indexed):
    torch.manual_seed(8)
    hidden = torch.randn(13, 16, requires_grad=True)
    weight = torch.randn(21, 16, requires_grad=True)
    teacher = torch.randn(13, 21) * 2
    rows = None
    if indexed:  # the teacher of row i sits at rows[i] of a larger table
        table, rows = torch.randn(40, 21), torch.randperm(40)[:13]
        table[rows] = teacher
    loss, top1 = soft_cross_entropy(hidden, weight, table if indexed else teacher, rows=rows,
                                    chunk=chunk)
    (loss * 3).backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logits = h2 @ w2.T
    ref = -(torch.softmax(teacher, -1) * torch.log_softmax(logits, -1)).sum()
    (ref * 3).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(hidden.grad, h2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)
    assert torch.equal(top1, logits.argmax(-1))
    frozen = torch.randn(21, 16)
    hidden.grad = None
    soft_cross_entropy(hidden, frozen, teacher, chunk=chunk)[0].backward()
    assert hidden.grad is not None
    with torch.no_grad():
        assert not soft_cross_entropy(hidden, weight, teacher)[0].requires_grad


def _lk_reference(logits, teacher, mode, kl_weight=None):
    """LK losses written directly with autograd (the definitions, no hand-made gradient)."""
    p, q = torch.softmax(teacher, -1), torch.softmax(logits, -1)
    alpha = torch.minimum(p, q).sum(-1)
    if mode == "alpha":
        return -torch.log(alpha).sum()
    ce = -(p * torch.log_softmax(logits, -1)).sum(-1)
    return (kl_weight * ce + (1 - kl_weight) * (1 - alpha)).sum()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mode", ["alpha", "lambda"])
def test_lk_losses_chunked_match_autograd_of_their_definition(mode, compiled, monkeypatch):
    """soft_cross_entropy(lk=...): loss, d hidden and d weight equal autograd through the
    LK definitions (Samarin et al. 2026), over chunks and with rows weighted 0/1."""
    import eyas.kernels.fused
    from eyas.draft.loss import Lk, mean_acceptance

    if compiled:
        monkeypatch.setattr(eyas.kernels.fused, "COMPILE_DEVICES", {"cpu"})
    torch.manual_seed(10)
    hidden, weight = torch.randn(13, 16), torch.randn(21, 16)
    teacher = torch.randn(13, 21) * 2
    keep = torch.rand(13) < 0.7
    w = torch.tensor(0.3)
    lk = Lk("alpha") if mode == "alpha" else Lk("lambda", w)
    loss, top1, d_hidden, d_weight = _soft_ce_and_grads(hidden, weight, lambda h, v: (
        soft_cross_entropy(h, v, teacher, chunk=5, row_weight=keep, lk=lk)))
    h2, w2 = (x.clone().requires_grad_() for x in (hidden, weight))
    ref = _lk_reference((h2 @ w2.T)[keep], teacher[keep], mode, w)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(d_hidden, h2.grad)
    torch.testing.assert_close(d_weight, w2.grad)
    assert not d_hidden[~keep].any()
    # the lambda weight's statistic: the mean acceptance over the counted rows
    alpha = torch.minimum(torch.softmax(teacher, -1),
                          torch.softmax(hidden @ weight.T, -1)).sum(-1)
    torch.testing.assert_close(mean_acceptance(hidden, weight, teacher, row_weight=keep,
                                               chunk=5), alpha[keep].mean())


@pytest.mark.parametrize("name", ["lk-alpha", "lk-lambda"])
def test_ttt_under_lk_losses_raises_the_acceptance_rate(name):
    """25 Adam steps of 3-step TTT under an LK objective raise the mean expected acceptance
    alpha of every step (read as 1 - the step loss of lk-lambda with KL weight 0)."""
    from eyas.draft.loss import Objective

    cfg = tiny_cfg()
    draft, batch = make_draft(cfg, seed=3), packed_batch(cfg, [[20, 12], [32]], 32, seed=3)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)

    def acceptance():
        with torch.no_grad():
            out = ttt_forward(draft, batch, lm_head, steps=3,
                              objective=Objective("lk-lambda", kl_scale=0.0))
        return 1 - out.step_loss

    before = acceptance()
    for _ in range(25):
        loss = ttt_forward(draft, batch, lm_head, steps=3, objective=Objective(name)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = acceptance()
    assert (after > before + 0.03).all(), (before, after)


def _soft_ce_and_grads(hidden, weight, call):
    """call(h, w) -> (loss, top1) on fresh leaf copies of hidden and weight, backpropagated:
    (loss, top1, d hidden, d weight)."""
    h, w = (x.detach().clone().requires_grad_() for x in (hidden, weight))
    loss, top1 = call(h, w)
    loss.backward()
    return loss, top1, h.grad, w.grad


@pytest.mark.parametrize("compiled", [False, True])
def test_soft_ce_row_weights_drop_rows_exactly(compiled, monkeypatch):
    """Rows weighted 0 add nothing to the loss or any gradient: the weighted sum over all
    rows equals the plain sum over the rows weighted 1 (eager, and compiled on CPU)."""
    import eyas.kernels.fused

    if compiled:
        monkeypatch.setattr(eyas.kernels.fused, "COMPILE_DEVICES", {"cpu"})
    torch.manual_seed(9)
    hidden, weight = torch.randn(13, 16), torch.randn(21, 16)
    teacher = torch.randn(13, 21) * 2
    keep = torch.rand(13) < 0.7
    loss, top1, d_hidden, d_weight = _soft_ce_and_grads(hidden, weight, lambda h, w: (
        soft_cross_entropy(h, w, teacher, chunk=5, row_weight=keep)))
    ref, ref_top1, ref_hidden, ref_weight = _soft_ce_and_grads(hidden, weight, lambda h, w: (
        soft_cross_entropy(h[keep], w, teacher[keep], chunk=5)))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(d_weight, ref_weight)
    torch.testing.assert_close(d_hidden, ref_hidden)
    assert not d_hidden[~keep].any() and torch.equal(top1[keep], ref_top1)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("indexed", [False, True])
def test_soft_ce_teacher_lse_and_extra_hidden_rows(compiled, indexed, monkeypatch):
    """A given teacher logsumexp gives the same loss as the one computed inside; hidden rows
    past the teacher's carry no loss and get a zero gradient (TTT passes a step's rows whole
    instead of slicing off the last ones)."""
    import eyas.kernels.fused
    from eyas.draft.loss import row_logsumexp

    if compiled:
        monkeypatch.setattr(eyas.kernels.fused, "COMPILE_DEVICES", {"cpu"})
    torch.manual_seed(4)
    hidden, weight = torch.randn(15, 16), torch.randn(21, 16)
    teacher = torch.randn(17, 21) * 3
    rows = torch.randint(0, 17, (12,)) if indexed else None
    scored = teacher[rows] if indexed else teacher[:12]
    lse = row_logsumexp(teacher if indexed else scored)
    loss, top1, d_hidden, d_weight = _soft_ce_and_grads(hidden, weight, lambda h, w: (
        soft_cross_entropy(h, w, teacher if indexed else scored, rows=rows, chunk=5,
                           teacher_lse=lse)))
    ref, ref_top1, ref_hidden, ref_weight = _soft_ce_and_grads(hidden, weight, lambda h, w: (
        soft_cross_entropy(h[:12], w, scored, chunk=5)))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(d_weight, ref_weight)
    torch.testing.assert_close(d_hidden[:12], ref_hidden[:12])
    assert not d_hidden[12:].any() and torch.equal(top1, ref_top1) and top1.shape == (12,)
    with pytest.raises(ValueError, match="disagree"):
        soft_cross_entropy(hidden[:5], weight, scored)


# ---------------------------------------------------------------- the attention itself

def dense_attention(q, k, v, lo, hi, dk, dv):
    n, hq, d = q.shape
    rep = hq // k.shape[1]
    m = k.shape[0]
    band = (torch.arange(m)[None] >= lo[:, None]) & (torch.arange(m)[None] <= hi[:, None])
    keys, vals, allowed = [k], [v], [band]
    for s in range(0 if dk is None else dk.shape[0]):
        keys.append(dk[s])
        vals.append(dv[s])
        allowed.append(torch.eye(n, dtype=torch.bool))
    kk, vv = torch.cat(keys).repeat_interleave(rep, 1), torch.cat(vals).repeat_interleave(rep, 1)
    scores = torch.einsum("nhd,mhd->hnm", q, kk) / math.sqrt(d)
    scores = scores.masked_fill(~torch.cat(allowed, 1), float("-inf"))
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), vv)


@pytest.mark.parametrize("n_keys,n_q,diag,compiled", [
    (40, 40, 0, False), (300, 120, 3, False), (1200, 900, 6, False), (300, 120, 3, True)])
def test_attention_matches_dense(n_keys, n_q, diag, compiled, monkeypatch):
    """The band + diagonal merge against dense masked softmax attention written in the test
    (values and every gradient, fp32); also with the merge compiled, as CUDA runs it."""
    import eyas.kernels.fused

    if compiled:
        monkeypatch.setattr(eyas.kernels.fused, "COMPILE_DEVICES", {"cpu"})
    torch.manual_seed(n_keys)
    hq, hkv, d = 6, 2, 8
    starts = torch.zeros(n_keys, dtype=torch.long)
    starts[torch.randperm(n_keys)[: n_keys // 25]] = 1
    starts[0] = 1
    seg_start = torch.where(starts.bool(), torch.arange(n_keys), 0).cummax(0).values
    rows = torch.randperm(n_keys)[:n_q].sort().values  # gathered (pruned) queries
    lo, hi = seg_start[rows], rows
    leaves = [torch.randn(n_q, hq, d), torch.randn(n_keys, hkv, d), torch.randn(n_keys, hkv, d)]
    if diag:
        leaves += [torch.randn(diag, n_q, hkv, d), torch.randn(diag, n_q, hkv, d)]
    leaves = [x.requires_grad_() for x in leaves]
    got = attention(*leaves[:3], lo, hi, *(leaves[3:] or [None, None]))
    twins = [x.detach().clone().requires_grad_() for x in leaves]
    want = dense_attention(*twins[:3], lo, hi, *(twins[3:] or [None, None]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    cot = torch.randn_like(want)
    (got * cot).sum().backward()
    (want * cot).sum().backward()
    for a, b in zip(leaves, twins):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["causal", "packed_gathered", "cache_rows"])
def test_block_mask_is_exact_where_it_skips(layout):
    """Blocks the FlexAttention mask leaves out must hold no visible pair; blocks it marks
    full must hold only visible pairs (there mask_mod is not consulted)."""
    torch.manual_seed(9)
    m = 1000
    if layout == "causal":
        lo, hi = torch.zeros(m, dtype=torch.long), torch.arange(m)
    elif layout == "packed_gathered":
        seg = torch.tensor([0, 90, 91, 333, 600, 601, 990])
        first = torch.zeros(m, dtype=torch.long)
        first[seg] = 1
        seg_start = torch.where(first.bool(), torch.arange(m), 0).cummax(0).values
        rows = torch.randperm(m)[:700].sort().values
        lo, hi = seg_start[rows], rows
    else:  # eval: 3 rows of 333 keys each, the last 20 positions of each row are queries
        lo = (torch.arange(3) * 333).repeat_interleave(20)
        hi = lo + 313 + torch.arange(20).repeat(3)
    n, pad_n, pad_m = lo.shape[0], -lo.shape[0] % BLOCK, -m % BLOCK
    lo, hi = F.pad(lo, (0, pad_n)), F.pad(hi, (0, pad_n))
    mask = band_block_mask(lo, hi, m + pad_m)
    kv = torch.arange(m + pad_m)
    visible = (kv[None] >= lo[:, None]) & (kv[None] <= hi[:, None])  # (Nq, M)
    nq, nk = visible.shape[0] // BLOCK, visible.shape[1] // BLOCK
    tiles = visible.view(nq, BLOCK, nk, BLOCK).transpose(1, 2)  # (nq, nk, B, B)
    listed = torch.zeros(nq, nk, dtype=torch.bool)
    full = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        listed[i, mask.kv_indices[0, 0, i, : mask.kv_num_blocks[0, 0, i]].long()] = True
        full[i, mask.full_kv_indices[0, 0, i, : mask.full_kv_num_blocks[0, 0, i]].long()] = True
    assert not (listed & full).any()
    assert not tiles[~(listed | full)].any()  # nothing visible is skipped
    assert tiles[full].all()  # full really is full
    assert full.any() or layout != "causal"  # the causal band has full blocks to skip masking
    # mask_mod agrees with the band
    q_idx, kv_idx = torch.randint(0, n, (500,)), torch.randint(0, m, (500,))
    assert torch.equal(mask.mask_mod(0, 0, q_idx, kv_idx), visible[q_idx, kv_idx])


def test_bf16_autocast_runs_on_cpu():
    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[10, 20]], 32, seed=10)
    batch.aux_hidden = batch.aux_hidden.bfloat16()
    batch.final_hidden = batch.final_hidden.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ttt_forward(draft, batch, torch.randn(50, 32).bfloat16(), steps=3)
    out.loss.backward()
    assert torch.isfinite(out.loss) and draft.fc.weight.grad.dtype == torch.float32


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("n_q,n_keys", [(300, 700), (256, 512)])
def test_flex_band_plumbing_matches_reference(monkeypatch, n_q, n_keys):
    """The CUDA band function (padding, layout, log-sum-exp) run with eager FlexAttention on
    CPU (forward only: CPU FlexAttention has no backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    import eyas.kernels.attention as D

    monkeypatch.setattr(D, "_compiled_flex", lambda: flex_attention)
    torch.manual_seed(13)
    first = torch.zeros(n_keys, dtype=torch.long)
    first[torch.tensor([0, 130, 131, 400])] = 1
    seg_start = torch.where(first.bool(), torch.arange(n_keys), 0).cummax(0).values
    rows = torch.randperm(n_keys)[:n_q].sort().values
    q, k, v = torch.randn(n_q, 4, 16), torch.randn(n_keys, 2, 16), torch.randn(n_keys, 2, 16)
    with torch.no_grad():
        out, lse = D._band_flex(q, k, v, seg_start[rows], rows)
        want, want_lse = D._band_reference(q, k, v, seg_start[rows], rows)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore")
def test_compiled_flex_outlives_dynamo_s_recompile_limit(monkeypatch):
    """Past dynamo's recompile limit a torch.compile'd function runs eagerly, and eager
    FlexAttention materialises every score and fails inside a CUDA graph's capture (the
    H100's `pytest -m gpu`, session 48). The band's compiled flex has a limit of its own: with
    the global limit at 1, three layouts (dtypes) get a graph each, with the band's values,
    where the same compiled flex without it stops at one. Counted by a counting backend on
    CPU, forward only (CPU FlexAttention has no backward)."""
    import functools

    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention

    import eyas.kernels.attention as D

    def compiles(flex) -> int:
        n, counter = 300, flex.counter
        idx = torch.arange(n)
        torch._dynamo.reset()  # dynamo counts the graphs of flex_attention's code, any wrapper
        with torch._dynamo.config.patch(**{name: 1}), torch.no_grad():
            for dtype in (torch.float32, torch.float64, torch.bfloat16):
                monkeypatch.setattr(D, "_compiled_flex", lambda: flex)
                q, k, v = (torch.randn(n, h, 16, dtype=dtype) for h in (4, 2, 2))
                out, lse = D._band_flex(q, k, v, (idx - 40).clamp(min=0), idx)
                want, want_lse = D._band_reference(q, k, v, (idx - 40).clamp(min=0), idx)
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(out, want, atol=tol, rtol=tol)
        return counter.frame_count

    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") \
        else "cache_size_limit"
    real = torch.compile
    counted = []

    def counting_compile(fn, **kwargs):
        counted.append(CompileCounter())
        compiled = real(fn, backend=counted[-1])
        compiled.counter = counted[-1]
        return compiled

    monkeypatch.setattr(torch, "compile", counting_compile)
    D._compiled_flex.cache_clear()
    try:
        limited = D._compiled_flex()
    finally:
        D._compiled_flex.cache_clear()
    limited.counter = counted[-1]
    assert compiles(limited) == 3
    assert compiles(counting_compile(flex_attention)) == 1  # the global limit, spent


@pytest.mark.slow
def test_block_mask_with_compiled_flex_kernel_cpu():
    """The real FlexAttention kernel (CPU inference template) honours the block mask."""
    from torch.nn.attention.flex_attention import flex_attention

    from eyas.kernels.attention import _band_reference

    torch.manual_seed(11)
    m, rows = 700, torch.randperm(700)[:300].sort().values
    first = torch.zeros(m, dtype=torch.long)
    first[torch.tensor([0, 130, 131, 400, 650])] = 1
    seg_start = torch.where(first.bool(), torch.arange(m), 0).cummax(0).values
    q, k, v = torch.randn(300, 4, 16), torch.randn(m, 2, 16), torch.randn(m, 2, 16)
    lo, hi = seg_start[rows], rows
    want, _ = _band_reference(q, k, v, lo, hi)
    pn, pm = -300 % BLOCK, -m % BLOCK
    mask = band_block_mask(F.pad(lo, (0, pn)), F.pad(hi, (0, pn)), m + pm)
    qt, kt, vt = (F.pad(x, (0, 0, 0, 0, 0, p)).transpose(0, 1)[None]
                  for x, p in ((q, pn), (k, pm), (v, pm)))
    with torch.no_grad():
        got = torch.compile(flex_attention)(qt, kt, vt, block_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got[0].transpose(0, 1)[:300], want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_path_on_cuda_matches_reference(dtype):
    """The CUDA path (compiled FlexAttention + LSE merge) against the CPU reference path."""
    torch.manual_seed(12)
    cfg = tiny_cfg(hidden_size=128, target_hidden_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, intermediate_size=256)
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[100, 37, 200], [300]], 340, seed=12)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    cpu = ttt_forward(draft, batch, lm_head, steps=5)
    cpu_grads = grads(draft, cpu.loss)
    gpu_draft = draft.to("cuda")
    gpu_batch = TTTBatch(**{k: v.cuda() for k, v in vars(batch).items()})
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = ttt_forward(gpu_draft, gpu_batch, lm_head.cuda(), steps=5)
    gpu_grads = grads(gpu_draft, out.loss)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(out.loss.cpu(), cpu.loss, **tol)
    assert out.step_count.tolist() == cpu.step_count.tolist()
    for name in cpu_grads:
        if dtype == torch.float32:
            torch.testing.assert_close(gpu_grads[name].cpu(), cpu_grads[name], atol=1e-4, rtol=1e-3)
        else:
            cos = F.cosine_similarity(gpu_grads[name].cpu().flatten(), cpu_grads[name].flatten(), 0)
            assert cos > 0.97, name


@pytest.mark.parametrize("n_keys,n_q,diag,compiled", [
    (70, 70, 0, False), (70, 64, 3, False), (1500, 1400, 2, False), (70, 64, 3, True),
    (300, 250, 6, True)])
def test_causal_fast_path_matches_lse_autograd(n_keys, n_q, diag, compiled, monkeypatch):
    """causal_attention folds the log-sum-exp gradient of the diagonal merge into the band
    kernel's backward (merged output in place of the band's): values and every gradient
    equal `attention`'s, whose band returns its LSE and takes that LSE's gradient, fp32,
    across a chunk boundary; also with the merge compiled (as CUDA runs it). Both share the
    merge functions: test_attention_matches_dense checks those against dense attention."""
    import eyas.kernels.fused
    from eyas.kernels.attention import causal_attention

    if compiled:
        monkeypatch.setattr(eyas.kernels.fused, "COMPILE_DEVICES", {"cpu"})

    torch.manual_seed(n_keys + diag)
    hq, hkv, d = 4, 2, 8
    q = torch.randn(n_q, hq, d, requires_grad=True)
    k, v = (torch.randn(n_keys, hkv, d, requires_grad=True) for _ in range(2))
    dk, dv = (torch.randn(diag, n_q, hkv, d, requires_grad=True) if diag else None
              for _ in range(2))
    grad = torch.randn(n_q, hq, d)
    inputs = [x for x in (q, k, v, dk, dv) if x is not None]
    fast = causal_attention(q, k, v, dk, dv)
    fast_grads = torch.autograd.grad(fast, inputs, grad)
    idx = torch.arange(n_q)
    ref = attention(q, k, v, torch.zeros_like(idx), idx, dk, dv)
    ref_grads = torch.autograd.grad(ref, inputs, grad)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(fast_grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_one_document_takes_the_fast_path_with_the_same_result(monkeypatch):
    """A batch of one document (padding only after it) goes through causal_attention at every
    step whose kept positions fill at least half their prefix; packed batches never do. Same
    loss and gradients as the dense reference."""
    import eyas.draft.ttt

    cfg = tiny_cfg()
    draft = make_draft(cfg)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    seen = []  # the arguments of every causal_attention call
    real = eyas.draft.ttt.causal_attention
    monkeypatch.setattr(eyas.draft.ttt, "causal_attention", lambda *a: seen.append(a) or real(*a))

    def checked(batch):
        """ttt_forward on `batch`, its loss and gradients equal to the reference's; the
        query count of each causal_attention call."""
        seen.clear()
        out = ttt_forward(draft, batch, lm_head, steps=4)
        got = grads(draft, out.loss)
        ref = reference_ttt(draft, batch, lm_head, 4)[0]
        torch.testing.assert_close(out.loss, ref, atol=1e-5, rtol=1e-5)
        for name, g in grads(draft, ref).items():
            torch.testing.assert_close(got[name], g, atol=1e-5, rtol=1e-4)
        return out, [a[0].shape[0] for a in seen]

    one = packed_batch(cfg, [[40]], 40, seed=5)
    one.loss_mask[:] = 1  # all supervised, all top-1s in the draft vocab: prefixes
    in_vocab = draft.t2d.nonzero().squeeze(1)
    one.target_top1 = in_vocab[torch.randint(0, in_vocab.numel(), (1, 40))].int()
    _, calls = checked(one)
    assert calls == [40, 37, 36, 35]  # step j keeps positions 0..T-3-j (step 0: all)
    # a few top-1s outside the draft vocab: rows with gaps, still one document (the 60 %
    # mask of packed_batch leaves too few rows at later steps: the band)
    one.target_top1[0, [9, 30]] = int((~draft.t2d).nonzero()[0])
    gaps, calls = checked(one)  # 33 of 35 positions fill >= RUN_FILL of the span: all 35
    assert calls == gaps.step_rows == [40, 37, 36, 35] and gaps.step_count[3] == 33
    monkeypatch.setattr(eyas.draft.ttt, "RUN_FILL", 1.0)  # only exact runs: the gaps are dropped
    gaps, calls = checked(one)
    assert calls == gaps.step_rows == [40, 37, 36, 33]  # step 3 lost 2 rows to the gaps
    assert [len(a) > 5 and a[5] is not None for a in seen] == [False, False, False, True]
    monkeypatch.undo()
    monkeypatch.setattr(eyas.draft.ttt, "causal_attention", lambda *a: seen.append(a) or real(*a))
    # one document padded at the end: still the fused path (padding sees no real key)
    padded = packed_batch(cfg, [[34]], 40, seed=6)
    padded.target_top1 = one.target_top1
    _, calls = checked(padded)
    assert calls[0] == 40 and len(calls) == 4
    seen.clear()
    ttt_forward(draft, packed_batch(cfg, [[20, 20]], 40, seed=5), lm_head, steps=4)
    ttt_forward(draft, packed_batch(cfg, [[40], [40]], 40, seed=5), lm_head, steps=4)
    assert seen == []  # two documents, or two rows: the general path


@pytest.mark.gpu
@pytest.mark.parametrize("diag", [0, 4])
@pytest.mark.parametrize("kernel", ["cudnn", "cudnn-repeat", "fa4"])
def test_causal_fast_path_on_cuda_matches_flex(diag, kernel, monkeypatch):
    """The fused band + folded LSE gradient against the FlexAttention path, bf16, 8B shapes:
    cuDNN with its own GQA, cuDNN with K/V repeated to the query heads (older cuDNN), and
    FlashAttention-4 (skipped where it is not installed)."""
    from eyas.kernels import band_kernels as bk
    from eyas.kernels.attention import causal_attention

    monkeypatch.setattr(bk.CudnnCausal, "gqa", kernel != "cudnn-repeat")
    monkeypatch.setenv(bk.ATTENTION_ENV, kernel.split("-")[0])
    monkeypatch.setattr(bk, "_fa4_module", None)  # imported afresh: not off from an earlier test
    if kernel == "fa4" and bk._fa4() is None:
        pytest.skip("FlashAttention-4 (flash_attn.cute) is not installed")

    torch.manual_seed(diag)
    n, hq, hkv, d = 3000, 32, 8, 128
    dev = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(n, hq, d, **dev, requires_grad=True)
    assert bk.band_kernel(q) is (bk.Fa4Causal if kernel == "fa4" else bk.CudnnCausal)
    k, v = (torch.randn(n, hkv, d, **dev, requires_grad=True) for _ in range(2))
    dk, dv = (torch.randn(diag, n, hkv, d, **dev, requires_grad=True) if diag else None
              for _ in range(2))
    inputs = [x for x in (q, k, v, dk, dv) if x is not None]
    grad = torch.randn(n, hq, d, **dev)
    fast = causal_attention(q, k, v, dk, dv)
    fast_grads = torch.autograd.grad(fast, inputs, grad)
    idx = torch.arange(n, device="cuda")
    ref = attention(q, k, v, torch.zeros_like(idx), idx, dk, dv)
    ref_grads = torch.autograd.grad(ref, inputs, grad)
    torch.testing.assert_close(fast, ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(fast_grads, ref_grads):
        cos = F.cosine_similarity(got.double().flatten(), want.double().flatten(), 0)
        assert cos > 0.999


@pytest.mark.gpu
def test_fp8_ttt_on_cuda_tracks_bf16():
    """--precision fp8 on CUDA: loss within 2% of bf16, gradients pointing the same way."""
    cfg = tiny_cfg(hidden_size=128, target_hidden_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=96,
                   draft_vocab_size=64)
    draft = make_draft(cfg).cuda()
    batch = packed_batch(cfg, [[100, 37, 200], [300]], 340, seed=12)
    batch = TTTBatch(**{k: v.cuda() for k, v in vars(batch).items()})
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, device="cuda") * 0.3
    draft.init_lm_head_from_target(lm_head, freeze=False)
    results = []
    for fp8 in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = ttt_forward(draft, batch, lm_head, steps=5, fp8=fp8)
        results.append((out.loss.detach(), grads(draft, out.loss)))
    (ref, ref_grads), (got, got_grads) = results
    assert abs(float(got) / float(ref) - 1) < 0.02
    for name, g in ref_grads.items():
        assert F.cosine_similarity(got_grads[name].double().flatten(),
                                   g.double().flatten(), 0) > 0.97, name


def test_output_flattens_to_its_tensors_for_fsdp():
    # FSDP2 (torch < 2.12) finds the tensors to hook its gradient reduce-scatter on with
    # pytree; an opaque output meant 2-GPU FSDP training silently never learned (H200 run).
    from torch.utils._pytree import tree_flatten

    cfg = tiny_cfg()
    out = ttt_forward(make_draft(cfg), packed_batch(cfg, [[24]], 24, seed=1),
                      torch.randn(cfg.vocab_size, cfg.target_hidden_size), steps=2)
    leaves = tree_flatten(out)[0]
    assert any(t is out.step_loss_sum for t in leaves)
    assert out.step_loss_sum.requires_grad


def test_compiled_function_past_the_recompile_limit_runs_eagerly(monkeypatch, caplog):
    # a process that sweeps many layouts (benchmarks) must not crash at torch.compile's
    # graph limit: the new layout runs eagerly, with a warning, and the result is the same
    import eyas.kernels.fused

    monkeypatch.setattr(eyas.kernels.fused, "COMPILE_DEVICES", {"cpu"})
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") \
        else "cache_size_limit"
    double_sum = eyas.kernels.fused.cuda_compiled(lambda x: (x * 2).sum(-1))
    with torch._dynamo.config.patch(**{name: 1}):  # (monkeypatch's undo broke the alias)
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float32):
            x = torch.arange(12, dtype=dtype).reshape(3, 4)
            torch.testing.assert_close(double_sum(x), (x * 2).sum(-1))
    assert "recompile limit" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("g,s,d", [(4, 1, 128), (4, 6, 128), (5, 3, 64)])
def test_triton_diagonal_merge_matches_the_torch_functions(g, s, d):
    """CUDA runs the diagonal merge and its backward as Triton kernels (eyas.kernels.attention_kernels):
    the same values as the torch functions (eager, fp32 math) for every output, incl. G and
    S that are not powers of two."""
    from eyas.kernels import attention_kernels
    from eyas.kernels.attention import _merge_diag, _merge_diag_backward

    torch.manual_seed(s)
    n, hkv = 300, 2
    dev = dict(device="cuda", dtype=torch.bfloat16)
    q, out_b, grad = (torch.randn(n, hkv, g, d, **dev) for _ in range(3))
    diag_k, diag_v = (torch.randn(s, n, hkv, d, **dev) for _ in range(2))
    lse = torch.randn(n, hkv, g, device="cuda") * 3
    got = attention_kernels.merge_diag(q, diag_k, diag_v, out_b, lse)
    want = _merge_diag.__wrapped__(q, diag_k.transpose(0, 1), diag_v.transpose(0, 1), out_b, lse)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[2], want[2], atol=1e-6, rtol=1e-5)
    merged, w_band, w_diag = want
    for with_lse in (False, True):
        extra = (out_b,) if with_lse else ()
        got = attention_kernels.merge_diag_backward(grad, merged, w_band, w_diag, q, diag_k,
                                                    diag_v, *extra)
        want = _merge_diag_backward.__wrapped__(grad, merged, w_band, w_diag, q,
                                                diag_k.transpose(0, 1), diag_v.transpose(0, 1),
                                                *extra)
        want = (want[0], want[1], want[2].transpose(0, 1), want[3].transpose(0, 1), *want[4:])
        assert len(got) == len(want) == 4 + with_lse
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
            assert F.cosine_similarity(a.double().flatten(), b.double().flatten(), 0) > 0.99999


@pytest.mark.gpu
@pytest.mark.parametrize("v", [1000, 32000])
def test_triton_soft_ce_chunk_matches_the_torch_function(v):
    """CUDA runs a soft-CE chunk as one Triton kernel (eyas.kernels.loss_kernels): loss, argmax and
    gradient as the torch function's, weighted or not; its fp8 gradient within e5m2 rounding."""
    from eyas.kernels import loss_kernels
    from eyas.draft.loss import _soft_ce_chunk

    torch.manual_seed(v)
    c = 333
    logits = (torch.randn(c, v, device="cuda") * 4).bfloat16()
    teacher = (torch.randn(c, v, device="cuda") * 4).bfloat16()
    logits[5, 7] = logits[5, 9] = 99.0  # a tie: the first index wins, as torch.argmax
    weight = torch.rand(c, device="cuda") < 0.8
    for w in (None, weight):
        loss, top, grad, scale = loss_kernels.soft_ce_chunk(logits, teacher, True, w)
        ref_loss, ref_top, ref_grad = _soft_ce_chunk.__wrapped__(logits, teacher, True, w)
        assert scale is None and grad.dtype == torch.bfloat16
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3)
        assert torch.equal(top, ref_top) and int(top[5]) == 7
        torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-3, rtol=1e-2)
        _, _, g8, scale = loss_kernels.soft_ce_chunk(logits, teacher, True, w, grad_fp8=True)
        assert g8.dtype == torch.float8_e5m2
        back = g8.float() * scale
        assert float((back - ref_grad.float()).abs().max()) <= \
            0.126 * float(ref_grad.float().abs().max()) + 1e-6
    assert loss_kernels.soft_ce_chunk(logits, teacher, False)[2] is None
    # the teacher's logsumexp given (TTT computes it once): the same results
    lse = torch.logsumexp(teacher.float(), -1)
    for w in (None, weight):
        got = loss_kernels.soft_ce_chunk(logits, teacher, True, w, teacher_lse=lse)
        ref = loss_kernels.soft_ce_chunk(logits, teacher, True, w)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-3)
        assert torch.equal(got[1], ref[1])
        torch.testing.assert_close(got[2].float(), ref[2].float(), atol=1e-3, rtol=1e-2)


def test_cudnn_gqa_fallback_only_on_a_refusal(monkeypatch):
    """A cuDNN that refuses fewer K/V heads than query heads gets K/V repeated (and the process
    remembers); running out of memory is not a refusal: it propagates and GQA stays on. (The
    kernel itself runs only on CUDA: here its call is replaced by one that fails.)"""
    from eyas.kernels.band_kernels import CudnnCausal as _CudnnCausal

    monkeypatch.setattr(_CudnnCausal, "gqa", True)
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    band = _CudnnCausal(q, k, v)
    monkeypatch.setattr(band, "_forward", lambda: (_ for _ in ()).throw(torch.OutOfMemoryError()))
    with pytest.raises(torch.OutOfMemoryError):
        band.forward()
    assert _CudnnCausal.gqa
    heads = []

    def refuse_gqa():  # fails while K/V have fewer heads than q, as an old cuDNN would
        heads.append(band.kt.shape[1])
        if band.kt.shape[1] != q.shape[1]:
            raise RuntimeError("cuDNN: no GQA")
        return "ran"

    monkeypatch.setattr(band, "_forward", refuse_gqa)
    assert band.forward() == "ran" and heads == [2, 4] and not _CudnnCausal.gqa
    # each K/V head serves the query heads of its group: 0, 1 <- head 0; 2, 3 <- head 1
    assert band.vt.shape[1] == 4 and torch.equal(band.kt[0, 1], k[:, 0]) \
        and torch.equal(band.kt[0, 2], k[:, 1]) and torch.equal(band.vt[0, 3], v[:, 1])


def test_embedding_shares_are_not_kept_alive_by_the_graph_after_backward(monkeypatch):
    """The (N, C) shares table is freed once backward has run, though the output (and so
    its graph) is still held, as `eyas train` holds it into the next micro-batch's forward."""
    import gc
    import weakref

    made = []
    original = Eagle3Draft.embed_share
    monkeypatch.setattr(Eagle3Draft, "embed_share",
                        lambda self, *a: made.append(original(self, *a)) or made[-1])
    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[7, 1, 11], [4, 4, 4, 3]], 24)
    out = ttt_forward(draft, batch, torch.randn(cfg.vocab_size, cfg.target_hidden_size), steps=7)
    ref = weakref.ref(made.pop())
    out.loss.backward()
    gc.collect()
    assert ref() is None, f"a {tuple(ref().shape)} shares table outlives backward"


def test_attention_kernel_choice_is_checked(monkeypatch, caplog):
    """EYAS_ATTENTION: a value other than auto / fa4 / cudnn is an error naming them;
    `fa4` where FlashAttention-4 cannot run says why; a FlashAttention-4 that is absent is
    logged once at INFO, one that is installed but broken (or lacks the functions eyas calls)
    once as a warning, and either is left to cuDNN."""
    from eyas.kernels import band_kernels as bk
    from eyas.errors import EyasError

    q = torch.randn(16, 4, 8)
    monkeypatch.setenv(bk.ATTENTION_ENV, "flash")
    with pytest.raises(EyasError, match="expected auto, fa4 or cudnn"):
        bk.band_kernel(q)
    monkeypatch.setenv(bk.ATTENTION_ENV, "fa4")
    with pytest.raises(EyasError, match=r"float32 .*unset EYAS_ATTENTION"):
        bk.band_kernel(q)
    assert "head dim 12" in bk._fa4_refuses(torch.randn(16, 4, 12).bfloat16())
    assert "dtype" in bk._fa4_refuses(q)

    failures = [ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn"),
                OSError("libcuda.so.1: cannot open shared object file"), None]
    imported = []

    def fake_import(name):
        imported.append(name)
        error = failures[len(imported) - 1]
        if error is not None:
            raise error
        return object()  # a module without the functions eyas calls

    monkeypatch.setattr(bk.importlib, "import_module", fake_import)
    for level, expected in (("INFO", "ModuleNotFoundError: No module named 'flash_attn'"),
                            ("WARNING", "OSError: libcuda.so.1"),
                            ("WARNING", "lacks _flash_attn_fwd")):
        monkeypatch.setattr(bk, "_fa4_module", None)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="eyas.kernels.band_kernels"):
            assert bk._fa4() is None and bk._fa4() is None
        assert [(r.levelname, expected in r.getMessage()) for r in caplog.records] \
            == [(level, True)]
    assert imported == ["flash_attn.cute.interface"] * 3


def _broken_fa4(q, k, v, error, where):
    """A FlashAttention-4 band whose forward or backward raises `error` (a forward that does
    not raise computes the reference band, in FlashAttention-4's layout)."""
    from eyas.kernels import attention as att
    from eyas.kernels import band_kernels as bk

    class Broken:
        def _flash_attn_fwd(self, q4, k4, v4, **kwargs):
            if where == "forward":
                raise error
            out, lse = att._ReferenceCausal(q4[0], k4[0], v4[0]).forward()
            return out[None], lse.t()[None]

        def _flash_attn_bwd(self, *args, **kwargs):
            raise error

    band = bk.Fa4Causal(q, k, v)
    band.fa4 = Broken()
    return band


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_fa4_failure_gives_way(where, monkeypatch, caplog):
    """Under EYAS_ATTENTION=auto a FlashAttention-4 forward or backward that fails (a kernel
    that does not compile, say) is logged, FlashAttention-4 is switched off for the process
    and another kernel computes the same output and gradients (on CPU the exact reference
    band, which has the fused kernels' contract); running out of memory, or
    EYAS_ATTENTION=fa4, propagates."""
    from eyas.kernels import attention as att
    from eyas.kernels import band_kernels as bk

    torch.manual_seed(0)
    q, k, v = (torch.randn(40, h, 8, requires_grad=True) for h in (4, 2, 2))
    dk, dv = (torch.randn(3, 40, 2, 8, requires_grad=True) for _ in range(2))
    grad = torch.randn(40, 4, 8)
    inputs = (q, k, v, dk, dv)
    want = att.causal_attention(*inputs)
    want_grads = torch.autograd.grad(want, inputs, grad)

    error = [None]

    def broken_kernel(q, k, v):
        return _broken_fa4(q, k, v, error[0], where)

    def broken_attention(*inputs):  # causal_attention's call, on a broken FlashAttention-4
        return att._CausalDiag.apply(*inputs, broken_kernel)

    monkeypatch.delenv(bk.ATTENTION_ENV, raising=False)
    monkeypatch.setattr(bk, "_failed", None)
    for env, error[0] in (("auto", torch.OutOfMemoryError()), ("fa4", RuntimeError("no kernel"))):
        monkeypatch.setenv(bk.ATTENTION_ENV, env)
        monkeypatch.setattr(bk, "_fa4_module", object())  # installed, not off
        with pytest.raises(type(error[0]), match="no kernel" if env == "fa4" else None):
            torch.autograd.grad(broken_attention(*inputs), inputs, grad)
        assert bk._fa4_module is not False
    monkeypatch.setenv(bk.ATTENTION_ENV, "auto")
    error[0] = RuntimeError("no kernel for sm_90a")
    with caplog.at_level(logging.WARNING, logger="eyas.kernels.band_kernels"):
        got = broken_attention(*inputs)
        got_grads = torch.autograd.grad(got, inputs, grad)
    assert "FlashAttention-4 failed in this process (RuntimeError: no kernel for sm_90a)" \
        in caplog.text
    assert bk._fa4_module is False  # off for the process, and doctor / refusals say why:
    assert bk._failed == "it failed in this process (RuntimeError: no kernel for sm_90a)"
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


@pytest.mark.gpu
def test_describe_names_the_kernel_on_cuda(monkeypatch):
    """`eyas doctor`'s line: cuDNN for an 8B draft's heads under EYAS_ATTENTION=cudnn; an MLA
    target's draft (head dim 192: beyond cuDNN) on FlashAttention-4 where it runs, else on
    FlexAttention with the reason."""
    from eyas.kernels import band_kernels as bk

    monkeypatch.setenv(bk.ATTENTION_ENV, "cudnn")
    assert bk.describe(32, 128) == "cuDNN (EYAS_ATTENTION=cudnn)"
    monkeypatch.setenv(bk.ATTENTION_ENV, "auto")
    line = bk.describe(64, 192)
    if line.startswith("FlashAttention-4"):
        assert line == "FlashAttention-4 (64 heads x 192)"
    else:
        assert line.startswith("FlexAttention; not FlashAttention-4: ")
