"""What knowing the future of the current spot spell would be worth to the default policy (run by hand; issue #6).

    .venv/bin/python benchmarks/oracle_hints.py [--settings a] [--seed 5] [--starts 300] HINT [HINT ...]

Each HINT is a variant of the default (`semi-markov-dp`) told, from the trace's future, one thing about the spell
spot is in, and overriding the plan's action with it; the table gives each one's share of Uniform Progress's gap to
the offline optimum closed, beside the default's on the same starts. A hint is `key=value[,key=value...]`:

- `wait_if_within=N`: idle in an outage, the plan buys on-demand: wait instead if spot is back within N ticks.
- `od_if_longer=N`: idle in an outage, the plan waits: buy on-demand instead if spot is not back within N ticks.
- `stay_od_if_up_under=N`: on on-demand with spot up, the plan goes back to spot: stay if the up window lasts N
  ticks or fewer from its start (told while it is no older than that).
- `stay_od_if_gone_within=N`: the same, whatever the window's age: stay if spot goes again within N ticks from now.
- `idle_skip_spot_under=N`: idle with spot up, the plan starts spot: do not if spot goes again within N ticks.
- `predicted=P` (with `--short-windows MINUTES`; not a hint, honest): on on-demand with spot up, the plan goes back
  to spot: stay while the window is no older than MINUTES if the predictor below gives it a chance over P of
  lasting no longer than that.
- `recall=P`: each hint is given to a share P of the runs only (the others play the plan): a hint never wrong that
  comes for some windows only.
- `noise=Q`: `stay_od_if_up_under`'s hint is wrong (short said long, or long said short) for a share Q of the up
  windows, drawn once per run and window; a long window said short keeps the run on on-demand for its first N
  ticks only.

These are not policies (they read the future); they bound what a predictor of that one thing could add. The
replay is `orchestrator.simulate`'s own: its `replay_batch` is wrapped so that a hint can find each run's tick.

`--short-windows MINUTES` then says how often an honest predictor tells an up window of at most that long from a
longer one at its start: a logistic model on the zone, the 12 h share regime and flicker (as the default reads
them), the lengths of the previous up and down periods and the share of the other zones with spot up, refitted
each day on every zone's windows that had ended by then; beside always saying the past's majority.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from policies import JOB, SETTINGS

import orchestrator.simulate as sim
from orchestrator.core import spot_policy as sp

_NEVER = 10**9
_TRACE: dict[str, Any] = {}  # the trace being replayed: starts, ticks until spot comes back / goes
_PREDICTED: dict[str, Any] = {}  # per trace, the predicted chance of a short window by tick; and its minutes


def _ticks_until(available: np.ndarray, state: bool) -> np.ndarray:
    """For every tick, how many ticks until spot is `state` (0: it is now); not before the trace ends: `_NEVER`."""
    n = available.shape[0]
    out = np.empty(n + 1, dtype=np.int64)
    out[n] = _NEVER
    for t in range(n - 1, -1, -1):
        out[t] = 0 if bool(available[t]) == state else min(out[t + 1] + 1, _NEVER)
    return out


_replay_batch = sim.replay_batch


def _replay_batch_seen(policy: sp.Policy, trace: sim.Trace, starts: Sequence[int] | np.ndarray, job: sim.JobSetting,
                       history: sim.TraceHistory | None = None, stats: sp.AvailabilityStats | None = None,
                       refits: Sequence[tuple[int, sp.AvailabilityStats]] = ()) -> sim.BatchOutcome:
    _TRACE.update(path=str(trace.path), starts=np.asarray(starts), back_in=_ticks_until(trace.available, True),
                  gone_in=_ticks_until(trace.available, False), tick_h=trace.gap_seconds / 3600.0)
    return _replay_batch(policy, trace, starts, job, history, stats, refits)


sim.replay_batch = _replay_batch_seen  # workers are forked: they see it too


@dataclasses.dataclass(frozen=True)
class Hinted(sp.SemiMarkovDP):
    """The default, with its action overridden by a hint from the trace's future (see the module's text)."""

    name: str = "hinted"
    wait_if_within: int = 0
    od_if_longer: int = 0  # 0: no such hint
    stay_od_if_up_under: int = 0
    stay_od_if_gone_within: int = 0
    idle_skip_spot_under: int = 0
    predicted: float = 0.0
    recall: float = 1.0
    noise: float = 0.0

    def decide_batch(self, batch: sp.SpotBatch) -> np.ndarray:
        out = super().decide_batch(batch)
        k = round(float(batch.elapsed_h[0]) / _TRACE["tick_h"])  # a replay's runs all share their elapsed time
        t = np.minimum(_TRACE["starts"] + k, _TRACE["back_in"].shape[0] - 1)
        back_in, gone_in = _TRACE["back_in"][t], _TRACE["gone_in"][t]
        free = ~(sp.safety_net_engaged_batch(batch) | (batch.progress_h >= batch.job_hours))
        told = np.random.default_rng(k).random(out.shape[0]) < self.recall
        idle, od = batch.market == sp.IDLE_CODE, batch.market == sp.OD_CODE
        down, up = free & told & ~batch.spot_available, free & told & batch.spot_available
        out[idle & down & (out == sp.OD_CODE) & (back_in <= self.wait_if_within)] = sp.IDLE_CODE
        out[idle & down & (out == sp.IDLE_CODE) & (back_in > self.od_if_longer)
            & (self.od_if_longer > 0)] = sp.OD_CODE
        # The hint is of the window's length from its start: told in its first N ticks, moot once it has lasted
        # longer (a predictor wrong at the start knows better by then).
        age = np.round(batch.spot_state_for_h / _TRACE["tick_h"]).astype(np.int64)
        short = age + gone_in - 1 <= self.stay_od_if_up_under  # both count this tick
        if self.noise > 0:  # wrong for a share of the windows: drawn once per run and window
            short ^= _wrong(t - age, _TRACE["starts"], self.noise) & (age <= self.stay_od_if_up_under)
        out[od & up & (out == sp.SPOT_CODE) & (short | (gone_in <= self.stay_od_if_gone_within))] = sp.OD_CODE
        out[idle & up & (out == sp.SPOT_CODE) & (gone_in <= self.idle_skip_spot_under)] = sp.IDLE_CODE
        if self.predicted > 0:  # honest: the predictor of --short-windows, from what was known at the window's start
            young = age * _TRACE["tick_h"] * 60.0 <= _PREDICTED["minutes"] + 1e-6
            chance = _PREDICTED[_TRACE["path"]][t]
            out[od & up & (out == sp.SPOT_CODE) & young & (chance > self.predicted)] = sp.OD_CODE
        return out


def _wrong(window: np.ndarray, start: np.ndarray, share: float) -> np.ndarray:
    """Whether the hint about this up window of this run is wrong: a fixed pseudo-random draw per (window, run)."""
    mixed = (window.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (start.astype(np.uint64) * np.uint64(
        0xBF58476D1CE4E5B9))
    mixed ^= mixed >> np.uint64(31)
    mixed *= np.uint64(0x94D049BB133111EB)
    mixed ^= mixed >> np.uint64(29)
    return (mixed >> np.uint64(11)).astype(np.float64) / float(2**53) < share


def _logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0) -> np.ndarray:
    """Weights of an L2-penalised logistic regression (Newton's method; the last column is the unpenalised 1s)."""
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


@dataclasses.dataclass(frozen=True)
class UpWindows:
    """The up windows of a set of traces on one clock that follow an up and a down period, with what is known at
    each one's start (`features`, for `_logistic`) and whether it lasted at most the minutes asked (`short`)."""

    zone: np.ndarray
    start: np.ndarray
    end: np.ndarray  # the first tick down after it; for one still up as its trace ends, `_NEVER`
    short: np.ndarray
    features: np.ndarray


def up_windows(traces: Sequence[sim.Trace], minutes: float) -> UpWindows:
    """Each trace's up windows, the features a predictor reads at their start: the zone, the 12 h share regime and
    flicker as the default reads them, the share itself, the lengths of the previous up and down periods, the share
    of the other zones with spot up."""
    rows = []
    for i, trace in enumerate(traces):
        a = trace.available.astype(bool)
        history = sim.TraceHistory.of(a, trace.gap_seconds)
        bounds = np.concatenate(([0], np.flatnonzero(a[1:] != a[:-1]) + 1, [a.shape[0]]))
        for j in range(2, bounds.shape[0] - 1):
            start, end = bounds[j], bounds[j + 1]
            if not a[start]:
                continue
            others = np.mean([o.available[start] for k, o in enumerate(traces) if k != i])
            features = [*np.eye(len(traces))[i], history.recent_up_fraction[start] < sp.REGIME_EDGES[0],
                        history.recent_changes[start] >= sp.FLICKER_EDGES[0], history.recent_up_fraction[start],
                        np.log(bounds[j - 1] - bounds[j - 2]), np.log(start - bounds[j - 1]), others, 1.0]
            ended = end < a.shape[0]
            rows.append((i, start, end if ended else _NEVER,
                         ended and (end - start) * trace.gap_seconds <= minutes * 60 + 1e-6, features))
    return UpWindows(*(np.array([r[k] for r in rows]) for k in range(4)),
                     features=np.array([r[4] for r in rows], dtype=float))


def predicted_short(windows: UpWindows, ticks_a_day: int) -> np.ndarray:
    """Each window's chance of being short, from a model fitted on the windows that had ended when its day began
    (NaN before there are 30 of them, of both kinds)."""
    chance = np.full(windows.start.shape[0], np.nan)
    short = windows.short.astype(float)
    for first in range(0, int(windows.start.max()) + 1, ticks_a_day):
        seen = windows.end <= first
        ask = (windows.start >= first) & (windows.start < first + ticks_a_day)
        if ask.any() and seen.sum() >= 30 and 0 < short[seen].sum() < seen.sum():
            w = _logistic(windows.features[seen], short[seen])
            chance[ask] = 1.0 / (1.0 + np.exp(-(windows.features[ask] @ w)))
    return chance


def short_window_accuracy(traces: Sequence[sim.Trace], minutes: float) -> tuple[float, float, int]:
    """How often the honest predictor of `--short-windows` is right, how often the past's majority is, over how
    many up windows (those that ended, starting from the third day, each told from the windows ended before its
    day)."""
    windows = up_windows(traces, minutes)
    day = round(86400 / traces[0].gap_seconds)
    chance = predicted_short(windows, day)
    told = (windows.start >= 2 * day) & (windows.end < _NEVER) & ~np.isnan(chance)
    majority = 0
    for first in range(2 * day, int(windows.start.max()) + 1, day):
        seen = windows.end <= first
        ask = told & (windows.start >= first) & (windows.start < first + day)
        majority += int(((windows.short[seen].mean() > 0.5) == windows.short[ask]).sum())
    right = int(((chance[told] > 0.5) == windows.short[told]).sum())
    return right / int(told.sum()), majority / int(told.sum()), int(told.sum())


def _predicted_by_tick(traces: Sequence[sim.Trace], minutes: float) -> dict[str, np.ndarray]:
    """Per trace and tick, the predicted chance that the up window the tick is in is short (0 where none is)."""
    windows = up_windows(traces, minutes)
    chance = np.nan_to_num(predicted_short(windows, round(86400 / traces[0].gap_seconds)))
    by_tick = {str(t.path): np.zeros(len(t) + 1) for t in traces}
    for zone, start, end, p in zip(windows.zone, windows.start, windows.end, chance, strict=True):
        trace = traces[int(zone)]
        by_tick[str(trace.path)][start:min(int(end), len(trace))] = p
    return by_tick


def hinted(spec: str) -> Hinted:
    """A `Hinted` policy from `key=value,...`."""
    fields = {f.name: f.type for f in dataclasses.fields(Hinted)}
    values: dict[str, Any] = {}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key not in fields or key == "name":
            raise SystemExit(f"oracle_hints.py: unknown hint {key!r} in {spec!r}")
        values[key] = float(value) if key in ("recall", "noise", "predicted") else int(value)
    return Hinted(name=spec, **values)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="a")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--starts", type=int, default=300)
    ap.add_argument("--short-windows", type=float, metavar="MINUTES",
                    help="also: how well an honest predictor tells up windows of at most this long (see above)")
    ap.add_argument("hints", nargs="*")
    args = ap.parse_args()
    variants = {spec: hinted(spec) for spec in args.hints}
    sp.POLICIES.update(variants)
    names = ["uniform-progress", sp.DEFAULT_POLICY, *variants]
    for key in args.settings:
        title, path, window = SETTINGS[key]
        traces = sim.load_traces([path], window=window)
        if args.short_windows:
            _PREDICTED.update(_predicted_by_tick(traces, args.short_windows), minutes=args.short_windows)
            right, majority, told = short_window_accuracy(traces, args.short_windows)
            print(f"\nSetting ({key}): up windows of at most {args.short_windows:g} min told at their start: "
                  f"{right:.1%} right (the past's majority: {majority:.1%}), {told} windows")
        if not variants:
            continue
        report = sim.simulate(traces, names, JOB, starts=args.starts, seed=args.seed)
        doc = report.as_json(sp.DEFAULT_POLICY)
        optimum = doc["offline"]["mean_cost_usd"]
        kind = "exact optimum" if doc["offline"]["exact"] else "the DP lower bound"
        up = doc["policies"]["uniform-progress"]["mean_cost_usd"]
        print(f"\n### Setting ({key}): {title}; seed {args.seed}, {args.starts} starts/trace; against {kind}\n")
        print("| policy | mean cost $/run | UP's gap closed | misses |")
        print("|---|---|---|---|")
        for name in names:
            p = doc["policies"][name]
            cost = p["mean_cost_usd"]
            print(f"| {name} | {cost:.3f} | {(up - cost) / (up - optimum):.1%} | {p['misses']}/{p['runs']} |")


if __name__ == "__main__":
    main()
