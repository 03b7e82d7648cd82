"""DFlash drafts: captures of N target layers, the draft model as vLLM's DFlashDraftModel runs
it, its block training objective, `eyas train --draft dflash` and the exported folder."""

from __future__ import annotations

import json
import re

import pytest
import torch

from eyas.config import ConfigError
from eyas.errors import EyasError
from eyas.targets.taps import dflash_aux_layer_ids, validate_aux_layer_ids

# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def dflash_inputs(tmp_path_factory):
    """The real pipeline on test_train's predictable tiny Llama (8 layers): 40 synthetic chats,
    prepared, captured with 5 taps (--split all)."""
    from safetensors.torch import load_file, save_file
    from test_train import copy_target

    from eyas.capture import CaptureConfig, capture
    from eyas.prepare import PrepareConfig, prepare
    from eyas.targets.corpus import synthetic_chats

    root = tmp_path_factory.mktemp("dflash-inputs")
    model = copy_target(root / "target")
    # the DFlash draft reads the target's lm_head as is: at x40 its logits are in the
    # hundreds and a few CPU steps barely move a random draft; x4 keeps the same predictions
    w = load_file(str(model / "model.safetensors"))
    w["lm_head.weight"] = (w["lm_head.weight"] / 10).contiguous()
    save_file(w, str(model / "model.safetensors"), metadata={"format": "pt"})
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(40, seed=0)))
    prepare(PrepareConfig(target=str(model), data=(str(chats),), out=str(root / "prepared"),
                          max_length=256, eval_fraction=0.15))
    capture(CaptureConfig(target=str(model), data=str(root / "prepared"),
                          out=str(root / "captured"), split="all", model_dtype="fp32",
                          batch_tokens=2048, aux_layer_ids=TAPS))
    return {k: str(root / k) for k in ("target", "prepared", "captured")}


TAPS = (1, 2, 4, 6, 8)  # 8-layer target: id 8 is the last layer's output (before the norm)

# ----------------------------------------------------------------------------- capture


def test_default_taps_are_the_reference_layout_plus_one():
    # SpecForge / z-lab `build_target_layer_ids` outputs, each +1 into vLLM's aux-id convention
    # (docs/dflash.md section 7): Qwen3-8B, Llama-3.1-8B, Qwen2.5-0.5B with 5 draft layers
    assert dflash_aux_layer_ids(36, 5) == (2, 10, 18, 26, 34)
    assert dflash_aux_layer_ids(32, 5) == (2, 9, 16, 23, 30)
    assert dflash_aux_layer_ids(24, 5) == (2, 7, 12, 17, 22)
    assert dflash_aux_layer_ids(36, 1) == (19,)  # one tap: output of layer L//2
    for depth in range(5, 100):
        for taps in range(1, min(depth - 3, 8)):
            ids = dflash_aux_layer_ids(depth, taps)
            assert validate_aux_layer_ids(ids, depth, count=None) == ids
    # the advice names the caller's flag, and not --aux-layer-ids beside it (refused)
    with pytest.raises(ConfigError, match=r"ask for fewer \(--dflash-taps\), or name the "
                                          r"layers with --aux-layer-ids instead \(without "
                                          r"--dflash-taps\)"):
        dflash_aux_layer_ids(6, 5)
    with pytest.raises(ConfigError, match=r"fewer \(--dflash-layers\)"):
        dflash_aux_layer_ids(6, 5, "--dflash-layers")


def test_aux_ids_any_count_for_capture_exactly_three_for_eagle3():
    assert validate_aux_layer_ids((2, 4, 6, 7, 8), 8, count=None) == (2, 4, 6, 7, 8)
    assert validate_aux_layer_ids((5,), 8, count=None) == (5,)
    with pytest.raises(ConfigError, match="exactly 3"):
        validate_aux_layer_ids((2, 4, 6, 7, 8), 8)
    with pytest.raises(ConfigError, match="ascending"):
        validate_aux_layer_ids((2, 6, 4, 7), 8, count=None)
    with pytest.raises(ConfigError, match="at least one"):
        validate_aux_layer_ids((), 8, count=None)


def test_capture_config_takes_n_taps_or_the_dflash_default():
    from eyas.capture import CaptureConfig

    base = dict(target="t", data="d", out="o")
    assert CaptureConfig(**base, aux_layer_ids=(1, 2, 3, 4, 5)).aux_layer_ids == (1, 2, 3, 4, 5)
    with pytest.raises(ConfigError, match="--dflash-taps"):
        CaptureConfig(**base, aux_layer_ids=(1, 2, 3), dflash_taps=5)
    with pytest.raises(ConfigError, match="--dflash-taps"):
        CaptureConfig(**base, dflash_taps=-1)


def test_capture_stores_n_taps_equal_to_hidden_states(dflash_inputs):
    """Five taps land in the manifest and in the shards, each equal to HF's
    output_hidden_states[k] (id L: the final norm's input); training collates (T, 5*Ht)."""
    from transformers import AutoModelForCausalLM

    from eyas.draft import data, data_loader
    from eyas.store.manifest import read_manifest

    man = read_manifest(dflash_inputs["captured"], step="capture")
    assert man["aux_layer_ids"] == list(TAPS)
    src = data.OfflineSource(dflash_inputs["captured"])
    sample = src.fetch([0])[0]
    n = sample["input_ids"].shape[0]
    assert sample["aux_hidden"].shape == (n, len(TAPS), 64)
    model = AutoModelForCausalLM.from_pretrained(dflash_inputs["target"], dtype=torch.float32)
    with torch.no_grad():
        out = model(sample["input_ids"][None].long(), output_hidden_states=True)
    for j, k in enumerate(TAPS):
        want = out.hidden_states[k][0] if k < 8 else None
        if want is None:  # id L: HF's hidden_states[L] is after the norm; ours before it
            want = out.hidden_states[8][0]
            got = model.model.norm(sample["aux_hidden"][:, j].float())
        else:
            got = sample["aux_hidden"][:, j].float()
        torch.testing.assert_close(got, want.float(), atol=2e-2, rtol=2e-2)  # bf16 storage
        if k < 8:  # and no other layer is as close: adjacent layers differ by less than the
            # bf16 tolerance here, so a tap one layer off would pass the check above alone
            dist = [float((got - h[0].float()).abs().max()) for h in out.hidden_states[:8]]
            assert min(range(8), key=dist.__getitem__) == k, (k, dist)
    batch = data_loader.collate([[sample]], 256, torch.float32)
    assert batch["aux_hidden"].shape == (1, 256, len(TAPS) * 64)
    assert torch.equal(batch["aux_hidden"][0, :n].view(n, len(TAPS), 64),
                       sample["aux_hidden"].float())


def test_capture_dflash_taps_default(dflash_inputs, tmp_path):
    from eyas.capture import CaptureConfig, capture
    from eyas.store.manifest import read_manifest

    capture(CaptureConfig(target=dflash_inputs["target"], data=dflash_inputs["prepared"],
                          out=str(tmp_path / "cap"), split="eval", model_dtype="fp32",
                          dflash_taps=3, limit=2))
    # 8 layers: outputs of layers 1, 3, 5 (round(1 + i*4/2)) -> vLLM ids 2, 4, 6
    assert read_manifest(tmp_path / "cap", step="capture")["aux_layer_ids"] == [2, 4, 6]


def test_eagle3_training_refuses_a_five_tap_capture_with_the_fix(dflash_inputs, tmp_path):
    from eyas.draft.train_config import TrainConfig
    from eyas.train import train

    cfg = TrainConfig(data=dflash_inputs["captured"], out=str(tmp_path / "run"), max_steps=1,
                      batch_tokens=256, num_workers=0, lm_head="scratch")
    with pytest.raises(EyasError, match=r"holds 5 target layer.*exactly 3.*Re-capture.*"
                                        r"--aux-layer-ids.*--draft dflash"):
        train(cfg)


# ----------------------------------------------------------------------------- the model


def tiny_dflash_cfg(**kw):
    from eyas.dflash.config import DFlashConfig

    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=96, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position_embeddings=512, vocab_size=300,
                aux_layer_ids=(1, 3, 5), block_size=4, mask_token_id=299)
    return DFlashConfig(**{**base, **kw})


def make_dflash(cfg=None, seed=0):
    """A draft with random weights everywhere (norm weights too, so a swapped or missing
    norm shows) and random target embedding / lm_head."""
    from eyas.dflash.model import DFlashDraft

    cfg = cfg or tiny_dflash_cfg()
    torch.manual_seed(seed)
    draft = DFlashDraft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    draft.set_target(torch.randn(cfg.vocab_size, cfg.hidden_size),
                     torch.randn(cfg.vocab_size, cfg.hidden_size) / 4)
    return draft


def test_block_attention_equals_dense_masked_attention():
    """Band of context keys + own block, against one softmax over [context; all blocks] with
    the mask written out (SpecForge's create_dflash_sdpa_mask rule), values and gradients."""
    from eyas.kernels.attention import block_attention

    g = torch.Generator().manual_seed(0)
    m, nb, b, hq, hkv, d = 20, 3, 4, 4, 2, 8
    n = nb * b
    q, bk, bv = (torch.randn(n, h, d, generator=g, requires_grad=True)
                 for h in (hq, hkv, hkv))
    k, v = (torch.randn(m, hkv, d, generator=g, requires_grad=True) for _ in range(2))
    lo = torch.tensor([0, 0, 11]).repeat_interleave(b)
    hi = torch.tensor([4, 9, 18]).repeat_interleave(b)
    out = block_attention(q, k, v, lo, hi, bk, bv, b)

    keys, vals = torch.cat([k, bk]), torch.cat([v, bv])  # (m + n, hkv, d)
    j = torch.arange(m + n)
    blk = torch.arange(n) // b
    seen = ((j[None] >= lo[:, None]) & (j[None] <= hi[:, None]) & (j[None] < m)) | \
        ((j[None] >= m) & ((j[None] - m) // b == blk[:, None]))  # (n, m + n)
    kq = keys.repeat_interleave(hq // hkv, 1)
    vq = vals.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("nhd,jhd->nhj", q, kq) / d ** 0.5
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    ref = torch.einsum("nhj,jhd->nhd", scores.softmax(-1), vq)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    mine = torch.autograd.grad(out, (q, k, v, bk, bv), grad)
    theirs = torch.autograd.grad(ref, (q, k, v, bk, bv), grad)
    for a, r in zip(mine, theirs):
        torch.testing.assert_close(a, r)


def reference_block(draft, aux, anchor: int, token: int):
    """One block drafted after `anchor` context tokens, the way docs/dflash.md section 4 says
    vLLM runs it, from transformers' own Qwen3 pieces (RMSNorm, rotary embedding, MLP) and a
    plain softmax: context through fc + hidden_norm into each layer's k/v only; the block
    [token, MASK...] at positions anchor..anchor+B-1, non-causal over [context; block]."""
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3 as q3

    cfg = draft.cfg
    hf = Qwen3Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                     num_key_value_heads=cfg.num_key_value_heads, rms_norm_eps=cfg.rms_norm_eps,
                     rope_theta=cfg.rope_theta, max_position_embeddings=512, hidden_act="silu")

    def norm(w):
        n = q3.Qwen3RMSNorm(w.shape[0], eps=cfg.rms_norm_eps)
        n.weight.data.copy_(w)
        return n

    b, hq, hkv, d = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rotary = q3.Qwen3RotaryEmbedding(hf)
    ctx = norm(draft.hidden_norm.weight)(aux[:anchor] @ draft.fc.weight.t())  # (a, H)
    ids = torch.tensor([token] + [cfg.mask_token_id] * (b - 1))
    x = draft.embed_tokens[ids]  # (B, H)
    pos = torch.arange(anchor + b)[None]
    cos, sin = rotary(x[None], pos)
    for layer in draft.layers:
        at = layer.self_attn
        a = norm(layer.input_layernorm.weight)(x)
        both = torch.cat([ctx, a])  # (a + B, H): keys/values from context then block
        q = norm(at.q_norm.weight)((a @ at.q_proj.weight.t()).view(b, hq, d))
        k = norm(at.k_norm.weight)((both @ at.k_proj.weight.t()).view(-1, hkv, d))
        v = (both @ at.v_proj.weight.t()).view(-1, hkv, d)
        qr, _ = q3.apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None],
                                        cos[:, anchor:], sin[:, anchor:])
        _, kr = q3.apply_rotary_pos_emb(k.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos, sin)
        out = torch.nn.functional.scaled_dot_product_attention(
            qr, kr, v.transpose(0, 1)[None], enable_gqa=True)  # no mask: non-causal
        x = x + out[0].transpose(0, 1).flatten(1) @ at.o_proj.weight.t()
        mlp = q3.Qwen3MLP(hf)
        mlp.gate_proj.weight.data.copy_(layer.mlp.gate_proj.weight)
        mlp.up_proj.weight.data.copy_(layer.mlp.up_proj.weight)
        mlp.down_proj.weight.data.copy_(layer.mlp.down_proj.weight)
        x = x + mlp(norm(layer.post_attention_layernorm.weight)(x))
    return norm(draft.norm.weight)(x)  # (B, H)


def test_draft_block_equals_transformers_qwen3_reference():
    draft = make_dflash()
    aux = torch.randn(12, 3 * 64)
    anchor, token = 7, 42
    c = draft.context(aux[:anchor])
    kv = draft.context_kv(c, torch.arange(anchor))
    b = draft.cfg.block_size
    ids = torch.tensor([token] + [draft.cfg.mask_token_id] * (b - 1))
    with torch.no_grad():
        h = draft(ids, torch.arange(anchor, anchor + b), kv, torch.zeros(b, dtype=torch.long),
                  torch.full((b,), anchor - 1))
        ref = reference_block(draft, aux, anchor, token)
    torch.testing.assert_close(h, ref, atol=1e-5, rtol=1e-5)
    assert draft.logits(h).shape == (b, 300)


# ----------------------------------------------------------------------------- the objective


def packed_batch(seed=0, rows=2, width=24, hidden=64, taps=3):
    """Two rows, each holding two documents and some padding, with a random loss mask."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((rows, width), -1)
    pos = torch.zeros(rows, width, dtype=torch.long)
    for r, lengths in enumerate([(10, 9), (13, 11)][:rows]):
        at = 0
        for d, n in enumerate(lengths):
            doc[r, at:at + n], pos[r, at:at + n] = d, torch.arange(n)
            at += n
    return {"input_ids": torch.randint(0, 299, (rows, width), generator=g),
            "target_top1": torch.randint(0, 299, (rows, width), generator=g),
            "loss_mask": (torch.rand(rows, width, generator=g) < 0.7).long() * (doc >= 0),
            "position_ids": pos, "doc_ids": doc,
            "aux_hidden": torch.randn(rows, width, taps * hidden, generator=g)}


def test_blocks_follow_specforge_rules():
    from eyas.dflash.objective import sample_blocks

    batch = packed_batch()
    kw = dict(block=4, mask_token_id=299, gamma=7.0, labels="data")
    blocks = sample_blocks(batch, num_anchors=100, generator=torch.Generator().manual_seed(1),
                           **kw)
    ids, mask = batch["input_ids"].flatten(), batch["loss_mask"].flatten()
    doc, pos = batch["doc_ids"].flatten(), batch["position_ids"].flatten()
    nb = blocks.num_blocks // 4
    a = blocks.hi.view(nb, 4)[:, 0] + 1  # anchor = last visible context token + 1
    # every masked token with context before it and a token after it in its document
    want = [t for t in range(48) if mask[t] and doc[t] >= 0 and t > 0 and doc[t - 1] == doc[t]
            and t + 1 < 48 and doc[t + 1] == doc[t]]
    assert a.tolist() == want
    for i, t in enumerate(a.tolist()):
        sl = slice(4 * i, 4 * i + 4)
        assert blocks.ids[sl].tolist() == [int(ids[t]), 299, 299, 299]
        assert blocks.positions[sl].tolist() == [int(pos[t]) + j for j in range(4)]
        assert pos[blocks.lo[4 * i]] == 0 and doc[blocks.lo[4 * i]] == doc[t]  # doc start
        for j in range(4):
            inside = t + j < 48 and doc[t + j] == doc[t]
            w = float(j > 0 and inside and mask[t + j]) * torch.exp(torch.tensor(-(j - 1) / 7.0))
            assert blocks.weight[4 * i + j] == pytest.approx(float(w))
            if w:
                assert blocks.labels[4 * i + j] == ids[t + j]
                assert blocks.greedy[4 * i + j] == batch["target_top1"].flatten()[t + j - 1]
    capped = sample_blocks(batch, num_anchors=2, generator=torch.Generator().manual_seed(1), **kw)
    assert capped.num_blocks == 4 * 2 * 4  # two anchors in each of the four documents
    again = sample_blocks(batch, num_anchors=2, generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(capped.hi, again.hi)
    target = sample_blocks(batch, num_anchors=2, generator=torch.Generator().manual_seed(1),
                           **{**kw, "labels": "target"})
    assert torch.equal(target.labels, target.greedy)


def test_packed_training_blocks_equal_serving_one_block_at_a_time():
    """Every block of a packed micro-batch (all in one forward) equals that block drafted the
    way serving does: its own document's tokens before the anchor as the whole context."""
    from eyas.dflash.objective import sample_blocks

    draft = make_dflash()
    batch = packed_batch()
    blocks = sample_blocks(batch, block=4, num_anchors=3, mask_token_id=299, gamma=7.0,
                           labels="data", generator=torch.Generator().manual_seed(0))
    aux = batch["aux_hidden"].flatten(0, 1)
    with torch.no_grad():
        kv = draft.context_kv(draft.context(aux), batch["position_ids"].flatten())
        h = draft(blocks.ids, blocks.positions, kv, blocks.lo, blocks.hi)
        for i in range(blocks.num_blocks // 4):
            sl = slice(4 * i, 4 * i + 4)
            s, a = int(blocks.lo[4 * i]), int(blocks.hi[4 * i]) + 1
            kv1 = draft.context_kv(draft.context(aux[s:a]), torch.arange(a - s))
            one = draft(blocks.ids[sl], blocks.positions[sl], kv1,
                        torch.zeros(4, dtype=torch.long), torch.full((4,), a - s - 1))
            torch.testing.assert_close(h[sl], one, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(one, reference_block(draft, aux[s:], a - s,
                                                            int(blocks.ids[4 * i])),
                                       atol=1e-5, rtol=1e-5)


def test_chunked_cross_entropy_equals_autograd():
    from eyas.dflash.objective import ChunkedCE

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    weight = torch.rand(37, generator=g) * (torch.rand(37, generator=g) > 0.3)
    loss, top = ChunkedCE.apply(h, w, labels, weight, 8)
    ref = (torch.nn.functional.cross_entropy(h @ w.t(), labels, reduction="none") * weight).sum()
    torch.testing.assert_close(loss, ref)
    assert torch.equal(top, (h @ w.t()).argmax(-1))
    torch.testing.assert_close(torch.autograd.grad(loss * 3, h)[0],
                               torch.autograd.grad(ref * 3, h)[0])


def test_forward_counts_accepted_chains():
    """The accepted chain of a block stops at its first slot whose argmax is not the target's
    greedy token; the draft is made to hit slots 1-2 of block 0 and miss slot 1 of block 1."""
    from eyas.dflash.objective import Blocks, dflash_forward

    draft = make_dflash()
    batch = packed_batch()
    blocks = Blocks(ids=torch.tensor([5, 299, 299, 299, 7, 299, 299, 299]),
                    positions=torch.tensor([3, 4, 5, 6, 5, 6, 7, 8]),
                    lo=torch.zeros(8, dtype=torch.long), hi=torch.tensor([2] * 4 + [4] * 4),
                    labels=torch.zeros(8, dtype=torch.long), weight=torch.tensor([0., 1, 1, 1] * 2),
                    greedy=torch.zeros(8, dtype=torch.long), valid=torch.tensor([False, True, True, True] * 2))
    with torch.no_grad():
        kv = draft.context_kv(draft.context(batch["aux_hidden"].flatten(0, 1)),
                              batch["position_ids"].flatten())
        top = draft.logits(draft(blocks.ids, blocks.positions, kv, blocks.lo, blocks.hi)).argmax(-1)
    greedy = top.clone()
    greedy[3] = (top[3] + 1) % 300  # block 0 misses slot 3
    greedy[5] = (top[5] + 1) % 300  # block 1 misses slot 1
    blocks.greedy, blocks.labels = greedy, greedy
    out = dflash_forward(draft, batch, blocks)
    assert out.accepted.tolist() == [2, 1, 1, 0]  # blocks accepting >= j drafts, j = 0..3
    assert out.slot_correct.tolist() == [0, 1, 2, 1] and out.slot_count.tolist() == [0, 2, 2, 2]
    assert out.weight_sum == 6


# ----------------------------------------------------------------------------- eyas train


def _dflash_train_cfg(inputs, out, **kw):
    from eyas.draft.train_config import TrainConfig

    base = dict(data=inputs["captured"], out=str(out), draft="dflash", block_size=4,
                num_anchors=16, dflash_layers=1, batch_tokens=256, max_steps=12, lr=3e-3,
                num_workers=0, log_every=1, eval_every=6, save_every=100, seed=0,
                warmup_ratio=0.0)
    return TrainConfig(**{**base, **kw})


def test_dflash_trains_through_the_cli_and_writes_the_run_folder(dflash_inputs, tmp_path):
    from eyas.cli import main
    from eyas.store.manifest import read_manifest

    run = tmp_path / "run"
    argv = ["train", "--data", dflash_inputs["captured"], "--out", str(run), "--draft", "dflash",
            "--block-size", "4", "--num-anchors", "16", "--dflash-layers", "1",
            "--batch-tokens", "256", "--max-steps", "30", "--lr", "3e-3", "--num-workers", "0",
            "--log-every", "1", "--eval-every", "15", "--warmup-ratio", "0",
            "--dflash-labels", "target"]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert len(train) == 30 and [r["step"] for r in evals] == [0, 15, 30]
    assert sum(r["loss"] for r in train[-3:]) < 0.8 * sum(r["loss"] for r in train[:3])
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert set(evals[-1]["acceptance_length"]) == {"1", "2", "3"}
    assert evals[-1]["acceptance_length"]["3"] > evals[0]["acceptance_length"]["3"]
    man = read_manifest(run, step="train")
    assert man["draft"] == "dflash" and man["aux_layer_ids"] == list(TAPS)
    best = (run / "checkpoints" / (run / "checkpoints" / "best").read_text().strip())
    config = json.loads((best / "draft_config.json").read_text())
    assert config["draft"] == "dflash" and config["aux_layer_ids"] == list(TAPS)
    assert config["num_hidden_layers"] == 1 and config["block_size"] == 4
    assert 0 <= config["mask_token_id"] < config["vocab_size"]
    from safetensors.torch import load_file

    names = set(load_file(str(best / "draft.safetensors")))
    assert "fc.weight" in names and not any("embed" in n or "lm_head" in n for n in names)


def test_dflash_resume_continues_exactly(dflash_inputs, tmp_path):
    """6 steps in one go == 3 steps, then a resumed run to 6 (same anchors, same updates)."""
    from safetensors.torch import load_file

    from eyas.store import checkpoint
    from eyas.train import train

    whole = train(_dflash_train_cfg(dflash_inputs, tmp_path / "a", max_steps=6, save_every=3,
                                    eval_every=100, grad_accum=2))
    part = tmp_path / "b"
    train(_dflash_train_cfg(dflash_inputs, part, max_steps=6, save_every=3, eval_every=100,
                            grad_accum=2))
    checkpoint.clear_after(part, 3)  # as if killed after step 3's checkpoint
    again = train(_dflash_train_cfg(dflash_inputs, part, max_steps=6, save_every=3,
                                    eval_every=100, grad_accum=2))
    assert again["train"]["loss"] == pytest.approx(whole["train"]["loss"], rel=1e-6)
    a = load_file(str(checkpoint.step_dir(tmp_path / "a", 6) / "draft.safetensors"))
    b = load_file(str(checkpoint.step_dir(part, 6) / "draft.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_block_longer_than_every_document_is_refused_before_training(dflash_inputs, tmp_path):
    """A block must fit a document after one token of context, or its last slots never get a
    loss and the draft is served with num_speculative_tokens it was never trained for: refused
    with the largest block that fits, before the run folder is written; that block trains."""
    from eyas.train import train

    run = tmp_path / "run"
    with pytest.raises(EyasError, match=r"--block-size 1000 .*longest training document has "
                                        r"(\d+) tokens.*--block-size (\d+) or less") as err:
        train(_dflash_train_cfg(dflash_inputs, run, block_size=1000, max_steps=1))
    assert not (run / "checkpoints").exists() and not (run / "eyas.json").exists()
    longest, fits = (int(x) for x in re.search(r"has (\d+) tokens.*--block-size (\d+)",
                                                str(err.value)).groups())
    assert fits == longest - 1
    train(_dflash_train_cfg(dflash_inputs, run, block_size=fits, num_anchors=1, max_steps=1,
                            eval_every=1))


@pytest.mark.parametrize("eval_every", [100, 3])
def test_dflash_stops_on_sigterm_after_saving_and_resumes_exactly(dflash_inputs, tmp_path,
                                                                   monkeypatch, eval_every):
    """SIGTERM during step 3 (no save due): step 3 is saved, SystemExit(143), and the same
    config resumes to the weights of a run never stopped (the EAGLE-3 loop's test runs it in
    a child process: tests/test_train.py). On an eval step (--eval-every 3) the stop saves
    without the eval, and the resumed run evaluates step 3 before step 4."""
    import json
    import os
    import signal

    from safetensors.torch import load_file

    from eyas.store import checkpoint
    from eyas.train import train

    kw = dict(max_steps=6, eval_every=eval_every)
    whole = train(_dflash_train_cfg(dflash_inputs, tmp_path / "a", **kw))
    calls, clip = [0], torch.nn.utils.clip_grad_norm_

    def evals(run):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if r["kind"] == "eval"]

    def clip_then_sigterm(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return clip(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_then_sigterm)
    with pytest.raises(SystemExit) as stopped:
        train(_dflash_train_cfg(dflash_inputs, tmp_path / "b", **kw))
    monkeypatch.undo()
    assert stopped.value.code == 143
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # ours is gone again
    assert checkpoint.read_pointer(tmp_path / "b", "last").name == "step-00000003"
    assert [r["step"] for r in evals(tmp_path / "b")] == [0]
    resumed = train(_dflash_train_cfg(dflash_inputs, tmp_path / "b", **kw))
    assert [(r["step"], r["acceptance_length"]) for r in evals(tmp_path / "b")] == \
        [(r["step"], r["acceptance_length"]) for r in evals(tmp_path / "a")]
    assert resumed["best"] == whole["best"]
    a = load_file(str(checkpoint.step_dir(tmp_path / "a", 6) / "draft.safetensors"))
    b = load_file(str(checkpoint.step_dir(tmp_path / "b", 6) / "draft.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dflash_online_training_equals_offline(dflash_inputs, tmp_path):
    """--online runs the target in the job with the same taps: the same blocks and losses."""
    from eyas.store.manifest import read_manifest
    from eyas.train import train

    kw = dict(max_steps=2, eval_every=2)
    offline = train(_dflash_train_cfg(dflash_inputs, tmp_path / "off", **kw))
    online = train(_dflash_train_cfg(dflash_inputs, tmp_path / "on", **kw, online=True,
                                     data=dflash_inputs["prepared"],
                                     target=dflash_inputs["target"], aux_layer_ids=TAPS))
    assert read_manifest(tmp_path / "on", step="train")["aux_layer_ids"] == list(TAPS)
    assert online["train"]["blocks"] == offline["train"]["blocks"] > 0
    assert online["train"]["loss"] == pytest.approx(offline["train"]["loss"], rel=1e-3)
    assert online["eval"]["loss"] == pytest.approx(offline["eval"]["loss"], rel=1e-3)


def test_eyas_run_wires_a_dflash_pipeline(tmp_path, llama_dir):
    """`eyas run` with train.draft dflash: capture takes DFlash's default taps (one per draft
    layer, 5 unless train.dflash_layers says otherwise) and train gets no draft vocabulary."""
    import yaml

    from eyas.pipeline import RunConfig, plan

    spec = {"target": str(llama_dir), "data": "chats.jsonl", "work_dir": "w",
            "train": {"draft": "dflash", "dflash_layers": 3}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    by = {p.step: p.config for p in plan(RunConfig(pipeline=str(path), dry_run=True))}
    assert by["capture"].dflash_taps == 3 and by["capture"].aux_layer_ids == ()
    assert by["train"].draft == "dflash" and by["train"].vocab is None
    path.write_text(yaml.safe_dump({**spec, "capture": {"aux_layer_ids": [2, 4, 6, 8]}}))
    by = {p.step: p.config for p in plan(RunConfig(pipeline=str(path), dry_run=True))}
    assert by["capture"].dflash_taps == 0 and by["capture"].aux_layer_ids == (2, 4, 6, 8)
    path.write_text(yaml.safe_dump({**spec, "train": {}}))  # EAGLE-3 as before
    by = {p.step: p.config for p in plan(RunConfig(pipeline=str(path), dry_run=True))}
    assert by["capture"].dflash_taps == 0 and by["train"].vocab == str(tmp_path / "w" / "vocab")


@pytest.mark.parametrize("kw, match", [
    (dict(vocab="v"), "drop --vocab"),
    (dict(loss="lk-alpha"), "cross-entropy"),
    (dict(fc_norm=True), "DFlash drafts do not have it"),
    (dict(block_size=1), "--block-size"),
    (dict(cuda_graph=True, device="cuda"), "--cuda-graph"),
    (dict(compile=True), "--compile"),
    (dict(mask_token_id=-2), "--mask-token-id must be >= 0 .or -1"),
])
def test_dflash_config_errors_name_the_flag(kw, match):
    from eyas.draft.train_config import TrainConfig

    with pytest.raises(ConfigError, match=match):
        TrainConfig(data="d", out="o", draft="dflash", **kw)


@pytest.mark.parametrize("kw", [dict(block_size=8), dict(num_anchors=64),
                                dict(loss_decay_gamma=0.0), dict(dflash_layers=2),
                                dict(mask_token_id=3), dict(dflash_labels="target")])
def test_an_eagle3_run_refuses_a_dflash_option_instead_of_ignoring_it(kw):
    from eyas.draft.train_config import TrainConfig

    flag = "--" + next(iter(kw)).replace("_", "-")
    with pytest.raises(ConfigError, match=f"{flag} is a DFlash option.*add --draft dflash"):
        TrainConfig(data="d", out="o", **kw)
    TrainConfig(data="d", out="o", draft="dflash", **kw)  # the same option, with its family


def test_mask_token_resolution_order(tiny_tok):
    from eyas.dflash.train import resolve_mask_token_id

    assert resolve_mask_token_id(tiny_tok, 4096, 17) == 17  # given
    assert resolve_mask_token_id(tiny_tok, 4096) == len(tiny_tok)  # first unused row
    full = resolve_mask_token_id(tiny_tok, len(tiny_tok))  # the table is full: pad, else eos
    assert full == (tiny_tok.pad_token_id if tiny_tok.pad_token_id is not None
                    else tiny_tok.eos_token_id)


# ----------------------------------------------------------------------------- eyas export


@pytest.fixture(scope="module")
def dflash_run(dflash_inputs, tmp_path_factory):
    from eyas.train import train

    run = tmp_path_factory.mktemp("dflash-run") / "run"
    train(_dflash_train_cfg(dflash_inputs, run, max_steps=4, eval_every=2, dflash_layers=2))
    return run


def test_a_diverging_dflash_run_stops_and_nan_weights_are_not_exported(dflash_inputs,
                                                                         dflash_run, tmp_path):
    """From an audit: a DFlash run at a learning rate that blows up ended "done" with NaN
    weights as its best, and export wrote them (EAGLE-3's stopped and refused both)."""
    from safetensors.torch import load_file

    from eyas.dflash.formats import dflash_checkpoint_config
    from eyas.draft.formats import find_checkpoint
    from eyas.serve.dflash_export import dflash_tensors
    from eyas.train import train

    with pytest.raises(EyasError, match=r"training diverged at step \d+ \((loss|grad_norm) "
                                        r"(nan|inf).*Lower --lr"):
        train(_dflash_train_cfg(dflash_inputs, tmp_path / "nan", max_steps=6, lr=1e30,
                                optimizer="adamw", grad_clip=0.0))
    step, _ = find_checkpoint(dflash_run)
    cfg = dflash_checkpoint_config(json.loads((step / "draft_config.json").read_text()))
    state = load_file(str(step / "draft.safetensors"))
    assert dflash_tensors(cfg, state, "bf16")  # the run's own: finite
    state["fc.weight"][0, 0] = float("nan")
    with pytest.raises(EyasError, match=r"\['fc.weight'\] of the DFlash checkpoint hold NaN or "
                                        r"Inf; export an earlier checkpoint"):
        dflash_tensors(cfg, state, "bf16")


# vLLM's names (qwen3_dflash.DFlashQwen3Model / load_weights, before its own "model." prefix)
VLLM_LAYER_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                    "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                    "input_layernorm", "post_attention_layernorm", "mlp.gate_proj",
                    "mlp.up_proj", "mlp.down_proj")


def test_export_writes_the_folder_vllms_dflash_loader_reads(dflash_run, dflash_inputs, tmp_path):
    from safetensors.torch import load_file

    from eyas.export import ExportConfig, export

    out = export(ExportConfig(checkpoint=str(dflash_run), out=str(tmp_path / "draft")))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"]["target_layer_ids"] == [k - 1 for k in TAPS]
    assert config["eagle_aux_hidden_state_layer_ids"] == list(TAPS)
    assert config["dflash_config"]["block_size"] == config["block_size"] == 4
    mask = config["dflash_config"]["mask_token_id"]
    assert 0 <= mask < config["vocab_size"] == 2048
    assert config["num_hidden_layers"] == 2 and config["layer_types"] == ["full_attention"] * 2
    assert config["hidden_size"] == 64 and config["num_target_layers"] == 8
    assert "draft_vocab_size" not in config and config["tie_word_embeddings"] is False
    assert not config["attention_bias"] and config["rope_theta"] > 0
    tensors = load_file(str(out / "model.safetensors"))
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}.weight" for i in range(2) for n in VLLM_LAYER_NAMES}
    assert set(tensors) == want  # no embed_tokens / lm_head: vLLM shares the target's
    assert tensors["fc.weight"].shape == (64, 5 * 64)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    readme = (out / "README.md").read_text()
    assert "method\": \"dflash\"" in readme
    with pytest.raises(EyasError, match="speculators"):
        export(ExportConfig(checkpoint=str(dflash_run), out=str(tmp_path / "s"),
                            format="speculators"))
    # tap 8 = L, the last layer's output: SGLang captures only layers' inputs, so no SGLang
    # command in the README and --format sglang refused (from an audit: the command given
    # would tap a layer past the target's last)
    assert "sglang.launch_server" not in readme
    assert "Not served by SGLang: aux id 8 = L (the last layer's output)" in readme
    with pytest.raises(EyasError, match=r"aux id 8 = L .*serve this draft with vLLM"):
        export(ExportConfig(checkpoint=str(dflash_run), out=str(tmp_path / "g"),
                            format="sglang"))


def test_dflash_export_serves_the_k_asked_for_and_quotes_its_eval(dflash_run, tmp_path):
    from eyas.dflash.formats import dflash_checkpoint_config
    from eyas.draft.formats import find_checkpoint
    from eyas.export import ExportConfig, export

    step, _ = find_checkpoint(dflash_run)
    most = dflash_checkpoint_config(json.loads((step / "draft_config.json").read_text())) \
        .block_size - 1
    readme = (export(ExportConfig(checkpoint=str(dflash_run), out=str(tmp_path / "a"))) /
              "README.md").read_text()
    assert f'"num_speculative_tokens": {most}' in readme
    # as an EAGLE-3 export's README: how to measure it, the target and how it trained (it
    # said none of these)
    assert "Not measured yet: `eyas eval --target" in readme
    assert f"--k {','.join(str(k) for k in sorted({1, 2, 3, most}) if k <= most)}`" in readme
    assert "## Target" in readme and "- model_type llama, 8 layers" in readme
    train = json.loads((dflash_run / "eyas.json").read_text())
    assert f"`eyas train`, {train['steps']} optimizer steps; exported step " in readme
    assert f"- block_size: {most + 1}" in readme and "- ttt_steps" not in readme
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"primary": "dflash", "mean_acceptance_length": {"2": 1.75},
                                  "per_position_acceptance": {"2": [0.5, 0.25]},
                                  "num_prompts": 8, "results": []}))
    readme = (export(ExportConfig(checkpoint=str(dflash_run), out=str(tmp_path / "b"),
                                  num_speculative_tokens=2, acceptance_report=str(report))) /
              "README.md").read_text()
    assert '"num_speculative_tokens": 2' in readme
    assert "Not served by SGLang" in readme  # (tap 8 = L: test_export_writes_the_folder_...)
    # a run of the same taps on a deeper target (9 layers): SGLang's command, which counts
    # the bonus token
    import shutil

    deeper = tmp_path / "deeper"
    shutil.copytree(dflash_run, deeper)
    manifest = json.loads((deeper / "eyas.json").read_text())
    manifest["target"]["num_hidden_layers"] = 9
    (deeper / "eyas.json").write_text(json.dumps(manifest))
    sglang = (export(ExportConfig(checkpoint=str(deeper), out=str(tmp_path / "deeper-export"),
                                  num_speculative_tokens=2)) / "README.md").read_text()
    assert "--speculative-num-draft-tokens 3" in sglang
    # a weight over fp16's range is said as such, as for EAGLE-3 (from an audit: "NaN or Inf;
    # export an earlier checkpoint")
    from safetensors.torch import load_file, save_file

    step = find_checkpoint(deeper)[0]
    weights = load_file(str(step / "draft.safetensors"))
    weights["fc.weight"][0, 0] = 1e5
    save_file(weights, str(step / "draft.safetensors"), metadata={"format": "pt"})
    with pytest.raises(EyasError, match=r"weight 'fc.weight' of .* holds values \(100000 at "
                                        r"most\) that --dtype fp16 cannot hold"):
        export(ExportConfig(checkpoint=str(deeper), out=str(tmp_path / "h"), dtype="fp16"))
    assert "| 2 | 1.750 | 0.50, 0.25 | - |" in readme
    assert "draft_sample_method" not in readme.split("## SGLang")[0].split("```")[1]
    # measured at T = 1 with sampled drafts: served so
    report.write_text(json.dumps({"primary": "dflash", "mean_acceptance_length": {"2": 1.5},
                                  "temperature": 1.0, "draft_sampling": "probabilistic",
                                  "num_prompts": 8, "results": []}))
    readme = (export(ExportConfig(checkpoint=str(dflash_run), out=str(tmp_path / "b"),
                                  num_speculative_tokens=2, acceptance_report=str(report))) /
              "README.md").read_text()
    assert '"draft_sample_method": "probabilistic"' in readme
    with pytest.raises(EyasError, match=rf"drafts at most {most} per step"):
        export(ExportConfig(checkpoint=str(dflash_run), out=str(tmp_path / "c"),
                            num_speculative_tokens=most + 1))
    report.write_text(json.dumps({"primary": "eagle3", "mean_acceptance_length": {"2": 2.0}}))
    with pytest.raises(EyasError, match="measured eagle3, not a DFlash draft"):
        export(ExportConfig(checkpoint=str(dflash_run), out=str(tmp_path / "c"),
                            acceptance_report=str(report)))


def test_dflash_readme_quotes_the_best_steps_acceptance_as_that_steps():
    """--which last or step-N: the README quoted the run's best acceptance as this step's."""
    from eyas.serve.dflash_export import dflash_readme
    from eyas.serve.export_readme import served_target

    best, t = {"step": 10, "acceptance_length": 2.5}, served_target("t")
    text = dflash_readme(tiny_dflash_cfg(), "d", t, "run/checkpoints/step-00000010", best)
    assert "at k = 3: 2.5." in text and "unfinished" not in text
    text = dflash_readme(tiny_dflash_cfg(), "d", t, "run/checkpoints/step-00000005", best,
                         unfinished=True)
    assert "2.5 at the run's best step 10, not this one" in text
    assert "(**unfinished**: the run had not ended" in text  # the export's warning said so
    # a path with a space and a quote, and a revision: commands that run as pasted
    t = served_target("my models/it's", revision="v1.0")
    text = dflash_readme(tiny_dflash_cfg(), "/d r/x", t, "s", None)
    assert "vllm serve 'my models/it'\"'\"'s' --revision v1.0 \\" in text
    assert "--speculative-draft-model-path '/d r/x'" in text


def test_exported_draft_loads_back_with_identical_logits(dflash_run, tmp_path):
    from safetensors.torch import load_file

    from eyas.dflash.model import DFlashDraft
    from eyas.dflash.formats import dflash_checkpoint_config
    from eyas.draft.formats import find_checkpoint
    from eyas.export import ExportConfig, export

    out = export(ExportConfig(checkpoint=str(dflash_run), out=str(tmp_path / "d"), dtype="fp32"))
    step, _ = find_checkpoint(dflash_run)
    cfg = dflash_checkpoint_config(json.loads((step / "draft_config.json").read_text()))
    trained = DFlashDraft(cfg)
    trained.load_state_dict(load_file(str(step / "draft.safetensors")))
    g = torch.Generator().manual_seed(0)
    embed, head = torch.randn(2048, 64, generator=g), torch.randn(2048, 64, generator=g)
    trained.set_target(embed, head)
    served = DFlashDraft.from_pretrained(out, embed, head)
    assert served.cfg == cfg
    # a config.json that names other taps than its weights read (a z-lab / SpecForge style
    # config edited by hand): one line naming the mismatch, not load_state_dict's traceback
    import shutil

    from eyas.serve.draft_loading import load_draft

    mixed = tmp_path / "mixed"
    shutil.copytree(out, mixed)
    config = json.loads((mixed / "config.json").read_text())
    config.pop("eagle_aux_hidden_state_layer_ids", None)
    config["dflash_config"]["target_layer_ids"] = config["dflash_config"]["target_layer_ids"][:4]
    (mixed / "config.json").write_text(json.dumps(config))
    with pytest.raises(EyasError, match=r"draft .*mixed: its weights do not fit its config.json "
                                        r"\(.*fc.weight.*\): .*export it again"):
        load_draft(mixed, torch.nn.Embedding.from_pretrained(embed),
                   lm_head=torch.nn.Linear(64, 2048, bias=False))
    aux = torch.randn(9, 5 * 64, generator=g)
    ids = torch.tensor([7] + [cfg.mask_token_id] * 3)
    outs = []
    with torch.no_grad():
        for d in (trained, served):
            kv = d.context_kv(d.context(aux), torch.arange(9))
            h = d(ids, torch.arange(9, 13), kv, torch.zeros(4, dtype=torch.long),
                  torch.full((4,), 8))
            outs.append(d.logits(h))
    assert torch.equal(outs[0], outs[1])


# ----------------------------------------------------------------------------- eyas eval


def test_drafter_proposes_what_the_training_forward_predicts(dflash_inputs, dflash_run):
    """The serving drafter (context K/V cached call by call, one block [last, MASK x k]) and
    the training forward over the whole prefix (the packed path) draft the same tokens."""
    from transformers import AutoModelForCausalLM

    from eyas.dflash.model import DFlashDraft
    from eyas.dflash.formats import dflash_checkpoint_config
    from eyas.draft.formats import find_checkpoint
    from eyas.serve.dflash_drafter import DFlashDrafter
    from eyas.serve.speculate import Sampling
    from eyas.targets.taps import AuxTaps
    from safetensors.torch import load_file

    model = AutoModelForCausalLM.from_pretrained(dflash_inputs["target"], dtype=torch.float32)
    step, _ = find_checkpoint(dflash_run)
    cfg = dflash_checkpoint_config(json.loads((step / "draft_config.json").read_text()))
    draft = DFlashDraft(cfg)
    draft.load_state_dict(load_file(str(step / "draft.safetensors")))
    draft.set_target(model.model.embed_tokens.weight, model.lm_head.weight)
    tokens = torch.randint(10, 2000, (20,), generator=torch.Generator().manual_seed(3))
    taps = AuxTaps(model.model.layers, model.model.norm, cfg.aux_layer_ids, 8, final=False)
    with torch.no_grad(), taps.attached():
        model(tokens[None])
    aux = taps.collect("cpu")[0].flatten(1)  # (20, 5*64)
    drafter, sampled = DFlashDrafter(draft, "cpu"), DFlashDrafter(draft, "cpu")
    drafter.begin()
    sampled.begin()
    greedy = Sampling()
    t1 = Sampling(temperature=1.0, generator=torch.Generator().manual_seed(0),
                  draft_sampling="probabilistic")  # drafts sampled: their distributions kept
    for s, since in ((9, 0), (13, 8), (20, 12)):  # calls after 8, 4 and 7 new target states
        got = drafter.propose(tokens[:s], aux[since:s - 1], 3, greedy).tokens
        q = sampled.propose(tokens[:s], aux[since:s - 1], 3, t1).probs  # (3, V)
        with torch.no_grad():
            kv = draft.context_kv(draft.context(aux[:s - 1]), torch.arange(s - 1))
            ids = torch.tensor([int(tokens[s - 1])] + [cfg.mask_token_id] * 3)
            h = draft(ids, torch.arange(s - 1, s + 3), kv, torch.zeros(4, dtype=torch.long),
                      torch.full((4,), s - 2))
            logits = draft.logits(h[1:])
        assert got == logits.argmax(-1).tolist()
        # the whole distribution, not just its argmax: positions and cache are exact
        torch.testing.assert_close(q, logits.softmax(-1), atol=1e-6, rtol=1e-5)
    with pytest.raises(EyasError, match="out of step"):
        drafter.propose(tokens[:20], aux[10:19], 3, greedy)
    with pytest.raises(EyasError, match="k <= 3"):
        drafter.propose(tokens[:20], aux[:19], 4, greedy)


def test_eval_measures_a_dflash_export_losslessly(dflash_inputs, dflash_run, tmp_path):
    from eyas.evaluate import EvalConfig, evaluate
    from eyas.export import ExportConfig, export

    folder = export(ExportConfig(checkpoint=str(dflash_run), out=str(tmp_path / "draft"),
                                 dtype="fp32"))
    report = evaluate(EvalConfig(target=dflash_inputs["target"], data=dflash_inputs["prepared"],
                                 out=str(tmp_path / "report"), draft=str(folder), k=(1, 3),
                                 num_prompts=3, max_new_tokens=12, dtype="float32",
                                 device="cpu", batch_size=4, ngram=False))
    assert report.primary == "dflash" and report.lossless is True
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert set(saved["mean_acceptance_length"]) == {"1", "3"}
    for k in ("1", "3"):
        rates = saved["per_position_acceptance"][k]
        assert len(rates) == int(k) and all(0 <= r <= 1 for r in rates)
        assert saved["mean_acceptance_length"][k] == pytest.approx(1 + sum(rates), abs=1e-3)


@pytest.fixture(scope="module")
def fitted(llama_dir, fit_dflash):
    """A tiny random Llama target (8 layers), six prompts, its greedy continuations (long
    enough for every k) and a DFlash draft fitted to them (labels: the target's own greedy
    tokens), so that eval has acceptance to count, right at some positions and wrong at
    others (about 0.45 / 0.11 / 0.11 at k = 3)."""
    from transformers import AutoModelForCausalLM

    from eyas.evaluate import Prompt
    from eyas.serve.speculate import Sampling, TargetRunner, generate_plain

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    layers, norm = model.model.layers, model.model.norm
    g = torch.Generator().manual_seed(5)
    prompts = [Prompt(str(i), torch.randint(10, 2000, (int(n),), generator=g))
               for i, n in enumerate(torch.randint(6, 14, (6,), generator=g))]
    runner = TargetRunner(model, layers, norm)
    refs = [generate_plain(runner, p.ids, 24, frozenset(), Sampling()).tokens for p in prompts]
    draft = fit_dflash(model, prompts, refs, TAPS, mask_token_id=2047)
    return model, prompts, refs, draft


def replayed_acceptance(model, draft, prompt, ref, k: int, max_new: int,
                        to_the_end: bool = False) -> list[int]:
    """[drafts, accepted at positions 1..k] of greedy chain drafting replayed on the target's
    own continuation `ref`: each step drafts from the teacher-forced prefix with one block and
    accepts its leading drafts equal to `ref`, then one token more (what the loop must count,
    independent of its KV caches and verification). Rounds run while fewer than `max_new`
    tokens are out, each counting k drafts (eval's loop); `to_the_end`: while `ref` has tokens
    left, counting only the drafts inside it (the replay's rounds, eyas.draft.loss's)."""
    from eyas.targets.taps import AuxTaps

    seq = torch.cat([prompt, torch.tensor(ref)])
    taps = AuxTaps(model.model.layers, model.model.norm, draft.cfg.aux_layer_ids, 8, final=False)
    with torch.no_grad(), taps.attached():
        model(seq[None])
    aux = taps.collect("cpu")[0].flatten(1)
    counts, t, p = [0] * (k + 1), 1, len(prompt)
    while (m := min(k, len(ref) - t)) > 0 if to_the_end else t < max_new:
        s = p + t  # sequence so far: prompt + t tokens; the last one is the block's bonus
        with torch.no_grad():
            kv = draft.context_kv(draft.context(aux[:s - 1]), torch.arange(s - 1))
            ids = torch.tensor([int(seq[s - 1])] + [draft.cfg.mask_token_id] * k)
            h = draft(ids, torch.arange(s - 1, s + k), kv, torch.zeros(k + 1, dtype=torch.long),
                      torch.full((k + 1,), s - 2), block=k + 1)
        drafts = draft.logits(h[1:]).argmax(-1).tolist()[:m if to_the_end else k]
        accepted = next((i for i, d in enumerate(drafts) if d != ref[t + i]), len(drafts))
        counts[0] += 1
        for i in range(accepted):
            counts[1 + i] += 1
        t += accepted + 1
    return counts


def test_the_replay_on_the_training_forward_counts_what_one_block_at_a_time_counts(fitted):
    """eyas.dflash.replay (every anchor's block in one forward, each seeing its context band,
    as training runs them) against drafting one block at a time from the teacher-forced
    prefix, as serving does: the same rounds, the same counts, for every k."""
    from eyas.dflash.replay import replay_dflash

    model, prompts, refs, draft = fitted
    for prompt, ref in zip(prompts, refs):
        got = replay_dflash(model, model.model.layers, model.model.norm, draft, prompt.ids,
                            ref, (1, 3, 5))
        for k, (drafts, accepted) in got.items():
            want = replayed_acceptance(model, draft, prompt.ids, ref, k, 0, to_the_end=True)
            assert [drafts, *accepted] == want, (prompt.id, k)
    assert sum(sum(a) for _, a in got.values()) > 0  # the fitted draft is accepted somewhere
    # and the blocks themselves: the logits of one forward over several anchors equal each
    # block drafted alone from its prefix (a block that saw one context key more or less
    # would differ here even where its argmax does not)
    from eyas.dflash.replay import block_logits
    from eyas.targets.taps import AuxTaps

    prompt, ref = prompts[0], refs[0]
    seq = torch.cat([prompt.ids, torch.tensor(ref)])
    taps = AuxTaps(model.model.layers, model.model.norm, draft.cfg.aux_layer_ids, 8, final=False)
    with torch.no_grad(), taps.attached():
        model(seq[None])
    aux = taps.collect("cpu")[0].flatten(1)
    p, k = len(prompt.ids), 3
    anchors = torch.tensor([p, p + 4, p + 9])
    with torch.no_grad():
        kv_all = draft.context_kv(draft.context(aux), torch.arange(len(seq)))
        together = block_logits(draft, kv_all, seq, anchors, k)
        for got_a, a in zip(together, anchors.tolist()):
            kv = draft.context_kv(draft.context(aux[:a]), torch.arange(a))
            ids = torch.tensor([int(seq[a])] + [draft.cfg.mask_token_id] * k)
            h = draft(ids, torch.arange(a, a + k + 1), kv, torch.zeros(k + 1, dtype=torch.long),
                      torch.full((k + 1,), a - 1), block=k + 1)
            torch.testing.assert_close(got_a, draft.logits(h[1:]), rtol=1e-4, atol=1e-4)


def test_eval_counts_dflash_acceptance_as_replayed_and_stays_lossless(fitted, tmp_path):
    from eyas.evaluate import EvalConfig
    from eyas.serve.eval_measure import run_eval

    model, prompts, refs, draft = fitted
    cfg = EvalConfig(target="tiny", data="unused", out=str(tmp_path), draft="in-memory",
                     k=(1, 3), max_new_tokens=16, batch_size=1, ngram=False, replay=False)
    report = run_eval(model, model.model.layers, model.model.norm, draft, prompts, cfg)
    assert report.primary == "dflash" and report.lossless is True
    for k in (1, 3):
        total = [sum(c) for c in zip(*(replayed_acceptance(model, draft, p.ids, r, k, 16)
                                       for p, r in zip(prompts, refs)))]
        measured = next(r for r in report.results if r.method == "dflash" and r.k == k)
        want = [a / total[0] for a in total[1:]]  # the report rounds to 4 places
        assert measured.per_position_acceptance == pytest.approx(want, abs=1e-4)
        assert measured.mean_acceptance_length == pytest.approx(1 + sum(want), abs=1e-4)
    rates = report.per_position_acceptance["3"]
    assert report.mean_acceptance_length["3"] > 1.3 and 0 < rates[1] < rates[0] < 1
    # with --replay the report has DFlash's replayed column too (rounds over each output)
    from dataclasses import replace

    from eyas.serve.eval_measure import measure

    raw = measure(model, model.model.layers, model.model.norm, draft, prompts,
                  replace(cfg, replay=True))
    for k in (1, 3):
        rows = [replayed_acceptance(model, draft, p.ids, out, k, 0, to_the_end=True)
                for p, out in zip(prompts, raw.outputs["target", 0])]
        assert [(r[0], r[1:]) for r in rows] == [tuple(c) for c in raw.replayed[k]]


def test_batched_dflash_equals_batch_one(fitted):
    """eyas.serve.batched with the DFlash drafter: token for token and counter for counter the
    batch-1 loop, on prompts of different lengths (rows accept different counts and fall out
    of step), in float32 at T=0."""
    from eyas.serve.batched import BatchTarget, generate_batch
    from eyas.serve.dflash_drafter import BatchDFlashDrafter, DFlashDrafter
    from eyas.serve.speculate import Sampling, TargetRunner, generate_speculative

    model, prompts, _, draft = fitted
    layers, norm, ids = model.model.layers, model.model.norm, draft.cfg.aux_layer_ids
    runner = TargetRunner(model, layers, norm, ids)
    for k in (1, 3):
        single = [generate_speculative(runner, DFlashDrafter(draft, "cpu"), p.ids, k, 16,
                                       frozenset(), Sampling()) for p in prompts]
        assert sum(g.stats.accepted_per_position[k - 1] for g in single) > 0
        got = generate_batch(BatchTarget(model, layers, norm, ids),
                             BatchDFlashDrafter(draft, "cpu"), [p.ids for p in prompts], k, 16,
                             frozenset(), Sampling())
        for b, s in zip(got, single, strict=True):
            assert b.tokens == s.tokens
            assert (b.stats.drafts, b.stats.accepted, b.stats.accepted_per_position) == \
                (s.stats.drafts, s.stats.accepted, s.stats.accepted_per_position)


def test_batched_dflash_drafter_gives_the_batch_one_distributions(fitted):
    """Two rounds of proposals over rows of different lengths receiving different numbers of
    new target states: every row's draft distributions (T = 1) equal the batch-1 drafter's,
    not only their argmax."""
    from eyas.serve.dflash_drafter import BatchDFlashDrafter, DFlashDrafter
    from eyas.serve.speculate import Sampling
    from eyas.targets.taps import AuxTaps

    model, prompts, refs, draft = fitted
    taps = AuxTaps(model.model.layers, model.model.norm, draft.cfg.aux_layer_ids, 8, final=False)
    seqs, auxs = [], []
    for p, r in zip(prompts[:4], refs):
        seq = torch.cat([p.ids, torch.tensor(r)])
        with torch.no_grad(), taps.attached():
            model(seq[None])
        seqs.append(seq)
        auxs.append(taps.collect("cpu")[0].flatten(1))
    t1 = Sampling(temperature=1.0, generator=torch.Generator().manual_seed(0),
                  draft_sampling="probabilistic")
    batch = BatchDFlashDrafter(draft, "cpu")
    batch.begin(4, 64)
    singles = [DFlashDrafter(draft, "cpu") for _ in seqs]
    for d in singles:
        d.begin()
    ends = [len(p.ids) for p in prompts[:4]]  # the first call: the prompt's states
    for more in (None, (1, 3, 2, 4)):  # then each row accepted a different number
        starts = [0] * 4 if more is None else ends
        ends = ends if more is None else [e + m for e, m in zip(ends, more)]
        rows = [s[:e + 1].tolist() for s, e in zip(seqs, ends)]
        new = [a[s:e] for a, s, e in zip(auxs, starts, ends)]
        got = batch.propose(rows, new, 3, [t1] * 4)
        for d, row, aux, g in zip(singles, rows, new, got):
            want = d.propose(torch.tensor(row), aux, 3, t1)
            torch.testing.assert_close(g.probs, want.probs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_dflash_two_ranks_equal_one_process_with_accumulation(parallel, dflash_inputs, tmp_path):
    """torchrun with 2 ranks (gloo, CPU) x accumulation 1 makes the updates of one process x
    accumulation 2, under DDP and under FSDP2: the same micro-batches draw the same blocks
    (seeded by their global index) and the loss is normalised by the whole step's weight."""
    from safetensors.torch import load_file
    from test_train_dist import _torchrun

    from eyas.store import checkpoint
    from eyas.train import train

    kw = dict(max_steps=2, eval_every=100, save_every=2, num_workers=0)
    train(_dflash_train_cfg(dflash_inputs, tmp_path / "one", grad_accum=2, **kw))
    _torchrun(tmp_path, _dflash_train_cfg(dflash_inputs, tmp_path / "two", parallel=parallel,
                                          **kw))
    a = load_file(str(checkpoint.step_dir(tmp_path / "one", 2) / "draft.safetensors"))
    b = load_file(str(checkpoint.step_dir(tmp_path / "two", 2) / "draft.safetensors"))
    assert a.keys() == b.keys()
    for k in a:  # FSDP2 reduce-scatters in another order than DDP's all-reduce
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_dflash_fsdp_resume_on_two_ranks_ends_where_one_process_does(dflash_inputs, tmp_path):
    """A one-process run's step-2 checkpoint, resumed on 2 FSDP2 ranks (the same global batch),
    reaches the uninterrupted run's step-4 weights: the sharded resume restores the draft,
    AdamW's moments, the schedule and the data position."""
    import shutil

    from safetensors.torch import load_file
    from test_train_dist import _records_to, _torchrun

    from eyas.store import checkpoint
    from eyas.train import train

    kw = dict(max_steps=4, eval_every=100, save_every=2, num_workers=0)
    train(_dflash_train_cfg(dflash_inputs, tmp_path / "one", grad_accum=2, **kw))
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "one", part)
    checkpoint.clear_after(part, 2)  # as if killed after step 2's checkpoint
    step2 = checkpoint.step_dir(part, 2) / "draft.safetensors"
    kept, written = _records_to(part, 2), step2.stat().st_mtime_ns
    _torchrun(tmp_path, _dflash_train_cfg(dflash_inputs, part, parallel="fsdp", **kw,
                                          resume=str(checkpoint.step_dir(part, 2))))
    # it resumed, not started over: steps 1-2 were neither logged nor saved again
    assert _records_to(part, 2) == kept and step2.stat().st_mtime_ns == written
    a = load_file(str(checkpoint.step_dir(tmp_path / "one", 4) / "draft.safetensors"))
    b = load_file(str(checkpoint.step_dir(part, 4) / "draft.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    train_rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()
                  if json.loads(x)["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    # the resumed part's seconds go on from step 2's
    assert train_rows[2]["elapsed_s"] >= train_rows[1]["elapsed_s"] > 0


def test_a_micro_batch_without_blocks_still_reaches_every_parameter():
    """A micro-batch with no anchor (no supervised token inside a document) must give every
    trainable parameter a gradient, zero, as DDP and FSDP2 need the same set on every rank."""
    from eyas.dflash.objective import Blocks, dflash_forward

    draft = make_dflash()
    t = 12
    batch = {"aux_hidden": torch.randn(1, t, 3 * 64), "position_ids": torch.arange(t)[None]}
    empty = torch.zeros(0, dtype=torch.long)
    blocks = Blocks(ids=empty, positions=empty, lo=empty, hi=empty, labels=empty,
                    weight=torch.zeros(0), greedy=empty, valid=torch.zeros(0, dtype=torch.bool))
    out = dflash_forward(draft, batch, blocks)
    out.loss_sum.backward()
    trainable = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    assert len(trainable) > 10
    missing = [n for n, p in trainable if p.grad is None]
    assert not missing, missing
    assert all(float(p.grad.abs().sum()) == 0.0 for _, p in trainable)
    assert float(out.loss_sum.detach()) == 0.0 and float(out.weight_sum) == 0.0
