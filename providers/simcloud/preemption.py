"""When simcloud reclaims a running spot instance: from a real trace, from a seeded rate, or on demand.

A *source* answers one question: at what wall-clock time is this spot instance reclaimed (or never)?

- `TracePreemptions`: a spot-traces file (`data[i]` = spot available during tick i, `gap_seconds` per tick)
  replayed from the moment simcloud started, sped up by `time_scale` (600 turns a 600 s tick into 1 s). The
  market is shared: every spot instance running when the trace says "unavailable" is reclaimed then; one
  launched while it is unavailable is reclaimed right after its notice. The trace loops when it runs out.
- `PoissonPreemptions`: a seeded rate of preemptions per (scaled) hour of an instance's life; each instance's
  draw depends only on the seed and its id, so a run is reproducible whatever the launch order.
- Forced preemptions (`burstctl simcloud preempt`) go through the API's admin routes, not through here.

`PreemptionScheduler` is the small thread in the simcloud process that applies a source to the server's
running spot instances: the interruption notice (`server.notice(id, seconds)`, EC2's two minutes, scaled)
first, then `server.preempt(id)` when the notice runs out. A notice always gets its full lead time.
"""

from __future__ import annotations

import bisect
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

EC2_NOTICE_S = 120.0  # EC2's spot interruption notice, in trace (unscaled) seconds


class PreemptionSource(Protocol):
    def preempt_at(self, instance_id: str, launched_at: float) -> float | None:
        """Wall-clock time (the server's clock) at which the instance is reclaimed; None means never."""
        ...


class TracePreemptions:
    """Spot availability from a spot-traces file, replayed from `started_at` at `time_scale` x speed."""

    def __init__(self, data: Sequence[int], gap_seconds: float, *, time_scale: float = 1.0,
                 started_at: float | None = None, nodes: int | None = None, source: str = "trace") -> None:
        if not data:
            raise ValueError(f"{source}: 'data' is empty")
        if gap_seconds <= 0 or time_scale <= 0:
            raise ValueError(f"{source}: gap_seconds and time_scale must be > 0")
        # A gang of `nodes` can use spot only when all of them are available (1-node files: 1 = available).
        self.nodes = nodes if nodes is not None else max(max(data), 1)
        self.available = [v >= self.nodes for v in data]
        self.unavailable_ticks = [i for i, ok in enumerate(self.available) if not ok]
        self.tick_s = gap_seconds / time_scale  # wall seconds per tick
        self.started_at = time.time() if started_at is None else started_at
        self.source = source

    @classmethod
    def from_file(cls, path: str | Path, *, time_scale: float = 1.0, started_at: float | None = None,
                  nodes: int | None = None) -> TracePreemptions:
        if not Path(path).is_file():
            raise ValueError(f"{path}: no such trace file")
        try:
            doc: Any = json.loads(Path(path).read_text(encoding="utf-8"))
            data = [int(v) for v in doc["data"]]
            gap = float(doc["metadata"]["gap_seconds"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a spot-traces file ({{'metadata': {{'gap_seconds'}}, 'data'}}): "
                             f"{type(exc).__name__}") from exc
        return cls(data, gap, time_scale=time_scale, started_at=started_at, nodes=nodes, source=str(path))

    @property
    def period_s(self) -> float:
        return len(self.available) * self.tick_s

    def available_at(self, t: float) -> bool:
        tick = int(max(0.0, t - self.started_at) // self.tick_s) % len(self.available)
        return self.available[tick]

    def preempt_at(self, instance_id: str, launched_at: float) -> float | None:
        if not self.unavailable_ticks:
            return None
        elapsed = max(0.0, launched_at - self.started_at)
        loops, offset = divmod(elapsed, self.period_s)
        tick = int(offset // self.tick_s)
        k = bisect.bisect_left(self.unavailable_ticks, tick)
        if k == len(self.unavailable_ticks):  # nothing left in this pass: the first outage of the next
            loops, k = loops + 1, 0
        when = self.started_at + loops * self.period_s + self.unavailable_ticks[k] * self.tick_s
        return max(when, launched_at)


class PoissonPreemptions:
    """Preemptions as a Poisson process: `per_hour` per scaled hour of each instance's life, seeded."""

    def __init__(self, per_hour: float, *, seed: int = 0, time_scale: float = 1.0) -> None:
        if per_hour < 0 or time_scale <= 0:
            raise ValueError("per_hour must be >= 0 and time_scale > 0")
        self.per_hour = per_hour
        self.seed = seed
        self.rate_per_wall_s = per_hour / 3600.0 * time_scale

    def preempt_at(self, instance_id: str, launched_at: float) -> float | None:
        if self.rate_per_wall_s == 0:
            return None
        # A str seed is hashed deterministically (SHA-512), unlike hash(): same seed + id, same draw.
        return launched_at + random.Random(f"{self.seed}/{instance_id}").expovariate(self.rate_per_wall_s)


class SpotServer(Protocol):
    """What the scheduler needs from `providers.simcloud.api.SimCloudServer`."""

    clock: Callable[[], float]
    catalog: dict[str, Any]

    def instances(self) -> list[Any]: ...

    def notice(self, instance_id: str, seconds: float) -> str: ...

    def preempt(self, instance_id: str, reason: str = ...) -> None: ...


@dataclass
class _Plan:
    preempt_at: float | None
    noticed_at: float | None = None


EventCallback = Callable[[str, dict[str, Any]], None]


class PreemptionScheduler:
    """Applies a source to the server's running spot instances from a background thread."""

    def __init__(self, server: SpotServer, source: PreemptionSource, *, notice_lead_s: float = EC2_NOTICE_S,
                 poll_s: float = 0.05, on_event: EventCallback | None = None) -> None:
        self.server = server
        self.source = source
        self.notice_lead_s = notice_lead_s
        self.poll_s = poll_s
        self.on_event = on_event
        self._plans: dict[str, _Plan] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PreemptionScheduler:
        self._thread = threading.Thread(target=self._loop, name="simcloud-preemptions", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.step()
            except Exception as exc:  # one bad pass must not end preemptions for the server's lifetime
                self._emit("preemption.error", error=f"{type(exc).__name__}: {exc}")

    def step(self, now: float | None = None) -> list[tuple[str, str]]:
        """One pass: post due notices, reclaim instances whose notice ran out. Returns (action, id) pairs."""
        now = self.server.clock() if now is None else now
        running = {i.id: i for i in self.server.instances() if i.status == "active" and self._is_spot(i.instance_type)}
        for gone in set(self._plans) - set(running):
            del self._plans[gone]
        actions: list[tuple[str, str]] = []
        for instance_id, inst in running.items():
            plan = self._plans.get(instance_id)
            if plan is None:
                plan = self._plans[instance_id] = _Plan(self.source.preempt_at(instance_id, inst.launched_at))
            if plan.preempt_at is None:
                continue
            if plan.noticed_at is None and now >= plan.preempt_at - self.notice_lead_s:
                # A late start (launched inside an outage) still gets the full notice.
                plan.preempt_at = max(plan.preempt_at, now + self.notice_lead_s)
                try:
                    self.server.notice(instance_id, plan.preempt_at - now)
                except Exception:  # terminated between our listing and the notice: nothing to reclaim
                    continue
                plan.noticed_at = now
                actions.append(("notice", instance_id))
                self._emit("spot.notice", instance_id=instance_id, seconds=round(plan.preempt_at - now, 3))
            if plan.noticed_at is not None and now >= plan.preempt_at:
                try:
                    self.server.preempt(instance_id)
                except Exception:
                    continue
                plan.preempt_at = None
                actions.append(("preempt", instance_id))
                self._emit("spot.preempted", instance_id=instance_id)
        return actions

    def _is_spot(self, instance_type: str) -> bool:
        return getattr(self.server.catalog.get(instance_type), "market", None) == "spot"

    def _emit(self, kind: str, **data: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, data)
