# The skillstats image: one image, every command (`skillstats windows`, `init`, ...),
# for Kubernetes (deploy/k8s/) and docker compose alike.
#
# Stage 1 builds wheels for skillstats and every pinned dependency (requirements.lock);
# stage 2 installs only those wheels into a slim runtime, without compilers or pip's
# cache, and runs as an unprivileged user. The root filesystem can be mounted read-only:
# nothing is written outside /tmp (mount an emptyDir there).

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml requirements.lock README.md ./
COPY skillstats ./skillstats
COPY streams ./streams
COPY sinks ./sinks
COPY bench ./bench
RUN pip wheel --no-cache-dir --wheel-dir /wheels -c requirements.lock .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl \
    && rm -rf /wheels \
    && groupadd --system --gid 10001 skillstats \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent skillstats
WORKDIR /tmp
USER 10001:10001
# windows, lag-exporter, docsync --every: /metrics, /healthz, /readyz
EXPOSE 9310 9311 9312
ENTRYPOINT ["skillstats"]
CMD ["--help"]
