"""Load a target with transformers and find, in any architecture, what EAGLE-3 needs from it.

Nothing here knows a model family by name. The decoder is found by structure: the
`nn.ModuleList` whose length is the text config's `num_hidden_layers` (DeepSeek-V3's
dense-then-MoE layers are one decoder-layer class; hybrids such as Jamba mix classes in it).
The module that owns that list runs the decoder loop and holds the input embedding and the
final norm; the output head is `get_output_embeddings()`. That works the same for a plain
`LlamaForCausalLM` (`model.layers`), a multimodal wrapper such as Qwen2.5-VL
(`model.language_model.layers`) or Kimi-K2.5's remote code (`language_model.model.layers`).

From a config alone the model is built on the meta device: no weight is read or allocated, so
`inspect_model` answers in seconds even for a 1T-parameter target.

A target is a hub name, a local folder, or a `.gguf` file: transformers reads a GGUF's config,
tokenizer (with its chat template) and de-quantized weights through the `gguf` package, so every
step that loads a target through `load_config` / `load_tokenizer` / `load_target` takes one.

Layer ids follow vLLM: aux id `k` is the residual stream entering decoder layer `k`
(= HF `output_hidden_states[k]` for `k < L`); id `L` is the last layer's output before the
final norm (their defaults and checks: eyas.targets.taps).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eyas.config import DEVICE_MAP_STRATEGIES, ConfigError, check_device_name
from eyas.errors import EyasError
from eyas.store.manifest import weights_damage, weights_folder
from eyas.targets.gguf import check_gguf_file, gguf_damage, is_gguf, load_once
from eyas.targets.quantized import check_fp8_blocks
from eyas.targets.taps import default_aux_layer_ids

log = logging.getLogger(__name__)

# Config keys that hold the number of routed experts, as spelled by different families.
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
# dtype names load_target accepts (a torch.dtype or "auto" also work; see load_target).
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class ModelInfo:
    """Where a target keeps its decoder pieces, and the text-model shapes a draft must match."""

    architecture: str  # class name, e.g. "KimiK25ForConditionalGeneration"
    model_type: str  # top-level config model_type
    text_model_type: str  # text config model_type, e.g. "deepseek_v3"
    is_wrapper: bool  # the text decoder sits below a multimodal (or other) wrapper
    text_model_path: str  # module that runs the decoder loop, e.g. "model.language_model"
    layers_path: str  # the decoder-layer ModuleList
    embed_path: str  # input embedding (nn.Embedding)
    norm_path: str  # final norm of the text decoder
    lm_head_path: str | None  # output embedding; None for a bare base model
    tied_embeddings: bool
    num_layers: int  # L
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # rope parameters when not plain RoPE (yarn, llama3, ...)
    max_position_embeddings: int
    is_moe: bool
    num_experts: int | None
    is_mla: bool  # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
    dtype: str  # parameter dtype of a loaded model, or the config's dtype
    quantization: dict | None  # config.quantization_config as a dict
    default_aux_layer_ids: tuple[int, int, int]


# ----------------------------------------------------------------------------- configs

def text_config(config):
    """The text (decoder) sub-config of any config; the config itself for text-only models."""
    sub = config.get_text_config(decoder=True)
    if isinstance(sub, dict):  # some remote configs keep text_config as a plain dict
        from transformers import AutoConfig

        sub = AutoConfig.for_model(**sub)
    return sub


def _looks_like_path(name: str) -> bool:
    # A hub id is "name" or "org/name"; anything else that does not exist is a missing folder.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def _explain_load_error(what: str, name: str, err: Exception, trust_remote_code: bool) -> str:
    text = str(err)
    if "trust_remote_code" in text and not trust_remote_code:
        return (f"{name} ships its own model code; re-run with --trust-remote-code "
                f"(trust_remote_code=True) if you trust it")
    first = text.splitlines()[0] if text else repr(err)
    damage = gguf_damage(name) if is_gguf(name) else ""
    if damage:
        return (f"cannot load the {what} from the GGUF file {name}: the file is damaged or cut "
                f"short ({Path(name).expanduser().stat().st_size:,} bytes; the gguf package "
                f"cannot read it either: {damage}); download it again and compare its size "
                f"and sha256 with the published ones")
    if is_gguf(name):
        return (f"cannot load the {what} from the GGUF file {name}: {first}. transformers reads "
                f"GGUF files of the architectures its GGUF documentation lists; upgrade "
                f"transformers and gguf, or pass the model's Hugging Face folder instead")
    if Path(name).expanduser().exists():
        if Path(name).expanduser().is_dir() and not (Path(name).expanduser() / "config.json"
                                                     ).is_file():
            first = "it has no config.json"  # transformers says "Unrecognized model"
        return (f"cannot load the {what} from the folder {name}: {first}. Check that it holds "
                f"the model's files as published (config.json, tokenizer files, weights)")
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    return (f"cannot load the {what} of {name!r}: {first}. "
            f"Check the hub name or folder; if this machine is offline, download it first "
            f"(`hf download {name}`) and pass the local folder"
            + ("" if offline else ", or set HF_HUB_OFFLINE=1 to use the cache")
            + "; for a gated repo run `hf auth login`")


def _check_exists(name: str) -> str:
    name = str(name)
    if not Path(name).expanduser().exists() and _looks_like_path(name):
        raise EyasError(f"model folder {name} does not exist; pass an existing folder or a "
                        f"hub name such as meta-llama/Llama-3.1-8B-Instruct")
    path = Path(name).expanduser()
    if path.is_file():  # a .gguf file does not come here (_locate)
        raise EyasError(f"{name} is a file, not a model folder: pass the folder that holds the "
                        f"model's config.json, tokenizer and weights ({path.parent}, if this "
                        f"file is one of them), or a .gguf file")
    return str(path) if path.exists() else name


def _locate(name_or_path) -> tuple[str, dict]:
    """(what to pass to `from_pretrained`, extra kwargs): a hub name or folder as is; a `.gguf`
    file as its folder plus `gguf_file=` (eyas.targets.gguf)."""
    name = str(name_or_path)
    return check_gguf_file(name) if is_gguf(name) else (_check_exists(name), {})


def load_config(name_or_path, *, revision=None, trust_remote_code=False):
    """`AutoConfig.from_pretrained` (of a hub name, folder or .gguf file) with a clear EyasError
    when the model cannot be found."""
    return _from_pretrained("config", name_or_path, revision, trust_remote_code)


def load_tokenizer(name_or_path, *, revision=None, trust_remote_code=False,
                   chat_template: str | None = None):
    """`AutoTokenizer.from_pretrained` (of a hub name, folder or .gguf file) with a clear
    EyasError when it cannot be loaded; `chat_template`: a --chat-template file whose template
    replaces the tokenizer's own."""
    tokenizer = _from_pretrained("tokenizer", name_or_path, revision, trust_remote_code)
    if chat_template:
        from eyas.targets.masking import read_template_file

        tokenizer.chat_template = read_template_file(chat_template)
    return tokenizer


def _from_pretrained(kind: str, name_or_path, revision, trust_remote_code: bool):
    import transformers

    auto = {"config": transformers.AutoConfig, "tokenizer": transformers.AutoTokenizer}[kind]
    name, where = _locate(name_or_path)

    def load():
        return auto.from_pretrained(name, revision=revision,
                                    trust_remote_code=trust_remote_code, **where)

    try:
        if where:  # a GGUF: parsed once per process (eyas.targets.gguf)
            return load_once(kind, where["gguf_file"], load, revision, trust_remote_code)
        return load()
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise EyasError(_explain_load_error(kind, str(name_or_path), err,
                                            trust_remote_code)) from err


# ----------------------------------------------------------------------------- model classes

def _model_classes(config, trust_remote_code: bool) -> list[tuple[str, Any]]:
    """Ways to build the checkpoint's model, most faithful first: the class named in
    `config.architectures` if transformers has it, then the Auto classes (which honour a
    remote-code `auto_map`). Wrappers (VL models) are not in AutoModelForCausalLM, hence the
    image-text-to-text class before the bare AutoModel (which has no lm_head)."""
    import transformers

    options: list[tuple[str, Any]] = []
    remote = bool(getattr(config, "auto_map", None)) and trust_remote_code
    for arch in (config.architectures or [])[:1]:
        cls = getattr(transformers, arch, None)
        if not remote and isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            options.append((arch, cls))
    for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel"):
        if hasattr(transformers, auto):
            options.append((auto, getattr(transformers, auto)))
    return options


def _instantiate(config, trust_remote_code: bool, make) -> nn.Module:
    errors = []
    for name, cls in _model_classes(config, trust_remote_code):
        try:
            return make(name, cls)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            errors.append(f"{name}: {str(err).splitlines()[0] if str(err) else repr(err)}")
    raise EyasError(f"transformers cannot build {config.architectures or config.model_type}: "
                    + "; ".join(errors) + ". Upgrade transformers, or pass --trust-remote-code "
                    "if the model ships its own code.")


def build_meta_model(config, *, trust_remote_code: bool = False) -> nn.Module:
    """Build the model of `config` on the meta device: full module tree, no weights read."""
    def make(name, cls):
        with torch.device("meta"):
            if name.startswith("Auto"):
                return cls.from_config(copy.deepcopy(config), trust_remote_code=trust_remote_code)
            return cls._from_config(copy.deepcopy(config))

    model = _instantiate(config, trust_remote_code, make)
    # from_config clears dtype on the (copied) config; keep the checkpoint's for inspect_model.
    for src, dst in ((config, model.config), (text_config(config), text_config(model.config))):
        if getattr(dst, "dtype", None) is None and getattr(src, "dtype", None) is not None:
            dst.dtype = src.dtype
    return model


def _check_placement(device, device_map) -> None:
    """Refuse, before any weights are read, a device (or a device_map naming one device) that
    torch cannot name or that is not here: CUDA on a machine without it, cuda:N past the
    GPUs visible."""
    named = [("device", device)]
    if isinstance(device_map, str) and device_map not in DEVICE_MAP_STRATEGIES:
        named.append(("device map", device_map))
    for what, value in named:
        check_device_name(value, f"the target's {what}", also=("auto",))
        if value is None or value == "auto" or (place := torch.device(value)).type != "cuda":
            continue
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"the target's {what} {value!r}: no CUDA device is visible here "
                              f"(torch {torch.__version__}); use cpu, or run where a GPU is")
        if place.index is not None and place.index >= count:
            raise ConfigError(f"the target's {what} {value!r}: only {count} CUDA device(s) "
                              f"are visible (cuda:0..cuda:{count - 1}; CUDA_VISIBLE_DEVICES "
                              f"decides which)")


def _on_cpu(device, device_map) -> bool:
    # with neither a device nor a device_map the model stays where transformers loads it
    if device_map is not None:
        places = device_map.values() if isinstance(device_map, dict) else [device_map]
        return not torch.cuda.is_available() or all(str(p) in ("cpu", "disk") for p in places)
    return device is None or torch.device(device).type == "cpu"


def _load_dtype(dtype, *, gguf: bool, on_cpu: bool):
    """The dtype handed to transformers. "auto" is float32 on the CPU: bf16 matmuls there are
    slow, and their rounding turns near-ties of the target's top-1 into false alarms in eval's
    lossless check. On a GPU "auto" is the checkpoint's own dtype; a GGUF has none (its weights
    are de-quantized to whatever is asked), so it gets bfloat16 there."""
    if not isinstance(dtype, torch.dtype) and dtype not in (*DTYPES, "auto"):
        raise ConfigError(f"dtype {dtype!r} is not a torch.dtype, one of {sorted(DTYPES)} "
                          f"or 'auto'")
    if dtype != "auto":
        return DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if on_cpu:
        return torch.float32
    return torch.bfloat16 if gguf else "auto"


def load_target(name_or_path, *, revision=None, trust_remote_code=False, dtype="bfloat16",
                device_map=None, device=None) -> tuple[nn.Module, ModelInfo]:
    """Load the target's weights with transformers (eval mode) and describe it.

    `name_or_path` is a hub name, a folder or a .gguf file (de-quantized at load). `dtype` is a
    torch.dtype, a name in DTYPES, or "auto": float32 on the CPU, the checkpoint's dtype on a
    GPU (bfloat16 for a GGUF). `device` "auto" spreads the target over every GPU (a
    device_map), or keeps it on the CPU when there is none."""
    import transformers

    _check_placement(device, device_map)
    if device == "auto":
        device, device_map = (None, "auto") if torch.cuda.is_available() else ("cpu", None)
    torch_dtype = _load_dtype(dtype, gguf=is_gguf(name_or_path),
                              on_cpu=_on_cpu(device, device_map))
    if is_gguf(name_or_path) and importlib.util.find_spec("accelerate") is None:
        raise EyasError(f"transformers loads the weights of a GGUF file ({name_or_path}) only "
                        f"with accelerate: pip install accelerate, or pip install 'eyas[gguf]'")
    if device_map is not None and importlib.util.find_spec("accelerate") is None:
        # transformers (5.x) refuses every device_map, even "cpu", without it
        raise EyasError(f"placing the target with device_map {device_map!r} (capture "
                        f"--device-map, train --target-device-map, eval/regenerate --device "
                        f"auto on GPUs) needs the accelerate package (transformers places the "
                        f"layers with it): pip install accelerate, or pip install "
                        f"'eyas[multigpu]'")
    config = load_config(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    check_fp8_blocks(name_or_path, config)  # transformers mis-reads partial FP8 blocks on a CPU
    name, where = _locate(name_or_path)
    if where and hasattr(transformers, "GgufConfig"):
        # With the `kernels` package installed, recent transformers keep a GGUF's weights in
        # packed blocks (GgufLinear / GgufEmbedding); eyas needs the plain nn.Linear /
        # nn.Embedding of every other target (lm_head and embedding weights, hooks).
        where["quantization_config"] = transformers.GgufConfig(dequantize=True)

    def make(cls_name, cls):
        kwargs = dict(revision=revision, dtype=torch_dtype, device_map=device_map, **where)
        if cls_name.startswith("Auto"):
            kwargs["trust_remote_code"] = trust_remote_code
        return cls.from_pretrained(name, config=config, **kwargs)

    log.info("loading %s (%s) in %s", name_or_path,
             (config.architectures or [config.model_type])[0], torch_dtype)  # a GGUF: no arch
    try:
        model = _instantiate(config, trust_remote_code, make)
    except Exception as err:
        # a weights file cut short raises safetensors' own error from deep in transformers
        folder = None if where else weights_folder(str(name_or_path), revision)
        damage = weights_damage(folder) if folder is not None else None
        if damage:
            raise EyasError(f"cannot load the weights from the folder {name_or_path}: {damage}. "
                            f"Download or copy the model again, then compare the files' sizes "
                            f"with the published ones") from err
        if not isinstance(err, OSError):
            raise
        raise EyasError(_explain_load_error("weights", str(name_or_path), err,
                                            trust_remote_code)) from err
    if device is not None:
        model.to(device)
    model.eval()
    return model, inspect_model(model)


# ----------------------------------------------------------------------------- discovery

def submodule(model: nn.Module, path: str) -> nn.Module:
    """The module at dotted `path` ("" is the model itself); EyasError naming what exists."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        children = [n for n, _ in model.named_children()]
        raise EyasError(f"{type(model).__name__} has no submodule {path!r} "
                        f"(top-level children: {children})") from None


def _paths(model: nn.Module) -> dict[int, str]:
    paths: dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(mod), name)
    return paths


def _module_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]


def _describe(blocks: nn.ModuleList) -> str:
    kinds = sorted({type(b).__name__ for b in blocks})
    return f"{len(blocks)} x {kinds[0] if len(kinds) == 1 else 'mixed ' + '/'.join(kinds)}"


def _find_layers(model: nn.Module, num_layers: int, vocab_size: int) -> str:
    """Path of the decoder-layer list: length num_hidden_layers; if several, the one beside
    the vocabulary embedding (not a vision tower as deep as the decoder), then the one of a
    single block class (hybrids such as Jamba mix Mamba and attention layers in one list)."""
    lists = _module_lists(model)
    found = [(n, m) for n, m in lists if len(m) == num_layers]
    if len(found) > 1:
        found = [(n, m) for n, m in found if _vocab_embedding(_owner(model, n), vocab_size)]
    if len(found) > 1:
        found = [(n, m) for n, m in found if len({type(b) for b in m}) == 1]
    if len(found) == 1:
        return found[0][0]
    seen = ", ".join(f"{n or '<root>'} ({_describe(m)})" for n, m in lists)
    raise EyasError(
        f"cannot tell which module list is the text decoder of {type(model).__name__}: "
        f"looked for one list of num_hidden_layers={num_layers} blocks beside a "
        f"{vocab_size}-row embedding, found {len(found)}. Module lists seen: {seen or 'none'}. "
        "Please report this with the output of `eyas doctor`.")


def _owner(model: nn.Module, path: str) -> nn.Module:
    return submodule(model, path.rpartition(".")[0])


def _vocab_embedding(owner: nn.Module, vocab_size: int) -> nn.Embedding | None:
    for child in owner.children():
        if isinstance(child, nn.Embedding) and child.num_embeddings >= vocab_size:
            return child
    return None


def _find_embedding(text_model: nn.Module, vocab_size: int) -> nn.Module:
    get = getattr(text_model, "get_input_embeddings", None)
    embed = None
    if get is not None:
        with contextlib.suppress(NotImplementedError, AttributeError):
            embed = get()
    embed = embed if isinstance(embed, nn.Embedding) else _vocab_embedding(text_model, vocab_size)
    if embed is None:
        raise EyasError(f"{type(text_model).__name__} (the text decoder) has no input "
                        f"embedding of {vocab_size} rows")
    return embed


def _find_final_norm(text_model: nn.Module, layers: nn.Module, hidden_size: int) -> str:
    """The text model's own norm over `hidden_size`. With several, the first one registered
    after the layer list wins: every HF decoder registers its final norm after its layers."""
    children = list(text_model.named_children())
    after = next(i for i, (_, child) in enumerate(children) if child is layers)
    norms = []
    for i, (name, child) in enumerate(children):
        weight = getattr(child, "weight", None)
        if ("norm" in type(child).__name__.lower() and isinstance(weight, torch.Tensor)
                and tuple(weight.shape) == (hidden_size,)):
            norms.append((i, name))
    if not norms:
        kids = [f"{n} ({type(c).__name__})" for n, c in children]
        raise EyasError(f"no final norm of size {hidden_size} found in "
                        f"{type(text_model).__name__}; its children: {kids}")
    later = [name for i, name in norms if i > after]
    return later[0] if later else norms[-1][1]


def _rope(tc) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 5's `rope_parameters` or the older keys."""
    params = dict(getattr(tc, "rope_parameters", None) or {})
    legacy = getattr(tc, "rope_scaling", None)
    theta = params.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    scaling = {k: v for k, v in (params or dict(legacy or {})).items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    # M-RoPE ("mrope" / mrope_section) equals plain RoPE on text-only positions.
    return float(theta), (scaling if kind not in ("default", "mrope") else None)


def _dtype_name(model: nn.Module, config, tc) -> str:
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "meta":
        return str(param.dtype).removeprefix("torch.")
    for cfg in (config, tc):
        dtype = getattr(cfg, "dtype", None)
        if dtype is not None:
            return str(dtype).removeprefix("torch.")
    return "unspecified"


def _quantization(config) -> dict | None:
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    return dict(quant) if isinstance(quant, dict) else quant.to_dict()


def _head_dim(tc, heads: int) -> int:
    # MLA configs name the RoPE part "head_dim"; the query/key head is nope + rope wide.
    if getattr(tc, "kv_lora_rank", None) is not None and getattr(tc, "qk_nope_head_dim", None):
        return int(tc.qk_nope_head_dim + tc.qk_rope_head_dim)
    return int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)


def _num_experts(tc) -> int | None:
    for key in EXPERT_COUNT_KEYS:
        value = getattr(tc, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return None


def inspect_model(model_or_config, *, trust_remote_code: bool = False) -> ModelInfo:
    """Describe a target from a loaded model, or from a config (built on the meta device)."""
    if isinstance(model_or_config, nn.Module):
        model, config = model_or_config, model_or_config.config
    else:
        config = model_or_config
        model = build_meta_model(config, trust_remote_code=trust_remote_code)
    tc = text_config(config)
    num_layers, vocab = int(tc.num_hidden_layers), int(tc.vocab_size)
    layers_path = _find_layers(model, num_layers, vocab)
    text_path = layers_path.rpartition(".")[0]
    text_model, layers = submodule(model, text_path), submodule(model, layers_path)
    paths = _paths(model)
    embed = _find_embedding(text_model, vocab)
    norm_name = _find_final_norm(text_model, layers, int(tc.hidden_size))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    theta, scaling = _rope(tc)
    heads = int(tc.num_attention_heads)
    num_experts = _num_experts(tc)
    return ModelInfo(
        architecture=type(model).__name__,
        model_type=str(config.model_type),
        text_model_type=str(tc.model_type),
        is_wrapper="." in text_path or tc is not config,
        text_model_path=text_path,
        layers_path=layers_path,
        embed_path=paths[id(embed)],
        norm_path=f"{text_path}.{norm_name}" if text_path else norm_name,
        lm_head_path=paths[id(head)] if head is not None else None,
        tied_embeddings=head is not None and head.weight is embed.weight,
        num_layers=num_layers,
        hidden_size=int(tc.hidden_size),
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
        head_dim=_head_dim(tc, heads),
        intermediate_size=int(tc.intermediate_size),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", None) or 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(tc.max_position_embeddings),
        is_moe=num_experts is not None,
        num_experts=num_experts,
        is_mla=getattr(tc, "kv_lora_rank", None) is not None,
        dtype=_dtype_name(model, config, tc),
        quantization=_quantization(config),
        default_aux_layer_ids=default_aux_layer_ids(num_layers),
    )
