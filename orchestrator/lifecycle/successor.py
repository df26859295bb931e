"""Make before break on a spot interruption notice.

EC2 gives two minutes between the notice and the reclaim; a GPU instance takes about as long to boot. So on the
notice (`Reconciler._on_notice`, as the pull of the newest checkpoint starts beside the tick) the job's next cloud
attempt is written at once,
on the offer and market its spot policy picks now, spot first in another zone than the one being reclaimed: the
*successor* (`info.successor_for`: the noticed attempt). It launches and boots like any attempt, then waits at
`bootstrapping` until the noticed attempt has ended (its last checkpoint pulled, its instance terminated), and is
bootstrapped from the newest checkpoint: the boot overlapped the last checkpoint instead of following it. A job with
a `setup` (say a pip install) has it started on the successor while it waits, so that it overlaps too.

Until it takes over (`info.took_over`), a successor's end is no news for its job (a refused launch, the job done or
cancelled meanwhile): the noticed attempt still speaks for the job, and its end decides what the job does next. A
successor whose predecessor ended with the job no longer waiting for a cloud attempt (done, failed, gone local,
blocked) is ended, `aborted`, and billed what it ran. Level-triggered on the database: a daemon killed at any point
carries on (the intent is found by its tags, a waiting successor waits again).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from orchestrator.app import burst_enabled
from orchestrator.lifecycle.budget_guard import expected_remaining_h
from orchestrator.lifecycle.handover import no_room, wait_or_take_over
from orchestrator.lifecycle.machine import HOLDING_ATTEMPT_STATES, AttemptState
from orchestrator.lifecycle.market_switch import spot_region_order
from providers.base import Market, Provider
from state import schema as s

if TYPE_CHECKING:
    from orchestrator.lifecycle.reconcile import Reconciler

A = AttemptState


def successor_of(att: dict[str, Any]) -> str | None:
    """The attempt a successor follows, if `att` is one that has not taken over yet."""
    info = att.get("info") or {}
    return None if info.get("took_over") else info.get("successor_for")


def written_successor(rec: Reconciler, att: dict[str, Any]) -> str | None:
    """The id of a successor written for `att` (in any state), if one was: a daemon that died after writing it and
    before noting its id in `att`'s notice has it found, not written again."""
    with rec.store.engine.connect() as c:
        rows = c.execute(select(s.attempts.c.id, s.attempts.c.info).where(
            s.attempts.c.job_id == att["job_id"], s.attempts.c.id != att["id"])).mappings()
        return next((str(r["id"]) for r in rows if (r["info"] or {}).get("successor_for") == att["id"]), None)


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
            s.attempts.c.job_id == job["id"], s.attempts.c.state.in_(HOLDING_ATTEMPT_STATES))).mappings()]
    if any(successor_of(a) == att["id"] for a in live):
        return None
    choice = rec.admission.choose_offer(job, now, quiet=True)
    if choice is None:
        return None
    provider_name, offer, market, facts = choice
    rate = offer.rate_usd_h(market)
    if no_room(rec, now, rate_usd_h=rate, minimum_s=offer.billing_minimum_s,
               expected_h=expected_remaining_h(rec.app, job, now), spec=job["spec"]) is not None:
        return None
    hold = rec.budget.hold_usd(job, rate, offer.billing_minimum_s, now)
    regions: list[str] = []
    if market is Market.SPOT:
        # The zone being reclaimed goes last: its capacity is what is being taken back.
        listed = list(spot_region_order(rec.app, provider_name, offer, now))
        regions = [r for r in listed if r != att["region"]] + [r for r in listed if r == att["region"]]
    with rec.store.tx() as conn:
        # A successor's refused launch is a sighting, not one of the job's launch failures.
        return rec.admission.write_intent(conn, job, provider_name, offer, market, facts, rate, regions, now,
                                          hold_usd=hold, successor_for=att["id"], failure_counted=False)


def waits(rec: Reconciler, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> bool:
    """For a successor at `bootstrapping`: True while its predecessor has not ended (it waits). Once it has, the
    successor takes the job over and False is returned (it bootstraps now), or, the job no longer waiting for a
    cloud attempt, the successor is ended and True returned."""
    predecessor = successor_of(att)
    assert predecessor is not None, "waits() is asked only of a successor that has not taken over"
    why_not = wait_or_take_over(
        rec, att, job, provider, predecessor=predecessor, info={**att["info"], "took_over": True},
        reason=f"resuming on {att['provider']} {att['instance_type']} ({att['market']}): the instance launched at "
               "the interruption notice", event="attempt.successor_taken_over", successor_for=predecessor)
    if why_not is not None:
        rec.stop(att, job, provider, f"successor not needed: {why_not}", outcome=A.ABORTED)
        return True
    if successor_of(att) is None:
        return False
    _setup_early(rec, att, job)
    return True


def _setup_early(rec: Reconciler, att: dict[str, Any], job: dict[str, Any]) -> None:
    """A waiting successor's idle minutes: prepare its instance and start the job's setup now (once), so that the
    takeover finds it done (or waits only for what is left of it) instead of running all of it then. Without a
    setup nothing is done early: the rest of a bootstrap takes seconds."""
    if not job["spec"].get("setup") or att["info"].get("setup_started_early"):
        return
    timings = rec.cloud_steps.start_setup_early(att, job)
    att["info"] = {**att["info"], "setup_started_early": rec.clock()}
    with rec.store.tx() as conn:
        rec.store.set_attempt_info(att["id"], att["info"], conn)
        rec.app.events.emit("attempt.setup_started_early", job_id=job["id"], attempt_id=att["id"], conn=conn,
                            instance=att["instance_id"], successor_for=successor_of(att), timings=timings)
