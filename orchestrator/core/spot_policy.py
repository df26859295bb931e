"""Spot/on-demand policy for a bursted job: every tick, run it on spot, on on-demand, or wait idle.

Pure: a frozen `SpotState` in, a `Market` out, no I/O and no hidden state, so the daemon (live, every tick) and
`burstctl simulate` (replaying real traces) call exactly the same code. Anything a policy remembers must arrive in
the state: the current market, how long spot has been up/down, and optional `AvailabilityStats` learned from
history the caller has already observed (never from the future of the run being decided).

Terms follow Wu et al., "Can't Be Late: Optimizing Spot Instance Savings under Deadlines" (NSDI 2024): a job of C
hours must finish within R hours; each switch into spot or on-demand costs a changeover delay d with no progress.
Every policy sits under the same safety net: once the time left is no more than the work left + 2d (rounded up
to whole ticks) the job runs on on-demand to the end, so no deadline is missed while on-demand capacity exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Protocol

import numpy as np

from orchestrator.core.market import EPS_H as _EPS_H
from orchestrator.core.market import safety_net


class Market(StrEnum):
    IDLE = "idle"
    SPOT = "spot"
    ON_DEMAND = "on-demand"


# Integer codes of the markets in the array (batch) interface; `MARKETS[code]` is the Market. `solve_plan` computes
# actions in arithmetic on these values.
IDLE_CODE, SPOT_CODE, OD_CODE = 0, 1, 2
MARKETS: tuple[Market, Market, Market] = (Market.IDLE, Market.SPOT, Market.ON_DEMAND)
MARKET_CODE: dict[Market, int] = {m: i for i, m in enumerate(MARKETS)}

# Upper edges (hours) of the age buckets of the semi-Markov availability model; the last bucket is open-ended.
# Log-spaced: the chance an outage ends soon falls steeply with its age over the first hours, then flattens.
AGE_EDGES_H: tuple[float, ...] = (1 / 3, 2 / 3, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 24.0)


_AGE_EDGES = np.asarray(AGE_EDGES_H)


def age_bucket(age_h: np.ndarray | float) -> np.ndarray:
    """Bucket of a spot state that has lasted `age_h` hours (counting the current tick)."""
    return np.searchsorted(_AGE_EDGES, np.asarray(age_h) - 1e-9, side="left")


# Regimes: a zone goes through spells of days when spot is mostly there and spells when it mostly is not, and
# the age of the current up or down period does not tell them apart. The regime is the share of the last
# REGIME_WINDOW_H hours spot was up: below REGIME_EDGES[0] is regime 0 (scarce), else regime 1 (plentiful).
# 12 h / 40 % as found by the previous session; 12 h / 50 % and 18 h / 40 % measured the same (docs/simulate.md).
REGIME_WINDOW_H = 12.0
REGIME_EDGES: tuple[float, ...] = (0.4,)
SHARE_REGIMES = len(REGIME_EDGES) + 1
# Flicker: spot that went or came back FLICKER_EDGES[0] times or more in the last FLICKER_WINDOW_H hours. There a
# new outage or up period is more often over within its first age bucket (pooled over setting (a): an outage
# ends in its first 20 min with a chance of 0.44 a tick against 0.31), which tells a gap worth waiting out from an
# outage worth buying on-demand for. Each share regime is split in two by it; the split changes only the youngest
# bucket's hazards, by a factor learned from every zone's past (`SpotModel.leave`), so it divides no counts.
FLICKER_WINDOW_H = 2.0
FLICKER_EDGES: tuple[int, ...] = (3,)  # changes from which spot counts as flickering (one level per edge)
FLICKER_LEVELS = len(FLICKER_EDGES) + 1
# Regime r: share regime r % SHARE_REGIMES, flicker level r // SHARE_REGIMES (0: calm).
REGIMES = SHARE_REGIMES * FLICKER_LEVELS


def regime_of(recent_up_fraction: np.ndarray | float, recent_changes: np.ndarray | int = 0) -> np.ndarray:
    """Regime index for this share of the last REGIME_WINDOW_H hours with spot up and this many up/down changes in
    the last FLICKER_WINDOW_H hours."""
    share = np.searchsorted(np.asarray(REGIME_EDGES), np.asarray(recent_up_fraction) + 1e-9, side="right")
    return share + SHARE_REGIMES * np.searchsorted(np.asarray(FLICKER_EDGES), np.asarray(recent_changes),
                                                   side="right")


def regime_in(n_regimes: int, recent_up_fraction: np.ndarray | float, recent_changes: np.ndarray | int = 0
              ) -> np.ndarray:
    """The regime as a model with `n_regimes` regimes knows it: all REGIMES, the share regimes only, or one."""
    return regime_of(recent_up_fraction, recent_changes) % n_regimes


@dataclass(frozen=True)
class SpotModel:
    """Semi-Markov model of one zone's spot availability, per tick of `tick_h` hours.

    `leave[a][b]` is the chance that spot, having been up (a=1) or down (a=0) for an age in bucket b
    (`AGE_EDGES_H`), changes state after the next tick; with regimes, `leave[r][a][b]` per regime r (`regime_in`:
    1, SHARE_REGIMES or REGIMES of them) and `regime_switch[r][r2]` the chance of being in regime r2 a tick after
    regime r. Hashable, so plans built from it can be cached.
    """

    tick_h: float
    leave: tuple[tuple[float, ...], ...] | tuple[tuple[tuple[float, ...], ...], ...]
    regime_switch: tuple[tuple[float, ...], ...] = ((1.0,),)
    # For a job that may move between zones (spot = any zone has it): the chance, per tick on spot, that the run's
    # own zone loses spot while another still has it. The run is preempted and must pay a changeover to go on.
    restart: float = 0.0

    @property
    def regimes(self) -> int:
        return len(self.regime_switch)

    def hazards(self) -> np.ndarray:
        """`leave` as an array (regime, up/down, age bucket)."""
        return np.asarray(self.leave, dtype=float).reshape(self.regimes, 2, len(AGE_EDGES_H) + 1)

    @classmethod
    def geometric(cls, tick_h: float, mean_uptime_h: float, mean_outage_h: float) -> SpotModel:
        """Memoryless model from mean up-time and outage length (what is left when no history is at hand)."""
        down = min(tick_h / max(mean_outage_h, tick_h), 1.0)
        up = min(tick_h / max(mean_uptime_h, tick_h), 1.0)
        n = len(AGE_EDGES_H) + 1
        return cls(tick_h=tick_h, leave=((down,) * n, (up,) * n))


@dataclass(frozen=True, slots=True)
class AvailabilityStats:
    """Spot availability learned from history the caller has seen (for a replay: ticks before now only).

    `up_fraction` is the share of observed time spot was usable; `mean_outage_h` / `mean_uptime_h` are the mean
    lengths of completed outages / up periods. `observed_h` says how much history backs the figures.
    """

    up_fraction: float
    mean_outage_h: float
    mean_uptime_h: float
    observed_h: float
    model: SpotModel | None = None  # per-age hazards of spot going away / coming back, when the caller has them


@dataclass(frozen=True, slots=True)
class SpotState:
    """Everything a policy may look at when deciding the next tick. Times and work are in hours."""

    job_hours: float  # C: compute the job needs in total
    deadline_hours: float  # R: wall-clock budget from the job's start
    elapsed_h: float  # wall clock since the start
    progress_h: float  # compute done so far
    market: Market  # what the job is on right now (IDLE after a preemption)
    spot_available: bool  # whether spot can be acquired (or kept) for the next tick
    changeover_left_h: float  # changeover delay still to sit through on the current instance
    changeover_h: float  # d: the delay paid on every switch into spot or on-demand
    tick_h: float  # decision granularity: the policy is asked again after this long
    od_price: float  # $/h on-demand
    spot_price: float  # $/h spot
    spot_state_for_h: float = 0.0  # how long spot has been in its current state (up or down), as observed
    stats: AvailabilityStats | None = None
    recent_up_fraction: float = 1.0  # share of the last REGIME_WINDOW_H spot was up, as observed
    recent_changes: int = 0  # times spot went or came back in the last FLICKER_WINDOW_H, as observed
    # The chance that the up window spot is in lasts at most `SemiMarkovDP.short_window_h` from its start, as
    # predicted at that start from the past only (`core.short_windows`); None: unknown (the daemon's case).
    short_window_chance: float | None = None

    @property
    def work_left_h(self) -> float:
        return max(self.job_hours - self.progress_h, 0.0)

    @property
    def time_left_h(self) -> float:
        return self.deadline_hours - self.elapsed_h

    @property
    def slack_h(self) -> float:
        """Wall-clock time that can still be spent not progressing (idle, changeovers) without missing R."""
        return self.time_left_h - self.work_left_h


@dataclass(frozen=True)
class SpotBatch:
    """Many runs of one job setting at once, for replays: per-run arrays, shared scalars, shared stats.

    The arrays mirror the per-run fields of `SpotState`; `market` holds `MARKET_CODE`s.
    """

    job_hours: float
    deadline_hours: float
    changeover_h: float
    tick_h: float
    od_price: float
    spot_price: float
    elapsed_h: np.ndarray
    progress_h: np.ndarray
    market: np.ndarray
    spot_available: np.ndarray
    changeover_left_h: np.ndarray
    spot_state_for_h: np.ndarray
    stats: AvailabilityStats | None = None
    recent_up_fraction: np.ndarray | None = None  # None: 1.0 for every run
    recent_changes: np.ndarray | None = None  # None: 0 for every run
    short_window_chance: np.ndarray | None = None  # None, or NaN for a run: unknown
    # Runs that know different things (a replay's runs that have passed different refits): run i knows
    # `known[which[i]]`, and `stats` is unused.
    known: tuple[AvailabilityStats | None, ...] = ()
    which: np.ndarray | None = None

    def stats_of(self, i: int) -> AvailabilityStats | None:
        """What run i knows."""
        return self.stats if self.which is None else self.known[int(self.which[i])]

    def state(self, i: int) -> SpotState:
        """Run i as the `SpotState` the scalar path sees."""
        return SpotState(
            job_hours=self.job_hours, deadline_hours=self.deadline_hours, elapsed_h=float(self.elapsed_h[i]),
            progress_h=float(self.progress_h[i]), market=MARKETS[int(self.market[i])],
            spot_available=bool(self.spot_available[i]), changeover_left_h=float(self.changeover_left_h[i]),
            changeover_h=self.changeover_h, tick_h=self.tick_h, od_price=self.od_price, spot_price=self.spot_price,
            spot_state_for_h=float(self.spot_state_for_h[i]), stats=self.stats_of(i),
            recent_up_fraction=1.0 if self.recent_up_fraction is None else float(self.recent_up_fraction[i]),
            recent_changes=0 if self.recent_changes is None else int(self.recent_changes[i]),
            short_window_chance=None if self.short_window_chance is None or math.isnan(self.short_window_chance[i])
            else float(self.short_window_chance[i]))


class Policy(Protocol):
    @property
    def name(self) -> str: ...  # read-only: the policies are frozen dataclasses

    def decide(self, state: SpotState) -> Market: ...

    def decide_batch(self, batch: SpotBatch) -> np.ndarray: ...


def safety_net_engaged(s: SpotState) -> bool:
    """True once the job must run on on-demand to the end to be sure of finishing by R (`market.safety_net`)."""
    return safety_net(s.job_hours - s.progress_h, s.deadline_hours - s.elapsed_h, s.changeover_h, s.tick_h)


def safety_net_engaged_batch(b: SpotBatch) -> np.ndarray:
    """`safety_net_engaged` for every run of a batch (same arithmetic, elementwise)."""
    work_left = b.job_hours - b.progress_h
    left = b.deadline_hours - b.elapsed_h
    tick = b.tick_h
    first = left <= np.ceil((work_left + 2 * b.changeover_h) / tick - _EPS_H) * tick + _EPS_H
    second = left - tick < work_left + b.changeover_h + _EPS_H
    return (work_left > 0) & (first | second)


def _spot_or_idle(s: SpotState) -> Market:
    return Market.SPOT if s.spot_available else Market.IDLE


@dataclass(frozen=True)
class OnDemandOnly:
    """Never touches spot: the price of certainty."""

    name: str = "on-demand"

    def decide(self, state: SpotState) -> Market:
        return Market.IDLE if state.work_left_h <= 0 else Market.ON_DEMAND

    def decide_batch(self, batch: SpotBatch) -> np.ndarray:
        return np.where(batch.job_hours - batch.progress_h <= 0, IDLE_CODE, OD_CODE).astype(np.int8)


@dataclass(frozen=True)
class Greedy:
    """Spot whenever available, otherwise wait; on-demand only when the safety net forces it (the paper's baseline)."""

    name: str = "greedy"

    def decide(self, state: SpotState) -> Market:
        if state.work_left_h <= 0:
            return Market.IDLE
        if safety_net_engaged(state):
            return Market.ON_DEMAND
        return _spot_or_idle(state)

    def decide_batch(self, batch: SpotBatch) -> np.ndarray:
        out = np.where(batch.spot_available, SPOT_CODE, IDLE_CODE).astype(np.int8)
        out[safety_net_engaged_batch(batch)] = OD_CODE
        out[batch.job_hours - batch.progress_h <= 0] = IDLE_CODE
        return out


@dataclass(frozen=True)
class UniformProgress:
    """The paper's Uniform Progress: keep progress at or above the straight line ep(t) = t*C/R.

    Spot whenever it is available and progress is not behind ep(t); when idle and behind, go on-demand; once
    on on-demand stay (rather than go idle) until progress reaches ep(t + 2d), so a changeover is not paid to
    gain nothing. This reading reproduces the paper's Table 3 hours on its setting (see docs/simulate.md);
    the variant that also holds on-demand against available spot until ep(t + 2d) lands 1.7 h off.
    """

    name: str = "uniform-progress"

    def decide(self, state: SpotState) -> Market:
        if state.progress_h >= state.job_hours:
            return Market.IDLE
        if safety_net_engaged(state):
            return Market.ON_DEMAND
        rate = state.job_hours / state.deadline_hours
        behind = state.progress_h < rate * state.elapsed_h - _EPS_H
        if state.spot_available and not (behind and state.market is Market.ON_DEMAND):
            return Market.SPOT
        if state.market is Market.ON_DEMAND and (
            state.progress_h < rate * (state.elapsed_h + 2 * state.changeover_h) - _EPS_H
        ):
            return Market.ON_DEMAND
        if state.spot_available:
            return Market.SPOT
        return Market.ON_DEMAND if behind else Market.IDLE

    def decide_batch(self, batch: SpotBatch) -> np.ndarray:
        rate = batch.job_hours / batch.deadline_hours
        up = batch.spot_available
        on_od = batch.market == OD_CODE
        behind = batch.progress_h < rate * batch.elapsed_h - _EPS_H
        hold_od = on_od & (batch.progress_h < rate * (batch.elapsed_h + 2 * batch.changeover_h) - _EPS_H)
        out = np.where(behind, OD_CODE, IDLE_CODE).astype(np.int8)
        out[up] = SPOT_CODE
        out[hold_od] = OD_CODE
        out[up & ~(behind & on_od)] = SPOT_CODE
        out[safety_net_engaged_batch(batch)] = OD_CODE
        out[batch.progress_h >= batch.job_hours] = IDLE_CODE
        return out


@dataclass(frozen=True)
class DPPlan:
    """The optimal action of the stochastic DP for every (ticks left, slack, market+phase, spot up/down, age).

    Time runs in DP steps of `step_h` (the decision tick); work and slack in units of step_h / `units_per_step`.
    `actions[k, j, a, r, b, s]` is a `MARKET_CODE`: k steps left, j the market index (0 idle, 1..phases spot,
    phases+1..2*phases on-demand, by ticks since the switch), a spot up now, r regime, b age bucket, s units of
    slack. Kept as `rows`, one a step, each as its runs: actions come in long stretches along the slack, so a row
    of setting (b) (942,000 entries at its finest) holds about 8,000 runs. Each run is one uint32, where it starts
    in the row shifted left 2 bits, its action (a code takes 2 bits) in the low 2: setting (b)'s plan keeps ~40 MB
    for 1.0 G entries (261 MB packed four a byte, as they were), in each of the plans a replay or a daemon keeps
    (`PLANS_CACHED`). An entry is read by bisecting its row, so any entry can be read without unpacking anything
    (rows compressed with zlib, 9.7 MB, had to be unpacked whole to read one: `simulate` on (b) took 1.4× the CPU).
    """

    step_h: float
    units_per_step: int
    changeover_units: int
    phases: int
    shape: tuple[int, ...]
    rows: tuple[np.ndarray, ...] = field(repr=False)  # per step: its runs, (start << 2) | code, ascending

    @property
    def nbytes(self) -> int:
        """The bytes the plan keeps (its rows' runs)."""
        return sum(row.nbytes for row in self.rows)

    @property
    def actions(self) -> np.ndarray:
        """The whole table, unpacked (int8, `shape`)."""
        n = math.prod(self.shape[1:])
        return np.stack([np.repeat((row & 3).astype(np.int8), np.diff(row >> 2, append=n)) for row in self.rows]
                        ).reshape(self.shape)

    def read(self, flat: np.ndarray) -> np.ndarray:
        """The actions at these places of the table flattened (`index`), as int8 market codes."""
        k, i = np.divmod(np.asarray(flat), math.prod(self.shape[1:]))
        if k.size and k.min() == k.max():  # the usual case: a replay's runs share their steps left
            row = self.rows[int(k.flat[0])]
            return (row[np.searchsorted(row, (i << 2) | 3, side="right") - 1] & 3).astype(np.int8)
        codes = np.empty(k.shape, dtype=np.int8)
        for step in np.unique(k):
            at = k == step
            row = self.rows[int(step)]
            codes[at] = row[np.searchsorted(row, (i[at] << 2) | 3, side="right") - 1] & 3
        return codes

    def index(self, elapsed_h: np.ndarray | float, progress_h: np.ndarray | float, market: np.ndarray | int,
              spot_available: np.ndarray | bool, changeover_left_h: np.ndarray | float, age_h: np.ndarray | float,
              deadline_hours: float, job_hours: float,
              recent_up_fraction: np.ndarray | float = 1.0, recent_changes: np.ndarray | int = 0) -> np.ndarray:
        """Where runs in these states (arrays or scalars broadcast together) are in the table flattened (`read`):
        the same in every plan of the same job and shape, whatever its model."""
        m, unit = self.units_per_step, self.step_h / self.units_per_step
        k_max, s_max = self.shape[0] - 1, self.shape[-1] - 1
        # Round against the job: whole steps left rounded down, work left rounded up.
        # (np.minimum/np.maximum rather than np.clip: the same, with a fraction of the overhead on small arrays)
        k = np.floor((deadline_hours - elapsed_h) / self.step_h + 1e-6).astype(np.int64)
        k = np.minimum(np.maximum(k, 0), k_max)
        w = np.ceil(np.maximum(job_hours - progress_h, 0.0) / unit - 1e-6).astype(np.int64)
        s = np.minimum(np.maximum(k * m - w, 0), s_max)
        # Phase: steps since the switch into the current market, from the changeover still to sit through.
        left_units = np.ceil(np.asarray(changeover_left_h) / unit - 1e-6).astype(np.int64)
        phase = np.minimum(np.maximum(-((left_units - self.changeover_units) // m), 0), self.phases - 1)
        market = np.asarray(market)
        j = np.where(market == SPOT_CODE, 1 + phase, np.where(market == OD_CODE, 1 + self.phases + phase, 0))
        r = regime_in(self.shape[3], recent_up_fraction, recent_changes)
        return np.ravel_multi_index((k, j, np.asarray(spot_available).astype(np.int64), r, age_bucket(age_h), s),
                                    self.shape)

    def lookup(self, elapsed_h: np.ndarray | float, progress_h: np.ndarray | float, market: np.ndarray | int,
               spot_available: np.ndarray | bool, changeover_left_h: np.ndarray | float, age_h: np.ndarray | float,
               deadline_hours: float, job_hours: float,
               recent_up_fraction: np.ndarray | float = 1.0, recent_changes: np.ndarray | int = 0) -> np.ndarray:
        """The planned action for runs in these states (arrays or scalars broadcast together)."""
        return self.read(self.index(elapsed_h, progress_h, market, spot_available, changeover_left_h, age_h,
                                    deadline_hours, job_hours, recent_up_fraction, recent_changes))


def _units_per_step(step_h: float, changeover_h: float, slack_h: float, max_slack_units: int) -> int:
    """Work units per DP step: the one that rounds the changeover d up the least, within `max_slack_units`.

    d rounded up to whole units is what the plan thinks a switch costs; an error of a few minutes per switch
    is a real bias (on setting (a), 800 s instead of 720 s cost 2 points of the gap closed). Ties go to the
    coarser (faster) table.
    """
    best, best_err = 1, math.inf
    for m in range(1, max_slack_units + 1):
        unit = step_h / m
        if slack_h / unit > max_slack_units:
            break
        err = math.ceil(changeover_h / unit - 1e-6) * unit - changeover_h
        if err < best_err - 1e-9:
            best, best_err = m, err
    return best


def _as_index(mask: np.ndarray) -> slice | np.ndarray | None:
    """Where `mask` holds, as a slice when that is one range (indexing by a slice is a view, by a mask a copy)."""
    where = np.flatnonzero(mask)
    if where.size == 0:
        return None
    if where[-1] - where[0] + 1 == where.size:
        return slice(int(where[0]), int(where[-1]) + 1)
    return mask


_MISS_USD = 1e6  # value of a state that cannot finish by R: far above any real cost, so the DP avoids it


def solve_plan(model: SpotModel, job_hours: float, deadline_hours: float, changeover_h: float, step_h: float,
               od_price: float, spot_price: float, max_slack_units: int = 240, od_is_final: bool = False) -> DPPlan:
    """Backward induction over the semi-Markov availability model: the least expected cost to finish by R.

    `od_is_final`: once on on-demand the job stays there to the end (the daemon's case: it does not know spot is
    back without launching, so it never leaves on-demand). Choosing on-demand then costs finishing on it, and the
    plan weighs waiting for spot against that, not against a later return to spot.

    Each step: bill the price of what runs, progress one step minus any changeover left, preempt spot if the
    model turns it off. The shared safety net is part of the model (once engaged, on-demand to the end), so the
    plan never counts on what the net forbids. The slack (time left - work left, which never grows) replaces
    the work left as the state, so the table is small: the job's R - C at most.

    Only what the next step reads is carried: the values of idle and of the phases a step ends in (a step never
    ends in phase 0; idle, spot and on-demand at phase 0 face the same choice), spot's only where spot is up.
    Arrays are (up/down, regime, age bucket, slack): the halves for spot up and down, bucket moves and slack
    shifts are contiguous slices, and the regime mixing is a matrix product. The float32 operations and their
    order are those of the straightforward version in tests/test_spot_policy.py, which checks that the tables
    are the same, entry for entry.
    """
    slack_h = deadline_hours - job_hours
    m = _units_per_step(step_h, changeover_h, slack_h, max_slack_units)
    unit = step_h / m
    k_max = math.floor(deadline_hours / step_h + 1e-6)
    s_max = max(math.ceil(slack_h / unit - 1e-6) + m, m)
    d_units = math.ceil(changeover_h / unit - 1e-6)
    phases = (-(-d_units // m) + 1) if d_units > 0 else 1
    progress = np.clip(m * (np.arange(phases) + 1) - d_units, 0, m)  # units of work done in a step at each phase
    loss = m - progress  # slack spent in that step
    nxt = np.minimum(np.arange(phases) + 1, phases - 1)
    n_buckets = len(AGE_EDGES_H) + 1
    n_markets = 1 + 2 * phases
    n_slack = s_max + 1
    spot_step, od_step = np.float32(spot_price * step_h), np.float32(od_price * step_h)

    # Transition of the availability state over one step, converted from the model's tick to the DP's step.
    # Arrays are (up/down, regime, age bucket); the regime moves by its own chain, independently within a step.
    ticks_per_step = max(round(step_h / model.tick_h), 1)
    leave = 1.0 - (1.0 - np.clip(model.hazards().swapaxes(0, 1), 0.0, 1.0)) ** (step_h / model.tick_h)
    restart = 1.0 - (1.0 - min(max(model.restart, 0.0), 1.0)) ** (step_h / model.tick_h)
    n_regimes = model.regimes
    switch = np.linalg.matrix_power(np.asarray(model.regime_switch, dtype=float), ticks_per_step
                                    ).astype(np.float32)
    widths_h = np.diff(np.concatenate(([0.0], AGE_EDGES_H)))
    advance = np.zeros((1, 1, n_buckets))
    advance[:, :, :-1] = np.minimum(step_h / widths_h, 1.0)  # uniform ages within a bucket
    shape = (2, n_regimes, n_buckets, n_slack)

    def spread(a: np.ndarray) -> np.ndarray:
        """float32 (values are dollars with cents to spare; half the memory traffic), spread over the slack axis
        once, so that every product below runs over whole arrays."""
        return np.ascontiguousarray(np.broadcast_to(a.astype(np.float32)[..., None], shape))

    stay_same = spread((1 - leave) * (1 - advance))
    stay_next = spread((1 - leave) * advance)
    leave = spread(leave)

    # The values a step reads: idle's, and those of the phases a step ends in (on-demand's, and spot's when up).
    reads = sorted(set(nxt.tolist()))
    read_at = {p: i for i, p in enumerate(reads)}
    n_full = 1 + len(reads)  # idle, then on-demand at each phase read
    value = np.zeros((n_full, *shape), dtype=np.float32)  # k = 0: done if s >= 0
    value_spot = np.zeros((len(reads), n_regimes, n_buckets, n_slack), dtype=np.float32)
    after, after_spot = np.empty_like(value), np.empty_like(value_spot)
    ev, ev_spot = np.empty_like(value), np.empty_like(value_spot)  # expected values after a step
    q_idle = np.empty(shape, dtype=np.float32)
    tmp, tmp_spot = np.empty_like(value), np.empty_like(value_spot)
    q_od = np.empty((phases, *shape), dtype=np.float32)
    q_spot = np.empty((phases, *shape[1:]), dtype=np.float32)  # spot up only: down, it is no option
    best = np.empty((phases, *shape), dtype=np.float32)  # min(idle, on-demand at phase p)
    worse = np.empty((phases, *shape), dtype=bool)  # idle dearer than on-demand at phase p
    spot_wins, od_wins = np.empty(shape[1:], dtype=bool), np.empty(shape[1:], dtype=bool)

    s_idx = np.arange(n_slack)
    # Changeover units an on-demand finish still pays, per market index: all of d unless already on on-demand.
    chg_left = np.full(n_markets, d_units)
    chg_left[1 + phases:] = np.maximum(d_units - m * np.arange(phases), 0)
    # Each step's actions are chosen into `act`, then kept as their step's row of runs (`DPPlan`).
    act = np.empty((n_markets, *shape), dtype=np.int8)
    flat_act = act.reshape(-1)
    run_dtype = np.uint32 if act.size < 2**30 else np.uint64
    rows: list[np.ndarray] = []

    def keep_row() -> None:
        starts = np.flatnonzero(flat_act[1:] != flat_act[:-1]) + 1
        starts = np.concatenate(([0], starts)).astype(run_dtype)
        rows.append((starts << 2) | flat_act[starts].astype(run_dtype))

    act[...] = IDLE_CODE
    keep_row()

    def shifted(out: np.ndarray, price: np.float32, after_step: np.ndarray, by: int) -> None:
        """out = price + after_step at slack s - by (a step that spends `by` units of slack); below 0, a miss."""
        if by == 0:
            np.add(price, after_step, out=out)
            return
        np.add(price, after_step[..., :n_slack - by], out=out[..., by:])
        out[..., :by] = price + np.float32(_MISS_USD)

    def choose(out: np.ndarray, idle_worse: np.ndarray, spot: np.ndarray, best_other: np.ndarray) -> None:
        """Spot (when up) if no dearer than min(idle, on-demand), else idle unless on-demand is cheaper
        (`idle_worse`): ties go to spot, then idle. In int8 arithmetic on the codes: idle 0, spot 1, OD 2."""
        np.less_equal(spot, best_other[1], out=spot_wins)
        np.less(spot_wins, idle_worse[1], out=od_wins)  # on-demand only where spot does not win
        flags = od_wins.view(np.int8)
        np.add(flags, flags, out=out[1])
        out[1] |= spot_wins.view(np.int8)
        flags = idle_worse[0].view(np.int8)  # spot down
        np.add(flags, flags, out=out[0])

    # Where the safety net engages and where the job is done, per steps left: a range of slack each (the net
    # below some slack, done from k*m up), as the same float64 arithmetic the daemon's net uses.
    steps = np.arange(k_max + 1)[:, None]
    work_all = steps * m - s_idx
    done_all = work_all <= 0
    time_left_all = steps * step_h
    work_h_all = np.maximum(work_all, 0) * unit
    net_all = ~done_all & (
        (time_left_all <= np.ceil((work_h_all + 2 * changeover_h) / step_h - _EPS_H) * step_h + _EPS_H)
        | (time_left_all - step_h < work_h_all + changeover_h + _EPS_H))

    if od_is_final:
        # (steps left, on-demand phase, slack): the cost of finishing on on-demand from there, or a miss
        units = np.maximum(work_all, 0)[:, None, :] + np.maximum(d_units - m * np.arange(phases), 0)[None, :, None]
        steps_needed = np.ceil(units / m)
        od_to_the_end = np.where(steps_needed <= steps[:, :, None], od_step * steps_needed,
                                 np.float32(_MISS_USD)).astype(np.float32)
    for k in range(1, k_max + 1):
        # Expected value after the step, given the availability state before it: first over the next regime...
        if n_regimes == 1:
            after, after_spot = value, value_spot
        else:
            np.matmul(switch, value.reshape(2 * n_full, n_regimes, -1), out=after.reshape(2 * n_full, n_regimes, -1))
            np.matmul(switch, value_spot.reshape(len(reads), n_regimes, -1),
                      out=after_spot.reshape(len(reads), n_regimes, -1))
        # ...then over spot staying (ageing within or into the next bucket) or changing state (age 0 of the other).
        np.multiply(stay_same, after, out=ev)
        np.multiply(stay_next[:, :, :-1], after[..., 1:, :], out=tmp[..., :-1, :])
        np.multiply(stay_next[:, :, -1:], after[..., -1:, :], out=tmp[..., -1:, :])
        ev += tmp
        np.multiply(leave, after[:, ::-1, :, :1], out=tmp)
        ev += tmp
        # On spot, spot going away means preemption: the next step starts idle.
        np.multiply(stay_same[1], after_spot, out=ev_spot)
        np.multiply(stay_next[1, :, :-1], after_spot[..., 1:, :], out=tmp_spot[..., :-1, :])
        np.multiply(stay_next[1, :, -1:], after_spot[..., -1:, :], out=tmp_spot[..., -1:, :])
        ev_spot += tmp_spot
        np.multiply(leave[1], after[0, 0, :, :1], out=tmp_spot)
        ev_spot += tmp_spot
        if restart > 0:  # the run's zone went while spot stayed up elsewhere: idle, with spot up
            ev_spot *= np.float32(1.0 - restart)
            np.multiply(np.float32(restart), ev[0, 1], out=tmp_spot[0])
            ev_spot += tmp_spot[0]
        # The cost of each choice: the step's price plus the value at the slack left after it.
        shifted(q_idle, np.float32(0.0), ev[0], m)  # an idle step costs nothing and spends m units of slack
        for p in range(phases):
            i = read_at[int(nxt[p])]
            if od_is_final:
                q_od[p] = od_to_the_end[k, p]
            else:
                shifted(q_od[p], od_step, ev[1 + i], int(loss[p]))
            shifted(q_spot[p], spot_step, ev_spot[i], int(loss[p]))
            np.minimum(q_idle, q_od[p], out=best[p])
        # Values of the markets read next: staying continues its phase, switching starts at phase 0.
        value[0, 0] = best[0, 0]
        np.minimum(q_spot[0], best[0, 1], out=value[0, 1])
        for p, i in read_at.items():
            value[1 + i, 0] = best[p, 0]
            np.minimum(q_spot[0], best[p, 1], out=value[1 + i, 1])
            np.minimum(q_spot[p], best[0, 1], out=value_spot[i])
        # Actions for every market and phase (idle, spot and on-demand at phase 0 face the same choice).
        np.greater(q_idle, q_od[0], out=worse[0])
        choose(act[0], worse[0], q_spot[0], best[0])
        act[1] = act[0]
        act[1 + phases] = act[0]
        for p in range(1, phases):
            choose(act[1 + p], worse[0], q_spot[p], best[0])
            np.greater(q_idle, q_od[p], out=worse[p])
            choose(act[1 + phases + p], worse[p], q_spot[0], best[p])
        # Done (work left <= 0): nothing more to pay. Safety net: on-demand to the end, whatever the plan says.
        net = _as_index(net_all[k])
        if net is not None:
            # (slack, market): what finishing on on-demand costs from each
            forced = od_step * np.ceil((np.maximum(work_all[k, net], 0)[:, None] + chg_left[None, :]) / m)
            forced = forced.astype(np.float32)
            value[0][..., net] = forced[:, 0]
            for p, i in read_at.items():
                value[1 + i][..., net] = forced[:, 1 + phases + p]
                value_spot[i][..., net] = forced[:, 1 + p]
            act[..., net] = OD_CODE
        if od_is_final:
            act[1 + phases:] = OD_CODE
        done = _as_index(done_all[k])
        if done is not None:
            value[..., done] = 0.0
            value_spot[..., done] = 0.0
            act[..., done] = IDLE_CODE
        keep_row()
    return DPPlan(step_h=step_h, units_per_step=m, changeover_units=d_units, phases=phases,
                  shape=(k_max + 1, *act.shape), rows=tuple(rows))


# Plans kept per process (kept as runs, a setting (b) plan keeps 40 MB; a daemon's 2-32 MB with four regimes, by the
# job's hours).
# Replays group their runs so that no group passes through more models than this, so each model is planned once.
PLANS_CACHED = 6


@lru_cache(maxsize=PLANS_CACHED)
def cached_plan(model: SpotModel, job_hours: float, deadline_hours: float, changeover_h: float, step_h: float,
                od_price: float, spot_price: float, max_slack_units: int, od_is_final: bool = False) -> DPPlan:
    """`solve_plan`, remembered: the daemon asks every tick with the same job and model."""
    return solve_plan(model, job_hours, deadline_hours, changeover_h, step_h, od_price, spot_price, max_slack_units,
                      od_is_final)


@dataclass(frozen=True)
class SemiMarkovDP:
    """The project's default: act as the optimal plan of a stochastic DP over a semi-Markov model of the zone.

    The model (`AvailabilityStats.model`: per-age, per-regime chances that spot goes away or comes back, and
    of the regime changing) is estimated by the caller from history it has already seen. Given it, backward
    induction over (steps left, slack, market and changeover phase, spot up/down, age of that state, regime)
    finds the least expected cost of finishing by R; the policy plays the plan's action for the current state,
    the regime read from `recent_up_fraction` and `recent_changes`. It waits out outages that are likely to end
    soon, buys on-demand early in outages that are likely to be long, and only pays a changeover when the expected
    saving covers it. Without a model it uses a memoryless one from `prior_uptime_h` / `prior_outage_h`.
    Beside the plan, the short-window rule (`short_window_h`): a young spot window predicted short is not worth
    leaving on-demand for. Under it all, the shared safety net (also modelled inside the DP).
    """

    name: str = "semi-markov-dp"
    prior_uptime_h: float = 1.5
    prior_outage_h: float = 1.0
    # Longer horizons are planned on a coarser step (a multiple of the tick). The policy is asked every tick, and a
    # plan read between its steps rounds the steps left down and so the slack against the job: on setting (b)
    # (60 h of 195-s ticks, 1,108 of them) a 3-tick step cost 2 points of UP's gap (docs/simulate.md).
    max_steps: int = 1200
    # Bound on the slack axis: finer is closer to exact, slower to plan. On setting (b) (195-s ticks, 12 h of slack)
    # 900 allows work units of 48.75 s, the changeover rounded up by 11 s instead of 60 s (400: 195-s units).
    max_slack_units: int = 900
    # A changeover spans at most this many steps: the table holds a row per step of one (its phases). At the
    # daemon's 1-minute tick a 0.5 h changeover was 31 phases, and one plan 240 MB and 1.5 CPU-seconds; the
    # paper's settings (a 10-minute tick and 0.2 h, 195 s and 720 s) are within it and planned as before.
    max_changeover_steps: int = 4
    uses_history: bool = True
    # Plan for a shell that never leaves on-demand (the daemon's): see `solve_plan`.
    od_is_final: bool = False
    # Short spot windows: on on-demand with spot up for at most `short_window_h` hours (counting this tick), where
    # the plan goes back to spot, stay on on-demand if the window's predicted chance of lasting at most
    # `short_window_h` from its start (`SpotState.short_window_chance`; unknown: no effect) is over
    # `short_window_over`. A changeover for a window gone within minutes buys another to come back. Setting (a),
    # 300 starts: 50.5 % of UP's gap closed against 48.4 % without (seed 0; 1.5-2.1 points on seeds 1, 2, 5);
    # setting (b): no change, no window there is predicted short that surely (docs/simulate.md).
    short_window_h: float = 0.5
    short_window_over: float = 0.8

    def model_for(self, stats: AvailabilityStats | None, tick_h: float) -> SpotModel:
        if stats is not None and stats.model is not None:
            return stats.model
        return SpotModel.geometric(tick_h, self.prior_uptime_h, self.prior_outage_h)

    def plan_for(self, job_hours: float, deadline_hours: float, changeover_h: float, tick_h: float,
                 od_price: float, spot_price: float, stats: AvailabilityStats | None) -> DPPlan:
        # Planned for the deadline rounded up on a grid of a sixteenth of it, at most (a power of 2 hours: 0.5 h
        # for deadlines of 8 to 16 h; 60 h stays 60 h): a plan's entries are per steps and slack left, which do not
        # depend on the deadline, so the larger table holds the same answers (`lookup` takes the true figures). The
        # daemon's clock for a job starts with its first attempt, so the deadline of a job waiting for spot moves
        # at every check: one plan serves the checks of half an hour, rather than one plan a check.
        grid = 2.0 ** (math.floor(math.log2(deadline_hours)) - 4)
        deadline_hours = math.ceil(deadline_hours / grid - 1e-9) * grid
        step_h = tick_h * max(1, math.ceil(deadline_hours / tick_h / self.max_steps),
                              math.ceil(changeover_h / tick_h / self.max_changeover_steps - 1e-9))
        return cached_plan(self.model_for(stats, tick_h), job_hours, deadline_hours, changeover_h, step_h,
                           od_price, spot_price, self.max_slack_units, self.od_is_final)

    def decide(self, state: SpotState) -> Market:
        if state.progress_h >= state.job_hours:
            return Market.IDLE
        if safety_net_engaged(state):
            return Market.ON_DEMAND
        plan = self.plan_for(state.job_hours, state.deadline_hours, state.changeover_h, state.tick_h,
                             state.od_price, state.spot_price, state.stats)
        code = int(plan.lookup(state.elapsed_h, state.progress_h, MARKET_CODE[state.market], state.spot_available,
                               state.changeover_left_h, state.spot_state_for_h, state.deadline_hours,
                               state.job_hours, state.recent_up_fraction, state.recent_changes))
        if code == SPOT_CODE and not state.spot_available:
            return Market.IDLE  # the plan's rounding can not make spot appear
        if (code == SPOT_CODE and state.market is Market.ON_DEMAND and state.short_window_chance is not None
                and state.short_window_chance > self.short_window_over
                and state.spot_state_for_h <= self.short_window_h + _EPS_H):
            return Market.ON_DEMAND  # a window likely gone within minutes: not worth two changeovers
        return MARKETS[code]

    def decide_batch(self, batch: SpotBatch) -> np.ndarray:
        job = (batch.job_hours, batch.deadline_hours, batch.changeover_h, batch.tick_h, batch.od_price,
               batch.spot_price)
        state = (batch.elapsed_h, batch.progress_h, batch.market, batch.spot_available, batch.changeover_left_h,
                 batch.spot_state_for_h, batch.deadline_hours, batch.job_hours,
                 1.0 if batch.recent_up_fraction is None else batch.recent_up_fraction,
                 0 if batch.recent_changes is None else batch.recent_changes)
        if batch.which is None:
            out = self.plan_for(*job, batch.stats).lookup(*state).astype(np.int8)
        else:
            # Runs knowing different models: a run's place in the table is the same in every plan of one shape,
            # so it is found once and each plan only reads its own runs' entries.
            out = np.empty(batch.elapsed_h.shape[0], dtype=np.int8)
            places: dict[tuple[int, ...], np.ndarray] = {}
            for g in np.flatnonzero(np.bincount(batch.which, minlength=len(batch.known))):
                plan = self.plan_for(*job, batch.known[g])
                if plan.shape not in places:
                    places[plan.shape] = plan.index(*state)
                sel = batch.which == g
                out[sel] = plan.read(places[plan.shape][sel])
        out[(out == SPOT_CODE) & ~batch.spot_available] = IDLE_CODE
        if batch.short_window_chance is not None:  # as `decide`; NaN > x is False: unknown, no effect
            out[(out == SPOT_CODE) & (batch.market == OD_CODE) & (batch.short_window_chance > self.short_window_over)
                & (batch.spot_state_for_h <= self.short_window_h + _EPS_H)] = OD_CODE
        out[safety_net_engaged_batch(batch)] = OD_CODE
        out[batch.progress_h >= batch.job_hours] = IDLE_CODE
        return out


DEFAULT_POLICY = "semi-markov-dp"

POLICIES: dict[str, Policy] = {p.name: p for p in (OnDemandOnly(), Greedy(), UniformProgress(), SemiMarkovDP())}


def get_policy(name: str) -> Policy:
    """The registered policy called `name`; KeyError lists the known names."""
    try:
        return POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
