"""`eyas capture`: run the target over prepared samples and store what the draft trains on.

Per token: the residual stream entering the aux decoder layers (vLLM ids, default
(2, L//2, L-3); id L is the last layer's output before the final norm), the final hidden state
after the final norm, and the target's top-1 next-token id. The target is the transformers
model itself (`eyas.targets.models.load_target`); hooks on its decoder layers and final norm keep only
those tensors, and top-1 comes from the lm_head run over chunks of tokens so that (N, V)
logits never exist at once. Samples are packed by length into `batch_tokens`-token batches,
either flattened with position resets (when the attention honours them: checked, not assumed)
or right-padded with an attention mask. On GPU, results are copied to pinned host memory on a
side stream and writer threads (`eyas.store.shard_writer.PartWriter`) write safetensors parts while
the next batches run. Files appear atomically, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.config import (DEVICE_MAP_STRATEGIES, ConfigError, check_choices, check_device_name,
                         option, out_option, required, revision_option, target_option,
                         trust_remote_code_option)
from eyas.errors import EyasError
from eyas.store.manifest import (check_out, check_same_target, read_manifest, target_record,
                                 write_manifest)
from eyas.serve.vllm_generate import check_engine_options, engine_options
from eyas.store import shard_state, shards
from eyas.store.shard_writer import PartWriter
from eyas.store.prepared import load_split
from eyas.targets.capture_forward import (capture_samples, forward_batches,
                                          iter_captured_batches, output_device)

log = logging.getLogger(__name__)

MODEL_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # models.load_target names


@dataclass(frozen=True)
class CaptureConfig:
    """Run the target over a prepared folder and write aux/final hidden states to shards."""

    target: str = target_option()
    data: str = required("prepared folder written by `eyas prepare`")
    out: str = out_option("capture folder (several --shard jobs may share it)")
    revision: str | None = revision_option()
    trust_remote_code: bool = trust_remote_code_option()
    split: str = option("train", "which prepared split to capture", choices=("train", "eval", "all"))
    aux_layer_ids: tuple[int, ...] = option(
        (), "aux layers in vLLM's convention (id k = residual entering layer k; id L = last "
            "layer output before the final norm), any number of them (EAGLE-3 trains on 3, "
            "DFlash on any); empty = EAGLE-3's (2, L//2, L-3), or DFlash's with --dflash-taps")
    dflash_taps: int = option(0, "without --aux-layer-ids: capture DFlash's default layout of "
                                 "N taps (one per draft layer; 5 in the public recipes), "
                                 "layer outputs spread from 1 to L-3 = vLLM ids 2..L-2; "
                                 "0 = EAGLE-3's three")
    dtype: str = option("bf16", "storage dtype of aux states (fp8 = e4m3 with per-token scales)",
                        choices=("bf16", "fp8"))
    model_dtype: str = option("bf16", "dtype the target runs in", choices=tuple(MODEL_DTYPES))
    batch_tokens: int = option(16384, "tokens per forward pass (padding included)")
    packing: str = option("auto", "flat = one row with position resets (needs varlen attention); "
                          "padded = length-sorted rows + mask; auto = flat only where it is "
                          "verified to match per-sample forwards under flash attention",
                          choices=("auto", "flat", "padded"))
    attn_implementation: str | None = option(
        None, "attention kernel for the target, e.g. flash_attention_2 (enables flat packing); "
              "default: transformers' choice (sdpa)")
    device: str | None = option(None, "device for the target (default: cuda if present, else cpu)")
    device_map: str | None = option(None, "'auto' spreads a big target over all GPUs (accelerate)")
    shard: str = option("0/1", "I/N: this job captures every N-th sample from I, into the shared "
                        "--out; run N jobs (any order, any machines) to capture everything")
    file_mb: float = option(1024.0, "approximate size of one shard part file in MiB")
    writer_threads: int = option(3, "part files written at once (each copies into the page "
                                    "cache, fsyncs and hashes on its own threads); each holds "
                                    "about --file-mb of pinned host memory")
    limit: int | None = option(None, "capture only the first N samples of the split (trials)")
    backend: str = option("transformers", "transformers: run the target here; vllm: a vLLM "
                          "engine in this process (vllm.LLM with its hidden-state extraction; "
                          "needs vLLM >= 0.18; docs/capture.md)", choices=("transformers", "vllm"))
    tensor_parallel_size: int = option(1, "vllm backend: GPUs the engine shards the target over")
    gpu_memory_utilization: float = option(0.9, "vllm backend: share of each GPU's memory the "
                                                "engine may take (weights + KV cache)")
    max_model_len: int = option(0, "vllm backend: longest row in tokens (rows that do not fit "
                                   "are set aside); 0 = the target's max_position_embeddings")
    kv_cache_gib: float = option(0.0, "vllm backend: the engine's KV cache in GiB; set, vLLM "
                                 "skips its start-up memory profile (which fails when another "
                                 "process on the GPU frees memory meanwhile); that share "
                                 "must still be free at its start (vLLM 0.24); 0 = sized "
                                 "by --gpu-memory-utilization")
    vllm_args: str = option("", "vllm backend: more vllm.LLM keyword arguments as a JSON object, "
                                "e.g. '{\"limit_mm_per_prompt\": {\"image\": 0}}' to start a "
                                "multimodal wrapper text-only (capture reads text), "
                                "'{\"enforce_eager\": true}'; eyas's own settings (the "
                                "extraction, prefix caching and chunked prefill off) cannot be "
                                "overridden")
    overwrite: bool = option(False, "delete a capture in --out that was made with other settings "
                                    "(otherwise that is an error)")

    def __post_init__(self):
        check_choices(self)
        if self.batch_tokens < 1:
            raise ConfigError(f"batch_tokens must be >= 1, got {self.batch_tokens}")
        if not 0 < self.file_mb < math.inf:  # nan too: a library call skips the CLI's check
            raise ConfigError(f"file_mb must be a finite number > 0, got {self.file_mb}")
        if self.writer_threads < 1:
            raise ConfigError(f"writer_threads must be >= 1, got {self.writer_threads}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1 (or unset), got {self.limit}")
        if self.aux_layer_ids:
            from eyas.targets.taps import validate_aux_layer_ids

            validate_aux_layer_ids(self.aux_layer_ids, None, count=None)
        if self.dflash_taps < 0 or (self.dflash_taps and self.aux_layer_ids):
            raise ConfigError(f"--dflash-taps {self.dflash_taps}: give a count >= 1 and no "
                              f"--aux-layer-ids (those name the layers themselves), or 0")
        self.shard_index()  # validates the I/N spelling
        check_engine_options(self)
        check_device_name(self.device, "--device")
        check_device_name(self.device_map, "--device-map", also=DEVICE_MAP_STRATEGIES)
        if self.backend == "vllm" and (self.device or self.device_map or self.attn_implementation
                                       or self.packing != "auto"):
            raise ConfigError("--device, --device-map, --attn-implementation and --packing are "
                              "transformers-backend options: the vllm backend's engine batches "
                              "and places the target by itself (--tensor-parallel-size); drop them")
        if self.vllm_args and self.backend != "vllm":
            raise ConfigError("--vllm-args is for --backend vllm; drop it or add --backend vllm")
        vllm_engine_args(self.vllm_args)  # refuses what is not a JSON object of free settings

    def shard_index(self) -> tuple[int, int]:
        """(I, N) from `shard`."""
        try:
            i, n = (int(x) for x in self.shard.split("/"))
        except ValueError:
            raise ConfigError(f"shard must look like I/N (e.g. 0/4), got {self.shard!r}") from None
        if n < 1 or not 0 <= i < n:
            raise ConfigError(f"shard {self.shard!r}: need 0 <= I < N, e.g. --shard 0/{max(n, 1)}")
        return i, n


# ---------------------------------------------------------------------------------------------
# entry points


# options that change how and where a capture runs, batches and writes, not the states it
# stores (what its jobs need not agree on, `_settings`: batch sizes, packing, the attention
# kernel, devices and the engine's memory may differ between a run and its resume, as between
# its --shard jobs: docs/capture.md; the shard a job wrote, and --overwrite): left out of the
# manifest's id and of `eyas run`'s config comparison (eyas.freshness.changed_options), so
# that setting one on a finished capture does not make every later step run again
CaptureConfig.RESULT_NEUTRAL = frozenset({
    "batch_tokens", "file_mb", "writer_threads", "shard", "overwrite", "packing",
    "attn_implementation", "device", "device_map", "tensor_parallel_size",
    "gpu_memory_utilization", "kv_cache_gib"})


def capture(cfg: CaptureConfig) -> dict:
    """Capture `cfg.split` of the prepared folder into `cfg.out`; returns the summary stats."""
    from eyas.targets.models import load_config, load_target, load_tokenizer

    check_out(cfg.out, "capture", own=shards.FILES, unfinished=shards.FILES)  # before loading
    prepared = read_manifest(cfg.data, step="prepare")
    tokenizer = load_tokenizer(cfg.target, revision=cfg.revision,
                               trust_remote_code=cfg.trust_remote_code)
    config = load_config(cfg.target, revision=cfg.revision,
                         trust_remote_code=cfg.trust_remote_code)
    what = f"the prepared folder {cfg.data}"
    # Before loading a possibly huge model: token ids from another tokenizer mean nothing
    # here, nor a model of another shape behind the same tokenizer (an 8B's prepared folder
    # used with the 70B loaded all of the 70B before it was refused)
    check_same_target(prepared.get("target"), target_record(cfg.target, cfg.revision,
                                                            config=config, tokenizer=tokenizer,
                                                            weights=False),
                      what, weights=False)
    dataset, split_rows = load_split(cfg.data, cfg.split, cfg.limit)
    _check_rows(cfg, len(dataset))
    if cfg.backend == "vllm":
        return _capture_vllm(cfg, prepared, tokenizer, config, dataset, split_rows)
    _check_settings_before_loading(cfg, tokenizer, prepared, config)
    model, info = load_target(cfg.target, revision=cfg.revision,
                              trust_remote_code=cfg.trust_remote_code,
                              dtype=MODEL_DTYPES[cfg.model_dtype], device_map=cfg.device_map,
                              device=_default_device(cfg))
    if cfg.attn_implementation:
        try:
            model.set_attn_implementation(cfg.attn_implementation)
        except (ValueError, ImportError) as err:  # transformers' word on what this model takes
            raise ConfigError(f"--attn-implementation {cfg.attn_implementation!r}: {err}") from None
    target = target_record(cfg.target, cfg.revision, config=model.config, tokenizer=tokenizer)
    check_same_target(prepared.get("target"), target, what, weights=False)
    return capture_loaded(cfg, model, info, dataset, target=target, inputs=[prepared],
                          split_rows=split_rows)


def _check_rows(cfg: CaptureConfig, rows: int) -> None:
    """Refuse an empty split before the target loads: its capture would be a complete folder
    of 0 samples, refused only later by `eyas train`."""
    if rows:
        return
    fix = {"eval": "prepare again with --eval-fraction above 0 (it holds out at least one "
                   "eval row once 2 conversations are kept), or capture --split train or all",
           "train": "capture --split eval or all, or prepare again with more conversations "
                    "kept",
           "all": "prepare again with data of which conversations are kept (its log says why "
                  "rows were set aside)"}[cfg.split]
    raise EyasError(f"--split {cfg.split} of {cfg.data} has 0 rows, so its capture would hold "
                    f"no samples; {fix}.", flag="--split")


def _check_settings_before_loading(cfg: CaptureConfig, tokenizer, prepared: dict,
                                   config=None) -> None:
    """Aux ids outside the target's layers, and a --out holding a capture of other settings
    (another target, aux ids, dtype, ...), are refused from the target's config, before its
    weights load or the vLLM engine starts (minutes, for a large one)."""
    from eyas.targets.models import inspect_model, load_config
    from eyas.targets.taps import validate_aux_layer_ids

    config = config or load_config(cfg.target, revision=cfg.revision,
                                   trust_remote_code=cfg.trust_remote_code)
    info = inspect_model(config, trust_remote_code=cfg.trust_remote_code)
    validate_aux_layer_ids(_aux_ids(cfg, info), info.num_layers, count=None)
    if cfg.overwrite or not Path(cfg.out).is_dir():
        return
    target = target_record(cfg.target, cfg.revision, config=config, tokenizer=tokenizer)
    settings = _settings(cfg, target, [prepared], _aux_ids(cfg, info), info.hidden_size)
    shard_state.check_settings(Path(cfg.out), settings, cfg.shard_index()[1])


def _capture_vllm(cfg: CaptureConfig, prepared: dict, tokenizer, config, dataset,
                  split_rows) -> dict:
    """`capture` through a vLLM engine (eyas.serve.vllm_capture): the same shards, resume and
    manifest; what vLLM's files fail is set aside with its reason. `config`: the target's,
    checked against the prepared folder's (capture)."""
    from eyas.serve.vllm_capture import VLLMCapture
    from eyas.targets.models import inspect_model
    from eyas.targets.taps import validate_aux_layer_ids

    target = target_record(cfg.target, cfg.revision, config=config, tokenizer=tokenizer)
    engine = dict(vllm_engine_args(cfg.vllm_args), **engine_options(cfg))
    info = inspect_model(config, trust_remote_code=cfg.trust_remote_code)
    aux_ids = validate_aux_layer_ids(_aux_ids(cfg, info), info.num_layers, count=None)
    _check_settings_before_loading(cfg, tokenizer, prepared, config)
    states = VLLMCapture.start(cfg.target, aux_ids, revision=cfg.revision,
                               trust_remote_code=cfg.trust_remote_code,
                               dtype=MODEL_DTYPES[cfg.model_dtype], **engine)
    try:
        return capture_loaded(cfg, states, states.info, dataset, target=target,
                              inputs=[prepared], split_rows=split_rows)
    finally:
        states.close()


# what --vllm-args may not set: the backend's own settings, and those it has options for
VLLM_OWN = ("model", "revision", "dtype", "trust_remote_code", "enable_prefix_caching",
            "enable_chunked_prefill", "speculative_config", "kv_transfer_config",
            "tensor_parallel_size", "gpu_memory_utilization", "max_model_len",
            "kv_cache_memory_bytes")


def vllm_engine_args(text: str) -> dict:
    """--vllm-args as a dict of vllm.LLM keyword arguments, or a ConfigError saying why not."""
    if not text:
        return {}
    try:
        args = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--vllm-args is not JSON ({err}): give an object, e.g. "
                          f"'{{\"enforce_eager\": true}}'") from None
    if not isinstance(args, dict):
        raise ConfigError(f"--vllm-args must be a JSON object of vllm.LLM arguments, got {text}")
    own = sorted(set(args) & set(VLLM_OWN))
    if own:
        raise ConfigError(f"--vllm-args sets {own}, which eyas capture sets itself or has "
                          f"options for (--model-dtype, --tensor-parallel-size, "
                          f"--gpu-memory-utilization, --max-model-len, --kv-cache-gib); drop "
                          f"them there")
    return args


def _aux_ids(cfg: CaptureConfig, info) -> tuple[int, ...]:
    from eyas.targets.taps import default_aux_layer_ids, dflash_aux_layer_ids

    return tuple(cfg.aux_layer_ids) or (
        dflash_aux_layer_ids(info.num_layers, cfg.dflash_taps) if cfg.dflash_taps else
        default_aux_layer_ids(info.num_layers))


def _default_device(cfg: CaptureConfig) -> str | None:
    if cfg.device_map is not None:
        return cfg.device  # accelerate placed the layers; move nothing unless asked
    return cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------
# offline capture to shards


def capture_loaded(cfg: CaptureConfig, model, info, dataset, *, target: dict | None,
                   inputs: list[dict] = (), split_rows: dict | None = None) -> dict:
    """Capture with an already loaded target (what `capture` does after loading; benchmarks
    call it directly; with --backend vllm `model` is the VLLMCapture). Resumes this shard's
    previous run; returns summary stats."""
    from eyas.targets.taps import validate_aux_layer_ids

    aux_ids = _aux_ids(cfg, info)
    validate_aux_layer_ids(aux_ids, info.num_layers, count=None)
    shard, num_shards = cfg.shard_index()
    out = check_out(cfg.out, "capture", own=shards.FILES, unfinished=shards.FILES)
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(cfg, target, inputs, aux_ids, info.hidden_size)
    rows = list(range(shard, len(dataset), num_shards))
    with _locked(out / f".shard-{shard:05d}-of-{num_shards:05d}.lock", wait=False):
        with _locked(out / ".capture.lock"):
            state = shard_state.start_shard(out, shard, num_shards, settings, len(rows),
                                            overwrite=cfg.overwrite)
        shard_state.drop_damaged(out, state)  # sha256 and headers: a damaged part is captured again
        # rows an earlier vLLM run set aside as too long, where this run fits them
        limit = model.max_model_len if cfg.backend == "vllm" else float("inf")
        shard_state.retry_set_aside(out, state, lambda r: r.get("max_model_len", limit) < limit)
        done = shard_state.done_rows(out, state)
        todo = [r for r in rows if r not in done]
        if todo:
            log.info("shard %d/%d: %d of %d samples to capture (%d done before)", shard,
                     num_shards, len(todo), len(rows), len(rows) - len(todo))
            todo = _set_aside_malformed(dataset, todo, state, out)
        if todo:
            _run_shard(cfg, model, info, dataset, todo, aux_ids, state, out)
        state["complete"] = True
        shards.write_json_atomic(out / shards.state_name(shard, num_shards), state)
    with _locked(out / ".capture.lock"):
        index = shard_state.build_index(out)
        shards.write_json_atomic(out / shards.INDEX, index)
        stats = _summary(index, state)
        write_manifest(out, "capture", cfg, target=target, inputs=inputs,
                       aux_layer_ids=list(aux_ids), hidden_size=info.hidden_size,
                       dtype=cfg.dtype, split=cfg.split, split_rows=split_rows or {},
                       shards=index["shards"], complete=index["complete"], stats=stats,
                       **({"engine": model.manifest} if cfg.backend == "vllm" else {}))
    log.info("capture %s: %d samples, %d tokens, %.1f GiB, %.0f bytes/token, %d set aside "
             "(set-aside-*.jsonl says why); shards complete: %s", out, stats["samples"],
             stats["tokens"], stats["bytes"] / 2**30, stats["bytes_per_token"], stats["nonfinite"],
             "all" if index["complete"] else index["shards"])
    return stats


def _set_aside_malformed(dataset, todo: list[int], state: dict, out: Path) -> list[int]:
    """`todo` without the rows no forward can take (empty, or lengths that disagree): each is
    set aside in the shard's report with why, counted, and the others are captured; they
    stopped the capture at their batch, after every longer row, at every rerun."""
    from eyas.serve.vllm_capture import set_aside
    from eyas.store.prepared import malformed_rows

    bad = malformed_rows(dataset, todo)
    if not bad:
        return todo
    log.warning("%d malformed prepared row(s) set aside (rows %s%s): see %s", len(bad),
                sorted(bad)[:10], " ..." if len(bad) > 10 else "",
                out / shards.report_name(state["shard"], state["num_shards"]))
    for r, why in sorted(bad.items()):
        set_aside(out, state, r, str(dataset[r]["sample_id"]), why)
    return [r for r in todo if r not in bad]


def _settings(cfg, target, inputs, aux_ids, hidden_size) -> dict:
    """What every job writing into one capture folder must agree on."""
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "tokenizer_hash",
            "commit", "gguf_fingerprint", "weights_fingerprint")
    return {"target": {k: (target or {}).get(k) for k in keys},
            "inputs": [m.get("id") for m in inputs], "split": cfg.split, "limit": cfg.limit,
            "aux_layer_ids": list(aux_ids), "dtype": cfg.dtype, "model_dtype": cfg.model_dtype,
            "hidden_size": hidden_size}


def _run_shard(cfg, model, info, dataset, todo, aux_ids, state, out):
    from tqdm.auto import tqdm

    # the vllm backend hands over CPU tensors: nothing to stage
    device = torch.device("cpu") if cfg.backend == "vllm" else output_device(model, info)
    stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
    writer = PartWriter(out, state, int(cfg.file_mb * 2**20),
                        {"aux_layer_ids": ",".join(map(str, aux_ids)), "dtype": cfg.dtype},
                        threads=cfg.writer_threads)
    lengths = [int(n) for n in dataset["num_tokens"]]
    total = sum(lengths[r] for r in todo)
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"capture {cfg.shard}",
               disable=None, dynamic_ncols=True)
    start = last_log = time.perf_counter()
    tokens, loop_s, stage_s = 0, None, 0.0
    try:
        if cfg.backend == "vllm":
            from eyas.serve.vllm_capture import set_aside

            source = model.batches(dataset, todo, cfg.batch_tokens,
                                   lambda *row, **extra: set_aside(out, state, *row, **extra))
        else:
            source = forward_batches(model, info, dataset, todo, aux_ids, cfg.batch_tokens,
                                     cfg.packing, True)
        for out_dev, host in source:
            t0 = time.perf_counter()
            stored, event = _to_host(_to_storage(out_dev, cfg.dtype), stream)
            stage_s += time.perf_counter() - t0  # mostly pinned-memory allocation, if any
            sample_ids = host.pop("sample_ids")
            writer.put(event, {**stored, **host}, sample_ids)
            n = int(host["input_ids"].numel())
            tokens += n
            bar.update(n)
            bar.set_postfix(written=f"{writer.bytes_written / 2**30:.2f}GiB", refresh=False)
            now = time.perf_counter()
            if bar.disable and now - last_log > 60:  # no terminal (batch job): log instead
                rate = tokens / (now - start)
                log.info("shard %s: %d/%d tokens, %.0f tok/s, ETA %.0f min, %.2f GiB written",
                         cfg.shard, tokens, total, rate, (total - tokens) / rate / 60,
                         writer.bytes_written / 2**30)
                last_log = now
        loop_s = time.perf_counter() - start
    finally:
        writer.close()
        bar.close()
    seconds = time.perf_counter() - start
    state["stats"] = _job_stats(tokens, seconds, loop_s, stage_s, writer)
    log.info("shard %s: %d tokens in %.1fs (%.0f tok/s); waited %.1fs on storage, %.1fs to "
             "finish the last parts; writer stages (s, summed over threads): %s", cfg.shard,
             tokens, seconds, tokens / seconds, writer.put_wait_s, seconds - loop_s,
             {k: round(v, 2) for k, v in writer.timings.items()})


def _job_stats(tokens: int, seconds: float, loop_s: float, stage_s: float, writer) -> dict:
    """This job's throughput, and where the storage path spent its time: `stage_s` (the
    forward loop converting and queueing device-to-host copies, allocating pinned memory
    on first use), `put_wait_s` (the forward loop blocked on the writer: storage is behind),
    `drain_s` (after the last forward, finishing parts),
    `writer` (seconds per stage summed over parts: layout, write (into the page cache),
    fsync, hash (on its own thread), hash_wait, order_wait, commit, copy_wait)."""
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "writer_busy_s": writer.busy_s, "put_wait_s": writer.put_wait_s, "stage_s": stage_s,
            "loop_s": loop_s, "drain_s": seconds - loop_s,
            "bytes_written": writer.bytes_written, "writer": dict(writer.timings)}


def _to_storage(out: dict, dtype: str) -> dict[str, torch.Tensor]:
    """Device tensors in their stored form: aux bf16 or fp8 + per-token per-layer scales."""
    stored = {"final_hidden": out["final_hidden"].to(torch.bfloat16),
              "target_top1": out["target_top1"], "nonfinite": out["nonfinite"]}
    if dtype == "fp8":
        stored["aux_hidden"], stored["aux_scale"] = shards.quantize_fp8(out["aux_hidden"])
    else:
        stored["aux_hidden"] = out["aux_hidden"].to(torch.bfloat16)
    return stored


def _to_host(tensors: dict, stream) -> tuple[dict, object]:
    """Start copying device tensors into pinned host memory on `stream` (so the copy overlaps
    the next forward); returns the host tensors and an event the writer waits on."""
    if stream is None:
        return {k: v.cpu() for k, v in tensors.items()}, None
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    host = {}
    with torch.cuda.stream(stream):
        for k, v in tensors.items():
            host[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            host[k].copy_(v, non_blocking=True)
            v.record_stream(stream)  # keep the device memory alive until the copy is done
        event = torch.cuda.Event()
        event.record(stream)
    return host, event


def _summary(index: dict, state: dict) -> dict:
    tokens = index["num_tokens"]
    return {"samples": index["num_samples"], "tokens": tokens, "bytes": index["num_bytes"],
            "bytes_per_token": index["num_bytes"] / max(tokens, 1),
            "nonfinite": index["nonfinite"], "files": len(index["files"]),
            "this_job": state.get("stats", {})}


@contextlib.contextmanager
def _locked(path: Path, wait: bool = True):
    """An exclusive flock on `path` (jobs sharing one --out folder take turns on its index)."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EyasError(f"another process is capturing into {path.parent} with the same "
                            f"--shard ({path.name}); wait for it or use another --shard.") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
