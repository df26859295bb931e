"""simcloud's machines: each instance is a sandbox directory plus a real SSH endpoint on 127.0.0.1.

Layout under the simcloud state dir, per instance:

    instances/<id>/sandbox/   the instance's disk: sessions start here, $HOME points here
    instances/<id>/machine/   sshd_config, host key, authorized_keys, session entry script, sshd.log

Two kinds of endpoint, chosen by `prefer`:

- "openssh": a per-instance `sshd -D -e` child in its own session, with its own ed25519 host key and config
  (ListenAddress 127.0.0.1, a free port, the launch's key as the only authorized key, no passwords,
  `StrictModes no`, `UsePAM no`). Sessions start in the sandbox through `ForceCommand` pointing at a tiny
  entry script that `cd`s there and runs the client's command with the login shell; because ForceCommand
  also captures subsystems, SFTP is the external `sftp-server -d <sandbox>` (run by that same script), not
  internal-sftp. rsync and sftp work as on any host.
- "paramiko": `ssh_paramiko.ParamikoMachine`, a pure-Python server (exec + SFTP), for hosts without sshd.
- "auto" (default): openssh when sshd and sftp-server are installed, else paramiko.

Every process of an instance carries the environment marker `BURSTCTL_SIM_INSTANCE=<backend token>/<id>`;
`stop()` freezes, then kills, the sshd listener with everything it forked, every marked process, anything
working in the sandbox and anything in a marked session (`ssh_procs.kill_instance`), so a `nohup ... &`
trainer really dies at a preemption. The sandbox is deleted at stop, as a cloud deletes a terminated
instance's disk (keep_sandboxes=True keeps it for debugging).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from providers.simcloud.backend import Endpoint
from providers.simcloud.ssh_keys import parse_public_keys, write_ed25519_host_key
from providers.simcloud.ssh_paramiko import ParamikoMachine
from providers.simcloud.ssh_procs import MARKER_VAR, instance_pids, kill_instance

Prefer = Literal["auto", "openssh", "paramiko"]

_INSTANCE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SFTP_SERVERS = ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server", "/usr/libexec/sftp-server",
                 "/usr/lib/ssh/sftp-server")
_PRIVSEP_MISSING = re.compile(r"Missing privilege separation directory: (\S+)")


class MachineStartError(RuntimeError):
    """The instance's SSH endpoint did not come up."""


def find_sshd() -> str | None:
    found = shutil.which("sshd") or ("/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else None)
    return found


def find_sftp_server() -> str | None:
    return next((p for p in _SFTP_SERVERS if os.access(p, os.X_OK)), None)


def openssh_available() -> bool:
    return find_sshd() is not None and find_sftp_server() is not None


@dataclass
class _Machine:
    instance_id: str
    marker: str
    root: Path
    sandbox: Path
    endpoint: Endpoint
    sshd: subprocess.Popen[bytes] | None = None
    paramiko: ParamikoMachine | None = None
    stopped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class SshBackend:
    """`InstanceBackend` whose instances are sandboxes reachable over real SSH on 127.0.0.1."""

    def __init__(self, state_dir: str | Path, *, prefer: Prefer = "auto", keep_sandboxes: bool = False,
                 start_timeout_s: float = 15.0) -> None:
        if prefer not in ("auto", "openssh", "paramiko"):
            raise ValueError(f"prefer must be auto, openssh or paramiko, not {prefer!r}")
        if prefer == "openssh" and not openssh_available():
            raise MachineStartError("OpenSSH's sshd or sftp-server is not installed (use prefer='paramiko')")
        self.mode: Literal["openssh", "paramiko"] = (
            "openssh" if prefer == "openssh" or (prefer == "auto" and openssh_available()) else "paramiko")
        self.state_dir = Path(state_dir).resolve()
        if '"' in str(self.state_dir) or "\n" in str(self.state_dir):
            raise ValueError("the simcloud state dir may not contain '\"' or a newline (it goes into sshd_config)")
        self.keep_sandboxes = keep_sandboxes
        self.start_timeout_s = start_timeout_s
        self.token = uuid.uuid4().hex[:12]  # two simcloud servers never kill each other's processes
        account = pwd.getpwuid(os.getuid())
        self.user = account.pw_name
        self.shell = account.pw_shell if os.access(account.pw_shell, os.X_OK) else "/bin/sh"
        self._machines: dict[str, _Machine] = {}
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()  # one boot at a time: ports and sshd's first config check
        self._sshd_checked = False
        self._closed = False

    # --- the InstanceBackend protocol ------------------------------------------------------------------
    def start(self, instance_id: str, ssh_public_key: str, *, host: str = "127.0.0.1", port: int | None = None,
              env: Mapping[str, str] | None = None) -> Endpoint:
        """Bring the machine up. `host` is a loopback address (the simulated EC2 gives each instance its own
        127.x private IP) and `port` a fixed port (else a free one); `env` is added to every session's environment
        (e.g. the instance's metadata-service endpoint)."""
        if not _INSTANCE_ID.match(instance_id):
            raise ValueError(f"instance id {instance_id!r} is not a safe name (letters, digits, . _ -)")
        keys = parse_public_keys(ssh_public_key)
        with self._start_lock:
            with self._lock:
                if self._closed:
                    raise MachineStartError("the backend is closed")
                existing = self._machines.get(instance_id)
                if existing is not None and not existing.stopped:
                    return existing.endpoint
            root = self.state_dir / "instances" / instance_id
            machine_dir, sandbox = root / "machine", root / "sandbox"
            shutil.rmtree(root, ignore_errors=True)  # a previous life of this id left nothing we want
            machine_dir.mkdir(parents=True, mode=0o700)
            sandbox.mkdir(mode=0o755)
            host_key_path = machine_dir / "ssh_host_ed25519_key"
            host_key = write_ed25519_host_key(host_key_path)
            marker = f"{self.token}/{instance_id}"
            extra_env = dict(env or {})
            try:
                if self.mode == "openssh":
                    (machine_dir / "authorized_keys").write_text("".join(k.line + "\n" for k in keys))
                    proc, bound = self._start_sshd(machine_dir, sandbox, marker, host, port, extra_env)
                    machine = _Machine(instance_id, marker, root, sandbox,
                                       Endpoint(host, bound, host_key, self.user, str(sandbox)), sshd=proc)
                else:
                    server = ParamikoMachine(sandbox=sandbox, host_key_path=host_key_path, authorized=keys,
                                             user=self.user, env={**self._session_env(sandbox, marker), **extra_env},
                                             shell=self.shell, host=host, port=port or 0)
                    machine = _Machine(instance_id, marker, root, sandbox,
                                       Endpoint(host, server.port, host_key, self.user, str(sandbox)),
                                       paramiko=server)
            except BaseException:
                kill_instance(marker, sandbox)
                if not self.keep_sandboxes:
                    shutil.rmtree(root, ignore_errors=True)
                raise
            with self._lock:
                self._machines[instance_id] = machine
            return machine.endpoint

    def stop(self, instance_id: str) -> None:
        with self._lock:
            machine = self._machines.get(instance_id)
        if machine is None:
            return
        self._stop(machine)
        with self._lock:
            if self._machines.get(instance_id) is machine:
                del self._machines[instance_id]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            machines = list(self._machines.values())
        for m in machines:
            self.stop(m.instance_id)

    # --- faults -----------------------------------------------------------------------------------------
    def interrupt_ssh(self, instance_id: str, seconds: float) -> None:
        """The instance's SSH goes away for `seconds`, as when its sshd restarts or its network blips: the listener
        and every SSH session it serves end at once (a transfer under way breaks), connections are refused
        meanwhile, then it listens again on the same address with the same host key. What runs on the instance
        outside SSH (a daemonized supervisor, its trainer) carries on. OpenSSH endpoints only."""
        with self._lock:
            machine = self._machines.get(instance_id)
        if machine is None or machine.stopped:
            raise ValueError(f"instance {instance_id} has no machine up")
        if machine.sshd is None:
            raise ValueError("only an OpenSSH endpoint can be interrupted (this backend runs paramiko)")
        with machine.lock:
            listener = machine.sshd
            for pid in _sshd_tree(listener.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            listener.wait()
            sshd = find_sshd()
            assert sshd is not None  # it ran this instance's listener
            argv = [sshd, "-D", "-e", "-f", str(machine.root / "machine" / "sshd_config")]  # as `_start_sshd` does
        threading.Thread(target=self._resume_ssh, args=(machine, listener, argv, seconds), daemon=True,
                         name=f"simcloud-ssh-{instance_id}").start()

    def _resume_ssh(self, machine: _Machine, was: subprocess.Popen[bytes], argv: list[str], seconds: float) -> None:
        time.sleep(seconds)
        with machine.lock:
            if machine.stopped or machine.sshd is not was:
                return
            log_path = machine.root / "machine" / "sshd.log"
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), MARKER_VAR: machine.marker}
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                        start_new_session=True)
            machine.sshd = proc
            _wait_for_sshd(proc, machine.endpoint.host, machine.endpoint.port, log_path, self.start_timeout_s)

    # --- inspection (status, tests) ---------------------------------------------------------------------
    def endpoint(self, instance_id: str) -> Endpoint | None:
        with self._lock:
            m = self._machines.get(instance_id)
        return m.endpoint if m is not None and not m.stopped else None

    def instance_ids(self) -> list[str]:
        with self._lock:
            return [i for i, m in self._machines.items() if not m.stopped]

    def pids(self, instance_id: str) -> set[int]:
        """Live processes of the instance (its sshd included), found the way stop() finds them."""
        with self._lock:
            m = self._machines.get(instance_id)
        if m is None:
            return set()
        return instance_pids(m.marker, m.sandbox, {m.sshd.pid} if m.sshd is not None else ())

    # --- internals --------------------------------------------------------------------------------------
    def _session_env(self, sandbox: Path, marker: str) -> dict[str, str]:
        # Never the server's own environment: it may hold API keys.
        return {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": str(sandbox),
                "USER": self.user, "LOGNAME": self.user, "SHELL": self.shell, "LANG": "C.UTF-8",
                MARKER_VAR: marker}

    def _stop(self, machine: _Machine) -> None:
        with machine.lock:
            if machine.stopped:
                return
            if machine.paramiko is not None:
                machine.paramiko.stop()
            # The sshd listener is a root: frozen first with everything it forked, so no session starts mid-sweep.
            roots = {machine.sshd.pid} if machine.sshd is not None else set()
            kill_instance(machine.marker, machine.sandbox, roots)
            if machine.sshd is not None:
                machine.sshd.wait()
            if machine.paramiko is not None:
                machine.paramiko.reap()
            if not self.keep_sandboxes:
                shutil.rmtree(machine.root, ignore_errors=True)
            machine.stopped = True

    def _write_sshd_config(self, machine_dir: Path, sandbox: Path, marker: str, host: str, port: int,
                           env: Mapping[str, str]) -> Path:
        sftp_server = find_sftp_server()
        entry = machine_dir / "session.sh"
        # The client's command arrives in SSH_ORIGINAL_COMMAND; the subsystem's too (see module docstring).
        entry.write_text(
            "#!/bin/sh\n"
            "# simcloud: every session of this instance starts in its sandbox.\n"
            f"cd {shlex.quote(str(sandbox))} || exit 1\n"
            'if [ -z "$SSH_ORIGINAL_COMMAND" ]; then exec "${SHELL:-/bin/sh}" -l; fi\n'
            'exec "${SHELL:-/bin/sh}" -c "$SSH_ORIGINAL_COMMAND"\n'
        )
        entry.chmod(0o755)
        path_env = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        config = machine_dir / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {host}",
            f"Port {port}",
            f'HostKey "{machine_dir / "ssh_host_ed25519_key"}"',
            f'AuthorizedKeysFile "{machine_dir / "authorized_keys"}"',
            f'PidFile "{machine_dir / "sshd.pid"}"',
            f"AllowUsers {self.user}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "PermitUserEnvironment no",
            "UsePAM no",
            "StrictModes no",  # the key files live in a tmp/state dir we own, not in ~/.ssh
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            "LogLevel INFO",
            "SetEnv " + " ".join(f'"{k}={v}"' for k, v in
                                 {MARKER_VAR: marker, "HOME": str(sandbox), "PATH": path_env, **env}.items()),
            f'ForceCommand "{entry}"',
            f'Subsystem sftp "{sftp_server}" -d "{sandbox}"',
            "",
        ]))
        return config

    def _check_sshd_config(self, sshd: str, config: Path) -> None:
        """`sshd -t` once per backend; creates the privilege-separation dir sshd insists on when root."""
        for _ in range(2):
            res = subprocess.run([sshd, "-t", "-f", str(config)], capture_output=True, text=True, timeout=30)
            if res.returncode == 0:
                self._sshd_checked = True
                return
            missing = _PRIVSEP_MISSING.search(res.stderr)
            if missing is None:
                break
            os.makedirs(missing.group(1), mode=0o755, exist_ok=True)
        lines = res.stderr.strip().splitlines()
        raise MachineStartError(f"sshd rejected its config: {lines[-1] if lines else 'exit ' + str(res.returncode)}")

    def _start_sshd(self, machine_dir: Path, sandbox: Path, marker: str, host: str, fixed_port: int | None,
                    env: Mapping[str, str]) -> tuple[subprocess.Popen[bytes], int]:
        sshd = find_sshd()
        assert sshd is not None
        log_path = machine_dir / "sshd.log"
        last_error = "no attempt"
        for _ in range(1 if fixed_port else 3):  # a probed free port can be taken before sshd binds: try another
            port = fixed_port or _free_port(host)
            config = self._write_sshd_config(machine_dir, sandbox, marker, host, port, env)
            if not self._sshd_checked:
                self._check_sshd_config(sshd, config)
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    [sshd, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), MARKER_VAR: marker},
                    start_new_session=True)
            if _wait_for_sshd(proc, host, port, log_path, self.start_timeout_s):
                return proc, port
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            tail = log_path.read_text(errors="replace").strip().splitlines()
            last_error = tail[-1] if tail else f"sshd exited with {proc.returncode}"
        raise MachineStartError(f"sshd did not start: {last_error}")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_for_sshd(proc: subprocess.Popen[bytes], host: str, port: int, log_path: Path, timeout_s: float) -> bool:
    """True once *this* sshd logged that it listens and the port answers with an SSH banner."""
    deadline = time.monotonic() + timeout_s
    listening = f"Server listening on {host} port {port}"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if listening in log_path.read_text(errors="replace"):
            try:
                with socket.create_connection((host, port), timeout=2.0) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return True
            except OSError:
                pass
        time.sleep(0.02)
    return False


def _sshd_tree(listener: int) -> list[int]:
    """The listener and its sshd descendants (one per connection, and their privilege-separated children): not the
    shells and commands the sessions run, which end when their connection does."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [listener]
    while stack:
        pid = stack.pop()
        try:
            comm = (Path("/proc") / str(pid) / "comm").read_text().strip()
        except OSError:
            continue
        if pid == listener or comm.startswith("sshd"):
            found.append(pid)
            stack.extend(children.get(pid, ()))
    return found
