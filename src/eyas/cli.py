"""The `eyas` command line: one table maps each subcommand to its step function and config.

Flags, types, defaults and help all come from the config dataclass fields
(see `eyas.config.option`). `--config FILE.yaml` works for every step; flags given
on the command line override the file.
"""

from __future__ import annotations

import argparse
import errno
import dataclasses
import importlib
import logging
import os
import re
import signal
import sys
import typing

from eyas import __version__
from eyas.config import (ConfigError, FlagValues, accepted, base_type, field_types, from_dict,
                         load_yaml)
from eyas.errors import EyasError, LosslessError

# subcommand -> (module, step function, config class, one-line summary)
COMMANDS = {
    "prepare": ("eyas.prepare", "prepare", "PrepareConfig",
                "chat data -> token ids + assistant-only loss masks"),
    "regenerate": ("eyas.regenerate", "regenerate", "RegenerateConfig",
                   "rewrite assistant turns with the target itself"),
    "capture": ("eyas.capture", "capture", "CaptureConfig",
                "run the target, store aux hidden states for training"),
    "vocab": ("eyas.vocab", "vocab", "VocabConfig",
              "draft vocabulary (d2t / t2d) from token counts"),
    "train": ("eyas.train", "train", "TrainConfig",
              "train an EAGLE-3 draft (training-time test) or a DFlash one (--draft dflash)"),
    "export": ("eyas.export", "export", "ExportConfig",
               "write a draft folder vLLM / SGLang load as is"),
    "eval": ("eyas.evaluate", "evaluate", "EvalConfig",
             "measure acceptance length with speculative decoding"),
    "doctor": ("eyas.doctor", "doctor", "DoctorConfig",
               "will this model work, and what must change"),
    "convert": ("eyas.convert", "convert", "ConvertConfig",
                "de-quantize a .gguf target once into a Hugging Face folder"),
    "run": ("eyas.pipeline", "run", "RunConfig",
            "run the whole pipeline from one YAML, resuming"),
    "demo": ("eyas.demo", "demo", "DemoConfig",
             "the whole pipeline on CPU with a built-in tiny target"),
}


# what running a stopped command again does
RESUMES = "run the same command again to resume where it stopped"
AGAIN = {"eval": "eval does not resume: run it again to measure from the start (a report "
                 "already in --out is left as it was meanwhile)",
         "doctor": "run it again",
         "convert": "convert does not resume: run it again to convert from the start "
                    "(--out is written only once the conversion is whole)",
         "prepare": "prepare does not resume: run it again to prepare from the start (an "
                    "earlier output in --out is left as it was meanwhile)",
         "demo": "run it again: a target stopped while it trained is trained again from its "
                 "first step, and the pipeline after it resumes where it stopped"}


def _load(command: str):
    module, fn, cls, _ = COMMANDS[command]
    mod = importlib.import_module(module)
    return getattr(mod, fn), getattr(mod, cls)


class _Repeated(argparse.Action):
    """A list flag given more than once adds to its list (`--data a --data b` is `--data a,b`,
    each value read as the flag's one value is, a path with a space in it included):
    argparse's own store kept the last one alone, dropping the data before it unsaid."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if before is None else
                FlagValues([*(before if isinstance(before, FlagValues) else [before]), values]))


def _add_field(parser: argparse.ArgumentParser, f: dataclasses.Field, tp) -> None:
    help_text = f.metadata.get("help", "")
    tp, _ = base_type(tp)
    default = None if f.default is dataclasses.MISSING else f.default
    if default is not None and default != ():
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        help_text += f" (default: {shown})"  # as the flag takes it: 0.9,0.999, not a tuple
    elif f.default is dataclasses.MISSING:
        # a positional is optional to argparse only because --config FILE may give it
        help_text += " (required; or in --config)" if f.metadata.get("positional") else \
            " (required)"
    kwargs: dict = {"help": help_text, "default": argparse.SUPPRESS}
    if f.metadata.get("choices"):
        kwargs["choices"] = accepted(f.metadata["choices"])  # the config spells a dtype its way
    if tp is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(tp) is tuple:
        kwargs["metavar"] = "A,B,..."
        kwargs["action"] = _Repeated
    if f.metadata.get("positional"):
        kwargs.pop("default")
        parser.add_argument(f.name, nargs="?", default=argparse.SUPPRESS,
                            **{k: v for k, v in kwargs.items() if k != "action"})
        return
    parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kwargs)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported (so one step's import cost or
    missing optional dependency never affects another step)."""
    parser = argparse.ArgumentParser(
        prog="eyas", description="Train EAGLE-3 draft models for any Hugging Face LLM.")
    parser.add_argument("--version", action="version", version=f"eyas {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, _, summary) in COMMANDS.items():
        sp = sub.add_parser(name, help=summary, description=summary)
        sp.add_argument("--config", dest="_config_file", metavar="FILE.yaml", default=None,
                        help="read settings from a YAML file; flags given here override it")
        # also after the command (`eyas doctor MODEL -v`); SUPPRESS keeps one given before it
        sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="debug logging")
        sp.set_defaults(_parser=sp)  # a wrong flag is answered with this command's usage
        if name != command:
            continue
        try:
            _, cls = _load(name)
        except ImportError as err:  # a step whose optional dependency is missing
            sp.set_defaults(_unavailable=str(err))
            continue
        hints = field_types(cls)
        for f in dataclasses.fields(cls):
            _add_field(sp, f, hints[f.name])
    return parser


def _command_of(argv: list[str]) -> str | None:
    return next((a for a in argv if a in COMMANDS), None)


def parse_config(command: str, argv: list[str]):
    """Parse `argv` (without the subcommand) into the step's config object."""
    parser = build_parser(command)
    args = parser.parse_args(_negative_values(parser, [command, *argv]))
    return _config_from_args(command, args)


NEGATIVE = re.compile(r"-\d[\d.eE+-]*(,-?\d[\d.eE+-]*)+")  # -1,2,4 (a single -1 argparse takes)


def _negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--aux-layer-ids -1,2,4` as `--aux-layer-ids=-1,2,4`: argparse reads a value that
    starts with '-' and is not one number as a flag, and answers "expected one argument"."""
    takes_value = {o for sp in _subparsers(parser) for a in sp._actions
                   if a.nargs is None and a.option_strings for o in a.option_strings}
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in takes_value and NEGATIVE.fullmatch(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(p for a in subs for p in a.choices.values())]


def _config_from_args(command: str, args: argparse.Namespace):
    _, cls = _load(command)
    values = load_yaml(args._config_file) if args._config_file else {}
    if command == "run" and {"target", "work_dir"} & set(values):
        raise ConfigError(f"{args._config_file} is a pipeline YAML: give it as the argument, "
                          f"`eyas run {args._config_file}` (--config takes `eyas run`'s own "
                          f"options, such as until_step or dry_run)")
    cli = {k: v for k, v in vars(args).items()
           if not k.startswith("_") and k not in ("command", "verbose")}
    values.update(cli)
    return from_dict(cls, values)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_of(argv))
    args, extra = parser.parse_known_args(_negative_values(parser, argv))
    if extra:  # answered by the command's own parser: its usage, and the flag meant
        _unrecognized(getattr(args, "_parser", parser), extra)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    if not args.command:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(f"eyas {args.command} is not available: {args._unavailable}", file=sys.stderr)
        return 2
    fn, _ = _load(args.command)
    before = _say_on_sigterm(args.command)
    try:
        # (a bad EYAS_TARGET_SDPA refused now, not after a target has loaded)
        from eyas.targets.sdpa import target_sdpa_choice
        target_sdpa_choice()
        cfg = _config_from_args(args.command, args)
        result = fn(cfg)
    except (ConfigError, EyasError) as err:
        print(f"eyas {args.command}: error: {err}", file=sys.stderr)
        return _exit_code(err)
    except KeyboardInterrupt:  # Ctrl-C: what was written stays, and every step resumes
        print(f"eyas {args.command}: interrupted; {AGAIN.get(args.command, RESUMES)}",
              file=sys.stderr)
        return 130
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # a full disk (or quota) wherever it is met, a state file's write as a part's: one
        # line with the way on, not a traceback
        where = f" ({err.filename})" if getattr(err, "filename", None) else ""
        print(f"eyas {args.command}: error: no space left on the device{where}: "
              f"{os.strerror(err.errno)}. Free some space (or give another --out on a disk "
              f"with room), then {AGAIN.get(args.command, RESUMES)}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, before)
    if args.command == "doctor" and isinstance(result, dict) and result.get("ok") is False:
        return 1  # it listed a problem: a script or CI step that runs it stops here
    return 0


def _say_on_sigterm(command: str):
    """SIGTERM (a scheduler's preemption, `kill`) ended a step with no word (exit 143): say
    that it stopped and how to go on, then end as SIGTERM does (every step resumes after a
    kill, so the same command goes on from there). `eyas train` installs its own handlers
    while it trains (it saves the step under way first). Returns the handler it replaced."""
    def stopped(signum, frame):
        print(f"eyas {command}: stopped by SIGTERM; {AGAIN.get(command, RESUMES)}",
              file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    return signal.signal(signal.SIGTERM, stopped)


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exit 2 with `parser`'s usage, naming the arguments it does not take and, for a
    misspelt flag, the ones it may have meant."""
    import difflib

    flags = [o for a in parser._actions for o in a.option_strings]
    hints = [f"{x} (did you mean {', '.join(close)}?)" if close else x
             for x in extra
             for close in [difflib.get_close_matches(x.split("=")[0], flags, n=2, cutoff=0.75)
                           if x.startswith("--") else []]]
    parser.error(f"unrecognized arguments: {' '.join(hints)}")


def _exit_code(err: BaseException | None) -> int:
    """LosslessError's own code, also when `eyas run` wraps it (`raise ... from err`); else 2."""
    while err is not None:
        if isinstance(err, LosslessError):
            return err.exit_code
        err = err.__cause__
    return 2

