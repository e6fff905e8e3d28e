# syntax=docker/dockerfile:1
# The gpuq image: every service runs from it as `gpuq up --services <name>` (deploy/helm/gpuq). It holds no NATS or
# Postgres: the embedded servers are an extra that is not installed here, and NATS_URL / DATABASE_URL are required.
# Its Python dependencies are requirements.lock's, pinned with hashes; the simulator's extra (gpuq[sim]) is left out.
# Built in your CI, not here (docs/install.md):  docker build -t <registry>/gpuq:<version> .
#
# Base: the official python:3.11-slim-bookworm (Python 3.11.16, Debian 12), pinned by the digest of its
# multi-platform image index as published by Docker Official Images (docker-library/repo-info,
# repos/python/remote/3.11-slim-bookworm.md). Both stages start from it; bump it with the Python patch release.
FROM python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b AS base

# ---- build: a virtualenv with the locked dependencies, then the gpuq wheel into it ---------------------------------
FROM base AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# The dependencies exactly as requirements.lock pins them (`make lock`): every file checked against its hash, wheels
# only (nothing compiled here), and none of the extras (the simulator's numpy and matplotlib stay out).
COPY requirements.lock ./
RUN python -m venv /opt/gpuq \
 && /opt/gpuq/bin/pip install --no-cache-dir --require-hashes --only-binary=:all: -r requirements.lock
COPY pyproject.toml README.md ./
COPY shared/ shared/
COPY services/ services/
COPY sim/ sim/
COPY cli/ cli/
# Not gpuq_tools/ (the benchmarks and the chaos harness): no service needs it, and the wheel built here is the
# product's alone; `gpuq bench ...` and `gpuq chaos` in the image say so (cli/lazy.py).
# gpuq itself without its dependencies: they are the locked ones above (pip refuses to go on if one is missing).
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist . \
 && /opt/gpuq/bin/pip install --no-cache-dir --no-deps /dist/gpuq-*.whl \
 && /opt/gpuq/bin/pip check \
 && /opt/gpuq/bin/python -m compileall -q /opt/gpuq/lib

# ---- runtime: the virtualenv, a non-root user, nothing else --------------------------------------------------------
FROM base
LABEL org.opencontainers.image.title="gpuq" \
      org.opencontainers.image.description="GPU training-job scheduling for shared Kubernetes clusters"
# The root filesystem is read-only in the chart: state and caches go to /tmp (an emptyDir there). In a container the
# API, /metrics and the health endpoints listen on every interface (GPUQ_BIND; `gpuq up` elsewhere: 127.0.0.1).
ENV PATH=/opt/gpuq/bin:$PATH \
    GPUQ_BIND=0.0.0.0 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    GPUQ_HOME=/tmp/gpuq
RUN groupadd --system --gid 10001 gpuq \
 && useradd --system --uid 10001 --gid gpuq --home-dir /tmp --no-create-home --shell /usr/sbin/nologin gpuq
COPY --from=build /opt/gpuq /opt/gpuq
USER 10001:10001
WORKDIR /tmp
# 8080: /healthz and /readyz of every service; 9464: telemetry's /metrics.
EXPOSE 8080 9464
ENTRYPOINT ["gpuq"]
CMD ["up", "--help"]
