// The builders and the validity checks; with SKILLSTATS_CONTRACT_CORPUS (written by
// tests/test_typescript_client.py), the verdict on each event of the corpus against Python's.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { download, installClear, InvalidEvent, problem, statEvent, type StatEvent } from "../src/index.js";

test("builders fill v, event_id and occurred_at", () => {
  const before = Date.now();
  const event = download("sk_1");
  assert.equal(event.v, 1);
  assert.equal(event.kind, "download");
  assert.match(event.event_id, /^[0-9a-f]{32}$/);
  assert.ok(event.occurred_at >= before && event.occurred_at <= Date.now());
  assert.notEqual(download("sk_1").event_id, event.event_id);
  const at = new Date("2026-11-30T10:00:00Z");
  assert.equal(statEvent("install_new", "sk_2", { occurredAt: at, eventId: "e-1" }).occurred_at, at.getTime());
  assert.deepEqual(installClear("sk_3", { all_time: -2, current: -1 }).delta, { all_time: -2, current: -1 });
});

test("an invalid event is refused with the contract's reason", () => {
  const refused = (make: () => StatEvent): string => {
    try {
      make();
    } catch (error) {
      assert.ok(error instanceof InvalidEvent);
      return error.reason;
    }
    return "accepted";
  };
  assert.equal(refused(() => download("")), "bad_field");
  assert.equal(refused(() => download("x".repeat(129))), "bad_field");
  assert.equal(refused(() => download("sk", { occurredAt: 1 })), "bad_timestamp");
  assert.equal(refused(() => download("sk", { occurredAt: Date.now() + 11 * 60_000 })), "bad_timestamp");
  assert.equal(refused(() => download("sk", { occurredAt: 1.5e12 + 0.5 })), "bad_timestamp");
  assert.equal(refused(() => installClear("sk", { all_time: 2e9, current: 0 })), "bad_delta");
  assert.equal(refused(() => statEvent("upvote" as "download", "sk")), "unknown_kind");
  assert.equal(problem({ ...download("sk"), v: 2 })?.reason, "unsupported_version");
});

test("the verdicts agree with Python's on the shared corpus", (t) => {
  const path = process.env.SKILLSTATS_CONTRACT_CORPUS;
  if (path === undefined) {
    t.skip("SKILLSTATS_CONTRACT_CORPUS is not set (tests/test_typescript_client.py sets it)");
    return;
  }
  const corpus = JSON.parse(readFileSync(path, "utf8")) as { now: number; cases: [unknown, string][] };
  let checked = 0;
  for (const [event, verdict] of corpus.cases) {
    assert.equal(problem(event, corpus.now)?.reason ?? "valid", verdict, JSON.stringify(event).slice(0, 200));
    checked++;
  }
  assert.ok(checked > 50, `only ${checked} cases`);
});
