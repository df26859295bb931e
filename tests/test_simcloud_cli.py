"""`burstctl simcloud serve | preempt | status` and the preemption sources behind `serve`.

The end-to-end tests run `simcloud serve` as a real subprocess through the real entry point, launch through
its REST API, SSH into the instance (host key pinned), rsync and SFTP over it, preempt it, and check that its
processes die and that SIGTERM leaves nothing behind.
"""

from __future__ import annotations

import base64
import io
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import paramiko
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from providers.simcloud.api import SimCloudServer
from providers.simcloud.preemption import PoissonPreemptions, PreemptionScheduler, TracePreemptions
from providers.simcloud.ssh_backend import openssh_available
from tests.e2e import simcloud_ec2_printed

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"
ENTRY = [sys.executable, "-c", "from orchestrator.cli import entry; entry()"]
KEY_ENV = "BURSTCTL_TEST_SIM_KEY"
API_KEY = "sk-simcloud-test-7d1e"  # must never show up in any output
TRACE = SHARED / "spot-traces" / "availability" / "1-node" / "aws-10-26-2022" / "us-west-2a_k80_1.json"
needs_trace = pytest.mark.skipif(not TRACE.is_file(), reason="shared spot traces not present")
MODES = [
    pytest.param("openssh", marks=pytest.mark.skipif(not openssh_available(), reason="sshd not installed")),
    "paramiko",
]


def burstctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ENTRY, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def alive(pid: int) -> bool:
    """Exists and is not a zombie (orphans' zombies wait for init to reap them: they are dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def processes_touching(directory: Path) -> list[int]:
    """Live processes whose command line, working directory or $HOME lies in `directory`."""
    root = str(directory.resolve())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid() or not alive(int(entry.name)):
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if root in cmdline or cwd.startswith(root) or any(v.startswith(f"HOME={root}".encode()) for v in environ):
            found.append(int(entry.name))
    return found


class Simcloud:
    """`burstctl simcloud serve` as a real foreground process on an ephemeral port."""

    def __init__(self, state: Path, *extra: str) -> None:
        self.state = state
        self.proc = subprocess.Popen([*ENTRY, "simcloud", "serve", "--port", "0", "--json", "--state", str(state),
                                      "--api-key-env", KEY_ENV, *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, KEY_ENV: API_KEY})
        self.lines: queue.Queue[str] = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        started = self.next_event(timeout=60)
        assert started["event"] == "serving", started
        self.info = started
        self.url: str = started["url"]
        self.api = httpx.Client(base_url=started["api_url"], headers={"Authorization": f"Bearer {API_KEY}"},
                                timeout=30)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout.append(line)
            self.lines.put(line)

    def next_event(self, timeout: float = 60) -> dict[str, Any]:
        return json.loads(self.lines.get(timeout=timeout))

    def terminate(self) -> tuple[int, str]:
        self.api.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=60)
        assert self.proc.stderr is not None
        return rc, self.proc.stderr.read()

    # --- the REST API, as a client sees it ---
    def add_key(self, public_line: str) -> None:
        self.api.post("/ssh-keys", json={"name": "burstctl", "public_key": public_line}).raise_for_status()

    def launch(self, instance_type: str) -> str:
        resp = self.api.post("/instance-operations/launch", json={
            "region_name": "us-east-1", "instance_type_name": instance_type, "ssh_key_names": ["burstctl"]})
        resp.raise_for_status()
        return str(resp.json()["data"]["instance_ids"][0])

    def instance(self, instance_id: str) -> dict[str, Any]:
        resp = self.api.get(f"/instances/{instance_id}")
        resp.raise_for_status()
        return dict(resp.json()["data"])

    def wait_status(self, instance_id: str, status: str, deadline_s: float = 60) -> dict[str, Any]:
        end = time.monotonic() + deadline_s
        while True:
            inst = self.instance(instance_id)
            if inst["status"] == status or time.monotonic() > end:
                assert inst["status"] == status, inst
                return inst
            time.sleep(0.05)

    def instance_action(self, instance_id: str) -> httpx.Response:
        return httpx.get(f"{self.url}/_sim/instances/{instance_id}/latest/meta-data/spot/instance-action")


class ClientKey:
    def __init__(self, directory: Path) -> None:
        pem = Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption())
        self.path = directory / "id_ed25519"
        self.path.write_bytes(pem)
        self.path.chmod(0o600)
        self.pkey = paramiko.Ed25519Key.from_private_key(io.StringIO(pem.decode()))
        self.public_line = f"{self.pkey.get_name()} {self.pkey.get_base64()} burstctl"


def ssh(inst: dict[str, Any], key: ClientKey) -> paramiko.SSHClient:
    """Connect as the daemon does: the host key comes from the API and is pinned; anything else is rejected."""
    client = paramiko.SSHClient()
    key_type, blob = inst["ssh_host_key"].split()[:2]
    client.get_host_keys().add(f"[{inst['ip']}]:{inst['ssh_port']}", key_type,
                               paramiko.PKey.from_type_string(key_type, base64.b64decode(blob)))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(inst["ip"], inst["ssh_port"], username=inst["ssh_user"], pkey=key.pkey, allow_agent=False,
                   look_for_keys=False, timeout=10, banner_timeout=10, auth_timeout=10)
    return client


def run(client: paramiko.SSHClient, command: str) -> tuple[int, str]:
    _, stdout, _ = client.exec_command(command, timeout=60)
    out = stdout.read().decode()
    return stdout.channel.recv_exit_status(), out


@pytest.fixture
def key(tmp_path: Path) -> ClientKey:
    return ClientKey(tmp_path)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    started: list[Simcloud] = []

    def start(*extra: str) -> Simcloud:
        sim = Simcloud(tmp_path / f"simcloud-{len(started)}", *extra)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        if sim.proc.poll() is None:
            sim.terminate()


# --- end to end ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("rsync") is None or shutil.which("ssh") is None, reason="needs rsync and ssh")
@pytest.mark.parametrize("mode", MODES)
def test_serve_launch_ssh_rsync_sftp_forced_preemption_and_clean_shutdown(
        mode: str, serve: Any, key: ClientKey, tmp_path: Path) -> None:
    sim: Simcloud = serve(f"--{mode}")
    assert sim.info["ssh"] == mode
    sim.add_key(key.public_line)
    spot_id = sim.launch("gpu_1x_a10_spot")
    inst = sim.wait_status(spot_id, "active")
    assert inst["ip"] == "127.0.0.1" and inst["ssh_host_key"].startswith("ssh-ed25519 ")

    # A command runs, in the instance's sandbox under simcloud's state dir.
    with ssh(inst, key) as client:
        status, out = run(client, "echo hello; pwd")
    sandbox = out.splitlines()[1]
    assert status == 0 and out.splitlines()[0] == "hello"
    assert Path(sandbox).resolve().is_relative_to(sim.state.resolve())

    # rsync pushes a workdir over the endpoint with the host key pinned.
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    (workdir / "train.py").write_text("print('step')\n")
    (workdir / "weights.bin").write_bytes(os.urandom(100_000))
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[{inst['ip']}]:{inst['ssh_port']} {inst['ssh_host_key']}\n")
    rsh = (f"ssh -p {inst['ssh_port']} -i {key.path} -o IdentitiesOnly=yes -o BatchMode=yes "
           f"-o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes -o LogLevel=ERROR")
    subprocess.run(["rsync", "-a", "-e", rsh, f"{workdir}/", f"{inst['ssh_user']}@{inst['ip']}:{sandbox}/work/"],
                   check=True, timeout=60)
    assert (Path(sandbox) / "work" / "weights.bin").read_bytes() == (workdir / "weights.bin").read_bytes()

    # SFTP puts a file; a trainer starts detached, as the daemon starts it.
    with ssh(inst, key) as client:
        with client.open_sftp() as sftp:
            sftp.putfo(io.BytesIO(b"lr=3e-4\n"), f"{sandbox}/work/config.txt")
        status, out = run(client, "cat work/config.txt; cd work; nohup sleep 1000 >/dev/null 2>&1 & echo $!")
    assert status == 0
    config_line, trainer = out.splitlines()
    assert config_line == "lr=3e-4" and alive(int(trainer))
    assert sim.instance_action(spot_id).status_code == 404  # no notice yet

    # Forced preemption: the notice shows while the instance still runs, then the trainer dies.
    preempt = subprocess.Popen([*ENTRY, "simcloud", "preempt", spot_id, "--notice-seconds", "3", "--url", sim.url,
                                "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while (action := sim.instance_action(spot_id)).status_code == 404:
        assert preempt.poll() is None, preempt.communicate()
        time.sleep(0.02)
    assert action.json()["action"] == "terminate"
    assert sim.instance(spot_id)["status"] == "active" and alive(int(trainer))
    stdout, stderr = preempt.communicate(timeout=60)
    assert preempt.returncode == 0, stderr
    result = json.loads(stdout)
    assert result["status"] == "preempted" and result["notice_time"] == action.json()["time"]
    assert not alive(int(trainer))
    assert sim.instance(spot_id)["status"] == "preempted"
    with pytest.raises((OSError, paramiko.SSHException)):
        ssh(inst, key)

    # status shows the record and its bill.
    status_run = burstctl("simcloud", "status", "--url", sim.url, "--json")
    assert status_run.returncode == 0, status_run.stderr
    record = next(r for r in json.loads(status_run.stdout) if r["id"] == spot_id)
    assert record["status"] == "preempted" and record["market"] == "spot" and record["cost_usd"] > 0

    # An on-demand instance cannot be preempted: bad input, one line.
    od_id = sim.launch("gpu_1x_a10")
    od = sim.wait_status(od_id, "active")
    refused = burstctl("simcloud", "preempt", od_id, "--url", sim.url, "--notice-seconds", "0")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "only spot instances" in refused.stderr

    # SIGTERM with a live instance and a running job: everything goes, nothing is left behind.
    with ssh(od, key) as client:
        _, out = run(client, "nohup sleep 1000 >/dev/null 2>&1 & echo $!")
    od_trainer = int(out.strip())
    assert alive(od_trainer) and processes_touching(sim.state)
    rc, server_stderr = sim.terminate()
    assert rc == 0, server_stderr
    assert not alive(od_trainer)
    assert processes_touching(sim.state) == []
    everything = "".join(sim.stdout) + server_stderr + stdout + stderr + status_run.stdout + refused.stderr
    assert API_KEY not in everything


@pytest.mark.slow
@needs_trace
def test_trace_driven_preemption_posts_the_notice_then_reclaims_the_instance(serve: Any, key: ClientKey) -> None:
    trace = json.loads(TRACE.read_text())
    first_outage = trace["data"].index(0)
    assert first_outage > 0  # the trace starts with spot available, so the instance does get to run
    # 600x: one 600 s tick per second, the 120 s notice becomes 0.2 s.
    sim: Simcloud = serve("--paramiko", "--preempt-trace", str(TRACE), "--time-scale", "600")
    assert sim.info["preemptions"] == "TracePreemptions"
    sim.add_key(key.public_line)
    spot_id = sim.launch("gpu_1x_a10_spot")
    # The scheduler only acts on active spot instances, so the notice event also proves the instance ran.
    events = [sim.next_event(timeout=60) for _ in range(2)]
    assert [(e["event"], e["instance_id"]) for e in events] == [("spot.notice", spot_id), ("spot.preempted", spot_id)]
    inst = sim.wait_status(spot_id, "preempted")
    assert inst["status_reason"] == "spot-preempted"
    assert sim.instance_action(spot_id).json()["action"] == "terminate"
    rc, _ = sim.terminate()
    assert rc == 0 and processes_touching(sim.state) == []


@pytest.mark.parametrize("as_json", [True, False])
def test_preempt_succeeds_when_the_client_terminates_the_instance_on_the_notice(
        as_json: bool, serve: Any, key: ClientKey) -> None:
    # What burstctl's daemon does: it sees the notice, takes its checkpoint and terminates the instance itself, so
    # the reclaim finds nothing. That is a preemption that worked, not a wrong INSTANCE.
    sim: Simcloud = serve("--paramiko")
    sim.add_key(key.public_line)
    spot_id = sim.launch("gpu_1x_a10_spot")
    sim.wait_status(spot_id, "active")
    preempt = subprocess.Popen([*ENTRY, "simcloud", "preempt", spot_id, "--notice-seconds", "3", "--url", sim.url,
                                *(["--json"] if as_json else [])],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while sim.instance_action(spot_id).status_code == 404:
        assert preempt.poll() is None, preempt.communicate()
        time.sleep(0.02)
    sim.api.post("/instance-operations/terminate", json={"instance_ids": [spot_id]}).raise_for_status()
    stdout, stderr = preempt.communicate(timeout=60)
    assert preempt.returncode == 0, stderr
    assert stderr == ""
    if as_json:
        result = json.loads(stdout)
        assert result["already_gone"] is True and result["status"] in ("terminating", "terminated")
    else:
        assert f"already gone: {spot_id} was terminated during the notice" in stdout
    # Its record stays a termination: the reclaim did not turn it into a preemption or bill past its end.
    record = next(r for r in json.loads(burstctl("simcloud", "status", "--url", sim.url, "--json").stdout)
                  if r["id"] == spot_id)
    assert record["status"] in ("terminating", "terminated") and record.get("status_reason") is None

    # Gone at the first call, though, it is bad input: one line naming INSTANCE, exit 2.
    while sim.api.get(f"/instances/{spot_id}").status_code != 404:  # terminated: the API no longer shows it
        time.sleep(0.02)
    again = burstctl("simcloud", "preempt", spot_id, "--url", sim.url, "--notice-seconds", "0")
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1
    assert "field 'INSTANCE'" in again.stderr and spot_id in again.stderr


# --- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "env", "expected"), [
    (["--api-key-env", "BURSTCTL_TEST_UNSET_KEY"], {}, "BURSTCTL_TEST_UNSET_KEY is not set"),
    (["--preempt-trace", str(TRACE), "--preempt-per-hour", "1"], {KEY_ENV: API_KEY}, "not both"),
    (["--capacity", "gpu_9x_nothing=2"], {KEY_ENV: API_KEY}, "unknown instance type"),
    (["--capacity", "gpu_1x_a10=many"], {KEY_ENV: API_KEY}, "TYPE=N"),
    (["--host", "0.0.0.0"], {KEY_ENV: API_KEY}, "loopback only"),
    (["--preempt-trace", "README.md"], {KEY_ENV: API_KEY}, "not a spot-traces file"),
    # Alternatives: the last one given had been taken.
    (["--openssh", "--paramiko"], {KEY_ENV: API_KEY}, "give --openssh or --paramiko, not both"),
    (["--paramiko", "--openssh"], {KEY_ENV: API_KEY}, "give --openssh or --paramiko, not both"),
])
def test_serve_refuses_bad_input_with_one_line_and_exit_2(
        args: list[str], env: dict[str, str], expected: str, tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("# not a trace\n")
    default_key = [] if "--api-key-env" in args else ["--api-key-env", KEY_ENV]
    res = burstctl("simcloud", "serve", "--port", "0", "--state", str(tmp_path / "s"), *default_key, *args,
                   env=env)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and expected in res.stderr
    assert "Traceback" not in res.stderr and API_KEY not in res.stderr


def test_the_simulated_ec2_takes_one_ssh_server_not_both(tmp_path: Path) -> None:
    res = burstctl("simcloud", "ec2", "--state", str(tmp_path / "s"), "--paramiko", "--openssh")
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "burstctl: error: field '--openssh': give --openssh or --paramiko, not both"]
    assert not (tmp_path / "s").exists()  # refused before anything was made


def test_status_and_preempt_without_a_server_fail_operationally(tmp_path: Path) -> None:
    url = "http://127.0.0.1:9"  # discard port: nothing answers HTTP there
    for args in (["status", "--url", url], ["preempt", "i-123", "--url", url]):
        res = burstctl("simcloud", *args)
        assert res.returncode == 1 and "not reachable" in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


# --- preemption sources ---------------------------------------------------------------------------------------
@needs_trace
def test_trace_replay_reclaims_at_the_first_outage_after_launch() -> None:
    trace = json.loads(TRACE.read_text())
    data, gap = trace["data"], trace["metadata"]["gap_seconds"]
    src = TracePreemptions.from_file(TRACE, time_scale=gap, started_at=1000.0)  # 1 tick = 1 s
    first_outage = data.index(0)
    back = first_outage + data[first_outage:].index(1)  # spot returns
    next_outage = back + data[back:].index(0)
    assert src.preempt_at("i-a", 1000.0) == 1000.0 + first_outage
    assert src.preempt_at("i-b", 1000.0 + first_outage + 0.5) == 1000.0 + first_outage + 0.5  # launched in an outage
    assert src.preempt_at("i-c", 1000.0 + back) == 1000.0 + next_outage
    assert src.available_at(1000.0) and not src.available_at(1000.0 + first_outage)


def test_trace_replay_loops_and_a_trace_without_outages_never_preempts() -> None:
    src = TracePreemptions([1, 0, 1, 1], 10.0, time_scale=10.0, started_at=0.0)  # 1 s ticks, 4 s period
    assert src.preempt_at("i", 2.0) == 5.0  # past the last outage: the outage of the next pass
    assert TracePreemptions([1, 1, 1], 60.0, started_at=0.0).preempt_at("i", 5.0) is None
    gang = TracePreemptions([4, 3, 4], 1.0, started_at=0.0)  # a 4-node file: 3 of 4 is not enough
    assert gang.nodes == 4 and gang.preempt_at("i", 0.0) == 1.0


def test_seeded_rate_is_reproducible_per_instance_and_has_the_asked_mean() -> None:
    src = PoissonPreemptions(2.0, seed=7, time_scale=60.0)  # 2 per scaled hour = one per 30 wall s on average
    assert src.preempt_at("i-1", 0.0) == PoissonPreemptions(2.0, seed=7, time_scale=60.0).preempt_at("i-1", 0.0)
    assert src.preempt_at("i-1", 0.0) != src.preempt_at("i-2", 0.0)
    assert src.preempt_at("i-1", 0.0) != PoissonPreemptions(2.0, seed=8, time_scale=60.0).preempt_at("i-1", 0.0)
    draws = [src.preempt_at(f"i-{n}", 0.0) or 0.0 for n in range(4000)]
    assert sum(draws) / len(draws) == pytest.approx(30.0, rel=0.05)
    assert PoissonPreemptions(0.0).preempt_at("i", 0.0) is None


def test_scheduler_notices_first_then_preempts_only_running_spot_instances(key: ClientKey) -> None:
    now = [1_000.0]
    with SimCloudServer(api_key=API_KEY, clock=lambda: now[0]) as server:
        api = httpx.Client(base_url=server.api_url, headers={"Authorization": f"Bearer {API_KEY}"})
        api.post("/ssh-keys", json={"name": "k", "public_key": key.public_line}).raise_for_status()

        def launch(type_name: str) -> str:
            resp = api.post("/instance-operations/launch", json={
                "region_name": "us-east-1", "instance_type_name": type_name, "ssh_key_names": ["k"]})
            return str(resp.json()["data"]["instance_ids"][0])

        spot, on_demand = launch("gpu_1x_a10_spot"), launch("gpu_1x_a10")
        while any(api.get(f"/instances/{i}").json()["data"]["status"] != "active" for i in (spot, on_demand)):
            time.sleep(0.01)
        trace = TracePreemptions([1, 1, 1, 0], 100.0, time_scale=1.0, started_at=1_000.0)  # outage at +300 s
        scheduler = PreemptionScheduler(server, trace, notice_lead_s=120.0)
        assert scheduler.step(now=1_100.0) == []
        assert scheduler.step(now=1_180.0) == [("notice", spot)]  # 120 s before the outage
        assert server.instance_action(spot) is not None and server.instance_action(on_demand) is None
        assert scheduler.step(now=1_250.0) == []
        assert scheduler.step(now=1_300.0) == [("preempt", spot)]
        assert api.get(f"/instances/{spot}").json()["data"]["status"] == "preempted"
        assert api.get(f"/instances/{on_demand}").json()["data"]["status"] == "active"
        assert scheduler.step(now=1_400.0) == []
        api.close()


def test_simcloud_ec2_serves_the_simulated_ec2_and_prints_the_settings_that_reach_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = subprocess.Popen([*ENTRY, "--state-dir", str(state), "simcloud", "ec2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        printed = simcloud_ec2_printed(proc)
        settings = [line for line in printed if line.strip() and not line.startswith("#")]
        admin_url = printed[-1].split("--url ")[-1].strip()
        config = tmp_path / "burstctl.toml"
        config.write_text("[providers.sim]\nenabled = false\n" + "".join(settings))  # pasted as the output says
        env = {"AWS_ACCESS_KEY_ID": "simulated", "AWS_SECRET_ACCESS_KEY": "simulated",
               "AWS_EC2_METADATA_DISABLED": "true"}
        r = burstctl("--config", str(config), "--state-dir", str(tmp_path / "daemon-state"), "providers", "--json",
                     env=env)
        assert r.returncode == 0, r.stderr
        (ec2,) = [p for p in json.loads(r.stdout)["providers"] if p["name"] == "ec2"]
        assert ec2["answers"] is True and [o["type"] for o in ec2["offers"]] == ["p3.2xlarge"]
        r = burstctl("simcloud", "status", "--url", admin_url, "--json")
        assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert processes_touching(state) == []
