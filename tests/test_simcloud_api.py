"""simcloud's REST API over real HTTP: the Lambda contract's shapes, capacity, quota, spot notices and
preemption, billing, fault injection, rate limits and persisted state."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from providers.simcloud.api import FaultKind, RateLimits, SimCloudServer
from providers.simcloud.backend import Endpoint
from providers.simcloud.contract import Contract

CONTRACT = Path(__file__).resolve().parents[2] / "shared" / "contracts" / "lambda-cloud" / "openapi-1.8.3.json"
pytestmark = pytest.mark.skipif(not CONTRACT.exists(), reason="shared Lambda contract not present")

KEY = "sim-test-key-0001"
AUTH = {"Authorization": f"Bearer {KEY}"}
PUBKEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAISimcloudApiTestKey000000000000000000000000 t@t"


class RecordingBackend:
    """A backend whose machines are records: it shows what the server asked of the seam, and when."""

    def __init__(self, fail_start: bool = False) -> None:
        self.started: list[tuple[str, str]] = []
        self.stopped: list[str] = []
        self.closed = False
        self.fail_start = fail_start
        self.release = threading.Event()
        self.release.set()

    def start(self, instance_id: str, ssh_public_key: str) -> Endpoint:
        self.release.wait(10)
        if self.fail_start:
            raise RuntimeError("sshd did not come up")
        self.started.append((instance_id, ssh_public_key))
        return Endpoint(host="127.0.0.1", port=40022, host_key="ssh-ed25519 AAAAhostkey", user="burst")

    def stop(self, instance_id: str) -> None:
        self.stopped.append(instance_id)

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def contract() -> Contract:
    return Contract.load(CONTRACT)


def make_server(**kw: Any) -> SimCloudServer:
    return SimCloudServer(api_key=KEY, contract_path=CONTRACT, **kw)


@pytest.fixture
def server() -> Iterator[SimCloudServer]:
    with make_server() as s:
        yield s


def client(s: SimCloudServer, timeout: float = 5.0) -> httpx.Client:
    return httpx.Client(base_url=s.api_url, headers=AUTH, timeout=timeout)


def add_key(c: httpx.Client, name: str = "k") -> None:
    c.post("/ssh-keys", json={"name": name, "public_key": PUBKEY}).raise_for_status()


def launch_body(region: str = "us-east-1", itype: str = "gpu_1x_h100_sxm5", name: str = "burst-x") -> dict[str, Any]:
    return {"region_name": region, "instance_type_name": itype, "ssh_key_names": ["k"], "name": name,
            "tags": [{"key": "burstctl:attempt", "value": name}]}


def wait_until(predicate: Callable[[], bool], deadline_s: float = 15.0) -> None:
    """Poll until true; the deadline only bounds a hang."""
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition never became true")
        time.sleep(0.02)


# --- the contract ----------------------------------------------------------------------------------------------
def test_responses_match_the_contracts_documented_shapes(server: SimCloudServer, contract: Contract) -> None:
    with client(server) as c:
        add_key(c)
        exchanges: list[tuple[str, str, httpx.Response]] = [
            ("GET", "/api/v1/instance-types", c.get("/instance-types")),
            ("GET", "/api/v1/ssh-keys", c.get("/ssh-keys")),
        ]
        launched = c.post("/instance-operations/launch", json=launch_body())
        exchanges.append(("POST", "/api/v1/instance-operations/launch", launched))
        iid = launched.json()["data"]["instance_ids"][0]
        exchanges += [
            ("GET", f"/api/v1/instances/{iid}", c.get(f"/instances/{iid}")),
            ("GET", "/api/v1/instances", c.get("/instances")),
            ("POST", "/api/v1/instance-operations/terminate",
             c.post("/instance-operations/terminate", json={"instance_ids": [iid]})),
            ("GET", "/api/v1/instances/nope", c.get("/instances/nope")),
            ("POST", "/api/v1/instance-operations/launch", c.post("/instance-operations/launch",
                                                                  json=launch_body(itype="gpu_9x_nothing"))),
        ]
        server.set_quota(0)
        exchanges.append(("POST", "/api/v1/instance-operations/launch",
                          c.post("/instance-operations/launch", json=launch_body())))
        exchanges.append(("GET", "/api/v1/instances", c.get("/instances", headers={"Authorization": "Bearer no"})))
    statuses = [r.status_code for _, _, r in exchanges]
    assert statuses == [200, 200, 200, 200, 200, 200, 404, 404, 400, 401]
    problems = [contract.check_response(m, p, r.status_code, r.json()) for m, p, r in exchanges]
    assert problems == [None] * len(exchanges)


def test_requests_outside_the_contract_get_400_and_are_recorded(server: SimCloudServer) -> None:
    with client(server) as c:
        bad_tag = {**launch_body(), "tags": [{"key": "Has Spaces", "value": "x"}]}
        r1 = c.post("/instance-operations/launch", json=bad_tag)
        r2 = c.post("/instance-operations/launch", json={"region_name": "mars-1", "instance_type_name": "x",
                                                          "ssh_key_names": ["k"]})
        r3 = c.get("/no-such-route")
    assert [r.status_code for r in (r1, r2, r3)] == [400, 400, 400]
    assert {r.json()["error"]["code"] for r in (r1, r2, r3)} == {"global/invalid-parameters"}
    assert [v.path for v in server.violations] == ["/api/v1/instance-operations/launch"] * 2 + ["/api/v1/no-such-route"]
    assert "tags/0/key" in server.violations[0].problem
    assert server.instances() == []
    admin = httpx.get(server.url + "/_sim/violations").json()["data"]
    assert len(admin) == 3


def test_bearer_auth_is_required(server: SimCloudServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.get(server.api_url + "/instances", headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (401, "global/invalid-api-key")


# --- capacity, quota ----------------------------------------------------------------------------------------------
def test_capacity_is_listed_and_enforced_per_type_and_region(server: SimCloudServer) -> None:
    server.set_capacity("gpu_1x_a10", "us-east-1", 1)
    with client(server) as c:
        add_key(c)

        def regions() -> list[str]:
            item = c.get("/instance-types").json()["data"]["gpu_1x_a10"]
            return [r["name"] for r in item["regions_with_capacity_available"]]

        assert regions() == ["us-east-1", "us-west-1"]
        assert c.post("/instance-operations/launch", json=launch_body(itype="gpu_1x_a10")).status_code == 200
        assert regions() == ["us-west-1"]
        full = c.post("/instance-operations/launch", json=launch_body(itype="gpu_1x_a10", name="burst-y"))
        assert (full.status_code, full.json()["error"]["code"]) == (
            400, "instance-operations/launch/insufficient-capacity")
        assert c.post("/instance-operations/launch", json=launch_body("us-west-1", "gpu_1x_a10")).status_code == 200


def test_quota_counts_live_instances(server: SimCloudServer) -> None:
    server.set_quota(1)
    with client(server) as c:
        add_key(c)
        iid = c.post("/instance-operations/launch", json=launch_body()).json()["data"]["instance_ids"][0]
        over = c.post("/instance-operations/launch", json=launch_body(name="burst-2"))
        assert (over.status_code, over.json()["error"]["code"]) == (400, "global/quota-exceeded")
        c.post("/instance-operations/terminate", json={"instance_ids": [iid]}).raise_for_status()
        wait_until(lambda: c.get(f"/instances/{iid}").status_code == 404)
        assert c.post("/instance-operations/launch", json=launch_body(name="burst-3")).status_code == 200


def test_launch_needs_a_registered_key_and_known_type(server: SimCloudServer) -> None:
    with client(server) as c:
        no_key = c.post("/instance-operations/launch", json=launch_body())
        assert (no_key.status_code, no_key.json()["error"]["code"]) == (404, "global/object-does-not-exist")
        add_key(c)
        dup = c.post("/ssh-keys", json={"name": "k", "public_key": PUBKEY})
        assert dup.status_code == 400


# --- instance lifecycle through the backend seam -------------------------------------------------------------------
def test_boot_calls_the_backend_and_exposes_its_endpoint() -> None:
    backend = RecordingBackend()
    backend.release.clear()  # hold the machine in `booting`
    with make_server(backend=backend) as s, client(s) as c:
        add_key(c)
        iid = c.post("/instance-operations/launch", json=launch_body()).json()["data"]["instance_ids"][0]
        booting = c.get(f"/instances/{iid}").json()["data"]
        assert booting["status"] == "booting" and "ip" not in booting
        backend.release.set()
        wait_until(lambda: c.get(f"/instances/{iid}").json()["data"]["status"] == "active")
        active = c.get(f"/instances/{iid}").json()["data"]
        assert (active["ip"], active["ssh_port"], active["ssh_user"], active["ssh_host_key"]) == (
            "127.0.0.1", 40022, "burst", "ssh-ed25519 AAAAhostkey")
        assert backend.started == [(iid, PUBKEY)]
        c.post("/instance-operations/terminate", json={"instance_ids": [iid]}).raise_for_status()
        wait_until(lambda: backend.stopped == [iid])
        wait_until(lambda: c.get(f"/instances/{iid}").status_code == 404)
    assert backend.closed


def test_a_machine_that_fails_to_boot_makes_the_instance_unhealthy() -> None:
    with make_server(backend=RecordingBackend(fail_start=True)) as s, client(s) as c:
        add_key(c)
        iid = c.post("/instance-operations/launch", json=launch_body()).json()["data"]["instance_ids"][0]
        wait_until(lambda: c.get(f"/instances/{iid}").json()["data"]["status"] == "unhealthy")
        assert "sshd did not come up" in c.get(f"/instances/{iid}").json()["data"]["status_reason"]


def test_terminate_during_boot_stops_the_machine_that_came_up() -> None:
    backend = RecordingBackend()
    backend.release.clear()
    with make_server(backend=backend) as s, client(s) as c:
        add_key(c)
        iid = c.post("/instance-operations/launch", json=launch_body()).json()["data"]["instance_ids"][0]
        c.post("/instance-operations/terminate", json={"instance_ids": [iid]}).raise_for_status()
        backend.release.set()
        wait_until(lambda: backend.stopped.count(iid) == 2)  # once for terminate, once when boot finished late
        assert c.get(f"/instances/{iid}").status_code == 404


# --- spot --------------------------------------------------------------------------------------------------------
def test_spot_types_are_listed_cheaper_and_marked(server: SimCloudServer) -> None:
    with client(server) as c:
        types = c.get("/instance-types").json()["data"]
    spot, base = types["gpu_1x_h100_sxm5_spot"]["instance_type"], types["gpu_1x_h100_sxm5"]["instance_type"]
    assert (spot["market"], spot["on_demand_type"], base["market"]) == ("spot", "gpu_1x_h100_sxm5", "on-demand")
    assert spot["price_cents_per_hour"] < base["price_cents_per_hour"]


def test_spot_notice_then_preemption() -> None:
    backend = RecordingBackend()
    with make_server(backend=backend) as s, client(s) as c:
        add_key(c)
        iid = c.post("/instance-operations/launch",
                     json=launch_body(itype="gpu_1x_h100_sxm5_spot")).json()["data"]["instance_ids"][0]
        meta = f"{s.url}/_sim/instances/{iid}/latest/meta-data/spot/instance-action"
        assert httpx.get(meta).status_code == 404  # EC2: no notice, no document
        notice = httpx.post(f"{s.url}/_sim/instances/{iid}/notice", json={"seconds": 120}).json()["data"]
        action = httpx.get(meta).json()
        assert action == notice and action["action"] == "terminate"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", action["time"])
        httpx.post(f"{s.url}/_sim/instances/{iid}/preempt", json={}).raise_for_status()
        seen = c.get(f"/instances/{iid}").json()["data"]
        assert (seen["status"], seen["status_reason"]) == ("preempted", "spot-preempted")
        assert backend.stopped == [iid]
        assert [i["id"] for i in c.get("/instances").json()["data"]] == [iid]  # visible until terminated


def test_a_reclaim_leaves_an_instance_its_client_is_terminating_alone() -> None:
    # A client acting on the notice (burstctl's daemon does) may still be terminating the instance when the reclaim
    # comes: it stays a termination, ended and billed when the client let it go.
    backend = RecordingBackend()
    stop_gate = threading.Event()
    recorded_stop = backend.stop

    def slow_stop(instance_id: str) -> None:
        stop_gate.wait(10)  # hold the instance in `terminating`
        recorded_stop(instance_id)

    backend.stop = slow_stop  # type: ignore[method-assign]
    now = [1_000.0]
    with make_server(backend=backend, clock=lambda: now[0]) as s, client(s) as c:
        add_key(c)
        iid = c.post("/instance-operations/launch",
                     json=launch_body(itype="gpu_1x_h100_sxm5_spot")).json()["data"]["instance_ids"][0]
        wait_until(lambda: c.get(f"/instances/{iid}").json()["data"]["status"] == "active")
        httpx.post(f"{s.url}/_sim/instances/{iid}/notice", json={"seconds": 2}).raise_for_status()
        now[0] = 1_060.0
        c.post("/instance-operations/terminate", json={"instance_ids": [iid]}).raise_for_status()
        now[0] = 1_062.0
        httpx.post(f"{s.url}/_sim/instances/{iid}/preempt", json={}).raise_for_status()
        assert c.get(f"/instances/{iid}").json()["data"]["status"] == "terminating"
        (bill,) = httpx.get(f"{s.url}/_sim/billing").json()["data"]
        assert bill["runtime_s"] == pytest.approx(60.0)
        stop_gate.set()
        wait_until(lambda: c.get(f"/instances/{iid}").status_code == 404)
        (record,) = httpx.get(f"{s.url}/_sim/instances").json()["data"]
        assert (record["status"], record["status_reason"]) == ("terminated", None)


def test_on_demand_instances_cannot_be_preempted(server: SimCloudServer) -> None:
    with client(server) as c:
        add_key(c)
        iid = c.post("/instance-operations/launch", json=launch_body()).json()["data"]["instance_ids"][0]
    with pytest.raises(ValueError, match="on-demand"):
        server.preempt(iid)
    assert httpx.post(f"{server.url}/_sim/instances/{iid}/preempt", json={}).status_code == 400


# --- billing -------------------------------------------------------------------------------------------------------
def test_billing_applies_the_minimum_and_rounds_up_to_seconds() -> None:
    now = [5000.0]
    with make_server(clock=lambda: now[0], billing_minimum_s=60.0) as s, client(s) as c:
        add_key(c)
        short = c.post("/instance-operations/launch", json=launch_body()).json()["data"]["instance_ids"][0]
        long = c.post("/instance-operations/launch",
                      json=launch_body(itype="gpu_1x_a10", name="burst-l")).json()["data"]["instance_ids"][0]
        now[0] += 30.0
        c.post("/instance-operations/terminate", json={"instance_ids": [short]}).raise_for_status()
        now[0] += 95.2
        c.post("/instance-operations/terminate", json={"instance_ids": [long]}).raise_for_status()
        now[0] += 1000.0  # time after the end is not billed
        bills = {b["instance_id"]: b for b in httpx.get(s.url + "/_sim/billing").json()["data"]}
    assert (bills[short]["billed_s"], bills[short]["rate_usd_h"]) == (60.0, 3.29)
    assert bills[short]["cost_usd"] == pytest.approx(60 / 3600 * 3.29, abs=1e-6)
    assert (bills[long]["billed_s"], bills[long]["runtime_s"]) == (126.0, pytest.approx(125.2))
    assert bills[long]["cost_usd"] == pytest.approx(126 / 3600 * 0.75, abs=1e-6)


# --- faults --------------------------------------------------------------------------------------------------------
def test_faults_injected_over_http_fire_the_given_number_of_times(server: SimCloudServer) -> None:
    admin = server.url + "/_sim/faults"
    httpx.post(admin, json={"kind": "throttle-html", "count": 1, "route": "instances"}).raise_for_status()
    httpx.post(admin, json={"kind": "server-error", "status": 502, "count": 1}).raise_for_status()
    httpx.post(admin, json={"kind": "throttle", "count": 1}).raise_for_status()
    with client(server) as c:
        types_reply = c.get("/instance-types")  # the instances-only fault does not match: the 502 fires
        html = c.get("/instances")
        json_429 = c.get("/instances")
        ok = c.get("/instances")
    assert (types_reply.status_code, types_reply.headers["content-type"]) == (502, "text/html")
    assert (html.status_code, html.headers["content-type"]) == (429, "text/html; charset=utf-8")
    assert html.text.startswith("<!DOCTYPE html>")
    assert (json_429.status_code, json_429.json()["error"]["code"]) == (429, "global/too-many-requests")
    assert ok.status_code == 200
    assert httpx.get(admin).json()["data"] == []


def test_a_server_error_says_when_to_ask_again_only_when_told_to(server: SimCloudServer) -> None:
    # A 503 for maintenance may carry Retry-After; the plain gateway error the other tests inject carries none.
    admin = server.url + "/_sim/faults"
    httpx.post(admin, json={"kind": "server-error", "status": 503, "retry_after_s": 42}).raise_for_status()
    server.inject(FaultKind.SERVER_ERROR, status=500, retry_after_s=7)
    server.inject(FaultKind.SERVER_ERROR, status=503)
    with client(server) as c:
        replies = [c.get("/instance-types") for _ in range(3)]
    assert [(r.status_code, r.headers.get("retry-after")) for r in replies] == [(503, "42"), (500, "7"), (503, None)]
    assert replies[1].json()["error"]["code"] == "global/internal-error"


def test_regional_capacity_fault_only_hits_its_regions(server: SimCloudServer) -> None:
    server.inject(FaultKind.INSUFFICIENT_CAPACITY, count=5, regions=["us-east-1"])
    with client(server) as c:
        add_key(c)
        east = c.post("/instance-operations/launch", json=launch_body("us-east-1"))
        west = c.post("/instance-operations/launch", json=launch_body("us-west-1"))
    assert east.json()["error"]["code"] == "instance-operations/launch/insufficient-capacity"
    assert west.status_code == 200


def test_timeout_fault_drops_the_request_without_effect(server: SimCloudServer) -> None:
    server.inject(FaultKind.TIMEOUT, route="instance-operations/launch", delay_s=3.0)
    with client(server, timeout=0.3) as c:
        add_key(c)
        with pytest.raises(httpx.TimeoutException):
            c.post("/instance-operations/launch", json=launch_body())
    assert server.instances() == []


def test_delayed_response_fault_launches_but_answers_too_late(server: SimCloudServer) -> None:
    server.inject(FaultKind.DELAYED_RESPONSE, route="instance-operations/launch", delay_s=3.0)
    with client(server, timeout=0.3) as c:
        add_key(c)
        with pytest.raises(httpx.TimeoutException):
            c.post("/instance-operations/launch", json=launch_body())
        assert [i["name"] for i in c.get("/instances").json()["data"]] == ["burst-x"]
    assert len(server.instances()) == 1


def test_unhealthy_status_can_be_forced(server: SimCloudServer) -> None:
    with client(server) as c:
        add_key(c)
        iid = c.post("/instance-operations/launch", json=launch_body()).json()["data"]["instance_ids"][0]
        httpx.post(f"{server.url}/_sim/instances/{iid}/status",
                   json={"status": "unhealthy", "reason": "gpu-fell-off-the-bus"}).raise_for_status()
        seen = c.get(f"/instances/{iid}").json()["data"]
    assert (seen["status"], seen["status_reason"]) == ("unhealthy", "gpu-fell-off-the-bus")


def test_enforced_rate_limits_answer_429() -> None:
    # Launch interval of an hour and a bucket of 3 requests refilled at 1 per ~17 min: nothing refills mid-test.
    limits = RateLimits(requests_per_s=0.001, burst=3, launch_interval_s=3600.0)
    with make_server(rate_limits=limits) as s, client(s) as c:
        add_key(c)
        first = c.post("/instance-operations/launch", json=launch_body())
        second = c.post("/instance-operations/launch", json=launch_body(name="burst-2"))
        third = c.get("/instances")
    assert [r.status_code for r in (first, second, third)] == [200, 429, 429]
    assert len(s.instances()) == 1


# --- persistence ---------------------------------------------------------------------------------------------------
def test_state_survives_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "simstate"
    with make_server(state_dir=state) as s, client(s) as c:
        add_key(c)
        kept = c.post("/instance-operations/launch", json=launch_body()).json()["data"]["instance_ids"][0]
        second = c.post("/instance-operations/launch", json=launch_body(name="burst-e"))
        ended = second.json()["data"]["instance_ids"][0]
        wait_until(lambda: c.get(f"/instances/{kept}").json()["data"]["status"] == "active")
        c.post("/instance-operations/terminate", json={"instance_ids": [ended]}).raise_for_status()
        wait_until(lambda: c.get(f"/instances/{ended}").status_code == 404)
    backend = RecordingBackend()
    with make_server(state_dir=state, backend=backend) as s, client(s) as c:
        wait_until(lambda: c.get(f"/instances/{kept}").json()["data"]["status"] == "active")
        assert [k["name"] for k in c.get("/ssh-keys").json()["data"]] == ["k"]
        assert backend.started == [(kept, PUBKEY)]  # its machine came back (a reboot: no processes survive)
        assert {b["instance_id"] for b in s.billing()} == {kept, ended}
        assert c.get(f"/instances/{ended}").status_code == 404


def test_stop_is_idempotent_and_safe_before_start() -> None:
    backend = RecordingBackend()
    never_started = make_server(backend=backend)
    never_started.stop()
    never_started.stop()
    assert backend.closed
    with make_server() as s:
        s.stop()  # the context manager's stop afterwards is a no-op
