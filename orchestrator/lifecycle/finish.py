"""What an ended attempt means for its job: done, resume elsewhere, back to the queue, blocked, or failed.

Called inside the transaction that closes the attempt, so the job's state and the attempt's end are one change.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, func, select

from orchestrator import records
from orchestrator.app import App
from orchestrator.core.budget import month_key
from orchestrator.core.release import utc
from orchestrator.core.spot_watch import probe_after_s
from orchestrator.lifecycle import checkpoints
from orchestrator.lifecycle.machine import AttemptState, confirmed_by_operator
from orchestrator.lifecycle.market_switch import TO_ON_DEMAND, TO_SPOT
from orchestrator.lifecycle.states import JobState
from state import schema as s

A = AttemptState
# How the reason of a job revert-local moved home begins, until it starts there (`revert.restore_plans` reads it).
REQUEUED_LOCAL = "revert-local: requeued locally"
LOCAL_HOURS_OVER = "local-hours"  # the stop reason of a local run whose local.available_hours ended
# The stop reasons of an instance that never came up (not running, or not reachable by SSH, within
# daemon.boot_timeout_s): the launch failed, not the job. Counted towards daemon.max_launch_failures.
NEVER_CAME_UP = frozenset({"boot-timeout", "ssh-timeout"})


def requeued_local_reason(cfg: Any, job_id: str, why: str = "") -> str:
    """What a job revert-local (or local-only) moves home says: whether it resumes from a checkpoint or starts over.
    It begins with REQUEUED_LOCAL, which `revert` reads."""
    newest = checkpoints.latest(cfg, job_id, deep=False)
    return f"{REQUEUED_LOCAL}{why} " + (f"from its newest checkpoint, {newest.name}" if newest
                                       else "from the start (no checkpoint yet)")


class _JobChanged(Exception):
    """The job's state changed between its read and its update: a command beside the tick (`cancel`) won."""


def job_after_attempt(app: App, conn: Connection, att: dict[str, Any], job: dict[str, Any], outcome: AttemptState,
                      reason: str | None, now: float) -> None:
    # Inside the caller's write transaction: checkpoints are only named here (sizes, `deep=False`), never read in
    # full, and the store's lock, which a multi-GB pull beside the tick may hold for minutes, is taken only to trim a
    # done job's store, once its last pull is over.
    for _ in range(2):
        row = conn.execute(select(s.jobs).where(s.jobs.c.id == job["id"])).mappings().first()
        current: dict[str, Any] = dict(row) if row is not None else job
        if current["state"] in (JobState.CANCELLED.value, JobState.DONE.value, JobState.FAILED.value):
            if current["state"] == JobState.CANCELLED.value:  # its last attempt just ended: what it cost is final
                _fill_measured(app, conn, job, att, now, ended="cancelled")
            return
        try:
            _next_for_job(app, conn, att, job, current, outcome, reason, now)
            return
        except _JobChanged:
            continue  # read again: what it was changed to decides (a cancelled job's cost is final now)


def _next_for_job(app: App, conn: Connection, att: dict[str, Any], job: dict[str, Any], current: dict[str, Any],
                  outcome: AttemptState, reason: str | None, now: float) -> None:
    store = app.store
    stop_reason = att["info"].get("stop_reason") or reason or ""

    def to(state: JobState, why: str, event: str, **data: Any) -> None:
        # Compare-and-set: on PostgreSQL a `cancel` may commit between the read above and this update.
        if not store.update_job(job["id"], conn, expect_state=current["state"], state=state.value, reason=why,
                                **data.pop("_fields", {})):
            raise _JobChanged
        app.events.emit(event, job_id=job["id"], attempt_id=att["id"], conn=conn, reason=why, **data)

    def back_in_line() -> JobState:
        """Where a job waits for its next cloud attempt: resuming when it has a checkpoint to resume from."""
        return JobState.RESUMING if checkpoints.latest(app.config, job["id"], deep=False) else JobState.QUEUED

    if outcome is A.SUCCEEDED:
        trimmed = checkpoints.trim_done(app.config, job["id"])
        to(JobState.DONE, "completed", "job.done", where=att["where"], checkpoints_trimmed=len(trimmed))
        _fill_measured(app, conn, job, att, now)
    elif outcome is A.LAUNCH_FAILED:
        back = back_in_line()
        policy = att["info"].get("market_policy") or {}
        if policy.get("choice") == "idle":  # the spot policy chose to wait for spot; the launch was its probe
            wait_s = probe_interval_s(app, policy)
            to(back, f"waiting for spot ({reason}): {policy['slack_h']:.2f} h of slack left; the spot policy "
                     "goes on-demand once waiting no longer pays", "job.waiting", next_probe_s=round(wait_s, 1),
               _fields={"spec": {**current["spec"], "_spot_probe_at": now + wait_s}})
            # An expected refusal: it does not count towards max_launch_failures (which would block the job).
            store.set_attempt_info(att["id"], {**att["info"], "failure_counted": False}, conn)
        else:
            to(back, f"launch failed: {reason}", "job.waiting")
    elif outcome is A.PREEMPTED:
        if att["where"] == "local" and stop_reason == "hybrid-switch":
            to(JobState.QUEUED, "local phase done: bursting the rest", "job.switching",
               _fields={"placement": "cloud"})
            return
        ckpt = checkpoints.latest(app.config, job["id"], deep=False)
        why = f"preempted: {stop_reason}"
        if att["where"] == "local" and stop_reason == LOCAL_HOURS_OVER:
            why = "paused: the local GPU's hours (local.available_hours) are over; it resumes when they begin"
        lost = (att.get("info") or {}).get("checkpoint_lost") or {}
        if lost.get("checkpoint"):  # newer than what is home, it went with the instance (`checkpoint.lost`)
            why += f"; its checkpoint {lost['checkpoint']} was lost with its instance"
        to(JobState.RESUMING, why, "job.resuming",
           checkpoint=ckpt.name if ckpt else None, lost_work_h=att.get("lost_work_h"),
           instance=att.get("instance_id"), **({"checkpoint_lost": lost["checkpoint"]} if lost else {}))
    elif outcome is A.ABORTED:
        if stop_reason == "revert-local":
            if current["decision"].get("fits_locally"):
                to(JobState.QUEUED, requeued_local_reason(app.config, job["id"]), "job.requeued_local",
                   _fields={"placement": "local"})
            else:
                to(JobState.BLOCKED, "revert-local: does not fit locally, waits for `burstctl burst-enable`",
                   "job.blocked")
        elif stop_reason == "budget-cap":
            cap = app.config.budget.monthly_cap_usd
            spent = app.store.month_spend(month_key(now), now)
            newest = checkpoints.latest(app.config, job["id"], deep=False)
            to(JobState.BLOCKED, f"stopped before the monthly budget cap: ${spent:.2f} spent of ${cap:.2f} this month, "
               f"{f'checkpoint {newest.name} home' if newest else 'no checkpoint home'}; it is decided again as "
               "the budget allows (a new month, or a higher cap)", "job.blocked")
        elif stop_reason in (TO_ON_DEMAND, TO_SPOT):
            back = back_in_line()
            why = ("moving to on-demand: the spot policy leaves spot to make the deadline"
                   if stop_reason == TO_ON_DEMAND
                   else "moving to spot: spot is back, and the spot policy finds it worth a changeover")
            to(back, why, "job.market_switch", market="on-demand" if stop_reason == TO_ON_DEMAND else "spot")
        elif stop_reason in NEVER_CAME_UP:
            what = "running" if stop_reason == "boot-timeout" else "reachable by SSH"
            to(back_in_line(), f"launch failed: its instance was not {what} within daemon.boot_timeout_s "
                               f"({stop_reason}); another is launched", "job.waiting")
        elif stop_reason == "max-run-time":
            to(JobState.FAILED, "exceeded max_run_hours", "job.failed")
            _fill_measured(app, conn, job, att, now, ended="failed")
        else:
            to(JobState.QUEUED, f"attempt aborted: {stop_reason}", "job.waiting")
    else:
        to(JobState.FAILED, stop_reason or "failed", "job.failed")
        _fill_measured(app, conn, job, att, now, ended="failed")


def measure_cancelled(app: App, conn: Connection, job: dict[str, Any], now: float) -> None:
    """The Measured line of a job cancelled (`burstctl cancel`, in its transaction) while none of its attempts is
    live, so that no attempt's end will fill it: "none" when it never had one, else what its ended attempts ran and
    cost, as a cancelled run's is. One with a live attempt is measured once the daemon has stopped it. A released
    attempt (revert-local, its provider not answering) is not live: its job went on without it, and its end does not
    move the job; its instance's charge, still open, is said, and added once it is closed (`measure_again`)."""
    rows = conn.execute(select(s.attempts).where(s.attempts.c.job_id == job["id"])
                        .order_by(s.attempts.c.n.desc())).mappings().all()
    if any(not AttemptState(r["state"]).final and r["state"] != A.RELEASED.value for r in rows):
        return
    if rows:
        _fill_measured(app, conn, job, dict(rows[0]), now, ended="cancelled")
    elif job.get("record_path") and Path(job["record_path"]).exists():
        records.fill_measured(Path(job["record_path"]), records.MEASURED_CANCELLED.removeprefix("- **Measured:** "))


def measure_again(app: App, conn: Connection, job_id: str, now: float) -> None:
    """A released attempt's instance is confirmed gone, its charge closed (in the caller's transaction): a job over
    by then (done here, failed, cancelled) is measured again, so that its Measured line has the whole of that charge
    rather than what it had cost when the job ended. The job's end, not now, is what the line dates and weighs
    against the deadline. A job not over is measured at its end, as ever."""
    row = conn.execute(select(s.jobs).where(s.jobs.c.id == job_id)).mappings().first()
    if row is None or row["state"] not in (JobState.DONE.value, JobState.FAILED.value, JobState.CANCELLED.value):
        return
    job = dict(row)
    before = conn.execute(select(s.events.c.ts, s.events.c.data).where(
        s.events.c.job_id == job_id, s.events.c.type == "job.measured").order_by(s.events.c.id.desc())).first()
    ended = str(before.data.get("ended") or "done") if before is not None else (
        "done" if job["state"] == JobState.DONE.value else str(job["state"]))
    _fill_measured(app, conn, job, {"info": {}}, float(before.ts) if before is not None else now, ended=ended,
                   peak_vram_gb=before.data.get("peak_vram_gb") if before is not None else None, at=now)


def probe_interval_s(app: App, policy: dict[str, Any]) -> float:
    """How long after a refusal a job that waits for spot, seen only by launching, tries spot again. The policy is
    still asked once a market_check_s meanwhile, so a move to on-demand is not delayed by it."""
    d = app.config.daemon
    outage_h = float(policy.get("for_h") or 0.0) if policy.get("spot_seen") == "down" else 0.0
    return probe_after_s(outage_h, d.launch_backoff_s, d.spot_probe_max_s)


def _ran_until(r: Any, now: float) -> float:
    """When an attempt's run ended: a released one's when its job went on without it (its instance's time being
    terminated after that is billed, in its charge, not run)."""
    released_at = (r["info"] or {}).get("released_at")
    return float(released_at) if released_at is not None else float(r["ended_at"] or now)


def _fill_measured(app: App, conn: Connection, job: dict[str, Any], att: dict[str, Any], now: float,
                   ended: str = "done", *, peak_vram_gb: float | None = None, at: float | None = None) -> None:
    """The record's Measured line and a `job.measured` event, once the job is over however it ended: what a
    cancelled or failed run spent is part of the trail too. `now`: when it ended. A released attempt's charge still
    open (its instance not yet confirmed gone) is said apart, as accrued by `at` (default `now`), and added to the
    cost once closed (`measure_again`)."""
    rows = conn.execute(select(s.attempts).where(s.attempts.c.job_id == job["id"])).mappings().all()
    run_h = sum((_ran_until(r, now) - r["started_at"]) / 3600.0 for r in rows if r["started_at"])
    cost, billed_s = conn.execute(select(func.coalesce(func.sum(s.ledger.c.cost_usd), 0.0),
                                         func.coalesce(func.sum(s.ledger.c.billed_seconds), 0.0))
                                  .where(s.ledger.c.job_id == job["id"])).one()
    released = [r["id"] for r in rows if r["state"] == A.RELEASED.value]
    open_charges = conn.execute(select(s.ledger.c.provider, s.ledger.c.instance_id, s.ledger.c.rate_usd_h,
                                       s.ledger.c.started_at)
                                .where(s.ledger.c.job_id == job["id"],  # through ix_ledger_job, not a scan
                                       s.ledger.c.attempt_id.in_(released), s.ledger.c.cost_usd.is_(None))).all() \
        if released else []
    at = now if at is None else at
    accrued = [(provider, instance, rate * max(0.0, at - started) / 3600.0)
               for provider, instance, rate, started in open_charges]
    still_usd = sum(usd for _, _, usd in accrued)
    where = ", ".join(sorted({f"{r['provider']} {r['instance_type']} {r['market']}" if r["where"] == "cloud"
                              else "local" for r in rows if r["started_at"]}))
    preemptions = sum(1 for r in rows if r["state"] == A.PREEMPTED.value and r["where"] == "cloud")
    peak = att["info"].get("metrics", {}).get("peak_vram_gb", peak_vram_gb)
    local_h = sum((_ran_until(r, now) - r["started_at"]) / 3600.0 for r in rows
                  if r["started_at"] and r["where"] == "local")
    date = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")
    # The promise was the deadline: say whether it held, against the deadline the decision was made for.
    late_h = (now - float(job["deadline_at"])) / 3600.0 if ended == "done" and job.get("deadline_at") else None
    deadline = "" if late_h is None else (f"; deadline missed by {_span(late_h)}" if late_h > 0
                                          else f"; deadline met with {_span(-late_h)} to spare")
    # The parts rounded alike, and the whole their sum: "run 0.04 h (local 0.04 h, cloud 0.01 h)" read as a slip.
    split, run_txt = "", f"{run_h:.2f}"
    if 0 < local_h < run_h:
        local_txt, cloud_txt = f"{local_h:.2f}", f"{run_h - local_h:.2f}"
        run_txt = f"{float(local_txt) + float(cloud_txt):.2f}"
        split = f" (local {local_txt} h, cloud {cloud_txt} h)"
    cloud_s = (run_h - local_h) * 3600.0
    # The meter runs from launch to termination, and bills each instance at least the provider's minimum: more
    # than the run's hours, which a short run shows as "run 0.00 h, cost $0.02" without this.
    minimum = (f" (billed {billed_s / 3600:.2f} h: launch to termination, at least the provider's minimum each)"
               if billed_s > cloud_s + 30 else "")
    # The plan priced local hours at local.usd_per_hour (power, wear): the same figure, so the two compare. The
    # cloud's is the meter's (the ledger), which is what the budget counts.
    local_usd = local_h * app.config.local.usd_per_hour
    costs = f"${cost:.2f}" + (f" cloud{minimum} + ${local_usd:.2f} local at "
                              f"{records.fmt_usd(app.config.local.usd_per_hour)}/h" if local_usd > 0 else minimum)
    unconfirmed = "".join(f"; instance {provider} {instance} is still being terminated: {records.fmt_usd(usd)} so "
                          "far, added here once its provider confirms it gone" for provider, instance, usd in accrued)
    # Its provider never said: the cost above ends those charges where the operator's word did (`confirm-gone`).
    by_operator = confirmed_by_operator(conn, job_ids=[job["id"]])
    operator_said = "".join(f"; instance {g['provider']} {g['instance']} confirmed gone by the operator, not its "
                            f"provider, at {utc(g['gone_at'])}: its charge ends then" for g in by_operator)
    text = ("" if ended == "done" else f"{ended}: ") + (
        f"run {run_txt} h{split}, cost {costs}, {date}, on {where or '—'}; {len(rows)} attempt(s), "
        f"{preemptions} preemption(s)" + (f"; peak VRAM {peak:.1f} GB" if peak else "") + deadline + unconfirmed
        + operator_said)
    if job.get("record_path") and Path(job["record_path"]).exists():
        records.fill_measured(Path(job["record_path"]), app.redactor(text))  # what providers named, redacted
    app.events.emit("job.measured", job_id=job["id"], conn=conn, run_h=round(run_h, 4), cost_usd=round(cost, 4),
                    where=where, preemptions=preemptions, peak_vram_gb=peak, ended=ended,
                    local_h=round(local_h, 4), local_cost_usd=round(local_usd, 4),
                    deadline_met=None if late_h is None else late_h <= 0,
                    late_h=None if late_h is None else round(late_h, 4),
                    **({"unconfirmed_usd": round(still_usd, 4)} if open_charges else {}),
                    **_said_by_operator(by_operator))


def _said_by_operator(by_operator: list[dict[str, Any]]) -> dict[str, Any]:
    """`job.measured`'s word on the instances of the job the operator confirmed gone, when there are any."""
    return {"confirmed_gone_by_operator": [f"{g['provider']} {g['instance']}" for g in by_operator]} \
        if by_operator else {}


def exit_reason(app: App, job: dict[str, Any], ex: dict[str, Any], prefix: str = "exited") -> str:
    """A failed run's reason: the supervisor's exit reason and code, and the command's last stderr line (its
    traceback's last line, say), with every secret the job may know scrubbed."""
    text = f"{prefix}: {ex.get('reason')} (code {ex.get('exit_code')})"
    tail = ex.get("stderr_tail")
    if tail:
        app.redactor.add_env_names(job["spec"].get("pass_env") or [])
        text += f": {app.redactor(str(tail))}"
    return text


def _span(hours: float) -> str:
    """A duration for the record: hours, or seconds and minutes when it is short (a rehearsal, a test)."""
    if hours >= 0.1:
        return f"{hours:.2f} h"
    return f"{hours * 3600:.0f} s" if hours * 3600 < 120 else f"{hours * 60:.1f} min"
