"""Spot vs on-demand, the monthly budget's cadence, and hybrid local-then-burst plans."""

from __future__ import annotations

import math

import pytest

from orchestrator.core.budget import BudgetView, Held, Launch, Spending, admits, cycle_prices, month_key
from orchestrator.core.market import MarketInputs, choose_market
from orchestrator.core.plan import hybrid_plan, latest_switch_at, latest_switch_h, projected_finish_at
from orchestrator.core.spot_policy import Market, SpotState, safety_net_engaged

RUN = dict(run_h=6.38, gpus=1, od_usd_per_gpu_h=3.0, spot_usd_per_gpu_h=1.0, preemptions_per_h=0.05,
           checkpoint_interval_h=0.5, restart_overhead_h=0.5, deadline_h=48.0)


def test_spot_with_checkpoints_is_chosen_and_both_figures_are_reported() -> None:
    m = choose_market(MarketInputs(**RUN))
    assert m.market == "spot"
    n = 0.05 * 6.38
    assert m.expected_preemptions == pytest.approx(n)
    assert m.spot_hours == pytest.approx(6.38 + n * (0.25 + 0.5))
    assert m.spot_cost_usd == pytest.approx(1.0 * m.spot_hours)
    assert m.od_cost_usd == pytest.approx(3.0 * 6.38)


def test_a_deadline_critical_run_goes_on_demand_even_though_spot_is_cheaper() -> None:
    m = choose_market(MarketInputs(**{**RUN, "deadline_critical": True}))
    assert m.market == "on-demand"
    assert m.spot_cost_usd is not None and m.spot_cost_usd < m.od_cost_usd


def test_spot_loses_when_preemptions_eat_the_discount() -> None:
    m = choose_market(MarketInputs(**{**RUN, "preemptions_per_h": 2.0, "checkpoint_interval_h": 4.0}))
    assert m.market == "on-demand"
    assert m.spot_cost_usd is not None and m.spot_cost_usd >= m.od_cost_usd


def test_spot_loses_when_its_expected_time_misses_the_deadline() -> None:
    m = choose_market(MarketInputs(**{**RUN, "deadline_h": 6.5, "preemptions_per_h": 0.5}))
    assert m.market == "on-demand"


def test_a_job_that_does_not_resume_pays_each_preemption_with_everything_done_so_far() -> None:
    # Expected hours to finish T uninterrupted hours with restarts at rate λ, r each: (1/λ + r)(e^{λT} − 1).
    m = choose_market(MarketInputs(**{**RUN, "resumable": False}))
    assert m.spot_hours == pytest.approx((1 / 0.05 + 0.5) * (math.exp(0.05 * 6.38) - 1))
    assert m.spot_hours > choose_market(MarketInputs(**RUN)).spot_hours
    assert m.market == "spot" and "does not resume" in m.reasons[0]  # still cheaper at λ = 0.05
    long_run = choose_market(MarketInputs(**{**RUN, "run_h": 40.0, "deadline_h": 500.0, "resumable": False}))
    assert long_run.market == "on-demand"  # e^{2} − 1 ≈ 6.4: restarting 40 h runs costs more than on-demand
    assert choose_market(MarketInputs(**{**RUN, "run_h": 40.0, "deadline_h": 500.0})).market == "spot"


def test_spot_is_not_chosen_where_the_daemons_safety_net_would_start_it_on_demand() -> None:
    # 2 min of work, 0.5 h overhead, due in 1 h: spot would be cheap, but a preemption could not be made up, and the
    # daemon's spot policy launches it on on-demand. The decision prices what will run, and says why.
    short = {**RUN, "run_h": 0.53, "deadline_h": 1.0, "restart_overhead_h": 0.5, "policy_tick_h": 60 / 3600}
    m = choose_market(MarketInputs(**short))
    assert m.market == "on-demand" and m.cost_usd == pytest.approx(3.0 * 0.53)
    assert m.reasons[0].startswith("spot leaves no room for a preemption: 1.00 h to the deadline")
    assert choose_market(MarketInputs(**{**short, "preference": "spot"})).market == "on-demand"
    assert choose_market(MarketInputs(**{**short, "deadline_h": 2.0})).market == "spot"


@pytest.mark.parametrize("tick_s", [30.0, 60.0, 900.0])
def test_the_market_decided_is_the_one_the_daemons_policy_launches_on_either_side_of_its_safety_net(
        tick_s: float) -> None:
    tick_h = tick_s / 3600
    for deadline_h in [x / 100 for x in range(100, 400, 3)]:
        inputs = MarketInputs(**{**RUN, "run_h": 1.2, "deadline_h": deadline_h, "restart_overhead_h": 0.5,
                                 "policy_tick_h": tick_h})
        m = choose_market(inputs)
        assert m.spot_hours is not None
        # The state `market_switch._ask_policy` builds for the launch: the spot plan's hours less one overhead.
        at_launch = SpotState(job_hours=m.spot_hours - 0.5, deadline_hours=deadline_h, elapsed_h=0.0, progress_h=0.0,
                              market=Market.IDLE, spot_available=True, changeover_left_h=0.0, changeover_h=0.5,
                              tick_h=tick_h, od_price=3.0, spot_price=1.0)
        assert (m.market == "on-demand") == safety_net_engaged(at_launch), deadline_h


def test_no_spot_market_means_on_demand() -> None:
    assert choose_market(MarketInputs(**{**RUN, "spot_usd_per_gpu_h": None})).market == "on-demand"


def test_the_seed_budget_picture_15_dollars_buys_10_spot_cycles_or_3_on_demand() -> None:
    spot, od = cycle_prices(1.5, 3.0, 1.0)
    assert (spot, od) == (pytest.approx(1.5), pytest.approx(4.5))
    view = BudgetView("2026-11", 15.0, 0.0, 0, spot, od)
    assert view.cycles_left_spot == 10
    assert view.cycles_left_on_demand == 3


def test_the_cap_is_hard() -> None:
    assert admits(Launch(4.99, 1.0), 15.0, Spending(10.0))[0]
    ok, why = admits(Launch(5.01, 1.0), 15.0, Spending(10.0))
    assert not ok and "exceeds" in why


def test_a_launch_waits_while_last_month_s_open_charges_reach_its_cap_and_not_for_less() -> None:
    # An instance launched last month counts against last month; while that month is at its cap it is being stopped.
    assert admits(Launch(4.99, 1.0), 15.0, Spending(10.0, earlier=(("2026-11", 14.0),)))[0]
    assert not admits(Launch(5.01, 1.0), 15.0, Spending(10.0, earlier=(("2026-11", 14.0),)))[0]
    ok, why = admits(Launch(1.0, 1.0), 15.0, Spending(0.0, earlier=(("2026-11", 15.5),)))
    assert not ok and why == "$15.50 committed in 2026-11 reaches the $15.00 cap"


def test_a_launch_counts_its_billing_minimum_and_its_stop_and_the_cap_what_others_have_and_keep() -> None:
    # One hour's work billed two hours at least, and 135 s to stop: $2.0375 at $1/h.
    launch = Launch(1.0, 1.0, minimum_s=7200.0, horizon_h=135 / 3600)
    assert launch.usd == pytest.approx(2.0375)
    assert admits(launch, 15.0, Spending(12.9625))[0]
    # What stopping the running instances takes and what admitted plans hold are not there to spend.
    ok, why = admits(launch, 15.0, Spending(10.0, kept_usd=1.0, held=Held(2.0, 1)))
    assert not ok and why == ("projected rented $2.04 (2 h at $1.00/h, plus 135 s to stop) exceeds the $2.00 left of "
                              "the $15.00 monthly budget ($10.00 spent or committed, $1.00 kept for the running ones "
                              "to stop, $2.00 held for 1 other admitted job)")


def test_month_key_is_utc() -> None:
    assert month_key(1764547199.0) == "2025-11"  # 2025-11-30T23:59:59Z
    assert month_key(1764547200.0) == "2025-12"


def test_hybrid_for_seed_candidate_c_runs_local_first_and_bursts_the_rest() -> None:
    plan = hybrid_plan(work=1, s_local=0.033, s_rented=0.17, gpus=1, overhead_h=0.5, deadline_h=12, margin_h=0.25,
                       local_usd_h=0.10, rented_usd_per_gpu_h=3.0, market="on-demand", gpu="H100")
    assert plan is not None
    local, cloud = plan.phases
    assert local.hours == pytest.approx(6.7, abs=0.2)  # the "about 6.9 h local"
    assert cloud.hours == pytest.approx(5.1, abs=0.1)  # "then about 5.1 h rented"
    assert local.hours + cloud.hours + 0.25 == pytest.approx(12.0)  # as late as is safe, margin kept
    assert cloud.cost_usd == pytest.approx(15.3, abs=0.1)
    assert plan.cost_usd < 19.15


def test_no_hybrid_when_local_is_as_fast_as_rented_or_too_late() -> None:
    assert latest_switch_h(1, 0.2, 0.1, 1, 0.5, 12, 0.25) is None
    assert latest_switch_h(1, 0.033, 0.17, 1, 0.5, 6.4, 0.25) is None


def test_the_hand_over_moves_with_the_work_measured_so_far() -> None:
    # Seed candidate C with the plan's own estimate of the local work (s_L·x*): the hand-over is x* after the start.
    x = latest_switch_h(1, 0.033, 0.17, 1, 0.5, 12, 0.25)
    assert x is not None
    start, deadline = 1_000_000.0, 1_000_000.0 + 12 * 3600
    terms = {"deadline_at": deadline, "work": 1.0, "rented_units_h": 0.17, "overhead_h": 0.5, "margin_h": 0.25}
    assert latest_switch_at(done=0.033 * x, **terms) == pytest.approx(start + x * 3600)
    # The local card ran at half its estimate: the rest no longer fits after x*, so it bursts that much earlier,
    # as late as the rest at s_R, t_ovh and the margin still end by the deadline.
    slow = latest_switch_at(done=0.033 * x / 2, **terms)
    assert slow == pytest.approx(start + x * 3600 - (0.033 * x / 2) / 0.17 * 3600)
    assert slow + (1 - 0.033 * x / 2) / 0.17 * 3600 + 0.75 * 3600 == pytest.approx(deadline)
    # Faster than its estimate: local runs on, later than x*; with the whole job done there is nothing to burst.
    assert latest_switch_at(done=0.033 * x * 1.5, **terms) > start + x * 3600
    assert latest_switch_at(done=1.0, **terms) == pytest.approx(deadline - 0.75 * 3600)


def test_the_end_of_a_run_is_projected_from_the_speed_measured_so_far() -> None:
    assert projected_finish_at(now=0.0, work=1.0, done=0.5, units_h=0.25) == 2 * 3600.0
    assert projected_finish_at(now=0.0, work=1.0, done=1.2, units_h=0.25) == 0.0  # done (or over-reported)
    assert projected_finish_at(now=0.0, work=1.0, done=0.5, units_h=0.0) is None  # no speed yet: no projection
    assert projected_finish_at(now=0.0, work=1.0, done=0.5, units_h=None) is None
