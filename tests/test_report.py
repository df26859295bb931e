"""`burstctl report`: each finished job's plan beside what the meter says it cost and took, and the window's sums.

The jobs are queued for real (their decisions are the decision core's); their runs are written as the daemon
writes them: attempts, and charges in the ledger opened and closed.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import insert, update

from orchestrator import records
from orchestrator.app import App
from orchestrator.lifecycle import checkpoints
from orchestrator.lifecycle.reconcile import Reconciler
from orchestrator.lifecycle.revert import revert_local
from orchestrator.queue import context, enqueue, redecide, retry
from runbooks import burst_checkpoint
from state import schema as s
from tests.conftest import write_job

# The runs start 4 h ago (all over before now); the month is theirs, and "last month" the one before it.
T0 = time.time() - 4 * 3600
MONTH = datetime.fromtimestamp(T0, UTC).strftime("%Y-%m")
LAST_MONTH = datetime.fromtimestamp(T0, UTC).replace(day=1, hour=0, minute=0).timestamp() - 86400.0
CONFIG = """
[local]
board_power_w = 400
electricity_usd_per_kwh = 0.25   # $0.10/h
[prices.H100]
on_demand_usd_h = 3.00
spot_usd_h = 1.00
vram_gib = 80
"""


class Lab:
    def __init__(self, tmp: Path, cli: Callable[..., subprocess.CompletedProcess[str]]) -> None:
        self.cli = cli
        self.tmp = tmp
        self.config = tmp / "burstctl.toml"
        self.config.write_text(CONFIG)
        self.state = tmp / "state"
        self.app = App(config_path=str(self.config), state_dir_override=str(self.state))
        self.t0 = T0

    def job(self, name: str, **fields: object) -> str:
        job_id, _, _ = enqueue(self.app, write_job(self.tmp, name, **fields))
        return job_id

    def attempt(self, job_id: str, n: int, where: str, state: str, start_h: float, hours: float,
                market: str | None = None, charge_usd: float | None = None, at: float | None = None) -> None:
        base = self.t0 if at is None else at
        started, ended = base + start_h * 3600, base + (start_h + hours) * 3600
        with self.app.store.tx() as c:
            c.execute(insert(s.attempts).values(
                id=f"{job_id}-a{n}", job_id=job_id, n=n, where=where, state=state, info={}, created_at=started,
                started_at=started, ended_at=ended, market=market, provider=None if where == "local" else "sim",
                instance_type=None if where == "local" else "gpu_1x_h100"))
        if charge_usd is not None:
            charge = self.app.store.open_charge({
                "month": datetime.fromtimestamp(started, UTC).strftime("%Y-%m"), "job_id": job_id,
                "attempt_id": f"{job_id}-a{n}", "provider": "sim", "instance_type": "gpu_1x_h100", "market": market,
                "rate_usd_h": charge_usd / hours, "started_at": started})
            self.app.store.close_charge(charge, ended_at=ended, billed_seconds=hours * 3600, cost_usd=charge_usd)

    def finish(self, job_id: str, state: str, end_h: float, deadline_h: float, at: float | None = None) -> None:
        base = self.t0 if at is None else at
        with self.app.store.tx() as c:
            c.execute(update(s.jobs).where(s.jobs.c.id == job_id).values(
                state=state, updated_at=base + end_h * 3600, deadline_at=base + deadline_h * 3600))

    def report(self, *args: str) -> dict:
        r = self.cli("--config", str(self.config), "--state-dir", str(self.state), "report", *args, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


@pytest.fixture
def lab(tmp_path: Path, burstctl_here: Callable[..., subprocess.CompletedProcess[str]]):
    lab = Lab(tmp_path, burstctl_here)
    yield lab
    lab.app.close()


def test_each_finished_job_is_set_beside_its_plan_and_the_month_is_summed(lab: Lab) -> None:
    # Does not fit locally: bursts on spot, planned at W / s_R + t_ovh = 2 / 1.0 + 0.5 = 2.5 h. It was preempted after
    # 1 h and resumed for 1.5 h more: $2.50 of spot, and it finished 2 h before its deadline.
    spot = lab.job("spot-job", local_throughput=0, rented_throughput={"H100": 1.0}, work_units=2,
                   checkpoint={"resumable": True, "interval_minutes": 10})
    lab.attempt(spot, 1, "cloud", "preempted", 0, 1.0, market="spot", charge_usd=1.0)
    lab.attempt(spot, 2, "cloud", "succeeded", 1.0, 1.5, market="spot", charge_usd=1.5)
    lab.finish(spot, "done", end_h=2.5, deadline_h=4.5)
    # Fits and meets its deadline locally: planned 1 / 0.5 = 2 h at $0.10/h; ran 3 h and finished 1 h late.
    local = lab.job("local-job", local_throughput=0.5, deadline_hours=12)
    lab.attempt(local, 1, "local", "succeeded", 0, 3.0)
    lab.finish(local, "done", end_h=3.0, deadline_h=2.0)
    # Failed after half an hour on-demand: spent, but compared with nothing.
    failed = lab.job("failed-job", local_throughput=0, rented_throughput={"H100": 1.0}, market="on-demand")
    lab.attempt(failed, 1, "cloud", "failed", 0, 0.5, market="on-demand", charge_usd=1.5)
    lab.finish(failed, "failed", end_h=0.5, deadline_h=10)
    # Cancelled in the queue, and finished last month: not this month's report.
    lab.finish(lab.job("never-ran"), "cancelled", end_h=0.1, deadline_h=10)
    old = lab.job("old-job", local_throughput=0.5, deadline_hours=12)
    lab.attempt(old, 1, "local", "succeeded", 0, 2.0, at=LAST_MONTH)
    lab.finish(old, "done", end_h=2.0, deadline_h=5.0, at=LAST_MONTH)

    got = lab.report("--month", MONTH)
    assert got["window"]["label"] == MONTH
    jobs = {j["name"]: j for j in got["jobs"]}
    assert list(jobs) == ["local-job", "spot-job", "failed-job"]  # newest first; the cancelled one never ran
    s_job = jobs["spot-job"]
    plan = lab.app.store.get_job(spot)["decision"]  # the plan it ran on: 2.5 h and the expected preemptions' rework
    assert (s_job["plan"], s_job["expected_usd"]) == ("burst spot", plan["plan_cost_usd"])
    assert s_job["expected_h"] == pytest.approx(sum(p["hours"] for p in plan["plan"]), abs=1e-4) == pytest.approx(
        2.5, abs=0.1)
    assert (s_job["measured_usd"], s_job["run_h"], s_job["attempts"], s_job["preemptions"]) == (2.5, 2.5, 2, 1)
    assert s_job["spot_saved_usd"] == pytest.approx(2.5 * 3.00 - 2.5)  # its 2.5 h at on-demand's $3.00/h, less $2.50
    assert (s_job["late_h"], s_job["deadline_met"]) == (pytest.approx(-2.0), True)
    l_job = jobs["local-job"]
    assert (l_job["plan"], l_job["expected_h"], l_job["expected_usd"]) == ("local", 2.0, pytest.approx(0.2))
    assert (l_job["measured_usd"], l_job["local_h"]) == (pytest.approx(0.3), 3.0)
    assert (l_job["late_h"], l_job["deadline_met"], l_job["spot_saved_usd"]) == (pytest.approx(1.0), False, None)
    f_job = jobs["failed-job"]
    assert (f_job["plan"], f_job["on_demand_usd"], f_job["deadline_met"]) == ("burst on-demand", 1.5, None)

    t = got["totals"]
    assert (t["jobs"], t["done"], t["failed"], t["cancelled"]) == (3, 2, 1, 0)
    assert (t["spent_usd"], t["cloud_usd"], t["spot_usd"], t["on_demand_usd"], t["local_usd"]) == (
        pytest.approx(4.3), 4.0, 2.5, 1.5, pytest.approx(0.3))
    assert t["spot_saved_usd"] == pytest.approx(5.0)
    assert t["done_measured_usd"] == pytest.approx(2.8)  # the done jobs only
    spot_ratio = round(2.5 / s_job["expected_h"], 3)
    assert t["hours_ratio"] == {"median": round((spot_ratio + 1.5) / 2, 3), "min": spot_ratio, "max": 1.5, "jobs": 2}
    assert t["cost_ratio"]["max"] == pytest.approx(1.5, abs=1e-3) and t["cost_ratio"]["jobs"] == 2
    assert (t["deadlines_met"], t["deadlines_missed"], t["attempts"], t["preemptions"]) == (1, 1, 4, 1)

    assert [j["name"] for j in lab.report("--all")["jobs"]] == ["local-job", "spot-job", "failed-job", "old-job"]
    last_month = datetime.fromtimestamp(LAST_MONTH, UTC).strftime("%Y-%m")
    assert [j["name"] for j in lab.report("--month", last_month)["jobs"]] == ["old-job"]
    assert [j["name"] for j in lab.report("--days", "1")["jobs"]] == ["local-job", "spot-job", "failed-job"]



def test_a_local_plan_through_the_gpu_s_hours_is_set_beside_the_hours_it_ran_not_its_wall_clock(
        lab: Lab) -> None:
    # The GPU is open 6 h a day. An 8 h local run (W 4 / s_L 0.5) is planned over the wall clock to its end, a night
    # included; the meter counts the hours it ran (a run paused while the GPU is closed has none). Planned 8 h, ran
    # 8 h in two sittings a day apart: measured / expected is 1, not 8 h against the plan's wall clock.
    lab.app.close()
    now = datetime.now()
    window = f"{now - timedelta(hours=1):%H:%M}-{now + timedelta(hours=5):%H:%M}"
    lab.config.write_text(CONFIG.replace("[local]\n", f'[local]\navailable_hours = ["{window}"]\n'))
    lab.app = App(config_path=str(lab.config), state_dir_override=str(lab.state))
    nightly = lab.job("nightly", local_throughput=0.5, work_units=4, deadline_hours=72,
                      checkpoint={"resumable": True, "interval_minutes": 10})
    decision = lab.app.store.get_job(nightly)["decision"]
    assert decision["plan"][0]["where"] == "local" and decision["plan"][0]["hours"] > 20  # through a night
    two_days_ago = lab.t0 - 48 * 3600
    lab.attempt(nightly, 1, "local", "succeeded", 0, 5.0, at=two_days_ago)
    lab.attempt(nightly, 2, "local", "succeeded", 24.0, 3.0, at=two_days_ago)
    lab.finish(nightly, "done", end_h=27.0, deadline_h=72, at=two_days_ago)
    (got,) = lab.report("--all")["jobs"]
    assert got["expected_h"] == pytest.approx(8.0, abs=0.01)  # W / s_L: the hours it runs
    assert got["run_h"] == pytest.approx(8.0)


def test_the_table_says_the_same_in_words(lab: Lab) -> None:
    spot = lab.job("spot-job", local_throughput=0, rented_throughput={"H100": 1.0}, work_units=2)
    lab.attempt(spot, 1, "cloud", "succeeded", 0, 2.5, market="spot", charge_usd=2.5)
    lab.finish(spot, "done", end_h=2.5, deadline_h=4.5)
    r = lab.cli("--config", str(lab.config), "--state-dir", str(lab.state), "report", "--days", "1")
    assert r.returncode == 0, r.stderr
    assert "the last 1 days: 1 job finished (1 done)" in r.stdout
    assert "met, 2.00 h to spare" in r.stdout and " h → 2.50 h " in r.stdout
    assert "$2.50: cloud $2.50 (spot $2.50, on-demand $0.00), local $0.00" in r.stdout
    assert re.search(r"spot saved against on-demand +│ \$5\.00 ", r.stdout)
    empty = lab.cli("--config", str(lab.config), "--state-dir", str(lab.state), "report", "--month", "2020-01")
    assert empty.stdout.strip() == "no job finished in 2020-01"
    this_month = lab.cli("--config", str(lab.config), "--state-dir", str(lab.state), "report", "--json")
    assert json.loads(this_month.stdout)["window"]["label"] == datetime.now(UTC).strftime("%Y-%m")  # the default


def test_a_job_decided_again_on_the_way_is_set_beside_the_plan_it_was_queued_on_too(lab: Lab) -> None:
    # Queued local (2 h at $0.10/h, $0.20); it failed after an hour, and was retried with a deadline local cannot
    # make: it burst on spot and finished there. Its plan now is the burst's; what was promised when it was queued
    # was $0.20, and the report says both.
    job_id = lab.job("moved", local_throughput=0.5, rented_throughput={"H100": 4.0}, deadline_hours=12)
    lab.attempt(job_id, 1, "local", "failed", 0, 1.0)
    lab.finish(job_id, "failed", end_h=1.0, deadline_h=12)
    again = retry(lab.app, lab.app.store.get_job(job_id), deadline_at=time.time() + 1.8 * 3600)
    assert again.decision["plan_kind"] == "burst" and again.decision["decisions"] == 2
    lab.attempt(job_id, 2, "cloud", "succeeded", 1.5, 1.5, market="spot", charge_usd=1.5)
    lab.finish(job_id, "done", end_h=3.0, deadline_h=3.5)

    got = lab.report("--days", "1")
    (moved,) = got["jobs"]
    assert (moved["plan"], moved["expected_usd"]) == ("burst spot", again.decision["plan_cost_usd"])
    assert (moved["first_plan"], moved["first_expected_usd"], moved["first_expected_h"], moved["decisions"]) == (
        "local", pytest.approx(0.2), pytest.approx(2.0), 2)
    t = got["totals"]
    assert (t["decided_again"], t["done_first_expected_usd"]) == (1, pytest.approx(0.2))
    assert t["done_expected_usd"] == pytest.approx(again.decision["plan_cost_usd"])
    r = lab.cli("--config", str(lab.config), "--state-dir", str(lab.state), "report", "--days", "1")
    assert "burst spot (queued as local $0.20; 2 decisions)" in r.stdout
    assert re.search(r"done jobs: expected when queued +│ \$0\.20 \(1 job decided again on the way\)", r.stdout)


def test_a_job_revert_local_brought_home_says_so_and_is_not_set_beside_a_plan_it_did_not_run_on(lab: Lab) -> None:
    # Planned on spot (1.5 h, about $1.50); an hour of it ran, then revert-local brought it home and it finished on
    # the local GPU in 3 h more. Its cloud plan stays its decision (burst-enable would restore it), but the run was
    # not that plan's: it is not in measured / expected. A local job beside it is, as before.
    home = lab.job("came-home", local_throughput=0.5, rented_throughput={"H100": 2.0}, work_units=2,
                   deadline_hours=3, checkpoint={"resumable": True, "interval_minutes": 10})
    assert lab.app.store.get_job(home)["decision"]["placement"] == "cloud"
    revert_local(lab.app, Reconciler(lab.app, {}, cloud=None), timeout_s=5)
    assert lab.app.store.get_job(home)["placement"] == "local"
    lab.attempt(home, 1, "cloud", "preempted", 0, 1.0, market="spot", charge_usd=1.0)
    lab.attempt(home, 2, "local", "succeeded", 1.0, 3.0)
    lab.finish(home, "done", end_h=4.0, deadline_h=3.0)
    local = lab.job("local-job", local_throughput=0.5, deadline_hours=12)
    lab.attempt(local, 1, "local", "succeeded", 0, 3.0)
    lab.finish(local, "done", end_h=3.0, deadline_h=5.0)

    got = lab.report("--days", "1")
    jobs = {j["name"]: j for j in got["jobs"]}
    assert (jobs["came-home"]["plan"], jobs["came-home"]["reverted_local"]) == ("burst spot", True)
    assert (jobs["came-home"]["measured_usd"], jobs["came-home"]["deadline_met"]) == (pytest.approx(1.3), False)
    assert jobs["local-job"]["reverted_local"] is False
    t = got["totals"]
    assert (t["reverted_local"], t["done"], t["deadlines_met"], t["deadlines_missed"]) == (1, 2, 1, 1)
    assert (t["cost_ratio"]["jobs"], t["hours_ratio"]["jobs"]) == (1, 1)  # the local job's only
    assert (t["done_expected_usd"], t["done_measured_usd"]) == (pytest.approx(0.2), pytest.approx(0.3))
    assert t["spent_usd"] == pytest.approx(1.6)  # what was spent is all of it
    r = lab.cli("--config", str(lab.config), "--state-dir", str(lab.state), "report", "--days", "1")
    assert "burst spot → local (revert-local)" in r.stdout
    assert re.search(r"brought home by revert-local +│ 1 \(their runs are not set beside", r.stdout)

def test_a_job_decided_again_with_work_done_is_not_set_beside_its_whole_run(lab: Lab) -> None:
    # On spot, planned 1.5 h; half its work ran (0.75 h, its checkpoint home), then it was decided again, as the
    # daemon does an unblocked job: on the half left. That decision prices 0.75 h; the meter measures the whole
    # run, 1.5 h. Set side by side they would say ×2 where the plan was right: it is counted apart.
    job_id = lab.job("halfway", local_throughput=0, rented_throughput={"H100": 2.0}, work_units=3, deadline_hours=12,
                     checkpoint={"resumable": True, "interval_minutes": 10})
    lab.attempt(job_id, 1, "cloud", "preempted", 0, 0.75, market="spot", charge_usd=0.75)
    with lab.app.store.tx() as c:
        c.execute(update(s.attempts).where(s.attempts.c.id == f"{job_id}-a1").values(
            info={"metrics": {"units_done": 1.5}}))
    burst_checkpoint.write_checkpoint(checkpoints.store_dir(lab.app.config, job_id), "step-00000050", {"w": b"w"})
    job = lab.app.store.get_job(job_id)
    again = redecide(lab.app, job, context(lab.app, time.time()), time.time())
    assert again.decision["work_done"] == pytest.approx(1.5)  # what redecide writes down
    lab.app.store.update_job(job_id, decision=records.supersede(job["decision"], again.decision))
    lab.attempt(job_id, 2, "cloud", "succeeded", 1.0, 0.75, market="spot", charge_usd=0.75)
    lab.finish(job_id, "done", end_h=1.75, deadline_h=12)

    got = lab.report("--days", "1")
    (halfway,) = got["jobs"]
    assert halfway["decided_midway"] is True and halfway["run_h"] == pytest.approx(1.5)
    t = got["totals"]
    assert (t["decided_midway"], t["cost_ratio"], t["hours_ratio"]) == (1, None, None)
    r = lab.cli("--config", str(lab.config), "--state-dir", str(lab.state), "report", "--days", "1")
    assert "decided again with work done" in r.stdout



@pytest.mark.parametrize(("args", "expected"), [
    (["--month", "2026-13"], "field '--month': expected a month as YYYY-MM"),
    (["--month", "december"], "field '--month': expected a month as YYYY-MM"),
    (["--month", "0000-01"], "field '--month': expected a month from 1970-01 to 9998-12"),  # had crashed
    (["--month", "9999-12"], "field '--month': expected a month from 1970-01 to 9998-12"),
    (["--days", "0"], "field '--days': expected a number of days above 0, got 0"),
    (["--days", "nan"], "field '--days': expected a number of days above 0"),
    (["--month", "2026-11", "--all"], "give one of --month, --days and --all"),
])
def test_a_bad_window_is_one_line_and_exit_2(lab: Lab, args: list[str], expected: str) -> None:
    r = lab.cli("--config", str(lab.config), "--state-dir", str(lab.state), "report", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    [line] = r.stderr.strip().splitlines()
    assert expected in line
