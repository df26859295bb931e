"""What the daemon has seen of a spot market (its own launches, preemptions and refused launches) becomes the
spot policy's view: is spot there now, since when, and how long its up-times and outages last."""

from __future__ import annotations

import pytest

from orchestrator.core.spot_watch import PRIOR_SPELLS, STALE_H, SpotLife, on_grid, preemption_rate, watch

H = 3600.0
PRIORS = {"tick_h": 60 / H, "prior_uptime_h": 20.0, "prior_outage_h": 1.0}


def test_with_nothing_seen_spot_is_worth_a_try_and_the_model_is_the_prior() -> None:
    view = watch([], [], 10 * H, **PRIORS)
    assert view.available and not view.known and view.state_for_h == 0.0
    assert (view.stats.mean_uptime_h, view.stats.mean_outage_h) == (20.0, 1.0)
    assert view.stats.model is not None and view.stats.model.tick_h == PRIORS["tick_h"]
    assert view.as_record()["spot_seen"] == "unknown"


def test_a_refused_launch_means_spot_is_down_since_the_first_refusal() -> None:
    view = watch([], [1000.0, 1000.0 + 1800, 1000.0 + H], 1000.0 + H + 60, **PRIORS)
    assert not view.available and view.known
    assert view.state_for_h == pytest.approx(1 + 60 / H)
    # The outage going on counts its time up to the last refusal (1 h), but has not ended.
    assert view.outages_ended == 0
    assert view.stats.mean_outage_h == on_grid((1.0 + PRIOR_SPELLS * 1.0) / PRIOR_SPELLS)
    assert view.as_record()["spot_seen"] == "down"


def test_an_outage_ends_when_a_spot_instance_comes_up() -> None:
    lives = [SpotLife(started_at=1800.0, ended_at=None, preempted=False)]
    view = watch(lives, [0.0, 600.0], 2400.0, **PRIORS)
    assert view.available and view.known
    assert view.state_for_h == pytest.approx(600 / H)
    assert view.outages_ended == 1
    assert view.stats.mean_outage_h == on_grid((0.5 + PRIOR_SPELLS * 1.0) / (1 + PRIOR_SPELLS))


def test_the_mean_up_time_is_spot_time_over_preemptions_with_unpreempted_time_counted() -> None:
    lives = [SpotLife(started_at=i * 3 * H, ended_at=i * 3 * H + 2 * H, preempted=True) for i in range(3)]
    lives.append(SpotLife(started_at=10 * H, ended_at=14 * H, preempted=False))  # finished its work: no preemption
    view = watch(lives, [], 14 * H, **PRIORS)
    assert view.preemptions == 3
    assert view.stats.mean_uptime_h == on_grid((3 * 2 + 4 + PRIOR_SPELLS * 20.0) / (3 + PRIOR_SPELLS))
    many = [SpotLife(started_at=i * 3 * H, ended_at=i * 3 * H + 2 * H, preempted=True) for i in range(1000)]
    assert watch(many, [], 3000 * H, **PRIORS).stats.mean_uptime_h == 2.0, "with enough evidence the prior fades"


def test_a_preemption_starts_an_outage() -> None:
    lives = [SpotLife(started_at=0.0, ended_at=2 * H, preempted=True)]
    view = watch(lives, [], 2 * H + 300, **PRIORS)
    assert not view.available and view.state_for_h == pytest.approx(300 / H)


def test_what_was_seen_long_ago_is_unknown_again() -> None:
    view = watch([], [0.0], (STALE_H + 0.5) * H, **PRIORS)
    assert view.available and not view.known and view.state_for_h == 0.0
    assert view.stats.mean_outage_h == 1.0, "a single old refusal says nothing of how long outages last"


def test_an_instance_running_now_keeps_spot_up_however_long_ago_it_started() -> None:
    view = watch([SpotLife(started_at=0.0, ended_at=None, preempted=False)], [], 5 * H, **PRIORS)
    assert view.available and view.known and view.state_for_h == pytest.approx(5.0)


def test_a_refusal_after_an_instance_started_means_new_launches_find_no_spot() -> None:
    view = watch([SpotLife(started_at=0.0, ended_at=None, preempted=False)], [600.0], 900.0, **PRIORS)
    assert not view.available and view.known


def test_estimates_move_in_tenths_of_a_decade_so_that_plans_are_reused() -> None:
    a = watch([], [0.0, 60.0], 120.0, **PRIORS).stats.model
    b = watch([], [0.0, 600.0], 700.0, **PRIORS).stats.model
    assert a == b
    assert [on_grid(x) for x in (0.85, 1.0, 1.1, 1.2, 1.5, 2.0, 20.0)] == [0.794, 1.0, 1.0, 1.26, 1.58, 2.0, 20.0]


def test_a_provider_s_capacity_listing_is_seen_without_launching_and_times_outages_exactly() -> None:
    listings = [(0.0, False), (2 * H, True)]
    view = watch([], [], 3 * H, **PRIORS, listings=listings, listed_now=True)
    assert view.available and view.known and view.state_for_h == pytest.approx(1.0)
    assert view.outages_ended == 1
    assert view.stats.mean_outage_h == on_grid((2.0 + PRIOR_SPELLS * 1.0) / (1 + PRIOR_SPELLS))
    later = watch([], [], 10 * H, **PRIORS, listings=[*listings, (9 * H, False)], listed_now=False)
    assert not later.available and later.known, "what is listed now is fresh, however old the last change"
    assert later.state_for_h == pytest.approx(1.0)


def test_the_preemption_rate_is_the_configured_one_until_spot_hours_say_otherwise() -> None:
    assert preemption_rate([], 0.0, 0.05) == (pytest.approx(0.05), 0.0, 0)
    # 10 preemptions in 20 instance-hours: 0.5/h seen, shrunk with two prior up-times of 20 h each.
    lives = [SpotLife(started_at=i * 3 * H, ended_at=(i * 3 + 2) * H, preempted=True) for i in range(10)]
    rate, hours, preemptions = preemption_rate(lives, 40 * H, 0.05)
    assert (hours, preemptions) == (pytest.approx(20.0), 10)
    assert rate == pytest.approx((10 + PRIOR_SPELLS) / (20 + PRIOR_SPELLS * 20))
    # Hundreds of hours without a preemption pull it below the prior; an instance running now counts to now.
    quiet = [SpotLife(started_at=0.0, ended_at=None, preempted=False)]
    assert preemption_rate(quiet, 400 * H, 0.05)[0] == pytest.approx(PRIOR_SPELLS / (400 + PRIOR_SPELLS * 20))
