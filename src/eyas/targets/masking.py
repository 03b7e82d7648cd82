"""Loss masks for chat data, found by rendering prefixes with the target's own chat template.

A draft learns only the tokens the target generates, so every conversation needs a mask over
exactly those tokens. Rather than per-model rules, the template itself says where they are:
the conversation is rendered once and tokenized once, and for assistant message i the render
of `messages[:i]` plus the generation prompt ends where the target starts writing, while the
render of `messages[:i+1]` ends after the turn, whose generated part runs to its end-of-turn
token (`<|eot_id|>`, `<|im_end|>`, ...; ChatML's newline after it is template glue). So any
template works without per-model code. Templates that render a turn differently once later
turns follow (Qwen3 drops reasoning before the last user message) are aligned by the text
between turns, which does not change. Empty `<think></think>` blocks are never supervised.
Character spans become token masks through the tokenizer's offsets, so tokens that merge
across a boundary are still placed. An answer cut before its end (regenerate's
`"truncated": true`) keeps its text in the mask but not the end-of-turn the template closes it
with, found by rendering it once more with a mark after its text. `eyas prepare` masks its
data here; eval and regenerate render prompts the same way. See docs/prepare.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from eyas.errors import EyasError
from eyas.targets import chat
from eyas.targets.chat_files import ChatFormatError

EMPTY_THINK = re.compile(re.escape(chat.THINK_OPEN) + r"\s*" + re.escape(chat.THINK_CLOSE)
                         + r"\s*")


def read_template_file(path) -> str:
    """The text of a --chat-template file (prepare, regenerate and eval take one), or an
    EyasError that says what the path is instead."""
    path = Path(path)
    if not path.is_file():
        raise EyasError(f"chat template file {path} "
                        f"{'is a folder' if path.is_dir() else 'does not exist'}; give "
                        f"--chat-template the path of a .jinja file: the template the target "
                        f"is served with")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise EyasError(f"chat template file {path} is not UTF-8 text ({err}); save it as "
                        f"UTF-8, as the target's own chat_template.jinja is") from None


def check_template_compiles(template, source: str,
                            fix: str = "give the template the target is served with as "
                                       "--chat-template FILE.jinja") -> None:
    """A chat template that Jinja cannot parse fails once, here, naming the line: it used to
    reject every row with the same error and then end in "no usable conversations". Compiled
    as transformers compiles it (its extensions, `{% generation %}` included): prepare and
    eval accept the same templates. `fix`: the other way out than fixing it, for a step
    without --chat-template."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: every row's render still says why
        return
    import jinja2

    for text in (template.values() if isinstance(template, dict) else [template]):
        try:
            _compile_jinja_template(text)
        except jinja2.TemplateSyntaxError as err:
            raise EyasError(f"the chat template of {source} is not valid Jinja: {err.message} "
                            f"(line {err.lineno}); fix it, or {fix}") from err


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False,
           chat_template: str | None = None, template_kwargs: dict | None = None) -> str:
    """The chat template's text for `messages`; a template error becomes ChatFormatError."""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, **(template_kwargs or {}))
    except Exception as err:  # templates raise anything (raise_exception, TypeError, ...)
        raise ChatFormatError(f"chat template failed: {type(err).__name__}: {err}") from None


def special_strings(tokenizer) -> tuple[str, ...]:
    """Text of every special token (end-of-turn candidates)."""
    found = set(tokenizer.all_special_tokens)
    found.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return tuple(sorted(s for s in found if s))


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search with C-speed slice compares
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _end_of_turn(text: str, specials: tuple[str, ...]) -> tuple[int, str | None]:
    """Where the generated part of a rendered turn ends, and its end-of-turn token.

    The end-of-turn token is the special token that ends last, if only whitespace (template
    glue such as ChatML's newline) follows it. Without one, the turn's text up to trailing
    whitespace counts as generated and the token is None.
    """
    found = [(k + len(s), len(s), s) for s in specials if (k := text.rfind(s)) >= 0]
    if found:
        end, _, token = max(found)
        if not text[end:].strip():
            return end, token
    return len(text.rstrip()), None


def _overlap(a: str, b: str) -> int:
    """Largest n with a[-n:] == b[:n] (0 if none)."""
    k = a.find(b[:1], max(0, len(a) - len(b)))
    while k >= 0:
        if b.startswith(a[k:]):
            return len(a) - k
        k = a.find(b[:1], k + 1)
    return 0


def _resync(tokenizer, messages, i, prompt, full, prev_end, kw) -> int:
    """Start of assistant turn i when the template renders an earlier assistant turn
    differently once later turns follow (Qwen3 keeps reasoning only after the last user
    message). The messages since the previous assistant turn render the same either way, so
    the render of messages[:i] is aligned to the full render by its overlap after `prev_end`."""
    before = render(tokenizer, messages[:i], **kw)
    found = _overlap(before, full[prev_end:]) if prompt.startswith(before) else 0
    if found == 0:
        raise ChatFormatError(f"chat template renders the turns before assistant turn {i} "
                              f"differently once later turns follow; cannot place turn {i}")
    pos = prev_end + found
    return pos + _common_prefix(prompt[len(before):], full[pos:])


def _end_in_context(i: int, own: str, full: str, start: int, specials) -> int:
    """End of assistant turn i in `full` when the template rewrites the turn once later turns
    follow (e.g. drops its reasoning): the turn's own render `own` names the end-of-turn
    token, whose first occurrence after `start` closes the turn."""
    eot = _end_of_turn(own, specials)[1]
    k = full.find(eot, start) if eot else -1
    if k < 0:
        raise ChatFormatError(f"cannot find the end of assistant turn {i}: the template renders "
                              f"it differently in context and its end-of-turn token "
                              f"{eot!r} does not close it there")
    return k + len(eot)


def assistant_spans(tokenizer, messages: list[dict], *, chat_template: str | None = None,
                    template_kwargs: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The full render and, per assistant turn, the character span the target generates.

    A turn starts where the render of the turns before it plus the generation prompt stops
    agreeing with the full render, and ends at its end-of-turn token (the last special token
    of the turn's own render). A first message from the assistant has no prompt and is
    context only.
    """
    kw = {"chat_template": chat_template, "template_kwargs": template_kwargs}
    full = render(tokenizer, messages, **kw)
    specials = special_strings(tokenizer)
    spans: list[tuple[int, int]] = []
    prev_end = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True, **kw)
        upto = render(tokenizer, messages[: i + 1], **kw)
        start = _common_prefix(prompt, full)
        if start < prev_end:  # an earlier assistant turn renders differently in `full`
            start = _resync(tokenizer, messages, i, prompt, full, prev_end, kw)
        if full.startswith(upto) and len(upto) >= start:
            # The usual case: the turn renders the same with or without later turns.
            end = start + _end_of_turn(full[start:len(upto)], specials)[0]
        else:
            end = _end_in_context(i, upto[_common_prefix(prompt, upto):], full, start, specials)
        _check_tool_calls_rendered(i, message, full[start:end])
        spans.append((start, end))
        prev_end = end
    return full, spans


def _check_tool_calls_rendered(i: int, message: dict, generated: str) -> None:
    """A tool call is supervised as the template renders it; a template without tool-call
    support renders an empty turn, which would teach the draft nothing of the call."""
    names = [call["function"]["name"] for call in message.get("tool_calls") or ()]
    missing = [name for name in names if name not in generated]
    if missing:
        raise ChatFormatError(f"assistant turn {i} is a tool call ({', '.join(names)}) that the "
                              f"chat template does not render ({missing[0]!r} is not in the "
                              f"turn's text): use the template that serves tool calls "
                              f"(--chat-template) or leave tool-call rows out")


def _char_mask(text: str, spans: list[tuple[int, int]]) -> np.ndarray:
    """Per-character 0/1: inside a span and not part of an empty think block."""
    mask = np.zeros(len(text) + 1, dtype=np.int8)  # +1: empty offsets at the very end
    for start, end in spans:
        mask[start:end] = 1
        for m in EMPTY_THINK.finditer(text, start, end):
            mask[m.start():min(m.end(), end)] = 0
    return mask


def _tokens_with_mask(tokenizer, text: str, cmask: np.ndarray) -> tuple[list[int], list[int]]:
    """Tokenize `text` once; a token is masked if any character it covers is."""
    if not getattr(tokenizer, "is_fast", False):
        return _tokens_by_segments(tokenizer, text, cmask)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    a, b = offsets[:, 0], offsets[:, 1]
    csum = np.concatenate([[0], np.cumsum(cmask, dtype=np.int64)])
    # Zero-width offsets (trimmed whitespace) take the mask of the position they sit at.
    mask = np.where(b > a, csum[b] > csum[a], cmask[a] > 0)
    return list(enc["input_ids"]), mask.astype(int).tolist()


def _tokens_by_segments(tokenizer, text: str, cmask: np.ndarray) -> tuple[list[int], list[int]]:
    """Slow tokenizers give no offsets: tokenize each masked / unmasked run on its own and
    accept that only if it equals the tokenization of the whole text."""
    cuts = [0, *(np.flatnonzero(np.diff(cmask[: len(text)])) + 1).tolist(), len(text)]
    ids, mask = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        piece = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(cmask[a])] * len(piece)
    if ids != list(tokenizer(text, add_special_tokens=False)["input_ids"]):
        raise ChatFormatError("tokens merge across an assistant-turn boundary and this (slow) "
                              "tokenizer gives no offsets to place them; use a fast tokenizer")
    return ids, mask


# Written after a cut answer's text to find where the template's closing of the turn starts.
_CUT_MARK = "\ue000eyas-cut\ue000"


def _answer_end(tokenizer, messages: list[dict], full: str, kw: dict) -> int:
    """Where the last message's own text ends in `full` (the render of `messages`).

    Rendered again with a mark after that text, the template writes after the mark exactly
    what it closes the turn with (`<|im_end|>\n`, `<|eot_id|>`); `full` ends with the same."""
    last = messages[-1]
    marked = render(tokenizer, [*messages[:-1], {**last, "content": last["content"] + _CUT_MARK}],
                    **kw)
    k = marked.rfind(_CUT_MARK)
    closing = marked[k + len(_CUT_MARK):] if k >= 0 else None
    if closing is None or not full.endswith(closing):
        raise ChatFormatError("cannot find where the truncated last answer ends: the chat "
                              "template renders it differently with text appended")
    return len(full) - len(closing)


def _cut_last_span(tokenizer, messages: list[dict], full: str,
                   spans: list[tuple[int, int]], kw: dict) -> list[tuple[int, int]]:
    """`spans` with the last assistant turn ending at its text: the answer was cut (at
    regenerate's max_new_tokens), so the target never wrote the end-of-turn the template adds."""
    if messages[-1]["role"] != "assistant":
        raise ChatFormatError("marked truncated, but the last message is a "
                              f"{messages[-1]['role']} turn, not the cut assistant answer")
    if len(messages) == 1:  # a lone assistant message is context only: no span to cut
        return spans
    start, end = spans[-1]
    return [*spans[:-1], (start, max(start, min(end, _answer_end(tokenizer, messages, full, kw))))]


def tokenize_conversation(tokenizer, messages: list[dict], *, last_turn_only: bool = False,
                          truncated: bool = False, chat_template: str | None = None,
                          template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation; mask 1 on tokens the target generates
    (assistant content and its end-of-turn token). With `truncated`, the last message is an
    answer cut before its end: its text is supervised, what the template closes it with is
    not. Raises ChatFormatError for conversations the template refuses or that cannot be
    masked."""
    kw = {"chat_template": chat_template, "template_kwargs": template_kwargs}
    text, spans = assistant_spans(tokenizer, messages, **kw)
    if truncated:
        spans = _cut_last_span(tokenizer, messages, text, spans, kw)
    if last_turn_only:
        spans = spans[-1:]
    return _tokens_with_mask(tokenizer, text, _char_mask(text, spans))


def render_prompt(tokenizer, messages: list[dict], *, chat_template: str | None = None,
                  template_kwargs: dict | None = None, tokenize: bool = True):
    """The prompt for the conversation's last assistant turn: every message before it, plus
    the generation prompt. Token ids (or the text with `tokenize=False`)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    head = messages[:last] if last else messages  # no assistant turn (or only a first one)
    text = render(tokenizer, head, add_generation_prompt=True, chat_template=chat_template,
                  template_kwargs=template_kwargs)
    if not tokenize:
        return text
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
