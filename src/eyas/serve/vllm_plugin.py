"""vLLM plugin: give model classes that lack `SupportsEagle3` the interface, when their text
decoder can already produce EAGLE-3 aux hidden states.

vLLM serves an EAGLE-3 draft only if the target's model class satisfies
`vllm.model_executor.models.interfaces.SupportsEagle3`, a `@runtime_checkable` Protocol that
`supports_eagle3(model)` checks with `isinstance` (on Python >= 3.12 through
`inspect.getattr_static`, so members must be real class attributes). Many multimodal wrappers
(KimiVL, Kimi-K2.5 in vLLM 0.15-0.2x, Llava-style models, ...) and a few text models (GLM-4 in
0.33) lack it even though the decoder they run (`DeepseekV2Model`, `LlamaModel`, ...) collects aux
states: it appends `hidden_states + residual` entering each layer whose id is in its
`aux_hidden_state_layers` (id L after the last layer) and then returns `(hidden, aux_list)`.

`plan_patch(cls)` decides, for one class, what is missing and where the decoder is; `patch(cls)`
sets the missing members on the class: `supports_eagle3 = True`, `has_own_lm_head = False`,
`has_own_embed_tokens = False`, `set_aux_hidden_state_layers` (delegating to the language model
or the decoder that runs the layer loop) and both getter names
(`get_eagle3_aux_hidden_state_layers` up to ~0.17, `get_eagle3_default_aux_hidden_state_layers`
later), and wraps `forward` so that with aux layers set it returns `(hidden_states, aux_list)`.
A wrapper's `__init__` is wrapped too: its config gets `image_token_index` from
`image_token_id` / `media_placeholder_token_id` when it has none, because vLLM's drafter
set-up reads that name for multimodal targets it does not list; and a language model that is
the bare decoder (no `.model`, as Idefics3 / SmolVLM's `text_model`) gets a `.model` view of
itself, because that set-up shares the target's embedding from `language_model.model`. Draft classes (vLLM's
speculative-decoding architectures) are never patched.

`register()` is the `vllm.general_plugins` entry point (pyproject). vLLM calls it in every
process before it loads a model class; it patches the registered classes already imported and
hooks the import of the others (a meta-path finder on the registry's model modules), so no model
module is imported early. `EYAS_VLLM_PLUGIN=0` turns it off. It never raises: problems are logged.

Not done here: vLLM's eagle3 target `model_type` allow-list (`eagle3_target_supported` /
`aux_hidden_states_supported`, a local list inside a pydantic validator of `SpeculativeConfig`
in some releases) cannot be lifted without editing vLLM; `eyas doctor` reports it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import re
import sys
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

ENV_SWITCH = "EYAS_VLLM_PLUGIN"
MARKER = "_eyas_eagle3_patch"  # set on a class this plugin patched
# Every member SupportsEagle3 has had (the getter was renamed around vLLM 0.18; the has_own_*
# flags arrived around 0.12). A patched class gets all of them, so any version's check passes.
MEMBERS = ("supports_eagle3", "has_own_lm_head", "has_own_embed_tokens",
           "set_aux_hidden_state_layers", "get_eagle3_aux_hidden_state_layers",
           "get_eagle3_default_aux_hidden_state_layers")


@dataclass(frozen=True)
class PatchPlan:
    """What the plugin would do to one model class (doctor prints it)."""

    cls: str  # module.qualname
    missing: tuple[str, ...]  # protocol members the class lacks (static lookup)
    kind: str  # "wrapper" (text decoder below a language model), "text", or "other"
    decoder: str | None  # where the decoder loop runs, as far as the class shows
    collects_aux: bool | None  # the decoder records aux states; None = known once built
    patchable: bool
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- planning

def _static(cls, name: str):
    try:
        return inspect.getattr_static(cls, name)
    except AttributeError:
        return None


def missing_members(cls) -> tuple[str, ...]:
    """Members absent from `cls` as Python >= 3.12's Protocol check sees them (no __getattr__)."""
    return tuple(name for name in MEMBERS if _static(cls, name) is None)


def _decoder_class_of(cls):
    """The class assigned to `self.model` in the first `__init__` along the MRO, or None."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass.__module__.startswith("torch."):
            continue
        try:
            source = inspect.getsource(init)
        except (OSError, TypeError):
            return None
        found = re.search(r"self\.model\s*(?::[^=]+)?=\s*([A-Za-z_]\w*)\s*\(", source)
        if found:
            return getattr(sys.modules.get(klass.__module__), found.group(1), None)
    return None


def decoder_collects_aux(decoder_cls) -> bool:
    """Does this decoder class record aux hidden states in its own layer loop?"""
    if _static(decoder_cls, "aux_hidden_state_layers") is not None:  # vLLM's EagleModelMixin
        return True
    try:
        return "aux_hidden_state" in inspect.getsource(decoder_cls.forward)
    except (OSError, TypeError, AttributeError):
        return False


def plan_patch(cls) -> PatchPlan:
    """Decide what to give `cls` (a vLLM model class, or an instance: then the decoder is
    located concretely). Only generative classes that lack members and whose decoder can
    produce aux states are patchable."""
    if not isinstance(cls, type):
        return _plan_instance(cls)
    name = f"{cls.__module__}.{cls.__qualname__}"
    missing = missing_members(cls)

    def plan(kind, decoder, collects, ok, reason):
        return PatchPlan(name, missing, kind, decoder, collects, ok, reason)

    if not missing:
        return plan("other", None, None, False, "already implements SupportsEagle3")
    if _static(cls, "compute_logits") is None or _static(cls, "is_pooling_model") is True:
        return plan("other", None, None, False, "not a generative model (no compute_logits)")
    if _static(cls, "get_language_model") is not None:
        return plan("wrapper", "get_language_model() (or its .model)", None, True,
                    "multimodal wrapper: members delegate to its language model; the decoder's "
                    "aux support is checked when vLLM sets the aux layers")
    decoder = _decoder_class_of(cls)
    if decoder is None:
        return plan("text", None, None, False, "could not find the decoder class behind "
                    "self.model; not patched")
    where = f"model ({decoder.__qualname__})"
    if decoder_collects_aux(decoder):
        return plan("text", where, True, True, "its decoder collects aux hidden states; only "
                    "the interface members were missing")
    return plan("text", where, False, False, f"{decoder.__qualname__} does not collect aux "
                "hidden states in its layer loop: this needs a change in vLLM, not a plugin")


def _plan_instance(model) -> PatchPlan:
    cls = type(model)
    base = plan_patch(cls)
    try:
        path, decoder = find_decoder(model)
    except RuntimeError as err:
        return PatchPlan(base.cls, base.missing, base.kind, None, False, False, str(err))
    collects = hasattr(decoder, "aux_hidden_state_layers") or decoder_collects_aux(type(decoder))
    ok = bool(base.missing) and collects and base.kind != "other"
    return PatchPlan(base.cls, base.missing, base.kind, f"{path} ({type(decoder).__qualname__})",
                     collects, ok, base.reason if collects else
                     f"{type(decoder).__qualname__} does not collect aux hidden states")


# ----------------------------------------------------------------------------- runtime pieces

def language_model(model):
    """The module vLLM treats as the language model (the model itself for text models)."""
    if _static(type(model), "get_language_model") is not None:
        return model.get_language_model()
    lm = getattr(model, "language_model", None)  # not `or`: an nn.Module may define __len__
    return model if lm is None else lm


def find_decoder(model) -> tuple[str, object]:
    """(path, module) of the object that runs the decoder-layer loop: the language model
    itself when it holds `layers` (decoder directly under `language_model`), else its `.model`
    (a CausalLM under `language_model`, or a text model's own `self.model`)."""
    lm = language_model(model)
    prefix = "" if lm is model else "language_model."
    for path, obj in ((prefix.rstrip(".") or "<model>", lm), (prefix + "model", getattr(lm, "model", None))):
        if obj is not None and obj is not model and hasattr(obj, "layers"):
            return path, obj
    raise RuntimeError(f"eyas vLLM plugin: cannot find the decoder (a module with `layers`) of "
                       f"{type(model).__name__} under language_model or model")


def _set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
    """Record the aux layers on whatever runs the decoder loop (vLLM aux-id convention)."""
    layers = tuple(int(i) for i in layers)
    lm = language_model(self)
    if lm is not self and callable(_static(type(lm), "set_aux_hidden_state_layers")):
        lm.set_aux_hidden_state_layers(layers)  # e.g. DeepseekV2ForCausalLM, LlamaForCausalLM
    else:
        path, decoder = find_decoder(self)
        if callable(getattr(decoder, "_set_aux_hidden_state_layers", None)):
            decoder._set_aux_hidden_state_layers(layers)  # vLLM >= 0.2x EagleModelMixin
        elif hasattr(decoder, "aux_hidden_state_layers"):
            decoder.aux_hidden_state_layers = layers
        else:
            raise RuntimeError(
                f"eyas vLLM plugin: {type(self).__name__}'s decoder {path} "
                f"({type(decoder).__name__}) does not collect aux hidden states in this vLLM, so "
                f"it cannot serve an EAGLE-3 draft; set EYAS_VLLM_PLUGIN=0 and ask vLLM for "
                f"SupportsEagle3 on {type(decoder).__name__}")
    self._eyas_aux_layers = layers


def _default_aux_layers(self) -> tuple[int, ...]:
    """vLLM's default (2, L//2, L-3), from the language model's own getter when it has one."""
    lm = language_model(self)
    if lm is not self:
        for name in ("get_eagle3_default_aux_hidden_state_layers", "get_eagle3_aux_hidden_state_layers"):
            if callable(_static(type(lm), name)):
                return tuple(getattr(lm, name)())
    num_layers = len(find_decoder(self)[1].layers)
    return (2, num_layers // 2, num_layers - 3)


def _wrap_forward(forward):
    """forward that returns (hidden_states, aux_list) once aux layers are set. The decoders
    this plugin accepts already return that pair and the wrappers pass it through; a wrapper
    that drops it would hand vLLM a bare tensor, so that is turned into a clear error."""

    @functools.wraps(forward)  # keeps the signature vLLM inspects (intermediate_tensors)
    def eagle3_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if getattr(self, "_eyas_aux_layers", None) and _is_tensor(out):
            raise RuntimeError(f"eyas vLLM plugin: {type(self).__name__}.forward returned only "
                               f"hidden states although aux layers {self._eyas_aux_layers} are "
                               f"set; its forward post-processes the decoder output, which the "
                               f"plugin cannot patch (set EYAS_VLLM_PLUGIN=0)")
        return out

    return eagle3_forward


# vLLM's drafter set-up (0.24: v1/spec_decode/llm_base_proposer.py, load_model) reads the
# target config's `image_token_index` for every multimodal target it does not list by name;
# wrappers whose config spells it otherwise would fail there with an AttributeError
_IMAGE_TOKEN_SPELLINGS = ("image_token_id", "media_placeholder_token_id")


class InnerModelView:
    """What vLLM's drafter set-up reads as `language_model.model` (0.32:
    `_maybe_share_embeddings` takes `get_language_model().model.embed_tokens`), for a wrapper
    whose language model is the bare decoder itself (Idefics3 / SmolVLM: `model.text_model`,
    a `LlamaModel` holding `embed_tokens`, with no `.model`; vLLM then fails with "Target model
    does not have 'model' attribute"). Every attribute is the decoder's own, read when asked;
    not an nn.Module, so the decoder gains no submodule, parameter or state-dict entry."""

    def __init__(self, decoder):
        self._decoder = decoder

    def __getattr__(self, name):
        return getattr(self._decoder, name)


def _wrap_init(init):
    """__init__ that gives the model's config `image_token_index` from another spelling of
    the image token when it has none (a wrapper is a multimodal model: see above), and a bare
    decoder under the wrapper the `.model` vLLM's drafter looks for (InnerModelView)."""

    @functools.wraps(init)
    def eagle3_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        config = getattr(self, "config", None)
        if config is not None and getattr(config, "image_token_index", None) is None:
            for name in _IMAGE_TOKEN_SPELLINGS:
                if getattr(config, name, None) is not None:
                    config.image_token_index = getattr(config, name)
                    break
        try:
            lm = language_model(self)
        except Exception:  # noqa: BLE001  (a wrapper whose language model is not built yet)
            return
        if lm is not self and getattr(lm, "model", None) is None \
                and hasattr(lm, "embed_tokens") and hasattr(lm, "layers"):
            lm.model = InnerModelView(lm)  # a plain attribute: nn.Module stores it as is

    return eagle3_init


def _is_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


# ----------------------------------------------------------------------------- patching

def patch(cls) -> PatchPlan:
    """Apply `plan_patch(cls)`: set each missing member on the class itself. Idempotent."""
    plan = plan_patch(cls)
    if not plan.patchable or cls.__dict__.get(MARKER):
        return plan
    members = {
        "supports_eagle3": True, "has_own_lm_head": False, "has_own_embed_tokens": False,
        "set_aux_hidden_state_layers": _set_aux_hidden_state_layers,
        "get_eagle3_aux_hidden_state_layers": _default_aux_layers,
        "get_eagle3_default_aux_hidden_state_layers": _default_aux_layers,
    }
    for name in plan.missing:
        setattr(cls, name, members[name])
    cls.forward = _wrap_forward(cls.forward)
    if plan.kind == "wrapper":
        cls.__init__ = _wrap_init(cls.__init__)
    setattr(cls, MARKER, plan)
    log.info("eyas: gave %s the SupportsEagle3 members %s (decoder: %s)", plan.cls,
             list(plan.missing), plan.decoder)
    return plan


def _patch_quietly(cls) -> None:
    try:
        plan = patch(cls)
        if plan.missing and not plan.patchable:
            log.debug("eyas: left %s alone: %s", plan.cls, plan.reason)
    except Exception:  # a plugin must never take vLLM down
        log.warning("eyas: could not patch %r", cls, exc_info=True)


def _patch_module(module, class_names) -> None:
    for name in class_names:
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            _patch_quietly(cls)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches registered classes right after vLLM imports their module (lazily)."""

    def __init__(self, classes_by_module: dict[str, set[str]]):
        self.classes_by_module = classes_by_module

    def find_spec(self, fullname, path=None, target=None):
        names = self.classes_by_module.get(fullname)
        if not names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _PatchingLoader(spec.loader, names)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, class_names):
        self.inner, self.class_names = inner, class_names

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch_module(module, self.class_names)

    def __getattr__(self, name):  # get_source, get_filename, ... as the real loader
        return getattr(self.inner, name)


def _registered_classes() -> tuple[list[type], dict[str, set[str]]]:
    """(classes already loaded, {module: class names} still lazy) of vLLM's ModelRegistry,
    targets only: a draft class (EAGLE, MTP, DFlash, ...) is never patched, since vLLM reads
    its has_own_lm_head / has_own_embed_tokens to decide whether to replace the draft's own
    head and embedding with the target's."""
    from vllm import ModelRegistry

    drafts = _draft_architectures()
    loaded, lazy = [], {}
    for arch, entry in getattr(ModelRegistry, "models", {}).items():
        if arch in drafts:
            continue
        cls = getattr(entry, "model_cls", None)
        module, name = getattr(entry, "module_name", None), getattr(entry, "class_name", None)
        if isinstance(cls, type):
            loaded.append(cls)
        elif module and name:
            lazy.setdefault(module, set()).add(name)
    return loaded, lazy


def _draft_architectures() -> set[str]:
    """The architectures vLLM registers as speculative-decoding drafts (its registry's
    `_SPECULATIVE_DECODING_MODELS`; empty where a release has no such table)."""
    try:
        from vllm.model_executor.models import registry
    except ImportError:
        return set()
    return set(getattr(registry, "_SPECULATIVE_DECODING_MODELS", {}))


_finder: _PatchOnImport | None = None


def register() -> None:
    """vLLM general-plugin entry point: patch what is loaded, hook the rest. Never raises."""
    global _finder
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("eyas vLLM plugin disabled by %s=0", ENV_SWITCH)
        return
    try:
        loaded, lazy = _registered_classes()
        for cls in loaded:
            _patch_quietly(cls)
        for module_name in [m for m in lazy if m in sys.modules]:
            _patch_module(sys.modules[module_name], lazy.pop(module_name))
        if _finder is None:
            _finder = _PatchOnImport(lazy)
            sys.meta_path.insert(0, _finder)
        else:
            _finder.classes_by_module.update(lazy)
        log.debug("eyas vLLM plugin: %d classes checked now, %d modules hooked", len(loaded),
                  len(lazy))
    except Exception:
        log.warning("eyas vLLM plugin could not start; EAGLE-3 wrappers stay unpatched",
                    exc_info=True)
