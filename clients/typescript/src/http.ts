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
 * A request that never got an answer (refused, unreachable, timed out), after its last attempt, rejects its
 * events with PublishFailed, which names the URL it tried.
 *
 * `url` and `token` are checked at construction: a missing or malformed one throws there, not at the first
 * publish (the usual cause: an environment variable that is not set, read with `process.env.X!`).
 */

import { assertValid, type StatEvent } from "./contract.js";

export interface HttpPublisherOptions {
  /**
   * The server's base address, e.g. "https://ingest.internal:9320" (or with a path prefix, behind a proxy): the
   * path /v1/events is added. An address already ending in /v1/events is taken as the same endpoint.
   */
  url: string;
  /** A bearer token from the server's tokens file, or null for a server started with --no-auth. */
  token: string | null;
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

/**
 * The server refused a request (for good, or a retried status on the last attempt): its status, what it said
 * (null when the body was not JSON) and the URL it was sent to.
 */
export class PublishRefused extends Error {
  constructor(
    readonly status: number,
    readonly body: unknown,
    readonly url: string = "",
  ) {
    super(`skillstats ingest${url === "" ? "" : ` at ${url}`} answered ${status}: ${JSON.stringify(body)}`);
    this.name = "PublishRefused";
  }
}

/**
 * No answer to a request after its last attempt (connection refused, host unreachable, a timeout): the URL it
 * tried, the number of attempts, and the last error as `cause`. Whether the server published it is not
 * known; the same events in the same request, sent again, are answered as before, not published twice.
 */
export class PublishFailed extends Error {
  constructor(
    readonly url: string,
    readonly attempts: number,
    cause: unknown,
  ) {
    super(`no answer from skillstats ingest at ${url} after ${attempts} attempt(s): ${describe(cause)}`, { cause });
    this.name = "PublishFailed";
  }
}

/** An error and the causes under it: fetch's own message ("fetch failed") hides the reason in `cause`. */
function describe(error: unknown): string {
  const parts: string[] = [];
  for (let at: unknown = error; at !== undefined && at !== null && parts.length < 4; ) {
    const message = at instanceof Error ? at.message : String(at);
    if (message !== "" && !parts.includes(message)) {
      parts.push(message);
    }
    at = at instanceof Error ? at.cause : undefined;
  }
  return parts.join(": ") || "unknown error";
}

/** The endpoint for `url` (its base address), or a TypeError saying what is wrong with it. */
export function endpoint(url: unknown): string {
  const hint = 'give skillstats ingest\'s base address, e.g. "http://ingest:9320"';
  if (typeof url !== "string" || url.trim() === "") {
    const got = typeof url === "string" ? "an empty string" : String(url);
    throw new TypeError(`HttpPublisher: options.url is missing (${got}): ${hint}`);
  }
  let parsed: URL;
  try {
    parsed = new URL(url.trim());
  } catch {
    throw new TypeError(`HttpPublisher: options.url ${JSON.stringify(url)} is not a URL: ${hint}`);
  }
  if (parsed.protocol !== "http:" && parsed.protocol !== "https:") {
    throw new TypeError(`HttpPublisher: options.url ${JSON.stringify(url)} is not http(s): ${hint}`);
  }
  if (parsed.search !== "" || parsed.hash !== "") {
    throw new TypeError(`HttpPublisher: options.url ${JSON.stringify(url)} has a query or fragment: ${hint}`);
  }
  parsed.pathname = parsed.pathname.replace(/\/+$/, "").replace(/\/v1\/events$/, "") + "/v1/events";
  return parsed.href;
}

interface Pending {
  event: StatEvent;
  resolve: () => void;
  reject: (error: unknown) => void;
}

const RETRIED = new Set([409, 429, 502, 503, 504]);

export class HttpPublisher {
  /** Where requests go: the base address given, with /v1/events. */
  readonly url: string;
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
    if (typeof options !== "object" || options === null) {
      throw new TypeError("HttpPublisher: options { url, token } are missing");
    }
    this.url = endpoint(options.url);
    this.#headers = { "Content-Type": "application/x-ndjson" };
    const token: unknown = options.token;
    if (typeof token === "string" && token.trim() !== "") {
      this.#headers.Authorization = `Bearer ${token}`;
    } else if (token !== null) {
      const got = typeof token === "string" ? "an empty string" : String(token);
      throw new TypeError(
        `HttpPublisher: options.token is missing (${got}): give a bearer token from the server's tokens file, ` +
          "or token: null for a server started with --no-auth",
      );
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
        const response = await this.#fetch(this.url, {
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
          const refused = new PublishRefused(response.status, answer, this.url);
          for (const pending of batch) {
            pending.reject(refused);
          }
          return;
        }
        lastError = new PublishRefused(response.status, answer, this.url);
        const header = Number(response.headers.get("Retry-After"));
        retryAfterMs = Number.isFinite(header) && header > 0 ? header * 1000 : undefined;
      } catch (error) {
        lastError = new PublishFailed(this.url, attempt + 1, error); // not known: the key makes a retry safe
      }
      if (attempt + 1 === this.#maxAttempts) {
        break; // no wait after the last attempt
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
