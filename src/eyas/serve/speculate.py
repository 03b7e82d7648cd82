"""Speculative decoding for evaluation: chain drafts, one-forward verification, exact acceptance.

One sequence at a time (batch 1), like the acceptance numbers servers report per request:

    prefill the target on the prompt -> first token (the target's own)
    loop:  drafter proposes up to k tokens d_1..d_m
           target runs once on [last, d_1..d_m] with its KV cache  -> m+1 next-token distributions
           accept a prefix of the drafts (greedy match at T=0, min(1, p/q) rejection at T>0),
           then one more token from the target: the correction or, if all m passed, the bonus
           drop the rejected positions from the target's KV cache

A drafter is any object with `aux_layer_ids` (the target states it reads; `()` for none),
`begin()` and `propose(tokens, new_aux, k, sampling) -> Proposal`; the n-gram drafter below, the
EAGLE-3 drafter and the test stubs all follow it (duck typing, no base class).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from eyas.errors import EyasError
from eyas.targets.sdpa import target_attention
from eyas.targets.taps import AuxTaps


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else sampling from softmax(logits / T).
    `draft_sampling` is how a draft picks its tokens at T > 0, as vLLM's speculative_config
    `draft_sample_method`: "greedy" (vLLM's default) takes the draft's argmax and verifies it
    as a point mass (accepted with the target's probability of it); "probabilistic" samples
    from the draft and accepts with min(1, p/q). Both keep the target's distribution exactly;
    their acceptance differs."""

    temperature: float = 0.0
    generator: torch.Generator | None = None
    draft_sampling: str = "greedy"


@dataclass
class Proposal:
    """What a drafter proposes for one step."""

    tokens: list[int]  # m <= k target-vocabulary ids (fewer than k, even 0, is allowed)
    # (m, V) the draft's distribution over the TARGET vocab each token was sampled from;
    # None = a deterministic drafter (point mass on each token; greedy drafts at T=0).
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """The interface the loop calls (documentation; drafters need not inherit it)."""

    aux_layer_ids: tuple[int, ...]

    def begin(self) -> None:
        """Forget the previous sequence."""

    def propose(self, tokens: torch.Tensor, new_aux: torch.Tensor | None, k: int,
                sampling: Sampling) -> Proposal:
        """`tokens` (S,) cpu int64: the whole sequence so far; its last token is not yet in the
        target's KV cache. `new_aux` (A, n_aux*Ht): the target's aux states at positions
        S-1-A .. S-2, i.e. those computed since the previous call (None if no aux ids)."""


@dataclass
class SpecStats:
    """Counters with vLLM's definitions: a draft = one verification step with >= 1 draft token."""

    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    target_forwards: int = 0  # including the prefill
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.k

    def observe(self, drafted: int, accepted: int) -> None:
        self.target_forwards += 1
        if drafted == 0:
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: SpecStats) -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted
        self.target_forwards += other.target_forwards
        for i, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += n

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per verification step, the bonus token included."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [n / self.drafts if self.drafts else 0.0 for n in self.accepted_per_position]

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class Generation:
    tokens: list[int]  # the new tokens (prompt excluded), cut at max_new_tokens / a stop id
    stats: SpecStats


# ---------------------------------------------------------------- sampling and verification

def probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """softmax(logits / T) in float32 over the last dim (T > 0)."""
    return torch.softmax(logits.float() / sampling.temperature, dim=-1)


def sample(p: torch.Tensor, sampling: Sampling) -> int:
    return int(torch.multinomial(p, 1, generator=sampling.generator).item())


def pick(logits: torch.Tensor, sampling: Sampling) -> tuple[int, torch.Tensor | None]:
    """One token from (V,) logits: (argmax, None) at T=0, else (sample, its distribution)."""
    if sampling.temperature == 0:
        return int(logits.argmax().item()), None
    p = probs(logits, sampling)
    return sample(p, sampling), p


def drafts_sampled(sampling: Sampling) -> bool:
    """Whether a draft samples its tokens (and hands their distributions to `verify`) rather
    than taking its argmax: only at T > 0 with draft_sampling "probabilistic"."""
    return sampling.temperature > 0 and sampling.draft_sampling == "probabilistic"


def draft_pick(logits: torch.Tensor, sampling: Sampling) -> tuple[int, torch.Tensor | None]:
    """A draft's token from (V,) logits: `pick` when drafts are sampled, else (argmax, None)."""
    if not drafts_sampled(sampling):
        return int(logits.argmax().item()), None
    return pick(logits, sampling)


def verify(logits: torch.Tensor, proposal: Proposal, sampling: Sampling) -> tuple[int, int]:
    """Accept a prefix of the drafts; return (number accepted, the target's next token).

    `logits` (m+1, V): the target at the last committed token and at each of the m drafts.
    At T=0 a draft is accepted while it equals the target's argmax. At T>0 draft i is accepted
    with probability min(1, p_i(d)/q_i(d)); the first rejection is replaced by a sample from
    norm(max(p_i - q_i, 0)), and if all pass the bonus token is sampled from p_m. The emitted
    tokens are then distributed exactly as the target's own samples (Leviathan et al. 2023).
    """
    m = len(proposal.tokens)
    drafts = torch.tensor(proposal.tokens, dtype=torch.long, device=logits.device)  # (m,)
    if sampling.temperature == 0:
        top = logits.argmax(dim=-1)  # (m+1,)
        agree = (top[:m] == drafts).tolist() + [False]
        accepted = agree.index(False)
        return accepted, int(top[accepted].item())
    p = probs(logits, sampling)  # (m+1, V)
    if proposal.probs is None:  # deterministic drafter: q is a point mass on each draft token
        q = torch.nn.functional.one_hot(drafts, p.shape[-1]).to(p.dtype)
    else:
        q = proposal.probs.to(device=p.device, dtype=p.dtype)  # (m, V)
    rows = torch.arange(m, device=p.device)
    ratio = p[rows, drafts] / q[rows, drafts]  # q(d) > 0: d was drawn from q
    u = torch.rand(m, generator=sampling.generator, device=p.device)
    passed = (u < ratio).tolist() + [False]
    accepted = passed.index(False)
    if accepted == m:
        return m, sample(p[m], sampling)
    residual = (p[accepted] - q[accepted]).clamp(min=0)
    total = residual.sum()
    # p == q up to rounding: rejection had probability ~0 and p itself is the right law
    residual = residual / total if total > 0 else p[accepted]
    return accepted, sample(residual, sampling)


# ---------------------------------------------------------------- the target

class TargetRunner:
    """A transformers causal LM with its KV cache; aux states through eyas.targets.taps.AuxTaps
    (the same hooks and layer-id convention as `eyas capture`)."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList, final_norm: nn.Module,
                 aux_layer_ids: tuple[int, ...] = ()):
        self.model = model
        self.device = model.get_input_embeddings().weight.device  # inputs and outputs live here
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.cache = None
        self.taps = AuxTaps(layers, final_norm, self.aux_layer_ids, len(layers), final=False)
        params = inspect.signature(model.forward).parameters
        self._can_trim_logits = "logits_to_keep" in params
        # transformers >= 5.2x names the KV cache argument `cache`; earlier 5.x (and most
        # remote code) `past_key_values`
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def reset(self) -> None:
        self.cache = None  # the first forward lets the model build the cache type it needs

    def run(self, ids: torch.Tensor, last_only: bool = False, aux: bool = False, **inputs):
        """The model on `ids` (B, T) after the cached prefix, the cache kept for the next call
        -> (logits (B, T or 1, V) as the model returns them, aux states (B*T, n*Ht) on the
        input embedding's device or None). inputs: more model inputs (attention_mask,
        position_ids: eyas.serve.batched)."""
        kwargs = {self._cache_arg: self.cache, "use_cache": True, **inputs}
        if last_only and self._can_trim_logits:
            kwargs["logits_to_keep"] = 1
        capture = aux and bool(self.aux_layer_ids)
        with self.taps.attached() if capture else contextlib.nullcontext(), \
                target_attention():
            out = self.model(input_ids=ids.to(self.device), **kwargs)
        cache = out.get("cache")
        self.cache = cache if cache is not None else out.get("past_key_values")
        logits = out.logits[:, -1:] if last_only else out.logits
        states = None
        if capture:  # (B*T, n, Ht) -> (B*T, n*Ht), on the input device (device_map'ed layers)
            states = self.taps.collect(self.device)[0].flatten(1)
        return logits, states

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, last_only: bool = False, aux: bool = False):
        """Run `ids` (T,) after the cached prefix -> (logits (T or 1, V) fp32, aux states
        (T, n*Ht) if `aux` else None), both on the input embedding's device."""
        logits, states = self.run(ids[None], last_only, aux)
        return logits[0].float().to(self.device), states

    def rollback(self, n: int) -> None:
        """Drop the last `n` positions from the KV cache (rejected drafts)."""
        if n > 0:  # negative = "remove this many" in every transformers 5.x Cache.crop
            self.cache.crop(-n)

    def close(self) -> None:
        """Nothing stays attached between forwards; kept for callers that release runners."""


# ---------------------------------------------------------------- generation loops

def _finished(out: list[int], new: list[int], max_new_tokens: int,
              stop_ids: frozenset[int]) -> bool:
    return len(out) >= max_new_tokens or any(t in stop_ids for t in new)


def _cut(out: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> list[int]:
    out = out[:max_new_tokens]
    for i, t in enumerate(out):
        if t in stop_ids:
            return out[: i + 1]
    return out


def generate_plain(target, prompt: torch.Tensor, max_new_tokens: int,
                   stop_ids: frozenset[int], sampling: Sampling) -> Generation:
    """No speculation: one target forward per token (the baseline and the greedy reference)."""
    stats = SpecStats(k=0)
    target.reset()
    logits, _ = target.forward(prompt, last_only=True)
    stats.observe(0, 0)
    out: list[int] = []
    while True:
        token, _ = pick(logits[-1], sampling)
        out.append(token)
        if _finished(out, [token], max_new_tokens, stop_ids):
            return Generation(_cut(out, max_new_tokens, stop_ids), stats)
        logits, _ = target.forward(torch.tensor([token]))
        stats.observe(0, 0)


def generate_speculative(target, drafter, prompt: torch.Tensor, k: int, max_new_tokens: int,
                         stop_ids: frozenset[int], sampling: Sampling) -> Generation:
    """Speculative decoding of one prompt with chain drafts of up to `k` tokens."""
    stats = SpecStats(k=k)
    target.reset()
    drafter.begin()
    aux = bool(drafter.aux_layer_ids)
    if aux and tuple(drafter.aux_layer_ids) != tuple(target.aux_layer_ids):
        raise EyasError(f"the drafter reads target layers {drafter.aux_layer_ids} but the target "
                        f"runner captures {target.aux_layer_ids} (internal error)")
    logits, new_aux = target.forward(prompt, last_only=True, aux=aux)  # (n, A*Ht) if aux
    stats.observe(0, 0)
    token, _ = pick(logits[-1], sampling)
    seq = prompt.tolist() + [token]
    out, new = [token], [token]
    while not _finished(out, new, max_new_tokens, stop_ids):
        with target_attention():  # (the draft's cache grows each step as the target's)
            proposal = drafter.propose(torch.tensor(seq), new_aux, k, sampling)
        m = len(proposal.tokens)
        if m > k:
            raise EyasError(f"drafter {type(drafter).__name__} proposed {m} > k={k} tokens")
        # (m+1,) the pending last token and the drafts, at positions S-1 .. S-1+m
        logits, states = target.forward(torch.tensor([seq[-1], *proposal.tokens]), aux=aux)
        accepted, token = verify(logits, proposal, sampling)
        target.rollback(m - accepted)
        stats.observe(m, accepted)
        new = proposal.tokens[:accepted] + [token]
        # the states of the last token and the accepted drafts: the drafter's next step-0 input
        new_aux = states[: accepted + 1] if states is not None else None
        seq += new
        out += new
    return Generation(_cut(out, max_new_tokens, stop_ids), stats)


# ---------------------------------------------------------------- drafters

class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens
    (n from `max_n` down to `min_n`) and propose the tokens that followed it."""

    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def begin(self) -> None:
        pass

    def propose(self, tokens: torch.Tensor, new_aux, k: int, sampling: Sampling) -> Proposal:
        s = tokens.shape[0]
        for n in range(min(self.max_n, s - 1), self.min_n - 1, -1):
            windows = tokens[: s - 1].unfold(0, n, 1)  # (s-n, n): every n-gram but the suffix
            hits = (windows == tokens[s - n:]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                return Proposal(tokens[start: start + k].tolist())
        return Proposal([])


class Eagle3Drafter:
    """An EAGLE-3 draft fed the way vLLM feeds it.

    Step 0 runs over the newly accepted positions: position t pairs the target's aux states at
    t with token t+1, at RoPE position t. Its last output predicts draft 1; chain step j feeds
    draft j with the draft's own hidden state from step j-1 at position S-2+j. Before step 0
    the draft's KV cache is cut back to the positions computed from target states.
    """

    def __init__(self, draft, device: torch.device | str):
        self.draft = draft
        self.device = torch.device(device)
        self.aux_layer_ids = tuple(draft.cfg.aux_layer_ids)
        self.dtype = next(draft.parameters()).dtype
        ids = torch.arange(draft.d2t.shape[0], device=draft.d2t.device)
        self.draft_to_target = draft.to_target_ids(ids).to(self.device)  # (Vd,) i + d2t[i]
        self.vocab_size = int(draft.t2d.shape[0])
        self.cache = None
        self.seen = 0  # positions whose draft KV comes from target states

    def begin(self) -> None:
        self.cache = self.draft.new_cache()
        self.seen = 0

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(Vd,) draft logits -> (V,) over the target vocabulary, -inf outside the draft's."""
        full = logits.new_full((self.vocab_size,), float("-inf"))  # (V,)
        full[self.draft_to_target] = logits
        return full

    @torch.inference_mode()
    def propose(self, tokens: torch.Tensor, new_aux: torch.Tensor, k: int,
                sampling: Sampling) -> Proposal:
        s = tokens.shape[0]
        first = s - 1 - new_aux.shape[0]  # position of the first new aux state
        if first != self.seen:
            raise EyasError(f"draft state out of step: has {self.seen} positions, got aux from "
                            f"{first} (internal error in the speculative loop)")
        self.cache.crop(self.seen)  # drop the previous step's chain positions
        ids = tokens[first + 1: s].to(self.device)[None]  # (1, A): token t+1 for aux t
        pos = torch.arange(first, s - 1, device=self.device)[None]  # (1, A)
        aux = new_aux.to(device=self.device, dtype=self.dtype)[None]  # (1, A, n*Ht)
        out = self.draft(ids, aux, pos, cache=self.cache)
        self.seen = s - 1
        drafts, dists = [], []
        for j in range(k):
            token, p = draft_pick(self.target_logits(out.logits[0, -1]), sampling)
            drafts.append(token)
            dists.append(p)
            if j + 1 == k:
                break
            ids = torch.tensor([[token]], device=self.device)  # (1, 1)
            pos = torch.tensor([[s - 1 + j]], device=self.device)  # (1, 1)
            out = self.draft(ids, None, pos, hidden=out.hidden[:, -1:], cache=self.cache)
        q = torch.stack(dists) if drafts_sampled(sampling) else None  # (k, V)
        return Proposal(drafts, q)
