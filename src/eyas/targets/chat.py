"""Chat rows -> normalised conversations.

A row is ShareGPT (`conversations` of `from`/`value`, as in Open-PerfectBlend) or OpenAI/HF
`messages` (`role`/`content`); with `fmt="auto"` each row's format is read from its own keys,
so every file (even a mixed one) is read in its format. Finding the files is
`eyas.targets.chat_sources`, reading their rows `eyas.targets.chat_files`.

`normalize` turns a row into OpenAI `messages` form, `[{"role", "content"}]` with roles
system/user/assistant/tool, or raises `ChatFormatError` saying what is wrong with it;
`read_conversations` does so for every row `read_rows` yields.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator, NamedTuple

from eyas.targets.chat_files import FORMATS, TURN_COLUMNS, ChatFormatError, read_rows

# Input role spelling -> OpenAI role. ShareGPT says human/gpt, OpenAI says user/assistant.
ROLES = {
    "system": "system", "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant",
    "tool": "tool",
}
# Columns that name a row; the first one present becomes its sample id.
ID_COLUMNS = ("id", "sample_id", "conversation_id", "uuid")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningCutOff(ChatFormatError):
    """An assistant turn that is only reasoning never closed (an answer cut inside its
    `<think>` block at max tokens): stripping its reasoning leaves nothing of it."""


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
        tool_calls = [_arguments_decoded(c) for c in tool_calls]
        if raw_content is None:
            raw_content = ""  # an OpenAI tool call has content null: the calls are the turn
    content = _text(i, raw_content)
    reasoning = _first_present(turn, ("reasoning_content", "reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatFormatError(f"turn {i} reasoning is a {type(reasoning).__name__}, not a string "
                              f"(reasoning_content / reasoning holds the thinking text)")
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


def _arguments_decoded(call: dict) -> dict:
    """An OpenAI tool call whose `arguments` is the JSON text of an object (as the API writes
    it) with that object instead, as vLLM's server hands calls to the chat template and as
    transformers' templates expect them: templates render arguments with `tojson`, which would
    encode the text a second time, a quoted string the model never writes."""
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return call  # not JSON: rendered as given
        if isinstance(decoded, dict):
            return {**call, "function": {**call["function"], "arguments": decoded}}
    return call


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
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        other = sorted({str(p.get("type")) for p in content} - {"text"})
        raise ChatFormatError(f"turn {i} content has parts of type {', '.join(other)} beside "
                              f"text: only text conversations are supported (the draft trains "
                              f"on text; drop such turns or rows, or keep their text parts)")
    raise ChatFormatError(f"turn {i} content is a {type(content).__name__}, not a string "
                          f"(only text conversations are supported)")


def has_text(message: dict) -> bool:
    """The message holds some text besides whitespace (a tool call alone holds none)."""
    return bool(str(message.get("content") or "").strip())


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
