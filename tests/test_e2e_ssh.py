"""`burstctl ssh`: a shell, or one command, on the instance a job's cloud attempt runs on, over real SSH to a
simcloud instance with the daemon's key and the instance's pinned host key; a job with no instance up says why."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orchestrator.app import App
from orchestrator.lifecycle import machine
from state import schema as s
from tests.e2e import Daemon, cli, enqueue, events, simcloud, trainer_job, wait_for, write_config


def test_a_job_running_locally_or_whose_instance_is_not_up_says_why_in_one_line(burstctl_here, tmp_path: Path) -> None:
    app = App(state_dir_override=str(tmp_path / "state"))
    for job_id, where in (("jlocal", "local"), ("jcloud", "cloud")):
        app.store.insert_job({"id": job_id, "name": job_id, "kind": "train", "state": "running", "verdict": "burst",
                              "placement": where, "spec": {"workdir": "/home/me/work"}, "decision": {},
                              "deadline_at": time.time() + 3600})
        with app.store.tx() as conn:
            machine.create(conn, job_id, where=where, provider="sim" if where == "cloud" else "local",
                           instance_type="gpu_1x_h100", market=None, info={}, created_at=time.time())
    # A job whose successor bootstraps beside the attempt running it (make before break on a spot notice).
    app.store.insert_job({"id": "jboth", "name": "jboth", "kind": "train", "state": "running", "verdict": "burst",
                          "placement": "cloud", "spec": {"workdir": "/w"}, "decision": {},
                          "deadline_at": time.time() + 3600})
    for state_ in ("running", "bootstrapping"):
        with app.store.tx() as conn:
            att = machine.create(conn, "jboth", where="cloud", provider="sim", instance_type="gpu_1x_h100",
                                 market="spot", info={"host": "127.0.0.1", "port": 9, "user": "u"},
                                 created_at=time.time())
            conn.execute(s.attempts.update().where(s.attempts.c.id == att["id"]).values(
                state=state_, instance_id=f"i-{state_}"))
    app.close()
    state = ("--state-dir", str(tmp_path / "state"))
    r = burstctl_here(*state, "ssh", "jboth", "--", "true")  # no host key recorded for it here: refused
    assert r.returncode == 1 and "attempt 1 on sim gpu_1x_h100 (spot), instance i-running" in r.stderr, r.stderr
    assert "no host key pinned or recorded yet" in r.stderr
    # Its env file is written by the bootstrap that starts the job: before that, --job-env says so.
    r = burstctl_here(*state, "ssh", "jboth", "--job-env", "--", "true")
    assert r.returncode == 1 and r.stderr.strip().endswith(
        "job jboth's attempt 1 is running: its env file is written once the bootstrap has started the job; try "
        "--job-env again then"), r.stderr
    r = burstctl_here(*state, "ssh", "jlocal")
    assert (r.returncode, r.stderr.strip()) == (1, "burstctl: error: job jlocal runs locally (attempt 1, intent): no "
                                                   "instance to log in to; its workdir is /home/me/work")
    r = burstctl_here(*state, "ssh", "jcloud", "--", "nvidia-smi")
    assert r.returncode == 1 and r.stderr.strip() == (
        "burstctl: error: job jcloud's attempt 1 on sim is intent: its instance cannot be logged in to yet; try "
        "again once it is bootstrapping or running")


@pytest.mark.slow
def test_a_command_runs_in_the_job_s_workdir_on_its_instance_and_exits_with_its_status(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        spec = trainer_job(tmp_path, "sshed", steps=3000, every=100, step_s=0.05)
        spec.write_text(spec.read_text() + '[env]\nGREETING = "hello $USER, it\'s me"\n')
        job_id = enqueue(config, state, spec)
        r = cli(config, state, "ssh", job_id, "--", "true")
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip() == f"burstctl: error: job {job_id} (queued) has no cloud instance up"
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: events(state, "attempt.running"), 120, "the job to run on an instance")
            # In the job's workdir there (the trainer the daemon pushed), with the command's own exit status.
            r = cli(config, state, "ssh", job_id, "--", "sh", "-c", "ls trainer.py; exit 7")
            assert (r.returncode, r.stdout) == (7, "trainer.py\n"), r.stderr
            instance = events(state, "attempt.running")[-1]["data"]["instance"]
            assert f"sshed ({job_id}), attempt 1 on sim" in r.stderr and instance in r.stderr
            # Each argument arrives as it was given: spaces, quotes and $ are not the remote shell's to read.
            r = cli(config, state, "ssh", job_id, "--", "printf", "%s|", "a b", "it's", "$HOME")
            assert (r.returncode, r.stdout) == (0, "a b|it's|$HOME|"), r.stderr
            # One word with spaces is a command line, as ssh runs it: by a shell.
            r = cli(config, state, "ssh", job_id, "--", "ls trainer.py; exit 6")
            assert (r.returncode, r.stdout) == (6, "trainer.py\n"), r.stderr
            # By its name, as every command that names a job.
            assert cli(config, state, "ssh", "sshed", "--", "true").returncode == 0
            # The job's env only when asked (before or after JOB), as given; the run's contract variables never.
            show = ["--", "sh", "-c", 'printf "%s|%s|%s" "${GREETING-unset}" "$BURST_WORK_UNITS" '
                                      '"${BURST_CHECKPOINT_DIR-unset}"; exit 5']
            r = cli(config, state, "ssh", job_id, *show)
            assert (r.returncode, r.stdout) == (5, "unset||unset"), r.stderr
            for args in (("--job-env", job_id), (job_id, "--job-env")):
                r = cli(config, state, "ssh", *args, *show)
                assert (r.returncode, r.stdout) == (5, "hello $USER, it's me|1.0|unset"), r.stderr
            r = cli(config, state, "ssh", job_id, "--job-env", "--", "no-such-program")
            assert r.returncode == 127 and "no-such-program" in r.stderr, r.stderr
        finally:
            cli(config, state, "cancel", job_id)
            wait_for(lambda: events(state, "instance.terminated"), 60, "the cancelled job's instance to be gone")
            assert daemon.stop() == 0
        r = cli(config, state, "ssh", job_id)
        assert r.returncode == 1 and "has no cloud instance up" in r.stderr, r.stderr
