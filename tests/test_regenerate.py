"""`eyas regenerate` on a tiny llama: both backends, real HTTP with faults, resume after a kill.

The tiny random model rarely emits its own end-of-turn token, so the fixture copies it and adds
one token its greedy answers often contain to `generation_config.eos_token_id` (real models list
several end ids the same way, e.g. Llama 3). Some rows then finish and others run into
`max_new_tokens` (kept, marked truncated), which exercises both outcomes. Every expected
answer comes from an independent reference: plain one-prompt `model.generate` without padding
or batching.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eyas.cli import main
from eyas.config import ConfigError
from eyas.targets.corpus import synthetic_chats
from eyas.errors import EyasError
from eyas.serve.generator import load_generator
from eyas.serve.openai_server import ChatServer
from eyas.regenerate import RegenerateConfig, regenerate
from eyas.store.regenerate_output import KILL_ENV, OUTPUT, REJECTS

MAX_NEW = 10
# The Llama-3 template of eyas.targets.tiny plus Qwen3's switch: thinking off = an empty think block.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


SYNTHETIC = synthetic_chats(9, seed=5)  # one and two assistant turns, some with a system turn
# Prompt-only rows (no assistant turn) and a conversation that ends with a user turn: each
# gets a new final answer.
PROMPTS = ("prompt-first", "prompt-only", "sharegpt-prompt", "system-prompt", "ends-with-user")
# Rows refused as input: nothing to answer, an unknown role, a line that is not JSON.
INPUT_REJECTS = 3


def _rows() -> list:
    """Input rows: a prompt-only row, synthetic chats, a ShareGPT row, a tool call, more
    prompt-only rows, then the malformed ones."""
    rows: list = [{"id": "prompt-first", "messages": [
        {"role": "user", "content": "Write a sentence about a green frog."}]}, *SYNTHETIC]
    rows.append({"id": "sharegpt-1", "conversations": [
        {"from": "human", "value": "Name three animals."}, {"from": "gpt", "value": "A cat."}]})
    rows.append({"id": "tool-1", "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "call get_weather(city='Paris')"},
        {"role": "tool", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny in Paris."}]})
    rows.append({"id": "prompt-only", "messages": [{"role": "user", "content": "Hello?"}]})
    rows.append({"id": "sharegpt-prompt", "conversations": [
        {"from": "human", "value": "Count from 3 to 9."}]})
    rows.append({"id": "system-prompt", "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What do you know about Paris?"}]})
    rows.append({"id": "ends-with-user", "messages": [
        {"role": "user", "content": "Name two animals."},
        {"role": "assistant", "content": "A fox and an owl."},
        {"role": "user", "content": "Add 12 and 30."}]})
    rows.append({"id": "system-only", "messages": [{"role": "system", "content": "Be brief."}]})
    rows.append({"id": "bad-role", "messages": [{"role": "robot", "content": "beep"}]})
    rows.append("this line is not JSON")
    return rows


def _messages(row: dict) -> list[dict]:
    return row.get("messages") or [
        {"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
        for t in row["conversations"]]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(llama_dir, tmp_path_factory):
    """(model dir, data file, input rows, reference outcome per row id)."""
    root = tmp_path_factory.mktemp("regen")
    model_dir = Path(shutil.copytree(llama_dir, root / "model"))
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    rows = _rows()
    data = root / "chats.jsonl"
    data.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    gen = load_generator(model_dir, device="cpu")
    stop = _pick_stop_token(gen, rows)
    config = json.loads((model_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], stop]
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    gen = load_generator(model_dir, device="cpu")
    assert gen.stop_ids == {gen.tokenizer.eos_token_id, stop}
    expected = {r["id"]: _reference(gen, _messages(r)) for r in rows[:-INPUT_REJECTS]}
    return model_dir, data, rows, expected


def _prompt_ids(tok, messages) -> torch.Tensor:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                   enable_thinking=False)
    return tok(text, add_special_tokens=False, return_tensors="pt").input_ids  # (1, T)


def _greedy(gen, messages, eos: list[int], max_new: int = MAX_NEW) -> list[int]:
    ids = _prompt_ids(gen.tokenizer, messages)
    with torch.no_grad():
        out = gen.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, eos_token_id=eos,
                                 pad_token_id=gen.tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def _pick_stop_token(gen, rows) -> int:
    """A token that ends some greedy first answers but is missing from others."""
    eos = gen.tokenizer.eos_token_id
    answers = [_greedy(gen, r["messages"][:next(i for i, m in enumerate(r["messages"])
                                                if m["role"] == "assistant")], [eos])
               for r in SYNTHETIC]
    seen = Counter(t for a in answers for t in set(a[1:]))
    return next(t for t, n in seen.most_common() if n < len(answers) and t != eos)


def _reference(gen, messages, last_only: bool = False, max_new: int = MAX_NEW,
               drop_truncated: bool = False, max_length: int = 0) -> dict | str:
    """Regenerate every assistant turn (tool calls kept), or the last, one prompt at a time; a
    conversation ending with a user turn gets a new final answer, a truncated answer ends the
    conversation, and so does a prompt of max_length tokens (after the last answer before it;
    rejected if none). {"messages", "truncated"}, or the reject kind."""
    messages = [dict(m) for m in messages]
    if messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": ""})
    redo = [i for i, m in enumerate(messages) if m["role"] == "assistant"
            and not (i + 1 < len(messages) and messages[i + 1]["role"] == "tool")]
    done = []
    for i in redo[-1:] if last_only else redo:
        if max_length and _prompt_ids(gen.tokenizer, messages[:i]).shape[1] >= max_length:
            if not done:
                return "length"
            return {"messages": messages[:done[-1] + 1], "truncated": False, "at_length": True}
        done.append(i)
        new = _greedy(gen, messages[:i], sorted(gen.stop_ids), max_new)
        end = next((k for k, t in enumerate(new) if t in gen.stop_ids), None)
        text = gen.tokenizer.decode(new[:end], skip_special_tokens=True)
        if end is None:
            text = text.rstrip("\ufffd")  # a character cut in half is not the target's
        if not text.strip():
            return "empty"
        if end is None and drop_truncated:
            return "length"
        messages[i] = {"role": "assistant", "content": text}
        if end is None:
            return {"messages": messages[:i + 1], "truncated": True}
    return {"messages": messages, "truncated": False}


def _cfg(setup, out, **kw) -> RegenerateConfig:
    model_dir, data, _, _ = setup
    values = dict(target=str(model_dir), data=(str(data),), out=str(out),
                  max_new_tokens=MAX_NEW, reasoning="off", batch_size=3)
    return RegenerateConfig(**{**values, **kw})


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _outcomes(out: Path) -> dict:
    """Row id -> {"messages", "truncated"} or the reject kind, from an output folder."""
    got = {r["id"]: {"messages": r["messages"], "truncated": r["truncated"]}
           for r in _read(out / OUTPUT)}
    got.update({r["sample_id"]: r["kind"] for r in _read(out / REJECTS)})
    return got


def _with_input_rejects(setup, expected: dict) -> dict:
    data, rows = setup[1], setup[2]
    return {**expected, "system-only": "input", "bad-role": "input",
            f"{data}:{len(rows)}": "input"}  # the bad JSON line has no id of its own


def _check_outputs(setup, out: Path, expected: dict | None = None) -> dict:
    """Every input row is in exactly one output, as the reference says; returns the manifest."""
    rows = setup[2]
    ok, rejects = _read(out / OUTPUT), _read(out / REJECTS)
    keys = [(r["source"]["file"], r["source"]["row"]) for r in ok] + [
        (r["file"], r["row"]) for r in rejects]
    assert sorted(k[1] for k in keys) == list(range(1, len(rows) + 1))  # no loss, no duplicate
    assert [r["source"]["row"] for r in ok] == sorted(r["source"]["row"] for r in ok)
    assert _outcomes(out) == _with_input_rejects(setup, expected or setup[3])
    manifest = json.loads((out / "eyas.json").read_text())
    assert manifest["complete"] is True
    # the weights it ran, where it ran them (prepare refuses these answers for others)
    assert bool(manifest["target"].get("weights_fingerprint")) == \
        (manifest["config"]["backend"] != "openai")
    stats = manifest["stats"]
    assert stats["ok"] + stats["failed"] + stats["skipped"] == stats["input"] == len(rows)
    assert stats["ok_total"] == len(ok) and stats["failed_total"] == len(rejects)
    assert stats["truncated_total"] == sum(r["truncated"] for r in ok)
    return manifest


@pytest.fixture(scope="module")
def local_run(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "out"
    return out, regenerate(_cfg(setup, out))


def _kinds(expected: dict) -> Counter:
    return Counter(v if isinstance(v, str) else "truncated" if v["truncated"] else "ok"
                   for v in expected.values())


def test_transformers_backend_regenerates_like_plain_generate(setup, local_run):
    out, stats = local_run
    _, _, rows, expected = setup
    kinds = _kinds(expected)
    assert kinds["ok"] >= 2 and kinds["truncated"] >= 1, kinds  # both outcomes are exercised
    manifest = _check_outputs(setup, out)
    assert stats == manifest["stats"]
    assert stats["input"] == len(rows) == stats["ok"] + stats["failed"] + stats["skipped"]
    assert stats["ok"] == kinds["ok"] + kinds["truncated"] and stats["skipped"] == 0
    assert stats["truncated"] == stats["truncated_total"] == kinds["truncated"]
    assert stats["failed_by_kind"] == {"input": INPUT_REJECTS, **{
        k: n for k, n in kinds.items() if k not in ("ok", "truncated")}}
    assert manifest["sampling"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert manifest["sampling"]["temperature"] == 0.0
    ok = {r["id"]: r for r in _read(out / OUTPUT)}
    if "tool-1" in ok:  # the tool call stays, only the final answer is new
        assert ok["tool-1"]["messages"][1]["content"] == "call get_weather(city='Paris')"
    reasons = {r["sample_id"]: r["reason"] for r in _read(out / REJECTS)}
    assert "no user or tool turn at the end to answer" in reasons["system-only"]
    assert "unknown role 'robot'" in reasons["bad-role"]


@pytest.mark.parametrize("batching, batch_size", [("continuous", 3), ("continuous", 1),
                                                   ("lookup", 3)])
def test_other_batchings_give_the_same_answers(setup, local_run, tmp_path, batching,
                                               batch_size):
    """Padded batches (the default), transformers' continuous batching and prompt-lookup
    speculative batches all equal the plain generate reference row for row, so they equal
    each other (T=0). Continuous batching keeps batch_size x 8 conversations in flight and
    refills the pool as they end: at batch size 1 the pool (8) is smaller than the input, so
    conversations join while others are mid-way."""
    assert json.loads((local_run[0] / "eyas.json").read_text())["config"]["batching"] == \
        "padded"
    assert batch_size > 1 or len(setup[2]) > 8  # the pool is refilled
    out = tmp_path / batching
    regenerate(_cfg(setup, out, batching=batching, batch_size=batch_size))
    _check_outputs(setup, out)
    assert _read(out / OUTPUT) == _read(local_run[0] / OUTPUT)


def test_prompt_only_rows_get_an_answer(setup, local_run):
    ok = {r["id"]: r for r in _read(local_run[0] / OUTPUT)}
    prompts = {p: ok[p] for p in PROMPTS if p in ok}
    assert len(prompts) >= 4, sorted(ok)  # the tiny model answers most of them
    for sid, row in prompts.items():
        source = _messages(setup[2][row["source"]["row"] - 1])
        assert row["messages"][-1]["role"] == "assistant" and row["messages"][-1]["content"]
        if not row["truncated"]:
            assert len(row["messages"]) == len(source) + 1, sid
        assert [m["role"] for m in row["messages"][:len(source)]] == [
            m["role"] for m in source][:len(row["messages"])]
    if "ends-with-user" in prompts and len(prompts["ends-with-user"]["messages"]) == 4:
        # turns=all: the earlier answer was regenerated too
        assert prompts["ends-with-user"]["messages"][1]["content"] != "A fox and an owl."


def test_rows_the_template_refuses_are_rejected_and_greetings_kept(setup, tmp_path):
    """A row the chat template refuses (roles that do not alternate, as Mistral's and Gemma's
    demand) is rejected, kind input, with the template's words, and the rows around it are
    still answered; an assistant greeting before the first user turn has no prompt, so it is
    kept as it is and only the turns after it are regenerated (the greeting's text is one
    the tiny model answers with some text, not with nothing). Both crashed the run before,
    and every re-run crashed at the same row."""
    model = Path(shutil.copytree(setup[0], tmp_path / "strict"))
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == 'user' and "
        "messages[loop.index0 - 1]['role'] == 'user' %}{{ raise_exception('Conversation "
        "roles must alternate user/assistant') }}{% endif %}{% endfor %}" + TEMPLATE)
    rows = [{"id": "good", "messages": [{"role": "user", "content": "Name a colour."}]},
            {"id": "twice", "messages": [{"role": "user", "content": "Hi."},
                                         {"role": "user", "content": "Again?"},
                                         {"role": "assistant", "content": "Yes."}]},
            {"id": "greeting", "messages": [
                {"role": "assistant", "content": "I am a helpful bot."},
                {"role": "user", "content": "Count to 3."},
                {"role": "assistant", "content": "1 2 3"}]},
            {"id": "greeting-only", "messages": [{"role": "assistant", "content": "Hi!"}]}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for turns in ("all", "last"):
        out = tmp_path / turns
        stats = regenerate(_cfg(setup, out, target=str(model), data=(str(data),), turns=turns))
        assert stats["input"] == 4 and stats["ok"] + stats["failed"] == 4
        rejects = {r["sample_id"]: r for r in _read(out / REJECTS)}
        assert set(rejects) == {"twice", "greeting-only"}
        assert rejects["twice"]["kind"] == "input"
        assert "chat template failed" in rejects["twice"]["reason"]
        assert "must alternate" in rejects["twice"]["reason"]
        assert "after a user turn" in rejects["greeting-only"]["reason"]
        ok = {r["id"]: r["messages"] for r in _read(out / OUTPUT)}
        assert ok["good"][-1]["role"] == "assistant" and ok["good"][-1]["content"]
        assert ok["greeting"][0] == rows[2]["messages"][0]  # the greeting, as it was
        assert [m["role"] for m in ok["greeting"]][:2] == ["assistant", "user"]


def test_empty_input_and_every_row_refused_say_what_to_do(setup, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(EyasError, match="the input files are empty but for 2 blank lines"):
        regenerate(_cfg(setup, tmp_path / "a", data=(str(empty),)))
    assert json.loads((tmp_path / "a/eyas.json").read_text())["complete"] is False
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "robot", "content": "hi"}]}\n\nnot json\n')
    with pytest.raises(EyasError) as err:
        regenerate(_cfg(setup, tmp_path / "b", data=(str(bad),)))
    assert "kind input" in str(err.value) and "new --out" in str(err.value)
    # every line is accounted for: two rows refused, and the blank line between them counted
    stats = json.loads((tmp_path / "b/eyas.json").read_text())["stats"]
    assert (stats["input"], stats["failed"], stats["blank_lines"]) == (2, 2, 1)
    assert [r["row"] for r in _read(tmp_path / "b" / REJECTS)] == [1, 3]
    assert "--retry-rejects" not in str(err.value)  # it retries server errors only


def test_truncated_answers_are_kept_marked_and_end_the_conversation(setup, tmp_path):
    """With 1 new token every answer that is not empty is cut; turns=all stops at the cut."""
    gen = load_generator(setup[0], device="cpu")
    stats = regenerate(_cfg(setup, tmp_path, max_new_tokens=1))
    expected = {r["id"]: _reference(gen, _messages(r), max_new=1)
                for r in setup[2][:-INPUT_REJECTS]}
    _check_outputs(setup, tmp_path, expected)
    kinds = _kinds(expected)
    assert stats["truncated"] == kinds["truncated"] >= 4 and kinds["ok"] == 0
    rows = {r["id"]: _messages(r) for r in setup[2][:-INPUT_REJECTS]}
    short = [sid for sid, v in expected.items() if not isinstance(v, str)
             and len(v["messages"]) < len(rows[sid]) + (rows[sid][-1]["role"] == "user")]
    assert stats["cut_short"] == stats["cut_short_total"] == len(short) >= 1
    assert {r["id"] for r in _read(tmp_path / OUTPUT) if r.get("cut_short")} == set(short)
    again = regenerate(_cfg(setup, tmp_path, max_new_tokens=1))  # every row done before
    assert again["cut_short"] == 0 and again["cut_short_total"] == len(short)


def test_drop_truncated_rejects_them(setup, tmp_path):
    gen = load_generator(setup[0], device="cpu")
    stats = regenerate(_cfg(setup, tmp_path, drop_truncated=True))
    expected = {r["id"]: _reference(gen, _messages(r), drop_truncated=True)
                for r in setup[2][:-INPUT_REJECTS]}
    _check_outputs(setup, tmp_path, expected)
    assert stats["truncated"] == 0
    assert stats["failed_by_kind"]["length"] == _kinds(setup[3])["truncated"] >= 1
    reasons = [r["reason"] for r in _read(tmp_path / REJECTS) if r["kind"] == "length"]
    assert all("max_new_tokens=10" in r and "--drop-truncated" in r for r in reasons)


def test_max_length_ends_a_conversation_before_a_prompt_that_long(setup, local_run, tmp_path):
    """--max-length L: before each turn, a prompt of L tokens or more ends the conversation
    after the last answer (counted in cut_at_length, marked on the row); with none before it
    the row is rejected (kind length). The same through a server, which renders its own
    prompts: eyas counts them with the target's tokenizer."""
    gen = load_generator(setup[0], device="cpu")
    rows = {r["id"]: _messages(r) for r in setup[2][:-INPUT_REJECTS]}
    # prompt lengths of every turn: the median cuts some rows, rejects others, spares others
    lengths = sorted(_prompt_ids(gen.tokenizer, m[:i]).shape[1] for m in rows.values()
                     for i, x in enumerate(m) if x["role"] == "assistant")
    limit = lengths[len(lengths) // 2]
    expected = {sid: _reference(gen, m, max_length=limit) for sid, m in rows.items()}
    at_length = {sid for sid, v in expected.items() if isinstance(v, dict) and v.pop(
        "at_length", False)}
    kinds = Counter(v if isinstance(v, str) else "kept" for v in expected.values())
    assert len(at_length) >= 1 and kinds["length"] >= 1 and kinds["kept"] > len(at_length)
    stats = regenerate(_cfg(setup, tmp_path / "local", max_length=limit))
    _check_outputs(setup, tmp_path / "local", expected)
    assert stats["cut_at_length"] == len(at_length)
    assert {r["id"] for r in _read(tmp_path / "local" / OUTPUT)
            if r.get("cut_at_length")} == at_length
    reasons = [r["reason"] for r in _read(tmp_path / "local" / REJECTS) if r["kind"] == "length"]
    assert reasons and all(f"at least --max-length {limit}" in r for r in reasons)
    with ChatServer(gen, "tiny") as server:
        regenerate(_cfg(setup, tmp_path / "server", max_length=limit, backend="openai",
                        served_model_name="tiny", server_url=(server.url,)))
    assert _read(tmp_path / "server" / OUTPUT) == _read(tmp_path / "local" / OUTPUT)
    assert _read(tmp_path / "server" / REJECTS) == _read(tmp_path / "local" / REJECTS)


def test_accept_keeps_a_cut_answer_as_the_target_wrote_it():
    from eyas.serve.generator import Generation
    from eyas.serve.openai_client import _parse_choice
    from eyas.regenerate import accept
    from eyas.store.regenerate_output import Rejected

    cfg = RegenerateConfig(target="m", data=("d",), out="o")
    assert accept(Generation("caf\ufffd", "length"), 1, cfg)["content"] == "caf"
    assert accept(Generation("caf\ufffd", "stop"), 1, cfg)["content"] == "caf\ufffd"
    # Cut inside its reasoning, split off by a server's reasoning parser: no closing tag added.
    split = _parse_choice({"choices": [{"finish_reason": "length", "message": {
        "content": None, "reasoning_content": "Let me think"}}]})
    assert accept(split, 1, cfg)["content"] == "<think>\nLet me think"
    whole = _parse_choice({"choices": [{"finish_reason": "length", "message": {
        "content": "The answer", "reasoning_content": "Let me think"}}]})
    assert accept(whole, 1, cfg)["content"] == "<think>\nLet me think\n</think>\n\nThe answer"
    with pytest.raises(Rejected, match="--drop-truncated") as err:
        accept(whole, 1, replace(cfg, drop_truncated=True))
    assert err.value.kind == "length"
    with pytest.raises(Rejected, match="empty answer"):
        accept(Generation("  ", "length"), 1, cfg)


def test_output_is_ready_for_prepare(setup, local_run, tmp_path):
    import datasets

    from eyas.prepare import PrepareConfig, prepare

    out, _ = local_run
    prepare(PrepareConfig(target=str(setup[0]), data=(str(out / OUTPUT),), out=str(tmp_path),
                          chat_template_kwargs=("enable_thinking=false",), eval_fraction=0.0))
    ids = datasets.load_from_disk(str(tmp_path / "dataset"))["train"]["sample_id"]
    assert sorted(ids) == sorted(r["id"] for r in _read(out / OUTPUT))


def test_turns_last_keeps_earlier_answers(setup, tmp_path):
    rows = setup[2]
    two_turns = [r for r in SYNTHETIC if sum(m["role"] == "assistant" for m in r["messages"]) > 1]
    assert two_turns
    gen = load_generator(setup[0], device="cpu")
    regenerate(_cfg(setup, tmp_path, turns="last"))
    expected = {r["id"]: _reference(gen, _messages(r), last_only=True)
                for r in rows[:-INPUT_REJECTS]}
    _check_outputs(setup, tmp_path, expected)
    got = _outcomes(tmp_path)
    if not isinstance(got["ends-with-user"], str):  # only the new final answer is generated
        assert got["ends-with-user"]["messages"][1]["content"] == "A fox and an owl."


def test_server_backend_matches_transformers_despite_faults(setup, local_run, tmp_path):
    model_dir = setup[0]
    gen = load_generator(model_dir, device="cpu")
    flaky = ChatServer(gen, "tiny", fail_first=2, slow_requests=(3,), slow_seconds=2.0)
    steady = ChatServer(gen, "tiny", fail_every=4)
    with flaky, steady:
        stats = regenerate(_cfg(setup, tmp_path, backend="openai", served_model_name="tiny",
                                server_url=(flaky.url, steady.url + "/v1/"), concurrency=3,
                                timeout=1.0, retries=4, retry_backoff=0.01))
    assert _read(tmp_path / OUTPUT) == _read(local_run[0] / OUTPUT)  # greedy parity
    assert _read(tmp_path / REJECTS) == _read(local_run[0] / REJECTS)
    assert stats == local_run[1]
    assert flaky.stats["failed"] == 2 and flaky.stats["slowed"] == 1
    assert steady.stats["failed"] >= 1 and steady.stats["completions"] >= 1
    assert max(flaky.stats["peak_in_flight"], steady.stats["peak_in_flight"]) >= 2
    _check_outputs(setup, tmp_path)


def test_server_errors_become_rejects_then_retry_rejects(setup, tmp_path):
    out = tmp_path / "out"  # --out holds only regenerate's files (one --out policy)
    gen = load_generator(setup[0], device="cpu")
    with ChatServer(gen, "tiny", fail_every=1) as down, \
            pytest.raises(EyasError, match="no conversation was regenerated"):
        regenerate(_cfg(setup, out, backend="openai", served_model_name="tiny",
                        server_url=(down.url,), retries=1, retry_backoff=0.01))
    stats = json.loads((out / "eyas.json").read_text())["stats"]
    rejects = _read(out / REJECTS)
    server = [r for r in rejects if r["kind"] == "server"]
    usable = len(setup[2]) - INPUT_REJECTS
    assert len(server) == stats["failed_by_kind"]["server"] == usable
    assert all("after 2 attempts" in r["reason"] and "HTTP 500" in r["reason"]
               for r in server), [r["reason"] for r in server]
    assert down.stats["requests"] == 2 * usable  # every request was retried once

    with ChatServer(gen, "tiny", max_prompt_tokens=3) as small, \
            pytest.raises(EyasError, match="no conversation was regenerated"):
        short = tmp_path / "short"
        regenerate(_cfg(setup, short, backend="openai", served_model_name="tiny",
                        server_url=(small.url,)))
    assert small.stats["requests"] == usable  # HTTP 400 is not retried
    assert all("maximum context length" in r["reason"] for r in _read(short / REJECTS)
               if r["kind"] == "server")

    with ChatServer(gen, "tiny") as up:
        again = regenerate(_cfg(setup, out, backend="openai", served_model_name="tiny",
                                server_url=(up.url,), retry_rejects=True))
    assert again["skipped"] == INPUT_REJECTS and again["ok"] + again["failed"] == usable
    _check_outputs(setup, out)


@pytest.mark.parametrize("how", ["500", "401"])
def test_servers_that_die_mid_run_stop_it_and_the_same_command_resumes(setup, local_run,
                                                                      tmp_path, how):
    # A server killed mid-run turned every row left into a 'server' reject, marked the run
    # complete (exit 0) and the same command, run again after a restart, did nothing; so did
    # one that began to refuse every request (its key rotated: HTTP 401)
    gen = load_generator(setup[0], device="cpu")
    server = ChatServer(gen, "tiny")
    answer = gen.generate

    def dies_after_two(*args, **kwargs):
        if server.stats["completions"] >= 2:
            if how == "500":
                server.fail_first = 10**9  # every request from now on is an HTTP 500
            else:
                server.api_key = "rotated"
        return answer(*args, **kwargs)

    gen.generate = dies_after_two
    out = tmp_path / "out"
    def cfg(url):
        return _cfg(setup, out, backend="openai", served_model_name="tiny", server_url=(url,),
                    concurrency=1, retries=1, retry_backoff=0.01)

    with server, pytest.raises(EyasError, match="servers stopped answering: 8 conversations"):
        regenerate(cfg(server.url))
    assert json.loads((out / "eyas.json").read_text())["complete"] is False
    assert [r for r in _read(out / REJECTS) if r["kind"] == "server"] == []
    before = len(_read(out / OUTPUT))
    assert before >= 1
    gen.generate = answer
    with ChatServer(gen, "tiny") as restarted:  # the same command: no --retry-rejects
        stats = regenerate(cfg(restarted.url))
    assert stats["skipped"] == before
    assert _read(out / OUTPUT) == _read(local_run[0] / OUTPUT)
    _check_outputs(setup, out)


def test_only_an_answer_to_a_request_sent_after_a_failure_makes_it_the_rows_own(tmp_path):
    # With requests in flight, a long answer to one sent before a server's key was rotated
    # came after its first 401s and counted as "a server answers again": the rows refused
    # meanwhile were written as final rejects, which the same command does not redo.
    from eyas.store.regenerate_output import Failing, Job, Output, Unanswered

    def failed(row: int):
        return Job("chats.jsonl", row, f"id-{row}", [], [1]), Unanswered(f"HTTP 401 ({row})")

    failing = Failing(down_after=3)
    with Output(tmp_path, 1) as output:
        sent_before = time.monotonic()
        failing.rows.append(failed(1))
        failing.answered(sent_before)
        failing.settle(output)
        assert [job.row for job, _ in failing.rows] == [1]  # held back
        failing.answered(time.monotonic())  # sent after row 1 failed: that failure was its own
        failing.rows += [failed(2), failed(3)]
        failing.settle(output)
        assert [job.row for job, _ in failing.rows] == [2, 3]
        failing.answered(sent_before)
        failing.rows.append(failed(4))
        with pytest.raises(EyasError, match="servers stopped answering: 3 conversations"):
            failing.settle(output)
    assert [r["row"] for r in _read(tmp_path / REJECTS)] == [1]


class _Breaking(ChatServer):
    """A ChatServer that answers its first `answered` chat requests, then breaks: `how` 500,
    every later request gets HTTP 500; 401, HTTP 401 (a rotated key); ctrl-c, the next request
    sends SIGINT to the main thread (the run's) and every later one is answered after `hold`
    seconds. `posts` counts every chat request that arrived."""

    def __init__(self, gen, how: str, answered: int = 2, hold: float = 1.0):
        super().__init__(gen, "tiny")
        self.how, self.answered, self.hold = how, answered, hold
        self.posts = 0

    def chat(self, raw: bytes):
        with self._stats_lock:
            self.posts += 1
            number = self.posts
        if number <= self.answered:
            return super().chat(raw)
        # Broken answers come slowly enough for the run to stop among them. The first 8
        # refusals stop it (8 rows in a row); those then in flight are slow, so that the rows
        # waiting for a free slot would send theirs well after it stopped.
        time.sleep(1.0 if self.how == "401" and number > self.answered + 8 else 0.05)
        if self.how == "500":
            return 500, {"error": {"message": "induced failure", "code": 500}}
        if self.how == "401":
            return 401, {"error": {"message": "a valid API key is required", "code": 401}}
        if number == self.answered + 1:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(self.hold)
        return super().chat(raw)


@pytest.mark.parametrize("how", ["500", "401", "ctrl-c"])
def test_a_run_that_stops_sends_and_writes_nothing_after(setup, local_run, tmp_path, how):
    # regenerate() called in-process (`eyas run`, a notebook) raised, but its request threads
    # went on: rows in retry and conversations between turns sent requests to the servers
    # for as long as they had retries and turns left.
    gen = load_generator(setup[0], device="cpu")
    out = tmp_path / "out"

    def cfg(url):
        return _cfg(setup, out, backend="openai", served_model_name="tiny", server_url=(url,),
                    concurrency=4, retries=3, retry_backoff=0.2)

    stopped = (KeyboardInterrupt if how == "ctrl-c" else EyasError)
    with _Breaking(gen, how) as server:
        with pytest.raises(stopped):
            regenerate(cfg(server.url))
        files = {name: (out / name).read_bytes() for name in (OUTPUT, REJECTS)}
        time.sleep(0.5)  # a request sent just before it raised reaches the server's count
        posts = server.posts
        time.sleep(3)  # longer than the retries left (1.4 s of backoff) and slow answers
        assert server.posts == posts, "requests sent after regenerate() raised"
    assert {name: (out / name).read_bytes() for name in files} == files
    assert json.loads((out / "eyas.json").read_text())["complete"] is False
    assert not [t for t in threading.enumerate() if t.name == "eyas-regenerate"]
    with ChatServer(gen, "tiny") as restarted:  # the same command resumes
        regenerate(cfg(restarted.url))
    assert _read(out / OUTPUT) == _read(local_run[0] / OUTPUT)
    _check_outputs(setup, out)


def test_nothing_regenerated_fails_and_the_summary_counts_what_is_on_disk(setup, tmp_path,
                                                                          capsys, caplog):
    # Issue 34: a server that answered every request with HTTP 500 left an empty
    # conversations.jsonl behind exit 0, and a re-run logged "(rejects: none)" beside the
    # rejects.jsonl of the first run.
    caplog.set_level(logging.INFO, logger="eyas")
    gen = load_generator(setup[0], device="cpu")
    with ChatServer(gen, "tiny", fail_every=1) as down:
        args = ["regenerate", "--backend", "openai", "--server-url", down.url,
                "--served-model-name", "tiny", "--target", str(setup[0]),
                "--data", str(setup[1]), "--out", str(tmp_path), "--max-new-tokens",
                str(MAX_NEW), "--retries", "0"]
        assert main(args) != 0
        err = capsys.readouterr().err
        assert "no conversation was regenerated" in err and "--retry-rejects" in err
        caplog.clear()
        assert main(args) != 0  # the re-run: every row done before, none of them ok
    rows, usable = len(setup[2]), len(setup[2]) - INPUT_REJECTS
    assert len(_read(tmp_path / REJECTS)) == rows and _read(tmp_path / OUTPUT) == []
    assert (f"0 conversations in {OUTPUT}, {rows} rejects in {REJECTS} "
            f"(input {INPUT_REJECTS}, server {usable})") in caplog.text
    stats = json.loads((tmp_path / "eyas.json").read_text())["stats"]
    assert stats["skipped"] == rows and stats["failed_by_kind"] == {}
    assert stats["failed_by_kind_total"] == {"input": INPUT_REJECTS, "server": usable}


def test_resume_after_kill_has_no_duplicates_or_losses(setup, local_run, tmp_path):
    model_dir, data, rows, _ = setup
    gen = load_generator(model_dir, device="cpu")
    out = tmp_path / "out"
    with ChatServer(gen, "tiny") as server:
        args = [sys.executable, "-m", "eyas", "regenerate", "--backend", "openai",
                "--target", str(model_dir), "--served-model-name", "tiny", "--data", str(data),
                "--out", str(out), "--server-url", server.url, "--max-new-tokens", str(MAX_NEW),
                "--reasoning", "off", "--batch-size", "2", "--concurrency", "2"]
        env = {**os.environ, KILL_ENV: "5", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        before = _outcomes(out)
        done = len(before)
        assert 5 <= done < len(rows)
        assert "prompt-first" in before and "prompt-only" not in before  # prompts on both sides
        assert json.loads((out / "eyas.json").read_text())["complete"] is False
        with open(out / OUTPUT, "a") as f:  # as if a later kill had torn a line in half
            f.write('{"id": "torn", "messages": [{"ro')
        stats = regenerate(_cfg(setup, out, backend="openai", served_model_name="tiny",
                                server_url=(server.url,), batch_size=2))
    assert stats["skipped"] == done and stats["ok"] + stats["failed"] == len(rows) - done
    assert _read(out / OUTPUT) == _read(local_run[0] / OUTPUT)
    assert stats["truncated_total"] == local_run[1]["truncated"]
    assert stats["ok_total"] == local_run[1]["ok"]
    assert stats["cut_short_total"] == local_run[1]["cut_short"]
    _check_outputs(setup, out)


def test_ctrl_c_exits_at_once_and_leaves_the_rows_in_flight_unwritten(setup, tmp_path):
    # The request threads were joined at exit: after "interrupted; run the same command again"
    # the process waited for every conversation in flight to end (72 s in a manual run).
    model_dir, data = setup[0], setup[1]
    out = tmp_path / "out"
    with ChatServer(load_generator(model_dir, device="cpu"), "tiny",
                    slow_requests=tuple(range(1, 100)), slow_seconds=60) as server:
        args = [sys.executable, "-m", "eyas", "regenerate", "--backend", "openai",
                "--target", str(model_dir), "--served-model-name", "tiny", "--data", str(data),
                "--out", str(out), "--server-url", server.url, "--concurrency", "2"]
        proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            for _ in range(600):  # until both requests in flight wait at the server
                if server.stats["slowed"] >= 2 or proc.poll() is not None:
                    break
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            start = time.monotonic()
            _, err = proc.communicate(timeout=30)
            waited = time.monotonic() - start
        finally:
            proc.kill()
    assert "interrupted; run the same command again" in err, err
    assert waited < 15, f"took {waited:.0f} s to exit after Ctrl-C"
    assert _read(out / OUTPUT) == [] and all(r["kind"] == "input" for r in _read(out / REJECTS))


def test_resume_refuses_other_settings_or_data(setup, local_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(local_run[0], out)
    with pytest.raises(EyasError, match="different max_new_tokens") as refused:
        regenerate(replace(_cfg(setup, out), max_new_tokens=MAX_NEW + 1))
    assert refused.value.flag == "--out"  # (eyas run's hint follows it)
    with pytest.raises(EyasError, match="different drop_truncated"):
        regenerate(replace(_cfg(setup, out), drop_truncated=True))
    with pytest.raises(EyasError, match=r"different max_length \(it ran with 2048\)"):
        regenerate(replace(_cfg(setup, out), max_length=0))
    data = tmp_path / "chats.jsonl"
    data.write_text(setup[1].read_text() + json.dumps(synthetic_chats(1)[0]) + "\n")
    with pytest.raises(EyasError, match="different data"):
        regenerate(replace(_cfg(setup, out), data=(str(data),)))
    again = regenerate(_cfg(setup, out))  # same settings: nothing left to do
    assert again["skipped"] == again["input"] and again["ok"] == 0
    assert again["truncated_total"] == local_run[1]["truncated"]


def test_resume_takes_a_relative_path_for_the_absolute_one_it_names(setup, local_run, tmp_path,
                                                                     monkeypatch):
    # The resume compared --target and --data as spelled: `tiny-llama` against the absolute
    # path the run started with was "different target, data, data file contents".
    out = tmp_path / "out"
    shutil.copytree(local_run[0], out)
    lines = (out / OUTPUT).read_text().splitlines(keepends=True)
    (out / OUTPUT).write_text("".join(lines[:-1]))  # one row to answer again
    model_dir, data = setup[0], setup[1]
    monkeypatch.chdir(model_dir.parent)
    relative = _cfg(setup, out, target=model_dir.name,
                    data=(os.path.relpath(data, model_dir.parent),))
    assert relative.target != str(model_dir)
    from eyas.freshness import starts_over
    assert starts_over("regenerate", relative, out, upstream_ran=False, forced=False) == ""
    monkeypatch.chdir(tmp_path)  # from here `model_dir.name` names no folder: a hub name
    assert starts_over("regenerate", relative, out, upstream_ran=False,
                       forced=False).startswith("its config changed (target (it ran with")
    monkeypatch.chdir(model_dir.parent)
    again = regenerate(relative)
    assert again["skipped"] == again["input"] - 1 and again["ok"] == 1
    # the row answered now has the file name the others were written under
    assert {r["source"]["file"] for r in _read(out / OUTPUT)} == {str(data)}


@pytest.mark.parametrize("key,value,says", [
    ("weights_fingerprint", "0123456789abcdef", "different target weights_fingerprint"),
    ("chat_template_hash", "0123456789abcdef", "different chat template")])
def test_resume_refuses_another_model_or_template_behind_the_same_target(
        setup, local_run, tmp_path, key, value, says):
    # The --target folder retrained in place (or its chat template edited) since the run: the
    # rest of its rows would be another model's answers, under a manifest naming only the new one.
    out = tmp_path / "out"
    shutil.copytree(local_run[0], out)
    manifest = json.loads((out / "eyas.json").read_text())
    (manifest["target"] if key == "weights_fingerprint" else manifest)[key] = value
    (out / "eyas.json").write_text(json.dumps(manifest))
    with pytest.raises(EyasError, match=f"{says} \\(it ran with (hash )?{value}, now"):
        regenerate(_cfg(setup, out))


def test_an_out_inside_a_data_folder_is_refused(setup, tmp_path):
    # it failed at once, calling its own new output an unfinished run to finish by running the
    # same command again, which failed the same way
    (tmp_path / "data").mkdir()
    shutil.copy(setup[1], tmp_path / "data")
    with pytest.raises(EyasError, match=r"--out .*data/out is inside --data .*data: eyas "
                                        r"regenerate would read its own output") as refused:
        regenerate(_cfg(setup, tmp_path / "data" / "out", data=(str(tmp_path / "data"),)))
    assert refused.value.flag == "--out" and not (tmp_path / "data" / "out").exists()


def test_a_run_that_wrote_no_row_may_start_again_with_other_settings(setup, tmp_path):
    # The servers down at its start, a run left its manifest and two empty files; the next
    # try with another --max-new-tokens was refused as a resume of it.
    out = tmp_path / "out"
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{free.getsockname()[1]}"  # nothing listens there
    with pytest.raises(EyasError, match="no server answers"):
        regenerate(_cfg(setup, out, backend="openai", server_url=(down,)))
    stats = regenerate(_cfg(setup, out, max_new_tokens=2, limit=2))
    assert stats["input"] == 2 and stats["skipped"] == 0
    with pytest.raises(EyasError, match="different max_new_tokens"):  # now it wrote rows
        regenerate(_cfg(setup, out, max_new_tokens=3, limit=2))


def test_run_from_before_drop_truncated_resumes_as_it_ran(setup, local_run, tmp_path):
    """A manifest without drop_truncated comes from a run that rejected truncated answers."""
    out = tmp_path / "out"
    shutil.copytree(local_run[0], out)
    manifest = json.loads((out / "eyas.json").read_text())
    del manifest["config"]["drop_truncated"]
    (out / "eyas.json").write_text(json.dumps(manifest))
    with pytest.raises(EyasError, match=r"different drop_truncated \(it ran with true\)"):
        regenerate(_cfg(setup, out))
    assert regenerate(_cfg(setup, out, drop_truncated=True))["skipped"] == len(setup[2])


def test_a_manifest_without_data_stamps_resumes_and_a_stamped_file_is_not_read(
        setup, local_run, tmp_path, monkeypatch):
    """data_files records gained each file's size and mtime_ns: an older manifest still
    resumes on the same data (hashed), and a file at its recorded stamp is not read again."""
    from eyas.store import manifest as store

    out = tmp_path / "out"
    shutil.copytree(local_run[0], out)
    record = json.loads((out / "eyas.json").read_text())
    assert {"size", "mtime_ns"} <= set(record["data_files"][0])
    hashed, sha256 = [], store.file_sha256
    monkeypatch.setattr(store, "file_sha256",
                        lambda path, *a: hashed.append(Path(path)) or sha256(path, *a))
    assert regenerate(_cfg(setup, out))["skipped"] == len(setup[2]) and setup[1] not in hashed
    for r in record["data_files"]:
        del r["size"], r["mtime_ns"]
    (out / "eyas.json").write_text(json.dumps(record))
    assert regenerate(_cfg(setup, out))["skipped"] == len(setup[2]) and setup[1] in hashed


def test_server_checks_fail_with_the_fix(setup, tmp_path):
    gen = load_generator(setup[0], device="cpu")
    with ChatServer(gen, "tiny") as server:
        url = server.url
        with pytest.raises(EyasError, match="--served-model-name"):
            regenerate(_cfg(setup, tmp_path / "a", backend="openai", server_url=(url,)))
    with pytest.raises(EyasError, match="no server answers"):
        regenerate(_cfg(setup, tmp_path / "b", backend="openai", served_model_name="tiny",
                        server_url=(url,)))


def test_torn_tail_is_cut_back_to_the_last_whole_line(tmp_path):
    from eyas.store.regenerate_output import _cut_torn_tail

    path = tmp_path / "x.jsonl"
    whole = '{"a": 1}\n{"b": 2}\n'
    path.write_text(whole + '{"c": "' + "x" * 200_000)  # longer than one backward-scan chunk
    _cut_torn_tail(path)
    assert path.read_text() == whole
    _cut_torn_tail(path)
    assert path.read_text() == whole
    path.write_text('{"only": "torn')
    _cut_torn_tail(path)
    assert path.read_text() == ""


def test_config_errors_name_the_fix(setup, tmp_path):
    with pytest.raises(ConfigError, match="--server-url"):
        _cfg(setup, tmp_path, backend="openai")
    with pytest.raises(ConfigError, match="http://"):
        _cfg(setup, tmp_path, backend="openai", server_url=("localhost:8000",))
    with pytest.raises(ConfigError, match="reasoning"):
        RegenerateConfig(target="m", data=("d",), out="o", reasoning="maybe")
    with pytest.raises(ConfigError, match="top_p"):
        _cfg(setup, tmp_path, top_p=0.0)
    # --backend openai forgotten: the target was loaded here, beside the server's copy
    for backend in ("transformers", "vllm"):
        with pytest.raises(ConfigError, match=r"are for --backend openai; add --backend openai"):
            _cfg(setup, tmp_path, backend=backend, server_url=("http://localhost:8000",))
    with pytest.raises(ConfigError, match=r"--served-model-name are for --backend openai"):
        _cfg(setup, tmp_path, served_model_name="qwen")


def test_separate_reasoning_from_a_server_is_kept_inline():
    from eyas.serve.openai_client import _parse_choice

    answer = {"choices": [{"finish_reason": "stop", "message": {
        "role": "assistant", "content": "\n\n42.", "reasoning_content": " 6 times 7. "}}],
        "usage": {"completion_tokens": 9}}
    gen = _parse_choice(answer)
    assert gen.text == "<think>\n6 times 7.\n</think>\n\n42." and gen.num_tokens == 9
    assert gen.finish_reason == "stop"


def test_reasoning_switch_reaches_the_chat_template(setup):
    gen = load_generator(setup[0], device="cpu")
    messages = [{"role": "user", "content": "Hi"}]
    off = gen.tokenizer.decode(gen.render(messages, {"enable_thinking": False}))
    assert off.endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in gen.tokenizer.decode(gen.render(messages, {}))


def test_a_batch_out_of_gpu_memory_is_split_after_its_memory_is_freed():
    """A batch that runs out of GPU memory is retried in halves, and the retry starts only
    once the failed call's tensors are gone (the exception's traceback would keep its
    frames, and so its activations, alive: each half would then fail too)."""
    import weakref

    from eyas.serve.generator import Generation, LocalGenerator

    gen = LocalGenerator.__new__(LocalGenerator)  # no model: only the splitting is tested
    failed, sizes = [], []

    def fake(prompts, max_new_tokens, temperature, top_p):
        assert all(ref() is None for ref in failed), "a failed batch's tensors are still alive"
        sizes.append(len(prompts))
        if len(prompts) > 2:
            activations = torch.zeros(8)
            failed.append(weakref.ref(activations))
            raise torch.cuda.OutOfMemoryError("fake")
        return [Generation(f"answer {p[0]}", "stop", 1) for p in prompts]

    gen._generate = fake
    out = gen.generate([[i] for i in range(5)], 4)
    assert [g.text for g in out] == [f"answer {i}" for i in range(5)]
    assert sizes == [5, 2, 3, 1, 2] and len(failed) == 2


def test_device_auto_loads_where_the_cli_would(setup):
    # benchmarks/regenerate.py hands the CLI's default device ("auto") to load_generator, which
    # once passed it on to torch.device and failed
    gen = load_generator(setup[0], device="auto")
    where = "cuda" if torch.cuda.is_available() else "cpu"
    assert next(gen.model.parameters()).device.type == where


def test_vllm_backend_refuses_a_gguf_transformers_options_and_a_missing_vllm(setup, tmp_path):
    """What `--backend vllm` says before any engine starts (its runs: test_regenerate_vllm)."""
    import importlib.util

    model_dir, data = setup[:2]
    base = dict(target=str(model_dir), data=(str(data),), out=str(tmp_path / "out"),
                backend="vllm")
    for bad in (dict(batching="lookup"), dict(device="cpu")):
        with pytest.raises(ConfigError, match="transformers-backend options"):
            RegenerateConfig(**base, **bad)
    with pytest.raises(ConfigError, match="eyas convert --target .*model.gguf --out FOLDER"):
        RegenerateConfig(**{**base, "target": str(tmp_path / "model.gguf")})
    if importlib.util.find_spec("vllm") is None:  # this suite's venv: no vLLM
        with pytest.raises(EyasError, match="needs vLLM in this environment.*pip install vllm"):
            regenerate(RegenerateConfig(**base))
        assert not (tmp_path / "out" / OUTPUT).read_text()  # nothing written, nothing lost


def test_stop_token_ids_required_or_empty():
    """One helper for regenerate (a target without an end-of-turn id is refused) and eval
    (which then measures to max_new_tokens)."""
    from types import SimpleNamespace as NS

    from eyas.serve.generator import stop_token_ids

    assert stop_token_ids(NS(eos_token_id=[2, 7]), NS(eos_token_id=2)) == {2, 7}
    assert stop_token_ids(None, NS(eos_token_id=3), required=False) == {3}
    none = NS(eos_token_id=None)
    assert stop_token_ids(none, none, required=False) == frozenset()
    with pytest.raises(EyasError, match="names no end-of-turn token: set eos_token_id"):
        stop_token_ids(none, none)


@pytest.mark.parametrize("batching", ["padded", "continuous"])
def test_the_target_generates_without_cudnn_attention(setup, batching, cudnn_seen):
    # as in eyas eval (tests/test_speculate.py): cuDNN re-plans each decode step's new key
    # length on the host, so the local backend leaves it out whichever batching runs
    model_dir = setup[0]
    gen = load_generator(model_dir, device="cpu", batching=batching)
    seen = cudnn_seen(gen.model.model.layers[0].self_attn)
    out = gen.generate([gen.render([{"role": "user", "content": "hello there"}])], 3)
    assert out[0].finish_reason in ("stop", "length") and seen and not any(seen)


def test_a_question_of_no_text_is_refused_not_answered(setup, tmp_path):
    """A user turn of no text that a regenerated answer would reply to is refused, kind input
    (the target's answer to nothing is noise to train on), and the row beside it answered;
    an empty user turn that --turns last leaves as it is does not stop the row."""
    rows = [{"id": "asked", "messages": [{"role": "user", "content": "Name a colour."}]},
            {"id": "unasked", "messages": [{"role": "user", "content": "  "}]},
            {"id": "early", "messages": [{"role": "user", "content": ""},
                                         {"role": "assistant", "content": "Hello?"},
                                         {"role": "user", "content": "Count to 3."}]}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for turns, refused in (("all", {"unasked", "early"}), ("last", {"unasked"})):
        out = tmp_path / turns
        stats = regenerate(_cfg(setup, out, data=(str(data),), turns=turns))
        rejects = {r["sample_id"]: r for r in _read(out / REJECTS)}
        assert set(rejects) == refused and stats["ok"] == 3 - len(refused)
        assert rejects["unasked"]["kind"] == "input" and rejects["unasked"]["reason"] == \
            "message 0: the user turn to answer is empty; fill it or leave the row out"


def test_retry_rejects_retries_server_errors_and_out_of_memory_rows(tmp_path):
    """From an audit: the advice for rows out of GPU memory (lower --batch-size, the reason's
    "use the openai backend") could not take effect in the same --out: every such row was
    skipped as done, and --retry-rejects retried server errors only."""
    from eyas.store.regenerate_output import read_previous, what_to_do

    kinds = ["server", "memory", "length", "input", "empty"]
    (tmp_path / REJECTS).write_text("".join(
        json.dumps({"file": "d.jsonl", "row": i, "kind": k, "reason": "r", "id": str(i)}) + "\n"
        for i, k in enumerate(kinds, 1)))
    assert set(read_previous(tmp_path, retry_rejects=False)) == {("d.jsonl", i) for i in
                                                                  range(1, 6)}
    kept = read_previous(tmp_path, retry_rejects=True)  # server and memory are tried again
    assert set(kept) == {("d.jsonl", 3), ("d.jsonl", 4), ("d.jsonl", 5)}
    assert [r["kind"] for r in _read(tmp_path / REJECTS)] == ["length", "input", "empty"]
    hints = what_to_do(_cfg_for_hints(), Counter({"memory": 1, "length": 1, "empty": 1}))
    assert "--backend openai" in hints and "--retry-rejects" in hints
    assert hints.count("with a new --out") == 3  # what a resume in this --out cannot change


def _cfg_for_hints():
    from types import SimpleNamespace

    return SimpleNamespace(served_model_name=None, target="t")


def test_a_target_without_a_chat_template_is_refused_before_its_weights_load(setup, tmp_path,
                                                                            monkeypatch):
    """From an audit: a base model (no chat template) loaded its weights, then every row was
    rejected as kind input, with advice to fix the data."""
    import shutil

    import eyas.regenerate as module

    target = tmp_path / "base"
    shutil.copytree(setup[0], target)
    for name in ("chat_template.jinja",):
        (target / name).unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))

    def no_load(cfg):
        raise AssertionError("the weights were loaded before the template was checked")

    monkeypatch.setattr(module, "_load_generator", no_load)
    with pytest.raises(EyasError, match=r"has no chat template: regenerate asks the target as "
                                        r"a chat model.*or that template as --chat-template "
                                        r"FILE.jinja \(and the same file to prepare\)$"):
        regenerate(_cfg(setup, tmp_path / "out", target=str(target)))
    # one that is not valid Jinja, in the tokenizer's files or given: named, with the way out
    bad = "{% for m in messages %}{{ m.content }"
    (target / "chat_template.jinja").write_text(bad)
    with pytest.raises(EyasError, match=r"the chat template of the tokenizer of .* is not valid "
                                        r"Jinja: .*; fix it, or give the template the target "
                                        r"is served with as --chat-template FILE.jinja$"):
        regenerate(_cfg(setup, tmp_path / "out2", target=str(target)))
    (tmp_path / "bad.jinja").write_text(bad)
    with pytest.raises(EyasError, match=r"the chat template of .*bad.jinja is not valid Jinja"):
        regenerate(_cfg(setup, tmp_path / "out3", chat_template=str(tmp_path / "bad.jinja")))
    with pytest.raises(EyasError, match=r"chat template file .*none.jinja does not exist; give "
                                        r"--chat-template the path of a .jinja file"):
        regenerate(_cfg(setup, tmp_path / "out4", chat_template=str(tmp_path / "none.jinja")))
    (tmp_path / "latin.jinja").write_bytes(b"{{ bos_token }}\xe9{% for m in messages %}")
    with pytest.raises(EyasError, match=r"chat template file .*latin.jinja is not UTF-8 text "
                                        r"\(.*\); save it as UTF-8"):
        regenerate(_cfg(setup, tmp_path / "out5", chat_template=str(tmp_path / "latin.jinja")))
    assert not any((tmp_path / f"out{i}").exists() for i in ("", 2, 3, 4, 5))


def test_chat_template_file_asks_a_target_without_one(setup, tmp_path):
    """--chat-template: a target whose tokenizer has no template (a base model's files, a GGUF
    without one) is asked in the file's, as prepare renders with the same file; the answers
    and the recorded template are those of the target that holds the template itself. A
    resume in another template is refused. The openai backend (its server renders) counts
    prompt tokens in it, and needs none with --max-length 0."""
    import shutil

    target = tmp_path / "base"
    shutil.copytree(setup[0], target)
    (target / "chat_template.jinja").unlink()
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    template = tmp_path / "served.jinja"
    template.write_text(TEMPLATE)

    regenerate(_cfg(setup, tmp_path / "own", limit=3))
    regenerate(_cfg(setup, tmp_path / "given", target=str(target), chat_template=str(template),
                    limit=3))
    own, given = (_read(tmp_path / d / "conversations.jsonl") for d in ("own", "given"))
    assert [r["messages"] for r in given] == [r["messages"] for r in own] and len(own) == 3
    hashes = {json.loads((tmp_path / d / "eyas.json").read_text())["chat_template_hash"]
              for d in ("own", "given")}
    assert len(hashes) == 1

    other = tmp_path / "other.jinja"
    other.write_text(TEMPLATE.replace("<|end_header_id|>", "<|end_header_id|> "))
    assert other.read_text() != TEMPLATE
    with pytest.raises(EyasError, match=r"different chat template \(it ran with hash"):
        regenerate(_cfg(setup, tmp_path / "given", target=str(target),
                        chat_template=str(other), limit=4))
    # the openai backend: its server renders, and the template counts prompt tokens here
    gen = load_generator(setup[0], device="cpu")
    with ChatServer(gen, "tiny") as server:
        served = dict(backend="openai", served_model_name="tiny", server_url=(server.url,),
                      target=str(target), limit=3)
        with pytest.raises(EyasError, match=r"has no chat template: the openai backend counts "
                                            r"each prompt's tokens in it for --max-length 2048"
                                            r"\. Give the template the server is started with "
                                            r"as --chat-template FILE.jinja.*or --max-length 0$"):
            regenerate(_cfg(setup, tmp_path / "srv0", **served))
        regenerate(_cfg(setup, tmp_path / "srv1", chat_template=str(template), **served))
        regenerate(_cfg(setup, tmp_path / "srv2", max_length=0, **served))
    for d in ("srv1", "srv2"):
        assert [r["messages"] for r in _read(tmp_path / d / "conversations.jsonl")] == \
            [r["messages"] for r in own]
    assert not (tmp_path / "srv0").exists()


def test_an_openai_run_without_a_template_file_is_not_started_over_for_one(setup, tmp_path):
    """From a review: an openai-backend run recorded its local tokenizer's template hash,
    though the server rendered; `eyas run` passing prepare's template file then started the
    whole corpus over on that hash. A GGUF target's run asked in a file, and now in none, is
    a change all the same."""
    from eyas.freshness import _regenerate_template_changes
    from eyas.store.manifest import chat_template_fingerprint
    from eyas.targets.models import load_tokenizer

    template = tmp_path / "served.jinja"
    template.write_text(TEMPLATE + "\n")  # the server's, one byte apart from the tokenizer's
    hashed = chat_template_fingerprint(load_tokenizer(str(setup[0])))
    cfg = _cfg(setup, tmp_path / "o", backend="openai", server_url=("http://localhost:1",),
               chat_template=str(template))
    ran = {"step": "regenerate", "config": {"backend": "openai"}, "chat_template_hash": hashed}
    assert _regenerate_template_changes(cfg, ran) == ""
    ran["config"]["chat_template"] = "old.jinja"  # a file said which: compared
    assert _regenerate_template_changes(cfg, ran).startswith("its chat template changed")
    gguf = replace(cfg, target="model.gguf", chat_template=None, backend="transformers",
                   server_url=())
    assert _regenerate_template_changes(gguf, ran) == \
        "its chat template changed (a --chat-template file then, the target's own now)"
