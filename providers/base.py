"""The one interface every cloud adapter implements, and the one error taxonomy the lifecycle sees.

An adapter is a small module with one method per lifecycle verb: offers, launch, describe, terminate,
list_owned. It maps its vendor's error *codes* to the taxonomy below, so the lifecycle never parses a
vendor's strings. Throttled and Transient calls are retried here (bounded, jittered); nothing else is.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    stop_any,
    wait_random_exponential,
)
from tenacity.stop import stop_base

T = TypeVar("T")


# --- error taxonomy ---------------------------------------------------------------------------------------
class ProviderError(Exception):
    """Base of the taxonomy. `code` is the vendor's error code (never its free-text message); `retry_after_s`, how
    long the provider asked to be left alone (its Retry-After), when it said."""

    retryable = False

    def __init__(self, message: str, *, provider: str = "", code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.provider = provider
        self.code = code
        self.retry_after_s = retry_after_s


class NoCapacity(ProviderError):
    """No capacity for this type/market in this region or zone now; try another or wait."""


class QuotaExceeded(ProviderError):
    """An account limit blocks the launch; retrying will not help."""


class AuthFailed(ProviderError):
    """Credentials missing, wrong or without permission."""


class Throttled(ProviderError):
    """Rate limited; retried with backoff."""

    retryable = True


class Transient(ProviderError):
    """5xx, timeout or connection failure; retried with backoff. The effect of the call is unknown (but for a request
    an adapter held back until a 5xx's Retry-After is up: not sent). A 5xx with a Retry-After carries it in
    `retry_after_s`: the provider answered that it is unavailable until then."""

    retryable = True


class InvalidRequest(ProviderError):
    """The request is wrong (unknown type, bad parameter); a bug or a config error."""


# A launch refused outright: no instance exists, and retrying the same call now will not change that.
LAUNCH_REFUSALS = (NoCapacity, QuotaExceeded, AuthFailed, InvalidRequest)
TAXONOMY = (*LAUNCH_REFUSALS, Throttled, Transient)


def category(exc: ProviderError) -> str:
    """The taxonomy's name for an error (a subclass an adapter may define is told as the kind it is): what the
    lifecycle records and reads back, never the vendor's words."""
    return next((kind.__name__ for kind in TAXONOMY if isinstance(exc, kind)), type(exc).__name__)


# --- data -------------------------------------------------------------------------------------------------
class Market(StrEnum):
    SPOT = "spot"
    ON_DEMAND = "on-demand"


class InstanceState(StrEnum):
    PENDING = "pending"
    BOOTING = "booting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    TERMINATING = "terminating"
    TERMINATED = "terminated"
    FAILED = "failed"

    @property
    def gone(self) -> bool:
        return self in (InstanceState.PREEMPTED, InstanceState.TERMINATED, InstanceState.FAILED)


@dataclass(frozen=True)
class Offer:
    provider: str
    instance_type: str
    gpu_model: str  # normalized short name: H100, A100, A10, V100, ...
    gpu_count: int
    vram_gib: float  # per GPU
    vcpus: int
    on_demand_usd_h: float  # per instance
    spot_usd_h: float | None  # per instance; None when there is no spot market
    regions: tuple[str, ...]  # regions/zones with capacity now
    billing_minimum_s: float = 60.0
    billing_increment_s: float = 1.0
    # Regions/zones where spot has capacity now, when the provider lists it (a Lambda-style capacity listing);
    # None when it cannot tell without launching (EC2). Lets the daemon see spot come back while it runs elsewhere.
    spot_regions: tuple[str, ...] | None = None
    # Regions/zones where on-demand has capacity now, when the provider lists each market's apart (Lambda); None
    # when it cannot tell (EC2: every zone, whatever its capacity).
    on_demand_regions: tuple[str, ...] | None = None

    def price(self, market: Market) -> float | None:
        return self.spot_usd_h if market is Market.SPOT else self.on_demand_usd_h

    def rate_usd_h(self, market: Market) -> float:
        """What an instance of this offer on `market` is billed per hour (on-demand's rate without a spot price)."""
        return self.price(market) or self.on_demand_usd_h

    def capacity_regions(self, market: Market) -> tuple[str, ...]:
        """Regions with capacity now on `market`: that market's own listing where the provider has one, else
        `regions` (either market's, or every zone where only a launch can tell)."""
        listed = self.spot_regions if market is Market.SPOT else self.on_demand_regions
        return self.regions if listed is None else listed


@dataclass(frozen=True)
class OwnerTags:
    orchestrator: str
    job_id: str
    attempt_id: str

    def as_dict(self) -> dict[str, str]:
        return {"burstctl:orchestrator": self.orchestrator, "burstctl:job": self.job_id,
                "burstctl:attempt": self.attempt_id}

    @property
    def instance_name(self) -> str:
        # Deterministic name, for providers without idempotency keys (find by name after a timeout).
        return f"burst-{self.attempt_id}"[:64]


@dataclass(frozen=True)
class LaunchRequest:
    instance_type: str
    market: Market
    tags: OwnerTags
    idempotency_key: str  # derived from the attempt id
    ssh_public_key: str  # OpenSSH public key line
    ssh_key_name: str | None = None
    region: str | None = None  # None: the adapter chooses among regions with capacity, in config order
    # Regions to try first, in this order, before the others in config order (`orchestrator.core.zones`: for spot,
    # the region whose capacity has been listed longest). Adapters with one region ignore it.
    region_order: tuple[str, ...] = ()
    image: str | None = None
    user_data: str | None = None


@dataclass(frozen=True)
class InstanceInfo:
    id: str
    state: InstanceState
    instance_type: str
    market: Market
    region: str | None = None
    reason: str | None = None  # the provider's reason for the state (e.g. Server.SpotInstanceTermination)
    host: str | None = None
    ssh_port: int = 22
    ssh_user: str = "ubuntu"
    host_key: str | None = None  # "ssh-ed25519 AAAA..." when the provider pins it
    tags: dict[str, str] = field(default_factory=dict)
    launched_at: float | None = None

    @property
    def attempt_id(self) -> str | None:
        return self.tags.get("burstctl:attempt")


class Provider(Protocol):
    """The lifecycle's one view of a cloud. Optional capabilities, looked up with getattr: `checkpoint_store(job_id)`
    → an `S3CheckpointStore` the job's instances upload to (EC2 with `checkpoint_bucket`), or None; and
    `spot_notice_url(instance_id)` → where an instance polls for its spot interruption notice (EC2's semantics)."""

    name: str

    def offers(self) -> list[Offer]: ...

    def launch(self, request: LaunchRequest) -> InstanceInfo: ...

    def describe(self, ids: Sequence[str]) -> dict[str, InstanceInfo]:
        """Instances by id. An id the provider no longer knows maps to state TERMINATED."""
        ...

    def terminate(self, ids: Sequence[str]) -> None:
        """Idempotent: terminating an instance that is already gone is success."""
        ...

    def list_owned(self) -> list[InstanceInfo]:
        """Every instance carrying this orchestrator's tags or names, including terminated-but-visible ones."""
        ...

    def find_attempt(self, attempt_id: str) -> InstanceInfo | None:
        """The live instance of an attempt, if one exists (look up before any second launch)."""
        ...


def public_key_body(public_key: str) -> str:
    """'ssh-ed25519 AAAA... comment' -> 'ssh-ed25519 AAAA...': comments do not make a different key."""
    return " ".join(public_key.split()[:2])


def key_name_variant(name: str, public_key: str) -> str:
    """Where our key goes when another key already holds `name`: `<name>-<hash of our key>`, stable per key."""
    return f"{name}-{hashlib.sha256(public_key_body(public_key).encode()).hexdigest()[:10]}"[:64]


# --- calls: retry + one structured event each ---------------------------------------------------------------
EventSink = Callable[..., Any]  # emit(type, **data)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    max_total_s: float = 60.0
    initial_s: float = 0.5
    max_wait_s: float = 10.0


def call(provider: str, verb: str, fn: Callable[[], T], *, sink: EventSink | None = None,
         retry: RetryPolicy = RetryPolicy(), sleep: Callable[[float], None] = time.sleep) -> T:
    """Run one provider call with bounded retries for Throttled/Transient, emitting `provider.call`."""
    started = time.monotonic()
    tries = 0

    def _before_sleep(state: RetryCallState) -> None:
        if sink is not None and state.outcome is not None:
            exc = state.outcome.exception()
            sink("provider.retry", provider=provider, call=verb, attempt=state.attempt_number,
                 error=type(exc).__name__, code=getattr(exc, "code", None))

    backoff = wait_random_exponential(multiplier=retry.initial_s, max=retry.max_wait_s)

    def _wait(state: RetryCallState) -> float:
        # The provider's Retry-After is a floor: a try sooner is refused again, and prolongs the throttling.
        return max(backoff(state), _retry_after(state) or 0.0)

    retrying = Retrying(
        retry=retry_if_exception_type((Throttled, Transient)),
        stop=stop_any(stop_after_attempt(retry.attempts), stop_after_delay(retry.max_total_s),
                      _RetryAfterBeyond(retry)),
        wait=_wait,
        reraise=True,
        sleep=sleep,
        before_sleep=_before_sleep,
    )
    outcome = "ok"
    error: ProviderError | None = None
    try:
        for attempt in retrying:
            with attempt:
                tries += 1
                return fn()
    except ProviderError as exc:
        outcome = type(exc).__name__
        error = exc
        raise
    finally:
        if sink is not None:
            data: dict[str, Any] = {"provider": provider, "call": verb, "outcome": outcome, "tries": tries,
                                    "duration_s": round(time.monotonic() - started, 4)}
            if error is not None and error.code:
                data["code"] = error.code
            sink("provider.call", **data)
    raise AssertionError("unreachable")  # pragma: no cover


class _RetryAfterBeyond(stop_base):
    """Stop when the provider's Retry-After is longer than one wait of the policy, or reaches past what the call may
    take: it is not slept through here, holding up the daemon's tick; the caller (its next tick) asks again later."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy

    def __call__(self, retry_state: RetryCallState) -> bool:
        after = _retry_after(retry_state)
        return after is not None and (after > self.policy.max_wait_s or
                                      (retry_state.seconds_since_start or 0.0) + after > self.policy.max_total_s)


def _retry_after(state: RetryCallState) -> float | None:
    exc = state.outcome.exception() if state.outcome is not None else None
    return exc.retry_after_s if isinstance(exc, ProviderError) else None
