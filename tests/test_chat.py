"""Reading chat files in every supported container and row format (eyas.targets.chat_sources,
chat_files and chat)."""

from __future__ import annotations

import gzip
import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eyas.targets import chat, chat_files, chat_sources
from eyas.targets.chat_files import ChatFormatError
from eyas.errors import EyasError

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "tool", "content": "{\"ok\": true}"},
    {"role": "assistant", "content": "Done."},
]
SHAREGPT = {"id": "sg-1", "conversations": [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "What is 2 plus 2?"},
    {"from": "gpt", "value": "It is 4."},
    {"from": "tool", "value": "{\"ok\": true}"},
    {"from": "gpt", "value": "Done."},
]}
# Open-PerfectBlend rows: ShareGPT turns plus a `source` column.
PERFECTBLEND = {"conversations": [{"from": "human", "value": "What is 2 plus 2?"},
                                  {"from": "gpt", "value": "It is 4."}],
                "source": "meta-math/MetaMathQA"}


def write_jsonl(path, rows, extra_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def rows_of(paths, fmt="auto"):
    return list(chat_files.read_rows(paths, fmt))


# ---------------------------------------------------------------- normalize

def test_normalize_messages_sharegpt_and_perfectblend_agree():
    assert chat.normalize({"messages": MESSAGES}) == MESSAGES
    assert chat.normalize(SHAREGPT) == MESSAGES
    assert chat.normalize(SHAREGPT, "sharegpt") == MESSAGES
    assert chat.normalize(PERFECTBLEND) == [
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "It is 4."}]


def test_detect_format():
    assert chat.detect_format({"messages": []}) == "messages"
    assert chat.detect_format(SHAREGPT) == "sharegpt"
    assert chat.detect_format({"conversation": []}) == "sharegpt"
    with pytest.raises(ChatFormatError, match="no 'conversations' or 'messages'.*text"):
        chat.detect_format({"text": "hello"})
    # MT-bench's own file, as docs/eval.md once showed it given to --data
    with pytest.raises(ChatFormatError, match="MT-bench's question.jsonl: `eyas eval --bench "
                                              "mt-bench` reads it"):
        chat.detect_format({"question_id": 81, "category": "writing", "turns": ["a", "b"]})


def test_normalize_forced_format_needs_its_column():
    with pytest.raises(ChatFormatError, match="'messages'"):
        chat.normalize(SHAREGPT, "messages")


def test_normalize_text_parts_and_reasoning_field():
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
    ]}
    assert chat.normalize(row) == [
        {"role": "user", "content": "Hi \nyou"},  # joined as vLLM joins them (newline)
        {"role": "assistant", "content": "<think>\ngreet back\n</think>\n\nHello."}]


@pytest.mark.parametrize("row, reason", [
    ({"messages": []}, "empty conversation"),
    ({"id": "x", "messages": None}, "'messages' is null: the row holds no conversation"),
    ({"messages": "hi"}, "not a list"),
    ({"messages": [{"role": "narrator", "content": "x"}]}, "unknown role 'narrator'"),
    ({"messages": [{"content": "x"}]}, "turn 0 has no 'role'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 7}]},
     "turn 1 content is a int, not a string"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
     "turn 1 has no content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                   {"role": "assistant", "content": "y"}]},
     "turn 0 content has parts of type image_url beside text: only text conversations"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                {"type": "image_url", "image_url": "x"}]},
                   {"role": "assistant", "content": "y"}]}, "parts of type image_url"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": "y", "reasoning_content": 123}]},
     "turn 1 reasoning is a int, not a string"),  # it was dropped without a word
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ({"messages": ["hello"]}, "turn 0 is a str"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "bot", "value": "y"}]},
     "unknown role 'bot'"),
])
def test_normalize_rejects_malformed_rows_with_reason(row, reason):
    with pytest.raises(ChatFormatError, match=reason):
        chat.normalize(row)


def test_normalize_accepts_prompts_only_when_asked():
    prompt = {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Hi"}]}
    human = {"conversations": [{"from": "human", "value": "Hi"}]}
    with pytest.raises(ChatFormatError, match="no assistant turn"):
        chat.normalize(prompt)  # the default: training data needs answers to supervise
    assert chat.normalize(prompt, need_assistant=False) == prompt["messages"]
    assert chat.normalize(human, "sharegpt", need_assistant=False) == [
        {"role": "user", "content": "Hi"}]
    with pytest.raises(ChatFormatError, match="empty conversation"):
        chat.normalize({"messages": []}, need_assistant=False)  # still checked
    with pytest.raises(ChatFormatError, match="unknown role"):
        chat.normalize({"messages": [{"role": "bot", "content": "x"}]}, need_assistant=False)


def test_chat_format_error_is_a_value_error():
    assert issubclass(ChatFormatError, ValueError)


def test_sample_id():
    assert chat.sample_id({"id": 12, "messages": []}, "f.jsonl", 3) == "12"
    assert chat.sample_id({"conversation_id": "c9"}, "f.jsonl", 3) == "c9"
    assert chat.sample_id({"messages": []}, "f.jsonl", 3) == "f.jsonl:3"


def test_strip_reasoning_and_system_prompt():
    msgs = [{"role": "user", "content": "q <think>not touched</think>"},
            {"role": "assistant", "content": "<think>\nplan\n</think>\n\nAnswer."},
            {"role": "assistant", "content": "half plan</think>Final."}]
    assert chat.strip_reasoning(msgs) == [msgs[0], {"role": "assistant", "content": "Answer."},
                                          {"role": "assistant", "content": "Final."}]
    # An answer cut inside its reasoning (regenerate writes it without </think>): kept by
    # default (regenerate's empty-answer check); with unclosed, removed to the end of its turn,
    # and a turn of nothing else is the row's reject, not a silently empty turn.
    cut = [{"role": "assistant", "content": "Sure. <think>\nthe cow and"}]
    assert chat.strip_reasoning(cut) == cut
    assert chat.strip_reasoning(cut, unclosed=True) == [{"role": "assistant", "content": "Sure. "}]
    assert chat.strip_reasoning(msgs, unclosed=True) == chat.strip_reasoning(msgs)
    with pytest.raises(chat.ReasoningCutOff, match="--max-new-tokens.*--reasoning keep"):
        chat.strip_reasoning([msgs[0], {"role": "assistant", "content": "<think>\nthe cow"}],
                             unclosed=True)
    with_sys = chat.with_system_prompt(msgs, "SYS")
    assert with_sys[0] == {"role": "system", "content": "SYS"} and with_sys[1:] == msgs
    assert chat.with_system_prompt(MESSAGES, "SYS") == MESSAGES  # has its own
    assert chat.with_system_prompt(msgs, None) == msgs


# ---------------------------------------------------------------- containers

def test_jsonl_rows_bad_lines_and_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [SHAREGPT, {"messages": MESSAGES}],
                       extra_lines=["", "{not json", "[1, 2]", json.dumps(PERFECTBLEND)])
    got = rows_of(path)
    assert [r.row for r in got] == [1, 2, 4, 5, 6]  # line 3 is blank: not a row
    assert got[0].data == SHAREGPT and got[1].data == {"messages": MESSAGES}
    assert isinstance(got[2].data, ChatFormatError) and "invalid JSON" in str(got[2].data)
    assert isinstance(got[3].data, ChatFormatError) and "not an object" in str(got[3].data)
    assert got[4].data == PERFECTBLEND
    file, row, data = got[0]  # unpacks as (file, row_number, raw_row or error)
    assert file == str(path) and row == 1


def test_json_list_object_and_jsonl_in_json(tmp_path, caplog):
    (tmp_path / "list.json").write_text(json.dumps([SHAREGPT, {"messages": MESSAGES}]))
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": [SHAREGPT]}))
    (tmp_path / "one.json").write_text(json.dumps(SHAREGPT))
    write_jsonl(tmp_path / "lines.json", [SHAREGPT, SHAREGPT])
    assert [(r.row, r.data) for r in rows_of(tmp_path / "list.json")] == [
        (0, SHAREGPT), (1, {"messages": MESSAGES})]
    assert [r.data for r in rows_of(tmp_path / "wrapped.json")] == [SHAREGPT]
    assert [r.data for r in rows_of(tmp_path / "one.json")] == [SHAREGPT]
    assert [(r.row, r.data) for r in rows_of(tmp_path / "lines.json")] == [
        (1, SHAREGPT), (2, SHAREGPT)]
    # and the other way round: a JSON list saved as .jsonl (pretty-printed, or on one line)
    # was one reject per line; it is read as JSON, with a warning that names the file
    (tmp_path / "pretty.jsonl").write_text("\ufeff" + json.dumps([SHAREGPT, SHAREGPT], indent=2))
    (tmp_path / "flat.jsonl.gz").write_bytes(gzip.compress(json.dumps([SHAREGPT]).encode()))
    with caplog.at_level("WARNING", logger="eyas"):
        assert [(r.row, r.data) for r in rows_of(tmp_path / "pretty.jsonl")] == [
            (0, SHAREGPT), (1, SHAREGPT)]
        assert [r.data for r in rows_of(tmp_path / "flat.jsonl.gz")] == [SHAREGPT]
    assert "pretty.jsonl starts with '[': a JSON list, not JSON Lines" in caplog.text


def test_parquet_rows(tmp_path):
    table = pa.Table.from_pylist([PERFECTBLEND, PERFECTBLEND])
    pq.write_table(table, tmp_path / "blend.parquet")
    got = rows_of(tmp_path / "blend.parquet")
    assert [r.row for r in got] == [0, 1]
    assert [chat.normalize(r.data) for r in got] == [chat.normalize(PERFECTBLEND)] * 2


def test_datasets_folder_and_dataset_dict(tmp_path):
    ds = datasets.Dataset.from_list([{"messages": MESSAGES, "id": "x"}] * 3)
    ds.save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(
        str(tmp_path / "dict"))
    single = rows_of(tmp_path / "single")
    assert [r.row for r in single] == [0, 1, 2]
    assert chat.normalize(single[0].data) == MESSAGES
    both = rows_of(tmp_path / "dict")
    assert [r.file.rsplit("/", 1)[-1] for r in both] == ["train"] * 3 + ["test"]


def test_globs_folders_and_gzip(tmp_path):
    for name in ("b.jsonl", "a.jsonl"):
        write_jsonl(tmp_path / name, [SHAREGPT])
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps(SHAREGPT) + "\n")
    (tmp_path / "notes.txt").write_text("not data")
    by_glob = rows_of(str(tmp_path / "*.jsonl*"))
    assert [r.file.rsplit("/", 1)[-1] for r in by_glob] == ["a.jsonl", "b.jsonl", "c.jsonl.gz"]
    by_folder = rows_of(tmp_path)
    assert [r.file for r in by_folder] == [r.file for r in by_glob]
    both = rows_of((str(tmp_path / "b.jsonl"), str(tmp_path / "a.jsonl")))
    assert [r.file.rsplit("/", 1)[-1] for r in both] == ["b.jsonl", "a.jsonl"]


def test_a_glob_that_matches_a_folder_reads_its_files(tmp_path, caplog):
    # `data/*` passed over data/sub/ without a word: its rows were never read
    write_jsonl(tmp_path / "a.jsonl", [SHAREGPT])
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "b.jsonl", [SHAREGPT, SHAREGPT])
    (tmp_path / "notes.txt").write_text("not data")
    got = rows_of(str(tmp_path / "*"))
    assert [r.file.rsplit("/", 1)[-1] for r in got] == ["a.jsonl", "b.jsonl", "b.jsonl"]
    assert rows_of(str(tmp_path / "**")) == got  # a folder and its files: each read once
    with caplog.at_level("WARNING", logger="eyas"):
        chat_sources.source_fingerprints([str(tmp_path / "*")])
    assert "not read as chat data (1 file(s)" in caplog.text and "notes.txt" in caplog.text
    assert "named more than once" not in caplog.text
    regen = _regenerate_folder(tmp_path / "sub" / "regen")  # checked against --target by prepare
    found = chat_sources.regenerate_outputs([str(tmp_path / "*")])
    assert [m["path"] for m in found] == [str(regen)]


def test_a_glob_over_a_datasets_folder_reads_it_once(tmp_path, caplog, monkeypatch):
    # `**` matched a DatasetDict folder and each split folder in it: every row was read twice
    # (trained twice, maybe in both splits), and its .json metadata read as malformed rows
    ds = datasets.Dataset.from_list([MESSAGE_ROW, MESSAGE_ROW])
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    got = rows_of(str(tmp_path / "**"))
    assert [(r.file.rsplit("/", 1)[-1], r.row) for r in got] == [
        ("train", 0), ("train", 1), ("test", 0)]
    assert all(r.data == MESSAGE_ROW for r in got)
    with caplog.at_level("WARNING", logger="eyas"):
        chat_sources.source_fingerprints([str(tmp_path / "**")])
    assert "not read as chat data" not in caplog.text  # its own files are its, not skipped
    # a glob into the folder or into a split (from an audit: dataset_dict.json, then a split's
    # dataset_info.json and state.json, were read as malformed rows, its .arrow data skipped)
    for spec, files in (("dd/*", ["train", "train", "test"]), ("dd/train/*", ["train"] * 2),
                        ("dd/*/*.json", ["test", "train", "train"])):
        got = rows_of(str(tmp_path / spec))
        assert [r.file.rsplit("/", 1)[-1] for r in got] == files, spec
        assert all(r.data == MESSAGE_ROW for r in got), spec
    # ... and only folders below the glob's own path: a state.json above the data (a project
    # folder's, $HOME's) made every match stand for that folder (from a review)
    (tmp_path / "state.json").write_text('{"app": 1}')
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text(json.dumps(MESSAGE_ROW) + "\n")
    assert [r.data for r in rows_of(str(tmp_path / "data" / "*.jsonl"))] == [MESSAGE_ROW]
    (tmp_path / "data" / "state.json").write_text('{"app": 2}')  # in the glob's own folder
    monkeypatch.chdir(tmp_path / "data")
    assert [r.data for r in rows_of("*.jsonl")] == [MESSAGE_ROW]


def test_broken_files_become_rejects_not_crashes(tmp_path):
    good = json.dumps(SHAREGPT).encode()
    (tmp_path / "latin1.jsonl").write_bytes(good + b"\n" + '{"x": "caf\xe9"}'.encode("latin-1")
                                            + b"\n" + good + b"\n")
    got = rows_of(tmp_path / "latin1.jsonl")
    assert [r.row for r in got] == [1, 2, 3] and got[2].data == SHAREGPT
    assert "not UTF-8" in str(got[1].data)
    whole = gzip.compress((good + b"\n") * 50)
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])  # truncated download
    got = rows_of(tmp_path / "cut.jsonl.gz")
    assert isinstance(got[-1].data, ChatFormatError) and "unreadable" in str(got[-1].data)
    assert all(r.data == SHAREGPT for r in got[:-1])
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really parquet")
    (bad,) = rows_of(tmp_path / "bad.parquet")
    assert bad.row == 0 and "unreadable" in str(bad.data)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(EyasError, match="cannot read"):
        rows_of(tmp_path / "data.csv")


def test_missing_paths_are_user_errors(tmp_path):
    with pytest.raises(EyasError, match="does not exist"):
        rows_of(tmp_path / "nope.jsonl")
    with pytest.raises(EyasError, match="no files match"):
        rows_of(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EyasError, match="holds no"):
        rows_of(tmp_path / "empty")
    with pytest.raises(EyasError, match="unknown chat format"):
        rows_of(tmp_path, "alpaca")


def test_tool_calls_surrogates_and_byte_order_marks(tmp_path):
    # Issue 34: an OpenAI tool call (content null) was "turn 1 has no content"; a lone
    # surrogate passed as text and ended prepare's run in pyarrow; a BOM made a row a reject.
    call = {"id": "c1", "type": "function",
            "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}
    got = chat.normalize({"messages": [
        {"role": "user", "content": "Find x."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "lookup", "content": "found"},
        {"role": "assistant", "content": "Found it."}]})
    # the arguments' JSON text decoded, as vLLM's server hands it to the template (which
    # renders it with `tojson`); text that is no JSON object stays as it is
    decoded = {**call, "function": {"name": "lookup", "arguments": {"q": "x"}}}
    assert got[1] == {"role": "assistant", "content": "", "tool_calls": [decoded]}
    assert got[2] == {"role": "tool", "content": "found", "tool_call_id": "c1", "name": "lookup"}
    assert chat.strip_reasoning(got)[1]["tool_calls"] == [decoded]
    for text in ("not json", "[1, 2]"):
        odd = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": text}}
        turn = chat.normalize({"messages": [{"role": "user", "content": "x"}, {
            "role": "assistant", "content": None, "tool_calls": [odd]}]})[1]
        assert turn["tool_calls"] == [odd]
    with pytest.raises(ChatFormatError, match="not a list of OpenAI tool calls"):
        chat.normalize({"messages": [{"role": "user", "content": "x"}, {
            "role": "assistant", "content": None, "tool_calls": [{"name": "lookup"}]}]})
    with pytest.raises(ChatFormatError, match="no content \\(and no tool_calls\\)"):
        chat.normalize({"messages": [{"role": "user", "content": "x"},
                                     {"role": "assistant", "content": None}]})
    row = {"messages": [{"role": "user", "content": "\ud800 lone"},
                        {"role": "assistant", "content": "ok"}]}
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + (json.dumps(MESSAGE_ROW) + "\n\n"
                                                          + json.dumps(row) + "\n").encode())
    (tmp_path / "b.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([MESSAGE_ROW]).encode())
    rows = list(chat_files.read_rows([tmp_path / "a.jsonl", tmp_path / "b.json"]))
    assert [r.row for r in rows] == [1, 3, 0]
    assert rows[0].data == rows[2].data == MESSAGE_ROW
    assert "lone UTF-16 surrogate" in str(rows[1].data)
    with_blank = list(chat_files.read_rows([tmp_path / "a.jsonl"], blank_lines=True))
    assert isinstance(with_blank[1].data, chat_files.BlankLine) and with_blank[1].row == 2


MESSAGE_ROW = {"id": "m", "messages": MESSAGES}


def test_a_broken_json_list_keeps_the_rows_before_its_syntax_error(tmp_path):
    # one stray comma in a pretty-printed list was one "invalid JSON line" per physical line
    # (67 rejects for 5 rows) and never said where the error was
    first = "[\n" + json.dumps(MESSAGE_ROW, indent=2) + ",\n"
    (tmp_path / "list.json").write_text(first + ",\n" + json.dumps(SHAREGPT, indent=2) + ",\n"
                                        + json.dumps(SHAREGPT, indent=2) + "\n]\n")
    got = rows_of(tmp_path / "list.json")
    assert [r.row for r in got] == [0, 1] and got[0].data == MESSAGE_ROW
    assert isinstance(got[1].data, ChatFormatError)
    assert f"breaks at line {first.count(chr(10)) + 1} column 1" in str(got[1].data)
    assert "no row from here on is read" in str(got[1].data)
    (tmp_path / "tail.json").write_text(json.dumps([SHAREGPT]) + " trailing")
    got = rows_of(tmp_path / "tail.json")
    assert got[0].data == SHAREGPT and "Extra data" in str(got[1].data)


def test_json_lines_whose_first_row_is_a_list_lose_only_that_row(tmp_path):
    """From an audit: a .jsonl whose first line is a JSON list was read as one JSON list (its
    items as rows), then broke at line 2 and lost every row after it."""
    row = json.dumps(MESSAGE_ROW)
    (tmp_path / "first.jsonl").write_text('["stray", "header"]\n' + (row + "\n") * 3)
    got = rows_of(tmp_path / "first.jsonl")
    assert [r.row for r in got] == [1, 2, 3, 4]
    assert "row is a JSON list" in str(got[0].data)
    assert all(r.data == MESSAGE_ROW for r in got[1:])
    # rows that are bare message lists: one reject each, numbered by line
    bare = json.dumps(MESSAGE_ROW["messages"])
    (tmp_path / "bare.jsonl").write_text((bare + "\n") * 3)
    got = rows_of(tmp_path / "bare.jsonl")
    assert [r.row for r in got] == [1, 2, 3]
    assert all("row is a JSON list" in str(r.data) for r in got)
    # a JSON list pretty-printed over lines, or followed by text on its own line, stays a list
    (tmp_path / "list.jsonl").write_text(json.dumps([MESSAGE_ROW] * 2, indent=1) + "\n")
    assert [r.data for r in rows_of(tmp_path / "list.jsonl")] == [MESSAGE_ROW] * 2


def test_a_json_file_that_breaks_part_way_keeps_the_rows_before_the_break(tmp_path):
    """From an audit: a cut .json.gz, or a byte that is not UTF-8 inside a JSON list, lost
    every row and put the reject at row 0 (the file was read whole before any row)."""
    rows = [dict(MESSAGE_ROW, id=f"r{i}") for i in range(400)]
    whole = gzip.compress(json.dumps(rows, indent=1).encode())
    (tmp_path / "cut.json.gz").write_bytes(whole[:len(whole) * 2 // 3])
    got = rows_of(tmp_path / "cut.json.gz")
    kept, (last,) = got[:-1], got[-1:]
    assert len(kept) > 100 and [r.data for r in kept] == rows[:len(kept)]
    assert last.row == len(kept) and "file unreadable from here on (EOFError" in str(last.data)
    # JSON Lines in a cut .json.gz: the same, the line the cut went through in the reject
    lines = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())
    (tmp_path / "lines.json.gz").write_bytes(lines[:len(lines) * 2 // 3])
    got = rows_of(tmp_path / "lines.json.gz")
    assert [r.row for r in got] == list(range(1, len(got) + 1))
    assert [r.data for r in got[:-1]] == rows[:len(got) - 1]
    assert "file unreadable from here on (EOFError" in str(got[-1].data)
    # a list with a Latin-1 byte in its fourth row: the three before it are kept
    text = json.dumps(rows[:5], indent=1).replace('"r3"', '"caf\u00e9"', 1)
    (tmp_path / "latin.json").write_bytes(text.encode("utf-8").replace(b"\xc3\xa9", b"\xe9"))
    got = rows_of(tmp_path / "latin.json")
    assert [r.data for r in got[:3]] == rows[:3] and len(got) == 4
    assert got[3].row == 3 and "UnicodeDecodeError" in str(got[3].data)
    # the same with a byte-order mark: the offsets are the file's (a review: one row early)
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "latin.json").read_bytes())
    assert [r.row for r in rows_of(tmp_path / "bom.json")] == [0, 1, 2, 3]
    # a .json list on one line with more lines after it stays a list (its rows kept, the rest
    # one reject), as a .json file always was: only a .jsonl may be JSON Lines led by a list
    (tmp_path / "two.json").write_text(json.dumps(rows[:2]) + "\n" + json.dumps(rows[:1]) + "\n")
    got = rows_of(tmp_path / "two.json")
    assert [r.data for r in got[:2]] == rows[:2] and "breaks at line 2" in str(got[2].data)


def test_json_lines_in_a_json_file_lose_only_their_bad_lines(tmp_path):
    # a Latin-1 byte made the whole file one reject; U+2028 / U+0085 inside a string split
    # rows apart (str.splitlines)
    odd = {"messages": [{"role": "user", "content": "a\u2028b"},
                        {"role": "assistant", "content": "c\x85d"}]}
    lines = [json.dumps(SHAREGPT).encode(), '{"x": "caf\xe9"}'.encode("latin-1"),
             json.dumps(odd, ensure_ascii=False).encode(), json.dumps(SHAREGPT).encode()]
    (tmp_path / "lines.json").write_bytes(b"\n".join(lines) + b"\n")
    got = rows_of(tmp_path / "lines.json")
    assert [r.row for r in got] == [1, 2, 3, 4]
    assert "not UTF-8" in str(got[1].data)
    assert got[2].data == odd and got[0].data == got[3].data == SHAREGPT
    (tmp_path / "odd.json").write_text("\n".join(json.dumps(r, ensure_ascii=False)
                                                 for r in (odd, odd)), encoding="utf-8")
    assert [r.data for r in rows_of(tmp_path / "odd.json")] == [odd, odd]


def test_json_lines_in_a_json_file_have_no_blank_line_past_their_end(tmp_path):
    # the newline that ends the last line was counted as a blank line after it (prepare: one
    # "blank" reject and one more row than the file has, for every Dataset.to_json file)
    text = json.dumps(SHAREGPT) + "\n\n" + json.dumps(MESSAGE_ROW) + "\n"
    (tmp_path / "utf8.json").write_text(text)
    (tmp_path / "latin1.json").write_bytes(text.encode() + b'{"x": "caf\xe9"}\n')
    (tmp_path / "ps.jsonl").write_bytes(text.encode("utf-16"))
    for name, rows in (("utf8.json", 3), ("latin1.json", 4), ("ps.jsonl", 3)):
        got = list(chat_files.read_rows(tmp_path / name, blank_lines=True))
        assert [r.row for r in got] == list(range(1, rows + 1)), name
        assert [isinstance(r.data, chat_files.BlankLine) for r in got[:3]] == [False, True, False]


def test_utf16_files_are_read(tmp_path, caplog):
    text = "\n".join(json.dumps(r) for r in (SHAREGPT, MESSAGE_ROW)) + "\n"
    (tmp_path / "ps.jsonl").write_bytes(text.encode("utf-16"))  # with its byte-order mark
    (tmp_path / "ps.json").write_bytes(json.dumps([SHAREGPT]).encode("utf-16"))
    with caplog.at_level("WARNING", logger="eyas"):
        assert [r.data for r in rows_of(tmp_path / "ps.jsonl")] == [SHAREGPT, MESSAGE_ROW]
    assert "UTF-16 text" in caplog.text
    assert [r.data for r in rows_of(tmp_path / "ps.json")] == [SHAREGPT]


def test_an_empty_tool_calls_list_is_a_turn_without_calls():
    got = chat.normalize({"messages": [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "a", "tool_calls": []}]})
    assert got == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ChatFormatError, match="no content"):
        chat.normalize({"messages": [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": None, "tool_calls": []}]})


def _regenerate_folder(folder, complete=True):
    from eyas.store.manifest import write_manifest

    folder.mkdir()
    write_jsonl(folder / "conversations.jsonl", [MESSAGE_ROW, SHAREGPT])
    write_jsonl(folder / "rejects.jsonl", [{"row": 3, "reason": "x"}])
    write_manifest(folder, "regenerate", {"data": ["in.jsonl"]}, complete=complete)
    return folder


def test_a_source_named_twice_is_read_once_and_globs_skip_eyas_files(tmp_path, caplog):
    write_jsonl(tmp_path / "a.jsonl", [SHAREGPT])
    with caplog.at_level("WARNING", logger="eyas"):
        got = rows_of((str(tmp_path / "a.jsonl"), str(tmp_path / "*.jsonl")))
    assert len(got) == 1 and "named more than once" in caplog.text
    regen = _regenerate_folder(tmp_path / "regen")
    by_glob = rows_of(str(regen / "*"))  # its manifest and rejects are not rows
    assert [r.data for r in by_glob] == [MESSAGE_ROW, SHAREGPT]
    (tmp_path / "prep").mkdir()
    from eyas.store.manifest import write_manifest

    write_jsonl(tmp_path / "prep" / "rejects.jsonl", [{"row": 1}])
    write_manifest(tmp_path / "prep", "prepare", {})
    with pytest.raises(EyasError, match="is an `eyas prepare` output, not chat data"):
        rows_of(str(tmp_path / "prep" / "*"))


def test_an_unfinished_regenerate_folder_is_refused_its_file_is_read(tmp_path):
    regen = _regenerate_folder(tmp_path / "regen", complete=False)
    with pytest.raises(EyasError, match=r"unfinished `eyas regenerate` run \(2 conversations "
                                        r"written so far\): run the same `eyas regenerate`"):
        rows_of(regen)
    assert len(rows_of(regen / "conversations.jsonl")) == 2  # the way to use what it has
    assert chat_sources.regenerate_outputs([str(regen), str(regen / "conversations.jsonl")])[0][
        "path"] == str(regen)


def test_a_template_kwarg_that_is_not_yaml_is_a_config_error():
    from eyas.config import ConfigError

    assert chat.parse_template_kwargs(("enable_thinking=false", "n=2")) == \
        {"enable_thinking": False, "n": 2}
    with pytest.raises(ConfigError, match=r"chat_template_kwargs 'x=\[1': the value is not YAML"):
        chat.parse_template_kwargs(("x=[1",))  # a yaml.parser.ParserError traceback before
