"""The reconcile loop: every tick, compare what the database says should be happening with what is observed
(the provider, the instance over SSH, the local supervisor) and take at most one idempotent step per attempt.

Level-triggered, like a Kubernetes controller: a tick knows nothing the database does not, so a daemon killed at any
point and restarted carries on where it was. Every step is a compare-and-set on the attempt's state
(`machine.move`), so a step repeated after a crash is harmless: a launch is preceded by a look-up by tag/name, a
terminate of a gone instance is success, a supervisor start is idempotent on the instance.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, func, insert, or_, select, update

from orchestrator.app import App, burst_enabled
from orchestrator.core.budget import month_key, stop_horizon_h
from orchestrator.core.decision import UNMEASURED_SETUP
from orchestrator.core.local_hours import LocalHours
from orchestrator.core.sizing import gb_and_gib
from orchestrator.errors import format_validation_error
from orchestrator.jobspec import JobSpec, ModelSpec
from orchestrator.lifecycle import checkpoints, passenv
from orchestrator.lifecycle.attempt_syncs import CLOSE_WAIT_S, AttemptSyncs, notice_reason
from orchestrator.lifecycle.finish import NEVER_CAME_UP, exit_reason, requeued_local_reason
from orchestrator.lifecycle.local import STOPPED_OUTSIDE, LocalRunner, stop_grace_s, stop_wait_s
from orchestrator.lifecycle.machine import ACTIVE_ATTEMPT_STATES, AttemptState, active_attempts, move
from orchestrator.lifecycle.machine import create as create_attempt
from orchestrator.lifecycle.market_switch import (
    TO_ON_DEMAND,
    TO_SPOT,
    attempt_should_move,
    cloud_attempts,
    cloud_hours_done,
    market_for_attempt,
    record_spot_listings,
    spot_region_order,
)
from orchestrator.lifecycle.orphans import sweep_orphans
from orchestrator.lifecycle.schedule import watch_schedule
from orchestrator.lifecycle.spot_probe import is_probe, kept_probe_for, probe_due, probe_spot, step_probe
from orchestrator.lifecycle.states import JobState, awaits_approval
from orchestrator.lifecycle.successor import launch_successor, successor_of, waits
from orchestrator.queue import headline, local_hours, local_time, record_offers_seen, setup_key, throughput_key
from orchestrator.records import supersede, superseded
from orchestrator.remote.ssh import HostKeyMismatch
from providers.base import (
    LAUNCH_REFUSALS,
    InstanceInfo,
    InstanceState,
    LaunchRequest,
    Market,
    NoCapacity,
    Offer,
    OwnerTags,
    Provider,
    ProviderError,
    category,
)
from state import schema as s
from state.schema import planned_rented_usd

if TYPE_CHECKING:
    from orchestrator.config import Config
    from orchestrator.lifecycle.cloud_steps import CloudSteps

A = AttemptState
MAX_STEP_ERRORS = 5
# Why a queued local (or hybrid) job has not started: the local GPU is busy, or outside local.available_hours.
LOCAL_GPU_BUSY = "waiting for the local GPU"
LOCAL_GPU_HOURS = "waiting for the local GPU's hours (local.available_hours)"
MAX_STEPS_PER_TICK = 4  # intent → provisioning → bootstrapping → running in one tick when nothing waits
LACKING_ENV_FORGET_S = 60.0  # how long a job lacking its pass_env is left out of the candidates before a new look
LACKING_ENV_KEPT = 2000  # at most this many left out (each is a row more that the candidates' query reads)
BOOT_WAIT_S, BOOT_POLL_S, BOOT_WAIT_WINDOW_S = 1.0, 0.2, 15.0  # brief in-tick polling of a just-launched instance
CHAOS_ENV = "BURSTCTL_CHAOS_KILL_AT"
CHAOS_POINTS = ("before-launch", "after-launch", "finishing", "terminating")
LOSS_PULL_MAX_S = 1800.0  # a lost run's last pull from an instance still there, at most (stalls end it sooner)
NOTICE_SYNCS_S = 300.0  # after a spot notice, a sync each tick for this long (EC2 reclaims in 120 s, GCP in 30 s)


def chaos_point(name: str) -> None:
    """Test-only crash injection (tests/test_chaos.py): the process dies on the spot, like SIGKILL, when
    BURSTCTL_CHAOS_KILL_AT names this point. Inert unless that variable is set."""
    if os.environ.get(CHAOS_ENV) == name:
        os._exit(137)


@dataclass
class OfferCache:
    """Offers per provider, refreshed at most every `ttl_s` (a cache of observed state, not state)."""

    ttl_s: float = 60.0
    on_refresh: Callable[[str, list[Offer], float], None] | None = None  # e.g. keep the spot capacity listed
    _at: dict[str, float] = field(default_factory=dict)
    _offers: dict[str, list[Offer] | ProviderError] = field(default_factory=dict)

    def get(self, name: str, provider: Provider, now: float) -> list[Offer]:
        """Offers, or the provider's error, at most once per ttl: an unreachable cloud is not asked every tick."""
        if now - self._at.get(name, -math.inf) > self.ttl_s:
            try:
                self._offers[name] = provider.offers()
            except ProviderError as exc:
                self._offers[name] = exc
            self._at[name] = now
            fresh = self._offers[name]
            if self.on_refresh is not None and not isinstance(fresh, ProviderError):
                self.on_refresh(name, fresh, now)
        got = self._offers[name]
        if isinstance(got, ProviderError):
            raise got
        return got

    def health(self) -> dict[str, bool]:
        return {n: not isinstance(v, ProviderError) for n, v in self._offers.items()}

    def checked_at(self) -> float | None:
        """When the least recently asked provider was last asked (None before any was)."""
        return min(self._at.values()) if self._at else None

    def forget(self, name: str) -> None:
        self._at.pop(name, None)


def _opens(cfg: Config, hours: LocalHours, now: float) -> str:
    """When the local GPU's hours begin, in their own zone: "Sat 00:00 (Europe/Berlin)"."""
    change = hours.until_change_h()
    if change is None:
        return "now"
    at = local_time(cfg, now + change * 3600.0)
    return f"{at:%a %H:%M} ({cfg.local.timezone or at.tzname()})"


def _gpus_named(spec: dict[str, Any]) -> str:
    """The GPUs a job can rent, as its reasons name them: "1×H100, 1×A100"."""
    return ", ".join(f"{spec['gpus']}×{g}" for g in spec["rented_throughput"])


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
        self.local = LocalRunner(app, hand_over_held=self._hand_over_held)
        self.cloud = cloud  # CloudSteps: SSH, runbooks, syncs (None: the cloud is not configured)
        self.offers = OfferCache(ttl_s=self.cfg.daemon.offers_ttl_s, on_refresh=self._offers_listed)
        self._heartbeats: dict[str, tuple[Any, float]] = {}  # attempt id → (heartbeat ts, monotonic when it changed)
        self.unavailable: dict[str, str] = {}  # enabled providers that cannot be used → why (`build_reconciler`)
        self.tick_s = self.cfg.daemon.tick_s  # the daemon's (`daemon --tick` sets it apart from the config's)
        self.syncs = AttemptSyncs(app, lambda: self.cloud_steps, clock, self._measure)
        # Jobs whose pass_env this process cannot give (`_lacks_passed_env`), left out of the candidates a tick
        # reads: any number of them, due first, then hides no job that can start. The process's environment is its
        # own for life, but `retry --reread` may change a job's pass_env: forgotten every LACKING_ENV_FORGET_S.
        self._lacking_env: set[str] = set()
        self._lacking_env_since = 0.0

    @property
    def cloud_steps(self) -> CloudSteps:
        """`cloud`, for an attempt on a provider: configured whenever a provider is (`service.build_reconciler`)."""
        if self.cloud is None:
            raise RuntimeError("no cloud steps: the cloud is not configured")
        return self.cloud

    def carry_over(self, before: Reconciler) -> None:
        """Take over from the reconciler this one replaces (a config reload): when each heartbeat last moved, and
        the syncs in flight."""
        self._heartbeats = before._heartbeats
        self.syncs.carry_over(before.syncs)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Once the ticks are over (the daemon stops, revert-local is done): the syncs in flight, waited for and
        written down (`AttemptSyncs.close`)."""
        self.syncs.close(wait_s)

    def abandon(self) -> None:
        """Once the ticks are over and nothing may be written down (`AttemptSyncs.abandon`)."""
        self.syncs.abandon()

    # --- the tick -----------------------------------------------------------------------------------------
    def tick(self) -> None:
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
        self._schedule()

    def _advance(self, att: dict[str, Any], job: dict[str, Any]) -> None:
        """Step an attempt, and keep stepping it within this tick while each step moves it on: a launch is
        followed at once by the look at the instance, a reachable instance at once by its bootstrap. A step that
        leaves the state as it was is waiting on the outside world; the next tick looks again."""
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
                self._step_failed(att, job, exc)
                return
            with self.store.engine.connect() as c:
                row = c.execute(select(s.attempts).where(s.attempts.c.id == att["id"])).mappings().first()
                fresh_job = c.execute(select(s.jobs).where(s.jobs.c.id == job["id"])).mappings().first()
            if row is None or AttemptState(row["state"]).final or fresh_job is None:
                return
            att, job = dict(row), dict(fresh_job)
            if att["info"].get("errors"):  # a step went through: the failures counted were not consecutive
                att["info"] = {k: v for k, v in att["info"].items() if k not in ("errors", "last_error")}
                self.store.set_attempt_info(att["id"], att["info"])
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
        error = self.app.redactor(str(exc))[:500]
        self.emit("attempt.host_key_mismatch", job_id=job["id"], attempt_id=att["id"], instance=att["instance_id"],
                  error=error)
        provider = self.providers.get(att["provider"])
        if provider is None or att["state"] == A.TERMINATING.value:
            return
        try:
            self._stop(att, job, provider, "host key changed", outcome=A.ABORTED)
        except Exception as exc2:
            self._step_failed(att, job, exc2)

    def _step_failed(self, att: dict[str, Any], job: dict[str, Any], exc: Exception) -> None:
        """Count consecutive failures of the same step; after MAX_STEP_ERRORS the attempt is given up."""
        error = self.app.redactor(f"{type(exc).__name__}: {exc}")[:500]
        info = dict(att["info"])
        same = info.get("last_error") == error
        info["errors"] = int(info.get("errors", 0)) + 1
        info["last_error"] = error
        with self.store.tx() as conn:
            self.store.set_attempt_info(att["id"], info, conn)
            if not same:  # repeated identical errors are counted, not re-logged every tick
                self.app.events.emit("attempt.error", job_id=att["job_id"], attempt_id=att["id"], conn=conn,
                                     state=att["state"], error=error, count=info["errors"])
        att["info"] = info
        if info["errors"] < MAX_STEP_ERRORS:
            return
        reason = f"gave up after {info['errors']} failed steps: {error}"
        if att["where"] == "cloud" and att["state"] == A.INTENT.value and info.get("launch_tried"):
            # Whether its launch made an instance is not known until the provider answers: given up now, one it made
            # would run, and bill, with no row or charge of ours until the sweep found it. It waits, and says so.
            self._note(job, f"the outcome of its launch on {att['provider']} is not known yet: {error}; asked "
                            "again each tick until the provider answers", same_as="the outcome of its launch")
            return
        if att["where"] == "local" and att["state"] != A.INTENT.value and not self.local.end_trainer(att):
            return  # its trainer still runs: given up once it is gone, not before (the next error tries again)
        if att["where"] == "local" or att["state"] == A.INTENT.value:
            outcome = A.LAUNCH_FAILED if att["where"] == "cloud" else A.FAILED
            with self.store.tx() as conn:
                if move(conn, att, outcome, reason=reason):
                    self._after_attempt(conn, att, job, outcome, reason)
            return
        provider = self.providers.get(att["provider"])
        if provider is not None and att["state"] != A.TERMINATING.value:
            try:
                self._stop(att, job, provider, reason, outcome=A.FAILED)
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

    # --- scheduling -------------------------------------------------------------------------------------------
    def _schedule(self) -> None:
        """Start what the free slots allow, earliest deadline first: local (and hybrid) jobs on the local GPU, then
        cloud jobs; then decide blocked jobs again and record the cloud's health."""
        now = self.clock()
        if now - self._lacking_env_since > LACKING_ENV_FORGET_S:
            self._lacking_env, self._lacking_env_since = set(), now
        while True:  # read again while jobs that lack their pass_env were found in the window (and left out)
            lacking = len(self._lacking_env)
            n_local, n_cloud, ready = self._ready(now)
            ready = [j for j in self._readable(ready) if not self._lacks_passed_env(j)]
            if len(self._lacking_env) == lacking:
                break
        local_free = self.cfg.daemon.local_concurrency - n_local
        cloud_free = self.cfg.daemon.max_cloud_attempts - n_cloud
        # Local work first: it must never wait behind a slow or unreachable cloud.
        hours = local_hours(self.cfg, now)
        local_open = hours.is_open()
        started: set[str] = set()
        for job in ready:
            if job["placement"] not in ("local", "hybrid"):
                continue
            if local_open and not _room_to_run(job, hours):
                self._note(job, f"{LOCAL_GPU_HOURS}: it cannot checkpoint, so it is never paused, and its "
                           f"{_gpu_h(job):.2f} h do not fit before they end", same_as=LOCAL_GPU_HOURS)
            elif local_open and local_free > 0:
                if self.local.start(job):
                    local_free -= 1
                    started.add(job["id"])
            elif job["placement"] == "hybrid" and self.local.hand_over_if_due(job, now):
                continue  # placed on the cloud now: the loop below may start its attempt this tick
            else:  # said, so that a queued job does not look stuck (its reason was its decision's last word)
                if not local_open:
                    self._note(job, f"{LOCAL_GPU_HOURS}: they begin {_opens(self.cfg, hours, now)}",
                               same_as=LOCAL_GPU_HOURS)
                else:
                    self._note(job, f"{LOCAL_GPU_BUSY}: {n_local + len(started)} local run(s) use its "
                               f"{self.cfg.daemon.local_concurrency} slot(s) (daemon.local_concurrency); it starts "
                               "when one ends", same_as=LOCAL_GPU_BUSY)
        self._redecide_late_in_line([j for j in ready if j["placement"] == "local" and j["state"] ==
                                     JobState.QUEUED.value and j["id"] not in started], now)
        for job in ready:
            if job["placement"] == "cloud" and cloud_free > 0 and self._start_cloud_attempt(job, now):
                cloud_free -= 1
                self._advance_new_attempt(job["id"])
        self._redecide_blocked(now)
        self._record_health(now)

    def _ready(self, now: float) -> tuple[int, int, list[dict[str, Any]]]:
        """The local and cloud attempts active, and the queued jobs without one that may start, earliest deadline
        first. Only as many as there are free slots (plus a margin) are read, so a tick stays cheap with 10,000
        queued jobs. The local GPU's and the cloud's are read apart: in one window, cloud jobs that cannot start
        (the cloud unreachable) hid every local job behind them. Jobs that wait for a time to launch (for spot, after
        a failed launch) are not read until then, for the same reason; a job moved home meanwhile (revert-local) is
        not kept waiting by it. Nor are those known to lack their pass_env."""
        with self.store.engine.connect() as c:
            busy_jobs = {r[0] for r in c.execute(
                select(s.attempts.c.job_id).where(s.attempts.c.state.in_(ACTIVE_ATTEMPT_STATES)))}

            def candidates(placements: tuple[str, ...], slots: int, *only: Any) -> list[dict[str, Any]]:
                # Those known to lack their pass_env are read and dropped here, not left out by the query: as many
                # bound ids as there are such jobs would pass SQLite's limit (999 before 3.32).
                return [dict(r) for r in c.execute(
                    select(s.jobs).where(s.jobs.c.state.in_([JobState.QUEUED.value, JobState.RESUMING.value]),
                                         s.jobs.c.placement.in_(placements), *only)
                    .order_by(s.jobs.c.deadline_at).limit(slots + 20 + len(self._lacking_env))).mappings()
                    if r["id"] not in self._lacking_env]

            ready = sorted(candidates(("local", "hybrid"), self.cfg.daemon.local_concurrency)
                           + candidates(("cloud",), self.cfg.daemon.max_cloud_attempts,
                                        or_(s.jobs.c.wait_until.is_(None), s.jobs.c.wait_until <= now)),
                           key=lambda j: float(j["deadline_at"] or math.inf))
            return (self.attempts_active("local", c), self.attempts_active("cloud", c),
                    [j for j in ready if j["id"] not in busy_jobs])

    def _readable(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The jobs whose stored spec validates; each other one fails, saying why. A job queued by an older
        burstctl may break a rule added since (a name shaped like a job id): raised in the middle of the schedule,
        it had stopped every launch and every decision again, every tick."""
        from pydantic import ValidationError

        from orchestrator.queue import spec_of

        readable = []
        for job in jobs:
            try:
                spec_of(job)
            except ValidationError as exc:
                problem = self.app.redactor(str(format_validation_error(exc, "its stored spec", JobSpec)))
                reason = (f"{problem}: it was queued by a burstctl that checked less; fix its job file, then "
                          "`burstctl retry` reads it again")
                with self.store.tx() as conn:
                    if self.store.update_job(job["id"], conn, expect_state=job["state"],
                                             state=JobState.FAILED.value, reason=reason):
                        self.app.events.emit("job.failed", job_id=job["id"], conn=conn, reason=reason)
            else:
                readable.append(job)
        return readable

    def _lacks_passed_env(self, job: dict[str, Any]) -> bool:
        """A job whose pass_env the daemon cannot give it waits (no instance is rented for it), saying which
        variable; it starts once the daemon is restarted with it."""
        problem = passenv.unusable(job["spec"])
        if problem is None:
            return False
        self._note(job, problem)
        if len(self._lacking_env) < LACKING_ENV_KEPT:
            self._lacking_env.add(job["id"])
        return True

    def attempts_active(self, where: str, conn: Connection | None = None) -> int:
        """Attempts not yet final `where` ("local" or "cloud"): what `local_concurrency` and `max_cloud_attempts`
        bound, spot probes included."""
        query = select(func.count()).select_from(s.attempts).where(
            s.attempts.c.where == where, s.attempts.c.state.in_(ACTIVE_ATTEMPT_STATES))
        if conn is not None:
            return int(conn.execute(query).scalar() or 0)
        with self.store.engine.connect() as c:
            return int(c.execute(query).scalar() or 0)

    def _record_health(self, now: float) -> None:
        """Whether each provider answers, asked at most once per `offers_ttl_s` even with no cloud job waiting, so
        that `status` is never an old answer; written (with when) only when the providers were asked again."""
        if not burst_enabled(self.app):
            return  # local-only: the cloud is not asked at all
        if not self.providers:  # none configured with credentials: `status` says so rather than burst-enabled
            if self.store.get_setting("cloud_health") != {}:
                with self.store.tx() as conn:
                    self.store.set_setting("cloud_health", {}, conn=conn)
                    self.store.set_setting("cloud_health_at", now, conn=conn)
                    self.app.events.emit("cloud.health", conn=conn, providers={})
            return
        for name, provider in self.providers.items():
            with contextlib.suppress(ProviderError):
                self.offers.get(name, provider, now)
        health, at = self.offers.health(), self.offers.checked_at()
        if not health or self.store.get_setting("cloud_health_at") == at:
            return
        with self.store.tx() as conn:
            if self.store.get_setting("cloud_health") != health:
                self.store.set_setting("cloud_health", health, conn=conn)
                self.app.events.emit("cloud.health", conn=conn, providers=health)
            self.store.set_setting("cloud_health_at", at, conn=conn)

    def _redecide_late_in_line(self, waiting: list[dict[str, Any]], now: float) -> None:
        """Queued local jobs that the line ahead of them now makes late (a more urgent job arrived after they were
        decided, or a run ahead took longer) are decided again, with the queue as it is: one whose deadline renting
        can still save goes to the cloud, a hybrid, or approval. One that stays local is asked again a
        `daemon.market_check_s` later. The line is walked through `local.available_hours`, as gate 2 walks it; a job
        that cannot checkpoint and that no stretch of them holds any more (they were cut after it was decided) is
        decided again too: waiting would be for ever."""
        from orchestrator.queue import context, local_backlog, record_decision, redecide

        if not waiting:
            return
        backlog = local_backlog(self.app, now, until=max(float(j["deadline_at"]) for j in waiting))
        hours = local_hours(self.cfg, now)
        late: list[tuple[dict[str, Any], bool]] = []  # (job, whether it can no longer run here at all)
        for job in waiting:
            asked = float(job["spec"].get("_late_in_line_at", 0.0))
            if 0 <= now - asked < self.cfg.daemon.market_check_s:
                continue
            planned = job["decision"]
            gpu_h = float(planned.get("t_local_h") or 0.0) * float(planned.get("local_share") or 1.0)
            finish_h = hours.finish_h(backlog.wait_h(job["deadline_at"], exclude=job["id"]), gpu_h,
                                      pauses=job["spec"]["checkpoint"].get("resumable", True))
            if finish_h is None or now + finish_h * 3600.0 > float(job["deadline_at"]) + 1.0:
                late.append((job, finish_h is None))
        if not late:
            return
        ctx = context(self.app, now)
        bursting = burst_enabled(self.app)
        for job, unfit in late:
            if not bursting and not unfit:  # local-only: here, late, is the one way left; asked again later
                self.store.update_job(job["id"], None, spec={**job["spec"], "_late_in_line_at": now})
                continue
            again = redecide(self.app, job, ctx, now, backlog=backlog)
            d = again.decision
            if d["placement"] == "local":  # renting cannot save it either: it runs here, late; asked again later
                self.store.update_job(job["id"], None, spec={**job["spec"], "_late_in_line_at": now})
                continue
            supersede(job["decision"], d)
            wait, queued = d.get("local_wait_h") or 0.0, d.get("local_queued_h")
            why = (f"its {_gpu_h(job):.2f} h run cannot checkpoint, and no stretch of local.available_hours is that "
                   "long now" if unfit else f"{wait if queued is None else queued:.2f} h of local work is now ahead "
                   "of it in line (earlier deadlines)" + ("" if queued is None else f", done {wait:.2f} h from now "
                   "in local.available_hours") + ", so local no longer makes its deadline")
            d["reasons"].insert(0, f"decided again while queued: {why}")
            record = record_decision(self.app, again.facts, d, now, job["id"])
            with self.store.tx() as conn:
                if not self.store.update_job(job["id"], conn, expect_state=job["state"], state=again.target.value,
                                             verdict=d["verdict"], placement=d["placement"], decision=d,
                                             record_path=str(record),
                                             reason=headline(d)):
                    record.unlink(missing_ok=True)
                    continue
                self.app.events.emit("job.redecided", job_id=job["id"], conn=conn, previous=job["state"],
                                     state=again.target.value, verdict=d["verdict"], action=d["action"],
                                     placement=d["placement"], local_wait_h=wait,
                                     why="no local stretch long enough" if unfit else "late in line",
                                     reason=headline(d))
            superseded(job.get("record_path"), record, "decided again while queued", now)
            if again.target is JobState.QUEUED:  # admitted to the cloud: the next job sees what its plan holds
                ctx = replace(ctx, held=ctx.held.plus(planned_rented_usd(d)))

    def _redecide_blocked(self, now: float) -> None:
        """Blocked jobs (budget, kill switch, no capacity) are decided again; the oldest-updated first."""
        from orchestrator.queue import (
            LocalBacklog,
            context,
            local_backlog,
            measured_rented_throughputs,
            reconsider,
            setup_estimates,
        )

        with self.store.engine.connect() as c:
            blocked = [dict(r) for r in c.execute(
                select(s.jobs).where(s.jobs.c.state == JobState.BLOCKED.value)
                .order_by(s.jobs.c.updated_at).limit(self.cfg.daemon.redecide_per_tick)).mappings()]
        if not blocked:
            return
        ctx = context(self.app, now)
        due = [job for job in self._readable(blocked)
               if job["spec"].get("_retry_at", 0) <= now and not self._budget_still_short(job, now)]
        # Measured s_R for the whole batch in one query (not one per job); jobs of one name may list other GPUs.
        gpus_by_name: dict[str, set[str]] = {}
        for job in due:
            gpus_by_name.setdefault(job["name"], set()).update(job["spec"].get("rented_throughput", {}))
        measured = measured_rented_throughputs(self.app, gpus_by_name)
        setups = setup_estimates(self.app, {job["name"] for job in due if job["spec"].get("setup")})
        # The local GPU's queue, read once for the batch (and only for the jobs that can run locally at all).
        here = [float(j["deadline_at"]) for j in due if j["spec"].get("local_throughput", 0) > 0]
        backlog = local_backlog(self.app, now, until=max(here)) if here else LocalBacklog.of([], 1)
        # One transaction for the batch; jobs still blocked go to the back of the line (updated_at), so with
        # thousands blocked every one is looked at in turn, `redecide_per_tick` at a time.
        with self.store.tx() as conn:
            moved = set()
            for job in due:
                again = reconsider(self.app, job, ctx, now, conn, measured.get(job["name"], {}),
                                   setups.get(job["name"], UNMEASURED_SETUP), backlog)
                if again is None:
                    continue
                moved.add(job["id"])
                state, d = again
                if state == JobState.QUEUED.value and d["placement"] in ("cloud", "hybrid"):
                    # Admitted: the next job of the batch sees the money its plan holds.
                    ctx = replace(ctx, held=ctx.held.plus(planned_rented_usd(d)))
            unchanged = [job["id"] for job in blocked if job["id"] not in moved]
            if unchanged:
                conn.execute(update(s.jobs).where(s.jobs.c.id.in_(unchanged)).values(updated_at=now))
        for job in due:  # committed: each record before points at its job's new one
            if job["id"] in moved:
                new = (self.store.get_job(job["id"]) or {}).get("record_path")
                if new:
                    superseded(job.get("record_path"), Path(new), f"decided again while {job['state']}", now)

    # --- starting a cloud attempt ------------------------------------------------------------------------------
    def _advance_new_attempt(self, job_id: str) -> None:
        with self.store.engine.connect() as c:
            row = c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id, s.attempts.c.state ==
                                                     A.INTENT.value)).mappings().first()
            job = c.execute(select(s.jobs).where(s.jobs.c.id == job_id)).mappings().first()
        if row is not None and job is not None:
            self._advance(dict(row), dict(job))

    def _start_cloud_attempt(self, job: dict[str, Any], now: float) -> bool:
        retry_at = now + max(30.0, self.cfg.daemon.launch_backoff_s)
        if not burst_enabled(self.app):
            if job["decision"].get("fits_locally"):
                self._run_here_meanwhile(job)
            else:
                self._block(job, "bursting is disabled (revert-local): `burstctl burst-enable` lifts it")
            return False
        if self.cloud is None or not self.providers:
            self._block(job, "no cloud provider is usable (check `burstctl providers`)", retry_at=retry_at)
            return False
        failures = self._recent_launch_failures(job["id"])
        if failures and now < failures[0]["ended_at"] + self.cfg.daemon.launch_backoff_s:
            self.store.update_job(job["id"], wait_until=failures[0]["ended_at"] + self.cfg.daemon.launch_backoff_s)
            return False  # not read again until then
        if len(failures) >= self.cfg.daemon.max_launch_failures:
            self._block(job, f"{len(failures)} launches failed in a row ({failures[0]['reason']}); "
                             f"retrying in {self.cfg.daemon.launch_backoff_s:.0f} s", retry_at=now +
                        self.cfg.daemon.launch_backoff_s, reset_failures=True)
            return False
        choice = self.choose_offer(job, now)
        if choice is None:
            return False
        provider_name, offer, market, market_facts = choice
        rate = offer.rate_usd_h(market)
        problem = self.launch_budget_problem(job, offer, market, now)
        if problem is not None:
            self._block(job, problem, budget_launch={"rate_usd_h": rate, "minimum_s": offer.billing_minimum_s})
            return False
        # Spot goes first to the region whose capacity has been listed longest (the rule simulate --may-move replays).
        regions = spot_region_order(self.app, provider_name, offer, now) if market is Market.SPOT else ()
        with self.store.tx() as conn:
            if not self.store.update_job(job["id"], conn, expect_state=job["state"], state=JobState.RUNNING.value,
                                         reason=f"bursting to {provider_name} {offer.instance_type} ({market.value})"):
                return False  # changed since it was read (a `cancel` beside the tick): no intent for it
            self.write_intent(conn, job, provider_name, offer, market, market_facts, rate, regions, now)
        return True

    def write_intent(self, conn: Connection, job: dict[str, Any], provider_name: str, offer: Offer, market: Market,
                     market_facts: dict[str, Any], rate: float, regions: tuple[str, ...] | list[str], now: float,
                     **info: Any) -> str:
        """Write a cloud attempt's intent (launched by its next step, `_step_intent`) and say so; its id. `info`:
        more of the attempt's info (a successor's `successor_for`)."""
        placed = {"region_order": list(regions)} if regions else {}
        attempt_id = create_attempt(
            conn, job["id"], where="cloud", provider=provider_name, instance_type=offer.instance_type,
            market=market.value, owner=self.owner, created_at=now,
            info={"rate_usd_h": rate, "billing_minimum_s": offer.billing_minimum_s, "launch_tried": False,
                  "gpu": offer.gpu_model, **({"market_policy": market_facts} if market_facts else {}), **placed,
                  **info})["id"]
        self.app.events.emit("attempt.intent", job_id=job["id"], attempt_id=attempt_id, conn=conn,
                             provider=provider_name, instance_type=offer.instance_type, market=market.value,
                             rate_usd_h=rate,
                             # from a checkpoint, whatever the job waited as (resuming, queued, blocked)
                             resuming=checkpoints.latest(self.cfg, job["id"], deep=False) is not None,
                             **({"market_policy": market_facts} if market_facts else {}), **placed,
                             **({"successor_for": info["successor_for"]} if "successor_for" in info else {}))
        return attempt_id

    def _offers_listed(self, provider: str, offers: list[Offer], now: float) -> None:
        """A provider's fresh listing: its spot capacity changes, and its machines and prices for decisions."""
        record_spot_listings(self.app, provider, offers, now)
        record_offers_seen(self.app, provider, offers, now)

    def choose_offer(self, job: dict[str, Any], now: float, *, quiet: bool = False
                     ) -> tuple[str, Offer, Market, dict[str, Any]] | None:
        """The cheapest offer, across usable providers, of a GPU type the job names, with capacity now; on the market
        the spot policy picks for it (with what that choice rested on). `quiet`, for a launch beside a running
        attempt: where there is none, the job's reason and its wait for spot are left as they are."""
        spec = job["spec"]
        wanted = {g.upper(): s_r for g, s_r in spec["rented_throughput"].items()}
        best: tuple[float, str, Offer, Market, dict[str, Any]] | None = None
        waiting: dict[str, Any] | None = None  # what the policy rests on where it waits for listed spot
        offers, problems, too_small = self._offers_with_capacity(job, now)
        # Offers whose launch was just refused for capacity go last: the next one is tried, as a provider's own
        # fallback would, but chosen here, where its GPU, memory and price are weighed and metered.
        refused = {(r["provider"], r["instance_type"], r["market"]) for r in self._recent_launch_failures(job["id"])
                   if r["info"].get("launch_error") == NoCapacity.__name__}
        held_back: list[tuple[float, str, Offer, Market, dict[str, Any]]] = []
        for name, o in offers:
            market, why = market_for_attempt(self.app, job, name, o, now)
            if market is Market.SPOT and why.get("choice") == "idle" and now < spec.get("_spot_probe_at", 0):
                market = None  # the policy waits, and the next probe of spot is not due yet
            if market is None:
                waiting = why
                continue
            if market is Market.ON_DEMAND and not o.capacity_regions(market):
                continue  # spot capacity listed, on-demand none: the launch would only be refused
            price = o.rate_usd_h(market)
            speed = wanted[o.gpu_model.upper()]
            cost = price / speed  # $ per unit of work
            if (name, o.instance_type, market.value) in refused:
                held_back.append((cost, name, o, market, why))
            elif best is None or cost < best[0]:
                best = (cost, name, o, market, why)
        if best is None and held_back:  # nothing else: the refused ones again, cheapest first
            best = min(held_back, key=lambda b: b[0])
        if waiting is not None and (best is None or best[3] is Market.ON_DEMAND):
            if quiet:
                return None
            # The policy waits for spot that a provider lists as gone: no launch, and no on-demand elsewhere.
            # Asked again a market_check_s from now, or when the next probe of spot is due if that is sooner.
            probe_at = spec.get("_spot_probe_at", 0)
            look_at = min(now + self.cfg.daemon.market_check_s, probe_at if probe_at > now else float("inf"))
            self.store.update_job(job["id"], wait_until=look_at)  # not read again until then
            seen = f"refused, next try in {probe_at - now:.0f} s" if probe_at > now else "none listed"
            self._note(job, f"waiting for spot ({seen}): {waiting['slack_h']:.2f} h of slack left; the spot "
                            "policy goes on-demand once waiting no longer pays", same_as="waiting for spot")
            return None
        if best is None:
            if quiet:
                return None
            if problems and len(problems) == len(self.providers):  # nobody answered: not a capacity question at all
                reason = "no provider answered (" + "; ".join(problems) + ")"
            else:
                reason = f"no offer with capacity for {_gpus_named(spec)}"
                if problems or too_small:
                    reason += f" ({'; '.join(problems + too_small)})"
            self._note(job, reason)
            return None
        return best[1], best[2], best[3], best[4]

    def _expected_remaining_h(self, job: dict[str, Any]) -> float:
        d = job["decision"]
        plan = d.get("plan") or []
        cloud = [p for p in plan if p["where"] == "cloud"]
        hours = cloud[0]["hours"] if cloud else (d.get("t_rented_h") or 0.0)
        # Only cloud hours count against the plan's cloud phase (a hybrid's local phase is already outside it).
        done = cloud_hours_done(cloud_attempts(self.app, job["id"]), self.clock())
        return max(hours - done, d.get("overhead_h") or 0.0)

    def _recent_launch_failures(self, job_id: str) -> list[dict[str, Any]]:
        """Consecutive launch failures since the last attempt that got a usable instance, newest first: refused
        launches, and instances that never came up (`NEVER_CAME_UP`)."""
        with self.store.engine.connect() as c:
            # Never more than max_launch_failures count (then the job blocks and they are reset): read no more.
            rows = [dict(r) for r in c.execute(
                select(s.attempts).where(s.attempts.c.job_id == job_id, s.attempts.c.where == "cloud")
                .order_by(s.attempts.c.n.desc()).limit(self.cfg.daemon.max_launch_failures)).mappings()]
        out = []
        for r in rows:
            never_up = r["state"] == A.ABORTED.value and r["info"].get("stop_reason") in NEVER_CAME_UP
            if (r["state"] != A.LAUNCH_FAILED.value and not never_up) or r["info"].get("failure_counted") is False:
                break
            out.append(r)
        return out

    def _run_here_meanwhile(self, job: dict[str, Any]) -> None:
        """Local-only (revert-local): a cloud job that fits locally runs here, late if need be, as revert-local
        requeues those it brings home; `burst-enable` puts it back on its plan if it has not started
        (`revert.restore_plans`)."""
        reason = requeued_local_reason(self.cfg, job["id"], " while bursting is disabled,")
        with self.store.tx() as conn:
            if self.store.update_job(job["id"], conn, expect_state=job["state"], placement="local", reason=reason):
                self.app.events.emit("job.requeued_local", job_id=job["id"], conn=conn, reason=reason)

    def _block(self, job: dict[str, Any], reason: str, *, retry_at: float | None = None,
               reset_failures: bool = False, budget_launch: dict[str, float] | None = None) -> None:
        """`budget_launch`: the launch the budget refused (its rate and billing minimum), which the job is decided
        again only once it fits (`_budget_still_short`)."""
        with self.store.tx() as conn:
            spec = {k: v for k, v in job["spec"].items() if k != "_budget_launch"}
            if retry_at is not None:
                spec["_retry_at"] = retry_at
            if budget_launch is not None:
                spec["_budget_launch"] = budget_launch
            if self.store.update_job(job["id"], conn, expect_state=job["state"], state=JobState.BLOCKED.value,
                                     reason=reason, spec=spec):
                self.app.events.emit("job.blocked", job_id=job["id"], conn=conn, reason=reason)
            if reset_failures:
                for r in self._recent_launch_failures(job["id"]):
                    info = {**r["info"], "failure_counted": False}
                    self.store.set_attempt_info(r["id"], info, conn)

    def _hand_over_held(self, job: dict[str, Any], now: float) -> str | None:
        """Why a hybrid job's local phase cannot hand over now, else None. Stopping the local run for a burst
        that cannot launch (no capacity, or the monthly budget would refuse it) would leave the local GPU idle while
        the deadline slips further. Only capacity on the
        market the cloud phase would launch on counts (`market_for_attempt`, as `choose_offer` asks it): spot
        capacity does not take an on-demand phase. A provider that lists capacity and lists none for the job's
        GPUs on that market holds it; one that cannot tell without launching (EC2 lists its zones whatever their
        capacity) lets it go."""
        if not burst_enabled(self.app):
            return "bursting is disabled (revert-local)"
        if awaits_approval(job):
            return f"its price waits for approval: `burstctl approve {job['id']}`"
        if self.cloud is None or not self.providers:
            return "no cloud provider is usable"
        offers, problems, too_small = self._offers_with_capacity(job, now)
        problems += too_small
        markets: set[str] = set()  # the markets it would launch on where only the other one has capacity
        refused: str | None = None  # what the budget says of the launch an offer with capacity would make
        for name, offer in offers:
            market, _ = market_for_attempt(self.app, job, name, offer, now)
            if market is not None and offer.capacity_regions(market):
                # The launch's own budget check, asked before the local run is stopped.
                refused = self.launch_budget_problem(job, offer, market, now)
                if refused is None:
                    return None
                continue
            markets.add((market or Market.SPOT).value)  # None: the spot policy waits for spot, listed gone
        if refused is not None:
            return f"the budget would refuse the burst: {refused.removeprefix('budget: ')}"
        on = f"{' or '.join(sorted(markets))} " if markets else ""
        return (f"no cloud lists {on}capacity for {_gpus_named(job['spec'])}"
                + (f" ({'; '.join(problems)})" if problems else ""))

    def _offers_with_capacity(self, job: dict[str, Any], now: float
                              ) -> tuple[list[tuple[str, Offer]], list[str], list[str]]:
        """(provider, offer) for each offer of a GPU type and count the job names, whose card holds the job, in a
        region with capacity now; each provider that did not answer, with its error; and the cards listed too small
        for the job (none or one line)."""
        spec = job["spec"]
        wanted = {g.upper() for g in spec["rented_throughput"]}
        need_gb = self._card_need_gb(job)
        found: list[tuple[str, Offer]] = []
        problems: list[str] = []
        too_small: dict[str, str] = {}
        for name, provider in self.providers.items():
            try:
                offers = self.offers.get(name, provider, now)
            except ProviderError as exc:
                problems.append(f"{name}: {type(exc).__name__}: {self.app.redactor(str(exc))[:200]}")
                continue
            for o in offers:
                if o.gpu_model.upper() not in wanted or o.gpu_count != spec["gpus"] or not o.regions:
                    continue
                card_gb = o.vram_gib * 2**30 / 1e9  # a card's label read as GiB, as `decide` reads listings
                if need_gb is not None and 0 < card_gb < need_gb:  # 0: a listing that does not say
                    # A card the decision took to be bigger ([prices], or an older listing): a launch would OOM.
                    too_small[f"{name} {o.instance_type}"] = gb_and_gib(card_gb)
                    continue
                found.append((name, o))
        small: list[str] = []
        if too_small and need_gb is not None:
            margin = self.cfg.local.safety_margin_gb
            small.append(f"too small for its {need_gb - margin:.1f} GB per GPU and {gb_and_gib(margin)} kept free: "
                         + ", ".join(f"{where} has {gb} per GPU" for where, gb in too_small.items()))
        return found, problems, small

    def _card_need_gb(self, job: dict[str, Any]) -> float | None:
        """The memory a rented card must have for this job: its per-GPU estimate and the margin gate 1 keeps free
        (None without a [model] table: nothing to judge a card by)."""
        spec = job["spec"]
        if spec.get("model") is None:
            return None
        from orchestrator.core import sizing  # sizing is optional input, as in `queue.facts`

        model = ModelSpec.model_validate(spec["model"], strict=False)
        return sizing.estimate(model, gpus=spec["gpus"]).per_gpu_gb + self.cfg.local.safety_margin_gb

    def _note(self, job: dict[str, Any], reason: str, *, same_as: str | None = None) -> None:
        """Say why the job waits. A reason that only updates one starting with `same_as` (a slack counting down)
        changes what `show` and `list --json` say without another event."""
        if job["reason"] == reason:
            return
        with self.store.tx() as conn:
            self.store.update_job(job["id"], conn, reason=reason)
            if same_as is None or not (job["reason"] or "").startswith(same_as):
                self.app.events.emit("job.waiting", job_id=job["id"], conn=conn, reason=reason)

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
            self._note(job, f"attempt {att['id']} is on provider {att['provider']}, which this daemon cannot use "
                            "(`burstctl providers` says why): its instance is neither watched nor stopped until "
                            "it can")
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
        stop_reason = self._stop_reason(att, job)
        if st is A.INTENT:
            self._step_intent(att, job, provider, stop_reason)
        elif st is A.TERMINATING:
            self._step_terminating(att, job, provider)
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

    def _stop_reason(self, att: dict[str, Any], job: dict[str, Any]) -> str | None:
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
        if live and self.budget_problem(now) is not None:
            return "budget-cap"  # stopped while there is still room to checkpoint, sync and terminate
        if live and kept_probe_for(self, att) is not None:
            return TO_SPOT  # a spot probe came up and is kept to take over (even if a daemon died in between)
        if att["state"] == A.RUNNING.value and att["info"].get("stopping_for"):
            return str(att["info"]["stopping_for"])  # a stop begun by a daemon that died before it ended
        return None

    # --- the budget: month-to-date spend never crosses budget.monthly_cap_usd (tests/test_budget_property.py) --
    def budget_horizon_h(self, spec: Mapping[str, Any] | None = None) -> float:
        """How long a stop of a job with `spec` may take to end the spending (`budget.stop_horizon_h`, with the
        job's grace for its last checkpoint)."""
        return stop_horizon_h(self.tick_s, stop_grace_s(spec or {}))

    def budget_exposure(self, now: float) -> dict[str, tuple[float, float, float]]:
        """Per month that can still grow: (USD committed, USD/h still accruing, USD kept for the running instances
        to stop: each one's rate over its job's stop horizon). Committed counts closed charges at cost and open
        ones at no less than their billing minimum (what stopping now would cost). An open charge counts against
        the month it opened in, even after the calendar has moved on."""
        with self.store.engine.connect() as c:
            open_months = {r[0] for r in c.execute(select(s.ledger.c.month).where(s.ledger.c.ended_at.is_(None)))}
            months = open_months | {month_key(now)}
            rows = c.execute(select(s.ledger, s.attempts.c.info).select_from(
                s.ledger.outerjoin(s.attempts, s.attempts.c.id == s.ledger.c.attempt_id))
                .where(s.ledger.c.month.in_(sorted(months)))).mappings().all()
            running = {r["job_id"] for r in rows if r["cost_usd"] is None and r["job_id"]}
            specs = {j: spec for j, spec in c.execute(select(s.jobs.c.id, s.jobs.c.spec).where(
                s.jobs.c.id.in_(sorted(running))))} if running else {}
        out = {m: (0.0, 0.0, 0.0) for m in months}
        for r in rows:
            committed, accruing, kept = out[r["month"]]
            if r["cost_usd"] is not None:
                committed += r["cost_usd"]
            else:
                minimum_s = float((r["info"] or {}).get("billing_minimum_s", 0.0))
                committed += r["rate_usd_h"] * max(minimum_s, now - r["started_at"]) / 3600.0
                accruing += r["rate_usd_h"]
                kept += r["rate_usd_h"] * self.budget_horizon_h(specs.get(r["job_id"]))
            out[r["month"]] = (committed, accruing, kept)
        return out

    def _budget_still_short(self, job: dict[str, Any], now: float) -> bool:
        """A job the budget refused at launch still would be. Its decision projects less (no stop horizon, billing
        minimum or live price), so deciding it again would queue it and the launch refuse it again every tick."""
        refused = job["spec"].get("_budget_launch")
        if not refused:
            return False
        return self.budget_problem(now, rate_usd_h=float(refused["rate_usd_h"]), minimum_s=float(refused["minimum_s"]),
                                   expected_h=self._expected_remaining_h(job), spec=job["spec"]) is not None

    def launch_budget_problem(self, job: dict[str, Any], offer: Offer, market: Market, now: float) -> str | None:
        """Why the budget refuses launching `job` on `offer` and `market` now (its rate, its billing minimum and
        the hours of work left to it), or None."""
        return self.budget_problem(now, rate_usd_h=offer.rate_usd_h(market), minimum_s=offer.billing_minimum_s,
                                   expected_h=self._expected_remaining_h(job), spec=job["spec"])

    def budget_problem(self, now: float, *, rate_usd_h: float = 0.0, minimum_s: float = 0.0,
                       expected_h: float = 0.0, spec: Mapping[str, Any] | None = None) -> str | None:
        """Why spending must not go on (or a launch at `rate_usd_h` must not start), or None. Every running
        instance may go on accruing for one stop horizon after this check, so that is reserved for all of them;
        a new one must also fit its billing minimum and the work expected of it."""
        cap = self.cfg.budget.monthly_cap_usd
        horizon_h = self.budget_horizon_h(spec)
        this_month = month_key(now)
        for month, (committed, accruing, kept) in sorted(self.budget_exposure(now).items()):
            reserved = committed + kept
            if month == this_month and rate_usd_h > 0:
                new_h = max(expected_h, minimum_s / 3600.0) + horizon_h
                left = cap - reserved
                if rate_usd_h * new_h > left + 1e-9:
                    # Every term named: the decision's projection (plan hours at the configured price) is smaller.
                    running = f", ${kept:.2f} kept for the running ones to stop" if accruing else ""
                    hours = max(expected_h, minimum_s / 3600.0)
                    return (f"budget: ${rate_usd_h * new_h:.2f} projected for the rest ({hours:.3g} h at today's "
                            f"${rate_usd_h:.2f}/h, plus {horizon_h * 3600:.0f} s to stop) exceeds the "
                            f"${max(left, 0.0):.2f} left this month (${committed:.2f} spent or committed{running})")
            elif reserved >= cap:
                return f"budget: ${reserved:.2f} committed in {month} reaches the ${cap:.2f} cap"
        return None

    def _step_intent(self, att: dict[str, Any], job: dict[str, Any], provider: Provider,
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
            tags = OwnerTags(self.owner, job["id"], att["id"])
            req = LaunchRequest(instance_type=att["instance_type"], market=Market(att["market"]), tags=tags,
                                idempotency_key=att["idempotency_key"], ssh_public_key=self.cloud_steps.public_key,
                                ssh_key_name=None, region_order=tuple(info.get("region_order") or ()))
            chaos_point("before-launch")  # intent and launch_tried are written; the call is not made
            try:
                found = provider.launch(req)
                chaos_point("after-launch")  # the instance exists; the database does not know its id
            except LAUNCH_REFUSALS as exc:
                reason = f"{type(exc).__name__}: {self.app.redactor(str(exc))}"
                with self.store.tx() as conn:
                    if move(conn, att, A.LAUNCH_FAILED, reason=reason,
                            info={**att["info"], "launch_error": category(exc)}):
                        self.app.events.emit("attempt.launch_failed", job_id=job["id"], attempt_id=att["id"],
                                             conn=conn, provider=att["provider"], error=type(exc).__name__,
                                             code=exc.code, reason=reason)
                        self._after_attempt(conn, att, job, A.LAUNCH_FAILED, reason)
                return
            except ProviderError as exc:  # throttled/transient after retries: the outcome is unknown
                self.emit("attempt.launch_unknown", job_id=job["id"], attempt_id=att["id"],
                          error=type(exc).__name__)
                return
        self._adopt(att, job, found, "adopted" if adopted else "launched")

    def _adopt(self, att: dict[str, Any], job: dict[str, Any], inst: InstanceInfo, how: str) -> None:
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
        if inst is None or inst.state.gone:
            self._lost(att, job, provider, inst, "instance gone while provisioning")
            return
        if inst.state is not InstanceState.RUNNING or not inst.host:
            if now - att["created_at"] > self.cfg.daemon.boot_timeout_s:
                self._stop(att, job, provider, "boot-timeout")  # aborted: the job launches again
            return
        target = self.cloud_steps.target(att, inst)
        if not self.cloud_steps.reachable(att, target):
            if now - att["created_at"] > self.cfg.daemon.boot_timeout_s:
                self._stop(att, job, provider, "ssh-timeout")  # aborted: the job launches again
            return
        boot_s = now - att["created_at"]
        with self.store.tx() as conn:
            info = {**att["info"], "host": inst.host, "port": inst.ssh_port, "user": inst.ssh_user, "boot_s": boot_s}
            if move(conn, att, A.BOOTSTRAPPING, info=info):
                conn.execute(update(s.instances).where(s.instances.c.provider == att["provider"],
                                                       s.instances.c.id == inst.id)
                             .values(state=InstanceState.RUNNING.value))  # the row said what launch saw
                self._measure(conn, att, "boot_s", boot_s)
                self.app.events.emit("instance.ready", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                     instance=att["instance_id"], boot_s=round(boot_s, 3))

    def _step_bootstrapping(self, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> None:
        problem = passenv.unusable(job["spec"])
        if problem is not None:
            # Launched by a daemon that had the variables, bootstrapped by one restarted without them.
            self._stop(att, job, provider, problem, outcome=A.ABORTED)
            return
        resume_from = checkpoints.resume_point(self.app, job["id"])
        timings = self.cloud_steps.bootstrap_and_start(att, job, resume_from)
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

    def _step_running(self, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> None:
        now = self.clock()
        inst = provider.describe([att["instance_id"]]).get(att["instance_id"])
        if inst is None or inst.state.gone:
            self._lost(att, job, provider, inst, f"provider reports {inst.state.value if inst else 'unknown'}"
                       + (f" ({inst.reason})" if inst and inst.reason else ""))
            return
        status = self.cloud_steps.status(att)
        info = dict(att["info"])
        if status is None:  # SSH unreachable
            if now - info.get("last_seen_at", now) > self.cfg.daemon.heartbeat_timeout_s:
                self._lost(att, job, provider, inst, "heartbeat lost (SSH unreachable)")
            return
        info["last_seen_at"] = now
        if status.get("metrics"):
            info["metrics"] = status["metrics"]  # what the trainer reports: progress, throughput, peak VRAM
            watch_schedule(self.app, att, job, info, now)
        hb = status.get("heartbeat") or {}
        ex = status.get("exit")
        setup_s = hb.get("setup_s") or (ex or {}).get("setup_s")
        if setup_s is not None and "setup_s" not in info:  # the job's setup ran on this instance, this long
            info["setup_s"] = setup_s
            with self.store.tx() as conn:  # the job name's: `queue.setup_estimate` adds it to the job's t_ovh
                self._measure(conn, att, "setup_s", float(setup_s), key=setup_key(job["name"]))
        self.syncs.watch_s3_uploads(att, job, info, (ex or {}).get("s3") or status.get("s3"), exited=ex is not None)
        # Staleness is how long, on this process's monotonic clock, the instance's heartbeat has not changed:
        # comparing its timestamp with the wall clock calls a healthy run lost when either clock jumps. A
        # restarted daemon watches for a full timeout again.
        mono = time.monotonic()
        seen = self._heartbeats.get(att["id"])
        if seen is None or seen[0] != hb.get("ts"):
            seen = self._heartbeats[att["id"]] = (hb.get("ts"), mono)
        if hb.get("notice") and "notice_seen_at" not in info:
            info["notice_seen_at"] = now
            self.syncs.sync(att, job, info, urgent=True)  # first: the newest checkpoint is what the reclaim would take
            self._on_notice(att, job, info, hb["notice"], now)
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
                self._stop(att, job, provider, exit_reason(self.app, job, ex, prefix="job exited"),
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
                self.emit("attempt.market_switch", job_id=job["id"], attempt_id=att["id"], to=target.value,
                          market_policy=why)
                self._stop(att, job, provider, TO_ON_DEMAND if target is Market.ON_DEMAND else TO_SPOT, info=info)
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
            self._stop(att, job, provider, reason, seen=status)

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
                self._stop(att, job, provider, stop_reason, info=info)
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
        self._stop(att, job, provider, "completed", outcome=A.SUCCEEDED, info=info)

    def _final_pull_failed(self, att: dict[str, Any], job: dict[str, Any], provider: Provider,
                           info: dict[str, Any], what: str) -> None:
        """The job finished on the instance but `what` is not home: the instance is kept and the pull retried every
        tick (the budget cap and max_run_hours still stop it), unless the instance is gone or unreachable past the
        heartbeat timeout, which is a loss: the job resumes from what is home."""
        now = self.clock()
        inst = provider.describe([att["instance_id"]]).get(att["instance_id"])
        if inst is None or inst.state.gone:
            self._lost(att, job, provider, inst, f"instance gone before {what} came home", info=info)
            return
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
        self.emit("instance.interruption_notice", job_id=job["id"], attempt_id=att["id"],
                  instance=att["instance_id"], provider=att["provider"], reclaim_at=when,
                  last_checkpoint_home=home)
        info["notice"] = {"reclaim_at": when}
        with self.store.tx() as conn:
            self.store.set_attempt_info(att["id"], info, conn)
        info["notice"]["successor"] = launch_successor(self, att, job, now)  # boots while this one checkpoints
        with self.store.tx() as conn:
            self.store.update_job(job["id"], conn, expect_state=JobState.RUNNING.value,
                                  reason=notice_reason(att, info, home))
        if info["notice"]["successor"]:
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
            # transfers' own stall timeouts, and by LOSS_PULL_MAX_S for one that trickles.
            since = info.setdefault("loss_seen_at", now)
            if 0 <= now - since < LOSS_PULL_MAX_S and not self.syncs.final(att, job, info, outputs=False):
                with self.store.tx() as conn:
                    self.store.set_attempt_info(att["id"], info, conn)
                return  # looked at again next tick
            info["loss_synced"] = True
        elif self.syncs.pool.busy(att["id"]) and not self.syncs.pool.finished_for(att["id"]):
            since = info.setdefault("loss_seen_at", now)
            if 0 <= now - since < self.cfg.daemon.heartbeat_timeout_s:
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
        if moved:
            self._step_terminating(att, job, provider)

    def _stop(self, att: dict[str, Any], job: dict[str, Any], provider: Provider, reason: str, *,
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
            self._step_terminating(att, job, provider)

    def _step_terminating(self, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> None:
        started = time.monotonic()
        inst_id = att["instance_id"]
        if inst_id:
            provider.terminate([inst_id])
            chaos_point("terminating")  # asked to terminate, not yet confirmed gone nor billed
            inst = provider.describe([inst_id]).get(inst_id)
            if inst is not None and not inst.state.gone:
                return  # confirmed next tick
        now = self.clock()
        outcome = A(att["info"].get("outcome", A.ABORTED.value))
        with self.store.tx() as conn:
            if not move(conn, att, outcome):
                return
            if inst_id:
                self._close_instance(conn, att, inst_id, now)
                self._measure(conn, att, "teardown_s", time.monotonic() - started)
            self.app.events.emit("instance.terminated", job_id=job["id"], attempt_id=att["id"], conn=conn,
                                 instance=inst_id, outcome=outcome.value)
            self._after_attempt(conn, att, job, outcome, att.get("reason"))

    def _close_instance(self, conn: Any, att: dict[str, Any], inst_id: str, now: float) -> None:
        """The instance is gone: its charge ends when it went, if another process (revert-local, with no daemon
        running) saw it go earlier, else now. Billed up to now, an instance gone for days was billed for them."""
        seen_gone = conn.execute(select(s.instances.c.gone_at).where(s.instances.c.provider == att["provider"],
                                                                     s.instances.c.id == inst_id)).scalar()
        self.store.instance_gone(conn, att["provider"], inst_id,
                                 gone_at=min(now, float(seen_gone)) if seen_gone is not None else now)

    def _after_attempt(self, conn: Any, att: dict[str, Any], job: dict[str, Any], outcome: AttemptState,
                       reason: str | None) -> None:
        """What an ended attempt means for its job."""
        from orchestrator.lifecycle.finish import job_after_attempt

        if is_probe(att) or successor_of(att) is not None:
            return  # a spot probe's end is a sighting, a successor's before it took over is its predecessor's news
        job_after_attempt(self.app, conn, att, job, outcome, reason, self.clock())

    def _measure(self, conn: Any, att: dict[str, Any], metric: str, value: float, key: str | None = None) -> None:
        """A measurement of the attempt's instance type (or of `key`: a job name's, say)."""
        conn.execute(insert(s.measurements).values(ts=self.clock(), provider=att["provider"] or "local",
                                                   instance_type=key or att["instance_type"] or "local",
                                                   metric=metric, value=float(value)))


def _run_over(status: dict[str, Any] | None) -> bool:
    """Whether a supervised run has ended, by its supervisor's status (None, it cannot be asked: nothing to wait
    for then)."""
    return status is None or status.get("exit") is not None or not status.get("supervisor_alive")


def _gpu_h(job: dict[str, Any]) -> float:
    """The local GPU hours a job takes from the start (W / s_L)."""
    s_local = float(job["spec"].get("local_throughput") or 0.0)
    return float(job["spec"].get("work_units") or 1.0) / s_local if s_local > 0 else 0.0


def _room_to_run(job: dict[str, Any], hours: LocalHours) -> bool:
    """Whether a local job may start in the local GPU's hours now: one that cannot checkpoint is never paused when
    they end (its work would be lost), so it starts only when its whole run fits before they do."""
    return job["spec"]["checkpoint"].get("resumable", True) or hours.room_for(_gpu_h(job))
