"""Training data: captured samples -> shuffled, packed, rank-sharded TTT micro-batches.

The whole run's data order is a pure function of (seed, sample lengths, packing settings), so
the "data position" saved in a checkpoint is one integer: how many global micro-batches the run
has consumed. Every epoch shuffles sample ids across all shards, then packs them in that order
into rows of `row_tokens` tokens (each sample keeps its own `position_ids` from 0 and a `doc_id`
so attention never crosses samples); `rows` rows make one micro-batch. Global micro-batch `g`
belongs to rank `g % world_size`, so ranks never see the same sample in a step and a run on N
ranks with accumulation A consumes exactly the micro-batches of a 1-rank run with accumulation
N*A.

Sources are small classes with the same two members, `lengths` (tokens per sample, an int
array) and `fetch(ids) -> list[dict]` (per sample: aux_hidden [n, taps, Ht], final_hidden [n, Ht],
target_top1 [n], input_ids [n], loss_mask [n]): `OfflineSource` reads capture shards
(memory-mapped by `eyas.store.shards`); `OnlineSource` runs the target on the prepared samples.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eyas.errors import EyasError
from eyas.store.manifest import check_same_target, read_manifest, target_record
from eyas.store.shards import dequantize_fp8

# TrainConfig: from the step eyas.train, named in annotations only (a layer never imports a step)

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


class OnlineSource:
    """Samples of a prepared split, captured on the fly by the target inside the training job.

    `fetch` runs the target over the requested samples (one micro-batch) through
    `eyas.targets.capture_forward.capture_samples`, the code `eyas capture` runs, so online and offline
    training see the same tensors for the same data. They come back on the device of the
    target's final norm (with --target-device-map maybe not the draft's GPU); train moves
    each collated micro-batch to the draft's device.
    """

    def __init__(self, model, info, dataset, aux_layer_ids: tuple[int, ...]):
        self.model, self.info, self.dataset = model, info, dataset
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.lengths = np.asarray(dataset["num_tokens"], dtype=np.int64)

    def fetch(self, ids: list[int]) -> list[dict[str, torch.Tensor]]:
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
    return inputs


def _offline_inputs(cfg: TrainConfig) -> Inputs:
    from eyas.targets.models import load_tokenizer

    src = OfflineSource(cfg.data)
    man = src.manifest
    name = cfg.target or (man.get("target") or {}).get("name_or_path")
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
    aux = tuple(man["aux_layer_ids"])
    train_ids = split_ids(src, "train")
    manifests, ev, eval_ids = [man], None, np.zeros(0, dtype=np.int64)
    if cfg.eval_data:
        ev = OfflineSource(cfg.eval_data)
        check_capture(ev.manifest, target=target, aux_layer_ids=aux,
                      what=f"--eval-data {cfg.eval_data}", weights=weights)
        eval_ids = split_ids(ev, "eval")
        manifests.append(ev.manifest)
    elif man.get("split") == "all" and len(split_ids(src, "eval")):
        ev, eval_ids = src, split_ids(src, "eval")
    elif cfg.eval_fraction > 0:
        keep, held = split_eval(len(train_ids), cfg.eval_fraction, cfg.seed)
        ev, train_ids, eval_ids = src, train_ids[keep], train_ids[held]
    return Inputs(src, train_ids, ev, eval_ids, info, target, manifests, aux, embed, lm_head,
                  None, None)


def _online_inputs(cfg: TrainConfig, device: torch.device, model_dtype: str) -> Inputs:
    from eyas.store.prepared import load_split
    from eyas.targets.models import load_target, load_tokenizer, submodule, validate_aux_layer_ids

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
        from eyas.targets.models import dflash_aux_layer_ids

        aux = validate_aux_layer_ids(cfg.aux_layer_ids or dflash_aux_layer_ids(
            info.num_layers, cfg.dflash_layers or 5), info.num_layers, count=None)
    else:
        aux = validate_aux_layer_ids(cfg.aux_layer_ids or info.default_aux_layer_ids,
                                     info.num_layers)
    dataset, rows = load_split(cfg.data, "all")
    src = OnlineSource(model, info, dataset, aux)
    train_ids = np.arange(*rows["train"])
    eval_ids = np.arange(*rows["eval"])
    if len(eval_ids) == 0 and cfg.eval_fraction > 0:
        keep, held = split_eval(len(train_ids), cfg.eval_fraction, cfg.seed)
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


# ---------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Packing:
    """How samples become micro-batches: `rows` rows of `row_tokens` tokens each."""

    row_tokens: int
    rows: int
    truncate: bool


def check_lengths(lengths: np.ndarray, ids: np.ndarray, packing: Packing, what: str) -> None:
    """Every sample must fit one row unless truncation was asked for."""
    if len(ids) == 0:
        raise EyasError(f"{what} has no samples; capture more data or lower --eval-fraction.")
    longest = int(lengths[ids].max())
    if longest > packing.row_tokens and not packing.truncate:
        worst = int(ids[int(np.argmax(lengths[ids]))])
        raise EyasError(
            f"{what}: sample {worst} has {longest} tokens but a packed row holds only "
            f"{packing.row_tokens}; raise --batch-tokens (or --row-tokens) to at least {longest}, "
            f"or pass --truncate to cut long samples to the row length.")


def pack(order: np.ndarray, lengths: np.ndarray, packing: Packing) -> list[list[list[int]]]:
    """Next-fit packing of samples in `order`: micro-batches -> rows -> sample ids.

    Next-fit keeps the shuffled order (so the plan is cheap and deterministic); with rows much
    longer than a sample the tail left empty in each row is small.
    """
    batches: list[list[list[int]]] = []
    batch: list[list[int]] = []
    row: list[int] = []
    used = 0
    for i in order:
        n = min(int(lengths[i]), packing.row_tokens)
        if row and used + n > packing.row_tokens:
            batch.append(row)
            row, used = [], 0
            if len(batch) == packing.rows:
                batches.append(batch)
                batch = []
        row.append(int(i))
        used += n
    if row:
        batch.append(row)
    if batch:
        batches.append(batch)
    return batches


def epoch_batches(ids: np.ndarray, lengths: np.ndarray, packing: Packing, *, seed: int,
                  epoch: int, shuffle: bool = True) -> list[list[list[int]]]:
    """One epoch's micro-batches: a seeded shuffle of `ids` across all shards, then packing."""
    order = ids
    if shuffle:
        order = ids[np.random.default_rng([seed, epoch]).permutation(len(ids))]
    return pack(order, lengths, packing)


def plan_run(ids: np.ndarray, lengths: np.ndarray, packing: Packing, *, seed: int,
             per_step: int, epochs: int, max_steps: int) -> tuple[list, list[int]]:
    """All global micro-batches of the run, and the epoch of each.

    `per_step` = world_size * grad_accum micro-batches per optimizer step. With `max_steps` the
    run goes on over as many epochs as it needs; otherwise it is `epochs` epochs, with the last
    incomplete optimizer step dropped.
    """
    batches: list = []
    epoch_of: list[int] = []
    epoch = 0
    while (len(batches) < max_steps * per_step) if max_steps else (epoch < epochs):
        new = epoch_batches(ids, lengths, packing, seed=seed, epoch=epoch)
        batches += new
        epoch_of += [epoch] * len(new)
        epoch += 1
    steps = max_steps or len(batches) // per_step
    if steps == 0:
        raise EyasError(
            f"the training data make {len(batches)} micro-batches but one optimizer step needs "
            f"{per_step} (ranks x --grad-accum); lower --batch-tokens or --grad-accum, or use "
            f"more data.")
    n = steps * per_step
    return batches[:n], epoch_of[:n]


def split_eval(num_samples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (train ids, held-out ids); at least one sample is held out if fraction > 0."""
    perm = np.random.default_rng([seed, 10**6]).permutation(num_samples)
    k = 0 if fraction <= 0 else max(1, int(round(num_samples * fraction)))
    if k >= num_samples:
        raise EyasError(f"--eval-fraction {fraction} leaves no training samples out of "
                        f"{num_samples}; lower it or pass --eval-data.")
    return np.sort(perm[k:]), np.sort(perm[:k])


def plan_fingerprint(lengths: np.ndarray, ids: np.ndarray, packing: Packing, seed: int,
                     per_step: int) -> str:
    """What must stay equal for a saved data position to mean the same samples on resume."""
    blob = json.dumps([packing.row_tokens, packing.rows, packing.truncate, seed, per_step,
                       hashlib.sha256(lengths.tobytes()).hexdigest(),
                       hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def rank_slice(batches: list, *, rank: int, world_size: int, start: int) -> list:
    """This rank's micro-batches from global position `start` on (`start` % world_size == 0)."""
    return batches[start + rank::world_size]


def eval_rank_batches(batches: list, *, rank: int, world_size: int) -> list:
    """This rank's eval micro-batches, padded with `None` so every rank runs the same count
    (FSDP forwards are collective: a rank that stopped early would hang the others)."""
    per_rank = math.ceil(len(batches) / world_size)
    mine = batches[rank::world_size]
    return mine + [None] * (per_rank - len(mine))


# ---------------------------------------------------------------- tensors

# Trimmed micro-batches are padded to a multiple of this many tokens: few distinct shapes
# for the compiled kernels and attention block masks, little padding.
PAD_MULTIPLE = 256


def row_width(rows: list[list[int]], lengths, row_tokens: int, static: bool) -> int:
    """Width T of a micro-batch of `rows` (sample indices): `row_tokens` when static (CUDA
    graphs, --compile replay fixed shapes), else its longest row rounded up to
    PAD_MULTIPLE (a micro-batch smaller than --batch-tokens is not padded to it)."""
    if static:
        return row_tokens
    longest = max((sum(min(int(lengths[i]), row_tokens) for i in row) for row in rows),
                  default=1)
    return min(row_tokens, -(-max(longest, 1) // PAD_MULTIPLE) * PAD_MULTIPLE)


def collate(rows: list[list[dict[str, torch.Tensor]]], row_tokens: int,
            hidden_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Pack samples into (B=len(rows), T=row_tokens) tensors; padding has doc_id -1, mask 0.
    Samples of an fp8 capture (with `aux_scale`) keep aux_hidden in fp8 beside `aux_scale`
    (B, T, taps), padding scaled by 1: `on_device` dequantizes them where the step runs."""
    first = rows[0][0]
    ht, dev = first["final_hidden"].shape[-1], first["final_hidden"].device  # online: the GPU
    taps = first["aux_hidden"].shape[-2]  # 3 for EAGLE-3; DFlash captures any number
    b, t = len(rows), row_tokens
    scaled = "aux_scale" in first
    aux_dtype = first["aux_hidden"].dtype if scaled else hidden_dtype

    def zeros(*shape, dtype=torch.long):
        return torch.zeros(*shape, dtype=dtype, device=dev)

    out = {
        "input_ids": zeros(b, t),
        "aux_hidden": zeros(b, t, taps * ht, dtype=aux_dtype),  # (B, T, taps*Ht)
        "final_hidden": zeros(b, t, ht, dtype=hidden_dtype),  # (B, T, Ht)
        "target_top1": zeros(b, t),
        "loss_mask": zeros(b, t),
        "position_ids": zeros(b, t),
        "doc_ids": zeros(b, t) - 1,
    }
    if scaled:
        out["aux_scale"] = torch.ones(b, t, taps, dtype=torch.float32, device=dev)
    for r, samples in enumerate(rows):
        at = 0
        for d, s in enumerate(samples):
            n = min(int(s["input_ids"].shape[0]), t - at)
            span = slice(at, at + n)
            out["aux_hidden"][r, span] = s["aux_hidden"][:n].reshape(n, taps * ht).to(aux_dtype)
            if scaled:
                out["aux_scale"][r, span] = s["aux_scale"][:n]
            out["final_hidden"][r, span] = s["final_hidden"][:n].to(hidden_dtype)
            for key in ("input_ids", "target_top1", "loss_mask"):
                out[key][r, span] = s[key][:n].long()
            out["position_ids"][r, span] = torch.arange(n, device=dev)
            out["doc_ids"][r, span] = d
            at += n
    return out


def on_device(mb: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A collated micro-batch on `device`, an fp8 capture's aux states dequantized there: to
    bf16, as the host did per sample before (a capture's final_hidden is bf16 too), then to the
    dtype of final_hidden (collate's hidden_dtype). The same values as dequantizing on the host
    (fp8 to float32 is exact, then one float32 multiply and the same roundings), without the
    host's cost."""
    out = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
    scale = out.pop("aux_scale", None)
    if scale is not None:
        aux = out["aux_hidden"]
        b, t, taps = scale.shape
        out["aux_hidden"] = dequantize_fp8(aux.view(b, t, taps, -1), scale).view(b, t, -1).to(
            out["final_hidden"].dtype)
    return out


def host_fields(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collated micro-batch's tensors without `aux_scale` (for a plan made on the host,
    which reads no hidden state)."""
    return {k: v for k, v in mb.items() if k != "aux_scale"}


class MicroBatches(torch.utils.data.Dataset):
    """Map-style view of a list of planned micro-batches (None = an all-padding batch)."""

    def __init__(self, source, batches: list, row_tokens: int, hidden_dtype: torch.dtype,
                 static: bool = True):
        self.source, self.batches = source, batches
        self.row_tokens, self.hidden_dtype, self.static = row_tokens, hidden_dtype, static

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        plan = self.batches[k]
        empty = plan is None
        if empty:  # a padding batch for eval: one real sample, all of it masked out
            plan = [[0]]
        flat = self.source.fetch([i for row in plan for i in row])
        rows, at = [], 0
        for row in plan:
            rows.append(flat[at:at + len(row)])
            at += len(row)
        width = row_width(plan, self.source.lengths, self.row_tokens, self.static)
        out = collate(rows, width, self.hidden_dtype)
        if empty:
            out["loss_mask"].zero_()
        return out


class Prefetch:
    """Micro-batches of `dataset` in order, each read and collated by one of `threads`
    threads up to `ahead` batches before it is asked for (pinned when `pin`).

    Threads, not processes: a batch is large (8 K tokens of a 576-wide target are 38 MB in
    bf16; of an 8B target, 268 MB) and a DataLoader worker process hands it over through
    shared memory, a copy and a mapping per batch that cost more than reading and collating
    it (benchmarks/loader.py, docs/benchmarks.md "The training data loader"). Reading and
    copying run in torch, outside the GIL, so threads overlap with each other and with the
    training step. A signal reaches only the main thread, which saves the step it is on.
    Closing the iterator (or leaving it) waits for the batches already begun."""

    def __init__(self, dataset, threads: int, pin: bool, ahead: int | None = None,
                 intra_threads: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.dataset, self.pin, self.next, self.closed = dataset, pin, 0, False
        self.ahead = ahead or 2 * threads
        self.pending: collections.deque = collections.deque()
        # each reader with its share of the intra-op threads (`intra_threads`; by default
        # the cores over the readers and the training loop, at least one): on two cores one
        # each, as a DataLoader worker process has; on a 16-core host, 5 each
        if intra_threads is None:
            intra_threads = reader_threads(threads)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="eyas-loader",
                                       initializer=torch.set_num_threads,
                                       initargs=(intra_threads,))

    def _load(self, k: int) -> dict[str, torch.Tensor]:
        return _read(self.dataset, k, self.pin)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.closed:
            raise StopIteration
        while self.next < len(self.dataset) and len(self.pending) < self.ahead:
            self.pending.append(self.pool.submit(self._load, self.next))
            self.next += 1
        if not self.pending:
            self.close()
            raise StopIteration
        return self.pending.popleft().result()

    def close(self, wait: bool = True) -> None:
        """Cancel the reads not begun, wait for those under way (unless not `wait`); later
        `next` ends at once."""
        if self.closed:
            return
        self.closed = True
        for f in self.pending:
            f.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=wait)

    def __del__(self):  # (not at interpreter exit: concurrent.futures joins its threads then)
        if hasattr(self, "pool"):  # (set last in __init__)
            self.close(wait=False)


def reader_threads(readers: int) -> int:
    """Intra-op threads for each of `readers` reader threads: this process's intra-op
    threads shared by the readers and the training loop, at least one."""
    return max(1, torch.get_num_threads() // (readers + 1))


def _read(dataset, k: int, pin: bool) -> dict[str, torch.Tensor]:
    """Micro-batch k of `dataset`, pinned when `pin`."""
    mb = dataset[k]
    return {key: v.pin_memory() for key, v in mb.items()} if pin else mb


def loader(source, batches: list, row_tokens: int, hidden_dtype: torch.dtype, *,
           num_workers: int, pin_memory: bool, static: bool = True):
    """Iterate micro-batches in plan order: `num_workers` threads read ahead (Prefetch;
    offline only: the online source runs the target on the GPU and must stay in this
    thread), 0 = each read when asked for. static: every micro-batch `row_tokens` wide; else
    as wide as its longest row needs (row_width)."""
    dataset = MicroBatches(source, batches, row_tokens, hidden_dtype, static)
    if num_workers:
        return Prefetch(dataset, num_workers, pin_memory)
    return (_read(dataset, k, pin_memory) for k in range(len(dataset)))


def count_tokens(batches: list, lengths: np.ndarray, row_tokens: int) -> int:
    """Real (non-padding) tokens in planned micro-batches, for throughput figures."""
    return sum(min(int(lengths[i]), row_tokens) for b in batches for row in b for i in row)


# ---------------------------------------------------------------- target weights

def target_head_weights(name: str, *, revision: str | None = None,
                        trust_remote_code: bool = False):
    """(embed (V, Ht), lm_head (V, Ht), ModelInfo, config) of a target, reading only those two
    tensors from its safetensors files: the module paths come from building the model on the
    meta device, the file holding each tensor from the safetensors index. Offline training
    never loads the whole target."""
    from eyas.targets.models import inspect_model, is_gguf, load_config, text_config
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
