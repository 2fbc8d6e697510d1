"""deploy/k8s on a real Kubernetes API server, with its controllers and kwok's fake node.

tests/test_deploy.py checks the manifests offline against schemas; here the server itself judges them:
kube-apiserver (its validation, strict field validation, Pod Security admission, the CRDs of KEDA and the
Prometheus Operator generated from their API types), kube-controller-manager (StatefulSet, Job, CronJob,
Deployment, PodDisruptionBudget and HorizontalPodAutoscaler controllers) and kube-scheduler, all of the
release deploy/local/kube.sh pins. The cluster: `deploy/local/kube.sh start`, then
SKILLSTATS_TEST_KUBECONFIG=$(deploy/local/kube.sh kubeconfig); without it these tests are skipped.

kwok stands in for the kubelet: it runs no container. A pod scheduled on its node is reported Running
and Ready at once (no probe is run), a Running pod owned by a Job is reported Succeeded (so Jobs
complete), and a deleted pod goes at once (deploy/local/kube/kwok-stages). So what is proven here is
everything the control plane does with the manifests, not that the image starts (tests/test_image.py).
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import kube_cluster
from tests.kube_cluster import (
    Kubectl,
    PodWatch,
    condition,
    example_secrets,
    overlay_namespace,
    pod_ready,
    rendered,
    rendered_with_component,
    selector_of,
    wait_until,
)
from tests.test_deploy import K8S, by_kind

pytestmark = pytest.mark.deploy
# The fixtures: the cluster (skipped without SKILLSTATS_TEST_KUBECONFIG) and a namespace of each test's own.
cluster = kube_cluster.cluster
namespace = kube_cluster.namespace

COMPONENTS = sorted(p.name for p in (K8S / "components").iterdir() if (p / "kustomization.yaml").exists())
WINDOWS = "skillstats-windows"


def deploy_production(kubectl: Kubectl) -> list[dict[str, Any]]:
    """The production overlay in the test's namespace, after the Secrets it references. (Whether the server
    warns about anything in it is test_every_rendering_is_accepted_without_a_warning's to say.)"""
    assert kubectl.namespace is not None
    kubectl.applied(example_secrets(kubectl.namespace))
    objects = rendered("production", kubectl.namespace)
    result = kubectl.apply(objects)
    assert result.returncode == 0, result.stderr
    return objects


def ready_pods(kubectl: Kubectl, selector: str, count: int) -> list[dict[str, Any]]:
    """Wait until exactly `count` pods match and all are Running and Ready; returns them."""

    def probe() -> list[dict[str, Any]] | None:
        pods = kubectl.pods(selector)
        return pods if len(pods) == count and all(pod_ready(p) for p in pods) else None

    return wait_until(f"{count} ready pods {selector} in {kubectl.namespace}", probe)


def observed(
    kubectl: Kubectl, kind: str, name: str, what: str, check: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Wait until the object `kind`/`name` passes `check` (typically on its status); returns it."""

    def probe() -> dict[str, Any] | None:
        obj = kubectl.get(kind, name)
        return obj if check(obj) else None

    return wait_until(f"{kind}/{name}: {what}", probe)


def job_completes(kubectl: Kubectl, name: str) -> dict[str, Any]:
    """Wait for the Job's Complete condition. No container runs: kwok's pod-complete stage reports the Job's
    Running pod Succeeded (exit code 0), and the Job controller counts it; a Failed condition fails at once."""

    def probe() -> dict[str, Any] | None:
        job = kubectl.get("job", name)
        failed = condition(job, "Failed")
        assert failed is None or failed["status"] != "True", f"job {name} failed: {failed}"
        complete = condition(job, "Complete")
        return job if complete and complete["status"] == "True" else None

    return wait_until(f"job {name} completes", probe)


# ------------------------------------------------------------------------- accepted as they are


@pytest.mark.parametrize("rendering", ["base", "production", *(f"component:{c}" for c in COMPONENTS)])
def test_every_rendering_is_accepted_without_a_warning(namespace: Kubectl, rendering: str, tmp_path: Path) -> None:
    """Server-side apply of the base, the production overlay and the base with each component: every object
    is stored and the server has nothing to warn about (no deprecated API, no Pod Security warning, no
    duplicate or unknown field)."""
    assert namespace.namespace is not None
    if rendering.startswith("component:"):
        objects = rendered_with_component(rendering.split(":", 1)[1], namespace.namespace, tmp_path)
    else:
        objects = rendered(rendering, namespace.namespace)
    if rendering == "production":
        namespace.applied(example_secrets(namespace.namespace))
        # The overlay's own Namespace (left out of `rendered`): accepted too, as a dry run (it is cluster-wide).
        (own,) = overlay_namespace("production")
        assert own["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        namespace.applied([own], "--dry-run=server")
    result = namespace.applied(objects)
    assert len([line for line in result.stdout.splitlines() if line.endswith("serverside-applied")]) == len(objects)
    stored = namespace.ok("get", "-f", "-", "-o", "name", stdin=yaml.safe_dump_all(objects)).split()
    assert len(stored) == len(objects), stored


# ------------------------------------------------------------------------- refused when broken


def test_pod_security_refuses_a_pod_template_that_breaks_the_restricted_profile(namespace: Kubectl) -> None:
    assert namespace.namespace is not None
    base = rendered("base", namespace.namespace)
    # Its ServiceAccount first: pods naming a missing one would be refused for that, before Pod Security.
    namespace.applied([o for o in base if o["kind"] == "ServiceAccount"])
    workers = by_kind(base, "StatefulSet", WINDOWS)
    template = workers["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "windows-probe", **template["metadata"]}}
    pod["spec"] = copy.deepcopy(template["spec"])
    # The control: the template as it is makes an admissible pod.
    namespace.applied([pod], "--dry-run=server")
    privileged = copy.deepcopy(pod)
    # (allowPrivilegeEscalation: false beside privileged: true is refused by the API's own validation.)
    del privileged["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"]
    privileged["spec"]["containers"][0]["securityContext"]["privileged"] = True
    as_root = copy.deepcopy(pod)
    del as_root["spec"]["securityContext"]["runAsNonRoot"]
    for broken, why in ((privileged, "privileged"), (as_root, "runAsNonRoot != true")):
        result = namespace.apply([broken], "--dry-run=server")
        assert result.returncode != 0, f"a pod with {why} was accepted"
        assert 'violates PodSecurity "restricted:latest"' in result.stderr and why in result.stderr, result.stderr
    # A workload is only warned about; its controller's pods are the ones refused.
    workers["spec"]["template"]["spec"] = privileged["spec"]
    result = namespace.apply([workers])
    assert result.returncode == 0, result.stderr
    assert 'Warning: would violate PodSecurity "restricted:latest": privileged' in result.stderr, result.stderr

    def refused() -> list[dict[str, Any]]:
        events = namespace.get("events", "--field-selector", f"involvedObject.name={WINDOWS},reason=FailedCreate")
        return [e for e in events["items"] if 'violates PodSecurity "restricted:latest"' in e["message"]]

    wait_until("the StatefulSet controller reports its pods refused", refused)
    assert namespace.pods(selector_of(workers["spec"]["selector"]["matchLabels"])) == []


def test_strict_field_validation_refuses_a_misspelt_field(namespace: Kubectl) -> None:
    """An unknown field is an error, in a built-in kind and in a custom resource (its CRD's schema is
    structural, so the server knows every field)."""
    assert namespace.namespace is not None
    objects = rendered("production", namespace.namespace)
    workers = by_kind(objects, "StatefulSet", WINDOWS)
    scaled = by_kind(objects, "ScaledObject", WINDOWS)
    namespace.applied([workers, scaled], "--dry-run=server")  # the control: both as rendered
    workers["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    scaled["spec"]["maxReplicaCont"] = 12
    for broken, path in ((workers, ".imagePullPolicyy"), (scaled, ".spec.maxReplicaCont")):
        result = namespace.apply([broken], "--dry-run=server")
        assert result.returncode != 0, f"{broken['kind']} with {path} was accepted"
        assert path in result.stderr and "field not declared in schema" in result.stderr, result.stderr


def test_the_prometheusrule_crd_refuses_an_invalid_duration(namespace: Kubectl) -> None:
    assert namespace.namespace is not None
    rule = by_kind(rendered("production", namespace.namespace), "PrometheusRule", "skillstats")
    namespace.applied([rule], "--dry-run=server")  # the control: the rule as rendered
    first = rule["spec"]["groups"][0]["rules"][0]
    assert "for" in first
    first["for"] = "5 minutes"
    result = namespace.apply([rule], "--dry-run=server")
    assert result.returncode != 0, "a PrometheusRule with `for: 5 minutes` was accepted"
    assert 'spec.groups[0].rules[0].for: Invalid value: "5 minutes"' in result.stderr, result.stderr
    assert "should match" in result.stderr, result.stderr


# ------------------------------------------------------------------------- run by the controllers


def test_the_windows_workers_run_under_stable_names_and_the_budget_selects_them(namespace: Kubectl) -> None:
    assert namespace.namespace is not None
    objects = rendered("base", namespace.namespace)
    namespace.applied(objects)
    workers = by_kind(objects, "StatefulSet", WINDOWS)
    replicas = workers["spec"]["replicas"]
    assert replicas >= 2
    pods = ready_pods(namespace, selector_of(workers["spec"]["selector"]["matchLabels"]), replicas)
    assert sorted(p["metadata"]["name"] for p in pods) == [f"{WINDOWS}-{i}" for i in range(replicas)]
    for pod in pods:  # each pod's SKILLSTATS_INSTANCE_ID is its name: the StatefulSet's pod-name label says so
        assert pod["metadata"]["labels"]["statefulset.kubernetes.io/pod-name"] == pod["metadata"]["name"]
    # The budget: the disruption controller counts the workers as the pods it protects.
    budget = observed(
        namespace,
        "pdb",
        WINDOWS,
        "counts the workers healthy",
        lambda b: b.get("status", {}).get("currentHealthy") == replicas,
    )
    assert budget["status"]["expectedPods"] == replicas
    assert budget["status"]["disruptionsAllowed"] == 1
    # And the other long-running worker, the lag-exporter.
    exporter = by_kind(objects, "Deployment", "skillstats-lag-exporter")
    ready_pods(namespace, selector_of(exporter["spec"]["selector"]["matchLabels"]), exporter["spec"]["replicas"])


def test_the_init_job_and_runs_of_the_cronjobs_complete(namespace: Kubectl) -> None:
    objects = deploy_production(namespace)
    (init,) = [o for o in objects if o["kind"] == "Job"]
    release = init["metadata"]["labels"]["app.kubernetes.io/version"]
    assert init["metadata"]["name"] == f"skillstats-init-{release.replace('.', '-')}"  # named by the overlay
    job = job_completes(namespace, init["metadata"]["name"])
    assert job["status"]["succeeded"] == 1
    cronjobs = sorted(o["metadata"]["name"] for o in objects if o["kind"] == "CronJob")
    assert cronjobs == ["skillstats-docsync", "skillstats-prune"]
    for cronjob in cronjobs:
        name = f"{cronjob.removeprefix('skillstats-')}-by-hand"
        namespace.ok("create", "job", name, f"--from=cronjob/{cronjob}")
        job = job_completes(namespace, name)
        template = by_kind(objects, "CronJob", cronjob)["spec"]["jobTemplate"]["spec"]
        assert job["spec"]["activeDeadlineSeconds"] == template["activeDeadlineSeconds"]
        assert job["metadata"]["annotations"]["cronjob.kubernetes.io/instantiate"] == "manual"


def test_the_scaledobject_scales_the_statefulset_the_way_keda_would(namespace: Kubectl) -> None:
    """No KEDA runs here, so the HorizontalPodAutoscaler KEDA makes of the ScaledObject (keda-hpa-<name>: its
    target, bounds and behaviour; the lag as an External metric) is created by hand. With no metrics API
    the controller still holds the minimum: the StatefulSet grows to it through its scale subresource, and
    a second apply of the overlay leaves that count alone (the keda component removed `replicas`)."""
    objects = deploy_production(namespace)
    scaled = by_kind(objects, "ScaledObject", WINDOWS)["spec"]
    target = scaled["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "StatefulSet")
    workers = namespace.get("statefulset", target["name"])  # the target exists under that name
    assert "replicas" not in by_kind(objects, "StatefulSet", WINDOWS)["spec"]
    selector = selector_of(workers["spec"]["selector"]["matchLabels"])
    ready_pods(namespace, selector, workers["spec"]["replicas"])
    trigger = scaled["triggers"][0]["metadata"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"keda-hpa-{WINDOWS}", "namespace": namespace.namespace},
        "spec": {
            "scaleTargetRef": target,
            "minReplicas": scaled["minReplicaCount"],
            "maxReplicas": scaled["maxReplicaCount"],
            "behavior": scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": f"s0-kafka-{trigger['topic']}",
                            "selector": {"matchLabels": {"scaledobject.keda.sh/name": WINDOWS}},
                        },
                        "target": {"type": "AverageValue", "averageValue": trigger["lagThreshold"]},
                    },
                }
            ],
        },
    }
    namespace.applied([hpa])
    minimum = scaled["minReplicaCount"]
    assert minimum > workers["spec"]["replicas"], "the test needs the minimum above the default of 1"
    pods = ready_pods(namespace, selector, minimum)
    assert sorted(p["metadata"]["name"] for p in pods) == [f"{WINDOWS}-{i}" for i in range(minimum)]
    observed(
        namespace,
        "hpa",
        hpa["metadata"]["name"],
        "got its target's scale",
        lambda h: (condition(h, "AbleToScale") or {}).get("status") == "True",
    )
    budget = observed(
        namespace,
        "pdb",
        WINDOWS,
        "expects the scaled workers",
        lambda b: b.get("status", {}).get("expectedPods") == minimum,
    )
    assert budget["status"]["disruptionsAllowed"] == 1
    again = namespace.apply(objects)  # a release: the overlay applied again
    assert again.returncode == 0, again.stderr
    assert namespace.get("statefulset", WINDOWS)["spec"]["replicas"] == minimum


def _rules_py_document() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("skillstats_k8s_rules", K8S / "rules.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return yaml.safe_load(module.render())


def test_the_stored_prometheusrule_is_what_rules_py_generates(namespace: Kubectl) -> None:
    """What the server keeps (after its CRD's schema pruned what it does not know) is the rules file."""
    objects = deploy_production(namespace)
    generated = _rules_py_document()
    rule = by_kind(objects, "PrometheusRule", "skillstats")
    assert rule["spec"] == generated["spec"]
    stored = namespace.get("prometheusrule", "skillstats")
    assert stored["spec"] == generated["spec"]
    assert generated["metadata"]["labels"].items() <= stored["metadata"]["labels"].items()
    assert sum(len(g["rules"]) for g in stored["spec"]["groups"]) > 0


def test_a_rolling_update_replaces_the_windows_pods_one_at_a_time(namespace: Kubectl) -> None:
    assert namespace.namespace is not None
    objects = rendered("base", namespace.namespace)
    namespace.applied(objects)
    workers = by_kind(objects, "StatefulSet", WINDOWS)
    replicas = workers["spec"]["replicas"]
    selector = selector_of(workers["spec"]["selector"]["matchLabels"])
    before = ready_pods(namespace, selector, replicas)
    old_image = before[0]["spec"]["containers"][0]["image"]
    old_revision = wait_until(
        "the StatefulSet reports its revision",
        lambda: namespace.get("statefulset", WINDOWS).get("status", {}).get("currentRevision"),
    )
    assert {p["metadata"]["labels"]["controller-revision-hash"] for p in before} == {old_revision}
    new_image = old_image.rpartition(":")[0] + ":0.1.1-rolling"
    names = [f"{WINDOWS}-{i}" for i in range(replicas)]

    watch = PodWatch(namespace, selector)
    try:
        wait_until(
            "the watch lists the pods", lambda: {o["metadata"]["name"] for _, o in watch.snapshot()} >= set(names)
        )
        namespace.ok("set", "image", f"statefulset/{WINDOWS}", f"windows={new_image}")

        def rolled_out() -> dict[str, Any] | None:
            status = namespace.get("statefulset", WINDOWS)["status"]
            done = (
                status.get("updateRevision") not in (None, old_revision)
                and status.get("currentRevision") == status["updateRevision"]
                and status.get("updatedReplicas") == replicas
                and status.get("readyReplicas") == replicas
            )
            return status if done else None

        status = wait_until("the rolling update completes", rolled_out)
        new_revision = status["updateRevision"]

        def watched_all_ready() -> bool:
            latest = {o["metadata"]["name"]: o for _, o in watch.snapshot()}
            return all(
                n in latest
                and latest[n]["metadata"]["labels"].get("controller-revision-hash") == new_revision
                and pod_ready(latest[n])
                for n in names
            )

        wait_until("the watch sees every new pod ready", watched_all_ready)
    finally:
        watch.stop()

    # Replay the events: which pods were unavailable (gone, terminating, not ready) at each moment, and the
    # order in which the pods came back on the new revision. The watch starts with the pods as they are (one
    # ADDED each): the count starts once it has listed them all.
    pods: dict[str, dict[str, Any]] = {}
    most_unavailable, unavailable_seen, order, listed = 0, 0, [], False
    for kind, pod in watch.events:
        name = pod["metadata"]["name"]
        if kind == "DELETED":
            pods.pop(name, None)
        else:
            pods[name] = pod
        listed = listed or set(pods) >= set(names)
        if not listed:
            continue
        unavailable = [n for n in names if n not in pods or not pod_ready(pods[n])]
        most_unavailable = max(most_unavailable, len(unavailable))
        unavailable_seen += bool(unavailable)
        new = pods.get(name, {}).get("metadata", {}).get("labels", {}).get("controller-revision-hash") == new_revision
        if new and name not in order:
            order.append(name)
            # Ordinal by ordinal from the highest: every higher ordinal is already updated and ready.
            for higher in names[names.index(name) + 1 :]:
                ready = higher in order and higher in pods and pod_ready(pods[higher])
                assert ready, f"{name} replaced before {higher} was ready"
    assert unavailable_seen, "the watch never saw a pod replaced"
    assert most_unavailable == 1, f"{most_unavailable} windows pods were unavailable at once"
    assert order == list(reversed(names))
    after = namespace.pods(selector)
    assert sorted(p["metadata"]["name"] for p in after) == names
    assert {p["spec"]["containers"][0]["image"] for p in after} == {new_image}
    assert {p["metadata"]["labels"]["controller-revision-hash"] for p in after} == {new_revision}
    assert new_revision != old_revision


def test_the_ingest_deployment_runs_and_its_autoscaler_finds_its_target(namespace: Kubectl) -> None:
    assert namespace.namespace is not None
    objects = deploy_production(namespace)
    deployment = by_kind(objects, "Deployment", "skillstats-ingest")
    replicas = deployment["spec"]["replicas"]
    ready_pods(namespace, selector_of(deployment["spec"]["selector"]["matchLabels"]), replicas)
    observed(
        namespace,
        "deployment",
        "skillstats-ingest",
        "Available",
        lambda d: (condition(d, "Available") or {}).get("status") == "True",
    )
    scaler = by_kind(objects, "HorizontalPodAutoscaler", "skillstats-ingest")
    target = scaler["spec"]["scaleTargetRef"]
    assert namespace.get(target["kind"].lower(), target["name"])["metadata"]["uid"]
    # The control: the same autoscaler aimed at a Deployment that does not exist cannot get its scale.
    missing = copy.deepcopy(scaler)
    missing["metadata"]["name"] = "skillstats-ingest-missing"
    missing["spec"]["scaleTargetRef"]["name"] = "skillstats-ingest-missing"
    namespace.applied([missing])

    def able_to_scale(name: str) -> dict[str, Any] | None:
        return condition(namespace.get("hpa", name), "AbleToScale")

    found = wait_until("the ingest autoscaler has a scale condition", lambda: able_to_scale("skillstats-ingest"))
    assert (found["status"], found["reason"]) == ("True", "SucceededGetScale"), found
    lost = wait_until(
        "the control autoscaler has a scale condition", lambda: able_to_scale(missing["metadata"]["name"])
    )
    assert (lost["status"], lost["reason"]) == ("False", "FailedGetScale"), lost
    budget = observed(
        namespace,
        "pdb",
        "skillstats-ingest",
        "counts the ingest pods healthy",
        lambda b: b.get("status", {}).get("currentHealthy") == replicas,
    )
    assert budget["status"]["expectedPods"] == replicas
