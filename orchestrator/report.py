"""`burstctl report`: what the finished jobs were expected to cost and take, beside what they did.

A decision is arithmetic made before a run; this is the check on it after. For the jobs that finished in a window
(done, failed or cancelled, having run): each job's plan — the decision it ran on, its cost and hours, and the
plan it was queued on when it was decided again on the way — beside the meter's (the ledger; local hours at
`local.board_power_w` × `local.electricity_usd_per_kwh`, as the plan priced them) and whether its deadline held;
over them all, what was spent on which market, how measured compared with expected, and what spot saved against
on-demand at the rate the decision priced on-demand at. A job that revert-local brought home says so, and is not
set beside a plan it did not run on. One whose instance the operator confirmed gone (`burstctl confirm-gone`), its
provider never having said, says so: its charge ends where the operator's word did.

Read from jobs, attempts and the ledger (with its instances), which `prune-events` never deletes, with one grouped
query each: a month of 10,000 jobs is three queries, not thirty thousand.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

from sqlalchemy import and_, case, distinct, func, select

from orchestrator.app import App
from orchestrator.core.release import OPERATOR
from orchestrator.lifecycle.machine import AttemptState
from orchestrator.lifecycle.states import JobState
from orchestrator.records import plan_of
from state import schema as s

REPORTED_STATES = (JobState.DONE.value, JobState.FAILED.value, JobState.CANCELLED.value)


@dataclass(frozen=True)
class JobOutcome:
    """One finished job: the plan it ran on, and what the meter says it did."""

    id: str
    name: str
    state: str
    ended_at: float
    plan: str  # "hybrid spot", "burst on-demand", "local"; "—" without a plan
    expected_usd: float | None  # the plan's cost
    expected_h: float | None  # the plan's hours, its phases one after the other
    run_h: float  # every attempt's, from start to end
    local_h: float
    local_usd: float
    spot_usd: float
    spot_billed_h: float
    on_demand_usd: float
    on_demand_usd_h: float | None  # the decision's on-demand rate for the instance: what spot is weighed against
    attempts: int
    preemptions: int
    late_h: float | None  # a done job's finish against its deadline (negative: early); None unless done
    decisions: int = 1  # how many it had: decided again late in line, re-planned while running, retried ...
    first_plan: str | None = None  # the plan it was queued on, when it ended on another decision's
    first_expected_usd: float | None = None
    first_expected_h: float | None = None
    # `revert-local` brought it home against its cloud or hybrid plan: it ran on another plan than the one shown, so
    # it is not in the measured / expected ratios
    reverted_local: bool = False
    # Its decision was made once part of its work was done (unblocked or retried from its checkpoint, re-planned
    # while running): it prices what was left, the meter the whole run, so it is not in those ratios either
    decided_midway: bool = False
    # Its instances confirmed gone by the operator (`burstctl confirm-gone`), not by their provider: their charges end
    # where the operator's word did
    confirmed_by_operator: int = 0

    @property
    def measured_usd(self) -> float:
        return self.spot_usd + self.on_demand_usd + self.local_usd

    @property
    def spot_saved_usd(self) -> float | None:
        """Spot's hours at the on-demand rate, less what they cost."""
        if self.on_demand_usd_h is None:
            return None
        return self.spot_billed_h * self.on_demand_usd_h - self.spot_usd

    def as_dict(self) -> dict[str, Any]:
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}
        saved = self.spot_saved_usd
        return {**out, "measured_usd": round(self.measured_usd, 4),
                "spot_saved_usd": None if saved is None else round(saved, 4),
                "deadline_met": None if self.late_h is None else self.late_h <= 0}


def on_demand_rate(decision: dict[str, Any]) -> float | None:
    """The decision's on-demand $/h for the job's instance (all its GPUs), where it priced one."""
    costs = decision.get("market_costs") or {}
    if costs.get("on_demand_usd_h") is not None:
        return float(costs["on_demand_usd_h"])
    usd, hours = costs.get("on_demand_usd"), costs.get("on_demand_h")  # a decision from before it was kept
    return usd / hours if usd is not None and hours else None


def outcomes(app: App, since: float | None, until: float, now: float) -> list[JobOutcome]:
    """The jobs that ended in [since, until) and ran, newest first."""
    j, a, led, inst = s.jobs, s.attempts, s.ledger, s.instances
    window = and_(j.c.state.in_(REPORTED_STATES), j.c.updated_at < until,
                  *([j.c.updated_at >= since] if since is not None else []))
    ids = select(j.c.id).where(window)
    span = func.coalesce(a.c.ended_at, now) - a.c.started_at
    started = a.c.started_at.is_not(None)
    is_local = a.c.where == "local"
    preempted = and_(a.c.state == AttemptState.PREEMPTED.value, a.c.where == "cloud")
    billed_s = func.coalesce(led.c.billed_seconds, func.coalesce(led.c.ended_at, now) - led.c.started_at)
    cost = func.coalesce(led.c.cost_usd, led.c.rate_usd_h * (func.coalesce(led.c.ended_at, now) - led.c.started_at)
                         / 3600.0)
    with app.store.engine.connect() as c:
        jobs = c.execute(select(j.c.id, j.c.name, j.c.state, j.c.updated_at, j.c.deadline_at, j.c.decision,
                                j.c.placement)
                         .where(window).order_by(j.c.updated_at.desc(), j.c.id)).mappings().all()
        runs = {r.job_id: r for r in c.execute(
            select(a.c.job_id, func.count().label("attempts"),
                   func.sum(case((started, span), else_=0.0)).label("run_s"),
                   func.sum(case((and_(started, is_local), span), else_=0.0)).label("local_s"),
                   func.sum(case((preempted, 1), else_=0)).label("preemptions"))
            .where(a.c.job_id.in_(ids)).group_by(a.c.job_id))}
        charges: dict[tuple[str, str], tuple[float, float]] = {}
        by_operator: dict[str, int] = {}
        operator_said = case((inst.c.gone_by == OPERATOR, led.c.instance_id))
        for r in c.execute(
                select(led.c.job_id, led.c.market, func.sum(cost).label("usd"), func.sum(billed_s).label("seconds"),
                       func.count(distinct(operator_said)).label("by_operator"))
                .select_from(led.outerjoin(inst, and_(inst.c.provider == led.c.provider,
                                                      inst.c.id == led.c.instance_id)))
                .where(led.c.job_id.in_(ids)).group_by(led.c.job_id, led.c.market)):
            charges[(r.job_id, r.market or "on-demand")] = (float(r.usd or 0.0), float(r.seconds or 0.0))
            by_operator[r.job_id] = by_operator.get(r.job_id, 0) + int(r.by_operator or 0)
    local_rate = app.config.local.usd_per_hour
    found = []
    for job in jobs:
        run = runs.get(job["id"])
        if run is None or not run.run_s:
            continue  # never ran (cancelled in the queue): nothing was expected of it or spent
        decision = job["decision"] or {}
        plan, expected_usd, expected_h = plan_of(decision)
        first = decision.get("first_plan") or {}
        local_h = float(run.local_s or 0.0) / 3600.0
        spot_usd, spot_s = charges.get((job["id"], "spot"), (0.0, 0.0))
        od_usd, _ = charges.get((job["id"], "on-demand"), (0.0, 0.0))
        done = job["state"] == JobState.DONE.value
        found.append(JobOutcome(
            id=job["id"], name=job["name"], state=job["state"], ended_at=float(job["updated_at"]), plan=plan,
            expected_usd=expected_usd, expected_h=expected_h, run_h=float(run.run_s) / 3600.0, local_h=local_h,
            local_usd=local_h * local_rate, spot_usd=spot_usd, spot_billed_h=spot_s / 3600.0,
            on_demand_usd=od_usd, on_demand_usd_h=on_demand_rate(decision), attempts=int(run.attempts),
            preemptions=int(run.preemptions or 0),
            late_h=(float(job["updated_at"]) - float(job["deadline_at"])) / 3600.0 if done else None,
            decisions=int(decision.get("decisions") or 1), first_plan=first.get("plan"),
            first_expected_usd=first.get("plan_cost_usd"), first_expected_h=first.get("hours"),
            reverted_local=job["placement"] == "local" and decision.get("placement") in ("cloud", "hybrid"),
            decided_midway=float(decision.get("work_done") or 0.0) > 0,
            confirmed_by_operator=by_operator.get(job["id"], 0)))
    return found


def _ratios(pairs: Iterable[tuple[float, float | None]]) -> dict[str, float] | None:
    """Measured / expected over the pairs with something expected: median, lowest, highest."""
    values = sorted(m / e for m, e in pairs if e)
    if not values:
        return None
    return {"median": round(median(values), 3), "min": round(values[0], 3), "max": round(values[-1], 3),
            "jobs": len(values)}


def totals(found: list[JobOutcome]) -> dict[str, Any]:
    """The window in figures. Expected against measured is over the done jobs that ran on their plan only: a
    failed or cancelled run stopped short of what its plan priced, one that revert-local brought home ran on
    another, and one decided again with part of its work done was priced on the rest only."""
    done = [o for o in found if o.state == JobState.DONE.value]
    followed = [o for o in done if not o.reverted_local and not o.decided_midway]
    saved = [o.spot_saved_usd for o in found if o.spot_saved_usd is not None]
    by_state = {st: sum(1 for o in found if o.state == st) for st in REPORTED_STATES}
    compared = [o for o in followed if o.expected_usd is not None]
    return {
        "jobs": len(found), **by_state,
        "spent_usd": round(sum(o.measured_usd for o in found), 4),
        "cloud_usd": round(sum(o.spot_usd + o.on_demand_usd for o in found), 4),
        "spot_usd": round(sum(o.spot_usd for o in found), 4),
        "on_demand_usd": round(sum(o.on_demand_usd for o in found), 4),
        "local_usd": round(sum(o.local_usd for o in found), 4),
        "spot_saved_usd": round(sum(saved), 4) if saved else None,
        "done_expected_usd": round(sum(o.expected_usd or 0.0 for o in compared), 4),
        # What they were expected to cost when queued: the promise, before any decision made on the way
        "done_first_expected_usd": round(sum((o.first_expected_usd if o.first_plan is not None else o.expected_usd)
                                             or 0.0 for o in compared), 4),
        "decided_again": sum(1 for o in found if o.decisions > 1),
        "reverted_local": sum(1 for o in found if o.reverted_local),
        "decided_midway": sum(1 for o in found if o.decided_midway),
        "confirmed_by_operator": sum(1 for o in found if o.confirmed_by_operator),
        "done_measured_usd": round(sum(o.measured_usd for o in compared), 4),
        "cost_ratio": _ratios((o.measured_usd, o.expected_usd) for o in followed),
        "hours_ratio": _ratios((o.run_h, o.expected_h) for o in followed),
        "deadlines_met": sum(1 for o in done if o.late_h is not None and o.late_h <= 0),
        "deadlines_missed": sum(1 for o in done if o.late_h is not None and o.late_h > 0),
        "attempts": sum(o.attempts for o in found),
        "preemptions": sum(o.preemptions for o in found),
    }
