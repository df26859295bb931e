"""Workdir and checkpoint sync with a burst instance: rsync over SSH and SFTP, against real simcloud machines.

The instance's "trainer" writes checkpoints with `runbooks.burst_checkpoint` straight into the sandbox (the
instance's disk, on this machine); everything crossing between the two sides goes over real SSH.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.remote import sync
from orchestrator.remote.ssh import MemoryHostKeyTrust, Target, generate_keypair
from orchestrator.remote.ssh import connect as ssh_connect
from orchestrator.remote.sync import (
    STAGING_PREFIX,
    InstanceRunbooks,
    PulledCheckpoints,
    PushedCheckpoint,
    SyncError,
    SyncStats,
    choose_transport,
    pull_checkpoints,
    pull_files,
    push_checkpoint,
    push_dir,
)
from providers.simcloud.ssh_backend import SshBackend, openssh_available
from runbooks import burst_checkpoint
from tests.conftest import child_processes, small_tmpfs

pytestmark = pytest.mark.slow

HAVE_RSYNC = shutil.which("rsync") is not None and shutil.which("ssh") is not None
SERVERS = [pytest.param("openssh", marks=pytest.mark.skipif(not openssh_available(), reason="sshd not installed")),
           "paramiko"]
TRANSPORTS = [pytest.param("rsync", marks=pytest.mark.skipif(not HAVE_RSYNC, reason="rsync/ssh not installed")),
              "sftp"]
MiB = 1024 * 1024


@dataclass
class Instance:
    target: Target
    sandbox: Path
    trust: MemoryHostKeyTrust
    transport: str


@pytest.fixture(params=SERVERS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SshBackend]:
    b = SshBackend(tmp_path / "simcloud", prefer=request.param)
    yield b
    b.close()


@pytest.fixture
def key_path(tmp_path: Path) -> Path:
    path = tmp_path / "keys" / "id_ed25519"
    generate_keypair(path)
    return path


def start(backend: SshBackend, key_path: Path, instance_id: str, transport: str) -> Instance:
    ep = backend.start(instance_id, Path(f"{key_path}.pub").read_text())
    assert ep.sandbox is not None
    target = Target(ep.host, ep.port, ep.user, key_path, ep.host_key, instance_id)
    return Instance(target, Path(ep.sandbox), MemoryHostKeyTrust(), transport)


@pytest.fixture(params=TRANSPORTS)
def instance(request: pytest.FixtureRequest, backend: SshBackend, key_path: Path) -> Instance:
    return start(backend, key_path, "i-sync", request.param)


def pull(inst: Instance, local: Path, **kwargs: object) -> PulledCheckpoints:
    return pull_checkpoints(inst.target, inst.trust, "ckpt", local, transport=inst.transport,  # type: ignore[arg-type]
                            **kwargs)  # type: ignore[arg-type]


def shards(n: int, size: int) -> dict[str, bytes]:
    return {f"model-{i:05d}.safetensors": os.urandom(size) for i in range(n)}


def visible(directory: Path) -> list[str]:
    """What a resume would consider: non-hidden entries."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) if directory.exists() else []


def test_push_workdir_then_pull_checkpoints_round_trip(instance: Instance, tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    (workdir / "data").mkdir(parents=True)
    (workdir / "train.py").write_text("print('train')\n")
    (workdir / "data" / "tokens.bin").write_bytes(os.urandom(300_000))
    (workdir / ".venv").mkdir()
    (workdir / ".venv" / "big").write_bytes(b"x" * 1000)
    (workdir / "run.log").write_text("local log\n")

    pushed = push_dir(instance.target, instance.trust, workdir, "job/work", exclude=[".venv", "*.log"],
                      transport=instance.transport)  # type: ignore[arg-type]
    remote_work = instance.sandbox / "job" / "work"
    assert (remote_work / "train.py").read_text() == "print('train')\n"
    assert (remote_work / "data" / "tokens.bin").read_bytes() == (workdir / "data" / "tokens.bin").read_bytes()
    assert not (remote_work / ".venv").exists() and not (remote_work / "run.log").exists()
    assert pushed.transport == instance.transport and pushed.bytes_sent >= 300_000 and pushed.seconds > 0
    again = push_dir(instance.target, instance.trust, workdir, "job/work", exclude=[".venv", "*.log"],
                     transport=instance.transport)  # type: ignore[arg-type]
    assert again.files_transferred == 0  # unchanged files are not sent twice

    written = burst_checkpoint.write_checkpoint(instance.sandbox / "ckpt", "step-00000100",
                                                {"model.bin": os.urandom(200_000), "opt/adam.bin": b"m" * 5000},
                                                meta={"step": 100})
    local = tmp_path / "local-ckpt"
    got = pull(instance, local)
    assert got == [local / "step-00000100"]
    assert burst_checkpoint.verify(got[0])
    assert (got[0] / "opt" / "adam.bin").read_bytes() == (written / "opt" / "adam.bin").read_bytes()
    assert burst_checkpoint.read_manifest(got[0]) == burst_checkpoint.read_manifest(written)
    assert got.stats.transport == instance.transport and got.stats.bytes_received >= 205_000
    assert got.rejected == {}
    assert os.listdir(local) == ["step-00000100"]  # no staging left behind
    assert pull(instance, local) == []  # already complete locally: nothing to do


def test_a_workdir_pushed_to_an_absolute_path_is_created_from_the_deepest_folder_there(
        instance: Instance, tmp_path: Path) -> None:
    # The daemon pushes to the instance's home by its absolute path. The SFTP walker stat'ed every ancestor from `/`
    # on, which a server confined to a folder (the paramiko sandbox, an OpenSSH chroot) refuses: every burst's
    # bootstrap failed with "Permission denied" on a machine without OpenSSH's sshd.
    workdir = tmp_path / "work"
    (workdir / "src").mkdir(parents=True)
    (workdir / "src" / "train.py").write_text("print('train')\n")
    remote = instance.sandbox / "home" / "jobs" / "j1" / "work"
    pushed = push_dir(instance.target, instance.trust, workdir, str(remote),
                      transport=instance.transport)  # type: ignore[arg-type]
    assert (remote / "src" / "train.py").read_text() == "print('train')\n" and pushed.files_transferred >= 1


def test_push_checkpoint_sends_the_newest_complete_one_under_a_hidden_name_then_renames(
        backend: SshBackend, key_path: Path, tmp_path: Path) -> None:
    for transport in [p for p in ("rsync", "sftp") if p == "sftp" or HAVE_RSYNC]:
        inst = start(backend, key_path, f"i-resume-{transport}", transport)
        local = tmp_path / f"local-{transport}"
        assert push_checkpoint(inst.target, inst.trust, local, "ckpt", transport=transport) is None  # type: ignore[arg-type]
        burst_checkpoint.write_checkpoint(local, "step-00000100", {"w.bin": os.urandom(10_000)})
        burst_checkpoint.write_checkpoint(local, "step-00000200", {"w.bin": os.urandom(10_000)})
        (local / "step-00000300").mkdir()  # incomplete: no manifest
        (local / "step-00000300" / "w.bin").write_bytes(b"half")
        # An earlier push to this instance that never finished: superseded, so the push removes it.
        (inst.sandbox / "ckpt" / f"{STAGING_PREFIX}step-00000050").mkdir(parents=True)
        (inst.sandbox / "ckpt" / f"{STAGING_PREFIX}step-00000050" / "w.bin").write_bytes(b"half")

        pushed = push_checkpoint(inst.target, inst.trust, local, "ckpt", transport=transport)  # type: ignore[arg-type]
        assert pushed is not None and pushed.name == "step-00000200" and not pushed.already_there
        assert pushed.stats.bytes_sent >= 10_000
        remote = inst.sandbox / "ckpt"
        assert os.listdir(remote) == ["step-00000200"]
        assert burst_checkpoint.verify(remote / "step-00000200")
        again = push_checkpoint(inst.target, inst.trust, local, "ckpt", transport=transport)  # type: ignore[arg-type]
        assert again is not None and again.already_there and again.stats.bytes_moved == 0


def test_incremental_pull_moves_only_the_changed_shard(instance: Instance, tmp_path: Path) -> None:
    shard_size = 2 * MiB
    files = shards(4, shard_size)
    remote = instance.sandbox / "ckpt"
    burst_checkpoint.write_checkpoint(remote, "step-00000100", files)
    local = tmp_path / "local"
    first = pull(instance, local)
    assert first.stats.bytes_received >= 4 * shard_size

    # The trainer rewrites every file of the next checkpoint (fresh mtimes); only one shard's bytes changed.
    files["model-00002.safetensors"] = os.urandom(shard_size)
    burst_checkpoint.write_checkpoint(remote, "step-00000200", files)
    second = pull(instance, local)

    assert second.rejected == {}
    assert second == [local / "step-00000200"] and burst_checkpoint.verify(second[0])
    assert shard_size <= second.stats.bytes_received < 1.25 * shard_size
    assert second.stats.files_transferred == 1
    # Unchanged shards are hard links to the previous checkpoint's files: no second copy on disk either.
    same = (local / "step-00000100" / "model-00000.safetensors").stat().st_ino
    assert (local / "step-00000200" / "model-00000.safetensors").stat().st_ino == same


def test_logs_come_home_by_what_they_grew_and_one_not_written_yet_is_skipped(instance: Instance,
                                                                              tmp_path: Path) -> None:
    run = instance.sandbox / "job" / "run"
    run.mkdir(parents=True)
    lines = b"".join(b"step %d loss %.4f\n" % (i, 1 / (i + 1)) for i in range(40_000))  # ~0.8 MiB
    (run / "stdout.log").write_bytes(lines)
    (run / "supervisor.log").write_bytes(b"attempt 1 of job j: starting\n")
    local = tmp_path / "runs" / "j-a1"

    def logs() -> SyncStats:
        return pull_files(instance.target, instance.trust, "job/run", ["stdout.log", "stderr.log", "supervisor.log"],
                          local, append=True, transport=instance.transport)  # type: ignore[arg-type]

    first = logs()
    assert (local / "stdout.log").read_bytes() == lines and not (local / "stderr.log").exists()
    assert first.bytes_received >= len(lines)
    # The trainer prints on; the next pull brings the new lines, not the log again.
    with open(run / "stdout.log", "ab") as out:
        out.write(b"step 40000 loss 0.0000\n")
    (run / "stderr.log").write_bytes(b"Traceback: a warning\n")
    second = logs()
    assert (local / "stdout.log").read_bytes() == lines + b"step 40000 loss 0.0000\n"
    assert (local / "stderr.log").read_bytes() == b"Traceback: a warning\n"
    assert (local / "supervisor.log").read_bytes() == b"attempt 1 of job j: starting\n"
    assert second.bytes_received < 32 * 1024
    assert logs().files_transferred == 0


def test_named_files_come_home_under_their_paths_and_only_a_changed_one_crosses_again(instance: Instance,
                                                                                     tmp_path: Path) -> None:
    work = instance.sandbox / "job" / "work"
    (work / "eval").mkdir(parents=True)
    (work / "result.json").write_text('{"loss": 0.5}')
    (work / "eval" / "samples.bin").write_bytes(os.urandom(200_000))
    (work / "not-asked.txt").write_text("stays there")
    local = tmp_path / "outputs" / "j1"

    def outputs() -> SyncStats:
        return pull_files(instance.target, instance.trust, "job/work", ["result.json", "eval/samples.bin"], local,
                          transport=instance.transport)  # type: ignore[arg-type]

    first = outputs()
    assert (local / "result.json").read_text() == '{"loss": 0.5}' and not (local / "not-asked.txt").exists()
    assert (local / "eval" / "samples.bin").read_bytes() == (work / "eval" / "samples.bin").read_bytes()
    assert first.files_transferred == 2 and sorted(p.name for p in local.rglob("*")) == [
        "eval", "result.json", "samples.bin"]  # no temporary left behind
    assert outputs().files_transferred == 0
    (work / "result.json").write_text('{"loss": 0.25}')
    os.utime(work / "result.json", (1, 1))
    assert outputs().files_transferred == 1 and (local / "result.json").read_text() == '{"loss": 0.25}'


def test_remote_checkpoints_without_a_manifest_or_still_hidden_are_ignored(
        instance: Instance, tmp_path: Path) -> None:
    remote = instance.sandbox / "ckpt"
    burst_checkpoint.write_checkpoint(remote, "step-00000100", {"w.bin": b"complete"})
    (remote / "step-00000200").mkdir()  # the trainer died before writing the manifest
    (remote / "step-00000200" / "w.bin").write_bytes(b"partial")
    hidden = remote / ".tmp-step-00000300-4242"  # being written: manifest there, rename not done yet
    hidden.mkdir()
    (hidden / "manifest.json").write_text('{"files": {}}')
    local = tmp_path / "local"
    got = pull(instance, local)
    assert got == [local / "step-00000100"] and got.rejected == {}
    assert visible(local) == ["step-00000100"]


def test_a_corrupted_remote_file_fails_verification_and_is_never_made_visible(
        instance: Instance, tmp_path: Path) -> None:
    remote = instance.sandbox / "ckpt"
    burst_checkpoint.write_checkpoint(remote, "step-00000100", {"w.bin": b"a" * 50_000})
    bad = burst_checkpoint.write_checkpoint(remote, "step-00000200", {"w.bin": b"b" * 50_000})
    (bad / "w.bin").write_bytes(b"B" * 50_000)  # same size, different bytes: a bit rot or a torn write
    local = tmp_path / "local"
    got = pull(instance, local)
    assert got == [local / "step-00000100"]
    assert got.rejected == {"step-00000200": "a file's size or sha256 differs from the manifest"}
    assert os.listdir(local) == ["step-00000100"]  # nor is its staging dir kept


def test_a_remote_file_shorter_than_its_manifest_says_is_rejected_not_a_failed_pull(
        instance: Instance, tmp_path: Path) -> None:
    """Over SFTP the read-ahead asked for the manifest's size: a file torn after its manifest was written (shorter)
    failed the whole pull with an empty reason ("pulling checkpoint step-00000200 into ... failed: "), every sync,
    and the good checkpoint before it never came home either."""
    remote = instance.sandbox / "ckpt"
    burst_checkpoint.write_checkpoint(remote, "step-00000100", {"w.bin": b"a" * 50_000})
    torn = burst_checkpoint.write_checkpoint(remote, "step-00000200", {"w.bin": b"b" * 50_000})
    (torn / "w.bin").write_bytes(b"b" * 20_000)
    local = tmp_path / "local"
    got = pull(instance, local)
    assert got == [local / "step-00000100"]
    assert got.rejected == {"step-00000200": "a file's size or sha256 differs from the manifest"}
    assert os.listdir(local) == ["step-00000100"]


def test_a_newest_checkpoint_that_fails_verification_does_not_keep_the_one_before_it_from_coming_home(
        instance: Instance, tmp_path: Path) -> None:
    """The daemon pulls the newest only. When that one did not verify (a file torn or rotted after its manifest was
    written), it was rejected and nothing came home, sync after sync, so a preemption resumed from an older
    checkpoint, or from the start, though a good newer one was on the instance."""
    remote = instance.sandbox / "ckpt"
    burst_checkpoint.write_checkpoint(remote, "step-00000100", {"w.bin": b"a" * 50_000})
    burst_checkpoint.write_checkpoint(remote, "step-00000200", {"w.bin": b"b" * 50_000})
    torn = burst_checkpoint.write_checkpoint(remote, "step-00000300", {"w.bin": b"c" * 50_000})
    (torn / "w.bin").write_bytes(b"c" * 20_000)
    local = tmp_path / "local"
    got = pull(instance, local, newest_only=True)
    assert got == [local / "step-00000200"]  # the newest that verifies, and only it
    assert list(got.rejected) == ["step-00000300"]
    assert os.listdir(local) == ["step-00000200"]
    again = pull(instance, local, newest_only=True)  # step 200 home: nothing older is fetched
    assert again == [] and list(again.rejected) == ["step-00000300"]
    assert os.listdir(local) == ["step-00000200"]


def test_a_checkpoint_rejected_once_is_not_fetched_again_until_it_is_written_again(
        instance: Instance, tmp_path: Path) -> None:
    """A torn newest checkpoint stays on the instance: the daemon's next pull, every few minutes, fetched its GBs
    again before finding it wanting again. Passed over by its manifest's digest, only the manifest crosses; written
    again under its name (another manifest), it is fetched."""
    remote = instance.sandbox / "ckpt"
    burst_checkpoint.write_checkpoint(remote, "step-00000100", {"w.bin": b"a" * 50_000})
    torn = burst_checkpoint.write_checkpoint(remote, "step-00000200", shards(2, 1 * MiB))
    (torn / "model-00001.safetensors").write_bytes(os.urandom(1 * MiB))  # rotted after its manifest was written
    local = tmp_path / "local"
    first = pull(instance, local, newest_only=True)
    assert first == [local / "step-00000100"] and list(first.rejected) == ["step-00000200"]
    assert first.stats.bytes_received >= 2 * MiB  # fetched whole once: that is how it was found wanting
    known = set(first.rejected_manifests.items())

    again = pull(instance, local, newest_only=True, rejected_before=known)
    assert again.stats.bytes_received < 64 * 1024 and again.stats.files_transferred == 0  # its manifest only
    assert again == [] and again.rejected == {} and again.passed_over == ["step-00000200"]
    assert os.listdir(local) == ["step-00000100"]  # no staging dir for it either

    burst_checkpoint.write_checkpoint(remote, "step-00000200", {"w.bin": b"b" * 50_000})  # written again, whole
    rewritten = pull(instance, local, newest_only=True, rejected_before=known)
    assert rewritten == [local / "step-00000200"] and rewritten.passed_over == [] and rewritten.rejected == {}


def test_a_rejection_a_leftover_in_staging_may_have_caused_is_not_kept_against_the_checkpoint(
        instance: Instance, tmp_path: Path) -> None:
    """A pull resumes from what an interrupted one left whole in staging, and that may be what the checkpoint held
    before the trainer wrote it again under its name. Rejected then, it is not listed to be passed over: the next
    pull fetches it whole and it comes home."""
    remote = instance.sandbox / "ckpt"
    burst_checkpoint.write_checkpoint(remote, "step-00000100", {"w.bin": b"a" * 50_000})
    burst_checkpoint.write_checkpoint(remote, "step-00000200", {"w.bin": b"b" * 50_000})
    local = tmp_path / "local"
    pull(instance, local, newest_only=True)
    burst_checkpoint.write_checkpoint(remote, "step-00000300", {"w.bin": b"c" * 50_000})
    leftover = local / f"{STAGING_PREFIX}step-00000300"  # a pull of the step 300 written before, cut short
    leftover.mkdir()
    (leftover / "w.bin").write_bytes(b"C" * 50_000)
    got = pull(instance, local, newest_only=True)
    assert got == [] and list(got.rejected) == ["step-00000300"]
    assert got.rejected_manifests == {}
    again = pull(instance, local, newest_only=True, rejected_before=set(got.rejected_manifests.items()))
    assert again == [local / "step-00000300"] and burst_checkpoint.verify(again[0])


def test_the_staging_dir_of_a_superseded_checkpoint_is_removed_by_the_next_pull(
        instance: Instance, tmp_path: Path) -> None:
    remote = instance.sandbox / "ckpt"
    burst_checkpoint.write_checkpoint(remote, "step-00000100", {"w.bin": b"a" * 50_000})
    burst_checkpoint.write_checkpoint(remote, "step-00000200", {"w.bin": b"b" * 50_000})
    local = tmp_path / "local"
    interrupted = local / f"{STAGING_PREFIX}step-00000100"  # a pull of step 100 killed midway
    interrupted.mkdir(parents=True)
    (interrupted / "w.bin").write_bytes(b"a" * 20_000)
    got = pull(instance, local, newest_only=True)
    assert got == [local / "step-00000200"]
    assert os.listdir(local) == ["step-00000200"]  # step 100 will never be fetched: its partial bytes are freed


def test_auto_transport_is_rsync_when_both_sides_have_it(backend: SshBackend, key_path: Path) -> None:
    inst = start(backend, key_path, "i-auto", "auto")
    with ssh_connect(inst.target, trust=inst.trust) as conn:
        assert choose_transport(inst.target, conn) == ("rsync" if HAVE_RSYNC else "sftp")
        assert choose_transport(inst.target, conn, "sftp") == "sftp"


@pytest.mark.skipif(not HAVE_RSYNC, reason="rsync/ssh not installed")
def _pull_beside(inst: Instance, local: Path, *, bwlimit_kib: int) -> tuple[threading.Thread, dict[str, object]]:
    """A rate-capped pull on a thread of its own, started; its outcome (`result` or `error`) once it ends."""
    outcome: dict[str, object] = {}

    def slow_pull() -> None:
        try:
            outcome["result"] = pull(inst, local, bwlimit_kib=bwlimit_kib)
        except SyncError as e:
            outcome["error"] = e

    puller = threading.Thread(target=slow_pull)
    puller.start()
    return puller, outcome


def test_rsync_killed_mid_pull_leaves_nothing_visible_and_a_retry_resumes(
        backend: SshBackend, key_path: Path, tmp_path: Path) -> None:
    inst = start(backend, key_path, "i-kill", "rsync")
    shard_size = 2 * MiB
    burst_checkpoint.write_checkpoint(inst.sandbox / "ckpt", "step-00000100", shards(4, shard_size))
    local = tmp_path / "local"
    staging = local / f"{STAGING_PREFIX}step-00000100"
    puller, outcome = _pull_beside(inst, local, bwlimit_kib=1024)  # ~8 s in all at 1 MiB/s
    deadline = time.monotonic() + 120
    while not (staging / "model-00000.safetensors").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # rsync renames a file into place only once it is whole
    rsyncs = [pid for pid, _ in child_processes(os.getpid(), "rsync")]
    assert rsyncs, "the pull's rsync process was not found"
    for pid in rsyncs:
        os.kill(pid, signal.SIGKILL)
    puller.join(60)

    assert "killed by signal 9" in str(outcome.get("error"))
    assert visible(local) == []  # resume logic would find no checkpoint, not a partial one
    assert (staging / "model-00000.safetensors").stat().st_size == shard_size

    retry = pull(inst, local)
    assert retry == [local / "step-00000100"] and burst_checkpoint.verify(retry[0])
    assert retry.stats.bytes_received < 3.5 * shard_size  # the finished shard was not fetched again
    assert os.listdir(local) == ["step-00000100"]


def _instance_rsyncs(sandbox: Path) -> list[int]:
    """The instance's side of a transfer: the `rsync --server` processes working in its sandbox (and only there,
    so that other tests' transfers on this machine are left alone)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            cwd = Path(os.readlink(f"/proc/{entry}/cwd"))
        except OSError:
            continue
        if argv[:1] and argv[0].endswith(b"rsync") and b"--server" in argv and cwd.is_relative_to(sandbox):
            found.append(int(entry))
    return found


def test_a_pull_whose_instance_side_hangs_while_ssh_answers_is_ended_and_a_retry_resumes(
        backend: SshBackend, key_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # rsync's --timeout counts its own keep-alives as traffic, and ssh's keepalive only sees a dead connection: an
    # instance's rsync stuck (a hung disk) while its sshd answers held the pull, and the store's lock, for ever.
    monkeypatch.setattr(sync, "PULL_STALL_S", 2.0)
    monkeypatch.setattr(sync, "STALL_POLL_S", 0.2)
    inst = start(backend, key_path, "i-stall", "rsync")
    shard_size = 2 * MiB
    burst_checkpoint.write_checkpoint(inst.sandbox / "ckpt", "step-00000100", shards(4, shard_size))
    local = tmp_path / "local"
    puller, outcome = _pull_beside(inst, local, bwlimit_kib=512)  # ~16 s in all at 512 KiB/s
    deadline = time.monotonic() + 60
    while sync._bytes_under(local) < shard_size // 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    servers = _instance_rsyncs(inst.sandbox)
    assert servers, "the instance's rsync was not found"
    try:
        for pid in servers:
            os.kill(pid, signal.SIGSTOP)  # hung, its connection up
        stopped = time.monotonic()
        puller.join(60)
        assert not puller.is_alive()
        assert time.monotonic() - stopped < 20  # 2 s without a byte, then the next poll: not for ever
        assert isinstance(outcome.get("error"), sync.TransferStalled), outcome
        assert "nothing arrived for 2 s" in str(outcome["error"])
    finally:
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert visible(local) == []  # nothing partial is visible, and what came is kept for the retry
    retry = pull(inst, local)
    assert retry == [local / "step-00000100"] and burst_checkpoint.verify(retry[0])
    assert retry.stats.bytes_received < 4 * shard_size  # resumed: what had come was not fetched again


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs; the test is skipped, with the reason, when it cannot be mounted."""
    with small_tmpfs(tmp_path / "tiny", 2) as mount_point:
        yield mount_point


def test_local_disk_full_raises_sync_error_and_leaves_nothing_visible(
        instance: Instance, tiny_disk: Path) -> None:
    burst_checkpoint.write_checkpoint(instance.sandbox / "ckpt", "step-00000100", shards(1, 3 * MiB))
    local = tiny_disk / "ckpt"
    with pytest.raises(SyncError, match="disk full"):
        pull(instance, local)
    assert os.listdir(local) == []  # the staging dir went too, giving the space back


def _count_hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files sha256_file reads from now on (in this process: the daemon's side)."""
    hashed: list[str] = []
    real = burst_checkpoint.sha256_file

    def counting(path: Path) -> str:
        hashed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(burst_checkpoint, "sha256_file", counting)
    return hashed


def test_a_resume_pushes_the_checkpoint_it_verified_without_hashing_it_again(
        backend: SshBackend, key_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Multi-GB checkpoints: the daemon hashes the one it resumes from once (checkpoints.latest), and that is the
    # one sent, even when a pull brought a newer one home in between (the trainer is told that one's name).
    for transport in [p for p in ("rsync", "sftp") if p == "sftp" or HAVE_RSYNC]:
        inst = start(backend, key_path, f"i-once-{transport}", transport)
        local = tmp_path / f"local-{transport}"
        burst_checkpoint.write_checkpoint(local, "step-00000100", {"w.bin": os.urandom(10_000)})
        hashed = _count_hashed(monkeypatch)
        resume_from = burst_checkpoint.latest_complete(local)
        assert resume_from is not None and hashed == ["w.bin"]
        burst_checkpoint.write_checkpoint(local, "step-00000200", {"w.bin": os.urandom(10_000)})
        hashed.clear()  # writing it hashed its file (the trainer's side)
        pushed = push_checkpoint(inst.target, inst.trust, local, "ckpt", transport=transport,  # type: ignore[arg-type]
                                 checkpoint=resume_from)
        assert pushed is not None and pushed.name == "step-00000100"
        assert hashed == [], "hashed again to push it"
        assert os.listdir(inst.sandbox / "ckpt") == ["step-00000100"]
        assert burst_checkpoint.verify(inst.sandbox / "ckpt" / "step-00000100")
        monkeypatch.undo()


def test_pruning_the_daemons_store_after_a_pull_reads_no_checkpoint(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Every checkpoint in the store was hashed against its manifest as it arrived; keeping the newest few after
    # each pull must not read them all again (three multi-GB checkpoints every sync interval).
    from orchestrator.config import Config
    from orchestrator.lifecycle import checkpoints

    cfg = Config.model_validate({"state": {"dir": str(tmp_path / "state")}})
    store = checkpoints.store_dir(cfg, "job1")
    for step in range(1, 6):
        burst_checkpoint.write_checkpoint(store, f"step-{step:08d}", {"w.bin": os.urandom(1000)})
    (store / "step-00000009").mkdir()  # incomplete (no manifest): not ours to judge, never counted as kept
    hashed = _count_hashed(monkeypatch)
    with checkpoints.store_lock(cfg, "job1"):
        removed = checkpoints.prune_store(cfg, "job1")
    assert hashed == []
    assert sorted(p.name for p in removed) == ["step-00000001", "step-00000002"]
    assert sorted(p.name for p in store.iterdir()) == ["step-00000003", "step-00000004", "step-00000005",
                                                       "step-00000009"]


# --- a pull with a basis: the two manifests decide what crosses the wire ------------------------------------------
def _pull_step_100_then_write_step_200(instance: Instance, local: Path, changed: str = "model-00002.safetensors",
                                       size: int = 256 * 1024) -> tuple[dict[str, bytes], Path]:
    """Step 100 pulled home (the basis); step 200 written remotely, every file rewritten, one with new bytes."""
    files = shards(4, size)
    remote = instance.sandbox / "ckpt"
    burst_checkpoint.write_checkpoint(remote, "step-00000100", files)
    assert pull(instance, local) == [local / "step-00000100"]
    files = {**files, changed: os.urandom(size)}
    return files, burst_checkpoint.write_checkpoint(remote, "step-00000200", files)


def test_a_file_the_basis_holds_is_hard_linked_from_it_and_never_read_on_the_instance(
        instance: Instance, tmp_path: Path) -> None:
    local = tmp_path / "local"
    files, written = _pull_step_100_then_write_step_200(instance, local)
    # Damage the instance's copy of an unchanged shard (same size): were it read or sent, the pull would bring
    # these bytes home and reject the checkpoint. The manifests' (size, sha256) say the basis holds it.
    (written / "model-00000.safetensors").write_bytes(b"\0" * len(files["model-00000.safetensors"]))

    got = pull(instance, local)
    assert got == [local / "step-00000200"] and got.rejected == {}
    assert got.stats.files_transferred == 1  # the changed shard only
    assert burst_checkpoint.verify(got[0])
    for rel, data in files.items():
        assert (got[0] / rel).read_bytes() == data
    for rel in ("model-00000.safetensors", "model-00001.safetensors", "model-00003.safetensors"):
        assert (got[0] / rel).stat().st_ino == (local / "step-00000100" / rel).stat().st_ino  # no second copy
    assert (got[0] / "model-00002.safetensors").stat().st_ino != \
        (local / "step-00000100" / "model-00002.safetensors").stat().st_ino


def test_a_same_sized_shard_rewritten_within_the_same_second_is_transferred(
        instance: Instance, tmp_path: Path) -> None:
    # rsync's quick check (size + mtime) would take it for the basis's file and hard-link it.
    local = tmp_path / "local"
    rel = "model-00002.safetensors"
    files, written = _pull_step_100_then_write_step_200(instance, local, changed=rel)
    basis_st = (local / "step-00000100" / rel).stat()
    os.utime(written / rel, ns=(basis_st.st_atime_ns, basis_st.st_mtime_ns))

    got = pull(instance, local)
    assert got == [local / "step-00000200"] and got.rejected == {}
    assert (got[0] / rel).read_bytes() == files[rel]
    assert (got[0] / rel).stat().st_ino != basis_st.st_ino
    assert (local / "step-00000100" / rel).stat().st_ino == basis_st.st_ino  # the basis is left as it was
    assert burst_checkpoint.verify(local / "step-00000100")


def test_a_manifest_that_lies_about_a_file_the_basis_does_not_hold_is_rejected(
        instance: Instance, tmp_path: Path) -> None:
    # The instance's file is the basis's bytes, same size and mtime; its manifest lists another sha256. Whatever
    # rsync makes of it (delta against the basis), the file it writes is read and checked against the manifest.
    local = tmp_path / "local"
    rel = "model-00002.safetensors"
    _pull_step_100_then_write_step_200(instance, local, changed=rel)
    remote_200 = instance.sandbox / "ckpt" / "step-00000200"
    basis_file = local / "step-00000100" / rel
    (remote_200 / rel).write_bytes(basis_file.read_bytes())
    basis_st = basis_file.stat()
    os.utime(remote_200 / rel, ns=(basis_st.st_atime_ns, basis_st.st_mtime_ns))

    got = pull(instance, local)
    assert got == [] and got.rejected == {"step-00000200": "a file's size or sha256 differs from the manifest"}
    assert os.listdir(local) == ["step-00000100"]
    assert burst_checkpoint.verify(local / "step-00000100")


def test_verifying_a_pulled_checkpoint_reads_only_the_files_that_crossed_the_wire(
        instance: Instance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Files hard-linked from the basis are its own bytes, hashed against the same (size, sha256) when it arrived.
    local = tmp_path / "local"
    _pull_step_100_then_write_step_200(instance, local)
    hashed = _count_hashed(monkeypatch)
    got = pull(instance, local)
    assert got == [local / "step-00000200"]
    assert hashed == ["model-00002.safetensors"]


def test_a_resumed_pull_keeps_only_what_the_manifest_lists(instance: Instance, tmp_path: Path) -> None:
    local = tmp_path / "local"
    files, _ = _pull_step_100_then_write_step_200(instance, local)
    staging = local / f"{STAGING_PREFIX}step-00000200"  # an earlier attempt, killed midway
    (staging / "old").mkdir(parents=True)
    (staging / "old" / "stray.bin").write_bytes(b"not listed")
    (staging / "manifest.json").write_text('{"files": {}}')
    (staging / "model-00002.safetensors").write_bytes(files["model-00002.safetensors"])  # finished whole

    got = pull(instance, local)
    assert got == [local / "step-00000200"] and got.rejected == {}
    assert got.stats.files_transferred == 0  # the basis held three shards, the earlier attempt the fourth
    assert sorted(p.relative_to(got[0]).as_posix() for p in got[0].rglob("*")) == sorted([*files, "manifest.json"])
    assert burst_checkpoint.verify(got[0])


def test_a_resumed_pull_never_appends_to_a_file_hard_linked_from_a_complete_checkpoint(
        instance: Instance, tmp_path: Path) -> None:
    # An earlier attempt hard-linked a file from the basis of its day; the checkpoint now lists it larger.
    local = tmp_path / "local"
    rel = "model-00002.safetensors"
    files = shards(4, 64 * 1024)
    remote = instance.sandbox / "ckpt"
    burst_checkpoint.write_checkpoint(remote, "step-00000100", files)
    assert pull(instance, local) == [local / "step-00000100"]
    files[rel] = files[rel] + os.urandom(64 * 1024)
    burst_checkpoint.write_checkpoint(remote, "step-00000200", files)
    staging = local / f"{STAGING_PREFIX}step-00000200"
    staging.mkdir()
    os.link(local / "step-00000100" / rel, staging / rel)

    got = pull(instance, local)
    assert got == [local / "step-00000200"] and got.rejected == {}
    assert (got[0] / rel).read_bytes() == files[rel]
    assert burst_checkpoint.verify(local / "step-00000100")  # deep: the complete checkpoint was not touched


# --- a push onto an instance that already holds a checkpoint -----------------------------------------------------
RUNBOOKS = Path(__file__).resolve().parents[1] / "runbooks"


def install_runbooks(inst: Instance) -> InstanceRunbooks:
    """What bootstrap puts on an instance before a resume pushes its checkpoint (the two files a push runs)."""
    (inst.sandbox / "runbooks").mkdir(exist_ok=True)
    for name in ("burst_checkpoint.py", "checkpoint_transfer.py"):
        shutil.copy(RUNBOOKS / name, inst.sandbox / "runbooks" / name)
    return InstanceRunbooks("runbooks", sys.executable)


def _instance_at_step_100_home_at_200(inst: Instance, local: Path, changed: str = "model-00002.safetensors",
                                      size: int = 256 * 1024) -> tuple[dict[str, bytes], Path]:
    """The trainer wrote step 100 on the instance (the basis); home holds it and step 200, one shard changed."""
    files = shards(4, size)
    burst_checkpoint.write_checkpoint(inst.sandbox / "ckpt", "step-00000100", files)
    burst_checkpoint.write_checkpoint(local, "step-00000100", files)
    files = {**files, changed: os.urandom(size)}
    return files, burst_checkpoint.write_checkpoint(local, "step-00000200", files)


def push(inst: Instance, local: Path, checkpoint: Path, **kwargs: object) -> PushedCheckpoint:
    pushed = push_checkpoint(inst.target, inst.trust, local, "ckpt", transport=inst.transport,  # type: ignore[arg-type]
                             checkpoint=checkpoint, **kwargs)  # type: ignore[arg-type]
    assert pushed is not None and not pushed.already_there
    return pushed


def test_a_push_onto_an_instance_holding_an_older_checkpoint_sends_only_the_changed_shard(
        instance: Instance, tmp_path: Path) -> None:
    local = tmp_path / "local"
    size = 256 * 1024
    files, step_200 = _instance_at_step_100_home_at_200(instance, local, size=size)
    pushed = push(instance, local, step_200, runbooks=install_runbooks(instance))

    remote = instance.sandbox / "ckpt"
    assert pushed.name == "step-00000200" and visible(remote) == ["step-00000100", "step-00000200"]
    assert burst_checkpoint.verify(remote / "step-00000200")
    assert sorted(p.name for p in (remote / "step-00000200").iterdir()) == sorted([*files, "manifest.json"])
    assert pushed.stats.files_transferred == 1
    assert size <= pushed.stats.bytes_sent < 1.25 * size
    for rel in ("model-00000.safetensors", "model-00001.safetensors", "model-00003.safetensors"):
        assert (remote / "step-00000200" / rel).stat().st_ino == (remote / "step-00000100" / rel).stat().st_ino
    assert (remote / "step-00000200" / "model-00002.safetensors").read_bytes() == files["model-00002.safetensors"]


def test_a_file_the_instance_holds_is_never_read_on_this_side(instance: Instance, tmp_path: Path) -> None:
    # The caller verified step 200 (checkpoints.latest); were an unchanged shard read here and sent, the instance
    # would get these zeros. The two manifests' (size, sha256) say the instance holds it.
    local = tmp_path / "local"
    files, step_200 = _instance_at_step_100_home_at_200(instance, local)
    rel = "model-00001.safetensors"
    (step_200 / rel).write_bytes(b"\0" * len(files[rel]))
    push(instance, local, step_200, runbooks=install_runbooks(instance))
    assert (instance.sandbox / "ckpt" / "step-00000200" / rel).read_bytes() == files[rel]


def test_a_corrupted_basis_file_on_the_instance_is_not_trusted(instance: Instance, tmp_path: Path) -> None:
    # Its manifest still lists the bytes step 200 has; the instance reads what it would link, and sends for the rest.
    local = tmp_path / "local"
    files, step_200 = _instance_at_step_100_home_at_200(instance, local)
    rel = "model-00001.safetensors"
    basis_file = instance.sandbox / "ckpt" / "step-00000100" / rel
    basis_file.write_bytes(b"B" * len(files[rel]))  # same size: bit rot, or a torn write
    pushed = push(instance, local, step_200, runbooks=install_runbooks(instance))

    remote_200 = instance.sandbox / "ckpt" / "step-00000200"
    assert burst_checkpoint.verify(remote_200)
    assert (remote_200 / rel).read_bytes() == files[rel]
    assert (remote_200 / rel).stat().st_ino != basis_file.stat().st_ino
    assert basis_file.read_bytes() == b"B" * len(files[rel])  # the basis's own file is left as it was
    assert pushed.stats.files_transferred == 2


@pytest.mark.skipif(not HAVE_RSYNC, reason="rsync/ssh not installed")
def test_without_the_runbooks_on_the_instance_rsync_compares_contents_itself(
        backend: SshBackend, key_path: Path, tmp_path: Path) -> None:
    inst = start(backend, key_path, "i-no-runbooks", "rsync")
    local = tmp_path / "local"
    rel = "model-00001.safetensors"
    files, step_200 = _instance_at_step_100_home_at_200(inst, local)
    basis_file = inst.sandbox / "ckpt" / "step-00000100" / rel
    basis_file.write_bytes(b"B" * len(files[rel]))
    pushed = push(inst, local, step_200)
    assert burst_checkpoint.verify(inst.sandbox / "ckpt" / "step-00000200")
    assert pushed.stats.files_transferred == 3  # the changed shard, the corrupted one, the manifest


@pytest.mark.parametrize("with_runbooks", [True, False])
def test_a_resumed_push_onto_a_fresh_instance_does_not_take_a_staged_file_on_its_size_and_mtime(
        instance: Instance, tmp_path: Path, with_runbooks: bool) -> None:
    # An interrupted push of an earlier "step 200" (a run replayed from step 100 wrote it again) left a file of the
    # same size and mtime in the instance's staging dir: read against the manifest on the instance, or not kept.
    inst = instance
    local = tmp_path / "local"
    rel = "model-00002.safetensors"
    _, step_200 = _instance_at_step_100_home_at_200(inst, local)
    shutil.rmtree(inst.sandbox / "ckpt")  # a fresh instance
    staged = inst.sandbox / "ckpt" / f"{STAGING_PREFIX}step-00000200"
    staged.mkdir(parents=True)
    (staged / rel).write_bytes(os.urandom((step_200 / rel).stat().st_size))
    st = (step_200 / rel).stat()
    os.utime(staged / rel, ns=(st.st_atime_ns, st.st_mtime_ns))

    push(inst, local, step_200, runbooks=install_runbooks(inst) if with_runbooks else None)
    assert visible(inst.sandbox / "ckpt") == ["step-00000200"]
    assert burst_checkpoint.verify(inst.sandbox / "ckpt" / "step-00000200")


def test_a_push_cut_short_is_taken_up_where_it_stopped(instance: Instance, tmp_path: Path) -> None:
    # The same instance, its bootstrap retried after SSH dropped mid-push: three of four shards arrived whole, the
    # fourth half. The whole ones are read against the manifest there and kept; only the rest crosses again.
    size = 1 * MiB
    files = shards(4, size)
    step_200 = burst_checkpoint.write_checkpoint(tmp_path / "local", "step-00000200", files)
    staged = instance.sandbox / "ckpt" / f"{STAGING_PREFIX}step-00000200"
    staged.mkdir(parents=True)
    for rel, content in sorted(files.items())[:3]:
        (staged / rel).write_bytes(content)
    last = sorted(files)[3]
    (staged / last).write_bytes(files[last][: size // 2])

    pushed = push(instance, tmp_path / "local", step_200, runbooks=install_runbooks(instance))
    assert visible(instance.sandbox / "ckpt") == ["step-00000200"]
    assert burst_checkpoint.verify(instance.sandbox / "ckpt" / "step-00000200")
    assert pushed.stats.files_transferred <= 2 and pushed.stats.bytes_sent < 1.5 * size  # a shard (+ manifest)


# --- delta transfer against a basis: where it can find something, and only there -----------------------------------
def _send_step_200(inst: Instance, tmp_path: Path, direction: str, files_100: dict[str, bytes],
                   files_200: dict[str, bytes]) -> tuple[int, int]:
    """The receiving side holds step 100, the sending side sends step 200; (bytes of data, bytes sent back)."""
    local, remote = tmp_path / "local", inst.sandbox / "ckpt"
    sender, receiver = (remote, local) if direction == "pull" else (local, remote)
    burst_checkpoint.write_checkpoint(receiver, "step-00000100", files_100)
    step_200 = burst_checkpoint.write_checkpoint(sender, "step-00000200", files_200)
    if direction == "pull":
        got = pull(inst, local)
        assert got == [local / "step-00000200"] and got.rejected == {}
        stats = got.stats
        data, back = stats.bytes_received, stats.bytes_sent
    else:
        stats = push(inst, local, step_200, runbooks=install_runbooks(inst)).stats
        data, back = stats.bytes_sent, stats.bytes_received
    assert burst_checkpoint.verify(receiver / "step-00000200")
    for rel, content in files_200.items():
        assert (receiver / "step-00000200" / rel).read_bytes() == content
    return data, back


@pytest.mark.skipif(not HAVE_RSYNC, reason="rsync/ssh not installed")
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_a_partly_changed_shard_crosses_as_a_delta_when_the_basis_shares_files(
        backend: SshBackend, key_path: Path, tmp_path: Path, direction: str) -> None:
    # Frozen layers: three shards as they were, the fourth rewritten with its first half as it was.
    inst = start(backend, key_path, f"i-delta-{direction}", "rsync")
    size, rel = 1 * MiB, "model-00002.safetensors"
    files = shards(4, size)
    data, _ = _send_step_200(inst, tmp_path, direction, files,
                             {**files, rel: files[rel][: size // 2] + os.urandom(size // 2)})
    assert size // 2 <= data < 0.75 * size


@pytest.mark.skipif(not HAVE_RSYNC, reason="rsync/ssh not installed")
@pytest.mark.parametrize("direction", ["pull", "push"])
def test_when_no_file_is_shared_with_the_basis_rsync_is_given_no_basis_to_read(
        backend: SshBackend, key_path: Path, tmp_path: Path, direction: str) -> None:
    # A full fine-tune: every shard is fresh bytes. A delta basis would be read whole on the receiving side, its
    # block checksums sent back (about 9 KB here), for a delta that finds nothing.
    inst = start(backend, key_path, f"i-full-{direction}", "rsync")
    size = 256 * 1024
    data, back = _send_step_200(inst, tmp_path, direction, shards(4, size), shards(4, size))
    assert data >= 4 * size
    assert back < 2048  # the file list and the per-file headers; no block checksums
