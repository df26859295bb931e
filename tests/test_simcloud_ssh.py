"""simcloud's machines: each instance is a sandbox with a real SSH endpoint on 127.0.0.1 (OpenSSH or paramiko).

Everything here is real: sshd or the paramiko server, the client's SSH connection, processes, rsync.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from providers.simcloud.backend import Endpoint
from providers.simcloud.ssh_backend import SshBackend, openssh_available

pytestmark = pytest.mark.slow

MODES = [
    pytest.param("openssh", marks=pytest.mark.skipif(not openssh_available(), reason="sshd not installed")),
    "paramiko",
]


class ClientKey:
    """An ed25519 key pair as a launch gets it: a private key file and its public key line."""

    def __init__(self, directory: Path) -> None:
        pem = Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption())
        self.path = directory / "id_ed25519"
        self.path.write_bytes(pem)
        self.path.chmod(0o600)
        self.pkey = paramiko.Ed25519Key.from_private_key(io.StringIO(pem.decode()))
        self.public_line = f"{self.pkey.get_name()} {self.pkey.get_base64()} burstctl-test"


@pytest.fixture
def client_key(tmp_path: Path) -> ClientKey:
    return ClientKey(tmp_path)


@pytest.fixture(params=MODES)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SshBackend]:
    b = SshBackend(tmp_path / "simcloud", prefer=request.param)
    yield b
    b.close()


def connect(ep: Endpoint, key: paramiko.PKey, *, pinned: str | None = None) -> paramiko.SSHClient:
    """SSH in the way the daemon does: the host key pinned from the API, unknown keys rejected."""
    client = paramiko.SSHClient()
    key_type, blob = (pinned or ep.host_key or "").split()[:2]
    client.get_host_keys().add(f"[{ep.host}]:{ep.port}", key_type,
                               paramiko.PKey.from_type_string(key_type, base64.b64decode(blob)))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(ep.host, ep.port, username=ep.user, pkey=key, allow_agent=False, look_for_keys=False,
                   timeout=10, banner_timeout=10, auth_timeout=10)
    return client


def run(client: paramiko.SSHClient, command: str) -> tuple[int, str, str]:
    _, stdout, stderr = client.exec_command(command, timeout=30)
    out, err = stdout.read().decode(), stderr.read().decode()
    return stdout.channel.recv_exit_status(), out, err


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's zombie waits for init to reap it: it is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def answers_ssh(ep: Endpoint) -> bool:
    try:
        with socket.create_connection((ep.host, ep.port), timeout=2) as s:
            return s.recv(4) == b"SSH-"
    except OSError:
        return False


def known_hosts_file(tmp_path: Path, ep: Endpoint) -> Path:
    path = tmp_path / "known_hosts"
    path.write_text(f"[{ep.host}]:{ep.port} {ep.host_key}\n")
    return path


def ssh_command(tmp_path: Path, ep: Endpoint, key: ClientKey) -> list[str]:
    """OpenSSH client options that pin the endpoint's host key (StrictHostKeyChecking=yes)."""
    return ["ssh", "-p", str(ep.port), "-i", str(key.path), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={known_hosts_file(tmp_path, ep)}", "-o", "StrictHostKeyChecking=yes",
            "-o", "LogLevel=ERROR"]


@pytest.mark.parametrize("mode", MODES)
def test_backend_runs_the_requested_kind_of_server(mode: str, tmp_path: Path) -> None:
    b = SshBackend(tmp_path / "sim", prefer=mode)  # type: ignore[arg-type]
    assert b.mode == mode


def test_a_command_runs_in_the_sandbox_with_its_streams_and_exit_status(
        backend: SshBackend, client_key: ClientKey) -> None:
    ep = backend.start("i-cmd", client_key.public_line)
    assert ep.host == "127.0.0.1" and ep.sandbox is not None and Path(ep.sandbox).is_dir()
    assert answers_ssh(ep)
    assert ep.host_key is not None and ep.host_key.startswith("ssh-ed25519 ")
    with connect(ep, client_key.pkey) as client:
        status, out, err = run(client, "pwd; echo \"home=$HOME\"; echo oops >&2; exit 3")
    assert status == 3
    assert out.splitlines() == [ep.sandbox, f"home={ep.sandbox}"]
    assert err == "oops\n"


def test_session_environment_never_carries_the_servers_secrets(
        backend: SshBackend, client_key: ClientKey, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURSTCTL_SIM_API_KEY", "sk-sim-do-not-leak-0f3a")
    ep = backend.start("i-env", client_key.public_line)
    with connect(ep, client_key.pkey) as client:
        status, out, _ = run(client, "env")
    assert status == 0
    assert "sk-sim-do-not-leak-0f3a" not in out
    assert "BURSTCTL_SIM_INSTANCE=" in out  # the marker that lets stop() find every process


def test_the_host_key_is_the_one_endpoint_reports_and_a_different_one_is_rejected(
        backend: SshBackend, client_key: ClientKey) -> None:
    ep = backend.start("i-hostkey", client_key.public_line)
    other = backend.start("i-other", client_key.public_line)
    assert other.host_key != ep.host_key and other.port != ep.port
    with pytest.raises(paramiko.BadHostKeyException):
        connect(ep, client_key.pkey, pinned=other.host_key)


def test_only_the_launch_key_may_log_in(backend: SshBackend, client_key: ClientKey, tmp_path: Path) -> None:
    ep = backend.start("i-auth", client_key.public_line)
    (tmp_path / "stranger").mkdir()
    stranger = ClientKey(tmp_path / "stranger")
    with pytest.raises(paramiko.AuthenticationException):
        connect(ep, stranger.pkey)


def test_sftp_puts_and_gets_files_relative_paths_landing_in_the_sandbox(
        backend: SshBackend, client_key: ClientKey) -> None:
    ep = backend.start("i-sftp", client_key.public_line)
    assert ep.sandbox is not None
    with connect(ep, client_key.pkey) as client, client.open_sftp() as sftp:
        assert sftp.normalize(".") == ep.sandbox
        sftp.mkdir("ckpt")
        sftp.putfo(io.BytesIO(b"step=42\n"), "ckpt/state.txt")
        assert Path(ep.sandbox, "ckpt", "state.txt").read_bytes() == b"step=42\n"
        got = io.BytesIO()
        sftp.getfo(f"{ep.sandbox}/ckpt/state.txt", got)  # absolute sandbox paths work too
        assert got.getvalue() == b"step=42\n"
        assert sftp.listdir("ckpt") == ["state.txt"]


@pytest.mark.skipif(shutil.which("rsync") is None or shutil.which("ssh") is None, reason="needs rsync and ssh")
def test_rsync_pushes_and_pulls_a_directory(backend: SshBackend, client_key: ClientKey, tmp_path: Path) -> None:
    ep = backend.start("i-rsync", client_key.public_line)
    assert ep.sandbox is not None
    workdir = tmp_path / "workdir"
    (workdir / "data").mkdir(parents=True)
    (workdir / "train.py").write_text("print('training')\n")
    (workdir / "data" / "shard-0.bin").write_bytes(os.urandom(200_000))
    rsh = " ".join(ssh_command(tmp_path, ep, client_key))
    target = f"{ep.user}@{ep.host}:{ep.sandbox}/work/"
    subprocess.run(["rsync", "-a", "-e", rsh, f"{workdir}/", target], check=True, timeout=60)
    pushed = Path(ep.sandbox, "work", "data", "shard-0.bin")
    assert pushed.read_bytes() == (workdir / "data" / "shard-0.bin").read_bytes()

    with connect(ep, client_key.pkey) as client:
        assert run(client, "mkdir -p work/ckpt && echo 'w=1' > work/ckpt/last.pt")[0] == 0
    pulled = tmp_path / "pulled"
    subprocess.run(["rsync", "-a", "-e", rsh, f"{target}ckpt/", f"{pulled}/"], check=True, timeout=60)
    assert (pulled / "last.pt").read_text() == "w=1\n"


def test_stop_kills_every_process_of_the_instance_even_detached_ones(
        backend: SshBackend, client_key: ClientKey) -> None:
    ep = backend.start("i-stop", client_key.public_line)
    assert ep.sandbox is not None
    with connect(ep, client_key.pkey) as client:
        # A trainer in the background, one in its own session, and one that scrubbed its environment.
        status, out, _ = run(client, "nohup sleep 1000 >/dev/null 2>&1 & echo $!; "
                                     "setsid sleep 1001 >/dev/null 2>&1 < /dev/null & echo $!; "
                                     "env -i sleep 1002 >/dev/null 2>&1 & echo $!")
        assert status == 0
        sleepers = [int(p) for p in out.split()]
        interactive = client.get_transport().open_session()  # type: ignore[union-attr]
        interactive.exec_command("sleep 1003")  # a session still connected at stop
    assert len(sleepers) == 3 and all(alive(p) for p in sleepers)
    instance_pids = backend.pids("i-stop")
    assert set(sleepers) <= instance_pids

    backend.stop("i-stop")

    assert not any(alive(p) for p in instance_pids)
    assert backend.pids("i-stop") == set() and backend.endpoint("i-stop") is None
    assert not Path(ep.sandbox).exists()  # the instance's disk goes with it
    assert not answers_ssh(ep)
    backend.stop("i-stop")  # idempotent


def test_close_stops_every_instance(backend: SshBackend, client_key: ClientKey) -> None:
    endpoints = [backend.start(f"i-close-{n}", client_key.public_line) for n in range(2)]
    pids = set()
    for n, ep in enumerate(endpoints):
        with connect(ep, client_key.pkey) as client:
            run(client, "nohup sleep 1000 >/dev/null 2>&1 &")
        pids |= backend.pids(f"i-close-{n}")
    assert pids
    backend.close()
    assert not any(alive(p) for p in pids)
    assert backend.instance_ids() == []


def test_start_is_idempotent_per_instance(backend: SshBackend, client_key: ClientKey) -> None:
    first = backend.start("i-same", client_key.public_line)
    assert backend.start("i-same", client_key.public_line) == first


def test_bad_inputs_are_refused_before_anything_starts(backend: SshBackend, client_key: ClientKey) -> None:
    with pytest.raises(ValueError, match="no OpenSSH public key"):
        backend.start("i-bad-key", "not a key")
    with pytest.raises(ValueError, match="not a safe name"):
        backend.start("../escape", client_key.public_line)
    assert backend.instance_ids() == []


def test_commands_that_end_at_once_still_report_their_exit_status(backend: SshBackend, client_key: ClientKey) -> None:
    # The command's exit status and close must not overtake the server's "exec accepted" reply: a client still
    # waiting for that reply would see "Channel closed" (it once made the paramiko server flaky).
    ep = backend.start("i-quick", client_key.public_line)
    with connect(ep, client_key.pkey) as client:
        results = [run(client, f"exit {n % 4}") for n in range(60)]
    assert [code for code, _, _ in results] == [n % 4 for n in range(60)]
