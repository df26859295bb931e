"""`burstctl confirm-gone`: the operator's word that an instance is gone, for a provider that will never say so."""

from __future__ import annotations

import time

import click
from rich.markup import escape

from orchestrator.app import App
from orchestrator.cli.base import cli, json_option, pass_app
from orchestrator.cli.output import out, print_json
from orchestrator.core.release import OPERATOR, utc
from orchestrator.errors import BadInput
from orchestrator.records import fmt_usd


@cli.command("confirm-gone")
@click.argument("provider")
@click.argument("instance_id")
@click.option("--at", "at", default=None, metavar="WHEN",
              help="When it stopped billing, as a job file's deadline is written: an ISO 8601 date and time with a "
                   "time zone (2035-01-01T09:00:00Z). Default: now.")
@json_option
@pass_app
def confirm_gone_cmd(app: App, provider: str, instance_id: str, at: str | None, as_json: bool) -> None:
    """Say that an instance is gone, when its provider never will (the account closed, the key deleted for good, the
    vendor gone) and you have seen it gone in its console, or terminated it there. For an instance burstctl is
    still terminating (`burstctl status` lists it: released by revert-local, terminating, an unverified orphan).

    Its open charge ends at --at, as its provider's confirmation would end it, and whatever waited for that goes
    on: its attempt ends, its job may launch in the cloud again, a job over is measured again with the whole
    charge. Works with the daemon running (its next tick sees it) or stopped. Should the provider answer again and
    list the instance running, it is metered again from --at and terminated."""
    from orchestrator.jobspec import parse_instant
    from orchestrator.lifecycle.gone import operator_confirms

    when = None
    if at is not None:
        try:
            when = parse_instant(at).timestamp()
        except ValueError as exc:
            raise BadInput(str(exc), field="--at") from None
    said = operator_confirms(app, provider, instance_id, at=when, now=time.time())
    confirmed = said.confirmed
    job = app.store.get_job(confirmed.job_id) if confirmed is not None and confirmed.job_id else None
    if as_json:
        closed = confirmed.closed if confirmed is not None else []
        print_json({"provider": provider, "instance": instance_id, "already_confirmed": said.already,
                    "by": said.by, "at": utc(said.at) if said.at is not None else None,
                    "attempt": confirmed.attempt_id if confirmed else None,
                    "attempt_outcome": confirmed.outcome if confirmed else None,
                    "job": job["id"] if job else None, "job_state": job["state"] if job else None,
                    "charges_closed": [{"id": c["id"], "job": c["job_id"], "started_at": utc(c["started_at"]),
                                        "ended_at": utc(c["ended_at"]), "billed_seconds": round(c["billed_seconds"], 1),
                                        "cost_usd": round(c["cost_usd"], 4)} for c in closed],
                    "closed_usd": round(sum(c["cost_usd"] for c in closed), 4)})
        return
    if said.already or confirmed is None:
        who = "the operator" if said.by == OPERATOR else "its provider"
        when_said = f" at {utc(said.at)}" if said.at is not None else ""
        out.print(f"{escape(provider)} {escape(instance_id)} was confirmed gone already, by {who}{when_said}: "
                  "nothing changed")
        return
    usd = sum(c["cost_usd"] for c in confirmed.closed)
    charge = (f"its charge closed then: {fmt_usd(usd)} in all" if confirmed.closed
              else "it had no charge open")
    out.print(f"{escape(provider)} {escape(instance_id)}: confirmed gone by the operator at {utc(said.at or 0)}; "
              f"{charge}")
    if confirmed.attempt_id is not None:
        out.print(f"attempt {confirmed.attempt_id} ended ({confirmed.outcome})"
                  + (f"; job {escape(job['name'])} ({job['id']}) is {job['state']}"
                     + (f": {escape(job['reason'])}" if job.get("reason") else "") if job else ""))
    out.print("[dim]if its provider answers again and lists it running, it is metered again from then and "
              "terminated[/dim]")
