"""`burstctl schedules`: the jobs the daemon queues on a schedule (`[[schedule]]`, orchestrator/schedules.py)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from rich.markup import escape

from orchestrator.app import App
from orchestrator.cli.base import cli, json_option, out, pass_app, print_json, table
from orchestrator.core.budget import month_end
from orchestrator.errors import BadInput
from orchestrator.jobspec import load_job
from orchestrator.schedules import KEY_PREFIX, next_slot, slots_between, trigger


def _local(ts: float | None) -> str:
    return "—" if ts is None else datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M %Z")


def schedule_rows(app: App, now: float) -> list[dict[str, Any]]:
    """Each schedule as the daemon sees it: its next slot, its last cycle, the slots left this month (UTC, the
    budget's month), and what is wrong with its job file now, if anything."""
    rows = []
    for sched in app.config.schedule:
        path = app.config.schedule_job(sched)
        trig = trigger(sched)
        rec = app.store.get_setting(KEY_PREFIX + str(path)) or {}
        last_job = app.store.get_job(rec["last_job_id"]) if rec.get("last_job_id") else None
        name, problem = None, None
        try:
            name = load_job(path, now)[0].name
        except BadInput as exc:
            problem = app.redactor(str(exc))
        rows.append({
            "job_file": str(path), "name": name, "cron": sched.cron, "timezone": str(trig.timezone),
            "overlap": sched.overlap, "armed": bool(rec), "next_slot_at": next_slot(trig, now),
            "last_slot_at": rec.get("last_slot_at"), "last_job_id": rec.get("last_job_id"),
            "last_job_state": last_job["state"] if last_job else None,
            "slots_left_this_month": len(slots_between(trig, now, month_end(now))), "problem": problem})
    return rows


@cli.command("schedules")
@json_option
@pass_app
def schedules_cmd(app: App, as_json: bool) -> None:
    """The jobs queued on a schedule ([[schedule]] in the config): each one's cron, next slot, last cycle and its
    state, the slots left this month, and whether its job file validates now (one that does not is skipped at its
    slot, and said). The daemon arms a new schedule at its next tick and queues from the slot after that."""
    rows = schedule_rows(app, time.time())
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print(escape(f"no [[schedule]] in {app.config.source or 'the config (none was read)'}"))
        return
    table("schedules", ["job", "cron", "next slot", "last cycle", "left this month"], [
        (escape(r["name"] or r["job_file"]), escape(f"{r['cron']} ({r['timezone']})"), _local(r["next_slot_at"]),
         (f"{r['last_job_id']} ({r['last_job_state']}), slot {_local(r['last_slot_at'])}" if r["last_job_id"] else
          f"none yet (slot {_local(r['last_slot_at'])} passed)" if r["last_slot_at"] else
          "none yet" if r["armed"] else "none: armed at the daemon's next tick"),
         r["slots_left_this_month"]) for r in rows])
    for r in rows:
        if r["problem"]:
            out.print(f"[bold]{escape(r['job_file'])}[/bold] would be skipped at its slot: {escape(r['problem'])}")
