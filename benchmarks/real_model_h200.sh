#!/bin/bash
# The real-model measurements of docs/benchmarks.md on one lent H200, run in the background by
# the recipe there ("Running it on the lent H200"): expects /tmp/w/smol.gguf (the joined GGUF),
# /tmp/w/realdata (benchmarks/real_data.py output), /tmp/w/site (the carried wheels) and
# /tmp/w/repo (a copy of this checkout); writes /tmp/w/results, one file per stage as it ends.
set -u
W=/tmp/w
R=$W/results
mkdir -p "$R"
export PYTHONPATH=$W/site:$W/repo/src PYTHONUNBUFFERED=1
cd "$W/repo" || exit 1
stage() { echo "$(date +%T) $*" >> "$R/stages.txt"; }

stage "pipeline: regenerate, prepare, capture, vocab, train, export, eval x2"
python3 benchmarks/real_model.py --target $W/smol.gguf --data $W/realdata --work $W/run \
    --out "$R/real-smollm2.json" ${REAL_ARGS:---max-train 3000 --regen-tokens 160 \
    --regen-batch 1000 --eval-fraction 0.08 --epochs 8 --batch-tokens 16384 \
    --indist-prompts 240 --heldout-prompts 300 --eval-tokens 96 --k 3,6 --eval-batch 64} \
    > "$R/real_model.out" 2>&1
stage "pipeline rc $?"
grep -v "it/s\]" $W/run/log.txt > "$R/real_model_log.txt"
cp $W/run/run/metrics.jsonl "$R/metrics.jsonl" 2>/dev/null
for s in indist heldout; do cp $W/run/eval-$s/report.json "$R/eval-$s-report.json" 2>/dev/null; done

stage "eval benchmark: batch 1 vs 32"
timeout 480 python3 benchmarks/eval.py --target $W/smol.gguf --draft $W/run/draft \
    --data $W/realdata/heldout.jsonl --prompts 30 --new-tokens 96 --k 3,6 \
    --batch-sizes 32,1 --json "$R/eval-batched-h200.json" > "$R/eval_bench.out" 2>&1
stage "eval benchmark rc $?"

stage "regenerate benchmark: generate, padded, lookup"
timeout 420 python3 benchmarks/regenerate.py --target $W/smol.gguf \
    --data $W/realdata/heldout.jsonl --rows 512 --new-tokens 256 --batch-size 256 \
    --modes generate,padded,lookup --dtype float32 --json "$R/regenerate-h200.json" \
    > "$R/regen_bench.out" 2>&1
stage "regenerate benchmark rc $?"
stage "regenerate benchmark: continuous"
timeout 240 python3 benchmarks/regenerate.py --target $W/smol.gguf \
    --data $W/realdata/heldout.jsonl --rows 512 --new-tokens 256 --batch-size 256 \
    --modes continuous --dtype float32 --json "$R/regenerate-cb-h200.json" \
    > "$R/regen_cb_bench.out" 2>&1
stage "regenerate continuous rc $?"
stage done
