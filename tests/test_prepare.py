"""`eyas prepare`: loss masks for any chat template, checked token by token against an
independent construction, and the prepared/ folder (rejects, length policy, manifest, counts)."""

from __future__ import annotations

import json
import re
import logging

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from safetensors.numpy import load_file

from eyas.targets import chat
from eyas.targets.chat_files import ChatFormatError
from eyas.cli import build_parser, main, parse_config
from eyas.config import ConfigError
from eyas.errors import EyasError
from eyas.store.manifest import read_manifest, tokenizer_fingerprint
from eyas.targets.masking import (_char_mask, _tokens_by_segments, _tokens_with_mask, assistant_spans,
                                 render_prompt, tokenize_conversation)
from eyas.prepare import PrepareConfig, prepare
from eyas.targets.tiny import save_tiny_tokenizer

# ChatML as Qwen2.5 writes it: a default system turn, tool results inside a user turn.
CHATML = (
    "{%- if messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3-like: reasoning parsed out of the content, shown only for turns after the last user
# message, an empty think block on the final turn, and enable_thinking=false in the prompt.
QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' or m.role == 'user' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# A template that insists on alternating roles (as Gemma / Mistral templates do).
STRICT = (
    "{%- for m in messages %}"
    "{%- if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
    "{{- raise_exception('Conversation roles must alternate') }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONV = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is 12 plus 30?"},
    {"role": "assistant", "content": "<think>\nadd the two\n</think>\n\nLet me check."},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "The answer is 42."},
    {"role": "user", "content": "Name two animals."},
    {"role": "assistant", "content": "<think>\npick two\n</think>\n\nThe cat and the dog."},
]
PLAIN = chat.strip_reasoning(CONV)


@pytest.fixture
def tok(tiny_tok):
    """The session's tiny tokenizer; a test may set another chat template on it."""
    original = tiny_tok.chat_template
    yield tiny_tok
    tiny_tok.chat_template = original


def expected(tok, segments):
    """The independent construction: tokenize each (text, supervised) piece on its own."""
    ids, mask = [], []
    for text, supervised in segments:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(supervised)] * len(piece)
    return ids, mask


def check(tok, messages, segments, **kwargs):
    ids, mask = tokenize_conversation(tok, messages, **kwargs)
    want_ids, want_mask = expected(tok, segments)
    # Pieces must not merge for the construction to be valid: the whole text tokenizes the same.
    full = "".join(text for text, _ in segments)
    assert want_ids == tok(full, add_special_tokens=False)["input_ids"]
    assert ids == want_ids
    assert mask == want_mask, [(tok.decode([i]), m, w) for i, m, w in zip(ids, mask, want_mask)]
    return ids, mask


def llama3_header(role):
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


def chatml(role, text):
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


# ---------------------------------------------------------------- masks, template by template

def test_llama3_headers_multi_turn_with_tool(tok):
    h, eot = llama3_header, "<|eot_id|>"
    segments = [
        ("<|begin_of_text|>" + h("system") + PLAIN[0]["content"] + eot + h("user")
         + PLAIN[1]["content"] + eot + h("assistant"), 0),
        ("Let me check." + eot, 1),
        (h("tool") + "42" + eot + h("assistant"), 0),
        ("The answer is 42." + eot, 1),
        (h("user") + "Name two animals." + eot + h("assistant"), 0),
        ("The cat and the dog." + eot, 1),
    ]
    check(tok, PLAIN, segments)
    last_only = [(text, i == len(segments) - 1) for i, (text, _) in enumerate(segments)]
    check(tok, PLAIN, last_only, last_turn_only=True)


def test_chatml_default_system_and_tool(tok):
    tok.chat_template = CHATML
    messages = PLAIN[1:]  # no system turn: the template adds its own
    segments = [
        (chatml("system", "You are a helpful assistant.") + chatml("user", messages[0]["content"])
         + "<|im_start|>assistant\n", 0),
        ("Let me check.<|im_end|>", 1),  # the newline after <|im_end|> is not generated
        ("\n" + chatml("user", "<tool_response>\n42\n</tool_response>")
         + "<|im_start|>assistant\n", 0),
        ("The answer is 42.<|im_end|>", 1),
        ("\n" + chatml("user", "Name two animals.") + "<|im_start|>assistant\n", 0),
        ("The cat and the dog.<|im_end|>", 1),
        ("\n", 0),
    ]
    check(tok, messages, segments)


def qwen3_head():
    return (chatml("system", CONV[0]["content"]) + chatml("user", CONV[1]["content"])
            + "<|im_start|>assistant\n")


def test_qwen3_keeps_last_reasoning_and_drops_earlier(tok):
    tok.chat_template = QWEN3
    # Turns before the last user message lose their reasoning in the full render; the last
    # turn keeps it, and the target generates it (supervised).
    segments = [
        (qwen3_head(), 0),
        ("Let me check.<|im_end|>", 1),
        ("\n" + chatml("user", "<tool_response>\n42\n</tool_response>")
         + "<|im_start|>assistant\n", 0),
        ("The answer is 42.<|im_end|>", 1),
        ("\n" + chatml("user", "Name two animals.") + "<|im_start|>assistant\n", 0),
        ("<think>\npick two\n</think>\n\nThe cat and the dog.<|im_end|>", 1),
        ("\n", 0),
    ]
    check(tok, CONV, segments)


@pytest.mark.parametrize("kwargs", [{}, {"template_kwargs": {"enable_thinking": False}}])
def test_qwen3_inserted_empty_think_is_never_supervised(tok, kwargs):
    tok.chat_template = QWEN3
    segments = [
        (qwen3_head(), 0),
        ("Let me check.<|im_end|>", 1),
        ("\n" + chatml("user", "<tool_response>\n42\n</tool_response>")
         + "<|im_start|>assistant\n", 0),
        ("The answer is 42.<|im_end|>", 1),
        ("\n" + chatml("user", "Name two animals.")
         + "<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
        ("The cat and the dog.<|im_end|>", 1),
        ("\n", 0),
    ]
    check(tok, PLAIN, segments, **kwargs)


def test_tokens_merging_across_the_boundary_are_placed_by_offsets(tok):
    # The prompt ends with "Assistant: " but history renders "Assistant:" + " text": the
    # answer's first token " The" starts inside the prompt. It carries generated text: masked.
    tok.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'user' %}{{- 'User: ' + m.content + '\\n' }}"
        "{%- else %}{{- 'Assistant: ' + m.content + '<|eot_id|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- 'Assistant: ' }}{%- endif %}")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The cat."}]
    segments = [("User: Hi\nAssistant:", 0), (" The cat.<|eot_id|>", 1), ("\n", 0)]
    check(tok, messages, segments)
    text, spans = assistant_spans(tok, messages)
    with pytest.raises(ChatFormatError, match="merge"):  # no offsets: segments cannot agree
        _tokens_by_segments(tok, text, _char_mask(text, spans))


def test_template_without_end_of_turn_token(tok):
    # Nothing special closes a turn: the text up to its trailing whitespace is generated,
    # even when the content itself holds special tokens (<think> is special in the tiny vocab).
    tok.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'user' %}{{- 'User: ' + m.content + '\n\n' }}"
        "{%- else %}{{- 'Assistant: ' + m.content + '\n\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- 'Assistant:' }}{%- endif %}")
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nThe cat."}]
    check(tok, messages, [("User: Hi\n\nAssistant:", 0),
                          (" <think>\nhmm\n</think>\n\nThe cat.", 1), ("\n\n", 0)])


PLAIN_TEXT = ("{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n<end>\\n\\n' }}"
              "{%- endfor %}{%- if add_generation_prompt %}{{- 'assistant:' }}{%- endif %}")
CUT = [{"role": "user", "content": "Name two animals."},
       {"role": "assistant", "content": "A cat and a dog."},
       {"role": "user", "content": "Two more?"},
       {"role": "assistant", "content": "The cow and"}]  # cut at max_new_tokens


def cut_case(tok, template):
    """CUT's hand-built segments as if its last answer were whole, and the closing the target
    writes after a whole answer (end-of-turn token; a plain "<end>" line without one)."""
    if template == "llama3":
        h, eot = llama3_header, "<|eot_id|>"
        return CUT, [("<|begin_of_text|>" + h("user") + "Name two animals." + eot
                      + h("assistant"), 0), ("A cat and a dog." + eot, 1),
                     (h("user") + "Two more?" + eot + h("assistant"), 0),
                     ("The cow and" + eot, 1)], eot
    if template == "plain text":
        tok.chat_template = PLAIN_TEXT
        return CUT, [("user: Name two animals.\n<end>\n\nassistant:", 0),
                     (" A cat and a dog.\n<end>", 1),
                     ("\n\nuser: Two more?\n<end>\n\nassistant:", 0),
                     (" The cow and\n<end>", 1), ("\n\n", 0)], "\n<end>"
    tok.chat_template = {"chatml": CHATML, "qwen3": QWEN3}[template]
    system = chatml("system", "You are a helpful assistant.") if template == "chatml" else ""
    head = [(system + chatml("user", "Name two animals.") + "<|im_start|>assistant\n", 0),
            ("A cat and a dog.<|im_end|>", 1),
            ("\n" + chatml("user", "Two more?") + "<|im_start|>assistant\n", 0)]
    if template == "chatml":
        return CUT, [*head, ("The cow and<|im_end|>", 1), ("\n", 0)], "<|im_end|>"
    # Qwen3 cut inside its reasoning: no </think>, so the template inserts an empty block.
    messages = [*CUT[:-1], {"role": "assistant", "content": "<think>\nthe cow"}]
    head[-1] = (head[-1][0] + "<think>\n\n</think>\n\n", 0)
    return messages, [*head, ("<think>\nthe cow<|im_end|>", 1), ("\n", 0)], "<|im_end|>"


@pytest.mark.parametrize("template", ["llama3", "chatml", "qwen3", "plain text"])
def test_truncated_answer_leaves_its_end_of_turn_out(tok, template):
    # The cut answer's text is what the target wrote; what the template closes the turn with
    # (<|eot_id|>, <|im_end|>, the plain "<end>" line) the target never wrote there. The same
    # conversation untruncated supervises it, as before; earlier turns keep theirs.
    messages, whole, close = cut_case(tok, template)
    k = max(i for i, (_, supervised) in enumerate(whole) if supervised)  # the last answer
    answer = whole[k][0][:-len(close)]
    cut = [*whole[:k], (answer, 1), (close, 0), *whole[k + 1:]]
    _, full_mask = check(tok, messages, whole)
    ids, cut_mask = check(tok, messages, cut, truncated=True)
    n_close = len(tok(close, add_special_tokens=False)["input_ids"])
    last = max(i for i, m in enumerate(cut_mask) if m)  # the mask ends at the answer's text
    assert tok.decode(ids[:last + 1]).endswith(answer)
    assert full_mask[last + 1:last + 1 + n_close] == [1] * n_close
    assert cut_mask[:last + 1] == full_mask[:last + 1]
    assert sum(cut_mask) == sum(full_mask) - n_close
    # --last-turn-only supervises the same cut span and nothing before it
    _, only = check(tok, messages, [(t, m and i >= k) for i, (t, m) in enumerate(cut)],
                    truncated=True, last_turn_only=True)
    assert only[last] == 1 and not any(only[last + 1:])


def test_truncated_needs_the_cut_answer_last(tok):
    with pytest.raises(ChatFormatError, match="last message is a user turn"):
        tokenize_conversation(tok, [*CUT, {"role": "user", "content": "go on"}], truncated=True)


def test_slow_tokenizer_path_agrees_when_nothing_merges(tok):
    tok.chat_template = CHATML
    text, spans = assistant_spans(tok, PLAIN)
    cmask = _char_mask(text, spans)
    assert _tokens_by_segments(tok, text, cmask) == _tokens_with_mask(tok, text, cmask)


def test_first_assistant_message_is_context_only(tok):
    messages = [{"role": "assistant", "content": "Hello there."},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes."}]
    h, eot = llama3_header, "<|eot_id|>"
    check(tok, messages, [("<|begin_of_text|>" + h("assistant") + "Hello there." + eot
                           + h("user") + "Hi" + eot + h("assistant"), 0), ("Yes." + eot, 1)])


def test_template_errors_become_chat_format_errors(tok):
    tok.chat_template = STRICT
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
           {"role": "assistant", "content": "c"}]
    with pytest.raises(ChatFormatError, match="chat template failed.*alternate"):
        tokenize_conversation(tok, bad)


def test_render_prompt_is_the_unsupervised_head(tok):
    for template in (tok.chat_template, CHATML):
        tok.chat_template = template
        ids, mask = tokenize_conversation(tok, PLAIN, last_turn_only=True)
        prompt = render_prompt(tok, PLAIN)
        assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
        assert mask[len(prompt)] == 1  # the first generated token follows the prompt
        text = render_prompt(tok, PLAIN, tokenize=False)
        assert "The cat and the dog." not in text
        assert text.endswith("<|im_start|>assistant\n" if template == CHATML
                             else "<|start_header_id|>assistant<|end_header_id|>\n\n")


# ---------------------------------------------------------------- the step

@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def make_data(root):
    """Every container and row format, with malformed rows at known places."""
    root.mkdir(parents=True, exist_ok=True)
    msg = {"id": "m-1", "messages": PLAIN}
    lines = [json.dumps(msg), "{oops", json.dumps({"messages": []}),
             json.dumps({"messages": [{"role": "user", "content": "x"}]}),
             json.dumps({"messages": [{"role": "user", "content": "x"},
                                      {"role": "assistant", "content": ["x", 1]}]}),
             json.dumps({"conversations": [{"from": "alien", "value": "x"}]})]
    (root / "a.jsonl").write_text("\n".join(lines) + "\n")
    sharegpt = {"conversations": [{"from": "human", "value": "Add 2 and 3."},
                                  {"from": "gpt", "value": "2 + 3 = 5."}]}
    (root / "b.json").write_text(json.dumps([sharegpt, sharegpt]))
    blend = dict(sharegpt, source="perfectblend")
    pq.write_table(pa.Table.from_pylist([blend] * 3), root / "c.parquet")
    datasets.Dataset.from_list([{"messages": PLAIN, "id": f"d-{i}"} for i in range(2)]
                               ).save_to_disk(str(root / "d_ds"))
    return root


EXPECTED_REJECTS = [(2, "invalid JSON line"), (3, "empty conversation"),
                    (4, "no assistant turn"), (5, "turn 1 content is a list"),
                    (6, "unknown role 'alien'")]


def run_prepare(tok_dir, data, out, **kw):
    kw.setdefault("eval_fraction", 0.0)
    return prepare(PrepareConfig(target=str(tok_dir), data=tuple(map(str, data)),
                                 out=str(out), **kw))


def test_prepare_all_formats_rejects_and_outputs(tok_dir, tmp_path, tok):
    root = make_data(tmp_path / "data")
    data = (root / "a.jsonl", root / "b.json", str(root / "*.parquet"), root / "d_ds")
    s = run_prepare(tok_dir, data, tmp_path / "out")
    assert (s.kept, s.rejected, s.dropped_too_long, s.truncated) == (8, 5, 0, 0)
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["file"], r["row"]) for r in rejects] == [(str(root / "a.jsonl"), n)
                                                        for n, _ in EXPECTED_REJECTS]
    for r, (_, reason) in zip(rejects, EXPECTED_REJECTS):
        assert reason in r["reason"] and r["sample_id"] == f"{r['file']}:{r['row']}"
    train = datasets.load_from_disk(str(tmp_path / "out" / "dataset"))["train"]
    assert train.features["input_ids"].feature.dtype == "int32"
    assert train.features["loss_mask"].feature.dtype == "int8"
    assert train["sample_id"] == ["m-1", f"{root / 'b.json'}:0", f"{root / 'b.json'}:1",
                                  *(f"{root / 'c.parquet'}:{i}" for i in range(3)), "d-0", "d-1"]
    for row in train:  # every stored row is exactly tokenize_conversation of its messages
        ids, mask = tokenize_conversation(tok, json.loads(row["messages_json"]))
        assert row["input_ids"] == ids and row["loss_mask"] == mask
        assert row["num_tokens"] == len(ids)
    # token counts == a direct count over the supervised train tokens
    counts = load_file(str(tmp_path / "out" / "token_counts.safetensors"))["counts"]
    direct = np.zeros_like(counts)
    for row in train:
        for t, m in zip(row["input_ids"], row["loss_mask"]):
            direct[t] += m
    assert counts.dtype == np.int64 and (counts == direct).all() and counts.sum() > 0
    assert s.masked_tokens == int(counts.sum()) and s.tokens == sum(train["num_tokens"])


def test_manifest_with_a_real_model_folder(llama_dir, tmp_path, tok):
    make_data(tmp_path / "data")
    run_prepare(llama_dir, [tmp_path / "data" / "b.json"], tmp_path / "out", max_length=300)
    m = read_manifest(tmp_path / "out", step="prepare")
    assert m["config"]["max_length"] == 300 and m["max_length"] == 300
    assert m["target"]["model_type"] == "llama" and m["target"]["vocab_size"] == 2048
    assert m["target"]["tokenizer_hash"] == tokenizer_fingerprint(tok)
    train = datasets.load_from_disk(str(tmp_path / "out" / "dataset"))["train"]
    assert m["stats"] == {"kept": 2, "dropped_too_long": 0, "truncated": 0,
                          "truncated_answers": 0, "rejected": 0,
                          "tokens": sum(train["num_tokens"]),
                          "masked_tokens": sum(map(sum, train["loss_mask"])),
                          "train": 2, "eval": 0, "blank_lines": 0, "rows": 2,
                          "duplicate_ids": 0, "empty_answers": 0, "empty_questions": 0,
                          "reasoning_cut_off": 0}
    assert m["max_position_embeddings"] == 4096  # the tiny llama's: 300 is below it
    assert len(m["chat_template_hash"]) == 16 and m["vocab_size"] == 2048
    assert m["data_files"][0]["path"] == str(tmp_path / "data" / "b.json")
    counts = load_file(str(tmp_path / "out" / "token_counts.safetensors"))["counts"]
    assert counts.shape == (2048,)  # the target's vocab size, not just the tokenizer's


def test_tokenizer_override(llama_dir, tok_dir, tmp_path, tok):
    tok.chat_template = CHATML
    tok.save_pretrained(tmp_path / "chatml_tok")
    make_data(tmp_path / "data")
    run_prepare(llama_dir, [tmp_path / "data" / "b.json"], tmp_path / "out",
                tokenizer=str(tmp_path / "chatml_tok"))
    row = datasets.load_from_disk(str(tmp_path / "out" / "dataset"))["train"][0]
    want = tokenize_conversation(tok, json.loads(row["messages_json"]))
    assert (row["input_ids"], row["loss_mask"]) == want
    assert tok.decode(row["input_ids"]).startswith("<|im_start|>system")


def test_remote_code_target_only_when_asked(tmp_path):
    from eyas.targets.kimi_like import kimi_like_text_config, write_kimi_like_config

    target = write_kimi_like_config(tmp_path / "kimi", kimi_like_text_config())
    save_tiny_tokenizer(target)
    make_data(tmp_path / "data")
    data = [tmp_path / "data" / "b.json"]
    run_prepare(target, data, tmp_path / "plain")  # tokenizer alone: no code needed
    assert read_manifest(tmp_path / "plain", "prepare")["target"].get("model_type") is None
    run_prepare(target, data, tmp_path / "trusted", trust_remote_code=True)
    m = read_manifest(tmp_path / "trusted", "prepare")
    assert m["target"]["model_type"] == "kimi_k25_like" and m["vocab_size"] == 2048


def test_length_policy(tok_dir, tmp_path, tok):
    root = make_data(tmp_path / "data")
    lengths = [len(tokenize_conversation(tok, PLAIN)[0])] * 3
    short = len(tokenize_conversation(tok, chat.normalize(
        json.loads((root / "b.json").read_text())[0]))[0])
    limit = (short + lengths[0]) // 2  # the PLAIN rows (1 jsonl + 2 ds) are too long
    drop = run_prepare(tok_dir, [root], tmp_path / "drop", max_length=limit)
    assert (drop.kept, drop.dropped_too_long, drop.truncated) == (5, 3, 0)
    reasons = [json.loads(line)["reason"] for line in open(tmp_path / "drop/rejects.jsonl")]
    assert f"> max_length {limit} (--max-length; --length-policy truncate keeps the first " \
        f"{limit})" in reasons[-1]  # the flags that keep such rows
    cut = run_prepare(tok_dir, [root], tmp_path / "cut", max_length=limit,
                      length_policy="truncate")
    assert (cut.kept, cut.dropped_too_long, cut.truncated) == (8, 0, 3)
    train = datasets.load_from_disk(str(tmp_path / "cut" / "dataset"))["train"]
    assert max(train["num_tokens"]) == limit
    full_ids, full_mask = tokenize_conversation(tok, PLAIN)
    row = train[0]
    assert row["input_ids"] == full_ids[:limit] and row["loss_mask"] == full_mask[:limit]


def test_truncated_rows_from_regenerate(tok_dir, tmp_path, tok, caplog):
    # regenerate's output lines: the same conversation marked cut, marked whole, and unmarked
    # (from before the mark); a mark that is not a boolean, and one on a conversation whose
    # last message is not the cut answer, are rejected.
    rows = [{"id": "cut", "messages": CUT, "truncated": True},
            {"id": "whole", "messages": CUT, "truncated": False},
            {"id": "unmarked", "messages": CUT},
            {"id": "bad", "messages": CUT, "truncated": "yes"},
            {"id": "user-last", "truncated": True,
             "messages": [*CUT, {"role": "user", "content": "And?"}]}]
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.INFO, logger="eyas.prepare"):
        s = run_prepare(tok_dir, [data], tmp_path / "out")
    assert (s.kept, s.truncated_answers, s.truncated, s.rejected) == (3, 1, 0, 2)
    assert "1 end in a truncated answer" in caplog.text
    assert read_manifest(tmp_path / "out", "prepare")["stats"]["truncated_answers"] == 1
    reasons = [json.loads(x)["reason"] for x in (tmp_path / "out" / "rejects.jsonl").open()]
    assert "'truncated' is 'yes'" in reasons[0] and "last message is a user turn" in reasons[1]
    train = datasets.load_from_disk(str(tmp_path / "out" / "dataset"))["train"]
    train = {row["sample_id"]: row for row in train}
    cut, whole, unmarked = train["cut"], train["whole"], train["unmarked"]
    assert cut["input_ids"] == whole["input_ids"] == unmarked["input_ids"]
    # false and no mark: exactly as before, the closing <|eot_id|> (the last token) supervised
    assert whole["loss_mask"] == unmarked["loss_mask"] == tokenize_conversation(tok, CUT)[1]
    assert tok.convert_ids_to_tokens(whole["input_ids"][-1]) == "<|eot_id|>"
    assert whole["loss_mask"][-1] == 1
    # true: the mask ends at the answer's last token
    assert cut["loss_mask"] == whole["loss_mask"][:-1] + [0]
    assert tok.decode(cut["input_ids"][:-1]).endswith("The cow and")
    assert s.masked_tokens == 3 * sum(whole["loss_mask"]) - 1


def test_strip_removes_reasoning_cut_off(tok_dir, tmp_path, caplog):
    # regenerate writes an answer cut inside its reasoning as "<think>\n..." with no
    # </think>: --reasoning strip kept that reasoning as the answer's text. Now it is removed
    # to the end of the turn; a turn left with nothing sets its row aside, counted and listed.
    rows = [{"id": "cut", "truncated": True, "messages": [
                *CUT[:-1], {"role": "assistant", "content": "<think>\nthe cow and the"}]},
            {"id": "said-first", "truncated": True, "messages": [
                *CUT[:-1], {"role": "assistant", "content": "The cow<think>\nand the"}]},
            {"id": "whole", "messages": CONV}]
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.INFO, logger="eyas.prepare"):
        s = run_prepare(tok_dir, [data], tmp_path / "out", reasoning="strip")
    assert (s.rows, s.kept, s.reasoning_cut_off, s.rejected) == (3, 2, 1, 0)
    assert "1 rows set aside by --reasoning strip" in caplog.text
    assert read_manifest(tmp_path / "out", "prepare")["stats"]["reasoning_cut_off"] == 1
    [reject] = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").open()]
    assert (reject["sample_id"], reject["kind"]) == ("cut", "reasoning_cut_off")
    assert "--max-new-tokens" in reject["reason"] and "--reasoning keep" in reject["reason"]
    train = {r["sample_id"]: json.loads(r["messages_json"]) for r in
             datasets.load_from_disk(str(tmp_path / "out" / "dataset"))["train"]}
    assert train["said-first"][-1]["content"] == "The cow"
    assert train["whole"] == PLAIN
    assert all("think>" not in m["content"] for conv in train.values() for m in conv)
    # keep: the reasoning the target wrote is trained on, as before
    keep = run_prepare(tok_dir, [data], tmp_path / "keep")
    assert (keep.kept, keep.reasoning_cut_off) == (3, 0)


def test_eval_split_is_deterministic(tok_dir, tmp_path):
    root = make_data(tmp_path / "data")
    ids = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        s = run_prepare(tok_dir, [root], tmp_path / name, eval_fraction=0.3, seed=seed)
        assert (s.train, s.eval) == (6, 2)
        ids.append(datasets.load_from_disk(str(tmp_path / name / "dataset"))["eval"]["sample_id"])
    assert ids[0] == ids[1]
    assert ids[0] != ids[2]


def test_a_damaged_prepared_or_datasets_folder_is_a_clear_error(tok_dir, tmp_path):
    """A prepared folder whose arrow file was cut short, or whose state.json is gone, raised
    pyarrow's or datasets' own error from capture, eval and online training; a damaged
    datasets folder given to prepare, the same. Each now names the folder and the fix."""
    import shutil

    from eyas.store.prepared import load_split
    from eyas.targets.chat_files import _read_datasets_folder

    root = make_data(tmp_path / "data")
    run_prepare(tok_dir, [root / "a.jsonl", root / "b.json"], tmp_path / "out", eval_fraction=0.3)
    assert len(load_split(tmp_path / "out", "all")[0]) == 3
    for harm in ("cut", "gone"):
        bad = tmp_path / harm
        shutil.copytree(tmp_path / "out", bad)
        train = bad / "dataset" / "train"
        if harm == "cut":
            arrow = next(train.glob("*.arrow"))
            with open(arrow, "r+b") as f:
                f.truncate(arrow.stat().st_size // 2)
        else:
            (train / "state.json").unlink()
        with pytest.raises(EyasError, match=rf"the prepared data in {bad}/dataset cannot be "
                                            rf"read: its files are damaged or incomplete "
                                            rf"\(\w+: .*\)\. Run "
                                            rf"`eyas prepare` again into {bad}"):
            load_split(bad, "all")
    with open(next((root / "d_ds").glob("*.arrow")), "r+b") as f:
        f.truncate(100)
    with pytest.raises(EyasError, match=rf"the datasets folder {root / 'd_ds'} cannot be read: "
                                        rf"its files are damaged or incomplete"):
        list(_read_datasets_folder(root / "d_ds"))


def test_options_reach_the_render(tok_dir, tmp_path, tok):
    root = make_data(tmp_path / "data")
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3)
    run_prepare(tok_dir, [root / "d_ds"], tmp_path / "out", chat_template=str(template),
                system_prompt="SYS", reasoning="strip", last_turn_only=True,
                chat_template_kwargs=("enable_thinking=false",))
    row = datasets.load_from_disk(str(tmp_path / "out" / "dataset"))["train"][0]
    messages = json.loads(row["messages_json"])
    assert messages == PLAIN  # has its own system turn, reasoning stripped
    tok.chat_template = QWEN3
    want = tokenize_conversation(tok, PLAIN, last_turn_only=True,
                                 template_kwargs={"enable_thinking": False})
    assert (row["input_ids"], row["loss_mask"]) == want
    run_prepare(tok_dir, [root / "b.json"], tmp_path / "out2", system_prompt="SYS")
    row = datasets.load_from_disk(str(tmp_path / "out2" / "dataset"))["train"][0]
    assert json.loads(row["messages_json"])[0] == {"role": "system", "content": "SYS"}


def test_template_rejects_and_parallel_run(tok_dir, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": "c"}]}]
    rows += [{"messages": [{"role": "user", "content": f"q{i}"},
                           {"role": "assistant", "content": f"answer {i}"}]} for i in range(6)]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = tmp_path / "strict.jinja"
    template.write_text(STRICT)
    outs = []
    for name, num_proc in (("one", 1), ("two", 2)):
        s = run_prepare(tok_dir, [tmp_path / "x.jsonl"], tmp_path / name,
                        chat_template=str(template), num_proc=num_proc)
        assert (s.kept, s.rejected) == (6, 1)
        outs.append(datasets.load_from_disk(str(tmp_path / name / "dataset"))["train"].to_dict())
    assert outs[0] == outs[1]
    reject = json.loads((tmp_path / "one" / "rejects.jsonl").read_text())
    assert reject["row"] == 1 and "roles must alternate" in reject["reason"]
    # a template Jinja cannot parse fails once, naming the line, before any row is read (every
    # row was rejected with the same error, then "no usable conversations")
    template.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(EyasError, match=rf"the chat template of {template} is not valid Jinja: "
                                        rf".* \(line 2\); fix it"):
        run_prepare(tok_dir, [tmp_path / "x.jsonl"], tmp_path / "bad", chat_template=str(template))
    assert not (tmp_path / "bad" / "dataset").exists()


def test_out_folder_rules(tok_dir, tmp_path):
    root = make_data(tmp_path / "data")
    data = [root / "b.json"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(EyasError, match="did not write \\(thesis.tex\\)"):
        run_prepare(tok_dir, data, tmp_path / "mine")
    (tmp_path / "cap").mkdir()
    (tmp_path / "cap" / "eyas.json").write_text(json.dumps({"step": "capture"}))
    with pytest.raises(EyasError, match="eyas capture"):
        run_prepare(tok_dir, data, tmp_path / "cap")
    run_prepare(tok_dir, data, tmp_path / "out")
    again = run_prepare(tok_dir, data, tmp_path / "out", max_length=100)  # re-run replaces
    assert read_manifest(tmp_path / "out", "prepare")["config"]["max_length"] == 100
    assert again.kept == 2


def test_nothing_usable_is_an_error_but_rejects_are_written(tok_dir, tmp_path):
    (tmp_path / "bad.jsonl").write_text("{nope\n" + json.dumps({"messages": []}) + "\n")
    with pytest.raises(EyasError, match="no usable conversations.*2 rejected"):
        run_prepare(tok_dir, [tmp_path / "bad.jsonl"], tmp_path / "out")
    assert len((tmp_path / "out" / "rejects.jsonl").read_text().splitlines()) == 2
    (tmp_path / "ok.jsonl").write_text(json.dumps({"messages": PLAIN}) + "\n")
    assert run_prepare(tok_dir, [tmp_path / "ok.jsonl"], tmp_path / "out").kept == 1
    # an empty file (a regenerate whose rows were all rejected) names the cause
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(EyasError, match="no rows in .*empty"):
        run_prepare(tok_dir, [tmp_path / "empty.jsonl"], tmp_path / "out2")


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt


def test_a_failed_or_stopped_rerun_leaves_the_earlier_output_as_it_was(tok_dir, tmp_path,
                                                                       monkeypatch):
    # the earlier dataset, manifest and counts were deleted before the new run had made
    # anything: a re-run that found no usable row (or was stopped) left only rejects.jsonl
    (tmp_path / "ok.jsonl").write_text(json.dumps({"messages": PLAIN}) + "\n")
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    out = tmp_path / "out"
    first = run_prepare(tok_dir, [tmp_path / "ok.jsonl"], out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(EyasError, match=r"no usable conversations.*reasons in .*\.work/new/"
                                        r"rejects.jsonl; the earlier output in this folder is "
                                        r"kept as it was"):
        run_prepare(tok_dir, [tmp_path / "bad.jsonl"], out)
    assert "invalid JSON" in (out / ".work/new/rejects.jsonl").read_text()
    assert all(out.joinpath(k).read_bytes() == v for k, v in before.items())
    assert read_manifest(out, "prepare")["stats"]["kept"] == first.kept
    # stopped while tokenizing (Ctrl-C): nothing of the earlier output is touched either
    import eyas.prepare as prep

    with monkeypatch.context() as patch:
        patch.setattr(prep, "tokenize_rows", _interrupted)
        with pytest.raises(KeyboardInterrupt):
            run_prepare(tok_dir, [tmp_path / "ok.jsonl"], out, max_length=100)
    assert all(out.joinpath(k).read_bytes() == v for k, v in before.items())
    assert not (out / ".work").exists()
    again = run_prepare(tok_dir, [tmp_path / "ok.jsonl"], out, max_length=100)
    assert again.kept == 1 and read_manifest(out, "prepare")["config"]["max_length"] == 100
    assert not (out / ".work").exists()


def test_an_unfinished_regenerate_folder_is_refused_a_finished_one_recorded(tok_dir, tmp_path):
    # a killed regenerate's prefix was prepared without a word, and nothing linked them
    from eyas.store.manifest import target_record, write_manifest

    record = target_record(str(tok_dir), tokenizer=load_tok(tok_dir), weights=False)
    regen = _regenerated(tmp_path, record, complete=False)
    with pytest.raises(EyasError, match="unfinished `eyas regenerate` run"):
        run_prepare(tok_dir, [regen], tmp_path / "p0")
    made = write_manifest(regen, "regenerate", {}, target=record, complete=True)
    run_prepare(tok_dir, [regen], tmp_path / "p1")
    inputs = read_manifest(tmp_path / "p1", "prepare")["inputs"]
    assert inputs == [{"step": "regenerate", "id": made["id"], "path": str(regen),
                       "config": {}}]  # (the config regenerate recorded: eyas run's check)


@pytest.mark.parametrize("change, why", [
    ({"tokenizer_hash": "0" * 16}, r"regenerate` output .*regen in --data was made for target "
                                   r"other-model .*regenerate its prompts with --target"),
    # a fine-tune or the base model (same tokenizer and shape) passed: regenerate recorded
    # no weights, and prepare compared none
    ({"weights_fingerprint": "0" * 16}, r"holds the answers of other-model .*same tokenizer "
                                        r"and shape but other weights.*pass its file"),
])
def test_answers_of_another_target_are_refused_unless_given_as_a_file(llama_dir, tmp_path,
                                                                      change, why):
    from eyas.store.manifest import target_record, write_manifest

    mine = target_record(str(llama_dir), tokenizer=load_tok(llama_dir))
    assert mine["weights_fingerprint"]
    regen = _regenerated(tmp_path, mine)
    assert run_prepare(llama_dir, [regen], tmp_path / "p1").kept == 1
    write_manifest(regen, "regenerate", {}, target={**mine, "name_or_path": "other-model",
                                                   **change}, complete=True)
    with pytest.raises(EyasError, match=why):
        run_prepare(llama_dir, [regen], tmp_path / "p2")
    assert run_prepare(llama_dir, [regen / "conversations.jsonl"], tmp_path / "p3").kept == 1


def test_answers_asked_in_another_chat_template_are_warned_about(tok_dir, tmp_path, caplog):
    """regenerate records the template it asked in; prepare rendering those answers in another
    (its --chat-template, the regenerate run's not) says so, naming both ways to agree."""
    from eyas.store.manifest import chat_template_fingerprint, target_record, write_manifest

    tok = load_tok(tok_dir)
    record = target_record(str(tok_dir), tokenizer=tok, weights=False)
    regen = _regenerated(tmp_path, record)
    write_manifest(regen, "regenerate", {}, target=record, complete=True,
                   chat_template_hash=chat_template_fingerprint(tok))
    with caplog.at_level(logging.WARNING, logger="eyas.prepare"):
        run_prepare(tok_dir, [regen], tmp_path / "p1")
    assert "asked in another chat template" not in caplog.text
    other = tmp_path / "other.jinja"
    other.write_text(tok.chat_template.replace("{{", "{{- ", 1))
    with caplog.at_level(logging.WARNING, logger="eyas.prepare"):
        run_prepare(tok_dir, [regen], tmp_path / "p2", chat_template=str(other))
    assert re.search(r"regenerate` output .*regen were asked in another chat template "
                     r"\(chat_template_hash \w+\) than prepare renders them in \(\w+\).*"
                     r"eyas regenerate --chat-template FILE", caplog.text)
    # through a server (the openai backend), the template asked in is known only where given
    caplog.clear()
    mine = chat_template_fingerprint(tok)
    tok.chat_template = other.read_text()
    theirs = chat_template_fingerprint(tok)
    for given, asked, warned in ((None, mine, False), (str(other), theirs, False),
                                 ("x.jinja", mine, True)):
        write_manifest(regen, "regenerate", {"backend": "openai", "chat_template": given},
                       target=record, complete=True, chat_template_hash=asked)
        with caplog.at_level(logging.WARNING, logger="eyas.prepare"):
            run_prepare(tok_dir, [regen], tmp_path / f"p-{given}", chat_template=str(other))
        assert ("asked in another chat template" in caplog.text) == warned, given
        caplog.clear()


def test_a_regenerate_runs_file_named_by_itself_keeps_its_system_prompt(tok_dir, tmp_path):
    """From an audit: the README's and `eyas run`'s way, --data REGEN/conversations.jsonl,
    recorded no regenerate input, so eval rendered prompts without the system prompt every
    row was answered with; and prepare's own --system-prompt (added only to rows with none)
    was recorded over regenerate's."""
    from eyas.store.manifest import chat_record, target_record, write_manifest

    record = target_record(str(tok_dir), tokenizer=load_tok(tok_dir), weights=False)
    regen = _regenerated(tmp_path, record)
    write_manifest(regen, "regenerate", {"system_prompt": "You are terse."}, target=record,
                   complete=True)
    run_prepare(tok_dir, [regen / "conversations.jsonl"], tmp_path / "p1")
    made = read_manifest(tmp_path / "p1", "prepare")
    assert [i["path"] for i in made["inputs"]] == [str(regen)]
    assert chat_record(made)["system_prompt"] == "You are terse."
    run_prepare(tok_dir, [regen], tmp_path / "p2", system_prompt="You are verbose.")
    assert chat_record(read_manifest(tmp_path / "p2", "prepare"))["system_prompt"] == \
        "You are terse."


def test_a_regenerate_folder_inside_a_data_folder_is_checked_and_recorded(llama_dir, tmp_path):
    # parts regenerated apart under one folder, given as --data: read, but another model's
    # answers were taken without a word and the folder was not recorded as an input
    from eyas.store.manifest import target_record, write_manifest

    mine = target_record(str(llama_dir), tokenizer=load_tok(llama_dir))
    (tmp_path / "parts").mkdir()
    regen = _regenerated(tmp_path / "parts", mine)
    assert run_prepare(llama_dir, [tmp_path / "parts"], tmp_path / "p1").kept == 1
    assert [i["path"] for i in read_manifest(tmp_path / "p1", "prepare")["inputs"]] == [str(regen)]
    write_manifest(regen, "regenerate", {}, target={**mine, "name_or_path": "other-model",
                                                   "weights_fingerprint": "0" * 16}, complete=True)
    with pytest.raises(EyasError, match=r"output .*parts/regen in --data holds the answers of "
                                        r"other-model"):
        run_prepare(llama_dir, [tmp_path / "parts"], tmp_path / "p2")


def _regenerated(tmp_path, target: dict, complete: bool = True):
    """A regenerate output folder of one conversation, answered by `target` (its record)."""
    from eyas.store.manifest import write_manifest

    regen = tmp_path / "regen"
    regen.mkdir()
    (regen / "conversations.jsonl").write_text(json.dumps({"messages": PLAIN}) + "\n")
    write_manifest(regen, "regenerate", {}, target=target, complete=complete)
    return regen


def load_tok(folder):
    from eyas.targets.models import load_tokenizer

    return load_tokenizer(str(folder))


def test_empty_answers_are_counted_and_named(tok_dir, tmp_path, caplog):
    # an assistant turn of no text trains only its end-of-turn token (the draft learns to end
    # answers at once); it is kept, as the data says, but counted and named, never silent
    caplog.set_level(logging.WARNING, logger="eyas")
    empty = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": " "}]
    rows = [{"id": "fine", "messages": PLAIN}, {"id": "hollow", "messages": empty}]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = run_prepare(tok_dir, [tmp_path / "x.jsonl"], tmp_path / "out")
    assert (s.kept, s.empty_answers) == (2, 1)
    assert "1 kept conversation(s) hold an assistant turn with no text" in caplog.text
    assert "'hollow'" in caplog.text
    stats = json.loads((tmp_path / "out/eyas.json").read_text())["stats"]
    assert stats["empty_answers"] == 1 and stats["empty_questions"] == 0
    # a user turn of no text, the same: its answer is a reply to nothing
    caplog.clear()
    rows.append({"id": "unasked", "messages": [{"role": "user", "content": ""},
                                               {"role": "assistant", "content": "Hello!"}]})
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = run_prepare(tok_dir, [tmp_path / "x.jsonl"], tmp_path / "out2")
    assert (s.kept, s.empty_answers, s.empty_questions) == (3, 1, 1)
    assert "1 kept conversation(s) hold a user turn with no text, e.g. ['unasked']" in \
        caplog.text


def test_an_output_of_another_step_is_refused_as_data(tok_dir, tmp_path):
    # a prepare output given as --data was read row by row as conversations, and every row
    # (its rejects, its dataset's token ids) rejected, with no word that it was the wrong folder
    (tmp_path / "ok.jsonl").write_text(json.dumps({"messages": PLAIN}) + "\n")
    run_prepare(tok_dir, [tmp_path / "ok.jsonl"], tmp_path / "p1")
    with pytest.raises(EyasError, match=r"p1 is an `eyas prepare` output, not chat data"):
        run_prepare(tok_dir, [tmp_path / "p1"], tmp_path / "p2")
    with pytest.raises(EyasError, match=r"p1 is a folder; give --chat-template the path"):
        run_prepare(tok_dir, [tmp_path / "ok.jsonl"], tmp_path / "p3",
                    chat_template=str(tmp_path / "p1"))


def test_an_out_inside_a_data_folder_is_refused(tok_dir, tmp_path):
    # the first run read the folder; the same command again found its own output there and
    # refused it as "an `eyas prepare` output, not chat data"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "ok.jsonl").write_text(json.dumps({"messages": PLAIN}) + "\n")
    for data in ([tmp_path / "data"], [str(tmp_path / "data" / "*")]):
        with pytest.raises(EyasError, match=r"--out .*data/prepared is inside --data .*data"):
            run_prepare(tok_dir, data, tmp_path / "data" / "prepared")
    assert not (tmp_path / "data" / "prepared").exists()
    s = run_prepare(tok_dir, [str(tmp_path / "data" / "*.jsonl")], tmp_path / "data" / "prepared")
    assert s.kept == 1  # a glob that cannot match the output is fine


# ---------------------------------------------------------------- nothing lost (issue 34)

def test_every_input_line_is_accounted_for(tok_dir, tmp_path, tok, caplog):
    # A lone surrogate (valid JSON, not Unicode) ended the whole run in pyarrow; blank lines
    # and too-long rows were in no list; a BOM made a row a reject; duplicate ids, a .txt and
    # a regenerate folder's own eyas.json and rejects.jsonl went unmentioned or were rejected.
    caplog.set_level(logging.INFO, logger="eyas")
    short = {"messages": chat.normalize(json.loads((make_data(tmp_path / "x") / "b.json")
                                                   .read_text())[0])}
    limit = len(tokenize_conversation(tok, short["messages"])[0]) + 2
    root = tmp_path / "data"
    root.mkdir()
    lines = ["\ufeff" + json.dumps({"id": "bom", **short}),  # 1: kept (BOM dropped)
             "",  # 2: blank
             json.dumps({"id": "twin", **short}),  # 3: kept
             json.dumps({"id": "twin", **short}),  # 4: kept, a duplicate id
             json.dumps({"id": "odd", "messages": [{"role": "user", "content": "\ud800 lone"},
                                                  {"role": "assistant", "content": "ok"}]}),
             "   ",  # 6: blank
             json.dumps({"id": "long", "messages": PLAIN}),  # 7: too long
             "{oops"]  # 8: invalid JSON
    assert "\\ud800" in lines[4]  # the escape, as JSON writers put it in a file
    (root / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "notes.txt").write_text("not chat data")
    regen = root / "regen"
    regen.mkdir()
    from eyas.store.manifest import write_manifest

    write_manifest(regen, "regenerate", {}, complete=True)  # (recorded as an input now)
    (regen / "conversations.jsonl").write_text(json.dumps({"id": "r-1", **short}) + "\n")
    (regen / "rejects.jsonl").write_text(json.dumps(
        {"file": "f", "row": 1, "sample_id": "s", "reason": "HTTP 500", "kind": "server"}) + "\n")

    s = run_prepare(tok_dir, [root], tmp_path / "out", max_length=limit)
    assert (s.rows, s.kept, s.dropped_too_long, s.rejected, s.blank_lines) == (9, 4, 1, 2, 2)
    assert s.kept + s.dropped_too_long + s.rejected + s.blank_lines == s.rows
    assert s.duplicate_ids == 1 and "repeat an earlier row's id ('twin' x2)" in caplog.text
    listed = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    a = str(root / "a.jsonl")
    assert [(r["file"], r["row"], r["kind"]) for r in listed] == [
        (a, 2, "blank"), (a, 5, "malformed"), (a, 6, "blank"), (a, 7, "too_long"),
        (a, 8, "malformed")]
    assert "lone UTF-16 surrogate" in listed[1]["reason"]
    assert f"> max_length {limit}" in listed[3]["reason"] and listed[3]["sample_id"] == "long"
    train = datasets.load_from_disk(str(tmp_path / "out" / "dataset"))["train"]
    assert train["sample_id"] == ["bom", "twin", "twin", "r-1"]
    assert "notes.txt" in caplog.text and str(regen / "eyas.json") in caplog.text
    stats = read_manifest(tmp_path / "out", "prepare")["stats"]
    assert (stats["rows"], stats["blank_lines"], stats["duplicate_ids"]) == (9, 2, 1)


def test_the_targets_position_limit_caps_max_length(tok_dir, tmp_path, tok, caplog):
    # The default --max-length 2048 with a target of max_position_embeddings 512 kept rows
    # that capture then ran past the target's positions.
    import transformers

    caplog.set_level(logging.INFO, logger="eyas")
    root = make_data(tmp_path / "data")
    long_len = len(tokenize_conversation(tok, PLAIN)[0])
    short_len = len(tokenize_conversation(tok, chat.normalize(
        json.loads((root / "b.json").read_text())[0]))[0])
    limit = (short_len + long_len) // 2  # the PLAIN rows (1 jsonl + 2 ds) are past it
    target = tmp_path / "target"
    save_tiny_tokenizer(target)
    transformers.LlamaConfig(vocab_size=2048, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2,
                             max_position_embeddings=limit).save_pretrained(target)
    drop = run_prepare(target, [root], tmp_path / "drop")  # --max-length 2048, the default
    assert (drop.kept, drop.dropped_too_long, drop.max_length) == (5, 3, limit)
    assert f"max_position_embeddings {limit}: prepare applies {limit}" in caplog.text
    m = read_manifest(tmp_path / "drop", "prepare")
    assert (m["max_length"], m["max_position_embeddings"]) == (limit, limit)
    assert m["config"]["max_length"] == 2048
    # each row's reason names the target's cap, not --max-length (an audit: raising it, as
    # the reasons said, could keep nothing)
    reasons = [r["reason"] for r in map(json.loads, open(tmp_path / "drop" / "rejects.jsonl"))
               if "tokens > max_length" in r["reason"]]
    assert len(reasons) == 3 and all(
        f"> max_length {limit} (the target's max_position_embeddings; --length-policy "
        f"truncate keeps the first {limit})" in r for r in reasons), reasons
    cut = run_prepare(target, [root], tmp_path / "cut", length_policy="truncate")
    assert (cut.kept, cut.truncated) == (8, 3)
    train = datasets.load_from_disk(str(tmp_path / "cut" / "dataset"))["train"]
    assert max(train["num_tokens"]) == limit
    assert run_prepare(target, [root], tmp_path / "lower", max_length=limit - 1).max_length \
        == limit - 1  # a smaller --max-length still applies


# Qwen2.5-style ChatML with tool calls: the calls are written after the content, their
# arguments with `tojson` (an audit: the OpenAI form's JSON text was encoded twice).
CHATML_TOOLS = CHATML.replace(
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}",
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>\\n{\"name\": \"' + c.function.name"
    " + '\", \"arguments\": ' + c.function.arguments | tojson + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}")
TOOL_ROW = {"id": "tool-call", "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."}]}


def test_tool_calls_are_supervised_as_the_template_renders_them(tok, tmp_path, tok_dir):
    # An OpenAI tool call (content null + tool_calls) was rejected as "turn 1 has no content".
    tok.chat_template = CHATML_TOOLS
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    check(tok, chat.normalize(TOOL_ROW), [
        (chatml("system", "You are a helpful assistant.") + chatml("user", "Weather in Paris?")
         + "<|im_start|>assistant\n", False), (call + "<|im_end|>", True),
        ("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
         "<|im_start|>assistant\n", False), ("It is sunny.<|im_end|>", True), ("\n", False)])
    (tmp_path / "t.jsonl").write_text(json.dumps(TOOL_ROW) + "\n")
    (tmp_path / "tools.jinja").write_text(CHATML_TOOLS)
    s = run_prepare(tok_dir, [tmp_path / "t.jsonl"], tmp_path / "out",
                    chat_template=str(tmp_path / "tools.jinja"))
    assert (s.kept, s.rejected) == (1, 0)
    # A template without tool-call support would drop the call: a reason naming it instead.
    (tmp_path / "plain.jinja").write_text(CHATML)
    with pytest.raises(EyasError, match="no usable"):
        run_prepare(tok_dir, [tmp_path / "t.jsonl"], tmp_path / "plain",
                    chat_template=str(tmp_path / "plain.jinja"))
    reject = json.loads((tmp_path / "plain" / "rejects.jsonl").read_text())
    assert "assistant turn 1 is a tool call (get_weather) that the chat template does not " \
           "render" in reject["reason"]


# ---------------------------------------------------------------- config and CLI

def test_config_validation():
    base = {"target": "t", "data": ("d",), "out": "o"}
    for bad in ({"eval_fraction": 1.0}, {"max_length": 1}, {"num_proc": 0},
                {"chat_template_kwargs": ("enable_thinking",)}, {"data": ()}):
        with pytest.raises(ConfigError):
            PrepareConfig(**{**base, **bad})


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["prepare", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    import dataclasses
    for f in dataclasses.fields(PrepareConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name
    assert "--config" in text
    assert build_parser()  # the parser builds with prepare's config


def test_yaml_config_with_cli_override(tmp_path):
    cfg_file = tmp_path / "prep.yaml"
    cfg_file.write_text(yaml.safe_dump({"target": "meta-llama/Llama-3.1-8B-Instruct",
                                        "data": ["a.jsonl", "b.parquet"], "out": "prepared",
                                        "max_length": 4096, "length_policy": "truncate"}))
    cfg = parse_config("prepare", ["--config", str(cfg_file), "--max-length", "1024",
                                   "--reasoning", "strip"])
    assert cfg.max_length == 1024 and cfg.length_policy == "truncate"
    assert cfg.data == ("a.jsonl", "b.parquet") and cfg.reasoning == "strip"
    cfg_file.write_text(yaml.safe_dump({"target": "x", "data": "a", "out": "o", "max_len": 5}))
    with pytest.raises(ConfigError, match="unknown config key.*max_len"):
        parse_config("prepare", ["--config", str(cfg_file)])


def test_cli_end_to_end(tok_dir, tmp_path):
    root = make_data(tmp_path / "data")
    assert main(["prepare", "--target", str(tok_dir), "--data", str(root / "b.json"),
                 "--out", str(tmp_path / "out"), "--eval-fraction", "0.5"]) == 0
    assert read_manifest(tmp_path / "out", "prepare")["stats"]["eval"] == 1
    assert main(["prepare", "--target", str(tok_dir), "--data", str(root / "nope.json"),
                 "--out", str(tmp_path / "out2")]) == 2


def test_reject_reasons_say_what_to_change(tok_dir, tmp_path):
    """A row whose only assistant turn opens it (context, nothing prompts it) and a row that
    --length-policy truncate cannot keep (its prompt alone is past --max-length) each say
    so, rather than "empty or unplaceable turns" or "truncate keeps the first N" (already
    the policy in force)."""
    rows = [[{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}],
            [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}],
            [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    stats = run_prepare(tok_dir, [data], tmp_path / "p", max_length=64,
                        length_policy="truncate")
    assert (stats.kept, stats.rejected, stats.dropped_too_long) == (1, 1, 1)
    rejects = {r["row"]: r for r in map(json.loads, open(tmp_path / "p/rejects.jsonl"))}
    assert rejects[2]["reason"] == ("no assistant tokens to supervise: the only assistant turn "
                                    "is the first message, taken as context (nothing prompts "
                                    "it)")
    assert re.fullmatch(r"\d+ tokens > max_length 64, and its first 64 hold no assistant token "
                        r"\(the prompt alone is longer\): raise --max-length to keep it",
                        rejects[3]["reason"])


def test_a_tokenizer_with_more_tokens_than_the_model_has_rows_sets_those_rows_aside(
        tmp_path, caplog):
    """From an audit: a target whose tokenizer has tokens past its embedding rows (added
    without resizing the model) passed prepare, then `eyas capture` ended in a bare IndexError
    on every run, and vocab made a t2d over the tokenizer's ids, which train then refused.
    Prepare now sets the rows holding such ids aside, counted, with the reason, and counts
    over the model's rows; capture takes the rest."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyas.capture import CaptureConfig, capture
    from eyas.targets.tiny import tiny_config

    target = tmp_path / "target"
    save_tiny_tokenizer(target)
    tok = AutoTokenizer.from_pretrained(target)
    rows = len(tok)  # the model has a row for each of its tokens, not for the two added next
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=rows)).save_pretrained(target)
    tok.add_tokens(["<new-a>", "<new-b>"])
    tok.save_pretrained(target)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
        for q, a in [("hi there", "hello"), ("say <new-a>", "<new-a> <new-b>"),
                     ("and you", "fine")]))
    with caplog.at_level(logging.WARNING):
        stats = prepare(PrepareConfig(target=str(target), data=(str(data),),
                                      out=str(tmp_path / "p"), eval_fraction=0.0))
    assert f"has {rows + 2} tokens, more than the model's {rows} embedding rows" in caplog.text
    assert (stats.kept, stats.rejected) == (2, 1)
    (reject,) = map(json.loads, open(tmp_path / "p/rejects.jsonl"))
    assert reject["row"] == 2 and f"is past the target's {rows} embedding rows" in \
        reject["reason"]
    assert read_manifest(tmp_path / "p")["vocab_size"] == rows
    done = capture(CaptureConfig(target=str(target), data=str(tmp_path / "p"),
                                 out=str(tmp_path / "c"), model_dtype="fp32",
                                 device="cpu"))
    assert done["samples"] == 2
