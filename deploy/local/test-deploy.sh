#!/usr/bin/env bash
# The deploy suite (tests marked `deploy`, docs/deploy.md "What was proven where"):
# the manifests against a real Kubernetes API server with its controllers and
# kwok's fake nodes (deploy/local/kube.sh, tests/test_kube.py), and the project's
# Dockerfile built with podman and run the way the manifests run it
# (deploy/local/image.sh, tests/test_image.py). Builds what it needs first (the
# control plane from the Go module proxy, once per machine: the Go build cache),
# then runs the test command (deploy/local/test.sh: tools, Kafka, PostgreSQL) with
# the `deploy` mark. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=deploy/local/lib.sh
source deploy/local/lib.sh

begin=$SECONDS
started_kube=
cleanup() { [[ -n $started_kube ]] && deploy/local/kube.sh stop || true; }
trap cleanup EXIT

say "the image (deploy/local/image.sh)"
SKILLSTATS_TEST_IMAGE=$(deploy/local/image.sh build)
export SKILLSTATS_TEST_IMAGE
say "the control plane (deploy/local/kube.sh)"
deploy/local/kube.sh build
deploy/local/kube.sh status >/dev/null 2>&1 || { started_kube=1; deploy/local/kube.sh start; }
SKILLSTATS_TEST_KUBECONFIG=$(deploy/local/kube.sh kubeconfig)
export SKILLSTATS_TEST_KUBECONFIG
say "images and control plane ready after $((SECONDS - begin))s"
status=0
SKILLSTATS_TEST_MARK=deploy deploy/local/test.sh "$@" || status=$?
say "deploy suite took $((SECONDS - begin))s"
exit $status
