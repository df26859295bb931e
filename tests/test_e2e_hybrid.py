"""A hybrid plan, executed: local hours are nearly free, so a job that misses its deadline locally runs locally
first, stops at the planned switch time with a last checkpoint (SIGTERM), and bursts only the rest — resuming in
the cloud from that checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from orchestrator.daemon import daemon_running
from orchestrator.lifecycle.machine import CHAOS_ENV, LOCAL_CHAOS_POINTS
from state import schema as s
from state.store import Store
from tests.e2e import (
    REPO,
    EnvDaemon,
    cli,
    events,
    job,
    sim_instances,
    simcloud,
    store_url,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow


def _enqueue(tmp: Path, url: str, state: Path, spec: Path, **daemon: float) -> tuple[Path, dict[str, Any]]:
    """The job enqueued on a config with t_ovh 0.001 h, no margin, and on-demand (with no margin a late burst
    could not absorb a preemption, so a spot job would burst at once instead: tests/test_decision.py). Returns the
    config and what `enqueue --json` said."""
    config = write_config(tmp, url, policy={"overhead_h": 0.001, "hybrid_margin_h": 0.0,
                                            "default_market": "on-demand"}, daemon=daemon)
    r = cli(config, state, "enqueue", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    return config, json.loads(r.stdout)


def _run_to_the_end(tmp: Path, url: str, config: Path, state: Path, job_id: str, local_step_s: float,
                    ended: tuple[str, ...] = ("done",), timeout: float = 120) -> list[dict[str, Any]]:
    """A daemon with the local card at `local_step_s` a step, until the job is in one of `ended`; the simulated
    cloud's instances then."""
    daemon = EnvDaemon(tmp, config, state).start(env={"LOCAL_STEP_S": str(local_step_s)})
    try:
        wait_for(lambda: job(state, job_id)["state"] in ended, timeout, f"{job_id} to end ({' or '.join(ended)})")
    finally:
        assert daemon.stop() == 0
    return sim_instances(url)


def _enqueued_to_a_running_daemon(tmp: Path, url: str, state: Path, spec: Path, local_step_s: float
                                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`_enqueue` then `_run_to_the_end`, but the job queued once the daemon runs: its plan's seconds count from
    the enqueue, and a daemon still starting on a loaded machine (imports, its first tick) had eaten the 16 s of
    the local phase, so the job burst at once with no hand-over to see."""
    config = write_config(tmp, url, policy={"overhead_h": 0.001, "hybrid_margin_h": 0.0,
                                            "default_market": "on-demand"})
    daemon = EnvDaemon(tmp, config, state).start(env={"LOCAL_STEP_S": str(local_step_s)})
    try:
        wait_for(lambda: daemon_running(state)[0], 60, "the daemon to run")
        r = cli(config, state, "enqueue", str(spec), "--json")
        assert r.returncode == 0, r.stderr
        decided = json.loads(r.stdout)
        wait_for(lambda: job(state, decided["id"])["state"] == "done", 120, "the job to end")
    finally:
        assert daemon.stop() == 0
    return decided, sim_instances(url)


def test_local_first_then_burst_the_rest_from_the_local_checkpoint(tmp_path: Path) -> None:
    state = tmp_path / "state"
    # W = 1, s_L = 90/h, s_R = 180/h, D = 31.6 s, t_ovh = 0.001 h, no margin: local misses (T_L = 40 s), renting
    # meets it (T_R = 23.6 s), and the latest safe switch is x* = (31.6 − 3.6 − 20) / (1 − 0.5) = 16 s. The local
    # card runs at its estimate (200 steps in 40 s), the rented one fast.
    spec = _two_speed_job(tmp_path, "hybrid", s_local=90, s_rented=180, deadline_hours=0.008778)
    with simcloud(tmp_path) as url:
        decided, instances = _enqueued_to_a_running_daemon(tmp_path, url, state, spec, 0.2)
    assert decided["placement"] == "hybrid"
    local_phase, cloud_phase = decided["decision"]["plan"]
    assert local_phase["where"] == "local" and cloud_phase["where"] == "cloud"
    assert local_phase["hours"] == pytest.approx(16 / 3600, abs=1e-4)

    types = [e["type"] for e in events(state)]
    assert types.index("attempt.stop_requested") < types.index("job.switching") < types.index("attempt.intent")
    resumed = [e["data"] for e in events(state, "job.resumed")]
    assert resumed and resumed[-1].get("provider") == "sim"  # the cloud phase started from the local checkpoint
    step = int(resumed[-1]["checkpoint"].removeprefix("step-"))
    # Real local progress was carried into the cloud: about 80 steps by the switch at the card's estimated speed,
    # fewer on a loaded machine (a trainer slow to start), never none and never the whole job.
    assert 0 < step < 200
    assert len(instances) == 1 and instances[0]["status"] == "terminated"


@pytest.mark.parametrize("point", LOCAL_CHAOS_POINTS)
def test_a_daemon_killed_as_it_stops_the_local_phase_hands_over_on_restart_not_a_preemption(tmp_path: Path,
                                                                                            point: str) -> None:
    # The daemon dies as it ends the local phase: with why written down and the trainer not yet told, or just after
    # the trainer was told (SIGTERM to its supervisor). The restarted daemon tells it (again: the supervisor acts on
    # the first), and the run's end is the hand-over it was. The why had been written after the trainer was told, so
    # a daemon killed in between took the trainer's end for a stop from outside burstctl: a preemption, the job
    # "preempted" and started locally again before it burst.
    state = tmp_path / "state"
    spec = _two_speed_job(tmp_path, "hybrid", s_local=90, s_rented=180, deadline_hours=0.008778)
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url, policy={"overhead_h": 0.001, "hybrid_margin_h": 0.0,
                                                     "default_market": "on-demand"})
        daemon = EnvDaemon(tmp_path, config, state).start(env={"LOCAL_STEP_S": "0.2", CHAOS_ENV: point})
        wait_for(lambda: daemon_running(state)[0], 60, "the daemon to run")
        r = cli(config, state, "enqueue", str(spec), "--json")
        assert r.returncode == 0, r.stderr
        job_id = json.loads(r.stdout)["id"]
        assert job(state, job_id)["placement"] == "hybrid"
        assert daemon.wait_exit(90) == 137, f"the daemon never reached {point}"
        instances = _run_to_the_end(tmp_path, url, config, state, job_id, 0.2)
    (local,) = [e["data"] for e in events(state, "attempt.ended") if e["job_id"] == job_id]
    assert (local["outcome"], local["reason"]) == ("preempted", "hybrid-switch"), local
    assert [e["data"]["reason"] for e in events(state, "job.switching")] == ["local phase done: bursting the rest"]
    assert not events(state, "job.resuming"), "a hand-over, not a preemption"
    assert len(events(state, "attempt.running")) == 2, "the local phase, then the cloud's: not run locally again"
    resumed = [e["data"] for e in events(state, "job.resumed")]
    assert resumed and resumed[-1].get("provider") == "sim"  # the cloud phase, from the local checkpoint
    assert job(state, job_id)["state"] == "done"
    assert len(instances) == 1 and instances[0]["status"] == "terminated"


def _two_speed_job(tmp: Path, name: str, *, s_local: float, s_rented: float, deadline_hours: float) -> Path:
    """The example trainer, 200 steps, at LOCAL_STEP_S seconds a step on the local card (in the daemon's
    environment, which a rented instance's clean environment does not have) and fast on the rented GPU."""
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(REPO / "examples" / "trainer.py", work / "trainer.py")
    (work / "two_speeds.py").write_text(
        "import os, sys\n"
        "local = os.environ.get('LOCAL_STEP_S')\n"
        "args = ['--step-seconds', local, '--checkpoint-every', '2'] if local else "
        "['--step-seconds', '0.01', '--checkpoint-every', '50']\n"
        "os.execv(sys.executable, [sys.executable, 'trainer.py', '--steps', '200', *args])\n")
    path = tmp / f"{name}.toml"
    path.write_text(f'name = "{name}"\ncommand = ["python3", "two_speeds.py"]\nworkdir = "work"\n'
                    f"deadline_hours = {deadline_hours}\nwork_units = 1\nlocal_throughput = {s_local}\n"
                    f"rented_throughput = {{ H100 = {s_rented} }}\n[checkpoint]\ninterval_minutes = 0.02\n")
    return path


def test_a_local_run_slower_than_its_estimate_bursts_earlier_from_its_measured_progress(tmp_path: Path) -> None:
    state = tmp_path / "state"
    # W = 1, s_L = 90/h (estimated), s_R = 180/h, t_ovh = 0.001 h, D = 31.6 s: the plan runs local for
    # x* = (31.6 − 3.6 − 20) / (1 − 0.5) = 16 s, when 0.4 of the job would be done. The local card really runs at
    # 36/h (a step a second), so by then 0.08 would be done and the rest (0.92 · 20 s + 3.6 s) would end past the
    # deadline. From the progress the trainer reports, the latest safe hand-over is about 8 s after the start.
    spec = _two_speed_job(tmp_path, "slow-local", s_local=90, s_rented=180, deadline_hours=0.008778)
    with simcloud(tmp_path) as url:
        decided, instances = _enqueued_to_a_running_daemon(tmp_path, url, state, spec, 1.0)
    job_id = decided["id"]
    planned_local = decided["decision"]["plan"][0]  # as queued: the run may re-plan it
    assert planned_local["where"] == "local" and planned_local["hours"] == pytest.approx(16 / 3600, abs=1e-4)
    planned_switch = job(state, job_id)["created_at"] + planned_local["hours"] * 3600

    [stop] = events(state, "attempt.stop_requested")
    assert stop["data"]["reason"] == "hybrid-switch"
    assert stop["ts"] < planned_switch  # it handed over before the stale schedule would have...
    assert stop["data"]["progress"] == "measured"  # ...because the trainer's progress was behind the plan
    assert stop["data"]["units_done"] < planned_local["work_units"]
    # The rest, from the progress measured at the hand-over, still fits: rented time + t_ovh ends by the deadline.
    assert stop["data"]["switch_at"] + (1 - stop["data"]["units_done"]) / 180 * 3600 + 3.6 == pytest.approx(
        job(state, job_id)["deadline_at"], abs=0.01)
    resumed = [e["data"] for e in events(state, "job.resumed")]
    assert resumed[-1].get("provider") == "sim" and int(resumed[-1]["checkpoint"].removeprefix("step-")) > 0
    assert len(instances) == 1 and instances[0]["status"] == "terminated"


def test_with_no_cloud_capacity_at_the_hand_over_the_local_run_goes_on_until_the_cloud_can_take_the_rest(
        tmp_path: Path) -> None:
    # The same job as above (hand-over due about 10 s after the start), its cloud phase on on-demand, on a cloud
    # with H100 spot capacity and no on-demand H100 capacity: an on-demand launch would be refused. Stopping
    # the local run for a burst that cannot launch would idle the local GPU and, after a few refused launches,
    # drop the job: it runs on locally instead, and bursts when on-demand capacity comes back.
    state = tmp_path / "state"
    spec = _two_speed_job(tmp_path, "no-capacity", s_local=90, s_rented=180, deadline_hours=0.008778)
    h100 = "gpu_1x_h100_sxm5"
    with simcloud(tmp_path, "--capacity", f"{h100}=0") as url:
        # Capacity coming back is seen within a second.
        config, decided = _enqueue(tmp_path, url, state, spec, offers_ttl_s=1.0)
        job_id = decided["id"]
        daemon = EnvDaemon(tmp_path, config, state).start(env={"LOCAL_STEP_S": "0.5"})
        try:
            held = wait_for(lambda: events(state, "attempt.hand_over_held"), 60, "the hand-over to be held")[0]
            assert "no cloud lists on-demand capacity for 1×H100" in held["data"]["reason"]
            done_then = held["data"]["units_done"]
            wait_for(lambda: (job(state, job_id)["reason"] or "").startswith("running on locally"), 30,
                     "the job's reason to say so")
            # The local run keeps working past the due time, and nothing was stopped or launched meanwhile.
            wait_for(lambda: _units_done(state, job_id) > done_then + 0.02, 30, "local progress past the due time")
            assert not events(state, "attempt.stop_requested") and not events(state, "attempt.intent")
            for region in ("us-east-1", "us-west-1"):
                httpx.post(f"{url}/_sim/capacity", json={"instance_type": h100, "region": region, "count": 1},
                           timeout=5).raise_for_status()
            wait_for(lambda: job(state, job_id)["state"] == "done", 120, "the job to burst the rest and finish")
        finally:
            assert daemon.stop() == 0
        instances = sim_instances(url)

    [stop] = events(state, "attempt.stop_requested")
    assert stop["ts"] > held["ts"] and stop["data"]["units_done"] > done_then
    resumed = [e["data"] for e in events(state, "job.resumed")]
    assert resumed[-1].get("provider") == "sim" and int(resumed[-1]["checkpoint"].removeprefix("step-")) > 0
    assert len(instances) == 1 and job(state, job_id)["state"] == "done"


def _units_done(state: Path, job_id: str) -> float:
    """The work the job's local attempts counted done, as the daemon recorded it."""
    st = Store(store_url(state))
    try:
        with st.engine.connect() as c:
            infos = [r[0] for r in c.execute(select(s.attempts.c.info).where(s.attempts.c.job_id == job_id,
                                                                             s.attempts.c.where == "local"))]
    finally:
        st.close()
    return max([float((i or {}).get("units_done") or 0.0) for i in infos] + [0.0])


def test_a_local_run_that_measures_it_will_miss_its_deadline_is_re_planned_and_bursts_the_rest_in_time(
        tmp_path: Path) -> None:
    # W = 1, D = 40 s, s_L = 360/h in the job file: T_L = 10 s, so gate 2 keeps it local. The card really does
    # 45/h (a step per 0.4 s of 200: 80 s). From the trainer's figures the daemon decides the job again on the work
    # left at 45/h: with s_R = 360/h and t_ovh = 9 s the rest (about 19 s rented) still makes the deadline, and a
    # hybrid (local on, then burst the rest as late as is safe, about 20 s in) is cheaper than bursting it all now.
    # The rented GPU is faster than its s_R (2 s for the whole job), so the burst ends well within the deadline.
    # (About 15 s to spare at each step: a loaded machine, slow to start the daemon and the trainer, still makes it.)
    state = tmp_path / "state"
    spec = _two_speed_job(tmp_path, "slow-card", s_local=360, s_rented=360, deadline_hours=40 / 3600)
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url, policy={"overhead_h": 0.0025, "hybrid_margin_h": 0.0,
                                                     "default_market": "on-demand"})
        r = cli(config, state, "enqueue", str(spec), "--json")
        assert r.returncode == 0, r.stderr
        decided = json.loads(r.stdout)
        job_id, first_record = decided["id"], Path(decided["record"])
        assert (decided["placement"], decided["decision"]["plan_kind"]) == ("local", "local")
        instances = _run_to_the_end(tmp_path, url, config, state, job_id, 0.4, ended=("done", "failed"), timeout=90)
        shown = cli(config, state, "show", job_id, "--json")

    done = job(state, job_id)
    assert done["state"] == "done", done["reason"]
    types = [e["type"] for e in events(state)]
    assert types.index("job.behind_schedule") < types.index("job.replanned") < types.index("attempt.stop_requested")
    [replanned] = [e["data"] for e in events(state, "job.replanned")]
    assert replanned["outcome"] == "hybrid" and replanned["planned_units_h"] == 360
    assert replanned["throughput_units_h"] < 250  # the card's own speed, not the job file's
    assert replanned["before"]["plan_kind"] == "local" and replanned["after"]["plan_kind"] == "hybrid"
    # The running local attempt became the hybrid's local phase: one local attempt, stopped at the hand-over...
    [stop] = events(state, "attempt.stop_requested")
    assert stop["data"]["reason"] == "hybrid-switch" and stop["attempt_id"] == events(state, "job.replanned")[0][
        "attempt_id"]
    # ...whose checkpoint the cloud phase resumed from, and the job met its deadline.
    resumed = [e["data"] for e in events(state, "job.resumed")]
    assert resumed[-1].get("provider") == "sim" and int(resumed[-1]["checkpoint"].removeprefix("step-")) > 0
    [measured] = [e["data"] for e in events(state, "job.measured")]
    assert measured["deadline_met"] is True, measured
    assert len(instances) == 1 and instances[0]["status"] == "terminated"
    # The trail: the job's decision and a record of its own say what was re-planned and why; the first record
    # points at it, and the Measured line is filled in on the plan that ran.
    assert shown.returncode == 0, shown.stderr
    decision = json.loads(shown.stdout)["decision"]
    assert decision["plan_kind"] == "hybrid" and decision["reasons"][0].startswith(
        "re-planned while running locally, behind schedule: at the ")
    record = Path(done["record_path"])
    assert record != first_record and "re-planned while running locally" in record.read_text()
    assert "- **Measured:** run " in record.read_text()
    assert "- **Measured:** re-planned while running locally, " in first_record.read_text()
    assert record.name in first_record.read_text()
