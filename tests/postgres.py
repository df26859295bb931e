"""A private PostgreSQL server for tests: its own cluster in a temporary directory, on 127.0.0.1.

The store promises that PostgreSQL stands in for SQLite by URL (`state.database_url`); the tests keep that promise
honest against a real server, not a mock. initdb refuses to run as root, so as root the cluster belongs to the
`postgres` user that Debian's package creates. Durability is off (`fsync=off`): a test cluster is thrown away.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

ROLE = "burst"


def find_bin_dir() -> Path | None:
    """Where initdb and pg_ctl are: on PATH, else the newest /usr/lib/postgresql/<version>/bin (Debian)."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).resolve().parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """Start with `start()`, take a fresh database per test with `new_database()`, end with `stop()`."""

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="burstctl-pg-"))
        self.data = self.root / "data"
        self.port = 0
        self._user: str | None = None
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("as root, the test cluster needs a 'postgres' user to own it (Debian's "
                                   "postgresql package creates one)") from None
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._user = "postgres"

    def _run(self, *args: str) -> None:
        res = subprocess.run([str(self.bin_dir / args[0]), *args[1:]], capture_output=True, text=True, timeout=120,
                             user=self._user, group=self._user, cwd=self.root)
        if res.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({res.returncode}): {(res.stderr or res.stdout).strip()[-800:]}")

    def start(self) -> PostgresServer:
        try:
            return self._start()
        except BaseException:
            self.stop()  # a cluster that did not start leaves no directory behind either
            raise

    def _start(self) -> PostgresServer:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", ROLE, "-E", "UTF8", "--locale=C",
                  "--no-sync")
        for _ in range(5):  # a free port can be taken between the probe and the server's bind: try another
            from tests.e2e import free_port  # not at import: conftest imports this module

            self.port = free_port()
            try:
                self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-l", str(self.root / "server.log"),
                          "-o", f"-h 127.0.0.1 -p {self.port} -k {self.root} -F -c fsync=off "
                                f"-c full_page_writes=off -c max_connections=200", "start")
                return self
            except RuntimeError:
                if "could not bind" not in self.log():
                    raise
        raise RuntimeError(f"PostgreSQL did not start: {self.log()[-800:]}")

    def log(self) -> str:
        try:
            return (self.root / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://{ROLE}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A new empty database; its SQLAlchemy URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user=ROLE, dbname="postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.data.exists():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):  # gone already: nothing to stop
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
