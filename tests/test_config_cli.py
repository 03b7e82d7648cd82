"""The config/CLI conventions every step shares: one declaration -> flags, YAML, validation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from eyas import cli
from eyas.config import ConfigError, from_dict, option, required, to_dict


@dataclass(frozen=True)
class Demo:
    target: str = required("the target")
    ids: tuple[int, ...] = option((2, 4, 5), "layer ids")
    lr: float = option(1e-4, "learning rate")
    name: str | None = option(None, "optional")
    flag: bool = option(False, "a switch")


def test_from_dict_coerces_and_rejects_unknown_keys():
    cfg = from_dict(Demo, {"target": "m", "ids": "1,2,3", "lr": "0.5", "flag": "yes"})
    assert cfg == Demo(target="m", ids=(1, 2, 3), lr=0.5, flag=True)
    assert to_dict(cfg)["ids"] == [1, 2, 3]
    with pytest.raises(ConfigError, match="unknown config key.*'lrr'"):
        from_dict(Demo, {"target": "m", "lrr": 1})
    with pytest.raises(ConfigError, match="needs \\['target'\\]"):
        from_dict(Demo, {})
    with pytest.raises(ConfigError, match="'lr'"):
        from_dict(Demo, {"target": "m", "lr": "fast"})
    with pytest.raises(ConfigError, match="may not be null"):
        from_dict(Demo, {"target": None})
    # YAML reads a bare off / yes as a bool: a text key got "False" / "True" (a system prompt
    # "True" on every row; `reasoning: off` refused as 'False')
    for bare in (False, True):
        with pytest.raises(ConfigError, match=rf"'name': {bare} is how YAML reads a bare .*quote"):
            from_dict(Demo, {"target": "m", "name": bare})
    assert from_dict(Demo, {"target": "m", "name": "off"}).name == "off"
    # a list: commas or spaces, but an empty item is a typo, not a shorter list
    assert from_dict(Demo, {"target": "m", "ids": "1, 2"}).ids == (1, 2)
    assert from_dict(Demo, {"target": "m", "ids": "1 2 3"}).ids == (1, 2, 3)
    for typo in ("1,,3", "1,2,", ",1"):
        with pytest.raises(ConfigError, match=r"'ids': .* has an empty item between commas"):
            from_dict(Demo, {"target": "m", "ids": typo})


def test_every_command_has_help_and_documents_every_field(capsys):
    import dataclasses
    for name in cli.COMMANDS:
        try:
            _, cls = cli._load(name)
        except ImportError:
            continue
        with pytest.raises(SystemExit) as exc:
            cli.main([name, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        for f in dataclasses.fields(cls):
            flag = f.name if f.metadata.get("positional") else "--" + f.name.replace("_", "-")
            assert flag in text, (name, flag)
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_yaml_config_is_overridden_by_flags(tmp_path):
    from eyas.pipeline import RunConfig  # noqa: F401  (a real config class of the CLI)
    path = tmp_path / "c.yaml"
    path.write_text("dry_run: true\nforce: false\n")
    cfg = cli.parse_config("run", ["p.yaml", "--config", str(path), "--force"])
    assert cfg.dry_run is True and cfg.force is True and cfg.pipeline == "p.yaml"
    path.write_text("dry_runn: true\n")
    with pytest.raises(ConfigError, match="dry_runn"):
        cli.parse_config("run", ["p.yaml", "--config", str(path)])


def test_cli_prints_error_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nope: 1\n")
    assert cli.main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["run", str(tmp_path)]) == 2  # a folder is not "missing"
    assert f"config file {tmp_path} is a folder; give the path of a YAML file" in \
        capsys.readouterr().err


def test_a_bad_target_sdpa_value_is_refused_before_any_step(tmp_path, monkeypatch, capsys):
    # EYAS_TARGET_SDPA (eyas.targets.sdpa) is read at each target forward: a typo must not
    # wait until a large target has loaded
    (tmp_path / "prepared").mkdir()
    monkeypatch.setenv("EYAS_TARGET_SDPA", "cudnn")
    assert cli.main(["vocab", "--data", str(tmp_path / "prepared"),
                     "--out", str(tmp_path / "vocab")]) == 2
    assert "EYAS_TARGET_SDPA='cudnn': expected auto" in capsys.readouterr().err
    assert not (tmp_path / "vocab").exists()


def test_a_wrong_flag_gets_the_commands_usage_and_a_pipeline_yaml_its_place(tmp_path, capsys):
    # the top-level usage answered a misspelt step flag; `eyas run --config pipe.yaml` said
    # "unknown config key(s) ['capture', ...] for RunConfig"
    with pytest.raises(SystemExit) as stop:
        cli.main(["prepare", "--target", "t", "--data", "d", "--max-lenght", "512"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("usage: eyas prepare ")
    assert "unrecognized arguments: --max-lenght (did you mean --max-length?) 512" in err
    pipe = tmp_path / "pipe.yaml"
    pipe.write_text("target: t\ndata: d\nwork_dir: w\n")
    assert cli.main(["run", "--config", str(pipe)]) == 2
    assert f"is a pipeline YAML: give it as the argument, `eyas run {pipe}`" in \
        capsys.readouterr().err
    # -v after the command, as `eyas STEP --help` lists it, and before it
    for argv in (["doctor", "x", "-v"], ["-v", "doctor", "x"]):
        args = cli.build_parser("doctor").parse_args(argv)
        assert args.verbose is True and args.target == "x"
    assert cli.build_parser("doctor").parse_args(["doctor", "x"]).verbose is False


def test_ctrl_c_is_one_line_that_says_how_to_resume(monkeypatch, capsys):
    """Ctrl-C in a step other than train (which stops itself) printed ~40 lines of traceback
    ending in KeyboardInterrupt; it is one line and exit code 130, as train's own stop."""
    def interrupted(cfg):
        raise KeyboardInterrupt

    real = cli._load
    monkeypatch.setattr(cli, "_load", lambda command: (interrupted, real(command)[1]))
    assert cli.main(["prepare", "--target", "t", "--data", "d", "--out", "o"]) == 130
    assert capsys.readouterr().err.strip().endswith(
        "eyas prepare: interrupted; prepare does not resume: run it again to prepare from the "
        "start (an earlier output in --out is left as it was meanwhile)")  # it once said resume
    assert cli.main(["capture", "--target", "t", "--data", "d", "--out", "o"]) == 130
    assert capsys.readouterr().err.strip().endswith(
        "eyas capture: interrupted; run the same command again to resume where it stopped")
    # from an audit: convert said "resume", and a second run converted from the start
    assert cli.main(["convert", "--target", "g.gguf", "--out", "o"]) == 130
    assert capsys.readouterr().err.strip().endswith(
        "eyas convert: interrupted; convert does not resume: run it again to convert from the "
        "start (--out is written only once the conversion is whole)")


def test_sigterm_says_the_step_stopped_and_ends_as_sigterm_does(tmp_path):
    # capture and regenerate ended on SIGTERM with no word, where train says how to resume
    import signal
    import subprocess
    import sys

    script = tmp_path / "step.py"
    script.write_text(
        "import sys, time\nfrom eyas import cli\nreal = cli._load\n"
        "def step(cfg):\n    print('started', flush=True)\n    time.sleep(60)\n"
        "cli._load = lambda c: (step, real(c)[1])\n"
        "sys.exit(cli.main(['prepare', '--target', 't', '--data', 'd', '--out', 'o']))\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM  # killed by it, as before: a shell says 143
    assert err.strip().endswith("eyas prepare: stopped by SIGTERM; prepare does not resume: "
                                "run it again to prepare from the start (an earlier output in "
                                "--out is left as it was meanwhile)")


def test_broken_configs_and_a_fake_gguf_are_one_line_errors(tmp_path, capsys):
    # Issue 34: malformed YAML and a !!python tag (refused by safe_load, never run) ended in
    # raw tracebacks; a text file named x.gguf must be a clear error too.
    marker = tmp_path / "ran"
    cases = {"syntax.yaml": ("target: [oops\n", "not valid YAML at line 2, column 1"),
             "tag.yaml": (f"target: !!python/object/apply:os.system ['touch {marker}']\n",
                          "eyas reads plain YAML only (no !!python tags)"),
             "tab.yaml": ("out: x\n\tdata: y\n", "cannot start any token"),
             "latin1.yaml": (b"target: caf\xe9\n", "is not UTF-8 text")}
    for name, (text, want) in cases.items():
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        for argv in (["prepare", "--config", str(path)], ["run", str(path)]):
            assert cli.main(argv) == 2
            err = capsys.readouterr().err
            assert want in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not marker.exists()
    fake = tmp_path / "x.gguf"
    fake.write_text("not a model, just text\n")
    assert cli.main(["doctor", str(fake)]) == 2
    err = capsys.readouterr().err
    assert "is not a GGUF file" in err and "Traceback" not in err



def _build_draft(cfg):
    """eyas.draft.train_setup.build_draft on a tiny target: only what it reads of
    eyas.draft.data.Inputs."""
    import types

    import torch
    from transformers import LlamaConfig

    from eyas.draft.processes import Env
    from eyas.draft.train_setup import build_draft

    inputs = types.SimpleNamespace(
        info=LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=50, max_position_embeddings=128),
        aux_layer_ids=(1, 2, 3), d2t=None, t2d=None, embed=torch.randn(50, 32),
        lm_head=torch.randn(50, 32))
    return build_draft(cfg, inputs, Env(0, 1, torch.device("cpu"), autocast=False))


@pytest.mark.parametrize("flags,want", [
    # the default recipe is EAGLE 3.1 with speculators' fc norm (measured best, docs/train.md)
    ([], {"norm_before_fc": True, "fc_norm": False, "norm_output": True}),
    (["--no-norm-before-fc", "--no-norm-output"],
     {"norm_before_fc": False, "fc_norm": False, "norm_output": False}),
    (["--norm-before-fc", "--norm-output"],
     {"norm_before_fc": True, "fc_norm": False, "norm_output": True}),
    (["--fc-norm"],  # the paper's fc norm takes the place of the default one
     {"norm_before_fc": False, "fc_norm": True, "norm_output": True}),
    (["--fc-norm", "--no-norm-output"],
     {"norm_before_fc": False, "fc_norm": True, "norm_output": False}),
])
def test_train_eagle31_flags_reach_the_draft_and_its_saved_config(flags, want):
    """`eyas train --norm-before-fc / --fc-norm / --norm-output` -> TrainConfig -> build_draft's
    DraftConfig (the dict train writes to draft_config.json and its manifest) and the norm
    modules of the draft."""
    from eyas.draft.config import DraftConfig

    cfg = cli.parse_config("train", ["--data", "captured/", "--out", "run/", *flags])
    assert {k: getattr(cfg, k) for k in want} == want
    draft, dcfg = _build_draft(cfg)
    assert {k: dcfg.to_dict()[k] for k in want} == want
    assert DraftConfig.from_dict(dcfg.to_dict()) == dcfg
    assert hasattr(draft, "input_norm") == want["norm_before_fc"]
    assert hasattr(draft, "fc_norm") == want["fc_norm"]


def test_dflash_drafts_get_no_eagle31_norms_by_default():
    cfg = cli.parse_config("train", ["--data", "c/", "--out", "r/", "--draft", "dflash"])
    assert (cfg.norm_before_fc, cfg.fc_norm, cfg.norm_output) == (False, False, False)
    with pytest.raises(ConfigError, match="--norm-before-fc"):
        cli.parse_config("train", ["--data", "c/", "--out", "r/", "--draft", "dflash",
                                   "--norm-output"])


def test_train_refuses_both_fc_norm_variants():
    cfg = cli.parse_config("train", ["--data", "c/", "--out", "r/", "--norm-before-fc",
                                     "--fc-norm"])
    with pytest.raises(ConfigError, match="choose one"):
        _build_draft(cfg)


@pytest.mark.parametrize("flag", [["--ttt-steps", "3"], ["--step-weight", "0.5"],
                                  ["--lm-head", "scratch"], ["--lk-kl-scale", "0.5"]])
def test_dflash_refuses_eagle3_flags_it_would_ignore(flag):
    with pytest.raises(ConfigError, match=flag[0] + ": an EAGLE-3 option"):
        cli.parse_config("train", ["--data", "c/", "--out", "r/", "--draft", "dflash", *flag])


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_a_value_outside_a_fields_choices_is_refused_however_given(command):
    # argparse checked choices for flags only: from a YAML file, a pipeline section or a
    # library call `optimizer: adam` trained Muon, `parallel: FSDP` ran DDP, and
    # `format: vlm` failed with a KeyError after training
    import dataclasses
    import importlib

    from eyas.config import ConfigError, field_types

    module, _, name, _ = cli.COMMANDS[command]
    cls = getattr(importlib.import_module(module), name)
    needed = {f.name: "x" for f in dataclasses.fields(cls)
              if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("choices"):
            continue
        bad = ("bogus",) if "tuple" in str(hints[f.name]) else "bogus"
        flag = "--" + f.name.replace("_", "-")
        with pytest.raises(ConfigError, match=f"{flag} 'bogus': use one of"):
            cls(**{**needed, f.name: bad})


def test_a_dtype_in_another_steps_spelling_is_taken_as_this_steps(tmp_path):
    """From a user audit: eval, regenerate and convert took `bfloat16`, capture, export and
    train `bf16`, each refusing the other's. Each now takes both, by flag, YAML or library
    call, and holds (and records) its own spelling."""
    from eyas.capture import CaptureConfig
    from eyas.evaluate import EvalConfig

    got = cli.parse_config("capture", ["--target", "t", "--data", "d", "--out", "o",
                                       "--model-dtype", "bfloat16", "--dtype", "bfloat16"])
    assert (got.model_dtype, got.dtype) == ("bf16", "bf16")
    got = cli.parse_config("eval", ["--target", "t", "--data", "d", "--out", "o",
                                    "--dtype", "fp32"])
    assert got.dtype == "float32"
    yaml_file = tmp_path / "export.yaml"
    yaml_file.write_text("checkpoint: run\nout: d\ndtype: float16\n")
    assert cli.parse_config("export", ["--config", str(yaml_file)]).dtype == "fp16"
    assert CaptureConfig(target="t", data="d", out="o", dtype="bfloat16").dtype == "bf16"
    assert EvalConfig(target="t", out="o", data="d", dtype="bf16").dtype == "bfloat16"
    with pytest.raises(SystemExit):  # fp8 has no other spelling: still refused where unknown
        cli.parse_config("export", ["--checkpoint", "c", "--out", "o", "--dtype", "fp8"])


def test_a_list_value_that_starts_with_a_minus_reaches_the_configs_own_check(capsys):
    # argparse took `-1,2,4` for a flag and answered "expected one argument"
    argv = ["capture", "--target", "t", "--data", "d", "--out", "o", "--aux-layer-ids", "-1,2,4"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "aux_layer_ids (-1, 2, 4) out of range" in err and "expected one" not in err
    with pytest.raises(ConfigError, match=r"\(-1, 2, 4\) out of range"):
        cli.parse_config("capture", argv[1:])
    # a flag after a flag that takes a value is still a flag
    with pytest.raises(SystemExit):
        cli.parse_config("capture", ["--target", "t", "--out", "--data", "d"])


def test_a_device_that_is_not_here_is_a_clear_error_before_the_target_loads(
        tmp_path, llama_dir, capsys, monkeypatch):
    """A device torch cannot name is refused with the options (capture, regenerate, and an
    `eyas run` YAML's capture section before any step); one it names but that is not here
    (CUDA without a GPU, cuda:N past the GPUs visible) when the target would load: never
    a traceback from deep inside torch."""
    import torch

    from eyas.targets import models

    from test_capture import make_prepared

    prepared = make_prepared(tmp_path / "prepared", llama_dir)
    capture = ["capture", "--target", str(llama_dir), "--data", str(prepared), "--out",
               str(tmp_path / "cap")]
    for flags, said in ((["--device", "nosuch"], "--device 'nosuch': torch names no such "
                         "device; use cpu, cuda, cuda:N"),
                        (["--device-map", "nosuch"], "--device-map 'nosuch': torch names no "
                         "such device; use auto, balanced")):
        assert cli.main([*capture, *flags]) == 2
        assert said in capsys.readouterr().err
    assert cli.main([*capture, "--attn-implementation", "nosuch"]) == 2  # transformers' reason
    assert "eyas capture: error: --attn-implementation 'nosuch': " in capsys.readouterr().err
    assert cli.main(["regenerate", "--target", str(llama_dir), "--data", str(tmp_path / "x"),
                     "--out", str(tmp_path / "r"), "--device", "gpu0"]) == 2
    assert "--device 'gpu0': torch names no such device; use auto, cpu" in \
        capsys.readouterr().err
    pipe = tmp_path / "pipe.yaml"
    pipe.write_text(f"target: {llama_dir}\ndata: {tmp_path / 'd.jsonl'}\nwork_dir: "
                    f"{tmp_path / 'w'}\ncapture:\n  device: nosuch\n")
    assert cli.main(["run", str(pipe)]) == 2
    assert "--device 'nosuch'" in capsys.readouterr().err and not (tmp_path / "w").exists()

    # CUDA that is not here: as on a machine without a GPU, and one GPU asked for its second
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main([*capture, "--device", "cuda"]) == 2
    assert "the target's device 'cuda': no CUDA device is visible here" in \
        capsys.readouterr().err
    assert not (tmp_path / "cap").exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"device map 'cuda:1': only 1 CUDA device\(s\) are "
                                          r"visible \(cuda:0..cuda:0"):
        models.load_target(str(llama_dir), device_map="cuda:1")


def test_vllm_engine_options_are_refused_with_another_backend():
    """--tensor-parallel-size and the other vLLM engine options do nothing with the
    transformers (or openai) backend: refused, as --vllm-args is, rather than ignored."""
    from eyas.capture import CaptureConfig
    from eyas.regenerate import RegenerateConfig

    common = dict(target="t", data="d", out="o")
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size is a --backend vllm "
                                          r"option, unused by --backend transformers: drop it"):
        CaptureConfig(**common, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"^--gpu-memory-utilization, --kv-cache-gib are "
                                          r"--backend vllm options, unused by --backend openai"):
        RegenerateConfig(**common, backend="openai", server_url=["http://localhost:8000"],
                         gpu_memory_utilization=0.5, kv_cache_gib=4)
    CaptureConfig(**common, tensor_parallel_size=2, backend="vllm")
    RegenerateConfig(**common, backend="vllm", max_model_len=4096)


def test_a_list_flag_given_twice_adds_to_its_list(tmp_path):
    """`--data a --data b` kept b alone (argparse's store), dropping a's data unsaid; `--bench
    mt-bench --bench gsm8k` measured GSM8K only."""
    cfg = cli.parse_config("vocab", ["--data", "a", "--data", "b,c", "--out", "o"])
    assert cfg.data == ("a", "b", "c")
    cfg = cli.parse_config("eval", ["--target", "t", "--bench", "mt-bench", "--bench", "gsm8k",
                                    "--k", "1", "--k", "3", "--out", "o"])
    assert cfg.bench == ("mt-bench", "gsm8k") and cfg.k == (1, 3)
    # a --config file's list is still replaced by the flag, not added to
    path = tmp_path / "v.yaml"
    path.write_text("data: [x, y]\nout: o\n")
    assert cli.parse_config("vocab", ["--config", str(path), "--data", "z"]).data == ("z",)


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_number_option_refuses_nan_and_inf_before_any_work(value, capsys):
    """`capture --file-mb inf` loaded the target, then ended in "OverflowError: cannot convert
    float infinity to integer" (nan: ValueError), leaving a part file in --out."""
    assert cli.main(["capture", "--target", "t", "--data", "d", "--out", "o",
                     f"--file-mb={value}"]) == 2
    assert f"config key 'file_mb': '{value}' is not a finite number" in capsys.readouterr().err


def test_one_data_path_with_a_space_is_one_path(tmp_path):
    """`--data 'my dir/x.jsonl'` was split on the space into two paths, neither there."""
    (tmp_path / "my dir").mkdir()
    (tmp_path / "my dir" / "x.jsonl").write_text("")
    path = str(tmp_path / "my dir" / "x.jsonl")
    assert cli.parse_config("vocab", ["--data", path, "--out", "o"]).data == (path,)
    # words that name no file are still a list: `--chat-template-kwargs 'a=1 b=2'`
    cfg = cli.parse_config("prepare", ["--target", "t", "--data", path, "--out", "o",
                                       "--chat-template-kwargs", "a=1 b=2"])
    assert cfg.chat_template_kwargs == ("a=1", "b=2")
    # from an audit: given twice, each value is read as one would be (the space kept)
    other = str(tmp_path / "y.jsonl")
    twice = cli.parse_config("vocab", ["--data", path, "--data", other, "--out", "o"]).data
    assert twice == (path, other)
    thrice = cli.parse_config("vocab", ["--data", "a,b", "--data", path, "--data", "c",
                                         "--out", "o"]).data
    assert thrice == ("a", "b", path, "c")


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0])
def test_capture_config_refuses_a_file_size_that_is_not_finite_and_positive(value):
    """From an audit: a library call's `file_mb=inf` passed the `<= 0` check, loaded the
    target and crashed leaving a part file."""
    from eyas.capture import CaptureConfig
    with pytest.raises(ConfigError, match="file_mb must be a finite number > 0"):
        CaptureConfig(target="t", data="d", out="o", file_mb=value)


def test_chat_template_kwargs_as_a_yaml_mapping_are_its_key_value_pairs():
    """From an audit: `chat_template_kwargs: {enable_thinking: false}` in a config was refused
    as "cannot read {...} as <class 'str'>"; it is the natural YAML for them."""
    from eyas.config import coerce

    from eyas.targets.chat import parse_template_kwargs

    given = {"enable_thinking": False, "n": 3, "mode": "no", "day": "2024-07-26", "note": "a: b"}
    pairs = coerce("eval.chat_template_kwargs", tuple[str, ...], given)
    assert pairs[:2] == ("enable_thinking=false", "n=3")
    assert parse_template_kwargs(pairs) == given  # every value of the type it was given
    assert coerce("chat_template_kwargs", tuple[str, ...], ["enable_thinking=false"]) == \
        ("enable_thinking=false",)


def test_a_value_of_the_wrong_kind_names_the_flag_and_what_it_takes():
    """From an audit: `--aux-layer-ids a,b` said "config key 'aux_layer_ids': cannot read 'a'
    as <class 'int'>" (a YAML key's name and a Python type, to a command-line user)."""
    from eyas.config import coerce

    with pytest.raises(ConfigError, match=r"^config key 'aux_layer_ids' \(--aux-layer-ids\): "
                                          r"cannot read 'a' as a whole number$"):
        coerce("aux_layer_ids", tuple[int, ...], "a,b")
    with pytest.raises(ConfigError, match=r"'eval.lr' \(--lr\): cannot read 'x' as a number$"):
        coerce("eval.lr", float, "x")
