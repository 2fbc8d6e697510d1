#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what the tests need (Python
# dependencies, Debian's kcat and PostgreSQL, the Kafka jars from Maven Central),
# starts a test Kafka on 127.0.0.1:19092 and PostgreSQL on 127.0.0.1:55432, runs
# ruff and pytest, and stops the services it started. Extra arguments go to pytest
# (e.g. deploy/local/test.sh -k contract). The fault suite (tests marked `faults`) is
# left out; deploy/local/test-faults.sh runs it (SKILLSTATS_TEST_MARK=faults).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
# shellcheck source=lib.sh
source deploy/local/lib.sh

export KAFKA_PORT=${SKILLSTATS_TEST_KAFKA_PORT:-19092} PG_PORT=${SKILLSTATS_TEST_PG_PORT:-55432}
# A taken PostgreSQL port is said in one line by postgres.sh, naming the variable that moves it here.
export PG_PORT_SETTING=SKILLSTATS_TEST_PG_PORT
export KAFKA_PORT_SETTING=${KAFKA_PORT_SETTING:-SKILLSTATS_TEST_KAFKA_PORT}
export SKILLSTATS_TEST_PG=postgresql://postgres@127.0.0.1:$PG_PORT/postgres
export SKILLSTATS_TEST_METRICS=$repo/.local/test-metrics.txt

started_kafka="" started_pg=""
cleanup() {
  [[ -n $started_kafka ]] && deploy/local/kafka.sh stop || true
  [[ -n $started_pg ]] && deploy/local/postgres.sh stop || true
}
trap cleanup EXIT

begin=$SECONDS
say "tools"
ensure_debian_tools
ensure_python_env
say "the TypeScript client"
ensure_typescript_client
say "services"
deploy/local/kafka.sh status >/dev/null 2>&1 || { started_kafka=1; deploy/local/kafka.sh start; }
SKILLSTATS_TEST_KAFKA=$(deploy/local/kafka.sh bootstrap) # every node: the fault suite stops some
export SKILLSTATS_TEST_KAFKA
deploy/local/postgres.sh status >/dev/null 2>&1 || { started_pg=1; deploy/local/postgres.sh start >/dev/null; }
say "ruff"
ruff check skillstats streams sinks bench tests deploy
say "deploy tools"
SKILLSTATS_TEST_KUSTOMIZE=$(ensure_kustomize)
export SKILLSTATS_TEST_KUSTOMIZE
say "promtool: the alert rules"
promtool check rules deploy/prometheus/skillstats-rules.yml
(cd deploy/prometheus && promtool test rules skillstats-rules.test.yml)
say "pytest"
mkdir -p .local && : >"$SKILLSTATS_TEST_METRICS"
status=0
# --durations: the slowest tests named in every run's log, so that a suite nearing its budget says what to
# move or share first.
pytest -q -p no:cacheprovider --durations=25 -m "${SKILLSTATS_TEST_MARK:-not faults and not deploy}" "$@" || status=$?
if [[ -s $SKILLSTATS_TEST_METRICS ]]; then say "measured (not asserted)"; cat "$SKILLSTATS_TEST_METRICS" >&2; fi
say "test run took $((SECONDS - begin))s"
exit $status
