"""What the daemon has seen of one spot market, turned into the input the spot policy reads.

The simulator replays traces that show spot's availability at every tick. The daemon sees much less: only what its
own spot launches tell it. A spot instance that came up says "up" from its launch until it ended. Its preemption
says "down" from then on. A launch refused for lack of capacity says "down" at that moment. Between sightings
nothing is known. This module keeps to that evidence. Pure: sightings in, `SpotView` out, no I/O, so it is
specified by tests and the daemon only gathers the sightings from its store.

From the sightings it estimates a memoryless model, the one `SpotModel.geometric` builds:
- the mean up-time is the spot time its instances ran divided by their preemptions (the maximum-likelihood
  estimate with censoring: an instance that ended for another reason counts its time but no preemption);
- the mean outage is the time from the first "down" sighting to the next "up", divided by the outages that ended;
  an outage still going on counts its time so far.
Each mean is shrunk towards the policy's prior with the weight of `PRIOR_SPELLS` spells, so a first preemption
does not swing the model, and snapped to a grid of tenths of a decade so that the plan built from it is reused
until the evidence has moved it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.core.spot_policy import AvailabilityStats, SpotModel

# Prior spells behind the prior means: how much evidence it takes to move the estimate halfway.
PRIOR_SPELLS = 2.0
# A state last seen longer ago than this is unknown again: the market may have changed since, so the next launch
# finds out (a refused spot launch costs nothing).
STALE_H = 1.0


@dataclass(frozen=True, slots=True)
class SpotLife:
    """One spot instance this installation ran: from its launch until it ended (None: running now)."""

    started_at: float  # unix seconds
    ended_at: float | None
    preempted: bool


@dataclass(frozen=True, slots=True)
class SpotView:
    """The spot market as the policy should see it now."""

    available: bool  # seen up, or not seen lately (then the next launch is how to find out)
    state_for_h: float  # how long it has been in that state, as far as the sightings tell (0 when unknown)
    known: bool  # False: nothing seen within STALE_H, `available` is only the assumption that a try is worth it
    stats: AvailabilityStats
    preemptions: int
    outages_ended: int

    def as_record(self) -> dict[str, object]:
        """What the decision trail keeps of this view."""
        return {"spot_seen": ("up" if self.available else "down") if self.known else "unknown",
                "for_h": round(self.state_for_h, 3), "mean_uptime_h": self.stats.mean_uptime_h,
                "mean_outage_h": self.stats.mean_outage_h, "preemptions": self.preemptions,
                "outages_ended": self.outages_ended}


def on_grid(x: float) -> float:
    """x snapped to a tenth of a decade (steps of 26 %): a plan per distinct model is built and cached, so the
    model changes only when the evidence has moved it that far."""
    if x <= 0 or not math.isfinite(x):
        return x
    return float(f"{10 ** (round(10 * math.log10(x)) / 10):.3g}")


def _shrunk(exposure_h: float, events: int, prior_h: float) -> float:
    return on_grid((exposure_h + PRIOR_SPELLS * prior_h) / (events + PRIOR_SPELLS))


# A job waiting for spot that only a launch can reveal probes again after this share of the outage so far:
# outages that have lasted long tend to last longer (docs/simulate.md), so probing less often as one ages loses
# little and keeps the attempts and the trail from growing by a row a minute through a day-long outage.
PROBE_SHARE_OF_OUTAGE = 0.1


def probe_after_s(outage_h: float, min_s: float, max_s: float) -> float:
    """Seconds from a refused spot launch to the next, when spot has been seen down for `outage_h` hours."""
    return max(min_s, min(PROBE_SHARE_OF_OUTAGE * outage_h * 3600.0, max_s))


def spot_hours(lives: Sequence[SpotLife], now: float) -> float:
    """Instance-hours on spot, a life still running counted to `now`."""
    return sum(max(0.0, ((life.ended_at if life.ended_at is not None else now) - life.started_at) / 3600.0)
               for life in lives)


def preemption_rate(lives: Sequence[SpotLife], now: float, prior_per_h: float) -> tuple[float, float, int]:
    """λ, preemptions per spot instance-hour, from these lives: the censored estimate (preemptions / hours) shrunk
    towards `prior_per_h` with the weight of PRIOR_SPELLS mean up-times, as `watch` shrinks the mean up-time.
    Returns (λ, spot hours, preemptions)."""
    hours = spot_hours(lives, now)
    preemptions = preemptions_seen(lives)
    return (preemptions + PRIOR_SPELLS) / (hours + PRIOR_SPELLS * mean_uptime_h(prior_per_h)), hours, preemptions


def preemptions_seen(lives: Sequence[SpotLife]) -> int:
    return sum(1 for life in lives if life.preempted and life.ended_at is not None)


def mean_uptime_h(preemptions_per_h: float) -> float:
    """The mean up-time a preemption rate stands for; a rate of 0 is a mean up-time of 14 months (for infinity)."""
    return 1.0 / preemptions_per_h if preemptions_per_h > 0 else 1e4


def plan_grade(hours: float) -> float:
    """`hours` on a grid 2^(1/16) apart (4.4 %), for the memoryless model: a plan is keyed by its model, and the
    means move with every check (an outage going on, an instance running), so that one plan serves the checks until
    an estimate has moved that much, rather than one plan a check."""
    return 2.0 ** (round(math.log2(hours) * 16) / 16) if hours > 0 else hours


def watch(lives: Sequence[SpotLife], refusals: Sequence[float], now: float, *, tick_h: float,
          prior_uptime_h: float, prior_outage_h: float, listings: Sequence[tuple[float, bool]] = (),
          listed_now: bool | None = None) -> SpotView:
    """The spot market seen through these instance lives and refused launches (unix seconds), at `now`.

    Where the provider lists spot capacity, `listings` are the changes it showed, (since, up), and `listed_now` is
    what it lists now: sightings too, which also come while the job runs elsewhere."""
    up_h = spot_hours(lives, now)
    preemptions = preemptions_seen(lives)
    # One timeline of sightings; at equal times an "up" goes first, so a refusal in the same second wins.
    sightings = sorted([(life.started_at, 0) for life in lives]
                       + [(life.ended_at, 1) for life in lives if life.preempted and life.ended_at is not None]
                       + [(at, 1) for at in refusals]
                       + [(at, 0 if up else 1) for at, up in listings]
                       + ([(now, 0 if listed_now else 1)] if listed_now is not None else []))
    state: bool | None = None  # None: nothing seen yet
    since = last_seen = now
    down_h, outages_ended = 0.0, 0
    for at, down in sightings:
        if at > now:
            continue
        last_seen = at
        if down and state is not False:
            state, since = False, at
        elif not down and state is not True:
            if state is False:
                down_h += (at - since) / 3600.0
                outages_ended += 1
            state, since = True, at
    if state is False:
        down_h += (last_seen - since) / 3600.0  # the outage going on, censored at its last sighting
    elif state is True and any(life.ended_at is None and life.started_at <= now for life in lives):
        last_seen = now  # an instance running now is an "up" sighting now (unless a refusal came after its start)
    known = state is not None and (now - last_seen) / 3600.0 <= STALE_H
    mean_up = _shrunk(up_h, preemptions, prior_uptime_h)
    mean_out = _shrunk(down_h, outages_ended, prior_outage_h)
    observed_h = up_h + down_h
    stats = AvailabilityStats(
        up_fraction=up_h / observed_h if observed_h > 0 else math.nan,
        mean_outage_h=mean_out, mean_uptime_h=mean_up, observed_h=observed_h,
        model=SpotModel.geometric(tick_h, plan_grade(mean_up), plan_grade(mean_out)))
    return SpotView(available=state is not False or not known, state_for_h=(now - since) / 3600.0 if known else 0.0,
                    known=known, stats=stats, preemptions=preemptions, outages_ended=outages_ended)
