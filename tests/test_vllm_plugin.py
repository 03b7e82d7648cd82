"""The vLLM plugin on stand-ins shaped like vLLM's model classes, checked with a stand-in of
vLLM's `SupportsEagle3` Protocol (and, under `-m vllm`, with vLLM's own `supports_eagle3` and
registry). docs/export.md says how to run the vLLM tests."""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import ClassVar, Literal, Protocol, runtime_checkable

import pytest
import torch
from torch import nn

from eyas.serve import vllm_plugin
from eyas.serve.vllm_plugin import MEMBERS, PatchPlan, patch, plan_patch

SRC = Path(__file__).resolve().parents[1] / "src"
H, V, L = 16, 50, 8


# ----------------------------------------------------------------------------- protocol stand-ins
# Written from vllm/model_executor/models/interfaces.py: 0.33 (SupportsEagleBase flags + the
# renamed getter) and ~0.11 (only the flag, the setter and the old getter).

@runtime_checkable
class SupportsEagle3(Protocol):
    supports_eagle3: ClassVar[Literal[True]] = True
    has_own_lm_head: bool = False
    has_own_embed_tokens: bool = False

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None: ...

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]: ...


@runtime_checkable
class SupportsEagle3Old(Protocol):
    supports_eagle3: ClassVar[Literal[True]] = True

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None: ...

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]: ...


def protocol_attrs(proto) -> set[str]:
    return set(getattr(proto, "__protocol_attrs__", None) or typing._get_protocol_attrs(proto))


def supports_statically(cls, proto) -> bool:
    """Python >= 3.12's runtime-protocol check: every member found by getattr_static, methods
    not None. (3.10/3.11's isinstance uses hasattr, which __getattr__ tricks fool.)"""
    for name in protocol_attrs(proto):
        try:
            value = inspect.getattr_static(cls, name)
        except AttributeError:
            return False
        if value is None and callable(getattr(proto, name, None)):
            return False
    return True


def supports(cls) -> bool:
    """As vLLM's supports_eagle3: isinstance on the class object, for both protocol versions."""
    return all(isinstance(cls, p) and supports_statically(cls, p)
               for p in (SupportsEagle3, SupportsEagle3Old))


# ----------------------------------------------------------------------------- model stand-ins

class Layer(nn.Module):
    """vLLM decoder-layer calling convention: (positions, hidden, residual) -> (hidden, residual)
    with the residual stream = hidden + residual (hidden alone before the first layer)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)

    def forward(self, positions, hidden_states, residual):
        stream = hidden_states if residual is None else hidden_states + residual
        return torch.tanh(self.proj(stream)), stream


class DecoderBase(nn.Module):
    """What vLLM's text decoders hold: an embedding and the decoder-layer ModuleList."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Layer() for _ in range(L))


def aux_loop(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
    """vLLM's aux collection: the stream entering each chosen layer (id L: after the last)."""
    hidden, residual, aux = self.embed_tokens(input_ids), None, []
    for idx, layer in enumerate(self.layers):
        if idx in self.aux_hidden_state_layers:
            aux.append(hidden if residual is None else hidden + residual)
        hidden, residual = layer(positions, hidden, residual)
    if len(self.layers) in self.aux_hidden_state_layers:
        aux.append(hidden + residual)
    hidden = hidden + residual
    return (hidden, aux) if aux else hidden


class AuxDecoder(DecoderBase):
    """Like vLLM 0.33's LlamaModel (EagleModelMixin): a class attribute says it collects."""

    aux_hidden_state_layers: tuple[int, ...] = ()
    forward = aux_loop


class AuxDecoderAttr(DecoderBase):
    """Like vLLM's DeepseekV2Model: the attribute is set in __init__ only."""

    def __init__(self):
        super().__init__()
        self.aux_hidden_state_layers = ()

    forward = aux_loop


class PlainDecoder(DecoderBase):
    """Like vLLM 0.33's MixtralModel: runs the layers, records nothing."""

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return hidden + residual


class Eagle3CausalLM(nn.Module):
    """Like DeepseekV2ForCausalLM: implements the protocol itself, decoder at `.model`."""

    supports_eagle3 = True
    has_own_lm_head = has_own_embed_tokens = False

    def __init__(self):
        super().__init__()
        self.model = AuxDecoderAttr()
        self.lm_head = nn.Linear(H, V)

    def set_aux_hidden_state_layers(self, layers):
        self.model.aux_hidden_state_layers = layers

    def get_eagle3_aux_hidden_state_layers(self):
        return (2, len(self.model.layers) // 2, len(self.model.layers) - 3)

    get_eagle3_default_aux_hidden_state_layers = get_eagle3_aux_hidden_state_layers

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states):
        return self.lm_head(hidden_states)


class WrapperDecoderDirect(nn.Module):
    """Multimodal wrapper whose language model IS the decoder (`language_model.layers`)."""

    def __init__(self):
        super().__init__()
        self.vision_tower = nn.Linear(4, H)
        self.language_model = AuxDecoder()
        self.lm_head = nn.Linear(H, V)

    def get_language_model(self):
        return self.language_model

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        hidden_states = self.language_model(input_ids, positions, intermediate_tensors,
                                            inputs_embeds)
        return hidden_states

    def compute_logits(self, hidden_states):
        return self.lm_head(hidden_states)


class WrapperCausalLM(WrapperDecoderDirect):
    """Kimi-K2.5 / KimiVL shape: `language_model` is a CausalLM, the decoder `language_model.model`."""

    def __init__(self):
        nn.Module.__init__(self)
        self.vision_tower = nn.Linear(4, H)
        self.language_model = Eagle3CausalLM()

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        return self.language_model.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states):
        return self.language_model.compute_logits(hidden_states)


class WrapperPlainLM(WrapperDecoderDirect):
    """A wrapper whose decoder cannot collect aux states (Gemma-3 style in vLLM 0.33)."""

    def __init__(self):
        nn.Module.__init__(self)
        self.language_model = PlainDecoder()
        self.lm_head = nn.Linear(H, V)


class WrapperDropsAux(WrapperDecoderDirect):
    """A wrapper that post-processes the decoder output and so loses the aux list."""

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        out = self.language_model(input_ids, positions)
        return out[0] if isinstance(out, tuple) else out


class TextAuxLM(nn.Module):
    """GLM-4 in vLLM 0.33: text model lacking the protocol, decoder collects aux states."""

    def __init__(self):
        super().__init__()
        self.model = AuxDecoder()
        self.lm_head = nn.Linear(H, V)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states):
        return self.lm_head(hidden_states)


class TextPlainLM(TextAuxLM):
    """Mixtral in vLLM 0.33: its decoder records nothing, so the plugin must leave it alone."""

    def __init__(self):
        nn.Module.__init__(self)
        self.model = PlainDecoder()
        self.lm_head = nn.Linear(H, V)


class PoolingWrapper(WrapperDecoderDirect):
    is_pooling_model = True


def fresh(cls):
    """A subclass copy of a stand-in, so each test patches its own class."""
    return type(cls.__name__, (cls,), {"__module__": __name__})


def expected_streams(decoder, ids, layer_ids):
    """The residual streams entering layers `layer_ids` (id L: after the last), computed
    layer by layer here, independently of the decoder's own loop."""
    stream, residual, out = decoder.embed_tokens(ids), None, {}
    hidden = stream
    for idx, layer in enumerate(decoder.layers):
        out[idx] = hidden if residual is None else hidden + residual
        hidden, residual = layer(None, hidden, residual)
    out[len(decoder.layers)] = hidden + residual
    return [out[i] for i in layer_ids]


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("wrapper,decoder_path", [(WrapperDecoderDirect, "language_model"),
                                                  (WrapperCausalLM, "language_model.model")])
def test_wrappers_get_every_member_and_return_aux_states(wrapper, decoder_path):
    cls = fresh(wrapper)
    assert not supports(cls)
    plan = patch(cls)
    assert plan.patchable and plan.kind == "wrapper" and set(plan.missing) == set(MEMBERS)
    assert supports(cls)
    for name in MEMBERS:  # real class attributes, found without __getattr__
        inspect.getattr_static(cls, name)
    torch.manual_seed(0)
    model = cls()
    assert vllm_plugin.find_decoder(model)[0] == decoder_path
    assert model.get_eagle3_aux_hidden_state_layers() == (2, 4, 5)
    assert model.get_eagle3_default_aux_hidden_state_layers() == (2, 4, 5)
    ids = torch.randint(0, V, (6,))
    plain = model(ids, torch.arange(6))
    assert isinstance(plain, torch.Tensor)  # nothing changes until aux layers are set
    model.set_aux_hidden_state_layers((0, 3, 8))
    hidden, aux = model(ids, torch.arange(6))
    assert torch.equal(hidden, plain)
    decoder = vllm_plugin.find_decoder(model)[1]
    assert decoder.aux_hidden_state_layers == (0, 3, 8)
    want = expected_streams(decoder, ids, (0, 3, 8))
    assert len(aux) == 3 and all(torch.equal(a, w) for a, w in zip(aux, want))
    assert inspect.signature(cls.forward).parameters.keys() >= {"intermediate_tensors"}


def test_text_model_whose_decoder_collects_is_patched_and_plain_one_is_not():
    cls = fresh(TextAuxLM)
    plan = patch(cls)
    assert plan.patchable and plan.kind == "text" and plan.collects_aux is True
    assert "AuxDecoder" in plan.decoder and supports(cls)
    model = cls()
    model.set_aux_hidden_state_layers((1, 2, 3))
    _, aux = model(torch.randint(0, V, (4,)), torch.arange(4))
    assert len(aux) == 3
    plain = fresh(TextPlainLM)
    plan = patch(plain)
    assert not plan.patchable and plan.collects_aux is False
    assert "does not collect aux hidden states" in plan.reason
    assert not supports(plain) and "supports_eagle3" not in plain.__dict__


def test_classes_that_need_nothing_are_untouched():
    for cls, why in ((Eagle3CausalLM, "already implements"), (PoolingWrapper, "not a generative")):
        before = dict(cls.__dict__)
        plan = patch(cls)
        assert not plan.patchable and why in plan.reason
        assert dict(cls.__dict__) == before


def test_partly_implementing_class_gets_only_what_it_lacks():
    def own_setter(self, layers):
        self.language_model.aux_hidden_state_layers = tuple(layers)

    cls = type("Partial", (WrapperDecoderDirect,), {"set_aux_hidden_state_layers": own_setter,
                                                    "supports_eagle3": True})
    plan = patch(cls)
    assert "set_aux_hidden_state_layers" not in plan.missing and "supports_eagle3" not in plan.missing
    assert cls.set_aux_hidden_state_layers is own_setter and supports(cls)


def test_wrapper_with_a_plain_decoder_fails_clearly_when_aux_layers_are_set():
    cls = fresh(WrapperPlainLM)
    assert patch(cls).patchable  # decided at load time: the decoder comes from the config
    model = cls()
    instance_plan = plan_patch(model)
    assert not instance_plan.patchable and instance_plan.collects_aux is False
    with pytest.raises(RuntimeError, match="does not collect aux hidden states"):
        model.set_aux_hidden_state_layers((1, 2, 3))


def test_forward_that_drops_aux_states_is_a_clear_error():
    cls = fresh(WrapperDropsAux)
    patch(cls)
    model = cls()
    model(torch.randint(0, V, (3,)), torch.arange(3))
    model.set_aux_hidden_state_layers((1, 2, 3))
    with pytest.raises(RuntimeError, match="returned only hidden states"):
        model(torch.randint(0, V, (3,)), torch.arange(3))


def test_getattr_tricks_do_not_satisfy_the_static_check():
    class Meta(type(nn.Module)):
        def __getattr__(cls, name):
            if name in MEMBERS:
                return lambda *a: None
            raise AttributeError(name)

    tricky = Meta("Tricky", (nn.Module,), {})
    assert hasattr(tricky, "set_aux_hidden_state_layers")  # what Python <= 3.11 checks
    assert not supports_statically(tricky, SupportsEagle3)  # what >= 3.12 checks
    assert set(vllm_plugin.missing_members(tricky)) == set(MEMBERS)


def test_plan_serialises_for_doctor():
    plan = plan_patch(fresh(WrapperCausalLM))
    assert isinstance(plan, PatchPlan)
    d = plan.to_dict()
    assert d["patchable"] is True and d["kind"] == "wrapper" and isinstance(d["missing"], tuple)


def test_patching_on_import_is_lazy_and_idempotent(tmp_path, monkeypatch):
    module = "eyas_standin_models_mod"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_vllm_plugin import WrapperCausalLM, TextPlainLM
        class KimiLike(WrapperCausalLM):
            pass
        class MixtralLike(TextPlainLM):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = vllm_plugin._PatchOnImport({module: {"KimiLike", "MixtralLike"}})
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    assert module not in sys.modules
    mod = __import__(module)
    try:
        assert supports(mod.KimiLike) and not supports(mod.MixtralLike)
        assert isinstance(mod.__loader__, vllm_plugin._PatchingLoader)
        assert "class KimiLike" in mod.__loader__.get_source(module)  # the real loader answers
        forward = mod.KimiLike.forward
        patch(mod.KimiLike)
        assert mod.KimiLike.forward is forward  # a second patch changes nothing
    finally:
        sys.modules.pop(module, None)


def test_register_is_switchable_and_never_raises(monkeypatch, caplog):
    monkeypatch.setenv("EYAS_VLLM_PLUGIN", "0")
    with caplog.at_level(logging.INFO, logger="eyas.serve.vllm_plugin"):
        vllm_plugin.register()
    assert "disabled by EYAS_VLLM_PLUGIN=0" in caplog.text
    monkeypatch.delenv("EYAS_VLLM_PLUGIN")
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM absent or broken: log, do not raise
    with caplog.at_level(logging.WARNING, logger="eyas.serve.vllm_plugin"):
        vllm_plugin.register()
    assert "could not start" in caplog.text


PY312_SCRIPT = """
import inspect, sys
from typing import ClassVar, Literal, Protocol, runtime_checkable
from eyas.serve.vllm_plugin import patch

@runtime_checkable
class SupportsEagle3(Protocol):
    supports_eagle3: ClassVar[Literal[True]] = True
    has_own_lm_head: bool = False
    has_own_embed_tokens: bool = False
    def set_aux_hidden_state_layers(self, layers): ...
    def get_eagle3_default_aux_hidden_state_layers(self): ...

class Decoder:
    aux_hidden_state_layers = ()
    layers = [None] * 8

class Wrapper:  # torch-free stand-in: only what the protocol check and the plan look at
    def __init__(self):
        self.language_model = Decoder()
    def get_language_model(self):
        return self.language_model
    def forward(self, input_ids, positions, intermediate_tensors=None):
        return None
    def compute_logits(self, hidden_states):
        return hidden_states

class Tricky(type):
    def __getattr__(cls, name):
        if name.startswith(("set_aux", "get_eagle3", "supports", "has_own")):
            return lambda *a: None
        raise AttributeError(name)

assert sys.version_info >= (3, 12)
assert not isinstance(Wrapper, SupportsEagle3)
assert not isinstance(Tricky("T", (), {}), SupportsEagle3)  # getattr_static ignores __getattr__
assert patch(Wrapper).patchable
assert isinstance(Wrapper, SupportsEagle3) and isinstance(Wrapper(), SupportsEagle3)
w = Wrapper(); w.set_aux_hidden_state_layers((2, 4, 5))
assert w.language_model.aux_hidden_state_layers == (2, 4, 5)
print("ok", sys.version_info[:2])
"""


def find_python(name: str) -> str | None:
    """An interpreter that runs: on PATH, or a pyenv install that is not the active one."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for exe in [shutil.which(name), *sorted(map(str, root.glob(f"versions/*/bin/{name}")))]:
        if exe and subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0:
            return exe
    return None


@pytest.mark.parametrize("python", ["python3.12", "python3.13"])
def test_protocol_check_of_python_3_12_and_later(python):
    exe = find_python(python)
    if exe is None:
        pytest.skip(f"{python} is not installed")
    run = subprocess.run([exe, "-c", PY312_SCRIPT], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ok")


# ----------------------------------------------------------------------------- with vLLM

@pytest.mark.vllm
def test_vllm_supports_eagle3_accepts_patched_stand_ins():
    pytest.importorskip("vllm")
    from vllm.model_executor.models.interfaces import supports_eagle3

    for wrapper in (WrapperDecoderDirect, WrapperCausalLM, TextAuxLM):
        cls = fresh(wrapper)
        assert not supports_eagle3(cls)
        patch(cls)
        assert supports_eagle3(cls) and supports_eagle3(cls())


@pytest.mark.vllm
def test_vllm_registry_classes_are_patched_only_where_needed():
    pytest.importorskip("vllm")
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    def load(arch):
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is None:
            pytest.skip(f"vLLM cannot import {arch} here")
        return cls

    kimi_vl, glm4, mixtral, llama = (load(a) for a in (
        "KimiVLForConditionalGeneration", "Glm4ForCausalLM", "MixtralForCausalLM",
        "LlamaForCausalLM"))
    llama_dict = dict(llama.__dict__)
    for cls in (kimi_vl, glm4, mixtral, llama):
        patch(cls)
    if not supports_eagle3(kimi_vl):
        pytest.fail(f"KimiVL still lacks the interface: {plan_patch(kimi_vl)}")
    assert supports_eagle3(glm4) and supports_eagle3(llama) and not supports_eagle3(mixtral)
    assert dict(llama.__dict__) == llama_dict
    assert "does not collect aux" in plan_patch(mixtral).reason


LAZY_SCRIPT = """
import sys
import vllm  # noqa: F401
from vllm.plugins import load_general_plugins
load_general_plugins()  # runs eyas.serve.vllm_plugin:register through the entry point
name = "vllm.model_executor.models.kimi_vl"
assert name not in sys.modules, "the plugin must not import model modules early"
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.model_executor.models.kimi_vl import KimiVLForConditionalGeneration as K
assert supports_eagle3(K), "not patched on import"
print("ok")
"""


@pytest.mark.vllm
def test_vllm_loads_the_plugin_and_patches_lazily():
    pytest.importorskip("vllm")
    from importlib.metadata import entry_points

    if not any(e.value == "eyas.serve.vllm_plugin:register"
               for e in entry_points(group="vllm.general_plugins")):
        pytest.skip("eyas is not installed in this environment (pip install -e .)")
    run = subprocess.run([sys.executable, "-c", LAZY_SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


@pytest.mark.vllm
@pytest.mark.parametrize("layout", ["language_model", "language_model.model"])
def test_vllm_decoder_behind_patched_wrapper_captures_hf_hidden_states(llama_dir, layout):
    """vLLM's real LlamaModel below a stand-in wrapper: once patched, set_aux_hidden_state_layers
    reaches it (directly, or through LlamaForCausalLM) and forward returns the streams that
    transformers calls output_hidden_states[k] (k < L) and the last layer's pre-norm output."""
    pytest.importorskip("vllm")
    from safetensors.torch import load_file
    from test_export import vllm_cpu_model
    from transformers import AutoModelForCausalLM
    from vllm.model_executor.models.llama import LlamaForCausalLM

    weights = load_file(str(llama_dir / "model.safetensors"))
    causal_lm = vllm_cpu_model(LlamaForCausalLM, llama_dir, weights=weights.items())

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.language_model = causal_lm if layout.endswith(".model") else causal_lm.model

        def get_language_model(self):
            return self.language_model

        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
            decoder = causal_lm.model
            return decoder(input_ids, positions, intermediate_tensors, inputs_embeds)

        def compute_logits(self, hidden_states):
            return causal_lm.compute_logits(hidden_states)

    assert patch(Wrapper).patchable
    model = Wrapper()
    num_layers = len(causal_lm.model.layers)
    ids = (0, 3, num_layers)
    model.set_aux_hidden_state_layers(ids)
    assert vllm_plugin.find_decoder(model)[0] == layout
    tokens = torch.randint(0, 2000, (10,))
    with torch.no_grad():
        hidden, aux = model(tokens, torch.arange(10))
        hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
        last = []
        hook = hf.model.layers[-1].register_forward_hook(
            lambda mod, args, out: last.append(out[0] if isinstance(out, tuple) else out))
        ref = hf(tokens[None], output_hidden_states=True)
        hook.remove()
    want = [ref.hidden_states[0][0], ref.hidden_states[3][0], last[0][0]]
    assert len(aux) == 3
    for got, exp in zip(aux, want):
        assert torch.allclose(got, exp, atol=1e-4, rtol=1e-4)
    assert torch.allclose(hidden, ref.hidden_states[-1][0], atol=1e-4, rtol=1e-4)


def test_a_patched_wrapper_config_gets_the_image_token_name_vllm_reads():
    """vLLM 0.24's drafter set-up reads target.config.image_token_index for multimodal targets
    it does not list (KimiVL's config says media_placeholder_token_id, Qwen2-VL's
    image_token_id): a patched wrapper's instance config gets that name; one that has it keeps
    its value; text models are left as they are."""
    class Config:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    def with_config(base, config):
        cls = fresh(base)
        init = cls.__init__

        def __init__(self):
            init(self)
            self.config = config
        cls.__init__ = __init__
        return cls

    for given, want in (({"media_placeholder_token_id": 7}, 7), ({"image_token_id": 9}, 9),
                        ({"image_token_index": 3, "image_token_id": 9}, 3)):
        cls = with_config(WrapperCausalLM, Config(**given))
        patch(cls)
        assert cls().config.image_token_index == want
    text = with_config(TextAuxLM, Config(image_token_id=9))
    patch(text)
    assert not hasattr(text().config, "image_token_index")


def test_a_bare_decoder_under_a_patched_wrapper_gets_the_model_view_vllm_reads():
    """vLLM 0.32's drafter set-up shares the target's embedding from
    `get_language_model().model.embed_tokens`; under Idefics3 / SmolVLM the language model is
    the bare decoder (no `.model`: "Target model does not have 'model' attribute", seen in a
    real vLLM 0.32 on CPU). A patched wrapper's decoder gets a `.model` that reads the
    decoder's own members, live, and adds no submodule, parameter or state-dict entry; a
    language model that has a `.model` keeps it."""
    cls = fresh(WrapperDecoderDirect)
    patch(cls)
    wrapper = cls()
    lm = wrapper.get_language_model()
    assert lm.model.embed_tokens is lm.embed_tokens and lm.model.layers is lm.layers
    replaced = nn.Embedding(V, H)
    lm.embed_tokens = replaced
    assert lm.model.embed_tokens is replaced  # read when asked, not copied at init
    assert "model" not in dict(lm.named_children())
    assert not any(k.startswith("model.") for k in wrapper.state_dict())
    wrapper.to(torch.float64)  # module recursion does not loop through the view
    causal = fresh(WrapperCausalLM)
    patch(causal)
    inner = causal().language_model
    assert isinstance(inner.model, nn.Module) and inner.model is inner.__dict__["_modules"]["model"]
    text = fresh(TextAuxLM)
    patch(text)
    assert not isinstance(getattr(text(), "model", None), vllm_plugin.InnerModelView)


@pytest.mark.vllm
def test_vllm_draft_classes_are_never_patched():
    """Patching a draft's has_own_lm_head / has_own_embed_tokens would make vLLM swap its own
    head and embedding for the target's: the plugin leaves vLLM's draft architectures alone."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models import registry

    loaded, lazy = vllm_plugin._registered_classes()
    names = {c.__name__ for c in loaded} | {n for ns in lazy.values() for n in ns}
    drafts = {name for _, name in registry._SPECULATIVE_DECODING_MODELS.values()}
    targets = {name for arch, (_, name) in registry._VLLM_MODELS.items()
               if arch not in registry._SPECULATIVE_DECODING_MODELS}
    assert "Qwen3_5MTP" in drafts and "LlamaForCausalLM" in targets
    assert not (names & (drafts - targets)), names & (drafts - targets)
    assert {"LlamaForCausalLM", "KimiVLForConditionalGeneration"} <= names
