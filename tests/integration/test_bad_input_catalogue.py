"""Bad input the other test modules do not already cover, through the real runtime.

Each case is a row of ``docs/bad_input.md``: a new streaming query on an old runtime, an
unknown sink option, a target deleted after data was committed, a progress marker deleted
while an epoch is pending.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from raysink import ConfigError, DataLossError, SinkRuntime
from raysink.coordinator.metastore import open_metastore
from raysink.protocol.results import EpochSource
from raysink.sinks import DeltaSink, ParquetSink
from raysink.spark.binding import source_offset
from raysink.testing import arm_fault
from tests.chaos.faults import run_in_thread, wait_fired
from tests.chaos.targets import epoch_table
from tests.integration.helpers import closes_with_epoch_pending

pytestmark = pytest.mark.usefixtures("ray_session")
# One writer: each case is met by the driver or the coordinator (a query's binding, the
# target and its marker at start or at commit), where the writers' number plays no part.
WRITERS = 1


def test_new_streaming_query_on_an_old_runtime(tmp_path: Path, meta: str) -> None:
    name, out = "bad-new-query", tmp_path / "out"
    with SinkRuntime(name, ParquetSink(str(out)), writers=WRITERS, metastore=meta) as rt:
        assert rt._bind_source("query-1") == 0
        assert rt.write_arrow(epoch_table(1, 10, 1), epoch=1).committed
    with SinkRuntime(name, ParquetSink(str(out)), writers=WRITERS, metastore=meta) as rt:
        assert rt._bind_source("query-1") == 0  # the same query carries on
        with pytest.raises(ConfigError, match=r"epoch_offset=1"):
            rt._bind_source("query-2")  # a new checkpoint: batch ids restart at 0
    with SinkRuntime(name, ParquetSink(str(out)), writers=WRITERS, metastore=meta,
                     epoch_offset=1) as rt:
        assert rt._bind_source("query-2") == 1  # re-bound on purpose


@pytest.mark.parametrize(("current", "query", "offset", "last", "fragment"), [
    # bound to its own numbering, now fed by a query
    (None, "q", None, 4, "own epoch numbering"),
    # re-bound below what is committed: the first batches would be skipped
    ({"kind": "query", "id": "old", "offset": 0}, "q", 2, 4, "below the last committed"),
    # the bound query with another offset than the recorded one
    ({"kind": "query", "id": "q", "offset": 3}, "q", 5, 4, "bound to query q"),
])
def test_source_offset_refusals(current: dict[str, object] | None, query: str,
                                offset: int | None, last: int | None, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        source_offset("rt", EpochSource.from_record(current), query, offset, last)


@pytest.mark.parametrize(("cls", "options", "fragment"), [
    # misspelt: the closest option is named
    (ParquetSink, {"compresion": "zstd"}, "no option 'compresion' (did you mean 'compression'"),
    # an option DeltaSink does not have, and nothing close
    (DeltaSink, {"bucket": "day"}, "DeltaSink has no option 'bucket'; its options are: path"),
    # the SinkRuntime's own options are checked the same way
    (None, {"writer": 3}, "SinkRuntime has no option 'writer' (did you mean 'writers'"),
])
def test_unknown_option_is_a_config_error(tmp_path: Path, cls: Any, options: dict[str, Any],
                                          fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        if cls is None:
            SinkRuntime("rt", ParquetSink(str(tmp_path / "t")), **options)
        else:
            cls(str(tmp_path / "t"), **options)
    assert fragment in str(info.value)
    assert not (tmp_path / "t").exists()  # nothing created


def test_target_deleted_after_commit_is_data_loss(tmp_path: Path, meta: str) -> None:
    name, out = "bad-deleted", tmp_path / "out"
    with SinkRuntime(name, ParquetSink(str(out)), writers=WRITERS, metastore=meta) as rt:
        assert rt.write_arrow(epoch_table(1, 20, 1), epoch=1).committed
    shutil.rmtree(out)
    with pytest.raises(DataLossError, match="deleted after raysink committed"):
        SinkRuntime(name, ParquetSink(str(out)), writers=WRITERS, metastore=meta,
                    commit_timeout=5).start()  # recovery checks the target in start()
    store = open_metastore(meta, name)
    try:
        status = store.sink_statuses(name)["main"]
    finally:
        store.close()
    assert status.state == "failed" and "DataLossError" in (status.last_error or "")
    assert not out.exists()  # nothing re-created behind the user's back


def test_marker_deleted_while_an_epoch_is_pending_is_data_loss(tmp_path: Path, meta: str) -> None:
    name, out = "bad-marker-pending", tmp_path / "out"
    with closes_with_epoch_pending(), SinkRuntime(
            name, ParquetSink(str(out)), writers=WRITERS, metastore=meta, commit_timeout=3,
            retry_cap=0.2) as rt:
        assert rt.write_arrow(epoch_table(1, 20, 1), epoch=1).committed
        arm_fault(name, "coordinator.after_pending", action="sleep", seconds=2.0,
                  when={"epoch": 2})
        thread, box = run_in_thread(lambda: rt.write_arrow(epoch_table(2, 20, 2), epoch=2))
        assert wait_fired(name, "coordinator.after_pending", 60.0, box)
        (out / "_raysink" / "commits" / f"{1:012d}.json").unlink()
        thread.join(timeout=60)
        assert not box["result"].committed  # decided, never made visible
        status = rt.status()
    error = status.sinks["main"].last_error or ""
    assert status.sinks["main"].state == "failed" and error.startswith("DataLossError"), error
    assert "while epoch 2 is pending" in error


def test_routing_key_outside_the_upsert_key(tmp_path: Path, meta: str) -> None:
    upsert = DeltaSink(str(tmp_path / "d"), mode="upsert", key=["id"])
    with pytest.raises(ConfigError, match="not within the upsert key"):
        SinkRuntime("bad-key", upsert, key=["customer"], metastore=meta)
