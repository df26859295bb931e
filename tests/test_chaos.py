"""Crash consistency: the daemon is SIGKILLed at every step of a cloud attempt (and at seeded random moments), then
restarted. Whatever the moment, the job finishes, no instance outlives its job, no attempt ever had two instances,
and the ledger agrees with the provider's billing record within one tick. The clouds are simcloud (Lambda-style REST)
and the simulated EC2 (boto3 against moto's server). A crash where the provider's own code is met (the launch and its
adoption by tag, a look at a booting instance, a reclaim the bootstrap finds, a notice's successor) is on both; a
step whose code is the reconciler's alone is on one, the clouds taking turns (CI's 20 minutes).

Trigger points are the events the dying daemon wrote (instance.launched → provisioning, instance.ready →
bootstrapping, attempt.running → running). The windows no event marks — between the intent and the launch call,
right after the launch call, while finishing, while terminating — use the reconciler's test-only hook
`BURSTCTL_CHAOS_KILL_AT=<point>` (`orchestrator.lifecycle.machine.chaos_point`), which `os._exit(137)`s there.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from orchestrator.lifecycle.machine import CHAOS_ENV, CHAOS_POINTS, NOTICE_CHAOS_POINTS
from state import schema as s
from state.store import Store
from tests.e2e import (
    GONE,
    CloudView,
    EnvDaemon,
    cli,
    cloud,
    events,
    instances_per_attempt,
    job,
    ledger,
    preempt,
    store_url,
    trainer_job,
    wait_for,
)

pytestmark = pytest.mark.slow
TICK_S = 0.4
STEPS, EVERY, STEP_S = 40, 5, 0.1  # a 4 s trainer that checkpoints every 0.5 s
KILL_ON_EVENT = {"provisioning": "instance.launched", "bootstrapping": "instance.ready", "running": "attempt.running"}


CLOUDS = ("simcloud", "ec2")
# The points crashed on one cloud only: past the launch and the first look, both clouds run the same reconciler code.
ONE_CLOUD = {"finishing": "simcloud", "terminating": "ec2", "bootstrapping": "simcloud", "running": "ec2"}


def on_their_clouds(points: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """(point, cloud) for each point on both clouds, or on its one (`ONE_CLOUD`)."""
    return [(point, kind) for point in points for kind in CLOUDS if ONE_CLOUD.get(point, kind) == kind]


def short_job(tmp: Path, name: str, gpu: str) -> Path:
    return trainer_job(tmp, name, steps=STEPS, every=EVERY, step_s=STEP_S, interval_minutes=0.01, gpu=gpu)


def enqueue(tmp: Path, config: Path, state: Path, name: str, gpu: str = "H100") -> str:
    r = cli(config, state, "enqueue", str(short_job(tmp, name, gpu)), "--json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["id"])


def job_event(state: Path, job_id: str, type_: str) -> bool:
    return any(e["job_id"] == job_id for e in events(state, type_))


def finish(daemon: EnvDaemon, cloud: CloudView, state: Path, job_ids: list[str]) -> None:
    """A fresh daemon (no chaos) runs every job to the end."""
    daemon.start()
    try:
        for job_id in job_ids:
            wait_for(lambda j=job_id: job(state, j)["state"] in ("done", "failed", "cancelled"), 120,
                     f"{job_id} to finish after a restart")
            assert job(state, job_id)["state"] == "done", job(state, job_id)["reason"]
        # the last attempt's instance is confirmed gone before the job is done; give the sweep one pass
        wait_for(lambda: all(i["status"] in GONE for i in cloud.instances()), 30, "every instance to be gone")
    finally:
        assert daemon.stop() == 0


def assert_safe(cloud: CloudView, state: Path, job_ids: list[str], steps: int = STEPS) -> None:
    """The invariants every crash must leave intact."""
    for job_id in job_ids:
        j = job(state, job_id)
        assert j["state"] == "done", (job_id, j["state"], j["reason"])
        assert len([e for e in events(state, "job.done") if e["job_id"] == job_id]) == 1
        assert (state / "checkpoints" / job_id / f"step-{steps:08d}" / "state.json").exists()
    # No transfer's private known_hosts file outlives its daemon: a killed one's are removed by the next daemon.
    assert not list((state / "transfers").glob("burstctl-known-hosts-*"))
    instances = cloud.instances()
    assert instances, "the job ran in the cloud"
    assert all(i["status"] in GONE for i in instances), instances
    for attempt, ids in instances_per_attempt(instances).items():
        assert len(ids) == 1, f"attempt {attempt} had {len(ids)} instances: {ids}"
    rows = ledger(state)
    assert sorted(r["instance_id"] for r in rows) == sorted(i["id"] for i in instances), "one charge per instance"
    billed = {b["instance_id"]: b for b in cloud.billing()}
    for r in rows:
        b = billed[r["instance_id"]]
        assert r["cost_usd"] is not None, r
        # the provider bills whole seconds or per second; the ledger closes within one tick of the provider's end
        assert abs(r["billed_seconds"] - b["billed_s"]) <= TICK_S + 1.0, (r, b)
        assert r["rate_usd_h"] == pytest.approx(b["rate_usd_h"])
        assert abs(r["cost_usd"] - b["cost_usd"]) <= b["rate_usd_h"] * (TICK_S + 1.0) / 3600


@pytest.mark.parametrize(("point", "kind"), on_their_clouds(CHAOS_POINTS))
def test_killed_at_a_hook_point_the_restart_carries_on_safely(tmp_path: Path, point: str, kind: str) -> None:
    state = tmp_path / "state"
    with cloud(kind, tmp_path) as c:
        config = c.config(tmp_path, daemon={"tick_s": TICK_S})
        job_id = enqueue(tmp_path, config, state, "chaos", c.gpu)
        daemon = EnvDaemon(tmp_path, config, state).start(env={CHAOS_ENV: point})
        assert daemon.wait_exit(120) == 137, f"the daemon never reached {point}"
        finish(daemon, c, state, [job_id])
        assert_safe(c, state, [job_id])
        if point == "after-launch":  # the instance launched by the dead daemon was found by its tag, not relaunched
            assert job_event(state, job_id, "instance.adopted")
            assert len(c.instances()) == 1
        if point in ("before-launch", "after-launch"):
            # Its boot began before the daemon that saw it up: the downtime is in boot_s, which is not measured.
            (ready,) = (e for e in events(state, "instance.ready") if e["job_id"] == job_id)
            assert ready["data"]["not_measured"].startswith("the daemon started after the launch")
            assert measured(state, "boot_s") == []


@pytest.mark.parametrize(("step", "kind"), on_their_clouds(sorted(KILL_ON_EVENT)))
def test_sigkilled_while_a_step_is_under_way_the_restart_carries_on_safely(tmp_path: Path, step: str,
                                                                          kind: str) -> None:
    state = tmp_path / "state"
    with cloud(kind, tmp_path) as c:
        config = c.config(tmp_path, daemon={"tick_s": TICK_S})
        job_id = enqueue(tmp_path, config, state, "chaos", c.gpu)
        daemon = EnvDaemon(tmp_path, config, state).start()
        wait_for(lambda: job_event(state, job_id, KILL_ON_EVENT[step]), 90, f"the attempt to reach {step}",
                 interval=0.05)
        daemon.kill(signal.SIGKILL)
        finish(daemon, c, state, [job_id])
        assert_safe(c, state, [job_id])


def measured(state: Path, metric: str) -> list[float]:
    st = Store(store_url(state))
    try:
        with st.engine.connect() as c:
            return [r.value for r in c.execute(select(s.measurements).where(s.measurements.c.metric == metric))]
    finally:
        st.close()


def noticed_job_running(c: CloudView, tmp_path: Path, state: Path, steps: int, env: dict[str, str] | None = None
                        ) -> tuple[str, EnvDaemon, str, str]:
    """A trainer job of `steps` steps enqueued and a daemon started (its environment plus `env`), waited for until
    its first attempt runs and a first checkpoint is home: (the job's id, the daemon, that attempt's id, its
    instance)."""
    config = c.config(tmp_path, daemon={"tick_s": TICK_S})
    spec = trainer_job(tmp_path, "noticed", steps=steps, every=10, step_s=STEP_S, interval_minutes=0.01, gpu=c.gpu)
    r = cli(config, state, "enqueue", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    job_id = str(json.loads(r.stdout)["id"])
    daemon = EnvDaemon(tmp_path, config, state).start(env=env)
    running = wait_for(lambda: [e for e in events(state, "attempt.running") if e["job_id"] == job_id], 90,
                       "the attempt to run")
    wait_for(lambda: job(state, job_id)["checkpoint"], 60, "a first checkpoint home")
    return job_id, daemon, running[0]["attempt_id"], running[0]["data"]["instance"]


def attempt_states(state: Path, job_id: str) -> dict[str, str]:
    st = Store(store_url(state))
    try:
        with st.engine.connect() as c:
            rows = c.execute(select(s.attempts.c.id, s.attempts.c.state).where(s.attempts.c.job_id == job_id))
            return {r.id: r.state for r in rows}
    finally:
        st.close()


@pytest.mark.parametrize("kind", CLOUDS)
def test_a_spot_instance_reclaimed_while_no_daemon_finished_its_bootstrap_is_a_preemption_the_job_resumes_from(
        tmp_path: Path, kind: str) -> None:
    # The daemon dies while it pushes the workdir (its attempt at bootstrapping), and the spot instance is reclaimed
    # before a daemon is back. The restarted daemon's bootstrap finds no SSH there: that is the provider's reclaim,
    # and the job goes on on another instance. It was taken for a failing step, and after 5 refused connections in
    # about a second the attempt, and the job, were failed.
    state = tmp_path / "state"
    with cloud(kind, tmp_path) as c:
        config = c.config(tmp_path, daemon={"tick_s": TICK_S})
        job_id = enqueue(tmp_path, config, state, "reclaimed", c.gpu)
        assert job(state, job_id)["decision"]["market"] == "spot"
        (tmp_path / "work" / "data.bin").write_bytes(os.urandom(256 << 20))  # a push that lasts
        daemon = EnvDaemon(tmp_path, config, state).start()
        ready = wait_for(lambda: [e for e in events(state, "instance.ready") if e["job_id"] == job_id], 90,
                         "the instance to be up", interval=0.05)
        daemon.kill(signal.SIGKILL)
        first = ready[0]["attempt_id"]
        assert attempt_states(state, job_id) == {first: "bootstrapping"}, "killed before its bootstrap ended"
        preempt(c.admin_url, ready[0]["data"]["instance"], notice_s=0.5)
        finish(daemon, c, state, [job_id])
        assert_safe(c, state, [job_id])
        assert attempt_states(state, job_id)[first] == "preempted"
        assert not [e for e in events(state, "job.failed") if e["job_id"] == job_id]


def test_sigkilled_as_it_hears_a_spot_notice_and_reclaimed_while_down_the_job_resumes_once(tmp_path: Path) -> None:
    # The daemon dies as it hears the interruption notice (its successor being written, or launching), and the
    # instance is reclaimed before a daemon is back: the restart ends the noticed attempt as preempted and the job
    # resumes from what is home, on one instance per attempt, billed as the provider bills. On simcloud: the notice
    # kill points below cover both clouds' notices.
    state = tmp_path / "state"
    steps = 160  # 16 s of training: long enough to be noticed
    with cloud("simcloud", tmp_path) as c:
        job_id, daemon, first, instance = noticed_job_running(c, tmp_path, state, steps)
        httpx.post(f"{c.admin_url}/_sim/instances/{instance}/notice", json={"seconds": 3},
                   timeout=10).raise_for_status()
        wait_for(lambda: job_event(state, job_id, "instance.interruption_notice"), 30, "the notice to be heard",
                 interval=0.02)
        daemon.kill(signal.SIGKILL)
        time.sleep(3)
        reclaimed = httpx.post(f"{c.admin_url}/_sim/instances/{instance}/preempt", json={}, timeout=10)
        assert reclaimed.status_code in (200, 404), reclaimed.text  # 404: already terminated by burstctl
        finish(daemon, c, state, [job_id])
        assert_safe(c, state, [job_id], steps=steps)
        assert attempt_states(state, job_id)[first] == "preempted"
        assert job_event(state, job_id, "job.resumed")


def killed_at_a_notice_point(tmp_path: Path, kind: str, point: str) -> tuple[list[dict], str]:
    """A noticed job's daemon killed at `point` (`NOTICE_CHAOS_POINTS`), restarted and run to the end, every crash
    invariant checked: (the job's events, its noticed attempt's id)."""
    assert point in NOTICE_CHAOS_POINTS
    state = tmp_path / "state"
    steps = 160
    with cloud(kind, tmp_path) as c:
        job_id, daemon, first, instance = noticed_job_running(c, tmp_path, state, steps, env={CHAOS_ENV: point})
        httpx.post(f"{c.admin_url}/_sim/instances/{instance}/notice", json={"seconds": 120},
                   timeout=10).raise_for_status()
        assert daemon.wait_exit(60) == 137, f"the daemon never reached {point}"
        assert attempt_states(state, job_id) == {first: "running"}, "killed before the successor was written"
        finish(daemon, c, state, [job_id])
        assert_safe(c, state, [job_id], steps=steps)
    return [e for e in events(state) if e["job_id"] == job_id], first


@pytest.mark.parametrize("kind", CLOUDS)
def test_killed_between_a_spot_notice_and_its_successor_the_restart_launches_the_successor_before_the_end(
        tmp_path: Path, kind: str) -> None:
    # The daemon dies once the notice is written down, before the next instance is written (make before break).
    # The restarted daemon launches it at its first look at the noticed attempt, while that one still ends (its
    # last checkpoint coming home), and the job resumes on it. It had waited for the noticed attempt's end.
    trail, first = killed_at_a_notice_point(tmp_path, kind, "notice-written")
    (preempted,) = (e for e in trail if e["type"] == "instance.preempted")
    assert preempted["attempt_id"] == first
    intents = [e for e in trail if e["type"] == "attempt.intent"]
    assert len(intents) == 2, intents
    assert intents[1]["data"].get("successor_for") == first, "the next instance was launched as a successor"
    assert intents[1]["id"] < preempted["id"], "written before the noticed attempt ended"
    (taken,) = (e for e in trail if e["type"] == "attempt.successor_taken_over")
    assert taken["attempt_id"] == intents[1]["attempt_id"]
    assert len([e for e in trail if e["type"] == "job.resumed"]) == 1


def test_killed_as_it_says_a_spot_notice_the_restart_says_it_once(tmp_path: Path) -> None:
    # The daemon dies once it has said the notice (`instance.interruption_notice`) and before it wrote the notice
    # down. The restart heard the notice again and said it a second time (a [[notify]] on it sent two messages).
    # Said and written down in one transaction, it is said once. The kill point is in the reconciler's code, the
    # same for both clouds: simcloud only.
    trail, first = killed_at_a_notice_point(tmp_path, "simcloud", "notice-said")
    said = [e for e in trail if e["type"] == "instance.interruption_notice"]
    assert [e["attempt_id"] for e in said] == [first], said
    intents = [e for e in trail if e["type"] == "attempt.intent"]
    assert len(intents) == 2 and intents[1]["data"].get("successor_for") == first, intents
