"""The Lambda adapter, spoken to over real HTTP by simcloud with the Lambda OpenAPI contract enforced.

Every test's server checks every request against the contract; the fixture fails the test if the adapter
ever sent one the contract does not allow.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.config import KEY_FILE_EXPECTED, LAMBDA_REGIONS, LambdaProvider, SimProvider, load_config
from orchestrator.errors import BadInput
from providers.base import (
    AuthFailed,
    InstanceState,
    InvalidRequest,
    LaunchRequest,
    Market,
    NoCapacity,
    OwnerTags,
    QuotaExceeded,
    RetryPolicy,
    Throttled,
    Transient,
    category,
)
from providers.lambda_cloud import (
    MAX_RETRY_AFTER_S,
    InstanceGone,
    LambdaCloud,
    Pacer,
    from_config,
    parse_gpu_description,
    read_api_key,
    retry_after_s,
)
from providers.simcloud.api import FaultKind, SimCloudServer

CONTRACT = Path(__file__).resolve().parents[2] / "shared" / "contracts" / "lambda-cloud" / "openapi-1.8.3.json"
pytestmark = pytest.mark.skipif(not CONTRACT.exists(), reason="shared Lambda contract not present")

API_KEY = "sk-sim-PLANTED-7f3a9c2e41d8b6"
PUBKEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBurstctlTestKeyForSimcloudOnly000000000000 test@burstctl"
FAST_RETRY = RetryPolicy(attempts=4, max_total_s=20.0, initial_s=0.01, max_wait_s=1.0)  # waits out a Retry-After: 1


class Events:
    """A provider event sink that keeps everything it is given."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, type_: str, **data: Any) -> None:
        self.items.append((type_, data))

    def calls(self, verb: str) -> list[dict[str, Any]]:
        return [d for t, d in self.items if t == "provider.call" and d["call"] == verb]


@pytest.fixture
def sim() -> Iterator[SimCloudServer]:
    with SimCloudServer(api_key=API_KEY, contract_path=CONTRACT) as server:
        yield server
        assert server.violations == [], "the adapter sent a request the Lambda contract does not allow"


@pytest.fixture
def events() -> Events:
    return Events()


def make_adapter(sim: SimCloudServer, events: Events, *, api_key: str = API_KEY, **kw: Any) -> LambdaCloud:
    options: dict[str, Any] = {"retry": FAST_RETRY, "request_interval_s": 0.0, "launch_interval_s": 0.0,
                               "timeout_s": 2.0, "regions": ("us-east-1", "us-west-1")}
    options.update(kw)
    return LambdaCloud(name="sim", base_url=sim.api_url, api_key=api_key, sink=events, **options)


@pytest.fixture
def lam(sim: SimCloudServer, events: Events) -> Iterator[LambdaCloud]:
    adapter = make_adapter(sim, events)
    yield adapter
    adapter.close()


def request(attempt: str = "a1", instance_type: str = "gpu_1x_h100_sxm5", market: Market = Market.ON_DEMAND,
            region: str | None = None) -> LaunchRequest:
    return LaunchRequest(instance_type=instance_type, market=market,
                         tags=OwnerTags(orchestrator="burstctl", job_id="j1", attempt_id=attempt),
                         idempotency_key=attempt, ssh_public_key=PUBKEY, region=region)


def instances_of(sim: SimCloudServer, attempt: str) -> list[Any]:
    return [i for i in sim.instances() if {"key": "burstctl:attempt", "value": attempt} in i.tags]


def wait_until(predicate: Callable[[], bool], deadline_s: float = 15.0) -> None:
    """Poll until true; the deadline only bounds a hang, it is not what the test asserts."""
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition never became true")
        time.sleep(0.02)


# --- offers -------------------------------------------------------------------------------------------------
def test_offers_normalise_gpu_prices_and_spot_extension(lam: LambdaCloud) -> None:
    offers = {o.instance_type: o for o in lam.offers()}
    assert "gpu_1x_h100_sxm5_spot" not in offers  # spot types fold into their on-demand type's offer
    h100 = offers["gpu_1x_h100_sxm5"]
    assert (h100.gpu_model, h100.gpu_count, h100.vram_gib, h100.vcpus) == ("H100", 1, 80.0, 26)
    assert h100.on_demand_usd_h == pytest.approx(3.29)
    assert h100.spot_usd_h == pytest.approx(1.00)
    assert h100.regions == ("us-east-1", "us-west-1")
    assert offers["gpu_8x_h100_sxm5"].spot_usd_h is None
    assert offers["gpu_1x_a10"].gpu_model == "A10"


def test_an_adapters_own_error_is_recorded_as_the_kind_of_the_taxonomy_it_is() -> None:
    # The lifecycle records and reads back this name (a spot refusal's `launch_error`), never a class of one cloud.
    assert category(InstanceGone("gone", provider="lambda")) == "InvalidRequest"
    assert [category(e("x")) for e in (NoCapacity, QuotaExceeded, AuthFailed, Throttled)] == [
        "NoCapacity", "QuotaExceeded", "AuthFailed", "Throttled"]


def test_simcloud_says_where_an_instance_polls_for_its_spot_notice_and_lambda_has_none() -> None:
    sim = LambdaCloud(name="sim", base_url="http://127.0.0.1:9/api/v1/", api_key="k")
    lam = LambdaCloud(name="lambda", base_url="https://cloud.lambda.ai/api/v1", api_key="k")
    try:
        assert sim.spot_notice_url("i-1") == ("http://127.0.0.1:9/_sim/instances/i-1/latest/meta-data/spot/"
                                              "instance-action")
        assert lam.spot_notice_url("i-1") is None  # Lambda Cloud sells no spot
    finally:
        sim.close()
        lam.close()


def test_gpu_description_parsing() -> None:
    assert parse_gpu_description("A100 (40 GB SXM4)") == ("A100", 40.0)
    assert parse_gpu_description("Tesla V100 (16 GB)") == ("V100", 16.0)
    assert parse_gpu_description("GH200 (96 GB)") == ("GH200", 96.0)


def test_offers_regions_follow_configured_order_and_capacity(sim: SimCloudServer, events: Events) -> None:
    adapter = make_adapter(sim, events, regions=("us-west-1", "us-east-1"), instance_types=("gpu_1x_a10",))
    [a10] = adapter.offers()
    assert (a10.instance_type, a10.regions) == ("gpu_1x_a10", ("us-west-1", "us-east-1"))
    sim.set_capacity("gpu_1x_a10", "us-east-1", 0)
    [a10] = adapter.offers()
    assert a10.regions == ("us-west-1", "us-east-1")  # the spot market still has us-east-1...
    # ...which an on-demand launch cannot use: each market's capacity is listed apart as well.
    assert (a10.capacity_regions(Market.ON_DEMAND), a10.capacity_regions(Market.SPOT)) == (
        ("us-west-1",), ("us-west-1", "us-east-1"))
    sim.set_capacity("gpu_1x_a10_spot", "us-east-1", 0)
    assert adapter.offers()[0].regions == ("us-west-1",)
    adapter.close()


# --- launch / describe / terminate ----------------------------------------------------------------------------
def test_launch_describe_terminate_round_trip(sim: SimCloudServer, lam: LambdaCloud, events: Events) -> None:
    info = lam.launch(request("round"))
    assert info.instance_type == "gpu_1x_h100_sxm5"
    assert info.market is Market.ON_DEMAND
    assert info.region == "us-east-1"
    assert info.attempt_id == "round"
    assert info.tags["burstctl:job"] == "j1"
    wait_until(lambda: lam.describe([info.id])[info.id].state is InstanceState.RUNNING)
    running = lam.describe([info.id])[info.id]
    assert (running.host, running.ssh_port, running.ssh_user) == ("127.0.0.1", 22, "ubuntu")

    lam.terminate([info.id])
    wait_until(lambda: lam.describe([info.id])[info.id].state is InstanceState.TERMINATED)
    [bill] = sim.billing()
    assert bill["instance_id"] == info.id and bill["ended_at"] is not None
    assert [d["outcome"] for d in events.calls("launch")] == ["ok"]


def test_spot_launch_picks_the_spot_type_and_describe_reports_the_market(lam: LambdaCloud) -> None:
    info = lam.launch(request("spot1", market=Market.SPOT))
    assert info.instance_type == "gpu_1x_h100_sxm5_spot"
    assert info.market is Market.SPOT


def test_describe_many_maps_unknown_ids_to_terminated(lam: LambdaCloud) -> None:
    a = lam.launch(request("m1"))
    b = lam.launch(request("m2"))
    seen = lam.describe([a.id, b.id, "0" * 32])
    assert seen[a.id].attempt_id == "m1" and seen[b.id].attempt_id == "m2"
    assert seen["0" * 32].state is InstanceState.TERMINATED


def test_ssh_key_is_registered_once_and_reused(sim: SimCloudServer, lam: LambdaCloud) -> None:
    lam.launch(request("k1"))
    lam.launch(request("k2"))
    assert {i.ssh_key_name for i in sim.instances()} == {"burstctl"}
    assert {i.public_key for i in sim.instances()} == {PUBKEY}


def test_a_different_key_under_the_configured_name_is_left_alone(sim: SimCloudServer, lam: LambdaCloud) -> None:
    other = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAISomebodyElsesKey00000000000000000000000000 other"
    import httpx

    httpx.post(sim.api_url + "/ssh-keys", json={"name": "burstctl", "public_key": other},
               headers={"Authorization": f"Bearer {API_KEY}"}).raise_for_status()
    lam.launch(request("k3"))
    [inst] = sim.instances()
    assert inst.public_key == PUBKEY and inst.ssh_key_name.startswith("burstctl-")


# --- capacity ---------------------------------------------------------------------------------------------------
def test_a_spot_launch_tries_the_requested_region_order_first(lam: LambdaCloud, events: Events) -> None:
    # Config order is us-east-1, us-west-1; the daemon asks for us-west-1 first (its spot listed longest).
    info = lam.launch(dataclasses.replace(request("order", market=Market.SPOT), region_order=("us-west-1",)))
    assert (info.instance_type, info.region) == ("gpu_1x_h100_sxm5_spot", "us-west-1")
    assert [d["outcome"] for d in events.calls("launch")] == ["ok"]


def test_region_fallback_on_insufficient_capacity(sim: SimCloudServer, lam: LambdaCloud, events: Events) -> None:
    sim.inject(FaultKind.INSUFFICIENT_CAPACITY, regions=["us-east-1"])
    info = lam.launch(request("reg"))
    assert (info.instance_type, info.region) == ("gpu_1x_h100_sxm5", "us-west-1")
    assert [d["outcome"] for d in events.calls("launch")] == ["NoCapacity", "ok"]
    assert len(instances_of(sim, "reg")) == 1


def test_a_configured_type_the_provider_does_not_list_is_said_by_its_setting(sim: SimCloudServer,
                                                                             events: Events) -> None:
    adapter = make_adapter(sim, events, instance_types=("gpu_1x_h100", "gpu_1x_a100_sxm4"))
    assert [o.instance_type for o in adapter.offers()] == ["gpu_1x_a100_sxm4"]
    assert adapter.config_problems == ["providers.sim.instance_types: gpu_1x_h100 is not a type the provider lists"]
    adapter.close()


def test_a_launch_never_falls_back_to_another_type(sim: SimCloudServer, events: Events) -> None:
    # Another type is another offer (its GPU, memory and price): the daemon chooses it. Here the A100 is configured
    # beside the H100, and the H100 is full everywhere, whether the listing says so or only the launch does.
    adapter = make_adapter(sim, events, instance_types=("gpu_1x_h100_sxm5", "gpu_1x_a100_sxm4"))
    sim.inject(FaultKind.INSUFFICIENT_CAPACITY, count=2)  # both regions of the H100, listed with capacity, refuse
    with pytest.raises(NoCapacity, match=r"gpu_1x_h100_sxm5 \(tried: us-east-1, us-west-1\)"):
        adapter.launch(request("typ"))
    for region in ("us-east-1", "us-west-1"):
        sim.set_capacity("gpu_1x_h100_sxm5", region, 0)
    with pytest.raises(NoCapacity, match="no region lists capacity"):
        adapter.launch(request("skip"))
    assert len(events.calls("launch")) == 2  # the two refused H100 launches; nothing of the A100
    assert instances_of(sim, "typ") == instances_of(sim, "skip") == []
    adapter.close()


def test_no_capacity_anywhere_raises_no_capacity(sim: SimCloudServer, lam: LambdaCloud) -> None:
    sim.set_capacity("gpu_1x_h100_sxm5", "us-east-1", 1)
    sim.set_capacity("gpu_1x_h100_sxm5", "us-west-1", 1)
    lam.launch(request("fill1"))
    lam.launch(request("fill2"))
    with pytest.raises(NoCapacity) as caught:
        lam.launch(request("none"))
    assert caught.value.code == "instance-operations/launch/insufficient-capacity"
    assert instances_of(sim, "none") == []


def test_quota_exceeded_is_not_retried(sim: SimCloudServer, lam: LambdaCloud, events: Events) -> None:
    sim.set_quota(1)
    lam.launch(request("q1"))
    with pytest.raises(QuotaExceeded) as caught:
        lam.launch(request("q2"))
    assert caught.value.code == "global/quota-exceeded"
    [failed] = [d for d in events.calls("launch") if d["outcome"] != "ok"]
    assert failed == {**failed, "outcome": "QuotaExceeded", "tries": 1, "code": "global/quota-exceeded"}


# --- auth --------------------------------------------------------------------------------------------------------
def test_bad_key_is_auth_failed_and_not_retried(sim: SimCloudServer, events: Events) -> None:
    adapter = make_adapter(sim, events, api_key="sk-wrong-key-123456")
    with pytest.raises(AuthFailed) as caught:
        adapter.offers()
    assert caught.value.code == "global/invalid-api-key"
    assert events.calls("offers")[0]["tries"] == 1
    adapter.close()


def test_revoked_key_mid_session_is_auth_failed(sim: SimCloudServer, lam: LambdaCloud) -> None:
    sim.inject(FaultKind.INVALID_KEY)
    with pytest.raises(AuthFailed):
        lam.list_owned()


def test_missing_env_var_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAMBDA_API_KEY", raising=False)
    with pytest.raises(AuthFailed, match="LAMBDA_API_KEY"):
        read_api_key(LambdaProvider())
    with pytest.raises(AuthFailed, match="BURSTCTL_SIM_API_KEY"):
        from_config(SimProvider(), None)


def test_a_key_in_the_environment_is_used_trimmed_and_scrubbed_trimmed_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pasted with a newline or a space, it made every request fail as a connection error (an illegal header), and a
    # provider echoing the key it was sent would have echoed what the redactor did not know.
    monkeypatch.setenv("LAMBDA_API_KEY", "  pasted-key-4d5e6f\n")
    assert read_api_key(LambdaProvider()) == "pasted-key-4d5e6f"
    from orchestrator.events import Redactor

    assert Redactor(["LAMBDA_API_KEY"])("401: key pasted-key-4d5e6f refused") == "401: key *** refused"
    monkeypatch.setenv("LAMBDA_API_KEY", " \n")
    with pytest.raises(AuthFailed, match="no API key: set the environment variable LAMBDA_API_KEY"):
        read_api_key(LambdaProvider())


@pytest.mark.parametrize("pasted,what", [("\u201csk-key-4d5e\u201d", "1 is U+201C LEFT DOUBLE QUOTATION MARK"),
                                         ("sk-key\u200b4d5e", "7 is U+200B ZERO WIDTH SPACE"),
                                         ("sk-key\x004d5e", "7 is a control character")])
def test_a_key_no_http_header_can_carry_is_refused_as_the_credentials_problem_naming_the_character_not_the_key(
        tmp_path: Path, pasted: str, what: str) -> None:
    with pytest.raises(AuthFailed) as refused:
        read_api_key(LambdaProvider(), {"LAMBDA_API_KEY": pasted})
    assert str(refused.value) == (f"the API key in the environment variable LAMBDA_API_KEY cannot be sent in an HTTP "
                                  f"header: its character {what} (pasted with quotes?)")
    assert "4d5e" not in str(refused.value)
    key = tmp_path / "lambda_api_key"
    key.write_text(pasted + "\n")
    key.chmod(0o600)
    with pytest.raises(AuthFailed, match=f"the API key in the API key file {key} cannot be sent"):
        read_api_key(LambdaProvider(api_key_file=str(key)), {})


def test_a_key_file_is_read_instead_of_the_variable_and_its_problems_never_quote_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAMBDA_API_KEY", "from-the-environment")
    key = tmp_path / "creds" / "lambda_api_key"
    section = LambdaProvider(api_key_file="$CREDS_DIR/lambda_api_key")
    environ = {"CREDS_DIR": str(tmp_path / "creds")}
    with pytest.raises(AuthFailed, match=f"cannot read the API key file {key}: No such file"):
        read_api_key(section, environ)
    key.parent.mkdir()
    key.write_text("secret-from-the-file\n# a comment line is not part of it\n")
    key.chmod(0o644)
    with pytest.raises(AuthFailed, match=r"can be read by other users \(mode 0644\): chmod 600 it") as refused:
        read_api_key(section, environ)
    assert "secret-from-the-file" not in str(refused.value)
    key.chmod(0o600)
    assert read_api_key(section, environ) == "secret-from-the-file"
    key.write_text("\n")
    with pytest.raises(AuthFailed, match="is empty"):
        read_api_key(section, environ)
    # ~ is the user's home.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "k").write_text("from-home")
    (tmp_path / "k").chmod(0o600)
    assert read_api_key(LambdaProvider(api_key_file="~/k"), {}) == "from-home"


def test_a_key_pasted_as_the_key_file_is_bad_input_and_never_echoed(tmp_path: Path) -> None:
    config = tmp_path / "burstctl.toml"
    config.write_text('[providers.lambda]\napi_key_file = "secret_live_4f9a8b7c6d5e"\n')
    with pytest.raises(BadInput) as refused:
        load_config(str(config))
    assert str(refused.value) == (f"{config}: field 'providers.lambda.api_key_file': {KEY_FILE_EXPECTED}")
    assert "secret_live_4f9a8b7c6d5e" not in str(refused.value)


def test_a_region_lambda_cloud_does_not_have_is_refused_naming_the_field_and_the_regions_it_has(
        tmp_path: Path) -> None:
    # A misspelt region never lists capacity: a job would wait for ever on "no offer with capacity".
    config = tmp_path / "burstctl.toml"
    config.write_text('[providers.lambda]\nregions = ["us-east-1", "us-west2"]\n')
    with pytest.raises(BadInput) as refused:
        load_config(str(config))
    said = str(refused.value)
    assert said.startswith(f"{config}: field 'providers.lambda.regions': 'us-west2': not a region Lambda Cloud has")
    assert "us-west-2" in said and "'us-east-1'" not in said
    # The regions are the contract's, every one of them.
    assert set(LAMBDA_REGIONS) == set(json.loads(CONTRACT.read_text())["components"]["schemas"]["PublicRegionCode"]
                                      ["enum"])
    assert LambdaProvider(regions=["us-west-2", "europe-central-1"]).regions == ["us-west-2", "europe-central-1"]


def test_factory_builds_a_working_sim_adapter(sim: SimCloudServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURSTCTL_SIM_API_KEY", API_KEY)
    section = SimProvider(base_url=sim.api_url)
    adapter = from_config(section, read_api_key(section), request_interval_s=0.0, launch_interval_s=0.0)
    assert adapter.name == "sim"
    assert adapter.offers()
    adapter.close()
    # A refused key is said with where it came from (the variable, and the setting that names it), never itself.
    refused = from_config(section, "sk-sim-WRONG-0000", request_interval_s=0.0, launch_interval_s=0.0,
                          retry=FAST_RETRY)
    with pytest.raises(AuthFailed) as caught:
        refused.offers()
    assert str(caught.value).endswith(
        "(the key from $BURSTCTL_SIM_API_KEY (providers.sim.api_key_env) was refused)")
    assert "WRONG" not in str(caught.value)
    refused.close()


# --- throttling and transient failures ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", [FaultKind.THROTTLE, FaultKind.THROTTLE_HTML])
def test_throttling_is_retried_then_succeeds(sim: SimCloudServer, lam: LambdaCloud, events: Events,
                                             kind: FaultKind) -> None:
    sim.inject(kind, count=2, route="instance-types")
    assert lam.offers()
    [offers_call] = events.calls("offers")
    assert (offers_call["outcome"], offers_call["tries"]) == ("ok", 3)
    retries = [d for t, d in events.items if t == "provider.retry"]
    assert [r["error"] for r in retries] == ["Throttled", "Throttled"]


def test_a_throttled_call_is_tried_again_no_sooner_than_the_retry_after_the_api_asked_for(
        sim: SimCloudServer, events: Events) -> None:
    adapter = make_adapter(sim, events, retry=RetryPolicy(attempts=4, max_total_s=20.0, initial_s=0.01, max_wait_s=5))
    sim.inject(FaultKind.THROTTLE, route="instance-types", retry_after_s=2)
    assert adapter.offers()
    [offers_call] = events.calls("offers")
    assert offers_call["tries"] == 2
    assert offers_call["duration_s"] >= 1.9, "tried again before the Retry-After was up: refused again"
    adapter.close()


def test_a_retry_after_longer_than_a_call_may_wait_ends_the_call_and_no_request_is_sent_until_it_is_up(
        sim: SimCloudServer, events: Events) -> None:
    clock = [1000.0]
    adapter = make_adapter(sim, events, clock=lambda: clock[0])
    sim.inject(FaultKind.THROTTLE, count=100, retry_after_s=30)
    started = time.monotonic()
    with pytest.raises(Throttled) as caught:
        adapter.offers()
    assert time.monotonic() - started < 5, "30 s is not slept through inside one call (the daemon's tick waits)"
    assert caught.value.retry_after_s == 30
    [fault] = sim.pending_faults()
    assert fault.remaining == 99, "one request, not one per retry: each early one is refused and counted again"
    clock[0] += 29  # the next tick, and the ones after: still asked to wait, so nothing is sent
    for ask in (adapter.list_owned, lambda: adapter.describe(["i-1"]), lambda: adapter.terminate(["i-1"])):
        with pytest.raises(Throttled, match="Retry-After"):
            ask()
    assert fault.remaining == 99
    clock[0] += 2  # past it: asked again (and refused again here, for another 30 s)
    with pytest.raises(Throttled):
        adapter.offers()
    assert fault.remaining == 98
    adapter.close()


def test_a_5xx_with_a_retry_after_holds_requests_back_as_that_outage_not_as_throttling(
        sim: SimCloudServer, events: Events) -> None:
    # A 503 that says when to ask again (maintenance): honoured as a 429's is, and each request held back meanwhile
    # fails as the 503 did (Transient), so that `status` says the provider is unavailable, not throttling the daemon.
    clock = [1000.0]
    adapter = make_adapter(sim, events, clock=lambda: clock[0])
    sim.inject(FaultKind.SERVER_ERROR, status=503, count=100, route="instance-types", retry_after_s=30)
    with pytest.raises(Transient) as caught:
        adapter.offers()
    assert caught.value.retry_after_s == 30
    [fault] = sim.pending_faults()
    assert fault.remaining == 99
    clock[0] += 29
    for ask in (adapter.offers, adapter.list_owned, lambda: adapter.terminate(["i-1"])):
        with pytest.raises(Transient, match=r"not sent: the API asked \(HTTP 503, Retry-After\)") as held:
            ask()
        assert not isinstance(held.value, Throttled) and held.value.retry_after_s == pytest.approx(1)
    assert fault.remaining == 99
    clock[0] += 2
    with pytest.raises(Transient):
        adapter.offers()
    assert fault.remaining == 98
    adapter.close()


def test_a_retry_after_is_read_in_seconds_or_as_an_http_date_and_bounded() -> None:
    assert retry_after_s("7") == 7.0
    assert retry_after_s("Thu, 01 Jan 2026 00:01:00 GMT", now=1767225600.0) == 60.0
    assert retry_after_s("86400") == MAX_RETRY_AFTER_S  # a terminate is never held back for a day
    assert [retry_after_s(v) for v in (None, "", "soon", "0", "-5", "nan")] == [None] * 6


@pytest.mark.parametrize("status", [500, 502, 503])
def test_server_errors_are_retried(sim: SimCloudServer, lam: LambdaCloud, events: Events, status: int) -> None:
    sim.inject(FaultKind.SERVER_ERROR, status=status, route="instances")
    assert lam.list_owned() == []
    [list_call] = events.calls("list")
    assert (list_call["outcome"], list_call["tries"]) == ("ok", 2)


def test_persistent_server_errors_surface_as_transient(sim: SimCloudServer, lam: LambdaCloud) -> None:
    sim.inject(FaultKind.SERVER_ERROR, count=10, status=503)
    with pytest.raises(Transient):
        lam.offers()


# --- unknown launch outcomes: never two instances per attempt -----------------------------------------------------
def test_launch_that_took_effect_but_timed_out_is_found_by_name(sim: SimCloudServer, events: Events) -> None:
    adapter = make_adapter(sim, events, timeout_s=0.3)
    sim.inject(FaultKind.DELAYED_RESPONSE, route="instance-operations/launch", delay_s=2.0)
    info = adapter.launch(request("slow"))
    assert [i.id for i in instances_of(sim, "slow")] == [info.id]
    [launch_call] = events.calls("launch")
    assert (launch_call["outcome"], launch_call["tries"]) == ("ok", 2)  # the 2nd try found it, did not launch
    adapter.close()


def test_launch_that_timed_out_without_effect_launches_once_on_retry(sim: SimCloudServer, events: Events) -> None:
    adapter = make_adapter(sim, events, timeout_s=0.3)
    sim.inject(FaultKind.TIMEOUT, route="instance-operations/launch", delay_s=2.0)
    info = adapter.launch(request("drop"))
    assert [i.id for i in instances_of(sim, "drop")] == [info.id]
    adapter.close()


@pytest.mark.parametrize("kind,extra", [
    (FaultKind.THROTTLE, {}), (FaultKind.THROTTLE_HTML, {}), (FaultKind.SERVER_ERROR, {"status": 500}),
    (FaultKind.SERVER_ERROR, {"status": 502}), (FaultKind.TIMEOUT, {"delay_s": 1.0}),
    (FaultKind.DELAYED_RESPONSE, {"delay_s": 1.0}),
])
def test_no_attempt_gets_two_instances_whatever_the_launch_fault(sim: SimCloudServer, events: Events,
                                                                 kind: FaultKind, extra: dict[str, Any]) -> None:
    adapter = make_adapter(sim, events, timeout_s=0.3)
    sim.inject(kind, count=2, route="instance-operations/launch", **extra)
    info = adapter.launch(request("once"))
    assert [i.id for i in instances_of(sim, "once")] == [info.id]
    assert adapter.find_attempt("once") is not None
    adapter.close()


# --- terminate, lost instances ----------------------------------------------------------------------------------
def test_terminate_twice_and_terminate_unknown_are_success(sim: SimCloudServer, lam: LambdaCloud) -> None:
    info = lam.launch(request("t2"))
    lam.terminate([info.id])
    wait_until(lambda: lam.describe([info.id])[info.id].state is InstanceState.TERMINATED)
    lam.terminate([info.id])
    lam.terminate(["f" * 32])


def test_a_wrong_base_url_is_never_taken_for_gone_instances(events: Events) -> None:
    # A base_url missing the API's path answers 404 to everything. Taken for "no such instance", terminate would
    # report success and describe a terminated instance while it runs and bills on.
    with SimCloudServer(api_key=API_KEY) as server:
        right = make_adapter(server, events)
        info = right.launch(request("wrong-url"))
        wrong = LambdaCloud(
            name="sim", base_url=server.api_url.removesuffix("/api/v1") + "/v1", api_key=API_KEY, sink=events,
            retry=FAST_RETRY, request_interval_s=0.0, launch_interval_s=0.0, timeout_s=2.0)
        for call in (lambda: wrong.terminate([info.id]), lambda: wrong.describe([info.id]), wrong.offers):
            with pytest.raises(InvalidRequest) as raised:
                call()
            assert not isinstance(raised.value, InstanceGone)
            assert str(raised.value).endswith(f"(is base_url '{wrong.base_url}' the API's root?)")
        assert right.describe([info.id])[info.id].state is not InstanceState.TERMINATED
        right.close()
        wrong.close()


def test_terminate_batch_with_a_gone_id_still_ends_the_live_one(sim: SimCloudServer, lam: LambdaCloud) -> None:
    info = lam.launch(request("tb"))
    lam.terminate(["f" * 32, info.id])
    wait_until(lambda: lam.describe([info.id])[info.id].state is InstanceState.TERMINATED)


def test_unhealthy_instance_maps_to_failed_with_reason(sim: SimCloudServer, lam: LambdaCloud) -> None:
    info = lam.launch(request("sick"))
    sim.set_status(info.id, "unhealthy", reason="gpu-xid-79")
    seen = lam.describe([info.id])[info.id]
    assert (seen.state, seen.reason) == (InstanceState.FAILED, "gpu-xid-79")


def test_preempted_spot_instance_maps_to_preempted(sim: SimCloudServer, lam: LambdaCloud) -> None:
    info = lam.launch(request("pre", market=Market.SPOT))
    sim.preempt(info.id)
    seen = lam.describe([info.id])[info.id]
    assert (seen.state, seen.reason) == (InstanceState.PREEMPTED, "spot-preempted")
    assert lam.find_attempt("pre") is None  # a preempted instance is no live instance of its attempt


def test_list_owned_and_find_attempt(sim: SimCloudServer, lam: LambdaCloud, events: Events) -> None:
    mine = lam.launch(request("own"))
    other = make_adapter(sim, events)
    other.orchestrator_id = "someone-else"
    assert [i.id for i in lam.list_owned()] == [mine.id]
    assert other.list_owned() == []
    found = lam.find_attempt("own")
    assert found is not None and found.id == mine.id
    assert lam.find_attempt("never") is None
    other.close()


def test_an_untagged_instance_is_ours_only_by_the_name_burstctl_gives(sim: SimCloudServer, lam: LambdaCloud) -> None:
    # A listing without tags (the API does not require them): a person's "burst-notebook-alice" is not swept;
    # "burst-<attempt id>" is burstctl's, and its attempt is read from the name so the sweep can find it.
    lam.launch(request("keyed"))
    with httpx.Client(base_url=sim.api_url, headers={"Authorization": f"Bearer {API_KEY}"}) as api:
        api.post("/ssh-keys", json={"name": "alice", "public_key": PUBKEY}).raise_for_status()
        for name in ("burst-notebook-alice", "burst-j0123abcd-a2"):
            api.post("/instance-operations/launch", json={
                "region_name": "us-east-1", "instance_type_name": "gpu_1x_h100_sxm5", "ssh_key_names": ["alice"],
                "name": name}).raise_for_status()
    owned = {i.attempt_id: i for i in lam.list_owned()}
    assert set(owned) == {"keyed", "j0123abcd-a2"}
    assert owned["j0123abcd-a2"].tags == {"burstctl:job": "j0123abcd", "burstctl:attempt": "j0123abcd-a2"}


# --- pacing ---------------------------------------------------------------------------------------------------------
def test_pacer_spaces_events_by_its_interval() -> None:
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    pacer = Pacer(12.0, clock=lambda: now[0], sleep=sleep)
    assert pacer.wait() == 0.0
    now[0] += 5.0
    assert pacer.wait() == pytest.approx(7.0)
    now[0] += 20.0
    assert pacer.wait() == 0.0
    assert slept == [pytest.approx(7.0)]


def test_default_limits_space_launches_12s_apart(events: Events) -> None:
    now = [1000.0]

    def sleep(s: float) -> None:
        now[0] += s

    def clock() -> float:
        return now[0]

    # The server stamps launches with the same fake clock, so its billing shows when each launch happened.
    with SimCloudServer(api_key=API_KEY, contract_path=CONTRACT, clock=clock) as server:
        adapter = LambdaCloud(name="sim", base_url=server.api_url, api_key=API_KEY, sink=events,
                              clock=clock, sleep=sleep, retry=FAST_RETRY)
        adapter.launch(request("p1"))
        adapter.launch(request("p2"))
        first, second = (b["launched_at"] for b in server.billing())
        assert second - first >= 12.0
        assert server.violations == []
        adapter.close()


# --- secrets -----------------------------------------------------------------------------------------------------
def test_planted_key_never_appears_in_events_errors_or_repr(sim: SimCloudServer, events: Events) -> None:
    wrong = "sk-sim-PLANTED-wrong-55e1"
    good = make_adapter(sim, events, timeout_s=0.3)
    bad = make_adapter(sim, events, api_key=wrong)
    captured: list[str] = [repr(good), repr(bad)]
    sim.inject(FaultKind.THROTTLE_HTML, route="instance-types")
    sim.inject(FaultKind.DELAYED_RESPONSE, route="instance-operations/launch", delay_s=1.0)
    info = good.launch(request("secret"))
    sim.set_quota(1)
    for action in (bad.offers, lambda: good.launch(request("secret2")), lambda: good.terminate([info.id])):
        try:
            action()
        except Exception as exc:  # every failure's text and repr are scanned below
            captured += [str(exc), repr(exc), repr(exc.__dict__)]
    captured.append(json.dumps(events.items, default=str))
    captured.append(json.dumps(sim.billing(), default=str))
    assert len(captured) > 6  # two failures were captured
    blob = "\n".join(captured)
    assert API_KEY not in blob and wrong not in blob
    good.close()
    bad.close()
