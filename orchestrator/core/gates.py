"""The two gates, exactly the seed's break-even model. Pure: numbers in, a verdict out.

Gate 1, feasibility: a job that does not fit on the local GPU bursts, no dollar argument.
Gate 2, deadline: T_L = W/s_L, C_L = p_L·T_L. If T_L ≤ D the job runs locally: renting is waste. With local
work queued ahead of it (earlier deadlines, on the one GPU), local finishes after that wait: w + T_L ≤ D.
Otherwise T_R = W/(s_R·g) + t_ovh and C_R = r·g·T_R. If T_R > D neither makes it (rethink scope);
else the deadline has a price: ΔC = C_R − C_L to save T_L − T_R hours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

# Ceilings no real figure reaches, so that a figure typed in the wrong unit (cents for dollars, minutes for hours)
# is refused rather than believed, and the gates' dollars stay finite (a rate of 1e308 $/GPU-h made every cost inf).
# They are the config's own where it has one (config.py): `policy.overhead_h` is at most 24 h, and the local $/h is
# `local.board_power_w` (at most 5,000 W) × `local.electricity_usd_per_kwh` (at most $5/kWh), so at most $25/h.
MAX_RATE_USD_GPU_H = 1000.0  # an H100 rents for $2-$12 a GPU-hour
MAX_OVERHEAD_H = 24.0
MAX_LOCAL_USD_H = 25.0
MAX_GPUS = 64  # as a job file's `gpus`
# The furthest deadline a job may have. A generous cap rather than "whatever a datetime can hold": no training job
# plans a decade ahead, and every later step (events, records, `list`) can then format the instant. Here, not in
# jobspec.py, so that `list`, `show` and `events` (whose module bounds `retry --deadline-hours`) do not build the job
# file's models.
MAX_DEADLINE_YEARS = 10
MAX_DEADLINE_HOURS = MAX_DEADLINE_YEARS * 365.25 * 24  # 87660 h


class Verdict(StrEnum):
    LOCAL = "local"
    BURST = "burst"
    PRICED = "priced"
    RETHINK = "rethink"


@dataclass(frozen=True)
class GateInputs:
    work: float  # W, work units
    s_local: float  # units/h on the local GPU; 0 = does not fit
    s_rented: float  # units/h per rented GPU
    deadline_h: float  # D
    rate_usd_per_gpu_h: float  # r
    gpus: int = 1  # g
    overhead_h: float = 0.5  # t_ovh
    local_usd_h: float = 0.10  # p_L
    fits_locally: bool | None = None  # from sizing; None = judge by s_local alone
    local_wait_h: float = 0.0  # w: hours until the local GPU is free for this job (the local work queued ahead)
    # The GPU hours of that work, when local.available_hours stretch them into a longer w (else None: they are w).
    local_queued_h: float | None = None
    unfit_why: str | None = None  # why the local GPU cannot run it, in words (else said from s_L or fits_locally)


@dataclass(frozen=True)
class GateResult:
    verdict: Verdict
    fits_locally: bool
    t_local_h: float | None
    c_local_usd: float | None
    t_rented_h: float | None
    c_rented_usd: float | None
    delta_cost_usd: float | None
    hours_saved: float | None
    reasons: list[str] = field(default_factory=list)
    local_wait_h: float = 0.0
    local_queued_h: float | None = None


def rented_time_h(work: float, s_rented: float, gpus: int, overhead_h: float) -> float:
    if s_rented <= 0:
        return math.inf
    return work / (s_rented * gpus) + overhead_h


def evaluate(x: GateInputs) -> GateResult:
    fits = x.s_local > 0 and x.fits_locally is not False
    t_r = rented_time_h(x.work, x.s_rented, x.gpus, x.overhead_h)
    c_r = x.rate_usd_per_gpu_h * x.gpus * t_r if math.isfinite(t_r) else math.inf
    reasons: list[str] = []

    if not fits:
        why = x.unfit_why or ("local throughput is 0" if x.s_local <= 0 else "the memory estimate exceeds local VRAM")
        reasons.append(f"Gate 1: does not fit locally ({why}): burst, no dollar argument")
        if math.isfinite(t_r) and t_r > x.deadline_h:
            reasons.append(f"rented T_R {t_r:.2f} h also misses the {x.deadline_h:.2f} h deadline")
        return GateResult(Verdict.BURST, False, None, None, _f(t_r), _f(c_r), None, None, reasons)

    t_l = x.work / x.s_local
    c_l = x.local_usd_h * t_l
    wait, queued = x.local_wait_h, x.local_queued_h
    finish = wait + t_l  # when local is done: after the local work queued ahead of it
    behind = "" if wait <= 0 else (
        f" after the {wait:.2f} h of local work queued ahead of it" if queued is None else
        f" after a {wait:.2f} h wait for the local GPU ({queued:.2f} h of work queued ahead of it, in "
        "local.available_hours)")
    reasons.append("Gate 1: fits locally")
    if finish <= x.deadline_h:
        reasons.append(
            f"Gate 2: local finishes in {finish:.2f} h{behind} within the {x.deadline_h:.2f} h deadline: run local"
        )
        return GateResult(Verdict.LOCAL, True, t_l, c_l, _f(t_r), _f(c_r), None, None, reasons, wait, queued)

    if t_r > x.deadline_h:
        if t_l <= x.deadline_h:  # only the queue ahead makes it late, and renting is too slow anyway
            reasons.append(
                f"Gate 2: local finishes in {finish:.2f} h{behind}, past the {x.deadline_h:.2f} h deadline, and "
                f"rented {t_r:.2f} h misses it too: run local, late (it would make it alone: {t_l:.2f} h)"
            )
            return GateResult(Verdict.LOCAL, True, t_l, c_l, _f(t_r), _f(c_r), None, None, reasons, wait, queued)
        reasons.append(
            f"Gate 2: local {t_l:.2f} h and rented {t_r:.2f} h both miss {x.deadline_h:.2f} h: "
            "rethink scope, not hardware"
        )
        return GateResult(Verdict.RETHINK, True, t_l, c_l, _f(t_r), _f(c_r), None, None, reasons, wait, queued)

    delta = c_r - c_l
    saved = finish - t_r
    price = f"ΔC = ${delta:.2f}" if delta >= 0 else f"ΔC = −${-delta:.2f}, cheaper than local,"
    reasons.append(
        f"Gate 2: local misses ({finish:.2f} h{behind} > {x.deadline_h:.2f} h); renting meets it for "
        f"{price} to save {saved:.2f} h"
    )
    return GateResult(Verdict.PRICED, True, t_l, c_l, t_r, c_r, delta, saved, reasons, wait, queued)


def wait_words(wait_h: float, queued_h: float | None) -> str:
    """Gate 2's w in a few words: the local work queued ahead, or (when local.available_hours stretch it) the wait
    for the local GPU and the work behind it."""
    if queued_h is None:
        return f"{wait_h:.2f} h queued ahead"
    return f"{wait_h:.2f} h wait for the local GPU ({queued_h:.2f} h of work queued ahead, in local.available_hours)"


def _f(v: float) -> float | None:
    return v if math.isfinite(v) else None
