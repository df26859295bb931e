"""How long the daemon has watched the attempts: what the timeouts that wait for an instance count.

The timeouts that give up on an instance that did not come up or stopped answering (`daemon.boot_timeout_s`, a
running attempt unreachable for `daemon.heartbeat_timeout_s`, a step failing for that long, a lost run's last pull)
count only the time some daemon was looking: a daemon stopped for an hour, or a laptop asleep, did not ask, and an
instance it did not ask is not silent for it. Wall time that is real whatever the daemon does (the budget's month, a
deadline, `max_run_hours`, a stopped trainer's grace on its instance, a spot reclaim) is not counted here.

A look is a tick's start. Between two looks further apart than a few ticks (GAP_TICKS ticks and GAP_SLACK_S) nobody
watched: the daemon was stopped, or its machine slept. A tick's own length is not a gap (it is measured from the
previous tick's end: a daemon whose every tick is slow must still give a stuck instance up), unless the machine was
suspended during it, which its clocks tell on Linux (`slept_s`). The gaps, the last look and the first one ever are
kept in a setting (WATCH_KEY), so a restarted daemon counts its downtime out, and a daemon restarted over and over
still gives a stuck instance up once the timeout's time has been watched in all. Time before the first look written
down is not known to have been watched, and is not counted either.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from state.store import Store

WATCH_KEY = "watched"
GAP_TICKS, GAP_SLACK_S = 3, 15.0
GAPS_KEPT = 200  # restarts and sleeps, a few a day; time before the oldest kept counts as not watched


class Watch:
    def __init__(self, store: Store, clock: Callable[[], float], tick_s: float,
                 on_gap: Callable[[float, float], None] | None = None):
        self.store = store
        self.clock = clock
        self.tick_s = tick_s
        self.on_gap = on_gap  # told of each gap as it is found: (the last look before it, the first after)
        kept = store.get_setting(WATCH_KEY) or {}
        self.first = float(kept.get("first", clock()))  # the first look written down
        self.gaps: list[tuple[float, float]] = [(float(a), float(b)) for a, b in kept.get("gaps", ())]
        self.last: float | None = float(kept["last"]) if kept.get("last") is not None else None
        self.ticking = False  # between look() and looked()
        self._slept = slept_s()  # at the tick's start

    @property
    def gap_s(self) -> float:
        """Looks further apart than this had nobody watching in between."""
        return GAP_TICKS * self.tick_s + GAP_SLACK_S

    def look(self) -> None:
        """A tick begins: a gap since the last look (this daemon's, or the one before it) is written down."""
        now = self.clock()
        gap = None if self.last is None or now - self.last <= self.gap_s else (self.last, now)
        self.last, self.ticking, self._slept = now, True, slept_s()
        self._write_down(gap)

    def looked(self) -> None:
        """A tick ended: the next gap is measured from now. A long tick is a look, not a gap, unless its machine was
        suspended during it (which the wall clock between ticks would not show: the tick spans the suspend)."""
        now = self.clock()
        asleep = self._asleep_in_tick()
        self.last, self.ticking = max(self.last or -float("inf"), now), False
        if asleep > self.gap_s:
            self._write_down((now - asleep, now))

    def _asleep_in_tick(self) -> float:
        """How long the machine has been suspended since the tick under way began (0 between ticks)."""
        return slept_s() - self._slept if self.ticking else 0.0

    def _write_down(self, gap: tuple[float, float] | None) -> None:
        if gap is not None:
            self.gaps.append(gap)
            if len(self.gaps) > GAPS_KEPT:
                self.first = max(self.first, self.gaps.pop(0)[1])
        self.store.set_setting(WATCH_KEY, {"first": self.first, "last": self.last,
                                           "gaps": [list(g) for g in self.gaps]})
        if gap is not None and self.on_gap is not None:  # once written down: a restart does not find it again
            self.on_gap(*gap)

    def watched_s(self, since: float, now: float) -> float:
        """The seconds between `since` and `now` that were watched: less the gaps; the one still open (outside a
        tick, no look for longer than a gap: this process is not the daemon; inside one, its machine suspended since
        the tick began); and what came before the first look."""
        unwatched = [(-float("inf"), self.first), *self.gaps]
        if self.ticking:
            if (asleep := self._asleep_in_tick()) > self.gap_s:
                unwatched.append((now - asleep, now))
        elif self.last is not None and now - self.last > self.gap_s:
            unwatched.append((self.last, now))
        counted = now - since
        for start, end in unwatched:
            counted -= max(0.0, min(end, now) - max(start, since))
        return max(0.0, counted)


def slept_s() -> float:
    """How long this machine has been suspended since it booted, as far as it can tell: on Linux CLOCK_BOOTTIME
    counts a suspend and CLOCK_MONOTONIC does not; elsewhere 0 (a suspend between ticks is still seen as a gap)."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return 0.0 if boottime is None else time.clock_gettime(boottime) - time.clock_gettime(time.CLOCK_MONOTONIC)
