"""The month's spend against the cap, said as it goes (`budget.alert_at`): the daemon's sweep emits `budget.crossed`
once for each fraction of the cap the month's spend reaches, the highest first when several are reached at once.
What was said is kept (the setting `budget_alerted`), so a restart does not say it again; a new month, or a new cap,
starts afresh."""

from __future__ import annotations

import time

from orchestrator.app import App
from orchestrator.core.budget import month_key, newly_crossed

SAID_KEY = "budget_alerted"


def alert_if_crossed(app: App, now: float | None = None) -> float | None:
    """Say the highest fraction of the cap this month's spend has newly reached; returns it (None: nothing new)."""
    now = time.time() if now is None else now
    budget = app.config.budget
    if not budget.alert_at:
        return None
    month = month_key(now)
    said = app.store.get_setting(SAID_KEY) or {}
    if said.get("month") != month or said.get("cap_usd") != budget.monthly_cap_usd:
        said = {"month": month, "cap_usd": budget.monthly_cap_usd, "fraction": 0.0}
    spent = app.store.month_spend(month, now)
    crossed = newly_crossed(spent, budget.monthly_cap_usd, budget.alert_at, float(said["fraction"]))
    if crossed is None:
        return None
    with app.store.tx() as conn:  # said and kept together: a daemon killed between them says it once
        app.store.set_setting(SAID_KEY, {**said, "fraction": crossed}, conn)
        app.events.emit("budget.crossed", conn=conn, month=month, fraction=crossed, spent_usd=round(spent, 4),
                        cap_usd=budget.monthly_cap_usd)
    return crossed
