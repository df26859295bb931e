"""The monthly budget: a hard cap, and the cadence of cycles it buys. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime


def month_key(ts: float) -> str:
    """The calendar month (UTC) a charge counts against, as YYYY-MM."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m")


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


def admits(projected_usd: float, cap_usd: float, spent_usd: float, held: Held | None = None) -> tuple[bool, str]:
    """The hard cap: a job whose projected cost exceeds what is left is refused, with the reason. What is left is
    the cap less what was spent and what the plans of jobs already admitted have still to spend (`held`): two jobs
    that each fit alone but not together would both launch, and the cap would stop both before either finished."""
    held = held or Held()
    left = max(0.0, cap_usd - spent_usd - held.usd)
    holds = f"${held.usd:.2f} held for {held.said('other ')}" if held.jobs else ""
    if projected_usd > cap_usd + 1e-9:  # not a matter of waiting for a new month
        return False, (f"projected rented ${projected_usd:.2f} is more than the whole ${cap_usd:.2f} monthly budget: "
                       "no month pays it; raise budget.monthly_cap_usd, or give it less work or a later deadline")
    if projected_usd > left + 1e-9:
        return False, (f"projected rented ${projected_usd:.2f} exceeds the ${left:.2f} left of the ${cap_usd:.2f} "
                       f"monthly budget (${spent_usd:.2f} spent{', ' + holds if holds else ''})")
    return True, f"projected rented ${projected_usd:.2f} fits the ${left:.2f} left this month" + (
        f" ({holds})" if holds else "")


@dataclass(frozen=True)
class Held:
    """What the plans of jobs admitted to the cloud (queued or running) have still to spend: their planned rented
    cost less what their instances have cost so far."""

    usd: float = 0.0
    jobs: int = 0

    def said(self, other: str = "") -> str:
        """`1 admitted job's plan`; with `other` ("other "), beside the job being admitted."""
        return f"1 {other}admitted job's plan" if self.jobs == 1 else f"{self.jobs} {other}admitted jobs' plans"

    def plus(self, usd: float) -> Held:
        return Held(self.usd + max(0.0, usd), self.jobs + 1)


def newly_crossed(spent_usd: float, cap_usd: float, fractions: Sequence[float], said: float) -> float | None:
    """The highest of `fractions` of the cap that the month's spend has reached, when it is above `said` (the highest
    already said this month); else None. A cap of 0 (no cloud) is never crossed."""
    if cap_usd <= 0:
        return None
    reached = [f for f in fractions if spent_usd >= f * cap_usd - 1e-9]
    return max(reached) if reached and max(reached) > said else None


def unpaid_hand_over(rented_usd: float, cap_usd: float) -> str | None:
    """Why a hybrid's hand-over to the cloud is not promised, its cloud phase costing more than a whole month's cap
    (no month pays it), else None. Its decision says the same in its own words."""
    if rented_usd <= cap_usd + 1e-9:
        return None
    return (f"its cloud phase (${rented_usd:.2f}) is more than the whole ${cap_usd:.2f} monthly cap, so it runs on "
            "locally, late, unless budget.monthly_cap_usd is raised")
