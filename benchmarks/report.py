"""What `burstctl report` costs as finished jobs pile up, against `burstctl list` in the same run (run by hand).

    .venv/bin/python benchmarks/report.py [--jobs 10000] [--runs 5]

A state of `--jobs` finished cloud jobs spread over 180 days is written once (a real decision from the decision core
for each, 1.3 attempts and a closed ledger charge per attempt). Then, interleaved, each command runs as a fresh
process: `list` (the baseline: the jobs not over and the newest 20 finished), `report` (this month: ~1/6 of the
jobs), `report --all --json` (every job), `report --all` (every job summed, the newest 20 drawn). Printed: median wall
and CPU seconds and the ratio to `list`'s. The report reads with three grouped queries whatever the number of jobs;
what grows is decoding each job's decision and the JSON it prints.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import insert

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.app import App  # noqa: E402
from orchestrator.core.budget import month_key  # noqa: E402
from orchestrator.queue import enqueue  # noqa: E402
from state import schema as s  # noqa: E402

DAY = 86400.0


def build(state: Path, jobs: int, seed: int) -> None:
    rng = random.Random(seed)
    app = App(state_dir_override=str(state))
    spec_file = state.parent / "job.toml"
    spec_file.write_text('name = "grpo"\ncommand = ["python", "train.py"]\nworkdir = "."\ndeadline_hours = 12\n'
                         'work_units = 1\nlocal_throughput = 0.033\nrented_throughput = { H100 = 0.17 }\n')
    template_id, _, _ = enqueue(app, str(spec_file))
    template = app.store.get_job(template_id)
    now = time.time()
    job_rows, attempt_rows, charges = [], [], []
    for i in range(jobs):
        end = now - rng.uniform(0, 180) * DAY
        job_id = f"b{i:07d}"
        job_rows.append({**{k: template[k] for k in ("kind", "verdict", "placement", "spec", "decision")},
                         "id": job_id, "name": f"job-{i % 50}", "state": "done", "approved": False,
                         "deadline_at": end + rng.uniform(-2, 6) * 3600, "created_at": end - 8 * 3600,
                         "updated_at": end})
        n = 2 if rng.random() < 0.3 else 1
        for k in range(1, n + 1):
            started, ended = end - (n - k + 1) * 3 * 3600, end - (n - k) * 3 * 3600
            attempt_rows.append({"id": f"{job_id}-a{k}", "job_id": job_id, "n": k, "where": "cloud",
                                 "state": "preempted" if k < n else "succeeded", "provider": "sim",
                                 "instance_type": "gpu_1x_h100", "market": "spot", "info": {},
                                 "created_at": started, "started_at": started, "ended_at": ended})
            charges.append({"month": month_key(started), "job_id": job_id, "attempt_id": f"{job_id}-a{k}",
                            "provider": "sim", "instance_type": "gpu_1x_h100", "market": "spot", "rate_usd_h": 1.0,
                            "started_at": started, "ended_at": ended, "billed_seconds": 3 * 3600.0,
                            "cost_usd": 3.0})
    with app.store.tx() as c:
        c.execute(insert(s.jobs), job_rows)
        c.execute(insert(s.attempts), attempt_rows)
        c.execute(insert(s.ledger), charges)
    app.close()


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one child process, its output thrown away."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{argv} failed: {p.stderr.read().decode() if p.stderr else status}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="burstctl-bench-report-") as tmp:
        state = Path(tmp) / "state"
        t0 = time.perf_counter()
        build(state, args.jobs, args.seed)
        print(f"{args.jobs} finished jobs written in {time.perf_counter() - t0:.1f} s")
        base = [sys.executable, "-m", "orchestrator.cli", "--state-dir", str(state)]
        commands = {"list (baseline)": ["list"], "report": ["report"], "report --all --json": ["report", "--all",
                    "--json"], "report --all": ["report", "--all"]}
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in commands}
        for _ in range(args.runs):  # interleaved: the machine's noise falls on every command alike
            for label, argv in commands.items():
                results[label].append(timed(base + argv))
        baseline = statistics.median(w for w, _ in results["list (baseline)"])
        print(f"{'command':<22} {'wall s':>8} {'CPU s':>8} {'× list':>8}")
        for label, runs in results.items():
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            print(f"{label:<22} {wall:>8.2f} {cpu:>8.2f} {wall / baseline:>7.2f}×")


if __name__ == "__main__":
    main()
