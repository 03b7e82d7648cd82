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

.PHONY: install demo test test-all test-vllm
install: $(BIN)/eyas

demo: $(BIN)/eyas
	$(BIN)/eyas demo --out demo-out

test: $(BIN)/eyas
	$(BIN)/python -m pytest -q

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
