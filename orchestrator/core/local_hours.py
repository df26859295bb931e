"""The local GPU's daily hours (`local.available_hours`, e.g. 22:00-08:00 when it serves a desktop by day): how
long, in wall-clock hours from now, it takes the GPU to be open for so many hours. Pure: the shell gives the
windows and the local time now.

Gate 2 needs the wall-clock time a local run takes. A share of the day (10 of 24 h open) gets it wrong for any
job shorter than a few days: a 4-hour job queued at 21:00 is done at 02:00 (22:00 to 02:00), not 9.6 h later, and
the same job queued at 09:00 is done 17 h later, at 02:00 too.

Across a daylight-saving change the local clock jumps while time does not: the night of 22:00-08:00 is 9 hours long
in spring and 11 in autumn. The shell passes the changes ahead (`shifts`), and every answer here is in real hours:
time is walked piece by piece between them, each piece on the plain 24-hour clock.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

DAY_MIN = 24 * 60.0
# Hours become minutes through floating point (62 / 60 * 60 is 62.00000000000001): a run that needs exactly what a
# stretch has left must end in that stretch, not a day later.
EPS_MIN = 1e-6


@functools.lru_cache(maxsize=64)  # a handful of configs; asked for every job in line, every tick
def _open_day(windows: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    parts: list[tuple[float, float]] = []
    for start, end in windows:
        if start == end:
            return ((0.0, DAY_MIN),)
        parts += [(start, end)] if start < end else [(start, DAY_MIN), (0.0, end)]
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(parts):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


@dataclass(frozen=True)
class LocalHours:
    """`windows`: (start, end) in minutes since local midnight; an end at or before its start wraps past midnight,
    and start == end is the whole day. `clock_min`: the local time now, in minutes since midnight. No windows:
    always open. `shifts`: the local clock's daylight-saving changes ahead, in order, as (real minutes from now, the
    minutes it moves then: 60 when it springs forward, -60 when it falls back)."""

    windows: tuple[tuple[float, float], ...]
    clock_min: float
    shifts: tuple[tuple[float, float], ...] = ()

    def _pieces(self) -> Iterator[tuple[float, LocalHours, float]]:
        """The time ahead between the clock's shifts: (real minutes from now where a piece begins, the hours as its
        plain clock reads them then, its length in minutes; the last one never ends)."""
        start, clock = 0.0, self.clock_min
        for at, moves in self.shifts:
            yield start, LocalHours(self.windows, clock), at - start
            clock = (clock + at - start + moves) % DAY_MIN
            start = at
        yield start, LocalHours(self.windows, clock), math.inf

    def _day(self) -> tuple[tuple[float, float], ...]:
        """One day's open minutes as sorted, disjoint intervals within [0, DAY_MIN)."""
        return _open_day(self.windows)

    def is_open(self) -> bool:
        return not self.windows or any(lo <= self.clock_min < hi for lo, hi in self._day())

    def later(self, hours: float) -> LocalHours:
        """The same hours, seen `hours` (real hours) from now."""
        then = hours * 60.0
        for start, plain, length in self._pieces():
            if then < start + length:
                return LocalHours(self.windows, (plain.clock_min + then - start) % DAY_MIN,
                                  tuple((at - then, moves) for at, moves in self.shifts if at > then))
        raise AssertionError("the last piece never ends")

    def always_open(self) -> bool:
        return not self.windows or self._day() == ((0.0, DAY_MIN),)

    def _spans(self) -> list[tuple[float, float]]:
        """The open stretches of today and the next two days, in minutes from today's midnight, joined where one
        runs on past midnight into the next (every length a stretch can have is among them)."""
        spans: list[tuple[float, float]] = []
        for d in range(3):
            for lo, hi in self._day():
                if spans and spans[-1][1] == d * DAY_MIN + lo:
                    spans[-1] = (spans[-1][0], d * DAY_MIN + hi)
                else:
                    spans.append((d * DAY_MIN + lo, d * DAY_MIN + hi))
        return spans

    def until_change_h(self) -> float | None:
        """Hours from now until the GPU's hours end (while open) or begin (while closed); None: always open."""
        if self.always_open():
            return None
        now_open = self.is_open()
        for start, plain, length in self._pieces():
            if plain.is_open() != now_open:  # the clock jumped into, or out of, the hours
                return start / 60.0
            change = plain._plain_until_change_h() * 60.0
            if change < length:
                return (start + change) / 60.0
        raise AssertionError("the last piece never ends")

    def _plain_until_change_h(self) -> float:
        for lo, hi in self._spans():
            if lo <= self.clock_min < hi:
                return (hi - self.clock_min) / 60.0
            if lo > self.clock_min:
                return (lo - self.clock_min) / 60.0
        raise AssertionError("a day with open hours has an interval in the next two days")

    def room_for(self, open_h: float) -> bool:
        """Open now, for `open_h` hours at least before the hours end: what a run that cannot pause (it cannot
        checkpoint) needs to start."""
        if self.always_open():
            return True
        left = self.until_change_h() if self.is_open() else None
        return left is not None and left >= open_h - 1e-9

    def one_sitting_wall_h(self, open_h: float) -> float | None:
        """Hours from now until a run that cannot pause ends: it starts in the first stretch with `open_h` hours
        open left (now, if this one has). None when no stretch is that long: such a run never fits here."""
        if self.always_open():
            return max(open_h, 0.0)
        if not self.shifts:
            need = open_h * 60.0
            for lo, hi in self._spans():
                start = max(lo, self.clock_min)
                if hi - start >= need - EPS_MIN:
                    return (start - self.clock_min + need) / 60.0
            return None
        # Stretch by stretch through real time: one may be an hour shorter or longer for a shift. Three days past
        # the last shift walked, every length the plain clock has has been seen.
        t, seen, horizon = 0.0, self, 3 * 24.0 + max((at / 60.0 for at, _ in self.shifts), default=0.0)
        while t <= horizon:
            left = seen.until_change_h()
            assert left is not None  # not always open
            if seen.is_open() and left >= open_h - 1e-9:
                return t + max(open_h, 0.0)
            t += left
            seen = self.later(t)
        return None

    def run_wall_h(self, open_h: float, pauses: bool = True) -> float | None:
        """Hours from now until a run of `open_h` GPU hours that starts now is done: paused while the GPU is closed
        when it can be (`pauses`: it checkpoints), else in one sitting (None: no stretch is that long)."""
        return self.wall_h(open_h) if pauses else self.one_sitting_wall_h(open_h)

    def finish_h(self, wait_open_h: float, open_h: float, pauses: bool = True) -> float | None:
        """Hours from now until a run of `open_h` GPU hours is done, after `wait_open_h` GPU hours of work ahead of
        it (the local queue's). None: it cannot run here in one sitting."""
        wait = self.wall_h(wait_open_h)
        run = self.later(wait).run_wall_h(open_h, pauses)
        return None if run is None else wait + run

    def open_h(self, wall_h: float) -> float:
        """Hours the GPU is open in the next `wall_h` hours (the inverse of `wall_h`): what a run that starts now
        trains in that time."""
        total, until = 0.0, wall_h * 60.0
        for start, plain, length in self._pieces():
            if start >= until:
                break
            total += plain._plain_open_h(min(length, until - start) / 60.0)
        return total

    def _plain_open_h(self, wall_h: float) -> float:
        if not self.windows or wall_h <= 0:
            return max(wall_h, 0.0)
        day = self._day()
        per_day = sum(hi - lo for lo, hi in day)

        def since_midnight(t: float) -> float:  # open minutes from today's midnight to t minutes after it
            days, within = divmod(t, DAY_MIN)
            return days * per_day + sum(min(max(within - lo, 0.0), hi - lo) for lo, hi in day)

        return (since_midnight(self.clock_min + wall_h * 60.0) - since_midnight(self.clock_min)) / 60.0

    def wall_h(self, open_h: float) -> float:
        """Hours from now until the GPU has been open for `open_h` hours (a run that starts now and pauses while
        it is closed ends then)."""
        left = open_h
        for start, plain, length in self._pieces():
            here = plain._plain_open_h(length / 60.0) if length < math.inf else math.inf
            if left <= here + EPS_MIN / 60.0:
                return start / 60.0 + plain._plain_wall_h(left)
            left -= here
        raise AssertionError("the last piece never ends")

    def _plain_wall_h(self, open_h: float) -> float:
        if not self.windows or open_h <= 0:
            return max(open_h, 0.0)
        day = self._day()
        per_day = sum(hi - lo for lo, hi in day)
        left = open_h * 60.0
        offset = -self.clock_min  # minutes from now to the start of the day being walked
        since = self.clock_min  # where the walk starts in that day
        while True:
            if since == 0.0 and left > per_day + EPS_MIN:  # whole days at once: a deadline weeks away costs no more
                days = math.ceil((left - EPS_MIN) / per_day) - 1  # leaves (0, per_day] for the last day
                left -= days * per_day
                offset += days * DAY_MIN
            for lo, hi in day:
                lo = max(lo, since)
                if hi <= lo:
                    continue
                if left <= hi - lo + EPS_MIN:
                    return (offset + lo + left) / 60.0
                left -= hi - lo
            offset += DAY_MIN
            since = 0.0
