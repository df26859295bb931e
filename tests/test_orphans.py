"""An instance of ours that no attempt drives is terminated, and metered like any other: from when it started until
the provider confirms it gone. Before, the daemon's sweep and revert-local terminated orphans without a charge, so
what one had cost never reached the month's spend or the cap."""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import insert

from orchestrator.app import App
from orchestrator.core.budget import month_key
from orchestrator.lifecycle import revert
from orchestrator.lifecycle.cloud_steps import CloudSteps
from orchestrator.lifecycle.reconcile import Reconciler
from orchestrator.queue import enqueue
from providers.base import LaunchRequest, Market, OwnerTags, RetryPolicy
from providers.lambda_cloud import LambdaCloud
from providers.simcloud.api import SimCloudServer
from state import schema as s
from tests.conftest import write_job

KEY = "sim-orphans-key"
PUBKEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBurstctlTestKeyForSimcloudOnly000000000000 test@burstctl"
H100 = "gpu_1x_h100_sxm5"


def _launch_behind_our_back(provider: LambdaCloud, owner: str, job_id: str, attempt_id: str) -> str:
    """An instance tagged as ours, launched for `attempt_id`, whose id the database never learnt."""
    return provider.launch(LaunchRequest(instance_type=H100, market=Market.ON_DEMAND,
                                         tags=OwnerTags(orchestrator=owner, job_id=job_id, attempt_id=attempt_id),
                                         idempotency_key=attempt_id, ssh_public_key=PUBKEY)).id


def _given_up_attempt(app: App, job_id: str, created_at: float, rate: float) -> str:
    """An attempt that ended before it learnt its instance (its launch's answer was lost, say)."""
    attempt_id = f"{job_id}-a1"
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(
            id=attempt_id, job_id=job_id, n=1, where="cloud", state="launch_failed", provider="sim",
            instance_type=H100, market="on-demand", info={"rate_usd_h": rate, "billing_minimum_s": 60.0},
            created_at=created_at, reason="launch outcome unknown"))
    return attempt_id


def test_the_sweep_meters_an_orphan_from_its_attempts_start_until_it_is_confirmed_gone(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "lost", local_throughput=0, market="on-demand"))
    started = time.time() - 1800  # Lambda's API gives no launch time: its attempt began half an hour ago
    attempt_id = _given_up_attempt(app, job_id, started, rate=2.49)
    with SimCloudServer(api_key=KEY) as sim:
        provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key=KEY, regions=("us-east-1",),
                               request_interval_s=0.0, orchestrator_id=app.orchestrator_id)
        orphan = _launch_behind_our_back(provider, app.orchestrator_id, job_id, attempt_id)
        rec = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}))

        assert rec.sweep() == {"sim": [orphan]}
        assert [i.status for i in sim.instances()] == ["terminated"]
        (charge,) = app.store.ledger_rows()
        assert (charge["instance_id"], charge["job_id"], charge["attempt_id"]) == (orphan, job_id, attempt_id)
        assert (charge["rate_usd_h"], charge["started_at"]) == (2.49, started)
        assert charge["ended_at"] is not None  # confirmed gone in the same sweep: closed
        assert abs(charge["cost_usd"] - 2.49 * (charge["ended_at"] - started) / 3600) < 1e-9
        assert app.store.month_spend(month_key(time.time())) >= 2.49 / 2
        (event,) = [e for e in app.store.events() if e["type"] == "instance.orphan_terminated"]
        assert (event["data"]["reason"], event["data"]["metered_from"]) == ("attempt launch_failed", started)

        assert rec.sweep() == {}  # gone: nothing more to do, and no second charge
        assert len(app.store.ledger_rows()) == 1
        provider.close()
    app.close()


def test_an_orphan_no_attempt_knows_is_billed_at_its_offers_rate_from_when_it_was_found(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    with SimCloudServer(api_key=KEY) as sim:
        provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key=KEY, regions=("us-east-1",),
                               request_interval_s=0.0, orchestrator_id=app.orchestrator_id)
        (offer,) = [o for o in provider.offers() if o.instance_type == H100]
        orphan = _launch_behind_our_back(provider, app.orchestrator_id, "j-from-an-old-state", "j-old-a3")
        found = time.time()
        Reconciler(app, {"sim": provider}, cloud=None).sweep()
        (charge,) = app.store.ledger_rows()
        assert (charge["instance_id"], charge["job_id"], charge["attempt_id"]) == (orphan, "j-from-an-old-state", None)
        assert charge["rate_usd_h"] == offer.on_demand_usd_h
        assert found <= charge["started_at"] <= charge["ended_at"]
        assert charge["billed_seconds"] == 60.0  # the billing minimum: nothing says it ran longer
        provider.close()
    app.close()


def test_revert_local_meters_the_orphans_it_terminates(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "lost", local_throughput=0, market="on-demand"))
    started = time.time() - 600
    attempt_id = _given_up_attempt(app, job_id, started, rate=2.49)
    with SimCloudServer(api_key=KEY) as sim:
        provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key=KEY, regions=("us-east-1",),
                               request_interval_s=0.0, orchestrator_id=app.orchestrator_id)
        orphan = _launch_behind_our_back(provider, app.orchestrator_id, job_id, attempt_id)
        report = revert.revert_local(app, Reconciler(app, {"sim": provider}, cloud=None), timeout_s=10)
        assert [(r.instance, r.terminated) for r in report.rows] == [(orphan, "yes")]
        (charge,) = app.store.ledger_rows()
        assert (charge["instance_id"], charge["started_at"], charge["rate_usd_h"]) == (orphan, started, 2.49)
        assert charge["cost_usd"] >= 2.49 * 600 / 3600
        provider.close()
    app.close()


def test_a_provider_the_sweep_cannot_list_is_said_once_an_outage_not_every_sweep(tmp_path: Path) -> None:
    # A key refused for a day was said at every sweep (every 120 s: 720 provider.unreachable events a day). It is said
    # once, again for another kind of error or after a sweep that listed the provider, and not again by a daemon
    # restarted meanwhile.
    app = App(state_dir_override=str(tmp_path / "state"))
    with SimCloudServer(api_key=KEY) as sim:
        provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key=KEY, regions=("us-east-1",),
                               request_interval_s=0.0, orchestrator_id=app.orchestrator_id,
                               retry=RetryPolicy(attempts=2, initial_s=0.01, max_wait_s=0.01))

        def said() -> list[str]:
            return [e["data"]["error"] for e in app.store.events() if e["type"] == "provider.unreachable"]

        def sweeps(n: int) -> None:
            for _ in range(n):  # a new reconciler each time: what was said is in the database, not in memory
                assert Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider})).sweep() == {}

        sim.inject("invalid-key", count=1000)
        sweeps(3)
        assert said() == ["AuthFailed"]
        sim.clear_faults()
        sim.inject("server-error", count=1000)
        sweeps(2)
        assert said() == ["AuthFailed", "Transient"]  # another kind of error
        sim.clear_faults()
        sweeps(1)  # listed: the outage is over
        sim.inject("invalid-key", count=1000)
        sweeps(2)
        assert said() == ["AuthFailed", "Transient", "AuthFailed"]
        provider.close()
    app.close()
