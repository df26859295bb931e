"""Hybrid plans: run locally first (nearly free), burst only the remainder, as late as is safe. Pure.

When local alone misses the deadline D but the job checkpoints, local for x hours then rented for the rest
meets D when  x + (W − s_L·x)/(s_R·g) + t_ovh + margin ≤ D,  so the latest safe switch is
    x* = (D − margin − t_ovh − W/(s_R·g)) / (1 − s_L/(s_R·g)).
Any x ≤ x* is safe; the largest x is cheapest, since local hours cost less than rented ones.

With `local.available_hours` the local phase trains only while the GPU is open: s_L·open(x) instead of s_L·x, where
open(x) is the GPU's open hours in the phase's first x hours. x + (W − s_L·open(x))/(s_R·g) still grows with x (by 1
an hour while closed, by 1 − s_L/(s_R·g) while open), so x* is found by bisection: at 09:00 with nights 22:00-08:00
and D = 12 h, the local phase would do nothing before it must hand over, and burst now is the plan. A phase whose
last hours would fall outside the GPU's hands over when its hours end instead (at 07:00: one hour, then the cloud).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Phase:
    where: str  # local | cloud
    hours: float
    cost_usd: float
    market: str | None = None  # for cloud phases
    gpu: str | None = None
    start_after_h: float = 0.0
    work_units: float = 0.0
    units_h: float | None = None  # the phase's planned speed (s_L, or s_R·g), where the daemon re-plans from it

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "where": self.where, "market": self.market, "gpu": self.gpu, "hours": round(self.hours, 4),
            "start_after_h": round(self.start_after_h, 4), "work_units": round(self.work_units, 6),
            "cost_usd": round(self.cost_usd, 4)}
        if self.units_h is not None:
            out["units_h"] = round(self.units_h, 6)
        return out


@dataclass(frozen=True)
class Plan:
    kind: str  # local | burst | hybrid
    phases: tuple[Phase, ...]

    @property
    def cost_usd(self) -> float:
        return sum(p.cost_usd for p in self.phases)

    @property
    def hours(self) -> float:
        return sum(p.hours for p in self.phases)

    @property
    def rented_cost_usd(self) -> float:
        return sum(p.cost_usd for p in self.phases if p.where == "cloud")


def cloud_phase(decision: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The cloud phase of a decision's plan (`Decision.to_dict`), if it has one."""
    return next((p for p in decision.get("plan") or [] if p["where"] == "cloud"), None)


def planned_cloud_hours(decision: Mapping[str, Any]) -> tuple[float, float]:
    """(hours, start_after_h) of the rented run a decision plans, its overhead included: its plan's cloud phase,
    else the all-rented run it priced (t_rented_h, from the start; 0 h where there is none)."""
    cloud = cloud_phase(decision)
    if cloud is not None:
        return float(cloud["hours"]), float(cloud.get("start_after_h") or 0.0)
    return float(decision.get("t_rented_h") or 0.0), 0.0


def remaining_cloud_h(decision: Mapping[str, Any], done_h: float) -> float:
    """The cloud hours a decision's plan still expects once its cloud attempts have done `done_h` useful hours: its
    cloud phase (or its rented time) less those, never less than its overhead (the next instance pays that)."""
    hours, _ = planned_cloud_hours(decision)
    return max(hours - done_h, float(decision.get("overhead_h") or 0.0))


def planned_cloud_work_h(decision: Mapping[str, Any]) -> float:
    """The compute of the rented run a decision plans, in hours at its planned speed: without its overhead, and
    without the expected rework and restarts that a spot plan's hours also hold (`market.choose_market`). The spot
    policy counts those itself (each switch pays the changeover; the work a preemption lost is counted as not done),
    so counted in its work too, its safety net went on-demand hours early. A hybrid's cloud phase: its work over
    its speed; else the all-rented run's on-demand hours (t_rented_h) less the overhead."""
    overhead = float(decision.get("overhead_h") or 0.0)
    cloud = cloud_phase(decision)
    if cloud is not None and cloud.get("units_h"):
        return float(cloud["work_units"]) / float(cloud["units_h"])
    hours = float(decision.get("t_rented_h") or 0.0) or planned_cloud_hours(decision)[0]
    return max(hours - overhead, 0.0)


def latest_switch_h(work: float, s_local: float, s_rented: float, gpus: int, overhead_h: float,
                    deadline_h: float, margin_h: float) -> float | None:
    """Local hours before bursting the rest still meets the deadline; None when no positive x is safe."""
    speed = s_rented * gpus
    if s_local <= 0 or speed <= s_local:
        return None
    x = (deadline_h - margin_h - overhead_h - work / speed) / (1.0 - s_local / speed)
    x = min(x, work / s_local)
    return x if x > 0 else None


def hybrid_plan(*, work: float, s_local: float, s_rented: float, gpus: int, overhead_h: float, deadline_h: float,
                margin_h: float, local_usd_h: float, rented_usd_per_gpu_h: float, market: str,
                gpu: str, open_h: Callable[[float], float] | None = None, wait_h: float = 0.0,
                billed_per_h: float = 1.0) -> Plan | None:
    """`s_local` and `local_usd_h` per hour of training; `open_h(x)`: the local GPU's open hours in the local phase's
    first x hours (its `local.available_hours`; None: always open). `deadline_h` counts from the local phase's start,
    which is `wait_h` from now (the local GPU's line ahead of it). `billed_per_h`: the cloud phase's expected billed
    hours per planned hour (on spot, above 1: the rework of expected preemptions, as the burst plan prices it)."""
    if open_h is None:
        x = latest_switch_h(work, s_local, s_rented, gpus, overhead_h, deadline_h, margin_h)
        trained = x
    else:
        x = _latest_switch_through_hours(work, s_local, s_rented * gpus, deadline_h - margin_h - overhead_h, open_h)
        trained = None if x is None else min(open_h(x), work / s_local)  # no more than W needs
        if x is not None and trained is not None:
            x = _first_reaching(open_h, trained, x)  # the hand-over when its hours end: waiting on trains nothing
    if x is None or trained is None or not trained > 0:
        return None  # no local training before the hand-over: bursting now is the same plan
    done = min(s_local * trained, work)
    rest = work - done
    rented_h = rest / (s_rented * gpus) + overhead_h
    return Plan("hybrid", (
        Phase("local", x, local_usd_h * trained, start_after_h=wait_h, work_units=done, units_h=s_local),
        Phase("cloud", rented_h, rented_usd_per_gpu_h * gpus * rented_h * billed_per_h, market=market, gpu=gpu,
              start_after_h=wait_h + x, work_units=rest, units_h=s_rented * gpus),
    ))


def _latest_switch_through_hours(work: float, s_local: float, speed: float, room_h: float,
                                 open_h: Callable[[float], float]) -> float | None:
    """The largest x with x + (W − s_L·open(x))/speed ≤ room_h (the module's docstring); None when none is
    positive."""
    if s_local <= 0 or speed <= s_local:
        return None

    def finish(x: float) -> float:
        return x + max(work - s_local * open_h(x), 0.0) / speed

    lo, hi = 0.0, room_h
    if hi <= 0 or finish(0.0) > room_h:
        return None
    if finish(hi) <= room_h:
        return hi  # local alone would make it: gate 2 says so before a hybrid is asked for
    for _ in range(60):  # to well under a second of a deadline weeks away
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if finish(mid) <= room_h else (lo, mid)
    return lo if lo > 0 else None


def _first_reaching(open_h: Callable[[float], float], trained: float, x: float) -> float:
    """The earliest x' ≤ x by which the GPU has been open `trained` hours (x itself when x ends in its hours)."""
    if open_h(x) - open_h(x - 1e-6) > 0:
        return x
    lo, hi = 0.0, x
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if open_h(mid) >= trained - 1e-9 else (mid, hi)
    return hi


def latest_switch_at(*, deadline_at: float, work: float, done: float, rented_units_h: float, overhead_h: float,
                     margin_h: float) -> float:
    """The latest instant (epoch seconds) a hybrid plan's local phase may hand over, given the work `done` so far:
    the rest at the rented speed, plus t_ovh and the margin, still ends by the deadline. x* is this instant with
    the plan's own estimate of the work done (s_L·x); the daemon asks it again with the work measured, so a local
    run slower than its estimate hands over earlier, and a faster one later."""
    rest = min(max(work - done, 0.0), work)
    return deadline_at - (margin_h + overhead_h + rest / rented_units_h) * 3600.0


def projected_finish_at(*, now: float, work: float, done: float, units_h: float | None) -> float | None:
    """When the work left ends at the speed measured so far (epoch seconds), or None without a usable speed.
    The trainer's own figures (`units_done`, `throughput_units_h`) against the plan's s_R: a rented GPU slower than
    the job file said shows up here, hours before the deadline does."""
    if units_h is None or not units_h > 0:
        return None
    return now + max(work - done, 0.0) / units_h * 3600.0
