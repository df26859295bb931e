"""Fault injection, end to end with real processes: a misbehaving provider API (429 JSON and HTML, 5xx, dropped
connections), no capacity, SSH dropping mid-run, a locked state database, and the daemon's own clock jumping.
Each test states what must still hold: the job completes (or waits with a clear reason), nothing is launched twice,
nothing crashes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.app import App
from orchestrator.lifecycle.reconcile import CHAOS_ENV
from orchestrator.lifecycle.service import build_reconciler
from tests.e2e import (
    SIM_KEY,
    Daemon,
    EnvDaemon,
    cli,
    events,
    free_port,
    instances_per_attempt,
    job,
    ledger,
    sim_admin,
    sim_instances,
    simcloud,
    wait_for,
    write_config,
)
from tests.e2e import (
    trainer_job as e2e_trainer_job,
)

pytestmark = pytest.mark.slow


def trainer_job(tmp: Path, name: str, steps: int = 40) -> Path:
    return e2e_trainer_job(tmp, name, steps=steps, every=5, interval_minutes=0.01)


def enqueue(config: Path, state: Path, path: Path) -> str:
    r = cli(config, state, "enqueue", str(path), "--json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["id"])


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


def assert_one_instance_per_attempt_and_all_gone(url: str) -> None:
    for attempt, ids in instances_per_attempt(sim_instances(url)).items():
        assert len(ids) == 1, f"attempt {attempt} launched {len(ids)} instances"
    assert all(i["status"] in ("terminated", "preempted") for i in sim_instances(url))


def test_a_throttling_failing_and_dropping_provider_api_still_gets_the_job_done_without_a_double_launch(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        # Every kind of API trouble, on launch, describe/list and terminate; each consumed by the next matching call.
        for route in ("instance-operations/launch", "instances", "instance-operations/terminate"):
            for fault in ({"kind": "throttle"}, {"kind": "throttle-html"}, {"kind": "server-error", "status": 500},
                          {"kind": "server-error", "status": 502}, {"kind": "server-error", "status": 503},
                          {"kind": "timeout", "delay_s": 0.5}):
                sim_admin(url, "faults", {**fault, "route": route, "count": 1})
        config = write_config(tmp_path, url)
        job_id = enqueue(config, state, trainer_job(tmp_path, "faulty"))
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: job(state, job_id)["state"] == "done", 240, "the job to finish despite the faults")
            wait_for(lambda: all(i["status"] == "terminated" for i in sim_instances(url)), 60, "nothing left")
        finally:
            assert daemon.stop() == 0
        pending = httpx.get(f"{url}/_sim/faults", timeout=10).json()["data"]
        assert_one_instance_per_attempt_and_all_gone(url)
        assert len(sim_instances(url)) == 1, "one attempt, one instance"
    assert len(pending) < 18, "the faults were met"
    assert not events(state, "daemon.tick_failed")
    (row,) = ledger(state)
    assert row["cost_usd"] is not None and row["billed_seconds"] > 0


def test_with_no_capacity_the_job_waits_with_a_clear_reason_and_runs_when_capacity_returns(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        sim_admin(url, "faults", {"kind": "insufficient-capacity", "route": "instance-operations/launch",
                                  "count": 10_000})
        # A long backoff, so the job sits blocked (with its reason) long enough to be read.
        config = write_config(tmp_path, url, daemon={"max_launch_failures": 2, "launch_backoff_s": 20.0})
        job_id = enqueue(config, state, trainer_job(tmp_path, "starved"))
        daemon = Daemon(tmp_path, config, state).start()
        try:
            def blocked_with_reason() -> str | None:
                shown = cli(config, state, "show", job_id, "--json")
                assert shown.returncode == 0, shown.stderr
                data = json.loads(shown.stdout)
                return data["reason"] if data["state"] == "blocked" else None

            reason = wait_for(blocked_with_reason, 180, "the job to be blocked")
            assert "launches failed in a row" in reason and "NoCapacity" in reason, reason
            assert not [i for i in sim_instances(url) if i["status"] not in ("terminated",)]
            httpx.delete(f"{url}/_sim/faults", timeout=10).raise_for_status()
            wait_for(lambda: job(state, job_id)["state"] == "done", 180, "the job to run once capacity is back")
        finally:
            assert daemon.stop() == 0
        assert_one_instance_per_attempt_and_all_gone(url)


def test_when_spot_never_comes_the_policy_moves_the_job_to_on_demand_in_time_for_its_deadline(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        for region in ("us-east-1", "us-west-1"):
            sim_admin(url, "capacity", {"instance_type": "gpu_1x_h100_sxm5_spot", "region": region, "count": 0})
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


def test_where_spot_is_seen_only_by_launching_a_job_on_demand_probes_spot_and_moves_back_when_it_comes_up(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        def spot_capacity(count: int) -> None:
            for region in ("us-east-1", "us-west-1"):
                sim_admin(url, "capacity", {"instance_type": "gpu_1x_h100_sxm5_spot", "region": region,
                                            "count": count})

        spot_capacity(0)
        # 0.25 h of cloud work as decided (the trainer needs less), 0.046 h of slack: spot is chosen and refused, and
        # soon the policy goes on-demand. There spot would still pay were it up, so it is probed.
        config = write_config(tmp_path, url, daemon={"offers_ttl_s": 1.0, "market_check_s": 1.0},
                              policy={"overhead_h": 0.01}, sim={"lists_spot_capacity": False})
        spec = e2e_trainer_job(tmp_path, "probed-spot", steps=100, every=5, step_s=0.2, interval_minutes=0.01,
                               rented=4, deadline_hours=0.296)
        job_id = enqueue(config, state, spec)
        assert job(state, job_id)["decision"]["market"] == "spot"
        # The first daemon dies (as if SIGKILLed) right after the first probe that comes up was launched.
        daemon = EnvDaemon(tmp_path, config, state).start(env={CHAOS_ENV: "probe-up"})
        try:
            wait_for(lambda: any(e["job_id"] == job_id and e["data"]["result"] == "refused"
                                 for e in events(state, "attempt.spot_probe")), 120,
                     "a refused spot probe beside the on-demand attempt")
            spot_capacity(4)
            assert daemon.wait_exit(60) == 137
            daemon.start()
            wait_for(lambda: job(state, job_id)["state"] == "done", 180, "the job to finish on spot")
        finally:
            assert daemon.stop() == 0
        # The restarted daemon found the orphaned probe by its tag and ended it, then probed again.
        with sqlite3.connect(state / "burstctl.db") as db:
            probe_rows = db.execute("SELECT id, state, instance_id FROM attempts WHERE json_extract(info, "
                                    "'$.probe_for') IS NOT NULL AND state != 'launch_failed' ORDER BY n").fetchall()
        assert len(probe_rows) == 2 and all(r[1] == "aborted" and r[2] for r in probe_rows), probe_rows
        assert {r["attempt_id"] for r in ledger(state)} >= {r[0] for r in probe_rows}, "both probes charged"
        probes = [e for e in events(state, "attempt.spot_probe") if e["job_id"] == job_id]
        results = [p["data"]["result"] for p in probes]
        assert results[-1] == "up" and set(results) == {"refused", "up"}, results
        markets = [e["data"]["market"] for e in events(state, "attempt.intent") if e["job_id"] == job_id]
        assert markets[-2:] == ["on-demand", "spot"] and "spot" in markets[:-2], markets
        (switch,) = [e["data"] for e in events(state, "attempt.market_switch") if e["job_id"] == job_id]
        assert switch["to"] == "spot" and switch["market_policy"]["probe"] is True, switch
        assert [e for e in events(state, "job.resumed") if e["job_id"] == job_id][-1]["data"]["market"] == "spot"
        # The probe that came up: never ran the job, billed the provider's minimum, charged to the job, and gone.
        up = probes[-1]
        with sqlite3.connect(state / "burstctl.db") as db:
            row = db.execute("SELECT state, reason, started_at FROM attempts WHERE id = ?",
                             (up["attempt_id"],)).fetchone()
        assert row == ("aborted", "spot probe", None), row
        (charge,) = [r for r in ledger(state) if r["attempt_id"] == up["attempt_id"]]
        assert charge["market"] == "spot" and charge["billed_seconds"] == pytest.approx(60.0), charge
        assert not [e for e in events(state, "job.waiting") if "probe" in e["data"]["reason"]], \
            "a probe's end is not news for its job"
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
        markets = [e["data"]["market"] for e in events(state, "attempt.intent") if e["job_id"] == job_id]
        assert markets == ["spot", "on-demand"], markets
        (switch,) = [e for e in events(state, "attempt.market_switch") if e["job_id"] == job_id]
        assert switch["data"]["to"] == "on-demand" and switch["data"]["market_policy"]["spot_seen"] == "up"
        (moved,) = [e for e in events(state, "job.market_switch") if e["job_id"] == job_id]
        assert moved["data"]["reason"].startswith("moving to on-demand")
        resumed = [e for e in events(state, "job.resumed") if e["job_id"] == job_id]
        assert resumed, "the on-demand attempt resumed from the spot attempt's last checkpoint"
        assert_one_instance_per_attempt_and_all_gone(url)


def test_where_spot_capacity_is_listed_a_job_waits_for_spot_without_launching_and_takes_it_when_listed(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        def spot_capacity(count: int) -> None:
            for region in ("us-east-1", "us-west-1"):
                sim_admin(url, "capacity", {"instance_type": "gpu_1x_h100_sxm5_spot", "region": region,
                                            "count": count})

        spot_capacity(0)
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
            spot_capacity(4)
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


def _sshd_pids(sim_state: Path, instance_id: str) -> list[int]:
    """The pids of the instance's sshd listener (its command line names the instance's own sshd_config)."""
    needle = str(sim_state / "instances" / instance_id / "machine").encode()
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmdline = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"sshd" in cmdline and needle in cmdline:
                pids.append(int(p.name))
    return pids


def test_ssh_dropping_mid_run_ends_the_attempt_as_lost_and_the_job_resumes_elsewhere(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url, daemon={"heartbeat_timeout_s": 3.0})
        job_id = enqueue(config, state, trainer_job(tmp_path, "dropped", steps=120))
        daemon = Daemon(tmp_path, config, state).start()
        try:
            first = wait_for(lambda: [e["data"]["instance"] for e in events(state, "attempt.running")], 90,
                             "the attempt to run")[0]
            wait_for(lambda: events(state, "checkpoint.synced"), 60, "a checkpoint to come home")
            pids = _sshd_pids(tmp_path / "sim", first)
            if not pids:
                pytest.skip("simcloud runs the paramiko SSH backend here (no sshd to stop)")
            for pid in pids:
                os.kill(pid, signal.SIGKILL)  # the listener: no new SSH session reaches the instance
            wait_for(lambda: events(state, "job.resumed"), 120, "the job to resume on another instance")
            wait_for(lambda: job(state, job_id)["state"] == "done", 180, "the job to finish")
        finally:
            assert daemon.stop() == 0
        assert_one_instance_per_attempt_and_all_gone(url)
    lost = events(state, "instance.preempted")[0]["data"]
    assert lost["instance"] == first and "heartbeat lost" in lost["reason"]
    resumed = events(state, "job.resumed")[0]["data"]
    assert resumed["instance"] != first and resumed["checkpoint"].startswith("step-")


HOLD_LOCK = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("COMMIT")
"""


def test_a_locked_state_database_makes_the_cli_and_the_daemon_wait_not_crash(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = write_config(tmp_path, f"http://127.0.0.1:{free_port()}")  # no cloud: local work only
    work = tmp_path / "w"
    work.mkdir()
    local = tmp_path / "local.toml"
    local.write_text('name = "local-one"\ncommand = ["python3", "-c", "print(42)"]\nworkdir = "w"\n'
                     'deadline_hours = 5\nlocal_throughput = 1\nrented_throughput = { H100 = 2 }\n')
    assert cli(config, state, "status", "--json").returncode == 0  # creates the database
    daemon = EnvDaemon(tmp_path, config, state).start()
    try:
        wait_for(lambda: events(state, "daemon.started"), 30, "the daemon to start")
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(state / "burstctl.db"), "4"],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        enq = cli(config, state, "enqueue", str(local), "--json")
        waited = time.monotonic() - t0
        status = cli(config, state, "status", "--json")
        assert holder.wait(30) == 0
        assert enq.returncode == 0 and "Traceback" not in enq.stderr, enq.stderr
        assert status.returncode == 0 and json.loads(status.stdout)["daemon"]
        assert waited > 0, "the write waited for the lock instead of failing"
        wait_for(lambda: job(state, "local-one")["state"] == "done", 60, "the job to run after the lock")
        assert daemon.proc is not None and daemon.proc.poll() is None, "the daemon is still alive"
    finally:
        assert daemon.stop() == 0
    assert not [e for e in events(state, "daemon.tick_failed") if "locked" in e["data"]["error"]]
    with sqlite3.connect(state / "burstctl.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_the_daemon_clock_jumping_forward_and_back_causes_no_budget_stop_no_loss_and_no_negative_bill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURSTCTL_SIM_API_KEY", SIM_KEY)
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        job_id = enqueue(config, state, trainer_job(tmp_path, "clocked", steps=300))
        daemon = Daemon(tmp_path, config, state).start()
        wait_for(lambda: events(state, "checkpoint.synced"), 120, "the attempt to run and sync")
        daemon.kill(signal.SIGKILL)
        # The rest runs in-process: the real reconciler, providers and SSH, with a clock that jumps.
        app = App(config_path=str(config), state_dir_override=str(state))
        offset = [0.0]
        reconciler = build_reconciler(app)
        reconciler.clock = lambda: time.time() + offset[0]
        assert "sim" in reconciler.providers
        try:
            for jump_h in (2.0, -2.0, -5.0, 0.0):  # forward two hours, back to four before now... then back to true
                offset[0] = jump_h * 3600
                mark = max(e["id"] for e in events(state))
                for _ in range(6):
                    reconciler.tick()
                    time.sleep(0.5)
                after = [e for e in events(state) if e["id"] > mark]
                assert not [e for e in after if e["type"] in ("instance.preempted", "attempt.error")
                            or (e["type"] == "attempt.stopping" and e["data"]["reason"] != "completed")], jump_h
                assert job(state, job_id)["state"] in ("running", "done"), jump_h
                if jump_h < 0:  # our clock went back: checkpoints must keep coming home
                    assert [e for e in after if e["type"] == "checkpoint.synced"], f"syncing stalled at {jump_h} h"
            offset[0] = 0.0
            deadline = time.monotonic() + 120
            while job(state, job_id)["state"] != "done" and time.monotonic() < deadline:
                reconciler.tick()
                time.sleep(0.5)
        finally:
            app.close()
        assert job(state, job_id)["state"] == "done"
        assert_one_instance_per_attempt_and_all_gone(url)
    (row,) = ledger(state)
    assert row["billed_seconds"] > 0 and row["cost_usd"] > 0
