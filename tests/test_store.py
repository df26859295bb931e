"""The store: versioned migrations, private SQLite in WAL mode, safe concurrent writers (CLI + daemon).

Each behaviour is specified on both backends the store supports by URL: SQLite (the embedded default) and a real
PostgreSQL server (`db_url`, `postgres_server` in conftest)."""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, insert, inspect, select, text

from orchestrator.app import App
from orchestrator.lifecycle.budget_guard import BudgetGuard
from orchestrator.lifecycle.orphans import last_charge, record_orphan
from providers.base import InstanceInfo, InstanceState, Market
from state import schema
from state.store import Store


def test_migrations_run_once_and_record_the_version(db_url: str) -> None:
    url = db_url
    st = Store(url)
    assert st.migrate() == schema.LATEST
    with st.engine.connect() as c:
        versions = [r[0] for r in c.execute(select(schema.schema_version.c.version))]
    assert versions == [v for v, _ in schema.MIGRATIONS]
    Store(url)  # a second open applies nothing again
    with st.engine.connect() as c:
        assert len(list(c.execute(select(schema.schema_version.c.version)))) == len(schema.MIGRATIONS)


def test_a_database_from_before_jobs_kept_their_planned_rented_cost_gets_it_from_their_decisions(
        db_url: str) -> None:
    # Version 6's jobs table had no rented_usd: the migration adds it and fills it in from each decision's plan.
    # (Nor wait_until, which version 8 adds, empty: no job waits for a time.)
    st = Store(db_url)
    with st.tx() as c:
        c.execute(text("ALTER TABLE jobs DROP COLUMN rented_usd"))
        c.execute(text("ALTER TABLE jobs DROP COLUMN wait_until"))
        c.execute(text("DELETE FROM schema_version WHERE version >= 7"))
        for job_id, plan in (("j1", [{"where": "local", "cost_usd": 0.5}, {"where": "cloud", "cost_usd": 6.25}]),
                             ("j2", [{"where": "local", "cost_usd": 0.2}]), ("j3", None)):
            c.execute(text("INSERT INTO jobs (id, name, kind, state, verdict, placement, approved, spec, decision, "
                           "deadline_at, created_at, updated_at) VALUES (:id, 'x', 'train', 'queued', 'burst', "
                           "'cloud', false, '{}', :decision, 0, 0, 0)"),
                      {"id": job_id, "decision": json.dumps({"plan": plan})})
    st.engine.dispose()
    again = Store(db_url)
    assert {j["id"]: j["rented_usd"] for j in again.list_jobs()} == {"j1": 6.25, "j2": 0.0, "j3": 0.0}
    assert {j["wait_until"] for j in again.list_jobs()} == {None}
    # From then on the store keeps it with every decision it writes.
    again.update_job("j2", decision={"plan": [{"where": "cloud", "cost_usd": 3.0}]})
    assert again.get_job("j2")["rented_usd"] == 3.0


def _a_database_of_version(url: str, last: int) -> None:
    """What burstctl made before version `last` + 1: migrations 1 to `last` as they ran (at 8 the ledger indexed by its
    month only; at 9 by job and open charges too, not by instance)."""
    engine = create_engine(url)
    with engine.begin() as c:
        for version, step in schema.MIGRATIONS:
            if version <= last:
                step(c)
                c.execute(insert(schema.schema_version).values(version=version))
    engine.dispose()


def _plans_of_ledger_reads(st: Store, *reads: Callable[[], object]) -> list[str]:
    """The query plan of each statement the reads sent that reads the ledger, one string each: SQLite's EXPLAIN
    QUERY PLAN; PostgreSQL's EXPLAIN with sequential scans priced out, so that the plan of a table this small names
    an index whenever one serves (and is a Seq Scan only where none does)."""
    sent: list[tuple[str, Any]] = []

    def seen(_conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any, _many: bool) -> None:
        sent.append((statement, parameters))

    event.listen(st.engine, "before_cursor_execute", seen)
    try:
        for read in reads:
            read()
    finally:
        event.remove(st.engine, "before_cursor_execute", seen)
    plans = []
    with st.engine.connect() as c:
        if not st.is_sqlite:
            c.exec_driver_sql("SET enable_seqscan = off")
        for statement, parameters in sent:
            if "FROM ledger" not in statement:
                continue
            explain = "EXPLAIN QUERY PLAN " if st.is_sqlite else "EXPLAIN "
            rows = c.exec_driver_sql(explain + statement, parameters).all()
            plans.append(" | ".join(str(r[-1]) for r in rows))
    return plans


@pytest.mark.parametrize("version", [8, 9])
def test_a_database_from_before_the_ledger_was_indexed_reads_a_jobs_spend_open_charges_and_instances_through_indexes(
        db_url: str, tmp_path: Path, version: int) -> None:
    # The ledger only grows (a charge per instance ever run): a job's spend read by scanning all of it grew with
    # every month of history. An existing database gets the indexes when it is opened, kept as it is otherwise:
    # one from before any (version 8), and one indexed by job and open charges but not by instance (version 9).
    _a_database_of_version(db_url, version)
    engine = create_engine(db_url)
    with engine.begin() as c:
        c.execute(insert(schema.ledger), [
            {"month": "2026-11", "job_id": f"j{k % 40}", "attempt_id": f"j{k % 40}-a{k}", "provider": "sim",
             "instance_id": f"i-{k}", "rate_usd_h": 2.0, "started_at": 1000.0 * k,
             "ended_at": None if k % 97 == 0 else 1000.0 * k + 600, "cost_usd": None if k % 97 == 0 else 1 / 3}
            for k in range(400)])
    engine.dispose()
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text(f'[state]\ndatabase_url = "{db_url}"\n')
    app = App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))
    st = app.store
    assert st.migrate() == schema.LATEST
    indexes = {ix["name"]: ix["column_names"] for ix in inspect(st.engine).get_indexes("ledger")}
    assert indexes["ix_ledger_job"] == ["job_id"]
    assert indexes["ix_ledger_instance"] == ["provider", "instance_id", "ended_at"]
    assert st.job_spend("j3", now=4e5) == pytest.approx((10 / 3, 0.0))  # k = 3, 43, ..., 383: ten charges, closed
    assert st.job_spend("j11", now=4e5) == pytest.approx((9 / 3 + 2.0 * (4e5 - 291e3) / 3600, 2.0))  # k = 291 open

    [spend] = _plans_of_ledger_reads(st, lambda: st.job_spend("j3"))
    assert "ix_ledger_job" in spend, spend
    # What else reads the ledger by one job, attempt or instance, or for the charges still open (the budget's check,
    # every tick): none of them reads the whole ledger either.
    guard = BudgetGuard(app, clock=time.time, tick_s=5.0)

    def close_open_charges() -> None:
        with st.tx() as c:
            st.close_open_charges(c, ended_at=2e6, attempt_id="j34-a194")
            st.instance_gone(c, "sim", "i-291", gone_at=2e6)

    plans = _plans_of_ledger_reads(st, close_open_charges, lambda: guard.exposure(2e6),
                                   lambda: st.jobs_over_before(2e6, final_states=["done"], active_attempt_states=[]))
    assert len(plans) >= 4
    for plan in plans:
        assert "SCAN ledger" not in plan and "Seq Scan on ledger" not in plan, plans

    # The sweep's look at an orphan's charges, by (provider, instance_id): one open (i-0), its last closed one (i-3),
    # none ever (i-new). Without an index by instance its max(ended_at) walked ix_ledger_ended from the newest charge
    # to the last of the instance's, all of it for one never charged, and neither backend's plan says it scans
    # (SQLite's: `SEARCH ledger USING INDEX ix_ledger_ended`): the plan must name the instance's index.
    def orphan(instance_id: str) -> None:
        inst = InstanceInfo(id=instance_id, state=InstanceState.RUNNING, instance_type="t", market=Market.ON_DEMAND)
        with st.tx() as c:
            record_orphan(app, c, "sim", inst, None, 2.0, now=2e6)

    with st.engine.connect() as c:
        assert last_charge(c, "sim", "i-0") == (True, None)
        assert last_charge(c, "sim", "i-3") == (False, 3600.0)
        assert last_charge(c, "sim", "i-new") == (False, None)
    orphan_plans = _plans_of_ledger_reads(st, *(functools.partial(orphan, i) for i in ("i-0", "i-3", "i-new")))
    assert len(orphan_plans) == 5  # i-0: its open charge; the others: none open, then their last one's end
    for plan in orphan_plans:
        assert "ix_ledger_instance" in plan, orphan_plans


def test_database_file_is_private(tmp_path: Path) -> None:
    Store(f"sqlite:///{tmp_path / 'b.db'}")
    assert stat.S_IMODE(os.stat(tmp_path / "b.db").st_mode) == 0o600


def _writer(url: str, worker: int, n: int) -> None:
    st = Store(url)
    for i in range(n):
        st.append_event("test.write", {"worker": worker, "i": i})
        st.set_setting(f"w{worker}", i)


def test_concurrent_writers_in_separate_processes_lose_nothing(db_url: str) -> None:
    url = db_url
    Store(url)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(url, w, 100)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    st = Store(url)
    evs = st.events(type_prefix="test.")
    assert len(evs) == 400
    assert {(e["data"]["worker"], e["data"]["i"]) for e in evs} == {(w, i) for w in range(4) for i in range(100)}
    assert all(st.get_setting(f"w{w}") == 99 for w in range(4))


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_processes_opening_a_new_database_at_once_take_turns_at_migrating(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    # The daemon and the first CLI command often start together on a new state directory. Both used to read
    # version 0 and create the tables; one failed with "table jobs already exists" (1 run in 4 or so, here).
    # Each process imports once, then opens every new database as soon as it is named: the four open it together,
    # not as their interpreters happen to finish starting.
    code = ("import sys\nfrom state.store import Store\n"
            "for url in sys.stdin:\n    Store(url.strip()).close()\n    print('opened', flush=True)\n")
    server = request.getfixturevalue("postgres_server") if backend == "postgresql" else None
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        for trial in range(8):
            url = server.new_database() if server else f"sqlite:///{tmp_path / f'new-{trial}.db'}"
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(url + "\n")
                p.stdin.flush()
            for p in procs:
                assert p.stdout is not None
                assert p.stdout.readline() == "opened\n", p.communicate(timeout=60)[1][-500:]
            with Store(url).engine.connect() as c:
                versions = [r[0] for r in c.execute(select(schema.schema_version.c.version))]
            assert versions == [v for v, _ in schema.MIGRATIONS], "each migration once"
    finally:
        for p in procs:
            p.communicate(timeout=60)  # stdin closed: each ends


def test_job_updates_are_compare_and_set(db_url: str) -> None:
    st = Store(db_url)
    st.insert_job({"id": "j1", "name": "x", "kind": "train", "state": "queued", "verdict": "local",
                   "placement": "local", "spec": {}, "decision": {}, "deadline_at": 0.0})
    assert st.update_job("j1", expect_state="queued", state="running")
    assert not st.update_job("j1", expect_state="queued", state="cancelled")
    assert st.get_job("j1")["state"] == "running"
    assert st.get_job("x")["id"] == "j1"  # by name too


def test_open_charges_accrue_until_closed(db_url: str) -> None:
    st = Store(db_url)
    cid = st.open_charge({"month": "2026-11", "provider": "sim", "rate_usd_h": 3.6, "started_at": 1000.0})
    assert abs(st.month_spend("2026-11", now=1000.0 + 1800) - 1.8) < 1e-9
    st.close_charge(cid, ended_at=1000.0 + 3600, billed_seconds=3600, cost_usd=3.6)
    assert abs(st.month_spend("2026-11", now=99999.0) - 3.6) < 1e-9
    # Closed and open charges together; another month's are not this month's.
    st.open_charge({"month": "2026-11", "provider": "sim", "rate_usd_h": 1.2, "started_at": 99999.0})
    st.open_charge({"month": "2026-12", "provider": "sim", "rate_usd_h": 9.0, "started_at": 0.0})
    assert abs(st.month_spend("2026-11", now=99999.0 + 3600) - 4.8) < 1e-9


def test_an_instance_confirmed_gone_closes_its_charge_at_its_attempts_billing_minimum(db_url: str) -> None:
    # The daemon, its sweep and revert-local each closed charges, two of them at a fixed 60 s whatever the offer's
    # minimum was: one function now, reading the minimum the attempt launched with.
    st = Store(db_url)
    st.insert_job({"id": "j1", "name": "x", "kind": "train", "state": "running", "verdict": "burst",
                   "placement": "cloud", "spec": {}, "decision": {}, "deadline_at": 0.0})
    with st.tx() as c:
        c.execute(insert(schema.attempts).values(id="j1-a1", job_id="j1", n=1, where="cloud", state="terminating",
                                                 info={"billing_minimum_s": 600.0}, created_at=1000.0))
        c.execute(insert(schema.instances).values(provider="sim", id="i-1", attempt_id="j1-a1", state="running",
                                                  launched_at=1000.0, verified_gone=False))
    st.open_charge({"month": "2026-11", "provider": "sim", "instance_id": "i-1", "attempt_id": "j1-a1",
                    "rate_usd_h": 3.6, "started_at": 1000.0})
    with st.tx() as c:
        st.instance_gone(c, "sim", "i-1", gone_at=1010.0)
    with st.engine.connect() as c:
        charge = c.execute(select(schema.ledger)).mappings().one()
        inst = c.execute(select(schema.instances)).mappings().one()
    assert (charge["ended_at"], charge["billed_seconds"], charge["cost_usd"]) == (1010.0, 600.0, pytest.approx(0.6))
    assert (inst["state"], inst["gone_at"], inst["verified_gone"]) == ("terminated", 1010.0, True)
    st.close()


def test_the_newest_events_are_read_from_the_end_in_order(db_url: str) -> None:
    st = Store(db_url)
    ids = [st.append_event(f"job.e{i}", {"i": i}, job_id="j1" if i % 2 else "j2") for i in range(6)]
    assert [e["id"] for e in st.events(newest=2)] == ids[-2:]
    assert [e["id"] for e in st.events(newest=2, job_id="j2")] == [ids[2], ids[4]]
    assert [e["id"] for e in st.events(newest=10)] == ids
    assert [e["id"] for e in st.events(limit=2)] == ids[:2]  # the first ones, as before


def test_a_type_prefix_reads_every_type_it_starts_and_only_those_in_id_order(db_url: str) -> None:
    st = Store(db_url)
    kinds = ["job.done", "instance.preempted", "job.decided", "jobx.other", "instance.ready", "job.done"]
    ids = [st.append_event(k, {"i": i}, job_id="j1" if i % 2 else None) for i, k in enumerate(kinds)]
    assert st.event_types() == sorted(set(kinds))
    assert st.event_types("job.") == ["job.decided", "job.done"]
    assert [e["id"] for e in st.events(type_prefix="job.")] == [ids[0], ids[2], ids[5]]
    assert [e["id"] for e in st.events(type_prefix="job.", newest=2)] == [ids[2], ids[5]]
    assert [e["id"] for e in st.events(type_prefix="job.", after_id=ids[0], limit=1)] == [ids[2]]
    assert [e["id"] for e in st.events(type_prefix="instance.", job_id="j1")] == [ids[1]]
    assert st.events(type_prefix="nothing.") == []
    assert [e["id"] for e in st.iter_events(type_prefix="job.", batch=2)] == [ids[0], ids[2], ids[5]]
    assert st.last_event_id() == ids[-1]
    st.close()


def test_settings_are_listed_by_a_literal_prefix_and_deleted_one_by_one(db_url: str) -> None:
    st = Store(db_url)
    for key in ("schedule:/jobs/a.toml", "schedule:/jobs/b_c.toml", "schedules-seen", "sched%:x", "other"):
        st.set_setting(key, {"armed_at": 1.0})
    assert st.settings_with_prefix("schedule:") == {"schedule:/jobs/a.toml": {"armed_at": 1.0},
                                                    "schedule:/jobs/b_c.toml": {"armed_at": 1.0}}
    assert list(st.settings_with_prefix("sched%")) == ["sched%:x"]  # % and _ are characters, not LIKE's wildcards
    st.delete_setting("schedule:/jobs/a.toml")
    st.delete_setting("schedule:/jobs/gone.toml")  # not there: nothing to do
    assert st.settings_with_prefix("schedule:") == {"schedule:/jobs/b_c.toml": {"armed_at": 1.0}}
    st.close()


def test_marking_finished_attempts_adds_to_their_info_and_keeps_the_rest(db_url: str) -> None:
    st = Store(db_url)
    st.insert_job({"id": "j1", "name": "x", "kind": "train", "state": "done", "verdict": "local",
                   "placement": "local", "spec": {}, "decision": {}, "deadline_at": 0.0})
    with st.tx() as c:
        for n in (1, 2):
            c.execute(schema.attempts.insert().values(id=f"j1-a{n}", job_id="j1", n=n, where="local",
                                                      state="succeeded", info={"units_done": n}, created_at=0.0))
    st.mark_attempts(["j1-a1", "j1-a2", "j9-a1"], "logs_pruned_at", 123.0, batch=1)
    with st.engine.connect() as c:
        infos = dict(c.execute(select(schema.attempts.c.id, schema.attempts.c.info)).all())
    assert infos == {"j1-a1": {"units_done": 1, "logs_pruned_at": 123.0},
                     "j1-a2": {"units_done": 2, "logs_pruned_at": 123.0}}
    st.close()
