// KafkaPublisher when Kafka goes away, against the real broker: every connection goes through a TCP proxy in
// this file, which can refuse connections ("Kafka away"), accept them again ("Kafka back"), and cut the
// connection that carries a Produce request once the broker has answered it, before the answer reaches the
// client ("stopped mid-publish": the broker wrote the records, the client never hears so). The shared
// broker itself is never stopped. kafkajs' `socketFactory` points every connection it makes (the bootstrap
// one and those to the advertised listener) at the proxy, so no metadata needs rewriting.
//
// Run by tests/test_typescript_client.py, which gives a fresh topic and then reads it: which events are on
// it, and how many times each, is checked there.
import assert from "node:assert/strict";
import net from "node:net";
import { test } from "node:test";

import { logLevel, type ISocketFactory } from "kafkajs";

import { download } from "../src/index.js";
import { KafkaPublisher } from "../src/kafka.js";

const env = process.env;
const live = env.SKILLSTATS_KAFKA !== undefined && env.SKILLSTATS_FAULTS_TOPIC !== undefined;
const topic = env.SKILLSTATS_FAULTS_TOPIC ?? "";

/** Frames of one direction of a Kafka connection (an int32 size, then that many bytes), seen head first. */
class Frames {
  #head = Buffer.alloc(0);
  #left = 0;

  constructor(readonly headBytes: number) {}

  /** Calls `seen` with the first `headBytes` bytes of every frame that begins or continues in `chunk`. */
  feed(chunk: Buffer, seen: (head: Buffer) => void): void {
    let at = 0;
    while (at < chunk.length) {
      if (this.#left > 0) {
        const skip = Math.min(this.#left, chunk.length - at);
        this.#left -= skip;
        at += skip;
        continue;
      }
      const take = Math.min(this.headBytes - this.#head.length, chunk.length - at);
      this.#head = Buffer.concat([this.#head, chunk.subarray(at, at + take)]);
      at += take;
      if (this.#head.length === this.headBytes) {
        const head = this.#head;
        this.#head = Buffer.alloc(0);
        this.#left = head.readInt32BE(0) + 4 - this.headBytes;
        seen(head);
      }
    }
  }
}

const PRODUCE = 0; // the Produce request's API key

/** A TCP proxy on 127.0.0.1 in front of one broker, which it can shut, open again and cut. */
class Proxy {
  #server: net.Server | undefined;
  #port = 0;
  readonly #sockets = new Set<net.Socket>();
  /** Cut the connection of the next Produce request when the broker's answer to it comes, and shut. */
  cutAtNextProduceAnswer = false;
  /** Produce requests that went through, and answers withheld by a cut. */
  produceRequests = 0;
  cuts = 0;

  constructor(readonly target: { host: string; port: number }) {}

  /** Accept connections (on the same port as before, after the first time). */
  async open(): Promise<void> {
    const server = net.createServer((client) => this.#pipe(client));
    await new Promise<void>((resolve, reject) => {
      server.once("error", reject);
      server.listen(this.#port, "127.0.0.1", () => resolve());
    });
    this.#port = (server.address() as net.AddressInfo).port;
    this.#server = server;
  }

  /** Close every connection and refuse new ones (ECONNREFUSED), as a broker that is down. */
  async shut(): Promise<void> {
    const server = this.#server;
    this.#server = undefined;
    for (const socket of this.#sockets) {
      socket.destroy();
    }
    if (server !== undefined) {
      await new Promise<void>((resolve) => server.close(() => resolve()));
    }
  }

  /** For kafkajs: every broker address it asks for leads here. */
  readonly socketFactory: ISocketFactory = ({ onConnect }) =>
    net.connect({ host: "127.0.0.1", port: this.#port }, onConnect);

  #pipe(client: net.Socket): void {
    const broker = net.connect(this.target);
    const requests = new Frames(12); // size, api key, api version, correlation id
    const answers = new Frames(8); // size, correlation id
    let withheld: number | undefined; // the correlation id of the Produce request whose answer is cut
    let cut = false;
    for (const socket of [client, broker]) {
      this.#sockets.add(socket);
      socket.on("error", () => undefined);
      socket.on("close", () => {
        this.#sockets.delete(socket);
        client.destroy();
        broker.destroy();
      });
    }
    client.on("data", (chunk: Buffer) => {
      requests.feed(chunk, (head) => {
        if (head.readInt16BE(4) === PRODUCE) {
          this.produceRequests += 1;
          if (this.cutAtNextProduceAnswer) {
            this.cutAtNextProduceAnswer = false;
            withheld = head.readInt32BE(8);
          }
        }
      });
      broker.write(chunk);
    });
    broker.on("data", (chunk: Buffer) => {
      answers.feed(chunk, (head) => {
        cut ||= withheld !== undefined && head.readInt32BE(4) === withheld;
      });
      if (!cut) {
        client.write(chunk);
        return;
      }
      // The broker answered (acks=all: the records are written); the client will never know.
      this.cuts += 1;
      void this.shut();
    });
  }
}

function proxyFor(bootstrap: string): Proxy {
  const [host, port] = (bootstrap.split(",")[0] ?? "").split(":");
  return new Proxy({ host: host ?? "127.0.0.1", port: Number(port) });
}

function publisherThrough(proxy: Proxy): KafkaPublisher {
  return new KafkaPublisher({
    brokers: (env.SKILLSTATS_KAFKA ?? "").split(","),
    topic,
    kafka: {
      socketFactory: proxy.socketFactory,
      // Give up quickly while the proxy is shut: a refused connection is refused again at once.
      retry: { retries: 2, initialRetryTime: 50, maxRetryTime: 200 },
      connectionTimeout: 2000,
      logLevel: logLevel.NOTHING,
    },
  });
}

test("a publish while Kafka is away rejects; once Kafka is back, the same publisher publishes", { skip: !live }, async () => {
  const proxy = proxyFor(env.SKILLSTATS_KAFKA ?? "");
  await proxy.open();
  await proxy.shut(); // its port now refuses connections
  const publisher = publisherThrough(proxy);
  try {
    await assert.rejects(publisher.publish(download("sk_away", { eventId: "away-1" })));
    await assert.rejects(publisher.publish(download("sk_away", { eventId: "away-2" })));
    await proxy.open();
    await publisher.publish(download("sk_away", { eventId: "back-1" }));
    await publisher.publish([download("sk_away", { eventId: "back-2" }), download("sk_other", { eventId: "back-3" })]);
  } finally {
    await publisher.close();
    await proxy.shut();
  }
});

test("a publish cut off after the broker wrote it rejects, and no event published after it is lost", { skip: !live }, async () => {
  const proxy = proxyFor(env.SKILLSTATS_KAFKA ?? "");
  await proxy.open();
  const publisher = publisherThrough(proxy);
  try {
    await publisher.publish(download("sk_cut", { eventId: "cut-before" }));
    proxy.cutAtNextProduceAnswer = true;
    await assert.rejects(publisher.publish(download("sk_cut", { eventId: "cut-unanswered" })));
    assert.equal(proxy.cuts, 1); // the broker answered that request: its record is on the topic
    await proxy.open();
    // The same size to the same partition as the cut batch: the batch a rolled-back sequence makes a duplicate.
    await publisher.publish(download("sk_cut", { eventId: "cut-after-1" }));
    await publisher.publish(download("sk_cut", { eventId: "cut-after-2" }));
    await publisher.publish([download("sk_cut", { eventId: "cut-after-3" }), download("sk_cut", { eventId: "cut-after-4" })]);
  } finally {
    await publisher.close();
    await proxy.shut();
  }
});

test("publishes made while one is in flight go together in the next request", { skip: !live }, async () => {
  const proxy = proxyFor(env.SKILLSTATS_KAFKA ?? "");
  await proxy.open();
  const publisher = publisherThrough(proxy);
  try {
    await publisher.publish(download("sk_many", { eventId: "many-first" })); // connected
    const before = proxy.produceRequests;
    await Promise.all(
      Array.from({ length: 200 }, (_, i) => publisher.publish(download(`sk_many_${i}`, { eventId: `many-${i}` }))),
    );
    // One request for the 200 (one broker; a second only if kafkajs had to retry it), not 200 one after another.
    assert.ok(proxy.produceRequests - before <= 2, `${proxy.produceRequests - before} produce requests`);
  } finally {
    await publisher.close();
    await proxy.shut();
  }
});
