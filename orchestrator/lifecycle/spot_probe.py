"""Probing spot from on-demand, where spot is seen only by launching (EC2).

A provider that lists spot capacity shows spot coming back while a job runs on on-demand, so the spot policy can
move the job back. EC2 shows nothing: the only test is a spot launch. When the policy would move a job from
on-demand back to spot were spot up (`market_switch.attempt_should_move`), and the job's next probe is due, the
daemon launches one spot instance of the job's type and terminates it as soon as the provider has it: billed the
provider's minimum (a minute on EC2), charged to the job in the ledger. A refused launch costs nothing. Either
way the answer is a sighting: a probe is a cloud attempt of its own (`info.probe_for`: the attempt it probes for),
so `market_switch.spot_sightings` reads it as it reads every spot launch. It is never bootstrapped, never runs the
job, and ends `aborted` (came up) or `launch_failed` (refused) without touching the job's state. When it came up,
the caller moves the job to spot (checkpoint, stop, relaunch on spot). After a refusal the next probe comes as
for a job waiting for spot: after a tenth of the outage so far, between `daemon.launch_backoff_s` and
`daemon.spot_probe_max_s` (`job.spec._spot_probe_at`, shared with the waiting job's probes).

The intent is written before the launch, as for any attempt: a daemon that dies mid-probe finds the instance by
its tags on restart and terminates it (`step_probe`); the sweep terminates anything left over.

Replayed on setting (a) (`benchmarks/daemon_shell.py`), probing takes the EC2 daemon from $114.31 a run (on-demand
final: greedy's figure) to $108.93, about Uniform Progress's $108.08.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from sqlalchemy import insert

from orchestrator.lifecycle.finish import probe_interval_s
from orchestrator.lifecycle.machine import AttemptState, move
from providers.base import LAUNCH_REFUSALS, LaunchRequest, Market, OwnerTags, Provider, ProviderError
from state import schema as s

if TYPE_CHECKING:
    from orchestrator.lifecycle.reconcile import Reconciler

A = AttemptState
PROBE_REASON = "spot probe"


def is_probe(att: dict[str, Any]) -> bool:
    return bool((att.get("info") or {}).get("probe_for"))


def probe_due(job: dict[str, Any], now: float) -> bool:
    return now >= float(job["spec"].get("_spot_probe_at", 0.0))


def probe_spot(rec: Reconciler, att: dict[str, Any], job: dict[str, Any], provider: Provider,
               facts: dict[str, Any], now: float) -> bool:
    """Launch a spot instance of `att`'s type as a probe, and end it at once. True when it came up."""
    rate = float(facts.get("spot_usd_h") or 0.0)
    minimum = float(att["info"].get("billing_minimum_s", 60.0))
    if rec.budget_problem(now, rate_usd_h=rate, minimum_s=minimum) is not None:
        return False  # not even a minute of spot fits the budget: no probe, and the job stays where it is
    n = rec._next_attempt_number(job["id"])
    probe_id = f"{job['id']}-a{n}"
    row = {"id": probe_id, "job_id": job["id"], "n": n, "where": "cloud", "state": A.INTENT.value,
           "provider": att["provider"], "instance_type": att["instance_type"], "region": None,
           "market": Market.SPOT.value, "idempotency_key": f"{rec.cfg.orchestrator_id}-{probe_id}", "created_at": now,
           "info": {"probe_for": att["id"], "rate_usd_h": rate, "billing_minimum_s": minimum, "launch_tried": True,
                    "failure_counted": False, "gpu": att["info"].get("gpu"), "market_policy": facts}}
    with rec.store.tx() as conn:
        conn.execute(insert(s.attempts).values(**row))
    probe = {**row, "started_at": None, "instance_id": None}
    request = LaunchRequest(instance_type=att["instance_type"], market=Market.SPOT,
                            tags=OwnerTags(rec.cfg.orchestrator_id, job["id"], probe_id),
                            idempotency_key=row["idempotency_key"], ssh_public_key=rec.cloud.public_key)
    said = {"job_id": job["id"], "attempt_id": probe_id, "probe_for": att["id"]}
    try:
        inst = provider.launch(request)
        _chaos_point("probe-up")  # the probe's instance exists; the database does not know its id
    except LAUNCH_REFUSALS as exc:
        wait_s = _next_probe(rec, job, facts, now)
        with rec.store.tx() as conn:
            move(conn, probe, A.LAUNCH_FAILED, reason=f"{type(exc).__name__}: {rec.app.redactor(str(exc))}")
        rec.emit("attempt.spot_probe", **said, result="refused", error=type(exc).__name__,
                 next_probe_s=round(wait_s, 1))
        return False
    except ProviderError as exc:  # throttled/transient after retries: whether it launched is unknown
        _next_probe(rec, job, facts, now)
        rec.emit("attempt.spot_probe", **said, result="unknown", error=type(exc).__name__)
        return False  # `step_probe` looks it up by its tags next tick
    rec._adopt(probe, job, inst, "launched")
    rec.emit("attempt.spot_probe", **said, result="up", instance=inst.id)
    # A provider error while terminating leaves it terminating: `step_probe` asks again next tick. Either way the
    # job moves to spot.
    with contextlib.suppress(ProviderError):
        _end(rec, probe, job, provider)
    return True


def _next_probe(rec: Reconciler, job: dict[str, Any], facts: dict[str, Any], now: float) -> float:
    """Schedule the job's next probe (as a waiting job's: a tenth of the outage so far, within bounds)."""
    wait_s = probe_interval_s(rec.app, facts)
    job["spec"] = {**job["spec"], "_spot_probe_at": now + wait_s}
    with rec.store.tx() as conn:
        rec.store.update_job(job["id"], conn, spec=job["spec"])
    return wait_s


def step_probe(rec: Reconciler, att: dict[str, Any], job: dict[str, Any], provider: Provider) -> None:
    """Drive a probe left unfinished (the daemon stopped mid-probe, or its end is not confirmed yet) to its end."""
    state = A(att["state"])
    if state is A.INTENT:
        found = provider.find_attempt(att["id"])
        if found is None:
            with rec.store.tx() as conn:
                move(conn, att, A.ABORTED, reason=f"{PROBE_REASON}: no instance")
            return
        rec._adopt(att, job, found, "adopted")
        if A(att["state"]) is not A.PROVISIONING:
            return
    if state is A.TERMINATING:
        rec._step_terminating(att, job, provider)
    else:
        _end(rec, att, job, provider)


def _chaos_point(name: str) -> None:
    from orchestrator.lifecycle.reconcile import chaos_point  # the reconciler imports this module

    chaos_point(name)


def _end(rec: Reconciler, probe: dict[str, Any], job: dict[str, Any], provider: Provider) -> None:
    with rec.store.tx() as conn:
        move(conn, probe, A.TERMINATING, info={**probe["info"], "outcome": A.ABORTED.value,
                                                "stop_reason": PROBE_REASON}, reason=PROBE_REASON)
    rec._step_terminating(probe, job, provider)
