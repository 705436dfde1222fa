# `make train` and `make test` do all set-up on a fresh machine: a virtual environment with
# the local CPU torch wheel first (an unpinned torch would pull several GB of CUDA), then
# meshrl editable with its dev extras.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

.PHONY: setup train test bench
setup: $(VENV)/.installed

train: $(VENV)/.installed
	$(BIN)/meshrl train @ configs/local.toml

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/chunked_logprobs.py
	$(BIN)/python benchmarks/collator_throughput.py
