"""A checkpoint pull runs beside the tick, on simcloud with real SSH and rsync.

One job writes large checkpoints and its pulls are slowed (`daemon.pull_kib_s`) so that each takes seconds; another
job gets a spot interruption notice while such a pull is under way. The notice must be acted on at once, not after
the large checkpoint is home: an EC2 notice gives two minutes, about what a 20 GB pull takes. And a daemon stopped
while a pull is under way waits for it and writes down what it brought home. A checkpoint the trainer writes after
the notice's pull began, reclaimed with its instance before it could come home, is said lost (`checkpoint.lost`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from runbooks.burst_checkpoint import MANIFEST
from state import schema as s
from state.store import Store
from tests.e2e import (
    Daemon,
    cli,
    enqueue,
    events,
    pull_under_way,
    simcloud,
    store_url,
    trainer_job,
    wait_for,
    write_config,
)

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



@pytest.mark.slow
@pytest.mark.parametrize("reclaimed", ["before it comes home", "after it came home"])
def test_a_checkpoint_written_after_the_notices_pull_began_comes_home_or_is_said_lost(
        tmp_path: Path, reclaimed: str) -> None:
    # A checkpoint every 2 s whose pull takes 8 s: a pull is under way when the notice comes, and the trainer's last
    # checkpoint (written on the notice's SIGTERM) is written after it began. While the notice's time allows, the
    # daemon pulls again once that pull is over, and the last checkpoint comes home: the job resumes from it. When
    # the instance is reclaimed before then, it never comes home and the job resumes from an older one. That is the
    # cloud's doing; not saying so is ours: the daemon saw it on the instance (the supervisor's heartbeat and exit),
    # and the user must be told which checkpoint was thrown away and which one the job goes back to.
    state = tmp_path / "state"
    with simcloud(tmp_path) as url:
        config = write_config(tmp_path, url, daemon={"tick_s": 0.2, "pull_kib_s": 512})
        job_id = enqueue(config, state, trainer_job(tmp_path, "lost", steps=400, every=20, step_s=0.1, shard_mib=4,
                                                    interval_minutes=0.05, extra=("--keep", "0")))
        daemon = Daemon(tmp_path, config, state).start()
        try:
            (home,) = wait_for(lambda: [e["data"]["checkpoints"][-1] for e in events(state, "checkpoint.synced")
                                        if e["job_id"] == job_id][:1], 120, "a first checkpoint to come home")
            under_way = wait_for(lambda: (n := pull_under_way(state, job_id)) != home and n, 60,
                                 "the next checkpoint's pull to begin", interval=0.05)
            (first,) = [e["data"]["instance"] for e in events(state, "attempt.running") if e["job_id"] == job_id]
            httpx.post(f"{url}/_sim/instances/{first}/notice", json={"seconds": 120}, timeout=10).raise_for_status()
            sandbox = tmp_path / "sim" / "instances" / first / "sandbox"
            wait_for(lambda: any(sandbox.rglob("exit.json")), 30, "the trainer's last checkpoint and exit")
            newest = sorted(p.parent.name for p in sandbox.rglob(f"checkpoints/step-*/{MANIFEST}"))[-1]
            # The daemon has read the supervisor's last word (its last checkpoint). A second's sleep had not been
            # enough on a loaded machine: the loss then named the checkpoint before the last.
            wait_for(lambda: _attempt_info(state, f"{job_id}-a1").get("instance_checkpoint") == newest, 30,
                     "the daemon to hear of the last checkpoint", interval=0.05)
            assert pull_under_way(state, job_id) == under_way < newest  # the last checkpoint came after it began
            if reclaimed == "before it comes home":
                httpx.post(f"{url}/_sim/instances/{first}/preempt", json={}, timeout=10).raise_for_status()
            resumed = wait_for(lambda: [e["data"] for e in events(state, "job.resumed") if e["job_id"] == job_id],
                               120, "the job to resume elsewhere")[0]
            show = cli(config, state, "show", job_id).stdout
            logs = cli(config, state, "logs", job_id, "--attempt", "1")
        finally:
            assert daemon.stop() == 0
    lost = [e for e in events(state, "checkpoint.lost") if e["job_id"] == job_id]
    resuming = next(e for e in events(state, "job.resuming") if e["job_id"] == job_id)["data"]
    if reclaimed == "after it came home":
        assert resumed["checkpoint"] == newest  # pulled again after the pull under way: nothing lost, nothing said
        assert not lost and "checkpoint_lost" not in resuming
        assert "lost:" not in show and "was lost" not in logs.stderr
        return
    assert resumed["checkpoint"] < newest  # the cloud took it: the job goes back to an older one
    assert lost, f"{newest} was thrown away with its instance and no event says so"
    (said,) = lost
    assert said["attempt_id"] == f"{job_id}-a1"
    assert said["data"]["checkpoint"] == newest and said["data"]["resumes_from"] == resumed["checkpoint"]
    assert said["data"]["instance"] == first
    # Lost to the reclaim: seen by the provider (preempted), or first by the trainer's exit on the notice once its last
    # sync ended, cut off by that same reclaim. Which of the two a tick meets first is a race this test cannot order.
    assert said["data"]["reason"].startswith(tuple(f"{newest} did not come home before the instance was lost ({by}"
                                                   for by in ("provider ", "spot interruption notice)"))), said
    types = [e["type"] for e in events(state) if e["job_id"] == job_id]
    assert types.index("instance.preempted") < types.index("checkpoint.lost") < types.index("job.resumed")
    assert resuming["checkpoint_lost"] == newest and f"its checkpoint {newest} was lost" in resuming["reason"]
    assert f"lost: attempt 1's checkpoint {newest} did not come home before its instance was lost; the job went " \
           f"back to {resumed['checkpoint']}" in show
    assert f"its checkpoint {newest} was lost with its instance, the job went back to {resumed['checkpoint']}" \
           in logs.stderr
    assert '"event": "checkpoint.lost"' in (state / "events.jsonl").read_text()  # the structured log says it too


def _attempt_info(state: Path, attempt_id: str) -> dict[str, Any]:
    store = Store(store_url(state))
    try:
        with store.engine.connect() as c:
            info = c.execute(select(s.attempts.c.info).where(s.attempts.c.id == attempt_id)).scalar()
        return dict(info or {})
    finally:
        store.close()
