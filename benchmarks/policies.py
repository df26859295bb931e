"""Spot/on-demand policies side by side on the paper's settings, next to the paper's reference figures.

Run by hand from the repo root: `.venv/bin/python benchmarks/policies.py [--starts 300] [--may-move]`.
`--may-move` replays a job that may move between the zones of its instance type (docs/simulate.md), against the
offline optimum of that problem, beside the pinned figures of the same starts.
Traces and reference figures: Wu et al., "Can't Be Late: Optimizing Spot Instance Savings under Deadlines",
NSDI 2024 (github.com/skypilot-org/spot-traces), read from ../shared/spot-traces.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from orchestrator.core.spot_policy import DEFAULT_POLICY, POLICIES
from orchestrator.simulate import JobSetting, load_traces, simulate

TRACES = Path(__file__).resolve().parents[2] / "shared" / "spot-traces" / "availability" / "1-node"
JOB = JobSetting(job_hours=48, deadline_hours=60, changeover_hours=0.2, od_price=3.06, spot_price=0.9731)
# Table 3 of the paper, setting (a): (on-demand h, spot h).
PAPER = {"greedy": (30.8, 17.2), "uniform-progress": (25.1, 22.9), "offline": (20.7, 27.4)}
SETTINGS = {
    "a": ("8 aws-10-26-2022 traces, first 1781 ticks", TRACES / "aws-10-26-2022", 1781),
    "b": ("9 aws-02-15-2023 traces, whole", TRACES / "aws-02-15-2023", None),
}


def arguments() -> argparse.ArgumentParser:
    """The options every replay benchmark takes (daemon_shell.py adds its own)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settings", default="ab")
    return ap


def main() -> None:
    ap = arguments()
    ap.add_argument("--may-move", action="store_true", help="the job may move between the zones of its instance")
    ap.add_argument("--exact-offline", action="store_true",
                    help="the exact offline optimum where the default gives a lower bound (setting (b): ~10x its CPU)")
    args = ap.parse_args()
    for key in args.settings:
        title, path, window = SETTINGS[key]
        traces = load_traces([path], window=window)
        t0 = time.perf_counter()
        r = simulate(traces, list(POLICIES), JOB, starts=args.starts, seed=args.seed, may_move=args.may_move,
                     exact_offline=args.exact_offline)
        took = time.perf_counter() - t0
        doc = r.as_json(DEFAULT_POLICY)
        off = doc["offline"]
        moving = ", the job may move between the zones of its instance type" if args.may_move else ""
        print(f"\n### Setting ({key}){moving}: {title}; C=48 h, R=60 h, d=0.2 h, $3.06 OD / $0.9731 spot, "
              f"{args.starts} starts/trace, seed {args.seed} ({took:.0f} s)\n")
        print("| policy | mean cost $/run | savings vs OD | OD work h | spot work h | OD billed h | spot billed h "
              "| misses | ÷ offline | paper OD h / spot h |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, p in doc["policies"].items():
            paper = PAPER.get(name) if key == "a" and not args.may_move else None
            ref = f"{paper[0]} / {paper[1]}" if paper else "—"
            label = f"{name} (default)" if name == DEFAULT_POLICY else name
            print(f"| {label} | {p['mean_cost_usd']:.2f} | {p['mean_savings_vs_od']:.1%} | {p['od_work_hours']:.2f} "
                  f"| {p['spot_work_hours']:.2f} | {p['od_hours']:.2f} | {p['spot_hours']:.2f} "
                  f"| {p['misses']}/{p['runs']} | {p['ratio_to_offline']:.3f} | {ref} |")
        kind = "exact DP" if off["exact"] else "DP lower bound"
        ref = f"{PAPER['offline'][0]} / {PAPER['offline'][1]}" if key == "a" and not args.may_move else "—"
        print(f"| offline optimum ({kind}) | {off['mean_cost_usd']:.2f} | | | | | | | 1.000 | {ref} |")
        print(f"| changeover-free bound | {off['availability_bound_usd']:.2f} | | | | | | | | |")
        up = doc["policies"]["uniform-progress"]["mean_cost_usd"]
        dflt = doc["policies"][DEFAULT_POLICY]["mean_cost_usd"]
        gap = up - off["mean_cost_usd"]
        print(f"\n{DEFAULT_POLICY} vs uniform-progress: {dflt - up:+.2f} $/run ({(dflt - up) / up:+.1%}); "
              f"closes {(up - dflt) / gap:.1%} of UP's gap to the offline optimum.")


if __name__ == "__main__":
    main()
