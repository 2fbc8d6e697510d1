"""RecordColumns (sinks/pipeline.py): the drain's fetched records as columns read the same as the records would.

streams/aiokafka_records.py reads record batches straight into columns and the drain decodes them as they are;
anything else (a filter after a seek, a rejected record's lookup, a test) sees them as a sequence of records. Both
must give the same batch: the same partitions' offsets and events, the same parcels for the DLQ (with the
replayed-from header and the Kafka timestamp), the same newest times. Unit tests, no broker.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from skillstats.dlq import H_REPLAYED_FROM
from skillstats.sinks.pipeline import ColumnRecord, RecordColumns, decode_batch
from skillstats.workload import generate

NOW_MS = 1_760_000_000_000
_EVENTS = list(generate(64, now_ms=NOW_MS, skills=20, invalid_ratio=0.3, days=2))


@st.composite
def fetched(draw: Any) -> dict[int, list[ColumnRecord]]:
    """Partitions of records, as the drain hands them over: rising offsets, valid events and invalid ones of
    every kind workload.py makes, Kafka timestamps or none, a replayed-from header now and then."""
    partitions: dict[int, list[ColumnRecord]] = {}
    for partition in draw(st.sets(st.integers(0, 5), max_size=3)):
        offset = draw(st.integers(0, 10**12))
        records = []
        for _ in range(draw(st.integers(0, 12))):
            event = draw(st.sampled_from(_EVENTS))
            stamp = draw(st.one_of(st.none(), st.just(-1), st.integers(NOW_MS - 10**9, NOW_MS)))
            headers = draw(st.sampled_from([(), ((H_REPLAYED_FROM, b"stats/3@7"),), [("other", None)]]))
            records.append(ColumnRecord(offset, stamp, event.key, event.value, headers))
            offset += draw(st.integers(1, 3))
        partitions[partition] = records
    return partitions


def _columns(records: list[ColumnRecord]) -> RecordColumns:
    columns = RecordColumns()
    columns.extend(records)
    return columns


@given(batch=fetched())
def test_columns_decode_as_the_records_they_hold(batch: dict[int, list[ColumnRecord]]) -> None:
    since = {p: (records[0].offset if records else 0) for p, records in batch.items()}
    as_records = decode_batch(batch, since)
    as_columns = decode_batch({p: _columns(records) for p, records in batch.items()}, since)
    assert as_columns == as_records


@given(
    records=fetched().map(lambda partitions: [r for rs in partitions.values() for r in rs]),
    cut=st.integers(-15, 15),
    step=st.sampled_from([None, 1, 2]),
)
def test_columns_are_a_sequence_of_the_records_they_hold(records: list[ColumnRecord], cut: int, step: Any) -> None:
    """Items, slices (a batch cut by a fetch's record limit), iteration, and extending by columns or records."""
    columns = _columns(records)
    assert len(columns) == len(records) and list(columns) == records
    assert all(columns[i] == records[i] for i in range(-len(records), len(records)))
    part = columns[cut::step]
    assert isinstance(part, RecordColumns) and list(part) == records[cut::step]
    both = _columns(records)
    both.extend(part)
    both.extend(records[:cut])
    assert list(both) == records + records[cut::step] + records[:cut]
    assert [len(column) for column in both.columns] == [len(both)] * 5
