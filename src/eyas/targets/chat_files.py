"""Reading chat data files: sources -> raw rows, one dict per row.

JSON Lines, JSON (a list, an object holding one list, or one conversation), Parquet and
`datasets` folders; gzipped files; UTF-8 with or without a byte-order mark, or UTF-16.
`read_rows` never raises for a bad row: it yields the `ChatFormatError` that says why it is
unreadable in the row's place, so a caller can report it with its file and row number and
carry on. Which sources --data names is `eyas.targets.chat_sources`; turning a row into a
conversation is `eyas.targets.chat`.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

from eyas.errors import EyasError
from eyas.store.prepared import load_saved
from eyas.targets.chat_sources import dict_splits, is_datasets_folder, resolve_paths

log = logging.getLogger(__name__)

FORMATS = ("auto", "sharegpt", "messages")
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # little- and big-endian byte-order marks
# Column that holds the turns, per format; the first one a row has is used.
TURN_COLUMNS = {"sharegpt": ("conversations", "conversation"), "messages": ("messages",)}


class ChatFormatError(ValueError):
    """A row that cannot be used; the message is the reason written to rejects.jsonl."""


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
    return _opens_a_list(head)  # (_read_json warns where it is a list: _said_a_list)


def _said_a_list(path: Path) -> None:
    """A file not named .json that _read_json reads as one JSON list says so."""
    if not path.name.endswith((".json", ".json.gz")):
        _warn_once(path, "%s starts with '[': a JSON list, not JSON Lines; read as JSON (rows "
                         "numbered from 0; rename it to .json to say so)")


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
    """The rows of a JSON file: a list (or {"data": [...]}, or one conversation), or JSON Lines
    in a .json file (as `Dataset.to_json` writes it). A file that breaks part way (a cut .gz,
    a byte that is not UTF-8 inside a list) keeps the rows before the break, and the rest
    becomes one reject at the row where it broke (_guarded: the error is raised after them)."""
    data, broken = _read_bytes(path)
    try:
        text = _decode(data)
    except UnicodeDecodeError as err:
        if not _opens_a_list(data):
            # JSON Lines in a .json file: line by line, so a bad byte costs its own line only
            yield from _read_jsonl(path, _split_lines(_whole_lines(data, broken), b"\n"),
                                   blank_lines)
            if broken:
                raise broken
            return
        # a list: its rows up to that byte (utf-8-sig counts from after a byte-order mark)
        cut = err.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        text, broken = _decode(data[:cut]), err
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        named_json = path.name.endswith((".json", ".json.gz"))
        if text.lstrip("\ufeff \t\r\n").startswith("[") and (
                named_json or not _list_line_first(text)):
            _said_a_list(path)
            yield from _list_items(path, text, err, cut=broken is not None)
        else:
            # `Dataset.to_json` and many tools write JSON Lines into *.json files, and a JSON
            # Lines file may start with a row that is a list. Split on "\n" only:
            # str.splitlines would also cut at U+2028, U+0085 and the like inside strings.
            yield from _read_jsonl(path, _split_lines(_whole_lines(text, broken), "\n"),
                                   blank_lines)
        if broken:
            raise broken
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
    if text.lstrip("\ufeff \t\r\n").startswith("["):
        _said_a_list(path)
    for i, item in enumerate(value):
        yield _check_dict(str(path), i, item)
    if broken:
        raise broken


def _read_bytes(path: Path) -> tuple[bytes, Exception | None]:
    """The file's bytes (gunzipped), and the error that cut them short (a .gz cut or damaged,
    an I/O error), if any: every byte before it is kept. (gzip's reader drops what it had
    decompressed in the call that finds the cut: on a small file, all of it.)"""
    try:
        raw = path.read_bytes()
    except OSError as err:
        return b"", err
    if not path.name.endswith(".gz"):
        return raw, None
    out, pos, step = [], 0, 1 << 16
    end, view = len(raw.rstrip(b"\0")), memoryview(raw)  # (zero padding after the members)
    try:
        while pos < end:  # member by member (bgzip and `cat a.gz b.gz` write thousands)
            member = zlib.decompressobj(wbits=31)
            for at in range(pos, len(raw), step):
                out.append(member.decompress(view[at:at + step]))
                if member.eof:
                    pos = min(at + step, len(raw)) - len(member.unused_data)
                    break
            else:
                return b"".join(out), EOFError(
                    "Compressed file ended before the end-of-stream marker was reached")
    except zlib.error as err:
        return b"".join(out), OSError(f"the gzip data is damaged: {err}")
    return b"".join(out), None


def _whole_lines(text, broken):
    """JSON Lines text without the line a break cut in two (that line is in the break's
    reject, not a malformed row of its own)."""
    if not broken:
        return text
    end = text.rfind(b"\n" if isinstance(text, bytes) else "\n")
    return text[:end + 1]


def _list_line_first(text: str) -> bool:
    """Whether text that opens with `[` but is not one JSON value is JSON Lines whose first
    row is a list: a whole JSON value on the first line, with more on later lines. (Read as
    a list, that line's items became rows and every later row was lost at the list's end.)"""
    start = len(text) - len(text.lstrip("\ufeff \t\r\n"))
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return False
    rest = text[end:]
    gap = rest[:len(rest) - len(rest.lstrip())]
    return "\n" not in text[start:end] and "\n" in gap and bool(rest.strip())


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


def _list_items(path: Path, text: str, whole: json.JSONDecodeError,
                cut: bool = False) -> Iterator[RawRow]:
    """The rows of a JSON list that does not parse as a whole, one by one up to the syntax
    error, then one reject that says where it is (nothing after it can be told apart). `cut`:
    the text ends where the file broke, which the caller reports instead."""
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
    if cut:
        return
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


def _read_datasets_folder(path: Path, only: str | None = None) -> Iterator[RawRow]:
    import datasets

    names = dict_splits(path)
    if only is not None and names is not None and only not in names:
        raise EyasError(f"{path} has no '{only}' split (it has {sorted(names)}); pass "
                        f"--split with one of them")
    loaded = load_saved(path, f"the datasets folder {path}",
                        "; save it again (Dataset.save_to_disk) or copy it again from where "
                        "it was made")
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    if only is not None and names is not None:
        splits = [(only, loaded[only])]
    for split, ds in splits:
        name = str(path) if split is None else f"{path}/{split}"
        for i, item in enumerate(ds):
            yield RawRow(name, i, item)
