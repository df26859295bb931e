"""The two gates reproduce the seed's three candidates exactly (rate $3.00/GPU-h, t_ovh 0.5 h, local $0.10/h)."""

from __future__ import annotations

import pytest

from orchestrator.core.gates import GateInputs, Verdict, evaluate, wait_words

SEED = dict(work=1.0, rate_usd_per_gpu_h=3.00, overhead_h=0.5, local_usd_h=0.10, gpus=1)


def test_candidate_a_fits_and_makes_the_deadline_so_it_runs_local() -> None:
    r = evaluate(GateInputs(s_local=0.33, s_rented=2.0, deadline_h=24, **SEED))
    assert r.verdict is Verdict.LOCAL
    assert r.t_local_h == pytest.approx(3.03, abs=0.005)
    assert r.delta_cost_usd is None  # renting is waste: no dollar argument is made


def test_candidate_b_does_not_fit_so_it_bursts_without_a_dollar_argument() -> None:
    r = evaluate(GateInputs(s_local=0.0, s_rented=0.17, deadline_h=48, **SEED))
    assert r.verdict is Verdict.BURST
    assert not r.fits_locally
    assert r.t_rented_h == pytest.approx(6.38, abs=0.005)
    assert r.c_rented_usd == pytest.approx(19.15, abs=0.005)
    assert r.delta_cost_usd is None


def test_candidate_c_misses_locally_and_prices_the_deadline() -> None:
    r = evaluate(GateInputs(s_local=0.033, s_rented=0.17, deadline_h=12, **SEED))
    assert r.verdict is Verdict.PRICED
    assert r.t_local_h == pytest.approx(30.30, abs=0.005)
    assert r.t_rented_h == pytest.approx(6.38, abs=0.005)
    assert r.delta_cost_usd == pytest.approx(16.12, abs=0.005)
    assert r.hours_saved == pytest.approx(23.92, abs=0.005)


def test_when_rented_also_misses_the_verdict_is_rethink_scope() -> None:
    r = evaluate(GateInputs(s_local=0.033, s_rented=0.17, deadline_h=5, **SEED))
    assert r.verdict is Verdict.RETHINK
    assert any("rethink" in reason for reason in r.reasons)


def test_local_wins_whatever_the_rented_speedup() -> None:
    r = evaluate(GateInputs(s_local=0.5, s_rented=1000.0, deadline_h=2.0, **SEED))
    assert r.verdict is Verdict.LOCAL


def test_a_memory_estimate_over_local_vram_forces_the_burst_even_with_local_throughput() -> None:
    r = evaluate(GateInputs(s_local=0.33, s_rented=2.0, deadline_h=24, fits_locally=False, **SEED))
    assert r.verdict is Verdict.BURST
    assert "memory" in r.reasons[0]


def test_more_gpus_divide_the_compute_but_not_the_overhead() -> None:
    r = evaluate(GateInputs(s_local=0.0, s_rented=0.17, deadline_h=48, **{**SEED, "gpus": 4}))
    assert r.t_rented_h == pytest.approx(1 / (0.17 * 4) + 0.5)
    assert r.c_rented_usd == pytest.approx(3.0 * 4 * r.t_rented_h)


@pytest.mark.parametrize(("wait_h", "verdict", "says"), [
    (0.0, Verdict.LOCAL, "local finishes in 3.03 h within"),
    (20.0, Verdict.LOCAL, "local finishes in 23.03 h after the 20.00 h of local work queued ahead of it within"),
    (22.0, Verdict.PRICED, "local misses (25.03 h after the 22.00 h of local work queued ahead of it > 24.00 h)"),
])
def test_local_work_queued_ahead_counts_against_the_deadline(wait_h: float, verdict: Verdict, says: str) -> None:
    # Candidate A alone makes its 24 h easily; behind a day of other local work on the one GPU it does not.
    r = evaluate(GateInputs(s_local=0.33, s_rented=2.0, deadline_h=24, local_wait_h=wait_h, **SEED))
    assert r.verdict is verdict and any(says in reason for reason in r.reasons), r.reasons
    assert r.t_local_h == pytest.approx(3.03, abs=0.005) and r.local_wait_h == wait_h  # T_L is the run alone
    if verdict is Verdict.PRICED:
        # Renting saves the wait too: what it saves is local's finish (w + T_L) less T_R.
        assert r.hours_saved == pytest.approx(22 + 3.03 - 1.0, abs=0.005)
        assert r.delta_cost_usd == pytest.approx(3.0 * 1.0 - 0.10 * 3.0303, abs=0.005)


def test_a_wait_the_local_gpu_s_hours_stretch_is_said_as_a_wait_not_as_work_queued_ahead() -> None:
    # 8 GPU hours queued ahead end 21 h from now when the GPU is open only at night: w is 21 h of wall clock.
    r = evaluate(GateInputs(s_local=0.33, s_rented=2.0, deadline_h=30, local_wait_h=21.0, local_queued_h=8.0,
                            **SEED))
    assert r.verdict is Verdict.LOCAL and r.local_queued_h == 8.0
    assert any("local finishes in 24.03 h after a 21.00 h wait for the local GPU (8.00 h of work queued ahead of "
               "it, in local.available_hours) within" in reason for reason in r.reasons), r.reasons
    assert wait_words(21.0, 8.0) == ("21.00 h wait for the local GPU (8.00 h of work queued ahead, in "
                                     "local.available_hours)")
    assert wait_words(21.0, None) == "21.00 h queued ahead"


def test_a_job_late_only_because_of_the_queue_with_renting_too_slow_runs_local_late_not_rethink() -> None:
    r = evaluate(GateInputs(s_local=0.33, s_rented=0.04, deadline_h=24, local_wait_h=22.0, **SEED))
    assert r.verdict is Verdict.LOCAL
    assert any("run local, late (it would make it alone: 3.03 h)" in reason for reason in r.reasons), r.reasons
    alone_too_slow = evaluate(GateInputs(s_local=0.033, s_rented=0.04, deadline_h=24, local_wait_h=2.0, **SEED))
    assert alone_too_slow.verdict is Verdict.RETHINK  # local misses by itself: the queue is not the reason
