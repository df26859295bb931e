"""The daemon follows the spot policy end to end, with real processes (simcloud, a daemon, SSH, the example
trainer): spot refused or listed as gone, spot coming back, a deadline coming near, a region going. Each test states
what must hold: the job waits or moves market as the policy says, finishes by its deadline, and leaves no instance
behind (one per attempt)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e import (
    Daemon,
    assert_one_instance_per_attempt_and_all_gone,
    enqueue,
    events,
    hold_from,
    job,
    sim_admin,
    sim_instances,
    simcloud,
    spot_capacity,
    wait_for,
    write_config,
)
from tests.e2e import (
    trainer_job as e2e_trainer_job,
)

pytestmark = pytest.mark.slow


def run_spot_job_to_done(tmp: Path, config: Path, state: Path, spec: Path) -> str:
    """Enqueue a job decided for spot, run a daemon until it is done (on whatever market), stop it; the job's id."""
    job_id = enqueue(config, state, spec)
    assert job(state, job_id)["decision"]["market"] == "spot"
    daemon = Daemon(tmp, config, state).start()
    try:
        wait_for(lambda: job(state, job_id)["state"] == "done", 300, "the job to finish on on-demand")
    finally:
        assert daemon.stop() == 0
    return job_id



def test_when_spot_never_comes_the_policy_moves_the_job_to_on_demand_in_time_for_its_deadline(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        spot_capacity(url, 0)
        # 72 s of cloud work and 36 s of overhead (as decided; the trainer needs less) to finish within 4.2 min:
        # spot is chosen, and refused; the policy waits for it while that pays, then goes on-demand. simcloud's
        # spot capacity listing is not read: spot is seen only by launching, as on EC2.
        config = write_config(tmp_path, url, policy={"overhead_h": 0.01}, sim={"lists_spot_capacity": False})
        spec = e2e_trainer_job(tmp_path, "starved-of-spot", steps=40, every=5, interval_minutes=0.01, rented=50,
                               deadline_hours=0.07)
        job_id = run_spot_job_to_done(tmp_path, config, state, spec)
        finished = job(state, job_id)
        intents = [e for e in events(state, "attempt.intent") if e["job_id"] == job_id]
        refused = [e for e in events(state, "attempt.launch_failed") if e["job_id"] == job_id]
        assert refused and all(e["data"]["error"] == "NoCapacity" for e in refused)
        assert [e["data"]["market"] for e in intents][-1] == "on-demand"
        assert all(e["data"]["market"] == "spot" for e in intents[:-1]), "spot tried until the policy gave up on it"
        last = intents[-1]["data"]["market_policy"]
        assert last["spot_seen"] == "down" and last["choice"] == "on-demand", last
        assert last["spot_usd_h"] == 1.0 and last["on_demand_usd_h"] == 3.29, "the offer's own prices"
        waited = [e for e in events(state, "job.waiting") if e["job_id"] == job_id][-1]["data"]["reason"]
        assert waited.startswith("waiting for spot (NoCapacity") and "slack" in waited, waited
        assert finished["updated_at"] <= finished["deadline_at"], "done before the deadline"
        assert_one_instance_per_attempt_and_all_gone(url)


def test_a_spot_attempt_whose_deadline_comes_near_is_checkpointed_and_moved_to_on_demand(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path, "--boot-delay", "30") as url:
        # 72 s of cloud work as decided (the trainer needs less), t_ovh 36 s, 183 s of slack when the spot attempt
        # is created: spot. The 30 s boot eats into the slack, and once running the policy's plan (on whole 60 s
        # ticks: 3 left) has no room for 2d: the safety net takes over, as a preemption now could not be made up.
        config = write_config(tmp_path, url, policy={"overhead_h": 0.01})
        spec = e2e_trainer_job(tmp_path, "deadline-near", steps=60, every=5, step_s=0.2, interval_minutes=0.01,
                               rented=50, deadline_hours=(72 + 183 + 1) / 3600)
        job_id = run_spot_job_to_done(tmp_path, config, state, spec)
        intents = [e for e in events(state, "attempt.intent") if e["job_id"] == job_id]
        assert [e["data"]["market"] for e in intents] == ["spot", "on-demand"], intents
        (switch,) = [e for e in events(state, "attempt.market_switch") if e["job_id"] == job_id]
        assert switch["data"]["to"] == "on-demand" and switch["data"]["market_policy"]["spot_seen"] == "up"
        # From the move on, the job holds the rest of its run at the on-demand price, not its spot plan's: at the
        # move (the spot instance still running) and at the on-demand launch (it gone, billed).
        spot, on_demand = (e["data"]["rate_usd_h"] for e in intents)
        assert (spot, on_demand) == (1.0, 3.29)
        for said in (switch, intents[1]):
            assert said["data"].get("hold_usd") == pytest.approx(hold_from(state, job_id, said["ts"], on_demand),
                                                             abs=0.003), said
        (moved,) = [e for e in events(state, "job.market_switch") if e["job_id"] == job_id]
        assert moved["data"]["reason"].startswith("moving to on-demand")
        resumed = [e for e in events(state, "job.resumed") if e["job_id"] == job_id]
        assert resumed, "the on-demand attempt resumed from the spot attempt's last checkpoint"
        assert_one_instance_per_attempt_and_all_gone(url)


def test_where_spot_capacity_is_listed_a_job_waits_for_spot_without_launching_and_takes_it_when_listed(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        spot_capacity(url, 0)
        # simcloud lists spot capacity: the daemon sees spot gone without launching, and waits (0.3 h of slack).
        config = write_config(tmp_path, url, daemon={"offers_ttl_s": 1.0, "market_check_s": 2.0},
                              policy={"overhead_h": 0.01})
        spec = e2e_trainer_job(tmp_path, "listed-spot", steps=40, every=5, interval_minutes=0.01, rented=10,
                               deadline_hours=0.4)
        job_id = enqueue(config, state, spec)
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: job(state, job_id)["reason"].startswith("waiting for spot (none listed)"), 60,
                     "the job to wait for spot")
            time.sleep(3)
            assert not [e for e in events(state, "attempt.intent") if e["job_id"] == job_id], "nothing launched"
            spot_capacity(url, 4)
            wait_for(lambda: job(state, job_id)["state"] == "done", 180, "the job to run on spot once listed")
        finally:
            assert daemon.stop() == 0
        intents = [e for e in events(state, "attempt.intent") if e["job_id"] == job_id]
        assert [e["data"]["market"] for e in intents] == ["spot"]
        assert intents[0]["data"]["market_policy"]["spot_seen"] == "up"
        assert not [e for e in events(state, "attempt.launch_failed") if e["job_id"] == job_id], \
            "spot listed as gone is not launched into"
        assert_one_instance_per_attempt_and_all_gone(url)


def _listed_regions(state: Path) -> dict[str, bool]:
    """Each region's last recorded spot listing (the daemon's spot_region_listings table)."""
    with sqlite3.connect(state / "burstctl.db") as db:
        rows = db.execute("SELECT region, up FROM spot_region_listings ORDER BY id").fetchall()
    return {region: bool(up) for region, up in rows}


def test_a_job_that_loses_its_region_resumes_in_the_region_whose_spot_has_been_listed_longest(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    spot = "gpu_1x_h100_sxm5_spot"
    with simcloud(tmp_path) as url:
        def capacity(region: str, count: int) -> None:
            sim_admin(url, "capacity", {"instance_type": spot, "region": region, "count": count})

        # Spot is listed in us-west-1 only; us-east-1 comes first in simcloud's own order, eu-west-1 last.
        capacity("us-east-1", 0)
        capacity("eu-west-1", 0)
        config = write_config(tmp_path, url, daemon={"offers_ttl_s": 1.0, "market_check_s": 1.0})
        job_id = enqueue(config, state, e2e_trainer_job(tmp_path, "moving", steps=300, every=10))  # 30 s of work
        daemon = Daemon(tmp_path, config, state).start()
        try:
            first = wait_for(lambda: [i for i in sim_instances(url) if i["status"] == "active"], 90,
                             "the first attempt to run")[0]
            assert first["region"] == "us-west-1"
            wait_for(lambda: events(state, "checkpoint.synced"), 60, "a first checkpoint to come home")
            # eu-west-1 lists spot first, then us-east-1: the daemon records each as its market check refreshes.
            capacity("eu-west-1", 4)
            wait_for(lambda: _listed_regions(state).get("eu-west-1"), 30, "eu-west-1 to be recorded as listed")
            capacity("us-east-1", 4)
            wait_for(lambda: _listed_regions(state).get("us-east-1"), 30, "us-east-1 to be recorded as listed")
            # us-west-1 loses its spot capacity (seen by the daemon before the instance goes) and reclaims it.
            capacity("us-west-1", 0)
            wait_for(lambda: _listed_regions(state).get("us-west-1") is False, 30, "us-west-1 recorded as gone")
            httpx.post(f"{url}/_sim/instances/{first['id']}/preempt", json={}, timeout=10).raise_for_status()
            wait_for(lambda: events(state, "job.resumed"), 120, "the job to resume in another region")
            wait_for(lambda: job(state, job_id)["state"] == "done", 180, "the job to finish")
        finally:
            assert daemon.stop() == 0
        intents = [e["data"] for e in events(state, "attempt.intent") if e["job_id"] == job_id]
        assert [i["market"] for i in intents] == ["spot", "spot"]
        # Longest listed first, not simcloud's (config) order: eu-west-1 has listed spot longer than us-east-1.
        assert intents[1]["region_order"] == ["eu-west-1", "us-east-1"]
        regions = [i["region"] for i in sorted(sim_instances(url), key=lambda i: i["launched_at"])]
        assert regions == ["us-west-1", "eu-west-1"]
        assert events(state, "job.resumed")[0]["data"]["checkpoint"].startswith("step-")
        assert_one_instance_per_attempt_and_all_gone(url)
