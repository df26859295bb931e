"""What the daemon's own use of the spot policy would cost on real spot traces, next to the simulator's policies.

`burstctl simulate` gives a policy every tick of a trace and lets it move between spot and on-demand at will. The
daemon (`orchestrator/lifecycle/market_switch.py`) may see less and do less. Where spot is seen only by launching
(EC2):
- it learns spot's state only from its own launches: an instance that came up, a preemption, a launch refused for
  lack of capacity (`orchestrator/core/spot_watch.py`, with the configured priors);
- while the job waits for spot it retries a spot launch after a refusal once a tenth of the outage so far has
  passed (`spot_watch.probe_after_s`: 60 s to `daemon.spot_probe_max_s`; here rounded up to whole ticks), and each
  refusal is a sighting;
- on spot it asks once a minute (here: every tick) whether to move to on-demand;
- on on-demand, by default (`daemon.spot_probe_on_demand`), it probes spot on the same schedule whenever the plan
  would go back to spot were it up: a probe that comes up is kept and takes the job over on spot (make before
  break, `orchestrator/lifecycle/spot_probe.py`): the move is the replay's changeover into spot, nothing more.
  With probes off, on-demand is final: it cannot see spot come back.
Where the provider lists spot capacity (simcloud, Lambda-style), it sees spot every tick, may go back to spot, and
plans on `simulate`'s model fitted on the listing (`refit_stats` on `refit_ticks`' schedule, as
`market_switch.listed_model` does; here the listing is the trace itself, seen from its start, and the other traces
are the provider's other listed types).
This script replays those shells, with the daemon's own policy objects, sightings code and model fitting, by the
paper's replay semantics (`orchestrator.simulate.replay`), over the same random starts as `simulate`.

Run by hand from the repo root: `.venv/bin/python benchmarks/daemon_shell.py [--settings ab] [--starts 300]`.
Traces: Wu et al., "Can't Be Late: Optimizing Spot Instance Savings under Deadlines", NSDI 2024
(github.com/skypilot-org/spot-traces), read from ../shared/spot-traces.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from policies import JOB, SETTINGS, arguments  # the settings and options of benchmarks/policies.py

import orchestrator.core.spot_policy as spot_policy
from orchestrator.config import DaemonSettings
from orchestrator.config import Policy as PolicyConfig
from orchestrator.core.spot_policy import (
    DEFAULT_POLICY,
    POLICIES,
    AvailabilityStats,
    Market,
    SemiMarkovDP,
    SpotState,
)
from orchestrator.core.spot_watch import SpotLife, SpotView, probe_after_s, watch
from orchestrator.lifecycle.market_switch import DAEMON_POLICY, SEEING_POLICY
from orchestrator.simulate import (
    Trace,
    TraceHistory,
    load_traces,
    refit_stats,
    refit_ticks,
    replay,
    sample_starts,
    simulate,
    trace_short_window_chances,
)

# The daemon's defaults for the probe schedule.
PROBE_MIN_S, PROBE_MAX_S = DaemonSettings().launch_backoff_s, DaemonSettings().spot_probe_max_s


class DaemonShell:
    """One run of a job through the daemon's shell: a fresh one per run (it remembers that run's sightings)."""

    name = "daemon-shell"

    def __init__(self, policy: SemiMarkovDP, prior_uptime_h: float, prior_outage_h: float, listed: bool,
                 fitted: Callable[[float], tuple[AvailabilityStats, float, int, float | None] | None] | None = None,
                 probes_on_od: bool = False, listings: Sequence[tuple[float, bool]] = ()) -> None:
        self.policy = policy
        self.probes_on_od = probes_on_od  # seen only by launching: probe spot while on on-demand
        self.fitted = fitted  # listed: the model fitted on the listing so far, by elapsed hours (None: memoryless)
        self.priors = (prior_uptime_h, prior_outage_h)
        self.listed = listed  # the provider lists spot capacity: seen every tick, and on-demand can be left
        self.lives: list[SpotLife] = []
        self.refusals: list[float] = []
        self.listings = list(listings)  # (since, up), seconds on the run's clock: what the store holds
        self.previous = Market.IDLE
        self.probe_at = 0.0  # no spot launch before this (seen only by launching: the daemon's probe schedule)

    def _end_life(self, now: float, preempted: bool) -> None:
        life = self.lives[-1]
        self.lives[-1] = SpotLife(life.started_at, now, preempted)

    def _refused(self, now: float, view: SpotView) -> None:
        """A spot launch (the probe) refused: a sighting, and the next probe after a tenth of the outage so far."""
        self.refusals.append(now)
        outage_h = view.state_for_h if view.known and not view.available else 0.0
        self.probe_at = now + probe_after_s(outage_h, PROBE_MIN_S, PROBE_MAX_S) - 1e-6

    def decide(self, s: SpotState) -> Market:
        now = s.elapsed_h * 3600.0
        if self.previous is Market.SPOT and s.market is Market.IDLE:
            self._end_life(now, preempted=True)
        if s.progress_h >= s.job_hours:
            return Market.IDLE
        if self.listed and (not self.listings or self.listings[-1][1] != s.spot_available):
            self.listings.append((now, s.spot_available))
        if s.market is Market.ON_DEMAND and not self.listed and not self.probes_on_od:
            return Market.ON_DEMAND
        view = watch(self.lives, self.refusals, now, tick_h=s.tick_h, prior_uptime_h=self.priors[0],
                     prior_outage_h=self.priors[1], listings=self.listings,
                     listed_now=s.spot_available if self.listed else None)
        fit = self.fitted(s.elapsed_h) if self.fitted is not None else None
        # A replay decides tick t knowing spot's state through its end, and the listing changed at its start: the
        # age the state is known to have reached is one tick more than since the change (the daemon, knowing spot
        # only up to now, is right to count from the change).
        age_h = view.state_for_h + (s.tick_h if self.listed and view.known else 0.0)
        seen = dataclasses.replace(s, spot_available=view.available if s.market is not Market.SPOT else True,
                                   spot_state_for_h=age_h, stats=fit[0] if fit else view.stats,
                                   recent_up_fraction=fit[1] if fit else 1.0, recent_changes=fit[2] if fit else 0,
                                   short_window_chance=fit[3] if fit and view.available else None)
        if s.market is Market.ON_DEMAND and not self.listed:
            # Would the plan go back to spot were it up now? Then a spot launch is the probe; one that comes up is
            # kept, and the job moves to it.
            if now < self.probe_at or self.policy.decide(dataclasses.replace(
                    seen, spot_available=True, spot_state_for_h=0.0)) is not Market.SPOT:
                action = Market.ON_DEMAND
            elif s.spot_available:
                self.lives.append(SpotLife(now, None, False))
                action = Market.SPOT
            else:
                self._refused(now, view)
                action = Market.ON_DEMAND
            self.previous = action
            return action
        choice = self.policy.decide(seen)
        if s.market is Market.ON_DEMAND:  # listed: back to spot when the plan says so
            action = Market.SPOT if choice is Market.SPOT and s.spot_available else Market.ON_DEMAND
            if action is Market.SPOT:
                self.lives.append(SpotLife(now, None, False))
        elif s.market is Market.SPOT:
            action = Market.ON_DEMAND if choice is Market.ON_DEMAND else Market.SPOT
            if action is Market.ON_DEMAND:
                self._end_life(now, preempted=False)
        elif choice is Market.ON_DEMAND:
            action = Market.ON_DEMAND
        elif not self.listed and now < self.probe_at:
            action = Market.IDLE  # the policy waits, and the next probe is not due
        elif s.spot_available:  # the launch (the probe where nothing is listed): spot came up
            action = Market.SPOT
            self.lives.append(SpotLife(now, None, False))
        else:
            if not self.listed:  # listed as gone: nothing launched, nothing refused
                self._refused(now, view)
            action = Market.IDLE
        self.previous = action
        return action


def _fitted_on_listing(trace: Trace, start: int, others: Sequence[tuple[Trace, TraceHistory]]
                       ) -> Callable[[float], tuple[AvailabilityStats, float, int, float | None] | None]:
    """What `market_switch.listed_model` gives the daemon, for a daemon that has watched this zone's listing (and
    the other listed types', `others`) since the trace began: `simulate`'s `refit_stats` on `refit_ticks`'
    schedule, the regime now, and the chance that the window spot is in is short (`listed_short_window_chance`:
    learned from the listing and the other listed types', as `simulate` learns it from traces on one clock)."""
    history = TraceHistory.of(trace.available, trace.gap_seconds)
    schedule = refit_ticks(len(trace), trace.gap_seconds / 3600.0)
    fits = _FITS.setdefault(trace.name, {})
    if trace.name not in _CHANCES:
        _CHANCES[trace.name] = trace_short_window_chances([trace, *(o for o, _ in others)],
                                                          SEEING_POLICY.short_window_h)[0]
    chances = _CHANCES[trace.name]

    def at(elapsed_h: float) -> tuple[AvailabilityStats, float, int, float | None] | None:
        t = start + round(elapsed_h * 3600.0 / trace.gap_seconds)
        refit = int(schedule[np.searchsorted(schedule, t, side="right") - 1])
        if refit <= 0:
            return None
        if refit not in fits:
            fits[refit] = refit_stats(trace, history, others, refit)
        now = min(t, len(trace) - 1)
        chance = float(chances[now])
        return (fits[refit], float(history.recent_up_fraction[now]), int(history.recent_changes[now]),
                None if np.isnan(chance) else chance)

    return at


_FITS: dict[str, dict[int, AvailabilityStats]] = {}
_CHANCES: dict[str, np.ndarray] = {}  # per trace (one set of `others` per process)


def _listed_before(trace: Trace, start: int) -> list[tuple[float, bool]]:
    """The listing's changes before the run's start tick, as the daemon's store holds them for a daemon that has
    watched since the trace began (times in seconds on the run's clock, so negative): spot's age at the start is
    known, as `simulate`'s policy knows it."""
    a = trace.available[:start].astype(bool)
    at = np.flatnonzero(np.concatenate(([True], a[1:] != a[:-1]))) if start > 0 else np.array([], dtype=np.int64)
    return [(float((i - start) * trace.gap_seconds), bool(a[i])) for i in at]


def _replay_trace(args: tuple[Trace, np.ndarray, SemiMarkovDP, str, float, float, Sequence[Trace]]
                  ) -> tuple[np.ndarray, int, float, float]:
    trace, starts, policy, sees, prior_up, prior_out, other_traces = args
    listed = not sees.startswith("launches")
    others = [(o, TraceHistory.of(o.available, o.gap_seconds)) for o in other_traces] if listed else []
    plans: dict[tuple, spot_policy.DPPlan] = {}

    def cached(*key: object) -> spot_policy.DPPlan:  # each process keeps every plan it made (models recur)
        if key not in plans:
            plans[key] = spot_policy.solve_plan(*key)  # type: ignore[arg-type]
        return plans[key]

    spot_policy.cached_plan = cached  # type: ignore[assignment]
    fitted = sees.startswith("listing, fitted")
    shells = [DaemonShell(policy, prior_up, prior_out, listed,
                          _fitted_on_listing(trace, int(s0), others) if fitted else None,
                          probes_on_od="probes" in sees, listings=_listed_before(trace, int(s0)) if fitted else ())
              for s0 in starts]
    runs = [replay(shell, trace, int(s0), JOB) for shell, s0 in zip(shells, starts, strict=True)]
    costs = np.array([r.cost_usd for r in runs])
    return (costs, sum(r.missed for r in runs),
            float(np.mean([r.spot_work_hours for r in runs])), float(np.mean([r.od_work_hours for r in runs])))


def main() -> None:
    ap = arguments()
    ap.add_argument("--shells", default="", help="comma-separated substrings: only the shells whose name has one")
    defaults = PolicyConfig()
    ap.add_argument("--prior-uptime-h", type=float, default=1.0 / defaults.spot_preemptions_per_hour,
                    help="the daemon's prior mean spot up-time (default: 1 / policy.spot_preemptions_per_hour)")
    ap.add_argument("--prior-outage-h", type=float, default=defaults.spot_mean_outage_hours,
                    help="the daemon's prior mean outage (default: policy.spot_mean_outage_hours)")
    args = ap.parse_args()
    prior_up, prior_out = args.prior_uptime_h, args.prior_outage_h
    shells = {
        "daemon shell, spot seen only by launching (EC2), probes off: on-demand is final": (DAEMON_POLICY, "launches"),
        "the same, planned as if it could leave on-demand": (POLICIES[DEFAULT_POLICY], "launches"),
        "daemon shell, spot seen only by launching, as shipped: spot probed while on on-demand": (
            SEEING_POLICY, "launches, probes"),
        "daemon shell, spot capacity listed (simcloud), memoryless model": (SEEING_POLICY, "listing"),
        "daemon shell, spot capacity listed, model fitted on its listing": (SEEING_POLICY, "listing, fitted"),
        "the same, shrunk towards the other listed types' past": (SEEING_POLICY, "listing, fitted, others"),
    }
    for key in args.settings:
        title, path, window = SETTINGS[key]
        traces = load_traces([path], window=window)
        t0 = time.perf_counter()
        report = simulate(traces, list(POLICIES), JOB, starts=args.starts, seed=args.seed).as_json(DEFAULT_POLICY)
        rng = np.random.default_rng(args.seed)  # the same starts as simulate's
        starts = [sample_starts(t, JOB, args.starts, rng) for t in traces]
        up = report["policies"]["uniform-progress"]["mean_cost_usd"]
        best = report["offline"]["mean_cost_usd"]
        print(f"\n### Setting ({key}): {title}; C=48 h, R=60 h, d=0.2 h, $3.06 OD / $0.9731 spot, "
              f"{args.starts} starts/trace, seed {args.seed}; daemon priors: up {prior_up:g} h, "
              f"outage {prior_out:g} h\n")
        print("| policy | mean cost $/run | OD work h | spot work h | misses | vs UP | UP's gap closed |")
        print("|---|---|---|---|---|---|---|")

        def row(name: str, cost: float, od: float, spot: float, misses: int, runs: int, up: float = up,
                best: float = best) -> None:
            print(f"| {name} | {cost:.2f} | {od:.2f} | {spot:.2f} | {misses}/{runs} | {cost / up:.3f} | "
                  f"{(up - cost) / (up - best):.1%} |")

        for name, p in report["policies"].items():
            row(name, p["mean_cost_usd"], p["od_work_hours"], p["spot_work_hours"], p["misses"], p["runs"])
        for name, (policy, sees) in shells.items():
            if args.shells and not any(part in name for part in args.shells.split(",")):
                continue
            with ProcessPoolExecutor(2) as pool:
                parts = list(pool.map(_replay_trace, [
                    (t, s, policy, sees, prior_up, prior_out,
                     [o for o in traces if o is not t and o.gap_seconds == t.gap_seconds] if "others" in sees else [])
                    for t, s in zip(traces, starts, strict=True)]))
            costs = np.concatenate([p[0] for p in parts])
            row(name, float(costs.mean()), float(np.mean([p[3] for p in parts])),
                float(np.mean([p[2] for p in parts])), sum(p[1] for p in parts), costs.shape[0])
        print(f"| offline optimum | {best:.2f} | | | | {best / up:.3f} | 100.0% |")
        print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
