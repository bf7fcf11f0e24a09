"""PostgresServer: a throwaway PostgreSQL cluster for the `postgres` lane (Debian's binaries).

`scripts/install-postgres.sh` installs them. The cluster lives in a temporary directory, listens
on a free loopback port (another one if a process takes it first), trusts local connections and
is stopped with everything it wrote when the test session ends. initdb refuses to run as root:
as root, the cluster is made and run by the `postgres` user that Debian's package creates. Tests
skip, saying why, where the binaries or psycopg (the `store-postgres` extra) are missing.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.lanes import missing_lane
from tests.server import PortTaken, free_port, on_free_ports, port_taken

_databases = itertools.count()


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_major)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _major(path: str) -> int:
    part = Path(path).parts[-3]
    return int(part) if part.isdigit() else 0


def skip_reason() -> str | None:
    """Why the lane cannot run here, or None."""
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install '.[store-postgres]')"
    if _bin_dir() is None:
        return "the PostgreSQL server binaries are missing (run scripts/install-postgres.sh)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a `postgres` user to run the cluster as"
    return None


class PostgresServer:
    """One cluster: `new_database()` gives each test a database of its own."""

    def __init__(self) -> None:
        reason = skip_reason()
        if reason is not None:
            missing_lane("postgres", reason)
        bin_dir = _bin_dir()
        assert bin_dir is not None
        self._bin = bin_dir
        self._root = Path(tempfile.mkdtemp(prefix="deepinfer-pg-"))
        self._data = self._root / "data"
        self.port = 0
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            postgres = pwd.getpwnam("postgres")
            os.chown(self._root, postgres.pw_uid, postgres.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self._data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        on_free_ports(self._start_on_a_free_port)
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _start_on_a_free_port(self) -> None:
        self.port = free_port()
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self._as_user, str(self._bin / tool), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}):\n{done.stdout}{done.stderr}")

    def new_database(self) -> str:
        """The URL of a fresh, empty database."""
        import psycopg

        name = f"store_{os.getpid()}_{next(_databases)}"
        with psycopg.connect(self.url, autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        """Stop the cluster (a database outage), keeping its data."""
        self._run("pg_ctl", "-D", str(self._data), "-m", "fast", "-w", "stop")

    def start(self) -> None:
        """Start the cluster (again, after `stop()`, on the same port: its URL stays) and wait
        until it accepts connections."""
        options = f"-p {self.port} -k {self._root} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = self._root / "log"
        written = log.stat().st_size if log.exists() else 0
        try:
            self._run(
                "pg_ctl", "-D", str(self._data), "-l", str(log), "-o", options, "-w", "start",
            )  # fmt: skip
        except RuntimeError:
            with log.open("rb") as opened:
                opened.seek(written)
                if port_taken(opened.read().decode(errors="replace")):
                    raise PortTaken(f"PostgreSQL: port {self.port} is taken") from None
            raise

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # already stopped
            self._run("pg_ctl", "-D", str(self._data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self._root, ignore_errors=True)
