"""How long the events table keeps a finished job's history: `burstctl prune-events` and `state.events_keep_days`.

The events table is the trail: every decision, launch, sync and provider retry, some 130 rows per cloud job, and it
is never read back by the daemon for a job that is over. Months of it make a database of gigabytes. What is
pruned is only the events of jobs finished (done, failed, cancelled, rethink) and last changed longer ago than the
limit, with nothing of theirs still live (an attempt not over, an instance not confirmed gone, an open ledger
charge), and the events of no job (daemon, provider, sweep) as old. The jobs, attempts, instances, the ledger (the
month's spend and the budget cap are computed from it alone), measurements, spot listings and decision records
(markdown files) are never touched.
"""

from __future__ import annotations

import time

from orchestrator.app import App
from orchestrator.lifecycle.machine import ACTIVE_ATTEMPT_STATES
from orchestrator.lifecycle.states import FINAL
from state.store import PruneCounts

DAY_S = 86400.0
PRUNED_AT = "events_pruned_at"  # settings key: when the daemon last pruned (it prunes at most once a day)


def prune_events(app: App, older_than_days: float, now: float | None = None) -> PruneCounts:
    now = time.time() if now is None else now
    cutoff = now - older_than_days * DAY_S
    done = app.store.prune_events(cutoff, final_states=sorted(st.value for st in FINAL),
                                  active_attempt_states=ACTIVE_ATTEMPT_STATES)
    app.store.set_setting(PRUNED_AT, now)
    return done


def prune_if_due(app: App, now: float | None = None) -> PruneCounts | None:
    """The daemon's sweep: prune by `state.events_keep_days` once a day (never with it unset)."""
    keep = app.config.state.events_keep_days
    now = time.time() if now is None else now
    if keep is None or now - float(app.store.get_setting(PRUNED_AT, 0.0)) < DAY_S:
        return None
    done = prune_events(app, keep, now)
    if done["events"]:
        app.events.emit("state.events_pruned", older_than_days=keep, **done)
    return done
