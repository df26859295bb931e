"""burstctl's own child processes for the demo and rehearsals: simcloud and a daemon, each in its own session with
its log in a folder, stopped in reverse order (the daemon before simcloud, so it never sees its cloud vanish)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


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
