"""How likely a spot window that has just opened is to be short: told at its start, from the past only.

A run on on-demand that goes back to spot as spot comes back pays a changeover; if the window is gone again within
minutes it pays another to come back. `SemiMarkovDP` stays on on-demand while a young window's predicted chance of
being short is high (`SpotState.short_window_chance`). This module makes that chance (docs/simulate.md, "What
knowing the future would be worth").

An up window is a run of ticks with spot up that follows an up and a down period of its zone. What is known at its
start (`window_features`): the zone, the 12 h share regime and flicker flags as the policy reads them, the 12 h
share itself, the log lengths of the previous up and down periods, the share of the other zones (traces on one
clock) with spot up at that tick, and a constant. A logistic regression (L2, Newton's method) is refitted once a
`ticks_per_fit` (a day of trace) on every zone's windows that had *ended* before that fit's first tick, and each
window's chance is from the model of the fit period it began in (`predicted_short`): nothing from the future.

Pure: arrays in, arrays out, numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from orchestrator.core.spot_policy import FLICKER_EDGES, REGIME_EDGES

OPEN_END = 2**62  # `UpWindows.end` of a window still up as its trace ends
MIN_WINDOWS = 30  # no model before this many windows have ended, of both kinds
L2 = 1.0  # the penalty on every weight but the constant's
FIT_EVERY_H = 24.0  # hours of trace between fits (one model a day)


@dataclass(frozen=True)
class UpWindows:
    """The up windows of traces on one clock (zone by zone, in order of start), with what is known at each one's
    start (`features`, one row each, the constant last) and whether it lasted at most the length asked (`short`)."""

    zone: np.ndarray  # int: the trace's index
    start: np.ndarray  # int: the window's first tick
    end: np.ndarray  # int: the first tick down after it; `OPEN_END` for one still up as its trace ends
    short: np.ndarray  # bool: it ended, at most the length asked after its start
    features: np.ndarray  # float (windows, zones + 7)


def window_features(available: np.ndarray, recent_up_fraction: np.ndarray, recent_changes: np.ndarray,
                    tick_h: float, short_h: float) -> UpWindows:
    """The up windows of `available` (zones, ticks; bool) and what is known at their start.

    `recent_up_fraction` and `recent_changes` (zones, ticks) are the share of the last `REGIME_WINDOW_H` with spot
    up and its changes in the last `FLICKER_WINDOW_H`, by tick (counting the tick), as the policy is given them.
    A window is short when it ended at most `short_h` hours after its start."""
    zones, n = available.shape
    short_ticks = short_h / tick_h + 1e-6
    parts = []
    for i in range(zones):
        a = available[i].astype(bool)
        bounds = np.concatenate(([0], np.flatnonzero(a[1:] != a[:-1]) + 1, [n]))
        lengths = np.diff(bounds)
        j = np.arange(2, bounds.shape[0] - 1)  # periods with an up and a down period before them
        j = j[a[bounds[j]]]
        start, end = bounds[j], bounds[j + 1]
        ended = end < n
        up_elsewhere = available[:, start].sum(axis=0) - a[start]
        others = up_elsewhere / (zones - 1) if zones > 1 else np.zeros(start.shape[0])  # one zone: no others
        share = recent_up_fraction[i, start]
        x = np.column_stack([np.broadcast_to(np.eye(zones)[i], (start.shape[0], zones)),
                             share < REGIME_EDGES[0], recent_changes[i, start] >= FLICKER_EDGES[0], share,
                             np.log(lengths[j - 2]), np.log(lengths[j - 1]), others, np.ones(start.shape[0])])
        parts.append((np.full(start.shape[0], i), start, np.where(ended, end, OPEN_END),
                      ended & (end - start <= short_ticks), x.astype(float)))
    zone, start, end, short = (np.concatenate([p[k] for p in parts]) for k in range(4))
    return UpWindows(zone=zone, start=start, end=end, short=short,
                     features=np.concatenate([p[4] for p in parts]).reshape(-1, zones + 7))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = L2) -> np.ndarray:
    """Weights of an L2-penalised logistic regression of `y` (0/1) on the rows of `x`, by Newton's method. The last
    column is the constant, not penalised."""
    w = np.zeros(x.shape[1])
    penalty = np.full(x.shape[1], l2)
    penalty[-1] = 0.0
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        grad = x.T @ (p - y) + penalty * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + np.diag(penalty) + 1e-9 * np.eye(x.shape[1])
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def chance_of(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The model's chance for each row of `x`."""
    return 1.0 / (1.0 + np.exp(-(x @ w)))


def logistic_chance(x: np.ndarray, y: np.ndarray, ask: np.ndarray) -> np.ndarray:
    """The chance for the rows `ask` from the logistic regression fitted on `x`, `y` (`fit_logistic`)."""
    return chance_of(ask, fit_logistic(x, y))


def predicted_short(windows: UpWindows, ticks_per_fit: int, x: np.ndarray | None = None,
                    fitted: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] = logistic_chance,
                    only: np.ndarray | None = None) -> np.ndarray:
    """Each window's chance of being short, from the model fitted on the windows that had ended by the first tick
    of its fit period (periods of `ticks_per_fit` from tick 0). NaN where fewer than `MIN_WINDOWS` had, or only
    of one kind. `x`: other features than `windows.features` (rows alike); `fitted(x, y, ask)`: another model;
    `only`: the windows to tell (NaN for the others), so that only their periods' models are fitted."""
    x = windows.features if x is None else x
    chance = np.full(windows.start.shape[0], np.nan)
    wanted = np.ones(chance.shape[0], dtype=bool) if only is None else only
    short = windows.short.astype(float)
    for first in np.unique(windows.start[wanted] // ticks_per_fit * ticks_per_fit):
        seen = windows.end <= first
        ask = wanted & (windows.start >= first) & (windows.start < first + ticks_per_fit)
        if seen.sum() >= MIN_WINDOWS and 0 < short[seen].sum() < seen.sum():
            chance[ask] = fitted(x[seen], short[seen], x[ask])
    return chance


def chance_by_tick(windows: UpWindows, chance: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """(zones, ticks): at each tick of an up window, that window's chance (`predicted_short`); NaN elsewhere (spot
    down, a window without one)."""
    out = np.full(shape, np.nan)
    for zone, start, end, p in zip(windows.zone, windows.start, windows.end, chance, strict=True):
        out[int(zone), int(start):min(int(end), shape[1])] = p
    return out


def chance_now(available: np.ndarray, recent_up_fraction: np.ndarray, recent_changes: np.ndarray, tick_h: float,
               short_h: float) -> float:
    """`short_window_chances` at zone 0's last tick (NaN where unknown, spot down there included), with one model
    fitted instead of one a day: what the daemon asks of its listings at a check."""
    windows = window_features(available, recent_up_fraction, recent_changes, tick_h, short_h)
    last = available.shape[1] - 1
    now = (windows.zone == 0) & (windows.start <= last) & (windows.end > last)
    if not now.any():
        return math.nan
    return float(predicted_short(windows, max(round(FIT_EVERY_H / tick_h), 1), only=now)[now][0])


def short_window_chances(available: np.ndarray, recent_up_fraction: np.ndarray, recent_changes: np.ndarray,
                         tick_h: float, short_h: float) -> np.ndarray:
    """(zones, ticks): the chance, at each tick, that the up window it is in lasts at most `short_h` from its start,
    as told at that start (NaN where unknown); refitted every `FIT_EVERY_H` hours of trace."""
    windows = window_features(available, recent_up_fraction, recent_changes, tick_h, short_h)
    chance = predicted_short(windows, max(round(FIT_EVERY_H / tick_h), 1))
    return chance_by_tick(windows, chance, available.shape)
