"""Checkpoint pull cost over loopback SSH: our pull_checkpoints vs plain `rsync -a` vs `cp -a`, in one run.

Run by hand (never in tests):  .venv/bin/python benchmarks/sync.py [--size-gib 2] [--shards 8] [--no-sftp]

A simcloud instance (OpenSSH sshd when installed, else the paramiko server) holds a checkpoint of N random
shards written with burst_checkpoint. We time:
  - ours, full: pull_checkpoints of the first checkpoint (transfer + sha256 verification + fsync + rename);
  - plain rsync -a of the same remote dir over the same pinned SSH command line, into a fresh dir;
  - cp -a of the same files (no SSH at all: the floor on this machine);
  - ours, incremental: a second checkpoint where the trainer rewrote every file but changed one shard;
and print throughputs, ratios, and incremental bytes moved vs one shard's size. Data sits in the page cache
(the box has enough RAM), so this measures CPU/protocol cost, not disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from orchestrator.remote.ssh import MemoryHostKeyTrust, Target, generate_keypair, rsync_ssh_command
from orchestrator.remote.sync import pull_checkpoints
from providers.simcloud.ssh_backend import SshBackend
from runbooks import burst_checkpoint

MiB = 1024 * 1024


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 16 * MiB)
            f.write(os.urandom(n))
            left -= n


def make_checkpoint(ckpt_dir: Path, name: str, shard_size: int, shards: int, *, reuse: Path | None = None,
                    changed: int | None = None) -> Path:
    def writer(tmp: Path) -> None:
        for i in range(shards):
            dest = tmp / f"model-{i:05d}-of-{shards:05d}.safetensors"
            if reuse is not None and i != changed:
                shutil.copyfile(reuse / dest.name, dest)  # same bytes, fresh mtime: what a trainer does
            else:
                write_random(dest, shard_size)

    return burst_checkpoint.write_checkpoint(ckpt_dir, name, writer=writer, meta={"step": int(name.split("-")[1])})


@dataclass(frozen=True)
class Loopback:
    """A simcloud instance on 127.0.0.1 and what it takes to reach it."""

    scratch: Path  # a temporary directory, removed afterwards
    mode: str  # the SSH server: OpenSSH when installed, else paramiko
    target: Target
    trust: MemoryHostKeyTrust
    sandbox: Path  # the instance's home directory, as this machine sees it


@contextmanager
def loopback_instance(scratch_in: str | None = None) -> Iterator[Loopback]:
    scratch = Path(tempfile.mkdtemp(prefix="burstctl-bench-", dir=scratch_in))
    backend = SshBackend(scratch / "simcloud")
    try:
        key = scratch / "keys" / "id_ed25519"
        ep = backend.start("i-bench", generate_keypair(key))
        assert ep.sandbox is not None
        yield Loopback(scratch, backend.mode, Target(ep.host, ep.port, ep.user, key, ep.host_key, "i-bench"),
                       MemoryHostKeyTrust(), Path(ep.sandbox))
    finally:
        backend.close()
        shutil.rmtree(scratch, ignore_errors=True)


def timed(fn: object, *args: object, **kwargs: object) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)  # type: ignore[operator]
    return time.perf_counter() - start, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size in GiB (default 2)")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--no-sftp", action="store_true", help="skip the SFTP transport (slow in pure Python)")
    parser.add_argument("--dir", default=None, help="scratch dir (default: a temp dir, removed afterwards)")
    args = parser.parse_args()

    shard_size = int(args.size_gib * 1024 * MiB) // args.shards
    total = shard_size * args.shards
    with loopback_instance(args.dir) as box:
        scratch, target, trust = box.scratch, box.target, box.trust
        remote_ckpt = box.sandbox / "ckpt"
        rsync_version = subprocess.run(["rsync", "--version"], capture_output=True, text=True).stdout.split()[2]
        print(f"server: {box.mode}; checkpoint: {args.shards} shards x {shard_size / MiB:.0f} MiB = "
              f"{total / MiB / 1024:.2f} GiB; rsync {rsync_version}; {os.cpu_count()} cores")
        first = make_checkpoint(remote_ckpt, "step-00000100", shard_size, args.shards)
        second_args = {"reuse": first, "changed": args.shards // 2}

        rows: list[tuple[str, float, int | None]] = []  # None: that tool does not report bytes
        t, got = timed(pull_checkpoints, target, trust, "ckpt", scratch / "ours-rsync", transport="rsync")
        rows.append(("ours rsync, full", t, got.stats.bytes_received))  # type: ignore[attr-defined]

        with rsync_ssh_command(target, trust) as rsh:
            plain = scratch / "plain-rsync"
            t, _ = timed(subprocess.run, ["rsync", "-a", "-e", rsh, f"{target.user}@{target.host}:ckpt/step-00000100/",
                                          f"{plain}/"], check=True)
        rows.append(("plain rsync -a, full", t, None))
        t, _ = timed(subprocess.run, ["cp", "-a", str(first), str(scratch / "cp-copy")], check=True)
        rows.append(("cp -a, full", t, None))
        if not args.no_sftp:
            t, got = timed(pull_checkpoints, target, trust, "ckpt", scratch / "ours-sftp", transport="sftp")
            rows.append(("ours sftp, full", t, got.stats.bytes_received))  # type: ignore[attr-defined]

        make_checkpoint(remote_ckpt, "step-00000200", shard_size, args.shards, **second_args)  # type: ignore[arg-type]
        t, got = timed(pull_checkpoints, target, trust, "ckpt", scratch / "ours-rsync", transport="rsync")
        inc_rsync = got.stats.bytes_received  # type: ignore[attr-defined]
        rows.append(("ours rsync, incremental (1 shard changed)", t, inc_rsync))
        if not args.no_sftp:
            t, got = timed(pull_checkpoints, target, trust, "ckpt", scratch / "ours-sftp", transport="sftp")
            inc_sftp = got.stats.bytes_received  # type: ignore[attr-defined]
            rows.append(("ours sftp, incremental (1 shard changed)", t, inc_sftp))

        print("\n| run | seconds | MiB received (measured) | checkpoint MiB/s |\n|---|---:|---:|---:|")
        for label, seconds, moved in rows:
            received = "—" if moved is None else f"{moved / MiB:.1f}"
            print(f"| {label} | {seconds:.2f} | {received} | {total / MiB / seconds:.0f} |")
        ours, plain_t, cp_t = rows[0][1], rows[1][1], rows[2][1]
        print(f"\nours rsync / plain rsync throughput: {plain_t / ours:.2f}")
        print(f"ours rsync / cp throughput: {cp_t / ours:.2f}")
        print(f"incremental rsync bytes received / shard size: {inc_rsync / shard_size:.3f}")
        if not args.no_sftp:
            print(f"incremental sftp bytes received / shard size: {inc_sftp / shard_size:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
