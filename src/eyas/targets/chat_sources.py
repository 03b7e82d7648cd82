"""Finding chat data: --data (files, folders, globs) -> the sources to read.

A source is a JSONL, JSON or Parquet file (the first two gzipped too) or a `datasets` folder
(`save_to_disk`); any other folder stands for the sources inside it, and a glob for those it
matches. Also what the steps record and check of their data: the sources' fingerprints for
manifests, the `eyas regenerate` outputs among them, and an --out that is not inside them.
Reading rows out of the sources is `eyas.targets.chat_files`.
"""

from __future__ import annotations

import fnmatch
import glob
import itertools
import json
import logging
import os
from pathlib import Path
from typing import Iterable

from eyas.errors import EyasError
from eyas.store.manifest import MANIFEST, peek_manifest

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")


def resolve_paths(paths: str | Path | tuple | list,
                  skipped: list[Path] | None = None) -> list[Path]:
    """Expand files, folders and globs into the ordered list of sources to read.

    A `datasets` folder (written by `save_to_disk`) is one source; any other folder stands
    for the supported files inside it (recursively, sorted). Files a folder holds that are
    not read (other suffixes; eyas's own manifest, and a regenerate folder's rejects) are
    appended to `skipped`, when given, so that the caller can say so.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out: list[Path] = []
    for spec in paths:
        spec = str(spec)
        if glob.has_magic(spec):
            out.extend(_globbed(spec, skipped if skipped is not None else []))
            continue
        path = Path(spec)
        if not path.exists():
            where = "" if path.is_absolute() else \
                f" from {Path.cwd()} (a relative path resolves from the directory eyas runs in)"
            raise EyasError(f"data path {path} does not exist{where}; check --data")
        if path.is_dir() and not is_datasets_folder(path):
            found = _sources_in(path, skipped if skipped is not None else [])
            if not found:
                raise EyasError(f"folder {path} holds no {'/'.join(FILE_SUFFIXES)} files and is "
                                f"not a datasets folder (save_to_disk); check --data")
            out.extend(found)
        elif _is_source(path):
            out.append(path)
        else:
            raise EyasError(f"cannot read {path}: give {'/'.join(FILE_SUFFIXES)} files or "
                            f"a datasets folder (save_to_disk) in --data")
    if not out:
        raise EyasError(f"no chat data found in {list(paths)}; check --data")
    return _once(out)


def _globbed(spec: str, skipped: list[Path]) -> list[Path]:
    """The sources a --data glob stands for: the files it matches and those in the folders it
    matches (as when named by itself); the files passed over are appended to `skipped`. `**`
    matches a folder and what is inside it: each source is read once, and nothing inside a
    datasets folder that is read (a DatasetDict's splits were read again, its .json metadata
    as malformed rows). A file a glob matches inside a datasets folder stands for the folder."""
    matches = sorted(glob.glob(spec, recursive=True))
    if not matches:
        raise EyasError(f"no files match {spec!r}; check the --data glob")
    found, passed = [], []
    base = _literal_prefix(spec)
    for match in map(Path, matches):
        holder = None if match.is_dir() else _datasets_folder_of(match, base)
        if holder is not None:  # a file of a datasets folder (data or metadata): that folder
            found.append(holder)
        elif match.is_dir() and not is_datasets_folder(match):
            found.extend(_sources_in(match, passed))  # a folder stands for its files
        elif _is_source(match) and match.name not in _eyas_own_files(match.parent):
            found.append(match)
        elif match.name not in _eyas_own_files(match.parent):
            passed.append(match)
    read = {p for p in found if is_datasets_folder(p)}
    skipped.extend(p for p in passed if read.isdisjoint(p.parents))
    return [p for p in dict.fromkeys(found) if read.isdisjoint(p.parents)]


def _datasets_folder_of(path: Path, base: Path) -> Path | None:
    """The `datasets` folder that holds the file `path` (the nearest, a split's before its
    DatasetDict's), or None: its .json metadata are not chat rows, nor its .arrow data files
    sources of their own. Only folders from the glob's literal part `base` down: one above it
    with a state.json of its own (a project folder, $HOME) is not the glob's data."""
    return next((p for p in path.parents if (p == base or base in p.parents)
                 and _saved_by_datasets(p)), None)


def _saved_by_datasets(folder: Path) -> bool:
    """A folder `save_to_disk` wrote, by its files (a DatasetDict's index, or a Dataset's
    state beside its info): a state.json alone (an app's, in a project folder a glob starts
    in) is not one."""
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())


def _literal_prefix(spec: str) -> Path:
    """The folder a glob's wildcards start below: `data/ds/*` -> data/ds, `*.jsonl` -> ."""
    parts = Path(spec).parts
    literal = list(itertools.takewhile(lambda part: not glob.has_magic(part), parts))
    return Path(*literal) if literal else Path(".")


def check_out_outside(paths, out: str | Path, step: str) -> None:
    """Refuse an --out inside a --data folder, or one a --data glob matches: the step would read
    its own output as input (a regenerate run failed at once as "unfinished", and told to run
    the same command again; a prepare run re-run found "an `eyas prepare` output" in its data)."""
    given, out = out, Path(os.path.abspath(out))
    for spec in map(str, [paths] if isinstance(paths, (str, Path)) else paths):
        where = Path(os.path.abspath(spec))
        if glob.has_magic(spec):
            caught = any(fnmatch.fnmatchcase(str(p), str(where)) for p in (out, *out.parents))
        else:
            caught = where.is_dir() and (where == out or where in out.parents)
        if caught:
            raise EyasError(f"--out {given} is inside --data {spec}: eyas {step} would read its "
                            f"own output as chat data; choose an --out outside the data "
                            f"folders", flag="--out")


def _once(paths: list[Path]) -> list[Path]:
    """`paths` without a source named again (overlapping --data entries, such as a file and
    a glob that matches it): read twice, its rows would be trained twice and could land in
    both the train and the eval split."""
    seen: set[Path] = set()
    out = []
    for path in paths:
        key = path.resolve()
        if key in seen:
            log.warning("%s is named more than once in --data: read once", path)
            continue
        seen.add(key)
        out.append(path)
    return out


def source_fingerprints(paths, recorded: Iterable[dict] = ()) -> list[dict]:
    """What `paths` hold now, for manifests: per file its sha256, size and mtime_ns, per
    datasets folder its fingerprints. A file still at the size and mtime_ns of its record in
    `recorded` (an earlier manifest's `data_files`) keeps that sha256 and is not read: `eyas
    run` plans on every start, and hashing large data each time was slow. A rewrite nearly
    always moves the mtime; one that keeps both size and mtime is trusted."""
    from eyas.store.manifest import file_sha256

    known = {r.get("path"): r for r in recorded}
    out, skipped = [], []
    for path in resolve_paths(paths, skipped):
        if path.is_dir():
            states = sorted(path.rglob("state.json"))
            prints = [json.loads(s.read_text()).get("_fingerprint") for s in states]
            out.append({"path": str(path), "fingerprints": prints})
            continue
        st = path.stat()  # before reading: a write meanwhile moves the mtime, so is hashed later
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        was = known.get(str(path)) or {}
        same = "sha256" in was and all(was.get(k) == v for k, v in stamp.items())
        out.append({"path": str(path), "sha256": was["sha256"] if same else file_sha256(path),
                    **stamp})
    skipped = list(dict.fromkeys(skipped))  # a folder and a `**` inside it name a file twice
    if skipped:
        log.warning("not read as chat data (%d file(s) in --data folders: other suffixes than "
                    "%s, or eyas's own manifest / rejects): %s", len(skipped),
                    "/".join(FILE_SUFFIXES), ", ".join(map(str, skipped[:10]))
                    + (", ..." if len(skipped) > 10 else ""))
    return out


def _sources_in(folder: Path, skipped: list[Path]) -> list[Path]:
    """Data files and datasets folders under `folder`, sorted; a datasets folder's own
    files (state.json, ...) are not data, nor are eyas's own files; the files passed over
    are appended to `skipped`."""
    out = []
    own = _eyas_own_files(folder)
    for path in sorted(folder.iterdir()):
        if is_datasets_folder(path):
            out.append(path)
        elif path.is_dir():
            out.extend(_sources_in(path, skipped))
        elif _is_source(path) and path.name not in own:
            out.append(path)
        else:
            skipped.append(path)
    return out


def _eyas_own_files(folder: Path) -> tuple[str, ...]:
    """Files of an eyas output folder that are not chat data: its manifest, and in a
    regenerate folder the rejects (its conversations.jsonl is the data)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return ()
    if not isinstance(manifest, dict) or "step" not in manifest:
        return ()  # a user's own eyas.json
    if manifest["step"] != "regenerate":  # its files are not conversations: read as rows,
        # they would all be rejected, with no word of why
        raise EyasError(f"{folder} is an `eyas {manifest['step']}` output, not chat data: give "
                        f"--data the conversations it was made from (its {MANIFEST} names "
                        f"them), or an `eyas regenerate` output folder")
    if manifest.get("complete") is False:
        # a killed (or still running) regenerate: what it holds is a prefix of its input
        done = _count_lines(folder / "conversations.jsonl")
        raise EyasError(f"{folder} is an unfinished `eyas regenerate` run ({done} conversations "
                        f"written so far): run the same `eyas regenerate` command again to "
                        f"finish it (it resumes where it stopped), or, to use only what it has "
                        f"now, pass its file {folder / 'conversations.jsonl'} in --data")
    return (MANIFEST, "rejects.jsonl")


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def regenerate_outputs(paths: str | Path | tuple | list) -> list[dict]:
    """The manifests (with their folder as "path") of the `eyas regenerate` output folders
    named in `paths` or inside a folder named there (parts regenerated apart, under one
    folder: read as data too). A file inside one, named by itself, is read as a plain file."""
    found = (f.parent for folder in _named(paths) if folder.is_dir()
             for f in sorted(folder.rglob(MANIFEST)))  # the folder's own first
    return _regenerate_manifests(found)


def regenerated_files(paths: str | Path | tuple | list) -> list[dict]:
    """The manifests (with their folder as "path") of the `eyas regenerate` folders whose
    conversations file is named in `paths` by itself: read as a plain file, unchecked (the
    way to use another target's answers, or an unfinished run's, knowingly), but its chat
    settings (the system prompt every row was answered with) are still the data's."""
    return _regenerate_manifests(f.parent for f in _named(paths) if f.is_file())


def _named(paths: str | Path | tuple | list) -> list[Path]:
    """Every path `paths` names, its globs expanded (sorted), in the order given."""
    out = []
    for spec in map(str, [paths] if isinstance(paths, (str, Path)) else paths):
        out += map(Path, sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec)
                   else [spec])
    return out


def _regenerate_manifests(folders) -> list[dict]:
    """The `eyas regenerate` manifests of `folders`, each folder once, with it as "path"."""
    out = {}
    for folder in folders:
        manifest = peek_manifest(folder)
        if manifest and manifest.get("step") == "regenerate":
            out.setdefault(str(folder), {**manifest, "path": str(folder)})
    return list(out.values())


def is_datasets_folder(path: Path) -> bool:
    """A `datasets` save_to_disk folder: a DatasetDict (dataset_dict.json) or one Dataset."""
    return path.is_dir() and any(
        (path / name).is_file() for name in ("dataset_dict.json", "state.json"))


def _is_source(path: Path) -> bool:
    return is_datasets_folder(path) or (path.is_file() and path.name.endswith(FILE_SUFFIXES))

def dict_splits(path: Path) -> list[str] | None:
    """The split names of a `datasets` DatasetDict folder (its dataset_dict.json, without
    loading the data); None for any other path, a single Dataset folder too."""
    index = path / "dataset_dict.json"
    return (json.loads(index.read_text()).get("splits") or []) if index.is_file() else None
