"""The outputs of `eyas regenerate` and resuming them after an interruption.

The records: a `Job` (an input conversation and the turns to regenerate) ends as a
`Regenerated` conversation, written to `conversations.jsonl`, or a `Rejected` one (with its
kind), written to `rejects.jsonl` (`Output`). A row the servers left `Unanswered` is held back
by `Failing` until an answer shows the failure was the row's own; if the servers went down
instead, it is not written at all, so that the same command redoes it. `what_to_do` tells a
run whose every row failed what to try, by the kinds of its rejects.

Both files, `conversations.jsonl` and `rejects.jsonl`, are append-only and fsynced every
`batch_size` rows, and every line names its input position (file, row). A restarted run
first checks that the folder was made with the same generation settings and inputs
(`check_resume`), cuts a line torn by a kill and skips the positions already written
(`read_previous`), so it never writes a row twice. When every row is done the files are
rewritten in input order (`sort_by_input`), so the result does not depend on concurrency or
on how often the run was interrupted. See docs/regenerate.md.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from eyas.config import to_dict
from eyas.errors import EyasError
from eyas.store.manifest import MANIFEST, placed, placed_data, read_manifest

# RegenerateConfig: from the step eyas.regenerate, named in annotations only (a layer never
# imports a step)

log = logging.getLogger(__name__)

OUTPUT, REJECTS = "conversations.jsonl", "rejects.jsonl"
# Test hook: a run SIGKILLs itself once this many rows are synced, to prove resume works.
KILL_ENV = "EYAS_REGENERATE_KILL_AFTER"
# Settings that change what is generated: a resumed run must keep them.
SAME_ON_RESUME = ("target", "revision", "data", "format", "turns", "max_new_tokens",
                  "drop_truncated", "max_length", "temperature", "top_p", "reasoning",
                  "system_prompt", "seed")
# Of those, the paths: `tiny-llama` and its absolute path name one target.
PATH_SETTINGS = ("target", "data")
# Settings added later, as runs made before they existed behaved: such a run resumes with them.
BEFORE_SETTING = {"drop_truncated": True, "max_length": 0}


@dataclass
class Job:
    """One input conversation and the positions of the assistant turns to regenerate.

    A conversation that ends with a user or tool turn carries an empty assistant turn at the
    end, the slot for the answer to generate.
    """

    file: str
    row: int
    sample_id: str
    messages: list[dict]
    turns: list[int]


@dataclass
class Regenerated:
    """A conversation in the target's words. `truncated`: its last message is an answer cut at
    max_new_tokens; `cut_short`: turns after that answer were left out; `at_length`: left out
    because the next turn's prompt reached max_length."""

    messages: list[dict]
    truncated: bool = False
    cut_short: bool = False
    at_length: bool = False


class Rejected(Exception):
    """A row that cannot be regenerated; `kind` is input, server, length, empty or memory."""

    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.kind = kind


class Unanswered(Rejected):
    """A row whose request failed after every retry, or was refused as every request would be
    (the key, the model name): the servers' fault, maybe not the row's. `at`: when
    (time.monotonic())."""

    def __init__(self, reason: str):
        super().__init__(reason, "server")
        self.at = time.monotonic()


class Output:
    """Append-only conversations.jsonl and rejects.jsonl, fsynced every `sync_every` rows."""

    def __init__(self, folder: Path, sync_every: int):
        self.files = {"ok": open(folder / OUTPUT, "a", encoding="utf-8"),
                      "failed": open(folder / REJECTS, "a", encoding="utf-8")}
        self.sync_every, self.unsynced, self.synced = sync_every, 0, 0
        self.counts: Counter = Counter()
        self.kill_after = int(os.environ.get(KILL_ENV) or 0)
        self.started = self.last_log = time.monotonic()

    def ok(self, job: Job, result: Regenerated) -> None:
        self.counts["truncated"] += result.truncated
        self.counts["cut_short"] += result.cut_short
        self.counts["cut_at_length"] += result.at_length
        record = {"id": job.sample_id, "messages": result.messages,
                  "truncated": result.truncated, "source": {"file": job.file, "row": job.row}}
        if result.cut_short:  # the turns after the last answer were left out
            record["cut_short"] = True
        if result.at_length:  # ... because the next prompt reached --max-length
            record["cut_at_length"] = True
        self._write("ok", record)

    def reject(self, file: str, row: int, sid: str, err: Rejected) -> None:
        self.counts["failed_" + err.kind] += 1
        self._write("failed", {"file": file, "row": row, "sample_id": sid,
                               "reason": str(err), "kind": err.kind})

    def _write(self, what: str, record: dict) -> None:
        self.files[what].write(json.dumps(record, ensure_ascii=False) + "\n")
        self.counts[what] += 1
        self.unsynced += 1
        if self.unsynced >= self.sync_every:
            self.sync()

    def sync(self) -> None:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        self.synced += self.unsynced
        self.unsynced = 0
        if self.kill_after and self.synced >= self.kill_after:
            log.warning("%s=%d: killing this process now (test hook)", KILL_ENV, self.kill_after)
            os.kill(os.getpid(), signal.SIGKILL)
        now = time.monotonic()
        if now - self.last_log > 30:
            self.last_log = now
            log.info("regenerate: %d ok, %d failed, %.2f rows/s", self.counts["ok"],
                     self.counts["failed"], self.synced / (now - self.started))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.sync()
        for f in self.files.values():
            f.close()


class Failing:
    """Rows Unanswered (out of retries, or refused as every request would be) that no answer
    has shown to be their own fault yet, held back from the rejects.

    A row that failed before a request that a server answered was sent failed on its own, and
    `settle` writes it as a reject. As many as `down_after` held at once, the servers went
    down: `settle` raises, and the rows are not written, so that the same command resumes
    them. (An answer to a request sent before the failures proves nothing: a long answer that
    a server finished after its key was rotated had counted as "a server answers again", and
    the rows refused meanwhile were written as final rejects.)
    """

    def __init__(self, down_after: int):
        self.down_after = down_after
        self.rows: list[tuple[Job, Unanswered]] = []
        self.last_sent = float("-inf")  # when the latest request answered was sent
        self._lock = threading.Lock()

    def answered(self, sent: float) -> None:
        """A request sent at `sent` (time.monotonic()) was answered; from any thread."""
        with self._lock:
            self.last_sent = max(self.last_sent, sent)

    def settle(self, output: Output, everything: bool = False) -> None:
        """Write the rows that failed on their own (all of them: `everything`, at the end of
        a run) as rejects; EyasError if the servers went down."""
        held = []
        for job, err in self.rows:
            if everything or err.at < self.last_sent:
                output.reject(job.file, job.row, job.sample_id, err)
            else:
                held.append((job, err))
        self.rows = held
        if len(held) >= self.down_after:
            raise EyasError(
                f"the servers stopped answering: {len(held)} conversations in a row failed, "
                f"out of retries or refused as every request would be (the last: "
                f"{held[-1][1]}). They and the rows in flight are not written: once a server "
                f"answers (with the key and model name it was started with), run the same "
                f"command again and it resumes with them")


def check_resume(cfg: RegenerateConfig, out: Path, sources: list[dict], target: dict,
                 template_hash: str) -> None:
    """Refuse to continue a run in `out` that generated with other settings or inputs, or with
    another model or chat template behind the same --target (`target`: this run's record)."""
    if not (out / MANIFEST).is_file():
        if any((out / name).exists() for name in (OUTPUT, REJECTS)):
            raise EyasError(f"{out} holds {OUTPUT}/{REJECTS} but no {MANIFEST}, so they cannot "
                            f"be resumed safely; pass a new --out or delete them", flag="--out")
        return
    old = read_manifest(out, step="regenerate")
    changed = setting_changes(cfg, old) + target_changes(old, target, template_hash)
    if placed_data(old.get("data_files")) != placed_data(sources):
        changed.append("data file contents")
    wrote = any((out / name).is_file() and (out / name).stat().st_size
                for name in (OUTPUT, REJECTS))
    if changed and not wrote:
        # e.g. the servers did not answer at its start: nothing to resume, nothing to keep
        log.info("%s holds a regenerate run that wrote no row; starting it anew", out)
        return
    if changed:
        raise EyasError(f"{out} holds a regenerate run made with different {', '.join(changed)}; "
                        f"use the same settings to resume it, or pass a new --out", flag="--out")
    if old.get("complete") is False:
        log.info("resuming the interrupted run in %s", out)


def setting_changes(cfg: RegenerateConfig, manifest: dict) -> list[str]:
    """The settings a resumed run must keep (SAME_ON_RESUME) that `cfg` changes from the run
    `manifest` records, each with the value it ran with. `eyas run` starts such a run over.
    A target or data path is compared as the place it names (`placed`), not as spelled."""
    new = json.loads(json.dumps(to_dict(cfg)))
    ran = manifest.get("config") or {}
    was = {k: ran.get(k, BEFORE_SETTING.get(k)) for k in SAME_ON_RESUME}
    same = {k: placed(was[k]) == placed(new[k]) if k in PATH_SETTINGS else was[k] == new[k]
            for k in SAME_ON_RESUME}
    return [f"{k} (it ran with {json.dumps(was[k])})" for k in SAME_ON_RESUME if not same[k]]


# What identifies the model behind --target; compared where both runs recorded it (the openai
# backend records no weights: a server's are not known here).
TARGET_KEYS = ("commit", "tokenizer_hash", "hidden_size", "num_hidden_layers", "vocab_size",
               "gguf_fingerprint", "weights_fingerprint")


def target_changes(manifest: dict, target: dict, template_hash: str) -> list[str]:
    """The target's record and chat template against the run `manifest` records: a folder
    retrained in place, a hub name whose main branch moved or an edited chat template would
    answer the rest of the rows otherwise, and the manifest would name only the new one."""
    was = manifest.get("target") or {}
    changed = [f"target {k} (it ran with {was[k]}, now {target[k]})" for k in TARGET_KEYS
               if was.get(k) is not None and target.get(k) is not None and was[k] != target[k]]
    if manifest.get("chat_template_hash") not in (None, template_hash):
        changed.append(f"chat template (it ran with hash {manifest['chat_template_hash']}, now "
                       f"{template_hash})")
    return changed


# reject kinds --retry-rejects tries again: a server that failed, an answer that did not fit
# the GPU (retried where the backend changed since: another server, more memory); the others
# come from the rows or the settings that shape the answers, which a resume keeps
RETRIED = ("server", "memory")


def read_previous(out: Path, retry_rejects: bool) -> dict[tuple[str, int], str]:
    """(file, row) -> "ok"/"truncated"/"failed" for every row a previous run in `out` wrote
    ("truncated": an ok row whose last answer was cut at max_new_tokens)."""
    done: dict[tuple[str, int], str] = {}
    for name in (OUTPUT, REJECTS):
        _cut_torn_tail(out / name)
    for _, _, rec in _records(out / OUTPUT):
        done[(rec["source"]["file"], rec["source"]["row"])] = (
            "truncated" if rec.get("truncated") else "ok")
    rejects = [rec for _, _, rec in _records(out / REJECTS)]
    if retry_rejects and any(r["kind"] in RETRIED for r in rejects):
        kept = [r for r in rejects if r["kind"] not in RETRIED]
        log.info("retry_rejects: %d rows rejected for server errors or out of memory will be "
                 "tried again", len(rejects) - len(kept))
        _rewrite(out / REJECTS, [json.dumps(r, ensure_ascii=False) + "\n" for r in kept])
        rejects = kept
    for rec in rejects:
        done[(rec["file"], rec["row"])] = "failed"
    return done


def reject_kinds(out: Path) -> Counter:
    """Rows in `out`'s rejects.jsonl per kind: what is on disk, from every run."""
    return Counter(rec["kind"] for _, _, rec in _records(out / REJECTS))


def cut_counts(out: Path) -> Counter:
    """Rows in `out`'s conversations.jsonl marked cut_short / cut_at_length: every run's."""
    counts: Counter = Counter()
    for _, _, rec in _records(out / OUTPUT):
        counts["cut_short"] += bool(rec.get("cut_short") or rec.get("cut_at_length"))
        counts["cut_at_length"] += bool(rec.get("cut_at_length"))
    return counts


def what_to_do(cfg: RegenerateConfig, kinds: Counter) -> str:
    """What a run whose every row failed should try next, for the kinds of its rejects."""
    hints = []
    if kinds.get("server"):
        hints.append(f"kind server: is the server up and serving "
                     f"{cfg.served_model_name or cfg.target}? Then run the same command with "
                     f"--retry-rejects, which retries those rows")
    if kinds.get("input"):
        hints.append("kind input: the rows themselves (their format, or a chat template that "
                     "refuses them); fix the data, then run with a new --out (an --out holds "
                     "one input)")
    if kinds.get("length"):
        hints.append("kind length: raise --max-length or --max-new-tokens, with a new --out "
                     "(a run in this one keeps the settings that shape its answers)")
    if kinds.get("empty"):
        hints.append("kind empty: the target answered nothing; check its chat template and "
                     "--reasoning, then run with a new --out")
    if kinds.get("memory"):
        hints.append("kind memory: the answers did not fit the GPU even one at a time; run "
                     "the same command with --backend openai (a server with more memory) and "
                     "--retry-rejects, which retries those rows, or lower --max-new-tokens "
                     "with a new --out")
    return "; ".join(hints) or "Fix the cause and run again."


def _cut_torn_tail(path: Path) -> None:
    """Cut a last line without its newline: the process was killed while writing it."""
    size = path.stat().st_size if path.is_file() else 0
    if size == 0:
        return
    with open(path, "r+b") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        end = size
        while end > 0:  # scan back for the last complete line
            start = max(0, end - (1 << 16))
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        f.truncate(end)
    log.warning("%s: cut a partial last line (%d bytes) left by an interrupted run", path,
                size - end)


def _records(path: Path) -> Iterator[tuple[int, int, dict]]:
    """(byte offset, byte length, record) of each line of a JSONL output."""
    if not path.is_file():
        return
    offset = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                record = json.loads(line)
            except ValueError:
                raise EyasError(f"line {number} of {path} is not JSON; delete that line (its "
                                f"row is then regenerated) and run again") from None
            yield offset, len(line), record
            offset += len(line)


def _rewrite(path: Path, lines: Iterable[str | bytes]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for line in lines:
            f.write(line.encode() if isinstance(line, str) else line)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sort_by_input(path: Path, order: dict[str, int]) -> None:
    """Rewrite a finished output in input order (rows of files not read this time go last)."""
    index = []  # (file rank, file, row, byte offset, byte length)
    for offset, size, rec in _records(path):
        src = rec.get("source", rec)  # rejects keep file and row at the top level
        index.append((order.get(src["file"], len(order)), src["file"], src["row"], offset, size))
    ranked = sorted(index)
    if ranked == index:
        return
    with open(path, "rb") as f:
        def lines():
            for *_, offset, size in ranked:
                f.seek(offset)
                yield f.read(size)
        _rewrite(path, lines())
