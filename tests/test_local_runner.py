"""A local attempt's end, as the daemon reads it from the supervisor's own record (real supervisor, real trainer)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from orchestrator.app import App
from orchestrator.lifecycle.local import STOPPED_OUTSIDE, LocalRunner
from orchestrator.queue import enqueue
from runbooks import job_outputs, supervisor
from state import schema as s
from tests.conftest import write_job


def only_attempt(app: App, job_id: str) -> dict[str, Any]:
    with app.store.engine.connect() as c:
        rows = c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id)).mappings().all()
    assert len(rows) == 1
    return dict(rows[0])


def test_a_local_run_stopped_by_a_signal_from_outside_burstctl_resumes_instead_of_failing(tmp_path: Path) -> None:
    # A shutdown of the machine (or someone's kill) SIGTERMs the supervisor: the trainer is asked for a last
    # checkpoint and exits. That is a preemption, not a failure of the job: it resumes from its checkpoint.
    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "local", command=["sleep", "60"], deadline_hours=24,
                                          local_throughput=1.0))
    job = app.store.get_job(job_id)
    assert job is not None and job["placement"] == "local"
    runner = LocalRunner(app)
    assert runner.start(job)
    att = only_attempt(app, job_id)
    run = runner.run_dir(att["id"])
    os.kill(supervisor.read_status(run)["supervisor_pid"], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while supervisor.read_status(run).get("exit") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert supervisor.read_status(run)["exit"]["reason"] == "terminated"

    runner.step(att, app.store.get_job(job_id))

    ended = only_attempt(app, job_id)
    assert (ended["state"], ended["reason"]) == ("preempted", STOPPED_OUTSIDE)
    resumed = app.store.get_job(job_id)
    assert (resumed["state"], resumed["reason"]) == ("resuming", f"preempted: {STOPPED_OUTSIDE}")
    app.close()


def test_a_failed_run_says_why_in_the_command_s_own_last_words_with_secrets_scrubbed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINER_TOKEN", "tok-5ecret-value")
    app = App(state_dir_override=str(tmp_path / "state"))
    script = ("import os, sys; print('loading', file=sys.stderr); "
              "sys.exit('ModuleNotFoundError: no module named torch (token ' + os.environ['TRAINER_TOKEN'] + ')')")
    job_id, _, _ = enqueue(app, write_job(tmp_path, "broken", command=[sys.executable, "-c", script],
                                          local_throughput=1.0, pass_env=["TRAINER_TOKEN"]))
    job = app.store.get_job(job_id)
    assert job is not None
    runner = LocalRunner(app)
    assert runner.start(job)
    run = runner.run_dir(only_attempt(app, job_id)["id"])
    deadline = time.monotonic() + 30
    while supervisor.read_status(run).get("exit") is None and time.monotonic() < deadline:
        time.sleep(0.1)

    runner.step(only_attempt(app, job_id), app.store.get_job(job_id))

    failed = app.store.get_job(job_id)
    assert failed["state"] == "failed"
    assert failed["reason"].startswith("exited: failed (code 1): ModuleNotFoundError: no module named torch")
    assert "tok-5ecret-value" not in failed["reason"] and "tok-5ecret-value" not in str(only_attempt(app, job_id))
    app.close()


def test_a_local_run_slower_than_its_s_l_says_once_that_it_will_miss_the_deadline(tmp_path: Path) -> None:
    # The job file claims 3600 units/h (a second's work) and gate 2 keeps it local for a 36 s deadline; the card
    # really does a step per 0.5 s of 200: the trainer's own figures project the end about a minute late.
    app = App(state_dir_override=str(tmp_path / "state"))
    work = tmp_path / "work"
    work.mkdir()
    trainer = work / "trainer.py"
    trainer.write_bytes((Path(__file__).parents[1] / "examples" / "trainer.py").read_bytes())
    job_id, _, _ = enqueue(app, write_job(tmp_path, "slow-card", workdir="work", local_throughput=3600,
                                          deadline_hours=0.01, command=[sys.executable, "trainer.py", "--steps",
                                                                        "200", "--step-seconds", "0.5",
                                                                        "--checkpoint-every", "2"]))
    job = app.store.get_job(job_id)
    assert job is not None and job["placement"] == "local"
    runner = LocalRunner(app)
    assert runner.start(job)
    run = runner.run_dir(only_attempt(app, job_id)["id"])
    try:
        deadline = time.monotonic() + 30
        while not (supervisor.read_status(run).get("metrics") or {}).get("throughput_units_h"):
            assert time.monotonic() < deadline, "the trainer reported no speed"
            time.sleep(0.2)
        for _ in range(2):
            runner.step(only_attempt(app, job_id), app.store.get_job(job_id))
        (behind,) = [e["data"] for e in app.store.events(job_id=job_id) if e["type"] == "job.behind_schedule"]
        assert behind["where"] == "local" and behind["late_h"] > 0
        assert "(3600 planned)" in app.store.get_job(job_id)["reason"]
    finally:
        supervisor.stop(run, grace_s=5.0)
    app.close()


def test_a_local_attempt_given_up_after_failing_steps_does_not_leave_its_trainer_running(tmp_path: Path) -> None:
    # Five steps in a row failed (here: said so directly). The attempt is given up; its trainer must end with it,
    # or it would hold the GPU and write into the checkpoint dir the job's next attempt starts from.
    from orchestrator.lifecycle.reconcile import MAX_STEP_ERRORS, Reconciler

    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "stuck", command=["sleep", "120"], deadline_hours=24,
                                          local_throughput=1.0))
    rec = Reconciler(app, {}, cloud=None)
    assert rec.local.start(app.store.get_job(job_id))
    att = only_attempt(app, job_id)
    rec.local.step(att, app.store.get_job(job_id))  # intent → running: the supervisor and its command start
    att = only_attempt(app, job_id)
    run = rec.local.run_dir(att["id"])
    assert att["state"] == "running" and supervisor.read_status(run)["child_alive"]

    for _ in range(MAX_STEP_ERRORS):
        rec._step_failed(att, app.store.get_job(job_id), RuntimeError("the metrics file is unreadable"))
        att = only_attempt(app, job_id)

    assert att["state"] == "failed" and att["reason"].startswith(f"gave up after {MAX_STEP_ERRORS} failed steps")
    status = supervisor.read_status(run)
    assert not status["supervisor_alive"] and not status["child_alive"]
    app.close()


def _finish(app: App, job_id: str) -> None:
    """Start the job's local run, wait for its command to exit, and let the runner see it."""
    job = app.store.get_job(job_id)
    assert job is not None and job["placement"] == "local"
    runner = LocalRunner(app)
    assert runner.start(job)
    run = runner.run_dir(only_attempt(app, job_id)["id"])
    deadline = time.monotonic() + 30
    while supervisor.read_status(run).get("exit") is None:
        assert time.monotonic() < deadline, "the command did not exit"
        time.sleep(0.1)
    runner.step(only_attempt(app, job_id), app.store.get_job(job_id))


WRITES_RESULTS = ("import os, pathlib; p = pathlib.Path; p('eval').mkdir(); "
                  "p('result.json').write_text('{\"loss\": 1}'); p('eval/a.json').write_text('a'); "
                  "p('eval/b.json').write_text('b'); p('notes.txt').write_text('n'); "
                  "os.symlink('/etc/hostname', 'eval/elsewhere.json')")


def test_a_job_that_finishes_here_copies_its_outputs_where_a_cloud_run_s_come_home(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    (tmp_path / "work").mkdir()
    job_id, _, _ = enqueue(app, write_job(tmp_path, "eval-here", workdir="work", local_throughput=1.0,
                                          command=[sys.executable, "-c", WRITES_RESULTS],
                                          outputs=["result.json", "eval/", "metrics/*.csv", "model.pt"]))
    _finish(app, job_id)

    assert app.store.get_job(job_id)["state"] == "done"
    home = tmp_path / "state" / "outputs" / job_id
    # What the globs name, a directory standing for the files below it; not a link, which may point anywhere.
    assert sorted(str(f.relative_to(home)) for f in home.rglob("*") if f.is_file()) == [
        "eval/a.json", "eval/b.json", "result.json"]
    assert only_attempt(app, job_id)["info"]["outputs"] == ["eval/a.json", "eval/b.json", "result.json"]
    (told,) = [e["data"] for e in app.store.events(job_id=job_id) if e["type"] == "job.outputs_home"]
    # What it named and did not write is said: a result the run did not produce, or a typo in `outputs`.
    assert told == {"files": 3, "dir": str(home), "missing": ["metrics/*.csv", "model.pt"]}
    # A copy: the workdir keeps its own, and the next run rewriting them there leaves this job's alone.
    (tmp_path / "work" / "result.json").write_text('{"loss": 0.5}')
    assert (home / "result.json").read_text() == '{"loss": 1}'
    app.close()


def test_outputs_that_cannot_be_copied_are_said_and_the_job_is_done_with_them_in_its_workdir(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    (tmp_path / "work").mkdir()
    job_id, _, _ = enqueue(app, write_job(tmp_path, "eval-here", workdir="work", local_throughput=1.0,
                                          command=[sys.executable, "-c", WRITES_RESULTS], outputs=["result.json"]))
    (tmp_path / "state" / "outputs").mkdir(parents=True)
    (tmp_path / "state" / "outputs" / job_id).write_text("in the way")  # a file where the job's directory goes
    _finish(app, job_id)

    assert app.store.get_job(job_id)["state"] == "done"
    (failed,) = [e["data"] for e in app.store.events(job_id=job_id) if e["type"] == "attempt.outputs_copy_failed"]
    assert failed["workdir"] == str(tmp_path / "work") and failed["error"].startswith(("FileExistsError",
                                                                                        "NotADirectoryError"))
    assert (tmp_path / "work" / "result.json").exists()
    assert not [e for e in app.store.events(job_id=job_id) if e["type"] == "job.outputs_home"]
    app.close()


@pytest.mark.parametrize(("patterns", "names", "missing"), [
    (["result.json", "eval/", "runs"], ["eval/a.json", "result.json", "runs/1/events"], []),
    (["eval/*.json", "*.pt"], ["eval/a.json"], ["*.pt"]),
    (["eval/"], [], ["eval/"]),
    (["result.jsn"], ["result.json"], ["result.jsn"]),
    (["./result.json", "**/result.json", "./eval", "**/*.csv"], ["eval/a.json", "result.json"], ["**/*.csv"]),
])
def test_the_outputs_patterns_that_matched_no_file_are_the_missing_ones(patterns: list[str], names: list[str],
                                                                        missing: list[str]) -> None:
    assert job_outputs.unmatched(patterns, names) == missing
