"""The writer's placement of records and its offset runs from two reports per chunk, and
the JSON strings' escape check, without a broker (``tests/kafka/test_kafka_writer_path.py``
checks both against the real one)."""

from __future__ import annotations

import json
import zlib
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from raysink.sinks.kafka._batches import (
    CHUNK,
    Chunks,
    Planner,
    _Chunk,
    key_partitions,
    partition_order,
    plan,
    produce_in_order,
    produce_parts,
)
from raysink.sinks.kafka._encode import encode, json_rows, json_text


def test_keys_are_placed_by_their_crc32_like_librdkafka() -> None:
    keys = [f"customer-{i}" for i in range(500)] + ["", None, "é☃", "x" * 300]
    array = pa.array(keys)
    for count in (1, 6, 7):
        want = [-1 if not k else zlib.crc32(k.encode()) % count for k in keys]
        assert key_partitions(array, count).tolist() == want
    assert key_partitions(array.slice(3, 10), 6).tolist() == [
        zlib.crc32(k.encode()) % 6 for k in keys[3:13]]
    assert key_partitions(pa.array([b"\x00\xff", b"k"]), 5).tolist() == [
        zlib.crc32(b"\x00\xff") % 5, zlib.crc32(b"k") % 5]
    # keys of one length take the matrix path: whole, sliced, and one row
    fixed = [f"customer-{i:05d}" for i in range(300)]
    for array, want_keys in ((pa.array(fixed), fixed), (pa.array(fixed).slice(7, 50),
                                                        fixed[7:57]),
                             (pa.array(["é☃"]), ["é☃"])):
        for count in (1, 6, 7):
            assert key_partitions(array, count).tolist() == [
                zlib.crc32(k.encode()) % count for k in want_keys]


def test_plan_keeps_each_keys_order_and_spreads_the_writers() -> None:
    table = pa.table({"k": [f"k{i % 5}" if i % 7 else None for i in range(2_000)],
                      "id": list(range(2_000))})
    encoded = encode(table, key="k", value=None, headers=())
    parts = plan([encoded, encoded], 3, writer=1)
    assert parts[0].partition == partition_order(3, 1)[0]
    assert sum(len(p.values) for p in parts) == 4_000
    seen: dict[str, list[int]] = {}
    for part in parts:
        for key, value in zip(part.keys or [], part.values, strict=True):
            if key is not None:
                assert zlib.crc32(key.encode()) % 3 == part.partition
                seen.setdefault(key, []).append(json.loads(value)["id"])
    for ids in seen.values():  # batch by batch, each in row order
        half = len(ids) // 2
        assert ids[:half] == sorted(ids[:half]) and ids[half:] == ids[:half]
    assert partition_order(6, 0)[0] != partition_order(6, 1)[0]


def test_a_planner_places_batch_after_batch_as_one_plan_of_them_all() -> None:
    """An epoch begun early is planned a batch at a time: records without a key go on
    rotating where the last batch left off (not back at the writer's first partition
    each batch), so they spread over the partitions as the whole epoch planned at once
    would; keyed records go where their key does either way."""
    def batch(start: int, rows: int) -> Any:
        table = pa.table({"k": [None if i % 3 else f"k{i % 11}" for i in
                                range(start, start + rows)],
                          "id": list(range(start, start + rows))})
        return encode(table, key="k", value=None, headers=())

    batches = [batch(i * 5_000, 5_000) for i in range(6)]
    placed_at_once = {(p.partition, v) for p in plan(batches, 4, writer=2) for v in p.values}
    planner = Planner(4, 2)
    placed_in_turn = {(p.partition, v) for b in batches for p in planner.plan([b])
                      for v in p.values}
    assert placed_in_turn == placed_at_once
    # each batch planned afresh would start its unkeyed blocks at the same partition
    placed_afresh = {(p.partition, v) for b in batches for p in Planner(4, 2).plan([b])
                     for v in p.values}
    assert placed_afresh != placed_at_once


def _reported(*chunks: tuple[int, int, int, int]) -> Chunks:
    """Chunks of (partition, count, first offset, last offset), as their reports left
    them."""
    done = Chunks()
    for partition, count, first, last in chunks:
        done.chunks.append(_Chunk(partition, count))
        index = len(done.chunks) - 1
        done.report(index, "first", None, SimpleNamespace(offset=lambda o=first: o))
        done.report(index, "last", None, SimpleNamespace(offset=lambda o=last: o))
    return done


def test_runs_join_adjacent_chunks_and_refuse_a_gap() -> None:
    assert _reported((0, CHUNK, 10, 10 + CHUNK - 1), (0, 5, 10 + CHUNK, 14 + CHUNK),
                     (1, 3, 100, 102)).runs() == {"0": [[10, CHUNK + 5]], "1": [[100, 3]]}
    # another producer's records between two chunks: two runs
    assert _reported((0, 3, 0, 2), (0, 3, 7, 9)).runs() == {"0": [[0, 3], [7, 3]]}
    # inside a chunk: where they lie is unknown
    assert _reported((0, 3, 0, 2), (0, 3, 3, 6)).runs() is None
    missing = Chunks(chunks=[_Chunk(0, 2, first=0)])
    assert missing.runs() is None


def test_a_failed_report_is_kept() -> None:
    chunks = Chunks(chunks=[_Chunk(0, 1)])
    chunks.report(0, "first", "boom", None)
    chunks.report(0, "last", "second", None)
    assert chunks.error == "boom" and chunks.runs() is None


@pytest.mark.parametrize("strings", [
    pa.array(["plain", "é☃", None, ""]),
    pa.array(["plain", 'q"uote', "back\\slash", "ctl\x01", None]),
    pa.array(["x", 'y"', "z"]).slice(2),  # a slice past the one to escape
    pa.array(["a", 'b"', None], pa.large_string()),
])
def test_strings_become_the_same_json_with_or_without_escapes(strings: pa.Array) -> None:
    texts = json_text(strings).to_pylist()
    assert [json.loads(t) for t in texts] == [s for s in strings.to_pylist()]


def test_throughput_defaults_are_overridable_within_exactly_once() -> None:
    from raysink.errors import ConfigError
    from raysink.sinks import KafkaSink

    default = KafkaSink("127.0.0.1:9", "t").settings.producer_config("x")
    assert default["max.in.flight.requests.per.connection"] == 5
    assert default["batch.size"] == 1_000_000 and default["compression.type"] == "none"
    mine = KafkaSink("127.0.0.1:9", "t", producer_config={
        "compression.type": "zstd", "linger.ms": 50,
        "max.in.flight.requests.per.connection": 2}).settings.producer_config("x")
    assert (mine["compression.type"], mine["linger.ms"],
            mine["max.in.flight.requests.per.connection"]) == ("zstd", "50", "2")
    assert mine["enable.idempotence"] is True and mine["acks"] == "all"
    with pytest.raises(ConfigError, match="at most 5"):
        KafkaSink("127.0.0.1:9", "t",
                  producer_config={"max.in.flight.requests.per.connection": 6})


def _chunk_of(values: list[bytes], first: int, last: int) -> tuple[_Chunk, list[tuple]]:
    from raysink.sinks.kafka._batches import Part

    encoded = encode(pa.table({"k": ["a"] * len(values), "value": pa.array(values)}),
                     key="k", value=None, headers=())
    chunk = _Chunk(0, len(values), first, last, segments=[(Part(0, encoded), 0,
                                                           len(values))])
    return chunk, [(b"a", v, ()) for v in values]


def test_a_spread_chunk_is_placed_only_when_one_placement_fits() -> None:
    from raysink.sinks.kafka._batches import place

    chunk, ours = _chunk_of([b"1", b"2", b"3"], 10, 14)
    foreign = (b"b", b"x", ())
    log = [(10, ours[0]), (11, ours[1]), (12, foreign), (13, foreign), (14, ours[2])]
    assert place(chunk, log) == [10, 11, 14]
    chunk.offsets = [10, 11, 14]
    assert Chunks(chunks=[chunk]).runs() == {"0": [[10, 2], [14, 1]]}
    # another producer's record equal to one of ours next to it: two placements fit
    assert place(chunk, [(10, ours[0]), (11, ours[1]), (12, ours[2]), (13, ours[2])]) is None
    # a record of ours missing from what was read: no placement
    assert place(chunk, [(10, ours[0]), (12, ours[2])]) is None


class _SmallQueueProducer:
    """A producer whose local queue holds ``room`` records: a full queue refuses the next
    one with ``BufferError`` (as confluent-kafka does) until ``poll`` delivers the queue
    into the log, each partition's records at consecutive offsets, with their reports."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.queue: list[tuple[int, Any, Any, Any]] = []
        self.log: dict[int, list[Any]] = {}
        self.refused = 0

    def produce(self, topic: str, value: Any, key: Any = None, partition: int = -1,
                on_delivery: Any = None, headers: Any = None) -> None:
        if len(self.queue) >= self.room:
            self.refused += 1
            raise BufferError("Local: Queue full")
        self.queue.append((partition, value, key, on_delivery))

    def poll(self, timeout: float = 0.0) -> int:
        for partition, value, key, report in self.queue:
            log = self.log.setdefault(partition, [])
            log.append((key, value))
            offset = len(log) - 1
            if report is not None:
                report(None, SimpleNamespace(offset=lambda o=offset: o))
        self.queue.clear()
        return 0


def test_a_full_queue_loses_and_repeats_no_record_and_the_runs_name_each_one() -> None:
    """``produce_parts`` against a queue of 7 records: the C-level loop is refused and
    resumed hundreds of times, and still each partition's log holds the planned records
    once each, in order, at exactly the offsets of the manifest's runs. An off-by-one in
    where the loop resumes skips or repeats a record (seen fail both ways)."""
    table = pa.table({"k": [f"k{i % 11}" if i % 5 else None for i in range(3 * CHUNK)],
                      "id": list(range(3 * CHUNK))})
    encoded = encode(table, key="k", value=None, headers=())
    parts = plan([encoded, encoded.take(pa.array(range(100)))], 4, writer=0)
    producer = _SmallQueueProducer(room=7)
    chunks = Chunks()
    produce_parts(producer, "t", parts, chunks, lambda: producer.poll(0.05))
    producer.poll()
    assert producer.refused > 100
    runs = chunks.runs()
    assert runs is not None and chunks.error is None
    for partition in range(4):
        want = [(k, v) for p in parts if p.partition == partition
                for k, v in zip(p.keys or [], p.values, strict=True)]
        assert producer.log.get(partition, []) == want
        named = [o for first, count in runs.get(str(partition), [])
                 for o in range(first, first + count)]
        assert named == list(range(len(want)))


def test_produce_in_order_resumes_at_the_refused_record() -> None:
    calls: list[Any] = []
    refuse = {3, 4, 9}  # the n-th call raises, as a full queue does

    def produce(topic: str, value: Any, key: Any, partition: int) -> None:
        calls.append(value)
        if len(calls) in refuse:
            calls[-1] = "refused"
            raise BufferError("Local: Queue full")

    produce_in_order(produce, "t", 0, list(range(10)), None, lambda: None)
    assert [c for c in calls if c != "refused"] == list(range(10))
    assert calls.count("refused") == 3


@pytest.mark.parametrize("table", [
    pa.table({"s": ["a", "b"], "t": ["c", "é☃"], "n": [1, 2]}),  # strings first, adjacent
    pa.table({"n": [1.5, float("nan")], "s": ['q"', "x"], "u": ["y", None]}),
    pa.table({"s": pa.chunked_array([["a"], ["b\\"]]), "l": pa.array(["z", "w"],
                                                                      pa.large_string())}),
    pa.table({"x": [1, 2], "last": ["", "ctl\x01"]}),
    pa.table({"only": ["one", "two"]}),
])
def test_rows_are_the_same_json_with_quotes_folded_into_the_literals(table: pa.Table
                                                                     ) -> None:
    """``json_rows`` joins plain string columns with their quotes in the literals around
    them: byte for byte what quoting each column and joining gives."""
    parts: list[Any] = []
    for i, (name, column) in enumerate(zip(table.schema.names, table.columns,
                                           strict=True)):
        parts += [("{" if i == 0 else ",") + json.dumps(name) + ":", json_text(column)]
    want = pc.binary_join_element_wise(*parts, "}", "").to_pylist()
    got = json_rows(table).to_pylist()
    assert got == want
    assert [json.loads(row) for row in got] == [
        {k: None if isinstance(v, float) and v != v else v for k, v in row.items()}
        for row in table.to_pylist()]
