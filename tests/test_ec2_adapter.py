"""The EC2 adapter against moto in-process: offers, launches, fallback, error taxonomy, preemption, idempotency.

Faults EC2 would produce but moto cannot (no capacity, quotas, throttling, timeouts after the launch took
effect) are injected with botocore's own event hooks on the adapter's real client, so the request still
travels through botocore's serializer, our mapping and `providers.base.call()`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError
from botocore.parsers import ResponseParserError
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from moto import mock_aws
from moto.core import DEFAULT_ACCOUNT_ID
from moto.ec2.models import ec2_backends
from moto.ec2.models.instances import StateReason

from orchestrator.config import Ec2Provider
from providers.base import (
    AuthFailed,
    InstanceState,
    InvalidRequest,
    LaunchRequest,
    Market,
    NoCapacity,
    OwnerTags,
    ProviderError,
    QuotaExceeded,
    RetryPolicy,
    Throttled,
    Transient,
    key_name_variant,
    public_key_body,
)
from providers.ec2 import Ec2Adapter, client_token

REGION = "us-east-1"
ORCH = "orch-test"
PLANTED_SECRET = "PlantedSecret/DoNotLeak+0123456789abcdefXYZ"
PLANTED_KEY_ID = "AKIAPLANTEDKEYID0000"
FAST_RETRY = RetryPolicy(attempts=4, max_total_s=30.0, initial_s=0.001, max_wait_s=0.002)


# --- fixtures ---------------------------------------------------------------------------------------------
class Recorder:
    """An event sink that keeps every event, as the daemon's EventLog would receive them."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, type_: str, **data: Any) -> None:
        self.events.append((type_, data))

    def of(self, type_: str) -> list[dict[str, Any]]:
        return [d for t, d in self.events if t == type_]


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Credentials only from the environment (with a planted secret), no profile, no IMDS, no endpoint override."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", PLANTED_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", PLANTED_SECRET)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_EC2"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))


@pytest.fixture
def mocked(aws_env: None) -> Iterator[None]:
    # mock_credentials False: keep our planted credentials instead of moto's own fake ones.
    with mock_aws(config={"core": {"mock_credentials": False}}):
        yield


@pytest.fixture(scope="module")
def ssh_public_key() -> str:
    key = Ed25519PrivateKey.generate().public_key()
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def make_adapter(retry: RetryPolicy = FAST_RETRY, **config: Any) -> tuple[Ec2Adapter, Recorder, list[float]]:
    config.setdefault("instance_types", ["g5.xlarge", "g6e.xlarge"])
    config.setdefault("on_demand_usd_h", {"g5.xlarge": 1.006, "g6e.xlarge": 1.861})
    config.setdefault("zones", ["us-east-1a", "us-east-1b"])
    sink, waits = Recorder(), []
    adapter = Ec2Adapter(Ec2Provider(enabled=True, region=REGION, **config), orchestrator_id=ORCH, sink=sink,
                         retry=retry, sleep=waits.append)
    return adapter, sink, waits


def request_for(attempt: str, public_key: str, *, market: Market = Market.SPOT, instance_type: str = "g5.xlarge",
                region: str | None = None) -> LaunchRequest:
    return LaunchRequest(instance_type=instance_type, market=market, tags=OwnerTags(ORCH, "job-1", attempt),
                         idempotency_key=f"{attempt}-launch", ssh_public_key=public_key, region=region)


def client_error(operation: str, code: str, message: str = "", status: int = 400) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       operation)


def on_run_instances(adapter: Ec2Adapter, handler: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """Call `handler(params)` before every RunInstances request is built; returns the list of params seen."""
    seen: list[dict[str, Any]] = []

    def hook(params: dict[str, Any], **_: Any) -> None:
        seen.append(dict(params))
        handler(params)

    adapter.client.meta.events.register("before-parameter-build.ec2.RunInstances", hook)
    return seen


def instances_of_attempt(adapter: Ec2Adapter, attempt: str) -> list[dict[str, Any]]:
    response = adapter.client.describe_instances(Filters=[{"Name": "tag:burstctl:attempt", "Values": [attempt]}])
    return [i for r in response["Reservations"] for i in r["Instances"]]


def moto_instance(instance_id: str) -> Any:
    return ec2_backends[DEFAULT_ACCOUNT_ID][REGION].get_instance(instance_id)


def interrupt_spot(instance_id: str, *, finished: bool = True) -> None:
    """What EC2 does on a spot interruption: shut down with StateReason Server.SpotInstanceTermination."""
    instance = moto_instance(instance_id)
    if finished:
        instance.terminate()
    else:
        instance._state.name, instance._state.code = "shutting-down", 32
    instance.state_reason = StateReason("Server.SpotInstanceTermination: Spot instance termination",
                                        "Server.SpotInstanceTermination")


# --- offers -----------------------------------------------------------------------------------------------
def test_offers_combine_api_gpu_info_table_fallback_config_prices_and_latest_spot_per_zone(mocked: None) -> None:
    adapter, sink, _ = make_adapter(
        instance_types=["p3.2xlarge", "g5.xlarge", "p5.48xlarge", "m5.large", "g6e.xlarge"],
        on_demand_usd_h={"p3.2xlarge": 3.06, "g5.xlarge": 1.006, "p5.48xlarge": 98.32, "m5.large": 0.096},
        zones=["us-east-1b", "us-east-1a"],
    )

    def plant_history(parsed: dict[str, Any], **_: Any) -> None:
        # moto's spot history is one static price; plant a history with an older and a newer price per zone.
        from datetime import UTC, datetime
        old, new = datetime(2025, 1, 1, tzinfo=UTC), datetime(2025, 1, 2, tzinfo=UTC)
        parsed["SpotPriceHistory"] = [
            {"InstanceType": "g5.xlarge", "AvailabilityZone": "us-east-1a", "SpotPrice": "0.520", "Timestamp": old},
            {"InstanceType": "g5.xlarge", "AvailabilityZone": "us-east-1a", "SpotPrice": "0.410", "Timestamp": new},
            {"InstanceType": "g5.xlarge", "AvailabilityZone": "us-east-1b", "SpotPrice": "0.450", "Timestamp": old},
            {"InstanceType": "g5.xlarge", "AvailabilityZone": "us-east-1c", "SpotPrice": "0.900", "Timestamp": new},
            {"InstanceType": "p5.48xlarge", "AvailabilityZone": "us-east-1a", "SpotPrice": "31.5", "Timestamp": new},
        ]

    adapter.client.meta.events.register("after-call.ec2.DescribeSpotPriceHistory", plant_history)
    offers = {o.instance_type: o for o in adapter.offers()}

    # m5.large has no GPU; g6e.xlarge has no on-demand price in config: both skipped, with a reason.
    assert list(offers) == ["p3.2xlarge", "g5.xlarge", "p5.48xlarge"]
    assert {e["instance_type"]: e["reason"] for e in sink.of("provider.offer_skipped")} == {
        "m5.large": "no GPU info", "g6e.xlarge": "no on_demand_usd_h in config"}

    p3 = offers["p3.2xlarge"]  # retired: moto's DescribeInstanceTypes does not know it, the table does
    assert (p3.gpu_model, p3.gpu_count, p3.vram_gib, p3.vcpus) == ("V100", 1, 16, 8)
    assert p3.on_demand_usd_h == 3.06 and p3.spot_usd_h is None

    g5 = offers["g5.xlarge"]  # GpuInfo from the API wins over the table's nominal 24 GB: 22888 MiB
    assert (g5.gpu_model, g5.gpu_count, g5.vram_gib, g5.vcpus) == ("A10", 1, round(22888 / 1024, 2), 4)
    # latest per zone among the configured zones: 1a → 0.41 (not the older 0.52), 1b → 0.45; 1c is not ours
    assert g5.spot_usd_h == 0.45
    assert g5.regions == ("us-east-1b", "us-east-1a")

    p5 = offers["p5.48xlarge"]
    assert (p5.gpu_model, p5.gpu_count, p5.vram_gib, p5.vcpus, p5.spot_usd_h) == ("H100", 8, 80.0, 192, 31.5)
    assert p5.price(Market.ON_DEMAND) == 98.32


def test_offers_with_no_configured_zones_use_every_available_zone(mocked: None) -> None:
    adapter, _, _ = make_adapter(zones=[])
    zones = adapter.client.describe_availability_zones()["AvailabilityZones"]
    assert adapter.offers()[0].regions == tuple(sorted(z["ZoneName"] for z in zones))


def test_settings_that_name_nothing_usable_are_said_by_the_setting(mocked: None) -> None:
    # A type EC2 does not describe, one without a price, a zone not in the region: each left out of the offers,
    # and said for `burstctl providers` to show, rather than a job waiting for ever on "no offer".
    adapter, _, _ = make_adapter(instance_types=["p9.xlarge", "g5.xlarge", "g6e.xlarge"],
                                 on_demand_usd_h={"g6e.xlarge": 1.861}, zones=["us-east-1a", "eu-west-1a"])
    assert [o.instance_type for o in adapter.offers()] == ["g6e.xlarge"]
    assert adapter.config_problems == [
        "providers.ec2.zones: eu-west-1a is not an available zone of us-east-1",
        "providers.ec2.instance_types: p9.xlarge is not a GPU type EC2 describes",
        "providers.ec2.on_demand_usd_h has no price for g5.xlarge"]


def test_a_region_that_does_not_exist_is_a_setting_to_fix_not_a_connection_to_retry(
        mocked: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # EC2's endpoint for "us-east-9" has no address: the connection error it gives is the region's, not the network's.
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)

    def unreachable() -> None:
        raise EndpointConnectionError(endpoint_url="https://ec2.us-east-9.amazonaws.com/")

    wrong, _, _ = make_adapter()
    wrong.config = wrong.config.model_copy(update={"region": "us-east-9"})
    with pytest.raises(InvalidRequest, match=r"providers\.ec2\.region: 'us-east-9' is not an AWS region"):
        wrong._mapped("DescribeInstanceTypes", unreachable)
    right, _, _ = make_adapter()
    with pytest.raises(Transient):  # a real region: the network's, retried
        right._mapped("DescribeInstanceTypes", unreachable)


# --- launch -----------------------------------------------------------------------------------------------
def test_spot_launch_tags_instance_and_volume_and_passes_config_and_client_token(
        mocked: None, ssh_public_key: str) -> None:
    setup = Ec2Adapter(Ec2Provider(region=REGION), orchestrator_id=ORCH).client
    subnet = next(s["SubnetId"] for s in setup.describe_subnets()["Subnets"] if s["AvailabilityZone"] == "us-east-1a")
    vpc = setup.describe_subnets(SubnetIds=[subnet])["Subnets"][0]["VpcId"]
    group = setup.create_security_group(GroupName="burst-ssh", Description="ssh", VpcId=vpc)["GroupId"]
    boto3.client("iam", region_name=REGION).create_instance_profile(InstanceProfileName="burst-ckpt")
    adapter, sink, _ = make_adapter(subnet_ids={"us-east-1a": subnet}, security_group_ids=[group],
                                    instance_profile="burst-ckpt", user_data="#cloud-config\n{}\n",
                                    ami="ami-12c6146b", key_name="burst-key")
    seen = on_run_instances(adapter, lambda params: None)

    info = adapter.launch(request_for("att-spot", ssh_public_key))

    assert len(seen) == 1
    params = seen[0]
    assert params["ClientToken"] == "att-spot-launch"
    assert params["InstanceMarketOptions"] == {
        "MarketType": "spot",
        "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
    assert (params["ImageId"], params["KeyName"], params["SubnetId"]) == ("ami-12c6146b", "burst-key", subnet)
    assert params["SecurityGroupIds"] == [group]
    assert params["IamInstanceProfile"] == {"Name": "burst-ckpt"}

    expected_tags = {"burstctl:orchestrator": ORCH, "burstctl:job": "job-1", "burstctl:attempt": "att-spot",
                     "Name": "burst-att-spot"}
    raw = instances_of_attempt(adapter, "att-spot")
    assert len(raw) == 1 and raw[0]["InstanceId"] == info.id
    assert raw[0]["InstanceLifecycle"] == "spot"
    assert raw[0]["KeyName"] == "burst-key" and raw[0]["SubnetId"] == subnet
    assert {t["Key"]: t["Value"] for t in raw[0]["Tags"]} == expected_tags
    volumes = adapter.client.describe_volumes(
        Filters=[{"Name": "attachment.instance-id", "Values": [info.id]}])["Volumes"]
    assert volumes and all({t["Key"]: t["Value"] for t in v["Tags"]} == expected_tags for v in volumes)
    user_data = adapter.client.describe_instance_attribute(InstanceId=info.id, Attribute="userData")["UserData"]
    assert base64.b64decode(user_data["Value"]).decode() == "#cloud-config\n{}\n"
    # The request's public key was imported under the configured key pair name; finding none there first is
    # expected on a first launch, so no call of the launch is in the trail as a failure.
    assert adapter.client.describe_key_pairs(KeyNames=["burst-key"])["KeyPairs"][0]["KeyType"] == "ed25519"
    assert {e["call"]: e["outcome"] for e in sink.of("provider.call")}.get("DescribeKeyPairs") == "ok"
    assert {e["outcome"] for e in sink.of("provider.call")} == {"ok"}

    assert info.market is Market.SPOT and info.instance_type == "g5.xlarge" and info.region == "us-east-1a"
    assert info.state in (InstanceState.PENDING, InstanceState.BOOTING, InstanceState.RUNNING)
    assert info.host and info.ssh_port == 22 and info.ssh_user == "ubuntu"
    assert info.tags == expected_tags and info.attempt_id == "att-spot"
    assert sink.of("provider.launched")[0]["instance"] == info.id


def test_on_demand_launch_has_no_market_options_and_places_by_zone(mocked: None, ssh_public_key: str) -> None:
    adapter, _, _ = make_adapter()
    seen = on_run_instances(adapter, lambda params: None)

    info = adapter.launch(request_for("att-od", ssh_public_key, market=Market.ON_DEMAND, region="us-east-1b"))

    assert "InstanceMarketOptions" not in seen[0]
    assert seen[0]["Placement"] == {"AvailabilityZone": "us-east-1b"}
    assert info.market is Market.ON_DEMAND and info.region == "us-east-1b"
    assert "InstanceLifecycle" not in instances_of_attempt(adapter, "att-od")[0]


def test_capacity_fallback_walks_the_zones_of_the_requested_type_only(mocked: None, ssh_public_key: str) -> None:
    # Another type is another offer (its GPU, memory and price): the daemon chooses it, not the adapter.
    adapter, sink, waits = make_adapter(instance_types=["g5.xlarge", "g6e.xlarge"], zones=["us-east-1a", "us-east-1b"])

    def no_capacity(params: dict[str, Any]) -> None:
        if params["Placement"]["AvailabilityZone"] == "us-east-1a":
            raise client_error("RunInstances", "InsufficientInstanceCapacity", "no capacity", 500)

    seen = on_run_instances(adapter, no_capacity)
    info = adapter.launch(request_for("att-fb", ssh_public_key))

    tried = [(p["InstanceType"], p["Placement"]["AvailabilityZone"]) for p in seen]
    assert tried == [("g5.xlarge", "us-east-1a"), ("g5.xlarge", "us-east-1b")]
    assert (info.instance_type, info.region) == ("g5.xlarge", "us-east-1b")
    # Each candidate has its own deterministic token; the first is the idempotency key itself.
    assert [p["ClientToken"] for p in seen] == [client_token("att-fb-launch", i) for i in range(2)]
    assert seen[0]["ClientToken"] == "att-fb-launch"
    assert [(e["instance_type"], e["zone"], e["code"]) for e in sink.of("provider.launch_fallback")] == [
        ("g5.xlarge", "us-east-1a", "InsufficientInstanceCapacity")]
    assert waits == []  # no capacity is not retried in place: the next zone is tried at once
    assert len(instances_of_attempt(adapter, "att-fb")) == 1
    assert adapter.candidates(request_for("a", ssh_public_key, instance_type="g6e.xlarge")) == [
        ("g6e.xlarge", "us-east-1a"), ("g6e.xlarge", "us-east-1b")]


def test_no_capacity_anywhere_raises_no_capacity_and_launches_nothing(mocked: None, ssh_public_key: str) -> None:
    adapter, _, _ = make_adapter()

    def never(params: dict[str, Any]) -> None:
        raise client_error("RunInstances", "InsufficientInstanceCapacity", "no capacity", 500)

    seen = on_run_instances(adapter, never)
    with pytest.raises(NoCapacity) as raised:
        adapter.launch(request_for("att-none", ssh_public_key))
    assert raised.value.code == "InsufficientInstanceCapacity"
    assert len(seen) == 2  # the requested type in each zone
    assert instances_of_attempt(adapter, "att-none") == []


@pytest.mark.parametrize(("code", "kind"), [
    ("InstanceLimitExceeded", QuotaExceeded),
    ("VcpuLimitExceeded", QuotaExceeded),
    ("MaxSpotInstanceCountExceeded", QuotaExceeded),
    ("AuthFailure", AuthFailed),
    ("UnauthorizedOperation", AuthFailed),
    ("InvalidParameterValue", InvalidRequest),
    ("InvalidAMIID.NotFound", InvalidRequest),
])
def test_quota_auth_and_invalid_requests_fail_at_once_without_retry_or_fallback(
        mocked: None, ssh_public_key: str, code: str, kind: type[ProviderError]) -> None:
    adapter, sink, waits = make_adapter()

    def refuse(params: dict[str, Any]) -> None:
        raise client_error("RunInstances", code, "refused")

    seen = on_run_instances(adapter, refuse)
    with pytest.raises(kind) as raised:
        adapter.launch(request_for("att-q", ssh_public_key))
    assert raised.value.code == code and raised.value.provider == "ec2"
    assert len(seen) == 1 and waits == []
    run_calls = [e for e in sink.of("provider.call") if e["call"] == "RunInstances"]
    assert run_calls == [{**run_calls[0], "outcome": kind.__name__, "tries": 1, "code": code}]


@pytest.mark.parametrize("code", ["RequestLimitExceeded", "Throttling"])
def test_throttling_is_retried_with_backoff_then_launches_once(
        mocked: None, ssh_public_key: str, code: str) -> None:
    adapter, sink, waits = make_adapter()

    def throttle_twice(params: dict[str, Any]) -> None:
        if len(seen) <= 2:
            raise client_error("RunInstances", code, "slow down", 503)

    seen = on_run_instances(adapter, throttle_twice)
    info = adapter.launch(request_for("att-thr", ssh_public_key))

    assert len(seen) == 3 and len(waits) == 2
    assert [e["code"] for e in sink.of("provider.retry") if e["call"] == "RunInstances"] == [code, code]
    assert [i["InstanceId"] for i in instances_of_attempt(adapter, "att-thr")] == [info.id]


@pytest.mark.parametrize(("make_error", "kind", "code"), [
    (lambda: client_error("DescribeInstances", "InternalError", "oops", 500),
     Transient, "InternalError"),
    (lambda: client_error("DescribeInstances", "ServiceUnavailable", "", 503),
     Transient, "ServiceUnavailable"),
    (lambda: client_error("DescribeInstances", "SomethingNew", "", 502),
     Transient, "SomethingNew"),
    (lambda: ReadTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com"),
     Transient, "ReadTimeoutError"),
    (lambda: EndpointConnectionError(endpoint_url="https://ec2.us-east-1.amazonaws.com"),
     Transient, "EndpointConnectionError"),
    (lambda: client_error("DescribeInstances", "Throttling", "", 400),
     Throttled, "Throttling"),
    # a proxy's HTML 500 page instead of EC2's XML (botocore raises this outside its BotoCoreError family)
    (lambda: ResponseParserError("Unable to parse response: b'<!doctype html>500 Internal Server Error'"),
     Transient, "ResponseParserError"),
])
def test_server_errors_and_timeouts_are_retried_up_to_the_policy_then_surface(
        mocked: None, make_error: Callable[[], Exception], kind: type[ProviderError], code: str) -> None:
    adapter, sink, waits = make_adapter()
    attempts: list[int] = []

    def fail(**_: Any) -> None:
        attempts.append(1)
        raise make_error()

    adapter.client.meta.events.register("before-call.ec2.DescribeInstances", fail)
    with pytest.raises(kind) as raised:
        adapter.describe(["i-0123456789abcdef0"])
    assert raised.value.code == code
    assert len(attempts) == FAST_RETRY.attempts and len(waits) == FAST_RETRY.attempts - 1
    assert sink.of("provider.call")[-1]["tries"] == FAST_RETRY.attempts


def test_a_real_invalid_parameter_from_ec2_maps_to_invalid_request(mocked: None, ssh_public_key: str) -> None:
    adapter, _, waits = make_adapter(subnet_ids={"us-east-1a": "subnet-0doesnotexist"}, zones=["us-east-1a"])
    with pytest.raises(InvalidRequest) as raised:
        adapter.launch(request_for("att-bad", ssh_public_key))
    assert raised.value.code == "InvalidSubnetID.NotFound"
    assert waits == []


def test_missing_credentials_fail_as_auth_without_retry(
        mocked: None, ssh_public_key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    adapter, sink, waits = make_adapter()
    seen = on_run_instances(adapter, lambda params: None)
    with pytest.raises(AuthFailed) as raised:
        adapter.launch(request_for("att-nocred", ssh_public_key))
    assert raised.value.code == "NoCredentials"
    assert seen == [] and waits == []
    assert sink.of("provider.call")[-1]["tries"] == 1


# --- no double launch ---------------------------------------------------------------------------------------
def timeout_after_first_run(adapter: Ec2Adapter) -> list[str]:
    """Make the first RunInstances take effect in EC2 and then time out on the way back to us."""
    launched: list[str] = []

    def lose_response(parsed: dict[str, Any], **_: Any) -> None:
        launched.extend(i["InstanceId"] for i in parsed.get("Instances", []))
        if len(launched) == 1:
            raise ReadTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com")

    adapter.client.meta.events.register("after-call.ec2.RunInstances", lose_response)
    return launched


def test_moto_does_not_dedupe_client_tokens_which_is_why_the_adapter_looks_up_by_tag(mocked: None) -> None:
    client = make_adapter()[0].client
    for _ in range(2):
        client.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="g5.xlarge",
                             ClientToken="same-token")
    tokens = [i["ClientToken"] for r in client.describe_instances()["Reservations"] for i in r["Instances"]]
    assert tokens == ["same-token", "same-token"]


def test_retry_after_a_lost_response_finds_the_launched_instance_instead_of_launching_again(
        mocked: None, ssh_public_key: str) -> None:
    adapter, sink, _ = make_adapter()
    launched = timeout_after_first_run(adapter)

    info = adapter.launch(request_for("att-lost", ssh_public_key))

    assert launched == [info.id]  # RunInstances took effect exactly once
    assert [i["InstanceId"] for i in instances_of_attempt(adapter, "att-lost")] == [info.id]
    assert sink.of("provider.launch_found_existing")[0]["instance"] == info.id
    assert [e["code"] for e in sink.of("provider.retry") if e["call"] == "RunInstances"] == ["ReadTimeoutError"]


def test_launching_again_after_a_failed_launch_returns_the_attempts_instance(
        mocked: None, ssh_public_key: str) -> None:
    adapter, _, _ = make_adapter(retry=RetryPolicy(attempts=1, initial_s=0.001, max_wait_s=0.002))
    launched = timeout_after_first_run(adapter)
    request = request_for("att-again", ssh_public_key)

    with pytest.raises(Transient):
        adapter.launch(request)  # the caller only knows the outcome is unknown
    found = adapter.find_attempt("att-again")
    again = adapter.launch(request)

    assert found is not None and again.id == found.id == launched[0]
    assert len(launched) == 1 and len(instances_of_attempt(adapter, "att-again")) == 1


def test_find_attempt_ignores_other_attempts_other_owners_and_dead_instances(
        mocked: None, ssh_public_key: str) -> None:
    adapter, _, _ = make_adapter()
    mine = adapter.launch(request_for("att-f", ssh_public_key))
    other_owner = Ec2Adapter(Ec2Provider(region=REGION, instance_types=["g5.xlarge"], zones=["us-east-1a"]),
                             orchestrator_id="someone-else", retry=FAST_RETRY, sleep=lambda s: None)
    other_owner.launch(LaunchRequest("g5.xlarge", Market.SPOT, OwnerTags("someone-else", "j", "att-f"), "k", ""))

    assert adapter.find_attempt("att-f") == adapter.describe([mine.id])[mine.id]
    assert adapter.find_attempt("att-unknown") is None
    adapter.terminate([mine.id])
    assert adapter.find_attempt("att-f") is None


# --- describe / preemption / terminate / list_owned -------------------------------------------------------------
def test_spot_interruption_is_reported_as_preempted_with_the_reason(mocked: None, ssh_public_key: str) -> None:
    adapter, _, _ = make_adapter()
    going = adapter.launch(request_for("att-p1", ssh_public_key))
    gone = adapter.launch(request_for("att-p2", ssh_public_key))
    interrupt_spot(going.id, finished=False)
    interrupt_spot(gone.id)

    states = adapter.describe([going.id, gone.id])

    for instance_id in (going.id, gone.id):
        assert states[instance_id].state is InstanceState.PREEMPTED
        assert states[instance_id].reason == "Server.SpotInstanceTermination"
        assert states[instance_id].state.gone


def test_describe_normalizes_running_stopped_terminated_and_unknown(mocked: None, ssh_public_key: str) -> None:
    adapter, _, _ = make_adapter()
    running, stopped, ended = (adapter.launch(request_for(f"att-d{n}", ssh_public_key, market=Market.ON_DEMAND))
                               for n in range(3))
    adapter.client.stop_instances(InstanceIds=[stopped.id])
    adapter.client.terminate_instances(InstanceIds=[ended.id])
    unknown = "i-0123456789abcdef0"

    states = adapter.describe([running.id, stopped.id, ended.id, unknown])

    assert list(states) == [running.id, stopped.id, ended.id, unknown]
    assert states[running.id].state is InstanceState.RUNNING
    assert states[running.id].host == instances_of_attempt(adapter, "att-d0")[0]["PublicIpAddress"]
    assert states[stopped.id].state is InstanceState.FAILED
    assert states[ended.id].state is InstanceState.TERMINATED
    assert states[ended.id].reason == "Client.UserInitiatedShutdown"
    assert states[unknown].state is InstanceState.TERMINATED
    assert states[unknown].reason == "InvalidInstanceID.NotFound"


def test_terminate_is_idempotent_including_unknown_ids(mocked: None, ssh_public_key: str) -> None:
    adapter, sink, _ = make_adapter()
    info = adapter.launch(request_for("att-t", ssh_public_key))
    preempted = adapter.launch(request_for("att-t2", ssh_public_key))
    interrupt_spot(preempted.id)

    adapter.terminate([info.id])
    adapter.terminate([info.id, preempted.id, "i-0123456789abcdef0"])
    adapter.terminate([])

    states = adapter.describe([info.id, preempted.id])
    assert states[info.id].state is InstanceState.TERMINATED
    assert states[preempted.id].state is InstanceState.PREEMPTED  # terminating again must not rewrite history
    # Only the first call had anything left to terminate.
    assert [e["outcome"] for e in sink.of("provider.call") if e["call"] == "TerminateInstances"] == ["ok"]


def test_terminate_copes_with_an_instance_vanishing_between_look_up_and_terminate(
        mocked: None, ssh_public_key: str) -> None:
    adapter, _, _ = make_adapter()
    keep, vanish = (adapter.launch(request_for(f"att-v{n}", ssh_public_key)) for n in range(2))
    calls: list[list[str]] = []

    def vanish_first_time(params: dict[str, Any], **_: Any) -> None:
        calls.append(list(params["InstanceIds"]))
        if len(calls) == 1:
            raise client_error("TerminateInstances", "InvalidInstanceID.NotFound", f"'{vanish.id}' does not exist")

    adapter.client.meta.events.register("before-parameter-build.ec2.TerminateInstances", vanish_first_time)
    adapter.terminate([keep.id, vanish.id])

    assert calls == [[keep.id, vanish.id], [keep.id], [vanish.id]]
    assert adapter.describe([keep.id])[keep.id].state is InstanceState.TERMINATED


def test_list_owned_returns_every_instance_of_this_orchestrator_in_any_visible_state(
        mocked: None, ssh_public_key: str) -> None:
    adapter, _, _ = make_adapter()
    live = adapter.launch(request_for("att-l1", ssh_public_key))
    ended = adapter.launch(request_for("att-l2", ssh_public_key))
    adapter.terminate([ended.id])
    adapter.client.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="g5.xlarge")
    adapter.client.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="g5.xlarge",
                                 TagSpecifications=[{"ResourceType": "instance", "Tags": [
                                     {"Key": "burstctl:orchestrator", "Value": "someone-else"}]}])

    owned = {i.id: i for i in adapter.list_owned()}

    assert set(owned) == {live.id, ended.id}
    assert owned[ended.id].state is InstanceState.TERMINATED
    assert {i.attempt_id for i in owned.values()} == {"att-l1", "att-l2"}


# --- secrets ------------------------------------------------------------------------------------------------
def test_credentials_never_reach_events_or_errors(mocked: None, ssh_public_key: str) -> None:
    adapter, sink, _ = make_adapter()
    errors: list[ProviderError] = []
    # Pretend EC2 echoed the secret in its messages (it does not, but nothing we emit may depend on that).
    echoes = iter([
        client_error("RunInstances", "AuthFailure", f"bad signature for {PLANTED_KEY_ID}/{PLANTED_SECRET}", 401),
        client_error("RunInstances", "InvalidParameterValue", f"value {PLANTED_SECRET} is not valid"),
        client_error("RunInstances", "InsufficientInstanceCapacity", f"none for {PLANTED_SECRET}", 500),
    ])

    def echo(params: dict[str, Any]) -> None:
        error = next(echoes, None)
        if error is not None:
            raise error

    on_run_instances(adapter, echo)
    for attempt in ("att-s1", "att-s2"):
        with pytest.raises(ProviderError) as raised:
            adapter.launch(request_for(attempt, ssh_public_key, region="us-east-1a"))
        errors.append(raised.value)
    info = adapter.launch(request_for("att-s3", ssh_public_key))  # no capacity in 1a, launched in 1b
    adapter.describe([info.id])
    adapter.terminate([info.id])

    assert [type(e) for e in errors] == [AuthFailed, InvalidRequest]
    assert sink.events, "the adapter emitted events"
    texts = [json.dumps(sink.events, default=str), *(str(e) for e in errors), *(repr(e) for e in errors),
             json.dumps(asdict(info), default=str), repr(adapter.describe([info.id]))]
    for text in texts:
        assert PLANTED_SECRET not in text
    assert PLANTED_KEY_ID not in str(errors[0])


# --- credentials chain and key pairs ------------------------------------------------------------------------------
def test_a_missing_aws_profile_is_an_auth_failure(aws_env: None) -> None:
    with pytest.raises(AuthFailed) as raised:
        Ec2Adapter(Ec2Provider(profile="no-such-profile"), orchestrator_id=ORCH)
    assert raised.value.code == "ProfileNotFound"


@pytest.mark.parametrize("where", ["config", "environment"])
def test_a_missing_aws_profile_is_named_in_the_providers_problem_not_reported_as_missing_keys(
        aws_env: None, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    from orchestrator.config import Config, Providers
    from providers import registry

    if where == "environment":
        monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    ec2 = Ec2Provider(enabled=True, profile="no-such-profile" if where == "config" else None)
    slot = registry.build(Config(providers=Providers(ec2=ec2)))["ec2"]
    named = "[providers.ec2] profile" if where == "config" else "AWS_PROFILE"
    assert (slot.provider, slot.credential_present) == (None, False)
    assert slot.problem == f"{named} 'no-such-profile' is not a profile in ~/.aws/config or ~/.aws/credentials"


def test_a_key_pair_already_holding_our_key_is_used_and_looked_up_once(mocked: None, ssh_public_key: str) -> None:
    adapter, sink, _ = make_adapter()
    adapter.client.import_key_pair(KeyName="burstctl", PublicKeyMaterial=f"{ssh_public_key} another-comment".encode())

    first = adapter.launch(request_for("att-k1", ssh_public_key))
    second = adapter.launch(request_for("att-k2", ssh_public_key))

    assert instances_of_attempt(adapter, "att-k1")[0]["KeyName"] == "burstctl"
    assert first.id != second.id
    key_calls = [e["call"] for e in sink.of("provider.call") if "KeyPair" in e["call"]]
    assert key_calls == ["DescribeKeyPairs"]


def test_a_key_pair_of_our_name_holding_another_key_is_left_alone_and_ours_goes_beside_it(
        mocked: None, ssh_public_key: str) -> None:
    """Launching with someone else's key would give an instance nobody here can log into."""
    adapter, _, _ = make_adapter()
    fingerprint = adapter.client.create_key_pair(KeyName="burstctl")["KeyFingerprint"]

    adapter.launch(request_for("att-k3", ssh_public_key))

    used = instances_of_attempt(adapter, "att-k3")[0]["KeyName"]
    assert used.startswith("burstctl-") and used == key_name_variant("burstctl", ssh_public_key)
    held = adapter.client.describe_key_pairs(KeyNames=[used], IncludePublicKey=True)["KeyPairs"][0]["PublicKey"]
    assert public_key_body(held) == public_key_body(ssh_public_key)
    assert adapter.client.describe_key_pairs(KeyNames=["burstctl"])["KeyPairs"][0]["KeyFingerprint"] == fingerprint
