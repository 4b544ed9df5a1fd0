"""Meta stores: where epoch decisions live (see ``base`` for the protocol).

``open_metastore(url, runtime)`` picks the backend from the URL:

* ``None``: the embedded default, ``sqlite:///<cwd>/.raysink/<runtime>.db``;
* ``sqlite:////abs/path.db``: ``SqliteMetaStore`` (an absolute path: four slashes);
* ``postgresql://...`` or ``postgres://...``: ``PostgresMetaStore`` (needs the
  ``raysink[postgres]`` extra).

Importing this package imports neither psycopg nor anything else optional.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from raysink.coordinator.metastore._sql import redact_url
from raysink.coordinator.metastore.base import (
    HISTORY_LIMIT,
    EpochRecord,
    EpochState,
    MetaStore,
    RuntimeRecord,
    SinkStatusRecord,
    check_sink_set,
)
from raysink.coordinator.metastore.postgres import PostgresMetaStore
from raysink.coordinator.metastore.sqlite import SqliteMetaStore
from raysink.errors import ConfigError

__all__ = [
    "HISTORY_LIMIT",
    "EpochRecord",
    "EpochState",
    "MetaStore",
    "PostgresMetaStore",
    "RuntimeRecord",
    "SinkStatusRecord",
    "SqliteMetaStore",
    "check_sink_set",
    "default_url",
    "open_metastore",
    "redact_url",
]

_ACCEPTED = ("None (the default sqlite:///<cwd>/.raysink/<runtime>.db), "
             "'sqlite:////abs/path.db', 'postgresql://user:password@host:port/db' or "
             "'postgres://...'")


def default_url(runtime: str, cwd: str | os.PathLike[str] | None = None) -> str:
    """``sqlite:///<cwd>/.raysink/<runtime>.db`` (``cwd`` defaults to the current one)."""
    if not runtime or runtime in (".", "..") or any(c in runtime for c in "/\\\0"):
        raise ConfigError(f"runtime name {runtime!r} cannot name a meta store file; use "
                          "letters, digits, '-', '_' or '.'", runtime=runtime or None)
    base = Path(cwd) if cwd is not None else Path.cwd()
    return f"sqlite:///{base.absolute() / '.raysink' / f'{runtime}.db'}"


def open_metastore(url: str | None, runtime: str) -> MetaStore:
    """Open the meta store at ``url`` (``None``: the runtime's default SQLite file).

    Raises ``ConfigError`` for a URL of no accepted form (quoted with any password
    redacted) and ``MetaStoreError`` when the store cannot be opened.
    """
    if url is None:
        url = default_url(runtime)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "sqlite":
        return SqliteMetaStore(_sqlite_path(url, runtime))
    if scheme in ("postgresql", "postgres"):
        return PostgresMetaStore(url)
    raise ConfigError(f"metastore must be {_ACCEPTED}; got {redact_url(url)!r}",
                      runtime=runtime)


def _sqlite_path(url: str, runtime: str) -> Path:
    """The absolute path of a ``sqlite:////abs/path.db`` URL."""
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc or parts.query or parts.fragment or not path.startswith("//"):
        raise ConfigError(f"a SQLite meta store URL is 'sqlite:////abs/path.db' (an absolute "
                          f"path after 'sqlite:///', no host or options); got {url!r}",
                          runtime=runtime)
    return Path(path[1:])
