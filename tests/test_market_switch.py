"""The daemon asks the same pure spot policy as `burstctl simulate` which market a job's next cloud attempt uses:
before every launch, with the offer's prices and what this installation has seen of that spot market. It must
answer at once for any horizon the daemon can ask about (it runs inside the reconcile tick)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import insert, select

from orchestrator.app import App
from orchestrator.core.decision import decide
from orchestrator.core.spot_policy import DEFAULT_POLICY, REGIMES, Market, SpotState, cached_plan, get_policy
from orchestrator.core.spot_watch import PRIOR_SPELLS
from orchestrator.jobspec import JobSpec
from orchestrator.lifecycle.finish import probe_interval_s
from orchestrator.lifecycle.market_switch import (
    attempt_should_move,
    listed_model,
    market_for_attempt,
    record_spot_listings,
    spot_region_order,
)
from orchestrator.queue import context, facts
from orchestrator.simulate import Trace, trace_short_window_chances
from providers.base import Market as CloudMarket
from providers.base import Offer
from state import schema as s


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tick_s", [0.5, 5.0, 60.0])
@pytest.mark.parametrize(("job_h", "deadline_h", "elapsed_h", "progress_h"),
                         [(0.1, 10.0, 0.01, 0.005), (48.0, 60.0, 20.0, 10.0), (6.0, 6.5, 1.0, 0.2)])
def test_the_default_policy_answers_for_daemon_sized_ticks(tick_s: float, job_h: float, deadline_h: float,
                                                           elapsed_h: float, progress_h: float) -> None:
    state = SpotState(job_hours=job_h, deadline_hours=deadline_h, elapsed_h=elapsed_h, progress_h=progress_h,
                      market=Market.IDLE, spot_available=True, changeover_left_h=0.0, changeover_h=0.2,
                      tick_h=tick_s / 3600.0, od_price=3.06, spot_price=0.9731)
    for _ in range(50):
        assert get_policy(DEFAULT_POLICY).decide(state) in (Market.SPOT, Market.ON_DEMAND, Market.IDLE)


def test_with_no_slack_left_the_policy_goes_on_demand() -> None:
    state = SpotState(job_hours=6.0, deadline_hours=6.3, elapsed_h=0.2, progress_h=0.0, market=Market.IDLE,
                      spot_available=True, changeover_left_h=0.0, changeover_h=0.2, tick_h=5 / 3600,
                      od_price=3.06, spot_price=0.9731)
    assert get_policy(DEFAULT_POLICY).decide(state) is Market.ON_DEMAND


# --- the daemon's side: the policy asked before every cloud launch, with the offer's prices and what was seen ---

H = 3600.0


def _job(app: App, *, market: str = "spot", cloud_h: float = 2.0, overhead_h: float = 0.1,
         deadline_at: float = 4 * H) -> dict[str, Any]:
    decision = {"market": market, "overhead_h": overhead_h, "t_rented_h": cloud_h,
                "plan": [{"where": "cloud", "hours": cloud_h, "market": market}]}
    row = {"id": "j1", "name": "grpo", "kind": "train", "state": "running", "verdict": "burst", "placement": "cloud",
           "spec": {}, "decision": decision, "deadline_at": deadline_at}
    app.store.insert_job(row)
    return row


def _offer(spot: float | None = 1.0, od: float = 3.0, listed: tuple[str, ...] | None = None) -> Offer:
    """An offer; `listed`: the regions where the provider lists spot capacity (None: it does not list it)."""
    return Offer(provider="sim", instance_type="gpu_1x_h100", gpu_model="H100", gpu_count=1, vram_gib=80, vcpus=26,
                 on_demand_usd_h=od, spot_usd_h=spot, regions=("us-east-1",), spot_regions=listed)


def _refused(app: App, n: int, at: float) -> None:
    """Attempt n of job j1: a spot launch refused for lack of capacity at `at`."""
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(
            id=f"j1-a{n}", job_id="j1", n=n, where="cloud", state="launch_failed", provider="sim",
            instance_type="gpu_1x_h100", market="spot", info={"launch_error": "NoCapacity"},
            reason="NoCapacity: no spot capacity",
            created_at=at, ended_at=at))


@pytest.fixture()
def app(tmp_path: Path) -> Iterator[App]:
    app = App(state_dir_override=str(tmp_path / "state"))
    yield app
    app.close()


def test_a_starved_spot_market_sends_the_job_to_on_demand_while_it_can_still_make_its_deadline(app: App) -> None:
    job = _job(app, cloud_h=2.0, overhead_h=0.1, deadline_at=4 * H)
    market, facts = market_for_attempt(app, job, "sim", _offer(), now=0.0)
    assert market is CloudMarket.SPOT and facts["spot_seen"] == "unknown", "nothing seen yet: spot is worth a try"
    # Every minute the daemon tries spot again and is refused; the policy weighs waiting against on-demand.
    flipped = None
    for minute in range(0, 240):
        now = minute * 60.0
        _refused(app, minute + 1, now)
        market, facts = market_for_attempt(app, job, "sim", _offer(), now=now + 1)
        if market is CloudMarket.ON_DEMAND:
            flipped = now
            break
    assert flipped is not None, "a job that never gets spot must not wait for it forever"
    assert facts["spot_seen"] == "down" and facts["for_h"] == pytest.approx(flipped / H, abs=0.01)
    assert 4 * H - flipped >= 2.0 * H + 0.1 * H, "on-demand chosen while the whole job still fits before the deadline"
    assert flipped > 0, "a fresh outage is waited out for a while when there is slack"


def test_with_a_day_of_slack_a_short_outage_is_waited_out(app: App) -> None:
    job = _job(app, cloud_h=2.0, deadline_at=26 * H)
    for minute in range(10):
        _refused(app, minute + 1, minute * 60.0)
    market, facts = market_for_attempt(app, job, "sim", _offer(), now=600.0)
    assert market is CloudMarket.SPOT and facts["choice"] == "idle", "idle: wait for spot, the next launch is the probe"
    assert facts["acted"] == "spot: a probe, spot is seen only by launching"  # what was done, beside the choice


def test_the_offer_s_prices_are_what_the_policy_weighs(app: App) -> None:
    job = _job(app, cloud_h=2.0, deadline_at=26 * H)
    assert market_for_attempt(app, job, "sim", _offer(spot=1.0, od=3.0), now=0.0)[0] is CloudMarket.SPOT
    market, facts = market_for_attempt(app, job, "sim", _offer(spot=3.5, od=3.0), now=0.0)
    assert market is CloudMarket.ON_DEMAND and facts["spot_usd_h"] == 3.5, "spot dearer than on-demand: never"


def test_an_on_demand_decision_or_an_offer_without_spot_is_never_sent_to_spot(app: App) -> None:
    job = _job(app, market="on-demand")
    assert market_for_attempt(app, job, "sim", _offer(), now=0.0) == (CloudMarket.ON_DEMAND, {})
    spot_job = {**job, "decision": {**job["decision"], "market": "spot"}}
    assert market_for_attempt(app, spot_job, "sim", _offer(spot=None), now=0.0) == (CloudMarket.ON_DEMAND, {})


def test_sightings_are_per_provider_and_type(app: App) -> None:
    job = _job(app, cloud_h=2.0, deadline_at=26 * H)
    for minute in range(30):
        _refused(app, minute + 1, minute * 60.0)
    _, facts = market_for_attempt(app, job, "sim", _offer(), now=1800.0)
    assert facts["spot_seen"] == "down"
    other = Offer(**{**_offer().__dict__, "instance_type": "gpu_1x_a100"})
    _, facts = market_for_attempt(app, job, "sim", other, now=1800.0)
    assert facts["spot_seen"] == "unknown"
    _, facts = market_for_attempt(app, job, "ec2", _offer(), now=1800.0)
    assert facts["spot_seen"] == "unknown"


def _running_spot(app: App, n: int, started_at: float, last_checkpoint_at: float | None = None) -> None:
    """Attempt n of job j1: running on spot since `started_at`, its last checkpoint home at `last_checkpoint_at`."""
    info = {} if last_checkpoint_at is None else {"last_checkpoint_at": last_checkpoint_at}
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(
            id=f"j1-a{n}", job_id="j1", n=n, where="cloud", state="running", provider="sim",
            instance_type="gpu_1x_h100", market="spot", instance_id=f"i-{n}", info=info, created_at=started_at,
            started_at=started_at))


def test_the_policy_weighs_the_work_itself_not_the_rework_a_spot_plan_expects(app: App) -> None:
    # A spot plan's hours hold the expected rework and restarts of its preemptions (here 5.88 h of work and 0.5 h of
    # overhead priced as 8 h). The policy counts those itself: the work it weighs is the 5.88 h, as at on-demand.
    job = _job(app, cloud_h=8.0, overhead_h=0.5, deadline_at=12 * H)
    job["decision"] = {**job["decision"], "t_rented_h": 6.38}
    _, facts = market_for_attempt(app, job, "sim", _offer(), now=0.0)
    assert facts["work_left_h"] == pytest.approx(5.88) and facts["slack_h"] == pytest.approx(12 - 5.88)
    # A hybrid's cloud phase: its work over its planned speed.
    job["decision"]["plan"] = [{"where": "local", "hours": 4.0, "work_units": 0.4, "units_h": 0.1},
                               {"where": "cloud", "hours": 4.5, "market": "spot", "work_units": 0.6, "units_h": 0.15,
                                "start_after_h": 4.0}]
    _, facts = market_for_attempt(app, job, "sim", _offer(), now=0.0)
    assert facts["work_left_h"] == pytest.approx(4.0)


def test_a_job_running_on_spot_stays_there_while_the_deadline_has_room(app: App) -> None:
    job = _job(app, cloud_h=2.0, overhead_h=0.1, deadline_at=6 * H)
    _running_spot(app, 1, 0.0)
    assert attempt_should_move(app, job, "sim", _offer(), CloudMarket.SPOT, now=0.5 * H) is None


def test_a_job_running_on_spot_moves_to_on_demand_before_a_preemption_could_make_it_late(app: App) -> None:
    # 1.8 h of work left at 0.1 h, 2.0 h to the deadline: slack 0.2 h = 2d, where the safety net takes over.
    job = _job(app, cloud_h=2.0, overhead_h=0.1, deadline_at=2.1 * H)
    _running_spot(app, 1, 0.0, last_checkpoint_at=0.1 * H)
    move = attempt_should_move(app, job, "sim", _offer(), CloudMarket.SPOT, now=0.1 * H)
    assert move is not None
    target, facts = move
    assert target is CloudMarket.ON_DEMAND and facts["choice"] == "on-demand" and facts["spot_seen"] == "up", facts
    assert facts["slack_h"] == pytest.approx(0.2) and facts["unsaved_h"] == 0.0


def test_a_job_that_does_not_resume_is_never_moved_off_the_market_it_runs_on(app: App) -> None:
    # The same moment as above, where a job that resumes goes to on-demand: moving this one would start it over.
    job = _job(app, cloud_h=2.0, overhead_h=0.1, deadline_at=2.1 * H)
    job["spec"] = {"checkpoint": {"resumable": False}}
    _running_spot(app, 1, 0.0, last_checkpoint_at=0.1 * H)
    assert attempt_should_move(app, job, "sim", _offer(), CloudMarket.SPOT, now=0.1 * H) is None


def test_work_since_the_last_checkpoint_counts_as_not_done_while_a_preemption_would_lose_it(app: App) -> None:
    # 3.9 h of work; at 1.95 h, 2 h of slack by the clock, but the last checkpoint came home 1.85 h ago: a preemption
    # now would lose that work, and leave 0.15 h of slack. The safety net counts it as not done.
    job = _job(app, cloud_h=4.0, overhead_h=0.1, deadline_at=5.9 * H)
    _running_spot(app, 1, 0.0, last_checkpoint_at=0.1 * H)
    move = attempt_should_move(app, job, "sim", _offer(), CloudMarket.SPOT, now=1.95 * H)
    assert move is not None and move[0] is CloudMarket.ON_DEMAND, move
    assert move[1]["unsaved_h"] == pytest.approx(1.85) and move[1]["slack_h"] == pytest.approx(0.15), move[1]
    # With the checkpoint just home, the same job has the slack to stay on spot.
    with app.store.tx() as c:
        c.execute(s.attempts.update().where(s.attempts.c.id == "j1-a1").values(info={"last_checkpoint_at": 1.9 * H}))
    assert attempt_should_move(app, job, "sim", _offer(), CloudMarket.SPOT, now=1.95 * H) is None


# --- where the provider lists spot capacity, the daemon sees spot while it runs elsewhere, and moves back -------


def test_where_spot_is_listed_as_gone_the_job_waits_without_launching_while_waiting_pays(app: App) -> None:
    job = _job(app, cloud_h=2.0, deadline_at=26 * H)
    record_spot_listings(app, "sim", [_offer(listed=())], 0.0)
    market, facts = market_for_attempt(app, job, "sim", _offer(listed=()), now=600.0)
    assert market is None and facts["spot_seen"] == "down" and facts["for_h"] == pytest.approx(600 / H, abs=1e-3), facts
    assert facts["policy"] == "semi-markov-dp", "it sees spot come back, so it plans to come back from on-demand"


def test_a_job_waiting_for_listed_spot_is_not_planned_again_at_every_check(app: App) -> None:
    # Its clock starts with its first attempt, so its deadline moves with every check, and the memoryless model's
    # means with the outage going on. A plan is keyed by both: one a check was 0.1 to 1.5 CPU-seconds a minute a job.
    job = _job(app, cloud_h=6.0, overhead_h=0.5, deadline_at=24 * H)
    record_spot_listings(app, "sim", [_offer(listed=())], 0.0)
    before = cached_plan.cache_info().misses
    choices = [market_for_attempt(app, job, "sim", _offer(listed=()), now=600.0 + 60 * minute)[0]
               for minute in range(10)]
    assert choices == [None] * 10  # it waits for spot, listed gone
    assert cached_plan.cache_info().misses - before <= 2


def test_a_job_on_demand_moves_back_to_spot_once_the_provider_lists_spot_again(app: App) -> None:
    job = _job(app, cloud_h=4.0, overhead_h=0.1, deadline_at=10 * H)
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(
            id="j1-a1", job_id="j1", n=1, where="cloud", state="running", provider="sim", instance_type="gpu_1x_h100",
            market="on-demand", instance_id="i-1", info={}, created_at=0.0, started_at=0.0))
    record_spot_listings(app, "sim", [_offer(listed=())], 0.0)
    assert attempt_should_move(app, job, "sim", _offer(listed=()), CloudMarket.ON_DEMAND, now=0.5 * H) is None
    record_spot_listings(app, "sim", [_offer(listed=("us-east-1",))], 0.6 * H)
    move = attempt_should_move(app, job, "sim", _offer(listed=("us-east-1",)), CloudMarket.ON_DEMAND, now=0.7 * H)
    assert move is not None and move[0] is CloudMarket.SPOT, move
    assert move[1]["spot_seen"] == "up" and move[1]["for_h"] == pytest.approx(0.1), move[1]


def test_where_spot_is_seen_only_by_launching_a_job_on_demand_asks_for_a_probe_when_spot_would_pay(
        app: App, tmp_path: Path) -> None:
    job = _job(app, cloud_h=4.0, overhead_h=0.1, deadline_at=10 * H)
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(
            id="j1-a1", job_id="j1", n=1, where="cloud", state="running", provider="sim", instance_type="gpu_1x_h100",
            market="on-demand", instance_id="i-1", info={}, created_at=0.0, started_at=0.0))
    _refused(app, 2, 0.5 * H)
    move = attempt_should_move(app, job, "sim", _offer(), CloudMarket.ON_DEMAND, now=0.7 * H)
    assert move is not None and move[0] is CloudMarket.SPOT and move[1]["probe"] is True, move
    assert move[1]["spot_seen"] == "down", "what was seen is still the refusal: the probe is what will tell"
    # With less slack than two changeovers, the safety net keeps the job on on-demand: no probe.
    late = attempt_should_move(app, {**job, "deadline_at": 4.05 * H}, "sim", _offer(), CloudMarket.ON_DEMAND,
                               now=0.7 * H)
    assert late is None
    # With probes off, on-demand is final where spot is not listed.
    config = tmp_path / "burstctl.toml"
    config.write_text("[daemon]\nspot_probe_on_demand = false\n")
    off = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    try:
        assert attempt_should_move(off, job, "sim", _offer(), CloudMarket.ON_DEMAND, now=0.7 * H) is None
        _, facts = market_for_attempt(off, job, "sim", _offer(), now=0.7 * H)
        assert facts["policy"].endswith("(on-demand final)"), facts
    finally:
        off.close()


def test_listings_are_kept_as_changes_only(app: App) -> None:
    for minute, listed in enumerate([(), (), ("us-east-1",), ("us-east-1",), ("us-west-1",), ()]):
        record_spot_listings(app, "sim", [_offer(listed=listed), _offer(spot=None)], minute * 60.0)
    with app.store.engine.connect() as c:
        rows = c.execute(select(s.spot_listings.c.at, s.spot_listings.c.up).order_by(s.spot_listings.c.at)).all()
    assert [(at, bool(up)) for at, up in rows] == [(0.0, False), (120.0, True), (300.0, False)]


def test_with_hours_of_listings_the_daemon_plans_on_simulates_own_model_fitted_on_them(app: App) -> None:
    job = _job(app, cloud_h=2.0, deadline_at=60 * H)
    # Spot listed up 2 h, gone 1 h, over and over, for the first 30 h.
    for hour in range(30):
        record_spot_listings(app, "sim", [_offer(listed=("us-east-1",) if hour % 3 < 2 else ())], hour * H)
    _, early = market_for_attempt(app, job, "sim", _offer(listed=("us-east-1",)), now=2 * H)
    assert early["model"] == "memoryless, from launches and listings", "before the first refit (3 h of listings)"
    fitted = listed_model(app, "sim", "gpu_1x_h100", 30 * H)
    assert fitted is not None
    stats = fitted.stats
    assert fitted.hours == 24.0, "simulate's refit schedule: 3, 6, 12, 24 h, then daily"
    assert stats.model is not None and stats.model.regimes == REGIMES and stats.model.tick_h == pytest.approx(1 / 6)
    assert fitted.recent_up_fraction == pytest.approx(2 / 3, abs=0.1)
    assert fitted.recent_changes == 1, "in the last 2 h the listing went once (at 29 h)"
    _, facts = market_for_attempt(app, job, "sim", _offer(listed=("us-east-1",)), now=30 * H)
    assert facts["model"] == "semi-markov, fitted on 24 h of listings" and facts["spot_seen"] == "up", facts
    assert stats.model.restart == 0.0, "one region: nowhere to move to"


def test_where_spot_is_listed_the_policy_is_told_the_short_window_chance_simulate_would_tell_it(app: App) -> None:
    # simulate tells its runs how likely a spot window that has just opened is to be short (`core.short_windows`,
    # learned from every zone's ended windows); the daemon, watching the provider's listings of its types from the
    # same start, tells its policy the same chance, so the default's short-window rule works in both.
    tick = 600.0
    cycle = [1, 1, 0, 0, 0] * 4 + [1] * 18 + [0] * 6  # four 20-min windows after 30-min outages, then a 3 h one
    h100 = np.array(cycle * 20, dtype=bool)[:441]  # three days of 10-min ticks and more, ending on a fresh window
    a100 = np.array(([1] * 30 + [0] * 3) * 20, dtype=bool)[:h100.size]
    assert h100[-1] and not h100[-2]
    other = Offer(**{**_offer().__dict__, "instance_type": "gpu_1x_a100"})
    for t in range(h100.size):
        record_spot_listings(app, "sim", [_offer(listed=("us-east-1",) if h100[t] else ()),
                                          dataclasses.replace(other, spot_regions=("us-east-1",) if a100[t] else ())],
                             t * tick)
    traces = [Trace(name=name, path=Path("-"), gap_seconds=tick, available=a) for name, a in
              (("h100", h100), ("a100", a100))]
    expected = trace_short_window_chances(traces, get_policy(DEFAULT_POLICY).short_window_h)[0][-1]
    assert 0.0 < expected < 1.0, "a chance is known: windows of both lengths have ended, days before"
    job = _job(app, cloud_h=2.0, deadline_at=h100.size * tick + 40 * H)
    now = h100.size * tick + 1.0
    _, said = market_for_attempt(app, job, "sim", _offer(listed=("us-east-1",)), now=now)
    assert said["short_window_chance"] == pytest.approx(expected, abs=5e-4), said
    # Spot listed as gone: no window, nothing told.
    record_spot_listings(app, "sim", [_offer(listed=())], now + 60.0)
    _, gone = market_for_attempt(app, job, "sim", _offer(listed=()), now=now + 120.0)
    assert "short_window_chance" not in gone, gone


def test_where_regions_take_turns_the_model_learns_that_a_run_s_region_goes_while_spot_stays(app: App) -> None:
    # Two regions list spot by turns, overlapping an hour: spot is always listed somewhere, but a run on spot
    # loses its region every 2 h and must restart in the other (simulate --may-move's SpotModel.restart).
    regions = ("us-east-1", "us-west-1")
    for hour in range(30):
        up = tuple(r for i, r in enumerate(regions) if (hour + 2 * i) % 4 < 3)
        record_spot_listings(app, "sim", [dataclasses.replace(_offer(listed=up), regions=regions)], hour * H)
    fitted = listed_model(app, "sim", "gpu_1x_h100", 30 * H)
    assert fitted is not None and fitted.stats.model is not None
    # About one loss every 2 h (12 ticks of 10 min) over the 24 h fitted, shrunk towards a prior of none.
    assert 0.02 < fitted.stats.model.restart < 1 / 12


def test_the_fitted_model_is_shrunk_towards_the_provider_s_other_listed_types(tmp_path: Path) -> None:
    def fitted(with_other: bool) -> Any:
        app = App(state_dir_override=str(tmp_path / f"state-{with_other}"))
        other = Offer(**{**_offer().__dict__, "instance_type": "gpu_1x_a100"})
        for hour in range(30):
            offers = [_offer(listed=("us-east-1",) if hour % 3 < 2 else ())]
            if with_other:  # the A100's spot comes and goes every hour
                offers.append(dataclasses.replace(other, spot_regions=("us-east-1",) if hour % 2 else ()))
            record_spot_listings(app, "sim", offers, hour * H)
        got = listed_model(app, "sim", "gpu_1x_h100", 30 * H)
        app.close()
        assert got is not None
        return got.stats.model

    assert fitted(with_other=True) != fitted(with_other=False)


# --- which region a spot launch tries first ---------------------------------------------------------------------


def test_a_spot_launch_tries_first_the_region_whose_capacity_has_been_listed_longest(app: App) -> None:
    regions = ("us-east-1", "us-west-1", "eu-west-1")  # the offer lists regions in config order

    def listed(*up: str) -> Offer:
        return dataclasses.replace(_offer(listed=tuple(r for r in regions if r in up)), regions=regions)

    record_spot_listings(app, "sim", [listed("us-east-1", "eu-west-1")], 0.0)
    record_spot_listings(app, "sim", [listed("us-east-1", "us-west-1", "eu-west-1")], 1 * H)
    record_spot_listings(app, "sim", [listed("us-west-1", "eu-west-1")], 2 * H)
    record_spot_listings(app, "sim", [listed("us-east-1", "us-west-1", "eu-west-1")], 3 * H)
    # eu-west-1 listed for 4 h, us-west-1 for 3 h, us-east-1 again only since 3 h (its outage reset it).
    assert spot_region_order(app, "sim", listed("us-east-1", "us-west-1", "eu-west-1"), 4 * H) == (
        "eu-west-1", "us-west-1", "us-east-1")
    # Regions the offer does not list now are not tried first, whatever their history.
    assert spot_region_order(app, "sim", listed("us-east-1"), 4 * H) == ("us-east-1",)


def test_regions_never_seen_before_keep_the_configured_order(app: App) -> None:
    offer = dataclasses.replace(_offer(listed=("b", "a")), regions=("b", "a"))
    assert spot_region_order(app, "sim", offer, 0.0) == ("b", "a")


def test_region_listings_are_kept_as_changes_only(app: App) -> None:
    offer = dataclasses.replace(_offer(listed=("a", "b")), regions=("a", "b"))
    for minute in range(5):
        record_spot_listings(app, "sim", [offer], minute * 60.0)
    record_spot_listings(app, "sim", [dataclasses.replace(offer, spot_regions=("b",))], 300.0)
    with app.store.engine.connect() as c:
        rl = s.spot_region_listings.c
        rows = c.execute(select(rl.region, rl.at, rl.up).order_by(rl.id)).all()
    assert [tuple(r) for r in rows] == [("a", 0.0, True), ("b", 0.0, True), ("a", 300.0, False)]


# --- the decision's spot arithmetic learns λ from the same sightings ---------------------------------------------


def _spot_life(app: App, n: int, started_at: float, hours: float, *, provider: str = "sim", gpu: str = "H100",
               preempted: bool = True) -> None:
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(
            id=f"j1-a{n}", job_id="j1", n=n, where="cloud", state="preempted" if preempted else "succeeded",
            provider=provider, instance_type=f"gpu_1x_{gpu.lower()}", market="spot", instance_id=f"i-{n}",
            info={"gpu": gpu}, created_at=started_at, started_at=started_at, ended_at=started_at + hours * H))


def test_the_decision_s_preemption_rate_is_learned_from_every_spot_market_seen(app: App) -> None:
    prior = app.config.policy.spot_preemptions_per_hour
    assert context(app, 0.0).preemptions_per_h == prior and context(app, 0.0).preemptions_basis == "configured"
    _job(app)
    for n in range(1, 9):  # 8 H100 preemptions, each after 1 h of spot, on two providers
        _spot_life(app, n, (n - 1) * 2 * H, 1.0, provider="sim" if n % 2 else "ec2")
    _spot_life(app, 9, 0.0, 40.0, gpu="A100", preempted=False)  # and 40 quiet A100 hours
    ctx = context(app, 41 * H)
    pooled = (8 + PRIOR_SPELLS) / (48 + PRIOR_SPELLS / prior)
    assert ctx.preemptions_per_h == pytest.approx(pooled)
    assert ctx.preemptions_basis.startswith("learned: 8 preemption(s) in 48.0 spot instance-hours")
    # Each type's own record, shrunk towards the pooled figure: H100 preempts far more than A100 here.
    h100, a100 = ctx.preemptions_by_gpu["H100"][0], ctx.preemptions_by_gpu["A100"][0]
    assert h100 == pytest.approx((8 + PRIOR_SPELLS) / (8 + PRIOR_SPELLS / pooled))
    assert a100 == pytest.approx(PRIOR_SPELLS / (40 + PRIOR_SPELLS / pooled))
    assert a100 < pooled < h100
    for gpu, rate in (("H100", h100), ("A100", a100)):
        spec = JobSpec.model_validate({"name": "t", "command": ["train"], "work_units": 10, "local_throughput": 1,
                                       "rented_throughput": {gpu: 5}, "deadline_hours": 5, "market": "auto"})
        decision = decide(facts(spec, 46 * H, 41 * H, app.config), ctx).to_dict()
        assert decision["market_costs"]["preemptions_per_h"] == pytest.approx(rate, abs=1e-4)
        assert any(r.startswith("market: λ = ") and f"{gpu} spot instance-hours" in r for r in decision["reasons"])


# --- a job waiting for spot seen only by launching probes less often as the outage ages --------------------------


def test_a_waiting_job_probes_spot_less_often_as_the_outage_ages(app: App) -> None:
    d = app.config.daemon
    assert probe_interval_s(app, {"spot_seen": "unknown", "for_h": 0.0}) == d.launch_backoff_s
    assert probe_interval_s(app, {"spot_seen": "down", "for_h": 0.05}) == d.launch_backoff_s
    assert probe_interval_s(app, {"spot_seen": "down", "for_h": 1.0}) == pytest.approx(360.0)
    assert probe_interval_s(app, {"spot_seen": "down", "for_h": 10.0}) == d.spot_probe_max_s
    # Through a 10-hour outage: tens of refused launches, where one every launch_backoff_s made 600.
    at, probes = 0.0, 0
    while at < 10 * H:
        at += probe_interval_s(app, {"spot_seen": "down", "for_h": at / H})
        probes += 1
    assert probes < 80, probes
