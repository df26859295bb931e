"""End to end on simcloud with real SSH and real processes: a checkpointing trainer bursts to spot, is preempted,
resumes on another instance from its checkpoint, finishes bit-identical to an uninterrupted run, and every instance
is gone with the meter matching simcloud's billing. A daemon killed with SIGKILL mid-run is restarted and carries on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.app import App
from orchestrator.queue import measured_setup_hours
from runbooks.burst_checkpoint import MANIFEST
from tests.e2e import (
    SIM_KEY,
    Daemon,
    cli,
    daemon_until,
    events,
    job,
    preempt,
    sim_billing,
    sim_instances,
    simcloud,
    store_sections,
    trainer_job,
    wait_for,
    write_config,
)
from tests.e2e import ledger as e2e_ledger

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
STEPS, EVERY, STEP_S = 160, 10, 0.1


def spot_job(tmp: Path, steps: int = STEPS) -> Path:
    """The trainer, which does not fit locally: it bursts. Its outputs, in its workdir: result.json, and a log file
    per run under runs/ (as TensorBoard writes an events file per run)."""
    return trainer_job(tmp, "trainer", steps=steps, every=EVERY, step_s=STEP_S,
                       extra=("--out", "result.json", "--log-dir", "runs"), outputs=["result.json", "runs/"])


def uninterrupted_final_state(tmp: Path) -> bytes:
    """The same trainer, run once locally with no interruption: the reference final checkpoint."""
    ckpt = tmp / "reference" / "checkpoints"
    ckpt.mkdir(parents=True)
    env = {"BURST_CHECKPOINT_DIR": str(ckpt), "BURST_RESUME_FROM": "", "PYTHONPATH": str(REPO / "runbooks"),
           "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, str(REPO / "examples" / "trainer.py"), "--steps", str(STEPS),
                    "--checkpoint-every", str(EVERY), "--step-seconds", "0"], env=env, check=True, timeout=120,
                   capture_output=True, cwd=tmp / "reference")  # its result.json there
    return (ckpt / f"step-{STEPS:08d}" / "state.json").read_bytes()


def running_instance(state: Path, after: int = 0) -> str:
    evs = [e for e in events(state, "attempt.running") if e["id"] > after and e["data"].get("instance")]
    return evs[-1]["data"]["instance"] if evs else ""


def synced(state: Path, after: int = 0) -> bool:
    return any(e["id"] > after for e in events(state, "checkpoint.synced"))


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_burst_preempt_resume_finish_and_nothing_left(tmp_path: Path, backend: str,
                                                      request: pytest.FixtureRequest) -> None:
    # The same story on both stores: SQLite in the state directory, and a real PostgreSQL server by URL.
    state = tmp_path / "state"
    database = store_sections(backend, request)
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url, **database)
        job_file = spot_job(tmp_path)
        # An earlier job's log in the workdir goes to the instance with it, but it is not this job's output.
        earlier = tmp_path / "work" / "runs" / "run-of-an-earlier-job.jsonl"
        earlier.parent.mkdir()
        earlier.write_text('{"step": 1}\n')
        os.utime(earlier, (time.time() - 3600, time.time() - 3600))
        r = cli(config, state, "enqueue", str(job_file), "--json")
        assert r.returncode == 0, r.stderr
        job_id = json.loads(r.stdout)["id"]
        daemon = Daemon(tmp_path, config, state).start()
        try:
            first = wait_for(lambda: running_instance(state), 90, "the first attempt to run")
            wait_for(lambda: synced(state), 60, "a first checkpoint to come home")
            preempt(url, first, notice_s=1.0)
            wait_for(lambda: events(state, "job.resumed"), 120, "the job to resume elsewhere")
            wait_for(lambda: job(state, job_id)["state"] == "done", 180, "the job to finish")
        finally:
            assert daemon.stop() == 0
        instances = sim_instances(url)
        billing = sim_billing(url)

    assert (state / "burstctl.db").exists() == (backend == "sqlite")  # the URL's store, not SQLite beside it
    # What the daemon saw simcloud list prices the next decision (its 1×H100 at $3.29, not [prices]' $3.00), and a
    # machine no provider sells (3×H100) is not planned.
    spec = spot_job(tmp_path).read_text()
    (tmp_path / "next.toml").write_text(spec.replace('name = "trainer"', 'name = "next"'))
    (tmp_path / "three.toml").write_text(spec.replace('name = "trainer"', 'name = "three"')
                                         .replace("[checkpoint]", "gpus = 3\n[checkpoint]"))
    priced = json.loads(cli(config, state, "decide", str(tmp_path / "next.toml"), "--json", "--no-record").stdout)
    assert priced["rate_usd_per_gpu_h"] in (3.29, 1.0)  # on-demand or spot, as listed
    assert any(r.startswith("H100: $3.29/GPU-h on-demand, spot $1.00, as sim ") for r in priced["reasons"])
    three = json.loads(cli(config, state, "decide", str(tmp_path / "three.toml"), "--json", "--no-record").stdout)
    assert three["verdict"] == "rethink" and any("no provider lists a 3×H100 machine" in r for r in three["reasons"])
    types = [e["type"] for e in events(state)]
    for a, b in [("instance.preempted", "job.resuming"), ("job.resuming", "job.resumed"), ("job.resumed", "job.done")]:
        assert types.index(a) < types.index(b), (a, b)
    pre = events(state, "instance.preempted")[0]["data"]
    assert pre["instance"] == first and pre["lost_work_h"] >= 0
    assert events(state, "job.resuming")[0]["data"]["lost_work_h"] == pre["lost_work_h"]  # one figure, said twice
    resumed = events(state, "job.resumed")[0]["data"]
    assert resumed["instance"] != first and resumed["checkpoint"].startswith("step-")
    # Both instances are gone; what the trainer printed on each came home (`burstctl logs`): the first attempt's
    # from step 0, the resumed one's from its checkpoint, to its end.
    assert "training from step 0 to" in cli(config, state, "logs", job_id, "--attempt", "1").stdout
    last = cli(config, state, "logs", job_id).stdout
    assert f"training from step {int(resumed['checkpoint'][5:])} to {STEPS}" in last
    assert f"done: step {STEPS}, result in" in last  # its last line: pulled once its exit was seen

    # The final state is bit-identical to an uninterrupted run's, and so is the result it wrote in its workdir on
    # the instance, which came home as the job's output before the instance went.
    final = state / "checkpoints" / job_id / f"step-{STEPS:08d}" / "state.json"
    assert final.read_bytes() == uninterrupted_final_state(tmp_path)
    assert (state / "outputs" / job_id / "result.json").read_bytes() == (tmp_path / "reference" / "result.json"
                                                                          ).read_bytes()
    (home,) = events(state, "job.outputs_home")
    assert home["data"]["files"] == 2 and types.index("job.outputs_home") < types.index("job.done")
    # The preempted attempt's run log came home with its checkpoints, before its instance went (the resumed run's
    # log starts after its checkpoint: the steps before it would have been lost with the first instance). It is as
    # of the newest checkpoint that came home with it; the notice's last sync may find the instance reclaimed.
    first_syncs = [e["data"] for e in events(state, "checkpoint.synced") if e["attempt_id"].endswith("-a1")]
    with_outputs = [int(d["checkpoints"][-1][5:]) for d in first_syncs if d.get("outputs") == 1]
    assert with_outputs
    runs = state / "outputs" / job_id / "runs"
    first_steps = [json.loads(line)["step"] for line in (runs / "run-attempt1.jsonl").read_text().splitlines()]
    last_steps = [json.loads(line)["step"] for line in (runs / "run-attempt2.jsonl").read_text().splitlines()]
    assert first_steps == list(range(1, len(first_steps) + 1)) and first_steps[-1] >= max(with_outputs)
    assert last_steps == list(range(int(resumed["checkpoint"][5:]) + 1, STEPS + 1))
    assert f"outputs: {state / 'outputs' / job_id} (3 files)" in cli(config, state, "show", job_id).stdout
    assert not (runs / earlier.name).exists()

    # Nothing is left running, and the meter agrees with the provider's billing record.
    assert len(instances) == 2 and all(i["status"] in ("terminated", "preempted") for i in instances)
    ledger = e2e_ledger(state)
    assert {r["instance_id"] for r in ledger} == {i["id"] for i in instances}
    assert all(r["cost_usd"] is not None for r in ledger)
    billed = {b["instance_id"]: b for b in billing}
    for r in ledger:
        b = billed[r["instance_id"]]
        # within one tick (0.5 s) of simcloud's own record, at the same rate
        assert abs(r["billed_seconds"] - b["billed_s"]) <= 1.5, (r, b)
        assert r["rate_usd_h"] == pytest.approx(b["rate_usd_h"])
        assert abs(r["cost_usd"] - b["cost_usd"]) <= b["rate_usd_h"] * 1.5 / 3600
    # The trainer's measured throughput is kept as this job's s_R on that GPU type, for its next decision.
    from orchestrator.app import App
    from orchestrator.queue import measured_rented_throughputs

    app = App(state_dir_override=str(state))
    assert measured_rented_throughputs(app, {"trainer": ["H100"]})["trainer"]["H100"] > 0
    app.close()
    record = Path(job(state, job_id)["record_path"]).read_text()
    assert "preemption(s)" in record and "_(filled in after the run)_" not in record
    assert SIM_KEY not in (state / "events.jsonl").read_text()


def test_a_daemon_killed_mid_run_is_restarted_and_carries_on(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        job_id = json.loads(cli(config, state, "enqueue", str(spot_job(tmp_path)), "--json").stdout)["id"]
        daemon = Daemon(tmp_path, config, state).start()
        first = wait_for(lambda: running_instance(state), 90, "the attempt to run")
        daemon.kill(signal.SIGKILL)
        # The instance and the trainer keep running without a daemon; a new one adopts them.
        daemon.start()
        try:
            wait_for(lambda: job(state, job_id)["state"] == "done", 180, "the job to finish")
        finally:
            assert daemon.stop() == 0
        instances = sim_instances(url)
    assert [i["id"] for i in instances] == [first]  # adopted, not launched again
    assert instances[0]["status"] == "terminated"
    assert len(events(state, "daemon.started")) == 2


def test_cancelling_a_running_burst_brings_its_last_checkpoint_home_and_terminates_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        job_id = json.loads(cli(config, state, "enqueue", str(spot_job(tmp_path, steps=2000)),
                                "--json").stdout)["id"]
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: synced(state), 120, "a first checkpoint to come home")
            assert cli(config, state, "cancel", job_id).returncode == 0
            wait_for(lambda: events(state, "instance.terminated"), 120, "the instance to be terminated")
        finally:
            assert daemon.stop() == 0
        instances = sim_instances(url)
    assert job(state, job_id)["state"] == "cancelled"
    assert [i["status"] for i in instances] == ["terminated"]
    stopping = events(state, "attempt.stopping")[0]["data"]
    assert stopping["reason"] == "cancelled" and stopping["outcome"] == "aborted"
    # What the cancelled run spent is in its record and the trail, as a finished run's is.
    (measured,) = (e["data"] for e in events(state, "job.measured"))
    assert measured["ended"] == "cancelled" and measured["cost_usd"] > 0
    record = Path(job(state, job_id)["record_path"]).read_text()
    assert f"- **Measured:** cancelled: run {measured['run_h']:.2f} h, cost $" in record


def _path_without(tmp: Path, program: str) -> str:
    """A PATH with every program of this one but `program`: for an instance image that lacks it."""
    farm = tmp / f"bin-without-{program}"
    farm.mkdir()
    for folder in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        for exe in Path(folder).glob("*") if Path(folder).is_dir() else []:
            if exe.name != program and not (farm / exe.name).exists() and os.access(exe, os.X_OK):
                (farm / exe.name).symlink_to(exe)
    return str(farm)


def test_on_instances_with_only_the_pure_python_ssh_server_a_burst_runs_to_done_over_sftp(tmp_path: Path) -> None:
    # A machine without OpenSSH's sshd runs simcloud's instances on paramiko's server, whose SFTP is confined to the
    # instance's folder; an instance without rsync is synced over SFTP. Every step of a burst (push, start, syncs,
    # outputs) must work through that, as `make demo` does on a fresh machine. The workdir push once stat'ed `/`,
    # and every burst failed at its bootstrap.
    state = tmp_path / "state"
    with simcloud(tmp_path, "--paramiko", env={"PATH": _path_without(tmp_path, "rsync")}) as url:
        config = write_config(tmp_path, url)
        job_id = json.loads(cli(config, state, "enqueue", str(spot_job(tmp_path, steps=30)), "--json").stdout)["id"]
        daemon_until(tmp_path, config, state, lambda: job(state, job_id)["state"] in ("done", "failed"), 120,
                     "the burst to end")
        instances = sim_instances(url)
    assert job(state, job_id)["state"] == "done", job(state, job_id)["reason"]
    assert [i["status"] for i in instances] == ["terminated"]
    assert {e["data"]["via"] for e in events(state, "checkpoint.synced")} == {"sftp"}
    assert (state / "outputs" / job_id / "result.json").is_file()


@pytest.mark.parametrize("launch_on_notice", [True, False])
def test_on_an_interruption_notice_the_newest_checkpoint_comes_home_before_the_instance_is_reclaimed(
        tmp_path: Path, launch_on_notice: bool) -> None:
    # A checkpoint every step of 2 s, synced only every 150 s (a 5-minute interval): when the notice comes, after
    # step 2's checkpoint, nothing has come home yet. The trainer's last checkpoint takes 30 s (a large model's), so
    # the reclaim 6 s after the notice comes first, and its exit is never seen: what the instance holds must come
    # home on the notice itself, or the run starts over. Make before break (`daemon.launch_on_notice`, the
    # default): the next instance is launched on the notice and boots meanwhile, runs the job's setup meanwhile
    # too, and takes over once the noticed attempt has ended.
    state = tmp_path / "state"
    spec = trainer_job(tmp_path, "notice", steps=8, every=1, step_s=2.0, interval_minutes=5,
                       extra=("--stop-seconds", "30"),
                       setup=["sh", "-c", f"sleep 1 && pwd >> {tmp_path / 'setup-ran'}"])
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url, daemon={"launch_on_notice": launch_on_notice})
        job_id = json.loads(cli(config, state, "enqueue", str(spec), "--json").stdout)["id"]
        daemon = Daemon(tmp_path, config, state).start()
        try:
            first = wait_for(lambda: running_instance(state), 90, "the first attempt to run")
            sandbox = tmp_path / "sim" / "instances" / first / "sandbox"
            wait_for(lambda: any(sandbox.rglob(f"step-00000002/{MANIFEST}")), 30, "step 2's checkpoint")
            assert not synced(state)
            # The notice, then the reclaim 6 s later (`preempt`, with a look at what the job says in between).
            httpx.post(f"{url}/_sim/instances/{first}/notice", json={"seconds": 6.0}, timeout=10).raise_for_status()
            noticed = time.monotonic()
            told = wait_for(lambda: "interruption notice" in (job(state, job_id)["reason"] or "")
                            and job(state, job_id)["reason"], 5.5, "the job to say it got the notice")
            time.sleep(max(0.0, 6.0 - (time.monotonic() - noticed)))
            httpx.post(f"{url}/_sim/instances/{first}/preempt", json={}, timeout=10).raise_for_status()
            # Once it runs again, the job says so, not how its instance was launched.
            again = wait_for(lambda: re.fullmatch(r"running on sim \S+ \(spot\), resumed from step-\d+",
                                                  job(state, job_id)["reason"] or ""), 120, "the job to run again")
            wait_for(lambda: job(state, job_id)["state"] == "done", 180, "the job to finish")
        finally:
            assert daemon.stop() == 0

    assert again
    trail = events(state)
    (notice,) = (e for e in trail if e["type"] == "instance.interruption_notice")
    assert notice["data"]["instance"] == first and notice["data"]["last_checkpoint_home"] is None
    preempted = next(e for e in trail if e["type"] == "instance.preempted")
    pulled = [e["data"]["checkpoints"][-1] for e in trail
              if e["type"] == "checkpoint.synced" and notice["id"] < e["id"] < preempted["id"]]
    assert pulled and pulled[-1] >= "step-00000002"
    resumed = next(e for e in trail if e["type"] == "job.resumed")["data"]
    assert resumed["instance"] != first and resumed["checkpoint"] == pulled[-1]
    assert told.startswith("spot interruption notice: sim reclaims the instance at ")
    assert "; its newest checkpoint is coming home (none is home yet)" in told
    intents = [e for e in trail if e["type"] == "attempt.intent"]
    assert len(intents) == 2  # the first attempt and the one the job resumed on, nothing launched twice
    (running,) = (e for e in trail if e["type"] == "attempt.running" and e["id"] > preempted["id"])
    if launch_on_notice:
        # Written and launched on the notice, ready before the reclaim; taken over once the noticed attempt ended.
        assert intents[1]["data"]["successor_for"] == notice["attempt_id"] and intents[1]["id"] > notice["id"]
        ready = next(e for e in trail if e["type"] == "instance.ready" and e["attempt_id"] == intents[1]["attempt_id"])
        assert ready["id"] < preempted["id"]
        (taken,) = (e for e in trail if e["type"] == "attempt.successor_taken_over")
        assert taken["attempt_id"] == intents[1]["attempt_id"] == running["attempt_id"]
        assert taken["id"] > preempted["id"]
        assert "its next instance is launching" in told
        # The setup ran on the successor while it waited, and was not run again when it took over.
        (early,) = (e for e in trail if e["type"] == "attempt.setup_started_early")
        assert early["attempt_id"] == taken["attempt_id"] and early["id"] < taken["id"]
    else:
        assert "successor_for" not in intents[1]["data"] and intents[1]["id"] > preempted["id"]
        assert not [e for e in trail if e["type"] == "attempt.successor_taken_over"]
    # The setup ran once on each instance (simcloud's run on this machine), in the job's workdir there.
    ran = (tmp_path / "setup-ran").read_text().splitlines()
    assert len(ran) == 2
    for instance, workdir in zip((first, resumed["instance"]), ran, strict=True):
        assert f"/instances/{instance}/" in workdir and workdir.endswith(f"/burst/{job_id}/work")
    # The first attempt's log came home on the notice: its one sync was at its start, and its exit was never seen.
    first_log = cli(config, state, "logs", job_id, "--attempt", "1").stdout
    assert "training from step 0 to 8" in first_log and "checkpoint step-00000002" in first_log
    # `burstctl report` reads the same run from the ledger and the attempts as the job's Measured line did.
    measured = next(e for e in trail if e["type"] == "job.measured")["data"]
    (row,) = json.loads(cli(config, state, "report", "--days", "1", "--json").stdout)["jobs"]
    assert (row["id"], row["attempts"]) == (job_id, 2) and row["preemptions"] == measured["preemptions"] == 1
    assert row["spot_usd"] + row["on_demand_usd"] == pytest.approx(measured["cost_usd"], abs=1e-3)
    assert row["run_h"] == pytest.approx(measured["run_h"], abs=1e-3) and row["deadline_met"] is True
    # Its time was measured (on the first instance, which ran it itself) for the job's next decisions' t_ovh.
    app = App(config_path=str(config), state_dir_override=str(state))
    try:
        assert measured_setup_hours(app, ["notice"])["notice"] * 3600 >= 1.0  # its `sleep 1`
    finally:
        app.close()


def test_a_failing_setup_fails_the_job_with_its_last_line_and_the_instance_is_terminated(tmp_path: Path) -> None:
    state = tmp_path / "state"
    spec = trainer_job(tmp_path, "broken-setup", steps=20, every=5, setup_retries=1,
                       setup=["sh", "-c", f"echo try >> {tmp_path / 'tries'}; echo collecting; "
                                          "echo 'ERROR: No matching distribution found for nothing-such' >&2; exit 3"])
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        job_id = json.loads(cli(config, state, "enqueue", str(spec), "--json").stdout)["id"]
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: job(state, job_id)["state"] == "failed", 120, "the job to fail")
            wait_for(lambda: events(state, "instance.terminated"), 60, "the instance to be terminated")
        finally:
            assert daemon.stop() == 0
        instances = sim_instances(url)
    reason = job(state, job_id)["reason"]
    assert "setup-failed (code 3)" in reason and "No matching distribution found for nothing-such" in reason
    assert (tmp_path / "tries").read_text().split() == ["try", "try"]  # it was given its one more try (10 s later)
    setup_log = cli(config, state, "logs", job_id, "--setup").stdout  # home, though the instance is gone
    assert setup_log.count("collecting") == 2 and "--- burstctl: setup try 2 of 2 ---" in setup_log
    assert [i["status"] for i in instances] == ["terminated"]
    assert not events(state, "checkpoint.synced")  # the trainer never started


def test_outputs_that_cannot_come_home_keep_the_instance_until_they_can(tmp_path: Path) -> None:
    state = tmp_path / "state"
    spec = trainer_job(tmp_path, "outputs", steps=20, every=5, extra=("--out", "result.json"),
                       outputs=["result.json"])
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        job_id = json.loads(cli(config, state, "enqueue", str(spec), "--json").stdout)["id"]
        in_the_way = state / "outputs" / job_id  # a file where the outputs' directory goes: the pull fails
        in_the_way.parent.mkdir(parents=True, exist_ok=True)
        in_the_way.write_text("in the way")
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: events(state, "attempt.outputs_pull_failed"), 120, "the outputs' pull to fail")
            time.sleep(2)  # ticks go by: the finished job's instance is kept, not terminated
            assert job(state, job_id)["state"] == "running" and not events(state, "instance.terminated")
            in_the_way.unlink()
            wait_for(lambda: job(state, job_id)["state"] == "done", 60, "the job to finish")
        finally:
            assert daemon.stop() == 0
        instances = sim_instances(url)
    assert len(events(state, "attempt.outputs_pull_failed")) == 1  # said once, though tried at every tick
    assert json.loads((state / "outputs" / job_id / "result.json").read_text())["step"] == 20
    assert [i["status"] for i in instances] == ["terminated"]
