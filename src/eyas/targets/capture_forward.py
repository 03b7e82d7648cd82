"""The target forward of `eyas capture`: hooks that keep the aux and final hidden states of
real tokens (eyas.targets.taps.AuxTaps), top-1 over lm_head chunks, batch planning and packing (flat rows with
position resets, or right-padded rows), and the self-check that flat packing really isolates
samples. `forward_batches` yields device tensors per batch; eyas.capture stores them or hands
them to online training.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator

import torch

from eyas.errors import EyasError
from eyas.targets.sdpa import target_attention
from eyas.targets.taps import AuxTaps
from eyas.store import shards

log = logging.getLogger(__name__)

LOGIT_CHUNK_ELEMENTS = 1 << 26  # lm_head chunk: tokens * vocab <= 64M logits (128 MiB in bf16)
PROBE_TOKENS = 16               # length of the two sequences the packing self-check runs


def top1_chunked(lm_head, final: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """argmax of lm_head(final) per token, (N,) int32, over token chunks so (N, V) logits are
    never materialised at once."""
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // max(vocab_size, 1))
    weight = next(lm_head.parameters(), None)
    dev = weight.device if weight is not None and weight.device.type != "meta" else final.device
    out = [lm_head(final[s:s + chunk].to(dev)).argmax(dim=-1).to(final.device)
           for s in range(0, final.shape[0], chunk)]
    return torch.cat(out).to(torch.int32) if out else torch.zeros(0, dtype=torch.int32)


def _forward(parts, taps: AuxTaps, inputs: dict) -> dict[str, torch.Tensor]:
    """One target forward; returns device tensors aux_hidden, final_hidden, target_top1 and the
    per-token `nonfinite` flags."""
    text_model, lm_head, device, vocab = parts
    # (cuDNN's attention left out: it plans every new batch shape on the host; sdpa.py)
    with taps.attached(_to(inputs["gather"], device)), target_attention():
        text_model(input_ids=inputs["input_ids"].to(device, non_blocking=True),
                   attention_mask=_to(inputs["attention_mask"], device),
                   position_ids=_to(inputs["position_ids"], device), use_cache=False)
    aux, final = taps.collect(taps.kept["final"].device if "final" in taps.kept else device)
    finite = aux.isfinite().all(dim=2).all(dim=1) & final.isfinite().all(dim=1)   # (N,)
    return {"aux_hidden": aux, "final_hidden": final,
            "target_top1": top1_chunked(lm_head, final, vocab), "nonfinite": ~finite}


def _to(t, device):
    return None if t is None else t.to(device, non_blocking=True)


def batch_inputs(samples: list[tuple[list[int], list[int]]], flat: bool) -> tuple[dict, dict]:
    """Model inputs for one batch, and the flattened per-token host tensors.

    flat: one row (1, N) with position ids restarting at each sample, no mask.
    padded: (B, T) right-padded rows, attention mask only if lengths differ, positions left to
    the model (0..T-1 per row, exactly what an unpadded forward of each sample uses)."""
    lengths = [len(ids) for ids, _ in samples]
    ids = torch.tensor([t for s, _ in samples for t in s], dtype=torch.int64)        # (N,)
    mask = torch.tensor([m for _, ms in samples for m in ms], dtype=torch.uint8)     # (N,)
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)               # (n+1,)
    if flat:
        pos = torch.cat([torch.arange(n) for n in lengths])[None]                    # (1, N)
        inputs = {"input_ids": ids[None], "position_ids": pos, "attention_mask": None,
                  "gather": None}
    else:
        b, t = len(lengths), max(lengths)
        padded = torch.zeros(b, t, dtype=torch.int64)                                # (B, T)
        real = torch.arange(t)[None] < torch.tensor(lengths)[:, None]                # (B, T)
        padded[real] = ids
        inputs = {"input_ids": padded, "position_ids": None,
                  "attention_mask": None if min(lengths) == t else real.long(),
                  "gather": real.flatten().nonzero().flatten()}                      # (N,)
    if torch.cuda.is_available():
        inputs = {k: (v.pin_memory() if v is not None else None) for k, v in inputs.items()}
    host = {"input_ids": ids.to(torch.int32), "loss_mask": mask, "sample_offsets": offsets}
    return inputs, host


def plan_batches(lengths, rows, batch_tokens: int, flat: bool, sort_by_length: bool = True):
    """Group `rows` into batches of at most `batch_tokens` tokens (padding counted). Sorted by
    decreasing length so padded rows waste little and the largest batch runs first (an
    out-of-memory shows at once). A sample longer than the budget runs alone."""
    order = sorted(rows, key=lambda r: (-int(lengths[r]), r)) if sort_by_length else list(rows)
    batches, cur, cur_max, cur_tokens = [], [], 0, 0
    for r in order:
        n = int(lengths[r])
        cost = cur_tokens + n if flat else max(cur_max, n) * (len(cur) + 1)
        if cur and cost > batch_tokens:
            batches.append(cur)
            cur, cur_max, cur_tokens = [], 0, 0
        cur.append(r)
        cur_max, cur_tokens = max(cur_max, n), cur_tokens + n
    if cur:
        batches.append(cur)
    return batches


def forward_batches(model, info, dataset, rows, aux_layer_ids, batch_tokens, packing, sort_by_length):
    """Yield (device outputs, host meta) per batch of `dataset` rows (all rows if None)."""
    from eyas.targets.models import submodule

    # (decoder loop module, lm_head, input device, vocab size): what `_forward` needs
    parts = (submodule(model, info.text_model_path), submodule(model, info.lm_head_path),
             submodule(model, info.embed_path).weight.device, info.vocab_size)
    lengths = [int(n) for n in dataset["num_tokens"]]
    rows = list(range(len(dataset))) if rows is None else list(rows)
    taps = AuxTaps(submodule(model, info.layers_path), submodule(model, info.norm_path),
                 aux_layer_ids, info.num_layers)
    with torch.inference_mode():
        flat = _resolve_packing(packing, info, parts, taps)
    for batch in plan_batches(lengths, rows, batch_tokens, flat, sort_by_length):
        data = dataset[batch]
        check_rows(batch, data, lengths)
        inputs, host = batch_inputs(list(zip(data["input_ids"], data["loss_mask"])), flat)
        with torch.inference_mode():
            out = _forward(parts, taps, inputs)
        host["sample_index"] = torch.tensor(batch, dtype=torch.int64)
        host["sample_ids"] = [str(s) for s in data["sample_id"]]
        yield out, host


def check_rows(batch, data, lengths):
    """A prepared window's rows as capture needs them, or an error naming the bad row."""
    for r, ids, mask in zip(batch, data["input_ids"], data["loss_mask"]):
        if len(ids) != lengths[r] or len(mask) != len(ids) or not ids:
            raise EyasError(f"prepared row {r} is malformed (num_tokens {lengths[r]}, "
                            f"{len(ids)} input_ids, {len(mask)} loss_mask); re-run `eyas prepare`.")


def _resolve_packing(packing, info, parts, taps) -> bool:
    """True for flat packing. `auto` picks flat only under flash attention (with sdpa/eager a
    flat row means a dense (N, N) mask: padding is cheaper), and only if the self-check passes."""
    if packing == "padded":
        return False
    text_model = parts[0]
    impl = str(getattr(text_model.config, "_attn_implementation", ""))
    if packing == "auto" and not impl.startswith("flash"):
        return False
    checked = _PACKING_CHECKS.setdefault(text_model, {})
    if impl not in checked:
        checked[impl] = _flat_packing_works(parts, taps, info.vocab_size)
    ok, err = checked[impl]
    if ok:
        return True
    msg = (f"flat packing leaks attention across samples for this model ({impl} attention, "
           f"relative difference {err:.3g})")
    if packing == "flat":
        raise EyasError(msg + "; use --packing padded (or auto).")
    log.warning("%s; using padded batches", msg)
    return False


_PACKING_CHECKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # text model -> results


def _flat_packing_works(parts, taps, vocab_size: int) -> tuple[bool, float]:
    """Pack one sequence twice in one flat row: if position resets isolate the samples, both
    copies give the same hidden states; if the attention ignores them, the second copy sees
    the first and differs far beyond rounding (in its first tokens especially)."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, vocab_size, (PROBE_TOKENS,), generator=g).tolist()
    inputs, _ = batch_inputs([(seq, [1] * len(seq))] * 2, flat=True)
    final = _forward(parts, taps, inputs)["final_hidden"].float()
    a, b = final[: len(seq)], final[len(seq):]
    err = float(((a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-6)).max())
    return err < 0.05, err


def output_device(model, info) -> torch.device:
    """Where the final norm runs, i.e. where captured tensors are gathered."""
    from eyas.targets.models import submodule

    param = next(submodule(model, info.norm_path).parameters(), None)
    return param.device if param is not None else next(model.parameters()).device


def iter_captured_batches(model, info, dataset, aux_layer_ids, batch_tokens: int, *,
                          rows=None, packing: str = "auto", sort_by_length: bool = True,
                          drop_nonfinite: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """Capture in-process (online training): yields one dict per forward, on the model's device,
    with a shard's keys: `aux_hidden` (N, 3, H) and `final_hidden` (N, H) in the model dtype,
    `target_top1`/`input_ids` (N,) int32, `loss_mask` (N,) uint8, `sample_offsets` (n+1,) and
    `sample_index` (n,) int64 (rows of `dataset`). `rows` restricts/orders the rows; with
    `sort_by_length` they are length-sorted for minimal padding. Samples with NaN/Inf are
    dropped and logged (costs one host sync per batch); with `drop_nonfinite=False` they are
    kept and flagged in an extra `nonfinite_samples` (n,) bool."""
    for out, meta in forward_batches(model, info, dataset, rows, aux_layer_ids, batch_tokens,
                                     packing, sort_by_length):
        bad = out.pop("nonfinite")
        device = out["aux_hidden"].device
        pin = device.type == "cuda"
        batch = {**out, **{k: (v.pin_memory() if pin else v).to(device, non_blocking=True)
                           for k, v in meta.items() if isinstance(v, torch.Tensor)}}
        if drop_nonfinite and bool(bad.any()):
            batch, dropped = shards.drop_samples(batch, bad)
            log.warning("dropped samples with NaN/Inf hidden states: %s",
                        [meta["sample_ids"][i] for i in dropped])
        elif not drop_nonfinite:
            batch["nonfinite_samples"] = shards.flagged_samples(batch["sample_offsets"], bad)
        yield batch


def capture_samples(model, info, rows_ds, aux_layer_ids, *, dtype: torch.dtype | None = None,
                    batch_tokens: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Capture the rows of `rows_ds` (a datasets.Dataset) and return one dict per row, in its
    order, on the model's device: `aux_hidden` (T, 3, H), `final_hidden` (T, H) (in `dtype`,
    default the model's), `target_top1`, `input_ids` (T,) int32, `loss_mask` (T,) uint8. A
    sample with NaN/Inf states is returned zeroed with loss_mask 0 (logged), so it adds no loss.
    Without `batch_tokens` all rows run in one forward."""
    budget = batch_tokens or max(1, sum(int(n) for n in rows_ds["num_tokens"]))
    result: list[dict | None] = [None] * len(rows_ds)
    for batch in iter_captured_batches(model, info, rows_ds, aux_layer_ids, budget,
                                       drop_nonfinite=False):
        bad = batch.pop("nonfinite_samples").tolist()                     # one host sync
        off = batch.pop("sample_offsets").tolist()
        for j, row in enumerate(batch.pop("sample_index").tolist()):
            sample = {k: v[off[j]:off[j + 1]] for k, v in batch.items()}
            if bad[j]:
                log.warning("prepared row %d has NaN/Inf hidden states: zeroed, loss_mask 0", row)
                for k in ("aux_hidden", "final_hidden", "loss_mask"):
                    sample[k] = torch.zeros_like(sample[k])
            if dtype is not None:
                for k in ("aux_hidden", "final_hidden"):
                    sample[k] = sample[k].to(dtype)
            result[row] = sample
    return result
