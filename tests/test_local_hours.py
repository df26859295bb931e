"""The local GPU's daily hours (`local.available_hours`): a local run pauses while they are over, so its wall-clock
time is the time from now until the GPU has been open for as long as the run needs, not its GPU hours over a share
of the day. The daemon checkpoints a run when they end and resumes it when they begin again."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from orchestrator.app import App
from orchestrator.cli.status import status_data
from orchestrator.core.decision import Decision, decide
from orchestrator.core.gates import Verdict
from orchestrator.core.local_hours import LocalHours
from orchestrator.core.plan import hybrid_plan
from orchestrator.daemon import run_daemon
from orchestrator.lifecycle.local import LocalRunner
from orchestrator.lifecycle.reconcile import Reconciler
from orchestrator.queue import enqueue as enqueue_job
from orchestrator.queue import local_hours
from tests.conftest import assert_config_refused, write_job
from tests.e2e import Daemon, enqueue, events, job, trainer_job, wait_for, write_config
from tests.test_decision import CTX, C

NIGHTS = ((22 * 60.0, 8 * 60.0),)  # 22:00-08:00: the GPU serves a desktop by day


def at(hour: float, windows: tuple[tuple[float, float], ...] = NIGHTS) -> LocalHours:
    return LocalHours(windows=windows, clock_min=hour * 60)


def test_a_run_of_four_hours_queued_at_nine_in_the_evening_is_done_at_two_in_the_morning() -> None:
    assert at(21).wall_h(4) == pytest.approx(5)  # 22:00 to 02:00; a share of the day (10/24) said 9.6 h
    assert at(9).wall_h(4) == pytest.approx(17)  # the same job queued at 09:00: 02:00 too
    assert at(23).wall_h(4) == pytest.approx(4)  # inside the window: no pause


def test_a_run_longer_than_a_night_pauses_for_the_day_and_goes_on_the_next_night() -> None:
    assert at(21).wall_h(12) == pytest.approx(1 + 10 + 14 + 2)  # ends at 00:00 the night after
    assert at(21).wall_h(10) == pytest.approx(11)  # ends at 08:00 exactly, not a day later
    assert at(21).wall_h(20) == pytest.approx(1 + 24 + 10)  # two whole nights: done at 08:00 the day after next
    assert at(21).wall_h(24 * 10) == pytest.approx(1 + 24 * 23 + 10)  # 24 nights: weeks are no slower


def test_windows_that_overlap_count_once_and_start_equal_to_end_is_the_whole_day() -> None:
    overlapping = ((9 * 60.0, 12 * 60.0), (11 * 60.0, 13 * 60.0))
    assert at(9, overlapping).wall_h(4) == pytest.approx(4)
    assert at(9, overlapping).wall_h(5) == pytest.approx(25)  # 09-13 today, then an hour from 09:00 tomorrow
    assert at(17, ((6 * 60.0, 6 * 60.0),)).wall_h(30) == pytest.approx(30)
    assert LocalHours(windows=(), clock_min=0).wall_h(7) == 7


def test_open_now_is_the_window_s_start_but_not_its_end_and_status_says_until_when() -> None:
    assert at(22).is_open() and at(7.99).is_open() and not at(8).is_open() and not at(12).is_open()
    assert LocalHours(windows=(), clock_min=600).is_open()
    assert at(23).until_change_h() == pytest.approx(9)  # open across midnight, until 08:00
    assert at(12).until_change_h() == pytest.approx(10)  # closed until 22:00
    assert at(8).until_change_h() == pytest.approx(14)
    assert LocalHours(windows=(), clock_min=600).until_change_h() is None
    assert at(3, ((6 * 60.0, 6 * 60.0),)).until_change_h() is None


@given(st.lists(st.tuples(st.integers(0, 1439), st.integers(60, 1440)), min_size=1, max_size=4),
       st.integers(0, 1439), st.integers(1, 48 * 60))
@example(windows=[(0, 62)], clock=0, open_min=62)  # exactly what the stretch holds (62 / 60 * 60 > 62 in floats)
@settings(max_examples=500)
def test_the_wall_clock_time_is_what_a_minute_by_minute_walk_takes(windows: list[tuple[int, int]], clock: int,
                                                                   open_min: int) -> None:
    # Whole minutes everywhere, so that each minute of the walk is open or closed throughout: the walk is exact.
    # Windows of an hour at least (start, length), so that it stays short.
    hours = LocalHours(windows=tuple((float(a), float((a + n) % 1440)) for a, n in windows), clock_min=clock)
    day = hours._day()
    t, left = clock, open_min
    while left > 0:
        if any(lo <= t % 1440 < hi for lo, hi in day):
            left -= 1
        t += 1
    assert hours.wall_h(open_min / 60) * 60 == pytest.approx(t - clock, abs=1e-6)
    assert hours.open_h((t - clock) / 60) * 60 == pytest.approx(open_min, abs=1e-6)  # and back


def test_a_night_the_clock_springs_forward_is_an_hour_shorter_and_one_it_falls_back_an_hour_longer() -> None:
    # At 21:00; the clock moves at 02:00, 5 h from now. In spring 22:00-08:00 is 9 hours, in autumn 11.
    spring = LocalHours(windows=NIGHTS, clock_min=21 * 60, shifts=((5 * 60, 60),))
    autumn = LocalHours(windows=NIGHTS, clock_min=21 * 60, shifts=((5 * 60, -60),))
    assert spring.open_h(11) == pytest.approx(9) and autumn.open_h(11) == pytest.approx(10)
    assert spring.wall_h(9) == pytest.approx(10)  # done at 08:00 by the clock, 10 real hours from 21:00
    assert spring.wall_h(10) == pytest.approx(10 + 14 + 1)  # the hour the night lost is trained the next night
    assert autumn.wall_h(10) == pytest.approx(11)  # done at 07:00 by the clock, with an hour of the night to spare
    assert autumn.wall_h(11) == pytest.approx(12)  # the whole night: 08:00, 12 real hours from 21:00
    assert spring.later(10).clock_min == 8 * 60 and spring.later(10).shifts == ()
    assert autumn.later(3).shifts == ((2 * 60, -60),)
    assert spring.later(6).until_change_h() == pytest.approx(4)  # at 04:00 (02:00 was skipped), open until 08:00
    assert autumn.later(6).until_change_h() == pytest.approx(6)  # at 02:00 (the second time), open until 08:00
    assert autumn.one_sitting_wall_h(10.5) == pytest.approx(11.5)  # the long night holds a run no other night does
    assert spring.one_sitting_wall_h(9.5) == pytest.approx(1 + 9 + 14 + 9.5)  # the short one does not
    assert LocalHours(windows=NIGHTS, clock_min=21 * 60).one_sitting_wall_h(10.5) is None


@given(st.lists(st.tuples(st.integers(0, 1439), st.integers(60, 1440)), min_size=1, max_size=3),
       st.integers(0, 1439), st.integers(1, 36 * 60),
       st.lists(st.tuples(st.integers(1, 40 * 60), st.sampled_from([60, -60])), max_size=2, unique_by=lambda s: s[0]))
@settings(max_examples=300)
def test_across_the_clock_s_shifts_every_answer_is_what_a_minute_by_minute_walk_of_real_time_finds(
        windows: list[tuple[int, int]], clock: int, open_min: int, shifts: list[tuple[int, int]]) -> None:
    # Real time is walked a minute at a time; the local clock moves with it and jumps at each shift.
    shifts = sorted(shifts)
    hours = LocalHours(windows=tuple((float(a), float((a + n) % 1440)) for a, n in windows), clock_min=clock,
                       shifts=tuple((float(at), float(moves)) for at, moves in shifts))
    day = hours._day()

    def open_at(r: int) -> bool:  # the real minute [r, r + 1)
        local = clock + r + sum(moves for at, moves in shifts if at <= r)
        return any(lo <= local % 1440 < hi for lo, hi in day)

    r, left = 0, open_min
    while left > 0:
        left -= open_at(r)
        r += 1
    assert hours.wall_h(open_min / 60) * 60 == pytest.approx(r, abs=1e-6)
    assert hours.open_h(r / 60) * 60 == pytest.approx(open_min, abs=1e-6)
    if not hours.always_open():
        change = next(m for m in range(1, 5 * 1440) if open_at(m) != open_at(0))
        assert hours.until_change_h() * 60 == pytest.approx(change, abs=1e-6)
        need = min(open_min, 6 * 60)  # in one sitting: the first run of `need` open minutes from a stretch's start
        starts = [m for m in range(0, 4 * 1440) if open_at(m) and (m == 0 or not open_at(m - 1))]
        fits = [m for m in starts if all(open_at(m + k) for k in range(need))]
        got = hours.one_sitting_wall_h(need / 60)
        assert (got * 60 if got is not None else None) == pytest.approx(fits[0] + need if fits else None, abs=1e-6)


def test_the_clock_s_changes_come_from_local_timezone(tmp_path: Path) -> None:
    # Berlin springs forward at 02:00 on 28 March 2027 and falls back at 03:00 on 31 October.
    config = tmp_path / "burstctl.toml"
    config.write_text('[local]\navailable_hours = ["22:00-08:00"]\ntimezone = "Europe/Berlin"\n')
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    try:
        spring = local_hours(app.config, datetime(2027, 3, 27, 20, 0, tzinfo=UTC).timestamp())  # 21:00 CET
        autumn = local_hours(app.config, datetime(2027, 10, 30, 19, 0, tzinfo=UTC).timestamp())  # 21:00 CEST
        winter = local_hours(app.config, datetime(2027, 1, 9, 20, 0, tzinfo=UTC).timestamp())
    finally:
        app.close()
    assert (spring.clock_min, spring.shifts[0]) == (21 * 60, (5 * 60, 60))
    assert (autumn.clock_min, autumn.shifts[0]) == (21 * 60, (6 * 60, -60))
    assert spring.wall_h(10) == pytest.approx(25) and autumn.wall_h(10) == pytest.approx(11)
    assert winter.wall_h(10) == pytest.approx(11)  # no change that night (the next is in March)


def _window(from_now_h: float, to_now_h: float) -> str:
    """A daily window of local time, as `local.available_hours` takes it, from and to these hours from now."""
    def hhmm(h: float) -> str:
        return (datetime.now() + timedelta(hours=h)).strftime("%H:%M")
    return f"{hhmm(from_now_h)}-{hhmm(to_now_h)}"


def test_a_local_run_is_checkpointed_when_the_gpu_s_hours_end_and_resumes_when_they_begin(tmp_path: Path) -> None:
    state = tmp_path / "state"
    path = trainer_job(tmp_path, "nightly", steps=120, every=10, step_s=0.1, local_throughput=1000, work_units=120,
                       extra=("--out", "result.json"))

    def hours(window: str) -> Path:
        return write_config(tmp_path, None, local={"available_hours": [window]})

    config = hours(_window(-1, 1))
    job_id = enqueue(config, state, path)
    assert job(state, job_id)["placement"] == "local"
    daemon = Daemon(tmp_path, config, state).start()
    try:
        store = state / "checkpoints" / job_id
        wait_for(lambda: store.exists() and any(p.name >= "step-00000020" for p in store.iterdir()), 60,
                 "a checkpoint of step 20")
        hours(_window(2, 3))  # the GPU's hours are over (the daemon reads its edited config at its next tick)
        wait_for(lambda: job(state, job_id)["state"] == "resuming", 60, "the run to be stopped")
        (stopped,) = [e for e in events(state, "attempt.stop_requested") if e["job_id"] == job_id]
        assert stopped["data"]["reason"] == "local-hours"
        assert "local GPU's hours" in job(state, job_id)["reason"]
        time.sleep(3)  # six ticks outside its hours: it stays paused
        assert job(state, job_id)["state"] == "resuming"

        hours(_window(-1, 1))
        wait_for(lambda: job(state, job_id)["state"] == "done", 90, "the job to finish in its hours again")
    finally:
        assert daemon.stop() == 0
    (resumed,) = [e for e in events(state, "job.resumed") if e["job_id"] == job_id]
    assert resumed["data"]["where"] == "local" and resumed["data"]["checkpoint"] >= "step-00000020"
    # Nothing lost or done twice: the result of an uninterrupted run.
    straight = tmp_path / "straight"
    straight.mkdir()
    subprocess.run([sys.executable, str(tmp_path / "work" / "trainer.py"), "--steps", "120", "--checkpoint-every",
                    "10", "--out", str(straight / "result.json")], cwd=straight, check=True, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "BURST_CHECKPOINT_DIR": str(straight / "ckpt")})
    result, expected = (json.loads(p.read_text()) for p in (tmp_path / "work" / "result.json",
                                                            straight / "result.json"))
    assert result["step"] == 120 and result["state_sha256"] == expected["state_sha256"]


def test_status_says_whether_the_local_gpu_may_train_now_and_until_when(tmp_path: Path) -> None:
    now = datetime.now()
    config = tmp_path / "burstctl.toml"
    config.write_text(f'[local]\navailable_hours = ["{_window(2, 3)}"]\n')
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    hours = status_data(app)["local_hours"]
    assert hours["open"] is False and hours["windows"] == [_window(2, 3)]
    opens = datetime.fromtimestamp(hours["until"])
    assert timedelta(hours=1, minutes=58) < opens - now <= timedelta(hours=2)  # at the window's whole minute
    app.close()
    config.write_text("")
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    assert status_data(app)["local_hours"] is None  # no hours set: always open, nothing to say
    app.close()


def test_a_local_job_waiting_for_the_gpu_s_hours_says_when_they_begin(tmp_path: Path) -> None:
    # "waiting for the local GPU's hours" alone left `show` and `list` to guess when; `status` knew.
    config = tmp_path / "burstctl.toml"
    config.write_text(f'[providers.sim]\nenabled = false\n[local]\navailable_hours = ["{_window(20, 23)}"]\n'
                      'timezone = "UTC"\n')
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    job_id = enqueue_job(app, write_job(tmp_path, "nightly", local_throughput=1.0, deadline_hours=48))[0]
    assert app.store.get_job(job_id)["placement"] == "local"
    Reconciler(app, {}, cloud=None).admission.schedule()
    opens = datetime.fromtimestamp(status_data(app)["local_hours"]["until"], UTC)
    assert app.store.get_job(job_id)["reason"] == ("waiting for the local GPU's hours (local.available_hours): they "
                                                   f"begin {opens:%a %H:%M} (UTC)")
    app.close()


def test_a_hybrid_that_cannot_start_locally_is_handed_to_the_cloud_when_its_switch_time_comes(tmp_path: Path
                                                                                              ) -> None:
    # The seed's job C: 30 h locally, 6.4 h rented, due in 12 h: about 6.9 h locally, then the rest rented. Kept off
    # the local GPU (outside its hours, or behind another run), it waits; once the latest safe switch has passed,
    # waiting on for the GPU would cost the deadline, so it is the cloud's now.
    config = tmp_path / "burstctl.toml"
    config.write_text("[policy]\nmax_auto_delta_usd = 50.0\n")
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    job_id = enqueue_job(app, write_job(tmp_path, "big-local-job", local_throughput=0.033, deadline_hours=12,
                                        rented_throughput={"H100": 0.17}, market="on-demand"))[0]
    job = app.store.get_job(job_id)
    assert job is not None and job["placement"] == "hybrid"
    local_h = job["decision"]["plan"][0]["hours"]
    runner = LocalRunner(app)
    assert not runner.hand_over_if_due(job, time.time())  # hours to go: it waits for the GPU
    assert app.store.get_job(job_id)["placement"] == "hybrid"
    assert runner.hand_over_if_due(job, time.time() + local_h * 3600 + 60)
    assert app.store.get_job(job_id)["placement"] == "cloud"
    (switching,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "job.switching"]
    assert "need the cloud now to make the deadline" in switching["data"]["reason"]
    app.close()


def test_a_run_that_cannot_pause_starts_only_in_a_stretch_of_hours_long_enough_for_all_of_it() -> None:
    assert at(23).room_for(9) and not at(23).room_for(9.5) and not at(12).room_for(1)
    assert at(21).one_sitting_wall_h(4) == pytest.approx(5)  # at 22:00, in one sitting anyway
    assert at(7).one_sitting_wall_h(4) == pytest.approx(15 + 4)  # 1 h left tonight: from 22:00
    assert at(7).one_sitting_wall_h(1) == pytest.approx(1)
    assert at(21).one_sitting_wall_h(12) is None  # no night is 12 h long: never here
    assert LocalHours(windows=(), clock_min=0).room_for(100) and at(3, ((0.0, 0.0),)).one_sitting_wall_h(30) == 30


def test_gate_2_runs_a_job_that_cannot_checkpoint_in_one_sitting_or_not_at_all() -> None:
    job = replace(C, s_local=0.25, deadline_h=24, checkpoints=False)  # 4 h of GPU time
    d = decide(job, replace(CTX, local_hours=at(7)))
    assert d.verdict is Verdict.LOCAL and d.gates.t_local_h == pytest.approx(19)  # tonight's stretch, not 1 h now
    assert any("in one sitting" in r for r in d.reasons)
    d = decide(replace(job, s_local=1 / 12), replace(CTX, local_hours=at(7)))  # 12 h: longer than any night
    assert d.verdict is Verdict.BURST and not d.gates.fits_locally
    assert "no stretch of local.available_hours is 12.00 h long" in " ".join(d.gates.reasons)


def test_the_daemon_starts_a_job_that_cannot_checkpoint_only_if_it_ends_before_the_hours_do(tmp_path: Path) -> None:
    config = tmp_path / "burstctl.toml"
    config.write_text(f'[providers.sim]\nenabled = false\n[local]\navailable_hours = ["{_window(-1, 3)}"]\n')
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    (tmp_path / "work").mkdir()
    # Three of today's four hours are left. The job that cannot pause needs 3.5 h: it waits for tomorrow's hours
    # (it makes its deadline then: local). The one behind it, an hour long, can pause: it starts now.
    stubborn, pausable = (enqueue_job(app, write_job(
        tmp_path, name, command=["sleep", "30"], workdir="work", deadline_hours=30, work_units=units,
        local_throughput=2, checkpoint={"resumable": resumable}))[0]
        for name, units, resumable in (("stubborn", 7, False), ("pausable", 2, True)))
    assert [app.store.get_job(j)["placement"] for j in (stubborn, pausable)] == ["local", "local"]
    run_daemon(app, tick_s=0.1, max_ticks=2)
    assert app.store.get_job(pausable)["state"] == "running"
    waiting = app.store.get_job(stubborn)
    assert waiting["state"] == "queued" and "it cannot checkpoint, so it is never paused" in waiting["reason"]
    app.close()


def test_jobs_in_line_for_the_local_gpu_wait_for_its_hours_once_not_once_each(tmp_path: Path) -> None:
    # Seen from 09:00 with the GPU's hours 22:00-08:00: two 4-hour jobs due in 24 h. The first is done at 02:00, 17 h
    # from now; the second follows it, done at 06:00, 21 h from now: both local. Counting the first for its 17
    # wall-clock hours, the second would finish 17 + 17 + 4 h from now and burst.
    config = tmp_path / "burstctl.toml"
    config.write_text(f'[policy]\nmax_auto_delta_usd = 100.0\n[local]\navailable_hours = ["{_window(13, 23)}"]\n')
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    first, second = (app.store.get_job(enqueue_job(app, write_job(
        tmp_path, name, work_units=4, local_throughput=1.0, rented_throughput={"H100": 2.0},
        deadline_hours=24))[0]) for name in ("first", "second"))
    assert first["placement"] == "local" and first["decision"]["t_local_h"] == pytest.approx(17, abs=0.02)
    assert first["decision"]["local_share"] == pytest.approx(4 / 17, abs=0.01)
    assert second["placement"] == "local"
    assert second["decision"]["local_wait_h"] == pytest.approx(17, abs=0.02)
    assert second["decision"]["t_local_h"] == pytest.approx(4, abs=0.02)  # in the same night, after the first
    app.close()


def test_a_job_that_cannot_checkpoint_is_decided_again_when_the_hours_no_longer_hold_its_run(tmp_path: Path) -> None:
    # Decided local while the GPU was always open; then the hours are cut to 3 h a day, and its 3.5 h run cannot
    # pause. Waiting would be forever: it is decided again, and gate 1 sends it to the cloud.
    config = tmp_path / "burstctl.toml"
    config.write_text("[policy]\nmax_auto_delta_usd = 100.0\n")
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    (tmp_path / "work").mkdir()
    job_id = enqueue_job(app, write_job(tmp_path, "stubborn", command=["sleep", "30"], workdir="work",
                                        deadline_hours=30, work_units=7, local_throughput=2,
                                        rented_throughput={"H100": 10.0}, checkpoint={"resumable": False}))[0]
    assert app.store.get_job(job_id)["placement"] == "local"
    app.close()
    config.write_text(f'[policy]\nmax_auto_delta_usd = 100.0\n[providers.sim]\nenabled = false\n'
                      f'[local]\navailable_hours = ["{_window(-1, 2)}"]\n')
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    run_daemon(app, tick_s=0.1, max_ticks=2)
    again = app.store.get_job(job_id)
    assert again["placement"] == "cloud" and again["state"] == "blocked"  # this config has no provider to rent from
    assert again["decision"]["reasons"][0] == ("decided again while queued: its 3.50 h run cannot checkpoint, and no "
                                               "stretch of local.available_hours is that long now")
    (redecided,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "job.redecided"]
    assert redecided["data"]["why"] == "no local stretch long enough"
    app.close()


def test_a_job_made_late_by_one_queued_ahead_of_it_is_decided_again_through_the_gpu_s_hours(tmp_path: Path) -> None:
    # Seen from 09:00 with the GPU's hours 22:00-08:00, 4-hour jobs. `later` (due in 24 h) is queued behind
    # `first` (24 h): done at 06:00, local. Then `urgent` (due in 20 h) comes ahead of it in line. Eight GPU hours
    # ahead of `later` end at 06:00; it trains until 08:00 and waits for the next night: done 39 h from now, late.
    # Its hours added up without the nights (8 + 4 h) say it is on time.
    config = tmp_path / "burstctl.toml"
    config.write_text(f'[policy]\nmax_auto_delta_usd = 100.0\n[providers.sim]\nenabled = false\n'
                      f'[local]\navailable_hours = ["{_window(13, 23)}"]\n')
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    first, later, urgent = (enqueue_job(app, write_job(
        tmp_path, name, work_units=4, local_throughput=1.0, rented_throughput={"H100": 2.0},
        deadline_hours=deadline_h))[0] for name, deadline_h in (("first", 24), ("later", 24), ("urgent", 20)))
    assert [app.store.get_job(j)["placement"] for j in (first, later, urgent)] == ["local"] * 3
    run_daemon(app, tick_s=0.1, max_ticks=2)
    assert [app.store.get_job(j)["placement"] for j in (first, later, urgent)] == ["local", "cloud", "local"]
    (redecided,) = [e for e in app.store.events(job_id=later) if e["type"] == "job.redecided"]
    assert redecided["data"]["why"] == "late in line"
    decision = app.store.get_job(later)["decision"]
    assert decision["local_wait_h"] == pytest.approx(21, abs=0.02)  # its 8 GPU hours ahead, through the nights
    assert decision["local_queued_h"] == pytest.approx(8, abs=0.02)
    # Said as what it is: 21 h of wall clock for the GPU to be free, 8 h of work (it was "21 h queued ahead").
    assert re.fullmatch(r"decided again while queued: 8\.00 h of local work is now ahead of it in line \(earlier "
                        r"deadlines\), done 2[01]\.\d\d h from now in local\.available_hours, so local no longer "
                        r"makes its deadline", decision["reasons"][0])
    assert re.search(r"after a 2[01]\.\d\d h wait for the local GPU \(8\.00 h of work queued ahead of it, in "
                     r"local\.available_hours\)", " ".join(decision["reasons"]))
    record = Path(app.store.get_job(later)["record_path"]).read_text()
    assert re.search(r"w = 2[01]\.\d\d h wait for the local GPU \(8\.00 h of work queued ahead, in "
                     r"local\.available_hours\) \+ T_L", record)
    assert decision["first_plan"]["plan"] == "local" and decision["decisions"] == 2
    app.close()


def test_the_hours_are_read_in_local_timezone_whatever_zone_the_daemon_runs_under(tmp_path: Path) -> None:
    # 12:00 UTC is 02:00 the next day on Kiritimati (UTC+14) and midnight at UTC-12: a 01:00-03:00 window is open
    # in the first and closed in the second, whatever TZ this process has.
    noon_utc = datetime(2026, 12, 2, 12, 0, tzinfo=UTC).timestamp()
    config = tmp_path / "burstctl.toml"

    def in_zone(zone: str) -> LocalHours:
        config.write_text(f'[local]\navailable_hours = ["01:00-03:00"]\ntimezone = "{zone}"\n')
        app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
        try:
            return local_hours(app.config, noon_utc)
        finally:
            app.close()

    kiritimati, west = in_zone("Pacific/Kiritimati"), in_zone("Etc/GMT+12")
    assert kiritimati.is_open() and kiritimati.until_change_h() == pytest.approx(1)
    assert not west.is_open() and west.until_change_h() == pytest.approx(1)
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    shown = status_data(app, noon_utc)["local_hours"]
    app.close()
    assert shown["open"] is False and shown["until"] == pytest.approx(noon_utc + 3600)
    assert shown["timezone"] == "Etc/GMT+12" and shown["until_local"] == "2026-12-02T01:00-12:00"


def test_a_time_zone_that_is_not_one_is_refused_in_one_line(burstctl, tmp_path: Path) -> None:
    assert_config_refused(burstctl, tmp_path, '[local]\ntimezone = "Mars/Base"\n', "budget", "local.timezone",
                          "'Mars/Base' is not a time zone")


def test_a_hybrid_s_local_phase_is_planned_hour_by_hour_through_the_gpu_s_hours() -> None:
    # The seed's job C (30 h locally, due in 12 h) with the GPU's nights 22:00-08:00.
    def plan_at(hour: float) -> Decision:
        return decide(C, replace(CTX, local_hours=at(hour)))

    always = decide(C, CTX)
    assert always.plan is not None and always.plan.kind == "hybrid"
    # Queued at nightfall: the local phase trains every hour of it, as if the GPU were always open.
    night = plan_at(22)
    assert night.plan is not None and [p.as_dict() for p in night.plan.phases] == [
        p.as_dict() for p in always.plan.phases]
    # Queued at 19:00: closed for 3 h, then open. The phase trains its hours after 22:00 only, and the rest, rented,
    # still ends by the deadline less t_ovh and the margin.
    evening = plan_at(19)
    assert evening.plan is not None and evening.plan.kind == "hybrid"
    local, cloud = evening.plan.phases
    assert local.work_units == pytest.approx(C.s_local * (local.hours - 3))
    assert local.cost_usd == pytest.approx(CTX.local_usd_h * (local.hours - 3))  # power only while it trains
    assert local.hours + cloud.hours + CTX.hybrid_margin_h == pytest.approx(C.deadline_h)
    assert evening.local_share == pytest.approx((local.hours - 3) / local.hours)  # what the local queue counts
    assert "(the GPU open 2.94 h of them, local.available_hours)" in " ".join(evening.reasons)
    # Queued at 09:00: closed until after the hand-over must come. A local phase would train nothing: burst now.
    # (The whole run's share of open hours, 0.36, would have planned 5 h of "local" work that never happens.)
    morning = plan_at(9)
    assert morning.plan is not None and morning.plan.kind == "burst"
    # Queued at 07:00: one hour of the night is left. It trains that hour and hands over when the hours end, not at
    # the latest safe switch hours later: waiting on would train nothing.
    dawn = plan_at(7)
    assert dawn.plan is not None and dawn.plan.kind == "hybrid"
    local, cloud = dawn.plan.phases
    assert local.hours == pytest.approx(1) and local.work_units == pytest.approx(C.s_local)
    assert cloud.start_after_h == pytest.approx(1) and dawn.local_share == 1.0


def test_a_hybrid_kept_off_the_gpu_by_its_hours_until_after_its_hand_over_bursts_at_once(tmp_path: Path) -> None:
    # Job C, planned hybrid while the GPU was always open: about 6.7 h local, then the rest rented. Its hours are
    # then set. If they begin in 2 h it waits for them (4 h to train before the hand-over); if they begin only in
    # 10 h it would train nothing before its hand-over, so it goes now: the same cloud phase, with more slack.
    config = tmp_path / "burstctl.toml"
    config.write_text("[policy]\nmax_auto_delta_usd = 50.0\n")
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    job_id = enqueue_job(app, write_job(tmp_path, "big-local-job", local_throughput=0.033, deadline_hours=12,
                                        rented_throughput={"H100": 0.17}, market="on-demand"))[0]
    app.close()
    for opens_in_h, hands_over in ((2, False), (10, True)):
        config.write_text(f'[policy]\nmax_auto_delta_usd = 50.0\n[local]\n'
                          f'available_hours = ["{_window(opens_in_h, opens_in_h + 8)}"]\n')
        app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
        job = app.store.get_job(job_id)
        assert job["placement"] == "hybrid"
        assert LocalRunner(app).hand_over_if_due(job, time.time()) is hands_over
        app.close()
    app = App(config_path=str(config), state_dir_override=str(tmp_path / "state"))
    assert app.store.get_job(job_id)["placement"] == "cloud"
    (switching,) = [e for e in app.store.events(job_id=job_id) if e["type"] == "job.switching"]
    assert "do not begin again before its hand-over at" in switching["data"]["reason"]
    assert "nothing more to train locally, so it bursts now" in switching["data"]["reason"]
    app.close()


@given(st.lists(st.tuples(st.integers(0, 1439), st.integers(30, 1440)), min_size=1, max_size=3),
       st.integers(0, 1439), st.floats(0.01, 0.4), st.floats(1.5, 72))
def test_a_hybrid_planned_through_any_hours_still_makes_its_deadline_and_trains_what_it_says(
        windows: list[tuple[int, int]], clock: int, s_local: float, deadline_h: float) -> None:
    hours = LocalHours(windows=tuple((float(a), float((a + n) % 1440)) for a, n in windows), clock_min=clock)
    plan = hybrid_plan(work=1.0, s_local=s_local, s_rented=0.5, gpus=1, overhead_h=0.5, deadline_h=deadline_h,
                       margin_h=0.5, local_usd_h=0.1, rented_usd_per_gpu_h=3.0, market="on-demand", gpu="H100",
                       open_h=hours.open_h)
    if plan is None:  # nothing to train before a hand-over that must come
        return
    local, cloud = plan.phases
    assert local.hours + cloud.hours + 0.5 <= deadline_h + 1e-6
    assert local.work_units == pytest.approx(min(s_local * hours.open_h(local.hours), 1.0)) and local.work_units > 0
    assert cloud.work_units == pytest.approx(1.0 - local.work_units) and cloud.start_after_h == local.hours
