"""No record stops the windows worker: poison values, oversized parcels, aborted transactions (docs/contract.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.dlq import H_OFFSET, H_ORIGINAL_BYTES, H_PARTITION, H_REASON, H_TRUNCATED
from skillstats.workload import Record, generate
from tests.helpers import (
    WorkerProcess,
    actual_windows,
    caught_up,
    expected_windows,
    murmur2_partition,
    publish,
    read_topic,
    wait_until,
)

BIG = 1_040_000  # just under the broker's default 1 MiB message limit, incompressible


def test_poison_and_oversized_records_are_parked_and_the_rest_counted(settings: Settings, tmp_path: Path) -> None:
    # The DLQ as an operator might have created it elsewhere: far smaller than a parcel.
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        settings.dlq_topic,
        incremental_configs=[ConfigEntry("max.message.bytes", "100000", incremental_operation=AlterConfigOpType.SET)],
    )
    admin.incremental_alter_configs([resource])[resource].result(30)

    now = int(time.time() * 1000)
    records = list(generate(3000, now_ms=now, skills=200, seed=3, invalid_ratio=0.05))
    poison = [
        r for r in records if not r.valid and r.value and (r.value.count(b"[") > 500 or r.value.count(b"{") > 500)
    ]
    assert len(poison) >= 2  # nested objects and nested arrays, from the workload's invalid variants
    huge_key = b"sk_huge"
    producer = Producer(
        {"bootstrap.servers": settings.kafka_bootstrap, "message.max.bytes": 2_000_000, "partitioner": "murmur2_random"}
    )
    producer.produce(settings.topic, key=huge_key, value=os.urandom(BIG))
    producer.produce(settings.topic, key=huge_key, value=os.urandom(70_000))  # over 64 KiB: fits the DLQ whole
    assert producer.flush(30) == 0
    assert publish(settings, records) == len(records)

    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to apply everything")
    worker.assert_alive()
    assert worker.terminate() == 0, worker.log_tail()

    assert actual_windows(settings) == expected_windows(records)
    parked = read_topic(settings, settings.dlq_topic)
    assert len(parked) == sum(1 for r in records if not r.valid) + 2
    big = [(v, h) for k, v, h in parked if k == huge_key]
    by_size = sorted(big, key=lambda vh: int(vh[1].get(H_ORIGINAL_BYTES, b"0")))
    (small_value, small_headers), (cut_value, cut_headers) = by_size
    assert len(small_value or b"") == 70_000 and H_TRUNCATED not in small_headers
    assert cut_headers[H_TRUNCATED] == b"true" and int(cut_headers[H_ORIGINAL_BYTES]) == BIG
    assert 0 < len(cut_value or b"") < 100_000
    assert cut_headers[H_REASON] == b"malformed"
    assert int(cut_headers[H_PARTITION]) == murmur2_partition(huge_key, 12) and int(cut_headers[H_OFFSET]) == 0


def test_aborted_transactions_count_nowhere(settings: Settings, tmp_path: Path) -> None:
    now = int(time.time() * 1000)
    producer = Producer(
        {
            "bootstrap.servers": settings.kafka_bootstrap,
            "transactional.id": f"tx-{settings.topic}",
            "partitioner": "murmur2_random",
        }
    )
    producer.init_transactions(30)
    committed: list[Record] = []
    for round_ in range(4):
        producer.begin_transaction()
        events = [make_event(f"sk_{i % 30}", "download", now - i, now_ms=now) for i in range(100)]
        for event in events:
            producer.produce(settings.topic, key=event.key, value=event.encode())
        if round_ % 2:
            assert producer.flush(30) == 0  # written to the log, then aborted
            producer.abort_transaction(30)
        else:
            producer.commit_transaction(30)
            committed += [Record(e.key, e.encode(), True) for e in events]

    worker = WorkerProcess(settings, tmp_path / "worker.log")
    expected = expected_windows(committed)
    wait_until(lambda: worker.assert_alive() or actual_windows(settings) == expected, 120, "the committed events")
    # Nothing more arrives later: the aborted 100 were skipped, not delayed.
    publish(settings, [Record(b"sk_0", make_event("sk_0", "download", now, now_ms=now).encode(), True)])
    wait_until(lambda: actual_windows(settings) != expected, 60, "one more event")
    # The fences pass the commit and abort markers and the aborted records too: every partition's fence
    # reaches its log end, those that end in a marker included (no lag of one record left behind).
    wait_until(caught_up(settings, settings.windows_group, worker), 60, "the fences at the log ends")
    assert worker.terminate() == 0, worker.log_tail()
    assert sum(d for d, _ in actual_windows(settings)[0].values()) == 201
