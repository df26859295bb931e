"""A job's whole decision: offer choice, market, plan, budget, approval, the cloud's bounded role."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from orchestrator.core.decision import DecisionContext, GpuOffer, JobFacts, ListedPrice, decide
from orchestrator.core.gates import Verdict
from orchestrator.core.local_hours import LocalHours

OFFERS = {
    "H100": GpuOffer("H100", 3.00, 1.00, 85.9),
    "A10": GpuOffer("A10", 0.75, 0.25, 25.8),
}
CTX = DecisionContext(local_usd_h=0.10, offers=OFFERS, overhead_h=0.5, budget_cap_usd=100.0)
C = JobFacts(name="c", kind="train", work=1, s_local=0.033, rented={"H100": 0.17}, gpus=1, deadline_h=12,
             market="on-demand")


def test_priced_job_above_the_ceiling_waits_for_approval() -> None:
    d = decide(C, CTX)
    assert d.verdict is Verdict.PRICED and d.action == "await-approval"
    assert d.plan is not None and d.plan.kind == "hybrid"


def test_a_job_that_does_not_resume_from_checkpoints_gets_no_hybrid_plan() -> None:
    # A hybrid hands the local run's checkpoint over to the cloud: without one there is nothing to hand over.
    d = decide(replace(C, checkpoints=False), CTX)
    assert d.verdict is Verdict.PRICED and d.plan is not None and d.plan.kind == "burst"


def test_a_job_that_cannot_meet_its_deadline_is_rethink_unless_it_has_started_then_it_finishes_locally() -> None:
    hopeless = replace(C, deadline_h=2.0)  # local 30.3 h, rented 6.38 h: neither makes 2 h
    assert decide(hopeless, CTX).action == "rethink"
    started = decide(replace(hopeless, started=True), CTX)
    assert started.verdict is Verdict.RETHINK and started.action == "run-local" and started.placement == "local"


def test_priced_job_within_the_ceiling_bursts_by_itself() -> None:
    d = decide(C, replace(CTX, max_auto_delta_usd=50.0))
    assert d.action == "burst"


def test_deadline_critical_job_bursts_without_asking_and_on_demand() -> None:
    d = decide(replace(C, deadline_critical=True, market="auto"), CTX)
    assert d.action == "burst" and d.market is not None and d.market.market == "on-demand"


def test_budget_cap_blocks_a_burst_whose_projection_exceeds_what_is_left() -> None:
    d = decide(replace(C, s_local=0.0), replace(CTX, budget_cap_usd=25.0, spent_usd=10.0))
    assert d.verdict is Verdict.BURST and d.action == "blocked"
    # The plan's $19.15, and 120 s of the instance for its stop, as the launch's own check counts it.
    assert ("budget: projected rented $19.25 (6.38 h at $3.00/h, plus 120 s to stop) exceeds the $15.00 left of the "
            "$25.00 monthly budget ($10.00 spent or committed)") in d.reasons


def test_a_burst_that_costs_more_than_the_whole_cap_is_told_no_month_pays_it_not_to_wait_for_one() -> None:
    d = decide(replace(C, s_local=0.0), replace(CTX, budget_cap_usd=15.0))
    assert d.action == "blocked"
    assert ("budget: projected rented $19.25 (6.38 h at $3.00/h, plus 120 s to stop) is more than the whole $15.00 "
            "monthly budget: no month pays it; raise budget.monthly_cap_usd, or give it less work or a later "
            "deadline") in d.reasons


def test_non_training_kinds_never_go_to_the_cloud_by_default() -> None:
    d = decide(replace(C, kind="eval", s_local=0.0), CTX)
    assert d.action == "blocked"
    assert any("cloud_kinds" in r for r in d.reasons)
    assert decide(replace(C, kind="eval", s_local=0.0), replace(CTX, cloud_kinds=("train", "eval"))).action == "burst"


def test_the_kill_switch_blocks_bursting_but_not_local_runs() -> None:
    off = replace(CTX, burst_enabled=False)
    assert decide(replace(C, s_local=0.0), off).action == "blocked"
    assert decide(replace(C, deadline_h=40), off).action == "run-local"


def test_cheapest_gpu_type_that_meets_the_deadline_is_chosen() -> None:
    job = replace(C, s_local=0.0, rented={"H100": 0.17, "A10": 0.05}, deadline_h=48)
    d = decide(job, CTX)
    # A10: 1/0.05 + 0.5 = 20.5 h at $0.75 = $15.4 < H100 $19.15, and meets 48 h.
    assert d.gpu == "A10"
    d = decide(replace(job, deadline_h=10), CTX)
    assert d.gpu == "H100"


def test_gpu_types_too_small_for_the_per_gpu_memory_are_skipped() -> None:
    job = replace(C, s_local=0.0, rented={"H100": 0.17, "A10": 0.05}, deadline_h=48, per_gpu_gb=40.0)
    assert decide(job, CTX).gpu == "H100"
    d = decide(replace(job, per_gpu_gb=200.0), CTX)
    assert d.verdict is Verdict.RETHINK


def test_a_rented_card_keeps_the_same_margin_free_as_the_local_one() -> None:
    # An A10 reads 23028 MiB = 24.15 GB: a job of 24.0 GB per GPU fits it only to the last 150 MB, which the CUDA
    # context alone takes, so with gate 1's 1 GiB kept free it goes to the H100.
    a10 = {**OFFERS, "A10": GpuOffer("A10", 0.75, 0.25, 23028 * 2**20 / 1e9)}
    job = replace(C, s_local=0.0, rented={"H100": 0.17, "A10": 0.05}, deadline_h=48, per_gpu_gb=24.0)
    assert decide(job, replace(CTX, offers=a10)).gpu == "A10"
    d = decide(job, replace(CTX, offers=a10, vram_margin_gb=2**30 / 1e9))
    assert d.gpu == "H100"
    assert "A10: needs 24.0 GB per GPU and 1.1 GB = 1.00 GiB kept free, has 24.1 GB = 22.49 GiB: skipped" in d.reasons


def test_prices_providers_listed_for_the_job_s_machine_replace_the_reference_and_say_so() -> None:
    job = replace(C, s_local=0.0, rented={"H100": 0.17}, deadline_h=48)
    listed = {("H100", 1): ListedPrice(3.29, 1.10, "sim 2 min ago"),
              ("H100", 2): ListedPrice(3.19, 1.05, "sim 2 min ago")}
    d = decide(job, replace(CTX, listed=listed))
    assert d.rate_usd_per_gpu_h == pytest.approx(3.29)  # the 1-GPU machine's, not the 2-GPU one's per GPU
    assert "H100: $3.29/GPU-h on-demand, spot $1.10, as sim 2 min ago listed 1×H100 ([prices.H100] says $3.00)" \
        in d.reasons
    assert d.gates.c_rented_usd == pytest.approx(3.29 * (1 / 0.17 + 0.5))
    # The instance's on-demand rate is kept as such (the report's "spot saved" divided rounded figures: 3.3191).
    assert d.to_dict()["market_costs"]["on_demand_usd_h"] == pytest.approx(3.29, abs=1e-6)
    assert decide(replace(job, gpus=2), replace(CTX, listed=listed)).rate_usd_per_gpu_h == pytest.approx(3.19)


def test_a_listed_card_smaller_than_prices_says_is_the_one_the_job_must_fit() -> None:
    # [prices.A100] has 80 GB, but the providers list a 40 GB A100: a 44 GB job would overfill what launches.
    offers = {**OFFERS, "A100": GpuOffer("A100", 1.80, 0.65, 85.9)}
    job = replace(C, s_local=0.0, rented={"A100": 0.3, "H100": 0.17}, deadline_h=48, per_gpu_gb=44.0)
    listed = {("A100", 1): ListedPrice(1.29, 0.65, "sim just now", vram_gb=40 * 2**30 / 1e9)}
    d = decide(job, replace(CTX, offers=offers, listed=listed))
    assert d.gpu == "H100"
    assert "A100: needs 44.0 GB per GPU and 0.0 GB = 0.00 GiB kept free, has 42.9 GB = 40.00 GiB: skipped" in d.reasons
    assert decide(job, replace(CTX, offers=offers)).gpu == "A100"  # by [prices] alone it would have gone there


def test_a_local_job_s_reason_is_its_gate_not_where_a_burst_would_be_priced() -> None:
    listed = {("H100", 1): ListedPrice(3.29, 1.10, "sim just now")}
    local = replace(C, s_local=0.33, deadline_h=24, rented_in_file={"H100": 0.2})
    d = decide(local, replace(CTX, listed=listed))
    assert d.verdict is Verdict.LOCAL and not any(r.startswith(("H100", "s_R")) for r in d.reasons)
    burst = decide(replace(local, s_local=0.0), replace(CTX, listed=listed))
    assert any(r.startswith("H100: $3.29") for r in burst.reasons) and any(r.startswith("s_R on H100")
                                                                          for r in burst.reasons)


def test_a_gpu_type_or_count_no_provider_sells_is_skipped_when_every_provider_has_listed() -> None:
    job = replace(C, s_local=0.0, rented={"H100": 0.17, "A10": 0.05}, deadline_h=48, gpus=3)
    sold = {"H100": (1, 2, 8)}
    d = decide(job, replace(CTX, listed_shapes=sold))
    assert d.verdict is Verdict.RETHINK and d.gpu is None
    assert "H100: no provider lists a 3×H100 machine (they list H100 ×1/2/8): skipped" in d.reasons
    assert "A10: no provider lists a 3×A10 machine (they list H100 ×1/2/8): skipped" in d.reasons
    assert d.reasons[-1].startswith("no provider sells a machine of the GPU types and count it names")
    assert decide(replace(job, gpus=2), replace(CTX, listed_shapes=sold)).gpu == "H100"
    assert decide(job, CTX).gpu is not None  # not known which are sold: the reference prices alone decide
    # One type unsold and the other too small: the closing line names both ways out.
    both = decide(replace(job, gpus=2, per_gpu_gb=30.0), replace(CTX, listed_shapes={"H100": (1,), "A10": (2,)}))
    assert both.verdict is Verdict.RETHINK
    assert both.reasons[-1].startswith("no rented GPU type can run this job: rethink scope")
    assert both.reasons[-1].endswith(", or name a GPU type and count a provider sells")


def test_spot_is_the_default_market_for_a_checkpointing_burst() -> None:
    d = decide(replace(C, s_local=0.0, market="auto", deadline_h=48), CTX)
    assert d.market is not None and d.market.market == "spot"
    assert d.rate_usd_per_gpu_h == pytest.approx(1.0)
    assert d.to_dict()["market_costs"]["on_demand_usd"] == pytest.approx(19.147, abs=0.01)


def test_the_local_gpu_s_hours_make_t_local_the_wall_clock_time_through_them() -> None:
    # 3.03 h of GPU time; the GPU trains 00:00-06:00 only.
    early = replace(CTX, local_hours=LocalHours(windows=((0.0, 360.0),), clock_min=0.0))
    d = decide(replace(C, s_local=0.33, deadline_h=10), early)
    assert d.verdict is Verdict.LOCAL and d.gates.t_local_h == pytest.approx(1 / 0.33)  # done by 03:02
    # Queued at 08:00, the same run waits for midnight: done at 03:02 the next day, 19.03 h from now.
    late = replace(CTX, local_hours=LocalHours(windows=((0.0, 360.0),), clock_min=480.0))
    d = decide(replace(C, s_local=0.33, deadline_h=10), late)
    assert d.verdict is Verdict.PRICED and d.gates.t_local_h == pytest.approx(16 + 1 / 0.33)
    assert d.gates.c_local_usd == pytest.approx(CTX.local_usd_h / 0.33)  # power for the hours it trains, not waits
    assert any("local GPU open 3.03 h of the 19.03 h from now" in r for r in d.reasons)
    assert decide(replace(C, s_local=0.33, deadline_h=24), late).verdict is Verdict.LOCAL


def test_a_rethink_or_local_job_s_headline_is_its_gate_not_a_note_said_after_it() -> None:
    # The job's reason, `show`'s header and its notice are the headline: a rethink job's was the price providers
    # listed, a local job's the local GPU's hours.
    listed = {("H100", 1): ListedPrice(3.29, 1.10, "sim just now")}
    rethink = decide(replace(C, deadline_h=0.0001), replace(CTX, listed=listed)).to_dict()
    assert rethink["reasons"][-1].startswith("H100: $3.29/GPU-h")
    assert rethink["headline"] == ("Gate 2: local 30.30 h and rented 6.38 h both miss 0.00 h: rethink scope, not "
                                   "hardware")
    late = replace(CTX, local_hours=LocalHours(windows=((0.0, 360.0),), clock_min=480.0))
    local = decide(replace(C, s_local=0.33, deadline_h=24), late).to_dict()
    assert local["reasons"][-1].startswith("local GPU open 3.03 h")
    assert local["headline"].startswith("Gate 2: local finishes")
    burst = decide(C, CTX).to_dict()  # otherwise the last word: here, what the deadline costs
    assert burst["headline"] == burst["reasons"][-1] and burst["headline"].startswith("its plan costs")


def test_decision_json_has_the_documented_keys() -> None:
    d = decide(C, CTX).to_dict()
    for key in ("verdict", "fits_locally", "t_local_h", "c_local_usd", "t_rented_h", "c_rented_usd",
                "delta_cost_usd", "hours_saved", "market", "reasons", "headline", "plan", "plan_cost_usd"):
        assert key in d
    assert not any(isinstance(v, float) and math.isnan(v) for v in d.values())


def test_a_hybrid_s_rented_phase_is_priced_on_demand_unless_its_margin_leaves_room_for_a_preemption() -> None:
    # Bursting as late as is safe leaves t_ovh + margin of slack; the spot policy's safety net keeps 2·t_ovh.
    spot_c = replace(C, market="spot")
    tight = decide(spot_c, CTX)  # margin 0.25 h, t_ovh 0.5 h: the late burst would run on on-demand
    assert tight.plan is not None and tight.plan.kind == "burst" and tight.plan.phases[0].market == "spot", \
        "bursting now on spot, with the whole slack, is cheaper than a late burst on on-demand"
    roomy = decide(spot_c, replace(CTX, hybrid_margin_h=1.0))
    assert roomy.plan is not None and roomy.plan.kind == "hybrid"
    assert roomy.plan.phases[1].market == "spot"
    # Priced as a burst on spot is: at $1.00 an hour, with the rework its expected preemptions add (λ of the
    # market's choice), not as if spot were never reclaimed.
    m = roomy.to_dict()["market_costs"]
    rework = m["spot_expected_h"] / roomy.gates.t_rented_h
    assert rework > 1.0 and roomy.plan.phases[1].cost_usd == pytest.approx(1.00 * roomy.plan.phases[1].hours * rework,
                                                                           rel=1e-3)


def test_a_hybrid_s_phases_start_after_the_local_gpu_s_line_ahead_of_it() -> None:
    # Behind 4 h of local work, the local phase starts in 4 h and the burst at 4 h + x*, not at x*.
    behind = decide(replace(C, local_wait_h=4.0, deadline_h=20.0), CTX)
    assert behind.plan is not None and behind.plan.kind == "hybrid"
    local, cloud = behind.plan.phases
    assert local.start_after_h == pytest.approx(4.0)
    assert cloud.start_after_h == pytest.approx(4.0 + local.hours)


def test_a_hybrid_plan_the_budget_cannot_pay_yet_still_starts_its_free_local_phase() -> None:
    # Seed C's hybrid rents about 5 h at the end: $15.9 against the $15 cap. Its first hours are local and cost no
    # cloud money: it is queued (here within the approval ceiling), and the hand-over waits for the budget.
    d = decide(C, replace(CTX, budget_cap_usd=20.0, spent_usd=5.0, max_auto_delta_usd=50.0))
    assert d.plan.kind == "hybrid" and 15.0 < d.plan.rented_cost_usd < 20.0
    assert d.action == "burst" and d.placement == "hybrid"
    assert any(r.startswith("budget: projected rented $") and "exceeds" in r for r in d.reasons)
    assert "budget: the local phase runs first, and the hand-over to the cloud waits until the budget allows it " \
           "(raise the cap, or the month turns); until then it runs on locally, late" in d.reasons
    # Against a $15 cap no month pays its cloud phase: it is said so, not promised for the month that turns.
    d = decide(C, replace(CTX, budget_cap_usd=15.0, max_auto_delta_usd=50.0))
    assert d.action == "burst" and d.placement == "hybrid"
    assert "budget: its cloud phase ($15.37: 5.09 h at $3.00/h, plus 120 s to stop) is more than the whole $15.00 " \
           "monthly cap, so no month pays it: it runs locally, late, and hands over only if budget.monthly_cap_usd " \
           "is raised" in d.reasons
    # A plan that rents from the start is still blocked by the same budget.
    d = decide(replace(C, s_local=0.0), replace(CTX, budget_cap_usd=15.0, max_auto_delta_usd=50.0))
    assert d.action == "blocked" and d.placement == "cloud"


def test_a_hybrid_whose_cloud_phase_fits_the_cap_only_without_its_stop_is_said_to_be_over_the_whole_cap() -> None:
    # Its cloud phase costs $15.27, under a $15.30 cap; its launch also pays the 120 s its instance takes to stop
    # ($15.37), which no month's $15.30 pays. It was told its hand-over waits for the budget, as if a month would.
    d = decide(C, replace(CTX, budget_cap_usd=15.30, max_auto_delta_usd=50.0))
    assert d.plan is not None and d.plan.kind == "hybrid" and d.plan.rented_cost_usd < 15.30
    assert d.action == "burst" and d.placement == "hybrid"
    assert d.launch_usd == pytest.approx(d.plan.rented_cost_usd + 3.00 * 120 / 3600)
    assert d.reasons[-1] == ("budget: its cloud phase ($15.37: 5.09 h at $3.00/h, plus 120 s to stop) is more than "
                             "the whole $15.30 monthly cap, so no month pays it: it runs locally, late, and hands over "
                             "only if budget.monthly_cap_usd is raised")
    assert not any("waits until the budget allows it" in r for r in d.reasons)


def test_a_jobs_measured_setup_is_part_of_every_instance_overhead() -> None:
    # C rents 1/0.17 = 5.88 h + t_ovh 0.5 h = 6.38 h; with a 1.5 h setup it rents 7.88 h. Local misses a 7 h
    # deadline (30.3 h): that setup is the difference between renting to meet it and rethinking the job.
    job = replace(C, deadline_h=7.0)
    without = decide(job, CTX)
    assert without.verdict is Verdict.PRICED and without.gates.t_rented_h == pytest.approx(6.382, abs=1e-3)
    with_setup = decide(replace(job, setup_h=1.5), CTX)
    assert with_setup.overhead_h == pytest.approx(2.0)
    assert with_setup.gates.t_rented_h == pytest.approx(7.882, abs=1e-3) and with_setup.action == "rethink"
    assert with_setup.reasons[0] == ("t_ovh 2.00 h: 0.50 h per instance, plus this job's setup (90.0 min, "
                                     "measured on its earlier runs)")
