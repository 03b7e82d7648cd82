"""Self-describing step folders: every step writes `eyas.json` beside its payload.

A manifest records the step, its resolved config, library versions, the target it
belongs to and the ids of the manifests it consumed. The next step reads it with
`read_manifest(folder, step=...)` and refuses a folder from another step or target
with a message that says what to do.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import platform
import secrets
import time
from pathlib import Path
from typing import Any

from eyas import __version__
from eyas.config import to_dict
from eyas.errors import EyasError

log = logging.getLogger(__name__)

MANIFEST = "eyas.json"
# Written into every manifest that stores aux layer ids.
LAYER_ID_CONVENTION = (
    "vllm: aux id k = residual stream entering decoder layer k "
    "= HF output_hidden_states[k] for k < L; id L = last layer output before the final norm"
)


def versions() -> dict[str, str]:
    out = {"eyas": __version__, "python": platform.python_version()}
    for name in ("torch", "transformers", "datasets", "safetensors"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            continue
    return out


# A data file's stamp in a manifest's `data_files` (written by
# eyas.targets.chat_sources.source_fingerprints): when to hash the file again, not what it holds.
DATA_STAMP = ("size", "mtime_ns")


def data_content(records) -> list[dict]:
    """`data_files` records without their stamps: what two runs on the same data share (a
    copy or a checkout of the same rows has another mtime)."""
    return [{k: v for k, v in r.items() if k not in DATA_STAMP} for r in records or ()]


def placed(value):
    """A path as recorded (`--target`, `--data`, a `data_files` record's path), as the place it
    names: an existing local file or folder resolved, so that `tiny-llama` and its absolute
    path are the same input; anything else (a hub name, a glob, a path gone) as spelled. For
    comparing two runs' records only: manifest ids keep what was given."""
    if isinstance(value, (list, tuple)):
        return [placed(v) for v in value]
    if isinstance(value, str) and value and os.path.exists(value):
        return os.path.realpath(value)
    return value


def placed_data(records) -> list[dict]:
    """data_content, with each file's path `placed`: the same rows read through another
    spelling of their path are the same data."""
    return [{**r, "path": placed(r.get("path"))} if "path" in r else r
            for r in data_content(records)]


def peek_manifest(folder: str | Path) -> dict[str, Any] | None:
    """`folder`'s manifest, or None where there is none or it is damaged: for looking at what
    a folder may be, where read_manifest would refuse it."""
    try:
        body = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and not _misshapen(body) else None


def recorded_data(folder: str | Path, step: str) -> list[dict]:
    """The `data_files` an earlier `step` recorded in `folder` ([] if none): the files still
    at their recorded size and mtime need not be read again (source_fingerprints)."""
    body = peek_manifest(folder) or {}
    return (body.get("data_files") or []) if body.get("step") == step else []


def manifest_id(body: dict[str, Any], neutral: frozenset | tuple = ()) -> str:
    """Content hash of a manifest body (time stamps excluded) used to chain steps; the config
    options named in `neutral` (the step's RESULT_NEUTRAL: how it batched or wrote, not what it
    made) are left out, so a run repeated with only those changed keeps its id."""
    stable = _unstamped({k: v for k, v in body.items()
                         if k not in ("id", "created", "versions", "stats", "chat",
                                      "chat_template_path")})
    if neutral and isinstance(stable.get("config"), dict):
        stable["config"] = {k: v for k, v in stable["config"].items() if k not in neutral}
    if "inputs" in stable:  # an input's record holds its step's data_files too (_input)
        stable["inputs"] = [_unstamped(i) for i in stable["inputs"]]
    blob = json.dumps(stable, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _unstamped(record: dict[str, Any]) -> dict[str, Any]:
    """A manifest, or an input's record of one, with its `data_files` stamps left out
    (data_content): the same rows under another mtime are the same input."""
    if "data_files" not in record:
        return record
    return {**record, "data_files": data_content(record["data_files"])}


def write_manifest(folder: str | Path, step: str, config, *, target: dict | None = None,
                   inputs: list[dict] | tuple = (), **extra: Any) -> dict[str, Any]:
    """Write `folder/eyas.json` atomically and return it.

    `target` describes the target model (see `target_record`); `inputs` are the
    manifests this step consumed (their step and id are recorded); `extra` holds
    step-specific facts (aux_layer_ids, stats, files, ...).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    body: dict[str, Any] = {
        "step": step,
        "config": to_dict(config) if config is not None and not isinstance(config, dict) else config,
        "target": target,
        "inputs": [_input(m) for m in inputs],
    }
    body.update(extra)
    if "chat" not in body and step != "prepare":  # how its data's prompts were rendered,
        # carried on from the inputs (chat_record; not in the id: the inputs' ids are)
        chat = _first_chat(inputs, chat_record)
        if chat is not None:
            body["chat"] = chat
    if "aux_layer_ids" in body and "layer_id_convention" not in body:
        body["layer_id_convention"] = LAYER_ID_CONVENTION
    body["id"] = manifest_id(body, getattr(type(config), "RESULT_NEUTRAL", ()))
    body["versions"] = versions()
    body["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _replace(folder, body)
    return body


def _input(manifest: dict[str, Any]) -> dict[str, Any]:
    """How a step records a manifest it consumed: its step, id, folder, config and the chat data
    it read (`data_files`: `eyas run` sees an edit of either once that folder is gone), and a
    training run's `run` (train_run)."""
    item = {key: manifest.get(key) for key in ("step", "id", "path", "config")}
    return item | {key: manifest[key] for key in ("data_files", "run") if manifest.get(key)}


def train_run(folder: str | Path, resumed: bool) -> str:
    """The `run` of a training run's manifests: one id for the run from its first step to its
    last, where the manifest's own id changes as it trains (complete, best, steps). A resumed
    run keeps the one its folder records; a fresh run, or one from an eyas that recorded none,
    gets a new one."""
    earlier = (peek_manifest(folder) or {}) if resumed else {}
    kept = earlier.get("run") if earlier.get("step") == "train" else None
    return kept if isinstance(kept, str) and kept else secrets.token_hex(8)


def _replace(folder: Path, body: dict[str, Any]) -> None:
    """Write `folder/eyas.json` whole or not at all: a kill mid-write leaves the old one."""
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(body, indent=2, default=str) + "\n")
    os.replace(tmp, folder / MANIFEST)


def restamp_data(folder: str | Path, expect_id: str | None, now: list[dict]) -> bool:
    """Record in `folder`'s manifest the present stamps of its `data_files` whose sha256 `now`
    (source_fingerprints' records) found unchanged: a file touched but not edited is then read
    once, not at every later plan. Only stamps change, and they are out of the id, so the
    steps that consumed this manifest still match it. Nothing is written unless the manifest
    is still the one with id `expect_id` (another run may have replaced it since). Returns
    whether it wrote; OSError where it cannot (a read-only folder)."""
    body = peek_manifest(folder)
    if body is None or body.get("id") != expect_id:
        return False
    fresh = {r.get("path"): r for r in now if "sha256" in r}
    moved = False
    for record in body.get("data_files") or []:
        seen = fresh.get(record.get("path"))
        if seen is None or seen["sha256"] != record.get("sha256"):
            continue  # other content: the step runs again and records it
        stamp = {k: seen[k] for k in DATA_STAMP if k in seen}
        moved = moved or any(record.get(k) != v for k, v in stamp.items())
        record.update(stamp)
    if moved:
        _replace(Path(folder), body)
    return moved


def read_manifest(folder: str | Path, step: str | tuple[str, ...] | None = None) -> dict[str, Any]:
    """Read `folder/eyas.json`, checking it was written by `step` (one of them, if a tuple)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        want = f"`eyas {step if isinstance(step, str) else step[0]}`" if step else "an eyas step"
        if not folder.exists():
            raise EyasError(f"{folder} does not exist. Point this option at the output folder "
                            f"of {want}.")
        if folder.is_dir() and any(folder.iterdir()):  # files, but no manifest (yet)
            raise EyasError(f"{folder} has no {MANIFEST}: it was not written by {want}, or "
                            f"{want} was stopped there before it finished (a capture writes "
                            f"its {MANIFEST} at the end): then run the same command again, "
                            f"which resumes. Otherwise point this option at the output folder "
                            f"of {want}.")
        raise EyasError(f"{folder} has no {MANIFEST}: it was not written by {want}. "
                        f"Point this option at the output folder of {want}.")
    body = _load(path)
    steps = (step,) if isinstance(step, str) else step
    if steps and body.get("step") not in steps:
        raise EyasError(f"{folder} holds the output of `eyas {body.get('step')}`, but "
                        f"`eyas {steps[0]}` output is needed here; run `eyas {steps[0]}` first "
                        f"and pass its --out folder.")
    body["path"] = str(folder)
    return body


# The shape of the manifest fields that steps read: an edit that breaks one is a damaged
# manifest, refused by name, not an AttributeError wherever it is first read.
MANIFEST_SHAPE = (("step", str), ("config", dict), ("target", dict), ("inputs", list),
                  ("chat", dict), ("data_files", list), ("aux_layer_ids", list),
                  ("stats", dict))


def _misshapen(body: dict) -> str:
    """What in a manifest's body is not of MANIFEST_SHAPE ("" if nothing)."""
    return "; ".join(f"its {key} is a JSON {type(body[key]).__name__}"
                     for key, kind in MANIFEST_SHAPE
                     if body.get(key) is not None and not isinstance(body[key], kind))


def _load(path: Path) -> dict[str, Any]:
    """A manifest's body, or an EyasError that names the damaged file and the fix."""
    try:
        body = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        body = err
    if isinstance(body, dict) and (wrong := _misshapen(body)):
        body = ValueError(wrong)
    if not isinstance(body, dict):
        why = body if isinstance(body, Exception) else f"a JSON {type(body).__name__}"
        raise EyasError(f"{path} is damaged ({why}, not an eyas manifest); eyas writes it "
                        f"whole or not at all, so something else changed or cut it. Restore it, "
                        f"or run the step that made {path.parent} again into a new --out.")
    return body


def inside(folder: str | Path, name: str, what: str) -> Path:
    """`folder / name` for a `name` read from a file inside `folder` (a manifest, an index, a
    checkpoint pointer): a plain relative name that stays inside the folder, never an absolute
    path, a `..` or a symlink out of it. `what` names the file the name came from."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or Path(name).is_absolute() or \
            ".." in Path(name).parts or "\x00" in name:
        raise EyasError(f"{what} in {folder} names {name!r}, which is not a plain name inside "
                        f"that folder (absolute paths and '..' are refused); the file was edited "
                        f"or written by something other than eyas: re-run the step that wrote "
                        f"{folder}.")
    path = folder / name
    if path.exists() and not path.resolve().is_relative_to(folder.resolve()):
        raise EyasError(f"{what} in {folder} names {name!r}, a link to "
                        f"{path.resolve()} outside that folder; eyas reads only files inside "
                        f"its folders: re-run the step that wrote {folder}.")
    return path


def check_out(folder: str | Path, step: str, own: tuple[str, ...] = (),
              unfinished: tuple[str, ...] = ()) -> Path:
    """The one --out policy of every step: write only into a folder that is missing, empty or
    holds nothing but this step's own files. `own` are glob patterns of the names the step
    writes (top level) in a folder whose manifest says `step`; `unfinished` those an interrupted
    run leaves before its manifest exists (capture's shard files, say). Refuses a file, another
    step's folder, and any entry no pattern covers, naming them; returns the folder."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise EyasError(f"--out {folder} is a file; give a folder (eyas {step} writes a folder).",
                        flag="--out")
    _check_not_inside_a_step(folder, step)
    _check_writable(folder, step)
    entries = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if not entries:
        return folder
    allowed = (MANIFEST, MANIFEST + ".tmp", *unfinished)
    if MANIFEST in entries:
        try:
            found = json.loads((folder / MANIFEST).read_text()).get("step")
        except (OSError, ValueError, AttributeError):  # not JSON, not UTF-8, a folder
            found = None
        if found != step:
            holds = (f"the output of `eyas {found}`" if isinstance(found, str) and found else
                     f"an {MANIFEST} that is unreadable or names no eyas step")
            raise EyasError(f"--out {folder} holds {holds}, not the output of `eyas {step}`; "
                            f"choose another --out (eyas never writes into another step's "
                            f"folder).", flag="--out")
        allowed += own
    foreign = [n for n in entries if not any(fnmatch.fnmatchcase(n, p) for p in allowed)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        kind = ("an earlier `eyas " + step + "` output plus files it did not write"
                if MANIFEST in entries else "files eyas did not write")
        raise EyasError(f"--out {folder} holds {kind} ({shown}); eyas {step} writes only into "
                        f"an empty folder or its own earlier output, so nothing of yours is "
                        f"overwritten or deleted. Move those away, or choose another --out.",
                        flag="--out")
    return folder


def _check_not_inside_a_step(folder: Path, step: str) -> None:
    """Refuse an --out inside another step's output folder (`run/draft` for an export): that
    step's own checks then find a folder they did not write there, and a training run so
    holding its export can no longer resume."""
    for parent in Path(os.path.abspath(folder)).parents:
        found = peek_manifest(parent)
        if found is not None and isinstance(found.get("step"), str):
            raise EyasError(f"--out {folder} is inside {parent}, the output of `eyas "
                            f"{found['step']}`; eyas {step} writes beside another step's folder, "
                            f"never into it (a folder of its own there would stop that step "
                            f"resuming or running again): choose an --out outside it, e.g. "
                            f"{parent.parent / folder.name}", flag="--out")


def _check_writable(folder: Path, step: str) -> None:
    """Refuse an --out that cannot be written (a read-only file system or folder) now, before
    a step loads its target for minutes and then fails on its first file with a traceback."""
    import tempfile

    where = folder
    while not where.exists() and where != where.parent:
        where = where.parent  # the folder is made later, inside its nearest existing parent
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as err:
        raise EyasError(f"--out {folder}: eyas {step} cannot write there ({where}: "
                        f"{err.strerror or err}); give a folder it can write into.",
                        flag="--out") from None


# Bytes hashed at each end of a GGUF target (see gguf_fingerprint).
GGUF_HASHED_END_BYTES = 4 << 20
# Bytes of each safetensors tensor hashed at its start and at its middle (see
# weights_fingerprint).
WEIGHT_SAMPLE_BYTES = 1024
# reads of weights_fingerprint in flight at once: many on a big host's NVMe; on 2 cores
# more threads only contend for the GIL (benchmarks/weights_fingerprint.py)
WEIGHT_READERS = min(32, 4 * (os.cpu_count() or 1))


def found_here(name: str | None, where: str | None, there=os.path.exists) -> str | None:
    """A path a step recorded as given (`name`), to use from here: `name` where it names
    something from here (`there`), else the absolute path recorded beside it (`where`: `name`
    was relative to another directory) where that does, else `name` as it is."""
    if name and there(os.path.expanduser(str(name))):
        return name
    return str(where) if name and where and there(where) else name


def recorded_target(record: dict | None) -> str | None:
    """The target a step's record names, to load from here (`found_here` of its
    `name_or_path` and the absolute `path` recorded beside it)."""
    record = record if isinstance(record, dict) else {}
    name = record.get("name_or_path")
    here = found_here(name, record.get("path"))
    if here != name:
        log.info("the recorded target %s is %s from here", name, here)
    return here


def target_record(name_or_path: str, revision: str | None = None, *, config=None,
                  tokenizer=None, weights: bool = True) -> dict[str, Any]:
    """Identify a target: name, revision/commit if known, and fingerprints that let
    later steps detect a different model or tokenizer behind the same name (for a .gguf
    file: its name, size and `gguf_fingerprint`; for a folder `eyas convert` wrote, those of
    the GGUF it came from, plus `converted_from`: the two are one target; for any folder,
    converted or not, `weights_fingerprint`, unless `weights` is False: steps whose output is
    tokens only). A local target's absolute path is `path` (name_or_path is as given, which
    may be relative to where the step ran)."""
    rec: dict[str, Any] = {"name_or_path": str(name_or_path), "revision": revision}
    commit = getattr(config, "_commit_hash", None) if config is not None else None
    rec["commit"] = commit
    path = Path(name_or_path).expanduser()
    if path.exists():  # a local target, named as given: where it was, for a step run elsewhere
        rec["path"] = str(path.resolve())
    if path.suffix.lower() == ".gguf" and path.is_file():
        rec["gguf_file"] = path.name
        rec["gguf_bytes"] = path.stat().st_size
        rec["gguf_fingerprint"] = gguf_fingerprint(path)
    else:
        if (source := converted_from(path)) is not None:
            rec.update({k: source[k] for k in ("gguf_file", "gguf_bytes", "gguf_fingerprint")})
            rec["converted_from"] = source["name_or_path"]
        # a converted folder has its own weights too: an fp32 and a bf16 conversion of one GGUF
        # are one target to the GGUF, but not to each other (a capture must not mix them)
        if weights and (folder := weights_folder(name_or_path, revision)) is not None:
            rec["weights_fingerprint"] = weights_fingerprint(folder)
    if config is not None:
        text = getattr(config, "get_text_config", lambda: config)()
        rec["model_type"] = getattr(config, "model_type", None)
        rec["num_hidden_layers"] = getattr(text, "num_hidden_layers", None)
        rec["hidden_size"] = getattr(text, "hidden_size", None)
        rec["vocab_size"] = getattr(text, "vocab_size", None)
    if tokenizer is not None:
        rec["tokenizer_hash"] = tokenizer_fingerprint(tokenizer)
    return rec


def converted_from(folder: Path) -> dict[str, Any] | None:
    """The target record of the GGUF file a folder was converted from (`eyas convert`'s
    manifest), or None for any other path."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    body = _load(manifest)
    return body["target"] if body.get("step") == "convert" else None


def gguf_fingerprint(path: str | Path) -> str:
    """sha256 of a GGUF file's size, first and last GGUF_HASHED_END_BYTES. Not the whole file:
    a GGUF target can be hundreds of GB and every step records it, so hashing it all would cost
    minutes per step. The front holds the metadata, tokenizer and tensor table (a re-conversion
    or another quantization changes it) and the back the last tensors' data; a file edited
    only in the middle goes unnoticed."""
    size = Path(path).stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(GGUF_HASHED_END_BYTES))
        f.seek(max(GGUF_HASHED_END_BYTES, size - GGUF_HASHED_END_BYTES))
        h.update(f.read())
    return h.hexdigest()[:16]


def weights_folder(name_or_path: str, revision: str | None = None) -> Path | None:
    """The local folder that holds a target's weights: the folder itself, or a hub name's
    snapshot in the Hugging Face cache (None when the hub name is not cached yet)."""
    path = Path(str(name_or_path)).expanduser()
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(str(name_or_path), "config.json", revision=revision)
    except (ValueError, OSError):  # not a valid repo id (HFValidationError), or no cache
        return None
    return Path(hit).parent if isinstance(hit, str) else None


def weights_damage(folder: str | Path) -> str | None:
    """What is wrong with the safetensors weights of a local model folder, or None when they
    are whole (or there are none): a file its index names that is not there, a header that
    cannot be read, or a file whose size is not the one its header gives (a download or a
    copy cut short). Reads each file's header only, not its tensors."""
    folder = Path(folder)
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            named = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        except (OSError, ValueError, AttributeError) as err:
            return f"{index.name} cannot be read as JSON ({str(err)[:80]})"
        missing = [n for n in named if not (folder / n).is_file()]
        if missing:
            return (f"{len(missing)} of the {len(named)} files {index.name} names "
                    f"{'is' if len(missing) == 1 else 'are'} missing ({', '.join(missing[:3])}"
                    f"{', ...' if len(missing) > 3 else ''})")
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or 8 + n > size:
                return (f"{path.name} has {size:,} bytes, too few for its header: the file "
                        f"was cut short")
            try:
                header = json.loads(f.read(n))
                end = max((int(v["data_offsets"][1]) for k, v in header.items()
                           if k != "__metadata__"), default=0)
            except (ValueError, TypeError, KeyError, AttributeError, IndexError) as err:
                return f"{path.name}'s safetensors header cannot be read ({str(err)[:80]})"
        if size != 8 + n + end:
            what = "cut short" if size < 8 + n + end else "given bytes after its last tensor"
            return (f"{path.name} has {size:,} bytes where its header says {8 + n + end:,}: "
                    f"the file was {what}")
    return None


# weights_fingerprint per (folder, its weight files' names, sizes and mtimes): a step records
# its target more than once
_WEIGHTS_SEEN: dict[tuple, str | None] = {}


def weights_fingerprint(folder: str | Path) -> str | None:
    """Tell apart two checkpoints of one shape and tokenizer (a fine-tune and its base model,
    two training runs) at the cost of two small reads per tensor, WEIGHT_READERS at a time
    (benchmarks/weights_fingerprint.py: 2-11 s for a 1T MoE's ~2 x 10^5 tensors on 2 cores):
    sha256 over each safetensors tensor's name, dtype, shape and WEIGHT_SAMPLE_BYTES at its
    start and its middle, in name order, so the same tensors re-sharded keep it; a pickled
    checkpoint (*.bin, *.pt) by its size and GGUF_HASHED_END_BYTES at each end. The stored
    bytes, so the same model saved in another dtype or quantization gets another fingerprint.
    None when the folder holds no weights, or misses a file its index names (a download under
    way)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    pickled = [] if files else sorted(p for ext in ("*.bin", "*.pt", "*.pth")
                                      for p in folder.glob(ext) if "training_args" not in p.name)
    index = next(iter(sorted(folder.glob("*.safetensors.index.json"))), None) if files else None
    if index is not None:
        named = set(json.loads(index.read_text()).get("weight_map", {}).values())
        if any(not (folder / name).is_file() for name in named):
            return None
    if not files and not pickled:
        return None
    key = (str(folder.resolve()),
           tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files + pickled))
    if key not in _WEIGHTS_SEEN:
        _WEIGHTS_SEEN[key] = (_safetensors_fingerprint(files) if files
                              else _pickled_fingerprint(pickled))
    return _WEIGHTS_SEEN[key]


def _safetensors_fingerprint(files: list[Path]) -> str:
    from concurrent.futures import ThreadPoolExecutor

    def samples(fd: int, start: int, metas: list[tuple[str, dict]]) -> list[tuple]:
        out = []
        for name, meta in metas:
            begin, end = meta["data_offsets"]
            n = min(WEIGHT_SAMPLE_BYTES, end - begin)
            middle = begin + (end - begin) // 2 // n * n if n else begin
            data = os.pread(fd, n, start + begin) + \
                os.pread(fd, min(n, end - middle), start + middle)
            out.append((name, (meta["dtype"], meta["shape"], hashlib.sha256(data).hexdigest())))
        return out

    tensors = []
    # a big checkpoint is ~10^5 tensors spread over ~10^3 GB: the reads are random, so they go
    # out many at a time (os.pread lets go of the GIL), in batches (a future per read costs
    # more than the read), without readahead
    with ThreadPoolExecutor(WEIGHT_READERS) as pool:
        for path in files:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                metas = [(n, m) for n, m in header.items() if n != "__metadata__"]
                batch = -(-len(metas) // WEIGHT_READERS) if len(metas) > 256 else len(metas)
                jobs = [pool.submit(samples, f.fileno(), 8 + size, metas[i:i + batch])
                        for i in range(0, len(metas), max(batch, 1))]
                for job in jobs:
                    tensors += job.result()
    h = hashlib.sha256(json.dumps(sorted(tensors)).encode())
    return h.hexdigest()[:16]


def _pickled_fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(GGUF_HASHED_END_BYTES))
            f.seek(max(GGUF_HASHED_END_BYTES, size - GGUF_HASHED_END_BYTES))
            h.update(f.read())
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the tokenizer's vocabulary (token string -> id): equal iff token ids mean the same.
    The chat template is fingerprinted separately by the steps that render chats."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    h = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode())
    return h.hexdigest()[:16]


def chat_template_fingerprint(tokenizer) -> str:
    """Hash of the tokenizer's chat template: prepare and regenerate record it so a mismatch
    between how data was rendered and how it was regenerated can be seen."""
    blob = json.dumps(tokenizer.chat_template, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_same_target(found: dict | None, expected: dict | None, what: str,
                      fix: str = "", *, weights: bool = True) -> None:
    """Refuse an artifact made for another target (different architecture, tokenizer, shape or
    GGUF, or, with `weights`, other weights of the same shape: a fine-tune, another
    checkpoint); `fix` says how to make the right one where re-running with --target is not
    it. Prepared data is tokens only: its checks pass weights=False."""
    if not found or not expected:
        return
    fix = fix or f"re-run that step with --target {expected.get('name_or_path')}"
    # a key only compares where both records have it (older manifests lack the fingerprints)
    for key in ("model_type", "tokenizer_hash", "hidden_size", "num_hidden_layers",
                "vocab_size", "gguf_fingerprint"):
        a, b = found.get(key), expected.get(key)
        if a is not None and b is not None and a != b:
            raise EyasError(
                f"{what} was made for target {found.get('name_or_path')} ({key}={a}) but this run "
                f"uses {expected.get('name_or_path')} ({key}={b}); {fix} or point at the "
                f"matching folder.")
    a, b = found.get("weights_fingerprint"), expected.get("weights_fingerprint")
    if weights and a is not None and b is not None and a != b:
        raise EyasError(
            f"{what} was made with the weights of {found.get('name_or_path')} "
            f"(weights_fingerprint={a}) and this run's target {expected.get('name_or_path')} has "
            f"the same tokenizer and shape but other weights (weights_fingerprint={b}): another "
            f"checkpoint or a fine-tune, whose hidden states and head the draft does not match. "
            f"{fix[0].upper() + fix[1:]} or point at the matching folder; if it is the same model "
            f"saved in another precision or quantization, pass --accept-other-weights.")


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """The file's sha256, read `chunk` bytes at a time (hashlib releases the GIL on each block,
    so threads hash files in parallel: eyas.store.integrity)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# The chat rendering of a draft's data: its chat template, template variables and system
# prompt, as `eyas prepare` (and `eyas regenerate` before it) recorded them. `eyas eval`
# renders its prompts the same way unless told otherwise: a draft trained on prompts rendered
# with `enable_thinking=false` and measured on prompts rendered without it measures another
# distribution (an audit found AL 2.63 against 3.67 on one Qwen3-style target). Every
# manifest written after the data's carries the record as `chat` (write_manifest), so an
# exported draft copied to another machine still has it; a manifest from an eyas before that
# has it found through the folders its inputs name, where they still exist.

# how many input folders deep chat_record looks for the data's record (export -> train ->
# capture -> prepare is three)
_CHAT_DEPTH = 6


def chat_record(manifest: dict[str, Any] | None, *, depth: int = 0) -> dict[str, Any] | None:
    """The chat rendering of the data behind `manifest` (a step's manifest, or an input's
    record of one): {chat_template (prepare's file as given, or None: the tokenizer's),
    chat_template_path (that file made absolute, where prepare recorded it),
    chat_template_hash (None where unknown), chat_template_kwargs (KEY=VALUE list),
    system_prompt (regenerate's, else prepare's, or None)}; None where no step before it says
    (no prepare manifest reachable: a peer's draft, a hand-made folder). An input's folder is
    read only while it holds the run the input's record names (its id): a folder made again
    since holds other data."""
    if not isinstance(manifest, dict):
        return None
    if isinstance(manifest.get("chat"), dict):
        return manifest["chat"]
    if manifest.get("step") == "prepare":
        # the settings from the record itself; the template's hash and the regenerate runs it
        # read from the folder's own manifest (an input's record holds only the config)
        config = manifest.get("config") or {}
        own = manifest if "inputs" in manifest else _same_run(manifest, depth)
        regenerated = next((i.get("config") or {} for i in (own or {}).get("inputs") or []
                            if i.get("step") == "regenerate"), {})
        record = {"chat_template": config.get("chat_template"),
                  "chat_template_hash": (own or {}).get("chat_template_hash"),
                  "chat_template_kwargs": list(config.get("chat_template_kwargs") or ()),
                  # regenerate's first: its rows hold it, and prepare's own is added only
                  # to conversations that have none
                  "system_prompt": (regenerated.get("system_prompt")
                                    or config.get("system_prompt"))}
        if (own or {}).get("chat_template_path"):  # the file the name resolved to then
            record["chat_template_path"] = own["chat_template_path"]
        return record
    if depth >= _CHAT_DEPTH:
        return None
    return _first_chat(manifest.get("inputs") or [], lambda item: chat_record(
        item if item.get("step") == "prepare" else _same_run(item, depth), depth=depth + 1))


def _first_chat(inputs, record_of) -> dict[str, Any] | None:
    """The first chat record `record_of` finds among a step's `inputs`, the data it learned
    from before its vocab (made from prepared data too, not necessarily the same)."""
    for item in sorted(inputs, key=lambda i: i.get("step") == "vocab"):
        found = record_of(item)
        if found is not None:
            return found
    return None


def _same_run(record: dict[str, Any], depth: int) -> dict[str, Any] | None:
    """The manifest in the folder an input's `record` names, if it is still that run (same
    id) and the walk is not too deep; else None."""
    if depth >= _CHAT_DEPTH or not record.get("path"):
        return None
    body = peek_manifest(record["path"])
    return body if body is not None and body.get("id") == record.get("id") else None


def draft_chat(folder: str | Path) -> dict[str, Any] | None:
    """chat_record of a --draft folder: an `eyas export` folder, an `eyas train` run, or one of
    its checkpoints (checkpoints/step-N: the run's manifest, two folders up)."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file() and folder.parent.name == "checkpoints":
        folder = folder.parent.parent
    return chat_record(peek_manifest(folder))


def rebaser(manifest: dict, now: Path):
    """A function that reads a path the step of `manifest` recorded as it is now that the
    step's folder is `now`: a work_dir moved or renamed (to a bigger disk, say) holds the same
    runs, which the plan had all run again, the capture deleted and recaptured and the draft
    retrained. Paths inside the folder that held its recorded --out are moved with it, others
    (lists of paths too) are left as they are; where the folder did not move, the identity."""
    was = (manifest.get("config") or {}).get("out")
    if not isinstance(was, str):
        return lambda value: value
    was_path, now_path = Path(os.path.abspath(was)), Path(os.path.abspath(now))
    if was_path == now_path or was_path.name != now_path.name:
        return lambda value: value
    old_root, new_root = str(was_path.parent), str(now_path.parent)

    def rebased(value):
        if isinstance(value, str) and os.path.isabs(value) and (
                value == old_root or value.startswith(old_root + os.sep)):
            return new_root + value[len(old_root):]
        if isinstance(value, list):
            return [rebased(v) for v in value]
        return value

    return rebased
