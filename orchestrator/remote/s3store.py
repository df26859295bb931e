"""Checkpoints in S3 (the EC2 alternative to pulling over SSH).

Layout: `s3://BUCKET/PREFIX/<name>/<relpath>` for each file and `.../<name>/manifest.json`, the manifest being
uploaded last: a checkpoint is complete in S3 exactly when its manifest object exists. Files go up and down as
concurrent multipart transfers (`boto3.s3.transfer.TransferConfig`). Files a checkpoint shares with the newest
complete one already in S3 (same size and sha256 in both manifests) are copied server-side, not re-uploaded;
downloads hard-link such files from the newest local checkpoint. A download lands in a hidden staging dir,
is verified against the manifest (sizes + sha256), fsynced, and renamed into place, so nothing partial is ever
visible locally. The caller builds the boto3 client (credentials come from the environment, never from here).
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import botocore.exceptions
from boto3.s3.transfer import TransferConfig, create_transfer_manager

from orchestrator.remote.sync import (
    MANIFEST,
    STAGING_PREFIX,
    PulledCheckpoints,
    SyncError,
    SyncStats,
    _fsync_dir,
    _link_or_copy,
    _safe_relpath,
    _verify_and_sync,
)
from runbooks import burst_checkpoint

MiB = 1024 * 1024
DEFAULT_TRANSFER_CONFIG = TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB,
                                         max_concurrency=8, use_threads=True)


@dataclass
class S3Upload:
    name: str
    key_prefix: str  # PREFIX/<name>/
    stats: SyncStats  # bytes_sent: bytes uploaded; bytes copied server-side are not moved by us
    files_copied_in_s3: int = 0
    already_there: bool = False


class S3CheckpointStore:
    """Complete-only checkpoints under one S3 prefix."""

    def __init__(self, client: Any, bucket: str, prefix: str, *,
                 transfer_config: TransferConfig | None = None) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.config = transfer_config or DEFAULT_TRANSFER_CONFIG

    def _key(self, name: str, rel: str = "") -> str:
        return f"{self.prefix}/{name}/{rel}" if self.prefix else f"{name}/{rel}"

    # --- listing --------------------------------------------------------------------------------------------
    def list_complete(self) -> list[str]:
        """Names with a manifest object, oldest first."""
        names: set[str] = set()
        base = self._key("")[:-1]  # "PREFIX/" (or "")
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base):
                for obj in page.get("Contents", []):
                    rest = obj["Key"][len(base):]
                    name, _, tail = rest.partition("/")
                    if tail == MANIFEST and not name.startswith("."):
                        names.add(name)
        except botocore.exceptions.ClientError as e:
            raise SyncError(f"listing s3://{self.bucket}/{base}: {_code(e)}") from None
        return sorted(names)

    def read_manifest(self, name: str) -> dict[str, Any]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))["Body"].read()
        except botocore.exceptions.ClientError as e:
            raise SyncError(f"reading s3://{self.bucket}/{self._key(name, MANIFEST)}: {_code(e)}") from None
        manifest = json.loads(body)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise SyncError(f"s3://{self.bucket}/{self._key(name, MANIFEST)} is not a checkpoint manifest")
        return manifest

    # --- upload ---------------------------------------------------------------------------------------------
    def upload(self, local_ckpt: str | Path) -> S3Upload:
        """Upload one complete local checkpoint; its manifest goes last. Refuses an incomplete or corrupt one."""
        local = Path(local_ckpt)
        name = local.name
        started = time.monotonic()
        if not burst_checkpoint.verify(local):
            raise SyncError(f"{local} is not a complete checkpoint (manifest missing or a file does not match it)")
        stats = SyncStats("s3")
        complete = self.list_complete()
        if name in complete:
            return S3Upload(name, self._key(name), stats, already_there=True)
        manifest_bytes = (local / MANIFEST).read_bytes()
        files: dict[str, Any] = json.loads(manifest_bytes)["files"]
        basis = [n for n in complete if n < name] or complete
        basis_files: dict[str, Any] = self.read_manifest(basis[-1])["files"] if basis else {}
        copied = 0
        try:
            with create_transfer_manager(self.client, self.config) as manager:
                futures = []
                for rel in sorted(files):
                    key = self._key(name, _safe_relpath(rel))
                    if basis_files.get(rel) == files[rel]:
                        source = {"Bucket": self.bucket, "Key": self._key(basis[-1], rel)}
                        futures.append(manager.copy(source, self.bucket, key))
                        copied += 1
                    else:
                        futures.append(manager.upload(str(local / rel), self.bucket, key))
                        stats.bytes_sent += int(files[rel]["size"])
                        stats.files_transferred += 1
                for future in futures:
                    future.result()
            # Only now does the checkpoint exist for readers.
            self.client.put_object(Bucket=self.bucket, Key=self._key(name, MANIFEST), Body=manifest_bytes,
                                   ContentType="application/json")
        except botocore.exceptions.ClientError as e:
            raise SyncError(f"uploading checkpoint {name} to s3://{self.bucket}/{self._key(name)}: "
                            f"{_code(e)}") from None
        stats.bytes_sent += len(manifest_bytes)
        stats.seconds = time.monotonic() - started
        return S3Upload(name, self._key(name), stats, files_copied_in_s3=copied)

    # --- download -------------------------------------------------------------------------------------------
    def download(self, name: str, local_ckpt_dir: str | Path) -> tuple[Path, SyncStats]:
        """Fetch complete checkpoint `name` into local_ckpt_dir/name, verified, atomically. SyncError if the
        data does not match its manifest (nothing is made visible) or the local disk is full."""
        root = Path(local_ckpt_dir)
        root.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        stats = SyncStats("s3")
        manifest_bytes = self._get_manifest_bytes(name)
        try:
            files: dict[str, Any] = json.loads(manifest_bytes)["files"]
        except (ValueError, KeyError, TypeError):
            raise SyncError(f"checkpoint {name} in s3://{self.bucket} failed verification: its manifest is "
                            "malformed; nothing was made visible") from None
        basis = burst_checkpoint.latest_complete(root, deep=False)
        basis_files: dict[str, Any] = {}
        if basis is not None:
            with contextlib.suppress(OSError, ValueError):
                basis_files = burst_checkpoint.read_manifest(basis)["files"]
        staging = root / f"{STAGING_PREFIX}{name}"
        shutil.rmtree(staging, ignore_errors=True)  # S3 downloads do not resume: start clean
        staging.mkdir()
        try:
            with create_transfer_manager(self.client, self.config) as manager:
                futures = []
                for rel in sorted(files):
                    dest = staging / _safe_relpath(rel)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    if basis is not None and basis_files.get(rel) == files[rel] and _link_or_copy(basis / rel, dest):
                        continue
                    futures.append(manager.download(self.bucket, self._key(name, rel), str(dest)))
                    stats.bytes_received += int(files[rel]["size"])
                    stats.files_transferred += 1
                for future in futures:
                    future.result()
            (staging / MANIFEST).write_bytes(manifest_bytes)
            problem = _verify_and_sync(staging)
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            if e.errno == errno.ENOSPC:
                raise SyncError(f"local disk full while downloading checkpoint {name} into {root}; "
                                "nothing was made visible") from None
            raise SyncError(f"downloading checkpoint {name} into {root}: {e.strerror or e}") from None
        except botocore.exceptions.ClientError as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise SyncError(f"downloading checkpoint {name} from s3://{self.bucket}: {_code(e)}") from None
        if problem is not None:
            shutil.rmtree(staging, ignore_errors=True)
            raise SyncError(f"checkpoint {name} from s3://{self.bucket}/{self._key(name)} failed verification: "
                            f"{problem}; nothing was made visible")
        final = root / name
        if final.exists():
            shutil.rmtree(final)  # a leftover without a verified manifest is not a checkpoint
        final_path = staging.rename(final)
        _fsync_dir(root)
        stats.bytes_received += len(manifest_bytes)
        stats.seconds = time.monotonic() - started
        return final_path, stats

    def pull_new(self, local_ckpt_dir: str | Path) -> PulledCheckpoints:
        """Download every complete S3 checkpoint not complete locally (oldest first), like `sync.pull_checkpoints`."""
        root = Path(local_ckpt_dir)
        started = time.monotonic()
        total = SyncStats("s3")
        pulled: list[Path] = []
        rejected: dict[str, str] = {}
        for name in self.list_complete():
            if burst_checkpoint.verify(root / name, deep=False):
                continue
            try:
                path, stats = self.download(name, root)
            except SyncError as e:
                if "failed verification" not in str(e):
                    raise
                rejected[name] = str(e)
                continue
            total.add(stats)
            pulled.append(path)
        total.seconds = time.monotonic() - started
        return PulledCheckpoints(pulled, total, rejected)

    def _get_manifest_bytes(self, name: str) -> bytes:
        try:
            body: bytes = self.client.get_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))["Body"].read()
        except botocore.exceptions.ClientError as e:
            raise SyncError(f"checkpoint {name} is not complete in s3://{self.bucket}/{self._key(name)} "
                            f"(no manifest: {_code(e)})") from None
        return body


def _code(exc: botocore.exceptions.ClientError) -> str:
    """The AWS error code only: messages can echo request details."""
    return str(exc.response.get("Error", {}).get("Code", "unknown error"))
