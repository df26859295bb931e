"""Months of history: what an operator's commands and the store read must not grow with every event ever kept, and
the history can be pruned without touching what a live job, the budget's meter or a decision record needs.

Costs are counted, not timed: SQLite's virtual-machine steps (a progress handler called every 100 instructions)
for the same read against a history ten times longer (benchmarks/history.py has the seconds)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import event, insert

from orchestrator.app import App
from state import schema as s
from state.store import Store


def _vm_steps(store: Store) -> Callable[[Callable[[], Any]], tuple[int, Any]]:
    """`count(fn)`: run fn and return (SQLite VM steps / 100 it cost, its result)."""
    steps = [0]

    def tick() -> int:
        steps[0] += 1
        return 0

    event.listen(store.engine, "connect", lambda conn, _rec: conn.set_progress_handler(tick, 100))
    store.engine.dispose()  # every connection from now on counts

    def count(fn: Callable[[], Any]) -> tuple[int, Any]:
        steps[0] = 0
        result = fn()
        return steps[0], result

    return count


def _history(store: Store, n: int, start_id: int) -> None:
    """n ordinary events (checkpoints synced by finished jobs), in one statement."""
    with store.tx() as c:
        c.execute(insert(s.events), [{"id": start_id + k, "ts": 1000.0 + k, "type": "checkpoint.synced",
                                      "job_id": f"j{k % 500}", "attempt_id": None, "data": {"k": k}}
                                     for k in range(n)])


def test_reading_the_newest_events_of_a_rare_type_costs_the_same_after_ten_times_the_history(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'h.db'}")
    count = _vm_steps(store)
    _history(store, 2_000, 1)
    rare = [store.append_event("instance.orphan_terminated", {"n": k}) for k in range(3)]
    small, got = count(lambda: store.events(type_prefix="instance.orphan", newest=2))
    assert [e["id"] for e in got] == rare[1:]
    _history(store, 18_000, rare[-1] + 1)
    large, got = count(lambda: store.events(type_prefix="instance.orphan", newest=2))
    assert [e["id"] for e in got] == rare[1:]
    assert large <= small + 5, (small, large)  # a scan of the history took ~10x the steps
    # A prefix still means a prefix, and ids stay in order across the types it matches.
    both = store.events(type_prefix="instance.", newest=10)
    assert [e["type"] for e in both] == ["instance.orphan_terminated"] * 3
    assert [e["id"] for e in store.events(type_prefix="checkpoint", newest=3)] == [
        rare[-1] + 18_000 - 2, rare[-1] + 18_000 - 1, rare[-1] + 18_000]
    assert [e["id"] for e in store.events(type_prefix="instance.orph", after_id=rare[0])] == rare[1:]
    store.close()


def _app(tmp_path: Path, extra: str = "") -> App:
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text(extra)
    return App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))


def test_events_prints_the_newest_100_unless_asked_for_more_and_all_of_them_with_all(burstctl, tmp_path: Path
                                                                                      ) -> None:
    app = _app(tmp_path)
    with app.store.tx() as c:
        c.execute(insert(s.events), [{"ts": 1000.0 + k, "type": "daemon.started", "job_id": None, "attempt_id": None,
                                      "data": {"k": k}} for k in range(250)])
    app.close()
    shown = burstctl("events", "--json")
    assert [json.loads(line)["k"] for line in shown.stdout.splitlines()] == list(range(150, 250))
    assert "--all" in shown.stderr  # says there is more
    assert len(burstctl("events", "--json", "--limit", "300").stdout.splitlines()) == 250
    every = burstctl("events", "--json", "--all")
    assert [json.loads(line)["k"] for line in every.stdout.splitlines()] == list(range(250))
    assert every.stderr == ""


def test_list_shows_every_live_job_and_only_the_newest_finished_ones_unless_all(burstctl, tmp_path: Path) -> None:
    app = _app(tmp_path)
    now = time.time()
    spec = {"name": "x"}
    decision = {"verdict": "burst", "action": "burst", "reasons": []}
    rows = [{"id": f"j{k:03d}", "name": f"job-{k}", "kind": "train", "state": "done" if k < 30 else "queued",
             "verdict": "burst", "placement": "cloud", "approved": False, "spec": spec, "decision": decision,
             "deadline_at": now + 86400, "created_at": now - 1000 + k, "updated_at": now - 1000 + k}
            for k in range(35)]
    with app.store.tx() as c:
        c.execute(insert(s.jobs), rows)
    app.close()
    listed = burstctl("list", "--json")
    ids = [j["id"] for j in json.loads(listed.stdout)]
    assert ids == [f"j{k:03d}" for k in range(10, 35)]  # the 20 finished last, then the 5 queued, oldest first
    assert "10 older finished jobs not shown" in listed.stderr
    assert len(json.loads(burstctl("list", "--json", "--all").stdout)) == 35
    assert [j["id"] for j in json.loads(burstctl("list", "--json", "--state", "queued").stdout)] == [
        f"j{k:03d}" for k in range(30, 35)]
    assert "10 older finished jobs not shown" in burstctl("list").stdout
