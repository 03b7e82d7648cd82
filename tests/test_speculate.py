"""The speculative loop: acceptance counting with stub drafters, losslessness at T=0, the exact
sampler at T=1 (chi-square against the target's own law), aux-state bookkeeping, n-gram lookup."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from eyas.draft.config import DraftConfig
from eyas.draft.eagle3 import Eagle3Draft
from eyas.errors import EyasError
from eyas.targets import sdpa
from eyas.targets.models import inspect_model
from eyas.serve.speculate import (Eagle3Drafter, NgramDrafter, Proposal, Sampling, TargetRunner,
                                  generate_plain, generate_speculative, verify)

NO_STOP = frozenset()


# ---------------------------------------------------------------- stub drafters

class ScriptedDrafter:
    """Knows the target's greedy continuation `full` (prompt + reference tokens). At its s-th
    proposal it copies the reference for the first `pattern[s % len(pattern)]` positions and
    proposes a wrong token after that."""

    aux_layer_ids = ()

    def __init__(self, full: list[int], pattern: tuple[int, ...], vocab: int):
        self.full, self.pattern, self.vocab = full, pattern, vocab

    def begin(self):
        self.calls = 0

    def propose(self, tokens, new_aux, k, sampling):
        s = tokens.shape[0]
        right = self.full[s: s + k]
        assert tokens.tolist() == self.full[:s], "the loop emitted a token the target would not"
        agree = self.pattern[self.calls % len(self.pattern)]
        self.calls += 1
        wrong = [(t + 1) % self.vocab for t in right]
        return Proposal(right[:agree] + wrong[agree:k])


class MarkovTarget:
    """A synthetic target: the next-token law depends on the last token only (a bigram table)."""

    aux_layer_ids = ()

    def __init__(self, logits: torch.Tensor):
        self.logits = logits  # (V, V)

    def reset(self):
        self.length = 0

    def forward(self, ids, last_only=False, aux=False):
        self.length += len(ids)
        rows = self.logits[ids]
        return (rows[-1:] if last_only else rows), None

    def rollback(self, n):
        self.length -= n


class MarkovDrafter:
    """Samples a chain from its own bigram table q and reports q for each draft."""

    aux_layer_ids = ()

    def __init__(self, logits: torch.Tensor, deterministic: bool = False):
        self.logits, self.deterministic = logits, deterministic

    def begin(self):
        pass

    def propose(self, tokens, new_aux, k, sampling):
        last, drafts, dists = int(tokens[-1]), [], []
        for _ in range(k):
            if self.deterministic:  # a point-mass drafter (like n-gram)
                last = int(self.logits[last].argmax())
            else:
                p = torch.softmax(self.logits[last] / sampling.temperature, -1)
                last = int(torch.multinomial(p, 1, generator=sampling.generator))
                dists.append(p)
            drafts.append(last)
        return Proposal(drafts, None if self.deterministic else torch.stack(dists))


# ---------------------------------------------------------------- fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    return model


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(10, 2000, (24,), generator=torch.Generator().manual_seed(3))


def _reference(model, prompt, n):
    runner = TargetRunner(model, model.model.layers, model.model.norm)
    return generate_plain(runner, prompt, n, NO_STOP, Sampling()).tokens


# ---------------------------------------------------------------- tests

def test_plain_greedy_equals_transformers_generate(llama, prompt):
    ours = _reference(llama, prompt, 30)
    theirs = llama.generate(prompt[None], max_new_tokens=30, min_new_tokens=30, do_sample=False)
    assert ours == theirs[0, len(prompt):].tolist()


# k=3, 21 new tokens: the prefill gives 1, then each step gives accepted + 1.
# always:  5 steps x 4 tokens;           AL 4,   per position 1, 1, 1
# never:   20 steps x 1 token;           AL 1,   per position 0, 0, 0
# 0,1,2,3: 8 steps (2 cycles of 1+2+3+4): accepted 12 of 24 drafted; AL 1 + 12/8 = 2.5,
#          position 0 accepted in 6/8 steps, position 1 in 4/8, position 2 in 2/8
@pytest.mark.parametrize("pattern, drafts, accepted, al, per_pos", [
    ((3,), 5, 15, 4.0, [1.0, 1.0, 1.0]),
    ((0,), 20, 0, 1.0, [0.0, 0.0, 0.0]),
    ((0, 1, 2, 3), 8, 12, 2.5, [0.75, 0.5, 0.25]),
])
def test_stub_drafters_give_hand_computed_acceptance(llama, prompt, pattern, drafts, accepted,
                                                     al, per_pos):
    ref = _reference(llama, prompt, 21 + 4)  # reference runs past the end for the last draft
    drafter = ScriptedDrafter(prompt.tolist() + ref, pattern, llama.config.vocab_size)
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm)
    gen = generate_speculative(runner, drafter, prompt, 3, 21, NO_STOP, Sampling())
    assert gen.tokens == ref[:21]  # lossless whatever the drafts were
    st = gen.stats
    assert (st.drafts, st.accepted, st.draft_tokens) == (drafts, accepted, 3 * drafts)
    assert st.mean_acceptance_length == pytest.approx(al)
    assert st.per_position_acceptance == pytest.approx(per_pos)
    assert st.draft_acceptance_rate == pytest.approx(accepted / (3 * drafts))
    assert st.target_forwards == drafts + 1
    # rejected drafts left no trace: the cache holds every position but the last token's
    assert runner.cache.get_seq_length() == len(prompt) + 21 - 1


def test_ngram_drafter_is_lossless_and_stops(llama, prompt):
    ref = _reference(llama, prompt, 40)
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm)
    for k in (1, 4):
        gen = generate_speculative(runner, NgramDrafter(1, 3), prompt, k, 40, NO_STOP, Sampling())
        assert gen.tokens == ref
    stop = frozenset({ref[5]})
    gen = generate_speculative(runner, NgramDrafter(1, 3), prompt, 4, 40, stop, Sampling())
    assert gen.tokens == ref[: ref.index(ref[5]) + 1]


def test_ngram_lookup():
    d = NgramDrafter(min_n=2, max_n=3)
    t = torch.tensor
    assert d.propose(t([1, 2, 3, 9, 8, 1, 2, 3]), None, 3, Sampling()).tokens == [9, 8, 1]
    # most recent match of the 2-gram (1, 2) wins; proposals stop at the sequence end
    assert d.propose(t([1, 2, 7, 1, 2, 8, 1, 2]), None, 5, Sampling()).tokens == [8, 1, 2]
    assert d.propose(t([1, 2, 3, 4]), None, 3, Sampling()).tokens == []


def test_greedy_verify_accepts_the_matching_prefix():
    logits = torch.full((4, 10), -1.0)
    for row, top in enumerate([3, 5, 7, 9]):
        logits[row, top] = 1.0
    assert verify(logits, Proposal([3, 5, 7]), Sampling()) == (3, 9)  # all + bonus
    assert verify(logits, Proposal([3, 6, 7]), Sampling()) == (1, 5)  # correction at position 1
    assert verify(logits[:1], Proposal([]), Sampling()) == (0, 3)


def test_aux_states_fed_to_drafter_are_the_targets_at_each_position(llama, prompt):
    """Concatenating every `new_aux` the drafter receives gives the target's states at
    positions 0..S-2 of the final sequence, as a single full forward computes them."""
    seen = []

    class Recorder(NgramDrafter):
        aux_layer_ids = (2, 5, 8)

        def propose(self, tokens, new_aux, k, sampling):
            seen.append(new_aux)
            self.tokens = tokens
            return super().propose(tokens, new_aux, k, sampling)

    recorder = Recorder(1, 3)
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm, recorder.aux_layer_ids)
    generate_speculative(runner, recorder, prompt, 3, 30, NO_STOP, Sampling())
    runner.close()
    got = torch.cat(seen)  # (S-1, 3*Ht)
    assert got.shape[0] == len(recorder.tokens) - 1
    with torch.no_grad():
        hs = llama(recorder.tokens[None, :-1], output_hidden_states=True).hidden_states
    ht = llama.config.hidden_size
    torch.testing.assert_close(got[:, :ht], hs[2][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[:, ht: 2 * ht], hs[5][0], atol=1e-4, rtol=1e-4)
    # id L = 8 is the last layer's output BEFORE the final norm; HF's hidden_states[8] is after
    last = got[:, 2 * ht:]
    torch.testing.assert_close(llama.model.norm(last), hs[8][0], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(last, hs[8][0], atol=1e-2)


# ---------------------------------------------------------------- the EAGLE-3 drafter

@pytest.fixture(scope="module")
def draft(llama):
    info = inspect_model(llama)
    cfg = DraftConfig.from_target(info, draft_vocab_size=256, aux_layer_ids=(2, 4, 8))
    torch.manual_seed(0)
    model = Eagle3Draft(cfg, llama.model.embed_tokens)
    with torch.no_grad():  # larger random weights: the default init proposes one constant token
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    chosen = torch.arange(0, 8 * 256, 8)  # draft id i <-> target id 8i
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    model.set_vocab(chosen - torch.arange(256), t2d)
    return model.eval()


def _from_scratch(draft, tokens, aux, k):
    """Drafts per the reference, with a fresh cache: step 0 pairs the aux state of position t
    with token t+1 at RoPE position t for every t < S-1; chain step j feeds draft j and the
    previous step's hidden state at position S-2+j."""
    s = tokens.shape[0]
    cache = draft.new_cache()
    with torch.no_grad():
        out = draft(tokens[1:][None], aux[None], torch.arange(s - 1)[None], cache=cache)
        drafts = []
        for j in range(k):
            d = int(draft.to_target_ids(out.logits[0, -1].argmax()))
            drafts.append(d)
            out = draft(torch.tensor([[d]]), None, torch.tensor([[s - 1 + j]]),
                        hidden=out.hidden[:, -1:], cache=cache)
    return drafts


def test_eagle3_drafter_with_kv_cache_equals_drafting_from_scratch(llama, draft, prompt):
    """Every proposal made with the incrementally cropped and extended draft KV cache equals
    one made from scratch. The loop is handed the reference continuation for the first
    0, 1, 2, 3 positions in turn, so step 0 runs over 1 to 4 new positions."""
    ref = _reference(llama, prompt, 24)
    full = prompt.tolist() + ref

    class Checked(Eagle3Drafter):
        def begin(self):
            super().begin()
            self.aux, self.proposals = [], []

        def propose(self, tokens, new_aux, k, sampling):
            self.aux.append(new_aux)
            got = super().propose(tokens, new_aux, k, sampling)
            assert got.tokens == _from_scratch(self.draft, tokens, torch.cat(self.aux), k)
            self.proposals.append(tuple(got.tokens))
            agree = len(self.proposals) % 4
            s = tokens.shape[0]
            return Proposal(full[s: s + agree] + got.tokens[agree:])

    drafter = Checked(draft, "cpu")
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm, drafter.aux_layer_ids)
    gen = generate_speculative(runner, drafter, prompt, 3, 20, NO_STOP, Sampling())
    assert gen.tokens == ref[:20]
    assert len(drafter.proposals) == gen.stats.drafts >= 5
    assert gen.stats.accepted >= 6
    assert len(set(drafter.proposals)) > 1  # a draft that actually depends on its input


def test_eagle3_draft_distribution_lives_on_the_draft_vocab(llama, draft, prompt):
    drafter = Eagle3Drafter(draft, "cpu")
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm, drafter.aux_layer_ids)
    runner.reset()
    _, aux = runner.forward(prompt, last_only=True, aux=True)
    drafter.begin()
    seq = torch.cat([prompt, torch.tensor([7])])
    sampling = Sampling(1.0, torch.Generator().manual_seed(0), draft_sampling="probabilistic")
    proposal = drafter.propose(seq, aux, 4, sampling)
    q = proposal.probs  # (4, V)
    assert q.shape == (4, llama.config.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(4))
    assert float(q[:, ~draft.t2d].abs().sum()) == 0.0
    assert all(q[i, t] > 0 and t % 8 == 0 for i, t in enumerate(proposal.tokens))
    # vLLM's default at T > 0 (draft_sample_method "greedy"): the T=0 drafts, verified as
    # point masses
    drafter.begin()
    at_zero = drafter.propose(seq, aux, 4, Sampling())
    drafter.begin()
    greedy = drafter.propose(seq, aux, 4, Sampling(1.0, torch.Generator().manual_seed(0)))
    assert greedy.probs is None and greedy.tokens == at_zero.tokens


# ---------------------------------------------------------------- exactness at T > 0

V, NEW, N = 3, 4, 4000  # 3-token vocabulary, 4 new tokens (81 outcomes), 4000 samples


def _tables():
    g = torch.Generator().manual_seed(1)
    return torch.randn(V, V, generator=g), torch.randn(V, V, generator=g)  # target, draft


def _exact_law(p_logits: torch.Tensor, start: int) -> dict[tuple, float]:
    p = torch.softmax(p_logits, -1).double()
    law = {}
    for seq in itertools.product(range(V), repeat=NEW):
        prob, last = 1.0, start
        for t in seq:
            prob *= float(p[last, t])
            last = t
        law[seq] = prob
    return law


def _chi_square(counts: dict[tuple, int], law: dict[tuple, float]) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; outcomes expected < 5 times share a bin."""
    big = {s: pr for s, pr in law.items() if N * pr >= 5}
    stat = sum((counts.get(s, 0) - N * pr) ** 2 / (N * pr) for s, pr in big.items())
    rest = 1.0 - sum(big.values())
    if N * rest > 1e-9:
        other = N - sum(counts.get(s, 0) for s in big)
        stat += (other - N * rest) ** 2 / (N * rest)
    return stat, len(big) - (N * rest <= 1e-9)


def _critical(dof: int, z: float = 3.09) -> float:
    """Chi-square quantile at p = 0.999 (Wilson-Hilferty)."""
    a = 2.0 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def _sample_speculative(p_logits, drafter) -> dict[tuple, int]:
    target = MarkovTarget(p_logits)
    sampling = Sampling(1.0, torch.Generator().manual_seed(1))
    prompt = torch.tensor([0])
    counts = {}
    for _ in range(N):
        seq = tuple(generate_speculative(target, drafter, prompt, 2, NEW, NO_STOP,
                                         sampling).tokens)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampling_reproduces_the_target_distribution(deterministic):
    """T=1, k=2: the law of 4-token continuations equals the target's exact law (chi-square
    at the 0.1% level; each position's marginal within total variation 0.03, about 3x its
    sampling noise), for a sampled and a point-mass draft."""
    p_logits, q_logits = _tables()
    counts = _sample_speculative(p_logits, MarkovDrafter(q_logits, deterministic))
    law = _exact_law(p_logits, 0)
    stat, dof = _chi_square(counts, law)
    assert stat < _critical(dof), (stat, dof)
    for i in range(NEW):
        got, want = torch.zeros(V), torch.zeros(V, dtype=torch.float64)
        for seq, pr in law.items():
            got[seq[i]] += counts.get(seq, 0) / N
            want[seq[i]] += pr
        tv = 0.5 * float((got.double() - want).abs().sum())
        assert tv < 0.03, (i, tv)


def test_chi_square_catches_a_wrong_residual(monkeypatch):
    """Negative control: resampling a rejected position from p instead of norm(max(p-q, 0)),
    the classic bug, fails the same test at the same sample size."""
    from eyas.serve import speculate

    right = speculate.verify

    def wrong(logits, proposal, sampling):
        accepted, token = right(logits, proposal, sampling)
        if accepted < len(proposal.tokens):
            token = speculate.sample(speculate.probs(logits[accepted], sampling), sampling)
        return accepted, token

    monkeypatch.setattr(speculate, "verify", wrong)
    p_logits, q_logits = _tables()
    counts = _sample_speculative(p_logits, MarkovDrafter(q_logits))
    stat, dof = _chi_square(counts, _exact_law(p_logits, 0))
    assert stat > _critical(dof), (stat, dof)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_moe"])
def test_runner_on_wrapper_and_moe_targets(tiny_model_dir, arch, prompt):
    """A multimodal wrapper (decoder below `model.language_model`, M-RoPE) and an MoE target:
    aux capture through models.py's paths, KV-cache rollback, lossless n-gram decoding."""
    from eyas.targets.models import load_target, submodule

    model, info = load_target(tiny_model_dir(arch), dtype="float32")
    runner = TargetRunner(model, submodule(model, info.layers_path),
                          submodule(model, info.norm_path), info.default_aux_layer_ids)
    ref = generate_plain(runner, prompt, 16, NO_STOP, Sampling()).tokens
    theirs = model.generate(prompt[None], max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert ref == theirs[0, len(prompt):].tolist()
    gen = generate_speculative(runner, NgramDrafter(1, 3), prompt, 3, 16, NO_STOP, Sampling())
    assert gen.tokens == ref and gen.stats.drafts > 0


def test_runner_refuses_an_aux_id_beyond_the_target(llama):
    with pytest.raises(EyasError, match=r"aux layer id 9 does not exist: the target has 8 "
                                        r"decoder layers \(ids 0..8\)"):
        TargetRunner(llama, llama.model.layers, llama.model.norm, (2, 5, 9))


def _cudnn_back() -> bool:
    """cuDNN's attention is on again, or a context of another thread (a test's leftover
    server thread, say) still holds it off: the flag is process-wide."""
    return torch.backends.cuda.cudnn_sdp_enabled() or sdpa._open > 0


def test_target_decode_forwards_leave_cudnn_attention_out(llama, prompt, monkeypatch,
                                                          cudnn_seen):
    # cuDNN plans each new key length on the host, so in a decode loop it plans every step
    # (47 of 83 ms a step at batch 64 on the 1.5B's shape, H200, session 41): the target's
    # forwards run with it left out, and EYAS_TARGET_SDPA=torch gives torch its choice back
    seen = cudnn_seen(llama.model.layers[0].self_attn)
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm)
    first, _ = runner.forward(prompt)
    runner.forward(first.argmax(-1)[-1:])
    assert seen == [False, False] and _cudnn_back()
    monkeypatch.setenv("EYAS_TARGET_SDPA", "torch")
    runner.reset()
    again, _ = runner.forward(prompt)
    assert seen[-1] is True or sdpa._open > 0
    assert torch.equal(again, first)  # the same attention, whichever kernel
    monkeypatch.setenv("EYAS_TARGET_SDPA", "fastest")
    with pytest.raises(EyasError, match="EYAS_TARGET_SDPA='fastest'"):
        runner.forward(prompt)


def test_target_attention_only_takes_cudnn_away():
    # kernels the user (or another library) turned off stay off inside the context
    from eyas.targets.sdpa import target_attention

    cuda = torch.backends.cuda
    cuda.enable_flash_sdp(False)
    try:
        with target_attention():
            assert (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
                    cuda.math_sdp_enabled(), cuda.cudnn_sdp_enabled()) == (False, True, True,
                                                                           False)
        assert not cuda.flash_sdp_enabled() and _cudnn_back()
    finally:
        cuda.enable_flash_sdp(True)


def test_contexts_of_several_threads_give_cudnn_back_only_when_the_last_leaves():
    # a save-and-restore per context let a thread that left last restore the "off" it had
    # found on entering (a chat server's request thread beside the main thread): one CI run
    # of session 41 ended with cuDNN's attention off for the rest of the process
    import threading

    cuda = torch.backends.cuda
    entered, leave, left = threading.Event(), threading.Event(), threading.Event()

    def other():
        with sdpa.target_attention():
            entered.set()
            leave.wait(10)
        left.set()

    before = cuda.cudnn_sdp_enabled()
    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10) and not cuda.cudnn_sdp_enabled()
    with sdpa.target_attention():
        leave.set()
        assert left.wait(10) and not cuda.cudnn_sdp_enabled()  # the other left first
    thread.join(10)
    assert cuda.cudnn_sdp_enabled() == before and sdpa._open == 0


def test_the_drafts_cached_attention_runs_without_cudnn_too(llama, draft, prompt, cudnn_seen):
    # the draft's cache grows every step as the target's does: left out of cuDNN as well
    # (session 41, H100: its proposals then took 44.6 ms of cuDNN host time a step at k = 2)
    seen = cudnn_seen(draft)
    drafter = Eagle3Drafter(draft, "cpu")
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm, drafter.aux_layer_ids)
    generate_speculative(runner, drafter, prompt, 3, 8, NO_STOP, Sampling())
    assert seen and not any(seen)
