"""Spot or on-demand for one rented run. Pure.

Expected spot cost = spot price × g × (T + E[preemptions] × (work since the last checkpoint + restart overhead)),
with E[preemptions] = λ·T and the work lost per preemption averaging half a checkpoint interval. A job that does
not resume from checkpoints starts over at each preemption: (1/λ + r)(e^{λT} − 1) hours in expectation.
Spot wins unless the run is deadline-critical, spot's expected time misses the deadline, or its expected cost is
not lower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

MarketName = Literal["spot", "on-demand"]


# Float hours accumulate rounding error tick by tick; comparisons of time budgets allow this much (~4 ms).
EPS_H = 1e-6


def safety_net(work_left_h: float, time_left_h: float, changeover_h: float, tick_h: float) -> bool:
    """The spot policy's safety net: True once a job must run on on-demand to the end to be sure of finishing.

    The paper's rule: time left <= work left + 2d, rounded up to whole ticks. The second clause covers ticks
    longer than d, where waiting one more tick could already leave less than the d + work an on-demand start
    needs. Both clauses stay true once on on-demand (time and work left then fall together), so the net holds.
    A tick of 0 asks the rule without rounding.
    """
    if work_left_h <= 0:
        return False
    if tick_h <= 0:
        return time_left_h <= work_left_h + 2 * changeover_h + EPS_H
    if time_left_h <= math.ceil((work_left_h + 2 * changeover_h) / tick_h - EPS_H) * tick_h + EPS_H:
        return True
    return time_left_h - tick_h < work_left_h + changeover_h + EPS_H


NO_SPOT_OFFER = "no spot offer for this GPU type from the enabled providers"  # why on-demand, spot being None


@dataclass(frozen=True)
class MarketInputs:
    run_h: float  # T: rented wall-clock hours including overhead, with no preemption
    gpus: int
    od_usd_per_gpu_h: float
    spot_usd_per_gpu_h: float | None
    preemptions_per_h: float  # λ
    checkpoint_interval_h: float
    restart_overhead_h: float  # a new instance + pulling the checkpoint
    deadline_h: float
    deadline_critical: bool = False
    preference: Literal["auto", "spot", "on-demand"] = "auto"
    resumable: bool = True  # False: a preemption loses everything done, not half a checkpoint interval
    preference_from: str = "job"  # who set `preference`, for the record: "job" or "policy.default_market"
    policy_tick_h: float = 0.0  # how often the daemon asks the spot policy: its safety net rounds to it
    no_spot_why: str = NO_SPOT_OFFER  # the reason, spot being None


@dataclass(frozen=True)
class MarketChoice:
    market: MarketName
    od_cost_usd: float
    od_hours: float
    spot_cost_usd: float | None  # expected
    spot_hours: float | None  # expected
    expected_preemptions: float | None
    reasons: list[str] = field(default_factory=list)
    preemptions_per_h: float | None = None  # the λ the spot figures used

    @property
    def cost_usd(self) -> float:
        if self.market == "spot" and self.spot_cost_usd is not None:
            return self.spot_cost_usd
        return self.od_cost_usd

    @property
    def hours(self) -> float:
        if self.market == "spot" and self.spot_hours is not None:
            return self.spot_hours
        return self.od_hours

    @property
    def rate_usd_per_gpu_h(self) -> float:
        return self.cost_usd / self.hours if self.hours else 0.0


def choose_market(x: MarketInputs) -> MarketChoice:
    od_cost = x.od_usd_per_gpu_h * x.gpus * x.run_h
    if x.spot_usd_per_gpu_h is None:
        return MarketChoice("on-demand", od_cost, x.run_h, None, None, None, [x.no_spot_why])

    n = x.preemptions_per_h * x.run_h
    if x.resumable:
        lost_per = x.checkpoint_interval_h / 2.0 + x.restart_overhead_h
        spot_h = x.run_h + n * lost_per
    else:
        # Each preemption starts it over: the expected time to T hours without an interruption, with rate λ and
        # overhead r per restart, is (1/λ + r)(e^{λT} − 1) (T when λ = 0).
        rate = x.preemptions_per_h
        spot_h = (1.0 / rate + x.restart_overhead_h) * math.expm1(rate * x.run_h) if rate > 0 else x.run_h
    spot_cost = x.spot_usd_per_gpu_h * x.gpus * spot_h
    base = dict(od_cost_usd=od_cost, od_hours=x.run_h, spot_cost_usd=spot_cost, spot_hours=spot_h,
                expected_preemptions=n, preemptions_per_h=x.preemptions_per_h)
    figures = (f"spot ≈ ${spot_cost:.2f} over {spot_h:.2f} h ({n:.2f} expected preemptions at "
               f"{x.preemptions_per_h:.3g}/h) "
               f"vs on-demand ${od_cost:.2f} over {x.run_h:.2f} h")

    if x.preference == "on-demand":
        return MarketChoice("on-demand", **base, reasons=[f"{x.preference_from} asks for on-demand", figures])
    if x.deadline_critical:
        return MarketChoice("on-demand", **base, reasons=["deadline-critical: no preemption risk taken", figures])
    # The daemon launches a spot job only while its spot policy's safety net leaves room for a preemption; with
    # less, it starts on on-demand (`lifecycle/market_switch.py`). Priced as it will run: the net asked of the work
    # the daemon will count, spot's expected hours less one overhead, from the start.
    work_h = spot_h - x.restart_overhead_h
    if safety_net(work_h, x.deadline_h, x.restart_overhead_h, x.policy_tick_h):
        return MarketChoice("on-demand", **base, reasons=[
            f"spot leaves no room for a preemption: {x.deadline_h:.2f} h to the deadline, {work_h:.2f} h of work + "
            f"2 × {x.restart_overhead_h:.2f} h overhead to make one up; the daemon's spot policy runs it on "
            "on-demand from the start", figures])
    if x.preference == "spot":
        return MarketChoice("spot", **base, reasons=[f"{x.preference_from} asks for spot", figures])
    if spot_h > x.deadline_h:
        return MarketChoice("on-demand", **base, reasons=["spot's expected time misses the deadline", figures])
    if spot_cost >= od_cost:
        return MarketChoice("on-demand", **base, reasons=["spot is not cheaper once preemptions are counted", figures])
    if not x.resumable:
        return MarketChoice("spot", **base, reasons=["spot is cheaper even with each preemption restarting it (the "
                                                     "job does not resume from checkpoints)", figures])
    return MarketChoice("spot", **base, reasons=["spot is cheaper with checkpoints", figures])
