"""Crash consistency at moments nobody chose: the daemon is SIGKILLed at seeded random moments over several jobs
on each cloud, then restarted; the invariants of tests/test_chaos.py hold (every job done, nothing left running,
one instance per attempt, ledger = the provider's billing within a tick)."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from tests.e2e import EnvDaemon, cloud, store_sections
from tests.test_chaos import CLOUDS, TICK_S, assert_safe, enqueue, finish

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("kind", "backend"), [*((kind, "sqlite") for kind in CLOUDS), ("simcloud", "postgresql")])
def test_sigkilled_at_seeded_random_moments_over_several_jobs(tmp_path: Path, kind: str, backend: str,
                                                             request: pytest.FixtureRequest) -> None:
    # On PostgreSQL each SIGKILL also drops the daemon's database lock, which the next daemon must find free.
    rng = random.Random(20240917)
    state = tmp_path / "state"
    with cloud(kind, tmp_path) as c:
        config = c.config(tmp_path, daemon={"tick_s": TICK_S}, **store_sections(backend, request))
        job_ids = []
        daemon = EnvDaemon(tmp_path, config, state)
        for trial in range(3):
            job_ids.append(enqueue(tmp_path, config, state, f"random-{trial}", c.gpu))
            for _ in range(2):  # two kills per job, each after a random stretch of work
                daemon.start()
                time.sleep(rng.uniform(0.5, 6.0))
                daemon.kill(signal.SIGKILL)
            finish(daemon, c, state, job_ids[-1:])
        assert_safe(c, state, job_ids)
