#!/bin/bash
# The real-model measurements of docs/benchmarks.md on one lent H200, run in the background by
# the recipe there ("Running it on the lent H200"): expects /tmp/w/smol.gguf (the joined GGUF),
# /tmp/w/realdata (benchmarks/real_data.py output), /tmp/w/site (the carried wheels) and
# /tmp/w/repo (a copy of this checkout); writes /tmp/w/results, one file per stage as it ends.
# STAGES picks and orders the stages (most wanted first, so that a lease that ends early still
# leaves the first ones; default: pipeline dflash eval32 regen dflash5 recipe; also eval1, and
# ablation: the pipeline with ABLATION_VARIANTS trained beside it, issue 31; ABLATION_SPLITS:
# their evals, default indist,heldout, add bench for REAL_ARGS' --bench sets; ABLATION_AFTER=1:
# the variants only after the pipeline, for a peer that needs most of an 80 GiB card).
# Before them the GGUF is converted once (`eyas convert`, float32) and every stage reads the
# folder: no GGUF parse per load (docs/benchmarks.md, issue 22); the GGUF is the fallback.
# REAL_ARGS overrides real_model.py's settings, REGEN_ARGS and EVAL_ARGS the regenerate and
# eval benchmarks', RECIPE_VARIANTS the ablation's variants. Stage scale: the scaling curve of
# issue 31 (benchmarks/scale.py; SCALE_REGEN, SCALE_REGEN_ARGS, SCALE_ARGS, SCALE_DATA;
# docs/benchmarks.md, "The scaling curve"); stage scale-regen regenerates only, beside a scale
# instance started with SCALE_WAIT_REGEN=1. Stage vcapture: capture through vLLM against transformers (issue 32,
# benchmarks/capture_backends.py), on the pipeline's prepared rows and a random 8B target;
# stage vtests: only its vllm-marked capture tests. Stage scale-served: trained == served at
# the curve's size SERVE_SIZE (vLLM serves its draft once scale.py has exported it, beside the
# size's in-distribution eval). Stage train-speed: eyas train eager and under --cuda-graph,
# 400 steps each, on size SPEED_SIZE's captures while that size trains.
# Stage loader: benchmarks/loader.py on this host, SmolLM2's and Llama-8B's widths.
# Stage ngram-steps: n-gram-only evals of the curve's sets at its settings (NGRAM_SETS).
# Stage t1-sampling: greedy against probabilistic drafts at T = 1 (T1S_TEMPS) on a draft of
# 2,000 conversations.
# Stage served: issue 33's Qwen2.5-Coder draft and vLLM serving it three ways (QWEN_GGUF,
# SERVED_TRAIN, SERVED_DATA, SERVED_EPOCHS, SERVED_MINUTES, SERVED_CONVERSATIONS (comma list),
# SERVED_TOP_UP, SERVED_REGEN_ONLY (=1: stop once the conversations exist and went to
# results/: a lease that grows the corpus, then serves or trains), SERVED_ONLINE (=1: no
# capture, eyas train --online: a corpus whose fp8 capture the lease's ~55 GB of free disk
# cannot hold), SERVED_EVAL_EVERY (train's --eval-every and --save-every, default 200),
# SERVED_EVAL_ORDER, SERVED_EVALS_FIRST (e.g. bench: before the serving, not after),
# SERVED_DRAFT (an exported draft carried back from an earlier lease: served, no pipeline;
# SERVED_EVAL_REPORTS: its eval reports from that lease, with SERVED_EVALS_FIRST=none),
# SERVED_EVAL_K (eyas eval's k, for the served rows' eval AL), SERVED_EVAL_ARGS (more eyas eval
# flags, e.g. --no-ngram), SERVED_TRAIN_ARGS (more eyas train flags, e.g. "--online-cache gpu
# --online-cache-dtype fp8 --online-cache-gb 80"),
# SERVED_SOURCES_FIRST (the curve's prompts of these sources first: scale.py --sources-first),
# SERVED_BENCH (the standard sets evaluated and served, default mt-bench,humaneval; e.g.
# mt-bench alone where a lease is short), SERVED_SPEED_ARGS: more
# served_speed.py flags, e.g. "--ngram-methods ngram,ngram_gpu --runner v2"); stage
# served-shape: the cost of a speculative step on a random 8B-shaped target (SHAPE_K,
# SHAPE_BATCHES, SHAPE_MINUTES, SHAPE_RUNNERS: "v1 v2" serves it on each vLLM model runner,
# default auto, vLLM's choice; a word RUNNER:ATTENTION, e.g. "v2:fa3-nosplit", adds
# served_speed.py's --attention; SHAPE: llama-8b, or qwen2.5-0.5b / qwen2.5-1.5b, issue 33's
# targets' shapes). Stages that start vLLM read it from VSITE
# (/tmp/vsite). Several instances may run at once
# with different STAGES (the GGUF is converted once; each stage writes its own files in $R).
set -u
W=${W:-/tmp/w}  # W=another/folder for a dry run elsewhere
R=$W/results
mkdir -p "$R"
export PYTHONPATH=$W/site:$W/repo/src PYTHONUNBUFFERED=1
export EYAS_BENCH_CACHE=${EYAS_BENCH_CACHE:-$W/bench}  # the bench archives h200_lease.sh b copies
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1
cd "$W/repo" || exit 1
stage() { echo "$(date +%T) $*" >> "$R/stages.txt"; }
T=$W/smol-hf
exec 9> "$W/convert.lock"
flock 9  # instances started together: one converts, the others wait for it
if [ -f $T/eyas.json ]; then  # another instance of this script converted it
  rc=0
else
  stage "convert the GGUF to $T"
  python3 -m eyas convert --target $W/smol.gguf --out $T > "$R/convert.out" 2>&1
  rc=$?
  stage "convert rc $rc"
fi
flock -u 9
[ $rc = 0 ] || T=$W/smol.gguf
REAL_ARGS=${REAL_ARGS:---max-train 3000 --regen-tokens 160 --regen-batch 1000 \
    --eval-fraction 0.07 --epochs 20 --batch-tokens 16384 --indist-prompts 200 \
    --heldout-prompts 200 --eval-tokens 96 --k 3,6 --eval-batch 64}
# the ablation trains with the pipeline's settings and is measured on its held-out prompts,
# so the pipeline's own draft (eyas train's defaults) is its `default` row
REGEN_ARGS=${REGEN_ARGS:---rows 512 --new-tokens 256 --batch-size 256}
EVAL_ARGS=${EVAL_ARGS:---prompts 30 --new-tokens 96 --k 3,6}  # issue 22's sweep
arg() { echo "$REAL_ARGS" | tr -s ' ' '\n' | grep -A1 -- "^$1\$" | tail -1; }

for s in ${STAGES:-pipeline dflash eval32 regen dflash5 recipe}; do
  case $s in
  pipeline)
    stage "pipeline: regenerate, prepare, capture, vocab, train, export, eval x2"
    python3 benchmarks/real_model.py --target $T --data $W/realdata --work $W/run \
        --out "$R/real-smollm2.json" $REAL_ARGS > "$R/real_model.out" 2>&1
    stage "pipeline rc $?"
    grep -v "it/s\]" $W/run/log.txt > "$R/real_model_log.txt"
    cp $W/run/run/metrics.jsonl "$R/metrics.jsonl" 2>/dev/null
    for e in indist heldout; do
      cp $W/run/eval-$e/report.json "$R/eval-$e-report.json" 2>/dev/null
      cp $W/run/eval-$e/report.md "$R/eval-$e-report.md" 2>/dev/null
    done
    cp $W/run/prepared/eyas.json "$R/prepared-eyas.json" 2>/dev/null
    cp $W/run/regenerated/eyas.json "$R/regen-eyas.json" 2>/dev/null
    cp $W/run/eyas.json "$R/run-eyas.json" 2>/dev/null
    mkdir -p "$R/draft" && cp $W/run/draft/* "$R/draft/" 2>/dev/null ;;
  eval32|eval1)
    sizes=$([ $s = eval32 ] && echo 32 || echo 32,1)
    stage "eval benchmark: batch sizes $sizes"
    timeout 540 python3 benchmarks/eval.py --target $T --draft $W/run/draft \
        --data $W/realdata/heldout.jsonl $EVAL_ARGS --batch-sizes $sizes --json "$R/eval-batched-h200-$s.json" > "$R/eval_bench_$s.out" 2>&1
    stage "eval benchmark $s rc $?" ;;
  dflash|dflash5)
    # issue 25: a DFlash draft on the pipeline's own 3-tap capture (docs/dflash.md, "Reusing
    # an EAGLE-3 capture"; dflash5: a capture of DFlash's own 5-tap layout first), the same
    # epochs and batch as its EAGLE-3 draft, SpecForge's DFlash lr / warmup / clip, an unused
    # special token as the mask (SmolLM2 has none); measured on the pipeline's eval prompts.
    # Same epochs is more GPU time than EAGLE-3's if DFlash trains slower (on the CPU it ran at
    # half the tokens/s): its metrics.jsonl evals every 200 steps with elapsed_s, which gives
    # its simulated acceptance at EAGLE-3's training time too
    D=$W/run/$s
    CAP=$W/run/captured
    if [ $s = dflash5 ]; then
      CAP=$D/captured
      stage "$s: capture 5 taps"
      python3 -m eyas capture --target $T --data $W/run/prepared --out $CAP \
          --split all --model-dtype fp32 --dflash-taps 5 > "$R/${s}_capture.out" 2>&1
      stage "$s capture rc $?"
    fi
    stage "$s: train"
    timeout 900 python3 -m eyas train --draft dflash --data $CAP --out $D/run \
        --epochs $(arg --epochs) --batch-tokens $(arg --batch-tokens) --lr 6e-4 \
        --warmup-ratio 0.04 --grad-clip 1 --mask-token-id 16 --eval-every 200 \
        --save-every 200 > "$R/${s}_train.out" 2>&1
    stage "$s train rc $?"
    cp $D/run/metrics.jsonl "$R/$s-metrics.jsonl" 2>/dev/null
    python3 -m eyas export --checkpoint $D/run --out $D/draft > "$R/${s}_export.out" 2>&1
    stage "$s export rc $?"
    ev="--target $T --draft $D/draft --k 3,6,15 --max-new-tokens $(arg --eval-tokens) \
        --dtype float32 --batch-size $(arg --eval-batch) --no-ngram"
    timeout 600 python3 -m eyas eval $ev --data $W/realdata/heldout.jsonl \
        --num-prompts $(arg --heldout-prompts) --out $D/eval-heldout > "$R/${s}_eval.out" 2>&1
    stage "$s eval heldout rc $?"
    timeout 600 python3 -m eyas eval $ev --data $W/run/prepared --split eval \
        --num-prompts $(arg --indist-prompts) --out $D/eval-indist >> "$R/${s}_eval.out" 2>&1
    stage "$s eval indist rc $?"
    for e in indist heldout; do
      cp $D/eval-$e/report.json "$R/$s-eval-$e-report.json" 2>/dev/null
    done
    cp $D/draft/config.json "$R/$s-draft-config.json" 2>/dev/null ;;
  ablation)
    # issue 31: the pipeline (its own draft is the eagle3.1 row, with n-gram beside it) and,
    # as soon as its vocab is written, every ABLATION_VARIANTS variant side by side on the
    # same capture (a 135M target leaves most of the GPU idle); the regenerated
    # conversations come back gzipped, for later leases to carry instead of regenerating
    stage "ablation: pipeline, then the variants beside its training"
    python3 benchmarks/real_model.py --target $T --data $W/realdata --work $W/run \
        --out "$R/real-smollm2.json" $REAL_ARGS > "$R/real_model.out" 2>&1 &
    pipe=$!
    until [ -f $W/run/vocab/eyas.json ] || ! kill -0 $pipe 2>/dev/null; do sleep 5; done
    gzip -c $W/run/regenerated/conversations.jsonl > "$R/conversations.jsonl.gz" 2>/dev/null
    cp $W/run/regenerated/eyas.json "$R/regen-eyas.json" 2>/dev/null
    stage "ablation: vocab written, variants start"
    # the bench split measures REAL_ARGS' --bench sets (recipe.py's own defaults where not given)
    bench=()
    case ,${ABLATION_SPLITS:-}, in *,bench,*)
      [ -z "$(arg --bench)" ] || bench+=(--bench "$(arg --bench)")
      [ -z "$(arg --bench-prompts)" ] || bench+=(--bench-prompts "$(arg --bench-prompts)") ;;
    esac
    abl() {  # the variants (again: every finished step is skipped, only the records are read)
      python3 benchmarks/recipe.py --work $W/run --data $W/realdata --target $T \
          --variants ${ABLATION_VARIANTS:?name the variants} "$@" \
          ${ABLATION_INDIST:+--indist-for $ABLATION_INDIST} \
          --parallel ${ABLATION_PARALLEL:-16} --splits ${ABLATION_SPLITS:-indist,heldout} \
          "${bench[@]}" \
          --epochs $(arg --epochs) --batch-tokens $(arg --batch-tokens) --k $(arg --k) \
          --indist-prompts $(arg --indist-prompts) --heldout-prompts $(arg --heldout-prompts) \
          --eval-tokens $(arg --eval-tokens) --eval-batch $(arg --eval-batch) \
          --out "$R/ablation.json"
    }
    # ABLATION_AFTER=1: no variant beside the pipeline, all of them in the table pass (a peer
    # that needs most of an 80 GiB card, SpecForge's, ran out of memory beside the eval)
    if [ -z "${ABLATION_AFTER:-}" ]; then
      abl > "$R/ablation.out" 2>&1
      stage "ablation variants rc $?"
    fi
    wait $pipe
    stage "ablation pipeline rc $?"
    abl --baseline default >> "$R/ablation.out" 2>&1  # the pipeline's draft as the first row
    stage "ablation table rc $?"
    grep -v "it/s\]" $W/run/log.txt > "$R/real_model_log.txt"
    for e in indist heldout bench; do
      cp $W/run/eval-$e/report.json "$R/eval-$e-report.json" 2>/dev/null
    done
    cp $W/run/run/metrics.jsonl "$R/metrics.jsonl" 2>/dev/null
    for v in $W/run/recipe-*; do
      n=$(basename $v | tr '+' '_')
      cp $v/run/metrics.jsonl "$R/$n-metrics.jsonl" 2>/dev/null
      cp $v/log.txt "$R/$n-log.txt" 2>/dev/null
      cp $v/peer.json "$R/$n-peer.json" 2>/dev/null
      for e in $v/eval-*/report.json; do  # each eval's whole report (per-set tables, intervals)
        [ -f $e ] && cp $e "$R/$n-$(basename $(dirname $e))-report.json"
      done
    done ;;
  recipe)
    stage "recipe ablation"
    python3 benchmarks/recipe.py --work $W/run --data $W/realdata --target $T \
        --variants ${RECIPE_VARIANTS:-eagle3.1-lk,eagle3.1-ttt3,eagle3} --baseline default \
        --splits heldout --epochs $(arg --epochs) --batch-tokens $(arg --batch-tokens) \
        --k $(arg --k) --heldout-prompts $(arg --heldout-prompts) \
        --eval-tokens $(arg --eval-tokens) --eval-batch $(arg --eval-batch) \
        --out "$R/recipe-h200.json" > "$R/recipe.out" 2>&1
    stage "recipe rc $?"
    cp $W/run/recipe-log.txt "$R/recipe-log.txt" 2>/dev/null ;;
  scale)
    # issue 31 item 4: regenerate the next SCALE_REGEN prompts of the curve order (vLLM from
    # /tmp/vsite) into $W/corpus, then every size whose prefix has arrived and that the carried
    # $W/scale-smollm2.json lacks; the JSON, table, plots and the new part land in $R as they end
    # (SCALE_LEVERS: scale.py --levers, its sizes in SCALE_ARGS' --lever-sizes)
    # (SCALE_NAME: another JSON and log, for an instance that runs beside this one)
    # (SCALE_TRAIN_ARGS: scale.py --train-args, kept one word: a recipe of several flags)
    stage "scale: regenerate ${SCALE_REGEN:-0}, then the missing sizes"
    # the carried state, unless an instance beside this one already works on that JSON
    cp -n $W/${SCALE_NAME:-scale-smollm2}.json "$R/${SCALE_NAME:-scale-smollm2}.json" 2>/dev/null
    cp -rn $W/${SCALE_NAME:-scale-smollm2}-prompts "$R/" 2>/dev/null  # its per-prompt counts
    if [ -n "${SCALE_WAIT_REGEN:-}" ]; then
      # a scale-regen instance started first: its vLLM engine profiles GPU memory at start and
      # refuses to run if neighbours change theirs meanwhile, so wait until it says it is ready
      for _ in $(seq 60); do
        cat $W/scale/regen-p*/log.txt 2>/dev/null | grep -q "vLLM engine ready" && break
        sleep 5
      done
      stage "scale: the regeneration's vLLM engine is ready (or 300 s passed)"
    fi
    PYTHONPATH=$PYTHONPATH:${VSITE:-/tmp/vsite} python3 benchmarks/scale.py --target $T \
        --data ${SCALE_DATA:-$W/realdata} --corpus-dir $W/corpus --work $W/scale \
        --out "$R/${SCALE_NAME:-scale-smollm2}.json" --regenerate ${SCALE_REGEN:-0} \
        ${SCALE_REGEN_ARGS:+--regen-args "$SCALE_REGEN_ARGS"} ${SCALE_ARGS:-} \
        ${SCALE_LEVERS:+--levers "$SCALE_LEVERS"} \
        ${SCALE_TRAIN_ARGS:+--train-args="$SCALE_TRAIN_ARGS"} \
        >> "$R/${SCALE_NAME:-scale-smollm2}.out" 2>&1  # a second call appends
    stage "scale rc $?"
    cp $W/corpus/conversations-p*.jsonl.gz $W/corpus/conversations-p*-eyas.json \
        $W/corpus/rejects-p*.jsonl "$R/" 2>/dev/null ;;
  scale-regen)
    # issue 31 item 3: only regenerate the next SCALE_REGEN prompts of the curve order, beside
    # a `scale` instance (started with SCALE_WAIT_REGEN=1) that trains the sizes already here;
    # the JSON is left to that instance. Poll brings back the part, or what it has so far
    stage "scale-regen: ${SCALE_REGEN:-0} prompts"
    PYTHONPATH=$PYTHONPATH:${VSITE:-/tmp/vsite} python3 benchmarks/scale.py --target $T \
        --data ${SCALE_DATA:-$W/realdata} --corpus-dir $W/corpus --work $W/scale \
        --out "$R/scale-regen-unused.json" --sizes '' --regenerate ${SCALE_REGEN:-0} \
        ${SCALE_REGEN_ARGS:+--regen-args "$SCALE_REGEN_ARGS"} >> "$R/scale-regen.out" 2>&1
    stage "scale-regen rc $?"
    cp $W/corpus/conversations-p*.jsonl.gz $W/corpus/conversations-p*-eyas.json \
        $W/corpus/rejects-p*.jsonl "$R/" 2>/dev/null ;;
  vcapture)
    # issue 32: `eyas capture --backend vllm` against `--backend transformers` on the rows the
    # pipeline (or ablation) prepared, float32 (exactness and speed), then on a random
    # Llama-3.1-8B-shaped target in bf16 (speed; 400 of the same conversations), then the
    # vllm-marked capture tests on the GPU (CB_8B_ROWS=0: no 8B)
    # the pipeline's prepared rows when an instance beside this one makes them (it waits for
    # them), else its own from CB_DATA's conversations
    P=$W/run/prepared
    if [ -d $W/run ]; then
      until [ -f $P/eyas.json ]; do sleep 5; done
    else
      P=$W/cb-prepared
      [ -f $P/eyas.json ] || python3 -m eyas prepare --target $T \
          --data ${CB_DATA:-$W/conversations-2000.jsonl} --out $P > "$R/cb_prepare.out" 2>&1
      stage "vcapture: prepare rc $?"
    fi
    VP=$PYTHONPATH:${VSITE:-/tmp/vsite}
    stage "vcapture: SmolLM2, float32"
    PYTHONPATH=$VP timeout 900 python3 benchmarks/capture_backends.py --target $T \
        --prepared $P --work $W/cb-smol --model-dtype fp32 \
        --gpu-memory-utilization ${VLLM_MEMORY:-0.25} --kv-cache-gib ${VLLM_KV_GIB:-0} \
        --json "$R/capture-backends-smollm2.json" > "$R/cb_smol.out" 2>&1
    stage "vcapture SmolLM2 rc $?"
    [ "${CB_8B_ROWS:-400}" = 0 ] || {
    stage "vcapture: random Llama-3.1-8B shape, bf16"
    PYTHONPATH=$VP timeout 900 python3 benchmarks/capture_backends.py --llama8b \
        --data ${CB_DATA:-$W/conversations-2000.jsonl} --tokenizer $T --work $W/cb-8b \
        --model-dtype bf16 --limit ${CB_8B_ROWS:-400} \
        --gpu-memory-utilization ${VLLM_MEMORY:-0.25} --kv-cache-gib ${VLLM_KV_GIB:-0} \
        --json "$R/capture-backends-llama8b.json" > "$R/cb_8b.out" 2>&1
    stage "vcapture 8B rc $?"
    rm -rf $W/cb-8b/llama8b; }
    PYTHONPATH=$VP timeout 600 python3 -m pytest -q -m vllm -p no:cacheprovider \
        tests/test_capture_vllm.py > "$R/vllm_capture_tests.out" 2>&1
    stage "vcapture tests rc $?" ;;
  vtests)
    # the vllm-marked tests of VTESTS (default: vcapture's, ~75 s) on the GPU, e.g.
    # VTESTS="tests/test_export.py" for the exports built into vLLM's own model classes
    PYTHONPATH=$PYTHONPATH:${VSITE:-/tmp/vsite} timeout 600 python3 -m pytest -q -m vllm \
        -p no:cacheprovider ${VTESTS:-tests/test_capture_vllm.py} \
        > "$R/vllm_tests-$(date +%H%M%S).out" 2>&1
    stage "vtests rc $?" ;;
  scale-served)
    # issue 31: vLLM serves size SERVE_SIZE's draft on the in-distribution prompts its eval
    # measures (200, 96 new tokens, float32, k = 3 and 6), its own counters beside that eval's
    # report (and its interval and replay); started with the scale stage, it waits for the
    # export, and its KV cache has a size of its own (vLLM's start-up memory profile fails
    # beside the trainings and evals that take and free GPU memory). vLLM 0.24 still asks
    # that share of the GPU to be free at its start (utils.request_memory), even with a KV
    # cache size: 0.15 (21 GB), as the size's seven evals took up to 80 of the 143 GB
    D=$W/scale/size-${SERVE_SIZE:?name the size}
    stage "scale-served: waiting for $D/draft"
    for i in $(seq 360); do [ -f $D/draft/eyas.json ] && break; sleep 10; done
    PYTHONPATH=$PYTHONPATH:${VSITE:-/tmp/vsite} timeout 1500 python3 benchmarks/vllm_serve.py \
        --target $T --draft $D/draft --data ${SCALE_DATA:-$W/realdata}/indist.jsonl \
        --num-prompts 200 --max-new-tokens 96 --k 3,6 --dtype float32 --kv-cache-gib 8 \
        --gpu-memory-utilization 0.15 \
        --eyas-report $D/eval-indist/report.json --wait-report 900 \
        --json "$R/served-scale-$SERVE_SIZE.json" > "$R/served-scale-$SERVE_SIZE.out" 2>&1
    stage "scale-served rc $?" ;;
  train-speed)
    # how fast eyas train runs on this draft eagerly and under --cuda-graph (a change of
    # execution, not of recipe): 400 steps each on size SPEED_SIZE's captures, one after the
    # other, once that size's own training has started (so both share the GPU with it alike)
    D=$W/scale/size-${SPEED_SIZE:?name the size}
    stage "train-speed: waiting for $D's training"
    for i in $(seq 360); do [ -f $D/run/metrics.jsonl ] && break; sleep 10; done
    for mode in eager cuda-graph; do
      flag=$([ $mode = cuda-graph ] && echo --cuda-graph)
      timeout 600 python3 -m eyas train --data $D/captured --vocab $D/vocab \
          --out $W/speed-$mode --max-steps 400 --eval-every 100000 $flag \
          > "$R/train-speed-$mode.out" 2>&1
      stage "train-speed $mode rc $?"
      cp $W/speed-$mode/metrics.jsonl "$R/train-speed-$mode-metrics.jsonl" 2>/dev/null
    done ;;
  loader)
    # eyas train's data loader alone on this host (threads and, beside them, the worker
    # processes of before; fp8 dequantized on the GPU and on the host): SmolLM2's width and
    # Llama-8B's (benchmarks/loader.py, docs/benchmarks.md "The training data loader")
    for shape in smollm2-135m llama-8b; do
      tokens=300000; [ $shape = llama-8b ] && tokens=100000
      timeout 600 python3 benchmarks/loader.py --shape $shape --capture-tokens $tokens \
          --batches 60 --work-dir $W --out "$R/loader-$shape.json" > "$R/loader-$shape.out" 2>&1
      stage "loader $shape rc $?"
    done ;;
  served)
    # issue 33: the Qwen2.5-Coder target ($QWEN_GGUF, joined from its parts by h200_lease.sh
    # gpart), converted once; a draft by eyas train's default recipe on SERVED_TRAIN prompts
    # regenerated by the target through vLLM (or SERVED_CONVERSATIONS, a .jsonl.gz of an
    # earlier lease's, e.g. benchmarks/results/served-h200-s23/qwen-conversations.jsonl.gz
    # for the 0.5B); as soon as it is exported, vLLM serves the target three ways
    # (benchmarks/served_speed.py, alone on the GPU: SERVED_K, SERVED_BATCHES, SERVED_TEMPS,
    # SERVED_MINUTES), then eyas eval measures the draft on the same prompts (held out,
    # MT-bench, HumanEval; in distribution) and its reports are attached to the served rows.
    # Session 23's lease ran the evals first: 230 s for 100 prompts left 9 minutes to serve.
    # The evals whose reports go beside the served rows come first (SERVED_EVAL_ORDER)
    # (QWEN_GGUF=$W/qwen15.gguf: the 1.5B, from h200_carry.sh qwen15's parts r0..; each
    # GGUF converts into its own folder; SERVED_DATA=$W/scale-realdata with SERVED_TRAIN
    # above 5821: the scale corpus's prompts, the same held-out files; SERVED_TRAIN prompts
    # are the scaling curve's first, a seeded shuffle: both files are sorted by source)
    Q=$W/$(basename ${QWEN_GGUF:-$W/qwen.gguf} .gguf)-hf
    VP=$PYTHONPATH:${VSITE:-/tmp/vsite}
    served_bench=${SERVED_BENCH:-mt-bench,humaneval}  # the standard sets evaluated and served
    if [ ! -f $Q/eyas.json ]; then
      python3 -m eyas convert --target ${QWEN_GGUF:-$W/qwen.gguf} --out $Q \
          > "$R/qwen_convert.out" 2>&1
      rc=$?
      stage "served: convert rc $rc"
      [ $rc = 0 ] || continue
    fi
    conv=()
    if [ -n "${SERVED_CONVERSATIONS:-}" ]; then
      # (several, comma-separated: one file, e.g. session 26's mixed 8,000 and session 29's
      # 8,612 chat rows; an id in both keeps the first file's row)
      gunzip -c $(echo "$SERVED_CONVERSATIONS" | tr , ' ') > $W/qwen-conversations.jsonl || \
        continue
      # SERVED_DROP_SOURCES (e.g. bigbench): the carried rows of those sources left out, by the
      # id eyas regenerate writes first in a row ("SOURCE/..."); e.g. session 29's 12,000
      # chat-first conversations out of sessions 26's and 29's files, with no regeneration
      if [ -n "${SERVED_DROP_SOURCES:-}" ]; then
        all=$(wc -l < $W/qwen-conversations.jsonl)
        grep -v -E "^\{\"id\": \"($(echo "$SERVED_DROP_SOURCES" | tr , '|'))/" \
          $W/qwen-conversations.jsonl > $W/qwen-conversations.kept
        mv $W/qwen-conversations.kept $W/qwen-conversations.jsonl
        stage "served: $(wc -l < $W/qwen-conversations.jsonl) of $all carried conversations \
kept, those of $SERVED_DROP_SOURCES left out"
      fi
      conv=(--conversations $W/qwen-conversations.jsonl ${SERVED_TOP_UP:+--top-up})
    fi
    # the target's answers go home first (results.tgz), as soon as they are regenerated, in
    # case the lease ends before or while serving (real_model.py --keep-conversations;
    # SERVED_TOP_UP=1 with SERVED_CONVERSATIONS: the SERVED_TRAIN prompts they lack are
    # regenerated, and both together go home: a corpus that grows lease by lease)
    used=$W/qrun/regenerated/conversations.jsonl
    [ -n "${SERVED_CONVERSATIONS:-}" ] && [ -n "${SERVED_TOP_UP:-}" ] && \
      used=$W/qrun/conversations.jsonl
    keep=(--keep-conversations $R/qwen-conversations.jsonl.gz)
    [ -n "${SERVED_CONVERSATIONS:-}" ] && [ -z "${SERVED_TOP_UP:-}" ] && keep=()
    # SERVED_EVALS_FIRST (e.g. bench): those evals run before the serving, their reports go
    # home at once and beside the served rows from the start (a lease that ends while serving
    # keeps them); the others after it
    first=""
    for e in $(echo "${SERVED_EVALS_FIRST:-}" | tr , ' '); do
      first="$first [ ! -f $W/qrun/eval-$e/report.json ] || { mkdir -p $R/eval-$e && \
        cp $W/qrun/eval-$e/report.json $W/qrun/eval-$e/report.md $R/eval-$e/; };"
    done
    # (the eval reports on the served prompts: held out and bench, at T = 0 and at others)
    speed="$first python3 benchmarks/served_speed.py --target $Q \
        --draft ${SERVED_DRAFT:-$W/qrun/draft} \$(for f in $W/qrun/eval-heldout*/report.json \
            $W/qrun/eval-bench*/report.json; do [ -f \$f ] && echo --eyas-report \$f; done) \
        --bench $served_bench --data $W/realdata/heldout.jsonl --num-prompts 80 \
        --batch1-prompts 20 --k ${SERVED_K:-3,5,1,7} --ngram-k 4 \
        --batches ${SERVED_BATCHES:-1,8,32,64} --temperatures ${SERVED_TEMPS:-0,1} \
        --max-new-tokens 256 --max-minutes ${SERVED_MINUTES:-12} ${SERVED_SPEED_ARGS:-} \
        --json $R/served-qwen-coder.json > $R/served.out 2>&1; rc=\$?; \
        echo \"\$(date +%T) served: speed rc \$rc\" >> $R/stages.txt"
    if [ -n "${SERVED_DRAFT:-}" ]; then
      # a draft exported by an earlier lease and carried back (`KEEP_WHOLE=1 h200_lease.sh keep
      # /tmp/w/qrun/draft NAME`, then `KEEP_INTO=/tmp/w/qrun h200_lease.sh kpart` here): no
      # pipeline. eyas eval measures it on the served prompts first (SERVED_EVALS_FIRST's
      # heldout and bench, default bench; at each of SERVED_TEMPS; SERVED_EVAL_K), each report
      # sent home as it ends, then vLLM serves it beside them
      [ -f "$SERVED_DRAFT/config.json" ] || {
        stage "served: SERVED_DRAFT $SERVED_DRAFT holds no exported draft (carried back?)"
        continue; }
      # SERVED_EVAL_REPORTS: this draft's eyas eval reports from an earlier lease (paths in
      # this tree, e.g. benchmarks/results/served-h100-s39/eval-bench/report.json), each put
      # in $W/qrun/ under its folder's name, where the served rows find it; with
      # SERVED_EVALS_FIRST=none no eval runs again
      for f in $(echo "${SERVED_EVAL_REPORTS:-}" | tr , ' '); do
        d=$W/qrun/$(basename "$(dirname "$f")")
        mkdir -p "$d" && cp "$f" "$d/report.json" ||
          stage "served: SERVED_EVAL_REPORTS $f not copied"
      done
      for temp in $(echo "${SERVED_TEMPS:-0,1}" | tr , ' '); do
        sfx=-t$temp  # (T = 0, as 0 or 0.0: no suffix)
        awk "BEGIN {exit !($temp == 0)}" && sfx=""
        for e in $(echo "${SERVED_EVALS_FIRST:-bench}" | tr , ' '); do
          case $e in
            heldout) set_args=(--data $W/realdata/heldout.jsonl) ;;
            bench) set_args=(--bench $served_bench) ;;
            none) continue ;;
            *) stage "served: SERVED_EVALS_FIRST $e ignored (a carried draft: heldout, bench)"
               continue ;;
          esac
          python3 -m eyas eval --target $Q --draft $SERVED_DRAFT --k ${SERVED_EVAL_K:-3,5} \
              --max-new-tokens 256 --dtype bfloat16 --batch-size 64 --num-prompts 80 \
              ${SERVED_EVAL_ARGS:-} \
              --temperature $temp "${set_args[@]}" --out $W/qrun/eval-$e$sfx \
              > "$R/eval-$e$sfx.out" 2>&1
          stage "served: eval $e$sfx of the carried draft rc $?"
          mkdir -p "$R/eval-$e$sfx" && cp $W/qrun/eval-$e$sfx/report.* "$R/eval-$e$sfx/"
        done
      done
      PYTHONPATH=$VP sh -c "$speed"  # (it writes its own stage line)
      continue
    fi
    stage "served: regenerate (vLLM), prepare, capture, vocab, train, export, serve, eval"
    PYTHONPATH=$VP python3 benchmarks/real_model.py --target $Q --data ${SERVED_DATA:-$W/realdata} \
        --work $W/qrun --out "$R/real-qwen.json" --max-train ${SERVED_TRAIN:-5821} \
        --train-order curve ${SERVED_SOURCES_FIRST:+--sources-first $SERVED_SOURCES_FIRST} \
        "${conv[@]}" "${keep[@]}" --regen-tokens 256 --regen-batch 1024 \
        --regen-args "--backend vllm --gpu-memory-utilization ${VLLM_MEMORY:-0.5}" \
        --dtype bfloat16 --capture-dtype fp8 ${SERVED_ONLINE:+--online} \
        ${SERVED_REGEN_ONLY:+--regenerate-only} \
        --eval-fraction 0.05 --epochs ${SERVED_EPOCHS:-10} --eval-every ${SERVED_EVAL_EVERY:-200} \
        --batch-tokens 16384 --after-export "$speed" --indist-prompts 100 \
        --heldout-prompts 80 --eval-tokens 256 --k ${SERVED_EVAL_K:-3,5} --eval-batch 64 \
        --eval-order ${SERVED_EVAL_ORDER:-heldout,bench,indist} \
        ${SERVED_EVALS_FIRST:+--evals-first $SERVED_EVALS_FIRST} \
        ${SERVED_EVAL_ARGS:+"--eval-args=$SERVED_EVAL_ARGS"} \
        ${SERVED_TRAIN_ARGS:+"--train-args=$SERVED_TRAIN_ARGS"} \
        --bench $served_bench --bench-prompts 80 > "$R/real_qwen.out" 2>&1
    stage "served: pipeline rc $?"
    # (and when a step failed before they were kept: the answers are the costliest output)
    [ ${#keep[@]} = 0 ] || [ -s "$R/qwen-conversations.jsonl.gz" ] || [ ! -s $used ] || \
      { gzip -c $used > $R/qwen-conversations.tmp && \
        mv $R/qwen-conversations.tmp $R/qwen-conversations.jsonl.gz; }
    # the held-out and bench reports only: a report of one set (held out) is matched to
    # served_speed.py's "data" set, so the in-distribution one must not be among them
    reports=$(for f in $W/qrun/eval-heldout/report.json $W/qrun/eval-bench/report.json; do
              [ -f $f ] && echo --eyas-report $f; done)
    [ -z "$reports" ] || python3 benchmarks/served_speed.py attach \
        --json "$R/served-qwen-coder.json" $reports >> "$R/served.out" 2>&1
    stage "served: attach rc $?" ;;
  served-shape)
    # issue 33: where an eyas draft pays when vLLM serves it. A random target of SHAPE
    # (Llama-3.1-8B's by default; SmolLM2's tokenizer, from $T) and a draft eyas makes for it
    # (200 of the ablation's conversations, 20 steps), served without speculation and at each
    # SHAPE_K (benchmarks/served_shape.py): the break-even acceptance length per k and batch
    VP=$PYTHONPATH:${VSITE:-/tmp/vsite}
    # (SHAPE_RUNNERS="v1 v2": once per vLLM model runner, the target and draft made once,
    # first, while vLLM's bundle may still be arriving: the stage can start with call c)
    shape=(--tokenizer $T --shape ${SHAPE:-llama-8b} --conversations $W/conversations-2000.jsonl
           --work $W/shape-${SHAPE:-llama-8b})
    out="$R/served_shape-${SHAPE:-llama-8b}.out"  # (two shapes in a row keep both)
    python3 benchmarks/served_shape.py "${shape[@]}" --no-serve \
        --json "$R/served-${SHAPE:-llama-8b}-made.json" > "$out" 2>&1
    stage "served-shape: target and draft made, rc $?"
    for i in $(seq 120); do [ -f ${VSITE:-/tmp/vsite}/.ready ] && break; sleep 5; done
    # each SHAPE_RUNNERS word is RUNNER[:ATTENTION], e.g. "v2:fa3-nosplit" (served_speed.py's
    # --runner and --attention; auto: vLLM's choice, as served_speed.py's defaults)
    for way in ${SHAPE_RUNNERS:-auto}; do
      rn=${way%%:*} att=auto; [ "$way" = "$rn" ] || att=${way#*:}
      sfx=; [ $rn = auto ] || sfx=-$rn; [ $att = auto ] || sfx=$sfx-$att
      stage "served-shape: ${SHAPE:-llama-8b}, vLLM ($way) at each k"
      PYTHONPATH=$VP python3 benchmarks/served_shape.py "${shape[@]}" \
          --json "$R/served-${SHAPE:-llama-8b}-shape$sfx.json" -- --bench mt-bench --num-prompts 40 \
          --batch1-prompts 10 --k ${SHAPE_K:-3,1,5} --batches ${SHAPE_BATCHES:-1,8,32} \
          --temperatures 0 --max-new-tokens 256 --max-minutes ${SHAPE_MINUTES:-8} \
          --runner $rn --attention $att >> "$out" 2>&1
      stage "served-shape ($way) rc $?"
    done ;;
  ngram-steps)
    # issue 31: n-gram's tokens per step (docs/eval.md) on the curve's prompt sets whose n-gram
    # record lacks them: n-gram-only `eyas eval` runs (no draft) at the curve's eval settings,
    # at once (SmolLM2 is small), for benchmarks/ngram_steps.py. NGRAM_SETS: indist and
    # indist_chat (SCALE_DATA's files, 200 prompts) and mt-bench-t1 (80 prompts, T = 1)
    ev=(--target $T --k 3,6 --max-new-tokens 96 --dtype float32 --device cuda --batch-size 64
        --ngram)
    for s in ${NGRAM_SETS:-indist indist_chat mt-bench-t1}; do
      if [ $s = mt-bench-t1 ]; then
        set_args=(--bench mt-bench --num-prompts 80 --temperature 1)
      else
        set_args=(--data ${SCALE_DATA:-$W/scale-realdata}/$s.jsonl --num-prompts 200)
      fi
      (python3 -m eyas eval "${ev[@]}" "${set_args[@]}" --out "$R/ngram-$s" \
          > "$R/ngram-$s.out" 2>&1; stage "ngram-steps $s rc $?") &
    done
    wait ;;
  t1-sampling)
    # how drafts are drawn at T > 0 (vLLM's draft_sample_method, eyas eval --draft-sampling):
    # greedy (the draft's argmax, accepted with the target's probability of it) against
    # probabilistic (sampled from the draft, accepted with min(1, p/q)), on one draft from the
    # ablation's 2,000 conversations (eyas train's defaults, 10 epochs), MT-bench at T = 1
    # (T1S_TEMPS="1 0.7" adds 0.7), with T = 0 beside them; the evals side by side once the
    # draft is exported (session 28's five at once had not ended after 2.5 minutes)
    D=$W/t1s
    ev="--target $T --draft $D/draft --bench mt-bench --num-prompts 80 --k 3,6 \
        --max-new-tokens 96 --dtype float32 --batch-size 64 --no-ngram"
    evals="python3 -m eyas eval $ev --out $R/t1s-0 > $R/t1s-0.out 2>&1 &"
    for temp in ${T1S_TEMPS:-1}; do
      for s in greedy probabilistic; do
        evals="$evals python3 -m eyas eval $ev --temperature $temp --draft-sampling $s \
          --out $R/t1s-$temp-$s > $R/t1s-$temp-$s.out 2>&1 &"
      done
    done
    stage "t1-sampling: a draft of 2,000 conversations, then its evals"
    python3 benchmarks/real_model.py --target $T --data $W/realdata --work $D \
        --out "$R/t1s-real.json" --conversations $W/conversations-2000.jsonl \
        --dtype float32 --capture-dtype fp8 --epochs 10 --batch-tokens 8192 \
        --eval-fraction 0.05 --indist-prompts 50 --heldout-prompts 50 --eval-tokens 96 \
        --k 3,6 --after-export "$evals wait" > "$R/t1s.out" 2>&1
    stage "t1-sampling rc $?" ;;
  regen)
    stage "regenerate benchmark: generate, padded, lookup"
    timeout 420 python3 benchmarks/regenerate.py --target $T \
        --data $W/realdata/heldout.jsonl $REGEN_ARGS \
        --modes generate,padded,lookup --dtype float32 --json "$R/regenerate-h200.json" \
        > "$R/regen_bench.out" 2>&1
    stage "regenerate benchmark rc $?"
    timeout 240 python3 benchmarks/regenerate.py --target $T \
        --data $W/realdata/heldout.jsonl $REGEN_ARGS \
        --modes continuous --dtype float32 --json "$R/regenerate-cb-h200.json" \
        > "$R/regen_cb_bench.out" 2>&1
    stage "regenerate continuous rc $?" ;;
  esac
done
stage done
