# kvxferd container image.
#
#   docker build -t kvxferd .                        # CPU: python:3.12-slim, CPU-only torch
#   docker build -t kvxferd:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 .
#
#   docker run --rm -e KVXFERD_AUTH_TOKEN=... -p 50051:50051 -p 9400:9400 \
#     --stop-timeout 30 kvxferd
#
#   docker build -t kvxferd:cu12 --build-arg NIXL_EXTRA=cu12 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# NIXL (with its bundled UCX) comes from PyPI through the package's [cu13] extra, or [cu12]
# (NIXL_EXTRA: exactly one of the two). The
# GPU driver comes from the host through the NVIDIA Container Toolkit (--gpus), the RDMA
# devices through --device=/dev/infiniband (plus --ulimit memlock=-1 for registration).
# docker stop waits 10 s by default, the same as server.drain_timeout_s: give it more
# (--stop-timeout) so that draining pulls are not killed.

# Any Debian/Ubuntu-based image; one without Python (nvidia/cuda) gets the distribution's
# python3, which must be >= 3.11 (Ubuntu 24.04: 3.12).
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

# Where torch comes from. The CPU index keeps the slim image free of CUDA wheels (several GB);
# for GPU images use a CUDA index (cu130 matches nixl-cu13), or "" for PyPI's default build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Userspace RDMA verbs and NUMA libraries, loaded by UCX's InfiniBand/RoCE transports
# (without them UCX silently uses TCP only).
ARG RUNTIME_PACKAGES="libibverbs1 ibverbs-providers librdmacm1 libnuma1"
# Which NIXL build: cu13 (CUDA 13, the default) or cu12.
ARG NIXL_EXTRA=cu13

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/kvxferd \
    PATH=/opt/kvxferd/bin:$PATH \
    CUDA_CACHE_PATH=/tmp/cuda-cache

# The base image decides the distribution, so its packages are not pinned (DL3008); $pkgs is
# a word list on purpose (SC2086). deploy/check.sh runs hadolint on this file.
# hadolint ignore=DL3008,SC2086
RUN set -eux; \
    apt-get update; \
    pkgs="$RUNTIME_PACKAGES"; \
    if ! command -v python3 >/dev/null 2>&1; then pkgs="$pkgs python3 python3-venv"; fi; \
    apt-get install -y --no-install-recommends $pkgs; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/kvxferd

COPY . /src
RUN set -eux; \
    if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" "torch>=2.4"; \
    fi; \
    pip install "/src[${NIXL_EXTRA}]"; \
    rm -rf /src; \
    kvxferd --help >/dev/null

COPY deploy/docker/kvxferd.toml /etc/kvxferd/kvxferd.toml

# Non-root, with a numeric uid so that Kubernetes' runAsNonRoot can verify it.
# /run/kvxferd holds the Engine service's Unix socket (server.engine_socket).
RUN set -eux; \
    groupadd --system --gid 10001 kvxferd; \
    useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin kvxferd; \
    install -d -o 10001 -g 10001 -m 0750 /run/kvxferd
USER 10001:10001

LABEL org.opencontainers.image.title="kvxferd" \
      org.opencontainers.image.description="KV-cache transfer daemon for disaggregated LLM serving" \
      org.opencontainers.image.licenses="Apache-2.0"

# 50051: gRPC (Peer, Scheduler, grpc.health.v1). 9400: HTTP /metrics and /healthz.
EXPOSE 50051 9400

# No HEALTHCHECK: Kubernetes probes grpc.health.v1 directly (deploy/k8s/worker.yaml).
ENTRYPOINT ["kvxferd"]
CMD ["serve", "--config", "/etc/kvxferd/kvxferd.toml"]
