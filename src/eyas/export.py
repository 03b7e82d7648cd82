"""`eyas export`: a training checkpoint -> a draft folder vLLM, SGLang or `speculators` loads.

Three formats, one set of weights (reference §5; docs/export.md); a DFlash checkpoint
(`eyas train --draft dflash`) is written as the one folder vLLM's `dflash` and SGLang's DFLASH
both read (eyas.serve.dflash_export, docs/dflash.md):

- `vllm` (default): `config.json` in the Llama layout that vLLM's `LlamaForCausalLMEagle3`
  (`llama_eagle3.py`) reads + `model.safetensors`. Served with `vllm serve TARGET
  --speculative-config '{"method": "eagle3", "model": DRAFT, ...}'`.
- `speculators`: the same weights (layer 0 under `layers.0.`) with the config of the `speculators`
  library (`speculators_model_type: "eagle3"`, `transformer_layer_config`,
  `speculators_config.verifier`), so `vllm serve DRAFT` works alone.
- `sglang`: the vLLM layout, but `eagle_config.eagle_aux_hidden_state_layer_ids` in SGLang's
  convention: SGLang adds 1 to each id and captures the INPUT of that layer, so eyas writes
  `k - 1` there to capture the same residual streams as vLLM's id `k`. The top-level key keeps
  vLLM's ids (vLLM reads the top level first, SGLang only `eagle_config`), so the folder is
  correct in both servers.

Inside eyas the weight names are the vLLM export names (`fc.weight`, `midlayer.*`, `layers.{i}.*`
for a layer i >= 1, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`); each format's config
mapping is one pair of functions in `eyas.draft.formats` (`to_*_config` / `from_*_config`).
A draft of several decoder layers (`eyas train --draft-layers`) is written for vLLM only:
`--format sglang` refuses it. Every folder is validated before it is written.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.config import (ConfigError, accept_other_weights_option, check_choices, option,
                         out_option, required)
from eyas.draft.config import DraftConfig
from eyas.errors import EyasError
from eyas.draft.formats import (DTYPES, EAGLE31_KEYS, SERVED_SINCE, read_config,
                                to_sglang_config, to_speculators_config, to_vllm_config)
# Documented as eyas.export API (docs/export.md); they live in eyas.draft.formats.
from eyas.draft.formats import (from_speculators_config, from_vllm_config,  # noqa: F401
                                sglang_layer_ids)
from eyas.serve.export_readme import ServedTarget, render_readme, served_target
from eyas.serve.quoted_report import read_report, step_number
from eyas.store.manifest import (MANIFEST, check_out, check_same_target, file_sha256, inside,
                                 peek_manifest, read_manifest, rebaser, target_record,
                                 write_manifest)
from eyas.store.permissions import as_umask
from eyas.draft.formats import (PICK_ANOTHER, REEXPORT, find_checkpoint, load_checkpoint,
                                read_json, read_weights, reading_step)
from eyas.dflash.formats import dflash_checkpoint_config
from eyas.serve.dflash_export import dflash_config_json, dflash_readme, dflash_tensors

log = logging.getLogger(__name__)

FORMATS = ("vllm", "speculators", "sglang")
LAYOUTS = ("midlayer", "layers.0")
# Layer 0's prefix each format's loader accepts: vLLM maps midlayer. -> layers.0. and takes
# both; SGLang only loads midlayer.* (others are skipped silently); speculators' model class
# names its first layer layers.0. Layers i >= 1 are layers.{i}. in every format (vLLM maps
# only midlayer., and leaves a missing weight uninitialised without a word).
NATIVE_LAYOUT = {"vllm": "midlayer", "speculators": "layers.0", "sglang": "midlayer"}
WEIGHTS_FILE = "model.safetensors"
# Every name an export writes; a re-export replaces a folder holding only these
FILES = (WEIGHTS_FILE, "config.json", "README.md")


@dataclass(frozen=True)
class ExportConfig:
    """Write a trained draft as a folder vLLM / SGLang load as is (docs/export.md)."""

    checkpoint: str = required("`eyas train` run folder (or one of its checkpoints/step-N folders)")
    out: str = out_option("draft folder to write (config.json, model.safetensors, README.md)")
    format: str = option("vllm", "vllm: vllm serve TARGET --speculative-config ...; "
                                 "speculators: vllm serve DRAFT alone; sglang: SGLang's EAGLE3",
                         choices=FORMATS)
    dtype: str = option("bf16", "weight dtype (d2t/t2d keep int64/bool)", choices=tuple(DTYPES))
    which: str = option("best", "checkpoint of the run: best, last or step-N")
    layout: str | None = option(None, "decoder-layer 0's prefix: midlayer or layers.0 (default: "
                                      "the format's own: midlayer for vllm/sglang, layers.0 for "
                                      "speculators); layers after it are always layers.N",
                                choices=LAYOUTS)
    num_speculative_tokens: int | None = option(None, "draft tokens per step written into the "
                                                   "serve commands and the speculators config; "
                                                   "unset: 3 for EAGLE-3, a DFlash draft's "
                                                   "block size less one")
    acceptance_report: str | None = option(None, "report.json (or its folder) from `eyas eval` "
                                                 "to quote in the README")
    target: str | None = option(None, "target name for the README commands and the speculators "
                                      "verifier (default: the one the run was trained on)")
    overwrite: bool = option(False, "replace an export in --out that came from another "
                                    "training run (otherwise that is an error)")
    accept_other_weights: bool = accept_other_weights_option("a --target")

    def __post_init__(self):
        check_choices(self)
        if not re.fullmatch(r"best|last|step-\d+", self.which):
            raise ConfigError(f"--which {self.which!r}: use best, last or step-N (e.g. step-2000)")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ConfigError(f"--num-speculative-tokens must be >= 1, got "
                              f"{self.num_speculative_tokens}")
        if self.layout is not None and self.layout != NATIVE_LAYOUT[self.format] \
                and self.format != "vllm":
            raise ConfigError(f"--layout {self.layout} does not load in {self.format}: it needs "
                              f"{NATIVE_LAYOUT[self.format]} (leave --layout unset)")

    @property
    def resolved_layout(self) -> str:
        return self.layout or NATIVE_LAYOUT[self.format]


# ----------------------------------------------------------------------------- weights

def expected_shapes(cfg: DraftConfig, layout: str = "midlayer") -> dict[str, tuple[int, ...]]:
    """Every key an exported draft holds, with its shape (no embed_tokens: the server shares
    the target's). `layout` is layer 0's prefix; layer i >= 1 is `layers.{i}`, its q/k/v
    reading H inputs, without hidden_norm (vLLM builds one there but never uses it)."""
    h, ht, i = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def layer(first: bool) -> dict[str, tuple[int, ...]]:
        qkv_in = 2 * h if first else h
        return {"input_layernorm": (h,), **({"hidden_norm": (h,)} if first else {}),
                "self_attn.q_proj": (q, qkv_in),
                "self_attn.k_proj": (kv, qkv_in), "self_attn.v_proj": (kv, qkv_in),
                "self_attn.o_proj": (h, q), "post_attention_layernorm": (h,),
                "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}

    out = {"fc.weight": (h, 3 * ht)}
    if cfg.norm_before_fc:
        out["input_norm.weight"] = (3 * ht,)  # one norm over the concatenated aux states
    if cfg.fc_norm:
        out.update({f"fc_norm.{j}.weight": (ht,) for j in range(3)})
    out.update({f"{layout}.{name}.weight": shape for name, shape in layer(True).items()})
    for n in range(1, cfg.num_hidden_layers):
        out.update({f"layers.{n}.{name}.weight": shape for name, shape in layer(False).items()})
    out.update({"norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h)})
    if cfg.maps_vocab:
        out.update({"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)})
    return out


def export_state_dict(state: dict[str, torch.Tensor], *, layout: str = "midlayer",
                      dtype: str = "bf16") -> dict[str, torch.Tensor]:
    """Internal (checkpoint) names -> export names and dtype; d2t/t2d keep int64/bool."""
    out = {}
    for name, tensor in state.items():
        if layout != "midlayer" and name.startswith("midlayer."):
            name = layout + name[len("midlayer"):]
        if tensor.is_floating_point():
            tensor = tensor.to(DTYPES[dtype])
        out[name] = tensor.contiguous()
    return out


# ----------------------------------------------------------------------------- validation

def _check_cast(state: dict[str, torch.Tensor], dtype: str, step: Path) -> None:
    """A weight finite in the checkpoint `state` that --dtype cannot hold (fp16 tops out at
    65504) is named with the dtypes that can: the cast's Inf was called NaN or Inf, with
    advice to export an earlier checkpoint of a draft that is fine (both families)."""
    for name, tensor in state.items():
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            continue  # (a checkpoint's own NaN: the export's own check names it)
        if not bool(torch.isfinite(tensor.to(DTYPES[dtype])).all()):
            raise EyasError(f"weight {name!r} of {step} holds values "
                            f"({float(tensor.abs().max()):g} at most) that --dtype {dtype} "
                            f"cannot hold; export with --dtype bf16 or fp32")


def validate_export(config: dict, tensors: dict[str, torch.Tensor], fmt: str) -> DraftConfig:
    """Refuse a folder a server would load wrong: config keys, every weight's presence, shape
    and dtype, no extra keys, finite values, and d2t/t2d agreeing. Names the key at fault."""
    cfg = read_config(config)
    _check_config_keys(config, cfg, fmt)
    layout = "layers.0" if any(k.startswith("layers.0.") for k in tensors) else "midlayer"
    if fmt != "vllm" and layout != NATIVE_LAYOUT[fmt]:
        raise EyasError(f"{fmt} loads {NATIVE_LAYOUT[fmt]}.* weights but this folder has "
                        f"{layout}.*; re-export with --format {fmt} and no --layout")
    want = expected_shapes(cfg, layout)
    missing = [k for k in want if k not in tensors]
    extra = sorted(set(tensors) - set(want))
    if missing:
        raise EyasError(f"draft weights miss {missing[0]!r}" + (f" (and {len(missing) - 1} more)"
                        if len(missing) > 1 else "") + "; re-export from the training checkpoint")
    if extra:
        why = " (the server shares the target's embedding; drop it)" if "embed_tokens" in extra[0] \
            else (" (the draft covers the target's whole vocabulary: no map; re-export it with "
                  "this eyas)") if extra[0] in ("d2t", "t2d") else ""
        raise EyasError(f"draft weights have unexpected key {extra[0]!r}{why}; the server "
                        f"would refuse or ignore it")
    float_dtype = tensors["fc.weight"].dtype
    for name, shape in want.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise EyasError(f"weight {name!r} has shape {tuple(t.shape)} but config.json implies "
                            f"{shape}; the weights and config.json come from different drafts")
        want_dtype = {"d2t": torch.int64, "t2d": torch.bool}.get(name, float_dtype)
        if name not in ("d2t", "t2d") and not t.is_floating_point():
            want_dtype = "a float dtype"
        if t.dtype != want_dtype:
            raise EyasError(f"weight {name!r} is {t.dtype} but must be {want_dtype} (floats all "
                            f"in fc.weight's dtype, d2t int64, t2d bool)")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise EyasError(f"weight {name!r} holds NaN or Inf; export an earlier checkpoint")
    if cfg.maps_vocab:
        _check_vocab_maps(tensors["d2t"], tensors["t2d"])
    return cfg


def _check_config_keys(config: dict, cfg: DraftConfig, fmt: str) -> None:
    if fmt == "sglang" and cfg.num_hidden_layers > 1:  # a folder made elsewhere, or edited
        raise EyasError(f"this SGLang folder has {cfg.num_hidden_layers} decoder layers; SGLang "
                        f"runs the layers after the first differently from how eyas trains "
                        f"them (as vLLM runs them): serve the draft with vLLM")
    layer = config.get("transformer_layer_config", config) if fmt == "speculators" else config
    need = {"model_type": "llama", "num_hidden_layers": cfg.num_hidden_layers,
            "tie_word_embeddings": False}
    if fmt != "speculators":
        need["architectures"] = ["LlamaForCausalLMEagle3"]
    for key, value in need.items():
        if layer.get(key) != value:
            raise EyasError(f"config.json key {key!r} is {layer.get(key)!r}, must be {value!r} "
                            f"(a target model_type makes vLLM build another draft class)")
    if "norm_before_residual" not in config:
        raise EyasError("config.json lacks norm_before_residual; servers default it "
                        "differently (vLLM False, speculators True): write it explicitly")
    ids = list(cfg.aux_layer_ids)
    if config.get("eagle_aux_hidden_state_layer_ids") != ids:
        raise EyasError("config.json key 'eagle_aux_hidden_state_layer_ids' must be at the top "
                        f"level (vLLM convention), found {config.get('eagle_aux_hidden_state_layer_ids')!r}")
    if fmt == "speculators":
        return
    eagle = config.get("eagle_config") or {}
    want = ids if fmt == "vllm" else [k - 1 for k in ids]
    if eagle.get("eagle_aux_hidden_state_layer_ids") != want or eagle.get("use_aux_hidden_state") is not True:
        raise EyasError(f"config.json key 'eagle_config' must be {{'eagle_aux_hidden_state_layer_ids'"
                        f": {want}, 'use_aux_hidden_state': true}} for --format {fmt}, found {eagle}")


def _check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """t2d has exactly Vd true entries, at target ids i + d2t[i], ascending."""
    ids = torch.arange(d2t.numel()) + d2t
    if int(t2d.sum()) != d2t.numel():
        raise EyasError(f"weights 'd2t'/'t2d' disagree: t2d has {int(t2d.sum())} true entries "
                        f"but d2t maps {d2t.numel()} draft ids; re-run `eyas vocab` and train")
    if not torch.equal(ids, t2d.nonzero().squeeze(1)):
        raise EyasError("weights 'd2t'/'t2d' disagree: target ids i + d2t[i] are not exactly "
                        "the true entries of t2d in ascending order; re-run `eyas vocab`")


def folder_format(folder: str | Path, config: dict) -> str:
    """vllm, speculators or sglang, from the config (and eyas.json where the ids cannot tell)."""
    if "speculators_config" in config:
        return "speculators"
    manifest = Path(folder) / MANIFEST
    if manifest.is_file():
        fmt = read_json(manifest, REEXPORT).get("format")
        if fmt in FORMATS:
            return fmt
    top = config.get("eagle_aux_hidden_state_layer_ids")
    inner = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return "sglang" if top and inner == [k - 1 for k in top] else "vllm"


def validate_folder(path: str | Path) -> DraftConfig:
    """Check an exported draft folder as `eyas export` does before writing; returns its config."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise EyasError(f"{folder} has no config.json; point at a folder written by `eyas export`")
    config = read_json(folder / "config.json", REEXPORT)
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(read_weights(f, REEXPORT))
    return validate_export(config, tensors, folder_format(folder, config))


# ----------------------------------------------------------------------------- checkpoint

# ----------------------------------------------------------------------------- export

def _names_step(which: str, step: Path) -> bool:
    """--which names this checkpoint: `step-20` or the folder's own `step-00000020`."""
    number = which.removeprefix("step-")
    return which.startswith("step-") and number.isdigit() and int(number) == step_number(step)


def export(cfg: ExportConfig) -> Path:
    """Write the draft folder `cfg.out` (validated first) and return its path."""
    # resolved: the manifest records the run by its folder, which tells a re-export of the
    # same run from another run's export in --out (_fresh_dir)
    step, run = find_checkpoint(Path(cfg.checkpoint).resolve(), cfg.which)
    if (Path(cfg.checkpoint) / "draft.safetensors").is_file() and cfg.which != "best" and \
            not _names_step(cfg.which, step):
        raise EyasError(f"--which {cfg.which} picks a checkpoint of a run folder, but "
                        f"--checkpoint {cfg.checkpoint} is one checkpoint already ({step.name}): "
                        f"pass the run folder{f' ({run})' if run else ''} with --which, or "
                        f"drop --which", flag="--which")
    train = read_manifest(run, step="train") if run and (run / MANIFEST).is_file() else None
    if train is not None and train.get("complete") is False:
        log.warning("the run in %s is unfinished (killed, or still training): exporting its "
                    "%s, %s; the same `eyas train` command resumes the run to its end (the "
                    "README says the draft is unfinished)", run, cfg.which, step.name)
    with reading_step(step):
        dflash = dflash_checkpoint_config(read_json(step / "draft_config.json", PICK_ANOTHER)) \
            if (step / "draft_config.json").is_file() else None
    if dflash is not None:
        return _export_dflash(cfg, dflash, step, run or step, train)
    asked, cfg = cfg, replace(cfg, num_speculative_tokens=cfg.num_speculative_tokens or 3)
    dcfg, state = load_checkpoint(step)
    if train is None:
        log.warning("no train manifest found next to %s: the README cannot say how the draft "
                    "was trained", step)
    target = (train or {}).get("target") or {}
    served = _served_target(cfg, train)
    if cfg.format == "speculators" and not (cfg.target or target.get("name_or_path")):
        raise EyasError("--format speculators names the verifier, but the run records no "
                        "target; give --target MODEL")
    config = _format_config(cfg, dcfg, served, target)  # refuses what a format cannot run
    variants = [k for k in EAGLE31_KEYS if getattr(dcfg, k)]
    if variants:
        since = SERVED_SINCE[cfg.format]
        log.warning("this draft uses EAGLE 3.1 %s: a --format %s folder runs as trained on %s; "
                    "older releases do not build these norms", variants, cfg.format,
                    ", ".join(f"{since[k]} or later ({k})" for k in variants))
    if not dcfg.maps_vocab:  # the identity: no map in the folder
        if bool(state["d2t"].any()):
            raise EyasError(f"{step}: a draft vocab as large as the target's with a d2t that "
                            f"is not the identity; re-run `eyas vocab` and train")
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    tensors = export_state_dict(state, layout=cfg.resolved_layout, dtype=cfg.dtype)
    _check_cast(state, cfg.dtype, step)
    validate_export(config, tensors, cfg.format)
    report = read_report(cfg.acceptance_report, target, train, step)
    out = Path(cfg.out).resolve()  # `--out .` too: its folder is written beside, then renamed
    tmp = _fresh_dir(out, run or step, cfg.overwrite)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "README.md").write_text(render_readme(cfg, dcfg, out, served, train, step, report))
    # the config as given (unset k stays unset), so `eyas run` sees the step unchanged
    write_manifest(tmp, "export", asked, target=target or None, inputs=[train] if train else [],
                   format=cfg.format, layout=cfg.resolved_layout, dtype=cfg.dtype,
                   checkpoint=str(step), aux_layer_ids=list(dcfg.aux_layer_ids),
                   draft_config=dcfg.to_dict(),
                   files={f: file_sha256(tmp / f) for f in FILES})
    as_umask(tmp)  # safetensors wrote its file owner-only: a server may run as another user
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log.info("wrote %s draft (%s, %s) from %s to %s", cfg.format, cfg.dtype,
             cfg.resolved_layout, step, out)
    return out


def _export_dflash(cfg: ExportConfig, dcfg, step: Path, source: Path,
                   train: dict | None) -> Path:
    """A DFlash checkpoint -> the folder vLLM's `dflash` and SGLang's DFLASH both read (one
    format: --format vllm or sglang; SGLang takes the taps from dflash_config itself)."""
    if cfg.format == "speculators":
        raise EyasError("--format speculators is not written for DFlash drafts yet; use --format "
                        "vllm (the same folder serves SGLang's DFLASH)")
    if cfg.layout is not None:
        raise EyasError("--layout applies to EAGLE-3 drafts; a DFlash draft has layers.N.* "
                        "weights only: drop --layout")
    most = dcfg.block_size - 1
    if (cfg.num_speculative_tokens or most) > most:
        raise EyasError(f"--num-speculative-tokens {cfg.num_speculative_tokens}: this DFlash "
                        f"draft has blocks of {dcfg.block_size} (the bonus token and {most} "
                        f"drafts), so it drafts at most {most} per step; give {most} or less")
    asked, cfg = cfg, replace(cfg, num_speculative_tokens=cfg.num_speculative_tokens or most)
    target = (train or {}).get("target") or {}
    served = _served_target(cfg, train)
    report = read_report(cfg.acceptance_report, target, train, step, "dflash")
    weights = read_weights(step / "draft.safetensors", PICK_ANOTHER)
    _check_cast(weights, cfg.dtype, step)
    tensors = dflash_tensors(dcfg, weights, cfg.dtype)
    config = dflash_config_json(dcfg, cfg.dtype, target.get("num_hidden_layers"))
    # SGLang captures the inputs of layers 0..L-1 only: a tap of layer L's output (vLLM's id
    # L) it cannot serve (its `target_layer_ids` L - 1 is past its last layer)
    try:
        sglang_layer_ids(dcfg.aux_layer_ids, target.get("num_hidden_layers"))
        sglang_refused = ""
    except EyasError as err:
        if cfg.format == "sglang":
            raise
        sglang_refused = str(err)
    out = Path(cfg.out).resolve()  # `--out .` too: its folder is written beside, then renamed
    tmp = _fresh_dir(out, source, cfg.overwrite)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "README.md").write_text(dflash_readme(
        dcfg, str(out.resolve()), served, str(step), (train or {}).get("best"),
        cfg.num_speculative_tokens, report, unfinished=(train or {}).get("complete") is False,
        train=train, sglang_refused=sglang_refused))
    write_manifest(tmp, "export", asked, target=target or None, inputs=[train] if train else [],
                   format=cfg.format, draft="dflash", dtype=cfg.dtype, checkpoint=str(step),
                   aux_layer_ids=list(dcfg.aux_layer_ids), draft_config=dcfg.to_dict(),
                   files={f: file_sha256(tmp / f) for f in FILES})
    as_umask(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    log.info("wrote DFlash draft (%s) from %s to %s", cfg.dtype, step, out)
    return out


def _format_config(cfg: ExportConfig, dcfg: DraftConfig, served: ServedTarget,
                   target: dict) -> dict:
    if cfg.format == "vllm":
        return to_vllm_config(dcfg, cfg.dtype)
    if cfg.format == "sglang":
        layers = target.get("num_hidden_layers")
        if layers is None:
            log.warning("the target's layer count is not recorded (a checkpoint without its "
                        "run): SGLang cannot capture vLLM's id L (the last layer's output), and "
                        "whether %s holds it is not checked; export from the run folder, or "
                        "check that every id is below the target's layer count",
                        list(dcfg.aux_layer_ids))
        return to_sglang_config(dcfg, cfg.dtype, layers)
    return to_speculators_config(dcfg, verifier=served.name,
                                 verifier_architectures=_architectures(served.name),
                                 num_speculative_tokens=cfg.num_speculative_tokens, dtype=cfg.dtype)


def _maybe_relative_path(name: str) -> bool:
    """A name that does not exist here and may be a relative path rather than a hub name
    (org/model): no slash or several, a leading . or ~, or a .gguf file."""
    path = Path(name).expanduser()
    if path.is_absolute() or path.exists():
        return False
    return name.count("/") != 1 or name.startswith((".", "~")) or \
        path.suffix.lower() == ".gguf"


def _served_target(cfg: ExportConfig, train: dict | None) -> ServedTarget:
    """The target the serve commands (and the speculators verifier) name: --target, checked
    against the run's target where it is a local folder or file, else the run's own (with its
    revision), as a server loads it from anywhere."""
    target = (train or {}).get("target") or {}
    remote = bool(((train or {}).get("config") or {}).get("trust_remote_code"))
    recorded = target.get("name_or_path")
    if cfg.target is None or cfg.target == recorded:
        if recorded and _maybe_relative_path(recorded):
            where = target.get("path")
            if where and Path(where).exists():
                # a path relative to where the run trained: the serve commands name it whole
                log.info("the run's target %s is %s", recorded, where)
                return served_target(where, target.get("revision"), remote)
            log.warning("the run recorded its target as %s, which is no path from here%s: if "
                        "it is a path relative to where the run trained, give --target with "
                        "its path, or the serve commands name a model that is not there (a hub "
                        "name is served as it is)", recorded,
                        f" (it was {where}, gone since)" if where else "")
        return served_target(recorded, target.get("revision"), remote)
    if target:
        from eyas.targets.models import load_config

        local = Path(cfg.target).expanduser().exists()
        try:  # a hub name: its config from the cache or the hub
            config = load_config(cfg.target, trust_remote_code=remote)
        except EyasError as err:
            if local:
                raise
            log.warning("--target %s is no local folder and its config cannot be read here "
                        "(%s): the export names it without checking it against the target the "
                        "run was trained on (%s). Make sure it is that model, or give --target "
                        "a local copy of it to have it checked", cfg.target,
                        str(err).split(". ")[0], recorded)
            return served_target(cfg.target, None, remote)
        # the served model's weights too: another checkpoint of the same shape is another
        # target (the same one in another precision: --accept-other-weights)
        weights = not cfg.accept_other_weights
        given = target_record(cfg.target, config=config, weights=weights)
        check_same_target(target, given, f"the run in {cfg.checkpoint} (trained on "
                          f"{recorded})", fix=f"give --target the model the run was trained on "
                          f"({recorded}), or leave --target out", weights=weights)
    return served_target(cfg.target, None, remote)


def _architectures(target_name: str | None) -> list[str]:
    """The target's architectures from its config.json when it is a local folder (the
    speculators verifier record); [] otherwise (vLLM reads only the verifier's name)."""
    path = Path(target_name or "") / "config.json"
    return list(json.loads(path.read_text()).get("architectures") or []) if path.is_file() else []


def _fresh_dir(out: Path, source: Path, overwrite: bool) -> Path:
    """A temp folder beside `out`. `out` is replaced later, so it must be missing, empty or an
    earlier export holding only the files eyas wrote there, unedited (check_out, and the
    sha256 each file had when it was written), made from `source` (the run folder, or the
    checkpoint exported when it has none) unless `overwrite`; anything else is refused by name."""
    check_out(out, "export", own=FILES)
    earlier = peek_manifest(out)
    if earlier is not None:
        recorded = earlier.get("files") or {}
        edited = [f for f, digest in recorded.items()
                  if (out / f).is_file() and file_sha256(inside(out, f, MANIFEST)) != digest]
        if edited:
            raise EyasError(f"{out} is an earlier export, but {', '.join(edited)} changed since "
                            f"eyas wrote it (yours now); re-exporting would replace it. Move it "
                            f"away, or choose another --out.", flag="--out")
        theirs = _exported_from(earlier)
        if theirs is not None:  # (a work_dir moved since holds its run where it is now)
            theirs = Path(rebaser(earlier, out)(str(theirs)))
        if theirs != source and not overwrite:
            what = f"another training run ({theirs})" if theirs else \
                "a training run its eyas.json does not name"
            raise EyasError(f"--out {out} holds an export of {what}, not of {source}; "
                            f"exporting would replace it. Choose another --out, or pass "
                            f"--overwrite to replace it.", flag="--out")
    tmp = out.with_name(out.name + ".tmp-export")
    if tmp.is_dir() and {p.name for p in tmp.iterdir()} - {*FILES, MANIFEST}:
        raise EyasError(f"{tmp}, where export writes the new folder before it replaces --out, "
                        f"holds files eyas did not write there; move it away, or choose "
                        f"another --out", flag="--out")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _exported_from(made: dict) -> Path | None:
    """The folder an export's manifest says it came from: the `eyas train` run it read, else
    the run folder around its checkpoint, or the checkpoint itself (a step folder elsewhere);
    None if it records neither."""
    runs = [i["path"] for i in made.get("inputs") or []
            if isinstance(i, dict) and i.get("step") == "train" and i.get("path")]
    if runs:
        return Path(runs[0]).resolve()
    if not made.get("checkpoint"):
        return None
    step = Path(made["checkpoint"])
    return (step.parent.parent if step.parent.name == "checkpoints" else step).resolve()
