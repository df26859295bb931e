"""PostgreSQL by URL, beyond what every backend shares (tests/test_store.py, the burst story in test_e2e_burst.py):
several state directories can point at one database, and still only one daemon runs on it."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from state.store import DAEMON_LOCK_KEY
from tests.e2e import Daemon, cli, events, wait_for, write_config

pytestmark = pytest.mark.slow


def test_one_daemon_per_database_whatever_the_state_directory(tmp_path: Path, postgres_server) -> None:
    config = write_config(tmp_path, None, state={"database_url": postgres_server.new_database()})
    first, second = tmp_path / "state-a", tmp_path / "state-b"
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
    finally:
        assert daemon.stop() == 0
    # The lock went with the first daemon's connection: now the second may run.
    r = cli(config, second, "daemon", "--max-ticks", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(cli(config, first, "status", "--json").stdout)["daemon"]["running"] is False


def test_a_killed_daemons_database_lock_goes_with_it(tmp_path: Path, postgres_server) -> None:
    config = write_config(tmp_path, None, state={"database_url": postgres_server.new_database()})
    daemon = Daemon(tmp_path, config, tmp_path / "state-a").start()
    wait_for(lambda: events(tmp_path / "state-a", "daemon.started"), 60, "the daemon to start")
    daemon.kill()  # SIGKILL: no unlock; the server ends the session when the connection drops
    r = wait_for(lambda: (res := cli(config, tmp_path / "state-b", "daemon", "--max-ticks", "1")).returncode == 0
                 and res, 30, "the lock to be free")
    assert r.returncode == 0


def test_a_daemon_whose_lock_the_server_ends_stops_rather_than_run_unguarded(tmp_path: Path, postgres_server) -> None:
    import psycopg

    url = postgres_server.new_database()
    config = write_config(tmp_path, None, state={"database_url": url})
    state = tmp_path / "state"
    daemon = Daemon(tmp_path, config, state).start()
    wait_for(lambda: events(state, "daemon.started"), 60, "the daemon to start")
    # What a server restart or an administrator does: end the session that holds the lock.
    with psycopg.connect(host="127.0.0.1", port=postgres_server.port, user="burst", dbname="postgres",
                         autocommit=True) as c:
        ended = c.execute("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                          f"AND objid = {DAEMON_LOCK_KEY}").fetchall()
    assert ended == [(True,)]
    assert daemon.proc.wait(60) == 1
    assert events(state, "daemon.lock_lost")
    assert "lost this database's daemon lock" in (tmp_path / "daemon-1.log").read_text()
