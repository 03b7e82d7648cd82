#!/bin/bash
# Run here, between device calls (docs/benchmarks.md, "A lease, call by call"): every device
# call carries this working tree beside its carried folder, 64 MiB in all, and the 36 MB
# parts of the GGUF, the vLLM bundle and a kept draft leave ~29 MiB for the tree. Call `a`
# copies the tree to the device ($W/repo), and later calls run from there, so after `a` the
# largest tracked files can leave the working tree for the lease:
#   hide      move tracked files over ${SLIM_MIN_KB:-1024} KB under benchmarks/results into
#             .slim/ (ignored, so not carried); prints the tree's size after
#   restore   put them back, and any other tracked file of benchmarks/results the tree lacks
#             from git; changes to tracked files (a lease's results copied in) are kept
set -eu
cd "$(dirname "$0")/.."
case "${1:?name a step: hide or restore}" in
  hide)
    git ls-files -z benchmarks/results | while IFS= read -r -d '' f; do
      [ -f "$f" ] && [ "$(du -b "$f" | cut -f1)" -gt $(( ${SLIM_MIN_KB:-1024} * 1024 )) ] ||
        continue
      mkdir -p ".slim/$(dirname "$f")" && mv "$f" ".slim/$f" && echo "hid $f"
    done
    echo "tree: $(git ls-files -z | xargs -0 cat 2>/dev/null | wc -c) bytes" ;;
  restore)
    [ -d .slim ] && (cd .slim && find . -type f -print0) | while IFS= read -r -d '' f; do
      mkdir -p "$(dirname "$f")" && mv ".slim/$f" "$f"
    done
    rm -rf .slim
    # (a tracked file .slim did not hold and the tree lacks; never a blanket checkout, which
    # would throw away a lease's results copied over tracked files before the restore, as
    # session 50's scale-smollm2-corpus.json was)
    git ls-files -z -d benchmarks/results | xargs -0 -r git checkout --
    git status --short benchmarks/results ;;
  *) echo "unknown step $1: hide or restore" >&2; exit 2 ;;
esac
