"""What bringing a job's `outputs` home adds to a sync that brings a new checkpoint: `pull_checkpoints` alone against
it followed by the outputs' pull, as the daemon does with each checkpoint that comes home (`Reconciler._pull` then
`_sync_outputs`: the globs listed by the instance's Python, then the files pulled, on the sync's connection).

Run by hand (never in tests):  .venv/bin/python benchmarks/sync_outputs.py [--rounds 10] [--ckpt-mib 64]

A simcloud instance (OpenSSH sshd when installed, else the paramiko server) writes a new checkpoint of --ckpt-mib
before each round, and its outputs, `runs/` (a TensorBoard-like events file per run growing by --log-kib a round,
and four of earlier runs) and `result.json`, change as a trainer's would. Each round times, in alternating order:
  - the sync alone: `pull_checkpoints(newest_only=True)` of the new checkpoint;
  - the sync and the outputs: the same, then the listing and the pull `CloudSteps.pull_outputs` makes.
Prints the medians and the ratio of the second to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from sync import loopback_instance  # benchmarks/sync.py

from orchestrator.lifecycle.cloud_steps import LIST_OUTPUTS
from orchestrator.remote import ssh, sync
from orchestrator.remote.ssh import MemoryHostKeyTrust, Target
from runbooks import burst_checkpoint

OUTPUTS = ["runs/", "result.json"]


def pull_outputs(target: Target, trust: MemoryHostKeyTrust, work: str, home: Path,
                 shared: ssh.SharedConnection) -> list[str]:
    """`CloudSteps.pull_outputs`, its calls as they are."""
    conn = shared.get()
    found = ssh.run(conn, [sys.executable, "-c", LIST_OUTPUTS, work, *OUTPUTS], timeout=120)
    names: list[str] = json.loads(found.stdout.strip().splitlines()[-1])
    if names:
        sync.pull_files(target, trust, work, names, home, conn=conn)
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ckpt-mib", type=float, default=64.0, help="each new checkpoint's size (MiB)")
    parser.add_argument("--log-kib", type=float, default=16.0, help="what the run's events file grows by a round")
    args = parser.parse_args()

    with loopback_instance() as box:
        scratch, target, trust, sandbox = box.scratch, box.target, box.trust, box.sandbox
        work = sandbox / "work"
        (work / "runs").mkdir(parents=True)
        for n in range(1, 5):  # earlier runs' files: unchanged, each sync looks at them
            (work / "runs" / f"run-attempt{n}.jsonl").write_bytes(os.urandom(256 * 1024))
        events = work / "runs" / "run-attempt5.jsonl"
        events.write_bytes(b"")
        print(f"server: {box.mode}; {args.rounds} rounds; a {args.ckpt_mib:g} MiB checkpoint a round; the events "
              f"file grows {args.log_kib:g} KiB a round; {os.cpu_count()} cores")
        size = int(args.ckpt_mib * 1024 * 1024)
        times: dict[bool, list[float]] = {False: [], True: []}
        step = 0

        def new_checkpoint() -> None:
            nonlocal step
            step += 1
            burst_checkpoint.write_checkpoint(sandbox / "ckpt", f"step-{step:08d}",
                                              writer=lambda tmp: (tmp / "model.bin").write_bytes(os.urandom(size)),
                                              meta={"step": step})
            with events.open("ab") as f:
                f.write(os.urandom(int(args.log_kib * 1024)))
            (work / "result.json").write_text(f'{{"step": {step}}}')

        for k in range(args.rounds):
            for with_outputs in ((True, False) if k % 2 else (False, True)):
                new_checkpoint()
                t = time.perf_counter()
                with ssh.SharedConnection(target, trust) as shared:
                    got = sync.pull_checkpoints(target, trust, "ckpt", scratch / "home" / "ckpt", newest_only=True,
                                                conn=shared.get())
                    assert got, "a new checkpoint each round"
                    if with_outputs:
                        names = pull_outputs(target, trust, str(work), scratch / "home" / "outputs", shared)
                        assert len(names) == 6
                times[with_outputs].append(time.perf_counter() - t)
        home = scratch / "home" / "outputs"
        assert (home / "runs" / events.name).stat().st_size > 0

        alone, both = (statistics.median(times[x]) for x in (False, True))
        print("\n| sync | median s | against the sync alone |\n|---|---:|---:|")
        print(f"| the new checkpoint alone | {alone:.3f} | 1.00 |")
        print(f"| the new checkpoint, then the outputs | {both:.3f} | {both / alone:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
