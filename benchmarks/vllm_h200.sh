#!/bin/bash
# Issue 24 on one lent H200, in the background (docs/export.md, "A real vLLM, offline"):
# waits for the vLLM bundle's parts in /tmp/vparts (carried one per call: .carry/vllm's
# vllm-bundle-slim.tar.part-00..03 and SHA256SUMS; the call that copies the last one then
# touches /tmp/vparts/ready, so no part is read half-copied), checks, joins and installs them into
# /tmp/vsite, then serves an eyas draft with a real vLLM (benchmarks/vllm_serve.py),
# times `eyas regenerate --backend vllm` against transformers (benchmarks/regenerate.py) and,
# if present, runs the plugin check (benchmarks/vllm_plugin_serve.py). Expects what
# real_model_h200.sh expects (/tmp/w/smol.gguf, /tmp/w/realdata, /tmp/w/site, /tmp/w/repo)
# plus VLLM_DRAFT (an exported draft folder) and VLLM_REPORT (the `eyas eval` report.json of
# that draft on the same prompts). Writes /tmp/w/vresults, one file per stage as it ends.
# vLLM first runs as the bundle's notes advise; a failed run is retried with Model Runner V1,
# then with the engine core in-process, and each attempt's log is kept. vLLM takes
# VLLM_MEMORY (0.25) of the GPU, so that real_model_h200.sh can run beside it (its speeds are
# then shared-GPU speeds: the acceptance counts are what this run is for).
set -u
W=${W:-/tmp/w}
R=$W/vresults
mkdir -p "$R"
stage() { echo "$(date +%T) $*" >> "$R/stages.txt"; }
DRAFT=${VLLM_DRAFT:-$W/draft0}
REPORT=${VLLM_REPORT:-$W/repo/benchmarks/results/real-smollm2-h200-3000/eval-heldout-report.json}

stage "waiting for the bundle's parts in /tmp/vparts"
while [ ! -f /tmp/vparts/ready ]; do sleep 2; done
cd /tmp/vparts || exit 1
if ! sha256sum -c --ignore-missing SHA256SUMS > "$R/sha.txt" 2>&1; then
  stage "a part's sha256 differs: see sha.txt"; exit 1
fi
cat vllm-bundle-slim.tar.part-0* > b.tar && tar xf b.tar && rm b.tar
bash vllm-bundle-slim/install.sh /tmp/vsite > "$R/install.txt" 2>&1
stage "install rc $?"

export PYTHONPATH=/tmp/vsite:$W/site:$W/repo/src PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1
cd "$W/repo" || exit 1
attempt() {  # NAME, then the command; retried with the fallbacks until one succeeds
  local name=$1; shift
  for env in "" "VLLM_USE_V2_MODEL_RUNNER=0" \
             "VLLM_USE_V2_MODEL_RUNNER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0"; do
    stage "$name${env:+ with $env}"
    env $env timeout 900 "$@" > "$R/$name${env:+-fallback${#env}}.out" 2>&1
    local rc=$?
    stage "$name rc $rc"
    [ $rc = 0 ] && return 0
  done
  return 1
}
attempt vllm_serve python3 benchmarks/vllm_serve.py --target $W/smol.gguf --draft "$DRAFT" \
    --data $W/realdata/heldout.jsonl --num-prompts 200 --max-new-tokens 96 --k 3,6 \
    --eyas-report "$REPORT" --gpu-memory-utilization ${VLLM_MEMORY:-0.25} \
    --json "$R/vllm-serve-h200.json"
# issue 22: regeneration through vLLM's engine in the process (eyas regenerate --backend vllm)
# against transformers in the same process; needs real_model_h200.sh's converted folder
# (padded once, outside `attempt`, whose retries are for vLLM's start-up; the baseline,
# generate, beside vllm, so that its answers are compared with vLLM's)
if [ -d $W/smol-hf ]; then
  REGEN="python3 benchmarks/regenerate.py --target $W/smol-hf --data $W/realdata/heldout.jsonl
      --rows 512 --new-tokens 256 --batch-size 256 --dtype float32"
  stage "regenerate: padded"
  timeout 600 $REGEN --modes padded --json "$R/regenerate-hf-h200.json" \
      > "$R/regen_hf.out" 2>&1
  stage "regenerate padded rc $?"
  attempt vllm_regen $REGEN --modes generate,vllm \
      --gpu-memory-utilization ${VLLM_MEMORY:-0.25} --json "$R/regenerate-vllm-h200.json"
else
  stage "no $W/smol-hf (real_model_h200.sh converts it): regenerate benchmark skipped"
fi
if [ -f benchmarks/vllm_plugin_serve.py ]; then
  attempt vllm_plugin python3 benchmarks/vllm_plugin_serve.py --json "$R/vllm-plugin-h200.json"
fi
stage done
