#!/usr/bin/env bash
# The main job on a fresh machine: installs the Python environment, brings up a
# local Kafka (127.0.0.1:9092, from Maven Central jars), initialises SQLite, runs
# the windows worker, publishes a demo workload (DEMO_EVENTS, default 20000),
# prints the resulting daily and hourly rows, and shuts everything down cleanly.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
# shellcheck source=lib.sh
source deploy/local/lib.sh

export KAFKA_PORT=${KAFKA_PORT:-9092}
export SKILLSTATS_KAFKA_BOOTSTRAP=127.0.0.1:$KAFKA_PORT
started_kafka=""
cleanup() { [[ -n $started_kafka ]] && deploy/local/kafka.sh stop || true; }
trap cleanup EXIT

ensure_debian_tools
ensure_python_env
deploy/local/kafka.sh status >/dev/null 2>&1 || { started_kafka=1; deploy/local/kafka.sh start; }
python deploy/local/demo.py
