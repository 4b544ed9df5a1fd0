"""``SinkRuntime`` on the PostgreSQL meta store (``metastore="postgresql://..."``).

The same exactly-once cases as on SQLite, end to end: coordinator kills before and after
the sink commit, a closed runtime's successor reading the decisions back, and the DSN's
password kept out of status, errors and every log line (the driver's and the actors').
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from raysink import MetaStoreError, SinkRuntime
from raysink.testing import arm_fault
from tests.integration.helpers import epoch_table
from tests.integration.real_targets import (
    DeltaTarget,
    PostgresTarget,
    assert_ids_exact,
)
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]

ROWS = 200


def _ray_log_text() -> str:
    """Everything the actors of this Ray session logged so far."""
    import ray

    node = ray._private.worker._global_node
    assert node is not None
    logs = Path(node.get_session_dir_path()) / "logs"
    return "\n".join(p.read_text(errors="replace") for p in logs.rglob("*")
                     if p.is_file() and p.suffix in (".out", ".err", ".log"))


def test_runtime_on_postgres_metastore_survives_coordinator_kills(
        pg_server: PostgresServer, schema: str, tmp_path: Path, name: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Delta and PostgreSQL sinks, decisions in PostgreSQL: the coordinator SIGKILLed after
    PENDING (epoch 3) and after the sink commits (epoch 4); a new runtime reads the
    decisions back. Both targets hold epochs 1-5 once; no password anywhere."""
    caplog.set_level(logging.DEBUG, logger="raysink")
    password = pg_server.password("raysink")
    delta, pg = DeltaTarget(tmp_path / "delta"), PostgresTarget(pg_server, schema)
    sinks = {"lake": delta.sink(), "db": pg.sink()}
    meta = pg_server.dsn()
    with SinkRuntime(name, sinks, metastore=meta, retry_cap=0.5, progress=False) as rt:
        for epoch in (1, 2):
            assert rt.write_arrow(epoch_table(epoch, ROWS)).committed
        arm_fault(name, "coordinator.after_pending", action="kill", when={"epoch": 3})
        assert rt.write_arrow(epoch_table(3, ROWS)).committed
        arm_fault(name, "coordinator.after_commit", action="kill",
                  when={"epoch": 4, "sink": "db"})
        fourth = rt.write_arrow(epoch_table(4, ROWS))
        # recovery found db's marker, of this very decision (``holds_decision``): not committed
        # again (commit_epochs below), and not reported skipped either
        assert (fourth.committed, fourth.skipped, fourth.skipped_sinks) == (True, False, ())
        status = rt.status()
    assert status.metastore.startswith("postgresql://") and "***" in status.metastore
    assert password not in repr(status)

    with SinkRuntime(name, sinks, metastore=meta, progress=False) as rt:
        assert rt.status().last_committed_epoch == 4  # read back from PostgreSQL
        assert rt.write_arrow(epoch_table(4, ROWS), epoch=4).skipped
        assert rt.write_arrow(epoch_table(5, ROWS)).committed
    for target, sink in ((delta, "lake"), (pg, "db")):
        assert_ids_exact(target.ids(), [1, 2, 3, 4, 5], ROWS)
        assert target.commit_epochs(name, sink) == [1, 2, 3, 4, 5]
    assert name in caplog.text and password not in caplog.text
    actor_logs = _ray_log_text()
    assert name in actor_logs  # the actors' log lines are there, and hold no password
    assert password not in actor_logs


@pytest.mark.parametrize("case", ["wrong password", "no permission"])
def test_unusable_postgres_metastore_at_start(pg_server: PostgresServer, tmp_path: Path,
                                              name: str, case: str) -> None:
    """Refused in start() as MetaStoreError, the password redacted, no actor started."""
    password = pg_server.password("raysink")
    meta = (pg_server.dsn(password=password + "-wrong") if case == "wrong password"
            else pg_server.dsn(user="reader"))
    rt = SinkRuntime(name, DeltaTarget(tmp_path / "d").sink(), metastore=meta, progress=False)
    with pytest.raises(MetaStoreError) as info:
        rt.start()
    text = f"{info.value} {info.value!r}"
    assert password not in text and pg_server.password("reader") not in text
    assert "***" in text or case == "no permission"
    assert not (tmp_path / "d").exists()
