"""Fixtures and helpers for tests/test_kube.py: a real Kubernetes API server, its controllers and kwok.

The cluster is deploy/local/kube.sh's (etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
kwok's fake node, built from the Go module proxy): the tests find it through SKILLSTATS_TEST_KUBECONFIG
(`deploy/local/kube.sh kubeconfig`) and are skipped without it. They talk to it with the kubectl built
beside it (.local/kube/bin/kubectl; SKILLSTATS_TEST_KUBECTL overrides), so client and server are one
release. Each test works in a namespace of its own that enforces the restricted Pod Security profile, as
the production overlay's namespace does, and that also *warns* about it, so that a pod template which
breaks the profile shows up as a warning when its workload is applied (pods are refused, workloads are
only warned about). The namespace is deleted afterwards.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from tests import helpers
from tests.test_deploy import K8S, RENDERINGS, ROOT, render

T = TypeVar("T")

KUBECTL = Path(os.environ.get("SKILLSTATS_TEST_KUBECTL", ROOT / ".local" / "kube" / "bin" / "kubectl"))
EXAMPLE_SECRETS = K8S / "examples" / "secret.yaml"
# The labels of the production overlay's Namespace (overlays/production/namespace.yaml), plus `warn`.
POD_SECURITY_LABELS = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
    "pod-security.kubernetes.io/warn": "restricted",
    "pod-security.kubernetes.io/warn-version": "latest",
}
CRDS = (
    "scaledobjects.keda.sh",
    "triggerauthentications.keda.sh",
    "podmonitors.monitoring.coreos.com",
    "servicemonitors.monitoring.coreos.com",
    "prometheusrules.monitoring.coreos.com",
)
WAIT_S = 120  # the longest any condition is waited for; reaching it fails the test


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = WAIT_S, every: float = 0.25) -> T:
    """tests.helpers.wait_until, with the arguments in the order these tests read best."""
    return helpers.wait_until(probe, timeout, what, interval=every)  # type: ignore[arg-type]


@dataclass
class Kubectl:
    """kubectl against the test cluster, in one namespace (None: the kubeconfig's default)."""

    kubeconfig: str
    namespace: str | None = None

    def command(self, *args: str) -> list[str]:
        ns = ["--namespace", self.namespace] if self.namespace else []
        return [str(KUBECTL), "--kubeconfig", self.kubeconfig, *ns, *args]

    def run(self, *args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*args), input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )

    def ok(self, *args: str, stdin: str | None = None) -> str:
        result = self.run(*args, stdin=stdin)
        assert result.returncode == 0, f"kubectl {shlex.join(args)}: {result.stderr}"
        return result.stdout

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.ok("get", *args, "-o", "json"))

    def get_or_none(self, *args: str) -> dict[str, Any] | None:
        result = self.run("get", *args, "-o", "json")
        return json.loads(result.stdout) if result.returncode == 0 else None

    def apply(self, objects: list[dict[str, Any]], *extra: str) -> subprocess.CompletedProcess[str]:
        """Server-side apply, with strict field validation (an unknown field is an error, not a warning)."""
        return self.run(
            "apply",
            "--server-side",
            "--field-manager",
            "skillstats-tests",
            "--validate=strict",
            *extra,
            "-f",
            "-",
            stdin=yaml.safe_dump_all(objects, sort_keys=False),
        )

    def applied(self, objects: list[dict[str, Any]], *extra: str) -> subprocess.CompletedProcess[str]:
        """apply(), which must succeed without a single warning from the server."""
        result = self.apply(objects, *extra)
        assert result.returncode == 0, result.stderr
        assert "Warning:" not in result.stderr, result.stderr
        return result

    def pods(self, selector: str) -> list[dict[str, Any]]:
        return self.get("pods", "-l", selector)["items"]


def selector_of(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    conditions = (obj or {}).get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), None)


def pod_ready(pod: dict[str, Any]) -> bool:
    ready = condition(pod, "Ready")
    return (
        pod["status"].get("phase") == "Running"
        and ready is not None
        and ready["status"] == "True"
        and "deletionTimestamp" not in pod["metadata"]
    )


@functools.cache
def _rendered(name: str) -> str:
    return json.dumps(render(RENDERINGS[name]))


def rendered(name: str, namespace: str) -> list[dict[str, Any]]:
    """The base or the production overlay as kustomize renders it, moved into `namespace`.

    The overlay's own Namespace object is left out (each test has one of its own, with the same labels).
    """
    objects = [o for o in json.loads(_rendered(name)) if o["kind"] != "Namespace"]  # a fresh copy
    for obj in objects:
        obj["metadata"]["namespace"] = namespace
    return objects


def rendered_with_component(component: str, namespace: str, tmp_path: Path) -> list[dict[str, Any]]:
    """The base with one component (deploy/k8s/components/<component>), as an overlay would include it."""
    tree = tmp_path / "k8s"
    if not tree.exists():
        shutil.copytree(K8S, tree)
    overlay = tree / "overlays" / f"with-{component}"
    overlay.mkdir(parents=True)
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": namespace,
                "resources": ["../../base"],
                "components": [f"../../components/{component}"],
            }
        )
    )
    return render(overlay)


def overlay_namespace(name: str) -> list[dict[str, Any]]:
    """The Namespace objects of a rendering, as rendered (the production overlay's `skillstats`)."""
    return [o for o in json.loads(_rendered(name)) if o["kind"] == "Namespace"]


def example_secrets(namespace: str) -> list[dict[str, Any]]:
    """The Secrets the overlay references (examples/secret.yaml, placeholders), and the Kafka CA's."""
    secrets = [doc for doc in yaml.safe_load_all(EXAMPLE_SECRETS.read_text()) if doc]
    secrets.append(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "kafka-cluster-ca-cert"},
            "type": "Opaque",
            "stringData": {"ca.crt": "<the Kafka cluster's CA, PEM>"},
        }
    )
    for secret in secrets:
        secret["metadata"]["namespace"] = namespace
    return secrets


@dataclass
class PodWatch:
    """Every event of a `kubectl get pods --watch` on a selector, in the order the server sent them."""

    kubectl: Kubectl
    selector: str
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            self.kubectl.command("get", "pods", "-l", self.selector, "--watch", "--output-watch-events", "-o", "json"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        # kubectl writes one indented JSON document per event; decode them as they complete.
        assert self._process.stdout is not None
        decoder, buffer = json.JSONDecoder(), ""
        for line in self._process.stdout:
            buffer += line
            try:
                event, end = decoder.raw_decode(buffer.lstrip())
            except json.JSONDecodeError:
                continue
            buffer = buffer.lstrip()[end:]
            with self._lock:
                self.events.append((event["type"], event["object"]))

    def snapshot(self) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            return list(self.events)

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(30)
        self._reader.join(30)
        assert self._process.stderr is not None
        errors = self._process.stderr.read()
        assert "error" not in errors.lower(), errors


# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def cluster() -> Kubectl:
    kubeconfig = os.environ.get("SKILLSTATS_TEST_KUBECONFIG")
    if not kubeconfig:
        pytest.skip(
            "no Kubernetes cluster: set SKILLSTATS_TEST_KUBECONFIG "
            "(deploy/local/kube.sh start; SKILLSTATS_TEST_KUBECONFIG=$(deploy/local/kube.sh kubeconfig))"
        )
    if not KUBECTL.exists():
        pytest.fail(f"no kubectl at {KUBECTL}: run deploy/local/kube.sh build, or set SKILLSTATS_TEST_KUBECTL")
    kubectl = Kubectl(kubeconfig)
    ready = kubectl.run("get", "--raw", "/readyz", timeout=30)
    if ready.returncode != 0:
        pytest.fail(f"the API server of {kubeconfig} is not ready ({ready.stderr.strip()}): deploy/local/kube.sh start")
    missing = [crd for crd in CRDS if kubectl.get_or_none("crd", crd) is None]
    assert missing == [], "deploy/local/kube.sh start installs the CRDs of KEDA and the Prometheus Operator"
    nodes = kubectl.get("nodes")["items"]
    assert any((condition(n, "Ready") or {}).get("status") == "True" for n in nodes), "no Ready node: is kwok running?"
    return kubectl


@pytest.fixture
def namespace(cluster: Kubectl) -> Iterator[Kubectl]:
    """kubectl in a fresh namespace that enforces the restricted profile; deleted afterwards."""
    name = f"skillstats-test-{uuid.uuid4().hex[:8]}"
    cluster.applied(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": POD_SECURITY_LABELS}}]
    )
    try:
        yield Kubectl(cluster.kubeconfig, name)
    finally:
        # Not waited for: the namespace controller removes what is in it, kwok the pods.
        cluster.run("delete", "namespace", name, "--wait=false")
