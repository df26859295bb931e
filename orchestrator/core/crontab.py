"""A five-field crontab as APScheduler's `CronTrigger.from_crontab` should read it. Pure.

APScheduler numbers the days of the week from Monday = 0, crontab(5) from Sunday = 0 (and 7): `0 2 * * 1` is a
Monday in crontab and a Tuesday to APScheduler, `*/2` is Sun, Tue, Thu, Sat in crontab and Mon, Wed, Fri, Sun to
APScheduler. So the day-of-week field is read here, by crontab's rules, into the days' names, which both agree on.
The other four fields mean the same to both and pass through. When both the day of the month and the day of the
week are restricted, crontab takes a day that matches either and APScheduler only one that matches both; such a
cron is read as two APScheduler crontabs whose slots are joined (`as_apscheduler`).
"""

from __future__ import annotations

DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")  # crontab's numbers 0-6 (7 is Sunday again)
# The nicknames cron(8) takes for a whole line (`@reboot` is none: a schedule has slots, not a boot).
ALIASES = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
           "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *"}


def five_fields(cron: str) -> str:
    """`cron` as five fields: a nickname (`@weekly`) as the line cron(8) reads it for, anything else as it is."""
    return ALIASES.get(cron.strip().lower(), cron)


def for_apscheduler(cron: str) -> str:
    """`cron` with its day-of-week field as day names. Raises ValueError for a field crontab does not allow."""
    fields = five_fields(cron).split()
    if len(fields) != 5:
        raise ValueError(f"{len(fields)} fields")
    days = weekdays(fields[4])
    fields[4] = "*" if len(days) == 7 else ",".join(DAY_NAMES[d] for d in sorted(days))
    return " ".join(fields)


def as_apscheduler(cron: str) -> list[str]:
    """The APScheduler crontabs whose slots together are `cron`'s: one, or two when both day fields are restricted
    (neither starts with `*`, cron's own test): `0 0 1 * mon` is the 1st of every month and every Monday."""
    cron = five_fields(cron)
    fields = for_apscheduler(cron).split()
    day_of_month, day_of_week = cron.split()[2], cron.split()[4]
    if day_of_month.startswith("*") or day_of_week.startswith("*"):
        return [" ".join(fields)]
    return [" ".join([*fields[:4], "*"]), " ".join([*fields[:2], "*", *fields[3:]])]


def weekdays(field: str) -> set[int]:
    """The days (0 = Sunday … 6 = Saturday) a crontab day-of-week field names: a list of `*`, a day or a range of
    days, each with an optional `/step`. Days are 0-7 (0 and 7 both Sunday) or names; `5-7` is Friday to Sunday,
    and a day with a step runs to the week's end (`1/2`: Monday, Wednesday, Friday, Sunday), as in cron."""
    days: set[int] = set()
    for item in field.lower().split(","):
        span, slash, step_text = item.partition("/")
        step = int(step_text) if step_text.isdigit() else 0
        if slash and step < 1:
            raise ValueError(f"step {step_text!r}")
        if span == "*":
            first, last = 0, 6
        elif "-" in span:
            a, _, b = span.partition("-")
            first, last = _day(a), _day(b)
        else:
            first = _day(span)
            last = 7 if slash else first
        if first > last:
            raise ValueError(f"range {span!r}")
        days.update(d % 7 for d in range(first, last + 1, step or 1))
    return days


def _day(text: str) -> int:
    """0-7 for a number (7 stays 7, so that a range can end on it), 0-6 for a name."""
    if text.isdigit() and int(text) <= 7:
        return int(text)
    if text in DAY_NAMES:
        return DAY_NAMES.index(text)
    raise ValueError(f"day {text!r}")
