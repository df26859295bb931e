"""SSH to instances: host keys pinned or trusted on first use, commands, errors, rsync's ssh command line.

Every endpoint is a real simcloud machine on 127.0.0.1 (OpenSSH's sshd, or the paramiko server).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.remote.ssh import (
    HostKeyMismatch,
    JsonFileHostKeyTrust,
    MemoryHostKeyTrust,
    RemoteCommandFailed,
    SharedConnection,
    SshUnavailable,
    Target,
    connect,
    generate_keypair,
    rsync_ssh_command,
    run,
    wait_for_ssh,
)
from providers.simcloud.ssh_backend import SshBackend, openssh_available

pytestmark = pytest.mark.slow

MODES = [
    pytest.param("openssh", marks=pytest.mark.skipif(not openssh_available(), reason="sshd not installed")),
    "paramiko",
]


@pytest.fixture(params=MODES)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SshBackend]:
    b = SshBackend(tmp_path / "simcloud", prefer=request.param)
    yield b
    b.close()


@pytest.fixture
def key_path(tmp_path: Path) -> Path:
    path = tmp_path / "keys" / "id_ed25519"
    generate_keypair(path)
    return path


def launch(backend: SshBackend, key_path: Path, instance_id: str, *, pinned: bool = True) -> Target:
    ep = backend.start(instance_id, Path(f"{key_path}.pub").read_text())
    return Target(host=ep.host, port=ep.port, user=ep.user, key_path=key_path,
                  host_key=ep.host_key if pinned else None, instance_id=instance_id)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_generate_keypair_writes_a_private_file_only_the_owner_reads(tmp_path: Path) -> None:
    line = generate_keypair(tmp_path / "k" / "id")
    assert line.startswith("ssh-ed25519 ") and line.endswith(" burstctl")
    assert stat.S_IMODE((tmp_path / "k" / "id").stat().st_mode) == 0o600
    assert (tmp_path / "k" / "id.pub").read_text() == line + "\n"
    with pytest.raises(FileExistsError):
        generate_keypair(tmp_path / "k" / "id")  # an existing key is never clobbered


def test_pinned_host_key_is_accepted_and_commands_run_with_their_exit_status(
        backend: SshBackend, key_path: Path) -> None:
    target = launch(backend, key_path, "i-pin")
    with connect(target, trust=MemoryHostKeyTrust()) as conn:
        res = run(conn, ["sh", "-c", "echo out; echo err >&2", "ignored-arg0"])
        assert (res.exit_code, res.stdout, res.stderr) == (0, "out\n", "err\n")
        # Arguments are quoted: a word with spaces, quotes and $ reaches the program unchanged.
        tricky = "a b 'c' \"d\" $HOME; rm -rf /"
        assert run(conn, ["printf", "%s", tricky]).stdout == tricky
        assert run(conn, ["cat"], stdin="from stdin").stdout == "from stdin"


def test_a_commands_stdin_arrives_whole_within_its_timeout_however_large(backend: SshBackend, key_path: Path) -> None:
    # A checkpoint's manifest goes to the instance this way (a few KB for a sharded model, more for many files).
    # invoke alone fed it one character per 10 ms poll: this would have taken 30 minutes.
    target = launch(backend, key_path, "i-stdin")
    text = "".join(f"{i:07d} {'x' * 56}\n" for i in range(3000))  # 192 KB
    with connect(target, trust=MemoryHostKeyTrust()) as conn:
        res = run(conn, ["sha256sum"], stdin=text, timeout=60)
    assert res.stdout.split()[0] == hashlib.sha256(text.encode()).hexdigest()


def test_a_wrong_pinned_host_key_is_rejected_before_any_command(backend: SshBackend, key_path: Path) -> None:
    target = launch(backend, key_path, "i-real")
    impostor = launch(backend, key_path, "i-impostor")
    with pytest.raises(HostKeyMismatch, match="differs from the one pinned"):
        connect(replace(target, host_key=impostor.host_key), trust=MemoryHostKeyTrust())


def test_trust_on_first_use_records_the_key_then_rejects_a_changed_one(backend: SshBackend, key_path: Path) -> None:
    trust = MemoryHostKeyTrust()
    first = launch(backend, key_path, "i-tofu", pinned=False)
    with connect(first, trust=trust) as conn:
        assert run(conn, ["true"]).exit_code == 0
    assert trust.get("i-tofu") == backend.endpoint("i-tofu").host_key  # type: ignore[union-attr]
    with connect(first, trust=trust):
        pass  # the same key again is fine
    # Another machine answering at the recorded instance's address (a reused IP, a man in the middle).
    other = launch(backend, key_path, "i-elsewhere", pinned=False)
    with pytest.raises(HostKeyMismatch, match="recorded at first use"):
        connect(replace(other, instance_id="i-tofu"), trust=trust)
    assert trust.get("i-tofu") == backend.endpoint("i-tofu").host_key  # type: ignore[union-attr]


def test_json_file_trust_survives_a_restart_and_keeps_other_instances(tmp_path: Path) -> None:
    path = tmp_path / "state" / "host_keys.json"
    JsonFileHostKeyTrust(path).put("i-a", "ssh-ed25519 AAAA")
    JsonFileHostKeyTrust(path).put("i-b", "ssh-ed25519 BBBB")
    reopened = JsonFileHostKeyTrust(path)
    assert reopened.get("i-a") == "ssh-ed25519 AAAA" and reopened.get("i-b") == "ssh-ed25519 BBBB"
    assert reopened.get("i-c") is None
    assert json.loads(path.read_text()) == {"i-a": "ssh-ed25519 AAAA", "i-b": "ssh-ed25519 BBBB"}


def test_non_zero_exit_raises_remote_command_failed_with_the_stderr_tail(
        backend: SshBackend, key_path: Path) -> None:
    target = launch(backend, key_path, "i-fail")
    with connect(target, trust=MemoryHostKeyTrust()) as conn:
        with pytest.raises(RemoteCommandFailed, match=r"sh on 127\.0\.0\.1 exited 7: disk on fire") as info:
            run(conn, ["sh", "-c", "echo working; echo disk on fire >&2; exit 7"])
        assert info.value.remote_exit_code == 7 and info.value.stderr_tail == "disk on fire"
        assert run(conn, ["sh", "-c", "exit 3"], check=False).exit_code == 3
        with pytest.raises(RemoteCommandFailed, match="timeout") as timed_out:
            run(conn, ["sleep", "30"], timeout=1)
        assert timed_out.value.remote_exit_code is None


def test_refused_and_stopped_endpoints_are_ssh_unavailable(backend: SshBackend, key_path: Path) -> None:
    nobody = Target("127.0.0.1", free_port(), "root", key_path, None, "i-nobody")
    with pytest.raises(SshUnavailable, match="connection refused"):
        connect(nobody, trust=MemoryHostKeyTrust())
    with pytest.raises(SshUnavailable, match="not ready after 1 s"):
        wait_for_ssh(nobody, MemoryHostKeyTrust(), timeout_s=1, interval_s=0.2)

    target = launch(backend, key_path, "i-dropped")
    conn = connect(target, trust=MemoryHostKeyTrust())
    backend.stop("i-dropped")  # a preemption while connected
    with pytest.raises(SshUnavailable):
        run(conn, ["true"])
    conn.close()


def test_wait_for_ssh_returns_once_the_instance_answers_and_fails_fast_on_a_wrong_key(
        backend: SshBackend, key_path: Path) -> None:
    target = launch(backend, key_path, "i-wait")
    wait_for_ssh(target, MemoryHostKeyTrust(), timeout_s=20, interval_s=0.2)
    other = launch(backend, key_path, "i-wait-other")
    with pytest.raises(HostKeyMismatch):
        wait_for_ssh(replace(target, host_key=other.host_key), MemoryHostKeyTrust(), timeout_s=600)


@pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync and ssh")
def test_rsync_ssh_command_pins_the_host_key(backend: SshBackend, key_path: Path, tmp_path: Path) -> None:
    target = launch(backend, key_path, "i-rsync")
    sandbox = backend.endpoint("i-rsync").sandbox  # type: ignore[union-attr]
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"\x01" * 1000)
    with rsync_ssh_command(target, MemoryHostKeyTrust()) as rsh:
        assert "StrictHostKeyChecking=yes" in rsh and "BatchMode=yes" in rsh and "IdentitiesOnly=yes" in rsh
        known_hosts = Path(rsh.split("UserKnownHostsFile=")[1].split()[0])
        assert known_hosts.read_text() == f"[127.0.0.1]:{target.port} {target.host_key}\n"
        subprocess.run(["rsync", "-a", "-e", rsh, f"{src}/", f"{target.user}@{target.host}:up/"],
                       check=True, timeout=60, capture_output=True)
    assert not known_hosts.exists()  # the temporary known_hosts goes away with the context
    assert Path(sandbox, "up", "weights.bin").read_bytes() == b"\x01" * 1000

    other = launch(backend, key_path, "i-rsync-other")
    with rsync_ssh_command(replace(target, host_key=other.host_key), MemoryHostKeyTrust()) as rsh:
        refused = subprocess.run(["rsync", "-a", "-e", rsh, f"{src}/", f"{target.user}@{target.host}:up2/"],
                                 timeout=60, capture_output=True, text=True)
    assert refused.returncode != 0 and "Host key verification failed" in refused.stderr
    assert not Path(sandbox, "up2").exists()

    with pytest.raises(HostKeyMismatch, match="no host key pinned or recorded"), \
            rsync_ssh_command(replace(target, host_key=None), MemoryHostKeyTrust()):
        pass


def test_a_shared_connection_is_opened_once_for_the_steps_of_a_sync_and_afresh_after_a_failed_step(
        backend: SshBackend, key_path: Path) -> None:
    target = launch(backend, key_path, "i-shared")
    with SharedConnection(target, MemoryHostKeyTrust()) as shared:
        first = shared.get()
        assert shared.get() is first  # the logs' pull rides on the checkpoint pull's connection
        assert run(first, ["echo", "one"]).stdout.strip() == "one"
        shared.drop()  # a step failed: the next one must not inherit a connection that may be broken
        again = shared.get()
        assert again is not first and run(again, ["echo", "two"]).stdout.strip() == "two"
    assert not again.is_connected  # closed on the way out
    # Nothing is opened until a step asks for it (a sync through S3 needs no SSH at all): entering one for a port
    # nothing listens on is fine; asking it for the connection is what fails.
    nowhere = SharedConnection(replace(target, port=free_port()), MemoryHostKeyTrust())
    with nowhere, pytest.raises(SshUnavailable):
        nowhere.get()


def test_a_timeout_s_kill_of_a_session_already_gone_is_nothing_to_do(backend: SshBackend, key_path: Path) -> None:
    # A command's timeout kills it from a timer thread by closing its channel; when the connection is closed under
    # that thread, the close fails there, where nothing catches it. Connections use a runner whose kill allows that.
    target = launch(backend, key_path, "i-gone")
    with connect(target, trust=MemoryHostKeyTrust()) as conn:
        runner = conn.config.runners.remote(context=conn)

    class GoneChannel:
        def close(self) -> None:
            raise EOFError  # paramiko's packetizer, writing to a transport that is closed

    runner.channel = GoneChannel()
    runner.kill()  # nothing raised
