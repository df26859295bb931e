"""The timeouts that wait on an instance count only the time a daemon was watching: not a daemon's downtime, nor its
machine's sleep (lifecycle/watch.py). An instance stuck for the whole timeout while watched is still given up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select

from orchestrator.app import App
from orchestrator.lifecycle import watch as watch_module
from orchestrator.lifecycle.reconcile import MAX_STEP_ERRORS, STEP_RETRY_MAX_S, Reconciler
from orchestrator.lifecycle.watch import GAPS_KEPT, Watch
from orchestrator.queue import enqueue
from providers.base import InstanceInfo, InstanceState, Market, Offer
from state import schema as s
from tests.conftest import write_job

T0 = 1_800_000_000.0
TICK_S = 5.0  # the default daemon.tick_s
TIMEOUT_S = 60.0  # daemon.boot_timeout_s and daemon.heartbeat_timeout_s in these tests
HOUR_S = 3600.0


class _Instance:
    """A provider and the cloud steps for one instance, i-1: booting until `up`, answering SSH while `ssh`; its
    provider's describe failing while `failing`."""

    name = "sim"

    def __init__(self, *, up: bool = False, ssh: bool = False) -> None:
        self.up, self.ssh, self.failing = up, ssh, False
        self.terminated: list[str] = []
        self.bootstrapped = 0

    def describe(self, ids: list[str]) -> dict[str, InstanceInfo]:
        if self.failing:
            raise RuntimeError("describe failed")
        state = InstanceState.RUNNING if self.up else InstanceState.BOOTING
        return {i: InstanceInfo(id=i, state=state, instance_type="x", market=Market.ON_DEMAND,
                                host="203.0.113.7" if self.up else None) for i in ids if i not in self.terminated}

    def terminate(self, ids: list[str]) -> None:
        self.terminated += ids

    def target(self, att: dict[str, Any], inst: InstanceInfo) -> str:
        return str(inst.host)

    def reachable(self, att: dict[str, Any], target: str) -> bool:
        return self.ssh

    def bootstrap_and_start(self, att: dict[str, Any], job: dict[str, Any], resume_from: Any) -> dict[str, float]:
        self.bootstrapped += 1
        return {"bootstrap": 1.0}

    def status(self, att: dict[str, Any]) -> dict[str, Any] | None:
        return {"supervisor_alive": True, "heartbeat": {"ts": 1.0}} if self.ssh else None

    def request_checkpoint(self, att: dict[str, Any]) -> None:
        pass

    def checkpoints_outlive_instance(self, att: dict[str, Any], job: dict[str, Any]) -> bool:
        return False

    def list_owned(self) -> list[InstanceInfo]:
        return []

    def offers(self) -> list[Offer]:
        return []


class _Daemon:
    """A job whose cloud attempt is in `state` on i-1 since T0, and the daemons that watch it on a fake clock: each
    `start` is a daemon (re)started, each `tick` one of its ticks."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, instance: _Instance, state: str) -> None:
        self.app = App(state_dir_override=str(tmp_path / "state"))
        full = self.app.config
        self.app.use_config(full.model_copy(update={"daemon": full.daemon.model_copy(update={
            "boot_timeout_s": TIMEOUT_S, "heartbeat_timeout_s": TIMEOUT_S})}))
        self.instance = instance
        self.now = T0
        self.job_id, _, _ = enqueue(self.app, write_job(tmp_path, "watched", local_throughput=0))
        running = state == "running"
        with self.app.store.tx() as c:
            self.app.store.update_job(self.job_id, c, state="running")
            c.execute(insert(s.attempts).values(
                id=f"{self.job_id}-a1", job_id=self.job_id, n=1, where="cloud", state=state, provider="sim",
                instance_type="x", market="on-demand", instance_id="i-1", idempotency_key="k1", created_at=T0,
                started_at=T0 if running else None,
                info={"last_seen_at": T0, "last_sync_at": T0, "market_checked_at": T0} if running else {}))
        self.monkeypatch = monkeypatch
        self.rec: Reconciler | None = None
        self.start()

    def start(self) -> None:
        if self.rec is not None:
            self.rec.abandon()  # killed, or stopped: the next daemon starts from the database
        self.rec = Reconciler(self.app, {"sim": self.instance}, cloud=self.instance,  # type: ignore[dict-item]
                              clock=lambda: self.now)  # type: ignore[arg-type]
        # The syncs are not these tests': none is under way, and a run's last one (a loss's) is home at once.
        self.monkeypatch.setattr(self.rec.syncs, "sync", lambda *a, **k: None)
        self.monkeypatch.setattr(self.rec.syncs, "final", lambda *a, **k: True)

    def tick(self, after_s: float = TICK_S) -> dict[str, Any]:
        """`after_s` later, a tick: the attempt as it is after it."""
        self.now += after_s
        assert self.rec is not None
        self.rec.tick()
        return self.attempt()

    def ticks_for(self, seconds: float, every_s: float = TICK_S) -> dict[str, Any]:
        """Ticks `every_s` apart for `seconds`, watched throughout: the attempt as it is after them."""
        for _ in range(round(seconds / every_s)):
            att = self.tick(every_s)
        return att

    def stuck_past_the_timeout(self, away: str | None) -> None:
        """Half the timeout watched, then `away` (if not None) for an hour, then watched on to just short of the
        timeout, the attempt still where it was at each look; then watched a few ticks past it."""
        state = self.attempt()["state"]
        assert self.ticks_for(TIMEOUT_S / 2)["state"] == state
        if away is not None:
            AWAY[away](self)
            assert self.tick(HOUR_S)["state"] == state
        assert self.ticks_for(TIMEOUT_S / 2 - 2 * TICK_S)["state"] == state
        self.ticks_for(3 * TICK_S)

    def attempt(self) -> dict[str, Any]:
        with self.app.store.engine.connect() as c:
            return dict(c.execute(select(s.attempts).where(s.attempts.c.id == f"{self.job_id}-a1")).mappings().one())

    def stops(self) -> list[str]:
        return [e["data"]["reason"] for e in self.app.store.events(job_id=self.job_id) if e["type"] in (
            "attempt.stopping", "instance.preempted")]

    def close(self) -> None:
        assert self.rec is not None
        self.rec.close()
        self.app.close()


def _restarted(daemon: _Daemon) -> None:
    daemon.start()


def _asleep(daemon: _Daemon) -> None:
    pass  # the same daemon, its machine suspended: only the clock moves


AWAY = {"restarted": _restarted, "asleep": _asleep}


@pytest.mark.parametrize("away", AWAY)
@pytest.mark.parametrize("stage", ["booting", "sshd not answering"])
def test_a_boot_the_daemon_was_away_for_longer_than_boot_timeout_s_is_waited_for_not_ended_at_the_first_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, away: str, stage: str) -> None:
    # A laptop's daemon launched an instance, then was stopped (or the laptop slept) for an hour. Its first look
    # after that counted the hour as boot time, past daemon.boot_timeout_s, and ended the instance (boot-timeout, or
    # ssh-timeout if sshd did not answer that first try), though it had watched the boot for seconds: the job
    # launched, and paid for, another. Only the time watched counts: the same instance is waited for, and taken.
    instance = _Instance(up=stage != "booting")
    daemon = _Daemon(tmp_path, monkeypatch, instance, "provisioning")
    assert daemon.tick()["state"] == "provisioning"
    AWAY[away](daemon)
    assert daemon.tick(HOUR_S)["state"] == "provisioning"  # the first look after the hour away
    assert daemon.ticks_for(TIMEOUT_S / 2)["state"] == "provisioning"
    instance.up = instance.ssh = True
    att = daemon.tick()
    assert (att["state"], instance.bootstrapped, instance.terminated, daemon.stops()) == ("running", 1, [], [])
    (ready,) = [e["data"] for e in daemon.app.store.events(job_id=daemon.job_id) if e["type"] == "instance.ready"]
    assert ready["boot_s"] > HOUR_S and "not_measured" in ready  # the hour away is no boot time to learn from
    # Said once, with its length: why the timeout waited longer than it is set to.
    (unwatched,) = [e["data"] for e in daemon.app.store.events() if e["type"] == "daemon.unwatched"]
    assert unwatched["seconds"] == pytest.approx(HOUR_S) and unwatched["until"] - unwatched["since"] == HOUR_S
    daemon.close()


@pytest.mark.parametrize("away", [None, *AWAY])
@pytest.mark.parametrize("stage", ["booting", "sshd not answering"])
def test_an_instance_that_does_not_come_up_for_boot_timeout_s_of_watched_time_is_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, away: str | None, stage: str) -> None:
    # The timeout is counted in all: watched throughout, or before and after an hour away.
    instance = _Instance(up=stage != "booting")
    daemon = _Daemon(tmp_path, monkeypatch, instance, "provisioning")
    daemon.stuck_past_the_timeout(away)
    reason = "boot-timeout" if stage == "booting" else "ssh-timeout"
    assert (daemon.stops(), instance.terminated, daemon.attempt()["state"]) == ([reason], ["i-1"], "aborted")
    daemon.close()


@pytest.mark.parametrize("away", AWAY)
def test_a_run_the_daemon_was_away_from_is_not_lost_because_ssh_does_not_answer_its_first_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, away: str) -> None:
    # A running instance was last heard from before the daemon was stopped (or its laptop slept) for an hour; at the
    # first look after it, SSH did not answer yet (the laptop's network coming back). Past heartbeat_timeout_s since
    # it was last seen, the run was called lost: its instance terminated, its work since the last checkpoint gone.
    instance = _Instance(up=True, ssh=True)
    daemon = _Daemon(tmp_path, monkeypatch, instance, "running")
    assert daemon.tick()["state"] == "running"
    instance.ssh = False
    AWAY[away](daemon)
    assert daemon.tick(HOUR_S)["state"] == "running"
    assert daemon.ticks_for(TIMEOUT_S / 2)["state"] == "running"
    instance.ssh = True
    att = daemon.tick()
    assert (att["state"], att["info"]["last_seen_at"], instance.terminated, daemon.stops()) == (
        "running", daemon.now, [], [])
    daemon.close()


@pytest.mark.parametrize("away", [None, *AWAY])
def test_a_run_unreachable_for_heartbeat_timeout_s_of_watched_time_is_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, away: str | None) -> None:
    # The timeout is counted in all: watched throughout, or before and after an hour away.
    instance = _Instance(up=True, ssh=False)
    daemon = _Daemon(tmp_path, monkeypatch, instance, "running")
    daemon.stuck_past_the_timeout(away)
    assert daemon.stops() == ["heartbeat lost (SSH unreachable)"] and instance.terminated == ["i-1"]
    daemon.close()


@pytest.mark.parametrize("away", AWAY)
def test_a_step_failing_before_and_after_the_daemon_was_away_is_given_up_only_after_heartbeat_timeout_s_watched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, away: str) -> None:
    # Four failed looks at a booting instance, an hour away, one more failure at the first look back: five in a row
    # "over 3,600 s", and the attempt was given up, its instance terminated, though the failures had spanned 48 s
    # of watching. They are counted over the time watched: given up once that reaches heartbeat_timeout_s.
    instance = _Instance()
    instance.failing = True
    daemon = _Daemon(tmp_path, monkeypatch, instance, "provisioning")
    every = STEP_RETRY_MAX_S + 1  # each tick a try: none waits for its retry
    daemon.ticks_for((MAX_STEP_ERRORS - 1) * every, every)
    assert daemon.attempt()["info"]["errors"] == MAX_STEP_ERRORS - 1
    AWAY[away](daemon)
    att = daemon.tick(HOUR_S)
    assert (att["state"], att["info"]["errors"], instance.terminated) == ("provisioning", MAX_STEP_ERRORS, [])
    att = daemon.tick(every)
    assert att["state"] == "terminating" and att["info"]["stop_reason"].startswith(
        f"gave up after {MAX_STEP_ERRORS + 1} failed steps over {(MAX_STEP_ERRORS - 1) * every:.0f} s")
    assert instance.terminated == ["i-1"]
    daemon.close()


def test_the_time_before_the_gaps_kept_counts_as_not_watched_for_a_restarted_daemon_too(tmp_path: Path) -> None:
    # Only the last GAPS_KEPT gaps are kept: the watch before the oldest is not known any more, and is not counted
    # (counted as watched, an instance would be given up for time nobody watched).
    app = App(state_dir_override=str(tmp_path / "state"))
    now = [T0]
    watch = Watch(app.store, lambda: now[0], TICK_S)
    for _ in range(GAPS_KEPT + 1):
        watch.look()  # two looks a tick apart, then an hour away
        now[0] += TICK_S
        watch.look()
        now[0] += HOUR_S
    watch.look()
    assert len(watch.gaps) == GAPS_KEPT
    restarted = Watch(app.store, lambda: now[0], TICK_S)
    assert watch.watched_s(T0, now[0]) == restarted.watched_s(T0, now[0]) == pytest.approx(GAPS_KEPT * TICK_S)
    app.close()


@pytest.mark.parametrize("suspended", [True, False])
def test_an_hour_inside_one_tick_is_not_watched_if_the_machine_was_suspended_and_is_if_the_tick_was_slow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suspended: bool) -> None:
    # The laptop closed while a tick was looking at the instances: between that tick's start and its end an hour
    # passed, which the wall clock between ticks does not show. The suspend is told by the machine's clocks (Linux's
    # CLOCK_BOOTTIME counts it, CLOCK_MONOTONIC does not); an hour-long tick on a machine awake is a daemon stuck
    # looking, and counts as watched, or a daemon whose every tick is slow would never give a stuck instance up.
    instance = _Instance()
    daemon = _Daemon(tmp_path, monkeypatch, instance, "provisioning")
    assert daemon.tick()["state"] == "provisioning"
    slept = [0.0]
    monkeypatch.setattr(watch_module, "slept_s", lambda: slept[0])
    describe = instance.describe

    def an_hour_passes(ids: list[str]) -> dict[str, InstanceInfo]:
        monkeypatch.setattr(instance, "describe", describe)  # once
        daemon.now += HOUR_S
        slept[0] += HOUR_S if suspended else 0.0
        return describe(ids)

    monkeypatch.setattr(instance, "describe", an_hour_passes)
    att = daemon.tick()
    if not suspended:
        assert (daemon.stops(), att["state"]) == (["boot-timeout"], "aborted")
        daemon.close()
        return
    assert att["state"] == "provisioning"  # the look after waking, in the tick the suspend fell in
    assert daemon.ticks_for(TIMEOUT_S / 2)["state"] == "provisioning"  # and the ticks after it
    instance.up = instance.ssh = True
    assert (daemon.tick()["state"], instance.terminated, daemon.stops()) == ("running", [], [])
    (unwatched,) = [e["data"] for e in daemon.app.store.events() if e["type"] == "daemon.unwatched"]
    assert unwatched["seconds"] == pytest.approx(HOUR_S)
    daemon.close()
