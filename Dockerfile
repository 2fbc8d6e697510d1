# The skillstats image: one image, every command (`skillstats windows`, `init`, ...).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml requirements.lock README.md ./
COPY skillstats ./skillstats
COPY streams ./streams
COPY sinks ./sinks
RUN pip install --no-cache-dir -c requirements.lock . \
    && useradd --system --uid 10001 skillstats
USER 10001
ENTRYPOINT ["skillstats"]
CMD ["--help"]
