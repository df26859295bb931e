"""Complete-only checkpoints: a checkpoint is either fully there (manifest verified) or not there at all.

Layout: `CKPT/<name>/` holds the trainer's files plus `manifest.json` (written last) with every file's size and
sha256, the step, the time and the job id. A checkpoint is built in a hidden sibling `CKPT/.tmp-<name>-<pid>` and
made visible with one atomic `os.rename`, so a process killed mid-write leaves only a hidden temporary directory
that `list_complete` never returns and `prune` later removes.

Stdlib-only and Python 3.8+ compatible: this file is copied to rented instances that may have only a plain
`python3`, and it is also imported by the daemon (`from runbooks import burst_checkpoint`).

CLI:  python3 burst_checkpoint.py latest CKPT      -> prints the newest complete checkpoint's path (or nothing)
      python3 burst_checkpoint.py list CKPT        -> prints every complete checkpoint, oldest first
      python3 burst_checkpoint.py verify PATH      -> exit 0 if complete, 1 if not
      python3 burst_checkpoint.py prune CKPT [--keep N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_CHUNK = 4 * 1024 * 1024  # hash and copy in 4 MiB pieces: shards can be many GB
# `.tmp-<name>-<pid>` while building; `-old`/`-pruned` while a replaced or pruned checkpoint is being deleted.
_TMP_RE = re.compile(r"^\.tmp-(?P<name>.+)-(?P<pid>\d+)(?:-(?:old|pruned))?$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(_CHUNK)
            if not block:
                break
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    # Makes a rename durable; some filesystems refuse to open directories, which only costs durability.
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        view = memoryview(data)
        for start in range(0, len(view), _CHUNK):
            fh.write(view[start:start + _CHUNK])
        fh.flush()
        os.fsync(fh.fileno())


def _check_relpath(rel: str) -> str:
    parts = Path(rel).parts
    if not rel or Path(rel).is_absolute() or ".." in parts or rel == MANIFEST:
        raise ValueError(f"checkpoint file name {rel!r}: expected a relative path inside the checkpoint (not "
                         f"absolute, no '..'), other than {MANIFEST}")
    return Path(rel).as_posix()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def write_checkpoint(ckpt_dir: str | os.PathLike[str], name: str, files: Mapping[str, bytes] | None = None, *,
                     writer: Callable[[Path], None] | None = None, meta: dict | None = None) -> Path:
    """Write checkpoint `ckpt_dir/name` atomically and return its path.

    `files` maps relative paths to contents; `writer(tmp_dir)` may write further files itself (e.g. a framework's
    `save`). `meta` is stored in the manifest; its `step` and `job_id` keys (job id defaults to $BURST_JOB_ID) are
    also lifted to the top level. An existing checkpoint of the same name is replaced as a whole.
    """
    if not _NAME_RE.match(name):
        raise ValueError(f"checkpoint name {name!r}: expected letters, digits, '.', '_', '-' and no leading dot")
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():  # left by an earlier crash of a process that had our pid
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        for rel, data in (files or {}).items():
            _write_bytes(tmp / _check_relpath(rel), data)
        if writer is not None:
            writer(tmp)
        if (tmp / MANIFEST).exists():
            raise ValueError(f"the writer must not create {MANIFEST}; write_checkpoint writes it last")

        entries = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = path.relative_to(tmp).as_posix()
            with open(path, "rb") as fh:  # the writer may not have synced its own files
                os.fsync(fh.fileno())
            entries[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        meta = dict(meta or {})
        manifest = {
            "format": FORMAT_VERSION,
            "name": name,
            "job_id": meta.get("job_id", os.environ.get("BURST_JOB_ID") or None),
            "step": meta.get("step"),
            "created_at": time.time(),
            "files": entries,
            "meta": meta,
        }
        _write_bytes(tmp / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        fsync_dir(tmp)
    except BaseException:
        # A bad file name, a writer that raised (a full disk): what was written so far goes, so a trainer that
        # carries on does not keep a hidden temporary (multi-GB) that prune removes only once its pid is dead.
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    final = root / name
    if final.exists():
        # A directory cannot be renamed over a non-empty one: move the old one aside first. In between, readers
        # see the older checkpoints only, which are complete, so nothing partial is ever visible.
        old = root / f".tmp-{name}-{os.getpid()}-old"
        if old.exists():
            shutil.rmtree(old)
        os.rename(str(final), str(old))
        os.rename(str(tmp), str(final))
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(str(tmp), str(final))
    fsync_dir(root)
    return final


def read_manifest(path: str | os.PathLike[str]) -> dict:
    """The manifest of checkpoint `path`. Raises FileNotFoundError or ValueError if it is missing or malformed."""
    with open(Path(path) / MANIFEST, "rb") as fh:
        data = json.loads(fh.read().decode("utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise ValueError(f"{Path(path) / MANIFEST}: not a burst checkpoint manifest (no 'files' table)")
    return data


def verify(path: str | os.PathLike[str], *, deep: bool = True) -> bool:
    """True if `path` is a complete checkpoint: manifest present, every listed file present with its size and
    (with `deep`, the default) its sha256. Files the manifest does not list are ignored.
    `deep=False` checks sizes only: cheap enough to call every few seconds on multi-GB checkpoints."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError):
        return False
    for rel, entry in manifest["files"].items():
        try:
            target = path / _check_relpath(rel)
            if not isinstance(entry, dict) or target.stat().st_size != entry.get("size"):
                return False
            if deep and sha256_file(target) != entry.get("sha256"):
                return False
        except (OSError, ValueError):
            return False
    return True


def candidates(ckpt_dir: Path) -> list[Path]:
    """The checkpoint directories of `ckpt_dir`, complete or not, oldest first (by name, which sorts by step)."""
    try:
        children = list(ckpt_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((p for p in children if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)


def list_complete(ckpt_dir: str | os.PathLike[str], *, deep: bool = True) -> list[Path]:
    """Every complete checkpoint in `ckpt_dir`, oldest first (by name, which sorts by step)."""
    return [p for p in candidates(Path(ckpt_dir)) if verify(p, deep=deep)]


def latest_complete(ckpt_dir: str | os.PathLike[str], *, deep: bool = True) -> Path | None:
    """The newest complete checkpoint, or None. Only the newest candidates are hashed until one verifies."""
    for path in reversed(candidates(Path(ckpt_dir))):
        if verify(path, deep=deep):
            return path
    return None


def prune(ckpt_dir: str | os.PathLike[str], keep: int = 2, *, deep: bool = True) -> list[Path]:
    """Remove complete checkpoints older than the newest `keep` fully verified ones, and temporary directories whose
    writer process is gone. Directories that do not verify are left alone (not ours to judge) and never count as
    kept, so a corrupted newest checkpoint cannot cost the good ones before it. Returns what was removed.
    `deep=False` counts the kept ones by sizes only, for a store whose every checkpoint was sha256-verified as it
    arrived (the daemon's): hashing the newest `keep` again after every pull reads them all, gigabytes each."""
    if keep < 1:
        raise ValueError("keep must be at least 1: pruning the last complete checkpoint loses the resume point")
    root = Path(ckpt_dir)
    removed = []
    found = candidates(root)
    kept = 0
    older = []
    for index in range(len(found) - 1, -1, -1):  # hash only the newest ones, until `keep` of them verify
        if verify(found[index], deep=deep):
            kept += 1
            if kept == keep:
                older = found[:index]
                break
    for path in (p for p in older if verify(p, deep=False)):
        # Hide it first, so a concurrent reader never sees a half-deleted checkpoint.
        doomed = root / f".tmp-{path.name}-{os.getpid()}-pruned"
        os.rename(str(path), str(doomed))
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    try:
        children = list(root.iterdir())
    except FileNotFoundError:
        return removed
    for path in children:
        match = _TMP_RE.match(path.name)
        if match and path.is_dir() and not _pid_alive(int(match.group("pid"))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="burst_checkpoint.py", description="Complete-only checkpoints.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd in ("latest", "list"):
        sub.add_parser(cmd).add_argument("ckpt_dir")
    sub.add_parser("verify").add_argument("path")
    prune_p = sub.add_parser("prune")
    prune_p.add_argument("ckpt_dir")
    prune_p.add_argument("--keep", type=int, default=2)
    args = parser.parse_args(argv)
    if args.cmd == "latest":
        latest = latest_complete(args.ckpt_dir)
        if latest is not None:
            print(latest)
        return 0
    if args.cmd == "list":
        for path in list_complete(args.ckpt_dir):
            print(path)
        return 0
    if args.cmd == "verify":
        return 0 if verify(args.path) else 1
    try:
        for path in prune(args.ckpt_dir, keep=args.keep):
            print(path)
    except ValueError as exc:
        print(f"burst_checkpoint: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
