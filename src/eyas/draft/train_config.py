"""`eyas train`'s config: every flag of the recipe, for both draft families (EAGLE-3 and, with
`--draft dflash`, DFlash), declared once, with the recipe's defaults and the checks that refuse
a bad or mismatched combination naming the fix. The step is eyas.train.train; the set-up
pieces of eyas.draft and eyas.dflash take this config.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from eyas.config import (DEVICE_MAP_STRATEGIES, ConfigError, accept_other_weights_option,
                         check_choices, option, out_option, required, revision_option,
                         trust_remote_code_option)
from eyas.draft.loss import OBJECTIVES
from eyas.draft.ttt import LOSS_MASK_AT

log = logging.getLogger(__name__)

# DFlash's slot targets (--dflash-labels): the data tokens, or the target's greedy tokens
# (eyas.dflash.objective)
DFLASH_LABELS = ("data", "target")

# the default peak learning rates (issue 31's ablation, docs/train.md): AdamW at 1e-3 beat
# 3e-4 by +6.6 % / +9.4 % replayed AL (k = 3 / 6) on SmolLM2; SpecForge's DFlash recipe uses 6e-4
EAGLE3_LR, DFLASH_LR = 1e-3, 6e-4

# What an unset option of the recipe becomes: for EAGLE-3, speculators 0.9.0's EAGLE 3.1 recipe,
# which eyas trained as well as speculators' own trainer did on the same data (SmolLM2, 2,000
# regenerated conversations, `eyas eval`: 1.979 / 1.981 in distribution at k = 3), ahead of
# AdamW alone (1.902; held-out 1.435 / 1.394): docs/train.md, "What the defaults were chosen by".
# One change from it, measured here: every position of a document in the loss, prompts too
# (speculators: the assistant's), +1.7 % / +1.8 % acceptance at k = 3 / 6 over its positions,
# paired over 506 held-out and benchmark prompts at 12 K conversations (+2.5 % / +3.0 % at 3 K).
# For DFlash (and where torch has no Muon: the optimizer only), the settings before it.
EAGLE3_RECIPE = {"optimizer": "muon", "weight_decay": 0.01, "warmup_ratio": 0.01,
                 "lr_decay": "linear", "grad_clip": 1.0, "ttt_steps": 3, "step_weight": 1.0,
                 "loss_mask_at": "all", "vocab_filter": False, "freeze_lm_head": True,
                 "norm_before_residual": True}
PREVIOUS_RECIPE = {"optimizer": "adamw", "weight_decay": 0.0, "warmup_ratio": 0.015,
                   "lr_decay": "cosine", "grad_clip": 0.5, "ttt_steps": 7, "step_weight": 0.8,
                   "loss_mask_at": "predicted", "vocab_filter": True, "freeze_lm_head": False,
                   "norm_before_residual": False}
# of those, the TTT options a DFlash draft does not have (--draft dflash given another value:
# refused; freeze_lm_head and norm_before_residual have refusals of their own)
EAGLE3_ONLY = ("ttt_steps", "step_weight", "loss_mask_at", "vocab_filter")
RECIPE_NOTE = "unset: speculators' recipe for EAGLE-3 ({}), {} for dflash (docs/train.md)"
# The other options a run trains by, with one default for both families (the peak lr has its
# own: EAGLE3_LR, DFLASH_LR). Unset (None) until __post_init__, as the recipe's are, so that a
# resumed run tells an option given again from one left out (eyas.train.keep_run_recipe).
# Among them the data order's options: a resume given another value of one is refused
# (eyas.draft.resume).
DATA_ORDER = {"batch_tokens": 8192, "row_tokens": 0, "truncate": False, "seed": 0,
              "grad_accum": 1}
TRAINING_DEFAULTS = {"epochs": 10, "max_steps": 0, "betas": (0.9, 0.999), "muon_lr": 0.0,
                     "muon_momentum": 0.95, "muon_weight_decay": 0.1, "min_lr_ratio": 0.0,
                     "loss": "kl", "lk_kl_scale": 1.0, "lk_kl_decay": 1.0, "num_anchors": 512,
                     "loss_decay_gamma": 7.0, "dflash_labels": "data",
                     "online_cache_dtype": "bf16", **DATA_ORDER}
# what a resumed run keeps from its start (its eyas.json) where it is not given again
RESUMED = ("lr", *EAGLE3_RECIPE, *TRAINING_DEFAULTS)


def _unset_note(name: str) -> str:
    """The help text's end for an option of TRAINING_DEFAULTS: what it is when left unset."""
    value = TRAINING_DEFAULTS[name]
    shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
    return f" (unset: {shown}; a resumed run keeps its own)"


@dataclass(frozen=True)
class TrainConfig:
    """Train an EAGLE-3 draft with training-time test on captured (or online) target states."""

    data: str = required("capture folder from `eyas capture` (with --online: a prepared "
                         "folder from `eyas prepare`)")
    out: str = out_option("run folder: checkpoints/, metrics.jsonl, curves.png")
    draft: str = option("eagle3", "draft family: eagle3 (3 taps, training-time test) or dflash "
                                  "(block-parallel, any number of taps, served by vLLM's "
                                  "method dflash; docs/dflash.md)", choices=("eagle3", "dflash"))
    vocab: str | None = option(None, "vocab folder from `eyas vocab` (d2t/t2d); unset = the "
                                     "draft predicts over the whole target vocabulary")
    target: str | None = option(None, "target model; offline it defaults to the one the "
                                      "capture names (only its embedding and lm_head are read)")
    revision: str | None = revision_option()
    trust_remote_code: bool = trust_remote_code_option()
    accept_other_weights: bool = accept_other_weights_option("captures")
    online: bool = option(False, "run the target inside this job (capture on the fly) "
                                 "instead of reading capture shards")
    aux_layer_ids: tuple[int, ...] = option((), "--online only: aux layers in vLLM's "
                                                "convention; empty = EAGLE-3's (2, L//2, L-3), "
                                                "or with --draft dflash the layout of "
                                                "--dflash-layers (else 5) taps")
    target_device_map: str | None = option(
        None, "--online only: place the target with transformers' device_map (needs "
              "accelerate): auto spreads it over the visible GPUs, balanced_low_0 also but keeps "
              "GPU 0 (where the draft trains) light, or one device (cuda:1, cpu); unset = the "
              "whole target on the draft's GPU. One process only: under torchrun every rank "
              "would load its own copy")
    online_cache: str = option(
        "off", "--online only: keep each sample's target states after the target's first pass "
               "over it, so later epochs and evals read them instead of running the target "
               "again: gpu (the target's device), cpu (host memory) or off",
        choices=("off", "gpu", "cpu"))
    online_cache_dtype: str | None = option(
        None, "how --online-cache keeps the aux states: bf16 (what the target gave) or fp8 "
              "(as `eyas capture --dtype fp8` stores them, ~0.6x the memory; every epoch, "
              "the first too, then trains on the fp8 states)"
              + _unset_note("online_cache_dtype"), choices=("bf16", "fp8"))
    online_cache_gb: float = option(
        0.0, "--online-cache's bound in GB; 0 = half the memory free on its device once the "
             "target is loaded. Samples past it run the target every epoch (counted in the log)")
    eval_data: str | None = option(None, "held-out capture folder; default: the capture's "
                                         "eval split if it has one, else --eval-fraction")
    eval_fraction: float = option(0.02, "share of training samples held out when there is no "
                                        "eval split or --eval-data (0 = no eval)")
    batch_tokens: int | None = option(None, "tokens per micro-batch on each rank (packed rows, "
                                            "padding included)" + _unset_note("batch_tokens"))
    row_tokens: int | None = option(None, "tokens per packed row; 0 = one row of --batch-tokens"
                                    + _unset_note("row_tokens"))
    truncate: bool | None = option(None, "cut samples longer than a row instead of refusing "
                                         "them (counted)" + _unset_note("truncate"))
    grad_accum: int | None = option(None, "micro-batches per optimizer step on each rank"
                                    + _unset_note("grad_accum"))
    epochs: int | None = option(None, "passes over the training data (SpecForge's default)"
                                + _unset_note("epochs"))
    max_steps: int | None = option(None, "optimizer steps; 0 = --epochs over the data"
                                   + _unset_note("max_steps"))
    lr: float | None = option(None, "peak learning rate; unset: 1e-3 for EAGLE-3 (measured "
                                    "best on a real target, docs/train.md, issue 31; "
                                    "speculators' default), 6e-4 for dflash (SpecForge's)")
    betas: tuple[float, ...] | None = option(None, "AdamW betas (SpecForge; EAGLE used "
                                                   "0.9,0.95)" + _unset_note("betas"))
    weight_decay: float | None = option(None, "AdamW weight decay; " +
                                        RECIPE_NOTE.format(0.01, 0.0))
    optimizer: str | None = option(
        None, "adamw over every trained parameter, or muon: Muon (torch.optim.Muon, torch >= "
              "2.9, update RMS matched to AdamW's) over the 2-D hidden matrices (fc, attention, "
              "MLP) and AdamW over the rest; " + RECIPE_NOTE.format(
                  "muon; adamw on a torch without Muon", "adamw"), choices=("adamw", "muon"))
    muon_lr: float | None = option(None, "--optimizer muon: peak lr of the Muon group; 0 = "
                                         "--lr" + _unset_note("muon_lr"))
    muon_momentum: float | None = option(None, "--optimizer muon: Muon's momentum"
                                         + _unset_note("muon_momentum"))
    muon_weight_decay: float | None = option(None, "--optimizer muon: Muon's weight decay"
                                             + _unset_note("muon_weight_decay"))
    warmup_ratio: float | None = option(None, "linear warmup as a share of all steps; " +
                                        RECIPE_NOTE.format(0.01, 0.015))
    lr_decay: str | None = option(None, "after warmup, decay the lr along a cosine or a "
                                        "straight line to --min-lr-ratio; " +
                                  RECIPE_NOTE.format("linear", "cosine"),
                                  choices=("cosine", "linear"))
    min_lr_ratio: float | None = option(None, "lr floor at the last step, as a share of --lr"
                                        + _unset_note("min_lr_ratio"))
    grad_clip: float | None = option(None, "clip the global gradient norm to this (0 = off); " +
                                     RECIPE_NOTE.format(1.0, 0.5))
    ttt_steps: int | None = option(None, "training-time-test steps (chained draft passes); "
                                         "unset: 3 (speculators'; EAGLE-3's paper used 7)")
    step_weight: float | None = option(None, "loss weight of TTT step j is step_weight**j; "
                                             "unset: 1 (speculators'; 0.8 before)")
    loss_mask_at: str | None = option(None, "which token's loss mask puts a TTT step's "
                                            "position in the loss: the token it predicts or the "
                                            "token it reads, or all: every position of a "
                                            "document, prompts too; unset: all (measured best: "
                                            "docs/train.md; speculators': input; before: "
                                            "predicted)",
                                      choices=LOSS_MASK_AT)
    vocab_filter: bool | None = option(None, "leave out of the loss the positions whose target "
                                             "top-1 is outside the draft vocab (EAGLE-3's rule); "
                                             "unset: off (speculators keeps them)")
    loss: str | None = option(None, "per-position objective of each TTT step: kl = soft "
                              "cross-entropy against the target (EAGLE-3's); lk-alpha = -log of "
                              "the expected acceptance rate; lk-lambda = KL and 1 - acceptance "
                              "mixed by an adaptive weight (LK losses, arXiv 2602.23881; "
                              "docs/train.md)" + _unset_note("loss"), choices=OBJECTIVES)
    lk_kl_scale: float | None = option(None, "lk-lambda: KL weight = scale * exp(-decay * mean "
                                       "acceptance of the step)" + _unset_note("lk_kl_scale"))
    lk_kl_decay: float | None = option(None, "lk-lambda: see --lk-kl-scale"
                                       + _unset_note("lk_kl_decay"))
    lm_head: str = option("target", "initialise the draft lm_head from the target's rows of "
                                    "the draft vocab, or randomly", choices=("target", "scratch"))
    freeze_lm_head: bool | None = option(None, "keep the lm_head fixed at the target's rows; "
                                               "unset: on with --lm-head target (speculators'), "
                                               "off with scratch")
    draft_hidden_size: int = option(0, "draft hidden size: must stay 0, the target's (the "
                                       "draft shares the target's embedding and reads its "
                                       "states; docs/train.md)")
    draft_intermediate_size: int = option(0, "draft MLP size; 0 = the target's")
    draft_num_attention_heads: int = option(0, "draft attention heads; 0 = the target's")
    draft_num_key_value_heads: int = option(0, "draft kv heads; 0 = the target's")
    draft_layers: int = option(1, "EAGLE-3 decoder layers: the first reads the token embedding "
                                  "beside the hidden state, later ones are Llama blocks on its "
                                  "output, as vLLM's llama_eagle3 runs them; more than 1 is "
                                  "served by vLLM only (--format sglang refuses it)")
    norm_before_residual: bool | None = option(None, "residual = hidden_norm(g) instead of g; "
                                                     "unset: on (speculators'; served by vLLM "
                                                     ">= 0.19)")
    norm_before_fc: bool | None = option(
        None, "EAGLE 3.1 (speculators' default): one RMSNorm over the 3 concatenated aux states "
              "before fc; served by vLLM >= 0.19 (both formats), not by SGLang; not with "
              "--fc-norm. Unset: on for EAGLE-3 unless --fc-norm is given (the measured best "
              "recipe, docs/train.md), off for dflash; --no-norm-before-fc with "
              "--no-norm-before-residual for SGLang, and --no-norm-output too for plain "
              "EAGLE-3")
    fc_norm: bool = option(False, "EAGLE 3.1 (the paper's): one RMSNorm per aux state before fc; "
                                  "served by vLLM >= 0.22 (speculators format >= 0.24) and "
                                  "SGLang >= 0.5.13; not with --norm-before-fc")
    norm_output: bool | None = option(
        None, "EAGLE 3.1: feed norm(h), not h, to the next draft step; served by vLLM >= 0.22 "
              "(speculators format >= 0.24) and SGLang >= 0.5.13. Unset: on for EAGLE-3 (the "
              "measured best recipe), off for dflash; --no-norm-output for older servers")
    block_size: int = option(16, "dflash: tokens per block, the bonus slot included (the public "
                                 "recipes' 16); serve with num_speculative_tokens <= block_size - 1")
    num_anchors: int | None = option(None, "dflash: at most this many blocks per document per "
                                           "step, at random loss-masked anchors (SpecForge's "
                                           "512)" + _unset_note("num_anchors"))
    loss_decay_gamma: float | None = option(None, "dflash: slot j's loss weight is "
                                                  "exp(-(j-1)/gamma) (7 in every DFlash recipe at "
                                                  "block 16); 0 = uniform"
                                            + _unset_note("loss_decay_gamma"))
    dflash_layers: int = option(0, "dflash: decoder layers; 0 = one per captured tap "
                                   "(SpecForge's rule)")
    mask_token_id: int = option(-1, "dflash: id of the mask token filling slots 1..B-1; -1 = the "
                                    "tokenizer's mask token, else its first unused embedding row, "
                                    "else pad, else eos (SpecForge's order)")
    dflash_labels: str | None = option(None, "dflash: slot targets: the data tokens "
                                             "(SpecForge) or the target's greedy tokens (its "
                                             "captured top-1)" + _unset_note("dflash_labels"),
                                       choices=DFLASH_LABELS)
    parallel: str = option("ddp", "data parallelism under torchrun: DDP replicates the draft, "
                                  "FSDP2 shards weights and optimizer state",
                          choices=("ddp", "fsdp"))
    precision: str = option("bf16", "bf16 autocast over fp32 master weights (CUDA only; CPU "
                                     "always runs fp32); fp8: the same with the draft's matmuls "
                                     "in fp8 (GPUs of compute capability 8.9+: Ada, Hopper, "
                                     "Blackwell; on CPU only to test it); or fp32",
                            choices=("bf16", "fp8", "fp32"))
    compile: bool = option(False, "torch.compile the TTT forward")
    cuda_graph: bool = option(False, "replay each TTT forward+backward from a CUDA graph "
                                     "(one GPU, not with --compile): every step computes every "
                                     "position (no pruning), so all batches share one graph; "
                                     "pays at short rows, where queueing ~2,000 kernels per "
                                     "micro-batch bounds the speed")
    device: str | None = option(None, "cuda or cpu (default: cuda if available)")
    num_workers: int = option(2, "data-loader threads reading ahead (offline); 0 = read each "
                              "batch when the step asks for it")
    seed: int | None = option(None, "seed for the draft init and the data order"
                              + _unset_note("seed"))
    log_every: int = option(10, "log train metrics every N steps")
    eval_every: int = option(500, "evaluate every N steps (and at the end)")
    save_every: int = option(1000, "checkpoint every N steps (and at the end and at each new best)")
    keep_last: int = option(2, "checkpoints to keep besides the best")
    resume: str = option("auto", "auto = continue the run in --out if it has a checkpoint; "
                                 "never = delete the run's checkpoints and start over; or a "
                                 "checkpoints/step-N folder (newer ones are removed)")

    def __post_init__(self):
        check_choices(self)
        eagle3 = self.draft != "dflash"  # unset EAGLE 3.1 norms take the recipe's default
        if self.norm_before_fc is None:
            object.__setattr__(self, "norm_before_fc", eagle3 and not self.fc_norm)
        if self.norm_output is None:
            object.__setattr__(self, "norm_output", eagle3)
        # the options this config left unset (a resumed run keeps its own: train())
        object.__setattr__(self, "_unset", frozenset(k for k in RESUMED
                                                     if getattr(self, k) is None))
        if self.lr is None:
            object.__setattr__(self, "lr", EAGLE3_LR if eagle3 else DFLASH_LR)
        for name, value in TRAINING_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name, value in (EAGLE3_RECIPE if eagle3 else PREVIOUS_RECIPE).items():
            if getattr(self, name) is None:
                if name == "optimizer" and value == "muon" and not hasattr(torch.optim, "Muon"):
                    log.warning("torch %s has no torch.optim.Muon (torch >= 2.9): the draft "
                                "trains with AdamW alone (--optimizer adamw), not the default "
                                "recipe's Muon", torch.__version__)
                    value = "adamw"
                elif name == "freeze_lm_head" and self.lm_head == "scratch":
                    value = False
                object.__setattr__(self, name, value)
        checks = [
            (self.batch_tokens > 0, f"--batch-tokens must be > 0, got {self.batch_tokens}"),
            (self.row_tokens >= 0 and self.batch_tokens % (self.row_tokens or 1) == 0,
             f"--row-tokens {self.row_tokens} must divide --batch-tokens {self.batch_tokens} "
             f"(or be 0 for one row)"),
            (self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}"),
            (self.max_steps >= 0 and self.epochs >= 0, "--epochs and --max-steps must be >= 0"),
            (self.max_steps > 0 or self.epochs > 0, "give --epochs > 0 or --max-steps > 0"),
            (math.isfinite(self.lr) and self.lr > 0, f"--lr must be > 0 and finite, got "
                                                     f"{self.lr}"),
            (math.isfinite(self.muon_lr) and (self.weight_decay is None or (
                math.isfinite(self.weight_decay) and self.weight_decay >= 0)),
             f"--muon-lr must be finite and --weight-decay >= 0, got "
                                     f"{self.muon_lr}, {self.weight_decay}"),
            (self.seed >= 0, f"--seed must be >= 0, got {self.seed}"),
            (self.optimizer != "muon" or hasattr(torch.optim, "Muon"),
             f"--optimizer muon needs torch >= 2.9 (torch.optim.Muon); this is torch "
             f"{torch.__version__}: upgrade torch or use --optimizer adamw"),
            (self.muon_lr >= 0 and 0 <= self.muon_momentum < 1 and self.muon_weight_decay >= 0,
             f"--muon-lr must be >= 0 (0 = --lr), --muon-momentum in [0, 1), "
             f"--muon-weight-decay >= 0; got {self.muon_lr}, {self.muon_momentum}, "
             f"{self.muon_weight_decay}"),
            (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
             f"--betas needs two values in [0, 1), e.g. 0.9,0.999; got {self.betas}"),
            (0 <= self.warmup_ratio < 1,
             f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}"),
            (0 <= self.min_lr_ratio <= 1,
             f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}"),
            (self.grad_clip >= 0, f"--grad-clip must be >= 0 (0 = off), got {self.grad_clip}"),
            (self.ttt_steps >= 1, f"--ttt-steps must be >= 1, got {self.ttt_steps}"),
            (self.draft_layers >= 1, f"--draft-layers must be >= 1, got {self.draft_layers}"),
            (0 < self.step_weight <= 1, f"--step-weight must be in (0, 1], got {self.step_weight}"),
            (0 <= self.lk_kl_scale <= 1 and self.lk_kl_decay >= 0,
             f"--lk-kl-scale must be in [0, 1] and --lk-kl-decay >= 0 (the KL weight stays in "
             f"[0, 1]), got {self.lk_kl_scale}, {self.lk_kl_decay}"),
            (0 <= self.eval_fraction < 1,
             f"--eval-fraction must be in [0, 1), got {self.eval_fraction}"),
            (not (self.freeze_lm_head and self.lm_head == "scratch"),
             "--freeze-lm-head with --lm-head scratch would keep a random head; "
             "use --lm-head target"),
            (not self.online or bool(self.target), "--online needs --target (the model to run)"),
            (self.online or not self.aux_layer_ids,
             "--aux-layer-ids applies to --online only; offline, the capture fixes the layers"),
            (self.online or self.target_device_map is None,
             "--target-device-map applies to --online only; offline, train reads just the "
             "target's embedding and lm_head (use --device-map on `eyas capture` instead)"),
            (_is_device_map(self.target_device_map),
             f"--target-device-map must be one of {', '.join(DEVICE_MAP_STRATEGIES)} or a "
             f"device such as cuda:1 or cpu, got {self.target_device_map!r}"),
            (len(self.aux_layer_ids) in (0, 3) or self.draft == "dflash",
             f"--aux-layer-ids needs 3 ids (e.g. 2,16,29), got {self.aux_layer_ids}"),
            *(_dflash_checks(self) if self.draft == "dflash" else _eagle3_checks(self)),
            (self.online or (self.online_cache == "off" and self.online_cache_gb == 0
                             and self.online_cache_dtype == "bf16"),
             "--online-cache, --online-cache-dtype and --online-cache-gb apply to --online "
             "only; offline, the capture folder already holds the states"),
            (self.online_cache_gb >= 0,
             f"--online-cache-gb must be >= 0 (0 = half the free memory), got "
             f"{self.online_cache_gb}"),
            (not (self.online and self.eval_data),
             "--eval-data names a capture folder; with --online the eval split of the prepared "
             "folder (or --eval-fraction) is used instead"),
            (self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}"),
            (not (self.cuda_graph and self.compile),
             "--cuda-graph and --compile exclude each other: a graph replays the kernels the "
             "eager TTT step queues (its own compiled parts included); pick one"),
            (not (self.cuda_graph and self.device == "cpu"), "--cuda-graph needs --device cuda"),
            (self.device in (None, "cpu", "cuda"),
             f"--device must be cpu or cuda, got {self.device}"),
            *[(getattr(self, k) >= 1, f"--{k.replace('_', '-')} must be >= 1")
              for k in ("log_every", "eval_every", "save_every", "keep_last")],
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        ignored = [*(_changed(self, ("muon_lr", "muon_momentum", "muon_weight_decay"))
                     if self.optimizer != "muon" else []),
                   *(_changed(self, ("lk_kl_scale", "lk_kl_decay"))
                     if self.loss != "lk-lambda" else [])]
        if ignored:
            log.warning("%s: not used with --optimizer %s --loss %s (the Muon options need "
                        "--optimizer muon, the KL-weight options --loss lk-lambda)",
                        ", ".join(ignored), self.optimizer, self.loss)


def _changed(cfg: "TrainConfig", names) -> list[str]:
    """The flags of `names` given a value other than their default."""
    return [f"--{n.replace('_', '-')} {getattr(cfg, n)}" for n in names
            if getattr(cfg, n) != _default(n)]


def _dflash_checks(cfg: TrainConfig) -> list[tuple[bool, str]]:
    """What --draft dflash does not take, or takes differently."""
    why = "an EAGLE-3 option; DFlash drafts do not have it: drop it with --draft dflash"
    return [
        (cfg.block_size >= 2, f"--block-size must be >= 2 (bonus + drafts), got {cfg.block_size}"),
        (cfg.num_anchors >= 1, f"--num-anchors must be >= 1, got {cfg.num_anchors}"),
        (cfg.loss_decay_gamma >= 0, f"--loss-decay-gamma must be >= 0, got {cfg.loss_decay_gamma}"),
        (cfg.dflash_layers >= 0, f"--dflash-layers must be >= 0, got {cfg.dflash_layers}"),
        (cfg.mask_token_id >= -1, f"--mask-token-id must be >= 0 (or -1: the tokenizer's), got "
                                  f"{cfg.mask_token_id}"),
        (cfg.vocab is None, "--vocab: a DFlash draft predicts over the target's whole vocabulary "
                            "with the target's own lm_head (what vLLM shares with it); drop --vocab"),
        (cfg.loss == "kl", f"--loss {cfg.loss}: {why} (DFlash trains on cross-entropy)"),
        (not (cfg.norm_before_fc or cfg.fc_norm or cfg.norm_output or cfg.norm_before_residual),
         f"--norm-before-fc / --fc-norm / --norm-output / --norm-before-residual: {why}"),
        (not cfg.freeze_lm_head, f"--freeze-lm-head: the target's lm_head is always frozen for "
                                 f"DFlash; drop it"),
        (cfg.precision != "fp8", "--precision fp8 is not built for DFlash yet; use bf16"),
        (not cfg.cuda_graph, "--cuda-graph is not built for DFlash yet (its block count changes "
                             "every step); drop it"),
        (not cfg.compile, "--compile is not built (or tested) for DFlash yet; drop it"),
        (cfg.draft_layers == 1, "--draft-layers is the EAGLE-3 draft's layer count; a DFlash "
                                "draft's is --dflash-layers"),
        (not cfg.draft_hidden_size, "--draft-hidden-size: a DFlash draft has the target's width "
                                    "(it reads the target's embedding and lm_head); leave it 0"),
        *_left_at_default(cfg, ("lm_head", "lk_kl_scale", "lk_kl_decay"), "{flag}: " + why),
        *[(getattr(cfg, name) == PREVIOUS_RECIPE[name], f"--{name.replace('_', '-')}: {why}")
          for name in EAGLE3_ONLY],
    ]


# the options only a DFlash draft has (an EAGLE-3 run would silently ignore them)
DFLASH_ONLY = ("block_size", "num_anchors", "loss_decay_gamma", "dflash_layers", "mask_token_id",
               "dflash_labels")


def _eagle3_checks(cfg: TrainConfig) -> list[tuple[bool, str]]:
    """An EAGLE-3 run given a DFlash option: refused, naming the flag, not ignored."""
    return _left_at_default(cfg, DFLASH_ONLY, "{flag} is a DFlash option; EAGLE-3 drafts do not "
                                              "have it: add --draft dflash or drop it")


def _left_at_default(cfg: TrainConfig, names, message: str) -> list[tuple[bool, str]]:
    """One check per option of `names`: it keeps its default, else `message` (its {flag})."""
    return [(getattr(cfg, name) == _default(name),
             message.format(flag="--" + name.replace("_", "-"))) for name in names]


def _default(name: str):
    """What option `name` is when not given (TRAINING_DEFAULTS' are unset until then)."""
    return TRAINING_DEFAULTS.get(name, TrainConfig.__dataclass_fields__[name].default)


def _is_device_map(value: str | None) -> bool:
    """None, a strategy, or one device torch can name (transformers puts the whole target there)."""
    if value is None or value in DEVICE_MAP_STRATEGIES:
        return True
    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        return False
    return True


# what an option of TRAINING_DEFAULTS is when left unset (eyas.freshness.changed_options: an
# option a manifest lacks is no change where it holds this)
TrainConfig.UNSET_DEFAULTS = TRAINING_DEFAULTS
# options that change how a run logs, checkpoints or reads ahead, never the draft it makes
# (eyas.freshness.changed_options: editing one in `eyas run`'s YAML does not start a finished
# or half-trained run over; a run resumed with another value goes on as `eyas train` does)
TrainConfig.RESULT_NEUTRAL = frozenset({"num_workers", "log_every", "save_every", "keep_last",
                                        "device"})
