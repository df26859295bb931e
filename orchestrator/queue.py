"""The shell around the decision core: gather facts (config, store), decide, record, persist.

`enqueue` validates and decides everything before the one transaction that writes the job, its first event
and nothing else; a bad spec or a failed decision leaves the queue untouched.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from datetime import time as dtime
from pathlib import Path
from typing import Any

from orchestrator import records
from orchestrator.app import App, burst_enabled
from orchestrator.config import Config
from orchestrator.core.decision import (
    MEASURED_SETUP,
    UNMEASURED_SETUP,
    Decision,
    DecisionContext,
    GpuOffer,
    JobFacts,
    ListedPrice,
    SetupEstimate,
    decide,
)
from orchestrator.core.local_hours import LocalHours
from orchestrator.errors import BadInput
from orchestrator.holds import held_by_plans
from orchestrator.jobspec import JobSpec, load_job
from orchestrator.lifecycle.schedule import reported
from orchestrator.lifecycle.states import RETRIABLE, JobState, check_transition, state_for
from providers.base import Offer


def local_hours(cfg: Config, now: float) -> LocalHours:
    """`local.available_hours`, the time of day now in `local.timezone` and its clock's daylight-saving changes in
    the year ahead, for the decision core."""
    clock = _minutes(local_time(cfg, now).time())
    if not cfg.local.available_hours:  # always open: the clock's changes do not matter
        return LocalHours(windows=(), clock_min=clock)
    zone = cfg.local.timezone
    changes = _clock_changes(zone or f"this machine's {time.tzname}", zone, int(now // 86400))
    return LocalHours(windows=tuple((_minutes(w.start), _minutes(w.end)) for w in cfg.local.available_hours),
                      clock_min=clock, shifts=tuple(((at - now) / 60.0, moves) for at, moves in changes if at > now))


SHIFTS_AHEAD_DAYS = 400  # a local plan reaches no further; a deadline years away is off by an hour at most


@functools.lru_cache(maxsize=16)
def _clock_changes(key: str, zone: str | None, day: int) -> tuple[tuple[int, float], ...]:
    """(the instant, minutes the clock moves) of each change of `zone`'s UTC offset (None: this machine's) in the
    SHIFTS_AHEAD_DAYS from `day` (days since the epoch); once a day per zone (`key` names it in the cache)."""
    from zoneinfo import ZoneInfo

    tz = ZoneInfo(zone) if zone else None

    def offset(t: int) -> float:
        if tz is None:
            return float(time.localtime(t).tm_gmtoff)
        off = datetime.fromtimestamp(t, tz).utcoffset()
        return off.total_seconds() if off is not None else 0.0

    step = 6 * 3600  # offsets change at most twice a year, never twice in six hours
    changes: list[tuple[int, float]] = []
    t = day * 86400
    before = offset(t)
    for _ in range(SHIFTS_AHEAD_DAYS * 4):
        after = offset(t + step)
        if after != before:
            lo, hi = t, t + step  # the first second on the new offset, by bisection
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if offset(mid) == before else (lo, mid)
            changes.append((hi, (after - before) / 60.0))
            before = after
        t += step
    return tuple(changes)


def local_time(cfg: Config, now: float) -> datetime:
    """`now` as the local GPU's hours read it: in `local.timezone`, else this machine's zone."""
    from zoneinfo import ZoneInfo

    zone = cfg.local.timezone
    return datetime.fromtimestamp(now, ZoneInfo(zone)) if zone else datetime.fromtimestamp(now).astimezone()


def _minutes(t: dtime) -> float:
    return t.hour * 60 + t.minute + t.second / 60 + t.microsecond / 60e6


# A provider's listing older than this is not taken for its prices or the machines it sells: [prices] stands in.
OFFERS_SEEN_MAX_AGE_S = 7 * 86400.0
# Whether every enabled provider sells nothing but what it listed: only from listings this fresh.
SHAPES_MAX_AGE_S = 86400.0


def record_offers_seen(app: App, provider: str, offers: Iterable[Offer], now: float) -> None:
    """What a provider lists (each refresh of its offers, `daemon.offers_ttl_s`), kept for decisions made without
    asking it: the machines by GPU type and count, and their prices per instance."""
    shapes = sorted({(o.gpu_model.upper(), o.gpu_count, o.on_demand_usd_h, o.spot_usd_h, o.vram_gib) for o in offers},
                    key=lambda x: (x[0], x[1], x[2], x[3] if x[3] is not None else -1.0, x[4]))
    app.store.set_setting(f"offers_seen:{provider}", {"at": now, "shapes": [list(x) for x in shapes]})


def enabled_providers(cfg: Config) -> list[str]:
    p = cfg.providers
    return [name for name, section in (("sim", p.sim), ("lambda", p.lambda_), ("ec2", p.ec2)) if section.enabled]


def offers_seen(app: App, now: float) -> tuple[dict[tuple[str, int], ListedPrice], dict[str, tuple[int, ...]] | None]:
    """The cheapest price per GPU each (GPU type, count) was last listed at by an enabled provider, and the counts
    each type is sold in when every enabled provider has listed lately (else None)."""
    cheapest: dict[tuple[str, int], tuple[float, float | None, list[tuple[str, float]], float]] = {}
    counts: dict[str, set[int]] = {}
    all_fresh = True
    names = enabled_providers(app.config)
    for name in names:
        seen = app.store.get_setting(f"offers_seen:{name}")
        age = now - float(seen["at"]) if seen else math.inf
        all_fresh = all_fresh and age <= SHAPES_MAX_AGE_S
        if age > OFFERS_SEEN_MAX_AGE_S:
            continue
        for gpu, count, od, spot, vram_gib in seen["shapes"]:
            counts.setdefault(gpu, set()).add(int(count))
            od_g, spot_g = od / count, (spot / count if spot is not None else None)
            vram_gb = vram_gib * 2**30 / 1e9 if vram_gib else math.inf  # a card's label read as GiB
            was = cheapest.get((gpu, count))
            if was is None:
                cheapest[(gpu, count)] = (od_g, spot_g, [(name, age)], vram_gb)
                continue
            spots = [x for x in (was[1], spot_g) if x is not None]
            who = was[2] if any(n == name for n, _ in was[2]) else [*was[2], (name, age)]
            # The smallest card of the shape: the launch takes the cheapest offer, whatever its memory.
            cheapest[(gpu, count)] = (min(was[0], od_g), min(spots) if spots else None, who, min(was[3], vram_gb))
    listed = {key: ListedPrice(od, spot, ", ".join(f"{n} {_ago(a)}" for n, a in who),
                               vram if math.isfinite(vram) else None)
              for key, (od, spot, who, vram) in cheapest.items()}
    return listed, ({g: tuple(sorted(c)) for g, c in counts.items()} if names and all_fresh else None)


def _ago(age_s: float) -> str:
    if age_s < 60:
        return "just now"
    return f"{age_s / 60:.0f} min ago" if age_s < 5400 else f"{age_s / 3600:.0f} h ago"


# The providers whose cloud sells spot. Lambda Cloud sells none: its adapter takes a spot sibling only where a
# Lambda-style API lists one (simcloud), which its listing then says.
SELLS_SPOT = ("sim", "ec2")


def _may_be_used(cfg: Config, name: str) -> bool:
    """Whether an enabled provider's credentials may be at hand (simcloud, enabled by default, has none on a machine
    that rents from Lambda Cloud; alone, it is the embedded default, planned on as it is). EC2's credential chain is
    not walked here: counted as at hand."""
    if name != "sim":
        return True
    from providers import lambda_cloud
    from providers.base import AuthFailed

    try:
        lambda_cloud.read_api_key(cfg.providers.sim)
    except AuthFailed:
        return False
    return True


def reference_offers(cfg: Config) -> dict[str, GpuOffer]:
    """[prices], for what no provider has listed lately. Its spot figure only where an enabled provider sells spot:
    planned on spot at Lambda Cloud, a job would have been held and approved at a third of what it then pays."""
    enabled = enabled_providers(cfg)
    spot = enabled in ([], ["sim"]) or any(name in SELLS_SPOT and _may_be_used(cfg, name) for name in enabled)
    return {gpu: GpuOffer(gpu, p.on_demand_usd_h, p.spot_usd_h if spot else None, p.vram_gib * 2**30 / 1e9)
            for gpu, p in cfg.prices.items()}


# The parts of t_ovh a burst attempt pays once: boot (launch → SSH), the runbook steps, one sync, teardown.
OVERHEAD_METRICS = ("boot_s", "bootstrap_s", "push_workdir_s", "push_checkpoint_s", "start_s", "sync_s",
                    "teardown_s")


def measured_overhead_h(app: App, recent: int = 20) -> float | None:
    """t_ovh as measured on this installation's recent attempts (median of each part), once any boot was timed."""
    from statistics import median

    from sqlalchemy import select

    from state import schema as s

    parts: dict[str, float] = {}
    with app.store.engine.connect() as c:
        for metric in OVERHEAD_METRICS:
            values = [r[0] for r in c.execute(select(s.measurements.c.value).where(s.measurements.c.metric == metric)
                                              .order_by(s.measurements.c.id.desc()).limit(recent))]
            if values:
                parts[metric] = median(values)
    if "boot_s" not in parts:
        return None
    return sum(parts.values()) / 3600.0


def learned_preemptions_per_h(app: App, now: float) -> tuple[float, str, dict[str, tuple[float, str]]]:
    """λ for the spot arithmetic, with its basis: from this installation's spot instances over the last 30 days
    (every provider and type), shrunk towards `policy.spot_preemptions_per_hour`; with none, the configured figure.
    And per GPU type seen on spot: that type's own instances, shrunk towards the pooled λ."""
    from orchestrator.core.spot_watch import preemption_rate
    from orchestrator.lifecycle.market_switch import spot_lives_by_gpu

    prior = app.config.policy.spot_preemptions_per_hour
    by_gpu = spot_lives_by_gpu(app, now)
    lives = [life for group in by_gpu.values() for life in group]
    if not lives:
        return prior, "configured", {}
    pooled, hours, preemptions = preemption_rate(lives, now, prior)
    basis = (f"learned: {preemptions} preemption(s) in {hours:.1f} spot instance-hours over 30 days, "
             f"shrunk towards the configured {prior:g}/h")
    per_gpu = {}
    for gpu, group in by_gpu.items():
        rate, hours, preemptions = preemption_rate(group, now, pooled)
        per_gpu[gpu] = (rate, f"learned: {preemptions} preemption(s) in {hours:.1f} {gpu} spot instance-hours over "
                              f"30 days, shrunk towards {pooled:.3g}/h over every type")
    return pooled, basis, per_gpu


def headline(d: dict[str, Any]) -> str | None:
    """A decision's one line: why its verdict is what it is (`Decision.headline`; the last reason in a decision
    stored before it had one)."""
    return d.get("headline") or (d["reasons"][-1] if d["reasons"] else None)


def context(app: App, now: float, exclude: str | None = None, tick_s: float | None = None) -> DecisionContext:
    """What a decision weighs besides the job itself. `exclude`: the job being decided again (see `held_by_plans`).
    `tick_s`: the daemon's tick, where the daemon decides (else the running daemon's, or the config's). The month's
    spending is read as the launch's budget check reads it, so that a decision says "fits" only of a launch the
    budget will take."""
    from orchestrator.lifecycle.budget_guard import BudgetGuard

    cfg = app.config
    if tick_s is None:
        from orchestrator.daemon import daemon_tick_s

        tick_s = daemon_tick_s(app)
    spending = BudgetGuard(app, time.time, tick_s).spending(now)
    preemptions_per_h, basis, by_gpu = learned_preemptions_per_h(app, now)
    listed, shapes = offers_seen(app, now)
    return DecisionContext(
        local_usd_h=cfg.local.usd_per_hour,
        offers=reference_offers(cfg),
        overhead_h=measured_overhead_h(app) or cfg.policy.overhead_h,
        preemptions_per_h=preemptions_per_h,
        preemptions_basis=basis,
        preemptions_by_gpu=by_gpu,
        max_auto_delta_usd=cfg.policy.max_auto_delta_usd,
        cloud_kinds=tuple(cfg.policy.cloud_kinds),
        hybrid_margin_h=cfg.policy.hybrid_margin_h,
        policy_tick_h=cfg.daemon.policy_tick_h,
        budget_cap_usd=cfg.budget.monthly_cap_usd,
        spent_usd=spending.committed_usd,
        kept_usd=spending.kept_usd,
        held=held_by_plans(app, now, exclude),
        earlier_usd=spending.earlier,
        stop_tick_s=tick_s,
        billing_minimum_s=Offer.billing_minimum_s,
        burst_enabled=burst_enabled(app),
        local_hours=local_hours(cfg, now),
        local_slots=cfg.daemon.local_concurrency,
        vram_margin_gb=cfg.local.safety_margin_gb,
        listed=listed,
        listed_shapes=shapes,
    )


def throughput_key(gpu: str, job_name: str) -> str:
    """Where a job name's measured s_R on a GPU type is kept (`measurements.instance_type`, 64 characters): under
    the type in upper case, as providers name models (H100), whatever case a job file spells it in."""
    return f"{gpu.upper()}:{job_name}"[:64]


def setup_key(job_name: str) -> str:
    """Where a job name's measured setup time is kept (`measurements.instance_type`, metric `setup_s`)."""
    return f"setup:{job_name}"[:64]


def recent_measurements(app: App, metric: str, keys: Iterable[str], recent: int = 10) -> dict[str, list[float]]:
    """Each key's newest `recent` values of `metric` (`measurements.instance_type` is the key), newest first: one
    query for a whole batch, by exact key."""
    from sqlalchemy import select

    from state import schema as s

    wanted = list(dict.fromkeys(keys))
    if not wanted:
        return {}
    with app.store.engine.connect() as c:
        # Newest first, sorted here: ORDER BY id in SQL makes SQLite walk the (metric, id) index through every
        # job's rows instead of looking up these keys in (metric, instance_type).
        rows = c.execute(select(s.measurements.c.id, s.measurements.c.instance_type, s.measurements.c.value)
                         .where(s.measurements.c.metric == metric, s.measurements.c.instance_type.in_(wanted))).all()
    found: dict[str, list[float]] = {}
    for _, key, value in sorted(rows, reverse=True):
        values = found.setdefault(key, [])
        if len(values) < recent:
            values.append(value)
    return found


def measured_setup_hours(app: App, names: Iterable[str]) -> dict[str, float]:
    """How long each job name's `setup` took on a fresh instance (median of its recent runs, in hours), for the
    names that have run one."""
    from statistics import median

    names = list(names)
    found = recent_measurements(app, "setup_s", (setup_key(name) for name in names))
    return {name: median(found[setup_key(name)]) / 3600.0 for name in names if setup_key(name) in found}


SETUPS_BORROWED = 20  # a job whose setup has never run is priced with the median of this many newest setups


def setup_estimates(app: App, names: Iterable[str]) -> dict[str, SetupEstimate]:
    """What each job name's `setup` adds to t_ovh: its own measured median; for a name that has never run its
    setup, the median of the newest setups of any job (a first run pays one too, and 0 would make its first burst
    look cheaper than every later one); nothing when no setup has ever run here."""
    from statistics import median

    from sqlalchemy import select

    from state import schema as s

    names = list(names)
    measured = measured_setup_hours(app, names)
    out = {name: SetupEstimate(h, MEASURED_SETUP) for name, h in measured.items()}
    if len(out) < len(names):
        m = s.measurements
        with app.store.engine.connect() as c:
            newest = [v for (v,) in c.execute(select(m.c.value).where(m.c.metric == "setup_s")
                                              .order_by(m.c.id.desc()).limit(SETUPS_BORROWED))]
        if newest:
            borrowed = SetupEstimate(median(newest) / 3600.0, f"not measured for this job yet: the median of the "
                                                              f"newest {len(newest)} setups of any job")
            out.update({name: borrowed for name in names if name not in out})
    return out


def setup_estimate(app: App, spec: JobSpec) -> SetupEstimate:
    """The job's setup time (`setup_estimates`); `UNMEASURED_SETUP` when there is nothing to go on, or no setup to
    look up (`facts` leaves a job without one at 0)."""
    if not spec.setup:
        return UNMEASURED_SETUP
    return setup_estimates(app, [spec.name]).get(spec.name, UNMEASURED_SETUP)


def work_done(app: App, job_id: str, conn: Any = None) -> float:
    """Work units a job has done, as its trainer last reported them (`units_done` in its metrics, or a hybrid
    local phase's count); 0 when it never said. Counts only with a checkpoint of the job home to resume from."""
    from sqlalchemy import select

    from state import schema as s

    query = select(s.attempts.c.info).where(s.attempts.c.job_id == job_id)
    if conn is not None:
        infos = [r[0] or {} for r in conn.execute(query)]
    else:
        with app.store.engine.connect() as c:
            infos = [r[0] or {} for r in c.execute(query)]
    return most_units_done((info.get("metrics"), info.get("units_done")) for info in infos)


def most_units_done(reports: Iterable[tuple[Any, Any]]) -> float:
    """The most work units any of these attempts reported, as (its metrics, its own `units_done`: a hybrid local
    phase's count); 0 when none did. Each figure is checked (`reported`): metrics.json is the trainer's to write."""
    done = 0.0
    for metrics, units in reports:
        for value in (reported(metrics if isinstance(metrics, dict) else None, "units_done"),
                      reported({"units_done": units}, "units_done")):
            if value is not None and value > done:
                done = value
    return done


def measured_rented_throughputs(app: App, gpus_by_name: Mapping[str, Iterable[str]], recent: int = 10
                                ) -> dict[str, dict[str, float]]:
    """s_R per GPU type as measured on each job name's earlier cloud runs (median of the recent ones), for the GPU
    types each name's spec lists: one query for a whole batch of jobs, by exact key."""
    from statistics import median

    wanted = {(name, gpu): throughput_key(gpu, name) for name, gpus in gpus_by_name.items() for gpu in gpus}
    found = recent_measurements(app, "throughput_units_h", wanted.values(), recent)
    out: dict[str, dict[str, float]] = {}
    for (name, gpu), key in wanted.items():  # two long names can share a key: each gets its values
        if key in found:
            out.setdefault(name, {})[gpu] = median(found[key])
    return out


def measured_rented_throughput(app: App, spec: JobSpec) -> dict[str, float]:
    """s_R per GPU type measured on this job name's earlier cloud runs, for the GPU types its spec lists."""
    return measured_rented_throughputs(app, {spec.name: spec.rented_throughput}).get(spec.name, {})


@dataclass(frozen=True)
class LocalBacklog:
    """The local work running on the local GPU or queued for it: read once, asked for many jobs in O(log n) each.
    Queued work is in the order the daemon starts local jobs in, earliest deadline first, each job on the first slot
    (`daemon.local_concurrency`) to come free: with one slot that is the sum of the work ahead; with two, a job
    behind one run that has 3 h left starts now on the other slot, not 1.5 h from now."""

    running_h: tuple[float, ...]  # what each run on the GPU has left: a run is never stopped for a job in line
    deadlines: tuple[float, ...]  # the queued jobs' deadlines, sorted
    queued_h: tuple[float, ...]  # their local hours, in that order
    free_at: tuple[float, ...]  # free_at[k]: hours until a slot is free once the first k of them have started
    own: dict[str, tuple[float, float, bool]]  # job id -> (deadline, local hours left, running)
    slots: int  # daemon.local_concurrency

    @classmethod
    def of(cls, jobs: Iterable[tuple[str, float, float, bool]], slots: int) -> LocalBacklog:
        """From (job id, deadline, local hours left, running) rows."""
        own = {job_id: (deadline, hours, running) for job_id, deadline, hours, running in jobs if hours > 0}
        queued = sorted((deadline, hours) for deadline, hours, running in own.values() if not running)
        running = tuple(h for _, h, running in own.values() if running)
        hours = tuple(h for _, h in queued)
        return cls(running, tuple(d for d, _ in queued), hours, _free_at(running, hours, slots), own, slots)

    def wait_h(self, deadline_at: float, exclude: str | None = None) -> float:
        """How long a job with this deadline waits for a slot of the local GPU: until the runs on it and the local
        jobs queued before it in line (an earlier or equal deadline) have left one free. `exclude`: the job asking,
        which does not wait for itself."""
        if self.slots < 1:
            return 0.0  # no local runs at all: gate 2 has nothing to wait for (and the job never starts locally)
        ahead = bisect.bisect_right(self.deadlines, deadline_at)
        if exclude not in self.own:
            return self.free_at[ahead]
        deadline, own_h, running = self.own[exclude]
        if not running and deadline > deadline_at:
            return self.free_at[ahead]  # behind the deadline asked about: not among what it waits for
        if not running and self.deadlines[ahead - 1] == deadline and self.queued_h[ahead - 1] == own_h:
            return self.free_at[ahead - 1]  # the last in line before that deadline: a job asking of its own, say
        # Otherwise (it is running, or ahead of others in line) its line is placed again without it.
        runs, line = list(self.running_h), list(zip(self.deadlines[:ahead], self.queued_h[:ahead], strict=True))
        if running:
            runs.remove(own_h)
        else:
            line.remove((deadline, own_h))
        return _free_at(tuple(runs), tuple(h for _, h in line), self.slots)[-1]


def _free_at(running_h: tuple[float, ...], queued_h: tuple[float, ...], slots: int) -> tuple[float, ...]:
    """Hours until a slot is free, before and after each queued job (in line order) starts on the first one free.
    With more runs than slots (the setting was lowered), a slot is free once enough of them have ended."""
    if slots < 1:
        return (0.0,) * (len(queued_h) + 1)
    free = [0.0] * max(slots - len(running_h), 0) + sorted(running_h)[-slots:]
    heapq.heapify(free)
    out = [free[0]]
    for h in queued_h:
        heapq.heapreplace(free, free[0] + h)
        out.append(free[0])
    return tuple(out)


def local_backlog(app: App, now: float, until: float | None = None) -> LocalBacklog:
    """The jobs that hold the local GPU or wait for it (queued, running, resuming; placed local or hybrid), each with
    what it has left locally. `until`: only the queued ones due by then matter to the caller (those behind them in
    line are not read: a long queue costs nothing here).

    What a job has left: its decision's local GPU hours (a local job's T_L, also when revert-local brought a cloud
    job home; a hybrid's local phase; with `local.available_hours`, the share of them it trains), less its progress
    since that decision. A local job whose trainer reports `units_done` counts the units it has left, whatever
    attempts did them (one resumed after a reboot holds the GPU for the rest of its work, not all of it again);
    otherwise, and for a hybrid, its running attempt's time so far.
    """
    from sqlalchemy import or_, select

    from orchestrator.lifecycle.machine import ACTIVE_ATTEMPT_STATES
    from state import schema as s

    states = [JobState.QUEUED.value, JobState.RUNNING.value, JobState.RESUMING.value]
    # The figures are read through JSON paths in SQL, so that thousands of queued jobs' decisions are never parsed.
    d = s.jobs.c.decision
    held = s.jobs.c.state.in_(states) & s.jobs.c.placement.in_(["local", "hybrid"])
    if until is not None:
        held &= or_(s.jobs.c.deadline_at <= until, s.jobs.c.state == JobState.RUNNING.value)
    with app.store.engine.connect() as c:
        rows = c.execute(select(
            s.jobs.c.id, s.jobs.c.deadline_at, s.jobs.c.placement, d[("plan", 0, "hours")].as_float(),
            d[("plan", 0, "where")].as_string(), d[("t_local_h",)].as_float(), d[("work_done",)].as_float(),
            d[("local_share",)].as_float(), s.jobs.c.spec[("work_units",)].as_float()).where(held)).all()
        started = dict(c.execute(select(s.attempts.c.job_id, s.attempts.c.started_at).where(
            s.attempts.c.where == "local", s.attempts.c.state.in_(ACTIVE_ATTEMPT_STATES),
            s.attempts.c.started_at.is_not(None))).all())
        # Only jobs that have run have attempts: few rows, whose reported units are checked here, not cast in SQL
        # (metrics.json is the trainer's to write).
        reports = c.execute(select(s.attempts.c.job_id, s.attempts.c.info[("metrics",)], s.attempts.c.info[
            ("units_done",)]).join(s.jobs, s.jobs.c.id == s.attempts.c.job_id).where(
            held, s.jobs.c.placement == "local")).all()
    by_job: dict[str, list[tuple[Any, Any]]] = {}
    for job_id, metrics, units in reports:
        by_job.setdefault(job_id, []).append((metrics, units))
    units_done = {job_id: most_units_done(pairs) for job_id, pairs in by_job.items()}
    jobs = []
    for job_id, deadline_at, placement, plan_h, plan_where, t_local_h, done_then, share, work in rows:
        if placement == "local":
            hours = float(t_local_h or 0.0)
        else:  # a hybrid's local phase; none when re-planned to burst at once
            hours = float(plan_h or 0.0) if plan_where == "local" else 0.0
        hours *= float(share or 1.0)  # GPU hours: with local.available_hours, T_L is wall-clock time
        done_now, done_then, work = units_done.get(job_id, 0.0), float(done_then or 0.0), float(work or 0.0)
        if placement == "local" and done_now > done_then and work > done_then:
            hours *= max(work - done_now, 0.0) / (work - done_then)
        elif job_id in started:
            hours -= (now - float(started[job_id])) / 3600.0
        jobs.append((str(job_id), float(deadline_at), hours, job_id in started))
    return LocalBacklog.of(jobs, app.config.daemon.local_concurrency)


def local_wait_h(app: App, spec: JobSpec, deadline_at: float, now: float, exclude: str | None = None,
                 backlog: LocalBacklog | None = None) -> float:
    """Gate 2's w for this job: the local GPU's queue ahead of it (`backlog` when the caller read it for a batch),
    read only for a job that can run locally at all."""
    if spec.local_throughput <= 0:
        return 0.0
    if backlog is None:
        backlog = local_backlog(app, now, until=deadline_at)
    return backlog.wait_h(deadline_at, exclude)


def facts(spec: JobSpec, deadline_at: float, now: float, cfg: Config, source: str | Path | None = None,
          measured: dict[str, float] | None = None, setup: SetupEstimate = UNMEASURED_SETUP,
          local_wait_h: float = 0.0) -> JobFacts:
    fits_local: bool | None = None
    memory_why: str | None = None
    per_gpu: float | None = None
    if spec.model is not None:
        from orchestrator.core import sizing  # the sizing module is optional input to gate 1

        try:
            local = sizing.estimate(spec.model, gpus=1)
            per_gpu = sizing.estimate(spec.model, gpus=spec.gpus).per_gpu_gb
        except BadInput as exc:
            raise exc.in_file(source) if source else exc from None
        margin_gb = cfg.local.safety_margin_gb
        fits_local = local.per_gpu_gb <= cfg.local.vram_gb - margin_gb
        if not fits_local:
            memory_why = (f"it needs {local.per_gpu_gb:.1f} GB, the local {cfg.local.gpu} has "
                          f"{sizing.gb_and_gib(cfg.local.vram_gb)} with {sizing.gb_and_gib(margin_gb)} kept free")
    priced = _priced_names(spec.rented_throughput, cfg)
    unpriced = [gpu for gpu in priced if gpu not in cfg.prices]
    if unpriced and source is not None:  # a job file taken in: a typo is refused, not queued to rethink
        gpu = unpriced[0]
        raise BadInput(f"'{gpu}' is not a GPU type of [prices] ({', '.join(sorted(cfg.prices))}): name one of "
                       f"them, or add [prices.{gpu}] to the config", source=source, field=f"rented_throughput.{gpu}")
    by_model = {gpu.upper(): s_r for gpu, s_r in (measured or {}).items()}
    measured = {gpu: by_model[gpu.upper()] for gpu in priced if gpu.upper() in by_model}
    return JobFacts(
        name=spec.name, kind=spec.kind, work=spec.work_units, s_local=spec.local_throughput,
        rented={**priced, **measured},
        rented_in_file={gpu: priced[gpu] for gpu, s_r in measured.items() if s_r != priced[gpu]},
        gpus=spec.gpus, deadline_h=(deadline_at - now) / 3600.0,
        market=spec.market or cfg.policy.default_market, deadline_critical=spec.deadline_critical,
        market_from="job" if spec.market else "policy.default_market",
        checkpoint_interval_h=spec.checkpoint.interval_minutes / 60.0, checkpoints=spec.checkpoint.resumable,
        fits_local_memory=fits_local, memory_why=memory_why, per_gpu_gb=per_gpu,
        setup_h=setup.hours if spec.setup else 0.0, setup_basis=setup.basis if spec.setup else "",
        local_wait_h=local_wait_h, stop_grace_s=spec.checkpoint.stop_grace_s,
    )


def job_facts(app: App, spec: JobSpec, deadline_at: float, now: float, path: str | Path) -> JobFacts:
    """`facts` for a job file taken in now, with what the state knows of it: the rented throughput measured for jobs
    of its name, its setup's measured time, and the local GPU's queue ahead of it."""
    return facts(spec, deadline_at, now, app.config, path, measured_rented_throughput(app, spec),
                 setup_estimate(app, spec), local_wait_h(app, spec, deadline_at, now))


def _priced_names(rented: dict[str, float], cfg: Config) -> dict[str, float]:
    """GPU types as `[prices]` spells them: `h100` in a job file is the H100 priced there, not an unknown type."""
    spelled = {name.lower(): name for name in cfg.prices}
    return {spelled.get(gpu.lower(), gpu): s_r for gpu, s_r in rented.items()}


def new_job_id() -> str:
    return "j" + secrets.token_hex(4)


def record_decision(app: App, job: JobFacts, decision: dict[str, Any], now: float, job_id: str | None) -> Path:
    text = records.render(job.name, job_id, decision, now=now, deadline_h=job.deadline_h, work=job.work,
                          s_local=job.s_local, gpus=job.gpus, local_gpu=app.config.local.gpu)
    # Offers' names and reasons are the providers' words, which may hold a key they were sent: as events, redacted.
    return records.write(app.config.state_dir, job.name, job_id, app.redactor(text), now)


def stored_spec(spec: JobSpec, path: str | Path, slot_at: float | None = None) -> dict[str, Any]:
    """A job file's spec as the jobs table keeps it: its workdir resolved, where it came from, and the slot of the
    schedule that queued it."""
    workdir = (Path(path).parent / spec.workdir).resolve()
    return {**spec.model_dump(mode="json"), "workdir": str(workdir), "source": str(Path(path).resolve()),
            **({"_slot_at": slot_at} if slot_at is not None else {})}


def enqueue(app: App, path: str | Path, now: float | None = None, *, slot_at: float | None = None,
            also: Callable[[Any, str], None] | None = None) -> tuple[str, Decision, Path]:
    """Validate, decide, record and queue a job file. A scheduled cycle (`orchestrator/schedules.py`) passes its
    `slot_at`, from which `deadline_hours` count, and `also(conn, job_id)`, done in the job's own transaction."""
    now = time.time() if now is None else now
    spec, deadline_at = load_job(path, now if slot_at is None else slot_at)
    job = job_facts(app, spec, deadline_at, now, path)
    ctx = context(app, now)
    decision = decide(job, ctx)
    d = decision.to_dict()
    job_id = new_job_id()
    deadline = datetime.fromtimestamp(deadline_at).astimezone().isoformat()
    state, placement = _state_said(decision, d), decision.placement
    if here_meanwhile(d, ctx, spec.kind):
        state, placement = JobState.QUEUED, "local"
    spec_data = stored_spec(spec, path, slot_at)
    record_path = record_decision(app, job, d, now, job_id)
    try:
        with app.store.tx() as conn:
            app.store.insert_job({
                "id": job_id, "name": spec.name, "kind": spec.kind, "state": state.value,
                "verdict": decision.verdict.value, "placement": placement, "spec": spec_data,
                "decision": d, "reason": headline(d), "deadline_at": deadline_at,
                "record_path": str(record_path),
            }, conn=conn)
            app.events.emit("job.enqueued", job_id=job_id, conn=conn, name=spec.name, state=state.value,
                            action=d["action"],
                            deadline=deadline, reason=headline(d))
            app.events.emit("job.decided", job_id=job_id, conn=conn, verdict=d["verdict"], action=d["action"],
                            inputs=_inputs(job), decision=d)
            if also is not None:
                also(conn, job_id)
    except BaseException:
        # The job was never written: no record may describe it.
        record_path.unlink(missing_ok=True)
        raise
    return job_id, decision, record_path


def _inputs(job: JobFacts) -> dict[str, Any]:
    return {"work": job.work, "s_local": job.s_local, "s_rented": job.rented, "gpus": job.gpus,
            "deadline_h": round(job.deadline_h, 4), "kind": job.kind, "market": job.market,
            "deadline_critical": job.deadline_critical, "fits_local_memory": job.fits_local_memory,
            "per_gpu_gb": job.per_gpu_gb,
            **({"setup_h": round(job.setup_h, 4), "setup_basis": job.setup_basis} if job.setup_basis else {})}




def spec_of(job: dict[str, Any]) -> JobSpec:
    """The validated spec of a stored job (its workdir already resolved to an absolute path)."""
    # "_"-keys are the daemon's own bookkeeping (retry and spot-probe times), not the user's spec.
    data = {k: v for k, v in job["spec"].items() if k != "source" and not k.startswith("_")}
    return JobSpec.model_validate(data, strict=False)  # stored as JSON: the deadline is a string there


@dataclass(frozen=True)
class Redecision:
    """A stored job decided again with today's facts, on the work it has left."""

    target: JobState
    decision: dict[str, Any]
    facts: JobFacts
    work_done: float


def redecide(app: App, job: dict[str, Any], ctx: DecisionContext, now: float, conn: Any = None,
             measured: dict[str, float] | None = None, setup: SetupEstimate | None = None,
             backlog: LocalBacklog | None = None) -> Redecision:
    """Decide a stored job again (deadline `job["deadline_at"]`). A job that has run, its checkpoint home, is decided
    on the work it has left, not on the whole of W (its next attempt resumes from the checkpoint), and is never
    dropped into rethink with that work (`JobFacts.started`)."""
    from orchestrator.lifecycle import checkpoints

    spec = spec_of(job)
    if measured is None:
        measured = measured_rented_throughput(app, spec)
    if setup is None:
        setup = setup_estimate(app, spec)
    deadline_at = float(job["deadline_at"])
    wait = local_wait_h(app, spec, deadline_at, now, job["id"], backlog)
    job_facts = facts(spec, deadline_at, now, app.config, measured=measured, setup=setup, local_wait_h=wait)
    started = checkpoints.latest(app.config, job["id"], deep=False) is not None
    done = work_done(app, job["id"], conn) if started else 0.0
    if started:
        job_facts = replace(job_facts, started=True, work=max(job_facts.work - done, job_facts.work * 1e-6))
    decision = decide(job_facts, ctx)
    d = decision.to_dict()
    if done > 0:
        d["work_done"] = round(done, 6)
        d["reasons"].insert(0, f"{done:.4g} of {spec.work_units:.4g} units done (its checkpoint is home): "
                               f"decided on the {job_facts.work:.4g} left")
    return Redecision(_state_said(decision, d), d, job_facts, done)


def _state_said(decision: Decision, d: dict[str, Any]) -> JobState:
    """The state a fresh decision puts its job in (`state_for`); a hybrid queued while its price awaits approval
    says so in its reasons (`d`, the decision as stored)."""
    state = state_for(decision.action, decision.placement)
    if state is JobState.QUEUED and decision.action == "await-approval":
        d["reasons"].append("meanwhile its local phase runs: only the hand-over to the cloud waits for `burstctl "
                            "approve` (never approved, it runs on locally, late)")
    return state


def here_meanwhile(d: dict[str, Any], ctx: DecisionContext, kind: str) -> bool:
    """Local-only (revert-local): a job whose decision the switch blocks but that fits here runs here meanwhile, late
    if need be, as revert-local requeues those it brings home; `burst-enable` puts it back on its plan if it has not
    started (`revert.restore_plans`). True when that is `d`'s case; its reasons then say so."""
    if not (d["action"] == "blocked" and not ctx.burst_enabled and kind in ctx.cloud_kinds and d.get("fits_locally")
            and d["placement"] in ("cloud", "hybrid")):
        return False
    from orchestrator.lifecycle.finish import REQUEUED_LOCAL

    d["reasons"].append(f"{REQUEUED_LOCAL} while bursting is disabled: it runs here, late if need be, until "
                        "`burstctl burst-enable` puts it back on this plan")
    d["headline"] = d["reasons"][-1]
    return True


def reconsider(app: App, job: dict[str, Any], ctx: DecisionContext, now: float, conn: Any = None,
               measured: dict[str, float] | None = None, setup: SetupEstimate | None = None,
               backlog: LocalBacklog | None = None) -> tuple[str, dict[str, Any]] | None:
    """Decide a blocked job again with today's facts; move it when the answer changed. Returns its new state and
    decision.
    `measured`, `setup`, `backlog`: its name's measured s_R and setup time, and the local GPU's queue, when the
    caller read them for a batch (else read here)."""
    again = redecide(app, job, ctx, now, conn, measured, setup, backlog)
    target, placement = again.target, again.decision["placement"]
    if here_meanwhile(again.decision, ctx, job["kind"]):
        target, placement = JobState.QUEUED, "local"
    if target.value == job["state"]:
        # Still held, maybe for another reason now (bursting enabled again, and the budget holds it): said as the
        # decision says it, without a record of its own for each tick's figures.
        if (said := headline(again.decision)) and said != job["reason"]:
            if conn is not None:
                app.store.update_job(job["id"], conn, expect_state=job["state"], reason=said)
            else:
                with app.store.tx() as c:
                    app.store.update_job(job["id"], c, expect_state=job["state"], reason=said)
        return None
    d = records.supersede(job["decision"], again.decision)
    d["reasons"].insert(0, f"decided again while {job['state']}" + (f" ({job['reason']})" if job["reason"] else ""))
    # A record of its own, as every decision has: the one before still describes the answer it changed.
    record = record_decision(app, again.facts, d, now, job["id"])

    def _apply(c: Any) -> tuple[str, dict[str, Any]] | None:
        if not app.store.update_job(job["id"], c, expect_state=job["state"], state=target.value,
                                    verdict=d["verdict"], placement=placement, decision=d,
                                    record_path=str(record), reason=headline(d)):
            record.unlink(missing_ok=True)
            return None
        app.events.emit("job.redecided", job_id=job["id"], conn=c, previous=job["state"], state=target.value,
                        verdict=d["verdict"], action=d["action"], record=str(record), placement=placement,
                        reason=headline(d))
        return target.value, {**d, "placement": placement}

    if conn is not None:  # the caller's transaction: it points the record before at this one once committed
        return _apply(conn)
    with app.store.tx() as c:
        done = _apply(c)
    if done is not None:
        records.superseded(job.get("record_path"), record, f"decided again while {job['state']}", now)
    return done


def retry(app: App, job: dict[str, Any], now: float | None = None, *,
          deadline_at: float | None = None, reread: bool = False) -> Redecision:
    """Queue a failed, cancelled or rethink job again, decided afresh on the work it has left: its next attempt
    resumes from its newest checkpoint, with the workdir as it is now (a fixed bug is picked up). The deadline stays,
    unless `deadline_at` gives a new one. `reread`: its job file is read again (a fixed command line), and its
    deadline counts from now as `enqueue`'s would. Refused, changing nothing, while an attempt of it is still being
    stopped, or when the decision would be rethink again. A new decision record describes the retry."""
    from orchestrator.lifecycle.machine import active_attempts

    now = time.time() if now is None else now
    if JobState(job["state"]) not in RETRIABLE:
        raise BadInput(f"job {job['id']} is {job['state']}: only a failed, cancelled or rethink job is retried "
                       "(`burstctl cancel` stops one that runs)", field="JOB")
    with app.store.tx() as conn:
        live = [a["id"] for a in active_attempts(conn) if a["job_id"] == job["id"]]
    if live:
        raise BadInput(f"job {job['id']}'s attempt {live[0]} is still being stopped; retry it once `burstctl show "
                       f"{job['id']}` says it ended", field="JOB")
    spec = {k: v for k, v in job["spec"].items() if k == "_slot_at" or not k.startswith("_")}  # the daemon's waits go
    deadline = float(job["deadline_at"])
    if reread:
        source = job["spec"].get("source")
        if not source:
            raise BadInput(f"job {job['id']} does not say which job file it came from", field="--reread")
        fresh, deadline = load_job(source, now)
        if fresh.name != job["name"]:
            raise BadInput(f"names the job '{fresh.name}', not '{job['name']}': a different job is enqueued, not "
                           "retried", source=source, field="name")
        spec = stored_spec(fresh, source, job["spec"].get("_slot_at"))
    deadline = deadline if deadline_at is None else deadline_at
    if deadline <= now:
        when = datetime.fromtimestamp(deadline).astimezone().isoformat(timespec="minutes")
        raise BadInput(f"job {job['id']}'s deadline ({when}) has passed: give a new one, counted from now",
                       field="--deadline-hours")
    again = redecide(app, {**job, "spec": spec, "deadline_at": deadline}, context(app, now), now)
    d = again.decision
    if again.target is JobState.RETHINK:
        raise BadInput(f"job {job['id']} would be rethink again: {headline(d) or ''} (a "
                       "later deadline, --deadline-hours, may do)")
    check_transition(job["state"], again.target.value, job["id"])
    records.supersede(job["decision"], d)
    d["retry_of"] = job["state"]
    d["reasons"].insert(0, f"retry of a {job['state']} job ({job['reason'] or 'no reason given'})"
                           f"{', its job file read again' if reread else ''}; its Measured line counts every attempt "
                           "of the job, the earlier ones too")
    record_path = record_decision(app, again.facts, d, now, job["id"])
    try:
        with app.store.tx() as conn:
            if not app.store.update_job(job["id"], conn, expect_state=job["state"], state=again.target.value,
                                        verdict=d["verdict"], placement=d["placement"], decision=d, spec=spec,
                                        deadline_at=deadline, approved=False, record_path=str(record_path),
                                        reason=headline(d)):
                raise BadInput(f"job {job['id']} changed state meanwhile; try again", field="JOB")
            app.events.emit("job.retried", job_id=job["id"], conn=conn, previous=job["state"],
                            state=again.target.value, verdict=d["verdict"], action=d["action"],
                            reason=headline(d),
                            work_done=round(again.work_done, 6), work_left=round(again.facts.work, 6),
                            deadline=datetime.fromtimestamp(deadline).astimezone().isoformat())
    except BaseException:
        record_path.unlink(missing_ok=True)  # the retry never happened: no record may describe it
        raise
    records.superseded(job.get("record_path"), record_path, "retried", now)  # a rethink job's: it never ran
    return again
