"""DraftConfig: the EAGLE-3 draft's shape, vocab sizes, RoPE and aux layers (HF spelling),
and the pieces a draft family takes from its target (`layer_shape`, `draft_rope_scaling`).

Apart from the model (eyas.draft.eagle3) so the exported formats (eyas.draft.formats) can
map configs without importing the model, and the model can read exported folders.
"""

from __future__ import annotations
from dataclasses import dataclass, field
import logging

from eyas.config import ConfigError, from_dict, to_dict

log = logging.getLogger(__name__)


# RoPE scaling types a draft supports, with the keys both transformers and every vLLM
# version read the same way (vLLM's Llama YaRN ignores mscale/mscale_all_dim, so they are
# dropped rather than trained with a scaling the server would not apply).
ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"),
}


def draft_rope_scaling(scaling: dict | None) -> dict | None:
    """The target's rope scaling as the draft uses it: None for plain RoPE (incl. M-RoPE,
    which is plain RoPE on text positions), else `{"rope_type", <ROPE_KEYS>}`."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", "mrope"):
        return None
    if kind not in ROPE_KEYS:
        log.warning("rope scaling %r is not supported for drafts; the draft uses plain RoPE "
                    "(train and serve agree, as the exported config says so)", kind)
        return None
    out = {"rope_type": kind}
    out.update({k: scaling[k] for k in ROPE_KEYS[kind] if scaling.get(k) is not None})
    return out


def _rope_of(target) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a ModelInfo or an HF config (transformers 4 or 5 keys)."""
    params = dict(getattr(target, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
        params = dict(params.get("full_attention") or next(iter(params.values())))
    theta = getattr(target, "rope_theta", None) or params.get("rope_theta") or 10000.0
    scaling = getattr(target, "rope_scaling", None) or \
        {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), draft_rope_scaling(scaling)


def layer_shape(target) -> dict:
    """The target's decoder-layer shape as draft config fields (hidden and MLP sizes, heads,
    norm eps, RoPE, positions, vocab), from an `eyas.targets.models.ModelInfo` or an HF (text)
    config: what both draft families copy from the target."""
    if hasattr(target, "get_text_config"):
        target = target.get_text_config()
    heads = int(target.num_attention_heads)
    theta, scaling = _rope_of(target)
    return dict(
        hidden_size=int(target.hidden_size), num_attention_heads=heads,
        num_key_value_heads=int(getattr(target, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(target, "head_dim", None) or target.hidden_size // heads),
        intermediate_size=int(target.intermediate_size),
        rms_norm_eps=float(getattr(target, "rms_norm_eps", None) or 1e-6),
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(target.max_position_embeddings),
        vocab_size=int(target.vocab_size))


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """Shapes of an EAGLE-3 draft, in Hugging Face spelling. `vocab_size` is the TARGET
    vocabulary; `draft_vocab_size` the draft's. JSON round-trips via to_dict/from_dict."""

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    # decoder layers: layer 0 reads [embedding, hidden] as EAGLE-3's always did, layers 1.. are
    # plain Llama blocks on its residual stream, as vLLM's llama_eagle3 runs them
    num_hidden_layers: int = 1
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]
    norm_before_residual: bool = False
    # EAGLE 3.1 variants; docs/draft.md says which server versions run each.
    # norm_before_fc: one RMSNorm over the concatenated aux states before fc (weight
    # input_norm.weight, (3*Ht,)), speculators' default recipe; fc_norm: one RMSNorm per aux
    # state (fc_norm.{0,1,2}.weight, (Ht,) each), the paper's; one or the other, not both
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False  # feed norm(h), not h, to the next draft step
    hidden_act: str = "silu"

    def __post_init__(self):
        for name in ("hidden_size", "target_hidden_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "num_hidden_layers",
                     "max_position_embeddings", "vocab_size", "draft_vocab_size"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"draft config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"draft config: num_attention_heads {self.num_attention_heads} must "
                              f"be a multiple of num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"draft config: head_dim {self.head_dim} must be even for RoPE")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"draft config: draft_vocab_size {self.draft_vocab_size} exceeds "
                              f"the target vocab_size {self.vocab_size}; use a smaller one")
        if len(self.aux_layer_ids) != 3:
            raise ConfigError(f"draft config: aux_layer_ids needs 3 layer ids, got "
                              f"{self.aux_layer_ids}")
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.norm_before_fc and self.fc_norm:
            raise ConfigError("draft config: norm_before_fc (one RMSNorm over the concatenated "
                              "aux states) and fc_norm (one per aux state) are alternatives "
                              "(speculators refuses both too); choose one")
        if self.hidden_act != "silu":
            raise ConfigError(f"draft config: hidden_act {self.hidden_act!r}: vLLM's Llama MLP "
                              f"only runs 'silu'; set hidden_act='silu'")
        if self.rope_scaling is not None and self.rope_scaling != draft_rope_scaling(
                self.rope_scaling):
            raise ConfigError(f"draft config: rope_scaling {self.rope_scaling} is not in the "
                              f"supported form {{'rope_type': one of {sorted(ROPE_KEYS)}, ...}}; "
                              f"pass it through eyas.draft.config.draft_rope_scaling")

    @property
    def maps_vocab(self) -> bool:
        """Whether the draft's vocabulary is a subset mapped by d2t/t2d. A draft over the
        target's whole vocabulary (a target of <= --draft-vocab-size ids: Llama 2, Mistral 7B
        v0.1) has none: vLLM builds no d2t weight for it and refuses one in the folder (0.32:
        "no module or parameter named 'draft_id_to_target_id'"), and every loader reads its
        absence as the identity."""
        return self.draft_vocab_size != self.vocab_size

    @classmethod
    def from_target(cls, target, *, draft_vocab_size: int, aux_layer_ids, **overrides):
        """A draft shaped like the target's text decoder layer. `target` is an
        `eyas.targets.models.ModelInfo` or a (text) HF config; `overrides` set any field."""
        shape = layer_shape(target)
        values = dict(shape, target_hidden_size=shape["hidden_size"],
                      draft_vocab_size=int(draft_vocab_size), aux_layer_ids=tuple(aux_layer_ids))
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict:
        return to_dict(self)

    @classmethod
    def from_dict(cls, values: dict) -> DraftConfig:
        return from_dict(cls, values)
