"""How long `simulate` takes on the paper's settings, against a baseline commit measured in the same run.

Run by hand from the repo root: `.venv/bin/python benchmarks/simulate_speed.py [--baseline REV] [--settings ab]`.
The baseline is checked out into a temporary `git worktree`; each setting runs as a child process per tree (4
policies + offline optimum, 300 starts per trace, 2 worker processes), baseline first, then this tree. Wall and
CPU seconds (the child and its workers) are measured from outside, and the two JSON documents must be equal: the
speed must not change a figure. Traces: Wu et al., "Can't Be Late", NSDI 2024 (see benchmarks/policies.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from baseline import baseline_tree  # benchmarks/baseline.py, beside this script

REPO = Path(__file__).resolve().parents[1]
BASELINE = "b2f0f4d"  # the last commit before planning and the replay were made faster (docs/simulate.md)


def child(tree: str, setting: str, starts: int, seed: int, workers: int) -> None:
    """Run one setting with the `orchestrator` package of `tree`; print the JSON document."""
    sys.path.insert(0, tree)
    from orchestrator.core.spot_policy import DEFAULT_POLICY, POLICIES
    from orchestrator.simulate import JobSetting, load_traces, simulate

    job = JobSetting(job_hours=48, deadline_hours=60, changeover_hours=0.2, od_price=3.06, spot_price=0.9731)
    traces_dir = REPO.parent / "shared" / "spot-traces" / "availability" / "1-node"
    if setting == "a":
        traces = load_traces([traces_dir / "aws-10-26-2022"], window=1781)
    else:
        traces = load_traces([traces_dir / "aws-02-15-2023"])
    report = simulate(traces, list(POLICIES), job, starts=starts, seed=seed, workers=workers)
    print(json.dumps(report.as_json(DEFAULT_POLICY)))


def measure(tree: Path, setting: str, args: argparse.Namespace) -> tuple[float, float, dict]:
    """(wall s, CPU s of the child and its workers, JSON document) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", str(tree), "--settings", setting, "--starts",
                          str(args.starts), "--seed", str(args.seed), "--workers", str(args.workers)],
                         capture_output=True, text=True, check=True, cwd=tree)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=BASELINE, help="git revision to compare with")
    ap.add_argument("--settings", default="ab")
    ap.add_argument("--starts", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--child", metavar="TREE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.settings, args.starts, args.seed, args.workers)
        return
    with baseline_tree(args.baseline) as base:
        rows = []
        for setting in args.settings:
            b_wall, b_cpu, b_doc = measure(base, setting, args)
            n_wall, n_cpu, n_doc = measure(REPO, setting, args)
            same = b_doc["policies"] == n_doc["policies"] and b_doc["offline"] == n_doc["offline"]
            rows.append(f"| ({setting}) | {b_wall:.0f} s / {b_cpu:.0f} s | {n_wall:.1f} s / {n_cpu:.1f} s "
                        f"| {b_wall / n_wall:.1f}x / {b_cpu / n_cpu:.1f}x | {'yes' if same else 'NO'} |")
            print(rows[-1], file=sys.stderr)
    print(f"\n`simulate`, 4 policies + offline optimum, {args.starts} starts/trace, seed {args.seed}, "
          f"{args.workers} workers; baseline {args.baseline}\n")
    print("| setting | baseline wall / CPU | this tree wall / CPU | speed-up wall / CPU | same JSON figures |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
