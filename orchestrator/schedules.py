"""Jobs on a schedule (`[[schedule]]` in the config): the daemon queues each cycle when its slot comes.

Level-triggered, like the rest of the daemon: every tick compares each schedule's slots with what the database says
it last did (the setting `schedule:<job file>`), and queues the newest slot that has come since, if any. So:
- A schedule seen for the first time is armed (`schedule.armed`) and fires from its next slot on: adding one to
  the config never queues a slot from before it was there. One taken out of the config is forgotten
  (`schedule.removed`), so putting it back arms it afresh.
- A daemon that was down across several slots queues only the newest of them, its deadline counted from that slot;
  when that deadline has passed too, the slot is skipped (`schedule.missed`). The older ones are said as missed
  too, once, in one event with how many they were (`slots`), recorded with the newest slot.
- The cycle is queued and the slot recorded in one transaction: a daemon killed at any moment queues a slot once.
- A slot that comes while the schedule's previous cycle is not over is skipped (`schedule.skipped`), unless the
  schedule says `overlap = "queue"`.
- A job file that does not validate at its slot skips that slot, said with the line `enqueue` would print
  (`schedule.job_invalid`); nothing is queued.
Each cycle is then a job like any other: both gates, the market and this month's budget decide it when it is queued.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from apscheduler.triggers.cron import CronTrigger

from orchestrator.app import App
from orchestrator.config import Schedule
from orchestrator.core import crontab
from orchestrator.errors import BadInput
from orchestrator.jobspec import JobSpec, load_job
from orchestrator.lifecycle.states import FINAL, JobState

KEY_PREFIX = "schedule:"  # settings key, + the job file's resolved path
DENSE_WINDOW_S = 32 * 86400.0  # newest_slot looks this far back first (a month and a bit)
_TICK = timedelta(microseconds=1)  # APScheduler's "next" is at or after its `now`: strictly after a slot


def load_cycle_job(path: Path, slot: float) -> tuple[JobSpec, float]:
    """A schedule's job file read for a cycle at `slot` (its deadline counted from the slot). An absolute
    `deadline` is refused: every cycle after the first would be past it."""
    spec, deadline_at = load_job(path, slot)
    if spec.deadline is not None:
        raise BadInput("is an instant, which a cycle after the first would have passed; expected "
                       "deadline_hours, counted from each slot", source=path, field="deadline")
    return spec, deadline_at


class CronSlots:
    """A cron's slots as crontab(5) reads it, from one APScheduler trigger or the earliest of two
    (`crontab.as_apscheduler`): what the walks below ask of a trigger."""

    def __init__(self, triggers: list[CronTrigger]) -> None:
        self.triggers = triggers
        self.timezone = triggers[0].timezone

    def get_next_fire_time(self, previous: datetime | None, now: datetime) -> datetime | None:
        fires = [at for t in self.triggers if (at := t.get_next_fire_time(previous, now)) is not None]
        return min(fires, default=None)


def trigger(sched: Schedule) -> CronSlots:
    """The schedule's cron in its time zone (unset: this machine's, daylight saving included)."""
    return _trigger(sched.cron, sched.timezone)


@functools.lru_cache(maxsize=256)
def _trigger(cron: str, timezone: str | None) -> CronSlots:
    # Built once per cron, not at every tick: parsing one costs about as much as the look at its slots. Its days of
    # the week as crontab numbers them (Sunday = 0), not as APScheduler does (Monday = 0).
    return CronSlots([CronTrigger.from_crontab(c, timezone=timezone) for c in crontab.as_apscheduler(cron)])


def next_slot(trig: CronSlots | CronTrigger, after: float) -> float | None:
    """The first slot strictly after `after` (unix seconds). A wall-clock time that comes twice, in the hour clocks
    fall back, is a slot once, at its first pass, as cron runs it."""
    probe = datetime.fromtimestamp(after, trig.timezone) + _TICK
    minute = math.floor(after / 60) * 60.0
    while True:
        at = trig.get_next_fire_time(None, probe)
        if at is None:
            return None
        if at.timestamp() > after and not at.fold:  # fold 1: the repeated hour's second pass
            return at.timestamp()
        # APScheduler reads a wall-clock time of the repeated hour as its first pass whatever the datetime's fold,
        # so from there it finds slots already behind (it had looped for ever). Cron slots are whole minutes: look
        # on from the next whole minute past both, which leaves the repeated hour within about 60 looks.
        minute = max(minute + 60, math.floor(max(after, at.timestamp()) / 60) * 60 + 60)
        probe = datetime.fromtimestamp(minute, trig.timezone)


def slots_between(trig: CronSlots | CronTrigger, after: float, until: float) -> list[float]:
    """The slots in (after, until], oldest first (callers ask for a month at most: 44,640 slots of a cron that
    fires every minute, 0.8 s)."""
    found: list[float] = []
    at = next_slot(trig, after)
    while at is not None and at <= until:
        found.append(at)
        at = next_slot(trig, at)
    return found


def cycles_among(slots: list[float], overlap: str, cycle_h: float | None, busy_until: float | None = None) -> int:
    """How many of `slots` (oldest first) queue a cycle: each one, or with overlap "skip" those that come once the
    cycle queued before has had `cycle_h` hours to run (`busy_until`: when the one running now should be over). An
    estimate: the daemon skips a slot while the cycle before is not over, whatever it took."""
    if overlap != "skip" or not cycle_h:
        return len(slots)
    count, free_at = 0, busy_until or -math.inf
    for slot in slots:
        if slot >= free_at:
            count, free_at = count + 1, slot + cycle_h * 3600.0
    return count


def newest_slot(trig: CronSlots | CronTrigger, after: float, until: float) -> float | None:
    """The newest slot in (after, until]. Looks back a month first, so a daemon that was down for a year on an
    hourly cron walks a month of slots, not a year; a cron sparser than that walks the rest, which is short."""
    start = max(after, until - DENSE_WINDOW_S)
    for lo, hi in ((start, until), (after, start)):
        found = slots_between(trig, lo, hi)
        if found:
            return found[-1]
    return None


@dataclass(frozen=True)
class Fired:
    """What a schedule did at a tick (for tests and the event log)."""

    job_file: str
    outcome: str  # armed | queued | skipped | missed | job_invalid | removed
    slot_at: float | None = None
    job_id: str | None = None


def fire_due(app: App, now: float | None = None) -> list[Fired]:
    """The daemon's tick: queue every schedule's newest slot that has come since its last (see the module's
    docstring). Returns what was done; nothing for a schedule with no slot due."""
    now = time.time() if now is None else now
    done: list[Fired] = []
    configured = {app.config.schedule_job(sched): sched for sched in app.config.schedule}
    records: dict[str, Any] = app.store.settings_with_prefix(KEY_PREFIX)  # one read for them all, every tick
    for key in set(records) - {KEY_PREFIX + str(path) for path in configured}:
        # Taken out of the config: forgotten, so that one put back later is armed afresh rather than catching up.
        app.store.delete_setting(key)
        app.events.emit("schedule.removed", job_file=key.removeprefix(KEY_PREFIX))
        done.append(Fired(key.removeprefix(KEY_PREFIX), "removed"))
    for path, sched in configured.items():
        key = KEY_PREFIX + str(path)
        rec: dict[str, Any] | None = records.get(key)
        trig = trigger(sched)
        if rec is None:
            app.store.set_setting(key, {"armed_at": now})
            nxt = next_slot(trig, now)
            app.events.emit("schedule.armed", job_file=str(path), cron=sched.cron, next_slot_at=nxt)
            done.append(Fired(str(path), "armed"))
            continue
        last = float(rec.get("last_slot_at") or rec["armed_at"])
        slot = newest_slot(trig, last, now)
        if slot is not None:
            done.append(_fire(app, sched, path, key, rec, slot, now, _slept_through(trig, last, slot)))
    return done


SLEPT_COUNTED = 10_000  # slots slept through counted at most (a year of an every-minute cron is 525,600)


def _slept_through(trig: CronSlots, last: float, slot: float) -> dict[str, Any] | None:
    """The slots between the last one done and `slot`, the newest, at which no tick ran (the daemon was down, or its
    ticks further apart than the slots), as the `schedule.missed` event that says them; None in the usual tick,
    found with one look."""
    first = next_slot(trig, last)
    if first is None or first >= slot:
        return None
    count, newest = 0, first
    at: float | None = first
    while at is not None and at < slot and count < SLEPT_COUNTED:
        count, newest = count + 1, at
        at = next_slot(trig, at)
    more = count == SLEPT_COUNTED and at is not None and at < slot
    return {"slot_at": newest, "first_slot_at": first, "slots": count,
            "reason": f"no tick ran at {'more than ' if more else ''}{count} slot{'s' if count != 1 else ''} before "
                      f"the one at {_utc(slot)} (the daemon was not running, or its ticks were further apart): only "
                      "the newest is run"}


def _utc(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M UTC")


# A slot passed without a cycle, by outcome: the event it is recorded as.
SCHEDULE_EVENTS = {"skipped": "schedule.skipped", "job_invalid": "schedule.job_invalid", "missed": "schedule.missed"}


def _fire(app: App, sched: Schedule, path: Path, key: str, rec: dict[str, Any], slot: float, now: float,
          slept: dict[str, Any] | None) -> Fired:
    """The slot's outcome, recorded with it in one transaction, and with it the slots slept through before it
    (`slept`): each said once."""
    def say_slept(conn: Any) -> None:
        if slept is not None:
            app.events.emit("schedule.missed", job_file=str(path), conn=conn, **slept)

    def passed(outcome: str, **said: Any) -> Fired:
        """The slot is over without a cycle: recorded, so it is said once."""
        with app.store.tx() as conn:
            app.store.set_setting(key, {**rec, "last_slot_at": slot}, conn=conn)
            say_slept(conn)
            app.events.emit(SCHEDULE_EVENTS[outcome], job_file=str(path), slot_at=slot, conn=conn, **said)
        return Fired(str(path), outcome, slot)

    previous = rec.get("last_job_id")
    if previous and sched.overlap == "skip":
        job = app.store.get_job(previous)
        if job is not None and JobState(job["state"]) not in FINAL:
            return passed("skipped", reason=f"its previous cycle {previous} is {job['state']}",
                          previous_job_id=previous)
    try:
        _, deadline_at = load_cycle_job(path, slot)
    except BadInput as exc:
        return passed("job_invalid", error=app.redactor(str(exc)))
    if deadline_at <= now:
        return passed("missed", reason="the daemon was not running at the slot, and its deadline has passed since")
    from orchestrator.queue import enqueue  # the decision core: only once a slot is due

    def record(conn: Any, job_id: str) -> None:
        app.store.set_setting(key, {**rec, "last_slot_at": slot, "last_job_id": job_id}, conn=conn)
        say_slept(conn)

    try:
        job_id, decision, _ = enqueue(app, path, now, slot_at=slot, also=record)
    except BadInput as exc:  # what only the decision finds (a GPU type no price names, sizing)
        return passed("job_invalid", error=app.redactor(str(exc)))
    app.events.emit("schedule.queued", job_id=job_id, job_file=str(path), slot_at=slot, cron=sched.cron,
                    verdict=decision.verdict.value, late_s=round(now - slot, 3))
    return Fired(str(path), "queued", slot, job_id)
