"""Which SDPA kernels the target runs on: cuDNN's attention left out by default.

torch picks cuDNN's scaled-dot-product attention for a masked batch on Hopper, and cuDNN
builds a plan for each new shape on the host. Decoding gives every step a new key length and
padded batches a new (rows, length) each, so it plans nearly every call.

The flag torch reads is process-wide, not per thread, and threads may run forwards at once
(a chat server's request threads beside the main thread, transformers' continuous batching).
A plain save-and-restore per context would then leave the flag as another thread had set it.
So the contexts share a count: the first to enter turns cuDNN's attention off and the last to
leave turns it back to what it was; the other kernels' flags are not touched.
"""

from __future__ import annotations

import contextlib
import os
import threading

from eyas.errors import EyasError

TARGET_SDPA_ENV = "EYAS_TARGET_SDPA"
CHOICES = ("auto", "torch")

_lock = threading.Lock()
_open = 0  # contexts open now, in any thread
_before = True  # cuDNN's flag when the first of them opened


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
    if target_sdpa_choice() == "torch":
        return contextlib.nullcontext()
    return _without_cudnn()


@contextlib.contextmanager
def _without_cudnn():
    global _open, _before
    import torch  # (here: the CLI checks the variable without loading torch)

    with _lock:
        if _open == 0:
            _before = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0:
                torch.backends.cuda.enable_cudnn_sdp(_before)
