"""DFlashConfig: the DFlash draft's shapes, taps, block size and mask token (HF, Qwen3 spelling).

Apart from the model (eyas.dflash.model) so the exported format (eyas.dflash.formats) can map
configs without importing the model.
"""

from __future__ import annotations
from dataclasses import dataclass, field

from eyas.config import ConfigError, from_dict, to_dict
from eyas.draft.config import ROPE_KEYS, draft_rope_scaling, layer_shape


@dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    """Shapes of a DFlash draft in Hugging Face (Qwen3) spelling. `vocab_size` is the target's
    (the draft predicts over it with the target's lm_head); `aux_layer_ids` are the captured
    taps in vLLM's convention (DFlash's `target_layer_ids` + 1); `block_size` counts the bonus
    slot (serve with num_speculative_tokens <= block_size - 1)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int
    vocab_size: int
    aux_layer_ids: tuple[int, ...]
    block_size: int = 16
    mask_token_id: int
    hidden_act: str = "silu"

    def __post_init__(self):
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings", "vocab_size"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"dflash config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"dflash config: num_attention_heads {self.num_attention_heads} "
                              f"must be a multiple of num_key_value_heads "
                              f"{self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"dflash config: head_dim {self.head_dim} must be even for RoPE")
        ids = tuple(int(i) for i in self.aux_layer_ids)
        object.__setattr__(self, "aux_layer_ids", ids)
        if not ids or min(ids) < 1 or any(a >= b for a, b in zip(ids, ids[1:])):
            raise ConfigError(f"dflash config: aux_layer_ids {ids} must be ascending ids >= 1 "
                              f"(DFlash names layer OUTPUTS, id - 1; the embedding output, id 0, "
                              f"has no DFlash name): capture with other --aux-layer-ids")
        if self.block_size < 2:
            raise ConfigError(f"dflash config: block_size {self.block_size} must be >= 2 (the "
                              f"bonus slot and at least one drafted token)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"dflash config: mask_token_id {self.mask_token_id} must be a row "
                              f"of the target's embedding, in [0, {self.vocab_size})")
        if self.hidden_act != "silu":
            raise ConfigError(f"dflash config: hidden_act {self.hidden_act!r}: only 'silu'")
        if self.rope_scaling is not None and self.rope_scaling != draft_rope_scaling(
                self.rope_scaling):
            raise ConfigError(f"dflash config: rope_scaling {self.rope_scaling} is not in the "
                              f"supported form {{'rope_type': one of {sorted(ROPE_KEYS)}, ...}}")

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The taps as DFlash checkpoints name them: 0-based decoder-layer outputs."""
        return tuple(i - 1 for i in self.aux_layer_ids)

    @classmethod
    def from_target(cls, target, *, aux_layer_ids, mask_token_id: int, **overrides):
        """Decoder layers shaped like the target's (an `eyas.targets.models.ModelInfo` or an HF
        text config), one per tap unless `num_hidden_layers` is given, RoPE as the target's
        (the block sits at the target's absolute positions)."""
        values = dict(layer_shape(target), num_hidden_layers=len(tuple(aux_layer_ids)),
                      aux_layer_ids=tuple(aux_layer_ids), mask_token_id=int(mask_token_id))
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict:
        return to_dict(self)

    @classmethod
    def from_dict(cls, values: dict) -> DFlashConfig:
        return from_dict(cls, values)
