"""How step configs are declared, loaded from YAML and turned into CLI flags.

Every pipeline step is a plain function taking one frozen dataclass. Each field is
declared once with `option(...)`: its type annotation, default and help text are
all the CLI (`eyas STEP --help`), the YAML loader and the library API need.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config value is wrong; the message says which key and how to fix it."""


def option(default: Any, help: str, *, choices: tuple | None = None, positional: bool = False):
    """Declare a config field: default, help text for the CLI, allowed choices."""
    meta = {"help": help, "choices": choices, "positional": positional}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple (immutable) for sequence defaults")
    return dataclasses.field(default=default, metadata=meta)


def required(help: str, *, positional: bool = False):
    """Declare a field that has no default (the user must give it)."""
    return dataclasses.field(metadata={"help": help, "choices": None, "positional": positional})


def field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def base_type(tp) -> tuple[Any, bool]:
    """(underlying type, is_optional) for `X | None` / `Optional[X]`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


class FlagValues(list):
    """The values of a list flag given more than once (`--data a --data "my b"`), each read
    as the flag's one value would be."""


def _list_words(name: str, value: str, item) -> list[str]:
    """One list value as given: a path that exists is one item, spaces and all; else items
    split on commas, or on whitespace where there is no comma."""
    if item is str and os.path.exists(value):
        return [value]
    parts = [v.strip() for v in value.split(",")] if "," in value else value.split()
    if "" in parts:  # "1,,3" is a typo for some list, not for 1,3
        raise ConfigError(f"config key '{name}': {value!r} has an empty item "
                          f"between commas; give each value once, e.g. 1,2,3")
    return [w for v in parts for w in v.split()]


def coerce(name: str, tp, value):
    """Convert a YAML/CLI value to the field's declared type, or raise ConfigError."""
    tp, optional = base_type(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"config key '{name}' may not be null")
    origin = typing.get_origin(tp)
    try:
        if origin is tuple:
            (item,) = typing.get_args(tp)[:1]
            if isinstance(value, FlagValues):  # each as one flag's value: spaces in paths too
                value = [w for v in value for w in _list_words(name, v, item)]
            elif isinstance(value, str):
                value = _list_words(name, value, item)
            elif isinstance(value, dict) and item is str and name.endswith("_kwargs"):
                # a YAML mapping for a list of KEY=VALUE (chat_template_kwargs): the same
                # pairs, each value as JSON writes it (false, 3, "text"), which reads back as
                # the same type (a bare no or 2024-07-26 would come back a bool, a date)
                value = [f"{k}={json.dumps(v)}" for k, v in value.items()]
            if not isinstance(value, (list, tuple)):
                value = [value]
            return tuple(coerce(name, item, v) for v in value)
        if tp is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if tp is float:
            number = float(value)
            if not math.isfinite(number):  # no option means anything by nan or inf
                raise ConfigError(f"config key '{name}': {value!r} is not a finite number; "
                                  f"give one, e.g. 1.5")
            return number
        if tp is str:
            if isinstance(value, bool):  # str(False) is "False": a system prompt "True", say
                raise ConfigError(f"config key '{name}': {value} is how YAML reads a bare "
                                  f"yes/no/on/off/true/false, and this key takes text; quote "
                                  f"the word (e.g. \"off\")")
            if isinstance(value, (dict, list)):
                raise ValueError(value)
            return str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        kind = {int: "a whole number", float: "a number", bool: "true or false",
                str: "text"}.get(tp, getattr(tp, "__name__", str(tp)))
        flag = "--" + name.rsplit(".", 1)[-1].replace("_", "-")
        raise ConfigError(f"config key '{name}' ({flag}): cannot read {value!r} as "
                          f"{kind}") from None
    return value


# one dtype, two spellings: the steps that name torch's (eval, regenerate, convert) and those
# that name the short one (capture, export, train) each take the other too
DTYPE_SPELLINGS = {"bf16": "bfloat16", "bfloat16": "bf16", "fp16": "float16",
                   "float16": "fp16", "fp32": "float32", "float32": "fp32"}


def spelled(value, choices):
    """`value` as `choices` spell it: itself, or its other dtype spelling where only that one
    is a choice."""
    other = DTYPE_SPELLINGS.get(value) if isinstance(value, str) else None
    return other if value not in choices and other in choices else value


def accepted(choices) -> tuple:
    """`choices` and the other dtype spelling of each that has one (what argparse takes)."""
    return (*choices, *(DTYPE_SPELLINGS[c] for c in choices
                        if c in DTYPE_SPELLINGS and DTYPE_SPELLINGS[c] not in choices))


def check_choices(config) -> None:
    """Every field of `config` declared with `choices` holds one of them (each item of a tuple
    field; None where the field may be unset), a dtype given in its other spelling (`bfloat16`
    where the choices say `bf16`) being set to the choices' own. The CLI's flags are checked by
    argparse; this is for a YAML file, a pipeline section and a library call, where a typo
    (`optimizer: adam`) would otherwise run another recipe or fail hours later. Each config with
    choices calls it first in its __post_init__."""
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices:
            fixed = (tuple(spelled(v, choices) for v in value) if isinstance(value, tuple)
                     else spelled(value, choices))
            if fixed != value:
                object.__setattr__(config, f.name, fixed)
                value = fixed
        bad = [v for v in (value if isinstance(value, tuple) else (value,))
               if choices and v is not None and v not in choices]
        if bad:
            raise ConfigError(f"--{f.name.replace('_', '-')} {bad[0]!r}: use one of "
                              f"{', '.join(map(str, choices))}")


def from_dict(cls, values: dict[str, Any]):
    """Build config `cls` from a plain dict; unknown keys are an error naming the key."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {unknown} for {cls.__name__}; valid keys: {sorted(names)}"
        )
    hints = field_types(cls)
    kwargs = {k: coerce(k, hints[k], v) for k, v in values.items()}
    missing = [
        f.name for f in dataclasses.fields(cls)
        if f.name not in kwargs and f.default is dataclasses.MISSING
    ]
    if missing:
        first = next(f for f in dataclasses.fields(cls) if f.name == missing[0])
        how = (f"give {missing[0].upper()}" if first.metadata.get("positional")
               else f"give --{missing[0].replace('_', '-')}")
        raise ConfigError(f"{cls.__name__} needs {missing} ({how})")
    return cls(**kwargs)


class _UniqueKeys(yaml.SafeLoader):
    """safe_load's loader, with a key given twice in one mapping refused: YAML keeps the last,
    so a section added again at the end of a config dropped the first one's keys unsaid."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (lines {seen[key]} and "
                                f"{key_node.start_mark.line + 1}): YAML would keep the last one "
                                f"only; merge them", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} "
                          f"{'is a folder' if path.is_dir() else 'does not exist'}; give the "
                          f"path of a YAML file")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeys) or {}
    except yaml.YAMLError as err:
        # safe_load never runs a tag; a `!!python/...` one is refused here, like a syntax error.
        mark = getattr(err, "problem_mark", None)  # absent on some YAMLErrors
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        hint = ("; eyas reads plain YAML only (no !!python tags)" if "!!python" in str(err)
                or "tag:yaml.org,2002:python" in str(err) else "")
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}{hint}"
                          ) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of key: value")
    return data


def to_dict(cfg) -> dict[str, Any]:
    """JSON-friendly dict of a config (tuples become lists)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


# Fields shared by every step that touches the target. Declared through functions so
# each config dataclass stays flat (no inheritance) yet spells them identically.

def target_option(help: str = "target model: hub name, local folder or .gguf file"):
    return required(help)


# device_map words transformers (accelerate) places a target by, besides one device's name
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def check_device_name(value: str | None, flag: str, *, also: tuple[str, ...] = ()) -> None:
    """A device option's value torch can name (cpu, cuda, cuda:N, ...), `also`'s words or None;
    whether that device is here is told when the target loads (targets.models)."""
    if value is None or value in also:
        return
    import torch

    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        words = ", ".join((*also, "cpu", "cuda", "cuda:N"))
        raise ConfigError(f"{flag} {value!r}: torch names no such device; use {words}") from None


def trust_remote_code_option():
    return option(False, "allow the target's own Python code (needed for e.g. Kimi-K2.5)")


def accept_other_weights_option(what: str):
    return option(False, f"accept {what} made with a target of the same tokenizer and shape but "
                         f"other weights (e.g. the same model in another precision or "
                         f"quantization); refused by default, since a fine-tune or another "
                         f"checkpoint has other hidden states")


def revision_option():
    return option(None, "hub revision (branch, tag or commit) of the target")


def out_option(help: str = "output folder"):
    return required(help)
