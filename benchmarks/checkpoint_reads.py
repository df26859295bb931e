"""What the daemon reads of multi-GB checkpoints it already has, before and after, same run (run by hand).

    .venv/bin/python benchmarks/checkpoint_reads.py [--gib 1.5] [--keep]
    .venv/bin/python benchmarks/checkpoint_reads.py --pull BASELINE_TREE [--gib 1.0] [--shards 8] [--rounds 2]
    .venv/bin/python benchmarks/checkpoint_reads.py --push BASELINE_TREE [--gib 1.0] [--shards 8] [--rounds 2]

Three complete checkpoints of `--gib` / 3 random bytes each (one shard apiece, written with burst_checkpoint like a
trainer's) in a job's local store under a temporary state directory, cleaned up afterwards. Each variant runs in
its own child process, so its peak RSS (`wait4`) is its own; bytes read are `rchar` from /proc/self/io:
  - prune after a pull: `burst_checkpoint.prune(store, keep=3)` (what CloudSteps.pull did: hashes the newest three)
    against `checkpoints.prune_store` (sizes only: each was hashed as it arrived);
  - resume: `checkpoints.latest` then `burst_checkpoint.latest_complete` again inside `push_checkpoint` (before)
    against `checkpoints.latest` alone (after: push_checkpoint is handed the checkpoint it verified);
  - one arrival's verification (`verify_and_fsync` of a staged copy): the floor, a single read of the new one.
Files sit in the page cache (the machine has the RAM), so seconds are sha256's CPU, not the disk's.

`--pull BASELINE_TREE`: a pull with a basis, this tree against another checkout (e.g. `git worktree add /tmp/base
HEAD~1`), each in its own child process with PYTHONPATH at its tree. A simcloud instance (OpenSSH sshd, a child of
this process) holds checkpoint step 1 and step 2 of `--gib` each in `--shards` shards; the local store holds step 1
(the basis); the child pulls step 2 over rsync, first with one shard changed, then with every shard changed (a
full fine-tune). Local bytes read: `rchar` of the pulling process, which includes its reaped children (rsync, ssh);
remote: the `rchar` sshd's process tree added (its reaped sessions, the remote rsync among them). `rchar` counts
every read(2), pipes and sockets too, so the transferred bytes are in both figures about twice (ssh, rsync).

`--push BASELINE_TREE`: the other way, as a resume does it (`push_checkpoint(checkpoint=...)`, the runbooks on the
instance as bootstrap leaves them): the local store holds step 1 and step 2, and the child pushes step 2 onto a
fresh instance (nothing there), then onto one holding step 1 with one shard changed, then with every shard changed.
Same counters; the remote side's include `checkpoint_transfer.py`'s Python start (a few MB of modules).
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


def transfer_child(spec_json: str) -> None:
    from orchestrator.remote import sync
    from orchestrator.remote.ssh import MemoryHostKeyTrust, Target

    spec = json.loads(spec_json)
    target = Target(spec["host"], spec["port"], spec["user"], Path(spec["key"]), spec["host_key"], "i-bench")
    r0, t0 = rchar(), time.perf_counter()
    if spec["direction"] == "pull":
        got = sync.pull_checkpoints(target, MemoryHostKeyTrust(), "ckpt", spec["store"], transport="rsync")
        assert [p.name for p in got] == ["step-00000002"] and not got.rejected, (got, got.rejected)
        moved = got.stats.bytes_received
    else:
        # A baseline tree from before the push compared manifests has no InstanceRunbooks.
        runbooks = getattr(sync, "InstanceRunbooks", None)
        kwargs = {"runbooks": runbooks("runbooks", sys.executable)} if runbooks is not None else {}
        pushed = sync.push_checkpoint(target, MemoryHostKeyTrust(), spec["store"], "ckpt", transport="rsync",
                                      checkpoint=Path(spec["store"]) / "step-00000002", **kwargs)
        assert pushed is not None and not pushed.already_there, pushed
        moved = pushed.stats.bytes_sent
    print(json.dumps({"s": time.perf_counter() - t0, "read": rchar() - r0, "moved": moved}))


def proc_rchar(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def transfer_bench(a: argparse.Namespace, tmp: Path, direction: str, baseline: str) -> None:
    from orchestrator.remote.ssh import generate_keypair
    from providers.simcloud.ssh_backend import SshBackend
    from runbooks import burst_checkpoint

    key = tmp / "keys" / "id_ed25519"
    generate_keypair(key)
    backend = SshBackend(tmp / "simcloud", prefer="openssh")
    this_tree = Path(__file__).resolve().parents[1]
    try:
        ep = backend.start("i-bench", Path(f"{key}.pub").read_text())
        sshd = backend._machines["i-bench"].sshd  # a benchmark: the remote side's reads
        assert sshd is not None and ep.sandbox is not None
        remote = Path(ep.sandbox) / "ckpt"
        (Path(ep.sandbox) / "runbooks").mkdir()
        for name in ("burst_checkpoint.py", "checkpoint_transfer.py"):  # what bootstrap puts there
            shutil.copy(this_tree / "runbooks" / name, Path(ep.sandbox) / "runbooks" / name)
        shard = int(a.gib * 2**30 / a.shards)
        names = [f"model-{i:05d}.safetensors" for i in range(a.shards)]
        step1 = {n: os.urandom(shard) for n in names}
        sender = remote if direction == "pull" else tmp / "home"
        burst_checkpoint.write_checkpoint(sender, "step-00000001", step1)
        trees = {"baseline": Path(baseline).resolve(), "this tree": this_tree}
        print(f"a {direction} of one {a.gib:.2f} GiB checkpoint ({a.shards} shards) over rsync\n")
        moved = "received" if direction == "pull" else "sent"
        print(f"| case | tree | seconds | read locally | read remotely | {moved} |")
        print("|---|---|---|---|---|---|")
        cases = [("1 shard changed", names[:1], True), ("every shard changed", names, True)]
        if direction == "push":
            cases.insert(0, ("fresh instance", names[:1], False))
        for case, changed, with_basis in cases:
            step2 = {n: (os.urandom(shard) if n in changed else step1[n]) for n in names}
            shutil.rmtree(sender / "step-00000002", ignore_errors=True)
            burst_checkpoint.write_checkpoint(sender, "step-00000002", step2)
            res: dict[str, list[dict]] = {label: [] for label in trees}
            for round_ in range(a.rounds):  # alternating which tree goes first
                for label in (list(trees) if round_ % 2 == 0 else list(reversed(trees))):
                    store = tmp / "home" if direction == "push" else tmp / f"store-{label.replace(' ', '-')}"
                    if direction == "pull":  # the receiving side holds step 1 (the basis), or nothing
                        shutil.rmtree(store, ignore_errors=True)
                        store.mkdir()
                        shutil.copytree(remote / "step-00000001", store / "step-00000001")
                    else:
                        shutil.rmtree(remote, ignore_errors=True)
                        remote.mkdir()
                        if with_basis:
                            shutil.copytree(store / "step-00000001", remote / "step-00000001")
                    spec = {"host": ep.host, "port": ep.port, "user": ep.user, "key": str(key),
                            "host_key": ep.host_key, "store": str(store), "direction": direction}
                    time.sleep(0.5)
                    remote0 = proc_rchar(sshd.pid)
                    p = subprocess.run([sys.executable, __file__, "--transfer-child", json.dumps(spec)], check=True,
                                       stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(trees[label])})
                    time.sleep(0.5)  # sshd reaps the session
                    got = json.loads(p.stdout)
                    got["remote"] = proc_rchar(sshd.pid) - remote0
                    receiver = store if direction == "pull" else remote
                    assert burst_checkpoint.verify(receiver / "step-00000002"), (case, label)
                    res[label].append(got)
                    print(f"| {case} | {label} | {got['s']:.2f} s | {got['read'] / 2**30:.2f} GiB | "
                          f"{got['remote'] / 2**30:.2f} GiB | {got['moved'] / 2**30:.3f} GiB |", flush=True)
                    if direction == "pull":
                        shutil.rmtree(store)
            b, t = ({k: sum(r[k] for r in res[label]) / a.rounds for k in ("s", "read", "remote", "moved")}
                    for label in ("baseline", "this tree"))
            print(f"| {case}: this tree / baseline, means | | {t['s'] / b['s']:.2f}x | {t['read'] / b['read']:.2f}x | "
                  f"{t['remote'] / max(b['remote'], 1):.2f}x | {t['moved'] / max(b['moved'], 1):.2f}x |")
    finally:
        backend.close()


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
    ap.add_argument("--pull", metavar="BASELINE_TREE", help="measure a pull against this checkout instead")
    ap.add_argument("--push", metavar="BASELINE_TREE", help="measure a push against this checkout instead")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2,
                    help="transfers per tree and case, alternating which goes first")
    ap.add_argument("--transfer-child")
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    if a.transfer_child:
        transfer_child(a.transfer_child)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from runbooks import burst_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="burstctl-ckpt-"))
    if a.pull or a.push:
        try:
            transfer_bench(a, tmp, "pull" if a.pull else "push", a.pull or a.push)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
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
