"""Fakes for testing code that uses raysink (Bytewax ``testing.py``, Quix ``FailingSink``).

``ListSink(directory)``
    A small exactly-once sink. Each committed epoch is one Arrow IPC file
    ``<directory>/committed/<epoch>.arrow``, written atomically, so the file is both the
    data and the marker; ``read()`` returns every committed row. Works across processes.
    ``schema_evolution="add_columns"`` as every sink (``raysink._schema``; any lossless
    widening is applied: each epoch's file holds the schema after it).
``FailingSink(inner, state_dir=...)``
    Wraps any sink and injects failures: the n-th write, the first n pre-commits, commits or
    aborts, stalled commits. Call counters live in ``<state_dir>/counters.json`` (locked), so
    they count across writer actors, the coordinator and restarts.
``InMemoryMetaStore()``
    The ``MetaStore`` protocol on dicts, for coordinator unit tests. Manifests go through a
    JSON round trip, as in the real stores.
``arm_fault`` / ``disarm_faults`` / ``fired``
    Arm the named fault points of ``raysink._faults`` for one runtime.
"""

from raysink._faults import InjectedFault, fault_dir
from raysink.testing.failing_sink import FailingSink, InjectedSinkFailure
from raysink.testing.fault_arming import arm_fault, disarm_faults, fired, fired_context
from raysink.testing.list_sink import ListSink
from raysink.testing.metastore import InMemoryMetaStore

__all__ = [
    "FailingSink",
    "InMemoryMetaStore",
    "InjectedFault",
    "InjectedSinkFailure",
    "ListSink",
    "arm_fault",
    "disarm_faults",
    "fault_dir",
    "fired",
    "fired_context",
]
