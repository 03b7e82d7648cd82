"""`eyas doctor MODEL`: will this target work with eyas and vLLM, and what must change.

The report is built from the config alone (the model is built on the meta device, no weight is
downloaded or read) plus the tokenizer, so it runs in seconds for any size of target. It says
where the text decoder sits, which aux layers EAGLE-3 will use, how many bytes each captured
token costs, what capture / train / export will do, and, when vLLM is importable, whether
vLLM's class for the architecture satisfies `SupportsEagle3`, accepts the text model type for
eagle3, and whether the eyas vLLM plugin would patch it. `--json` prints the same dict.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import json
import logging
import logging.handlers
import shlex
import sys
import typing
from dataclasses import asdict, dataclass
from pathlib import Path

from eyas.kernels import band_kernels
from eyas.config import (ConfigError, option, required, revision_option,
                         trust_remote_code_option)
from eyas.errors import EyasError
from eyas.draft.formats import SERVED_SINCE
from eyas.store.manifest import (LAYER_ID_CONVENTION, MANIFEST, converted_from, target_record,
                                 versions, weights_damage)
from eyas.targets.gguf import is_gguf
from eyas.targets.models import (ModelInfo, build_meta_model, inspect_model, load_config,
                                 load_tokenizer, submodule)
from eyas.targets.taps import validate_aux_layer_ids

# Every member name vLLM's SupportsEagle3 protocol has had (vLLM renamed the default-layer
# getter around 0.18 and added the two has_own_* flags around 0.12).
EAGLE3_MEMBERS = (
    "supports_eagle3", "has_own_lm_head", "has_own_embed_tokens", "set_aux_hidden_state_layers",
    "get_eagle3_aux_hidden_state_layers", "get_eagle3_default_aux_hidden_state_layers",
)
# Where vLLM keeps its eagle3 target model_type allow-list (a package from ~0.11, one file before).
ALLOW_LIST_MODULES = ("vllm.config.speculative", "vllm.config")
# The allow-list of vLLM ~0.10-0.11, quoted when vLLM cannot be imported here.
OLD_ALLOW_LIST = ("llama", "qwen", "minicpm", "gpt_oss")
DEFAULT_DRAFT_VOCAB = 32000


@dataclass(frozen=True)
class DoctorConfig:
    """What `eyas doctor` checks."""

    target: str = required("model to check: hub name, local folder or .gguf file", positional=True)
    trust_remote_code: bool = trust_remote_code_option()
    revision: str | None = revision_option()
    json: bool = option(False, "print the report as JSON (for scripts) instead of text")
    aux_layer_ids: tuple[int, ...] | None = option(
        None, "aux layer ids to check, vLLM convention (default: the target's (2, L//2, L-3))")

    def __post_init__(self):
        if not str(self.target).strip():
            raise ConfigError("give the model to check: eyas doctor MODEL (hub name or folder)")
        if self.aux_layer_ids is not None:
            validate_aux_layer_ids(self.aux_layer_ids, None)


def doctor(cfg: DoctorConfig) -> dict:
    """Inspect `cfg.target`, print the report (text, or JSON with `cfg.json`) and return it."""
    _refuse_a_step_folder(str(cfg.target))
    config = load_config(cfg.target, revision=cfg.revision,
                         trust_remote_code=cfg.trust_remote_code)
    model = build_meta_model(config, trust_remote_code=cfg.trust_remote_code)
    info = inspect_model(model)
    ids = validate_aux_layer_ids(cfg.aux_layer_ids or info.default_aux_layer_ids, info.num_layers)
    layers = submodule(model, info.layers_path)
    report = {
        "target": str(cfg.target),
        "revision": cfg.revision,
        "versions": versions(),
        "model": asdict(info),
        "layer_class": type(layers[0]).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "aux_layer_ids": {"ids": list(ids),
                          "source": "given" if cfg.aux_layer_ids else _default_rule(
                              info.num_layers),
                          "convention": LAYER_ID_CONVENTION},
        "capture_bytes": capture_bytes_per_token(info.hidden_size),
        "tokenizer": _tokenizer_report(cfg, info),
        "plan": _plan(info, ids, cfg),
        "vllm": vllm_report(config.architectures or [info.architecture], info.text_model_type),
        # the draft's heads are the target's by default (DraftConfig.from_target)
        "draft_attention": band_kernels.describe(info.num_attention_heads, info.head_dim),
    }
    # a local folder's weights cut short (a hub name's cache may lack files it downloads)
    folder = Path(str(cfg.target)).expanduser()
    report["weights_damage"] = weights_damage(folder) if folder.is_dir() else None
    # what later steps compare to tell this checkpoint from another of its shape (none for
    # weights cut short: their fingerprint names no checkpoint; the identity line says why)
    record = target_record(str(cfg.target), cfg.revision)
    report["identity"] = {} if report["weights_damage"] else {
        k: record[k] for k in ("gguf_fingerprint", "weights_fingerprint")
        if record.get(k)}  # none without weights here
    report["problems"] = _problems(report, info)
    report["notes"] = _notes(str(cfg.target))
    report["ok"] = not report["problems"]
    report["vllm_checked"] = report["vllm"]["importable"] and "broken" not in report["vllm"]
    _emit(json.dumps(report, indent=2, default=str) if cfg.json else render_text(report))
    return report


def _refuse_a_step_folder(target: str) -> None:
    """An eyas step's output is no target: an exported draft's config.json would be inspected
    as a 1-layer Llama ("has no 3 distinct aux layers"). `eyas convert`'s folder is a target."""
    manifest = Path(target).expanduser() / MANIFEST
    try:
        body = json.loads(manifest.read_text()) if manifest.is_file() else {}
    except (OSError, ValueError):
        return  # not eyas's to judge: the config decides
    step = body.get("step")
    if step and step != "convert":
        made_for = (body.get("target") or {}).get("name_or_path")
        raise EyasError(f"{target} holds the output of `eyas {step}`, not a model; doctor checks "
                        f"the target" + (f": eyas doctor {made_for}" if made_for else ""))


def _emit(text: str) -> None:
    # The report is this command's product (to paste into a bug report), not a log line.
    sys.stdout.write(text + "\n")


# ----------------------------------------------------------------------------- target side

def capture_bytes_per_token(hidden_size: int) -> dict:
    """Bytes `eyas capture` stores per token (see docs/architecture.md, captured/)."""
    parts = {"aux_hidden": 3 * hidden_size * 2, "final_hidden": hidden_size * 2,
             "target_top1": 4, "input_ids": 4, "loss_mask": 1}
    total = sum(parts.values())
    # fp8 aux states: 1 byte per value plus one float32 scale per aux row.
    fp8 = total - 3 * hidden_size + 3 * 4
    return {"bf16": total, "parts": parts, "fp8_aux": fp8,
            "gib_per_million_tokens_bf16": round(total * 1e6 / 2**30, 2)}


def _default_rule(num_layers: int) -> str:
    """How the default aux ids of a target of `num_layers` come (taps.default_aux_layer_ids):
    vLLM's rule from 7 layers, the spread that fits below it."""
    if num_layers >= 7:
        return "default (2, L//2, L-3)"
    return ("default (1, L//2, L-1): below L = 7 vLLM's (2, L//2, L-3) collide"
            if num_layers >= 4 else "default (0, 1, 2): below L = 4 the only three there are")


def _tokenizer_report(cfg: DoctorConfig, info: ModelInfo) -> dict:
    try:
        tok = load_tokenizer(cfg.target, revision=cfg.revision,
                             trust_remote_code=cfg.trust_remote_code)
    except EyasError as err:
        return {"loaded": False, "error": str(err)}
    return {"loaded": True, "class": type(tok).__name__, "size": len(tok),
            "chat_template": bool(getattr(tok, "chat_template", None)),
            "fits_model_vocab": len(tok) <= info.vocab_size}


def _plan(info: ModelInfo, ids: tuple[int, ...], cfg: DoctorConfig) -> dict:
    L, layers = info.num_layers, info.layers_path
    taps = [f"input of {layers}[{k}]" if k < L else f"output of {layers}[{L - 1}]" for k in ids]
    vocab = min(DEFAULT_DRAFT_VOCAB, info.vocab_size)
    remote = (" --trust-remote-code" if cfg.trust_remote_code else "") + \
        (f" --revision {shlex.quote(cfg.revision)}" if cfg.revision else "")  # the one checked
    return {
        "capture": (f"run {info.architecture} in transformers on text-only input_ids; aux ids "
                    f"{list(ids)} = " + ", ".join(taps) + f"; final hidden = output of "
                    f"{info.norm_path}; teacher top-1 from {info.lm_head_path or 'none (!)'}"),
        "train": (f"EAGLE-3 draft: fc {3 * info.hidden_size} -> {info.hidden_size}, one "
                  f"Llama-style decoder layer, frozen target embedding {info.embed_path} "
                  f"[{info.vocab_size}, {info.hidden_size}], draft vocab {vocab} of "
                  f"{info.vocab_size}" + (" (all of it)" if vocab == info.vocab_size else "")),
        "export": (f"LlamaForCausalLMEagle3 config with model_type llama (whatever the "
                   f"target's), eagle_aux_hidden_state_layer_ids {list(ids)}, "
                   f"vocab_size {info.vocab_size}, max_position_embeddings "
                   f"{info.max_position_embeddings}, rope_theta {info.rope_theta:g}"
                   f"{', rope_scaling ' + str(info.rope_scaling) if info.rope_scaling else ''}; "
                   f"no embed_tokens.weight (vLLM shares the target's); train's default "
                   f"recipe is EAGLE 3.1 (norm_before_fc + norm_output + "
                   f"norm_before_residual: vLLM 0.22+, not SGLang, which takes --fc-norm "
                   f"--no-norm-before-residual instead; --no-norm-before-fc --no-norm-output "
                   f"--no-norm-before-residual for plain EAGLE-3); EAGLE 3.1 keys are served by "
                   + "; ".join(f"--format {fmt}: " + ", ".join(f"{k} {v}+" for k, v in
                                                               since.items())
                               for fmt, since in SERVED_SINCE.items())),
        "serve": (f"vllm serve {shlex.quote(str(cfg.target))}{remote} --speculative-config "
                  "'{\"method\":\"eagle3\",\"model\":\"DRAFT\",\"num_speculative_tokens\":3}'"),
    }


# ----------------------------------------------------------------------------- vLLM side

def vllm_report(architectures: list[str], text_model_type: str) -> dict:
    """What the installed vLLM would do with this target for eagle3 (or what was not checked)."""
    arch = architectures[0]
    try:
        import vllm
    except Exception as err:  # ImportError, or a broken install failing at import time
        return {
            "importable": False, "error": f"{type(err).__name__}: {err}",
            "not_checked": [
                f"which vLLM class serves {arch}",
                "whether that class satisfies SupportsEagle3 (and which members it lacks)",
                f"whether this vLLM accepts text model_type {text_model_type!r} for eagle3",
                "whether the eyas vLLM plugin would patch the class",
            ],
            "hint": ("run `eyas doctor` in the environment that serves the model; vLLM "
                     f"~0.10-0.11 accepts eagle3 only for text model types containing one of "
                     f"{list(OLD_ALLOW_LIST)} ({text_model_type!r} "
                     f"{'is' if allowed_by(text_model_type, OLD_ALLOW_LIST) else 'is not'})"),
        }
    out: dict = {"importable": True, "version": getattr(vllm, "__version__", "unknown")}
    try:
        with _vllm_logs_held() as held:
            cls, out["model_class"] = _vllm_model_class(arch)
            out["model_type"] = eagle3_model_type_check(text_model_type)
            if cls is not None:
                from vllm.model_executor.models.interfaces import (SupportsEagle3,
                                                                   supports_eagle3)

                out["eagle3"] = eagle3_interface(cls, SupportsEagle3, supports_eagle3)
                out["plugin"] = ({"status": "not needed"} if out["eagle3"]["supports_eagle3"]
                                 else plugin_plan(cls))
    except Exception as err:  # a vLLM that imports but breaks further in (e.g. no PIL)
        return {"importable": True, "version": out["version"],
                "broken": f"{type(err).__name__}: {err}"}
    if cls is None and _logged_error(held.buffer):
        out["model_class"] += f" ({_logged_error(held.buffer)})"
    return out


@contextlib.contextmanager
def _vllm_logs_held():
    """Hold what vLLM logs meanwhile: it logs a model module that fails to import with its
    whole traceback (`logger.exception`), which the report says in one line instead."""
    logger = logging.getLogger("vllm")
    held = logging.handlers.BufferingHandler(capacity=10_000)
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [held], False
    try:
        yield held
    finally:
        logger.handlers, logger.propagate = saved


def _logged_error(records: list[logging.LogRecord]) -> str | None:
    """The last exception vLLM logged, as `Type: message`, or None."""
    errors = [r.exc_info[1] for r in records if r.exc_info and r.exc_info[1] is not None]
    return f"{type(errors[-1]).__name__}: {errors[-1]}" if errors else None


def _vllm_model_class(arch: str):
    """(class or None, description) of vLLM's registered implementation of `arch`."""
    try:
        from vllm import ModelRegistry

        if arch not in ModelRegistry.get_supported_archs():
            return None, (f"{arch} is not registered in vLLM; vLLM would try its Transformers "
                          f"backend (not checked)")
        cls = ModelRegistry._try_load_model_cls(arch)
    except Exception as err:  # a model module that fails to import must not end the report
        return None, f"could not load vLLM's class for {arch}: {type(err).__name__}: {err}"
    if cls is None:
        return None, f"vLLM's registry has {arch} but could not load its class"
    return cls, f"{cls.__module__}.{cls.__qualname__}"


def protocol_members(protocol) -> list[str]:
    """Names a runtime-checkable Protocol requires (Python 3.12 caches them on the class)."""
    attrs = getattr(protocol, "__protocol_attrs__", None)
    if attrs is None:
        attrs = typing._get_protocol_attrs(protocol)  # Python 3.10 / 3.11
    return sorted(attrs)


def eagle3_interface(cls, protocol, checker) -> dict:
    """Does `cls` satisfy vLLM's SupportsEagle3, and which members does it lack?

    `checker` is vLLM's `supports_eagle3`: an isinstance check that works on the class object.
    Never `issubclass(cls, protocol)`: protocols with non-method members (the `supports_eagle3`
    ClassVar) raise TypeError there. Members are looked up with `inspect.getattr_static`, as
    Python >= 3.12's protocol check does, so `__getattr__` tricks do not count.
    """
    required_names = protocol_members(protocol)
    present = {name: _has_static(cls, name) for name in (*EAGLE3_MEMBERS, *required_names)}
    try:
        ok, error = bool(checker(cls)), None
    except TypeError as err:
        ok, error = False, f"{type(err).__name__}: {err}"
    return {"supports_eagle3": ok, "error": error, "protocol_members": required_names,
            "members": present, "missing": [n for n in required_names if not present[n]]}


def _has_static(cls, name: str) -> bool:
    try:
        inspect.getattr_static(cls, name)
    except AttributeError:
        return False
    return True


def allowed_by(model_type: str, allow_list) -> bool:
    # vLLM matches by substring: "qwen" admits "qwen2_5_vl_text".
    return any(entry in model_type for entry in allow_list)


def allow_list_in_source(source: str) -> tuple[str, list[str]] | None:
    """(variable name, entries) of vLLM's eagle3 target allow-list in a module's source.

    Spelled `eagle3_target_supported` up to ~0.15, `aux_hidden_states_supported` later.
    """
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        if "supported" not in name or not ("eagle3" in name or "aux_hidden" in name):
            continue
        if isinstance(node.value, (ast.List, ast.Tuple)) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.value.elts):
            return name, [e.value for e in node.value.elts]
    return None


def eagle3_model_type_check(text_model_type: str) -> dict:
    """Whether the installed vLLM accepts `text_model_type` as an eagle3 target."""
    for module in ALLOW_LIST_MODULES:
        try:
            spec = importlib.util.find_spec(module)  # imports the parent package
        except Exception:  # ImportError, or a broken vLLM failing at its import
            continue
        if spec is None or not (spec.origin or "").endswith(".py"):
            continue
        found = allow_list_in_source(Path(spec.origin).read_text())
        if found:
            name, entries = found
            return {"accepted": allowed_by(text_model_type, entries), "allow_list": entries,
                    "source": f"{module}:{name}", "text_model_type": text_model_type}
    return {"accepted": None, "allow_list": None, "text_model_type": text_model_type,
            "source": "no eagle3 model_type allow-list found in this vLLM's config code "
                      "(not checked)"}


def plugin_plan(cls) -> dict:
    """Ask `eyas.serve.vllm_plugin.plan_patch(cls)` what the plugin would change on `cls`."""
    try:
        plugin = importlib.import_module("eyas.serve.vllm_plugin")
    except ImportError as err:
        return {"status": "unknown", "why": f"eyas.serve.vllm_plugin cannot be imported ({err})"}
    plan_patch = getattr(plugin, "plan_patch", None)
    if plan_patch is None:
        return {"status": "unknown", "why": "eyas.serve.vllm_plugin has no plan_patch()"}
    try:
        plan = plan_patch(cls)
    except Exception as err:  # report a plugin bug instead of losing the whole report
        return {"status": "error", "why": f"plan_patch failed: {type(err).__name__}: {err}"}
    plan = plan.to_dict() if hasattr(plan, "to_dict") else plan
    return {"status": "planned", "plan": json.loads(json.dumps(plan, default=str))}


# ----------------------------------------------------------------------------- verdict + text

def _problems(report: dict, info: ModelInfo) -> list[str]:
    out = []
    tok = report["tokenizer"]
    if not tok["loaded"]:
        out.append(f"tokenizer: {tok['error']}")
    else:
        if not tok["chat_template"]:
            out.append("the tokenizer has no chat template: prepare needs the template the "
                       "model is served with (use the instruct/chat tokenizer)")
        if not tok["fits_model_vocab"]:
            out.append(f"the tokenizer has {tok['size']} tokens but the model only "
                       f"{info.vocab_size} embedding rows: wrong tokenizer for this model")
    if report.get("weights_damage"):
        out.append(f"weights: {report['weights_damage']}; download or copy the model again "
                   f"(every step that loads the target would fail)")
    if info.lm_head_path is None:
        out.append("no output head (lm_head) found: eyas needs the target's logits as teacher")
    if report["draft_attention"].startswith("error: "):
        out.append(f"draft attention: {report['draft_attention'][len('error: '):]}")
    vl = report["vllm"]
    if vl["importable"] and "broken" not in vl:
        if "eagle3" not in vl:
            out.append(f"vLLM: {vl['model_class']}")
        elif not vl["eagle3"]["supports_eagle3"]:
            out.append(f"vLLM: {vl['model_class']} does not implement SupportsEagle3 "
                       f"(missing {vl['eagle3']['missing']}); plugin: {_plugin_line(vl)}")
        if vl["model_type"]["accepted"] is False:
            out.append(f"vLLM {vl['version']} refuses eagle3 for text model_type "
                       f"{info.text_model_type!r} (allow-list {vl['model_type']['allow_list']}"
                       f"): upgrade vLLM or patch {vl['model_type']['source']}")
    return out


def _notes(target: str) -> list[str]:
    """Advice that is not a problem: how a GGUF target's load time goes away."""
    if is_gguf(target):
        return [f"a .gguf target is parsed and de-quantized at every load, in every step; "
                f"`eyas convert --target {shlex.quote(target)} --out FOLDER` does it once, then "
                f"pass --target FOLDER (artifacts made with the GGUF are accepted with its folder)"]
    source = converted_from(Path(target).expanduser())
    if source is not None:
        return [f"converted from {source['name_or_path']} by `eyas convert` (gguf_fingerprint "
                f"{source['gguf_fingerprint']}): artifacts made with that GGUF are accepted"]
    return []


def _plugin_line(vl: dict) -> str:
    plugin = vl.get("plugin") or {}
    if plugin.get("status") == "planned":
        return json.dumps(plugin["plan"], default=str)
    return f"{plugin.get('status', 'unknown')} ({plugin.get('why', '')})".rstrip(" ()")


def _vllm_lines(vl: dict) -> list[tuple[str, str]]:
    if not vl["importable"]:
        return [("vllm", f"not importable ({vl['error']})"),
                ("  not checked", "; ".join(vl["not_checked"])),
                ("  hint", vl["hint"])]
    if "broken" in vl:
        return [("vllm", f"{vl['version']} imports but fails further in ({vl['broken']}): "
                         f"vLLM side not checked; repair that environment or run `eyas doctor` "
                         f"where the model is served")]
    lines = [("vllm", vl["version"]), ("  model class", vl["model_class"])]
    if "eagle3" in vl:
        e3 = vl["eagle3"]
        have = ", ".join(f"{k}{'' if v else ' (MISSING)'}" for k, v in e3["members"].items())
        lines += [("  SupportsEagle3", ("yes" if e3["supports_eagle3"] else "NO")
                   + (f" [{e3['error']}]" if e3["error"] else "")),
                  ("  members", have),
                  ("  eyas plugin", _plugin_line(vl))]
    mt = vl["model_type"]
    verdict = {True: "accepted", False: "REFUSED", None: "unknown"}[mt["accepted"]]
    lines.append(("  eagle3 model_type", f"{mt['text_model_type']}: {verdict} ({mt['source']}"
                  + (f" = {mt['allow_list']})" if mt["allow_list"] else ")")))
    return lines


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def render_text(r: dict) -> str:
    """The report as aligned `label  value` lines, for humans and bug reports."""
    m, cap, tok = r["model"], r["capture_bytes"], r["tokenizer"]
    ids = r["aux_layer_ids"]
    lines = [
        ("target", f"{r['target']} (revision {r['revision'] or 'default'})"),
        ("versions", ", ".join(f"{k} {v}" for k, v in r["versions"].items())),
        ("architecture", f"{m['architecture']} (model_type {m['model_type']}, text "
                         f"model_type {m['text_model_type']})"),
        ("text decoder", f"{m['text_model_path'] or '<root>'}"
                         + (" (below a wrapper)" if m["is_wrapper"] else "")),
        ("decoder layers", f"{m['layers_path']}: {m['num_layers']} x {r['layer_class']}"),
        ("embed / norm", f"{m['embed_path']} / {m['norm_path']}"),
        ("lm_head", f"{m['lm_head_path']}"
                    + (" (tied to the embedding)" if m["tied_embeddings"] else "")),
        ("shapes", f"hidden {m['hidden_size']}, vocab {m['vocab_size']}, heads "
                   f"{m['num_attention_heads']} (kv {m['num_key_value_heads']}, head_dim "
                   f"{m['head_dim']}), intermediate {m['intermediate_size']}"),
        ("attention / mlp", f"{'MLA' if m['is_mla'] else 'MHA/GQA'}, "
                            + (f"MoE ({m['num_experts']} experts)" if m["is_moe"] else "dense")),
        ("positions", f"rope_theta {m['rope_theta']:g}, rope_scaling {m['rope_scaling']}, "
                      f"max {m['max_position_embeddings']}"),
        ("weights", f"{_count(r['parameters'])} parameters, dtype {m['dtype']}, "
                    f"quantization {(m['quantization'] or {}).get('quant_method', 'none')}"),
        ("identity", ", ".join(f"{k} {v}" for k, v in r["identity"].items())
         or (f"none ({r['weights_damage']})" if r.get("weights_damage") else
             "none (no weights here: a config-only folder, or a hub name not cached yet)")),
        ("aux layer ids", f"{tuple(ids['ids'])} {ids['source']}"),
        ("  convention", ids["convention"]),
        ("bytes / token", f"{cap['bf16']} at bf16 (3 aux x {m['hidden_size']} x 2 + final x 2 "
                          f"+ top1 4 + ids 4 + mask 1) = {cap['gib_per_million_tokens_bf16']} "
                          f"GiB per 1M tokens; {cap['fp8_aux']} with fp8 aux"),
        ("chat template", ("yes" if tok.get("chat_template") else "NO") if tok["loaded"]
         else f"tokenizer not loaded: {tok['error']}"),
        *[(f"eyas {k}", v) for k, v in r["plan"].items()],
        ("draft attention", r["draft_attention"] + " [one-document rows; packed rows: "
                            "FlexAttention]"),
        *_vllm_lines(r["vllm"]),
        ("verdict", (f"{len(r['problems'])} problem(s)" if not r["ok"] else "ok" if
                     r["vllm_checked"] else "ok for capture/train/export; vLLM side "
                     "not checked")),
        *[("  problem", p) for p in r["problems"]],
        *[("note", n) for n in r["notes"]],
    ]
    width = max(len(k) for k, _ in lines) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in lines)
