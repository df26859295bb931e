"""End to end on EC2: the daemon, a separate process, drives boto3 against moto's EC2 server, whose instances are
real SSH machines on 127.x private addresses (`providers/simcloud/ec2_sim.py`). A spot instance gets the
interruption notice through its metadata service and is reclaimed; the job resumes on a new instance from its
newest checkpoint, finishes bit-identical to an uninterrupted run, nothing is left running, and the ledger agrees
with the simulated EC2's billing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e import (
    AWS_TEST_SECRET,
    P3_SPOT,
    Daemon,
    Ec2View,
    cli,
    events,
    job,
    ledger,
    preempt,
    sim_ec2,
    trainer_job,
    wait_for,
)
from tests.test_e2e_burst import EVERY, STEP_S, STEPS, running_instance, synced, uninterrupted_final_state

pytestmark = pytest.mark.slow
NOTICE_S = 8.0  # AWS gives 120 s; a few ticks, a status call and a pull are all burstctl needs


def interrupted_spot_burst(ec2: Ec2View, tmp: Path, config: Path, state: Path) -> tuple[str, str]:
    """The trainer bursts to spot; once a checkpoint came home, its instance gets the interruption notice and is
    reclaimed; the daemon runs until the job is done. Returns (job id, the interrupted instance)."""
    spec = trainer_job(tmp, "trainer", steps=STEPS, every=EVERY, step_s=STEP_S, gpu=ec2.gpu)
    r = cli(config, state, "enqueue", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["id"]
    daemon = Daemon(tmp, config, state).start()
    try:
        first = wait_for(lambda: running_instance(state), 90, "the first attempt to run on EC2")
        wait_for(lambda: synced(state), 60, "a first checkpoint to come home")
        # AWS's two-minute warning, shortened: the notice through the metadata service, then the reclaim.
        preempt(ec2.admin_url, first, notice_s=NOTICE_S)
        wait_for(lambda: events(state, "job.resumed"), 120, "the job to resume on another instance")
        wait_for(lambda: job(state, job_id)["state"] == "done", 180, "the job to finish")
    finally:
        assert daemon.stop() == 0
    return job_id, first


def test_ec2_spot_burst_is_interrupted_resumes_on_a_new_instance_and_finishes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with sim_ec2(tmp_path) as ec2:
        job_id, first = interrupted_spot_burst(ec2, tmp_path, ec2.config(tmp_path), state)
        instances = ec2.instances()
        billing = ec2.billing()

    intents = [e["data"] for e in events(state, "attempt.intent")]
    assert intents[0]["market"] == "spot" and intents[0]["rate_usd_h"] == P3_SPOT
    # The trainer saw the notice through the instance's metadata service and wrote a last checkpoint, which came
    # home before the reclaim: the resumed attempt starts from it.
    pre = events(state, "instance.preempted")[0]["data"]
    assert pre["instance"] == first and pre["reason"] == "spot interruption notice"
    resumed = events(state, "job.resumed")[0]["data"]
    assert resumed["instance"] != first and resumed["checkpoint"].startswith("step-")

    final = state / "checkpoints" / job_id / f"step-{STEPS:08d}" / "state.json"
    assert final.read_bytes() == uninterrupted_final_state(tmp_path)

    # Nothing is left: every instance moto knows is terminated and its machine is gone.
    assert len(instances) == 2 and all(i["status"] == "terminated" and not i["machine"] for i in instances)
    # The meter agrees with EC2's billing (per second, 60 s minimum) within one tick, at the attempt's rate.
    billed = {b["instance_id"]: b for b in billing}
    rows = ledger(state)
    assert {r["instance_id"] for r in rows} == set(billed)
    for row in rows:
        assert abs(row["billed_seconds"] - billed[row["instance_id"]]["billed_s"]) <= 1.5, (row, billed)
        assert row["rate_usd_h"] == pytest.approx(billed[row["instance_id"]]["rate_usd_h"])
        assert row["cost_usd"] == pytest.approx(row["billed_seconds"] * row["rate_usd_h"] / 3600, abs=1e-6)
    assert AWS_TEST_SECRET not in (state / "events.jsonl").read_text()
