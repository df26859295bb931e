"""A checkpoint that fails verification on its way home is rejected once, not fetched again at every later sync.

It stays where it is (on the instance, or in S3) and an older one comes home in its place. Each later sync, every few
minutes, had downloaded its GBs again before finding it wanting again. The daemon writes down, with the attempt, the
digest of the manifest it was rejected with: while the manifest there is the same, only the manifest is read; once
the trainer writes it again under its name (another manifest), it is fetched again. Driven through the daemon's
syncs (`AttemptSyncs.transfers`, then `write_down`, the attempt's info persisted as the tick persists it), against a
real SSH instance (simcloud) and S3 (moto), and across a daemon restart (a new App on the same state).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws
from sqlalchemy import insert, select, update

from orchestrator.app import App
from orchestrator.config import Ec2Provider
from orchestrator.lifecycle import checkpoints
from orchestrator.lifecycle.cloud_steps import CloudSteps
from orchestrator.lifecycle.reconcile import Reconciler
from orchestrator.queue import enqueue
from providers.ec2 import Ec2Adapter
from providers.simcloud.ssh_backend import SshBackend
from runbooks.burst_checkpoint import write_checkpoint
from runbooks.checkpoint_transfer import PulledCheckpoints
from runbooks.s3_checkpoints import S3CheckpointStore
from state import schema as s
from tests.conftest import write_job

MiB = 1024 * 1024
PAYLOAD = 4 * MiB  # the torn checkpoint's files: what a sync must not fetch again
BUCKET = "burstctl-ckpt"


class Daemon:
    """The daemon's reconciler on a state dir; a new one over the same dir is a restarted daemon."""

    def __init__(self, state: Path, providers: dict[str, Any]) -> None:
        self.app = App(state_dir_override=str(state))
        self.cloud = CloudSteps(self.app, providers)
        self.rec = Reconciler(self.app, providers, cloud=self.cloud)

    def sync(self, attempt_id: str) -> PulledCheckpoints:
        """One periodic sync of the running attempt: its transfers, then what they did written down and the
        attempt's info stored, as the tick does (`AttemptSyncs.collect`). What the checkpoint pull did."""
        with self.app.store.engine.connect() as c:
            att = dict(c.execute(select(s.attempts).where(s.attempts.c.id == attempt_id)).mappings().one())
        job = self.app.store.get_job(att["job_id"])
        assert job is not None
        info = dict(att["info"])
        done = self.rec.syncs.transfers({**att, "info": dict(info)}, job, None, logs=False)
        assert done.error is None and done.pulled is not None, done.error
        assert self.rec.syncs.write_down(att, job, info, done)
        self.app.store.set_attempt_info(attempt_id, info)
        return done.pulled

    def close(self) -> None:
        self.rec.close()
        self.app.close()


def running_attempt(app: App, tmp_path: Path, provider: str, instance: dict[str, Any],
                    info: dict[str, Any]) -> tuple[str, str]:
    """A cloud job running on its first attempt, on `instance` (a row of the instances table): (job id, attempt)."""
    job_id, _, _ = enqueue(app, write_job(tmp_path, "torn", local_throughput=0))
    att_id = f"{job_id}-a1"
    with app.store.tx() as c:
        c.execute(insert(s.instances).values(provider=provider, attempt_id=att_id, state="running", **instance))
        c.execute(insert(s.attempts).values(id=att_id, job_id=job_id, n=1, where="cloud", state="running",
                                            provider=provider, instance_id=instance["id"], instance_type="gpu",
                                            info=info, created_at=0.0, started_at=0.0))
        c.execute(update(s.jobs).where(s.jobs.c.id == job_id).values(state="running"))
    return job_id, att_id


def rejected_said(app: App, job_id: str) -> list[str]:
    return [e["data"]["checkpoint"] for e in app.store.events(job_id=job_id, type_prefix="checkpoint.rejected")]


def test_a_checkpoint_rejected_on_its_way_from_the_instance_is_not_fetched_again_until_written_again(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    daemon = Daemon(state, {})
    backend = SshBackend(tmp_path / "simcloud")
    try:
        ep = backend.start("i-torn", daemon.cloud.public_key)
        job_id, att_id = running_attempt(
            daemon.app, tmp_path, "sim", {"id": "i-torn", "host": ep.host, "port": ep.port, "host_key": ep.host_key},
            {"host": ep.host, "port": ep.port, "user": ep.user, "remote_base": "burst", "remote_run": "burst/run"})
        assert ep.sandbox is not None
        on_instance = Path(ep.sandbox) / "burst" / job_id / "checkpoints"
        write_checkpoint(on_instance, "step-00000100", {"w.bin": b"a" * 1000})
        torn = write_checkpoint(on_instance, "step-00000200", {"w.bin": os.urandom(PAYLOAD)})
        os.truncate(torn / "w.bin", PAYLOAD // 2)  # torn after its manifest was written

        first = daemon.sync(att_id)
        assert [p.name for p in first] == ["step-00000100"] and list(first.rejected) == ["step-00000200"]
        assert first.stats.bytes_received >= PAYLOAD // 2  # fetched once: that is how it was found torn

        second = daemon.sync(att_id)
        assert second.stats.bytes_received < 64 * 1024 and second.stats.files_transferred == 0  # its manifest only
        assert list(second) == [] and second.passed_over == ["step-00000200"]
        daemon.close()

        daemon = Daemon(state, {})  # restarted: it knows the rejection from the attempt as stored
        after_restart = daemon.sync(att_id)
        assert after_restart.stats.bytes_received < 64 * 1024 and after_restart.passed_over == ["step-00000200"]
        assert rejected_said(daemon.app, job_id) == ["step-00000200"]  # said once, as before

        write_checkpoint(on_instance, "step-00000200", {"w.bin": b"b" * 1000})  # written again, whole this time
        rewritten = daemon.sync(att_id)
        assert [p.name for p in rewritten] == ["step-00000200"]
        assert daemon.app.store.get_job(job_id)["checkpoint"] == "step-00000200"
        assert rejected_said(daemon.app, job_id) == ["step-00000200"]
    finally:
        daemon.close()
        backend.close()


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(var, "testing")
    for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


def recorded_gets(client: Any) -> list[str]:
    """The key of every GetObject the client makes from now on."""
    keys: list[str] = []

    def record(params: dict[str, Any], model: Any, **_: Any) -> None:
        if model.name == "GetObject":
            keys.append(params.get("Key", ""))

    client.meta.events.register("provide-client-params.s3.GetObject", record)
    return keys


def test_a_checkpoint_rejected_on_its_way_from_s3_is_not_downloaded_again_until_written_again(
        tmp_path: Path, aws: Any) -> None:
    state = tmp_path / "state"

    def ec2() -> Ec2Adapter:
        return Ec2Adapter(Ec2Provider(enabled=True, region="us-east-1", checkpoint_bucket=BUCKET),
                          orchestrator_id="burstctl-test")

    daemon = Daemon(state, {"ec2": ec2()})
    try:
        job_id, att_id = running_attempt(daemon.app, tmp_path, "ec2", {"id": "i-0torn"},
                                         {"remote_base": "burst", "remote_run": "burst/run"})
        in_s3 = S3CheckpointStore(aws, BUCKET, f"burstctl/{job_id}")
        trainer = tmp_path / "trainer"
        in_s3.upload(write_checkpoint(trainer, "step-00000100", {"w.bin": b"a" * 1000}))
        in_s3.upload(write_checkpoint(trainer, "step-00000200", {"w.bin": os.urandom(PAYLOAD)}))
        torn = f"burstctl/{job_id}/step-00000200/w.bin"
        aws.put_object(Bucket=BUCKET, Key=torn, Body=b"t" * PAYLOAD)  # rotted in S3 after it went up

        first = daemon.sync(att_id)
        assert [p.name for p in first] == ["step-00000100"] and list(first.rejected) == ["step-00000200"]

        daemon_s3 = daemon.cloud.s3_store({"provider": "ec2", "info": {}}, {"id": job_id})
        assert daemon_s3 is not None
        gets = recorded_gets(daemon_s3.client)  # the daemon's own client
        second = daemon.sync(att_id)
        assert gets == [f"burstctl/{job_id}/step-00000200/manifest.json"]  # its manifest, not its files
        assert list(second) == [] and second.passed_over == ["step-00000200"]
        daemon.close()

        daemon = Daemon(state, {"ec2": ec2()})  # restarted
        daemon_s3 = daemon.cloud.s3_store({"provider": "ec2", "info": {}}, {"id": job_id})
        assert daemon_s3 is not None
        gets = recorded_gets(daemon_s3.client)
        after_restart = daemon.sync(att_id)
        assert gets == [f"burstctl/{job_id}/step-00000200/manifest.json"]
        assert after_restart.passed_over == ["step-00000200"]

        # Written again under its name (S3's copy replaced, manifest last): another manifest, so it comes home.
        aws.delete_object(Bucket=BUCKET, Key=f"burstctl/{job_id}/step-00000200/manifest.json")
        in_s3.upload(write_checkpoint(trainer, "step-00000200", {"w.bin": b"b" * 1000}))
        rewritten = daemon.sync(att_id)
        assert [p.name for p in rewritten] == ["step-00000200"]
        assert (checkpoints.store_dir(daemon.app.config, job_id) / "step-00000200" / "w.bin").read_bytes() == \
            b"b" * 1000
        assert rejected_said(daemon.app, job_id) == ["step-00000200"]
    finally:
        daemon.close()
