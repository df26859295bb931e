"""The reconcile loop: every tick, compare what the database says should be happening with what is observed
(the provider, the instance over SSH, the local supervisor) and take at most one idempotent step per attempt.

Level-triggered, like a Kubernetes controller: a tick knows nothing the database does not, so a daemon killed at any
point and restarted carries on where it was. Every step is a compare-and-set on the attempt's state
(`machine.move`), so a step repeated after a crash is harmless: a launch is preceded by a look-up by tag/name, a
terminate of a gone instance is success, a supervisor start is idempotent on the instance.

Which queued jobs start, where and on what is `Admission`'s (lifecycle/admission.py); what the monthly cap allows,
`BudgetGuard`'s (lifecycle/budget_guard.py); a cloud attempt's syncs, `AttemptSyncs`'s. The reconciler steps the
attempts: launch, look, bootstrap, watch, move between markets, stop, and what an ended one means for its job.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, insert, select, update

from orchestrator.app import App, burst_enabled
from orchestrator.core.budget import month_key
from orchestrator.core.release import ReleaseFacts, RunSeen, decide_release, releasable
from orchestrator.lifecycle import checkpoints, passenv
from orchestrator.lifecycle.admission import Admission, note_waiting
from orchestrator.lifecycle.attempt_syncs import CLOSE_WAIT_S, AttemptSyncs, notice_reason
from orchestrator.lifecycle.budget_guard import BudgetGuard
from orchestrator.lifecycle.finish import exit_reason
from orchestrator.lifecycle.gone import close_instance, confirmed_gone, job_after_end
from orchestrator.lifecycle.local import STOPPED_OUTSIDE, LocalRunner, stop_wait_s
from orchestrator.lifecycle.machine import AttemptState, active_attempts, chaos_point, move
from orchestrator.lifecycle.market_switch import (
    TO_ON_DEMAND,
    TO_SPOT,
    attempt_should_move,
)
from orchestrator.lifecycle.orphans import sweep_orphans
from orchestrator.lifecycle.schedule import watch_schedule
from orchestrator.lifecycle.spot_probe import is_probe, kept_probe_for, probe_due, probe_spot, step_probe
from orchestrator.lifecycle.states import JobState
from orchestrator.lifecycle.successor import launch_successor, successor_of, waits, written_successor
from orchestrator.lifecycle.watch import Watch
from orchestrator.queue import setup_key, throughput_key
from orchestrator.remote.ssh import HostKeyMismatch
from providers.base import (
    LAUNCH_REFUSALS,
    AuthFailed,
    InstanceInfo,
    InstanceState,
    InvalidRequest,
    LaunchRequest,
    Market,
    OwnerTags,
    Provider,
    ProviderError,
    QuotaExceeded,
    Throttled,
    Transient,
    category,
)
from state import schema as s

if TYPE_CHECKING:
    from orchestrator.lifecycle.cloud_steps import CloudSteps

A = AttemptState
# A step that fails (an SSH connection refused while the instance's sshd restarts, a reset, a provider's 500) is tried
# again after a growing delay, STEP_RETRY_FIRST_S doubled at each failure in a row up to STEP_RETRY_MAX_S, whatever
# the tick (the daemon also steps attempts between ticks); the attempt is given up once MAX_STEP_ERRORS have failed
# in a row *and* the first of them is at least `daemon.heartbeat_timeout_s` of watched time ago (`Watch`: what a
# running attempt's instance may be unreachable before it counts as lost). Failures that come back at once had
# reached the count in about a second, and a blip of a second failed the job. The count, the first failure's time and
# the next try's are in the attempt's info (STEP_FAILURE_KEYS): a restarted daemon carries on the same count and waits
# the same delay.
# A running attempt's step is also its watch (heartbeat, spot notice, syncs; a local run's stops and hand-over): it is
# taken every tick during the wait, and failing again then is the same failure, counted at the next try.
MAX_STEP_ERRORS = 5
STEP_RETRY_FIRST_S = 2.0
STEP_RETRY_MAX_S = 15.0
STEP_FAILURE_KEYS = ("errors", "last_error", "failing_since", "retry_at", "step_reason", "reason_before")
# What a failing step is called in the job's reason, by the attempt's state.
STEP_NAMES = {"intent": "launch", "provisioning": "look at the booting instance", "bootstrapping": "bootstrap",
              "running": "check on the run", "finishing": "final sync", "terminating": "terminate",
              "released": "terminate"}
# The provider did not answer (down, throttling, its retries spent): that says nothing of an instance, which SSH
# still watches. Never a reason to give up an attempt that has one; an intent's launch is given up as before.
UNANSWERED = (Throttled, Transient)
# The provider answered, and would not say: its key refused or without permission (AuthFailed: the user rotated or
# revoked it mid-run), an account limit on the call (QuotaExceeded), a request it calls wrong (InvalidRequest: a
# wrong base_url or region). None of them is an instance gone: every adapter's describe maps one to TERMINATED
# (Lambda's 404 once its listing confirms it, and a 404 for one the listing has live is an InvalidRequest; EC2's
# instance-id filter skips unknown ids), and NoCapacity is only ever a launch's. Unlike UNANSWERED this will not pass
# by itself: the user must act. It says nothing of the instance, which is the user's and reachable over SSH without
# the API: a running attempt is watched there meanwhile (heartbeat, notice, checkpoint syncs), the problem is said
# once (`attempt.provider_refused`) naming the provider and what to do, and is the job's reason and the attempt's
# problem in `status` (its info's PROVIDER_REFUSED) until the provider answers again (`attempt.provider_answers`).
# Never a reason to give up an attempt that has an instance: its terminate could not work either, and an attempt that
# was to end (a run finished, a stop) stays `terminating`, its job not said over, until its instance is confirmed gone.
CANNOT_ASK = (AuthFailed, QuotaExceeded, InvalidRequest)
PROVIDER_REFUSED = "provider_refused"
# Why a terminating attempt's job is not released to this machine while its provider does not answer (revert-local;
# `core/release.py`): said in the job's reason with the terminate's count, and once as `attempt.release_held`.
RELEASE_HELD = "release_held"
# The setting `revert-local --resume-from-home` writes: the user's leave to release such a job whatever the instance
# holds. Until `burst-enable`.
RESUME_FROM_HOME_KEY = "revert_local.resume_from_home"
# The provider did not answer while an attempt's instance was launched or booting (its info's flag): how long the boot
# took is not known, so it is not measured (`boot_s` feeds every later decision's t_ovh).
BOOT_UNANSWERED = "boot_unanswered"
# Nor does `daemon.boot_timeout_s` count that time: a boot is timed from its launch less the time the provider did not
# answer (since the first unanswered call, until the next look it answers), kept in the attempt's info so that a
# restarted daemon counts the same. An outage longer than the timeout had ended, and launched again, an instance not
# yet up at the first look after it. Both count only the time a daemon watched (`Watch`): one restarted, or woken,
# an hour after the launch had ended the instance at its first look.
UNANSWERED_SINCE, UNANSWERED_S = "boot_unanswered_since", "boot_unanswered_s"
# Why a queued local (or hybrid) job has not started: the local GPU is busy, or outside local.available_hours.
LOCAL_GPU_BUSY = "waiting for the local GPU"
LOCAL_GPU_HOURS = "waiting for the local GPU's hours (local.available_hours)"
MAX_STEPS_PER_TICK = 4  # intent → provisioning → bootstrapping → running in one tick when nothing waits
LACKING_ENV_FORGET_S = 60.0  # how long a job lacking its pass_env is left out of the candidates before a new look
LACKING_ENV_KEPT = 2000  # at most this many left out (each is a row more that the candidates' query reads)
BOOT_WAIT_S, BOOT_POLL_S, BOOT_WAIT_WINDOW_S = 1.0, 0.2, 15.0  # brief in-tick polling of a just-launched instance
LOSS_PULL_MAX_S = 1800.0  # a lost run's last pull from an instance still there, at most (stalls end it sooner)
NOTICE_SYNCS_S = 300.0  # after a spot notice, a sync each tick for this long (EC2 reclaims in 120 s, GCP in 30 s)


class Reconciler:
    def __init__(self, app: App, providers: Mapping[str, Provider], *, cloud: CloudSteps | None = None,
                 clock: Callable[[], float] = time.time):
        self.app = app
        self.cfg = app.config
        self.store = app.store
        # The owner tag, read now: made on first use, it is written to the state, which inside a launch's own write
        # transaction waited on that transaction (SQLite: "database is locked").
        self.owner = app.orchestrator_id
        self.providers = dict(providers)
        self.clock = clock
        # Since when this process has watched the attempts (carried over by a config reload's reconciler): a boot
        # that began before it was not watched throughout, and is not measured (`_step_provisioning`).
        self.watching_since = clock()
        # How long the attempts were watched (lifecycle/watch.py): what the timeouts that wait on an instance count.
        self.watch = Watch(self.store, clock, self.cfg.daemon.tick_s, on_gap=self._unwatched)
        self.cloud = cloud  # CloudSteps: SSH, runbooks, syncs (None: the cloud is not configured)
        self._heartbeats: dict[str, tuple[Any, float]] = {}  # attempt id → (heartbeat ts, monotonic when it changed)
        self.unavailable: dict[str, str] = {}  # enabled providers that cannot be used → why (`build_reconciler`)
        self.budget = BudgetGuard(app, clock, self.cfg.daemon.tick_s)
        self.local = LocalRunner(app, hand_over_held=lambda job, now: self.admission.hand_over_held(job, now))
        self.admission = Admission(app, self.providers, local=self.local, budget=self.budget,
                                   has_cloud=cloud is not None, owner=self.owner, clock=clock,
                                   advance=self._advance_new_attempt)
        self.offers = self.admission.offers  # the providers' listings, read by running attempts' steps too
        self.syncs = AttemptSyncs(app, lambda: self.cloud_steps, clock, self._measure)

    @property
    def cloud_steps(self) -> CloudSteps:
        """`cloud`, for an attempt on a provider: configured whenever a provider is (`service.build_reconciler`)."""
        if self.cloud is None:
            raise RuntimeError("no cloud steps: the cloud is not configured")
        return self.cloud

    def carry_over(self, before: Reconciler) -> None:
        """Take over from the reconciler this one replaces (a config reload): when each heartbeat last moved, since
        when the attempts are watched, and the gaps in the watch, and the syncs in flight."""
        self._heartbeats = before._heartbeats
        self.watching_since = before.watching_since
        self.watch = before.watch
        self.syncs.carry_over(before.syncs)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Once the ticks are over (the daemon stops, revert-local is done): the syncs in flight, waited for and
        written down (`AttemptSyncs.close`)."""
        self.syncs.close(wait_s)

    def abandon(self) -> None:
        """Once the ticks are over and nothing may be written down (`AttemptSyncs.abandon`)."""
        self.syncs.abandon()

    def _unwatched(self, since: float, until: float) -> None:
        """Said: nobody watched the attempts from `since` to `until` (the daemon was stopped, or its machine slept),
        and the timeouts that wait on an instance do not count that time."""
        self.app.events.emit("daemon.unwatched", seconds=round(until - since, 1), since=round(since, 3),
                             until=round(until, 3))

    @property
    def tick_s(self) -> float:
        """The tick the daemon runs this reconciler at (`daemon --tick`, else the config's)."""
        return self.watch.tick_s

    @tick_s.setter
    def tick_s(self, tick_s: float) -> None:
        self.budget.tick_s = self.watch.tick_s = tick_s

    # --- the tick -----------------------------------------------------------------------------------------
    def tick(self) -> None:
        self.watch.look()
        try:
            self._tick()
        finally:
            self.watch.looked()

    def _tick(self) -> None:
        self.syncs.collect()
        with self.store.tx() as conn:
            attempts = active_attempts(conn)
        jobs = {j["id"]: j for j in self._jobs_of(attempts)}
        for j in jobs.values():
            # A job started before a daemon restart: its passed values are scrubbed from this daemon's errors too.
            self.app.redactor.add_env_names(passenv.names(j["spec"]))
        for att in attempts:
            job = jobs.get(att["job_id"])
            if job is not None:
                self._advance(att, job)
        for gone in self._heartbeats.keys() - {att["id"] for att in attempts}:
            del self._heartbeats[gone]  # ended attempts: months of them in a daemon that never restarts
        self.admission.schedule()

    def _advance(self, att: dict[str, Any], job: dict[str, Any]) -> None:
        """Step an attempt, and keep stepping it within this tick while each step moves it on: a launch is
        followed at once by the look at the instance, a reachable instance at once by its bootstrap. A step that
        leaves the state as it was is waiting on the outside world; the next tick looks again."""
        # Its last step failed and its next try is not due: not tried again before then, but a running attempt is
        # still watched (a notice, a stale heartbeat or a stop in the wait's 15 s would have waited for it).
        waiting = self._retry_waits(att, job)
        if waiting and att["state"] != A.RUNNING.value:
            return
        waited = 0.0
        for _ in range(MAX_STEPS_PER_TICK + int(BOOT_WAIT_S / BOOT_POLL_S)):
            before = att["state"]
            try:
                if att["where"] == "local":
                    self.local.step(att, job)
                else:
                    self._cloud_step(att, job)
            except HostKeyMismatch as exc:
                self._host_key_changed(att, job, exc)
                return
            except Exception as exc:  # one attempt's trouble never stops the others
                if not (waiting and before == A.RUNNING.value):  # else counted at its next try, as if not taken
                    self._step_failed(att, job, exc)
                return
            with self.store.engine.connect() as c:
                row = c.execute(select(s.attempts).where(s.attempts.c.id == att["id"])).mappings().first()
                fresh_job = c.execute(select(s.jobs).where(s.jobs.c.id == job["id"])).mappings().first()
            if row is None or AttemptState(row["state"]).final or fresh_job is None:
                return
            att, job = dict(row), dict(fresh_job)
            if att["info"].get("errors"):  # a step went through: the failures counted were not consecutive
                self._failures_over(att, job)
            if row["state"] == before:
                # An instance launched a moment ago is often up within a second: look again briefly rather than
                # a whole tick later (bounded, so other attempts are not held up).
                if before != A.PROVISIONING.value or waited >= BOOT_WAIT_S or \
                        self.clock() - float(row["created_at"]) > BOOT_WAIT_WINDOW_S:
                    return
                time.sleep(BOOT_POLL_S)
                waited += BOOT_POLL_S

    def _host_key_changed(self, att: dict[str, Any], job: dict[str, Any], exc: HostKeyMismatch) -> None:
        """Not the machine we launched (or someone in the middle): never retried, never trusted. The attempt is
        aborted at once (its instance terminated) and the job goes back to the queue."""
        error = self.app.redactor.clip(str(exc), 500)
        self.emit("attempt.host_key_mismatch", job_id=job["id"], attempt_id=att["id"], instance=att["instance_id"],
                  error=error)
        provider = self.providers.get(att["provider"])
        if provider is None or att["state"] in (A.TERMINATING.value, A.RELEASED.value):
            return
        try:
            self.stop(att, job, provider, "host key changed", outcome=A.ABORTED)
        except Exception as exc2:
            self._step_failed(att, job, exc2)

    def _retry_waits(self, att: dict[str, Any], job: dict[str, Any]) -> bool:
        """Whether the attempt's last step failed and its next try is not due yet. A stop due (cancel, revert-local,
        the budget, ...) is not held up by it: that is another step; nor is a running attempt's watch (`_advance`). A
        next try further ahead than the longest delay is due (the clock went back)."""
        retry_at = att["info"].get("retry_at")
        if retry_at is None:
            return False
        wait = float(retry_at) - self.clock()
        if not 0 < wait <= STEP_RETRY_MAX_S:
            return False
        if att["state"] == A.RELEASED.value:
            return True  # its job has gone on without it: only its terminate is tried again, when due
        if job["state"] == JobState.CANCELLED.value:
            return False
        return not (att["where"] == "cloud" and att["state"] not in (A.INTENT.value, A.TERMINATING.value)
                    and self.stop_reason(att, job) is not None)

    def _failures_over(self, att: dict[str, Any], job: dict[str, Any]) -> None:
        """A step went through after failures: their count and wait go, and the job's reason, if it is still the one
        the failures wrote, is what it was before them."""
        info = att["info"]
        said, before = info.get("step_reason"), info.get("reason_before")
        att["info"] = {k: v for k, v in info.items() if k not in STEP_FAILURE_KEYS}
        with self.store.tx() as conn:
            self.store.set_attempt_info(att["id"], att["info"], conn)
            if said is not None and job.get("reason") == said and \
                    self.store.update_job(job["id"], conn, expect_state=job["state"], reason=before):
                job["reason"] = before

    def _provider_refused(self, att: dict[str, Any], job: dict[str, Any], exc: ProviderError,
                         info: dict[str, Any]) -> None:
        """The attempt's provider refused to be asked about its instance (CANNOT_ASK). Written in `info` (the
        caller's working copy of the attempt's, persisted here) as PROVIDER_REFUSED, made the job's reason, and said
        once (`attempt.provider_refused`, in the transaction that writes it down: a restarted daemon does not say it
        again), and again only for another kind of refusal. What is said follows the attempt's state (watched over
        SSH; or its instance not terminated)."""
        kind = category(exc)
        note = info.get(PROVIDER_REFUSED) or {}
        said = refused_problem(att["provider"], kind, self.app.redactor.clip(str(exc), 300), att["instance_id"],
                               att["state"])
        if note.get("said") == said:
            att["info"] = info
            return
        info[PROVIDER_REFUSED] = {"since": note.get("since", self.clock()), "error": kind, "said": said,
                                  "reason_before": note["reason_before"] if note else job.get("reason")}
        with self.store.tx() as conn:
            self.store.set_attempt_info(att["id"], info, conn)
            # A spot probe's or a successor's is said as theirs, not as the job's reason (as `_step_failed`'s count).
            if not JobState(job["state"]).final and not is_probe(att) and successor_of(att) is None and \
                    att["state"] != A.RELEASED.value and \
                    self.store.update_job(job["id"], conn, expect_state=job["state"], reason=said):
                job["reason"] = said
            if note.get("error") != kind:
                self.app.events.emit("attempt.provider_refused", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                     provider=att["provider"], instance=att["instance_id"], error=kind,
                                     code=exc.code, state=att["state"], problem=said)
        att["info"] = info

    def _provider_answers(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any]) -> None:
        """The provider answered a look at the instance after refusing (PROVIDER_REFUSED in `info`, the caller's
        working copy, persisted here): the refusal goes, said (`attempt.provider_answers`), and the job's reason, if
        it is still the refusal's, is what it was before."""
        note = info.pop(PROVIDER_REFUSED, None)
        if note is None:
            return
        with self.store.tx() as conn:
            self.store.set_attempt_info(att["id"], info, conn)
            if job.get("reason") == note.get("said") and self.store.update_job(
                    job["id"], conn, expect_state=job["state"], reason=note.get("reason_before")):
                job["reason"] = note.get("reason_before")
            self.app.events.emit("attempt.provider_answers", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                 provider=att["provider"], instance=att["instance_id"], error=note.get("error"),
                                 refused_for_s=round(max(0.0, self.clock() - float(note.get("since") or 0)), 1))
        att["info"] = info

    def _step_failed(self, att: dict[str, Any], job: dict[str, Any], exc: Exception) -> None:
        """Count consecutive failures of the same step, and set when it is tried again (STEP_RETRY_FIRST_S, doubled
        at each failure, at most STEP_RETRY_MAX_S); the attempt is given up after MAX_STEP_ERRORS failures in a row
        spanning at least `daemon.heartbeat_timeout_s`. Until then the job's reason says so."""
        error = self.app.redactor.clip(f"{type(exc).__name__}: {exc}", 500)
        now = self.clock()
        info = dict(att["info"])
        same = info.get("last_error") == error
        info["errors"] = errors = int(info.get("errors", 0)) + 1
        if isinstance(exc, UNANSWERED) and att["state"] in (A.INTENT.value, A.PROVISIONING.value):
            info[BOOT_UNANSWERED] = True
            info.setdefault(UNANSWERED_SINCE, now)
        info["last_error"] = error
        info["failing_since"] = since = min(now, float(info.get("failing_since", now)))  # min: the clock went back
        delay = min(STEP_RETRY_MAX_S, STEP_RETRY_FIRST_S * 2.0 ** (errors - 1))
        info["retry_at"] = now + delay
        # Watched time: four failures, a night asleep and one more failure at waking are not a step failing all night.
        failing_s = self.watch.watched_s(since, now)
        # A cloud step its provider does not answer, on an attempt past its launch, is never given up (below): its
        # count and next try are said on, not left at the last before MAX_STEP_ERRORS for as long as the outage.
        waited_out = isinstance(exc, UNANSWERED) and att["where"] == "cloud" and att["state"] != A.INTENT.value
        give_up = errors >= MAX_STEP_ERRORS and failing_s >= self.cfg.daemon.heartbeat_timeout_s and not waited_out
        unknown_launch = att["where"] == "cloud" and att["state"] == A.INTENT.value and info.get("launch_tried")
        # Its instance's provider refuses to be asked (CANNOT_ASK): said as that, with what to do, not as a count.
        refused = isinstance(exc, CANNOT_ASK) and att["where"] == "cloud" and bool(att.get("instance_id"))
        said = None
        if not give_up and not refused and not (errors >= MAX_STEP_ERRORS and unknown_launch) and not is_probe(att) \
                and successor_of(att) is None and not JobState(job["state"]).final and att["state"] != A.RELEASED.value:
            step = STEP_NAMES.get(att["state"], "step") if att["where"] == "cloud" else "local run's step"
            said = (f"{step} failed {errors} time{'s' if errors != 1 else ''} in a row, next try in {delay:.0f} s: "
                    f"{error}")
            if info.get(RELEASE_HELD):  # revert-local could not bring it home: why, and what the user may do
                said += f"; not moved home: {info[RELEASE_HELD]}"
            if "step_reason" not in info:
                info["reason_before"] = job.get("reason")
            info["step_reason"] = said
        with self.store.tx() as conn:
            self.store.set_attempt_info(att["id"], info, conn)
            if said is not None and self.store.update_job(job["id"], conn, expect_state=job["state"], reason=said):
                job["reason"] = said
            if not same:  # repeated identical errors are counted, not re-logged every tick
                self.app.events.emit("attempt.error", job_id=att["job_id"], attempt_id=att["id"], conn=conn,
                                     state=att["state"], error=error, count=errors, next_try_in_s=delay)
        att["info"] = info
        if refused and isinstance(exc, ProviderError):
            self._provider_refused(att, job, exc, dict(info))
            return  # never given up: its terminate could not work either; tried again at each next try
        if errors < MAX_STEP_ERRORS:
            return
        if waited_out:
            # Its instance runs on, or not, whatever the API says now: given up, its last checkpoint would be left
            # behind, its job failed, for a blip. SSH watches the run meanwhile (its heartbeat timeout still ends a
            # lost one), and the provider is asked again each tick.
            return
        if unknown_launch:
            # Whether its launch made an instance is not known until the provider answers: given up now, one it made
            # would run, and bill, with no row or charge of ours until the sweep found it. It waits, and says so.
            note_waiting(self.app, job, f"the outcome of its launch on {att['provider']} is not known yet: {error}; "
                         "asked again each tick until the provider answers", same_as="the outcome of its launch")
            return
        if not give_up:
            return  # failing for less than the heartbeat timeout: a blip (an sshd restarting) is waited out
        reason = f"gave up after {errors} failed steps over {failing_s:.0f} s: {error}"
        if att["where"] == "local" and att["state"] != A.INTENT.value and not self.local.end_trainer(att):
            return  # its trainer still runs: given up once it is gone, not before (the next error tries again)
        if att["where"] == "local" or att["state"] == A.INTENT.value:
            outcome = A.LAUNCH_FAILED if att["where"] == "cloud" else A.FAILED
            with self.store.tx() as conn:
                if move(conn, att, outcome, reason=reason):
                    self._after_attempt(conn, att, job, outcome, reason)
            return
        provider = self.providers.get(att["provider"])
        if provider is not None and att["state"] not in (A.TERMINATING.value, A.RELEASED.value):
            try:
                self.stop(att, job, provider, reason, outcome=A.FAILED)
            except Exception as exc2:
                self.emit("attempt.error", job_id=att["job_id"], attempt_id=att["id"], state=att["state"],
                          error=f"{type(exc2).__name__}: {exc2}")

    def emit(self, type_: str, **data: Any) -> None:
        self.app.events.emit(type_, **data)

    def mode(self) -> str:
        """As `status` says it: the kill switch's, or local-only for want of a usable cloud provider."""
        if not burst_enabled(self.app):
            return "local-only"
        return "burst-enabled" if self.providers else "local-only (no cloud provider is usable)"

    def sweep(self) -> dict[str, list[str]]:
        return sweep_orphans(self.app, self.providers, self.clock)

    def _jobs_of(self, attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ids = sorted({a["job_id"] for a in attempts})
        if not ids:
            return []
        with self.store.engine.connect() as c:
            return [dict(r) for r in c.execute(select(s.jobs).where(s.jobs.c.id.in_(ids))).mappings()]

    def _advance_new_attempt(self, job_id: str) -> None:
        """Step a cloud attempt that admission has just written down: launched now, not a tick later."""
        with self.store.engine.connect() as c:
            row = c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id, s.attempts.c.state ==
                                                     A.INTENT.value)).mappings().first()
            job = c.execute(select(s.jobs).where(s.jobs.c.id == job_id)).mappings().first()
        if row is not None and job is not None:
            self._advance(dict(row), dict(job))

    # --- one step of a cloud attempt ---------------------------------------------------------------------------
    def _cloud_step(self, att: dict[str, Any], job: dict[str, Any]) -> None:
        provider = self.providers.get(att["provider"])
        if provider is None:
            # Said once per attempt (it was an event every tick), and in the job's reason: nobody watches or
            # stops its instance until the provider is usable again (config fixed, or its credentials restored).
            if not att["info"].get("provider_unavailable"):
                info = {**att["info"], "provider_unavailable": True}
                with self.store.tx() as conn:
                    self.store.set_attempt_info(att["id"], info, conn)
                att["info"] = info
                self.emit("attempt.provider_unavailable", job_id=job["id"], attempt_id=att["id"],
                          provider=att["provider"])
            note_waiting(self.app, job, f"attempt {att['id']} is on provider {att['provider']}, which this daemon "
                         "cannot use (`burstctl providers` says why): its instance is neither watched nor stopped "
                         "until it can")
            return
        if att["info"].get("provider_unavailable"):
            info = {k: v for k, v in att["info"].items() if k != "provider_unavailable"}
            with self.store.tx() as conn:
                self.store.set_attempt_info(att["id"], info, conn)
            att["info"] = info
        if is_probe(att):
            step_probe(self, att, job, provider)
            return
        st = A(att["state"])
        stop_reason = self.stop_reason(att, job)
        if st is A.INTENT:
            self.step_intent(att, job, provider, stop_reason)
        elif st in (A.TERMINATING, A.RELEASED):
            self.step_terminating(att, job, provider)
        elif stop_reason is not None:
            self.wind_down(att, job, provider, stop_reason)
        elif st is A.PROVISIONING:
            self._step_provisioning(att, job, provider)
        elif st is A.BOOTSTRAPPING:
            if successor_of(att) is None or not waits(self, att, job, provider):
                self._step_bootstrapping(att, job, provider)
        elif st is A.RUNNING:
            self._step_running(att, job, provider)
        elif st is A.FINISHING:
            self._step_finishing(att, job, provider)

    def stop_reason(self, att: dict[str, Any], job: dict[str, Any]) -> str | None:
        """Why an attempt must stop now, whatever its state: cancel, kill switch, budget, max run time, a kept spot
        probe to take over from it."""
        now = self.clock()
        if job["state"] == JobState.CANCELLED.value:
            return "cancelled"
        if not burst_enabled(self.app):
            return "revert-local"
        spec = job["spec"]
        if spec.get("max_run_hours") and att["started_at"] and now - att["started_at"] > spec["max_run_hours"] * 3600:
            return "max-run-time"
        live = att["state"] in (A.RUNNING.value, A.BOOTSTRAPPING.value, A.PROVISIONING.value)
        if live and self.budget.problem(now) is not None:
            return "budget-cap"  # stopped while there is still room to checkpoint, sync and terminate
        if live and kept_probe_for(self, att) is not None:
            return TO_SPOT  # a spot probe came up and is kept to take over (even if a daemon died in between)
        if att["state"] == A.RUNNING.value and att["info"].get("stopping_for"):
            return str(att["info"]["stopping_for"])  # a stop begun by a daemon that died before it ended
        return None

    def step_intent(self, att: dict[str, Any], job: dict[str, Any], provider: Provider,
                     stop_reason: str | None) -> None:
        info = dict(att["info"])
        # Any launch that may have happened is looked up before another is made (no idempotency in every cloud).
        found = provider.find_attempt(att["id"]) if info.get("launch_tried") else None
        adopted = found is not None  # launched by a daemon that died before recording it
        if found is None and stop_reason is not None:
            with self.store.tx() as conn:
                if move(conn, att, A.ABORTED, reason=stop_reason):
                    self._after_attempt(conn, att, job, A.ABORTED, stop_reason)
            return
        if found is None:
            info["launch_tried"] = True
            with self.store.tx() as conn:
                self.store.set_attempt_info(att["id"], info, conn)
            att["info"] = info
            chaos_point("before-launch")  # intent and launch_tried are written; the call is not made
            try:
                found = self.launch(att, job, provider)
                chaos_point("after-launch")  # the instance exists; the database does not know its id
            except LAUNCH_REFUSALS as exc:
                with self.store.tx() as conn:
                    if reason := self.refused(conn, att, exc):
                        self.app.events.emit("attempt.launch_failed", job_id=job["id"], attempt_id=att["id"],
                                             conn=conn, provider=att["provider"], error=type(exc).__name__,
                                             code=exc.code, reason=reason)
                        self._after_attempt(conn, att, job, A.LAUNCH_FAILED, reason)
                return
            except ProviderError as exc:  # throttled/transient after retries: the outcome is unknown
                att["info"] = {UNANSWERED_SINCE: self.clock(), **info, BOOT_UNANSWERED: True}
                with self.store.tx() as conn:
                    self.store.set_attempt_info(att["id"], att["info"], conn)
                    self.app.events.emit("attempt.launch_unknown", job_id=job["id"], attempt_id=att["id"],
                                         conn=conn, error=type(exc).__name__)
                return
        self.adopt(att, job, found, "adopted" if adopted else "launched")

    def launch(self, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> InstanceInfo:
        """Launch the instance an attempt's row describes (its type, its market, the regions to try first), tagged
        with the attempt so that a launch whose answer was lost is found by its tags. Raises the provider's error:
        a refusal (`LAUNCH_REFUSALS`, see `refused`), or an unknown outcome (throttled or transient after retries)."""
        return provider.launch(LaunchRequest(
            instance_type=att["instance_type"], market=Market(att["market"]),
            tags=OwnerTags(self.owner, job["id"], att["id"]), idempotency_key=att["idempotency_key"],
            ssh_public_key=self.cloud_steps.public_key, region_order=tuple(att["info"].get("region_order") or ())))

    def refused(self, conn: Connection, att: dict[str, Any], exc: ProviderError) -> str | None:
        """An attempt whose launch was refused ends `launch_failed`, with the refusal's category (what the next
        offer's choice and the sightings read); why, or None if it had already moved on."""
        reason = f"{type(exc).__name__}: {self.app.redactor(str(exc))}"
        moved = move(conn, att, A.LAUNCH_FAILED, reason=reason, info={**att["info"], "launch_error": category(exc)})
        return reason if moved else None

    def adopt(self, att: dict[str, Any], job: dict[str, Any], inst: InstanceInfo, how: str) -> None:
        now = self.clock()
        launched = inst.launched_at or now
        with self.store.tx() as conn:
            if not move(conn, att, A.PROVISIONING, instance_id=inst.id, region=inst.region):
                return
            exists = conn.execute(select(s.instances.c.id).where(s.instances.c.provider == att["provider"],
                                                                 s.instances.c.id == inst.id)).first()
            if exists is None:
                conn.execute(insert(s.instances).values(
                    provider=att["provider"], id=inst.id, attempt_id=att["id"], state=inst.state.value,
                    instance_type=inst.instance_type, market=inst.market.value,
                    rate_usd_h=att["info"].get("rate_usd_h"), host=inst.host, port=inst.ssh_port,
                    host_key=inst.host_key, launched_at=launched, verified_gone=False))
                self.store.open_charge({
                    "month": month_key(launched), "job_id": job["id"], "attempt_id": att["id"],
                    "provider": att["provider"], "instance_id": inst.id, "instance_type": inst.instance_type,
                    "market": inst.market.value, "rate_usd_h": att["info"].get("rate_usd_h", 0.0),
                    "started_at": launched}, conn=conn)
            self.app.events.emit("instance.adopted" if how == "adopted" else "instance.launched", job_id=job["id"],
                                 attempt_id=att["id"], conn=conn,
                                 provider=att["provider"], instance=inst.id, instance_type=inst.instance_type,
                                 market=inst.market.value, region=inst.region)

    def _step_provisioning(self, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> None:
        inst = provider.describe([att["instance_id"]]).get(att["instance_id"])
        now = self.clock()
        self._answered_again(att, now)
        self._provider_answers(att, job, dict(att["info"]))
        if inst is None or inst.state.gone:
            self._lost(att, job, provider, inst, "instance gone while provisioning")
            return
        booting_s = self.watch.watched_s(att["created_at"], now) - float(att["info"].get(UNANSWERED_S, 0.0))
        if inst.state is not InstanceState.RUNNING or not inst.host:
            if booting_s > self.cfg.daemon.boot_timeout_s:
                self.stop(att, job, provider, "boot-timeout")  # aborted: the job launches again
            return
        target = self.cloud_steps.target(att, inst)
        if not self.cloud_steps.reachable(att, target):
            if booting_s > self.cfg.daemon.boot_timeout_s:
                self.stop(att, job, provider, "ssh-timeout")  # aborted: the job launches again
            return
        boot_s = now - att["created_at"]
        # An outage during the boot is in `boot_s`, and whether the instance was up before it ended is not known:
        # measured, one outage would lengthen every later decision's t_ovh (`queue.measured_overhead_h`). So is a
        # daemon's downtime, for a boot launched (or written down) before this daemon started, and a sleep of its
        # machine during the boot: it was not watched.
        not_measured = ("the provider did not answer during the boot: its time is not taken into t_ovh"
                        if att["info"].get(BOOT_UNANSWERED) else
                        "the daemon started after the launch: the boot was not watched throughout, and its time "
                        "(which holds the daemon's downtime) is not taken into t_ovh"
                        if att["created_at"] < self.watching_since else
                        "the daemon was not looking for part of the boot (its machine asleep): its time is not "
                        "taken into t_ovh" if self.watch.watched_s(att["created_at"], now) < boot_s else None)
        with self.store.tx() as conn:
            info = {**att["info"], "host": inst.host, "port": inst.ssh_port, "user": inst.ssh_user, "boot_s": boot_s}
            if move(conn, att, A.BOOTSTRAPPING, info=info):
                conn.execute(update(s.instances).where(s.instances.c.provider == att["provider"],
                                                       s.instances.c.id == inst.id)
                             .values(state=InstanceState.RUNNING.value))  # the row said what launch saw
                if not_measured is None:
                    self._measure(conn, att, "boot_s", boot_s)
                self.app.events.emit("instance.ready", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                     instance=att["instance_id"], boot_s=round(boot_s, 3),
                                     **({"not_measured": not_measured} if not_measured else {}))

    def _answered_again(self, att: dict[str, Any], now: float) -> None:
        """The provider answered a look at a booting instance: the time since it first did not is written down as
        not counted against `daemon.boot_timeout_s` (`UNANSWERED_S`): what of it was watched, the rest is not counted
        anyway."""
        info = att["info"]
        if UNANSWERED_SINCE not in info:
            return
        silent_s = self.watch.watched_s(float(info[UNANSWERED_SINCE]), now)
        info = {k: v for k, v in info.items() if k != UNANSWERED_SINCE}
        info[UNANSWERED_S] = float(info.get(UNANSWERED_S, 0.0)) + silent_s
        with self.store.tx() as conn:
            self.store.set_attempt_info(att["id"], info, conn)
        att["info"] = info

    def _step_bootstrapping(self, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> None:
        problem = passenv.unusable(job["spec"])
        if problem is not None:
            # Launched by a daemon that had the variables, bootstrapped by one restarted without them.
            self.stop(att, job, provider, problem, outcome=A.ABORTED)
            return
        resume_from = checkpoints.resume_point(self.app, job["id"])
        try:
            timings = self.cloud_steps.bootstrap_and_start(att, job, resume_from)
        except HostKeyMismatch:
            raise
        except Exception:
            # Failing on an instance the provider no longer runs (a spot reclaim, likeliest while no daemon watched
            # a bootstrap cut short) is its loss, not a step to retry: the job resumes elsewhere.
            if (gone := self._gone(att, provider)) is None:
                raise
            self._lost(att, job, provider, gone[0], f"instance gone while bootstrapping ({gone[1]})")
            return
        now = self.clock()
        with self.store.tx() as conn:
            info = {**att["info"], "timings": timings, "resume_from": resume_from.name if resume_from else None,
                    "last_sync_at": now, "last_seen_at": now,
                    "last_checkpoint_at": now}
            if move(conn, att, A.RUNNING, info=info, started_at=now):
                for k, v in timings.items():
                    self._measure(conn, att, f"{k}_s", v)
                # What launched it ("bursting to", "resuming on ... launched at the notice") is over: say what runs.
                self.store.update_job(job["id"], conn, expect_state=JobState.RUNNING.value, reason=(
                    f"running on {att['provider']} {att['instance_type']} ({att['market']})"
                    + (f", resumed from {resume_from.name}" if resume_from is not None else "")))
                if resume_from is not None:
                    self.app.events.emit("job.resumed", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                         instance=att["instance_id"], checkpoint=resume_from.name,
                                         provider=att["provider"], market=att["market"])
                self.app.events.emit("attempt.running", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                     instance=att["instance_id"], timings=timings)

    def _gone(self, att: dict[str, Any], provider: Provider) -> tuple[InstanceInfo | None, str] | None:
        """The attempt's instance as the provider reports it, and what it says, when it is gone; None while it runs
        or the provider does not answer."""
        try:
            inst = provider.describe([att["instance_id"]]).get(att["instance_id"])
        except ProviderError:
            return None
        if inst is not None and not inst.state.gone:
            return None
        said = f"provider reports {inst.state.value if inst else 'unknown'}"
        return inst, said + (f" ({inst.reason})" if inst and inst.reason else "")

    def _step_running(self, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> None:
        now = self.clock()
        try:
            inst = provider.describe([att["instance_id"]]).get(att["instance_id"])
        except UNANSWERED as exc:
            # The API is down or throttling: the run is watched over SSH meanwhile (heartbeat, notice, syncs), as
            # if the provider had said nothing; said once an outage (`attempt.error`), never the run's end.
            if "unanswered_since" not in att["info"]:
                att["info"] = {**att["info"], "unanswered_since": now}
                self.emit("attempt.error", job_id=job["id"], attempt_id=att["id"], state=att["state"],
                          error=self.app.redactor.clip(f"{type(exc).__name__}: {exc}", 500),
                          carries_on="the provider does not answer: the run is watched over SSH meanwhile")
            inst = None
        except CANNOT_ASK as exc:
            # Its key refused, say: nothing is known of the instance either way, and the run is watched over SSH
            # as above. Said once, with what to do, until the provider answers again.
            self._provider_refused(att, job, exc, dict(att["info"]))
            inst = None
        else:
            if inst is None or inst.state.gone:
                self._lost(att, job, provider, inst, f"provider reports {inst.state.value if inst else 'unknown'}"
                           + (f" ({inst.reason})" if inst and inst.reason else ""))
                return
            if "unanswered_since" in att["info"]:
                att["info"] = {k: v for k, v in att["info"].items() if k != "unanswered_since"}
            self._provider_answers(att, job, dict(att["info"]))
        status = self.cloud_steps.status(att)
        info = dict(att["info"])
        if status is None:  # SSH unreachable, for the time a daemon asked (`Watch`), not since it last answered
            if self.watch.watched_s(float(info.get("last_seen_at", now)), now) > self.cfg.daemon.heartbeat_timeout_s:
                self._lost(att, job, provider, inst, "heartbeat lost (SSH unreachable)")
            return
        info["last_seen_at"] = now
        if status.get("metrics"):
            info["metrics"] = status["metrics"]  # what the trainer reports: progress, throughput, peak VRAM
            watch_schedule(self.app, att, job, info, now)
        hb = status.get("heartbeat") or {}
        ex = status.get("exit")
        # The newest complete checkpoint the instance holds, as its supervisor last said: what a preemption throws
        # away if it is not home by then (`_lost` says so, `checkpoint.lost`).
        on_instance = checkpoints.newest_name(info.get("instance_checkpoint"), hb.get("last_checkpoint"),
                                              (ex or {}).get("last_checkpoint"))
        if on_instance is not None:
            info["instance_checkpoint"] = on_instance
        setup_s = hb.get("setup_s") or (ex or {}).get("setup_s")
        if setup_s is not None and "setup_s" not in info:  # the job's setup ran on this instance, this long
            info["setup_s"] = setup_s
            with self.store.tx() as conn:  # the job name's: `queue.setup_estimate` adds it to the job's t_ovh
                self._measure(conn, att, "setup_s", float(setup_s), key=setup_key(job["name"]))
        self.syncs.watch_s3_uploads(att, job, info, (ex or {}).get("s3") or status.get("s3"), exited=ex is not None)
        # Staleness is how long, on this process's monotonic clock, the instance's heartbeat has not changed:
        # comparing its timestamp with the wall clock calls a healthy run lost when either clock jumps. A
        # restarted daemon watches for a full timeout again; a sleep of its machine does not count either (the
        # monotonic clock stands still through a suspend on Linux and macOS).
        mono = time.monotonic()
        seen = self._heartbeats.get(att["id"])
        if seen is None or seen[0] != hb.get("ts"):
            seen = self._heartbeats[att["id"]] = (hb.get("ts"), mono)
        if hb.get("notice") and "notice_seen_at" not in info:
            info["notice_seen_at"] = now
            self.syncs.sync(att, job, info, urgent=True)  # first: the newest checkpoint is what the reclaim would take
            self._on_notice(att, job, info, hb["notice"], now)
        elif isinstance(info.get("notice"), dict) and "successor" not in info["notice"]:
            self._successor_on_notice(att, job, info, now)  # a daemon died between the notice and its successor
        if ex is None and hb and mono - seen[1] > self.cfg.daemon.heartbeat_timeout_s:
            self._lost(att, job, provider, inst, "heartbeat lost (stale)")
            return
        if ex is None and info.pop("loss_seen_at", None) is not None:
            # Healthy again after a loss seen: a later one waits for its pull afresh, and the loss's own pull, if
            # one ran, is taken as a periodic sync (held as a last one, it blocked every sync after it).
            info.pop("loss_synced", None)
            self.syncs.forget_final(att["id"])
        interval = float(job["spec"]["checkpoint"]["interval_minutes"]) * 60.0
        sync_every = min(interval, max(self.cfg.daemon.tick_s, interval / 2))
        noticed = 0 <= now - info.get("notice_seen_at", -math.inf) < NOTICE_SYNCS_S
        if noticed:
            sync_every = 0.0  # until the reclaim: whatever the trainer writes comes home as soon as it is there
        since_sync = now - info.get("last_sync_at", 0)
        if ex is None and (since_sync >= sync_every or since_sync < 0):  # < 0: the clock went back
            self.syncs.sync(att, job, info, urgent=noticed)
        if ex is not None:
            if not self.syncs.final(att, job, info):  # its last sync first, beside the tick: what follows ends it
                with self.store.tx() as conn:
                    self.store.set_attempt_info(att["id"], info, conn)
                return
            reason = ex.get("reason")
            info["final_synced"] = True  # whatever follows: a loss does not pull again
            if reason == "completed" and ex.get("exit_code") == 0:
                with self.store.tx() as conn:
                    move(conn, att, A.FINISHING, info=info)
            elif reason == "notice":
                self._lost(att, job, provider, inst, "spot interruption notice", info=info)
            elif reason == "terminated":  # not by us: a running attempt's stop goes through _stop
                self._lost(att, job, provider, inst, STOPPED_OUTSIDE, info=info)
            else:
                self.stop(att, job, provider, exit_reason(self.app, job, ex, prefix="job exited"),
                           outcome=A.FAILED, info=info)
            return
        if not 0 <= now - info.get("market_checked_at", 0) < self.cfg.daemon.market_check_s:
            info["market_checked_at"] = now
            move_to = self._market_move(att, job, provider, now)
            kept = None
            if move_to is not None and move_to[1].get("probe"):
                kept = probe_spot(self, att, job, provider, move_to[1], now) if probe_due(job, now) else None
                if kept is None:
                    move_to = None  # spot would be worth it, but is not seen up (or the next probe is not due)
            if move_to is not None:
                target, why = move_to
                # From now on the job holds the rest of its run at the other market's rate: the stop may take
                # minutes (the last checkpoint, its pull), and decisions meanwhile must not count the old price.
                rate = float(why["on_demand_usd_h" if target is Market.ON_DEMAND else "spot_usd_h"])
                hold = self.budget.hold_usd(job, rate, float(info.get("billing_minimum_s", 60.0)), now)
                with self.store.tx() as conn:
                    self.store.set_hold(job["id"], hold, conn)
                    self.app.events.emit("attempt.market_switch", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                         to=target.value, market_policy=why, hold_usd=round(hold, 4))
                self.stop(att, job, provider, TO_ON_DEMAND if target is Market.ON_DEMAND else TO_SPOT, info=info)
                if kept is not None:
                    self._advance(kept, job)  # make before break: the kept probe takes over now, not next tick
                return
        with self.store.tx() as conn:
            self.store.set_attempt_info(att["id"], info, conn)

    def _market_move(self, att: dict[str, Any], job: dict[str, Any], provider: Provider, now: float
                     ) -> tuple[Market, dict[str, Any]] | None:
        """The market the spot policy moves this running attempt to, with what that rests on; else None."""
        try:
            offers = self.offers.get(att["provider"], provider, now)
        except ProviderError:
            return None  # no prices to weigh: asked again next time
        offer = next((o for o in offers if o.instance_type == att["instance_type"]), None)
        if offer is None:
            return None
        return attempt_should_move(self.app, job, att["provider"], offer, Market(att["market"]), now)

    def wind_down(self, att: dict[str, Any], job: dict[str, Any], provider: Provider, reason: str) -> None:
        """Stop an attempt for `reason` (revert-local, the budget, max run time, a kept probe); but a run that has
        already exited 0 is finished instead: its final checkpoint and outputs come home and it succeeds. Stopped,
        its end would be thrown away and the job run again (revert-local held one that does not fit locally, and
        `burst-enable` then rented an instance to finish nothing). A cancelled job is stopped whatever its run did."""
        # One look at the supervisor a tick, for both questions: did the run end well, and has a stop under way ended
        # (a cancel asks only the second, and a stop asked now looks after its SIGTERM).
        needed = reason != "cancelled" or "stop_requested_at" in att["info"]
        status = (self._supervisor_status(att),) if att["state"] == A.RUNNING.value and needed else None
        if reason != "cancelled" and self._has_completed(att, status[0] if status else None):
            self._step_finishing(att, job, provider, stop_reason=reason)
        else:
            self.stop(att, job, provider, reason, seen=status)

    def _supervisor_status(self, att: dict[str, Any]) -> dict[str, Any] | None:
        """The supervisor's status; None when it cannot be asked (SSH unreachable, an unreadable answer)."""
        try:
            return self.cloud_steps.status(att)
        except Exception:
            return None

    def _has_completed(self, att: dict[str, Any], status: dict[str, Any] | None) -> bool:
        """Whether the attempt's run ended with exit 0, by its supervisor's `status` (moving a running attempt that
        the daemon has not yet seen exit to finishing). No status is no news of an end: the stop goes on as asked."""
        if att["state"] == A.FINISHING.value:
            return True
        if att["state"] != A.RUNNING.value:
            return False
        ex = (status or {}).get("exit") or {}
        if ex.get("reason") != "completed" or ex.get("exit_code") != 0:
            return False
        with self.store.tx() as conn:
            return move(conn, att, A.FINISHING, info={**att["info"], "last_seen_at": self.clock()})

    def _step_finishing(self, att: dict[str, Any], job: dict[str, Any], provider: Provider, *,
                        stop_reason: str | None = None) -> None:
        """Bring the final checkpoint and outputs home (the run's last sync, beside the tick: `AttemptSyncs.final`; the
        running step's, or one of this step's own), then end the attempt as succeeded. Until both are home the
        instance is kept and a last sync started again each tick; with a `stop_reason` it is tried once, then the
        attempt is stopped for it (the job resumes from what is home)."""
        info = dict(att["info"])
        chaos_point("finishing")
        if not info.get("final_synced"):
            if not self.syncs.final(att, job, info):
                with self.store.tx() as conn:
                    self.store.set_attempt_info(att["id"], info, conn)
                return  # looked at again next tick
            info["final_synced"] = True
        what = "its final checkpoint" if "sync_error" in info else None
        if what is None and not self.syncs.outputs_home(att, job, info):
            what = "its outputs"
        if what is not None:
            info.pop("final_synced")  # the next look starts another last sync
            if stop_reason is not None:
                self.stop(att, job, provider, stop_reason, info=info)
            else:
                self._final_pull_failed(att, job, provider, info, what=what)
            return
        self.cloud_steps.release_s3(att, job)  # the final checkpoint is home: the S3 copies are no longer needed
        speed = (info.get("metrics") or {}).get("throughput_units_h")
        if speed and info.get("gpu"):
            # Measured s_R (per GPU) for this job's name on this GPU type: later decisions of the same job use it.
            with self.store.tx() as conn:
                conn.execute(insert(s.measurements).values(
                    ts=self.clock(), provider=att["provider"], instance_type=throughput_key(info["gpu"], job["name"]),
                    metric="throughput_units_h", value=float(speed) / max(1, int(job["spec"].get("gpus", 1)))))
        self.stop(att, job, provider, "completed", outcome=A.SUCCEEDED, info=info)

    def _final_pull_failed(self, att: dict[str, Any], job: dict[str, Any], provider: Provider,
                           info: dict[str, Any], what: str) -> None:
        """The job finished on the instance but `what` is not home: the instance is kept and the pull retried every
        tick (the budget cap and max_run_hours still stop it), unless the instance is gone or unreachable past the
        heartbeat timeout, which is a loss: the job resumes from what is home."""
        now = self.clock()
        try:
            inst = provider.describe([att["instance_id"]]).get(att["instance_id"])
        except UNANSWERED:
            inst = None  # nothing known of the instance: SSH says whether it is there, below
        except CANNOT_ASK as exc:
            self._provider_refused(att, job, exc, info)
            inst = None
        else:
            if inst is None or inst.state.gone:
                self._lost(att, job, provider, inst, f"instance gone before {what} came home", info=info)
                return
            self._provider_answers(att, job, info)
        if self.cloud_steps.status(att) is not None:
            info["last_seen_at"] = now
        elif now - info.get("last_seen_at", now) > self.cfg.daemon.heartbeat_timeout_s:
            self._lost(att, job, provider, inst, f"heartbeat lost (SSH unreachable) before {what} came home",
                       info=info)
            return
        with self.store.tx() as conn:
            self.store.set_attempt_info(att["id"], info, conn)

    def _on_notice(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], notice: Any,
                   now: float) -> None:
        """The supervisor saw a spot interruption notice (and told the trainer to write a last checkpoint). Said at
        once. The newest complete checkpoint the instance holds is on its way home beside the tick (`_step_running`
        started it, and starts another each tick until the reclaim: the trainer's last one may be written
        meanwhile), and, make before break, the next instance is launched now: a multi-GB pull then holds up neither
        its launch nor any other attempt's notice. `info` is persisted by the caller, `_step_running`."""
        when = notice.get("time") if isinstance(notice, dict) else None
        home = job.get("checkpoint")
        info["notice"] = {"reclaim_at": when}
        with self.store.tx() as conn:
            # Said in the transaction that writes it down: a daemon killed between the two said it again on restart.
            self.app.events.emit("instance.interruption_notice", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                 instance=att["instance_id"], provider=att["provider"], reclaim_at=when,
                                 last_checkpoint_home=home)
            chaos_point("notice-said")  # said, not yet committed with the notice
            self.store.set_attempt_info(att["id"], info, conn)
        chaos_point("notice-written")  # the notice is written down, its successor not yet
        self._successor_on_notice(att, job, info, now)

    def _successor_on_notice(self, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any],
                             now: float) -> None:
        """Make before break for a noticed attempt whose successor is not decided yet (`info.notice` has no
        `successor`): at the notice, or at the next tick of any daemon after one that died in between. A successor
        already written (the daemon died before noting its id) is noted, not written again; otherwise the next
        instance is written and launched now (`launch_successor`; None when it waits for the reclaim). Persisted
        here: `info` is also the caller's to persist."""
        notice = info["notice"] = dict(info["notice"])
        notice["successor"] = written_successor(self, att) or launch_successor(self, att, job, now)
        with self.store.tx() as conn:
            self.store.set_attempt_info(att["id"], info, conn)
            self.store.update_job(job["id"], conn, expect_state=JobState.RUNNING.value,
                                  reason=notice_reason(att, info, job.get("checkpoint")))
        if notice["successor"]:
            self._advance_new_attempt(job["id"])  # launched now, not a tick later: every second of boot counts

    def _lost(self, att: dict[str, Any], job: dict[str, Any], provider: Provider, inst: InstanceInfo | None,
              reason: str, info: dict[str, Any] | None = None) -> None:
        """A preemption, seen by the provider's state, the notice, or heartbeat loss. A sync of the attempt's under way
        (a notice's, most often, when the reclaim comes) is waited for, tick by tick, up to the heartbeat timeout:
        what it brings home is then not counted as lost work, and the next run resumes from it."""
        now = self.clock()
        info = dict(info or att["info"])
        if inst is not None and not inst.state.gone and not info.get("loss_synced") and not info.get("final_synced"):
            # The instance is still there (its trainer stopped outside, its heartbeat went stale, SSH dropped): one
            # last pull of what it wrote since the last sync, beside the tick, before it goes. Bounded by the
            # transfers' own stall timeouts, and by LOSS_PULL_MAX_S (watched: no pull runs while nobody does) for one
            # that trickles.
            since = info.setdefault("loss_seen_at", now)
            pulling = since <= now and self.watch.watched_s(since, now) < LOSS_PULL_MAX_S
            if pulling and not self.syncs.final(att, job, info, outputs=False):
                with self.store.tx() as conn:
                    self.store.set_attempt_info(att["id"], info, conn)
                return  # looked at again next tick
            info["loss_synced"] = True
        elif self.syncs.pool.busy(att["id"]) and not self.syncs.pool.finished_for(att["id"]):
            since = info.setdefault("loss_seen_at", now)
            if since <= now and self.watch.watched_s(since, now) < self.cfg.daemon.heartbeat_timeout_s:
                with self.store.tx() as conn:
                    self.store.set_attempt_info(att["id"], info, conn)
                return  # looked at again next tick; a sync still under way then is written down when it ends
        self.syncs.take_finished(att, job, info)
        # The trainer's last checkpoint on a notice came home with its last sync (`AttemptSyncs.final`) before this.
        if (self.cloud_steps.checkpoints_outlive_instance({**att, "info": info}, job)
                and not self.syncs.pool.busy(att["id"])):
            # What the instance uploaded to S3 is there still. A pull from the gone instance still hanging past the
            # wait is not waited for in the tick: the next attempt starts from S3 in-region all the same.
            self.syncs.pull_now(att, job, info)
        # What the instance held that is not home now went with it: said, with what the job goes back to.
        home = checkpoints.latest(self.cfg, job["id"], deep=False)
        lost = checkpoints.lost_with_instance(info.get("instance_checkpoint"), home.name if home else None)
        if lost is not None:
            info["checkpoint_lost"] = {"checkpoint": lost, "resumes_from": home.name if home else None}
        last_ckpt = info.get("last_checkpoint_at") or att["started_at"] or now
        # Up to when the loss was seen, not the end of its last pull. Rounded once, here: the attempt,
        # instance.preempted and job.resuming then say the same figure.
        seen = min(now, float(info.get("loss_seen_at") or now))
        lost_h = round(max(0.0, seen - last_ckpt) / 3600.0, 4) if att["started_at"] else 0.0
        with self.store.tx() as conn:
            moved = move(conn, att, A.TERMINATING, info={**info, "outcome": A.PREEMPTED.value, "stop_reason": reason,
                                                         "lost_counted_to": seen},
                         lost_work_h=lost_h, reason=reason)
            if moved:
                self.app.events.emit("instance.preempted", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                     instance=att["instance_id"], provider=att["provider"],
                                     lost_work_h=lost_h, reason=reason)
                if lost is not None:
                    back_to = home.name if home else None
                    self.app.events.emit(
                        "checkpoint.lost", job_id=job["id"], attempt_id=att["id"], conn=conn, checkpoint=lost,
                        resumes_from=back_to, instance=att["instance_id"], provider=att["provider"],
                        reason=f"{lost} did not come home before the instance was lost ({reason}); the job "
                               f"resumes from {back_to or 'the start (no checkpoint is home)'}")
        if moved:
            self.step_terminating(att, job, provider)

    def stop(self, att: dict[str, Any], job: dict[str, Any], provider: Provider, reason: str, *,
              outcome: AttemptState = A.ABORTED, info: dict[str, Any] | None = None,
              seen: tuple[dict[str, Any] | None] | None = None) -> None:
        """`seen`: the supervisor's status as read this tick, if it was; a stop asked before this call looks at that
        instead of asking again (one asked now looks afresh, after the SIGTERM). A running attempt's stop ends over
        several ticks, none held up: the trainer's last checkpoint is waited for, then brought home beside the tick
        (`AttemptSyncs.final`), then the instance goes."""
        info = dict(info or att["info"])
        if att["state"] == A.RUNNING.value and outcome is A.ABORTED:
            now = self.clock()
            asked_before = "stop_requested_at" in info
            if not asked_before:
                # Why, written before the trainer is told: a daemon killed while it writes its last checkpoint finds
                # the reason on restart and goes on with this stop, instead of taking the exit for a preemption.
                info.update(stopping_for=reason, stop_requested_at=now)
                with self.store.tx() as conn:
                    self.store.set_attempt_info(att["id"], info, conn)
                att["info"] = info
                try:  # a last checkpoint: SIGTERM through the supervisor
                    self.cloud_steps.request_checkpoint(att)
                except Exception as exc:
                    self.emit("attempt.last_checkpoint_failed", job_id=job["id"], attempt_id=att["id"],
                              error=self.app.redactor(f"{type(exc).__name__}: {exc}"))
            # Its grace (checkpoint.stop_grace_s) and a margin, looked at tick by tick: no other attempt waits.
            if 0 <= now - float(info["stop_requested_at"]) < stop_wait_s(job["spec"]) and not _run_over(
                    seen[0] if asked_before and seen is not None else self._supervisor_status(att)):
                return  # it writes its last checkpoint: looked at again next tick, other attempts not held up
            if not self.syncs.final(att, job, info, outputs=False):  # the last checkpoint home, then the instance goes
                with self.store.tx() as conn:
                    self.store.set_attempt_info(att["id"], info, conn)
                return
        else:
            self.syncs.take_finished(att, job, info)
        with self.store.tx() as conn:
            moved = move(conn, att, A.TERMINATING, info={**info, "outcome": outcome.value, "stop_reason": reason},
                         reason=reason)
            if moved:
                self.app.events.emit("attempt.stopping", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                     reason=reason, outcome=outcome.value)
        if moved:  # else another process moved it first (a finished run's outputs pull, say): its step goes on
            self.step_terminating(att, job, provider)

    def step_terminating(self, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> None:
        """Terminate the instance and end the attempt once the provider confirms it gone (a `terminating` attempt's
        step, and a `released` one's, whose job has already gone on): `gone.confirmed_gone`, as for every instance
        confirmed gone. A provider that does not answer, after revert-local, may release the job first
        (`release_if_home`); the failure is raised all the same, counted and tried again (`_step_failed`). One that
        never answers again leaves it to the operator (`burstctl confirm-gone`)."""
        started = time.monotonic()
        inst_id = att["instance_id"]
        if inst_id:
            try:
                provider.terminate([inst_id])
                chaos_point("terminating")  # asked to terminate, not yet confirmed gone nor billed
                inst = provider.describe([inst_id]).get(inst_id)
            except (*UNANSWERED, *CANNOT_ASK):
                if att["state"] == A.TERMINATING.value and not burst_enabled(self.app):  # else no SSH look: moot
                    self.release_if_home(att, job)
                raise
            if inst is not None and not inst.state.gone:
                return  # confirmed next tick
        now = self.clock()
        with self.store.tx() as conn:  # what waited for it goes on: the attempt's end, its job's next step
            confirmed_gone(self.app, conn, att["provider"], inst_id, gone_at=now, now=now, attempt=att, job=job,
                           teardown_s=time.monotonic() - started if inst_id else None)

    def release_if_home(self, att: dict[str, Any], job: dict[str, Any]) -> bool:
        """A terminating attempt whose provider does not answer (or refuses) its terminate: after revert-local, its
        job is released to this machine when nothing of it is left on the instance (`core/release.py`): the attempt
        goes `released` and its job takes, now, the step its end would have given it (requeued locally, resuming).
        The instance is still terminated, and metered, until the provider confirms it gone. Otherwise why not is
        written down (RELEASE_HELD, said once as `attempt.release_held`) for the job's reason. Returns whether it was
        released."""
        info = att["info"]
        if not releasable(str(info.get("outcome", A.ABORTED.value)), info.get("stop_reason")) \
                or self.syncs.pool.busy(att["id"]):
            return False  # as `decide_release` would say, without the SSH look below (up to ~35 s, at each try)
        status = self._supervisor_status(att) if att["instance_id"] else None
        run = RunSeen.UNREACHABLE if status is None else RunSeen.STOPPED if _run_over(status) else RunSeen.RUNNING
        # Decided and moved under the job's store lock, which every pull holds while it writes there (the daemon's,
        # revert-local's): a pull either brought its checkpoint home before (counted as home here) or, after, finds
        # the attempt released and brings nothing (`CloudSteps.pull`). Not waited for: a pull under way is looked at
        # again at the next try.
        with checkpoints.try_store_lock(self.cfg, job["id"]) as free:
            return self._release_locked(att, job, status, run, pulling=not free or self.syncs.pool.busy(att["id"]))

    def _release_locked(self, att: dict[str, Any], job: dict[str, Any], status: dict[str, Any] | None,
                        run: RunSeen, *, pulling: bool) -> bool:
        """`release_if_home`, its job's store locked (unless `pulling`: then it is not released now)."""
        info = dict(att["info"])
        hb, ex = (status or {}).get("heartbeat") or {}, (status or {}).get("exit") or {}
        on_instance = checkpoints.newest_name(info.get("instance_checkpoint"), hb.get("last_checkpoint"),
                                              ex.get("last_checkpoint"))
        home = checkpoints.latest(self.cfg, job["id"], deep=False)
        verdict = decide_release(ReleaseFacts(
            bursting_enabled=burst_enabled(self.app), outcome=str(info.get("outcome", A.ABORTED.value)),
            stop_reason=info.get("stop_reason"), provider_answers=False, run=run, on_instance=on_instance,
            home=home.name if home else None, pull_under_way=pulling,
            resume_from_home=bool(self.store.get_setting(RESUME_FROM_HOME_KEY))))
        if not verdict.release:
            if verdict.held is not None and info.get(RELEASE_HELD) != verdict.held:
                info[RELEASE_HELD] = verdict.held
                with self.store.tx() as conn:
                    self.store.set_attempt_info(att["id"], info, conn)
                    self.app.events.emit("attempt.release_held", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                         instance=att["instance_id"], provider=att["provider"], why=verdict.held)
                att["info"] = info
            return False
        info.pop(RELEASE_HELD, None)
        info.update(released_at=self.clock(), released_with=home.name if home else None, released_run=run.value)
        with self.store.tx() as conn:
            moved = move(conn, att, A.RELEASED, info=info)
            if moved:
                self.app.events.emit("attempt.released", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                     instance=att["instance_id"], provider=att["provider"], run=run.value,
                                     checkpoint=home.name if home else None,
                                     reason="the provider does not answer its terminate: the job goes on without "
                                            "it, and the instance is terminated once the provider answers")
                self._after_attempt(conn, att, job, A(info.get("outcome", A.ABORTED.value)), att.get("reason"))
        return moved

    def _close_instance(self, conn: Any, att: dict[str, Any], inst_id: str, now: float) -> None:
        """The attempt's instance is gone (`gone.close_instance`), the attempt ended by the caller."""
        close_instance(self.app, conn, att["provider"], inst_id, gone_at=now)

    def _after_attempt(self, conn: Any, att: dict[str, Any], job: dict[str, Any], outcome: AttemptState,
                       reason: str | None) -> None:
        """What an ended attempt means for its job."""
        job_after_end(self.app, conn, att, job, outcome, reason, self.clock())

    def _measure(self, conn: Any, att: dict[str, Any], metric: str, value: float, key: str | None = None) -> None:
        """A measurement of the attempt's instance type (or of `key`: a job name's, say)."""
        conn.execute(insert(s.measurements).values(ts=self.clock(), provider=att["provider"] or "local",
                                                   instance_type=key or att["instance_type"] or "local",
                                                   metric=metric, value=float(value)))


def _run_over(status: dict[str, Any] | None) -> bool:
    """Whether a supervised run has ended, by its supervisor's status (None, it cannot be asked: nothing to wait
    for then)."""
    return status is None or status.get("exit") is not None or not status.get("supervisor_alive")


def refused_problem(provider: str, kind: str, error: str, instance: str | None, state: str) -> str:
    """What is said of an attempt whose provider refuses to be asked about its instance (CANNOT_ASK, `kind` its
    category): the provider, what it refused, what becomes of the instance meanwhile, and what to do."""
    what, fix = {
        "AuthFailed": ("its API key or credentials were refused",
                       "fix the key (`burstctl providers` shows which it reads and whether it is accepted)"),
        "QuotaExceeded": ("an account limit refused the call",
                          "raise the limit with the provider, or wait for it to reset"),
    }.get(kind, ("it refused the request as invalid", f"check [providers.{provider}] in the config (base_url, region)"))
    if state == A.TERMINATING.value:
        meanwhile = f"instance {instance} could not be terminated and may still run, and bill"
        then = "it is terminated, and the attempt ends, once the provider answers"
    elif state == A.PROVISIONING.value:
        meanwhile = f"instance {instance} is left booting (where to reach it comes from the provider)"
        then = "burstctl cannot stop it, or see when it stops billing, until then"
    else:
        meanwhile = f"instance {instance} keeps running and is watched over SSH, its checkpoints still come home"
        then = "burstctl cannot stop it, or see when it stops billing, until then"
    return f"providers.{provider}: {what} ({kind}: {error}): {meanwhile}; {fix} — {then}"
