"""Probing spot from on-demand, where spot is seen only by launching (EC2).

A provider that lists spot capacity shows spot coming back while a job runs on on-demand, so the spot policy can
move the job back. EC2 shows nothing: the only test is a spot launch. When the policy would move a job from
on-demand back to spot were spot up (`market_switch.attempt_should_move`), and the job's next probe is due, the
daemon launches one spot instance of the job's type beside the running one. A probe is a cloud attempt of its own
(`info.probe_for`: the attempt it probes for), so `market_switch.spot_sightings` reads its answer as it reads every
spot launch:
- at `daemon.max_cloud_attempts` (the probe would be one cloud attempt too many), or its billing minimum not fitting
  the budget: no launch, asked again at the next probe (`attempt.spot_probe` result `deferred`, with the reason).
- refused: costs nothing and ends `launch_failed` without touching the job's state. The next probe comes as for a
  job waiting for spot: after a tenth of the outage so far, between `daemon.launch_backoff_s` and
  `daemon.spot_probe_max_s` (`job.spec._spot_probe_at`, shared with the waiting job's probes).
- it came up: make before break. The probe's instance is kept (`info.kept`) while the caller moves the job off
  on-demand (checkpoint, stop); once that attempt has ended, the probe becomes the job's next attempt (bootstrap,
  resume from the checkpoint, on spot) instead of a second spot launch that capacity, just back, might refuse. The
  instance boots while the on-demand one checkpoints (`handover.py`, shared with the successor launched on a spot
  interruption notice).

Every step is level-triggered on what the database holds, so a daemon killed at any point carries on:
- killed after the launch, before the instance id was written (intent): the restart finds the instance by its tags
  and ends it, `aborted` (a sighting hours old is no reason to move); the sweep terminates anything left over.
- killed with the probe kept and the on-demand attempt still running: that attempt's stop reason is the kept probe
  (`kept_probe_for`), so the restart stops it and then hands the job to the probe.
- the job cancelled, bursting disabled, the budget cap reached, the instance gone, or the job no longer waiting for
  a cloud attempt once the on-demand attempt ended: the kept probe is ended, `aborted`, billed what it ran (the
  provider's minimum at least), charged to the job; its end never changes the job's state.

Replayed on setting (a) (`benchmarks/daemon_shell.py`), probing takes the EC2 daemon from $114.32 a run (on-demand
final: greedy's figure) to $108.84, about Uniform Progress's $108.08.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from orchestrator.lifecycle.finish import probe_interval_s
from orchestrator.lifecycle.handover import no_room, wait_or_take_over
from orchestrator.lifecycle.machine import ACTIVE_ATTEMPT_STATES, AttemptState, chaos_point, move
from orchestrator.lifecycle.machine import create as create_attempt
from providers.base import LAUNCH_REFUSALS, Market, Provider, ProviderError
from state import schema as s

if TYPE_CHECKING:
    from orchestrator.lifecycle.reconcile import Reconciler

A = AttemptState
PROBE_REASON = "spot probe"


def is_probe(att: dict[str, Any]) -> bool:
    return bool((att.get("info") or {}).get("probe_for"))


def probe_due(job: dict[str, Any], now: float) -> bool:
    return now >= float(job["spec"].get("_spot_probe_at", 0.0))


def is_kept(att: dict[str, Any]) -> bool:
    return is_probe(att) and bool(att["info"].get("kept"))


def probe_spot(rec: Reconciler, att: dict[str, Any], job: dict[str, Any], provider: Provider,
               facts: dict[str, Any], now: float) -> dict[str, Any] | None:
    """Launch a spot instance of `att`'s type as a probe. When it came up, the probe, kept to become the job's next
    attempt once `att` has stopped; else None."""
    rate = float(facts.get("spot_usd_h") or 0.0)
    minimum = float(att["info"].get("billing_minimum_s", 60.0))
    why_not = no_room(rec, now, rate_usd_h=rate, minimum_s=minimum)
    if why_not is not None:
        # A probe is a cloud attempt, and `max_cloud_attempts` bounds them all (quotas, what may bill at once), as
        # the budget does: the job stays where it is and asks again at its next probe, as after a refusal.
        wait_s = _next_probe(rec, job, facts, now)
        rec.emit("attempt.spot_probe", job_id=job["id"], attempt_id=att["id"], probe_for=att["id"], result="deferred",
                 reason=why_not, next_probe_s=round(wait_s, 1))
        return None
    with rec.store.tx() as conn:
        probe = create_attempt(
            conn, job["id"], where="cloud", provider=att["provider"], instance_type=att["instance_type"],
            market=Market.SPOT.value, owner=rec.owner, created_at=now,
            info={"probe_for": att["id"], "rate_usd_h": rate, "billing_minimum_s": minimum, "launch_tried": True,
                  "failure_counted": False, "gpu": att["info"].get("gpu"), "market_policy": facts})
    probe_id = probe["id"]
    said = {"job_id": job["id"], "attempt_id": probe_id, "probe_for": att["id"]}
    try:
        inst = rec.launch(probe, job, provider)
        chaos_point("probe-up")  # the probe's instance exists; the database does not know its id
    except LAUNCH_REFUSALS as exc:
        wait_s = _next_probe(rec, job, facts, now)
        with rec.store.tx() as conn:
            rec.refused(conn, probe, exc)
        rec.emit("attempt.spot_probe", **said, result="refused", error=type(exc).__name__,
                 next_probe_s=round(wait_s, 1))
        return None
    except ProviderError as exc:  # throttled/transient after retries: whether it launched is unknown
        _next_probe(rec, job, facts, now)
        rec.emit("attempt.spot_probe", **said, result="unknown", error=type(exc).__name__)
        return None  # `step_probe` looks it up by its tags next tick
    rec.adopt(probe, job, inst, "launched")
    probe["info"] = {**probe["info"], "kept": True}
    with rec.store.tx() as conn:
        rec.store.set_attempt_info(probe_id, probe["info"], conn)
        rec.app.events.emit("attempt.spot_probe", **said, conn=conn, result="up", instance=inst.id, kept=True)
    chaos_point("probe-kept")  # the probe is kept; the on-demand attempt has not been stopped
    return probe


def kept_probe_for(rec: Reconciler, att: dict[str, Any]) -> dict[str, Any] | None:
    """The live probe kept to take over from `att` (an on-demand attempt the job is moving off), if any."""
    if att["market"] != Market.ON_DEMAND.value or att["where"] != "cloud":
        return None
    with rec.store.engine.connect() as c:
        rows = c.execute(select(s.attempts).where(s.attempts.c.job_id == att["job_id"],
                                                  s.attempts.c.state.in_(ACTIVE_ATTEMPT_STATES))).mappings().all()
    return next((dict(r) for r in rows if is_kept(dict(r)) and r["info"]["probe_for"] == att["id"]), None)


def _next_probe(rec: Reconciler, job: dict[str, Any], facts: dict[str, Any], now: float) -> float:
    """Schedule the job's next probe (as a waiting job's: a tenth of the outage so far, within bounds)."""
    wait_s = probe_interval_s(rec.app, facts)
    job["spec"] = {**job["spec"], "_spot_probe_at": now + wait_s}
    with rec.store.tx() as conn:
        rec.store.update_job(job["id"], conn, spec=job["spec"])
    return wait_s


def step_probe(rec: Reconciler, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> None:
    """Drive a probe on: a kept one to its takeover (or its end), one left unfinished (the daemon stopped mid-probe,
    or its end is not confirmed yet) to its end."""
    state = A(att["state"])
    if state is A.INTENT:
        found = provider.find_attempt(att["id"])
        if found is None:
            with rec.store.tx() as conn:
                move(conn, att, A.ABORTED, reason=f"{PROBE_REASON}: no instance")
            return
        rec.adopt(att, job, found, "adopted")
        if A(att["state"]) is not A.PROVISIONING:
            return
    if state is A.TERMINATING:
        rec.step_terminating(att, job, provider)
    elif is_kept(att) and state is A.PROVISIONING:
        _step_kept(rec, att, job, provider)
    else:
        _end(rec, att, job, provider)


def _step_kept(rec: Reconciler, probe: dict[str, Any], job: dict[str, Any], provider: Provider) -> None:
    """A kept probe waits for the attempt it probed for to end, then becomes the job's next attempt."""
    info = {k: v for k, v in probe["info"].items() if k not in ("probe_for", "kept")}
    info["from_probe_for"] = probe["info"]["probe_for"]
    why_not = wait_or_take_over(
        rec, probe, job, provider, predecessor=probe["info"]["probe_for"], info=info,
        reason=f"bursting to {probe['provider']} {probe['instance_type']} (spot): the instance of the spot probe "
               "that came up", event="attempt.probe_taken_over", instance_type=probe["instance_type"])
    if why_not is not None:
        with contextlib.suppress(ProviderError):  # still terminating: `step_probe` asks again next tick
            _end(rec, probe, job, provider, why=why_not)


def _end(rec: Reconciler, probe: dict[str, Any], job: dict[str, Any], provider: Provider, *,
         why: str | None = None) -> None:
    reason = f"{PROBE_REASON}: {why}" if why else PROBE_REASON
    with rec.store.tx() as conn:
        move(conn, probe, A.TERMINATING, info={**probe["info"], "outcome": A.ABORTED.value,
                                                "stop_reason": reason}, reason=reason)
    rec.step_terminating(probe, job, provider)
