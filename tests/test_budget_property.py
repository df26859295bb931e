"""The budget property: whatever the sequence of launches, prices, billing minimums, preemptions, daemon crashes and
month boundaries, the month-to-date spend never exceeds `budget.monthly_cap_usd`.

Driven through the real parts: the reconciler's launch gate (`BudgetGuard.problem`, what
`_start_cloud_attempt` asks before writing an intent), its running guard (`Reconciler.stop_reason`, asked every
tick), the store's ledger (`open_charge`) and the reconciler's charge closing (`_close_instance`: billing minimum,
billed seconds), all on a real SQLite database with an injected clock. The world around them is a small model:
a stop takes effect within two ticks (SIGTERM, last sync, terminate); a crashed daemon is back within 110 s (the
guard's horizon reserves 120 s, see `BudgetGuard.horizon_h`).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert

from orchestrator.app import App
from orchestrator.core.budget import month_key
from orchestrator.lifecycle.reconcile import Reconciler
from state import schema as s

TICK_S = 5.0
TEARDOWN_S = 2 * TICK_S  # from the stop decision to the instance confirmed gone
# An hour before a month ends, so runs cross the boundary (charges count against the month they opened in).
START = datetime(2026, 1, 31, 23, 0, tzinfo=UTC).timestamp()

launch = st.tuples(st.just("launch"), st.floats(0.2, 40.0), st.sampled_from([0.0, 60.0, 600.0, 3600.0]),
                   st.floats(0.0, 4.0))
tick = st.tuples(st.just("tick"), st.floats(0.1, TICK_S))
preempt = st.tuples(st.just("preempt"), st.integers(0, 20))
crash = st.tuples(st.just("crash"), st.floats(0.0, 110.0))
long_run = st.tuples(st.just("ticks"), st.integers(1, 200))  # many ticks in a row: hours go by
ops = st.lists(st.one_of(launch, tick, tick, preempt, crash, long_run), min_size=1, max_size=60)


@dataclass
class World:
    reconciler: Reconciler
    clock: list[float]
    live: dict[str, dict[str, Any]] = field(default_factory=dict)  # attempt id → attempt row
    stopping: dict[str, float] = field(default_factory=dict)  # attempt id → when its instance is gone
    n: int = 0

    @property
    def now(self) -> float:
        return self.clock[0]

    def launch(self, rate: float, minimum_s: float, expected_h: float) -> None:
        r = self.reconciler
        if r.budget.problem(self.now, rate_usd_h=rate, minimum_s=minimum_s, expected_h=expected_h) is not None:
            return
        self.n += 1
        att = {"id": f"j{self.n}-a1", "job_id": f"j{self.n}", "n": 1, "where": "cloud", "state": "running",
               "provider": "sim", "instance_type": "gpu", "market": "spot", "idempotency_key": f"k{self.n}",
               "info": {"rate_usd_h": rate, "billing_minimum_s": minimum_s}, "created_at": self.now,
               "started_at": self.now, "instance_id": f"i-{self.n}"}
        with r.store.tx() as conn:
            conn.execute(insert(s.jobs).values(
                id=att["job_id"], name=att["job_id"], kind="train", state="running", verdict="burst",
                placement="cloud", approved=True, spec={}, decision={}, deadline_at=self.now + 86400,
                created_at=self.now, updated_at=self.now))
            conn.execute(insert(s.attempts).values(**att))
            r.store.open_charge({"month": month_key(self.now), "job_id": att["job_id"], "attempt_id": att["id"],
                                 "provider": "sim", "instance_id": att["instance_id"], "instance_type": "gpu",
                                 "market": "spot", "rate_usd_h": rate, "started_at": self.now}, conn=conn)
        self.live[att["id"]] = att

    def close(self, attempt_id: str) -> None:
        att = self.live.pop(attempt_id)
        self.stopping.pop(attempt_id, None)
        with self.reconciler.store.tx() as conn:
            self.reconciler._close_instance(conn, att, att["instance_id"], self.now)

    def tick(self, dt: float) -> None:
        """The clock moves on; the daemon confirms finished stops, then asks the guard about every live attempt."""
        self.clock[0] += dt
        for attempt_id, gone_at in list(self.stopping.items()):
            if self.now >= gone_at:
                self.close(attempt_id)
        job = {"state": "running", "spec": {}}
        for attempt_id, att in self.live.items():
            if attempt_id not in self.stopping and self.reconciler.stop_reason(att, job) == "budget-cap":
                self.stopping[attempt_id] = self.now + TEARDOWN_S

    def crash(self, down_s: float) -> None:
        """No daemon for `down_s`: nothing is decided; instances already told to stop do stop at the cloud, but
        the ledger only closes them when the next daemon confirms it."""
        self.clock[0] += down_s
        for attempt_id in self.stopping:
            self.stopping[attempt_id] = self.now  # confirmed at the next tick

    def spent_by_month(self) -> dict[str, float]:
        """What the provider would charge so far: closed charges at cost, open ones for the time they ran."""
        out: dict[str, float] = {}
        for r in self.reconciler.store.ledger_rows():
            cost = r["cost_usd"] if r["cost_usd"] is not None else r["rate_usd_h"] * (self.now - r["started_at"]) / 3600
            out[r["month"]] = out.get(r["month"], 0.0) + cost
        return out


def make_world(state_dir: Path, cap: float) -> World:
    config = state_dir / "burstctl.toml"
    config.write_text(f"[budget]\nmonthly_cap_usd = {cap}\n\n[daemon]\ntick_s = {TICK_S}\n")
    app = App(config_path=str(config), state_dir_override=str(state_dir / "state"))
    clock = [START]
    return World(Reconciler(app, {}, clock=lambda: clock[0]), clock)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cap=st.floats(0.5, 60.0), steps=ops)
def test_month_to_date_spend_never_exceeds_the_cap(cap: float, steps: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        world = make_world(Path(tmp), cap)
        try:
            for op, *args in steps:
                if op == "launch":
                    world.launch(*args)
                elif op == "tick":
                    world.tick(args[0])
                elif op == "ticks":
                    for _ in range(args[0]):
                        world.tick(TICK_S)
                elif op == "preempt" and world.live:
                    world.close(sorted(world.live)[args[0] % len(world.live)])
                elif op == "crash":
                    world.crash(args[0])
                for month, spent in world.spent_by_month().items():
                    assert spent <= cap + 1e-9, f"{month}: ${spent:.4f} spent, cap ${cap:.2f} (after {op} {args})"
            # The daemon runs on until every stop has gone through; then everyone stops what is left.
            for _ in range(int(TEARDOWN_S / TICK_S) + 1):
                world.tick(TICK_S)
            for attempt_id in list(world.live):
                world.close(attempt_id)
            for month, spent in world.spent_by_month().items():
                assert spent <= cap + 1e-9, f"{month}: ${spent:.4f} billed in the end, cap ${cap:.2f}"
        finally:
            world.reconciler.app.close()


def test_a_launch_whose_billing_minimum_alone_would_cross_the_cap_is_refused(tmp_path: Path) -> None:
    world = make_world(tmp_path, cap=1.0)
    try:
        # $30/h for an hour's minimum is $30: far over a $1 cap even if the job would need only a minute.
        problem = world.reconciler.budget.problem(world.now, rate_usd_h=30.0, minimum_s=3600.0, expected_h=0.01)
        assert problem is not None and problem.startswith("budget:")
        assert world.reconciler.budget.problem(world.now, rate_usd_h=3.0, minimum_s=60.0, expected_h=0.1) is None
    finally:
        world.reconciler.app.close()


def test_an_open_charge_still_counts_against_its_month_after_the_calendar_moves_on(tmp_path: Path) -> None:
    world = make_world(tmp_path, cap=5.0)
    try:
        world.launch(rate=3.0, minimum_s=0.0, expected_h=0.5)
        assert world.live, "the launch fits the cap"
        month = month_key(world.now)
        ticks = 0
        while world.live and ticks < 2000:  # 3 $/h against $5: stopped before 100 minutes, across the month's end
            world.tick(TICK_S)
            ticks += 1
        assert not world.live and month_key(world.now) != month
        assert world.spent_by_month()[month] <= 5.0
    finally:
        world.reconciler.app.close()
