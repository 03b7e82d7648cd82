"""Training data, the order: which samples make each micro-batch of the run, and on which rank.

The whole run's data order is a pure function of (seed, sample lengths, packing settings), so
the "data position" saved in a checkpoint is one integer: how many global micro-batches the run
has consumed. Every epoch shuffles sample ids across all shards, then packs them in that order
into rows of `row_tokens` tokens (each sample keeps its own `position_ids` from 0 and a `doc_id`
so attention never crosses samples); `rows` rows make one micro-batch. Global micro-batch `g`
belongs to rank `g % world_size`, so ranks never see the same sample in a step and a run on N
ranks with accumulation A consumes exactly the micro-batches of a 1-rank run with accumulation
N*A. `plan_data` makes a run's `Plan` from its inputs (eyas.draft.data); eyas.draft.data_loader
turns the planned micro-batches into tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass

import numpy as np

from eyas.draft.data import Inputs
from eyas.draft.processes import Env
from eyas.errors import EyasError
from eyas.draft.train_config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Packing:
    """How samples become micro-batches: `rows` rows of `row_tokens` tokens each."""

    row_tokens: int
    rows: int
    truncate: bool


def check_lengths(lengths: np.ndarray, ids: np.ndarray, packing: Packing,
                  what: str) -> dict[str, int] | None:
    """Every sample must fit one row unless truncation was asked for. With `--truncate`, what
    the cut costs, counted (None when no sample is cut): samples cut of all, tokens not trained
    on of all, and the longest sample, whose length keeps every one whole."""
    if len(ids) == 0:
        raise EyasError(f"{what} has no samples; capture more data or lower --eval-fraction.")
    mine = lengths[ids].astype(np.int64)
    longest = int(mine.max())
    if longest > packing.row_tokens and not packing.truncate:
        worst = int(ids[int(np.argmax(mine))])
        raise EyasError(
            f"{what}: sample {worst} has {longest} tokens but a packed row holds only "
            f"{packing.row_tokens}; raise --batch-tokens (or --row-tokens) to at least {longest}, "
            f"or pass --truncate to cut long samples to the row length.")
    over = mine > packing.row_tokens
    if not over.any():
        return None
    return {"samples": int(over.sum()), "of_samples": len(mine),
            "tokens_cut": int((mine[over] - packing.row_tokens).sum()),
            "of_tokens": int(mine.sum()), "longest": longest}


def pack(order: np.ndarray, lengths: np.ndarray, packing: Packing) -> list[list[list[int]]]:
    """Next-fit packing of samples in `order`: micro-batches -> rows -> sample ids.

    Next-fit keeps the shuffled order (so the plan is cheap and deterministic); with rows much
    longer than a sample the tail left empty in each row is small.
    """
    batches: list[list[list[int]]] = []
    batch: list[list[int]] = []
    row: list[int] = []
    used = 0
    for i in order:
        n = min(int(lengths[i]), packing.row_tokens)
        if row and used + n > packing.row_tokens:
            batch.append(row)
            row, used = [], 0
            if len(batch) == packing.rows:
                batches.append(batch)
                batch = []
        row.append(int(i))
        used += n
    if row:
        batch.append(row)
    if batch:
        batches.append(batch)
    return batches


def epoch_batches(ids: np.ndarray, lengths: np.ndarray, packing: Packing, *, seed: int,
                  epoch: int, shuffle: bool = True) -> list[list[list[int]]]:
    """One epoch's micro-batches: a seeded shuffle of `ids` across all shards, then packing."""
    order = ids
    if shuffle:
        order = ids[np.random.default_rng([seed, epoch]).permutation(len(ids))]
    return pack(order, lengths, packing)


def plan_run(ids: np.ndarray, lengths: np.ndarray, packing: Packing, *, seed: int,
             per_step: int, epochs: int, max_steps: int) -> tuple[list, list[int]]:
    """All global micro-batches of the run, and the epoch of each.

    `per_step` = world_size * grad_accum micro-batches per optimizer step. With `max_steps` the
    run goes on over as many epochs as it needs; otherwise it is `epochs` epochs, with the last
    incomplete optimizer step dropped.
    """
    batches: list = []
    epoch_of: list[int] = []
    epoch = 0
    while (len(batches) < max_steps * per_step) if max_steps else (epoch < epochs):
        new = epoch_batches(ids, lengths, packing, seed=seed, epoch=epoch)
        batches += new
        epoch_of += [epoch] * len(new)
        epoch += 1
    steps = max_steps or len(batches) // per_step
    if steps == 0:
        raise EyasError(
            f"the training data make {len(batches)} micro-batches but one optimizer step needs "
            f"{per_step} (ranks x --grad-accum); lower --batch-tokens or --grad-accum, or use "
            f"more data.")
    n = steps * per_step
    return batches[:n], epoch_of[:n]


def plan_fingerprint(lengths: np.ndarray, ids: np.ndarray, packing: Packing, seed: int,
                     per_step: int) -> str:
    """What must stay equal for a saved data position to mean the same samples on resume."""
    blob = json.dumps([packing.row_tokens, packing.rows, packing.truncate, seed, per_step,
                       hashlib.sha256(lengths.tobytes()).hexdigest(),
                       hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def rank_slice(batches: list, *, rank: int, world_size: int, start: int) -> list:
    """This rank's micro-batches from global position `start` on (`start` % world_size == 0)."""
    return batches[start + rank::world_size]


def eval_rank_batches(batches: list, *, rank: int, world_size: int) -> list:
    """This rank's eval micro-batches, padded with `None` so every rank runs the same count
    (FSDP forwards are collective: a rank that stopped early would hang the others)."""
    per_rank = math.ceil(len(batches) / world_size)
    mine = batches[rank::world_size]
    return mine + [None] * (per_rank - len(mine))


@dataclass(frozen=True)
class Plan:
    """The run's data order (see this module's docstring): every global micro-batch, and the
    eval batches of this rank."""

    packing: Packing
    batches: list  # global micro-batches -> rows -> sample ids
    epoch_of: list[int]
    per_step: int  # global micro-batches per optimizer step (ranks x grad_accum)
    total_steps: int
    fingerprint: str
    eval_batches: list  # this rank's, padded with None to the same count on every rank
    eval_fingerprint: str = ""  # the eval samples ("" without eval): a best compares within one
    truncated: dict | None = None  # per split, what --truncate cut (check_lengths), if any
    older_fingerprints: tuple[str, ...] = ()  # earlier eyas's fingerprints of the same plan


def plan_data(cfg: TrainConfig, inputs: Inputs, env: Env) -> Plan:
    row = cfg.row_tokens or cfg.batch_tokens
    packing = Packing(row, cfg.batch_tokens // row, cfg.truncate)
    lengths, per_step = inputs.train.lengths, env.world_size * cfg.grad_accum
    truncated = {"train": check_lengths(lengths, inputs.train_ids, packing, "the training data")}
    batches, epoch_of = plan_run(inputs.train_ids, lengths, packing, seed=cfg.seed,
                                 per_step=per_step, epochs=cfg.epochs, max_steps=cfg.max_steps)
    eval_batches = []
    if inputs.eval is not None:
        truncated["eval"] = check_lengths(inputs.eval.lengths, inputs.eval_ids, packing,
                                          "the eval data")
        eval_batches = eval_rank_batches(pack(inputs.eval_ids, inputs.eval.lengths, packing),
                                         rank=env.rank, world_size=env.world_size)
    truncated = {k: v for k, v in truncated.items() if v}
    if env.main:
        for split, cut in truncated.items():
            log.warning("--truncate: %d of the %d %s samples are longer than a row of %d tokens "
                        "and are cut to it: %d of their split's %d tokens (%.2f %%) are not "
                        "trained on%s; --batch-tokens (or --row-tokens) %d keeps every one "
                        "whole (counted in the run's eyas.json, `truncated`)", cut["samples"],
                        cut["of_samples"], split, packing.row_tokens, cut["tokens_cut"],
                        cut["of_tokens"], 100 * cut["tokens_cut"] / cut["of_tokens"],
                        "" if split == "train" else " or measured", cut["longest"])
    # by prepared row, not capture sample number: a capture made again (other --shard count,
    # a damaged part redone) holds the same rows under other numbers, in the same order
    ids = np.asarray(inputs.train_ids, np.int64)
    rows = _prepared_rows(inputs, ids)
    return Plan(packing, batches, epoch_of, per_step, len(batches) // per_step,
                plan_fingerprint(np.asarray(lengths)[ids], rows, packing, cfg.seed, per_step),
                eval_batches, eval_fingerprint(inputs), truncated,
                # what runs saved before 2026-12-07 recorded (capture numbers): still resumed
                (plan_fingerprint(lengths, inputs.train_ids, packing, cfg.seed, per_step),))


def _prepared_rows(inputs: Inputs, ids: np.ndarray) -> np.ndarray:
    """The prepared rows of training samples `ids`: a capture's own record of them (its
    `sample_index`), or the ids themselves online, where samples are the prepared rows."""
    capture = getattr(inputs.train, "capture", None)
    if capture is None:
        return ids
    return np.asarray(capture.sample_index, np.int64)[ids]


def eval_fingerprint(inputs: Inputs) -> str:
    """Which samples the run's evals measure: their ids and lengths, and the capture they are
    read from (its manifest id: --eval-data of the same size is other samples). "" without
    eval."""
    if inputs.eval is None or len(inputs.eval_ids) == 0:
        return ""
    source = (getattr(inputs.eval, "manifest", None) or {}).get("id")
    lengths = np.asarray(inputs.eval.lengths)[np.asarray(inputs.eval_ids, np.int64)]
    blob = json.dumps([source, hashlib.sha256(lengths.tobytes()).hexdigest(),
                       hashlib.sha256(np.asarray(inputs.eval_ids, np.int64).tobytes()).hexdigest()])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
