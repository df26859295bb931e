"""`burstctl schedules`: the jobs the daemon queues on a schedule (`[[schedule]]`, orchestrator/schedules.py)."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.markup import escape

from orchestrator.app import App
from orchestrator.cli.base import cli, json_option, pass_app
from orchestrator.cli.output import out, print_json, table
from orchestrator.core.budget import month_end, month_key
from orchestrator.errors import BadInput
from orchestrator.jobspec import JobSpec
from orchestrator.lifecycle.states import FINAL, JobState
from orchestrator.records import fmt_usd
from orchestrator.schedules import KEY_PREFIX, cycles_among, load_cycle_job, next_slot, slots_between, trigger


def _local(ts: float | None) -> str:
    return "—" if ts is None else datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M %Z")


def schedule_rows(app: App, now: float) -> list[dict[str, Any]]:
    """Each schedule as the daemon sees it: its next slot, its last cycle, the slots left this month (UTC, the
    budget's month) and the cycles they queue (with overlap "skip", none while the cycle before runs: a cycle
    taking the hours a cycle queued now is planned to; none at all while its job file does not validate, as the
    daemon skips every slot until it is fixed), and what is wrong with its job file now, if anything."""
    rows = []
    for sched in app.config.schedule:
        path = app.config.schedule_job(sched)
        trig = trigger(sched)
        rec = app.store.get_setting(KEY_PREFIX + str(path)) or {}
        last_job = app.store.get_job(rec["last_job_id"]) if rec.get("last_job_id") else None
        name, problem, plan = None, None, None
        try:
            spec, deadline_at = load_cycle_job(path, now)
            name = spec.name
            plan = _plan_now(app, spec, path, deadline_at, now)
        except BadInput as exc:
            problem = app.redactor(str(exc))
        end = month_end(now)  # the next month's first instant: a slot then is next month's
        slots = [at for at in slots_between(trig, now, end) if at < end]
        cycle_h = plan["hours"] if plan else None
        # The cycle not yet over, from its own slot (`last_slot_at` moves on at a slot skipped while it runs).
        running_slot = None if last_job is None or JobState(last_job["state"]) in FINAL \
            else last_job["spec"].get("_slot_at")
        busy_until = running_slot + cycle_h * 3600.0 if running_slot and cycle_h else None
        rows.append({
            "job_file": str(path), "name": name, "cron": sched.cron, "timezone": str(trig.timezone),
            "overlap": sched.overlap, "armed": bool(rec), "next_slot_at": next_slot(trig, now),
            "last_slot_at": rec.get("last_slot_at"), "last_job_id": rec.get("last_job_id"),
            "last_job_state": last_job["state"] if last_job else None,
            "slots_left_this_month": len(slots),
            "cycles_left_this_month": 0 if problem else cycles_among(slots, sched.overlap, cycle_h, busy_until),
            "last_cycle_cloud_usd": None if last_job is None else round(app.store.job_spend(last_job["id"])[0], 4),
            "plan_now": plan, "problem": problem})
    return rows


def _plan_now(app: App, spec: JobSpec, path: Path, deadline_at: float, now: float) -> dict[str, Any]:
    """How a cycle queued now would be decided (`burstctl decide` on the job file): its plan and its cloud cost."""
    from orchestrator.core.decision import decide
    from orchestrator.queue import context, job_facts

    d = decide(job_facts(app, spec, deadline_at, now, path), context(app, now)).to_dict()
    cloud = sum(p["cost_usd"] for p in d["plan"] or [] if p["where"] == "cloud")
    hours = max(p["start_after_h"] + p["hours"] for p in d["plan"]) if d["plan"] else None  # to its last phase's end
    return {"verdict": d["verdict"], "plan_kind": d["plan_kind"], "cloud_usd": round(cloud, 4),
            "market": d["market"], "hours": None if hours is None else round(hours, 4)}



@cli.command("schedules")
@json_option
@pass_app
def schedules_cmd(app: App, as_json: bool) -> None:
    """The jobs queued on a schedule ([[schedule]] in the config): each one's cron, next slot, last cycle (its state
    and cloud cost), how a cycle queued now would be decided and what it would cost, the slots left this month, and
    whether its job file validates now (one that does not is skipped at its slot, and said). The daemon arms a new
    schedule at its next tick and queues from the slot after that."""
    rows = schedule_rows(app, time.time())
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print(escape(f"no [[schedule]] in {app.config.source or 'the config (none was read)'}"))
        return
    table("schedules", ["job", "cron", "next slot", "last cycle", "a cycle now", "left this month"], [
        (escape(r["name"] or r["job_file"]), escape(f"{r['cron']} ({r['timezone']})"), _local(r["next_slot_at"]),
         _last(r), _plan_txt(r["plan_now"]), _left(r)) for r in rows])
    for r in rows:
        if r["plan_now"] and r["cycles_left_this_month"] != r["slots_left_this_month"]:
            out.print(f"[bold]{escape(r['name'] or r['job_file'])}[/bold]: a cycle takes about "
                      f"{r['plan_now']['hours']:.1f} h, so the slots that come while one runs are skipped (overlap = "
                      f"\"skip\"): {r['cycles_left_this_month']} cycles this month, of "
                      f"{r['slots_left_this_month']} slots")
        if r["problem"]:
            out.print(f"[bold]{escape(r['job_file'])}[/bold] would be skipped at its slot: {escape(r['problem'])}")
    from orchestrator.daemon import running_daemon

    if running_daemon(app) is None:
        out.print("[yellow]the daemon is not running: no cycle is queued until it is (`burstctl daemon`, or its "
                  "systemd unit)[/yellow]")
    if any(r["plan_now"] for r in rows):
        month = cloud_usd_left(rows)
        left = max(0.0, app.config.budget.monthly_cap_usd - app.store.month_spend(month_key(time.time())))
        out.print(f"this month's cycles left, planned as a cycle would be now: {fmt_usd(month)} of cloud; "
                  f"{fmt_usd(left)} of the budget is left")


def cloud_usd_left(rows: list[dict[str, Any]]) -> float:
    """What the cycles left this month would rent, each planned as a cycle queued now (`schedule_rows`)."""
    return sum(r["cycles_left_this_month"] * r["plan_now"]["cloud_usd"] for r in rows if r["plan_now"])


def _left(r: dict[str, Any]) -> str:
    """The cycles left this month, and the slots when a cycle outlasts the slots' spacing (overlap "skip"). A job
    file that does not validate queues none (said below the table)."""
    if r["problem"] or r["cycles_left_this_month"] == r["slots_left_this_month"]:
        return str(r["cycles_left_this_month"])
    return f"{r['cycles_left_this_month']} of {r['slots_left_this_month']} slots"


def _last(r: dict[str, Any]) -> str:
    if r["last_job_id"]:
        cost = f", {fmt_usd(r['last_cycle_cloud_usd'])} of cloud" if r["last_cycle_cloud_usd"] else ""
        return f"{r['last_job_id']} ({r['last_job_state']}{cost}), slot {_local(r['last_slot_at'])}"
    if r["last_slot_at"]:
        return f"none yet (slot {_local(r['last_slot_at'])} passed)"
    return "none yet" if r["armed"] else "none: armed at the daemon's next tick"


def _plan_txt(plan: dict[str, Any] | None) -> str:
    """How a cycle queued now would run, and its cloud cost."""
    if plan is None:
        return "—"
    how = plan["plan_kind"] or plan["verdict"]
    market = f" {plan['market']}" if plan["market"] and plan["cloud_usd"] else ""
    return f"{how}{market}, {fmt_usd(plan['cloud_usd'])} of cloud"
