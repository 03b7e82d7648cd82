"""eyas train: packing and the data plan, checkpoints, and the recipe's invariants on a tiny
real pipeline (prepare -> capture -> vocab -> train): the draft learns, batch 4 x accumulation 1
== batch 1 x accumulation 4, a run SIGKILLed mid-way resumes to identical weights, online
training equals offline, and mismatched inputs are refused with the fix in the message.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.store import checkpoint, shards
from eyas.draft import data, data_loader, data_plan
from eyas.config import ConfigError, to_dict
from eyas.errors import EyasError
from eyas.draft.train_config import TrainConfig
from eyas.train import train, warmup_cosine

# ----------------------------------------------------------------------------- fixtures


def copy_target(out: Path) -> Path:
    """A tiny random Llama made predictable: its lm_head is its own (row-normalised, x40)
    embedding and its blocks are damped, so the target mostly predicts a token of the recent
    context with a peaked distribution. A purely random tiny target predicts near-uniform
    noise, which no draft can learn in a few steps."""
    from eyas.targets.tiny import build_tiny_model

    build_tiny_model("llama", out)
    path = out / "model.safetensors"
    w = load_file(str(path))
    e = w["model.embed_tokens.weight"]
    w["lm_head.weight"] = (e / (e.norm(dim=1, keepdim=True) + 1e-6) * 40).contiguous()
    for k in list(w):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = (w[k] * 0.3).contiguous()
    save_file(w, str(path), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    """The real pipeline on the tiny target: 80 synthetic chats, captured with --split all."""
    from eyas.capture import CaptureConfig, capture
    from eyas.targets.corpus import synthetic_chats
    from eyas.prepare import PrepareConfig, prepare
    from eyas.vocab import VocabConfig, vocab

    root = tmp_path_factory.mktemp("train-inputs")
    model = copy_target(root / "target")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(80, seed=0)))
    prepare(PrepareConfig(target=str(model), data=(str(chats),), out=str(root / "prepared"),
                          max_length=256, eval_fraction=0.15))
    capture(CaptureConfig(target=str(model), data=str(root / "prepared"),
                          out=str(root / "captured"), split="all", model_dtype="fp32",
                          batch_tokens=2048))
    vocab(VocabConfig(data=(str(root / "prepared"),), out=str(root / "vocab"),
                      draft_vocab_size=256))
    return {k: str(root / k) for k in ("target", "prepared", "captured", "vocab")}


def _cfg(inputs, out, **kw) -> TrainConfig:
    base = dict(data=inputs["captured"], vocab=inputs["vocab"], out=str(out), batch_tokens=256,
                max_steps=6, lr=1e-2, lm_head="scratch", num_workers=0, log_every=1,
                eval_every=100, save_every=100, seed=0)
    return TrainConfig(**{**base, **kw})


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint.step_dir(run, step) / "draft.safetensors"))


def _records(run: Path, kind: str) -> list[dict]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


# ----------------------------------------------------------------------------- data plan


def _fake_sample(n: int, ht: int = 4, start: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.arange(start, start + n, dtype=torch.int32)
    return {"aux_hidden": torch.randn(n, 3, ht), "final_hidden": torch.randn(n, ht),
            "target_top1": ids + 1, "input_ids": ids,
            "loss_mask": torch.ones(n, dtype=torch.uint8)}


def test_packing_fills_rows_without_crossing_samples():
    lengths = np.array([5, 9, 3, 7, 7, 2, 8, 1, 6])
    packing = data_plan.Packing(row_tokens=12, rows=2, truncate=False)
    batches = data_plan.pack(np.arange(len(lengths)), lengths, packing)
    rows = [row for b in batches for row in b]
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 12 for row in rows)
    assert all(len(b) <= 2 for b in batches)
    # collate: positions restart at 0 in every sample, doc ids count samples, padding is -1
    samples = [_fake_sample(int(lengths[i]), start=100 * i) for i in rows[0]]
    out = data_loader.collate([samples], 12, torch.float32)
    at = 0
    for d, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        assert out["position_ids"][0, at:at + n].tolist() == list(range(n))
        assert (out["doc_ids"][0, at:at + n] == d).all()
        assert torch.equal(out["aux_hidden"][0, at:at + n], s["aux_hidden"].reshape(n, -1))
        at += n
    assert (out["doc_ids"][0, at:] == -1).all() and (out["loss_mask"][0, at:] == 0).all()


def test_plan_is_deterministic_shuffled_per_epoch_and_split_by_rank():
    lengths = np.random.default_rng(0).integers(3, 30, size=50)
    ids = np.arange(50)
    packing = data_plan.Packing(64, 1, False)
    plan, epoch_of = data_plan.plan_run(ids, lengths, packing, seed=3, per_step=4, epochs=2,
                                        max_steps=0)
    again, _ = data_plan.plan_run(ids, lengths, packing, seed=3, per_step=4, epochs=2,
                                  max_steps=0)
    assert plan == again and len(plan) % 4 == 0
    first = [i for b, e in zip(plan, epoch_of) if e == 0 for r in b for i in r]
    second = [i for b, e in zip(plan, epoch_of) if e == 1 for r in b for i in r]
    assert first != second  # each epoch has its own order...
    assert len(set(first)) == len(first)  # ...and no sample twice within it
    # two ranks: disjoint, together exactly the global stream; a resumed slice continues it
    r0 = data_plan.rank_slice(plan, rank=0, world_size=2, start=0)
    r1 = data_plan.rank_slice(plan, rank=1, world_size=2, start=0)
    assert r0 + r1 == plan[0::2] + plan[1::2]
    assert data_plan.rank_slice(plan, rank=1, world_size=2, start=4) == r1[2:]
    # max_steps runs over as many epochs as needed
    long, epochs = data_plan.plan_run(ids, lengths, packing, seed=3, per_step=4, epochs=0,
                                      max_steps=40)
    assert len(long) == 160 and max(epochs) >= 2
    # eval batches: every rank gets the same count (FSDP forwards are collective)
    ev = data_plan.eval_rank_batches(plan[:5], rank=1, world_size=2)
    assert len(ev) == 3 and ev[-1] is None


def test_too_long_sample_names_its_length_and_the_flags():
    lengths = np.array([10, 300, 20])
    with pytest.raises(EyasError, match=r"sample 1 has 300 tokens.*--batch-tokens.*--truncate"):
        data_plan.check_lengths(lengths, np.arange(3), data_plan.Packing(256, 1, False),
                                "the data")
    # --truncate: the cut is counted (it used to go unrecorded): 1 of 3 samples, 44 tokens
    assert data_plan.check_lengths(lengths, np.arange(3), data_plan.Packing(256, 1, True),
                                   "the data") == {"samples": 1, "of_samples": 3, "tokens_cut": 44,
                                                   "of_tokens": 330, "longest": 300}
    assert data_plan.check_lengths(lengths, np.array([0, 2]), data_plan.Packing(256, 1, True),
                                   "the data") is None
    out = data_loader.collate([[_fake_sample(300)]], 256, torch.float32)
    assert out["position_ids"][0, -1] == 255  # cut to the row, not dropped


def test_warmup_then_cosine_to_floor():
    f = warmup_cosine(100, 0.1, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(99) == pytest.approx(0.1, abs=1e-3)
    assert all(f(s) >= f(s + 1) for s in range(10, 99))


def test_warmup_then_linear_decay_to_floor():
    f = warmup_cosine(100, 0.1, 0.0, "linear")
    assert f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)
    assert f(40) - f(41) == pytest.approx(f(80) - f(81))  # a straight line, not a cosine


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tmp_path):
    from test_ttt import make_draft, tiny_cfg
    from eyas.draft.train_setup import build_optimizers

    draft = make_draft(tiny_cfg(norm_before_fc=True))
    name = {id(p): n for n, p in draft.named_parameters()}
    cfg = TrainConfig(data="x", out=str(tmp_path), optimizer="muon", lr=1e-3, muon_lr=2e-2)
    muon, adamw = build_optimizers(cfg, draft)
    in_muon = {name[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {name[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert isinstance(muon, torch.optim.Muon) and muon.param_groups[0]["lr"] == 2e-2
    assert adamw.param_groups[0]["lr"] == 1e-3
    assert "fc.weight" in in_muon and "lm_head.weight" in in_adamw
    assert all(n.endswith("proj.weight") for n in in_muon - {"fc.weight"})
    assert all("norm" in n for n in in_adamw - {"lm_head.weight"})
    assert in_muon | in_adamw == {n for n, p in draft.named_parameters() if p.requires_grad}
    assert len(build_optimizers(TrainConfig(data="x", out=str(tmp_path)), draft)) == 2  # default
    assert len(build_optimizers(TrainConfig(data="x", out=str(tmp_path), optimizer="adamw"),
                                draft)) == 1


def test_unset_recipe_options_take_the_recipe_of_the_draft_family(monkeypatch, caplog):
    """EAGLE-3: speculators' recipe with every position of a document in the loss (measured
    best: docs/train.md); DFlash: the previous settings, and an EAGLE-3-only option given to it
    with another value is refused; --lm-head scratch is not frozen; a torch without Muon trains
    with AdamW alone, warned."""
    from eyas.config import ConfigError
    from eyas.draft.train_config import EAGLE3_RECIPE, PREVIOUS_RECIPE

    def recipe(cfg):
        return {k: getattr(cfg, k) for k in EAGLE3_RECIPE}

    assert recipe(TrainConfig(data="x", out="y")) == EAGLE3_RECIPE
    assert TrainConfig(data="x", out="y").loss_mask_at == "all"
    assert TrainConfig(data="x", out="y", loss_mask_at="input").loss_mask_at == "input"
    assert recipe(TrainConfig(data="x", out="y", draft="dflash")) == PREVIOUS_RECIPE
    assert TrainConfig(data="x", out="y", lm_head="scratch").freeze_lm_head is False
    assert TrainConfig(data="x", out="y", grad_clip=0.5).grad_clip == 0.5  # given wins
    for flag, value in (("ttt_steps", 3), ("vocab_filter", False), ("loss_mask_at", "input"),
                        ("norm_before_residual", True), ("freeze_lm_head", True)):
        with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')}"):
            TrainConfig(data="x", out="y", draft="dflash", **{flag: value})
    monkeypatch.delattr(torch.optim, "Muon")
    with caplog.at_level(logging.WARNING):
        assert TrainConfig(data="x", out="y").optimizer == "adamw"
    assert "no torch.optim.Muon" in caplog.text
    with pytest.raises(ConfigError, match="needs torch >= 2.9"):
        TrainConfig(data="x", out="y", optimizer="muon")


def test_speculators_recipe_resumes_after_sigkill_exactly(run_inputs, tmp_path, caplog):
    """Muon + AdamW, a linear decay and speculators' loss positions resume bit for bit
    (two optimizers and two schedules in one checkpoint)."""
    kw = dict(max_steps=6, save_every=2, eval_every=3, lm_head="target", grad_accum=2,
              optimizer="muon", lr_decay="linear", loss_mask_at="input", vocab_filter=False,
              ttt_steps=3, step_weight=1.0, norm_before_residual=True, lr=1e-3)
    _resume_after_sigkill(run_inputs, tmp_path, kw)
    state = torch.load(checkpoint.step_dir(tmp_path / "whole", 6) / "trainer_state.pt",
                       weights_only=True)
    assert len(state["scheduler"]["schedules"]) == 2
    lrs = [r["lr"] for r in _records(tmp_path / "whole", "train")]
    assert lrs[-1] < lrs[1]
    # the same run folder resumed with another optimizer: refused with the fix, no traceback
    more = {**kw, "optimizer": "adamw", "max_steps": 8}
    with pytest.raises(EyasError, match="--optimizer adamw.*saved by another.*started with "
                                        r"\(--optimizer muon --freeze-lm-head\).*--resume never"):
        train(_cfg(run_inputs, tmp_path / "whole", **more))
    assert "--lr-decay linear -> cosine" not in caplog.text
    with pytest.raises(EyasError, match="saved by another"):  # warned first, then refused
        train(_cfg(run_inputs, tmp_path / "whole", **{**more, "lr_decay": "cosine"}))
    assert "--lr-decay linear -> cosine" in caplog.text and "--optimizer muon ->" not in \
        caplog.text
    caplog.clear()
    train(_cfg(run_inputs, tmp_path / "one", **{**kw, "max_steps": 1}))
    assert "Muon on the CPU is slow" in caplog.text and "--optimizer adamw" in caplog.text


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoints_keep_last_n_and_best_and_restore_everything(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"draft": torch.nn.Linear(3, 2)})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    saved = {}
    for step in range(1, 6):
        model["draft"](torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        checkpoint.save(tmp_path, step, model, opt, sched, draft_config={"x": 1},
                        state={"step": step}, metrics={}, keep_last=2, best_step=2)
    ckpt = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == \
        ["step-00000002", "step-00000004", "step-00000005"]
    assert checkpoint.read_pointer(tmp_path, "last").name == "step-00000005"
    assert checkpoint.read_pointer(tmp_path, "best").name == "step-00000002"
    assert set(_weights(tmp_path, 4)) == {"weight", "bias"}  # the "draft." prefix is dropped
    # restore into a fresh model: weights, optimizer moments, schedule, RNG
    checkpoint.save(tmp_path, 6, model, opt, sched, draft_config={}, state={"step": 6},
                    metrics={}, keep_last=9, best_step=2)
    expected_rng = torch.rand(3)  # the draw right after the save...
    fresh = torch.nn.ModuleDict({"draft": torch.nn.Linear(3, 2)})  # (moves the RNG on)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (s + 1))
    state = checkpoint.load(checkpoint.step_dir(tmp_path, 6), fresh, opt2, sched2)
    assert state["step"] == 6 and torch.equal(torch.rand(3), expected_rng)  # ...comes again
    assert all(torch.equal(fresh.state_dict()[k], saved[5][k]) for k in saved[5])
    assert sched2.last_epoch == sched.last_epoch
    m1, m2 = opt.state_dict()["state"][0], opt2.state_dict()["state"][0]
    assert torch.equal(m1["exp_avg"], m2["exp_avg"]) and m1["step"] == m2["step"]
    checkpoint.clear_after(tmp_path, 4)
    assert checkpoint.read_pointer(tmp_path, "last") is None
    assert checkpoint.resolve_resume(tmp_path, "never") is None
    with pytest.raises(EyasError, match="--resume auto") as refused:
        checkpoint.resolve_resume(tmp_path, str(tmp_path / "nope"))
    assert refused.value.flag == "--resume"  # (eyas run's hint follows it)


# ----------------------------------------------------------------------------- the recipe


def test_tiny_draft_learns_and_writes_the_run_folder(run_inputs, tmp_path):
    from eyas.draft.config import DraftConfig
    from eyas.draft.eagle3 import Eagle3Draft
    from eyas.store.manifest import read_manifest

    run = tmp_path / "run"
    summary = train(_cfg(run_inputs, run, max_steps=36, log_every=6, eval_every=12,
                         save_every=12, keep_last=1, num_workers=1))
    evals = _records(run, "eval")
    assert [r["step"] for r in evals] == [0, 12, 24, 36]
    start, end = evals[0]["sim_acceptance_length"], evals[-1]["sim_acceptance_length"]
    assert start < 1.1 and end > start + 0.4, evals  # learns far beyond chance
    assert evals[-1]["loss"] < evals[0]["loss"] - 4
    train_rows = _records(run, "train")
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    # the default recipe's 3 TTT steps (speculators')
    assert all(r["tokens_per_s"] > 0 and len(r["acc"]) == 3 for r in train_rows)
    # checkpoints: the best by the replayed chain's AL at k = 3, the last, nothing else
    # (keep_last=1)
    best = max(evals[1:], key=lambda r: r["chain"]["acceptance_length"]["3"])
    assert summary["best"]["step"] == best["step"]
    assert summary["best"]["chain_by_k"] == best["chain"]["acceptance_length"]
    # the replay counts as a server does: position i is accepted only after 0..i-1
    for r in evals[1:]:
        per_pos = r["chain"]["per_position"]["3"]
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert checkpoint.read_pointer(run, "best").name == f"step-{best['step']:08d}"
    assert checkpoint.read_pointer(run, "last").name == "step-00000036"
    kept = {p.name for p in (run / "checkpoints").iterdir() if p.is_dir()}
    assert kept == {f"step-{best['step']:08d}", "step-00000036"}
    # what export reads: draft_config.json + draft.safetensors under the vLLM names
    step = checkpoint.read_pointer(run, "best")
    dcfg = DraftConfig.from_dict(json.loads((step / "draft_config.json").read_text()))
    weights = load_file(str(step / "draft.safetensors"))
    assert "fc.weight" in weights and "midlayer.self_attn.q_proj.weight" in weights
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert weights["fc.weight"].dtype == torch.float32  # fp32 master weights
    Eagle3Draft(dcfg).load_state_dict(weights, strict=True)
    assert dcfg.draft_vocab_size == 256 and dcfg.aux_layer_ids == (2, 4, 5)
    manifest = read_manifest(run, step="train")
    assert manifest["complete"] and manifest["best"] == summary["best"]
    assert manifest["aux_layer_ids"] == [2, 4, 5]
    assert (run / "curves.png").stat().st_size > 1000


def test_batch_4_accum_1_equals_batch_1_accum_4(run_inputs, tmp_path):
    """Four rows in one micro-batch or one row in each of four: the same samples, the same
    global-count normalisation, so the same loss and the same update."""
    # AdamW: Muon's Newton-Schulz runs in bf16, which turns the last-bit differences of two
    # summation orders into update differences of ~1e-4 (exactness here is the batching's)
    big = train(_cfg(run_inputs, tmp_path / "big", batch_tokens=512, row_tokens=128,
                     grad_accum=1, max_steps=3, lm_head="target", optimizer="adamw"))
    small = train(_cfg(run_inputs, tmp_path / "small", batch_tokens=128, grad_accum=4,
                       max_steps=3, lm_head="target", optimizer="adamw"))
    records = _records(tmp_path / "big", "train"), _records(tmp_path / "small", "train")
    assert len(records[0]) == len(records[1]) == 3 and small["steps"] == big["steps"] == 3
    for rb, rs in zip(*records):
        assert rb["positions"] == rs["positions"] and rb["tokens"] == rs["tokens"]
        assert rb["loss"] == pytest.approx(rs["loss"], rel=1e-5)
        # step 1 from the same weights; later steps start from weights that differ by
        # float rounding grown through Adam (below), which moves the norm by ~2e-5
        tol = 1e-5 if rb["step"] == 1 else 1e-4
        assert rb["grad_norm"] == pytest.approx(rs["grad_norm"], rel=tol)
    # Adam divides by sqrt(v): float-rounding differences of near-zero gradients grow to
    # ~1e-5 (with every position in the loss, the default since issue 31's 12 K levers, one
    # weight of 4,096 by 1.6e-4 on an Intel CPU, by 4.9e-4 on an AMD EPYC), still 20x below one
    # step's size (lr 1e-2); a batching error moves the losses and norms above, held to 1e-5,
    # and nearly every weight
    a, b = _weights(tmp_path / "big", 3), _weights(tmp_path / "small", 3)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-3)
        far = ((a[k].float() - b[k].float()).abs() > 1e-5).float().mean().item()
        assert far < 0.01, f"{k}: {far:.2%} of its weights differ by more than 1e-5"  # 0.65 %
    assert big["train"]["grad_norm"] > 0  # the weights compared are trained, not two inits


KILLER = """
import json, os, signal, sys
from eyas.store import checkpoint
from eyas.draft.train_config import TrainConfig
from eyas.train import train

kill_at = int(sys.argv[2])
save = checkpoint.save


def save_then_die(run_dir, step, *args, **kwargs):
    out = save(run_dir, step, *args, **kwargs)
    if step == kill_at:  # a real crash: no cleanup, no exception handlers
        os.kill(os.getpid(), signal.SIGKILL)
    return out


checkpoint.save = save_then_die
train(TrainConfig(**json.loads(sys.argv[1])))
"""


def test_resume_after_sigkill_continues_exactly(run_inputs, tmp_path):
    kw = dict(max_steps=6, save_every=2, eval_every=3, lm_head="target", grad_accum=2)
    _resume_after_sigkill(run_inputs, tmp_path, kw)


TERMINATOR = """
import json, os, signal, sys
import torch
from eyas.draft.train_config import TrainConfig
from eyas.train import train

calls, clip = [0], torch.nn.utils.clip_grad_norm_


def clip_then_signal(*args, **kwargs):  # during step 3, as a scheduler's preemption would
    calls[0] += 1
    if calls[0] == int(sys.argv[4]):  # to this process, or to its whole process group
        if sys.argv[2] == "RAISE":  # an error nothing catches (an OOM, a full disk) instead
            raise RuntimeError("step failed")
        name, times = (sys.argv[2].split("*") + ["1"])[:2]  # SIGTERM*2: twice at once
        for _ in range(int(times)):
            sig = getattr(signal, name)
            os.killpg(os.getpgid(0), sig) if sys.argv[3] == "group" else os.kill(os.getpid(), sig)
    return clip(*args, **kwargs)


torch.nn.utils.clip_grad_norm_ = clip_then_signal
train(TrainConfig(**json.loads(sys.argv[1])))
"""


def _signalled(run_inputs, out: Path, kw: dict, signame: str, to: str, step: int,
               timeout: int = 300) -> subprocess.CompletedProcess:
    """`train` on `_cfg(run_inputs, out, **kw)` in a child of its own session, sent `signame`
    (or "RAISE": an uncaught error) during step `step`, to itself or to its process group."""
    script = out.parent / f"terminator-{out.name}.py"
    script.write_text(TERMINATOR)
    return subprocess.run([sys.executable, str(script),
                           json.dumps(to_dict(_cfg(run_inputs, out, **kw))), signame, to,
                           str(step)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


@pytest.mark.parametrize("signame,to,workers", [("SIGTERM", "process", 0),
                                                 ("SIGINT", "process", 0),
                                                 ("SIGTERM", "group", 2),
                                                 ("SIGINT", "group", 2)])
def test_a_signal_saves_the_step_it_is_on_and_the_run_resumes_exactly(run_inputs, tmp_path,
                                                                     signame, to, workers):
    """SIGTERM (a preempted job, a lease's end) or Ctrl-C mid-step: that step is finished and
    saved (no save was due before step 100), the process exits 128 + the signal, and the same
    command resumes to the weights of a run never stopped. Sent to the whole process group
    (`kill -- -PGID`, Ctrl-C in a terminal) it is the same: the loader's reading threads,
    which must outlive the step, never receive it."""
    kw = dict(max_steps=6, save_every=100, eval_every=100, lm_head="target", num_workers=workers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float sums depend on the thread count: one, like the child
    try:
        train(_cfg(run_inputs, tmp_path / "whole", **kw))
        stopped = tmp_path / "stopped"
        proc = _signalled(run_inputs, stopped, kw, signame, to, 3)
        assert proc.returncode == 128 + getattr(signal, signame), proc.stderr[-3000:]
        assert f"stopped by {signame} after step 3 of 6" in proc.stderr
        assert checkpoint.read_pointer(stopped, "last").name == "step-00000003"
        assert not json.loads((stopped / "eyas.json").read_text())["complete"]
        train(_cfg(run_inputs, stopped, **kw))  # the same command: resumed
    finally:
        torch.set_num_threads(threads)
    a, b = _weights(tmp_path / "whole", 6), _weights(stopped, 6)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ"
    assert [r["step"] for r in _records(stopped, "train")] == list(range(1, 7))
    # the handlers are the caller's again once train() returns
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_stop_between_logging_steps_logs_its_step(run_inputs, tmp_path):
    """--log-every 4, SIGTERM during step 3 of 6: the stop logs steps 1-3 as step 3's line,
    the resumed run logs 4 and 6, and together they count every token the whole run counts."""
    kw = dict(max_steps=6, save_every=100, eval_every=100, lm_head="target", log_every=4)
    train(_cfg(run_inputs, tmp_path / "whole", **kw))
    stopped = tmp_path / "stopped"
    proc = _signalled(run_inputs, stopped, kw, "SIGTERM", "process", 3)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert [r["step"] for r in _records(stopped, "train")] == [3]
    train(_cfg(run_inputs, stopped, **kw))
    assert [r["step"] for r in _records(stopped, "train")] == [3, 4, 6]
    assert [r["step"] for r in _records(tmp_path / "whole", "train")] == [4, 6]
    assert sum(r["tokens"] for r in _records(stopped, "train")) == \
        sum(r["tokens"] for r in _records(tmp_path / "whole", "train"))
    # the resumed part's seconds go on from the stopped part's (not from 0 again)
    elapsed = [r["elapsed_s"] for r in _records(stopped, "train")]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0


def test_the_same_signal_twice_at_once_is_one_request_to_stop(run_inputs, tmp_path):
    """A scheduler's SIGTERM that reaches a rank directly and again through torchrun (which
    passes on what it gets), or Ctrl-C from the terminal and torchrun's SIGTERM after it: the
    step is still saved, as for one signal, where a second signal acting at once killed the
    process unsaved."""
    kw = dict(max_steps=6, save_every=100, eval_every=100, lm_head="target")
    out = tmp_path / "stopped"
    proc = _signalled(run_inputs, out, kw, "SIGTERM*2", "process", 3)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "stopped by SIGTERM after step 3 of 6" in proc.stderr
    assert checkpoint.read_pointer(out, "last").name == "step-00000003"


def test_a_stop_on_an_eval_step_saves_first_and_the_resumed_run_evaluates_it(run_inputs,
                                                                            tmp_path):
    """SIGTERM during step 3 of 6 with --eval-every 3: the step is saved without its eval
    (torchrun allows a rank 30 s after a SIGTERM; an eval on a real eval split can take
    longer), and the resumed run evaluates step 3 before step 4, so that its evals, best
    checkpoint and weights are those of a run never stopped."""
    kw = dict(max_steps=6, save_every=100, eval_every=3, lm_head="target")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float sums depend on the thread count: one, like the child
    try:
        whole = train(_cfg(run_inputs, tmp_path / "whole", **kw))
        stopped = tmp_path / "stopped"
        proc = _signalled(run_inputs, stopped, kw, "SIGTERM", "process", 3)
        assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
        assert [r["step"] for r in _records(stopped, "eval")] == [0]  # step 3's: not run
        # resumed, and stopped again during step 4: step 3's eval ran first and made step 3
        # the best (above step 0's); step 4's save records it, step 3's folder kept
        proc = _signalled(run_inputs, stopped, kw, "SIGTERM", "process", 1)
        assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
        assert [r["step"] for r in _records(stopped, "eval")] == [0, 3]
        assert checkpoint.read_pointer(stopped, "best").name == "step-00000003"
        resumed = train(_cfg(run_inputs, stopped, **kw))
    finally:
        torch.set_num_threads(threads)
    evals = _records(stopped, "eval")
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert [r["chain"] for r in evals] == [r["chain"] for r in _records(tmp_path / "whole",
                                                                        "eval")]
    assert resumed["best"] == whole["best"]
    assert checkpoint.read_pointer(stopped, "best").name == \
        checkpoint.read_pointer(tmp_path / "whole", "best").name
    a, b = _weights(tmp_path / "whole", 6), _weights(stopped, 6)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ"


REPEATER = """
import os, signal, sys, time
from eyas.draft.processes import StopOnSignal

StopOnSignal.REPEAT_S = 0.5
stop = StopOnSignal()
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGINT)  # within REPEAT_S: the same request
print("asked", stop.signum, flush=True)
time.sleep(0.8)
os.kill(os.getpid(), signal.SIGTERM)  # a second request: acts at once
time.sleep(10)
print("still here", flush=True)
"""


def test_a_second_signal_after_the_repeat_window_stops_at_once(tmp_path):
    script = tmp_path / "repeater.py"
    script.write_text(REPEATER)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.split() == ["asked", str(int(signal.SIGTERM))]
    assert "SIGINT 0.0 s after the first signal: the same request" in proc.stderr


def test_a_signal_during_the_last_step_ends_the_process_after_a_complete_run(run_inputs,
                                                                           tmp_path):
    """The run is complete and saved, but the signal is not swallowed: the process exits
    128 + it, so that `eyas run` does not go on to the next stage."""
    kw = dict(max_steps=4, save_every=100, eval_every=100, lm_head="target")
    out = tmp_path / "run"
    proc = _signalled(run_inputs, out, kw, "SIGTERM", "process", 4)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert "SIGTERM came during the last step" in proc.stderr
    assert json.loads((out / "eyas.json").read_text())["complete"]
    assert checkpoint.read_pointer(out, "last").name == "step-00000004"


def test_an_error_with_workers_ends_the_process(run_inputs, tmp_path):
    """An error nothing catches, with the loader's reading threads under way: the process
    still exits (non-zero) instead of hanging at exit on threads a kept traceback holds."""
    kw = dict(max_steps=6, save_every=100, eval_every=100, lm_head="target", num_workers=2)
    proc = _signalled(run_inputs, tmp_path / "run", kw, "RAISE", "process", 2, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "RuntimeError: step failed" in proc.stderr


def test_stop_on_signal_keeps_an_ignored_signal_ignored_and_restores_a_foreign_handler():
    """SIGINT ignored by whoever started the job (`cmd &` in a script) stays ignored; a
    handler set outside Python (getsignal gives None) comes back as the default."""
    from eyas.draft.processes import StopOnSignal

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop = StopOnSignal()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._ask
        stop._old[signal.SIGTERM] = None  # as signal.signal reports a C-level handler
        stop.restore()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_the_data_loaders_threads_outlive_a_stop_meant_for_the_loop(run_inputs):
    """SIGTERM / SIGINT sent to the process while loader threads read ahead reach only the
    main thread's handler (the loop's, which saves the step): the loop still gets every batch
    it asks for, the same batches in the same order as reading each when asked for."""
    source = data.OfflineSource(run_inputs["captured"])
    plan = [[[i]] for i in range(len(source.lengths))] * 4
    seen = []
    old = {s: signal.signal(s, lambda n, f: seen.append(n))
           for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        it = data_loader.loader(source, plan, 256, torch.float32, num_workers=2,
                                pin_memory=False)
        got = [next(it), next(it)]
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        got += list(it)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert sorted(seen) == sorted([signal.SIGTERM, signal.SIGINT])
    want = list(data_loader.loader(source, plan, 256, torch.float32, num_workers=0,
                                   pin_memory=False))
    assert len(got) == len(want) == len(plan)
    for a, b in zip(got, want):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_loader_threads_error_reaches_the_loop_and_closing_waits_for_its_reads(run_inputs):
    source = data.OfflineSource(run_inputs["captured"])
    plan = [[[i]] for i in range(len(source.lengths))]
    it = data_loader.loader(source, plan + [[[len(source.lengths) + 7]]], 256, torch.float32,
                            num_workers=2, pin_memory=False)
    with pytest.raises(IndexError):
        list(it)  # the bad id's batch fails in a thread; its error is the loop's
    it = data_loader.loader(source, plan, 256, torch.float32, num_workers=2, pin_memory=False)
    next(it)
    it.close()  # e.g. a stopped run's: the reads under way end, none begins
    assert not it.pending and it.pool._shutdown
    assert next(it, None) is None  # a closed loader is exhausted
    it.close()
    it.__del__()  # and its collection is quiet


def test_each_reader_thread_gets_its_share_of_the_intra_op_threads(run_inputs):
    """Reader threads share this process's intra-op threads with the training loop: on the
    H200's 16-core host two readers of 5 read Llama-8B-wide fp8 batches 2x as fast as two of 1
    (session 26); on two cores each keeps one, as a DataLoader worker process had."""
    source = data.OfflineSource(run_inputs["captured"])
    plan = [[[i]] for i in range(len(source.lengths))]

    class Seen(data_loader.MicroBatches):  # the intra-op threads each read ran on
        threads: list = []

        def __getitem__(self, k):
            self.threads.append(torch.get_num_threads())
            return super().__getitem__(k)

    before = torch.get_num_threads()
    torch.set_num_threads(6)
    try:
        assert [data_loader.reader_threads(n) for n in (1, 2, 5, 6)] == [3, 2, 1, 1]
        for intra, want in ((None, 2), (1, 1), (4, 4)):
            Seen.threads = []
            it = data_loader.Prefetch(Seen(source, plan, 256, torch.float32), 2, False,
                                      intra_threads=intra)
            assert len(list(it)) == len(plan)
            assert Seen.threads == [want] * len(plan)
        assert torch.get_num_threads() == 6  # the loop's own pool is left as it was
    finally:
        torch.set_num_threads(before)


def _resume_after_sigkill(run_inputs, tmp_path, kw):
    # float sums depend on the thread count: all three runs use one thread, like the child
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _three_runs(run_inputs, tmp_path, kw)
    finally:
        torch.set_num_threads(threads)


def _three_runs(run_inputs, tmp_path, kw):
    whole = tmp_path / "whole"
    train(_cfg(run_inputs, whole, **kw, num_workers=1))
    killed = tmp_path / "killed"
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    cfg = to_dict(_cfg(run_inputs, killed, **kw))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), json.dumps(cfg), "4"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert checkpoint.read_pointer(killed, "last").name == "step-00000004"
    assert not checkpoint.step_dir(killed, 5).exists()
    train(_cfg(run_inputs, killed, **kw))  # --resume auto
    a, b = _weights(whole, 6), _weights(killed, 6)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ"
    ra, rb = _records(whole, "train"), _records(killed, "train")
    assert [r["step"] for r in rb] == list(range(1, 7))  # no step logged twice
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    assert _records(whole, "eval") == _records(killed, "eval")
    sa = torch.load(checkpoint.step_dir(whole, 6) / "trainer_state.pt", weights_only=True)
    sb = torch.load(checkpoint.step_dir(killed, 6) / "trainer_state.pt", weights_only=True)
    assert sa["data_position"] == sb["data_position"] == 12
    assert sa["best"] == sb["best"]


def test_online_training_equals_offline(run_inputs, tmp_path):
    kw = dict(max_steps=2, lm_head="target", eval_every=2)
    offline = train(_cfg(run_inputs, tmp_path / "offline", **kw))
    online = train(_cfg(run_inputs, tmp_path / "online", **kw, online=True,
                        data=run_inputs["prepared"], target=run_inputs["target"]))
    first_off, first_on = _records(tmp_path / "offline", "train")[0], \
        _records(tmp_path / "online", "train")[0]
    assert first_on["positions"] == first_off["positions"] > 0
    assert first_on["loss"] == pytest.approx(first_off["loss"], rel=1e-4)
    assert online["eval"]["loss"] == pytest.approx(offline["eval"]["loss"], rel=1e-3)
    a, b = _weights(tmp_path / "offline", 2), _weights(tmp_path / "online", 2)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------------- refusals


def test_refuses_mismatched_inputs_with_the_fix(run_inputs, tmp_path, monkeypatch, caplog):
    # a vocab folder made for another target
    other_vocab = tmp_path / "vocab"
    shutil.copytree(run_inputs["vocab"], other_vocab)
    man = json.loads((other_vocab / "eyas.json").read_text())
    man["target"]["hidden_size"] = 4096
    (other_vocab / "eyas.json").write_text(json.dumps(man))
    with pytest.raises(EyasError, match=r"`eyas prepare --target .*`, then `eyas vocab` on "
                                        r"that folder: vocab has no --target"):
        train(_cfg(run_inputs, tmp_path / "r1", vocab=str(other_vocab)))
    # an eval capture of other aux layers
    other = tmp_path / "captured"
    shutil.copytree(run_inputs["captured"], other)
    man = json.loads((other / "eyas.json").read_text())
    man["aux_layer_ids"] = [1, 3, 5]
    (other / "eyas.json").write_text(json.dumps(man))
    with pytest.raises(EyasError, match=r"aux layers \[1, 3, 5\].*--aux-layer-ids 2,4,5"):
        train(_cfg(run_inputs, tmp_path / "r2", eval_data=str(other)))
    # a prepared folder where a capture folder belongs
    with pytest.raises(EyasError, match="eyas capture"):
        train(_cfg(run_inputs, tmp_path / "r3", data=run_inputs["prepared"]))
    # an attention kernel that does not exist: refused before anything loads
    monkeypatch.setenv("EYAS_ATTENTION", "flash2")
    with pytest.raises(EyasError, match="EYAS_ATTENTION='flash2': expected auto, fa4 or cudnn"):
        train(_cfg(run_inputs, tmp_path / "r3b"))
    assert not (tmp_path / "r3b").exists()
    monkeypatch.delenv("EYAS_ATTENTION")
    # a batch smaller than the longest sample: the length and the flags to change
    with pytest.raises(EyasError, match=r"has \d+ tokens but a packed row holds only 32"):
        train(_cfg(run_inputs, tmp_path / "r4", batch_tokens=32))
    with caplog.at_level(logging.WARNING, logger="eyas.draft.data_plan"):
        train(_cfg(run_inputs, tmp_path / "r5", batch_tokens=32, truncate=True, max_steps=1))
    cut = json.loads((tmp_path / "r5" / "eyas.json").read_text())["truncated"]["train"]
    assert 0 < cut["samples"] <= cut["of_samples"] and cut["longest"] > 32
    assert re.search(rf"--truncate: {cut['samples']} of the {cut['of_samples']} train samples "
                     rf"are longer than a row of 32 tokens and are cut to it: "
                     rf"{cut['tokens_cut']} of their split's {cut['of_tokens']} tokens "
                     rf"\([0-9.]+ %\) are not trained on; --batch-tokens \(or --row-tokens\) "
                     rf"{cut['longest']} keeps every one whole", caplog.text)
    # resuming with other batching would silently change the data order: refused
    # (and names what changed, from the run's eyas.json: it used to list every such flag)
    with pytest.raises(EyasError, match=r"other data or batching than this command's: "
                                        r"--batch-tokens 32 then, 64 now\. Resume with the "
                                        r"values it was started with"):
        train(_cfg(run_inputs, tmp_path / "r5", batch_tokens=64, truncate=True, max_steps=2))
    # left out, they are the run's own (as the recipe's are): it resumed at today's defaults
    # (--batch-tokens 8192, no --truncate) and was refused
    with caplog.at_level(logging.INFO, logger="eyas.train"):
        train(_cfg(run_inputs, tmp_path / "r5", batch_tokens=None, max_steps=2))
    assert re.search(r"resuming .*r5 with the recipe it was started with for the options not "
                     r"given here \(--batch-tokens 32, .*--truncate\b", caplog.text)
    assert "--truncate True" not in caplog.text  # (flags as they are written)
    assert [r["step"] for r in _records(tmp_path / "r5", "train")] == [1, 2]


def test_refuses_captures_of_other_weights_unless_accepted(run_inputs, tmp_path):
    # the same tiny target with one projection changed, as a fine-tune of it would be
    tuned = tmp_path / "tuned"
    shutil.copytree(run_inputs["target"], tuned)
    weights = load_file(str(tuned / "model.safetensors"))
    weights["model.layers.1.self_attn.q_proj.weight"] *= 1.01
    save_file(weights, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(EyasError, match=r"the capture .* was made with the weights of .*target "
                                        r".*tuned has the same tokenizer and shape but other "
                                        r"weights.*--accept-other-weights"):
        train(_cfg(run_inputs, tmp_path / "r1", target=str(tuned)))
    assert not (tmp_path / "r1").exists()
    train(_cfg(run_inputs, tmp_path / "r2", target=str(tuned), accept_other_weights=True,
               max_steps=1))


@pytest.mark.parametrize("kw, match", [
    (dict(row_tokens=100), "must divide"),
    (dict(freeze_lm_head=True, lm_head="scratch"), "random head"),
    (dict(online=True), "--online needs --target"),
    (dict(betas=(0.9,)), "two values"),
    (dict(aux_layer_ids=(1, 2, 3)), "--online only"),
    (dict(max_steps=0, epochs=0), "--epochs"),
    (dict(target_device_map="auto"), "--target-device-map applies to --online only"),
    (dict(online=True, target="t", target_device_map="gpus"), "must be one of auto"),
    (dict(cuda_graph=True, compile=True), "exclude each other"),
    (dict(cuda_graph=True, device="cpu"), "needs --device cuda"),
    (dict(loss="lk"), "--loss 'lk'"),
    (dict(loss="lk-lambda", lk_kl_scale=2.0), "--lk-kl-scale must be in"),
])
def test_config_errors_name_the_flag(kw, match):
    base = dict(data="d", out="o")
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**{**base, **kw})


def test_target_device_map_accepts_strategies_and_devices():
    for value in ("auto", "balanced_low_0", "sequential", "cuda:1", "cpu"):
        cfg = TrainConfig(data="d", out="o", online=True, target="t", target_device_map=value)
        assert cfg.target_device_map == value


def test_target_device_map_under_torchrun_is_refused_with_the_fix(run_inputs, tmp_path,
                                                                  monkeypatch):
    """Refused before joining a process group or loading anything: N ranks would each
    spread their own copy of the target over the same GPUs."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = _cfg(run_inputs, tmp_path / "run", online=True, data=run_inputs["prepared"],
               target=run_inputs["target"], target_device_map="auto", device="cpu")
    with pytest.raises(EyasError, match=r"WORLD_SIZE=2.*Run one process instead.*without "
                                        r"torchrun.*CUDA_VISIBLE_DEVICES"):
        train(cfg)
    assert not torch.distributed.is_initialized() and not (tmp_path / "run").exists()


def _has_accelerate() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


@pytest.mark.usefixtures("without_accelerate")
def test_target_device_map_without_accelerate_names_the_install(run_inputs, tmp_path):
    # transformers (5.x) refuses every device_map, even "cpu", without accelerate
    with pytest.raises(EyasError, match="needs the accelerate package.*pip install accelerate"):
        train(_cfg(run_inputs, tmp_path / "run", online=True, data=run_inputs["prepared"],
                   target=run_inputs["target"], target_device_map="cpu"))


def _cache_summary(caplog) -> dict:
    """The numbers of the --online-cache line train logs at its end."""
    import re

    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("--online-cache ("))
    m = re.search(r"(\d+) samples kept.* reads (\d+) from it, (\d+) by the target "
                  r"\((\d+) past the bound\)", line)
    return dict(zip(("kept", "hits", "misses", "refused"), map(int, m.groups())))


def _online_kw(run_inputs) -> dict:
    return dict(max_steps=0, epochs=3, batch_tokens=1024, lm_head="target", eval_every=4,
                online=True, data=run_inputs["prepared"], target=run_inputs["target"],
                device="cpu")


@pytest.fixture(scope="module")
def online_run(run_inputs, tmp_path_factory):
    """(result, folder) of three epochs online without a cache: what both bounds compare to
    (trained once: ~25 s here)."""
    folder = tmp_path_factory.mktemp("online") / "plain"
    return train(_cfg(run_inputs, folder, **_online_kw(run_inputs))), folder


@pytest.mark.parametrize("bound_gb", [0.0, 2e-4])
def test_online_cache_runs_the_target_once_per_sample(run_inputs, online_run, tmp_path, caplog,
                                                      bound_gb):
    """Three epochs online: with --online-cache the target runs once per sample (train and
    eval), later epochs and evals read what it kept, and the run equals one without the
    cache. Under a bound of a few samples (200 KB) the rest run the target each time, and the
    run is the same again. (Equal up to bf16 roundings: without the cache the target sees
    each sample again in other micro-batches, whose fp32 sums differ in the last bits.)"""
    kw = _online_kw(run_inputs)
    plain, plain_dir = online_run
    caplog.set_level(logging.INFO, logger="eyas")
    cached = train(_cfg(run_inputs, tmp_path / "cached", **kw, online_cache="cpu",
                        online_cache_gb=bound_gb))
    assert cached["steps"] == plain["steps"] >= 6
    got = _cache_summary(caplog)
    from eyas.store.prepared import load_split

    samples = len(load_split(run_inputs["prepared"], "all")[0])  # train and eval rows
    if bound_gb == 0:  # half the host's free memory: all of them
        assert got["kept"] == got["misses"] == samples and got["refused"] == 0
        assert got["hits"] >= 2 * (samples - 12)  # two more epochs of the train rows at least
    else:
        assert 0 < got["kept"] < samples and got["refused"] > 0
        assert got["misses"] > samples  # the rest ran the target again
    assert [r["loss"] for r in _records(tmp_path / "cached", "train")] == pytest.approx(
        [r["loss"] for r in _records(plain_dir, "train")], rel=1e-3)
    assert cached["eval"]["loss"] == pytest.approx(plain["eval"]["loss"], rel=1e-3)
    a, b = _weights(plain_dir, plain["steps"]), _weights(tmp_path / "cached", cached["steps"])
    for k in a:  # (15 steps at lr 1e-2 carry those last bits to ~3e-4)
        torch.testing.assert_close(a[k], b[k], rtol=1e-2, atol=1e-3)


def _same_bits(a: dict, b: dict) -> bool:
    """Two samples' tensors bitwise equal (fp8 compared as bytes: torch.equal has no fp8 on
    the CPU)."""
    def bits(v):
        return v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def test_online_cache_fp8_equals_an_fp8_capture(run_inputs, tmp_path):
    """--online-cache-dtype fp8 hands out the numbers `eyas capture --dtype fp8` stores, from
    the target's first pass on, and the same numbers again from the cache; a run trains on
    them (its first step as offline training on such a capture, not as on bf16 states)."""
    from eyas.capture import CaptureConfig, capture
    from eyas.draft.online_cache import StateCache
    from eyas.store.prepared import load_split
    from eyas.store.shards import dequantize_fp8
    from eyas.targets.models import load_target

    fp8 = tmp_path / "captured-fp8"
    capture(CaptureConfig(target=run_inputs["target"], data=run_inputs["prepared"],
                          out=str(fp8), split="all", model_dtype="fp32", dtype="fp8",
                          batch_tokens=2048))
    offline = data.OfflineSource(fp8)
    model, info = load_target(run_inputs["target"], dtype="fp32", device=torch.device("cpu"))
    dataset, _ = load_split(run_inputs["prepared"], "all")
    online = data.OnlineSource(model, info, dataset, tuple(offline.manifest["aux_layer_ids"]),
                               cache=StateCache(torch.device("cpu"), "fp8", 10**9))
    # capture orders samples by its batches: the offline sample of each prepared row
    number = {int(r): i for i, r in enumerate(offline.capture.sample_index.tolist())}
    rows = list(range(0, len(dataset), 3))
    first, again = online.fetch(rows), online.fetch(rows)
    stored = offline.fetch([number[r] for r in rows])
    assert online.cache.misses == len(rows) and online.cache.hits == len(rows)
    for a, b, c in zip(first, again, stored):
        assert a["aux_hidden"].dtype == c["aux_hidden"].dtype == torch.float8_e4m3fn
        assert _same_bits(a, b)  # the cache's copy, unchanged
        for k in ("input_ids", "target_top1", "loss_mask"):
            assert torch.equal(a[k], c[k])
        # one micro-batch's forward against the capture's larger batch: the last bits of
        # fp32 may differ, so the row scales differ in theirs and a rare element lands in
        # the next fp8 step
        codes = a["aux_hidden"].view(torch.uint8) == c["aux_hidden"].view(torch.uint8)
        assert codes.float().mean() > 0.95  # (98 % here)
        torch.testing.assert_close(a["aux_scale"], c["aux_scale"], rtol=1e-2, atol=0)
        x, y = (dequantize_fp8(s["aux_hidden"], s["aux_scale"], torch.float32) for s in (a, c))
        torch.testing.assert_close(x, y, rtol=0.13, atol=1e-3)  # (e4m3's step: 1/8)
        torch.testing.assert_close(a["final_hidden"], c["final_hidden"])
    # the assistant's positions: with the prompts' too (the default), the states' rare
    # differing fp8 codes (above) moved online's first loss from offline's by 1.1e-4 of it
    kw = dict(max_steps=1, batch_tokens=1024, lm_head="target", device="cpu",
              loss_mask_at="input")
    runs = {"offline": dict(data=str(fp8)), "bf16": {},
            "online": dict(online=True, data=run_inputs["prepared"], target=run_inputs["target"],
                           online_cache="gpu", online_cache_dtype="fp8")}
    loss = {k: _records(train(_cfg(run_inputs, tmp_path / k, **kw, **v)) and tmp_path / k,
                        "train")[0]["loss"] for k, v in runs.items()}
    assert loss["online"] == pytest.approx(loss["offline"], rel=3e-5)
    assert loss["online"] != pytest.approx(loss["bf16"], rel=1e-4)  # fp8's rounding is there


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["gpu", "cpu"])
def test_online_cache_on_a_gpu(run_inputs, tmp_path, caplog, where):
    """On a GPU: fp8 states kept on the target's GPU, or in host memory and moved back per
    micro-batch, train as the run without the cache does (its first step to fp8's rounding)."""
    kw = dict(max_steps=0, epochs=2, batch_tokens=1024, lm_head="target", eval_every=4,
              online=True, data=run_inputs["prepared"], target=run_inputs["target"],
              device="cuda", lr=1e-3)
    plain = train(_cfg(run_inputs, tmp_path / "plain", **kw))
    caplog.set_level(logging.INFO, logger="eyas")
    cached = train(_cfg(run_inputs, tmp_path / where, **kw, online_cache=where,
                        online_cache_dtype="fp8"))
    got = _cache_summary(caplog)
    assert got["hits"] > 0 and got["refused"] == 0
    assert cached["steps"] == plain["steps"]
    first = [_records(tmp_path / k, "train")[0]["loss"] for k in ("plain", where)]
    assert first[1] == pytest.approx(first[0], rel=1e-2)
    assert cached["eval"]["loss"] == pytest.approx(plain["eval"]["loss"], rel=1e-2)


def test_online_cache_flags_are_refused_offline():
    # (and a resumed run keeps the dtype it started with unless given again: fp8 to the end)
    unset = TrainConfig(data="p", out="r", online=True, target="t", online_cache="gpu")
    assert unset.online_cache_dtype == "bf16" and "online_cache_dtype" in unset._unset
    with pytest.raises(ConfigError, match="apply to --online only"):
        TrainConfig(data="c", out="r", online_cache="gpu")
    with pytest.raises(ConfigError, match="--online-cache-gb must be >= 0"):
        TrainConfig(data="p", out="r", online=True, target="t", online_cache="cpu",
                    online_cache_gb=-1)


@pytest.mark.skipif(not _has_accelerate(), reason="device_map needs accelerate")
@pytest.mark.usefixtures("one_thread")  # many tiny forwards: faster on a shared CPU
def test_online_with_target_device_map_equals_online(run_inputs, tmp_path, monkeypatch):
    """The target placed by transformers/accelerate ("auto": on a CPU box all on cpu; "cpu":
    one device) trains exactly like the target moved to the draft's device. Spreading over
    several GPUs needs GPUs: not this test."""
    import eyas.targets.models

    real, calls = eyas.targets.models.load_target, []

    def load_target(*args, **kwargs):  # the real loader; records what train asked of it
        calls.append({k: kwargs.get(k) for k in ("device_map", "device")})
        return real(*args, **kwargs)

    monkeypatch.setattr(eyas.targets.models, "load_target", load_target)
    kw = dict(max_steps=1, lm_head="target", online=True, data=run_inputs["prepared"],
              target=run_inputs["target"], device="cpu")
    plain = train(_cfg(run_inputs, tmp_path / "plain", **kw))
    first_plain = _records(tmp_path / "plain", "train")[0]
    for device_map in ("auto", "cpu"):
        mapped = train(_cfg(run_inputs, tmp_path / device_map, **kw, target_device_map=device_map))
        first = _records(tmp_path / device_map, "train")[0]
        assert first["positions"] == first_plain["positions"] > 0
        assert first["loss"] == pytest.approx(first_plain["loss"], rel=1e-5)
        assert mapped["eval"]["loss"] == pytest.approx(plain["eval"]["loss"], rel=1e-5)
    assert calls == [{"device_map": None, "device": torch.device("cpu")},
                     {"device_map": "auto", "device": None},
                     {"device_map": "cpu", "device": None}]


def test_offloaded_target_weight_is_refused_with_the_fix():
    """accelerate leaves a weight it offloaded to cpu/disk on the meta device."""
    with pytest.raises(EyasError, match="offloaded the target's lm_head.*CUDA_VISIBLE_DEVICES"):
        data._resident(torch.empty(4, 2, device="meta"), "lm_head", "auto")
    weight = torch.nn.Parameter(torch.ones(4, 2))
    kept = data._resident(weight, "embedding", "auto")
    assert not kept.requires_grad and kept.data_ptr() == weight.data_ptr()


def test_cli_builds_the_config():
    from eyas.cli import parse_config

    cfg = parse_config("train", ["--data", "c", "--out", "r", "--betas", "0.9,0.95",
                                 "--parallel", "fsdp", "--no-truncate", "--max-steps", "5"])
    assert cfg.betas == (0.9, 0.95) and cfg.parallel == "fsdp" and cfg.max_steps == 5
    cfg = parse_config("train", ["--data", "p", "--out", "r", "--online", "--target", "t",
                                 "--target-device-map", "auto"])
    assert cfg.online and cfg.target_device_map == "auto"


def test_lk_loss_trains_through_the_cli_and_is_recorded(run_inputs, tmp_path):
    """`eyas train --loss lk-lambda` through the whole loop: the loss falls, the objective is
    in the manifest, the checkpoint is an ordinary draft (serving is unchanged)."""
    from eyas.cli import parse_config
    from eyas.store.manifest import read_manifest

    run = tmp_path / "run"
    cfg = parse_config("train", ["--data", str(run_inputs["captured"]), "--vocab",
                                 str(run_inputs["vocab"]), "--out", str(run),
                                 "--loss", "lk-lambda", "--lk-kl-decay", "2"])
    assert (cfg.loss, cfg.lk_kl_scale, cfg.lk_kl_decay) == ("lk-lambda", 1.0, 2.0)
    train(_cfg(run_inputs, run, loss=cfg.loss, lk_kl_decay=cfg.lk_kl_decay, max_steps=8))
    rows = _records(run, "train")
    assert rows[-1]["loss"] < rows[0]["loss"]
    config = read_manifest(run, step="train")["config"]
    assert (config["loss"], config["lk_kl_decay"]) == ("lk-lambda", 2.0)
    assert "fc.weight" in _weights(run, 8)


def test_loss_on_every_position_trains_on_the_prompts_too(run_inputs, tmp_path):
    """`--loss-mask-at all` through the whole loop: the same steps carry a loss on more
    positions than speculators' `input` (the prompt's and the template's too), the loss falls,
    the in-loop eval still scores eyas's positions (the same count for both runs, so they
    compare), and the manifest records the choice."""
    from eyas.cli import parse_config
    from eyas.store.manifest import read_manifest

    cfg = parse_config("train", ["--data", str(run_inputs["captured"]), "--vocab",
                                 str(run_inputs["vocab"]), "--out", str(tmp_path / "x"),
                                 "--loss-mask-at", "all"])
    assert cfg.loss_mask_at == "all"
    runs = {m: tmp_path / m for m in ("input", "all")}
    for mask_at, run in runs.items():
        train(_cfg(run_inputs, run, loss_mask_at=mask_at, max_steps=6, eval_every=3))
    rows = {m: _records(run, "train") for m, run in runs.items()}
    evals = {m: _records(run, "eval") for m, run in runs.items()}
    assert len(rows["all"]) >= 2 and evals["all"]
    assert [r["step"] for r in rows["all"]] == [r["step"] for r in rows["input"]]
    assert all(a["positions"] > b["positions"] for a, b in zip(rows["all"], rows["input"]))
    assert rows["all"][-1]["loss"] < rows["all"][0]["loss"]
    assert [e["positions"] for e in evals["all"]] == [e["positions"] for e in evals["input"]]
    assert read_manifest(runs["all"], step="train")["config"]["loss_mask_at"] == "all"


def test_training_on_an_fp8_capture_reads_ahead_to_the_same_run(run_inputs, tmp_path):
    """An fp8 capture's aux states reach the step through the reading threads and on_device
    (dequantized there, not on the host): the run is the one that reads each batch when
    asked, weight for weight, and close to the bf16 capture's."""
    from eyas.capture import CaptureConfig, capture

    fp8 = tmp_path / "captured-fp8"
    capture(CaptureConfig(target=run_inputs["target"], data=run_inputs["prepared"],
                          out=str(fp8), split="all", model_dtype="fp32", batch_tokens=2048,
                          dtype="fp8"))
    runs = {}
    for name, kw in (("fp8-threads", dict(data=str(fp8), num_workers=2)),
                     ("fp8-inline", dict(data=str(fp8), num_workers=0)),
                     ("bf16", {})):
        train(_cfg(run_inputs, tmp_path / name, max_steps=4, save_every=4, **kw))
        runs[name] = _weights(tmp_path / name, 4)
    for k in runs["bf16"]:
        assert torch.equal(runs["fp8-threads"][k], runs["fp8-inline"][k]), k
    near = [float((runs["fp8-threads"][k] - runs["bf16"][k]).abs().max())
            for k, v in runs["bf16"].items() if v.is_floating_point()]
    assert 0 < max(near) < 0.05, near  # other inputs (e4m3 aux), the same run otherwise


def test_fp8_training_tracks_fp32(run_inputs, tmp_path):
    """`eyas train --precision fp8` through the whole loop (on CPU the real fp8 products run,
    slowly): every logged loss within 5 % of the fp32 run on the same data, and a checkpoint
    of fp32 master weights that export reads."""
    runs = {}
    for precision in ("fp32", "fp8"):
        run = tmp_path / precision
        train(_cfg(run_inputs, run, max_steps=4, precision=precision))
        runs[precision] = [r["loss"] for r in _records(run, "train")]
    assert len(runs["fp8"]) == len(runs["fp32"]) == 4
    assert runs["fp8"] != runs["fp32"]  # the fp8 products really ran
    for fp8_loss, fp32_loss in zip(runs["fp8"], runs["fp32"]):
        assert abs(fp8_loss / fp32_loss - 1) < 0.05, runs
    weights = _weights(tmp_path / "fp8", 4)
    assert weights["fc.weight"].dtype == torch.float32



def test_a_torn_metrics_line_does_not_stop_a_resume(tmp_path, caplog):
    """A crash or power loss can leave half a line at the end of metrics.jsonl: the resume
    drops it with a warning (it ended in a JSONDecodeError traceback)."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"kind": "train", "step": 1, "loss": 3.0}\n{"kind": "train", "step": 2, "lo')
    log = checkpoint.MetricsLog(tmp_path, resume_step=1)
    log.close()
    assert [json.loads(ln)["step"] for ln in
            (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert "an unreadable line dropped on resume" in caplog.text


def test_metrics_go_to_jsonl_and_tensorboard_and_resume_drops_lost_steps(tmp_path):
    """metrics.jsonl and TensorBoard get the same scalars (lists as one scalar per TTT step);
    after a kill at step 3 the records of steps 4-5 are dropped from both."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = checkpoint.MetricsLog(tmp_path, resume_step=0)
    for step in range(1, 6):
        first.write({"kind": "train", "step": step, "loss": 10.0 - step, "acc": [0.1, 0.2]})
    first.close()
    again = checkpoint.MetricsLog(tmp_path, resume_step=3)  # the run resumes after step 3
    for step in (4, 5):
        again.write({"kind": "train", "step": step, "loss": 100.0 + step, "acc": [0.3, 0.4]})
    again.close()
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0),
                                                      (5, 105.0)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/acc_0", "train/acc_1"} <= set(events.Tags()["scalars"])
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0), (5, 105.0)]
    assert [e.value for e in events.Scalars("train/acc_1")][-1] == pytest.approx(0.4)


def test_a_resumed_runs_elapsed_seconds_go_on_from_the_kept_records(tmp_path):
    """elapsed_s counts the training's seconds from its first step: a resume starts from the
    last train record it keeps (a record of a step lost with a kill does not count)."""
    assert checkpoint.MetricsLog(tmp_path, resume_step=0).elapsed_before == 0.0
    first = checkpoint.MetricsLog(tmp_path, resume_step=0)
    for step, seconds in ((1, 4.5), (2, 9.25), (3, 14.0)):
        first.write({"kind": "train", "step": step, "elapsed_s": seconds})
    first.write({"kind": "eval", "step": 2})
    first.close()
    assert checkpoint.MetricsLog(tmp_path, resume_step=2).elapsed_before == 9.25
    assert checkpoint.MetricsLog(tmp_path, resume_step=0).elapsed_before == 0.0  # started over


def test_a_resume_that_reruns_its_steps_eval_drops_an_earlier_record_of_it(tmp_path):
    """A stop on eval step 3 left the eval to the resumed run; that run evaluated step 3 and
    was killed during step 4, before any save: the next resume runs step 3's eval again, so
    the earlier record of it goes (the train record of step 3 stays)."""
    first = checkpoint.MetricsLog(tmp_path, resume_step=0)
    for record in ({"kind": "eval", "step": 0}, {"kind": "train", "step": 3},
                   {"kind": "eval", "step": 3}, {"kind": "train", "step": 4}):
        first.write(record)
    first.close()
    checkpoint.MetricsLog(tmp_path, resume_step=3).close()  # the eval of step 3 was saved
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0), ("train", 3), ("eval", 3)]
    checkpoint.MetricsLog(tmp_path, resume_step=3, eval_due=True).close()
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0), ("train", 3)]


def _compiled_training_matches_eager(run_inputs, tmp_path):
    """`--compile` (torch.compile of the TTT module, graph breaks at the host sync and the
    custom kernels) trains to the same losses as eager."""
    from torch._dynamo.utils import counters

    losses, graphs = {}, {}
    for compiled in (False, True):
        run = tmp_path / f"compile-{compiled}"
        before = counters["stats"]["unique_graphs"]
        train(_cfg(run_inputs, run, max_steps=3, compile=compiled))
        graphs[compiled] = counters["stats"]["unique_graphs"] - before
        losses[compiled] = [r["loss"] for r in _records(run, "train")]
    assert graphs[False] == 0 and graphs[True] > 0  # it really compiled
    # compiled, the embedding shares use autograd's sum, not _AddShare (a break per step)
    assert not any("_GradSum" in reason for reason in counters["graph_break"])
    assert len(losses[True]) == 3
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-4)


def test_compiled_training_matches_eager(run_inputs, tmp_path, monkeypatch):
    """The same with the module compiled for torch's `aot_eager` backend: dynamo's graphs,
    their breaks and AOT autograd exactly as `--compile` makes them, without inductor's CPU
    code generation (a minute of C++ compiling on 2 cores; on a GPU inductor writes Triton,
    which the CPU cannot run anyway). Inductor itself: the slow test below."""
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: compile_module(self, **{"backend": "aot_eager", **kw}))
    _compiled_training_matches_eager(run_inputs, tmp_path)


@pytest.mark.slow
def test_compiled_training_with_inductor_matches_eager(run_inputs, tmp_path):
    _compiled_training_matches_eager(run_inputs, tmp_path)


def test_cuda_graph_needs_one_cuda_process(run_inputs, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(EyasError, match="--cuda-graph runs on one GPU"):
        train(_cfg(run_inputs, tmp_path / "run", cuda_graph=True))


@pytest.mark.gpu
def test_cuda_graph_training_matches_eager(run_inputs, tmp_path):
    """`--cuda-graph` (static plans, each micro-batch's forward + backward replayed) trains
    to the losses of eager training, over micro-batch accumulation and optimizer steps."""
    losses = {}
    for graph in (False, True):
        run = tmp_path / f"graph-{graph}"
        train(_cfg(run_inputs, run, max_steps=4, grad_accum=2, device="cuda", cuda_graph=graph))
        losses[graph] = [r["loss"] for r in _records(run, "train")]
    assert len(losses[True]) == 4
    np.testing.assert_allclose(losses[True], losses[False], rtol=2e-2)


def test_a_parameter_without_gradient_after_the_first_step_is_an_error():
    from eyas.draft.train_setup import check_gradients

    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    net[0](torch.ones(1, 2)).sum().backward()  # the second layer never sees a gradient
    with pytest.raises(EyasError, match=r"no gradient reached 2 trainable parameter\(s\).*"
                                        r"1\.weight, 1\.bias.*report this as an eyas bug"):
        check_gradients(net, TrainConfig(data="d", out="o"))
    net[1](torch.ones(1, 2)).sum().backward()
    check_gradients(net, TrainConfig(data="d", out="o"))
    # under --cuda-graph every .grad exists; the graph's record of what its warm-up reached
    from types import SimpleNamespace

    params = list(net.parameters())
    record = SimpleNamespace(params=params, unreached=[2, 3])  # GraphedTTT's two attributes
    with pytest.raises(EyasError, match=r"2 trainable parameter\(s\).*1\.weight, 1\.bias"):
        check_gradients(net, TrainConfig(data="d", out="o"), record)
    check_gradients(net, TrainConfig(data="d", out="o"), SimpleNamespace(params=params,
                                                                          unreached=[]))


def test_resume_on_another_vocab_is_refused_and_a_new_length_warned(run_inputs, tmp_path,
                                                                      caplog):
    """A killed run resumed with another --vocab of the same size mixed them: the checkpoint's
    d2t/t2d came back while the teacher head was built from the new vocab's rows. It is
    refused with the fix; a new --max-steps is allowed (a run may be lengthened) but warned
    about, since the learning rate jumps to the new schedule."""
    from eyas.prepare import PrepareConfig, prepare
    from eyas.targets.corpus import synthetic_chats
    from eyas.vocab import VocabConfig, vocab

    train(_cfg(run_inputs, tmp_path / "run", max_steps=2, save_every=2))
    chats = tmp_path / "other.jsonl"  # other conversations: other token counts
    chats.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(12, seed=7)))
    prepare(PrepareConfig(target=run_inputs["target"], data=(str(chats),),
                          out=str(tmp_path / "prepared"), max_length=256))
    vocab(VocabConfig(data=(str(tmp_path / "prepared"),), out=str(tmp_path / "vocab"),
                      draft_vocab_size=256))
    with pytest.raises(EyasError, match=r"another draft vocabulary than --vocab's.*--resume never"):
        train(_cfg(run_inputs, tmp_path / "run", max_steps=3, vocab=str(tmp_path / "vocab")))
    # resumed without --vocab (the whole target vocabulary, another size): the message names
    # the --vocab the run started with, and does not advise deleting it
    with pytest.raises(EyasError, match=r"draft_vocab_size 256 there, \d+ now.*Resume it with "
                                        rf"--vocab {re.escape(run_inputs['vocab'])}, or train a "
                                        r"new run in another --out"):
        train(_cfg(run_inputs, tmp_path / "run", max_steps=3, vocab=None))
    # its --vocab folder made again at another size since: said so, not "resume it with
    # --vocab" the folder just given
    train(_cfg(run_inputs, tmp_path / "run2", max_steps=2, save_every=2,
               vocab=str(tmp_path / "vocab")))
    vocab(VocabConfig(data=(str(tmp_path / "prepared"),), out=str(tmp_path / "vocab"),
                      draft_vocab_size=128))
    with pytest.raises(EyasError, match=rf"a --vocab of its 256 tokens \({re.escape(str(tmp_path))}"
                                        r"/vocab was made again since the run started"):
        train(_cfg(run_inputs, tmp_path / "run2", max_steps=3, vocab=str(tmp_path / "vocab")))
    # the same folder spelled another way (from an audit: "resume it with --vocab" that folder)
    other_spelling = os.path.relpath(tmp_path / "vocab")
    assert other_spelling != str(tmp_path / "vocab")
    with pytest.raises(EyasError, match=r"a --vocab of its 256 tokens .*was made again since"):
        train(_cfg(run_inputs, tmp_path / "run2", max_steps=3, vocab=other_spelling))
    with caplog.at_level(logging.WARNING):
        train(_cfg(run_inputs, tmp_path / "run", max_steps=3))
    assert "started with --max-steps 2, resumed with 3" in caplog.text
    assert checkpoint.read_pointer(tmp_path / "run", "last").name == "step-00000003"


def test_resume_of_a_draft_with_other_norms_names_the_flags(run_inputs, tmp_path):
    # a run started before EAGLE 3.1 became the default, resumed with today's defaults
    plain = dict(norm_before_fc=False, norm_output=False)
    train(_cfg(run_inputs, tmp_path, max_steps=2, save_every=2, **plain))
    with pytest.raises(EyasError, match=r"norm_before_fc False there, True now.*Resume it with "
                                        r"--no-norm-before-fc --no-norm-output"):
        train(_cfg(run_inputs, tmp_path, max_steps=3))
    train(_cfg(run_inputs, tmp_path, max_steps=3, **plain))  # as the message says
    assert checkpoint.read_pointer(tmp_path, "last").name == "step-00000003"


def test_a_run_started_under_the_previous_defaults_resumes_with_its_own_recipe(
        run_inputs, tmp_path, caplog):
    """eyas's defaults changed (issue 31: speculators' recipe); a run started before, resumed
    with no recipe flags, keeps the recipe it started with (its eyas.json) instead of being
    refused or changed halfway; a flag given on resume still wins."""
    from eyas.draft.train_config import PREVIOUS_RECIPE

    old = dict(PREVIOUS_RECIPE, lm_head="target", save_every=2)
    train(_cfg(run_inputs, tmp_path, max_steps=2, **old))
    with caplog.at_level(logging.INFO):
        train(_cfg(run_inputs, tmp_path, max_steps=4, lm_head="target", save_every=2))
    assert "with the recipe it was started with" in caplog.text
    rows = _records(tmp_path, "train")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(len(r["acc"]) == 7 for r in rows)
    config = json.loads((tmp_path / "eyas.json").read_text())["config"]
    assert {k: config[k] for k in PREVIOUS_RECIPE} == PREVIOUS_RECIPE
    # a recipe flag given on resume wins (and is warned about)
    train(_cfg(run_inputs, tmp_path, max_steps=5, lm_head="target", save_every=2,
               grad_clip=1.0))
    assert "--grad-clip 0.5 -> 1.0" in caplog.text


def test_a_resumed_run_keeps_every_option_it_was_started_with_and_applies_one_given(
        run_inputs, tmp_path, caplog):
    """From a review: a resume kept only the 11 recipe options of EAGLE3_RECIPE; --lr, --betas,
    --min-lr-ratio, --loss (and the run's length) left out of the command went back to
    today's defaults (the loss and schedule changed, the manifest named the defaults), and an
    --lr or --betas given on resume was warned about but not applied (the checkpoint's optimizer
    state brought its own back). Left out, they are the run's own: the resumed run ends where an
    uninterrupted one does; given, they are applied and warned about by name."""
    run = dict(lr=5e-3, betas=(0.8, 0.9), min_lr_ratio=0.5, loss="lk-alpha", max_steps=4,
               optimizer="adamw", save_every=2)
    whole, part = tmp_path / "whole", tmp_path / "part"
    train(_cfg(run_inputs, whole, **run))
    train(_cfg(run_inputs, part, **run))
    checkpoint.clear_after(part, 2)  # as if killed after step 2
    with caplog.at_level(logging.INFO):  # _cfg's lr and max_steps left out too
        train(_cfg(run_inputs, part, lr=None, max_steps=None, optimizer="adamw", save_every=2))
    assert "--lr 0.005, --max-steps 4, --min-lr-ratio 0.5" in caplog.text
    config = json.loads((part / "eyas.json").read_text())["config"]
    assert {k: config[k] for k in run} == {**run, "betas": [0.8, 0.9]}
    a, b = _weights(whole, 4), _weights(part, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lrs = {r["step"]: r["lr"] for r in _records(whole, "train")}
    assert {r["step"]: r["lr"] for r in _records(part, "train")} == lrs
    # given on resume with other values: applied (half the lr at each step), warned by name
    checkpoint.clear_after(part, 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train(_cfg(run_inputs, part, **{**run, "lr": 2.5e-3, "betas": (0.9, 0.99)}))
    assert "--lr 0.005 -> 0.0025" in caplog.text and "--betas [0.8, 0.9] -> " in caplog.text
    resumed = {r["step"]: r["lr"] for r in _records(part, "train")}
    assert [resumed[s] for s in (3, 4)] == pytest.approx([lrs[3] / 2, lrs[4] / 2])
    state = torch.load(checkpoint.step_dir(part, 4) / "trainer_state.pt", weights_only=True)
    assert tuple(state["optimizer"]["param_groups"][0]["betas"]) == (0.9, 0.99)


@pytest.mark.parametrize("before, after, by_k", [
    (5, 2, {"1": 1.0, "2": 1.0, "3": 2.5, "4": 2.5, "5": 2.5}), (2, 3, {"1": 1.0, "2": 2.5})])
def test_a_resume_with_another_ttt_steps_compares_the_best_at_its_own_k(run_inputs, tmp_path,
                                                                          caplog, before, after,
                                                                          by_k):
    """From a review: the best checkpoint's replayed acceptance length at the run's k was
    compared with evals at the resumed run's --ttt-steps, where a longer chain accepts more:
    a best at k = 5 outranked every eval at k = 2. Fewer steps: the best is compared by its own
    length at the new k (its eval replayed every k up to its own); more: it was never measured
    there, so the next eval becomes the best, warned. The saved best (`by_k`) is made one that
    the evals after the resume could beat only at the same k: 2.5 at its own k, where they
    reach ~1.1."""
    run = tmp_path / "run"
    train(_cfg(run_inputs, run, max_steps=4, eval_every=2, save_every=2, ttt_steps=before))
    saved = checkpoint.step_dir(run, 4) / "trainer_state.pt"
    state = torch.load(saved, weights_only=True)
    state["best"] = {**state["best"], "step": 4, "chain_acceptance_length": by_k[str(before)],
                     "chain_by_k": by_k}
    torch.save(state, saved)
    with caplog.at_level(logging.INFO):
        summary = train(_cfg(run_inputs, run, max_steps=6, eval_every=2, save_every=2,
                             ttt_steps=after))
    ev = _records(run, "eval")[-1]
    assert ev["step"] == 6 and ev["chain"]["acceptance_length"][str(after)] > 1.0
    assert summary["best"]["step"] == 6  # above the best's 1.0 at k = 2; none known at k = 3
    assert summary["best"]["chain_acceptance_length"] == \
        summary["best"]["chain_by_k"][str(after)]
    assert checkpoint.read_pointer(run, "best").name == "step-00000006"
    assert ("has no replayed chain acceptance length at k = 3" if after > before else
            "is compared at k = 2 (--ttt-steps) from here") in caplog.text


def test_eval_counts_a_target_token_outside_the_draft_vocab_as_a_miss(run_inputs, tmp_path):
    """From a review: eval's per-step accuracy left out the positions whose target token is
    outside the draft vocab, so a draft of one token scored acc 1.0 at every step and a simulated
    acceptance length of 1 + ttt_steps: perfect. Such a position is a miss (the draft cannot
    propose that token), as the chain replay counts it; the loss still leaves it out."""
    from eyas.vocab import VocabConfig, vocab

    vocab(VocabConfig(data=(run_inputs["prepared"],), out=str(tmp_path / "one"),
                      draft_vocab_size=1))
    ev = train(_cfg(run_inputs, tmp_path / "run", max_steps=1, vocab=str(tmp_path / "one"),
                    ttt_steps=3))["eval"]
    assert ev["positions"] > 0 and all(0 < a < 0.5 for a in ev["acc"])
    assert ev["sim_acceptance_length"] < 1.5
    assert 1.0 <= ev["chain"]["acceptance_length"]["3"] < 1.5
    full = train(_cfg(run_inputs, tmp_path / "full", max_steps=1, ttt_steps=3))["eval"]
    assert ev["positions"] < full["positions"]  # the loss's positions: in the vocab only


def test_eval_samples_that_are_training_samples_are_counted_in_a_warning(run_inputs, tmp_path,
                                                                         caplog):
    """From a review: an --eval-data of the training conversations (a capture of the prepared
    train split beside a --split all capture) was taken without a word, and eval, the best
    checkpoint and the exported acceptance measured memorised data. Counted and warned: by the
    prepared sample ids, or, where the prepared folder is gone, by prepared row; the capture's
    own eval split (disjoint) is not warned about."""
    from eyas.capture import CaptureConfig, capture

    def capture_train_split(prepared, out):  # the first 10 training conversations
        capture(CaptureConfig(target=run_inputs["target"], data=str(prepared), out=str(out),
                              split="train", limit=10, model_dtype="fp32", batch_tokens=2048))

    capture_train_split(run_inputs["prepared"], tmp_path / "seen")
    moved = tmp_path / "prepared"  # a prepared folder that is gone by training time
    shutil.copytree(run_inputs["prepared"], moved)
    capture_train_split(moved, tmp_path / "seen-moved")
    shutil.rmtree(moved)
    with caplog.at_level(logging.WARNING):
        train(_cfg(run_inputs, tmp_path / "own", max_steps=1))
    assert "eval samples are training samples too" not in caplog.text
    for seen, how in (("seen", "sample id in the prepared data"),
                      ("seen-moved", "row of a prepared folder")):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            train(_cfg(run_inputs, tmp_path / f"run-{seen}", max_steps=1,
                       eval_data=str(tmp_path / seen)))
        assert f"10 of the 10 eval samples are training samples too (the same {how})" in \
            caplog.text


def test_train_log_counts_a_target_token_outside_the_draft_vocab_as_a_miss(run_inputs, tmp_path):
    """The training log's per-step accuracy left out, under --vocab-filter, the positions whose
    target token is outside the draft vocab, as eval's did: a draft of one token (right wherever
    it can be) logged acc 1.0 at every step. They are misses, as eval counts them, so its acc is
    the one of --no-vocab-filter (whose loss keeps them, never right); the loss leaves them out."""
    from eyas.vocab import VocabConfig, vocab

    vocab(VocabConfig(data=(run_inputs["prepared"],), out=str(tmp_path / "one"),
                      draft_vocab_size=1))
    runs = {f: train(_cfg(run_inputs, tmp_path / str(f), max_steps=1, ttt_steps=3,
                          vocab=str(tmp_path / "one"), vocab_filter=f))["train"]
            for f in (True, False)}
    assert all(0 < a < 0.5 for a in runs[True]["acc"])
    assert runs[True]["acc"] == runs[False]["acc"]
    assert runs[True]["sim_acceptance_length"] < 1.5
    assert 0 < runs[True]["positions"] < runs[False]["positions"]  # the loss's positions
    assert _records(tmp_path / "True", "train")[-1]["acc"] == runs[True]["acc"]


def test_resume_of_another_dflash_draft_or_family_names_the_flags(run_inputs, tmp_path):
    dflash = dict(draft="dflash", vocab=None, lm_head="target", block_size=4, num_anchors=8)
    train(_cfg(run_inputs, tmp_path, max_steps=2, save_every=2, **dflash))
    with pytest.raises(EyasError, match=r"block_size 4 there, 8 now.*--block-size 4"):
        train(_cfg(run_inputs, tmp_path, max_steps=3, **{**dflash, "block_size": 8}))
    with pytest.raises(EyasError, match=r"holds a dflash draft and this run trains eagle3: "
                                        r"resume it with --draft dflash"):
        train(_cfg(run_inputs, tmp_path, max_steps=3))


def test_a_dflash_resume_of_an_eagle3_run_names_the_family_not_a_recipe_flag(run_inputs,
                                                                             tmp_path):
    """An EAGLE-3 run on eyas's default recipe resumed with --draft dflash: refused as another
    draft family (resume with --draft eagle3), not with a complaint about an EAGLE-3 flag
    (--norm-before-residual, ...) the user never gave, taken over from the run's recipe."""
    train(_cfg(run_inputs, tmp_path, max_steps=1, save_every=1, optimizer="adamw"))
    with pytest.raises(EyasError, match=r"holds a eagle3 draft and this run trains dflash: "
                                        r"resume it with --draft eagle3"):
        train(_cfg(run_inputs, tmp_path, max_steps=2, draft="dflash", vocab=None,
                   lm_head="target", block_size=4, num_anchors=8))


def test_two_layer_draft_trains_resumes_exactly_and_refuses_another_layer_count(
        run_inputs, tmp_path):
    """--draft-layers 2: the TTT trains both layers (eval loss falls), the checkpoint holds
    layers.1.* and num_hidden_layers 2, a run SIGKILLed mid-way resumes to identical weights,
    and a resume with another layer count is refused with the flag that resumes it (also for
    a checkpoint saved before the key existed, which holds one layer)."""
    from eyas.cli import parse_config
    from eyas.draft.config import DraftConfig
    from eyas.draft.eagle3 import Eagle3Draft

    assert parse_config("train", ["--data", "d", "--out", "o",
                                  "--draft-layers", "2"]).draft_layers == 2
    with pytest.raises(ConfigError, match="--draft-layers must be >= 1"):
        TrainConfig(data="d", out="o", draft_layers=0)
    with pytest.raises(ConfigError, match="--dflash-layers"):
        TrainConfig(data="d", out="o", draft="dflash", draft_layers=2)
    kw = dict(max_steps=6, save_every=2, eval_every=3, grad_accum=2, draft_layers=2)
    _resume_after_sigkill(run_inputs, tmp_path, kw)
    run = tmp_path / "killed"
    evals = _records(run, "eval")
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert all(math.isfinite(r["loss"]) for r in evals + _records(run, "train"))
    assert evals[-1]["loss"] < evals[0]["loss"], evals
    step = checkpoint.step_dir(run, 6)
    dcfg = DraftConfig.from_dict(json.loads((step / "draft_config.json").read_text()))
    weights = _weights(run, 6)
    assert dcfg.num_hidden_layers == 2 and "layers.1.self_attn.q_proj.weight" in weights
    Eagle3Draft(dcfg).load_state_dict(weights, strict=True)
    with pytest.raises(EyasError, match=r"num_hidden_layers 2 there, 1 now.*Resume it with "
                                        r"--draft-layers 2"):
        train(_cfg(run_inputs, run, max_steps=7, draft_layers=1))
    saved = step / "draft_config.json"  # as a checkpoint from before --draft-layers
    saved.write_text(json.dumps({k: v for k, v in json.loads(saved.read_text()).items()
                                 if k != "num_hidden_layers"}))
    with pytest.raises(EyasError, match=r"num_hidden_layers 1 there, 2 now.*--draft-layers 1"):
        train(_cfg(run_inputs, run, max_steps=7, draft_layers=2))


@pytest.mark.parametrize("ttt_steps, ks", [(3, "1/3"), (2, "1/2"), (5, "1/3/5")])
def test_eval_log_names_the_draft_lengths_it_prints(run_inputs, tmp_path, caplog, ttt_steps, ks):
    caplog.set_level("INFO", logger="eyas")
    train(_cfg(run_inputs, tmp_path, ttt_steps=ttt_steps, max_steps=1, eval_every=1))
    line = next(r.getMessage() for r in caplog.records if "replayed chain AL" in r.getMessage())
    values = line.split("replayed chain AL ")[1].split(" (k=")[0].split("/")
    assert line.endswith(f"(k={ks})") and len(values) == len(ks.split("/"))


def test_a_run_keeps_one_run_id_while_its_manifest_id_moves_and_export_quotes_its_eval(
        run_inputs, tmp_path):
    """An eval of a run's step-2 export, made before the run was lengthened to step 4 (its
    manifest id changes as it trains: complete, best, steps), was refused at the export of
    step 2 as "another training run". The run's `run` stays one from first step to last; a
    run started afresh in the same folder, or elsewhere, is another."""
    from eyas.export import ExportConfig, export
    from eyas.store.manifest import read_manifest, write_manifest

    run = tmp_path / "run"
    train(_cfg(run_inputs, run, max_steps=2, save_every=1, keep_last=5))
    early = read_manifest(run, step="train")
    measured = read_manifest(export(ExportConfig(checkpoint=str(run), out=str(tmp_path / "e2"),
                                                 which="step-2")))
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.json").write_text(json.dumps(
        {"draft": str(tmp_path / "e2"), "primary": "eagle3", "mean_acceptance_length": {"3": 2.0}}))
    write_manifest(report, "eval", {}, target=early["target"], inputs=[measured],
                   draft_checkpoint=measured["checkpoint"])
    train(_cfg(run_inputs, run, max_steps=4, save_every=1, keep_last=5))  # lengthened
    late = read_manifest(run, step="train")
    assert late["id"] != early["id"] and late["run"] == early["run"]
    out = export(ExportConfig(checkpoint=str(run), out=str(tmp_path / "d"), which="step-2",
                              acceptance_report=str(report)))
    assert "| 3 | 2.000 |" in (out / "README.md").read_text()
    train(_cfg(run_inputs, tmp_path / "other", max_steps=1))
    train(_cfg(run_inputs, run, max_steps=2, save_every=1, keep_last=5, resume="never"))
    for again in (tmp_path / "other", run):
        assert read_manifest(again, step="train")["run"] != early["run"]
        with pytest.raises(EyasError, match="measured a draft of another training run than"):
            export(ExportConfig(checkpoint=str(again), out=str(tmp_path / "d"), overwrite=True,
                                acceptance_report=str(report)))


def test_a_second_training_into_the_same_folder_is_refused_while_the_first_runs(run_inputs,
                                                                                  tmp_path):
    # two runs on one --out (a requeued job beside the old one) trained side by side and
    # overwrote each other's checkpoints and metrics
    from eyas.store import locks

    out = tmp_path / "run"
    with locks.exclusive(out / ".train.lock", "held by the test"):
        with pytest.raises(EyasError, match=r"another eyas train is writing into .*run .*wait "
                                            r"for it to end or stop it"):
            train(_cfg(run_inputs, out, max_steps=2))
    assert not (out / "checkpoints").exists()
    with locks.exclusive(out / ".train.lock", "still held"):  # it went with its holder
        pass


def test_a_run_is_not_resumed_on_another_targets_capture(run_inputs, tmp_path):
    # the same samples captured from a fine-tune of the target passed every resume check, and
    # the run's manifest then named the new target over checkpoints of the old one
    out = tmp_path / "run"
    train(_cfg(run_inputs, out, max_steps=2, save_every=1))
    manifest = json.loads((out / "eyas.json").read_text())
    was = manifest["target"]
    manifest["target"] = {**was, "name_or_path": "base-model",
                          "weights_fingerprint": "0" * 16}
    (out / "eyas.json").write_text(json.dumps(manifest))
    with pytest.raises(EyasError, match=r"the training run in .*run was made with the weights of "
                                        r"base-model .*[Rr]esume it on the data of the target it "
                                        r"was started with"):
        train(_cfg(run_inputs, out, max_steps=4, save_every=1))
    assert json.loads((out / "eyas.json").read_text())["target"]["name_or_path"] == "base-model"
    # --resume of that run's step into a new --out: the same check, against the step's run
    # (from an audit: only the new --out's eyas.json was looked at, which holds none)
    step = str(checkpoint.step_dir(out, 2))
    with pytest.raises(EyasError, match=r"the training run in .*run was made with the weights of "
                                        r"base-model"):
        train(_cfg(run_inputs, tmp_path / "new", max_steps=4, save_every=1, resume=step))
    # a resume given --lm-head scratch while the run froze its head: the conflict is said as
    # the run's recipe against the flag given (from an audit: "--freeze-lm-head True", a flag
    # never given, in a bare refusal)
    frozen = tmp_path / "frozen"
    train(_cfg(run_inputs, frozen, max_steps=2, save_every=1, lm_head="target",
               freeze_lm_head=True))
    with pytest.raises(ConfigError, match=r"frozen resumes with the recipe it was started with "
                                          r"for the options not given here \(.*--freeze-lm-head"
                                          r"\b.*\), and with those given here it is refused: "
                                          r".*--lm-head scratch would keep a random head"):
        train(_cfg(run_inputs, frozen, max_steps=4, lm_head="scratch", freeze_lm_head=None))
    # a step folder copied out of its run: resumed, with a warning that nothing is checked
    alone = tmp_path / "alone"
    shutil.copytree(step, alone)
    train(_cfg(run_inputs, tmp_path / "new2", max_steps=4, save_every=1, resume=str(alone)))


def test_a_checkpoint_that_cannot_be_written_is_an_error_that_says_how_to_go_on(run_inputs,
                                                                                 tmp_path,
                                                                                 monkeypatch):
    # a full disk ended training in safetensors' "No space left on device" traceback
    import safetensors.torch

    from eyas.store import checkpoint as store

    out = tmp_path / "run"
    train(_cfg(run_inputs, out, max_steps=2, save_every=1))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "save_file", full)
    with pytest.raises(EyasError, match=r"cannot write checkpoint step-00000003 into .*No space "
                                        r"left on device.*resumes from the last checkpoint "
                                        r"saved \(step-00000002\)"):
        train(_cfg(run_inputs, out, max_steps=4, save_every=1))
    assert not list((out / "checkpoints").glob("*.tmp"))
    monkeypatch.setattr(store, "save_file", safetensors.torch.save_file)
    train(_cfg(run_inputs, out, max_steps=4, save_every=1))  # space again: it resumes
    assert (out / "checkpoints" / "step-00000004").is_dir()


def test_a_refused_resume_keeps_the_later_steps_and_a_shorter_length_is_refused(run_inputs,
                                                                                  tmp_path):
    """From a review: a resume from step 2 refused for another --batch-tokens had already
    deleted steps 4 and 6 and the last/best pointers; a resume with fewer steps than the run
    had done "finished" at step 4 with best and last at step 6."""
    run = tmp_path / "run"
    train(_cfg(run_inputs, run, max_steps=6, save_every=2, keep_last=5))
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(EyasError, match="other data or batching"):
        train(_cfg(run_inputs, run, max_steps=6, batch_tokens=512,
                   resume=str(run / "checkpoints" / "step-00000002")))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert checkpoint.read_pointer(run, "last").name == "step-00000006"
    with pytest.raises(EyasError, match=r"step-00000006 is step 6, past the 4 steps"):
        train(_cfg(run_inputs, run, max_steps=4))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_a_diverging_run_stops_with_the_step_and_the_fix(run_inputs, tmp_path):
    # it ended "done" with NaN weights as its best checkpoint
    with pytest.raises(EyasError, match=r"training diverged at step \d+ \((loss|grad_norm) "
                                        r"(nan|inf).*Lower --lr \(now 1e\+30\)"):
        train(_cfg(run_inputs, tmp_path / "run", max_steps=6, lr=1e30, optimizer="adamw"))
    with pytest.raises(ConfigError, match="--lr must be > 0 and finite"):
        _cfg(run_inputs, tmp_path / "x", lr=float("inf"))


def test_a_step_that_diverged_between_logs_is_not_saved_nor_resumed(run_inputs, tmp_path):
    """From an audit: only logged steps' losses were checked, so a step saved between two of
    them held NaN weights and became `last`; the advised rerun with a lower --lr resumed it
    and diverged again, as often as it was tried. Saving now checks the weights, and a
    resume refuses a checkpoint saved before that check."""
    run = tmp_path / "run"
    with pytest.raises(EyasError, match=r"training diverged before step 4 \(its weights are "
                                        r"not saved\).*run the same command again \(nothing "
                                        r"was saved before it: it starts over\)$"):
        train(_cfg(run_inputs, run, max_steps=12, log_every=6, save_every=4, lr=1e30,
                   optimizer="adamw"))
    assert checkpoint.read_pointer(run, "last") is None
    train(_cfg(run_inputs, run, max_steps=12, log_every=6, save_every=4, optimizer="adamw"))
    assert checkpoint.read_pointer(run, "last").name == "step-00000012"
    # a checkpoint with NaN weights (saved by an eyas before the check) is refused on resume
    step = checkpoint.step_dir(run, 8)
    weights = load_file(str(step / "draft.safetensors"))
    name = next(k for k, v in weights.items() if v.is_floating_point())
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(step / "draft.safetensors"), metadata={"format": "pt", "step": "8"})
    with pytest.raises(EyasError, match=r"step-00000008 holds weights that are not finite "
                                        r"\(the run had diverged before that step was saved\)"
                                        r": resume from an earlier step folder"):
        train(_cfg(run_inputs, run, max_steps=12, log_every=6, save_every=4, optimizer="adamw",
                   resume=str(step)))


def test_the_logged_lr_is_the_steps_own_and_a_run_started_over_drops_its_old_events(
        run_inputs, tmp_path, caplog):
    """From a review: each train record logged the next step's lr (the last step logged 0);
    --resume never kept the old run's TensorBoard events beside the new ones; Muon options
    given with AdamW were ignored without a word."""
    run = tmp_path / "run"
    train(_cfg(run_inputs, run, max_steps=3, optimizer="adamw", warmup_ratio=0.0,
               lr_decay="linear", min_lr_ratio=0.0))
    lrs = [r["lr"] for r in _records(run, "train")]
    assert lrs[0] == pytest.approx(1e-2) and lrs[-1] > 0 and lrs == sorted(lrs, reverse=True)
    if (run / "tensorboard").is_dir():
        with caplog.at_level(logging.WARNING):
            train(_cfg(run_inputs, run, max_steps=2, optimizer="adamw", resume="never",
                       muon_lr=0.5))
        assert len(list((run / "tensorboard").glob("events.*"))) == 1
        assert "--muon-lr 0.5: not used with --optimizer adamw" in caplog.text



def test_resume_auto_without_a_last_pointer_continues_from_the_latest_complete_step(
        run_inputs, tmp_path, caplog):
    """From a review: `auto` read only `checkpoints/last`; with it gone (a kill before the
    first pointer was written, or the pointer removed) the run started over at step 1 over its
    own checkpoints. It resumes from the newest complete step folder instead, and says so; a
    newer folder that is not complete (its weights cut) is passed over and removed."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    train(_cfg(run_inputs, whole, max_steps=6, save_every=2))
    train(_cfg(run_inputs, part, max_steps=6, save_every=2, keep_last=3))
    run_id = json.loads((part / "eyas.json").read_text())["run"]
    checkpoint.clear_after(part, 4)  # as if killed after step 4's folder, before any pointer
    assert not (part / "checkpoints" / "last").exists()
    cut = part / "checkpoints" / "step-00000004" / "draft.safetensors"
    cut.write_bytes(cut.read_bytes()[:100])
    assert checkpoint.resolve_resume(part, "auto").name == "step-00000002"
    with caplog.at_level(logging.WARNING):
        train(_cfg(run_inputs, part, max_steps=6, save_every=2))
    assert "resuming from its latest complete checkpoint step-00000002; step-00000004 " \
           "(incomplete) will be removed" in caplog.text
    assert json.loads((part / "eyas.json").read_text())["run"] == run_id  # the same run
    assert [r["step"] for r in _records(part, "train")] == [1, 2, 3, 4, 5, 6]
    a, b = _weights(whole, 6), _weights(part, 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_of_a_kept_step_whose_best_is_gone_measures_a_new_best(run_inputs, tmp_path,
                                                                     caplog):
    """From an audit: `--resume` of an earlier step whose best had been removed by --keep-last
    (a later step became the best, then `--resume` removed that one) kept naming the removed
    step as the best, unless an eval beat its number: no checkpoints/best, and `eyas export
    --which best` said "no eval ran". And `--resume` of a step folder copied under another
    name than step-N ended in a ValueError from parsing that name."""
    run = tmp_path / "run"
    train(_cfg(run_inputs, run, max_steps=9, eval_every=3, save_every=3, keep_last=5))
    kept = tmp_path / "kept"  # a step saved aside under a name of the user's
    shutil.copytree(checkpoint.step_dir(run, 6), kept)
    was = torch.load(kept / "trainer_state.pt", weights_only=True)["best"]["step"]
    assert was in (3, 6)
    shutil.rmtree(checkpoint.step_dir(run, was))  # as --keep-last removes it
    with caplog.at_level(logging.WARNING):
        # a learning rate that ruins the draft: no eval after the resume beats the old best
        summary = train(_cfg(run_inputs, run, max_steps=9, eval_every=3, save_every=3,
                             keep_last=5, lr=300.0, resume=str(kept)))
    assert f"the resumed step's best checkpoint (step {was}) is no longer in" in caplog.text
    assert summary["best"]["step"] == 9
    assert checkpoint.read_pointer(run, "best") == checkpoint.step_dir(run, 9)
    assert [r["step"] for r in _records(run, "train")][-3:] == [7, 8, 9]


def test_a_damaged_last_checkpoint_names_the_whole_one_to_resume_from(run_inputs, tmp_path):
    """From a user audit: the checkpoint `last` names, cut short or overwritten after it was
    written (a copy, a disk), raised safetensors' "incomplete metadata" from the resume, or,
    for the trainer state, the advice that the run's own settings were another run's. The
    resume now says which file is damaged and which whole checkpoint to resume from."""
    run = tmp_path / "run"
    train(_cfg(run_inputs, run, max_steps=6, save_every=2, keep_last=3))
    four, six = checkpoint.step_dir(run, 4), checkpoint.step_dir(run, 6)
    weights = six / "draft.safetensors"
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    with pytest.raises(EyasError, match=rf"checkpoint {six} is damaged \(draft.safetensors "
                                        rf"unreadable: .*\), so the run cannot resume from it: "
                                        rf"resume from {four}, the latest whole checkpoint "
                                        rf"before it, with --resume {four} \(the steps after "
                                        rf"it are trained again\)"):
        train(_cfg(run_inputs, run, max_steps=8, save_every=2))
    state = four / "trainer_state.pt"
    state.write_bytes(b"junk" * 100)  # the one before it too, another way
    with pytest.raises(EyasError, match=rf"checkpoint {four} is damaged \(trainer_state.pt is "
                                        rf"not a whole torch.save file .*\).*--resume "
                                        rf"{checkpoint.step_dir(run, 2)} "):
        train(_cfg(run_inputs, run, max_steps=8, save_every=2, resume=str(four)))
    # the fix it names works: the run goes on from step 2 and ends at step 8
    train(_cfg(run_inputs, run, max_steps=8, save_every=2, keep_last=3,
               resume=str(checkpoint.step_dir(run, 2))))
    assert checkpoint.complete(checkpoint.step_dir(run, 8))
    assert [r["step"] for r in _records(run, "train")] == list(range(1, 9))
    for step in (4, 6):  # the damaged folders were trained and written again
        assert checkpoint.complete(checkpoint.step_dir(run, step))


def test_a_resume_on_other_eval_samples_does_not_compare_the_best_with_them(run_inputs,
                                                                           tmp_path, caplog):
    """A best chosen on one --eval-data outranked every eval of a resume on another set (its
    acceptance length is another set's): on other eval samples the next eval becomes the best,
    warned; on the same ones the best stands. The saved best is made one the evals after the
    resume cannot beat (2.5 where they reach ~1.1)."""
    from eyas.capture import CaptureConfig, capture

    for name, limit in (("eval-a", 6), ("eval-b", 4)):
        capture(CaptureConfig(target=run_inputs["target"], data=run_inputs["prepared"],
                              out=str(tmp_path / name), split="train", limit=limit,
                              model_dtype="fp32", batch_tokens=2048))
    first = tmp_path / "first"
    kw = dict(eval_every=2, save_every=2, ttt_steps=2)
    train(_cfg(run_inputs, first, max_steps=4, eval_data=str(tmp_path / "eval-a"), **kw))
    saved = checkpoint.step_dir(first, 4) / "trainer_state.pt"
    state = torch.load(saved, weights_only=True)
    assert state["eval"]  # the eval samples its best was measured on
    state["best"] = {**state["best"], "step": 4, "chain_acceptance_length": 2.5,
                     "chain_by_k": {"1": 1.9, "2": 2.5}}
    torch.save(state, saved)
    for name, best in (("eval-a", 4), ("eval-b", 6)):
        run = tmp_path / f"resumed-{name}"
        shutil.copytree(first, run)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            summary = train(_cfg(run_inputs, run, max_steps=6, eval_data=str(tmp_path / name),
                                 **kw))
        assert summary["best"]["step"] == best
        assert ("was measured on other eval samples" in caplog.text) == (best == 6)
    # resumed with no eval samples at all (a capture without an eval split, --eval-fraction
    # 0): no next eval becomes the best, and the warning says so (from an audit: it said the
    # next eval would, and the run ended with that old best all the same)
    from types import SimpleNamespace

    from eyas.draft.resume import best_on_this_eval

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        kept = best_on_this_eval(state, SimpleNamespace(eval_fingerprint=""),
                                 "chain_acceptance_length", first)
    assert kept == state["best"]
    assert "no later step is measured, so it stays the best" in caplog.text
    assert "the next eval becomes the best" not in caplog.text


def test_a_capture_of_a_relative_target_trains_from_another_directory(run_inputs, tmp_path,
                                                                      monkeypatch):
    """`capture --target demo/target` then `train` run from elsewhere loaded "demo/target"
    from the hub ("cannot load the config of 'demo/target'"): the capture records the
    absolute path beside the name, and train takes it where the name is no path from here."""
    from eyas.capture import CaptureConfig, capture

    target = Path(run_inputs["target"])
    monkeypatch.chdir(target.parent)
    capture(CaptureConfig(target=target.name, data=run_inputs["prepared"],
                          out=str(tmp_path / "cap"), model_dtype="fp32", batch_tokens=2048))
    monkeypatch.chdir(tmp_path)
    result = train(_cfg(run_inputs, tmp_path / "run", data=str(tmp_path / "cap"), max_steps=1))
    assert result["steps"] == 1
    recorded = json.loads((tmp_path / "run" / "eyas.json").read_text())["target"]
    assert recorded["name_or_path"] == str(target)


def test_a_capture_recording_layers_its_target_lacks_is_refused(run_inputs, tmp_path):
    """aux_layer_ids [2, 4, 50] edited into a capture of an 8-layer target: train ran and
    export wrote eagle_aux_hidden_state_layer_ids [2, 4, 50]; only eval caught it."""
    import shutil

    cap = tmp_path / "cap"
    shutil.copytree(run_inputs["captured"], cap)
    body = json.loads((cap / "eyas.json").read_text())
    body["aux_layer_ids"] = [*body["aux_layer_ids"][:2], 50]
    (cap / "eyas.json").write_text(json.dumps(body))
    with pytest.raises(EyasError, match=rf"the capture {cap} records aux_layer_ids .* out of "
                                        rf"range.*its eyas.json was edited"):
        train(_cfg(run_inputs, tmp_path / "run", data=str(cap)))


def test_resuming_on_states_of_other_layers_says_which_capture_to_give(tmp_path):
    """From an audit: a run resumed on a capture of other aux layers was told "resume it with
    the settings it was started with", naming none."""
    from eyas.draft.resume import check_same_draft
    (tmp_path / "draft_config.json").write_text(json.dumps(
        {"draft": "eagle3", "aux_layer_ids": [2, 4, 5], "num_hidden_layers": 1}))
    with pytest.raises(EyasError, match=r"aux_layer_ids \[2, 4, 5\] there, \[1, 3, 6\] now.*"
                                        r"Resume it with states of layers 2,4,5: a --data "
                                        r"capture made with --aux-layer-ids 2,4,5"):
        check_same_draft(tmp_path, {"draft": "eagle3", "aux_layer_ids": [1, 3, 6],
                                    "num_hidden_layers": 1})


def test_a_run_resumes_on_its_data_captured_again_in_other_shards(run_inputs, tmp_path):
    """From an audit: the plan's fingerprint hashed capture sample numbers, so a capture made
    again (another --shard count, a damaged part redone, as eyas's own message says to) was
    "other data or batching" though it held the same rows in the same order."""
    from eyas.capture import CaptureConfig, capture

    again = tmp_path / "captured-in-two"
    for shard in ("0/2", "1/2"):
        capture(CaptureConfig(target=run_inputs["target"], data=run_inputs["prepared"],
                              out=str(again), split="all", model_dtype="fp32",
                              batch_tokens=2048, shard=shard))
    numbers = [shards.open_capture(f).sample_index for f in (run_inputs["captured"], again)]
    assert not torch.equal(*numbers)  # the same rows under other sample numbers
    whole, part = tmp_path / "whole", tmp_path / "part"
    train(_cfg(run_inputs, whole, max_steps=4, save_every=2))
    train(_cfg(run_inputs, part, max_steps=2, save_every=2))
    train(_cfg({**run_inputs, "captured": str(again)}, part, max_steps=4, save_every=2))
    for key, value in _weights(whole, 4).items():
        torch.testing.assert_close(_weights(part, 4)[key], value, rtol=1e-4, atol=1e-5)


def test_eval_data_without_eval_samples_says_how_to_capture_it(run_inputs, tmp_path):
    """From an audit: --eval-data captured with --split all from a prepared folder with no
    eval rows was "no samples; capture more data or lower --eval-fraction", a flag
    --eval-data does not use."""
    from eyas.capture import CaptureConfig, capture
    from eyas.prepare import PrepareConfig, prepare
    from eyas.targets.corpus import synthetic_chats

    chats = tmp_path / "c.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(4, seed=5)))
    prepare(PrepareConfig(target=run_inputs["target"], data=(str(chats),),
                          out=str(tmp_path / "prep"), max_length=256, eval_fraction=0.0))
    capture(CaptureConfig(target=run_inputs["target"], data=str(tmp_path / "prep"),
                          out=str(tmp_path / "cap"), split="all", model_dtype="fp32"))
    with pytest.raises(EyasError, match=r"--eval-data .*cap holds no eval samples.*--split "
                                        r"train") as err:
        train(_cfg(run_inputs, tmp_path / "run", eval_data=str(tmp_path / "cap")))
    assert "--eval-fraction and capture again" in str(err.value)


def test_a_resume_with_other_held_out_samples_names_the_flag(run_inputs, tmp_path):
    """From an audit: resuming a run started with --eval-fraction 0.2 (on a capture of the
    train split alone) without it was refused as "other data or batching" naming flags that
    had not changed, and advised --resume never, which deletes the run's checkpoints."""
    from eyas.capture import CaptureConfig, capture

    captured = tmp_path / "train-only"
    capture(CaptureConfig(target=run_inputs["target"], data=run_inputs["prepared"],
                          out=str(captured), split="train", model_dtype="fp32",
                          batch_tokens=2048))
    run = tmp_path / "run"
    train(_cfg(run_inputs, run, data=str(captured), max_steps=2, save_every=2,
               eval_fraction=0.2))
    with pytest.raises(EyasError, match=r"other data or batching than this command's: "
                                        r"--eval-fraction 0\.2 then, 0\.02 now\. Resume with "
                                        r"the values it was started with, or train a new run "
                                        r"in another --out"):
        train(_cfg(run_inputs, run, data=str(captured), max_steps=3))


def test_an_eval_fraction_that_leaves_nothing_to_train_names_fixes_the_run_has():
    """From an audit: --online was told to pass --eval-data, which --online refuses."""
    with pytest.raises(EyasError, match=r"--eval-fraction 0.02 leaves no training samples out "
                                        r"of 1; set --eval-fraction 0 .* or pass --eval-data"):
        data.split_eval(1, 0.02, 0)
    with pytest.raises(EyasError, match=r"out of 1; set --eval-fraction 0 .* or prepare more "
                                        r"data") as err:
        data.split_eval(1, 0.02, 0, online=True)
    assert "--eval-data" not in str(err.value)
    assert [len(x) for x in data.split_eval(50, 0.02, 0)] == [49, 1]
