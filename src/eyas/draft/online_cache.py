"""Online training's memory of the target's states (`eyas train --online --online-cache`).

Online, the target runs over every micro-batch of every epoch and every eval: on a 1.5B target
that is most of a training step. `StateCache` keeps each sample's captured states after the
target's first pass over it, on the GPU or in host memory, up to a bound in bytes; a sample
past the bound runs the target every time, as without a cache (counted, never dropped).

What a cached sample holds is what `eyas capture` would have written for it: bf16 states, or
with `dtype="fp8"` the aux states quantized as `eyas capture --dtype fp8` does (row scales in
`aux_scale`, dequantized on the GPU by training's `on_device`) beside a bf16 final state. In
fp8 every sample is handed out quantized, on the target's first pass too and past the bound,
so each epoch trains on the same numbers, those an offline fp8 capture would give.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from eyas.store.shards import quantize_fp8

log = logging.getLogger(__name__)

GB = 1e9


def free_bytes(device: torch.device) -> int:
    """Memory free on `device` now: the GPU's free memory, or the host's available memory
    (MemAvailable: free plus what the kernel can reclaim; sysconf's free pages elsewhere)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class StateCache:
    """Samples' captured states by sample number, on `device`, at most `max_bytes` of them."""

    def __init__(self, device: torch.device, dtype: str, max_bytes: int):
        self.device, self.dtype, self.max_bytes = torch.device(device), dtype, int(max_bytes)
        self.samples: dict[int, dict[str, torch.Tensor]] = {}
        self.bytes = 0
        self.hits = self.misses = self.refused = 0  # refused: past the bound, not kept
        self.lock = threading.Lock()

    def get(self, i: int, device: torch.device) -> dict[str, torch.Tensor] | None:
        """Sample i's states on `device` (the target's), or None if they are not kept."""
        with self.lock:
            s = self.samples.get(i)
            if s is None:
                self.misses += 1
                return None
            self.hits += 1
        return s if self.device == device else {k: v.to(device) for k, v in s.items()}

    def put(self, i: int, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keep sample i (as the target gave it: bf16, on the target's device) if the bound
        allows; returns it in the cache's form (fp8: quantized) on the device it came on."""
        sample = self.form(sample)
        size = sum(v.numel() * v.element_size() for v in sample.values())
        with self.lock:
            if i in self.samples:
                return sample
            if self.bytes + size > self.max_bytes:
                if not self.refused:
                    log.info("--online-cache is full (%.2f of %.2f GB, %d samples): samples "
                             "past it run the target every epoch; raise --online-cache-gb "
                             "to keep them", self.bytes / GB, self.max_bytes / GB,
                             len(self.samples))
                self.refused += 1
                return sample
            self.bytes += size
        try:  # a copy of each view: the target's samples are views of a whole micro-batch
            kept = {k: v.to(self.device, copy=v._base is not None) for k, v in sample.items()}
        except torch.OutOfMemoryError:
            with self.lock:  # what training needs comes first: keep no more
                self.bytes -= size
                self.max_bytes = self.bytes
            log.warning("--online-cache: out of memory on %s at %.2f GB (%d samples): no more "
                        "are kept; lower --online-cache-gb to leave training room",
                        self.device, self.bytes / GB, len(self.samples))
            return sample
        with self.lock:
            self.samples[i] = kept
        return sample

    def form(self, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A sample as the cache hands it out: bf16 as given, or fp8 aux states + scales."""
        if self.dtype != "fp8":
            return sample
        q, scale = quantize_fp8(sample["aux_hidden"])  # (T, taps, H) fp8, (T, taps) float32
        return {**sample, "aux_hidden": q, "aux_scale": scale}

    def summary(self) -> str:
        return (f"--online-cache ({self.dtype}, {self.device.type}): {len(self.samples)} "
                f"samples kept, {self.bytes / GB:.2f} of {self.max_bytes / GB:.2f} GB; reads "
                f"{self.hits} from it, {self.misses} by the target ({self.refused} past the "
                f"bound)")


def open_cache(where: str, dtype: str, gb: float, target_device: torch.device) -> StateCache | None:
    """The cache --online-cache asks for: `where` gpu (the target's device), cpu (host
    memory) or off; `gb` its bound, 0 = half the memory free there now."""
    if where == "off":
        return None
    device = target_device if where == "gpu" else torch.device("cpu")
    if where == "gpu" and device.type != "cuda":
        log.warning("--online-cache gpu: the target is on %s, so the cache is too", device)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        log.warning("--online-cache under torchrun: each of the %d ranks keeps the samples it "
                    "reads, and the ranks share the data out anew each epoch, so a rank finds "
                    "a sample it kept only ~1/%d of the time in epoch 2; one process gains "
                    "the most", ranks, ranks)
    # host memory is shared by this node's ranks: half of it split between them
    share = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    bound = int(gb * GB) if gb > 0 else free_bytes(device) // 2 // share
    log.info("--online-cache: up to %.2f GB of %s states on %s", bound / GB, dtype, device)
    return StateCache(device, dtype, bound)
