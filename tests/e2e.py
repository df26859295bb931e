"""Helpers for end-to-end tests: a real simcloud process, a real daemon process, and waiting on the database."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import httpx

from providers.simcloud.ec2_sim import SimEc2
from runbooks.checkpoint_transfer import STAGING_PREFIX
from state.store import Store
from tests.conftest import toml_value

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


def simcloud_ec2_printed(proc: subprocess.Popen[str]) -> list[str]:
    """What a started `burstctl simcloud ec2` prints, read up to its last line, once everything is up."""
    assert proc.stdout is not None
    printed = [proc.stdout.readline()]
    while not printed[-1].startswith("# preempt and status"):
        printed.append(proc.stdout.readline())
        assert printed[-1], proc.stderr.read() if proc.stderr else ""
    return printed


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/_sim/instances", timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def trainer_job(tmp: Path, name: str, *, steps: int, every: int, step_s: float = 0.1, local_throughput: float = 0,
                rented: float = 0.5, gpu: str = "H100", deadline_hours: float = 10, work_units: float = 1,
                interval_minutes: float = 0.02, shard_mib: int = 0, extra: tuple[str, ...] = (),
                setup: list[str] | None = None, setup_retries: int | None = None,
                outputs: list[str] | None = None) -> Path:
    """A job spec running the example checkpointing trainer (copied into <tmp>/work), the e2e tests' workload."""
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(REPO / "examples" / "trainer.py", work / "trainer.py")
    path = tmp / f"{name}.toml"
    path.write_text("\n".join([
        f'name = "{name}"',
        f'command = ["python3", "trainer.py", "--steps", "{steps}", "--checkpoint-every", "{every}", '
        f'"--step-seconds", "{step_s}", "--shard-mib", "{shard_mib}"{"".join(f", {json.dumps(x)}" for x in extra)}]',
        'workdir = "work"', f"deadline_hours = {deadline_hours}", f"work_units = {work_units}",
        f"local_throughput = {local_throughput}", f"rented_throughput = {{ {gpu} = {rented} }}",
        *([f"setup = {json.dumps(setup)}"] if setup else []),
        *([f"setup_retries = {setup_retries}"] if setup_retries is not None else []),
        *([f"outputs = {json.dumps(outputs)}"] if outputs else []),
        "[checkpoint]", f"interval_minutes = {interval_minutes}",
    ]) + "\n")
    return path


def write_config(tmp: Path, sim_url: str | None, **sections: dict[str, Any]) -> Path:
    """burstctl.toml for a test: simcloud at `sim_url` (None: simcloud off), a fast daemon, and `sections`
    (`sim`: more keys for [providers.sim])."""
    daemon = {"tick_s": 0.5, "heartbeat_timeout_s": 20.0, "sweep_s": 5.0, "launch_backoff_s": 1.0,
              **sections.pop("daemon", {})}
    sim = [f'base_url = "{sim_url}/api/v1"'] if sim_url else ["enabled = false"]
    sim += [f"{k} = {toml_value(v)}" for k, v in sections.pop("sim", {}).items()]
    lines = ["[providers.sim]", *sim, "", "[daemon]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in daemon.items()]
    for name, values in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in values.items()]
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
        # A SIGTERM while Python is still importing kills it by the signal (-15): wait until it is up (its console
        # log says daemon.started; the daemon handles signals from before that), or gone.
        log = self.tmp / f"daemon-{self.n}.log"
        wait_for(lambda: self.proc is None or self.proc.poll() is not None or "daemon.started" in log.read_text(),
                 60, "the daemon to be up before stopping it", interval=0.05)
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


# Commands that start nothing, install no signal handler, follow nothing and return at once: `cli` runs them in
# the test's own process, through the same entry point, which skips an interpreter's start (about a CPU-second each,
# most of what a short command costs; the suite makes hundreds). The others get a process of their own.
IN_PROCESS = frozenset({"enqueue", "status", "show", "list", "events", "decide", "cancel", "report", "schedules"})


def cli(config: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`burstctl --config CONFIG --state-dir STATE ARGS...` with the daemon's environment (the simcloud key)."""
    command = next((a for a in args if not a.startswith("-")), None)
    if command in IN_PROCESS and "--follow" not in args and "-f" not in args and threading.current_thread() is \
            threading.main_thread():
        return _cli_here(config, state, *args)
    return subprocess.run(burstctl_argv("--config", str(config), "--state-dir", str(state), *args),
                          env={**os.environ, "BURSTCTL_SIM_API_KEY": SIM_KEY}, capture_output=True, text=True,
                          timeout=300)


def _cli_here(config: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    from orchestrator.cli import main

    argv = ["--config", str(config), "--state-dir", str(state), *args]
    out, err = io.StringIO(), io.StringIO()
    before = os.environ.get("BURSTCTL_SIM_API_KEY")
    os.environ["BURSTCTL_SIM_API_KEY"] = SIM_KEY
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        if before is None:
            del os.environ["BURSTCTL_SIM_API_KEY"]
        else:
            os.environ["BURSTCTL_SIM_API_KEY"] = before
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def daemon_until(tmp: Path, config: Path, state: Path, pred: Callable[[], Any], timeout: float, what: str) -> None:
    """Run a daemon until `pred` holds (or `timeout` runs out, failing with `what`), then stop it: it must exit 0."""
    daemon = Daemon(tmp, config, state).start()
    try:
        wait_for(pred, timeout, what)
    finally:
        assert daemon.stop() == 0


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def store_url(state: Path) -> str:
    """The database the test's daemon and CLI use: `[state] database_url` of the config `write_config` put beside
    the state directory, else SQLite in the state directory (the default)."""
    config = state.parent / "burstctl.toml"
    if config.exists():
        url = tomllib.loads(config.read_text()).get("state", {}).get("database_url")
        if url:
            return str(url)
    return f"sqlite:///{state / 'burstctl.db'}"


def store_sections(backend: str, request: Any) -> dict[str, dict[str, Any]]:
    """Config sections that keep a test's state on `backend`: none for "sqlite" (the default), for "postgresql"
    `[state] database_url` of a new database on the test process's PostgreSQL server (`request` is pytest's)."""
    if backend == "sqlite":
        return {}
    return {"state": {"database_url": request.getfixturevalue("postgres_server").new_database()}}


def events(state: Path, type_prefix: str | None = None) -> list[dict[str, Any]]:
    st = Store(store_url(state))
    try:
        return st.events(type_prefix=type_prefix)
    finally:
        st.close()


def job(state: Path, ref: str) -> dict[str, Any]:
    st = Store(store_url(state))
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


def pull_under_way(state: Path, job_id: str) -> str:
    """The name of the checkpoint of `job_id` being pulled home now (its staging directory is there), else ""."""
    staging = sorted((state / "checkpoints" / job_id).glob(f"{STAGING_PREFIX}*"))
    return staging[-1].name[len(STAGING_PREFIX):] if staging else ""


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


def instances_per_attempt(instances: list[dict[str, Any]]) -> dict[str, list[str]]:
    """A cloud's instances (all ever launched) grouped by the attempt tag burstctl gave them."""
    out: dict[str, list[str]] = {}
    for inst in instances:
        tags = {t["key"]: t["value"] for t in inst["tags"]}
        out.setdefault(tags.get("burstctl:attempt", inst["name"]), []).append(inst["id"])
    return out


def enqueue(config: Path, state: Path, path: Path) -> str:
    """`burstctl enqueue` of a job spec; the job's id."""
    r = cli(config, state, "enqueue", str(path), "--json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["id"])


def assert_one_instance_per_attempt_and_all_gone(cloud: str | CloudView) -> None:
    """The cloud (simcloud's URL, or either cloud's view) never launched two instances for one attempt, and none is
    left running."""
    instances = sim_instances(cloud) if isinstance(cloud, str) else cloud.instances()
    for attempt, ids in instances_per_attempt(instances).items():
        assert len(ids) == 1, f"attempt {attempt} launched {len(ids)} instances"
    assert all(i["status"] in ("terminated", "preempted") for i in instances), instances


def ledger(state: Path) -> list[dict[str, Any]]:
    st = Store(store_url(state))
    try:
        return st.ledger_rows()
    finally:
        st.close()


def hold_from(state: Path, job_id: str, at: float, rate_usd_h: float) -> float:
    """What the budget holds for a job whose attempt is written on a market billing `rate_usd_h` at `at` (a launch,
    a move): what its instances had cost by then (closed charges at cost, open ones at their rate), and the rest of
    its plan's cloud hours at that rate: less the useful hours its attempts had run, never less than its overhead,
    billed at least a minute. Read from the state afterwards, as it stood at `at`."""
    from sqlalchemy import select

    from orchestrator.core.plan import planned_cloud_hours
    from state import schema as s

    st = Store(store_url(state))
    try:
        stored = st.get_job(job_id)
        assert stored is not None
        decision = stored["decision"]
        with st.engine.connect() as c:
            runs = c.execute(select(s.attempts.c.started_at, s.attempts.c.ended_at, s.attempts.c.lost_work_h)
                             .where(s.attempts.c.job_id == job_id)).all()
        charges = [r for r in st.ledger_rows() if r["job_id"] == job_id and r["started_at"] <= at]
    finally:
        st.close()
    done_h = sum(max(0.0, min(ended or at, at) - started) / 3600.0 - (lost or 0.0 if ended and ended <= at else 0.0)
                 for started, ended, lost in runs if started is not None and started <= at)
    spent = sum(r["cost_usd"] if r["ended_at"] is not None and r["ended_at"] <= at
                else r["rate_usd_h"] * (at - r["started_at"]) / 3600.0 for r in charges)
    rest_h = max(planned_cloud_hours(decision)[0] - done_h, float(decision.get("overhead_h") or 0.0), 60 / 3600)
    return spent + rate_usd_h * rest_h


def sim_admin(url: str, route: str, body: dict[str, Any]) -> Any:
    """POST to one of simcloud's /_sim admin routes (faults, capacity, quota...)."""
    r = httpx.post(f"{url}/_sim/{route}", json=body, timeout=10)
    r.raise_for_status()
    return r.json()["data"]


def spot_capacity(url: str, count: int) -> None:
    """simcloud's H100 spot capacity in both its regions."""
    for region in ("us-east-1", "us-west-1"):
        sim_admin(url, "capacity", {"instance_type": "gpu_1x_h100_sxm5_spot", "region": region, "count": count})


# --- either cloud: simcloud (Lambda-style REST) or the simulated EC2 (moto's server) -------------------------
GONE = ("terminated", "preempted")
AWS_TEST_SECRET = "E2ePlantedAwsSecret/abc+0123456789XYZ"
P3_OD, P3_SPOT = 3.06, 0.9731  # the paper's p3.2xlarge prices (setting (a) of `burstctl simulate`)


class CloudView(Protocol):
    """What a test sees of the cloud burstctl drives, whichever it is."""

    gpu: str  # the GPU its offers carry, for the job's rented_throughput
    admin_url: str  # root of the /_sim admin routes (notice, preempt)

    def config(self, tmp: Path, **sections: dict[str, Any]) -> Path: ...

    def instances(self) -> list[dict[str, Any]]: ...

    def spot_capacity(self, count: int) -> None: ...

    def billing(self) -> list[dict[str, Any]]: ...


class SimcloudView:
    gpu = "H100"

    def __init__(self, url: str) -> None:
        self.admin_url = url

    def config(self, tmp: Path, **sections: dict[str, Any]) -> Path:
        return write_config(tmp, self.admin_url, **sections)

    def instances(self) -> list[dict[str, Any]]:
        return sim_instances(self.admin_url)

    def spot_capacity(self, count: int) -> None:
        spot_capacity(self.admin_url, count)

    def billing(self) -> list[dict[str, Any]]:
        return sim_billing(self.admin_url)


class Ec2View:
    gpu = "V100"

    def __init__(self, sim: SimEc2) -> None:
        self.sim = sim
        self.admin_url = sim.admin_url

    def config(self, tmp: Path, provider: dict[str, Any] | None = None, **sections: dict[str, Any]) -> Path:
        """A config for this cloud; `provider` adds to its `[providers.ec2]` table."""
        return write_config(
            tmp, None, **{"providers.ec2": {**self.sim.provider_config(), "instance_types": ["p3.2xlarge"],
                                            "on_demand_usd_h": {"p3.2xlarge": P3_OD}, **(provider or {})},
                          "prices.V100": {"on_demand_usd_h": P3_OD, "spot_usd_h": P3_SPOT, "vram_gib": 16},
                          "budget": {"cycle_gpu": "V100"}, **sections})

    def instances(self) -> list[dict[str, Any]]:
        return self.sim.instances()

    def spot_capacity(self, count: int) -> None:
        """p3.2xlarge spot capacity in every zone: beyond it, RunInstances fails with InsufficientInstanceCapacity."""
        self.sim.set_spot_capacity("p3.2xlarge", count)

    def billing(self) -> list[dict[str, Any]]:
        return self.sim.billing()


AWS_ENV = {"AWS_ACCESS_KEY_ID": "AKIAE2ETESTKEY000000", "AWS_SECRET_ACCESS_KEY": AWS_TEST_SECRET,
           "AWS_EC2_METADATA_DISABLED": "true"}
AWS_ENV_UNSET = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_EC2")


@contextmanager
def sim_ec2(tmp: Path) -> Iterator[Ec2View]:
    """The simulated EC2 in this process, with this process's environment (inherited by the daemon and CLI
    processes) pointing the standard AWS chain at test credentials and nothing real."""
    saved = dict(os.environ)
    os.environ.update({**AWS_ENV, "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-credentials"),
                       "AWS_CONFIG_FILE": str(tmp / "no-config")})
    for name in AWS_ENV_UNSET:
        os.environ.pop(name, None)
    sim = SimEc2(tmp / "ec2", spot_prices={"p3.2xlarge": P3_SPOT}, on_demand_prices={"p3.2xlarge": P3_OD}).start()
    try:
        yield Ec2View(sim)
    finally:
        sim.close()
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def cloud(kind: str, tmp: Path) -> Iterator[CloudView]:
    """`simcloud` (its own process) or `ec2` (moto's server in this process), as a CloudView."""
    if kind == "ec2":
        with sim_ec2(tmp) as view:
            yield view
    else:
        with simcloud(tmp) as url:
            yield SimcloudView(url)
