"""Local attempts: the job's command under the same supervisor and checkpoint contract as in the cloud, as a
detached process on this machine, so a daemon restart adopts it instead of losing it.

Layout: <state>/runs/<attempt>/ (supervisor pid, heartbeat, exit.json, stdout.log, stderr.log, metrics.json);
checkpoints go straight into the local store <state>/checkpoints/<job>/.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import func, insert, select, update

from orchestrator.app import App
from orchestrator.lifecycle import checkpoints, passenv
from orchestrator.lifecycle.finish import job_after_attempt
from orchestrator.lifecycle.machine import AttemptState, move
from orchestrator.lifecycle.states import JobState
from runbooks import supervisor
from state import schema as s

A = AttemptState
RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
SUPERVISOR = RUNBOOKS / "supervisor.py"


def supervisor_status(run_dir: Path) -> dict[str, Any]:
    """The supervisor's own view (heartbeat, exit record, liveness, metrics)."""
    return supervisor.read_status(run_dir)


def write_env_file(path: Path, env: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        for k, v in env.items():
            fh.write(f"{k}={v}\n")


# The supervisor's exit reason "terminated" when burstctl did not ask for the stop: a shutdown of the machine, or
# someone's kill. The trainer was asked for a last checkpoint, so this is a preemption: the job resumes. (A user
# who wants it over runs `burstctl cancel`.)
STOPPED_OUTSIDE = "stopped from outside burstctl (SIGTERM or SIGINT to its supervisor)"


class LocalRunner:
    def __init__(self, app: App):
        self.app = app
        self.cfg = app.config

    def run_dir(self, attempt_id: str) -> Path:
        return self.cfg.state_dir / "runs" / attempt_id

    # --- start ------------------------------------------------------------------------------------------------
    def start(self, job: dict[str, Any]) -> bool:
        now = time.time()
        with self.app.store.engine.connect() as c:
            n = int(c.execute(select(func.max(s.attempts.c.n)).where(s.attempts.c.job_id == job["id"])).scalar() or 0)
        attempt_id = f"{job['id']}-a{n + 1}"
        info: dict[str, Any] = {}
        if job["placement"] == "hybrid":
            plan = job["decision"].get("plan") or []
            local_h = plan[0]["hours"] if plan and plan[0]["where"] == "local" else 0.0
            info["switch_at"] = now + local_h * 3600.0
        with self.app.store.tx() as conn:
            conn.execute(insert(s.attempts).values(
                id=attempt_id, job_id=job["id"], n=n + 1, where="local", state=A.INTENT.value, provider="local",
                instance_type="local", market=None, idempotency_key=None, info=info, created_at=now))
            if not self.app.store.update_job(job["id"], conn, expect_state=job["state"], state=JobState.RUNNING.value,
                                             reason="running locally"):
                raise RuntimeError(f"job {job['id']} changed state while starting")
        att = {"id": attempt_id, "n": n + 1, "job_id": job["id"], "state": A.INTENT.value, "info": info,
               "where": "local",
               "started_at": None, "instance_id": None}
        self._spawn(att, job)
        return True

    def _spawn(self, att: dict[str, Any], job: dict[str, Any]) -> None:
        """Start the supervisor (idempotent on its side), then mark the attempt running."""
        spec = job["spec"]
        run = self.run_dir(att["id"])
        run.mkdir(parents=True, exist_ok=True)
        ckpt = checkpoints.store_dir(self.cfg, job["id"])
        ckpt.mkdir(parents=True, exist_ok=True)
        resume = checkpoints.latest(self.cfg, job["id"])
        problem = passenv.unusable(spec)
        if problem:
            # The daemon was restarted without them: back to the queue, where the job waits saying which.
            self._end(att, job, A.ABORTED, problem, dict(att["info"]))
            return
        # pass_env's values go to the supervisor through its own environment, never into a file under <state>.
        passed = passenv.values(spec, self.app.redactor)
        env_file = run / "job.env"
        write_env_file(env_file, {**spec.get("env", {}), "PYTHONPATH": str(RUNBOOKS)})
        argv = [sys.executable, str(SUPERVISOR), "--run-dir", str(run), "--job-id", job["id"],
                "--attempt", str(att["n"]), "--checkpoint-dir", str(ckpt), "--workdir", spec["workdir"],
                "--env-file", str(env_file),
                "--daemonize"]
        if resume is not None:
            argv += ["--resume-from", str(resume)]
        if spec.get("max_run_hours"):
            argv += ["--max-run-s", str(float(spec["max_run_hours"]) * 3600)]
        if spec.get("torchrun"):
            argv += ["--gpus", "1", "--torchrun"]  # the one local GPU; the script still runs under torchrun
        argv += ["--", *spec["command"]]
        # The trainer gets the daemon's environment but not the cloud providers' API keys, which are burstctl's
        # (a job that needs one names it in pass_env).
        keys = {self.cfg.providers.sim.api_key_env, self.cfg.providers.lambda_.api_key_env}
        env = {k: v for k, v in os.environ.items() if k not in keys}
        subprocess.run(argv, check=True, timeout=60, stdin=subprocess.DEVNULL, capture_output=True,
                       env={**env, **passed})
        now = time.time()
        with self.app.store.tx() as conn:
            if move(conn, att, A.RUNNING, started_at=now, info={**att["info"], "resume_from": resume.name if resume
                                                                 else None}):
                self.app.events.emit("attempt.running", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                     where="local", run_dir=str(run))
                if resume is not None:
                    self.app.events.emit("job.resumed", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                         where="local", checkpoint=resume.name)

    # --- one step -----------------------------------------------------------------------------------------------
    def step(self, att: dict[str, Any], job: dict[str, Any]) -> None:
        if att["state"] == A.INTENT.value:
            self._spawn(att, job)
            return
        run = self.run_dir(att["id"])
        st = supervisor_status(run)
        info = dict(att["info"])
        if st.get("metrics"):
            info["metrics"] = st["metrics"]
        ex = st.get("exit")
        now = time.time()
        if ex is None:
            if not st.get("supervisor_alive"):
                self._end(att, job, A.PREEMPTED, "local supervisor died", info)
                return
            wanted = None
            if job["state"] == JobState.CANCELLED.value:
                wanted = "cancelled"
            elif info.get("switch_at") and now >= info["switch_at"]:
                wanted = "hybrid-switch"
            if wanted and not info.get("stop_requested"):
                supervisor.stop(run, grace_s=30.0)  # SIGTERM: the trainer writes a last checkpoint
                info["stop_requested"] = now
                info["stop_reason"] = wanted
                self.app.events.emit("attempt.stop_requested", job_id=job["id"], attempt_id=att["id"], reason=wanted)
            with self.app.store.tx() as conn:
                conn.execute(update(s.attempts).where(s.attempts.c.id == att["id"]).values(info=info))
            return
        reason = ex.get("reason")
        if reason == "completed" and ex.get("exit_code") == 0:
            self._end(att, job, A.SUCCEEDED, "completed", info)
        elif info.get("stop_reason") == "hybrid-switch":
            self._end(att, job, A.PREEMPTED, "hybrid-switch", info)
        elif info.get("stop_reason") == "cancelled":
            self._end(att, job, A.ABORTED, "cancelled", info)
        elif reason == "terminated":
            self._end(att, job, A.PREEMPTED, STOPPED_OUTSIDE, info)
        else:
            self._end(att, job, A.FAILED, f"exited: {reason} (code {ex.get('exit_code')})", info)

    def _end(self, att: dict[str, Any], job: dict[str, Any], outcome: AttemptState, reason: str,
             info: dict[str, Any]) -> None:
        now = time.time()
        info = {**info, "stop_reason": info.get("stop_reason") or reason}
        with self.app.store.tx() as conn:
            if move(conn, att, outcome, info=info, reason=reason, ended_at=now):
                self.app.events.emit("attempt.ended", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                     where="local", outcome=outcome.value, reason=reason)
                job_after_attempt(self.app, conn, att, job, outcome, reason, now)
