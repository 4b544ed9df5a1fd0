"""Size-tiered choice of the files a compaction rewrites (``raysink.sinks._tiers``): over a
long stream each byte is rewritten a few times, not at every pass, and a partition keeps a
bounded number of small files."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import count

import pytest

from raysink.sinks._tiers import pack, plan_partition, tier_of

MIB = 2**20
TARGET = 128 * MIB
SMALL = TARGET // 2

_ids = count()


@dataclass(frozen=True)
class File:
    size: int
    name: int = field(default_factory=lambda: next(_ids))


def size(f: File) -> int:
    return f.size


@pytest.mark.parametrize(("nbytes", "tier"), [
    (SMALL, 0), (TARGET, 0), (SMALL - 1, 1), (SMALL // 16, 1), (SMALL // 16 - 1, 2),
    (SMALL // 256, 2), (1, 7), (0, 7),
])
def test_tiers_are_powers_of_the_fan_in_below_half_the_target(nbytes: int, tier: int) -> None:
    assert tier_of(nbytes, small=SMALL, fan_in=16) == tier


def test_a_tier_waits_for_fan_in_files_then_takes_every_smaller_file() -> None:
    big = [File(SMALL // 4) for _ in range(15)]  # tier 1, one short of due
    tiny = [File(1000) for _ in range(3)]
    assert plan_partition(big + tiny, size, target=TARGET, fan_in=16, force=False) == []

    mid = [File(SMALL // 64) for _ in range(16)]  # tier 2: due
    bins = plan_partition(big + mid + tiny, size, target=TARGET, fan_in=16, force=False)
    chosen = {f.name for b in bins for f in b}
    assert chosen == {f.name for f in mid + tiny}  # tier 1 untouched
    assert all(len(b) >= 2 and sum(f.size for f in b) <= TARGET for b in bins)


def test_forced_takes_every_small_file_and_leaves_full_ones() -> None:
    files = [File(SMALL // 4), File(SMALL // 64), File(1000), File(TARGET)]
    (only,) = plan_partition(files, size, target=TARGET, fan_in=16, force=True)
    assert sorted(f.size for f in only) == [1000, SMALL // 64, SMALL // 4]


def test_bins_hold_at_most_the_target_and_never_one_file() -> None:
    files = [File(SMALL - 1) for _ in range(5)]
    bins = list(pack(files, size, TARGET))
    assert [len(b) for b in bins] == [2, 2]  # the fifth alone in its bin: left as it is
    assert all(sum(f.size for f in b) <= TARGET for b in bins)


@pytest.mark.parametrize(("epoch_bytes", "fan_in"), [(10_000, 16), (150_000, 16), (7_000, 4)])
def test_a_long_stream_rewrites_each_byte_a_few_times(epoch_bytes: int, fan_in: int) -> None:
    """Passes after every 10 epochs of one file each: the bytes rewritten stay within
    (tiers + 1) times the bytes written, and the small files within (fan_in - 1) per tier
    plus the epochs since the last pass. Choosing every small file at each pass (the
    former plan) rewrites the growing file each time: hundreds of times more."""
    live: list[File] = []
    written = rewritten = 0
    tiers = tier_of(epoch_bytes, small=SMALL, fan_in=fan_in)
    for epoch in range(1, 20_001):
        live.append(File(epoch_bytes))
        written += epoch_bytes
        if epoch % 10:
            continue
        for b in plan_partition(live, size, target=TARGET, fan_in=fan_in, force=False):
            ids = {f.name for f in b}
            live = [f for f in live if f.name not in ids]
            total = sum(f.size for f in b)
            rewritten += total
            live.append(File(total))
        small = [f for f in live if f.size < SMALL]
        assert len(small) <= (fan_in - 1) * tiers + 10
    assert rewritten <= (tiers + 1) * written
    assert rewritten >= written  # it did compact
    assert math.ceil(written / TARGET) <= len(live)
