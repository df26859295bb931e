"""The daemon asks the same pure spot policy as `burstctl simulate` which market a resumed job's next attempt uses;
it must answer at once for any horizon the daemon can ask about (it runs inside the reconcile tick)."""

from __future__ import annotations

import pytest

from orchestrator.core.spot_policy import DEFAULT_POLICY, Market, SpotState, get_policy


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
