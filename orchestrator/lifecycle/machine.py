"""The attempt state machine, in one place: its states, its transitions, the one function that creates an attempt
(`create`, at `intent`: the cloud's, a spot probe's, a local run's) and the one that moves one (compare-and-set in the
database). The reconciler decides *when*; this says *what may*.

A cloud attempt:

    intent ─launch─► provisioning ─ssh up─► bootstrapping ─started─► running ─exit 0─► finishing
      │                 │                      │                       │                 │
      │ no capacity     │ gone                 │ ssh lost / gone       │ preempted /     │ final sync
      ▼                 ▼                      ▼                       │ notice /        ▼
    launch_failed     terminating ◄────────────┴───────────────────────┴─ heartbeat ──► terminating
                        │ confirmed gone (ledger closed)
                        ▼
          succeeded | failed | preempted | aborted
                        ▲
    terminating ─► released ─┘ (revert-local, the provider not answering: the job went home, the instance is
                                still terminated and metered until confirmed gone)

A local attempt:   running ─► succeeded | failed | preempted (stopped for a planned burst) | aborted

A successor (launched at a spot interruption notice, `successor.py`) is a cloud attempt that waits at
`bootstrapping` until the attempt it follows has ended; a spot probe (`spot_probe.py`) one that waits at
`provisioning` until the on-demand attempt it probes for has ended. Neither adds a state or a transition.

A stop burstctl asks of a running attempt (cancel, revert-local, budget, market switch) keeps it `running` while its
trainer writes a last checkpoint (`info.stopping_for`, looked at again each tick for up to 60 s), then goes to
`terminating`; one whose run had already exited 0 goes to `finishing`. Neither adds a state or a transition.

`released` is `terminating` whose job no longer waits for it: after revert-local, its provider does not answer the
terminate, its run stopped (or its instance cannot be reached either) and its newest checkpoint is home
(`core/release.py`). Its job's next step (requeued locally, resuming) is taken as it goes `released`, not again at its
end; it is never synced from again, so nothing of the old instance reaches the job's store once the job has moved.
The daemon goes on terminating its instance, its charge open, until the provider confirms it gone (or the operator
does, for a provider that never will: `burstctl confirm-gone`; both through `gone.confirmed_gone`); until then it
still holds a cloud slot, and no other instance is launched for its job (`core/release.relaunch_held`).

`intent` is written *before* the launch call, with the idempotency key; a daemon that dies right after the call
finds the instance by its tags on restart (no second launch). `terminating` records the outcome to end with, so the
attempt is closed only once the provider confirms the instance is gone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from sqlalchemy import Connection, and_, case, func, insert, select, update

from orchestrator.core.release import OPERATOR
from state import schema as s

CHAOS_ENV = "BURSTCTL_CHAOS_KILL_AT"
CHAOS_POINTS = ("before-launch", "after-launch", "finishing", "terminating")  # a cloud attempt's (tests/test_chaos.py)
LOCAL_CHAOS_POINTS = ("local-stop-written", "local-stop-signalled")  # a local run's stop (tests/test_e2e_hybrid.py)
# A spot notice said, not yet written down; written down, its successor not (tests/test_chaos.py).
NOTICE_CHAOS_POINTS = ("notice-said", "notice-written")


def chaos_point(name: str) -> None:
    """Test-only crash injection (tests/test_chaos.py): the process dies on the spot, like SIGKILL, when
    BURSTCTL_CHAOS_KILL_AT names this point. Inert unless that variable is set."""
    if os.environ.get(CHAOS_ENV) == name:
        os._exit(137)


class AttemptState(StrEnum):
    INTENT = "intent"
    PROVISIONING = "provisioning"
    BOOTSTRAPPING = "bootstrapping"
    RUNNING = "running"
    FINISHING = "finishing"
    TERMINATING = "terminating"
    RELEASED = "released"  # terminating, its job gone home (revert-local with the provider unreachable)
    LAUNCH_FAILED = "launch_failed"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PREEMPTED = "preempted"
    ABORTED = "aborted"

    @property
    def final(self) -> bool:
        return self in FINAL_ATTEMPT_STATES


FINAL_ATTEMPT_STATES = frozenset({AttemptState.LAUNCH_FAILED, AttemptState.SUCCEEDED, AttemptState.FAILED,
                                  AttemptState.PREEMPTED, AttemptState.ABORTED})
ACTIVE_ATTEMPT_STATES = tuple(a.value for a in AttemptState if not a.final)
# Of those, the ones that hold their job (its run is, or may be, there): a released attempt holds only its instance,
# which the daemon still terminates, while its job runs elsewhere.
HOLDING_ATTEMPT_STATES = tuple(a for a in ACTIVE_ATTEMPT_STATES if a != AttemptState.RELEASED.value)

# Outcomes an attempt may end with once its instance is confirmed gone.
OUTCOMES = frozenset({AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.PREEMPTED, AttemptState.ABORTED})

A = AttemptState
TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    A.INTENT: frozenset({A.PROVISIONING, A.LAUNCH_FAILED, A.ABORTED, A.RUNNING, A.FAILED}),  # local: → running
    A.PROVISIONING: frozenset({A.BOOTSTRAPPING, A.TERMINATING}),
    A.BOOTSTRAPPING: frozenset({A.RUNNING, A.TERMINATING}),
    A.RUNNING: frozenset({A.FINISHING, A.TERMINATING, A.SUCCEEDED, A.FAILED, A.PREEMPTED, A.ABORTED}),
    A.FINISHING: frozenset({A.TERMINATING}),
    A.TERMINATING: OUTCOMES | {A.RELEASED},
    A.RELEASED: OUTCOMES,
    A.LAUNCH_FAILED: frozenset(),
    A.SUCCEEDED: frozenset(),
    A.FAILED: frozenset(),
    A.PREEMPTED: frozenset(),
    A.ABORTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def create(conn: Connection, job_id: str, *, where: str, provider: str, instance_type: str, market: str | None,
           info: dict[str, Any], created_at: float, owner: str | None = None) -> dict[str, Any]:
    """A new attempt of the job, at `intent` (every attempt starts there), numbered after its others in the same
    transaction, and its row. `owner`: a cloud attempt's, whose idempotency key and instance tags it makes unique
    to this installation."""
    n = int(conn.execute(select(func.max(s.attempts.c.n)).where(s.attempts.c.job_id == job_id)).scalar() or 0) + 1
    attempt_id = f"{job_id}-a{n}"
    row: dict[str, Any] = {
        "id": attempt_id, "job_id": job_id, "n": n, "where": where, "state": AttemptState.INTENT.value,
        "provider": provider, "instance_type": instance_type, "region": None, "market": market,
        "idempotency_key": f"{owner}-{attempt_id}" if owner else None, "info": info, "created_at": created_at}
    conn.execute(insert(s.attempts).values(**row))
    return {**row, "started_at": None, "instance_id": None}


def move(conn: Connection, attempt: dict[str, Any], target: AttemptState, **fields: Any) -> bool:
    """Move an attempt from its current state to `target` if still there (compare-and-set). Returns False when
    another actor (a CLI command, a previous daemon) moved it first; raises on a transition the machine forbids."""
    current = AttemptState(attempt["state"])
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(f"attempt {attempt['id']}: {current.value} → {target.value} is not a transition")
    values: dict[str, Any] = {"state": target.value, **fields}
    if target.final and "ended_at" not in fields:
        values["ended_at"] = time.time()
    res = conn.execute(update(s.attempts).where(s.attempts.c.id == attempt["id"])
                       .where(s.attempts.c.state == current.value).values(**values))
    if res.rowcount == 1:
        attempt.update(values)
        return True
    return False


def active_attempts(conn: Connection) -> list[dict[str, Any]]:
    q = select(s.attempts).where(s.attempts.c.state.in_(ACTIVE_ATTEMPT_STATES)).order_by(s.attempts.c.created_at)
    return [dict(r) for r in conn.execute(q).mappings()]


# How `list`, `show` and `status` say a running job whose every live attempt is a cloud intent: a launch written
# down that no provider has confirmed (made a moment ago, or its answer lost while the provider does not answer).
# Its state stays `running` (the job state machine's); "running" said of it was not true.
LAUNCHING = "launching"


def launching(conn: Connection, job_ids: Sequence[str] | None = None) -> set[str]:
    """The running jobs (of `job_ids`, else all) whose live attempts are all cloud intents (`LAUNCHING`)."""
    a = s.attempts
    confirmed = func.sum(case((and_(a.c.state == AttemptState.INTENT.value, a.c.where == "cloud"), 0), else_=1))
    q = (select(a.c.job_id).select_from(a.join(s.jobs, s.jobs.c.id == a.c.job_id))
         .where(a.c.state.in_(HOLDING_ATTEMPT_STATES), s.jobs.c.state == "running")
         .group_by(a.c.job_id).having(confirmed == 0))
    if job_ids is not None:
        q = q.where(a.c.job_id.in_(list(job_ids)))
    return {r[0] for r in conn.execute(q)}


def released_instances(conn: Connection, job_ids: Sequence[str] | None = None) -> dict[str, list[str]]:
    """The jobs (of `job_ids`, else all) with a released attempt, each with its instances not yet confirmed gone
    ("sim i-1"): what `core/release.relaunch_held` weighs."""
    q = (select(s.attempts.c.job_id, s.attempts.c.provider, s.attempts.c.instance_id)
         .where(s.attempts.c.state == AttemptState.RELEASED.value).order_by(s.attempts.c.n))
    if job_ids is not None:
        q = q.where(s.attempts.c.job_id.in_(list(job_ids)))
    out: dict[str, list[str]] = {}
    for job_id, provider, instance in conn.execute(q):
        out.setdefault(job_id, []).append(f"{provider} {instance or '(no instance id)'}")
    return out


def states_said(conn: Connection, jobs: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Each job's state as the CLI says it (by id): its own, or `launching` (see `LAUNCHING`)."""
    running = [j["id"] for j in jobs if j["state"] == "running"]
    found = launching(conn, running) if running else set()
    return {j["id"]: LAUNCHING if j["id"] in found else j["state"] for j in jobs}


def confirmed_by_operator(conn: Connection, *, job_ids: Sequence[str] | None = None,
                          since: float | None = None) -> list[dict[str, Any]]:
    """The instances confirmed gone by the operator (`burstctl confirm-gone`), not by their provider: of the jobs
    `job_ids` (by their charges), or gone since `since`; each with its job, attempt and when it went."""
    i, led = s.instances, s.ledger
    q = (select(i.c.provider, i.c.id, i.c.attempt_id, i.c.gone_at, led.c.job_id)
         .select_from(i.outerjoin(led, and_(led.c.provider == i.c.provider, led.c.instance_id == i.c.id)))
         .where(i.c.gone_by == OPERATOR, i.c.verified_gone.is_(True)).distinct().order_by(i.c.gone_at, i.c.id))
    if job_ids is not None:
        q = q.where(led.c.job_id.in_(list(job_ids)))
    if since is not None:
        q = q.where(i.c.gone_at >= since)
    return [{"provider": p, "instance": inst, "attempt": att, "gone_at": gone_at, "job": job}
            for p, inst, att, gone_at, job in conn.execute(q)]
