"""`checkpoint.stop_grace_s`: the time a trainer has for its last checkpoint between the SIGTERM of a stop and the
SIGKILL after it. The job's supervisor is started with it, locally and on an instance, and the daemon waits for a
stopped run's end at least that long and a margin. Real supervisors and the example trainer, whose last checkpoint
takes `--stop-seconds` (a large model's optimizer state): 3 s here, so a grace of 1 s cuts it and one of 5 s does
not; an instance's is seen in the supervisor's own log brought home."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from orchestrator import jobspec
from orchestrator.app import App
from orchestrator.lifecycle import checkpoints
from orchestrator.lifecycle.local import (
    CLOUD_STOP_MARGIN_S,
    LOCAL_STOP_MARGIN_S,
    LocalRunner,
    stop_grace_s,
    stop_wait_s,
)
from orchestrator.queue import enqueue
from orchestrator.rehearse import rehearsal_spec
from runbooks import burst_checkpoint, supervisor
from state import schema as s
from tests.conftest import write_job
from tests.e2e import REPO, Daemon, cli, events, simcloud, trainer_job, wait_for, write_config

STOP_SECONDS = 3.0  # how long the trainer's last checkpoint takes once it is told to stop


def local_trainer_job(tmp: Path, grace_s: float) -> Path:
    """The example trainer as a local job that never checkpoints on its own: only a stop's last checkpoint."""
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(REPO / "examples" / "trainer.py", work / "trainer.py")
    return write_job(tmp, "slow-save", workdir="work", local_throughput=1.0,
                     command=[sys.executable, "trainer.py", "--steps", "100000", "--checkpoint-every", "100000",
                              "--step-seconds", "0.05", "--stop-seconds", str(STOP_SECONDS)],
                     checkpoint={"stop_grace_s": grace_s})


def stop_a_local_run(tmp: Path, grace_s: float) -> tuple[dict[str, Any], float, str, list[Path]]:
    """Start the job as the daemon does, let it train, then give it up as the daemon does (`end_trainer`: SIGTERM
    through its supervisor, and wait). Its exit record, when it ended after the stop, the supervisor's log and the
    checkpoints it wrote."""
    app = App(state_dir_override=str(tmp / "state"))
    try:
        job_id, _, _ = enqueue(app, local_trainer_job(tmp, grace_s))
        job = app.store.get_job(job_id)
        assert job is not None and job["placement"] == "local"
        runner = LocalRunner(app)
        assert runner.start(job)
        with app.store.engine.connect() as c:
            (att,) = c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id)).mappings().all()
        run = runner.run_dir(att["id"])
        stdout = run / supervisor.STDOUT_LOG
        wait_for(lambda: stdout.exists() and "training from step" in stdout.read_text(), 30, "the trainer to train")
        stopped_at = time.time()
        assert runner.end_trainer(dict(att))  # it is gone when this returns
        status = supervisor.read_status(run)
        assert not status["supervisor_alive"] and not status["child_alive"]
        written = burst_checkpoint.list_complete(checkpoints.store_dir(app.config, job_id), deep=False)
        return (status["exit"], status["exit"]["ended_at"] - stopped_at, (run / supervisor.SUPERVISOR_LOG).read_text(),
                written)
    finally:
        app.close()


def test_a_last_checkpoint_longer_than_the_grace_is_cut_by_sigkill_when_the_grace_is_over_not_before(
        tmp_path: Path) -> None:
    ended, after_s, log, written = stop_a_local_run(tmp_path, grace_s=1.0)
    assert "SIGKILL in 1s" in log and "grace period over: SIGKILL" in log
    assert ended["reason"] == "terminated" and ended["signal_name"] == "SIGKILL"
    assert STOP_SECONDS > after_s >= 1.0  # killed once its second was over, before it could finish
    assert written == []  # the last checkpoint was never complete


def test_a_last_checkpoint_within_the_grace_is_written_and_the_trainer_exits_by_itself(tmp_path: Path) -> None:
    ended, after_s, log, written = stop_a_local_run(tmp_path, grace_s=5.0)
    assert "SIGKILL in 5s" in log and "grace period over" not in log
    assert ended["reason"] == "terminated" and ended["signal"] is None and ended["exit_code"] == 143
    assert STOP_SECONDS <= after_s < 5.0
    assert [p.name for p in written] == [ended["last_checkpoint"]]  # written on the SIGTERM, after its 3 s


@pytest.mark.slow
def test_the_supervisor_on_an_instance_is_started_with_the_jobs_grace(tmp_path: Path) -> None:
    # A cancelled burst: its trainer's last checkpoint takes 3 s, its grace is 1 s. The supervisor's log, brought
    # home with the run's last sync, says that it gave 1 s (the default would have been 30 s, and let it finish).
    state = tmp_path / "state"
    spec = trainer_job(tmp_path, "slow-save", steps=100000, every=10, step_s=0.1,
                       extra=("--stop-seconds", str(STOP_SECONDS)))
    spec.write_text(spec.read_text() + "stop_grace_s = 1\n")  # in its [checkpoint] table, the file's last
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        job_id = json.loads(cli(config, state, "enqueue", str(spec), "--json").stdout)["id"]
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: events(state, "checkpoint.synced"), 120, "a first checkpoint to come home")
            assert cli(config, state, "cancel", job_id).returncode == 0
            wait_for(lambda: events(state, "instance.terminated"), 120, "the instance to be terminated")
        finally:
            assert daemon.stop() == 0
    (running,) = events(state, "attempt.running")
    log = (state / "runs" / running["attempt_id"] / supervisor.SUPERVISOR_LOG).read_text()
    assert "stopping (terminated): SIGTERM to process group" in log and "SIGKILL in 1s" in log
    assert "grace period over: SIGKILL" in log


def test_a_job_queued_before_the_grace_existed_gets_the_default_and_the_daemon_waits_it_out_with_a_margin() -> None:
    stored = {"checkpoint": {"dir": "checkpoints", "interval_minutes": 30.0, "resumable": True}}  # no stop_grace_s
    assert stop_grace_s(stored) == 30.0
    # As before the field: 60 s for a stopped run on an instance, 40 s for one given up here.
    assert stop_wait_s(stored) == 60.0 and stop_wait_s(stored, LOCAL_STOP_MARGIN_S) == 40.0
    seven_b = {"checkpoint": {"stop_grace_s": 600.0}}
    assert stop_wait_s(seven_b) == 600.0 + CLOUD_STOP_MARGIN_S and stop_wait_s(seven_b, LOCAL_STOP_MARGIN_S) == 610.0


@pytest.mark.parametrize(("grace", "says"), [
    (0, "expected a number greater than 0, got 0"),
    (-5, "expected a number greater than 0, got -5"),
    (3601, "expected a number less than or equal to 3600, got 3601"),
    ("30", "expected a number, got a string"),
    (float("inf"), "expected a finite number"),
])
def test_a_grace_out_of_bounds_exits_2_with_one_line_and_queues_nothing(burstctl_in_process, tmp_path: Path,
                                                                       grace: object, says: str) -> None:
    path = write_job(tmp_path, "grace", checkpoint={"stop_grace_s": grace})
    r = burstctl_in_process("enqueue", str(path))
    assert r.returncode == 2, (r.stdout, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert f"{path}: field 'checkpoint.stop_grace_s': {says}" in line, line
    assert json.loads(burstctl_in_process("list", "--json").stdout) == []


def test_a_grace_is_a_number_of_seconds_up_to_an_hour(tmp_path: Path) -> None:
    def grace(checkpoint: dict[str, Any] | None) -> float:
        return jobspec.load_job(write_job(tmp_path, "grace", checkpoint=checkpoint))[0].checkpoint.stop_grace_s

    assert grace({"stop_grace_s": 120}) == 120.0 and grace({"stop_grace_s": 3600.0}) == 3600.0
    # The default, with the table and without it (a job that does not resume is stopped the same way).
    assert grace({"resumable": True}) == 30.0 and grace(None) == 30.0


def test_a_rehearsal_gives_the_trainer_the_jobs_grace(tmp_path: Path) -> None:
    spec, _ = jobspec.load_job(write_job(tmp_path, "rehearsed", checkpoint={"stop_grace_s": 90.0}))
    forced = tmp_path / "forced.toml"
    forced.write_text(rehearsal_spec(spec, tmp_path / "rehearsed.toml"))
    assert jobspec.load_job(forced)[0].checkpoint.stop_grace_s == 90.0


def test_revert_local_waits_long_enough_for_the_longest_grace_among_the_running_jobs() -> None:
    # Cut short at 180 s, a 10-minute grace's last checkpoint was terminated half written by the sweep.
    from orchestrator.lifecycle.revert import default_timeout_s

    assert default_timeout_s([], {}) == 180.0
    running = [{"job_id": "j1"}, {"job_id": "j2"}]
    assert default_timeout_s(running, {"j1": {}, "j2": {"checkpoint": {"stop_grace_s": 30.0}}}) == 180.0
    assert default_timeout_s(running, {"j1": {}, "j2": {"checkpoint": {"stop_grace_s": 600.0}}}) == 600 + 30 + 120
