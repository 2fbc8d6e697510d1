"""clients/typescript, run with Node: its unit tests, its verdicts against Python's on one corpus, and its two
transports against the real broker and a real `skillstats ingest`, counted exactly by both groups.

The README's test command builds the package first (`npm ci`, `tsc`: deploy/local/test.sh).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tarfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from skillstats.config import Settings
from skillstats.contract import Invalid, decode, make_event
from skillstats.kafka import ensure_topics
from skillstats.workload import Record, generate
from tests.helpers import (
    WorkerProcess,
    actual_docstats,
    actual_windows,
    caught_up,
    expected_docstats,
    expected_windows,
    murmur2_partition,
    read_records,
    run_docsync,
    wait_until,
)
from tests.test_ingest import TOKEN, start_ingest

CLIENT = Path(__file__).resolve().parent.parent / "clients" / "typescript"


def node_test(*files: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    node = shutil.which("node")
    if node is None or not (CLIENT / "dist" / "test").is_dir():
        pytest.fail("no built TypeScript client: run the README's test command (it runs npm ci and tsc)")
    return subprocess.run(
        [node, "--test", *(str(CLIENT / "dist" / "test" / f) for f in files)],
        cwd=CLIENT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def corpus(now: int) -> list[tuple[Any, str]]:
    """Events and near-events, each with Python's verdict: "valid" or the contract's reason.

    Only what JavaScript can hold: a float with an integral value (1.0) is the integer 1 once JSON.parse has
    read it, and JSON.stringify writes it back as 1, so a TypeScript publisher can never send "1.0"."""
    good = orjson.loads(make_event("sk_1", "download", now - 1000, event_id="e1", now_ms=now).encode())
    clear = {**good, "kind": "install_clear", "delta": {"all_time": -3, "current": 2}}
    cases: list[Any] = [good, clear, 5, "x", [good], None]
    for field, values in {
        "v": [2, 0, "1", None, True, 1.5],
        "event_id": ["", "x" * 128, "x" * 129, 7, None, "é" * 128, "😀" * 128, "😀" * 129],
        "skill_id": ["", "s" * 129, 0, ["a"], "ok-🙂"],
        "kind": ["upvote", "Download", 3, None, *("star", "unstar", "comment", "uncomment", "install_new")],
        "occurred_at": [
            0, 946_684_799_999, 946_684_800_000, now + 10 * 60_000, now + 10 * 60_000 + 1, 253_402_300_799_999,
            253_402_300_800_000, 1.5, "2026-12-01T00:00:00Z", None, True,
        ],
    }.items():  # fmt: skip
        cases += [{**good, field: value} for value in values]
    for delta in [None, {}, {"all_time": 1}, {"all_time": 10**9, "current": -(10**9)}, {"all_time": 10**9 + 1,
                  "current": 0}, {"all_time": 1.5, "current": 0}, {"all_time": "1", "current": 0}, [1, 2]]:  # fmt: skip
        cases.append({**clear, "delta": delta})
    cases += [{k: v for k, v in good.items() if k != missing} for missing in good]
    cases.append({**good, "extra": "fields are allowed"})
    verdicts = []
    for case in cases:
        value = orjson.dumps(case)
        key = case["skill_id"].encode() if isinstance(case, dict) and isinstance(case.get("skill_id"), str) else None
        result = decode(key, value, now)
        verdicts.append((case, result.reason.value if isinstance(result, Invalid) else "valid"))
    return verdicts


def test_the_clients_unit_tests_and_its_verdicts_on_the_contract_corpus(tmp_path: Path) -> None:
    now = int(time.time() * 1000)
    path = tmp_path / "corpus.json"
    cases = corpus(now)
    path.write_text(json.dumps({"now": now, "cases": cases}))
    assert len({verdict for _c, verdict in cases}) >= 6  # the corpus covers most reasons
    result = node_test("contract.test.js", "http.test.js", env={"SKILLSTATS_CONTRACT_CORPUS": str(path)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# fail 0" in result.stdout and "# skipped 0" in result.stdout, result.stdout[-2000:]


def test_both_transports_are_counted_exactly_on_the_contracts_partitions(
    settings: Settings, registry_rows: dict[str, str | None], tmp_path: Path
) -> None:
    now = int(time.time() * 1000)
    records = [r for r in generate(4000, now_ms=now, skills=2000, seed=9, days=2) if r.valid]
    # And one event for each of 3,000 more skills, so that the partitions are checked on thousands of keys.
    for index in range(3000):
        event = make_event(f"spread-{index}", "download", now - index)
        records.append(Record(event.key, event.encode(), True))
    events = tmp_path / "events.jsonl"
    events.write_bytes(b"".join((r.value or b"") + b"\n" for r in records))
    ingest, url = start_ingest(settings, tmp_path)
    result = node_test(
        "live.test.js",
        env={
            "SKILLSTATS_INGEST_URL": url,
            "SKILLSTATS_INGEST_TOKEN": TOKEN,
            "SKILLSTATS_KAFKA": settings.kafka_bootstrap,
            "SKILLSTATS_TOPIC": settings.topic,
            "SKILLSTATS_EVENTS_FILE": str(events),
        },
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# pass 1" in result.stdout, result.stdout[-2000:]
    assert ingest.terminate() == 0

    on_topic = read_records(settings, settings.topic)
    assert sorted(r.value or b"" for r in on_topic) == sorted(r.value or b"" for r in records)  # once each
    keys = {r.key for r in on_topic}
    assert len(keys) > 3000
    wrong = [r for r in on_topic if r.partition != murmur2_partition(r.key or b"", 12)]
    assert wrong == [], f"{len(wrong)} of {len(on_topic)} records off the contract's partition"

    worker = WorkerProcess(settings, tmp_path / "windows.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "windows to apply both transports' events")
    assert worker.terminate() == 0
    assert actual_windows(settings) == expected_windows(records)
    code, _ = run_docsync(settings)
    assert code == 0
    skill_stats, owner_stats, _unknown = expected_docstats(records, registry_rows)
    assert actual_docstats(settings) == (skill_stats, owner_stats)


def test_the_kafka_transport_recovers_when_kafka_comes_back_and_loses_nothing_after_a_cut_publish(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """clients/typescript/test/kafka-faults.test.ts, through a TCP proxy in front of the real broker: a publisher
    whose first connect failed publishes once Kafka is back; a publish whose answer was cut after the broker wrote
    it rejects, and every event published after it is on the topic, once (kafkajs' idempotent producer rolls a
    partition's sequence back after a failed request: the next batch of the same size would be taken for a
    duplicate and dropped, acknowledged, unless the publisher makes a new producer)."""
    run = uuid.uuid4().hex[:10]
    settings = Settings(kafka_bootstrap=kafka_bootstrap, topic=f"ts-faults-{run}", dlq_topic=f"ts-faults-{run}.dlq")
    ensure_topics(settings, {settings.topic: 3})
    result = node_test(
        "kafka-faults.test.js", env={"SKILLSTATS_KAFKA": kafka_bootstrap, "SKILLSTATS_FAULTS_TOPIC": settings.topic}
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# pass 3" in result.stdout and "# skipped 0" in result.stdout, result.stdout[-2000:]

    written = Counter(orjson.loads(r.value or b"")["event_id"] for r in read_records(settings, settings.topic))
    expected = Counter(
        ["back-1", "back-2", "back-3"]  # "away-1" and "away-2" never reached the broker
        + ["cut-before", "cut-unanswered"]  # the second one rejected, yet written: what a rejected publish means
        + [f"cut-after-{i}" for i in range(1, 5)]
        + ["many-first"]
        + [f"many-{i}" for i in range(200)]
    )
    assert written == expected


REPO = CLIENT.parent.parent
INSTALL_README = CLIENT / "README.md"


def install_block(readme: Path) -> str:
    """The README's install steps: its ```sh block that runs `npm pack`."""
    blocks = re.findall(r"^```sh\n(.*?)^```$", readme.read_text(), re.S | re.M)
    found = [block for block in blocks if re.search(r"^npm pack\b", block, re.M)]
    assert len(found) == 1, f"{readme}: {len(found)} sh blocks that run npm pack (want one: the install steps)"
    return found[0]


def test_the_readme_sends_installers_to_the_steps_the_test_runs() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert "clients/typescript/README.md#install" in text and "npm pack" in text
    assert "## Install" in INSTALL_README.read_text(encoding="utf-8")


# Run in the fresh project after the README's steps, without kafkajs; argv[2]: a loopback port nothing listens on.
NO_KAFKAJS = r"""
import { createServer } from "node:http";
import * as client from "@skillstats/client";

const { HttpPublisher, PublishFailed, download } = client;
const out = {};
const thrown = (make) => {
  try {
    make();
    return null;
  } catch (error) {
    return `${error.name}: ${error.message}`;
  }
};
out.noUrl = thrown(() => new HttpPublisher({ token: "t" }));
out.unsetUrl = thrown(() => new HttpPublisher({ url: process.env.SKILLSTATS_SURELY_UNSET, token: "t" }));
out.badUrl = thrown(() => new HttpPublisher({ url: "ingest:9320", token: "t" }));
out.noToken = thrown(() => new HttpPublisher({ url: "http://127.0.0.1:9320" }));
out.emptyToken = thrown(() => new HttpPublisher({ url: "http://127.0.0.1:9320", token: "" }));

// The base address and the curl example's address, to a stand-in server: which path each request went to.
const paths = [];
const stand = createServer((request, response) => {
  paths.push(request.url);
  request.resume();
  request.on("end", () => {
    response.writeHead(202, { "Content-Type": "application/json" });
    response.end('{"accepted":1}');
  });
});
await new Promise((resolve) => stand.listen(0, "127.0.0.1", resolve));
const base = `http://127.0.0.1:${stand.address().port}`;
for (const url of [base, `${base}/v1/events`, `${base}/v1/events/`]) {
  const publisher = new HttpPublisher({ url, token: "t", lingerMs: 0 });
  await publisher.publish(download("sk_1"));
  await publisher.close();
}
await new Promise((resolve) => stand.close(resolve));
out.paths = paths;

const closed = `http://127.0.0.1:${process.argv[2]}/v1/events`;
const publisher = new HttpPublisher({ url: closed, token: "t", lingerMs: 0, maxAttempts: 2, baseDelayMs: 1 });
try {
  await publisher.publish(download("sk_1"));
  out.refused = null;
} catch (error) {
  const publishFailed = typeof PublishFailed === "function" && error instanceof PublishFailed;
  out.refused = { name: error.name, message: error.message, publishFailed };
}
try {
  await import("@skillstats/client/kafka");
  out.kafka = null;
} catch (error) {
  out.kafka = `${error.code}: ${error.message}`;
}
console.log(JSON.stringify(out));
"""

# After `npm install kafkajs`: the Kafka entry imports and makes a publisher (no connection: none is made before
# the first publish).
WITH_KAFKAJS = r"""
import { KafkaPublisher } from "@skillstats/client/kafka";
const kafka = new KafkaPublisher({ brokers: ["127.0.0.1:9"] });
await kafka.close();
console.log(JSON.stringify({ topic: kafka.topic }));
"""

# Type-checked in the fresh project: the package's types resolve by name, for both entries.
CONSUMER_TS = """
import { download, HttpPublisher, PublishFailed, type StatEvent } from "@skillstats/client";
import { KafkaPublisher } from "@skillstats/client/kafka";

const event: StatEvent = download("sk_1");
const http = new HttpPublisher({ url: "http://ingest:9320", token: null });
// @ts-expect-error: token is required (null for a server started with --no-auth)
new HttpPublisher({ url: "http://ingest:9320" });
const kafka = new KafkaPublisher({ brokers: ["kafka:9092"] });
export const used: unknown[] = [event, http.url, kafka.topic, PublishFailed];
"""


def test_the_readmes_install_steps_install_a_package_that_imports_by_name_and_fails_clearly(tmp_path: Path) -> None:
    """The client README's install block, run as written: `npm ci` and `npm pack` in a copy of clients/typescript
    (what a checkout holds: no node_modules, no dist), `npm install <tarball>` in a fresh project beside it, then
    node scripts there that import the package by name. npm is told to prefer its cache (npm_config_prefer_offline):
    the lock's packages and kafkajs are there after the test command's own `npm ci`, else the registry is asked."""
    steps = install_block(INSTALL_README)
    before, kafkajs_line, after = steps.partition("npm install kafkajs")
    assert kafkajs_line and before.endswith("\n"), "the install block's last step installs kafkajs"
    checkout = tmp_path / "skillstats"
    shutil.copytree(
        CLIENT, checkout / "clients" / "typescript", ignore=shutil.ignore_patterns("node_modules", "dist", "*.tgz")
    )
    app = tmp_path / "your-app"
    app.mkdir()
    (app / "package.json").write_text(json.dumps({"name": "your-app", "private": True, "type": "module"}))
    env = {
        **os.environ,
        "npm_config_prefer_offline": "true",
        "npm_config_audit": "false",
        "npm_config_fund": "false",
        "npm_config_update_notifier": "false",
    }

    def bash(script: str, cwd: Path) -> str:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, f"{script}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result.stdout

    def node(script: str, *args: str) -> Any:
        (app / "check.mjs").write_text(script)
        result = subprocess.run(["node", "check.mjs", *args], cwd=app, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    # Everything up to kafkajs, from the checkout's top; the steps end in the project (printed by pwd).
    assert bash(before + "pwd\n", checkout).strip().splitlines()[-1] == str(app)

    tarballs = list((checkout / "clients" / "typescript").glob("*.tgz"))
    assert [t.name for t in tarballs] == ["skillstats-client-0.1.0.tgz"], tarballs
    with tarfile.open(tarballs[0]) as packed:
        shipped = set(packed.getnames())
    for entry in ("index", "http", "contract", "kafka"):
        assert {f"package/dist/src/{entry}.js", f"package/dist/src/{entry}.d.ts"} <= shipped, sorted(shipped)
    assert not any("/test/" in name or (name.endswith(".ts") and not name.endswith(".d.ts")) for name in shipped)
    manifest = json.loads((app / "node_modules" / "@skillstats" / "client" / "package.json").read_text())
    assert "dependencies" not in manifest and manifest["peerDependenciesMeta"]["kafkajs"]["optional"] is True
    assert not (app / "node_modules" / "kafkajs").exists()

    with socket.socket() as closed:  # bound, never listening: a connection to it is refused
        closed.bind(("127.0.0.1", 0))
        out = node(NO_KAFKAJS, str(closed.getsockname()[1]))
        port = closed.getsockname()[1]
    for case in ("noUrl", "unsetUrl", "badUrl"):
        assert out[case] and out[case].startswith("TypeError: HttpPublisher: options.url "), out
        assert "base address" in out[case], out
    for case in ("noToken", "emptyToken"):
        assert out[case] and out[case].startswith("TypeError: HttpPublisher: options.token is missing"), out
        assert "--no-auth" in out[case], out
    assert out["paths"] == ["/v1/events"] * 3  # the base address and the curl example's: the same endpoint
    assert out["refused"]["name"] == "PublishFailed" and out["refused"]["publishFailed"], out
    message = out["refused"]["message"]
    assert f"http://127.0.0.1:{port}/v1/events after 2 attempt(s)" in message and "ECONNREFUSED" in message, message
    assert out["kafka"].startswith("ERR_MODULE_NOT_FOUND") and "'kafkajs'" in out["kafka"], out

    bash(kafkajs_line + after, app)
    assert node(WITH_KAFKAJS) == {"topic": "skill-stat-events"}
    (app / "consumer.ts").write_text(CONSUMER_TS)
    (app / "tsconfig.json").write_text(json.dumps({"compilerOptions": {
        "module": "NodeNext", "moduleResolution": "NodeNext", "target": "ES2022", "lib": ["ES2022", "DOM"],
        "types": [], "strict": True, "noEmit": True, "skipLibCheck": True,
    }, "files": ["consumer.ts"]}))  # fmt: skip
    tsc = checkout / "clients" / "typescript" / "node_modules" / "typescript" / "bin" / "tsc"
    checked = subprocess.run(["node", str(tsc), "-p", "."], cwd=app, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
