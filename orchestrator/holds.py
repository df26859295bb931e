"""What the budget holds for the jobs admitted to the cloud: each job's hold is written with its decision (its plan's
rented cost) and with each attempt written on a market (`budget.held_on_market`, `Store.set_hold`); summed here, less
what each has spent, for every decision, `burstctl budget` and `burstctl status` alike. Without the decision core:
`status` reads it too, and loads none of that."""

from __future__ import annotations

from sqlalchemy import case, func, or_, select

from orchestrator.app import App
from orchestrator.core.budget import Held
from orchestrator.lifecycle.states import JobState
from state import schema as s


def held_by_plans(app: App, now: float, exclude: str | None = None) -> Held:
    """What the jobs admitted to the cloud, queued or running, have still to spend: each one's hold (its plan's
    rented cost; once an attempt of it is written on a market, its spend then and the rest of its run at that
    market's rate, `budget.held_on_market`) less what its instances have cost so far (`budget.admits` keeps it from
    the next job; `burstctl budget` and `status` show it). `exclude`: the job being decided again, which must not
    hold money against itself. Summed in the database (`jobs.rented_usd`): every decision asks, and the queue may
    hold thousands."""
    j, led = s.jobs, s.ledger
    admitted = select(j.c.id, j.c.rented_usd).where(
        j.c.state.in_((JobState.QUEUED.value, JobState.RUNNING.value, JobState.RESUMING.value)),
        j.c.placement.in_(("cloud", "hybrid")), j.c.rented_usd > 0,
        # A plan no month's cap pays (its launch, stop included) never hands over while the cap stands (its local
        # phase runs on, late), and a hybrid whose price awaits `approve` hands over only once approved: neither holds
        # money from other jobs.
        func.coalesce(j.c.decision["launch_usd"].as_float(), j.c.rented_usd) <= app.config.budget.monthly_cap_usd
        + 1e-9,
        or_(j.c.approved, func.coalesce(j.c.decision["action"].as_string(), "") != "await-approval"),
        *([j.c.id != exclude] if exclude is not None else [])).subquery()
    accrued = func.coalesce(led.c.cost_usd, led.c.rate_usd_h * (now - led.c.started_at) / 3600.0)
    spent = (select(led.c.job_id, func.sum(accrued).label("usd"))
             .where(led.c.job_id.in_(select(admitted.c.id))).group_by(led.c.job_id).subquery())
    rest = admitted.c.rented_usd - func.coalesce(spent.c.usd, 0.0)
    with app.store.engine.connect() as c:
        usd, jobs = c.execute(select(func.coalesce(func.sum(case((rest > 0, rest), else_=0.0)), 0.0), func.count())
                              .select_from(admitted.outerjoin(spent, spent.c.job_id == admitted.c.id))).one()
    return Held(float(usd), int(jobs))
