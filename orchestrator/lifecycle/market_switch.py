"""Which market a job's cloud attempts run on: the job's decision, then the deadline-aware spot policy (the same
pure function `burstctl simulate` replays against real traces), asked before every launch and once a
`daemon.market_check_s` while an attempt runs, with the offer's real prices and what this installation has seen
of that spot market (its own launches, and the provider's capacity listing where there is one)."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Connection, func, insert, select

from orchestrator.app import App
from orchestrator.core.plan import planned_cloud_work_h
from orchestrator.core.short_windows import chance_now
from orchestrator.core.spot_policy import (
    DEFAULT_POLICY,
    AvailabilityStats,
    SemiMarkovDP,
    SpotState,
    get_policy,
)
from orchestrator.core.spot_policy import Market as PolicyMarket
from orchestrator.core.spot_watch import SpotLife, SpotView, mean_uptime_h, watch
from orchestrator.core.zones import zone_order
from orchestrator.lifecycle.machine import AttemptState as A
from orchestrator.simulate import Trace, TraceHistory, refit_stats, refit_ticks
from providers.base import Market, NoCapacity, Offer
from state import schema as s

# Stop reasons of a running attempt the policy moves to the other market.
TO_ON_DEMAND = "to-on-demand"
TO_SPOT = "to-spot"
# The policy the daemon asks, by what it can see. Where the provider lists spot capacity (Lambda-style), the daemon
# sees spot come back while it runs on on-demand and can move back, as `simulate`'s policy does: the default.
# Elsewhere (EC2) it sees spot only by launching. By default it probes spot while on on-demand
# (`daemon.spot_probe_on_demand`, `lifecycle/spot_probe.py`), so it can leave on-demand too, and follows the default.
# With probes off it never leaves on-demand, so the plan must be made for that (`od_is_final`). Planned as if it
# could leave without probing, it buys on-demand at the first outage "for a while" and then stays there: replayed on
# setting (a) that cost $119.53 a run against $114.32 with on-demand final and $108.84 probing
# (benchmarks/daemon_shell.py).
SEEING_POLICY = get_policy(DEFAULT_POLICY)
DAEMON_POLICY = (dataclasses.replace(SEEING_POLICY, od_is_final=True) if isinstance(SEEING_POLICY, SemiMarkovDP)
                 else SEEING_POLICY)
# How far back the daemon's sightings of a spot market are read: a month of launches, preemptions and refusals.
SIGHTINGS_WINDOW_S = 30 * 86400.0


def cloud_attempts(app: App, job_id: str) -> list[dict[str, Any]]:
    with app.store.engine.connect() as c:
        return [dict(r) for r in c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id,
                                                                    s.attempts.c.where == "cloud")).mappings()]


def cloud_hours_done(rows: list[dict[str, Any]], now: float) -> float:
    """Useful cloud hours so far: each started attempt's running time, less the work its preemption lost."""
    return sum(max(0.0, ((r["ended_at"] or now) - r["started_at"]) / 3600.0 - (r["lost_work_h"] or 0.0))
               for r in rows if r["started_at"] is not None)


def unsaved_hours(rows: list[dict[str, Any]], now: float) -> float:
    """Work a preemption now would lose: on each running spot attempt, the time since its last checkpoint came home
    (since its start when none has)."""
    return sum(max(0.0, now - float((r["info"] or {}).get("last_checkpoint_at") or r["started_at"])) / 3600.0
               for r in rows if r["market"] == Market.SPOT.value and r["state"] == A.RUNNING.value
               and r["started_at"] is not None)


def spot_lives_by_gpu(app: App, now: float) -> dict[str, list[SpotLife]]:
    """This installation's spot instances over the last SIGHTINGS_WINDOW_S, by the GPU model of their offer."""
    out: dict[str, list[SpotLife]] = {}
    for gpu, life in _spot_rows(app, None, None, now)[0]:
        out.setdefault(gpu.upper(), []).append(life)
    return out


def spot_sightings(app: App, provider: str, instance_type: str, now: float) -> tuple[list[SpotLife], list[float]]:
    """This installation's spot instances of one type on one provider, and its spot launches refused for lack of
    capacity, over the last SIGHTINGS_WINDOW_S (every job's attempts: the market is the same for all of them)."""
    lives, refusals = _spot_rows(app, provider, instance_type, now)
    return [life for _, life in lives], refusals


def _spot_rows(app: App, provider: str | None, instance_type: str | None, now: float
               ) -> tuple[list[tuple[str, SpotLife]], list[float]]:
    """(GPU model, spot instance life) of every spot attempt that got an instance, and the times of refused spot
    launches, over the last SIGHTINGS_WINDOW_S; of one provider and type, or (None) of every one."""
    a = s.attempts.c
    query = select(a.state, a.instance_id, a.instance_type, a.reason, a.info, a.created_at, a.ended_at).where(
        a.market == Market.SPOT.value, a.where == "cloud", a.created_at >= now - SIGHTINGS_WINDOW_S)
    if provider is not None:
        query = query.where(a.provider == provider)
    if instance_type is not None:
        query = query.where(a.instance_type == instance_type)
    with app.store.engine.connect() as c:
        rows = c.execute(query).mappings().all()
    lives, refusals = [], []
    for r in rows:
        info = r["info"] or {}
        if r["state"] == A.LAUNCH_FAILED.value:
            if info.get("launch_error") == NoCapacity.__name__:
                refusals.append(r["ended_at"] or r["created_at"])
        elif r["instance_id"]:
            preempted = r["state"] == A.PREEMPTED.value or info.get("outcome") == A.PREEMPTED.value
            # A preempted attempt still terminating has no end time yet: the preemption was seen now or before.
            ended = r["ended_at"] if r["ended_at"] is not None else (now if preempted else None)
            lives.append((str(info.get("gpu") or r["instance_type"]),
                          SpotLife(started_at=r["created_at"], ended_at=ended, preempted=preempted)))
    return lives, refusals


def spot_listings(app: App, provider: str, instance_type: str | None, now: float
                  ) -> dict[str, list[tuple[float, bool]]]:
    """The changes in spot capacity the provider listed over the last SIGHTINGS_WINDOW_S, per instance type (one
    type, or all when None)."""
    sl = s.spot_listings.c
    query = select(sl.instance_type, sl.at, sl.up).where(sl.provider == provider, sl.at >= now - SIGHTINGS_WINDOW_S)
    if instance_type is not None:
        query = query.where(sl.instance_type == instance_type)
    out: dict[str, list[tuple[float, bool]]] = {}
    with app.store.engine.connect() as c:
        for itype, at, up in c.execute(query.order_by(sl.at)):
            out.setdefault(itype, []).append((float(at), bool(up)))
    return out


def record_spot_listings(app: App, provider: str, offers: list[Offer], now: float) -> None:
    """Keep each change in the spot capacity a provider lists (offers refreshed once per `daemon.offers_ttl_s`)."""
    sl = s.spot_listings.c
    with app.store.tx() as c:
        for o in offers:
            if o.spot_regions is None:
                continue
            up = bool(o.spot_regions)
            last = c.execute(select(sl.up).where(sl.provider == provider, sl.instance_type == o.instance_type)
                             .order_by(sl.at.desc()).limit(1)).scalar()
            if last is None or bool(last) != up:
                c.execute(insert(s.spot_listings).values(provider=provider, instance_type=o.instance_type, at=now,
                                                         up=up))
    record_spot_region_listings(app, provider, offers, now)


def spot_region_listings(app: App, provider: str, instance_type: str, now: float
                         ) -> dict[str, list[tuple[float, bool]]]:
    """The changes in spot capacity each region listed for this type over the last SIGHTINGS_WINDOW_S."""
    sl = s.spot_region_listings.c
    out: dict[str, list[tuple[float, bool]]] = {}
    with app.store.engine.connect() as c:
        for region, at, up in c.execute(select(sl.region, sl.at, sl.up).where(
                sl.provider == provider, sl.instance_type == instance_type, sl.at >= now - SIGHTINGS_WINDOW_S)
                .order_by(sl.at, sl.id)):
            out.setdefault(region, []).append((float(at), bool(up)))
    return out


def record_spot_region_listings(app: App, provider: str, offers: list[Offer], now: float) -> None:
    """Keep each change in the spot capacity each region lists, for `spot_region_order`."""
    with app.store.tx() as c:
        for o in offers:
            if o.spot_regions is None:
                continue
            last = {region: up for region, (_, up) in _region_states(c, provider, o.instance_type).items()}
            listed = set(o.spot_regions)
            for region in sorted(listed | {r for r, up in last.items() if up}):
                if last.get(region) != (region in listed):
                    c.execute(insert(s.spot_region_listings).values(
                        provider=provider, instance_type=o.instance_type, region=region, at=now,
                        up=region in listed))


def spot_region_order(app: App, provider: str, offer: Offer, now: float) -> tuple[str, ...]:
    """The regions the offer lists spot capacity in, longest listed first, ties in config order
    (`core.zones.zone_order`: the rule `burstctl simulate --may-move` replays). Empty where none are listed."""
    with app.store.engine.connect() as c:
        states = _region_states(c, provider, offer.instance_type)
    regions = offer.spot_regions or ()
    since = [states[r][0] if r in states and states[r][1] else now for r in regions]
    return tuple(regions[i] for i in zone_order([now - at for at in since]))


def _region_states(c: Connection, provider: str, instance_type: str) -> dict[str, tuple[float, bool]]:
    """Each region's last listed change: (since when, spot listed or not). One index range per region, however
    long the history."""
    sl = s.spot_region_listings.c
    last = (select(func.max(sl.id)).where(sl.provider == provider, sl.instance_type == instance_type)
            .group_by(sl.region))
    return {region: (float(at), bool(up))
            for region, at, up in c.execute(select(sl.region, sl.at, sl.up).where(sl.id.in_(last)))}


def spot_view(app: App, provider: str, offer: Offer, now: float) -> SpotView:
    lives, refusals = spot_sightings(app, provider, offer.instance_type, now)
    listed = offer.spot_regions is not None
    policy = app.config.policy
    rate = policy.spot_preemptions_per_hour
    return watch(lives, refusals, now, tick_h=app.config.daemon.policy_tick_h, prior_uptime_h=mean_uptime_h(rate),
                 prior_outage_h=policy.spot_mean_outage_hours,
                 listings=spot_listings(app, provider, offer.instance_type, now).get(offer.instance_type, [])
                 if listed else (),
                 listed_now=bool(offer.spot_regions) if listed else None)


# Where spot capacity is listed, the daemon's record of it is a trace like the ones `burstctl simulate` replays:
# resampled to ticks of LISTED_TICK_S, the zone's semi-Markov model is fitted by simulate's own `refit_stats`, on
# simulate's refit schedule (`refit_ticks`: after 3, 6, 12, 24 h of listings, then daily), so the plan the daemon
# follows is the one simulate measures.
LISTED_TICK_S = 600.0
_LISTED_MODELS: dict[tuple[object, ...], AvailabilityStats] = {}


def listed_series(listings: list[tuple[float, bool]], start: float, ticks: int, tick_s: float) -> np.ndarray:
    """Spot listed (True) or not during each tick of `tick_s` from `start`: the state at the tick's start."""
    at = np.array([a for a, _ in listings])
    up = np.array([u for _, u in listings], dtype=bool)
    i = np.searchsorted(at, start + tick_s * np.arange(ticks), side="right") - 1
    return up[np.maximum(i, 0)]


@dataclasses.dataclass(frozen=True)
class ListedModel:
    """`simulate`'s model fitted on a provider's spot capacity listing of one type, and the regime it is in now."""

    stats: AvailabilityStats  # with the fitted model
    recent_up_fraction: float  # share of the last REGIME_WINDOW_H listed up
    recent_changes: int  # times the listing went or came back in the last FLICKER_WINDOW_H
    hours: float  # of listings behind the fit
    # The chance that the window spot is listed in now lasts at most the policy's `short_window_h` from its start,
    # told at that start (`core.short_windows`); None: spot not listed now, or too few windows have ended yet.
    short_window_chance: float | None = None


def listed_model(app: App, provider: str, instance_type: str, now: float) -> ListedModel | None:
    """The model fitted on the provider's spot capacity listing of this type; None before the first refit.

    As `simulate` shrinks a zone's estimate towards the other zones' pooled past, this one is shrunk towards the
    provider's other listed types, those listed from the same start (simcloud lists every type at once). Where the
    type is listed in several regions, the model also learns how often a run's own region goes while another still
    lists spot (`SpotModel.restart`), from the regions' own listings, as `simulate --may-move` does."""
    every = spot_listings(app, provider, None, now)
    listings = every.get(instance_type)
    if not listings:
        return None
    start = listings[0][0]
    ticks = int((now - start) // LISTED_TICK_S)
    schedule = refit_ticks(ticks + 1, LISTED_TICK_S / 3600.0)
    refit = int(schedule[-1]) if schedule.size else 0
    if refit <= 0:
        return None
    cut = start + refit * LISTED_TICK_S
    # Fitted once per refit, on what was listed before it (the store, and the changes seen, in the key).
    regions = spot_region_listings(app, provider, instance_type, now)
    key = (str(app.store.engine.url), provider, instance_type, start, refit,
           tuple(sorted((name, sum(1 for at, _ in changes if at < cut)) for name, changes in every.items())),
           tuple(sorted((name, sum(1 for at, _ in changes if at < cut)) for name, changes in regions.items())))
    if key not in _LISTED_MODELS:
        if len(_LISTED_MODELS) > 64:
            _LISTED_MODELS.clear()

        def as_trace(name: str, changes: list[tuple[float, bool]]) -> tuple[Trace, TraceHistory]:
            series = listed_series(changes, start, refit, LISTED_TICK_S)
            return (Trace(name=f"{provider}:{name}", path=Path("-"), gap_seconds=LISTED_TICK_S, available=series),
                    TraceHistory.of(series, LISTED_TICK_S))

        trace, history = as_trace(instance_type, listings)
        if len(regions) > 1:  # a job may move between them: each region's own listing, on the same ticks
            zones = np.stack([listed_series(changes, start, refit, LISTED_TICK_S) for _, changes in
                              sorted(regions.items())])
            trace = dataclasses.replace(trace, zones=zones)
            history = TraceHistory.of_trace(trace)
        others = [as_trace(name, changes) for name, changes in sorted(every.items())
                  if name != instance_type and changes[0][0] <= start + LISTED_TICK_S]
        _LISTED_MODELS[key] = refit_stats(trace, history, others, refit)
    # The regime now, from the listing up to now (not only to the refit), read as `simulate` reads it on a trace.
    now_history = TraceHistory.of(listed_series(listings, start, ticks, LISTED_TICK_S), LISTED_TICK_S)
    return ListedModel(_LISTED_MODELS[key], float(now_history.recent_up_fraction[-1]),
                       int(now_history.recent_changes[-1]), refit * LISTED_TICK_S / 3600.0,
                       listed_short_window_chance(every, instance_type, start, ticks, key[:2]))


_SHORT_WINDOW_CHANCES: dict[tuple[object, ...], float | None] = {}


def listed_short_window_chance(every: dict[str, list[tuple[float, bool]]], instance_type: str, start: float,
                               ticks: int, scope: tuple[object, ...] = ()) -> float | None:
    """The chance `simulate` would tell a run that the window spot is listed in now is short (`SpotState.
    short_window_chance`): learned as simulate learns it from traces on one clock (`trace_short_window_chances`),
    the type's listing and the provider's other types listed from the same start being the zones. `scope` (the
    store and the provider) keeps one listing's answer from another's."""
    short_h = getattr(SEEING_POLICY, "short_window_h", None)
    if short_h is None or ticks <= 0:
        return None
    names = [instance_type, *sorted(n for n, changes in every.items()
                                    if n != instance_type and changes[0][0] <= start + LISTED_TICK_S)]
    key = (*scope, start, ticks, short_h, tuple((n, len(every[n])) for n in names))  # no new change: same answer
    if key not in _SHORT_WINDOW_CHANCES:
        if len(_SHORT_WINDOW_CHANCES) > 64:
            _SHORT_WINDOW_CHANCES.clear()
        series = np.stack([listed_series(every[n], start, ticks, LISTED_TICK_S) for n in names])
        histories = [TraceHistory.of(row, LISTED_TICK_S) for row in series]
        chance = chance_now(series, np.stack([h.recent_up_fraction for h in histories]),
                            np.stack([h.recent_changes for h in histories]), LISTED_TICK_S / 3600.0, short_h)
        _SHORT_WINDOW_CHANCES[key] = None if math.isnan(chance) else float(chance)
    return _SHORT_WINDOW_CHANCES[key]


def market_for_attempt(app: App, job: dict[str, Any], provider: str, offer: Offer,
                       now: float | None = None) -> tuple[Market | None, dict[str, Any]]:
    """The market for the job's next attempt on this offer (None: wait for spot, launch nothing now), and what
    the choice rested on (for the trail).

    On-demand when the decision said so (deadline-critical, asked for, or spot not worth it): never downgraded.
    Otherwise the spot policy decides, from the job's cloud phase (hours left, deadline), the offer's spot and
    on-demand prices and the spot market as this installation has seen it. Where the provider does not list spot
    capacity, a refused spot launch is how the daemon learns that spot is gone; the policy then weighs waiting for
    it (the next launch tries again) against paying for on-demand, and goes on-demand before the deadline is at
    risk. Where it lists spot capacity, waiting launches nothing until spot is listed again.
    """
    now = time.time() if now is None else now
    d = job["decision"]
    if d.get("market") != "spot" or offer.spot_usd_h is None:
        return Market.ON_DEMAND, {}
    if offer.spot_usd_h >= offer.on_demand_usd_h:
        # Never worth it; and the plan's "wait" (idle) would read as "launch spot" below.
        return Market.ON_DEMAND, {"policy": "spot not cheaper", "spot_usd_h": offer.spot_usd_h,
                                  "on_demand_usd_h": offer.on_demand_usd_h}
    choice, facts = _ask_policy(app, job, provider, offer, now, PolicyMarket.IDLE)
    if choice is PolicyMarket.ON_DEMAND:
        return Market.ON_DEMAND, facts
    if choice is PolicyMarket.IDLE and offer.spot_regions is not None and not offer.spot_regions:
        return None, facts  # spot is listed as gone: a launch would be refused
    if choice is PolicyMarket.IDLE:
        # "Wait for spot" where only a launch can tell: the launch is the wait's probe (a refusal costs nothing).
        # Where spot is listed up, the daemon starts the job rather than hold it while spot is there. Either way
        # the trail says what was done beside what the plan chose.
        facts = {**facts, "acted": "spot: a probe, spot is seen only by launching" if offer.spot_regions is None
                 else "spot: listed up, so the job starts rather than wait"}
    return Market.SPOT, facts


def attempt_should_move(app: App, job: dict[str, Any], provider: str, offer: Offer, market: Market,
                        now: float | None = None) -> tuple[Market, dict[str, Any]] | None:
    """For a job running on `market`: the market the policy moves it to now, and what that rests on (else None).

    The simulator's policy is asked every tick on either market: near the deadline its safety net moves a spot job
    to on-demand before a preemption could make it late, its plan may leave spot earlier when that is cheaper in
    expectation, and it returns from on-demand to spot when spot is back and worth a changeover. The daemon does
    the same with its running attempts (checkpoint, stop, relaunch on the other market), once a
    `daemon.market_check_s`; back to spot only where the provider lists spot capacity, so that it can see it."""
    now = time.time() if now is None else now
    if offer.spot_usd_h is None or job["decision"].get("market") != "spot":
        return None
    if not job["spec"].get("checkpoint", {}).get("resumable", True):
        return None  # a move restarts a job that does not resume from checkpoints: it stays where it runs
    if market is Market.SPOT:
        choice, facts = _ask_policy(app, job, provider, offer, now, PolicyMarket.SPOT)
        return (Market.ON_DEMAND, facts) if choice is PolicyMarket.ON_DEMAND else None
    if offer.spot_usd_h >= offer.on_demand_usd_h:
        return None
    if offer.spot_regions is None:
        if not app.config.daemon.spot_probe_on_demand:
            return None  # spot seen only by launching, and not probed: on-demand is final
        # Would the plan go back to spot were it up now? Then spot is worth a probe (`lifecycle/spot_probe.py`).
        choice, facts = _ask_policy(app, job, provider, offer, now, PolicyMarket.ON_DEMAND, assume_spot_up=True)
        return (Market.SPOT, {**facts, "probe": True}) if choice is PolicyMarket.SPOT else None
    if not offer.spot_regions:
        return None  # spot listed as gone: nothing to move to
    choice, facts = _ask_policy(app, job, provider, offer, now, PolicyMarket.ON_DEMAND)
    return (Market.SPOT, facts) if choice is PolicyMarket.SPOT else None


def leaves_on_demand(app: App, offer: Offer) -> bool:
    """Whether the daemon can see spot come back while a job of this offer runs on on-demand: the provider lists
    spot capacity, or the daemon probes spot (`daemon.spot_probe_on_demand`). Otherwise on-demand is final."""
    return offer.spot_regions is not None or app.config.daemon.spot_probe_on_demand


def _ask_policy(app: App, job: dict[str, Any], provider: str, offer: Offer, now: float, market: PolicyMarket, *,
                assume_spot_up: bool = False) -> tuple[PolicyMarket, dict[str, Any]]:
    """The policy's choice and what it rested on. `assume_spot_up`: what it would choose were spot up now, having
    just come back (what a probe would find)."""
    d = job["decision"]
    rows = cloud_attempts(app, job["id"])
    overhead = float(d.get("overhead_h") or 0.0)
    job_h = max(planned_cloud_work_h(d), 1e-6)
    # The cloud phase's clock starts with its first attempt (a hybrid plan's local phase is before it).
    t0 = min((r["created_at"] for r in rows), default=now)
    # Progress is what a preemption now would leave: the replays' jobs lose nothing when preempted, a real one loses
    # the work since its last checkpoint. Counted as not done, it keeps the safety net's promise (a preemption at
    # its edge still leaves time to finish on on-demand) whatever the checkpoint interval.
    unsaved = unsaved_hours(rows, now)
    progress = min(max(cloud_hours_done(rows, now) - unsaved, 0.0), job_h)
    deadline_h = (job["deadline_at"] - t0) / 3600.0
    view = spot_view(app, provider, offer, now)
    sees_spot = offer.spot_regions is not None
    fitted = listed_model(app, provider, offer.instance_type, now) if sees_spot else None
    state = SpotState(
        job_hours=job_h, deadline_hours=max(deadline_h, 1e-6), elapsed_h=(now - t0) / 3600.0, progress_h=progress,
        market=market, spot_available=view.available or market is PolicyMarket.SPOT or assume_spot_up,
        changeover_left_h=0.0, changeover_h=overhead, tick_h=app.config.daemon.policy_tick_h,
        od_price=offer.on_demand_usd_h, spot_price=offer.spot_usd_h or 0.0,
        spot_state_for_h=0.0 if assume_spot_up and not view.available else view.state_for_h,
        stats=fitted.stats if fitted else view.stats,
        recent_up_fraction=fitted.recent_up_fraction if fitted else 1.0,
        recent_changes=fitted.recent_changes if fitted else 0,
        # Where spot is listed, as `simulate` tells it from the listing; unknown otherwise (the rule then does nothing)
        short_window_chance=fitted.short_window_chance if fitted and view.available else None)
    leaves = leaves_on_demand(app, offer)
    choice = (SEEING_POLICY if leaves else DAEMON_POLICY).decide(state)
    facts = {"policy": DEFAULT_POLICY if leaves else f"{DEFAULT_POLICY} (on-demand final)",
             "choice": choice.value, "slack_h": round(state.slack_h, 3), "work_left_h": round(state.work_left_h, 3),
             "unsaved_h": round(unsaved, 3), "spot_usd_h": offer.spot_usd_h, "on_demand_usd_h": offer.on_demand_usd_h,
             **view.as_record(),
             "model": (f"semi-markov, fitted on {fitted.hours:.0f} h of listings" if fitted
                       else "memoryless, from launches and listings")}
    if fitted:
        facts["recent_up_fraction"] = round(fitted.recent_up_fraction, 3)
        facts["recent_changes"] = fitted.recent_changes
        if state.short_window_chance is not None:
            facts["short_window_chance"] = round(state.short_window_chance, 3)
    if not math.isfinite(view.stats.mean_uptime_h):  # what as_record() put there
        facts["mean_uptime_h"] = None
    return choice, facts
