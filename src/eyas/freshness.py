"""`eyas run`'s checks of one step's folder: is it up to date, and must a re-run start over.

Each check compares one step's folder (its manifest, the files it lists, the folders it read)
with the config the pipeline would run the step with now, and says why it is not current.
The plan (`eyas.pipeline`) decides from these which steps run; nothing here runs a step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from eyas.config import to_dict
from eyas.errors import EyasError
from eyas.store.manifest import MANIFEST, peek_manifest, placed, read_manifest, rebaser

log = logging.getLogger(__name__)


def _normalise(value):
    """`value` (a step config, or one option's value) as its manifest stores it: JSON."""
    return json.loads(json.dumps(to_dict(value) if dataclasses.is_dataclass(value) else value,
                                 default=str))


def up_to_date(cfg, out: Path, upstream_ran: bool) -> tuple[bool, str]:
    """(True, "up to date") where the step's folder `out` holds a finished run of `cfg` on the
    inputs there now, else (False, why); `upstream_ran`: an earlier step of the plan runs."""
    path = out / MANIFEST
    if upstream_ran:
        return False, "an earlier step ran, so its inputs changed"
    if not path.is_file():
        return False, "no finished output yet (or it was interrupted: the step resumes)"
    manifest = read_step_manifest(out)
    # a change first: an interrupted run with other settings may not resume (starts_over)
    changed = _config_changes(cfg, manifest, out)
    if changed:
        return False, f"config changed ({', '.join(changed)})"
    swapped = (_target_missing(cfg, manifest) or _target_changes(cfg, manifest)
               or _template_changes(cfg, manifest))
    if swapped:
        return False, swapped
    moved = _data_moved(cfg, manifest, out)
    if moved:
        return False, moved
    replaced = _input_changes(manifest, out)
    if replaced:
        return False, replaced
    if manifest.get("complete") is False:
        return False, "the previous run was interrupted: the step resumes"
    # the files the manifest lists (export's draft): one deleted since left a broken draft
    # that every later plan called up to date
    gone = [f for f in (*(manifest.get("files") or ()), *_outputs(manifest.get("step"), out))
            if not (out / f).exists()]
    if gone:
        return False, f"{LOST} {', '.join(sorted(gone))} since it ran"
    if manifest.get("step") == "capture":  # a part deleted (as a damaged one's fix says) or cut
        lost = _capture_parts_lost(out)
        if lost:
            return False, (f"its part files {', '.join(lost[:3])}"
                           f"{f' and {len(lost) - 3} more' if len(lost) > 3 else ''} are missing "
                           f"or cut since it ran: capture resumes and captures their samples "
                           f"again")
    return True, "up to date"


LOST = "its output lost"  # the start of up_to_date's reason where files of it are gone
# what a step's folder must hold for the steps after it, beside the files its manifest lists
# (export's): a deleted report.json, vocab or dataset left the step "up to date" and the next
# one failing on it
OUTPUTS = {"regenerate": ("conversations.jsonl",), "prepare": ("dataset",),
           "vocab": ("vocab.safetensors",), "eval": ("report.json",)}


def _outputs(step: str | None, out: Path) -> list[str]:
    """The output paths (relative to `out`) that step's later readers need; a training run's:
    the step folders its `last` and `best` pointers name (read here by hand: the checkpoint
    module imports torch, which planning does not need)."""
    if step != "train":
        return list(OUTPUTS.get(step, ()))
    named = []
    for pointer in ("last", "best"):
        try:
            text = (out / "checkpoints" / pointer).read_text().strip()
        except OSError:
            continue  # no such pointer (a run without evals has no best)
        named.append(f"checkpoints/{text}")
    return named


def _capture_parts_lost(out: Path) -> list[str]:
    """The part files a finished capture's index lists that are gone or of another size (a
    stat each; their sha256 is train's check)."""
    try:
        files = json.loads((out / "index.json").read_text()).get("files") or []
    except (OSError, ValueError, AttributeError):
        return ["index.json"]
    return [e["file"] for e in files
            if not (out / e["file"]).is_file() or (out / e["file"]).stat().st_size != e["bytes"]]


def read_step_manifest(out: Path) -> dict:
    """The manifest of a step's folder, or EyasError naming it where it is damaged (a JSON
    traceback before, --dry-run included) and how the pipeline gets past it."""
    try:
        return read_manifest(out)
    except EyasError as err:
        raise EyasError(f"{err} In `eyas run`, move {out} away (or delete it): the plan then "
                        f"runs that step again.") from None


def _target_missing(cfg, manifest: dict) -> str:
    """Why the step's target, a local path when its run recorded it, names nothing from here
    ("" if it does, or was never local): a relative target and `eyas run` started from another
    directory. Said before any other check of it, which would take the name for a hub model
    and wait on the network to find none."""
    name = getattr(cfg, "target", None)
    was = (manifest.get("target") or {}).get("path")
    if not name or not was or Path(str(name)).expanduser().exists():
        return ""
    if Path(str(name)).expanduser().is_absolute():
        return f"its target {name} does not exist (it ran with it)"
    return (f"its target {name} does not exist from {Path.cwd()} (it ran with {was}; the "
            f"target and data paths resolve from the directory eyas runs in, work_dir from the "
            f"YAML's)")


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
    one (`eyas prepare` run by itself prepares again; the plan skipped it). For regenerate
    and eval, the same of the template they ask in."""
    if manifest.get("step") == "eval":  # its --chat-template file, by content
        return _template_file_changes(getattr(cfg, "chat_template", None),
                                      manifest.get("chat_template_sha256"))
    if manifest.get("step") == "regenerate":
        return _regenerate_template_changes(cfg, manifest)
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


def _template_file_changes(path: str | None, was: str | None) -> str:
    """Why eval's `--chat-template` file is not the one it measured with ("" if it is, or if
    none was recorded)."""
    if not path or not was:
        return ""
    from eyas.store.manifest import file_sha256

    try:
        now = file_sha256(Path(path))
    except OSError as err:
        return f"its chat template file cannot be read ({err})"
    return "" if now == was else f"its chat template file {path} changed"


def _input_changes(manifest: dict, folder: Path | None = None) -> str:
    """Why the output folders a step read are not the ones it ran on ("" if they are): a
    step re-run alone (`--until-step prepare` after its data changed) leaves the steps after
    it made from its old output. An input folder without a manifest is left to the plan (its
    step runs: no finished output)."""
    move = rebaser(manifest, folder) if folder is not None else (lambda value: value)
    for item in manifest.get("inputs") or []:
        path = move(item.get("path") or "")  # (where a moved work_dir holds it now)
        now = peek_manifest(path)
        if path and now is not None and now.get("id") != item.get("id"):
            return f"its input from {item.get('step')} changed since it ran ({path})"
    return ""


def _data_moved(cfg, manifest: dict, folder: Path) -> str:
    """Why the chat data the manifest's run read is not what `cfg.data` holds now ("" if it
    is): _data_changes, as a reason, with data that cannot be read one too."""
    try:
        moved = _data_changes(cfg, manifest, folder)
    except EyasError as err:
        moved = f"it cannot be read: {err}"
    return f"its input data changed ({moved})" if moved else ""


def _data_changes(cfg, manifest: dict, folder: Path) -> str:
    """For a step that records what its chat data held (prepare, regenerate: `data_files`),
    the first file whose content is not what it was then ("" if none): the same path with
    other rows is other data. EyasError if the data cannot be read. A file whose stamp moved
    with its content the same gets its new stamp recorded in `folder`'s manifest, so it is
    read once, not at every plan until the step runs again."""
    if "data_files" not in manifest or not getattr(cfg, "data", None):
        return ""
    from eyas.store.manifest import placed_data
    from eyas.targets.chat_sources import source_fingerprints

    move = rebaser(manifest, folder)  # (regenerate's conversations in a moved work_dir)
    recorded = [{**x, "path": move(x.get("path"))} if isinstance(x, dict) else x
                for x in manifest["data_files"] or []]  # at their recorded stamps: not read
    fresh = _normalise(source_fingerprints(cfg.data, recorded))
    _remember_stamps(folder, manifest, fresh)
    now = placed_data(fresh)  # a file's path as the place it names, not as spelled
    was = {json.dumps(x, sort_keys=True) for x in placed_data(recorded)}
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


def _config_changes(cfg, manifest: dict, folder: Path | None = None) -> list[str]:
    """The options of `cfg` that differ from those the manifest's run was made with; where
    that run's folder is `folder` now, not the --out it recorded, its paths are read as moved
    with it (rebaser)."""
    old = manifest.get("config") or {}
    if folder is not None:
        move = rebaser(manifest, folder)
        old = {k: move(v) for k, v in old.items()}
    new = _normalise(cfg)
    # a path spelled another way (relative, absolute, through a link) names the same input:
    # `data: chats.jsonl` for the absolute path it ran with prepared, captured and trained again
    old = {k: new[k] if k in new and v != new[k] and isinstance(v, (str, list))
           and placed(v) == placed(new[k]) else v for k, v in old.items()}
    return changed_options(type(cfg), old, new)


def changed_options(cls, old: dict, new: dict) -> list[str]:
    """The options of the config class `cls` whose values differ between `old` and `new`
    (both as a manifest stores them); an option the step gained since (no key in `old`) is a
    change only if set off its default in `new`, and one of `cls.RESULT_NEUTRAL` (how a step
    logs, batches or writes, not what it makes) is none."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING}
    # an option unset until the config resolves it (TrainConfig's) has its value when unset
    defaults.update({k: v for k, v in getattr(cls, "UNSET_DEFAULTS", {}).items()
                     if defaults.get(k) is None})
    gained = {k for k, v in new.items()
              if k not in old and k in defaults and v == _normalise(defaults[k])}
    neutral = getattr(cls, "RESULT_NEUTRAL", frozenset())
    return sorted(k for k in set(old) | set(new)
                  if k not in gained and k not in neutral and old.get(k) != new.get(k))


def changes_since_read(cfg, read: dict) -> str:
    """Why the run of `cfg`'s step that a later step read is not the one `cfg` makes now ("" if
    it is), `read` being that run's record in the later step's manifest (`inputs`): an edit of
    its section, or of the chat data it read (prepare's file), seen with its folder removed
    after use. A record without a config or `data_files` (from an eyas before inputs kept
    them) tells nothing of it: unknown, so the plan takes it as unchanged."""
    changed = _config_changes(cfg, read, Path(cfg.out)) \
        if isinstance(read.get("config"), dict) else []
    if changed:
        return f"config changed ({', '.join(changed)})"
    # the folder is gone: the stamps of data touched but not edited cannot be recorded, and
    # such a file is read again at each plan
    return _data_moved(cfg, read, Path(cfg.out))


def starts_over(step: str, cfg, out: Path, upstream_ran: bool, forced: bool) -> str:
    """Why a train or regenerate step that runs must not resume the run in `out` ("" if it
    may). The pipeline moves such a run aside first (`pipeline.run`).

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
    manifest = read_step_manifest(out)
    if manifest.get("step") != step:
        return ""  # not this step's folder: the step's own --out check refuses it
    if step == "regenerate":
        return _regenerate_starts_over(cfg, manifest, out, forced)
    changed = _config_changes(cfg, manifest, out)
    if changed:
        return f"its config changed ({', '.join(changed)})"
    replaced = _input_changes(manifest, out)
    if replaced:
        return replaced
    if manifest.get("complete") is not False:
        return "forced" if forced else "it finished"
    return ""


def _regenerate_template_changes(cfg, manifest: dict) -> str:
    """Why the template regenerate would ask in now (its --chat-template file, e.g. prepare's
    in `eyas run`, else the target's own) is not the one its answers were asked in ("" if it
    is, or where this cannot be told here: the step itself then says)."""
    from eyas.targets.gguf import is_gguf

    was = manifest.get("chat_template_hash")
    ran = manifest.get("config") or {}
    if not was or (ran.get("backend") == "openai" and not ran.get("chat_template")):
        return ""  # (a server rendered: the hash recorded is not of what it asked in)
    if is_gguf(cfg.target) and not cfg.chat_template:
        # a GGUF's own template is in the file (_target_changes), costly to parse; a file
        # given then and none now is a change all the same
        return "its chat template changed (a --chat-template file then, the target's own " \
               "now)" if ran.get("chat_template") else ""
    from eyas.store.manifest import chat_template_fingerprint
    from eyas.targets.models import load_tokenizer

    try:
        now = chat_template_fingerprint(load_tokenizer(
            cfg.target, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
            chat_template=cfg.chat_template))
    except (EyasError, OSError, ValueError):
        return ""
    return "" if now == was else f"its chat template changed (chat_template_hash {was} -> {now})"


def _regenerate_starts_over(cfg, manifest: dict, out: Path, forced: bool) -> str:
    from eyas.store.regenerate_output import setting_changes

    changed = setting_changes(cfg, manifest)
    if changed:
        return f"its config changed ({', '.join(changed)})"
    # other weights behind the same target: its resume refuses them (two models' answers)
    swapped = _target_changes(cfg, manifest)
    if swapped.startswith("the target's weights changed"):
        return swapped
    template = _regenerate_template_changes(cfg, manifest)
    if template:  # its resume refuses the rest in another template
        return template
    try:
        moved = _data_changes(cfg, manifest, out)
    except EyasError:
        return ""  # the step says what is wrong with its data; its output stays where it is
    if moved:
        return f"its input data changed ({moved})"
    return "forced" if forced else ""
