"""Where an eyas draft pays when vLLM serves it (issue 33): what one speculative step costs
on a target of a given shape, against a step without speculation, and so the acceptance
length a draft needs there to be faster at all (`eagle3_break_even_al` in the summary).

    python benchmarks/served_shape.py --tokenizer /tmp/w/smol-hf \
        --conversations /tmp/w/conversations-2000.jsonl --work /tmp/w/shape8b \
        --json benchmarks/results/served-8b-shape.json -- \
        --bench mt-bench --num-prompts 40 --batch1-prompts 10 --k 3,1,5 --batches 1,8,32 \
        --temperatures 0 --max-new-tokens 256 --max-minutes 8

Speed needs no trained weights: the target is a randomly initialised Llama of `--shape`
(Llama-3.1-8B's by default: 32 layers, hidden 4096, vocab 128 K) with `--tokenizer`'s
tokenizer, and its draft is made by eyas's own path for it (prepare `--rows` of
`--conversations`, capture, vocab, `--train-steps` steps of `eyas train`, export in bf16),
so it has the shape, vocab mapping and config that eyas gives any draft of that target.
Its acceptance is about 1 (a random target, a barely trained draft); what is measured is the
cost of a step, which does not depend on it: the draft runs k forwards and the target
verifies k + 1 tokens whatever is accepted. Then `benchmarks/served_speed.py` serves the
target without speculation and with the draft at each k, with the arguments after `--`
(`--ignore-eos` always: a random target's answers would end at random lengths; no n-gram by
default: random text has no repeats for it to find). A real draft of acceptance length AL
at that k would run at about AL / break-even AL times the speed without speculation.

`--shape tiny` (8 layers, hidden 64) with `--no-serve` runs the draft's making on a CPU:
tests/test_served_speed.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from capture import LLAMA_8B, TINY  # noqa: E402  (the shapes of the capture benchmark)
from capture_backends import make_llama8b, sh  # noqa: E402

# The two targets of issue 33 as Llama shapes (Qwen2's attention biases left out: three
# vectors per layer, nothing beside its matmuls), with the upstream models' tied 151,936-row
# embedding (their GGUFs carry an untied output matrix of the same shape: the same work per
# step), so that the target's step costs what theirs does
QWEN2_5_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                   max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=True)
QWEN2_5_15B = {**QWEN2_5_05B, "hidden_size": 1536, "intermediate_size": 8960,
               "num_hidden_layers": 28, "num_attention_heads": 12}
# tiny-128: head dim 32, which vLLM's CPU attention runs (tests/test_served_speed.py, -m vllm)
SHAPES = {"llama-8b": LLAMA_8B, "qwen2.5-0.5b": QWEN2_5_05B, "qwen2.5-1.5b": QWEN2_5_15B,
          "tiny": TINY, "tiny-128": {**TINY, "hidden_size": 128, "intermediate_size": 256}}


def make_draft(a, target: Path, work: Path, log: Path) -> tuple[Path, dict]:
    """eyas's path to a draft for `target`: the first --rows conversations prepared,
    captured, a draft vocab, --train-steps steps of eyas train, exported in bf16 (a later
    call in the same work folder reuses it: main, made.json)."""
    rows = [line for line in Path(a.conversations).read_text().splitlines() if line.strip()]
    data = work / "conversations.jsonl"
    data.write_text("\n".join(rows[:a.rows]) + "\n")
    eyas = [sys.executable, "-m", "eyas"]
    dtype = "fp32" if a.device == "cpu" else "bf16"
    device = ["--device", a.device] if a.device else []
    seconds = {
        "prepare": sh(eyas + ["prepare", "--target", target, "--data", data,
                              "--out", work / "prepared", "--eval-fraction", "0"], log),
        "capture": sh(eyas + ["capture", "--target", target, "--data", work / "prepared",
                              "--out", work / "captured", "--model-dtype", dtype,
                              *device], log),
        "vocab": sh(eyas + ["vocab", "--data", work / "prepared", "--out", work / "vocab"],
                    log),
        "train": sh(eyas + ["train", "--data", work / "captured", "--vocab", work / "vocab",
                            "--out", work / "run", "--max-steps", a.train_steps,
                            "--batch-tokens", a.batch_tokens, *device], log),
        "export": sh(eyas + ["export", "--checkpoint", work / "run", "--out", work / "draft",
                             "--dtype", "bf16"], log)}
    return work / "draft", {k: round(v, 1) for k, v in seconds.items()}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    p.add_argument("--tokenizer", required=True, help="a folder whose tokenizer the target gets")
    p.add_argument("--conversations", required=True,
                   help="a JSONL of conversations (eyas prepare's input) for the draft")
    p.add_argument("--rows", type=int, default=200, help="conversations the draft is made on")
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--device", default=None, help="cuda or cpu for capture and train "
                   "(default: theirs, cuda if present)")
    p.add_argument("--work", required=True)
    p.add_argument("--json", required=True, help="served_speed.py's result, with this run's")
    p.add_argument("--no-serve", action="store_true", help="make the target and draft only")
    a = p.parse_args(ours)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    target = work / "target"
    # made before in this work folder (a second runner's call): reused, not made again (each
    # eyas step would load its model only to find its output complete: ~70 s for a 0.5B)
    stamp, asked = work / "made.json", {"shape": a.shape, "tokenizer": a.tokenizer,
                                        "rows": a.rows, "train_steps": a.train_steps}
    before = json.loads(stamp.read_text()) if stamp.is_file() else {}
    if before.get("asked") == asked and (work / "draft/config.json").is_file():
        draft, made = work / "draft", {**before["seconds"], "reused": True}
    else:
        start = time.perf_counter()
        make_llama8b(target, a.tokenizer, SHAPES[a.shape])
        made = {"target": round(time.perf_counter() - start, 1)}
        draft, seconds = make_draft(a, target, work, log)
        made.update(seconds)
        stamp.write_text(json.dumps({"asked": asked, "seconds": made}) + "\n")
    record = {"shape": a.shape, "config": SHAPES[a.shape], "tokenizer": a.tokenizer,
              "draft_rows": a.rows, "train_steps": a.train_steps, "seconds_to_make": made,
              "draft_config": json.loads((draft / "config.json").read_text())}
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.no_serve:
        out.write_text(json.dumps(record, indent=1) + "\n")
        return record
    import served_speed

    extra = [x for x in serve if x != "--ignore-eos"]
    ngram = [] if "--ngram-k" in extra else ["--ngram-k", ""]
    result = served_speed.main(["--target", str(target), "--draft", str(draft), "--ignore-eos",
                                *ngram, *extra, "--json", str(out)])
    result["shape"] = record
    result["command"] = "python benchmarks/served_shape.py " + " ".join(argv)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(served_speed.markdown(result))
    return result


if __name__ == "__main__":  # vLLM starts its engine core in another process
    main()
