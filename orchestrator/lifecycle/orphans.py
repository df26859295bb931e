"""Instances of ours that no attempt drives: found by the daemon's sweep or by revert-local, terminated, and metered.

An orphan bills like any instance (a launch whose answer was lost, an attempt ended while its instance lived on, a
state restored from an old copy), so the meter counts it: `record_orphan` writes it down as an instance not yet
confirmed gone, with a charge open from when it started; the charge closes when the provider confirms it gone
(`gone.confirmed_gone`), as every instance's does. When it started: the provider's launch time, else (a provider
that does not say, as Lambda's API) the start of the attempt it was launched for, else when it was found; never
before the end of a charge the meter already holds for it. An instance the operator said was gone
(`burstctl confirm-gone`) that its provider lists as running is one too: their word was wrong, and the meter picks
up from where that word ended its charge.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection, func, insert, select, update

from orchestrator.app import App
from orchestrator.core.budget import month_key
from orchestrator.lifecycle.gone import confirmed_gone
from orchestrator.lifecycle.machine import AttemptState
from providers.base import InstanceInfo, Offer, Provider, ProviderError
from state import schema as s

# The setting (per provider) that keeps what the sweep said of a provider it could not list (`_unreachable`).
SWEEP_UNREACHABLE = "sweep.unreachable."


def attempts_of(app: App, owned: list[InstanceInfo]) -> dict[str, dict[str, Any]]:
    """The attempts the instances are tagged with that this database knows, by id (one query for a provider's
    listing)."""
    with app.store.engine.connect() as c:
        return {r["id"]: dict(r) for r in c.execute(select(s.attempts).where(
            s.attempts.c.id.in_([i.attempt_id for i in owned if i.attempt_id]))).mappings()}


def meter_orphan(app: App, provider_name: str, offers: Callable[[], list[Offer]], inst: InstanceInfo,
                 attempt: dict[str, Any] | None, now: float) -> tuple[float | None, float | None]:
    """`record_orphan` at `orphan_rate`, in a transaction of its own: the rate, and when its new charge starts.
    `offers`: the provider's listing, asked at most once a sweep however many orphans it finds."""
    rate = orphan_rate(offers, inst, attempt)
    with app.store.tx() as conn:
        return rate, record_orphan(app, conn, provider_name, inst, attempt, rate, now)


def orphan_rate(offers: Callable[[], list[Offer]], inst: InstanceInfo, attempt: dict[str, Any] | None
                ) -> float | None:
    """Its $/h: its attempt's when it was launched as that attempt's type and market, else the provider's offer for
    its type (its region's when listed); None when the provider cannot say."""
    if attempt is not None and (attempt["instance_type"], attempt["market"]) == (inst.instance_type,
                                                                                 inst.market.value):
        rate = (attempt["info"] or {}).get("rate_usd_h")
        if rate is not None:
            return float(rate)
    try:
        of_type = [o for o in offers() if o.instance_type == inst.instance_type]
    except ProviderError:
        return None
    here = [o for o in of_type if inst.region in o.regions] or of_type
    return here[0].rate_usd_h(inst.market) if here else None


def record_orphan(app: App, conn: Connection, provider_name: str, inst: InstanceInfo,
                  attempt: dict[str, Any] | None, rate: float | None, now: float) -> float | None:
    """Write the orphan down as not yet confirmed gone, and open its charge unless one is open already. Returns the
    time its new charge starts from (None: none opened, as one is open or its rate is unknown)."""
    where = (s.instances.c.provider == provider_name, s.instances.c.id == inst.id)
    if conn.execute(select(s.instances.c.id).where(*where)).first() is None:
        conn.execute(insert(s.instances).values(
            provider=provider_name, id=inst.id, attempt_id=attempt["id"] if attempt else None, state="unverified",
            instance_type=inst.instance_type, market=inst.market.value, rate_usd_h=rate, host=inst.host,
            port=inst.ssh_port, launched_at=inst.launched_at, verified_gone=False))
    else:  # known, and thought gone or going (the operator's word too: `confirm-gone`): it is not, so it is asked
        # after again until it is
        conn.execute(update(s.instances).where(*where).values(state="unverified", verified_gone=False, gone_at=None,
                                                              gone_by=None))
    if rate is None:
        return None
    is_open, metered_to = last_charge(conn, provider_name, inst.id)
    if is_open:
        return None
    started = inst.launched_at if inst.launched_at is not None else (attempt or {}).get("created_at") or now
    started = min(max(started, metered_to or started), now)
    app.store.open_charge({
        "month": month_key(started), "job_id": attempt["job_id"] if attempt else inst.tags.get("burstctl:job"),
        "attempt_id": attempt["id"] if attempt else None, "provider": provider_name, "instance_id": inst.id,
        "instance_type": inst.instance_type, "market": inst.market.value, "rate_usd_h": rate,
        "started_at": started}, conn=conn)
    return started


def last_charge(conn: Connection, provider_name: str, instance_id: str) -> tuple[bool, float | None]:
    """What the meter holds for an instance: whether a charge of it is open, and when its last closed one ended
    (None: none). Read through `ix_ledger_instance` (migration 10), not by scanning months of charges."""
    led = s.ledger
    mine = (led.c.provider == provider_name, led.c.instance_id == instance_id)
    if conn.execute(select(led.c.id).where(*mine, led.c.ended_at.is_(None))).first() is not None:
        return True, None
    return False, conn.execute(select(func.max(led.c.ended_at)).where(*mine)).scalar()


def sweep_orphans(app: App, providers: Mapping[str, Provider], clock: Callable[[], float]) -> dict[str, list[str]]:
    """Every owned instance whose attempt is unknown or over is metered and terminated (a leaked instance is money
    lost). Returns, per provider, the ids terminated; an unreachable provider is reported and skipped."""
    terminated: dict[str, list[str]] = {}
    for name, provider in providers.items():
        try:
            owned = provider.list_owned()
        except ProviderError as exc:
            _unreachable(app, name, exc, clock())
            continue
        if app.store.get_setting(SWEEP_UNREACHABLE + name) is not None:
            app.store.delete_setting(SWEEP_UNREACHABLE + name)  # answered: its next outage is said again
        attempts = attempts_of(app, owned)
        offers = functools.cache(provider.offers)
        for inst in owned:
            if inst.state.gone:
                continue
            att = attempts.get(inst.attempt_id or "")
            if att is not None and not AttemptState(att["state"]).final and att["instance_id"] in (None, inst.id):
                continue  # live: the tick drives it (an intent adopts it by tag)
            rate, since = meter_orphan(app, name, offers, inst, att, clock())
            why = "no attempt" if att is None else f"attempt {att['state']}"
            try:
                provider.terminate([inst.id])
            except ProviderError as exc:
                app.events.emit("instance.orphan_terminate_failed", provider=name, instance=inst.id,
                                error=type(exc).__name__)
                continue
            terminated.setdefault(name, []).append(inst.id)
            app.events.emit("instance.orphan_terminated", provider=name, instance=inst.id,
                            attempt_id=inst.attempt_id, reason=why, rate_usd_h=rate, metered_from=since)
    retry_unverified(app, providers, clock)
    return terminated


def _unreachable(app: App, name: str, exc: ProviderError, now: float) -> None:
    """A provider the sweep could not list: said once an outage (`provider.unreachable`), and again for another
    kind of error, not every sweep (a key refused for a day was 720 events of it). What was said is kept in a setting
    until a sweep lists the provider again, so a restarted daemon does not say it again either."""
    error = type(exc).__name__
    said = app.store.get_setting(SWEEP_UNREACHABLE + name)
    if isinstance(said, dict) and said.get("error") == error:
        return
    with app.store.tx() as conn:
        app.store.set_setting(SWEEP_UNREACHABLE + name, {"error": error, "since": now}, conn)
        app.events.emit("provider.unreachable", provider=name, error=error, during="sweep", conn=conn)


def retry_unverified(app: App, providers: Mapping[str, Provider], clock: Callable[[], float]) -> None:
    """Instances not yet confirmed gone (an orphan just terminated, or one revert-local left while its cloud was
    unreachable) are terminated again and asked after, every sweep; confirmed gone, their charges close."""
    with app.store.engine.connect() as c:
        pending = [dict(r) for r in c.execute(select(s.instances).where(s.instances.c.state == "unverified"))
                   .mappings()]
    for inst in pending:
        provider = providers.get(inst["provider"])
        outcome = "provider unavailable"
        if provider is not None:
            try:
                provider.terminate([inst["id"]])
                seen = provider.describe([inst["id"]]).get(inst["id"])
                if seen is None or seen.state.gone:
                    with app.store.tx() as c:  # and what waited for it goes on (an attempt revert-local released)
                        confirmed_gone(app, c, inst["provider"], inst["id"], gone_at=clock(), now=clock())
                    outcome = "gone"
                else:
                    outcome = seen.state.value
            except ProviderError as exc:
                outcome = type(exc).__name__
        app.events.emit("instance.terminate_retry", provider=inst["provider"], instance=inst["id"],
                        outcome=outcome)
