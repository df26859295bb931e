"""Fault injection, end to end with real processes: a misbehaving provider API (429 JSON and HTML, 5xx, dropped
connections), its API key refused mid-run, no capacity, SSH dropping mid-run, SSH away for seconds during a
bootstrap, a locked state database, and the daemon's own clock jumping.
(The spot market's faults, spot refused or gone, are in tests/test_e2e_spot_market.py.)
Each test states what must still hold: the job completes (or waits with a clear reason), nothing is launched twice,
nothing crashes."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.app import App
from orchestrator.lifecycle.service import build_reconciler
from tests.conftest import write_job
from tests.e2e import (
    SIM_KEY,
    Daemon,
    EnvDaemon,
    assert_one_instance_per_attempt_and_all_gone,
    cli,
    enqueue,
    events,
    free_port,
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


def done_where_it_ran(state: Path, job_id: str, url: str) -> None:
    """The job ended done on the one instance it ran on, never given up meanwhile, and nothing is left running."""
    assert job(state, job_id)["state"] == "done", job(state, job_id)["reason"]
    assert len(sim_instances(url)) == 1, "the run carried on where it was: one instance"
    assert_one_instance_per_attempt_and_all_gone(url)
    assert not [e for e in events(state, "attempt.") if "gave up" in json.dumps(e["data"])]


def test_a_provider_api_down_for_many_ticks_neither_fails_a_running_job_nor_loses_its_checkpoints(
        tmp_path: Path) -> None:
    # Every look at the instance answered 503 for many ticks (the API down, the instance fine): it was "gave up
    # after 5 failed steps", the instance terminated without its last checkpoint and the job failed, for a blip.
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        job_id = enqueue(config, state, e2e_trainer_job(tmp_path, "api-blip", steps=300, every=20, step_s=0.05,
                                                        interval_minutes=0.01))
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: events(state, "attempt.running"), 120, "the job to run on its instance")
            sim_admin(url, "faults", {"kind": "server-error", "status": 503, "route": "instances", "count": 80})
            wait_for(lambda: not httpx.get(f"{url}/_sim/faults", timeout=10).json()["data"], 120,
                     "the API's 80 failures to be met")
            wait_for(lambda: job(state, job_id)["state"] in ("done", "failed"), 120, "the job to end")
        finally:
            assert daemon.stop() == 0
        done_where_it_ran(state, job_id, url)
    said = [e["data"] for e in events(state, "attempt.error") if e["data"].get("carries_on")]
    assert said and "HTTP 503" in said[0]["error"]  # said once the outage began


def test_a_provider_refusing_the_api_key_mid_run_leaves_the_run_watched_over_ssh_until_the_key_works_again(
        tmp_path: Path) -> None:
    # The user revokes the API key while the job runs: every look at the instance answers 401. The run was no longer
    # watched over SSH (no checkpoint came home, a spot notice went unheard), then given up as failed with its
    # instance left running, as its terminate was refused too. The instance is the user's and SSH needs no API.
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url, daemon={"tick_s": 0.3})
        job_id = enqueue(config, state, e2e_trainer_job(tmp_path, "revoked", steps=100, every=10, step_s=0.1,
                                                        interval_minutes=0.01))
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: events(state, "checkpoint.synced"), 120, "a checkpoint to come home")
            sim_admin(url, "faults", {"kind": "invalid-key", "count": 1_000_000})  # 401 to everything
            refused = wait_for(lambda: [e["ts"] for e in events(state, "provider.call") if e["data"]["call"] ==
                                        "describe" and e["data"]["outcome"] == "AuthFailed"], 30, "a refused look")[0]
            # Two syncs since (one may have been under way), within the step retries' first 15 s: a give-up's last
            # sync (20 s on at the earliest) does not count.
            wait_for(lambda: len([e for e in events(state, "checkpoint.synced") if e["ts"] > refused]) >= 2, 15,
                     "checkpoints to come home while the key is refused")
            wait_for(lambda: events(state, "attempt.provider_refused"), 10, "the refusal to be said")
            status = json.loads(cli(config, state, "status", "--json").stdout)
            (attempt,) = status["attempts"]
            problem = attempt["problem"]
            assert problem.startswith("providers.sim: its API key or credentials were refused (AuthFailed: "), problem
            assert f"instance {attempt['instance']} keeps running and is watched over SSH" in problem
            assert json.loads(cli(config, state, "show", job_id, "--json").stdout)["reason"] == problem
            httpx.delete(f"{url}/_sim/faults", timeout=10).raise_for_status()  # the key works again
            wait_for(lambda: job(state, job_id)["state"] in ("done", "failed"), 120, "the job to end")
        finally:
            assert daemon.stop() == 0
        done_where_it_ran(state, job_id, url)
    (said,) = [e["data"] for e in events(state, "attempt.provider_refused")]  # said once
    assert said["error"] == "AuthFailed" and said["provider"] == "sim"
    assert len(events(state, "attempt.provider_answers")) == 1
    (row,) = ledger(state)
    assert row["ended_at"] is not None and row["cost_usd"] is not None and row["billed_seconds"] > 0


def test_with_no_capacity_the_job_waits_with_a_clear_reason_and_runs_when_capacity_returns(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        sim_admin(url, "faults", {"kind": "insufficient-capacity", "route": "instance-operations/launch",
                                  "count": 10_000})
        # A long backoff, so the job sits blocked (with its reason) long enough to be read.
        config = write_config(tmp_path, url, daemon={"max_launch_failures": 2, "launch_backoff_s": 6.0})
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


def test_an_instances_ssh_away_for_seconds_during_its_bootstrap_is_waited_out_and_the_job_finishes(
        tmp_path: Path) -> None:
    # The instance's sshd restarts mid-bootstrap: the push breaks, then connections are refused for 4 s. Each try
    # failed at once and was tried again each tick: 5 in about 2 s gave the attempt up, its job failed. Tried again
    # after 2 s, 4 s, ..., and given up only after 5 failures spanning the heartbeat timeout, it comes through.
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        job_id = enqueue(config, state, trainer_job(tmp_path, "flaky-ssh"))
        (tmp_path / "work" / "data.bin").write_bytes(os.urandom(64 << 20))  # a push that takes a moment
        daemon = Daemon(tmp_path, config, state).start()
        try:
            def bootstrap_begun() -> Path | None:  # the bootstrap's first command has made the job's directories
                return next((tmp_path / "sim" / "instances").glob(f"*/sandbox/burst/{job_id}/work"), None)

            work = wait_for(bootstrap_begun, 120, "the bootstrap to begin", interval=0.01)
            instance = work.parents[3].name
            if not _sshd_pids(tmp_path / "sim", instance):
                pytest.skip("simcloud runs the paramiko SSH backend here (no sshd to stop)")
            sim_admin(url, f"instances/{instance}/ssh-outage", {"seconds": 4})
            said = []  # what `show` says meanwhile

            def ended() -> bool:
                shown = json.loads(cli(config, state, "show", job_id, "--json").stdout)
                said.append(shown["reason"] or "")
                return shown["state"] in ("done", "failed")

            wait_for(ended, 180, "the job to end", interval=0.05)
        finally:
            assert daemon.stop() == 0
        assert job(state, job_id)["state"] == "done", job(state, job_id)["reason"]
        assert [i["id"] for i in sim_instances(url)] == [instance], "the bootstrap went through on its instance"
        assert_one_instance_per_attempt_and_all_gone(url)
    failed = [e["data"] for e in events(state, "attempt.error") if e["data"]["state"] == "bootstrapping"]
    assert failed, "the outage met the bootstrap"
    assert failed[0]["next_try_in_s"] == 2.0 and all(e["count"] < 5 for e in failed)
    failing = [r for r in said if r.startswith("bootstrap failed")]
    assert failing and re.match(r"bootstrap failed [1-4] times? in a row, next try in (2|4|8) s: ", failing[0]), said
    assert not [e for e in events(state, "attempt.") if "gave up" in json.dumps(e["data"])]


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
        reconciler = build_reconciler(app, clock=lambda: time.time() + offset[0])
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


def test_a_stop_asked_for_while_the_daemon_starts_ends_it_cleanly(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGTERM lands while the daemon is still building its reconciler (providers, the store): it must not die by the
    # signal (a supervisor sees a crash), nor tick on: it stops before its first tick, and says so.
    from orchestrator import daemon as daemon_module
    from orchestrator.lifecycle import service

    app = App(state_dir_override=str(tmp_path / "state"))
    built = service.build_reconciler

    def build_while_stopped(a: App) -> object:
        os.kill(os.getpid(), signal.SIGTERM)
        return built(a)

    monkeypatch.setattr(service, "build_reconciler", build_while_stopped)
    before = signal.getsignal(signal.SIGTERM)
    assert daemon_module.run_daemon(app, tick_s=0.2) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # the test process's own handler is back
    kinds = [e["type"] for e in app.store.events()]
    assert kinds.index("daemon.stopping") < kinds.index("daemon.started") and kinds[-1] == "daemon.stopped"
    app.close()


def test_a_full_disk_is_one_line_from_the_cli_and_one_line_a_change_from_the_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # On a full state disk `enqueue` said "internal error: OSError", and the daemon printed a traceback a tick
    # (about 6,000 lines in 50 s): each tick failed, and so did the event that was to say so.
    import errno
    import threading

    from orchestrator.cli import main
    from orchestrator.daemon import run_daemon

    def full(*_args: object, **_kw: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "state" / "burstctl.db"))

    monkeypatch.setattr("orchestrator.queue.enqueue", full)
    assert main(["--state-dir", str(tmp_path / "state"), "enqueue", str(write_job(tmp_path, "j"))]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"burstctl: error: No space left on device: {tmp_path / 'state' / 'burstctl.db'}; free space " \
                   "(or make it writable) and run it again"

    app = App(state_dir_override=str(tmp_path / "state"))
    emit = app.events.emit

    def disk_full(*_args: object, **_kw: object) -> bool:
        raise sqlite3.OperationalError("database or disk is full")

    def emit_unless_failed(kind: str, **data: object) -> object:
        if kind == "daemon.tick_failed":
            disk_full()
        return emit(kind, **data)

    monkeypatch.setattr(app.store, "still_holds", disk_full)
    monkeypatch.setattr(app.events, "emit", emit_unless_failed)
    capsys.readouterr()
    stopper = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM))  # 20 ticks that all fail
    stopper.start()
    try:
        run_daemon(app, tick_s=0.05)
    finally:
        stopper.cancel()
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "daemon.tick_failed" in line]
    assert len(said) == 1 and "OperationalError: database or disk is full (not recorded: OperationalError" in said[0]
    assert "Traceback" not in err
    app.close()


def test_a_daemon_stopped_longer_than_boot_timeout_s_while_its_instance_boots_takes_that_instance_once_it_is_up(
        tmp_path: Path) -> None:
    # The daemon is stopped (a laptop shut down, the service restarted after an upgrade) just after it launched an
    # instance, for longer than daemon.boot_timeout_s, while the instance boots on in the cloud. The next daemon's
    # first look counted the downtime as boot time and ended the instance (boot-timeout), paying for another
    # launch. Only the time a daemon watched counts: the same instance is taken once it is up.
    state = tmp_path / "state"
    with simcloud(tmp_path, "--boot-delay", "28") as url:
        config = write_config(tmp_path, url, daemon={"tick_s": 0.3, "boot_timeout_s": 12.0})
        job_id = enqueue(config, state, trainer_job(tmp_path, "restarted", steps=20))
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: events(state, "instance.launched"), 60, "the instance to be launched")
            daemon.kill()
            time.sleep(20)  # past the timeout, and past the gap (3 ticks + 15 s) that says nobody watched
            daemon.start()
            wait_for(lambda: job(state, job_id)["state"] in ("done", "failed"), 120, "the job to end")
        finally:
            assert daemon.stop() == 0
        done_where_it_ran(state, job_id, url)
    assert [e["data"]["reason"] for e in events(state, "attempt.stopping")] == ["completed"]
    (unwatched,) = [e["data"] for e in events(state, "daemon.unwatched")]
    assert unwatched["seconds"] >= 20
