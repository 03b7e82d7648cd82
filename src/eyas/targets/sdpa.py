"""Which SDPA kernels the target runs on: cuDNN's attention left out by default.

torch picks cuDNN's scaled-dot-product attention for a masked batch on Hopper, and cuDNN
builds a plan for each new shape on the host. Decoding gives every step a new key length and
padded batches a new (rows, length) each, so it plans nearly every call.
"""

from __future__ import annotations

import contextlib
import os

from torch.nn.attention import SDPBackend, sdpa_kernel

from eyas.errors import EyasError

TARGET_SDPA_ENV = "EYAS_TARGET_SDPA"


def target_attention():
    """The SDPA kernels the target's forwards may use (eyas eval, regenerate, capture and
    online training): all but cuDNN's (auto), or torch's own choice (EYAS_TARGET_SDPA=torch).
    Measured in a decode loop: at batch 64 on Qwen2.5-1.5B's shape cuDNN's planning took 47
    of a step's 83 ms (H200, torch 2.11, benchmarks/eval_steps.py, session 41). The kernels
    left compute the same attention."""
    choice = os.environ.get(TARGET_SDPA_ENV, "") or "auto"
    if choice == "torch":
        return contextlib.nullcontext()
    if choice != "auto":
        raise EyasError(f"{TARGET_SDPA_ENV}={choice!r}: expected auto (cuDNN's attention "
                        "left out of the target's forwards) or torch (torch's choice)")
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])
