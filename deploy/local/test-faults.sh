#!/usr/bin/env bash
# The fault suite (tests marked `faults`, docs/reliability.md): brokers stopped under
# load, workers killed, the database stopped, groups scaled, shutdowns while the
# database hangs or the broker is gone. Same setup as the test command
# (deploy/local/test.sh installs and starts what it needs), but on a three-node
# KRaft cluster of its own on 127.0.0.1:29092-29094 (topics replicated 3 times,
# min.insync.replicas 2), so a broker can be stopped without stopping Kafka.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export SKILLSTATS_TEST_KAFKA_PORT=${SKILLSTATS_TEST_FAULTS_KAFKA_PORT:-29092} KAFKA_NODES=3
export KAFKA_PORT_SETTING=SKILLSTATS_TEST_FAULTS_KAFKA_PORT
SKILLSTATS_TEST_MARK=faults exec deploy/local/test.sh "$@"
