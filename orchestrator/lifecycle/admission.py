"""Admission: which queued jobs start this tick, and where. Local (and hybrid) jobs on the local GPU within its
slots and hours; cloud jobs on the cheapest offer with capacity, on the market the spot policy picks, within the
budget; jobs that the line or the budget made late or blocked, decided again. It writes a cloud attempt's intent
(`write_intent`); the reconciler takes the attempt from there.

Each tick reads only as many queued jobs as there are free slots (plus a margin), so a tick stays cheap with 10,000
queued; nothing is held in memory that the database does not also say, but the providers' listings (`OfferCache`,
a cache of observed state) and the jobs known to lack their pass_env this minute.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, func, or_, select, update

from orchestrator.app import CLOUD_REFUSED_KEY, CLOUD_THROTTLED_KEY, CLOUD_UNAVAILABLE_KEY, App, burst_enabled
from orchestrator.core.decision import UNMEASURED_SETUP
from orchestrator.core.local_hours import LocalHours
from orchestrator.core.release import relaunch_held
from orchestrator.core.sizing import gb_and_gib
from orchestrator.errors import format_validation_error
from orchestrator.jobspec import JobSpec, ModelSpec
from orchestrator.lifecycle import checkpoints, passenv
from orchestrator.lifecycle.budget_guard import BudgetGuard
from orchestrator.lifecycle.finish import NEVER_CAME_UP, requeued_local_reason
from orchestrator.lifecycle.machine import (
    ACTIVE_ATTEMPT_STATES,
    HOLDING_ATTEMPT_STATES,
    AttemptState,
    released_instances,
)
from orchestrator.lifecycle.machine import create as create_attempt
from orchestrator.lifecycle.market_switch import market_for_attempt, record_spot_listings, spot_region_order
from orchestrator.lifecycle.states import JobState, awaits_approval
from orchestrator.queue import headline, local_hours, local_time, record_offers_seen
from orchestrator.records import supersede, superseded
from providers.base import Market, NoCapacity, Offer, Provider, ProviderError, Throttled, Transient, category
from state import schema as s
from state.schema import planned_rented_usd

if TYPE_CHECKING:
    from orchestrator.config import Config
    from orchestrator.lifecycle.local import LocalRunner

A = AttemptState
# Why a queued local (or hybrid) job has not started: the local GPU is busy, or outside local.available_hours.
LOCAL_GPU_BUSY = "waiting for the local GPU"
LOCAL_GPU_HOURS = "waiting for the local GPU's hours (local.available_hours)"
LACKING_ENV_FORGET_S = 60.0  # how long a job lacking its pass_env is left out of the candidates before a new look
LACKING_ENV_KEPT = 2000  # at most this many left out (each is a row more that the candidates' query reads)


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

    def refusals(self) -> dict[str, str]:
        """The providers that answered their last listing with a refusal a retry will not change (its key refused,
        an account limit, a request it calls wrong: not Throttled or Transient), and what it said. Such a provider is
        not unreachable: what to do about it is not the network's."""
        return {n: f"{category(v)}: {v}" for n, v in self._offers.items()
                if isinstance(v, ProviderError) and not v.retryable}

    def throttled(self) -> dict[str, float]:
        """The providers that answered their last listing with Throttled (its retries spent, or a Retry-After longer
        than a call waits), and when each is asked again: a `ttl_s` after it was asked, or once the Retry-After it
        gave is up if that is later (a call before then is not sent: `providers.base.call`, Lambda's quiet window).
        Such a provider is up and asks to be left alone a while, not unreachable."""
        return {n: self._asked_again(n, v) for n, v in self._offers.items() if isinstance(v, Throttled)}

    def unavailable(self) -> dict[str, float]:
        """The providers that answered their last listing that they are unavailable (a 5xx: Transient) and said when
        to ask again (Retry-After), and when each is asked again, as `throttled` says it. Such a provider answered:
        not unreachable (a timeout, a refused connection or a 5xx that says nothing more), nor throttling the daemon.
        A listing held back by its Retry-After (Lambda's adapter sends nothing before) fails as the 5xx did."""
        return {n: self._asked_again(n, v) for n, v in self._offers.items()
                if isinstance(v, Transient) and v.retry_after_s is not None}

    def _asked_again(self, name: str, error: ProviderError) -> float:
        return self._at[name] + max(self.ttl_s, error.retry_after_s or 0.0)

    def checked_at(self) -> float | None:
        """When the least recently asked provider was last asked (None before any was)."""
        return min(self._at.values()) if self._at else None

    def forget(self, name: str) -> None:
        self._at.pop(name, None)


def note_waiting(app: App, job: dict[str, Any], reason: str, *, same_as: str | None = None) -> None:
    """Say why the job waits. A reason that only updates one starting with `same_as` (a slack counting down)
    changes what `show` and `list --json` say without another event."""
    if job["reason"] == reason:
        return
    with app.store.tx() as conn:
        app.store.update_job(job["id"], conn, reason=reason)
        if same_as is None or not (job["reason"] or "").startswith(same_as):
            app.events.emit("job.waiting", job_id=job["id"], conn=conn, reason=reason)


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


def _gpu_h(job: dict[str, Any]) -> float:
    """The local GPU hours a job takes from the start (W / s_L)."""
    s_local = float(job["spec"].get("local_throughput") or 0.0)
    return float(job["spec"].get("work_units") or 1.0) / s_local if s_local > 0 else 0.0


def _room_to_run(job: dict[str, Any], hours: LocalHours) -> bool:
    """Whether a local job may start in the local GPU's hours now: one that cannot checkpoint is never paused when
    they end (its work would be lost), so it starts only when its whole run fits before they do."""
    return job["spec"]["checkpoint"].get("resumable", True) or hours.room_for(_gpu_h(job))


class Admission:
    """Starts what the free slots allow each tick (`schedule`); answers what a launch would be (`choose_offer`,
    `hand_over_held`) for the reconciler's other steps: a successor's launch, a hybrid's hand-over."""

    def __init__(self, app: App, providers: Mapping[str, Provider], *, local: LocalRunner, budget: BudgetGuard,
                 has_cloud: bool, owner: str, clock: Callable[[], float], advance: Callable[[str], None]):
        self.app = app
        self.cfg = app.config
        self.store = app.store
        self.providers = providers
        self.local = local
        self.budget = budget
        self.has_cloud = has_cloud  # the cloud's steps are configured (SSH keys, runbooks)
        self.owner = owner
        self.clock = clock
        self.advance = advance  # steps a cloud attempt just written down, within this tick
        self.offers = OfferCache(ttl_s=self.cfg.daemon.offers_ttl_s, on_refresh=self._offers_listed)
        # Jobs whose pass_env this process cannot give (`_lacks_passed_env`), left out of the candidates a tick
        # reads: any number of them, due first, then hides no job that can start. The process's environment is its
        # own for life, but `retry --reread` may change a job's pass_env: forgotten every LACKING_ENV_FORGET_S.
        self._lacking_env: set[str] = set()
        self._lacking_env_since = 0.0

    def _note(self, job: dict[str, Any], reason: str, *, same_as: str | None = None) -> None:
        note_waiting(self.app, job, reason, same_as=same_as)

    def schedule(self) -> None:
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
                self.advance(job["id"])
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
            # A released attempt (revert-local, its provider unreachable) holds its instance, not its job.
            busy_jobs = {r[0] for r in c.execute(
                select(s.attempts.c.job_id).where(s.attempts.c.state.in_(HOLDING_ATTEMPT_STATES)))}

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
                    self.store.set_setting(CLOUD_REFUSED_KEY, {}, conn=conn)
                    self.store.set_setting(CLOUD_THROTTLED_KEY, {}, conn=conn)
                    self.store.set_setting(CLOUD_UNAVAILABLE_KEY, {}, conn=conn)
                    self.store.set_setting("cloud_health_at", now, conn=conn)
                    self.app.events.emit("cloud.health", conn=conn, providers={})
            return
        for name, provider in self.providers.items():
            with contextlib.suppress(ProviderError):
                self.offers.get(name, provider, now)
        health, at = self.offers.health(), self.offers.checked_at()
        if not health or self.store.get_setting("cloud_health_at") == at:
            return
        refused = {n: self.app.redactor.clip(why, 300) for n, why in self.offers.refusals().items()}
        throttled, unavailable = self.offers.throttled(), self.offers.unavailable()
        with self.store.tx() as conn:
            if self.store.get_setting("cloud_health") != health or \
                    set(self.store.get_setting(CLOUD_REFUSED_KEY) or {}) != set(refused) or \
                    set(self.store.get_setting(CLOUD_THROTTLED_KEY) or {}) != set(throttled) or \
                    set(self.store.get_setting(CLOUD_UNAVAILABLE_KEY) or {}) != set(unavailable):
                said: dict[str, Any] = {"refused": sorted(refused)} if refused else {}
                if throttled:
                    said["throttled"] = sorted(throttled)
                if unavailable:
                    said["unavailable"] = sorted(unavailable)
                self.app.events.emit("cloud.health", conn=conn, providers=health, **said)
            self.store.set_setting("cloud_health", health, conn=conn)
            self.store.set_setting(CLOUD_REFUSED_KEY, refused, conn=conn)
            self.store.set_setting(CLOUD_THROTTLED_KEY, throttled, conn=conn)
            self.store.set_setting(CLOUD_UNAVAILABLE_KEY, unavailable, conn=conn)
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
        ctx = context(self.app, now, tick_s=self.budget.tick_s)
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
        ctx = context(self.app, now, tick_s=self.budget.tick_s)
        due = [job for job in self._readable(blocked)
               if job["spec"].get("_retry_at", 0) <= now and not self.budget.still_short(job, now)]
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

    def _start_cloud_attempt(self, job: dict[str, Any], now: float) -> bool:
        retry_at = now + max(30.0, self.cfg.daemon.launch_backoff_s)
        if not burst_enabled(self.app):
            if job["decision"].get("fits_locally"):
                self._run_here_meanwhile(job)
            else:
                self._block(job, "bursting is disabled (revert-local): `burstctl burst-enable` lifts it")
            return False
        if (held := self.relaunch_held(job)) is not None:
            self._note(job, held)  # its instance from before still bills: launched once that is confirmed gone
            return False
        if not self.has_cloud or not self.providers:
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
        problem = self.budget.launch_problem(job, offer, market, now)
        if problem is not None:
            self._block(job, problem, budget_launch={"rate_usd_h": rate, "minimum_s": offer.billing_minimum_s})
            return False
        # Spot goes first to the region whose capacity has been listed longest (the rule simulate --may-move replays).
        regions = spot_region_order(self.app, provider_name, offer, now) if market is Market.SPOT else ()
        hold = self.budget.hold_usd(job, rate, offer.billing_minimum_s, now)
        with self.store.tx() as conn:
            if not self.store.update_job(job["id"], conn, expect_state=job["state"], state=JobState.RUNNING.value,
                                         reason=f"bursting to {provider_name} {offer.instance_type} ({market.value})"):
                return False  # changed since it was read (a `cancel` beside the tick): no intent for it
            self.write_intent(conn, job, provider_name, offer, market, market_facts, rate, regions, now, hold_usd=hold)
        return True

    def write_intent(self, conn: Connection, job: dict[str, Any], provider_name: str, offer: Offer, market: Market,
                     market_facts: dict[str, Any], rate: float, regions: tuple[str, ...] | list[str], now: float, *,
                     hold_usd: float, **info: Any) -> str:
        """Write a cloud attempt's intent (launched by its next step, `Reconciler.step_intent`) and say so; its
        id. `hold_usd`: what the job holds of the budget on this market (`BudgetGuard.hold_usd`), written with it:
        the spot policy may launch a spot plan on on-demand, at three times its price. `info`: more of the attempt's
        info (a successor's `successor_for`)."""
        self.store.set_hold(job["id"], hold_usd, conn)
        placed = {"region_order": list(regions)} if regions else {}
        attempt_id = create_attempt(
            conn, job["id"], where="cloud", provider=provider_name, instance_type=offer.instance_type,
            market=market.value, owner=self.owner, created_at=now,
            info={"rate_usd_h": rate, "billing_minimum_s": offer.billing_minimum_s, "launch_tried": False,
                  "gpu": offer.gpu_model, **({"market_policy": market_facts} if market_facts else {}), **placed,
                  **info})["id"]
        self.app.events.emit("attempt.intent", job_id=job["id"], attempt_id=attempt_id, conn=conn,
                             provider=provider_name, instance_type=offer.instance_type, market=market.value,
                             rate_usd_h=rate, hold_usd=round(hold_usd, 4),
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
        again only once it fits (`BudgetGuard.still_short`)."""
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

    def relaunch_held(self, job: dict[str, Any]) -> str | None:
        """Why the job may not be launched in the cloud now for an instance of its from before (revert-local, its
        provider not answering the terminate) that is not yet confirmed gone (`core/release.relaunch_held`)."""
        with self.store.engine.connect() as c:
            return relaunch_held(released_instances(c, [job["id"]]).get(job["id"], []))

    def hand_over_held(self, job: dict[str, Any], now: float) -> str | None:
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
        if (held := self.relaunch_held(job)) is not None:
            return held
        if not self.has_cloud or not self.providers:
            return "no cloud provider is usable"
        offers, problems, too_small = self._offers_with_capacity(job, now)
        problems += too_small
        markets: set[str] = set()  # the markets it would launch on where only the other one has capacity
        refused: str | None = None  # what the budget says of the launch an offer with capacity would make
        for name, offer in offers:
            market, _ = market_for_attempt(self.app, job, name, offer, now)
            if market is not None and offer.capacity_regions(market):
                # The launch's own budget check, asked before the local run is stopped.
                refused = self.budget.launch_problem(job, offer, market, now)
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
                problems.append(f"{name}: {type(exc).__name__}: {self.app.redactor.clip(str(exc), 200)}")
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
