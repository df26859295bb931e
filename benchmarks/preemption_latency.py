"""Preemption → running again, on simcloud with no boot delay, measured by hand.

    .venv/bin/python benchmarks/preemption_latency.py [--preemptions 5] [--ticks 0.5,1.0] [--notice-s 0]

For each daemon tick length it rehearses the example trainer (`orchestrator.rehearse`, the same machinery as
`burstctl rehearse`: a private simcloud and daemon as child processes, real SSH, real processes) with N
preemptions. A preemption is the reclaim (with `--notice-s 0` the notice is posted and the instance reclaimed at
once, so the daemon learns of it from the provider's state, not from the trainer's SIGTERM). Per preemption:

    latency  = the new attempt's `attempt.running` − the reclaim
    sync     = push_workdir + push_checkpoint (the data the new instance needs; grows with the checkpoint)
    ticks    = (latency − sync) / tick            the issue's aim: under 2 ticks plus the sync time

and its parts from the events' timestamps and the runbook's own timings: detect (reclaim → instance.preempted),
terminate (→ instance.terminated: the provider confirms the old instance gone), launch (→ instance.launched,
including the tick that schedules the new attempt), boot/SSH (→ instance.ready), then bootstrap, push workdir,
push checkpoint, start (the runbook steps, timed by the daemon), and the wait for the tick that runs them.
Ratios are against the tick measured in the same run; the machine is shared and noisy, so nothing is asserted.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.rehearse import RehearsalOptions, rehearse  # noqa: E402

PARTS = ("detect", "terminate", "launch", "boot_ssh", "tick_wait", "bootstrap", "push_workdir", "push_checkpoint",
         "start")


def job(tmp: Path, steps: int) -> Path:
    work = tmp / "work"
    work.mkdir()
    shutil.copy(REPO / "examples" / "trainer.py", work / "trainer.py")
    spec = tmp / "latency.toml"
    spec.write_text("\n".join([
        'name = "latency"',
        f'command = ["python3", "trainer.py", "--steps", "{steps}", "--checkpoint-every", "10", '
        '"--step-seconds", "0.1"]',
        'workdir = "work"', "deadline_hours = 10", "local_throughput = 0", "rented_throughput = { H100 = 1 }",
        "[checkpoint]", "interval_minutes = 0.02", ""]))
    return spec


def parts(p: dict) -> dict[str, float]:
    t, tm = p["timeline"], p["timings"]
    reclaim = t.get("reclaimed", 0.0)
    runbook = sum(tm.get(k, 0.0) for k in ("bootstrap", "push_workdir", "push_checkpoint", "start"))
    return {
        "latency": t["running"] - reclaim,
        "sync": tm.get("push_workdir", 0.0) + tm.get("push_checkpoint", 0.0),
        "detect": t["detected"] - reclaim, "terminate": t["terminated"] - t["detected"],
        "launch": t["launched"] - t["terminated"], "boot_ssh": t["ready"] - t["launched"],
        "tick_wait": t["running"] - t["ready"] - runbook,
        **{k: tm.get(k, 0.0) for k in ("bootstrap", "push_workdir", "push_checkpoint", "start")},
    }


def run(tick: float, n: int, notice_s: float, seed: int) -> list[dict[str, float]]:
    tmp = Path(tempfile.mkdtemp(prefix="burstctl-bench-latency-"))
    try:
        spec = job(tmp, steps=60 * (n + 1))  # ~6 s of training per attempt: every attempt lives to be preempted
        res = rehearse(spec, RehearsalOptions(preemptions=n, seed=seed, every_s=4.0, timeout_s=900,
                                              notice_s=notice_s, tick_s=tick, boot_delay_s=0.0),
                       say=lambda line: print(f"  {line}", file=sys.stderr))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"  tick {tick} s: {res.verdict}; {len(res.preemptions)} preemptions, instances left {res.instances_left}",
          file=sys.stderr)
    return [parts(p.as_dict()) for p in res.preemptions if p.resumed_at is not None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preemptions", type=int, default=5)
    ap.add_argument("--ticks", default="0.5,1.0", help="daemon tick lengths to measure, comma-separated (s)")
    ap.add_argument("--notice-s", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(f"# preemption → running, {datetime.now(UTC):%Y-%m-%d}, {args.preemptions} preemptions per tick, "
          f"notice {args.notice_s} s, simcloud boot delay 0")
    print("| tick | latency median (min–max) | sync median | (latency − sync) / tick, median (max) | aim < 2 |")
    print("|---|---|---|---|---|")
    breakdown: dict[float, dict[str, float]] = {}
    for tick in (float(x) for x in args.ticks.split(",")):
        rows = run(tick, args.preemptions, args.notice_s, args.seed)
        if not rows:
            print(f"| {tick} s | no completed resume | | | |")
            continue
        lat = [r["latency"] for r in rows]
        ticks = [(r["latency"] - r["sync"]) / tick for r in rows]
        med_ticks = statistics.median(ticks)
        print(f"| {tick} s | {statistics.median(lat):.2f} s ({min(lat):.2f}–{max(lat):.2f}) "
              f"| {statistics.median(r['sync'] for r in rows):.2f} s | {med_ticks:.1f} ({max(ticks):.1f}) "
              f"| {'met' if med_ticks < 2 else 'missed'} |")
        breakdown[tick] = {k: statistics.median(r[k] for r in rows) for k in PARTS}
    print()
    print("Parts, median seconds (and in ticks):")
    print("| tick | " + " | ".join(PARTS) + " |")
    print("|---|" + "---|" * len(PARTS))
    for tick, med in breakdown.items():
        print(f"| {tick} s | " + " | ".join(f"{med[k]:.2f} ({med[k] / tick:.1f})" for k in PARTS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
