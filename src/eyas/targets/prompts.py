"""Prompts for measuring a draft: chat rows from files, an `eyas prepare` folder or the
standard prompt sets (eyas.store.benchsets), rendered with the chat template the draft was
trained with (docs/eval.md, "Prompts").

A prompt is the conversation before its last assistant turn (the whole conversation when it
does not end with one), rendered with `add_generation_prompt` exactly as `eyas prepare`
renders training data. A prompt with a `follow_up` (MT-bench's second turn) is asked again
after the target's own answer: `next_turn` builds that prompt from the answer's tokens.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.store.benchsets import bench_rows
from eyas.store.manifest import (chat_record, chat_template_fingerprint, draft_chat, found_here,
                                 peek_manifest, read_manifest)
from eyas.targets import chat
from eyas.targets.chat_files import ChatFormatError, read_rows
from eyas.targets.chat_sources import dict_splits, is_datasets_folder
from eyas.targets.masking import check_template_compiles, read_template_file, render_prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowUp:
    """Questions asked after the target's own answer, and how to render them."""

    messages: tuple[dict, ...]  # the conversation the answer replies to
    questions: tuple[str, ...]  # the next user turns, one per answer
    template: str  # the chat template text the first turn was rendered with
    template_kwargs: dict = field(default_factory=dict)


@dataclass
class Prompt:
    id: str
    ids: torch.Tensor  # (n,) int64 on the CPU: the rendered chat prompt
    group: str = ""  # the prompt set (and turn) it is reported with; "" = --data prompts
    follow_up: FollowUp | None = None


def chat_template(cfg, tokenizer, prepared: dict | None, lineage: dict | None = None
                  ) -> tuple[str | None, tuple[str, ...]]:
    """Set the chat template (and variables) the draft was trained with on the tokenizer:
    `cfg.chat_template`, else the prepared folder's, else the one the draft's data was
    prepared with (`lineage`: eyas.store.manifest.chat_record, where its file is here), else
    the tokenizer's own; return the template file used (None: the tokenizer's) and the
    variables as KEY=VALUE (`cfg.chat_template_kwargs`, else the prepared folder's, else the
    draft data's). Where what it renders with is not what the draft's data was rendered with, say
    so (the acceptance measured is then another distribution's)."""
    trained = (prepared or {}).get("config") or {}
    lineage = lineage or {}
    template = cfg.chat_template or trained.get("chat_template")
    if template:
        # a file the prepared folder names relative to where prepare ran: where it was then
        path = Path(template if cfg.chat_template else found_here(
            template, (prepared or {}).get("chat_template_path")))
        tokenizer.chat_template = read_template_file(path)
        if not cfg.chat_template:  # a file the prepared folder names: it must be that one
            check_template_hash(tokenizer, prepared or {}, str(path))
    elif not prepared and (lineage_file := found_here(
            lineage.get("chat_template"), lineage.get("chat_template_path"), os.path.isfile)) \
            and os.path.isfile(lineage_file):  # the draft data's file, where it is here
        own = tokenizer.chat_template
        tokenizer.chat_template = Path(lineage_file).read_text()
        if lineage.get("chat_template_hash") not in (None, chat_template_fingerprint(tokenizer)):
            tokenizer.chat_template = own  # a file of that name, edited or another since: not it
        else:
            template = lineage_file
    if not tokenizer.chat_template:
        raise EyasError(f"the tokenizer of {cfg.target} has no chat template; pass the one the "
                        f"target is served with as --chat-template FILE.jinja")
    # once, not as one failure per prompt; as prepare checks it ({% generation %} included)
    check_template_compiles(tokenizer.chat_template, template or f"the tokenizer of {cfg.target}")
    # a prepared folder's own settings, none included; else the draft data's
    kwargs = cfg.chat_template_kwargs or tuple(
        (trained if prepared is not None else lineage).get("chat_template_kwargs") or ())
    _warn_unlike_lineage(tokenizer, kwargs, lineage, getattr(cfg, "draft", None))
    return template, kwargs


def _warn_unlike_lineage(tokenizer, kwargs: tuple[str, ...], lineage: dict, draft) -> None:
    """Warn where the template or its variables differ from those the draft's data was
    rendered with (`lineage`), naming the flag that renders as it was."""
    was_hash, now_hash = lineage.get("chat_template_hash"), chat_template_fingerprint(tokenizer)
    if was_hash and now_hash != was_hash:
        log.warning("eval renders prompts with another chat template (hash %s) than the draft "
                    "%s was trained on (hash %s%s): it is measured on other prompts than it "
                    "learned; pass that template as --chat-template FILE.jinja", now_hash,
                    draft, was_hash,
                    f", {lineage['chat_template']}" if lineage.get("chat_template") else "")
    was = tuple(lineage.get("chat_template_kwargs") or ())
    if lineage and chat.parse_template_kwargs(kwargs) != chat.parse_template_kwargs(was):
        log.warning("eval renders prompts with the chat template variables %s; the draft %s "
                    "was trained on prompts rendered with %s: %s to measure it as it learned",
                    " ".join(kwargs) or "(none)", draft, " ".join(was) or "none",
                    f"pass --chat-template-kwargs {' '.join(was)}" if was else
                    "leave --chat-template-kwargs out")


def system_prompt(cfg, prepared: dict | None, lineage: dict | None, draft=None) -> str | None:
    """The system message for prompts that have none: `cfg.system_prompt`, else the prepared
    folder's (none included: its rows hold the one it added), else the one the draft's data
    was prepared or regenerated with (`draft`'s); a difference from the latter is warned
    about."""
    was = (lineage or {}).get("system_prompt") or None
    # a prepared folder's: regenerate's first (its rows hold it), else prepare's own
    prompt = cfg.system_prompt or (((chat_record(prepared) or {}).get("system_prompt") or None)
                                   if prepared is not None else was)
    if lineage and prompt != was:
        log.warning("eval gives prompts without a system message %s; the draft %s was trained "
                    "on data given %s: %s to measure it as it learned",
                    f"the system prompt {prompt!r}" if prompt else "none", draft,
                    f"{was!r}" if was else "none",
                    "pass --system-prompt" if was else "leave --system-prompt out")
    return prompt


def check_template_hash(tokenizer, manifest: dict, source: str) -> None:
    """Refuse a chat template (set on `tokenizer`, read from `source`) that is not the one the
    folder of `manifest` recorded in `chat_template_hash` (a template file named in a manifest
    is outside its folder and may have changed since)."""
    want = manifest.get("chat_template_hash")
    got = chat_template_fingerprint(tokenizer)
    if want is not None and got != want:
        raise EyasError(f"the chat template {source} (hash {got}) is not the one "
                        f"{manifest.get('path')} was prepared with (chat_template_hash {want}); "
                        f"pass the template the data was prepared with as --chat-template "
                        f"FILE.jinja, or prepare the data again with this one.")


def _prepared_conversations(folder: Path, split: str):
    from eyas.store.prepared import load_prepared

    dd = load_prepared(folder)
    if split not in dd:
        raise EyasError(f"{folder} has no '{split}' split (it has {sorted(dd)}); pass --split "
                        f"{next(iter(dd))} or re-run `eyas prepare` with --eval-fraction > 0")
    for sid, text in zip(dd[split]["sample_id"], dd[split]["messages_json"]):
        yield sid, json.loads(text)


def _dict_split(path: Path, split: str) -> str | None:
    """--split for a `datasets` DatasetDict folder: the split to read. Its default (eval) names
    a prepared folder's split; a DatasetDict without one is read whole, as before, with a
    word, and any other --split must exist there (read_rows refuses one it lacks). A
    single Dataset folder has no splits: another --split than the default is warned about."""
    names = dict_splits(path)
    if names is None:
        if split != "eval" and is_datasets_folder(path):  # one Dataset: no splits
            log.warning("%s is one datasets Dataset, not a DatasetDict: it has no splits, so "
                        "--split %s is not applied and every row is read", path, split)
        return None
    if split == "eval" and split not in names:
        log.warning("%s: a datasets folder without an 'eval' split: every split is read (%s); "
                    "pass --split to read one", path, ", ".join(names))
        return None
    return split


def _file_conversations(data: str, skipped: Counter, split: str | None = None):
    """(sample id, messages) of every usable row; bad rows are logged with file and row and
    counted in `skipped` ("malformed"). Prompt-only rows (no assistant turn, e.g. MT-bench
    questions) are fine."""
    for file, row, item in read_rows(data, split=split):
        try:
            if isinstance(item, ChatFormatError):
                raise item
            messages = chat.normalize(item, need_assistant=False)
        except ChatFormatError as err:
            log.warning("%s row %d skipped: %s", file, row, err)
            skipped["malformed"] += 1
            continue
        yield chat.sample_id(item, file, row), messages


def render(tokenizer, rows, limit: int, template_kwargs: dict, group: str = "",
           skipped: Counter | None = None, max_len: int | None = None,
           system: str | None = None) -> list[Prompt]:
    """The first `limit` usable rows of (id, messages[, next questions]) as Prompts, `system`
    as the system message of those without one; the others are logged and counted in
    `skipped` by reason ("no user turn": nothing asks for the answer, e.g. a lone greeting;
    "chat template failed"; "too long": more than `max_len` tokens), and the rows after them
    fill their places."""
    skipped = Counter() if skipped is None else skipped
    prompts, long = [], []
    for sid, messages, *more in rows:
        if len(prompts) == limit:
            break
        if messages[-1]["role"] == "assistant":  # the prompt is what comes before it
            messages = messages[:max(i for i, m in enumerate(messages)
                                     if m["role"] == "assistant")]
        if not any(m["role"] == "user" for m in messages):
            log.warning("prompt %s skipped: no user turn before the answer to measure", sid)
            skipped["no user turn"] += 1
            continue
        messages = chat.with_system_prompt(messages, system)
        try:
            ids = render_prompt(tokenizer, [*messages, {"role": "assistant", "content": ""}],
                                template_kwargs=template_kwargs)
        except ChatFormatError as err:
            log.warning("prompt %s skipped: %s", sid, err)
            skipped["chat template failed"] += 1
            continue
        if max_len is not None and len(ids) > max_len:
            long.append(str(sid))
            continue
        questions = tuple(more[0]) if more else ()
        follow = FollowUp(tuple(messages), questions, tokenizer.chat_template,
                          template_kwargs) if questions else None
        prompts.append(Prompt(str(sid), torch.tensor(ids, dtype=torch.long), group, follow))
    if long:
        skipped["too long"] += len(long)
        log.warning("%d prompt(s) longer than %d tokens skipped (the target's context less "
                    "--max-new-tokens and k; lower --max-new-tokens to keep them): %s",
                    len(long), max_len, long[:5])
    return prompts


def next_turn(prompt: Prompt, answer: list[int], tokenizer) -> Prompt:
    """The prompt asking `prompt.follow_up`'s next question after `answer` (the target's own
    reply to `prompt`, token ids), rendered as the first turn was. Its id and group name the
    turn: `mt-bench/turn-2/81` for `mt-bench/turn-1/81`."""
    f = prompt.follow_up
    text = tokenizer.decode(answer, skip_special_tokens=True)
    messages = (*f.messages, {"role": "assistant", "content": text},
                {"role": "user", "content": f.questions[0]})
    turn = sum(m["role"] == "user" for m in messages)
    tokenizer.chat_template = f.template
    ids = render_prompt(tokenizer, [*messages, {"role": "assistant", "content": ""}],
                        template_kwargs=f.template_kwargs)
    rest = FollowUp(messages, f.questions[1:], f.template, f.template_kwargs)
    base = prompt.group.rsplit("/turn-", 1)[0]
    return Prompt(f"{base}/turn-{turn}/{prompt.id.rsplit('/', 1)[-1]}",
                  torch.tensor(ids, dtype=torch.long), f"{base}/turn-{turn}",
                  rest if rest.questions else None)


def bench_prompts(names: tuple[str, ...], tokenizer, limit: int, template_kwargs: dict,
                  cache: Path | None = None, skipped: Counter | None = None,
                  max_len: int | None = None, system: str | None = None) -> list[Prompt]:
    """The first `limit` usable prompts (at most `max_len` tokens) of each named standard set
    (eyas.store.benchsets). Sets with next turns (MT-bench) are grouped as turn 1
    (`mt-bench/turn-1`)."""
    prompts = []
    for name in names:
        rows = bench_rows(name, cache)
        turns = any(r.get("next_turns") for r in rows)
        group = f"{name}/turn-1" if turns else name
        listed = [(f"{group}/{r['id'].rsplit('/', 1)[-1]}", r["messages"],
                   r.get("next_turns") or ()) for r in rows]
        got = render(tokenizer, listed, limit, template_kwargs, group, skipped, max_len, system)
        if len(got) < limit:
            log.warning("%s: %d usable prompts of its %d rows, fewer than --num-prompts %d: "
                        "all are measured", name, len(got), len(rows), limit)
        prompts += got
    return prompts


def load_prompts(cfg, tokenizer, skipped: Counter | None = None, max_len: int | None = None,
                 rendered: dict | None = None) -> tuple[list[Prompt], dict | None]:
    """The first `cfg.num_prompts` usable prompts of `cfg.data` and of each of `cfg.bench`'s
    sets, rendered with the training chat template (`chat_template`), and the prepared
    folder's manifest if `cfg.data` is one; the rows left out (prompts longer than `max_len`
    tokens too), by reason, are added to `skipped`, and how they were rendered (the chat
    record of eyas.store.manifest.chat_record) to `rendered`. `cfg`: an eyas.evaluate.EvalConfig."""
    skipped = Counter() if skipped is None else skipped
    path = Path(cfg.data) if cfg.data else None
    # a prepared folder (its eval split by default); any other eyas folder is read as chat
    # data by read_rows (a regenerate output: its conversations; other steps' refused)
    prepared = (read_manifest(path, step="prepare")
                if path is not None and (peek_manifest(path) or {}).get("step") == "prepare"
                else None)
    draft = getattr(cfg, "draft", None)
    lineage = draft_chat(draft) if draft else None
    template, kwargs = chat_template(cfg, tokenizer, prepared, lineage)
    template_kwargs = chat.parse_template_kwargs(kwargs)
    system = system_prompt(cfg, prepared, lineage, draft)
    if rendered is not None:
        rendered.update(chat_template=template,
                        chat_template_hash=chat_template_fingerprint(tokenizer),
                        chat_template_kwargs=list(kwargs), system_prompt=system)
    prompts = []
    if path is not None:
        rows = (_prepared_conversations(path, cfg.split) if prepared
                else _file_conversations(cfg.data, skipped, _dict_split(path, cfg.split)))
        prompts = render(tokenizer, rows, cfg.num_prompts, template_kwargs,
                         "data" if cfg.bench else "", skipped, max_len, system)
        if not prompts and skipped.get("chat template failed"):
            raise EyasError(f"no usable prompt in {cfg.data}: the chat template failed on "
                            f"every row ({skipped['chat template failed']}; the first reason is "
                            f"logged above); check the template (--chat-template, "
                            f"--chat-template-kwargs) before the data")
        if not prompts and skipped.get("too long"):
            raise EyasError(f"every prompt of {cfg.data} is too long for the target's context "
                            f"(more than {max_len} tokens); lower --max-new-tokens or use "
                            f"shorter prompts")
        if not prompts:
            raise EyasError(f"no usable prompt in {cfg.data}; check --data (and --split for a "
                            f"prepared folder)")
        if len(prompts) < cfg.num_prompts:
            left = ", ".join(f"{k} {n}" for k, n in sorted(skipped.items()))
            log.warning("%s has %d usable prompts, fewer than --num-prompts %d%s: all are "
                        "measured", cfg.data, len(prompts), cfg.num_prompts,
                        f" (rows left out: {left})" if left else "")
    return unique_ids(prompts + bench_prompts(cfg.bench, tokenizer, cfg.num_prompts,
                                              template_kwargs, skipped=skipped,
                                              max_len=max_len, system=system)), prepared


def unique_ids(prompts: list[Prompt]) -> list[Prompt]:
    """`prompts`, each id that an earlier prompt already has renamed ID#2, ID#3, ...: a
    report's rows are matched by id (a lossless check's margin, a question's turns, two
    drafts paired prompt by prompt), so two prompts under one id would be taken for one."""
    taken = {p.id for p in prompts}
    seen: set[str] = set()
    out, renamed = [], []
    for p in prompts:
        if p.id in seen:
            n = 2
            while f"{p.id}#{n}" in taken:
                n += 1
            renamed.append(p.id)
            p = replace(p, id=f"{p.id}#{n}")
            taken.add(p.id)
        seen.add(p.id)
        out.append(p)
    if renamed:
        log.warning("%d prompt(s) have the id of an earlier one, renamed ID#2, ID#3, ... in the "
                    "report so that each is measured and reported on its own: %s",
                    len(renamed), sorted(set(renamed))[:5])
    return out
