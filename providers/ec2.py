"""AWS EC2 adapter: GPU offers, spot/on-demand launches with zone fallback, and no double launches.

Everything goes through boto3's standard credential chain and endpoint resolution, so `AWS_ENDPOINT_URL`
(or `endpoint_url` in config) points the same code at moto's server. botocore's own retries are switched
off: `providers.base.call()` is the one retry layer, so every retry is bounded, visible as an event, and
preceded by a look-up when a launch may already have taken effect.

Errors are mapped by botocore error *code*; free-text messages are only carried along for humans, with
every known credential value scrubbed out first.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    NoCredentialsError,
    NoRegionError,
    ParamValidationError,
    PartialCredentialsError,
    ProfileNotFound,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from botocore.parsers import ResponseParserError

from orchestrator.config import Ec2Provider
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
from runbooks import s3_checkpoints
from runbooks.s3_checkpoints import S3CheckpointStore

T = TypeVar("T")

PROVIDER_NAME = "ec2"
TAG_ORCHESTRATOR = "burstctl:orchestrator"
TAG_ATTEMPT = "burstctl:attempt"
SPOT_TERMINATION = "Server.SpotInstanceTermination"
# AWS accepts up to 200 values per filter; chunking keeps describe/terminate of long id lists legal.
FILTER_VALUES_MAX = 200
CLIENT_TOKEN_MAX = 64

# --- error codes --------------------------------------------------------------------------------------------
# `Unsupported` is what EC2 says when a type is not offered in the requested zone: for fallback purposes it is
# the same as "no capacity here", so the next type/zone is tried.
CAPACITY_CODES = frozenset({
    "InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientReservedInstanceCapacity",
    "InsufficientCapacity", "Unsupported",
})
QUOTA_CODES = frozenset({
    "InstanceLimitExceeded", "VcpuLimitExceeded", "MaxSpotInstanceCountExceeded", "ResourceLimitExceeded",
    "InsufficientFreeAddressesInSubnet",
})
AUTH_CODES = frozenset({
    "AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "SignatureDoesNotMatch", "OptInRequired",
    "Blocked", "ExpiredToken", "RequestExpired", "PendingVerification", "AccessDenied", "AccessDeniedException",
    "UnrecognizedClientException",
})
THROTTLE_CODES = frozenset({"RequestLimitExceeded", "Throttling", "ThrottlingException", "TooManyRequestsException"})
TRANSIENT_CODES = frozenset({"ServiceUnavailable", "InternalError", "InternalFailure", "Unavailable",
                             "ServerInternal", "RequestTimeout", "RequestTimeoutException"})
NOT_FOUND_INSTANCE = "InvalidInstanceID.NotFound"


# --- GPU families -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuSpec:
    model: str  # normalized short name, as in Offer.gpu_model
    count: int
    vram_gib: float  # per GPU
    vcpus: int


# Used when DescribeInstanceTypes does not know a type (retired types such as p3 in moto) or omits GpuInfo.
# Figures from AWS's accelerated-computing instance pages (GPU memory per GPU, default vCPUs).
GPU_TABLE: dict[str, GpuSpec] = {
    "p3.2xlarge": GpuSpec("V100", 1, 16, 8),
    "p3.8xlarge": GpuSpec("V100", 4, 16, 32),
    "p3.16xlarge": GpuSpec("V100", 8, 16, 64),
    "p3dn.24xlarge": GpuSpec("V100", 8, 32, 96),
    "p4d.24xlarge": GpuSpec("A100", 8, 40, 96),
    "p4de.24xlarge": GpuSpec("A100", 8, 80, 96),
    "p5.48xlarge": GpuSpec("H100", 8, 80, 192),
    "p5e.48xlarge": GpuSpec("H200", 8, 141, 192),
    "g4dn.xlarge": GpuSpec("T4", 1, 16, 4),
    "g4dn.12xlarge": GpuSpec("T4", 4, 16, 48),
    "g5.xlarge": GpuSpec("A10", 1, 24, 4),
    "g5.2xlarge": GpuSpec("A10", 1, 24, 8),
    "g5.12xlarge": GpuSpec("A10", 4, 24, 48),
    "g5.48xlarge": GpuSpec("A10", 8, 24, 192),
    "g6.xlarge": GpuSpec("L4", 1, 24, 4),
    "g6e.xlarge": GpuSpec("L40S", 1, 48, 4),
    "g6e.12xlarge": GpuSpec("L40S", 4, 48, 48),
}

# EC2's GPU names mapped onto the short names the price table and decisions use (A10G is AWS's A10 variant).
GPU_NAME_ALIASES = {"A10G": "A10"}


def normalize_gpu_name(name: str) -> str:
    short = name.upper().removeprefix("NVIDIA").strip()
    return GPU_NAME_ALIASES.get(short, short)


def gpu_spec_from_api(instance_type: dict[str, Any]) -> GpuSpec | None:
    """GpuSpec from one DescribeInstanceTypes entry, or None when it carries no GpuInfo."""
    gpus = (instance_type.get("GpuInfo") or {}).get("Gpus") or []
    if not gpus:
        return None
    first = gpus[0]
    count = sum(int(g.get("Count", 0)) for g in gpus)
    vram_mib = float((first.get("MemoryInfo") or {}).get("SizeInMiB", 0))
    vcpus = int((instance_type.get("VCpuInfo") or {}).get("DefaultVCpus", 0))
    return GpuSpec(normalize_gpu_name(str(first.get("Name", ""))), count, round(vram_mib / 1024, 2), vcpus)


# --- state normalization ------------------------------------------------------------------------------------
def normalize_state(ec2_state: str, reason_code: str, has_address: bool) -> InstanceState:
    """EC2 instance state + StateReason code → the lifecycle's InstanceState."""
    if reason_code == SPOT_TERMINATION and ec2_state in ("shutting-down", "terminated", "stopping", "stopped"):
        return InstanceState.PREEMPTED
    if ec2_state == "pending":
        # An address means the machine is placed and booting; before that the request is still being placed.
        return InstanceState.BOOTING if has_address else InstanceState.PENDING
    if ec2_state == "running":
        return InstanceState.RUNNING
    if ec2_state == "shutting-down":
        return InstanceState.TERMINATING
    if ec2_state == "terminated":
        # Server.* reasons (InternalError, InsufficientInstanceCapacity, ...) mean EC2 ended it, not us.
        return InstanceState.FAILED if reason_code.startswith("Server.") else InstanceState.TERMINATED
    # stopping/stopped: our instances terminate on shutdown, so a stopped one will never run the job.
    return InstanceState.FAILED


def client_token(idempotency_key: str, candidate_index: int) -> str:
    """The RunInstances ClientToken: the key itself for the first choice, a derived one per fallback.

    EC2 rejects a reused token whose parameters differ (IdempotentParameterMismatch), so each type/zone
    candidate gets its own deterministic token; retries of one candidate still share theirs.
    """
    if candidate_index == 0:
        return idempotency_key[:CLIENT_TOKEN_MAX]
    suffix = f"-{candidate_index}"
    return idempotency_key[: CLIENT_TOKEN_MAX - len(suffix)] + suffix


def _chunks(items: Sequence[str], size: int) -> Iterable[list[str]]:
    for start in range(0, len(items), size):
        yield list(items[start:start + size])


# --- the adapter --------------------------------------------------------------------------------------------
class Ec2Adapter:
    """`providers.base.Provider` for AWS EC2."""

    name = PROVIDER_NAME

    def __init__(self, config: Ec2Provider, *, orchestrator_id: str, sink: EventSink | None = None,
                 retry: RetryPolicy | None = None, sleep: Callable[[float], None] = time.sleep,
                 session: boto3.Session | None = None, connect_timeout_s: float = 10.0,
                 read_timeout_s: float = 60.0):
        self.config = config
        self.orchestrator_id = orchestrator_id
        self.sink = sink
        self.retry = retry or RetryPolicy()
        self.sleep = sleep
        try:
            self._session = session or boto3.Session(profile_name=config.profile, region_name=config.region)
        except ProfileNotFound:
            raise AuthFailed(f"AWS profile {config.profile!r} not found in the shared config files",
                             provider=self.name, code="ProfileNotFound") from None
        boto_config = BotoConfig(
            region_name=config.region,
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            # One try per botocore call: call() does the retrying, with look-ups in between for launches.
            retries={"total_max_attempts": 1, "mode": "standard"},
        )
        # endpoint_url=None lets botocore apply AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_EC2 itself.
        self.client = self._session.client("ec2", endpoint_url=config.endpoint_url or None, config=boto_config)
        self._zones: list[str] | None = None
        self._unknown_zones: list[str] = []  # configured zones the region does not have (read with `_zones`)
        # Settings the cloud's answers showed to name nothing usable (a type it does not describe, a zone not in the
        # region), as of the last `offers()`: `burstctl providers` says them. An optional capability (getattr).
        self.config_problems: list[str] = []
        # public key -> the key pair name holding it: one look-up per adapter, not per launch
        self._key_pair_names: dict[str, str] = {}
        self._s3: Any = None
        self._s3_made = threading.Lock()  # the tick and the sync threads may ask for it at once

    # --- checkpoints in S3 (optional; see `checkpoint_bucket`) -----------------------------------------------
    def checkpoint_uri(self, job_id: str) -> str | None:
        """Where the job's instances upload their checkpoints, or None when checkpoints travel over SSH."""
        if not self.config.checkpoint_bucket:
            return None
        prefix = "/".join(p for p in (self.config.checkpoint_prefix.strip("/"), job_id) if p)
        return f"s3://{self.config.checkpoint_bucket}/{prefix}"

    def spot_notice_url(self, instance_id: str) -> str:
        """The instance metadata service's interruption notice, as every EC2 instance reads it."""
        return "http://169.254.169.254/latest/meta-data/spot/instance-action"

    def checkpoint_store(self, job_id: str) -> S3CheckpointStore | None:
        uri = self.checkpoint_uri(job_id)
        if uri is None:
            return None
        with self._s3_made:  # one client per adapter: clients are thread-safe (sessions are not) and costly to build
            if self._s3 is None:
                self._s3 = s3_checkpoints.make_client(self.config.region, self.config.s3_endpoint_url, self._session)
        bucket, prefix = s3_checkpoints.parse_uri(uri)
        return S3CheckpointStore(self._s3, bucket, prefix)

    # --- plumbing ---------------------------------------------------------------------------------------
    def _emit(self, type_: str, **data: Any) -> None:
        if self.sink is not None:
            self.sink(type_, **data)

    def _call(self, verb: str, fn: Callable[[], T]) -> T:
        """One EC2 operation with the taxonomy mapping and base.call()'s bounded retries."""
        return call(self.name, verb, lambda: self._mapped(verb, fn), sink=self.sink, retry=self.retry,
                    sleep=self.sleep)

    def _mapped(self, verb: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except ClientError as exc:
            raise self._from_client_error(verb, exc) from None
        except (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError):
            raise AuthFailed(f"{verb}: no usable AWS credentials in the standard chain", provider=self.name,
                             code="NoCredentials") from None
        except (HTTPClientError, BotoConnectionError) as exc:
            # Connect/read timeouts, refused or dropped connections: the call's effect is unknown. Unless no such
            # region exists: EC2's endpoint for it has no address, and no retry will give it one.
            if self._unknown_region():
                raise InvalidRequest(f"{verb}: providers.{self.name}.region: {self.config.region!r} is not an AWS "
                                     "region this boto3 knows", provider=self.name, code="UnknownRegion") from None
            raise Transient(f"{verb}: {type(exc).__name__} talking to EC2", provider=self.name,
                            code=type(exc).__name__) from None
        except (ParamValidationError, NoRegionError) as exc:
            raise InvalidRequest(f"{verb}: {self._scrub(str(exc))}", provider=self.name,
                                 code=type(exc).__name__) from None
        except BotoCoreError as exc:
            raise Transient(f"{verb}: {type(exc).__name__}", provider=self.name, code=type(exc).__name__) from None
        except ResponseParserError:
            # A body that is not EC2's XML: an HTML 5xx page from a proxy or gateway (or an endpoint that is not
            # EC2's). Not a BotoCoreError, so named here; the page itself is not worth repeating.
            raise Transient(f"{verb}: the endpoint answered something that is not an EC2 response", provider=self.name,
                            code="ResponseParserError") from None

    def _unknown_region(self) -> bool:
        """The configured region is in no partition botocore knows, and no endpoint_url stands in for AWS."""
        if self.config.endpoint_url or os.environ.get("AWS_ENDPOINT_URL"):
            return False
        known = {r for p in self._session.get_available_partitions()
                 for r in self._session.get_available_regions("ec2", partition_name=p)}
        return bool(known) and self.config.region not in known

    def _from_client_error(self, verb: str, exc: ClientError) -> ProviderError:
        error = exc.response.get("Error") or {}
        code = str(error.get("Code") or "")
        status = int((exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
        detail = self._scrub(str(error.get("Message") or ""))[:300]
        message = f"{verb}: {code}" + (f": {detail}" if detail else "")
        kind: type[ProviderError]
        if code in CAPACITY_CODES:
            kind = NoCapacity
        elif code in QUOTA_CODES:
            kind = QuotaExceeded
        elif code in AUTH_CODES:
            # AWS's auth messages may echo the access key id; keep only the code.
            kind, message = AuthFailed, f"{verb}: {code}"
        elif code in THROTTLE_CODES:
            kind = Throttled
        elif code in TRANSIENT_CODES or status >= 500:
            kind = Transient
        else:
            kind = InvalidRequest
        return kind(message, provider=self.name, code=code or None)

    def _secret_values(self) -> list[str]:
        values = {os.environ.get(n, "") for n in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                                   "AWS_SECURITY_TOKEN")}
        try:
            creds = self._session.get_credentials()
            if creds is not None:
                frozen = creds.get_frozen_credentials()
                values |= {frozen.secret_key or "", frozen.token or ""}
        except BotoCoreError:
            pass
        return sorted((v for v in values if len(v) >= 4), key=len, reverse=True)

    def _scrub(self, text: str) -> str:
        for secret in self._secret_values():
            text = text.replace(secret, "***")
        return text

    def _describe_raw(self, verb: str, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        def fetch() -> list[dict[str, Any]]:
            pages = self.client.get_paginator("describe_instances").paginate(Filters=filters)
            return [inst for page in pages for res in page.get("Reservations", []) for inst in res["Instances"]]
        return self._call(verb, fetch)

    def _owner_filter(self) -> dict[str, Any]:
        return {"Name": f"tag:{TAG_ORCHESTRATOR}", "Values": [self.orchestrator_id]}

    def _to_info(self, raw: dict[str, Any]) -> InstanceInfo:
        state_name = str((raw.get("State") or {}).get("Name", ""))
        reason_code = str((raw.get("StateReason") or {}).get("Code") or "")
        private = raw.get("PrivateIpAddress") or None
        host = private if self.config.ssh_address == "private" else (raw.get("PublicIpAddress") or private)
        launch_time = raw.get("LaunchTime")
        return InstanceInfo(
            id=raw["InstanceId"],
            state=normalize_state(state_name, reason_code, host is not None),
            instance_type=str(raw.get("InstanceType", "")),
            market=Market.SPOT if raw.get("InstanceLifecycle") == "spot" else Market.ON_DEMAND,
            region=(raw.get("Placement") or {}).get("AvailabilityZone"),
            reason=reason_code or None,
            host=host,
            ssh_port=self.config.ssh_port,
            ssh_user=self.config.ssh_user,
            tags={t["Key"]: t["Value"] for t in raw.get("Tags") or []},
            launched_at=launch_time.timestamp() if isinstance(launch_time, datetime) else None,
        )

    def zones(self) -> list[str]:
        """Available zones of the region, restricted to and ordered by config `zones` when it is set."""
        if self._zones is None:
            response = self._call("DescribeAvailabilityZones", lambda: self.client.describe_availability_zones(
                Filters=[{"Name": "state", "Values": ["available"]}]))
            available = [z["ZoneName"] for z in response.get("AvailabilityZones", [])]
            wanted = self.config.zones
            self._zones = [z for z in wanted if z in available] if wanted else sorted(available)
            self._unknown_zones = [z for z in wanted if z not in available]
        return list(self._zones)

    # --- offers -----------------------------------------------------------------------------------------
    def offers(self) -> list[Offer]:
        types = list(dict.fromkeys(self.config.instance_types))
        if not types:
            return []
        # A filter (not InstanceTypes=) so a type the API does not know is left out instead of failing the call.
        described = self._call("DescribeInstanceTypes", lambda: self.client.get_paginator(
            "describe_instance_types").paginate(
                Filters=[{"Name": "instance-type", "Values": types}]).build_full_result())
        api_specs = {t["InstanceType"]: spec for t in described.get("InstanceTypes", [])
                     if (spec := gpu_spec_from_api(t)) is not None}
        zones = self.zones()
        problems = [f"providers.{self.name}.zones: {z} is not an available zone of {self.config.region}"
                    for z in self._unknown_zones]
        spot = self._latest_spot_prices(types, zones)
        offers: list[Offer] = []
        for itype in types:
            spec = api_specs.get(itype) or GPU_TABLE.get(itype)
            price = self.config.on_demand_usd_h.get(itype)
            if spec is None or price is None:
                reason = "no GPU info" if spec is None else "no on_demand_usd_h in config"
                self._emit("provider.offer_skipped", provider=self.name, instance_type=itype, reason=reason)
                problems.append(f"providers.{self.name}.instance_types: {itype} is not a GPU type EC2 describes"
                                if spec is None else f"providers.{self.name}.on_demand_usd_h has no price for {itype}")
                continue
            zone_prices = spot.get(itype, {})
            offers.append(Offer(
                provider=self.name, instance_type=itype, gpu_model=spec.model, gpu_count=spec.count,
                vram_gib=spec.vram_gib, vcpus=spec.vcpus, on_demand_usd_h=float(price),
                # The dearest zone's price: launches go to zones in config order, not the cheapest one,
                # so a decision made with this figure is never undercut by where the instance lands.
                spot_usd_h=max(zone_prices.values()) if zone_prices else None,
                regions=tuple(zones),
                billing_minimum_s=60.0, billing_increment_s=1.0,
            ))
        self.config_problems = problems
        return offers

    def _latest_spot_prices(self, types: list[str], zones: list[str]) -> dict[str, dict[str, float]]:
        """{type: {zone: $/h}} from the newest DescribeSpotPriceHistory entry per type and zone."""
        history = self._call("DescribeSpotPriceHistory", lambda: self.client.get_paginator(
            "describe_spot_price_history").paginate(
                InstanceTypes=types, ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
                StartTime=datetime.now(UTC)).build_full_result())
        newest: dict[tuple[str, str], tuple[datetime, float]] = {}
        for entry in history.get("SpotPriceHistory", []):
            key = (entry["InstanceType"], entry["AvailabilityZone"])
            if key[1] not in zones:
                continue
            stamp, price = entry["Timestamp"], float(entry["SpotPrice"])
            if key not in newest or stamp > newest[key][0]:
                newest[key] = (stamp, price)
        out: dict[str, dict[str, float]] = {}
        for (itype, zone), (_, price) in newest.items():
            out.setdefault(itype, {})[zone] = price
        return out

    # --- launch -----------------------------------------------------------------------------------------
    def candidates(self, request: LaunchRequest) -> list[tuple[str, str]]:
        """(instance type, zone) pairs in the order launch tries them: the requested type only, in the requested
        zone or else every zone. Another type is another offer, with its own GPU, memory and price: the daemon
        chooses it (`Reconciler.choose_offer`), so that what runs is what was priced and metered."""
        zones = [request.region] if request.region else self.zones()
        return [(request.instance_type, z) for z in zones]

    def launch(self, request: LaunchRequest) -> InstanceInfo:
        # A previous launch of this attempt may have taken effect without us hearing back (timeout, crash).
        existing = self.find_attempt(request.tags.attempt_id)
        if existing is not None:
            self._emit("provider.launch_found_existing", provider=self.name, instance=existing.id,
                       job_id=request.tags.job_id, attempt_id=request.tags.attempt_id)
            return existing
        key_name = self._ensure_key_pair(request.ssh_key_name or self.config.key_name, request.ssh_public_key)
        candidates = self.candidates(request)
        last_error: NoCapacity | None = None
        for index, (itype, zone) in enumerate(candidates):
            try:
                raw = self._run_instance(request, itype, zone, key_name, client_token(request.idempotency_key, index))
            except NoCapacity as exc:
                last_error = exc
                self._emit("provider.launch_fallback", provider=self.name, instance_type=itype, zone=zone,
                           code=exc.code, job_id=request.tags.job_id, attempt_id=request.tags.attempt_id)
                continue
            info = self._to_info(raw)
            self._emit("provider.launched", provider=self.name, instance=info.id, instance_type=info.instance_type,
                       zone=info.region, market=str(info.market), job_id=request.tags.job_id,
                       attempt_id=request.tags.attempt_id)
            return info
        tried = ", ".join(f"{t}@{z}" for t, z in candidates)
        raise NoCapacity(f"RunInstances: no capacity in any candidate ({tried})", provider=self.name,
                         code=last_error.code if last_error else None)

    def _ensure_key_pair(self, wanted: str, public_key: str) -> str:
        """The name of a key pair holding `public_key`, importing it if needed.

        A key pair of the wanted name holding another key (made by hand, or by another burstctl) is left alone:
        launching with it would give instances nobody here can log into. Ours goes under `<name>-<hash>`.
        """
        if not public_key:
            return wanted  # a key pair managed by hand: trust the configured name
        if public_key in self._key_pair_names:
            return self._key_pair_names[public_key]
        ours = public_key_body(public_key)
        for name in (wanted, key_name_variant(wanted, public_key)):
            held = self._key_pair_public_key(name)
            if held is None:
                try:
                    self._call("ImportKeyPair", partial(self.client.import_key_pair,
                                                        KeyName=name, PublicKeyMaterial=public_key.encode()))
                    break
                except InvalidRequest as dup:
                    if dup.code != "InvalidKeyPair.Duplicate":
                        raise
                    held = self._key_pair_public_key(name)  # imported meanwhile by someone: whose key is it?
            if held is not None and public_key_body(held) == ours:
                break
        else:
            raise InvalidRequest(f"EC2 key pairs {wanted!r} and its variant hold other keys", provider=self.name)
        self._key_pair_names[public_key] = name
        return name

    def _key_pair_public_key(self, name: str) -> str | None:
        """The public key a key pair holds ("" when EC2 does not say), or None when there is no such key pair."""
        # A filter, not KeyNames=[name]: a first launch's expected miss is then an empty list, not an
        # InvalidKeyPair.NotFound error in the trail. The filter takes wildcards, hence the exact match below.
        found = self._call("DescribeKeyPairs", lambda: self.client.describe_key_pairs(
            Filters=[{"Name": "key-name", "Values": [name]}], IncludePublicKey=True))["KeyPairs"]
        held = [str(pair.get("PublicKey", "")) for pair in found if pair.get("KeyName") == name]
        return held[0] if held else None

    def _run_params(self, request: LaunchRequest, itype: str, zone: str, key_name: str,
                    token: str) -> dict[str, Any]:
        tags = [{"Key": k, "Value": v} for k, v in request.tags.as_dict().items()]
        tags.append({"Key": "Name", "Value": request.tags.instance_name})
        params: dict[str, Any] = {
            "ImageId": request.image or self.config.ami,
            "InstanceType": itype,
            "MinCount": 1,
            "MaxCount": 1,
            "KeyName": key_name,
            "ClientToken": token,
            "TagSpecifications": [{"ResourceType": "instance", "Tags": tags},
                                  {"ResourceType": "volume", "Tags": tags}],
            # Our instances never stop: a shutdown from inside ends the bill too.
            "InstanceInitiatedShutdownBehavior": "terminate",
        }
        subnet = self.config.subnet_ids.get(zone)
        if subnet:
            params["SubnetId"] = subnet
        else:
            params["Placement"] = {"AvailabilityZone": zone}
        if self.config.security_group_ids:
            params["SecurityGroupIds"] = list(self.config.security_group_ids)
        if self.config.instance_profile:
            params["IamInstanceProfile"] = {"Name": self.config.instance_profile}
        user_data = request.user_data if request.user_data is not None else self.config.user_data
        if user_data:
            params["UserData"] = user_data
        if request.market is Market.SPOT:
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
        return params

    def _run_instance(self, request: LaunchRequest, itype: str, zone: str, key_name: str,
                      token: str) -> dict[str, Any]:
        params = self._run_params(request, itype, zone, key_name, token)
        ambiguous = False

        def attempt() -> dict[str, Any]:
            nonlocal ambiguous
            if ambiguous:
                # The last try may have launched; EC2 would dedupe by ClientToken, but not every endpoint
                # does (moto does not), so look by tag before launching again.
                found = self._find_attempt_raw(request.tags.attempt_id)
                if found is not None:
                    self._emit("provider.launch_found_existing", provider=self.name, instance=found["InstanceId"],
                               job_id=request.tags.job_id, attempt_id=request.tags.attempt_id)
                    return found
            try:
                response = self._mapped("RunInstances", lambda: self.client.run_instances(**params))
            except Transient:
                ambiguous = True
                raise
            return response["Instances"][0]

        return call(self.name, "RunInstances", attempt, sink=self.sink, retry=self.retry, sleep=self.sleep)

    # --- describe / terminate / list ----------------------------------------------------------------------
    def _raw_by_id(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        # An instance-id *filter* skips unknown ids, where InstanceIds= fails the whole call on one of them.
        for chunk in _chunks(list(dict.fromkeys(ids)), FILTER_VALUES_MAX):
            for raw in self._describe_raw("DescribeInstances", [{"Name": "instance-id", "Values": chunk}]):
                found[raw["InstanceId"]] = raw
        return found

    def describe(self, ids: Sequence[str]) -> dict[str, InstanceInfo]:
        found = self._raw_by_id(ids)
        out: dict[str, InstanceInfo] = {}
        for instance_id in dict.fromkeys(ids):
            raw = found.get(instance_id)
            out[instance_id] = self._to_info(raw) if raw is not None else InstanceInfo(
                id=instance_id, state=InstanceState.TERMINATED, instance_type="", market=Market.ON_DEMAND,
                reason=NOT_FOUND_INSTANCE, ssh_user=self.config.ssh_user)
        return out

    def terminate(self, ids: Sequence[str]) -> None:
        found = self._raw_by_id(ids)
        # Already-terminated and unknown ids are done; a preempted one that is still shutting down is not.
        live = [i for i, raw in found.items() if (raw.get("State") or {}).get("Name") != "terminated"]
        for chunk in _chunks(live, FILTER_VALUES_MAX):
            try:
                self._call("TerminateInstances", partial(self.client.terminate_instances, InstanceIds=chunk))
            except InvalidRequest as exc:
                if exc.code != NOT_FOUND_INSTANCE:
                    raise
                # One of them vanished since describe: terminate the rest one by one, gone ones are done.
                for instance_id in chunk:
                    try:
                        self._call("TerminateInstances",
                                   partial(self.client.terminate_instances, InstanceIds=[instance_id]))
                    except InvalidRequest as single:
                        if single.code != NOT_FOUND_INSTANCE:
                            raise

    def list_owned(self) -> list[InstanceInfo]:
        return [self._to_info(raw) for raw in self._describe_raw("DescribeInstances", [self._owner_filter()])]

    def _find_attempt_raw(self, attempt_id: str) -> dict[str, Any] | None:
        raws = self._describe_raw("DescribeInstances", [
            self._owner_filter(),
            {"Name": f"tag:{TAG_ATTEMPT}", "Values": [attempt_id]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ])
        if not raws:
            return None
        # Two live instances for one attempt should never happen; if it did, keep the oldest one stable.
        return min(raws, key=lambda r: (r.get("LaunchTime") or datetime.max.replace(tzinfo=UTC), r["InstanceId"]))

    def find_attempt(self, attempt_id: str) -> InstanceInfo | None:
        raw = self._find_attempt_raw(attempt_id)
        return self._to_info(raw) if raw is not None else None

