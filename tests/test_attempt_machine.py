"""The attempt state machine: its transitions are listed once and enforced with compare-and-set."""

from __future__ import annotations

import pytest
from sqlalchemy import insert

from orchestrator.lifecycle.machine import (
    FINAL_ATTEMPT_STATES,
    TRANSITIONS,
    AttemptState,
    IllegalTransition,
    active_attempts,
    move,
)
from state import schema as s
from state.store import Store

A = AttemptState


@pytest.fixture
def store(db_url: str) -> Store:
    st = Store(db_url)  # on SQLite and on PostgreSQL
    st.insert_job({"id": "j1", "name": "x", "kind": "train", "state": "running", "verdict": "burst",
                   "placement": "cloud", "spec": {}, "decision": {}, "deadline_at": 0.0})
    with st.tx() as c:
        c.execute(insert(s.attempts).values(id="j1-a1", job_id="j1", n=1, where="cloud", state="intent", info={},
                                            created_at=0.0))
    return st


def attempt(store: Store) -> dict:
    with store.tx() as c:
        return next(a for a in active_attempts(c) if a["id"] == "j1-a1")


def test_a_cloud_attempt_walks_the_happy_path(store: Store) -> None:
    att = attempt(store)
    for target in [A.PROVISIONING, A.BOOTSTRAPPING, A.RUNNING, A.FINISHING, A.TERMINATING, A.SUCCEEDED]:
        with store.tx() as c:
            assert move(c, att, target)  # move() keeps the caller's copy in step with the database
    with store.tx() as c:
        assert active_attempts(c) == []
    assert att["ended_at"] is not None


def test_forbidden_transitions_raise(store: Store) -> None:
    with store.tx() as c, pytest.raises(IllegalTransition):
        move(c, attempt(store), A.SUCCEEDED)  # an instance is never closed without terminating it first


def test_a_stale_actor_loses_the_compare_and_set(store: Store) -> None:
    stale = attempt(store)
    with store.tx() as c:
        assert move(c, attempt(store), A.PROVISIONING)
    with store.tx() as c:
        assert not move(c, stale, A.LAUNCH_FAILED)


def test_final_states_have_no_way_out_and_every_state_is_listed() -> None:
    assert set(TRANSITIONS) == set(AttemptState)
    for st in FINAL_ATTEMPT_STATES:
        assert TRANSITIONS[st] == frozenset()
    # every outcome is reached only through terminating, except launch failures and local ends
    assert A.SUCCEEDED in TRANSITIONS[A.TERMINATING]
