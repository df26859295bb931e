"""The local checkpoint store: <state>/checkpoints/<job id>/<name>/, complete checkpoints only."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from orchestrator.config import Config
from runbooks import burst_checkpoint

if TYPE_CHECKING:
    from orchestrator.app import App

KEEP = 3  # complete checkpoints kept per job in the local store while it may still resume
KEEP_DONE = 1  # and once it is done: its final state (nothing resumes a done job)
REJECTED_KEPT = 20  # rejected checkpoints an attempt remembers: a trainer writing bad ones for days keeps info small

Source = Literal["instance", "s3"]  # where an attempt's checkpoints are pulled from


def store_dir(cfg: Config, job_id: str) -> Path:
    return cfg.state_dir / "checkpoints" / job_id


@contextmanager
def _store_lock_file(cfg: Config, job_id: str) -> Iterator[int]:
    """The open lock file beside a job's store (its descriptor), which `store_lock` and `try_store_lock` flock."""
    folder = store_dir(cfg, job_id)
    folder.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder.parent / f".{job_id}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def store_lock(cfg: Config, job_id: str) -> Iterator[None]:
    """An exclusive lock on a job's store while checkpoints are pulled into it or one is chosen to resume from."""
    with _store_lock_file(cfg, job_id) as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield


@contextmanager
def try_store_lock(cfg: Config, job_id: str) -> Iterator[bool]:
    """`store_lock` if it is free now (True), else nothing held (False): for a step in the tick, which must not wait
    minutes for a multi-GB pull to end."""
    with _store_lock_file(cfg, job_id) as fd:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def latest(cfg: Config, job_id: str, *, deep: bool = True) -> Path | None:
    """The newest complete (manifest-verified) local checkpoint of a job, if any. Never a partial one. `deep=False`
    checks sizes only, for a caller that only asks whether there is one (hashing multi-GB files would not pay)."""
    folder = store_dir(cfg, job_id)
    if not folder.is_dir():
        return None
    if not deep:  # no lock: checkpoints become visible by a rename, and a prune never takes the newest
        return burst_checkpoint.latest_complete(folder, deep=False)
    with store_lock(cfg, job_id):  # its files are read in full: not while a pull or prune changes them
        return burst_checkpoint.latest_complete(folder, deep=True)


def resume_point(app: App, job_id: str) -> Path | None:
    """The checkpoint a resume starts from: the newest that verifies, sha256 and all. A newer one whose sizes are
    right but whose bytes are not (a disk's rot, a copy gone wrong) is moved aside to `.corrupt-<name>` in the store,
    out of the checkpoints kept and of what revert-local names, and said once (`checkpoint.corrupt`); an older good
    one is resumed from."""
    folder = store_dir(app.config, job_id)
    if not folder.is_dir():
        return None
    with store_lock(app.config, job_id):
        for path in reversed(burst_checkpoint.candidates(folder)):
            if burst_checkpoint.verify(path, deep=True):
                return path
            if burst_checkpoint.verify(path, deep=False):  # complete by its sizes: its contents are wrong
                aside = folder / f".corrupt-{path.name}-{int(time.time())}"
                os.rename(path, aside)
                app.events.emit("checkpoint.corrupt", job_id=job_id, checkpoint=path.name, moved_to=str(aside))
    return None


def prune_store(cfg: Config, job_id: str, keep: int = KEEP) -> list[Path]:
    """Keep the newest `keep` checkpoints of a job's store (the caller holds `store_lock`). Each was verified against
    its manifest's sha256 as it arrived (sync.pull_checkpoints, S3's pull), so sizes suffice here: hashing the
    newest three again after every pull read them in full, gigabytes each, every sync interval. A resume still
    hashes the one it resumes from (`latest`)."""
    return burst_checkpoint.prune(store_dir(cfg, job_id), keep=keep, deep=False)


def trim_done(cfg: Config, job_id: str) -> list[Path]:
    """A done job keeps only its newest checkpoint: the older ones were resume points, and nothing resumes it."""
    if not store_dir(cfg, job_id).is_dir():
        return []
    with store_lock(cfg, job_id):
        return prune_store(cfg, job_id, keep=KEEP_DONE)


def newest_name(*names: object) -> str | None:
    """The newest of checkpoint names (the job contract makes them sort by progress: `step-%08d`), None given none.
    Names an instance reported are kept only when they look like one (a string, no path, not absurdly long)."""
    usable = [n for n in names if isinstance(n, str) and n and len(n) <= 255 and "/" not in n]
    return max(usable, default=None)


def lost_with_instance(on_instance: str | None, home: str | None) -> str | None:
    """The checkpoint an attempt's instance held (its newest, as last seen) that is newer than the newest home: what
    its loss threw away. None when home holds it, or a newer one."""
    if on_instance is None or (home is not None and home >= on_instance):
        return None
    return on_instance


def rejected_before(info: Mapping[str, Any], source: Source) -> frozenset[tuple[str, str]]:
    """The checkpoints the attempt's pulls from `source` rejected, as (name, manifest digest): a pull passes them over
    while their manifest is the one they were rejected with, and fetches one written again under its name. By
    source: a copy in S3 and the instance's own are not the same bytes (S3's was verified before it went up)."""
    return frozenset((str(e["checkpoint"]), str(e["manifest_sha256"])) for e in info.get("rejected_manifests") or []
                     if isinstance(e, dict) and e.get("from") == source and "checkpoint" in e
                     and "manifest_sha256" in e)


def remember_rejected(info: dict[str, Any], source: Source, manifests: Mapping[str, str]) -> None:
    """Write down in the attempt's `info` (persisted with it, so a restarted daemon passes them over too) the
    checkpoints a pull from `source` rejected, name → manifest digest (`PulledCheckpoints.rejected_manifests`)."""
    if not manifests:
        return
    kept = [e for e in info.get("rejected_manifests") or []
            if isinstance(e, dict) and not (e.get("from") == source and e.get("checkpoint") in manifests)]
    kept += [{"checkpoint": name, "from": source, "manifest_sha256": digest} for name, digest in manifests.items()]
    info["rejected_manifests"] = kept[-REJECTED_KEPT:]  # a new list: a sync's snapshot of info shares the old one
