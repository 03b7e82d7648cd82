"""Measuring speculative decoding on a loaded target and draft: every method (plain
decoding, the n-gram drafter, the EAGLE-3 or DFlash draft) at every k over a list of prompts,
batch by batch and interleaved, with the lossless check, the logit margin of each mismatch and
the replay on training's forward. `measure` returns raw counts (`Measured`), `run_eval` a
report, `measure_sets` one `Measured` per prompt set with MT-bench's next turn after the
target's own answer. `eyas eval` (eyas.evaluate) loads the models and writes the report; a
caller holding the models (training, on its checkpoints) can call these directly.
`cfg` below is an eyas.evaluate.EvalConfig.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter

import torch

from eyas.dflash.model import DFlashDraft
from eyas.serve.batched import (BatchEagle3Drafter, BatchNgramDrafter, BatchTarget,
                                generate_batch)
from eyas.serve.dflash_drafter import BatchDFlashDrafter, DFlashDrafter
from eyas.serve.eval_report import EvalReport, Measured, summarize
from eyas.serve.speculate import (Eagle3Drafter, NgramDrafter, Sampling, SpecStats, TargetRunner,
                                  generate_plain, generate_speculative)
from eyas.targets.prompts import Prompt, next_turn

log = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # every GPU: a device_map'ed target spans several
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def _timed(generate, batch: list[Prompt], device):
    """(Generations, seconds) of one batch of generations, the GPU work included."""
    _sync(device)
    start = time.perf_counter()
    gen = generate(batch)
    _sync(device)
    return gen, time.perf_counter() - start


def _prompt_generator(seed: int, prompt_id: str, device) -> torch.Generator:
    """The generator a prompt samples from at T > 0: seeded from `seed` and the prompt's id
    (a hash, so that seeds s and s+1 share no prompt's stream), not from its place in a
    process's share or a batch."""
    digest = hashlib.sha256(f"{seed}/{prompt_id}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little"))


def run_eval(model, layers, final_norm, draft, prompts: list[Prompt], cfg,
             stop_ids: frozenset[int] = frozenset()) -> EvalReport:
    """Measure every method on `prompts` with an already loaded target and draft.

    `layers`/`final_norm`: the target's decoder-layer ModuleList and final norm (for aux
    capture). `draft`: an `Eagle3Draft` sharing the target's embedding, or None. Training can
    call this on checkpoints with the models it holds; `evaluate` is the file-to-file step.
    """
    measured = measure(model, layers, final_norm, draft, prompts, cfg, stop_ids)
    return summarize(cfg, measured, len(prompts), [p.id for p in prompts])


def measure(model, layers, final_norm, draft, prompts: list[Prompt], cfg,
            stop_ids: frozenset[int] = frozenset(), index: list[int] | None = None) -> Measured:
    """Every method on `prompts`, `cfg.batch_size` prompts at a time (batch 1: the loop of
    eyas.serve.speculate per prompt; more: eyas.serve.batched over prompts of similar
    length), methods interleaved per batch; the lossless check and the replay. Raw counts,
    merged across processes by `merge`."""
    device = model.get_input_embeddings().weight.device
    aux_ids = tuple(draft.cfg.aux_layer_ids) if draft is not None else ()
    runner = TargetRunner(model, layers, final_norm, aux_ids)
    dflash = isinstance(draft, DFlashDraft)
    batched = cfg.batch_size > 1
    if batched:
        batch_target = BatchTarget(model, layers, final_norm, aux_ids)
    drafters = []
    if cfg.ngram:
        drafters.append(("ngram", (BatchNgramDrafter if batched else NgramDrafter)(
            cfg.ngram_min, cfg.ngram_max)))
    if dflash:
        drafters.append(("dflash", (BatchDFlashDrafter if batched else DFlashDrafter)(
            draft, device)))
    elif draft is not None:
        drafters.append(("eagle3", (BatchEagle3Drafter if batched else Eagle3Drafter)(
            draft, device)))

    def sampling(batch: list[Prompt]) -> list[Sampling]:
        # each prompt samples from its own generator, seeded from --seed and its id: the same
        # for every method, and whichever process (--workers) or batch decodes the prompt
        return [Sampling(cfg.temperature, _prompt_generator(cfg.seed, p.id, device)
                         if cfg.temperature else None, cfg.draft_sampling) for p in batch]

    def decoder(drafter, k: int, n: int):
        """A function: list of Prompts -> their Generations."""
        if batched:
            return lambda batch: generate_batch(batch_target, drafter, [p.ids for p in batch],
                                                k, n, stop_ids, sampling(batch))
        if drafter is None:
            return lambda batch: [generate_plain(runner, p.ids, n, stop_ids, s)
                                  for p, s in zip(batch, sampling(batch))]
        return lambda batch: [generate_speculative(runner, drafter, p.ids, k, n, stop_ids, s)
                              for p, s in zip(batch, sampling(batch))]

    runs = [("target", 0, decoder(None, 0, cfg.max_new_tokens))]
    runs += [(name, k, decoder(d, k, cfg.max_new_tokens)) for name, d in drafters for k in cfg.k]
    # batches of similar length (less padding) unless batch 1, which keeps the prompt order
    order = list(range(len(prompts)))
    if batched:
        order.sort(key=lambda i: len(prompts[i].ids))
    groups = [order[i: i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]
    out = Measured(index=list(range(len(prompts))) if index is None else list(index),
                   stats={(name, k): SpecStats(k=k) for name, k, _ in runs},
                   outputs={}, seconds={(name, k): 0.0 for name, k, _ in runs},
                   per_prompt={}, replayed={}, mismatches=[], device=str(device),
                   dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                   prompt_ids=[p.id for p in prompts])
    gens = {(name, k): [None] * len(prompts) for name, k, _ in runs}
    try:
        with torch.inference_mode():
            # warm-up (kernels, allocator, lazy init) so the first method is not penalised
            first = [prompts[i] for i in groups[0]]
            for _, drafter in [("target", None), *drafters]:
                decoder(drafter, max(cfg.k), 4)(first)
            # methods interleaved per batch: a drifting machine load hits all of them alike
            for group in groups:
                batch = [prompts[i] for i in group]
                for name, k, generate in runs:
                    done, took = _timed(generate, batch, device)
                    out.seconds[name, k] += took
                    for i, g in zip(group, done):
                        gens[name, k][i] = g
            for key, row in gens.items():
                for g in row:
                    out.stats[key].merge(g.stats)
                out.outputs[key] = [g.tokens for g in row]
                out.per_prompt[key] = [(g.stats.drafts, list(g.stats.accepted_per_position))
                                       for g in row]
            reference = out.outputs["target", 0]
            if cfg.lossless_check:
                for name, k, _ in runs[1:]:
                    out.mismatches += _compare(reference, out.outputs[name, k], prompts, name, k)
            for m in out.mismatches:
                m.update(_logit_margin(runner, prompts, reference, m))
    finally:
        runner.close()
    if draft is not None and cfg.replay and cfg.temperature == 0:
        try:
            out.replayed = _replay_all(model, layers, final_norm, draft, prompts, reference,
                                       cfg.k, dflash)
        except (RuntimeError, ValueError) as err:  # a diagnostic: the measurement stands
            log.warning("replay on training's forward failed, reported without it: %s", err)
    return out


def _replay_all(model, layers, final_norm, draft, prompts, reference, ks, dflash: bool) -> dict:
    """Per k, the replayed counts of every prompt, one row each: EAGLE-3 on training's TTT forward
    (eyas.draft.replay), DFlash on its block forward (eyas.dflash.replay)."""
    from eyas.dflash.replay import replay_dflash
    from eyas.draft.replay import replay

    head = model.get_output_embeddings().weight
    per_k = {k: [] for k in ks}
    for prompt, tokens in zip(prompts, reference):
        if len(tokens) < 2:  # nothing drafted after the target's first token: a row of none,
            for k in ks:     # so that the rows stay one per prompt, as measured ones are
                per_k[k].append((0, [0] * k))
            continue
        counts = (replay_dflash(model, layers, final_norm, draft, prompt.ids, tokens, tuple(ks))
                  if dflash else
                  replay(model, layers, final_norm, head, draft, prompt.ids, tokens, tuple(ks)))
        for k, c in counts.items():
            per_k[k].append(c)
    return per_k


def _compare(reference, outputs, prompts, method: str, k: int) -> list[dict]:
    """The first differing new token of each prompt whose output is not the reference."""
    found = []
    for prompt, want, got in zip(prompts, reference, outputs):
        at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b),
                  None if len(want) == len(got) else min(len(want), len(got)))
        if at is not None:
            found.append({"prompt_id": prompt.id, "method": method, "k": k, "position": at,
                          "expected": want[at] if at < len(want) else None,
                          "got": got[at] if at < len(got) else None})
    return found


def _logit_margin(runner, prompts, reference, mismatch: dict) -> dict:
    """{"margin": the target logit of the greedy token minus that of the speculative one at
    the divergence, "logit": the greedy token's logit}, from one fresh forward, exact (the
    difference of the two logits as the dtype holds them): a margin within the dtype's
    rounding of the logit is a tie (eval_report.rounding_tie), not a wrong token."""
    if mismatch["expected"] is None or mismatch["got"] is None:
        return {"margin": None, "logit": None}
    index = next(i for i, p in enumerate(prompts) if p.id == mismatch["prompt_id"])
    prefix = reference[index][: mismatch["position"]]
    runner.reset()
    ids = torch.cat([prompts[index].ids, torch.tensor(prefix, dtype=torch.long)])
    logits, _ = runner.forward(ids, last_only=True)
    want, got = float(logits[-1, mismatch["expected"]]), float(logits[-1, mismatch["got"]])
    return {"margin": want - got, "logit": want}


def prompt_room(max_positions: int, cfg) -> int:
    """The longest prompt that leaves room for max_new_tokens + k in the target's context."""
    return max_positions - cfg.max_new_tokens - max(cfg.k) - 1


def measure_sets(model, layers, final_norm, draft, prompts: list[Prompt], cfg,
                 stop_ids: frozenset[int], tokenizer,
                 index: list[int] | None = None, skipped: Counter | None = None
                 ) -> dict[str, tuple[list[Prompt], Measured]]:
    """`measure` on each group of prompts on its own (so each set has its own speed), in
    order: group -> (its prompts, Measured). After a group whose prompts ask a next question
    (MT-bench), that turn is measured as its own group, its prompts built from the target's
    own answers (its plain decoding, the greedy reference at T=0), as FastChat asks
    MT-bench's second turn. A next turn too long for the target's context is skipped,
    counted in `skipped` ("next turn too long")."""
    from eyas.targets.models import text_config

    index = list(range(len(prompts))) if index is None else index
    room = prompt_room(int(text_config(model.config).max_position_embeddings), cfg)
    pending = []
    for p, j in zip(prompts, index):
        if not pending or pending[-1][0] != p.group:
            pending.append((p.group, [], []))
        pending[-1][1].append(p)
        pending[-1][2].append(j)
    out = {}
    while pending:
        group, ps, idx = pending.pop(0)
        out[group] = ps, measure(model, layers, final_norm, draft, ps, cfg, stop_ids, idx)
        answers = out[group][1].outputs["target", 0]
        asked = [(next_turn(p, a, tokenizer), j) for p, j, a in zip(ps, idx, answers)
                 if p.follow_up is not None]
        fit = [(p, j) for p, j in asked if len(p.ids) <= room]
        long = [p.id for p, _ in asked if len(p.ids) > room]
        if long:
            if skipped is not None:
                skipped["next turn too long"] += len(long)
            log.warning("%d next-turn prompt(s) after %s longer than %d tokens skipped (the "
                        "target's context less --max-new-tokens and k; a lower "
                        "--max-new-tokens shortens the answer they hold too): %s", len(long),
                        group, room, long[:5])
        if fit:
            pending.insert(0, (fit[0][0].group, [p for p, _ in fit], [j for _, j in fit]))
    return out
