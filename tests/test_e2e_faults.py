"""Sync faults driven end to end through the daemon (a real `burstctl daemon` process, simcloud with real sshd,
real rsync): the local rsync of a checkpoint pull SIGKILLed mid-transfer, and the local checkpoint disk full.

What must hold in both: a partial checkpoint is never visible to a resume nor reported as synced, the instance is
kept (training goes on, the pull is retried), the reason is recorded, and the job ends with a final checkpoint
bit-identical to an uninterrupted run's, with nothing left running. tests/test_sync.py covers the same faults at
the sync layer alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import load_config
from orchestrator.lifecycle import checkpoints
from orchestrator.remote.sync import STAGING_PREFIX
from providers.simcloud.ssh_backend import openssh_available
from runbooks import burst_checkpoint
from tests.conftest import child_processes, small_tmpfs
from tests.e2e import (
    REPO,
    Daemon,
    cli,
    enqueue,
    events,
    job,
    sim_admin,
    sim_instances,
    simcloud,
    trainer_job,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow
MiB = 1024 * 1024


def reference_final_files(tmp: Path, *, steps: int, every: int, shard_mib: int) -> dict[str, Any]:
    """The final checkpoint's manifest entries (size and sha256 of every file) of an uninterrupted local run."""
    ckpt = tmp / "reference" / "checkpoints"
    ckpt.mkdir(parents=True)
    env = {"BURST_CHECKPOINT_DIR": str(ckpt), "BURST_RESUME_FROM": "", "PYTHONPATH": str(REPO / "runbooks"),
           "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, str(REPO / "examples" / "trainer.py"), "--steps", str(steps),
                    "--checkpoint-every", str(every), "--shard-mib", str(shard_mib)], env=env, check=True,
                   timeout=120, capture_output=True, cwd=tmp / "reference")  # its result.json there
    files: dict[str, Any] = burst_checkpoint.read_manifest(ckpt / f"step-{steps:08d}")["files"]
    return files


def store_view(config: Path, state: Path, job_id: str) -> tuple[list[str], list[str], bool]:
    """What a resume would see in the job's local checkpoint store, read under the daemon's own store lock (so no
    pull or prune is half-way): the visible names, the hidden staging dirs, and whether every visible one verifies
    byte for byte against its manifest."""
    cfg = load_config(str(config), str(state))
    store = checkpoints.store_dir(cfg, job_id)
    with checkpoints.store_lock(cfg, job_id):
        names = sorted(os.listdir(store)) if store.is_dir() else []
        visible = [n for n in names if not n.startswith(".") and (store / n).is_dir()]
        staging = [n for n in names if n.startswith(STAGING_PREFIX)]
        return visible, staging, all(burst_checkpoint.verify(store / n) for n in visible)


def kill_a_pull_mid_transfer(daemon_pid: int, timeout: float) -> str:
    """SIGKILL the daemon's rsync of a checkpoint pull once at least 1 MiB of it has landed in the staging dir.
    Pulls that finish before that are let be; the next one is tried. Returns the checkpoint's name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid, argv in child_processes(daemon_pid, "rsync"):
            if not argv:  # it has just exited (a zombie): not a pull to kill
                continue
            dest = Path(argv[-1].rstrip("/"))  # rsync ... SRC/ STAGING/
            if not dest.name.startswith(STAGING_PREFIX):
                continue  # a push of the workdir or a checkpoint, not a pull
            while time.monotonic() < deadline:
                try:
                    landed = sum(p.stat().st_size for p in dest.iterdir() if p.is_file())
                except OSError:
                    landed = 0
                if landed >= MiB:
                    os.kill(pid, signal.SIGKILL)
                    return dest.name.removeprefix(STAGING_PREFIX)
                if not Path(f"/proc/{pid}").exists():
                    break  # this pull finished too quickly to catch; try the next one
                time.sleep(0.005)
        time.sleep(0.01)
    raise AssertionError(f"no checkpoint pull was caught mid-transfer within {timeout:.0f} s")


@pytest.mark.skipif(not openssh_available() or shutil.which("rsync") is None,
                    reason="needs sshd and rsync (simcloud's paramiko SSH falls back to SFTP)")
def test_rsync_killed_mid_pull_is_retried_and_the_partial_checkpoint_is_never_used(tmp_path: Path) -> None:
    steps, every, shard_mib = 40, 10, 128  # a 128 MiB shard: a pull over loopback SSH takes long enough to kill
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        # A 1 s tick leaves room to look at the store between the killed pull and its retry.
        config = write_config(tmp_path, url, daemon={"tick_s": 1.0})
        job_id = enqueue(config, state, trainer_job(tmp_path, "killed-pull", steps=steps, every=every, step_s=0.1,
                                                    shard_mib=shard_mib))
        daemon = Daemon(tmp_path, config, state).start()
        try:
            assert daemon.proc is not None
            killed = kill_a_pull_mid_transfer(daemon.proc.pid, 90)
            # The daemon holds the store lock until its pull has failed; the store is looked at right after.
            visible, staging, all_verify = store_view(config, state, job_id)
            wait_for(lambda: job(state, job_id)["state"] == "done", 120, "the job to finish")
        finally:
            assert daemon.stop() == 0
        instances = sim_instances(url)

    # Right after the kill: the half-pulled checkpoint is only a hidden staging dir; what a resume sees verifies.
    assert killed not in visible and f"{STAGING_PREFIX}{killed}" in staging, (killed, visible, staging)
    assert all_verify
    # The failed pull is on record, never reported as synced, and a later tick's pull brought checkpoints home.
    failed = [e for e in events(state, "checkpoint.sync_failed") if killed in e["data"]["error"]]
    assert failed and "killed by signal 9" in failed[0]["data"]["error"], failed
    synced = events(state, "checkpoint.synced")
    assert synced and all(e["id"] > failed[0]["id"] or killed not in e["data"]["checkpoints"] for e in synced)
    assert any(e["id"] > failed[0]["id"] for e in synced)
    # The job ran to the end on its one instance (nothing resumed, nothing left running)...
    assert [i["status"] for i in instances] == ["terminated"]
    assert not events(state, "instance.preempted")
    # ...and its final checkpoint is bit-identical to an uninterrupted run's, shard included; no staging is left.
    visible, staging, all_verify = store_view(config, state, job_id)
    final = state / "checkpoints" / job_id / f"step-{steps:08d}"
    assert final.name in visible and all_verify and staging == []
    assert burst_checkpoint.read_manifest(final)["files"] == reference_final_files(
        tmp_path, steps=steps, every=every, shard_mib=shard_mib)


def fill(directory: Path) -> Path:
    """Write a file until the filesystem is full (ENOSPC); it is what the operator deletes to free space."""
    filler = directory / "filler.bin"
    block = b"\0" * MiB
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as e:
            assert e.errno == 28, e  # ENOSPC
    return filler


def show(config: Path, state: Path, job_id: str) -> dict[str, Any]:
    r = cli(config, state, "show", job_id, "--json")
    assert r.returncode == 0, r.stderr
    data: dict[str, Any] = json.loads(r.stdout)
    return data


def live_attempt(config: Path, state: Path) -> dict[str, Any]:
    """The one live attempt, as `burstctl status --json` shows it; failing at once if it has ended."""
    r = cli(config, state, "status", "--json")
    assert r.returncode == 0, r.stderr
    attempts: list[dict[str, Any]] = json.loads(r.stdout)["attempts"]
    assert len(attempts) == 1, f"expected the attempt to be live, `status` shows {attempts}"
    return attempts[0]


def failures(attempt: dict[str, Any]) -> int:
    """How many pulls in a row failed, from `status`'s "N checkpoint pull(s) failed in a row: ..." problem."""
    return int(str(attempt["problem"]).split()[0])


def test_a_full_checkpoint_disk_keeps_the_instance_and_the_pull_retrying_until_space_is_freed(
        tmp_path: Path) -> None:
    steps, every, shard_mib = 60, 10, 8
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        job_id = enqueue(config, state, trainer_job(tmp_path, "disk-full", steps=steps, every=every, step_s=0.1,
                                                    shard_mib=shard_mib))
        # The job's checkpoint store is a 40 MiB filesystem, already full: room, once freed, for the three
        # checkpoints kept plus one being pulled.
        with small_tmpfs(state / "checkpoints" / job_id, 40) as store:
            filler = fill(store)
            daemon = Daemon(tmp_path, config, state).start()
            try:
                failed = wait_for(lambda: [e for e in events(state, "checkpoint.sync_failed")
                                           if "No space left on device" in e["data"]["error"]], 90,
                                  "a pull to fail on the full disk")[0]
                # The reason names the store and the cause, in `show` and in `status`.
                assert str(store) in failed["data"]["error"], failed
                reason = show(config, state, job_id)["reason"]
                assert "No space left on device" in reason and str(store) in reason, reason
                attempt = live_attempt(config, state)
                assert attempt["state"] in ("running", "finishing")
                assert "No space left on device" in (attempt["problem"] or ""), attempt
                assert "No space left on device" in " ".join(cli(config, state, "status").stdout.split())
                # The trainer finishes on the instance while nothing can come home: the attempt holds on to its
                # instance (the final checkpoint is only there) and keeps retrying, for as long as it takes.
                wait_for(lambda: live_attempt(config, state)["state"] == "finishing", 90,
                         "the trainer to finish on the instance")
                tried = failures(live_attempt(config, state))
                # Tried again after 2, 4, 8, then every 15 s (a sleep of 3 s saw none after the third failure).
                attempt = wait_for(lambda: next((a for a in [live_attempt(config, state)] if failures(a) > tried),
                                                None), 45, "the pull to be tried again")
                assert attempt["state"] == "finishing", (tried, attempt)
                assert job(state, job_id)["state"] == "running"
                assert [i["status"] for i in sim_instances(url)] == ["active"]  # simcloud speaks Lambda: running
                assert "No space left on device" in show(config, state, job_id)["reason"]
                visible, staging, _ = store_view(config, state, job_id)
                assert (visible, staging) == ([], []), "no checkpoint, and no half of one, on the full disk"

                filler.unlink()  # the operator frees space
                wait_for(lambda: job(state, job_id)["state"] == "done", 90, "the job to finish once space is free")
            finally:
                assert daemon.stop() == 0
            instances = sim_instances(url)
            visible, staging, all_verify = store_view(config, state, job_id)
            final_files = burst_checkpoint.read_manifest(store / f"step-{steps:08d}")["files"]

    assert [i["status"] for i in instances] == ["terminated"]
    assert not events(state, "instance.preempted")
    assert f"step-{steps:08d}" in visible and all_verify and staging == []
    assert final_files == reference_final_files(tmp_path, steps=steps, every=every, shard_mib=shard_mib)
    assert job(state, job_id)["reason"] == "completed"


def test_a_finished_attempt_whose_instance_is_reclaimed_before_its_final_pull_resumes_from_what_is_home(
        tmp_path: Path) -> None:
    steps, every, shard_mib = 30, 10, 8
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        job_id = enqueue(config, state, trainer_job(tmp_path, "disk-full-reclaimed", steps=steps, every=every,
                                                    step_s=0.1, shard_mib=shard_mib))
        with small_tmpfs(state / "checkpoints" / job_id, 40) as store:
            filler = fill(store)
            daemon = Daemon(tmp_path, config, state).start()
            try:
                wait_for(lambda: events(state, "checkpoint.sync_failed"), 90, "a pull to fail on the full disk")
                wait_for(lambda: live_attempt(config, state)["state"] == "finishing", 90,
                         "the trainer to finish on the instance while the disk is full")
                (first,) = [i["id"] for i in sim_instances(url)]
                sim_admin(url, f"instances/{first}/preempt", {})  # the only copy of the final checkpoint goes
                wait_for(lambda: events(state, "job.resuming"), 60, "the job to resume elsewhere")
                filler.unlink()
                wait_for(lambda: job(state, job_id)["state"] == "done", 120, "the job to finish on another instance")
            finally:
                assert daemon.stop() == 0
            instances = sim_instances(url)
            final_files = burst_checkpoint.read_manifest(store / f"step-{steps:08d}")["files"]

    lost = events(state, "instance.preempted")[0]["data"]
    assert lost["instance"] == first and lost["reason"] == "instance gone before its final checkpoint came home"
    assert len(instances) == 2 and all(i["status"] in ("terminated", "preempted") for i in instances)
    assert final_files == reference_final_files(tmp_path, steps=steps, every=every, shard_mib=shard_mib)
