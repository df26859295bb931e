"""What bringing the logs home adds to a checkpoint sync: `pull_checkpoints` alone against it followed by the logs'
pull, as the daemon does at each sync (`Reconciler._sync_io`: the checkpoint, then `_logs_io`), in one run.

Run by hand (never in tests):  .venv/bin/python benchmarks/sync_logs.py [--rounds 20] [--log-kib 4]

A simcloud instance (OpenSSH sshd when installed, else the paramiko server) holds a small checkpoint that is
already home, so each checkpoint pull is what most syncs are: a look that finds nothing new. Between rounds the
trainer's stdout grows by --log-kib. Each round times, in alternating order, for checkpoints over rsync and over
SFTP:
  - the sync alone: `pull_checkpoints(newest_only=True)`;
  - the sync and the logs: the same, then the calls `CloudSteps.pull_logs` makes (the three run logs with append,
    then the setup log): over rsync (as two stops ago) or SFTP, on a connection of their own (as the stop before)
    or on the checkpoint pull's (as now), each connection's set-up included.
Prints the medians and each one's ratio to the sync alone.
"""

from __future__ import annotations

import argparse
import contextlib
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
              transport: sync.Transport, shared: ssh.SharedConnection | None = None) -> None:
    """`CloudSteps.pull_logs`, its calls as they are, with the transport pinned."""
    with contextlib.ExitStack() as stack:
        conn = shared.get() if shared is not None else stack.enter_context(ssh.connect(target, trust=trust))
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

        # (checkpoints' transport, logs' transport, one connection for both): the daemon pulls logs over SFTP on the
        # checkpoint pull's connection (`Reconciler` with `CloudSteps.shared_ssh`); the rest is how it was before.
        Case = tuple[sync.Transport, sync.Transport | None, bool]
        cases: list[Case] = [("rsync", None, False), ("rsync", "rsync", False), ("rsync", "sftp", False),
                             ("rsync", "sftp", True), ("sftp", None, False), ("sftp", "sftp", False),
                             ("sftp", "sftp", True)]
        times: dict[Case, list[float]] = {case: [] for case in cases}

        def one_sync(ckpt: sync.Transport, logs: sync.Transport | None, share: bool, newest_only: bool) -> bool:
            with ssh.SharedConnection(target, trust) as shared:
                got = sync.pull_checkpoints(target, trust, "ckpt", scratch / f"home-{ckpt}" / "ckpt",
                                            transport=ckpt, newest_only=newest_only,
                                            conn=shared.get() if share else None)
                if logs is not None:
                    pull_logs(target, trust, "run", "setup", scratch / f"home-{ckpt}-{logs}-{share}", logs,
                              shared if share else None)
            return bool(got)

        for case in cases:  # everything home once: the rounds measure what a later sync costs
            one_sync(*case, newest_only=False)
        for k in range(args.rounds):
            with open(run / supervisor.STDOUT_LOG, "ab") as f:
                f.write(growth)
            for case in cases[::-1] if k % 2 else cases:
                t = time.perf_counter()
                assert not one_sync(*case, newest_only=True), "the checkpoint is home: nothing new"
                times[case].append(time.perf_counter() - t)
        for ckpt, logs, share in cases:
            if logs is not None:
                home = scratch / f"home-{ckpt}-{logs}-{share}" / supervisor.STDOUT_LOG
                assert home.read_bytes() == (run / supervisor.STDOUT_LOG).read_bytes()

        print("\n| checkpoints over | logs over | median s a sync | against the sync alone |\n|---|---|---:|---:|")
        for ckpt, logs, share in cases:
            m = statistics.median(times[(ckpt, logs, share)])
            how = "(no logs)" if logs is None else f"{logs}, {'the same' if share else 'its own'} connection"
            print(f"| {ckpt} | {how} | {m:.3f} | {m / statistics.median(times[(ckpt, None, False)]):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
