"""How long a spot interruption notice waits to be seen while another job's large checkpoint comes home: syncs inside
the tick (`daemon.sync_workers = 0`, the baseline) against syncs beside it (the default, 4 threads), in the same run.

Run by hand (never in tests):  .venv/bin/python benchmarks/notice_during_pull.py [--rounds 2] [--ckpt-mib 1024]

Each round runs both modes, alternating which goes first: a fresh simcloud (real SSH on 127.0.0.1, real rsync) and
`burstctl daemon` (tick 1 s) with two jobs on spot. One writes a checkpoint of --ckpt-mib MiB every 40 s (the example
trainer's shard); the other, small, syncs every second. As soon as a pull of a large checkpoint begins (its staging
directory appears), the small job's instance gets an interruption notice, and the latency is the time from posting it
to the daemon's `instance.interruption_notice` event (the supervisor polls the notice every second: that part is the
same in both modes). Also printed: how long that large pull took (its `checkpoint.synced` seconds). Prints the medians
and the ratio of the default's to the baseline's.
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

from tests.e2e import Daemon, enqueue, events, pull_under_way, simcloud, trainer_job, wait_for, write_config


def one_run(workers: int, ckpt_mib: int) -> tuple[float, float]:
    """(notice latency s, the large pull's seconds) with `workers` sync threads."""
    with tempfile.TemporaryDirectory(prefix="notice-bench-") as scratch:
        tmp = Path(scratch)
        state = tmp / "state"
        with simcloud(tmp) as url:
            config = write_config(tmp, url, daemon={"tick_s": 1.0, "sync_workers": workers})
            large = enqueue(config, state, trainer_job(tmp, "large", steps=4000, every=40, step_s=1.0,
                                                       shard_mib=ckpt_mib, extra=("--keep", "2")))
            small = enqueue(config, state, trainer_job(tmp, "small", steps=40000, every=10, step_s=0.1))
            daemon = Daemon(tmp, config, state).start()
            try:
                wait_for(lambda: [e for e in events(state, "checkpoint.synced") if e["job_id"] == small], 300,
                         "the small job to sync")
                name = wait_for(lambda: pull_under_way(state, large), 600, "a large pull to begin", interval=0.02)
                (inst,) = [e["data"]["instance"] for e in events(state, "attempt.running") if e["job_id"] == small]
                posted = time.time()
                httpx.post(f"{url}/_sim/instances/{inst}/notice", json={"seconds": 300}, timeout=10).raise_for_status()
                seen = wait_for(lambda: [e for e in events(state, "instance.interruption_notice")
                                         if e["job_id"] == small], 600, "the notice to be seen", interval=0.05)
                home = wait_for(lambda: [e for e in events(state, "checkpoint.synced") if e["job_id"] == large
                                         and name in e["data"]["checkpoints"]], 600, "the large checkpoint home")
            finally:
                daemon.stop()
    return seen[0]["ts"] - posted, float(home[0]["data"]["seconds"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ckpt-mib", type=int, default=1024, help="the large job's checkpoint size (MiB)")
    args = parser.parse_args()
    runs: dict[int, list[tuple[float, float]]] = {0: [], 4: []}
    for r in range(args.rounds):
        for workers in ((0, 4) if r % 2 == 0 else (4, 0)):
            runs[workers].append(one_run(workers, args.ckpt_mib))
            latency, pull = runs[workers][-1]
            print(f"round {r + 1}, sync_workers={workers}: notice seen after {latency:.2f} s; the large pull "
                  f"took {pull:.2f} s", flush=True)
    med = {w: statistics.median(x[0] for x in v) for w, v in runs.items()}
    pulls = {w: statistics.median(x[1] for x in v) for w, v in runs.items()}
    print(f"\n| sync_workers | notice latency, median s | large pull, median s ({args.ckpt_mib} MiB) |")
    print("|---|---|---|")
    for w in (0, 4):
        print(f"| {w}{' (baseline: in the tick)' if w == 0 else ' (default: beside it)'} | {med[w]:.2f} | "
              f"{pulls[w]:.2f} |")
    print(f"\nratio of the notice latencies, default / baseline: {med[4] / med[0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
