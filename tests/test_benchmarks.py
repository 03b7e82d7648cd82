"""The benchmark scripts still run (tiny shapes on CPU, `--smoke`): they import the library
the way a GPU run does, so a refactor that breaks them shows here, not on the GPU box."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ttt_benchmark_smoke(tmp_path):
    out = tmp_path / "ttt.json"
    _run("ttt.py", "--smoke", "--contexts", "64", "--precision", "bf16,fp8", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {(r["mask"], r["lm_head"], r["precision"]) for r in rows} == {
        (m, h, p) for m in ("ones", "60") for h in ("frozen", "trained") for p in ("bf16", "fp8")}
    assert all(r["tok_s"] > 0 and r["rows"][0] == 64 for r in rows)
    # the host's share of an iteration (on CPU the host does the work: close to all of it).
    # host_ms is the best of a few single iterations against ms/iter over many: on a busy
    # 2-core CI machine one stall can take a 10 ms iteration's single timing several times
    # over, so the bound leaves 200 ms for it (a host time in seconds still fails)
    assert all(0 < r["host_ms"] <= 3 * r["ms"] + 200 for r in rows)
    dense = [r for r in rows if "dense_loss" in r]  # frozen bf16 only, same loss as eyas
    assert len(dense) == 2 and all(abs(r["dense_loss"] - r["loss"]) < 1e-3 for r in dense)
    packed = tmp_path / "packed.json"
    _run("ttt.py", "--smoke", "--contexts", "64", "--precision", "bf16", "--masks", "ones",
         "--doc-tokens", "16", "--out", str(packed))
    assert all(r["doc_tokens"] == 16 for r in json.loads(packed.read_text())["rows"])


def test_train_benchmark_smoke(tmp_path):
    out = tmp_path / "train.json"
    _run("train.py", "--smoke", "--precision", "bf16,fp8", "--out", str(out),
         "--work-dir", str(tmp_path), "--profile", "--capture-dtype", "fp8")
    result = json.loads(out.read_text())
    runs = result["train"]
    assert [r["precision"] for r in runs] == ["bf16", "fp8"]
    assert all(r["tokens_per_s"] > 0 for r in runs)
    assert result["setup"]["capture_dtype"] == "fp8"
    prof = runs[0]["profile"]  # only the first run is profiled
    assert "profile" not in runs[1]
    assert prof["wall_s"] > 0 and any("Muon" in o["op"] or "aten::" in o["op"]
                                      for o in prof["host_ops"])


def test_multigpu_benchmark_capture_smoke(tmp_path):
    # device_map="auto" on the CPU: the 2-GPU script's capture part runs and compares
    out = tmp_path / "multigpu.json"
    _run("multigpu.py", "--smoke", "--parts", "capture", "--out", str(out),
         "--work-dir", str(tmp_path))
    capture = json.loads(out.read_text())["capture"]
    assert capture["compare"]["bitwise_equal"] is True
    assert [r["name"] for r in capture["runs"]] == ["single", "device-map-auto"]


@pytest.mark.slow
def test_multigpu_benchmark_train_smoke(tmp_path):
    # two gloo ranks on CPU: the 2-GPU script's train part runs and its comparisons hold
    # (slow: four torchrun launches; what it compares, DDP and FSDP2 against one process and
    # resume, make test checks in tests/test_train_dist.py)
    out = tmp_path / "multigpu.json"
    _run("multigpu.py", "--smoke", "--parts", "train", "--out", str(out),
         "--work-dir", str(tmp_path))
    runs = {r["name"]: r for r in json.loads(out.read_text())["train"]["runs"]}
    assert sorted(runs) == ["one", "two-ddp", "two-ddp-resumed", "two-fsdp"]
    assert [runs["one"]["ranks"], runs["two-fsdp"]["ranks"]] == [1, 2]
    for name in ("two-ddp", "two-fsdp"):
        assert runs[name]["max_rel_loss_diff_vs_one"] < 1e-4
        assert runs[name]["weights_rel_diff_vs_one"] < 1e-4
    assert runs["two-ddp-resumed"]["weights_rel_diff_vs_uninterrupted"] < 1e-4


def test_vllm_serve_memory_and_a_report_written_beside_it(tmp_path, monkeypatch):
    """benchmarks/vllm_serve.py beside running jobs: a KV cache size given to vLLM (so that
    its start-up memory profile is skipped), and the `eyas eval` report it sets beside vLLM's
    counters read once that eval, running at the same time, has written it."""
    import os
    import threading

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the script sets vLLM's variables
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import vllm_serve

    assert vllm_serve.memory_options(0.4, 0) == {"tensor_parallel_size": 1,
                                                 "gpu_memory_utilization": 0.4}
    assert vllm_serve.memory_options(0.2, 1.5)["kv_cache_memory_bytes"] == 3 * 2**29
    report = tmp_path / "eval-indist/report.json"
    assert vllm_serve.wait_for(None, 5) is None
    assert vllm_serve.wait_for(str(report), 0.05, poll=0.01) is None  # never written
    late = threading.Timer(0.2, lambda: (report.parent.mkdir(),
                                         report.write_text(json.dumps({"primary": "eagle3"}))))
    late.start()
    assert vllm_serve.wait_for(str(report), 30, poll=0.02) == {"primary": "eagle3"}
    late.join()


def test_weights_fingerprint_benchmark_smoke(tmp_path):
    out = tmp_path / "wfp.json"
    _run("weights_fingerprint.py", "--dir", str(tmp_path / "w"), "--files", "2", "--tensors",
         "40", "--kib", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["tensors"] == 80 and len(result["runs"]) == 4
    # every way of reading gives one fingerprint, and a real one
    assert len({r["fingerprint"] for r in result["runs"]}) == 1
    assert result["runs"][0]["fingerprint"] is not None


def _tiny_target_and_chats(tmp_path):
    """A tiny random Llama saved with its tokenizer, and `chat(i, answer)`: one JSONL row of
    a short user turn (with an assistant answer when `answer`), id chat/i."""
    import torch
    from transformers import LlamaForCausalLM

    from eyas.targets.tiny import save_tiny_tokenizer, tiny_config

    target = tmp_path / "tiny"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama")).save_pretrained(target)
    save_tiny_tokenizer(target)
    words = "the cat sat on a mat and then it ran off to see the dog by the red door".split()

    def chat(i: int, answer: bool) -> str:
        turn = [{"role": "user", "content": " ".join(words[i % 9: i % 9 + 6])}]
        if answer:
            turn.append({"role": "assistant", "content": " ".join(words[i % 5:][:10])})
        return json.dumps({"id": f"chat/{i}", "messages": turn}) + "\n"

    return target, chat


def test_real_model_trains_online_without_a_capture(tmp_path):
    """benchmarks/real_model.py --online, end to end on a tiny target: no capture folder is
    made, `eyas train` runs the target itself (its manifest says online) with the flags of
    --train-args, and the draft it exports is measured by both evals."""
    target, chat = _tiny_target_and_chats(tmp_path)
    data = tmp_path / "realdata"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(chat(i, False) for i in range(24)))
    (data / "heldout.jsonl").write_text("".join(chat(i, False) for i in range(40, 44)))
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text("".join(chat(i, True) for i in range(24)))
    work, out = tmp_path / "work", tmp_path / "real.json"
    _run("real_model.py", "--target", str(target), "--data", str(data), "--work", str(work),
         "--out", str(out), "--conversations", str(conversations), "--online",
         "--eval-fraction", "0.2", "--epochs", "1", "--batch-tokens", "256",
         "--indist-prompts", "2", "--heldout-prompts", "2", "--eval-tokens", "4", "--k", "2",
         "--eval-batch", "2", "--eval-args=--no-ngram", "--device", "cpu", "--eval-every", "3",
         "--train-args=--online-cache gpu --online-cache-dtype fp8")
    assert not (work / "captured").exists()
    run = json.loads((work / "run/eyas.json").read_text())
    assert run["config"]["online"] is True and run["config"]["data"] == str(work / "prepared")
    assert (run["config"]["online_cache"], run["config"]["online_cache_dtype"]) == ("gpu", "fp8")
    assert (run["config"]["eval_every"], run["config"]["save_every"]) == (3, 3)
    result = json.loads(out.read_text())
    assert result["seconds"]["capture"] == 0.0 and result["seconds"]["train"] > 0
    assert result["heldout"]["measured_al"]["2"] >= 1.0


def test_real_model_regenerate_only_tops_up_and_stops(tmp_path):
    """benchmarks/real_model.py --top-up --regenerate-only: the prompts the given conversations
    lack are answered by the target, the merged file goes to --keep-conversations, and nothing
    after regeneration runs (no prepared folder, no draft)."""
    import gzip

    target, chat = _tiny_target_and_chats(tmp_path)
    data = tmp_path / "realdata"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(chat(i, False) for i in range(12)))
    (data / "heldout.jsonl").write_text(chat(40, False))
    given = tmp_path / "conversations.jsonl"
    given.write_text("".join(chat(i, True) for i in range(9)))  # three prompts lack answers
    work, out, kept = tmp_path / "work", tmp_path / "real.json", tmp_path / "kept.jsonl.gz"
    _run("real_model.py", "--target", str(target), "--data", str(data), "--work", str(work),
         "--out", str(out), "--conversations", str(given), "--top-up", "--regenerate-only",
         "--keep-conversations", str(kept), "--regen-tokens", "4", "--regen-batch", "4",
         "--device", "cpu")
    rows = [json.loads(x) for x in gzip.open(kept, "rt")]
    assert sorted(r["id"] for r in rows) == sorted(f"chat/{i}" for i in range(12))
    regenerated = [json.loads(x) for x in (work / "regenerated/conversations.jsonl").open()]
    assert sorted(r["id"] for r in regenerated) == ["chat/10", "chat/11", "chat/9"]
    assert not (work / "prepared").exists() and not (work / "draft").exists()
    result = json.loads(out.read_text())
    assert result["regenerate_only"]["conversations_used"] == 12
    assert result["seconds"]["regenerate"] > 0


def test_eval_steps_sums_leave_the_ranges_gpu_annotations_out():
    """On a GPU each profiler range is also a CUDA user-annotation event of its key (session
    41's H200 run: its 0.0 host parts and 103 % busy GPU came from counting them): host parts
    are read from the CPU events, and the annotations add no GPU time."""
    from types import SimpleNamespace as E

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import eval_steps

    cpu, cuda = E(name="CPU"), E(name="CUDA")
    events = [
        E(key="target forward", device_type=cpu, cpu_time_total=20000.0,
          self_cpu_time_total=2000.0, self_device_time_total=0.0, is_user_annotation=False),
        E(key="target forward", device_type=cuda, cpu_time_total=0.0,
          self_cpu_time_total=0.0, self_device_time_total=160000.0, is_user_annotation=True),
        E(key="aten::_cudnn_attention_forward", device_type=cpu, cpu_time_total=9000.0,
          self_cpu_time_total=9000.0, self_device_time_total=0.0, is_user_annotation=False),
        E(key="flash_kernel", device_type=cuda, cpu_time_total=0.0, self_cpu_time_total=0.0,
          self_device_time_total=6000.0, is_user_annotation=False),
        E(key="gemm", device_type=cuda, cpu_time_total=0.0, self_cpu_time_total=0.0,
          self_device_time_total=4000.0, is_user_annotation=False)]
    host, gpu_us, top_host, top_gpu = eval_steps.summarize(events, steps=2)
    assert host == {"target forward": 10.0}
    assert gpu_us == 10000.0
    assert [e.key for e in top_gpu] == ["flash_kernel", "gemm",
                                        "aten::_cudnn_attention_forward"]
    assert top_host[0].key == "aten::_cudnn_attention_forward"


def test_eval_steps_benchmark_smoke(tmp_path):
    out = tmp_path / "steps.json"
    _run("eval_steps.py", "--smoke", "--k", "0,2", "--sdpa", "auto,torch", "--json", str(out))
    runs = json.loads(out.read_text())["runs"]
    assert [(r["k"], r["sdpa"], r["steps"]) for r in runs] == [
        (0, "auto", 6), (2, "auto", 6), (0, "torch", 6), (2, "torch", 6)]
    plain, eagle = runs[:2]
    # every part of a step was timed where it ran, and the parts fit in the step's wall time
    assert plain["host_ms_per_step"]["draft proposal"] == 0
    assert all(v > 0 for v in eagle["host_ms_per_step"].values())
    for r in (plain, eagle):
        assert 0 < r["host_ms_per_step"]["target forward"] < r["wall_ms_per_step"]
        assert sum(r["host_ms_per_step"].values()) <= r["wall_ms_per_step"] * 1.05
