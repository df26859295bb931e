"""Local attempts: the job's command under the same supervisor and checkpoint contract as in the cloud, as a
detached process on this machine, so a daemon restart adopts it instead of losing it.

Layout: <state>/runs/<attempt>/ (supervisor pid, heartbeat, exit.json, stdout.log, stderr.log, metrics.json);
checkpoints go straight into the local store <state>/checkpoints/<job>/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select

from orchestrator import records
from orchestrator.app import App
from orchestrator.core.budget import unpaid_hand_over
from orchestrator.core.plan import latest_switch_at
from orchestrator.core.replan import replan_late_local
from orchestrator.jobspec import CheckpointSpec
from orchestrator.lifecycle import checkpoints, passenv
from orchestrator.lifecycle.finish import LOCAL_HOURS_OVER, exit_reason, job_after_attempt
from orchestrator.lifecycle.homes import attempt_run_dir, job_outputs_dir
from orchestrator.lifecycle.machine import AttemptState, chaos_point, move
from orchestrator.lifecycle.machine import create as create_attempt
from orchestrator.lifecycle.schedule import behind, reported, watch_schedule
from orchestrator.lifecycle.states import JobState
from orchestrator.queue import (
    context,
    facts,
    local_hours,
    local_time,
    measured_rented_throughput,
    record_decision,
    setup_estimate,
    spec_of,
)
from runbooks import job_outputs, supervisor
from state import schema as s
from state.schema import planned_launch_usd

A = AttemptState
RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
SUPERVISOR = RUNBOOKS / "supervisor.py"
# What the daemon waits for a stopped run's end beyond the job's grace (checkpoint.stop_grace_s, the supervisor's
# SIGTERM → SIGKILL): the SIGKILL and the exit record on this machine; on an instance also the status polls over SSH,
# a tick apart. With the default grace of 30 s: 40 s and 60 s.
LOCAL_STOP_MARGIN_S = 10.0
CLOUD_STOP_MARGIN_S = 30.0
# A trainer whose supervisor is gone is signalled, and waited for, by the daemon itself, inside its tick: held
# that long at most, whatever the job's grace, so that no other job's step waits an hour behind it. (A live
# supervisor applies the job's whole grace on its own: the usual case.)
IN_TICK_STOP_MAX_S = 30.0


def supervisor_status(run_dir: Path) -> dict[str, Any]:
    """The supervisor's own view (heartbeat, exit record, liveness, metrics)."""
    return supervisor.read_status(run_dir)


def _switch_args(terms: dict[str, Any]) -> dict[str, float]:
    return {k: terms[k] for k in ("deadline_at", "work", "rented_units_h", "overhead_h", "margin_h")}


def work_units_env(spec: dict[str, Any]) -> dict[str, str]:
    """The job's W for its trainer, so that `units_done` and `throughput_units_h` come back in the job's units."""
    return {"BURST_WORK_UNITS": repr(float(spec.get("work_units", 1.0)))}


def stop_grace_s(spec: Mapping[str, Any]) -> float:
    """The job's checkpoint.stop_grace_s, from its stored spec (a dict): the default for a job queued before the
    field existed, whose spec has none."""
    default: float = CheckpointSpec.model_fields["stop_grace_s"].default
    return float((spec.get("checkpoint") or {}).get("stop_grace_s", default))


def stop_wait_s(spec: Mapping[str, Any], margin_s: float = CLOUD_STOP_MARGIN_S) -> float:
    """How long the daemon waits for a run it stopped to end: the job's grace and a margin."""
    return stop_grace_s(spec) + margin_s


def write_env_file(path: Path, env: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        for k, v in env.items():
            fh.write(f"{k}={v}\n")


# The supervisor's exit reason "terminated" when burstctl did not ask for the stop: a shutdown of the machine, or
# someone's kill. The trainer was asked for a last checkpoint, so this is a preemption: the job resumes. (A user
# who wants it over runs `burstctl cancel`.)
SUPERVISOR_DIED = "local supervisor died"
# A local run whose supervisor dies this soon after its start, this many times in a row, fails: it cannot start.
SUPERVISOR_EARLY_S = 60.0
SUPERVISOR_DEATHS_MAX = 3
STOPPED_OUTSIDE = "stopped from outside burstctl (SIGTERM or SIGINT to its supervisor)"


class LocalRunner:
    def __init__(self, app: App, hand_over_held: Callable[[dict[str, Any], float], str | None] | None = None):
        self.app = app
        self.cfg = app.config
        # Why a hybrid plan's local phase cannot hand over now (no cloud can take the rest), else None: the
        # reconciler's look at the clouds. Holding keeps the local GPU working instead of stopping it for a burst
        # that would be refused.
        self.hand_over_held = hand_over_held

    def run_dir(self, attempt_id: str) -> Path:
        return attempt_run_dir(self.cfg, attempt_id)

    # --- start ------------------------------------------------------------------------------------------------
    def start(self, job: dict[str, Any]) -> bool:
        now = time.time()
        info: dict[str, Any] = {}
        if job["placement"] == "hybrid":
            terms = self._hybrid_terms(job)
            info["hybrid"] = terms
            info["units_done"] = terms["done_at_start"]
            info["switch_at"] = latest_switch_at(done=terms["done_at_start"], **_switch_args(terms))
            if self._hand_over_if_due(job, terms, info["switch_at"], now):
                return False
        with self.app.store.tx() as conn:
            att = create_attempt(conn, job["id"], where="local", provider="local", instance_type="local", market=None,
                                 info=info, created_at=now)
            if not self.app.store.update_job(job["id"], conn, expect_state=job["state"], state=JobState.RUNNING.value,
                                             reason="running locally"):
                raise RuntimeError(f"job {job['id']} changed state while starting")
        self._spawn(att, job)
        return True

    def _hybrid_terms(self, job: dict[str, Any]) -> dict[str, Any]:
        """What a hybrid plan's hand-over is recomputed from: the deadline, W, the planned speeds, t_ovh and the
        margin, and the work done by this job's earlier local attempts (a local run that died, or a restart)."""
        d = job["decision"]
        plan = d.get("plan") or []
        local: dict[str, Any] = next((p for p in plan if p["where"] == "local"), {})
        cloud: dict[str, Any] = next((p for p in plan if p["where"] == "cloud"), {})
        overhead_h = float(d.get("overhead_h") or 0.0)
        work = float(job["spec"].get("work_units", 1.0))
        # Plans made before the phases carried their speed: the cloud phase's work over its hours less t_ovh.
        rented = cloud.get("units_h") or float(cloud.get("work_units") or work) / max(
            float(cloud.get("hours") or 0.0) - overhead_h, 1e-9)
        local_units_h = local.get("units_h") or float(local.get("work_units") or 0.0) / max(
            float(local.get("hours") or 0.0), 1e-9)
        with self.app.store.engine.connect() as c:
            earlier = [r[0] for r in c.execute(select(s.attempts.c.info).where(
                s.attempts.c.job_id == job["id"], s.attempts.c.where == "local"))]
        done = max([float((i or {}).get("units_done") or 0.0) for i in earlier] + [0.0])
        return {"deadline_at": float(job["deadline_at"]), "work": work, "rented_units_h": float(rented),
                "local_units_h": float(local_units_h), "overhead_h": overhead_h,
                "margin_h": float(self.cfg.policy.hybrid_margin_h), "done_at_start": min(done, work)}

    def hand_over_if_due(self, job: dict[str, Any], now: float) -> bool:
        """For a hybrid job that cannot start locally now (the GPU busy, or outside its hours): True when its
        hand-over is due and it now waits for the cloud instead. Waiting on for the GPU would cost the deadline."""
        terms = self._hybrid_terms(job)
        switch_at = latest_switch_at(done=terms["done_at_start"], **_switch_args(terms))
        hours = local_hours(self.cfg, now)
        opens_h = None if hours.is_open() else hours.until_change_h()
        if opens_h is not None and now + opens_h * 3600.0 >= switch_at > now:
            # Outside the GPU's hours until after its hand-over: waiting trains nothing, and bursting now costs the
            # same and leaves the cloud phase the slack (a spot run can wait out more of an outage).
            return self._hand_over_if_due(job, terms, now, now, why=(
                f"the local GPU's hours (local.available_hours) do not begin again before its hand-over at "
                f"{local_time(self.cfg, switch_at):%H:%M}: nothing more to train locally, so it bursts now"))
        return self._hand_over_if_due(job, terms, switch_at, now)

    def _hand_over_if_due(self, job: dict[str, Any], terms: dict[str, Any], switch_at: float, now: float,
                          why: str | None = None) -> bool:
        if switch_at > now or (self.hand_over_held is not None and self.hand_over_held(job, now) is not None):
            return False
        # The job waited (behind another local job, outside the local GPU's hours, or after a restart): the rest no
        # longer fits after a local phase, so it bursts at once (unless no cloud can take it: then it runs locally
        # when it can, and `step` hands over when a cloud can).
        self._hand_over_now(job, terms, why)
        return True

    def _hand_over_now(self, job: dict[str, Any], terms: dict[str, Any], why: str | None = None) -> None:
        why = why or (f"no time left for a local phase: {terms['work'] - terms['done_at_start']:.4g} of "
                      f"{terms['work']:.4g} units left need the cloud now to make the deadline")
        with self.app.store.tx() as conn:
            if self.app.store.update_job(job["id"], conn, expect_state=job["state"], placement="cloud", reason=why):
                self.app.events.emit("job.switching", job_id=job["id"], conn=conn, reason=why,
                                     units_done=round(terms["done_at_start"], 6))
                job["placement"] = "cloud"  # the scheduler's copy: it may start the cloud attempt this tick

    def _spawn(self, att: dict[str, Any], job: dict[str, Any]) -> None:
        """Start the supervisor (idempotent on its side), then mark the attempt running."""
        spec = job["spec"]
        run = self.run_dir(att["id"])
        run.mkdir(parents=True, exist_ok=True)
        ckpt = checkpoints.store_dir(self.cfg, job["id"])
        ckpt.mkdir(parents=True, exist_ok=True)
        resume = checkpoints.resume_point(self.app, job["id"])
        problem = passenv.unusable(spec)
        if problem:
            # The daemon was restarted without them: back to the queue, where the job waits saying which.
            self._end(att, job, A.ABORTED, problem, dict(att["info"]))
            return
        # pass_env's values go to the supervisor through its own environment, never into a file under <state>.
        passed = passenv.values(spec, self.app.redactor)
        env_file = run / "job.env"
        write_env_file(env_file, {**spec.get("env", {}), **work_units_env(spec), "PYTHONPATH": str(RUNBOOKS)})
        argv = [sys.executable, str(SUPERVISOR), "--run-dir", str(run), "--job-id", job["id"],
                "--attempt", str(att["n"]), "--checkpoint-dir", str(ckpt), "--workdir", spec["workdir"],
                "--env-file", str(env_file), *passenv.secret_args(spec), "--grace-s", repr(stop_grace_s(spec)),
                "--daemonize"]
        if resume is not None:
            argv += ["--resume-from", str(resume)]
        if spec.get("max_run_hours"):
            argv += ["--max-run-s", str(float(spec["max_run_hours"]) * 3600)]
        if spec.get("torchrun"):
            argv += ["--gpus", "1", "--torchrun"]  # the one local GPU; the script still runs under torchrun
        argv += ["--", *spec["command"]]
        # The trainer gets the daemon's environment but not the secrets burstctl holds for itself: the providers'
        # API keys, AWS's secret key, the database password, the notifiers' (a job that needs one names it in
        # pass_env).
        keys = set(self.cfg.secret_env_names())
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

    def end_trainer(self, att: dict[str, Any], wait_s: float | None = None) -> bool:
        """End a local attempt's trainer before the attempt is given up: SIGTERM through its supervisor (a last
        checkpoint, SIGKILL after the job's grace), waiting up to `wait_s` (by default the grace and
        LOCAL_STOP_MARGIN_S) for the supervisor to go. A given-up attempt never leaves its trainer running, holding
        the GPU and writing into the checkpoint dir the job's next attempt starts from. True when nothing of it runs
        any more."""
        run = self.run_dir(att["id"])
        spec = (self.app.store.get_job(att["job_id"]) or {}).get("spec") or {}
        # Without its supervisor, the trainer is signalled here, and killed after the grace (held in the tick).
        supervisor.stop(run, grace_s=min(stop_grace_s(spec), IN_TICK_STOP_MAX_S))  # nothing to do if nothing runs
        # Waited for in the tick too: a longer grace is given up on here and looked at again at the next try.
        wait = min(stop_wait_s(spec, LOCAL_STOP_MARGIN_S), IN_TICK_STOP_MAX_S + LOCAL_STOP_MARGIN_S)
        deadline = time.monotonic() + (wait if wait_s is None else wait_s)
        while supervisor.read_status(run).get("supervisor_alive") and time.monotonic() < deadline:
            time.sleep(0.2)
        return not supervisor.read_status(run).get("supervisor_alive")

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
                if st.get("child_alive") and not self.end_trainer(att):
                    # Its trainer runs on without it: ended first (a last checkpoint in its grace), else the next
                    # attempt's trainer would share the GPU and the checkpoint directory with it.
                    return
                self._outputs_home(att, job, info, finished=False)
                if (deaths := self._deaths_at_start(att, now)) >= SUPERVISOR_DEATHS_MAX:
                    said = supervisor.last_line(run / supervisor.SUPERVISOR_LOG) or "its supervisor.log says nothing"
                    self._end(att, job, A.FAILED, f"{SUPERVISOR_DIED} {deaths} times in a row within "
                              f"{SUPERVISOR_EARLY_S:.0f} s of its start: {said}", info)
                else:
                    self._end(att, job, A.PREEMPTED, SUPERVISOR_DIED, info)
                return
            wanted = None
            progress: dict[str, Any] = {}
            if not info.get("hybrid") and job["placement"] == "local":
                watch_schedule(self.app, att, job, info, now)
                self._redecide_if_late(att, job, info, now)  # may make it a hybrid's local phase, or hand over
            if info.get("hybrid") and not info.get("stop_requested"):
                progress = self._replan(att, job, info, now)  # a hybrid hands over earlier instead
            if job["state"] == JobState.CANCELLED.value:
                wanted = "cancelled"
            elif not local_hours(self.cfg, now).is_open() and job["spec"]["checkpoint"].get("resumable", True):
                # The GPU's hours are over (local.available_hours): a last checkpoint, and the job waits for them
                # to begin again. A job that cannot resume runs on: stopping it would throw its work away.
                wanted = LOCAL_HOURS_OVER
            elif info.get("switch_at") and now >= info["switch_at"] and not info.get("stop_requested"):
                held = self.hand_over_held(job, now) if self.hand_over_held is not None else None
                if held is None:
                    wanted = "hybrid-switch"
                else:
                    progress["reason"] = self._hold(att, job, info, held)
            if wanted and not info.get("stop_requested"):
                # Why, written before the trainer is told: a daemon killed in between finds it on restart and asks
                # again (below), instead of taking the run's end for a stop from outside burstctl (a preemption).
                info["stop_requested"] = now
                info["stop_reason"] = wanted
                with self.app.store.tx() as conn:
                    self.app.store.set_attempt_info(att["id"], info, conn)
                    self.app.events.emit("attempt.stop_requested", job_id=job["id"], attempt_id=att["id"],
                                         conn=conn, reason=wanted,
                                         **({k: v for k, v in progress.items() if k != "reason"}
                                            if wanted == "hybrid-switch" else {}))
                chaos_point("local-stop-written")
            if info.get("stop_requested"):
                # SIGTERM: the trainer writes a last checkpoint, in the job's grace (its supervisor's --grace-s).
                # Each look until the run has ended: its supervisor acts on the first and ignores the others.
                supervisor.stop(run, grace_s=min(stop_grace_s(job["spec"]), IN_TICK_STOP_MAX_S))
                chaos_point("local-stop-signalled")
            with self.app.store.tx() as conn:
                self.app.store.set_attempt_info(att["id"], info, conn)
                if progress and not wanted and job["reason"] != progress["reason"]:
                    self.app.store.update_job(job["id"], conn, expect_state=JobState.RUNNING.value,
                                              reason=progress["reason"])
            return
        reason = ex.get("reason")
        succeeded = reason == "completed" and ex.get("exit_code") == 0
        # What this run wrote comes home however it ended: the next run (here, or on an instance) writes its own.
        self._outputs_home(att, job, info, finished=succeeded)
        # When the run ended, as its supervisor wrote it down: a daemon restarted after that sees it only now.
        ran_until = ex.get("ended_at") if isinstance(ex.get("ended_at"), int | float) else None
        if succeeded:
            self._end(att, job, A.SUCCEEDED, "completed", info, ran_until)
        elif info.get("stop_reason") in ("hybrid-switch", LOCAL_HOURS_OVER):
            self._end(att, job, A.PREEMPTED, info["stop_reason"], info, ran_until)
        elif info.get("stop_reason") == "cancelled":
            self._end(att, job, A.ABORTED, "cancelled", info, ran_until)
        elif reason == "terminated":
            self._end(att, job, A.PREEMPTED, STOPPED_OUTSIDE, info, ran_until)
        else:
            self._end(att, job, A.FAILED, exit_reason(self.app, job, ex), info, ran_until)

    def _outputs_home(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], *,
                      finished: bool = True) -> None:
        """The files its `outputs` name that a run here wrote (not an earlier run's left in the workdir), copied into
        <state>/outputs/<job>/, where a cloud run's come home: a job's results are in one place wherever it ran (a
        copy, not a link: the next run in the same workdir rewrites its files in place). However it ended, so that
        what it wrote is kept as a preempted instance's is (`job.outputs_home` only once it finished). A copy
        that fails (a full disk) is said, and the job goes on all the same: its files are still in the workdir."""
        patterns = job["spec"].get("outputs")
        if not patterns:
            return
        work, home = Path(job["spec"]["workdir"]), job_outputs_dir(self.cfg, job["id"])
        try:
            names = job_outputs.list_outputs(work, patterns, job_outputs.run_started_at(self.run_dir(att["id"])))
            for name in names:
                dest = home / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                part = dest.with_name(f".{dest.name}.part")
                shutil.copy2(work / name, part)
                os.replace(part, dest)
        except OSError as exc:
            self.app.events.emit("attempt.outputs_copy_failed", job_id=job["id"], attempt_id=att["id"],
                                 error=f"{type(exc).__name__}: {exc.strerror or exc}", workdir=str(work))
            return
        info["outputs"] = names
        if not finished:
            return  # said at the job's end (a notice mid-job would read as its end)
        # Against everything home, an earlier run's files too: a pattern one of them matched is not missing.
        missing = job_outputs.missing_from(home, patterns)
        self.app.events.emit("job.outputs_home", job_id=job["id"], attempt_id=att["id"], files=len(names),
                             dir=str(home), **({"missing": missing} if missing else {}))

    def _hold(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], why: str) -> str:
        """The hand-over is due but no cloud can take the rest: run on locally, say so (an event when it starts
        holding, or holds for another reason), and hand over as soon as the cloud can take it."""
        due = datetime.fromtimestamp(info["switch_at"], UTC).strftime("%H:%M:%S")
        if info.get("hand_over_held") != why:
            info["hand_over_held"] = why
            self.app.events.emit("attempt.hand_over_held", job_id=job["id"], attempt_id=att["id"], reason=why,
                                 switch_at=round(info["switch_at"], 3), units_done=info.get("units_done"))
        plan = "hybrid plan" if info.get("hybrid") else "re-planned to burst"
        return (f"running on locally ({plan}): the hand-over to the cloud was due at {due} UTC, but {why}; "
                "it bursts the rest once the cloud can take it, and may miss the deadline")

    def _replan(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], now: float) -> dict[str, Any]:
        """A hybrid plan's local phase: the hand-over moved to the latest instant that still makes the deadline
        from the work done so far, as the trainer reports it (`units_done` in its metrics, in the job's work
        units), else as the plan estimates it (s_L times the hours this attempt has run)."""
        terms = info["hybrid"]
        measured = reported(info.get("metrics"), "units_done")
        if measured is not None:
            done, basis = min(measured, terms["work"]), "measured"
        else:
            # Since done_at_start was counted: the attempt's start, or its re-plan into a hybrid (`_redecide_if_late`).
            ran_h = max(0.0, now - float(terms.get("replanned_at") or att.get("started_at") or now)) / 3600.0
            done, basis = min(terms["done_at_start"] + terms["local_units_h"] * ran_h, terms["work"]), "estimated"
        info["units_done"] = done
        info["switch_at"] = latest_switch_at(done=done, **_switch_args(terms))
        at = datetime.fromtimestamp(info["switch_at"], UTC).strftime("%H:%M:%S")
        plan = "hybrid plan, re-planned behind schedule" if terms.get("replanned_at") else "hybrid plan"
        unpaid = unpaid_hand_over(planned_launch_usd(job["decision"]), self.cfg.budget.monthly_cap_usd)
        then = unpaid or f"bursts the rest by {at} UTC to make the deadline"
        return {"units_done": round(done, 6), "progress": basis, "switch_at": round(info["switch_at"], 3),
                "reason": f"running locally ({plan}): {done:.4g} of {terms['work']:.4g} units done ({basis}); "
                          f"{then}"}

    def _redecide_if_late(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], now: float) -> None:
        """A plain local run whose trainer's figures put its end past the deadline is decided again, on the work left
        and the speed measured (`core/replan.py`): a hybrid makes this attempt the plan's local phase (the hand-over
        is then recomputed every tick by `_replan`), a burst hands over now (both through the hand-over hold), and
        otherwise it runs on, saying why. Asked again once a `daemon.market_check_s` while it stays late (the kill
        switch lifted, the budget, an approval may change the answer), at once when the job was approved since.
        What it answered is kept in the attempt (`info["redecided"]`), said once per answer."""
        if job["placement"] != "local" or info.get("hybrid") or info.get("stop_requested") or \
                job["state"] != JobState.RUNNING.value:
            return  # not a plain local run (any more), or on its way out
        late = behind(job, "local", info.get("metrics"), now)
        if late is None:
            return
        done, speed, _, behind_why = late
        last = info.get("redecided") or {}
        approved_since = last.get("outcome") == "await-approval" and bool(job.get("approved"))
        if last and 0 <= now - float(last["at"]) < self.cfg.daemon.market_check_s and not approved_since:
            return
        if checkpoints.latest(self.cfg, job["id"], deep=False) is None:
            done = 0.0  # nothing to resume from yet: the cloud would start over
        spec = spec_of(job)
        base = facts(spec, float(job["deadline_at"]), now, self.cfg,
                     measured=measured_rented_throughput(self.app, spec), setup=setup_estimate(self.app, spec))
        r = replan_late_local(base, context(self.app, now, exclude=job["id"]), done=done, units_h=speed,
                              approved=bool(job.get("approved")))
        answer = {"at": now, "outcome": r.outcome}
        if last.get("outcome") == r.outcome:
            info["redecided"] = answer  # said already; asked again a market_check_s from now
            return
        fields: dict[str, Any] = {"reason": f"{behind_why}; {r.why}"}
        record: Path | None = None
        d: dict[str, Any] | None = None
        before = job["decision"]
        if r.decision is not None:
            d = records.supersede(before, r.decision.to_dict())
            d["work_done"] = round(done, 6)
            d["replanned_from"] = {k: before.get(k) for k in ("verdict", "action", "plan_kind", "plan_cost_usd",
                                                              "t_local_h", "t_rented_h")}
            d["reasons"].insert(0, f"re-planned while running locally, {behind_why}: decided again on the "
                                   f"units left at the speed measured (was: {before.get('plan_kind') or '—'} plan, "
                                   f"T_L {records.fmt_h(before.get('t_local_h'))}, "
                                   f"{records.fmt_usd(before.get('plan_cost_usd'))})")
            record = record_decision(self.app, r.facts, d, now, job["id"])
            fields.update(decision=d, verdict=d["verdict"], record_path=str(record))
        changed: dict[str, Any] = {"redecided": answer}  # this attempt's part in the new plan
        if r.moves:
            assert d is not None
            fields["placement"] = d["placement"]
            changed["units_done"] = done
            if r.outcome == "hybrid":
                terms = self._hybrid_terms({**job, "decision": d})
                terms.update(done_at_start=done, replanned_at=now)
                changed["hybrid"] = terms
                changed["switch_at"] = latest_switch_at(done=done, **_switch_args(terms))
            else:
                changed["switch_at"] = now  # no time for a local phase: the hand-over is due (`step` may hold it)
        written = False
        try:
            with self.app.store.tx() as conn:
                # The job's new plan and this attempt's part in it are one change: a restart finds both or neither.
                if self.app.store.update_job(job["id"], conn, expect_state=JobState.RUNNING.value, **fields):
                    self.app.store.set_attempt_info(att["id"], {**info, **changed}, conn)
                    self.app.events.emit(
                        "job.replanned", job_id=job["id"], attempt_id=att["id"], conn=conn, outcome=r.outcome,
                        reason=fields["reason"], units_done=round(done, 6), throughput_units_h=round(speed, 6),
                        planned_units_h=float(job["spec"].get("local_throughput") or 0.0),
                        before={k: before.get(k) for k in ("verdict", "plan_kind", "plan_cost_usd", "t_local_h")},
                        after=None if d is None else {k: d.get(k) for k in (
                            "verdict", "action", "placement", "plan_kind", "plan_cost_usd", "t_rented_h")},
                        switch_at=round(changed["switch_at"], 3) if r.moves else None,
                        record=str(record) if record else None, decision=d)
                    written = True
        finally:
            if not written and record is not None:
                record.unlink(missing_ok=True)  # the re-plan was never written: no record may describe it
        if not written:  # the job moved on meanwhile (a cancel): nothing was re-planned
            return
        info.update(changed)
        if record is not None:
            records.superseded(job.get("record_path"), record, "re-planned while running locally", now)
        job.update(fields)

    def _deaths_at_start(self, att: dict[str, Any], now: float) -> int:
        """How many of the job's local attempts in a row, this one included, lost their supervisor within
        SUPERVISOR_EARLY_S of their start: a run that cannot start (a machine without room for another process,
        an environment no process takes), which resuming again at once would only repeat, every tick."""
        def early(a: Any, ended: float) -> bool:
            return ended - float(a["started_at"] or a["created_at"]) < SUPERVISOR_EARLY_S

        if not early(att, now):
            return 0
        with self.app.store.engine.connect() as c:
            before = c.execute(select(s.attempts).where(s.attempts.c.job_id == att["job_id"],
                                                        s.attempts.c.where == "local", s.attempts.c.n < att["n"])
                               .order_by(s.attempts.c.n.desc()).limit(SUPERVISOR_DEATHS_MAX - 1)).mappings().all()
        deaths = 1
        for a in before:
            if a["reason"] != SUPERVISOR_DIED or a["ended_at"] is None or not early(a, a["ended_at"]):
                break
            deaths += 1
        return deaths

    def _end(self, att: dict[str, Any], job: dict[str, Any], outcome: AttemptState, reason: str,
             info: dict[str, Any], ran_until: float | None = None) -> None:
        """End the attempt; `ran_until`, when its run ended as its supervisor recorded it (measured from then, not
        from when this daemon saw it)."""
        now = time.time()
        started = float(att.get("started_at") or att.get("created_at") or 0.0)
        ended = now if ran_until is None else min(now, max(float(ran_until), started))
        info = {**info, "stop_reason": info.get("stop_reason") or reason}
        with self.app.store.tx() as conn:
            if move(conn, att, outcome, info=info, reason=reason, ended_at=ended):
                self.app.events.emit("attempt.ended", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                     where="local", outcome=outcome.value, reason=reason)
                job_after_attempt(self.app, conn, att, job, outcome, reason, now)
