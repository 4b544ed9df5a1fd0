"""The verdicts of ``bench/longrun.py``: issue 37's bars, each printed with the bound it
checks and how that bound follows from the sink's ``raysink.Maintenance`` policy.

Bounds (``docs/maintenance.md``, *Bounds*), for a sink maintained with the policy ``m``
at ``W`` writers, over ``P`` partitions (1 unpartitioned):

* ``E``, epochs between two passes: a pass is due every ``m.every_epochs`` epochs but at
  most once per ``m.min_interval_s``, so ``E = max(every_epochs, min_interval_s / p50)``
  at the last window's epoch p50;
* ``V``, commits between two expiries: ``E`` epochs, one compaction commit per partition
  (Delta; Iceberg's is one for all) and two more (manifest merge, expiry): ``E + P + 2``;
* retained snapshots (Iceberg snapshots, Delta log versions): the newest
  ``keep_snapshots`` or those younger than ``keep_seconds`` (``Y``, counted at the end),
  plus what the ``V`` commits since the last expiry added: ``R = max(keep_snapshots, Y) + V``;
  Delta's log also holds the versions below them back to the checkpoint the oldest one
  is read from, at most ``checkpoint_every`` more;
* live data files: per partition, fewer than ``min_compact_files`` files in each size tier
  below half the target (``raysink.sinks._tiers``; ``T`` tiers between an epoch's file and
  ``target_file_bytes / 2``, counted at the average epoch file) plus the ``W x E`` files
  of the epochs since the last pass, and a file per half ``target_file_bytes`` of data;
* Delta's ``_delta_log``: ``R`` commit entries, back to the checkpoint below the oldest
  retained one (at most ``checkpoint_every + V`` further), and a checkpoint per
  ``checkpoint_every`` of them (plus ``_last_checkpoint`` and the newest version's
  checksum file);
* Iceberg's ``metadata/``: at most ``METADATA_VERSIONS + 1`` ``metadata.json`` files, a
  manifest list per retained snapshot, and at most ``W + 1`` manifests per retained
  snapshot (its own appends and a merged one).

Timing verdicts (epoch p50 growth at most 1.2x, a reader's count in at most 1 s) mean
something only on a quiet machine: the report says so and prints the load average.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from raysink import Maintenance
from raysink.sinks._tiers import tier_of

GROWTH_MAX = 1.2
READ_MAX_S = 1.0
_ICEBERG_METADATA_VERSIONS = 10  # raysink.sinks.iceberg._maintain.METADATA_VERSIONS


@dataclass(frozen=True)
class Check:
    sink: str
    name: str
    value: float
    bound: float
    how: str
    timing: bool = False

    @property
    def passed(self) -> bool:
        return self.value <= self.bound

    def line(self) -> str:
        mark = "PASS" if self.passed else "FAIL"
        kind = " [timing]" if self.timing else ""
        return (f"  {mark} {self.name}: {_num(self.value)} <= {_num(self.bound)}{kind}"
                f"  ({self.how})")


def _num(value: float) -> str:
    return f"{value:,}" if float(value).is_integer() else f"{value:.3f}"


def _spark_how(spark: dict[str, Any]) -> str:
    """The warm count, the first one's Spark jobs, and the floor's counts beside it."""
    how = f"warm {spark['warm_s']} s"
    if len(spark.get("fresh_s", [])) > 1:
        how += f"; every fresh read {spark['fresh_s']} s"
    first = spark.get("first", {})
    if "jobs" in first:
        how += f"; first: {first['jobs']} Spark jobs, {first['jobs_s']} s of them"
    floor = spark.get("floor")
    if floor:
        ratio = spark["first_s"] / floor["first_s"] if floor["first_s"] else float("inf")
        how += (f"; floor (one commit, same rows) {floor['first_s']} s, warm "
                f"{floor['warm_s']} s: {ratio:.2f}x")
    return how


def partitions(kind: str, epochs: int) -> int:
    """How many ``day`` values ``bench/longrun.py``'s epochs 1..epochs wrote."""
    if not kind.endswith("-part"):
        return 1
    return len({(epoch // 100) % 30 for epoch in range(1, epochs + 1)})


def checks(result: dict[str, Any], policy: Maintenance | bool, writers: int,
           rows: int) -> list[Check]:
    """Every verdict for one sink's result of ``bench/longrun.py``."""
    kind = result["sink"]
    expected = result["epochs"] * rows
    found = [Check(kind, "rows counted == epochs x rows (fresh reader)",
                   abs(result["rows"] - expected), 0, f"{result['rows']:,} of {expected:,}")]
    for reader, count in result.get("spark", {}).get("counts", {}).items():
        found.append(Check(kind, f"rows counted == epochs x rows (Spark, {reader})",
                           abs(count - expected), 0, f"{count:,} of {expected:,}"))
    if kind == "parquet":
        return found  # not maintained (docs/maintenance.md): nothing bounded to check
    found.append(Check(kind, f"epoch p50 last/first {result['window']}", result["growth"],
                       GROWTH_MAX, f"{result['p50_first_ms']} -> {result['p50_last_ms']} ms",
                       timing=True))
    found.append(Check(kind, "fresh reader open+count s", result["fresh_open_count_s"],
                       READ_MAX_S, result["reader"], timing=True))
    spark = result.get("spark", {})
    if "error" in spark:
        found.append(Check(kind, "Spark read failed", 1, 0, spark["error"]))
    if "first_s" in spark:
        found.append(Check(kind, "Spark first open+count() s", spark["first_s"], READ_MAX_S,
                           _spark_how(spark), timing=True))
    if isinstance(policy, Maintenance):
        found += _size_checks(result, policy, writers)
    return found


def _size_checks(result: dict[str, Any], m: Maintenance, writers: int) -> list[Check]:
    kind = result["sink"]
    parts = partitions(kind, result["epochs"])
    per_pass = max(m.every_epochs, math.ceil(m.min_interval_s / (result["p50_last_ms"] / 1000)))
    commits = per_pass + parts + 2
    retained = max(m.keep_snapshots, result["young"]) + commits
    by_size = math.ceil(result["data_bytes"] / (m.target_file_bytes // 2))
    epoch_file = result["data_bytes"] // max(1, result["epochs"] * writers * parts)
    tiers = tier_of(epoch_file, small=m.target_file_bytes // 2, fan_in=m.min_compact_files)
    files = parts * ((m.min_compact_files - 1) * tiers + writers * per_pass) + by_size
    where = (f"E={per_pass} epochs/pass, P={parts}, W={writers}, V={commits}, "
             f"Y={result['young']} younger than {m.keep_seconds:g} s")
    found = [
        Check(kind, "live data files", result["data_files"], files,
              f"P x ((min_compact_files {m.min_compact_files} - 1) x T {tiers} + W x E) + "
              f"{by_size} per {m.target_file_bytes >> 21} MiB; {where}"),
    ]
    if kind.startswith("delta"):
        # every version in the log: the retained ones, and those below them back to the
        # checkpoint the oldest retained one is read from (docs/maintenance.md, Bounds)
        found.append(Check(kind, "versions in _delta_log", result["snapshots"],
                           retained + m.checkpoint_every,
                           f"max(keep_snapshots {m.keep_snapshots}, Y) + V + "
                           f"checkpoint_every {m.checkpoint_every}"))
    else:
        found.append(Check(kind, "retained snapshots", result["snapshots"], retained,
                           f"max(keep_snapshots {m.keep_snapshots}, Y) + V"))
    if kind.startswith("delta"):
        entries = retained + m.checkpoint_every + commits
        # + _last_checkpoint and the newest version's checksum file
        log_files = entries + math.ceil(entries / m.checkpoint_every) + 2
        found.append(Check(kind, "_delta_log files", result["metadata_files"], log_files,
                           f"R + checkpoint_every {m.checkpoint_every} + V entries, "
                           f"a checkpoint per {m.checkpoint_every}, _last_checkpoint, a .crc; "
                           f"{result['metadata_bytes'] / 2**20:.1f} MiB"))
    else:
        meta_files = _ICEBERG_METADATA_VERSIONS + 1 + retained * (writers + 2)
        found.append(Check(kind, "metadata/ files", result["metadata_files"], meta_files,
                           f"{_ICEBERG_METADATA_VERSIONS + 1} metadata.json + R x (W + 2) "
                           f"manifest lists and manifests; "
                           f"{result['metadata_bytes'] / 2**20:.1f} MiB, newest "
                           f"metadata.json {result['metadata_json_bytes'] / 1024:.0f} KiB"))
    return found


def report(all_checks: list[Check]) -> bool:
    """Print the verdicts per sink; True when every one passed."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nverdicts (issue 37); load average now {load} on {os.cpu_count()} cores."
          "\n[timing] verdicts mean something only on a quiet machine (nothing else "
          "running); the others hold under any load.")
    for sink in dict.fromkeys(c.sink for c in all_checks):
        mine = [c for c in all_checks if c.sink == sink]
        ok = all(c.passed for c in mine)
        print(f"{sink}: {'PASS' if ok else 'FAIL'}")
        for check in mine:
            print(check.line())
    failed = [c for c in all_checks if not c.passed]
    timing = sum(c.timing for c in failed)
    print(f"overall: {'PASS' if not failed else 'FAIL'} ({len(failed)} failed, "
          f"{timing} of them timing)")
    return not failed
