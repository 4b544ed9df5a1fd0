"""The cost of encoding Kafka values as Avro: raysink's column-wise encoder against a
row-by-row Python encoder and, when it can be imported, fastavro's ``schemaless_writer``,
side by side in one run on the same Arrow table.

``--rows`` rows (1 M by default) of four columns: ``id`` long, ``customer`` string,
``amount`` double, ``note`` a nullable string (a third of the rows null). Cases:

* ``column-wise``   ``raysink.sinks.kafka._avro.avro_values`` (what ``KafkaSink(
                    value_format="avro")`` runs per batch), Arrow in, a binary array out;
* ``row-wise``      Python, one row at a time: ``to_pylist()``, then per field a small
                    function (zigzag varint, ``struct.pack``, UTF-8 and a length), joined;
* ``fastavro``      ``to_pylist()``, then ``fastavro.schemaless_writer`` per row into a
                    reused ``BytesIO`` (the C extension); left out if fastavro is missing;
* ``json``          raysink's column-wise JSON of the same rows, for scale.

Each prints CPU seconds (``process_time``: on a shared machine the wall clock is
noisier), rows/s, and its ratio to ``column-wise``; the outputs of the first 10,000 rows
are compared byte for byte first. fastavro is not a dependency: put it on the path
yourself (``pip install --target DIR fastavro`` and ``PYTHONPATH=DIR``).

    nice -n 10 .venv/bin/python bench/kafka_avro.py
    nice -n 10 .venv/bin/python bench/kafka_avro.py --rows 200000 --repeat 1
"""

from __future__ import annotations

import argparse
import io
import os
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysink.sinks.kafka._avroschema import zigzag

SCHEMA: dict[str, Any] = {
    "type": "record", "name": "Order", "namespace": "bench",
    "fields": [{"name": "id", "type": "long"},
               {"name": "customer", "type": "string"},
               {"name": "amount", "type": "double"},
               {"name": "note", "type": ["null", "string"]}]}


def make_table(rows: int) -> pa.Table:
    rng = np.random.default_rng(7)
    return pa.table({
        "id": pa.array(np.arange(rows) * 7_919 - rows, pa.int64()),
        "customer": pa.array([f"customer-{i % 9973:05d}" for i in range(rows)]),
        "amount": pa.array(np.round(rng.random(rows) * 1000, 2)),
        "note": pa.array([None if i % 3 == 0 else "order placed through the web shop"
                          for i in range(rows)]),
    })


# -- the row-by-row encoder ----------------------------------------------------------


def _string(value: str) -> bytes:
    data = value.encode()
    return zigzag(len(data)) + data


def _double(value: float) -> bytes:
    return struct.pack("<d", value)


def _nullable_string(value: str | None) -> bytes:
    return b"\x00" if value is None else b"\x02" + _string(value)


_ROW_FIELDS: list[tuple[str, Callable[[Any], bytes]]] = [
    ("id", zigzag), ("customer", _string), ("amount", _double), ("note", _nullable_string)]


def row_wise(table: pa.Table) -> list[bytes]:
    return [b"".join(encode(row[name]) for name, encode in _ROW_FIELDS)
            for row in table.to_pylist()]


def fastavro_rows(table: pa.Table) -> list[bytes] | None:
    try:
        import fastavro
    except ImportError:
        return None
    parsed = fastavro.parse_schema(SCHEMA)
    out: list[bytes] = []
    buffer = io.BytesIO()
    for row in table.to_pylist():
        buffer.seek(0)
        buffer.truncate()
        fastavro.schemaless_writer(buffer, parsed, row)
        out.append(buffer.getvalue())
    return out


def column_wise(table: pa.Table) -> list[bytes]:
    from raysink.sinks.kafka._avro import avro_values
    from raysink.sinks.kafka._avroschema import parse

    return avro_values(table, parse(SCHEMA))  # type: ignore[no-any-return]


def json_rows(table: pa.Table) -> Any:
    from raysink.sinks.kafka._encode import json_rows as rows

    return rows(table)


def timed(run: Callable[[pa.Table], Any], table: pa.Table, repeat: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        started = time.process_time()
        result = run(table)
        best = min(best, time.process_time() - started)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of the column-wise cases (the best is kept)")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    table = make_table(args.rows)
    sample = table.slice(0, 10_000)
    want = row_wise(sample)
    assert column_wise(sample).to_pylist() == want, "column-wise differs from row-wise"
    fast = fastavro_rows(sample)
    if fast is not None:
        assert fast == want, "fastavro differs from row-wise"
    cases: list[tuple[str, Callable[[pa.Table], Any], int]] = [
        ("column-wise", column_wise, args.repeat), ("row-wise", row_wise, 1)]
    if fast is not None:
        cases.append(("fastavro", fastavro_rows, 1))
    cases.append(("json (column-wise)", json_rows, args.repeat))
    results: dict[str, float] = {}
    for label, run, repeat in cases:
        seconds, out = timed(run, table, repeat)
        results[label] = seconds
        size = (pc.sum(pc.binary_length(out)).as_py() if isinstance(out, pa.Array)
                else sum(map(len, out)))
        print(f"{label:20s} {seconds:7.3f} s CPU  {args.rows / seconds:>12,.0f} rows/s  "
              f"{size / args.rows:5.1f} bytes/row  "
              f"{seconds / results['column-wise']:6.1f}x column-wise")
    started = time.process_time()
    table.to_pylist()
    print(f"{'(to_pylist alone)':20s} {time.process_time() - started:7.3f} s CPU")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
