"""Reading chat data: files -> rows -> normalised conversations.

Inputs are JSONL, JSON, Parquet, a `datasets` folder (`save_to_disk`), a folder of such
files, or a glob of any of them. A row is ShareGPT (`conversations` of `from`/`value`, as in
Open-PerfectBlend) or OpenAI/HF `messages` (`role`/`content`); with `fmt="auto"` each row's
format is read from its own keys, so every file (even a mixed one) is read in its format.

`normalize` turns a row into OpenAI `messages` form, `[{"role", "content"}]` with roles
system/user/assistant/tool, or raises `ChatFormatError` saying what is wrong with it.
`read_rows` never raises for a bad row either: it yields the error in the row's place, so a
caller can report it with its file and row number and carry on.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

from eyas.errors import EyasError
from eyas.store.manifest import MANIFEST, peek_manifest

log = logging.getLogger(__name__)

FORMATS = ("auto", "sharegpt", "messages")
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # little- and big-endian byte-order marks
# Column that holds the turns, per format; the first one a row has is used.
TURN_COLUMNS = {"sharegpt": ("conversations", "conversation"), "messages": ("messages",)}
# Input role spelling -> OpenAI role. ShareGPT says human/gpt, OpenAI says user/assistant.
ROLES = {
    "system": "system", "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant",
    "tool": "tool",
}
# Columns that name a row; the first one present becomes its sample id.
ID_COLUMNS = ("id", "sample_id", "conversation_id", "uuid")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ChatFormatError(ValueError):
    """A row that cannot be used; the message is the reason written to rejects.jsonl."""


class ReasoningCutOff(ChatFormatError):
    """An assistant turn that is only reasoning never closed (an answer cut inside its
    `<think>` block at max tokens): stripping its reasoning leaves nothing of it."""


class BlankLine(ChatFormatError):
    """An empty line of a JSON Lines file (`read_rows(..., blank_lines=True)`)."""


class RawRow(NamedTuple):
    """One input row: where it came from and its content (a dict, or why it is unreadable).

    `row` is the 1-based line number in JSONL files and the 0-based record index
    (`dataset[i]`) in JSON, Parquet and `datasets` folders.
    """

    file: str
    row: int
    data: dict | ChatFormatError


# ---------------------------------------------------------------- finding and reading files

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
            raise EyasError(f"data path {path} does not exist; check --data")
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
    as malformed rows)."""
    matches = sorted(glob.glob(spec, recursive=True))
    if not matches:
        raise EyasError(f"no files match {spec!r}; check the --data glob")
    found, passed = [], []
    for match in map(Path, matches):
        if match.is_dir() and not is_datasets_folder(match):
            found.extend(_sources_in(match, passed))  # a folder stands for its files
        elif _is_source(match) and match.name not in _eyas_own_files(match.parent):
            found.append(match)
        elif match.name not in _eyas_own_files(match.parent):
            passed.append(match)
    read = {p for p in found if is_datasets_folder(p)}
    skipped.extend(p for p in passed if read.isdisjoint(p.parents))
    return [p for p in dict.fromkeys(found) if read.isdisjoint(p.parents)]


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
    folders = []
    for spec in map(str, [paths] if isinstance(paths, (str, Path)) else paths):
        matches = sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else [spec]
        folders += [Path(m) for m in matches if Path(m).is_dir()]
    out = {}
    for folder in folders:
        for found in sorted(folder.rglob(MANIFEST)):  # the folder's own first
            manifest = peek_manifest(found.parent)
            if manifest and manifest.get("step") == "regenerate":
                out.setdefault(str(found.parent), {**manifest, "path": str(found.parent)})
    return list(out.values())


def is_datasets_folder(path: Path) -> bool:
    """A `datasets` save_to_disk folder: a DatasetDict (dataset_dict.json) or one Dataset."""
    return path.is_dir() and any(
        (path / name).is_file() for name in ("dataset_dict.json", "state.json"))


def _is_source(path: Path) -> bool:
    return is_datasets_folder(path) or (path.is_file() and path.name.endswith(FILE_SUFFIXES))


def read_rows(paths, fmt: str = "auto", *, blank_lines: bool = False,
              split: str | None = None) -> Iterator[RawRow]:
    """Yield every row of every source in order; unreadable rows come as `ChatFormatError`.

    `fmt` is accepted for symmetry with `normalize` (rows are read the same way in every
    format); it is checked here so a typo fails before any file is read. Blank lines of JSON
    Lines files are not rows; with `blank_lines` they come as `BlankLine` errors, so that a
    caller can account for every line. `split`: of a `datasets` DatasetDict folder, that split
    only (an EyasError if it has none); else every split.
    """
    if fmt not in FORMATS:
        raise EyasError(f"unknown chat format {fmt!r}; use one of {FORMATS}")
    for path in resolve_paths(paths):
        if is_datasets_folder(path):
            yield from _read_datasets_folder(path, split)
        elif path.name.endswith(".parquet"):
            yield from _guarded(path, _read_parquet(path), first=0)
        elif path.name.endswith((".json", ".json.gz")) or _read_whole(path):
            yield from _guarded(path, _read_json(path, blank_lines), first=0)
        else:
            yield from _guarded(path, _read_jsonl(path, _binary_lines(path), blank_lines),
                                first=1)


def _guarded(path: Path, rows: Iterator[RawRow], first: int) -> Iterator[RawRow]:
    """A file that breaks while being read (corrupt gzip / parquet, I/O error) becomes one
    reject at the row where it broke instead of ending the run."""
    row = first
    try:
        for item in rows:
            row = item.row + 1
            yield item
    except (OSError, EOFError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        yield RawRow(str(path), row, ChatFormatError(
            f"file unreadable from here on ({type(err).__name__}: {err})"))


def _read_whole(path: Path) -> bool:
    """Whether a JSON Lines file is read as one JSON text instead, line by line after that
    where it is JSON Lines: one that starts with `[` (a JSON list saved as .jsonl, which read
    line by line would be one reject per line, one per pretty-printed line; its rows are then
    numbered from 0, as in a .json file), or UTF-16 text (whose bytes do not split at b"\n")."""
    try:
        with _open_binary(path) as f:
            head = f.read(4096)
    except (OSError, EOFError):
        return False  # read as JSON Lines, where the error becomes a reject
    if head.startswith(UTF16_BOMS):
        _warn_once(path, "%s is UTF-16 text (as Windows PowerShell writes it): read as such; "
                         "UTF-8 is what other tools expect")
        return True
    if _opens_a_list(head):
        _warn_once(path, "%s starts with '[': a JSON list, not JSON Lines; read as JSON (rows "
                         "numbered from 0; rename it to .json to say so)")
        return True
    return False


def _opens_a_list(data: bytes) -> bool:
    """Whether JSON text starts with `[` (after a UTF-8 byte-order mark and white space)."""
    return data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


_WARNED: set[tuple] = set()  # (path, size, mtime, message): a step reads its data twice


def _warn_once(path: Path, message: str) -> None:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, message)
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message, path)


def _open_binary(path: Path):
    """The file's bytes, gunzipped where its name ends in .gz."""
    return (gzip.open if path.name.endswith(".gz") else open)(path, "rb")


def _binary_lines(path: Path) -> Iterator[bytes]:
    with _open_binary(path) as f:
        yield from f


def _check_dict(file: str, row: int, value: Any) -> RawRow:
    if not isinstance(value, dict):
        return RawRow(file, row, ChatFormatError(
            f"row is a JSON {type(value).__name__}, not an object"))
    bad = _lone_surrogate(value)
    if bad is not None:
        # Valid JSON ("\ud800" escapes) but not Unicode text: no encoder (pyarrow, the
        # tokenizer, a server) takes it, and one such string would end the whole run there.
        return RawRow(file, row, ChatFormatError(
            f"text holds a lone UTF-16 surrogate {bad!r} (an escape such as \\ud800 without "
            f"its pair), which is not valid Unicode; fix or remove that text"))
    return RawRow(file, row, value)


def _lone_surrogate(value: Any) -> str | None:
    """The first string in `value` (nested lists / dicts, keys too) that is not encodable as
    UTF-8, cut to 40 characters, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item[:40]
    return None


def _read_jsonl(path: Path, lines: Iterable[bytes | str],
                blank_lines: bool = False) -> Iterator[RawRow]:
    for number, line in enumerate(lines, start=1):
        try:
            # utf-8-sig: a byte-order mark (Windows tools write one) is not part of the row.
            text = line.decode("utf-8-sig") if isinstance(line, bytes) else line.lstrip("\ufeff")
        except UnicodeDecodeError as err:
            yield RawRow(str(path), number, ChatFormatError(f"line is not UTF-8 text: {err}"))
            continue
        if not text.strip():
            if blank_lines:
                yield RawRow(str(path), number, BlankLine("blank line"))
            continue  # blank lines are not rows
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            yield RawRow(str(path), number, ChatFormatError(f"invalid JSON line: {err}"))
            continue
        yield _check_dict(str(path), number, value)


def _read_json(path: Path, blank_lines: bool = False) -> Iterator[RawRow]:
    data = b"".join(_binary_lines(path))
    try:
        text = _decode(data)
    except UnicodeDecodeError as err:
        if _opens_a_list(data):
            raise  # a list with a bad byte: one reject from row 0 (_guarded)
        # JSON Lines in a .json file: line by line, so a bad byte costs its own line only
        yield from _read_jsonl(path, _split_lines(data, b"\n"), blank_lines)
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        if text.lstrip("\ufeff \t\r\n").startswith("["):
            yield from _list_items(path, text, err)
            return
        # `Dataset.to_json` and many tools write JSON Lines into *.json files. Split on "\n"
        # only: str.splitlines would also cut at U+2028, U+0085 and the like inside strings.
        yield from _read_jsonl(path, _split_lines(text, "\n"), blank_lines)
        return
    if isinstance(value, dict):
        lists = [v for v in value.values() if isinstance(v, list)]
        if any(k in value for cols in TURN_COLUMNS.values() for k in cols):
            value = [value]  # the file is a single conversation
        elif len(lists) == 1:
            value = lists[0]  # {"data": [rows...]}
        else:
            yield RawRow(str(path), 0, ChatFormatError(
                "JSON file is an object without one list of rows; write a list of "
                "conversations or JSON Lines"))
            return
    if not isinstance(value, list):
        yield RawRow(str(path), 0, ChatFormatError(
            f"JSON file holds a {type(value).__name__}; write a list of conversations"))
        return
    for i, item in enumerate(value):
        yield _check_dict(str(path), i, item)


def _split_lines(text, newline):
    """Lines as a JSON Lines reader sees them: the newline that ends the last line starts no
    line after it (split alone made it a blank line past the end of the file)."""
    lines = text.split(newline)
    return lines[:-1] if lines[-1] in ("", b"") else lines


def _decode(data: bytes) -> str:
    """A JSON file's text: UTF-8 (a byte-order mark dropped), or UTF-16 where it starts with
    that encoding's byte-order mark (Windows PowerShell's `>` and Out-File write it)."""
    if data.startswith(UTF16_BOMS):
        return data.decode("utf-16")
    return data.decode("utf-8-sig")


def _list_items(path: Path, text: str, whole: json.JSONDecodeError) -> Iterator[RawRow]:
    """The rows of a JSON list that does not parse as a whole, one by one up to the syntax
    error, then one reject that says where it is (nothing after it can be told apart)."""
    decoder = json.JSONDecoder()
    space = re.compile(r"[\s\ufeff]*")
    pos, index = space.match(text, text.index("[") + 1).end(), 0
    try:
        while pos < len(text) and text[pos] != "]":
            value, pos = decoder.raw_decode(text, pos)
            yield _check_dict(str(path), index, value)
            index += 1
            pos = space.match(text, pos).end()
            if pos < len(text) and text[pos] == ",":
                pos = space.match(text, pos + 1).end()
            elif pos >= len(text) or text[pos] != "]":
                raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
    except json.JSONDecodeError as err:
        whole = err
    yield RawRow(str(path), index, ChatFormatError(
        f"the JSON list breaks at line {whole.lineno} column {whole.colno} ({whole.msg}); "
        f"no row from here on is read: fix the file there"))


def _read_parquet(path: Path) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for item in batch.to_pylist():
            yield RawRow(str(path), index, item)
            index += 1


def dict_splits(path: Path) -> list[str] | None:
    """The split names of a `datasets` DatasetDict folder (its dataset_dict.json, without
    loading the data); None for any other path, a single Dataset folder too."""
    index = path / "dataset_dict.json"
    return (json.loads(index.read_text()).get("splits") or []) if index.is_file() else None


def _read_datasets_folder(path: Path, only: str | None = None) -> Iterator[RawRow]:
    import datasets

    names = dict_splits(path)
    if only is not None and names is not None and only not in names:
        raise EyasError(f"{path} has no '{only}' split (it has {sorted(names)}); pass "
                        f"--split with one of them")
    loaded = datasets.load_from_disk(str(path))
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    if only is not None and names is not None:
        splits = [(only, loaded[only])]
    for split, ds in splits:
        name = str(path) if split is None else f"{path}/{split}"
        for i, item in enumerate(ds):
            yield RawRow(name, i, item)


# ---------------------------------------------------------------- rows -> conversations

def detect_format(row: dict) -> str:
    """'messages' or 'sharegpt' from the row's keys, or ChatFormatError if neither fits."""
    if row.get("messages") is not None:
        return "messages"
    if any(row.get(c) is not None for c in TURN_COLUMNS["sharegpt"]):
        return "sharegpt"
    empty = [c for c in ("messages", *TURN_COLUMNS["sharegpt"]) if c in row]
    if empty:  # the column is there, its value null (a Parquet or datasets gap, say)
        raise ChatFormatError(f"'{empty[0]}' is null: the row holds no conversation")
    keys = ", ".join(sorted(map(str, row))) or "none"
    hint = ("; a 'turns' list of questions is MT-bench's question.jsonl: `eyas eval --bench "
            "mt-bench` reads it, second turns after the target's own answers") \
        if isinstance(row.get("turns"), list) else ""
    raise ChatFormatError(f"no 'conversations' or 'messages' column (row has: {keys}){hint}")


def normalize(row: dict, fmt: str = "auto", *,
              need_assistant: bool = True) -> list[dict]:
    """The row's turns as `[{"role": ..., "content": str}]` (OpenAI roles).

    Raises `ChatFormatError` for an empty conversation, a turn without role or content, an
    unknown role, non-text content or, with `need_assistant` (training data supervises
    assistant turns), a conversation without an assistant turn. `need_assistant=False`
    accepts prompts, such as a lone user turn, for callers that generate the answer.
    A turn's `reasoning_content` (or `reasoning`) is kept, inline as `<think>...</think>`.
    An assistant turn's OpenAI `tool_calls` are kept (its null content becomes ""), and a
    tool turn's `tool_call_id` / `name`: the chat template renders them.
    """
    if not isinstance(row, dict):
        raise ChatFormatError(f"row is a {type(row).__name__}, not an object")
    if fmt == "auto":
        fmt = detect_format(row)
    if fmt not in TURN_COLUMNS:
        raise ValueError(f"unknown chat format {fmt!r}; use one of {FORMATS}")
    column = next((c for c in TURN_COLUMNS[fmt] if row.get(c) is not None), None)
    if column is None:
        raise ChatFormatError(f"no {' or '.join(repr(c) for c in TURN_COLUMNS[fmt])} column "
                              f"for format {fmt}")
    turns = row[column]
    if not isinstance(turns, (list, tuple)):
        raise ChatFormatError(f"'{column}' is a {type(turns).__name__}, not a list of turns")
    if not turns:
        raise ChatFormatError("empty conversation")
    messages = [_normalize_turn(i, turn) for i, turn in enumerate(turns)]
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ChatFormatError("no assistant turn (a prompt-only row: `eyas regenerate` answers "
                              "it with the target first)")
    return messages


def _normalize_turn(i: int, turn: Any) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise ChatFormatError(f"turn {i} is a {type(turn).__name__}, not an object")
    raw_role = _first_present(turn, ("role", "from"))
    if raw_role is None:
        raise ChatFormatError(f"turn {i} has no 'role'/'from'")
    role = ROLES.get(str(raw_role).strip().lower())
    if role is None:
        raise ChatFormatError(f"turn {i} has unknown role {raw_role!r} "
                              f"(known: {', '.join(sorted(ROLES))})")
    raw_content = _first_present(turn, ("content", "value"))
    # `[]` is what many exporters write for a turn without calls: the same as none
    tool_calls = (turn.get("tool_calls") or None) if role == "assistant" else None
    if tool_calls is not None:
        _check_tool_calls(i, tool_calls)
        if raw_content is None:
            raw_content = ""  # an OpenAI tool call has content null: the calls are the turn
    content = _text(i, raw_content)
    reasoning = _first_present(turn, ("reasoning_content", "reasoning"))
    if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
        content = f"{THINK_OPEN}\n{reasoning.strip()}\n{THINK_CLOSE}\n\n{content.lstrip()}"
    message = {"role": role, "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls  # rendered by the chat template, which knows them
    if role == "tool":
        # Templates name the call a result answers by these (OpenAI and HF spellings).
        message.update({k: turn[k] for k in ("tool_call_id", "name")
                        if isinstance(turn.get(k), str)})
    return message


def _check_tool_calls(i: int, calls: Any) -> None:
    """OpenAI `tool_calls`: a non-empty list of {"function": {"name": str, "arguments"}}."""
    ok = isinstance(calls, list) and calls and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)
    if not ok:
        raise ChatFormatError(f"turn {i} has tool_calls that are not a list of OpenAI tool "
                              f"calls ({{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              f"\"arguments\": ...}}}})")


def _first_present(turn: dict, keys: tuple[str, ...]):
    return next((turn[k] for k in keys if turn.get(k) is not None), None)


def _text(i: int, content: Any) -> str:
    """Content as a string; a list of OpenAI text parts is joined with newlines, as vLLM's
    chat endpoint joins them for a template that takes string content (so the draft trains on
    the prompt vLLM serves); anything else refused."""
    if isinstance(content, str):
        return content
    if content is None:
        raise ChatFormatError(f"turn {i} has no content (and no tool_calls)")
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "\n".join(p["text"] for p in content)
    raise ChatFormatError(f"turn {i} content is a {type(content).__name__}, not a string "
                          f"(only text conversations are supported)")


def sample_id(row: dict, file: str, row_number: int) -> str:
    """The row's own id column if it has one, else `file:row`."""
    if isinstance(row, dict):
        for key in ID_COLUMNS:
            value = row.get(key)
            if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
                return str(value)
    return f"{file}:{row_number}"


class Conversation(NamedTuple):
    """A row read and normalised: its messages, or why it cannot be used."""

    file: str
    row: int
    sample_id: str
    messages: list[dict[str, str]] | ChatFormatError


def read_conversations(paths, fmt: str = "auto", *, system_prompt: str | None = None,
                       strip_think: bool = False) -> Iterator[Conversation]:
    """`read_rows` + `normalize` (+ optional system prompt / reasoning strip) per row; a
    turn that is only cut-off reasoning makes its row's error when `strip_think`."""
    for file, row, data in read_rows(paths, fmt):
        if isinstance(data, ChatFormatError):
            yield Conversation(file, row, f"{file}:{row}", data)
            continue
        sid = sample_id(data, file, row)
        try:
            messages = normalize(data, fmt)
            if strip_think:
                messages = strip_reasoning(messages, unclosed=True)
        except ChatFormatError as err:
            yield Conversation(file, row, sid, err)
            continue
        yield Conversation(file, row, sid, with_system_prompt(messages, system_prompt))


# ---------------------------------------------------------------- conversation edits

_THINK_BLOCK = re.compile(re.escape(THINK_OPEN) + r".*?" + re.escape(THINK_CLOSE) + r"\s*",
                          re.DOTALL)


def strip_reasoning(messages: list[dict[str, str]], *,
                    unclosed: bool = False) -> list[dict[str, str]]:
    """Assistant turns without their `<think>...</think>` reasoning.

    Text before a lone `</think>` counts as reasoning too (R1-style outputs whose opening
    tag was part of the prompt). With `unclosed`, so does a `<think>` never closed, to the
    end of its turn (an answer cut inside its reasoning at max tokens, as `eyas regenerate`
    writes it); a turn of nothing else raises ReasoningCutOff, since dropping it silently
    would change the conversation. Without it (regenerate's empty-answer check) such a turn
    keeps its text: it is what the target wrote, trained on with `--reasoning keep`.
    """
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            text = _THINK_BLOCK.sub("", m["content"])
            if THINK_CLOSE in text:
                text = text.split(THINK_CLOSE)[-1]
            if unclosed and THINK_OPEN in text:
                text = text.split(THINK_OPEN)[0]
                if not text.strip() and not m.get("tool_calls"):
                    raise ReasoningCutOff(
                        f"assistant turn {i} is reasoning cut off before its {THINK_CLOSE} (an "
                        f"answer cut at max tokens) and --reasoning strip leaves nothing of it; "
                        f"regenerate with a larger --max-new-tokens, or prepare with "
                        f"--reasoning keep to train on the reasoning")
            m = {**m, "content": text.lstrip()}
        out.append(m)
    return out


def with_system_prompt(messages: list[dict[str, str]], prompt: str | None) -> list[dict[str, str]]:
    """Prepend `prompt` as the system message unless the conversation already has one."""
    if not prompt or any(m["role"] == "system" for m in messages):
        return list(messages)
    return [{"role": "system", "content": prompt}, *messages]


def parse_template_kwargs(pairs: tuple[str, ...]) -> dict:
    """("enable_thinking=false",) -> {"enable_thinking": False} (values read as YAML)."""
    import yaml

    from eyas.config import ConfigError

    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"chat_template_kwargs {pair!r}: the value is not YAML "
                              f"({str(err).splitlines()[0]}); quote it, e.g. "
                              f"{key.strip()}='\"text\"'") from None
    return out
