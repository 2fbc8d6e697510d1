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
 * replica has the records. A `publish` that rejects may still have written the records of some partitions
 * (one request per broker, no transaction): sending the same events again counts those twice. Where a
 * retry must be exact, publish over HTTP (its requests are transactions, and keyed).
 */

import { Kafka, Partitioners, type KafkaConfig, type Producer } from "kafkajs";

import { assertValid, encode, type StatEvent } from "./contract.js";

export interface KafkaPublisherOptions {
  brokers: string[];
  /** The events topic (default "skill-stat-events"). */
  topic?: string;
  clientId?: string;
  /** Anything else kafkajs takes (ssl, sasl, ...). */
  kafka?: Omit<KafkaConfig, "brokers" | "clientId">;
}

export class KafkaPublisher {
  readonly topic: string;
  readonly #producer: Producer;
  #connected: Promise<void> | undefined;

  constructor(options: KafkaPublisherOptions) {
    this.topic = options.topic ?? "skill-stat-events";
    const kafka = new Kafka({ ...options.kafka, brokers: options.brokers, clientId: options.clientId ?? "skillstats" });
    this.#producer = kafka.producer({
      createPartitioner: Partitioners.DefaultPartitioner, // murmur2, as the Java client
      idempotent: true,
      maxInFlightRequests: 5,
    });
  }

  /** Validate every event, then send them all; resolves when the broker acknowledged them (acks=all). */
  async publish(events: StatEvent | StatEvent[]): Promise<void> {
    const batch = Array.isArray(events) ? events : [events];
    const now = Date.now();
    for (const event of batch) {
      assertValid(event, now); // all of them before any is sent
    }
    this.#connected ??= this.#producer.connect();
    await this.#connected;
    await this.#producer.send({
      topic: this.topic,
      acks: -1,
      messages: batch.map((event) => ({ ...encode(event), timestamp: String(now) })),
    });
  }

  async close(): Promise<void> {
    if (this.#connected !== undefined) {
      await this.#producer.disconnect();
    }
  }
}
