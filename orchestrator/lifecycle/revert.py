"""`burstctl revert-local`: the kill switch. The cloud is additive, never required.

1. Persist the switch first: from then on nobody launches anything (the daemon reads it every tick).
2. Every active cloud attempt, all together: a last checkpoint (SIGTERM through the supervisor), synced home within a
   bounded time (the pulls side by side, beside the loop), then terminate and confirm the instance is gone. A run
   that has already exited 0 is finished instead (final checkpoint and outputs home, the job done), not stopped to
   be run again.
3. Sweep every configured provider for instances owned by this orchestrator, orphans included, and terminate them.
4. Requeue the bursted jobs as local jobs resuming from their newest complete checkpoint (or hold those that
   cannot fit locally until `burstctl burst-enable`).

A provider that cannot be reached leaves its instances *unverified*: recorded, retried by the daemon's sweep with
an event each time, and reported (exit 1) so nothing is silently left running. So does an enabled provider this
process cannot use at all (its API key is not in this shell's environment, say): it was never asked what runs there.

The job of a stopped run whose terminate its provider does not answer comes home all the same once nothing of it is
left on the instance (its run stopped or unreachable, its newest checkpoint home): its attempt is `released` and its
instance terminated in the background (`Reconciler.release_if_home`). One that would leave work behind waits, saying
so, unless the user says to resume from what is home (`--resume-from-home`, RESUME_FROM_HOME_KEY, until
`burst-enable`).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import insert, select, update

from orchestrator.app import BURST_ENABLED_KEY, App
from orchestrator.core.release import relaunch_held
from orchestrator.lifecycle import checkpoints
from orchestrator.lifecycle.finish import REQUEUED_LOCAL, requeued_local_reason
from orchestrator.lifecycle.gone import confirmed_gone
from orchestrator.lifecycle.local import stop_wait_s
from orchestrator.lifecycle.machine import ACTIVE_ATTEMPT_STATES, AttemptState, released_instances
from orchestrator.lifecycle.orphans import attempts_of, meter_orphan
from orchestrator.lifecycle.reconcile import RELEASE_HELD, RESUME_FROM_HOME_KEY, Reconciler
from orchestrator.lifecycle.states import JobState
from providers.base import ProviderError
from state import schema as s


@dataclass
class RevertRow:
    job: str | None
    provider: str
    instance: str | None
    checkpoint: str | None
    terminated: str  # yes | no | unverified

    def as_dict(self) -> dict[str, Any]:
        return {"job": self.job, "provider": self.provider, "instance": self.instance,
                "checkpoint_synced": self.checkpoint, "terminated": self.terminated}


@dataclass
class RevertReport:
    rows: list[RevertRow] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # their run had ended well: finished, not brought home
    requeued_local: list[str] = field(default_factory=list)
    already_local: list[str] = field(default_factory=list)  # queued locally by an earlier revert-local, not yet run
    held: list[str] = field(default_factory=list)
    # Jobs left on an instance whose provider does not answer, by why they were not brought home (work would be
    # left behind): `revert-local --resume-from-home` brings them home from what is home.
    not_home: dict[str, str] = field(default_factory=dict)
    unreachable: list[str] = field(default_factory=list)
    # Enabled providers this process cannot use (no API key in its environment, say), by why: never asked what
    # runs there, so nothing is confirmed gone on them.
    not_swept: dict[str, str] = field(default_factory=dict)
    daemon_winding_down: list[str] = field(default_factory=list)  # attempts the running daemon had not yet ended
    # Enabled providers this process cannot use either, but on which nothing of this installation's can run: every
    # attempt there has ended and every instance is confirmed gone. Said, not a failure.
    nothing_there: dict[str, str] = field(default_factory=dict)
    # Enabled providers this process cannot use but the running daemon does (its keys in its own environment): it
    # ended their attempts, and its sweep (every daemon.sweep_s) terminates anything else of ours there.
    daemon_sweeps: dict[str, str] = field(default_factory=dict)

    @property
    def left(self) -> list[RevertRow]:
        return [r for r in self.rows if r.terminated != "yes"]

    @property
    def all_gone(self) -> bool:
        return not self.left and not self.unreachable and not self.not_swept

    def as_dict(self) -> dict[str, Any]:
        return {"mode": "local-only", "instances": [r.as_dict() for r in self.rows],
                "finished": self.finished, "requeued_local": self.requeued_local, "already_local": self.already_local,
                "held_until_burst_enable": self.held, "not_moved_home": self.not_home,
                "unreachable_providers": self.unreachable, "not_swept": self.not_swept,
                "daemon_winding_down": self.daemon_winding_down, "not_asked_nothing_there": self.nothing_there,
                "not_asked_daemon_sweeps": self.daemon_sweeps,
                "left": [r.as_dict() for r in self.left], "all_gone": self.all_gone}


def set_burst_enabled(app: App, enabled: bool, why: str) -> bool:
    """Persist the switch; returns whether it changed."""
    was = bool(app.store.get_setting(BURST_ENABLED_KEY, True))
    with app.store.tx() as conn:
        app.store.set_setting(BURST_ENABLED_KEY, enabled, conn=conn)
        if was != enabled:
            app.events.emit("burst.enabled" if enabled else "burst.disabled", conn=conn, reason=why)
    if enabled and app.store.get_setting(RESUME_FROM_HOME_KEY) is not None:
        app.store.delete_setting(RESUME_FROM_HOME_KEY)  # the leave was for that revert-local's jobs
    return was != enabled


def restore_plans(app: App, only: Collection[str] | None = None, why: str = "burst-enable") -> list[str]:
    """Undo revert-local's requeue for the jobs (of `only`, else all) that are not running locally now: each goes
    back to the placement its decision chose (cloud or hybrid), so `burst-enable` does not leave a job local that
    revert-local moved there (one that misses its deadline locally by hours). Only revert-local places a job local
    against its decision (a re-plan changes the decision too); its reason may since say it waits for the local GPU. A
    job running locally stays, and is re-planned if it falls behind its deadline. A job whose instance from before is
    not yet confirmed gone (`held_for_released`) stays here until it is: the daemon puts it back on its plan then.
    Returns the ids restored."""
    with app.store.engine.connect() as c:
        jobs = [dict(r) for r in c.execute(select(s.jobs).where(
            s.jobs.c.state.in_([JobState.QUEUED.value, JobState.RESUMING.value]),
            s.jobs.c.placement == "local", *([s.jobs.c.id.in_(list(only))] if only is not None else []))).mappings()]
        released = released_instances(c, [j["id"] for j in jobs])
    restored = []
    for job in jobs:
        placement = job["decision"].get("placement")
        if placement not in ("cloud", "hybrid") or relaunch_held(released.get(job["id"], [])) is not None:
            continue
        with app.store.tx() as conn:
            if app.store.update_job(job["id"], conn, expect_state=job["state"], placement=placement,
                                    reason=f"{why}: back to its {placement} plan"):
                app.events.emit("job.plan_restored", job_id=job["id"], conn=conn, placement=placement)
                restored.append(job["id"])
    return restored


def held_for_released(app: App) -> dict[str, str]:
    """The jobs not over with an instance from before revert-local (a released attempt's) not yet confirmed gone,
    each with why no other instance is launched for it until it is (`core/release.relaunch_held`): what
    `burst-enable` says."""
    with app.store.engine.connect() as c:
        released = released_instances(c)
    return {job_id: why for job_id, instances in released.items()
            if (why := relaunch_held(instances)) is not None
            and not JobState((app.store.get_job(job_id) or {"state": "done"})["state"]).final}


DEFAULT_TIMEOUT_S = 180.0  # a stop's wait for its last checkpoint (60 s by default), then its pull and termination
PULL_AND_TERMINATE_S = DEFAULT_TIMEOUT_S - 60.0


def default_timeout_s(active: list[dict[str, Any]], specs: dict[str, dict[str, Any]]) -> float:
    """180 s, or longer for a job whose trainer is given longer for its last checkpoint (checkpoint.stop_grace_s):
    cut short at 180 s, a 10-minute grace's checkpoint was terminated half written."""
    return max([DEFAULT_TIMEOUT_S, *(stop_wait_s(specs.get(att["job_id"]) or {}) + PULL_AND_TERMINATE_S
                                     for att in active)])


def revert_local(app: App, reconciler: Reconciler, *, timeout_s: float | None = None,
                 daemon_running: bool = False, resume_from_home: bool = False) -> RevertReport:
    """`daemon_running`: a daemon runs on this state, and winds the cloud attempts down itself once it reads the
    switch (at its next tick); this process then waits for it instead of stepping them too: two processes stepping
    one attempt each write back what the other has just done (a finished run's outcome lost and the job run again,
    an instance terminated under the other's last pull). The sweep then leaves alone what the daemon still holds.
    `resume_from_home`: a job whose instance's provider does not answer comes home from what is home even when its
    run did not stop or its newest checkpoint is out there (written down: the daemon reads it too)."""
    set_burst_enabled(app, False, "revert-local")
    if resume_from_home:
        with app.store.tx() as conn:
            app.store.set_setting(RESUME_FROM_HOME_KEY, {"at": time.time()}, conn=conn)
            app.events.emit("revert_local.resume_from_home", conn=conn)
    report = RevertReport(not_swept=dict(reconciler.unavailable))
    # One this installation never left anything on need not be asked: every launch is written down before it is
    # made, so what runs there of its own has an attempt not yet ended or an instance not confirmed gone.
    for name in [n for n in report.not_swept if not _may_hold_ours(app, n)]:
        report.nothing_there[name] = report.not_swept.pop(name)
    active = _active_cloud_attempts(app)
    if timeout_s is None:
        timeout_s = default_timeout_s(active, {a["job_id"]: (app.store.get_job(a["job_id"]) or {}).get("spec") or {}
                                               for a in active})
    deadline = time.monotonic() + timeout_s
    # The daemon's to wind down: on the providers it uses (an attempt on one it cannot use would never end there).
    daemons = _daemon_providers(app) if daemon_running else set()
    theirs = [a for a in active if daemons is None or a["provider"] in daemons]
    report.rows.extend(_wind_down(app, reconciler, [a for a in active if a not in theirs], deadline, report))
    report.rows.extend(_wait_for_daemon(app, reconciler, theirs, deadline, report))
    for name in [n for n in report.not_swept if daemons is None or n in daemons]:
        report.daemon_sweeps[name] = report.not_swept.pop(name)  # with its own credentials, every sweep_s
    # The daemon's own, still under way (and any it launched since): its to end, not this sweep's.
    still = [a for a in _active_cloud_attempts(app) if daemons is None or a["provider"] in daemons]
    held = {(a["provider"], a["instance_id"]) for a in still}
    held_attempts = {a["id"] for a in still}

    # Sweep: anything owned and alive, known to the database or not.
    seen = {(r.provider, r.instance) for r in report.rows} | held
    for name, provider in reconciler.providers.items():
        try:
            owned = [i for i in provider.list_owned() if not i.state.gone]
        except ProviderError:
            if name not in report.unreachable:
                report.unreachable.append(name)
            app.events.emit("provider.unreachable", provider=name, during="revert-local")
            continue
        attempts, offers = attempts_of(app, owned), functools.cache(provider.offers)
        for inst in owned:
            if (name, inst.id) in seen or inst.attempt_id in held_attempts:
                continue
            # Metered from its start until confirmed gone, as any instance.
            meter_orphan(app, name, offers, inst, attempts.get(inst.attempt_id or ""), time.time())
            status = _terminate_confirm(provider, inst.id, deadline)
            _record_instance(app, name, inst.id, inst.attempt_id, status)
            app.events.emit("instance.orphan_terminated" if status == "yes" else "instance.terminate_unverified",
                            provider=name, instance=inst.id, attempt_id=inst.attempt_id, during="revert-local")
            report.rows.append(RevertRow(inst.tags.get("burstctl:job"), name, inst.id, None, status))

    # Instances recorded earlier as unverified (a previous run, an unreachable provider) are retried too.
    with app.store.engine.connect() as c:
        pending = [dict(r) for r in c.execute(select(s.instances).where(s.instances.c.verified_gone.is_(False)))
                   .mappings()]
    for row in pending:
        if any(r.instance == row["id"] and r.terminated == "yes" for r in report.rows):
            continue
        if (row["provider"], row["id"]) in held:
            continue
        known = reconciler.providers.get(row["provider"])
        status = "unverified" if known is None else _terminate_confirm(known, row["id"], deadline)
        _record_instance(app, row["provider"], row["id"], row["attempt_id"], status)
        if not any(r.instance == row["id"] for r in report.rows):
            report.rows.append(RevertRow(None, row["provider"], row["id"], None, status))
        else:
            for r in report.rows:
                if r.instance == row["id"]:
                    r.terminated = status

    _requeue_local(app, report)
    app.events.emit("revert_local.done", instances=len(report.rows), left=len(report.left),
                    finished=report.finished, requeued_local=report.requeued_local, held=report.held,
                    unreachable=report.unreachable, not_swept=sorted(report.not_swept))
    return report


def _daemon_providers(app: App) -> set[str] | None:
    """The providers the running daemon uses, as it last said (`cloud_health`); None when it has not said yet."""
    health = app.store.get_setting("cloud_health")
    return None if health is None else set(health)


def _may_hold_ours(app: App, provider: str) -> bool:
    """Whether something this installation launched may still run on `provider`."""
    with app.store.engine.connect() as c:
        attempt = c.execute(select(s.attempts.c.id).where(
            s.attempts.c.provider == provider, s.attempts.c.state.in_(ACTIVE_ATTEMPT_STATES)).limit(1)).first()
        instance = c.execute(select(s.instances.c.id).where(
            s.instances.c.provider == provider, s.instances.c.verified_gone.is_(False)).limit(1)).first()
    return attempt is not None or instance is not None


def _active_cloud_attempts(app: App) -> list[dict[str, Any]]:
    with app.store.engine.connect() as c:
        return [dict(r) for r in c.execute(select(s.attempts).where(
            s.attempts.c.where == "cloud", s.attempts.c.state.in_(ACTIVE_ATTEMPT_STATES))).mappings()]


def _wait_for_daemon(app: App, rec: Reconciler, active: list[dict[str, Any]], deadline: float,
                     report: RevertReport) -> list[RevertRow]:
    """The running daemon winds the attempts down (its `stop_reason` reads the switch): wait for their ends, up to
    the deadline. One it is still winding down then is said (`daemon_winding_down`), not cut short: its last pull
    may be under way, and the daemon ends it."""
    waiting = {att["id"] for att in active}
    while waiting and time.monotonic() < deadline:
        waiting = {i for i in waiting if not _settled(_attempt(app, i))}
        if waiting:
            time.sleep(0.5)
    report.daemon_winding_down = sorted(waiting)
    return [_wound_down(app, rec, att, report, by_daemon=True) for att in active]


def _settled(att: dict[str, Any]) -> bool:
    """Whether a wound-down attempt is as far as it goes now: ended, or its job released home or held (its provider
    does not answer: the daemon terminates its instance when it does)."""
    return AttemptState(att["state"]).final or att["state"] == AttemptState.RELEASED.value or (
        att["state"] == AttemptState.TERMINATING.value and bool(att["info"].get(RELEASE_HELD)))


OVERTIME_TERMINATE_S = 30.0  # after a last pull let finish past the deadline: its instance's termination, confirmed


def _wind_down(app: App, rec: Reconciler, active: list[dict[str, Any]], deadline: float,
               report: RevertReport) -> list[RevertRow]:
    """Step every active attempt towards its end, together, until all have ended or the deadline: their last
    checkpoints are written and brought home side by side (the syncs run beside, `AttemptSyncs.final`), not one
    attempt's after another's. A last pull under way at the deadline is let finish, and its attempt ended then: cut
    short, its instance would be terminated by the sweep below with the checkpoint half home. A provider that fails
    a step leaves its attempt as it is (unverified)."""
    steps: dict[str, tuple[dict[str, Any], Any]] = {}  # attempt id → (job, provider), while it is stepped
    current = {att["id"]: dict(att) for att in active}  # `active` keeps the states they began in (`_not_ended`)
    for att in active:
        provider = rec.providers.get(att["provider"])
        if provider is None:
            if att["provider"] not in report.unreachable and att["provider"] not in report.not_swept:
                report.unreachable.append(att["provider"])
            continue
        steps[att["id"]] = (app.store.get_job(att["job_id"]) or {"id": att["job_id"], "state": "running",
                                                                  "spec": {}}, provider)
    overtime: dict[str, float] = {}  # attempts let finish their last pull past the deadline → until when after it
    while steps:
        now = time.monotonic()
        for attempt_id, (job, provider) in list(steps.items()):
            if now >= deadline:
                if rec.syncs.pool.busy(attempt_id):
                    overtime[attempt_id] = math.inf  # its last pull under way: let finish
                elif overtime.get(attempt_id) == math.inf:
                    overtime[attempt_id] = now + OVERTIME_TERMINATE_S  # pulled: now its instance goes
                if now >= overtime.get(attempt_id, now):
                    del steps[attempt_id]  # not yet stopped, or not yet confirmed gone: left to the sweep below
                    continue
            att = current[attempt_id]
            try:
                if att["state"] == AttemptState.INTENT.value:
                    rec.step_intent(att, job, provider, "revert-local")
                elif att["state"] in (AttemptState.TERMINATING.value, AttemptState.RELEASED.value):
                    rec.step_terminating(att, job, provider)
                else:  # a run that has already ended well is finished, not stopped
                    rec.wind_down(att, job, provider, "revert-local")
            except ProviderError:
                if att["provider"] not in report.unreachable:
                    report.unreachable.append(att["provider"])
                del steps[attempt_id]
                continue
            current[attempt_id] = _attempt(app, attempt_id)
            if AttemptState(current[attempt_id]["state"]).final:
                del steps[attempt_id]
        if not steps:
            break
        time.sleep(0.5)
    return [_wound_down(app, rec, att, report) for att in active]


def _wound_down(app: App, rec: Reconciler, att: dict[str, Any], report: RevertReport, *,
                by_daemon: bool = False) -> RevertRow:
    """The report's row for an attempt `_wind_down` stepped (or could not), or, `by_daemon`, that the running daemon
    winds down: what it ended is said as ended, whether this shell could use its provider or not, and what it has
    not ended yet is its to end, recorded as nothing for a sweep to terminate."""
    if by_daemon:
        current = _attempt(app, att["id"])
        if not AttemptState(current["state"]).final:
            status = "no"
            if _settled(current):  # its provider does not answer: the daemon terminates it when it does
                status = "unverified"
                _not_ended(app, att, current, report)
            return RevertRow(att["job_id"], att["provider"], current["instance_id"], _last_synced(app, att), status)
    elif att["provider"] not in rec.providers:
        if att["instance_id"]:
            _record_instance(app, att["provider"], att["instance_id"], att["id"], "unverified")
        return RevertRow(att["job_id"], att["provider"], att["instance_id"], None, "unverified")
    current = _attempt(app, att["id"])
    synced = _last_synced(app, att)
    if AttemptState(current["state"]).final:
        status = "yes"
        _job_after_wind_down(app, att, current, report)
        if rec.cloud is not None:  # local-only from now on: S3 keeps nothing that what is home supersedes
            job = app.store.get_job(att["job_id"]) or {"id": att["job_id"], "state": "running", "spec": {}}
            rec.cloud.release_s3(current, job)
    else:
        status = "unverified" if att["provider"] in report.unreachable or att["provider"] in report.not_swept else "no"
        _not_ended(app, att, current, report)
        if current["instance_id"]:
            _record_instance(app, att["provider"], current["instance_id"], att["id"], status)
    return RevertRow(att["job_id"], att["provider"], current["instance_id"], synced, status)


def _not_ended(app: App, att: dict[str, Any], current: dict[str, Any], report: RevertReport) -> None:
    """For the report, an attempt whose instance is not confirmed gone: its job released home by this revert-local
    (requeued locally, or held), or left out there, and why."""
    if current["state"] == AttemptState.RELEASED.value and att["state"] != AttemptState.RELEASED.value:
        _job_after_wind_down(app, att, current, report)
    elif current["state"] == AttemptState.TERMINATING.value and current["info"].get(RELEASE_HELD):
        report.not_home[att["job_id"]] = str(current["info"][RELEASE_HELD])


def _job_after_wind_down(app: App, att: dict[str, Any], ended: dict[str, Any], report: RevertReport) -> None:
    """Where the wound-down attempt's end put its job, for the report: finished, requeued locally or held. The end
    decides that (`finish.job_after_attempt`), and a running daemon may start the requeued job locally at once, so
    the job's state now does not tell; the events of this attempt's end do."""
    if ended["state"] == AttemptState.SUCCEEDED.value:
        report.finished.append(att["job_id"])
        return
    for e in app.store.events(job_id=att["job_id"], type_prefix="job."):
        if e["attempt_id"] != att["id"]:  # an attempt ends once: its end said one of these at most
            continue
        if e["type"] == "job.requeued_local" and att["job_id"] not in report.requeued_local:
            report.requeued_local.append(att["job_id"])
        elif e["type"] == "job.blocked" and att["job_id"] not in report.held:
            report.held.append(att["job_id"])


def _last_synced(app: App, att: dict[str, Any]) -> str | None:
    """The newest checkpoint this attempt brought home (from its events: once the attempt ends, a local run of the
    same job may already be writing newer ones into the store)."""
    synced = [e for e in app.store.events(job_id=att["job_id"], type_prefix="checkpoint.synced")
              if e["attempt_id"] == att["id"]]
    if synced:
        return synced[-1]["data"]["checkpoints"][-1]
    latest = checkpoints.latest(app.config, att["job_id"])
    return latest.name if latest else None


def _attempt(app: App, attempt_id: str) -> dict[str, Any]:
    with app.store.engine.connect() as c:
        return dict(c.execute(select(s.attempts).where(s.attempts.c.id == attempt_id)).mappings().one())


def _terminate_confirm(provider: Any, instance_id: str, deadline: float) -> str:
    try:
        provider.terminate([instance_id])
        while True:
            inst = provider.describe([instance_id]).get(instance_id)
            if inst is None or inst.state.gone:
                return "yes"
            if time.monotonic() > deadline:
                return "no"
            time.sleep(0.5)
    except ProviderError:
        return "unverified"


def _record_instance(app: App, provider: str, instance_id: str, attempt_id: str | None, status: str) -> None:
    now = time.time()
    gone = status == "yes"
    with app.store.tx() as c:
        known = c.execute(select(s.instances.c.id).where(s.instances.c.provider == provider,
                                                         s.instances.c.id == instance_id)).first()
        if known is None:
            c.execute(insert(s.instances).values(provider=provider, id=instance_id, attempt_id=attempt_id,
                                                 state="unverified", verified_gone=False))
        if gone:  # the meter stops now, not when a daemon next steps the attempt (days later, perhaps)
            confirmed_gone(app, c, provider, instance_id, gone_at=now, now=now)
        else:
            c.execute(update(s.instances).where(s.instances.c.provider == provider, s.instances.c.id == instance_id)
                      .values(verified_gone=False, state="unverified", gone_at=None, gone_by=None))


def _requeue_local(app: App, report: RevertReport) -> None:
    """Jobs bound for the cloud come home: local if they fit, else held until bursting is enabled again."""
    with app.store.engine.connect() as c:
        jobs = [dict(r) for r in c.execute(select(s.jobs).where(
            s.jobs.c.placement.in_(["cloud", "hybrid"]),
            s.jobs.c.state.in_([JobState.QUEUED.value, JobState.RESUMING.value, JobState.BLOCKED.value,
                                JobState.AWAITING_APPROVAL.value]))).mappings()]
        local_now = [dict(r) for r in c.execute(select(s.jobs).where(
            s.jobs.c.state == JobState.QUEUED.value, s.jobs.c.reason.like(f"{REQUEUED_LOCAL}%"))).mappings()]
    for job in jobs:
        fits = bool(job["decision"].get("fits_locally"))
        with app.store.tx() as conn:
            if fits:
                app.store.update_job(job["id"], conn, expect_state=job["state"], state=JobState.QUEUED.value,
                                     placement="local", reason=requeued_local_reason(app.config, job["id"]))
                app.events.emit("job.requeued_local", job_id=job["id"], conn=conn)
                report.requeued_local.append(job["id"])
            elif job["state"] != JobState.BLOCKED.value:
                app.store.update_job(job["id"], conn, expect_state=job["state"], state=JobState.BLOCKED.value,
                                     reason="does not fit locally: waits for `burstctl burst-enable`")
                app.events.emit("job.blocked", job_id=job["id"], conn=conn, reason="revert-local, does not fit")
                report.held.append(job["id"])
            elif job["id"] not in report.held:
                report.held.append(job["id"])
    report.already_local.extend(j["id"] for j in local_now if j["id"] not in report.requeued_local)
