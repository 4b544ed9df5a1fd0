"""KafkaSink without a broker: the scope of its transactional ids, what its progress
records say about a partly committed epoch, and whose decision an epoch record holds."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from raysink.sinks import KafkaSink
from raysink.sinks.base import Held, Manifest, decision_id
from raysink.sinks.kafka._progress import epoch_key, part_key


def _sink(topic: str = "orders", **options: Any) -> KafkaSink:
    return KafkaSink("127.0.0.1:9", topic, **options).bind("rt", "main")


def _ids(sink: KafkaSink) -> tuple[str, str, str]:
    s = sink.settings
    return s.writer_txn("rt", "main", 0), s.writer_txn("rt", "main", 1), \
        s.committer_txn("rt", "main")


def test_two_topics_of_one_runtime_and_sink_get_their_own_ids() -> None:
    """Two deployments named alike writing different topics: no id in common, so
    neither fences the other's transactions."""
    orders, payments = _ids(_sink("orders")), _ids(_sink("payments"))
    assert not set(orders) & set(payments)
    assert orders == ("raysink.rt.main.orders.w0", "raysink.rt.main.orders.w1",
                      "raysink.rt.main.orders.c")


def test_the_same_topic_gets_the_same_ids_whatever_else_differs() -> None:
    """Two runtimes of one name writing the same topics share every id (so the newer
    fences the older), whatever else of their configuration differs."""
    one = _ids(_sink("orders", timeout=5.0, partitions=3))
    other = _ids(_sink("orders", producer_config={"linger.ms": 50}))
    assert one == other


def test_a_custom_progress_topic_scopes_the_ids_too() -> None:
    default = _ids(_sink("orders"))
    custom = _ids(_sink("orders", progress_topic="orders-progress"))
    again = _ids(_sink("orders", progress_topic="orders-progress"))
    assert custom == again and not set(custom) & set(default)
    assert custom[0].startswith("raysink.rt.main.orders.")  # still readable


def test_a_long_topic_is_shortened_with_a_stable_digest() -> None:
    """A long name is cut and followed by a sha256 prefix of both topics (the same in
    every process, unlike ``hash()``): two long names with a common start differ."""
    a, b = "x" * 200 + "a", "x" * 200 + "b"
    scope_a = _sink(a).settings.txn_scope()
    assert scope_a == _sink(a).settings.txn_scope()
    assert scope_a != _sink(b).settings.txn_scope()
    assert len(scope_a) <= 64 and scope_a.startswith("x" * 48 + ".")
    import hashlib

    digest = hashlib.sha256(f"{a}\n{a}-raysink-progress".encode()).hexdigest()[:12]
    assert scope_a.endswith(digest)


def test_the_legacy_committer_id_is_the_unscoped_one() -> None:
    assert _sink().settings.legacy_committer_txn("rt", "main") == "raysink.rt.main.c"


def test_a_part_of_the_unscoped_scheme_is_no_gone_but_unknown() -> None:
    """A writer answers ``GONE`` when it took its id over; a part made under the id of
    the scheme before (an epoch decided before an upgrade) was not, so it is ``UNKNOWN``
    and its id is fenced before a replay."""
    sink = _sink()
    old: Any = {"writer": 0, "rows": 1, "txn": "raysink.rt.main.w0"}
    new: Any = {"writer": 0, "rows": 1, "txn": "raysink.rt.main.orders.w0"}
    assert sink._vouched(old, Held.GONE) is Held.UNKNOWN
    assert sink._vouched(new, Held.GONE) is Held.GONE
    assert sink._vouched(old, Held.COMMITTED) is Held.COMMITTED


class _Progress:
    """A scripted progress reader: the newest record of each key."""

    def __init__(self, latest: dict[str, dict[str, Any]]) -> None:
        self.latest = latest
        self.strict_reads = 0

    def read(self, *, strict: bool) -> dict[str, dict[str, Any]]:
        self.strict_reads += strict
        return self.latest

    def committed_epoch(self, *, strict: bool = False, cached: bool = False) -> int | None:
        record = self.latest.get(epoch_key("rt", "main"))
        return None if record is None else int(record["epoch"])


class _Topics:
    def exists(self, topic: str) -> bool:
        return True


def _scripted(latest: dict[str, dict[str, Any]]) -> tuple[KafkaSink, _Progress]:
    sink = _sink()
    progress = _Progress(latest)
    sink._reader = progress  # type: ignore[assignment]
    sink._topics = _Topics()  # type: ignore[assignment]
    sink._read_at = time.monotonic()
    sink._committer = SimpleNamespace(producer=object())  # claimed, taken over
    return sink, progress


MANIFESTS: list[Manifest] = [{"writer": 0, "rows": 5, "epoch": 3, "attempt": 0},
                             {"writer": 1, "rows": 4, "epoch": 3, "attempt": 0}]


def test_the_epoch_record_names_the_decision_it_committed() -> None:
    """The epoch record carries the decision's id, so a coordinator that finds the epoch
    in (its predecessor died before recording the commit) knows it is its own decision,
    and one that finds another decision's (a driver with another meta store) knows not."""
    sink, progress = _scripted({})
    sink._decision = (3, decision_id(3, MANIFESTS))
    record = __import__("json").loads(sink.epoch_record(3, 0))
    progress.latest[epoch_key("rt", "main")] = record
    assert sink.holds_decision(3, MANIFESTS) is True
    other = [{**m, "rows": 7} for m in MANIFESTS]
    assert sink.holds_decision(3, other) is False  # type: ignore[arg-type]
    # a record past the epoch (compaction keeps the newest) or without a decision: unknown
    progress.latest[epoch_key("rt", "main")] = {"epoch": 4, "attempt": 0, "decision": "x"}
    assert sink.holds_decision(3, MANIFESTS) is None
    progress.latest[epoch_key("rt", "main")] = {"epoch": 3, "attempt": 0}
    assert sink.holds_decision(3, MANIFESTS) is None


def test_an_epoch_record_of_another_epoch_names_no_decision() -> None:
    sink, _ = _scripted({})
    sink._decision = (3, decision_id(3, MANIFESTS))
    assert b"decision" not in sink.epoch_record(4, 0)


@pytest.mark.parametrize(("latest", "expected"), [
    # parts of epoch 3 in, the epoch record at 2: a commit cut after the writers' commits
    ({epoch_key("rt", "main"): {"epoch": 2}, part_key("rt", "main", 0): {"epoch": 3},
      part_key("rt", "main", 1): {"epoch": 2}, part_key("rt", "main", 2): {"epoch": 3}},
     (3, (0, 2))),
    # the first epoch cut: no epoch record at all
    ({part_key("rt", "main", 1): {"epoch": 1}}, (1, (1,))),
    # the epoch record holds the parts: nothing partly in
    ({epoch_key("rt", "main"): {"epoch": 3}, part_key("rt", "main", 0): {"epoch": 3}},
     None),
    # another sink's or runtime's records do not count
    ({epoch_key("rt", "main"): {"epoch": 2}, "raysink:rt:main2:w0": {"epoch": 3}}, None),
    ({}, None),
])
def test_parts_above_the_epoch_record_are_a_partly_committed_epoch(
        latest: dict[str, dict[str, Any]], expected: Any) -> None:
    sink, progress = _scripted(latest)
    assert sink.partly_committed() == expected
    assert progress.strict_reads == 1  # read to the partition's end


class _Probe:
    """A first, short read of the progress topic: ``stuck`` when an open transaction
    holds its end back."""

    stuck = True
    timeouts: list[float] = []

    def __init__(self, settings: Any, runtime: str, sink: str) -> None:
        self.timeouts.append(settings.timeout)

    def read(self, *, strict: bool) -> dict[str, dict[str, Any]]:
        if self.stuck:
            from raysink.errors import SinkUnavailableError

            raise SinkUnavailableError("a transaction left open holds it back")
        return {part_key("rt", "main", 1): {"epoch": 1}}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("stuck", [True, False])
def test_the_committer_is_taken_over_only_when_the_progress_topic_is_held_back(
        monkeypatch: pytest.MonkeyPatch, stuck: bool) -> None:
    """A dead committer's open epoch record hides the part records after it: taking the
    committer over ends it. A topic read to its end at once leaves the committer alone
    (a live runtime of the name is not fenced by a start alignment may refuse)."""
    from raysink.sinks.kafka import _sink as sink_module

    sink, _ = _scripted({epoch_key("rt", "main"): {"epoch": 2},
                         part_key("rt", "main", 0): {"epoch": 3}})
    sink._committer = None
    claims: list[bool] = []
    monkeypatch.setattr(sink, "_take_over", lambda: claims.append(True))
    monkeypatch.setattr(_Probe, "stuck", stuck)
    monkeypatch.setattr(_Probe, "timeouts", [])
    monkeypatch.setattr(sink_module, "ProgressReader", _Probe)
    assert sink.partly_committed() == ((3, (0,)) if stuck else (1, (1,)))
    assert claims == ([True] if stuck else [])
    assert _Probe.timeouts == [5.0]
