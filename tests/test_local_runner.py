"""A local attempt's end, as the daemon reads it from the supervisor's own record (real supervisor, real trainer)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from orchestrator.app import App
from orchestrator.cli.status import status_data
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


def _run_until_it_exits(app: App, tmp_path: Path, name: str, script: str, **fields: object
                        ) -> tuple[str, LocalRunner, Path]:
    """A local job running `python -c script`, started and waited for until its supervisor recorded its exit (not
    yet stepped): (its id, the runner, its run dir)."""
    job_id, _, _ = enqueue(app, write_job(tmp_path, name, command=[sys.executable, "-c", script],
                                          local_throughput=1.0, **fields))
    job = app.store.get_job(job_id)
    assert job is not None
    runner = LocalRunner(app)
    assert runner.start(job)
    run = runner.run_dir(only_attempt(app, job_id)["id"])
    deadline = time.monotonic() + 30
    while supervisor.read_status(run).get("exit") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return job_id, runner, run


def _run_to_its_end(app: App, tmp_path: Path, name: str, script: str, **fields: object) -> tuple[str, Path]:
    """The same, stepped once it exited: (its id, run dir)."""
    job_id, runner, run = _run_until_it_exits(app, tmp_path, name, script, **fields)
    runner.step(only_attempt(app, job_id), app.store.get_job(job_id))
    return job_id, run


def test_a_run_that_ended_while_no_daemon_watched_is_measured_to_its_end_not_to_when_it_was_seen(
        tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    # A second's run: a trainer that ends at once may end before the daemon has written down its start, and an end is
    # never put before the start.
    job_id, runner, run = _run_until_it_exits(app, tmp_path, "unwatched", "import time; time.sleep(1)")
    ended = supervisor.read_status(run)["exit"]["ended_at"]
    time.sleep(4.0)  # the daemon down: it sees the end only now
    runner.step(only_attempt(app, job_id), app.store.get_job(job_id))
    att = only_attempt(app, job_id)
    assert att["state"] == "succeeded" and att["ended_at"] == pytest.approx(ended, abs=1e-3)
    (measured,) = [e["data"] for e in app.store.events(job_id=job_id) if e["type"] == "job.measured"]
    assert measured["run_h"] * 3600 < 3.0  # the run's own second or so, not the four more it went unseen
    app.close()


def test_a_failed_run_says_why_in_the_command_s_own_last_words_with_secrets_scrubbed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINER_TOKEN", "tok-5ecret-value")
    app = App(state_dir_override=str(tmp_path / "state"))
    script = ("import os, sys; print('loading', file=sys.stderr); "
              "sys.exit('ModuleNotFoundError: no module named torch (token ' + os.environ['TRAINER_TOKEN'] + ')')")
    job_id, _ = _run_to_its_end(app, tmp_path, "broken", script, pass_env=["TRAINER_TOKEN"])
    failed = app.store.get_job(job_id)
    assert failed["state"] == "failed"
    assert failed["reason"].startswith("exited: failed (code 1): ModuleNotFoundError: no module named torch")
    assert "tok-5ecret-value" not in failed["reason"] and "tok-5ecret-value" not in str(only_attempt(app, job_id))
    app.close()


def test_a_secret_cut_by_the_records_line_limit_leaves_no_fragment_in_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The trainer's last line puts the secret across the 300 characters its exit record keeps: the supervisor
    # scrubs it before the cut, so none of its characters reach exit.json, the attempt or the job's reason.
    secret = "Zq9-5ecret-value"
    monkeypatch.setenv("TRAINER_TOKEN", secret)
    app = App(state_dir_override=str(tmp_path / "state"))
    script = "import os, sys; sys.exit('E' * 290 + ' token=' + os.environ['TRAINER_TOKEN'] + ' rejected')"
    job_id, run = _run_to_its_end(app, tmp_path, "cut", script, pass_env=["TRAINER_TOKEN"])
    failed = app.store.get_job(job_id)
    assert failed["state"] == "failed" and "EEEE" in failed["reason"]
    record = (run / supervisor.EXIT_FILE).read_text()
    assert json.loads(record)["stderr_tail"] == "E" * 290 + " token=***"[:10]  # 300 characters, scrubbed first
    fragment = secret[:3]  # what a cut after the 297th character would leave
    for text in (failed["reason"], str(only_attempt(app, job_id)), record, json.dumps(app.store.events())):
        assert fragment not in text
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


def test_a_run_behind_schedule_is_said_once_and_its_reason_follows_the_measured_speed(tmp_path: Path) -> None:
    # The reason had been frozen at the first figure, taken seconds after a resume, and was still shown once the end
    # it projected had passed, beside a progress line with other figures.
    from orchestrator.lifecycle.schedule import watch_schedule

    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "slow", local_throughput=1.0, deadline_hours=2, work_units=2))
    att, info, now = {"id": f"{job_id}-a1", "where": "local"}, {}, time.time()

    def measured(done: float, units_h: float) -> str:
        info["metrics"] = {"units_done": done, "throughput_units_h": units_h}
        watch_schedule(app, att, app.store.get_job(job_id), info, now)
        return app.store.get_job(job_id)["reason"]

    assert measured(0.1, 0.5).startswith("behind schedule: at the 0.5 units/h measured (1 planned), the 1.9 units "
                                         "left end ")  # 3.8 h: 1.80 h late
    assert measured(0.2, 0.9).startswith("behind schedule: at the 0.9 units/h measured (1 planned), the 1.8 units")
    assert measured(0.3, 2.0).startswith("on schedule again: at the 2 units/h measured, the run ends ")
    assert measured(0.3, 0.5).startswith("behind schedule: at the 0.5 units/h measured")
    assert [e["type"] for e in app.store.events(job_id=job_id)].count("job.behind_schedule") == 1
    app.close()


def _running_sleeper(tmp_path: Path, clock: Callable[[], float] = time.time, config: str = ""
                     ) -> tuple[App, str, Any, Path]:
    """A local job running `sleep 120` under a real supervisor, started by a reconciler (on `clock`, with `config`
    as its file): (app, job id, the reconciler, the attempt's run dir)."""
    from orchestrator.lifecycle.reconcile import Reconciler

    (tmp_path / "burstctl.toml").write_text(config)
    app = App(config_path=str(tmp_path / "burstctl.toml"), state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "sleeper", command=["sleep", "120"], deadline_hours=24,
                                          local_throughput=1.0))
    rec = Reconciler(app, {}, cloud=None, clock=clock)
    assert rec.local.start(app.store.get_job(job_id))
    rec.local.step(only_attempt(app, job_id), app.store.get_job(job_id))  # intent → running: supervisor, command
    run = rec.local.run_dir(only_attempt(app, job_id)["id"])
    # The supervisor writes its child down once it has started it: on a loaded machine, after `step` returns.
    deadline = time.monotonic() + 30
    while not supervisor.read_status(run).get("child_alive"):
        assert time.monotonic() < deadline, "the supervisor did not start the command"
        time.sleep(0.05)
    return app, job_id, rec, run


def test_failed_steps_with_steps_that_went_through_between_them_do_not_give_the_attempt_up(tmp_path: Path) -> None:
    # Only failures in a row count: five glitches spread over a three-day run had failed the job.
    from orchestrator.lifecycle.reconcile import MAX_STEP_ERRORS, STEP_FAILURE_KEYS, STEP_RETRY_FIRST_S

    offset = [0.0]
    app, job_id, rec, run = _running_sleeper(tmp_path, clock=lambda: time.time() + offset[0])
    try:
        for i in range(MAX_STEP_ERRORS + 1):
            rec._step_failed(only_attempt(app, job_id), app.store.get_job(job_id), RuntimeError(f"glitch {i}"))
            assert only_attempt(app, job_id)["info"]["errors"] == 1
            assert app.store.get_job(job_id)["reason"].startswith("local run's step failed 1 time in a row")
            (problem,) = [a["problem"] for a in status_data(app, now=rec.clock())["attempts"]]
            assert problem == f"1 step failed in a row, next try in 2 s: RuntimeError: glitch {i}"
            offset[0] += STEP_RETRY_FIRST_S + 0.1  # its next try is due
            rec._advance(only_attempt(app, job_id), app.store.get_job(job_id))  # a step that goes through
            att = only_attempt(app, job_id)
            assert att["state"] == "running" and not set(STEP_FAILURE_KEYS) & set(att["info"])
            assert not (app.store.get_job(job_id)["reason"] or "").startswith("local run's step failed")
    finally:
        supervisor.stop(run, grace_s=5.0)
    app.close()


def test_a_local_run_whose_step_failed_is_still_stopped_for_its_hours_while_it_waits_for_its_next_try(
        tmp_path: Path) -> None:
    # A local run's step failed; for the wait before its next try (2 s, then up to 15 s) nothing looked at the run:
    # the end of local.available_hours, a hybrid's hand-over waited for it (only a cancel did not). The run is still
    # watched; failing again in the wait is the same failure, counted at its next try.
    from orchestrator.lifecycle.reconcile import STEP_RETRY_FIRST_S

    now = time.time()
    opens = (time.gmtime(now).tm_hour + 2) % 24  # the GPU's hours begin in over an hour: they are over now
    app, job_id, rec, run = _running_sleeper(tmp_path, clock=lambda: now, config=(
        f'[local]\navailable_hours = ["{opens:02d}:00-{(opens + 1) % 24:02d}:00"]\ntimezone = "UTC"\n'))
    try:
        rec._step_failed(only_attempt(app, job_id), app.store.get_job(job_id), RuntimeError("glitch"))
        att = only_attempt(app, job_id)
        assert att["info"]["errors"] == 1 and att["info"]["retry_at"] == now + STEP_RETRY_FIRST_S
        rec._advance(att, app.store.get_job(job_id))  # in the wait
        att = only_attempt(app, job_id)
        assert att["info"]["stop_reason"] == "local-hours" and "errors" not in att["info"]
        (asked,) = app.store.events(type_prefix="attempt.stop_requested")
        assert asked["data"]["reason"] == "local-hours"
    finally:
        supervisor.stop(run, grace_s=5.0)
    app.close()


def test_a_local_attempt_given_up_after_failing_steps_does_not_leave_its_trainer_running(tmp_path: Path) -> None:
    # Five steps in a row failed over more than the heartbeat timeout (here: said so directly). The attempt is given
    # up; its trainer must end with it, or it would hold the GPU and write into the checkpoint dir the job's next
    # attempt starts from. Five in a second are not enough: a blip is waited out.
    from orchestrator.lifecycle.reconcile import MAX_STEP_ERRORS

    offset = [0.0]
    app, job_id, rec, run = _running_sleeper(tmp_path, clock=lambda: time.time() + offset[0])
    att = only_attempt(app, job_id)
    assert att["state"] == "running" and supervisor.read_status(run)["child_alive"]

    for _ in range(MAX_STEP_ERRORS + 2):
        rec._step_failed(att, app.store.get_job(job_id), RuntimeError("the metrics file is unreadable"))
        att = only_attempt(app, job_id)
    assert att["state"] == "running" and att["info"]["errors"] == MAX_STEP_ERRORS + 2

    offset[0] += app.config.daemon.heartbeat_timeout_s
    rec._step_failed(att, app.store.get_job(job_id), RuntimeError("the metrics file is unreadable"))
    att = only_attempt(app, job_id)
    assert att["state"] == "failed" and att["reason"].startswith(f"gave up after {MAX_STEP_ERRORS + 3} failed steps "
                                                                 f"over {app.config.daemon.heartbeat_timeout_s:.0f} s")
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


def test_outputs_an_earlier_run_left_in_the_workdir_are_not_this_jobs(tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    (tmp_path / "work" / "eval").mkdir(parents=True)
    for stale in ("result.json", "eval/old.json"):  # another job's results, from a run an hour ago
        (tmp_path / "work" / stale).write_text("not mine")
        os.utime(tmp_path / "work" / stale, (time.time() - 3600, time.time() - 3600))
    writes_one = "import pathlib; pathlib.Path('eval/new.json').write_text('mine')"
    job_id, _, _ = enqueue(app, write_job(tmp_path, "evaluates", workdir="work", local_throughput=1.0,
                                          command=[sys.executable, "-c", writes_one],
                                          outputs=["result.json", "eval/"]))
    _finish(app, job_id)

    home = tmp_path / "state" / "outputs" / job_id
    assert sorted(str(f.relative_to(home)) for f in home.rglob("*") if f.is_file()) == ["eval/new.json"]
    (told,) = [e["data"] for e in app.store.events(job_id=job_id) if e["type"] == "job.outputs_home"]
    assert told["missing"] == ["result.json"]  # it did not write one
    app.close()


def test_a_local_run_stopped_to_hand_over_to_the_cloud_keeps_what_it_wrote_as_outputs(tmp_path: Path) -> None:
    # Its workdir goes with the rest of the job to an instance, where what this run wrote is not that run's own.
    app = App(state_dir_override=str(tmp_path / "state"))
    (tmp_path / "work").mkdir()
    writes_then_stops = "import pathlib, sys; pathlib.Path('events.1').write_text('phase 1'); sys.exit(143)"
    job_id, _, _ = enqueue(app, write_job(tmp_path, "hands-over", workdir="work", local_throughput=1.0,
                                          command=[sys.executable, "-c", writes_then_stops],
                                          outputs=["events.*", "result.json"]))
    runner = LocalRunner(app)
    assert runner.start(app.store.get_job(job_id))
    att = only_attempt(app, job_id)
    deadline = time.monotonic() + 30
    while supervisor.read_status(runner.run_dir(att["id"])).get("exit") is None:
        assert time.monotonic() < deadline, "the command did not exit"
        time.sleep(0.1)
    with app.store.tx() as c:  # as the hand-over asked it to stop
        app.store.set_attempt_info(att["id"], {**att["info"], "stop_reason": "hybrid-switch"}, c)
    runner.step(only_attempt(app, job_id), app.store.get_job(job_id))

    assert only_attempt(app, job_id)["state"] == "preempted"
    assert (tmp_path / "state" / "outputs" / job_id / "events.1").read_text() == "phase 1"
    # Said at the job's end, with what is missing then: a notice now would read as the job's end.
    assert not [e for e in app.store.events(job_id=job_id) if e["type"] == "job.outputs_home"]
    app.close()


def test_the_outputs_an_instance_lists_are_those_its_run_wrote(tmp_path: Path) -> None:
    # The listing a rented instance runs (`python3 -c` with this file's source), against its run's start there.
    run_dir, work = tmp_path / "run", tmp_path / "work"
    run_dir.mkdir()
    work.mkdir()
    (work / "pushed.json").write_text("from the workdir")
    os.utime(work / "pushed.json", (time.time() - 600, time.time() - 600))
    (run_dir / supervisor.HEARTBEAT_FILE).write_text(json.dumps({"started_at": time.time() - 60}))
    (work / "written.json").write_text("by the run")
    source = (Path(job_outputs.__file__)).read_text()
    listed = subprocess.run([sys.executable, "-c", source, "--run-dir", str(run_dir), str(work), "*.json"],
                            capture_output=True, text=True, check=True).stdout
    assert json.loads(listed) == ["written.json"]
    # Without a start on record (no heartbeat yet), nothing is held back.
    (run_dir / supervisor.HEARTBEAT_FILE).unlink()
    listed = subprocess.run([sys.executable, "-c", source, "--run-dir", str(run_dir), str(work), "*.json"],
                            capture_output=True, text=True, check=True).stdout
    assert json.loads(listed) == ["pushed.json", "written.json"]


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


def test_a_local_run_whose_supervisor_dies_at_each_start_fails_after_three_instead_of_resuming_for_ever(
        tmp_path: Path) -> None:
    # A supervisor that dies at once (an environment no process takes, a machine out of processes) was taken for a
    # preemption each time: the job resumed every tick, for ever, holding the local GPU's slot.
    from orchestrator.lifecycle.local import SUPERVISOR_DIED

    app = App(state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "local", command=["sleep", "60"], deadline_hours=24,
                                          local_throughput=1.0))
    runner = LocalRunner(app)
    for n in (1, 2, 3):
        assert runner.start(app.store.get_job(job_id))
        with app.store.engine.connect() as c:
            att = dict(c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id, s.attempts.c.n == n))
                       .mappings().one())
        run = runner.run_dir(att["id"])
        pid = supervisor.read_status(run)["supervisor_pid"]
        os.kill(pid, signal.SIGKILL)  # gone without a word; its trainer, in a session of its own, runs on
        deadline = time.monotonic() + 30
        while supervisor.read_status(run).get("supervisor_alive") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert supervisor.read_status(run)["child_alive"]
        runner.step(att, app.store.get_job(job_id))
        assert not supervisor.read_status(run)["child_alive"]  # ended before another attempt's trainer starts
        job = app.store.get_job(job_id)
        if n < 3:
            assert (job["state"], job["reason"]) == ("resuming", f"preempted: {SUPERVISOR_DIED}")
    assert job["state"] == "failed"
    assert job["reason"].startswith(f"{SUPERVISOR_DIED} 3 times in a row within 60 s of its start: ")
    app.close()
