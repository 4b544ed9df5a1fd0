"""Pulls: data a consumer fetches itself, in place of an object ref the driver hands it.

A data message carries refs nested in a list (``writer.write.remote(..., [item])``). An
item is an ``ObjectRef`` (the consumer ``ray.get``\\ s it), a local table, or a
:class:`Pull`: a small picklable description of where the data lives, which the consumer
turns into a table by calling :meth:`Pull.pull` in its own process. The Spark handoff uses
pulls so that each writer reads its partitions straight from the RayDP executors
(``raysink.spark.partitions``), with no Ray task and no copy in the object store per partition.

The contract, for every implementation:

* ``pull()`` runs in the consumer (a writer actor, or the split task of a keyed runtime),
  possibly on another node, possibly more than once for the same item (a re-fed attempt, a
  retried task): it returns the same rows every time, or raises.
* A failure is raised, never hidden: the writer poisons the epoch with it and the runtime
  retries the attempt (raysink errors keep their type).
* The item stays small (it is pickled into every message that carries it) and holds no
  live handle: handles are looked up in the consumer.
"""

from __future__ import annotations

import abc
from typing import Any

import pyarrow as pa

__all__ = ["Pull", "resolve"]


class Pull(abc.ABC):
    """Where one piece of an epoch's data lives; :meth:`pull` fetches it as a table."""

    __slots__ = ()

    @abc.abstractmethod
    def pull(self) -> pa.Table:
        """Fetch the data in this process; same rows on every call."""


def resolve(item: Any) -> Any:
    """The data behind one item of a data message: a ref's value, a pull's table, or the
    item itself (a local table or batch)."""
    import ray

    if isinstance(item, ray.ObjectRef):
        return ray.get(item)
    if isinstance(item, Pull):
        return item.pull()
    return item
