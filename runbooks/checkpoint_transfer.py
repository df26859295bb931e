"""What moving a complete checkpoint needs on either end, whatever carries it (rsync, SFTP, S3).

A checkpoint being fetched lands in a hidden staging dir `CKPT/.incoming-<name>` on the same filesystem, is
verified against its manifest (sizes + sha256), fsynced, and only then renamed into place: nothing partial is
ever visible. Files a new checkpoint shares with an older local one are hard-linked, never fetched again (safe,
because a complete checkpoint is never modified in place).

Stdlib-only. It is copied to instances beside `s3_checkpoints.py` and imported by the daemon's `sync`, which also runs
it on an instance when pushing a checkpoint there (the instance's own checkpoints are the basis then):

    python3 checkpoint_transfer.py stage STAGING BASIS|- < MANIFEST   -> {"todo": [files to send], "delta": bool}
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:  # the daemon: `runbooks.checkpoint_transfer` (and mypy, which checks the package)
    from . import burst_checkpoint
    from .burst_checkpoint import MANIFEST, fsync_dir, read_manifest
else:  # an instance: beside burst_checkpoint.py on PYTHONPATH
    import burst_checkpoint
    from burst_checkpoint import MANIFEST, fsync_dir, read_manifest

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

    def __init__(self, paths: Iterable[Path], stats: TransferStats, rejected: dict[str, str], *,
                 rejected_manifests: Mapping[str, str] | None = None, passed_over: Iterable[str] = ()) -> None:
        super().__init__(paths)
        self.stats = stats
        self.rejected = rejected  # checkpoint name → why it was not made visible (e.g. a sha256 mismatch)
        # Of those, each fetched whole → its `manifest_digest`: what to pass as `rejected_before` to later pulls. One
        # rejected after resuming from what an earlier pull left in staging is not here: the leftover may be to blame.
        self.rejected_manifests = dict(rejected_manifests or {})
        self.passed_over = list(passed_over)  # in `rejected_before` with the manifest they have now: not fetched


def manifest_digest(manifest_bytes: bytes) -> str:
    """What tells a checkpoint rejected once from one written again under its name: the sha256 of its manifest's
    bytes. The manifest lists every file's size and sha256 and the time it was written, so a checkpoint written
    again has another; a few KB read, where its files are GBs."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def to_pull(names: Iterable[str], root: Path, newest_only: bool) -> Iterator[str]:
    """The complete checkpoints `names` (oldest first) that a pull into `root` brings home, in the order to try them:
    each one not complete there, oldest first. With `newest_only`, newest first, until one is complete there or has
    just been made so (anything older is superseded): one that failed verification on its way (a file torn or rotted
    after its manifest was written), or that the caller passes over as rejected before, does not keep the one before
    it from coming home. Only verified checkpoints are ever renamed into place, so sizes suffice to tell one home."""
    if not newest_only:
        yield from (name for name in names if not burst_checkpoint.verify(root / name, deep=False))
        return
    for name in reversed(list(names)):
        if burst_checkpoint.verify(root / name, deep=False):
            return  # home already
        yield name
        if burst_checkpoint.verify(root / name, deep=False):
            return  # the caller brought it home


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


def basis_files(basis: Path | None) -> dict[str, Any]:
    """The `files` table of the basis's manifest ({} without a basis or with an unreadable manifest)."""
    if basis is None:
        return {}
    try:
        files = read_manifest(basis)["files"]
    except (OSError, ValueError):
        return {}
    return files if isinstance(files, dict) else {}


def held_by_basis(files: Mapping[str, Any], basis: Path | None) -> set[str]:
    """The entries of `files` (a manifest's table) that the basis's manifest lists with the same size and sha256."""
    shared = basis_files(basis)
    return {rel for rel, entry in files.items() if shared.get(rel) == entry}


def delta_basis(files: Mapping[str, Any], basis: Path | None) -> Path | None:
    """The basis, as a basis for delta transfer of the files it does not hold; None when it holds none of them.

    A checkpoint that shares no file with the basis by content is a full fine-tune's: every shard is fresh weights
    and optimizer state, in which a delta against the old ones finds nothing, while reading the basis for it costs
    a full read of it (benchmarks/checkpoint_reads.py). One that shares some (frozen layers, say) may also share
    blocks within a changed file, and there the delta saves what crosses the wire."""
    return basis if held_by_basis(files, basis) else None


def stage_from_basis(files: Mapping[str, Any], staging: Path, basis: Path | None) -> list[str]:
    """Prepare `staging` for the checkpoint whose manifest lists `files`; return what is still to fetch, sorted.

    Every file the basis (a complete checkpoint beside staging: for a pull, the newest local one) lists with the same
    size and sha256 is hard-linked into staging, never fetched nor read. A file already in staging with its listed
    size was left there whole by an earlier, interrupted transfer (rsync renames a file into place only once it is
    whole; SFTP appends) and is not fetched again; the final verification reads it. Whatever else staging holds (a
    stale manifest, files the manifest does not list) is removed, so the checkpoint made visible holds what its
    manifest lists. Partial files in `RSYNC_PARTIAL_DIR` are left for rsync to resume from.
    """
    listed = {safe_relpath(rel): rel for rel in files}
    for path in sorted(staging.rglob("*"), reverse=True):
        rel = path.relative_to(staging).as_posix()
        if rel == RSYNC_PARTIAL_DIR or rel.startswith(RSYNC_PARTIAL_DIR + "/"):
            continue
        if path.is_dir() and not path.is_symlink():
            if not any(r.startswith(rel + "/") for r in listed):
                shutil.rmtree(path, ignore_errors=True)
        elif rel not in listed:
            path.unlink()
    held = held_by_basis(files, basis)
    todo = []
    for rel in sorted(listed):
        entry = files[listed[rel]]
        dest = staging / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if basis is not None and listed[rel] in held and link_or_copy(basis / rel, dest):
            continue
        try:
            st = dest.stat()
        except FileNotFoundError:
            pass
        else:
            if st.st_size == int(entry["size"]):
                continue
            if st.st_nlink > 1:  # linked from an older basis by an earlier attempt: SFTP must not append to it
                dest.unlink()
        todo.append(listed[rel])
    return todo


def stage_checked(files: Mapping[str, Any], staging: Path, basis: Path | None) -> list[str]:
    """`stage_from_basis` from a basis not known to be intact, then every file it staged without a transfer is read
    against the manifest; return what is still to send, sorted.

    For a push onto an instance: its checkpoints were written there by the trainer or by an earlier push, and
    nothing on this side vouches for their bytes since. A file hard-linked from it (or left whole by an interrupted
    push) whose size or sha256 is not its entry's is unlinked from staging, the basis's own file left as it was, and
    sent with the rest. What the transfer then writes it checks itself against the sender's verified file (rsync's
    whole-file checksum), so the staged checkpoint is the sender's, file for file."""
    todo = stage_from_basis(files, staging, basis)
    staged = {rel: files[rel] for rel in files if rel not in todo}
    bad = list(mismatched(staging, staged))
    for rel in bad:
        (staging / safe_relpath(rel)).unlink(missing_ok=True)
    return sorted([*todo, *bad])


def _hard_linked_from_basis(path: Path, entry: Any, basis: Path | None, shared: Mapping[str, Any], rel: str) -> bool:
    """True if `path` is the very file (same inode) the basis lists with this manifest entry's size and sha256.

    Such a file need not be read again: its bytes are the basis's, which were hashed against that same
    (size, sha256) when the basis arrived (`verify_and_fsync`) or was written (`write_checkpoint` hashes what it
    wrote), and a complete checkpoint is never modified in place. A copy (a link that fell back to copying) or a
    file rsync wrote is read in full."""
    if basis is None or shared.get(rel) != entry:
        return False
    try:
        return os.path.samestat(path.stat(), (basis / rel).stat())
    except OSError:
        return False


def mismatched(staging: Path, files: Mapping[str, Any],
               trusted: Callable[[str, Path, Any], bool] | None = None) -> Iterator[str]:
    """The files of `files` (a manifest's table) in `staging` whose size or sha256 is not their entry's, one by one
    (a caller that wants only the first reads no further). A file `trusted(rel, path, entry)` vouches for has only
    its size checked."""
    for rel, entry in files.items():
        try:
            path = staging / safe_relpath(rel)
            ok = isinstance(entry, dict) and path.stat().st_size == entry.get("size") and (
                (trusted is not None and trusted(rel, path, entry))
                or burst_checkpoint.sha256_file(path) == entry.get("sha256"))
        except (OSError, TransferError):
            ok = False
        if not ok:
            yield rel


def verify_and_fsync(staging: Path, basis: Path | None = None) -> str | None:
    """None when staging is a complete checkpoint, now durable on disk; else why it is not.

    Every file is checked against the manifest's size and sha256, except those hard-linked from `basis` (a
    complete local checkpoint, verified in full when it arrived) whose entry equals the basis's: the same bytes,
    already hashed against that entry (see `_hard_linked_from_basis`)."""
    shutil.rmtree(staging / RSYNC_PARTIAL_DIR, ignore_errors=True)
    try:
        manifest = read_manifest(staging)
    except (OSError, ValueError):
        return "its manifest is missing or malformed"
    shared = basis_files(basis)
    if next(mismatched(staging, manifest["files"],
                       lambda rel, path, entry: _hard_linked_from_basis(path, entry, basis, shared, rel)),
            None) is not None:
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


def main(argv: list[str] | None = None) -> int:
    """`stage STAGING BASIS`, the manifest on stdin: `stage_checked` into STAGING (created if needed) from the
    complete checkpoint BASIS (`-`: none; what an interrupted transfer left whole in STAGING is still kept once it
    reads true), then the manifest written there; prints {"todo": [...], "delta": bool}, `delta` saying whether
    BASIS is worth a delta transfer of the rest (`delta_basis`)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "stage":
        print("usage: checkpoint_transfer.py stage STAGING BASIS|- < MANIFEST", file=sys.stderr)
        return 2
    staging, basis = Path(args[1]), None if args[2] == "-" else Path(args[2])
    manifest = sys.stdin.buffer.read()
    files = json.loads(manifest)["files"]
    staging.mkdir(parents=True, exist_ok=True)
    todo = stage_checked(files, staging, basis)
    (staging / MANIFEST).write_bytes(manifest)
    print(json.dumps({"todo": todo, "delta": delta_basis(files, basis) is not None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
