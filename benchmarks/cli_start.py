"""How long a `burstctl` command takes to start, against a bare `python -c pass`, and against a baseline commit.

    .venv/bin/python benchmarks/cli_start.py [--runs 15] [--baseline REV]

Each command runs in a fresh interpreter (`python -m orchestrator.cli`, PYTHONPATH at its tree) on a state directory
of its tree's own with the three seed jobs queued (`examples/seed/`, enqueued untimed), so the command's own work is
small and the figures are mostly what it imports. Printed: the median wall and CPU time of each, its ratio to
`python -c pass` (the interpreter's own start) and, with `--baseline`, the same for the baseline (checked out into a
temporary `git worktree`) and the ratio now / baseline. All cases of both trees are interleaved run by run: the
machine is shared and noisy.

Before commands imported lazily (7ed8532), every command, --version and --help included, loaded SQLAlchemy, the
config's pydantic models, structlog (and rich's tracebacks under it), rich and the providers' base module, `status`
the daemon's scheduler too: `--help` took 22× the CPU of `python -c pass`, `list` 24.5× (figures in
benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baseline import baseline_tree  # benchmarks/baseline.py, beside this script

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "examples" / "seed"
JOB = str(SEED / "b-full-grpo-7b.toml")
BASE = "python -c pass (baseline)"


def timed(argv: list[str], tree: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one child process running `tree`'s code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, cwd=tree, env=env_of(tree))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def env_of(tree: Path) -> dict[str, str]:
    """`python -m` puts the working directory first on the path, PYTHONPATH next: both at `tree`, ahead of the
    editable install's finder."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def cases(tree: Path, state: Path) -> dict[str, list[str]]:
    """The commands timed, each with its tree's code and state; the first job queued is the one `show` shows."""
    env = env_of(tree)
    cli = [sys.executable, "-m", "orchestrator.cli", "--state-dir", str(state)]
    for job in sorted(SEED.glob("*.toml")):
        subprocess.run([*cli, "enqueue", str(job)], check=True, capture_output=True, cwd=tree, env=env)
    listed = subprocess.run([*cli, "list", "--json"], check=True, capture_output=True, text=True, cwd=tree,
                            env=env).stdout
    first = listed.split('"id": "', 1)[1].split('"', 1)[0]
    return {
        BASE: [sys.executable, "-c", "pass"],
        "burstctl --version": [*cli, "--version"],
        "burstctl --help": [*cli, "--help"],
        "burstctl status": [*cli, "status"],
        "burstctl list": [*cli, "list"],
        "burstctl show JOB": [*cli, "show", first],
        "burstctl size --model qwen2.5-7b": [*cli, "size", "--model", "qwen2.5-7b"],
        "burstctl decide b-full-grpo-7b.toml": [*cli, "decide", JOB],
    }


def measure(trees: dict[str, Path], runs: int) -> dict[str, dict[str, tuple[float, float]]]:
    """Per tree, per case: (median wall s, median CPU s)."""
    tmp = Path(tempfile.mkdtemp(prefix="burstctl-bench-"))
    plans = {label: cases(tree, tmp / label / "state") for label, tree in trees.items()}
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {
        label: {name: [] for name in argvs} for label, argvs in plans.items()}
    for _ in range(runs):
        for label, argvs in plans.items():
            for name, argv in argvs.items():
                samples[label][name].append(timed(argv, trees[label]))
    return {label: {name: (statistics.median(w for w, _ in got), statistics.median(c for _, c in got))
                    for name, got in by_case.items()} for label, by_case in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--baseline", default=None, help="git revision to compare with (e.g. HEAD~1)")
    args = ap.parse_args()
    print(f"{args.runs} runs each, interleaved; medians\n")
    if args.baseline is None:
        got = measure({"now": REPO}, args.runs)["now"]
        base_wall, base_cpu = got[BASE]
        print("| what | wall | CPU | wall / `python -c pass` | CPU / `python -c pass` |")
        print("|---|---|---|---|---|")
        for name, (wall, cpu) in got.items():
            print(f"| {name} | {wall:.3f} s | {cpu:.3f} s | {wall / base_wall:.1f} | {cpu / base_cpu:.1f} |")
        return
    with baseline_tree(args.baseline) as tree:
        got = measure({"baseline": tree, "now": REPO}, args.runs)
    print(f"baseline: {args.baseline}; the ratios to `python -c pass` use each tree's own runs of it\n")
    print("| what | baseline wall / CPU | now wall / CPU | CPU / `python -c pass`, baseline → now | now / baseline, "
          "wall / CPU |")
    print("|---|---|---|---|---|")
    for name in got["now"]:
        (bw, bc), (nw, nc) = got["baseline"][name], got["now"][name]
        b_pass, n_pass = got["baseline"][BASE][1], got["now"][BASE][1]
        print(f"| {name} | {bw:.3f} s / {bc:.3f} s | {nw:.3f} s / {nc:.3f} s | {bc / b_pass:.1f} → {nc / n_pass:.1f} "
              f"| {nw / bw:.2f} / {nc / bc:.2f} |")


if __name__ == "__main__":
    main()
