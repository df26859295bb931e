"""Queue commands: enqueue, list, show, cancel, approve, retry, budget, events."""

from __future__ import annotations

import difflib
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click
from rich.markup import escape
from sqlalchemy import Connection, select

from orchestrator.app import App, burst_enabled
from orchestrator.cli.base import FiniteFloat, cli, json_option, pass_app, say_config_problem_now
from orchestrator.cli.output import out, print_json, table
from orchestrator.core.budget import BudgetView, cycle_prices, month_key, stop_horizon_h, unpaid_hand_over
from orchestrator.core.gates import MAX_DEADLINE_HOURS
from orchestrator.core.release import utc
from orchestrator.errors import BadInput
from orchestrator.events import EventTail
from orchestrator.lifecycle.homes import job_outputs_dir
from orchestrator.lifecycle.machine import (
    HOLDING_ATTEMPT_STATES,
    LAUNCHING,
    AttemptState,
    confirmed_by_operator,
    states_said,
)
from orchestrator.lifecycle.schedule import reported
from orchestrator.lifecycle.states import FINAL, JobState, awaits_approval, check_transition
from orchestrator.records import fmt_h, fmt_usd, plan_name
from state import schema as s
from state.schema import planned_launch_usd


def _when(ts: float | None) -> str:
    return "—" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M")


def _at(ts: float) -> str:
    """An event's time, to the second: a preemption and its resume are seconds apart."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def job_or_fail(app: App, ref: str, field: str = "JOB", *, newest: bool = False) -> dict[str, Any]:
    """The job `ref` names: an id, or a name that one job has, or that only one job not yet over has (the run of it
    that `cancel` or `approve` means when earlier runs are done). Otherwise the ids to choose from, or, for a command
    that only reads (`newest`), the newest of them (a schedule's cycles share a name), said on stderr. `field`: the
    argument or option that named it."""
    found = app.store.find_jobs(ref)  # newest first
    if not found:
        raise BadInput(f"no job with id or name '{ref}'", field=field)
    active = [j for j in found if not JobState(j["state"]).final]
    if len(found) == 1 or len(active) == 1:
        return found[0] if len(found) == 1 else active[0]
    if newest:
        chosen = (active or found)[0]
        click.echo(f"{ref}: the newest of {len(found)} jobs of that name, {chosen['id']} ({chosen['state']}); "
                   "give an id for another (burstctl list --all)", err=True)
        return chosen
    choices = ", ".join(f"{j['id']} ({j['state']})" for j in (active or found))
    raise BadInput(f"{len(active or found)} jobs are named '{ref}': give one of their ids: {choices}", field=field)


def _states_said(app: App, jobs: list[dict[str, Any]]) -> dict[str, str]:
    """Each job's state as `list` and `show` say it (`machine.states_said`: `launching` for a running job whose
    launch no provider has confirmed yet)."""
    with app.store.engine.connect() as c:
        return states_said(c, jobs)


def _public(job: dict[str, Any], said: str | None = None) -> dict[str, Any]:
    """`said`: the job's state as the table says it, where known; `state` is the job state machine's."""
    return {
        "id": job["id"], "name": job["name"], "kind": job["kind"], "state": job["state"],
        **({"launching": said == LAUNCHING} if said is not None else {}),
        "verdict": job["verdict"], "placement": job["placement"], "approved": bool(job["approved"]),
        "reason": job["reason"], "deadline": datetime.fromtimestamp(job["deadline_at"], UTC).isoformat(),
        "created": datetime.fromtimestamp(job["created_at"], UTC).isoformat(),
        "record": job["record_path"],
    }


@cli.command("enqueue")
@click.argument("job_file")
@json_option
@pass_app
def enqueue_cmd(app: App, job_file: str, as_json: bool) -> None:
    """Validate JOB_FILE, decide it, write its decision record and queue it. Prints the job id."""
    from orchestrator.queue import enqueue  # the decision core: only this command of the module needs it

    job_id, decision, record = enqueue(app, job_file)
    d = decision.to_dict()
    job = app.store.get_job(job_id)
    assert job is not None
    cloudless = _no_cloud_from_here(app) if job["placement"] in ("cloud", "hybrid") else None
    if as_json:
        print_json({**_public(job), "decision": d})
    else:
        out.print(job_id)
        out.print(f"[dim]{job['name']}: {d['verdict']} → {job['state']}; {escape(job['reason'] or '')}[/dim]")
        out.print(f"[dim]decision record: {record}[/dim]")
    if cloudless:
        click.echo(f"burstctl: note: {cloudless}", err=True)


def _no_cloud_from_here(app: App) -> str | None:
    """Why no enabled provider can be used with this shell's credentials, for a job that must burst; None when one
    can. Said, not refused: the daemon's own environment (a systemd env file) may hold the keys."""
    from providers.registry import build

    slots = [slot for slot in build(app.config, orchestrator_id=app.orchestrator_id).values() if slot.enabled]
    if not slots:
        return "no provider is enabled in the config: this job waits until one is"
    if any(slot.provider is not None for slot in slots):
        return None
    why = "; ".join(f"{slot.name}: {slot.problem}" for slot in slots)
    return (f"no enabled provider can be used from this shell ({why}): the daemon needs the credentials in its own "
            "environment (`burstctl providers` checks them)")


LIST_FINISHED = 20  # `burstctl list` without --all: every job not over, and the newest this many finished ones
LIST_ROWS = 200  # and in its table (not --json) at most this many rows: 10,000 queued jobs took 8.7 s to draw


@cli.command("list")
@click.option("--state", "states", multiple=True, type=click.Choice([st.value for st in JobState]),
              help="Only jobs in this state (repeatable).")
@click.option("--all", "show_all", is_flag=True, help=f"Every finished job, not only the newest {LIST_FINISHED}; "
              f"and the table's every row, not the first {LIST_ROWS}.")
@json_option
@pass_app
def list_cmd(app: App, states: tuple[str, ...], show_all: bool, as_json: bool) -> None:
    """List jobs, oldest first: every job not over, and the newest 20 finished ones unless --all (the table draws
    the first 200 rows)."""
    jobs, hidden = _listed(app, states, show_all)
    note = f"{hidden} older finished job{'s' if hidden != 1 else ''} not shown (--all lists them)" if hidden else None
    said = _states_said(app, jobs)
    if as_json:
        print_json([{**_public(j, said[j["id"]]), "plan": plan_name(j["decision"]),  # the table's columns, as numbers
                     "plan_cost_usd": j["decision"].get("plan_cost_usd"),
                     "over_local_usd": _over_local_usd(j["decision"])} for j in jobs])
        if note:
            click.echo(note, err=True)
        return
    if not jobs:
        out.print("no jobs")
        return
    rows = jobs if show_all else jobs[:LIST_ROWS]
    table(None, ["id", "name", "kind", "verdict", "state", "placement", "plan", "over local", "deadline (UTC)"],
          [(j["id"], j["name"], j["kind"], j["verdict"], said[j["id"]], j["placement"], _plan_txt(j["decision"]),
            _over_local(j["decision"]), _when(j["deadline_at"])) for j in rows])
    if len(rows) < len(jobs):
        out.print(f"[dim]{len(jobs) - len(rows)} more not shown: `burstctl status` counts them by state; --all "
                  "draws every row, --json lists them, --state narrows[/dim]")
    # Why the jobs that are held are held (blocked, awaiting approval): the question `list` is most often run to
    # answer. A few lines, not one per job of a long queue.
    waiting = [j for j in jobs if j["reason"] and (j["state"] in WAITING_STATES or awaits_approval(j))]
    for j in waiting[:REASONS_SHOWN]:
        out.print(f"[dim]{escape(j['id'])} {escape(j['state'])}: {escape(j['reason'])}[/dim]")
    if len(waiting) > REASONS_SHOWN:
        out.print(f"[dim]... and {len(waiting) - REASONS_SHOWN} more waiting (`burstctl show JOB` says why)[/dim]")
    if note:
        out.print(f"[dim]{note}[/dim]")


# A queued job's reason is its decision's last word, not a hold-up; these states are held until something changes.
WAITING_STATES = (JobState.BLOCKED.value, JobState.AWAITING_APPROVAL.value)
REASONS_SHOWN = 10


def _listed(app: App, states: tuple[str, ...], show_all: bool) -> tuple[list[dict[str, Any]], int]:
    """The jobs `list` shows, oldest first, and how many finished ones it leaves out. Months of finished jobs
    would otherwise be read, decoded and drawn on every `list` (10,000 took 11 s, almost all of it the table)."""
    if show_all:
        return app.store.list_jobs(states or None), 0
    wanted = [JobState(st) for st in states] if states else list(JobState)
    live = [st.value for st in wanted if not st.final]
    over = [st.value for st in wanted if st.final]
    jobs = app.store.list_jobs(live) if live else []
    finished = app.store.newest_jobs(over, LIST_FINISHED) if over else []
    counts = app.store.count_jobs_by_state()
    hidden = sum(counts.get(st, 0) for st in over) - len(finished)
    return sorted(jobs + finished, key=lambda j: j["created_at"]), hidden


def _over_local_usd(d: dict[str, Any]) -> float | None:
    """What a priced job's plan costs more than running it locally: what `policy.max_auto_delta_usd` is held against
    (not the seed's all-on-demand ΔC, which `show` and `decide` print). None for a job that is not priced."""
    if d.get("verdict") != "priced" or d.get("plan_cost_usd") is None or d.get("c_local_usd") is None:
        return None
    return round(float(d["plan_cost_usd"] - d["c_local_usd"]), 4)  # as the two are: 9.5265, not 9.526499999999999


def _over_local(d: dict[str, Any]) -> str:
    over = _over_local_usd(d)
    return "—" if over is None else fmt_usd(over)


def _plan_txt(d: dict[str, Any]) -> str:
    name = plan_name(d)
    return "—" if name is None else f"{name} {fmt_usd(d.get('plan_cost_usd'))}"


SHOW_EVENTS = 15


@cli.command("show")
@click.argument("job")
@json_option
@pass_app
def show_cmd(app: App, job: str, as_json: bool) -> None:
    """Show one job: its decision, state and recent events."""
    j = job_or_fail(app, job, newest=True)
    # The table shows the newest 15: only those are read (a job that ran for weeks has thousands).
    evs = app.store.events(job_id=j["id"], newest=None if as_json else SHOW_EVENTS)
    progress = _progress(app, j)
    state = _states_said(app, [j])[j["id"]]
    if as_json:
        print_json({**_public(j, state), "spec": j["spec"], "decision": j["decision"], "progress": progress,
                    "events": [_event_public(e) for e in evs]})
        return
    d = j["decision"]
    out.print(f"[bold]{j['name']}[/bold] ({j['id']}) — {j['kind']}, {state}"
              + (f": {escape(j['reason'])}" if j["reason"] else ""))
    # The decision as it was made (an approval, a revert-local or a hand-over since moves the job, not the record).
    out.print(f"decided: verdict {d['verdict']} → {d['action']}; T_L {fmt_h(d['t_local_h'])}, "
              f"T_R {fmt_h(d['t_rented_h'])}, ΔC (all on-demand) {fmt_usd(d['delta_cost_usd'])}, "
              f"market {d.get('market') or '—'}, plan {d.get('plan_kind') or '—'} {fmt_usd(d.get('plan_cost_usd'))}")
    if j["placement"] == "local" and d.get("placement") in ("cloud", "hybrid"):  # only revert-local moves one home
        out.print(f"  now placed local, not {d['placement']} as decided: revert-local brought it home"
                  + ("; bursting is still off (`burstctl burst-enable` puts it back on its plan unless it has "
                     "started here)" if not burst_enabled(app) and JobState(j["state"]) not in FINAL else ""))
    for r in d["reasons"]:
        out.print(f"  · {escape(r)}")
    out.print(f"deadline {_when(j['deadline_at'])} UTC; record {escape(j['record_path'])}")
    if j["spec"].get("_slot_at"):
        out.print(f"queued by its schedule for the slot of {_when(j['spec']['_slot_at'])} UTC (burstctl schedules)")
    said = []
    if progress["units_done"] is not None:
        speed = progress["throughput_units_h"]
        said.append(f"{progress['units_done']:.4g} of {j['spec'].get('work_units', 1):.4g} units done (the trainer's "
                    f"figure{f', {speed:.4g} units/h' if speed is not None else ''})")
    if progress["cloud_usd"] or progress["accruing_usd_h"]:
        said.append(f"cloud spend so far {fmt_usd(progress['cloud_usd'])}"
                    + (f", accruing ${progress['accruing_usd_h']:.2f}/h" if progress["accruing_usd_h"] else ""))
    if said:
        out.print("progress: " + "; ".join(said))
    if (now := progress["now"]) is not None:
        on = (f"on {now['provider']} {now['instance_type']} ({now['market'] or 'market not chosen yet'})"
              + (f", instance {now['instance_id']}" if now["instance_id"] else "")
              if now["where"] == "cloud" else "on the local GPU")
        out.print(f"now: attempt {now['attempt']}, {now['state']}, {escape(on)}")
    for gone in progress["being_terminated"]:
        named = f"{escape(str(gone['provider']))} {escape(str(gone['instance_id']))}"
        out.print(f"instance {named} (attempt {gone['attempt']}): the job came home without it; being terminated, "
                  "not yet confirmed gone (its provider does not answer), and metered until it is; no other instance "
                  f"is launched for the job until then (`burstctl confirm-gone {named}` once you have seen it gone "
                  "in its provider's console)")
    for gone in progress["confirmed_gone_by_operator"]:
        out.print(f"instance {escape(str(gone['provider']))} {escape(str(gone['instance']))}"
                  + (f" (attempt {escape(str(gone['attempt']))})" if gone["attempt"] else "")
                  + f": confirmed gone by the operator, not its provider, at {utc(gone['gone_at'])}; its charge "
                  "ends then")
    if progress["attempts_run"]:
        runs = progress["attempts_run"]
        out.print(f"logs: burstctl logs {j['id']} ({runs} attempt{'s' if runs != 1 else ''}, in "
                  f"{escape(str(app.config.state_dir / 'runs'))}/{j['id']}-a<N>/)")
    for lost in progress["checkpoints_lost"]:
        back_to = lost.get("resumes_from") or "the start"
        out.print(f"lost: attempt {lost['attempt']}'s checkpoint {escape(lost['checkpoint'])} did not come home "
                  f"before its instance was lost; the job went back to {escape(back_to)}")
    for late in progress["checkpoints_lost_came_home"]:
        out.print(f"home after all: attempt {late['attempt']}'s checkpoint {escape(late['checkpoint'])}, said lost "
                  "with its instance, came home with a pull that ended after the loss")
    outputs = job_outputs_dir(app.config, j["id"])
    if outputs.is_dir():  # brought home from the instance it finished on
        count = sum(1 for f in outputs.rglob("*") if f.is_file())
        out.print(f"outputs: {escape(str(outputs))} ({count} file{'s' if count != 1 else ''})")
    if evs:
        table("events", ["time", "type", "data"],
              [(_at(e["ts"]), e["type"], _short(e["data"])) for e in evs])


def _progress(app: App, j: dict[str, Any]) -> dict[str, Any]:
    """How far the job is, as its trainer last reported it (its newest attempt that said), and what its cloud
    instances have cost so far (the ledger: closed charges at cost, open ones at their rate until now)."""
    now = ("state", "where", "provider", "instance_type", "market", "instance_id")  # of the attempt under way
    with app.store.engine.connect() as c:
        rows = c.execute(select(s.attempts.c.info, s.attempts.c.started_at, s.attempts.c.n,
                                *(s.attempts.c[k] for k in now))
                         .where(s.attempts.c.job_id == j["id"]).order_by(s.attempts.c.n.desc())).all()
        by_operator = confirmed_by_operator(c, job_ids=[j["id"]])
    live = next((r for r in rows if r.state in HOLDING_ATTEMPT_STATES), None)
    infos = [r.info or {} for r in rows]
    said = next((i.get("metrics") for i in infos if reported(i.get("metrics"), "units_done") is not None), None)
    cloud, accruing = app.store.job_spend(j["id"])
    return {"units_done": reported(said, "units_done"), "throughput_units_h": reported(said, "throughput_units_h"),
            "cloud_usd": round(cloud, 4), "accruing_usd_h": round(accruing, 4),
            "attempts_run": sum(1 for r in rows if r.started_at is not None),
            # The attempt under way: where it runs now, which may not be the market decided (a deadline come near
            # moves a spot run to on-demand; a spot probe waits on it).
            "now": None if live is None else {"attempt": live.n, **{k: getattr(live, k) for k in now}},
            # Instances of attempts the job went on without (revert-local, their provider not answering): still
            # being terminated, and metered, until the provider confirms them gone.
            "being_terminated": [{"attempt": r.n, "provider": r.provider, "instance_id": r.instance_id}
                                 for r in reversed(rows) if r.state == AttemptState.RELEASED.value],
            # ...and those the operator said were gone (`confirm-gone`), their provider never having said it.
            "confirmed_gone_by_operator": [{k: g[k] for k in ("provider", "instance", "attempt", "gone_at")}
                                           for g in by_operator],
            # Checkpoints an attempt's instance held, newer than home, when it was lost (`checkpoint.lost`).
            "checkpoints_lost": [{"attempt": r.n, **(r.info or {})["checkpoint_lost"]} for r in reversed(rows)
                                 if (r.info or {}).get("checkpoint_lost")],
            # ...and those a pull that ended after the loss brought home all the same (`checkpoint.lost_corrected`).
            "checkpoints_lost_came_home": [{"attempt": r.n, **(r.info or {})["checkpoint_lost_came_home"]}
                                           for r in reversed(rows)
                                           if (r.info or {}).get("checkpoint_lost_came_home")]}


def _short(data: dict[str, Any], limit: int = 90) -> str:
    text = json.dumps({k: v for k, v in data.items() if k not in ("decision", "inputs")}, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _event_public(e: dict[str, Any]) -> dict[str, Any]:
    return {"id": e["id"], "ts": datetime.fromtimestamp(e["ts"], UTC).isoformat(), "type": e["type"],
            "job": e["job_id"], "attempt": e["attempt_id"], **e["data"]}


def _set_state(app: App, ref: str, target: JobState, event: str,
               also: Callable[[Connection, dict[str, Any]], None] | None = None, **extra: Any) -> dict[str, Any]:
    """Move the job to `target` and say so (`event`); `also`: more done in the same transaction, given the job as it
    was read."""
    j = job_or_fail(app, ref)
    check_transition(j["state"], target.value, j["id"])
    with app.store.tx() as conn:
        if not app.store.update_job(j["id"], conn, expect_state=j["state"], state=target.value, **extra):
            raise BadInput(f"job {j['id']} changed state meanwhile; try again", field="JOB")
        app.events.emit(event, job_id=j["id"], conn=conn, previous=j["state"], state=target.value)
        if also is not None:
            also(conn, j)
    new = app.store.get_job(j["id"])
    assert new is not None
    return new


@cli.command("cancel")
@click.argument("job")
@json_option
@pass_app
def cancel_cmd(app: App, job: str, as_json: bool) -> None:
    """Cancel a job that has not finished. A running job is stopped by the daemon on its next tick."""
    from orchestrator.lifecycle.finish import measure_cancelled

    # Its decision record's Measured line: now, unless an attempt still runs (measured once the daemon stops it).
    j = _set_state(app, job, JobState.CANCELLED, "job.cancelled", reason="cancelled by the user",
                   also=lambda conn, was: measure_cancelled(app, conn, was, time.time()))
    print_json(_public(j)) if as_json else out.print(f"{j['id']} cancelled")


@cli.command("approve")
@click.argument("job")
@json_option
@pass_app
def approve_cmd(app: App, job: str, as_json: bool) -> None:
    """Approve the price of a job's deadline. A job awaits approval when its plan costs more than running it
    locally (`over local` in `list`) by more than policy.max_auto_delta_usd; approved, it is queued to burst. A
    local run re-planned behind schedule (running, its price awaiting approval) bursts the rest instead of running
    on, late."""
    j = job_or_fail(app, job)
    if not awaits_approval(j):
        raise BadInput(f"job {j['id']} is {j['state']}, not awaiting approval", field="JOB")
    plan = j["decision"].get("plan") or []
    local_first = next((p for p in plan if p["where"] == "local"), None) if j["placement"] == "hybrid" else None
    held_whole = j["state"] == JobState.AWAITING_APPROVAL.value
    if local_first:
        runs = (f"{local_first['hours']:.2f} h on the local GPU first (when it is free), then the rest bursts"
                if held_whole else "its local phase runs on, and the rest bursts at its hand-over")
    else:
        runs = "queued to burst" if held_whole else "it bursts the rest"
    unpaid = unpaid_hand_over(planned_launch_usd(j["decision"]), app.config.budget.monthly_cap_usd)
    if local_first and unpaid:  # approved or not, no month's budget pays the hand-over: not promised
        runs = f"{local_first['hours']:.2f} h on the local GPU first; {unpaid}"
    if held_whole:
        j = _set_state(app, job, JobState.QUEUED, "job.approved", approved=True,
                       reason=f"deadline price approved: {runs}")
    else:  # queued or running (a hybrid's local phase, a local run re-planned behind schedule): only approved
        with app.store.tx() as conn:
            if not app.store.update_job(j["id"], conn, expect_state=j["state"], approved=True,
                                        reason=f"deadline price approved: {runs}"):
                raise BadInput(f"job {j['id']} changed state meanwhile; try again", field="JOB")
            app.events.emit("job.approved", job_id=j["id"], conn=conn, previous=j["state"], state=j["state"])
        j = app.store.get_job(j["id"]) or j
    print_json(_public(j)) if as_json else out.print(f"{j['id']} approved: {runs}")


@cli.command("retry")
@click.argument("job")
@click.option("--deadline-hours", type=FiniteFloat(min=0, min_open=True, max=MAX_DEADLINE_HOURS), default=None,
              help="A new deadline, this many hours from now (else the job's own, which must not have passed).")
@click.option("--reread", is_flag=True, help="Read its job file again (a fixed command line, setup or env); its "
              "deadline then counts from now, as enqueue's would.")
@json_option
@pass_app
def retry_cmd(app: App, job: str, deadline_hours: float | None, reread: bool, as_json: bool) -> None:
    """Queue a failed, cancelled or rethink job again. It is decided afresh on the work it has left, and its next
    attempt resumes from its newest checkpoint with the workdir as it is now: fix the bug, then retry. With
    --reread its job file is read again too. A new decision record describes the retry."""
    from orchestrator.queue import retry  # the decision core: only this command of the module needs it

    j = job_or_fail(app, job)
    now = time.time()
    again = retry(app, j, now, deadline_at=None if deadline_hours is None else now + deadline_hours * 3600,
                  reread=reread)
    new = app.store.get_job(j["id"])
    assert new is not None
    if as_json:
        print_json({**_public(new), "work_done": again.work_done, "work_left": again.facts.work,
                    "decision": again.decision})
        return
    out.print(f"{new['id']} {j['state']} → {new['state']}: {escape(new['reason'] or '')}")
    if again.work_done > 0:
        out.print(f"[dim]resumes from its newest checkpoint: {again.work_done:.4g} units done, "
                  f"{again.facts.work:.4g} left[/dim]")
    out.print(f"[dim]decision record: {new['record_path']}[/dim]")


@cli.command("budget")
@json_option
@pass_app
def budget_cmd(app: App, as_json: bool) -> None:
    """Month-to-date spend, cycles, $/cycle on spot and on-demand, and the cycles the rest buys."""
    from orchestrator.daemon import daemon_tick_s
    from orchestrator.holds import held_by_plans
    from orchestrator.queue import offers_seen  # the decision core: only this command needs it

    cfg = app.config
    now = time.time()
    month = month_key(now)
    rows = app.store.ledger_rows(month)
    cycles = len({r["job_id"] for r in rows if r["job_id"]})
    ref_gpu = cfg.budget.cycle_gpu
    price = cfg.prices[ref_gpu]
    # Priced as decisions price a machine: what providers last listed for one such GPU, else [prices].
    listed = offers_seen(app, now)[0].get((ref_gpu.upper(), 1))
    od_rate, spot_rate = ((listed.od_usd_per_gpu_h, listed.spot_usd_per_gpu_h) if listed is not None
                          else (price.on_demand_usd_h, price.spot_usd_h))
    priced_by = f"as {listed.seen} listed" if listed is not None else f"[prices.{ref_gpu}]"
    spot, od = cycle_prices(cfg.budget.cycle_gpu_hours, od_rate, spot_rate)
    view = BudgetView(month, cfg.budget.monthly_cap_usd, app.store.month_spend(month, now), cycles, spot, od)
    # Running instances go on billing until stopped: the daemon keeps what stopping them takes out of "left" before
    # it launches anything new, so a launch can be refused with money seemingly left.
    from orchestrator.lifecycle.local import stop_grace_s

    accruing = sum(r["rate_usd_h"] for r in rows if r["ended_at"] is None)
    tick_s = daemon_tick_s(app)
    kept = sum(r["rate_usd_h"] * stop_horizon_h(tick_s, stop_grace_s((app.store.get_job(r["job_id"] or "") or {})
                                                                     .get("spec") or {}))
               for r in rows if r["ended_at"] is None)  # each its job's grace too, as the daemon keeps it
    # What new cycles can have: less what admitted jobs hold and what stopping the running ones takes.
    held = held_by_plans(app, now)
    free = BudgetView(month, view.cap_usd, view.spent_usd + held.usd + kept, cycles, spot, od)
    scheduled: int | None = None  # the cadence the schedules ask for, beside the one the budget buys
    scheduled_usd = 0.0  # what their cycles that burst would rent this month, each planned as one queued now
    broken: list[str] = []  # the job files of schedules whose file does not validate now
    if cfg.schedule:
        from orchestrator.cli.schedules import cloud_usd_left, schedule_rows

        rows = schedule_rows(app, now)
        # A schedule whose job file does not validate queues nothing at its slots (the daemon skips them, saying
        # why) until the file is fixed: `schedule_rows` counts it no cycles left, and it is named.
        broken = [r["job_file"] for r in rows if r["problem"]]
        scheduled = sum(r["cycles_left_this_month"] for r in rows)
        scheduled_usd = cloud_usd_left(rows)
    data = {"month": month, "cap_usd": view.cap_usd, "spent_usd": round(view.spent_usd, 4),
            "remaining_usd": round(view.remaining_usd, 4), "held_usd": round(held.usd, 4), "held_jobs": held.jobs,
            "free_usd": round(free.remaining_usd, 4), "cycles_this_month": cycles,
            "cycle_gpu_hours": cfg.budget.cycle_gpu_hours, "reference_gpu": ref_gpu, "priced_by": priced_by,
            "usd_per_cycle_spot": None if spot is None else round(spot, 4), "usd_per_cycle_on_demand": round(od, 4),
            "accruing_usd_h": round(accruing, 4),
            "kept_to_stop_running_usd": round(kept, 4),
            "cycles_left_spot": free.cycles_left_spot, "cycles_left_on_demand": free.cycles_left_on_demand,
            "scheduled_cycles_left": scheduled, "scheduled_cloud_usd": round(scheduled_usd, 4),
            "schedules_skipped": broken}
    if as_json:
        print_json(data)
        return
    table(f"budget {month}", ["", "value"], [
        ("monthly cap", fmt_usd(view.cap_usd, as_set=True)),
        ("spent", fmt_usd(view.spent_usd)),
        ("left", fmt_usd(view.remaining_usd)),
        *([("running instances accrue", f"${accruing:.2f}/h"),
           ("kept to stop them", fmt_usd(kept))] if accruing else []),
        *([(f"held for {held.said()}", fmt_usd(held.usd))] if held.jobs else []),
        *([("free for new cycles", fmt_usd(free.remaining_usd))] if accruing or held.jobs else []),
        ("cycles this month", cycles),
        (f"$/cycle on spot ({cfg.budget.cycle_gpu_hours:g} {ref_gpu}-h, {priced_by})", fmt_usd(spot)),
        (f"$/cycle on-demand ({cfg.budget.cycle_gpu_hours:g} {ref_gpu}-h, {priced_by})", fmt_usd(od)),
        ("cycles left on spot", "—" if free.cycles_left_spot is None else free.cycles_left_spot),
        ("cycles left on-demand", free.cycles_left_on_demand),
        *([("cycles the schedules queue this month", scheduled),
           ("their cloud cost, planned as now", fmt_usd(scheduled_usd))] if scheduled is not None else []),
    ])
    if broken:
        out.print(escape(f"not counted: {len(broken)} schedule(s) whose job file does not validate now, skipped at "
                         f"their slots ({', '.join(broken)}; `burstctl schedules` says why)"))
    if scheduled_usd > free.remaining_usd + 1e-9:
        out.print(f"the schedules' cycles left this month would rent {fmt_usd(scheduled_usd)}, each planned as one "
                  f"queued now (`burstctl schedules`), and {fmt_usd(free.remaining_usd)} is free: a cycle that must "
                  "burst once the money is gone waits, blocked by the budget")


EVENTS_SHOWN = 100  # `burstctl events` without --limit or --all: the newest this many, as `tail` shows the end
# The largest number a database INTEGER holds (SQLite's and PostgreSQL's BIGINT): an event id or a LIMIT above it
# reached the database as an OverflowError.
DB_INT_MAX = 2**63 - 1


@cli.command("events")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events as they happen.")
@click.option("--job", "job_ref", default=None, help="Only this job's events.")
@click.option("--type", "type_prefixes", multiple=True,
              help="Only events whose type starts with this (`job.` or `job.*`: every job event; `job.done`).")
@click.option("--limit", type=click.IntRange(min=1, max=DB_INT_MAX), default=None,
              help=f"At most this many (the newest; {EVENTS_SHOWN} unless --all; with --after, the first).")
@click.option("--all", "show_all", is_flag=True, help="Every event from the first (streamed), not only the newest.")
@click.option("--after", "after_id", type=click.IntRange(min=0, max=DB_INT_MAX), default=None,
              help="Only events with a higher id, oldest first: every one (streamed), or the first --limit. A "
                   "script pages with the last id it printed.")
@click.option("--interval", type=FiniteFloat(min=0.05), default=0.5, show_default=True,
              help="Poll interval with --follow.")
@json_option
@pass_app
def events_cmd(app: App, follow: bool, job_ref: str | None, type_prefixes: tuple[str, ...], limit: int | None,
               show_all: bool, after_id: int | None, interval: float, as_json: bool) -> None:
    """Print the event log (JSON lines with --json), the newest 100 unless --limit, --all or --after says
    otherwise; optionally following it live."""
    if len(type_prefixes) > 1:  # click keeps the last one given: the others would be dropped without a word
        raise BadInput(f"is given {len(type_prefixes)} times: expected one type or prefix (`job.` takes every job "
                       "event)", field="--type")
    type_prefix = type_prefixes[0] if type_prefixes else None
    if show_all and limit:
        raise BadInput("--all and --limit exclude each other", field="--limit")
    if show_all and after_id is not None:
        raise BadInput("--all and --after exclude each other (--all is --after 0)", field="--after")
    job_id = job_or_fail(app, job_ref, "--job", newest=True)["id"] if job_ref else None
    if type_prefix is not None:
        type_prefix = _type_prefix(app, type_prefix)
    last = 0
    if after_id is not None and limit:  # a page
        evs = app.store.events(after_id=after_id, job_id=job_id, type_prefix=type_prefix, limit=limit)
        _print_events(evs, as_json)
        last = evs[-1]["id"] if evs else after_id
    elif show_all or after_id is not None:  # months of events: streamed, never all in memory at once
        last = after_id or 0
        for e in app.store.iter_events(after_id=last, job_id=job_id, type_prefix=type_prefix):
            _print_events([e], as_json)
            last = e["id"]
    else:
        evs = app.store.events(job_id=job_id, type_prefix=type_prefix, newest=limit or EVENTS_SHOWN)
        _print_events(evs, as_json)
        last = evs[-1]["id"] if evs else 0
        if limit is None and len(evs) == EVENTS_SHOWN:
            click.echo(f"(the newest {EVENTS_SHOWN} events; --limit N or --all for more)", err=True)
    if not follow:
        return
    say_config_problem_now(app)
    tail = EventTail(app.store, job_id=job_id, type_prefix=type_prefix, after_id=last)
    try:
        while True:
            time.sleep(interval)
            _print_events(tail.poll(), as_json)
    except KeyboardInterrupt:
        return


def _type_prefix(app: App, given: str) -> str:
    """`--type` as a prefix of event types: `job.*` as [[notify]] `events` write it is `job.`. A prefix no event
    recorded so far has is said on stderr (a typo shows nothing), with the nearest type; it stays the filter, as
    --follow may yet see one."""
    prefix = given.removesuffix("*")
    if any(c in prefix for c in "*?["):
        raise BadInput(f"'{given}' is not a prefix: expected the start of an event type (`job.`, `job.*`, "
                       "`attempt.running`); only a trailing * is allowed", field="--type")
    if not app.store.event_types(prefix):
        near = difflib.get_close_matches(prefix, app.store.event_types(), n=1, cutoff=0.5)
        click.echo(f"note: no event of a type starting with '{prefix}' has been recorded yet"
                   + (f" (did you mean '{near[0]}'?)" if near else ""), err=True)
    return prefix


def _print_events(evs: list[dict[str, Any]], as_json: bool) -> None:
    for e in evs:
        if as_json:
            click.echo(json.dumps(_event_public(e), default=str))
        else:
            ids = " ".join(f"{k}={v}" for k, v in (("job", e["job_id"]), ("attempt", e["attempt_id"])) if v)
            click.echo(f"{_at(e['ts'])}  {e['type']:<22} {ids} {_short(e['data'], 120)}")
