"""Gate 2 with a queue: the local GPU runs one job at a time, earliest deadline first, so a job's local finish is
the local work queued ahead of it (earlier or equal deadlines) plus its own T_L. A job that would make its deadline
alone but not behind the queue has its deadline priced like any other (it bursts, or waits for approval)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import insert

from orchestrator.app import App
from orchestrator.queue import LocalBacklog, enqueue, local_backlog
from state import schema as s
from tests.conftest import write_job


def _app(tmp_path: Path, extra: str = "", database_url: str | None = None) -> App:
    cfg = tmp_path / "burstctl.toml"
    state = f'[state]\ndatabase_url = "{database_url}"\n' if database_url else ""
    cfg.write_text("[policy]\nmax_auto_delta_usd = 100.0\n" + state + extra)
    return App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))


def _enqueue(app: App, tmp_path: Path, name: str, deadline_hours: float) -> dict:
    # Four hours of work on the local GPU alone; 2.5 h rented (2 h at s_R 2, plus t_ovh).
    path = write_job(tmp_path, name, work_units=4, local_throughput=1.0, rented_throughput={"H100": 2.0},
                     deadline_hours=deadline_hours)
    job_id = enqueue(app, path)[0]
    return app.store.get_job(job_id)


def test_the_third_four_hour_job_due_in_ten_hours_has_its_deadline_priced_and_an_earlier_one_goes_first(
        tmp_path: Path) -> None:
    app = _app(tmp_path)
    first, second, third = (_enqueue(app, tmp_path, f"job-{k}", 10) for k in (1, 2, 3))
    assert [(j["placement"], j["decision"]["local_wait_h"]) for j in (first, second, third)] == [
        ("local", 0.0), ("local", 4.0), ("cloud", 8.0)]
    assert third["decision"]["verdict"] == "priced"
    assert any("local misses (12.00 h after the 8.00 h of local work queued ahead of it > 10.00 h)" in r
               for r in third["decision"]["reasons"])
    assert third["decision"]["hours_saved"] == pytest.approx(12 - 2.5)
    # Each record shows the wait in its gate 2 line.
    assert "w = 4.00 h queued ahead + T_L = 4.00 h = 8.00 h ≤ D = 10.00 h → local" in \
        Path(second["record_path"]).read_text()
    assert "w = 8.00 h queued ahead + T_L = 4.00 h > D = 10.00 h; T_R = 2.50 h ≤ D" in \
        Path(third["record_path"]).read_text()
    # Due sooner, it is ahead of all of them in line: nothing waits before it.
    urgent = _enqueue(app, tmp_path, "urgent", 5)
    assert (urgent["placement"], urgent["decision"]["local_wait_h"]) == ("local", 0.0)
    app.close()


def test_with_no_local_slot_no_job_is_planned_on_the_local_gpu(tmp_path: Path) -> None:
    # daemon.local_concurrency = 0: the daemon would never start it, so a job local makes in time is not queued to
    # wait for ever; gate 1 finds no local option and says why.
    app = _app(tmp_path, "[daemon]\nlocal_concurrency = 0\n")
    job = _enqueue(app, tmp_path, "would-fit", 10)
    app.close()
    assert (job["placement"], job["decision"]["verdict"], job["decision"]["fits_locally"]) == ("cloud", "burst", False)
    assert "Gate 1: does not fit locally (daemon.local_concurrency is 0: the daemon starts no local run)" in \
        job["decision"]["reasons"][0]


def test_a_running_local_job_holds_the_gpu_for_what_it_has_left(tmp_path: Path, db_url: str) -> None:
    # On both stores: the plans' local hours are read in SQL (a JSON path), which each dialect spells its own way.
    app = _app(tmp_path, database_url=db_url)
    running = _enqueue(app, tmp_path, "running", 10)
    now = time.time()
    app.store.update_job(running["id"], None, state="running")
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{running['id']}-a1", job_id=running["id"], n=1, where="local",
                                            state="running", info={}, created_at=now - 3600, started_at=now - 3600))
    assert local_backlog(app, now).wait_h(now + 10 * 3600) == pytest.approx(3.0, abs=1e-3)  # 4 h planned, 1 h run
    # A run is never stopped for a more urgent job: even one due before it waits for what it has left.
    assert local_backlog(app, now).wait_h(now + 3600) == pytest.approx(3.0, abs=1e-3)
    assert local_backlog(app, now).wait_h(now + 10 * 3600, exclude=running["id"]) == 0.0
    app.close()
    two_slots = _app(tmp_path, "[daemon]\nlocal_concurrency = 2\n", database_url=db_url)
    assert local_backlog(two_slots, now).wait_h(now + 10 * 3600) == 0.0  # the other slot is free: it starts now
    two_slots.close()


def test_with_several_slots_each_job_in_line_starts_on_the_first_one_free() -> None:
    # Two slots: a run with 3 h left, then in line a 4-hour job due first. It starts now on the free slot; a job
    # behind it starts when the run ends, in 3 h (the work shared evenly would say 3.5 h).
    backlog = LocalBacklog.of([("run", 50.0, 3.0, True), ("first", 10.0, 4.0, False)], slots=2)
    assert backlog.wait_h(5.0) == 0.0 and backlog.wait_h(20.0) == 3.0
    assert backlog.wait_h(20.0, exclude="run") == 0.0 and backlog.wait_h(10.0, exclude="first") == 0.0
    one_slot = LocalBacklog.of([("run", 50.0, 3.0, True), ("first", 10.0, 4.0, False)], slots=1)
    assert one_slot.wait_h(20.0) == 7.0 and one_slot.wait_h(10.0, exclude="first") == 3.0


def test_a_job_resumed_locally_holds_the_gpu_for_the_units_it_has_left_not_its_whole_plan(tmp_path: Path,
                                                                                          db_url: str) -> None:
    # A machine rebooted three quarters into a 4-hour run: the job resumes from its checkpoint, with 1 h left. Counted
    # as its whole plan, the 3 h it no longer needs would push the jobs behind it to the cloud.
    app = _app(tmp_path, database_url=db_url)
    resumed = _enqueue(app, tmp_path, "resumed", 6)
    now = time.time()
    app.store.update_job(resumed["id"], None, state="resuming")
    with app.store.tx() as c:
        for n, metrics in ((1, {"units_done": 3.0}), (2, {"units_done": "a lot"})):  # the trainer's word, checked
            c.execute(insert(s.attempts).values(id=f"{resumed['id']}-a{n}", job_id=resumed["id"], n=n, where="local",
                                                state="preempted", info={"metrics": metrics}, created_at=now - 4000,
                                                started_at=now - 4000, ended_at=now - 100))
    assert local_backlog(app, now).wait_h(now + 10 * 3600) == pytest.approx(1.0)
    behind = _enqueue(app, tmp_path, "behind", 6)  # 1 h + 4 h <= 6 h: local (counted whole, 8 h: it would burst)
    assert (behind["placement"], behind["decision"]["local_wait_h"]) == ("local", pytest.approx(1.0))
    app.close()


def test_a_job_decided_again_on_the_work_it_had_left_counts_its_units_from_that_decision(tmp_path: Path) -> None:
    app = _app(tmp_path)
    job = _enqueue(app, tmp_path, "retried", 10)
    now = time.time()
    # Retried with 2 of 4 units done: decided on the 2 h left; since then it has reached 3.
    app.store.update_job(job["id"], None, state="resuming",
                         decision={**job["decision"], "work_done": 2.0, "t_local_h": 2.0,
                                   "plan": [{"where": "local", "hours": 2.0, "cost_usd": 0.2}]})
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job['id']}-a1", job_id=job["id"], n=1, where="local",
                                            state="preempted", info={"units_done": 3.0}, created_at=now - 60))
    assert local_backlog(app, now).wait_h(now + 10 * 3600) == pytest.approx(1.0)
    app.close()


def test_a_cloud_job_revert_local_brought_home_holds_the_gpu_for_its_local_hours(tmp_path: Path) -> None:
    app = _app(tmp_path)
    job = _enqueue(app, tmp_path, "reverted", 3.5)  # 4 h local > 3.5 h: it bursts, on spot (room for 2 t_ovh)
    assert job["placement"] == "cloud" and job["decision"]["plan"][0]["where"] == "cloud"
    assert local_backlog(app, time.time()).wait_h(time.time() + 10 * 3600) == 0.0
    app.store.update_job(job["id"], None, placement="local")  # what revert-local does to a queued cloud job
    assert local_backlog(app, time.time()).wait_h(time.time() + 10 * 3600) == pytest.approx(4.0)
    app.close()


def test_decide_says_what_a_job_would_wait_for_the_local_gpu(burstctl, tmp_path: Path) -> None:
    app = _app(tmp_path)
    _enqueue(app, tmp_path, "ahead", 10)
    app.close()
    path = write_job(tmp_path, "what-if", work_units=4, local_throughput=1.0, rented_throughput={"H100": 2.0},
                     deadline_hours=10)
    shown = burstctl("--config", str(tmp_path / "burstctl.toml"), "decide", str(path), "--json")
    assert shown.returncode == 0, shown.stderr
    d = json.loads(shown.stdout)
    assert d["local_wait_h"] == 4.0 and d["verdict"] == "local"
    # The text's gate 2 line is the same sum: the wait, then T_L, against D.
    text = burstctl("--config", str(tmp_path / "burstctl.toml"), "decide", str(path), "--no-record")
    assert "GATE 2: local MAKES the deadline (8.00 h (4.00 h queued ahead + 4.00 h) ≤ 10.00 h)" in text.stdout
    tight = write_job(tmp_path, "tight", work_units=7, local_throughput=1.0, rented_throughput={"H100": 2.0},
                      deadline_hours=10)
    text = burstctl("--config", str(tmp_path / "burstctl.toml"), "decide", str(tight), "--no-record")
    assert "GATE 2: local MISSES the deadline (11.00 h (4.00 h queued ahead + 7.00 h) > 10.00 h)." in text.stdout


def _running(app: App, job: dict, started_ago_h: float = 0.0) -> None:
    """The job holds the local GPU: its local attempt runs (a row, as the local runner writes it)."""
    now = time.time()
    app.store.update_job(job["id"], None, state="running")
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job['id']}-a1", job_id=job["id"], n=1, where="local",
                                            state="running", info={}, created_at=now,
                                            started_at=now - started_ago_h * 3600))


def test_a_queued_job_that_a_more_urgent_one_makes_late_is_decided_again_and_bursts(tmp_path: Path) -> None:
    from orchestrator.lifecycle.reconcile import Reconciler

    app = _app(tmp_path)
    holding = _enqueue(app, tmp_path, "holding", 10)
    _running(app, holding)  # 4 h left on the GPU
    later = _enqueue(app, tmp_path, "later", 10)
    first_record = Path(later["record_path"])
    # The run's 4 h less the moments it has run by now (a loaded machine makes them tenths of a second).
    assert (later["placement"], later["decision"]["local_wait_h"]) == ("local", pytest.approx(4.0, abs=0.01))
    urgent = _enqueue(app, tmp_path, "urgent", 9)  # ahead of `later` in line: 4 + 4 = 8 h, in time
    assert (urgent["placement"], urgent["decision"]["local_wait_h"]) == ("local", pytest.approx(4.0, abs=0.01))

    Reconciler(app, {}, cloud=None).admission.schedule()  # the GPU is held: nothing starts; the line is looked at
    later, urgent = app.store.get_job(later["id"]), app.store.get_job(urgent["id"])
    assert urgent["placement"] == "local"  # 8 h: in time, then; `later` now waits for both
    assert (later["state"], later["placement"]) == ("queued", "cloud")
    assert later["decision"]["local_wait_h"] == pytest.approx(8.0, abs=0.01)
    assert later["decision"]["reasons"][0].startswith("decided again while queued: 8.00 h of local work is now")
    (moved,) = app.store.events(job_id=later["id"], type_prefix="job.redecided")
    assert moved["data"]["why"] == "late in line" and moved["data"]["placement"] == "cloud"
    assert "decided again while queued" in Path(later["record_path"]).read_text()  # a record of its own
    # The first record's run will never be measured there: it says where it will be.
    assert ("- **Measured:** decided again while queued, " in first_record.read_text()
            and f": see {Path(later['record_path']).name}" in first_record.read_text())
    app.close()


def test_a_queued_job_the_cloud_cannot_save_stays_local_and_is_asked_again_later(tmp_path: Path) -> None:
    from orchestrator.lifecycle.reconcile import Reconciler

    app = _app(tmp_path)
    holding = _enqueue(app, tmp_path, "holding", 10)
    _running(app, holding)
    path = write_job(tmp_path, "slow-rented", work_units=4, local_throughput=1.0, rented_throughput={"H100": 0.1},
                     deadline_hours=9)
    stuck = app.store.get_job(enqueue(app, path)[0])
    _enqueue(app, tmp_path, "urgent", 8.5)  # ahead of it: 4 + 4 + 4 = 12 h > 9 h, and 40 h rented
    rec = Reconciler(app, {}, cloud=None)
    rec.admission.schedule()
    stuck = app.store.get_job(stuck["id"])
    assert stuck["placement"] == "local" and stuck["spec"]["_late_in_line_at"] > 0
    assert app.store.events(job_id=stuck["id"], type_prefix="job.redecided") == []
    app.close()


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(-1, 10), st.booleans()), max_size=30),
       st.floats(0, 110), st.integers(1, 3), st.integers(-1, 29))
def test_the_wait_is_until_the_runs_and_the_jobs_due_no_later_leave_a_slot_free(
        jobs: list[tuple[float, float, bool]], deadline: float, slots: int, excluded: int) -> None:
    rows = [(f"j{k}", at, hours, running) for k, (at, hours, running) in enumerate(jobs)]
    exclude = f"j{excluded}"
    runs = [hours for job_id, at, hours, running in rows if hours > 0 and running and job_id != exclude]
    line = [hours for at, hours in sorted((at, hours) for job_id, at, hours, running in rows
                                          if hours > 0 and not running and at <= deadline and job_id != exclude)]
    # Walked as it happens: each job in line starts at the first moment, no earlier than the one before it, when
    # fewer than `slots` runs are going.
    ends, start = list(runs), 0.0
    for hours in [*line, None]:
        start = min(t for t in [0.0, *ends] if t >= start and sum(e > t for e in ends) < slots)
        if hours is not None:
            ends.append(start + hours)
    assert LocalBacklog.of(rows, slots).wait_h(deadline, exclude) == pytest.approx(start, abs=1e-9)
    if slots == 1:  # one slot: the work of the runs and of the line, one after the other (a run is never stopped)
        assert start == pytest.approx(max(runs, default=0.0) + sum(line), abs=1e-9)
