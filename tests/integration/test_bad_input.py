"""Bad input through the real runtime: its error (docs/bad_input.md), committed data intact.

Cases already covered elsewhere are not repeated here: schemas differing within an epoch
(local tables and object refs), an epoch below a PENDING one, a changed sink set, an empty
epoch and four invalid options are in ``test_runtime.py``; a new streaming query, unknown
sink options, deleted targets and markers, and a routing key outside the upsert key are in
``test_bad_input_catalogue.py``. Every case here first commits an epoch of its own where it
can, and checks afterwards that the table still holds exactly what it held before plus
that epoch (and whatever the case wrote on purpose), and that the runtime goes on.
Messages are checked for what the user must change, not only for the error type.

The cases of bad data and epochs share one runtime (``shared``): each is refused without
harm to the runtime, and each asserts only on the epochs it wrote itself, numbered after
whatever the runtime committed before it. So do the starts of its name refused by the meta
store (a store that cannot be opened, a sink of another kind, a changed sink set): each is
refused before the lease is sought, and the runtime holding the name goes on. Cases that
need other options or a broken sink start their own runtime.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import ray

from raysink import (
    ConfigError,
    EpochRegressionError,
    MetaStoreError,
    SchemaMismatchError,
    SinkRuntime,
    SinkUnavailableError,
)
from raysink.sinks import DeltaSink, ParquetSink
from tests.integration.helpers import (
    assert_exactly,
    closes_with_epoch_pending,
    epoch_table,
    read_ids,
    unique_name,
)

pytestmark = pytest.mark.usefixtures("ray_session")

ROWS = 50


@pytest.fixture(scope="module")
def shared(ray_session: None, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[SinkRuntime, Path]]:
    """One started runtime for the module's cases that leave it as they found it: routing
    key ``customer``, a Parquet sink given the schema of ``epoch_table``."""
    path = tmp_path_factory.mktemp("bad-input") / "table"
    sink = ParquetSink(str(path), schema=epoch_table(1, 1).schema)
    rt = SinkRuntime(unique_name("bad-shared"), sink, key=["customer"], progress=False,
                     metastore=f"sqlite:///{path.parent / 'meta.db'}").start()
    try:
        yield rt, path
    finally:
        rt.close()


@dataclass(frozen=True, kw_only=True)
class Committed:
    """The shared runtime after a case committed its first epoch, ``epoch``; ``before``:
    the table's ids before that."""

    rt: SinkRuntime
    path: Path
    epoch: int
    before: list[int]

    def assert_holds(self, *epochs: int) -> None:
        """The table holds what it held before, and exactly ``epochs`` of this case."""
        assert_exactly(self.path, list(epochs), ROWS, before=self.before)


@pytest.fixture
def committed(shared: tuple[SinkRuntime, Path]) -> Committed:
    """The shared runtime with an epoch of the case's own committed."""
    rt, path = shared
    before = read_ids(path)
    epoch = (rt.status().last_committed_epoch or 0) + 1
    assert rt.write_arrow(epoch_table(epoch, ROWS), epoch=epoch).committed
    return Committed(rt=rt, path=path, epoch=epoch, before=before)


def _with_null_keys(epoch: int) -> pa.Table:
    table = epoch_table(epoch, ROWS)
    customers = table.column("customer").to_pylist()
    customers[7] = None
    return table.set_column(1, "customer", pa.array(customers, pa.string()))


# --------------------------------------------------------------------------- data


def test_null_keys_in_a_local_table(committed: Committed) -> None:
    nxt = committed.epoch + 1
    with pytest.raises(SchemaMismatchError, match=r"key column 'customer' holds 1 null") as info:
        committed.rt.write_arrow(_with_null_keys(nxt), epoch=nxt)
    assert "must not be null" in str(info.value)
    assert committed.rt.write_arrow(epoch_table(nxt, ROWS), epoch=nxt).committed
    committed.assert_holds(committed.epoch, nxt)


def test_null_keys_behind_an_object_ref(committed: Committed) -> None:
    """The ref is split by key in a Ray task, which finds the nulls; nothing is written."""
    nxt = committed.epoch + 1
    with pytest.raises(SchemaMismatchError, match=r"key column 'customer' holds 1 null"):
        committed.rt.write_arrow([ray.put(_with_null_keys(nxt))], epoch=nxt)
    assert committed.rt.write_arrow(epoch_table(nxt, ROWS), epoch=nxt).committed
    committed.assert_holds(committed.epoch, nxt)


def test_missing_routing_key_column(committed: Committed) -> None:
    nxt = committed.epoch + 1
    with pytest.raises(SchemaMismatchError, match=r"routing key column 'customer' is not in"):
        committed.rt.write_arrow(epoch_table(nxt, ROWS).drop_columns(["customer"]), epoch=nxt)
    committed.assert_holds(committed.epoch)


@pytest.mark.parametrize("data", [
    {"id": [1, 2]},  # a dict of columns
    "id,customer\n1,a",  # CSV text
    [epoch_table(2, 5), [1, 2, 3]],  # one good table and a list
])
def test_non_arrow_data(committed: Committed, data: Any) -> None:
    with pytest.raises(ConfigError, match="write_arrow takes a pyarrow Table, RecordBatch "
                                          "or ObjectRef") as info:
        committed.rt.write_arrow(data, epoch=committed.epoch + 1)
    assert "got " in str(info.value)
    committed.assert_holds(committed.epoch)


def test_batch_differs_from_the_targets_schema(committed: Committed) -> None:
    """A sink given a schema (the shared runtime's is) refuses a batch of another one, in
    the writer."""
    nxt = committed.epoch + 1
    wrong = epoch_table(nxt, ROWS).set_column(2, "amount", pa.array(range(ROWS)))
    with pytest.raises(SchemaMismatchError, match=r"'amount': expected double, got int64"):
        committed.rt.write_arrow(wrong, epoch=nxt)
    assert committed.rt.write_arrow(epoch_table(nxt, ROWS), epoch=nxt).committed
    committed.assert_holds(committed.epoch, nxt)


# --------------------------------------------------------------------------- epochs


def test_negative_epoch(committed: Committed) -> None:
    nxt = committed.epoch + 1
    with pytest.raises(EpochRegressionError, match="non-negative"):
        committed.rt.write_arrow(epoch_table(nxt, ROWS), epoch=-1)
    assert committed.rt.write_arrow(epoch_table(nxt, ROWS)).epoch == nxt
    committed.assert_holds(committed.epoch, nxt)


def test_regression_message_names_both_epochs(tmp_path: Path, meta: str) -> None:
    """Below an epoch still in flight: the message says which and what to do."""
    from raysink.testing import FailingSink

    sink = FailingSink(ParquetSink(str(tmp_path / "table")), fail_commit_times=1000,
                       state_dir=str(tmp_path / "faults"))
    with closes_with_epoch_pending(), SinkRuntime(
            "bad-regress-msg", sink, metastore=meta, commit_timeout=1.0, retry_cap=0.2,
            progress=False) as rt:
        assert not rt.write_arrow(epoch_table(4, 5), epoch=4).committed
        with pytest.raises(EpochRegressionError) as info:
            rt.write_arrow(epoch_table(2, 5), epoch=2)
    text = str(info.value)
    assert "epoch 2 is below epoch 4" in text and "increasing order" in text
    assert info.value.epoch == 2


# --------------------------------------------------------------------------- meta store


def test_metastore_under_a_regular_file(tmp_path: Path, committed: Committed) -> None:
    """Root ignores file modes: a path under a regular file is unwritable for anyone. A
    start of the shared runtime's name and table with such a meta store is refused before
    it seeks the lease or starts an actor (a live actor of the name would have refused it
    otherwise); the runtime goes on, its table intact."""
    blocker = tmp_path / "plain-file"
    blocker.write_text("not a directory")
    bad = f"sqlite:///{blocker / 'sub' / 'meta.db'}"
    with pytest.raises(MetaStoreError, match="choose a path under a writable directory") as info:
        SinkRuntime(committed.rt.name, ParquetSink(str(committed.path)), metastore=bad).start()
    assert str(blocker / "sub") in str(info.value)
    assert blocker.read_text() == "not a directory"
    nxt = committed.epoch + 1
    assert committed.rt.write_arrow(epoch_table(nxt, ROWS)).epoch == nxt
    committed.assert_holds(committed.epoch, nxt)


def test_metastore_file_is_not_a_database(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not SQLite " * 100)
    with pytest.raises(MetaStoreError, match="must be a SQLite file") as info:
        SinkRuntime("bad-meta-junk", ParquetSink(str(tmp_path / "table")),
                    metastore=f"sqlite:///{junk}").start()
    assert "choose another path" in str(info.value)
    assert junk.read_bytes() == b"this is not SQLite " * 100


@pytest.mark.parametrize(("url", "fragment"), [
    ("mysql://u:secret@h/db", "metastore must be"),  # an unsupported backend
    ("sqlite:///relative/meta.db", "an absolute path"),  # three slashes: relative
])
def test_metastore_url_of_no_accepted_form(url: str, fragment: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        SinkRuntime("bad-meta-url", ParquetSink(str(tmp_path / "t")), metastore=url).start()
    assert "secret" not in str(info.value)  # a password is never quoted


# --------------------------------------------------------------------------- sinks


def test_sink_path_is_a_file(tmp_path: Path, meta: str) -> None:
    target = tmp_path / "table"
    target.write_text("someone's file")
    with pytest.raises(SinkUnavailableError, match="is a file; give a directory"):
        SinkRuntime("bad-sink-file", ParquetSink(str(target)), metastore=meta).start()
    assert target.read_text() == "someone's file"
    with pytest.raises(SinkUnavailableError, match="is a file; give a directory"):
        SinkRuntime("bad-sink-file", ParquetSink(str(target / "sub")),
                    metastore=meta).start()


def test_sink_of_another_kind_under_the_same_name(tmp_path: Path,
                                                  committed: Committed) -> None:
    """Refused by the meta store's record before the lease is sought: the runtime of the
    name goes on."""
    rt = committed.rt
    with pytest.raises(ConfigError, match="give a sink of another kind a new name") as info:
        SinkRuntime(rt.name, DeltaSink(str(tmp_path / "delta")),
                    metastore=rt.metastore_url).start()
    assert "parquet -> delta" in str(info.value)
    assert not (tmp_path / "delta").exists()
    nxt = committed.epoch + 1
    assert rt.write_arrow(epoch_table(nxt, ROWS)).epoch == nxt
    committed.assert_holds(committed.epoch, nxt)


def test_changed_sink_set_says_how_to_change_it(committed: Committed) -> None:
    rt = committed.rt
    renamed = {"other": ParquetSink(str(committed.path))}
    with pytest.raises(ConfigError, match=r"new \['other'\], missing \['main'\]") as info:
        SinkRuntime(rt.name, renamed, metastore=rt.metastore_url).start()
    assert "add=/drop=" in str(info.value)
    committed.assert_holds(committed.epoch)


def test_batch_over_the_size_limit_writes_nothing(tmp_path: Path, meta: str) -> None:
    """A local table over ``max_batch_bytes`` is cut to fit and committed; an object ref
    over it (a Spark partition arrives the same way) is refused by the writer, nothing of
    the epoch is written, and the epoch can be written again in smaller pieces."""
    big = epoch_table(2, 20_000)
    limit = big.nbytes // 8
    with SinkRuntime("bad-oversized", ParquetSink(str(tmp_path / "table")),
                     metastore=meta, max_batch_bytes=limit, progress=False) as rt:
        assert rt.write_arrow(epoch_table(1, 20_000), epoch=1).committed  # cut to fit
        with pytest.raises(SchemaMismatchError, match=r"over max_batch_bytes=[\d,]+; split "
                                                      r"the data") as info:
            rt.write_arrow([ray.put(big)], epoch=2)
        assert info.value.epoch == 2
        assert_exactly(tmp_path / "table", [1], 20_000)
        pieces = [ray.put(big.slice(i, 2_000)) for i in range(0, big.num_rows, 2_000)]
        assert rt.write_arrow(pieces, epoch=2).committed
    assert_exactly(tmp_path / "table", [1, 2], 20_000)


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(("make", "fragment"), [
    # options test_runtime.py does not cover
    (lambda p: SinkRuntime("r", ParquetSink(p), flush_interval=0), "flush_interval must be > 0"),
    (lambda p: SinkRuntime("r", ParquetSink(p), max_attempts=0), "max_attempts must be at least"),
    (lambda p: SinkRuntime("r", ParquetSink(p), retry_cap=0), "retry_cap must be > 0"),
    (lambda p: SinkRuntime("r", ParquetSink(p), max_batch_bytes=0),
     "max_batch_bytes must be at least 1"),
    (lambda p: SinkRuntime("r.x", ParquetSink(p)), "letters, digits"),  # a dot in the name
    (lambda p: SinkRuntime("r", {}), "give at least one sink"),
    (lambda p: SinkRuntime("r", {"main": p}), "is not a raysink Sink; got str"),
    (lambda p: ParquetSink(p, compression="lzma"),  # type: ignore[arg-type]
     "compression must be one of"),
    (lambda p: ParquetSink(p, row_group_size=0), "row_group_size must be a positive int"),
    (lambda p: ParquetSink("s3://bucket/t"), "use DeltaSink or IcebergSink"),
])
def test_invalid_options_say_what_to_change(tmp_path: Path, make: Any, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        make(str(tmp_path / "t"))
    assert isinstance(info.value, ValueError)  # a ConfigError is also a ValueError
    assert not (tmp_path / "t").exists()  # nothing created
