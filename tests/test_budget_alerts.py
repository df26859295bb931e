"""The month's spend against the cap, said as it goes: once for each fraction of the cap reached (`budget.alert_at`),
the highest when several are reached at once, never again after a restart, afresh in a new month or with a new cap."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orchestrator.app import App
from orchestrator.budget_alerts import alert_if_crossed
from orchestrator.core.budget import month_key, newly_crossed
from orchestrator.notify import notice_text


@pytest.mark.parametrize(("spent", "said", "crossed"), [
    (4.99, 0.0, None), (5.0, 0.0, 0.5), (9.0, 0.0, 0.8), (9.0, 0.5, 0.8), (9.0, 0.8, None), (15.0, 0.8, 1.0),
    (15.0, 1.0, None),
])
def test_the_highest_fraction_reached_is_said_once(spent: float, said: float, crossed: float | None) -> None:
    assert newly_crossed(spent, 10.0, [0.5, 0.8, 1.0], said) == crossed


def test_no_cap_no_fractions_nothing_to_say() -> None:
    assert newly_crossed(5.0, 0.0, [0.5], 0.0) is None and newly_crossed(5.0, 10.0, [], 0.0) is None


def _app(tmp_path: Path, budget: str = "") -> App:
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text(f"[budget]\nmonthly_cap_usd = 10.0\n{budget}")
    return App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))


def _spend(app: App, usd: float, at: float) -> None:
    charge = app.store.open_charge({"month": month_key(at), "job_id": None, "attempt_id": None, "provider": "sim",
                                    "instance_id": f"i-{at}", "instance_type": "gpu_1x_h100", "market": "spot",
                                    "rate_usd_h": usd, "started_at": at - 3600})
    app.store.close_charge(charge, ended_at=at, billed_seconds=3600, cost_usd=usd)


def test_the_daemon_says_each_fraction_of_the_cap_once_and_afresh_each_month(tmp_path: Path) -> None:
    app = _app(tmp_path)
    now = time.time()
    assert alert_if_crossed(app, now) is None
    _spend(app, 5.5, now)
    assert alert_if_crossed(app, now) == 0.5
    assert alert_if_crossed(app, now + 1) is None
    app.close()
    app = _app(tmp_path)  # a restarted daemon does not say it again
    assert alert_if_crossed(app, now + 2) is None
    _spend(app, 5.0, now)  # 10.5 of 10: 0.8 and 1.0 at once, said as the one that matters
    assert alert_if_crossed(app, now + 3) == 1.0
    (said, *_) = reversed(app.store.events(type_prefix="budget."))
    assert said["data"] == {"month": month_key(now), "fraction": 1.0, "spent_usd": 10.5, "cap_usd": 10.0}
    assert notice_text("budget.crossed", said["data"], None) == \
        f"burstctl: 100% of {month_key(now)}'s cloud budget spent ($10.50 of $10.00)"
    assert [e["data"]["fraction"] for e in app.store.events(type_prefix="budget.")] == [0.5, 1.0]
    next_month = now + 32 * 86400
    assert alert_if_crossed(app, next_month) is None  # nothing spent yet this month
    _spend(app, 8.0, next_month)
    assert alert_if_crossed(app, next_month) == 0.8
    app.close()
    app = _app(tmp_path, "alert_at = [0.9]\n")  # fractions of its own
    assert alert_if_crossed(app, next_month) is None
    _spend(app, 1.5, next_month)
    assert alert_if_crossed(app, next_month) == 0.9
    app.close()


def test_a_new_cap_starts_afresh_and_an_empty_alert_at_says_nothing(tmp_path: Path) -> None:
    app = _app(tmp_path)
    now = time.time()
    _spend(app, 9.0, now)
    assert alert_if_crossed(app, now) == 0.8
    app.close()
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text("[budget]\nmonthly_cap_usd = 30.0\n")
    app = App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))
    assert alert_if_crossed(app, now) is None  # 9 of 30 is under half
    _spend(app, 7.0, now)
    assert alert_if_crossed(app, now) == 0.5
    app.close()
    app = _app(tmp_path, "alert_at = []\n")
    _spend(app, 100.0, now)
    assert alert_if_crossed(app, now) is None
    app.close()
