"""Rules of the reconciler that need no cloud: they are checked in-process against its real store."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select, update

from orchestrator.app import App
from orchestrator.cli.status import status_data
from orchestrator.core.budget import month_key
from orchestrator.lifecycle import admission, attempt_syncs, checkpoints, handover, reconcile, revert
from orchestrator.lifecycle.background_sync import SyncDone
from orchestrator.lifecycle.cloud_steps import CloudSteps
from orchestrator.lifecycle.finish import REQUEUED_LOCAL, job_after_attempt
from orchestrator.lifecycle.local import LocalRunner
from orchestrator.lifecycle.machine import AttemptState
from orchestrator.lifecycle.reconcile import Reconciler
from orchestrator.lifecycle.schedule import watch_schedule
from orchestrator.notify import notice_type
from orchestrator.queue import enqueue
from providers.base import (
    AuthFailed,
    InstanceInfo,
    InstanceState,
    InvalidRequest,
    LaunchRequest,
    Market,
    Offer,
    OwnerTags,
    ProviderError,
    QuotaExceeded,
    RetryPolicy,
)
from providers.lambda_cloud import LambdaCloud
from providers.simcloud.api import SimCloudServer
from runbooks.burst_checkpoint import write_checkpoint
from runbooks.checkpoint_transfer import PulledCheckpoints, TransferStats
from state import schema as s
from tests.conftest import REPO, write_job


def test_a_job_the_budget_refused_at_launch_stays_blocked_until_that_launch_would_fit(tmp_path: Path) -> None:
    # Its decision projected that it fits; the launch check (stop horizon, billing minimum, live price) said no.
    # Deciding it again on the decision's figures would queue it and the launch refuse it, every tick.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "refused", local_throughput=0, rented_throughput={"H100": 2.0}))
    job = app.store.get_job(job_id)
    assert job is not None and job["state"] == "queued"
    rec = Reconciler(app, {}, cloud=None)
    rec.admission._block(job, "budget: $1000.00 projected for the rest exceeds the $15.00 left this month",
               budget_launch={"rate_usd_h": 1000.0, "minimum_s": 3600.0})
    for _ in range(3):
        rec.admission._redecide_blocked(time.time())
    assert app.store.get_job(job_id)["state"] == "blocked"
    assert not [e for e in app.store.events(job_id=job_id) if e["type"] == "job.redecided"]

    job = app.store.get_job(job_id)
    assert job is not None
    job["spec"]["_budget_launch"]["rate_usd_h"] = 1.0  # the price fell (or the cap rose): that launch fits now
    job["spec"]["_spot_probe_at"] = 0.0  # the daemon's bookkeeping in the spec is not the user's spec to validate
    with app.store.tx() as c:
        app.store.update_job(job_id, c, spec=job["spec"])
    rec.admission._redecide_blocked(time.time())
    assert app.store.get_job(job_id)["state"] == "queued"
    app.close()


def test_a_pull_that_fails_because_another_process_wound_the_attempt_down_is_not_a_failure(
        tmp_path: Path) -> None:
    # revert-local (its own process) stops and terminates an attempt while the daemon is pulling from it: that
    # pull's SSH error is the wind-down, not a failing sync, and the attempt's own step pulls last.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "pulled", local_throughput=0, rented_throughput={"H100": 2.0}))
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state="stopping",
                                            provider="sim", instance_type="x", market="spot", info={},
                                            created_at=0.0))
    rec = Reconciler(app, {}, cloud=None)
    job = app.store.get_job(job_id)
    seen_running = {"id": f"{job_id}-a1", "state": "running", "info": {}}
    rec.syncs.pull_failed(seen_running, job, {}, EOFError("no SSH session"))
    assert not [e for e in app.store.events(job_id=job_id) if e["type"] == "checkpoint.sync_failed"]
    rec.syncs.pull_failed({**seen_running, "state": "stopping"}, job, {}, EOFError("no SSH session"))
    assert [e["type"] for e in app.store.events(job_id=job_id) if e["type"] == "checkpoint.sync_failed"] == [
        "checkpoint.sync_failed"]
    # The same for the logs' and outputs' pulls, which the demo's revert-local said had failed every time.
    for event in ("attempt.logs_pull_failed", "attempt.outputs_pull_failed"):
        rec.syncs.said_once(seen_running, job, {}, "error", event, EOFError("no SSH session"))
        assert not [e for e in app.store.events(job_id=job_id) if e["type"] == event]
        rec.syncs.said_once({**seen_running, "state": "stopping"}, job, {}, "error", event, EOFError("no SSH session"))
        assert len([e for e in app.store.events(job_id=job_id) if e["type"] == event]) == 1
    app.close()


def test_each_installation_tags_its_instances_with_an_owner_of_its_own_kept_in_its_state(tmp_path: Path) -> None:
    # Two installations on one cloud account sharing a tag would each sweep the other's instances as orphans.
    first, second = (App(state_dir_override=str(tmp_path / name)) for name in ("one", "two"))
    ids = [first.orchestrator_id, second.orchestrator_id]
    assert ids[0] != ids[1] and all(i.startswith("burstctl-") and len(i) == len("burstctl-") + 8 for i in ids)
    first.close()
    again = App(state_dir_override=str(tmp_path / "one"))
    assert again.orchestrator_id == ids[0]  # kept in the state, so a restart owns what it launched
    again.close()
    second.close()

    legacy = App(state_dir_override=str(tmp_path / "old"))  # a state from before: its instances say "burstctl"
    job_id, _, _ = enqueue(legacy, write_job(tmp_path, "old", local_throughput=0, rented_throughput={"H100": 2.0}))
    with legacy.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state="running",
                                            provider="sim", instance_type="x", market="spot", info={},
                                            created_at=0.0))
    assert legacy.orchestrator_id == "burstctl"
    legacy.close()

    cfg = tmp_path / "burstctl.toml"
    cfg.write_text('orchestrator_id = "lab-box"\n')
    named = App(config_path=str(cfg), state_dir_override=str(tmp_path / "named"))
    assert named.orchestrator_id == "lab-box"
    named.close()


class _RefusingProvider:
    """A provider that answers every look at its offers with one error of the taxonomy."""

    name = "ec2"

    def __init__(self, error: Exception) -> None:
        self.error = error

    def offers(self) -> list[Offer]:
        raise self.error


def test_a_job_no_provider_answers_for_is_told_why_not_that_nobody_has_capacity(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "unanswered", local_throughput=0,
                                          rented_throughput={"H100": 2.0}))
    refusing = _RefusingProvider(AuthFailed("DescribeInstanceTypes: AuthFailure", provider="ec2",
                                            code="AuthFailure"))
    rec = Reconciler(app, {"ec2": refusing}, cloud=None)  # type: ignore[dict-item]
    job = app.store.get_job(job_id)
    assert job is not None
    assert rec.admission.choose_offer(job, time.time()) is None
    assert app.store.get_job(job_id)["reason"] == (
        "no provider answered (ec2: AuthFailed: DescribeInstanceTypes: AuthFailure)")
    app.close()


class _Listing:
    """A provider that lists the given offers."""

    name = "lambda"

    def __init__(self, *offers: Offer) -> None:
        self.listed = list(offers)

    def offers(self) -> list[Offer]:
        return self.listed


def _a100(instance_type: str, vram_gib: float, usd_h: float) -> Offer:
    return Offer(provider="lambda", instance_type=instance_type, gpu_model="A100", gpu_count=1, vram_gib=vram_gib,
                 vcpus=30, on_demand_usd_h=usd_h, spot_usd_h=None, regions=("us-east-1",))


def test_a_launch_never_takes_a_card_too_small_for_the_job_whatever_its_price(tmp_path: Path) -> None:
    # Decided on [prices]' 80 GB A100; the provider also lists a cheaper 40 GB A100, which the job (7B LoRA at
    # 12288 tokens, 44 GB) would fill past its last byte. The launch takes the 80 GB one.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "long-context", local_throughput=0,
                                          rented_throughput={"A100": 2.0},
                                          model={"preset": "qwen2.5-7b", "method": "lora", "context": 12288}))
    job = app.store.get_job(job_id)
    assert job is not None and job["state"] == "queued"
    small, big = _a100("gpu_1x_a100", 40.0, 1.29), _a100("gpu_1x_a100_sxm4_80gb", 80.0, 1.79)
    chosen = Reconciler(app, {"lambda": _Listing(small, big)}, cloud=None).admission.choose_offer(  # type: ignore[dict-item]
        job, time.time())
    assert chosen is not None and chosen[1] is big

    # With only the small one listed, nothing launches, and the job says which card was too small for what.
    assert Reconciler(app, {"lambda": _Listing(small)}, cloud=None).admission.choose_offer(  # type: ignore[dict-item]
        job, time.time()) is None
    assert app.store.get_job(job_id)["reason"] == (
        "no offer with capacity for 1×A100 (too small for its 44.2 GB per GPU and 1.1 GB = 1.00 GiB kept free: "
        "lambda gpu_1x_a100 has 42.9 GB = 40.00 GiB per GPU)")

    # A listing that does not say how much memory its card has is not judged by it.
    unsaid = _a100("gpu_1x_a100_pcie", 0.0, 1.29)
    chosen = Reconciler(app, {"lambda": _Listing(unsaid)}, cloud=None).admission.choose_offer(  # type: ignore[dict-item]
        job, time.time())
    assert chosen is not None and chosen[1] is unsaid
    app.close()


def test_after_a_launch_refused_for_capacity_the_next_offer_is_chosen_and_metered_at_its_own_price(
        tmp_path: Path) -> None:
    # Providers launch only the type asked for; falling back to another type is the daemon's choice, so that the
    # attempt's type, GPU and rate are the ones that run and are billed.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "fallback", local_throughput=0, market="on-demand",
                                          rented_throughput={"H100": 2.0, "A100": 1.0}))
    h100 = Offer(provider="lambda", instance_type="gpu_1x_h100_sxm5", gpu_model="H100", gpu_count=1, vram_gib=80.0,
                 vcpus=26, on_demand_usd_h=3.29, spot_usd_h=None, regions=("us-east-1",))
    a100 = _a100("gpu_1x_a100_sxm4", 80.0, 1.79)
    rec = Reconciler(app, {"lambda": _Listing(h100, a100)}, cloud=None)  # type: ignore[dict-item]
    job = app.store.get_job(job_id)
    assert job is not None
    assert rec.admission.choose_offer(job, time.time())[1] is h100  # $1.65 a unit of work against the A100's $1.79

    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(
            id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state="launch_failed", provider="lambda",
            instance_type="gpu_1x_h100_sxm5", market="on-demand", created_at=0.0, ended_at=0.0,
            info={"rate_usd_h": 3.29, "launch_error": "NoCapacity"}))
    assert rec.admission.choose_offer(job, time.time())[1] is a100
    only_h100 = Reconciler(app, {"lambda": _Listing(h100)}, cloud=None)  # type: ignore[dict-item]
    assert only_h100.admission.choose_offer(job, time.time())[1] is h100  # nothing else: the refused one again
    app.close()


def test_a_job_waiting_for_spot_is_looked_at_again_when_its_next_spot_probe_is_due(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The policy waits for spot that only a launch can show; the next probe launch is due in 5 s. The job must be
    # looked at then, not a whole market_check_s later, so that "next try in 5 s" is true.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "waits", local_throughput=0, rented_throughput={"H100": 2.0}))
    offer = Offer(provider="ec2", instance_type="p5.xlarge", gpu_model="H100", gpu_count=1, vram_gib=80.0,
                  vcpus=26, on_demand_usd_h=6.0, spot_usd_h=2.0, regions=("us-east-1a",))

    class Listing:
        name = "ec2"

        def offers(self) -> list[Offer]:
            return [offer]

    monkeypatch.setattr(admission, "market_for_attempt",
                        lambda *_a, **_k: (None, {"choice": "idle", "slack_h": 3.0}))
    now = time.time()
    job = app.store.get_job(job_id)
    assert job is not None
    job["spec"]["_spot_probe_at"] = now + 5.0
    rec = Reconciler(app, {"ec2": Listing()}, cloud=None)  # type: ignore[dict-item]
    assert rec.admission.choose_offer(job, now) is None
    waiting = app.store.get_job(job_id)
    assert waiting["wait_until"] == pytest.approx(now + 5.0, abs=0.01)
    assert waiting["reason"].startswith("waiting for spot (refused, next try in 5 s)")


def test_the_measured_line_says_whether_the_deadline_held_and_how_the_hours_split(tmp_path: Path) -> None:
    # 2 h on the local card (a hybrid plan's local phase), then 1.5 h in the cloud, done 30 min after the deadline.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "late", local_throughput=0.033, rented_throughput={"H100": 0.17},
                                          deadline_hours=12))
    job = app.store.get_job(job_id)
    assert job is not None
    deadline = float(job["deadline_at"])
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="local", state="preempted",
                                            provider="local", instance_type="local", info={}, created_at=0.0,
                                            started_at=deadline - 3 * 3600, ended_at=deadline - 1 * 3600))
        c.execute(insert(s.attempts).values(id=f"{job_id}-a2", job_id=job_id, n=2, where="cloud", state="succeeded",
                                            provider="sim", instance_type="x", market="on-demand", info={},
                                            created_at=0.0, started_at=deadline - 1 * 3600,
                                            ended_at=deadline + 0.5 * 3600))
    cloud = {"id": f"{job_id}-a2", "where": "cloud", "info": {}, "instance_id": None}
    with app.store.tx() as c:
        job_after_attempt(app, c, cloud, job, AttemptState.SUCCEEDED, "completed", deadline + 0.5 * 3600)
    (measured,) = (e["data"] for e in app.store.events(job_id=job_id) if e["type"] == "job.measured")
    assert measured["deadline_met"] is False and measured["late_h"] == 0.5 and measured["local_h"] == 2.0
    # Local hours cost what the plan priced them at (board_power_w × electricity_usd_per_kwh, $0.10 by default),
    # beside the cloud's meter.
    assert measured["local_cost_usd"] == pytest.approx(0.2)
    record = Path(job["record_path"]).read_text()
    assert ("- **Measured:** run 3.50 h (local 2.00 h, cloud 1.50 h), cost $0.00 cloud + $0.20 local at $0.10/h"
            in record)
    assert record.rstrip().count("deadline missed by 0.50 h") == 1
    app.close()


def _blocked_after_running(app: App, tmp_path: Path, *, local_throughput: float, units_done: float,
                           hours_left: float) -> dict[str, Any]:
    """A cloud job of 1 unit whose trainer reported `units_done` (with that checkpoint home), whose relaunches were
    refused until `hours_left` of its deadline are left, then decided again by the daemon. Returns the job."""
    job_id, _, _ = enqueue(app, write_job(tmp_path, "ran", local_throughput=local_throughput, deadline_hours=20,
                                          rented_throughput={"H100": 0.17}, market="on-demand"))
    write_checkpoint(checkpoints.store_dir(app.config, job_id), f"step-{int(units_done * 1000):08d}",
                     {"state.json": b"{}"})
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state="preempted",
                                            provider="sim", instance_type="x", market="on-demand", created_at=0.0,
                                            info={"metrics": {"units_done": units_done}}))
        app.store.update_job(job_id, c, deadline_at=time.time() + hours_left * 3600)
    rec = Reconciler(app, {}, cloud=None)
    job = app.store.get_job(job_id)
    assert job is not None
    rec.admission._block(job, "3 launches failed in a row (NoCapacity)")
    rec.admission._redecide_blocked(time.time())
    job = app.store.get_job(job_id)
    assert job is not None
    return job


def test_a_blocked_job_that_has_run_is_decided_again_on_the_work_it_has_left(tmp_path: Path) -> None:
    # A cloud job 80 % done (its trainer said so, and that checkpoint is home) whose relaunch failed until only 2 h
    # of its deadline are left: the whole job (6.38 h, $19 on the H100) would miss them and the month's $15 cap, the
    # 0.2 left (1.68 h, $5) makes both.
    app = App(state_dir_override=str(tmp_path / "state"))
    job = _blocked_after_running(app, tmp_path, local_throughput=0, units_done=0.8, hours_left=2)
    assert job["state"] == "queued", job["reason"]
    assert job["decision"]["work_done"] == 0.8 and job["decision"]["t_rented_h"] == pytest.approx(0.2 / 0.17 + 0.5,
                                                                                                  abs=1e-3)
    # Its new answer has a record of its own (the one before describes the answer it changed), and the record the
    # run's Measured line goes into is that one.
    records = list((tmp_path / "state" / "decisions").glob("*.md"))
    (before,) = [p for p in records if str(p) != job["record_path"]]
    assert len(records) == 2 and "- decided again" not in before.read_text()  # its rationale is its own
    # Its Measured line says where the run is measured: its earlier attempt, and the rest, are counted there.
    assert "- **Measured:** decided again while blocked, " in before.read_text()
    assert f": see {Path(job['record_path']).name}" in before.read_text()
    text = Path(job["record_path"]).read_text()
    assert "decided again while blocked (3 launches failed in a row (NoCapacity))" in text and "0.8" in text
    redecided = [e for e in app.store.events(job_id=job["id"]) if e["type"] == "job.redecided"]
    assert redecided[-1]["data"]["record"] == job["record_path"]
    app.close()


def test_a_started_job_whose_deadline_can_no_longer_be_met_is_finished_late_locally_not_dropped(
        tmp_path: Path) -> None:
    # Half done, its checkpoint home, its relaunch refused until 1 h of its deadline is left: neither local nor
    # rented finishes the rest by then. A job that never ran would be rethink (never runs); this one has work to
    # lose, and the deadline was the only reason to rent: it finishes locally, late.
    app = App(state_dir_override=str(tmp_path / "state"))
    job = _blocked_after_running(app, tmp_path, local_throughput=0.033, units_done=0.5, hours_left=1)
    assert job["decision"]["verdict"] == "rethink"
    assert (job["state"], job["placement"]) == ("queued", "local")
    assert "finishes late, locally" in job["reason"]
    app.close()


def test_a_job_that_never_ran_and_cannot_meet_its_deadline_is_still_rethink(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "hopeless", local_throughput=0.033, deadline_hours=20,
                                          rented_throughput={"H100": 0.17}, market="on-demand"))
    with app.store.tx() as c:
        app.store.update_job(job_id, c, deadline_at=time.time() + 1 * 3600)
    rec = Reconciler(app, {}, cloud=None)
    job = app.store.get_job(job_id)
    assert job is not None
    rec.admission._block(job, "3 launches failed in a row (NoCapacity)")
    rec.admission._redecide_blocked(time.time())
    assert app.store.get_job(job_id)["state"] == "rethink"
    app.close()


def test_a_cloud_run_slower_than_planned_says_once_that_it_will_miss_the_deadline(tmp_path: Path) -> None:
    # s_R = 0.17/h planned; the trainer measures 0.1/h with 0.5 of 1 unit done and 4 h to the deadline: the rest
    # ends in 5 h, an hour late. Said once an attempt (an event and the job's reason), while there is time to act.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "slow-gpu", local_throughput=0, deadline_hours=10,
                                          rented_throughput={"H100": 0.17}, market="on-demand"))
    now = time.time()
    with app.store.tx() as c:
        app.store.update_job(job_id, c, deadline_at=now + 4 * 3600)
    job = app.store.get_job(job_id)
    assert job is not None and job["decision"]["gpu"] == "H100"
    att = {"id": f"{job_id}-a1", "where": "cloud"}
    on_time = {"metrics": {"units_done": 0.5, "throughput_units_h": 0.17}}
    watch_schedule(app, att, job, on_time, now)
    assert not [e for e in app.store.events(job_id=job_id) if e["type"] == "job.behind_schedule"]
    slow = {"metrics": {"units_done": 0.5, "throughput_units_h": 0.1}}
    for _ in range(2):
        watch_schedule(app, att, app.store.get_job(job_id), slow, now)
    (behind,) = [e["data"] for e in app.store.events(job_id=job_id) if e["type"] == "job.behind_schedule"]
    assert behind["late_h"] == pytest.approx(1.0) and behind["projected_end"] == pytest.approx(now + 5 * 3600)
    assert app.store.get_job(job_id)["reason"].startswith(
        "behind schedule: at the 0.1 units/h measured (0.17 planned), the 0.5 units left end ")
    app.close()


def test_a_hybrid_local_phase_runs_on_while_the_budget_would_refuse_its_burst(tmp_path: Path) -> None:
    # The month's spend has reached the point where the rest's burst would be refused at launch: stopping the local
    # run for it would leave the local GPU idle and the job blocked. It runs on locally, and hands over once the
    # budget allows (here: the cap raised in the config, which the daemon applies without a restart).
    (tmp_path / "burstctl.toml").write_text("[budget]\nmonthly_cap_usd = 100\n")
    app = App(config_path=str(tmp_path / "burstctl.toml"), state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "c", local_throughput=0.033, market="on-demand",
                                          rented_throughput={"H100": 0.17}, deadline_hours=12))
    job = {**app.store.get_job(job_id), "approved": True}  # its price approved: only the budget holds it
    assert job["placement"] == "hybrid"
    full = app.config
    with SimCloudServer(api_key="sim-rules-key") as sim:
        sim_provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key="sim-rules-key",
                                   regions=("us-east-1", "us-west-1"), request_interval_s=0.0)
        providers = {"sim": sim_provider}
        app.use_config(full.model_copy(update={"budget": full.budget.model_copy(update={"monthly_cap_usd": 0.5})}))
        held = Reconciler(app, providers, cloud=CloudSteps(app, providers)).admission.hand_over_held(
            job, time.time())
        assert held is not None and held.startswith("the budget would refuse the burst: projected rented $")
        assert "is more than the whole $0.50 monthly budget" in held  # the launch's own words
        app.use_config(full)
        assert Reconciler(app, providers, cloud=CloudSteps(app, providers)).admission.hand_over_held(
            job, time.time()) is None
        sim_provider.close()
    app.close()


@pytest.mark.parametrize(("cap", "then"), [
    (100.0, "bursts the rest by "),
    # No month pays the hand-over: the reason does not promise it (the decision's own words, where it was made).
    (10.0, "its cloud phase ($15.38 with its stop) is more than the whole $10.00 monthly cap, so it runs on locally, "
           "late, unless budget.monthly_cap_usd is raised"),
    # $15.27 fits the cap; with the 135 s its instance takes to stop, as the launch counts it, no month pays it.
    (15.30, "its cloud phase ($15.38 with its stop) is more than the whole $15.30 monthly cap, so it runs on locally, "
            "late, unless budget.monthly_cap_usd is raised"),
])
def test_a_hybrid_s_local_phase_promises_the_hand_over_only_when_a_month_s_budget_pays_it(
        tmp_path: Path, cap: float, then: str) -> None:
    (tmp_path / "burstctl.toml").write_text(f"[budget]\nmonthly_cap_usd = {cap}\n")
    app = App(config_path=str(tmp_path / "burstctl.toml"), state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "c", local_throughput=0.033, market="on-demand",
                                          rented_throughput={"H100": 0.17}, deadline_hours=12))
    job = app.store.get_job(job_id)
    assert job is not None and job["placement"] == "hybrid"
    runner = LocalRunner(app)
    info = {"hybrid": runner._hybrid_terms(job)}
    now = time.time()
    reason = runner._replan({"id": f"{job_id}-a1", "started_at": now}, job, info, now)["reason"]
    assert reason.startswith("running locally (hybrid plan): 0 of 1 units done (estimated); " + then), reason
    app.close()


def test_a_hybrid_awaiting_approval_runs_its_local_phase_and_only_its_hand_over_waits_for_approve(
        tmp_path: Path) -> None:
    # Held whole, a hybrid above the approval ceiling left the local GPU idle until someone approved, and each hour
    # of that made its cloud phase longer. Its local phase costs nothing: it is queued; the burst is what waits.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, decision, _ = enqueue(app, write_job(tmp_path, "c", local_throughput=0.033, market="on-demand",
                                                 rented_throughput={"H100": 0.17}, deadline_hours=12))
    job = app.store.get_job(job_id)
    assert decision.action == "await-approval" and (job["state"], job["placement"]) == ("queued", "hybrid")
    assert job["decision"]["reasons"][-1].startswith("meanwhile its local phase runs: only the hand-over to the "
                                                     "cloud waits for `burstctl approve`")
    (enqueued,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "job.enqueued"]
    assert notice_type(enqueued) == "job.awaiting_approval"  # a person is told, as of a job held whole
    cloud = _Stoppable()
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud)  # type: ignore[dict-item, arg-type]
    said = rec.admission.hand_over_held(job, time.time())
    assert said == f"its price waits for approval: `burstctl approve {job_id}`"
    with app.store.tx() as c:
        app.store.update_job(job_id, c, approved=True)
    said = rec.admission.hand_over_held(app.store.get_job(job_id), time.time())
    assert not (said or "").startswith("its price waits")
    rec.close()
    app.close()


def test_a_hand_over_and_a_launch_count_only_capacity_on_the_market_they_launch_on(tmp_path: Path) -> None:
    # simcloud lists H100 spot capacity and no on-demand capacity. An on-demand cloud phase would be refused: its
    # local phase runs on. A spot one can launch: it hands over.
    app = App(state_dir_override=str(tmp_path / "state"))
    jobs = {market: enqueue(app, write_job(tmp_path, market, local_throughput=0.033, market=market,
                                           rented_throughput={"H100": 0.17}))[0] for market in ("on-demand", "spot")}
    h100 = "gpu_1x_h100_sxm5"
    with SimCloudServer(api_key="sim-rules-key") as sim:
        for region in ("us-east-1", "us-west-1"):
            sim.set_capacity(h100, region, 0)
        sim_provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key="sim-rules-key",
                                   regions=("us-east-1", "us-west-1"), request_interval_s=0.0)
        providers = {"sim": sim_provider}
        rec = Reconciler(app, providers, cloud=CloudSteps(app, providers))
        on_demand, spot = ({**app.store.get_job(jobs[m]), "approved": True} for m in ("on-demand", "spot"))
        assert rec.admission.hand_over_held(on_demand, time.time()) == "no cloud lists on-demand capacity for 1×H100"
        assert rec.admission.hand_over_held(spot, time.time()) is None

        # Nor does an on-demand launch go to the offer: only spot is listed there.
        assert rec.admission.choose_offer(on_demand, time.time()) is None
        assert app.store.get_job(jobs["on-demand"])["reason"] == "no offer with capacity for 1×H100"

        sim.set_capacity(h100, "us-west-1", 1)
        rec.offers.forget("sim")
        assert rec.admission.hand_over_held(on_demand, time.time()) is None
        assert rec.admission.choose_offer(on_demand, time.time())[2].value == "on-demand"
        sim_provider.close()
    app.close()


def test_an_instance_that_never_comes_up_fails_the_launch_not_the_job(tmp_path: Path) -> None:
    # A boot or SSH timeout had ended the attempt as failed, and every failed attempt fails its job: one bad host
    # took a job that another instance would have run. Now it is a failed launch: the job launches again, and after
    # daemon.max_launch_failures of them in a row it waits, blocked, with the reason.
    app = App(state_dir_override=str(tmp_path / "state"))
    full = app.config
    app.use_config(full.model_copy(update={"daemon": full.daemon.model_copy(update={
        "boot_timeout_s": 0.5, "max_launch_failures": 2, "launch_backoff_s": 0.0})}))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "unbooted", local_throughput=0, market="on-demand"))
    with SimCloudServer(api_key="sim-rules-key", boot_delay_s=3600.0) as sim:
        provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key="sim-rules-key",
                               regions=("us-east-1", "us-west-1"), request_interval_s=0.0)
        rec = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}))
        reasons = []
        for _ in range(2):
            rec.tick()  # launched, looked at while it boots, not up within boot_timeout_s: terminated, and in line
            job = app.store.get_job(job_id)
            reasons.append((job["state"], job["reason"]))
        assert reasons[0] == ("queued", "launch failed: its instance was not running within daemon.boot_timeout_s "
                                        "(boot-timeout); another is launched")
        rec.tick()  # blocked after two in a row; with no launch_backoff_s, decided again at once
        (blocked,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "job.blocked"]
        assert blocked["data"]["reason"].startswith("2 launches failed in a row (boot-timeout)")
        assert app.store.get_job(job_id)["state"] != "failed"
        with app.store.engine.connect() as c:
            rows = c.execute(select(s.attempts).order_by(s.attempts.c.n)).mappings()
            ended = [(r["state"], r["reason"]) for r in rows]
        assert ended == [("aborted", "boot-timeout")] * 2
        assert [i.status for i in sim.instances()] == ["terminated"] * 2
        assert app.store.month_spend(month_key(time.time())) > 0  # each billed its minimum, and closed
        provider.close()
    app.close()


def test_a_job_whose_launch_no_provider_has_confirmed_is_said_launching_not_running(
        tmp_path: Path, burstctl_here: Callable[..., Any]) -> None:
    # The launch was written down (its intent) and the provider answered 503: no instance is known. The job's state
    # is `running` (the machine's), and `list` said so; `list`, `show` and `status` say it is launching.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "unconfirmed", local_throughput=0, market="on-demand"))
    state = ["--state-dir", str(tmp_path / "state")]

    def said() -> tuple[str, str, str, dict[str, Any]]:
        row = next(line for line in burstctl_here(*state, "list").stdout.splitlines() if job_id in line)
        (listed,) = json.loads(burstctl_here(*state, "list", "--json").stdout)
        shown = burstctl_here(*state, "show", job_id).stdout.splitlines()[0]
        jobs = next(line for line in burstctl_here(*state, "status").stdout.splitlines() if line.startswith("jobs:"))
        return row, shown, jobs, listed

    with SimCloudServer(api_key="sim-rules-key") as sim:
        provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key="sim-rules-key", regions=("us-east-1",),
                               request_interval_s=0.0, launch_interval_s=0.0,
                               retry=RetryPolicy(attempts=1, max_total_s=0.0, initial_s=0.0, max_wait_s=0.0))
        rec = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}))
        sim.inject("server-error", count=1000, route="instance-operations/launch", status=503)
        rec.tick()
        with app.store.engine.connect() as c:
            (att,) = c.execute(select(s.attempts)).mappings()
        assert att["state"] == "intent" and app.store.get_job(job_id)["state"] == "running" and not sim.instances()
        row, shown, jobs, listed = said()
        assert " launching " in row and " running " not in row, row
        assert shown.startswith(f"unconfirmed ({job_id}) — train, launching"), shown
        assert jobs == "jobs: launching 1", jobs
        assert (listed["state"], listed["launching"]) == ("running", True)  # the machine's state, and what is true

        sim.clear_faults()
        rec.tick()  # launched and confirmed: running
        assert len(sim.instances()) == 1
        row, shown, jobs, listed = said()
        assert " running " in row and shown.startswith(f"unconfirmed ({job_id}) — train, running"), (row, shown)
        assert jobs == "jobs: running 1" and listed["launching"] is False
        rec.close()
        provider.close()
    app.close()


def test_a_job_cancelled_after_the_tick_read_it_gets_no_attempt(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "cancelled", local_throughput=0, market="on-demand"))
    read = app.store.get_job(job_id)
    app.store.update_job(job_id, state="cancelled", reason="cancelled by the user")  # `cancel`, beside the tick
    with SimCloudServer(api_key="sim-rules-key") as sim:
        provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key="sim-rules-key", regions=("us-east-1",),
                               request_interval_s=0.0)
        rec = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}))
        assert rec.admission._start_cloud_attempt(read, time.time()) is False
        provider.close()
    with app.store.engine.connect() as c:
        assert c.execute(select(s.attempts)).first() is None
    assert app.store.get_job(job_id)["state"] == "cancelled"
    app.close()


def test_a_launch_whose_outcome_is_unknown_is_never_given_up_while_the_provider_cannot_say(tmp_path: Path) -> None:
    # The launch made an instance, but its answer was lost; then the provider throttled every look for it. After
    # five failed steps the attempt had been given up as a failed launch: the instance ran, and billed, with no
    # row or charge of ours, outside the budget's cap.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "unknown", local_throughput=0, market="on-demand"))
    with SimCloudServer(api_key="sim-rules-key") as sim:
        offset = [0.0]  # each tick past the failed step's next try, and the failures past the heartbeat timeout
        provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key="sim-rules-key", regions=("us-east-1",),
                               request_interval_s=0.0, timeout_s=0.5, clock=lambda: time.monotonic() + offset[0],
                               retry=RetryPolicy(attempts=1, max_total_s=0.0, initial_s=0.0, max_wait_s=0.0))
        rec = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}),
                         clock=lambda: time.time() + offset[0])
        sim.inject("delayed-response", route="instance-operations/launch", delay_s=2.0)  # made, answer lost
        sim.inject("throttle", count=1000, route="instances")
        for _ in range(reconcile.MAX_STEP_ERRORS + 2):
            rec.tick()
            offset[0] += app.config.daemon.heartbeat_timeout_s
        with app.store.engine.connect() as c:
            (att,) = c.execute(select(s.attempts)).mappings()
        assert att["state"] == "intent" and att["info"]["errors"] > reconcile.MAX_STEP_ERRORS
        assert app.store.get_job(job_id)["reason"].startswith("the outcome of its launch on sim is not known yet: "
                                                             "Throttled")
        assert len(sim.instances()) == 1  # the launch made it
        sim.clear_faults()
        rec.tick()  # it answers: the instance is found, adopted and metered
        with app.store.engine.connect() as c:
            (att,) = c.execute(select(s.attempts)).mappings()
            charges = c.execute(select(s.ledger)).mappings().all()
        assert att["state"] in ("provisioning", "bootstrapping") and att["instance_id"] == sim.instances()[0].id
        assert [r["instance_id"] for r in charges] == [att["instance_id"]]
        provider.close()
    app.close()


class _Instances:
    """A provider that only describes instances: the one named in `present` is running, any other is gone."""

    name = "sim"

    def __init__(self, present: str) -> None:
        self.present = present

    def describe(self, ids: list[str]) -> dict[str, InstanceInfo]:
        return {i: InstanceInfo(id=i, state=InstanceState.RUNNING if i == self.present else InstanceState.TERMINATED,
                                instance_type="x", market=Market.SPOT) for i in ids}


def test_an_instance_launched_ahead_waits_for_the_attempt_before_it_then_takes_the_job_over_or_is_not_needed(
        tmp_path: Path) -> None:
    # The shared rule of a successor (launched on a spot notice) and a kept spot probe (handover.py).
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "ahead", local_throughput=0, rented_throughput={"H100": 2.0}))
    with app.store.tx() as c:
        for n, state in ((1, "running"), (2, "bootstrapping")):
            c.execute(insert(s.attempts).values(
                id=f"{job_id}-a{n}", job_id=job_id, n=n, where="cloud", state=state, provider="sim",
                instance_type="x", market="spot", instance_id=f"i-{n}", created_at=0.0,
                info={"successor_for": f"{job_id}-a1"} if n == 2 else {}))
    rec = Reconciler(app, {}, cloud=None)

    def attempt(n: int) -> dict[str, Any]:
        with app.store.engine.connect() as c:
            return dict(c.execute(select(s.attempts).where(s.attempts.c.id == f"{job_id}-a{n}")).mappings().one())

    def tick(present: str = "i-2") -> str | None:
        job = app.store.get_job(job_id)
        ahead = attempt(2)
        return handover.wait_or_take_over(rec, ahead, job, _Instances(present), predecessor=f"{job_id}-a1",
                                          info={**ahead["info"], "took_over": True}, reason="on the next one",
                                          event="attempt.successor_taken_over")

    def set_state(table: Any, row_id: str, state: str) -> None:
        with app.store.tx() as c:
            c.execute(update(table).where(table.c.id == row_id).values(state=state))

    assert tick() is None  # the attempt before it still runs: it waits, and nothing changes
    assert app.store.get_job(job_id)["state"] == "queued"
    assert tick(present="i-other") == "instance gone"  # reclaimed while it waited: not needed, whatever else holds

    set_state(s.jobs, job_id, "cancelled")
    assert tick() == "cancelled"  # the job stops it even while the attempt before it runs
    set_state(s.attempts, f"{job_id}-a1", "preempted")
    set_state(s.jobs, job_id, "succeeded")
    assert tick() == "job succeeded"  # the attempt before it finished the job: nothing left for it
    assert not [e for e in app.store.events(job_id=job_id) if e["type"] == "attempt.successor_taken_over"]

    set_state(s.jobs, job_id, "resuming")
    assert tick() is None
    job = app.store.get_job(job_id)
    assert (job["state"], job["reason"]) == ("running", "on the next one")
    assert attempt(2)["info"]["took_over"] is True
    (taken,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "attempt.successor_taken_over"]
    assert (taken["attempt_id"], taken["data"]["instance"], taken["data"]["resuming"]) == (f"{job_id}-a2", "i-2", True)
    app.close()


def test_burst_enable_puts_back_on_their_plans_the_jobs_revert_local_moved_home_that_have_not_started(
        tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    # s_L 0.033/h against a 12 h deadline: local takes 30 h, so its plan bursts (it fits locally: it can go home).
    job_id, _, _ = enqueue(app, write_job(tmp_path, "home", local_throughput=0.033, deadline_hours=12,
                                          rented_throughput={"H100": 0.17}))
    planned = app.store.get_job(job_id)
    assert planned["placement"] in ("cloud", "hybrid") and planned["decision"]["fits_locally"]

    report = revert.revert_local(app, Reconciler(app, {}, cloud=None), timeout_s=5)
    reverted = app.store.get_job(job_id)
    assert report.requeued_local == [job_id] and reverted["placement"] == "local"
    assert reverted["reason"] == "revert-local: requeued locally from the start (no checkpoint yet)"
    again = revert.revert_local(app, Reconciler(app, {}, cloud=None), timeout_s=5)  # a no-op, and says so
    assert (again.requeued_local, again.already_local) == ([], [job_id])

    assert revert.set_burst_enabled(app, True, "burst-enable")
    assert revert.restore_plans(app) == [job_id]
    restored = app.store.get_job(job_id)
    assert (restored["state"], restored["placement"]) == ("queued", planned["placement"])
    assert [e["data"]["placement"] for e in app.store.events(job_id=job_id) if e["type"] == "job.plan_restored"] == [
        planned["placement"]]
    assert revert.restore_plans(app) == []  # once
    app.close()


def test_a_daemon_with_no_usable_cloud_provider_is_reported_local_only_by_status(tmp_path: Path) -> None:
    # No provider has its credentials (e.g. BURSTCTL_SIM_API_KEY unset): nothing can burst, and status says so
    # rather than "burst-enabled" (a stopped daemon's last answer says nothing about now).
    from orchestrator.cli.status import _mode

    app = App(state_dir_override=str(tmp_path / "state"))
    assert _mode(app, daemon_running=True) == "burst-enabled"  # nothing asked yet
    Reconciler(app, {}, cloud=None).admission._record_health(time.time())
    assert _mode(app, daemon_running=True) == "local-only (no cloud provider is usable: `burstctl providers` says why)"
    assert _mode(app, daemon_running=False) == "burst-enabled"
    app.close()


def test_status_says_when_the_config_file_changed_since_the_daemon_read_it(tmp_path: Path) -> None:
    from orchestrator.cli.status import _config_changed
    from orchestrator.daemon import CONFIG_SEEN_KEY, config_fingerprint

    cfg = tmp_path / "burstctl.toml"
    cfg.write_text("[budget]\nmonthly_cap_usd = 15.0\n")
    daemon = App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))
    daemon.store.set_setting(CONFIG_SEEN_KEY, config_fingerprint(daemon.config))  # what the daemon does at its start
    assert not _config_changed(App(config_path=str(cfg), state_dir_override=str(tmp_path / "state")))
    with pytest.MonkeyPatch.context() as m:  # the same state directory, named from elsewhere: the same setting
        m.chdir(tmp_path)
        assert not _config_changed(App(config_path=str(cfg), state_dir_override="state"))
    cfg.write_text("[budget]\nmonthly_cap_usd = 100.0\n")  # raised while it runs
    assert _config_changed(App(config_path=str(cfg), state_dir_override=str(tmp_path / "state")))
    # Another config file than the daemon's says nothing about the daemon's.
    other = tmp_path / "other.toml"
    other.write_text("[budget]\nmonthly_cap_usd = 100.0\n")
    assert not _config_changed(App(config_path=str(other), state_dir_override=str(tmp_path / "state")))
    daemon.close()


def test_a_job_stopped_before_the_budget_cap_says_what_was_spent_and_what_came_home(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "capped", local_throughput=0, rented_throughput={"H100": 2.0}))
    job = app.store.get_job(job_id)
    write_checkpoint(checkpoints.store_dir(app.config, job_id), "step-00000042", {"w.bin": b"x"})
    att = {"id": f"{job_id}-a1", "where": "cloud", "info": {}, "instance_id": "i-1"}
    with app.store.tx() as c:
        job_after_attempt(app, c, att, job, AttemptState.ABORTED, "budget-cap", time.time())
    held = app.store.get_job(job_id)
    assert held["state"] == "blocked"
    assert held["reason"].startswith("stopped before the monthly budget cap: $0.00 spent of $15.00 this month, "
                                     "checkpoint step-00000042 home; it is decided again as the budget allows")
    app.close()


def test_a_hybrid_no_month_pays_or_one_awaiting_approval_holds_no_money_from_other_jobs(tmp_path: Path) -> None:
    # The seed's candidate C at a $15 cap: its cloud phase ($15.27) is more than the whole cap, so it runs locally
    # and never hands over; and its price awaits approval. It had held the $15.27 all the same, and every other
    # burst was blocked for the month, "held for 1 other admitted job".
    app = App(state_dir_override=str(tmp_path / "state"))
    c_id, c_decision, _ = enqueue(app, REPO / "examples" / "seed" / "c-big-local-deadline.toml")
    assert c_decision.action == "await-approval" and app.store.get_job(c_id)["placement"] == "hybrid"
    other = {"local_throughput": 0, "rented_throughput": {"H100": 1.0}, "work_units": 0.5, "market": "on-demand"}
    burst_id, d, _ = enqueue(app, write_job(tmp_path, "small-burst", **other))
    assert app.store.get_job(burst_id)["state"] == "queued", d.reasons[-1]
    assert d.reasons[-1].startswith("budget: projected rented $") and "held" not in d.reasons[-1]
    app.close()


def test_a_charge_still_open_in_last_month_at_its_cap_blocks_the_decision_as_it_blocks_the_launch(
        tmp_path: Path) -> None:
    # An instance launched last month still runs, $15.50 committed against last month's $15 cap: the guard stops it,
    # and the launch's check refuses every launch meanwhile. The decision saw this month alone, said "fits" and queued
    # the job, for the launch to block it at once.
    app = App(state_dir_override=str(tmp_path / "state"))
    now = time.time()
    last_month = month_key(now - 32 * 86400)
    with app.store.tx() as c:
        c.execute(insert(s.ledger).values(month=last_month, job_id=None, attempt_id=None, provider="sim",
                                          instance_id="i-0", instance_type="x", market="on-demand", rate_usd_h=3.1,
                                          started_at=now - 5 * 3600, ended_at=None, cost_usd=None))
    job_id, d, _ = enqueue(app, write_job(tmp_path, "small", local_throughput=0, rented_throughput={"H100": 1.0},
                                          work_units=0.5, market="on-demand"))
    launch = Reconciler(app, {}, cloud=None).budget.problem(time.time(), rate_usd_h=3.0, minimum_s=60.0,
                                                            expected_h=d.plan.phases[0].hours)
    assert launch is not None and launch.startswith("budget: $15.") and f"committed in {last_month} reaches the " \
        "$15.00 cap" in launch
    assert d.action == "blocked" and app.store.get_job(job_id)["state"] == "blocked"
    assert d.reasons[-1] == launch  # the decision's words are the launch's
    app.close()


def test_a_hybrid_whose_launch_no_month_pays_with_its_stop_holds_no_money_either(tmp_path: Path) -> None:
    # Seed C's cloud phase ($15.27) fits a $15.30 cap only without the 135 s its instance takes to stop: it never
    # hands over, so it must not keep that money from other jobs.
    from orchestrator.holds import held_by_plans

    (tmp_path / "burstctl.toml").write_text("[budget]\nmonthly_cap_usd = 15.30\n[policy]\nmax_auto_delta_usd = 50.0\n")
    app = App(config_path=str(tmp_path / "burstctl.toml"), state_dir_override=str(tmp_path / "state"))
    c_id, d, _ = enqueue(app, REPO / "examples" / "seed" / "c-big-local-deadline.toml")
    assert d.action == "burst" and app.store.get_job(c_id)["placement"] == "hybrid"
    assert d.plan is not None and d.plan.rented_cost_usd < 15.30 < (d.launch_usd or 0.0)
    assert held_by_plans(app, time.time()).jobs == 0
    app.close()


def test_a_job_is_admitted_only_into_what_the_plans_already_admitted_leave_of_the_cap(tmp_path: Path) -> None:
    # $50 a month; each job plans 10.5 on-demand H100 hours at $3.00: $31.50. Each fits alone, not both: admitting
    # both would launch both, and the cap would stop both before either finished.
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text("[budget]\nmonthly_cap_usd = 50.0\n")
    app = App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))
    job = {"local_throughput": 0, "rented_throughput": {"H100": 1.0}, "work_units": 10, "market": "on-demand"}
    first, d1, _ = enqueue(app, write_job(tmp_path, "first", **job))
    second, d2, _ = enqueue(app, write_job(tmp_path, "second", **job))
    assert app.store.get_job(first)["state"] == "queued"
    # $31.50 and the 135 s a stop of its instance takes (three 5 s ticks and 120 s), as the launch counts it.
    assert d1.reasons[-1] == ("budget: projected rented $31.61 (10.5 h at $3.00/h, plus 135 s to stop) fits the "
                              "$50.00 left this month")
    assert app.store.get_job(second)["state"] == "blocked"
    assert d2.reasons[-1] == ("budget: projected rented $31.61 (10.5 h at $3.00/h, plus 135 s to stop) exceeds the "
                              "$18.50 left of the $50.00 monthly budget ($0.00 spent or committed, $31.50 held for 1 "
                              "other admitted job)")

    # What the first has spent comes off what its plan holds: $10 spent, $21.50 held, still $18.50 left.
    with app.store.tx() as c:
        c.execute(insert(s.ledger).values(month=month_key(time.time()), job_id=first, attempt_id=f"{first}-a1",
                                          provider="sim", instance_id="i-1", instance_type="x", market="on-demand",
                                          rate_usd_h=3.0, started_at=0.0, ended_at=1.0, cost_usd=10.0))
    rec = Reconciler(app, {}, cloud=None)
    rec.admission._redecide_blocked(time.time())
    assert app.store.get_job(second)["state"] == "blocked"
    # Once the first is over, the second is decided again into what is left ($40).
    with app.store.tx() as c:
        app.store.update_job(first, c, state="cancelled")
    rec.admission._redecide_blocked(time.time())
    assert app.store.get_job(second)["state"] == "queued"
    app.close()


def test_a_job_decided_again_at_the_cap_s_edge_is_said_to_fit_only_when_its_launch_would_be_taken(
        tmp_path: Path) -> None:
    # Blocked while bursting was off, decided again after burst-enable with just its plan's price left of the $15
    # cap: the decision said "fits" (the plan's hours at the listed price) and queued it, and the launch's check
    # (the same, and 135 s for its stop) blocked it at once. Both ask budget.admits now: it stays blocked, saying why.
    from orchestrator.queue import record_offers_seen

    app = App(state_dir_override=str(tmp_path / "state"))
    with SimCloudServer(api_key="sim-rules-key") as sim:
        provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key="sim-rules-key", regions=("us-east-1",),
                               request_interval_s=0.0)
        record_offers_seen(app, "sim", provider.offers(), time.time())  # decided at the price the launch pays
        revert.set_burst_enabled(app, False, "revert-local")
        job_id, blocked, _ = enqueue(app, write_job(tmp_path, "edge", local_throughput=0, market="on-demand"))
        assert blocked.action == "blocked" and blocked.plan is not None
        plan_usd = blocked.plan.rented_cost_usd  # 1 h at simcloud's $3.29
        with app.store.tx() as c:  # spent this month: all but the plan's price and 5 cents
            c.execute(insert(s.ledger).values(month=month_key(time.time()), job_id=None, attempt_id=None,
                                              provider="sim", instance_id="i-0", instance_type="x",
                                              market="on-demand", rate_usd_h=3.0, started_at=0.0, ended_at=1.0,
                                              cost_usd=15.0 - plan_usd - 0.05))
        revert.set_burst_enabled(app, True, "burst-enable")
        rec = Reconciler(app, {"sim": provider}, cloud=CloudSteps(app, {"sim": provider}))
        for _ in range(2):
            rec.tick()
        job = app.store.get_job(job_id)
        said = [(e["type"], e["data"].get("state"), e["data"].get("reason")) for e in app.store.events(job_id=job_id)
                if e["type"] in ("job.redecided", "job.blocked")]
        assert not said, said  # neither "decided again: fits" nor a launch refused right after
        assert job["state"] == "blocked" and not sim.instances()
        assert job["reason"] == (f"budget: projected rented ${plan_usd + 3.29 * 135 / 3600:.2f} (1 h at $3.29/h, plus "
                                 f"135 s to stop) exceeds the ${plan_usd + 0.05:.2f} left of the $15.00 monthly budget "
                                 f"(${15.0 - plan_usd - 0.05:.2f} spent or committed)")
        # A cap raised by what the stop takes pays the launch: decided again, queued and launched.
        full = app.config
        app.use_config(full.model_copy(update={"budget": full.budget.model_copy(update={"monthly_cap_usd": 15.1})}))
        for _ in range(2):
            rec.tick()
        assert [e["data"]["state"] for e in app.store.events(job_id=job_id) if e["type"] == "job.redecided"] == [
            "queued"]
        assert app.store.get_job(job_id)["state"] == "running" and len(sim.instances()) == 1
        rec.close()
        provider.close()
    app.close()


def test_a_launch_the_budget_refuses_names_every_term_of_its_projection(tmp_path: Path) -> None:
    # The launch counts today's price, the billing minimum and the time to stop beside the work: a bigger figure
    # than the plan's hours at its price, so each term is named.
    app = App(state_dir_override=str(tmp_path / "state"))
    with app.store.tx() as c:
        c.execute(insert(s.ledger).values(month=month_key(time.time()), job_id=None, attempt_id=None, provider="sim",
                                          instance_id="i-0", instance_type="x", market="on-demand", rate_usd_h=5.0,
                                          started_at=0.0, ended_at=3600.0, cost_usd=5.0))
    rec = Reconciler(app, {}, cloud=None)
    why = rec.budget.problem(time.time(), rate_usd_h=12.0, minimum_s=60.0, expected_h=1.0)
    horizon_s = rec.budget.horizon_h() * 3600
    assert why == (f"budget: projected rented ${12.0 * (1.0 + horizon_s / 3600):.2f} (1 h at $12.00/h, plus "
                   f"{horizon_s:.0f} s to stop) exceeds the $10.00 left of the $15.00 monthly budget ($5.00 spent or "
                   "committed)")
    # Billed a minimum of two hours, a launch of one hour's work counts two.
    why = rec.budget.problem(time.time(), rate_usd_h=6.0, minimum_s=7200.0, expected_h=1.0)
    assert why is not None and why.startswith(f"budget: projected rented ${6.0 * (2.0 + horizon_s / 3600):.2f} (2 h "
                                              "at $6.00/h")
    app.close()


def test_the_budget_keeps_for_each_running_instance_the_time_its_job_s_last_checkpoint_may_take(
        tmp_path: Path) -> None:
    # A budget stop waits out the job's grace for its last checkpoint: a 10-minute grace on a $24/h instance spent
    # past the cap what the fixed 120 s had not kept.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _ = _running_on_the_cloud(app, tmp_path, "i-1")
    with app.store.tx() as c:
        spec = app.store.get_job(job_id)["spec"]
        app.store.update_job(job_id, c, spec={**spec, "checkpoint": {**spec["checkpoint"], "stop_grace_s": 600.0}})
    now = time.time()
    app.store.open_charge({"month": month_key(now), "job_id": job_id, "attempt_id": f"{job_id}-a1",
                           "provider": "sim", "instance_id": "i-1", "rate_usd_h": 24.0, "started_at": now})
    rec = Reconciler(app, {}, cloud=None)
    ((_, accruing, kept),) = rec.budget.exposure(now).values()
    assert accruing == 24.0 and kept == pytest.approx(24.0 * (3 * rec.budget.tick_s + 120 + 570) / 3600)
    assert rec.budget.horizon_h({}) * 3600 == pytest.approx(3 * rec.budget.tick_s + 120)  # the default grace: as before
    rec.close()
    app.close()


def test_show_says_how_far_a_job_is_and_what_its_instances_have_cost_so_far(tmp_path: Path) -> None:
    from orchestrator.cli.jobs import _progress

    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "watched", local_throughput=0, rented_throughput={"H100": 2.0}))
    now = time.time()
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state="preempted",
                                            provider="sim", instance_type="x", market="spot", created_at=0.0,
                                            info={"metrics": {"units_done": 0.25, "throughput_units_h": 2.0}}))
        c.execute(insert(s.attempts).values(id=f"{job_id}-a2", job_id=job_id, n=2, where="cloud", state="running",
                                            provider="sim", instance_type="x", market="spot", created_at=0.0,
                                            info={"metrics": {"units_done": 0.5, "throughput_units_h": "fast"}}))
        for attempt, cost, started in ((1, 0.75, now - 7200), (2, None, now - 1800)):
            c.execute(insert(s.ledger).values(month="2026-12", job_id=job_id, attempt_id=f"{job_id}-a{attempt}",
                                              provider="sim", rate_usd_h=1.5, started_at=started, cost_usd=cost))
    progress = _progress(app, app.store.get_job(job_id))
    # The newest attempt's figures (a speed that is not a number is not shown); the closed charge at its cost,
    # the open one at its rate for the half hour it has run.
    assert progress["units_done"] == 0.5 and progress["throughput_units_h"] is None
    assert progress["cloud_usd"] == pytest.approx(0.75 + 0.75, abs=0.01) and progress["accruing_usd_h"] == 1.5
    app.close()


def test_a_short_runs_measured_line_adds_up_and_says_the_meter_billed_more_than_it_ran(tmp_path: Path) -> None:
    # 126 s locally and 32 s in the cloud, billed 120 s (the provider's minimum and the boot): each part rounds
    # up, so the whole is their sum, not its own rounding; and a cost for "0.01 h" says what it was billed for.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "short", local_throughput=0.033, rented_throughput={"H100": 0.17},
                                          deadline_hours=12))
    job = app.store.get_job(job_id)
    t0 = time.time() - 600
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="local", state="preempted",
                                            provider="local", instance_type="local", info={}, created_at=0.0,
                                            started_at=t0, ended_at=t0 + 126))
        c.execute(insert(s.attempts).values(id=f"{job_id}-a2", job_id=job_id, n=2, where="cloud", state="succeeded",
                                            provider="sim", instance_type="x", market="spot", info={}, created_at=0.0,
                                            started_at=t0 + 200, ended_at=t0 + 232.4))
        c.execute(insert(s.ledger).values(month="2026-12", job_id=job_id, attempt_id=f"{job_id}-a2", provider="sim",
                                          rate_usd_h=1.5, started_at=t0 + 190, ended_at=t0 + 310,
                                          billed_seconds=120.0, cost_usd=0.05))
    with app.store.tx() as c:
        job_after_attempt(app, c, {"id": f"{job_id}-a2", "where": "cloud", "info": {}, "instance_id": None}, job,
                          AttemptState.SUCCEEDED, "completed", t0 + 240)
    record = Path(job["record_path"]).read_text()
    assert "- **Measured:** run 0.05 h (local 0.04 h, cloud 0.01 h), cost $0.05 cloud (billed 0.03 h: launch to " \
           "termination, at least the provider's minimum each) + $0.00 local" in record, record
    app.close()


def test_budget_shows_what_running_instances_accrue_and_what_is_kept_to_stop_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from orchestrator.cli import main
    from orchestrator.core.budget import month_key, stop_horizon_h

    app = App(state_dir_override=str(tmp_path / "state"))
    now = time.time()
    with app.store.tx() as c:
        c.execute(insert(s.ledger).values(month=month_key(now), job_id="j1", attempt_id="j1-a1", provider="sim",
                                          rate_usd_h=3.0, started_at=now - 60))
    _, decision, _ = enqueue(app, write_job(tmp_path, "queued", local_throughput=0, market="on-demand",
                                                 rented_throughput={"H100": 2.0}))  # 1 unit: 1.0 h at $3.00
    assert decision.plan is not None and decision.plan.rented_cost_usd == pytest.approx(3.0)
    app.close()
    assert main(["--state-dir", str(tmp_path / "state"), "budget", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["accruing_usd_h"] == 3.0
    kept = 3.0 * stop_horizon_h(5.0)  # 5 s tick
    assert shown["kept_to_stop_running_usd"] == pytest.approx(kept, abs=1e-4)
    # What new cycles can have: the rest, less the queued job's plan and what stopping the running one takes.
    assert (shown["held_usd"], shown["held_jobs"]) == (pytest.approx(3.0), 1)
    assert shown["free_usd"] == pytest.approx(shown["remaining_usd"] - 3.0 - kept, abs=1e-3)
    assert shown["cycles_left_on_demand"] == int(shown["free_usd"] // shown["usd_per_cycle_on_demand"])


def test_what_budget_keeps_to_stop_running_instances_is_at_the_running_daemons_tick_not_the_configs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `daemon --tick 60` takes up to three minutes to notice and act, not the config's three 5 s ticks: the daemon's
    # own guard reserves that, and `budget` counts the same.
    import json

    from orchestrator.cli import main
    from orchestrator.core.budget import month_key, stop_horizon_h
    from orchestrator.daemon import DaemonLock, run_daemon

    state = tmp_path / "state"
    app = App(state_dir_override=str(state))
    now = time.time()
    with app.store.tx() as c:
        c.execute(insert(s.ledger).values(month=month_key(now), job_id="j1", attempt_id="j1-a1", provider="sim",
                                          rate_usd_h=3.0, started_at=now - 60))
    assert run_daemon(app, tick_s=60.0, max_ticks=1) == 1
    assert app.store.get_setting("daemon", {})["tick_s"] == 60.0
    app.close()

    def kept() -> float:
        assert main(["--state-dir", str(state), "budget", "--json"]) == 0
        return float(json.loads(capsys.readouterr().out)["kept_to_stop_running_usd"])

    assert kept() == pytest.approx(3.0 * stop_horizon_h(5.0), abs=1e-4)  # no daemon runs: the next runs at 5 s
    running = DaemonLock(state)  # a daemon holds the state directory's lock, as the one above did while it ran
    running.acquire()
    try:
        assert kept() == pytest.approx(3.0 * stop_horizon_h(60.0), abs=1e-4)
    finally:
        running.release()


def test_a_queued_local_job_says_it_waits_for_the_local_gpu_while_another_run_holds_it(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    first, _, _ = enqueue(app, write_job(tmp_path, "first", local_throughput=1.0, deadline_hours=30))
    second, _, _ = enqueue(app, write_job(tmp_path, "second", local_throughput=1.0, deadline_hours=40))
    with app.store.tx() as c:  # the first one runs on the local GPU (local_concurrency 1)
        c.execute(insert(s.attempts).values(id=f"{first}-a1", job_id=first, n=1, where="local", state="running",
                                            provider="local", instance_type="local", info={}, created_at=0.0))
        c.execute(update(s.jobs).where(s.jobs.c.id == first).values(state="running"))
    Reconciler(app, {}, cloud=None).admission.schedule()
    waiting = app.store.get_job(second)
    assert (waiting["state"], waiting["reason"]) == ("queued", "waiting for the local GPU: 1 local run(s) use its 1 "
                                                     "slot(s) (daemon.local_concurrency); it starts when one ends")
    assert [e["type"] for e in app.store.events(job_id=second)][-1] == "job.waiting"
    app.close()


def test_a_queued_local_job_counts_the_run_started_ahead_of_it_in_the_same_tick(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # At a daemon's first tick, the earlier job takes the one slot: the later one said "0 local run(s) use its 1
    # slot(s)", a wait with nothing to wait for.
    app = App(state_dir_override=str(tmp_path / "state"))
    enqueue(app, write_job(tmp_path, "first", local_throughput=1.0, deadline_hours=30))
    second, _, _ = enqueue(app, write_job(tmp_path, "second", local_throughput=1.0, deadline_hours=40))
    rec = Reconciler(app, {}, cloud=None)
    monkeypatch.setattr(rec.local, "start", lambda job: True)  # the first one's run, started
    rec.admission.schedule()
    assert app.store.get_job(second)["reason"].startswith("waiting for the local GPU: 1 local run(s) use its 1 slot")
    app.close()


def _local_starts_of_a_schedule(app: App, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The jobs one schedule of a new reconciler starts on the local GPU (said, not run)."""
    rec = Reconciler(app, {}, cloud=None)
    started: list[str] = []
    monkeypatch.setattr(rec.local, "start", lambda job: started.append(job["id"]) or True)
    rec.admission.schedule()
    return started


def test_a_local_job_starts_behind_any_number_of_cloud_jobs_that_cannot(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # With the cloud unreachable, 30 cloud jobs due earlier had filled the window of candidates a tick reads, and
    # the local job behind them never started: the local GPU sat idle while its work waited.
    app = App(state_dir_override=str(tmp_path / "state"))
    for n in range(30):
        enqueue(app, write_job(tmp_path, f"cloud-{n}", local_throughput=0, deadline_hours=10 + n / 100))
    local_id, _, _ = enqueue(app, write_job(tmp_path, "local", local_throughput=1.0, deadline_hours=20))
    started = _local_starts_of_a_schedule(app, monkeypatch)
    assert started == [local_id]
    app.close()


def test_a_stored_job_that_no_longer_validates_fails_saying_why_and_the_others_are_scheduled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Jobs queued by a burstctl that checked less (a name shaped like a job id was refused only later): read
    # again at each tick, one such job raised in the middle of the schedule, and no job started or was decided
    # again, every tick.
    app = App(state_dir_override=str(tmp_path / "state"))
    old_queued, _, _ = enqueue(app, write_job(tmp_path, "old-queued", local_throughput=1.0, deadline_hours=10))
    old_blocked, _, _ = enqueue(app, write_job(tmp_path, "old-blocked", local_throughput=0, deadline_hours=11))
    for job_id, state in ((old_queued, "queued"), (old_blocked, "blocked")):
        job = app.store.get_job(job_id)
        app.store.update_job(job_id, state=state, spec={**job["spec"], "name": "j0123abcd"})
    behind, _, _ = enqueue(app, write_job(tmp_path, "behind", local_throughput=1.0, deadline_hours=20))
    started = _local_starts_of_a_schedule(app, monkeypatch)
    assert started == [behind]
    for job_id in (old_queued, old_blocked):
        failed = app.store.get_job(job_id)
        assert failed["state"] == "failed"
        assert failed["reason"].startswith("its stored spec: field 'name': 'j0123abcd' has the shape of a job id")
        assert failed["reason"].endswith("it was queued by a burstctl that checked less; fix its job file, then "
                                         "`burstctl retry` reads it again")
        assert [e["type"] for e in app.store.events(job_id=job_id)][-1] == "job.failed"
    app.close()


def test_a_cancel_committed_while_the_daemon_ends_the_jobs_attempt_stands(
        tmp_path: Path, postgres_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # On PostgreSQL (read committed) a `cancel` can commit between the daemon's read of the job and its update of
    # it, in the transaction that ends the attempt: the update had overwritten the cancel, and the job went on.
    config = tmp_path / "burstctl.toml"
    config.write_text(f'[state]\ndatabase_url = "{postgres_server.new_database()}"\n')
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "raced", local_throughput=1.0))
    now = time.time()
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="local", state="succeeded",
                                            info={}, created_at=now, started_at=now, ended_at=now))
    app.store.update_job(job_id, state="running")
    with app.store.engine.connect() as c:
        att = dict(c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id)).mappings().one())
    other = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))

    def cancel_meanwhile(*_: Any) -> list[Path]:  # the done job's checkpoints are trimmed between read and update
        with other.store.tx() as c:
            assert other.store.update_job(job_id, c, expect_state="running", state="cancelled",
                                          reason="cancelled by the user")
        return []

    monkeypatch.setattr(checkpoints, "trim_done", cancel_meanwhile)
    with app.store.tx() as conn:
        job_after_attempt(app, conn, att, app.store.get_job(job_id), AttemptState.SUCCEEDED, None, time.time())
    job = app.store.get_job(job_id)
    assert (job["state"], job["reason"]) == ("cancelled", "cancelled by the user")
    types = [e["type"] for e in app.store.events(job_id=job_id)]
    assert "job.done" not in types and types[-1] == "job.measured"
    other.close()
    app.close()


def test_any_number_of_jobs_waiting_for_their_pass_env_hide_no_job_that_can_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A sweep of 30 jobs naming a variable the daemon was started without, all due first, had filled the window of
    # candidates a tick reads: the job behind them never started, though nothing kept it.
    monkeypatch.delenv("SWEEP_TOKEN", raising=False)
    app = App(state_dir_override=str(tmp_path / "state"))
    sweep = [enqueue(app, write_job(tmp_path, f"sweep-{n}", local_throughput=1.0, deadline_hours=100 + n / 100,
                                    pass_env=["SWEEP_TOKEN"]))[0] for n in range(30)]
    other, _, _ = enqueue(app, write_job(tmp_path, "other", local_throughput=1.0, deadline_hours=200))
    rec = Reconciler(app, {}, cloud=None)
    started: list[str] = []
    monkeypatch.setattr(rec.local, "start", lambda job: started.append(job["id"]) or True)
    assert all(app.store.get_job(j)["placement"] == "local" for j in sweep)  # 30: more than the window of 1 + 20
    rec.admission.schedule()
    assert started == [other]
    waiting = app.store.get_job(sweep[0])
    assert waiting["reason"].startswith("pass_env: SWEEP_TOKEN is not set in the daemon's environment")
    # Given the variable (a daemon restarted with it: a new reconciler), they start, earliest deadline first.
    monkeypatch.setenv("SWEEP_TOKEN", "t")
    started.clear()
    rec = Reconciler(app, {}, cloud=None)
    monkeypatch.setattr(rec.local, "start", lambda job: started.append(job["id"]) or True)
    rec.admission.schedule()
    assert started == [sweep[0]]
    app.close()


def test_a_checkpoint_a_sync_brought_home_but_never_wrote_down_is_the_jobs_at_the_next_sync(tmp_path: Path) -> None:
    # The daemon was killed (or stopped past its wait) between a pull that made step 20 visible and the tick that
    # would have written it down. The next pull finds nothing new: step 20 is home already.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "synced", local_throughput=0))
    write_checkpoint(checkpoints.store_dir(app.config, job_id), "step-00000010", {"w.bin": b"1"})
    app.store.update_job(job_id, checkpoint="step-00000010")
    write_checkpoint(checkpoints.store_dir(app.config, job_id), "step-00000020", {"w.bin": b"2"})
    rec = Reconciler(app, {}, cloud=None)
    job = app.store.get_job(job_id)
    att = {"id": f"{job_id}-a1", "job_id": job_id, "state": "running", "info": {}}
    info: dict[str, Any] = {}
    nothing_new = SyncDone(at=time.time(), pulled=PulledCheckpoints([], TransferStats("rsync"), {}), logs=True)
    assert rec.syncs.write_down(att, job, info, nothing_new)
    assert app.store.get_job(job_id)["checkpoint"] == "step-00000020"
    app.close()


def test_a_checkpoint_that_fails_verification_on_its_way_home_is_said_once(tmp_path: Path) -> None:
    # It stays on the instance and an older one comes in its place; it had been said nowhere, sync after sync.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "torn", local_throughput=0))
    rec = Reconciler(app, {}, cloud=None)
    job = app.store.get_job(job_id)
    att = {"id": f"{job_id}-a1", "job_id": job_id, "state": "running", "info": {}}
    info: dict[str, Any] = {}
    torn = {"step-00000020": "w.bin: 3 bytes, its manifest says 8"}
    for _ in range(2):  # every sync meets it again
        done = SyncDone(at=time.time(), pulled=PulledCheckpoints([], TransferStats("rsync"), dict(torn)), logs=True)
        assert rec.syncs.write_down(att, job, info, done)
    said = app.store.events(job_id=job_id, type_prefix="checkpoint.rejected")
    assert [(e["data"]["checkpoint"], e["data"]["problem"], e["attempt_id"]) for e in said] == [
        ("step-00000020", "w.bin: 3 bytes, its manifest says 8", f"{job_id}-a1")]
    app.close()


def test_an_attempt_remembers_its_newest_twenty_rejections_each_for_where_it_was_pulled_from(tmp_path: Path) -> None:
    # A trainer writing bad checkpoints for days keeps the attempt's info small. S3's copy of a checkpoint is not the
    # instance's (it was verified before it went up): one rejected from S3 is still fetched from the instance when
    # S3 refuses the daemon's key.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "rotting", local_throughput=0))
    rec = Reconciler(app, {}, cloud=None)
    job = app.store.get_job(job_id)
    att = {"id": f"{job_id}-a1", "job_id": job_id, "state": "running", "info": {}}
    info: dict[str, Any] = {}
    for n in range(1, 26):
        name = f"step-{n:08d}"
        pulled = PulledCheckpoints([], TransferStats("s3"), {name: "torn"}, rejected_manifests={name: f"m{n}"})
        assert rec.syncs.write_down(att, job, info, SyncDone(at=time.time(), pulled=pulled))
    assert checkpoints.rejected_before(info, "s3") == {(f"step-{n:08d}", f"m{n}") for n in range(6, 26)}
    assert checkpoints.rejected_before(info, "instance") == frozenset()
    assert len(info["rejected_said"]) == 20
    app.close()


def _running_in_the_cloud(app: App, tmp_path: Path, name: str) -> tuple[str, str]:
    """A job that does not fit locally, running on its first cloud attempt: (job id, attempt id)."""
    job_id, _, _ = enqueue(app, write_job(tmp_path, name, local_throughput=0))
    att_id = f"{job_id}-a1"
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=att_id, job_id=job_id, n=1, where="cloud", state="running",
                                            provider="sim", instance_type="gpu", info={}, created_at=0.0))
        c.execute(update(s.jobs).where(s.jobs.c.id == job_id).values(state="running"))
    return job_id, att_id


def test_a_sync_beside_the_tick_that_failed_is_on_record_though_the_pull_right_after_it_succeeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The run exited while its periodic pull was under way, and that pull was killed; the final pull that follows
    # brings the checkpoint home. Both happened: the trail keeps the failure.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, att_id = _running_in_the_cloud(app, tmp_path, "killed-sync")
    rec = Reconciler(app, {}, cloud=None)
    killed = SyncDone(at=time.time(), error=RuntimeError("rsync was killed by signal 9 while pulling step-00000040"))
    monkeypatch.setattr(rec.syncs.pool, "take", lambda attempt_id, wait=False: killed if attempt_id == att_id else None)
    write_checkpoint(checkpoints.store_dir(app.config, job_id), "step-00000040", {"w.bin": b"4"})
    home = PulledCheckpoints([checkpoints.store_dir(app.config, job_id) / "step-00000040"], TransferStats("rsync"), {})
    monkeypatch.setattr(rec.syncs, "transfers", lambda *args, **kwargs: SyncDone(at=time.time(), pulled=home))
    att = {"id": att_id, "job_id": job_id, "state": "running", "info": {}, "provider": "sim", "instance_type": "gpu"}
    info: dict[str, Any] = {}
    assert rec.syncs.pull_now(att, app.store.get_job(job_id), info)
    (failed,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "checkpoint.sync_failed"]
    assert "killed by signal 9" in failed["data"]["error"]
    after = app.store.get_job(job_id)
    assert after["checkpoint"] == "step-00000040" and "sync_error" not in info
    assert not (after["reason"] or "").startswith(attempt_syncs.SYNC_FAILING)
    app.close()


def test_a_run_s_last_sync_runs_beside_the_tick_and_is_taken_by_its_own_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A run that ended left its newest checkpoint (20 GB, say) to a pull inside the tick, which held up every other
    # attempt's heartbeat check, notice and stop for minutes. It runs beside the tick now; the attempt's step waits
    # for it tick by tick, and a periodic sync under way as the run ended is taken first, then the last one runs.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, att_id = _running_in_the_cloud(app, tmp_path, "large-end")
    rec = Reconciler(app, {}, cloud=None)
    store = checkpoints.store_dir(app.config, job_id)
    gates = {"step-00000030": threading.Event(), "step-00000040": threading.Event()}
    finals: list[bool] = []

    def sync_beside(att: dict[str, Any], job: dict[str, Any], *, outputs: bool = False) -> SyncDone:
        name = "step-00000040" if outputs else "step-00000030"
        finals.append(outputs)
        assert gates[name].wait(10)
        write_checkpoint(store, name, {"w.bin": name.encode()})
        return SyncDone(at=time.time(), pulled=PulledCheckpoints([store / name], TransferStats("rsync"), {}))

    monkeypatch.setattr(rec.syncs, "beside", sync_beside)
    job = app.store.get_job(job_id)
    att = {"id": att_id, "job_id": job_id, "state": "running", "info": {}, "provider": "sim", "instance_type": "gpu"}
    rec.syncs.pool.start(att_id, lambda: sync_beside(att, job))  # a periodic pull, under way as the run ends
    info: dict[str, Any] = {}
    started = time.monotonic()
    assert not rec.syncs.final(att, job, info)  # the periodic one has not finished: nothing waited for
    gates["step-00000030"].set()
    deadline = time.monotonic() + 10
    while not rec.syncs.pool.finished():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not rec.syncs.final(att, job, info)  # the periodic one is written down; the last one is under way
    assert app.store.get_job(job_id)["checkpoint"] == "step-00000030" and finals == [False, True]
    assert time.monotonic() - started < 5  # no step waited for a pull
    gates["step-00000040"].set()
    while not rec.syncs.pool.finished():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    rec.syncs.collect()  # the start of the next tick leaves it to the attempt's own step
    assert rec.syncs.pool.busy(att_id)
    assert rec.syncs.final(att, job, info)
    assert app.store.get_job(job_id)["checkpoint"] == "step-00000040" and not rec.syncs.pool.busy(att_id)
    rec.syncs.pool.close()
    app.close()


def test_a_cloud_job_is_looked_at_behind_any_number_of_cloud_jobs_waiting_for_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 30 jobs due earlier wait: for spot (their policy idles until it is back), or after a failed launch. They had
    # filled the window of candidates a tick reads, and a job behind them that could start was never looked at.
    (tmp_path / "burstctl.toml").write_text("[budget]\nmonthly_cap_usd = 1000\n")  # room for all of them
    app = App(config_path=str(tmp_path / "burstctl.toml"), state_dir_override=str(tmp_path / "state"))
    waiting = [enqueue(app, write_job(tmp_path, f"spot-{n}", local_throughput=0, deadline_hours=10 + n / 100))[0]
               for n in range(30)]
    later_id, _, _ = enqueue(app, write_job(tmp_path, "later", local_throughput=0, deadline_hours=20))
    now = time.time()
    for job_id in waiting:
        app.store.update_job(job_id, wait_until=now + 60)
    clock = [now]
    rec = Reconciler(app, {}, cloud=None, clock=lambda: clock[0])  # no provider: a job looked at is blocked, saying so
    rec.admission.schedule()
    assert app.store.get_job(later_id)["state"] == "blocked"
    assert {app.store.get_job(j)["state"] for j in waiting} == {"queued"}
    # One moved home meanwhile (revert-local): its wait was for a launch, and it starts on the local GPU now.
    app.store.update_job(waiting[1], placement="local")
    started: list[str] = []
    monkeypatch.setattr(rec.local, "start", lambda job: started.append(job["id"]) or True)
    rec.admission.schedule()
    assert started == [waiting[1]]
    clock[0] = now + 61  # their time is up: looked at again, earliest deadline first
    rec.admission.schedule()
    assert app.store.get_job(waiting[0])["state"] == "blocked"
    app.close()


def test_local_only_runs_here_late_the_jobs_that_fit_and_never_decides_them_back_to_the_cloud(tmp_path: Path) -> None:
    # After revert-local, a job brought home that is late here is not decided again to a burst the switch blocks,
    # and one queued for the cloud meanwhile runs here too, until `burst-enable` puts both back on their plans.
    app = App(state_dir_override=str(tmp_path / "state"))
    late = dict(local_throughput=0.05, deadline_hours=10, rented_throughput={"H100": 2.0})  # 20 h here, due in 10
    home, decision, _ = enqueue(app, write_job(tmp_path, "home", **late))
    assert decision.placement in ("cloud", "hybrid")
    rec = Reconciler(app, {}, cloud=None)
    revert.revert_local(app, rec, timeout_s=5)
    assert app.store.get_job(home)["placement"] == "local"
    rec.admission._redecide_late_in_line([app.store.get_job(home)], time.time())
    job = app.store.get_job(home)
    assert (job["state"], job["placement"]) == ("queued", "local")
    assert not [e for e in app.store.events(job_id=home) if e["type"] == "job.redecided"]

    queued, decided, _ = enqueue(app, write_job(tmp_path, "meanwhile", **late))  # queued while local-only
    job = app.store.get_job(queued)
    assert decided.placement in ("cloud", "hybrid") and (job["state"], job["placement"]) == ("queued", "local")
    assert job["reason"].startswith(f"{REQUEUED_LOCAL} while bursting is disabled")
    big, _, _ = enqueue(app, write_job(tmp_path, "big", local_throughput=0))  # does not fit here: it waits
    assert app.store.get_job(big)["state"] == "blocked"
    # One the switch blocked before this rule (an older burstctl) runs here too once it is decided again.
    revert.set_burst_enabled(app, True, "test")
    older, _, _ = enqueue(app, write_job(tmp_path, "older", **late))
    revert.set_burst_enabled(app, False, "test")
    with app.store.tx() as c:
        app.store.update_job(older, c, state="blocked", reason="bursting is disabled (revert-local)")
    rec.admission._redecide_blocked(time.time())
    job = app.store.get_job(older)
    assert (job["state"], job["placement"]) == ("queued", "local") and REQUEUED_LOCAL in job["reason"]
    assert app.store.get_job(big)["state"] == "blocked"
    # One queued for the cloud as the switch went off (enqueued beside revert-local) goes home at its start.
    revert.set_burst_enabled(app, True, "test")
    racing, _, _ = enqueue(app, write_job(tmp_path, "racing", **late))
    revert.set_burst_enabled(app, False, "test")
    assert app.store.get_job(racing)["placement"] in ("cloud", "hybrid")
    assert not rec.admission._start_cloud_attempt(app.store.get_job(racing), time.time())
    job = app.store.get_job(racing)
    assert (job["state"], job["placement"]) == ("queued", "local")

    revert.set_burst_enabled(app, True, "test")
    assert sorted(revert.restore_plans(app)) == sorted([home, queued, racing, older])
    app.close()


def _running_on_the_cloud(app: App, tmp_path: Path, instance_id: str | None = None, *,
                          started_ago_s: float | None = None) -> tuple[str, Callable[[], dict[str, Any]]]:
    """A job with a cloud attempt running (on `instance_id`; none: no instance behind it; started `started_ago_s`
    ago), and a reader of that attempt's row as it is now."""
    job_id, _, _ = enqueue(app, write_job(tmp_path, "running", local_throughput=0, rented_throughput={"H100": 2.0}))
    with app.store.tx() as c:
        app.store.update_job(job_id, c, state="running")
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state="running",
                                            provider="sim", instance_type="gpu_1x_h100", market="spot",
                                            instance_id=instance_id, idempotency_key=f"{job_id}-k1", info={},
                                            created_at=time.time(),
                                            started_at=None if started_ago_s is None else time.time() - started_ago_s))

    def attempt() -> dict[str, Any]:
        with app.store.engine.connect() as c:
            return dict(c.execute(select(s.attempts).where(s.attempts.c.id == f"{job_id}-a1")).mappings().one())

    return job_id, attempt


def test_a_stop_begun_by_a_daemon_killed_while_the_trainer_checkpoints_is_carried_on_not_taken_for_a_preemption(
        tmp_path: Path) -> None:
    # A move to on-demand tells the trainer to checkpoint and exit, and waits for it. A daemon killed then had
    # written nothing: the next one read the trainer's exit as "stopped from outside" and counted a preemption
    # (in the report, the record and the learned preemption rate). The reason is written before the trainer is told.
    from orchestrator.lifecycle.market_switch import TO_ON_DEMAND

    class Killed(BaseException):
        """The daemon's end, as a SIGKILL would come: nothing after it runs."""

    class DiesWhileTheTrainerCheckpoints:
        def request_checkpoint(self, att: dict[str, Any]) -> None:
            raise Killed

    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path)
    job = app.store.get_job(job_id)

    assert Reconciler(app, {}, cloud=None).stop_reason(attempt(), job) is None
    dying = Reconciler(app, {}, cloud=DiesWhileTheTrainerCheckpoints())  # type: ignore[arg-type]
    with pytest.raises(Killed):
        dying.stop(attempt(), job, None, TO_ON_DEMAND)  # type: ignore[arg-type]
    assert attempt()["state"] == "running"
    assert Reconciler(app, {}, cloud=None).stop_reason(attempt(), job) == TO_ON_DEMAND  # the next daemon's
    app.close()


def test_a_stop_waits_for_the_last_checkpoint_tick_by_tick_without_holding_up_the_tick(tmp_path: Path) -> None:
    # A stopped run whose trainer takes 25 s to write its last checkpoint held the whole tick that long: no other
    # job was synced, heartbeat-checked or told of a notice. The stop is asked once, then looked at each tick.
    class Checkpointing:
        asked = looked = 0

        def request_checkpoint(self, att: dict[str, Any]) -> None:
            self.asked += 1

        def status(self, att: dict[str, Any]) -> dict[str, Any]:
            self.looked += 1
            return {"supervisor_alive": True, "exit": None}  # still writing it

    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path)
    cloud = Checkpointing()
    rec = Reconciler(app, {}, cloud=cloud)  # type: ignore[arg-type]

    for _ in range(3):
        started = time.monotonic()
        rec.wind_down(attempt(), app.store.get_job(job_id), None, "budget-cap")  # type: ignore[arg-type]
        assert time.monotonic() - started < 5.0
    assert cloud.asked == 1 and attempt()["state"] == "running"
    assert attempt()["info"]["stopping_for"] == "budget-cap"
    # Over SSH: whether the run had ended well, then after the SIGTERM; from then on one look a tick serves both.
    assert cloud.looked == 2 + 1 + 1
    app.close()


class _Stoppable:
    """Cloud steps and a provider for attempts being stopped: the trainer has written its last checkpoint and
    exited; the instance is gone once terminated."""

    name = "sim"

    def __init__(self) -> None:
        self.terminated: list[str] = []

    def request_checkpoint(self, att: dict[str, Any]) -> None:
        pass

    def status(self, att: dict[str, Any]) -> dict[str, Any]:
        return {"supervisor_alive": False, "exit": {"reason": "terminated", "exit_code": 143}}

    def release_s3(self, att: dict[str, Any], job: dict[str, Any]) -> None:
        pass

    def checkpoints_outlive_instance(self, att: dict[str, Any], job: dict[str, Any]) -> bool:
        return False

    def terminate(self, ids: list[str]) -> None:
        self.terminated += ids

    def describe(self, ids: list[str]) -> dict[str, InstanceInfo]:
        return {i: InstanceInfo(id=i, state=InstanceState.RUNNING, instance_type="x", market=Market.SPOT)
                for i in ids if i not in self.terminated}

    def list_owned(self) -> list[InstanceInfo]:
        return []

    def offers(self) -> list[Offer]:
        return []


class _Reclaimed(_Stoppable):
    """As `_Stoppable`, with the instance reclaimed: the provider describes it as gone."""

    def describe(self, ids: list[str]) -> dict[str, InstanceInfo]:
        return {}


def _until_a_sync_finished(rec: Reconciler) -> None:
    deadline = time.monotonic() + 10
    while not rec.syncs.pool.finished():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _last_checkpoint_beside(rec: Reconciler, app: App, release: Callable[[], None]
                            ) -> Callable[..., SyncDone]:
    """A stand-in for a stop's last sync on its thread: it waits for `release`, then brings step 50 home."""
    def sync_beside(att: dict[str, Any], job: dict[str, Any], *, outputs: bool = False) -> SyncDone:
        release()
        store = checkpoints.store_dir(app.config, job["id"])
        write_checkpoint(store, "step-00000050", {"w.bin": b"5"})
        return SyncDone(at=time.time(), pulled=PulledCheckpoints([store / "step-00000050"], TransferStats("rsync"), {}))
    return sync_beside


def test_a_stop_brings_the_last_checkpoint_home_beside_the_tick_then_ends_the_attempt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cancel, the budget or revert-local pulled the stopped run's last checkpoint inside the tick: a 20 GB one held
    # up every other attempt's heartbeat check, notice and stop for minutes. It is pulled on a sync thread now; the
    # attempt's step looks each tick, and the instance goes once the checkpoint is home.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1")
    cloud = _Stoppable()
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud)  # type: ignore[dict-item, arg-type]
    pulled = threading.Event()
    monkeypatch.setattr(rec.syncs, "beside", _last_checkpoint_beside(rec, app, lambda: pulled.wait(10)))

    for _ in range(3):
        started = time.monotonic()
        rec.wind_down(attempt(), app.store.get_job(job_id), cloud, "budget-cap")  # type: ignore[arg-type]
        assert time.monotonic() - started < 5.0, "the tick is not held up by the pull"
    assert attempt()["state"] == "running" and not cloud.terminated
    rec.syncs.collect()  # the start of a tick leaves the stop's sync to the attempt's own step
    pulled.set()
    _until_a_sync_finished(rec)
    rec.syncs.collect()
    rec.wind_down(attempt(), app.store.get_job(job_id), cloud, "budget-cap")  # type: ignore[arg-type]
    assert attempt()["state"] == "aborted" and cloud.terminated == ["i-1"]
    assert app.store.get_job(job_id)["checkpoint"] == "step-00000050"
    (synced,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "checkpoint.synced"]
    assert synced["data"]["checkpoints"] == ["step-00000050"]
    rec.close()
    app.close()


class _Noticed(_Stoppable):
    """A run going on whose supervisor has heard a spot interruption notice (`notice`, as its heartbeat says it)."""

    def __init__(self, notice: dict[str, Any]) -> None:
        super().__init__()
        self.notice = notice

    def status(self, att: dict[str, Any]) -> dict[str, Any]:
        return {"supervisor_alive": True, "exit": None, "heartbeat": {"ts": time.time(), "notice": self.notice}}


def test_a_notice_launches_the_next_instance_while_the_checkpoint_comes_home_beside_the_tick(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a spot notice the daemon pulled the newest checkpoint inside the tick, then launched the next instance: a
    # 20 GB pull took the two minutes the notice gives before the launch began, and held up every other attempt's
    # notice. The pull starts first, beside the tick; the launch follows at once; and until the reclaim a pull
    # starts again each tick, for what the trainer writes meanwhile.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1")

    cloud = _Noticed({"time": "2026-12-04T03:00:00Z"})
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud)  # type: ignore[dict-item, arg-type]
    pulled = threading.Event()
    pulls: list[float] = []
    beside = _last_checkpoint_beside(rec, app, lambda: pulled.wait(10))
    monkeypatch.setattr(rec.syncs, "beside", lambda *a, **k: pulls.append(time.monotonic()) or beside(*a, **k))
    launched: list[float] = []
    monkeypatch.setattr(reconcile, "launch_successor",
                        lambda rec, att, job, now: launched.append(time.monotonic()) or False)

    started = time.monotonic()
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5.0, "the tick is not held up by the pull"
    assert len(pulls) == 1 and len(launched) == 1 and pulls[0] <= launched[0] and not pulled.is_set()
    reason = app.store.get_job(job_id)["reason"]
    assert reason == ("spot interruption notice: sim reclaims the instance at 2026-12-04T03:00:00Z; its newest "
                      "checkpoint is coming home (none is home yet); it resumes elsewhere")
    assert "notice_seen_at" in attempt()["info"]
    pulled.set()
    _until_a_sync_finished(rec)
    rec.syncs.collect()
    job = app.store.get_job(job_id)
    assert job["checkpoint"] == "step-00000050"
    assert job["reason"] == ("spot interruption notice: sim reclaims the instance at 2026-12-04T03:00:00Z; its newest "
                             "checkpoint is coming home (step-00000050 is home); it resumes elsewhere")
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    assert len(pulls) == 2 and len(launched) == 1  # pulled again at the next tick; launched once
    rec.close()
    app.close()


@pytest.mark.parametrize("written", [False, True])
def test_a_notice_written_down_without_its_successor_gets_one_at_the_next_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: bool) -> None:
    # A daemon died after writing the notice down and before the next instance was written (or before it noted the
    # one it wrote, `written`). The next daemon saw the notice as already handled and launched nothing until the
    # reclaim ended the attempt. Now its look at the running attempt launches the successor, once: one already
    # written (here ended, a refused launch) is noted, not written again.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1")
    notice = {"time": "2026-12-04T03:00:00Z"}
    now = time.time()
    with app.store.tx() as c:
        c.execute(update(s.attempts).where(s.attempts.c.id == f"{job_id}-a1").values(
            info={"notice": {"reclaim_at": notice["time"]}, "notice_seen_at": now, "last_seen_at": now}))
        if written:
            c.execute(insert(s.attempts).values(id=f"{job_id}-a2", job_id=job_id, n=2, where="cloud",
                                                state="launch_failed", provider="sim", instance_type="gpu_1x_h100",
                                                market="spot", idempotency_key=f"{job_id}-k2",
                                                info={"successor_for": f"{job_id}-a1"}, created_at=now))

    cloud = _Noticed(notice)
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud)  # type: ignore[dict-item, arg-type]
    monkeypatch.setattr(rec.syncs, "beside", _last_checkpoint_beside(rec, app, lambda: None))
    launched: list[str] = []
    monkeypatch.setattr(reconcile, "launch_successor",
                        lambda rec, att, job, now: launched.append(att["id"]) or f"{job_id}-a3")
    for _ in range(2):
        rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    assert launched == ([] if written else [f"{job_id}-a1"])
    assert attempt()["info"]["notice"] == {"reclaim_at": notice["time"],
                                           "successor": f"{job_id}-a2" if written else f"{job_id}-a3"}
    assert app.store.get_job(job_id)["reason"].endswith("; its next instance is launching")
    rec.close()
    app.close()


def test_a_running_attempt_whose_step_failed_is_still_watched_and_hears_a_notice_while_it_waits_for_its_next_try(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A running attempt's step failed (here the look at its supervisor). For the wait before its next try (2 s, then
    # up to 15 s) nothing looked at the run: a spot notice (30 s on GCP), a stale heartbeat, the syncs waited for it.
    # The run is watched through the wait; failing again then is the same failure, counted at its next try.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1")
    heard: dict[str, Any] = {}

    class Failing(_Stoppable):
        def status(self, att: dict[str, Any]) -> dict[str, Any]:
            if not heard:
                raise RuntimeError("the supervisor's status is unreadable")
            return {"supervisor_alive": True, "exit": None, "heartbeat": {"ts": time.time(), **heard}}

    cloud = Failing()
    now = time.time()
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud, clock=lambda: now)  # type: ignore[dict-item, arg-type]
    monkeypatch.setattr(rec.syncs, "beside", _last_checkpoint_beside(rec, app, lambda: None))
    monkeypatch.setattr(reconcile, "launch_successor", lambda rec, att, job, now: None)

    for _ in range(2):  # failed, then failed again in the wait: counted once
        rec._advance(attempt(), app.store.get_job(job_id))
        assert attempt()["info"]["errors"] == 1 and attempt()["info"]["retry_at"] > now
    assert len(app.store.events(type_prefix="attempt.error")) == 1
    heard["notice"] = {"time": "2026-12-04T03:00:00Z"}  # the supervisor reads again, and has heard a notice
    rec._advance(attempt(), app.store.get_job(job_id))  # still in the wait
    assert [e["attempt_id"] for e in app.store.events(type_prefix="instance.interruption_notice")] == [f"{job_id}-a1"]
    info = attempt()["info"]
    assert info["notice"]["reclaim_at"] == "2026-12-04T03:00:00Z" and "errors" not in info
    rec.close()
    app.close()


def test_a_run_found_finished_by_a_stop_brings_its_end_home_beside_the_tick_then_succeeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # revert-local (or the budget) finds a run that has just exited 0: it is finished, not stopped. Its final
    # checkpoint was pulled inside the tick; now it comes home beside it, the attempt waiting at `finishing`.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1")

    class Completed(_Stoppable):
        def status(self, att: dict[str, Any]) -> dict[str, Any]:
            return {"supervisor_alive": False, "exit": {"reason": "completed", "exit_code": 0}}

    cloud = Completed()
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud)  # type: ignore[dict-item, arg-type]
    pulled = threading.Event()
    monkeypatch.setattr(rec.syncs, "beside", _last_checkpoint_beside(rec, app, lambda: pulled.wait(10)))
    for _ in range(2):
        started = time.monotonic()
        rec.wind_down(attempt(), app.store.get_job(job_id), cloud, "revert-local")  # type: ignore[arg-type]
        assert time.monotonic() - started < 5.0, "the tick is not held up by the pull"
        rec.syncs.collect()  # the start of a tick leaves a finishing attempt's last sync to its own step
    assert attempt()["state"] == "finishing" and not cloud.terminated
    pulled.set()
    _until_a_sync_finished(rec)
    rec.syncs.collect()
    rec.wind_down(attempt(), app.store.get_job(job_id), cloud, "revert-local")  # type: ignore[arg-type]
    assert attempt()["state"] == "succeeded" and cloud.terminated == ["i-1"]
    job = app.store.get_job(job_id)
    assert (job["state"], job["checkpoint"]) == ("done", "step-00000050")
    rec.close()
    app.close()


def test_a_loss_waits_for_the_sync_under_way_so_what_it_brings_home_is_not_lost_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # After a notice a pull is under way each tick; the reclaim comes during one. Ended at once, the attempt had
    # counted an hour of work lost that the pull then brought home, and its successor took over while the pull
    # still held the job's checkpoint store.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1", started_ago_s=3600)

    cloud = _Reclaimed()
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud)  # type: ignore[dict-item, arg-type]
    pulled = threading.Event()
    monkeypatch.setattr(rec.syncs, "beside", _last_checkpoint_beside(rec, app, lambda: pulled.wait(10)))
    rec.syncs.sync(attempt(), app.store.get_job(job_id), {}, urgent=True)
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    assert attempt()["state"] == "running" and "loss_seen_at" in attempt()["info"]
    pulled.set()
    _until_a_sync_finished(rec)
    rec.syncs.collect()
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    assert attempt()["state"] == "preempted"
    (preempted,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "instance.preempted"]
    assert preempted["data"]["lost_work_h"] < 0.01  # not the hour since the attempt began
    assert app.store.get_job(job_id)["checkpoint"] == "step-00000050"
    rec.close()
    app.close()


def _lost_while_a_pull_outlasts_its_wait(app: App, job_id: str, attempt: Callable[[], dict[str, Any]],
                                         monkeypatch: pytest.MonkeyPatch) -> tuple[Reconciler, threading.Event]:
    """A pull of the running attempt's last checkpoint under way (held until the event is set) when its instance is
    reclaimed, and the loss written down once the pull has outlasted the heartbeat timeout: (the reconciler, the
    event that lets the pull end)."""
    now = [time.time()]
    cloud = _Reclaimed()
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud, clock=lambda: now[0])  # type: ignore[dict-item, arg-type]
    pulled = threading.Event()
    monkeypatch.setattr(rec.syncs, "beside", _last_checkpoint_beside(rec, app, lambda: pulled.wait(10)))
    rec.syncs.sync(attempt(), app.store.get_job(job_id), {}, urgent=True)
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    now[0] += app.config.daemon.heartbeat_timeout_s + 1  # the pull outlasts the loss's wait
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    return rec, pulled


def test_a_pull_that_ends_after_the_loss_was_written_down_corrects_the_work_counted_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The loss waits for a pull under way only up to the heartbeat timeout; one that lands later brought home work
    # the attempt had counted as lost, and the figure (which the market switch's useful hours read) stayed an hour.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1", started_ago_s=3600)

    rec, pulled = _lost_while_a_pull_outlasts_its_wait(app, job_id, attempt, monkeypatch)
    assert attempt()["state"] == "preempted" and attempt()["lost_work_h"] == pytest.approx(1.0, abs=0.01)

    pulled.set()
    _until_a_sync_finished(rec)
    rec.syncs.collect()
    assert attempt()["lost_work_h"] < 0.01 and app.store.get_job(job_id)["checkpoint"] == "step-00000050"
    (corrected,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "attempt.lost_work_corrected"]
    assert corrected["data"]["counted_before"] == pytest.approx(1.0, abs=0.01)
    assert corrected["data"]["checkpoint"] == "step-00000050"
    rec.close()
    app.close()


def test_a_pull_that_ends_after_the_loss_brings_home_the_checkpoint_said_lost_and_that_is_said_and_shown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, burstctl_here: Callable[..., Any]) -> None:
    # The supervisor said the instance held step 50; step 40 was home when the reclaim was written down, so step 50
    # was said lost (`checkpoint.lost`, the job's reason, show, logs). The pull under way then brought step 50 home
    # after all, and they all went on saying it was lost and that the job went back to step 40.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1", started_ago_s=3600)
    write_checkpoint(checkpoints.store_dir(app.config, job_id), "step-00000040", {"w.bin": b"4"})
    with app.store.tx() as c:
        app.store.set_attempt_info(f"{job_id}-a1", {"instance_checkpoint": "step-00000050"}, c)
    rec, pulled = _lost_while_a_pull_outlasts_its_wait(app, job_id, attempt, monkeypatch)
    job = app.store.get_job(job_id)
    assert attempt()["state"] == "preempted" and job["state"] == "resuming"
    assert job["reason"].endswith("; its checkpoint step-00000050 was lost with its instance")
    state = ["--state-dir", str(tmp_path / "state")]
    shown = burstctl_here(*state, "show", job_id).stdout
    assert "lost: attempt 1's checkpoint step-00000050 did not come home" in shown
    (run := tmp_path / "state" / "runs" / f"{job_id}-a1").mkdir(parents=True, exist_ok=True)
    (run / "train.log").write_text("step 50\n")
    assert "its checkpoint step-00000050 was lost" in burstctl_here(*state, "logs", job_id, "--attempt", "1").stderr

    pulled.set()
    _until_a_sync_finished(rec)
    rec.syncs.collect()
    job = app.store.get_job(job_id)
    assert job["checkpoint"] == "step-00000050"
    (corrected,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "checkpoint.lost_corrected"]
    assert corrected["attempt_id"] == f"{job_id}-a1"
    assert {k: corrected["data"][k] for k in ("checkpoint", "said_resumes_from", "resumes_from")} == {
        "checkpoint": "step-00000050", "said_resumes_from": "step-00000040", "resumes_from": "step-00000050"}
    assert corrected["data"]["reason"] == ("step-00000050 came home after all, with a pull that ended after the "
                                           "instance's loss was written down: the job resumes from it")
    assert job["reason"].endswith("; its checkpoint step-00000050, said lost with its instance, came home after all")
    shown = burstctl_here(*state, "show", job_id).stdout
    assert "lost: attempt 1" not in shown
    assert "home after all: attempt 1's checkpoint step-00000050, said lost with its instance, came home" in shown
    logs = burstctl_here(*state, "logs", job_id, "--attempt", "1")
    assert logs.returncode == 0 and "was lost" not in logs.stderr, logs.stderr
    assert checkpoints.resume_point(app, job_id).name == "step-00000050"  # what the next attempt starts from
    rec.close()
    app.close()


def test_a_run_lost_on_an_instance_still_there_brings_what_it_wrote_home_before_the_instance_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The trainer was stopped outside burstctl (an OOM kill, a reboot): the instance answers, with up to half a
    # checkpoint interval written since the last sync. Terminated at once, that work went with it.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1", started_ago_s=3600)
    cloud = _Stoppable()  # its trainer says it was terminated, not by burstctl
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud)  # type: ignore[dict-item, arg-type]
    pulled = threading.Event()
    monkeypatch.setattr(rec.syncs, "beside", _last_checkpoint_beside(rec, app, lambda: pulled.wait(10)))
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    assert attempt()["state"] == "running" and cloud.terminated == []  # its last pull under way
    pulled.set()
    _until_a_sync_finished(rec)
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    assert attempt()["state"] == "preempted" and cloud.terminated == ["i-1"]
    (preempted,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "instance.preempted"]
    assert preempted["data"]["lost_work_h"] < 0.01 and app.store.get_job(job_id)["checkpoint"] == "step-00000050"
    rec.close()
    app.close()


def test_work_since_a_checkpoint_counts_from_when_the_trainer_wrote_it_not_from_when_it_came_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Synced every half interval, a checkpoint comes home up to that long after it was written: counted from the
    # pull, the work lost at a reclaim, and the unsaved hours the spot policy's safety net weighs, read too little.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1", started_ago_s=3600)
    written = time.time() - 1200

    def sync_beside(att: dict[str, Any], job: dict[str, Any], *, outputs: bool = False) -> SyncDone:
        store = checkpoints.store_dir(app.config, job["id"])
        path = write_checkpoint(store, "step-00000050", {"w.bin": b"5"})
        manifest = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**manifest, "created_at": written}))
        return SyncDone(at=time.time(), pulled=PulledCheckpoints([path], TransferStats("rsync"), {}))

    cloud = _Reclaimed()
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud)  # type: ignore[dict-item, arg-type]
    monkeypatch.setattr(rec.syncs, "beside", sync_beside)
    rec.syncs.sync(attempt(), app.store.get_job(job_id), {})
    _until_a_sync_finished(rec)
    rec.syncs.collect()
    assert attempt()["info"]["last_checkpoint_at"] == pytest.approx(written)
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    (preempted,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "instance.preempted"]
    assert preempted["data"]["lost_work_h"] == pytest.approx(1 / 3, abs=0.01)
    rec.close()
    app.close()


def test_work_lost_counts_up_to_when_the_loss_was_seen_not_to_the_end_of_its_last_pull(tmp_path: Path) -> None:
    # The trainer died 10 min after its last checkpoint; the loss's last pull then took half an hour, during which
    # nothing ran that could be lost.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1", started_ago_s=7200)
    seen = time.time()
    rec = Reconciler(app, {"sim": _Stoppable()}, cloud=_Stoppable(),  # type: ignore[dict-item, arg-type]
                     clock=lambda: seen + 1800)
    info = {"last_checkpoint_at": seen - 600, "loss_seen_at": seen, "loss_synced": True}
    inst = InstanceInfo(id="i-1", state=InstanceState.RUNNING, instance_type="x", market=Market.SPOT)
    rec._lost(attempt(), app.store.get_job(job_id), rec.providers["sim"], inst, "heartbeat lost (stale)", info=info)
    (preempted,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "instance.preempted"]
    assert preempted["data"]["lost_work_h"] == pytest.approx(600 / 3600, abs=1e-3)
    rec.close()
    app.close()


def test_a_loss_that_heals_during_its_last_pull_leaves_that_pull_as_a_periodic_sync_not_a_last_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SSH went quiet past the timeout: the loss began its last pull, then SSH answered again. Held as a run's last
    # sync, that pull's result was never written down while the run ran, and no sync could start after it.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1", started_ago_s=3600)
    with app.store.tx() as c:
        c.execute(update(s.attempts).where(s.attempts.c.id == f"{job_id}-a1").values(
            info={"last_seen_at": time.time() - 3600}))
    answers: list[dict[str, Any] | None] = [None]

    class Flaky(_Stoppable):
        def status(self, att: dict[str, Any]) -> dict[str, Any] | None:  # type: ignore[override]
            return answers[-1]

    cloud = Flaky()
    now = [time.time() - 3600]
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud, clock=lambda: now[0])  # type: ignore[dict-item, arg-type]
    now[0] += 3600  # watched since the instance was last seen
    pulled = threading.Event()
    monkeypatch.setattr(rec.syncs, "beside", _last_checkpoint_beside(rec, app, lambda: pulled.wait(10)))
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    assert "loss_seen_at" in attempt()["info"] and rec.syncs.pool.busy(f"{job_id}-a1")  # the loss's pull under way
    answers.append({"supervisor_alive": True, "heartbeat": {"ts": time.time()}})
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    assert attempt()["state"] == "running" and "loss_seen_at" not in attempt()["info"]
    pulled.set()
    _until_a_sync_finished(rec)
    rec.syncs.collect()  # written down as any periodic sync: the run goes on
    assert not rec.syncs.pool.busy(f"{job_id}-a1") and app.store.get_job(job_id)["checkpoint"] == "step-00000050"
    rec.close()
    app.close()


def test_a_loss_seen_and_then_healthy_again_leaves_no_trace_that_a_later_loss_would_take_for_its_own(
        tmp_path: Path) -> None:
    # SSH dropped past the timeout while a sync ran, then came back. The loss's start, kept, had a later loss's
    # wait for its pull over before it began.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1")
    with app.store.tx() as c:
        c.execute(update(s.attempts).where(s.attempts.c.id == f"{job_id}-a1").values(
            info={"loss_seen_at": time.time() - 3600, "loss_synced": True, "last_sync_at": time.time()}))

    class Healthy(_Stoppable):
        def status(self, att: dict[str, Any]) -> dict[str, Any]:
            return {"supervisor_alive": True, "heartbeat": {"ts": time.time()}}

    cloud = Healthy()
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud)  # type: ignore[dict-item, arg-type]
    rec._step_running(attempt(), app.store.get_job(job_id), cloud)  # type: ignore[arg-type]
    assert attempt()["state"] == "running"
    assert "loss_seen_at" not in attempt()["info"] and "loss_synced" not in attempt()["info"]
    rec.close()
    app.close()


def test_a_stop_s_last_sync_does_not_stand_for_the_end_of_a_run_that_finished_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The trainer finished as it was stopped: the stop's last sync brought no outputs (only with a new checkpoint),
    # and taken as the run's end it would have had the finished run stopped for outputs that were never asked for.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1")
    rec = Reconciler(app, {}, cloud=None)
    asked: list[bool] = []

    def sync_beside(att: dict[str, Any], job: dict[str, Any], *, outputs: bool = False) -> SyncDone:
        asked.append(outputs)
        return SyncDone(at=time.time(), pulled=PulledCheckpoints([], TransferStats("rsync"), {}),
                        outputs=["runs/events.out"] if outputs else None)

    release = threading.Event()
    monkeypatch.setattr(rec.syncs, "beside", lambda *a, **k: release.wait(10) and sync_beside(*a, **k))
    job, info = app.store.get_job(job_id), {}
    assert not rec.syncs.final(attempt(), job, info, outputs=False)  # the stop's, under way
    release.set()
    deadline = time.monotonic() + 10
    while not rec.syncs.final(attempt(), job, info, outputs=True):  # the run's end: one more, with the outputs
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert asked == [False, True] and info["final_outputs"] == ["runs/events.out"]
    rec.close()
    app.close()


def test_revert_local_brings_every_stopped_run_s_last_checkpoint_home_side_by_side(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two jobs bursting: revert-local wound one down, pulled its last checkpoint, then began the other's. Their
    # pulls now run at once: each of these two ends only once the other has begun.
    app = App(state_dir_override=str(tmp_path / "state"))
    jobs = []
    for n in (1, 2):
        job_id, _, _ = enqueue(app, write_job(tmp_path, f"running-{n}", local_throughput=0,
                                              rented_throughput={"H100": 2.0}))
        with app.store.tx() as c:
            app.store.update_job(job_id, c, state="running")
            c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud",
                                                state="running", provider="sim", instance_type="gpu_1x_h100",
                                                market="spot", instance_id=f"i-{n}", info={}, created_at=time.time()))
        jobs.append(job_id)
    cloud = _Stoppable()
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud)  # type: ignore[dict-item, arg-type]
    both = threading.Barrier(2)
    monkeypatch.setattr(rec.syncs, "beside", _last_checkpoint_beside(rec, app, lambda: both.wait(10)))

    report = revert.revert_local(app, rec, timeout_s=30)
    rec.close(wait_s=0)
    assert sorted(cloud.terminated) == ["i-1", "i-2"]
    assert [r.terminated for r in report.rows] == ["yes", "yes"]
    assert [r.checkpoint for r in report.rows] == ["step-00000050", "step-00000050"]
    app.close()


def test_revert_local_lets_a_last_pull_under_way_at_its_timeout_finish_before_the_instance_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Cut short at --timeout, the pull's instance was then terminated by the sweep with the checkpoint half home,
    # and reported gone: the run's last hour of work thrown away. It finishes (as a pull inside the loop always did).
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1")
    cloud = _Stoppable()
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud)  # type: ignore[dict-item, arg-type]
    monkeypatch.setattr(rec.syncs, "beside", _last_checkpoint_beside(rec, app, lambda: time.sleep(3)))
    report = revert.revert_local(app, rec, timeout_s=1)
    rec.close(wait_s=0)
    (row,) = report.rows
    assert (row.terminated, row.checkpoint) == ("yes", "step-00000050") and cloud.terminated[0] == "i-1"
    assert attempt()["state"] == "aborted" and app.store.get_job(job_id)["checkpoint"] == "step-00000050"
    assert job_id in report.held + report.requeued_local
    app.close()


def _revert_beside_a_ticking_daemon(app: App, shell: Reconciler, daemon: _Stoppable,
                                    monkeypatch: pytest.MonkeyPatch) -> revert.RevertReport:
    """revert-local run by `shell` while a daemon on `daemon`'s cloud ticks in a thread (its last pulls bring step
    50 home), as the daemon process beside the CLI would."""
    ticking = Reconciler(app, {"sim": daemon}, cloud=daemon)  # type: ignore[dict-item, arg-type]
    monkeypatch.setattr(ticking.syncs, "beside", _last_checkpoint_beside(ticking, app, lambda: None))
    stop = threading.Event()

    def ticks() -> None:
        while not stop.is_set():
            ticking.tick()
            time.sleep(0.05)

    thread = threading.Thread(target=ticks)
    thread.start()
    try:
        return revert.revert_local(app, shell, timeout_s=30, daemon_running=True)
    finally:
        stop.set()
        thread.join()
        ticking.close(wait_s=0)


def _unverified_instances(app: App) -> list[Any]:
    with app.store.engine.connect() as c:
        return list(c.execute(select(s.instances.c.id).where(s.instances.c.state == "unverified")).all())


def test_with_a_daemon_running_revert_local_waits_for_it_to_wind_down_and_steps_no_attempt_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two processes stepping one attempt each wrote back what the other had just done: a finished run's outcome
    # lost (the job run again), an instance terminated under the other's last pull. The daemon alone steps it.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1")
    shell, daemon = _Stoppable(), _Stoppable()
    rec = Reconciler(app, {"sim": shell}, cloud=shell)  # type: ignore[dict-item, arg-type]
    report = revert.revert_local(app, rec, timeout_s=1, daemon_running=True)
    # The daemon has not ticked: nothing was stepped, terminated or recorded for a sweep to terminate.
    assert shell.terminated == [] and attempt()["state"] == "running"
    assert report.daemon_winding_down == [f"{job_id}-a1"] and [r.terminated for r in report.rows] == ["no"]
    assert _unverified_instances(app) == []

    # The daemon's ticks wind it down while revert-local waits, which then reports it as the daemon ended it.
    again = _revert_beside_a_ticking_daemon(app, rec, daemon, monkeypatch)
    rec.close(wait_s=0)
    assert shell.terminated == [] and daemon.terminated == ["i-1"] and attempt()["state"] == "aborted"
    (row,) = again.rows
    assert (row.terminated, row.checkpoint) == ("yes", "step-00000050") and again.daemon_winding_down == []
    assert job_id in again.held + again.requeued_local
    app.close()


def test_beside_a_daemon_that_has_the_keys_revert_local_from_a_keyless_shell_reports_what_the_daemon_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The README's own setup: the API key in the systemd env file only. The shell recorded the daemon's instances
    # as unverified (for the daemon's sweep to terminate, under a pull) and exited 1 after a clean wind-down.
    app = App(state_dir_override=str(tmp_path / "state"))
    _, attempt = _running_on_the_cloud(app, tmp_path, "i-1")
    app.store.set_setting("cloud_health", {"sim": {"ok": True}})  # the daemon uses sim
    shell = Reconciler(app, {}, cloud=None)
    shell.unavailable = {"sim": "no API key"}
    daemon = _Stoppable()
    report = _revert_beside_a_ticking_daemon(app, shell, daemon, monkeypatch)
    assert attempt()["state"] == "aborted" and daemon.terminated == ["i-1"]
    (row,) = report.rows
    assert (row.terminated, row.checkpoint) == ("yes", "step-00000050") and report.all_gone
    assert report.daemon_sweeps == {"sim": "no API key"} and report.not_swept == {}
    assert _unverified_instances(app) == []

    # A daemon that cannot use the provider would never end an attempt there: this shell winds it down itself.
    (tmp_path / "second").mkdir()
    _, attempt2 = _running_on_the_cloud(app, tmp_path / "second", "i-2")
    app.store.set_setting("cloud_health", {})
    mine = _Stoppable()
    here = Reconciler(app, {"sim": mine}, cloud=mine)  # type: ignore[dict-item, arg-type]
    monkeypatch.setattr(here.syncs, "beside", _last_checkpoint_beside(here, app, lambda: None))
    again = revert.revert_local(app, here, timeout_s=30, daemon_running=True)
    assert mine.terminated == ["i-2"] and attempt2()["state"] == "aborted" and again.daemon_winding_down == []
    here.close(wait_s=0)
    shell.close(wait_s=0)
    app.close()


def test_revert_local_fails_for_a_provider_it_cannot_ask_only_if_something_of_ours_may_run_there(
        tmp_path: Path) -> None:
    # simcloud is enabled by default: a fresh install without its key was told revert-local failed, with nothing
    # ever launched anywhere. Every launch is written down before it is made, so the state knows.
    app = App(state_dir_override=str(tmp_path / "state"))
    rec = Reconciler(app, {}, cloud=None)
    rec.unavailable = {"sim": "no API key"}
    fresh = revert.revert_local(app, rec, timeout_s=1)
    assert fresh.all_gone and fresh.nothing_there == {"sim": "no API key"} and fresh.not_swept == {}
    _running_on_the_cloud(app, tmp_path, "i-1")
    ours = revert.revert_local(app, rec, timeout_s=1)
    assert not ours.all_gone and ours.not_swept == {"sim": "no API key"} and ours.nothing_there == {}
    rec.close()
    app.close()


def test_the_meter_stops_when_an_instance_was_seen_gone_not_when_a_daemon_next_steps_its_attempt(
        tmp_path: Path) -> None:
    # revert-local without a daemon: its sweep terminated an instance whose attempt it could not end by --timeout.
    # The charge ran on in `budget` and the cap until a daemon, days later, stepped the attempt and billed them all.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _ = _running_on_the_cloud(app, tmp_path, "i-1")
    start = time.time() - 7200
    app.store.open_charge({"month": month_key(start), "job_id": job_id, "attempt_id": f"{job_id}-a1",
                           "provider": "sim", "instance_id": "i-1", "rate_usd_h": 3.0, "started_at": start})
    revert._record_instance(app, "sim", "i-1", f"{job_id}-a1", "yes")  # the sweep saw it go, now
    (charge,) = app.store.ledger_rows()
    assert charge["ended_at"] == pytest.approx(time.time(), abs=5) and charge["cost_usd"] == pytest.approx(6, abs=0.01)

    # A daemon that steps such an attempt later ends its charge when the instance went, not at its own now.
    app.close()
    (tmp_path / "second").mkdir()
    app = App(state_dir_override=str(tmp_path / "second" / "state"))
    job2, attempt2 = _running_on_the_cloud(app, tmp_path / "second", "i-2")
    app.store.open_charge({"month": month_key(start), "job_id": job2, "attempt_id": f"{job2}-a1",
                           "provider": "sim", "instance_id": "i-2", "rate_usd_h": 3.0, "started_at": start})
    with app.store.tx() as c:
        c.execute(insert(s.instances).values(provider="sim", id="i-2", attempt_id=f"{job2}-a1", state="terminated",
                                             gone_at=start + 3600, verified_gone=True))
    rec = Reconciler(app, {}, cloud=None)
    with app.store.tx() as c:
        rec._close_instance(c, attempt2(), "i-2", time.time())
    (second,) = app.store.ledger_rows()
    assert second["ended_at"] == start + 3600 and second["cost_usd"] == pytest.approx(3.0)
    rec.close()
    app.close()


@pytest.mark.parametrize("refusal", [
    AuthFailed("GET /instances/i-1: HTTP 401 global/invalid-api-key", provider="sim", code="global/invalid-api-key"),
    QuotaExceeded("GET /instances/i-1: HTTP 400 global/quota-exceeded", provider="sim", code="global/quota-exceeded"),
    InvalidRequest("GET /instances/i-1: 404 for instances the listing has live: i-1", provider="sim")],
    ids=["AuthFailed", "QuotaExceeded", "InvalidRequest"])
def test_a_run_that_finishes_while_its_provider_refuses_to_be_asked_is_not_said_done_until_its_instance_is_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: ProviderError) -> None:
    # The user revoked the API key mid-run: every look at the instance skipped the run's SSH watch, and after five
    # failures over the heartbeat timeout the attempt was given up, its terminate refused too, the instance left
    # billing. The run is watched over SSH through the refusal, said once; a run that finishes meanwhile waits,
    # `terminating`, its job not done and its charge open, until the provider answers and confirms the instance gone.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-1", started_ago_s=60)
    start = time.time() - 60
    app.store.open_charge({"month": month_key(start), "job_id": job_id, "attempt_id": f"{job_id}-a1",
                           "provider": "sim", "instance_id": "i-1", "rate_usd_h": 3.0, "started_at": start})
    finished: list[bool] = []

    class Refusing(_Stoppable):
        error: ProviderError | None = refusal

        def status(self, att: dict[str, Any]) -> dict[str, Any]:
            if finished:
                return {"supervisor_alive": False, "exit": {"reason": "completed", "exit_code": 0}}
            return {"supervisor_alive": True, "exit": None, "heartbeat": {"ts": time.time()}}

        def describe(self, ids: list[str]) -> dict[str, InstanceInfo]:
            if self.error is not None:
                raise self.error
            return super().describe(ids)

        def terminate(self, ids: list[str]) -> None:
            if self.error is not None:
                raise self.error
            super().terminate(ids)

    cloud = Refusing()
    now = [time.time()]
    rec = Reconciler(app, {"sim": cloud}, cloud=cloud, clock=lambda: now[0])  # type: ignore[dict-item, arg-type]
    monkeypatch.setattr(rec.syncs, "beside", _last_checkpoint_beside(rec, app, lambda: None))
    kind = type(refusal).__name__

    def step(seconds: float) -> None:
        now[0] += seconds
        rec.syncs.collect()
        rec._advance(attempt(), app.store.get_job(job_id))
        _until_a_sync_finished(rec) if rec.syncs.pool.busy(f"{job_id}-a1") else None

    for _ in range(8):  # five failures over the heartbeat timeout gave it up; a running attempt has none now
        step(20.0)
    job = app.store.get_job(job_id)
    assert attempt()["state"] == "running" and "errors" not in attempt()["info"]
    assert job["checkpoint"] == "step-00000050", "checkpoints come home over SSH meanwhile"
    said = [e["data"] for e in app.store.events(type_prefix="attempt.provider_refused")]
    assert len(said) == 1 and said[0]["error"] == kind and said[0]["provider"] == "sim"
    assert job["reason"] == said[0]["problem"]
    assert job["reason"].startswith("providers.sim: ") and f"({kind}: GET /instances/i-1" in job["reason"]
    assert "instance i-1 keeps running and is watched over SSH" in job["reason"]
    (shown,) = status_data(app, now[0])["attempts"]
    assert shown["problem"] == job["reason"]

    finished.append(True)  # the run ends well while the provider still refuses
    for _ in range(8):
        step(20.0)
    job = app.store.get_job(job_id)
    assert attempt()["state"] == "terminating" and job["state"] == "running", "not done: its instance may still run"
    assert "instance i-1 could not be terminated and may still run, and bill" in job["reason"]
    (shown,) = status_data(app, now[0])["attempts"]
    assert shown["problem"] == job["reason"]
    assert app.store.ledger_rows()[0]["ended_at"] is None
    assert len(app.store.events(type_prefix="attempt.provider_refused")) == 1

    cloud.error = None  # the key is fixed: the terminate that was due goes through at its next try
    step(16.0)
    job = app.store.get_job(job_id)
    assert attempt()["state"] == "succeeded" and cloud.terminated == ["i-1"]
    assert job["state"] == "done" and app.store.ledger_rows()[0]["ended_at"] is not None
    rec.close()
    app.close()


def test_an_attempt_on_a_provider_the_daemon_cannot_use_is_said_once_and_in_the_jobs_reason(tmp_path: Path) -> None:
    # A daemon started without the provider a live attempt runs on (its credentials gone, or disabled in the
    # config): the attempt is left as it is, said once (it was an event every tick), and the job says why.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "big", local_throughput=0, rented_throughput={"H100": 2.0}))
    with app.store.tx() as c:
        app.store.update_job(job_id, c, state="running", reason="bursting to sim")
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state="running",
                                            provider="sim", instance_type="gpu_1x_h100", market="spot",
                                            idempotency_key="k1", info={}, created_at=time.time()))
    rec = Reconciler(app, {}, cloud=None)
    for _ in range(3):
        rec.tick()
    said = [e for e in app.store.events(job_id=job_id) if e["type"] == "attempt.provider_unavailable"]
    assert len(said) == 1 and said[0]["data"]["provider"] == "sim"
    assert app.store.get_job(job_id)["reason"] == (
        f"attempt {job_id}-a1 is on provider sim, which this daemon cannot use (`burstctl providers` says why): "
        "its instance is neither watched nor stopped until it can")
    app.close()


def test_a_newest_checkpoint_whose_bytes_are_wrong_is_moved_aside_and_said_and_the_one_before_resumed(
        tmp_path: Path) -> None:
    # Its sizes match its manifest, so only its sha256 tells: the resume skipped it silently, it still counted among
    # the three kept, and revert-local could name it as the resume point.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "rotted", local_throughput=0, rented_throughput={"H100": 2.0}))
    store = checkpoints.store_dir(app.config, job_id)
    write_checkpoint(store, "step-00000010", {"state.json": b'{"step": 10}'})
    write_checkpoint(store, "step-00000020", {"state.json": b'{"step": 20}'})
    (store / "step-00000020" / "state.json").write_bytes(b'{"step": 21}')  # one byte flipped, same size
    assert checkpoints.latest(app.config, job_id, deep=False).name == "step-00000020"  # sizes alone cannot tell

    assert checkpoints.resume_point(app, job_id).name == "step-00000010"
    (said,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "checkpoint.corrupt"]
    assert said["data"]["checkpoint"] == "step-00000020" and Path(said["data"]["moved_to"]).is_dir()
    assert checkpoints.latest(app.config, job_id, deep=False).name == "step-00000010"  # what revert-local names
    assert checkpoints.resume_point(app, job_id).name == "step-00000010"  # said once
    assert len([e for e in app.store.events(job_id=job_id) if e["type"] == "checkpoint.corrupt"]) == 1
    app.close()


def _terminating_on(sim: SimCloudServer, app: App, job_id: str, now: list[float],
                    info: dict[str, Any] | None = None) -> tuple[LambdaCloud, Any]:
    """The job's attempt a1 terminating an instance launched on `sim` (its charge open), the provider on the clock
    `now` and trying each call once, so that each failure is the tick's."""
    provider = LambdaCloud(name="sim", base_url=sim.api_url, api_key="sim-rules-key", regions=("us-east-1",),
                           request_interval_s=0.0, clock=lambda: now[0],
                           retry=RetryPolicy(attempts=1, max_total_s=0.0, initial_s=0.0, max_wait_s=0.0))
    instance = provider.launch(LaunchRequest("gpu_1x_h100_sxm5", Market.ON_DEMAND,
                                             OwnerTags("burstctl", job_id, f"{job_id}-a1"), "k",
                                             "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBurstctlRulesKey0000 test"))
    with app.store.tx() as c:
        c.execute(update(s.attempts).where(s.attempts.c.id == f"{job_id}-a1").values(
            state="terminating", instance_id=instance.id, **({"info": info} if info is not None else {})))
    app.store.open_charge({"month": month_key(now[0]), "job_id": job_id, "attempt_id": f"{job_id}-a1",
                           "provider": "sim", "instance_id": instance.id, "rate_usd_h": 3.29, "started_at": now[0]})
    return provider, instance


def test_a_terminate_its_provider_does_not_answer_for_minutes_is_said_with_its_count_and_next_try_all_along(
        tmp_path: Path) -> None:
    # The run had ended and its instance was being terminated when the provider's API went down (503s) for minutes.
    # The terminate is never given up (the instance may bill), but the job's reason, what `show` says, stayed at
    # "terminate failed 4 times in a row, next try in 15 s" for the whole outage while `status` counted on.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path)
    with SimCloudServer(api_key="sim-rules-key") as sim:
        now = [time.time()]
        provider, _ = _terminating_on(sim, app, job_id, now)
        sim.inject("server-error", count=1000, status=503)
        rec = Reconciler(app, {"sim": provider}, cloud=None, clock=lambda: now[0])
        for _ in range(8):  # each past the failed step's next try (at most 15 s), 8 failures over 2 minutes
            now[0] += 16.0
            rec._advance(attempt(), app.store.get_job(job_id))
        job = app.store.get_job(job_id)
        assert attempt()["state"] == "terminating" and job["state"] == "running"
        assert app.store.ledger_rows()[0]["ended_at"] is None, "metered until the provider confirms it gone"
        assert job["reason"].startswith("terminate failed 8 times in a row, next try in 15 s: Transient: POST "
                                        "/instance-operations/terminate: HTTP 503")
        (shown,) = status_data(app, now[0])["attempts"]
        assert shown["problem"].startswith("8 steps failed in a row, next try in 15 s: Transient: POST")
        sim.clear_faults()  # the API is back: the terminate due goes through
        now[0] += 16.0
        rec._advance(attempt(), app.store.get_job(job_id))
        rec._advance(attempt(), app.store.get_job(job_id))
        assert attempt()["state"] in ("succeeded", "failed", "aborted", "preempted")
        assert app.store.ledger_rows()[0]["ended_at"] is not None
        rec.close()
        provider.close()
    app.close()


def test_after_revert_local_a_terminate_its_provider_does_not_answer_releases_the_job_only_with_nothing_left_there(
        tmp_path: Path) -> None:
    # revert-local stopped the run, and its provider's API is down: its terminate cannot be confirmed. The job comes
    # home once nothing of it is left on the instance; while the instance holds a newer checkpoint than home, it
    # waits and says why and what to do (`--resume-from-home`), and with that leave it comes home from what is home.
    # Either way the instance is still terminated, and metered, until the provider confirms it gone, and its end
    # then does not move the job again.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path)
    job_row = app.store.get_job(job_id)
    with app.store.tx() as c:  # it fits locally: revert-local requeues it here
        app.store.update_job(job_id, c, decision={**job_row["decision"], "fits_locally": True})
    write_checkpoint(checkpoints.store_dir(app.config, job_id), "step-00000010", {"w.bin": b"1"})
    with SimCloudServer(api_key="sim-rules-key") as sim:
        now = [time.time()]
        # Stopped by revert-local; its supervisor last said it held step-20, which did not come home.
        provider, instance = _terminating_on(sim, app, job_id, now, info={
            "outcome": "aborted", "stop_reason": "revert-local", "instance_checkpoint": "step-00000020"})
        revert.set_burst_enabled(app, False, "revert-local")
        sim.inject("server-error", count=1000, status=503)
        rec = Reconciler(app, {"sim": provider}, cloud=None, clock=lambda: now[0])  # no SSH: the instance unreachable

        def step() -> None:
            now[0] += 16.0  # past the failed step's next try
            rec._advance(attempt(), app.store.get_job(job_id))

        step()
        step()
        job = app.store.get_job(job_id)
        assert attempt()["state"] == "terminating" and job["state"] == "running"
        assert job["reason"].startswith("terminate failed 2 times in a row, next try in 4 s: Transient")
        assert job["reason"].endswith(
            "; not moved home: its newest checkpoint, step-00000020, is on the instance and not home (step-00000010 "
            "is); burstctl revert-local --resume-from-home resumes it here from step-00000010, giving up the work "
            "since")
        assert len([e for e in app.store.events(job_id=job_id) if e["type"] == "attempt.release_held"]) == 1

        # The user's leave (written down: a restarted daemon reads it too).
        report = revert.revert_local(app, Reconciler(app, {"sim": provider}, cloud=None), timeout_s=5,
                                     resume_from_home=True)
        assert report.requeued_local == [job_id] and report.not_home == {}
        assert [(r.instance, r.terminated) for r in report.rows] == [(instance.id, "unverified")]
        job = app.store.get_job(job_id)
        assert attempt()["state"] == "released"
        assert (job["state"], job["placement"]) == ("queued", "local")
        assert job["reason"] == "revert-local: requeued locally from its newest checkpoint, step-00000010"
        assert app.store.ledger_rows()[0]["ended_at"] is None, "metered until the provider confirms it gone"
        with app.store.tx() as c:  # the job runs here meanwhile
            app.store.update_job(job_id, c, state="running")
        step()
        assert attempt()["state"] == "released" and app.store.get_job(job_id)["state"] == "running"
        assert app.store.get_job(job_id)["reason"] == job["reason"], "the retried terminate is not the job's news"

        sim.clear_faults()  # the API is back
        step()
        step()
        assert attempt()["state"] == "aborted"
        assert app.store.ledger_rows()[0]["ended_at"] is not None
        assert app.store.get_job(job_id)["state"] == "running", "its end does not move the job again"
        moves = ("job.requeued_local", "attempt.released")
        assert [e["type"] for e in app.store.events(job_id=job_id) if e["type"] in moves] == list(reversed(moves))
        assert revert.set_burst_enabled(app, True, "burst-enable")
        assert app.store.get_setting(reconcile.RESUME_FROM_HOME_KEY) is None  # the leave was for that revert-local
        rec.close()
        provider.close()
    app.close()


def test_a_job_is_released_only_between_pulls_and_no_pull_from_its_old_instance_lands_in_its_store_after(
        tmp_path: Path) -> None:
    # The old instance must not write into the job's store once the job resumes here from it. A pull holds the job's
    # store lock while it writes there (the daemon's and revert-local's alike): the release waits for it, and a pull
    # that begins after the release finds the attempt released and brings nothing.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, attempt = _running_on_the_cloud(app, tmp_path, "i-old")
    job = app.store.get_job(job_id)
    with app.store.tx() as c:
        app.store.update_job(job_id, c, decision={**job["decision"], "fits_locally": True})
        c.execute(update(s.attempts).where(s.attempts.c.id == f"{job_id}-a1").values(
            state="terminating", info={"outcome": "aborted", "stop_reason": "revert-local"}))
    write_checkpoint(checkpoints.store_dir(app.config, job_id), "step-00000010", {"w.bin": b"1"})
    revert.set_burst_enabled(app, False, "revert-local")
    rec = Reconciler(app, {}, cloud=None)
    with checkpoints.store_lock(app.config, job_id):  # a pull from it is writing into the store
        assert not rec.release_if_home(attempt(), app.store.get_job(job_id))
    assert attempt()["state"] == "terminating" and "release_held" not in attempt()["info"]  # not news: a moment
    assert rec.release_if_home(attempt(), app.store.get_job(job_id))
    assert attempt()["state"] == "released" and app.store.get_job(job_id)["state"] == "queued"

    steps = CloudSteps(app, {})
    pulled = steps.pull(attempt(), app.store.get_job(job_id))  # no SSH is even tried: it would fail here
    assert list(pulled) == [] and checkpoints.latest(app.config, job_id).name == "step-00000010"
    rec.close()
    app.close()


def _released_home(app: App, tmp_path: Path, sim: SimCloudServer, now: list[float], *, route: str | None = None,
                   started_ago_s: float | None = None) -> tuple[str, Callable[[], dict[str, Any]], LambdaCloud, Any]:
    """A job that fits locally, whose cloud run revert-local stopped with step-10 home, released home (`released`,
    queued here) while `sim` answers its terminate (calls under `route`; None: every call) with 503s."""
    job_id, attempt = _running_on_the_cloud(app, tmp_path, started_ago_s=started_ago_s)
    job_row = app.store.get_job(job_id)
    with app.store.tx() as c:
        app.store.update_job(job_id, c, decision={**job_row["decision"], "fits_locally": True})
    write_checkpoint(checkpoints.store_dir(app.config, job_id), "step-00000010", {"w.bin": b"1"})
    provider, instance = _terminating_on(sim, app, job_id, now, info={"outcome": "aborted",
                                                                      "stop_reason": "revert-local"})
    sim.inject("server-error", count=1000, status=503, route=route)
    report = revert.revert_local(app, Reconciler(app, {"sim": provider}, cloud=None), timeout_s=5)
    assert report.requeued_local == [job_id] and attempt()["state"] == "released"
    return job_id, attempt, provider, instance


def test_burst_enable_keeps_a_job_released_home_here_until_its_instance_from_before_is_confirmed_gone(
        tmp_path: Path, burstctl_in_process: Any) -> None:
    # revert-local released the job home while its provider did not answer the terminate, and it has not started
    # here yet (the local GPU busy) when the user turns bursting back on. Put back on its cloud plan it would burst on
    # a new instance beside the old one, which still bills: it stays here until the old one is confirmed gone, and
    # burst-enable says so; nor is it handed over to the cloud from a run here. Confirmed gone, it goes back to its
    # plan.
    app = App(state_dir_override=str(tmp_path / "state"))
    with SimCloudServer(api_key="sim-rules-key") as sim:
        now = [time.time()]
        job_id, attempt, provider, instance = _released_home(app, tmp_path, sim, now,
                                                             route="instance-operations/terminate")
        r = burstctl_in_process("burst-enable", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        said = json.loads(r.stdout)
        assert said["restored"] == [] and list(said["held_for_released_instance"]) == [job_id]
        held = said["held_for_released_instance"][job_id]
        assert held == (f"its instance from before revert-local, sim {instance.id}, is still being terminated (its "
                        "provider has not confirmed it gone, and it bills until then): no other instance is launched "
                        f"for the job until it is (`burstctl confirm-gone sim {instance.id}` once you have seen it "
                        "gone in its provider's console)")
        job = app.store.get_job(job_id)
        assert (job["state"], job["placement"]) == ("queued", "local")  # it runs here meanwhile
        rec = Reconciler(app, {"sim": provider}, cloud=None, clock=lambda: now[0])
        assert rec.admission.hand_over_held(job, now[0]) == held
        # Its instance still holds a cloud slot, and its charge accrues against the month's budget.
        assert rec.admission.attempts_active("cloud") == 1
        assert rec.budget.exposure(now[0])[month_key(now[0])][1] == pytest.approx(3.29)

        sim.clear_faults()  # the provider answers the terminate again
        for _ in range(2):
            now[0] += 16.0  # past the failed terminate's next try
            rec._advance(attempt(), app.store.get_job(job_id))
        assert attempt()["state"] == "aborted" and app.store.ledger_rows()[0]["ended_at"] is not None
        job = app.store.get_job(job_id)
        assert (job["state"], job["placement"]) == ("queued", job["decision"]["placement"])  # back on its plan
        assert rec.admission.hand_over_held(job, now[0]) != held
        rec.close()
        provider.close()
    app.close()


def test_a_job_cancelled_while_its_only_attempt_is_released_is_measured_and_again_once_that_instance_is_gone(
        tmp_path: Path, burstctl_in_process: Any) -> None:
    # No attempt of the cancelled job will end to measure it: its released attempt's end does not move the job
    # (it went on without it). Its Measured line is written at the cancel, saying what the instance still being
    # terminated has cost so far; and written again with its charge once its provider confirms it gone.
    app = App(state_dir_override=str(tmp_path / "state"))
    with SimCloudServer(api_key="sim-rules-key") as sim:
        now = [time.time()]
        job_id, attempt, provider, instance = _released_home(app, tmp_path, sim, now, started_ago_s=600)
        r = burstctl_in_process("cancel", job_id)
        assert r.returncode == 0, r.stdout + r.stderr
        record = Path(app.store.get_job(job_id)["record_path"])
        (line,) = [ln for ln in record.read_text().splitlines() if ln.startswith("- **Measured:**")]
        assert line.startswith("- **Measured:** cancelled: run 0.17 h, cost $0.00, ")
        assert f"; instance sim {instance.id} is still being terminated: $" in line
        assert line.endswith("so far, added here once its provider confirms it gone")

        sim.clear_faults()  # the API is back
        rec = Reconciler(app, {"sim": provider}, cloud=None, clock=lambda: now[0])
        for _ in range(2):
            now[0] += 16.0
            rec._advance(attempt(), app.store.get_job(job_id))
        assert attempt()["state"] == "aborted"
        (charge,) = app.store.ledger_rows()
        assert charge["cost_usd"] > 0
        (line,) = [ln for ln in record.read_text().splitlines() if ln.startswith("- **Measured:**")]
        assert line.startswith(f"- **Measured:** cancelled: run 0.17 h, cost ${charge['cost_usd']:.2f}, ")
        assert "still being terminated" not in line
        measured = [e["data"] for e in app.store.events(job_id=job_id) if e["type"] == "job.measured"]
        assert [m["cost_usd"] for m in measured] == [0.0, round(charge["cost_usd"], 4)]
        rec.close()
        provider.close()
    app.close()
