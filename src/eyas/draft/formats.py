"""Each export format's config.json <-> DraftConfig mapping, one function per direction.

`to_vllm_config` / `from_vllm_config` (vLLM's `LlamaForCausalLMEagle3` layout),
`to_sglang_config` (the vLLM layout with `eagle_config` ids in SGLang's convention, via
`sglang_layer_ids`; read back by `from_vllm_config`, since the top-level ids win as in vLLM)
and `to_speculators_config` / `from_speculators_config` (the `speculators` library's eagle3
config); `read_config` reads any folder eyas writes (DFlash's format: eyas.dflash.formats).
Kept apart from `eyas.export` (which
writes and validates folders) so the key-by-key mapping reads in one place; the tests
round-trip every format. Reference §5, docs/export.md.
"""

from __future__ import annotations
import contextlib
from pathlib import Path
import re
import json

import torch
from safetensors.torch import load_file

from eyas.draft.config import DraftConfig, draft_rope_scaling
from eyas.errors import EyasError
from eyas.store.checkpoint import STEP_DIR, latest_complete
from eyas.store.manifest import inside, peek_manifest

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
SPECULATORS_FORMAT_VERSION = "0.7.0"  # the speculators release whose config format this follows
EAGLE31_KEYS = ("norm_before_fc", "fc_norm", "norm_output")
# The first server release that builds each EAGLE 3.1 variant from each format's config.json
# (older ones do not build the norm, and run another model than the one trained); sources in
# docs/draft.md, "EAGLE 3.1 variants". SGLang has no norm_before_fc: to_sglang_config refuses it.
SERVED_SINCE = {
    "vllm": {"norm_before_fc": "vLLM 0.19", "fc_norm": "vLLM 0.22", "norm_output": "vLLM 0.22"},
    "speculators": {"norm_before_fc": "vLLM 0.19", "fc_norm": "vLLM 0.24",
                    "norm_output": "vLLM 0.24"},
    "sglang": {"fc_norm": "SGLang 0.5.13", "norm_output": "SGLang 0.5.13"},
}


def rope_keys(cfg: DraftConfig) -> dict:
    """RoPE in both spellings: legacy rope_theta/rope_scaling (transformers 4, SGLang, every
    vLLM) and rope_parameters (transformers 5). They describe the same rotation."""
    out: dict = {"rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    out["rope_parameters"] = {"rope_type": "default", **(cfg.rope_scaling or {}),
                              "rope_theta": cfg.rope_theta}
    return out


def _llama_layer(cfg: DraftConfig, dtype: str) -> dict:
    """The Llama decoder-layer keys every format shares (`vocab_size` is the TARGET's)."""
    return {
        "model_type": "llama", "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, **rope_keys(cfg),
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": DTYPE_NAMES[DTYPES[dtype]],
    }


def _eagle_keys(cfg: DraftConfig) -> dict:
    """EAGLE-3 keys read next to the layer config. target_hidden_size is written only when it
    differs: vLLM and SGLang read it with getattr/hasattr, so a null would break both. The
    EAGLE 3.1 keys go at the top level, where vLLM's llama_eagle3 and its speculators reader
    (update_eagle3) look for them; written when on, so a plain draft's config is unchanged."""
    out = {"draft_vocab_size": cfg.draft_vocab_size,
           "norm_before_residual": cfg.norm_before_residual}
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    out.update({key: True for key in EAGLE31_KEYS if getattr(cfg, key)})
    return out


def to_vllm_config(cfg: DraftConfig, dtype: str = "bf16") -> dict:
    """config.json that vLLM's `LlamaForCausalLMEagle3` reads; aux ids in vLLM's convention
    both at the top level and in `eagle_config`. Inverse: `from_vllm_config`."""
    ids = list(cfg.aux_layer_ids)
    return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_layer(cfg, dtype),
            **_eagle_keys(cfg), "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}


def _draft_config(layer: dict, extras: dict, ids, norm_before_residual_default: bool) -> DraftConfig:
    """DraftConfig from a Llama layer dict and the EAGLE-3 extras (they may be the same dict)."""
    if not ids or len(ids) != 3:
        raise EyasError(f"draft config has eagle_aux_hidden_state_layer_ids={ids!r}; eyas needs "
                        f"the 3 ids the draft was trained on (vLLM convention). For a draft "
                        f"without them vLLM uses the target's (2, L//2, L-3): add that list to "
                        f"its config.json, or re-export an eyas draft with `eyas export`")
    if "target_hidden_size" in extras and extras["target_hidden_size"] is None:
        raise EyasError("draft config has target_hidden_size: null, which vLLM and SGLang "
                        "multiply by 3 and crash on; drop the key (or give the target's size)")
    params = dict(layer.get("rope_parameters") or {})
    theta = layer.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = layer.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    heads = int(layer["num_attention_heads"])
    return DraftConfig(
        hidden_size=int(layer["hidden_size"]),
        target_hidden_size=int(extras.get("target_hidden_size") or layer["hidden_size"]),
        num_attention_heads=heads, num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or int(layer["hidden_size"]) // heads),
        intermediate_size=int(layer["intermediate_size"]),
        num_hidden_layers=int(layer.get("num_hidden_layers", 1)),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        rope_scaling=draft_rope_scaling(scaling),
        max_position_embeddings=int(layer.get("max_position_embeddings", 8192)),
        vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(extras.get("draft_vocab_size") or layer["vocab_size"]),
        aux_layer_ids=tuple(int(i) for i in ids),
        norm_before_residual=bool(extras.get("norm_before_residual", norm_before_residual_default)),
        **{key: bool(extras.get(key, False)) for key in EAGLE31_KEYS},
        hidden_act=layer.get("hidden_act", "silu"))


def from_vllm_config(config: dict) -> DraftConfig:
    """Read a vLLM-layout draft config.json. Aux ids: the top-level key first (as vLLM does),
    else `eagle_config`'s. A foreign SGLang/SpecForge draft with ids only in `eagle_config` is
    in SGLang's convention (one less than vLLM's); eyas cannot tell, so such ids are taken as
    they are, exactly as vLLM would."""
    eagle = config.get("eagle_config") or {}
    ids = (config.get("eagle_aux_hidden_state_layer_ids")
           or eagle.get("eagle_aux_hidden_state_layer_ids"))
    extras = dict(config)
    if "norm_before_fc" in eagle:  # vLLM reads eagle_config's first (NVIDIA's drafts keep it there)
        extras["norm_before_fc"] = eagle["norm_before_fc"]
    # vLLM reads a missing norm_before_residual as False (getattr default)
    return _draft_config(config, extras, ids, norm_before_residual_default=False)


def sglang_layer_ids(aux_layer_ids, num_target_layers: int | None = None) -> list[int]:
    """SGLang's ids for vLLM aux ids: SGLang captures the input of layer `id + 1`, so vLLM's
    id k (input of layer k) is SGLang's k - 1 (id 0, the embedding output, becomes -1). vLLM's
    id L (the last layer's output) has no SGLang equivalent: SGLang captures only inputs of
    layers 0..L-1."""
    ids = [int(k) for k in aux_layer_ids]
    if num_target_layers is not None and max(ids) >= num_target_layers:
        raise EyasError(f"aux id {max(ids)} = L (the last layer's output) cannot be captured by "
                        f"SGLang, which only captures the inputs of layers 0..{num_target_layers - 1};"
                        f" serve this draft with vLLM (--format vllm) or train with ids < L")
    return [k - 1 for k in ids]


def to_sglang_config(cfg: DraftConfig, dtype: str = "bf16",
                     num_target_layers: int | None = None) -> dict:
    """config.json for SGLang's `LlamaForCausalLMEagle3`: the vLLM config with `eagle_config`
    ids in SGLang's convention. SGLang's draft layer always uses residual = g and has no
    norm_before_fc (an input_norm weight is skipped without a word), and it runs layers after
    the first another way than vLLM, so drafts trained with those are refused rather than
    served wrong; fc_norm and norm_output it runs (SERVED_SINCE)."""
    if cfg.num_hidden_layers > 1:
        raise EyasError(f"this draft has {cfg.num_hidden_layers} decoder layers, trained as "
                        f"vLLM runs them; SGLang's llama_eagle3 runs the layers after the first "
                        f"differently (they drop the incoming residual and read hidden_norm, "
                        f"weights named additional_layers.*), so it would serve another model "
                        f"than the one trained. Serve this draft with vLLM (--format vllm or "
                        f"speculators), or train for SGLang with --draft-layers 1")
    unsupported = [k for k in ("norm_before_residual", "norm_before_fc") if getattr(cfg, k)]
    if unsupported:
        flags = {"norm_before_residual": "--no-norm-before-residual",
                 "norm_before_fc": "--fc-norm (the EAGLE 3.1 fc norm SGLang runs) or "
                                   "--no-norm-before-fc"}
        raise EyasError(f"SGLang's llama_eagle3 does not implement {unsupported}: it would run a "
                        f"different model than the one trained. Serve it with vLLM "
                        f"(--format vllm), or train for SGLang with "
                        + " and ".join(flags[k] for k in unsupported)
                        + " (eyas train's default recipe turns both on)")
    out = to_vllm_config(cfg, dtype)
    out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids":
                           sglang_layer_ids(cfg.aux_layer_ids, num_target_layers),
                           "use_aux_hidden_state": True}
    return out


def to_speculators_config(cfg: DraftConfig, *, verifier: str, verifier_architectures,
                          num_speculative_tokens: int = 3, dtype: str = "bf16") -> dict:
    """config.json in the `speculators` format (Eagle3SpeculatorConfig): vLLM builds the draft
    from `transformer_layer_config` plus the top-level EAGLE-3 keys and loads the verifier named
    in `speculators_config`. Inverse: `from_speculators_config`.

    The EAGLE 3.1 keys are written in both places. vLLM 0.24.0's reader (`update_eagle3`)
    copies only `norm_before_fc` from the top level, so `fc_norm` / `norm_output` reach
    llama_eagle3 only through `transformer_layer_config` (the dict its config starts from);
    later releases also copy them from the top level, where speculators writes them."""
    eagle31 = {key: getattr(cfg, key) for key in EAGLE31_KEYS}
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_FORMAT_VERSION,
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"],
                                     **_llama_layer(cfg, dtype), **eagle31},
        **_eagle_keys(cfg), "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        **eagle31, "embed_requires_grad": False,  # all three explicit, as speculators writes them
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens":
                                  num_speculative_tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "torch_dtype": DTYPE_NAMES[DTYPES[dtype]],
    }


def from_speculators_config(config: dict) -> DraftConfig:
    """Read a speculators-format eagle3 config.json (as vLLM's `update_eagle3` does)."""
    if config.get("speculators_model_type") != "eagle3":
        raise EyasError(f"speculators config has speculators_model_type="
                        f"{config.get('speculators_model_type')!r}; eyas reads eagle3 drafts only")
    # vLLM's update_eagle3 reads a missing norm_before_residual as True, the EAGLE 3.1 keys
    # (top level only) as False
    return _draft_config(config.get("transformer_layer_config") or {}, config,
                         config.get("eagle_aux_hidden_state_layer_ids"),
                         norm_before_residual_default=True)


def read_config(config: dict) -> DraftConfig:
    """DraftConfig of any folder eyas writes (speculators detected by its keys)."""
    if "speculators_config" in config:
        return from_speculators_config(config)
    return from_vllm_config(config)


def internal_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Export names (either layout, optional `model.` prefix) -> the draft's internal names.
    A `hidden_norm` of a layer after the first is dropped: vLLM loads it and never uses it,
    and eyas's later layers have none."""
    out = {}
    for name, t in tensors.items():
        name = re.sub(r"^layers\.0\.", "midlayer.", name.removeprefix("model."))
        if not re.fullmatch(r"layers\.\d+\.hidden_norm\.weight", name):
            out[name] = t
    return out


# what to do about a damaged file, in an export folder or in a training checkpoint
REEXPORT = "re-run `eyas export` into a new folder"
PICK_ANOTHER = ("it changed after `eyas train` wrote it: use another checkpoint of the run "
                "(export --which step-N, or its checkpoints/step-N folder)")


def read_json(path: Path, fix: str) -> dict:
    """A JSON file of a draft folder or checkpoint; an edited or truncated one is an EyasError
    naming the file and `fix`, not a traceback."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise EyasError(f"{path} is not readable JSON ({err}); {fix}") from None


def read_weights(path: Path, fix: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a truncated or damaged one is an EyasError naming the
    file and `fix`."""
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise EyasError(f"{path} is not a readable safetensors file ({str(err)[:120]}); "
                        f"{fix}") from None


def read_vllm_folder(folder: str | Path) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """(DraftConfig, state dict in internal names) of an exported draft folder, any format.
    The weights are not validated here; `validate_folder` does that."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise EyasError(f"{folder} has no config.json; point at a folder written by "
                        f"`eyas export` (or another EAGLE-3 draft in vLLM layout)")
    cfg = read_config(read_json(folder / "config.json", REEXPORT))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EyasError(f"{folder} has no *.safetensors weights; re-run `eyas export`")
    tensors = {}
    for f in files:
        tensors.update(read_weights(f, REEXPORT))
    return cfg, internal_state_dict(tensors)


def find_checkpoint(path: str | Path, which: str = "best",
                    pick: str | None = None) -> tuple[Path, Path | None]:
    """(step folder, run folder or None) for a run folder + best|last|step-N, or a step folder.
    `pick`: how the caller's user names another step, where the one asked for is not there
    (export's --which step-N by default; eval's --draft RUN/checkpoints/step-N)."""
    path = Path(path)
    if (path / "draft.safetensors").is_file():
        run = path.parent.parent if path.parent.name == "checkpoints" else None
        return path, run
    ckpt = path / "checkpoints"
    if not path.exists():
        raise EyasError(f"{path} does not exist: pass the `eyas train` --out folder (or one of "
                        f"its checkpoints/step-N folders)")
    if not ckpt.is_dir():
        made = _made_by(path)
        if made is not None:  # another step's folder, an export most likely
            step, runs = made
            raise EyasError(f"{path} is the output of `eyas {step}`, not a training run; pass "
                            f"the `eyas train` --out folder" + (f" it came from ({runs})"
                                                                 if runs else ""))
        raise EyasError(f"{path} is neither an `eyas train` run folder (no checkpoints/) nor a "
                        f"checkpoint folder (no draft.safetensors); pass the train --out folder")
    have = sorted(p.name for p in ckpt.glob("step-*") if p.is_dir() and STEP_DIR.match(p.name))
    if not have:
        raise EyasError(f"{path} holds no checkpoint yet (checkpoints/ has no step-N folder): "
                        f"the run saved none so far; export once it has (eyas train saves every "
                        f"--save-every steps and at its end)")
    if which in ("best", "last"):
        pointer = ckpt / which
        if which == "last" and not pointer.is_file():
            # the pointer is gone (or the run was killed before writing it): the newest whole
            # step folder is the last checkpoint, as `eyas train --resume auto` takes it
            step = latest_complete(path)
            if step is None:
                raise EyasError(f"{path} has no checkpoints/last and none of its step folders "
                                f"({', '.join(have)}) is whole; pick one with "
                                f"{pick or '--which step-N'}")
            return step, path
        if not pointer.is_file():
            raise EyasError(f"{path} has no checkpoints/best (no eval ran, so no best was "
                            f"chosen, or the best step was removed and no eval since has "
                            f"measured one); use "
                            + (f"{pick} of {', '.join(have)}" if pick else
                               f"--which last, or --which step-N of {', '.join(have)}"))
        step = inside(ckpt, pointer.read_text().strip(), f"checkpoints/{which}")
    else:
        step = ckpt / f"step-{int(which.split('-')[1]):08d}"
    if not (step / "draft.safetensors").is_file():
        raise EyasError(f"checkpoint {step} is missing (or has no draft.safetensors); this run "
                        f"has {', '.join(have)}; pick one with {pick or '--which step-N'}")
    return step, path


def _made_by(folder: Path) -> tuple[str, str] | None:
    """(step, the train folders it read) of an eyas step's folder, or None for any other."""
    body = peek_manifest(folder) or {}
    if not body.get("step"):
        return None
    runs = [i.get("path") for i in body.get("inputs") or []
            if isinstance(i, dict) and i.get("step") == "train" and i.get("path")]
    return body["step"], ", ".join(runs)


def load_checkpoint(step: Path) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    with reading_step(step):
        if not (step / "draft_config.json").is_file():
            raise EyasError(f"{step} has no draft_config.json; it was not written by "
                            f"`eyas train`")
        cfg = DraftConfig.from_dict(read_json(step / "draft_config.json", PICK_ANOTHER))
        return cfg, read_weights(step / "draft.safetensors", PICK_ANOTHER)


@contextlib.contextmanager
def reading_step(step: Path):
    """Reading checkpoint `step`: a failure because the step folder is gone (a run still
    training removed it between finding it and reading it) says so, not what file failed."""
    try:
        yield
    except EyasError:
        if step.is_dir():
            raise
        raise EyasError(f"checkpoint {step} was removed while it was being read: the run is "
                        f"still training and keeps only its newest checkpoints (--keep-last). "
                        f"Export again (`last` and `best` then name the checkpoints kept now), "
                        f"or once the run has ended") from None
