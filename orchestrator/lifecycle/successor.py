"""Make before break on a spot interruption notice.

EC2 gives two minutes between the notice and the reclaim; a GPU instance takes about as long to boot. So on the
notice (`Reconciler._on_notice`, once the newest checkpoint is home) the job's next cloud attempt is written at once,
on the offer and market its spot policy picks now, spot first in another zone than the one being reclaimed: the
*successor* (`info.successor_for`: the noticed attempt). It launches and boots like any attempt, then waits at
`bootstrapping` until the noticed attempt has ended (its last checkpoint pulled, its instance terminated), and is
bootstrapped from the newest checkpoint: the boot overlapped the last checkpoint instead of following it.

Until it takes over (`info.took_over`), a successor's end is no news for its job (a refused launch, the job done or
cancelled meanwhile): the noticed attempt still speaks for the job, and its end decides what the job does next. A
successor whose predecessor ended with the job no longer waiting for a cloud attempt (done, failed, gone local,
blocked) is ended, `aborted`, and billed what it ran. Level-triggered on the database: a daemon killed at any point
carries on (the intent is found by its tags, a waiting successor waits again).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update

from orchestrator.app import burst_enabled
from orchestrator.lifecycle.machine import ACTIVE_ATTEMPT_STATES, AttemptState
from orchestrator.lifecycle.market_switch import spot_region_order
from orchestrator.lifecycle.states import JobState
from providers.base import Market, Provider
from state import schema as s

if TYPE_CHECKING:
    from orchestrator.lifecycle.reconcile import Reconciler

A = AttemptState


def successor_of(att: dict[str, Any]) -> str | None:
    """The attempt a successor follows, if `att` is one that has not taken over yet."""
    info = att.get("info") or {}
    return None if info.get("took_over") else info.get("successor_for")


def launch_successor(rec: Reconciler, att: dict[str, Any], job: dict[str, Any], now: float) -> str | None:
    """Write the successor of `att` (noticed); its id, or None when the next launch waits for `att`'s end as before:
    turned off, bursting disabled, not resumable, no cloud attempt to spare, the policy waiting for spot or no offer
    with capacity, or the budget."""
    cfg = rec.cfg
    if not cfg.daemon.launch_on_notice or rec.cloud is None or not burst_enabled(rec.app):
        return None
    if not job["spec"].get("checkpoint", {}).get("resumable", True):
        return None
    with rec.store.engine.connect() as c:
        live = [dict(r) for r in c.execute(select(s.attempts).where(
            s.attempts.c.job_id == job["id"], s.attempts.c.state.in_(ACTIVE_ATTEMPT_STATES))).mappings()]
    if any(successor_of(a) == att["id"] for a in live):
        return None
    if rec.attempts_active("cloud") >= cfg.daemon.max_cloud_attempts:
        return None
    choice = rec.choose_offer(job, now, quiet=True)
    if choice is None:
        return None
    provider_name, offer, market, facts = choice
    rate = offer.price(market) or offer.on_demand_usd_h
    if rec.budget_problem(now, rate_usd_h=rate, minimum_s=offer.billing_minimum_s,
                          expected_h=rec._expected_remaining_h(job)) is not None:
        return None
    regions: list[str] = []
    if market is Market.SPOT:
        # The zone being reclaimed goes last: its capacity is what is being taken back.
        listed = list(spot_region_order(rec.app, provider_name, offer, now))
        regions = [r for r in listed if r != att["region"]] + [r for r in listed if r == att["region"]]
    with rec.store.tx() as conn:
        # A successor's refused launch is a sighting, not one of the job's launch failures.
        return rec.write_intent(conn, job, provider_name, offer, market, facts, rate, regions, now,
                                successor_for=att["id"], failure_counted=False)


def waits(rec: Reconciler, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> bool:
    """For a successor at `bootstrapping`: True while its predecessor has not ended (it waits). Once it has, the
    successor takes the job over and False is returned (it bootstraps now), or, the job no longer waiting for a
    cloud attempt, the successor is ended and True returned."""
    predecessor = successor_of(att)
    with rec.store.engine.connect() as c:
        before = c.execute(select(s.attempts.c.state).where(s.attempts.c.id == predecessor)).scalar()
        row = c.execute(select(s.jobs).where(s.jobs.c.id == job["id"])).mappings().first()
    if before is not None and not A(before).final:
        return True
    fresh = dict(row) if row is not None else {**job, "state": "gone"}
    if fresh["placement"] != "cloud" or fresh["state"] not in (JobState.QUEUED.value, JobState.RESUMING.value):
        rec._stop(att, job, provider, f"successor not needed: job {fresh['state']}", outcome=A.ABORTED)
        return True
    info = {**att["info"], "took_over": True}
    with rec.store.tx() as conn:
        if not rec.store.update_job(job["id"], conn, expect_state=fresh["state"], state=JobState.RUNNING.value,
                                    reason=f"resuming on {att['provider']} {att['instance_type']} ({att['market']}): "
                                           "the instance launched at the interruption notice"):
            return True  # the job moved meanwhile: looked at again next tick
        conn.execute(update(s.attempts).where(s.attempts.c.id == att["id"]).values(info=info))
        rec.app.events.emit("attempt.successor_taken_over", job_id=job["id"], attempt_id=att["id"], conn=conn,
                            successor_for=predecessor, instance=att["instance_id"], provider=att["provider"],
                            market=att["market"])
    att["info"] = info
    job.update(state=JobState.RUNNING.value)
    return False
