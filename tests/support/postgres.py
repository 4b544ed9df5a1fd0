"""A throwaway PostgreSQL server for tests, started by the test session itself.

``PostgresServer`` runs the newest ``/usr/lib/postgresql/*/bin`` in a fresh directory under
``/tmp`` (pytest's ``tmp_path`` is unreachable for the ``postgres`` user). As root, the
server binaries run as the ``postgres`` system user (``initdb`` and ``postgres`` refuse
root). The server listens on 127.0.0.1 only, on a free random port, with its unix socket
inside its directory, scram-sha-256 password authentication for every connection,
``max_prepared_transactions=20`` and fsync on (crash-restart tests need durability);
``settings`` adds to or overrides these ``postgresql.conf`` lines.

The session fixture ``pg_server`` also creates:

* role ``raysink`` (login, not a superuser) owning database ``raysink``: ``pg_server.dsn()``;
* role ``reader`` (login, no privileges) for permission tests:
  ``pg_server.dsn(user="reader")``.

Passwords are random per session; ``dsn()`` fills in the one it knows for the user.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import pytest

from tests.support.ports import server_port

__all__ = ["PostgresServer", "find_bindir", "pg_server"]

StopMode = Literal["smart", "fast", "immediate"]

_PG_ROOT = Path("/usr/lib/postgresql")
_SETUP_HINT = "run scripts/setup.sh (it installs the PostgreSQL server binaries and psycopg)"


def find_bindir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding ``initdb``, or ``None``."""
    found: list[tuple[tuple[int, ...], Path]] = []
    for candidate in _PG_ROOT.glob("*/bin"):
        if (candidate / "initdb").is_file():
            version = tuple(int(part) for part in re.findall(r"\d+", candidate.parent.name))
            found.append((version, candidate))
    return max(found)[1] if found else None


class PostgresServer:
    """One PostgreSQL cluster in a temporary directory; see the module docstring.

    Call order: ``start()`` (runs ``initdb`` the first time), then any of ``execute``,
    ``create_role``, ``create_database``, ``dsn``, ``stop``/``start``/``restart``; finally
    ``cleanup()`` (idempotent), which stops the server and deletes its directory.
    """

    superuser = "postgres"

    def __init__(self, bindir: Path | None = None, *,
                 settings: dict[str, str] | None = None) -> None:
        found = bindir or find_bindir()
        if found is None:
            raise RuntimeError(f"no PostgreSQL server binaries under {_PG_ROOT}/*/bin; "
                               f"{_SETUP_HINT}")
        self.bindir = found
        self.host = "127.0.0.1"
        self.port = server_port()
        self.root = Path(tempfile.mkdtemp(prefix="raysink-pg-", dir="/tmp"))
        self.data_dir = self.root / "data"
        self.log_file = self.root / "server.log"
        self.superuser_password = secrets.token_hex(12)
        self._passwords: dict[str, str] = {self.superuser: self.superuser_password}
        self._initialised = False
        self._running = False
        self._as_postgres = os.geteuid() == 0
        self._settings = dict(settings or {})
        if self._as_postgres:
            shutil.chown(self.root, user="postgres", group="postgres")

    # process control ----------------------------------------------------------------
    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a server binary (as the ``postgres`` user when we are root)."""
        command = [str(self.bindir / args[0]), *args[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, cwd=self.root, capture_output=True, text=True,
                                timeout=120, check=False)
        if check and result.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({result.returncode}): "
                               f"{result.stderr.strip() or result.stdout.strip()}\n"
                               f"{self._log_tail()}")
        return result

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return "server log:\n" + "\n".join(text.splitlines()[-lines:])

    def _initdb(self) -> None:
        pwfile = self.root / "pwfile"
        pwfile.write_text(self.superuser_password + "\n")
        if self._as_postgres:
            shutil.chown(pwfile, user="postgres", group="postgres")
        self._run("initdb", "-D", str(self.data_dir), "-U", self.superuser,
                  "--auth=scram-sha-256", f"--pwfile={pwfile}", "--encoding=UTF8",
                  "--no-locale")
        pwfile.unlink()
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
            "max_prepared_transactions": "20",
            "fsync": "on",
            "max_connections": "100",
            **self._settings,
        }
        with open(self.data_dir / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write("\n# raysink test server\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        self._initialised = True

    def start(self) -> None:
        """Start the server (initialising the cluster the first time); waits until ready."""
        if self._running:
            return
        if not self._initialised:
            self._initdb()
        self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.data_dir),
                  "-l", str(self.log_file), "-o", f"-k {self.root}")
        self._running = True

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server; ``mode="immediate"`` is a crash (no checkpoint)."""
        if not self._running:
            return
        self._run("pg_ctl", "stop", "-w", "-t", "60", "-D", str(self.data_dir), "-m", mode)
        self._running = False

    def restart(self, mode: StopMode = "immediate") -> None:
        """Stop with ``mode`` (a crash by default), then start again on the same port."""
        self.stop(mode)
        self.start()

    @property
    def running(self) -> bool:
        return self._running

    def cleanup(self) -> None:
        """Stop the server if it runs and delete its directory. Idempotent."""
        if self._running:
            with contextlib.suppress(Exception):
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    # connections ---------------------------------------------------------------------
    def dsn(self, user: str = "raysink", password: str | None = None,
            dbname: str = "raysink") -> str:
        """A ``postgresql://`` URL; ``password`` defaults to the one this server set."""
        secret = self._passwords.get(user, "") if password is None else password
        auth = quote(user, safe="") + (f":{quote(secret, safe='')}" if secret else "")
        return f"postgresql://{auth}@{self.host}:{self.port}/{quote(dbname, safe='')}"

    def password(self, user: str) -> str:
        """The password this server gave ``user``."""
        return self._passwords[user]

    def execute(self, sql: str, params: Any = None, *,
                dbname: str = "postgres") -> list[tuple[Any, ...]]:
        """Run one statement as the superuser (autocommit); returns its rows, if any."""
        import psycopg

        dsn = self.dsn(self.superuser, dbname=dbname)
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            cursor = conn.execute(sql, params)
            return list(cursor.fetchall()) if cursor.description else []

    def create_role(self, name: str, password: str, superuser: bool = False) -> None:
        """Create a login role (or reset its password when it exists)."""
        from psycopg import sql

        exists = self.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,))
        verb = "ALTER" if exists else "CREATE"
        power = "SUPERUSER" if superuser else "NOSUPERUSER"
        statement = sql.SQL("{} ROLE {} LOGIN {} PASSWORD {}").format(
            sql.SQL(verb), sql.Identifier(name), sql.SQL(power), sql.Literal(password))
        self.execute(statement.as_string(None))
        self._passwords[name] = password

    def create_database(self, name: str, owner: str) -> None:
        """Create a database owned by ``owner`` unless it exists."""
        from psycopg import sql

        if self.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)):
            return
        statement = sql.SQL("CREATE DATABASE {} OWNER {}").format(
            sql.Identifier(name), sql.Identifier(owner))
        self.execute(statement.as_string(None))

    def __repr__(self) -> str:
        state = "running" if self._running else "stopped"
        return f"PostgresServer({self.host}:{self.port}, {state}, root={str(self.root)!r})"


def _require_tools() -> None:
    if find_bindir() is None:
        pytest.fail(f"PostgreSQL server binaries not found under {_PG_ROOT}/*/bin; "
                    f"{_SETUP_HINT}", pytrace=False)
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.fail(f"psycopg is not installed; {_SETUP_HINT}", pytrace=False)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """A running PostgreSQL for the test session with roles ``raysink`` and ``reader``.

    Never skips: missing binaries fail with a pointer to ``scripts/setup.sh``.
    """
    _require_tools()
    server = PostgresServer()
    atexit.register(server.cleanup)
    try:
        server.start()
        server.create_role("raysink", "rs-" + secrets.token_hex(10))
        server.create_database("raysink", owner="raysink")
        server.create_role("reader", "rd-" + secrets.token_hex(10))
        yield server
    finally:
        server.cleanup()
