"""The ``raysink`` command without Ray: status from a real SQLite meta store, the table of
processes, errors, bench listing; the progress line; the demo's data and table check."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from raysink.cli import format_processes, main, read_status
from raysink.coordinator.metastore import SqliteMetaStore
from raysink.demo import ORDER_SCHEMA, check_ids, order_batch, percentile, prepare_workdir
from raysink.driver.remote import role_of
from raysink.errors import ConfigError
from raysink.progress import Progress, ProgressSnapshot, format_rate, render_line
from raysink.protocol.results import WriterStatus
from raysink.reports import ActorProcess


def _store_with_history(path: Path) -> str:
    """Runtime ``orders`` with two sinks: epoch 1 and 2 committed by both, epoch 3 pending,
    the delta sink stalled with an error."""
    store = SqliteMetaStore(path)
    gen = store.claim("orders", {"files": "parquet", "lake": "delta"}).generation
    for epoch in (1, 2):
        store.put_open("orders", gen, epoch, 1, ["files", "lake"], {})
        store.put_pending("orders", gen, epoch, 1, {"files": [], "lake": []})
        store.put_committed("orders", gen, epoch, "files")
        store.put_committed("orders", gen, epoch, "lake")
    store.put_open("orders", gen, 3, 1, ["files", "lake"], {})
    store.put_pending("orders", gen, 3, 1, {"files": [], "lake": []})
    store.put_committed("orders", gen, 3, "files")
    store.set_sink_status("orders", gen, "files", "running")
    store.set_sink_status("orders", gen, "lake", "running")
    store.set_sink_status("orders", gen, "lake", "stalled", "CommitFailedError: disk full")
    store.bind_source("orders", gen, {"kind": "query", "id": "q-123", "offset": 0})
    store.close()
    return f"sqlite:///{path}"


def test_status_reads_the_meta_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = _store_with_history(tmp_path / "meta.db")
    stored = read_status("orders", url)
    assert stored.status.last_committed_epoch == 2  # epoch 3 is not in "lake" yet
    assert stored.status.pending_epochs == [3]
    assert stored.status.sinks["files"].last_committed_epoch == 3
    lake = stored.status.sinks["lake"]
    assert (lake.state, lake.last_error) == ("stalled", "CommitFailedError: disk full")
    assert [h["state"] for h in lake.history] == ["running", "stalled"]
    assert stored.epoch_source == {"kind": "query", "id": "q-123", "offset": 0}

    assert main(["status", "orders", "--metastore", url]) == 0
    out = capsys.readouterr().out
    assert "last committed epoch  2" in out and "pending epochs        3" in out
    assert "lake (delta): stalled" in out and "disk full" in out
    assert "streaming query q-123" in out

    assert main(["status", "orders", "--metastore", url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pending_epochs"] == [3] and data["sinks"]["lake"]["state"] == "stalled"


@pytest.mark.parametrize("argv, expected", [
    # no file at the default place: told where it looked, nothing created
    (["status", "nothing-here"], "no meta store at"),
    # a URL of no accepted form
    (["status", "x", "--metastore", "mysql://u:pw@h/db"], "metastore must be"),
])
def test_status_errors_are_readable(argv: list[str], expected: str, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / ".raysink").exists()


def test_status_of_an_unknown_runtime(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = _store_with_history(tmp_path / "meta.db")
    assert main(["status", "other", "--metastore", url]) == 2
    assert "no runtime named 'other'" in capsys.readouterr().err


def test_status_never_prints_a_password(capsys: pytest.CaptureFixture[str]) -> None:
    url = "postgresql://raysink:s3cret-pw@127.0.0.1:1/meta?connect_timeout=2"
    assert main(["status", "orders", "--metastore", url]) == 2
    err = capsys.readouterr().err
    assert "s3cret-pw" not in err and "Traceback" not in err


def _writer_status(**fields: object) -> WriterStatus:
    values: dict[str, object] = {
        "sink": "main", "writer": 0, "pid": 4711, "rows_total": 12_000, "epoch": 3,
        "attempt": 1, "epochs_here": ((3, 1),), "waiting_for_feeds": {},
        "mailbox_depth": 2, "mailbox_bytes": 3 * 2**20, "refused": 1, "busy": None,
        "slow_warnings": 0, "closed": False}
    return WriterStatus(**{**values, **fields})  # type: ignore[arg-type]


def test_processes_read_as_a_table() -> None:
    node = "ab12cd34ef56" + "0" * 44
    text = format_processes([
        ActorProcess(role="coordinator", name="orders.coordinator", node_id=node,
                     node_ip="10.0.0.5", pid=4700),
        ActorProcess(role="writer", name="orders.main.writer-0", sink="main", writer=0,
                     node_id=node, node_ip="10.0.0.5", pid=4711, mailbox=_writer_status(
                         busy={"call": "flush", "seconds": 12.5})),
        ActorProcess(role="writer", name="orders.main.writer-1.1", sink="main", writer=1),
    ])
    assert text.splitlines() == [
        "processes",
        "  coordinator orders.coordinator      node ab12cd34ef56 (10.0.0.5), pid 4700",
        "  writer      orders.main.writer-0    node ab12cd34ef56 (10.0.0.5), pid 4711",
        "    epochs held (epoch/attempt) 3/1; mailbox 2 messages, 3.0 MiB; refused 1; rows "
        "written 12,000; flush running for 12.5 s",
        "  writer      orders.main.writer-1.1  not answering (restarting, or its node is lost)",
    ]
    assert format_processes([]) == "processes             none live in this Ray cluster"


@pytest.mark.parametrize("name, role", [
    ("orders.coordinator", ("coordinator", None, None)),
    ("orders.coordinator.2", ("coordinator", None, None)),  # a later incarnation's name
    ("orders.coordinator-standby", ("standby", None, None)),
    ("orders.coordinator-standby.1", ("standby", None, None)),
    ("orders.main.writer-3", ("writer", "main", 3)),
    ("orders.coordinator.writer-0.4", ("writer", "coordinator", 0)),  # a sink so named
    ("orders-2.coordinator", None),  # another runtime
    ("orders.main.writer-x", None),
    ("raydp-executor-1", None),
])
def test_actor_names_say_their_role(name: str, role: object) -> None:
    assert role_of("orders", name) == role


def test_bench_lists_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "spark_write.py" in out and "spark_memory.py" in out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--events", "-5"])
    assert exited.value.code == 2
    assert "expected at least 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------- progress


def test_progress_is_quiet_off_a_terminal() -> None:
    stream = io.StringIO()  # not a TTY
    with Progress(total_rows=100, stream=stream) as progress:
        progress.advance(rows=60, epochs=1)
        progress.advance(rows=40, epochs=1, skipped=1)
    assert stream.getvalue() == ""
    snap = progress.snapshot()
    assert (snap.rows, snap.epochs, snap.skipped_epochs) == (100, 2, 1)
    assert progress.summary().startswith("100 rows in 2 epochs (1 skipped)")


def test_progress_draws_on_a_terminal() -> None:
    stream = io.StringIO()
    with Progress(total_rows=1000, total_epochs=4, stream=stream, enabled=True,
                  min_interval=0.0) as progress:
        progress.advance(rows=500, epochs=2)
    text = stream.getvalue()
    assert text.startswith("\r") and text.endswith("\n")
    assert "500/1,000 rows" in text and "2/4 epochs" in text and "50%" in text


def test_progress_line_fits_and_rates_read_well() -> None:
    snap = ProgressSnapshot(rows=2_500_000, epochs=3, skipped_epochs=0, seconds=2.0,
                            total_rows=None, total_epochs=None)
    assert render_line(snap, "writing", 200) == ("writing  2,500,000 rows  3 epochs  "
                                                 "1.25 M rows/s")
    assert len(render_line(snap, "writing", 20)) == 19
    assert format_rate(45_600) == "45,600 rows/s"


# ---------------------------------------------------------------------------- demo


def test_order_batch_is_realistic_and_unique() -> None:
    table = order_batch(1000, 500, np.random.default_rng(1))
    assert table.schema == ORDER_SCHEMA
    assert table["order_id"].to_pylist() == list(range(1000, 1500))
    assert set(table["status"].to_pylist()) <= {"created", "paid", "packed", "shipped",
                                                "delivered", "cancelled"}
    assert all(str(a).count(".") == 1 for a in table["amount"].to_pylist()[:10])


def test_check_ids_names_what_is_missing_or_doubled() -> None:
    # every id once
    assert check_ids(np.arange(10), 10).describe() == "yes"
    # 3 missing, 5 doubled, 42 unexpected
    bad = check_ids(np.array([0, 1, 2, 4, 5, 5, 6, 7, 8, 9, 42]), 10)
    assert (bad.missing, bad.doubled, bad.unexpected) == ([3], [5], [42])
    assert not bad.exact
    assert bad.describe().startswith("NO: 1 missing (e.g. 3); 1 doubled (e.g. 5)")


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99)) == (50.0, 99.0)
    assert percentile([3.0], 99) == 3.0


def test_workdir_of_someone_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="holds files the demo did not make"):
        prepare_workdir(tmp_path)
    assert (tmp_path / "precious.txt").exists()
    demo = prepare_workdir(tmp_path / "demo")
    (demo / "input").mkdir()
    assert prepare_workdir(demo) == demo and not (demo / "input").exists()
