"""Which small files one compaction rewrites: size tiers, so that each byte is rewritten
a few times over a long stream, not once per pass.

Merging every small file of a partition at every pass rewrites the growing compacted file
each time: with an epoch's files much smaller than the target, the bytes rewritten grow
with the square of the data (10,000 Delta epochs of 1,000 rows rewrote 607 MB to keep
14.6 MB). Here a partition's files below half the target (``small``) fall in tiers by
size, each ``fan_in`` times the one below it::

    tier 1: [small / F,  small)      tier 2: [small / F**2, small / F)     ...

A tier is merged once it holds ``fan_in`` files, together with every smaller file of the
partition; ``fan_in`` files of a tier sum to at least the tier above's lower bound, so the
merged file climbs at least one tier. Each byte is therefore rewritten at most once per
tier between the size it was written at and ``small``: ``log(small / epoch file) /
log(fan_in)`` times, 3-4 for 10 KB epochs and a 128 MiB target. The price: a partition
keeps up to ``fan_in - 1`` files per tier besides its full-sized ones.

A forced pass (``rt.maintain()``) merges every small file of the partition, tiers aside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

__all__ = ["pack", "plan_partition", "tier_of"]

T = TypeVar("T")


def tier_of(size: int, *, small: int, fan_in: int) -> int:
    """The tier of a file of ``size`` bytes: 0 at or above ``small``, else the ``k`` with
    ``small / fan_in**k <= size < small / fan_in**(k-1)``."""
    ratio = max(2, fan_in)
    bound, tier = small, 0
    while size < bound:
        bound //= ratio
        tier += 1
    return tier


def plan_partition(files: Sequence[T], size: Callable[[T], int], *, target: int,
                   fan_in: int, force: bool) -> list[list[T]]:
    """The bins one partition's ``files`` are rewritten in: each of at least two files and
    at most ``target`` bytes summed (none when no tier is due)."""
    small = target // 2
    tiers = {id(f): tier_of(size(f), small=small, fan_in=fan_in) for f in files}
    candidates = [f for f in files if tiers[id(f)] > 0]
    if not force:
        counts: dict[int, int] = {}
        for f in candidates:
            counts[tiers[id(f)]] = counts.get(tiers[id(f)], 0) + 1
        due = [t for t, n in counts.items() if n >= max(2, fan_in)]
        if not due:
            return []
        top = min(due)  # the largest files' tier that is due: it and every smaller file
        candidates = [f for f in candidates if tiers[id(f)] >= top]
    return list(pack(candidates, size, target))


def pack(files: Sequence[T], size: Callable[[T], int], target: int) -> Iterator[list[T]]:
    """First fit of ``files``, smallest first, into bins of at most ``target`` bytes; a bin
    of one file is left out (rewriting it alone gains nothing)."""
    current: list[T] = []
    total = 0
    for f in sorted(files, key=size):
        n = size(f)
        if current and total + n > target:
            if len(current) > 1:
                yield current
            current, total = [], 0
        current.append(f)
        total += n
    if len(current) > 1:
        yield current
