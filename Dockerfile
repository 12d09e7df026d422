# syntax=docker/dockerfile:1
# rollout-relay: the proxy (default command) and the worker in one image.
#   docker build -t rollout-relay:0.1.0 .                                  # proxy + hf worker, CPU torch
#   docker build --build-arg EXTRAS=vllm -t rollout-relay-vllm:0.1.0 .    # GPU worker (vLLM, CUDA)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- builder: resolve and install everything into a virtualenv ----
FROM ${PYTHON_IMAGE} AS builder
ARG EXTRAS=hf
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY rollout_relay ./rollout_relay
COPY proxy ./proxy
COPY relay ./relay
COPY worker_client ./worker_client
COPY sdk ./sdk
COPY deploy ./deploy
# The hf extra takes torch's CPU build first: resolved from PyPI alone, torch is a CUDA build
# of several GB. The vllm extra brings the CUDA build vLLM pins. DL3013: the project itself
# is installed from this directory; its dependencies' ranges live in pyproject.toml.
# hadolint ignore=DL3013
RUN if [ "$EXTRAS" = "hf" ]; then \
        pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"; \
    fi \
    && pip install --no-cache-dir ".[${EXTRAS}]"

# ---- runtime: the virtualenv on a slim base; no compilers, no pip cache, no sources ----
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 relay \
    && useradd --system --uid 10001 --gid relay --home-dir /home/relay --create-home \
        --shell /usr/sbin/nologin relay \
    && mkdir -p /var/lib/rollout-relay /var/cache/rollout-relay \
    && chown relay:relay /var/lib/rollout-relay /var/cache/rollout-relay
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/var/cache/rollout-relay/huggingface \
    RELAY_HEALTHCHECK_URL=http://127.0.0.1:8080/healthz
USER 10001:10001
WORKDIR /home/relay
VOLUME ["/var/lib/rollout-relay"]
EXPOSE 8080
# Kubernetes ignores HEALTHCHECK and probes /healthz and /readyz itself (deploy/).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(urllib.request.urlopen(os.environ['RELAY_HEALTHCHECK_URL'], timeout=4).status != 200)"]
ENTRYPOINT ["rollout-relay"]
# Without --admin-token/--worker-token (or RELAY_ADMIN_TOKEN/RELAY_WORKER_TOKEN) the proxy
# refuses to start.
CMD ["proxy", "--host", "0.0.0.0", "--port", "8080", "--data-dir", "/var/lib/rollout-relay", "--cache-dir", "/var/cache/rollout-relay"]
