"""vLLM serves the DFlash draft eyas trained: a checkpoint in the folder `eyas train --draft
dflash` leaves, written by `eyas export`, built by vLLM's own `DFlashQwen3ForCausalLM`
(vllm/model_executor/models/qwen3_dflash.py, `method: "dflash"`) on CPU, computes the same
block hidden states and logits as eyas's `DFlashDraft` from the same target taps and block.

vLLM's path, as its DFlash proposer drives it (vllm/v1/spec_decode/dflash.py):
`combine_hidden_states` (fc) on the taps, `precompute_and_store_context_kv` (hidden_norm, every layer's k/v projection,
k_norm and RoPE at the context positions, written into each layer's KV cache), then the model
on the block [bonus, MASK x k] at the positions after the context, non-causal over the cache,
and `compute_logits` through the target's lm_head. eyas's path: `context`, `context_kv`, the
forward with the whole context visible, `logits`; and eyas eval's `DFlashDrafter`, step by step.

GPU-only pieces are replaced as in test_export.vllm_cpu_model, plus two for DFlash: the paged
KV cache of each layer becomes `_CachedBlockAttention` (the context K/V vLLM writes, then exact
non-causal attention of the block over [context; block], what FLASH_ATTN runs with
causal=False), and the two CUDA kernels `precompute_and_store_context_kv` calls
(`_custom_ops.rms_norm`, `_custom_ops.rotary_embedding`) run as vLLM's own native versions.
Everything else is vLLM's code. Off by default (`-m vllm`); docs/export.md says how to run it.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from eyas.dflash.config import DFlashConfig
from eyas.dflash.model import DFlashDraft
from eyas.export import ExportConfig, export
from eyas.store import checkpoint
from eyas.store.manifest import write_manifest

pytestmark = pytest.mark.vllm

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {  # target arch, draft shape: taps != layers, GQA, head_dim * heads != hidden (qwen3)
    "llama-5taps-2layers": ("llama", dict(aux_layer_ids=(1, 2, 4, 6, 8), num_hidden_layers=2)),
    "qwen3-3taps-3layers": ("qwen3", dict(aux_layer_ids=(2, 4, 5), num_hidden_layers=3)),
    "llama-llama3-rope": ("llama", dict(aux_layer_ids=(2, 5, 7), num_hidden_layers=1,
                                        rope_scaling=LLAMA3_ROPE)),
}


def make_dflash_run(folder, target_dir, arch: str, cfg: DFlashConfig) -> DFlashDraft:
    """A run folder as `eyas train --draft dflash` leaves it (its checkpoint record and train
    manifest), holding a draft with random weights everywhere (norms too, so a swapped or
    missing norm shows). Returns that draft."""
    torch.manual_seed(0)
    draft = DFlashDraft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    opt = torch.optim.AdamW(draft.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    record = {"draft": "dflash", **cfg.to_dict()}  # as dflash_train writes draft_config.json
    checkpoint.save(folder, 10, draft, opt, sched, draft_config=record, state={"step": 10},
                    metrics={}, keep_last=5, best_step=10)
    target = {"name_or_path": str(target_dir), "revision": None, "commit": None,
              "model_type": arch, "num_hidden_layers": 8, "hidden_size": cfg.hidden_size,
              "vocab_size": cfg.vocab_size, "tokenizer_hash": "t"}
    write_manifest(folder, "train", {"lr": 1e-4, "data": "captured/", "trust_remote_code": False},
                   target=target, aux_layer_ids=list(cfg.aux_layer_ids), draft="dflash",
                   steps=10, best={"step": 10, "acceptance_length": 2.0})
    return draft


class _CachedBlockAttention(nn.Module):
    """One DFlash layer's paged attention for one request on CPU: keeps the context K/V that
    `precompute_and_store_context_kv` writes through `impl.do_kv_cache_update`, and attends
    the block's queries, non-causally, over [context; block] keys."""

    def __init__(self, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.kv_cache = None
        self.ctx_k, self.ctx_v = [], []

    @property
    def impl(self):  # vLLM calls attn.impl.do_kv_cache_update(attn, k, v, cache, slots)
        return self

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.ctx_k.append(key.reshape(-1, self.kv_heads, self.head_dim))  # (M, kv, d)
        self.ctx_v.append(value.reshape(-1, self.kv_heads, self.head_dim))

    def forward(self, q, k, v, *args, **kwargs):  # (N, heads*d), (N, kv*d), (N, kv*d)
        n, rep, d = q.shape[0], self.heads // self.kv_heads, self.head_dim
        keys = torch.cat([*self.ctx_k, k.view(n, self.kv_heads, d)])  # (M + N, kv, d)
        values = torch.cat([*self.ctx_v, v.view(n, self.kv_heads, d)])
        q = q.view(n, self.heads, d).transpose(0, 1)
        keys, values = (t.transpose(0, 1).repeat_interleave(rep, 0) for t in (keys, values))
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values)  # non-causal
        return out.transpose(0, 1).reshape(n, self.heads * d)


class _NativeOps:
    """The two CUDA kernels of `precompute_and_store_context_kv`, as vLLM's own torch code:
    `ir.ops.rms_norm` (what RMSNorm.forward_native runs) and RotaryEmbedding.forward_static
    (what forward_native runs), with the kernels' out-parameter / in-place conventions."""

    @staticmethod
    def rms_norm(out, x, weight, eps):
        from vllm import ir

        out.copy_(ir.ops.rms_norm(x, weight, eps, None))

    @staticmethod
    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        q, k = RotaryEmbedding.forward_static(positions, query, key, head_size,
                                              cos_sin_cache.shape[-1], cos_sin_cache, is_neox)
        query.copy_(q)
        if key is not None:
            key.copy_(k)


def exported_pair(tmp_path, tiny_model_dir, monkeypatch, variant):
    """(cfg, eyas's trained draft, vLLM's DFlashQwen3ForCausalLM built from its `eyas export`
    folder), both holding the target's embedding and lm_head."""
    from test_export import vllm_cpu_model
    from transformers import AutoConfig
    from vllm.model_executor.models import qwen3_dflash
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        pytest.skip("vLLM's CPU build (vllm-cpu) writes DFlash's context K/V through its own "
                    "grouped CPU kernels, which these stand-ins (written for a CUDA build's "
                    "classes on a CPU) do not replace; there tests/test_vllm_serve_cpu.py "
                    "serves the DFlash export through the real engine instead")

    arch, shape = VARIANTS[variant]
    target_dir = tiny_model_dir(arch)
    target = AutoConfig.from_pretrained(target_dir)
    cfg = DFlashConfig.from_target(target, mask_token_id=target.vocab_size - 1, block_size=4,
                                   **shape)
    trained = make_dflash_run(tmp_path / "run", target_dir, arch, cfg)
    out = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "d"),
                              dtype="fp32"))
    monkeypatch.setattr(qwen3_dflash, "ops", _NativeOps)
    vllm_draft = vllm_cpu_model(qwen3_dflash.DFlashQwen3ForCausalLM, target_dir, out,
                                load_file(str(out / "model.safetensors")).items(),
                                method="dflash", attention=_CachedBlockAttention)
    vllm_draft.model._build_fused_kv_buffers()  # its cache writes now reach the stand-ins
    # the target's embedding and lm_head, which vLLM shares into the draft (the export has
    # neither, so has_own_embed_tokens / has_own_lm_head are false)
    target_weights = load_file(str(target_dir / "model.safetensors"))
    embed, head = target_weights["model.embed_tokens.weight"], target_weights["lm_head.weight"]
    vllm_draft.model.embed_tokens.weight.data.copy_(embed)
    vllm_draft.lm_head.weight.data.copy_(head)
    trained.set_target(embed, head)
    return cfg, trained.eval(), vllm_draft


def vllm_block(vllm_draft, cfg, aux, ctx_pos, bonus: int):
    """One step of vLLM's DFlash proposer: the new context into the cache, then the block
    [bonus, MASK x k] at the positions after the last context one (copy_and_expand_dflash_
    inputs_kernel: last_target_pos + 1 + offset). Returns (hidden (1+k, H), logits (1+k, V))."""
    k = cfg.block_size - 1
    vllm_draft.precompute_and_store_context_kv(vllm_draft.combine_hidden_states(aux), ctx_pos,
                                               ctx_pos)  # slots = positions: one request
    block = torch.tensor([bonus] + [cfg.mask_token_id] * k)
    hidden = vllm_draft(block, torch.arange(k + 1) + int(ctx_pos[-1]) + 1)
    return hidden, vllm_draft.compute_logits(hidden)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_vllm_runs_the_dflash_export_as_eyas_does(tmp_path, tiny_model_dir, monkeypatch, variant):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config)

    cfg, trained, vllm_draft = exported_pair(tmp_path, tiny_model_dir, monkeypatch, variant)
    # what vLLM reads from the folder besides the weights: the MASK slots' token, the taps
    # (the function both model runners use), the full target vocabulary, the fc width
    hf = vllm_draft.config
    assert hf.dflash_config["mask_token_id"] == cfg.mask_token_id
    assert get_eagle3_aux_layers_from_config(SimpleNamespace(
        draft_model_config=SimpleNamespace(hf_config=hf))) == cfg.aux_layer_ids
    assert vllm_draft.draft_id_to_target_id is None
    n = len(cfg.aux_layer_ids)
    assert tuple(vllm_draft.model.fc.weight.shape) == (cfg.hidden_size, n * cfg.hidden_size)

    g = torch.Generator().manual_seed(1)
    m, k = 9, cfg.block_size - 1
    aux = torch.randn(m, n * cfg.hidden_size, generator=g)
    bonus = int(torch.randint(0, cfg.vocab_size - 1, (1,), generator=g))
    with torch.no_grad():
        hidden, logits = vllm_block(vllm_draft, cfg, aux, torch.arange(m), bonus)
        kv = trained.context_kv(trained.context(aux), torch.arange(m))
        block = torch.tensor([bonus] + [cfg.mask_token_id] * k)
        ours = trained(block, torch.arange(m, m + k + 1), kv, torch.zeros(k + 1, dtype=torch.long),
                       torch.full((k + 1,), m - 1), block=k + 1)  # (1+k, H): all context seen
        ours_logits = trained.logits(ours)
    assert torch.allclose(hidden, ours, atol=1e-5, rtol=1e-5)
    assert torch.allclose(logits, ours_logits, atol=1e-4, rtol=1e-5)
    assert torch.equal(logits[1:].argmax(-1), ours_logits[1:].argmax(-1))  # the k drafts


def test_eval_drafter_proposes_what_vllm_drafts(tmp_path, tiny_model_dir, monkeypatch):
    """eyas eval's DFlashDrafter (its own context cache, positions and block) over two steps, a
    prefill then a verified step, gives vLLM's drafts at T=0 and its distributions at T=1."""
    pytest.importorskip("vllm")
    from eyas.serve.dflash_drafter import DFlashDrafter
    from eyas.serve.speculate import Sampling

    cfg, trained, vllm_draft = exported_pair(tmp_path, tiny_model_dir, monkeypatch,
                                             "llama-5taps-2layers")
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size - 1, (10,), generator=g)
    aux = torch.randn(9, len(cfg.aux_layer_ids) * cfg.hidden_size, generator=g)  # positions 0..8
    greedy, sampled = DFlashDrafter(trained, "cpu"), DFlashDrafter(trained, "cpu")
    greedy.begin()
    sampled.begin()
    for seen, s in ((0, 6), (5, 10)):  # aux of positions seen..s-2, bonus token at s-1
        with torch.no_grad():
            _, logits = vllm_block(vllm_draft, cfg, aux[seen:s - 1], torch.arange(seen, s - 1),
                                   int(tokens[s - 1]))
        at_zero = greedy.propose(tokens[:s], aux[seen:s - 1], cfg.block_size - 1, Sampling())
        at_one = sampled.propose(tokens[:s], aux[seen:s - 1], cfg.block_size - 1,
                                 Sampling(temperature=1.0, generator=torch.Generator(),
                                          draft_sampling="probabilistic"))
        assert at_zero.tokens == logits[1:].argmax(-1).tolist()
        assert torch.allclose(at_one.probs, logits[1:].softmax(-1), atol=1e-6)
