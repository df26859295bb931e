"""What the budget holds for an admitted job follows the market it runs on. `burstctl decide` may choose spot, and
the daemon's spot policy then launch the job (or move it) on on-demand, at three times the price: from then on the
job holds the rest of its run at that price, which the next job's decision, `burstctl budget` and `burstctl status`
all count. A job decided again after it has spent holds its new plan (the work left) whole. Checked against the
real store, simcloud's offers and the daemon's own reconciler."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sqlalchemy import insert

from orchestrator.app import App
from orchestrator.cli import main
from orchestrator.cli.status import status_data
from orchestrator.core.budget import Launch, held_on_market, month_key
from orchestrator.holds import held_by_plans
from orchestrator.lifecycle import checkpoints
from orchestrator.lifecycle.cloud_steps import CloudSteps
from orchestrator.lifecycle.reconcile import Reconciler
from orchestrator.queue import enqueue, record_offers_seen
from providers.lambda_cloud import LambdaCloud
from providers.simcloud.api import SimCloudServer
from runbooks.burst_checkpoint import write_checkpoint
from state import schema as s
from tests.conftest import write_job

SIM_SPOT_USD_H, SIM_ON_DEMAND_USD_H = 1.00, 3.29  # simcloud's 1×H100


def test_a_job_on_a_market_holds_what_it_has_spent_and_the_rest_of_its_run_at_that_market_s_rate() -> None:
    rest = Launch(rate_usd_h=3.29, hours=2.0, minimum_s=60.0, horizon_h=0.04)
    # The stop is not in it: every running instance's is kept apart (`Spending.kept_usd`).
    assert held_on_market(1.5, rest) == pytest.approx(1.5 + 3.29 * 2.0)
    assert held_on_market(0.0, Launch(1.0, 2.0)) == pytest.approx(2.0)  # the same rest on spot: a third of it
    # A rest shorter than the billing minimum is billed the minimum.
    assert held_on_market(0.0, Launch(3.29, 10 / 3600, minimum_s=60.0)) == pytest.approx(3.29 / 60)


def test_a_spot_plan_the_spot_policy_launches_on_demand_holds_the_on_demand_price_of_its_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 2 h of H100 work due in 2.6 h: spot ($2.14 with its expected rework, against $6.91 on-demand) leaves room for
    # a preemption when decided. The job then waits in line 0.45 h: at its launch the slack (0.15 h) no longer
    # covers two changeovers, and the spot policy launches it on on-demand. Its hold had stayed the spot plan's,
    # a third of what it runs up, and a second job was admitted against money the first will spend.
    (tmp_path / "burstctl.toml").write_text(
        "[budget]\nmonthly_cap_usd = 10.0\n[policy]\noverhead_h = 0.1\nmax_auto_delta_usd = 50.0\n")
    config = str(tmp_path / "burstctl.toml")
    app = App(config_path=config, state_dir_override=str(tmp_path / "state"))
    with SimCloudServer(api_key="sim-holds-key") as sim:
        provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key="sim-holds-key",
                               regions=("us-east-1", "us-west-1"), request_interval_s=0.0)
        record_offers_seen(app, "sim", provider.offers(), time.time())  # decided at the price the launch pays
        queued_at = time.time() - 0.45 * 3600
        job_id, decided, _ = enqueue(app, write_job(tmp_path, "tight", local_throughput=0, work_units=2,
                                                    rented_throughput={"H100": 1.0}, deadline_hours=2.6), queued_at)
        assert decided.action == "burst" and decided.market is not None and decided.market.market == "spot"
        assert decided.plan is not None
        (cloud,) = decided.plan.phases
        assert held_by_plans(app, time.time()).usd == pytest.approx(SIM_SPOT_USD_H * cloud.hours, abs=1e-3)

        rec = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}))
        rec.admission.schedule()  # the daemon's launch: its intent, then the instance
        (intent,) = [e["data"] for e in app.store.events(job_id=job_id) if e["type"] == "attempt.intent"]
        assert intent["market"] == "on-demand" and intent["market_policy"]["choice"] == "on-demand", intent
        assert [i.instance_type for i in sim.instances()] == ["gpu_1x_h100_sxm5"]  # not its "_spot" twin
        on_demand = SIM_ON_DEMAND_USD_H * cloud.hours  # nothing spent before: the whole run, at the launch's price
        # Less what the instance has cost since its launch, seconds ago; the intent's trail says the hold.
        assert held_by_plans(app, time.time()).usd == pytest.approx(on_demand, abs=0.02)
        assert intent.get("hold_usd") == pytest.approx(on_demand, abs=1e-3)

        # The next decision counts it: $3.74 (1.1 h on-demand and its stop) fits beside the spot plan's $2.14, not
        # beside the $7.03 the first job will spend.
        second_id, second, _ = enqueue(app, write_job(tmp_path, "second", local_throughput=0, work_units=1,
                                                      rented_throughput={"H100": 1.0}, market="on-demand"))
        assert second.action == "blocked" and app.store.get_job(second_id)["state"] == "blocked"
        said = second.reasons[-1]
        assert said.endswith(" held for 1 other admitted job)"), said
        assert float(said.rsplit("$", 1)[1].split()[0]) == pytest.approx(on_demand, abs=0.02), said

        # `status` and `budget` say the same hold, and a process that starts afresh (a daemon restarted, the CLI)
        # reads it from the state: nothing of it is only in a daemon's memory.
        rec.close()
        app.close()
        again = App(config_path=config, state_dir_override=str(tmp_path / "state"))
        shown = status_data(again)
        again.close()
        assert (shown["held_usd"], shown["held_jobs"]) == (pytest.approx(on_demand, abs=0.02), 1)
        capsys.readouterr()
        assert main(["--config", config, "--state-dir", str(tmp_path / "state"), "budget", "--json"]) == 0
        budget = json.loads(capsys.readouterr().out)
        assert (budget["held_usd"], budget["held_jobs"]) == (pytest.approx(shown["held_usd"], abs=0.002), 1)
        assert main(["--config", config, "--state-dir", str(tmp_path / "state"), "status"]) == 0
        assert " held for 1 admitted job (`burstctl budget`)" in capsys.readouterr().out
        provider.close()


def test_a_job_decided_again_after_spending_holds_its_new_plan_whole(tmp_path: Path) -> None:
    # 80 % done on the cloud ($4.00 spent, that checkpoint home), its relaunches refused, then decided again on the
    # 0.2 unit left: $5.04 on-demand. What it spent before was taken off that new plan too, and it held $1.04.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "ran", local_throughput=0, rented_throughput={"H100": 0.17},
                                          market="on-demand"))
    write_checkpoint(checkpoints.store_dir(app.config, job_id), "step-00000800", {"state.json": b"{}"})
    now = time.time()
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state="preempted",
                                            provider="sim", instance_type="x", market="on-demand",
                                            created_at=now - 7200, info={"metrics": {"units_done": 0.8}}))
        c.execute(insert(s.ledger).values(month=month_key(now), job_id=job_id, attempt_id=f"{job_id}-a1",
                                          provider="sim", instance_type="x", market="on-demand", rate_usd_h=3.0,
                                          started_at=now - 7200, ended_at=now - 3600, cost_usd=4.0))
    rec = Reconciler(app, {}, cloud=None)
    rec.admission._block(app.store.get_job(job_id), "3 launches failed in a row (NoCapacity)")
    rec.admission._redecide_blocked(time.time())
    job = app.store.get_job(job_id)
    assert job["state"] == "queued" and job["decision"]["work_done"] == 0.8, job["reason"]
    plan_usd = job["decision"]["plan_cost_usd"]
    assert plan_usd == pytest.approx(3.0 * (0.2 / 0.17 + 0.5), abs=1e-3)
    assert held_by_plans(app, time.time()).usd == pytest.approx(plan_usd, abs=1e-3)
    rec.close()
    app.close()
