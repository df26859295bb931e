"""simcloud's REST API: a Lambda Cloud v1 stand-in with capacity, quota, billing, spot and fault injection.

One `SimCloudServer` is a real HTTP server on 127.0.0.1 (stdlib `ThreadingHTTPServer`: the API is a handful
of JSON routes, and the fault kinds need raw control of the socket — sleep past a client's timeout, drop a
connection, answer HTML — which the stdlib gives without a framework in the way).

- `/api/v1/...` answers in the contract's shapes (`{"data": ...}` / `{"error": {code, message, suggestion}}`),
  behind `Authorization: Bearer <key>`. With a contract path, every request is checked against the OpenAPI
  document first; a violation answers 400 `global/invalid-parameters` and is recorded in `violations`.
- `/_sim/...` are admin routes (no auth, no contract): faults, capacity, quota, preemption, spot notices, SSH outages,
  billing. Everything there is also a method, for in-process tests.

Spot extension: a spot instance type is listed beside its on-demand type (`gpu_1x_h100_sxm5_spot` beside
`gpu_1x_h100_sxm5`) with a lower price; its `instance_type` object carries two extra fields, `market: "spot"`
and `on_demand_type`, so clients recognise it from data, not from its name. Instances carry the extra fields
`ssh_port`, `ssh_user`, `ssh_host_key` (the machine's endpoint) and `status_reason`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from providers.simcloud.backend import Endpoint, InstanceBackend, NullBackend
from providers.simcloud.contract import Contract, Violation

API_PREFIX = "/api/v1"
STATE_FILE = "simcloud-state.json"

# Statuses that hold a machine: they count against capacity and quota.
LIVE_STATUSES = frozenset({"booting", "active", "unhealthy", "terminating"})
# Terminated instances vanish from the API (404), like Lambda's; preempted ones stay visible until the
# client terminates them, so the client can learn why its instance went away.
HIDDEN_STATUSES = frozenset({"terminated"})

REGION_DESCRIPTIONS = {
    "us-east-1": "Virginia, USA",
    "us-west-1": "California, USA",
    "us-west-2": "Arizona, USA",
    "us-west-3": "Utah, USA",
    "us-south-1": "Texas, USA",
    "us-midwest-1": "Illinois, USA",
    "europe-central-1": "Germany",
    "asia-northeast-1": "Osaka, Japan",
}


@dataclass(frozen=True)
class InstanceTypeSpec:
    name: str
    description: str
    gpu_description: str
    price_cents_per_hour: int
    vcpus: int
    memory_gib: int
    storage_gib: int
    gpus: int
    market: str = "on-demand"  # "spot" for the spot extension
    on_demand_type: str | None = None  # for a spot type: the on-demand type it is the spot market of

    def as_contract(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": self.name, "description": self.description, "gpu_description": self.gpu_description,
            "price_cents_per_hour": self.price_cents_per_hour,
            "specs": {"vcpus": self.vcpus, "memory_gib": self.memory_gib, "storage_gib": self.storage_gib,
                      "gpus": self.gpus},
            "market": self.market,
        }
        if self.on_demand_type:
            body["on_demand_type"] = self.on_demand_type
        return body


def _spot(base: InstanceTypeSpec, cents: int) -> InstanceTypeSpec:
    return InstanceTypeSpec(
        name=f"{base.name}_spot", description=f"{base.description} spot", gpu_description=base.gpu_description,
        price_cents_per_hour=cents, vcpus=base.vcpus, memory_gib=base.memory_gib, storage_gib=base.storage_gib,
        gpus=base.gpus, market="spot", on_demand_type=base.name,
    )


# On-demand prices and specs are Lambda's list entries from the contract's example body; spot prices are the
# project's reference spot prices (orchestrator.config defaults): Lambda itself sells no spot.
_A10 = InstanceTypeSpec("gpu_1x_a10", "1x A10 (24 GB PCIe)", "A10 (24 GB PCIe)", 75, 30, 200, 1400, 1)
_A100 = InstanceTypeSpec("gpu_1x_a100_sxm4", "1x A100 (40 GB SXM4)", "A100 (40 GB SXM4)", 129, 30, 200, 512, 1)
_H100 = InstanceTypeSpec("gpu_1x_h100_sxm5", "1x H100 (80 GB SXM5)", "H100 (80 GB SXM5)", 329, 26, 225, 2816, 1)
# Two GPUs: a `gpus = 2, torchrun = true` job finds an offer (its spot price is two H100 spot GPUs).
_H100X2 = InstanceTypeSpec("gpu_2x_h100_sxm5", "2x H100 (80 GB SXM5)", "H100 (80 GB SXM5)", 638, 52, 450, 5632, 2)
_H100X8 = InstanceTypeSpec("gpu_8x_h100_sxm5", "8x H100 (80 GB SXM5)", "H100 (80 GB SXM5)", 2392, 208, 1800, 22528, 8)
DEFAULT_CATALOG: tuple[InstanceTypeSpec, ...] = (
    _A10, _spot(_A10, 25), _A100, _spot(_A100, 65), _H100, _spot(_H100, 100), _H100X2, _spot(_H100X2, 200), _H100X8,
)
DEFAULT_REGIONS: tuple[str, ...] = ("us-east-1", "us-west-1")
DEFAULT_CAPACITY_PER_REGION = 4


class FaultKind(StrEnum):
    THROTTLE = "throttle"  # 429 with a JSON error body
    THROTTLE_HTML = "throttle-html"  # 429 with the CDN's HTML page
    SERVER_ERROR = "server-error"  # `status` 500 (JSON internal-error), 502 or 503 (HTML gateway page)
    TIMEOUT = "timeout"  # sleep `delay_s`, then drop the connection; the request has no effect
    DELAYED_RESPONSE = "delayed-response"  # perform the request, then sleep `delay_s` before answering
    INSUFFICIENT_CAPACITY = "insufficient-capacity"  # launches (into `regions`, if given) fail
    QUOTA_EXCEEDED = "quota-exceeded"
    INVALID_KEY = "invalid-key"  # 401 even with the right key


@dataclass
class Fault:
    kind: FaultKind
    remaining: int = 1
    route: str | None = None  # path below /api/v1 the fault applies to (prefix), e.g. "instance-operations/launch"
    status: int = 500
    delay_s: float = 5.0
    regions: tuple[str, ...] = ()
    # The Retry-After header: a `throttle`'s (1 s unless given); a `server-error`'s only when given (an outage that
    # says when to ask again, as a 503 for maintenance does).
    retry_after_s: int | None = None

    def applies_to(self, path: str, body: Any) -> bool:
        if self.remaining <= 0:
            return False
        sub = path[len(API_PREFIX) + 1:] if path.startswith(API_PREFIX + "/") else path
        if self.route is not None and not sub.startswith(self.route.strip("/")):
            return False
        if self.kind in (FaultKind.INSUFFICIENT_CAPACITY, FaultKind.QUOTA_EXCEEDED):
            if sub != "instance-operations/launch":
                return False
            if self.regions and not (isinstance(body, dict) and body.get("region_name") in self.regions):
                return False
        return True


@dataclass(frozen=True)
class RateLimits:
    """Server-enforced limits (off unless given): Lambda's ~1 request/s and 1 launch per 12 s."""

    requests_per_s: float = 1.0
    burst: int = 2
    launch_interval_s: float = 12.0


@dataclass
class SimInstance:
    id: str
    name: str
    instance_type: str
    region: str
    ssh_key_name: str
    public_key: str
    tags: list[dict[str, str]]
    status: str = "booting"
    status_reason: str | None = None
    launched_at: float = 0.0
    ended_at: float | None = None
    host: str | None = None
    ssh_port: int | None = None
    ssh_user: str | None = None
    ssh_host_key: str | None = None
    notice_at: float | None = None  # when a spot interruption notice says the instance will be reclaimed


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, suggestion: str = ""):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.suggestion = suggestion

    def body(self) -> dict[str, Any]:
        err = {"code": self.code, "message": self.message}
        if self.suggestion:
            err["suggestion"] = self.suggestion
        return {"error": err}


def _invalid(message: str) -> ApiError:
    return ApiError(400, "global/invalid-parameters", message, "Check the request against the API reference.")


def _not_found(what: str) -> ApiError:
    return ApiError(404, "global/object-does-not-exist", f"Specified {what} does not exist.",
                    "Check the identifier and try again.")


_CDN_429_PAGE = (b"<!DOCTYPE html><html><head><title>429 Too Many Requests</title></head><body>"
                 b"<h1>Too Many Requests</h1><p>You are being rate limited. Please slow down.</p>"
                 b"<hr><center>cloudflare</center></body></html>")


def _gateway_page(status: int) -> bytes:
    phrase = HTTPStatus(status).phrase
    return f"<html><head><title>{status} {phrase}</title></head><body><h1>{status} {phrase}</h1></body></html>".encode()


class SimCloudServer:
    """The simulated Lambda Cloud. `start()`/`stop()` (or `with`) in-process; `serve_forever()` as a process."""

    def __init__(
        self,
        *,
        api_key: str,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: InstanceBackend | None = None,
        catalog: Sequence[InstanceTypeSpec] = DEFAULT_CATALOG,
        capacity: Mapping[str, Mapping[str, int]] | None = None,
        max_instances: int = 16,
        boot_delay_s: float = 0.0,
        billing_minimum_s: float = 60.0,
        contract_path: str | Path | None = None,
        state_dir: str | Path | None = None,
        rate_limits: RateLimits | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self._api_key = api_key
        self.backend: InstanceBackend = backend if backend is not None else NullBackend()
        self.catalog: dict[str, InstanceTypeSpec] = {t.name: t for t in catalog}
        self.capacity: dict[str, dict[str, int]] = (
            {t: dict(regions) for t, regions in capacity.items()} if capacity is not None
            else {t: dict.fromkeys(DEFAULT_REGIONS, DEFAULT_CAPACITY_PER_REGION) for t in self.catalog}
        )
        self.max_instances = max_instances
        self.boot_delay_s = boot_delay_s
        self.billing_minimum_s = billing_minimum_s
        self.contract = Contract.load(contract_path) if contract_path is not None else None
        self.rate_limits = rate_limits
        self.clock = clock
        self.violations: list[Violation] = []
        self.requests_served = 0

        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._instances: dict[str, SimInstance] = {}
        self._ssh_keys: dict[str, dict[str, str]] = {}
        self._faults: list[Fault] = []
        self._tokens = float(rate_limits.burst) if rate_limits else 0.0
        self._tokens_at = time.monotonic()
        self._last_launch_at: float | None = None
        self._state_path = Path(state_dir) / STATE_FILE if state_dir is not None else None
        self._load_state()

        self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None
        self._serving = False

    # --- lifecycle ----------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        """The API root a client's `base_url` points at."""
        return self.url + API_PREFIX

    def start(self) -> SimCloudServer:
        self._serving = True
        self._reboot_loaded_instances()
        # A short poll interval: stop() returns within it (tests start and stop many servers).
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="simcloud-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on the calling thread until `stop()` is called from *another* thread (not from a signal
        handler on this one: socketserver's shutdown() would wait for this very loop)."""
        self._serving = True
        self._reboot_loaded_instances()
        self._httpd.serve_forever()

    def stop(self) -> None:
        """Idempotent; safe before `start()` (socketserver's shutdown() would wait forever then)."""
        if self._stopping.is_set():
            return
        self._stopping.set()  # wakes handlers sleeping in timeout faults and pending boots
        if self._serving:
            self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._save_state()
        self.backend.close()

    def __enter__(self) -> SimCloudServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # --- admin: faults, capacity, quota -------------------------------------------------------------------
    def inject(self, kind: FaultKind | str, count: int = 1, *, route: str | None = None, status: int = 500,
               delay_s: float = 5.0, regions: Iterable[str] = (), retry_after_s: int | None = None) -> Fault:
        """Make the next `count` matching requests fail as `kind`."""
        fault = Fault(kind=FaultKind(kind), remaining=count, route=route, status=status, delay_s=delay_s,
                      regions=tuple(regions), retry_after_s=retry_after_s)
        if fault.kind is FaultKind.SERVER_ERROR and status not in (500, 502, 503):
            raise ValueError(f"server-error status must be 500, 502 or 503, not {status}")
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def pending_faults(self) -> list[Fault]:
        with self._lock:
            return [f for f in self._faults if f.remaining > 0]

    def set_capacity(self, instance_type: str, region: str, count: int) -> None:
        """How many instances of a type may run in a region (0 removes the region from capacity lists)."""
        with self._lock:
            self.capacity.setdefault(instance_type, {})[region] = count

    def set_quota(self, max_instances: int) -> None:
        with self._lock:
            self.max_instances = max_instances

    # --- admin: instance faults, spot ---------------------------------------------------------------------
    def set_status(self, instance_id: str, status: str, reason: str | None = None) -> None:
        """Force an instance's status, e.g. `unhealthy` (the machine stays up; the API reports the fault)."""
        if status not in ("booting", "active", "unhealthy"):
            raise ValueError(f"can force booting, active or unhealthy, not {status!r}; use preempt() or terminate")
        with self._lock:
            inst = self._get_visible(instance_id)
            inst.status = status
            inst.status_reason = reason
            self._save_state()

    def notice(self, instance_id: str, seconds: float) -> str:
        """Post a spot interruption notice: the instance will be reclaimed in `seconds`. Returns the ISO time."""
        with self._lock:
            inst = self._get_visible(instance_id)
            inst.notice_at = self.clock() + seconds
            self._save_state()
            return _iso(inst.notice_at)

    def preempt(self, instance_id: str, reason: str = "spot-preempted") -> None:
        """Reclaim a spot instance now: status `preempted`, billing ends, its machine is stopped."""
        with self._lock:
            inst = self._get_visible(instance_id)
            if self.catalog[inst.instance_type].market != "spot":
                raise ValueError(f"instance {instance_id} is on-demand; only spot instances are preempted")
            if inst.status not in LIVE_STATUSES or inst.status == "terminating":
                return  # already ended, or being released by its client: nothing to reclaim, its bill stands
            inst.status = "preempted"
            inst.status_reason = reason
            inst.ended_at = self.clock()
            self._save_state()
        self.backend.stop(instance_id)

    def interrupt_ssh(self, instance_id: str, seconds: float) -> None:
        """The instance's SSH goes away for `seconds` (its sshd restarting, a network blip): sessions end, connections
        are refused, then it answers again as before (`SshBackend.interrupt_ssh`). The API still reports it active."""
        with self._lock:
            inst = self._get_visible(instance_id)
            if inst.status not in ("active", "unhealthy"):
                raise ValueError(f"instance {instance_id} is {inst.status}: its SSH is not up to interrupt")
        interrupt = getattr(self.backend, "interrupt_ssh", None)
        if interrupt is None:
            raise ValueError("this backend's instances have no SSH to interrupt")
        interrupt(instance_id, seconds)

    def instance_action(self, instance_id: str) -> dict[str, str] | None:
        """The metadata route's answer: None (404) until a notice exists, EC2's semantics."""
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is None or inst.notice_at is None:
                return None
            return {"action": "terminate", "time": _iso(inst.notice_at)}

    # --- admin: records -------------------------------------------------------------------------------------
    def instances(self) -> list[SimInstance]:
        """Every instance ever launched (terminated ones too), oldest first."""
        with self._lock:
            return [SimInstance(**asdict(i)) for i in sorted(self._instances.values(), key=lambda i: i.launched_at)]

    def billing(self) -> list[dict[str, Any]]:
        """One record per instance: what simcloud would charge for it (running ones up to now)."""
        now = self.clock()
        with self._lock:
            out = []
            for inst in sorted(self._instances.values(), key=lambda i: i.launched_at):
                spec = self.catalog[inst.instance_type]
                end = inst.ended_at if inst.ended_at is not None else now
                runtime = max(0.0, end - inst.launched_at)
                billed_s = float(max(self.billing_minimum_s, math.ceil(runtime)))
                rate = spec.price_cents_per_hour / 100.0
                out.append({
                    "instance_id": inst.id, "name": inst.name, "instance_type": inst.instance_type,
                    "market": spec.market, "region": inst.region, "status": inst.status,
                    "launched_at": inst.launched_at, "ended_at": inst.ended_at, "rate_usd_h": rate,
                    "runtime_s": round(runtime, 3), "billing_minimum_s": self.billing_minimum_s,
                    "billed_s": billed_s, "cost_usd": round(billed_s / 3600.0 * rate, 6),
                })
            return out

    # --- request handling ---------------------------------------------------------------------------------
    def _handle(self, method: str, raw_path: str, headers: Mapping[str, str], raw_body: bytes) -> _Reply:
        path = urlsplit(raw_path).path.rstrip("/") or "/"
        with self._lock:
            self.requests_served += 1
        if path.startswith("/_sim/"):
            return self._handle_admin(method, path, raw_body)
        if not path.startswith(API_PREFIX + "/"):
            return _Reply.error(_not_found("route"))

        body: Any = None
        if raw_body:
            try:
                body = json.loads(raw_body)
            except ValueError:
                self._record_violation(method, path, "body is not valid JSON")
                return _Reply.error(_invalid("The request body is not valid JSON."))
        if self.contract is not None:
            problem = self.contract.check(method, path, body)
            if problem is not None:
                self._record_violation(method, path, problem)
                return _Reply.error(_invalid(problem))
        if not self._authorized(headers.get("authorization", "")):
            return _Reply.error(_unauthorized())

        with self._lock:
            throttled = self._rate_limited(method, path)
            fault = next((f for f in self._faults if f.applies_to(path, body)), None)
            if fault is not None:
                fault.remaining -= 1
        if throttled:
            return _Reply.throttled_json()
        delay_after = 0.0
        if fault is not None:
            early = self._fault_reply(fault)
            if early is not None:
                return early
            delay_after = fault.delay_s
        try:
            reply = self._route(method, path, body)
        except ApiError as err:
            reply = _Reply.error(err)
        reply.delay_s = delay_after
        return reply

    def _fault_reply(self, fault: Fault) -> _Reply | None:
        kind = fault.kind
        if kind is FaultKind.THROTTLE:
            return _Reply.throttled_json(1 if fault.retry_after_s is None else fault.retry_after_s)
        if kind is FaultKind.THROTTLE_HTML:
            return _Reply(429, _CDN_429_PAGE, "text/html; charset=utf-8")
        if kind is FaultKind.SERVER_ERROR:
            if fault.status == 500:
                reply = _Reply.error(ApiError(500, "global/internal-error", "An internal server error occurred.",
                                              "Try again later. Contact Support if the problem persists."))
            else:
                reply = _Reply(fault.status, _gateway_page(fault.status), "text/html")
            if fault.retry_after_s is not None:
                reply.headers["Retry-After"] = str(fault.retry_after_s)
            return reply
        if kind is FaultKind.TIMEOUT:
            return _Reply(0, b"", "", delay_s=fault.delay_s, drop=True)
        if kind is FaultKind.INSUFFICIENT_CAPACITY:
            return _Reply.error(_insufficient_capacity())
        if kind is FaultKind.QUOTA_EXCEEDED:
            return _Reply.error(_quota_exceeded())
        if kind is FaultKind.INVALID_KEY:
            return _Reply.error(_unauthorized())
        return None  # DELAYED_RESPONSE: perform, then answer late

    def _route(self, method: str, path: str, body: Any) -> _Reply:
        sub = path[len(API_PREFIX):]
        if method == "GET" and sub == "/instance-types":
            return _Reply.data(self._instance_types())
        if method == "GET" and sub == "/instances":
            with self._lock:
                return _Reply.data([self._render(i) for i in self._instances.values()
                                    if i.status not in HIDDEN_STATUSES])
        if method == "GET" and (m := re.fullmatch(r"/instances/([^/]+)", sub)):
            with self._lock:
                return _Reply.data(self._render(self._get_visible(m.group(1))))
        if method == "POST" and sub == "/instance-operations/launch":
            return _Reply.data({"instance_ids": [self._launch(body or {})]})
        if method == "POST" and sub == "/instance-operations/terminate":
            return _Reply.data({"terminated_instances": self._terminate((body or {}).get("instance_ids", []))})
        if method == "GET" and sub == "/ssh-keys":
            with self._lock:
                return _Reply.data(list(self._ssh_keys.values()))
        if method == "POST" and sub == "/ssh-keys":
            return _Reply.data(self._add_ssh_key(body or {}))
        raise _not_found("route")

    def _instance_types(self) -> dict[str, Any]:
        with self._lock:
            out = {}
            for name, spec in self.catalog.items():
                regions = [r for r, cap in self.capacity.get(name, {}).items() if self._live_count(name, r) < cap]
                out[name] = {"instance_type": spec.as_contract(),
                             "regions_with_capacity_available": [_region(r) for r in regions]}
            return out

    def _launch(self, body: Mapping[str, Any]) -> str:
        type_name = body.get("instance_type_name")
        region = body.get("region_name")
        key_names = body.get("ssh_key_names") or []
        if not isinstance(type_name, str) or not isinstance(region, str):
            raise _invalid("region_name and instance_type_name are required.")
        if len(key_names) != 1:
            raise _invalid("Exactly one SSH key must be specified.")
        name = body.get("name") or ""
        if len(name) > 64:
            raise _invalid("name must be 64 characters or fewer.")
        with self._lock:
            if type_name not in self.catalog:
                raise _not_found(f"instance type '{type_name}'")
            key = self._ssh_keys.get(key_names[0])
            if key is None:
                raise _not_found(f"SSH key '{key_names[0]}'")
            if sum(1 for i in self._instances.values() if i.status in LIVE_STATUSES) >= self.max_instances:
                raise _quota_exceeded()
            if self._live_count(type_name, region) >= self.capacity.get(type_name, {}).get(region, 0):
                raise _insufficient_capacity()
            if self.rate_limits is not None:
                self._last_launch_at = time.monotonic()
            inst = SimInstance(
                id=uuid.uuid4().hex, name=name, instance_type=type_name, region=region, ssh_key_name=key["name"],
                public_key=key["public_key"], tags=[dict(t) for t in body.get("tags") or []],
                launched_at=self.clock(),
            )
            self._instances[inst.id] = inst
            self._save_state()
        threading.Thread(target=self._boot, args=(inst.id,), name=f"simcloud-boot-{inst.id[:8]}", daemon=True).start()
        return inst.id

    def _boot(self, instance_id: str) -> None:
        if self.boot_delay_s > 0 and self._stopping.wait(self.boot_delay_s):
            return
        with self._lock:
            inst = self._instances.get(instance_id)
            if inst is None or inst.status != "booting":
                return
            public_key = inst.public_key
        try:
            endpoint: Endpoint | None = self.backend.start(instance_id, public_key)
            failure = None
        except Exception as exc:  # the machine did not come up: the API reports the instance unhealthy
            endpoint, failure = None, f"boot failed: {type(exc).__name__}: {exc}"
        with self._lock:
            still_wanted = inst.status == "booting"
            if still_wanted:
                if endpoint is not None:
                    inst.status, inst.host, inst.ssh_port = "active", endpoint.host, endpoint.port
                    inst.ssh_user, inst.ssh_host_key = endpoint.user, endpoint.host_key
                else:
                    inst.status, inst.status_reason = "unhealthy", failure
                self._save_state()
        if not still_wanted:
            self.backend.stop(instance_id)  # terminated or preempted while its machine was coming up

    def _terminate(self, ids: Sequence[str]) -> list[dict[str, Any]]:
        with self._lock:
            targets = []
            for instance_id in ids:
                inst = self._instances.get(instance_id)
                if inst is None or inst.status in HIDDEN_STATUSES:
                    raise _not_found("instance")
                targets.append(inst)
            rendered = []
            for inst in targets:
                if inst.status in LIVE_STATUSES:
                    inst.ended_at = self.clock()
                if inst.status != "terminating":
                    inst.status, inst.status_reason = "terminating", None
                rendered.append(self._render(inst))
            self._save_state()
        for inst in targets:
            threading.Thread(target=self._finish_terminate, args=(inst.id,), daemon=True).start()
        return rendered

    def _finish_terminate(self, instance_id: str) -> None:
        self.backend.stop(instance_id)
        with self._lock:
            inst = self._instances[instance_id]
            inst.status = "terminated"
            self._save_state()

    def _add_ssh_key(self, body: Mapping[str, Any]) -> dict[str, str]:
        name = body.get("name")
        public_key = body.get("public_key")
        if not isinstance(name, str) or not name:
            raise _invalid("name is required.")
        if not isinstance(public_key, str) or not public_key.strip():
            # Lambda would generate a key pair; simcloud has no use for a private key it made up.
            raise _invalid("simcloud needs public_key: it does not generate key pairs.")
        with self._lock:
            if name in self._ssh_keys:
                raise _invalid(f"An SSH key named '{name}' already exists.")
            key = {"id": uuid.uuid4().hex, "name": name, "public_key": public_key.strip()}
            self._ssh_keys[name] = key
            self._save_state()
            return dict(key)

    # --- admin routes -----------------------------------------------------------------------------------------
    def _handle_admin(self, method: str, path: str, raw_body: bytes) -> _Reply:
        try:
            body = json.loads(raw_body) if raw_body else {}
        except ValueError:
            return _Reply.error(_invalid("The request body is not valid JSON."))
        try:
            return self._admin_route(method, path, body)
        except ApiError as err:
            return _Reply.error(err)
        except (ValueError, TypeError, KeyError) as exc:
            return _Reply.error(_invalid(str(exc)))

    def _admin_route(self, method: str, path: str, body: dict[str, Any]) -> _Reply:
        sub = path[len("/_sim"):]
        if m := re.fullmatch(r"/instances/([^/]+)/latest/meta-data/spot/instance-action", sub):
            action = self.instance_action(m.group(1))
            if action is None:
                return _Reply(404, b"Not Found", "text/plain")
            return _Reply(200, json.dumps(action).encode(), "application/json")
        if method == "GET" and sub == "/billing":
            return _Reply.data(self.billing())
        if method == "GET" and sub == "/violations":
            with self._lock:
                return _Reply.data([v.as_dict() for v in self.violations])
        if method == "GET" and sub == "/faults":
            return _Reply.data([_fault_dict(f) for f in self.pending_faults()])
        if method == "POST" and sub == "/faults":
            fault = self.inject(body["kind"], int(body.get("count", 1)), route=body.get("route"),
                                status=int(body.get("status", 500)), delay_s=float(body.get("delay_s", 5.0)),
                                regions=body.get("regions", ()),
                                retry_after_s=None if body.get("retry_after_s") is None else int(body["retry_after_s"]))
            return _Reply.data(_fault_dict(fault))
        if method == "DELETE" and sub == "/faults":
            self.clear_faults()
            return _Reply.data({})
        if method == "POST" and sub == "/capacity":
            self.set_capacity(body["instance_type"], body["region"], int(body["count"]))
            return _Reply.data({})
        if method == "POST" and sub == "/quota":
            self.set_quota(int(body["max_instances"]))
            return _Reply.data({})
        if method == "GET" and sub == "/instances":
            return _Reply.data([asdict(i) for i in self.instances()])
        if method == "POST" and (m := re.fullmatch(r"/instances/([^/]+)/ssh-outage", sub)):
            self.interrupt_ssh(m.group(1), float(body["seconds"]))
            return _Reply.data({})
        if method == "POST" and (m := re.fullmatch(r"/instances/([^/]+)/(preempt|notice|status)", sub)):
            instance_id, verb = m.groups()
            if verb == "preempt":
                self.preempt(instance_id, body.get("reason", "spot-preempted"))
                return _Reply.data({})
            if verb == "notice":
                return _Reply.data({"action": "terminate", "time": self.notice(instance_id, float(body["seconds"]))})
            self.set_status(instance_id, body["status"], body.get("reason"))
            return _Reply.data({})
        raise _not_found("admin route")

    # --- helpers (call with the lock held) --------------------------------------------------------------------
    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and token.strip() == self._api_key

    def _rate_limited(self, method: str, path: str) -> bool:
        limits = self.rate_limits
        if limits is None:
            return False
        now = time.monotonic()
        self._tokens = min(float(limits.burst), self._tokens + (now - self._tokens_at) * limits.requests_per_s)
        self._tokens_at = now
        if self._tokens < 1.0:
            return True
        self._tokens -= 1.0
        is_launch = method == "POST" and path == API_PREFIX + "/instance-operations/launch"
        return (is_launch and self._last_launch_at is not None
                and now - self._last_launch_at < limits.launch_interval_s)

    def _record_violation(self, method: str, path: str, problem: str) -> None:
        with self._lock:
            self.violations.append(Violation(method=method, path=path, problem=problem))

    def _live_count(self, type_name: str, region: str) -> int:
        return sum(1 for i in self._instances.values()
                   if i.instance_type == type_name and i.region == region and i.status in LIVE_STATUSES)

    def _get_visible(self, instance_id: str) -> SimInstance:
        inst = self._instances.get(instance_id)
        if inst is None or inst.status in HIDDEN_STATUSES:
            raise _not_found("instance")
        return inst

    def _render(self, inst: SimInstance) -> dict[str, Any]:
        blocked = {"available": False, "reason_code": "vm-has-not-launched" if inst.status == "booting"
                   else "vm-is-terminating"}
        action = {"available": True} if inst.status == "active" else blocked
        can_terminate = inst.status in LIVE_STATUSES and inst.status != "terminating"
        out: dict[str, Any] = {
            "id": inst.id, "name": inst.name, "status": inst.status, "ssh_key_names": [inst.ssh_key_name],
            "file_system_names": [], "region": _region(inst.region),
            "instance_type": self.catalog[inst.instance_type].as_contract(),
            "actions": {"migrate": action, "rebuild": action, "restart": action, "cold_reboot": action,
                        "terminate": {"available": True} if can_terminate else blocked},
            "tags": [dict(t) for t in inst.tags],
        }
        if inst.host is not None and inst.status in ("active", "unhealthy"):
            endpoint = {"ip": inst.host, "hostname": inst.host, "ssh_port": inst.ssh_port, "ssh_user": inst.ssh_user,
                        "ssh_host_key": inst.ssh_host_key}
            out.update({k: v for k, v in endpoint.items() if v is not None})
        if inst.status_reason:
            out["status_reason"] = inst.status_reason
        return out

    # --- persistence ----------------------------------------------------------------------------------------
    def _save_state(self) -> None:
        if self._state_path is None:
            return
        data = {"instances": [asdict(i) for i in self._instances.values()], "ssh_keys": list(self._ssh_keys.values())}
        self._state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, self._state_path)  # atomic: a crash leaves the old or the new file, never half of one

    def _load_state(self) -> None:
        if self._state_path is None or not self._state_path.exists():
            return
        data = json.loads(self._state_path.read_text(encoding="utf-8"))
        self._instances = {d["id"]: SimInstance(**d) for d in data.get("instances", [])}
        self._ssh_keys = {k["name"]: k for k in data.get("ssh_keys", [])}

    def _reboot_loaded_instances(self) -> None:
        """Instances that were live when a previous simcloud process stopped lost their machines with it:
        they boot again (new endpoint, no processes), like a host reboot; a terminating one finishes."""
        with self._lock:
            to_boot, to_finish = [], []
            for inst in self._instances.values():
                if inst.status in ("booting", "active", "unhealthy") and inst.host is not None:
                    inst.status, inst.host, inst.ssh_port, inst.ssh_host_key = "booting", None, None, None
                    inst.status_reason = "rebooted: simcloud restarted"
                    to_boot.append(inst.id)
                elif inst.status == "booting":
                    to_boot.append(inst.id)
                elif inst.status == "terminating":
                    to_finish.append(inst.id)
        for instance_id in to_boot:
            threading.Thread(target=self._boot, args=(instance_id,), daemon=True).start()
        for instance_id in to_finish:
            threading.Thread(target=self._finish_terminate, args=(instance_id,), daemon=True).start()


@dataclass
class _Reply:
    status: int
    body: bytes
    content_type: str
    delay_s: float = 0.0  # sleep before answering (the client may have given up)
    drop: bool = False  # close the connection without an answer
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def data(cls, payload: Any) -> _Reply:
        return cls(200, json.dumps({"data": payload}).encode(), "application/json")

    @classmethod
    def error(cls, err: ApiError) -> _Reply:
        return cls(err.status, json.dumps(err.body()).encode(), "application/json")

    @classmethod
    def throttled_json(cls, retry_after_s: int = 1) -> _Reply:
        body = {"error": {"code": "global/too-many-requests", "message": "Too many requests.",
                          "suggestion": "Slow down: about 1 request per second, 1 launch per 12 seconds."}}
        return cls(429, json.dumps(body).encode(), "application/json", headers={"Retry-After": str(retry_after_s)})


def _make_handler(server: SimCloudServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "simcloud/1"

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            reply = server._handle(self.command, self.path, headers, raw)
            if reply.delay_s > 0 and server._stopping.wait(reply.delay_s):
                self.close_connection = True
                return
            if reply.drop:
                self.close_connection = True
                return
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up waiting
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                self.send_header("Content-Length", str(len(reply.body)))
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(reply.body)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:
            return  # requests are counted, not logged: the Authorization header must never reach a log

    return Handler


def _region(name: str) -> dict[str, str]:
    return {"name": name, "description": REGION_DESCRIPTIONS.get(name, name)}


def _unauthorized() -> ApiError:
    return ApiError(401, "global/invalid-api-key", "API key was invalid, expired, or deleted.",
                    "Check your API key or create a new one, then try again.")


def _insufficient_capacity() -> ApiError:
    return ApiError(400, "instance-operations/launch/insufficient-capacity",
                    "Not enough capacity to fulfill launch request.", "Choose another region or instance type.")


def _quota_exceeded() -> ApiError:
    return ApiError(400, "global/quota-exceeded", "Quota exceeded.", "Contact Support to increase your quota.")


def _fault_dict(fault: Fault) -> dict[str, Any]:
    d = asdict(fault)
    d["kind"] = str(fault.kind)
    d["regions"] = list(fault.regions)
    return d


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
