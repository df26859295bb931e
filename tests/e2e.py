"""Helpers for end-to-end tests: a real simcloud process, a real daemon process, and waiting on the database."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from state.store import Store

SIM_KEY = "sim-e2e-secret-key-5f2c"
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def burstctl_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.cli", *args]


@contextmanager
def simcloud(tmp: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`burstctl simcloud serve` as its own process (so it outlives a daemon we kill). Yields its root URL."""
    port = free_port()
    log = (tmp / "simcloud.log").open("w")
    proc = subprocess.Popen(burstctl_argv("simcloud", "serve", "--port", str(port), "--state", str(tmp / "sim"),
                                          *extra),
                            env={**os.environ, "BURSTCTL_SIM_API_KEY": SIM_KEY, **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url), 30, "simcloud to answer")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/_sim/instances", timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def trainer_job(tmp: Path, name: str, *, steps: int, every: int, step_s: float = 0.1, local_throughput: float = 0,
                rented_h100: float = 0.5, deadline_hours: float = 10, work_units: float = 1,
                interval_minutes: float = 0.02, shard_mib: int = 0) -> Path:
    """A job spec running the example checkpointing trainer (copied into <tmp>/work), the e2e tests' workload."""
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(REPO / "examples" / "trainer.py", work / "trainer.py")
    path = tmp / f"{name}.toml"
    path.write_text("\n".join([
        f'name = "{name}"',
        f'command = ["python3", "trainer.py", "--steps", "{steps}", "--checkpoint-every", "{every}", '
        f'"--step-seconds", "{step_s}", "--shard-mib", "{shard_mib}"]',
        'workdir = "work"', f"deadline_hours = {deadline_hours}", f"work_units = {work_units}",
        f"local_throughput = {local_throughput}", f"rented_throughput = {{ H100 = {rented_h100} }}",
        "[checkpoint]", f"interval_minutes = {interval_minutes}",
    ]) + "\n")
    return path


def write_config(tmp: Path, sim_url: str, **sections: dict[str, Any]) -> Path:
    daemon = {"tick_s": 0.5, "heartbeat_timeout_s": 20.0, "sweep_s": 5.0, "launch_backoff_s": 1.0,
              **sections.pop("daemon", {})}
    lines = ["[providers.sim]", f'base_url = "{sim_url}/api/v1"', "", "[daemon]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in daemon.items()]
    for name, values in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = tmp / "burstctl.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Daemon:
    """`burstctl daemon` as a real process."""

    def __init__(self, tmp: Path, config: Path, state: Path):
        self.tmp, self.config, self.state = tmp, config, state
        self.proc: subprocess.Popen[bytes] | None = None
        self.n = 0

    def start(self, *extra: str) -> Daemon:
        self.n += 1
        log = (self.tmp / f"daemon-{self.n}.log").open("w")
        self.proc = subprocess.Popen(
            burstctl_argv("--config", str(self.config), "--state-dir", str(self.state), "daemon", *extra),
            env={**os.environ, "BURSTCTL_SIM_API_KEY": SIM_KEY}, stdout=log, stderr=subprocess.STDOUT)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(60)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def cli(config: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(burstctl_argv("--config", str(config), "--state-dir", str(state), *args),
                          env={**os.environ, "BURSTCTL_SIM_API_KEY": SIM_KEY}, capture_output=True, text=True,
                          timeout=300)


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def events(state: Path, type_prefix: str | None = None) -> list[dict[str, Any]]:
    st = Store(f"sqlite:///{state / 'burstctl.db'}")
    try:
        return st.events(type_prefix=type_prefix)
    finally:
        st.close()


def job(state: Path, ref: str) -> dict[str, Any]:
    st = Store(f"sqlite:///{state / 'burstctl.db'}")
    try:
        j = st.get_job(ref)
        assert j is not None
        return j
    finally:
        st.close()


def sim_instances(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/_sim/instances", timeout=10).json()["data"]


def sim_billing(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/_sim/billing", timeout=10).json()["data"]


def preempt(url: str, instance_id: str, notice_s: float = 1.0) -> None:
    """An EC2-style interruption: the notice first, then the instance is reclaimed and its processes die."""
    httpx.post(f"{url}/_sim/instances/{instance_id}/notice", json={"seconds": notice_s}, timeout=10).raise_for_status()
    time.sleep(notice_s)
    r = httpx.post(f"{url}/_sim/instances/{instance_id}/preempt", json={}, timeout=10)
    if r.status_code != 404:  # 404: on the notice, burstctl already checkpointed and terminated the instance
        r.raise_for_status()


# --- chaos, faults and secrets helpers (tests/test_chaos.py, test_faults.py, test_secrets.py) -------------------
class EnvDaemon(Daemon):
    """A `Daemon` started with extra environment (e.g. BURSTCTL_CHAOS_KILL_AT for one run)."""

    def start(self, *extra: str, env: dict[str, str] | None = None) -> EnvDaemon:
        self.n += 1
        log = (self.tmp / f"daemon-{self.n}.log").open("w")
        self.proc = subprocess.Popen(
            burstctl_argv("--config", str(self.config), "--state-dir", str(self.state), "daemon", *extra),
            env={**os.environ, "BURSTCTL_SIM_API_KEY": SIM_KEY, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)


def instances_per_attempt(url: str) -> dict[str, list[str]]:
    """simcloud's instances (all ever launched) grouped by the attempt tag burstctl gave them."""
    out: dict[str, list[str]] = {}
    for inst in sim_instances(url):
        tags = {t["key"]: t["value"] for t in inst["tags"]}
        out.setdefault(tags.get("burstctl:attempt", inst["name"]), []).append(inst["id"])
    return out


def ledger(state: Path) -> list[dict[str, Any]]:
    st = Store(f"sqlite:///{state / 'burstctl.db'}")
    try:
        return st.ledger_rows()
    finally:
        st.close()


def sim_admin(url: str, route: str, body: dict[str, Any]) -> Any:
    """POST to one of simcloud's /_sim admin routes (faults, capacity, quota...)."""
    r = httpx.post(f"{url}/_sim/{route}", json=body, timeout=10)
    r.raise_for_status()
    return r.json()["data"]
