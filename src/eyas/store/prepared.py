"""A prepared folder's splits (written by `eyas prepare`), read for capture, online training
and eval.
"""

from __future__ import annotations
from pathlib import Path

from eyas.errors import EyasError


def load_saved(path: str | Path, what: str, fix: str):
    """`datasets.load_from_disk(path)`; where its files are damaged or incomplete (a copy cut
    short, a file removed), an EyasError "`what` cannot be read: ... (the reason). `fix`"
    instead of datasets' own error, which names an arrow message or a state.json only."""
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except (OSError, ValueError) as err:  # pyarrow's errors are OSError or ValueError
        first = (str(err).splitlines() or [repr(err)])[0][:200].rstrip(".")
        raise EyasError(f"{what} cannot be read: its files are damaged or incomplete "
                        f"({type(err).__name__}: {first}){fix}") from err


def load_prepared(prepared: str | Path):
    """The DatasetDict of a prepared folder's `dataset/`; an EyasError naming the folder and
    the fix when it is missing, damaged or incomplete (load_saved)."""
    path = Path(prepared) / "dataset"
    if not path.is_dir():
        raise EyasError(f"{prepared} has no dataset/ folder; run `eyas prepare --out {prepared}`.")
    return load_saved(path, f"the prepared data in {path}",
                      f". Run `eyas prepare` again into {prepared} (the same data and settings "
                      f"give the same rows), or copy the folder again from where it was made")


def load_split(prepared: str | Path, split: str, limit: int | None = None):
    """(dataset, split_rows) of a prepared folder; for `all`, train rows then eval rows, and
    `split_rows` maps each split to its [start, end) row range in that order."""
    import datasets

    dd = load_prepared(prepared)
    names = ("train", "eval") if split == "all" else (split,)
    missing = [n for n in names if n not in dd]
    if missing:
        raise EyasError(f"{prepared} has no {missing} split; re-run `eyas prepare` (it writes "
                        f"train and eval) or choose --split from {sorted(dd)}.")
    parts = [dd[n] for n in names]
    ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    split_rows, start = {}, 0
    for n, p in zip(names, parts):
        split_rows[n] = [start, start + len(p)]
        start += len(p)
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
        split_rows = {n: [min(a, limit), min(b, limit)] for n, (a, b) in split_rows.items()}
    return ds, split_rows


def malformed_rows(dataset, rows, chunk: int = 1 << 16) -> dict[int, str]:
    """The rows among `rows` of a prepared split that no forward can take, each with why: no
    tokens, or `num_tokens`, `input_ids` and `loss_mask` of different lengths. Reads the
    lists' lengths only (their arrow offsets), not the tokens."""
    import pyarrow.compute as pc

    wanted, bad = set(rows), {}
    table = dataset.with_format("arrow")
    for start in range(0, len(dataset), chunk):
        part = table[start:start + chunk]
        ids = pc.list_value_length(part["input_ids"]).to_pylist()
        mask = pc.list_value_length(part["loss_mask"]).to_pylist()
        for j, (n, a, b) in enumerate(zip(part["num_tokens"].to_pylist(), ids, mask)):
            if start + j in wanted and (not a or a != n or a != b):
                bad[start + j] = (f"malformed prepared row: num_tokens {n}, {a or 0} input_ids, "
                                  f"{b or 0} loss_mask values; re-run `eyas prepare`")
    return bad
