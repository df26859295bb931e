"""Checkpoints in S3: the EC2 alternative to pulling every checkpoint home over SSH.

The instance uploads each new complete checkpoint into the job's prefix in-region (the supervisor runs
`upload-newest` after every checkpoint and once more when the trainer exits, before it reports the exit), so a
reclaimed instance's last checkpoint survives however slow the way home is. The daemon downloads from S3 into the
local store, and the next instance downloads its resume point in-region (`download`).

Layout: `s3://BUCKET/PREFIX/<name>/<relpath>` for each file and `.../<name>/manifest.json`, the manifest being
uploaded last: a checkpoint is complete in S3 exactly when its manifest object exists. Files go up and down as
concurrent multipart transfers (`boto3.s3.transfer.TransferConfig`). Files a checkpoint shares with the newest
complete one already in S3 (same size and sha256 in both manifests) are copied server-side, not re-uploaded;
downloads hard-link such files from the newest local checkpoint. A download lands in a hidden staging dir,
is verified against the manifest (sizes + sha256), fsynced, and renamed into place, so nothing partial is ever
visible locally. Credentials come from boto3's own chain (on an instance: its role, through the metadata
service), never from here; `AWS_ENDPOINT_URL_S3` points it at an S3-compatible endpoint.

CLI, on an instance with boto3 (every verb prints one JSON line; exit 1 with {"error": ...} on failure):
    python3 s3_checkpoints.py upload-newest --uri s3://BUCKET/PREFIX --dir CKPT [--region R]
    python3 s3_checkpoints.py download --uri s3://BUCKET/PREFIX --name NAME --dir CKPT [--region R]
"""

from __future__ import annotations

import errno
import json
import shutil
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
import botocore.exceptions
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config as BotoConfig

if TYPE_CHECKING or __package__:  # the daemon: `runbooks.s3_checkpoints` (and mypy, which checks the package)
    from . import burst_checkpoint
    from .checkpoint_transfer import (
        STAGING_PREFIX,
        PulledCheckpoints,
        TransferError,
        TransferStats,
        make_visible,
        manifest_digest,
        safe_relpath,
        stage_from_basis,
        to_pull,
        verify_and_fsync,
    )
else:  # an instance: beside burst_checkpoint.py and checkpoint_transfer.py on PYTHONPATH
    import burst_checkpoint
    from checkpoint_transfer import (
        STAGING_PREFIX,
        PulledCheckpoints,
        TransferError,
        TransferStats,
        make_visible,
        manifest_digest,
        safe_relpath,
        stage_from_basis,
        to_pull,
        verify_and_fsync,
    )

MANIFEST = burst_checkpoint.MANIFEST

# S3's answers that refuse the caller's credentials rather than fail the transfer, and botocore's own errors for
# credentials that are missing or cannot be refreshed (an SSO session that expired mid-run): `S3Refused`.
REFUSED_CODES = frozenset({"AccessDenied", "AccountProblem", "AllAccessDisabled", "ExpiredToken",
                           "ExpiredTokenException", "InvalidAccessKeyId", "InvalidClientTokenId", "InvalidToken",
                           "SignatureDoesNotMatch", "TokenRefreshRequired"})
CREDENTIAL_ERRORS = (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError,
                     botocore.exceptions.CredentialRetrievalError, botocore.exceptions.TokenRetrievalError,
                     botocore.exceptions.SSOError, botocore.exceptions.NoAuthTokenError)
_S3_ERRORS = (botocore.exceptions.ClientError, *CREDENTIAL_ERRORS)
_FIXED_TEXTS = (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError,
                botocore.exceptions.UnauthorizedSSOTokenError, botocore.exceptions.NoAuthTokenError)

MiB = 1024 * 1024
DEFAULT_TRANSFER_CONFIG = TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB,
                                         max_concurrency=8, use_threads=True)


class S3Refused(TransferError):
    """S3 refused this process's credentials, or it has none: nothing was transferred. The checkpoints may well be
    there; another way to them (the instance, over SSH) or the key mended is what it takes."""


def _failed(what: str, exc: Exception) -> TransferError:
    """`what` failed with `exc`: S3Refused for a refusal of the credentials, else TransferError. Only AWS's error code
    is kept, or botocore's own text of a credential error: neither echoes a request or a secret."""
    if isinstance(exc, botocore.exceptions.ClientError):
        code = _code(exc)
        return (S3Refused if code in REFUSED_CODES else TransferError)(f"{what}: {code}")
    # botocore's own text where it is fixed ("Unable to locate credentials", "The SSO session ... has expired ...");
    # otherwise only its class: a failed credential_process's message is whatever that program printed.
    said = str(exc) if isinstance(exc, _FIXED_TEXTS) else type(exc).__name__
    return S3Refused(f"{what}: {said}")


@dataclass
class S3Upload:
    name: str
    key_prefix: str  # PREFIX/<name>/
    stats: TransferStats  # bytes_sent: bytes uploaded; bytes copied server-side are not moved by us
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

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def region(self) -> str:
        return str(self.client.meta.region_name or "us-east-1")

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
        except _S3_ERRORS as e:
            raise _failed(f"listing s3://{self.bucket}/{base}", e) from None
        return sorted(names)

    def read_manifest(self, name: str) -> dict[str, Any]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))["Body"].read()
        except _S3_ERRORS as e:
            raise _failed(f"reading s3://{self.bucket}/{self._key(name, MANIFEST)}", e) from None
        manifest = json.loads(body)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise TransferError(f"s3://{self.bucket}/{self._key(name, MANIFEST)} is not a checkpoint manifest")
        return manifest

    # --- upload ---------------------------------------------------------------------------------------------
    def upload(self, local_ckpt: str | Path) -> S3Upload:
        """Upload one complete local checkpoint; its manifest goes last. Refuses an incomplete or corrupt one."""
        local = Path(local_ckpt)
        name = local.name
        started = time.monotonic()
        if not burst_checkpoint.verify(local):
            raise TransferError(f"{local} is not a complete checkpoint (manifest missing or a file does not match it)")
        stats = TransferStats("s3")
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
                    key = self._key(name, safe_relpath(rel))
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
        except _S3_ERRORS as e:
            raise _failed(f"uploading checkpoint {name} to s3://{self.bucket}/{self._key(name)}", e) from None
        stats.bytes_sent += len(manifest_bytes)
        stats.seconds = time.monotonic() - started
        return S3Upload(name, self._key(name), stats, files_copied_in_s3=copied)

    # --- download -------------------------------------------------------------------------------------------
    def download(self, name: str, local_ckpt_dir: str | Path, *,
                 manifest_bytes: bytes | None = None) -> tuple[Path, TransferStats]:
        """Fetch complete checkpoint `name` into local_ckpt_dir/name, verified, atomically. TransferError if the
        data does not match its manifest (nothing is made visible) or the local disk is full. `manifest_bytes`: its
        manifest, already read by the caller."""
        root = Path(local_ckpt_dir)
        root.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        stats = TransferStats("s3")
        if manifest_bytes is None:
            manifest_bytes = self._get_manifest_bytes(name)
        try:
            files: dict[str, Any] = json.loads(manifest_bytes)["files"]
        except (ValueError, KeyError, TypeError):
            raise TransferError(f"checkpoint {name} in s3://{self.bucket} failed verification: its manifest is "
                            "malformed; nothing was made visible") from None
        basis = burst_checkpoint.latest_complete(root, deep=False)
        staging = root / f"{STAGING_PREFIX}{name}"
        shutil.rmtree(staging, ignore_errors=True)  # S3 downloads do not resume: start clean
        staging.mkdir()
        try:
            with create_transfer_manager(self.client, self.config) as manager:
                futures = []
                for rel in stage_from_basis(files, staging, basis):  # hard-links what the basis holds
                    dest = staging / safe_relpath(rel)
                    futures.append(manager.download(self.bucket, self._key(name, rel), str(dest)))
                    stats.bytes_received += int(files[rel]["size"])
                    stats.files_transferred += 1
                for future in futures:
                    future.result()
            (staging / MANIFEST).write_bytes(manifest_bytes)
            problem = verify_and_fsync(staging, basis)
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            if e.errno == errno.ENOSPC:
                raise TransferError(f"local disk full while downloading checkpoint {name} into {root}; "
                                "nothing was made visible") from None
            raise TransferError(f"downloading checkpoint {name} into {root}: {e.strerror or e}") from None
        except _S3_ERRORS as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise _failed(f"downloading checkpoint {name} from s3://{self.bucket}", e) from None
        if problem is not None:
            shutil.rmtree(staging, ignore_errors=True)
            raise TransferError(f"checkpoint {name} from s3://{self.bucket}/{self._key(name)} failed verification: "
                            f"{problem}; nothing was made visible")
        final_path = make_visible(staging, root / name)
        stats.bytes_received += len(manifest_bytes)
        stats.seconds = time.monotonic() - started
        return final_path, stats

    def pull_new(self, local_ckpt_dir: str | Path, *, newest_only: bool = False,
                 rejected_before: Collection[tuple[str, str]] = ()) -> PulledCheckpoints:
        """Download every complete S3 checkpoint not complete locally (oldest first), like `sync.pull_checkpoints`;
        with `newest_only`, just the newest that verifies (older ones are superseded; one that fails verification
        does not keep the one before it from coming home). One whose (name, `manifest_digest`) is in
        `rejected_before` (an earlier pull's `.rejected_manifests`) is passed over with only its manifest read."""
        root = Path(local_ckpt_dir)
        started = time.monotonic()
        total = TransferStats("s3")
        pulled: list[Path] = []
        rejected: dict[str, str] = {}
        rejected_manifests: dict[str, str] = {}
        passed_over: list[str] = []
        names = self.list_complete()
        for name in to_pull(names, root, newest_only):
            manifest_bytes = self._get_manifest_bytes(name)
            digest = manifest_digest(manifest_bytes)
            if (name, digest) in rejected_before:
                total.bytes_received += len(manifest_bytes)
                passed_over.append(name)
                continue
            try:
                path, stats = self.download(name, root, manifest_bytes=manifest_bytes)
            except TransferError as e:
                if "failed verification" not in str(e):
                    raise
                rejected[name] = str(e)
                rejected_manifests[name] = digest  # always fetched whole: S3 downloads start from a clean staging
                continue
            total.add(stats)
            pulled.append(path)
        total.seconds = time.monotonic() - started
        return PulledCheckpoints(pulled, total, rejected, rejected_manifests=rejected_manifests,
                                 passed_over=passed_over)

    def upload_newest(self, local_ckpt_dir: str | Path) -> S3Upload | None:
        """Upload the newest complete local checkpoint unless S3 has it (None when there is none locally)."""
        newest = burst_checkpoint.latest_complete(local_ckpt_dir)
        return self.upload(newest) if newest is not None else None

    def prune(self, keep: int) -> list[str]:
        """Delete all but the newest `keep` complete checkpoints. Each manifest goes first, so a checkpoint being
        deleted is never mistaken for a complete one. Returns the names deleted."""
        doomed = self.list_complete()[:-keep] if keep > 0 else self.list_complete()
        for name in doomed:
            self._delete_prefix(name, manifest_first=True)
        return doomed

    def drop_superseded(self, local_ckpt_dir: str | Path) -> list[str]:
        """Delete every checkpoint no newer than the newest complete one at `local_ckpt_dir` (home): nothing will
        resume from those, and multi-GB copies cost money every month. Returns the names deleted."""
        home = burst_checkpoint.latest_complete(local_ckpt_dir, deep=False)
        if home is None:
            return []
        doomed = [name for name in self.list_complete() if name <= home.name]
        for name in doomed:
            self._delete_prefix(name, manifest_first=True)
        return doomed

    def _delete_prefix(self, name: str, *, manifest_first: bool) -> None:
        try:
            if manifest_first:
                self.client.delete_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(name)):
                keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
                if keys:
                    self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
        except _S3_ERRORS as e:
            raise _failed(f"deleting s3://{self.bucket}/{self._key(name)}", e) from None

    def _get_manifest_bytes(self, name: str) -> bytes:
        try:
            body: bytes = self.client.get_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))["Body"].read()
        except _S3_ERRORS as e:
            if not isinstance(e, botocore.exceptions.ClientError) or _code(e) in REFUSED_CODES:
                raise _failed(f"reading s3://{self.bucket}/{self._key(name, MANIFEST)}", e) from None
            raise TransferError(f"checkpoint {name} is not complete in s3://{self.bucket}/{self._key(name)} "
                                f"(no manifest: {_code(e)})") from None
        return body


def _code(exc: botocore.exceptions.ClientError) -> str:
    """The AWS error code only: messages can echo request details."""
    return str(exc.response.get("Error", {}).get("Code", "unknown error"))


def parse_uri(uri: str) -> tuple[str, str]:
    """`s3://BUCKET/PREFIX` → (bucket, prefix); ValueError for anything else."""
    rest = uri.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if rest == uri or not bucket:
        raise ValueError(f"{uri!r} is not an s3://BUCKET/PREFIX address")
    return bucket, prefix.strip("/")


def make_client(region: str | None = None, endpoint_url: str | None = None, session: Any = None) -> Any:
    """An S3 client with boto3's credential chain and bounded standard retries. endpoint_url=None lets botocore
    apply AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL itself."""
    config = BotoConfig(region_name=region, retries={"total_max_attempts": 5, "mode": "standard"},
                    connect_timeout=10, read_timeout=120)
    return (session or boto3.Session()).client("s3", endpoint_url=endpoint_url or None, config=config)


def store_for(uri: str, *, region: str | None = None, endpoint_url: str | None = None,
              session: Any = None) -> S3CheckpointStore:
    bucket, prefix = parse_uri(uri)
    return S3CheckpointStore(make_client(region, endpoint_url, session), bucket, prefix)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="s3_checkpoints.py", description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    up = verbs.add_parser("upload-newest", help="upload the newest complete local checkpoint unless S3 has it")
    down = verbs.add_parser("download", help="download one complete checkpoint, verified, atomically")
    down.add_argument("--name", required=True)
    for verb in (up, down):
        verb.add_argument("--uri", required=True, help="s3://BUCKET/PREFIX of the job's checkpoints")
        verb.add_argument("--dir", required=True, help="the local checkpoint dir")
        verb.add_argument("--region", default=None)
    args = parser.parse_args(argv)
    try:
        store = store_for(args.uri, region=args.region)
        if args.verb == "upload-newest":
            done = store.upload_newest(args.dir)
            out: dict[str, Any] = {"uploaded": None} if done is None else {
                "uploaded": done.name, "already_there": done.already_there, "bytes": done.stats.bytes_sent,
                "seconds": round(done.stats.seconds, 3)}
        else:
            path, stats = store.download(args.name, args.dir)
            out = {"downloaded": path.name, "path": str(path), "bytes": stats.bytes_received,
                   "seconds": round(stats.seconds, 3)}
    except (TransferError, ValueError, OSError, botocore.exceptions.BotoCoreError) as e:
        # One line; botocore's own texts name what is missing (e.g. "Unable to locate credentials"), no secrets.
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps(out))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
