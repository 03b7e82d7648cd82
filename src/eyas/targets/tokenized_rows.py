"""Chat rows -> one `datasets` Dataset of token ids, a loss mask and a status per row, for
`eyas prepare` (eyas.prepare keeps, splits and writes them).

Every input row and blank line becomes one record (`_records`: the normalised conversation
as JSON, its `truncated` mark, or why it is unusable), then one tokenized row (`_process`:
the conversation rendered with the target's chat template and masked by
eyas.targets.masking, with status ok / truncated / too_long / rejected / cut_off / blank).
`tokenize_rows` runs both over the whole input with `datasets` (cached, `--num-proc`
processes). `cfg` below is an eyas.prepare.PrepareConfig.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eyas.config import to_dict
from eyas.errors import EyasError
from eyas.store.manifest import chat_template_fingerprint, tokenizer_fingerprint
from eyas.targets import chat
from eyas.targets.chat import parse_template_kwargs
from eyas.targets.chat_files import BlankLine, ChatFormatError, read_rows
from eyas.targets.masking import tokenize_conversation


def _truncated(data: dict) -> bool:
    """A row's `truncated` mark (regenerate's output): true, false, or absent (false)."""
    flag = data.get("truncated")
    if flag is not None and not isinstance(flag, bool):
        raise ChatFormatError(f"'truncated' is {flag!r}; it must be true or false")
    return bool(flag)


def _records(paths: tuple[str, ...], fmt: str, system_prompt: str | None, strip: bool):
    """Dataset rows: the normalised conversation as JSON and its `truncated` mark, or the
    reason it is unusable (`cut_off`: reasoning cut off, which `strip` leaves nothing of), or
    a blank line (so that every line is accounted for).
    (`chat.read_conversations` with the raw row's mark kept.)"""
    for file, row, data in read_rows(paths, fmt, blank_lines=True):
        rec = {"file": file, "row": row, "sample_id": f"{file}:{row}", "messages_json": "",
               "truncated": False, "error": "", "cut_off": False,
               "blank": isinstance(data, BlankLine)}
        try:
            if isinstance(data, ChatFormatError):
                raise data
            rec["sample_id"] = chat.sample_id(data, file, row)
            messages = chat.normalize(data, fmt)
            rec["truncated"] = _truncated(data)
            if strip:
                messages = chat.strip_reasoning(messages, unclosed=True)
        except ChatFormatError as err:
            rec["error"] = str(err)
            rec["cut_off"] = isinstance(err, chat.ReasoningCutOff)
            yield rec
            continue
        messages = chat.with_system_prompt(messages, system_prompt)
        rec["messages_json"] = json.dumps(messages, ensure_ascii=False)
        yield rec


def _process(rec: dict, *, tokenizer, mask_kwargs: dict, max_length: int,
             truncate: bool, embedding_rows: int | None = None, capped: bool = False) -> dict:
    """One conversation -> ids, mask and a status: ok / truncated / too_long / rejected /
    cut_off / blank. `embedding_rows`: the target's, where its tokenizer has more tokens
    (a row holding one of those would end its forward in an index error); `capped`:
    `max_length` is the target's max_position_embeddings, below --max-length (the reasons
    then name it, since no --max-length raises it)."""
    status = "blank" if rec["blank"] else "cut_off" if rec["cut_off"] else "rejected"
    out = {"input_ids": [], "loss_mask": [], "num_tokens": 0, "num_masked": 0,
           "status": status, "reason": rec["error"],
           "empty_answer": False, "empty_question": False}
    if rec["error"]:
        return out
    messages = json.loads(rec["messages_json"])
    out["empty_answer"] = any(m["role"] == "assistant" and not m.get("tool_calls")
                              and not chat.has_text(m) for m in messages)
    out["empty_question"] = any(m["role"] == "user" and not chat.has_text(m) for m in messages)
    try:
        ids, mask = tokenize_conversation(tokenizer, messages,
                                          truncated=rec["truncated"], **mask_kwargs)
    except ChatFormatError as err:
        out["reason"] = str(err)
        return out
    if embedding_rows is not None and ids and max(ids) >= embedding_rows:
        out["reason"] = (f"token id {max(ids)} is past the target's {embedding_rows} embedding "
                         f"rows (its config's vocab_size): the tokenizer has more tokens than "
                         f"the model; check that the tokenizer is the target's own")
        return out
    if not any(mask):
        out["reason"] = ("no assistant tokens to supervise: the only assistant turn is the "
                         "first message, taken as context (nothing prompts it)"
                         if _answers_first(messages)
                         else "no assistant tokens to supervise (empty or unplaceable turns)")
        return out
    status = "ok"
    if len(ids) > max_length:
        full = len(ids)
        limit = "the target's max_position_embeddings" if capped else "--max-length"
        out["reason"] = (f"{full} tokens > max_length {max_length} ({limit}; "
                         f"--length-policy truncate keeps the first {max_length})")
        ids, mask = ids[:max_length], mask[:max_length]
        # A cut that leaves nothing to learn from is as useless as a dropped sample.
        status = "truncated" if truncate and any(mask) else "too_long"
        if truncate and status == "too_long":
            out["reason"] = (f"{full} tokens > max_length {max_length}, and "
                             f"its first {max_length} hold no assistant token (the prompt "
                             f"alone is longer): "
                             + ("the target's max_position_embeddings caps the length, so "
                                "nothing keeps it" if capped else
                                "raise --max-length to keep it"))
    if status == "too_long":
        ids, mask = [], []
    out.update(input_ids=ids, loss_mask=mask, num_tokens=len(ids), num_masked=sum(mask),
               status=status)
    return out


def _answers_first(messages: list[dict]) -> bool:
    """The conversation's only assistant turn is its first message, which the mask takes as
    context (no prompt before it: masking.assistant_spans)."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"] == [0]


def _features():
    import datasets

    seq = getattr(datasets, "List", datasets.Sequence)
    return datasets.Features({
        "file": datasets.Value("string"), "row": datasets.Value("int64"),
        "sample_id": datasets.Value("string"), "messages_json": datasets.Value("string"),
        "truncated": datasets.Value("bool"), "error": datasets.Value("string"),
        "cut_off": datasets.Value("bool"), "blank": datasets.Value("bool"),
        "input_ids": seq(datasets.Value("int32")), "loss_mask": seq(datasets.Value("int8")),
        "num_tokens": datasets.Value("int32"), "num_masked": datasets.Value("int64"),
        "status": datasets.Value("string"), "reason": datasets.Value("string"),
        "empty_answer": datasets.Value("bool"),
        "empty_question": datasets.Value("bool"),
    })


def tokenize_rows(cfg, tok, work: Path, max_length: int, embedding_rows: int | None = None):
    """All input rows as one dataset with ids, masks and a status per row; rows holding a
    token id of `embedding_rows` or more are rejected (`_process`)."""
    import datasets

    features = _features()
    read_features = datasets.Features({k: features[k] for k in
                                       ("file", "row", "sample_id", "messages_json",
                                        "truncated", "error", "cut_off", "blank")})
    if next(read_rows(cfg.data, cfg.format), None) is None:  # datasets' own error is cryptic
        raise EyasError(f"no rows in {list(cfg.data)}: the input files are empty (an `eyas "
                        f"regenerate` whose rows were all rejected writes an empty "
                        f"conversations.jsonl: see its rejects.jsonl)")
    rows = datasets.Dataset.from_generator(
        _records, features=read_features, cache_dir=str(work / "read"),
        gen_kwargs={"paths": tuple(cfg.data), "fmt": cfg.format,
                    "system_prompt": cfg.system_prompt, "strip": cfg.reasoning == "strip"})
    template_kwargs = parse_template_kwargs(cfg.chat_template_kwargs)
    fingerprint = hashlib.sha256(json.dumps(
        [to_dict(cfg), max_length, tokenizer_fingerprint(tok), chat_template_fingerprint(tok),
         rows._fingerprint, embedding_rows],
        sort_keys=True, default=str).encode()).hexdigest()[:16]
    return rows.map(
        _process, features=features, num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        desc="tokenizing", new_fingerprint=fingerprint,
        fn_kwargs={"tokenizer": tok, "max_length": max_length, "embedding_rows": embedding_rows,
                   "capped": max_length < cfg.max_length,
                   "truncate": cfg.length_policy == "truncate",
                   "mask_kwargs": {"last_turn_only": cfg.last_turn_only,
                                   "template_kwargs": template_kwargs}})
