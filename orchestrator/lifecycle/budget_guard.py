"""The monthly cap, enforced: month-to-date spend never crosses `budget.monthly_cap_usd`
(tests/test_budget_property.py). Asked before every launch (`Admission`), of every live attempt each tick
(`Reconciler.stop_reason`) and before a hybrid hands over (`handover`).

Every running instance may go on accruing for one stop horizon after a check (a tick, then its stop's grace for its
last checkpoint), so that is reserved for all of them; a new launch must also fit its billing minimum, the work
expected of it and its own stop. Decisions ask the same (`budget.admits`, with `spending` read here), so that one
that says a job fits is not refused at its launch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import func, select

from orchestrator.app import App
from orchestrator.core.budget import Launch, Spending, admits, held_on_market, month_key, stop_horizon_h
from orchestrator.core.plan import remaining_cloud_h
from orchestrator.lifecycle.local import stop_grace_s
from orchestrator.lifecycle.market_switch import cloud_attempts, cloud_hours_done
from providers.base import Market, Offer
from state import schema as s


def expected_remaining_h(app: App, job: dict[str, Any], now: float) -> float:
    """The cloud hours a job's plan still expects (`plan.remaining_cloud_h`), given what its cloud attempts have
    run."""
    # Only cloud hours count against the plan's cloud phase (a hybrid's local phase is already outside it).
    return remaining_cloud_h(job["decision"], cloud_hours_done(cloud_attempts(app, job["id"]), now))


class BudgetGuard:
    """What the budget allows now, read from the ledger every time (nothing is held in memory)."""

    def __init__(self, app: App, clock: Callable[[], float], tick_s: float):
        self.app = app
        self.clock = clock
        self.tick_s = tick_s  # the daemon's (`daemon --tick` sets it apart from the config's)

    def horizon_h(self, spec: Mapping[str, Any] | None = None) -> float:
        """How long a stop of a job with `spec` may take to end the spending (`budget.stop_horizon_h`, with the
        job's grace for its last checkpoint)."""
        return stop_horizon_h(self.tick_s, stop_grace_s(spec or {}))

    def exposure(self, now: float) -> dict[str, tuple[float, float, float]]:
        """Per month that can still grow: (USD committed, USD/h still accruing, USD kept for the running instances
        to stop: each one's rate over its job's stop horizon). Committed counts closed charges at cost and open
        ones at no less than their billing minimum (what stopping now would cost). An open charge counts against
        the month it opened in, even after the calendar has moved on."""
        led = s.ledger
        with self.app.store.engine.connect() as c:
            open_months = {r[0] for r in c.execute(select(led.c.month).where(led.c.ended_at.is_(None)))}
            months = sorted(open_months | {month_key(now)})
            # Summed in the database: every decision asks (`queue.context`), and a month holds thousands of charges.
            closed = dict(c.execute(select(led.c.month, func.sum(led.c.cost_usd)).where(
                led.c.month.in_(months), led.c.cost_usd.is_not(None)).group_by(led.c.month)).all())
            rows = c.execute(select(led, s.attempts.c.info).select_from(
                led.outerjoin(s.attempts, s.attempts.c.id == led.c.attempt_id))
                .where(led.c.month.in_(months), led.c.cost_usd.is_(None))).mappings().all()
            running = {r["job_id"] for r in rows if r["job_id"]}
            specs = {j: spec for j, spec in c.execute(select(s.jobs.c.id, s.jobs.c.spec).where(
                s.jobs.c.id.in_(sorted(running))))} if running else {}
        out = {m: (float(closed.get(m) or 0.0), 0.0, 0.0) for m in months}
        for r in rows:
            committed, accruing, kept = out[r["month"]]
            minimum_s = float((r["info"] or {}).get("billing_minimum_s", 0.0))
            committed += r["rate_usd_h"] * max(minimum_s, now - r["started_at"]) / 3600.0
            accruing += r["rate_usd_h"]
            kept += r["rate_usd_h"] * self.horizon_h(specs.get(r["job_id"]))
            out[r["month"]] = (committed, accruing, kept)
        return out

    def spending(self, now: float, exposure: Mapping[str, tuple[float, float, float]] | None = None) -> Spending:
        """This month's spending as a launch is weighed against it (`budget.admits`), with what the earlier months a
        charge is still open in have committed; a decision weighs the same."""
        months = self.exposure(now) if exposure is None else exposure
        this_month = month_key(now)
        committed, _, kept = months[this_month]
        earlier = tuple((m, c + k) for m, (c, _, k) in sorted(months.items()) if m != this_month)
        return Spending(committed, kept, earlier=earlier)

    def still_short(self, job: dict[str, Any], now: float) -> bool:
        """A job the budget refused at launch still would be. Its decision counts as the launch does, but at the
        price last listed, not the live one it was refused at: deciding it again would queue it and the launch
        refuse it again every tick."""
        refused = job["spec"].get("_budget_launch")
        if not refused:
            return False
        return self.problem(now, rate_usd_h=float(refused["rate_usd_h"]), minimum_s=float(refused["minimum_s"]),
                            expected_h=expected_remaining_h(self.app, job, now), spec=job["spec"]) is not None

    def launch_problem(self, job: dict[str, Any], offer: Offer, market: Market, now: float) -> str | None:
        """Why the budget refuses launching `job` on `offer` and `market` now (its rate, its billing minimum and
        the hours of work left to it), or None."""
        return self.problem(now, rate_usd_h=offer.rate_usd_h(market), minimum_s=offer.billing_minimum_s,
                            expected_h=expected_remaining_h(self.app, job, now), spec=job["spec"])

    def hold_usd(self, job: dict[str, Any], rate_usd_h: float, minimum_s: float, now: float) -> float:
        """What `job` holds of the month's budget once an attempt of it runs at `rate_usd_h` (`budget.held_on_market`:
        its spend so far, and its remaining hours as its launch's check counts them at that rate). Read before the
        caller's transaction writes it (`Store.set_hold`), with the attempt."""
        spent, _ = self.app.store.job_spend(job["id"], now)
        return held_on_market(spent, Launch(rate_usd_h, expected_remaining_h(self.app, job, now), minimum_s))

    def problem(self, now: float, *, rate_usd_h: float = 0.0, minimum_s: float = 0.0,
                expected_h: float = 0.0, spec: Mapping[str, Any] | None = None) -> str | None:
        """Why spending must not go on (or a launch at `rate_usd_h` must not start), or None. Every running
        instance may go on accruing for one stop horizon after this check, so that is reserved for all of them;
        a new one must also fit its billing minimum, the work expected of it and its own stop (`budget.admits`,
        which every decision asks too)."""
        cap = self.app.config.budget.monthly_cap_usd
        exposure = self.exposure(now)
        if rate_usd_h > 0:  # a launch: the decisions' own check, earlier months' open charges included
            launch = Launch(rate_usd_h, expected_h, minimum_s, self.horizon_h(spec))
            ok, why = admits(launch, cap, self.spending(now, exposure))
            return None if ok else f"budget: {why}"
        for month, (committed, _, kept) in sorted(exposure.items()):
            if committed + kept >= cap:
                return f"budget: ${committed + kept:.2f} committed in {month} reaches the ${cap:.2f} cap"
        return None
