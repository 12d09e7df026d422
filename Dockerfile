# rollout-relay: two images from one file, the proxy and the worker.
#   docker build --target proxy -t rollout-relay:0.1.0 .                     # proxy, no torch
#   docker build --target worker -t rollout-relay-worker:0.1.0 .             # hf worker, CPU torch
#   docker build --target worker --build-arg EXTRAS=vllm -t rollout-relay-vllm:0.1.0 .  # GPU
# The stages are ordered so that the classic builder, which builds every stage up to its
# --target, builds nothing of the worker for the proxy. The CPU torch wheel is taken from
# wheels/ in the build context when it is there, from TORCH_INDEX_URL otherwise; a base
# image other than the official one: --build-arg PYTHON_IMAGE=... (scripts/base-image.sh).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- base: the runtime user and directories both images run with ----
FROM ${PYTHON_IMAGE} AS base
LABEL org.opencontainers.image.title=rollout-relay
RUN groupadd --system --gid 10001 relay \
    && useradd --system --uid 10001 --gid relay --home-dir /home/relay --create-home \
        --shell /usr/sbin/nologin relay \
    && mkdir -p /var/lib/rollout-relay /var/cache/rollout-relay \
    && chown relay:relay /var/lib/rollout-relay /var/cache/rollout-relay
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/var/cache/rollout-relay/huggingface

# ---- proxy-builder: the project and its runtime dependencies in a virtualenv ----
FROM ${PYTHON_IMAGE} AS proxy-builder
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
# DL3013: the project itself is installed from this directory; its dependencies' ranges
# live in pyproject.toml. The proxy needs no torch: it tokenizes with `tokenizers`.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir .

# ---- proxy: the virtualenv on the base; no compilers, no pip cache, no sources ----
FROM base AS proxy
COPY --from=proxy-builder /opt/venv /opt/venv
ENV RELAY_HEALTHCHECK_URL=http://127.0.0.1:8080/healthz
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

# ---- worker-builder: the proxy's virtualenv plus an engine ----
FROM proxy-builder AS worker-builder
ARG EXTRAS=hf
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# wheels/ holds what the build installs from the context instead of an index: the CPU
# torch wheel, where the torch index cannot be reached (scripts/test-image.sh links it in).
COPY wheels/ /tmp/wheels/
# The hf extra takes torch's CPU build first: resolved from PyPI alone, torch is a CUDA build
# of several GB. The vllm extra brings the CUDA build vLLM pins.
# hadolint ignore=DL3013
RUN if [ "$EXTRAS" = "hf" ]; then \
        for wheel in /tmp/wheels/torch-"${TORCH_VERSION}"*.whl; do break; done; \
        if [ -f "$wheel" ]; then \
            pip install --no-cache-dir "$wheel"; \
        else \
            pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"; \
        fi; \
    fi \
    && pip install --no-cache-dir ".[${EXTRAS}]"

# ---- worker: dials out to the proxy; serves no port ----
FROM base AS worker
COPY --from=worker-builder /opt/venv /opt/venv
USER 10001:10001
WORKDIR /home/relay
HEALTHCHECK NONE
ENTRYPOINT ["rollout-relay"]
CMD ["worker", "--help"]
