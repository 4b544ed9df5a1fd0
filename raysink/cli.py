"""The ``raysink`` command: ``demo``, ``status``, ``maintain``, ``dashboard`` and ``bench``.

::

    raysink demo [--events N] [--batches K] [--workdir DIR] [--sink delta|parquet]
    raysink status NAME [--metastore URL] [--json] [--processes [--address ADDR]]
    raysink maintain NAME [--sink S] [--timeout SECONDS] [--address ADDR] [--json]
    raysink dashboard install [--session-dir DIR | --temp-dir DIR]
    raysink dashboard export FILE
    raysink dashboard alerts FILE [--stalled-for 5m] [...]
    raysink bench [write|memory|handoff|...] [-- ARGS...]

``status`` reads the meta store directly (no Ray, no actors): last committed epoch,
pending and open epochs, the epoch source, and each sink's state with its last error and
history. Passwords in meta store URLs are never printed. With ``--processes`` it also
joins the Ray cluster (``--address``, default ``auto``: the one this machine runs) and
shows what runs where: the runtime's live actors, each with its node and pid, a writer
with its mailbox (``rt.processes()`` shows the same in the driver).

``maintain`` runs a full table maintenance pass (``rt.maintain()``) through the running
runtime's coordinator, found in the Ray cluster (``--address``), so it is serialized with
the runtime's commits as the coordinator's own passes are. It never opens a table itself:
with no runtime of that name running it refuses, since a pass beside another process's
commits could race them (an idle table is maintained by starting its runtime and calling
``rt.maintain()``).

``dashboard install`` puts raysink's Grafana dashboard where the running Ray head's
Grafana provisioning reads it (``raysink.dashboards.install``; again after each head
start, as Ray rewrites that folder); ``export`` writes it for Grafana's *Import
dashboard*; ``alerts`` writes the Prometheus alert rules (``-`` for standard output).

Expected failures (any :class:`~raysink.errors.RaySinkError`) print their message and
exit with status 2, without a traceback; an interrupt exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from raysink import __version__
from raysink.errors import ConfigError, RaySinkError
from raysink.reports import ActorProcess, RuntimeStatus, SinkState, SinkStatus

if TYPE_CHECKING:
    from raysink.protocol.results import WriterStatus

__all__ = ["StoredStatus", "format_processes", "main", "read_processes", "read_status"]

log = logging.getLogger(__name__)

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130

#: Benchmarks ``raysink bench`` knows by short name (file under ``bench/``).
BENCHMARKS = {
    "write": "spark_write.py",
    "memory": "spark_memory.py",
    "handoff": "spark_handoff.py",
    "delta-iceberg": "sinks_delta_iceberg.py",
    "postgres": "sink_postgres.py",
}


# ---------------------------------------------------------------------------- status


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredStatus:
    """What the meta store says about a runtime, read without starting it."""

    status: RuntimeStatus
    generation: int
    open_epochs: list[int]
    epoch_source: dict[str, Any] | None
    sink_kinds: dict[str, str]


def read_status(name: str, metastore: str | None = None) -> StoredStatus:
    """Read runtime ``name``'s status from its meta store (default: the SQLite file under
    ``./.raysink/``). Raises ``ConfigError`` when there is no such store or runtime; a
    SQLite file is never created by looking."""
    from raysink.coordinator.metastore import default_url, open_metastore, redact_url

    url = metastore or default_url(name)
    _require_sqlite_file(url, name)
    store = open_metastore(url, name)
    try:
        record = store.load(name)
        if record is None:
            raise ConfigError(f"no runtime named {name!r} in meta store {redact_url(url)}; "
                              "check the name, or pass --metastore with the URL the job used",
                              runtime=name)
        records = store.records(name)
        statuses = store.sink_statuses(name)
        shown_url = store.url
    finally:
        store.close()
    committed: dict[str, int] = {}
    pending: set[int] = set()
    opened: set[int] = set()
    for rec in records:
        if rec.state.value == "COMMITTED":
            committed[rec.sink] = max(rec.epoch, committed.get(rec.sink, rec.epoch))
        elif rec.state.value == "PENDING":
            pending.add(rec.epoch)
        elif rec.state.value == "OPEN":
            opened.add(rec.epoch)
    live = [s for s in record.sinks if s not in record.dropped]
    sinks: dict[str, SinkStatus] = {}
    for sink in [*live, *record.dropped]:
        stored = statuses.get(sink)
        dropped = sink in record.dropped
        sinks[sink] = SinkStatus(
            state="dropped" if dropped else _state(stored.state if stored else "starting"),
            last_committed_epoch=committed.get(sink),
            last_error=stored.last_error if stored else None,
            history=list(stored.history) if stored else [])
    per_sink = [committed.get(s) for s in live]
    last = None if not per_sink or None in per_sink else min(e for e in per_sink if e is not None)
    status = RuntimeStatus(name=name, metastore=shown_url, last_committed_epoch=last,
                           pending_epochs=sorted(pending), sinks=sinks)
    return StoredStatus(status=status, generation=record.generation, open_epochs=sorted(opened),
                        epoch_source=record.epoch_source, sink_kinds=dict(record.sinks))


def _state(value: str) -> Any:
    return value if value in get_args(SinkState) else "starting"


def _require_sqlite_file(url: str, name: str) -> None:
    """A SQLite meta store must exist already: looking must not create one."""
    if not url.lower().startswith("sqlite:"):
        return
    path = url.split(":", 1)[1].removeprefix("///")
    if not Path(path).is_file():
        raise ConfigError(f"no meta store at {path}: runtime {name!r} never ran with it here. "
                          "Run `raysink status` from the directory the job ran in, or pass "
                          "--metastore sqlite:////abs/path.db (or the postgresql:// URL)",
                          runtime=name)


def format_status(stored: StoredStatus) -> str:
    """A person-readable report of ``stored``."""
    status = stored.status
    source = stored.epoch_source
    if source and source.get("kind") == "query":
        bound = (f"streaming query {source.get('id')} "
                 f"(epoch = batch_id + 1 + {source.get('offset', 0)})")
    else:
        bound = "its own epoch numbering"
    lines = [
        f"runtime               {status.name}",
        f"meta store            {status.metastore}",
        f"generation            {stored.generation}",
        f"epoch source          {bound}",
        f"last committed epoch  {_epoch(status.last_committed_epoch)}",
        f"pending epochs        {_epochs(status.pending_epochs)}",
        f"open epochs           {_epochs(stored.open_epochs)}",
        "sinks",
    ]
    for sink, info in status.sinks.items():
        kind = stored.sink_kinds.get(sink, "?")
        lines.append(f"  {sink} ({kind}): {info.state}, last committed epoch "
                     f"{_epoch(info.last_committed_epoch)}")
        if info.last_error:
            lines.append(f"    last error: {info.last_error}")
        for entry in info.history[-5:]:
            lines.append(f"    {_when(entry.get('time'))}  {entry.get('state')}"
                         + (f"  ({entry['error']})" if entry.get("error") else ""))
    return "\n".join(lines)


def _epoch(value: int | None) -> str:
    return "none" if value is None else str(value)


def _epochs(values: Sequence[int]) -> str:
    return ", ".join(map(str, values)) if values else "none"


def _when(value: Any) -> str:
    if not isinstance(value, int | float):
        return "?"
    return datetime.fromtimestamp(value).isoformat(sep=" ", timespec="seconds")


def read_processes(name: str, address: str | None = None,
                   timeout: float = 10.0) -> list[ActorProcess]:
    """The processes of runtime ``name``'s live actors, asked in the Ray cluster at
    ``address`` (default ``auto``: the one this machine runs), or in the Ray this process
    already joined. ``ConfigError`` when there is no cluster to join."""
    from raysink.driver.processes import find_processes

    with _joined_ray(name, address, "raysink status --processes"):
        return find_processes(name, timeout)


@contextlib.contextmanager
def _joined_ray(name: str, address: str | None, command: str) -> Iterator[None]:
    """Inside: this process is in the Ray cluster at ``address`` (default ``auto``: the
    one this machine runs), joined here and left after, or the one it already joined.
    ``ConfigError`` naming ``command`` when there is no cluster to join."""
    import ray

    joined = not ray.is_initialized()
    if joined:
        try:
            ray.init(address=address or "auto", log_to_driver=False,
                     logging_level=logging.WARNING)
        except Exception as exc:
            raise ConfigError(f"no Ray cluster to ask at {address or 'auto'} ({exc}): run "
                              f"`{command}` on a node of the cluster the job runs in, or "
                              "pass --address HOST:PORT of its head", runtime=name) from exc
    try:
        yield
    finally:
        if joined:
            ray.shutdown()


def format_processes(processes: Sequence[ActorProcess]) -> str:
    """A person-readable table of ``processes``: one line each."""
    if not processes:
        return "processes             none live in this Ray cluster"
    width = max(len(p.name) for p in processes)
    lines = ["processes"]
    for process in processes:
        where = (f"node {(process.node_id or '?')[:12]} ({process.node_ip}), pid {process.pid}"
                 if process.answered else "not answering (restarting, or its node is lost)")
        lines.append(f"  {process.role:<11} {process.name:<{width}}  {where}")
        if process.mailbox is not None:
            lines.append(f"    {_mailbox(process.mailbox)}")
    return "\n".join(lines)


def _mailbox(status: WriterStatus) -> str:
    held = ", ".join(f"{epoch}/{attempt}" for epoch, attempt in status.epochs_here) or "none"
    text = (f"epochs held (epoch/attempt) {held}; mailbox {status.mailbox_depth} messages, "
            f"{status.mailbox_bytes / 2**20:.1f} MiB; refused {status.refused}; "
            f"rows written {status.rows_total:,}")
    if status.busy:
        text += f"; {status.busy.get('call')} running for {status.busy.get('seconds')} s"
    return text + ("; closed" if status.closed else "")


def _cmd_status(args: argparse.Namespace) -> int:
    stored = read_status(args.name, args.metastore)
    processes = read_processes(args.name, args.address) if args.processes else None
    if args.json:
        shown = {**asdict(stored.status), "generation": stored.generation,
                 "open_epochs": stored.open_epochs, "epoch_source": stored.epoch_source,
                 "sink_kinds": stored.sink_kinds}
        if processes is not None:
            shown["processes"] = [asdict(p) for p in processes]
        print(json.dumps(shown, indent=2, default=str))
    else:
        print(format_status(stored))
        if processes is not None:
            print(format_processes(processes))
    return 0


def run_maintenance(name: str, sink: str | None, timeout: float,
                    address: str | None = None) -> list[Any]:
    """``rt.maintain()`` of the running runtime ``name``, through its coordinator in the
    Ray cluster at ``address``; ``ConfigError`` when no such runtime runs there."""
    from raysink.driver.calls import ask
    from raysink.driver.remote import find_coordinator
    from raysink.protocol.clients import CoordinatorClient

    with _joined_ray(name, address, "raysink maintain"):
        handle = find_coordinator(name)
        if handle is None:
            raise ConfigError(f"no runtime {name!r} is running in this Ray cluster; maintenance "
                              "runs through its coordinator (serialized with its commits), so "
                              "start the job and run this again, or call rt.maintain() in it",
                              runtime=name)
        reports: list[Any] = ask(CoordinatorClient.of(handle).maintain(sink, timeout),
                                 what="maintain", runtime=name, timeout=timeout + 30)
        return reports


def _cmd_maintain(args: argparse.Namespace) -> int:
    reports = run_maintenance(args.name, args.sink, args.timeout, args.address)
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=2))
        return 0
    for r in reports:
        print(f"{r.sink:<20} {', '.join(r.steps) or 'nothing to do'}: {r.files_compacted} "
              f"files compacted into {r.files_written}, {r.snapshots_expired} snapshots "
              f"expired, {r.files_deleted} files deleted, {r.seconds:.2f}s")
    return 0


# ---------------------------------------------------------------------------- dashboard


def _cmd_dashboard_install(args: argparse.Namespace) -> int:
    from raysink.dashboards import dashboard_text
    from raysink.dashboards.install import install, session_dir

    session = Path(args.session_dir) if args.session_dir else session_dir(args.temp_dir)
    done = install(dashboard_text(), session)
    verb = "installed" if done.changed else "already installed (unchanged)"
    print(f"{verb}: {done.path}")
    if done.provisioned:
        print("Grafana started with Ray's configuration (--config <temp dir>/session_latest/"
              "metrics/grafana/grafana.ini) shows it as \"raysink\" in the folder \"Ray\".")
    else:
        print("note: Ray wrote no Grafana provisioning for this session (the head runs "
              "without Ray's dashboard), so no Grafana reads this folder: import the "
              "dashboard instead (raysink dashboard export FILE).")
    print(f"Ray rewrites {done.path.parent.parent} each time the head starts: run `raysink "
          "dashboard install` again after a head restart, or import the dashboard once "
          "through Grafana's UI (raysink dashboard export FILE).")
    return 0


def _cmd_dashboard_export(args: argparse.Namespace) -> int:
    from raysink.dashboards import dashboard_text

    _write_out(args.file, dashboard_text(exported=True))
    if args.file != "-":
        print(f"wrote {args.file}: in Grafana, Dashboards > New > Import, upload it and "
              "choose the Prometheus data source that scrapes Ray's metrics")
    return 0


def _cmd_dashboard_alerts(args: argparse.Namespace) -> int:
    from raysink.dashboards import alerts_text
    from raysink.dashboards.alerts import AlertSettings

    settings = AlertSettings(
        stalled_for=args.stalled_for, pending_for=args.pending_for,
        commit_p99_seconds=args.commit_p99_seconds, commit_p99_for=args.commit_p99_for,
        replacements=args.replacements, replacements_window=args.replacements_window,
        rewinds=args.rewinds, rewinds_window=args.rewinds_window)
    _write_out(args.file, alerts_text(settings))
    if args.file != "-":
        print(f"wrote {args.file}: add it to rule_files in prometheus.yml and reload "
              "Prometheus (check it with `promtool check rules FILE`)")
    return 0


def _write_out(file: str, text: str) -> None:
    if file == "-":
        sys.stdout.write(text)
        return
    try:
        Path(file).write_text(text)
    except OSError as exc:
        raise ConfigError(f"cannot write {file}: {exc.strerror or exc}") from None


def _add_dashboard(commands: Any) -> None:
    from raysink.dashboards.alerts import AlertSettings

    dashboard = commands.add_parser(
        "dashboard", help="raysink's Grafana dashboard and Prometheus alert rules")
    actions = dashboard.add_subparsers(dest="action", required=True, metavar="ACTION")
    install = actions.add_parser(
        "install", help="put the dashboard where the running Ray head's Grafana reads it")
    where = install.add_mutually_exclusive_group()
    where.add_argument("--session-dir", default=None,
                       help="the head's session dir (default: <temp dir>/session_latest)")
    where.add_argument("--temp-dir", default=None,
                       help="Ray's temp dir, as given to `ray start --temp-dir` "
                            "(default: $RAY_TMPDIR or /tmp/ray)")
    install.set_defaults(run=_cmd_dashboard_install)
    export = actions.add_parser(
        "export", help="write the dashboard for Grafana's Import (asks for a data source)")
    export.add_argument("file", help="where to write the JSON (- for standard output)")
    export.set_defaults(run=_cmd_dashboard_export)
    alerts = actions.add_parser("alerts", help="write the Prometheus alert rules")
    alerts.add_argument("file", help="where to write the YAML (- for standard output)")
    default = AlertSettings()
    for option, kind, what in (
            ("stalled_for", str, "a sink stalled this long fires"),
            ("pending_for", str, "a sink at max_pending_epochs this long fires"),
            ("commit_p99_seconds", float, "p99 of epoch commits above this (seconds)"),
            ("commit_p99_for", str, "... for this long fires"),
            ("replacements", int, "this many actor restarts and replacements"),
            ("replacements_window", str, "... within this window fire"),
            ("rewinds", int, "this many stream rewinds"),
            ("rewinds_window", str, "... within this window fire")):
        alerts.add_argument(f"--{option.replace('_', '-')}", dest=option, type=kind,
                            default=getattr(default, option),
                            help=f"{what} (default: %(default)s)")
    alerts.set_defaults(run=_cmd_dashboard_alerts)


# ---------------------------------------------------------------------------- bench


def bench_dir() -> Path | None:
    """``bench/`` of a source checkout (editable install), or ``None``."""
    candidate = Path(__file__).resolve().parent.parent / "bench"
    return candidate if candidate.is_dir() else None


def _cmd_bench(args: argparse.Namespace) -> int:
    where = bench_dir()
    if where is None:
        print("the benchmarks live in bench/ of a source checkout of raysink: clone it, run "
              "`make setup`, then `raysink bench write` or `python bench/spark_write.py`")
        return 0
    if args.name is None:
        print("benchmarks (run one with `raysink bench NAME [-- ARGS]`):")
        for short, file_name in BENCHMARKS.items():
            path = where / file_name
            if path.is_file():
                print(f"  {short:<14} {path}  {_first_doc_line(path)}")
        return 0
    script = where / BENCHMARKS[args.name]
    if not script.is_file():
        raise ConfigError(f"benchmark {args.name!r} is not in this checkout ({script} missing)")
    extra = [a for a in args.args if a != "--"]
    return subprocess.call([sys.executable, str(script), *extra])


def _first_doc_line(path: Path) -> str:
    for line in path.read_text().splitlines():
        text = line.strip().strip('"').strip()
        if text:
            return text
    return ""


# ---------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from raysink.demo import DemoOptions, run_demo

    options = DemoOptions(events=args.events, batches=args.batches, workdir=args.workdir,
                          sink=args.sink, writers=args.writers)
    return 0 if run_demo(options).exact else 1


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``raysink``."""
    parser = argparse.ArgumentParser(
        prog="raysink", description="Exactly-once sinks for Spark-on-Ray (RayDP) jobs.")
    parser.add_argument("--version", action="version", version=f"raysink {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo", help="stream synthetic order events through Spark into a table, then check it")
    demo.add_argument("--events", type=_positive, default=1_000_000,
                      help="order events in all (default: %(default)s)")
    demo.add_argument("--batches", type=_positive, default=8,
                      help="micro-batches (default: %(default)s)")
    demo.add_argument("--workdir", default=".raysink/demo",
                      help="directory for input, checkpoint, table and meta store "
                           "(default: ./%(default)s)")
    demo.add_argument("--sink", choices=("delta", "parquet"), default="delta",
                      help="table format (default: %(default)s)")
    demo.add_argument("--writers", type=_positive, default=2,
                      help="writer actors (default: %(default)s)")
    demo.set_defaults(run=_cmd_demo)

    status = commands.add_parser(
        "status", help="a runtime's epochs and sinks, read from its meta store")
    status.add_argument("name", help="the runtime's name")
    status.add_argument("--metastore", default=None,
                        help="meta store URL (default: sqlite:///<cwd>/.raysink/<name>.db)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--processes", action="store_true",
                        help="also show the runtime's live actors: node, pid, mailbox (joins "
                             "the Ray cluster)")
    status.add_argument("--address", default=None,
                        help="the Ray cluster for --processes (default: auto, the one this "
                             "machine runs)")
    status.set_defaults(run=_cmd_status)

    maintain = commands.add_parser(
        "maintain", help="a full table maintenance pass through the running runtime")
    maintain.add_argument("name", help="the runtime's name")
    maintain.add_argument("--sink", default=None,
                          help="one sink (default: every sink whose maintenance is on)")
    maintain.add_argument("--timeout", type=float, default=600.0,
                          help="seconds to wait for the pass (default: %(default)s)")
    maintain.add_argument("--address", default=None,
                          help="the Ray cluster the runtime runs in (default: auto)")
    maintain.add_argument("--json", action="store_true", help="print JSON")
    maintain.set_defaults(run=_cmd_maintain)

    _add_dashboard(commands)

    bench = commands.add_parser("bench", help="list or run the benchmarks in bench/")
    bench.add_argument("name", nargs="?", choices=sorted(BENCHMARKS), default=None,
                       help="benchmark to run; without it, list them")
    bench.add_argument("args", nargs=argparse.REMAINDER,
                       help="arguments for the benchmark script (after --)")
    bench.set_defaults(run=_cmd_bench)
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``raysink`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.run(args)
    except RaySinkError as exc:
        print(f"raysink {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"raysink {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())
