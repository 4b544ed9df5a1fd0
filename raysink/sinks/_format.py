"""Format versions of what raysink leaves behind for a later raysink to read: the manifests
of decided epochs (kept in the meta store) and each sink's progress marker in its target.

Each carries ``"format": N``. One written by raysink 0.1.0 carries none: it reads as
version 1, and is used as it is (the keys it has are the keys version 1 has). One of a
format newer than this raysink reads is refused with ``NewerVersionError`` before
anything is committed or swept on its strength: an older raysink cannot know what a newer
one's keys mean, and guessing could commit the wrong data or delete the right data.

Versions::

    manifest 1   raysink 0.1.0 (no key) and 0.2.0: writer, rows, epoch, attempt, bytes,
                 schema and the sink's own keys (``FilesManifest``, ``PostgresManifest``,
                 ``KafkaManifest``)
    marker   1   raysink 0.1.0 (no key) and 0.2.0: each sink's marker as its docs page
                 describes it

A release that changes what a manifest or marker holds raises its number here, and reads
every older one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from raysink.errors import MetaStoreError, NewerVersionError

__all__ = ["FORMAT_KEY", "MANIFEST_FORMAT", "MARKER_FORMAT", "check_manifests",
           "check_marker", "format_of", "stamp"]

FORMAT_KEY = "format"
MANIFEST_FORMAT = 1
MARKER_FORMAT = 1

M = TypeVar("M", bound=Mapping[str, Any])


def stamp(manifest: M) -> M:
    """A copy of ``manifest`` carrying this raysink's manifest format."""
    stamped: Any = {**manifest, FORMAT_KEY: MANIFEST_FORMAT}
    return stamped  # type: ignore[no-any-return]


def format_of(record: Mapping[str, Any], what: str, **where: Any) -> int:
    """The format version ``record`` carries (1 when it carries none: raysink 0.1.0's);
    ``MetaStoreError`` when it is not a positive whole number."""
    found = record.get(FORMAT_KEY, 1)
    if isinstance(found, bool) or not isinstance(found, int) or found < 1:
        raise MetaStoreError(f"{what} has format {found!r}, not a version number; it is "
                             "corrupt: restore it from a backup", **where)
    return found


def check_manifests(manifests: Iterable[Mapping[str, Any]], *, written_by: str | None,
                    runtime: str, sink: str, epoch: int) -> None:
    """``NewerVersionError`` when a manifest of a decided epoch is of a newer format than
    this raysink reads (``written_by``: the raysink release that recorded the epoch)."""
    for manifest in manifests:
        found = format_of(manifest, "a manifest in the meta store", runtime=runtime,
                          sink=sink, epoch=epoch)
        if found > MANIFEST_FORMAT:
            who = f"raysink {written_by}" if written_by else "a newer raysink"
            raise NewerVersionError(
                f"epoch {epoch} was decided by {who} with manifests of format {found}; this "
                f"raysink reads manifest formats up to {MANIFEST_FORMAT}, so it neither "
                f"commits nor sweeps it. Run {who} or newer for this runtime (the epoch "
                "stays pending and rolls forward there)", what="manifest", found=found,
                supported=MANIFEST_FORMAT, runtime=runtime, sink=sink, epoch=epoch)


def check_marker(marker: Mapping[str, Any] | None, *, runtime: str | None,
                 sink: str | None, where: str) -> None:
    """``NewerVersionError`` when a progress marker found ``where`` (its place in the
    target) is of a newer format than this raysink reads; ``None``: no marker."""
    if marker is None:
        return
    found = format_of(marker, f"the progress marker in {where}", runtime=runtime, sink=sink)
    if found > MARKER_FORMAT:
        raise NewerVersionError(
            f"the progress marker in {where} is of format {found}, written by a newer "
            f"raysink; this raysink reads marker formats up to {MARKER_FORMAT}. Run the "
            "raysink that wrote it, or a newer one, for this runtime",
            what="marker", found=found, supported=MARKER_FORMAT, runtime=runtime, sink=sink)
