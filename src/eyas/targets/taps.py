"""Where EAGLE-3's aux hidden states come from: one set of hooks on a transformers target,
used by `eyas capture` (packed batches, real tokens only) and by the speculative-decoding
harness (`eyas eval`, batch 1 with a KV cache), so the layer-id convention lives here alone:
the default ids (EAGLE-3's three, DFlash's taps), their checks, and the hooks that read them.

vLLM's convention (docs/formats.md): aux id k < L is the residual stream entering decoder
layer k, which is HF's `output_hidden_states[k]`; id L is the last layer's output before the
final norm. "final" is the final norm's output, what the lm_head reads.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from eyas.config import ConfigError
from eyas.errors import EyasError


# ----------------------------------------------------------------------------- aux layer ids

def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default aux ids `(2, L//2, L-3)`: early, middle and late residual streams.

    For a 61-layer DeepSeek-V3 / Kimi-K2.5 that is (2, 30, 58); for 32-layer Llama-3.1-8B
    (2, 16, 29). Below L = 7 those three collide, so tiny test models get the same early /
    middle / late spread from what exists: (1, L//2, L-1) for L = 4..6 and (0, 1, 2) for
    L = 2..3. Every result is strictly ascending and within [0, L].
    """
    if num_layers >= 7:
        return (2, num_layers // 2, num_layers - 3)
    if num_layers >= 4:
        return (1, num_layers // 2, num_layers - 1)
    if num_layers >= 2:
        return (0, 1, 2)
    raise ConfigError(f"a target with {num_layers} decoder layer(s) has no 3 distinct aux "
                      f"layers; EAGLE-3 needs num_hidden_layers >= 2")


def dflash_aux_layer_ids(num_layers: int, taps: int, flag: str = "--dflash-taps"
                         ) -> tuple[int, ...]:
    """DFlash's default taps in vLLM's convention: SpecForge / z-lab / SGLang spread `taps`
    layer OUTPUTS evenly from layer 1 to layer L-3 (`round(1 + i*(L-4)/(taps-1))`, `L//2` for
    one tap); output of layer t is vLLM's aux id t+1 (docs/dflash.md section 7). Qwen3-8B
    (L = 36), 5 taps: (2, 10, 18, 26, 34). A target too shallow for `taps` distinct ids is
    refused with the most it can take, naming the caller's count `flag` (capture's
    --dflash-taps, online training's --dflash-layers)."""
    if taps < 1:
        raise ConfigError(f"a DFlash capture needs at least 1 tap, got {taps}")
    if taps == 1:
        return (num_layers // 2 + 1,)
    span = num_layers - 4
    if span < taps - 1:
        raise ConfigError(f"a target with {num_layers} decoder layers has no {taps} distinct "
                          f"DFlash default taps (it has {max(span + 1, 1)}); ask for fewer "
                          f"({flag}), or name the layers with --aux-layer-ids instead "
                          f"(without {flag})")
    # Python's round (half to even), as the reference helpers compute it
    return tuple(round(1 + i * span / (taps - 1)) + 1 for i in range(taps))


def validate_aux_layer_ids(ids, num_layers: int | None, count: int | None = 3) -> tuple[int, ...]:
    """Check aux ids: `count` ints (EAGLE-3's 3; None = any number >= 1, e.g. DFlash's taps),
    strictly ascending, each in [0, L].

    `num_layers=None` checks everything but the upper bound (for config validation before the
    target is known). Returns the ids as a tuple of ints.
    """
    ids = tuple(ids)
    hint = ("" if num_layers is None or num_layers < 2 else
            f" (this target has L = {num_layers}; its default is "
            f"--aux-layer-ids {','.join(map(str, default_aux_layer_ids(num_layers)))})")
    ints = all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    if count is None and not (ints and ids):
        raise ConfigError(f"aux_layer_ids must be integers (at least one), got {ids!r}{hint}")
    if count is not None and (len(ids) != count or not ints):
        raise ConfigError(f"aux_layer_ids must be exactly {count} integers, got {ids!r}; EAGLE-3 "
                          f"fuses three target layers{hint}")
    if any(i < 0 for i in ids) or (num_layers is not None and any(i > num_layers for i in ids)):
        raise ConfigError(f"aux_layer_ids {ids} out of range: each id must be in [0, L] "
                          f"(vLLM convention: id k = input of decoder layer k, id L = last "
                          f"layer output){hint}")
    if any(a >= b for a, b in zip(ids, ids[1:])):
        raise ConfigError(f"aux_layer_ids {ids} must be strictly ascending with no "
                          f"duplicates{hint}")
    return ids


# ----------------------------------------------------------------------------- hooks

class AuxTaps:
    """Hooks that keep the aux states (and optionally the final norm's output) of one
    forward. Attached only for that forward (`attached`), so the model behaves as usual in
    between; `collect` hands the states over and forgets them."""

    def __init__(self, layers, norm, aux_layer_ids, num_layers: int, *, final: bool = True):
        self.layers, self.norm, self.num_layers = layers, norm, num_layers
        self.ids = tuple(aux_layer_ids)
        self.final = final
        for k in self.ids:
            if not 0 <= k <= num_layers:
                raise EyasError(f"aux layer id {k} does not exist: the target has {num_layers} "
                                f"decoder layers (ids 0..{num_layers}); was the draft trained "
                                f"for another target?")
        self.kept: dict = {}
        self.gather: torch.Tensor | None = None  # flat indices of real tokens in (B*T), or None

    @contextlib.contextmanager
    def attached(self, gather: torch.Tensor | None = None):
        """Hooks on for one forward; `gather`: keep only these flat (B*T) positions."""
        self.gather, self.kept = gather, {}
        last = self.layers[self.num_layers - 1]
        handles = [self.layers[k].register_forward_pre_hook(
                       functools.partial(self._before, k), with_kwargs=True)
                   if k < self.num_layers else
                   last.register_forward_hook(functools.partial(self._after, k))
                   for k in self.ids]
        if self.final:
            handles.append(self.norm.register_forward_hook(
                functools.partial(self._after, "final")))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _before(self, key, module, args, kwargs):
        self._keep(key, args[0] if args else kwargs["hidden_states"])

    def _after(self, key, module, args, output):
        self._keep(key, output[0] if isinstance(output, (tuple, list)) else output)

    def _keep(self, key, hidden: torch.Tensor):
        flat = hidden.reshape(-1, hidden.shape[-1])                         # (B*T, H)
        # clone/index_select copy: a later layer may update the residual tensor in place
        self.kept[key] = (flat.clone() if self.gather is None
                          else flat.index_select(0, self.gather.to(flat.device)))

    def collect(self, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(aux (N, n_ids, H), final (N, H) or None without `final`), on `device` (with a
        device_map the layers may sit on several GPUs)."""
        wanted = (*self.ids, "final") if self.final else self.ids
        missing = [k for k in wanted if k not in self.kept]
        if missing:
            raise EyasError(f"the forward never reached the hooks for {missing} (aux ids / "
                            f"final norm); the layer or norm paths eyas found for this model "
                            f"are wrong: check `eyas doctor` and report the architecture.")
        aux = torch.stack([self.kept[k].to(device) for k in self.ids], dim=1)  # (N, n, H)
        final = self.kept["final"].to(device) if self.final else None          # (N, H)
        self.kept = {}
        return aux, final
