"""A plain local run that measures it will miss its deadline, decided again on the work left and the local speed
measured (orchestrator/core/replan.py): hybrid, burst now, or finish late locally, under the enqueue rules."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.core.decision import DecisionContext, GpuOffer, JobFacts
from orchestrator.core.replan import replan_late_local

CTX = DecisionContext(local_usd_h=0.10, offers={"H100": GpuOffer("H100", 3.00, 1.00, 85.9)}, overhead_h=0.5,
                      hybrid_margin_h=0.25, budget_cap_usd=100.0, max_auto_delta_usd=50.0)
# Kept local at enqueue: W = 1 at the job file's s_L = 0.2/h is 5 h, within 12 h. Two hours in, the trainer
# reports 0.1 done at 0.05/h: the 0.9 left take 18 h, and 10 h are left.
JOB = JobFacts(name="slow-card", kind="train", work=1, s_local=0.2, rented={"H100": 0.17}, gpus=1, deadline_h=10,
               market="on-demand")


def test_a_local_run_behind_its_deadline_becomes_the_local_phase_of_a_hybrid_planned_at_the_measured_speed() -> None:
    r = replan_late_local(JOB, CTX, done=0.1, units_h=0.05)
    assert r.outcome == "hybrid" and r.moves and r.decision is not None
    assert r.decision.placement == "hybrid" and r.decision.verdict.value == "priced"
    assert (r.facts.work, r.facts.s_local) == (pytest.approx(0.9), 0.05)  # decided on the rest, at the speed seen
    local, cloud = r.decision.plan.phases  # type: ignore[union-attr]
    # x* = (D − margin − t_ovh − rest/s_R) / (1 − s_L/s_R) with the measured s_L and the work left.
    x = (10 - 0.25 - 0.5 - 0.9 / 0.17) / (1 - 0.05 / 0.17)
    assert local.hours == pytest.approx(x) and local.units_h == 0.05
    assert cloud.work_units == pytest.approx(0.9 - 0.05 * x) and cloud.market == "on-demand"
    assert r.why.startswith("re-planned: a hybrid, $")


def test_with_no_time_left_for_a_local_phase_it_bursts_the_rest_now() -> None:
    r = replan_late_local(replace(JOB, deadline_h=6), CTX, done=0.1, units_h=0.05)  # T_R 5.79 h of 6 h: x* < 0
    assert r.outcome == "burst" and r.moves
    assert r.decision is not None and r.decision.placement == "cloud"
    assert r.why.startswith("re-planned: it bursts the rest to H100 (on-demand) now")


def test_when_nothing_meets_the_deadline_any_more_it_finishes_late_locally() -> None:
    r = replan_late_local(replace(JOB, deadline_h=3), CTX, done=0.1, units_h=0.05)  # T_R 5.79 h > 3 h
    assert r.outcome == "late" and not r.moves
    assert r.decision is not None and r.decision.action == "run-local" and r.decision.placement == "local"
    assert "neither local (18.00 h) nor rented (5.79 h) finishes the rest within the 3.00 h left" in r.why


def test_a_job_that_does_not_resume_from_checkpoints_is_never_moved() -> None:
    r = replan_late_local(replace(JOB, checkpoints=False), CTX, done=0.1, units_h=0.05)
    assert (r.outcome, r.moves, r.decision) == ("not-resumable", False, None)


@pytest.mark.parametrize("ctx, cause", [
    (replace(CTX, burst_enabled=False), "bursting is disabled (revert-local"),
    (replace(CTX, budget_cap_usd=20.0, spent_usd=15.0), "budget: projected rented $"),
    (replace(CTX, cloud_kinds=()), "kind 'train' may not run in the cloud"),
])
def test_the_kill_switch_the_budget_and_the_kinds_allowed_keep_it_local_saying_which(
        ctx: DecisionContext, cause: str) -> None:
    r = replan_late_local(JOB, ctx, done=0.1, units_h=0.05)
    assert r.outcome == "blocked" and not r.moves
    assert r.why.startswith("re-planned: it runs on locally, late: " + cause)


def test_a_price_above_the_approval_ceiling_waits_for_approval_while_it_runs_on_and_moves_once_approved() -> None:
    ctx = replace(CTX, max_auto_delta_usd=5.0)  # the hybrid costs about $13 against $1.80 locally
    waiting = replan_late_local(JOB, ctx, done=0.1, units_h=0.05)
    assert waiting.outcome == "await-approval" and not waiting.moves
    assert "above the $5.00 approved without asking" in waiting.why and "`burstctl approve`" in waiting.why
    assert replan_late_local(JOB, ctx, done=0.1, units_h=0.05, approved=True).outcome == "hybrid"


def test_a_measured_speed_of_zero_is_no_speed() -> None:
    with pytest.raises(ValueError):
        replan_late_local(JOB, CTX, done=0.1, units_h=0.0)
