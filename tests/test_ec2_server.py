"""The EC2 adapter over real HTTP: moto's server on 127.0.0.1, reached through the standard endpoint settings.

This is what a separate daemon process sees: no in-process patching, only `AWS_ENDPOINT_URL` (or the
config's `endpoint_url`) and credentials from the environment.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from moto.core import DEFAULT_ACCOUNT_ID
from moto.ec2.models import ec2_backends
from moto.ec2.models.instances import StateReason
from moto.server import ThreadedMotoServer

from orchestrator.config import Ec2Provider
from providers.base import (
    AuthFailed,
    InstanceState,
    LaunchRequest,
    Market,
    OwnerTags,
    ProviderError,
    RetryPolicy,
    Transient,
)
from providers.ec2 import Ec2Adapter

REPO = Path(__file__).resolve().parent.parent
REGION = "us-east-1"
ORCH = "orch-http"
PLANTED_SECRET = "PlantedSecret/OverHttp+0123456789abcdefXYZ"
FAST_RETRY = RetryPolicy(attempts=3, max_total_s=30.0, initial_s=0.001, max_wait_s=0.002)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, type_: str, **data: Any) -> None:
        self.events.append((type_, data))


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def server_env(moto_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A fresh moto state and an environment that points the standard AWS chain at it."""
    httpx.post(f"{moto_url}/moto-api/reset").raise_for_status()
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAHTTPTESTKEY00000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PLANTED_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_EC2"):
        monkeypatch.delenv(name, raising=False)
    return moto_url


def make_adapter(sink: Recorder | None = None, **config: Any) -> Ec2Adapter:
    config.setdefault("instance_types", ["g5.xlarge"])
    config.setdefault("on_demand_usd_h", {"g5.xlarge": 1.006})
    config.setdefault("zones", ["us-east-1a", "us-east-1b"])
    return Ec2Adapter(Ec2Provider(enabled=True, region=REGION, **config), orchestrator_id=ORCH, sink=sink,
                      retry=FAST_RETRY, sleep=lambda s: None, connect_timeout_s=2.0, read_timeout_s=10.0)


def request_for(attempt: str, market: Market = Market.SPOT) -> LaunchRequest:
    return LaunchRequest(instance_type="g5.xlarge", market=market, tags=OwnerTags(ORCH, "job-h", attempt),
                         idempotency_key=f"{attempt}-launch", ssh_public_key="")


def interrupt_spot(instance_id: str) -> None:
    """EC2's spot interruption, applied to the server's state (the threaded server shares this process)."""
    instance = ec2_backends[DEFAULT_ACCOUNT_ID][REGION].get_instance(instance_id)
    instance.terminate()
    instance.state_reason = StateReason("Server.SpotInstanceTermination: Spot instance termination",
                                        "Server.SpotInstanceTermination")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_launch_interrupt_describe_terminate_over_http_via_aws_endpoint_url(server_env: str) -> None:
    sink = Recorder()
    adapter = make_adapter(sink)
    assert adapter.client.meta.endpoint_url == server_env  # picked up from the environment, not from config

    info = adapter.launch(request_for("att-h1"))
    assert info.market is Market.SPOT and info.tags["burstctl:attempt"] == "att-h1"
    assert adapter.describe([info.id])[info.id].state is InstanceState.RUNNING

    interrupt_spot(info.id)
    seen = adapter.describe([info.id])[info.id]
    assert seen.state is InstanceState.PREEMPTED and seen.reason == "Server.SpotInstanceTermination"

    adapter.terminate([info.id])
    adapter.terminate([info.id])
    assert [(i.id, i.state) for i in adapter.list_owned()] == [(info.id, InstanceState.PREEMPTED)]
    assert {e["call"] for t, e in sink.events if t == "provider.call"} >= {
        "DescribeInstances", "RunInstances", "DescribeAvailabilityZones"}


def test_endpoint_url_from_config_serves_offers_and_launches(server_env: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    adapter = make_adapter(endpoint_url=server_env, instance_types=["g5.xlarge", "p3.2xlarge"],
                           on_demand_usd_h={"g5.xlarge": 1.006, "p3.2xlarge": 3.06})
    assert adapter.client.meta.endpoint_url == server_env

    offers = {o.instance_type: o for o in adapter.offers()}
    assert (offers["g5.xlarge"].gpu_model, offers["p3.2xlarge"].gpu_model) == ("A10", "V100")
    assert offers["g5.xlarge"].regions == ("us-east-1a", "us-east-1b")

    info = adapter.launch(request_for("att-h2", Market.ON_DEMAND))
    adapter.terminate([info.id])
    assert adapter.describe([info.id])[info.id].state is InstanceState.TERMINATED


LAUNCH_SCRIPT = textwrap.dedent("""
    import json, sys
    from orchestrator.config import Ec2Provider
    from providers.base import LaunchRequest, Market, OwnerTags, RetryPolicy
    from providers.ec2 import Ec2Adapter

    events = []
    adapter = Ec2Adapter(
        Ec2Provider(enabled=True, region="us-east-1", instance_types=["g5.xlarge"], zones=["us-east-1a"]),
        orchestrator_id="orch-http", sink=lambda t, **d: events.append(t),
        retry=RetryPolicy(attempts=2, initial_s=0.001, max_wait_s=0.002))
    attempt = sys.argv[1]
    info = adapter.launch(LaunchRequest("g5.xlarge", Market.SPOT, OwnerTags("orch-http", "job-sub", attempt),
                                        attempt + "-launch", ""))
    print(json.dumps({"id": info.id, "state": str(info.state), "events": events}))
""")


def test_a_separate_process_launches_through_the_adapter_and_a_second_run_finds_it(server_env: str) -> None:
    def run_launcher() -> dict[str, Any]:
        done = subprocess.run([sys.executable, "-c", LAUNCH_SCRIPT, "att-sub"], capture_output=True, text=True,
                              cwd=REPO, env=dict(os.environ), timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert PLANTED_SECRET not in done.stdout + done.stderr
        return json.loads(done.stdout)

    first = run_launcher()
    second = run_launcher()  # a restarted daemon relaunching the same attempt

    assert "provider.launched" in first["events"]
    assert second["id"] == first["id"] and "provider.launch_found_existing" in second["events"]
    adapter = make_adapter()
    owned = adapter.list_owned()
    assert [(i.id, i.attempt_id, i.region) for i in owned] == [(first["id"], "att-sub", "us-east-1a")]


def test_unreachable_endpoint_is_transient_after_bounded_retries(server_env: str) -> None:
    sink = Recorder()
    adapter = make_adapter(sink, endpoint_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(Transient) as raised:
        adapter.describe(["i-0123456789abcdef0"])
    assert raised.value.code == "EndpointConnectionError"
    assert [e["tries"] for t, e in sink.events if t == "provider.call"] == [FAST_RETRY.attempts]
    assert PLANTED_SECRET not in json.dumps(sink.events) + str(raised.value)


def test_missing_credentials_fail_as_auth_before_any_request(server_env: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(AuthFailed) as raised:
        make_adapter().launch(request_for("att-nocred"))
    assert raised.value.code == "NoCredentials"


@pytest.fixture
def auth_checking_moto(tmp_path: Path) -> Iterator[str]:
    """A moto server *process* that checks credentials (INITIAL_NO_AUTH_ACTION_COUNT=0): unknown keys fail."""
    port = free_port()
    log = (tmp_path / "moto-auth.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_real_auth_failure_from_the_server_is_not_retried_and_leaks_no_secret(
        server_env: str, auth_checking_moto: str) -> None:
    sink = Recorder()
    adapter = make_adapter(sink, endpoint_url=auth_checking_moto)
    with pytest.raises(ProviderError) as raised:
        adapter.launch(request_for("att-auth"))
    assert type(raised.value) is AuthFailed and raised.value.code == "AuthFailure"
    assert [e["tries"] for t, e in sink.events if t == "provider.call"] == [1]
    assert PLANTED_SECRET not in json.dumps(sink.events) + str(raised.value) + repr(raised.value)
