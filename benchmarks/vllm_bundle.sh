#!/bin/bash
# Builds the "vLLM slim bundle" that benchmarks/vllm_h200.sh installs on a lent, offline H200
# (x86-64, Python 3.12, torch 2.11.0+cu130 and transformers 5.17 already there, no network):
# the vLLM 0.24.0 wheel (cp38-abi3, CUDA 13, Requires-Dist torch==2.11.0) slimmed, plus the
# dependency wheels such an image lacks, in one tar split into parts of at most 36 MB (five for vLLM 0.24)
# (carried one per call; see docs/export.md, "A real vLLM, offline").
#   bash benchmarks/vllm_bundle.sh [OUT]      (default .carry/vllm, ignored by git)
# writes OUT/vllm-bundle-slim.tar.part-00..03 and OUT/SHA256SUMS. The tar holds
# vllm-bundle-slim/ with the wheels and install.sh TARGET (pip --no-index --no-deps --target).
# Slimming (the tar must stay <= 180 MB): dropped from the vLLM wheel are FlashAttention-2
# (the H200 uses FA3, kept), the MoE ops (_moe_C_stable_libtorch: imported in a try at start-up,
# dense models never call it), the Rust serve front end (vllm-rs), the vendored SM100 fmha
# (MiniMax-M3 on Blackwell only) and the vendored DeepGEMM (FP8 GEMMs; vLLM falls back without
# it); from xgrammar its static library lib/libxgrammar.a. RECORD is rewritten to match.
# Left out on purpose: what the image has (torch stack, transformers, tokenizers, hf-hub,
# safetensors, numpy, triton, requests, pyyaml, jinja2, psutil, pillow, ...), flashinfer, ray,
# nvidia-*, numba/llvmlite (n-gram drafts only), opencv, mistral_common (+pycountry), the
# serving-only anthropic/mcp/model-hosting-container-standards/opentelemetry-sdk, and
# outlines_core (the "outlines" structured-output backend only; xgrammar and guidance stay).
set -euo pipefail
OUT=${1:-.carry/vllm}
NAME=vllm-bundle-slim
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
B=$WORK/$NAME
mkdir -p "$B" "$WORK/dl"

# Every wheel for CPython 3.12 on manylinux x86-64, binaries only, pinned (one version each).
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  PLAT+=(--platform "${p}_x86_64")
done
DEPS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  pydantic-extra-types==2.11.1 msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1
  cachetools==8.0.2 blake3==1.0.11 py-cpuinfo==9.0.0 cloudpickle==3.1.3 dill==0.4.1
  openai==2.54.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 httpx==0.28.1 httpcore==1.0.9
  h11==0.16.0 anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1 openai-harmony==0.0.8
  llguidance==1.7.6 xgrammar==0.2.3 apache-tvm-ffi==0.1.9 lm-format-enforcer==0.11.3
  interegular==0.3.3 diskcache==5.6.3 lark==1.2.2 partial-json-parser==0.2.1.1.post7
  fastapi==0.136.3 starlette==1.10.0 annotated-doc==0.0.7 uvloop==0.23.0 watchfiles==1.3.0
  prometheus-client==0.26.0 prometheus-fastapi-instrumentator==8.1.0 opentelemetry-api==1.45.2
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 tiktoken==0.14.0 sentencepiece==0.2.3
  protobuf==6.33.6 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 compressed-tensors==0.17.0 loguru==0.7.3 depyf==0.20.0 astor==0.8.1
  einops==0.8.2 six==1.17.0 setproctitle==1.3.8 python-json-logger==4.2.0 ijson==3.6.0
)
"$PY" -m pip download -q "${PLAT[@]}" -d "$WORK/dl" vllm==0.24.0 "${DEPS[@]}"

VLLM=$(ls "$WORK"/dl/vllm-0.24.0-cp38-abi3-*.whl)
META=$(unzip -p "$VLLM" 'vllm-0.24.0.dist-info/METADATA')
grep -qx 'Requires-Dist: torch==2.11.0' <<<"$META" || { echo "vllm wheel: not torch 2.11" >&2; exit 1; }
unzip -l "$VLLM" | grep -q _vllm_fa3_C || { echo "vllm wheel: no FA3" >&2; exit 1; }

# slim WHEEL PATTERN...: delete the matching files (fnmatch, '*' spans '/') from the wheel in
# place and from its RECORD, so that pip's RECORD check still passes.
slim() {
  "$PY" - "$@" <<'EOF'
import csv, fnmatch, os, sys, zipfile
whl, pats = sys.argv[1], sys.argv[2:]
drop = lambda n: any(fnmatch.fnmatch(n, p) for p in pats)
tmp = whl + ".tmp"
with zipfile.ZipFile(whl) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
    gone = [i.filename for i in zi.infolist() if drop(i.filename)]
    assert gone, f"nothing matched {pats} in {whl}"
    for i in zi.infolist():
        if drop(i.filename):
            continue
        data = zi.read(i)
        if i.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(True)  # CSV: names with commas are quoted
            keep = [l for l in lines if not drop(next(csv.reader([l]))[0])]
            data = "".join(keep).encode()
        zo.writestr(i, data)  # same name, date, mode and compression as before
os.replace(tmp, whl)
print(f"{os.path.basename(whl)}: dropped {len(gone)} files, now {os.path.getsize(whl)} bytes")
EOF
}
slim "$VLLM" 'vllm/vllm_flash_attn/_vllm_fa2_C*.so' 'vllm/_moe_C*.so' 'vllm/vllm-rs' \
  'vllm/third_party/fmha_sm100/*' 'vllm/third_party/deep_gemm/*'
slim "$(ls "$WORK"/dl/xgrammar-*.whl)" 'xgrammar/lib/libxgrammar.a'
mv "$WORK"/dl/*.whl "$B/"

cat > "$B/install.sh" <<'EOF'
#!/bin/bash
# install.sh TARGET: installs every wheel beside this script into TARGET (no network, no deps);
# then use it with `export PYTHONPATH=TARGET` (docs/export.md).
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 TARGET" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$1" \
  "$here"/*.whl
echo "installed $(ls "$here"/*.whl | wc -l) wheels into $1"
EOF
chmod +x "$B/install.sh"

(cd "$B" && ls -l *.whl | awk '{print $5, $9}' > "$WORK/wheels.txt")
tar -C "$WORK" -cf "$WORK/$NAME.tar" "$NAME"
SIZE=$(stat -c %s "$WORK/$NAME.tar")
[ "$SIZE" -le 180000000 ] || { echo "tar is $SIZE bytes, over 180000000" >&2; exit 1; }
rm -f "$OUT/$NAME.tar.part-"* "$OUT/SHA256SUMS"
split -b 36000000 -d "$WORK/$NAME.tar" "$OUT/$NAME.tar.part-"
(cd "$OUT" && sha256sum "$NAME.tar.part-"* > SHA256SUMS)
cat "$WORK/wheels.txt"
echo "tar $SIZE bytes, $(wc -l < "$WORK/wheels.txt") wheels; parts in $OUT:"
(cd "$OUT" && ls -l "$NAME.tar.part-"* SHA256SUMS)
