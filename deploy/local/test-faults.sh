#!/usr/bin/env bash
# The fault suite: consumers stopped while the database hangs or the broker is gone,
# and the other faults of docs/reliability.md. Same setup as the test command
# (deploy/local/test.sh installs and starts what it needs); only the tests marked
# `faults`. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
SKILLSTATS_TEST_MARK=faults exec deploy/local/test.sh "$@"
