"""eyas doctor: the report on real tiny targets (text and JSON, through the CLI), clear errors,
and the vLLM checks: SupportsEagle3 by isinstance (never issubclass) and the model_type allow-list.
The vLLM-marked test runs the real vLLM where it is installed."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import types
from typing import ClassVar, Literal, Protocol, runtime_checkable

import pytest
import torch

from eyas.cli import main, parse_config
from eyas.config import ConfigError
from eyas.doctor import (DoctorConfig, allow_list_in_source, allowed_by,
                         capture_bytes_per_token, doctor, eagle3_interface, plugin_plan,
                         protocol_members)
from eyas.errors import EyasError
from eyas.targets.models import inspect_model, load_config, load_tokenizer

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, kimi_like_dir):
    return lambda name: kimi_like_dir if name == "kimi_like" else tiny_model_dir(name)


# ----------------------------------------------------------------------------- the report

@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "deepseek_v3", "qwen2_5_vl", "kimi_like"])
def test_report_matches_inspection(model_dir, name, capsys):
    path = model_dir(name)
    report = doctor(DoctorConfig(target=str(path), trust_remote_code=True))
    info = inspect_model(load_config(path, trust_remote_code=True), trust_remote_code=True)
    assert report["model"]["layers_path"] == info.layers_path
    assert report["model"]["text_model_path"] == info.text_model_path
    assert report["aux_layer_ids"]["ids"] == list(info.default_aux_layer_ids)
    assert report["capture_bytes"]["bf16"] == 8 * info.hidden_size + 9
    tok = load_tokenizer(path)
    assert report["tokenizer"] == {"loaded": True, "class": type(tok).__name__,
                                   "size": len(tok), "chat_template": True,
                                   "fits_model_vocab": True}
    text = capsys.readouterr().out
    assert f"{info.layers_path}: {info.num_layers} x " in text
    assert f"aux layer ids    {info.default_aux_layer_ids} default (2, L//2, L-3)" in text
    if not torch.cuda.is_available():
        assert "draft attention  no CUDA GPU here (CPU training runs the exact plain-torch " \
               "band) [one-document rows; packed rows: FlexAttention]" in text
    json.dumps(report)  # the same dict is what --json prints


def test_weights_cut_short_or_missing_are_a_problem(model_dir, tmp_path, capsys):
    """doctor said "verdict ok" on a folder whose weights file was cut short (every step that
    loads it fails), and "no weights here: a config-only folder" when one shard was gone."""
    import shutil

    folder = tmp_path / "cut"
    shutil.copytree(model_dir("llama"), folder)
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 1)
    report = doctor(DoctorConfig(target=str(folder)))
    assert not report["ok"] and report["problems"] == [
        f"weights: model.safetensors has {size - 1:,} bytes where its header says {size:,}: "
        f"the file was cut short; download or copy the model again (every step that loads "
        f"the target would fail)"]
    text = capsys.readouterr().out
    assert "verdict          1 problem(s)" in text
    # no fingerprint of the cut file (it names no checkpoint): the identity line says why
    assert report["identity"] == {} and "identity         none (model.safetensors has" in text
    # an index naming a file that is not there: the identity line says so
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    weights.unlink()
    report = doctor(DoctorConfig(target=str(folder)))
    assert not report["ok"] and report["identity"] == {}
    assert "identity         none (1 of the 1 files model.safetensors.index.json names is " \
           "missing (model-00002-of-00002.safetensors))" in capsys.readouterr().out


def test_bad_attention_choice_is_a_problem(model_dir, monkeypatch, capsys):
    monkeypatch.setenv("EYAS_ATTENTION", "flash3")
    report = doctor(DoctorConfig(target=str(model_dir("llama"))))
    assert not report["ok"]
    assert "draft attention: EYAS_ATTENTION='flash3': expected auto, fa4 or cudnn" \
        in report["problems"]
    # the CLI exits 1 with a problem listed (it exited 0: a CI step running doctor passed)
    assert main(["doctor", str(model_dir("llama"))]) == 1
    assert "verdict          1 problem(s)" in capsys.readouterr().out
    monkeypatch.delenv("EYAS_ATTENTION")
    assert main(["doctor", str(model_dir("llama"))]) == 0


def test_kimi_like_report_text(model_dir, capsys):
    doctor(DoctorConfig(target=str(model_dir("kimi_like")), trust_remote_code=True,
                        aux_layer_ids=(1, 4, 8)))
    text = capsys.readouterr().out
    assert "KimiK25ForConditionalGeneration (model_type kimi_k25_like, text model_type " \
           "deepseek_v3)" in text
    assert "text decoder     language_model.model (below a wrapper)" in text
    assert "language_model.model.layers: 8 x DeepseekV3DecoderLayer" in text
    assert "MLA, MoE (4 experts)" in text
    # id 8 = L: the output of the last layer, not the input of a ninth one
    assert "output of language_model.model.layers[7]" in text
    assert "(1, 4, 8) given" in text


@pytest.mark.skipif(HAVE_VLLM, reason="checks the report without vLLM")
def test_without_vllm_says_what_was_not_checked(model_dir, capsys):
    report = doctor(DoctorConfig(target=str(model_dir("kimi_like")), trust_remote_code=True))
    vl = report["vllm"]
    assert vl["importable"] is False and "vllm" in vl["error"]
    assert any("SupportsEagle3" in line for line in vl["not_checked"])
    assert "'deepseek_v3' is not" in vl["hint"]
    assert report["ok"] and "vLLM side not checked" in capsys.readouterr().out


def test_a_gguf_target_is_pointed_at_eyas_convert(tiny_gguf, model_dir, tmp_path, capsys):
    """Not a problem (it works), a note: the GGUF is de-quantized at every load; its converted
    folder says where it came from; a plain folder has no note."""
    from eyas.store.manifest import gguf_fingerprint, weights_fingerprint
    from eyas.targets.convert import convert_gguf

    gguf = tiny_gguf(0)
    report = doctor(DoctorConfig(target=str(gguf)))
    assert report["ok"] and len(report["notes"]) == 1
    assert "de-quantized at every load" in report["notes"][0]
    assert f"eyas convert --target {gguf} --out FOLDER" in report["notes"][0]
    assert f"note             {report['notes'][0]}" in capsys.readouterr().out
    folder = convert_gguf(gguf, tmp_path / "hf")
    converted = doctor(DoctorConfig(target=str(folder)))
    (note,) = converted["notes"]
    assert note.startswith(f"converted from {gguf.resolve()} by `eyas convert`")
    # the identity later steps compare: the GGUF's for both (and the folder's own weights, which
    # tell conversions in other dtypes apart), the weights' for a plain folder
    assert report["identity"] == {"gguf_fingerprint": gguf_fingerprint(gguf)}
    assert converted["identity"] == {"gguf_fingerprint": gguf_fingerprint(gguf),
                                     "weights_fingerprint": weights_fingerprint(folder)}
    plain = doctor(DoctorConfig(target=str(model_dir("llama"))))
    assert plain["notes"] == []
    assert plain["identity"] == {"weights_fingerprint": weights_fingerprint(model_dir("llama"))}
    assert f"identity         weights_fingerprint {weights_fingerprint(model_dir('llama'))}" \
        in capsys.readouterr().out
    # a config-only folder: no identity (it printed "weights_fingerprint None"), and the
    # serve advice names the revision checked, quoted for a shell
    bare = tmp_path / "config only"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((model_dir("llama") / name).read_bytes())
    empty = doctor(DoctorConfig(target=str(bare)))
    assert empty["identity"] == {}
    assert "identity         none (no weights here" in capsys.readouterr().out
    assert empty["plan"]["serve"].startswith(f"vllm serve '{bare}' --speculative-config")


def test_cli_json(model_dir, capsys):
    rc = main(["doctor", str(model_dir("qwen2_5_vl")), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["is_wrapper"] is True
    assert report["model"]["lm_head_path"] == "lm_head"


def test_cli_parses_positional_target_and_ids(model_dir):
    cfg = parse_config("doctor", [str(model_dir("llama")), "--aux-layer-ids", "1,3,8"])
    assert cfg.target == str(model_dir("llama")) and cfg.aux_layer_ids == (1, 3, 8)
    assert cfg.json is False and cfg.trust_remote_code is False


def test_missing_model_is_a_clean_cli_error(tmp_path, capsys):
    rc = main(["doctor", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert rc == 2 and "does not exist" in err and "Traceback" not in err



def test_a_step_folder_is_not_taken_for_a_target(model_dir, tmp_path, capsys):
    """doctor on an exported draft read its config.json as a 1-layer Llama and said "a target
    with 1 decoder layer(s) has no 3 distinct aux layers"."""
    from eyas.draft.formats import to_vllm_config
    from eyas.store.manifest import write_manifest
    from test_export import draft_config

    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(to_vllm_config(draft_config())))
    write_manifest(tmp_path / "draft", "export", {}, target={"name_or_path": "org/target"})
    rc = main(["doctor", str(tmp_path / "draft")])
    err = capsys.readouterr().err
    assert rc == 2 and "output of `eyas export`, not a model" in err
    assert "eyas doctor org/target" in err

def test_remote_code_without_trust_is_refused(model_dir):
    with pytest.raises(EyasError, match="--trust-remote-code"):
        doctor(DoctorConfig(target=str(model_dir("kimi_like"))))


def test_bad_aux_ids(model_dir):
    with pytest.raises(ConfigError, match="strictly ascending"):
        DoctorConfig(target="x", aux_layer_ids=(4, 2, 1))
    with pytest.raises(ConfigError, match="out of range"):
        doctor(DoctorConfig(target=str(model_dir("llama")), aux_layer_ids=(2, 4, 9)))


def test_capture_bytes_for_kimi_k25():
    b = capture_bytes_per_token(7168)  # Kimi-K2.5 / DeepSeek-V3 hidden size
    assert b["bf16"] == 3 * 7168 * 2 + 7168 * 2 + 4 + 4 + 1 == 57353
    assert b["fp8_aux"] == 3 * 7168 + 3 * 4 + 7168 * 2 + 9


# ----------------------------------------------------------------------------- vLLM checks

@runtime_checkable
class _Eagle3Shape(Protocol):
    """Same kind of members as vLLM's SupportsEagle3: a ClassVar flag, plain flags, methods."""

    supports_eagle3: ClassVar[Literal[True]] = True
    has_own_lm_head: bool = False
    has_own_embed_tokens: bool = False

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None: ...

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]: ...


class _Complete:
    supports_eagle3 = True
    has_own_lm_head = False
    has_own_embed_tokens = False

    def set_aux_hidden_state_layers(self, layers): ...

    def get_eagle3_default_aux_hidden_state_layers(self): ...


class _Wrapper:  # a multimodal wrapper that only delegates to its language model
    def get_language_model(self): ...


def test_protocol_with_data_members_refuses_issubclass():
    # Why eyas checks with isinstance on the class object: issubclass raises here.
    with pytest.raises(TypeError, match="non-method members"):
        issubclass(_Complete, _Eagle3Shape)


def test_eagle3_interface_complete_and_missing():
    check = lambda cls: isinstance(cls, _Eagle3Shape)  # noqa: E731 - vLLM's supports_eagle3
    members = protocol_members(_Eagle3Shape)
    assert "supports_eagle3" in members and "set_aux_hidden_state_layers" in members
    ok = eagle3_interface(_Complete, _Eagle3Shape, check)
    assert ok["supports_eagle3"] and ok["missing"] == []
    assert ok["members"]["get_eagle3_aux_hidden_state_layers"] is False  # the old getter name
    bad = eagle3_interface(_Wrapper, _Eagle3Shape, check)
    assert not bad["supports_eagle3"]
    assert set(bad["missing"]) == set(members)


def test_eagle3_interface_reports_a_checker_that_raises():
    def strict(cls):
        return issubclass(cls, _Eagle3Shape)
    res = eagle3_interface(_Complete, _Eagle3Shape, strict)
    assert res["supports_eagle3"] is False and "TypeError" in res["error"]


OLD_SOURCE = '''
def _verify_args(self):
    eagle3_target_supported = ["llama", "qwen", "minicpm", "gpt_oss"]
    if self.method == "eagle3":
        pass
'''
NEW_SOURCE = '''
class SpeculativeConfig:
    def _verify_args(self):
        other_supported = ["x"]
        aux_hidden_states_supported = [
            "llama", "qwen", "deepseek_v3", "kimi_k2", "kimi_k25",
        ]
'''


def test_allow_list_found_in_both_spellings():
    assert allow_list_in_source(OLD_SOURCE) == (
        "eagle3_target_supported", ["llama", "qwen", "minicpm", "gpt_oss"])
    name, entries = allow_list_in_source(NEW_SOURCE)
    assert name == "aux_hidden_states_supported" and "kimi_k25" in entries
    assert allow_list_in_source("supported = ['llama']\n") is None


def test_allow_list_matches_by_substring_like_vllm():
    old = ["llama", "qwen", "minicpm", "gpt_oss"]
    assert allowed_by("qwen2_5_vl_text", old) and allowed_by("llama", old)
    assert not allowed_by("deepseek_v3", old)


def test_plugin_plan_is_forwarded(monkeypatch):
    plugin = types.ModuleType("eyas.serve.vllm_plugin")
    plugin.plan_patch = lambda cls: {"class": cls.__name__, "would_fix": True}
    monkeypatch.setitem(sys.modules, "eyas.serve.vllm_plugin", plugin)
    assert plugin_plan(_Wrapper) == {"status": "planned",
                                     "plan": {"class": "_Wrapper", "would_fix": True}}
    del plugin.plan_patch
    assert plugin_plan(_Wrapper)["status"] == "unknown"


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
@pytest.mark.parametrize("name", ["llama", "kimi_like"])
def test_real_vllm(model_dir, name):
    report = doctor(DoctorConfig(target=str(model_dir(name)), trust_remote_code=True))
    vl = report["vllm"]
    assert vl["importable"] and vl["model_type"]["text_model_type"] in ("llama", "deepseek_v3")
    if name == "llama":  # vLLM's Llama implements SupportsEagle3 in every eagle3 release
        assert vl["eagle3"]["supports_eagle3"] and vl["eagle3"]["missing"] == []
        assert vl["model_type"]["accepted"] is not False
    elif "eagle3" not in vl:  # a vLLM without Kimi-K2.5 support
        assert "not registered" in vl["model_class"], vl
    else:
        e3 = vl["eagle3"]
        assert set(e3["members"]) >= {"set_aux_hidden_state_layers", "supports_eagle3"}
        assert e3["supports_eagle3"] == (e3["missing"] == [])
        assert (vl["plugin"]["status"] == "not needed") == e3["supports_eagle3"]


# A vLLM that imports but breaks further in, as real installs do (issue 34: a missing PIL gave a
# full traceback before the report). Its logger is set up as vLLM's is, and its registry logs a
# model module that fails to import with logger.exception, as vLLM's _try_load_model_cls does.
FAKE_VLLM = {
    "vllm/__init__.py": (
        "import logging, sys\n__version__ = '0.0.broken'\n"
        "_root = logging.getLogger('vllm')\n_root.addHandler(logging.StreamHandler(sys.stderr))\n"
        "_root.setLevel(logging.DEBUG)\n_root.propagate = False\n"
        "from vllm.model_executor.models.registry import ModelRegistry\n"),
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/models/__init__.py": "",
    "vllm/model_executor/models/registry.py": (
        "import importlib, logging\nlogger = logging.getLogger(__name__)\n"
        "class _Registry:\n"
        "    def get_supported_archs(self):\n        return ['LlamaForCausalLM']\n"
        "    def _try_load_model_cls(self, arch):\n"
        "        try:\n"
        "            return importlib.import_module('vllm.model_executor.models.llama').Model\n"
        "        except Exception:\n"
        "            logger.exception('Error in loading model architecture %r', arch)\n"
        "            return None\n"
        "ModelRegistry = _Registry()\n"),
    "vllm/multimodal.py": "from PIL import ImageOps_not_in_this_install\n",
}
BROKEN_MODEL = "import vllm.multimodal\nclass Model: pass\n"  # the model module needs PIL
BROKEN_INTERFACES = "import vllm.multimodal\n"  # the class loads; its interfaces need PIL


@pytest.mark.parametrize("broken", ["model module", "interfaces"])
def test_a_broken_vllm_is_one_line_not_a_traceback(model_dir, tmp_path, monkeypatch, capsys,
                                                   broken):
    files = dict(FAKE_VLLM)
    if broken == "model module":
        files["vllm/model_executor/models/llama.py"] = BROKEN_MODEL
    else:
        files["vllm/model_executor/models/llama.py"] = "class Model: pass\n"
        files["vllm/model_executor/models/interfaces.py"] = BROKEN_INTERFACES
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    target = str(model_dir("llama"))
    capsys.readouterr()  # building the tiny model writes a progress bar
    monkeypatch.syspath_prepend(str(tmp_path))
    vllm_logger = logging.getLogger("vllm")
    saved = vllm_logger.handlers[:], vllm_logger.propagate, vllm_logger.level
    try:
        report = doctor(DoctorConfig(target=target))
    finally:
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]
        vllm_logger.handlers, vllm_logger.propagate = saved[:2]
        vllm_logger.setLevel(saved[2])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and err == ""
    section = out.split("\nvllm ")[1].split("\nverdict")[0]  # the vLLM section of the report
    vllm_lines = [line for line in section.splitlines() if "ImageOps_not_in_this_install" in line]
    assert len(vllm_lines) == 1 and "0.0.broken" in out
    if broken == "model module":
        assert "could not load its class (ImportError: cannot import name" in vllm_lines[0]
        assert report["vllm_checked"]
    else:
        assert len(section.splitlines()) == 1 and "imports but fails further in" in section
        assert not report["vllm_checked"] and report["ok"]
        assert "vLLM side not checked" in out


def test_a_folder_without_config_json_and_an_offline_hub_name_are_named_as_such(
        model_dir, tmp_path, monkeypatch):
    # "Unrecognized model ... Should have a `model_type` key in its config.json", and advice
    # to set HF_HUB_OFFLINE=1 where it was set
    from eyas.errors import EyasError

    folder = tmp_path / "no-config"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((model_dir("llama") / "tokenizer.json").read_bytes())
    with pytest.raises(EyasError, match=r"from the folder .*no-config: it has no config.json"):
        doctor(DoctorConfig(target=str(folder)))
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what eyas reads
    # what the hub client reads (at import: the environment alone would retry 23 s online)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(EyasError) as err:
        doctor(DoctorConfig(target="nobody/no-such-model"))
    assert "download it first" in str(err.value) and "HF_HUB_OFFLINE" not in str(err.value)


def test_the_default_aux_rule_named_is_the_one_used():
    """From an audit: a 2-layer target's ids (0, 1, 2) were shown as "default (2, L//2, L-3)"."""
    from eyas.doctor import _default_rule
    from eyas.targets.taps import default_aux_layer_ids

    assert _default_rule(32) == "default (2, L//2, L-3)"
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert _default_rule(5).startswith("default (1, L//2, L-1)")
    assert default_aux_layer_ids(5) == (1, 2, 4)
    assert _default_rule(2).startswith("default (0, 1, 2)")
    assert default_aux_layer_ids(2) == (0, 1, 2)
