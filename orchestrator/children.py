"""burstctl's own child processes for the demo and rehearsals: simcloud and a daemon, each in its own session with
its log in a folder, stopped in reverse order (the daemon before simcloud, so it never sees its cloud vanish)."""

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

from orchestrator.errors import OperationalError


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a child server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """pred()'s first truthy value; OperationalError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval)
    raise OperationalError(f"timed out after {timeout:.0f} s waiting for {what}")


class Children:
    def __init__(self, log_dir: Path, env: Mapping[str, str]):
        self.log_dir = log_dir
        self.env = dict(env)
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """`burstctl ARGS...` in the background, output to <log_dir>/<name>.log."""
        with (self.log_dir / f"{name}.log").open("w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop_all(self, grace_s: float = 60.0) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        self.procs.clear()
