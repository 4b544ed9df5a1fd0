"""Compare a trial's target with its input, row by row.

Every input row carries an attempt-independent ``id`` (``group * 1e6 + i``) and the
``feed`` that carried it (which driver call, or which generation of a stream producer).
A group is an epoch for the epoch-by-epoch ways in, a producer for a stream (whose epochs
the runtime cuts). Given the rows each group must show and the target's commit order,
``check`` counts:

* lost rows: expected ids the target lacks;
* duplicated rows: extra copies of an id, all from one feed (a re-applied write);
* aborted rows: extra copies of an id from a different feed (an aborted attempt leaked);
* uncommitted rows: rows of a group nobody wrote, or past its end;
* order problems: the commit order is not strictly increasing, or misses an epoch that
  must be committed (``must_commit``: by default every group is an epoch that must).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

import pyarrow as pa

from tests.chaos.targets import ID_BASE

__all__ = ["Check", "check"]


@dataclass(kw_only=True)
class Check:
    """What one target holds compared with what it must hold."""

    sink: str
    rows_expected: int = 0
    rows_seen: int = 0
    lost: int = 0
    duplicated: int = 0
    aborted: int = 0
    uncommitted: int = 0
    order: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check(sink: str, rows: pa.Table, expected: dict[int, int], order: Sequence[int],
          *, partial: Iterable[int] = (), must_commit: Iterable[int] | None = None) -> Check:
    """``expected``: group -> rows that must be visible exactly once. ``partial``: groups
    allowed to show any subset of their rows, never a duplicate (a commit still rolling
    forward in a sink without atomic visibility). ``must_commit``: the epochs the commit
    order must hold (default: the groups, which are epochs)."""
    allowed_partial = set(partial)
    result = Check(sink=sink, rows_expected=sum(expected.values()), rows_seen=rows.num_rows)
    feeds: dict[int, Counter[int]] = defaultdict(Counter)
    for rid, feed in zip(rows.column("id").to_pylist(), rows.column("feed").to_pylist(),
                         strict=True):
        feeds[int(rid)][int(feed)] += 1
    _count_copies(result, feeds)
    _count_lost_and_foreign(result, feeds, expected, allowed_partial)
    must = set(expected if must_commit is None else must_commit) - allowed_partial
    _check_order(result, order, {e: expected.get(e, 1) for e in must})
    return result


def _count_copies(result: Check, feeds: dict[int, Counter[int]]) -> None:
    for rid, by_feed in feeds.items():
        total = sum(by_feed.values())
        if total <= 1:
            continue
        if len(by_feed) > 1:
            result.aborted += total - 1
        else:
            result.duplicated += total - 1
        if len(result.problems) < 20:
            result.problems.append(f"id {rid} seen {total} times (feeds {dict(by_feed)})")


def _ranges(values: list[int]) -> str:
    """Sorted numbers as ``a-b`` runs: which rows, readable."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs[:20])


def _count_lost_and_foreign(result: Check, feeds: dict[int, Counter[int]],
                            expected: dict[int, int], partial: set[int]) -> None:
    lost_by_epoch: Counter[int] = Counter()
    for epoch, count in expected.items():
        if epoch in partial:
            continue
        for i in range(count):
            if epoch * ID_BASE + i not in feeds:
                lost_by_epoch[epoch] += 1
    result.lost = sum(lost_by_epoch.values())
    if result.lost:
        result.problems.append(f"rows lost per epoch: {dict(lost_by_epoch)}")
        for epoch, count in expected.items():
            missing = [i for i in range(count) if epoch * ID_BASE + i not in feeds]
            if missing and epoch not in partial:
                result.problems.append(f"group {epoch}: rows lost {_ranges(missing)}")
    foreign: Counter[int] = Counter()
    for rid in feeds:
        epoch, index = divmod(rid, ID_BASE)
        if epoch not in expected or index >= expected[epoch]:
            foreign[epoch] += 1
    result.uncommitted = sum(foreign.values())
    if result.uncommitted:
        result.problems.append(f"rows of uncommitted epochs (or written by nobody): "
                               f"{dict(foreign)}")


def _check_order(result: Check, order: Sequence[int], must: dict[int, int]) -> None:
    """``must``: epoch -> its rows, for the epochs the order must hold."""
    result.order = list(order)
    if any(b <= a for a, b in pairwise(order)):
        result.problems.append(f"commits out of epoch order: {list(order)}")
    missing = sorted(set(must) - set(order))
    # An epoch with rows must have a marker; an empty epoch may leave none in some sinks.
    if missing and any(must[e] > 0 for e in missing):
        result.problems.append(f"epochs visible without a commit marker: {missing}")
