"""End to end on the simulated EC2 with S3 checkpoints (`providers.ec2.checkpoint_bucket`): the instance uploads
its checkpoints in-region with its role's credentials (served by its metadata service), the daemon downloads them
home from S3, and the attempt that resumes after a spot interruption downloads its starting point in-region
instead of having it pushed over SSH. An instance that cannot upload falls back to SSH and the job still ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from runbooks import burst_checkpoint
from runbooks.s3_checkpoints import S3CheckpointStore
from tests.e2e import AWS_TEST_SECRET, Daemon, cli, events, job, sim_ec2, trainer_job, wait_for
from tests.test_e2e_burst import EVERY, STEP_S, STEPS, uninterrupted_final_state
from tests.test_e2e_ec2 import interrupted_spot_burst

pytestmark = pytest.mark.slow


def test_checkpoints_go_through_s3_and_the_resumed_attempt_downloads_in_region(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with sim_ec2(tmp_path) as ec2:
        s3_settings = ec2.sim.setup_checkpoint_bucket()
        job_id, first = interrupted_spot_burst(ec2, tmp_path, ec2.config(tmp_path, provider=s3_settings), state)
        s3 = boto3.client("s3", endpoint_url=s3_settings["s3_endpoint_url"], region_name="us-east-1")
        in_s3 = S3CheckpointStore(s3, s3_settings["checkpoint_bucket"], f"burstctl/{job_id}").list_complete()
        instances = ec2.instances()

    # Every checkpoint came home from S3, none over SSH, and no instance failed to upload.
    synced_via = {e["data"]["via"] for e in events(state, "checkpoint.synced")}
    assert synced_via == {"s3"}
    assert not events(state, "checkpoint.s3_unavailable")
    # The resumed attempt fetched its starting point in-region; the first had nothing to fetch.
    timings = [e["data"]["timings"] for e in events(state, "attempt.running")]
    assert len(timings) == 2
    assert "s3_download_checkpoint" in timings[1] and "push_checkpoint" not in timings[1]
    resumed = events(state, "job.resumed")[0]["data"]
    assert resumed["instance"] != first and resumed["checkpoint"].startswith("step-")

    final_name = f"step-{STEPS:08d}"
    assert (state / "checkpoints" / job_id / final_name / "state.json").read_bytes() == \
        uninterrupted_final_state(tmp_path)
    assert burst_checkpoint.verify(state / "checkpoints" / job_id / final_name)
    # The final checkpoint is home: every S3 copy it supersedes is deleted (they would be paid for every month).
    assert in_s3 == []
    released = events(state, "checkpoint.s3_released")
    assert released and released[-1]["data"]["checkpoints"][-1] == final_name
    assert len(instances) == 2 and all(i["status"] == "terminated" and not i["machine"] for i in instances)
    trail = (state / "events.jsonl").read_text()
    assert AWS_TEST_SECRET not in trail and "simulated-role-secret" not in trail


def test_an_instance_that_cannot_upload_falls_back_to_ssh_and_the_job_finishes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with sim_ec2(tmp_path) as ec2:
        s3_settings = ec2.sim.setup_checkpoint_bucket()
        # No instance profile: the instances have no credentials, so their uploads fail.
        config = ec2.config(tmp_path, provider={k: v for k, v in s3_settings.items() if k != "instance_profile"})
        spec = trainer_job(tmp_path, "trainer", steps=60, every=EVERY, step_s=STEP_S, gpu=ec2.gpu)
        r = cli(config, state, "enqueue", str(spec), "--json")
        assert r.returncode == 0, r.stderr
        job_id = json.loads(r.stdout)["id"]
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: job(state, job_id)["state"] == "done", 240, "the job to finish")
        finally:
            assert daemon.stop() == 0

    unavailable = events(state, "checkpoint.s3_unavailable")
    assert len(unavailable) == 1 and unavailable[0]["data"]["fallback"] == "ssh"
    assert "credentials" in unavailable[0]["data"]["error"].lower()
    assert {e["data"]["via"] for e in events(state, "checkpoint.synced")} <= {"rsync", "sftp"}
    assert burst_checkpoint.verify(state / "checkpoints" / job_id / "step-00000060")
