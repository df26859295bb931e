"""Probing spot from on-demand where spot is seen only by launching, end to end with real processes (a daemon, SSH,
the example trainer): on the simulated EC2 (boto3 against moto's server, spot refused with EC2's own
InsufficientInstanceCapacity) and on simcloud with its spot listing not read. A probe that comes up is kept and takes
the job over (make before break); a daemon killed mid-probe carries on; a kept probe never outlives its job."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import insert, select

from orchestrator.app import App
from orchestrator.lifecycle.machine import CHAOS_ENV
from orchestrator.lifecycle.service import build_reconciler
from orchestrator.lifecycle.spot_probe import probe_spot
from state import schema as s
from tests.e2e import (
    P3_OD,
    P3_SPOT,
    SIM_KEY,
    CloudView,
    Daemon,
    EnvDaemon,
    SimcloudView,
    assert_one_instance_per_attempt_and_all_gone,
    cli,
    cloud,
    enqueue,
    events,
    hold_from,
    job,
    ledger,
    sim_instances,
    simcloud,
    wait_for,
    write_config,
)
from tests.e2e import (
    trainer_job as e2e_trainer_job,
)

pytestmark = pytest.mark.slow


def probed_job(tmp: Path, view: CloudView, state: Path) -> tuple[Path, str]:
    """A job decided for spot, with spot refused and seen only by launching (EC2; simcloud with its listing not
    read): 0.25 h of cloud work as decided (the trainer needs less) and 0.046 h of slack, so the policy soon goes
    on-demand, where spot would still pay were it up: it is probed. (config, job id)"""
    view.spot_capacity(0)
    unlisted = {"sim": {"lists_spot_capacity": False}} if isinstance(view, SimcloudView) else {}
    config = view.config(tmp, daemon={"offers_ttl_s": 1.0, "market_check_s": 1.0}, policy={"overhead_h": 0.01},
                         **unlisted)
    spec = e2e_trainer_job(tmp, "probed-spot", steps=100, every=5, step_s=0.2, interval_minutes=0.01,
                           rented=4, deadline_hours=0.296, gpu=view.gpu)
    job_id = enqueue(config, state, spec)
    assert job(state, job_id)["decision"]["market"] == "spot"
    return config, job_id


def spot_back_after_a_refused_probe(view: CloudView, state: Path, job_id: str) -> None:
    wait_for(lambda: any(e["job_id"] == job_id and e["data"]["result"] == "refused"
                         for e in events(state, "attempt.spot_probe")), 120,
             "a refused spot probe beside the on-demand attempt")
    view.spot_capacity(4)


def killed_once_spot_is_back(tmp: Path, config: Path, state: Path, view: CloudView, job_id: str,
                             point: str) -> EnvDaemon:
    """A daemon run that dies (as if SIGKILLed) at chaos point `point`, once spot came back after a refused probe.
    Returns the daemon, to be started again."""
    daemon = EnvDaemon(tmp, config, state).start(env={CHAOS_ENV: point})
    try:
        spot_back_after_a_refused_probe(view, state, job_id)
        assert daemon.wait_exit(60) == 137
    except BaseException:
        daemon.stop()
        raise
    return daemon


def job_attempts(state: Path, job_id: str) -> list[dict[str, object]]:
    with sqlite3.connect(state / "burstctl.db") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute(
            "SELECT id, state, reason, market, instance_id, started_at, json_extract(info, '$.probe_for') AS "
            "probe_for, json_extract(info, '$.from_probe_for') AS from_probe_for FROM attempts WHERE job_id = ? "
            "ORDER BY n", (job_id,))]


def assert_the_probe_took_over(state: Path, job_id: str) -> tuple[dict[str, object], dict[str, object]]:
    """The on-demand attempt was stopped for spot (a last checkpoint), and the kept probe's instance took the job
    over and resumed it on spot: no spot launch after the probe. (on-demand attempt, the probe's attempt)"""
    attempts = job_attempts(state, job_id)
    (taken,) = [a for a in attempts if a["from_probe_for"]]
    on_demand = next(a for a in attempts if a["id"] == taken["from_probe_for"])
    assert (on_demand["market"], on_demand["state"], on_demand["reason"]) == ("on-demand", "aborted", "to-spot")
    assert (taken["market"], taken["state"]) == ("spot", "succeeded") and taken["started_at"], taken
    assert attempts[-1]["id"] == taken["id"], "no spot launch after the probe"
    probes = [e["data"] for e in events(state, "attempt.spot_probe") if e["job_id"] == job_id]
    assert [p["result"] for p in probes][-1] == "up" and {p["result"] for p in probes} == {"refused", "up"}
    assert probes[-1]["kept"] is True and probes[-1]["probe_for"] == on_demand["id"]
    (over,) = [e for e in events(state, "attempt.probe_taken_over") if e["job_id"] == job_id]
    assert over["attempt_id"] == taken["id"] and over["data"]["resuming"] is True, over
    resumed = [e for e in events(state, "job.resumed") if e["job_id"] == job_id][-1]
    assert resumed["attempt_id"] == taken["id"] and resumed["data"]["market"] == "spot", resumed
    markets = [e["data"]["market"] for e in events(state, "attempt.intent") if e["job_id"] == job_id]
    assert markets[-1] == "on-demand" and "spot" in markets, markets
    assert not [e for e in events(state, "job.waiting") if "probe" in e["data"]["reason"]], \
        "a probe's end is not news for its job"
    return on_demand, taken


def test_on_ec2_a_job_on_demand_probes_spot_and_the_probe_that_comes_up_takes_over(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with cloud("ec2", tmp_path) as ec2:  # boto3 against moto's server: spot refused with InsufficientInstanceCapacity
        config, job_id = probed_job(tmp_path, ec2, state)
        daemon = Daemon(tmp_path, config, state).start()
        try:
            spot_back_after_a_refused_probe(ec2, state, job_id)
            wait_for(lambda: job(state, job_id)["state"] == "done", 180, "the job to finish on spot")
        finally:
            assert daemon.stop() == 0
        on_demand, taken = assert_the_probe_took_over(state, job_id)
        # EC2's own refusal, mapped once by the adapter: the lifecycle saw only NoCapacity.
        refusals = {e["data"]["code"] for e in events(state, "provider.launch_fallback")}
        assert refusals == {"InsufficientInstanceCapacity"}, refusals
        assert {e["data"]["error"] for e in events(state, "attempt.launch_failed")} == {"NoCapacity"}
        (switch,) = [e for e in events(state, "attempt.market_switch") if e["job_id"] == job_id]
        assert switch["attempt_id"] == on_demand["id"] and switch["data"]["to"] == "spot"
        assert switch["data"]["market_policy"]["probe"] is True, switch
        # What the budget holds for the job follows the market it runs on: the on-demand price of its whole run
        # when the policy gave up on spot and launched it on on-demand, the spot price of the rest from the move
        # back to spot and at the probe's takeover.
        od_intent = next(e for e in events(state, "attempt.intent") if e["attempt_id"] == on_demand["id"])
        assert od_intent["data"].get("hold_usd") == pytest.approx(hold_from(state, job_id, od_intent["ts"], P3_OD),
                                                              abs=0.003), od_intent
        (over,) = [e for e in events(state, "attempt.probe_taken_over") if e["job_id"] == job_id]
        for said in (switch, over):
            assert said["data"].get("hold_usd") == pytest.approx(hold_from(state, job_id, said["ts"], P3_SPOT),
                                                              abs=0.003), said
        # Make before break: the spot instance was up before the on-demand one was gone.
        launched = next(e["ts"] for e in events(state, "instance.launched") if e["attempt_id"] == taken["id"])
        gone = next(e["ts"] for e in events(state, "instance.terminated") if e["attempt_id"] == on_demand["id"])
        assert launched < gone
        (charge,) = [r for r in ledger(state) if r["attempt_id"] == taken["id"]]
        assert charge["market"] == "spot" and charge["job_id"] == job_id, charge
        assert_one_instance_per_attempt_and_all_gone(ec2)


def test_a_daemon_killed_mid_probe_carries_on_on_restart_and_the_kept_probe_still_takes_over(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with cloud("simcloud", tmp_path) as sim:
        config, job_id = probed_job(tmp_path, sim, state)
        # The first daemon dies right after launching the first probe that comes up; the second right after keeping
        # the next one, before it stopped the on-demand attempt.
        daemon = killed_once_spot_is_back(tmp_path, config, state, sim, job_id, "probe-up")
        try:
            daemon.start(env={CHAOS_ENV: "probe-kept"})
            assert daemon.wait_exit(60) == 137
            daemon.start()
            wait_for(lambda: job(state, job_id)["state"] == "done", 180, "the job to finish on spot")
        finally:
            assert daemon.stop() == 0
        # The first daemon's probe was found by its tag and ended: a sighting that old is no reason to move. It never
        # ran the job, was billed the provider's minimum, and was charged to the job.
        (orphan,) = [a for a in job_attempts(state, job_id) if a["probe_for"] and a["state"] != "launch_failed"]
        assert (orphan["state"], orphan["reason"], orphan["started_at"]) == ("aborted", "spot probe", None), orphan
        (charge,) = [r for r in ledger(state) if r["attempt_id"] == orphan["id"]]
        assert charge["market"] == "spot" and charge["billed_seconds"] == pytest.approx(60.0), charge
        # The second daemon's kept probe: the third stopped the on-demand attempt for it, and it took the job over.
        assert_the_probe_took_over(state, job_id)
        assert_one_instance_per_attempt_and_all_gone(sim)


def test_a_kept_probe_whose_job_is_cancelled_meanwhile_is_ended_and_never_runs_the_job(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with cloud("simcloud", tmp_path) as sim:
        config, job_id = probed_job(tmp_path, sim, state)
        # A probe came up and was kept; the on-demand attempt still runs.
        daemon = killed_once_spot_is_back(tmp_path, config, state, sim, job_id, "probe-kept")
        try:
            (kept_now,) = [a for a in json.loads(cli(config, state, "status", "--json").stdout)["attempts"]
                           if a["probe_for"]]
            assert kept_now["probe_kept"] is True and kept_now["market"] == "spot", kept_now
            assert "kept to take over" in cli(config, state, "status").stdout
            assert cli(config, state, "cancel", job_id).returncode == 0
            daemon.start()
            wait_for(lambda: not [a for a in job_attempts(state, job_id) if a["state"] not in
                                  ("aborted", "launch_failed", "failed", "succeeded", "preempted")], 60,
                     "every attempt of the cancelled job to end")
        finally:
            assert daemon.stop() == 0
        assert job(state, job_id)["state"] == "cancelled"
        attempts = job_attempts(state, job_id)
        (kept,) = [a for a in attempts if a["probe_for"] and a["instance_id"]]
        assert (kept["state"], kept["reason"], kept["started_at"]) == ("aborted", "spot probe: cancelled", None)
        assert not [a for a in attempts if a["from_probe_for"]] and not events(state, "attempt.probe_taken_over")
        (charge,) = [r for r in ledger(state) if r["attempt_id"] == kept["id"]]
        assert charge["market"] == "spot" and charge["job_id"] == job_id and charge["cost_usd"] > 0, charge
        assert_one_instance_per_attempt_and_all_gone(sim)


def test_a_probe_is_a_cloud_attempt_so_at_max_cloud_attempts_it_waits_for_its_next_turn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, the real reconciler against simcloud: a job on on-demand whose probe is due. With one cloud
    attempt allowed (the on-demand one), no spot instance is launched beside it; with two, the probe is."""
    monkeypatch.setenv("BURSTCTL_SIM_API_KEY", SIM_KEY)
    with simcloud(tmp_path) as url:
        for cap in (1, 2):
            config = write_config(tmp_path, url, daemon={"max_cloud_attempts": cap})
            app = App(config_path=str(config), state_dir_override=str(tmp_path / f"state-{cap}"))
            try:
                rec = build_reconciler(app)
                now = rec.clock()
                job = {"id": f"j{cap}", "name": "probed", "kind": "train", "state": "running", "verdict": "burst",
                       "placement": "cloud", "approved": True, "spec": {}, "decision": {},
                       "deadline_at": now + 3600, "created_at": now, "updated_at": now}
                on_demand = {"id": f"j{cap}-a1", "job_id": job["id"], "n": 1, "where": "cloud", "state": "running",
                             "provider": "sim", "instance_type": "gpu_1x_h100_sxm5", "market": "on-demand",
                             "idempotency_key": f"k{cap}", "info": {"billing_minimum_s": 60.0}, "created_at": now,
                             "started_at": now, "instance_id": "i-on-demand"}
                with app.store.tx() as conn:
                    conn.execute(insert(s.jobs).values(**job))
                    conn.execute(insert(s.attempts).values(**on_demand))
                kept = probe_spot(rec, on_demand, job, rec.providers["sim"], {"spot_usd_h": 1.0}, now)
                with app.store.engine.connect() as c:
                    attempts = c.execute(select(s.attempts.c.id).where(s.attempts.c.job_id == job["id"])).all()
                stored = app.store.get_job(job["id"])
            finally:
                app.close()
            probes = [e["data"] for e in events(tmp_path / f"state-{cap}", "attempt.spot_probe")]
            if cap == 1:
                assert kept is None and len(attempts) == 1, "no probe attempt beside the one allowed"
                assert sim_instances(url) == [], "nothing launched"
                assert [p["result"] for p in probes] == ["deferred"], probes
                assert probes[0]["reason"] == "1 cloud attempts run, max_cloud_attempts is 1", probes
                assert stored["spec"]["_spot_probe_at"] > now, "asked again at the next probe, not every check"
            else:
                assert kept is not None and len(attempts) == 2
                assert [p["result"] for p in probes] == ["up"], probes
                assert [i["instance_type"] for i in sim_instances(url)] == ["gpu_1x_h100_sxm5_spot"]
