"""The spot/on-demand policies: the safety net never lets a deadline slip, and the paper's baselines reproduce."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.core.spot_policy import (
    _EPS_H,
    _MISS_USD,
    AGE_EDGES_H,
    DEFAULT_POLICY,
    FLICKER_EDGES,
    IDLE_CODE,
    MARKETS,
    OD_CODE,
    POLICIES,
    REGIME_EDGES,
    REGIMES,
    SHARE_REGIMES,
    SPOT_CODE,
    AvailabilityStats,
    Market,
    SemiMarkovDP,
    SpotBatch,
    SpotModel,
    SpotState,
    _units_per_step,
    get_policy,
    regime_in,
    regime_of,
    solve_plan,
)
from orchestrator.simulate import JobSetting, Trace, load_traces, replay, sample_starts

TRACES = Path(__file__).resolve().parents[2] / "shared" / "spot-traces"
SETTING_A_DIR = TRACES / "availability" / "1-node" / "aws-10-26-2022"
PAPER_JOB = JobSetting(job_hours=48, deadline_hours=60, changeover_hours=0.2, od_price=3.06, spot_price=0.9731)


def state(**overrides: object) -> SpotState:
    base = dict(job_hours=10.0, deadline_hours=14.0, elapsed_h=0.0, progress_h=0.0, market=Market.IDLE,
                spot_available=True, changeover_left_h=0.0, changeover_h=0.2, tick_h=0.1, od_price=3.0,
                spot_price=1.0)
    base.update(overrides)
    return SpotState(**base)  # type: ignore[arg-type]


def test_registry_names_the_paper_baselines_and_a_default() -> None:
    assert {"on-demand", "greedy", "uniform-progress"} <= set(POLICIES)
    assert DEFAULT_POLICY in POLICIES
    with pytest.raises(KeyError, match="known"):
        get_policy("nope")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_goes_on_demand_once_the_safety_net_engages(name: str) -> None:
    # 3.4 h left for 3 h of work with d = 0.2 h: within work + 2d, so on-demand to the end, even if spot is up.
    s = state(elapsed_h=10.6, progress_h=7.0, market=Market.SPOT, spot_available=True)
    assert POLICIES[name].decide(s) is Market.ON_DEMAND


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_finished_job_stays_idle(name: str) -> None:
    assert POLICIES[name].decide(state(progress_h=10.0, elapsed_h=11.0)) is Market.IDLE


def test_uniform_progress_buys_on_demand_only_when_behind_the_line() -> None:
    up = get_policy("uniform-progress")
    # ep(4 h) = 4 * 10/14 = 2.86 h of progress
    assert up.decide(state(elapsed_h=4.0, progress_h=2.0, spot_available=False)) is Market.ON_DEMAND
    assert up.decide(state(elapsed_h=4.0, progress_h=3.5, spot_available=False)) is Market.IDLE
    assert up.decide(state(elapsed_h=4.0, progress_h=2.0, spot_available=True)) is Market.SPOT


def test_greedy_waits_for_spot_while_slack_remains() -> None:
    assert get_policy("greedy").decide(state(elapsed_h=2.0, spot_available=False)) is Market.IDLE


@settings(max_examples=60, deadline=None)
@given(
    availability=st.lists(st.booleans(), min_size=1, max_size=60).map(lambda xs: xs * 8),
    job_ticks=st.integers(min_value=1, max_value=120),
    slack_ticks=st.integers(min_value=0, max_value=60),
    changeover_ticks=st.sampled_from([0.0, 0.3, 1.0, 1.2, 2.5]),
    name=st.sampled_from(sorted(POLICIES)),
)
def test_no_policy_misses_a_deadline_while_on_demand_exists(
    availability: list[bool], job_ticks: int, slack_ticks: int, changeover_ticks: float, name: str
) -> None:
    tick_h = 0.25
    d = changeover_ticks * tick_h
    # The deadline leaves room for the job plus one changeover plus one tick of rounding: the least any
    # schedule needs when the first decision may be forced onto on-demand.
    job = JobSetting(job_hours=job_ticks * tick_h, deadline_hours=(job_ticks + slack_ticks + 1) * tick_h + d,
                     changeover_hours=d, od_price=3.0, spot_price=1.0)
    ticks = int(np.ceil(job.deadline_hours / tick_h)) + 1
    avail = np.resize(np.array(availability, dtype=bool), ticks)
    trace = Trace(name="random", path=Path("random.json"), gap_seconds=tick_h * 3600, available=avail)
    outcome = replay(POLICIES[name], trace, 0, job)
    assert not outcome.missed
    assert outcome.spot_work_hours + outcome.od_work_hours == pytest.approx(job.job_hours)


@pytest.mark.skipif(not SETTING_A_DIR.is_dir(), reason="shared spot traces not present")
@pytest.mark.parametrize(("name", "paper_od_h", "paper_spot_h"), [("greedy", 30.8, 17.2),
                                                                   ("uniform-progress", 25.1, 22.9)])
def test_baselines_reproduce_the_papers_hours_on_setting_a(name: str, paper_od_h: float, paper_spot_h: float) -> None:
    # Wu et al., "Can't Be Late", NSDI 2024, Table 3. 80 starts per trace here (the paper uses 300; the full
    # figure is in benchmarks/policies.py and docs/simulate.md).
    traces = load_traces([SETTING_A_DIR], window=1781)
    rng = np.random.default_rng(7)
    runs = [replay(POLICIES[name], t, int(s), PAPER_JOB) for t in traces
            for s in sample_starts(t, PAPER_JOB, 80, rng)]
    assert not any(r.missed for r in runs)
    assert abs(np.mean([r.od_work_hours for r in runs]) - paper_od_h) <= 1.0
    assert abs(np.mean([r.spot_work_hours for r in runs]) - paper_spot_h) <= 1.0


# Spot's age: young windows (the short-window override's ages, its edge 0.5 h among them) as often as any age.
AGES = st.one_of(st.sampled_from([0.1, 0.2, 0.3, 0.4, 0.5, 0.5 + 1e-7, 0.6]), st.floats(0.1, 30))
# A run's predicted chance of a short window: unknown (NaN in a batch, None in a state) or a chance, often high.
CHANCES = st.one_of(st.just(math.nan), st.floats(0, 1), st.sampled_from([0.8, 0.8 + 1e-9, 0.95]))


@settings(max_examples=40, deadline=None)
@given(
    runs=st.lists(st.tuples(st.floats(0, 14), st.floats(0, 10), st.sampled_from([0, 1, 2]), st.booleans(),
                            st.sampled_from([0.0, 0.05, 0.1, 0.2]), AGES, CHANCES), min_size=1, max_size=30),
    name=st.sampled_from(sorted(POLICIES)),
    chances_given=st.booleans(),
)
def test_array_path_decides_exactly_as_the_scalar_path(
    runs: list[tuple[float, float, int, bool, float, float, float]], name: str, chances_given: bool
) -> None:
    # The daemon calls decide(state); replays call decide_batch(arrays). They must agree run for run.
    cols = list(zip(*runs, strict=True))
    batch = SpotBatch(job_hours=10.0, deadline_hours=14.0, changeover_h=0.2, tick_h=0.1, od_price=3.0,
                      spot_price=1.0, elapsed_h=np.array(cols[0]), progress_h=np.array(cols[1]),
                      market=np.array(cols[2], dtype=np.int8), spot_available=np.array(cols[3]),
                      changeover_left_h=np.array(cols[4]), spot_state_for_h=np.array(cols[5]),
                      short_window_chance=np.array(cols[6]) if chances_given else None)
    policy = POLICIES[name]
    batched = [MARKETS[c] for c in policy.decide_batch(batch)]
    assert batched == [policy.decide(batch.state(i)) for i in range(len(runs))]


@settings(max_examples=25, deadline=None)
@given(
    runs=st.lists(st.tuples(st.floats(0, 14), st.floats(0, 10), st.sampled_from([0, 1, 2]), st.booleans(),
                            st.sampled_from([0.0, 0.05, 0.1, 0.2]), AGES, st.floats(0, 1),
                            st.sampled_from([0, 1, 2, 3]), st.integers(0, 6), CHANCES), min_size=1, max_size=30),
)
def test_dp_decides_runs_knowing_different_models_as_each_alone(
    runs: list[tuple[float, float, int, bool, float, float, float, int, int, float]]
) -> None:
    # A replay's runs that have passed different refits are decided in one batch (`known`, `which`); each run
    # must get what the daemon's scalar path would decide knowing its own model.
    n = len(AGE_EDGES_H) + 1
    models = [SpotModel(tick_h=0.1, leave=((0.6,) * n, (0.02,) * n)),
              SpotModel(tick_h=0.1, leave=(((0.05,) * n, (0.4,) * n), ((0.3,) * n, (0.01,) * n)),
                        regime_switch=((0.99, 0.01), (0.01, 0.99))),
              SpotModel(tick_h=0.1, leave=((0.001,) * n, (0.02,) * n)),
              # share regimes x calm/flickering, as `simulate` fits them
              SpotModel(tick_h=0.1, leave=(((0.05,) * n, (0.4,) * n), ((0.3,) * n, (0.01,) * n),
                                           ((0.9,) + (0.05,) * (n - 1), (0.4,) * n),
                                           ((0.9,) + (0.3,) * (n - 1), (0.01,) * n)),
                        regime_switch=tuple(tuple(0.97 if i == j else 0.01 for j in range(4)) for i in range(4)))]
    known = tuple(AvailabilityStats(0.5, 1.0, 1.0, 100.0, model=m) for m in models)
    cols = list(zip(*runs, strict=True))
    batch = SpotBatch(job_hours=10.0, deadline_hours=14.0, changeover_h=0.2, tick_h=0.1, od_price=3.0,
                      spot_price=1.0, elapsed_h=np.array(cols[0]), progress_h=np.array(cols[1]),
                      market=np.array(cols[2], dtype=np.int8), spot_available=np.array(cols[3]),
                      changeover_left_h=np.array(cols[4]), spot_state_for_h=np.array(cols[5]),
                      recent_up_fraction=np.array(cols[6]), known=known, which=np.array(cols[7]),
                      recent_changes=np.array(cols[8]), short_window_chance=np.array(cols[9]))
    dp = POLICIES[DEFAULT_POLICY]
    assert [MARKETS[c] for c in dp.decide_batch(batch)] == [dp.decide(batch.state(i)) for i in range(len(runs))]


def test_dp_policy_waits_out_a_brief_outage_but_keeps_on_demand_when_spot_is_not_coming_back() -> None:
    # A zone whose outages mostly end within a tick or two: with slack to spare, a fresh outage is waited out.
    dp = POLICIES[DEFAULT_POLICY]
    brief = SpotModel(tick_h=0.1, leave=((0.6,) * 12, (0.02,) * 12))
    stats = AvailabilityStats(0.9, 0.2, 5.0, 100.0, model=brief)
    assert dp.decide(state(elapsed_h=1.0, progress_h=0.8, spot_available=False, stats=stats,
                           spot_state_for_h=0.1)) is Market.IDLE
    # Spot almost never comes back: already on on-demand, going idle would only buy a second changeover later.
    dead = SpotModel(tick_h=0.1, leave=((0.001,) * 12, (0.02,) * 12))
    stats = AvailabilityStats(0.1, 50.0, 1.0, 100.0, model=dead)
    assert dp.decide(state(elapsed_h=3.0, progress_h=2.0, market=Market.ON_DEMAND, spot_available=False,
                           stats=stats, spot_state_for_h=3.0)) is Market.ON_DEMAND


def test_dp_policy_reads_the_regime_from_the_recent_share_of_spot_up_time() -> None:
    # The same up/down hazards at every age, but two regimes that persist: when spot has mostly been down lately
    # (regime 0) it comes back only for a few ticks, less than a changeover is worth; when it has mostly been up
    # (regime 1) it stays for hours. On on-demand with spot just back, only the second is worth switching for.
    n = len(AGE_EDGES_H) + 1
    scarce, plentiful = ((0.05,) * n, (0.4,) * n), ((0.3,) * n, (0.01,) * n)
    model = SpotModel(tick_h=0.1, leave=(scarce, plentiful), regime_switch=((0.999, 0.001), (0.001, 0.999)))
    stats = AvailabilityStats(0.5, 1.0, 1.0, 100.0, model=model)
    dp = POLICIES[DEFAULT_POLICY]
    back = dict(elapsed_h=3.0, progress_h=2.5, market=Market.ON_DEMAND, spot_available=True, stats=stats,
                spot_state_for_h=0.1)
    edge = REGIME_EDGES[0]
    assert dp.decide(state(**back, recent_up_fraction=edge + 0.1)) is Market.SPOT
    assert dp.decide(state(**back, recent_up_fraction=edge - 0.1)) is Market.ON_DEMAND


def test_dp_policy_goes_back_to_spot_when_it_was_calm_but_not_for_a_flicker() -> None:
    # On on-demand, spot just back. Calm regimes: a fresh up period lasts (0.01 a tick to end). Flickering ones
    # (spot went or came back FLICKER_EDGES[0] times lately): it is gone again after a tick or two, less than a
    # changeover is worth. Same slack, same age: only the recent changes tell them apart.
    n = len(AGE_EDGES_H) + 1
    calm = ((0.3,) * n, (0.01,) * n)
    flicker = ((0.3,) * n, (0.9,) + (0.01,) * (n - 1))
    model = SpotModel(tick_h=0.1, leave=(calm, calm, flicker, flicker),
                      regime_switch=tuple(tuple(0.97 if i == j else 0.01 for j in range(4)) for i in range(4)))
    stats = AvailabilityStats(0.5, 1.0, 1.0, 100.0, model=model)
    dp = POLICIES[DEFAULT_POLICY]
    back = dict(elapsed_h=3.0, progress_h=2.5, market=Market.ON_DEMAND, spot_available=True, stats=stats,
                spot_state_for_h=0.1)
    assert dp.decide(state(**back, recent_changes=FLICKER_EDGES[0] - 1)) is Market.SPOT
    assert dp.decide(state(**back, recent_changes=FLICKER_EDGES[0])) is not Market.SPOT
    # A model without the flicker split (one or two regimes) reads the share alone.
    assert regime_in(2, 0.9, FLICKER_EDGES[0]) == regime_in(2, 0.9, 0) == regime_of(0.9) == 1
    assert regime_in(REGIMES, 0.9, FLICKER_EDGES[0]) == 1 + SHARE_REGIMES
    assert regime_in(1, 0.1, FLICKER_EDGES[0]) == 0


def _both_paths(policy: SemiMarkovDP, s: SpotState) -> Market:
    """`policy`'s choice for `s`, checked to be the same on the batch path (the chance NaN there for None)."""
    chance = math.nan if s.short_window_chance is None else s.short_window_chance
    batch = SpotBatch(job_hours=s.job_hours, deadline_hours=s.deadline_hours, changeover_h=s.changeover_h,
                      tick_h=s.tick_h, od_price=s.od_price, spot_price=s.spot_price, elapsed_h=np.array([s.elapsed_h]),
                      progress_h=np.array([s.progress_h]), market=np.array([MARKETS.index(s.market)], dtype=np.int8),
                      spot_available=np.array([s.spot_available]), changeover_left_h=np.array([s.changeover_left_h]),
                      spot_state_for_h=np.array([s.spot_state_for_h]), stats=s.stats,
                      recent_up_fraction=np.array([s.recent_up_fraction]), recent_changes=np.array([s.recent_changes]),
                      short_window_chance=np.array([chance]))
    choice = policy.decide(s)
    assert MARKETS[int(policy.decide_batch(batch)[0])] is choice
    return choice


def test_dp_stays_on_on_demand_for_a_young_spot_window_predicted_short_and_only_then() -> None:
    # On on-demand, spot back, the plan goes back to spot (a calm, plentiful zone). Told that the window is likely
    # short (chance over `short_window_over`) while it is at most `short_window_h` old, the run stays on on-demand.
    n = len(AGE_EDGES_H) + 1
    model = SpotModel(tick_h=0.1, leave=(((0.05,) * n, (0.4,) * n), ((0.3,) * n, (0.01,) * n)),
                      regime_switch=((0.999, 0.001), (0.001, 0.999)))
    stats = AvailabilityStats(0.5, 1.0, 1.0, 100.0, model=model)
    dp = SemiMarkovDP()
    assert (dp.short_window_over, dp.short_window_h) == (0.8, 0.5)
    back = state(elapsed_h=3.0, progress_h=2.5, market=Market.ON_DEMAND, spot_available=True, stats=stats,
                 spot_state_for_h=0.1, recent_up_fraction=0.9)

    def choice(policy: SemiMarkovDP = dp, **change: object) -> Market:
        return _both_paths(policy, dataclasses.replace(back, **change))  # type: ignore[arg-type]

    assert choice() is Market.SPOT, "the plan's own choice, no chance given"
    assert choice(short_window_chance=0.81) is Market.ON_DEMAND
    assert choice(short_window_chance=0.8) is Market.SPOT, "over the threshold, not at it"
    assert choice(short_window_chance=math.nan) is Market.SPOT, "unknown"
    # Its age: up to short_window_h, the current tick counted (3 ticks of 10 minutes is 0.5 h), and no older.
    for age, stays in ((0.1, True), (0.3, True), (0.5, True), (0.5 + 1e-7, True), (0.5001, False), (0.6, False),
                       (5.0, False)):
        assert choice(spot_state_for_h=age) is Market.SPOT
        assert choice(spot_state_for_h=age, short_window_chance=0.95) is (Market.ON_DEMAND if stays
                                                                          else Market.SPOT), age
    # The two fields move the rule.
    assert choice(SemiMarkovDP(short_window_over=0.9), short_window_chance=0.85) is Market.SPOT
    assert choice(SemiMarkovDP(short_window_h=1.0), spot_state_for_h=0.8, short_window_chance=0.85) \
        is Market.ON_DEMAND
    # Only from on-demand: idle (after a preemption or before the start) or already on spot, the plan's spot stands.
    assert choice(market=Market.IDLE, short_window_chance=0.99) is Market.SPOT
    assert choice(market=Market.SPOT, short_window_chance=0.99) is Market.SPOT
    # Only where the plan chose spot: it never sends a run to spot or idle. In a scarce spell the plan keeps
    # on-demand; with spot down it chooses as it would; a chance changes neither.
    for change in ({"recent_up_fraction": 0.1}, {"spot_available": False}, {"spot_available": False,
                                                                            "market": Market.IDLE}):
        plain = choice(**change)
        assert all(choice(**change, short_window_chance=c) is plain for c in (0.0, 0.5, 0.99))
    assert choice(recent_up_fraction=0.1) is Market.ON_DEMAND
    # The safety net and a finished job are as they were, whatever the chance.
    net = dict(elapsed_h=10.6, progress_h=7.0)
    assert choice(**net, short_window_chance=0.99) is choice(**net) is Market.ON_DEMAND
    done = dict(elapsed_h=11.0, progress_h=10.0)
    assert choice(**done, short_window_chance=0.99) is choice(**done) is Market.IDLE


def test_dp_plan_charges_the_changeover_exactly_when_the_tick_allows_it_and_nearly_when_not() -> None:
    # Setting (a): 10-minute ticks, d = 12 min. The plan's unit of work must make d a whole number of units
    # (2-minute units), not round it up to the next 200 s (which overprices every switch by 80 s).
    dp = POLICIES[DEFAULT_POLICY]
    plan = dp.plan_for(48.0, 60.0, 0.2, 1 / 6, 3.06, 0.9731, None)
    assert plan.changeover_units * plan.step_h / plan.units_per_step == pytest.approx(0.2)
    # Setting (b): 195-s ticks, which no unit within the slack axis divides 720 s by. Units of 48.75 s price a switch
    # 11 s too high, where the tick's 195 s priced it 60 s too high (and read the work left to 195 s).
    plan = dp.plan_for(48.0, 60.0, 0.2, 195 / 3600, 3.06, 0.9731, None)
    unit_s = plan.step_h * 3600 / plan.units_per_step
    assert unit_s == pytest.approx(48.75)
    assert 0 <= plan.changeover_units * unit_s - 720 < 12


def reference_actions(model: SpotModel, job_hours: float, deadline_hours: float, changeover_h: float, step_h: float,
                      od_price: float, spot_price: float, max_slack_units: int) -> np.ndarray:
    """The plan's table computed the straightforward way (every market and phase, a shifted copy per step, the
    layout (k, s, market, up/down, bucket, regime)): the specification `solve_plan` must match entry for entry."""
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
    spot_step, od_step = np.float32(spot_price * step_h), np.float32(od_price * step_h)

    # Transition of the availability state over one step, converted from the model's tick to the DP's step.
    # Arrays are (up/down, age bucket, regime); the regime moves by its own chain, independently within a step.
    ticks_per_step = max(round(step_h / model.tick_h), 1)
    leave = 1.0 - (1.0 - np.clip(model.hazards(), 0.0, 1.0)) ** (step_h / model.tick_h)
    leave = np.moveaxis(leave, 0, -1)
    restart = 1.0 - (1.0 - model.restart) ** (step_h / model.tick_h)
    n_regimes = model.regimes
    switch_t = np.linalg.matrix_power(np.asarray(model.regime_switch, dtype=float), ticks_per_step
                                      ).T.astype(np.float32)
    widths_h = np.diff(np.concatenate(([0.0], AGE_EDGES_H)))
    advance = np.zeros((2, n_buckets, 1))
    advance[:, :-1, 0] = np.minimum(step_h / widths_h, 1.0)  # uniform ages within a bucket
    # float32: the values are dollars with cents to spare, and half the memory traffic makes planning faster.
    stay_same = ((1 - leave) * (1 - advance)).astype(np.float32)
    stay_next = ((1 - leave) * advance).astype(np.float32)
    leave = leave.astype(np.float32)

    s_idx = np.arange(s_max + 1)
    # Changeover units an on-demand finish still pays, per market index: all of d unless already on on-demand.
    chg_left = np.full(n_markets, d_units)
    chg_left[1 + phases:] = np.maximum(d_units - m * np.arange(phases), 0)

    spot_phase_of = np.zeros(n_markets, dtype=np.int64)  # per market index: the spot phase a spot step runs in
    spot_phase_of[1:1 + phases] = np.arange(phases)
    od_phase_of = np.zeros(n_markets, dtype=np.int64)
    od_phase_of[1 + phases:] = np.arange(phases)
    not_spot = np.r_[0, 1 + phases:n_markets]
    actions = np.empty((k_max + 1, s_max + 1, n_markets, 2, n_buckets, n_regimes), dtype=np.int8)
    actions[0] = IDLE_CODE
    value = np.zeros((s_max + 1, n_markets, 2, n_buckets, n_regimes), dtype=np.float32)  # k = 0: done if s >= 0
    inf = np.inf

    def shift(v: np.ndarray, by: int) -> np.ndarray:
        """v at slack s - by (a step that spends `by` units of slack); below zero is a miss."""
        if by == 0:
            return v
        out = np.empty_like(v)
        out[:by] = _MISS_USD
        out[by:] = v[:-by]
        return out

    for k in range(1, k_max + 1):
        # Expected value after the step, given the availability state before it: first over the next regime
        # (one 2-D product; numpy's stacked matmul of tiny matrices is 5x slower)...
        after = value if n_regimes == 1 else (value.reshape(-1, n_regimes) @ switch_t).reshape(value.shape)
        # ...then over spot staying (ageing within or into the next bucket) or changing state.
        nxt_bucket = np.concatenate((after[..., 1:, :], after[..., -1:, :]), axis=-2)
        # Only idle and on-demand steps read `ev` (a spot step reads `ev_spot_up`): 0 idle, 1 + p on-demand.
        kept, kept_next = after[:, not_spot], nxt_bucket[:, not_spot]
        ev = stay_same * kept + stay_next * kept_next + leave * kept[:, :, ::-1, :1]
        # On spot, spot going away means preemption: the next step starts idle.
        ev_spot_up = (stay_same[1] * after[:, 1:1 + phases, 1] + stay_next[1] * nxt_bucket[:, 1:1 + phases, 1]
                      + leave[1] * after[:, :1, 0, :1])
        if restart > 0:  # a job that may move: its zone went while spot stayed up elsewhere; it starts idle, up
            ev_spot_up = ev_spot_up * np.float32(1.0 - restart) + np.float32(restart) * ev[:, :1, 1]
        q_idle = shift(ev[:, 0], m)[:, None]  # broadcasts over the current market
        q_spot = np.full((s_max + 1, phases, 2, n_buckets, n_regimes), inf, dtype=np.float32)
        q_od = np.empty((s_max + 1, phases, 2, n_buckets, n_regimes), dtype=np.float32)
        for p in range(phases):
            q_spot[:, p, 1] = spot_step + shift(ev_spot_up[:, nxt[p]], int(loss[p]))
            q_od[:, p] = od_step + shift(ev[:, 1 + nxt[p]], int(loss[p]))
        # Per current market: staying continues its phase, switching starts at phase 0.
        sp = q_spot[:, spot_phase_of]
        od = q_od[:, od_phase_of]
        best_other = np.minimum(q_idle, od)
        new_value = np.minimum(sp, best_other)
        new_actions = np.where(sp <= best_other, SPOT_CODE, np.where(q_idle <= od, IDLE_CODE, OD_CODE)
                               ).astype(np.int8)  # ties go to spot, then idle
        # Done (work left <= 0): nothing more to pay. Safety net: on-demand to the end, whatever the plan says.
        work = k * m - s_idx
        done = work <= 0
        time_left = k * step_h
        work_h = np.maximum(work, 0) * unit
        net = ~done & ((time_left <= np.ceil((work_h + 2 * changeover_h) / step_h - _EPS_H) * step_h + _EPS_H)
                       | (time_left - step_h < work_h + changeover_h + _EPS_H))
        forced = od_step * np.ceil((np.maximum(work, 0)[:, None] + chg_left[None, :]) / m)  # (s, market)
        new_value[net] = forced[net][:, :, None, None, None]
        new_actions[net] = OD_CODE
        new_value[done] = 0.0
        new_actions[done] = IDLE_CODE
        value = new_value
        actions[k] = new_actions
    return actions


def random_model(rng: np.random.Generator, tick_h: float, regimes: int, restart: float = 0.0) -> SpotModel:
    n = len(AGE_EDGES_H) + 1
    leave = rng.uniform(0.0, 0.6, size=(regimes, 2, n)) ** 2  # mostly small hazards, as in real zones
    stay = rng.uniform(0.9, 1.0, size=regimes)
    switch = np.full((regimes, regimes), 0.0) + ((1 - stay) / max(regimes - 1, 1))[:, None]
    np.fill_diagonal(switch, stay if regimes > 1 else 1.0)
    return SpotModel(tick_h=tick_h, leave=tuple(tuple(map(tuple, r)) for r in leave),
                     regime_switch=tuple(map(tuple, switch)), restart=restart)


@pytest.mark.parametrize(("job_h", "deadline_h", "changeover_h", "tick_h", "regimes", "restart"), [
    (48.0, 60.0, 0.2, 1 / 6, 2, 0.0),  # setting (a): 10-minute ticks, 3 phases, 2-minute units
    (48.0, 60.0, 0.2, 1 / 6, 1, 0.0),  # the daemon's memoryless single-regime model
    (10.0, 14.0, 0.0, 0.1, 2, 0.0),  # no changeover: one phase
    (10.0, 14.0, 0.35, 0.1, 2, 0.0),  # a changeover of several ticks: 5 phases
    (4.0, 6.0, 0.25, 0.1, 3, 0.0),  # three regimes
    (48.0, 60.0, 0.2, 1 / 6, 2, 0.03),  # a job that may move between zones: its own zone may go
])
def test_fast_plan_is_the_straightforward_backward_induction_entry_for_entry(
    job_h: float, deadline_h: float, changeover_h: float, tick_h: float, regimes: int, restart: float
) -> None:
    # solve_plan computes only the values a step reads, in another layout; every action must be the same.
    rng = np.random.default_rng(int(job_h * 10 + changeover_h * 100 + regimes))
    model = random_model(rng, tick_h, regimes, restart)
    args = (model, job_h, deadline_h, changeover_h, tick_h, 3.06, 0.9731, 400)
    plan = solve_plan(*args)
    expected = reference_actions(*args)
    assert plan.actions.shape[0] == expected.shape[0]
    assert np.array_equal(plan.actions.transpose(0, 5, 1, 2, 4, 3), expected)
    # and the plan is not trivial: every action occurs
    assert {IDLE_CODE, SPOT_CODE, OD_CODE} <= set(np.unique(plan.actions).tolist())


def test_a_plan_keeps_its_rows_as_runs_and_reads_any_entry_as_the_whole_table_has_it() -> None:
    # A replay keeps several plans per process and a daemon one per bursting job: setting (b)'s table has a billion
    # entries. Its rows are kept as runs of equal actions; reading entries of one step, of several, or of the same
    # step again after another, gives what the unpacked table holds.
    model = random_model(np.random.default_rng(7), 1 / 6, 2)
    plan = solve_plan(model, 48.0, 60.0, 0.2, 1 / 6, 3.06, 0.9731, 400)
    table = plan.actions.ravel()
    assert plan.nbytes < math.prod(plan.shape) / 4, "less than the table packed four entries a byte"
    rng = np.random.default_rng(1)
    row = math.prod(plan.shape[1:])
    one_step = 200 * row + rng.integers(0, row, size=50)
    several = rng.integers(0, table.size, size=500)
    for flat in (one_step, several, one_step, several[:1], np.array(5 * row + 3)):
        assert np.array_equal(plan.read(flat), table[flat])


def test_a_plan_for_a_shell_that_never_leaves_on_demand_waits_for_spot_instead_of_buying_it_for_a_while() -> None:
    # The daemon cannot see spot come back while it runs on on-demand, so it never leaves on-demand. A plan made as
    # if it could buys on-demand at an outage "for a while"; made for the daemon, it weighs the outage against
    # on-demand to the end and waits for spot while the slack allows.
    idle_in_outage = SpotState(job_hours=48, deadline_hours=60, elapsed_h=10.0, progress_h=9.8, market=Market.IDLE,
                               spot_available=False, changeover_left_h=0.0, changeover_h=0.2, tick_h=1 / 6,
                               od_price=3.06, spot_price=0.9731)
    assert SemiMarkovDP().decide(idle_in_outage) is Market.ON_DEMAND
    assert SemiMarkovDP(od_is_final=True).decide(idle_in_outage) is Market.IDLE
    on_od_spot_back = dataclasses.replace(idle_in_outage, market=Market.ON_DEMAND, spot_available=True,
                                          spot_state_for_h=1.0)
    assert SemiMarkovDP().decide(on_od_spot_back) is Market.SPOT
    assert SemiMarkovDP(od_is_final=True).decide(on_od_spot_back) is Market.ON_DEMAND
    near_deadline = dataclasses.replace(idle_in_outage, elapsed_h=11.7, progress_h=0.0)
    assert SemiMarkovDP(od_is_final=True).decide(near_deadline) is Market.ON_DEMAND, "the safety net still holds"


def test_a_changeover_spans_a_few_plan_steps_whatever_the_decision_tick() -> None:
    # The daemon asks every minute: a 0.5 h changeover planned minute by minute was 31 phases of the table, 240 MB and
    # 1.5 CPU-seconds a plan with four regimes. Its plan steps are now at least a quarter of the changeover. The
    # paper's settings, whose ticks are longer than that already, are planned on their own tick as before.
    policy = SemiMarkovDP()
    daemon = policy.plan_for(5.0, 12.0, 0.5, 1 / 60, 3.0, 1.0, None)
    assert daemon.step_h == pytest.approx(0.5 / 4 + 1 / 120, abs=1 / 120) and daemon.phases <= 5
    assert daemon.nbytes * 4 < math.prod(daemon.shape)  # four actions a byte at most, compressed
    uncapped = SemiMarkovDP(max_changeover_steps=10**6)
    for tick_h in (1 / 6, 195 / 3600):  # settings (a) and (b)
        job = (48.0, 60.0, 0.2, tick_h, 3.06, 0.9731, None)
        assert policy.plan_for(*job).step_h == uncapped.plan_for(*job).step_h
