"""PostgreSQL by URL, beyond what every backend shares (tests/test_store.py, the burst story in test_e2e_burst.py,
one daemon per shared database in test_e2e_shared_database.py): the daemon's lock lives in a server session, which
a killed daemon or the server itself can end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from state.store import DAEMON_LOCK_KEY
from tests.e2e import Daemon, cli, events, wait_for, write_config

pytestmark = pytest.mark.slow


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


def test_copy_state_moves_everything_to_postgresql_and_the_budget_carries_over(
        burstctl, tmp_path: Path, postgres_server) -> None:
    from sqlalchemy import select

    from state import schema
    from state.store import Store
    from tests.conftest import write_job

    for name in ("weekly-finetune", "eval-sweep"):
        assert burstctl("enqueue", str(write_job(tmp_path, name))).returncode == 0
    assert burstctl("cancel", "eval-sweep").returncode == 0
    sqlite = Store(f"sqlite:///{burstctl.state_dir / 'burstctl.db'}")
    charge = sqlite.open_charge({"month": "2026-11", "provider": "sim", "rate_usd_h": 3.0, "started_at": 1000.0})
    sqlite.close_charge(charge, ended_at=4600.0, billed_seconds=3600.0, cost_usd=3.0)
    url = postgres_server.new_database()

    r = burstctl("copy-state", "--to", url, "--json")
    assert r.returncode == 0, r.stderr
    copied = json.loads(r.stdout)["copied"]
    assert copied["jobs"] == 2 and copied["ledger"] == 1 and copied["events"] >= 5

    pg = Store(url)
    for table in schema.metadata.sorted_tables:  # every row, ids and values, as it was
        order = list(table.primary_key.columns)
        with sqlite.engine.connect() as a, pg.engine.connect() as b:
            assert [dict(x) for x in a.execute(select(table).order_by(*order)).mappings()] == \
                   [dict(x) for x in b.execute(select(table).order_by(*order)).mappings()], table.name
    assert pg.append_event("test.after_copy", {}) > max(e["id"] for e in sqlite.events())  # ids go on past them
    assert pg.month_spend("2026-11") == sqlite.month_spend("2026-11") == 3.0

    # The copy is the state now: point the config at it.
    config = tmp_path / "pg.toml"  # not ./burstctl.toml, which every command here would read
    config.write_text(f'[state]\ndatabase_url = "{url}"\n')
    listed = json.loads(burstctl("--config", str(config), "list", "--json").stdout)
    assert sorted(j["name"] for j in listed) == ["eval-sweep", "weekly-finetune"]

    # A database already used is refused, and left as it was.
    again = burstctl("copy-state", "--to", url)
    assert again.returncode == 2 and "already holds burstctl data" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    assert len(pg.events()) == copied["events"] + 1
    sqlite.close()
    pg.close()


def test_copy_state_refuses_bad_targets_with_one_line(burstctl) -> None:
    cases = {
        "postgresql+psycopg://burst:hunter2@127.0.0.1/x": (2, "holds a password"),
        "nonsense": (2, "is not a database URL"),
        "postgresql+psycopg://burst:hunter2/x": (2, "is not a database URL"),  # no host: hunter2 read as the port
        f"sqlite:///{burstctl.state_dir / 'burstctl.db'}": (2, "in use now"),
        # "rows copied" into a database gone when the command ends
        "sqlite:///:memory:": (2, "is an in-memory database"),
        "sqlite:///file:x?mode=memory&uri=true": (2, "is an in-memory database"),
    }
    for url, (code, words) in cases.items():
        r = burstctl("copy-state", "--to", url)
        assert r.returncode == code and words in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "hunter2" not in r.stderr
