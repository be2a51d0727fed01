# syntax=docker/dockerfile:1
# The image k8s/ runs: elastic-rt, torch and the example job, with tini as PID 1.
#
#   GPU (CUDA torch from PyPI):  docker build -t elastic-rt:0.1.0-cuda .
#   CPU only (smaller):          docker build -t elastic-rt:0.1.0-cpu \
#                                  --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# Layout in the image: a virtualenv at /opt/venv (on PATH), the repository's
# launch/ recipes and example at /opt/elastic-rt/launch. The default command is
# `elastic-rt --help`; the manifests give `elastic-rt launch ...` as args.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
# Empty: torch from PyPI (CUDA build on x86_64). Set to a PyTorch wheel index
# (e.g. https://download.pytorch.org/whl/cpu) for another build of torch.
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, in a layer of its own: it is most of the image and changes least.
COPY pyproject.toml README.md /src/
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" "torch>=2.13.0"; \
    else \
        pip install "torch>=2.13.0"; \
    fi
COPY elastic_rt /src/elastic_rt
RUN pip install /src && elastic-rt --version

FROM python:${PYTHON_VERSION}-slim-bookworm
# tini: PID 1 that forwards SIGTERM to the agent and reaps orphaned processes.
# ca-certificates: TLS to etcd and object storage. procps: ps/pgrep for operators.
# numactl: launch --numa-binding runs each worker under numactl.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini ca-certificates procps numactl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
COPY launch /opt/elastic-rt/launch
# Non-root by default (the cpu-smoke and base manifests run as uid 1000; the gpu
# overlay runs as root for RDMA's locked memory).
RUN groupadd --gid 1000 elastic && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/elastic elastic \
    && mkdir -p /var/log/elastic-rt && chown 1000:1000 /var/log/elastic-rt
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/elastic-rt
USER 1000:1000
# 9402: the agent's /metrics and /healthz (--metrics-port).
EXPOSE 9402
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["elastic-rt", "--help"]
