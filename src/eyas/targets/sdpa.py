"""Which SDPA kernels the target runs on: cuDNN's attention left out by default.

torch picks cuDNN's scaled-dot-product attention for a masked batch on Hopper, and cuDNN
builds a plan for each new shape on the host. Decoding gives every step a new key length and
padded batches a new (rows, length) each, so it plans nearly every call.

The flags torch reads are process-wide, not per thread: the context below switches them for
the whole process while it is open (callers run the target from one thread at a time; a
thread the target starts, as transformers' continuous batching does, sees them too).
"""

from __future__ import annotations

import contextlib
import os

from eyas.errors import EyasError

TARGET_SDPA_ENV = "EYAS_TARGET_SDPA"
CHOICES = ("auto", "torch")


def target_sdpa_choice() -> str:
    """EYAS_TARGET_SDPA's value: auto (unset or empty) or torch; anything else is an error
    (checked by the CLI before any step starts, so not after a target has loaded)."""
    choice = os.environ.get(TARGET_SDPA_ENV, "") or "auto"
    if choice not in CHOICES:
        raise EyasError(f"{TARGET_SDPA_ENV}={choice!r}: expected auto (cuDNN's attention "
                        "left out of the target's forwards) or torch (torch's choice)")
    return choice


def target_attention():
    """The SDPA kernels the target's forwards may use (eyas eval and its replay, regenerate,
    capture and online training; in eval's decode loops the draft's proposals too): those
    enabled now less cuDNN's (auto), or torch's own choice (EYAS_TARGET_SDPA=torch).
    Measured in eval's batched loop at batch 64 on Qwen2.5-1.5B's shape (H100, torch 2.11,
    benchmarks/eval_steps.py, session 41): a plain step 59.4 -> 34.2 ms, a step at k = 2
    95.5 -> 63.0 ms. The kernels left compute the same attention, with their own rounding
    in bf16."""
    import torch  # (here: the CLI checks the variable without loading torch)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if target_sdpa_choice() == "torch":
        return contextlib.nullcontext()
    cuda = torch.backends.cuda
    keep = [backend for backend, on in ((SDPBackend.FLASH_ATTENTION, cuda.flash_sdp_enabled),
                                        (SDPBackend.EFFICIENT_ATTENTION,
                                         cuda.mem_efficient_sdp_enabled),
                                        (SDPBackend.MATH, cuda.math_sdp_enabled)) if on()]
    overrideable = getattr(torch._C, "_get_overrideable_sdp_enabled", None)
    if overrideable is not None and overrideable():  # (other devices' own kernels)
        keep.append(SDPBackend.OVERRIDEABLE)
    return sdpa_kernel(keep or [SDPBackend.MATH])
