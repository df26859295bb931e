"""A plain local run that measures it will miss its deadline, decided again. Pure.

Gate 2 kept the job local because the job file's s_L finishes it by the deadline. When the trainer's own figures
(`units_done`, `throughput_units_h`) say it will not, the deadline has a price after all, and `decide` prices it
as it prices any job, on the work left and the local speed measured. It gives one of three answers:
- a hybrid: the running local attempt becomes the plan's local phase, and it bursts the rest as late as is safe;
- a burst of the rest now;
- nothing meets the deadline any more: the job has started, so it finishes locally, late.
Bursting is held to the rules that apply at enqueue: the kill switch, the monthly budget, the approval ceiling and
the kinds allowed in the cloud. A job that does not resume from checkpoints is never moved, since its work would be
lost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from orchestrator.core.decision import Decision, DecisionContext, JobFacts, budget_admits, decide
from orchestrator.core.gates import Verdict

# hybrid / burst: the job moves. The others keep the local run going: late (nothing meets the deadline),
# await-approval (the price is above the ceiling and not approved), blocked (kill switch, budget, kind),
# not-resumable (never moved), on-time (at the measured speed local makes it after all).
Outcome = Literal["hybrid", "burst", "late", "await-approval", "blocked", "not-resumable", "on-time"]


@dataclass(frozen=True)
class Replan:
    outcome: Outcome
    facts: JobFacts  # what was decided: the work left, the local speed measured, the hours to the deadline
    decision: Decision | None  # None when it was not decided again (it does not resume from checkpoints)
    why: str  # one line for the job's reason

    @property
    def moves(self) -> bool:
        return self.outcome in ("hybrid", "burst")


def replan_late_local(job: JobFacts, ctx: DecisionContext, *, done: float, units_h: float,
                      approved: bool = False) -> Replan:
    """The job as enqueued (`job.work` is the whole W, `job.deadline_h` the hours left now), `done` units of it done
    (with a checkpoint to resume from), running locally at `units_h` (> 0) as measured. `approved`: the user approved
    the price of its deadline (`burstctl approve`)."""
    if not units_h > 0:
        raise ValueError("a local speed measured above 0 is needed")
    # It runs on the local GPU, so it fits there whatever a memory estimate says; it has started, so a deadline
    # nothing can meet any more is finished late, locally, rather than thrown away (`JobFacts.started`).
    left = replace(job, work=max(job.work - min(done, job.work), job.work * 1e-6), s_local=units_h, started=True,
                   fits_local_memory=None)
    if not job.checkpoints:
        return Replan("not-resumable", left, None,
                      "it does not resume from checkpoints, so it is not moved: it finishes locally, late")
    d = decide(left, ctx)
    # A hybrid the budget cannot pay is queued at enqueue to run its free local phase; this job is already running
    # locally, so it is kept as it is, said blocked by the budget, and asked again at a later market check.
    unpaid = d.plan is not None and not budget_admits(d.plan, left, ctx)[0]
    go = (d.action == "burst" or (d.action == "await-approval" and approved)) and not unpaid
    if go and d.plan is not None and d.plan.kind in ("hybrid", "burst"):
        cloud = next(p for p in d.plan.phases if p.where == "cloud")
        where = f"{cloud.gpu} ({cloud.market})"
        if d.plan.kind == "hybrid":
            return Replan("hybrid", left, d,
                          f"re-planned: a hybrid, ${d.plan.cost_usd:.2f}: it runs on locally for "
                          f"{d.plan.phases[0].hours:.2f} h at most, then bursts the rest to {where} as late as is safe")
        return Replan("burst", left, d, f"re-planned: it bursts the rest to {where} now, ${d.plan.cost_usd:.2f}")
    g = d.gates
    if d.action == "await-approval" and not unpaid:
        extra = (d.plan.cost_usd if d.plan else 0.0) - (g.c_local_usd or 0.0)
        return Replan("await-approval", left, d,
                      f"re-planned: bursting the rest makes the deadline for ${extra:.2f} more than finishing "
                      f"locally, above the ${ctx.max_auto_delta_usd:.2f} approved without asking: it runs on "
                      "locally, late, unless `burstctl approve`")
    if d.action == "blocked" or unpaid:
        if job.kind not in ctx.cloud_kinds:
            cause = f"kind '{job.kind}' may not run in the cloud"
        elif not ctx.burst_enabled:
            cause = "bursting is disabled (revert-local; `burstctl burst-enable` lifts it)"
        else:
            cause = next((r for r in d.reasons if r.startswith("budget: ")), d.reasons[-1])
        return Replan("blocked", left, d, f"re-planned: it runs on locally, late: {cause}")
    if d.verdict is Verdict.LOCAL:
        return Replan("on-time", left, d, "re-planned: at the speed measured, local still finishes by the deadline")
    if g.t_rented_h is not None and g.t_local_h is not None:
        why = (f"neither local ({g.t_local_h:.2f} h) nor rented ({g.t_rented_h:.2f} h) finishes the rest within the "
               f"{max(left.deadline_h, 0.0):.2f} h left")
    else:
        why = "no rented GPU type can take the rest"
    return Replan("late", left, d, f"re-planned: {why}: it finishes late, locally")
