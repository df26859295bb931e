"""Which market the next cloud attempt of a job runs on: the job's decision, then the deadline-aware spot
policy (the same pure function `burstctl simulate` replays against real traces) once the job is resuming."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select

from orchestrator.app import App
from orchestrator.core.spot_policy import DEFAULT_POLICY, SpotState, get_policy
from orchestrator.core.spot_policy import Market as PolicyMarket
from providers.base import Market
from state import schema as s


def cloud_attempts(app: App, job_id: str) -> list[dict[str, Any]]:
    with app.store.engine.connect() as c:
        return [dict(r) for r in c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id,
                                                                    s.attempts.c.where == "cloud")).mappings()]


def cloud_hours_done(rows: list[dict[str, Any]], now: float) -> float:
    """Useful cloud hours so far: each started attempt's running time, less the work its preemption lost."""
    return sum(max(0.0, ((r["ended_at"] or now) - r["started_at"]) / 3600.0 - (r["lost_work_h"] or 0.0))
               for r in rows if r["started_at"])


def market_for_attempt(app: App, job: dict[str, Any], now: float | None = None) -> Market:
    now = time.time() if now is None else now
    d = job["decision"]
    first = Market.SPOT if d.get("market") == "spot" else Market.ON_DEMAND
    if first is Market.ON_DEMAND:
        return first  # deadline-critical, asked for, or spot not worth it: never downgraded to spot
    rows = cloud_attempts(app, job["id"])
    if not any(r["started_at"] for r in rows):
        return first
    plan_cloud = [p for p in (d.get("plan") or []) if p["where"] == "cloud"]
    overhead = float(d.get("overhead_h") or 0.0)
    job_h = max((plan_cloud[0]["hours"] if plan_cloud else d.get("t_rented_h") or 0.0) - overhead, 1e-6)
    t0 = min(r["created_at"] for r in rows)
    progress = cloud_hours_done(rows, now)
    deadline_h = (job["deadline_at"] - t0) / 3600.0
    state = SpotState(
        job_hours=job_h, deadline_hours=deadline_h, elapsed_h=(now - t0) / 3600.0, progress_h=min(progress, job_h),
        market=PolicyMarket.IDLE, spot_available=True, changeover_left_h=0.0, changeover_h=overhead,
        tick_h=max(app.config.daemon.tick_s, 60.0) / 3600.0,  # a market is chosen per attempt, not per second
        od_price=1.0, spot_price=0.33)
    choice = get_policy(DEFAULT_POLICY).decide(state)
    return Market.ON_DEMAND if choice is PolicyMarket.ON_DEMAND else Market.SPOT
