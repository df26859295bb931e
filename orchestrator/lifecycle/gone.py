"""An instance confirmed gone, and everything that waited for it: the one place that happens, whoever confirmed it.

Its provider confirms it (a terminate's look, the sweep's retry of an unverified one, revert-local's sweep), or the
operator does (`burstctl confirm-gone`), for a provider that will never answer again (the account closed, the key
deleted for good, the vendor gone). Either way the instance's row says it is gone and who said so, its open charges
end when it went, the attempt that waited for it (`terminating`, or `released` after revert-local) ends with the
outcome it recorded, its job takes the step that end gives it (a released one's job: measured again if over, back
on its plan if bursting is on), and a job over whose charge was still open is measured again with the whole of it.

The operator may be wrong: an instance their word took for gone that its provider later lists as running is an
orphan like any other (`orphans.record_orphan`): not confirmed gone any more, its charge open again from where it
was metered to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, insert, select

from orchestrator.app import App, burst_enabled
from orchestrator.core.release import OPERATOR, PROVIDER, WAITING_FOR_GONE, GoneFacts, operator_gone
from orchestrator.errors import BadInput
from orchestrator.lifecycle.finish import job_after_attempt, measure_again
from orchestrator.lifecycle.machine import ACTIVE_ATTEMPT_STATES, AttemptState, move
from orchestrator.lifecycle.spot_probe import is_probe
from orchestrator.lifecycle.successor import successor_of
from state import schema as s
from state.store import after_commit

A = AttemptState


@dataclass(frozen=True)
class Confirmed:
    """What a confirmation changed."""
    attempt_id: str | None  # the attempt that waited for it and has now ended
    outcome: str | None  # what that attempt ended with
    job_id: str | None
    released: bool  # that attempt was released (its job had gone on without it)
    closed: list[dict[str, Any]]  # the charges closed, as closed


def waiting_attempt(conn: Connection, provider: str, instance_id: str) -> dict[str, Any] | None:
    """The attempt whose end waits for this instance to be confirmed gone (`terminating`, or `released`), if any."""
    row = conn.execute(select(s.attempts).where(
        s.attempts.c.provider == provider, s.attempts.c.instance_id == instance_id,
        s.attempts.c.state.in_(sorted(WAITING_FOR_GONE)))).mappings().first()
    return dict(row) if row is not None else None


def confirmed_gone(app: App, conn: Connection, provider: str, instance_id: str | None, *, gone_at: float, now: float,
                   by: str = PROVIDER, attempt: dict[str, Any] | None = None, job: dict[str, Any] | None = None,
                   teardown_s: float | None = None) -> Confirmed | None:
    """The instance is gone (`by` its provider or the operator), in the caller's transaction: see the module.
    `attempt` and `job`: the attempt being stepped that waited for it and its job (else the one waiting is found);
    `gone_at`: when it went (`close_instance`);
    `teardown_s`: how long its provider took to terminate it, measured. Returns None when another process had
    already ended the attempt, or confirmed the instance gone (nothing is changed then)."""
    row = conn.execute(select(s.instances.c.verified_gone).where(
        s.instances.c.provider == provider, s.instances.c.id == instance_id)).first() if instance_id else None
    if attempt is None and instance_id is not None:
        attempt = waiting_attempt(conn, provider, instance_id)
        job = None
    if attempt is None and (row is None or row.verified_gone):
        return None
    released = attempt is not None and attempt["state"] == A.RELEASED.value
    outcome = A(attempt["info"].get("outcome", A.ABORTED.value)) if attempt is not None else None
    if attempt is not None and outcome is not None and not move(conn, attempt, outcome):
        return None  # ended by another process (a daemon, revert-local, the operator), with its instance
    closed = close_instance(app, conn, provider, instance_id, gone_at=gone_at, by=by) if instance_id else []
    if by == OPERATOR:
        app.events.emit("instance.confirmed_gone", conn=conn, by=OPERATOR, provider=provider, instance=instance_id,
                        at=gone_at, job_id=attempt["job_id"] if attempt else None,
                        attempt_id=attempt["id"] if attempt else None,
                        closed_usd=round(sum(float(c["cost_usd"]) for c in closed), 4))
    if attempt is not None and outcome is not None:
        if job is None:
            found = conn.execute(select(s.jobs).where(s.jobs.c.id == attempt["job_id"])).mappings().first()
            job = dict(found) if found is not None else {"id": attempt["job_id"], "state": "running", "spec": {}}
        if teardown_s is not None:  # how long its provider took: a part of every later decision's overhead
            conn.execute(insert(s.measurements).values(ts=now, provider=provider,
                                                       instance_type=attempt["instance_type"] or "local",
                                                       metric="teardown_s", value=float(teardown_s)))
        app.events.emit("instance.terminated", job_id=job["id"], attempt_id=attempt["id"], conn=conn,
                        instance=instance_id, outcome=outcome.value, **({"released": True} if released else {}),
                        **({"confirmed_by": by} if by != PROVIDER else {}))
        if not released:
            job_after_end(app, conn, attempt, job, outcome, attempt.get("reason"), now)
        else:  # its job went on without it: over since, it is measured again with this charge; else back to plan
            measure_again(app, conn, job["id"], now)
            job_id = str(job["id"])
            after_commit(conn, lambda: _back_to_plan(app, job_id, instance_id, by))
    # A job over while a charge of its instance was open (an orphan of a job done) is measured again with it.
    for other in sorted({str(c["job_id"]) for c in closed if c.get("job_id")} - {attempt["job_id"] if attempt else ""}):
        measure_again(app, conn, other, now)
    return Confirmed(attempt_id=attempt["id"] if attempt else None, outcome=outcome.value if outcome else None,
                     job_id=attempt["job_id"] if attempt else None, released=released, closed=closed)


def close_instance(app: App, conn: Connection, provider: str, instance_id: str, *, gone_at: float,
                   by: str = PROVIDER) -> list[dict[str, Any]]:
    """The instance's row says it is gone, and who said so; its open charges end when it went: at `gone_at`, or
    earlier if another process (revert-local, with no daemon running) saw it go then. Billed up to a daemon's look,
    an instance gone for days was billed for them. Returns the charges closed."""
    seen_gone = conn.execute(select(s.instances.c.gone_at).where(s.instances.c.provider == provider,
                                                                 s.instances.c.id == instance_id)).scalar()
    return app.store.instance_gone(conn, provider, instance_id, by=by,
                                   gone_at=min(gone_at, float(seen_gone)) if seen_gone is not None else gone_at)


def job_after_end(app: App, conn: Connection, att: dict[str, Any], job: dict[str, Any], outcome: AttemptState,
                  reason: str | None, now: float) -> None:
    """What an ended attempt means for its job (`finish.job_after_attempt`), in the caller's transaction; nothing for
    a spot probe (its end is a sighting) or a successor before it took over (its predecessor's news)."""
    if is_probe(att) or successor_of(att) is not None:
        return
    job_after_attempt(app, conn, att, job, outcome, reason, now)


def _back_to_plan(app: App, job_id: str, instance_id: str | None, by: str) -> None:
    """A released job, kept here by burst-enable while its instance from before might still bill
    (`core/release.relaunch_held`): that instance gone, it goes back to its plan unless it has started here since."""
    if not burst_enabled(app):
        return  # revert-local is in force: burst-enable puts it back
    from orchestrator.lifecycle.revert import restore_plans  # revert-local builds on the reconciler, which uses this

    said = "confirmed gone by the operator" if by == OPERATOR else "confirmed gone"
    restore_plans(app, only=[job_id], why=f"its instance from before, {instance_id}, is {said}")


@dataclass(frozen=True)
class OperatorSaid:
    """What `burstctl confirm-gone` did."""
    provider: str
    instance: str
    already: bool  # confirmed gone before: nothing changed
    by: str  # who confirmed it gone (the operator now; whoever did, when `already`)
    at: float | None  # when it went, as confirmed
    confirmed: Confirmed | None  # what this confirmation changed (None when `already`)


def operator_confirms(app: App, provider: str, instance_id: str, *, at: float | None, now: float) -> OperatorSaid:
    """The operator says the instance is gone (seen gone in the provider's console, or terminated there), `at` when
    it stopped billing (None: now): `core/release.operator_gone` decides whether that is taken, and
    `confirmed_gone` does what its provider's confirmation would, in one transaction. Raises BadInput, with nothing
    changed, for an instance burstctl does not know, one still under way, or a time that cannot be when it went."""
    at = now if at is None else at
    with app.store.tx() as conn:
        inst = conn.execute(select(s.instances).where(s.instances.c.provider == provider,
                                                      s.instances.c.id == instance_id)).mappings().first()
        if inst is None:
            raise _unknown(conn, provider, instance_id)
        live = conn.execute(select(s.attempts.c.id, s.attempts.c.state).where(
            s.attempts.c.provider == provider, s.attempts.c.instance_id == instance_id,
            s.attempts.c.state.in_(list(ACTIVE_ATTEMPT_STATES)))).first()
        led = s.ledger
        charge_from = conn.execute(select(func.min(led.c.started_at)).where(
            led.c.provider == provider, led.c.instance_id == instance_id, led.c.ended_at.is_(None))).scalar()
        verdict = operator_gone(GoneFacts(
            verified_gone=bool(inst["verified_gone"]), attempt=live.id if live else None,
            attempt_state=live.state if live else None,
            charge_from=float(charge_from) if charge_from is not None else inst["launched_at"], at=at, now=now))
        if verdict.problem is not None:
            raise BadInput(verdict.problem, field=verdict.field)
        if not verdict.already:
            confirmed = confirmed_gone(app, conn, provider, instance_id, gone_at=at, now=now, by=OPERATOR)
            if confirmed is not None:
                return OperatorSaid(provider, instance_id, already=False, by=OPERATOR, at=at, confirmed=confirmed)
        # Confirmed gone before, or by another process between the read and the write (its provider answered).
        gone = conn.execute(select(s.instances.c.gone_by, s.instances.c.gone_at).where(
            s.instances.c.provider == provider, s.instances.c.id == instance_id)).one()
        return OperatorSaid(provider, instance_id, already=True, by=gone.gone_by or PROVIDER,
                            at=gone.gone_at, confirmed=None)


def _unknown(conn: Connection, provider: str, instance_id: str) -> BadInput:
    """The argument an unknown instance is wrong in: its provider, when burstctl knows no instance there at all."""
    providers = sorted({p for (p,) in conn.execute(select(s.instances.c.provider).distinct())})
    if provider not in providers:
        return BadInput(f"burstctl knows no instance on '{provider}': expected the provider of an instance it launched "
                        f"or found ({', '.join(providers) or 'none yet'}; `burstctl status` lists those not confirmed "
                        "gone)", field="PROVIDER")
    return BadInput(f"burstctl knows no instance '{instance_id}' on {provider}: expected one it launched or found "
                    "there (`burstctl status` lists those not confirmed gone)", field="INSTANCE_ID")
