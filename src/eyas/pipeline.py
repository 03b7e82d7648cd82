"""`eyas run CONFIG.yaml`: the whole pipeline from one file, skipping finished steps.

The YAML holds the shared keys (`target`, `trust_remote_code`, `revision`, `data`,
`work_dir`) and one section per step with that step's own config keys. Steps read and
write fixed folders under `work_dir`; a step is skipped when its folder's manifest was
written with the same config from the same inputs, and every step after the first one
that runs is run again (its inputs changed). Interrupted steps resume by themselves. The
checks of one step's folder are in `eyas.freshness`; here, the plan over them, and the run.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from dataclasses import dataclass
from pathlib import Path

from eyas import freshness
from eyas.config import (ConfigError, check_choices, coerce, from_dict, load_yaml, option,
                         required)
from eyas.errors import EyasError
from eyas.store import locks
from eyas.store.manifest import MANIFEST, peek_manifest, rebaser

log = logging.getLogger(__name__)

# regenerate (optional) comes first: prepare then reads its conversations.jsonl.
STEPS = ("regenerate", "prepare", "capture", "vocab", "train", "export", "eval")
RUN_LOCK = ".eyas-run.lock"  # in work_dir, held by the `eyas run` that runs there
# step -> (module, function, config class)
STEP_FUNCS = {
    "prepare": ("eyas.prepare", "prepare", "PrepareConfig"),
    "regenerate": ("eyas.regenerate", "regenerate", "RegenerateConfig"),
    "capture": ("eyas.capture", "capture", "CaptureConfig"),
    "vocab": ("eyas.vocab", "vocab", "VocabConfig"),
    "train": ("eyas.train", "train", "TrainConfig"),
    "export": ("eyas.export", "export", "ExportConfig"),
    "eval": ("eyas.evaluate", "evaluate", "EvalConfig"),
}
SHARED_KEYS = ("target", "trust_remote_code", "revision")


@dataclass(frozen=True)
class RunConfig:
    """Run the pipeline described by a YAML file."""

    pipeline: str = required("pipeline YAML (target, data, work_dir, one section per step)",
                             positional=True)
    from_step: str | None = option(None, "start at this step (earlier ones must be finished "
                                         "and up to date)", choices=STEPS)
    until_step: str | None = option(None, "stop after this step", choices=STEPS)
    dry_run: bool = option(False, "print what would run and why, run nothing")
    force: bool = option(False, "re-run steps even when their outputs are up to date")
    allow_stale: bool = option(False, "with --from-step: use the outputs of the steps it skips "
                                      "even where they are out of date (a warning names them)")

    def __post_init__(self):
        check_choices(self)
        if self.allow_stale and not self.from_step:
            raise ConfigError("--allow-stale is for --from-step (it lets the steps that one "
                              "skips be out of date); without --from-step every out-of-date "
                              "step runs again: drop --allow-stale")


@dataclass(frozen=True)
class Plan:
    step: str
    config: object
    out: Path
    action: str  # "run" | "skip"
    reason: str
    start_over: bool = False  # train, regenerate: the run in `out` is moved aside first


def _step_config(step: str, spec: dict, work: Path):
    """The step's config: YAML section + shared keys + the fixed folder wiring."""
    module, _, cls_name = STEP_FUNCS[step]
    cls = getattr(importlib.import_module(module), cls_name)
    names = {f.name for f in dataclasses.fields(cls)}
    section = dict(spec.get(step) or {})
    section.pop("enabled", None)
    values = {k: spec[k] for k in SHARED_KEYS if k in spec and k in names}
    out = {s: _out(spec, s, work) for s in STEPS}
    prepared_from = (out["regenerate"] / "conversations.jsonl"
                     if _enabled(spec, "regenerate") else spec.get("data"))
    online = _flag(spec, "train", "online")
    train = spec.get("train") or {}
    dflash = train.get("draft") == "dflash"  # no draft vocabulary; DFlash's taps by default
    taps = {} if not dflash or "aux_layer_ids" in (spec.get("capture") or {}) else \
        {"dflash_taps": coerce("train.dflash_layers", int, train.get("dflash_layers") or 5)}
    # regenerate answers no turn past the length prepare keeps (its own section may say else)
    kept = (spec.get("prepare") or {}).get("max_length")
    # and asks in the template prepare renders with (the openai backend's server should be
    # started with it too: regenerate counts prompt tokens in it)
    template = (spec.get("prepare") or {}).get("chat_template")
    # prepare.eval_fraction 0 leaves the eval split empty: eval's prompts must come from
    # eval.bench or eval.data, and with train's own held-out share 0 too (and no
    # train.eval_data) the run has no best checkpoint, so export takes the last one
    held_out = step not in ("export", "eval") or _fraction(spec, "prepare") > 0
    train_eval = held_out or train.get("eval_data") or _fraction(spec, "train") > 0
    if step == "eval" and not held_out and not section.get("bench") and \
            not section.get("data"):
        raise ConfigError("prepare.eval_fraction is 0, so the prepared data has no eval "
                          "prompts for the eval step: set prepare.eval_fraction above 0, or "
                          "give the eval section its prompts (eval.bench: mt-bench, gsm8k, ...; "
                          "or eval.data: a chat file)")
    wiring = {
        # a regenerated conversation ends at the first turn whose prompt reaches max_length,
        # so its last answer may cross it: kept up to max_length, not dropped whole
        "prepare": {"data": prepared_from, "out": out["prepare"],
                    **({"length_policy": "truncate"} if _enabled(spec, "regenerate") else {})},
        "regenerate": {"data": spec.get("data"), "out": out["regenerate"],
                       **({"max_length": kept} if kept is not None else {}),
                       **({"chat_template": template} if template else {})},
        # overwrite: a re-run after an upstream change replaces the old capture; an interrupted
        # capture with the same settings still resumes. split all: train holds out the eval rows.
        "capture": {"data": out["prepare"], "out": out["capture"], "overwrite": True,
                    "split": "all", **taps},
        "vocab": {"data": (str(out["prepare"]),), "out": out["vocab"]},
        "train": {"data": out["prepare" if online else "capture"],
                  **({} if dflash else {"vocab": out["vocab"]}), "out": out["train"]},
        "export": {"checkpoint": out["train"], "out": out["export"],
                   **({} if train_eval else {"which": "last"})},
        "eval": {"draft": out["export"], "out": out["eval"],
                 **({"data": out["prepare"]} if held_out else {})},
    }[step]
    for key, value in wiring.items():
        if key in names and key not in section:
            values[key] = (tuple(value) if isinstance(value, (list, tuple))
                           else value if isinstance(value, bool) else str(value))
    values.update(section)
    try:
        return from_dict(cls, values)
    except ConfigError as err:
        raise ConfigError(f"section '{step}' of the pipeline: {err}") from None


def _fraction(spec: dict, step: str) -> float:
    """The `eval_fraction` of the prepare or train section, else that step's default."""
    module, _, cls_name = STEP_FUNCS[step]
    fields = dataclasses.fields(getattr(importlib.import_module(module), cls_name))
    value = (spec.get(step) or {}).get("eval_fraction",
                                       next(f.default for f in fields if f.name == "eval_fraction"))
    return coerce(f"{step}.eval_fraction", float, value)


# step -> its output folder under work_dir, unless its section sets `out`
FOLDERS = {"regenerate": "regenerated", "prepare": "prepared", "capture": "captured",
           "vocab": "vocab", "train": "train", "export": "draft", "eval": "eval"}


def _out(spec: dict, step: str, work: Path) -> Path:
    """Where `step` writes: its section's `out` (as the step reads it, from the directory eyas
    runs in), else its fixed folder under work_dir. The steps after it read it from there: a
    section's `out` with the next step still wired to the fixed folder had export take an
    older run left there (or fail on a missing one)."""
    given = (spec.get(step) or {}).get("out")
    return Path(str(given)) if given is not None else work / FOLDERS[step]


def _enabled(spec: dict, step: str) -> bool:
    if step == "regenerate":
        return _flag(spec, "regenerate", "enabled")
    if step == "capture":
        return not _flag(spec, "train", "online")
    return True


def _flag(spec: dict, section: str, key: str) -> bool:
    """A boolean key of a section, read as the step's config reads it: a quoted "false" or
    "no" is False (bool() of the string would be True)."""
    return coerce(f"{section}.{key}", bool, (spec.get(section) or {}).get(key, False))


def _work_dir(cfg: RunConfig, spec: dict) -> Path:
    """The pipeline's work_dir: as given, or relative to the pipeline YAML's folder. One that
    is no path, or a file, is a ConfigError (a TypeError or FileExistsError traceback before)."""
    given = spec["work_dir"]
    if not isinstance(given, str) or not given.strip():
        raise ConfigError(f"pipeline {cfg.pipeline}: work_dir must be a folder path (a string, "
                          f"relative to the YAML's folder), not {given!r}")
    work = Path(given)
    work = work if work.is_absolute() else Path(cfg.pipeline).resolve().parent / work
    file = next((p for p in (work, *work.parents) if p.exists() and not p.is_dir()), None)
    if file is not None:
        raise ConfigError(f"pipeline {cfg.pipeline}: work_dir {work} cannot be a folder: {file} "
                          f"is a file; give work_dir a folder path")
    return work


WANTS = {"target": "a model folder, a .gguf file or a hub name",
         "data": "a chat file, folder or glob, or a list of them"}


def _check_spec(cfg: RunConfig, spec: dict) -> None:
    """The pipeline YAML's keys and sections, refused with the fix where they are wrong."""
    for key in ("target", "data", "work_dir"):
        if key not in spec:
            raise ConfigError(f"pipeline {cfg.pipeline} needs a top-level '{key}' key")
        if key != "work_dir" and spec[key] in (None, "", []):  # (work_dir: _work_dir's own)
            # (a bare `data:` was wired in as the path "None", refused only inside the step,
            # an empty one as prepare's --data, which eyas run has not)
            raise ConfigError(f"pipeline {cfg.pipeline}: top-level '{key}' is empty; give it "
                              f"{WANTS[key]}")
    unknown = set(spec) - {*SHARED_KEYS, "data", "work_dir", *STEPS}
    if unknown:
        raise ConfigError(f"pipeline {cfg.pipeline}: unknown top-level key(s) {sorted(unknown)}; "
                          f"valid: target, trust_remote_code, revision, data, work_dir, {STEPS}")
    for step in STEPS:
        if not isinstance(spec.get(step) or {}, dict):
            raise ConfigError(f"pipeline {cfg.pipeline}: section '{step}' must be a mapping of "
                              f"key: value (the options of `eyas {step}`), not "
                              f"{spec[step]!r}")
        if step != "regenerate" and "enabled" in (spec.get(step) or {}):
            raise ConfigError(f"pipeline {cfg.pipeline}: 'enabled' in section '{step}' would be "
                              f"ignored: only regenerate is optional; to run part of the "
                              f"pipeline use --from-step / --until-step")
    if (spec.get("train") or {}).get("draft") == "dflash" and \
            (spec.get("export") or {}).get("format") == "speculators":
        # (refused by export only after every step before it had run)
        raise ConfigError(f"pipeline {cfg.pipeline}: export.format speculators is not written "
                          f"for DFlash drafts (train.draft: dflash) yet; set export.format: "
                          f"vllm (the same folder serves SGLang's DFLASH)")
    if spec.get("capture") and _flag(spec, "train", "online"):
        # (no capture step runs: its section's layers and dtype were dropped without a word)
        raise ConfigError(f"pipeline {cfg.pipeline}: section 'capture' would be ignored with "
                          f"train.online: true (the target runs inside train, no capture step "
                          f"does); move what it sets into 'train' (aux_layer_ids, "
                          f"online_cache_dtype, target_device_map, ...) and drop it")


def plan(cfg: RunConfig) -> list[Plan]:
    """The pipeline's steps in order, each to run or skip and why; runs nothing (`run` does)."""
    spec = load_yaml(cfg.pipeline)
    _check_spec(cfg, spec)
    work = _work_dir(cfg, spec)
    steps = [s for s in STEPS if _enabled(spec, s)]
    for flag, step in (("--from-step", cfg.from_step), ("--until-step", cfg.until_step)):
        if step and step not in steps:
            raise ConfigError(f"{flag} {step}: this pipeline has no {step} step (its steps: "
                              f"{', '.join(steps)}; regenerate runs only with enabled: true, "
                              f"capture not with train.online: true)")
    if cfg.from_step and cfg.until_step and \
            steps.index(cfg.from_step) > steps.index(cfg.until_step):
        raise ConfigError(f"--from-step {cfg.from_step} comes after --until-step "
                          f"{cfg.until_step}; give steps in pipeline order ({', '.join(steps)})")
    skipped = steps[:steps.index(cfg.from_step)] if cfg.from_step else []
    steps = steps[len(skipped):]
    planned = steps[: steps.index(cfg.until_step) + 1] if cfg.until_step else steps
    configs = {step: _step_config(step, spec, work) for step in planned}
    folders = {step: _out(spec, step, work) for step in steps}
    if skipped:
        _check_skipped(cfg, spec, work, skipped + steps, dict(configs))
    # a step whose folder is gone is skipped while every step that read it is (_removed_after
    # _use); where the plan runs a step that reads it after all (one of those, or one that
    # never ran: eval on prepared/), that step runs too, and the plan is made again from it
    needed: set[str] = set()
    checked: dict[tuple[str, bool], tuple[bool, str]] = {}

    def up_to_date(step: str, upstream_ran: bool) -> tuple[bool, str]:
        # each step checked once per plan (fingerprints, a tokenizer load), whichever pass or
        # look-ahead asks
        if (step, upstream_ran) not in checked:
            if step not in configs:  # past --until-step: a reader the look-ahead found
                configs[step] = _step_config(step, spec, work)
            checked[step, upstream_ran] = freshness.up_to_date(
                configs[step], Path(configs[step].out), upstream_ran)
        return checked[step, upstream_ran]

    def removed_after_use(step: str) -> tuple[list[str], str]:
        # the readers past --until-step count too: captured/ removed once train used it was
        # captured again by `--until-step vocab`, though train was up to date
        later = steps[steps.index(step) + 1:]
        return _removed_after_use(configs[step], later, folders, usable)

    def usable(step: str, upstream_ran: bool) -> tuple[bool, str]:
        # a reader that is up to date, or whose own output was pruned after its readers used
        # it (captured/ and train's checkpoints both removed once the draft was exported)
        ok, why = up_to_date(step, upstream_ran)
        if ok or upstream_ran or step in needed or step in ("export", "eval") or \
                not _gone(step, Path(configs[step].out), why):
            return ok, why
        used, changed = removed_after_use(step)
        return bool(used) and not changed, why

    while True:
        plans, readers = _plan_steps(cfg, planned, configs, needed, up_to_date,
                                     removed_after_use)
        runs = [p.config for p in plans if p.action == "run"]
        again = {step for step in readers
                 if any(_reads(run_cfg, folders[step]) for run_cfg in runs)} - needed
        if not again:
            return plans
        needed |= again


def _plan_steps(cfg: RunConfig, steps: list[str], configs: dict, needed: set[str],
                up_to_date, removed_after_use) -> tuple[list[Plan], dict[str, list[str]]]:
    """One pass of the plan: each step run or skipped, in order; and the steps skipped as
    removed after use, with the steps that read them. `needed`: steps that run even so;
    `up_to_date(step, upstream_ran)`: freshness.up_to_date of that step's config;
    `removed_after_use(step)`: _removed_after_use of that step's config."""
    plans, readers, upstream_ran = [], {}, False
    for step in steps:
        step_cfg = configs[step]
        out = Path(step_cfg.out)
        if cfg.force or (cfg.from_step == step):
            ok, why = False, "forced" if cfg.force else "--from-step"
        else:
            ok, why = up_to_date(step, upstream_ran)
            if not ok and not upstream_ran and _gone(step, out, why) and step not in needed:
                used, changed = removed_after_use(step)
                why = changed or why
                if used and not changed:
                    readers[step] = used
                    ok, why = True, (
                        f"its output was removed after {' and '.join(used)} used it, which "
                        f"{'is' if len(used) == 1 else 'are'} up to date (it runs again when "
                        f"{'that step' if len(used) == 1 else 'one of them'} must)")
        again = "" if ok or step not in ("train", "regenerate") else \
            freshness.starts_over(step, step_cfg, out, upstream_ran,
                                  cfg.force or cfg.from_step == step)
        if again:
            why += f"; {step} starts over ({again}), the old run moved to {_aside(out).name}"
        elif step == "capture" and not ok and any(out.glob("shard-*")):
            # capture runs with overwrite (its wiring): said here, since it can be TBs
            why += ("; an earlier capture there made from other inputs or settings is deleted "
                    "first (one interrupted with the same ones resumes)")
        plans.append(Plan(step, step_cfg, out, "skip" if ok else "run", why, bool(again)))
        upstream_ran = upstream_ran or not ok
    return plans, readers


def _gone(step: str, out: Path, why: str) -> bool:
    """Whether a step that is not up to date (`why`) has its output removed: its folder, or
    files of an intermediate step's (pruned after use; the draft and the report are what a
    run is for, made again where gone)."""
    return not out.exists() or (why.startswith(freshness.LOST)
                                and step not in ("export", "eval"))


def _removed_after_use(step_cfg, later: list[str], folders: dict[str, Path],
                       up_to_date) -> tuple[list[str], str]:
    """The steps after a step whose folder is gone that read it (their manifests name it as
    an input), where each is up to date by itself, e.g. captured/ (often terabytes) deleted
    once train used it; [] where none read it or one of them must run. And why the step runs
    all the same ("" if not): its config or data changed since they read it. The plan then checks
    that none of them runs for another reason (an earlier step that runs). `later` goes past
    --until-step: a reader there is one all the same."""
    readers = _readers(Path(step_cfg.out), later, folders)
    if not all(up_to_date(name, False)[0] for name in readers):
        return [], ""
    return list(readers), _edited_since_read(step_cfg, readers)


def _readers(out: Path, later: list[str], folders: dict[str, Path]) -> dict[str, dict]:
    """The steps of `later` whose manifests name folder `out` as an input, each with its
    record of that input (step, id, path, and the config that run had: manifest._input)."""
    found = {}
    for name in later:
        manifest = peek_manifest(folders[name]) or {}
        move = rebaser(manifest, folders[name])  # (a work_dir moved since)
        read = next((i for i in manifest.get("inputs") or []
                     if i.get("path") and Path(move(i["path"])).resolve() == out.resolve()),
                    None)
        if read is not None:
            found[name] = read
    return found


def _edited_since_read(step_cfg, readers: dict[str, dict]) -> str:
    """Why a step whose folder is gone is out of date all the same ("" if it is not): its
    section, or the chat data it read, was edited since one of `readers` (_readers) read its
    output; with the folder gone, only their records of it tell. A record without a config or
    data_files (a manifest written before eyas kept them) tells nothing: taken as unchanged."""
    for name, read in readers.items():
        why = freshness.changes_since_read(step_cfg, read)
        if why:
            return f"{why} since {name} read its output, which has been removed"
    return ""


# the options by which _step_config wires a step to the folders of the steps before it
INPUT_KEYS = ("data", "vocab", "checkpoint", "draft")


def _reads(step_cfg, folder: Path) -> bool:
    """Whether a step run with `step_cfg` reads `folder`: one of its INPUT_KEYS names that
    folder or a file in it (prepare's data: regenerated/conversations.jsonl; vocab's is a
    tuple of folders)."""
    folder = folder.resolve()
    for field in dataclasses.fields(step_cfg):
        value = getattr(step_cfg, field.name)
        paths = value if isinstance(value, tuple) else (value,)
        if field.name in INPUT_KEYS and any(isinstance(p, str) and p and
                                            Path(p).resolve().is_relative_to(folder)
                                            for p in paths):
            return True
    return False


def _check_skipped(cfg: RunConfig, spec: dict, work: Path, steps: list[str],
                   running: dict) -> None:
    """--from-step skips the steps before it (`steps`: the pipeline's steps; `running`: the
    configs of those that run, by step). Each must have finished its folder, or the started
    step fails on a missing input, naming an option the pipeline sets; a folder removed after
    use (_removed_for_from_step) passes where no step that runs reads it. And each must be up
    to date, one the plan would not run again, or the started step silently works on an old
    output (prepared rows from before an edit of prepare's section). --allow-stale takes the
    old outputs anyway, with a warning; it does not stand in for a removed folder."""
    start = cfg.from_step
    folders = {step: _out(spec, step, work) for step in steps}
    for n, step in enumerate(steps[:steps.index(start)]):
        step_cfg = _step_config(step, spec, work)
        out = Path(step_cfg.out)
        if not out.exists():
            current, why = _removed_for_from_step(cfg, step_cfg, step, steps[n + 1:], folders,
                                                  running)
        else:
            done = freshness.read_step_manifest(out) if (out / MANIFEST).is_file() else None
            if done is None or done.get("complete") is False:
                raise _unfinished(start, step, out)
            # each on its own manifest: with --allow-stale, a later one is not stale only
            # because an earlier one is
            current, why = freshness.up_to_date(step_cfg, out, upstream_ran=False)
        if current:
            continue
        used = f"its old output in {out}" if out.exists() else \
            "what the steps after it made from its removed output"
        if cfg.allow_stale:
            log.warning("--allow-stale: %s is out of date (%s); %s is used as it is", step, why,
                        used)
            continue
        raise EyasError(f"--from-step {start} skips {step}, which is out of date: {why}. "
                        f"--from-step would use {used} as it is. To bring it up to date, run "
                        f"without --from-step (the plan runs {step} again and the steps after "
                        f"it) or with --from-step {step}; to use the old output anyway, add "
                        f"--allow-stale.", flag="--from-step")


def _removed_for_from_step(cfg: RunConfig, step_cfg, step: str, later: list[str],
                           folders: dict[str, Path], running: dict) -> tuple[bool, str]:
    """A step --from-step skips whose folder is gone: refused (ConfigError) where no later
    manifest names it as an input (it may never have finished), or where a step that runs
    reads it, --allow-stale or not (there is no old output to take as it is); else whether it
    is up to date, and why not (_edited_since_read: its section changed since it was read)."""
    out = Path(step_cfg.out)
    readers = _readers(out, later, folders)
    if not readers:
        raise _unfinished(cfg.from_step, step, out)
    needs = next((name for name, run_cfg in running.items() if _reads(run_cfg, out)), None)
    if needs is not None:
        raise ConfigError(f"--from-step {cfg.from_step} skips {step}, whose output {out} was "
                          f"removed, but {needs}, which runs, reads it: use --from-step {step} "
                          f"to make it again (the steps after it run too). --allow-stale does "
                          f"not apply: it uses an old output as it is, and this one is gone.")
    why = _edited_since_read(step_cfg, readers)
    return not why, why or "up to date"


def _unfinished(start: str, step: str, out: Path) -> ConfigError:
    """--from-step's refusal of a skipped step that has no finished output."""
    return ConfigError(f"--from-step {start} skips {step}, which has not finished in {out}; run "
                       f"without --from-step (the pipeline runs what is missing or changed), "
                       f"or --until-step {step} first")


def _aside(out: Path) -> Path:
    """Where a run that starts over moves its earlier one: `NAME.previous`, or where that is
    taken `NAME.previous-2`, -3, ...: an earlier generation may be the one whose config comes
    back (a regenerated corpus costs hours), so none is deleted."""
    aside, n = out.with_name(out.name + ".previous"), 1
    while aside.exists():
        n += 1
        aside = out.with_name(f"{out.name}.previous-{n}")
    return aside


def run(cfg: RunConfig) -> list[Plan]:
    """Run (or with dry_run, describe) the pipeline; returns the plan that was executed."""
    spec = load_yaml(cfg.pipeline)
    if "work_dir" not in spec:
        return _run(cfg)  # plan() says what is missing
    work = _work_dir(cfg, spec)
    running = locks.holder(work / RUN_LOCK)
    if cfg.dry_run:
        if running:  # (its steps under way show as interrupted or not finished)
            log.warning("another `eyas run` (process %s) is running the pipeline in %s: the "
                        "plan below reads folders it is writing", running, work)
        return _run(cfg)
    # one `eyas run` at a time in a work_dir, planning included: a second one would plan from
    # folders the first is writing, then run the same steps into them
    busy = (f"another `eyas run` (process {running or 'id in ' + str(work / RUN_LOCK)}) is "
            f"running the pipeline in {work}; wait for it to end or stop it (its steps "
            f"resume), or give this pipeline another work_dir")
    with locks.exclusive(work / RUN_LOCK, busy):
        return _run(cfg)


def _run(cfg: RunConfig) -> list[Plan]:
    plans = plan(cfg)
    for p in plans:
        log.info("%-10s %-4s  %s  -> %s", p.step, p.action, p.reason, p.out)
    if cfg.dry_run:
        return plans
    for p in plans:
        if p.action == "skip":
            continue
        module, fn, _ = STEP_FUNCS[p.step]
        log.info("== eyas %s ==", p.step)
        if p.start_over:  # (see freshness.starts_over)
            aside = _aside(p.out)
            p.out.rename(aside)
            log.info("%s: the earlier run moved to %s", p.step, aside)
        try:
            getattr(importlib.import_module(module), fn)(p.config)
        except EyasError as err:
            # a refused --out or --resume: the pipeline set them, so say where and how
            hint = (f" (In `eyas run` this step's --out is {p.out}: to start it over, move "
                    f"that folder away, or set the flag in the pipeline's '{p.step}' section.)"
                    if err.flag in ("--out", "--resume") else "")
            raise EyasError(f"step {p.step} failed: {err}{hint}") from err
    return plans
