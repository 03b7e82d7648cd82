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

.PHONY: install demo test test-all
install: $(BIN)/eyas

demo: $(BIN)/eyas
	$(BIN)/eyas demo --out demo-out

test: $(BIN)/eyas
	$(BIN)/python -m pytest -q

test-all: $(BIN)/eyas
	$(BIN)/python -m pytest -q -m "slow or not slow"
