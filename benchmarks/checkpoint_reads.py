"""What the daemon reads of multi-GB checkpoints it already has, before and after, same run (run by hand).

    .venv/bin/python benchmarks/checkpoint_reads.py [--gib 1.5] [--keep]

Three complete checkpoints of `--gib` / 3 random bytes each (one shard apiece, written with burst_checkpoint like a
trainer's) in a job's local store under a temporary state directory, cleaned up afterwards. Each variant runs in
its own child process, so its peak RSS (`wait4`) is its own; bytes read are `rchar` from /proc/self/io:
  - prune after a pull: `burst_checkpoint.prune(store, keep=3)` (what CloudSteps.pull did: hashes the newest three)
    against `checkpoints.prune_store` (sizes only: each was hashed as it arrived);
  - resume: `checkpoints.latest` then `burst_checkpoint.latest_complete` again inside `push_checkpoint` (before)
    against `checkpoints.latest` alone (after: push_checkpoint is handed the checkpoint it verified);
  - one arrival's verification (`verify_and_fsync` of a staged copy): the floor, a single read of the new one.
Files sit in the page cache (the machine has the RAM), so seconds are sha256's CPU, not the disk's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 2**20


def rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def child(variant: str, state: str) -> None:
    from orchestrator.config import Config
    from orchestrator.lifecycle import checkpoints
    from runbooks import burst_checkpoint
    from runbooks.checkpoint_transfer import verify_and_fsync

    cfg = Config.model_validate({"state": {"dir": state}})
    store = checkpoints.store_dir(cfg, "job")
    r0, t0 = rchar(), time.perf_counter()
    if variant == "prune, before (deep)":
        burst_checkpoint.prune(store, keep=checkpoints.KEEP)
    elif variant == "prune, after (prune_store)":
        checkpoints.prune_store(cfg, "job")
    elif variant == "resume, before (latest + push's latest_complete)":
        checkpoints.latest(cfg, "job")
        burst_checkpoint.latest_complete(store)
    elif variant == "resume, after (latest only)":
        checkpoints.latest(cfg, "job")
    elif variant == "arrival (verify_and_fsync)":
        newest = sorted(store.iterdir())[-1]
        staging = store / f".staging-{newest.name}"
        shutil.copytree(newest, staging, copy_function=os.link)
        r0, t0 = rchar(), time.perf_counter()
        verify_and_fsync(staging)
        shutil.rmtree(staging)
    print(json.dumps({"s": time.perf_counter() - t0, "read": rchar() - r0}))


def run(variant: str, state: str) -> tuple[float, int, float]:
    p = subprocess.Popen([sys.executable, __file__, "--child", variant, state], stdout=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert p.stdout is not None
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{variant}: failed")
    got = json.loads(out)
    return got["s"], got["read"], ru.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.5)
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from runbooks import burst_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="burstctl-ckpt-"))
    try:
        store = tmp / "state" / "checkpoints" / "job"
        shard = int(a.gib * 2**30 / 3)
        for step in (1, 2, 3):
            def writer(d: Path) -> None:
                with open(d / "model.safetensors", "wb") as f:
                    for _ in range(shard // (16 * MiB)):
                        f.write(os.urandom(16 * MiB))

            burst_checkpoint.write_checkpoint(store, f"step-{step:08d}", writer=writer)
        print(f"3 checkpoints of {shard / 2**30:.2f} GiB in {store}\n")
        print("| daemon-side step | seconds | read | peak RSS |")
        print("|---|---|---|---|")
        res = {}
        for variant in ("prune, before (deep)", "prune, after (prune_store)",
                        "resume, before (latest + push's latest_complete)", "resume, after (latest only)",
                        "arrival (verify_and_fsync)"):
            s, read, rss = res[variant] = run(variant, str(tmp / "state"))
            print(f"| {variant} | {s:.2f} s | {read / 2**30:.2f} GiB | {rss:.0f} MiB |", flush=True)
        pb, pa = res["prune, before (deep)"], res["prune, after (prune_store)"]
        rb, ra = res["resume, before (latest + push's latest_complete)"], res["resume, after (latest only)"]
        print(f"\nprune: {pa[0] / pb[0]:.3f}x the time, {pa[1] / max(pb[1], 1):.4f}x the bytes; "
              f"resume: {ra[0] / rb[0]:.2f}x the time, {ra[1] / max(rb[1], 1):.2f}x the bytes")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
