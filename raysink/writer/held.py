"""Which attempt's rows a writer's sink writer holds (``HeldRows``), without Ray.

A ``SinkWriter`` keeps the rows written since its last pre-commit without knowing their
attempt (PostgreSQL keeps one open transaction; Parquet, Delta, Iceberg one buffer), its
pre-commit stages all of them, and its rollback of any attempt drops them. So the writer
actor keeps the books: which attempt the held rows are (``held``), and which attempts this
process pre-committed (their staging is still to roll back when they are given up).

The rules the actor follows (``SinkWriterActor._hold`` and ``_roll_back_held``):

- before rows of attempt K go in, or K pre-commits, rows another attempt H left are
  rolled back and H is poisoned (its seal fails and its epoch is written again): no
  pre-commit stages another attempt's rows;
- a rollback of an attempt that has nothing in the sink writer (no rows since the last
  pre-commit, no pre-commit by this process) is not sent: the held rows stay (an earlier
  process's staging of it is the coordinator's to sweep);
- a rollback that is sent while another attempt's rows are held poisons that attempt,
  as its rows may be gone.

It matters when data arrive out of epoch order: a stream's epoch E+1 at a writer before
anything of epoch E, a given-up epoch's replay after the next epoch's data (chaos seed
1126 t0054), a late CANCEL of an attempt after its retry's rows. One epoch at a time, as
``write_arrow`` and feeds send, never meets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["HeldRows", "Key"]

Key = tuple[int, int]
"""``(epoch, attempt)``."""

_REMEMBERED = 64  # pre-committed attempts remembered


@dataclass(slots=True)
class HeldRows:
    """The books of one sink writer (the actor's lock guards them)."""

    held: Key | None = None
    pre_committed: list[Key] = field(default_factory=list)

    def other_than(self, key: Key) -> Key | None:
        """The attempt whose rows must go before rows of ``key`` go in or ``key``
        pre-commits; ``None`` when there is none."""
        return self.held if self.held is not None and self.held != key else None

    def needs_rollback(self, key: Key) -> bool:
        """Whether the sink writer has anything of ``key`` to roll back."""
        return self.held is None or self.held == key or key in self.pre_committed

    def rolled_back(self, key: Key) -> Key | None:
        """The sink writer rolled ``key`` back: the other attempt whose rows it may have
        dropped (to poison; it stays held until rolled back itself), or ``None``."""
        if key in self.pre_committed:
            self.pre_committed.remove(key)
        if self.held == key:
            self.held = None
        return self.held

    def pre_commit(self, key: Key) -> None:
        """``key`` pre-committed: the sink writer holds no rows now."""
        self.held = None
        self.pre_committed = [*self.pre_committed[-_REMEMBERED:], key]
