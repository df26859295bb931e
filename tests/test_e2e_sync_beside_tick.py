"""A checkpoint pull runs beside the tick, on simcloud with real SSH and rsync.

One job writes large checkpoints and its pulls are slowed (`daemon.pull_kib_s`) so that each takes seconds; another
job gets a spot interruption notice while such a pull is under way. The notice must be acted on at once, not after
the large checkpoint is home: an EC2 notice gives two minutes, about what a 20 GB pull takes. And a daemon stopped
while a pull is under way waits for it and writes down what it brought home.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.e2e import Daemon, enqueue, events, pull_under_way, simcloud, trainer_job, wait_for, write_config

SHARD_MIB, PULL_KIB_S = 12, 2048  # each of the large job's checkpoints takes about 6 s to come home


def synced(state: Path, job_id: str, name: str) -> list[dict[str, Any]]:
    return [e for e in events(state, "checkpoint.synced") if e["job_id"] == job_id and name in e["data"]["checkpoints"]]


def test_a_slow_checkpoint_pull_holds_up_no_other_attempt_and_a_stop_writes_it_down(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url, daemon={"tick_s": 0.2, "pull_kib_s": PULL_KIB_S})
        large = enqueue(config, state, trainer_job(tmp_path, "large", steps=400, every=20, step_s=0.5,
                                                   shard_mib=SHARD_MIB, extra=("--keep", "0")))
        small = enqueue(config, state, trainer_job(tmp_path, "small", steps=4000, every=10, step_s=0.1))
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: [e for e in events(state, "checkpoint.synced") if e["job_id"] == small], 120,
                     "the small job to run and sync")
            first = wait_for(lambda: pull_under_way(state, large), 120, "a large checkpoint's pull to begin",
                             interval=0.05)
            (running,) = [e["data"]["instance"] for e in events(state, "attempt.running") if e["job_id"] == small]
            httpx.post(f"{url}/_sim/instances/{running}/notice", json={"seconds": 120},
                       timeout=10).raise_for_status()
            wait_for(lambda: [e for e in events(state, "instance.interruption_notice") if e["job_id"] == small],
                     60, "the small job's notice to be seen", interval=0.05)
            assert pull_under_way(state, large) == first  # seen while the large checkpoint was still on its way
            wait_for(lambda: synced(state, large, first), 60, f"{first} to come home")

            second = wait_for(lambda: (n := pull_under_way(state, large)) != first and n, 120,
                              "the next large checkpoint's pull to begin", interval=0.05)
        finally:
            assert daemon.stop() == 0
        # Stopped while it came home: the daemon waited for it, and it is the job's.
        assert synced(state, large, second)
        assert not pull_under_way(state, large)
        assert (state / "checkpoints" / large / second / "shard.bin").stat().st_size == SHARD_MIB << 20
