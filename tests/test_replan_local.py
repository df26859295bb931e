"""The daemon's side of re-planning a plain local run that measures it will miss its deadline
(`LocalRunner._redecide_if_late`): what it stores, what it says, and when it asks again. In-process against the real
store; the trainer's figures are what its metrics file would say. Each look is a fresh runner, as after a restart:
everything it acts on comes from the store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select, update

from orchestrator.app import BURST_ENABLED_KEY, App
from orchestrator.core.plan import latest_switch_at
from orchestrator.lifecycle import checkpoints
from orchestrator.lifecycle.local import LocalRunner
from orchestrator.queue import enqueue
from runbooks.burst_checkpoint import write_checkpoint
from state import schema as s
from tests.conftest import write_job


def _late_local_run(tmp_path: Path, *, approval_ceiling_usd: float = 50.0, **fields: Any) -> tuple[App, str]:
    """A job gate 2 kept local (W = 1 at the job file's s_L = 0.2/h: 5 h of its 12), running locally, a checkpoint
    of it home, whose trainer reports 0.1 done at 0.05/h with 10 h left: the 0.9 left would end 8 h late. Renting
    (H100 at 0.17/h, t_ovh 0.5 h) still makes it; a hybrid costs about $13, $11 more than finishing locally."""
    config = tmp_path / "burstctl.toml"
    config.write_text(f"[policy]\nmax_auto_delta_usd = {approval_ceiling_usd}\n[budget]\nmonthly_cap_usd = 100\n")
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    job_id, _, _ = enqueue(app, write_job(tmp_path, "slow-card", local_throughput=0.2, deadline_hours=12,
                                          rented_throughput={"H100": 0.17}, market="on-demand", **fields))
    write_checkpoint(checkpoints.store_dir(app.config, job_id), "step-00000100", {"state.json": b"{}"})
    now = time.time()
    with app.store.tx() as c:
        c.execute(insert(s.attempts).values(
            id=f"{job_id}-a1", job_id=job_id, n=1, where="local", state="running", provider="local",
            instance_type="local", info={"metrics": {"units_done": 0.1, "throughput_units_h": 0.05}},
            created_at=now, started_at=now))
        app.store.update_job(job_id, c, state="running", deadline_at=now + 10 * 3600)
    return app, job_id


def _attempt(app: App, job_id: str) -> dict[str, Any]:
    with app.store.engine.connect() as c:
        return dict(c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id)).mappings().one())


def _look(app: App, job_id: str, now: float) -> dict[str, Any]:
    """What a daemon's step does for the running local attempt, the trainer's figures in hand; returns the job."""
    att = _attempt(app, job_id)
    info = dict(att["info"])
    LocalRunner(app)._redecide_if_late(att, app.store.get_job(job_id), info, now)  # type: ignore[arg-type]
    with app.store.tx() as c:  # the step writes the attempt's info back, as it does every tick
        c.execute(update(s.attempts).where(s.attempts.c.id == att["id"]).values(info=info))
    job = app.store.get_job(job_id)
    assert job is not None
    return job


def _replanned(app: App, job_id: str) -> list[dict[str, Any]]:
    return [e["data"] for e in app.store.events(job_id=job_id) if e["type"] == "job.replanned"]


def test_a_late_local_run_becomes_the_local_phase_of_a_hybrid_stored_with_the_job_s_new_plan_and_said_once(
        tmp_path: Path) -> None:
    app, job_id = _late_local_run(tmp_path)
    first_record = app.store.get_job(job_id)["record_path"]  # type: ignore[index]
    now = time.time()
    job = _look(app, job_id, now)
    assert (job["state"], job["placement"], job["verdict"]) == ("running", "hybrid", "priced")
    d = job["decision"]
    assert d["plan_kind"] == "hybrid" and d["work_done"] == 0.1 and d["replanned_from"]["plan_kind"] == "local"
    assert d["first_plan"]["plan"] == "local" and d["decisions"] == 2  # what `report` sets beside the meter
    assert d["reasons"][0].startswith("re-planned while running locally, behind schedule: at the 0.05 units/h "
                                      "measured (0.2 planned)")
    # This attempt is the plan's local phase, handing over at the latest instant the rest still makes the deadline
    # from the work measured (recomputed every tick from here on).
    info = _attempt(app, job_id)["info"]
    assert info["hybrid"]["local_units_h"] == 0.05 and info["hybrid"]["done_at_start"] == 0.1
    assert info["switch_at"] == pytest.approx(latest_switch_at(
        deadline_at=job["deadline_at"], work=1.0, done=0.1, rented_units_h=0.17, overhead_h=0.5, margin_h=0.25))
    # Said once, with a decision record of its own that the first one points at.
    for later in (now + 1, now + 3600):
        _look(app, job_id, later)
    [said] = _replanned(app, job_id)
    assert said["outcome"] == "hybrid" and said["before"]["plan_kind"] == "local"
    assert said["after"]["plan_kind"] == "hybrid" and said["record"] == job["record_path"] != first_record
    assert Path(job["record_path"]).name in Path(first_record).read_text()
    app.close()


def test_with_no_time_left_for_a_local_phase_the_hand_over_is_due_at_once(tmp_path: Path) -> None:
    app, job_id = _late_local_run(tmp_path)
    with app.store.tx() as c:  # 6 h left: renting the 0.9 left takes 5.8 h, so no local phase fits before it
        app.store.update_job(job_id, c, deadline_at=time.time() + 6 * 3600)
    now = time.time()
    job = _look(app, job_id, now)
    assert job["placement"] == "cloud" and job["decision"]["plan_kind"] == "burst"
    info = _attempt(app, job_id)["info"]
    assert info["switch_at"] == now and "hybrid" not in info  # the step stops it for the burst (or holds it)
    app.close()


def test_a_job_that_does_not_resume_from_checkpoints_is_never_moved_and_says_so(tmp_path: Path) -> None:
    app, job_id = _late_local_run(tmp_path, checkpoint={"dir": "checkpoints", "interval_minutes": 20,
                                                        "resumable": False})
    job = _look(app, job_id, time.time())
    assert (job["placement"], job["decision"]["plan_kind"]) == ("local", "local")
    assert job["reason"].startswith("behind schedule: ") and job["reason"].endswith(
        "it does not resume from checkpoints, so it is not moved: it finishes locally, late")
    assert "switch_at" not in _attempt(app, job_id)["info"]
    assert [r["outcome"] for r in _replanned(app, job_id)] == ["not-resumable"]
    app.close()


def test_with_bursting_disabled_it_runs_on_and_is_asked_again_once_a_market_check_after_it_is_enabled(
        tmp_path: Path) -> None:
    app, job_id = _late_local_run(tmp_path)
    app.store.set_setting(BURST_ENABLED_KEY, False)
    now = time.time()
    job = _look(app, job_id, now)
    assert job["placement"] == "local" and "re-planned: it runs on locally, late: bursting is disabled" in job["reason"]
    app.store.set_setting(BURST_ENABLED_KEY, True)
    assert _look(app, job_id, now + 1)["placement"] == "local"  # not asked again every tick...
    assert _look(app, job_id, now + app.config.daemon.market_check_s + 1)["placement"] == "hybrid"  # ...but again
    assert [r["outcome"] for r in _replanned(app, job_id)] == ["blocked", "hybrid"]
    app.close()


def test_a_price_above_the_approval_ceiling_waits_for_burstctl_approve_while_the_local_run_goes_on(
        tmp_path: Path, burstctl: Any) -> None:
    app, job_id = _late_local_run(tmp_path, approval_ceiling_usd=5.0)
    now = time.time()
    job = _look(app, job_id, now)
    assert (job["state"], job["placement"], job["decision"]["action"]) == ("running", "local", "await-approval")
    assert "above the $5.00 approved without asking" in job["reason"] and "`burstctl approve`" in job["reason"]
    r = burstctl("approve", job_id)
    assert r.returncode == 0 and "approved: it bursts the rest" in r.stdout, r.stderr
    assert _look(app, job_id, now + 1)["placement"] == "hybrid"  # at once, not a market check later
    assert [r["outcome"] for r in _replanned(app, job_id)] == ["await-approval", "hybrid"]
    app.close()
