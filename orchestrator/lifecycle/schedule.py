"""Whether a running attempt will end by its job's deadline, at the speed its trainer measures."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from orchestrator.app import App
from orchestrator.core.plan import projected_finish_at

# How a job's reason begins while its run is behind schedule, and once it is back on it (`watch_schedule`).
BEHIND = "behind schedule: "
ON_SCHEDULE_AGAIN = "on schedule again: "


def reported(figures: Mapping[str, Any] | None, key: str) -> float | None:
    """A number the trainer reported (`units_done`, `throughput_units_h`, ...), or None when it is missing, not a
    number, or negative: metrics.json is the trainer's to write, and burstctl acts on nothing else it says."""
    value = (figures or {}).get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def behind(job: dict[str, Any], where: str, figures: Mapping[str, Any] | None, now: float
           ) -> tuple[float, float, float, str] | None:
    """When the trainer's measured speed puts the end of the run past the deadline: (units done, units/h measured,
    projected end, what to say); None while it is on time or has not said."""
    done, speed = reported(figures, "units_done"), reported(figures, "throughput_units_h")
    if done is None or speed is None:
        return None
    work = float(job["spec"].get("work_units", 1.0))
    ends = projected_finish_at(now=now, work=work, done=done, units_h=speed)
    if ends is None or ends <= float(job["deadline_at"]):
        return None
    late_h = (ends - float(job["deadline_at"])) / 3600.0
    spec = job["spec"]
    if where == "local":
        planned = float(spec.get("local_throughput") or 0.0)
    else:
        planned = spec["rented_throughput"].get(job["decision"].get("gpu") or "", 0.0) * int(spec.get("gpus", 1))
    at = datetime.fromtimestamp(ends, UTC).strftime("%Y-%m-%d %H:%M UTC")
    return done, speed, ends, (f"{BEHIND}at the {speed:.4g} units/h measured ({planned:.4g} planned), the "
                               f"{work - done:.4g} units left end {at}, {late_h:.2f} h after the deadline")


def _on_time(job: dict[str, Any], figures: Mapping[str, Any] | None, now: float) -> str | None:
    """What a run that was behind says once its measured speed makes the deadline again."""
    done, speed = reported(figures, "units_done"), reported(figures, "throughput_units_h")
    if done is None or speed is None:
        return None
    ends = projected_finish_at(now=now, work=float(job["spec"].get("work_units", 1.0)), done=done, units_h=speed)
    if ends is None:
        return None
    at = datetime.fromtimestamp(ends, UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{ON_SCHEDULE_AGAIN}at the {speed:.4g} units/h measured, the run ends {at}, before the deadline"


def watch_schedule(app: App, att: dict[str, Any], job: dict[str, Any], info: dict[str, Any], now: float) -> None:
    """Say so, once an attempt, when the trainer's measured speed puts the end of the run past the deadline
    (`job.behind_schedule`, and the job's reason): a GPU slower than the job file's s_L or s_R is the user's to
    know while there is time to act on it. The reason then follows the measured speed (no more events): the first
    figure, taken seconds after a start, is often not the run's."""
    where = att.get("where", "cloud")
    late = behind(job, where, info.get("metrics"), now)
    said = job.get("reason") or ""
    if info.get("behind_schedule"):
        if late is not None and said.startswith((BEHIND, ON_SCHEDULE_AGAIN)) and said != late[3]:
            app.store.update_job(job["id"], reason=late[3])
            job["reason"] = late[3]
        elif late is None and said.startswith(BEHIND):
            again = _on_time(job, info.get("metrics"), now)
            if again is not None:
                app.store.update_job(job["id"], reason=again)
                job["reason"] = again
        return
    if late is None:
        return
    done, speed, ends, why = late
    info["behind_schedule"] = now
    job["reason"] = why
    with app.store.tx() as conn:
        app.store.update_job(job["id"], conn, reason=why)
        app.events.emit("job.behind_schedule", job_id=job["id"], attempt_id=att["id"], conn=conn,
                        where=where, units_done=round(done, 6),
                        throughput_units_h=round(speed, 6), projected_end=round(ends, 3),
                        late_h=round((ends - float(job["deadline_at"])) / 3600.0, 4))
