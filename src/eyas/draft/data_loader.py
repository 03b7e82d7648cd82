"""Training data, the tensors: a planned micro-batch (rows of sample ids, eyas.draft.data_plan)
read from its source (eyas.draft.data) and packed into (B, T) tensors (`collate`,
`MicroBatches`), moved to the training device (`on_device`, which dequantizes an fp8 capture's
aux states there), and read ahead in threads (`Prefetch`, `loader`).
"""

from __future__ import annotations

import collections

import torch

from eyas.store.shards import dequantize_fp8


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
