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

import pytest
from sqlalchemy import event, insert

from orchestrator.app import App
from orchestrator.retention import prune_events, prune_if_due
from state import schema as s
from state.store import Store
from tests.conftest import write_job


@pytest.fixture
def burstctl(burstctl_in_process):  # the CLI in this process; a daemon's in its own (`burstctl_subprocess`)
    return burstctl_in_process


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


def test_a_script_pages_through_the_event_log_from_the_last_id_it_saw(burstctl, tmp_path: Path) -> None:
    app = _app(tmp_path)
    with app.store.tx() as c:
        c.execute(insert(s.events), [{"ts": 1000.0 + k, "type": "daemon.started" if k % 2 else "daemon.stopped",
                                      "job_id": None, "attempt_id": None, "data": {"k": k}} for k in range(250)])
    app.close()
    seen, last = [], 0
    while page := [json.loads(line) for line in
                   burstctl("events", "--json", "--after", str(last), "--limit", "100").stdout.splitlines()]:
        assert len(page) <= 100 and page[0]["id"] > last
        seen += [e["k"] for e in page]
        last = page[-1]["id"]
    assert seen == list(range(250))
    # Without --limit, every event after the id, oldest first; with --type, only those.
    rest = burstctl("events", "--json", "--after", str(last - 10))
    assert [json.loads(line)["k"] for line in rest.stdout.splitlines()] == list(range(240, 250))
    odd = burstctl("events", "--json", "--after", str(last - 10), "--type", "daemon.started")
    assert [json.loads(line)["k"] for line in odd.stdout.splitlines()] == list(range(241, 250, 2))
    clash = burstctl("events", "--all", "--after", "3")
    assert clash.returncode == 2 and "--after" in clash.stderr and "Traceback" not in clash.stderr


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


def _job(app: App, tmp_path: Path, name: str, state: str, updated_at: float) -> str:
    from orchestrator.queue import enqueue

    job_id, _, _ = enqueue(app, write_job(tmp_path, name, local_throughput=0, rented_throughput={"H100": 2.0}))
    with app.store.tx() as c:
        c.execute(s.jobs.update().where(s.jobs.c.id == job_id).values(state=state, updated_at=updated_at))
    return job_id


def _attempt(app: App, job_id: str, state: str, *, ended: bool, month: str, cost: float) -> None:
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(id=f"{job_id}-a1", job_id=job_id, n=1, where="cloud", state=state,
                                            provider="sim", instance_type="t", market="spot", info={},
                                            instance_id=f"i-{job_id}", created_at=1000.0, started_at=1000.0))
        c.execute(insert(s.instances).values(provider="sim", id=f"i-{job_id}", attempt_id=f"{job_id}-a1",
                                             state="terminated" if ended else "running", verified_gone=ended))
    app.store.open_charge({"month": month, "job_id": job_id, "attempt_id": f"{job_id}-a1", "provider": "sim",
                           "instance_id": f"i-{job_id}", "rate_usd_h": 2.0, "started_at": time.time() - 3600})
    if ended:
        [row] = app.store.ledger_rows(month)[-1:]
        app.store.close_charge(row["id"], ended_at=time.time(), billed_seconds=3600, cost_usd=cost)


def test_pruning_drops_only_the_history_of_jobs_long_over_and_the_budget_meter_reads_the_same(
        burstctl, tmp_path: Path) -> None:
    from orchestrator.core.budget import month_key

    app = _app(tmp_path)
    now = time.time()
    month = month_key(now)
    old = now - 40 * 86400
    done_long_ago = _job(app, tmp_path, "old", "done", old)
    _attempt(app, done_long_ago, "succeeded", ended=True, month=month, cost=7.5)
    done_lately = _job(app, tmp_path, "recent", "done", now - 86400)
    # Over long ago, but its instance is not confirmed gone (an unverified termination): its trail stays.
    unverified = _job(app, tmp_path, "unverified", "failed", old)
    _attempt(app, unverified, "failed", ended=False, month=month, cost=0)
    with app.store.tx() as c:
        c.execute(s.ledger.update().where(s.ledger.c.job_id == unverified).values(ended_at=None))
    running = _job(app, tmp_path, "running", "running", old)  # not over, however old its last change
    _attempt(app, running, "running", ended=False, month=month, cost=0)
    app.store.append_event("daemon.started", {}, ts=old)
    recent_daemon = app.store.append_event("daemon.started", {}, ts=now - 60)
    for job_id in (done_long_ago, done_lately, unverified, running):
        app.store.append_event("checkpoint.synced", {"path": "x"}, job_id=job_id, ts=old)
    before = {j: len(app.store.events(job_id=j)) for j in (done_long_ago, done_lately, unverified, running)}
    logs = {j: _run_logs(tmp_path, f"{j}-a1") for j in (done_long_ago, done_lately, unverified, running)}
    ledger_before = app.store.ledger_rows()
    app.close()
    budget_before = json.loads(burstctl("budget", "--json").stdout)

    pruned = json.loads(burstctl("prune-events", "--older-than", "30", "--json").stdout)
    assert pruned["finished_jobs"] == 1 and pruned["events"] == before[done_long_ago] + 1
    # Its attempts' logs went with its events; every other job's stay.
    assert pruned["run_dirs"] == 1 and pruned["run_bytes"] == logs[done_long_ago]
    assert not (tmp_path / "state" / "runs" / f"{done_long_ago}-a1").exists()
    assert [j for j in logs if (tmp_path / "state" / "runs" / f"{j}-a1" / "stdout.log").exists()] == [
        done_lately, unverified, running]
    said = burstctl("logs", done_long_ago)
    assert said.returncode == 0 and said.stdout == ""
    assert "its logs were deleted on " in said.stderr and "state.events_keep_days" in said.stderr

    app = _app(tmp_path)
    assert app.store.events(job_id=done_long_ago) == []
    for j in (done_lately, unverified, running):
        assert len(app.store.events(job_id=j)) == before[j], j
    assert [e["id"] for e in app.store.events(type_prefix="daemon.")] == [recent_daemon]
    # The job, its attempt and its charges stay: the month's spend, the cycles and `show` read as before.
    assert app.store.ledger_rows() == ledger_before
    assert app.store.get_job(done_long_ago)["state"] == "done"
    app.close()
    budget_after = json.loads(burstctl("budget", "--json").stdout)
    accruing = ("spent_usd", "remaining_usd", "held_usd", "free_usd")  # open charges accrue meanwhile
    assert {k: v for k, v in budget_after.items() if k not in accruing} == {
        k: v for k, v in budget_before.items() if k not in accruing}
    assert abs(budget_after["free_usd"] - budget_before["free_usd"]) < 0.1
    assert budget_after["cycles_this_month"] == 3
    assert budget_after["spent_usd"] >= budget_before["spent_usd"] >= 7.5  # open charges accrue meanwhile
    assert budget_after["spent_usd"] - budget_before["spent_usd"] < 0.1
    shown = burstctl("show", done_long_ago)
    assert shown.returncode == 0 and done_long_ago in shown.stdout


def _run_logs(tmp_path: Path, attempt_id: str) -> int:
    """An attempt's logs as a run leaves them in <state>/runs/<attempt>/; returns their bytes."""
    run = tmp_path / "state" / "runs" / attempt_id
    run.mkdir(parents=True)
    (run / "stdout.log").write_text("step 1 loss 2.5\n" * 1000)
    (run / "supervisor.log").write_text("started\nexited 0\n")
    return sum(f.stat().st_size for f in run.iterdir())


def test_keep_logs_prunes_the_events_alone(burstctl, tmp_path: Path) -> None:
    app = _app(tmp_path)
    old = _job(app, tmp_path, "old", "done", time.time() - 40 * 86400)
    _attempt(app, old, "succeeded", ended=True, month="2026-01", cost=1.0)
    _run_logs(tmp_path, f"{old}-a1")
    app.close()
    pruned = json.loads(burstctl("prune-events", "--older-than", "30", "--keep-logs", "--json").stdout)
    assert pruned["events"] > 0 and pruned["run_dirs"] == 0
    assert burstctl("logs", old).stdout == "step 1 loss 2.5\n" * 1000
    said = burstctl("prune-events", "--older-than", "30")
    assert said.returncode == 0
    assert said.stdout.startswith("0 events deleted, 1 attempts' logs deleted (0.0 MiB)"), said.stdout


def test_an_event_log_pruned_to_nothing_never_numbers_its_events_from_1_again(burstctl, tmp_path: Path) -> None:
    # SQLite numbers a new row one past the largest id left: emptied, the table numbered from 1 again, and a
    # notifier that had delivered up to id 160 saw nothing new (and `status` said it was fine) for 160 events.
    app = _app(tmp_path)
    old = _job(app, tmp_path, "old", "done", time.time() - 40 * 86400)
    newest = max(e["id"] for e in app.store.events())
    app.close()
    pruned = json.loads(burstctl("prune-events", "--older-than", "0", "--json").stdout)
    assert pruned["events"] > 0
    app = _app(tmp_path)
    assert [e["id"] for e in app.store.events()] == [newest]  # the newest is kept: the numbering goes on from it
    app.store.append_event("daemon.started", {})
    assert [e["id"] for e in app.store.events()][-1] == newest + 1
    assert old
    app.close()


def test_the_daemon_prunes_once_a_day_only_when_configured(tmp_path: Path) -> None:
    app = _app(tmp_path)
    now = time.time()
    job_id = _job(app, tmp_path, "old", "done", now - 40 * 86400)
    app.store.append_event("checkpoint.synced", {}, job_id=job_id, ts=now - 40 * 86400)
    assert prune_if_due(app, now) is None  # unset: every event is kept
    app.close()
    app = _app(tmp_path, "[state]\nevents_keep_days = 30\n")
    assert prune_if_due(app, now) == {"finished_jobs": 1, "events": 2,  # enqueued, decided; synced is the newest
                                      "run_dirs": 0, "run_bytes": 0}
    app.store.append_event("checkpoint.synced", {}, job_id=job_id, ts=now)
    assert prune_if_due(app, now + 3600) is None  # pruned less than a day ago
    assert prune_if_due(app, now + 86400)["events"] == 1
    assert [e["type"] for e in app.store.events(type_prefix="state.")] == ["state.events_pruned"] * 2
    # Only the synced event the prune before kept as the newest then: a newer one (its own note) is there now.
    assert prune_events(app, 30, now + 86400)["events"] == 1
    app.close()


def _checkpoints(tmp_path: Path, job_id: str, steps: int = 2) -> int:
    """Complete checkpoints of a job in the local store, as a sync leaves them; returns their bytes."""
    from runbooks.burst_checkpoint import write_checkpoint

    store = tmp_path / "state" / "checkpoints" / job_id
    for step in range(1, steps + 1):
        write_checkpoint(store, f"step-{step:08d}", {"weights.bin": b"w" * 50_000})
    return sum(f.stat().st_size for f in store.rglob("*") if f.is_file())


def test_checkpoints_of_jobs_done_long_ago_go_only_when_asked_and_a_failed_job_keeps_its_own(
        burstctl, tmp_path: Path) -> None:
    app = _app(tmp_path)
    now = time.time()
    done_long_ago = _job(app, tmp_path, "old", "done", now - 40 * 86400)
    failed_long_ago = _job(app, tmp_path, "broken", "failed", now - 40 * 86400)  # `burstctl retry` resumes from them
    done_lately = _job(app, tmp_path, "recent", "done", now - 86400)
    held = {j: _checkpoints(tmp_path, j) for j in (done_long_ago, failed_long_ago, done_lately)}
    app.close()
    store = tmp_path / "state" / "checkpoints"

    kept = json.loads(burstctl("prune-events", "--older-than", "30", "--json").stdout)
    assert "checkpoint_dirs" not in kept and sorted(p.name for p in store.iterdir() if p.is_dir()) == sorted(held)
    pruned = json.loads(burstctl("prune-events", "--older-than", "30", "--checkpoints", "--json").stdout)
    assert (pruned["checkpoint_dirs"], pruned["checkpoint_bytes"]) == (1, held[done_long_ago])
    assert sorted(p.name for p in store.iterdir() if p.is_dir()) == sorted([failed_long_ago, done_lately])
    said = burstctl("prune-events", "--older-than", "0", "--checkpoints")
    assert "the checkpoints of 1 done jobs deleted (0.00 GiB)" in said.stdout
    assert [p.name for p in store.iterdir() if p.is_dir()] == [failed_long_ago]


def test_the_daemon_prunes_done_jobs_checkpoints_once_a_day_when_configured(tmp_path: Path) -> None:
    app = _app(tmp_path, "[state]\ncheckpoints_keep_days = 30\n")
    now = time.time()
    job_id = _job(app, tmp_path, "old", "done", now - 40 * 86400)
    held = _checkpoints(tmp_path, job_id)
    assert prune_if_due(app, now) == {"finished_jobs": 0, "events": 0, "run_dirs": 0, "run_bytes": 0}
    assert not (tmp_path / "state" / "checkpoints" / job_id).exists()
    (said,) = app.store.events(type_prefix="state.")
    assert (said["type"], said["data"]) == ("state.checkpoints_pruned", {
        "older_than_days": 30, "checkpoint_dirs": 1, "checkpoint_bytes": held})
    _checkpoints(tmp_path, job_id)
    assert prune_if_due(app, now + 3600) is None  # once a day
    assert (tmp_path / "state" / "checkpoints" / job_id).exists()
    app.close()
