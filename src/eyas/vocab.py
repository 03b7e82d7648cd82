"""`eyas vocab`: the draft vocabulary (d2t / t2d) from prepare's assistant-token counts.

The draft predicts over `Vd` of the target's `V` ids: the `Vd` most frequent target ids among
loss-masked (assistant) tokens, ties broken by the lower id, padded with the lowest unused
ids when fewer than `Vd` ids were seen, sorted ascending. Draft id `i` is target id
`i + d2t[i]` (d2t holds int64 OFFSETS, as vLLM reads it); `t2d` is a bool mask over the
target vocab with exactly `Vd` true entries. Output: `vocab.safetensors` + `eyas.json`
(with `coverage`, the share of assistant tokens whose id is in the draft vocab).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.config import ConfigError, option, out_option, required
from eyas.errors import EyasError
from eyas.store.manifest import (check_out, check_same_target, peek_manifest, read_manifest,
                                 write_manifest)
from eyas.store.permissions import as_umask
from eyas.store.vocab import VOCAB_FILE, check_vocab, load_vocab, read_tensors

log = logging.getLogger(__name__)

DEFAULT_DRAFT_VOCAB = 32000
COUNTS_FILE = "token_counts.safetensors"


@dataclass(frozen=True)
class VocabConfig:
    """Pick the draft vocabulary from the token counts of one or more prepared folders."""

    data: tuple[str, ...] = required("prepared folder(s) written by `eyas prepare` (same target)")
    out: str = out_option("output folder (vocab/)")
    draft_vocab_size: int | None = option(
        None, f"draft vocabulary size Vd (default {DEFAULT_DRAFT_VOCAB}, or the whole target vocab "
              f"when that is smaller; a size given is kept, or refused when over the target's)")

    def __post_init__(self):
        if not self.data:
            raise ConfigError("vocab needs --data: one or more folders written by `eyas prepare`")
        if self.draft_vocab_size is not None and self.draft_vocab_size <= 0:
            raise ConfigError(f"--draft-vocab-size must be > 0, got {self.draft_vocab_size}")
        resolved = [Path(f).resolve() for f in self.data]
        twice = [f for f, r in zip(self.data, resolved) if resolved.count(r) > 1]
        if twice:  # its counts would be summed twice, weighting it over the others
            raise ConfigError(f"--data names the same prepared folder more than once "
                              f"({', '.join(twice)}); give each folder once")


def build_vocab(counts: torch.Tensor, draft_vocab_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """counts (V,) int64 -> (d2t (Vd,) int64 offsets, t2d (V,) bool, coverage in [0, 1])."""
    counts = counts.to(torch.int64).reshape(-1)
    v = counts.numel()
    if draft_vocab_size > v:
        raise EyasError(f"draft vocab size {draft_vocab_size} exceeds the target vocab of {v} "
                        f"ids; pass --draft-vocab-size {v} or less")
    # stable sort of -counts: most frequent first, equal counts (incl. the unseen zeros, which
    # pad the selection) in ascending id order
    order = torch.argsort(-counts, stable=True)
    chosen = order[:draft_vocab_size].sort().values  # (Vd,) target ids, ascending
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[chosen] = True
    total = int(counts.sum())
    coverage = float(counts[chosen].sum()) / total if total else 0.0
    return d2t, t2d, coverage


def _read_counts(folders: tuple[str, ...]) -> tuple[torch.Tensor, list[dict]]:
    manifests = [read_manifest(f, step="prepare") for f in folders]
    for m in manifests[1:]:
        check_same_target(m.get("target"), manifests[0].get("target"),
                          f"prepared folder {m['path']}", weights=False)
    total = None
    for m in manifests:
        path = Path(m["path"]) / COUNTS_FILE
        counts = read_tensors(path, ("counts",), f"re-run `eyas prepare` for {m['path']}"
                              )["counts"].to(torch.int64)
        expected = m.get("vocab_size") or (m.get("target") or {}).get("vocab_size")
        if expected and counts.numel() != int(expected):
            raise EyasError(f"{path} counts {counts.numel()} ids but the target vocab has "
                            f"{expected}; re-run `eyas prepare` for {m['path']}")
        if total is not None and counts.numel() != total.numel():
            raise EyasError(f"{m['path']} counts {counts.numel()} ids but {manifests[0]['path']} "
                            f"counts {total.numel()}: the folders were prepared for different "
                            f"targets; give folders of one target")
        total = counts if total is None else total + counts
    return total, manifests


def _warn_replacing(out: Path, t2d: torch.Tensor) -> None:
    """Warn where `out` holds an earlier vocab of other tokens than `t2d`'s: the training runs
    started with it as --vocab cannot resume with the new one (their checkpoints hold the old
    vocabulary's rows)."""
    earlier = peek_manifest(out) or {}
    if not (out / VOCAB_FILE).is_file() or earlier.get("step") != "vocab":
        return
    try:
        same = torch.equal(read_tensors(out / VOCAB_FILE, ("t2d",), "")["t2d"], t2d)
    except EyasError:  # unreadable: replaced either way, and nothing could have resumed on it
        return
    if not same:
        log.warning("replacing the draft vocabulary in %s (%s tokens) with another (%d tokens): "
                    "a training run started with --vocab %s resumes only with the old one "
                    "(`eyas run` starts its train step over); to keep the old, write the new "
                    "one to another --out", out, earlier.get("draft_vocab_size", "?"),
                    int(t2d.sum()), out)


def vocab(cfg: VocabConfig) -> dict:
    """Write `vocab.safetensors` (d2t, t2d) and the manifest into cfg.out; return the manifest."""
    # not unfinished=(VOCAB_FILE,): a vocab.safetensors without a manifest may be a user's own
    # (issue 34). So the manifest comes first, marked unfinished: a run killed before the end
    # leaves the folder as this step's (run again, it is replaced; train refuses it)
    out = check_out(cfg.out, "vocab", own=(VOCAB_FILE,))
    counts, manifests = _read_counts(cfg.data)
    seen = int(counts.sum())
    if seen == 0:
        raise EyasError(f"no assistant (loss-masked) tokens in {list(cfg.data)}; check that "
                        f"prepare found assistant turns (see its rejects.jsonl and stats)")
    size = cfg.draft_vocab_size
    if size is None:
        size = min(DEFAULT_DRAFT_VOCAB, counts.numel())
        if size < DEFAULT_DRAFT_VOCAB:
            log.info("target vocab has only %d ids (< default draft vocab %d): the draft uses "
                     "the whole target vocabulary", size, DEFAULT_DRAFT_VOCAB)
    d2t, t2d, coverage = build_vocab(counts, size)
    _warn_replacing(out, t2d)
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, "vocab", cfg, target=manifests[0].get("target"), inputs=manifests,
                   complete=False)
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(out / VOCAB_FILE))
    as_umask(out / VOCAB_FILE)  # safetensors writes owner-only
    log.info("draft vocab: %d of %d target ids, covering %.2f%% of %d assistant tokens "
             "(%d distinct ids seen)", size, counts.numel(), 100 * coverage, seen,
             int((counts > 0).sum()))
    return write_manifest(out, "vocab", cfg, target=manifests[0].get("target"), inputs=manifests,
                          draft_vocab_size=size, vocab_size=int(counts.numel()),
                          coverage=coverage, assistant_tokens=seen,
                          distinct_ids_seen=int((counts > 0).sum()))
