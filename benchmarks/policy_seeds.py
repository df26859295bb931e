"""How much of Uniform Progress's gap to the offline optimum the default closes, seed by seed (issue #6's aim).

One seed's 300 starts per trace tell the default's share of the gap to about ±0.7 points; this replays UP and the
default on several seeds (each seed its own starts, its own optimum) and prints each seed's share, their mean and
its standard error. Run by hand from the repo root:
`.venv/bin/python benchmarks/policy_seeds.py --settings a --seeds 10` (~70 s a seed on (a); (b) with
`--exact-offline`, ~10 min a seed).
"""

from __future__ import annotations

import argparse
import statistics
import time

from policies import JOB, SETTINGS

from orchestrator.core.spot_policy import DEFAULT_POLICY
from orchestrator.simulate import load_traces, simulate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="a")
    ap.add_argument("--seeds", type=int, default=10, help="seeds 0 .. N-1")
    ap.add_argument("--starts", type=int, default=300)
    ap.add_argument("--exact-offline", action="store_true", help="the exact optimum where the default gives a bound")
    args = ap.parse_args()
    for key in args.settings:
        title, path, window = SETTINGS[key]
        traces = load_traces([path], window=window)
        print(f"\n### Setting ({key}): {title}; {args.starts} starts/trace\n")
        print(f"| seed | UP $/run | {DEFAULT_POLICY} $/run | offline $/run | gap closed | misses | s |")
        print("|---|---|---|---|---|---|---|")
        shares = []
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            doc = simulate(traces, ["uniform-progress", DEFAULT_POLICY], JOB, starts=args.starts, seed=seed,
                           exact_offline=args.exact_offline).as_json(DEFAULT_POLICY)
            up, dflt = (doc["policies"][n] for n in ("uniform-progress", DEFAULT_POLICY))
            opt = doc["offline"]["mean_cost_usd"]
            shares.append((up["mean_cost_usd"] - dflt["mean_cost_usd"]) / (up["mean_cost_usd"] - opt))
            kind = "" if doc["offline"]["exact"] else " (bound)"
            print(f"| {seed} | {up['mean_cost_usd']:.2f} | {dflt['mean_cost_usd']:.2f} | {opt:.2f}{kind} "
                  f"| {shares[-1]:.1%} | {dflt['misses'] + up['misses']}/{dflt['runs'] + up['runs']} "
                  f"| {time.perf_counter() - t0:.0f} |", flush=True)
        spread = statistics.stdev(shares) / len(shares) ** 0.5 if len(shares) > 1 else float("nan")
        print(f"\n{DEFAULT_POLICY} closes {statistics.mean(shares):.1%} ± {spread:.1%} (standard error) of UP's gap "
              f"to the offline optimum over {len(shares)} seeds; {sum(s >= 0.5 for s in shares)} of them at 50 % "
              "or more.")


if __name__ == "__main__":
    main()
