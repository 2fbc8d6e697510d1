/**
 * Publishing over HTTP to `skillstats ingest`, with `fetch` only: Node 20+, Deno, Bun, Convex actions, edge
 * functions. Nothing to hold open between requests, which is what a serverless function needs.
 *
 * `publish(event)` validates at once (an invalid event throws InvalidEvent and is never sent) and resolves
 * when the request carrying it was answered 202, which the server gives only once Kafka committed it.
 * Events are batched: a request goes when `batchSize` events wait or `lingerMs` after the first. What
 * is held (waiting, or sent and not yet answered) is bounded by `maxBuffered`: past it, `publish` waits
 * for room instead of growing without end while the server is slow or away.
 *
 * Every request carries an Idempotency-Key: the SHA-256 of its body, so it is kept across the request's
 * retries and is the same for the same events sent again by a new publisher (a serverless function or a
 * Convex action run again after a lost answer): such a request is answered as the first was, not published
 * twice. That holds when a re-run builds the same events (give `eventId` and `occurredAt` from your own
 * data) in the same requests (`lingerMs: 0`, or one `flush` per unit of retry); events of a random id are a
 * new request each time. 503 (nothing of it counted), 409 (its key still in flight), 429 and network
 * errors are retried with capped, jittered backoff, honouring Retry-After; every other status is final and
 * rejects the events of that request (400 lists each invalid one: a bug in the caller, not a condition).
 */

import { assertValid, type StatEvent } from "./contract.js";

export interface HttpPublisherOptions {
  /** The server, e.g. "https://ingest.internal:9320" (the path /v1/events is added). */
  url: string;
  /** A bearer token from the server's tokens file; omit only for a server started with --no-auth. */
  token?: string;
  /** Events per request (default 500; the server takes up to its --max-events, 10,000 by default). */
  batchSize?: number;
  /** How long the first event of a batch waits for company, in ms (default 50; 0 sends at once). */
  lingerMs?: number;
  /** Events waiting at most (default 10,000); `publish` waits for room past it. */
  maxBuffered?: number;
  /** Attempts per request before its events are rejected (default 8). */
  maxAttempts?: number;
  /** First retry delay in ms, doubled each attempt up to `maxDelayMs` (defaults 200 and 10,000). */
  baseDelayMs?: number;
  maxDelayMs?: number;
  /** Per-attempt timeout in ms (default 30,000). */
  timeoutMs?: number;
  /** The fetch to use (default globalThis.fetch). */
  fetch?: typeof globalThis.fetch;
}

/** The server refused a request for good (not retried): its status and what it said. */
export class PublishRefused extends Error {
  constructor(
    readonly status: number,
    readonly body: unknown,
  ) {
    super(`skillstats ingest answered ${status}: ${JSON.stringify(body)}`);
    this.name = "PublishRefused";
  }
}

interface Pending {
  event: StatEvent;
  resolve: () => void;
  reject: (error: unknown) => void;
}

const RETRIED = new Set([409, 429, 502, 503, 504]);

export class HttpPublisher {
  readonly #url: string;
  readonly #headers: Record<string, string>;
  readonly #batchSize: number;
  readonly #lingerMs: number;
  readonly #maxBuffered: number;
  readonly #maxAttempts: number;
  readonly #baseDelayMs: number;
  readonly #maxDelayMs: number;
  readonly #timeoutMs: number;
  readonly #fetch: typeof globalThis.fetch;
  #buffer: Pending[] = [];
  #inFlight = new Set<Promise<void>>();
  #timer: ReturnType<typeof setTimeout> | undefined;
  #waitingForRoom: Array<() => void> = [];
  #sending = 0; // events in requests not yet answered
  #closed = false;
  /** Requests sent, attempts included: for tests and metrics. */
  attempts = 0;

  constructor(options: HttpPublisherOptions) {
    this.#url = options.url.replace(/\/+$/, "") + "/v1/events";
    this.#headers = { "Content-Type": "application/x-ndjson" };
    if (options.token !== undefined) {
      this.#headers.Authorization = `Bearer ${options.token}`;
    }
    this.#batchSize = options.batchSize ?? 500;
    this.#lingerMs = options.lingerMs ?? 50;
    this.#maxBuffered = options.maxBuffered ?? 10_000;
    this.#maxAttempts = options.maxAttempts ?? 8;
    this.#baseDelayMs = options.baseDelayMs ?? 200;
    this.#maxDelayMs = options.maxDelayMs ?? 10_000;
    this.#timeoutMs = options.timeoutMs ?? 30_000;
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    if (this.#batchSize < 1 || this.#maxBuffered < this.#batchSize) {
      throw new RangeError("batchSize must be at least 1 and at most maxBuffered");
    }
  }

  /** Events held: waiting to be sent or sent and not yet answered (at most `maxBuffered`). */
  get buffered(): number {
    return this.#buffer.length + this.#sending;
  }

  /** Validate, buffer, and resolve once the event's request was answered 202. */
  async publish(event: StatEvent): Promise<void> {
    assertValid(event); // before anything is buffered or sent
    if (this.#closed) {
      throw new Error("HttpPublisher is closed");
    }
    while (this.buffered >= this.#maxBuffered) {
      await new Promise<void>((resolve) => this.#waitingForRoom.push(resolve));
    }
    const done = new Promise<void>((resolve, reject) => this.#buffer.push({ event, resolve, reject }));
    if (this.#buffer.length >= this.#batchSize || this.#lingerMs === 0) {
      this.#send();
    } else if (this.#timer === undefined) {
      this.#timer = setTimeout(() => this.#send(), this.#lingerMs);
    }
    return done;
  }

  /** Every event given so far: sent and answered (or rejected). */
  async flush(): Promise<void> {
    while (this.#buffer.length > 0 || this.#inFlight.size > 0) {
      this.#send();
      await Promise.allSettled([...this.#inFlight]);
    }
  }

  async close(): Promise<void> {
    this.#closed = true;
    await this.flush();
  }

  #send(): void {
    if (this.#timer !== undefined) {
      clearTimeout(this.#timer);
      this.#timer = undefined;
    }
    while (this.#buffer.length > 0) {
      const batch = this.#buffer.splice(0, this.#batchSize);
      this.#sending += batch.length;
      const request = this.#request(batch).finally(() => {
        this.#inFlight.delete(request);
        this.#sending -= batch.length;
        for (const wake of this.#waitingForRoom.splice(0, batch.length)) {
          wake();
        }
      });
      this.#inFlight.add(request);
    }
  }

  async #request(batch: Pending[]): Promise<void> {
    try {
      await this.#attempt(batch);
    } catch (error) {
      for (const pending of batch) {
        pending.reject(error); // whatever failed (even before a request went out), every event hears of it
      }
    }
  }

  async #attempt(batch: Pending[]): Promise<void> {
    const body = batch.map((p) => JSON.stringify(p.event)).join("\n") + "\n";
    const headers = { ...this.#headers, "Idempotency-Key": await bodyKey(body) };
    let lastError: unknown;
    for (let attempt = 0; attempt < this.#maxAttempts; attempt++) {
      let retryAfterMs: number | undefined;
      try {
        this.attempts++;
        const response = await this.#fetch(this.#url, {
          method: "POST",
          headers,
          body,
          signal: AbortSignal.timeout(this.#timeoutMs),
        });
        const answer: unknown = await response.json().catch(() => null);
        if (response.status === 202) {
          for (const pending of batch) {
            pending.resolve();
          }
          return;
        }
        if (!RETRIED.has(response.status)) {
          const refused = new PublishRefused(response.status, answer);
          for (const pending of batch) {
            pending.reject(refused);
          }
          return;
        }
        lastError = new PublishRefused(response.status, answer);
        const header = Number(response.headers.get("Retry-After"));
        retryAfterMs = Number.isFinite(header) && header > 0 ? header * 1000 : undefined;
      } catch (error) {
        lastError = error; // the network, or a timeout: the outcome is not known, the key makes a retry safe
      }
      const backoff = Math.min(this.#maxDelayMs, this.#baseDelayMs * 2 ** attempt) * (0.5 + Math.random() / 2);
      await new Promise((resolve) => setTimeout(resolve, Math.max(backoff, retryAfterMs ?? 0)));
    }
    for (const pending of batch) {
      pending.reject(lastError);
    }
  }
}

/** The Idempotency-Key of a request: its body's SHA-256 (WebCrypto: Node 20+, Deno, Convex, edge runtimes). */
export async function bodyKey(body: string): Promise<string> {
  const digest = await globalThis.crypto.subtle.digest("SHA-256", new TextEncoder().encode(body));
  return "sha256-" + Array.from(new Uint8Array(digest), (byte) => byte.toString(16).padStart(2, "0")).join("");
}
