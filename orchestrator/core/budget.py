"""The monthly budget: a hard cap, and the cadence of cycles it buys. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime


def month_key(ts: float) -> str:
    """The calendar month (UTC) a charge counts against, as YYYY-MM."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m")


def month_start(ts: float) -> float:
    """When the budget's month (UTC) that `ts` is in began."""
    return datetime.fromtimestamp(ts, UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()


def month_end(ts: float) -> float:
    """When the budget's month (UTC) that `ts` is in ends: the first instant of the next."""
    at = datetime.fromtimestamp(ts, UTC)
    nxt = at.replace(year=at.year + at.month // 12, month=at.month % 12 + 1, day=1, hour=0, minute=0, second=0,
                     microsecond=0)
    return nxt.timestamp()


@dataclass(frozen=True)
class BudgetView:
    month: str
    cap_usd: float
    spent_usd: float
    cycles_this_month: int
    usd_per_cycle_spot: float | None
    usd_per_cycle_on_demand: float

    @property
    def remaining_usd(self) -> float:
        return max(0.0, self.cap_usd - self.spent_usd)

    @property
    def cycles_left_spot(self) -> int | None:
        if not self.usd_per_cycle_spot:
            return None
        return math.floor(self.remaining_usd / self.usd_per_cycle_spot + 1e-9)

    @property
    def cycles_left_on_demand(self) -> int:
        return math.floor(self.remaining_usd / self.usd_per_cycle_on_demand + 1e-9)


def cycle_prices(cycle_gpu_hours: float, od_usd_per_gpu_h: float,
                 spot_usd_per_gpu_h: float | None) -> tuple[float | None, float]:
    spot = cycle_gpu_hours * spot_usd_per_gpu_h if spot_usd_per_gpu_h else None
    return spot, cycle_gpu_hours * od_usd_per_gpu_h


DEFAULT_GRACE_S = 30.0  # a trainer's time for its last checkpoint unless its job says (checkpoint.stop_grace_s)


def stop_horizon_h(tick_s: float, grace_s: float = DEFAULT_GRACE_S) -> float:
    """How long a stop may take to end the spending: three ticks to notice and act, 120 s to checkpoint, sync and
    terminate (also covers a daemon down for less than 120 s), and a job's longer grace for its last checkpoint
    beyond that. Every running instance is reserved this long."""
    return (3 * tick_s + 120 + max(0.0, grace_s - DEFAULT_GRACE_S)) / 3600.0


@dataclass(frozen=True)
class Held:
    """What the jobs admitted to the cloud (queued or running) have still to spend: each one's hold (its plan's
    rented cost, or, once an attempt of it is written on a market, what `held_on_market` says) less what its
    instances have cost so far."""

    usd: float = 0.0
    jobs: int = 0

    def said(self, other: str = "") -> str:
        """`1 admitted job`; with `other` ("other "), beside the job being admitted. Not "plan": a job that runs
        holds the rest of its run on the market it runs on, which may not be its plan's."""
        return f"1 {other}admitted job" if self.jobs == 1 else f"{self.jobs} {other}admitted jobs"

    def plus(self, usd: float) -> Held:
        return Held(self.usd + max(0.0, usd), self.jobs + 1)


@dataclass(frozen=True)
class Launch:
    """A cloud run as the budget counts it before it starts: billed at `rate_usd_h` for the hours expected of it,
    never fewer than its billing minimum, and for the stop horizon beyond them (the spending goes on until a stop
    ends it). The launch's own check and a decision's count the same (`admits`): a decision that said "fits" for a
    launch the cap then refused was blocked at the cap's edge right after being queued."""

    rate_usd_h: float
    hours: float
    minimum_s: float = 0.0
    horizon_h: float = 0.0

    @property
    def billed_h(self) -> float:
        return max(self.hours, self.minimum_s / 3600.0)

    @property
    def usd(self) -> float:
        return self.rate_usd_h * (self.billed_h + self.horizon_h)

    def said(self) -> str:
        return f"{self.billed_h:.3g} h at ${self.rate_usd_h:.2f}/h, plus {self.horizon_h * 3600:.0f} s to stop"


def held_on_market(spent_usd: float, launch: Launch) -> float:
    """What a job holds of the month's budget once an attempt of it is written on a market (launched, or moved to
    the other market): what it has spent, and the rest of its run as that launch's budget check counts it, the hours
    its plan still expects at that market's rate, never fewer than the billing minimum. Not the stop: each running
    instance's is kept apart (`Spending.kept_usd`). `Held` takes off what the job spends from here on, so a job moved
    from spot to on-demand holds the on-demand price of what is left, not its spot plan's third of it."""
    return max(0.0, spent_usd) + launch.rate_usd_h * launch.billed_h


@dataclass(frozen=True)
class Spending:
    """What the month's cap has already given to others when a launch asks: what is spent or committed (closed
    charges at cost, open ones at no less than their billing minimum: what stopping them now would cost), what is
    kept for the running instances to stop (each one's rate over its job's stop horizon), and what the plans of jobs
    already admitted have still to spend (`held`; a decision counts them, so two jobs that each fit alone but not
    together are not both queued for the cap to stop both)."""

    committed_usd: float = 0.0
    kept_usd: float = 0.0
    held: Held = field(default_factory=Held)
    # Earlier months a charge is still open in: (month, USD committed and kept there). An open charge counts against
    # the month it opened in, and one that reaches that month's cap is being stopped: no launch while it is.
    earlier: tuple[tuple[str, float], ...] = ()

    def left_usd(self, cap_usd: float) -> float:
        return max(0.0, cap_usd - self.committed_usd - self.kept_usd - self.held.usd)

    def said(self) -> str:
        kept = f", ${self.kept_usd:.2f} kept for the running ones to stop" if self.kept_usd > 0 else ""
        holds = f", ${self.held.usd:.2f} held for {self.held.said('other ')}" if self.held.jobs else ""
        return f"${self.committed_usd:.2f} spent or committed{kept}{holds}"


def admits(launch: Launch, cap_usd: float, spending: Spending) -> tuple[bool, str]:
    """The hard cap, asked by a launch and by every decision alike: a launch whose cost (`Launch.usd`) exceeds what
    the month has left, or made while an earlier month's open charges reach its cap, is refused, with the reason."""
    usd, left = launch.usd, spending.left_usd(cap_usd)
    projected = f"projected rented ${usd:.2f} ({launch.said()})"
    if usd > cap_usd + 1e-9:  # not a matter of waiting for a new month
        return False, (f"{projected} is more than the whole ${cap_usd:.2f} monthly budget: no month pays it; raise "
                       "budget.monthly_cap_usd, or give it less work or a later deadline")
    for month, earlier_usd in spending.earlier:
        if earlier_usd >= cap_usd:
            return False, f"${earlier_usd:.2f} committed in {month} reaches the ${cap_usd:.2f} cap"
    if usd > left + 1e-9:
        return False, (f"{projected} exceeds the ${left:.2f} left of the ${cap_usd:.2f} monthly budget "
                       f"({spending.said()})")
    holds = f" (${spending.held.usd:.2f} held for {spending.held.said('other ')})" if spending.held.jobs else ""
    return True, f"{projected} fits the ${left:.2f} left this month{holds}"


def newly_crossed(spent_usd: float, cap_usd: float, fractions: Sequence[float], said: float) -> float | None:
    """The highest of `fractions` of the cap that the month's spend has reached, when it is above `said` (the highest
    already said this month); else None. A cap of 0 (no cloud) is never crossed."""
    if cap_usd <= 0:
        return None
    reached = [f for f in fractions if spent_usd >= f * cap_usd - 1e-9]
    return max(reached) if reached and max(reached) > said else None


def unpaid_hand_over(launch_usd: float, cap_usd: float) -> str | None:
    """Why a hybrid's hand-over to the cloud is not promised, its cloud phase's launch (`Launch.usd`: its price, its
    billing minimum and its stop) needing more than a whole month's cap (no month pays it), else None. Its decision
    says the same in its own words."""
    if launch_usd <= cap_usd + 1e-9:
        return None
    return (f"its cloud phase (${launch_usd:.2f} with its stop) is more than the whole ${cap_usd:.2f} monthly cap, so "
            "it runs on locally, late, unless budget.monthly_cap_usd is raised")
