/**
 * @skillstats/client: publish skillstats stat events from TypeScript.
 *
 * - `HttpPublisher` (this module): over HTTP to `skillstats ingest`, with fetch only (Node 20+, Deno,
 *   Convex actions, edge functions).
 * - `KafkaPublisher` (`@skillstats/client/kafka`): straight to Kafka with kafkajs, for long-running services.
 *
 * Both validate every event with the contract's rules before sending it (InvalidEvent: nothing sent).
 */

export * from "./contract.js";
export { HttpPublisher, PublishFailed, PublishRefused, type HttpPublisherOptions } from "./http.js";
