/**
 * Publishing straight to Kafka with kafkajs, for services that can hold a connection.
 *
 * The contract's partitioner is the Java client's murmur2 (docs/contract.md): a skill's events land on the
 * partition Python, Java and kcat-with-murmur2 would choose for its key. kafkajs' DefaultPartitioner is that
 * (tests/test_typescript_client.py checks it on thousands of keys against the topic itself), so this sets
 * it explicitly, never the LegacyPartitioner (which agrees on about one key in twelve).
 *
 * With @confluentinc/kafka-javascript instead, the trap: configured with a top-level
 * `bootstrap.servers` only, it partitions with librdkafka's default, CRC32, and only a non-empty
 * `kafkaJS` block switches it to murmur2. Always set `partitioner: "murmur2_random"` at the top level
 * (README, "Publish from TypeScript").
 *
 * Each event is validated before it is sent (InvalidEvent, nothing sent), against the time the record's
 * CreateTime will carry. `acks: -1` and an idempotent producer: `publish` resolves when every in-sync
 * replica has the records.
 *
 * One send at a time: publishes made while one is in flight wait, and go together in the next (up to
 * MERGE_EVENTS events; a larger publish goes alone). kafkajs numbers an idempotent producer's batches per
 * partition and, when a request fails, takes the numbers back, though the broker may have written it. Its
 * own retries of that request are then exact (same batch, same numbers: the broker knows it), but once it
 * gives up, the next batch of the same size to that partition carries the numbers of the written one, and
 * the broker acknowledges it as a duplicate without writing it. So after a send that failed, nothing more
 * goes through that producer: the publisher drops it and makes a new one (a new producer id) for the next
 * send; and sends never overlap on one producer, where one could take numbers back between another's
 * attempts. A failed connect is dropped the same way: the next publish connects again.
 *
 * A `publish` that rejects may still have written the events of some partitions, or all of them (one
 * request per broker, no transaction; the broker may have written what it never acknowledged): sending the
 * same events again counts those twice. That is at-least-once. Where a retry must be exact, publish over
 * HTTP (its requests are transactions, keyed by an Idempotency-Key).
 */

import { Kafka, Partitioners, type KafkaConfig, type Message, type Producer } from "kafkajs";

import { assertValid, encode, type StatEvent } from "./contract.js";

/** Publishes waiting while a request is in flight go together in the next, up to this many events. */
export const MERGE_EVENTS = 1000;

export interface KafkaPublisherOptions {
  brokers: string[];
  /** The events topic (default "skill-stat-events"). */
  topic?: string;
  clientId?: string;
  /** Anything else kafkajs takes (ssl, sasl, retry, socketFactory, ...). */
  kafka?: Omit<KafkaConfig, "brokers" | "clientId">;
}

/** The publisher was closed: nothing more is sent. */
export class PublisherClosed extends Error {
  constructor() {
    super("the KafkaPublisher is closed");
    this.name = "PublisherClosed";
  }
}

interface Pending {
  messages: Message[];
  resolve: () => void;
  reject: (error: unknown) => void;
}

/** A producer and its connect: used until a request on it fails, then dropped for good. */
interface Session {
  producer: Producer;
  connected: Promise<void>;
}

export class KafkaPublisher {
  readonly topic: string;
  readonly #kafka: Kafka;
  #session: Session | undefined;
  readonly #waiting: Pending[] = [];
  #sending: Promise<void> | undefined;
  readonly #dropping = new Set<Promise<void>>();
  #closed = false;

  constructor(options: KafkaPublisherOptions) {
    this.topic = options.topic ?? "skill-stat-events";
    this.#kafka = new Kafka({ ...options.kafka, brokers: options.brokers, clientId: options.clientId ?? "skillstats" });
  }

  /**
   * Validate every event, then send them all; resolves when the broker acknowledged them (acks=all). A
   * rejection (other than InvalidEvent, for which nothing is sent) may leave some or all of them written.
   */
  async publish(events: StatEvent | StatEvent[]): Promise<void> {
    const batch = Array.isArray(events) ? events : [events];
    const now = Date.now();
    for (const event of batch) {
      assertValid(event, now); // all of them before any is sent
    }
    if (this.#closed) {
      throw new PublisherClosed();
    }
    const messages = batch.map((event) => ({ ...encode(event), timestamp: String(now) }));
    return new Promise<void>((resolve, reject) => {
      this.#waiting.push({ messages, resolve, reject });
      this.#sending ??= this.#sendAll();
    });
  }

  /** Waits for the publishes made before it, then disconnects. */
  async close(): Promise<void> {
    this.#closed = true;
    await this.#sending;
    const session = this.#session;
    this.#session = undefined;
    if (session !== undefined) {
      this.#drop(session);
    }
    await Promise.all(this.#dropping);
  }

  async #sendAll(): Promise<void> {
    await Promise.resolve(); // the publishes of the caller's same turn go in the first request too
    try {
      while (this.#waiting.length > 0) {
        const group = this.#take();
        try {
          await this.#send(group.flatMap((pending) => pending.messages));
        } catch (error) {
          group.forEach((pending) => pending.reject(error));
          continue;
        }
        group.forEach((pending) => pending.resolve());
      }
    } finally {
      this.#sending = undefined;
    }
  }

  /** The first waiting publish, and those after it while they fit in MERGE_EVENTS events together. */
  #take(): Pending[] {
    const group = [this.#waiting.shift() as Pending];
    let events = group[0]?.messages.length ?? 0;
    while (this.#waiting.length > 0 && events + (this.#waiting[0]?.messages.length ?? 0) <= MERGE_EVENTS) {
      const next = this.#waiting.shift() as Pending;
      events += next.messages.length;
      group.push(next);
    }
    return group;
  }

  async #send(messages: Message[]): Promise<void> {
    if (this.#session === undefined) {
      const producer = this.#kafka.producer({
        createPartitioner: Partitioners.DefaultPartitioner, // murmur2, as the Java client
        idempotent: true,
        maxInFlightRequests: 5,
      });
      this.#session = { producer, connected: producer.connect() };
    }
    const session = this.#session;
    try {
      await session.connected;
      await session.producer.send({ topic: this.topic, acks: -1, messages });
    } catch (error) {
      // Its sequence numbers may now lie (see above), or it never connected: never send with it again.
      this.#session = undefined;
      this.#drop(session);
      throw error;
    }
  }

  #drop(session: Session): void {
    // After a failed connect too: it may have failed after some connections were made (InitProducerId).
    const done = session.connected
      .catch(() => undefined)
      .then(() => session.producer.disconnect())
      .catch(() => undefined)
      .finally(() => this.#dropping.delete(done));
    this.#dropping.add(done);
  }
}
