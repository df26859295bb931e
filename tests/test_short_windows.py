"""The predictor of short spot windows (`core.short_windows`): honest, each window told from the past only."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.short_windows import (
    MIN_WINDOWS,
    OPEN_END,
    chance_now,
    fit_logistic,
    predicted_short,
    short_window_chances,
    window_features,
)
from orchestrator.simulate import TraceHistory

TICK_H = 1 / 6  # setting (a)'s 10-minute ticks: a day is 144
DAY = 144


def flickering(rng: np.random.Generator, zones: int, ticks: int) -> np.ndarray:
    """Zones whose spot goes and comes back every few ticks, some spells shorter than others."""
    out = np.empty((zones, ticks), dtype=bool)
    for z in range(zones):
        state, t = bool(rng.integers(2)), 0
        while t < ticks:
            run = int(rng.geometric(0.5 if rng.random() < 0.5 else 0.08))
            out[z, t:t + run] = state
            state, t = not state, t + run
    return out


def chances(available: np.ndarray, short_h: float = 0.5) -> np.ndarray:
    histories = [TraceHistory.of(a, TICK_H * 3600) for a in available]
    return short_window_chances(available, np.array([h.recent_up_fraction for h in histories]),
                                np.array([h.recent_changes for h in histories]), TICK_H, short_h)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_ticks_chance_does_not_change_when_any_zones_future_is_rewritten(seed: int) -> None:
    # At tick t the chance is the one of the window t is in, told at its start from windows that had ended before
    # its day: rewriting every zone's ticks after t (or after the window's day) leaves it, and every tick's before.
    rng = np.random.default_rng(seed)
    available = flickering(rng, 3, 12 * DAY)
    before = chances(available)
    assert np.isfinite(before).sum() > 1000 and (before > 0).any()
    assert np.isnan(before[:, :DAY]).all(), "nothing had ended before the first day: no model"
    assert np.isnan(before[~available]).all(), "spot down: no window"
    for t in [*rng.integers(DAY, 12 * DAY - 1, size=4), *range(DAY, 12 * DAY, DAY)]:  # a day's first tick too
        rewritten = available.copy()
        rewritten[:, t + 1:] = flickering(rng, 3, 12 * DAY - t - 1)
        after = chances(rewritten)
        assert np.array_equal(before[:, :t + 1], after[:, :t + 1], equal_nan=True), t
    # A window's chance is its day's model's: flipping every tick after that day changes none of that day's.
    day_end = 6 * DAY
    rewritten = available.copy()
    rewritten[:, day_end:] = ~rewritten[:, day_end:]
    windows = window_features(available, *_recent(available), TICK_H, 0.5)
    in_day = (windows.start >= day_end - DAY) & (windows.start < day_end)
    told = predicted_short(windows, DAY)[in_day]
    again = window_features(rewritten, *_recent(rewritten), TICK_H, 0.5)
    same = np.isin(again.start + again.zone * 10**6, (windows.start + windows.zone * 10**6)[in_day])
    assert same.sum() == in_day.sum() > 10 and np.isfinite(told).all()
    assert not np.array_equal(chances(rewritten)[:, day_end:], before[:, day_end:], equal_nan=True)
    assert np.array_equal(predicted_short(again, DAY)[same], told, equal_nan=True)


def _recent(available: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    histories = [TraceHistory.of(a, TICK_H * 3600) for a in available]
    return np.array([h.recent_up_fraction for h in histories]), np.array([h.recent_changes for h in histories])


def test_a_window_is_told_by_the_model_fitted_on_the_windows_ended_before_its_day() -> None:
    rng = np.random.default_rng(4)
    available = flickering(rng, 2, 6 * DAY)
    windows = window_features(available, *_recent(available), TICK_H, 0.5)
    chance = predicted_short(windows, DAY)
    day = 3
    seen = windows.end <= day * DAY
    assert MIN_WINDOWS <= seen.sum() < windows.start.shape[0]
    w = fit_logistic(windows.features[seen], windows.short[seen].astype(float))
    ask = (windows.start >= day * DAY) & (windows.start < (day + 1) * DAY)
    assert np.allclose(chance[ask], 1 / (1 + np.exp(-(windows.features[ask] @ w))))
    # Labels: short is "ended at most 0.5 h (3 ticks) after its start"; a window still up at the end is not short.
    ended = windows.end < OPEN_END
    assert np.array_equal(windows.short, ended & (windows.end - windows.start <= 3))
    assert (windows.end[~ended] == OPEN_END).all() and (~ended).sum() <= 2
    # Every window starts up after a down tick, and follows an up and a down period of its zone.
    assert available[windows.zone, windows.start].all() and not available[windows.zone, windows.start - 1].any()


def test_the_features_read_at_a_windows_start_are_the_zone_its_regime_and_the_periods_before_it() -> None:
    up, down = [True], [False]
    a = np.array(up * 5 + down * 2 + up * 3 + down * 4 + up * 6)
    b = np.array(down * 10 + up * 10)  # the other zone: up from tick 10
    windows = window_features(np.stack([a, b]), *_recent(np.stack([a, b])), TICK_H, 0.5)
    assert windows.zone.tolist() == [0, 0] and windows.start.tolist() == [7, 14]
    assert windows.end.tolist() == [10, OPEN_END] and windows.short.tolist() == [True, False]
    x = windows.features[1]
    assert x[:2].tolist() == [1.0, 0.0] and x[-1] == 1.0
    assert x[2:5].tolist() == [0.0, 1.0, 9 / 15]  # not scarce (9 of 15 ticks up), flickering (4 changes in 2 h)
    assert x[5:7] == pytest.approx(np.log([3, 4]))  # the previous up (3 ticks) and down (4) periods
    assert x[7] == 1.0  # the other zone's spot is up at tick 14
    alone = window_features(a[None], *_recent(a[None]), TICK_H, 0.5)
    assert alone.features[:, -2].tolist() == [0.0, 0.0], "one zone: no others"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_chance_now_is_the_last_ticks_chance_of_the_first_zone_with_one_fit(seed: int) -> None:
    # The daemon asks at each check only about the window its type's spot is in now (`chance_now`): what
    # `short_window_chances` tells at that tick, spot down (NaN) included, wherever the history ends.
    available = flickering(np.random.default_rng(seed), 3, 5 * DAY)
    for end in range(3 * DAY, 5 * DAY, 37):
        part = available[:, :end]
        histories = [TraceHistory.of(a, TICK_H * 3600) for a in part]
        now = chance_now(part, np.array([h.recent_up_fraction for h in histories]),
                         np.array([h.recent_changes for h in histories]), TICK_H, 0.5)
        np.testing.assert_allclose(now, chances(part)[0, -1], rtol=1e-12, equal_nan=True)  # a 1-row product may round
