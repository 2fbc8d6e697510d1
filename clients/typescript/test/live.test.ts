// Against the real broker and a real `skillstats ingest`, started by tests/test_typescript_client.py, which
// then counts what these published with both consumer groups and checks every record's partition.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { download, HttpPublisher, InvalidEvent, type StatEvent } from "../src/index.js";
import { KafkaPublisher } from "../src/kafka.js";

const env = process.env;
const live = env.SKILLSTATS_INGEST_URL !== undefined && env.SKILLSTATS_EVENTS_FILE !== undefined;

function events(): StatEvent[] {
  return readFileSync(env.SKILLSTATS_EVENTS_FILE ?? "", "utf8")
    .split("\n")
    .filter((line) => line.trim() !== "")
    .map((line) => JSON.parse(line) as StatEvent);
}

test("half the events over HTTP, half straight to Kafka; invalid ones refused before sending", { skip: !live }, async () => {
  const all = events();
  const half = Math.floor(all.length / 2);
  const http = new HttpPublisher({ url: env.SKILLSTATS_INGEST_URL ?? "", token: env.SKILLSTATS_INGEST_TOKEN ?? "", batchSize: 400 });
  await Promise.all(all.slice(0, half).map((event) => http.publish(event)));
  await assert.rejects(http.publish({ ...download("sk_never"), occurred_at: 0 }), InvalidEvent);
  await http.close();

  const kafka = new KafkaPublisher({ brokers: (env.SKILLSTATS_KAFKA ?? "").split(","), topic: env.SKILLSTATS_TOPIC ?? "" });
  try {
    const rest = all.slice(half);
    for (let i = 0; i < rest.length; i += 1000) {
      await kafka.publish(rest.slice(i, i + 1000));
    }
    await assert.rejects(kafka.publish([download("sk_never"), { ...download("sk_never"), kind: "upvote" as "download" }]), InvalidEvent);
  } finally {
    await kafka.close();
  }
});
