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
- `predicted=P` (not a hint, honest; `SemiMarkovDP.short_window_over`, 0.8 in the default): on on-demand with spot
  up, the plan goes back to spot: stay while the window is no older than MINUTES (`--short-windows`; else the
  default's 30) if the predictor below gives it a chance over P of lasting no longer than that. The default does
  this since it was built in (`core/short_windows.py`); `predicted=1` is the default without it.
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
each day on every zone's windows that had ended by then; beside always saying the past's majority. With it, the
same model on a richer set of features (`--rich`: the two previous up and down periods, the median up and down
period and the share of short up periods among the last five, spot's changes in 6 h and its share in 24 h, other
zones whose spot came back in the last 3 ticks, the hour of the trace's day), and with `--gbm` gradient-boosted
trees on them (needs scikit-learn, not a dependency: `pip install scikit-learn`). Each says its accuracy, the area
under its ROC curve and, above a few thresholds, how many windows it called short and what share of them were.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from policies import JOB, SETTINGS

import orchestrator.simulate as sim
from orchestrator.core import short_windows as sw
from orchestrator.core import spot_policy as sp

_NEVER = 10**9
_TRACE: dict[str, Any] = {}  # the trace being replayed: starts, ticks until spot comes back / goes


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
                       refits: Sequence[tuple[int, sp.AvailabilityStats]] = (),
                       short_window_chance: np.ndarray | None = None) -> sim.BatchOutcome:
    _TRACE.update(path=str(trace.path), starts=np.asarray(starts), back_in=_ticks_until(trace.available, True),
                  gone_in=_ticks_until(trace.available, False), tick_h=trace.gap_seconds / 3600.0)
    return _replay_batch(policy, trace, starts, job, history, stats, refits, short_window_chance)


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
        return out


def _wrong(window: np.ndarray, start: np.ndarray, share: float) -> np.ndarray:
    """Whether the hint about this up window of this run is wrong: a fixed pseudo-random draw per (window, run)."""
    mixed = (window.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (start.astype(np.uint64) * np.uint64(
        0xBF58476D1CE4E5B9))
    mixed ^= mixed >> np.uint64(31)
    mixed *= np.uint64(0x94D049BB133111EB)
    mixed ^= mixed >> np.uint64(29)
    return (mixed >> np.uint64(11)).astype(np.float64) / float(2**53) < share


def rich_features(traces: Sequence[sim.Trace], windows: sw.UpWindows, minutes: float) -> np.ndarray:
    """For `--rich` and `--gbm`, one row per window of `windows` (the zone's index first): the 12 h share, spot's
    changes in 2 h, the two previous up and down periods' log lengths, the other zones' share up, the share of
    other zones whose spot came back in the last 3 ticks, the share of short ones among the last five up periods,
    the median up and down period, the hour of the trace's day, spot's changes in 6 h and its share in 24 h."""
    available = np.array([t.available.astype(bool) for t in traces])
    came_back = np.zeros_like(available)
    came_back[:, 1:] = available[:, 1:] & ~available[:, :-1]
    gap = traces[0].gap_seconds
    short_ticks = minutes * 60 / gap + 1e-6
    histories = [sim.TraceHistory.of(a, gap) for a in available]
    periods = []
    for a in available:
        bounds = np.concatenate(([0], np.flatnonzero(a[1:] != a[:-1]) + 1, [a.shape[0]]))
        periods.append((bounds, np.diff(bounds)))
    rows = []
    for i, start in zip(windows.zone, windows.start, strict=True):
        a, history, (bounds, lengths) = available[i], histories[i], periods[i]
        j = int(np.searchsorted(bounds, start))  # the window is period j
        others = np.mean(np.delete(available[:, start], i))
        before = lengths[max(j - 10, 0):j][::-1]  # the periods before this window, the latest first
        ups, downs = before[1::2], before[0::2]
        six_h, day = a[max(start - round(6 * 3600 / gap), 0):start], a[max(start - round(86400 / gap), 0):start]
        rows.append([i, history.recent_up_fraction[start], history.recent_changes[start], np.log(lengths[j - 2]),
                     np.log(lengths[j - 1]), np.log(lengths[max(j - 4, 0)]), np.log(lengths[max(j - 3, 0)]), others,
                     np.mean(np.delete(came_back[:, max(start - 2, 0):start + 1].any(axis=1), i)),
                     np.mean(ups <= short_ticks), np.log(np.median(ups)), np.log(np.median(downs)),
                     (start * gap / 3600) % 24, np.count_nonzero(six_h[1:] != six_h[:-1]), day.mean()])
    return np.array(rows, dtype=float)


def up_windows(traces: Sequence[sim.Trace], minutes: float) -> sw.UpWindows:
    """Each trace's up windows with the features the default's predictor reads at their start (`core.short_windows`),
    the traces as zones on one clock."""
    histories = [sim.TraceHistory.of(t.available, t.gap_seconds) for t in traces]
    return sw.window_features(np.array([t.available for t in traces]),
                              np.array([h.recent_up_fraction for h in histories]),
                              np.array([h.recent_changes for h in histories]), traces[0].gap_seconds / 3600.0,
                              minutes / 60.0)


def _gbm_chance(x: np.ndarray, y: np.ndarray, ask: np.ndarray) -> np.ndarray:
    from sklearn.ensemble import HistGradientBoostingClassifier  # optional: only for --gbm

    trees = HistGradientBoostingClassifier(max_iter=150, learning_rate=0.05, max_leaf_nodes=8,
                                           min_samples_leaf=20, l2_regularization=1.0, categorical_features=[0])
    return trees.fit(x, y).predict_proba(ask)[:, 1]


def _rich_logistic_chance(zones: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    def fitted(x: np.ndarray, y: np.ndarray, ask: np.ndarray) -> np.ndarray:
        mean, scale = x[:, 1:].mean(axis=0), x[:, 1:].std(axis=0) + 1e-9  # from the windows seen only

        def design(rows: np.ndarray) -> np.ndarray:
            return np.column_stack([np.eye(zones)[rows[:, 0].astype(int)], (rows[:, 1:] - mean) / scale,
                                    np.ones(rows.shape[0])])

        return sw.chance_of(design(ask), sw.fit_logistic(design(x), y, l2=3.0))

    return fitted


def predicted_short(traces: Sequence[sim.Trace], windows: sw.UpWindows, minutes: float, model: str = "basic"
                    ) -> np.ndarray:
    """Each window's chance of being short, from a model (`basic`: the default's, `core.short_windows`; `rich`: the
    logistic on `rich_features`; `gbm`: trees on them) fitted on the windows that had ended when its day began (NaN
    before there are 30 of them, of both kinds)."""
    day = round(86400 / traces[0].gap_seconds)
    if model == "basic":
        return sw.predicted_short(windows, day)
    rich = rich_features(traces, windows, minutes)
    return sw.predicted_short(windows, day, rich,
                              _gbm_chance if model == "gbm" else _rich_logistic_chance(len(traces)))


def _auc(chance: np.ndarray, short: np.ndarray) -> float:
    """Area under the ROC curve: the chance a short window is given a higher chance than a long one (ties half)."""
    values, inverse = np.unique(chance, return_inverse=True)
    first = np.searchsorted(np.sort(chance), values)  # 0-based rank of each value's first occurrence
    counts = np.bincount(inverse)
    ranks = (first + (counts + 1) / 2.0)[inverse]  # tied values share their mean rank (1-based)
    positives = int(short.sum())
    negatives = short.shape[0] - positives
    return float((ranks[short].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


_THRESHOLDS = (0.6, 0.7, 0.8, 0.9)  # chances above which `compare_predictors` counts a window called short


def compare_predictors(traces: Sequence[sim.Trace], minutes: float, models: Sequence[str]) -> None:
    """Print, per model, how well it tells the up windows of at most `minutes` (those `short_window_accuracy`
    counts): accuracy, ROC area, and above thresholds how many it called short and what share were."""
    windows = up_windows(traces, minutes)
    day = round(86400 / traces[0].gap_seconds)
    chances = {m: predicted_short(traces, windows, minutes, m) for m in models}
    told = (windows.start >= 2 * day) & (windows.end < sw.OPEN_END) & ~np.isnan(chances[models[0]])
    short = windows.short[told].astype(bool)
    print("\n| model | right | ROC area | " + " | ".join(f"chance > {p}: called short, share short" for p in
                                                        _THRESHOLDS) + " |")
    print("|---" * (3 + len(_THRESHOLDS)) + "|")
    for model, chance in chances.items():
        c = chance[told]
        cells = [f"{int((c > p).sum())}, {short[c > p].mean():.0%}" if (c > p).any() else "0, —" for p in _THRESHOLDS]
        print(f"| {model} | {((c > 0.5) == short).mean():.1%} | {_auc(c, short):.3f} | " + " | ".join(cells) + " |")


def short_window_accuracy(traces: Sequence[sim.Trace], minutes: float) -> tuple[float, float, int]:
    """How often the honest predictor of `--short-windows` is right, how often the past's majority is, over how
    many up windows (those that ended, starting from the third day, each told from the windows ended before its
    day)."""
    windows = up_windows(traces, minutes)
    day = round(86400 / traces[0].gap_seconds)
    chance = predicted_short(traces, windows, minutes)
    told = (windows.start >= 2 * day) & (windows.end < sw.OPEN_END) & ~np.isnan(chance)
    majority = 0
    for first in range(2 * day, int(windows.start.max()) + 1, day):
        seen = windows.end <= first
        ask = told & (windows.start >= first) & (windows.start < first + day)
        majority += int(((windows.short[seen].mean() > 0.5) == windows.short[ask]).sum())
    right = int(((chance[told] > 0.5) == windows.short[told]).sum())
    return right / int(told.sum()), majority / int(told.sum()), int(told.sum())


def hinted(spec: str, short_minutes: float | None = None) -> Hinted:
    """A `Hinted` policy from `key=value,...` (`predicted` is the default's `short_window_over`; `short_minutes`, its
    `short_window_h` in minutes)."""
    fields = {f.name: f.type for f in dataclasses.fields(Hinted)}
    values: dict[str, Any] = {} if short_minutes is None else {"short_window_h": short_minutes / 60.0}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        key = "short_window_over" if key == "predicted" else key
        if key not in fields or key == "name":
            raise SystemExit(f"oracle_hints.py: unknown hint {key!r} in {spec!r}")
        values[key] = float(value) if key in ("recall", "noise", "short_window_over") else int(value)
    return Hinted(name=spec, **values)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="a")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--starts", type=int, default=300)
    ap.add_argument("--short-windows", type=float, metavar="MINUTES",
                    help="also: how well an honest predictor tells up windows of at most this long (see above)")
    ap.add_argument("--rich", action="store_true", help="with --short-windows: the richer features too")
    ap.add_argument("--gbm", action="store_true", help="with --short-windows: trees on them (needs scikit-learn)")
    ap.add_argument("hints", nargs="*")
    args = ap.parse_args()
    variants = {spec: hinted(spec, args.short_windows) for spec in args.hints}
    sp.POLICIES.update(variants)
    names = ["uniform-progress", sp.DEFAULT_POLICY, *variants]
    for key in args.settings:
        title, path, window = SETTINGS[key]
        traces = sim.load_traces([path], window=window)
        if args.short_windows:
            right, majority, told = short_window_accuracy(traces, args.short_windows)
            print(f"\nSetting ({key}): up windows of at most {args.short_windows:g} min told at their start: "
                  f"{right:.1%} right (the past's majority: {majority:.1%}), {told} windows")
            if args.rich or args.gbm:
                compare_predictors(traces, args.short_windows,
                                   ["basic", *(["rich"] if args.rich else []), *(["gbm"] if args.gbm else [])])
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
