"""Jobs on a schedule: the daemon queues one cycle per slot, never a slot from before the schedule was there, only the
newest of the slots it slept through, never one while the previous cycle runs (unless told), never twice, and
nothing for a job file that does not validate, saying so once."""

from __future__ import annotations

import json
import math
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from zoneinfo import ZoneInfo

import pytest
from apscheduler.triggers.cron import CronTrigger

from orchestrator.app import App
from orchestrator.config import Config, Schedule
from orchestrator.schedules import (
    KEY_PREFIX,
    _trigger,
    cycles_among,
    fire_due,
    newest_slot,
    next_slot,
    slots_between,
)
from state import schema as s
from tests.conftest import assert_config_refused, write_job


@pytest.fixture
def burstctl(burstctl_in_process):  # the CLI in this process; a daemon's in its own (`burstctl_subprocess`)
    return burstctl_in_process


DAY = 86400.0
ARMED = datetime(2030, 1, 7, 3, 0, tzinfo=UTC).timestamp()  # a Monday, 03:00 UTC: after that day's 02:00 slot
SLOT_1 = datetime(2030, 1, 8, 2, 0, tzinfo=UTC).timestamp()  # the first slot after it ("0 2 * * *")


def _setup(tmp_path: Path, schedule: str = "", **job: object) -> App:
    (tmp_path / "work").mkdir(exist_ok=True)
    write_job(tmp_path, "nightly", command=["true"], workdir="work", deadline_hours=12, local_throughput=1.0,
              **job)
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text('[[schedule]]\njob = "nightly.toml"\ncron = "0 2 * * *"\ntimezone = "UTC"\n' + schedule)
    return App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))


def _events(app: App, prefix: str = "schedule.") -> list[tuple[str, dict]]:
    return [(e["type"], e["data"]) for e in app.store.events(type_prefix=prefix)]


def _jobs(app: App) -> list[dict]:
    with app.store.engine.connect() as c:
        return [dict(r) for r in c.execute(s.jobs.select().order_by(s.jobs.c.created_at)).mappings()]


def test_a_new_schedule_is_armed_and_queues_from_its_next_slot_on_once_per_slot(tmp_path: Path) -> None:
    app = _setup(tmp_path)
    assert [f.outcome for f in fire_due(app, ARMED)] == ["armed"]  # that day's 02:00 slot was before it existed
    assert fire_due(app, ARMED + 3600) == [] and _jobs(app) == []
    (fired,) = fire_due(app, SLOT_1 + 5)
    assert (fired.outcome, fired.slot_at) == ("queued", SLOT_1)
    assert fire_due(app, SLOT_1 + 10) == []  # the slot is recorded: the next tick queues nothing
    (job,) = _jobs(app)
    assert job["id"] == fired.job_id and job["name"] == "nightly"
    assert job["deadline_at"] == SLOT_1 + 12 * 3600  # counted from the slot, not from when it was queued
    assert job["spec"]["_slot_at"] == SLOT_1
    assert [t for t, _ in _events(app)] == ["schedule.armed", "schedule.queued"]
    queued = _events(app)[1][1]
    assert queued["slot_at"] == SLOT_1 and queued["late_s"] == 5.0 and queued["cron"] == "0 2 * * *"
    app.close()


def test_a_daemon_down_across_slots_queues_only_the_newest_and_skips_one_whose_deadline_passed(
        tmp_path: Path) -> None:
    app = _setup(tmp_path)
    fire_due(app, ARMED)
    (fired,) = fire_due(app, SLOT_1 + 3 * DAY + 3600)  # four slots slept through: one cycle, the newest
    assert fired.slot_at == SLOT_1 + 3 * DAY and len(_jobs(app)) == 1
    # The three before it are said, once, in one event: their cycles never ran.
    (slept,) = [d for t, d in _events(app) if t == "schedule.missed"]
    assert (slept["slots"], slept["first_slot_at"], slept["slot_at"]) == (3, SLOT_1, SLOT_1 + 2 * DAY)
    assert slept["reason"] == ("no tick ran at 3 slots before the one at 2030-01-11 02:00 UTC (the daemon was not "
                               "running, or its ticks were further apart): only the newest is run")
    app.store.update_job(fired.job_id, None, state="done")
    # Down again, past the newest slot's 12 h deadline: nothing to queue, said once.
    (missed,) = fire_due(app, SLOT_1 + 5 * DAY + 13 * 3600)
    assert (missed.outcome, missed.slot_at) == ("missed", SLOT_1 + 5 * DAY)
    assert fire_due(app, SLOT_1 + 5 * DAY + 14 * 3600) == [] and len(_jobs(app)) == 1
    assert [t for t, _ in _events(app)][-2:] == ["schedule.missed"] * 2  # the 4th day's slot slept through, the 5th's
    assert _events(app)[-2][1]["slots"] == 1 and _events(app)[-2][1]["reason"].startswith(
        "no tick ran at 1 slot before")
    app.close()


def test_the_slots_slept_through_are_said_with_the_newest_slot_s_record_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A queue that fails at the newest slot (the database, say) records nothing: the tick after says them then.
    import orchestrator.queue

    app = _setup(tmp_path)
    fire_due(app, ARMED)
    real = orchestrator.queue.enqueue

    def failing(*args: object, **kwargs: object) -> object:
        raise RuntimeError("database is locked")

    monkeypatch.setattr(orchestrator.queue, "enqueue", failing)
    with pytest.raises(RuntimeError):
        fire_due(app, SLOT_1 + DAY + 3600)
    assert [t for t, _ in _events(app)] == ["schedule.armed"]
    monkeypatch.setattr(orchestrator.queue, "enqueue", real)
    (fired,) = fire_due(app, SLOT_1 + DAY + 3600)
    assert fired.outcome == "queued" and fire_due(app, SLOT_1 + DAY + 3700) == []
    assert [t for t, _ in _events(app)] == ["schedule.armed", "schedule.missed", "schedule.queued"]
    app.close()


@pytest.mark.parametrize("overlap", ["skip", "queue"])
def test_a_slot_that_comes_while_the_previous_cycle_is_not_over(tmp_path: Path, overlap: str) -> None:
    app = _setup(tmp_path, f'overlap = "{overlap}"\n')
    fire_due(app, ARMED)
    (first,) = fire_due(app, SLOT_1 + 1)
    (second,) = fire_due(app, SLOT_1 + DAY + 1)  # the first cycle is still queued
    if overlap == "skip":
        assert second.outcome == "skipped" and len(_jobs(app)) == 1
        assert _events(app)[-1][1]["previous_job_id"] == first.job_id
        app.store.update_job(first.job_id, None, state="done")
        (third,) = fire_due(app, SLOT_1 + 2 * DAY + 1)  # over now: the next slot queues
        assert third.outcome == "queued" and len(_jobs(app)) == 2
    else:
        assert second.outcome == "queued" and len(_jobs(app)) == 2
    app.close()


def test_a_job_file_that_does_not_validate_skips_its_slot_says_why_once_and_queues_nothing(tmp_path: Path) -> None:
    app = _setup(tmp_path, kind="pretrain")  # not a job kind
    fire_due(app, ARMED)
    (bad,) = fire_due(app, SLOT_1 + 1)
    assert bad.outcome == "job_invalid" and _jobs(app) == []
    error = _events(app)[-1][1]["error"]
    assert error.startswith(f"{tmp_path / 'nightly.toml'}: field 'kind': ")
    assert fire_due(app, SLOT_1 + 60) == []  # said once for the slot
    write_job(tmp_path, "nightly", command=["true"], workdir="work", deadline_hours=None, local_throughput=1.0,
              deadline="2030-01-20T00:00:00Z")  # an instant: a later cycle would be past it
    (instant,) = fire_due(app, SLOT_1 + DAY + 1)
    assert instant.outcome == "job_invalid" and "field 'deadline': is an instant" in _events(app)[-1][1]["error"]
    write_job(tmp_path, "nightly", command=["true"], workdir="work", deadline_hours=12, local_throughput=1.0)
    (fixed,) = fire_due(app, SLOT_1 + 2 * DAY + 1)  # read again at each slot: the fix applies from the next
    assert fixed.outcome == "queued" and len(_jobs(app)) == 1
    app.close()


def test_a_cycle_is_queued_and_its_slot_recorded_in_one_transaction(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    app = _setup(tmp_path)
    fire_due(app, ARMED)
    real = app.store.set_setting

    def dies_while_recording(key: str, value: object, conn: object = None) -> None:
        if conn is not None and key.startswith(KEY_PREFIX):
            raise RuntimeError("killed")  # inside the job's transaction: the job is rolled back with it
        real(key, value, conn)  # type: ignore[arg-type]

    monkeypatch.setattr(app.store, "set_setting", dies_while_recording)
    with pytest.raises(RuntimeError):
        fire_due(app, SLOT_1 + 1)
    assert _jobs(app) == [] and not list((tmp_path / "state" / "decisions").glob("*.md"))
    monkeypatch.setattr(app.store, "set_setting", real)
    (fired,) = fire_due(app, SLOT_1 + 2)  # the next tick: the same slot, once
    assert fired.outcome == "queued" and len(_jobs(app)) == 1
    app.close()


class Counted:
    """A cron trigger that counts the slots asked of it."""

    def __init__(self, crontab: str) -> None:
        self.trigger = CronTrigger.from_crontab(crontab, timezone="UTC")
        self.timezone = self.trigger.timezone
        self.asked = 0

    def get_next_fire_time(self, previous: datetime | None, now: datetime) -> datetime | None:
        self.asked += 1
        return self.trigger.get_next_fire_time(previous, now)


def test_the_newest_slot_is_found_without_walking_every_slot_of_a_long_sleep() -> None:
    every_minute = Counted("* * * * *")
    yearly = CronTrigger.from_crontab("0 0 1 1 *", timezone="UTC")
    start = datetime(2030, 1, 1, 0, 30, tzinfo=UTC).timestamp()
    a_year_on = start + 365 * DAY  # 00:30 on Jan 1st, 2031: itself a slot
    assert newest_slot(every_minute, start, a_year_on) == a_year_on  # type: ignore[arg-type]
    assert every_minute.asked < 33 * 1440  # the last month's slots, not the year's 525,600
    assert newest_slot(every_minute, start, a_year_on - 1) == a_year_on - 60  # type: ignore[arg-type]
    assert newest_slot(yearly, start, a_year_on) == datetime(2031, 1, 1, tzinfo=UTC).timestamp()
    assert newest_slot(yearly, start, a_year_on - DAY) is None
    assert slots_between(yearly, start - DAY, a_year_on) == [datetime(2030, 1, 1, tzinfo=UTC).timestamp(),
                                                             datetime(2031, 1, 1, tzinfo=UTC).timestamp()]


def test_a_wall_clock_time_that_comes_twice_when_clocks_fall_back_is_one_slot_and_the_walk_goes_on() -> None:
    # 2026-10-25 in Berlin: 02:00-02:59 comes twice (CEST, then CET). A nightly 02:00 cycle runs once, at the first
    # pass, as cron runs it; the walk had found the second pass, then that slot again and again for ever (the
    # daemon's tick, `schedules` and `budget` hung).
    berlin = ZoneInfo("Europe/Berlin")
    night = datetime(2026, 10, 24, 12, tzinfo=UTC).timestamp()
    nightly = CronTrigger.from_crontab("0 2 * * *", timezone="Europe/Berlin")
    assert slots_between(nightly, night, night + DAY) == [datetime(2026, 10, 25, 2, tzinfo=berlin).timestamp()]
    assert newest_slot(nightly, night, night + 1.1 * DAY) == datetime(2026, 10, 25, 2, tzinfo=berlin).timestamp()
    # A cron every 15 minutes runs through the first pass and goes on after the second, none skipped, none twice.
    quarterly = CronTrigger.from_crontab("*/15 1-3 * * *", timezone="Europe/Berlin")
    walls = [datetime.fromtimestamp(t, berlin).strftime("%H:%M%z") for t in slots_between(quarterly, night,
                                                                                            night + DAY)]
    assert walls == [f"{h:02d}:{m:02d}+0200" for h in (1, 2) for m in (0, 15, 30, 45)] + [
        f"03:{m:02d}+0100" for m in (0, 15, 30, 45)]
    # Asked from within the second pass, the next slot is the next one after it.
    second_pass = datetime(2026, 10, 25, 2, 30, fold=1, tzinfo=berlin).timestamp()
    assert next_slot(quarterly, second_pass) == datetime(2026, 10, 25, 3, tzinfo=berlin).timestamp()
    # New York falls back on 2026-11-01: 01:30 comes twice.
    new_york = CronTrigger.from_crontab("30 1 * * *", timezone="America/New_York")
    start = datetime(2026, 10, 31, 12, tzinfo=UTC).timestamp()
    assert len(slots_between(new_york, start, start + DAY)) == 1


@pytest.mark.parametrize(("day_of_week", "weekdays"), [
    ("1", "Mon"), ("0", "Sun"), ("7", "Sun"), ("1-5", "Mon Tue Wed Thu Fri"), ("5-7", "Sun Fri Sat"),
    ("*/2", "Sun Tue Thu Sat"), ("0,6", "Sun Sat"), ("mon-fri", "Mon Tue Wed Thu Fri"), ("sat", "Sat"),
])
def test_days_of_the_week_are_numbered_as_crontab_numbers_them(day_of_week: str, weekdays: str) -> None:
    # APScheduler counts Monday as 0: "0 2 * * 1" had run on Tuesdays, "1-5" Tuesday to Saturday.
    trig = _trigger(f"0 2 * * {day_of_week}", "UTC")
    monday = datetime(2030, 1, 7, tzinfo=UTC).timestamp()
    week = slots_between(trig, monday - 1, monday + 7 * DAY - 1)
    assert sorted(datetime.fromtimestamp(t, UTC).strftime("%a") for t in week) == sorted(weekdays.split())


@pytest.mark.parametrize(("cron", "days"), [
    ("0 2 1 * mon", [1, 6, 13, 20, 27]),  # crontab: the 1st and every Monday (APScheduler: Mondays that are the 1st)
    ("0 2 1,15 * sat,sun", [1, 4, 5, 11, 12, 15, 18, 19, 25, 26]),
    ("0 2 13 * 5", [3, 10, 13, 17, 24, 31]),  # every Friday and the 13th, not only Friday the 13th
    ("0 2 * * mon", [6, 13, 20, 27]),  # one field restricted: that one alone
    ("0 2 1 * *", [1]),
    # A field that starts with `*` is not restricted, by cron's own test, even with a step: both must match.
    ("0 2 */10 * tue", [21]),
])
def test_a_cron_restricting_both_days_fires_on_either_as_crontab_does(cron: str, days: list[int]) -> None:
    # January 2031 starts on a Wednesday. cron(8): "If both fields are restricted, the command will be run when
    # either field matches"; APScheduler wants both, which ran `0 2 1 * mon` only when the 1st was a Monday.
    start = datetime(2031, 1, 1, tzinfo=UTC).timestamp()
    month = slots_between(_trigger(cron, "UTC"), start - 1, start + 31 * DAY - 1)
    assert [datetime.fromtimestamp(t, UTC).day for t in month] == days
    assert all(datetime.fromtimestamp(t, UTC).hour == 2 for t in month)


@pytest.mark.parametrize(("cron", "slots"), [
    ("@weekly", ["05 00:00", "12 00:00", "19 00:00", "26 00:00"]),  # Sundays at midnight, as cron(8) reads it
    ("@monthly", ["01 00:00"]), ("@yearly", ["01 00:00"]), ("@annually", ["01 00:00"]),
    ("@daily", [f"{d:02} 00:00" for d in range(1, 32)]), ("@midnight", [f"{d:02} 00:00" for d in range(1, 32)]),
    ("@HOURLY", [f"{d:02} {h:02}:00" for d in range(1, 32) for h in range(24)]),
])
def test_cron_s_nicknames_are_the_lines_cron_reads_them_for(cron: str, slots: list[str]) -> None:
    start = datetime(2031, 1, 1, tzinfo=UTC).timestamp()  # a Wednesday
    month = slots_between(_trigger(cron, "UTC"), start - 1, start + 31 * DAY - 1)
    assert [datetime.fromtimestamp(t, UTC).strftime("%d %H:%M") for t in month] == slots
    Schedule(job="nightly.toml", cron=cron)  # and the config takes it


def test_slots_a_tick_apart_or_more_are_taken() -> None:
    Config.model_validate({"daemon": {"tick_s": 300}, "schedule": [{"job": "a.toml", "cron": "*/5 * * * *"},
                                                                     {"job": "b.toml", "cron": "@hourly"}]})


@pytest.mark.parametrize(("entry", "field", "says"), [
    ('job = "nightly.toml"\ncron = "0 2 * * monday"', "schedule.0.cron", "is not a crontab: expected five crontab"),
    ('job = "nightly.toml"\ncron = "0 2 * *"', "schedule.0.cron", "is not a crontab"),
    ('job = "nightly.toml"\ncron = "@reboot"', "schedule.0.cron", "or @hourly, @daily, @weekly, @monthly, @yearly"),
    ('job = "nightly.toml"\ncron = "0 2 * * 8"', "schedule.0.cron", "is not a crontab"),
    # Five fields, one out of range: which one, not "expected five fields".
    ('job = "nightly.toml"\ncron = "61 9 * * *"', "schedule.0.cron", "'61 9 * * *': minute 61 is more than 59"),
    ('job = "nightly.toml"\ncron = "0 9 32 * *"', "schedule.0.cron", "day-of-month 32 is more than 31"),
    # Valid, and never: no February has a 30th (with a day of the week too, that day alone would do).
    ('job = "nightly.toml"\ncron = "0 2 30 2 *"', "schedule.0.cron", "'0 2 30 2 *' matches no date"),
    ('job = "nightly.toml"\ncron = "0 2 * * *"\ntimezone = "Mars/Base"', "schedule.0.timezone",
     "'Mars/Base' is not a time zone"),
    ('job = "nightly.toml"\ncron = "0 2 * * *"\noverlap = "maybe"', "schedule.0.overlap", "'skip' or 'queue'"),
    ('job = "nightly.toml"\ncron = "0 2 * * *"\n\n[[schedule]]\njob = "./nightly.toml"\ncron = "0 3 * * *"',
     "schedule.1.job", "has a schedule already"),
    # Slots closer than the ticks: each tick would pass some by, and say so.
    ('job = "nightly.toml"\ncron = "*/2 * * * *"\n\n[daemon]\ntick_s = 300', "schedule.0.cron",
     "'*/2 * * * *' has slots 120 s apart, closer than daemon.tick_s (300 s)"),
    ('job = "nightly.toml"\ncron = "0,1 2 * * *"\n\n[daemon]\ntick_s = 90', "schedule.0.cron", "has slots 60 s apart"),
])
def test_a_bad_schedule_is_one_line_naming_the_file_and_field_and_changes_nothing(
        burstctl, tmp_path: Path, entry: str, field: str, says: str) -> None:
    assert_config_refused(burstctl, tmp_path, f"[[schedule]]\n{entry}\n", "schedules", field, says)


def test_a_daemon_whose_tick_is_longer_than_a_schedules_slots_apart_is_refused_before_it_starts(
        burstctl_subprocess, tmp_path: Path) -> None:
    # The config's own tick is checked as the file is read; `daemon --tick` overrides it, and is checked the same.
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text('[[schedule]]\njob = "nightly.toml"\ncron = "*/2 * * * *"\n')
    r = burstctl_subprocess("--config", str(cfg), "daemon", "--tick", "300", "--max-ticks", "1")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.strip() == (f"burstctl: error: {cfg}: field 'schedule.0.cron': '*/2 * * * *' has slots 120 s "
                                "apart, closer than --tick (300 s): expected slots at least a tick apart, or a "
                                "shorter tick")
    app = App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))
    assert app.store.get_setting("daemon", None) is None  # it never started
    app.close()


def test_the_daemon_queues_a_due_slot_runs_the_cycle_and_schedules_says_so(burstctl, burstctl_subprocess,
                                                                          tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    write_job(tmp_path, "every-minute", command=["true"], workdir="work", deadline_hours=4, local_throughput=1.0)
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text('[daemon]\ntick_s = 0.5\n\n[[schedule]]\njob = "every-minute.toml"\ncron = "* * * * *"\n')
    app = App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))
    app.store.set_setting(KEY_PREFIX + str(tmp_path / "every-minute.toml"), {"armed_at": time.time() - 120})
    app.close()

    r = burstctl_subprocess("--config", str(cfg), "daemon", "--exit-when-idle")
    assert r.returncode == 0, r.stderr[-2000:]
    listed = json.loads(burstctl("--config", str(cfg), "list", "--json").stdout)
    assert [(j["name"], j["state"]) for j in listed] == [("every-minute", "done")]
    (row,) = json.loads(burstctl("--config", str(cfg), "schedules", "--json").stdout)
    assert row["name"] == "every-minute" and row["armed"] and row["problem"] is None
    assert (row["last_job_id"], row["last_job_state"]) == (listed[0]["id"], "done")
    assert row["next_slot_at"] > row["last_slot_at"] > time.time() - 120
    # A cycle of it runs here: nothing of the cloud, last time or planned now.
    assert row["last_cycle_cloud_usd"] == 0 and row["plan_now"]["cloud_usd"] == 0
    assert row["plan_now"]["plan_kind"] == "local"
    budget = json.loads(burstctl("--config", str(cfg), "budget", "--json").stdout)
    # Counted a moment apart: a minute may turn between the two.
    assert abs(budget["scheduled_cycles_left"] - row["cycles_left_this_month"]) <= 1 and row["cycles_left_this_month"]
    assert "queued by its schedule for the slot of " in burstctl("--config", str(cfg), "show", listed[0]["id"]).stdout
    (soonest,) = json.loads(burstctl("--config", str(cfg), "status", "--json").stdout)["schedules"]
    assert soonest == {"job_file": row["job_file"], "next_slot_at": pytest.approx(row["next_slot_at"], abs=60)}
    shown = burstctl("--config", str(cfg), "schedules").stdout
    assert "every-minute" in shown and f"{listed[0]['id']} (done)" in shown and "local, $0.00 of cloud" in shown
    assert "this month's cycles left, planned as a cycle would be now: $0.00 of cloud; $15.00 of the budget" in shown


def test_schedules_prices_a_cycle_that_bursts_and_what_the_month_s_cycles_would_cost(burstctl, tmp_path: Path
                                                                                      ) -> None:
    # The job does not fit locally: each cycle bursts, at today's plan.
    write_job(tmp_path, "weekly", command=["true"], deadline_hours=48, local_throughput=0,
              rented_throughput={"H100": 0.5}, market="on-demand")
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text('[[schedule]]\njob = "weekly.toml"\ncron = "0 2 * * mon"\ntimezone = "UTC"\n')
    decided = json.loads(burstctl("--config", str(cfg), "decide", str(tmp_path / "weekly.toml"), "--json").stdout)
    (row,) = json.loads(burstctl("--config", str(cfg), "schedules", "--json").stdout)
    assert row["plan_now"] == {"verdict": "burst", "plan_kind": "burst", "market": "on-demand",
                               "cloud_usd": pytest.approx(decided["plan_cost_usd"], abs=1e-4),
                               "hours": pytest.approx(sum(p["hours"] for p in decided["plan"]), abs=1e-4)}
    assert row["plan_now"]["cloud_usd"] > 0 and row["last_job_id"] is None and not row["armed"]
    shown = burstctl("--config", str(cfg), "schedules").stdout
    month = row["slots_left_this_month"] * row["plan_now"]["cloud_usd"]
    assert f"planned as a cycle would be now: ${month:,.2f} of cloud" in shown
    assert "the daemon is not running: no cycle is queued until it is" in shown  # a schedule alone does nothing


def test_with_overlap_skip_only_the_slots_that_come_once_the_cycle_before_is_over_count() -> None:
    hourly = [h * 3600.0 for h in range(10)]
    assert cycles_among(hourly, "skip", 2.5) == 4  # at 0, 3, 6 and 9 h
    assert cycles_among(hourly, "skip", 2.5, busy_until=1.5 * 3600) == 3  # one runs until 1.5 h: 2, 5 and 8 h
    assert cycles_among(hourly, "skip", 1.0) == 10  # one that ends as the next slot comes does not skip it
    assert cycles_among(hourly, "queue", 2.5) == 10  # queued beside the one before
    assert cycles_among(hourly, "skip", None) == 10  # no plan to tell how long a cycle takes


def test_a_cycle_planned_longer_than_its_slots_spacing_is_counted_once_per_cycle_not_per_slot(
        burstctl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An hourly cron whose cycle takes 3 h on the local GPU: two slots in three are skipped (overlap "skip"), so
    # the month holds a third of its slots' cycles, and `budget` counts those. Asked at noon on 10 January 2031:
    # 515 hourly slots to the month's end (13:00 on the 10th to 23:00 on the 31st; 00:00 on 1 February is
    # February's).
    noon = SimpleNamespace(time=lambda: datetime(2031, 1, 10, 12, 0, 30, tzinfo=UTC).timestamp())
    monkeypatch.setattr("orchestrator.cli.schedules.time", noon)
    monkeypatch.setattr("orchestrator.cli.jobs.time", noon)
    write_job(tmp_path, "hourly", command=["true"], deadline_hours=10, local_throughput=1 / 3)
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text('[providers.sim]\nenabled = false\n\n[[schedule]]\njob = "hourly.toml"\ncron = "0 * * * *"\n'
                   'timezone = "UTC"\n')
    (row,) = json.loads(burstctl("--config", str(cfg), "schedules", "--json").stdout)
    assert row["plan_now"]["hours"] == pytest.approx(3.0)
    slots = row["slots_left_this_month"]
    assert (slots, row["cycles_left_this_month"]) == (515, 172)
    shown = burstctl("--config", str(cfg), "schedules").stdout
    assert f"{math.ceil(slots / 3)} of {slots} slots" in shown
    assert (f'hourly: a cycle takes about 3.0 h, so the slots that come while one runs are skipped (overlap = "skip"): '
            f"{math.ceil(slots / 3)} cycles this month, of {slots} slots") in shown
    budget = json.loads(burstctl("--config", str(cfg), "budget", "--json").stdout)
    assert budget["scheduled_cycles_left"] == 172
    cfg.write_text(cfg.read_text() + 'overlap = "queue"\n')
    (row,) = json.loads(burstctl("--config", str(cfg), "schedules", "--json").stdout)
    assert row["cycles_left_this_month"] == row["slots_left_this_month"]


def test_a_slot_at_the_first_instant_of_next_month_is_next_months(
        burstctl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An @monthly cron fires at 00:00 UTC on the 1st: it had been counted as a cycle left this month, and its cost
    # as this month's.
    noon = SimpleNamespace(time=lambda: datetime(2031, 1, 10, 12, tzinfo=UTC).timestamp())
    monkeypatch.setattr("orchestrator.cli.schedules.time", noon)
    monkeypatch.setattr("orchestrator.cli.jobs.time", noon)
    write_job(tmp_path, "monthly", command=["true"], deadline_hours=10, local_throughput=1)
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text('[providers.sim]\nenabled = false\n\n[[schedule]]\njob = "monthly.toml"\ncron = "@monthly"\n'
                   'timezone = "UTC"\n')
    (row,) = json.loads(burstctl("--config", str(cfg), "schedules", "--json").stdout)
    assert row["next_slot_at"] == datetime(2031, 2, 1, tzinfo=UTC).timestamp()
    assert (row["slots_left_this_month"], row["cycles_left_this_month"]) == (0, 0)
    assert json.loads(burstctl("--config", str(cfg), "budget", "--json").stdout)["scheduled_cycles_left"] == 0


def test_budget_leaves_out_the_cycles_of_a_schedule_whose_job_file_does_not_validate(
        burstctl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The daemon skips such a schedule's slots until the file is fixed: they queue no cycle to count.
    noon = SimpleNamespace(time=lambda: datetime(2031, 1, 10, 12, 0, 30, tzinfo=UTC).timestamp())
    monkeypatch.setattr("orchestrator.cli.schedules.time", noon)
    monkeypatch.setattr("orchestrator.cli.jobs.time", noon)
    write_job(tmp_path, "daily", command=["true"], deadline_hours=10, local_throughput=1)
    write_job(tmp_path, "broken", command=["true"], deadline_hours=10, local_throughput=1, gpus=0)
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text('[providers.sim]\nenabled = false\n\n'
                   + "".join(f'[[schedule]]\njob = "{name}.toml"\ncron = "0 3 * * *"\ntimezone = "UTC"\n\n'
                             for name in ("daily", "broken")))
    rows = json.loads(burstctl("--config", str(cfg), "schedules", "--json").stdout)
    assert [r["cycles_left_this_month"] for r in rows] == [21, 0] and "gpus" in rows[1]["problem"]
    budget = json.loads(burstctl("--config", str(cfg), "budget", "--json").stdout)
    assert (budget["scheduled_cycles_left"], budget["schedules_skipped"]) == (21, [str(tmp_path / "broken.toml")])
    shown = burstctl("--config", str(cfg), "budget").stdout
    assert (f"not counted: 1 schedule(s) whose job file does not validate now, skipped at their slots "
            f"({tmp_path / 'broken.toml'}; `burstctl schedules` says why)") in shown.replace("\n", "")


def test_a_schedule_whose_job_file_does_not_validate_has_no_cycles_left_as_budget_counts_it(
        burstctl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The daemon skips its every slot until the file is fixed: `schedules` had counted them as cycles left this
    # month (4 Mondays), while `budget` counted none and said the schedule queued nothing.
    noon = SimpleNamespace(time=lambda: datetime(2031, 1, 3, 12, tzinfo=UTC).timestamp())  # a Friday: 4 Mondays left
    monkeypatch.setattr("orchestrator.cli.schedules.time", noon)
    monkeypatch.setattr("orchestrator.cli.jobs.time", noon)
    write_job(tmp_path, "weekly", command=["true"], deadline_hours=10, local_throughput=1, gpus=0)
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text('[providers.sim]\nenabled = false\n\n[[schedule]]\njob = "weekly.toml"\ncron = "0 2 * * mon"\n'
                   'timezone = "UTC"\n')
    (row,) = json.loads(burstctl("--config", str(cfg), "schedules", "--json").stdout)
    assert (row["slots_left_this_month"], row["cycles_left_this_month"]) == (4, 0)
    assert row["plan_now"] is None and "gpus" in row["problem"]
    shown = burstctl("--config", str(cfg), "schedules")
    assert shown.returncode == 0, shown.stderr
    assert "of 4 slots" not in shown.stdout and "│ 4 " not in shown.stdout
    assert f"{tmp_path / 'weekly.toml'} would be skipped at its slot:" in shown.stdout.replace("\n", "")
    budget = json.loads(burstctl("--config", str(cfg), "budget", "--json").stdout)
    assert (budget["scheduled_cycles_left"], budget["schedules_skipped"]) == (0, [str(tmp_path / "weekly.toml")])


def test_budget_weighs_what_the_scheduled_cycles_would_rent_against_what_is_free(
        burstctl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # It had compared the count of every cycle, local ones too, with the reference cycles the money buys: an
    # every-minute local schedule "needed" 40,000 cycles of a $15 budget. Asked on Friday 10 January 2031: three
    # Mondays are left.
    noon = SimpleNamespace(time=lambda: datetime(2031, 1, 10, 12, tzinfo=UTC).timestamp())
    monkeypatch.setattr("orchestrator.cli.schedules.time", noon)
    monkeypatch.setattr("orchestrator.cli.jobs.time", noon)
    write_job(tmp_path, "weekly", command=["true"], deadline_hours=48, local_throughput=0,
              rented_throughput={"H100": 0.5}, market="on-demand")
    write_job(tmp_path, "often", command=["true"], deadline_hours=4, local_throughput=60.0)
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text('[providers.sim]\nenabled = false\n\n[[schedule]]\njob = "often.toml"\ncron = "* * * * *"\n'
                   'timezone = "UTC"\n')
    shown = burstctl("--config", str(cfg), "budget")
    assert shown.returncode == 0 and "waits, blocked by the budget" not in shown.stdout  # local cycles rent nothing
    cfg.write_text(cfg.read_text() + '\n[[schedule]]\njob = "weekly.toml"\ncron = "0 2 * * mon"\ntimezone = "UTC"\n')
    rows = json.loads(burstctl("--config", str(cfg), "schedules", "--json").stdout)
    weekly = next(r for r in rows if r["name"] == "weekly")
    assert weekly["cycles_left_this_month"] == 3
    budget = json.loads(burstctl("--config", str(cfg), "budget", "--json").stdout)
    assert budget["scheduled_cloud_usd"] == pytest.approx(3 * weekly["plan_now"]["cloud_usd"], abs=1e-3)
    assert budget["scheduled_cloud_usd"] > budget["free_usd"]
    assert (f"the schedules' cycles left this month would rent ${budget['scheduled_cloud_usd']:,.2f}, each planned "
            f"as one queued now (`burstctl schedules`), and ${budget['free_usd']:,.2f} is free") in \
        burstctl("--config", str(cfg), "budget").stdout


def test_schedules_names_an_absolute_deadline_as_the_problem_every_slot_would_skip_for(burstctl, tmp_path: Path
                                                                                        ) -> None:
    # The daemon refuses it at each slot (`schedule.job_invalid`): `schedules` says so now, and prices no cycle.
    write_job(tmp_path, "weekly", command=["true"], deadline_hours=None, local_throughput=1.0,
              deadline="2030-01-20T00:00:00Z")
    cfg = tmp_path / "burstctl.toml"
    cfg.write_text('[[schedule]]\njob = "weekly.toml"\ncron = "0 2 * * mon"\ntimezone = "UTC"\n')
    (row,) = json.loads(burstctl("--config", str(cfg), "schedules", "--json").stdout)
    assert row["plan_now"] is None and "field 'deadline': is an instant" in row["problem"]
    assert "would be skipped at its slot" in burstctl("--config", str(cfg), "schedules").stdout


def test_a_schedule_taken_out_of_the_config_and_put_back_is_armed_afresh_not_caught_up(tmp_path: Path) -> None:
    app = _setup(tmp_path)
    fire_due(app, ARMED)
    cfg = tmp_path / "burstctl.toml"
    with_schedule = cfg.read_text()
    app.close()
    cfg.write_text("")
    app = App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))
    assert [f.outcome for f in fire_due(app, ARMED + DAY)] == ["removed"]
    assert fire_due(app, ARMED + DAY + 1) == []
    app.close()
    cfg.write_text(with_schedule)
    app = App(config_path=str(cfg), state_dir_override=str(tmp_path / "state"))
    # Back ten days later: the slots while it was out are not its to catch up.
    assert [f.outcome for f in fire_due(app, ARMED + 10 * DAY)] == ["armed"] and _jobs(app) == []
    assert [f.outcome for f in fire_due(app, SLOT_1 + 10 * DAY + 1)] == ["queued"]
    app.close()


@pytest.mark.slow
def test_a_scheduled_cycle_that_does_not_fit_locally_bursts_and_schedules_prices_it(tmp_path: Path) -> None:
    from tests.e2e import cli, daemon_until, sim_instances, simcloud, trainer_job, write_config

    state = tmp_path / "state"
    spec = trainer_job(tmp_path, "weekly-burst", steps=20, every=5, step_s=0.05)  # no local throughput: it bursts
    now = datetime.now(UTC)
    cron = f"{now.minute} {now.hour} * * *"  # its slot is this minute's, which has come; the next is tomorrow
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url)
        config.write_text(config.read_text() + f'\n[[schedule]]\njob = "weekly-burst.toml"\ncron = "{cron}"\n'
                                               'timezone = "UTC"\n')
        app = App(config_path=str(config), state_dir_override=str(state))
        app.store.set_setting(KEY_PREFIX + str(spec.resolve()), {"armed_at": time.time() - 120})
        app.close()

        def cycle_done() -> bool:
            listed = json.loads(cli(config, state, "list", "--json").stdout)
            return [j["state"] for j in listed] == ["done"]

        daemon_until(tmp_path, config, state, cycle_done, 180, "the scheduled cycle to burst and finish")
        instances = sim_instances(url)
    (row,) = json.loads(cli(config, state, "schedules", "--json").stdout)
    assert row["last_job_state"] == "done" and row["last_cycle_cloud_usd"] > 0
    (listed,) = json.loads(cli(config, state, "list", "--json").stdout)
    assert listed["verdict"] == "burst" and listed["id"] == row["last_job_id"]
    assert len(instances) == 1 and instances[0]["status"] == "terminated"
