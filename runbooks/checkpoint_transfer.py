"""What moving a complete checkpoint needs on either end, whatever carries it (rsync, SFTP, S3).

A checkpoint being fetched lands in a hidden staging dir `CKPT/.incoming-<name>` on the same filesystem, is
verified against its manifest (sizes + sha256), fsynced, and only then renamed into place: nothing partial is
ever visible. Files a new checkpoint shares with an older local one are hard-linked, never fetched again (safe,
because a complete checkpoint is never modified in place).

Stdlib-only. It is copied to instances beside `s3_checkpoints.py` and imported by the daemon's `sync`.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

if __package__:  # the daemon: `runbooks.checkpoint_transfer`
    from .burst_checkpoint import MANIFEST, fsync_dir, read_manifest, verify
else:  # an instance: beside burst_checkpoint.py on PYTHONPATH
    from burst_checkpoint import MANIFEST, fsync_dir, read_manifest, verify  # type: ignore[no-redef]

STAGING_PREFIX = ".incoming-"  # hidden: burst_checkpoint never lists it, and its prune never deletes it
RSYNC_PARTIAL_DIR = ".rsync-partial"


class TransferError(Exception):
    """A transfer did not complete (refused, failed, local disk full, ...). Nothing partial was made visible."""


@dataclass
class TransferStats:
    """What one transfer cost: the daemon stores these as measured overhead."""

    transport: str  # "rsync", "sftp" or "s3"
    bytes_sent: int = 0  # rsync: wire bytes incl. protocol; sftp and s3: file payload bytes
    bytes_received: int = 0
    files_transferred: int = 0
    seconds: float = 0.0

    @property
    def bytes_moved(self) -> int:
        return self.bytes_sent + self.bytes_received

    def add(self, other: TransferStats) -> None:
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.files_transferred += other.files_transferred


class PulledCheckpoints(list):  # list[Path]
    """The new complete local checkpoints (oldest first), plus what the pull cost and what it refused."""

    def __init__(self, paths: Iterable[Path], stats: TransferStats, rejected: dict[str, str]) -> None:
        super().__init__(paths)
        self.stats = stats
        self.rejected = rejected  # checkpoint name → why it was not made visible (e.g. a sha256 mismatch)


def safe_relpath(rel: str) -> str:
    """A manifest entry as a relative path inside its checkpoint; TransferError for anything that escapes it."""
    parts = PurePosixPath(rel).parts
    if not rel or rel.startswith("/") or ".." in parts or rel == MANIFEST:
        raise TransferError(f"the manifest lists {rel!r}, which is not a relative path inside the checkpoint")
    return PurePosixPath(rel).as_posix()


def link_or_copy(src: Path, dest: Path) -> bool:
    """Hard-link src to dest (copy across filesystems); False if src is missing."""
    if dest.exists():
        dest.unlink()
    try:
        os.link(src, dest)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copy2(src, dest)
    return True


def verify_and_fsync(staging: Path) -> str | None:
    """None when staging is a complete checkpoint, now durable on disk; else why it is not."""
    shutil.rmtree(staging / RSYNC_PARTIAL_DIR, ignore_errors=True)
    if not verify(staging):
        try:
            read_manifest(staging)
        except (OSError, ValueError):
            return "its manifest is missing or malformed"
        return "a file's size or sha256 differs from the manifest"
    for path in staging.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for directory in [staging, *(p for p in staging.rglob("*") if p.is_dir() and not p.is_symlink())]:
        fsync_dir(directory)
    return None


def make_visible(staging: Path, final: Path) -> Path:
    """Rename a verified staging dir into place (replacing an incomplete leftover) and make the rename durable."""
    if final.exists():
        shutil.rmtree(final)  # a leftover without a verified manifest is not a checkpoint
    os.rename(staging, final)
    fsync_dir(final.parent)
    return final
