// HttpPublisher against a local stand-in server (a unit test: the real server is in live.test.ts).
import assert from "node:assert/strict";
import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { test } from "node:test";

import { download, HttpPublisher, InvalidEvent, PublishRefused } from "../src/index.js";
import { bodyKey, endpoint } from "../src/http.js";

type Handler = (request: IncomingMessage, body: string, response: ServerResponse) => void;

async function server(handler: Handler): Promise<{ url: string; close: () => Promise<void> }> {
  const http = createServer((request, response) => {
    let body = "";
    request.on("data", (chunk: Buffer) => (body += chunk.toString()));
    request.on("end", () => handler(request, body, response));
  });
  await new Promise<void>((resolve) => http.listen(0, "127.0.0.1", resolve));
  const { port } = http.address() as AddressInfo;
  return { url: `http://127.0.0.1:${port}`, close: () => new Promise((resolve) => http.close(() => resolve())) };
}

const answer = (response: ServerResponse, status: number, body: object, headers: Record<string, string> = {}) => {
  response.writeHead(status, { "Content-Type": "application/json", ...headers });
  response.end(JSON.stringify(body));
};

test("503 is retried with the same Idempotency-Key, honouring Retry-After, until 202", async () => {
  const keys: string[] = [];
  const stand = await server((request, body, response) => {
    keys.push(String(request.headers["idempotency-key"]));
    assert.equal(request.headers.authorization, "Bearer t");
    assert.equal(body.trim().split("\n").length, 3);
    if (keys.length < 3) {
      answer(response, 503, { error: "not published" }, { "Retry-After": "0" });
    } else {
      answer(response, 202, { accepted: 3 });
    }
  });
  const publisher = new HttpPublisher({ url: stand.url, token: "t", batchSize: 3, baseDelayMs: 5 });
  await Promise.all([publisher.publish(download("a")), publisher.publish(download("b")), publisher.publish(download("c"))]);
  assert.equal(keys.length, 3);
  assert.equal(new Set(keys).size, 1, "one request, one key, however many attempts");
  await publisher.close();
  await stand.close();
});

test("a refusal is final: 400 rejects the batch's events without a retry", async () => {
  let requests = 0;
  const stand = await server((_request, _body, response) => {
    requests++;
    answer(response, 400, { error: "1 invalid event(s)", rejected: [{ line: 1, reason: "bad_field" }] });
  });
  const publisher = new HttpPublisher({ url: stand.url, token: null, lingerMs: 0 });
  await assert.rejects(publisher.publish(download("a")), (error: unknown) => {
    assert.ok(error instanceof PublishRefused);
    assert.equal(error.status, 400);
    return true;
  });
  assert.equal(requests, 1);
  await stand.close();
});

test("an invalid event throws before anything is sent", async () => {
  let calls = 0;
  const publisher = new HttpPublisher({
    url: "http://127.0.0.1:1",
    token: null,
    fetch: async () => {
      calls++;
      return new Response(null, { status: 202 });
    },
  });
  const bad = { ...download("sk"), occurred_at: 5 };
  await assert.rejects(publisher.publish(bad), InvalidEvent);
  await publisher.flush();
  assert.equal(calls, 0);
});

test("the buffer is bounded: publish waits for room", async () => {
  const sizes: number[] = [];
  const stand = await server((_request, body, response) => {
    sizes.push(body.trim().split("\n").length);
    setTimeout(() => answer(response, 202, { accepted: 1 }), 20);
  });
  const publisher = new HttpPublisher({ url: stand.url, token: null, batchSize: 5, maxBuffered: 10, lingerMs: 1000 });
  const sent = [];
  let most = 0;
  for (let i = 0; i < 60; i++) {
    sent.push(publisher.publish(download(`sk_${i}`)));
    most = Math.max(most, publisher.buffered);
  }
  assert.ok(most <= 10, `${most} buffered`);
  await Promise.all(sent);
  await publisher.close();
  await stand.close();
  assert.equal(sizes.reduce((a, b) => a + b, 0), 60);
  assert.ok(sizes.every((size) => size <= 5), String(sizes));
});

test("the same events sent again by a new publisher carry the same Idempotency-Key; other events another", async () => {
  const keys: string[] = [];
  const stand = await server((request, _body, response) => {
    keys.push(String(request.headers["idempotency-key"]));
    answer(response, 202, { accepted: 1 });
  });
  const event = () => download("sk_1", { eventId: "ev-1", occurredAt: 1_700_000_000_000 });
  for (const chosen of [event(), event(), download("sk_1", { eventId: "ev-2", occurredAt: 1_700_000_000_000 })]) {
    const publisher = new HttpPublisher({ url: stand.url, token: null, lingerMs: 0 }); // a function run again: a new publisher
    await publisher.publish(chosen);
    await publisher.close();
  }
  assert.equal(keys.length, 3);
  assert.equal(keys[0], keys[1]);
  assert.notEqual(keys[0], keys[2]);
  assert.equal(keys[0], await bodyKey(JSON.stringify(event()) + "\n"));
  assert.match(keys[0], /^sha256-[0-9a-f]{64}$/);
  await stand.close();
});

test("a failure before any request went out rejects the events instead of leaving them waiting", async () => {
  const event = download("sk_1", { eventId: "ev-1", occurredAt: 1_700_000_000_000 });
  const real = Object.getOwnPropertyDescriptor(globalThis, "crypto");
  Object.defineProperty(globalThis, "crypto", { value: undefined, configurable: true }); // a runtime without WebCrypto
  try {
    const publisher = new HttpPublisher({ url: "http://127.0.0.1:1", token: null, lingerMs: 0 });
    await assert.rejects(publisher.publish(event), TypeError);
  } finally {
    Object.defineProperty(globalThis, "crypto", real!);
  }
});

test("url is the base address: /v1/events is added once, whatever the address ends with", () => {
  for (const [url, expected] of [
    ["http://127.0.0.1:9320", "http://127.0.0.1:9320/v1/events"],
    ["http://127.0.0.1:9320/", "http://127.0.0.1:9320/v1/events"],
    ["http://127.0.0.1:9320/v1/events", "http://127.0.0.1:9320/v1/events"], // the curl example's address
    ["https://gw.internal/stats/v1/events/", "https://gw.internal/stats/v1/events"],
    ["https://gw.internal/stats", "https://gw.internal/stats/v1/events"],
  ] as const) {
    assert.equal(endpoint(url), expected, url);
  }
  for (const url of [undefined, "", "  ", "ingest:9320/x", "127.0.0.1:9320", "ftp://h/", "http://h/?a=1"]) {
    assert.throws(() => endpoint(url), /options\.url .*base address, e\.g\./, String(url));
  }
});
