"""burstctl's own child processes for the demo and rehearsals: simcloud and a daemon, each in its own session with
its log in a folder, stopped in reverse order (the daemon before simcloud, so it never sees its cloud vanish).

Every child reads the private config it is given and nothing else: `--config` comes first on its command line and
`$BURSTCTL_CONFIG` is removed from its environment, so the user's own config (`$BURSTCTL_CONFIG`, `./burstctl.toml`,
`~/.config/burstctl/config.toml`) never reaches it — its `api_key_env` or state directory would not match the
private cloud's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from orchestrator.child_records import ChildRecord, write_down
from orchestrator.errors import OperationalError

ERROR_PREFIX = "burstctl: error: "


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/burstctl, or ~/.cache/burstctl (a relative $XDG_CACHE_HOME is ignored, as the XDG base
    directory specification asks): where the demo runs and rehearsals are written down."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "burstctl"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a child server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.2,
               check: Callable[[], None] | None = None) -> Any:
    """pred()'s first truthy value; OperationalError naming `what` after `timeout` seconds. `check`, called before
    every try, raises to stop waiting for something that can no longer happen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check is not None:
            check()
        got = pred()
        if got:
            return got
        time.sleep(interval)
    raise OperationalError(f"timed out after {timeout:.0f} s waiting for {what}")


def last_line(path: Path) -> str:
    """The last non-empty line of a child's log, without the CLI's error prefix; '' when there is none."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    line = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
    return line.removeprefix(ERROR_PREFIX)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Children:
    """While any child runs, SIGTERM and SIGHUP to this process raise SystemExit (exit 128 + the signal) instead of
    ending it at once, so the caller's `finally` stops the children: they run in sessions of their own (a terminal's
    ^C does not reach them), and `timeout`, `kill` or a CI job's cancel signals the parent alone. A second signal
    while they are being stopped is ignored."""

    def __init__(self, log_dir: Path, env: Mapping[str, str], config: Path, records: Path | None = None):
        self.log_dir = log_dir
        self.config = config
        # Where each child is written down (`child_records`), for `end_left_over` to end it should this process be
        # killed outright (SIGKILL runs no `finally`): None, not written down.
        self.records = records
        self.env = {k: v for k, v in env.items() if k != "BURSTCTL_CONFIG"}
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._written: list[ChildRecord] = []
        self._handlers: dict[int, Any] = {}  # the signal handlers spawn() replaced, restored by stop_all()
        self._stopping = False
        self._starting = False  # spawn() between starting a child and listing it in self.procs
        self._pending: int | None = None  # a stop signal that came meanwhile, raised once the child is listed

    def _on_stop_signal(self, signum: int, _frame: Any) -> None:
        if self._starting:
            # Raised now, it left the child just started out of self.procs: stop_all() never stopped it, and it ran
            # on (a demo's daemon, SIGTERMed as it started).
            self._pending = signum
            return
        if not self._stopping:
            self._stopping = True
            raise SystemExit(128 + signum)

    def _catch_stop_signals(self) -> None:
        import threading

        if not self._handlers and threading.current_thread() is threading.main_thread():  # only it may set them
            self._handlers = {sig: signal.signal(sig, self._on_stop_signal) for sig in STOP_SIGNALS}

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """`burstctl --config <private config> ARGS...` in the background, output to <log_dir>/<name>.log."""
        self._catch_stop_signals()
        self._starting = True
        try:
            # Written down before it starts: killed while it starts, this process leaves a child the next run finds.
            record = write_down(self.records, name, prefix=f"{len(self.procs):02d}-{name}-")
            self._written.append(record)
            with self.log(name).open("w") as log:
                proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "--config", str(self.config),
                                         *args], env=record.env(self.env), stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            self.procs.append((name, proc))
            record.started(proc.pid)
        finally:
            self._starting = False
            signum, self._pending = self._pending, None
            if signum is not None:
                self._on_stop_signal(signum, None)
        return proc

    def check(self) -> None:
        """OperationalError with the child's own last log line if any child has exited: none is meant to before
        stop_all(), and waiting on it would only end in a timeout."""
        for name, proc in self.procs:
            rc = proc.poll()
            if rc is not None:
                why = last_line(self.log(name)) or "no output"
                raise OperationalError(f"the private {name} exited with code {rc}: {why}")

    def wait(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        """wait_until(), failing at once if a child dies meanwhile."""
        return wait_until(pred, timeout, what, check=self.check)

    def stop_all(self, grace_s: float = 60.0) -> None:
        self._stopping = True
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        self.procs.clear()
        for record in self._written:
            record.forget()
        self._written.clear()
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers, self._stopping = {}, False
