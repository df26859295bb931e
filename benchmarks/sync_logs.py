"""What bringing the logs home adds to a checkpoint sync: `pull_checkpoints` alone against it followed by the logs'
pull, as the daemon does at each sync (`Reconciler._pull` then `_pull_logs`), in one run.

Run by hand (never in tests):  .venv/bin/python benchmarks/sync_logs.py [--rounds 20] [--log-kib 4]

A simcloud instance (OpenSSH sshd when installed, else the paramiko server) holds a small checkpoint that is
already home, so each checkpoint pull is what most syncs are: a look that finds nothing new. Between rounds the
trainer's stdout grows by --log-kib. Each round times, in alternating order, for checkpoints over rsync and over
SFTP:
  - the sync alone: `pull_checkpoints(newest_only=True)`;
  - the sync and the logs: the same, then the calls `CloudSteps.pull_logs` makes (one SSH connection; the three
    run logs with append, then the setup log) with that connection's set-up included, the logs over rsync (as
    before) or SFTP (as now).
Prints the medians and each one's ratio to the sync alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from sync import loopback_instance  # benchmarks/sync.py

from orchestrator.lifecycle.cloud_steps import LOG_FILES
from orchestrator.remote import ssh, sync
from orchestrator.remote.ssh import MemoryHostKeyTrust, Target
from runbooks import burst_checkpoint, supervisor


def pull_logs(target: Target, trust: MemoryHostKeyTrust, run_dir: str, setup_dir: str, local: Path,
              transport: sync.Transport) -> None:
    """`CloudSteps.pull_logs`, its calls as they are, with the transport pinned."""
    with ssh.connect(target, trust=trust) as conn:
        sync.pull_files(target, trust, run_dir, LOG_FILES, local, append=True, conn=conn, transport=transport)
        sync.pull_files(target, trust, setup_dir, [supervisor.SETUP_LOG], local, append=True, conn=conn,
                        transport=transport)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--log-kib", type=float, default=4.0, help="what stdout grows by between syncs (KiB)")
    args = parser.parse_args()

    with loopback_instance() as box:
        scratch, target, trust, sandbox = box.scratch, box.target, box.trust, box.sandbox
        burst_checkpoint.write_checkpoint(sandbox / "ckpt", "step-00000100",
                                          writer=lambda tmp: (tmp / "model.bin").write_bytes(os.urandom(1 << 20)),
                                          meta={"step": 100})
        run, setup = sandbox / "run", sandbox / "setup"
        run.mkdir()
        setup.mkdir()
        for name in LOG_FILES:
            (run / name).write_text("started\n")
        (setup / supervisor.SETUP_LOG).write_text("Successfully installed everything\n")
        line = b"step 1234 loss 2.345 lr 1e-4 tokens/s 12345\n"
        growth = line * max(1, int(args.log_kib * 1024 / len(line)))
        print(f"server: {box.mode}; {args.rounds} rounds; stdout grows {len(growth) / 1024:.1f} KiB a sync; "
              f"{os.cpu_count()} cores")

        # (checkpoints' transport, logs' transport): the daemon pulls logs over SFTP whatever carries checkpoints
        # (`CloudSteps.pull_logs`); logs over rsync is how it was before.
        cases: list[tuple[sync.Transport, sync.Transport | None]] = [
            ("rsync", None), ("rsync", "rsync"), ("rsync", "sftp"), ("sftp", None), ("sftp", "sftp")]
        times: dict[tuple[sync.Transport, sync.Transport | None], list[float]] = {case: [] for case in cases}
        for ckpt, logs in cases:  # everything home once: the rounds measure what a later sync costs
            sync.pull_checkpoints(target, trust, "ckpt", scratch / f"home-{ckpt}" / "ckpt", transport=ckpt)
            if logs is not None:
                pull_logs(target, trust, "run", "setup", scratch / f"home-{ckpt}-{logs}", logs)
        for k in range(args.rounds):
            with open(run / supervisor.STDOUT_LOG, "ab") as f:
                f.write(growth)
            for ckpt, logs in cases[::-1] if k % 2 else cases:
                t = time.perf_counter()
                got = sync.pull_checkpoints(target, trust, "ckpt", scratch / f"home-{ckpt}" / "ckpt",
                                            transport=ckpt, newest_only=True)
                assert not got, "the checkpoint is home: nothing new"
                if logs is not None:
                    pull_logs(target, trust, "run", "setup", scratch / f"home-{ckpt}-{logs}", logs)
                times[(ckpt, logs)].append(time.perf_counter() - t)
        for ckpt, logs in cases:
            if logs is not None:
                home = scratch / f"home-{ckpt}-{logs}" / supervisor.STDOUT_LOG
                assert home.read_bytes() == (run / supervisor.STDOUT_LOG).read_bytes()

        print("\n| checkpoints over | logs over | median s a sync | against the sync alone |\n|---|---|---:|---:|")
        for ckpt, logs in cases:
            m = statistics.median(times[(ckpt, logs)])
            print(f"| {ckpt} | {logs or '(no logs)'} | {m:.3f} | {m / statistics.median(times[(ckpt, None)]):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
