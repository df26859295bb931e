"""The local GPU's daily hours (`local.available_hours`, e.g. 22:00-08:00 when it serves a desktop by day): how
long, in wall-clock hours from now, it takes the GPU to be open for so many hours. Pure: the shell gives the
windows and the local time now.

Gate 2 needs the wall-clock time a local run takes. A share of the day (10 of 24 h open) gets it wrong for any
job shorter than a few days: a 4-hour job queued at 21:00 is done at 02:00 (22:00 to 02:00), not 9.6 h later, and
the same job queued at 09:00 is done 17 h later, at 02:00 too.
"""

from __future__ import annotations

from dataclasses import dataclass

DAY_MIN = 24 * 60.0


@dataclass(frozen=True)
class LocalHours:
    """`windows`: (start, end) in minutes since local midnight; an end at or before its start wraps past midnight,
    and start == end is the whole day. `clock_min`: the local time now, in minutes since midnight. No windows:
    always open."""

    windows: tuple[tuple[float, float], ...]
    clock_min: float

    def _day(self) -> list[tuple[float, float]]:
        """One day's open minutes as sorted, disjoint intervals within [0, DAY_MIN)."""
        parts: list[tuple[float, float]] = []
        for start, end in self.windows:
            if start == end:
                return [(0.0, DAY_MIN)]
            parts += [(start, end)] if start < end else [(start, DAY_MIN), (0.0, end)]
        merged: list[tuple[float, float]] = []
        for lo, hi in sorted(parts):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return merged

    def is_open(self) -> bool:
        return not self.windows or any(lo <= self.clock_min < hi for lo, hi in self._day())

    def until_change_h(self) -> float | None:
        """Hours from now until the GPU's hours end (while open) or begin (while closed); None: always open."""
        day = self._day()
        if not self.windows or day == [(0.0, DAY_MIN)]:
            return None
        # Today's and the next two days' intervals, joined where one runs on past midnight into the next.
        spans: list[tuple[float, float]] = []
        for d in range(3):
            for lo, hi in day:
                if spans and spans[-1][1] == d * DAY_MIN + lo:
                    spans[-1] = (spans[-1][0], d * DAY_MIN + hi)
                else:
                    spans.append((d * DAY_MIN + lo, d * DAY_MIN + hi))
        for lo, hi in spans:
            if lo <= self.clock_min < hi:
                return (hi - self.clock_min) / 60.0
            if lo > self.clock_min:
                return (lo - self.clock_min) / 60.0
        raise AssertionError("a day with open hours has an interval in the next two days")

    def wall_h(self, open_h: float) -> float:
        """Hours from now until the GPU has been open for `open_h` hours (a run that starts now and pauses while
        it is closed ends then)."""
        if not self.windows or open_h <= 0:
            return max(open_h, 0.0)
        day = self._day()
        per_day = sum(hi - lo for lo, hi in day)
        left = open_h * 60.0
        offset = -self.clock_min  # minutes from now to the start of the day being walked
        since = self.clock_min  # where the walk starts in that day
        while True:
            if since == 0.0 and left > per_day:  # whole days at once: a deadline weeks away costs no more
                days = int((left - 1e-9) // per_day)
                left -= days * per_day
                offset += days * DAY_MIN
            for lo, hi in day:
                lo = max(lo, since)
                if hi <= lo:
                    continue
                if left <= hi - lo:
                    return (offset + lo + left) / 60.0
                left -= hi - lo
            offset += DAY_MIN
            since = 0.0

    def share(self, open_h: float) -> float:
        """The share of the wall-clock time to `open_h` open hours that is open: s_L times it is the local GPU's
        effective throughput for that run."""
        wall = self.wall_h(open_h)
        return open_h / wall if wall > 0 else 1.0
