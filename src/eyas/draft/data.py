"""Training data, the inputs: what train reads, resolved and checked.

Sources are small classes with the same two members, `lengths` (tokens per sample, an int
array) and `fetch(ids) -> list[dict]` (per sample: aux_hidden [n, taps, Ht], final_hidden [n, Ht],
target_top1 [n], input_ids [n], loss_mask [n]): `OfflineSource` reads capture shards
(memory-mapped by `eyas.store.shards`); `OnlineSource` runs the target on the prepared samples.
`open_inputs` opens them (with the held-out eval samples, `split_eval`) and the target's frozen
embedding and lm_head (offline, read alone from its files: `target_head_weights`), checking that
captures, vocab and target belong together. The order the run reads the samples in is
eyas.draft.data_plan's; the tensors and the threads that read them, eyas.draft.data_loader's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eyas.errors import EyasError
from eyas.store.locks import main_process
from eyas.store.manifest import (check_same_target, peek_manifest, read_manifest,
                                 recorded_target, target_record)
from eyas.draft.train_config import TrainConfig

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- sources

class OfflineSource:
    """Samples of a `captured/` folder, read through `eyas.store.shards.open_capture` (mmap)."""

    def __init__(self, folder: str | Path):
        from eyas.store.shards import open_capture

        self.folder = Path(folder)
        self.capture = open_capture(self.folder)
        self.manifest = self.capture.manifest
        self.lengths = np.asarray(self.capture.sample_lengths, dtype=np.int64)

    def fetch(self, ids: list[int]) -> list[dict[str, torch.Tensor]]:
        # collate copies them; an fp8 capture's aux states stay fp8 until on_device
        return [self.capture.sample(i, copy=False, dequantize=False) for i in ids]

    def _prepared(self) -> dict:
        """The prepared folder this was captured from, as the manifest records it."""
        return next((m for m in self.manifest.get("inputs") or []
                     if m.get("step") == "prepare"), {})

    def sample_ids(self) -> list[str] | None:
        """Each sample's id (its `sample_id` in the prepared folder it was captured from), by
        sample number; None where that folder is gone or was prepared again since."""
        from eyas.store.prepared import load_split

        prepared = self._prepared()
        path = prepared.get("path")
        if not path or (peek_manifest(path) or {}).get("id") != prepared.get("id"):
            return None
        # the one column, read as arrow (walking the rows takes ~100x as long)
        ids = load_split(path, self.manifest["split"])[0].with_format("arrow")["sample_id"]
        ids = ids.to_pylist()
        return [ids[i] for i in self.capture.sample_index.tolist()]

    def rows(self) -> list[tuple]:
        """Each sample's (prepared folder id, split, row in that split), by sample number."""
        prepared = self._prepared().get("id") or str(self.folder.resolve())
        at = self.capture.split_rows.items()
        out = []
        for i in self.capture.sample_index.tolist():
            split, lo = next(((s, lo) for s, (lo, hi) in at if lo <= i < hi),
                             (self.manifest["split"], 0))  # (a capture that names no rows)
            out.append((prepared, split, i - lo))
        return out


class OnlineSource:
    """Samples of a prepared split, captured on the fly by the target inside the training job.

    `fetch` runs the target over the requested samples (one micro-batch) through
    `eyas.targets.capture_forward.capture_samples`, the code `eyas capture` runs, so online and offline
    training see the same tensors for the same data. They come back on the device of the
    target's final norm (with --target-device-map maybe not the draft's GPU); train moves
    each collated micro-batch to the draft's device. With a `cache`
    (eyas.draft.online_cache, --online-cache) the target runs once per sample it can keep.
    """

    def __init__(self, model, info, dataset, aux_layer_ids: tuple[int, ...], cache=None):
        from eyas.targets.capture_forward import output_device

        self.model, self.info, self.dataset = model, info, dataset
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.lengths = np.asarray(dataset["num_tokens"], dtype=np.int64)
        self.cache = cache
        self.device = output_device(model, info)  # where captured states come back

    def sample_ids(self) -> list[str]:
        """Each sample's id (the prepared `sample_id`), by row."""
        return self.dataset.with_format("arrow")["sample_id"].to_pylist()

    def fetch(self, ids: list[int]) -> list[dict[str, torch.Tensor]]:
        if self.cache is None:
            return self._capture(ids)
        out = [self.cache.get(i, self.device) for i in ids]
        todo = [j for j, s in enumerate(out) if s is None]
        for j, sample in zip(todo, self._capture([ids[j] for j in todo]) if todo else []):
            out[j] = self.cache.put(ids[j], sample)
        return out

    def _capture(self, ids: list[int]) -> list[dict[str, torch.Tensor]]:
        from eyas.targets.capture_forward import capture_samples

        rows = self.dataset.select(ids)
        # bf16 like a capture folder stores them: online and offline see the same numbers
        return capture_samples(self.model, self.info, rows, self.aux_layer_ids,
                               dtype=torch.bfloat16)


def split_ids(source: OfflineSource, split: str) -> np.ndarray:
    """Sample numbers of `split` ("train" or "eval") in a capture, ordered by their row in the
    prepared split: the data order then depends on the prepared rows only (not on how the
    capture batched them), so offline and online training see the same samples in the same
    order. A capture of a single split yields all of its samples for either name."""
    cap = source.capture
    ids = cap.positions(split) if source.manifest.get("split") == "all" else \
        torch.arange(cap.num_samples)
    return ids[torch.argsort(cap.sample_index[ids], stable=True)].numpy()


def check_capture(manifest: dict, *, target: dict | None, aux_layer_ids: tuple[int, ...] | None,
                  what: str, weights: bool = True) -> None:
    """Refuse a capture folder made for another target (with `weights`, also one of the same
    shape with other weights) or other aux layers, saying how to fix."""
    check_same_target(manifest.get("target"), target, what, weights=weights)
    found = tuple(manifest.get("aux_layer_ids") or ())
    if aux_layer_ids is not None and found != tuple(aux_layer_ids):
        raise EyasError(
            f"{what} ({manifest.get('path')}) holds aux layers {list(found)} but this run uses "
            f"{list(aux_layer_ids)}; capture it again with --aux-layer-ids "
            f"{','.join(map(str, aux_layer_ids))} (or train on a capture made with the same ids).")


# ---------------------------------------------------------------- what train reads

@dataclass
class Inputs:
    """Everything train reads, resolved: sample sources, ids, the frozen target pieces."""

    train: OfflineSource | OnlineSource
    train_ids: np.ndarray
    eval: OfflineSource | OnlineSource | None
    eval_ids: np.ndarray
    info: object  # eyas.targets.models.ModelInfo
    target: dict  # target_record of the target
    manifests: list[dict]  # the manifests this run consumed
    aux_layer_ids: tuple[int, ...]
    embed: torch.Tensor  # (V, Ht) frozen
    lm_head: torch.Tensor  # (V, Ht) the teacher head
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None


def open_inputs(cfg: TrainConfig, device: torch.device, model_dtype: str) -> Inputs:
    """Open the training/eval data and the target's embedding and lm_head, checking that
    captures, vocab and target belong together."""
    from eyas.store.vocab import load_vocab

    vocab = load_vocab(cfg.vocab) if cfg.vocab else None
    inputs = _online_inputs(cfg, device, model_dtype) if cfg.online else _offline_inputs(cfg)
    if vocab is not None:
        d2t, t2d, vman = vocab
        name = inputs.target.get("name_or_path")
        check_same_target(vman.get("target"), inputs.target, f"the vocab folder {cfg.vocab}",
                          weights=False, fix=f"make one for it (`eyas prepare --target {name}`, then `eyas "
                              f"vocab` on that folder: vocab has no --target)")
        inputs.d2t, inputs.t2d = d2t, t2d
        inputs.manifests.append(vman)
    shared, how = shared_eval_samples(inputs) if main_process() else (0, "")
    if shared:
        log.warning("%d of the %d eval samples are training samples too (the same %s): eval, "
                    "the best checkpoint and the acceptance quoted at export would measure "
                    "conversations the draft trained on. Give --eval-data a capture of other "
                    "conversations (e.g. `eyas capture --split eval` of the prepared folder), or "
                    "leave it out: the capture's eval split or --eval-fraction is held out",
                    shared, len(inputs.eval_ids), how)
    return inputs


def shared_eval_samples(inputs: Inputs) -> tuple[int, str]:
    """How many eval samples are training samples too, and what tells: the same id in the
    prepared folders (where they can still be read: one column, not the data), else the same
    row of the same prepared folder."""
    if inputs.eval is None or not len(inputs.eval_ids):
        return 0, ""
    train = inputs.train.sample_ids()
    ev = train if inputs.eval is inputs.train else inputs.eval.sample_ids()
    how = "sample id in the prepared data"
    if train is None or ev is None:
        train, ev, how = inputs.train.rows(), inputs.eval.rows(), "row of a prepared folder"
    seen = {train[i] for i in inputs.train_ids}
    return sum(ev[i] in seen for i in inputs.eval_ids), how


def _offline_inputs(cfg: TrainConfig) -> Inputs:
    from eyas.targets.models import load_tokenizer

    src = OfflineSource(cfg.data)
    man = src.manifest
    name = cfg.target or recorded_target(man.get("target"))
    if not name:
        raise EyasError(f"the capture {cfg.data} does not name its target; pass --target")
    revision = cfg.revision or (man.get("target") or {}).get("revision")
    where = dict(revision=revision, trust_remote_code=cfg.trust_remote_code)
    embed, lm_head, info, config = target_head_weights(name, **where)
    target = target_record(name, revision, config=config,
                           tokenizer=load_tokenizer(name, **where))
    weights = not cfg.accept_other_weights
    check_capture(man, target=target, aux_layer_ids=None, what=f"the capture {cfg.data}",
                  weights=weights)
    from eyas.config import ConfigError
    from eyas.targets.taps import validate_aux_layer_ids

    try:  # an edited manifest: ids this target does not have would go into the export
        aux = validate_aux_layer_ids(man["aux_layer_ids"], info.num_layers, count=None)
    except ConfigError as err:
        raise EyasError(f"the capture {cfg.data} records {err}; its eyas.json was edited since "
                        f"the capture wrote it: restore it, or capture again") from None
    train_ids = split_ids(src, "train")
    manifests, ev, eval_ids = [man], None, np.zeros(0, dtype=np.int64)
    if cfg.eval_data:
        ev = OfflineSource(cfg.eval_data)
        check_capture(ev.manifest, target=target, aux_layer_ids=aux,
                      what=f"--eval-data {cfg.eval_data}", weights=weights)
        eval_ids = split_ids(ev, "eval")
        if not len(eval_ids):  # a --split all capture of a prepared folder without eval rows
            raise EyasError(f"--eval-data {cfg.eval_data} holds no eval samples: it was "
                            f"captured with --split all from a prepared folder whose eval "
                            f"split is empty. Capture that folder's rows with --split train "
                            f"(every sample is then eval data), or prepare with a non-zero "
                            f"--eval-fraction and capture again", flag="--eval-data")
        manifests.append(ev.manifest)
    elif man.get("split") == "all" and len(split_ids(src, "eval")):
        ev, eval_ids = src, split_ids(src, "eval")
    elif cfg.eval_fraction > 0:
        keep, held = split_eval(len(train_ids), cfg.eval_fraction, cfg.seed)
        ev, train_ids, eval_ids = src, train_ids[keep], train_ids[held]
    return Inputs(src, train_ids, ev, eval_ids, info, target, manifests, aux, embed, lm_head,
                  None, None)


def _online_inputs(cfg: TrainConfig, device: torch.device, model_dtype: str) -> Inputs:
    from eyas.draft.online_cache import open_cache
    from eyas.store.prepared import load_split
    from eyas.targets.models import load_target, load_tokenizer, submodule
    from eyas.targets.taps import validate_aux_layer_ids

    dmap = cfg.target_device_map
    prepared = read_manifest(cfg.data, step="prepare")
    where = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    tokenizer = load_tokenizer(cfg.target, **where)
    # with a device_map transformers places every layer; moving the model after would undo it
    model, info = load_target(cfg.target, **where, dtype=model_dtype, device_map=dmap,
                              device=None if dmap is not None else device)
    placed = getattr(model, "hf_device_map", None) or {}
    if len(set(placed.values())) > 1 and {"cpu", "disk"} & {str(d) for d in placed.values()}:
        log.warning("--target-device-map %s offloaded part of the target to cpu/disk (the GPUs "
                    "cannot hold it): every training step will run those layers from host "
                    "memory. hf_device_map: %s", dmap, placed)
    target = target_record(cfg.target, cfg.revision, config=model.config, tokenizer=tokenizer)
    check_same_target(prepared.get("target"), target, f"the prepared folder {cfg.data}",
                      weights=False)
    if cfg.draft == "dflash":  # any number of taps; default: DFlash's layout, one per layer
        from eyas.targets.taps import dflash_aux_layer_ids

        aux = validate_aux_layer_ids(cfg.aux_layer_ids or dflash_aux_layer_ids(
            info.num_layers, cfg.dflash_layers or 5, "--dflash-layers"), info.num_layers,
            count=None)
    else:
        aux = validate_aux_layer_ids(cfg.aux_layer_ids or info.default_aux_layer_ids,
                                     info.num_layers)
    dataset, rows = load_split(cfg.data, "all")
    src = OnlineSource(model, info, dataset, aux)
    src.cache = open_cache(cfg.online_cache, cfg.online_cache_dtype, cfg.online_cache_gb,
                           src.device)
    train_ids = np.arange(*rows["train"])
    eval_ids = np.arange(*rows["eval"])
    if len(eval_ids) == 0 and cfg.eval_fraction > 0:
        keep, held = split_eval(len(train_ids), cfg.eval_fraction, cfg.seed, online=True)
        train_ids, eval_ids = train_ids[keep], train_ids[held]
    # left where the target keeps them: train copies the embedding and the draft-vocab rows of
    # lm_head to the draft's device (eyas.draft.train_setup.build_draft)
    embed = _resident(submodule(model, info.embed_path).weight, "embedding", dmap)
    lm_head = _resident(submodule(model, info.lm_head_path).weight, "lm_head", dmap)
    return Inputs(src, train_ids, src if len(eval_ids) else None, eval_ids, info, target,
                  [prepared], aux, embed, lm_head, None, None)


def _resident(weight: torch.Tensor, what: str, device_map: str | None) -> torch.Tensor:
    """A target weight the draft reads; refused if accelerate offloaded it (a meta tensor)."""
    if weight.device.type == "meta":
        raise EyasError(
            f"--target-device-map {device_map} offloaded the target's {what} to cpu/disk: the "
            f"visible GPUs cannot hold the target, and online training would run it from host "
            f"memory. Make more GPUs visible (CUDA_VISIBLE_DEVICES), load a smaller checkpoint "
            f"(fp8/INT4), or train offline from an `eyas capture --device-map auto` folder.")
    return weight.detach()


def split_eval(num_samples: int, fraction: float, seed: int,
               online: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (train ids, held-out ids); at least one sample is held out if fraction > 0.
    `online`: the prepared folder's rows (--eval-data, a capture, is not for --online)."""
    perm = np.random.default_rng([seed, 10**6]).permutation(num_samples)
    k = 0 if fraction <= 0 else max(1, int(round(num_samples * fraction)))
    if k >= num_samples:
        other = ("prepare more data, or prepare with --eval-fraction above 0 (its eval split "
                 "is then held out instead)") if online else "pass --eval-data"
        raise EyasError(f"--eval-fraction {fraction} leaves no training samples out of "
                        f"{num_samples}; set --eval-fraction 0 (no held-out eval, no best "
                        f"checkpoint) or {other}.")
    return np.sort(perm[k:]), np.sort(perm[:k])


# ---------------------------------------------------------------- target weights

def target_head_weights(name: str, *, revision: str | None = None,
                        trust_remote_code: bool = False):
    """(embed (V, Ht), lm_head (V, Ht), ModelInfo, config) of a target, reading only those two
    tensors from its safetensors files: the module paths come from building the model on the
    meta device, the file holding each tensor from the safetensors index. Offline training
    never loads the whole target."""
    from eyas.targets.gguf import is_gguf
    from eyas.targets.models import inspect_model, load_config, text_config
    from eyas.targets.weights import TargetWeights

    config = load_config(name, revision=revision, trust_remote_code=trust_remote_code)
    info = inspect_model(config, trust_remote_code=trust_remote_code)
    if is_gguf(name):
        return (*_gguf_head_weights(name, info, config), info, config)
    weights = TargetWeights(name, revision)

    def read(module_path: str) -> torch.Tensor | None:
        key = weights.key(f"{module_path}.weight")
        return None if key is None else weights.read(key)

    embed = read(info.embed_path)
    if embed is None:
        raise EyasError(f"cannot find the input embedding ({info.embed_path}.weight) in the "
                        f"safetensors files of {name}; train with --online.")
    head = read(info.lm_head_path) if info.lm_head_path else None
    if head is None:
        if not (info.tied_embeddings or getattr(text_config(config), "tie_word_embeddings", False)):
            raise EyasError(f"cannot find the output head ({info.lm_head_path}.weight) in the "
                            f"safetensors files of {name}; train with --online.")
        head = embed  # tied: the checkpoint stores the matrix once
    return embed, head, info, config


# GGUF names of the input embedding and output head (llama.cpp's for every architecture)
GGUF_EMBED, GGUF_HEAD = "token_embd.weight", "output.weight"


def _gguf_head_weights(name: str, info, config) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed, lm_head) de-quantized from a .gguf file, reading only those two tensors (the
    values transformers' own GGUF loader gives them: tests/test_real_model.py)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from eyas.targets.models import text_config

    tensors = {t.name: t for t in GGUFReader(name).tensors
               if t.name in (GGUF_EMBED, GGUF_HEAD)}

    def read(key: str) -> torch.Tensor | None:
        t = tensors.get(key)
        if t is None:
            return None
        return torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))

    embed = read(GGUF_EMBED)
    if embed is None or embed.shape != (info.vocab_size, info.hidden_size):
        raise EyasError(f"{name} has no {GGUF_EMBED} of shape ({info.vocab_size}, "
                        f"{info.hidden_size}); train with --online.")
    head = read(GGUF_HEAD)
    if head is None:
        if not (info.tied_embeddings or getattr(text_config(config), "tie_word_embeddings",
                                                False)):
            raise EyasError(f"{name} has no {GGUF_HEAD} and its embeddings are not tied; "
                            f"train with --online.")
        head = embed  # tied: llama.cpp stores the matrix once
    return embed, head
