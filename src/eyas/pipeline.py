"""`eyas run CONFIG.yaml`: the whole pipeline from one file, skipping finished steps.

The YAML holds the shared keys (`target`, `trust_remote_code`, `revision`, `data`,
`work_dir`) and one section per step with that step's own config keys. Steps read and
write fixed folders under `work_dir`; a step is skipped when its folder's manifest was
written with the same config from the same inputs, and every step after the first one
that runs is run again (its inputs changed). Interrupted steps resume by themselves.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from eyas.config import (ConfigError, check_choices, coerce, from_dict, load_yaml, option,
                         required, to_dict)
from eyas.errors import EyasError
from eyas.store import locks
from eyas.store.manifest import MANIFEST, peek_manifest, read_manifest

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
    wiring = {
        "prepare": {"data": prepared_from, "out": out["prepare"]},
        "regenerate": {"data": spec.get("data"), "out": out["regenerate"],
                       **({"max_length": kept} if kept is not None else {})},
        # overwrite: a re-run after an upstream change replaces the old capture; an interrupted
        # capture with the same settings still resumes. split all: train holds out the eval rows.
        "capture": {"data": out["prepare"], "out": out["capture"], "overwrite": True,
                    "split": "all", **taps},
        "vocab": {"data": (str(out["prepare"]),), "out": out["vocab"]},
        "train": {"data": out["prepare" if online else "capture"],
                  **({} if dflash else {"vocab": out["vocab"]}), "out": out["train"]},
        "export": {"checkpoint": out["train"], "out": out["export"]},
        "eval": {"draft": out["export"], "data": out["prepare"], "out": out["eval"]},
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


def _normalise(value):
    """`value` (a step config, or one option's value) as its manifest stores it: JSON."""
    return json.loads(json.dumps(to_dict(value) if dataclasses.is_dataclass(value) else value,
                                 default=str))


def _up_to_date(cfg, out: Path, upstream_ran: bool) -> tuple[bool, str]:
    path = out / MANIFEST
    if upstream_ran:
        return False, "an earlier step ran, so its inputs changed"
    if not path.is_file():
        return False, "no finished output yet (or it was interrupted: the step resumes)"
    manifest = _manifest(out)
    # a change first: an interrupted run with other settings may not resume (_starts_over)
    changed = _config_changes(cfg, manifest)
    if changed:
        return False, f"config changed ({', '.join(changed)})"
    swapped = _target_changes(cfg, manifest) or _template_changes(cfg, manifest)
    if swapped:
        return False, swapped
    try:
        moved = _data_changes(cfg, manifest, out)
    except EyasError as err:
        moved = f"it cannot be read: {err}"
    if moved:
        return False, f"its input data changed ({moved})"
    replaced = _input_changes(manifest)
    if replaced:
        return False, replaced
    if manifest.get("complete") is False:
        return False, "the previous run was interrupted: the step resumes"
    # the files the manifest lists (export's draft): one deleted since left a broken draft
    # that every later plan called up to date
    gone = [f for f in manifest.get("files") or () if not (out / f).exists()]
    if gone:
        return False, f"its output lost {', '.join(sorted(gone))} since it ran"
    return True, "up to date"


def _manifest(out: Path) -> dict:
    """The manifest of a step's folder, or EyasError naming it where it is damaged (a JSON
    traceback before, --dry-run included) and how the pipeline gets past it."""
    try:
        return read_manifest(out)
    except EyasError as err:
        raise EyasError(f"{err} In `eyas run`, move {out} away (or delete it): the plan then "
                        f"runs that step again.") from None


def _target_changes(cfg, manifest: dict) -> str:
    """Why the step's target is not the one its manifest recorded ("" if it is): the same path
    with other weights (a GGUF replaced, a folder fine-tuned in place) would keep every config
    equal, and the next step would refuse the old outputs; or no fingerprint can be made
    from here to tell."""
    from eyas.store.manifest import target_record

    name = getattr(cfg, "target", None)
    was = manifest.get("target") or {}
    keys = [k for k in ("gguf_fingerprint", "weights_fingerprint") if was.get(k)]
    if not name or not keys:
        return ""
    now = target_record(str(name), getattr(cfg, "revision", None))
    if not any(now.get(k) for k in keys):
        # nothing to fingerprint here: a path that does not resolve from this directory (a
        # relative target, and eyas run from elsewhere), or a hub model not in the cache
        where = "" if Path(str(name)).expanduser().exists() else \
            f"; {name} does not exist from {Path.cwd()} (the target and data paths resolve " \
            f"from the directory eyas runs in, work_dir from the YAML's)"
        return f"its target cannot be checked against the one it ran with{where}"
    return next((f"the target's weights changed ({k} {was[k]} -> {now.get(k)})" for k in keys
                 if now.get(k) != was[k]), "")


def _template_changes(cfg, manifest: dict) -> str:
    """For prepare, why the chat template it renders with now is not the one its manifest
    recorded ("" if it is): a `chat_template` file, or the target folder's own template,
    edited in place keeps every config equal, and the prepared rows stay rendered with the old
    one (`eyas prepare` run by itself prepares again; the plan skipped it)."""
    if manifest.get("step") != "prepare" or not manifest.get("chat_template_hash"):
        return ""
    from eyas.prepare import load_tokenizer
    from eyas.store.manifest import chat_template_fingerprint
    from eyas.targets.gguf import is_gguf

    if is_gguf(cfg.target) and not cfg.chat_template and not cfg.tokenizer:
        return ""  # its template is in the file (_target_changes: gguf_fingerprint), whose
        # parse would cost every plan seconds

    was = manifest["chat_template_hash"]
    try:
        now = chat_template_fingerprint(load_tokenizer(cfg))
    except EyasError as err:
        return f"its chat template cannot be checked against the one it ran with ({err})"
    return "" if now == was else f"its chat template changed (chat_template_hash {was} -> {now})"


def _input_changes(manifest: dict) -> str:
    """Why the output folders a step read are not the ones it ran on ("" if they are): a
    step re-run alone (`--until-step prepare` after its data changed) leaves the steps after
    it made from its old output. An input folder without a manifest is left to the plan (its
    step runs: no finished output)."""
    for item in manifest.get("inputs") or []:
        now = peek_manifest(item.get("path") or "")
        if item.get("path") and now is not None and now.get("id") != item.get("id"):
            return f"its input from {item.get('step')} changed since it ran ({item['path']})"
    return ""


def _data_changes(cfg, manifest: dict, folder: Path) -> str:
    """For a step that records what its chat data held (prepare, regenerate: `data_files`),
    the first file whose content is not what it was then ("" if none): the same path with
    other rows is other data. EyasError if the data cannot be read. A file whose stamp moved
    with its content the same gets its new stamp recorded in `folder`'s manifest, so it is
    read once, not at every plan until the step runs again."""
    if "data_files" not in manifest or not getattr(cfg, "data", None):
        return ""
    from eyas.store.manifest import data_content
    from eyas.targets.chat import source_fingerprints

    recorded = manifest["data_files"] or []  # files at their recorded size and mtime: not read
    fresh = _normalise(source_fingerprints(cfg.data, recorded))
    _remember_stamps(folder, manifest, fresh)
    now = data_content(fresh)
    was = {json.dumps(x, sort_keys=True) for x in data_content(recorded)}
    moved = [x.get("path") for x in now if json.dumps(x, sort_keys=True) not in was]
    if not moved and len(now) != len(was):
        return "a file of it is gone"
    return f"{moved[0]} differs" if moved else ""


def _remember_stamps(folder: Path, manifest: dict, fresh: list[dict]) -> None:
    """Best effort (see store.manifest.restamp_data): a folder that cannot be written only
    has its touched files read again at the next plan. --dry-run writes these stamps too:
    they say when to read a file, not what the step ran on."""
    from eyas.store.manifest import restamp_data

    try:
        if restamp_data(folder, manifest.get("id"), fresh):
            log.debug("%s: recorded the new stamps of data files read unchanged", folder)
    except OSError as err:
        log.info("cannot record data file stamps in %s (%s): they are read again next time",
                 folder, err)


def _config_changes(cfg, manifest: dict) -> list[str]:
    """The options of `cfg` that differ from those the manifest's run was made with."""
    old, new = manifest.get("config") or {}, _normalise(cfg)
    # an option the step gained since (no key in the manifest) is a change only if set now
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)
                if f.default is not dataclasses.MISSING}
    gained = {k for k, v in new.items()
              if k not in old and k in defaults and v == _normalise(defaults[k])}
    return sorted(k for k in set(old) | set(new) if k not in gained and old.get(k) != new.get(k))


def _starts_over(step: str, cfg, out: Path, upstream_ran: bool, forced: bool) -> str:
    """Why a train or regenerate step that runs must not resume the run in `out` ("" if it
    may). The pipeline moves such a run aside first (`run`).

    train: a finished run re-run (its config or inputs changed, or --force) would resume at
    its last step and train nothing, and an interrupted one resumed on other inputs or
    settings would mix them. regenerate: its own check refuses to resume on other data or
    generation settings (store.regenerate_output.SAME_ON_RESUME), and a forced run would
    generate nothing; other changes (a raised --limit, --retry-rejects, the backend) resume."""
    path = out / MANIFEST
    if not path.is_file():
        return ""
    if upstream_ran:
        return "its inputs changed"
    manifest = _manifest(out)
    if manifest.get("step") != step:
        return ""  # not this step's folder: the step's own --out check refuses it
    if step == "regenerate":
        return _regenerate_starts_over(cfg, manifest, out, forced)
    changed = _config_changes(cfg, manifest)
    if changed:
        return f"its config changed ({', '.join(changed)})"
    replaced = _input_changes(manifest)
    if replaced:
        return replaced
    if manifest.get("complete") is not False:
        return "forced" if forced else "it finished"
    return ""


def _regenerate_starts_over(cfg, manifest: dict, out: Path, forced: bool) -> str:
    from eyas.store.regenerate_output import setting_changes

    changed = setting_changes(cfg, manifest)
    if changed:
        return f"its config changed ({', '.join(changed)})"
    # other weights behind the same target: its resume refuses them (two models' answers)
    swapped = _target_changes(cfg, manifest)
    if swapped.startswith("the target's weights changed"):
        return swapped
    try:
        moved = _data_changes(cfg, manifest, out)
    except EyasError:
        return ""  # the step says what is wrong with its data; its output stays where it is
    if moved:
        return f"its input data changed ({moved})"
    return "forced" if forced else ""


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


def plan(cfg: RunConfig) -> list[Plan]:
    spec = load_yaml(cfg.pipeline)
    for key in ("target", "data", "work_dir"):
        if key not in spec:
            raise ConfigError(f"pipeline {cfg.pipeline} needs a top-level '{key}' key")
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
    if cfg.from_step:
        _check_skipped(steps[:steps.index(cfg.from_step)], spec, work, cfg)
        steps = steps[steps.index(cfg.from_step):]
    if cfg.until_step:
        steps = steps[: steps.index(cfg.until_step) + 1]
    configs = {step: _step_config(step, spec, work) for step in steps}
    # a step whose folder is gone is skipped while every step that read it is (_removed_after
    # _use); where the plan runs one of those after all, that step runs too, and the plan is
    # made again from it
    needed: set[str] = set()
    checked: dict[tuple[str, bool], tuple[bool, str]] = {}

    def up_to_date(step: str, upstream_ran: bool) -> tuple[bool, str]:
        # each step checked once per plan (fingerprints, a tokenizer load), whichever pass or
        # look-ahead asks
        if (step, upstream_ran) not in checked:
            checked[step, upstream_ran] = _up_to_date(configs[step], Path(configs[step].out),
                                                      upstream_ran)
        return checked[step, upstream_ran]

    while True:
        plans, readers = _plan_steps(cfg, steps, configs, needed, up_to_date)
        runs = {p.step for p in plans if p.action == "run"}
        again = {step for step, used in readers.items() if set(used) & runs} - needed
        if not again:
            return plans
        needed |= again


def _plan_steps(cfg: RunConfig, steps: list[str], configs: dict, needed: set[str],
                up_to_date) -> tuple[list[Plan], dict[str, list[str]]]:
    """One pass of the plan: each step run or skipped, in order; and the steps skipped as
    removed after use, with the steps that read them. `needed`: steps that run even so;
    `up_to_date(step, upstream_ran)`: _up_to_date of that step's config."""
    plans, readers, upstream_ran = [], {}, False
    for i, step in enumerate(steps):
        step_cfg = configs[step]
        out = Path(step_cfg.out)
        if cfg.force or (cfg.from_step == step):
            ok, why = False, "forced" if cfg.force else "--from-step"
        else:
            ok, why = up_to_date(step, upstream_ran)
            if not ok and not upstream_ran and not out.exists() and step not in needed:
                used = _removed_after_use(out, steps[i + 1:], configs, up_to_date)
                if used:
                    readers[step] = used
                    ok, why = True, (
                        f"its output was removed after {' and '.join(used)} used it, which "
                        f"{'is' if len(used) == 1 else 'are'} up to date (it runs again when "
                        f"{'that step' if len(used) == 1 else 'one of them'} must)")
        again = "" if ok or step not in ("train", "regenerate") else \
            _starts_over(step, step_cfg, out, upstream_ran, cfg.force or cfg.from_step == step)
        if again:
            why += f"; {step} starts over ({again}), the old run moved to {_aside(out).name}"
        elif step == "capture" and not ok and any(out.glob("shard-*")):
            # capture runs with overwrite (its wiring): said here, since it can be TBs
            why += ("; an earlier capture there made from other inputs or settings is deleted "
                    "first (one interrupted with the same ones resumes)")
        plans.append(Plan(step, step_cfg, out, "skip" if ok else "run", why, bool(again)))
        upstream_ran = upstream_ran or not ok
    return plans, readers


def _removed_after_use(out: Path, later: list[str], configs: dict, up_to_date) -> list[str]:
    """The steps after a step whose folder `out` is gone that read it (their manifests name it
    as an input), where each is up to date by itself, e.g. captured/ (often terabytes)
    deleted once train used it; [] where none read it or one of them must run. The plan then
    checks that none of them runs for another reason (an earlier step that runs)."""
    readers = []
    for name in later:
        manifest = peek_manifest(configs[name].out) or {}
        if any(i.get("path") and Path(i["path"]).resolve() == out.resolve()
               for i in manifest.get("inputs") or []):
            if not up_to_date(name, False)[0]:
                return []
            readers.append(name)
    return readers


def _check_skipped(earlier: list[str], spec: dict, work: Path, cfg: RunConfig) -> None:
    """--from-step skips the steps before it. Each must have finished its folder, or the
    started step fails on a missing input, naming an option the pipeline sets; and each must
    be up to date, one the plan would not run again, or the started step silently works on
    an old output (prepared rows from before an edit of prepare's section). --allow-stale
    takes the old outputs anyway, with a warning."""
    start = cfg.from_step
    for step in earlier:
        step_cfg = _step_config(step, spec, work)
        out = Path(step_cfg.out)
        done = _manifest(out) if (out / MANIFEST).is_file() else None
        if done is None or done.get("complete") is False:
            raise ConfigError(f"--from-step {start} skips {step}, which has not finished in "
                              f"{out}; run without --from-step (the pipeline runs what is "
                              f"missing or changed), or --until-step {step} first")
        # each on its own manifest: with --allow-stale, a later one is not stale only
        # because an earlier one is
        current, why = _up_to_date(step_cfg, out, upstream_ran=False)
        if current:
            continue
        if cfg.allow_stale:
            log.warning("--allow-stale: %s is out of date (%s); its output in %s is used as "
                        "it is", step, why, out)
            continue
        raise EyasError(f"--from-step {start} skips {step}, which is out of date: {why}. Its "
                        f"old output in {out} would be used as it is. To bring it up to date, "
                        f"run without --from-step (the plan runs {step} again and the steps "
                        f"after it) or with --from-step {step}; to use the old output anyway, "
                        f"add --allow-stale.", flag="--from-step")


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
    if cfg.dry_run:
        return _run(cfg)
    spec = load_yaml(cfg.pipeline)
    if "work_dir" not in spec:
        return _run(cfg)  # plan() says what is missing
    work = _work_dir(cfg, spec)
    # one `eyas run` at a time in a work_dir, planning included: a second one would plan from
    # folders the first is writing, then run the same steps into them
    busy = (f"another `eyas run` is running the pipeline in {work} (its process id is in "
            f"{work / RUN_LOCK}); wait for it to end or stop it (its steps resume), or give "
            f"this pipeline another work_dir")
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
        if p.start_over:  # (see _starts_over)
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
