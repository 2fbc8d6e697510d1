# The skillstats image: one image, every command (`skillstats windows`, `init`, ...),
# for Kubernetes (deploy/k8s/) and docker compose alike.
#
# The base is Debian bookworm with Debian's own Python 3.11 rather than
# python:3.11-slim: one distribution for the interpreter and the system libraries,
# security updates from Debian's archive, and a base that can be made from scratch
# with debootstrap where no registry is reachable (deploy/local/image.sh does that
# to build and run this very file in the tests; BASE names the base it made).
#
# Stage 1 installs skillstats and every pinned dependency (requirements.lock) into a
# virtualenv at /opt/skillstats, compiling skillstats' C module (skillstats/_native.c: the
# per-record hot path) with gcc and the Python headers, which stay in that stage; stage 2
# copies only that virtualenv onto the same base with just `python3`, without pip or
# caches (the bytecode pip compiled is kept: a read-only root cannot cache it at
# start-up), and runs as an unprivileged user. The root filesystem can be mounted
# read-only: nothing is written outside /tmp (mount an emptyDir there).
ARG BASE=docker.io/library/debian:bookworm-slim

FROM ${BASE} AS build
# Unpinned apt packages: the base pins the release, and within a Debian stable
# release an upgrade is a security or bug fix that should be taken.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
WORKDIR /src
COPY pyproject.toml setup.py requirements.lock README.md ./
COPY skillstats ./skillstats
COPY streams ./streams
COPY sinks ./sinks
COPY bench ./bench
RUN python3 -m venv /opt/skillstats \
    && /opt/skillstats/bin/pip install --no-cache-dir -c requirements.lock . \
    && /opt/skillstats/bin/pip uninstall --yes pip

FROM ${BASE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 skillstats \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent skillstats
COPY --from=build /opt/skillstats /opt/skillstats
ENV PATH=/opt/skillstats/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
# windows, lag-exporter, docsync --every, ingest: /metrics, /healthz, /readyz
EXPOSE 9310 9311 9312 9320
ENTRYPOINT ["skillstats"]
CMD ["--help"]
