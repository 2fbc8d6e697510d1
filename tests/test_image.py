"""The built image, run the way the manifests run it (deploy/local/test-deploy.sh).

deploy/local/image.sh builds the project's own Dockerfile with podman and names the
result in SKILLSTATS_TEST_IMAGE. Every workload here is the rendered manifests' own
pod template (the base with the ingest component) played by `podman kube play`:
its args, env, envFrom, security context (uid 10001, read-only root, no
capabilities), volumes (the emptyDir /tmp, the tokens Secret) as written, with
`hostNetwork: true` and the image under test the only changes to a template, and
what podman 4.3 (Debian bookworm's) needs to play it as a kubelet would: no named
ports on the host's network, an emptyDir per pod, a Secret volume's files written
by the test (`Pods.play` says why). What
a test changes besides is only what points the workloads at this machine: the
ConfigMap's Kafka bootstrap, topic and groups and the Secret's database URL (as an
overlay would), and init's replication factor (one broker here). The probes are
asked on the manifest's own ports and paths from outside the container, and events
are published from outside it too.

What this cannot show, a real cluster can: scheduling, the pod network, Services,
resource limits, and probes run by a kubelet (tests/test_kube.py has the API server
and the controllers, with fake nodes).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from skillstats.config import Settings
from skillstats.kafka import end_offsets
from skillstats.workload import generate
from tests.conftest import _fresh_postgres_database, record_metric
from tests.helpers import (
    actual_docstats,
    actual_windows,
    caught_up,
    expected_docstats,
    expected_windows,
    get,
    publish,
    registry,
    seed_registry,
    wait_until,
)
from tests.test_deploy import ROOT, pod_specs, render
from tests.test_ingest import lines, post

pytestmark = [pytest.mark.deploy, pytest.mark.kafka, pytest.mark.postgres]

PODMAN = [str(ROOT / "deploy" / "local" / "image.sh"), "podman"]
TOKEN = "image-test-token"
# What the manifests' images are called before an overlay renames them.
MANIFEST_IMAGE = "localhost/skillstats"


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check:
        assert done.returncode == 0, f"podman {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def image() -> str:
    name = os.environ.get("SKILLSTATS_TEST_IMAGE")
    if not name:
        pytest.fail("no image: run deploy/local/test-deploy.sh (it builds one and sets SKILLSTATS_TEST_IMAGE)")
    podman("image", "exists", name)
    return name


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Each workload's pod spec and the rendered ConfigMap, from the base with the ingest component."""
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", copy)  # kustomize refuses absolute paths to a base
    overlay = copy / "overlays" / "image-test"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [../../base]\ncomponents: [../../components/ingest]\n"
    )
    objects = render(overlay)
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("skillstats"))
    found = {name.split("/")[1]: (spec, config) for name, spec in pod_specs(objects)}
    assert {"skillstats-windows", "skillstats-init", "skillstats-docsync", "skillstats-lag-exporter"} <= set(found)
    assert "skillstats-ingest" in found
    return found


def probes(pod: dict[str, Any]) -> dict[str, str]:
    """The container's probes (startup, liveness, readiness) as URLs on this host."""
    (container,) = pod["containers"]
    ports = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
    urls = {}
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        if kind in container:
            http = container[kind]["httpGet"]  # every probe the manifests declare is an HTTP GET
            port = ports.get(http["port"], http["port"])
            urls[kind] = f"http://127.0.0.1:{port}{http['path']}"
    return urls


def replaced(args: list[str], flag: str, value: str) -> list[str]:
    assert flag in args, f"{flag} not in {args}"
    changed = list(args)
    changed[changed.index(flag) + 1] = value
    return changed


class Pods:
    """Workloads' pod templates run by `podman kube play`, as rendered; all removed when the test ends.

    The one change to a template is `hostNetwork: true` (the broker and the database
    are on this host's loopback, and the probes are asked from outside), plus the
    image under test in place of the manifests' name. The ConfigMap goes into the
    same play; the Secrets become podman secrets of the same names, the form
    `kube play` reads them in (a JSON object of base64 values).
    """

    def __init__(self, image: str, config: dict[str, Any], secrets: dict[str, dict[str, str]], files: Path) -> None:
        self.image, self.files, self.config, self.secret_data = image, files, config, secrets
        self.volumes: list[str] = []
        self.plays: list[Path] = []
        for name, data in secrets.items():
            encoded = files / f"secret-{name}.json"
            encoded.write_text(json.dumps({k: base64.b64encode(v.encode()).decode() for k, v in data.items()}))
            podman("secret", "rm", name, check=False)
            podman("secret", "create", name, str(encoded))
        self.secrets = list(secrets)

    def play(self, template: dict[str, Any], name: str, args: list[str] | None = None) -> str:
        """Start the pod `name` from this template; the name of its container."""
        spec = copy.deepcopy(template)
        (container,) = spec["containers"]
        assert container["image"].split(":")[0] == MANIFEST_IMAGE
        container["image"] = self.image
        if args is not None:
            container["args"] = args
        spec["hostNetwork"] = True
        # podman refuses port mappings on the host's network (a kubelet makes them host ports): the named
        # ports go, and the probes that name one get its number, as a kubelet resolves it.
        ports = {port["name"]: port["containerPort"] for port in container.pop("ports", [])}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            if kind in container:
                http = container[kind]["httpGet"]
                http["port"] = ports.get(http["port"], http["port"])
        # podman 4.3's kube play makes an emptyDir a named volume shared by every pod that uses the name (so
        # each gets one of its own here), and a Secret volume an empty one (so the test writes the Secret's
        # files, as a kubelet does, and mounts them read-only from the host).
        renamed = {}
        for volume in spec.get("volumes", []):
            renamed[volume["name"]] = volume["name"] = f"{name}-{volume['name']}"
            self.volumes.append(volume["name"])
            if "secret" in volume:
                source = volume.pop("secret")
                data = self.secret_data[source["secretName"]]
                folder = self.files / volume["name"]
                folder.mkdir()
                for item in source.get("items") or [{"key": key, "path": key} for key in data]:
                    (folder / item["path"]).write_text(data[item["key"]])
                volume["hostPath"] = {"path": str(folder), "type": "Directory"}
            else:
                assert set(volume) == {"name", "emptyDir"}, f"a volume this test cannot give a pod: {volume}"
        for mount in container.get("volumeMounts", []):
            mount["name"] = renamed[mount["name"]]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
        path = self.files / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all([self.config, pod]))
        self.plays.append(path)
        podman("kube", "play", str(path), timeout=300)
        return f"{name}-{container['name']}"

    def run(self, template: dict[str, Any], name: str, args: list[str] | None = None) -> tuple[int, str]:
        """Run to completion, as a Job's pod does: the exit code and the output."""
        container = self.play(template, name, args)
        code = int(podman("wait", container, timeout=600).stdout.strip())
        return code, self.logs(container)

    def logs(self, container: str) -> str:
        done = podman("logs", container, check=False)
        return (done.stdout + done.stderr)[-4000:]

    def assert_running(self, container: str) -> None:
        state = podman("inspect", "--format", "{{.State.Status}}", container).stdout.strip()
        assert state == "running", f"{container} is {state}:\n{self.logs(container)}"

    def stop(self, container: str, budget: int) -> int:
        """SIGTERM, then SIGKILL after `budget` s (terminationGracePeriodSeconds): the exit code."""
        podman("stop", "--time", str(budget), container, timeout=budget + 60)
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", container).stdout.strip())

    def remove_all(self) -> None:
        for path in self.plays:
            podman("kube", "down", str(path), check=False)
        for name in self.secrets:
            podman("secret", "rm", name, check=False)
        for volume in self.volumes:
            podman("volume", "rm", "--force", volume, check=False)


@pytest.fixture
def database_url(postgres_admin_url: str) -> Iterator[str]:
    yield from _fresh_postgres_database(postgres_admin_url)


def test_the_image_is_unprivileged_and_starts(image: str) -> None:
    inspected = json.loads(podman("image", "inspect", image).stdout)[0]
    assert inspected["Config"]["User"] == "10001:10001"
    assert inspected["Config"]["Entrypoint"] == ["skillstats"]
    begin = time.monotonic()
    done = podman(
        "run", "--rm", "--network", "none", "--read-only", "--read-only-tmpfs=false", "--cap-drop=all", image, "--help"
    )
    record_metric(f"image: `skillstats --help` in a fresh container: {time.monotonic() - begin:.2f} s")
    assert done.returncode == 0 and "windows" in done.stdout, done.stderr
    # The C module was compiled in the build stage and runs here without a compiler; its source ships beside it,
    # so the hash check (skillstats/contract.py) covered it.
    probe = "from pathlib import Path; from skillstats import contract; " + (
        "print(contract.native.__name__, Path(contract.native.__file__).with_name('_native.c').is_file())"
    )
    native = podman(
        "run", "--rm", "--network", "none", "--read-only", "--read-only-tmpfs=false", "--cap-drop=all",
        "--entrypoint", "python3", image, "-c", probe,
    )  # fmt: skip
    assert native.returncode == 0 and native.stdout.split() == ["skillstats._native", "True"], native.stderr
    record_metric(f"image: {image} is {int(inspected['Size']) / 1e6:.0f} MB")


def test_every_workload_runs_from_its_manifest_and_counts_exactly(
    image: str,
    workloads: dict[str, tuple[dict[str, Any], dict[str, Any]]],
    kafka_bootstrap: str,
    database_url: str,
    tmp_path: Path,
) -> None:
    """init, windows, the lag exporter and ingest started from their pod specs, each probed on its own port and
    path; events from outside (the Python publisher and ingest's HTTP API) counted exactly by windows and by one
    docsync drain, a container too; SIGTERM stops the long-running ones with exit 0."""
    run = uuid.uuid4().hex[:10]
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        database_url=database_url,
        topic=f"image-{run}",
        dlq_topic=f"image-{run}.dlq",
        windows_group=f"windows-{run}",
        docsync_group=f"docsync-{run}",
    )
    _spec, configmap = workloads["skillstats-windows"]
    config = {
        **configmap["data"],
        "SKILLSTATS_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "SKILLSTATS_TOPIC": settings.topic,
        "SKILLSTATS_DLQ_TOPIC": settings.dlq_topic,
        "SKILLSTATS_WINDOWS_GROUP": settings.windows_group,
        "SKILLSTATS_DOCSYNC_GROUP": settings.docsync_group,
    }
    secrets = {
        "skillstats": {"SKILLSTATS_DATABASE_URL": database_url},
        "skillstats-ingest-tokens": {"tokens": TOKEN + "\n"},
    }
    pods = Pods(image, {**configmap, "data": config}, secrets, tmp_path)
    try:
        init_pod = workloads["skillstats-init"][0]
        init_args = replaced(init_pod["containers"][0]["args"], "--replication-factor", "1")
        code, output = pods.run(init_pod, "skillstats-init-test", init_args)
        assert code == 0, output
        assert len(end_offsets(settings, settings.topic)) == 12  # the topics made, the schema migrated
        rows = registry(seed=23)
        seed_registry(settings, rows)

        started: dict[str, str] = {}
        for role in ("windows", "lag-exporter", "ingest"):
            pod = workloads[f"skillstats-{role}"][0]
            begin = time.monotonic()
            name = pods.play(pod, f"skillstats-{role}-0")
            started[role] = name
            urls = probes(pod)
            assert urls, f"{role} declares no probes"
            for kind, url in urls.items():
                wait_until(
                    lambda url=url, name=name: pods.assert_running(name) or get(url)[0] == 200,
                    120,
                    f"{role}'s {kind} ({url}) to answer 200",
                    interval=0.5,
                )
            record_metric(f"image: {role} container ready (every probe 200) after {time.monotonic() - begin:.1f} s")
            status, metrics = get(urls["livenessProbe"].rsplit("/", 1)[0] + "/metrics")
            assert status == 200 and "skillstats_" in metrics

        now = int(time.time() * 1000)
        records = [r for r in generate(6000, now_ms=now, skills=2000, seed=9, days=3) if r.valid]
        direct, over_http = records[:3000], records[3000:]
        assert publish(settings, direct) == len(direct)
        ingest_url = probes(workloads["skillstats-ingest"][0])["readinessProbe"].rsplit("/", 1)[0]
        for start in range(0, len(over_http), 1000):
            chunk = over_http[start : start + 1000]
            status, _headers, answer = post(ingest_url, lines(chunk), token=TOKEN)
            assert (status, answer) == (202, {"accepted": len(chunk)})
        assert post(ingest_url, lines(over_http[:1]), token="wrong")[0] == 401

        wait_until(
            lambda: pods.assert_running(started["windows"]) or caught_up(settings, settings.windows_group)(),
            180,
            "the windows container to count every event",
            interval=0.5,
        )
        assert actual_windows(settings) == expected_windows(records)

        lag_url = probes(workloads["skillstats-lag-exporter"][0])["livenessProbe"].rsplit("/", 1)[0] + "/metrics"
        wait_until(
            lambda: f'group="{settings.windows_group}"' in get(lag_url)[1],
            120,
            "the lag exporter to report the windows group",
            interval=0.5,
        )

        code, output = pods.run(workloads["skillstats-docsync"][0], "skillstats-docsync-test")
        assert code == 0, output
        summaries = [orjson.loads(line) for line in output.splitlines() if line.startswith("{")]
        assert summaries, output
        skill_stats, owner_stats, _unknown = expected_docstats(records, rows)
        assert actual_docstats(settings) == (skill_stats, owner_stats)

        for role, name in started.items():
            budget = workloads[f"skillstats-{role}"][0].get("terminationGracePeriodSeconds", 30)
            assert pods.stop(name, budget) == 0, f"{role} on SIGTERM:\n{pods.logs(name)}"
    finally:
        pods.remove_all()
