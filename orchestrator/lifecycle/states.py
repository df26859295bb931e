"""The job state machine, in one place. Every change of a job's state goes through `transition()`.

    queued ──────────────► running ──► done
      │  ▲                   │  ▲
      │  └── approve ──┐     │  └──── resuming ◄── (preempted attempt)
      ▼                │     ▼
    awaiting_approval ─┘   failed
    blocked (budget / kind / kill switch; re-decided every tick)
    rethink (neither local nor rented meets the deadline; never runs)
    cancelled (from any non-final state)
    failed, cancelled, rethink ── retry ──► queued | awaiting_approval | blocked (decided again on the work left;
                                            `burstctl retry`, `queue.retry`)
"""

from __future__ import annotations

from enum import StrEnum

from orchestrator.errors import BadInput


class JobState(StrEnum):
    QUEUED = "queued"
    AWAITING_APPROVAL = "awaiting_approval"
    BLOCKED = "blocked"
    RETHINK = "rethink"
    RUNNING = "running"
    RESUMING = "resuming"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in FINAL


FINAL = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.RETHINK})

# Where `retry` may put a job that is over without being done; until then it counts as over (FINAL).
RETRIED = frozenset({JobState.QUEUED, JobState.AWAITING_APPROVAL, JobState.BLOCKED})
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.BLOCKED, JobState.AWAITING_APPROVAL,
                                JobState.CANCELLED, JobState.FAILED}),
    JobState.AWAITING_APPROVAL: frozenset({JobState.QUEUED, JobState.BLOCKED, JobState.CANCELLED}),
    JobState.BLOCKED: frozenset({JobState.QUEUED, JobState.AWAITING_APPROVAL, JobState.CANCELLED,
                                 JobState.FAILED}),  # failed: its stored spec no longer validates
    JobState.RUNNING: frozenset({JobState.DONE, JobState.FAILED, JobState.RESUMING, JobState.QUEUED,
                                 JobState.BLOCKED, JobState.CANCELLED}),
    JobState.RESUMING: frozenset({JobState.RUNNING, JobState.QUEUED, JobState.BLOCKED, JobState.FAILED,
                                  JobState.CANCELLED}),
    JobState.RETHINK: RETRIED,
    JobState.DONE: frozenset(),
    JobState.FAILED: RETRIED,
    JobState.CANCELLED: RETRIED,
}

# The states `retry` takes a job from: over, and with somewhere to go.
RETRIABLE = frozenset(st for st, targets in JOB_TRANSITIONS.items() if st in FINAL and targets)

# What a fresh decision's action puts a new job in.
STATE_FOR_ACTION: dict[str, JobState] = {
    "run-local": JobState.QUEUED,
    "burst": JobState.QUEUED,
    "await-approval": JobState.AWAITING_APPROVAL,
    "blocked": JobState.BLOCKED,
    "rethink": JobState.RETHINK,
}


def state_for(action: str, placement: str) -> JobState:
    """What a fresh decision puts a job in. A hybrid plan awaiting approval is queued all the same: its local phase
    costs nothing and needs no one's leave, and only its hand-over to the cloud waits for `burstctl approve`
    (`Admission.hand_over_held`). Held whole, the local GPU sat idle while the deadline came closer."""
    if action == "await-approval" and placement == "hybrid":
        return JobState.QUEUED
    return STATE_FOR_ACTION[action]


def awaits_approval(job: dict) -> bool:
    """Whether a job's price waits for `burstctl approve`: held whole, or a hybrid whose local phase runs meanwhile."""
    return job["state"] == JobState.AWAITING_APPROVAL.value or (
        job["state"] in (JobState.QUEUED.value, JobState.RUNNING.value)
        and (job.get("decision") or {}).get("action") == "await-approval" and not job.get("approved"))


def check_transition(current: str, target: str, job: str) -> None:
    cur, tgt = JobState(current), JobState(target)
    if tgt not in JOB_TRANSITIONS[cur]:
        over = ""
        if cur in FINAL:  # "cannot become cancelled" read as stuck: it is over, and nothing of it waits or runs
            over = (": it never ran and nothing of it is queued (`burstctl retry` with a later --deadline-hours "
                    "queues it again)" if cur is JobState.RETHINK else ": it is over, and nothing of it runs")
        raise BadInput(f"job {job} is {cur.value}; it cannot become {tgt.value}{over}")
