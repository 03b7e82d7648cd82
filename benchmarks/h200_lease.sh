#!/bin/bash
# One lent H200, call by call (docs/benchmarks.md, "A lease, call by call"). Each call of the
# device tool runs `bash benchmarks/h200_lease.sh STEP` in its copy of this tree, carrying what
# that step reads (at most 64 MiB a call with the tree); everything lasting goes to /tmp, which
# survives between calls while the machine is held. Steps:
# Every carried folder is built by benchmarks/h200_carry.sh (a session's checkout has none).
# After `a`, run `bash benchmarks/h200_slim.sh hide` here (and `restore` after the lease):
# the tree then leaves room beside it for the 36 MB parts (later calls run from $W/repo).
#   a          carry .carry/a + .whl: the GGUF's first quarter, realdata.tgz, the wheels
#              (installed into $W/site); copies this tree's src, benchmarks, tests and
#              pyproject.toml to $W/repo (later calls replace the tree, never $W/repo)
#   b          carry .carry/b: the second quarter,
#              scale.tgz (real_data.py --scale: scale-realdata/), the bench archives ($EYAS_BENCH_CACHE =
#              $W/bench); the ablation's 2,000 conversations, gunzipped into $W, and the scale
#              corpus ($W/corpus): that seed and the parts committed in
#              benchmarks/results/scale-corpus/; the committed scale-smollm2*.json into $W
#   b2         carry .carry/b2: the third quarter
#   c          carry .carry/c (+ .whl-peers when the peers run: installed into $W/peersite):
#              the last quarter (the GGUF joined into $W/smol.gguf, sha256 checked)
#   e          carry .carry/e: alpaca's and arena-hard's archive into $W/bench (only when
#              eyas eval --bench measures those sets)
#   vpart DIR  carry DIR (.carry/v0 .. v4: one 36 MB part of the vLLM bundle of
#              benchmarks/vllm_bundle.sh each, with its SHA256SUMS): copied into /tmp/vparts;
#              once every part of SHA256SUMS is there, checked, joined and installed into
#              /tmp/vsite (/tmp/vsite/.ready when done)
#   gpart DIR  carry DIR (one part of a file split by `split -b 36000000`, with SHA256SUMS of the
#              parts and the whole file as FILE.sha256, e.g. .carry/q0 .. q13 of the Qwen GGUF,
#              made by h200_carry.sh qwen):
#              copied into /tmp/gparts; once every part is there, checked, joined into $W/FILE
#              and the whole checked
#   keep SRC NAME  pack the folder SRC (a size's, its job stopped) once with benchmarks/keep.py,
#              then send its next parts of 15 MB to $OUT per call, as many as fit what the
#              call has left of its 8 files and 64 MiB (four) (docs/benchmarks.md, "A size
#              over two leases"; KEEP_WHOLE=1: every file of SRC, for a folder that is not a
#              training run, e.g. an exported draft, unpacked by kpart with KEEP_INTO=FOLDER's
#              parent). A call that failed lost its $OUT: run it again with
#              KEEP_RESEND=last (what that call sent goes again); KEEP_RESEND=3,4,5 sends those
#              parts again (`keep.py carry` here names the missing ones and this value);
#              KEEP_RESEND=all sends everything again from the first part
#   kpart DIR  carry DIR (.carry/kN, made here by `keep.py carry`; the name from its
#              NAME.SHA256SUMS): once every part is there, joined, checked and unpacked into
#              ${KEEP_INTO:-$W/scale}, and NAME's files removed from ${KPARTS:-/tmp/kparts}
#              (kept if the join or a check fails: carry the missing or good folder again;
#              NAME's files of another pack, whose NAME.SHA256SUMS differs, are removed first)
#   stop NAME  stop the job started as NAME (its process group)
#   corpus DIR carry DIR (regenerated corpus parts not committed, conversations-p*.jsonl.gz,
#              with their manifests and rejects-p*.jsonl): copied into $W/corpus, where stage
#              scale reads them
#   start NAME CMD...  run CMD from $W/repo in its own session (setsid), in the background,
#              output in $W/results/NAME.out, pid in $W/NAME.pid
#   monitor    record GPU, memory and disk use every 10 s into $W/results/monitor.txt, in the
#              background (pid in $W/monitor.pidm: poll does not wait for it)
#   poll S     wait up to S seconds while any started job runs (POLL_UNTIL=PATH: or until
#              PATH exists, e.g. /tmp/w/qrun/draft/config.json once the draft is exported),
#              then pack $W/results into $OUT/results.tgz (with every part's rejects, the
#              live one's as partial-rejects-regen-pNN.jsonl) and the scale corpus parts made
#              here, finished or growing, into $OUT (split at 15 MB: join with cat; parts
#              that were carried here are not sent back; POLL_CORPUS=0 poll: none); prints
#              the stages
set -u
W=${W:-/tmp/w}
R=$W/results
mkdir -p "$R"
step=${1:?"name a step: a, b, c, e, vpart, gpart, keep, kpart, stop, corpus, start, monitor, poll"}
shift
collect() {  # copy the part folder $1 into $2 and cd there; true once every part its
  # sums file ($3, SHA256SUMS if not given) lists has arrived and checks out (a mismatch ends
  # the step), false before
  local sums=${3:-SHA256SUMS}
  mkdir -p "$2" && cp "$1"/* "$2"/ || exit 1
  cd "$2" || exit 1
  for f in $(awk '{print $2}' "$sums"); do
    [ -f "$f" ] || { echo "have $(ls | wc -l) files, waiting for $f"; return 1; }
  done
  sha256sum -c "$sums" || exit 1
}
# the peers' wheels (.whl-peers, built by h200_carry.sh peers), when this call carries them:
# into $W/peersite (PEER_SITE of real_model_h200.sh); carry them with c (b is too full)
peers() {
  ls .whl-peers/*.whl > /dev/null 2>&1 || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target $W/peersite $(ls .whl-peers/*.whl | grep -Ev "datasets-|dill-|multiprocess-")
}
case $step in
a)
  mkdir -p $W/site $W/repo /tmp/gguf
  cp .carry/a/gguf.part-aa /tmp/gguf/ || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $W/site \
      .whl/*.whl || exit 1
  cp -r src benchmarks tests pyproject.toml $W/repo/
  tar xzf .carry/a/realdata.tgz -C $W || exit 1
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  ls $W ;;
b)
  cp .carry/b/gguf.part-ab /tmp/gguf/ || exit 1
  tar xzf .carry/b/scale.tgz -C $W || exit 1
  mkdir -p $W/bench && cp .carry/b/bench/* $W/bench/
  gunzip -c $W/repo/benchmarks/results/ablation-h200/conversations-2000.jsonl.gz \
      > $W/conversations-2000.jsonl
  wc -l $W/conversations-2000.jsonl
  mkdir -p $W/corpus  # the scale corpus's seed (docs/benchmarks.md, "The scaling curve")
  cp $W/repo/benchmarks/results/ablation-h200/conversations-2000.jsonl.gz \
      $W/corpus/conversations-seed-2000.jsonl.gz
  cp $W/repo/benchmarks/results/scale-corpus/* $W/corpus/ 2>/dev/null
  # the committed parts (not the seed, nor parts made here) are not sent back by poll
  (cd $W/repo/benchmarks/results/scale-corpus &&
      ls conversations-p*.jsonl.gz >> $W/corpus.carried 2>/dev/null)
  # the curves so far (the curve's own, the chat-first and the corpus order's: stage scale
  # takes SCALE_NAME's)
  cp $W/repo/benchmarks/results/scale-smollm2*.json $W/ 2>/dev/null
  cp -r $W/repo/benchmarks/results/scale-smollm2*-prompts $W/ 2>/dev/null  # their evals' prompts
  ls -la $W/corpus ;;
b2)
  cp .carry/b2/gguf.part-ac /tmp/gguf/ || exit 1 ;;
c)
  peers || exit 1
  cp .carry/c/gguf.part-ad /tmp/gguf/ && cat /tmp/gguf/gguf.part-a? > $W/smol.gguf || exit 1
  sha256sum $W/smol.gguf | grep ^b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 ||
    { echo "the joined GGUF's sha256 differs"; exit 1; }
  rm -f /tmp/gguf/gguf.part-a? ;;
e)
  mkdir -p $W/bench && cp .carry/e/bench/* $W/bench/ ;;
vpart)
  collect "${1:?vpart DIR}" /tmp/vparts || exit 0
  cat vllm-bundle-slim.tar.part-* | tar x && rm -f vllm-bundle-slim.tar.part-*
  bash vllm-bundle-slim/install.sh /tmp/vsite > $R/vllm-install.txt 2>&1 || {
      tail $R/vllm-install.txt; exit 1; }
  touch /tmp/vsite/.ready && echo "vLLM installed in /tmp/vsite"
  # (installed --no-compile: the byte code is made now, in the background, rather than by
  # the first engine while it starts; session 39's first engine took 188 s to start)
  setsid nohup python3 -m compileall -q -j 0 /tmp/vsite > $R/vsite-compile.txt 2>&1 \
      < /dev/null & ;;
gpart)
  collect "${1:?gpart DIR}" /tmp/gparts || exit 0
  whole=$(ls *.sha256 | head -1)
  name=${whole%.sha256}
  cat $(awk '{print $2}' SHA256SUMS) > $W/$name && rm -f $(awk '{print $2}' SHA256SUMS)
  (cd $W && sha256sum -c /tmp/gparts/$whole) || exit 1
  echo "joined $W/$name" ;;
keep)
  # keep SRC NAME: the folder SRC (a size of the curve, its job stopped first) packed once by
  # benchmarks/keep.py into /tmp/keep, then each call sends the next parts of 15 MB to $OUT (as
  # many as fit beside what is there: a poll's results.tgz in the same call counts; four)
  # (`python benchmarks/keep.py carry NAME .carry DIRS...` here makes kN folders of them);
  # KEEP_RESEND=last|all|3,4,5 sends parts again (the header above)
  src=${1:?"keep SRC NAME"}; name=${2:?"keep SRC NAME"}
  store=${KEEP_STORE:-/tmp/keep}
  whole=(); [ "${KEEP_WHOLE:-0}" = 1 ] && whole=(--whole)
  [ -f $store/$name.json ] || python3 benchmarks/keep.py pack "$src" "$name" $store \
      --part-bytes ${KEEP_PART_BYTES:-15000000} "${whole[@]}" || exit 1
  python3 benchmarks/keep.py send $store "$name" "$OUT" --resend "${KEEP_RESEND:-}" \
      ${KEEP_MAX_FILES:+--max-files $KEEP_MAX_FILES} ;;
kpart)
  # kpart DIR: one part of a kept folder (.carry/kN from keep.py carry); the last one joins,
  # checks and unpacks it into ${KEEP_INTO:-$W/scale}, where scale.py resumes it; NAME comes
  # from the NAME.SHA256SUMS that DIR brings (two sizes' parts may share KPARTS)
  dir=${1:?kpart DIR}; kparts=${KPARTS:-/tmp/kparts}
  sums=$(cd "$dir" && ls *.SHA256SUMS 2>/dev/null)
  name=${sums%.SHA256SUMS}
  [ "$(echo "$sums" | wc -w)" = 1 ] && [ -f "$dir/$name.tar.sha256" ] || {
      echo "$dir should hold one NAME.SHA256SUMS and its NAME.tar.sha256 (from keep.py carry)"
      exit 1; }
  # NAME's files here with sums other than DIR's are of another pack or carry of NAME, left by
  # one that never finished: removed, or a stale part would pass for one not yet carried
  cmp -s "$dir/$sums" "$kparts/$sums" || rm -fv "$kparts/$name.tar" "$kparts/$name".tar.part-* \
      "$kparts/$sums" "$kparts/$name.tar.sha256"
  collect "$dir" "$kparts" "$sums" || exit 0
  # the parts stay until the whole has checked and unpacked: a failed call can be made again
  { cat $(awk '{print $2}' "$sums") > "$name.tar" && sha256sum -c "$name.tar.sha256"; } ||
      { rm -f "$name.tar"; exit 1; }
  cd - > /dev/null && python3 benchmarks/keep.py unpack "$kparts/$name.tar" \
      "${KEEP_INTO:-$W/scale}" || exit 1
  rm -f "$kparts/$name.tar" "$kparts/$name".tar.part-* "$kparts/$sums" \
      "$kparts/$name.tar.sha256" ;;
stop)
  # stop NAME: the job started as NAME, its whole process group (SIGTERM, then SIGKILL)
  pid=$(cat "$W/${1:?stop NAME}.pid") || exit 1
  kill -TERM -- -"$pid" 2>/dev/null
  for _ in $(seq 30); do kill -0 -- -"$pid" 2>/dev/null || break; sleep 1; done  # the group
  kill -KILL -- -"$pid" 2>/dev/null
  echo "$1 stopped" ;;
corpus)
  mkdir -p $W/corpus && cp "${1:?corpus DIR}"/conversations-p*.jsonl.gz $W/corpus/ || exit 1
  cp "$1"/conversations-p*-eyas.json "$1"/rejects-p*.jsonl $W/corpus/ 2>/dev/null
  (cd "$1" && ls conversations-p*.jsonl.gz >> $W/corpus.carried)
  ls -la $W/corpus ;;
start)
  name=${1:?"start NAME CMD..."}
  shift
  cd $W/repo || exit 1
  setsid nohup "$@" > "$R/$name.out" 2>&1 < /dev/null &
  echo $! > "$W/$name.pid"
  echo "started $name: pid $(cat $W/$name.pid)" ;;
monitor)
  # the limits the training's page cache lives under (a cgroup may cap it below the machine's)
  { nproc; free -g; cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/memory.high 2>&1; } \
      > "$R/machine.txt" 2>&1
  setsid nohup bash -c "while true; do echo \$(date +%T) \$(nvidia-smi \
      --query-gpu=utilization.gpu,memory.used --format=csv,noheader) \
      mem \$(free -g | awk '/Mem:/ {print \$3 \" GiB, cache \" \$6}') GiB, \
      cgroup \$(( \$(cat /sys/fs/cgroup/memory.current 2>/dev/null || echo 0) >> 30 )) GiB, \
      load \$(cut -d' ' -f1 /proc/loadavg), disk \$(df -h /tmp | awk 'NR==2 {print \$3}'); \
      sleep 10; done" >> "$R/monitor.txt" 2>&1 < /dev/null &
  echo $! > "$W/monitor.pidm" ;;
poll)
  end=$((SECONDS + ${1:-500}))
  running() {
    for p in $W/*.pid; do [ -f "$p" ] && kill -0 "$(cat "$p")" 2>/dev/null && return 0; done
    return 1
  }
  # (POLL_UNTIL=PATH: return as soon as PATH exists, e.g. an exported draft's config.json,
  # so that the next call can send it home while the job goes on)
  until_there() { [ -n "${POLL_UNTIL:-}" ] && [ -e "$POLL_UNTIL" ]; }
  while running && [ $SECONDS -lt $end ] && ! until_there; do sleep 10; done
  for p in $W/*.pid; do
    kill -0 "$(cat "$p")" 2>/dev/null && s=running || s=ended
    echo "$(basename "$p" .pid): $s"
  done
  # the scale corpus: finished parts, else the part being regenerated (append-only and
  # fsynced: what a machine taken back would lose), as their own files (at most 8 files of
  # 16 MiB come back), outside results.tgz
  # Parts that came here in a carry (b, corpus) are not sent back. POLL_CORPUS=0: none at
  # all, only results.tgz (both machines lost in session 17 were lost right after a call that
  # brought files back; a call that brings none back has never lost one)
  parts=$(cd $W/corpus 2>/dev/null && ls conversations-p*.jsonl.gz 2>/dev/null |
      grep -vxF -f <(cat $W/corpus.carried 2>/dev/null; echo /) | sed "s|^|$W/corpus/|")
  [ "${POLL_CORPUS:-1}" = 0 ] && parts=
  for c in $W/scale/regen-p*/out/conversations.jsonl; do
    [ "${POLL_CORPUS:-1}" = 0 ] && break  # not even gzipped: a short call
    n=$(basename "$(dirname "$(dirname "$c")")")
    [ -f "$c" ] && ! ls $W/corpus/conversations-${n#regen-}-*.jsonl.gz > /dev/null 2>&1 &&
      gzip -c "$c" > "$W/partial-$n.jsonl.gz" && parts="$parts $W/partial-$n.jsonl.gz"
  done
  for f in $parts; do split -b 15000000 -d "$f" "$OUT/$(basename "$f")."; done
  # and the ids regenerate refused (the curve order skips them): finished parts' and the live
  # regeneration's, in results.tgz (commit them beside the parts in scale-corpus/)
  cp $W/corpus/rejects-p*.jsonl $W/corpus/conversations-p*-eyas.json "$R/" 2>/dev/null
  for r in $W/scale/regen-p*/out/rejects.jsonl; do
    [ -f "$r" ] && cp "$r" "$R/partial-rejects-$(basename "$(dirname "$(dirname "$r")")").jsonl"
  done
  # each size's, variant's and the pipeline's progress (its log's tail: a training's step
  # lines, tokens/s and ETA, an eval's result lines), and a peer's own training log
  for g in $W/scale/size-*/log.txt $W/run/recipe-*/log.txt $W/run/log.txt \
      $W/qrun/log.txt; do
    [ -f "$g" ] && grep -v "it/s\]" "$g" | tail -n 30 > "$R/tail-$(basename "$(dirname "$g")").txt"
  done
  for g in $W/run/recipe-peer-*/train.log; do
    # (a line's head and tail: SpecForge's step lines end with their step time)
    [ -f "$g" ] && tail -n 40 "$g" | awk '{ print (length($0) > 600 ? substr($0, 1, 200) \
        " ... " substr($0, length($0) - 399) : $0) }' > "$R/tail-$(basename "$(dirname "$g")")-train.txt"
  done
  tar czf "$OUT/results.tgz" --exclude='conversations*.jsonl.gz' -C $W results 2>/dev/null
  ls -la "$OUT"
  tail -n 25 $R/stages.txt 2>/dev/null
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader || true ;;
*)
  echo "unknown step $step"; exit 2 ;;
esac
