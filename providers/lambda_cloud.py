"""The Lambda Cloud adapter (and, pointed at simcloud, the simulated cloud's): `providers.base.Provider` over
Lambda's v1 REST API.

- Every HTTP exchange runs inside `providers.base.call()`: Throttled/Transient are retried there, and each
  call emits one `provider.call` event. Errors are mapped from the API's error *codes* and HTTP statuses,
  never from its messages.
- Lambda has no idempotency key. Instances are named `OwnerTags.instance_name` and tagged with the owner
  tags; after a launch whose outcome is unknown (timeout, 5xx, dropped connection) the next try looks the
  name up before launching again, so one attempt never gets two instances.
- Client-side pacing keeps to Lambda's limits (about 1 request/s, 1 launch per 12 s); the clock and sleep
  are injectable so tests need not wait.
- The API key lives only in the `Authorization` header of the HTTP client. It is never part of a message,
  an event or this object's repr.
"""

from __future__ import annotations

import email.utils
import math
import os
import re
import threading
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from orchestrator.config import LambdaProvider, SimProvider
from providers.base import (
    AuthFailed,
    EventSink,
    InstanceInfo,
    InstanceState,
    InvalidRequest,
    LaunchRequest,
    Market,
    NoCapacity,
    Offer,
    ProviderError,
    QuotaExceeded,
    RetryPolicy,
    Throttled,
    Transient,
    call,
    key_name_variant,
    public_key_body,
)

# Lambda's published limits.
REQUEST_INTERVAL_S = 1.0
LAUNCH_INTERVAL_S = 12.0
DEFAULT_RETRY = RetryPolicy()
# The code of a request held back, not sent, while a Retry-After the API gave is not up: it had no effect.
NOT_SENT = "retry-after"

_STATES = {
    "booting": InstanceState.BOOTING,
    "active": InstanceState.RUNNING,
    "unhealthy": InstanceState.FAILED,
    "terminating": InstanceState.TERMINATING,
    "terminated": InstanceState.TERMINATED,
    "preempted": InstanceState.PREEMPTED,
}


class InstanceGone(InvalidRequest):
    """`global/object-does-not-exist`: on terminate or describe, the instance is gone (a success there)."""


# The name burstctl gives an instance: "burst-" and the attempt id (`queue.new_job_id`, "-a" and its number).
_NAMED_BY_BURSTCTL = re.compile(r"burst-(?P<attempt>(?P<job>j[0-9a-f]{8})-a[0-9]+)")
# Requests whose 404 `global/object-does-not-exist` says an instance is gone (not a type, a key or a route).
_NAMES_INSTANCES = ("GET /instances/", "POST /instance-operations/terminate")


class Pacer:
    """At most one event per `interval_s`: waits (with the injected sleep) until the interval has passed."""

    def __init__(self, interval_s: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._last: float | None = None
        self._lock = threading.Lock()

    def wait(self) -> float:
        """Block until the next event may happen; returns how long it waited."""
        with self._lock:
            waited = 0.0
            if self._last is not None:
                waited = max(0.0, self._last + self.interval_s - self._clock())
                if waited > 0:
                    self._sleep(waited)
            self._last = self._clock()
            return waited

    def mark(self) -> None:
        """Record an event now (when another pacer's wait delayed it past this pacer's own stamp)."""
        with self._lock:
            self._last = self._clock()


class LambdaCloud:
    """A Lambda-API cloud: Lambda Cloud itself (`name="lambda"`) or simcloud (`name="sim"`)."""

    def __init__(
        self,
        *,
        name: str,
        base_url: str,
        api_key: str,
        ssh_key_name: str = "burstctl",
        regions: Sequence[str] = (),
        instance_types: Sequence[str] = (),
        orchestrator_id: str = "burstctl",
        sink: EventSink | None = None,
        lists_spot_capacity: bool = True,
        retry: RetryPolicy = DEFAULT_RETRY,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        request_interval_s: float = REQUEST_INTERVAL_S,
        launch_interval_s: float = LAUNCH_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        key_from: str = "",
    ):
        self.name = name
        self.key_from = key_from  # where the key was read, for a refusal to name: "$LAMBDA_API_KEY (providers…)"
        # Configured instance types the listing does not have, as of the last `offers()` (`burstctl providers`).
        self.config_problems: list[str] = []
        self.base_url = base_url.rstrip("/")
        self.ssh_key_name = ssh_key_name
        self.regions = tuple(regions)
        self.instance_types = tuple(instance_types)
        self.orchestrator_id = orchestrator_id
        self.sink = sink
        self.lists_spot_capacity = lists_spot_capacity
        self.retry = retry
        self._sleep = sleep
        self._request_pacer = Pacer(request_interval_s, clock=clock, sleep=sleep)
        self._launch_pacer = Pacer(launch_interval_s, clock=clock, sleep=sleep)
        self._key_names: dict[str, str] = {}  # public key -> the name it is registered under
        self._clock = clock
        self._quiet_until = -math.inf  # on `clock`: until when the API asked (Retry-After) to be left alone
        # What asked for it: a 429 (Throttled) or an outage, a 5xx (Transient), and its HTTP status.
        self._quiet_asked: tuple[type[Throttled] | type[Transient], int] = (Throttled, 429)
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {api_key}", "Accept": "application/json"},
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
        )

    def __repr__(self) -> str:
        return f"LambdaCloud(name={self.name!r}, base_url={self.base_url!r})"

    def close(self) -> None:
        self._http.close()

    def spot_notice_url(self, instance_id: str) -> str | None:
        """simcloud's stand-in for EC2's metadata notice (Lambda Cloud sells no spot, so has none)."""
        if self.name != "sim":
            return None
        root = self.base_url.removesuffix("/api/v1")
        return f"{root}/_sim/instances/{instance_id}/latest/meta-data/spot/instance-action"

    # --- Provider ---------------------------------------------------------------------------------------------
    def offers(self) -> list[Offer]:
        """One offer per on-demand GPU type, with the spot price of its spot sibling when simcloud lists one.

        `regions` are the regions where either market has capacity now (launch re-checks per market);
        `on_demand_regions` and `spot_regions` each market's own.
        """
        types = self._call("offers", lambda: self._request("GET", "/instance-types"))
        self.config_problems = [f"providers.{self.name}.instance_types: {t} is not a type the provider lists"
                                for t in self.instance_types if t not in types]
        spot_of = {_on_demand_type(item): item for item in types.values() if _is_spot(item)}
        offers = []
        for type_name, item in types.items():
            if _is_spot(item) or (self.instance_types and type_name not in self.instance_types):
                continue
            it = item["instance_type"]
            specs = it["specs"]
            if int(specs.get("gpus", 0)) <= 0:
                continue  # CPU-only types train nothing
            model, vram = parse_gpu_description(it.get("gpu_description", ""))
            spot = spot_of.get(type_name)
            regions = self._order_regions(_capacity_regions(item) + (_capacity_regions(spot) if spot else []))
            offers.append(Offer(
                provider=self.name, instance_type=type_name, gpu_model=model, gpu_count=int(specs["gpus"]),
                vram_gib=vram, vcpus=int(specs.get("vcpus", 0)),
                on_demand_usd_h=int(it["price_cents_per_hour"]) / 100.0,
                spot_usd_h=int(spot["instance_type"]["price_cents_per_hour"]) / 100.0 if spot else None,
                regions=tuple(regions),
                on_demand_regions=tuple(self._order_regions(_capacity_regions(item))),
                spot_regions=tuple(self._order_regions(_capacity_regions(spot)))
                if spot and self.lists_spot_capacity else None,
            ))
        order = {t: i for i, t in enumerate(self.instance_types)}
        offers.sort(key=lambda o: (order.get(o.instance_type, len(order)), o.instance_type))
        return offers

    def launch(self, request: LaunchRequest) -> InstanceInfo:
        """Launch the requested type in the first region with capacity: regions listing capacity, those of
        `request.region_order` first, then the rest in config order. Never another type: that is another offer,
        with its own GPU, memory and price, which the daemon chooses (`Reconciler.choose_offer`)."""
        types = self._call("instance-types", lambda: self._request("GET", "/instance-types"))
        if request.instance_type not in types:
            raise InvalidRequest(f"unknown instance type {request.instance_type!r}", provider=self.name)
        market_type = _type_for_market(types, request.instance_type, request.market)
        if market_type is None:
            raise InvalidRequest(f"{request.instance_type!r} has no {request.market} market", provider=self.name)
        regions = self._order_regions(_capacity_regions(types[market_type]))
        if request.region_order:
            first = {r: i for i, r in enumerate(request.region_order)}
            regions.sort(key=lambda r: first.get(r, len(first)))  # stable: the rest stay in config order
        if request.region is not None:
            regions = [r for r in regions if r == request.region]
        tried: list[str] = []
        for region in regions:
            tried.append(region)
            try:
                return self._launch_in(request, market_type, region)
            except NoCapacity:
                continue  # capacity went between listing and launching: the next region
        where = ", ".join(tried) if tried else "no region lists capacity"
        raise NoCapacity(f"no {request.market} capacity for {market_type} (tried: {where})",
                         provider=self.name, code="instance-operations/launch/insufficient-capacity")

    def describe(self, ids: Sequence[str]) -> dict[str, InstanceInfo]:
        if not ids:
            return {}
        if len(ids) == 1:
            instance_id = ids[0]

            def get_one() -> dict[str, Any] | None:
                try:
                    return self._request("GET", f"/instances/{instance_id}")
                except InstanceGone:
                    self._confirm_gone([instance_id])
                    return None

            found = self._call("describe", get_one)
            return {instance_id: self._info(found) if found is not None else _gone(instance_id)}
        listed = {i["id"]: i for i in self._call("describe", lambda: self._request("GET", "/instances"))}
        return {i: self._info(listed[i]) if i in listed else _gone(i) for i in ids}

    def terminate(self, ids: Sequence[str]) -> None:
        """Idempotent: an instance that is already gone (404 object-does-not-exist) counts as terminated."""
        if not ids:
            return

        def terminate_all() -> None:
            try:
                self._request("POST", "/instance-operations/terminate", {"instance_ids": list(ids)})
            except InstanceGone:
                # One unknown id fails the whole batch: end the others one by one.
                gone = list(ids) if len(ids) == 1 else []
                for instance_id in ids if len(ids) > 1 else ():
                    try:
                        self._request("POST", "/instance-operations/terminate", {"instance_ids": [instance_id]})
                    except InstanceGone:
                        gone.append(instance_id)
                self._confirm_gone(gone)

        self._call("terminate", terminate_all)

    def list_owned(self) -> list[InstanceInfo]:
        listed = self._call("list", lambda: self._request("GET", "/instances"))
        return [self._info(i) for i in listed if self._owned(i)]

    def find_attempt(self, attempt_id: str) -> InstanceInfo | None:
        listed = self._call("find", lambda: self._request("GET", "/instances"))
        found = _live_of_attempt(listed, attempt_id)
        return self._info(found) if found is not None else None

    # --- launch ------------------------------------------------------------------------------------------------
    def _launch_in(self, request: LaunchRequest, instance_type: str, region: str) -> InstanceInfo:
        key_name = self._ensure_ssh_key(request)
        body: dict[str, Any] = {
            "region_name": region,
            "instance_type_name": instance_type,
            "ssh_key_names": [key_name],
            "name": request.tags.instance_name,
            "tags": [{"key": k, "value": v} for k, v in request.tags.as_dict().items()],
        }
        if request.user_data:
            body["user_data"] = request.user_data
        if request.image:
            body["image"] = {"family": request.image}
        outcome_unknown = False

        def launch_once() -> str:
            nonlocal outcome_unknown
            if outcome_unknown:
                # The previous try may have launched before failing: find it by name before launching again.
                existing = _live_of_attempt(self._request("GET", "/instances"), request.tags.attempt_id)
                if existing is not None:
                    return str(existing["id"])
            try:
                data = self._request("POST", "/instance-operations/launch", body, launch=True)
            except Transient as exc:
                outcome_unknown = outcome_unknown or exc.code != NOT_SENT  # one held back launched nothing
                raise
            return str(data["instance_ids"][0])

        instance_id = self._call("launch", launch_once)
        return self.describe([instance_id])[instance_id]

    def _ensure_ssh_key(self, request: LaunchRequest) -> str:
        """The name under which the request's public key is registered, registering it if needed.

        A different key already holding the wanted name is left alone: ours goes under `<name>-<hash>`.
        """
        wanted = request.ssh_key_name or self.ssh_key_name
        public_key = request.ssh_public_key.strip()
        if not public_key:
            return wanted  # a key registered by hand (real Lambda): trust the configured name
        if public_key in self._key_names:
            return self._key_names[public_key]
        def ensure() -> str:
            registered = {k["name"]: k.get("public_key", "") for k in self._request("GET", "/ssh-keys")}
            for name in (wanted, key_name_variant(wanted, public_key)):
                if name not in registered:
                    self._request("POST", "/ssh-keys", {"name": name, "public_key": public_key})
                    return name
                if public_key_body(registered[name]) == public_key_body(public_key):
                    return name
            raise InvalidRequest(f"SSH key names {wanted!r} and its variant hold other keys", provider=self.name)

        name = self._call("ssh-key", ensure)
        self._key_names[public_key] = name
        return name

    # --- HTTP ----------------------------------------------------------------------------------------------------
    def _call(self, verb: str, fn: Callable[[], Any]) -> Any:
        return call(self.name, verb, fn, sink=self.sink, retry=self.retry, sleep=self._sleep)

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None, *, launch: bool = False) -> Any:
        """One HTTP exchange; returns the response's `data` or raises the taxonomy's error."""
        what = f"{method} {path}"
        if (quiet_s := self._quiet_until - self._clock()) > 0:
            # Asked again before its Retry-After is up, the API refuses again and counts the request against us. Not
            # sent, it fails as the answer that asked for the wait did: throttled (429), or unavailable (5xx), which
            # `status` says apart; either is retried, and neither says the provider is unreachable.
            kind, status = self._quiet_asked
            raise kind(f"{what}: not sent: the API asked (HTTP {status}, Retry-After) to be left alone for "
                       f"{quiet_s:.0f} s more", provider=self.name, code=NOT_SENT, retry_after_s=quiet_s)
        self._request_pacer.wait()
        if launch:
            # Both limits apply; stamp the request pacer again so both count from the moment of sending.
            self._launch_pacer.wait()
            self._request_pacer.mark()
        try:
            resp = self._http.request(method, path, json=body) if body is not None else self._http.request(method, path)
        except httpx.TimeoutException as exc:
            raise Transient(f"{what}: {self._http.base_url} timed out ({type(exc).__name__})", provider=self.name,
                            code="timeout") from None
        except httpx.TransportError as exc:  # the URL says where: a wrong base_url, or a server not running
            raise Transient(f"{what}: connection to {self._http.base_url} failed ({type(exc).__name__})",
                            provider=self.name, code="connection") from None
        payload = _json_or_none(resp)
        if resp.is_success:
            if not isinstance(payload, dict) or "data" not in payload:
                raise Transient(f"{what}: HTTP {resp.status_code} without a JSON data body", provider=self.name,
                                code=f"http-{resp.status_code}")
            return payload["data"]
        error = self._error(what, resp.status_code, payload)
        if isinstance(error, (Throttled, Transient)) and (after := retry_after_s(resp.headers.get("retry-after"))):
            error.retry_after_s = after
            if (until := self._clock() + after) > self._quiet_until:  # the wait ending last holds requests back
                self._quiet_until = until
                self._quiet_asked = (Throttled if isinstance(error, Throttled) else Transient, resp.status_code)
        raise error

    def _error(self, what: str, status: int, payload: Any) -> ProviderError:
        err = payload.get("error") if isinstance(payload, dict) else None
        code = str(err.get("code")) if isinstance(err, dict) and err.get("code") else None
        message = str(err.get("message", "")) if isinstance(err, dict) else ""
        text = f"{what}: HTTP {status} {code or '(no JSON error body)'}" + (f": {message}" if message else "")
        kw: dict[str, Any] = {"provider": self.name, "code": code or f"http-{status}"}
        if status == 429:
            return Throttled(text, **kw)  # often an HTML page from the CDN: the status alone decides
        if status >= 500 or code == "global/internal-error" or (code or "").startswith("provider/"):
            return Transient(text, **kw)
        if code == "instance-operations/launch/insufficient-capacity":
            return NoCapacity(text, **kw)
        if code == "global/quota-exceeded":
            return QuotaExceeded(text, **kw)
        if code == "global/invalid-api-key" or status in (401, 403):
            return AuthFailed(text + (f" (the key from {self.key_from} was refused)" if self.key_from else ""), **kw)
        if code == "global/object-does-not-exist" and what.startswith(_NAMES_INSTANCES):
            return InstanceGone(text, **kw)  # the callers confirm it with a listing (`_confirm_gone`)
        if status == 404 and not what.startswith("POST /instance-operations/launch"):
            # A listing or a path the server does not have: what a wrong base_url gives. Never "gone".
            return InvalidRequest(f"{text} (is base_url {self.base_url!r} the API's root?)", **kw)
        return InvalidRequest(text, **kw)

    def _confirm_gone(self, ids: Sequence[str]) -> None:
        """A 404 for an instance is trusted only where the instance listing answers and does not list it: a wrong
        base_url answers 404 to everything, and reading that as "gone" would report a live, billing instance
        terminated. Raises the listing's error, or InvalidRequest for an instance the listing still has."""
        live = {str(i["id"]) for i in self._request("GET", "/instances")
                if i.get("status") not in ("terminated", "terminating")}
        if still := [i for i in ids if i in live]:
            raise InvalidRequest(f"404 for instances the listing has live: {', '.join(still)}", provider=self.name)

    # --- mapping -------------------------------------------------------------------------------------------------
    def _order_regions(self, regions: Sequence[str]) -> list[str]:
        unique = list(dict.fromkeys(regions))
        if not self.regions:
            return unique
        return [r for r in self.regions if r in unique]

    def _owned(self, inst: Mapping[str, Any]) -> bool:
        tags = _tags(inst)
        if "burstctl:orchestrator" in tags:
            return tags["burstctl:orchestrator"] == self.orchestrator_id
        # A listing without tags: only a name burstctl gives (`OwnerTags.instance_name`), not any "burst-…" a
        # person might choose, is taken for ours.
        return _NAMED_BY_BURSTCTL.fullmatch(str(inst.get("name", ""))) is not None

    def _info(self, inst: Mapping[str, Any]) -> InstanceInfo:
        status = str(inst.get("status", ""))
        # An unknown status is not "gone": reporting it as pending keeps the lifecycle from launching again.
        state = _STATES.get(status, InstanceState.PENDING)
        reason = inst.get("status_reason")
        if state in (InstanceState.FAILED, InstanceState.PREEMPTED) and not reason:
            reason = status
        itype = inst.get("instance_type") or {}
        return InstanceInfo(
            id=str(inst["id"]),
            state=state,
            instance_type=str(itype.get("name", "")),
            market=Market.SPOT if itype.get("market") == "spot" else Market.ON_DEMAND,
            region=(inst.get("region") or {}).get("name"),
            reason=reason,
            host=inst.get("ip"),
            ssh_port=int(inst.get("ssh_port") or 22),
            ssh_user=str(inst.get("ssh_user") or "ubuntu"),
            host_key=inst.get("ssh_host_key"),
            tags=_tags(inst) or _tags_from_name(str(inst.get("name", ""))),
        )


def from_config(section: LambdaProvider | SimProvider, api_key: str | None, *, sink: EventSink | None = None,
                orchestrator_id: str = "burstctl", **tuning: Any) -> LambdaCloud:
    """The adapter for a config section. The caller reads the key (`read_api_key`); `tuning` passes through to
    `LambdaCloud` (timeouts, pacing, retry, clock, sleep)."""
    if not api_key:
        raise AuthFailed(f"no API key: set the environment variable {section.api_key_env}",
                         provider="sim" if isinstance(section, SimProvider) else "lambda")
    name = "sim" if isinstance(section, SimProvider) else "lambda"
    path = key_file_path(section)
    key_from = (f"the file {path} (providers.{name}.api_key_file)" if path is not None
                else f"${section.api_key_env} (providers.{name}.api_key_env)")
    if isinstance(section, SimProvider):
        return LambdaCloud(name="sim", base_url=section.base_url, api_key=api_key, ssh_key_name=section.ssh_key_name,
                           orchestrator_id=orchestrator_id, sink=sink, lists_spot_capacity=section.lists_spot_capacity,
                           key_from=key_from, **tuning)
    return LambdaCloud(name="lambda", base_url=section.base_url, api_key=api_key, ssh_key_name=section.ssh_key_name,
                       regions=section.regions, instance_types=section.instance_types,
                       orchestrator_id=orchestrator_id, sink=sink, key_from=key_from, **tuning)


def key_file_path(section: LambdaProvider | SimProvider, environ: Mapping[str, str] = os.environ) -> Path | None:
    """The section's `api_key_file`, with ~ and $VARS expanded (from `environ`); None without one."""
    if section.api_key_file is None:
        return None
    expanded = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: environ.get(m.group(1), m.group(0)),
                      section.api_key_file)
    return Path(expanded).expanduser()


def read_api_key(section: LambdaProvider | SimProvider, environ: Mapping[str, str] = os.environ) -> str:
    """The section's API key: the first line of its `api_key_file` when it names one, else the environment
    variable it names. AuthFailed saying what is missing or wrong (never a byte of the file)."""
    provider = "sim" if isinstance(section, SimProvider) else "lambda"
    path = key_file_path(section, environ)
    if path is None:
        # Trimmed as a key file's first line is: a key pasted with a space or a newline made every request fail as
        # a connection error (httpx refuses such a header), retried for ever.
        value = environ.get(section.api_key_env, "").strip()
        if not value:
            raise AuthFailed(f"no API key: set the environment variable {section.api_key_env}", provider=provider)
        _sendable(value, f"the environment variable {section.api_key_env}", provider)
        return value
    try:
        mode = path.stat().st_mode
        if mode & 0o077:
            raise AuthFailed(f"the API key file {path} can be read by other users (mode {mode & 0o777:04o}): "
                             "chmod 600 it", provider=provider)
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise AuthFailed(f"cannot read the API key file {path}: {exc.strerror}", provider=provider) from None
    except UnicodeDecodeError:
        raise AuthFailed(f"the API key file {path} is not text", provider=provider) from None
    value = lines[0].strip() if lines else ""
    if not value:
        raise AuthFailed(f"the API key file {path} is empty", provider=provider)
    _sendable(value, f"the API key file {path}", provider)
    return value


def _sendable(key: str, where: str, provider: str) -> None:
    """AuthFailed unless every character of the key can go in an HTTP header (printable ASCII): pasted with curly
    quotes or a zero-width space, the HTTP client raised an error no adapter maps, and the daemon did not start (its
    local jobs with it). Says which character, never the key."""
    for i, ch in enumerate(key):
        if ch < " " or ch >= "\x7f":
            what = f"U+{ord(ch):04X} {unicodedata.name(ch, '')}".rstrip() if ord(ch) > 0x7F else "a control character"
            raise AuthFailed(f"the API key in {where} cannot be sent in an HTTP header: its character {i + 1} is "
                             f"{what} (pasted with quotes?)", provider=provider)


MAX_RETRY_AFTER_S = 300.0  # a Retry-After longer than this is taken as this: a terminate is not held back for hours


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds a Retry-After header asks to wait (a number of seconds or an HTTP date), at most MAX_RETRY_AFTER_S;
    None when there is none or it cannot be read."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds) or seconds <= 0:
        return None
    return min(seconds, MAX_RETRY_AFTER_S)


def parse_gpu_description(text: str) -> tuple[str, float]:
    """'H100 (80 GB SXM5)' -> ('H100', 80.0); 'Tesla V100 (16 GB)' -> ('V100', 16.0)."""
    model = text.split("(")[0].strip().removeprefix("Tesla ").removeprefix("NVIDIA ").strip()
    vram = re.search(r"(\d+(?:\.\d+)?)\s*GB", text)
    return model or text, float(vram.group(1)) if vram else 0.0


def _is_spot(item: Mapping[str, Any] | None) -> bool:
    if not item:
        return False
    return item["instance_type"].get("market") == "spot"


def _on_demand_type(item: Mapping[str, Any]) -> str | None:
    return item["instance_type"].get("on_demand_type")


def _type_for_market(types: Mapping[str, Any], base_type: str, market: Market) -> str | None:
    """The type to launch for `base_type` in `market`: itself on demand, its spot sibling for spot."""
    if base_type not in types:
        return None
    if _is_spot(types[base_type]):  # the caller named the spot type itself
        return base_type if market is Market.SPOT else _on_demand_type(types[base_type])
    if market is Market.ON_DEMAND:
        return base_type
    return next((name for name, item in types.items() if _is_spot(item) and _on_demand_type(item) == base_type), None)


def _capacity_regions(item: Mapping[str, Any]) -> list[str]:
    return [r["name"] for r in item.get("regions_with_capacity_available", [])]


def _tags_from_name(name: str) -> dict[str, str]:
    """The job and attempt an untagged instance's burstctl name says, so that the sweep knows its attempt."""
    m = _NAMED_BY_BURSTCTL.fullmatch(name)
    return {"burstctl:job": m["job"], "burstctl:attempt": m["attempt"]} if m else {}


def _tags(inst: Mapping[str, Any]) -> dict[str, str]:
    return {str(t["key"]): str(t["value"]) for t in inst.get("tags") or [] if "key" in t}


def _live_of_attempt(listed: Sequence[Mapping[str, Any]], attempt_id: str) -> Mapping[str, Any] | None:
    name = f"burst-{attempt_id}"[:64]
    for inst in listed:
        if inst.get("status") in ("terminated", "terminating", "preempted"):
            continue
        if _tags(inst).get("burstctl:attempt") == attempt_id or inst.get("name") == name:
            return inst
    return None


def _gone(instance_id: str) -> InstanceInfo:
    return InstanceInfo(id=instance_id, state=InstanceState.TERMINATED, instance_type="", market=Market.ON_DEMAND,
                        reason="not-found")


def _json_or_none(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None
