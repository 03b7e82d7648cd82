"""benchmarks/scale.py: the nested curve order over a corpus that arrives in parts, and the
resume across leases (only the sizes and evals the JSON lacks run again). The eyas steps are
stubbed: the CPU dry run with SmolLM2 is in docs/benchmarks.md."""

from __future__ import annotations

import gzip
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import scale  # noqa: E402


def _row(i: int) -> str:
    return json.dumps({"id": f"src/{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                                      {"role": "assistant", "content": "a"}]})


def _data(tmp_path: Path, n: int) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(_row(i) + "\n" for i in range(n)))
    for name in ("indist.jsonl", "heldout.jsonl"):
        (data / name).write_text(_row(999) + "\n")
    return data


def _regenerated(tmp_path: Path, n: int) -> tuple[Path, Path]:
    """The data of n prompts and a corpus folder with every one of them answered."""
    data = _data(tmp_path, n)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "conversations-p01.jsonl").write_text(
        "".join(_row(int(i.split("/")[1])) + "\n"
                for i in scale.curve_order(data / "train.jsonl", 0)))
    return data, corpus


def test_sizes_are_nested_prefixes_of_a_seeded_order_over_parts(tmp_path):
    data = _data(tmp_path, 40)
    order = scale.curve_order(data / "train.jsonl", 0)
    assert sorted(order) == sorted(f"src/{i}" for i in range(40)) and order != sorted(order)
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    first = [json.loads(_row(int(i.split("/")[1]))) for i in order[:10]]
    with gzip.open(corpus_dir / "conversations-p01-10.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in first)
    rows, files = scale.read_corpus([f"{corpus_dir}/conversations*.jsonl*"])
    assert scale.available(order, rows) == 10 and files[0]["rows"] == 10
    small, fp_small = scale.subset(order, rows, 5)
    # a later part (plain jsonl, with a duplicate of an earlier id) leaves size 5 unchanged
    later = [_row(int(i.split("/")[1])) for i in order[9:25]]
    (corpus_dir / "conversations-p02-16.jsonl").write_text("\n".join(later) + "\n")
    rows, files = scale.read_corpus([f"{corpus_dir}/conversations*.jsonl*"])
    assert scale.available(order, rows) == 25 and len(rows) == 25
    assert scale.subset(order, rows, 5) == (small, fp_small)
    assert scale.subset(order, rows, 20)[0][:5] == small
    nxt = scale.next_prompts(order, rows, data / "train.jsonl", 3)
    assert [json.loads(x)["id"] for x in nxt] == order[25:28]


def test_real_model_takes_its_training_prompts_as_the_curve_or_the_file_orders_them(tmp_path):
    # real_data.py writes train.jsonl source by source: the file's first N can be one source,
    # the curve's first N are size N's prompts (issue 33's 1.5B trains on them)
    from real_model import train_subset

    data = _data(tmp_path, 40)
    order = scale.curve_order(data / "train.jsonl", 0)
    curve = train_subset(data / "train.jsonl", 12, "curve", tmp_path / "curve.jsonl")
    assert [json.loads(x)["id"] for x in curve.read_text().splitlines()] == order[:12]
    assert curve.read_text().splitlines()[0] == _row(int(order[0].split("/")[1]))
    mixed = tmp_path / "mixed.jsonl"  # two sources: one of them first, as scale.py orders
    mixed.write_text("".join(_row(i).replace('"src/', '"chat/' if i % 4 == 0 else '"src/')
                             + "\n" for i in range(40)))
    chat = train_subset(mixed, 12, "curve", tmp_path / "chat.jsonl", ["chat"])
    want = scale.sources_first(scale.curve_order(mixed, 0), ["chat"])[:12]
    assert [json.loads(x)["id"] for x in chat.read_text().splitlines()] == want
    assert [i.split("/")[0] for i in want] == ["chat"] * 10 + ["src"] * 2
    head = train_subset(data / "train.jsonl", 12, "file", tmp_path / "head.jsonl")
    assert head.read_text().splitlines() == (data / "train.jsonl").read_text().splitlines()[:12]
    # a misnamed eval is refused before any step runs (not after hours of them)
    from real_model import main as real_model

    with pytest.raises(SystemExit):
        real_model(["--target", "t", "--data", str(data), "--work", str(tmp_path / "w"),
                    "--out", str(tmp_path / "r.json"), "--eval-order", "heldout,bench,indsit"])
    assert not (tmp_path / "w").exists()
    for bad in (["--top-up"], ["--sources-first", "chat"],
                ["--sources-first", "chat", "--train-order", "curve"],  # (no --max-train)
                ["--evals-first", "bench,indsit"]):
        with pytest.raises(SystemExit):
            real_model(["--target", "t", "--data", str(data), "--work", str(tmp_path / "w"),
                        "--out", str(tmp_path / "r.json"), *bad])
        assert not (tmp_path / "w").exists()
    # --evals-first: those evals before the command after export (served_speed.py), in
    # --eval-order's order, the others after it
    from real_model import eval_schedule

    assert eval_schedule(["heldout", "bench", "indist"], ["indist", "bench"]) == \
        (["bench", "indist"], ["heldout"])
    assert eval_schedule(["heldout", "bench", "indist"], []) == \
        ([], ["heldout", "bench", "indist"])
    # an eval before the serving that fails does not stop the serving; one after it does
    from real_model import evals_around, keep_gzipped

    ran = []

    def run_eval(name):
        ran.append(name)
        if name in ("bench", "indist"):
            raise SystemExit(f"eyas eval {name} failed")

    assert evals_around(["bench", "heldout"], [], run_eval, lambda: ran.append("serve") or 7) \
        == 7
    assert ran == ["bench", "heldout", "serve"]
    with pytest.raises(SystemExit, match="indist failed"):
        evals_around([], ["indist"], run_eval, lambda: None)
    # --keep-conversations: gzipped whole, through a temporary file
    src = tmp_path / "conversations.jsonl"
    src.write_text(_row(1) + "\n" + _row(2) + "\n")
    keep_gzipped(src, tmp_path / "home/qwen-conversations.jsonl.gz")
    import gzip

    with gzip.open(tmp_path / "home/qwen-conversations.jsonl.gz", "rt") as f:
        assert f.read() == src.read_text()
    assert [p.name for p in (tmp_path / "home").iterdir()] == ["qwen-conversations.jsonl.gz"]


def test_real_model_tops_up_carried_conversations_with_the_prompts_they_lack(tmp_path):
    # issue 33's 1.5B: 8,000 answers came home from one lease; the next trains on more
    from real_model import merge_conversations, missing_prompts

    data = _data(tmp_path, 10)
    prompts = data / "train.jsonl"
    carried = tmp_path / "carried.jsonl"  # ids 0-5 answered, 7 too, with one U+2028
    carried.write_text("".join(_row(i).replace("q", "q\u2028") + "\n" for i in (7, 0, 1, 2, 3, 4, 5)))
    rest = tmp_path / "rest.jsonl"
    assert missing_prompts(carried, prompts, rest) == 3
    assert [json.loads(x)["id"] for x in rest.read_text().splitlines()] == \
        ["src/6", "src/8", "src/9"]
    new = tmp_path / "new.jsonl"  # what the regeneration answered (8 was rejected)
    new.write_text(_row(9) + "\n" + _row(6) + "\n" + _row(0) + "\n")
    merged = merge_conversations([carried, new, tmp_path / "none.jsonl"], prompts,
                                 tmp_path / "merged.jsonl")
    rows = [json.loads(x) for x in merged.read_text().split("\n") if x]
    assert [r["id"] for r in rows] == [f"src/{i}" for i in (0, 1, 2, 3, 4, 5, 6, 7, 9)]
    assert rows[0]["messages"][0]["content"] == "q\u20280"  # the carried row of an id wins
    assert rows[6]["messages"][0]["content"] == "q6"
    assert missing_prompts(merged, prompts, rest) == 1  # only the rejected one is left


def test_sources_first_puts_a_data_mix_at_the_head_of_the_curve_and_keeps_its_own_json(
        tmp_path, monkeypatch):
    order = ["bigbench/a/1", "sharegpt/x", "chitchat/y", "bigbench/b/2", "sharegpt/z"]
    assert scale.sources_first(order, ["sharegpt", "chitchat"]) == \
        ["sharegpt/x", "chitchat/y", "sharegpt/z", "bigbench/a/1", "bigbench/b/2"]
    assert scale.sources_first(order, []) == order
    # 12 prompts of two sources, every one answered
    rows = [json.dumps({"id": f"{'chat' if i % 3 == 0 else 'task'}/{i}", "messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]})
        for i in range(12)]
    data, corpus = tmp_path / "data", tmp_path / "corpus"
    data.mkdir(), corpus.mkdir()
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    for name in ("indist.jsonl", "heldout.jsonl"):
        (data / name).write_text(rows[0] + "\n")
    (corpus / "conversations-p01.jsonl").write_text("\n".join(rows) + "\n")
    trained = {}

    def fake_train(a, n, lines, folder):
        trained[folder.name] = [json.loads(x)["id"].split("/")[0] for x in lines]
        (folder / "draft").mkdir(parents=True, exist_ok=True)
        (folder / "draft/eyas.json").write_text(json.dumps({"id": f"d{n}"}))
        return {"tokens": n, "train_tokens": n, "gpu_minutes": 0.1, "draft_id": f"d{n}"}

    monkeypatch.setattr(scale, "train_size", fake_train)
    monkeypatch.setattr(scale, "measure", lambda *args, **kw: None)
    out = tmp_path / "scale.json"
    argv = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus), "--work",
            str(tmp_path / "work"), "--out", str(out), "--sizes", "4"]
    assert scale.main(argv)["sources_first"] == []
    assert trained.pop("size-4") != ["chat"] * 4  # (the seeded shuffle's first 4: mixed)
    # the same JSON with another order would redo (and overwrite) the curve's sizes
    with pytest.raises(SystemExit, match="its own --out"):
        scale.main(argv + ["--sources-first", "chat"])
    with pytest.raises(SystemExit):  # a source no prompt has: a typo, not a mix
        scale.main(argv[:-4] + ["--out", str(tmp_path / "x.json"), "--sources-first", "caht"])
    state = scale.main(argv[:-4] + ["--out", str(tmp_path / "chat.json"), "--sizes", "4",
                                    "--sources-first", "chat"])
    assert state["sources_first"] == ["chat"] and "4" in state["sizes"]
    assert trained == {"size-4-chat": ["chat"] * 4}  # its own folder, chat prompts only
    # how the list is written changes nothing: the same order, name and JSON
    scale.main(argv[:-4] + ["--out", str(tmp_path / "chat.json"), "--sizes", "4",
                            "--sources-first", "chat,chat,"])
    state = scale.main(argv[:-4] + ["--out", str(tmp_path / "two.json"), "--sizes", "4",
                                    "--sources-first", "task,chat"])
    assert state["sources_first"] == ["chat", "task"] and "size-4-chat+task" in trained


def test_an_order_of_the_corpus_itself_trains_on_rows_train_jsonl_lacks(tmp_path,
                                                                       monkeypatch, capsys):
    """--order corpus: every answered row but --data's eval prompts and held-out sources,
    whatever train.jsonl lists (a corpus regenerated from prompts a later train.jsonl lacks:
    BIG-bench's)."""
    data, corpus = _regenerated(tmp_path, 8)  # train.jsonl lists src/0..7, all answered
    extra = [json.dumps({"id": f"{src}/{i}", "messages": [
        {"role": "user", "content": f"b{i}"}, {"role": "assistant", "content": "a"}]})
        for src in ("bigbench/t", "chatterbot/kept-out") for i in range(5)]
    with gzip.open(corpus / "conversations-p02-10.jsonl.gz", "wt") as f:
        f.write("\n".join(extra) + "\n")
    (data / "indist.jsonl").write_text(_row(3) + "\n")  # eval prompts the corpus answered
    (data / "heldout.jsonl").write_text(  # a held-out source: none of its rows is trained on
        json.dumps({"id": "chatterbot/kept-out/7", "messages": []}) + "\n")
    trained = {}

    def fake_train(a, n, lines, folder):
        trained[folder.name] = [json.loads(x)["id"] for x in lines]
        (folder / "draft").mkdir(parents=True, exist_ok=True)
        (folder / "draft/eyas.json").write_text(json.dumps({"id": f"d{n}"}))
        return {"tokens": n, "train_tokens": n, "gpu_minutes": 0.1, "draft_id": f"d{n}"}

    monkeypatch.setattr(scale, "train_size", fake_train)
    monkeypatch.setattr(scale, "measure", lambda *args, **kw: None)
    base = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus),
            "--work", str(tmp_path / "work")]
    out = tmp_path / "corpus.json"
    state = scale.main(base + ["--out", str(out), "--order", "corpus", "--sizes", "5, all"])
    whole = [f"src/{i}" for i in range(8) if i != 3] + [f"bigbench/t/{i}" for i in range(5)]
    order = scale.corpus_order(scale.read_corpus([f"{corpus}/*.jsonl*"])[0], {"src/3"},
                               {"chatterbot/kept-out"}, 0)
    assert sorted(order) == sorted(whole)  # 18 answered, less 1 eval prompt and 5 held out
    assert trained["size-12-corpus"] == order and trained["size-5-corpus"] == order[:5]
    assert state["order"] == "corpus" and state["left_out_for_evals"] == 6
    assert sorted(state["sizes"]) == ["12", "5"]
    # the curve's own order trains on train.jsonl's ids only, and keeps its own JSON
    with pytest.raises(SystemExit, match="its own --out"):
        scale.main(base + ["--out", str(out), "--sizes", "5"])
    # another corpus is another order: not resumed into this JSON
    (corpus / "conversations-p03-1.jsonl").write_text(_row(20) + "\n")
    with pytest.raises(SystemExit, match="another order of the corpus"):
        scale.main(base + ["--out", str(out), "--order", "corpus", "--sizes", "5"])
    refused = {"only with --order corpus": ["--sizes", " all,5"],  # an order that grows
               "as it is": ["--order", "corpus", "--sizes", "all", "--regenerate", "4"],
               "holds 13": ["--order", "corpus", "--sizes", "14"]}
    for i, (why, args) in enumerate(refused.items()):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            scale.main(base + ["--out", str(tmp_path / f"r{i}.json"), *args])
        assert why in capsys.readouterr().err and not (tmp_path / f"r{i}.json").exists()
    scale.main(base + ["--out", str(tmp_path / "train.json"), "--sizes", "5"])
    assert all(i.startswith("src/") for i in trained["size-5"])


def test_a_second_call_runs_only_what_the_json_lacks(tmp_path, monkeypatch, capsys):
    data, corpus = _regenerated(tmp_path, 12)
    trained, evals = [], []

    def fake_train(a, n, lines, folder):
        trained.append(n)
        (folder / "draft").mkdir(parents=True, exist_ok=True)
        (folder / "draft/eyas.json").write_text(json.dumps({"id": f"d{n}-{len(trained)}"}))
        return {"tokens": 10 * n, "train_tokens": 100 * n, "gpu_minutes": 0.1,
                "draft_id": f"d{n}-{len(trained)}"}

    ngram_by = {}

    def fake_run(step, *args, log, out):
        evals.append(out.name)
        ngram_by[out.name] = "--ngram" in args
        out.mkdir(parents=True)
        sets = ["mt-bench", "gsm8k"] if "--bench" in args else []
        res = [{"method": m, "k": k, "mean_acceptance_length": 1.5,
                "tokens_per_step": 1.49 if m == "eagle3" else 1.2}
               for m in ("eagle3", "ngram") for k in (3, 6)]
        report = {"num_prompts": 2, "lossless": True, "results": res,
                  "by_set": {s: {"prompts": 2, "results": res} for s in sets}}
        if "--temperature" not in args:  # eyas eval replays only at T = 0
            report.update({"mean_acceptance_length": {"3": 1.5, "6": 1.5},
                           "ci95": {"3": {"mean_acceptance_length": [1.4, 1.6]}},
                           "replayed": {"3": {"mean_acceptance_length": 1.52, "ci95": {
                               "mean_acceptance_length": [1.41, 1.63]}}}})
        (out / "report.json").write_text(json.dumps(report))
        return 1.0

    monkeypatch.setattr(scale, "train_size", fake_train)
    monkeypatch.setattr(scale, "run", fake_run)
    out = tmp_path / "res/scale.json"
    argv = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus), "--work",
            str(tmp_path / "work"), "--out", str(out), "--sizes", "4,8,16",
            "--bench", "mt-bench,gsm8k", "--t1-bench", "mt-bench"]
    state = scale.main(argv)
    assert trained == [4, 8] and "16" not in state["sizes"]  # 12 conversations: 16 waits
    assert len(evals) == 8 and set(state["ngram"]) == {"indist", "heldout", "mt-bench",
                                                       "gsm8k", "mt-bench-t1"}
    assert out.with_suffix(".md").is_file() and (out.parent / "scale-k3.png").is_file()
    # trained == served per eval: measured AL and its replay on training's forward, with
    # their intervals (none at T = 1)
    evals4 = state["sizes"]["4"]["evals"]
    assert evals4["indist"]["fidelity"] == {"3": {"measured": 1.5, "measured_ci95": [1.4, 1.6],
                                                  "replayed": 1.52,
                                                  "replayed_ci95": [1.41, 1.63]}}
    assert "fidelity" not in evals4["bench-t1"]
    # n-gram's tokens per step (its AL counts only the steps that drafted) beside its AL
    assert state["ngram"]["gsm8k"]["tokens_per_step"] == {"3": 1.2, "6": 1.2}
    assert evals4["bench"]["sets"]["gsm8k"]["eagle3_tokens_per_step"] == {"3": 1.49, "6": 1.49}
    md = out.with_suffix(".md").read_text()
    assert "| n-gram, tokens per step | | | | 1.200 | 1.200 |" in md and "tokens per step" in md
    assert "| 4 | indist | 3 | 1.500 [1.400, 1.600] | 1.520 [1.410, 1.630] |" in \
        out.with_suffix(".md").read_text()
    # a new lease: the work folder is gone, size 4's record deleted, one eval of size 8 lost
    import shutil
    shutil.rmtree(tmp_path / "work")
    saved = json.loads(out.read_text())
    del saved["sizes"]["4"]
    # an n-gram record from before tokens per step were recorded is measured again
    del saved["ngram"]["heldout"]["tokens_per_step"]
    out.write_text(json.dumps(saved))
    trained.clear(), evals.clear(), ngram_by.clear()
    state = scale.main(argv)
    assert trained == [4] and len(evals) == 4  # size 8: every eval done, its draft not needed
    assert ngram_by == {"eval-indist": False, "eval-heldout": True, "eval-bench": False,
                        "eval-bench-t1": False}
    assert state["ngram"]["heldout"]["tokens_per_step"] == {"3": 1.2, "6": 1.2}
    saved["ngram"]["heldout"] = state["ngram"]["heldout"]
    assert state["sizes"]["8"] == saved["sizes"]["8"]
    assert "8 | 80 | 800" in scale.markdown(state).replace(",", "")
    # fp8 capture storage and a CUDA graph are not another recipe: the records stand
    trained.clear(), evals.clear()
    scale.main([*argv, "--capture-dtype", "fp8", "--exec-args", "--cuda-graph --num-workers 2"])
    assert trained == [] and evals == []
    with pytest.raises(SystemExit):  # what training learns is the recipe, not --exec-args
        scale.main([*argv, "--exec-args", "--cuda-graph --lr 1e-4"])
    assert trained == [] and evals == []
    # a size's record holds the recipe eyas train resolved (its defaults filling what
    # --train-args leave unset): flags that resolve to it keep the records ...
    from eyas.draft import train_config

    assert state["sizes"]["4"]["recipe"]["loss_mask_at"] == "all"
    scale.main([*argv, "--train-args", "--loss-mask-at all --lr 1e-3"])
    assert trained == [] and evals == []
    # ... a record from before recipes were recorded trained on the assistant's positions
    # (BEFORE_RECIPES): trained again under today's defaults, kept where flags ask for those
    def forget_recipe(size):
        saved = json.loads(out.read_text())
        saved["sizes"][size].pop("recipe", None)
        out.write_text(json.dumps(saved))

    forget_recipe("8")
    scale.main([*argv, "--train-args", "--loss-mask-at input"])
    assert trained == [4]  # size 4's recipe was all; 8's, unrecorded, was input
    trained.clear()
    forget_recipe("8")
    capsys.readouterr()
    scale.main(argv)
    assert trained == [4, 8] and "size 8: recorded under another recipe (loss_mask_at " \
        "'input' -> 'all'), run again" in capsys.readouterr().out
    # ... and a change of eyas train's defaults under the same flags trains every size again
    trained.clear()
    forget_recipe("8")
    monkeypatch.setitem(train_config.EAGLE3_RECIPE, "loss_mask_at", "input")
    state = scale.main(argv)
    assert trained == [4] and "size 4: recorded under another recipe (loss_mask_at 'all' -> " \
        "'input'), run again" in capsys.readouterr().out
    assert state["sizes"]["4"]["recipe"]["loss_mask_at"] == "input"
    # flags eyas train refuses, and a torch whose Muon is missing (eyas train's recipe would
    # fall back to AdamW: every record trained again), stop before any work
    trained.clear()
    fresh = [*argv[:argv.index("--work") + 1], str(tmp_path / "work2"),
             *argv[argv.index("--work") + 2:]]
    with pytest.raises(SystemExit):
        scale.main([*fresh, "--train-args", "--loss-mask-at everywhere"])
    assert "--loss-mask-at" in capsys.readouterr().err
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(SystemExit):
        scale.main(fresh)
    assert "no torch.optim.Muon" in capsys.readouterr().err
    assert trained == [] and not (tmp_path / "work2").exists()


def test_a_new_recipe_trains_on_the_captures_a_size_kept(tmp_path, monkeypatch):
    """Captures are made for the subset and the capture dtype, not the recipe: a size trained
    again under other --train-args finds its prepared and captured folders as they were (its
    run goes, by the recipe's mark), while another capture dtype starts the folder again."""
    data, corpus = _regenerated(tmp_path, 4)
    found = []

    def fake_train(a, n, lines, folder):
        captured = folder / "captured/shard.bin"
        found.append((captured.is_file(), (folder / "run/step.txt").is_file()))
        captured.parent.mkdir(parents=True, exist_ok=True)
        captured.write_text("states")
        (folder / "run").mkdir(exist_ok=True)
        (folder / "run/step.txt").write_text("1")
        (folder / "draft").mkdir(exist_ok=True)
        (folder / "draft/eyas.json").write_text(json.dumps({"id": f"d{len(found)}"}))
        return {"tokens": 1, "train_tokens": 1, "gpu_minutes": 0.1, "draft_id": f"d{len(found)}"}

    monkeypatch.setattr(scale, "train_size", fake_train)
    monkeypatch.setattr(scale, "measure", lambda *args: None)
    argv = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus), "--work",
            str(tmp_path / "work"), "--out", str(tmp_path / "scale.json"), "--sizes", "4",
            "--keep-captures"]
    scale.main(argv)
    # a mark of the format before session 47 (the subset, then --train-args; bf16 storage),
    # as a run kept over two leases carries it, is taken as today's
    mark = tmp_path / "work/size-4/subset.txt"
    fingerprint = mark.read_text().split()[0]
    mark.write_text(f"{fingerprint} --lr 3e-4")
    scale.main([*argv, "--train-args", "--lr 2e-3"])  # another recipe: the captures stay
    assert mark.read_text().startswith(f"{fingerprint} capture=bf16 dtype=float32 target=t")
    # a record made with the other storage dtype stands; a folder made with it does not
    scale.main([*argv, "--train-args", "--lr 2e-3", "--capture-dtype", "fp8"])
    assert len(found) == 2
    saved = json.loads((tmp_path / "scale.json").read_text())
    del saved["sizes"]["4"]
    (tmp_path / "scale.json").write_text(json.dumps(saved))
    scale.main([*argv, "--train-args", "--lr 2e-3", "--capture-dtype", "fp8"])
    assert found == [(False, False), (True, False), (False, False)]


def test_a_run_folder_of_another_recipe_is_not_resumed(tmp_path):
    """A size's or variant's run and draft trained by another recipe go before it trains; the
    recipe is the folder's mark, or (a folder made before marks) its run's own manifest."""
    import argparse

    a = argparse.Namespace(target="t", online=False, train_args="", exec_args="")
    now = scale.train_recipe(a)
    before = scale.train_recipe(a, ["--loss-mask-at", "input"])
    for mark, config, kept in ((None, now, True), (None, before, False), (now, before, True),
                               (before, now, False)):
        folder = tmp_path / f"f{len(list(tmp_path.iterdir()))}"
        (folder / "run").mkdir(parents=True)
        (folder / "draft").mkdir()
        (folder / "run/eyas.json").write_text(json.dumps({"config": {**config, "data": "x"}}))
        if mark is not None:
            (folder / "recipe.json").write_text(json.dumps(mark, sort_keys=True))
        scale._run_made_for(folder, now)
        assert (folder / "run").exists() is kept and (folder / "draft").exists() is kept
        assert json.loads((folder / "recipe.json").read_text()) == now
    # an option eyas gained since holds its default in the old record: no change
    assert scale._recipe_diff({k: v for k, v in now.items() if k != "seed"}, now) == []
    assert scale._recipe_diff(now, {**now, "seed": 1}) == ["seed"]


def test_t1_sampling_measures_probabilistic_drafts_as_their_own_sets(tmp_path, monkeypatch):
    """--t1-sampling greedy,probabilistic: the T = 1 bench sets twice, greedy drafts as
    SET-t1 and probabilistic ones (eyas eval --draft-sampling probabilistic) as SET-t1p, each
    with its n-gram, in the table; an unknown way is refused before any work."""
    data, corpus = _regenerated(tmp_path, 6)
    calls = {}

    def fake_train(a, n, lines, folder):
        (folder / "draft").mkdir(parents=True, exist_ok=True)
        (folder / "draft/eyas.json").write_text(json.dumps({"id": "d"}))
        return {"tokens": 10, "train_tokens": 100, "gpu_minutes": 0.1, "draft_id": "d"}

    def fake_run(step, *args, log, out):
        args = [str(x) for x in args]
        calls[out.name] = args
        out.mkdir(parents=True)
        al = 1.4 if "probabilistic" in args else 1.2
        res = [{"method": m, "k": k, "mean_acceptance_length": al if m == "eagle3" else 1.6}
               for m in ("eagle3", "ngram") for k in (3, 6)]
        report = {"num_prompts": 2, "lossless": True, "results": res,
                  "by_set": {"mt-bench": {"prompts": 2, "results": res}}}
        (out / "report.json").write_text(json.dumps(report))
        return 1.0

    monkeypatch.setattr(scale, "train_size", fake_train)
    monkeypatch.setattr(scale, "run", fake_run)
    out = tmp_path / "res/scale.json"
    argv = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus), "--work",
            str(tmp_path / "work"), "--out", str(out), "--sizes", "4", "--bench", "",
            "--t1-bench", "mt-bench", "--t1-sampling", "greedy,probabilistic"]
    state = scale.main(argv)
    greedy, prob = calls["eval-bench-t1"], calls["eval-bench-t1p"]
    assert "--draft-sampling" not in greedy and "--temperature" in greedy
    assert prob[prob.index("--draft-sampling") + 1] == "probabilistic"
    assert prob[prob.index("--temperature") + 1] == "1"
    evals = state["sizes"]["4"]["evals"]
    assert evals["bench-t1"]["sets"]["mt-bench-t1"]["eagle3"] == {"3": 1.2, "6": 1.2}
    assert evals["bench-t1p"]["sets"]["mt-bench-t1p"]["eagle3"] == {"3": 1.4, "6": 1.4}
    assert {"mt-bench-t1", "mt-bench-t1p"} <= set(state["ngram"])
    assert "mt-bench-t1p k=3" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        scale.main([*argv[:-1], "greedy,sampled"])


def test_sizes_and_evals_at_once_share_one_json_and_measure_ngram_once(tmp_path, monkeypatch):
    """--jobs 3 --eval-jobs 2: sizes 4 and 6 and their two evals each run side by side (the
    stubbed eval waits until all four are running), every record lands in the one JSON, each
    prompt set's n-gram is measured by one eval only, and size 8, which fails, leaves the
    others' results, then ends the call with its error."""
    data, corpus = _regenerated(tmp_path, 12)
    at_once = threading.Barrier(4, timeout=60)
    ngram_runs, lock = [], threading.Lock()

    def fake_train(a, n, lines, folder):
        if n == 8:
            raise SystemExit("eyas train failed (rc 1); see log")
        (folder / "draft").mkdir(parents=True, exist_ok=True)
        (folder / "draft/eyas.json").write_text(json.dumps({"id": f"d{n}"}))
        return {"tokens": 10 * n, "train_tokens": 100 * n, "gpu_minutes": 0.1,
                "draft_id": f"d{n}"}

    def fake_run(step, *args, log, out):
        at_once.wait()  # four evals running together, or BrokenBarrierError
        with lock:
            if "--ngram" in args:
                ngram_runs.append(out.name)
        out.mkdir(parents=True)
        res = [{"method": m, "k": k, "mean_acceptance_length": 1.5}
               for m in ("eagle3", "ngram") for k in (3, 6)]
        (out / "report.json").write_text(json.dumps({"num_prompts": 2, "results": res}))
        return 1.0

    monkeypatch.setattr(scale, "train_size", fake_train)
    monkeypatch.setattr(scale, "run", fake_run)
    out = tmp_path / "res/scale.json"
    argv = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus), "--work",
            str(tmp_path / "work"), "--out", str(out), "--sizes", "4,6,8", "--bench", "",
            "--t1-bench", "", "--jobs", "3", "--eval-jobs", "2"]
    with pytest.raises(SystemExit, match="8: eyas train failed"):
        scale.main(argv)
    saved = json.loads(out.read_text())
    assert sorted(saved["sizes"]) == ["4", "6"]
    assert all(set(saved["sizes"][n]["evals"]) == {"indist", "heldout"} for n in ("4", "6"))
    assert sorted(ngram_runs) == ["eval-heldout", "eval-indist"]
    assert set(saved["ngram"]) == {"indist", "heldout"}


def test_no_sizes_only_regenerates_and_leaves_the_json_alone(tmp_path, monkeypatch):
    data = _data(tmp_path, 6)
    calls = []

    def fake_run(step, *args, log, out):
        calls.append(step)
        out.mkdir(parents=True)
        prompts = Path(args[args.index("--data") + 1]).read_text()
        (out / "conversations.jsonl").write_text(prompts)
        (out / "eyas.json").write_text("{}")
        return 1.0

    monkeypatch.setattr(scale, "run", fake_run)
    out = tmp_path / "res/scale.json"
    state = scale.main(["--target", "t", "--data", str(data), "--corpus-dir",
                        str(tmp_path / "corpus"), "--work", str(tmp_path / "work"), "--out",
                        str(out), "--sizes", "", "--regenerate", "4"])
    assert state == {} and calls == ["regenerate"] and not out.exists()
    assert sorted(f.name for f in (tmp_path / "corpus").iterdir()) == [
        "conversations-p01-4-eyas.json", "conversations-p01-4.jsonl.gz"]


def test_rows_regenerate_rejects_are_skipped_by_the_curve_order_and_counted(tmp_path,
                                                                            monkeypatch):
    # the H200 run of session 16: two prompts longer than --max-length were rejected (kind
    # length), and every size past the first of them waited for rows that never come
    data = _data(tmp_path, 10)
    order = scale.curve_order(data / "train.jsonl", 0)
    refused = {order[2], order[5]}

    def fake_run(step, *args, log, out):  # eyas regenerate's output files, in its formats
        out.mkdir(parents=True)
        rows = [json.loads(x) for x in
                Path(args[args.index("--data") + 1]).read_text().splitlines()]
        (out / "conversations.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows if r["id"] not in refused))
        (out / "rejects.jsonl").write_text("".join(
            json.dumps({"file": "prompts.jsonl", "row": n, "sample_id": r["id"],
                        "reason": "too long", "kind": "length"}) + "\n"
            for n, r in enumerate(rows) if r["id"] in refused))
        (out / "eyas.json").write_text("{}")
        return 1.0

    trained = {}

    def fake_train(a, n, lines, folder):
        trained[n] = [json.loads(x)["id"] for x in lines]
        (folder / "draft").mkdir(parents=True, exist_ok=True)
        (folder / "draft/eyas.json").write_text(json.dumps({"id": f"d{n}"}))
        return {"tokens": n, "train_tokens": n, "gpu_minutes": 0.1, "draft_id": f"d{n}"}

    monkeypatch.setattr(scale, "run", fake_run)
    corpus = tmp_path / "corpus"
    common = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus), "--work",
              str(tmp_path / "work"), "--out", str(tmp_path / "scale.json")]
    scale.main([*common, "--sizes", "", "--regenerate", "10"])
    assert sorted(f.name for f in corpus.iterdir()) == [
        "conversations-p01-10-eyas.json", "conversations-p01-10.jsonl.gz",
        "rejects-p01-10.jsonl"]
    # a later lease: a bare work folder, the corpus and its rejects carried
    import shutil
    shutil.rmtree(tmp_path / "work")
    monkeypatch.setattr(scale, "train_size", fake_train)
    monkeypatch.setattr(scale, "run_size", lambda a, n, lines, fp, book: fake_train(
        a, n, lines, tmp_path / f"s{n}"))
    state = scale.main([*common, "--sizes", "4,8,9"])
    kept = [i for i in order if i not in refused]
    assert trained == {4: kept[:4], 8: kept[:8]}  # 9 would need a refused row: it waits
    assert state["rejected_by_regenerate"] == 2 and state["curve_prefix_available"] == 8


def test_a_part_whose_every_prompt_is_rejected_is_kept_not_a_failure(tmp_path, monkeypatch):
    data = _data(tmp_path, 4)

    def fake_run(step, *args, log, out):  # eyas regenerate exits 2 when no row succeeded
        out.mkdir(parents=True)
        rows = [json.loads(x) for x in
                Path(args[args.index("--data") + 1]).read_text().splitlines()]
        (out / "conversations.jsonl").write_text("")
        (out / "rejects.jsonl").write_text("".join(
            json.dumps({"sample_id": r["id"], "kind": "length"}) + "\n" for r in rows[:refuse]))
        (out / "eyas.json").write_text("{}")
        raise SystemExit("eyas regenerate failed (rc 2)")

    monkeypatch.setattr(scale, "run", fake_run)
    corpus = tmp_path / "corpus"
    common = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus), "--work",
              str(tmp_path / "work"), "--out", str(tmp_path / "s.json"), "--sizes", ""]
    refuse = 1  # one of two rejected, the other lost: a real failure, raised
    with pytest.raises(SystemExit):
        scale.main([*common, "--regenerate", "2"])
    refuse = 3  # all three rejected: the part and its rejects are kept
    import shutil
    shutil.rmtree(tmp_path / "work")
    scale.main([*common, "--regenerate", "3"])
    assert (corpus / "rejects-p01-3.jsonl").is_file()
    assert len(scale.read_rejects([str(corpus / "rejects-*.jsonl")])) == 3


def test_wait_starts_a_size_once_a_running_regeneration_has_written_its_rows(tmp_path,
                                                                            monkeypatch):
    data = _data(tmp_path, 10)
    order = scale.curve_order(data / "train.jsonl", 0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "conversations-p01-4.jsonl").write_text(
        "".join(_row(int(i.split("/")[1])) + "\n" for i in order[:4]))
    growing = tmp_path / "work/regen-p02/out/conversations.jsonl"
    growing.parent.mkdir(parents=True)
    # a regeneration beside this process: rows 4..7 written, the next one half-way, cut inside
    # a multi-byte character
    whole = json.dumps({"id": order[8], "messages": [{"role": "user", "content": "caf\u00e9"}]},
                       ensure_ascii=False).encode()
    half = whole[:whole.index("\u00e9".encode()) + 1]
    growing.write_bytes("".join(_row(int(i.split("/")[1])) + "\n"
                                for i in order[4:8]).encode() + half)
    started = []

    def fake_run_size(a, n, lines, fp, book):
        started.append((n, [json.loads(x)["id"] for x in lines]))

    monkeypatch.setattr(scale, "run_size", fake_run_size)
    common = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus), "--work",
              str(tmp_path / "work"), "--out", str(tmp_path / "s.json"), "--sizes", "4,8,10"]
    state = scale.main(common)  # without --wait only the parts count, and nothing waits
    assert started == [(4, order[:4])] and state["curve_prefix_available"] == 4
    started.clear()
    monkeypatch.setattr(scale, "POLL_S", 0.1)
    state = scale.main([*common, "--wait", "0.5"])
    assert started == [(4, order[:4]), (8, order[:8])]  # 10 is not there when the wait ends
    assert state["curve_prefix_available"] == 8
    started.clear()

    def finish():  # the regeneration ends its half-written row and answers the last two
        time.sleep(0.5)
        growing.write_text("".join(_row(int(i.split("/")[1])) + "\n" for i in order[4:10]))

    threading.Thread(target=finish).start()
    begin = time.monotonic()
    state = scale.main([*common, "--wait", "60"])
    assert time.monotonic() - begin < 20  # started when the rows came, not at the deadline
    assert started == [(4, order[:4]), (8, order[:8]), (10, order)]
    assert state["curve_prefix_available"] == 10


def test_only_a_live_regeneration_may_end_in_a_broken_line_and_retried_rejects_stay(tmp_path):
    part = tmp_path / "conversations-p01-2.jsonl"
    part.write_text(_row(1) + "\n" + _row(2)[:10] + "\n" + _row(3) + "\n")
    with pytest.raises(json.JSONDecodeError):  # a damaged part is an error, not skipped
        scale.read_corpus([str(part)])
    rejects = tmp_path / "rejects-p01-3.jsonl"
    rejects.write_text("".join(json.dumps({"sample_id": f"src/{i}", "kind": k}) + "\n"
                               for i, k in enumerate(["length", "server", "memory", "input",
                                                      "empty"])))
    assert scale.read_rejects([str(rejects)]) == {"src/0", "src/3", "src/4"}


def _fake_steps(work: Path, events: list, gates: dict, dtypes: list | None = None):
    """`run` for a size's steps, writing what it reads back: a capture writes a file of the
    size's token count in bytes (after gates["capture", n] is set, when there is one), a
    training waits for gates["train", n] or fails on gates["train", n] = "fail"."""
    def fake_run(step, *args, log, out):
        n = int(out.parent.name.removeprefix("size-"))
        events.append((step, n))
        gate = gates.get((step, n))
        if gate == "fail":
            raise SystemExit(f"eyas {step} failed (rc 1)")
        if gate is not None:
            assert gate.wait(30)
        out.mkdir(parents=True, exist_ok=True)
        if step == "prepare":
            (out / "eyas.json").write_text(json.dumps(
                {"stats": {"tokens": n, "kept": 1, "train": 1}}))
        elif step == "capture":
            if dtypes is not None:
                dtypes.append(args[list(args).index("--dtype") + 1])
            (out / "shard.bin").write_bytes(b"x" * n)
            (out / "eyas.json").write_text("{}")
        elif step == "train":
            if dtypes is not None and "--cuda-graph" in args:
                dtypes.append("--cuda-graph")
            (out / "eyas.json").write_text(json.dumps({"config": {"epochs": 1}, "steps": 1}))
            (out / "metrics.jsonl").write_text("")
        elif step == "export":
            (out / "eyas.json").write_text(json.dumps({"id": f"d{n}"}))
        elif step == "eval":
            (out / "report.json").write_text(json.dumps({"num_prompts": 1, "results": []}))
        return 1.0
    return fake_run


@pytest.fixture(autouse=True)
def _no_disk_state_between_tests():
    """scale.py's disk bookkeeping is per process: a test starts and ends with none."""
    for held in (scale._CAPTURING, scale._FREEING, scale._WAITING):
        held.clear()
    yield
    for held in (scale._CAPTURING, scale._FREEING, scale._WAITING):
        held.clear()


def _disk(tmp_path: Path, monkeypatch, capacity: int, gates: dict, **kw):
    """A fake disk of `capacity` bytes under WORK (its .bin files fill it), the stubbed
    steps, and run_size's arguments and result book (two evals: indist, heldout)."""
    import argparse

    work, events, dtypes = tmp_path / "work", [], []
    data = _data(tmp_path, 1)

    def used() -> int:  # the shards' bytes; a size deleting its shards may remove one meanwhile
        total = 0
        for root, _, names in os.walk(work):  # os.walk skips a folder that vanishes
            for name in names:
                try:
                    total += os.stat(os.path.join(root, name)).st_size * name.endswith(".bin")
                except FileNotFoundError:
                    pass
        return total

    monkeypatch.setattr(scale, "run", _fake_steps(work, events, gates, dtypes))
    monkeypatch.setattr(scale, "capture_bytes", lambda target, tokens, dtype: tokens)
    monkeypatch.setattr(scale, "free_bytes", lambda folder: capacity - used())
    monkeypatch.setattr(scale, "DISK_POLL_S", 0.02)
    a = argparse.Namespace(target="t", dtype="float32", online=False, train_args="",
                           disk_wait=30.0, keep_captures=False, capture_dtype="bf16",
                           exec_args="", work=str(work), data=str(data), bench="", t1_bench="", k="3",
                           prompts=1, bench_prompts=1, eval_tokens=8, device="cpu",
                           eval_batch=1, eval_jobs=1, sources_first="", order="train")
    vars(a).update(kw)

    def write():  # whether a size's captures were still there when its record was written
        for n in book.state["sizes"]:
            book.captures_at_record.setdefault(n, (work / f"size-{n}/captured").is_dir())

    book = scale.Book({"sizes": {}, "ngram": {}}, write)
    book.captures_at_record = {}
    return a, book, work, events, dtypes, used


def _start(a, book, n: int, results: dict) -> threading.Thread:
    """run_size(n) in a thread; results[n] = its draft's id, or the SystemExit it ended on."""
    def size():
        try:
            scale.run_size(a, n, ["{}"], "fp", book)
            results[n] = book.state["sizes"][str(n)]["train"]["draft_id"]
        except SystemExit as e:
            results[n] = e
    t = threading.Thread(target=size)
    t.start()
    return t


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_capture_waits_for_the_disk_that_a_running_capture_reserved_and_a_size_frees(
        tmp_path, monkeypatch):
    """Two sizes at once on a disk that holds one capture: while the first capture has
    written nothing yet, the second waits on the first's reservation alone; then on its
    shards; it captures once the first size has recorded its draft and deleted them."""
    gates = {("capture", 1000): threading.Event(), ("train", 1000): threading.Event()}
    a, book, work, events, dtypes, used = _disk(tmp_path, monkeypatch, 1500, gates)
    results = {}
    first = _start(a, book, 1000, results)
    _until(lambda: ("capture", 1000) in events, "the first capture starts")
    second = _start(a, book, 900, results)
    _until(lambda: 900 in scale._WAITING, "the second capture waits")
    assert ("capture", 900) not in events and used() == 0  # 1,500 free, 1,000 reserved
    gates["capture", 1000].set()
    _until(lambda: ("train", 1000) in events, "the first size trains")
    _until(lambda: 900 in scale._WAITING, "the second capture still waits")
    assert ("capture", 900) not in events and used() == 1000  # 500 free: it still waits
    gates["train", 1000].set()
    first.join(30), second.join(30)
    assert results == {1000: "d1000", 900: "d900"}
    assert book.captures_at_record == {"1000": True, "900": True}  # deleted after the record
    assert events.index(("capture", 900)) > events.index(("export", 1000))
    assert used() == 0 and not (work / "size-1000/captured").exists()
    assert dtypes == ["bf16", "bf16"]  # capture is given --dtype


def test_a_resumed_capture_counts_what_it_wrote_and_a_complete_one_needs_no_disk(
        tmp_path, monkeypatch):
    """A capture killed after 600 of its 1,000 bytes, alone on a disk with 900 free: it
    needs only the 400 it has still to write (the full estimate against a disk that its own
    shards fill would fail). A capture with nothing left to write takes no disk; a draft
    exported before a kill that lost its record is not captured again."""
    a, book, work, events, dtypes, used = _disk(tmp_path, monkeypatch, 1500, {},
                                                capture_dtype="fp8", exec_args="--cuda-graph")
    captured = work / "size-1000/captured"
    captured.mkdir(parents=True)
    (captured / "part.bin").write_bytes(b"x" * 600)
    (work / "size-1000/subset.txt").write_text("fp  capture=fp8")  # the mark before session 47
    results = {}
    _start(a, book, 1000, results).join(30)
    assert results == {1000: "d1000"} and used() == 0
    assert dtypes == ["fp8", "--cuda-graph"]  # capture's --dtype; train's --exec-args
    assert book.state["sizes"]["1000"]["exec_args"] == "--cuda-graph"
    with scale.disk_for(5, work / "size-5/captured", 0, 0.0):
        assert not scale._CAPTURING
    # trained, then killed before its record was written (its captures deleted after)
    book.state["sizes"].clear()
    events.clear()
    _start(a, book, 1000, results).join(30)
    assert results == {1000: "d1000"} and ("capture", 1000) not in events
    # recorded, then killed before its captures were deleted (kept here): the next call
    # deletes them and measures the evals it lacks, without training or capturing again
    a.keep_captures = True
    _start(a, book, 700, results).join(30)
    assert results[700] == "d700" and used() == 700
    a.keep_captures = False
    del book.state["sizes"]["700"]["evals"]["heldout"]
    events.clear()
    _start(a, book, 700, results).join(30)
    assert events == [("eval", 700)] and used() == 0
    # a size done before whose captures an earlier --keep-captures run kept: deleted too
    a.keep_captures = True
    book.state["sizes"].clear()
    _start(a, book, 600, results).join(30)
    assert used() == 600
    a.keep_captures = False
    events.clear()
    _start(a, book, 600, results).join(30)
    assert events == [] and used() == 0


def test_a_capture_that_no_size_will_free_disk_for_fails_at_once(tmp_path, monkeypatch):
    """Beside a size whose training failed (its captures kept, to resume), or with
    --keep-captures, waiting cannot help: the size fails at once with what it needs, not
    after --disk-wait, and before writing anything."""
    gates = {("train", 1000): "fail"}
    a, book, work, events, dtypes, used = _disk(tmp_path, monkeypatch, 1500, gates,
                                                disk_wait=600.0)
    results = {}
    _start(a, book, 1000, results).join(30)
    assert isinstance(results[1000], SystemExit) and used() == 1000  # kept
    begin = time.monotonic()
    _start(a, book, 900, results).join(30)
    assert time.monotonic() - begin < 5 and ("capture", 900) not in events
    assert str(results[900]).startswith("size 900: its capture needs ~0.0 GB and 0.0 GB are "
                                        "free and no size beside it will free any")
    a.keep_captures = True
    _start(a, book, 400, results).join(30)
    assert results[400] == "d400" and used() == 1400  # kept
    _start(a, book, 200, results).join(30)
    assert "no size beside it will free any" in str(results[200])
    assert ("capture", 200) not in events and time.monotonic() - begin < 10


def test_sizes_that_all_wait_for_the_disk_fail_at_once(tmp_path, monkeypatch):
    """Two captures that each need more than the disk has, neither writing: each would wait
    for the other to free disk, which it never will. Both fail at once, not after
    --disk-wait."""
    a, book, work, events, dtypes, used = _disk(tmp_path, monkeypatch, 500, {},
                                                disk_wait=600.0)
    results = {}
    begin = time.monotonic()
    threads = [_start(a, book, n, results) for n in (1000, 900)]
    for t in threads:
        t.join(30)
    assert time.monotonic() - begin < 10 and not any(e[0] == "capture" for e in events)
    assert all("no size beside it will free any" in str(results[n]) for n in (1000, 900))


def test_the_disk_a_capture_needs_is_capture_s_own_bytes_per_token(llama_dir):
    import transformers

    hidden = transformers.AutoConfig.from_pretrained(llama_dir).hidden_size
    per_token = 3 * hidden * 2 + hidden * 2 + 4 + 4 + 1  # aux, final, top-1, id, loss mask
    assert scale.capture_bytes(str(llama_dir), 1000) == int(1000 * per_token * 1.02) + 2**30
    fp8 = per_token - 3 * hidden + 3 * 4  # one byte per aux value, a float32 scale per row
    assert scale.capture_bytes(str(llama_dir), 1000, "fp8") == int(1000 * fp8 * 1.02) + 2**30


def _lever_steps(events: list, gates: dict):
    """`run` for --levers: the shared steps in WORK/levers-N, each variant's in its own
    folder below; a step whose output is complete is skipped as real_model.run does. A
    training waits on gates["train"] (a barrier) and fails for the variant in gates["fail"]."""
    def fake_run(step, *args, log, out):
        if scale.done_before(out):
            return 0.0
        variant = out.parent.name if step in ("train", "export", "eval") else None
        events.append((step, variant, [str(x) for x in args]))
        out.mkdir(parents=True, exist_ok=True)
        if step == "prepare":
            (out / "eyas.json").write_text(json.dumps(
                {"stats": {"tokens": 40, "kept": 4, "train": 4}}))
        elif step in ("capture", "vocab"):
            (out / "shard.bin").write_bytes(b"x" * 40)
            (out / "eyas.json").write_text("{}")
        elif step == "train":
            if "train" in gates:
                gates["train"].wait()
            if gates.get("fail") == variant:
                raise SystemExit("eyas train failed (rc 1)")
            (out / "eyas.json").write_text(json.dumps({"config": {"epochs": 1}, "steps": 1}))
            (out / "metrics.jsonl").write_text("".join(json.dumps(  # the first: warm-up
                {"kind": "train", "tokens_per_s": x}) + "\n" for x in (1.0, 5.0)))
        elif step == "export":
            (out / "eyas.json").write_text(json.dumps({"id": f"{variant}-{len(events)}"}))
        elif step == "eval":
            res = [{"method": "eagle3", "k": k, "mean_acceptance_length":
                    2.5 if variant == "epochs2" else 2.0} for k in (3, 6)]
            (out / "report.json").write_text(json.dumps({"num_prompts": 1, "results": res}))
        return 1.0
    return fake_run


def test_levers_share_one_capture_train_side_by_side_and_resume(tmp_path, monkeypatch,
                                                                capsys):
    """--levers: three variants of the recipe at size 4 from one prepare and one capture,
    trained at once, each with its own flags on top of the recipe, measured by the lever
    evals and tabled against the control; the captures stay while a training has failed,
    and the next call trains only that variant and deletes them; a variant asked with other
    flags is measured again, one not asked any more stays in the JSON."""
    data, corpus = _regenerated(tmp_path, 6)
    events = []
    gates = {"train": threading.Barrier(3, timeout=30), "fail": "lr2"}
    monkeypatch.setattr(scale, "run", _lever_steps(events, gates))
    monkeypatch.setattr(scale, "capture_bytes", lambda target, tokens, dtype: tokens)
    out, work = tmp_path / "res/scale.json", tmp_path / "work"
    argv = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus), "--work",
            str(work), "--out", str(out), "--sizes", "", "--bench", "", "--t1-bench", "",
            "--lever-sizes", "4", "--levers", "default=;epochs2=--epochs=2;lr2=--lr 2e-3"]
    with pytest.raises(SystemExit, match="lr2: eyas train failed"):
        scale.main(argv)
    steps = [(s, v) for s, v, _ in events]
    assert steps.count(("prepare", None)) == 1 and steps.count(("capture", None)) == 1
    trains = {v: args for s, v, args in events if s == "train"}
    assert set(trains) == {"default", "epochs2", "lr2"}  # all three met at the barrier
    assert "--epochs=2" in trains["epochs2"] and trains["lr2"][-2:] == ["--lr", "2e-3"]
    assert not any(x.startswith("--epochs") or x == "--lr" for x in trains["default"])
    assert all(args[args.index("--data") + 1] == str(work / "levers-4/captured")
               for args in trains.values())
    saved = json.loads(out.read_text())
    variants = saved["levers"]["4"]["variants"]
    assert set(variants) == {"default", "epochs2"} and saved["sizes"] == {}
    assert set(variants["epochs2"]["evals"]) == {"indist", "heldout"}
    assert variants["epochs2"]["flags"] == ["--epochs=2"]
    assert (work / "levers-4/captured").is_dir()  # lr2's training failed: kept to resume
    table = out.with_suffix(".md").read_text()
    assert "Levers at 4 conversations" in table
    assert "| epochs2 | --epochs=2 | 5 | 1.0 | - | 2.500 | 2.500 | 2.500 | 2.500 | +25.0 % |" \
        in table

    events.clear()
    gates.clear()
    state = scale.main(argv)
    assert [(s, v) for s, v, _ in events if s in ("capture", "train")] == [("train", "lr2")]
    assert [v for s, v, _ in events if s == "eval"] == ["lr2", "lr2"]
    assert set(state["levers"]["4"]["variants"]) == {"default", "epochs2", "lr2"}
    assert not (work / "levers-4/captured").exists()  # every variant trained: freed

    events.clear()
    scale.main([*argv[:-1], "epochs2=--epochs=3"])
    assert [v for s, v, _ in events if s == "train"] == ["epochs2"]
    assert steps.count(("capture", None)) == 1 and ("capture", None) in \
        [(s, v) for s, v, _ in events]  # captured again: the shards were gone
    state = json.loads(out.read_text())
    assert state["levers"]["4"]["variants"]["epochs2"]["flags"] == ["--epochs=3"]
    assert set(state["levers"]["4"]["variants"]) == {"default", "epochs2", "lr2"}
    # each variant's record holds the recipe its flags resolved to, eyas train's defaults
    # filling the rest; when those defaults move, the same flags are another recipe: every
    # variant is trained again, its run folder not resumed
    from eyas.draft import train_config

    variants = state["levers"]["4"]["variants"]
    assert variants["epochs2"]["recipe"]["epochs"] == 3 and variants["lr2"]["recipe"]["lr"] == \
        2e-3 and variants["default"]["recipe"]["loss_mask_at"] == "all"
    (work / "levers-4/default/run/left-by-the-old-recipe").write_text("x")
    monkeypatch.setitem(train_config.EAGLE3_RECIPE, "loss_mask_at", "input")
    events.clear()
    capsys.readouterr()
    state = scale.main([*argv[:-1], "default=;epochs2=--epochs=3;lr2=--lr 2e-3"])
    assert sorted(v for s, v, _ in events if s == "train") == ["default", "epochs2", "lr2"]
    assert "lever lr2: recorded under another recipe (loss_mask_at 'all' -> 'input')" in \
        capsys.readouterr().out
    assert not (work / "levers-4/default/run/left-by-the-old-recipe").exists()
    assert state["levers"]["4"]["variants"]["default"]["recipe"]["loss_mask_at"] == "input"


def test_levers_outlive_train_args_written_otherwise_and_each_is_judged_by_its_recipe(
        tmp_path, monkeypatch, capsys):
    """--train-args written otherwise to the same effect retrain no variant; a change of
    effect retrains only the variants whose own recipe it changes (here not the one whose
    flags set that option themselves); a variant recorded before recipes were recorded is
    judged by its flags on the old --train-args."""
    data, corpus = _regenerated(tmp_path, 6)
    events = []
    monkeypatch.setattr(scale, "run", _lever_steps(events, {}))
    monkeypatch.setattr(scale, "capture_bytes", lambda target, tokens, dtype: tokens)
    out, work = tmp_path / "res/scale.json", tmp_path / "work"
    argv = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus), "--work",
            str(work), "--out", str(out), "--sizes", "", "--bench", "", "--t1-bench", "",
            "--lever-sizes", "4", "--levers", "default=;epochs2=--epochs=2;lr2=--lr 2e-3"]
    scale.main([*argv, "--train-args", "--epochs 5 --lr=1e-3"])
    assert sorted(v for s, v, _ in events if s == "train") == ["default", "epochs2", "lr2"]
    # lr2 as a record from before recipes were recorded (BEFORE_RECIPES: --loss-mask-at input)
    state = json.loads(out.read_text())
    del state["levers"]["4"]["variants"]["lr2"]["recipe"]
    out.write_text(json.dumps(state))

    events.clear()
    capsys.readouterr()
    state = scale.main([*argv, "--train-args", "--lr 1e-3 --epochs=5"])
    said = capsys.readouterr().out
    # lr2's pinned recipe is its flags on "--epochs 5 --lr=1e-3" less BEFORE_RECIPES' change
    assert "lever lr2: recorded under another recipe (loss_mask_at 'input' -> 'all')," in said
    assert "lever default:" not in said and "lever epochs2:" not in said
    assert not [v for s, v, _ in events if s == "train" and v != "lr2"]
    levers = state["levers"]["4"]
    assert levers["train_args"] == "--lr 1e-3 --epochs=5"
    assert levers["variants"]["lr2"]["recipe"]["loss_mask_at"] == "all" and \
        levers["variants"]["lr2"]["recipe"]["epochs"] == 5

    events.clear()
    capsys.readouterr()
    state = scale.main([*argv, "--train-args", "--epochs 7 --lr 1e-3"])
    assert sorted(v for s, v, _ in events if s == "train") == ["default", "lr2"]
    said = capsys.readouterr().out
    assert "lever default: recorded under another recipe (epochs 5 -> 7)" in said
    assert "lever lr2: recorded under another recipe (" in said and "epochs 5 -> 7" in said
    variants = state["levers"]["4"]["variants"]
    assert variants["epochs2"]["recipe"]["epochs"] == 2 and variants["default"]["recipe"][
        "epochs"] == 7 and variants["lr2"]["recipe"]["loss_mask_at"] == "all"


def test_lever_evals_keep_their_prompts_and_the_table_pairs_them(tmp_path, monkeypatch):
    """Each eval's per-prompt counts of the draft go beside the JSON (OUT-prompts/, named in
    its record), and the table gives each variant's change against the control paired
    prompt by prompt, with an interval: here one variant accepts one more token on every
    second prompt, on prompts listed in another order than the control's."""
    from eyas.serve.eval_report import paired_change_ci

    data, corpus = _regenerated(tmp_path, 6)
    events = []
    steps = _lever_steps(events, {})
    ids = [f"heldout/t/{i}" for i in range(10)]

    def run(step, *args, log, out):
        took = steps(step, *args, log=log, out=out)
        if step == "eval" and out.is_dir():
            better = out.parent.name == "more"
            rows = [[i, 10, [3 + (better and n % 2), 1]] for n, i in enumerate(ids)]
            report = json.loads((out / "report.json").read_text())
            report.update(primary="eagle3", per_prompt={
                "eagle3 k=3": rows[::-1] if better else rows, "ngram k=3": rows})
            (out / "report.json").write_text(json.dumps(report))
        return took

    monkeypatch.setattr(scale, "run", run)
    monkeypatch.setattr(scale, "capture_bytes", lambda target, tokens, dtype: tokens)
    out, work = tmp_path / "res/scale.json", tmp_path / "work"
    state = scale.main(["--target", "t", "--data", str(data), "--corpus-dir", str(corpus),
                        "--work", str(work), "--out", str(out), "--sizes", "", "--bench", "",
                        "--t1-bench", "", "--lever-sizes", "4", "--lever-evals", "heldout",
                        "--levers", "default=;more=--epochs=2"])
    variants = state["levers"]["4"]["variants"]
    for name in ("default", "more"):
        file = variants[name]["evals"]["heldout"]["per_prompt_file"]
        assert file == f"scale-prompts/levers-4-{name}-heldout.json"
        kept = json.loads((tmp_path / "res" / file).read_text())
        assert kept["draft_id"] == variants[name]["train"]["draft_id"] and set(kept) == \
            {"draft_id", "per_prompt"}
        assert set(kept["per_prompt"]) == {"3"} and len(kept["per_prompt"]["3"]) == 10  # the
        # draft's rows only
    want = paired_change_ci([(10, [4 + n % 2]) for n in range(10)], [(10, [4])] * 10)
    assert want["change"] == pytest.approx(1.45 / 1.4 - 1, abs=1e-5)  # AL 1.45 against 1.4
    assert want["ci95"][0] > 0
    line = f"- more against default, paired prompt by prompt: k=3 +3.6 % " \
           f"[{100 * want['ci95'][0]:+.1f}, {100 * want['ci95'][1]:+.1f}] over 10 prompts"
    assert line in out.with_suffix(".md").read_text().splitlines()

    from scale_report import paired_changes
    base, ctl, more = tmp_path / "res", variants["default"], variants["more"]
    assert set(paired_changes(ctl, more, base)) == {"3"}
    as_t1 = [{**v, "evals": {"bench-t1": v["evals"]["heldout"]}} for v in (ctl, more)]
    assert paired_changes(*as_t1, base) == {}  # sampled: not the same text, not paired
    rec = more["evals"]["heldout"]
    with pytest.raises(ValueError, match="measure it again"):  # a file of another draft
        paired_changes(ctl, {**more, "evals": {"heldout": {**rec, "draft_id": "x"}}}, base)
    (base / "none.json").write_text(json.dumps(  # nothing drafted: no change, no crash
        {"draft_id": rec["draft_id"], "per_prompt": {"3": [[i, 0, 0] for i in ids]}}))
    assert paired_changes(ctl, {**more, "evals": {"heldout": {
        **rec, "per_prompt_file": "none.json"}}}, base) == {}
    # a lever beside a size trained before, with no `default` of its own: paired against
    # the curve's point (its record and per-prompt files are those of a size)
    from scale_report import markdown

    beside = {**state, "sizes": {"4": ctl}, "levers": {"4": {
        **state["levers"]["4"], "variants": {"more": more}}}}
    text = markdown(beside, base).splitlines()
    assert line.replace("against default", "against the curve point") in text


def test_levers_are_parsed_and_refused_when_malformed(tmp_path):
    data, corpus = _regenerated(tmp_path, 6)
    argv = ["--target", "t", "--data", str(data), "--corpus-dir", str(corpus), "--work",
            str(tmp_path / "w"), "--out", str(tmp_path / "o.json"), "--sizes", ""]
    for bad in (["--levers", "a=--lr=1"],  # without --lever-sizes
                ["--lever-sizes", "4", "--levers", "--epochs 2"],  # no name
                ["--lever-sizes", "4", "--levers", "a=;a=--epochs=2"],  # named twice
                ["--lever-sizes", "4", "--levers", "a=", "--lever-evals", "served"]):
        with pytest.raises(SystemExit):
            scale.main([*argv, *bad])
    import argparse
    assert scale.parse_levers(argparse.ArgumentParser(), " x=; y.2=--ttt-steps 5 ;") == \
        {"x": [], "y.2": ["--ttt-steps", "5"]}


def test_a_failed_step_prints_its_own_last_log_lines(tmp_path, capsys):
    """A lease brings back the runner's output, not the work folder: a step that fails
    prints its log's last lines (its own, not an earlier step's in the same log) with the
    error."""
    from real_model import run

    log = tmp_path / "log.txt"
    log.write_text("$ an earlier step\nearlier step's line\n")
    with pytest.raises(SystemExit, match="eyas train failed"):
        run("train", "--data", tmp_path / "no-such-capture", "--out", tmp_path / "run",
            log=log, out=tmp_path / "run")
    printed = capsys.readouterr().out
    assert "the last lines of" in printed and "no-such-capture" in printed
    assert "earlier step's line" not in printed


@pytest.mark.parametrize("fault", [
    "torch.AcceleratorError: CUDA error: unspecified launch failure",
    "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( "
    "handle, opa, opb, m, n, k, &falpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, ...)`"])
def test_a_training_that_dies_on_a_cuda_fault_runs_once_more(tmp_path, monkeypatch, capsys,
                                                            fault):
    """A CUDA fault (three H200 trainings died so, inside torch's flex-attention mask code, and
    one in torch's Muon, in a cuBLAS GEMM) poisons the process: eyas train is run once more,
    where it resumes from its last checkpoint. Other failures are not retried, nor is a second
    fault. The first process's fault is stood in for (a CPU has no CUDA to fault); the second
    is the real eyas train."""
    import subprocess
    import real_model

    real, calls, faults = subprocess.run, [], [1]

    def faulting_first(cmd, stdout, **kw):
        calls.append(cmd)
        if faults and faults.pop():
            stdout.write(fault + "\n")
            return subprocess.CompletedProcess(cmd, 1)
        return real(cmd, stdout=stdout, **kw)

    monkeypatch.setattr(real_model.subprocess, "run", faulting_first)
    log, args = tmp_path / "log.txt", ("--data", tmp_path / "no-such-capture")
    with pytest.raises(SystemExit, match="eyas train failed"):
        real_model.run("train", *args, "--out", tmp_path / "run", log=log, out=tmp_path / "run")
    printed = capsys.readouterr().out
    assert len(calls) == 2 and "run again, from its last checkpoint" in printed
    assert "no-such-capture" in printed.split("run again")[1]  # the real second run's error

    calls.clear()  # not a CUDA fault: one run
    with pytest.raises(SystemExit, match="eyas train failed"):
        real_model.run("train", *args, "--out", tmp_path / "run2", log=log, out=tmp_path / "run2")
    assert len(calls) == 1
    calls.clear()  # a fault in another step: one run
    with pytest.raises(SystemExit, match="eyas capture failed"):
        real_model.run("capture", *args, log=log, out=tmp_path / "cap")
    assert len(calls) == 1
    calls.clear()  # a second fault in a row: not a third run
    faults[:] = [1, 1]
    with pytest.raises(SystemExit, match="eyas train failed"):
        real_model.run("train", *args, "--out", tmp_path / "run3", log=log, out=tmp_path / "run3")
    assert len(calls) == 2 and not faults


def test_levers_table_compares_each_variant_on_the_cells_it_has():
    """A variant measured on fewer prompt sets than the control is compared with the
    control's values on those sets only (session 20's table first said +12.2 % for a draft
    below the control on both of its cells: its in-distribution mean against the control's
    mean over every set). The committed JSON of the 12 K levers is the input."""
    from scale_report import markdown

    root = Path(__file__).parent.parent
    state = json.loads((root / "benchmarks/results/scale-smollm2.json").read_text())
    rows = {r.split(" | ")[0].strip("| "): r.split(" | ")[-1].strip(" |")
            for r in markdown(state).splitlines() if r.startswith("| ")}
    ctl = state["levers"]["12000"]["variants"]["default"]["evals"]["indist"]["sets"]["indist"]
    bt = state["levers"]["12000"]["variants"]["bt16k"]["evals"]["indist"]["sets"]["indist"]
    want = sum(bt["eagle3"].values()) / sum(ctl["eagle3"].values()) - 1
    assert want < 0 and rows["bt16k"] == f"{100 * want:+.1f} %" == "-2.5 %"
    assert rows["default"] == "+0.0 %" and rows["lr2e-3"] == "-"


def test_a_json_of_levers_alone_has_their_table_and_no_empty_curve():
    """The corpus order's JSON as sessions 45-49 left it held levers and no size: its report
    is the levers' table (control first, the variant's change against it), with no curve
    table of blank rows before it. With session 50's size the curve's table comes first."""
    from scale_report import markdown

    root = Path(__file__).parent.parent
    state = json.loads((root / "benchmarks/results/scale-smollm2-corpus.json").read_text())
    assert state["sizes"] and state["levers"]
    whole = markdown(state)
    assert whole.startswith("| conversations |") and "\n| 45,742 |" in whole
    assert "Levers at 3,000 conversations" in whole
    state["sizes"] = {}
    text = markdown(state)
    assert text.startswith("Levers at 3,000 conversations") and "| conversations |" not in text
    rows = [r for r in text.splitlines() if r.startswith("| ")]
    assert rows[1].startswith("| default |") and rows[1].endswith("| +0.0 % |")
    held = {n: v["evals"]["heldout"]["sets"]["heldout"]["eagle3"]
            for n, v in state["levers"]["3000"]["variants"].items()}
    want = sum(held["allpos"].values()) / sum(held["default"].values()) - 1
    assert rows[2].startswith("| allpos |") and rows[2].endswith(f"| {100 * want:+.1f} % |")


def test_the_curve_and_the_whole_corpus_on_one_plot(tmp_path):
    """scale_report.py --plot: the committed curve (3-24 K) and the whole corpus's point on
    one plot per k, each JSON's sizes its own series; without --plot, each JSON's table."""
    import scale_report

    res = Path(__file__).parent.parent / "benchmarks/results"
    states = [(n, json.loads((res / f).read_text())) for n, f in (
        ("curve", "scale-smollm2.json"), ("corpus", "scale-smollm2-corpus.json"))]
    pts = scale_report.curve_points(states, "3", ["mt-bench", "gsm8k"])
    assert [n for n, _ in pts["curve"]["mt-bench"]] == [3000, 6000, 12000, 24000]
    assert pts["curve"]["mt-bench"][-1][1] == pytest.approx(2.432, abs=5e-4)
    assert [(n, round(al, 3)) for n, al in pts["corpus"]["mt-bench"]] == [(45742, 2.542)]
    scale_report.main(["--plot", str(tmp_path / "all"), f"the curve={res / 'scale-smollm2.json'}",
                       str(res / "scale-smollm2-corpus.json")])
    for k in ("3", "6"):
        assert (tmp_path / f"all-k{k}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.md"))  # --plot writes no tables
    (tmp_path / "c.json").write_text((res / "scale-smollm2-corpus.json").read_text())
    scale_report.main([str(tmp_path / "c.json")])
    assert "| 45,742 |" in (tmp_path / "c.md").read_text()


def test_ngram_steps_adds_tokens_per_step_from_a_real_ngram_eval(llama_dir, tmp_path):
    """benchmarks/ngram_steps.py: an n-gram-only eyas eval's tokens per step go into a curve
    JSON's n-gram record made before they were reported, after its settings and AL are
    checked; a report of other settings or other outputs is refused."""
    import ngram_steps
    from eyas.evaluate import EvalConfig, evaluate
    from eyas.targets.corpus import synthetic_chats

    chats = tmp_path / "p.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(4, seed=1)))
    report = evaluate(EvalConfig(target=str(llama_dir), data=str(chats), out=str(tmp_path / "r"),
                                 k=(3, 6), num_prompts=4, max_new_tokens=12, dtype="float32",
                                 device="cpu"))
    ng = {str(k): report.result("ngram", k) for k in (3, 6)}
    settings = "k=3,6 prompts=4 bench_prompts=80 tokens=12 dtype=float32"
    state = {"benchmark": "scale", "target": "t", "k": "3,6", "sizes": {},
             "ngram": {"heldout": {"al": {k: r.mean_acceptance_length for k, r in ng.items()},
                                   "prompts": 4, "settings": settings}}}
    out = tmp_path / "res/scale.json"
    out.parent.mkdir()
    out.write_text(json.dumps(state))
    with pytest.raises(SystemExit, match="name its set"):
        ngram_steps.main([str(out), str(tmp_path / "r")])
    state = ngram_steps.main([str(out), f"heldout={tmp_path / 'r'}"])
    rec = state["ngram"]["heldout"]
    assert rec["tokens_per_step"] == {k: r.tokens_per_step for k, r in ng.items()}
    assert rec["tokens_per_step_run"]["device"] == "cpu"
    assert all(rec["tokens_per_step"][k] <= rec["al"][k] for k in ("3", "6"))
    assert "| n-gram, tokens per step |" in out.with_suffix(".md").read_text()
    # a report from before eyas eval wrote them: the same numbers from its counts
    saved = json.loads((tmp_path / "r/report.json").read_text())
    for r in saved["results"]:
        del r["tokens_per_step"]
    assert scale.per_set(saved, ["heldout"], False)["heldout"]["steps"]["ngram"] == \
        rec["tokens_per_step"]
    # another device's outputs beyond the tolerance, or another eval setting: refused
    state["ngram"]["heldout"]["al"]["3"] *= 1.1
    out.write_text(json.dumps(state))
    with pytest.raises(SystemExit, match="not the same outputs"):
        ngram_steps.main([str(out), f"heldout={tmp_path / 'r'}"])
    state["ngram"]["heldout"]["settings"] = settings.replace("tokens=12", "tokens=96")
    out.write_text(json.dumps(state))
    with pytest.raises(SystemExit, match="not the curve's"):
        ngram_steps.main([str(out), f"heldout={tmp_path / 'r'}"])
    # a sampled eval (T = 1, seeded) goes to the curve's SET-t1 record, and only there
    sampled = evaluate(EvalConfig(target=str(llama_dir), data=str(chats),
                                  out=str(tmp_path / "r1"), k=(3, 6), num_prompts=4,
                                  max_new_tokens=12, dtype="float32", device="cpu",
                                  temperature=1.0))
    ng1 = {str(k): sampled.result("ngram", k) for k in (3, 6)}
    state["ngram"] = {"heldout-t1": {"al": {k: r.mean_acceptance_length for k, r in ng1.items()},
                                     "prompts": 4, "settings": settings}}
    out.write_text(json.dumps(state))
    with pytest.raises(SystemExit, match="named SET-t1"):
        ngram_steps.main([str(out), f"heldout={tmp_path / 'r1'}"])
    state = ngram_steps.main([str(out), f"heldout-t1={tmp_path / 'r1'}"])
    assert state["ngram"]["heldout-t1"]["tokens_per_step"] == \
        {k: r.tokens_per_step for k, r in ng1.items()}
    # a report with one table per set (--bench's) at T = 1 names its sets SET-t1 itself
    one = json.loads((tmp_path / "r1/report.json").read_text())
    one["by_set"] = {"heldout": {"prompts": 4, "results": one["results"]},
                     "heldout/turn-1": {"prompts": 4, "results": one["results"]}}
    (tmp_path / "r1/report.json").write_text(json.dumps(one))
    del state["ngram"]["heldout-t1"]["tokens_per_step"]
    out.write_text(json.dumps(state))
    state = ngram_steps.main([str(out), str(tmp_path / "r1")])
    assert state["ngram"]["heldout-t1"]["tokens_per_step"] == \
        {k: r.tokens_per_step for k, r in ng1.items()}
