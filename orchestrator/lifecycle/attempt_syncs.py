"""The syncs of cloud attempts: each running attempt's checkpoints, outputs and logs brought home on threads beside
the tick (`background_sync.BackgroundSyncs`), and what they did written down by the tick's thread.

A sync is started when due (`sync`; at once, on a thread of its own, after a spot notice), taken at the start of the
next tick (`collect`), or by the attempt's own step when it is the run's last (`final`); a step that must have the
newest checkpoint home now pulls it itself (`pull_now`), after the sync under way. A failed pull keeps the attempt
going and is tried again at the next sync (`pull_failed`); what a sync saved after its attempt's loss was counted
corrects the lost work, and the checkpoint said lost with the instance when it brings that one home. The reconciler
decides when; this does the syncing and its bookkeeping.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update

from orchestrator.app import App
from orchestrator.lifecycle import checkpoints
from orchestrator.lifecycle.background_sync import BackgroundSyncs, SyncDone
from orchestrator.lifecycle.homes import job_outputs_dir
from orchestrator.lifecycle.machine import AttemptState
from orchestrator.lifecycle.states import JobState
from orchestrator.remote.ssh import SharedConnection
from orchestrator.remote.sync import stop_transfers
from runbooks import burst_checkpoint, job_outputs
from runbooks.s3_checkpoints import S3Refused
from state import schema as s

if TYPE_CHECKING:
    from orchestrator.lifecycle.cloud_steps import CloudSteps

A = AttemptState
SYNC_FAILING = "checkpoints are not coming home (the instance is kept and the pull retried)"  # a job's reason
CLOSE_WAIT_S = 30.0  # how long a stopping daemon waits for the syncs under way (systemd's stop timeout is 60 s)

Measure = Callable[..., None]  # (conn, attempt, metric, value): a measurement of the attempt's instance type


class AttemptSyncs:
    """The reconciler's syncs: the pool of threads (`pool`) and the attempts whose last sync runs beside the tick."""

    def __init__(self, app: App, cloud_steps: Callable[[], CloudSteps], clock: Callable[[], float],
                 measure: Measure):
        self.app = app
        self.cfg = app.config
        self.store = app.store
        self.clock = clock
        self._cloud_steps = cloud_steps
        self._measure = measure
        self.pool: BackgroundSyncs[SyncDone] = BackgroundSyncs(self.cfg.daemon.sync_workers)
        # Attempts whose run has ended and whose last sync runs beside the tick (`final`): taken by their own step,
        # not by `collect`. In memory only: a restarted daemon starts each one again.
        self._final: dict[str, bool] = {}  # → whether it brings the outputs whatever came

    @property
    def cloud_steps(self) -> CloudSteps:
        return self._cloud_steps()

    def carry_over(self, before: AttemptSyncs) -> None:
        """Take over the syncs in flight of the reconciler this one replaces (a config reload)."""
        self._final = before._final
        if self.pool.workers == before.pool.workers:
            self.pool = before.pool
        else:
            self.pool.adopt(before.pool)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Once the ticks are over (the daemon stops, revert-local is done): wait for the syncs in flight and write
        down what they did, so that a checkpoint one brought home is the job's before the process exits. Not for
        longer than `wait_s` (a service manager kills a daemon slow to stop): a pull still under way then is cut
        short, and the next pull resumes it."""
        self.pool.wait_all(timeout_s=wait_s)
        self.collect()
        # The rsyncs still running are ended, not left to outlive the daemon (their threads then end too); what
        # they did is not written down: a failure made by stopping them is not one.
        stop_transfers()
        self.pool.close()

    def abandon(self) -> None:
        """Once the ticks are over and nothing may be written down (the daemon lost its database lock: another may
        own the state): the syncs still in line are dropped, and every transfer those under way run is ended until
        they have (a sync whose checkpoint pull is ended goes on to its outputs' and logs'), so that no rsync of
        this process writes on into the staging directories the next daemon's pulls use."""
        until = time.monotonic() + CLOSE_WAIT_S
        while not self.pool.wait_all(timeout_s=0.2) and time.monotonic() < until:
            stop_transfers()
        stop_transfers()
        self.pool.close()

    def forget_final(self, attempt_id: str) -> None:
        """The attempt's last sync is no longer awaited by its step (a stop gave way to a notice's syncs)."""
        self._final.pop(attempt_id, None)

    def sync(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], *,
                  urgent: bool = False) -> None:
        """Start a sync of the running attempt beside the tick, unless one is under way. `urgent` (after a notice):
        at once, on a thread of its own, not in line behind other attempts' syncs (`BackgroundSyncs.start`)."""
        if self.pool.free_for_urgent(att["id"]) if urgent else not self.pool.busy(att["id"]):
            snapshot = {**att, "info": dict(info)}
            self.pool.start(att["id"], lambda: self.beside(snapshot, job), urgent=urgent)

    def watch_s3_uploads(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any],
                          s3: dict[str, Any] | None, *, exited: bool) -> None:
        """An instance that cannot upload to S3 (twice in a row, or for its last checkpoint) sends this attempt's
        checkpoints home over SSH instead, said once."""
        if not s3 or not s3.get("error") or info.get("s3_unavailable"):
            return
        if exited or int(s3.get("failures", 0)) >= 2:
            info["s3_unavailable"] = self.app.redactor.clip(str(s3["error"]), 300)
            self.app.events.emit("checkpoint.s3_unavailable", job_id=job["id"], attempt_id=att["id"],
                      error=info["s3_unavailable"], fallback="ssh")

    def pull_now(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any],
              shared: SharedConnection | None = None) -> bool:
        """Bring the newest checkpoint home (and the outputs with a new one), now; False when the pull failed
        (nothing partial is visible). A sync of the attempt's under way beside the tick is waited for first, so that
        what it brings home is counted. `info` is the attempt's, persisted by the caller. `shared`: the sync's SSH
        connection, when it has one."""
        beside = self.pool.take(att["id"], wait=True)
        self._final.pop(att["id"], None)
        if beside is not None:  # its failure too is on record, though the pull that follows may well succeed
            self.write_down(att, job, info, beside)
        return self.write_down(att, job, info, self.transfers({**att, "info": info}, job, shared, logs=False))

    def final(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], *,
                    outputs: bool = True) -> bool:
        """The sync that follows a run's end or a stop's last checkpoint (its newest checkpoint, its logs, and its
        outputs: with `outputs` whatever is there, else with a new checkpoint), on a thread beside the tick like the
        periodic ones: a multi-GB final checkpoint then holds up no other attempt's heartbeat check, notice or stop.
        True once it has been done and written down (failed or not: the step after it retries what it must have);
        False while it, or a periodic sync started before, is under way."""
        if self.pool.free_for_urgent(att["id"]):
            self._final[att["id"]] = outputs
            snapshot = {**att, "info": dict(info)}
            self.pool.start(att["id"], lambda: self.beside(snapshot, job, outputs=outputs), urgent=True)
        done = self.pool.take(att["id"])
        if done is None:
            return False  # looked at again next tick
        self.write_down(att, job, info, done)
        if att["id"] in self._final:
            with_outputs = self._final.pop(att["id"])
            if outputs and not with_outputs:
                return self.final(att, job, info, outputs=True)  # a stop's, and the run ended well meanwhile
            if outputs and not done.pulled:  # with a new checkpoint `write_down` has taken them
                self._outputs_done(att, job, info, done.outputs)
            if outputs and isinstance(done.outputs, list):
                info["final_outputs"] = done.outputs  # the run's outputs as it ended (`outputs_home`)
            return True
        return self.final(att, job, info, outputs=outputs)  # a periodic one, from before: now the last one

    def take_finished(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any]) -> None:
        """A sync of the attempt's that brought a checkpoint home since this tick began, counted before its end (the
        work it saved is not lost work). One still under way is not waited for: the instance may be gone and its
        pull hanging (it is written down when it ends, `collect`); one that failed is not news at an end."""
        done = self.pool.take(att["id"])
        if done is not None:
            self._final.pop(att["id"], None)
        if done is not None and done.error is None:
            self.write_down(att, job, info, done)

    def beside(self, att: dict[str, Any], job: dict[str, Any], *, outputs: bool = False) -> SyncDone:
        """A sync on a thread of `syncs`: transfers only (the tick writes down what they did, `write_down`), on one SSH
        connection of its own for the checkpoint, the outputs and the logs. `outputs`: the run has ended, and its
        outputs come too whether or not a new checkpoint did."""
        try:
            with self.cloud_steps.shared_ssh(att) as shared:
                return self.transfers(att, job, shared, logs=True, outputs=outputs)
        except Exception as exc:  # opening or closing the connection: a failed pull, said as one
            return SyncDone(error=exc, at=self.clock())

    def transfers(self, att: dict[str, Any], job: dict[str, Any], shared: SharedConnection | None, *,
                 logs: bool, outputs: bool = False) -> SyncDone:
        """The transfers of a sync, and nothing else: the newest checkpoint, the outputs with a new one (or with
        `outputs`, whatever came), and with `logs` the logs. Failures are returned, not raised."""
        started = time.monotonic()
        refused: str | None = None
        try:
            try:
                new = self.cloud_steps.pull(att, job, shared)
            except S3Refused as exc:
                # S3 refuses this daemon's credentials (a key rotated, an SSO session expired mid-run), not the
                # instance's role: the instance still holds its checkpoints, so they come home over SSH meanwhile.
                refused = str(exc)
                new = self.cloud_steps.pull(att, job, shared, over_ssh=True)
        except Exception as exc:
            if shared is not None:
                shared.drop()
            if refused is not None:  # over SSH too (the instance gone): the refusal is what to mend
                exc = S3Refused(f"{refused}; over SSH instead: {type(exc).__name__}: {exc}")
            # The logs come home all the same: a checkpoint store that fails (S3, a full disk) is no reason to stop.
            return SyncDone(error=exc, at=self.clock(), logs=self._logs_io(att, job, shared) if logs else None,
                            s3_refused=refused)
        took = time.monotonic() - started
        at = self.clock()
        pulled_outputs = self._outputs_io(att, job, shared) if new or outputs else None
        return SyncDone(pulled=new, took_s=took, at=at, outputs=pulled_outputs,
                        logs=self._logs_io(att, job, shared) if logs else None, s3_refused=refused)

    def write_down(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], done: SyncDone) -> bool:
        """Write down what a sync did (`transfers`): its checkpoint home, or its failure; its outputs and logs.
        `info` is the attempt's, persisted by the caller. False when the checkpoint pull failed."""
        if done.logs is not None:
            self._logs_done(att, job, info, done.logs)
        self._s3_refusal(att, job, info, done)
        if done.error is not None:
            self.pull_failed(att, job, info, done.error)
            return False
        info["last_sync_at"] = done.at
        self._rejected(att, job, info, done)
        if info.pop("sync_error", None) is not None:
            info.pop("sync_failures", None)
            with self.store.tx() as conn:  # the job's reason as it was, unless something else set one since
                conn.execute(update(s.jobs).where(s.jobs.c.id == job["id"], s.jobs.c.reason.startswith(SYNC_FAILING))
                             .values(reason=info.pop("reason_before_sync_error", None), updated_at=time.time()))
        if done.pulled:
            info["last_checkpoint_at"] = _written_at(done.pulled[-1], done.at, att.get("started_at"))
            outputs = self._outputs_done(att, job, info, done.outputs)
            self._checkpoint_home(att, job, done, outputs, info)
        else:
            # Nothing new: the newest checkpoint home is the job's all the same. One that a sync brought home but
            # never wrote down (the daemon killed in between, or stopped while it was under way) is found here: a
            # pull does not bring a checkpoint home twice.
            newest = checkpoints.latest(self.cfg, job["id"], deep=False)
            if newest is not None and newest.name != job.get("checkpoint"):
                self.store.update_job(job["id"], checkpoint=newest.name)
        return True

    def _rejected(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], done: SyncDone) -> None:
        """A checkpoint on the instance that failed verification on its way home (a file torn or rotted after its
        manifest was written): it stays there, and an older one is pulled in its place. Said once per checkpoint
        (`checkpoint.rejected`), and written down with its manifest's digest: later syncs pass it over without
        fetching its files again (GBs, every sync), until the trainer writes it again under its name."""
        if done.pulled is None or not done.pulled.rejected:
            return
        checkpoints.remember_rejected(info, "s3" if done.pulled.stats.transport == "s3" else "instance",
                                      done.pulled.rejected_manifests)
        said: list[str] = info.setdefault("rejected_said", [])
        for name, problem in done.pulled.rejected.items():
            if name not in said:
                said.append(name)
                self.app.events.emit("checkpoint.rejected", job_id=job["id"], attempt_id=att["id"], checkpoint=name,
                                     problem=self.app.redactor.clip(problem, 300))
        del said[:-20]  # the newest few: a trainer writing bad checkpoints for days keeps its info small

    def _s3_refusal(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], done: SyncDone) -> None:
        """Said once: S3 refuses the daemon's credentials, and the checkpoints come over SSH (`checkpoint.s3_refused`);
        and once more when a pull from S3 went through again (`checkpoint.s3_answers`)."""
        if done.s3_refused is not None:
            if "s3_refused" not in info:
                info["s3_refused"] = self.app.redactor.clip(done.s3_refused, 300)
                self.app.events.emit("checkpoint.s3_refused", job_id=job["id"], attempt_id=att["id"],
                                     error=info["s3_refused"], fallback="ssh")
        elif done.pulled is not None and done.pulled.stats.transport == "s3" and info.pop("s3_refused", None):
            self.app.events.emit("checkpoint.s3_answers", job_id=job["id"], attempt_id=att["id"])

    def _checkpoint_home(self, att: dict[str, Any], job: dict[str, Any], done: SyncDone,
                         outputs: list[str] | None, info: dict[str, Any] | None = None) -> None:
        """A new checkpoint home: the job's, measured and said (in the job's reason too while a notice is)."""
        assert done.pulled
        info = att["info"] if info is None else info
        with self.store.tx() as conn:
            self.store.update_job(job["id"], conn, checkpoint=done.pulled[-1].name)
            if info.get("notice") and att["state"] == A.RUNNING.value:
                self.store.update_job(job["id"], conn, expect_state=JobState.RUNNING.value,
                                      reason=notice_reason(att, info, done.pulled[-1].name))
            self._measure(conn, att, "sync_s", done.took_s)
            self.app.events.emit("checkpoint.synced", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                 checkpoints=[p.name for p in done.pulled], seconds=round(done.took_s, 3),
                                 via=done.pulled.stats.transport,
                                 **({} if outputs is None else {"outputs": len(outputs)}))

    def collect(self) -> None:
        """What the syncs beside the last ticks did, written down at the start of this one. One whose attempt has
        ended meanwhile (its end pulled on its own, or its instance went) counts only for a checkpoint it brought
        home."""
        for attempt_id in self.pool.finished():
            if attempt_id in self._final and self._still_ending(attempt_id):
                continue  # the attempt's own step takes it (`final`)
            self._final.pop(attempt_id, None)
            done = self.pool.take(attempt_id)
            assert done is not None
            try:
                self._collect_sync(attempt_id, done)
            except Exception as exc:  # one attempt's trouble is not every attempt's: the tick goes on
                self.app.events.emit("attempt.error", attempt_id=attempt_id, state=A.RUNNING.value,
                          error=self.app.redactor.clip(f"writing down a sync: {type(exc).__name__}: {exc}", 500))

    def _still_ending(self, attempt_id: str) -> bool:
        """Whether the attempt is still at the step that takes its last sync (running, or finishing)."""
        with self.store.engine.connect() as c:
            state = c.execute(select(s.attempts.c.state).where(s.attempts.c.id == attempt_id)).scalar()
        return state in (A.RUNNING.value, A.FINISHING.value)

    def _collect_sync(self, attempt_id: str, done: SyncDone) -> None:
        """`collect` for one attempt."""
        with self.store.engine.connect() as c:
            row = c.execute(select(s.attempts).where(s.attempts.c.id == attempt_id)).mappings().first()
            job_row = None if row is None else c.execute(
                select(s.jobs).where(s.jobs.c.id == row["job_id"])).mappings().first()
        if row is None or job_row is None:
            return
        att, job = dict(row), dict(job_row)
        if att["state"] != A.RUNNING.value:
            if done.pulled:
                self._checkpoint_home(att, job, done, None if isinstance(done.outputs, Exception) else done.outputs)
                self._recount_lost_work(att, job, done)
                self._lost_checkpoint_home(att, job, done)
            return
        info = dict(att["info"])
        self.write_down(att, job, info, done)
        with self.store.tx() as conn:  # unless another process moved it meanwhile
            conn.execute(update(s.attempts).where(s.attempts.c.id == attempt_id,
                                                  s.attempts.c.state == A.RUNNING.value).values(info=info))

    def _recount_lost_work(self, att: dict[str, Any], job: dict[str, Any], done: SyncDone) -> None:
        """A sync that ended after its attempt's loss was written down (the loss waits for it only up to the
        heartbeat timeout) saved some of the work counted as lost: the attempt's figure is corrected, and said."""
        counted_to, lost_before = att["info"].get("lost_counted_to"), att.get("lost_work_h")
        if counted_to is None or lost_before is None or not done.pulled:
            return
        written = _written_at(done.pulled[-1], done.at, att["started_at"])
        lost_h = round(max(0.0, float(counted_to) - written) / 3600.0, 4)
        if lost_h >= lost_before:
            return
        with self.store.tx() as conn:
            conn.execute(update(s.attempts).where(s.attempts.c.id == att["id"]).values(lost_work_h=lost_h))
            self.app.events.emit("attempt.lost_work_corrected", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                 lost_work_h=lost_h, counted_before=lost_before, checkpoint=done.pulled[-1].name)

    def _lost_checkpoint_home(self, att: dict[str, Any], job: dict[str, Any], done: SyncDone) -> None:
        """A sync that ended after its attempt's loss was written down brought home the checkpoint said lost with the
        instance (`checkpoint.lost`): said (`checkpoint.lost_corrected`), and taken out of the attempt (which `show`
        and `logs` read) and of the job's reason. The job resumes from it, unless a later attempt already resumed
        from an older one."""
        lost = att["info"].get("checkpoint_lost") or {}
        name = lost.get("checkpoint")
        if not name or not done.pulled or checkpoints.lost_with_instance(name, done.pulled[-1].name) is not None:
            return
        info = {k: v for k, v in att["info"].items() if k != "checkpoint_lost"}
        info["checkpoint_lost_came_home"] = {**lost, "at": round(done.at, 3)}
        with self.store.tx() as conn:
            later = conn.execute(select(s.attempts.c.n, s.attempts.c.info).where(
                s.attempts.c.job_id == job["id"], s.attempts.c.n > att["n"], s.attempts.c.started_at.is_not(None))
                .order_by(s.attempts.c.n)).first()
            back_to = name if later is None else (later.info or {}).get("resume_from")
            then = ("the job resumes from it" if later is None else
                    f"attempt {later.n} had already resumed from {back_to or 'the start'}")
            self.store.set_attempt_info(att["id"], info, conn)
            reason = conn.execute(select(s.jobs.c.reason).where(s.jobs.c.id == job["id"])).scalar()
            said = f"; its checkpoint {name} was lost with its instance"  # as `finish` wrote it in job.resuming
            if reason and said in reason:  # compare-and-set: a reason written since is not this one's to correct
                conn.execute(update(s.jobs).where(s.jobs.c.id == job["id"], s.jobs.c.reason == reason).values(
                    reason=reason.replace(said, f"; its checkpoint {name}, said lost with its instance, came home "
                                                "after all"), updated_at=time.time()))
            self.app.events.emit("checkpoint.lost_corrected", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                 checkpoint=name, said_resumes_from=lost.get("resumes_from"), resumes_from=back_to,
                                 reason=f"{name} came home after all, with a pull that ended after the instance's "
                                        f"loss was written down: {then}")

    def outputs_home(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any]) -> bool:
        """The job's `outputs`, home with the run's last sync (`final_outputs`), written down once it has finished
        on the instance; False when that sync did not bring them (said once per distinct error; the caller keeps the
        instance and starts another)."""
        if not job["spec"].get("outputs") or "outputs" in info:
            return True
        names = info.pop("final_outputs", None)
        if names is None:
            return False  # the last sync did not bring them (`_outputs_done` said why)
        info["outputs"] = names
        # Against everything home, earlier attempts' files too: a pattern one of them matched is not missing.
        home = job_outputs_dir(self.cfg, job["id"])
        missing = job_outputs.missing_from(home, job["spec"]["outputs"])
        self.app.events.emit("job.outputs_home", job_id=job["id"], attempt_id=att["id"], files=len(names),
                  dir=str(home), **({"missing": missing} if missing else {}))
        return True

    def _outputs_io(self, att: dict[str, Any], job: dict[str, Any], shared: SharedConnection | None
                    ) -> list[str] | Exception | None:
        """The job's `outputs` as they are on the instance, home: with each checkpoint that came home (so what an
        attempt wrote, a TensorBoard events file per run say, is not lost with its instance when it is preempted,
        and is as of its newest checkpoint), and with a run's last sync. A later attempt's file replaces an earlier
        one of the same path. The paths, the transfer's failure, or None when the job names no outputs."""
        if not job["spec"].get("outputs"):
            return None
        try:
            return self.cloud_steps.pull_outputs(att, job, shared)
        except Exception as exc:
            if shared is not None:
                shared.drop()
            return exc

    def _outputs_done(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any],
                      got: list[str] | Exception | None) -> list[str] | None:
        if isinstance(got, Exception):
            self.said_once(att, job, info, "outputs_error", "attempt.outputs_pull_failed", got)
            return None
        if got is not None:
            info.pop("outputs_error", None)
        return got

    def _logs_io(self, att: dict[str, Any], job: dict[str, Any], shared: SharedConnection | None
                 ) -> Exception | bool:
        """The attempt's logs home (`CloudSteps.pull_logs`), at each sync and at its end: True, or the failure, which
        costs only their freshness (said once per distinct error by `_logs_done`, tried again at the next sync)."""
        try:
            self.cloud_steps.pull_logs(att, job, shared)
        except Exception as exc:
            if shared is not None:
                shared.drop()
            return exc
        return True

    def _logs_done(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], got: Exception | bool) -> None:
        if isinstance(got, Exception):
            self.said_once(att, job, info, "logs_error", "attempt.logs_pull_failed", got)
        else:
            info.pop("logs_error", None)

    def _moved_on(self, att: dict[str, Any]) -> bool:
        """The attempt's state is no longer the one this step read: another process moved it meanwhile."""
        with self.store.engine.connect() as c:
            now_state = c.execute(select(s.attempts.c.state).where(s.attempts.c.id == att["id"])).scalar()
        return bool(now_state != att["state"])

    def said_once(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], key: str, event: str,
                   exc: Exception) -> None:
        """A failure that is tried again: `event` once per distinct error (the last one said is `info[key]`). Not
        said when the attempt moved on meanwhile: revert-local or a cancel, in another process, stopped its instance
        under the pull, and its own step pulled last."""
        if self._moved_on(att):
            return
        error = self.app.redactor.clip(f"{type(exc).__name__}: {exc}", 300)
        if info.get(key) != error:
            info[key] = error
            self.app.events.emit(event, job_id=job["id"], attempt_id=att["id"], error=error)

    def pull_failed(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], exc: Exception) -> None:
        """A failed pull (rsync killed, local disk full, SSH dropped...) keeps the attempt going and is retried at
        the next sync, not at once: a full disk would be filled and emptied every tick. Its reason is the job's
        until a pull succeeds; the event is logged once per distinct error, the failures are counted."""
        if self._moved_on(att):
            return  # revert-local or a cancel winding it down: its own step pulls last
        error = self.app.redactor.clip(f"{type(exc).__name__}: {exc}", 500)
        same = info.get("sync_error") == error
        if "sync_error" not in info:
            info["reason_before_sync_error"] = job["reason"]
        info["sync_error"] = error
        info["sync_failures"] = int(info.get("sync_failures", 0)) + 1
        info["last_sync_at"] = self.clock()
        with self.store.tx() as conn:
            self.store.update_job(job["id"], conn, expect_state=JobState.RUNNING.value,
                                  reason=f"{SYNC_FAILING}: {error}")
            if not same:
                self.app.events.emit("checkpoint.sync_failed", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                     error=error, failures=info["sync_failures"])


def notice_reason(att: dict[str, Any], info: dict[str, Any], home: str | None) -> str:
    """A noticed attempt's job's reason: the reclaim, the newest checkpoint home, the next instance."""
    notice = info["notice"]
    return (f"spot interruption notice: {att['provider']} reclaims the instance"
            + (f" at {notice['reclaim_at']}" if notice.get("reclaim_at") else "")
            + f"; its newest checkpoint is coming home ({f'{home} is home' if home else 'none is home yet'})"
            + ("; its next instance is launching" if notice.get("successor") else "; it resumes elsewhere"))



def _written_at(checkpoint: Path, pulled_at: float, started_at: float | None) -> float:
    """When a checkpoint that came home was written: its manifest's time, which the work since counts from (the
    lost work of a loss, the unsaved hours the spot policy's safety net weighs), not when the pull ended, up to half
    a checkpoint interval and a pull later. The instance's clock is read within the attempt's run and no later than
    the pull, so a skewed one can neither move it before the run nor after the pull."""
    try:
        created = float(burst_checkpoint.read_manifest(checkpoint).get("created_at") or pulled_at)
    except (OSError, ValueError, TypeError):
        return pulled_at
    return max(min(created, pulled_at), started_at or -math.inf)
