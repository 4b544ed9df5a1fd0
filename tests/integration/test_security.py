"""Security properties, through the whole runtime on real Ray and PostgreSQL.

* secrets (the PostgresSink DSN password, the PostgreSQL meta store password) never appear
  in logs (the driver's and every Ray worker's log files), errors, ``status()`` or the meta
  store's rows;
* hostile table and column names and values cannot inject SQL;
* the meta store holds JSON only;
* Ray's token authentication stays on, and a client without the token is refused;
* a manifest path that leaves the sink's directory is refused (``MetaStoreError``), never
  followed.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import ray
from psycopg import sql

import raysink
from raysink import MetaStoreError, SinkRuntime, SinkUnavailableError
from raysink.coordinator.metastore import open_metastore
from raysink.sinks import DeltaSink, ParquetSink, PostgresSink
from raysink.sinks.base import Sink
from raysink.testing import arm_fault
from tests.integration.helpers import (
    closes_with_epoch_pending,
    read_ids,
    run_in_thread,
    wait_fired,
)
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.usefixtures("ray_session")

ROWS = 200


def _table(epoch: int, rows: int = ROWS) -> pa.Table:
    return pa.table({"id": pa.array([epoch * 1_000_000 + i for i in range(rows)], pa.int64()),
                     "note": pa.array([f"n{i}" for i in range(rows)])})


def _ray_log_files(since: float) -> list[Path]:
    """Every Ray log file of this session written to since ``since``."""
    node = ray._private.worker._global_node
    assert node is not None
    logs = Path(node.get_logs_dir_path())
    return [p for p in logs.rglob("*") if p.is_file() and p.stat().st_mtime >= since - 1]


def _grep(paths: list[Path], secret: str) -> list[str]:
    needle = secret.encode()
    return [str(p) for p in paths if needle in p.read_bytes()]


def _meta_rows_pg(pg: PostgresServer) -> str:
    dumped = []
    for table in ("raysink_runtimes", "raysink_epochs", "raysink_sink_status"):
        dumped.append(repr(pg.execute(f"SELECT * FROM {table}", dbname="raysink")))
    return "\n".join(dumped)


@pytest.fixture()
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)
    yield caplog


def test_secrets_never_leak(pg_server: PostgresServer, tmp_path: Path,
                            debug_logs: pytest.LogCaptureFixture) -> None:
    password = pg_server.password("raysink")
    started = time.time()
    name = "sec-secrets"
    sink = PostgresSink(pg_server.dsn(), "sec_secrets")
    with SinkRuntime(name, sink, metastore=pg_server.dsn(), commit_timeout=30) as rt:
        assert rt.write_arrow(_table(1)).committed
        # a failed attempt logs its error: kill a writer after it staged (prepared txn)
        arm_fault(name, "writer.after_pre_commit", action="kill",
                  when={"epoch": 2, "writer": 0})
        assert rt.write_arrow(_table(2)).committed
        status = rt.status()
        shown = [repr(status), str(status.metastore), repr(rt.sinks), repr(sink.describe())]
    for text in shown:
        assert password not in text
    assert "***" in status.metastore
    assert password not in debug_logs.text
    assert password not in _meta_rows_pg(pg_server)
    assert not _grep(_ray_log_files(started), password)


@pytest.mark.parametrize("where", [
    "sink",       # a PostgresSink with a wrong password: validate() refuses it
    "metastore",  # a PostgreSQL meta store with a wrong password
])
def test_secrets_not_in_errors(pg_server: PostgresServer, tmp_path: Path, where: str,
                               debug_logs: pytest.LogCaptureFixture) -> None:
    secret = "Wr0ng-" + os.urandom(6).hex()
    wrong = pg_server.dsn(password=secret)
    if where == "sink":
        rt = SinkRuntime(f"sec-err-{where}", PostgresSink(wrong, "sec_err"),
                         metastore=f"sqlite:///{tmp_path / 'meta.db'}")
        expected: type[Exception] = SinkUnavailableError
    else:
        rt = SinkRuntime(f"sec-err-{where}", ParquetSink(str(tmp_path / "out")), metastore=wrong)
        expected = MetaStoreError
    with pytest.raises(expected) as info:
        rt.start()
    chain: list[BaseException] = []
    error: BaseException | None = info.value
    while error is not None and len(chain) < 10:
        chain.append(error)
        error = error.__cause__ or error.__context__
    for item in chain:
        assert secret not in str(item) and secret not in repr(item)
    assert secret not in debug_logs.text


HOSTILE_TABLE = 'evil"; DROP TABLE sec_victim; --'
HOSTILE_COLUMNS = ["a\"b", "x'); DROP TABLE sec_victim; --", "semi;colon", "back\\slash"]


def test_hostile_identifiers_and_values_through_the_runtime(
        pg_server: PostgresServer, tmp_path: Path) -> None:
    """A table of each commit method (two sinks of one runtime) with hostile names and
    values."""
    pg_server.execute("CREATE TABLE IF NOT EXISTS public.sec_victim (x int)", dbname="raysink")
    pg_server.execute("GRANT ALL ON public.sec_victim TO raysink", dbname="raysink")
    values = ["'; DROP TABLE sec_victim; --", 'q"uote', "new\nline", "tab\tback\\slash"]
    data = pa.table({"id": pa.array(range(4), pa.int64()),
                     **{c: pa.array(values) for c in HOSTILE_COLUMNS}})
    tables = {method: f"{HOSTILE_TABLE} {method}" for method in ("prepared", "staging")}
    sinks = {method: PostgresSink(pg_server.dsn(), table, method=method)
             for method, table in tables.items()}
    # one writer per sink: a name is quoted the same by every writer and the coordinator
    with SinkRuntime("sec-hostile", sinks, writers=1,
                     metastore=f"sqlite:///{tmp_path / 'meta.db'}") as rt:
        assert rt.write_arrow(data).committed
    for table in tables.values():
        query = sql.SQL("SELECT {} FROM public.{} ORDER BY id").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in ["id", *HOSTILE_COLUMNS]),
            sql.Identifier(table)).as_string(None)
        got = pg_server.execute(query, dbname="raysink")
        assert got == [(i, *([values[i]] * len(HOSTILE_COLUMNS))) for i in range(4)], table
    assert pg_server.execute("SELECT count(*) FROM public.sec_victim", dbname="raysink") == [(0,)]


_JSON_COLUMNS = {
    "raysink_runtimes": ("sinks", "dropped", "epoch_source"),
    "raysink_epochs": ("layout", "manifests"),
    "raysink_sink_status": ("history",),
}


def _sqlite_rows(db: Path) -> dict[str, list[dict[str, Any]]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: [dict(r) for r in conn.execute(f'SELECT * FROM "{t}"')] for t in tables}
    finally:
        conn.close()


def test_ray_token_authentication_stays_on(tmp_path: Path) -> None:
    from ray._raylet import (  # type: ignore[attr-defined]
        AuthenticationMode,
        get_authentication_mode,
    )

    assert os.environ.get("RAY_AUTH_MODE", "token").lower() != "disabled"
    assert get_authentication_mode() == AuthenticationMode.TOKEN
    package = Path(raysink.__file__).parent
    for source in package.rglob("*.py"):
        assert "RAY_AUTH_MODE" not in source.read_text(), f"{source} touches Ray's auth mode"
    # A client with the wrong token is refused by the running cluster.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    # (3 connection attempts, a second apart, rather than Ray's 20: each is refused alike)
    env.update(HOME=str(tmp_path), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32,
               RAY_NUM_REDIS_GET_RETRIES="3")
    probe = ("import ray, sys\n"
             "try:\n"
             f"    ray.init(address={ray.get_runtime_context().gcs_address!r})\n"
             "except Exception as exc:\n"
             "    print('REFUSED', type(exc).__name__, str(exc)[:300]); sys.exit(0)\n"
             "print('ACCEPTED')\n")
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                            text=True, timeout=120)
    assert "REFUSED" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "InvalidAuthToken" in result.stderr, result.stdout + result.stderr[-2000:]


def _forge_pending(db: Path, runtime: str, epoch: int, paths: dict[str, str]) -> None:
    """A PENDING record whose manifest for each sink names its path in ``paths``, as an
    attacker with write access to the meta store would leave it."""
    store = open_metastore(f"sqlite:///{db}", runtime)
    try:
        record = store.load(runtime)
        assert record is not None
        store.put_open(runtime, record.generation, epoch, 1, list(paths), {})
        manifests = {sink: [{"writer": 0, "epoch": epoch, "attempt": 1, "rows": 1, "bytes": 8,
                             "schema": None,
                             "files": [{"path": path, "rows": 1, "bytes": 8, "size": 8}]}]
                     for sink, path in paths.items()}
        store.put_pending(runtime, record.generation, epoch, 1, manifests)
    finally:
        store.close()


ESCAPES = {
    "up": "../../etc/x",  # up and out of the sink directory
    "dots": "_raysink/staging/000000000002/0001/../../../../../etc/x",  # dots in a staged path
    "absolute": "/etc/x",
}


def test_metastore_holds_json_only_and_manifest_paths_cannot_escape_on_recovery(
        tmp_path: Path) -> None:
    """A sink per way out of its directory, in one runtime.

    Every stored value is a number, plain text or JSON text: no pickle, no blobs. The
    PENDING rows (with their manifests) are read while epoch 2 is held at a fault point.
    Then a forged PENDING record names a manifest path out of each sink's directory: each
    sink refuses its own, stalls with ``MetaStoreError``, and nothing is followed."""
    roots = {sink: tmp_path / "deep" / sink for sink in ESCAPES}
    bait = tmp_path / "etc" / "x"  # where "../../etc/x" from a sink directory points
    bait.parent.mkdir(parents=True, exist_ok=True)
    bait.write_text("bait")
    name, db = "sec-escape", tmp_path / "meta.db"

    def sinks() -> dict[str, Sink]:
        return {sink: ParquetSink(str(root)) for sink, root in roots.items()}

    # one writer per sink: what is stored and what recovery follows are the coordinator's
    with SinkRuntime(name, sinks(), writers=1, metastore=f"sqlite:///{db}") as rt:
        assert rt.write_arrow(_table(1)).committed
        arm_fault(name, "coordinator.after_pending", action="sleep", seconds=3.0,
                  when={"epoch": 2})
        thread, box = run_in_thread(lambda: rt.write_arrow(_table(2)))
        wait_fired(name, "coordinator.after_pending")
        rows = _sqlite_rows(db)
        thread.join(timeout=60)
        assert box["result"].committed
    _assert_json_only(rows)

    _forge_pending(db, name, 3, ESCAPES)
    before = {sink: sorted(p.name for p in root.iterdir()) for sink, root in roots.items()}
    with closes_with_epoch_pending(), SinkRuntime(
            name, sinks(), writers=1, metastore=f"sqlite:///{db}", commit_timeout=2,
            retry_cap=0.2) as rt:
        deadline = time.monotonic() + 30
        while (any(s.last_error is None for s in rt.status().sinks.values())
               and time.monotonic() < deadline):
            time.sleep(0.1)
        status = rt.status()
    written = sorted(_table(1).column("id").to_pylist() + _table(2).column("id").to_pylist())
    for sink, root in roots.items():
        error = status.sinks[sink].last_error or ""
        assert status.sinks[sink].state == "stalled", (sink, status.sinks[sink])
        assert error.startswith("MetaStoreError"), (sink, error)
        assert sorted(p.name for p in root.iterdir()) == before[sink]
        assert sorted(read_ids(root)) == written
    assert bait.read_text() == "bait"


def _assert_json_only(rows: dict[str, list[dict[str, Any]]]) -> None:
    states = {r["state"] for r in rows["raysink_epochs"]}
    assert "PENDING" in states
    pending = [r for r in rows["raysink_epochs"] if r["state"] == "PENDING"]
    assert any(m["files"] for m in json.loads(pending[0]["manifests"]))
    for table, table_rows in rows.items():
        for row in table_rows:
            for column, value in row.items():
                assert value is None or isinstance(value, (int, float, str)), (table, column)
                if column in _JSON_COLUMNS.get(table, ()) and value is not None:
                    json.loads(str(value))


@pytest.mark.parametrize("kind", ["parquet", "delta"])
def test_sink_commit_refuses_escaping_manifest(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "deep" / "sink"
    sink = (ParquetSink(str(root)) if kind == "parquet" else DeltaSink(str(root))).bind(
        "sec", "main")
    bait = tmp_path / "etc" / "x"
    bait.parent.mkdir(parents=True)
    bait.write_text("bait")
    manifest = {"writer": 0, "epoch": 1, "attempt": 1, "rows": 1, "bytes": 4, "schema": None,
                "files": [{"path": "../../etc/x", "rows": 1, "bytes": 4, "size": 4,
                           "partition_values": {}, "modification_time": 0, "stats": "{}"}]}
    with pytest.raises(MetaStoreError):
        sink.commit(1, [manifest])
    with pytest.raises(MetaStoreError):
        sink.abort(1, [manifest])
    assert bait.read_text() == "bait"
    assert sink.committed_epoch() is None
