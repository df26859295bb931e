"""simcloud's pure-Python SSH machine: a paramiko server on 127.0.0.1 for hosts without OpenSSH's sshd.

- exec channels run the command with the login shell (`$SHELL -c`) as a real subprocess in the sandbox,
  streaming stdin/stdout/stderr and returning the exit status (128+N when killed by signal N);
- a shell request without a command runs the shell reading stdin (no pty: enough for scripts);
- the SFTP subsystem serves real absolute paths, resolves relative ones against the sandbox, and refuses
  anything outside the sandbox; rsync works too when the `rsync` binary exists (it is just an exec).

Each subprocess starts in a new session with a clean environment (never the server's: it may hold API keys)
carrying the instance marker, so `ssh_procs.kill_instance` finds it and every descendant.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import paramiko
from paramiko.common import (
    AUTH_FAILED,
    AUTH_SUCCESSFUL,
    OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED,
    OPEN_SUCCEEDED,
    cMSG_CHANNEL_FAILURE,
    cMSG_CHANNEL_SUCCESS,
)
from paramiko.message import Message
from paramiko.sftp import SFTP_FAILURE, SFTP_OK

from providers.simcloud.ssh_keys import PublicKey

_CHUNK = 32768


class _Outside(OSError):
    """A path outside the sandbox: answered as permission denied."""

    def __init__(self) -> None:
        super().__init__(errno.EACCES, "outside the instance sandbox")


def _sftp_status(e: OSError) -> int:
    """The SFTP status code for a failed file operation (no errno: a plain failure, as convert_errno answers)."""
    return SFTP_FAILURE if e.errno is None else paramiko.SFTPServer.convert_errno(e.errno)


class _Handle(paramiko.SFTPHandle):
    """An open file; `stat`/`chattr` on the handle (fstat, fsetstat) act on the real file."""

    filename: str
    readfile: Any
    writefile: Any

    def stat(self) -> paramiko.SFTPAttributes | int:
        try:
            return paramiko.SFTPAttributes.from_stat(os.fstat(self.readfile.fileno()))
        except OSError as e:
            return _sftp_status(e)

    def chattr(self, attr: paramiko.SFTPAttributes) -> int:
        try:
            if attr.st_mode is not None:
                os.chmod(self.filename, attr.st_mode & 0o7777)
            if attr.st_atime is not None and attr.st_mtime is not None:
                os.utime(self.filename, (attr.st_atime, attr.st_mtime))
        except OSError as e:
            return _sftp_status(e)
        return SFTP_OK


class SandboxSftp(paramiko.SFTPServerInterface):
    """SFTP over the real filesystem, confined to one sandbox directory."""

    def __init__(self, server: paramiko.ServerInterface, sandbox: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(server, *args, **kwargs)
        self.sandbox = os.path.realpath(sandbox)

    def _path(self, path: str | bytes) -> str:
        if isinstance(path, bytes):
            path = path.decode()
        full = os.path.normpath(os.path.join(self.sandbox, path))  # join keeps absolute paths as they are
        real = os.path.realpath(full)
        if real != self.sandbox and not real.startswith(self.sandbox + "/"):
            raise _Outside()
        return full

    def canonicalize(self, path: str) -> str:
        try:
            return os.path.realpath(self._path(path))
        except OSError:
            return self.sandbox

    def list_folder(self, path: str) -> list[paramiko.SFTPAttributes] | int:
        try:
            folder = self._path(path)
            return [paramiko.SFTPAttributes.from_stat(os.lstat(os.path.join(folder, n)), n)
                    for n in os.listdir(folder)]
        except OSError as e:
            return _sftp_status(e)

    def stat(self, path: str) -> paramiko.SFTPAttributes | int:
        try:
            return paramiko.SFTPAttributes.from_stat(os.stat(self._path(path)))
        except OSError as e:
            return _sftp_status(e)

    def lstat(self, path: str) -> paramiko.SFTPAttributes | int:
        try:
            return paramiko.SFTPAttributes.from_stat(os.lstat(self._path(path)))
        except OSError as e:
            return _sftp_status(e)

    def open(self, path: str, flags: int, attr: paramiko.SFTPAttributes) -> paramiko.SFTPHandle | int:
        try:
            full = self._path(path)
            mode = attr.st_mode if attr is not None and attr.st_mode is not None else 0o666
            fd = os.open(full, flags | getattr(os, "O_BINARY", 0), mode & 0o7777)
        except OSError as e:
            return _sftp_status(e)
        if flags & os.O_WRONLY:
            fmode = "ab" if flags & os.O_APPEND else "wb"
        elif flags & os.O_RDWR:
            fmode = "a+b" if flags & os.O_APPEND else "r+b"
        else:
            fmode = "rb"
        handle = _Handle(flags)
        f = os.fdopen(fd, fmode)
        handle.filename = full
        handle.readfile = f
        handle.writefile = f
        return handle

    def _do(self, fn: Any, *args: Any) -> int:
        try:
            fn(*args)
        except OSError as e:
            return _sftp_status(e)
        return SFTP_OK

    def remove(self, path: str) -> int:
        return self._do(lambda: os.remove(self._path(path)))

    def rename(self, oldpath: str, newpath: str) -> int:
        return self._do(lambda: os.rename(self._path(oldpath), self._path(newpath)))

    def posix_rename(self, oldpath: str, newpath: str) -> int:
        return self._do(lambda: os.replace(self._path(oldpath), self._path(newpath)))

    def mkdir(self, path: str, attr: paramiko.SFTPAttributes) -> int:
        mode = attr.st_mode if attr is not None and attr.st_mode is not None else 0o777
        return self._do(lambda: os.mkdir(self._path(path), mode & 0o7777))

    def rmdir(self, path: str) -> int:
        return self._do(lambda: os.rmdir(self._path(path)))

    def chattr(self, path: str, attr: paramiko.SFTPAttributes) -> int:
        def apply() -> None:
            full = self._path(path)
            if attr.st_mode is not None:
                os.chmod(full, attr.st_mode & 0o7777)
            if attr.st_atime is not None and attr.st_mtime is not None:
                os.utime(full, (attr.st_atime, attr.st_mtime))
            if attr.st_size is not None and os.path.isfile(full):
                os.truncate(full, attr.st_size)
        return self._do(apply)

    def symlink(self, target_path: str, path: str) -> int:
        return self._do(lambda: os.symlink(target_path, self._path(path)))

    def readlink(self, path: str) -> str | int:
        try:
            return os.readlink(self._path(path))
        except OSError as e:
            return _sftp_status(e)


class _Session(paramiko.ServerInterface):
    def __init__(self, machine: ParamikoMachine) -> None:
        self.machine = machine

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        offered = PublicKey(key.get_name(), key.get_base64())
        if username == self.machine.user and offered in self.machine.authorized:
            return AUTH_SUCCESSFUL
        return AUTH_FAILED

    def check_channel_request(self, kind: str, chanid: int) -> int:
        if kind == "session" and not self.machine.stopped:
            return OPEN_SUCCEEDED
        return OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        return self.machine.run(channel, command.decode(errors="replace"))

    def check_channel_shell_request(self, channel: paramiko.Channel) -> bool:
        return self.machine.run(channel, None)

    def check_channel_pty_request(self, *args: Any) -> bool:
        return True  # accepted but not allocated: commands run on pipes

    def check_channel_env_request(self, channel: paramiko.Channel, name: bytes, value: bytes) -> bool:
        return False


class _ReplyOrderedTransport(paramiko.Transport):
    """Tells when the reply to a channel's exec/shell request has gone out.

    paramiko calls `check_channel_exec_request` and only then sends the request's success reply. A command that
    ends at once (`nohup x &`) would have its exit status and close sent first, and the client, still waiting for
    the reply, sees "Channel closed". So a command's output waits for its reply (`replied(channel)`)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self._awaiting: dict[int, threading.Event] = {}
        self._awaiting_lock = threading.Lock()

    def replied(self, channel: paramiko.Channel) -> threading.Event:
        with self._awaiting_lock:
            return self._awaiting.setdefault(channel.remote_chanid, threading.Event())

    def _send_user_message(self, data: Message) -> None:  # paramiko's one path for channel replies
        super()._send_user_message(data)  # type: ignore[misc]  # a private method types-paramiko leaves out
        raw = data.asbytes()
        if raw[:1] in (cMSG_CHANNEL_SUCCESS, cMSG_CHANNEL_FAILURE) and len(raw) >= 5:
            with self._awaiting_lock:
                event = self._awaiting.pop(int.from_bytes(raw[1:5], "big"), None)
            if event is not None:
                event.set()


class ParamikoMachine:
    """One instance's SSH endpoint: a listening socket, its connections and the processes they started."""

    def __init__(self, *, sandbox: Path, host_key_path: Path, authorized: list[PublicKey], user: str,
                 env: Mapping[str, str], shell: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sandbox = sandbox
        self.user = user
        self.authorized = authorized
        self.env = dict(env)
        self.shell = shell
        self.stopped = False
        self._host_key = paramiko.Ed25519Key(filename=str(host_key_path))
        self._lock = threading.Lock()
        self._transports: list[paramiko.Transport] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(32)
        self._listener.settimeout(0.2)  # so the accept loop notices stop()
        self.port: int = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"sim-ssh-{self.port}", daemon=True)
        self._accept_thread.start()

    def _accept_loop(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        transport = _ReplyOrderedTransport(conn)
        transport.add_server_key(self._host_key)
        transport.set_subsystem_handler("sftp", paramiko.SFTPServer, SandboxSftp, str(self.sandbox))
        with self._lock:
            if self.stopped:
                transport.close()
                return
            self._transports.append(transport)
        with contextlib.suppress(paramiko.SSHException, EOFError, OSError):
            transport.start_server(server=_Session(self))

    def run(self, channel: paramiko.Channel, command: str | None) -> bool:
        """Start the command (or an interactive shell) for this channel; False refuses the request."""
        argv = [self.shell, "-c", command] if command is not None else [self.shell]
        with self._lock:
            if self.stopped:
                return False
            try:
                proc = subprocess.Popen(argv, cwd=self.sandbox, env=self.env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            except OSError:
                return False
            self._procs.append(proc)
        # Every transport of this machine is one (`_serve` makes them); get_transport() is typed as the base class.
        replied = cast(_ReplyOrderedTransport, channel.get_transport()).replied(channel)
        threading.Thread(target=self._pump, args=(channel, proc, replied), daemon=True).start()
        return True

    def _pump(self, channel: paramiko.Channel, proc: subprocess.Popen[bytes], replied: threading.Event) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        replied.wait(timeout=10.0)  # nothing reaches the client before "exec accepted" (see _ReplyOrderedTransport)

        def copy_out(fd: int, send: Any) -> None:
            with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
                while data := os.read(fd, _CHUNK):
                    send(data)

        def copy_in() -> None:
            with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
                while data := channel.recv(_CHUNK):
                    proc.stdin.write(data)  # type: ignore[union-attr]
                    proc.stdin.flush()  # type: ignore[union-attr]
            with contextlib.suppress(OSError):
                proc.stdin.close()  # type: ignore[union-attr]

        outs = [threading.Thread(target=copy_out, args=(proc.stdout.fileno(), channel.sendall), daemon=True),
                threading.Thread(target=copy_out, args=(proc.stderr.fileno(), channel.sendall_stderr), daemon=True)]
        for t in outs:
            t.start()
        threading.Thread(target=copy_in, daemon=True).start()
        rc = proc.wait()
        for t in outs:
            # A backgrounded grandchild may hold stdout open forever; the exit status must not wait for it.
            t.join(timeout=3.0)
        with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            channel.send_exit_status(rc if rc >= 0 else 128 - rc)
            channel.shutdown_write()
            channel.close()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        with self._lock:
            if proc in self._procs:
                self._procs.remove(proc)

    def stop(self) -> None:
        """Refuse new sessions and drop connections. Killing the processes is the caller's job (ssh_procs)."""
        with self._lock:
            self.stopped = True
            transports, self._transports = self._transports, []
        with contextlib.suppress(OSError):
            self._listener.close()
        for t in transports:
            t.close()
        self._accept_thread.join(timeout=2.0)

    def reap(self) -> None:
        """Collect the exit status of our direct children once they were killed (no zombies left)."""
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5.0)
