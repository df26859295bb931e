"""Checkpoints through S3: multipart concurrent transfers, manifest last, verified atomic downloads (moto)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
import pytest
from boto3.s3.transfer import TransferConfig
from moto import mock_aws

from runbooks import burst_checkpoint
from runbooks.checkpoint_transfer import TransferError
from runbooks.s3_checkpoints import S3CheckpointStore, S3Refused

MiB = 1024 * 1024
BUCKET = "burstctl-ckpt"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(var, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


@pytest.fixture
def store(s3: Any) -> S3CheckpointStore:
    # 5 MiB parts (S3's minimum) so a 12 MiB shard goes up in three concurrent parts.
    config = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=4)
    return S3CheckpointStore(s3, BUCKET, "jobs/job-1/ckpt", transfer_config=config)


def recorded_calls(client: Any) -> list[tuple[str, str]]:
    """(operation, key) of every S3 request the client makes from now on, in order."""
    calls: list[tuple[str, str]] = []

    def record(params: dict[str, Any], model: Any, **_: Any) -> None:
        calls.append((model.name, params.get("Key", "")))

    client.meta.events.register("provide-client-params.s3.*", record)
    return calls


def test_upload_is_multipart_with_the_manifest_last_and_download_round_trips(
        store: S3CheckpointStore, s3: Any, tmp_path: Path) -> None:
    files = {"model.safetensors": os.urandom(12 * MiB), "config.json": b'{"layers": 2}'}
    local = burst_checkpoint.write_checkpoint(tmp_path / "trainer", "step-00000100", files, meta={"step": 100})
    calls = recorded_calls(s3)

    up = store.upload(local)

    prefix = "jobs/job-1/ckpt/step-00000100/"
    assert up.stats.bytes_sent == 12 * MiB + len(b'{"layers": 2}') + (local / "manifest.json").stat().st_size
    assert s3.head_object(Bucket=BUCKET, Key=prefix + "model.safetensors")["ETag"].endswith('-3"')
    assert sum(op == "UploadPart" for op, _ in calls) == 3
    writes = [key for op, key in calls if op in ("PutObject", "CompleteMultipartUpload", "CopyObject")]
    assert writes[-1] == prefix + "manifest.json"  # the checkpoint becomes complete only after every file
    assert store.list_complete() == ["step-00000100"]

    path, stats = store.download("step-00000100", tmp_path / "local")
    assert path == tmp_path / "local" / "step-00000100" and burst_checkpoint.verify(path)
    assert (path / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert stats.bytes_received >= 12 * MiB
    assert os.listdir(tmp_path / "local") == ["step-00000100"]
    assert store.upload(local).already_there


def test_a_checkpoint_without_its_manifest_object_is_not_complete(
        store: S3CheckpointStore, s3: Any, tmp_path: Path) -> None:
    done = burst_checkpoint.write_checkpoint(tmp_path / "trainer", "step-00000100", {"w.bin": b"w" * 1000})
    store.upload(done)
    # An upload interrupted before its manifest: the files are there, the manifest is not.
    s3.put_object(Bucket=BUCKET, Key="jobs/job-1/ckpt/step-00000200/w.bin", Body=b"v" * 1000)
    assert store.list_complete() == ["step-00000100"]
    got = store.pull_new(tmp_path / "local")
    assert got == [tmp_path / "local" / "step-00000100"]
    with pytest.raises(TransferError, match="not complete"):
        store.download("step-00000200", tmp_path / "local")
    assert os.listdir(tmp_path / "local") == ["step-00000100"]


def test_upload_refuses_a_local_checkpoint_that_does_not_match_its_manifest(
        store: S3CheckpointStore, tmp_path: Path) -> None:
    local = burst_checkpoint.write_checkpoint(tmp_path / "trainer", "step-00000100", {"w.bin": b"a" * 100})
    (local / "w.bin").write_bytes(b"b" * 100)
    with pytest.raises(TransferError, match="not a complete checkpoint"):
        store.upload(local)
    assert store.list_complete() == []


def test_incremental_checkpoints_send_only_changed_files_both_ways(
        store: S3CheckpointStore, s3: Any, tmp_path: Path) -> None:
    files = {f"shard-{i}.bin": os.urandom(1 * MiB) for i in range(4)}
    trainer = tmp_path / "trainer"
    store.upload(burst_checkpoint.write_checkpoint(trainer, "step-00000100", files))
    local = tmp_path / "local"
    store.pull_new(local)

    files["shard-2.bin"] = os.urandom(1 * MiB)
    second = burst_checkpoint.write_checkpoint(trainer, "step-00000200", files)
    up = store.upload(second)
    manifest_size = (second / "manifest.json").stat().st_size
    assert up.stats.bytes_sent == 1 * MiB + manifest_size and up.files_copied_in_s3 == 3
    body = s3.get_object(Bucket=BUCKET, Key="jobs/job-1/ckpt/step-00000200/shard-0.bin")["Body"].read()
    assert body == files["shard-0.bin"]  # the server-side copy is the real bytes

    got = store.pull_new(local)
    assert got == [local / "step-00000200"] and burst_checkpoint.verify(got[0])
    assert got.stats.bytes_received == 1 * MiB + manifest_size
    assert (local / "step-00000200" / "shard-0.bin").stat().st_ino == \
        (local / "step-00000100" / "shard-0.bin").stat().st_ino


def test_a_corrupted_object_fails_verification_and_nothing_becomes_visible(
        store: S3CheckpointStore, s3: Any, tmp_path: Path) -> None:
    store.upload(burst_checkpoint.write_checkpoint(tmp_path / "trainer", "step-00000100", {"w.bin": b"a" * 4096}))
    s3.put_object(Bucket=BUCKET, Key="jobs/job-1/ckpt/step-00000100/w.bin", Body=b"A" * 4096)
    local = tmp_path / "local"
    with pytest.raises(TransferError, match="failed verification"):
        store.download("step-00000100", local)
    assert os.listdir(local) == []
    got = store.pull_new(local)
    assert got == [] and list(got.rejected) == ["step-00000100"]
    assert os.listdir(local) == []


def test_a_newest_checkpoint_that_fails_verification_does_not_keep_the_one_before_it_from_coming_home(
        store: S3CheckpointStore, s3: Any, tmp_path: Path) -> None:
    # The daemon pulls the newest only: when that one was rejected, nothing came home, sync after sync.
    for step, byte in ((100, b"a"), (200, b"b")):
        store.upload(burst_checkpoint.write_checkpoint(tmp_path / "trainer", f"step-{step:08d}", {"w.bin": byte * 64}))
    s3.put_object(Bucket=BUCKET, Key="jobs/job-1/ckpt/step-00000200/w.bin", Body=b"B" * 64)
    local = tmp_path / "local"
    got = store.pull_new(local, newest_only=True)
    assert [p.name for p in got] == ["step-00000100"] and list(got.rejected) == ["step-00000200"]
    again = store.pull_new(local, newest_only=True)  # the next sync: home already, nothing downloaded
    assert list(again) == [] and list(again.rejected) == ["step-00000200"]


def test_a_checkpoint_rejected_once_is_not_downloaded_again_until_it_is_written_again(
        store: S3CheckpointStore, s3: Any, tmp_path: Path) -> None:
    # A corrupt newest checkpoint stays in S3: every later sync downloaded it again before finding it wanting again.
    for step, byte in ((100, b"a"), (200, b"b")):
        store.upload(burst_checkpoint.write_checkpoint(tmp_path / "trainer", f"step-{step:08d}",
                                                       {"w.bin": byte * (1 * MiB)}))
    s3.put_object(Bucket=BUCKET, Key="jobs/job-1/ckpt/step-00000200/w.bin", Body=b"B" * MiB)
    local = tmp_path / "local"
    first = store.pull_new(local, newest_only=True)
    assert [p.name for p in first] == ["step-00000100"] and list(first.rejected) == ["step-00000200"]
    known = set(first.rejected_manifests.items())

    calls = recorded_calls(s3)
    again = store.pull_new(local, newest_only=True, rejected_before=known)
    assert [key for op, key in calls if op == "GetObject"] == ["jobs/job-1/ckpt/step-00000200/manifest.json"]
    assert list(again) == [] and again.rejected == {} and again.passed_over == ["step-00000200"]

    # Written again under its name: S3 holds another manifest for it, and it comes home.
    s3.delete_object(Bucket=BUCKET, Key="jobs/job-1/ckpt/step-00000200/manifest.json")
    store.upload(burst_checkpoint.write_checkpoint(tmp_path / "trainer", "step-00000200", {"w.bin": b"c" * 64}))
    rewritten = store.pull_new(local, newest_only=True, rejected_before=known)
    assert [p.name for p in rewritten] == ["step-00000200"] and rewritten.passed_over == []
    assert (local / "step-00000200" / "w.bin").read_bytes() == b"c" * 64


def test_prune_keeps_the_newest_and_deletes_each_manifest_first(
        store: S3CheckpointStore, s3: Any, tmp_path: Path) -> None:
    for step in (100, 200, 300):
        store.upload(burst_checkpoint.write_checkpoint(tmp_path / "trainer", f"step-{step:08d}", {"w.bin": b"w"}))
    calls = recorded_calls(s3)
    assert store.prune(keep=1) == ["step-00000100", "step-00000200"]
    assert store.list_complete() == ["step-00000300"]
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix="jobs/job-1/ckpt/step-00000100/")["KeyCount"] == 0
    deletes = [(op, key) for op, key in calls if op.startswith("Delete")]
    assert deletes[0] == ("DeleteObject", "jobs/job-1/ckpt/step-00000100/manifest.json")


def test_what_is_home_supersedes_is_dropped_and_anything_newer_is_kept(
        store: S3CheckpointStore, tmp_path: Path) -> None:
    trainer = tmp_path / "trainer"
    for step in (100, 200, 300):
        store.upload(burst_checkpoint.write_checkpoint(trainer, f"step-{step:08d}", {"w.bin": b"w"}))
    home = tmp_path / "home"
    assert store.drop_superseded(home) == []  # nothing home yet: nothing may go
    store.download("step-00000200", home)
    assert store.drop_superseded(home) == ["step-00000100", "step-00000200"]
    assert store.list_complete() == ["step-00000300"]  # newer than anything home: still needed


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.data


def answered_by_s3_with(client: Any, code: str, status: int = 403) -> None:
    """From now on, every request of `client` is answered by S3 with this error, as S3 answers it (its XML)."""
    from botocore.awsrequest import AWSResponse

    body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>no</Message></Error>'.encode()

    def answer(request: Any, **_: Any) -> AWSResponse:
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Body(body))

    client.meta.events.register_first("before-send.s3.*", answer)


@pytest.mark.parametrize("code", ["InvalidAccessKeyId", "ExpiredToken", "SignatureDoesNotMatch", "AccessDenied"])
def test_s3_refusing_the_credentials_is_a_refusal_not_a_failed_transfer(
        store: S3CheckpointStore, s3: Any, tmp_path: Path, code: str) -> None:
    # A key rotated or an SSO session expired mid-run: the daemon can then reach the checkpoints another way (the
    # instance, over SSH), which a failed transfer would not tell it.
    store.upload(burst_checkpoint.write_checkpoint(tmp_path / "trainer", "step-00000100", {"w.bin": b"w" * 100}))
    answered_by_s3_with(s3, code)
    for call in (lambda: store.pull_new(tmp_path / "home"), lambda: store.download("step-00000100", tmp_path / "home"),
                 lambda: store.prune(keep=0)):
        with pytest.raises(S3Refused, match=rf": {code}$"):
            call()
    assert not (tmp_path / "home").exists() or os.listdir(tmp_path / "home") == []


def test_a_store_that_fails_otherwise_is_not_taken_for_a_refusal(
        store: S3CheckpointStore, s3: Any, tmp_path: Path) -> None:
    answered_by_s3_with(s3, "NoSuchBucket", status=404)
    with pytest.raises(TransferError, match=r": NoSuchBucket$") as raised:
        store.list_complete()
    assert not isinstance(raised.value, S3Refused)


def test_no_credentials_at_all_is_a_refusal_that_says_so(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    anonymous = boto3.Session().client("s3", region_name="us-east-1")
    with pytest.raises(S3Refused, match="Unable to locate credentials"):
        S3CheckpointStore(anonymous, BUCKET, "jobs/job-1/ckpt").list_complete()


def test_a_credential_program_s_own_words_are_not_repeated(s3: Any) -> None:
    # A credential_process that fails says whatever it prints, which may hold a token: only the error's kind is said.
    def fail(**_: Any) -> None:
        raise botocore.exceptions.CredentialRetrievalError(provider="custom-process", error_msg="token=s3cr3t-v4lue")

    s3.meta.events.register_first("before-sign.s3.*", fail)
    with pytest.raises(S3Refused) as raised:
        S3CheckpointStore(s3, BUCKET, "jobs/job-1/ckpt").list_complete()
    assert str(raised.value).endswith(": CredentialRetrievalError") and "s3cr3t" not in str(raised.value)


# --- the instance side: the supervisor uploads, a separate process (boto3 over HTTP, as on an instance) ---------
REPO = Path(__file__).resolve().parents[1]
SUPERVISOR = REPO / "runbooks" / "supervisor.py"
TRAINER = REPO / "examples" / "trainer.py"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def instance_env(endpoint: str) -> dict[str, str]:
    """What an instance's sessions have: an S3 endpoint and credentials from the environment's chain."""
    return {"PATH": os.environ["PATH"], "AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "instance-role",
            "AWS_SECRET_ACCESS_KEY": "instance-role-secret", "AWS_DEFAULT_REGION": "us-east-1",
            "PYTHONPATH": str(REPO / "runbooks")}


def supervise(tmp_path: Path, endpoint: str, uri: str, *trainer_args: str) -> tuple[dict, Path]:
    ckpt = tmp_path / "ckpt"
    argv = [sys.executable, str(SUPERVISOR), "--run-dir", str(tmp_path / "run"), "--job-id", "job-1",
            "--attempt", "1", "--checkpoint-dir", str(ckpt), "--workdir", str(tmp_path), "--heartbeat-s", "0.2",
            "--s3-uri", uri, "--s3-region", "us-east-1", "--",
            sys.executable, str(TRAINER), "--out", str(tmp_path / "result.json"), *trainer_args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=instance_env(endpoint))
    assert proc.returncode == 0, proc.stderr
    exit_record = json.loads((tmp_path / "run" / "exit.json").read_text())
    return exit_record, ckpt


def test_the_supervisor_uploads_the_last_checkpoint_before_it_reports_the_exit(
        s3_server: str, tmp_path: Path) -> None:
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="x",
                          aws_secret_access_key="x")
    client.create_bucket(Bucket="ckpt-up")

    record, ckpt = supervise(tmp_path, s3_server, "s3://ckpt-up/burstctl/job-1", "--steps", "200",
                             "--checkpoint-every", "50", "--step-seconds", "0.01")

    last = record["last_checkpoint"]
    assert last == "step-00000200" and record["s3"]["uploaded"] == last and record["s3"]["error"] is None
    store = S3CheckpointStore(client, "ckpt-up", "burstctl/job-1")
    assert store.list_complete()[-1] == last
    home, _ = store.download(last, tmp_path / "home")
    assert burst_checkpoint.read_manifest(home) == burst_checkpoint.read_manifest(ckpt / last)
    status = subprocess.run([sys.executable, str(SUPERVISOR), "status", "--run-dir", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=60)
    assert json.loads(status.stdout)["s3"]["uploaded"] == last


def test_an_upload_that_fails_is_recorded_and_the_exit_is_still_reported(s3_server: str, tmp_path: Path) -> None:
    record, ckpt = supervise(tmp_path, s3_server, "s3://no-such-bucket/burstctl/job-1", "--steps", "60",
                             "--checkpoint-every", "30")

    assert record["reason"] == "completed" and record["last_checkpoint"] == "step-00000060"
    assert record["s3"]["uploaded"] is None and record["s3"]["failures"] >= 1
    assert "NoSuchBucket" in record["s3"]["error"]
    assert "instance-role-secret" not in (tmp_path / "run" / "supervisor.log").read_text()
    assert burst_checkpoint.verify(ckpt / "step-00000060")
