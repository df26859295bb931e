"""SSH to burst instances with verified host keys.

Host keys are never auto-added. A target's key is either pinned (the provider reported it at launch) or
trusted on first use and recorded per *instance id* through `HostKeyTrust` (the daemon backs it with its
database). Any other key raises `HostKeyMismatch` before authentication. The OpenSSH command line built for
rsync (`rsync_ssh_command`) pins the very same key through a private known_hosts file.

Errors are split so the caller can decide what to retry:
- `SshUnavailable`: connection refused, timed out or dropped (the instance may still be booting, or gone);
- `RemoteCommandFailed`: the command ran and exited non-zero (or outlived its timeout);
- `HostKeyMismatch`: the host is not the machine we launched; never retried.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shlex
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import fabric
import fabric.runners
import invoke
import paramiko
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from orchestrator.errors import OperationalError
from runbooks.supervisor import pid_alive, process_start_ticks

_STDERR_TAIL_CHARS = 2000


# --- errors -----------------------------------------------------------------------------------------------
class RemoteError(OperationalError):
    """Base of every failure talking to an instance."""


class HostKeyMismatch(RemoteError):
    """The host presented a key other than the pinned or first-seen one: possibly not our machine."""


class SshUnavailable(RemoteError):
    """No usable SSH session: refused, timed out, dropped, or the handshake failed."""


class RemoteCommandFailed(RemoteError):
    """A remote command exited non-zero or ran past its timeout. The message names the program, not its args."""

    def __init__(self, message: str, *, argv: list[str], exit_code: int | None, stderr_tail: str) -> None:
        super().__init__(message)
        self.argv = argv
        # The remote command's status, None when it timed out. Not `exit_code`: that is burstctl's own exit status
        # (BurstctlError), which the CLI returns for an error that reaches it.
        self.remote_exit_code = exit_code
        self.stderr_tail = stderr_tail


# --- targets and host-key trust ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """One instance's SSH endpoint, as the provider reported it."""

    host: str
    port: int
    user: str
    key_path: Path  # the orchestrator's private key file (mode 0600)
    host_key: str | None  # pinned OpenSSH public key line ("ssh-ed25519 AAAA..."), None → trust on first use
    instance_id: str

    @property
    def known_hosts_name(self) -> str:
        """The host's name as OpenSSH and paramiko write it in known_hosts."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


class HostKeyTrust(Protocol):
    """Where first-seen host keys are recorded, per instance id."""

    def get(self, instance_id: str) -> str | None: ...

    def put(self, instance_id: str, key: str) -> None: ...


class MemoryHostKeyTrust:
    """In-process trust store (tests, one-shot tools)."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}
        self._lock = threading.Lock()

    def get(self, instance_id: str) -> str | None:
        with self._lock:
            return self._keys.get(instance_id)

    def put(self, instance_id: str, key: str) -> None:
        with self._lock:
            self._keys[instance_id] = key


class JsonFileHostKeyTrust:
    """Trust store in a JSON file `{instance_id: key line}`, rewritten atomically on every put."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def _load(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        if not isinstance(data, dict):
            raise RemoteError(f"{self.path}: expected a JSON object of instance id → host key")
        return {str(k): str(v) for k, v in data.items()}

    def get(self, instance_id: str) -> str | None:
        with self._lock:
            return self._load().get(instance_id)

    def put(self, instance_id: str, key: str) -> None:
        with self._lock:
            keys = self._load()
            keys[instance_id] = key
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            with os.fdopen(fd, "w") as f:
                json.dump(keys, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)


def normalize_key_line(line: str) -> str:
    """'type base64' from an OpenSSH public key line (drops a trailing comment); ValueError if malformed."""
    parts = line.strip().split()
    if len(parts) < 2:
        raise ValueError("a host key line is 'TYPE BASE64 [comment]'")
    try:
        base64.b64decode(parts[1], validate=True)
    except ValueError as e:
        raise ValueError("the host key's base64 blob does not decode") from e
    return f"{parts[0]} {parts[1]}"


def _pkey_from_line(line: str) -> paramiko.PKey:
    key_type, blob = normalize_key_line(line).split()
    return paramiko.PKey.from_type_string(key_type, base64.b64decode(blob))


def expected_host_key(target: Target, trust: HostKeyTrust) -> str | None:
    """The key this target must present: the pinned one, else the one recorded at first use, else None."""
    if target.host_key:
        return normalize_key_line(target.host_key)
    recorded = trust.get(target.instance_id)
    return normalize_key_line(recorded) if recorded else None


class _TrustOnFirstUse(paramiko.MissingHostKeyPolicy):
    """Only reached when no key is known for the instance: record the first key seen."""

    def __init__(self, target: Target, trust: HostKeyTrust) -> None:
        self.target = target
        self.trust = trust

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        line = f"{key.get_name()} {key.get_base64()}"
        # Another connection may have recorded a key meanwhile: it wins, and this one must match it.
        recorded = self.trust.get(self.target.instance_id)
        if recorded is not None and normalize_key_line(recorded) != line:
            raise HostKeyMismatch(f"instance {self.target.instance_id} at {self.target.known_hosts_name} "
                                  f"presented a {key.get_name()} host key that differs from the one recorded")
        if recorded is None:
            self.trust.put(self.target.instance_id, line)


# --- connections and commands --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    argv: list[str]
    exit_code: int
    stdout: str
    stderr: str


class _Remote(fabric.runners.Remote):
    """Fabric's remote runner, whose timeout kill tolerates a session already gone.

    A command's timeout kills it from a timer thread by closing its channel. When the command's IO threads fail
    first (the same close), `run` returns while that thread may still be closing the channel; a caller that then
    closes the connection makes the close fail in the thread, where nothing catches it (an unhandled exception
    printed to the daemon's stderr). A channel whose session is gone has nothing left to kill."""

    def kill(self) -> None:
        with contextlib.suppress(EOFError, OSError, paramiko.SSHException):
            super().kill()


def connect(target: Target, *, trust: HostKeyTrust, timeout_s: float = 10.0) -> fabric.Connection:
    """An open fabric Connection whose host key was verified (pinned, or trusted on first use)."""
    expected = expected_host_key(target, trust)
    # An explicit empty ssh_config: the user's ~/.ssh/config must not redirect or relax anything.
    config = fabric.Config(ssh_config=paramiko.SSHConfig(), overrides={"runners": {"remote": _Remote}})
    conn = fabric.Connection(
        target.host, user=target.user, port=target.port, config=config,
        connect_timeout=max(1, int(timeout_s)),
        connect_kwargs={"key_filename": [str(target.key_path)], "look_for_keys": False, "allow_agent": False,
                        "banner_timeout": timeout_s, "auth_timeout": timeout_s})
    client = conn.client
    if expected is not None:
        # A known key also makes paramiko negotiate that key type first; any other key is BadHostKeyException.
        client.get_host_keys().add(target.known_hosts_name, expected.split()[0], _pkey_from_line(expected))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
    else:
        client.set_missing_host_key_policy(_TrustOnFirstUse(target, trust))
    try:
        conn.open()
    except paramiko.BadHostKeyException as e:
        conn.close()
        origin = "pinned" if target.host_key else "recorded at first use"
        raise HostKeyMismatch(f"instance {target.instance_id} at {target.known_hosts_name} presented a "
                              f"{e.key.get_name()} host key that differs from the one {origin}") from None
    except HostKeyMismatch:
        conn.close()
        raise
    except paramiko.AuthenticationException as e:
        conn.close()
        raise SshUnavailable(f"instance {target.instance_id}: SSH authentication as {target.user} with "
                             f"{target.key_path} failed ({type(e).__name__})") from None
    except (OSError, EOFError, paramiko.SSHException) as e:
        conn.close()
        raise SshUnavailable(f"instance {target.instance_id}: no SSH session to {target.known_hosts_name}: "
                             f"{_describe(e)}") from None
    return conn



class SharedConnection:
    """One SSH connection to an instance, opened when a step first asks for it and shared by the steps after it (a
    sync's checkpoint pull, then its logs: each SSH handshake is a tenth of a second, benchmarks/sync_logs.py). A
    step that failed drops it, so that the next one connects afresh."""

    def __init__(self, target: Target, trust: HostKeyTrust) -> None:
        self.target, self.trust = target, trust
        self._conn: fabric.Connection | None = None

    def get(self) -> fabric.Connection:
        if self._conn is None:
            self._conn = connect(self.target, trust=self.trust)
        return self._conn

    def drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # closing a broken connection may fail too
                self._conn.close()
            self._conn = None

    def __enter__(self) -> SharedConnection:
        return self

    def __exit__(self, *_: object) -> None:
        self.drop()

def _describe(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):  # one error per address tried
        reasons = {_describe(e) for e in exc.errors.values()}
        return ", ".join(sorted(reasons))
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]


def wait_for_ssh(target: Target, trust: HostKeyTrust, timeout_s: float, interval_s: float = 1.0) -> None:
    """Return once an SSH session opens; SshUnavailable after timeout_s. A wrong host key fails at once."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        try:
            conn = connect(target, trust=trust, timeout_s=max(1.0, min(10.0, remaining)))
        except SshUnavailable as e:
            last = str(e)
        else:
            conn.close()
            return
        if time.monotonic() + interval_s > deadline:
            raise SshUnavailable(f"instance {target.instance_id}: SSH not ready after {timeout_s:g} s ({last})")
        time.sleep(interval_s)


class _Stdin(io.StringIO):
    """A command's stdin for invoke, which reads a stream that is not a terminal one character per poll, 10 ms apart:
    100 characters a second (a 700-byte checkpoint manifest took 7 s). Each read here returns up to 64 KiB."""

    def read(self, size: int | None = -1) -> str:
        return super().read(-1 if size is None or size < 0 else max(size, 64 * 1024))


def run(conn: fabric.Connection, argv: list[str], *, timeout: float | None = 300.0, check: bool = True,
        stdin: str | None = None) -> Result:
    """Run argv on the instance (quoted with shlex.join: no word is ever re-interpreted by the shell). `stdin`, if
    given, is the command's standard input, then end of file."""
    if not argv:
        raise ValueError("argv must name a program")
    command = shlex.join(argv)
    program = os.path.basename(argv[0])
    started = time.monotonic()
    try:
        res = conn.run(command, hide=True, warn=True, timeout=timeout, pty=False,
                       in_stream=(_Stdin(stdin) if stdin is not None else False))
    except invoke.CommandTimedOut as e:
        tail = (e.result.stderr or "")[-_STDERR_TAIL_CHARS:]
        raise RemoteCommandFailed(f"{program} on {conn.host} ran past its {timeout:g} s timeout",
                                  argv=argv, exit_code=None, stderr_tail=tail) from None
    except (OSError, EOFError, paramiko.SSHException, invoke.exceptions.ThreadException) as e:
        # invoke's timeout closes the channel under its IO threads, which then may fail instead of it reporting
        # CommandTimedOut: a live transport past the deadline means a timeout, not a dropped session.
        if timeout is not None and time.monotonic() - started >= timeout and conn.is_connected:
            raise RemoteCommandFailed(f"{program} on {conn.host} ran past its {timeout:g} s timeout",
                                      argv=argv, exit_code=None, stderr_tail="") from None
        raise SshUnavailable(f"SSH session to {conn.host}:{conn.port} dropped while running {program}: "
                             f"{_describe(e)}") from None
    result = Result(argv=list(argv), exit_code=int(res.exited), stdout=res.stdout, stderr=res.stderr)
    if res.exited == -1 and timeout is not None and time.monotonic() - started >= timeout and conn.is_connected:
        # Under load invoke may also hand back a result with no exit status once the timeout closed the channel.
        raise RemoteCommandFailed(f"{program} on {conn.host} ran past its {timeout:g} s timeout",
                                  argv=argv, exit_code=None, stderr_tail=res.stderr[-_STDERR_TAIL_CHARS:])
    if res.exited == -1 or not conn.is_connected:
        # paramiko reports -1 when the channel closed without an exit status: the session went away.
        raise SshUnavailable(f"SSH session to {conn.host}:{conn.port} dropped while running {program}")
    if check and result.exit_code != 0:
        tail = result.stderr[-_STDERR_TAIL_CHARS:].strip()
        last_line = tail.splitlines()[-1] if tail else "no stderr"
        raise RemoteCommandFailed(f"{program} on {conn.host} exited {result.exit_code}: {last_line}",
                                  argv=list(argv), exit_code=result.exit_code, stderr_tail=tail)
    return result


# --- OpenSSH command line for rsync --------------------------------------------------------------------------
KNOWN_HOSTS_PREFIX = "burstctl-known-hosts-"
# Where this process writes the private known_hosts files of its pinned ssh commands (`keep_known_hosts_in`); None:
# the system's temporary directory.
_KNOWN_HOSTS_DIR: Path | None = None


def keep_known_hosts_in(directory: Path) -> None:
    """Write this process's private known_hosts files (`pinned_ssh_argv`) under `directory`, the state's: one left by
    a process killed outright (SIGKILL, the OOM killer: its `finally` never ran) is removed there by the next daemon
    (`remove_orphaned_known_hosts`). In the system's temporary directory they piled up, one per killed transfer."""
    global _KNOWN_HOSTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    _KNOWN_HOSTS_DIR = directory


def _owner_prefix() -> str:
    """A known_hosts file's name begins with the process that wrote it: its pid and its start (pids are reused; 0
    where the start is not known, without /proc)."""
    pid = os.getpid()
    return f"{KNOWN_HOSTS_PREFIX}{pid}-{process_start_ticks(pid) or 0}-"


def remove_orphaned_known_hosts(directory: Path) -> int:
    """Remove the known_hosts files under `directory` whose process is gone (killed outright while a transfer ran);
    a live process's (a revert-local beside the daemon) are its own. Returns how many were removed."""
    removed = 0
    for path in directory.glob(f"{KNOWN_HOSTS_PREFIX}*") if directory.is_dir() else []:
        pid, _, rest = path.name[len(KNOWN_HOSTS_PREFIX):].partition("-")
        start = rest.partition("-")[0]
        if pid.isdigit() and start.isdigit() and pid_alive(int(pid), int(start) or None):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


def ssh_argv(target: Target, known_hosts: Path, *, connect_timeout_s: int = 10) -> list[str]:
    """`ssh` options that pin the host key in `known_hosts` and never prompt, guess or fall back."""
    return ["ssh", "-F", "none", "-p", str(target.port), "-i", str(target.key_path), "-l", target.user,
            "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes", "-o", "UpdateHostKeys=no",
            "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout_s}", "-o", "ServerAliveInterval=15",
            "-o", "ServerAliveCountMax=4", "-o", "LogLevel=ERROR"]


@contextlib.contextmanager
def pinned_ssh_argv(target: Target, trust: HostKeyTrust, *, connect_timeout_s: int = 10) -> Iterator[list[str]]:
    """`ssh` and its options (`ssh_argv`; the host and a command go after them), with a private known_hosts file
    holding exactly the expected key.

    The key must already be known (pinned, or recorded by a first `connect`); the file is removed on exit, and,
    under `keep_known_hosts_in`'s directory, by the next daemon if this process is killed before (its name says
    whose it is).
    """
    expected = expected_host_key(target, trust)
    if expected is None:
        raise HostKeyMismatch(f"instance {target.instance_id}: no host key pinned or recorded yet; "
                              "connect() once first so it is trusted on first use")
    fd, path = tempfile.mkstemp(prefix=_owner_prefix(), dir=_KNOWN_HOSTS_DIR)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{target.known_hosts_name} {expected}\n")
        argv = ssh_argv(target, Path(path), connect_timeout_s=connect_timeout_s)
        # Offer the pinned key type first, so a host with several keys cannot fail on the "wrong" one.
        argv[1:1] = ["-o", f"HostKeyAlgorithms={expected.split()[0]}"]
        yield argv
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def rsync_ssh_command(target: Target, trust: HostKeyTrust, *, connect_timeout_s: int = 10) -> Iterator[str]:
    """The string for `rsync -e` (`pinned_ssh_argv`)."""
    with pinned_ssh_argv(target, trust, connect_timeout_s=connect_timeout_s) as argv:
        yield shlex.join(argv)  # rsync splits -e on whitespace and honours these quotes


# --- the orchestrator's own key --------------------------------------------------------------------------------
def generate_keypair(path: str | Path, comment: str = "burstctl") -> str:
    """Write a new ed25519 private key (OpenSSH format, mode 0600) at `path`; return its public key line.

    The public line is also written to `path`.pub. Refuses to overwrite an existing key.
    """
    path = Path(path)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(path, 0o600)  # os.open's mode is filtered by the umask; say it explicitly
    public = key.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()
    line = f"{public} {comment}" if comment else public
    Path(f"{path}.pub").write_text(line + "\n")
    return line
