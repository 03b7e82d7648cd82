"""`eyas prepare`: chat data -> token ids + a loss mask over what the target generates.

Rows are read by `eyas.targets.chat_files` and normalised by `eyas.targets.chat`; each
conversation is rendered with the target tokenizer's own chat template and masked by
`eyas.targets.masking` (assistant content and its end-of-turn token, found from the template
itself, so any template works without per-model code). A row marked `"truncated": true` (`eyas
regenerate` kept an answer cut at its max_new_tokens as the last message) keeps that answer's
text in the mask but not the end-of-turn the template closes it with: the target never wrote it
there. `eyas.targets.tokenized_rows` runs that over the whole input with `datasets`; this module
sets aside malformed and overlong rows, splits train/eval and writes the prepared folder. See
docs/prepare.md.
"""

from __future__ import annotations

import collections
import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from eyas.config import (ConfigError, check_choices, option, out_option, required, revision_option,
                         target_option, to_dict, trust_remote_code_option)
from eyas.errors import EyasError
from eyas.store.manifest import (MANIFEST, chat_template_fingerprint, check_out,
                                 check_same_target, recorded_data, target_record,
                                 write_manifest)
from eyas.store.permissions import as_umask
from eyas.targets.chat_files import FORMATS
from eyas.targets.chat_sources import (check_out_outside, regenerate_outputs, regenerated_files,
                                       source_fingerprints)
# documented as eyas.prepare.tokenize_conversation and eyas.prepare.render_prompt
from eyas.targets.masking import (check_template_compiles, render_prompt,  # noqa: F401
                                  tokenize_conversation)
from eyas.targets.tokenized_rows import tokenize_rows

log = logging.getLogger(__name__)

# What a prepare output folder holds; an earlier prepare run's copies are replaced.
PAYLOAD = ("dataset", "token_counts.safetensors", "rejects.jsonl", MANIFEST, ".work")
NEW_FILES = ("dataset", "token_counts.safetensors", "rejects.jsonl")  # made in .work/new


@dataclass(frozen=True)
class PrepareConfig:
    """Turn chat data into token ids and assistant-only loss masks for the target."""

    target: str = target_option()
    data: tuple[str, ...] = required(
        "chat data: .jsonl/.json/.parquet files, datasets folders (save_to_disk) or globs")
    out: str = out_option("output folder (prepared/)")
    tokenizer: str | None = option(None, "load the tokenizer from here instead of --target")
    revision: str | None = revision_option()
    trust_remote_code: bool = trust_remote_code_option()
    format: str = option("auto", "row format; auto reads each row's own keys",
                         choices=FORMATS)
    chat_template: str | None = option(None, "Jinja chat template file to use instead of the "
                                             "tokenizer's own (must match serving)")
    chat_template_kwargs: tuple[str, ...] = option(
        (), "KEY=VALUE variables for the chat template, e.g. enable_thinking=false")
    system_prompt: str | None = option(None, "system message for conversations that have none")
    last_turn_only: bool = option(False, "supervise only the last assistant turn")
    reasoning: str = option("keep", "keep or strip <think>...</think> in assistant turns",
                            choices=("keep", "strip"))
    max_length: int = option(2048, "longest sample in tokens")
    length_policy: str = option("drop", "what to do with longer samples",
                                choices=("drop", "truncate"))
    eval_fraction: float = option(0.02, "fraction of kept conversations held out as 'eval'")
    seed: int = option(0, "seed of the train/eval split")
    num_proc: int = option(1, "processes for tokenization")

    def __post_init__(self):
        check_choices(self)
        if not self.data:
            raise ConfigError("data is empty; give --data FILE_OR_GLOB")
        if self.max_length < 2:
            raise ConfigError(f"max_length must be >= 2, got {self.max_length}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.num_proc < 1:
            raise ConfigError(f"num_proc must be >= 1, got {self.num_proc}")
        bad = [kv for kv in self.chat_template_kwargs if "=" not in kv]
        if bad:
            raise ConfigError(f"chat_template_kwargs {bad}: write each as KEY=VALUE, "
                              f"e.g. enable_thinking=false")


@dataclass(frozen=True)
class PrepareSummary:
    """What `prepare` kept and set aside (also logged and stored as the manifest's stats)."""

    kept: int
    dropped_too_long: int
    truncated: int  # kept rows cut to max_length (length_policy truncate)
    truncated_answers: int  # kept rows whose last answer regenerate cut ("truncated": true)
    rejected: int
    tokens: int
    masked_tokens: int
    train: int
    eval: int
    out: str
    blank_lines: int = 0  # empty lines of JSON Lines inputs (listed in rejects.jsonl too)
    # every input row and blank line: kept + dropped_too_long + rejected + blank_lines
    # + reasoning_cut_off
    rows: int = 0
    duplicate_ids: int = 0  # kept rows whose sample id an earlier kept row has
    max_length: int = 0  # the limit applied: --max-length, or the target's, if smaller
    # kept rows with an assistant turn of no text (nor a tool call): only its end-of-turn
    # token is trained on there, which teaches the draft to end answers at once
    empty_answers: int = 0
    empty_questions: int = 0
    # rows set aside by --reasoning strip: an assistant turn was only reasoning cut off
    # before its </think> (regenerate's answer cut at max tokens), so nothing of it is left
    reasoning_cut_off: int = 0


# How the step runs, not what it writes (its output is the same for any count: tests)
PrepareConfig.RESULT_NEUTRAL = frozenset({"num_proc"})


# ---------------------------------------------------------------- the step

def load_tokenizer(cfg: PrepareConfig):
    """The target's tokenizer (never its weights), with --chat-template applied."""
    from eyas.targets.models import load_tokenizer as load

    name = cfg.tokenizer or cfg.target
    tok = load(name, revision=None if cfg.tokenizer else cfg.revision,
               trust_remote_code=cfg.trust_remote_code, chat_template=cfg.chat_template)
    if not tok.chat_template:
        raise EyasError(f"the tokenizer of {name} has no chat template; give the one the "
                        f"target is served with: --chat-template FILE.jinja")
    check_template_compiles(tok.chat_template, cfg.chat_template or f"the tokenizer of {name}")
    return tok


def _target_config(cfg: PrepareConfig):
    """The target's config (for the manifest and vocab size), or None if unavailable (a
    run with --tokenizer only). Through eyas.targets.models.load_config, so a .gguf target works."""
    from eyas.targets.models import load_config

    try:
        return load_config(cfg.target, revision=cfg.revision,
                           trust_remote_code=cfg.trust_remote_code)
    except EyasError as err:
        log.warning("no model config for %s (%s); the manifest records the tokenizer only",
                    cfg.target, err)
        return None


def _claim_out(out: Path, cfg: PrepareConfig) -> None:
    """Make sure `out` may be written: refuse another step's (or a user's) files
    (store.manifest.check_out, every step's one --out policy). An earlier prepare output is
    replaced only once the new one is complete (_replace): a run that fails or is stopped
    leaves it as it was."""
    check_out(out, "prepare", own=PAYLOAD, unfinished=PAYLOAD)
    if (out / MANIFEST).is_file():
        old = json.loads((out / MANIFEST).read_text())
        changed = sorted(k for k, v in to_dict(cfg).items()
                         if (old.get("config") or {}).get(k) != v and k != "num_proc")
        if changed:
            log.warning("replacing the prepare output in %s once this run ends (config "
                        "changed: %s)", out, ", ".join(changed))
    shutil.rmtree(out / ".work", ignore_errors=True)  # a killed run's
    out.mkdir(parents=True, exist_ok=True)


def _replace(out: Path, new: Path) -> None:
    """Move the complete new output in `new` into `out`, over an earlier one: its manifest
    goes first, so a folder caught half-replaced has none and is not taken as complete."""
    for name in (MANIFEST, *NEW_FILES):
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for name in NEW_FILES:
        (new / name).rename(out / name)


def _regenerated_for(cfg: PrepareConfig, target: dict, config, tok) -> list[dict]:
    """The `eyas regenerate` folders in --data (their manifests, recorded as this output's
    inputs), each refused if another target answered it (another tokenizer, shape or GGUF, or
    the same shape with other weights: a fine-tune, the base model): the draft learns the
    answers of the model it drafts for; one asked in another chat template is warned about.
    (An unfinished one is refused where its files are read: resolve_paths.) A regenerate
    folder's conversations file named by itself is recorded too, unchecked: its system prompt
    is the data's (eval renders with it)."""
    found = regenerate_outputs(cfg.data)
    rendered = chat_template_fingerprint(tok)  # the template prepare renders in
    weighed = any((m.get("target") or {}).get("weights_fingerprint") for m in found)
    # this target's weights fingerprint only where an answer's is there to compare with
    mine = target_record(cfg.target, cfg.revision, config=config, tokenizer=tok) \
        if weighed else target
    for manifest in found:
        folder = manifest["path"]
        knowingly = f"pass its file {folder}/conversations.jsonl"
        check_same_target(
            manifest.get("target"), target, f"the `eyas regenerate` output {folder} in --data",
            fix=f"regenerate its prompts with --target {cfg.target}, or, to train on another "
                f"model's answers knowingly, {knowingly}", weights=False)
        a = (manifest.get("target") or {}).get("weights_fingerprint")
        b = mine.get("weights_fingerprint")
        if a and b and a != b:
            raise EyasError(
                f"the `eyas regenerate` output {folder} in --data holds the answers of "
                f"{manifest['target'].get('name_or_path')} (weights_fingerprint={a}), and "
                f"--target {cfg.target} has the same tokenizer and shape but other weights "
                f"({b}): another checkpoint or a fine-tune, which answers otherwise when "
                f"served. Regenerate its prompts with --target {cfg.target}, or, to train on "
                f"those answers knowingly (the same model saved in another precision, say), "
                f"{knowingly}")
        # (the openai backend's server renders with its own: known only where given)
        ran = manifest.get("config") or {}
        asked = manifest.get("chat_template_hash") \
            if ran.get("backend") != "openai" or ran.get("chat_template") else None
        if asked and asked != rendered:
            log.warning("the answers in the `eyas regenerate` output %s were asked in another "
                        "chat template (chat_template_hash %s) than prepare renders them in "
                        "(%s): the draft then learns answers to prompts written otherwise "
                        "than served. Give prepare the template regenerate asked in "
                        "(--chat-template FILE, its config's chat_template), or regenerate in "
                        "prepare's (eyas regenerate --chat-template FILE)", folder, asked,
                        rendered)
    named = {m["path"] for m in found}
    return found + [m for m in regenerated_files(cfg.data) if m["path"] not in named]


def _split(kept: np.ndarray, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train / eval row indices (each in input order)."""
    n = len(kept)
    n_eval = max(1, round(n * fraction)) if fraction > 0 and n >= 2 else 0
    perm = np.random.default_rng(seed).permutation(n)
    eval_rows = np.sort(kept[perm[:n_eval]])
    train_rows = np.sort(kept[perm[n_eval:]])
    return train_rows.tolist(), eval_rows.tolist()


def _token_counts(train, vocab_size: int) -> np.ndarray:
    """Occurrences of each token id among loss-masked train tokens, int64 [vocab_size]."""
    import pyarrow.compute as pc

    counts = np.zeros(vocab_size, dtype=np.int64)
    for table in train.with_format("arrow").iter(batch_size=4096):
        ids = pc.list_flatten(table["input_ids"]).to_numpy(zero_copy_only=False)
        mask = pc.list_flatten(table["loss_mask"]).to_numpy(zero_copy_only=False)
        counts += np.bincount(ids[mask == 1], minlength=vocab_size)
    return counts


# status of a row that is not kept -> its `kind` in rejects.jsonl
SET_ASIDE = {"rejected": "malformed", "too_long": "too_long", "blank": "blank",
             "cut_off": "reasoning_cut_off"}


def _write_rejects(path: Path, ds, status: np.ndarray) -> None:
    """Every input row not kept, in input order: {"file", "row", "reason", "sample_id", "kind"}."""
    rows = ds.select(np.flatnonzero(np.isin(status, list(SET_ASIDE))).tolist())
    with open(path, "w", encoding="utf-8") as f:
        for rec in rows.select_columns(["file", "row", "reason", "sample_id", "status"]):
            rec["kind"] = SET_ASIDE[rec.pop("status")]
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def _max_length(cfg: PrepareConfig, text_config) -> int:
    """--max-length, or the target's max_position_embeddings if smaller: capture and training
    must not run the target past the positions it was trained on."""
    limit = getattr(text_config, "max_position_embeddings", None)  # absent in a few configs
    if isinstance(limit, int) and 1 < limit < cfg.max_length:
        log.warning("--max-length %d is more than the target's max_position_embeddings %d: "
                    "prepare applies %d (longer rows: --length-policy %s)", cfg.max_length,
                    limit, limit, cfg.length_policy)
        return limit
    return cfg.max_length


def _duplicate_ids(sample_ids: list[str]) -> int:
    """Rows whose id an earlier row has; logged, since capture sets samples aside by id."""
    counts = collections.Counter(sample_ids)
    repeated = {k: n for k, n in counts.items() if n > 1}
    if repeated:
        log.warning("%d kept rows repeat an earlier row's id (%s): all are kept; ids should "
                    "be unique, since later steps name samples by id",
                    sum(repeated.values()) - len(repeated),
                    ", ".join(f"{k!r} x{n}" for k, n in list(repeated.items())[:5]))
    return sum(repeated.values()) - len(repeated)


def prepare(cfg: PrepareConfig) -> PrepareSummary:
    """Tokenize `cfg.data` for `cfg.target` into `cfg.out` (see docs/architecture.md)."""
    out = Path(cfg.out)
    check_out_outside(cfg.data, out, "prepare")
    # also fails early on a missing path; files unchanged since the output in `out`: not read
    data_record = source_fingerprints(cfg.data, recorded_data(out, "prepare"))
    tok = load_tokenizer(cfg)
    config = _target_config(cfg)
    text_config = config.get_text_config() if config is not None else None
    # Count over the model's (possibly padded) vocabulary, which the draft's t2d spans. A
    # tokenizer with more tokens than the model's embedding (another model's, or one given
    # added tokens without resizing the model): rows holding those ids are set aside, counted
    rows = getattr(text_config, "vocab_size", None) or None
    embedding_rows = rows if rows and len(tok) > rows else None
    vocab_size = embedding_rows or max(len(tok), rows or 0)
    if embedding_rows is not None:
        log.warning("the tokenizer of %s has %d tokens, more than the model's %d embedding rows "
                    "(vocab_size): rows holding the ids past them are set aside as rejected "
                    "(eyas doctor checks the pair); is the tokenizer the model's own?",
                    cfg.target, len(tok), rows)
    max_length = _max_length(cfg, text_config)
    target = target_record(cfg.target, cfg.revision, config=config, tokenizer=tok,
                           weights=False)
    regenerated = _regenerated_for(cfg, target, config, tok)
    _claim_out(out, cfg)
    work, keep_work = out / ".work", False
    try:
        summary = _write_dataset(cfg, tok, work, vocab_size, max_length, embedding_rows)
        _replace(out, work / "new")
    except NoUsableRows as err:
        # the reasons must stay readable: in `out` if it held no earlier output, else beside
        # that output (which is kept), in .work (the next run clears it)
        shown = out / "rejects.jsonl"
        if (out / MANIFEST).is_file():
            shown, keep_work = err.rejects, True
        else:
            err.rejects.rename(shown)
        raise EyasError(f"{err} (reasons in {shown}"
                        + ("; the earlier output in this folder is kept as it was)"
                           if keep_work else ")")) from None
    finally:
        if not keep_work:
            shutil.rmtree(work, ignore_errors=True)
    stats = {k: v for k, v in asdict(summary).items() if k not in ("out", "max_length")}
    write_manifest(out, "prepare", cfg, target=target, inputs=regenerated,
                   stats=stats, chat_template_hash=chat_template_fingerprint(tok),
                   # the file where it is, for a later step run from another directory (not
                   # in the id: the same file named from elsewhere is the same preparation)
                   chat_template_path=(str(Path(cfg.chat_template).resolve())
                                       if cfg.chat_template else None),
                   max_length=max_length,
                   max_position_embeddings=getattr(text_config, "max_position_embeddings", None),
                   vocab_size=vocab_size, data_files=data_record)
    _log_summary(summary, out, cfg)
    return summary


def _length_fix(cfg: PrepareConfig, max_length: int) -> str:
    """The flags that keep rows longer than `max_length` (the limit applied), for messages."""
    if cfg.length_policy == "truncate":
        return ""
    raise_it = ("--max-length raises the limit, " if max_length == cfg.max_length else
                "the target's max_position_embeddings caps it, ")
    return f" ({raise_it}--length-policy truncate keeps their first {max_length} tokens)"


class NoUsableRows(EyasError):
    """Not one input row can be kept; `rejects` is the file that says why, row by row."""

    def __init__(self, message: str, rejects: Path):
        super().__init__(message)
        self.rejects = rejects


def _write_dataset(cfg: PrepareConfig, tok, work: Path, vocab_size: int,
                   max_length: int, embedding_rows: int | None = None) -> PrepareSummary:
    """Tokenize (cache in `work`), then write rejects.jsonl, dataset/ and
    token_counts.safetensors into `work`/new."""
    import datasets
    from safetensors.numpy import save_file

    ds = tokenize_rows(cfg, tok, work, max_length, embedding_rows)
    out = work / "new"
    out.mkdir(parents=True, exist_ok=True)
    status = np.asarray(ds["status"], dtype=object)
    _write_rejects(out / "rejects.jsonl", ds, status)
    kept = np.flatnonzero((status == "ok") | (status == "truncated"))
    if len(kept) == 0:
        raise NoUsableRows(f"no usable conversations in {list(cfg.data)}: {len(status)} rows, "
                           f"{int((status == 'rejected').sum())} rejected, "
                           f"{int((status == 'too_long').sum())} longer than max_length "
                           f"{max_length}{_length_fix(cfg, max_length)}, "
                           f"{int((status == 'blank').sum())} blank lines, "
                           f"{int((status == 'cut_off').sum())} only reasoning cut off "
                           f"(--reasoning strip)",
                           out / "rejects.jsonl")
    train_rows, eval_rows = _split(kept, cfg.eval_fraction, cfg.seed)
    columns = ["input_ids", "loss_mask", "sample_id", "num_tokens", "messages_json"]
    splits = datasets.DatasetDict({
        "train": ds.select(train_rows).select_columns(columns),
        "eval": ds.select(eval_rows).select_columns(columns)})
    # An empty split needs one (empty) shard or it cannot be loaded back.
    splits.save_to_disk(str(out / "dataset"),
                        num_shards={k: None if len(v) else 1 for k, v in splits.items()})
    save_file({"counts": _token_counts(splits["train"], vocab_size)},
              str(out / "token_counts.safetensors"))
    as_umask(out / "token_counts.safetensors")  # safetensors writes owner-only
    num_tokens = np.asarray(ds["num_tokens"], dtype=np.int64)[kept]
    num_masked = np.asarray(ds["num_masked"], dtype=np.int64)[kept]
    cut_answer = np.asarray(ds["truncated"], dtype=bool)[kept]
    empty = np.asarray(ds["empty_answer"], dtype=bool)[kept]
    if empty.any():
        ids = [ds[int(i)]["sample_id"] for i in kept[empty][:5]]
        log.warning("%d kept conversation(s) hold an assistant turn with no text (and no tool "
                    "call), e.g. %s: only its end-of-turn token is trained on, which teaches "
                    "the draft to end answers at once; drop or fill those turns (eyas "
                    "regenerate answers them)", int(empty.sum()), ids)
    asked_nothing = np.asarray(ds["empty_question"], dtype=bool)[kept]
    if asked_nothing.any():
        ids = [ds[int(i)]["sample_id"] for i in kept[asked_nothing][:5]]
        log.warning("%d kept conversation(s) hold a user turn with no text, e.g. %s: the "
                    "answer after it is trained on as a reply to nothing; fill or drop those "
                    "rows (eyas regenerate refuses them)", int(asked_nothing.sum()), ids)
    return PrepareSummary(
        kept=len(kept), dropped_too_long=int((status == "too_long").sum()),
        truncated=int((status == "truncated").sum()),
        truncated_answers=int(cut_answer.sum()), rejected=int((status == "rejected").sum()),
        tokens=int(num_tokens.sum()), masked_tokens=int(num_masked.sum()),
        train=len(train_rows), eval=len(eval_rows), out=str(work.parent),
        blank_lines=int((status == "blank").sum()), rows=len(status),
        duplicate_ids=_duplicate_ids(ds.select(kept.tolist())["sample_id"]),
        max_length=max_length, empty_answers=int(empty.sum()),
        empty_questions=int(asked_nothing.sum()),
        reasoning_cut_off=int((status == "cut_off").sum()))


def _log_summary(s: PrepareSummary, out: Path, cfg: PrepareConfig) -> None:
    log.info("prepare: %d input rows = kept %d conversations (train %d, eval %d; %d truncated "
             "to max_length %d; %d end in a truncated answer, its end-of-turn not supervised) "
             "+ dropped %d too long + rejected %d + %d blank lines + %d reasoning cut off; "
             "%d tokens, %d supervised -> %s", s.rows, s.kept, s.train, s.eval, s.truncated,
             s.max_length, s.truncated_answers, s.dropped_too_long, s.rejected, s.blank_lines,
             s.reasoning_cut_off, s.tokens, s.masked_tokens, out)
    if s.reasoning_cut_off:
        log.warning("%d rows set aside by --reasoning strip: an assistant turn is only "
                    "reasoning cut off before its </think> (an answer cut at max tokens), "
                    "which leaves nothing of it; regenerate with a larger --max-new-tokens, "
                    "or prepare with --reasoning keep (rows listed in %s, kind "
                    "reasoning_cut_off)", s.reasoning_cut_off, out / "rejects.jsonl")
    if s.rejected or s.dropped_too_long or s.blank_lines:
        log.warning("%d rows set aside (%d malformed, %d too long%s, %d blank lines): file, "
                    "row and reason of each in %s",
                    s.rejected + s.dropped_too_long + s.blank_lines, s.rejected,
                    s.dropped_too_long, _length_fix(cfg, s.max_length) if s.dropped_too_long
                    else "", s.blank_lines, out / "rejects.jsonl")
