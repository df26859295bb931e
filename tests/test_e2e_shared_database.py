"""One daemon per state directory, and per database: several state directories (machines) can point at one, a
PostgreSQL server or a SQLite file outside all of them, and still only one daemon runs on it. Two daemons would both
launch each queued job."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.e2e import Daemon, cli, events, wait_for, write_config

pytestmark = pytest.mark.slow


def test_one_daemon_per_database_whatever_the_state_directory(tmp_path: Path, db_url: str,
                                                              request: pytest.FixtureRequest) -> None:
    config = write_config(tmp_path, None, state={"database_url": db_url})
    first, second = tmp_path / "state-a", tmp_path / "state-b"
    unused = (request.getfixturevalue("postgres_server").new_database() if db_url.startswith("postgresql")
              else f"sqlite:///{tmp_path / 'copy.db'}")
    daemon = Daemon(tmp_path, config, first).start()
    try:
        wait_for(lambda: events(first, "daemon.started"), 60, "the first daemon to start")
        # Another state directory: its flock is free, the database's lock is not.
        r = cli(config, second, "daemon", "--max-ticks", "1")
        assert r.returncode == 1, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert "one daemon per database" in line, r.stderr
        assert len(events(first, "daemon.started")) == 1  # the refused one changed nothing
        status = json.loads(cli(config, second, "status", "--json").stdout)["daemon"]
        assert status == {"running": True, "pid": daemon.proc.pid, "host": socket.gethostname()}
        # Nor is the state copied elsewhere while that daemon changes it.
        r = cli(config, second, "copy-state", "--to", unused)
        assert r.returncode == 1 and "a daemon is running" in r.stderr, r.stderr
    finally:
        assert daemon.stop() == 0
    # The lock went with the first daemon: now the second may run.
    r = cli(config, second, "daemon", "--max-ticks", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(cli(config, first, "status", "--json").stdout)["daemon"]["running"] is False


def test_one_daemon_per_state_directory(tmp_path: Path) -> None:
    config = write_config(tmp_path, None)
    state = tmp_path / "state"
    daemon = Daemon(tmp_path, config, state).start()
    try:
        wait_for(lambda: events(state, "daemon.started"), 60, "the first daemon to start")
        r = cli(config, state, "daemon", "--max-ticks", "1")
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip().splitlines()[-1].endswith(
            f"another daemon holds {state / 'daemon.lock'} (pid {daemon.proc.pid})"), r.stderr
        status = json.loads(cli(config, state, "status", "--json").stdout)["daemon"]
        assert status == {"running": True, "pid": daemon.proc.pid}
    finally:
        assert daemon.stop() == 0
    assert json.loads(cli(config, state, "status", "--json").stdout)["daemon"]["running"] is False
