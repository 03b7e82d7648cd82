"""Static TTT plans (the same loss and gradients as pruned ones, shapes fixed by the batch's)
and the TTT iteration replayed from a CUDA graph (eyas.draft.ttt_graph; GPU tests)."""

from __future__ import annotations

import pytest
import torch

from eyas.draft.ttt import TTTBatch, ttt_forward, ttt_plan
from eyas.draft.ttt_graph import GraphedTTT, plan_signature
from test_ttt import grads, make_draft, packed_batch, tiny_cfg

LAYOUTS = {"packed": ([[20, 9, 30], [59]], 64), "one document": ([[50]], 64)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_static_plan_gives_the_pruned_loss_and_gradients(layout):
    cfg = tiny_cfg()
    draft = make_draft(cfg)
    docs, t = LAYOUTS[layout]
    batch = packed_batch(cfg, docs, t, seed=3)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    pruned = ttt_forward(draft, batch, lm_head, steps=6)
    pruned_grads = grads(draft, pruned.loss)
    plan = ttt_plan(batch, draft.t2d, 6, static=True)
    static = ttt_forward(draft, batch, lm_head, steps=6, plan=plan)
    static_grads = grads(draft, static.loss)
    n = batch.input_ids.numel()
    assert static.step_rows == [n] * 6 and pruned.step_rows[1:] != [n] * 5
    assert plan.loss_on_all == [True] * 6
    torch.testing.assert_close(static.loss, pruned.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(static.step_acc, pruned.step_acc)
    assert torch.equal(static.step_count, pruned.step_count)
    for name in pruned_grads:
        torch.testing.assert_close(static_grads[name], pruned_grads[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("t", [4, 5, 6, 8])
def test_a_static_plan_on_a_batch_shorter_than_the_steps(t):
    """Steps whose positions all lack a teacher (a batch of t <= steps positions) score
    nothing: the same loss as the pruned plan, which drops them."""
    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[t]], t, seed=t)
    batch.loss_mask[:] = 1
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size)
    pruned = ttt_forward(draft, batch, lm_head, steps=7)
    static = ttt_forward(draft, batch, lm_head, steps=7,
                         plan=ttt_plan(batch, draft.t2d, 7, static=True))
    torch.testing.assert_close(static.loss, pruned.loss, atol=1e-6, rtol=1e-6)
    assert torch.equal(static.step_count, pruned.step_count)


def test_static_plans_share_one_signature_per_batch_shape():
    """What a graph bakes in depends on the batch's shape only, not its masks or tokens;
    pruned plans of the same batches differ (each would need its own graph)."""
    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batches = [packed_batch(cfg, [[20, 9, 30], [59]], 64, seed=s) for s in range(3)]
    batches[2].loss_mask[:, 30:] = 0
    static = {plan_signature(ttt_plan(b, draft.t2d, 7, static=True)) for b in batches}
    pruned = {plan_signature(ttt_plan(b, draft.t2d, 7)) for b in batches}
    assert len(static) == 1 and len(pruned) == 3
    other = packed_batch(cfg, [[40, 24], [64]], 64, seed=0)  # same shape, other documents
    assert plan_signature(ttt_plan(other, draft.t2d, 7, static=True)) in static
    one_doc = packed_batch(cfg, [[64], [64]], 64, seed=0)  # two rows: still "packed"
    assert plan_signature(ttt_plan(one_doc, draft.t2d, 7, static=True)) in static


def test_graphs_need_cuda_and_a_plan():
    cfg = tiny_cfg()
    draft = make_draft(cfg)
    batch = packed_batch(cfg, [[20]], 24)
    graphed = GraphedTTT(lambda b, p: ttt_forward(draft, b, torch.zeros(1), plan=p),
                         list(draft.parameters()))
    with pytest.raises(ValueError, match="CUDA device"):
        graphed(batch, ttt_plan(batch, draft.t2d, 7, static=True))


# ---------------------------------------------------------------- GPU

def _cuda(batch: TTTBatch) -> TTTBatch:
    return TTTBatch(**{k: v.cuda() for k, v in vars(batch).items()})


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fp8", [False, True])
def test_graph_replays_give_eager_results_and_accumulate(layout, fp8):
    """Replays of one captured graph on other batches of the same shape: the eager loss and
    gradients of each; without zeroing in between, gradients add up as with eager backward."""
    cfg = tiny_cfg(hidden_size=128, target_hidden_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=96,
                   draft_vocab_size=64)
    draft = make_draft(cfg).cuda()
    docs, t = ([[100, 37, 119], [256]], 256) if layout == "packed" else ([[230]], 256)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, device="cuda") * 0.3
    draft.init_lm_head_from_target(lm_head, freeze=False)
    host = [packed_batch(cfg, docs, t, seed=s) for s in (1, 2, 3)]
    plans = [ttt_plan(b, draft.t2d.cpu(), 5, device="cuda", static=True) for b in host]
    batches = [_cuda(b) for b in host]

    def forward(b, p):
        return ttt_forward(draft, b, lm_head, steps=5, fp8=fp8, plan=p)

    eager = []
    for b, p in zip(batches, plans):
        runs = []
        for _ in range(2):  # twice: a mismatch below is then not eager nondeterminism
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = forward(b, p)
            runs.append((out.loss.detach(), grads(draft, out.loss)))
            # an autograd graph kept alive keeps its AccumulateGrad nodes, bound to the
            # stream that made them (the default one), which a capture must not run on
            del out
        assert torch.equal(runs[0][0], runs[1][0])
        for name, g in runs[0][1].items():
            assert torch.equal(g, runs[1][1][name]), f"eager {name} gradient differs between runs"
        eager.append(runs[0])
    draft.zero_grad(set_to_none=True)
    graphed = GraphedTTT(forward, list(draft.parameters()))
    for (loss, ref), b, p in zip(eager, batches, plans):
        draft.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = graphed(b, p)
        torch.testing.assert_close(out.loss, loss, atol=1e-4, rtol=1e-4)
        for name, g in draft.named_parameters():
            if name in ref:
                torch.testing.assert_close(g.grad, ref[name], atol=1e-4, rtol=1e-3)
    assert graphed.captures == 1 and graphed.replays == 3
    # accumulation: .grad kept (zeroed in place), two replays add up
    draft.zero_grad(set_to_none=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graphed(batches[0], plans[0])
        graphed(batches[1], plans[1])
    for name, g in draft.named_parameters():
        if name in eager[0][1]:
            torch.testing.assert_close(g.grad, eager[0][1][name] + eager[1][1][name],
                                       atol=2e-4, rtol=2e-3)
    assert graphed.captures == 1
    # another shape: captured anew, still right
    bigger = packed_batch(cfg, [[300]], 320, seed=4)
    plan = ttt_plan(bigger, draft.t2d.cpu(), 5, device="cuda", static=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = forward(_cuda(bigger), plan).loss.detach()  # its autograd graph dropped
        got = graphed(_cuda(bigger), plan)
    torch.testing.assert_close(got.loss, ref, atol=1e-4, rtol=1e-4)
    assert graphed.captures == 2


@pytest.mark.gpu
def test_one_document_and_packed_batches_keep_a_graph_each():
    """A packed run whose rows sometimes hold a single document (another attention kernel)
    keeps two graphs and replays each, rather than capturing at every switch."""
    cfg = tiny_cfg(hidden_size=128, target_hidden_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=96,
                   draft_vocab_size=64)
    draft = make_draft(cfg).cuda()
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, device="cuda") * 0.3
    draft.init_lm_head_from_target(lm_head, freeze=False)

    def forward(b, p):
        return ttt_forward(draft, b, lm_head, steps=4, plan=p)

    host = [packed_batch(cfg, docs, 256, seed=s) for s, docs in
            enumerate([[[256]], [[100, 156]], [[256]], [[30, 200, 26]], [[256]]])]
    plans = [ttt_plan(b, draft.t2d.cpu(), 4, device="cuda", static=True) for b in host]
    refs = []
    for b, p in zip(host, plans):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            refs.append(forward(_cuda(b), p).loss.detach())
    graphed = GraphedTTT(forward, list(draft.parameters()))
    for b, p, ref in zip(host, plans, refs):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = graphed(_cuda(b), p)
        torch.testing.assert_close(got.loss, ref, atol=1e-4, rtol=1e-4)
    assert graphed.captures == 2 and graphed.replays == 5 and len(graphed.graphs) == 2
    assert graphed.unreached == []
