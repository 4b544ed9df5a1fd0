"""The verdicts of ``bench/soak.py``: the tables' ids against what was written, and each
process's memory growth after the warm-up; and where the time went: each sink's latency
through the run, each process's CPU per epoch at the start and at the end."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from soak_probe import MIB, Series

WARMUP_CAP_SECONDS = 60.0
EDGE_FRACTION = 0.2


@dataclass(frozen=True, kw_only=True)
class IdCheck:
    sink: str
    rows: int
    distinct: int
    missing: int
    duplicated: int
    unexpected: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return (self.error is None and self.missing == 0 and self.duplicated == 0
                and self.unexpected == 0)


def count_ids(sink: str, batches: Iterable[pa.RecordBatch],
              ranges: Mapping[int, tuple[int, int]]) -> IdCheck:
    """Every id of every range ``(first, count)`` once, nothing else: counted in a
    compact array per range, batch by batch."""
    counts = {key: np.zeros(count, dtype=np.uint16) for key, (_, count) in ranges.items()}
    rows = unexpected = 0
    for batch in batches:
        ids = batch.column(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        rows += len(ids)
        matched = np.zeros(len(ids), dtype=bool)
        for key, (first, count) in ranges.items():
            inside = (ids >= first) & (ids < first + count)
            np.add.at(counts[key], ids[inside] - first, 1)
            matched |= inside
        unexpected += int(len(ids) - np.count_nonzero(matched))
    expected = sum(count for _, count in ranges.values())
    seen = sum(int(np.count_nonzero(c)) for c in counts.values())
    return IdCheck(sink=sink, rows=rows, distinct=seen, missing=expected - seen,
                   duplicated=sum(int(np.count_nonzero(c > 1)) for c in counts.values()),
                   unexpected=unexpected)


def id_batches(kind: str, path: Path) -> Iterator[pa.RecordBatch]:
    if kind == "parquet":
        import pyarrow.dataset as ds

        yield from ds.dataset(str(path), format="parquet").to_batches(columns=["id"])
    elif kind == "iceberg":
        yield from iceberg_table(path).scan(selected_fields=("id",)).to_arrow_batch_reader()
    else:
        from deltalake import DeltaTable

        yield from DeltaTable(str(path)).to_pyarrow_dataset().to_batches(columns=["id"])


def check_tables(tables: Mapping[str, tuple[str, Path]],
                 ranges: Mapping[int, tuple[int, int]]) -> list[IdCheck]:
    """``tables``: label -> (kind, path)."""
    checks = []
    expected = sum(count for _, count in ranges.values())
    for label, (kind, path) in tables.items():
        try:
            checks.append(count_ids(label, id_batches(kind, path), ranges))
        except Exception as exc:
            checks.append(IdCheck(sink=label, rows=0, distinct=0, missing=expected,
                                  duplicated=0, unexpected=0,
                                  error=f"{type(exc).__name__}: {exc}"))
    return checks


@dataclass(frozen=True, kw_only=True)
class MemoryVerdict:
    label: str
    pids: list[int]
    samples: int
    first_mib: float
    last_mib: float
    peak_mib: float
    baseline_mib: float
    final_mib: float
    growth_mib: float
    growth_pct: float
    ok: bool


def memory_verdict(series: Series, run_seconds: float, max_mib: float,
                   max_pct: float) -> MemoryVerdict:
    """Growth from the median of the first 20% of the samples after the warm-up (the
    first minute or the first 20% of the run, whichever is shorter) to the median of the
    last 20%: at most ``max_mib`` MiB and at most ``max_pct`` percent."""
    warmup = min(WARMUP_CAP_SECONDS, EDGE_FRACTION * run_seconds)
    values = [v for at, v in series.samples if at >= warmup] or [v for _, v in series.samples]
    edge = max(1, round(len(values) * EDGE_FRACTION))
    baseline = statistics.median(values[:edge])
    final = statistics.median(values[-edge:])
    growth = final - baseline
    pct = 100.0 * growth / baseline if baseline else 0.0
    everything = [v for _, v in series.samples]
    return MemoryVerdict(
        label=series.label, pids=list(series.pids), samples=len(everything),
        first_mib=everything[0] / MIB, last_mib=everything[-1] / MIB,
        peak_mib=max(everything) / MIB, baseline_mib=baseline / MIB, final_mib=final / MIB,
        growth_mib=growth / MIB, growth_pct=pct,
        ok=growth / MIB <= max_mib and pct <= max_pct)


@dataclass(frozen=True, kw_only=True)
class LatencyVerdict:
    """The write_arrow epochs' latency: the median over the first ``EDGE_FRACTION`` of
    the epochs after the warm-up against the median over the last, and whether it grew
    by at most ``max_growth`` (0.2: 20%)."""

    epochs: int
    first_ms: float
    last_ms: float
    growth: float
    ok: bool


def latency_verdict(epochs: list[tuple[float, float]], run_seconds: float,
                    max_growth: float) -> LatencyVerdict:
    """``epochs``: (when it began, seconds after the run's start; how long it took)."""
    warmup = min(WARMUP_CAP_SECONDS, run_seconds * EDGE_FRACTION)
    kept = [seconds for began, seconds in epochs if began >= warmup]
    edge = max(1, int(len(kept) * EDGE_FRACTION))
    if len(kept) < 2 * edge:
        return LatencyVerdict(epochs=len(epochs), first_ms=0.0, last_ms=0.0, growth=0.0,
                              ok=False)
    first = statistics.median(kept[:edge])
    last = statistics.median(kept[-edge:])
    growth = last / first - 1.0
    return LatencyVerdict(epochs=len(epochs), first_ms=first * 1000, last_ms=last * 1000,
                          growth=growth, ok=growth <= max_growth)


def edge_windows(run_seconds: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """The first and the last ``EDGE_FRACTION`` of the run after the warm-up, in seconds
    since the start."""
    warmup = min(WARMUP_CAP_SECONDS, run_seconds * EDGE_FRACTION)
    edge = (run_seconds - warmup) * EDGE_FRACTION
    return (warmup, warmup + edge), (run_seconds - edge, run_seconds)


def latency_through(epochs: list[tuple[float, float]], run_seconds: float,
                    parts: int = 10) -> list[float | None]:
    """The median epoch latency (ms) in each tenth of the run, by when the epoch began:
    a trend the two edges of ``latency_verdict`` cannot show."""
    slices: list[list[float]] = [[] for _ in range(parts)]
    for began, seconds in epochs:
        slices[min(parts - 1, int(parts * began / max(run_seconds, 1e-9)))].append(seconds)
    return [statistics.median(s) * 1000 if s else None for s in slices]


@dataclass(frozen=True, kw_only=True)
class CpuPerEpoch:
    """One process's CPU milliseconds per write_arrow round (an epoch into every sink) in
    the first and in the last window of ``edge_windows``."""

    label: str
    first_ms: float
    last_ms: float

    @property
    def growth(self) -> float:
        return self.last_ms / self.first_ms - 1.0 if self.first_ms else 0.0


def _cpu_between(series: Series, start: float, end: float) -> float | None:
    """CPU seconds the process spent from ``start`` to ``end`` (its nearest samples
    inside), none when it restarted or was sampled fewer than twice there."""
    inside = [(at, cpu) for at, cpu in series.cpu if start <= at <= end]
    if len(inside) < 2 or series.restarts:
        return None
    (t0, c0), (t1, c1) = inside[0], inside[-1]
    return (c1 - c0) * (end - start) / (t1 - t0) if t1 > t0 else None


def cpu_per_epoch(series: Series, rounds: list[float], run_seconds: float
                  ) -> CpuPerEpoch | None:
    """``rounds``: when each write_arrow round began (seconds since the start)."""
    values = []
    for start, end in edge_windows(run_seconds):
        cpu = _cpu_between(series, start, end)
        count = sum(1 for at in rounds if start <= at < end)
        if cpu is None or not count:
            return None
        values.append(cpu * 1000 / count)
    return CpuPerEpoch(label=series.label, first_ms=values[0], last_ms=values[1])


def table_files(kind: str, path: Path) -> int:
    """The live data files of a sink's table (what every reader lists)."""
    if kind == "parquet":
        return len(list(path.glob("*.parquet")))
    if kind == "iceberg":
        return len(iceberg_table(path).inspect.files())
    import deltalake

    return len(deltalake.DeltaTable(str(path)).file_uris())


ICEBERG_TABLE = "soak.events"


def iceberg_catalog(root: Path) -> dict[str, str]:
    """The SQL catalog of the soak's Iceberg table, kept under ``root``."""
    return {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}",
            "warehouse": f"file://{root / 'warehouse'}"}


def iceberg_table(root: Path) -> Any:
    from pyiceberg.catalog import load_catalog

    return load_catalog("raysink", **iceberg_catalog(root)).load_table(ICEBERG_TABLE)
