"""`burstctl simcloud preempt | status --url ADMIN_URL` against the simulated EC2, as README's "The simulated EC2"
says they drive it: a spot instance launched through boto3 (moto's server), reclaimed by the CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.e2e import burstctl_argv, simcloud_ec2_printed, wait_for

SPOT_TERMINATION = "Server.SpotInstanceTermination"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "simulated", "AWS_SECRET_ACCESS_KEY": "simulated"}


@dataclass
class Ec2:
    """`burstctl simcloud ec2` as its own process (moto's patches stay out of this one), as its output tells it."""
    settings: dict[str, Any]
    admin_url: str

    def client(self) -> Any:
        return boto3.client("ec2", region_name=self.settings["region"], endpoint_url=self.settings["endpoint_url"],
                            aws_access_key_id="simulated", aws_secret_access_key="simulated")

    def instances(self) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.admin_url}/_sim/instances", timeout=10).json()["data"])

    def billing(self) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.admin_url}/_sim/billing", timeout=10).json()["data"])


@pytest.fixture(scope="module")
def ec2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ec2]:
    state = tmp_path_factory.mktemp("ec2")
    proc = subprocess.Popen(burstctl_argv("--state-dir", str(state), "simcloud", "ec2"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **CREDENTIALS})
    try:
        printed = simcloud_ec2_printed(proc)
        settings = tomllib.loads("".join(printed))["providers"]["ec2"]
        yield Ec2(settings, printed[-1].split("--url ")[-1].strip())
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def launch(ec2: Ec2, market: str = "spot") -> str:
    """One p3.2xlarge in the first zone, as the adapter launches it (key pair, subnet, spot one-time)."""
    client = ec2.client()
    public = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
    name = f"k-{time.monotonic_ns()}"
    client.import_key_pair(KeyName=name, PublicKeyMaterial=public)
    extra: dict[str, Any] = ({"InstanceMarketOptions": {"MarketType": "spot", "SpotOptions": {
        "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}} if market == "spot" else {})
    zone = ec2.settings["zones"][0]
    reply = client.run_instances(ImageId="ami-12c6146b", InstanceType="p3.2xlarge", MinCount=1, MaxCount=1,
                                 KeyName=name, SubnetId=ec2.settings["subnet_ids"][zone], **extra)
    iid = str(reply["Instances"][0]["InstanceId"])
    wait_for(lambda: any(i["id"] == iid and i["machine"] for i in ec2.instances()), 30,
             "the instance's machine to boot")
    return iid


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(burstctl_argv("simcloud", *args), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("as_json", [True, False])
def test_preempt_of_a_running_ec2_spot_instance_says_it_reclaimed_it(ec2: Ec2, as_json: bool) -> None:
    iid = launch(ec2)
    r = cli("preempt", iid, "--notice-seconds", "0", "--url", ec2.admin_url, *(["--json"] if as_json else []))
    assert r.returncode == 0, r.stderr
    # The simulated EC2 reclaimed it (a spot termination, billed as preempted), its client did nothing.
    (inst,) = [i for i in ec2.instances() if i["id"] == iid]
    assert inst["status"] == "terminated" and inst["reason"] == SPOT_TERMINATION and not inst["machine"]
    assert next(b for b in ec2.billing() if b["instance_id"] == iid)["preempted"] is True
    if as_json:
        result = json.loads(r.stdout)
        assert result["already_gone"] is False and result["status"] == "terminated"
        assert result["reason"] == SPOT_TERMINATION
    else:
        assert f"preempted: {iid}" in r.stdout and "already gone" not in r.stdout


def test_preempt_of_an_ec2_spot_instance_its_client_terminated_on_the_notice_is_already_gone(ec2: Ec2) -> None:
    iid = launch(ec2)
    proc = subprocess.Popen(burstctl_argv("simcloud", "preempt", iid, "--notice-seconds", "3", "--url", ec2.admin_url,
                                          "--json"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: httpx.get(f"{ec2.admin_url}/{iid}/latest/meta-data/spot/instance-action",
                               timeout=10).status_code == 200, 30, "the notice")
    ec2.client().terminate_instances(InstanceIds=[iid])
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    result = json.loads(stdout)
    assert result["already_gone"] is True and result["reason"] != SPOT_TERMINATION


def test_preempt_of_an_ec2_on_demand_instance_is_bad_input(ec2: Ec2) -> None:
    iid = launch(ec2, market="on-demand")
    r = cli("preempt", iid, "--notice-seconds", "0", "--url", ec2.admin_url)
    assert r.returncode == 2 and "only spot instances" in r.stderr, r.stderr


def test_status_shows_an_ec2_instances_zone_ssh_endpoint_and_runtime(ec2: Ec2) -> None:
    iid = launch(ec2)
    r = cli("status", "--url", ec2.admin_url, "--json")
    assert r.returncode == 0, r.stderr
    (record,) = [x for x in json.loads(r.stdout) if x["id"] == iid]
    private_ip = record["private_ip"]
    assert record["region"] == ec2.settings["zones"][0]
    assert (record["host"], record["ssh_port"], record["ssh_user"]) == (private_ip, ec2.settings["ssh_port"],
                                                                         ec2.settings["ssh_user"])
    assert record["runtime_s"] is not None and record["runtime_s"] >= 0
    table = cli("status", "--url", ec2.admin_url)
    row = next(line for line in table.stdout.splitlines() if iid in line)
    assert ec2.settings["zones"][0] in row and f"{private_ip}:{ec2.settings['ssh_port']}" in row


def test_docs_ec2_tells_how_to_run_the_simulated_ec2_with_flags_it_has() -> None:
    # docs/ec2.md described the simulated EC2 by its Python API only; the command a user runs was in README alone.
    doc = (Path(__file__).resolve().parent.parent / "docs" / "ec2.md").read_text()
    section = doc[doc.index("## The simulated EC2"):doc.index("## Figures measured")]
    assert "burstctl simcloud ec2" in section and "--s3-checkpoints" in section
    for command in ("ec2", "status", "preempt"):
        named = set(re.findall(rf"burstctl simcloud {command} ([^\n`]*)", section))
        flags = {f for line in named for f in re.findall(r"--[a-z0-9-]+", line)}
        helped = cli(command, "--help").stdout
        assert flags and all(f in helped for f in flags), (command, flags)
