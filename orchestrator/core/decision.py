"""One job's full decision: gate 1 (sizing), gate 2 (deadline), offer, market, plan, budget, approval. Pure.

The shell gathers the facts (config, measured overhead, month-to-date spend, the kill switch) into a
`DecisionContext`; this module turns a job's facts into a `Decision` with its reasons. The daemon, the CLI
and the simulator all call it, so what is reported is what runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from orchestrator.core.budget import DEFAULT_GRACE_S, Held, Launch, Spending, admits, stop_horizon_h
from orchestrator.core.gates import GateInputs, GateResult, Verdict, evaluate
from orchestrator.core.local_hours import LocalHours
from orchestrator.core.market import NO_SPOT_OFFER, MarketChoice, MarketInputs, choose_market
from orchestrator.core.plan import Phase, Plan, hybrid_plan
from orchestrator.core.sizing import gb_and_gib

Action = Literal["run-local", "burst", "await-approval", "blocked", "rethink"]


@dataclass(frozen=True)
class GpuOffer:
    gpu: str
    od_usd_per_gpu_h: float
    spot_usd_per_gpu_h: float | None
    vram_gb: float
    no_spot_why: str = NO_SPOT_OFFER  # said when spot is None (decide's flags mode says why there is none)


@dataclass(frozen=True)
class ListedPrice:
    """What providers last listed a machine of one GPU type and count for: the cheapest per GPU, and who and when."""

    od_usd_per_gpu_h: float
    spot_usd_per_gpu_h: float | None  # None: no spot market listed for it
    seen: str  # "sim 3 min ago", for the reasons
    vram_gb: float | None = None  # the smallest card listed for it (marketed GB read as GiB), None: not said


@dataclass(frozen=True)
class JobFacts:
    name: str
    kind: str
    work: float
    s_local: float
    rented: dict[str, float]  # GPU type → units/h per GPU
    gpus: int
    deadline_h: float
    market: Literal["auto", "spot", "on-demand"] = "auto"
    market_from: str = "job"  # who chose `market`: "job", or "policy.default_market" when the job did not
    deadline_critical: bool = False
    checkpoint_interval_h: float = 0.5
    checkpoints: bool = True
    # It has run and a checkpoint of it is home (`work` is then what is left): when the deadline can no longer be
    # met, it is finished late rather than dropped into rethink with its work thrown away.
    started: bool = False
    fits_local_memory: bool | None = None  # from sizing; None when no [model] table
    memory_why: str | None = None  # when it does not fit: what it needs against what the local card has
    # GPU type → the job file's s_R, where `rented` holds the s_R measured on earlier runs of the job's name instead.
    rented_in_file: dict[str, float] = field(default_factory=dict)
    per_gpu_gb: float | None = None  # from sizing, on the rented GPU count
    # The job's `setup` on a fresh instance: every instance it rents pays it, so it is part of the job's t_ovh.
    setup_h: float = 0.0
    setup_basis: str = ""  # where setup_h comes from, for the record (`SetupEstimate.basis`); "" without a setup
    # Local work queued ahead of it (earlier deadlines) before the local GPU is free for it: gate 2's w.
    local_wait_h: float = 0.0
    # checkpoint.stop_grace_s: a stop of its instance waits this long for its last checkpoint, billing meanwhile.
    stop_grace_s: float = DEFAULT_GRACE_S


MEASURED_SETUP = "measured on its earlier runs"


@dataclass(frozen=True)
class SetupEstimate:
    """What a job's `setup` adds to each instance's t_ovh, and where that figure comes from."""

    hours: float
    basis: str


UNMEASURED_SETUP = SetupEstimate(0.0, "not measured yet, and no job's setup has run here: left out of t_ovh")


@dataclass(frozen=True)
class DecisionContext:
    local_usd_h: float
    offers: dict[str, GpuOffer]
    overhead_h: float
    preemptions_per_h: float = 0.05
    # Where λ came from, for the record: "configured", or the evidence it was learned from.
    preemptions_basis: str = "configured"
    # λ and its basis per rented GPU type (upper case), where this installation has seen it on spot (else the above).
    preemptions_by_gpu: dict[str, tuple[float, str]] = field(default_factory=dict)
    max_auto_delta_usd: float = 5.0
    cloud_kinds: tuple[str, ...] = ("train",)
    hybrid_margin_h: float = 0.25
    policy_tick_h: float = 0.0  # daemon.policy_tick_h: the spot policy's safety net rounds to it
    budget_cap_usd: float = math.inf
    # The month's spend as the launch's budget check counts it (`BudgetGuard.spending`): closed charges, open ones at
    # no less than their billing minimum; and what is kept for the running instances to stop.
    spent_usd: float = 0.0
    kept_usd: float = 0.0
    held: Held = field(default_factory=Held)  # what admitted jobs have still to spend (`holds.held_by_plans`)
    # Earlier months a charge is still open in, and what each has committed and kept (`Spending.earlier`).
    earlier_usd: tuple[tuple[str, float], ...] = ()
    stop_tick_s: float = 0.0  # the daemon's tick: a stop of the job's instance takes three of them (`stop_horizon_h`)
    billing_minimum_s: float = 60.0  # what a launch is billed at least (every provider's offer says 60 s)
    burst_enabled: bool = True
    local_hours: LocalHours | None = None  # local.available_hours, and the local time now (None: always open)
    local_slots: int = 1  # daemon.local_concurrency: 0 starts no local run, so nothing is planned on the local GPU
    # GB kept free on a rented card beside the job's per-GPU estimate (local.safety_margin_gib): the rule gate 1
    # applies to the local card, so a job is not sent to a card it fills to the last byte.
    vram_margin_gb: float = 0.0
    # (GPU type, GPU count) → its price as providers last listed it (`offers_seen`): what a launch pays, where known.
    listed: dict[tuple[str, int], ListedPrice] = field(default_factory=dict)
    # GPU type → the GPU counts of the machines providers list, when every enabled provider has listed lately: a
    # type or count none of them sells is skipped. None: not known (the reference prices alone are used).
    listed_shapes: dict[str, tuple[int, ...]] | None = None


def as_listed(ctx: DecisionContext, gpu: str, offer: GpuOffer, gpus: int) -> tuple[GpuOffer, ListedPrice | None]:
    """[prices]' offer for a GPU type as a decision prices a machine of `gpus` of them: at what an enabled provider
    last listed it for, where one did this week, with the listed card's memory if smaller than [prices]' figure (an
    A100 of 40 GB where [prices] has 80); and that listing (None: [prices] stands)."""
    listed = ctx.listed.get((gpu.upper(), gpus))
    if listed is None:
        return offer, None
    return replace(offer, od_usd_per_gpu_h=listed.od_usd_per_gpu_h, spot_usd_per_gpu_h=listed.spot_usd_per_gpu_h,
                   vram_gb=min(offer.vram_gb, listed.vram_gb or math.inf)), listed


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    action: Action
    gates: GateResult
    gpu: str | None
    rate_usd_per_gpu_h: float | None
    market: MarketChoice | None
    plan: Plan | None
    reasons: list[str] = field(default_factory=list)
    overhead_h: float = 0.0
    # With local.available_hours: the share of the local run's wall-clock hours that it trains (T_L times it is its
    # GPU hours, what the local queue counts it for); for a hybrid plan, the share of its local phase's hours.
    local_share: float = 1.0
    # Why the verdict is what it is, where the last of the reasons is only a note (a price as listed, the local
    # GPU's hours): the job's reason, its notice's text (`to_dict`'s "headline"). None: the last reason.
    headline: str | None = None
    # What its plan's launch needs of a month's budget (`planned_launch`): beside a cap it tells whether any month
    # pays it (`budget.unpaid_hand_over`). None: it rents nothing.
    launch_usd: float | None = None

    @property
    def placement(self) -> str:
        if self.action == "run-local":
            return "local"
        if self.plan is not None and self.plan.kind == "hybrid":
            return "hybrid"
        if self.action in ("burst", "await-approval") or (self.action == "blocked" and self.gpu):
            return "cloud"
        return "none"

    def to_dict(self) -> dict[str, Any]:
        g = self.gates
        m = self.market
        return {
            "verdict": self.verdict.value,
            "action": self.action,
            "placement": self.placement,
            "fits_locally": g.fits_locally,
            "t_local_h": _r(g.t_local_h),
            "local_wait_h": _r(g.local_wait_h),
            **({} if g.local_queued_h is None else {"local_queued_h": _r(g.local_queued_h)}),
            "local_share": _r(self.local_share),
            "c_local_usd": _r(g.c_local_usd),
            "t_rented_h": _r(g.t_rented_h),
            "c_rented_usd": _r(g.c_rented_usd),
            "delta_cost_usd": _r(g.delta_cost_usd),
            "hours_saved": _r(g.hours_saved),
            "gpu": self.gpu,
            # A rate, kept to the places of the instance's below: a listed machine's price per GPU (9.87 / 3 GPUs)
            # had all of a float's digits.
            "rate_usd_per_gpu_h": None if self.rate_usd_per_gpu_h is None else round(self.rate_usd_per_gpu_h, 6),
            "overhead_h": self.overhead_h,
            "market": m.market if m else None,
            "market_costs": None if m is None else {
                "on_demand_usd": _r(m.od_cost_usd), "on_demand_h": _r(m.od_hours),
                # The instance's on-demand $/h itself: the rounded figures above divide to 3.3191 for a $3.29 one.
                "on_demand_usd_h": round(m.od_cost_usd / m.od_hours, 6) if m.od_hours else None,
                "spot_expected_usd": _r(m.spot_cost_usd), "spot_expected_h": _r(m.spot_hours),
                "expected_preemptions": _r(m.expected_preemptions),
                "preemptions_per_h": _r(m.preemptions_per_h),
            },
            "plan": None if self.plan is None else [p.as_dict() for p in self.plan.phases],
            "plan_kind": None if self.plan is None else self.plan.kind,
            "plan_cost_usd": None if self.plan is None else _r(self.plan.cost_usd),
            "reasons": list(g.reasons) + list(self.reasons),
            "headline": self.headline or next(reversed([*g.reasons, *self.reasons]), None),
            **({} if self.launch_usd is None else {"launch_usd": _r(self.launch_usd)}),
        }


def _verdict_line(g: GateResult) -> str | None:
    """The gates' last word: why the verdict is local, or rethink."""
    return g.reasons[-1] if g.reasons else None


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


@dataclass(frozen=True)
class LocalRun:
    """The local GPU's terms for one job: its effective s_L and $/h (per wall-clock hour), the wait before it
    (wall-clock hours), why it cannot run there at all, and the share of its run's wall-clock time it trains."""

    s_local: float
    usd_h: float
    wait_h: float
    unfit_why: str | None = None
    queued_h: float | None = None  # the GPU hours of the work queued ahead, when the hours stretch them (else None)
    share: float = 1.0
    reason: str | None = None


def through_local_hours(job: JobFacts, ctx: DecisionContext) -> LocalRun:
    """The job's local run through `local.available_hours`, from now: first the work queued ahead of it (w, GPU
    hours), then its own W / s_L. T_L is then when it would be done, and it draws power only while it trains. A run
    that cannot checkpoint is never paused: it waits for a stretch of hours long enough to run in one sitting."""
    if ctx.local_slots <= 0 and job.s_local > 0:
        return LocalRun(0.0, ctx.local_usd_h, job.local_wait_h, unfit_why=(
            "daemon.local_concurrency is 0: the daemon starts no local run"))
    hours = ctx.local_hours
    if hours is None or hours.always_open() or job.s_local <= 0:
        return LocalRun(job.s_local, ctx.local_usd_h, job.local_wait_h)
    gpu_h = job.work / job.s_local
    wait_h = hours.wall_h(job.local_wait_h)
    queued_h = job.local_wait_h if wait_h > job.local_wait_h + 1e-9 else None
    free = hours.later(wait_h)
    wall = free.run_wall_h(gpu_h, pauses=job.checkpoints)
    if wall is None:
        return LocalRun(0.0, ctx.local_usd_h, wait_h, queued_h=queued_h, unfit_why=(
            f"no stretch of local.available_hours is {gpu_h:.2f} h long, and a run that cannot checkpoint is never "
            "paused"))
    if wall <= gpu_h:
        return LocalRun(job.s_local, ctx.local_usd_h, wait_h, queued_h=queued_h)
    share = gpu_h / wall
    return LocalRun(job.s_local * share, ctx.local_usd_h * share, wait_h, queued_h=queued_h, share=share, reason=(
        f"local GPU open {gpu_h:.2f} h of the {wall:.2f} h from {'now' if wait_h <= 0 else 'its turn'} to the end "
        f"of its run (local.available_hours{'' if job.checkpoints else ', in one sitting'}): effective s_L "
        f"{job.s_local * share:.4g} units/h"))


def planned_launch(plan: Plan, job: JobFacts, ctx: DecisionContext) -> Launch:
    """A plan's cloud run as the launch's budget check will count it: its hours at its rate (a spot plan's expected
    rework included), never fewer than the billing minimum, and its stop horizon."""
    cloud = next((p for p in plan.phases if p.where == "cloud"), None)
    if cloud is None or cloud.hours <= 0:
        return Launch(0.0, 0.0)
    return Launch(cloud.cost_usd / cloud.hours, cloud.hours, ctx.billing_minimum_s,
                  stop_horizon_h(ctx.stop_tick_s, job.stop_grace_s))


def budget_admits(plan: Plan, job: JobFacts, ctx: DecisionContext) -> tuple[bool, str]:
    """Whether the month's budget pays the plan's launch, asked as the launch will ask it (`budget.admits`), and why."""
    return admits(planned_launch(plan, job, ctx), ctx.budget_cap_usd,
                  Spending(ctx.spent_usd, ctx.kept_usd, ctx.held, ctx.earlier_usd))


def decide(job: JobFacts, ctx: DecisionContext) -> Decision:
    local = through_local_hours(job, ctx)
    d = _decide(job, ctx, local)
    share = local.share
    if d.plan is not None and d.plan.kind == "hybrid":  # the share of its local phase's hours it trains
        phase = d.plan.phases[0]
        share = phase.work_units / phase.units_h / phase.hours if phase.units_h and phase.hours > 0 else 1.0
    return replace(d, local_share=share) if abs(share - 1.0) > 1e-6 else d


def _decide(job: JobFacts, ctx: DecisionContext, local: LocalRun) -> Decision:
    reasons: list[str] = []
    overhead_h = ctx.overhead_h + job.setup_h  # t_ovh of this job's instances
    if job.setup_h > 0:
        reasons.append(f"t_ovh {overhead_h:.2f} h: {ctx.overhead_h:.2f} h per instance, plus this job's setup "
                       f"({job.setup_h * 60:.1f} min, {job.setup_basis or MEASURED_SETUP})")
    elif job.setup_basis:
        reasons.append(f"this job's setup: {job.setup_basis}")
    s_local, local_usd_h, wait_h = local.s_local, local.usd_h, local.wait_h
    if local.reason:
        reasons.append(local.reason)

    # Candidate rented GPU types: priced, sold, and big enough when sizing says how much memory a GPU needs. What
    # the choice rests on is said only if the job rents: a local job's reason stays its gate 2.
    candidates: list[tuple[str, float, GpuOffer]] = []
    skipped: list[str] = []
    said: dict[str, list[str]] = {}  # GPU type → where its price and s_R come from, when not the job file / [prices]
    too_small = unsold = False
    for gpu, s_r in job.rented.items():
        offer = ctx.offers.get(gpu)
        if offer is None:
            skipped.append(f"no price known for GPU type {gpu}: skipped")
            continue
        shapes = ctx.listed_shapes
        if shapes is not None and job.gpus not in shapes.get(gpu.upper(), ()):
            sold = ", ".join(f"{g} ×{'/'.join(map(str, n))}" for g, n in sorted(shapes.items())) or "nothing"
            skipped.append(f"{gpu}: no provider lists a {job.gpus}×{gpu} machine (they list {sold}): skipped")
            unsold = True
            continue
        notes = said.setdefault(gpu, [])
        reference = offer
        offer, listed = as_listed(ctx, gpu, offer, job.gpus)
        if listed is not None and (offer.od_usd_per_gpu_h, offer.spot_usd_per_gpu_h) != (
                reference.od_usd_per_gpu_h, reference.spot_usd_per_gpu_h):
            spot = (f", spot ${listed.spot_usd_per_gpu_h:.2f}" if listed.spot_usd_per_gpu_h is not None
                    else ", no spot market")
            notes.append(f"{gpu}: ${listed.od_usd_per_gpu_h:.2f}/GPU-h on-demand{spot}, as {listed.seen} "
                         f"listed {job.gpus}×{gpu} ([prices.{gpu}] says ${reference.od_usd_per_gpu_h:.2f})")
        if job.per_gpu_gb is not None and job.per_gpu_gb + ctx.vram_margin_gb > offer.vram_gb:
            skipped.append(f"{gpu}: needs {job.per_gpu_gb:.1f} GB per GPU and {gb_and_gib(ctx.vram_margin_gb)} kept "
                           f"free, has {gb_and_gib(offer.vram_gb)}: skipped")
            too_small = True
            continue
        if gpu in job.rented_in_file:
            notes.append(f"s_R on {gpu}: {s_r:.4g} units/h per GPU, measured on earlier runs of {job.name} (the job "
                         f"file says {job.rented_in_file[gpu]:.4g})")
        candidates.append((gpu, s_r, offer))

    def gate(s_r: float, rate: float) -> GateResult:
        return evaluate(GateInputs(work=job.work, s_local=s_local, s_rented=s_r, deadline_h=job.deadline_h,
                                   rate_usd_per_gpu_h=rate, gpus=job.gpus, overhead_h=overhead_h,
                                   local_usd_h=local_usd_h, fits_locally=job.fits_local_memory,
                                   local_wait_h=wait_h, local_queued_h=local.queued_h,
                                   unfit_why=local.unfit_why or job.memory_why))

    if not candidates:
        g = gate(0.0, 0.0)
        if g.verdict is Verdict.LOCAL:
            return Decision(Verdict.LOCAL, "run-local", g, None, None, None,
                            Plan("local", (Phase("local", g.t_local_h or 0.0, g.c_local_usd or 0.0),)),
                            reasons, overhead_h, headline=_verdict_line(g))
        reasons += skipped
        if too_small:
            reasons.append("no rented GPU type can run this job: rethink scope (e.g. LoRA/QLoRA, or FSDP over more "
                           "GPUs: `burstctl size --gpus N --parallelism fsdp`)"
                           + (", or name a GPU type and count a provider sells" if unsold else ""))
        elif unsold:
            reasons.append("no provider sells a machine of the GPU types and count it names: change `gpus` or "
                           "`rented_throughput` to one they list")
        else:  # nothing was too small: the types it names are only unpriced
            reasons.append("no GPU type in rented_throughput has a price: name a type of [prices] in the config "
                           f"({', '.join(sorted(ctx.offers)) or 'none configured'}) or add a [prices.<GPU>] table")
        return Decision(Verdict.RETHINK, "rethink", g, None, None, None, None, reasons, overhead_h)

    # Cheapest type that meets the deadline on-demand; if none does, the fastest.
    evaluated = [(gate(s_r, o.od_usd_per_gpu_h), gpu, s_r, o) for gpu, s_r, o in candidates]
    meeting = [e for e in evaluated if (e[0].t_rented_h or math.inf) <= job.deadline_h]
    pool = meeting or evaluated
    key = (lambda e: e[0].c_rented_usd or math.inf) if meeting else (lambda e: e[0].t_rented_h or math.inf)
    g, gpu, s_r, offer = min(pool, key=key)
    if g.verdict is not Verdict.LOCAL:  # a local run rents nothing
        reasons += skipped + said[gpu]
        if len(candidates) > 1:
            reasons.append(f"GPU type {gpu}: {'cheapest that meets the deadline' if meeting else 'fastest'} "
                           f"of {', '.join(c[0] for c in candidates)}")

    if g.verdict is Verdict.LOCAL:
        plan = Plan("local", (Phase("local", g.t_local_h or 0.0, g.c_local_usd or 0.0),))
        return Decision(g.verdict, "run-local", g, gpu, offer.od_usd_per_gpu_h, None, plan, reasons, overhead_h,
                        headline=_verdict_line(g))
    if g.verdict is Verdict.RETHINK and not job.started:
        return Decision(g.verdict, "rethink", g, gpu, offer.od_usd_per_gpu_h, None, None, reasons, overhead_h,
                        headline=_verdict_line(g))
    if g.verdict is Verdict.RETHINK:
        # Gate 2's verdict, so the job fits locally. The deadline is lost either way, and it was the only reason to
        # rent: finish what is left locally rather than throw the work done away.
        reasons.append(f"its deadline can no longer be met by local ({g.t_local_h:.2f} h) or rented "
                       f"({g.t_rented_h:.2f} h): it finishes late, locally; `burstctl cancel` ends it instead")
        plan = Plan("local", (Phase("local", g.t_local_h or 0.0, g.c_local_usd or 0.0),))
        return Decision(g.verdict, "run-local", g, gpu, offer.od_usd_per_gpu_h, None, plan, reasons,
                        overhead_h)

    t_r = g.t_rented_h or math.inf
    rate_h, basis = ctx.preemptions_by_gpu.get(gpu.upper(), (ctx.preemptions_per_h, ctx.preemptions_basis))
    market = choose_market(MarketInputs(
        run_h=t_r, gpus=job.gpus, od_usd_per_gpu_h=offer.od_usd_per_gpu_h,
        spot_usd_per_gpu_h=offer.spot_usd_per_gpu_h, preemptions_per_h=rate_h,
        checkpoint_interval_h=job.checkpoint_interval_h, restart_overhead_h=overhead_h,
        deadline_h=job.deadline_h, deadline_critical=job.deadline_critical, preference=job.market,
        resumable=job.checkpoints, preference_from=job.market_from, policy_tick_h=ctx.policy_tick_h,
        no_spot_why=offer.no_spot_why))
    reasons.extend(f"market: {r}" for r in market.reasons)
    if market.spot_cost_usd is not None:
        reasons.append(f"market: λ = {rate_h:.3g} preemptions/h ({basis})")
    rate = offer.spot_usd_per_gpu_h if market.market == "spot" and offer.spot_usd_per_gpu_h else \
        offer.od_usd_per_gpu_h

    plan = Plan("burst", (Phase("cloud", market.hours, market.cost_usd, market=market.market, gpu=gpu,
                                work_units=job.work),))
    if g.verdict is Verdict.PRICED and job.checkpoints:
        # Bursting as late as is safe leaves the rented phase t_ovh + margin of slack. A preemption costs another
        # t_ovh at least, and the spot policy's safety net keeps 2·t_ovh: unless the margin is larger than t_ovh,
        # that phase runs on on-demand (tests/test_e2e_hybrid.py), so it is priced so.
        spot_room = market.market == "spot" and ctx.hybrid_margin_h > overhead_h
        # Through the local GPU's hours, the local phase is planned hour by hour from its start (after the wait),
        # not at the whole run's effective s_L: a phase that starts at nightfall trains all of its hours.
        hours = ctx.local_hours
        by_hours = hours is not None and not hours.always_open()
        hybrid = hybrid_plan(work=job.work, s_local=job.s_local if by_hours else s_local, s_rented=s_r, gpus=job.gpus,
                             overhead_h=overhead_h,
                             deadline_h=job.deadline_h - wait_h,  # its local phase starts after the wait
                             margin_h=ctx.hybrid_margin_h, local_usd_h=ctx.local_usd_h if by_hours else local_usd_h,
                             rented_usd_per_gpu_h=market.rate_usd_per_gpu_h if spot_room else offer.od_usd_per_gpu_h,
                             market="spot" if spot_room else "on-demand", gpu=gpu,
                             open_h=hours.later(wait_h).open_h if hours is not None and by_hours else None,
                             wait_h=wait_h, billed_per_h=market.hours / t_r if spot_room and t_r > 0 else 1.0)
        if hybrid is not None and hybrid.cost_usd < plan.cost_usd:
            first = hybrid.phases[0]
            trains = f" (the GPU open {first.work_units / job.s_local:.2f} h of them, local.available_hours)" \
                if by_hours else ""
            reasons.append(f"plan: local {first.hours:.2f} h first{trains}, then burst the rest "
                           f"({hybrid.phases[1].hours:.2f} h): ${hybrid.cost_usd:.2f} instead of ${plan.cost_usd:.2f}")
            plan = hybrid

    action: Action = "burst"
    launch = planned_launch(plan, job, ctx)
    if job.kind not in ctx.cloud_kinds:
        action = "blocked"
        reasons.append(f"kind '{job.kind}' may not run in the cloud (policy.cloud_kinds = "
                       f"{list(ctx.cloud_kinds)}): the cloud's role is bounded to training")
    elif not ctx.burst_enabled:
        action = "blocked"
        reasons.append("bursting is disabled (revert-local): the job waits; `burstctl burst-enable` lifts it")
    else:
        ok, why = budget_admits(plan, job, ctx)
        # No month's budget pays it: what its launch needs (its billing minimum and its stop beside the plan's price)
        # is more than the whole cap, as the launch's check counts it.
        over_cap = launch.usd > ctx.budget_cap_usd + 1e-9
        if math.isfinite(ctx.budget_cap_usd) and not (over_cap and plan.kind == "hybrid"):  # a hybrid's says more
            reasons.append(f"budget: {why}")
        if not ok and plan.kind != "hybrid":
            action = "blocked"
        elif g.verdict is Verdict.PRICED and not job.deadline_critical:
            extra = plan.cost_usd - (g.c_local_usd or 0.0)
            # The plan's cost against local's: what running it adds (ΔC above is the seed's all-on-demand figure).
            versus = f"(its plan ${plan.cost_usd:.2f} against ${g.c_local_usd or 0.0:.2f} local)"
            if extra > ctx.max_auto_delta_usd:
                action = "await-approval"
                reasons.append(f"its plan costs ${extra:.2f} more than local {versus}, above the "
                               f"${ctx.max_auto_delta_usd:.2f} approved without asking: `burstctl approve`")
            elif extra < 0:  # local's own hours cost more than renting (a slow card, a long job)
                reasons.append(f"the deadline costs nothing: its plan is ${-extra:.2f} cheaper than local {versus}")
            else:
                reasons.append(f"its plan costs ${extra:.2f} more than local {versus}: within the "
                               f"${ctx.max_auto_delta_usd:.2f} approved without asking")
        if not ok and plan.kind == "hybrid":
            # A hybrid's local hours spend no cloud money: they start now, and the budget is asked again at the
            # hand-over (the launch's own check), which waits for it. The alternative is the local GPU idle.
            if over_cap:
                reasons.append(f"budget: its cloud phase (${launch.usd:.2f}: {launch.said()}) is more than the "
                               f"whole ${ctx.budget_cap_usd:.2f} monthly cap, so no month pays it: it runs locally, "
                               "late, and hands over only if budget.monthly_cap_usd is raised")
            else:
                reasons.append("budget: the local phase runs first, and the hand-over to the cloud waits until the "
                               "budget allows it (raise the cap, or the month turns); until then it runs on locally, "
                               "late")
    return Decision(g.verdict, action, g, gpu, rate, market, plan, reasons, overhead_h, launch_usd=launch.usd)
