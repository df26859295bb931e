"""Replay spot/on-demand policies against real spot availability traces, and the offline optimum to judge them.

Semantics are those of the simulator of Wu et al., "Can't Be Late: Optimizing Spot Instance Savings under
Deadlines" (NSDI 2024), as restated in `shared/spot-traces/README.md`, so our figures compare with the paper's:
tick by tick, bill the tick at the price of what ran, count progress (a tick minus any changeover delay left),
preempt spot when the trace says it is gone, then ask the policy. Every switch into spot or on-demand costs d.

Policies are the pure functions of `orchestrator.core.spot_policy`; the replay feeds them only what has happened
by the current tick (availability now and before, the run's own progress), never the trace's future.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np

from orchestrator.core.short_windows import short_window_chances
from orchestrator.core.spot_policy import (
    AGE_EDGES_H,
    DEFAULT_POLICY,
    FLICKER_LEVELS,
    FLICKER_WINDOW_H,
    IDLE_CODE,
    OD_CODE,
    PLANS_CACHED,
    POLICIES,
    REGIME_WINDOW_H,
    REGIMES,
    SHARE_REGIMES,
    SPOT_CODE,
    AvailabilityStats,
    Market,
    Policy,
    SemiMarkovDP,
    SpotBatch,
    SpotModel,
    SpotState,
    age_bucket,
    regime_of,
    safety_net_engaged,
    safety_net_engaged_batch,
)
from orchestrator.core.zones import pick_zone_batch, zone_order
from orchestrator.errors import BadInput, shown_count

_EPS_S = 1e-6  # seconds; float progress sums are compared with this tolerance

# Bounds of a simulation's figures, so that each stays finite and its arrays fit in memory (`burstctl simulate`):
MIN_JOB_HOURS = 1 / 3600.0  # a second of compute: well above _EPS_S, below which a job is done before it starts
MAX_PRICE_USD_H = 1000.0  # $/h of an instance (p3.16xlarge, 8 V100s: $24.48)
MAX_STARTS = 100_000  # random starts per trace (the paper's 300)
MAX_GAP_SECONDS = 86_400  # a tick of a day; the traces' are 30 to 600 s
MAX_NODES = 1_000_000  # instances per tick in a trace, and so the gang size (the traces': 1 to 16)
TRACE_FORMAT = "shared/spot-traces/README.md"


def _shown_json(v: object) -> str:
    """A trace's value for a message, in JSON's words (NaN, Infinity, true, null) and at most a few characters."""
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, int):
        return shown_count(v)
    if isinstance(v, float):
        return json.dumps(v) if not math.isfinite(v) else f"{v:g}"
    kinds: dict[type, str] = {str: "a string", list: "a list", dict: "an object"}
    return kinds.get(type(v), type(v).__name__)


def _is_count(v: object) -> bool:
    """An instance count of a trace's `data`: a whole number from 0 to MAX_NODES (1.0 is one, true is not)."""
    if type(v) is int:
        return 0 <= v <= MAX_NODES
    return type(v) is float and math.isfinite(v) and v.is_integer() and 0 <= v <= MAX_NODES


@dataclass(frozen=True)
class JobSetting:
    """The job and prices of one simulation setting (hours and $/h)."""

    job_hours: float  # C
    deadline_hours: float  # R
    changeover_hours: float  # d
    od_price: float
    spot_price: float

    def validate(self) -> None:
        for name in ("job_hours", "deadline_hours"):
            if not 0 < getattr(self, name) < math.inf:
                raise BadInput("must be a finite number > 0", field=name)
        for name in ("changeover_hours", "od_price", "spot_price"):
            if getattr(self, name) < 0 or not math.isfinite(getattr(self, name)):
                raise BadInput("must be a finite number >= 0", field=name)
        if self.deadline_hours < self.job_hours + self.changeover_hours - 1e-9:
            raise BadInput(f"deadline {self.deadline_hours:g} h is shorter than the job's {self.job_hours:g} h of "
                           f"compute and the changeover of {self.changeover_hours:g} h its start pays: no policy can "
                           "make it", field="deadline_hours")


@dataclass(frozen=True)
class Trace:
    """One zone's spot availability: `available[i]` says whether spot is usable during tick i.

    For a job that may move between zones (`may_move_between`), `zones` holds each zone's availability (zones,
    ticks) and `available` is their union: spot is usable while any zone has it.
    """

    name: str
    path: Path
    gap_seconds: float
    available: np.ndarray  # bool, one entry per tick
    zones: np.ndarray | None = None  # bool (zones, ticks), or None: one zone, `available` itself

    def __len__(self) -> int:
        return int(self.available.shape[0])


def _trace_files(given: str | Path) -> list[Path]:
    if not str(given).strip():  # Path("") is the current directory: a script's unset variable, not a choice
        raise BadInput("is empty: expected a trace file or a directory of them", field="trace")
    path = Path(given)
    if path.is_dir():
        try:  # rglob says nothing of a directory it cannot read: it would be "no trace"
            os.scandir(path).close()
        except OSError as exc:
            raise BadInput(f"directory cannot be read ({exc.strerror})", source=path) from None
        files = sorted(p for p in path.rglob("*.json") if p.is_file())
        if not files:
            raise BadInput("directory holds no *.json trace", source=path)
        return files
    if not path.exists():
        raise BadInput("no such trace file or directory", source=path)
    if not path.is_file():  # a FIFO or a device: reading it would wait for ever
        raise BadInput("is not a regular file: expected a JSON trace file", source=path)
    return [path]


def load_trace(path: str | Path, *, nodes: int = 1, window: int | None = None) -> Trace:
    """Read one trace file. Spot is usable in tick i when data[i] == nodes (a gang job needs all its nodes)."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise BadInput("no such trace file", source=p) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError: a JSONDecodeError, or an integer of more digits than Python converts; RecursionError: nesting.
        raise BadInput(f"not a JSON trace ({type(exc).__name__})", source=p) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list) or not doc["data"]:
        raise BadInput("expected a non-empty list of per-tick counts", source=p, field="data")
    # JSON as Python reads it spells NaN and Infinity: neither is a tick's length (int(NaN) crashed the offline
    # optimum), and the offline optimum counts whole seconds (a tick of 0.4 s was 0 of them).
    gap = (doc.get("metadata") or {}).get("gap_seconds") if isinstance(doc.get("metadata"), dict) else None
    if not ((type(gap) is int or (type(gap) is float and math.isfinite(gap) and gap.is_integer()))
            and 1 <= gap <= MAX_GAP_SECONDS):
        raise BadInput(f"expected a whole number of seconds per tick from 1 to {MAX_GAP_SECONDS} (the format: "
                       f"{TRACE_FORMAT}), got {_shown_json(gap) if gap is not None else 'nothing'}", source=p,
                       field="metadata.gap_seconds")
    bad = next((i for i, v in enumerate(doc["data"]) if not _is_count(v)), None)
    if bad is not None:
        raise BadInput(f"expected the number of spot instances in tick {bad}, a whole number from 0 to {MAX_NODES} "
                       f"(the format: {TRACE_FORMAT}), got {_shown_json(doc['data'][bad])}", source=p,
                       field=f"data.{bad}")
    counts = np.asarray(doc["data"], dtype=float)
    if window is not None:
        if window <= 0:
            raise BadInput(f"must be a positive number of ticks, got {shown_count(window)}", field="window")
        if window > counts.shape[0]:
            raise BadInput(f"is longer than the trace: expected at most its {counts.shape[0]} ticks, got "
                           f"{shown_count(window)}", source=p, field="window")
        counts = counts[:window]
    if nodes > 1 and counts.max() <= 1:
        # A 1-node trace (0 or 1 each tick) read for a gang: spot could never be usable, every policy on-demand.
        raise BadInput(f"is a 1-node trace (each tick 0 or 1); expected --nodes 1 with it, or a "
                       f"{shown_count(nodes)}-node trace",
                       source=p, field="nodes")
    if counts.max() > nodes:
        # An N-node trace is a gang's (spot usable when all N are up): read for a smaller job, spot would count only
        # in the ticks when exactly that many happened to be up.
        most = shown_count(int(counts.max()))
        raise BadInput(f"is a {most}-node trace (each tick 0 to {most} instances up); expected --nodes {most} with "
                       "it", source=p, field="nodes")
    return Trace(name=p.stem, path=p, gap_seconds=float(gap), available=counts == nodes)


def load_traces(paths: Iterable[str | Path], *, nodes: int = 1, window: int | None = None) -> list[Trace]:
    """Files as given, directories expanded to their *.json files (sorted)."""
    traces = [load_trace(f, nodes=nodes, window=window) for p in paths for f in _trace_files(p)]
    if not traces:
        raise BadInput("no trace given", field="trace")
    return traces


def instance_of(trace: Trace) -> str:
    """The instance a trace is of, from its file name `<zone>_<device>_<count>` (shared/spot-traces/README.md):
    "v100_1" for us-west-2a_v100_1. A job may move only between zones of the same instance."""
    return trace.name.split("_", 1)[1] if "_" in trace.name else ""


def may_move_between(traces: Sequence[Trace]) -> Trace:
    """One trace for a job that may move between these zones (one provider's regions, on one clock)."""
    if not traces:
        raise BadInput("no trace given", field="trace")
    first = traces[0]
    for t in traces[1:]:
        if t.gap_seconds != first.gap_seconds or len(t) != len(first):
            raise BadInput(f"--may-move needs zones on one clock: {t.name} has {len(t)} ticks of "
                           f"{t.gap_seconds:g} s, {first.name} {len(first)} of {first.gap_seconds:g} s",
                           source=t.path, field="trace")
    zones = np.stack([t.available for t in traces])
    name = f"any of {len(traces)} zones ({instance_of(first) or first.name})"
    return Trace(name=name, path=first.path.parent, gap_seconds=first.gap_seconds,
                 available=cast(np.ndarray, zones.any(axis=0)),  # numpy types any(axis=...) as maybe a scalar
                 zones=zones)


def zone_up_for_h(trace: Trace) -> np.ndarray | None:
    """For a trace of several zones, how long each zone's spot has been up at each tick (zones, ticks); else None."""
    if trace.zones is None:
        return None
    return np.stack([TraceHistory.of(z, trace.gap_seconds).run_age_h for z in trace.zones])


# --- what a policy may know: statistics of the trace up to (and including) the current tick --------------------


@dataclass(frozen=True)
class TraceHistory:
    """Per-tick running statistics of one trace, each computed from ticks 0..i only (so no look-ahead).

    `stats_at(i)` is what an operator who had watched the zone since the trace began would know at tick i.
    """

    gap_h: float
    up_fraction: np.ndarray
    mean_outage_h: np.ndarray
    mean_uptime_h: np.ndarray
    run_age_h: np.ndarray  # how long spot has been in its tick-i state, counting tick i
    recent_up_fraction: np.ndarray  # share of the REGIME_WINDOW_H ending with tick i that spot was up
    recent_changes: np.ndarray  # times spot went or came back in the FLICKER_WINDOW_H ending with tick i
    # For a job that may move between zones: a run that has followed the zone rule since tick 0 (spot whenever any
    # zone has it), its ticks on spot and the times it lost its zone while another had spot, by tick i (cumulative).
    moving_spot_ticks: np.ndarray | None = None
    moving_restarts: np.ndarray | None = None

    @classmethod
    def of_trace(cls, trace: Trace) -> TraceHistory:
        history = cls.of(trace.available, trace.gap_seconds)
        up_for_h = zone_up_for_h(trace)
        if trace.zones is None or up_for_h is None:  # one is None when the other is
            return history
        spot, restarts = _follow_zones(trace.zones, up_for_h)
        return dataclasses.replace(history, moving_spot_ticks=np.cumsum(spot), moving_restarts=np.cumsum(restarts))

    @classmethod
    def of(cls, available: np.ndarray, gap_seconds: float) -> TraceHistory:
        a = available.astype(bool)
        n = a.shape[0]
        gap_h = gap_seconds / 3600.0
        ticks = np.arange(1, n + 1)
        up_fraction = np.cumsum(a) / ticks
        # Runs of equal availability; a run is "completed" at tick i once a later state was seen by tick i.
        change = np.flatnonzero(a[1:] != a[:-1]) + 1
        starts = np.concatenate(([0], change))
        ends = np.concatenate((change, [n]))  # exclusive
        lengths_h = (ends - starts) * gap_h
        is_up = a[starts]
        run_id = np.repeat(np.arange(starts.shape[0]), ends - starts)
        run_age_h = (np.arange(n) - starts[run_id] + 1) * gap_h

        def running_mean(mask: np.ndarray) -> np.ndarray:
            # Mean length of the runs of this kind that ended strictly before tick i (end <= i).
            total = np.zeros(n + 1)
            count = np.zeros(n + 1)
            np.add.at(total, ends[mask], lengths_h[mask])
            np.add.at(count, ends[mask], 1)
            total, count = np.cumsum(total)[:n], np.cumsum(count)[:n]
            with np.errstate(invalid="ignore", divide="ignore"):
                return np.where(count > 0, total / np.maximum(count, 1), np.nan)

        window = max(round(REGIME_WINDOW_H / gap_h), 1)
        ups = np.cumsum(a)
        recent = (ups - np.concatenate((np.zeros(min(window, n)), ups[:-window]))) / np.minimum(ticks, window)
        window = max(round(FLICKER_WINDOW_H / gap_h), 1)
        changes = np.cumsum(np.concatenate(([0], a[1:] != a[:-1])))  # by tick i: ticks differing from the one before
        flicker = changes - np.concatenate((np.zeros(min(window, n), dtype=np.int64), changes[:-window]))
        return cls(gap_h=gap_h, up_fraction=up_fraction, mean_outage_h=running_mean(~is_up),
                   mean_uptime_h=running_mean(is_up), run_age_h=run_age_h,
                   recent_up_fraction=recent, recent_changes=flicker)

    def stats_at(self, i: int) -> AvailabilityStats:
        return AvailabilityStats(
            up_fraction=float(self.up_fraction[i]),
            mean_outage_h=float(self.mean_outage_h[i]),
            mean_uptime_h=float(self.mean_uptime_h[i]),
            observed_h=(i + 1) * self.gap_h,
        )


def _follow_zones(zones: np.ndarray, up_for_h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per tick: is a run that takes spot wherever it is (zone rule, `core.zones`) on spot, and did it just lose its
    zone while another had spot."""
    n = zones.shape[1]
    on_spot, restarted = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    zone = -1
    for t in range(n):
        if zone >= 0 and zones[zone, t]:
            on_spot[t] = True
            continue
        up = zones[:, t]
        if not up.any():
            zone = -1
            continue
        restarted[t] = zone >= 0
        zone = int(pick_zone_batch(up[:, None], up_for_h[:, t:t + 1])[0])
        on_spot[t] = True
    return on_spot, restarted


# --- a zone's availability model, learned from what has been observed ----------------------------------------------


@dataclass(frozen=True)
class ZoneCounts:
    """What a stretch of a zone's history shows, per (regime, spot up/down, age bucket): ticks observed (`seen`)
    and how many of them ended that spot state (`ended`); and `moves[r, r2]`, ticks in regime r followed by r2."""

    seen: np.ndarray
    ended: np.ndarray
    moves: np.ndarray

    def __add__(self, other: ZoneCounts) -> ZoneCounts:
        return ZoneCounts(self.seen + other.seen, self.ended + other.ended, self.moves + other.moves)

    def by_flicker(self) -> tuple[np.ndarray, np.ndarray]:
        """`seen` and `ended` as (flicker level, share regime, up/down, age bucket)."""
        shape = (FLICKER_LEVELS, SHARE_REGIMES, *self.seen.shape[1:])
        return self.seen.reshape(shape), self.ended.reshape(shape)


@dataclass(frozen=True)
class ZonePrior:
    """What a zone's own counts are shrunk towards: the other zones' pooled chances."""

    hazards: np.ndarray  # (share regime, up/down, age bucket): chance a tick ends that state, calm and flicker pooled
    moves: np.ndarray  # (regime, regime): chance a tick in one regime is followed by one in the other


def hazard_counts(available: np.ndarray, history: TraceHistory, before: int, since: int = 0) -> ZoneCounts:
    """The counts of ticks in [since, before) of one trace.

    A tick counts once the tick after it has been seen too, so only history strictly before `before` is used.
    """
    n_buckets = len(AGE_EDGES_H) + 1
    last = max(min(before, available.shape[0]) - 1, 0)
    first = min(max(since, 0), last)
    a = available[first:last].astype(np.int64)
    left = available[first + 1:last + 1] != available[first:last]
    regime = regime_of(history.recent_up_fraction[first:last + 1], history.recent_changes[first:last + 1])
    cell = (regime[:-1] * 2 + a) * n_buckets + age_bucket(history.run_age_h[first:last])
    shape = (REGIMES, 2, n_buckets)
    seen = np.bincount(cell, minlength=math.prod(shape)).reshape(shape).astype(float)
    ended = np.bincount(cell, weights=left, minlength=math.prod(shape)).reshape(shape)
    moves = np.bincount(regime[:-1] * REGIMES + regime[1:], minlength=REGIMES ** 2
                        ).reshape(REGIMES, REGIMES).astype(float)
    return ZoneCounts(seen, ended, moves)


def flicker_factors(counts: Sequence[ZoneCounts], prior: ZonePrior, prior_ends: float) -> np.ndarray:
    """By how much each flicker level (rows; 0 calm) changes the youngest age bucket's chance of spot going (up) or
    coming back (down), (levels, 2): the ends seen in that bucket against those the pooled hazards expect, over
    every zone given, shrunk towards 1 with the weight of `prior_ends` ends. A few numbers learned from all zones,
    so flicker splits no zone's counts (as a regime of its own it cost 1.6 points, docs/simulate.md)."""
    ended = np.zeros((FLICKER_LEVELS, 2))
    expected = np.zeros((FLICKER_LEVELS, 2))
    for c in counts:
        seen, ends = c.by_flicker()
        ended += ends[..., 0].sum(axis=1)
        expected += (seen[..., 0] * prior.hazards[None, ..., 0]).sum(axis=1)
    return (ended + prior_ends) / (expected + prior_ends)


def blend_model(tick_h: float, counts: ZoneCounts, prior: ZonePrior, prior_ticks: float,
                flicker: np.ndarray | None = None) -> SpotModel:
    """Chances from the zone's own counts, each shrunk towards `prior`'s with the weight of `prior_ticks` ticks.

    Hazards are estimated per share regime (every flicker level together); `flicker` (`flicker_factors`, default
    none) then scales the youngest age bucket's at each flicker level."""
    seen, ended = (x.sum(axis=0) for x in counts.by_flicker())
    base = (ended + prior_ticks * prior.hazards) / (seen + prior_ticks)
    leave = np.repeat(base[None], FLICKER_LEVELS, axis=0)
    if flicker is not None:
        leave[..., 0] = np.clip(base[None, ..., 0] * flicker[:, None, :], 0.0, 1.0)
    switch = (counts.moves + prior_ticks * prior.moves) / (counts.moves.sum(axis=1, keepdims=True) + prior_ticks)
    return SpotModel(tick_h=tick_h, leave=_nested(leave.reshape(REGIMES, *base.shape[1:])),
                     regime_switch=_nested(switch))


def _nested(a: np.ndarray) -> tuple:
    """An array as nested tuples (hashable, for the plan cache)."""
    return tuple(_nested(x) for x in a) if a.ndim > 1 else tuple(a.tolist())


# --- the replay ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOutcome:
    cost_usd: float
    spot_hours: float  # billed hours on spot (including changeovers)
    od_hours: float  # billed hours on on-demand (including changeovers)
    spot_work_hours: float  # progress made on spot
    od_work_hours: float  # progress made on on-demand
    missed: bool
    finished_h: float | None  # wall-clock hours from start to completion, None if missed


def replay(policy: Policy, trace: Trace, start: int, job: JobSetting, history: TraceHistory | None = None,
           stats: AvailabilityStats | None = None, short_window_chance: np.ndarray | None = None) -> RunOutcome:
    """Run one job from tick `start` of `trace` under `policy`, by the paper's replay semantics.

    The policy sees `stats` if given, else the running statistics of `history` at each tick; and at each tick the
    chance that spot's up window is short (`short_window_chances`, one a tick; NaN or None: unknown).
    """
    gap = trace.gap_seconds
    gap_h = gap / 3600.0
    need = job.job_hours * 3600.0
    deadline = job.deadline_hours * 3600.0
    delay = job.changeover_hours * 3600.0
    avail = trace.available
    n = len(trace)
    price = {Market.SPOT: job.spot_price, Market.ON_DEMAND: job.od_price}
    billed = {Market.SPOT: 0.0, Market.ON_DEMAND: 0.0}
    work = {Market.SPOT: 0.0, Market.ON_DEMAND: 0.0}
    cost = 0.0
    done = 0.0
    changeover_left = 0.0
    market = Market.IDLE
    forced_od = False  # the safety net has engaged: on-demand to the end, no more questions to ask
    up_for_h = zone_up_for_h(trace)
    zone = 0  # the zone a run on spot is in (only one unless the job may move)
    k = 0
    missed = False
    while done < need - _EPS_S:
        elapsed = k * gap
        t = start + k
        if elapsed >= deadline - _EPS_S or t >= n:
            missed = True
            break
        up = bool(avail[t])
        if market is Market.SPOT and not (up if trace.zones is None else trace.zones[zone, t]):
            market, changeover_left = Market.IDLE, 0.0  # preempted: the tick before still counted
        if forced_od:
            action = Market.ON_DEMAND
        else:
            state = SpotState(
                job_hours=job.job_hours,
                deadline_hours=job.deadline_hours,
                elapsed_h=elapsed / 3600.0,
                progress_h=done / 3600.0,
                market=market,
                spot_available=up,
                changeover_left_h=changeover_left / 3600.0,
                changeover_h=job.changeover_hours,
                tick_h=gap_h,
                od_price=job.od_price,
                spot_price=job.spot_price,
                spot_state_for_h=float(history.run_age_h[t]) if history is not None else 0.0,
                recent_up_fraction=float(history.recent_up_fraction[t]) if history is not None else 1.0,
                recent_changes=int(history.recent_changes[t]) if history is not None else 0,
                stats=stats if stats is not None else history.stats_at(t) if history is not None else None,
                short_window_chance=None if short_window_chance is None or math.isnan(short_window_chance[t])
                else float(short_window_chance[t]),
            )
            action = policy.decide(state)
            if action is Market.SPOT and not up:
                raise ValueError(f"policy {policy.name!r} chose spot while spot is unavailable")
            forced_od = action is Market.ON_DEMAND and safety_net_engaged(state)
        if action is not market:
            changeover_left = delay if action is not Market.IDLE else 0.0
            market = action
            if market is Market.SPOT and up_for_h is not None and trace.zones is not None:
                zone = zone_order([float(h) if u else None for u, h in zip(trace.zones[:, t], up_for_h[:, t],
                                                                          strict=True)])[0]
        if market is not Market.IDLE:
            cost += price[market] * gap_h
            billed[market] += gap_h
            progress = min(max(gap - changeover_left, 0.0), need - done)
            changeover_left = max(changeover_left - gap, 0.0)
            done += progress
            work[market] += progress / 3600.0
        k += 1
    return RunOutcome(
        cost_usd=cost,
        spot_hours=billed[Market.SPOT],
        od_hours=billed[Market.ON_DEMAND],
        spot_work_hours=work[Market.SPOT],
        od_work_hours=work[Market.ON_DEMAND],
        missed=missed,
        finished_h=None if missed else k * gap_h,
    )


@dataclass(frozen=True)
class BatchOutcome:
    """`RunOutcome`s of many runs as arrays (one entry per start)."""

    cost_usd: np.ndarray
    spot_hours: np.ndarray
    od_hours: np.ndarray
    spot_work_hours: np.ndarray
    od_work_hours: np.ndarray
    missed: np.ndarray
    finished_h: np.ndarray  # nan if missed

    @classmethod
    def concat(cls, parts: Sequence[tuple[np.ndarray, BatchOutcome]], runs: int) -> BatchOutcome:
        """Reassemble outcomes of subsets (index arrays, outcomes) into one, in the original order."""
        names = ("cost_usd", "spot_hours", "od_hours", "spot_work_hours", "od_work_hours", "missed", "finished_h")
        out = {n: np.zeros(runs, dtype=bool if n == "missed" else float) for n in names}
        for idx, part in parts:
            for n in names:
                out[n][idx] = getattr(part, n)
        return cls(**out)

    def outcome(self, i: int) -> RunOutcome:
        return RunOutcome(cost_usd=float(self.cost_usd[i]), spot_hours=float(self.spot_hours[i]),
                          od_hours=float(self.od_hours[i]), spot_work_hours=float(self.spot_work_hours[i]),
                          od_work_hours=float(self.od_work_hours[i]), missed=bool(self.missed[i]),
                          finished_h=None if self.missed[i] else float(self.finished_h[i]))


def replay_batch(policy: Policy, trace: Trace, starts: Sequence[int] | np.ndarray, job: JobSetting,
                 history: TraceHistory | None = None, stats: AvailabilityStats | None = None,
                 refits: Sequence[tuple[int, AvailabilityStats]] = (),
                 short_window_chance: np.ndarray | None = None) -> BatchOutcome:
    """`replay` for many starts at once: all runs advance tick by tick together, the policy decides on arrays.

    Same semantics and arithmetic as `replay`, run for run. `history` gives the policy how long spot has been
    in its state and how often it changed lately; `stats` is what the policy knows of the zone, shared by these runs.
    `refits` — (tick, stats) sorted by tick — replaces `stats`: at trace tick t a run is decided with the stats
    of the last refit at or before t (learned from ticks before it), so a run's knowledge grows as it runs.
    `short_window_chance` is as `replay`'s.
    """
    gap = trace.gap_seconds
    gap_h = gap / 3600.0
    need = job.job_hours * 3600.0
    deadline = job.deadline_hours * 3600.0
    delay = job.changeover_hours * 3600.0
    avail = trace.available
    n = len(trace)
    starts_arr = np.asarray(starts, dtype=np.int64)
    runs = starts_arr.shape[0]
    price = np.array([0.0, job.spot_price, job.od_price])
    billed = np.zeros((3, runs))
    work = np.zeros((3, runs))
    cost = np.zeros(runs)
    done = np.zeros(runs)
    changeover_left = np.zeros(runs)
    market = np.full(runs, IDLE_CODE, dtype=np.int8)
    zone = np.zeros(runs, dtype=np.int64)  # the zone a run on spot is in (only one unless the job may move)
    up_for_h = zone_up_for_h(trace)
    forced_od = np.zeros(runs, dtype=bool)
    missed = np.zeros(runs, dtype=bool)
    finished = np.full(runs, np.nan)
    active = done < need - _EPS_S
    refit_ticks = np.array([tick for tick, _ in refits], dtype=np.int64)
    known = tuple(stats for _, stats in refits)
    k = 0
    while active.any():
        elapsed = k * gap
        t = starts_arr + k
        out_of_time = active & ((elapsed >= deadline - _EPS_S) | (t >= n))
        missed |= out_of_time
        active &= ~out_of_time
        if not active.any():
            break
        t = np.minimum(t, n - 1)
        up = avail[t]
        preempted = (market == SPOT_CODE) & ~(up if trace.zones is None else trace.zones[zone, t])
        market[preempted] = IDLE_CODE
        changeover_left[preempted] = 0.0
        batch = SpotBatch(
            job_hours=job.job_hours, deadline_hours=job.deadline_hours, changeover_h=job.changeover_hours,
            tick_h=gap_h, od_price=job.od_price, spot_price=job.spot_price,
            elapsed_h=np.full(runs, elapsed / 3600.0), progress_h=done / 3600.0, market=market.copy(),
            spot_available=up, changeover_left_h=changeover_left / 3600.0,
            spot_state_for_h=history.run_age_h[t] if history is not None else np.zeros(runs), stats=stats,
            recent_up_fraction=history.recent_up_fraction[t] if history is not None else None,
            recent_changes=history.recent_changes[t] if history is not None else None, known=known,
            short_window_chance=short_window_chance[t] if short_window_chance is not None else None,
            which=np.maximum(np.searchsorted(refit_ticks, t, side="right") - 1, 0) if refits else None)
        action = np.asarray(policy.decide_batch(batch), dtype=np.int8)
        bad = active & ~forced_od & (action == SPOT_CODE) & ~up
        if bad.any():
            raise ValueError(f"policy {policy.name!r} chose spot while spot is unavailable")
        forced_od |= active & (action == OD_CODE) & safety_net_engaged_batch(batch)
        action = np.where(forced_od, OD_CODE, action).astype(np.int8)
        action[~active] = market[~active]  # finished or missed runs stay as they are (and are not billed)
        switched = active & (action != market)
        changeover_left[switched] = np.where(action[switched] != IDLE_CODE, delay, 0.0)
        if trace.zones is not None and up_for_h is not None:
            to_spot = np.flatnonzero(switched & (action == SPOT_CODE))
            zone[to_spot] = pick_zone_batch(trace.zones[:, t[to_spot]], up_for_h[:, t[to_spot]])
        market = action
        running = active & (market != IDLE_CODE)
        idx = np.flatnonzero(running)
        m = market[idx]
        cost[idx] += price[m] * gap_h
        billed[m, idx] += gap_h
        progress = np.minimum(np.maximum(gap - changeover_left[idx], 0.0), need - done[idx])
        changeover_left[idx] = np.maximum(changeover_left[idx] - gap, 0.0)
        done[idx] += progress
        work[m, idx] += progress / 3600.0
        k += 1
        now_done = active & (done >= need - _EPS_S)
        finished[now_done] = k * gap_h
        active &= ~now_done
    return BatchOutcome(cost_usd=cost, spot_hours=billed[SPOT_CODE], od_hours=billed[OD_CODE],
                        spot_work_hours=work[SPOT_CODE], od_work_hours=work[OD_CODE], missed=missed,
                        finished_h=finished)


def deadline_ticks(job: JobSetting, gap_seconds: float) -> int:
    """Ticks a run may use: those starting before R."""
    return math.ceil(job.deadline_hours * 3600.0 / gap_seconds - 1e-9)


def sample_starts(trace: Trace, job: JobSetting, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` uniformly random start ticks, each with at least R of trace left."""
    span = deadline_ticks(job, trace.gap_seconds)
    last = len(trace) - span
    if last < 0:
        raise BadInput(f"trace has {len(trace)} ticks, fewer than the deadline's {span}", source=trace.path,
                       field="deadline_hours")
    return rng.integers(0, last + 1, size=count)


# --- the offline optimum ------------------------------------------------------------------------------------------


_OFFLINE_CHUNK = 32  # runs per pass of the offline DP (measured best of 16-300 on settings (a) and (b))
# Work units the offline DP takes before it falls back to its lower bound. The cost of a tick grows with the slack
# in units: setting (a) needs 1,440 units (3 s of CPU a trace); setting (b)'s exact optimum 11,520 (15 s units, about
# 30 s a trace against 3 s for the bound), so `simulate` computes it only when asked (`exact_offline`).
OFFLINE_UNITS = 2000
EXACT_OFFLINE_UNITS = 20000  # with `exact_offline`: memory stays under about 300 MB a process even at 26 phases


def offline_optimum(trace: Trace, starts: Sequence[int] | np.ndarray, job: JobSetting,
                    *, max_work_units: int = OFFLINE_UNITS) -> tuple[np.ndarray, bool]:
    """Least cost of finishing by R for each start, knowing the whole trace (dynamic programming).

    State: tick, work left, and what the job is on (and in which zone, for a job that may move between zones)
    including how far into its changeover it is. Progress is
    counted in units dividing both a full tick and the partial tick that ends a changeover, which is exact.
    When that needs more than `max_work_units` units the partial tick is counted as a full one instead: an
    optimistic relaxation, so the result is then a lower bound. Returns (costs, exact).
    """
    starts_arr = np.asarray(starts, dtype=np.int64)
    # Runs are independent: a few dozen at a time keep the arrays of a tick in the processor's cache.
    parts = [_offline_chunk(trace, starts_arr[i:i + _OFFLINE_CHUNK], job, max_work_units)
             for i in range(0, starts_arr.shape[0], _OFFLINE_CHUNK)]
    costs = np.concatenate([c for c, _ in parts]) if parts else np.zeros(0)
    return costs, all(exact for _, exact in parts)


def _offline_chunk(trace: Trace, starts_arr: np.ndarray, job: JobSetting, max_work_units: int
                   ) -> tuple[np.ndarray, bool]:
    """`offline_optimum` for these starts."""
    gap = round(trace.gap_seconds)  # traces use whole seconds per tick
    delay = round(job.changeover_hours * 3600.0)
    need = job.job_hours * 3600.0
    zero_ticks, rem = divmod(delay, gap)  # ticks of a changeover with no progress, then one with gap - rem
    partial = gap - rem
    unit = math.gcd(gap, partial)
    exact = math.ceil(need / unit - 1e-9) <= max_work_units
    if not exact:
        unit, partial = gap, gap
    full_u, partial_u = gap // unit, partial // unit
    total_u = math.ceil(need / unit - 1e-9)
    span = deadline_ticks(job, trace.gap_seconds)
    zones = trace.zones if trace.zones is not None else trace.available[None, :]
    windows = zones[:, starts_arr[:, None] + np.arange(span)[None, :]]  # (zones, S, span)
    n_zones, n_runs = zones.shape[0], starts_arr.shape[0]
    phases = zero_ticks + 2  # ticks since the switch: 0..zero_ticks+1 (the last means "changeover over")
    inf = np.float64(np.inf)

    def progress_at(phase: int) -> int:
        return 0 if phase < zero_ticks else (partial_u if phase == zero_ticks else full_u)

    # Values are kept for every work-left column, but each tick only updates the band that matters: at tick k
    # at most k ticks of work are done (w >= total - k*full) and what is more than the ticks left can do is a
    # miss (inf, never written). The band is the slack wide, not the job wide. Column `pad + w` holds work left
    # w; the `pad` columns below work 0 hold its value too (0: done), so reading the value after some progress
    # is a slice, not a gather.
    pad = full_u
    idle = np.full((n_runs, pad + total_u + 1), inf)
    idle[:, :pad + 1] = 0.0
    # Phase 0 (the tick of a switch) is never the state after a tick, and there the choices are idle's: only
    # phases 1.. are kept. od[h] / spot[h] is on-demand / spot at phase h; spot's has a row per zone. A run on
    # spot stays in its zone until preempted (moving by choice would only restart the changeover).
    od = {h: idle.copy() for h in range(1, phases)}
    spot = {h: np.repeat(idle[None], n_zones, axis=0) for h in range(1, phases)}
    spot_tick = job.spot_price * gap / 3600.0
    od_tick = job.od_price * gap / 3600.0
    width = max(min((span - k) * full_u, total_u) - max(total_u - k * full_u, 1) + 1 for k in range(span))
    start_od, start_any_spot, keep_od, new_idle = (np.empty((n_runs, width)) for _ in range(4))
    start_spot, keep = (np.empty((n_zones, n_runs, width)) for _ in range(2))
    new_od = {h: np.empty((n_runs, width)) for h in od}
    new_spot = {h: np.empty((n_zones, n_runs, width)) for h in spot}
    for k in range(span - 1, -1, -1):
        lo = max(total_u - k * full_u, 1)
        hi = min((span - k) * full_u, total_u)
        if lo > hi:
            continue
        n = hi - lo + 1
        band = slice(pad + lo, pad + hi + 1)

        def after(v: np.ndarray, units: int, n: int = n, lo: int = lo) -> np.ndarray:
            """Values after making `units` of progress, for the band: column w reads column max(w - units, 0)."""
            return v[..., pad + lo - units:pad + lo - units + n]

        down = ~windows[:, :, k][:, :, None]  # (zones, S, 1)
        idle_b = idle[:, band]
        first = min(1, phases - 1)  # the phase after a switch's first tick
        s_od, s_any, kp_od, n_idle = start_od[:, :n], start_any_spot[:, :n], keep_od[:, :n], new_idle[:, :n]
        s_spot, kp = start_spot[:, :, :n], keep[:, :, :n]
        np.add(od_tick, after(od[first], progress_at(0)), out=s_od)
        np.add(spot_tick, after(spot[first], progress_at(0)), out=s_spot)
        np.copyto(s_spot, inf, where=down)  # spot cannot be started where it is gone
        np.min(s_spot, axis=0, out=s_any)
        np.minimum(idle_b, s_od, out=n_idle)
        np.minimum(n_idle, s_any, out=n_idle)
        for h in range(1, phases):
            nxt = min(h + 1, phases - 1)
            out = new_od[h][:, :n]
            np.add(od_tick, after(od[nxt], progress_at(h)), out=kp_od)
            np.minimum(kp_od, idle_b, out=out)
            np.minimum(out, s_any, out=out)
            out = new_spot[h][:, :, :n]
            np.add(spot_tick, after(spot[nxt], progress_at(h)), out=kp)
            np.minimum(kp, idle_b, out=out)
            np.minimum(out, s_od, out=out)
            np.copyto(out, np.broadcast_to(n_idle, out.shape), where=down)  # preempted: as if idle
        idle[:, band] = n_idle
        for h in range(1, phases):
            od[h][:, band] = new_od[h][:, :n]
            spot[h][:, :, band] = new_spot[h][:, :, :n]
    return idle[:, pad + total_u], exact


def availability_bound(trace: Trace, starts: Sequence[int] | np.ndarray, job: JobSetting) -> np.ndarray:
    """A looser, changeover-free lower bound: spot for all the spot time in [0, R), on-demand for the rest."""
    span = deadline_ticks(job, trace.gap_seconds)
    starts_arr = np.asarray(starts, dtype=np.int64)
    spot_h = trace.available[starts_arr[:, None] + np.arange(span)[None, :]].sum(axis=1) * trace.gap_seconds / 3600
    on_spot = np.minimum(spot_h, job.job_hours)
    return on_spot * job.spot_price + (job.job_hours - on_spot) * job.od_price


# --- many runs ----------------------------------------------------------------------------------------------------


@dataclass
class PolicySummary:
    name: str
    runs: int = 0
    misses: int = 0
    total_cost: float = 0.0
    total_spot_h: float = 0.0
    total_od_h: float = 0.0
    total_spot_work_h: float = 0.0
    total_od_work_h: float = 0.0
    costs: list[float] = field(default_factory=list)

    def add(self, r: RunOutcome) -> None:
        self.runs += 1
        self.misses += int(r.missed)
        self.total_cost += r.cost_usd
        self.total_spot_h += r.spot_hours
        self.total_od_h += r.od_hours
        self.total_spot_work_h += r.spot_work_hours
        self.total_od_work_h += r.od_work_hours
        self.costs.append(r.cost_usd)

    def add_batch(self, b: BatchOutcome) -> None:
        for i in range(b.cost_usd.shape[0]):
            self.add(b.outcome(i))

    @property
    def mean_cost(self) -> float:
        return self.total_cost / self.runs if self.runs else math.nan


def on_demand_cost(job: JobSetting, gap_seconds: float) -> float:
    """What a run costs on on-demand from its first tick: C plus the start's changeover, billed in whole ticks as
    the replay bills. The baseline of `mean_savings_vs_od`, so the on-demand policy saves exactly 0 %."""
    ticks = math.ceil((job.job_hours + job.changeover_hours) * 3600.0 / gap_seconds - 1e-9)
    return ticks * gap_seconds / 3600.0 * job.od_price


@dataclass
class SimulationReport:
    job: JobSetting
    policies: dict[str, PolicySummary]
    offline_mean_cost: float
    offline_exact: bool
    availability_bound_mean_cost: float
    od_only_cost: float  # what the on-demand policy costs a run (`on_demand_cost`): the savings baseline
    traces: list[str]
    starts_per_trace: int
    may_move: bool = False  # each run could move between the zones of its instance type

    def as_json(self, default_policy: str) -> dict:
        policies = {}
        for name, s in self.policies.items():
            mean = s.mean_cost
            policies[name] = {
                "mean_cost_usd": round(mean, 4),
                # + 0.0: on-demand's 0 % is not shown as -0.0 % when its float mean is a hair above the baseline
                "mean_savings_vs_od": round(1.0 - mean / self.od_only_cost, 4) + 0.0 if self.od_only_cost else None,
                "spot_hours": round(s.total_spot_h / s.runs, 3),
                "od_hours": round(s.total_od_h / s.runs, 3),
                "spot_work_hours": round(s.total_spot_work_h / s.runs, 3),
                "od_work_hours": round(s.total_od_work_h / s.runs, 3),
                "misses": s.misses,
                "runs": s.runs,
                "ratio_to_offline": round(mean / self.offline_mean_cost, 4) if self.offline_mean_cost else None,
            }
        return {
            "default_policy": default_policy,
            "policies": policies,
            "offline": {"mean_cost_usd": round(self.offline_mean_cost, 4), "exact": self.offline_exact,
                        "availability_bound_usd": round(self.availability_bound_mean_cost, 4)},
            "od_only_cost_usd": round(self.od_only_cost, 4),
            "traces": self.traces,
            "starts_per_trace": self.starts_per_trace,
            "may_move": self.may_move,
        }


# How a replay teaches a history-using policy its zone: re-estimate the model every REFIT_H hours of trace from
# everything before that point, each hazard shrunk towards the pooled hazards of the *other* traces given with
# the weight of PRIOR_TICKS ticks. A run switches to each new estimate as its clock passes the refit (as the
# daemon would), so it never uses data from after the tick being decided. Chosen on setting (a) with seed 5
# (docs/simulate.md): with the regime, 24 h closes 0.5 points more of UP's gap than 48 h, for twice the plans;
# the regime splits a zone's counts in two, and a prior weight of 40-60 ticks did best with it (20 before).
REFIT_H = 24.0
FIRST_REFIT_H = 3.0
PRIOR_TICKS = 50.0
FLICKER_ENDS = 20.0  # the flicker factors' shrinkage towards 1, in ends of spot states (`flicker_factors`)


def pooled_prior(counts: Sequence[ZoneCounts], tick_h: float) -> ZonePrior:
    """Pooled chances of these traces (see `blend_model`); memoryless defaults where none were observed."""
    registered = POLICIES.get(DEFAULT_POLICY)
    fallback = registered if isinstance(registered, SemiMarkovDP) else SemiMarkovDP()
    geometric = np.broadcast_to(fallback.model_for(None, tick_h).hazards(), (SHARE_REGIMES, 2, len(AGE_EDGES_H) + 1))
    stay = np.eye(REGIMES)
    if not counts:
        return ZonePrior(geometric.copy(), stay)
    total = sum(counts[1:], counts[0])
    seen, ended = (x.sum(axis=0) for x in total.by_flicker())
    rows = total.moves.sum(axis=1, keepdims=True)
    return ZonePrior(np.where(seen > 0, ended / np.maximum(seen, 1), geometric),
                     np.where(rows > 0, total.moves / np.maximum(rows, 1), stay))


def refit_stats(trace: Trace, history: TraceHistory, others: Sequence[tuple[Trace, TraceHistory]], tick: int
                ) -> AvailabilityStats:
    """What an operator who had watched this zone and `others` (same clock) until just before `tick` knows."""
    gap_h = trace.gap_seconds / 3600.0
    seen_too = [hazard_counts(o.available, oh, tick) for o, oh in others]
    prior = pooled_prior(seen_too, gap_h)
    counts = hazard_counts(trace.available, history, tick)
    observed = history.stats_at(tick - 1) if tick > 0 else None
    model = blend_model(gap_h, counts, prior, PRIOR_TICKS, flicker_factors([*seen_too, counts], prior, FLICKER_ENDS))
    if history.moving_restarts is not None:
        model = dataclasses.replace(model, restart=restart_rate(history, [oh for _, oh in others], tick))
    return AvailabilityStats(
        up_fraction=observed.up_fraction if observed else math.nan,
        mean_outage_h=observed.mean_outage_h if observed else math.nan,
        mean_uptime_h=observed.mean_uptime_h if observed else math.nan,
        observed_h=observed.observed_h if observed else 0.0,
        model=model)


def restart_rate(history: TraceHistory, others: Sequence[TraceHistory], tick: int) -> float:
    """A moving job's chance per tick on spot of losing its zone while another has spot, from ticks before `tick`,
    shrunk towards the other zone sets' (same clock) with the weight of PRIOR_TICKS ticks."""

    def counts(h: TraceHistory) -> tuple[float, float]:
        """(losses, ticks on spot) known before `tick`: a tick on spot counts once the tick after it was seen."""
        if h.moving_restarts is None or h.moving_spot_ticks is None or tick < 2:
            return 0.0, 0.0
        last = min(tick, h.moving_restarts.shape[0]) - 1
        return float(h.moving_restarts[last]), float(h.moving_spot_ticks[last - 1])

    pooled = [counts(o) for o in others]
    seen = sum(ticks for _, ticks in pooled)
    prior = sum(r for r, _ in pooled) / seen if seen > 0 else 0.0
    restarts, ticks = counts(history)
    return (restarts + PRIOR_TICKS * prior) / (ticks + PRIOR_TICKS)


def refit_ticks(n: int, tick_h: float) -> np.ndarray:
    """Ticks (below n) at which a replay re-estimates the zone: at 0, then each time the history has doubled from
    FIRST_REFIT_H, then every REFIT_H. Early estimates rest on little data, so they are renewed soonest."""
    hours = [0.0]
    h = FIRST_REFIT_H
    while h < REFIT_H:
        hours.append(h)
        h *= 2
    ticks = sorted({round(x / tick_h) for x in hours} | set(range(0, n, max(round(REFIT_H / tick_h), 1))))
    return np.array([t for t in ticks if t < n], dtype=np.int64)


def trace_short_window_chances(traces: Sequence[Trace], short_h: float) -> list[np.ndarray]:
    """Per trace and tick, the chance that spot's up window lasts at most `short_h` from its start, told at that
    start (`core.short_windows`; NaN where unknown). The traces on one clock (same tick and length: the zones of
    a set) are learned from together, every zone's windows that had ended by each day; a trace alone, from its
    own."""
    out: list[np.ndarray] = [np.empty(0)] * len(traces)
    clocks: dict[tuple[float, int], list[int]] = {}
    for i, t in enumerate(traces):
        clocks.setdefault((t.gap_seconds, len(t)), []).append(i)
    for (gap, _), idx in clocks.items():
        histories = [TraceHistory.of(traces[i].available, gap) for i in idx]
        chances = short_window_chances(np.array([traces[i].available for i in idx]),
                                       np.array([h.recent_up_fraction for h in histories]),
                                       np.array([h.recent_changes for h in histories]), gap / 3600.0, short_h)
        for row, i in enumerate(idx):
            out[i] = chances[row]
    return out


def _replay_all(policy_name: str, trace: Trace, starts: np.ndarray, job: JobSetting,
                others: Sequence[Trace] = (), short_window_chance: np.ndarray | None = None) -> BatchOutcome:
    policy = POLICIES[policy_name]
    history = TraceHistory.of_trace(trace)
    if not getattr(policy, "uses_history", False):
        return replay_batch(policy, trace, starts, job, history, short_window_chance=short_window_chance)
    gap_h = trace.gap_seconds / 3600.0
    seen_too = [(o, TraceHistory.of_trace(o)) for o in others]
    span = deadline_ticks(job, trace.gap_seconds)
    schedule = refit_ticks(int(starts.max()) + span + 1, gap_h)
    group = np.searchsorted(schedule, starts, side="right") - 1
    known: dict[int, AvailabilityStats] = {}
    parts = []
    # Runs are replayed in batches by the refit before their start: each batch passes through no more models than
    # the plan cache holds, so each model is planned once per trace, and every tick decides a whole batch at once.
    batches: list[tuple[list[int], int]] = []  # (groups, first model)
    for g in np.unique(group):
        end = int(np.searchsorted(schedule, int(starts[group == g].max()) + span, side="right"))
        if batches and end - batches[-1][1] <= PLANS_CACHED:
            batches[-1][0].append(int(g))
        else:
            batches.append(([int(g)], int(g)))
    for groups, first in batches:
        idx = np.flatnonzero(np.isin(group, groups))
        ticks = schedule[first:np.searchsorted(schedule, int(starts[idx].max()) + span, side="right")]
        for tick in ticks:
            if int(tick) not in known:
                known[int(tick)] = refit_stats(trace, history, seen_too, int(tick))
        refits = [(int(tick), known[int(tick)]) for tick in ticks]
        parts.append((idx, replay_batch(policy, trace, starts[idx], job, history, refits=refits,
                                        short_window_chance=short_window_chance)))
    return BatchOutcome.concat(parts, starts.shape[0])


def _run_task(trace: Trace, starts: np.ndarray, job: JobSetting, others: Sequence[Trace], name: str | None,
              offline_units: int = OFFLINE_UNITS, short_window_chance: np.ndarray | None = None
              ) -> BatchOutcome | tuple[float, bool, float]:
    """One task of `simulate`: a policy's replay of one trace, or (name None) the trace's offline optimum."""
    return (_offline_all(trace, starts, job, offline_units) if name is None
            else _replay_all(name, trace, starts, job, others, short_window_chance))


def _offline_all(trace: Trace, starts: np.ndarray, job: JobSetting, units: int) -> tuple[float, bool, float]:
    costs, exact = offline_optimum(trace, starts, job, max_work_units=units)
    return float(costs.sum()), exact, float(availability_bound(trace, starts, job).sum())


def simulate(traces: Sequence[Trace], policy_names: Sequence[str], job: JobSetting, *, starts: int = 300,
             seed: int = 0, workers: int | None = None, on_step: Callable[[], None] | None = None,
             may_move: bool = False, exact_offline: bool = False) -> SimulationReport:
    """Replay each policy over the same `starts` random start ticks of every trace (paired comparison).

    `may_move`: the traces of one instance type (`instance_of`) are zones on one clock, and the job may move
    between them (it checkpoints and resumes in any of them, as the daemon does in a provider's regions). The same
    start ticks are drawn, and each run is replayed, with its offline optimum, on all the zones of its instance at
    once (`may_move_between`).

    Start ticks are drawn in the calling process from `seed`, so results do not depend on `workers` (processes
    for the per-trace, per-policy batches; 1 = in this process). `on_step()` is called once per finished batch
    (len(traces) * (len(policy_names) + 1) batches, the +1 being the offline optimum).

    `exact_offline`: compute the exact offline optimum up to EXACT_OFFLINE_UNITS work units instead of
    OFFLINE_UNITS (past that, the report says it is a lower bound): ten times the CPU on setting (b).
    """
    job.validate()
    original = list(traces)
    unknown = [p for p in policy_names if p not in POLICIES]
    if unknown:
        raise BadInput(f"unknown policy {unknown[0]!r} (known: {', '.join(sorted(POLICIES))})", field="policy")
    if starts <= 0:
        raise BadInput("must be a positive number of runs per trace", field="starts")
    rng = np.random.default_rng(seed)
    trace_starts = [sample_starts(t, job, starts, rng) for t in traces]
    # Each zone's model is shrunk towards what the other zones given (same tick, same clock) showed until then.
    others = [[o for j, o in enumerate(traces) if j != i and o.gap_seconds == t.gap_seconds]
              for i, t in enumerate(traces)]
    if may_move:  # every start runs over all the zones of its instance type: no other zone left to learn from
        groups = {key: may_move_between([t for t in traces if instance_of(t) == key])
                  for key in dict.fromkeys(instance_of(t) for t in traces)}
        traces = [groups[instance_of(t)] for t in traces]
        others = [[g for g in groups.values() if g is not t and g.gap_seconds == t.gap_seconds] for t in traces]
    # The chance that a spot window is short, for the policies that read it (`SemiMarkovDP.short_window_h`), per
    # trace and tick, learned once here from every zone's past. A moving job's spot is its set's union: its windows
    # are the union's, learned beside the other sets' unions on its clock, as its model is.
    lengths = {h for n in policy_names if (h := getattr(POLICIES[n], "short_window_h", None)) is not None}
    markets = list({id(t): t for t in traces}.values())  # each set's union once: the runs of its zones share it
    chances = {h: dict(zip(map(id, markets), trace_short_window_chances(markets, h), strict=True))
               for h in sorted(lengths)}

    def chance(i: int, name: str | None) -> np.ndarray | None:
        h = getattr(POLICIES[name], "short_window_h", None) if name is not None else None
        return chances[h][id(traces[i])] if h is not None else None
    # One task per trace and policy, and one per trace for the offline optimum (name None). Longest first: a
    # policy that learns from history plans a model per refit, then the offline DP, then the cheap rules; so the
    # processes finish together instead of one waiting on a long task handed out last. The exact offline DP of a
    # fine-grained setting outlasts them all, so it goes first.
    tasks = [(i, name) for i in range(len(traces)) for name in [*policy_names, None]]
    units = EXACT_OFFLINE_UNITS if exact_offline else OFFLINE_UNITS
    offline_rank = -1 if exact_offline else 1
    tasks.sort(key=lambda task: offline_rank if task[1] is None
               else 0 if getattr(POLICIES[task[1]], "uses_history", False) else 2)
    # No more processes than tasks: the rest would only sit idle.
    workers = min(workers if workers is not None else min(os.cpu_count() or 1, 8), len(tasks))

    replays: dict[tuple[int, str], BatchOutcome] = {}
    offline: dict[int, tuple[float, bool, float]] = {}

    def collect(task: tuple[int, str | None], result: BatchOutcome | tuple[float, bool, float]) -> None:
        i, name = task
        if isinstance(result, BatchOutcome) and name is not None:
            replays[(i, name)] = result
        elif isinstance(result, tuple):
            offline[i] = result
        if on_step:
            on_step()

    if workers <= 1:
        for i, name in tasks:
            collect((i, name), _run_task(traces[i], trace_starts[i], job, others[i], name, units, chance(i, name)))
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(_run_task, traces[i], trace_starts[i], job, others[i], name, units,
                                   chance(i, name)): (i, name) for i, name in tasks}
            for fut in as_completed(futures):
                collect(futures[fut], fut.result())
    # Summed in trace order, whatever order the tasks finished in: the figures do not depend on `workers`.
    summaries = {name: PolicySummary(name) for name in policy_names}
    for i in range(len(traces)):
        for name in policy_names:
            summaries[name].add_batch(replays[(i, name)])
    offline_total = sum(offline[i][0] for i in range(len(traces)))
    all_exact = all(offline[i][1] for i in range(len(traces)))
    bound_total = sum(offline[i][2] for i in range(len(traces)))
    n = starts * len(traces)
    return SimulationReport(
        job=job,
        policies=summaries,
        offline_mean_cost=offline_total / n,
        offline_exact=all_exact,
        availability_bound_mean_cost=bound_total / n,
        od_only_cost=float(np.mean([on_demand_cost(job, t.gap_seconds) for t in traces])),
        traces=[str(t.path) for t in original],
        starts_per_trace=starts,
        may_move=may_move,
    )
