"""Preemption → running again, on simcloud (no boot delay unless `--boot-delay-s`), measured by hand.

    .venv/bin/python benchmarks/preemption_latency.py [--preemptions 5] [--ticks 0.5,1.0] [--notice-s 0]
    .venv/bin/python benchmarks/preemption_latency.py --baseline BASELINE_TREE [--rounds 3] [--preemptions 5] ...

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
With a notice (`--notice-s`) the daemon launches the next instance on it (make before break, a successor): its
launch and boot come before the reclaim, so `launch` is negative and `boot_ssh` overlaps the notice;
`--boot-delay-s` gives the boot something to overlap, as a real GPU instance's would.

`--baseline BASELINE_TREE`: this tree against another checkout (e.g. `git worktree add /tmp/base HEAD~1`), same
run. Each rehearsal runs in its own child process with PYTHONPATH and the working directory at its tree (the
rehearsal's daemon is `python -m orchestrator.cli`, which imports from its working directory first); `--rounds`
rounds, each one rehearsal per tick length per tree, alternating which tree goes first. Also reported: the size of
the run's env file on the instance (`job.env`, sent over the SSH session's stdin at every start and resume).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

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


def run(tick: float, n: int, notice_s: float, seed: int, boot_delay_s: float = 0.0) -> list[dict[str, float]]:
    from orchestrator.rehearse import RehearsalOptions, rehearse

    tmp = Path(tempfile.mkdtemp(prefix="burstctl-bench-latency-"))
    try:
        spec = job(tmp, steps=60 * (n + 1))  # ~6 s of training per attempt: every attempt lives to be preempted
        res = rehearse(spec, RehearsalOptions(preemptions=n, seed=seed, every_s=4.0, timeout_s=900,
                                              notice_s=notice_s, tick_s=tick, boot_delay_s=boot_delay_s),
                       say=lambda line: print(f"  {line}", file=sys.stderr))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"  tick {tick} s: {res.verdict}; {len(res.preemptions)} preemptions, instances left {res.instances_left}",
          file=sys.stderr)
    return [parts(p.as_dict()) for p in res.preemptions if p.resumed_at is not None]


def child(spec_json: str) -> None:
    """One rehearsal in this process, with whatever tree PYTHONPATH names: its rows as JSON on stdout."""
    spec = json.loads(spec_json)
    import orchestrator
    from orchestrator.remote import ssh

    tree = Path(spec["tree"])
    assert Path(orchestrator.__file__).resolve().is_relative_to(tree), (orchestrator.__file__, tree)
    assert Path.cwd().resolve() == tree, Path.cwd()  # where the rehearsal's `python -m orchestrator.cli` imports from
    # The rehearsal's throwaway directories (its own mkdtemp), watched for the instances' env files while they live.
    made: list[Path] = []
    mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args: Any, **kwargs: Any) -> str:
        d = mkdtemp(*args, **kwargs)
        made.append(Path(d))
        return d

    tempfile.mkdtemp = recording_mkdtemp  # type: ignore[assignment]
    env_sizes: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            for d in list(made):
                for f in d.glob("sim/instances/*/sandbox/burst/*/*/run/job.env"):
                    with contextlib.suppress(OSError):  # the instance went meanwhile
                        env_sizes.add(f.stat().st_size)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        rows = run(spec["tick"], spec["n"], spec["notice_s"], spec["seed"], spec.get("boot_delay_s", 0.0))
    finally:
        done.set()
        watcher.join()
    print(json.dumps({"rows": rows, "env_file_bytes": sorted(env_sizes), "stdin_64k": hasattr(ssh, "_Stdin")}))


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def against_baseline(args: argparse.Namespace, ticks: list[float]) -> None:
    trees = {"baseline": Path(args.baseline).resolve(), "this tree": REPO}
    print(f"# preemption → running, this tree ({REPO}) against {trees['baseline']}, {datetime.now(UTC):%Y-%m-%d}, "
          f"{args.rounds} rounds, {args.preemptions} preemptions per tick per tree, notice {args.notice_s} s, "
          f"simcloud boot delay {args.boot_delay_s} s\n")
    print("| round | tick | tree | latency median (min–max) | bootstrap | push workdir | push checkpoint | start "
          "| tick wait | env file |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows: dict[tuple[float, str], list[list[dict[str, float]]]] = {(t, label): [] for t in ticks for label in trees}
    env_bytes: dict[str, set[int]] = {label: set() for label in trees}
    for round_ in range(args.rounds):
        for tick in ticks:
            for label in (list(trees) if round_ % 2 == 0 else list(reversed(trees))):
                tree = trees[label]
                spec = {"tree": str(tree), "tick": tick, "n": args.preemptions, "notice_s": args.notice_s,
                        "seed": args.seed, "boot_delay_s": args.boot_delay_s}
                p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                                   check=True, stdout=subprocess.PIPE, cwd=tree,
                                   env={**os.environ, "PYTHONPATH": str(tree)})
                got = json.loads(p.stdout)
                rows[(tick, label)].append(got["rows"])
                env_bytes[label].update(got["env_file_bytes"])
                r = got["rows"]
                lat = [x["latency"] for x in r]
                print(f"| {round_ + 1} | {tick} s | {label} | "
                      + (f"{med(lat):.2f} s ({min(lat):.2f}–{max(lat):.2f}), {len(r)} resumes | " if r
                         else "no completed resume | ")
                      + " | ".join(f"{med([x[k] for x in r]):.2f} s" for k in
                                   ("bootstrap", "push_workdir", "push_checkpoint", "start", "tick_wait"))
                      + f" | {', '.join(map(str, got['env_file_bytes'])) or '?'} B |", flush=True)
    print("\nEvery resume of every round pooled, medians in seconds; ratio = this tree / baseline:\n")
    cols = ("latency", "sync", *PARTS)
    print("| tick | tree | rounds' latency medians | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for tick in ticks:
        pooled = {label: [x for r in rows[(tick, label)] for x in r] for label in trees}
        for label in trees:
            per_round = " / ".join(f"{med([x['latency'] for x in r]):.2f}" for r in rows[(tick, label)])
            print(f"| {tick} s | {label} | {per_round} | "
                  + " | ".join(f"{med([x[k] for x in pooled[label]]):.2f}" for k in cols) + " |")
        print(f"| {tick} s | **ratio** | | " + " | ".join(
            f"{med([x[k] for x in pooled['this tree']]) / med([x[k] for x in pooled['baseline']]):.2f}x"
            if med([x[k] for x in pooled["baseline"]]) > 0 else "–" for k in cols) + " |")
    print("\nenv file on the instance: " + "; ".join(
        f"{label} {', '.join(map(str, sorted(b))) or '?'} bytes" for label, b in env_bytes.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preemptions", type=int, default=5)
    ap.add_argument("--ticks", default="0.5,1.0", help="daemon tick lengths to measure, comma-separated (s)")
    ap.add_argument("--notice-s", type=float, default=0.0)
    ap.add_argument("--boot-delay-s", type=float, default=0.0,
                    help="simcloud's boot delay: with a notice, what make before break (a successor) overlaps")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline", metavar="BASELINE_TREE", help="measure this tree against this checkout, same run")
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline: rehearsals per tick and tree, alternating")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    sys.path.insert(0, str(REPO))
    if args.baseline:
        against_baseline(args, [float(x) for x in args.ticks.split(",")])
        return 0
    print(f"# preemption → running, {datetime.now(UTC):%Y-%m-%d}, {args.preemptions} preemptions per tick, "
          f"notice {args.notice_s} s, simcloud boot delay {args.boot_delay_s} s")
    print("| tick | latency median (min–max) | sync median | (latency − sync) / tick, median (max) | aim < 2 |")
    print("|---|---|---|---|---|")
    breakdown: dict[float, dict[str, float]] = {}
    for tick in (float(x) for x in args.ticks.split(",")):
        rows = run(tick, args.preemptions, args.notice_s, args.seed, args.boot_delay_s)
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
