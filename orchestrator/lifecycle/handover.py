"""An instance launched ahead of time takes its job over from the attempt before it.

Two kinds of cloud attempt are launched while the job's current attempt still runs, so that the next instance boots
while the current one writes its last checkpoint (make before break): a spot probe that came up while the job runs
on on-demand (`spot_probe.py`) and a successor launched on a spot interruption notice (`successor.py`). Both wait
for the attempt they follow (the *predecessor*) to end, then become the job's attempt; both are ended when the job
no longer needs them. This module is that shared part; each caller says how its attempt is ended and what it is
called once it took over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from orchestrator.lifecycle.budget_guard import expected_remaining_h
from orchestrator.lifecycle.machine import AttemptState
from orchestrator.lifecycle.states import JobState
from providers.base import Provider
from state import schema as s

if TYPE_CHECKING:
    from orchestrator.lifecycle.reconcile import Reconciler

A = AttemptState


def no_room(rec: Reconciler, now: float, *, rate_usd_h: float, minimum_s: float, expected_h: float = 0.0,
            spec: Mapping[str, Any] | None = None) -> str | None:
    """Why a second cloud attempt for a job may not be launched now (beside the one running), or None: it would
    be one cloud attempt more than `daemon.max_cloud_attempts` allows, or its billing minimum and the work expected
    of it would not fit the budget."""
    cap = rec.cfg.daemon.max_cloud_attempts
    running = rec.admission.attempts_active("cloud")
    if running >= cap:
        return f"{running} cloud attempts run, max_cloud_attempts is {cap}"
    return rec.budget.problem(now, rate_usd_h=rate_usd_h, minimum_s=minimum_s, expected_h=expected_h, spec=spec)


def wait_or_take_over(rec: Reconciler, att: dict[str, Any], job: dict[str, Any], provider: Provider, *,
                      predecessor: str, info: dict[str, Any], reason: str, event: str, **said: Any) -> str | None:
    """One tick of `att`, launched to take `job` over from the attempt `predecessor`.

    While the predecessor has not ended, `att` waits (None). Once it has, and the job still waits for a cloud
    attempt, `att` becomes the job's attempt: the job moves to running with `reason`, `att`'s info becomes `info`,
    and `event` says so (with `said`); None. Else, and at any time the job or the budget stops it or its instance
    is gone, why it is not needed: the caller ends it. Its end is then no news for the job.
    """
    with rec.store.engine.connect() as c:
        before = c.execute(select(s.attempts.c.state).where(s.attempts.c.id == predecessor)).scalar()
        row = c.execute(select(s.jobs).where(s.jobs.c.id == job["id"])).mappings().first()
    fresh = dict(row) if row is not None else {**job, "state": "gone"}
    why_not = rec.stop_reason(att, fresh)
    if why_not is None:
        inst = provider.describe([att["instance_id"]]).get(att["instance_id"])
        if inst is None or inst.state.gone:
            why_not = "instance gone"
    if why_not is None and before is not None and not A(before).final:
        return None  # the predecessor is still checkpointing and stopping: take over once it has ended
    if why_not is None and (fresh["placement"] != "cloud"
                            or fresh["state"] not in (JobState.QUEUED.value, JobState.RESUMING.value)):
        why_not = f"job {fresh['state']}"
    now = rec.clock()
    rate, minimum = float(att["info"].get("rate_usd_h") or 0.0), float(att["info"].get("billing_minimum_s", 60.0))
    if why_not is None:
        why_not = rec.budget.problem(now, rate_usd_h=rate, minimum_s=minimum,
                                     expected_h=expected_remaining_h(rec.app, fresh, now), spec=fresh["spec"])
    if why_not is not None:
        return why_not
    hold = rec.budget.hold_usd(fresh, rate, minimum, now)  # on the market it takes over on (a probe's: spot)
    with rec.store.tx() as conn:
        if not rec.store.update_job(job["id"], conn, expect_state=fresh["state"], state=JobState.RUNNING.value,
                                    reason=reason):
            return None  # the job moved meanwhile: looked at again next tick
        rec.store.set_attempt_info(att["id"], info, conn)
        rec.store.set_hold(job["id"], hold, conn)
        rec.app.events.emit(event, job_id=job["id"], attempt_id=att["id"], conn=conn, instance=att["instance_id"],
                            provider=att["provider"], market=att["market"],
                            resuming=fresh["state"] == JobState.RESUMING.value, hold_usd=round(hold, 4), **said)
    att["info"] = info
    job.update(state=JobState.RUNNING.value)
    return None
