"""How long a `burstctl` command takes to start, against importing every command module (what each command paid
before the command table loaded only the module of the command that runs).

    .venv/bin/python benchmarks/cli_start.py [--runs 15]

Each figure is the median wall and CPU time of a fresh interpreter, interleaved with the baseline in the same run
(the machine is shared and noisy). The state directory is a fresh empty one, so the command's own work is small.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ALL_COMMANDS = ("import pkgutil, importlib, orchestrator.cli; "
                "[importlib.import_module('orchestrator.cli.' + m.name) "
                "for m in pkgutil.iter_modules(orchestrator.cli.__path__) if m.name != '__main__']")


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="burstctl-bench-")) / "state"
    cli = [sys.executable, "-m", "orchestrator.cli", "--state-dir", str(state)]
    cases = {
        "import every command (baseline)": [sys.executable, "-c", ALL_COMMANDS],
        "burstctl list": [*cli, "list"],
        "burstctl status": [*cli, "status"],
        "burstctl events --limit 5": [*cli, "events", "--limit", "5"],
        "burstctl --help": [*cli, "--help"],
    }
    timed(cases["burstctl list"])  # creates the state directory and database once
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, argv in cases.items():
            samples[name].append(timed(argv))
    base_wall = statistics.median(w for w, _ in samples["import every command (baseline)"])
    base_cpu = statistics.median(c for _, c in samples["import every command (baseline)"])
    print(f"{args.runs} runs each, interleaved; medians\n")
    print("| what | wall | CPU | wall / baseline | CPU / baseline |")
    print("|---|---|---|---|---|")
    for name, got in samples.items():
        wall = statistics.median(w for w, _ in got)
        cpu = statistics.median(c for _, c in got)
        print(f"| {name} | {wall:.2f} s | {cpu:.2f} s | {wall / base_wall:.2f} | {cpu / base_cpu:.2f} |")


if __name__ == "__main__":
    main()
