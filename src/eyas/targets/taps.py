"""Where EAGLE-3's aux hidden states come from: one set of hooks on a transformers target,
used by `eyas capture` (packed batches, real tokens only) and by the speculative-decoding
harness (`eyas eval`, batch 1 with a KV cache), so the layer-id convention lives here alone.

vLLM's convention (docs/formats.md): aux id k < L is the residual stream entering decoder
layer k, which is HF's `output_hidden_states[k]`; id L is the last layer's output before the
final norm. "final" is the final norm's output, what the lm_head reads.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from eyas.errors import EyasError


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
