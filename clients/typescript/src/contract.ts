/**
 * The stat event contract (docs/contract.md), in TypeScript: the nine kinds, the builders that fill `v`,
 * `event_id` and `occurred_at`, and the same validity checks the consumers apply, so that an event this
 * accepts is counted, and one it refuses never leaves the process.
 *
 * The source of truth is skillstats/contract.py; tests/test_typescript_client.py checks that this
 * file's verdicts agree with it on the same corpus of events.
 */

export const WIRE_VERSION = 1;
export const KINDS = [
  "download",
  "install_new",
  "install_reactivate",
  "install_deactivate",
  "install_clear",
  "star",
  "unstar",
  "comment",
  "uncomment",
] as const;
export type Kind = (typeof KINDS)[number];

export const MAX_VALUE_BYTES = 64 * 1024;
export const MAX_ID_CHARS = 128;
export const MAX_ABS_DELTA = 1_000_000_000;
export const EPOCH_2000_MS = 946_684_800_000;
export const MAX_FUTURE_SKEW_MS = 10 * 60 * 1000;
export const MAX_OCCURRED_AT_MS = 253_402_300_799_999;

/** `install_clear`'s corrections, applied to the skill's counters as given. */
export interface Delta {
  all_time: number;
  current: number;
}

/** One event as it goes on the wire. */
export interface StatEvent {
  v: typeof WIRE_VERSION;
  event_id: string;
  skill_id: string;
  kind: Kind;
  occurred_at: number;
  delta?: Delta;
}

/** Why an event is invalid: the contract's reason codes (the DLQ's). */
export type Reason =
  | "malformed"
  | "unsupported_version"
  | "bad_field"
  | "key_mismatch"
  | "unknown_kind"
  | "bad_timestamp"
  | "bad_delta";

export class InvalidEvent extends Error {
  constructor(
    readonly reason: Reason,
    message: string,
  ) {
    super(`${reason}: ${message}`);
    this.name = "InvalidEvent";
  }
}

export interface EventOptions {
  /** Milliseconds since the epoch (default: now). */
  occurredAt?: number | Date;
  /** Unique per event (default: a random UUID). */
  eventId?: string;
  /** Only with `install_clear`. */
  delta?: Delta;
}

function randomId(): string {
  return globalThis.crypto.randomUUID().replaceAll("-", "");
}

/** A valid event of `kind` for `skillId`, or an InvalidEvent thrown saying why not. */
export function statEvent(kind: Kind, skillId: string, options: EventOptions = {}): StatEvent {
  const at = options.occurredAt ?? Date.now();
  const event: StatEvent = {
    v: WIRE_VERSION,
    event_id: options.eventId ?? randomId(),
    skill_id: skillId,
    kind,
    occurred_at: at instanceof Date ? at.getTime() : at,
  };
  if (options.delta !== undefined) {
    event.delta = { all_time: options.delta.all_time, current: options.delta.current };
  }
  assertValid(event);
  return event;
}

export const download = (skillId: string, options?: EventOptions) => statEvent("download", skillId, options);
export const installNew = (skillId: string, options?: EventOptions) => statEvent("install_new", skillId, options);
export const installReactivate = (skillId: string, options?: EventOptions) =>
  statEvent("install_reactivate", skillId, options);
export const installDeactivate = (skillId: string, options?: EventOptions) =>
  statEvent("install_deactivate", skillId, options);
/** The registry's own corrections: the counters move by `delta` (each |x| <= 10^9, may be negative). */
export const installClear = (skillId: string, delta: Delta, options: Omit<EventOptions, "delta"> = {}) =>
  statEvent("install_clear", skillId, { ...options, delta });

// With the u flag a surrogate pair is one code point, so this matches only an unpaired half, which has no
// UTF-8 form: JSON.stringify writes it as an escape the consumers' parser refuses (malformed).
const LONE_SURROGATE = /[\uD800-\uDFFF]/u;

const isInt = (value: unknown): value is number => typeof value === "number" && Number.isSafeInteger(value);

function checkId(name: string, value: unknown): InvalidEvent | null {
  if (typeof value !== "string" || value.length === 0 || [...value].length > MAX_ID_CHARS) {
    return new InvalidEvent("bad_field", `${name} must be a string of 1-${MAX_ID_CHARS} characters`);
  }
  if (LONE_SURROGATE.test(value)) {
    return new InvalidEvent("malformed", `${name} holds a lone surrogate (not UTF-8)`);
  }
  return null;
}

/**
 * Why `event` would not be counted, or null when it would: checked against `nowMs`, which stands for the
 * record's Kafka timestamp (its CreateTime is the publisher's clock when it is sent).
 */
export function problem(event: unknown, nowMs: number = Date.now()): InvalidEvent | null {
  if (typeof event !== "object" || event === null || Array.isArray(event)) {
    return new InvalidEvent("malformed", "value is not a JSON object");
  }
  const body = event as Record<string, unknown>;
  if (!(isInt(body.v) && body.v === WIRE_VERSION)) {
    return new InvalidEvent("unsupported_version", `v must be the integer ${WIRE_VERSION}`);
  }
  const bad = checkId("event_id", body.event_id) ?? checkId("skill_id", body.skill_id);
  if (bad !== null) {
    return bad;
  }
  if (typeof body.kind !== "string" || !(KINDS as readonly string[]).includes(body.kind)) {
    return new InvalidEvent("unknown_kind", `kind ${JSON.stringify(body.kind)} is not one of ${KINDS.join(", ")}`);
  }
  const at = body.occurred_at;
  if (!isInt(at)) {
    return new InvalidEvent("bad_timestamp", "occurred_at must be integer milliseconds since the epoch");
  }
  if (at < EPOCH_2000_MS) {
    return new InvalidEvent("bad_timestamp", `occurred_at ${at} is before 2000-01-01T00:00Z`);
  }
  if (at > MAX_OCCURRED_AT_MS) {
    return new InvalidEvent("bad_timestamp", `occurred_at ${at} is after 9999-12-31T23:59:59.999Z`);
  }
  if (at > nowMs + MAX_FUTURE_SKEW_MS) {
    return new InvalidEvent("bad_timestamp", `occurred_at ${at} is more than 10 minutes in the future`);
  }
  if (body.kind === "install_clear") {
    const delta = body.delta as Record<string, unknown> | undefined;
    if (typeof delta !== "object" || delta === null || Array.isArray(delta)) {
      return new InvalidEvent("bad_delta", "install_clear needs delta {all_time, current}");
    }
    for (const value of [delta.all_time, delta.current]) {
      if (!isInt(value) || Math.abs(value) > MAX_ABS_DELTA) {
        return new InvalidEvent("bad_delta", `delta values must be integers with |x| <= ${MAX_ABS_DELTA}`);
      }
    }
  }
  if (new TextEncoder().encode(JSON.stringify(body)).length > MAX_VALUE_BYTES) {
    return new InvalidEvent("malformed", "value is over 64 KiB");
  }
  return null;
}

export function assertValid(event: unknown, nowMs?: number): asserts event is StatEvent {
  const found = problem(event, nowMs);
  if (found !== null) {
    throw found;
  }
}

/** The record a publisher sends: the UTF-8 skill id as its key, the event's JSON as its value. */
export function encode(event: StatEvent): { key: string; value: string } {
  return { key: event.skill_id, value: JSON.stringify(event) };
}
