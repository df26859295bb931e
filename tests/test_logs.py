"""`burstctl logs JOB`: a job's log from `<state>/runs/<attempt>/`, whichever attempt and wherever it ran.

The attempts are written as the daemon writes them; their logs as a supervisor (or the cloud's pull) leaves them.
Logs coming home from a real instance are tests/test_e2e_burst.py's and tests/test_sync.py's.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import insert, update

from orchestrator.app import App
from orchestrator.queue import enqueue
from state import schema as s
from tests.conftest import write_job


class Job:
    def __init__(self, tmp: Path, cli: Callable[..., subprocess.CompletedProcess[str]]) -> None:
        self.cli = cli
        self.state = tmp / "state"
        self.app = App(state_dir_override=str(self.state))
        self.id, _, _ = enqueue(self.app, write_job(tmp, "trainer", local_throughput=0))

    def attempt(self, n: int, state: str, where: str = "cloud", **logs: bytes) -> Path:
        now = time.time()
        with self.app.store.tx() as c:
            c.execute(insert(s.attempts).values(
                id=f"{self.id}-a{n}", job_id=self.id, n=n, where=where, state=state, info={}, created_at=now,
                started_at=now, provider=None if where == "local" else "sim",
                instance_type=None if where == "local" else "gpu_1x_h100", market=None if where == "local" else "spot"))
        run = self.state / "runs" / f"{self.id}-a{n}"
        run.mkdir(parents=True)
        for name, text in logs.items():
            (run / f"{name}.log").write_bytes(text)
        return run

    def logs(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.cli("--state-dir", str(self.state), "logs", self.id, *args)


@pytest.fixture
def job(tmp_path: Path, burstctl_here: Callable[..., subprocess.CompletedProcess[str]]):
    j = Job(tmp_path, burstctl_here)
    yield j
    j.app.close()


def test_the_newest_attempts_stdout_by_default_and_any_attempts_other_logs_on_request(job: Job) -> None:
    job.attempt(1, "preempted", stdout=b"training from step 0 to 300\nstep 100\n", stderr=b"a warning\n")
    job.attempt(2, "running", stdout=b"training from step 100 to 300\n", supervisor=b"attempt 2: starting\n")
    r = job.logs()
    assert r.returncode == 0, r.stderr
    assert r.stdout == "training from step 100 to 300\n"
    assert r.stderr == (f"# trainer ({job.id}), attempt 2 (sim gpu_1x_h100 spot, running): stdout.log, as of its "
                        "last checkpoint sync\n")
    assert job.logs("--attempt", "1", "--stderr").stdout == "a warning\n"
    assert job.logs("--supervisor").stdout == "attempt 2: starting\n"
    ended = job.logs("--attempt", "1")
    assert ended.stdout == "training from step 0 to 300\nstep 100\n" and "as of" not in ended.stderr
    shown = job.cli("--state-dir", str(job.state), "show", job.id).stdout
    assert f"logs: burstctl logs {job.id} (2 attempts, in {job.state / 'runs'}/{job.id}-a<N>/)" in shown
    missing = job.logs("--setup")
    assert missing.returncode == 0 and missing.stdout == "" and "(no setup.log for this attempt yet)" in missing.stderr
    assert job.logs("--stderr", "--stderr").stdout == ""  # the same log twice is still one


def test_two_logs_at_once_are_refused_not_one_dropped(job: Job) -> None:
    job.attempt(1, "running", stdout=b"step 1\n", stderr=b"a warning\n")
    r = job.logs("--stderr", "--setup")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("burstctl: error: --stderr and --setup name 2 logs: expected one of --stdout, --stderr, "
                        "--setup or --supervisor\n")


@pytest.mark.parametrize(("text", "lines", "expected"), [
    (b"a\nb\nc\n", 2, b"b\nc\n"),
    (b"a\nb\nc", 2, b"b\nc"),  # no final newline: the last line still counts as one
    (b"a\nb\nc\n", 5, b"a\nb\nc\n"),
    (b"a\nb\nc\n", 0, b""),
    (b"".join(b"line %06d\n" % i for i in range(20_000)), 3, b"line 019997\nline 019998\nline 019999\n"),  # > a block
])
def test_tail_prints_the_last_lines(job: Job, text: bytes, lines: int, expected: bytes) -> None:
    job.attempt(1, "succeeded", where="local", stdout=text)
    r = job.logs("--tail", str(lines))
    assert r.returncode == 0 and r.stdout == expected.decode()


def test_follow_prints_what_the_log_gains_until_its_attempt_is_over(job: Job) -> None:
    run = job.attempt(1, "running", where="local", stdout=b"step 1\n")
    follow = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "--state-dir", str(job.state), "logs",
                               job.id, "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert follow.stdout is not None
    assert follow.stdout.readline() == b"step 1\n"
    with open(run / "stdout.log", "ab") as out:
        out.write(b"step 2\n")
    assert follow.stdout.readline() == b"step 2\n"
    with open(run / "stdout.log", "ab") as out:
        out.write(b"done\n")
    with job.app.store.tx() as c:
        c.execute(update(s.attempts).where(s.attempts.c.id == f"{job.id}-a1").values(state="succeeded"))
    rest, _ = follow.communicate(timeout=30)
    assert follow.returncode == 0 and rest == b"done\n"


def test_a_job_that_has_not_run_or_an_attempt_it_has_not_made_is_one_line(job: Job) -> None:
    never = job.logs()
    assert never.returncode == 1 and never.stderr.strip().splitlines() == [
        f"burstctl: error: job {job.id} (queued) has not run yet: no logs (`--follow` waits for its first attempt)"]
    job.attempt(1, "succeeded")
    wrong = job.logs("--attempt", "3")
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines() == [
        f"burstctl: error: field '--attempt': job {job.id} has no attempt 3 that ran (attempts that ran: 1)"]


def test_follow_on_a_job_that_has_not_started_waits_for_its_first_attempt(job: Job) -> None:
    # `enqueue` then `logs -f` is what one types: it had failed, "has not run yet: no logs".
    follow = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "--state-dir", str(job.state), "logs",
                               job.id, "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert follow.stderr is not None and follow.stdout is not None
    assert follow.stderr.readline().decode().endswith("is queued: waiting for its first attempt to start\n")
    run = job.attempt(1, "running", where="local", stdout=b"step 1\n")
    assert follow.stdout.readline() == b"step 1\n"
    with job.app.store.tx() as c:
        c.execute(update(s.attempts).where(s.attempts.c.id == f"{job.id}-a1").values(state="succeeded"))
    follow.communicate(timeout=30)
    assert follow.returncode == 0 and run.is_dir()


def test_follow_on_a_job_cancelled_before_it_ran_ends_saying_so(job: Job) -> None:
    follow = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "--state-dir", str(job.state), "logs",
                               job.id, "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert follow.stderr is not None
    follow.stderr.readline()
    job.app.store.update_job(job.id, state="cancelled")
    _, err = follow.communicate(timeout=30)
    assert follow.returncode == 1 and f"job {job.id} ended cancelled without running: no logs" in err
