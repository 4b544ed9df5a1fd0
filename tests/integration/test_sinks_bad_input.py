"""Bad input to Delta, Iceberg and PostgreSQL sinks through ``SinkRuntime``.

Each case is a row of docs/bad_input.md, met where a user meets it (``start()`` or a
``write_arrow``), and each checks that nothing was written: no rows, no commit, no table
or directory created behind the user's back. Deleted targets and markers are checked
against the meta store on the next start.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from raysink import (
    ConfigError,
    DataLossError,
    SchemaMismatchError,
    SinkRuntime,
    SinkUnavailableError,
)
from raysink.sinks.base import Sink
from raysink.sinks.delta import DeltaSink
from raysink.sinks.postgres import PostgresSink
from raysink.testing import arm_fault
from tests.integration.helpers import (
    closes_with_epoch_pending,
    epoch_table,
    run_in_thread,
    wait_fired,
)
from tests.integration.real_targets import (
    DeltaTarget,
    IcebergTarget,
    PostgresTarget,
    Target,
    assert_ids_exact,
)
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]

ROWS = 50
# One writer per sink unless a case routes rows: what these cases check is met at start
# (the coordinator against the target and its marker) or when an epoch's rows are checked
# against the target, where the writers' number plays no part; a writer fewer is an actor
# process fewer per start (2-4 s of a core each on this machine).
WRITERS = 1


def _runtime(name: str, sink: Sink | dict[str, Sink], meta: str, **options: Any) -> SinkRuntime:
    options.setdefault("retry_cap", 0.2)
    options.setdefault("writers", WRITERS)
    return SinkRuntime(name, sink, metastore=meta, progress=False, **options)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# ----------------------------------------------------------------------------- start()


def test_postgres_refusals_at_start(pg_server: PostgresServer, schema: str, name: str,
                                    meta: str) -> None:
    """A wrong password, an unreachable host and a role without permission, one after
    another: each refused by validate() in start() with SinkUnavailableError naming the
    cause, no secret in it, no table created; afterwards the name is free (no actor was
    left behind) and the right DSN writes."""
    target = PostgresTarget(pg_server, schema)
    secret = "not-the-password-" + uuid.uuid4().hex[:6]
    cases = [
        # the right user with a wrong password
        (pg_server.dsn(password=secret), "authentication failed"),
        # nothing listens on this port
        (f"postgresql://raysink:{secret}@127.0.0.1:{_closed_port()}/raysink", "unreachable"),
        # a role that may connect but not create in (or write to) the schema
        (pg_server.dsn(user="reader"), r"privilege|permission|CREATE"),
    ]
    for dsn, fragment in cases:
        rt = _runtime(name, target.sink(dsn=dsn), meta)
        with pytest.raises(SinkUnavailableError, match=fragment) as info:
            rt.start()
        text = f"{info.value} {info.value!r}"
        assert secret not in text and pg_server.password("reader") not in text, fragment
        assert not target.exists() and not target.exists("_raysink_progress"), fragment
    with _runtime(name, target.sink(), meta) as fixed:  # the name is free again
        assert fixed.write_arrow(epoch_table(1, ROWS)).committed
    assert_ids_exact(target.ids(), [1], ROWS)


def test_delta_path_holding_something_else(tmp_path: Path, name: str, meta: str) -> None:
    path = tmp_path / "not-delta"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(SinkUnavailableError, match="not a Delta table"):
        _runtime(name, DeltaSink(str(path)), meta).start()
    assert sorted(p.name for p in path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("kind", ["delta", "postgres"])
def test_routing_key_outside_the_upsert_key(tmp_path: Path, pg_server: PostgresServer,
                                            name: str, meta: str, kind: str) -> None:
    sink: Sink = (DeltaSink(str(tmp_path / "d"), mode="upsert", key=["id"]) if kind == "delta"
                  else PostgresSink(pg_server.dsn(), "events", key=["id"]))
    with pytest.raises(ConfigError, match="not within the upsert key"):
        _runtime(name, sink, meta, key=["customer"], writers=2)
    assert not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------- writes


def _disagreeing(kind: str, tmp_path: Path, pg: PostgresServer, schema: str) -> Target:
    """A table with columns ``id, other`` made by someone else."""
    if kind == "delta":
        from deltalake import write_deltalake

        target: Target = DeltaTarget(tmp_path / "delta")
        write_deltalake(str(tmp_path / "delta"), pa.table({"id": pa.array([7], pa.int64()),
                                                           "other": ["x"]}))
        return target
    pg.execute(f'CREATE TABLE "{schema}".events (id bigint, other text)', dbname="raysink")
    pg.execute(f'ALTER TABLE "{schema}".events OWNER TO raysink', dbname="raysink")
    pg.execute(f"INSERT INTO \"{schema}\".events VALUES (7, 'x')", dbname="raysink")
    return PostgresTarget(pg, schema)


@pytest.mark.parametrize("kind", ["delta", "postgres"])
def test_table_whose_columns_disagree(tmp_path: Path, pg_server: PostgresServer, schema: str,
                                      name: str, meta: str, kind: str) -> None:
    target = _disagreeing(kind, tmp_path, pg_server, schema)
    before = target.table()
    with _runtime(name, target.sink(), meta) as rt:
        with pytest.raises(SchemaMismatchError):
            rt.write_arrow(epoch_table(1, ROWS))
        assert rt.status().last_committed_epoch is None
    assert target.table() == before
    assert target.commit_epochs(name) == []


def test_null_key_values(tmp_path: Path, pg_server: PostgresServer, schema: str, name: str,
                         meta: str) -> None:
    """A Delta and a PostgreSQL upsert sink of one runtime (routed by their key): an epoch
    with a null key is refused, and neither table changes."""
    targets: dict[str, Target] = {"delta": DeltaTarget(tmp_path / "delta"),
                                  "postgres": PostgresTarget(pg_server, schema)}
    sinks = {"delta": targets["delta"].sink(mode="upsert", key=["id"]),
             "postgres": targets["postgres"].sink(key=["id"])}
    bad = pa.table({"id": pa.array([1, None, 3], pa.int64()), "value": ["a", "b", "c"]})
    good = pa.table({"id": pa.array([1, 2], pa.int64()), "value": ["a", "b"]})
    with _runtime(name, sinks, meta, writers=2) as rt:  # keyed: rows routed to two writers
        assert rt.write_arrow(good).committed
        with pytest.raises(SchemaMismatchError, match="null"):
            rt.write_arrow([good, bad])
        assert rt.status().last_committed_epoch == 1
    for kind, target in targets.items():
        assert target.values() == {1: "a", 2: "b"}, kind
        assert target.commit_epochs(name, kind) == [1], kind


# ----------------------------------------------------------------------------- deleted


# The coordinator's check at start is the same for every sink (``target_exists()`` of a
# sink whose marker the meta store expects): the default run proves it through the runtime
# on PostgreSQL here and on Parquet (test_bad_input_catalogue.py); that Delta's and
# Iceberg's ``target_exists()`` see a deleted table is the contract's ``deleted_target``
# (test_sink_contract.py, every sink).
@pytest.mark.parametrize("kind", [pytest.param("delta", marks=pytest.mark.slow),
                                  pytest.param("iceberg", marks=pytest.mark.slow), "postgres"])
def test_target_deleted_after_commits_is_data_loss_at_start(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest, name: str, meta: str) -> None:
    """Never silently re-created: the next start() raises DataLossError."""
    target: Target
    if kind == "delta":
        target = DeltaTarget(tmp_path / "delta")
    elif kind == "iceberg":
        monkeypatch.chdir(tmp_path)
        target = IcebergTarget(tmp_path)
    else:
        target = PostgresTarget(request.getfixturevalue("pg_server"),
                                request.getfixturevalue("schema"))
    with _runtime(name, target.sink(), meta) as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
    target.delete()
    with pytest.raises(DataLossError, match=r"deleted|gone") as info:
        _runtime(name, target.sink(), meta).start()
    assert info.value.sink == "main" and info.value.runtime == name
    assert target.table() is None  # not re-created
    # the name is free again: the failed start left no actor behind
    with pytest.raises(DataLossError):
        _runtime(name, target.sink(), meta).start()


def test_postgres_marker_deleted_with_nothing_pending_is_recreated(
        pg_server: PostgresServer, schema: str, name: str, meta: str) -> None:
    target = PostgresTarget(pg_server, schema)
    with _runtime(name, target.sink(), meta) as rt:
        for epoch in (1, 2):
            assert rt.write_arrow(epoch_table(epoch, ROWS)).committed
    target.delete_marker()
    with _runtime(name, target.sink(), meta) as rt:
        assert target.commit_epochs(name) == [2]  # re-created from the meta store at start
        assert rt.write_arrow(epoch_table(2, ROWS), epoch=2).skipped
        assert rt.write_arrow(epoch_table(3, ROWS)).committed
    assert_ids_exact(target.ids(), [1, 2, 3], ROWS)
    assert target.commit_epochs(name) == [2, 3]


def test_postgres_marker_deleted_while_an_epoch_is_pending(
        pg_server: PostgresServer, schema: str, name: str, meta: str) -> None:
    """Nothing can tell whether the pending epoch reached the table: DataLossError, shown
    in status as a failed sink, and the epoch is not committed."""
    target = PostgresTarget(pg_server, schema)
    with closes_with_epoch_pending(), _runtime(name, target.sink(method="staging"), meta,
                                               commit_timeout=3) as rt:
        assert rt.write_arrow(epoch_table(1, ROWS)).committed
        arm_fault(name, "coordinator.after_pending", action="sleep", seconds=2.0,
                  when={"epoch": 2})
        thread, box = run_in_thread(lambda: rt.write_arrow(epoch_table(2, ROWS)))
        wait_fired(name, "coordinator.after_pending")
        target.delete_marker()
        thread.join(timeout=60)
        assert "error" not in box, box.get("error")
        assert not box["result"].committed
        status = rt.status()
    sink = status.sinks["main"]
    assert sink.state == "failed" and status.pending_epochs == [2]
    assert (sink.last_error or "").startswith("DataLossError"), sink.last_error
    assert "while epoch 2 is pending" in (sink.last_error or "")
    assert_ids_exact(target.ids(), [1], ROWS)
