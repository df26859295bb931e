"""The spot policy's plans as the daemon makes them: each plan's memory and CPU, against a baseline commit.

Run by hand from the repo root: `.venv/bin/python benchmarks/daemon_plans.py [--baseline REV] [--rounds 3]`.

The daemon asks the policy once a `daemon.market_check_s` (60 s), so it plans on a 1-minute tick, and keeps up to
`PLANS_CACHED` plans. For a few job shapes (C hours of work, R to the deadline, d of changeover) each tree plans with
a four-regime model at 10-minute ticks (the daemon's fitted model has four regimes: share × flicker, on listings
resampled to 10 minutes), in a child process of its own per round, baseline first. Printed: the plan's step, the
bytes it keeps (`DPPlan.nbytes`, its compressed rows; `packed` or `actions` in older trees), the CPU seconds of
`plan_for` (the fastest round), and the ratios against the baseline. The baseline is checked out into a temporary
`git worktree`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from baseline import baseline_tree  # benchmarks/baseline.py, beside this script

REPO = Path(__file__).resolve().parents[1]
BASELINE = "e95c7e1"  # the last commit before plans stepped a quarter of the changeover and packed their actions
JOBS = ((5.0, 12.0, 0.5), (10.0, 24.0, 0.5), (48.0, 60.0, 0.5), (2.0, 4.0, 0.1), (48.0, 60.0, 0.2))


def child(tree: str) -> None:
    """Plan every job shape with the `orchestrator` package of `tree`; print one JSON line per shape."""
    sys.path.insert(0, tree)
    import time

    from orchestrator.core.spot_policy import AGE_EDGES_H, AvailabilityStats, SemiMarkovDP, SpotModel

    n = len(AGE_EDGES_H) + 1
    leave = tuple(((0.1,) * n, (0.02 * (r + 1),) * n) for r in range(4))
    switch = tuple(tuple(0.97 if i == j else 0.01 for j in range(4)) for i in range(4))
    model = SpotModel(tick_h=1 / 6, leave=leave, regime_switch=switch)
    stats = AvailabilityStats(up_fraction=0.5, mean_outage_h=1.0, mean_uptime_h=1.0, observed_h=100.0, model=model)
    policy = SemiMarkovDP()
    for job_h, deadline_h, changeover_h in JOBS:
        t0 = time.process_time()
        plan = policy.plan_for(job_h, deadline_h, changeover_h, 1 / 60, 3.0, 1.0, stats)
        cpu = time.process_time() - t0
        # What the tree's plans keep: compressed rows, else the packed table, else the table (older trees)
        kept = plan.nbytes if hasattr(plan, "rows") else next(
            getattr(plan, name).nbytes for name in ("packed", "actions") if hasattr(plan, name))
        print(json.dumps({"job": [job_h, deadline_h, changeover_h], "step_min": plan.step_h * 60, "bytes": kept,
                          "cpu_s": cpu}))


def measure(tree: Path) -> list[dict]:
    out = subprocess.run([sys.executable, __file__, "--child", str(tree)], capture_output=True, text=True,
                         check=True, cwd=tree)
    return [json.loads(line) for line in out.stdout.splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=BASELINE, help="git revision to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    runs: dict[str, list[list[dict]]] = {"baseline": [], "now": []}
    with baseline_tree(args.baseline) as base:
        for _ in range(args.rounds):
            runs["baseline"].append(measure(base))
            runs["now"].append(measure(REPO))
    print(f"| C, R, d (h) | baseline {args.baseline}: step, MB, CPU s | now: step, MB, CPU s | memory | CPU |")
    print("|---|---|---|---|---|")
    for i, (job_h, deadline_h, changeover_h) in enumerate(JOBS):
        b = min((r[i] for r in runs["baseline"]), key=lambda x: x["cpu_s"])
        n = min((r[i] for r in runs["now"]), key=lambda x: x["cpu_s"])
        print(f"| {job_h:g}, {deadline_h:g}, {changeover_h:g} | {b['step_min']:.0f} min, {b['bytes'] / 1e6:.1f}, "
              f"{b['cpu_s']:.2f} | {n['step_min']:.0f} min, {n['bytes'] / 1e6:.1f}, {n['cpu_s']:.2f} | "
              f"{n['bytes'] / b['bytes']:.3f}× | {n['cpu_s'] / b['cpu_s']:.2f}× |")


if __name__ == "__main__":
    main()
