"""Shared fixtures: the tiny tokenizer and tiny saved targets of every architecture."""

from __future__ import annotations

import pytest
import torch

from eyas.tiny import TINY_ARCHS, build_tiny_model, tiny_tokenizer


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
    from eyas.kimi_like import build_kimi_like

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
