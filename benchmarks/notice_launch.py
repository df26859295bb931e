"""How soon a spot interruption notice launches the job's next instance when the noticed instance holds a large
checkpoint not yet home: syncs inside the tick (`daemon.sync_workers = 0`, the baseline: the pull, then the launch)
against syncs beside it (the default, 4 threads: the pull starts, the launch follows at once), in the same run.

Run by hand (never in tests):  .venv/bin/python benchmarks/notice_launch.py [--rounds 2] [--ckpt-mib 1024]

Each round runs both modes, alternating which goes first: a fresh simcloud (real SSH on 127.0.0.1, real rsync) and
`burstctl daemon` (tick 1 s) with one job on spot whose trainer writes a checkpoint of --ckpt-mib MiB at step 5 and
is synced every 2.5 minutes. Once that checkpoint is written on the instance (and before any sync could bring it
home), the instance gets a notice (reclaim in 300 s, so nothing is lost to the reclaim itself). Measured from
posting the notice: when the next instance's `attempt.intent` is written (make before break, the point of launching
on the notice), and when the large checkpoint's `checkpoint.synced` is. Prints the medians and the ratios of the
default's to the baseline's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's tests.e2e helpers

from runbooks.burst_checkpoint import MANIFEST
from tests.e2e import Daemon, enqueue, events, simcloud, trainer_job, wait_for, write_config


def one_run(workers: int, ckpt_mib: int) -> tuple[float, float]:
    """(seconds to the next instance's launch, seconds to the large checkpoint home) with `workers` sync threads."""
    with tempfile.TemporaryDirectory(prefix="notice-launch-bench-") as scratch:
        tmp = Path(scratch)
        state = tmp / "state"
        with simcloud(tmp) as url:
            config = write_config(tmp, url, daemon={"tick_s": 1.0, "sync_workers": workers})
            job_id = enqueue(config, state, trainer_job(tmp, "large", steps=4000, every=5, step_s=1.0,
                                                        shard_mib=ckpt_mib, interval_minutes=5))
            daemon = Daemon(tmp, config, state).start()
            try:
                (inst,) = wait_for(lambda: [e["data"]["instance"] for e in events(state, "attempt.running")
                                            if e["job_id"] == job_id], 300, "the job to run")
                sandbox = tmp / "sim" / "instances" / inst / "sandbox"
                wait_for(lambda: any(sandbox.rglob(f"step-00000005/{MANIFEST}")), 120, "the large checkpoint",
                         interval=0.05)
                posted = time.time()
                httpx.post(f"{url}/_sim/instances/{inst}/notice", json={"seconds": 300}, timeout=10).raise_for_status()
                launched = wait_for(lambda: [e for e in events(state, "attempt.intent")
                                             if e["data"].get("successor_for")], 600, "the next instance's launch",
                                    interval=0.05)
                home = wait_for(lambda: [e for e in events(state, "checkpoint.synced") if e["job_id"] == job_id
                                         and "step-00000005" in e["data"]["checkpoints"]], 600,
                                "the large checkpoint home", interval=0.05)
            finally:
                daemon.stop()
    return launched[0]["ts"] - posted, home[0]["ts"] - posted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ckpt-mib", type=int, default=1024, help="the checkpoint's size (MiB)")
    args = parser.parse_args()
    runs: dict[int, list[tuple[float, float]]] = {0: [], 4: []}
    for r in range(args.rounds):
        for workers in ((0, 4) if r % 2 == 0 else (4, 0)):
            runs[workers].append(one_run(workers, args.ckpt_mib))
            launch, home = runs[workers][-1]
            print(f"round {r + 1}, sync_workers={workers}: next instance launched after {launch:.2f} s; the "
                  f"checkpoint home after {home:.2f} s", flush=True)
    launch_med = {w: statistics.median(x[0] for x in v) for w, v in runs.items()}
    home_med = {w: statistics.median(x[1] for x in v) for w, v in runs.items()}
    print(f"\n| sync_workers | notice → next instance launched, median s | notice → checkpoint home, median s "
          f"({args.ckpt_mib} MiB) |")
    print("|---|---|---|")
    for w in (0, 4):
        print(f"| {w}{' (baseline: in the tick)' if w == 0 else ' (default: beside it)'} | {launch_med[w]:.2f} | "
              f"{home_med[w]:.2f} |")
    print(f"\nratios, default / baseline: launch {launch_med[4] / launch_med[0]:.2f}x, checkpoint home "
          f"{home_med[4] / home_med[0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
