"""The ``maintenance_point`` trials: a maintenance crash point reached in a known pass.

A maintenance pass runs in the coordinator's commit worker of its sink, between commits,
after an epoch's commit (or when ``rt.maintain()`` asks): not inside the epoch the harness
writes, where the protocol points fire. So the trial's sink gets an aggressive policy
(``TrialSpec.extra["maintenance"]``: any two small files compacted, one or two snapshots
kept, none for its age, a checkpoint every version or two) and the point is armed for
sink ``main`` when the fault epoch begins; then, by the trial's ``variant``:

``forced``
    the coordinator starts no pass by itself (``every_epochs=1000``); a thread calls
    ``rt.maintain(sink="main")`` while the fault epoch is written, and again after each
    epoch committed since until the point fired (a pass with too little to do, one file
    to compact or one file to delete, passes no point);
``auto``
    a pass is due after every epoch; the harness writes the fault epoch and waits for the
    point to fire in the pass that follows a commit.

``how="self"`` SIGKILLs the coordinator there (a forced ``rt.maintain()`` is sent again
to the restarted one); ``raise`` fails the pass (``InjectedFault``), which the
coordinator tries again after its backoff. A point no pass reached by then fires in the
final pass.

After the last epoch the harness forces a final pass (``final_pass``), which must finish
what the crashed one left, and ``table_problems`` checks the table besides its rows: the
marker reads the last epoch, every retained version reads back (time travel) with each
row at most once, nothing is left that the policy expires (log entries below the
retained checkpoint, snapshots beyond ``keep_snapshots``, a maintenance journal,
unreferenced manifests), and no data file is on disk that no retained version references.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from raysink import RaySinkError, SinkRuntime
from raysink.testing import arm_fault, fired
from tests.chaos.faults import run_in_thread, wait_fired
from tests.chaos.plan import TrialSpec

__all__ = ["ForcedPasses", "drive", "final_pass", "table_problems"]

_PASS_TIMEOUT = 120.0
_AUTO_WAIT = 30.0  # seconds for the coordinator's own pass to reach the point
_FINAL_TRIES = 3


def _say(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _committed(rt: SinkRuntime) -> int | None:
    try:
        return rt.status().last_committed_epoch
    except RaySinkError:  # the coordinator restarting
        return None


def _force(rt: SinkRuntime, notes: list[str], what: str) -> None:
    try:
        reports = rt.maintain(sink="main", timeout=_PASS_TIMEOUT)
    except RaySinkError as exc:
        notes.append(f"{what}: {_say(exc)}")
        return
    notes.append(f"{what}: {', '.join(s for r in reports for s in r.steps) or 'nothing'}")


class ForcedPasses:
    """``rt.maintain(sink="main")`` from a thread: one now, then one after each epoch
    committed since, until the point fired or ``stop`` (the trial's epochs written)."""

    def __init__(self, rt: SinkRuntime, spec: TrialSpec, notes: list[str]) -> None:
        self._rt, self._spec, self._notes = rt, spec, notes
        self._done = threading.Event()
        self._thread, self._box = run_in_thread(self._run)

    def _run(self) -> None:
        point = self._spec.point
        assert point is not None
        last = _committed(self._rt)
        while True:
            _force(self._rt, self._notes, f"forced pass after epoch {last}")
            if fired(self._spec.name, point):
                return
            while True:  # the pass had too little to do: again after the next commit
                now = _committed(self._rt)
                if now is not None and (last is None or now > last):
                    last = now
                    break
                if self._done.is_set():
                    return
                time.sleep(0.1)

    def stop(self, *, quiet: bool = False) -> None:
        """Wait for the pass under way (a pass after the last commit included); ``quiet``:
        a trial already failing (its runtime closed) raises nothing more here."""
        self._done.set()
        self._thread.join(timeout=_PASS_TIMEOUT * 2)
        if quiet:
            return
        if self._thread.is_alive():
            raise AssertionError("the forced maintenance passes never ended")
        if "error" in self._box:
            raise self._box.pop("error")


def drive(rt: SinkRuntime, spec: TrialSpec, work: Callable[[], Any],
          notes: list[str]) -> ForcedPasses | None:
    """Arm the trial's point for sink ``main`` and run ``work`` (the fault epoch's write,
    or the stream) while a pass reaches it (see the module's docstring). A ``forced``
    trial's passes go on over the epochs after it: ``stop`` them before the final pass."""
    assert spec.point is not None
    arm_fault(spec.name, spec.point, action="kill" if spec.how == "self" else "raise",
              when={"sink": "main"})
    if spec.variant != "auto":
        forced = ForcedPasses(rt, spec, notes)
        try:
            work()
        except BaseException:
            forced.stop(quiet=True)
            raise
        return forced
    work()
    if not wait_fired(spec.name, spec.point, _AUTO_WAIT):
        notes.append(f"{spec.point} not reached by the passes after the fault epoch")
    return None


def final_pass(rt: SinkRuntime, spec: TrialSpec, notes: list[str]) -> int:
    """A forced pass once every epoch committed (it finishes what a crashed pass left;
    a point no pass reached fires here, so it is tried again); the last committed epoch."""
    for attempt in range(_FINAL_TRIES):
        try:
            reports = rt.maintain(sink="main", timeout=_PASS_TIMEOUT)
        except RaySinkError as exc:
            notes.append(f"final pass {attempt + 1}: {_say(exc)}")
            time.sleep(0.5)
            continue
        notes.append(f"final pass: {', '.join(s for r in reports for s in r.steps)}")
        last = rt.status().last_committed_epoch
        assert last is not None, "no epoch committed"
        return last
    raise AssertionError(f"the final maintenance pass failed {_FINAL_TRIES} times")


# --------------------------------------------------------------------------- the table


def table_problems(spec: Mapping[str, Any], runtime: str, epochs: tuple[int, int]
                   ) -> list[str]:
    """What is wrong with a maintained Delta or Iceberg ``main`` besides its rows.
    ``epochs``: the range the marker must read in, from the last epoch known to have
    carried rows to the sink (an epoch with none may leave no commit) to the last one
    committed."""
    marker_id = f"raysink:{runtime}:main"
    if spec["kind"] == "delta":
        return _delta_problems(Path(spec["path"]), spec["maintenance"], marker_id, epochs)
    return _iceberg_problems(spec, marker_id, epochs)


def _marker_problems(marker: int | None, epochs: tuple[int, int]) -> list[str]:
    low, high = epochs
    if marker is not None and low <= marker <= high:
        return []
    return [f"the marker reads epoch {marker}: not in {low}..{high} (the last epoch "
            "with rows .. the last committed)"]


def _version_problems(name: str, ids: list[int], current: set[int]) -> list[str]:
    """A retained version shows each row at most once, and no row the table lost."""
    problems = [f"{name}: id {i} seen {n} times" for i, n in Counter(ids).items() if n > 1]
    if not set(ids) <= current:
        problems.append(f"{name}: rows the current version lacks")
    return problems[:5]


def _delta_problems(path: Path, policy: Mapping[str, Any], marker_id: str,
                    epochs: tuple[int, int]) -> list[str]:
    from deltalake import DeltaTable

    table = DeltaTable(str(path))
    problems: list[str] = []
    current = table.to_pyarrow_table(columns=["id"]).column("id").to_pylist()
    problems += _marker_problems(table.transaction_version(marker_id), epochs)
    log = path / "_delta_log"
    versions = sorted(int(p.name.split(".")[0]) for p in log.glob("*.json"))
    checkpoints = sorted(int(p.name.split(".")[0]) for p in log.glob("*.checkpoint.parquet"))
    latest = table.version()
    keep_from = max(0, latest - int(policy["keep_snapshots"]) + 1)
    start = max([c for c in checkpoints if c <= keep_from], default=0)
    stale = [v for v in versions + checkpoints if v < start]
    if stale:
        problems.append(f"log entries below the retained checkpoint {start} left: {stale}")
    referenced: set[Path] = set()
    for version in range(keep_from, latest + 1):  # time travel to every retained version
        try:
            old = DeltaTable(str(path), version=version)
            ids = old.to_pyarrow_table(columns=["id"]).column("id").to_pylist()
        except Exception as exc:
            problems.append(f"version {version} of {latest} unreadable: {_say(exc)}")
            continue
        problems += _version_problems(f"version {version}", ids, set(current))
        referenced |= {Path(u.removeprefix("file://")) for u in old.file_uris()}
    on_disk = {p for p in path.rglob("*.parquet") if "_delta_log" not in p.parts}
    leaked = sorted(str(p.relative_to(path)) for p in on_disk - referenced)
    if leaked:
        problems.append(f"data files no retained version references: {leaked[:10]}")
    return problems


def _iceberg_problems(spec: Mapping[str, Any], marker_id: str,
                      epochs: tuple[int, int]) -> list[str]:
    from pyiceberg.catalog import load_catalog
    from pyiceberg.table.snapshots import ancestors_of

    from raysink.sinks.iceberg._maintain import JOURNAL_DIR, METADATA_VERSIONS

    table = load_catalog("chaos", **spec["catalog"]).load_table(spec["identifier"])
    problems: list[str] = []
    current = set(table.scan(selected_fields=("id",)).to_arrow().column("id").to_pylist())
    marker = next((int(str(s.summary["raysink.epoch"]))
                   for s in ancestors_of(table.current_snapshot(), table.metadata)
                   if s.summary is not None and s.summary.get("raysink.sink") == marker_id),
                  None)
    problems += _marker_problems(marker, epochs)
    snapshots = table.metadata.snapshots
    keep = int(spec["maintenance"]["keep_snapshots"])
    if len(snapshots) > keep:
        problems.append(f"{len(snapshots)} snapshots retained, the policy keeps {keep}")
    live: set[str] = set()
    listed: set[str] = set()
    for snapshot in snapshots:  # time travel to every retained snapshot
        try:
            scan = table.scan(snapshot_id=snapshot.snapshot_id, selected_fields=("id",))
            ids = scan.to_arrow().column("id").to_pylist()
        except Exception as exc:
            problems.append(f"snapshot {snapshot.snapshot_id} unreadable: {_say(exc)}")
            continue
        problems += _version_problems(f"snapshot {snapshot.snapshot_id}", ids, current)
        listed.add(snapshot.manifest_list)
        for manifest in snapshot.manifests(table.io):
            listed.add(manifest.manifest_path)
            live |= {e.data_file.file_path for e in
                     manifest.fetch_manifest_entry(table.io, discard_deleted=True)}
    root = Path(table.location().removeprefix("file://"))
    journal = sorted(p.name for p in (root / "metadata" / JOURNAL_DIR).glob("*"))
    if journal:
        problems.append(f"maintenance journals left: {journal}")
    names = {p.rsplit("/", 1)[-1] for p in listed}
    stray = sorted(p.name for p in (root / "metadata").glob("*.avro") if p.name not in names)
    if stray:
        problems.append(f"manifests no retained snapshot references: {stray[:10]}")
    metadata = list((root / "metadata").glob("*.metadata.json"))
    if len(metadata) > METADATA_VERSIONS + 1:
        problems.append(f"{len(metadata)} metadata.json files")
    paths = {p.removeprefix("file://") for p in live}
    leaked = sorted(str(p.relative_to(root)) for p in (root / "data").rglob("*.parquet")
                    if str(p) not in paths)
    if leaked:
        problems.append(f"data files no retained snapshot references: {leaked[:10]}")
    return problems

