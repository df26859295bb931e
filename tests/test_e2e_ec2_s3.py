"""End to end on the simulated EC2 with S3 checkpoints (`providers.ec2.checkpoint_bucket`): the instance uploads
its checkpoints in-region with its role's credentials (served by its metadata service), the daemon downloads them
home from S3, and the attempt that resumes after a spot interruption downloads its starting point in-region
instead of having it pushed over SSH. An instance that cannot upload falls back to SSH and the job still ends.
"""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest

from runbooks import burst_checkpoint
from runbooks.s3_checkpoints import S3CheckpointStore
from tests.e2e import AWS_ENV, AWS_TEST_SECRET, Daemon, enqueue, events, job, sim_ec2, trainer_job, wait_for
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
        job_id = enqueue(config, state, spec)
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


def test_a_key_s3_refuses_mid_run_brings_the_checkpoints_home_over_ssh_until_s3_takes_it_again(tmp_path: Path) -> None:
    # The daemon's credentials stop working mid-run (an SSO session's last hour, a key rotated), while the instance's
    # role goes on uploading. Before, no checkpoint came home until the key was mended, though every one of them was
    # on the instance too: a reclaim meanwhile would have found the newest home an hour old, and revert-local none.
    state = tmp_path / "state"
    key = AWS_ENV["AWS_ACCESS_KEY_ID"]
    with sim_ec2(tmp_path) as ec2:
        s3_settings = ec2.sim.setup_checkpoint_bucket()
        config = ec2.config(tmp_path, provider=s3_settings)
        spec = trainer_job(tmp_path, "trainer", steps=400, every=EVERY, step_s=STEP_S, gpu=ec2.gpu)
        job_id = enqueue(config, state, spec)
        daemon = Daemon(tmp_path, config, state).start()
        try:
            wait_for(lambda: [e for e in events(state, "checkpoint.synced") if e["data"]["via"] == "s3"], 180,
                     "a checkpoint home from S3")
            ec2.sim.refuse_key(key)
            refused = wait_for(lambda: events(state, "checkpoint.s3_refused"), 60, "S3's refusal to be said")[0]
            over_ssh = wait_for(lambda: [e for e in events(state, "checkpoint.synced")
                                         if e["ts"] > refused["ts"] and e["data"]["via"] != "s3"], 60,
                                "a checkpoint home over SSH while S3 refuses the key")
            ec2.sim.refuse_key(None)
            answers = wait_for(lambda: events(state, "checkpoint.s3_answers"), 60, "S3 to take the key again")[0]
            wait_for(lambda: job(state, job_id)["state"] in ("done", "failed"), 180, "the job to end")
        finally:
            assert daemon.stop() == 0

    assert job(state, job_id)["state"] == "done"
    assert refused["data"]["fallback"] == "ssh" and refused["data"]["error"].endswith(": InvalidAccessKeyId")
    assert over_ssh[0]["data"]["via"] in ("rsync", "sftp")
    # Said once each, though every sync in between met the refusal; and the checkpoints came through S3 again after.
    assert len(events(state, "checkpoint.s3_refused")) == len(events(state, "checkpoint.s3_answers")) == 1
    assert [e for e in events(state, "checkpoint.synced") if e["ts"] >= answers["ts"] and e["data"]["via"] == "s3"]
    assert not events(state, "checkpoint.sync_failed")
    assert burst_checkpoint.verify(state / "checkpoints" / job_id / "step-00000400")
    trail = (state / "events.jsonl").read_text()
    assert AWS_TEST_SECRET not in trail and "simulated-role-secret" not in trail
