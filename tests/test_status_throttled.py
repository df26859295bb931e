"""`burstctl status` tells a provider that throttles the daemon (HTTP 429, Throttled) from one that is down: it is up,
asked to be left alone a while, and status says when the daemon asks it again. So too one that answered it is
unavailable (HTTP 5xx) and said when to ask again (Retry-After): not unreachable, nor throttling the daemon.

The provider is the Lambda adapter over real HTTP, spoken to by simcloud with the Lambda OpenAPI contract enforced
and a throttle injected; the daemon's side is its own reconciler in this process (the listing each tick, and what it
writes for `status`), on a clock the test moves."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.app import App
from orchestrator.daemon import DaemonLock
from orchestrator.lifecycle.reconcile import Reconciler
from providers.base import RetryPolicy, Transient
from providers.lambda_cloud import LambdaCloud
from providers.simcloud.api import FaultKind, SimCloudServer
from tests.e2e import free_port

CONTRACT = Path(__file__).resolve().parents[2] / "shared" / "contracts" / "lambda-cloud" / "openapi-1.8.3.json"
pytestmark = pytest.mark.skipif(not CONTRACT.exists(), reason="shared Lambda contract not present")

API_KEY = "sk-sim-status-throttle-3c5e"
RETRY = RetryPolicy(attempts=3, max_total_s=5.0, initial_s=0.01, max_wait_s=1.0)


@pytest.fixture
def burstctl(burstctl_here):  # the CLI in this process, beside the test's daemon lock
    return burstctl_here


@pytest.fixture
def sim() -> Iterator[SimCloudServer]:
    with SimCloudServer(api_key=API_KEY, contract_path=CONTRACT) as server:
        yield server
        assert server.violations == [], "the adapter sent a request the Lambda contract does not allow"


def _lambda_and_a_provider_down(sim: SimCloudServer, tmp_path: Path
                                ) -> tuple[Path, Path, App, list[float], LambdaCloud, LambdaCloud, Reconciler]:
    """A state, a config whose offers_ttl_s (5 s) is shorter than the Retry-Afters the tests give (they decide), the
    Lambda contract server's provider and one nobody listens for, on a clock the test moves (`now[0]`)."""
    state = tmp_path / "state"
    config = tmp_path / "burstctl.toml"
    config.write_text("[daemon]\noffers_ttl_s = 5\n")
    app = App(config_path=str(config), state_dir_override=str(state))
    now = [time.time()]
    clock = lambda: now[0]  # noqa: E731
    lam = LambdaCloud(name="lambda", base_url=sim.api_url, api_key=API_KEY, regions=("us-east-1",),
                      request_interval_s=0.0, retry=RETRY, clock=clock)
    down = LambdaCloud(name="down", base_url=f"http://127.0.0.1:{free_port()}", api_key=API_KEY,
                       regions=("us-east-1",), request_interval_s=0.0, retry=RETRY, clock=clock)
    return state, config, app, now, lam, down, Reconciler(app, {"lambda": lam, "down": down}, cloud=None, clock=clock)


def test_status_says_a_throttling_provider_is_throttled_and_when_it_is_asked_again_and_a_down_one_unreachable(
        sim: SimCloudServer, tmp_path: Path, burstctl) -> None:
    state, config, app, now, lam, down, rec = _lambda_and_a_provider_down(sim, tmp_path)
    sim.inject(FaultKind.THROTTLE, count=1000, route="instance-types", retry_after_s=42)
    lock = DaemonLock(state)  # what a running daemon holds: status then says what it will do next
    lock.acquire()
    try:
        rec.admission.schedule()  # the daemon's tick: each provider's listing asked for, what it said written down
        t0 = now[0]
        text = " ".join(burstctl("--config", str(config), "--state-dir", str(state), "status").stdout.split())
        assert re.search(r"\): lambda THROTTLED: asked again in (4[0-2]) s, down UNREACHABLE", text), text
        data = json.loads(burstctl("--config", str(config), "--state-dir", str(state), "status", "--json").stdout)
        assert data["cloud_health"] == {"lambda": False, "down": False}
        assert data["cloud_throttled"] == {"lambda": pytest.approx(t0 + 42, abs=1)}
        assert data["mode"] == "local-only (no cloud usable: see cloud)"  # one throttles, one is down

        # The next ticks within the Retry-After send nothing (it is honoured), and the time said stays the same.
        [fault] = sim.pending_faults()
        sent = fault.remaining
        now[0] = t0 + 30
        rec.admission.schedule()
        assert fault.remaining == sent
        assert app.store.get_setting("cloud_throttled") == {"lambda": pytest.approx(t0 + 42, abs=1)}

        # Once it is up, the provider is asked again; it answers, and nothing says throttled any more.
        sim.clear_faults()
        now[0] = t0 + 43
        rec.admission.schedule()
        data = json.loads(burstctl("--config", str(config), "--state-dir", str(state), "status", "--json").stdout)
        assert data["cloud_health"] == {"lambda": True, "down": False}
        assert data["cloud_throttled"] == {}
        assert data["mode"] == "burst-enabled"
        assert "lambda answers, down UNREACHABLE" in burstctl("--config", str(config), "--state-dir", str(state),
                                                              "status").stdout
    finally:
        lock.release()
        lam.close()
        down.close()
        app.store.close()


@pytest.mark.parametrize(("fault", "mode", "key", "said"), [
    (dict(kind=FaultKind.THROTTLE), "the cloud throttles the daemon's requests", "cloud_throttled", "THROTTLED"),
    (dict(kind=FaultKind.SERVER_ERROR, status=502), "the cloud says it is unavailable", "cloud_unavailable",
     "UNAVAILABLE"),
], ids=["429", "502"])
def test_status_says_every_provider_asked_throttling_or_unavailable_so_not_that_no_cloud_is_reachable(
        sim: SimCloudServer, tmp_path: Path, burstctl, fault: dict[str, Any], mode: str, key: str, said: str) -> None:
    state = tmp_path / "state"
    config = tmp_path / "burstctl.toml"
    config.write_text("[daemon]\noffers_ttl_s = 60\n")
    app = App(config_path=str(config), state_dir_override=str(state))
    lam = LambdaCloud(name="lambda", base_url=sim.api_url, api_key=API_KEY, regions=("us-east-1",),
                      request_interval_s=0.0, retry=RETRY)
    rec = Reconciler(app, {"lambda": lam}, cloud=None)
    sim.inject(count=1000, route="instance-types", retry_after_s=1, **fault)  # retried, and still refused so
    lock = DaemonLock(state)
    lock.acquire()
    try:
        rec.admission.schedule()
        asked = time.time()
        data = json.loads(burstctl("--config", str(config), "--state-dir", str(state), "status", "--json").stdout)
        assert data["mode"] == f"local-only ({mode}: see cloud)"
        # A Retry-After shorter than offers_ttl_s: asked again a ttl after it was asked.
        assert data[key]["lambda"] == pytest.approx(asked + 60, abs=5)
        text = " ".join(burstctl("--config", str(config), "--state-dir", str(state), "status").stdout.split())
        assert re.search(rf"lambda {said}: asked again in (5[5-9]|60) s", text), text
    finally:
        lock.release()
        lam.close()
        app.store.close()
    # A daemon that is not running asks nobody: as it was last, and no time is promised.
    text = " ".join(burstctl("--config", str(config), "--state-dir", str(state), "status").stdout.split())
    assert f"by the daemon, which is not running): lambda {said}" in text and "asked again in" not in text


def test_status_says_a_provider_that_answered_5xx_with_a_retry_after_is_unavailable_until_then_not_unreachable(
        sim: SimCloudServer, tmp_path: Path, burstctl) -> None:
    # A 503 with Retry-After (maintenance, an overloaded gateway): the API answered, and said when to ask again.
    # Neither UNREACHABLE (which sends one looking at the network) nor THROTTLED (the daemon's own request rate).
    state, config, app, now, lam, down, rec = _lambda_and_a_provider_down(sim, tmp_path)
    sim.inject(FaultKind.SERVER_ERROR, status=503, count=1000, route="instance-types", retry_after_s=42)

    def status() -> str:
        return " ".join(burstctl("--config", str(config), "--state-dir", str(state), "status").stdout.split())

    def status_json() -> dict[str, Any]:
        return dict(json.loads(burstctl("--config", str(config), "--state-dir", str(state), "status", "--json").stdout))

    lock = DaemonLock(state)
    lock.acquire()
    try:
        rec.admission.schedule()
        t0 = now[0]
        assert re.search(r"\): lambda UNAVAILABLE: asked again in (4[0-2]) s, down UNREACHABLE", status()), status()
        data = status_json()
        assert data["cloud_health"] == {"lambda": False, "down": False}
        assert data["cloud_unavailable"] == {"lambda": pytest.approx(t0 + 42, abs=1)}
        assert data["cloud_throttled"] == {} and data["cloud_refused"] == {}
        assert data["mode"] == "local-only (no cloud usable: see cloud)"  # one unavailable, one down

        # The next ticks within the Retry-After send nothing; what they get is still the 503's answer (the adapter
        # held the listing back, the API did not throttle it), asked again at the same time.
        [fault] = sim.pending_faults()
        sent = fault.remaining
        now[0] = t0 + 30
        rec.admission.schedule()
        assert fault.remaining == sent
        assert "lambda UNAVAILABLE: asked again in" in status(), status()  # not THROTTLED: nobody throttled it
        assert app.store.get_setting("cloud_unavailable") == {"lambda": pytest.approx(t0 + 42, abs=1)}
        assert app.store.get_setting("cloud_throttled") == {}

        # Another call answered 503 with a Retry-After (a look at an instance, every tick while one runs): the
        # listing is not sent until it is up (it would have answered), and the provider is said unavailable until then.
        sim.clear_faults()
        now[0] = t0 + 43
        sim.inject(FaultKind.SERVER_ERROR, status=503, count=1000, route="instances", retry_after_s=60)
        with pytest.raises(Transient):
            lam.list_owned()
        rec.admission.schedule()
        data = status_json()
        assert data["cloud_health"] == {"lambda": False, "down": False}
        assert data["cloud_unavailable"] == {"lambda": pytest.approx(t0 + 103, abs=1)}
        assert data["cloud_throttled"] == {}

        # Once it is up, the provider is asked again; it answers, and nothing says unavailable any more.
        sim.clear_faults()
        now[0] = t0 + 104
        rec.admission.schedule()
        data = status_json()
        assert data["cloud_health"] == {"lambda": True, "down": False}
        assert data["cloud_unavailable"] == {}
        assert data["mode"] == "burst-enabled"
        assert "lambda answers, down UNREACHABLE" in status()
    finally:
        lock.release()
        lam.close()
        down.close()
        app.store.close()
