"""Wiring for the daemon and one-shot commands: the reconciler with the configured providers and SSH steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import func, select

from orchestrator.app import App
from orchestrator.lifecycle.machine import ACTIVE_ATTEMPT_STATES
from orchestrator.lifecycle.reconcile import Reconciler
from orchestrator.lifecycle.states import JobState
from providers.registry import build, usable
from state import schema as s


def build_reconciler(app: App, before: Reconciler | None = None, clock: Callable[[], float] = time.time
                     ) -> Reconciler:
    """The reconciler for `app`'s config. An enabled provider that cannot be used is said (`provider.unavailable`),
    unless `before` (the reconciler a config reload replaces) already had it unusable for the same reason."""
    from orchestrator.lifecycle.cloud_steps import CloudSteps
    from orchestrator.remote import sync

    sync.record_transfers_in(transfers_dir(app))  # a process killed outright leaves its rsyncs to the next daemon
    slots = build(app.config, orchestrator_id=app.orchestrator_id, sink=app.events.provider_sink)
    unavailable = {slot.name: slot.problem or "" for slot in slots.values() if slot.enabled and slot.provider is None}
    said = before.unavailable if before is not None else {}
    for name, problem in unavailable.items():
        if said.get(name) != problem:
            app.events.emit("provider.unavailable", provider=name, problem=problem)
    providers = usable(slots)
    reconciler = Reconciler(app, providers, cloud=CloudSteps(app, providers) if providers else None, clock=clock)
    reconciler.unavailable = unavailable
    return reconciler


def transfers_dir(app: App) -> Path:
    """Where the running transfers (rsync) of this state's processes are written down (`sync.record_transfers_in`)."""
    return app.config.state_dir / "transfers"


def has_active_work(app: App) -> bool:
    """Anything still to do: an active attempt, or a job waiting to run."""
    with app.store.engine.connect() as c:
        attempts = c.execute(select(func.count()).select_from(s.attempts)
                             .where(s.attempts.c.state.in_(ACTIVE_ATTEMPT_STATES))).scalar()
        jobs = c.execute(select(func.count()).select_from(s.jobs).where(s.jobs.c.state.in_(
            [JobState.QUEUED.value, JobState.RESUMING.value, JobState.RUNNING.value]))).scalar()
    return bool(attempts or jobs)
