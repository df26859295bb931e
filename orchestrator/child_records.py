"""Child processes written down while they run, so that the next run ends those a process killed outright (SIGKILL,
the OOM killer: no `finally` runs) left running: the demo's and rehearsals' simcloud and daemon (`children`), and
every rsync (`remote.sync`).

A record is written BEFORE its child starts, holding a fresh random token that the child is started with in its
environment ($BURSTCTL_OWNED_BY, which what the child starts inherits: rsync's ssh); once started, its pid and start
ticks are added. An owner killed between the two leaves a record without a pid, and the sweep (`end_left_over`)
finds that child by its token in /proc/PID/environ. Only a process started with the exact token, or the one written
down with its start ticks, is ever signalled: a pid reused since by another program is left alone. The records of
an owner still running are its own, and left alone too.

Each record is `<prefix><token>.json` in its directory, replaced whole (never seen half written once its child may
run): {"name", "owner", "owner_start", "token", "pid", "start"}, pid and start null until the child has started.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runbooks import supervisor

OWNER_ENV = "BURSTCTL_OWNED_BY"
KILLED_WAIT_S = 5.0  # what a process SIGKILLed may take to be gone (its memory freed, in uninterruptible I/O)


@dataclass
class ChildRecord:
    """One child's record, from `write_down`: its `env` to start the child with, `started` once it runs, `forget`
    once it has ended."""

    path: Path | None  # None: not written down (no directory, or it could not be written); a no-op record
    token: str
    fields: dict[str, Any]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str] | None:
        """`base` (this process's environment when None) with the token, for the child to start with; unwritten,
        `base` as it is."""
        if self.path is None:
            return None if base is None else dict(base)
        return {**(os.environ if base is None else base), OWNER_ENV: self.token}

    def started(self, pid: int) -> None:
        """Add the child's pid and start ticks: the sweep ends it by them, without looking for its token."""
        if self.path is not None:
            self.fields.update(pid=pid, start=supervisor.process_start_ticks(pid))
            with contextlib.suppress(OSError):  # the record without them still finds the child by its token
                _replace(self.path, self.fields)

    def forget(self) -> None:
        if self.path is not None:
            _remove(self.path)


def write_down(directory: Path | None, name: str, prefix: str = "") -> ChildRecord:
    """The record of a child about to be started, written in `directory` (None: not written down) before it
    starts: `<prefix><token>.json`, so a prefix orders the records (the sweep goes in reverse order). A record
    that cannot be written leaves the child unrecorded, its owner still stops it."""
    token = secrets.token_hex(16)
    fields: dict[str, Any] = {"name": name, "owner": os.getpid(), "owner_start": supervisor.process_start_ticks(
        os.getpid()), "token": token, "pid": None, "start": None}
    if directory is None:
        return ChildRecord(None, token, fields)
    path = directory / f"{prefix}{token}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _replace(path, fields)
    except OSError:
        return ChildRecord(None, token, fields)
    return ChildRecord(path, token, fields)


def end_left_over(directory: Path, grace_s: float = 30.0, *, in_order: bool = True) -> list[str]:
    """End the children written down in `directory` whose owner is gone but which still run, in reverse order of the
    records' names: SIGTERM to each one's session, SIGKILL to what is left of it after `grace_s`. Without `in_order`
    (children that do not depend on each other: transfers) all are signalled first, then waited for together: a dozen
    orphaned rsyncs slow to go then take one grace, not a dozen. A child written down with its pid is ended only
    while that pid is the same process (its start ticks); one whose owner was killed before its pid was added, found
    by its token. The records of a live owner are left alone; the others go. Returns the names of the children ended."""
    ended: list[str] = []
    signalled: list[tuple[int, int]] = []
    for path in sorted(directory.glob("*.json"), reverse=True) if directory.is_dir() else []:
        try:
            seen = json.loads(path.read_text())
            name, owner, owner_start = str(seen.get("name", "")), seen.get("owner"), seen.get("owner_start")
            pid, start, token = seen.get("pid"), seen.get("start"), seen.get("token")
        except (OSError, ValueError, AttributeError):
            _remove(path)
            continue
        if isinstance(owner, int) and supervisor.pid_alive(owner, owner_start):
            continue  # its owner runs (a revert-local beside the daemon): its own to stop
        if isinstance(pid, int):
            running = [(pid, start)] if start is not None and supervisor.process_start_ticks(pid) == start else []
        else:
            running = _started_with(token) if isinstance(token, str) and token else []
        for leader, leader_start in running:
            _signal(leader)
            if in_order:
                _reap([(leader, leader_start)], grace_s)
        signalled += running
        if running:
            ended.append(name)
        _remove(path)
    if not in_order:
        _reap(signalled, grace_s)
    return ended


def _started_with(token: str) -> list[tuple[int, int]]:
    """The processes started with `token` in their environment that no other such process started (the child
    itself, not what it started in turn), with their start ticks."""
    carrying = set(supervisor.processes_with_env({f"{OWNER_ENV}={token}".encode()}))
    found = []
    for pid in carrying:
        start = supervisor.process_start_ticks(pid)
        if start is not None and supervisor.parent_pid(pid) not in carrying:
            found.append((pid, start))
    return found


def _signal(pid: int) -> None:
    """SIGTERM to the session `pid` leads (each child starts its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)


def _reap(leaders: list[tuple[int, int]], grace_s: float) -> None:
    """Wait up to `grace_s` for the sessions of these leaders (pid, start ticks) to be gone, then SIGKILL what is left
    of each, and wait for that (at most KILLED_WAIT_S)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(supervisor.pid_alive(pid, start) or supervisor.group_alive(pid)
                                              for pid, start in leaders):
        time.sleep(0.05)
    for pid, _ in leaders:
        if supervisor.group_alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILLED_WAIT_S  # gone when this returns, not only sent SIGKILL
    while time.monotonic() < deadline and any(supervisor.group_alive(pid) for pid, _ in leaders):
        time.sleep(0.01)


def _replace(path: Path, fields: dict[str, Any]) -> None:
    """Write `path` whole: a sweep never reads a record half written, which it would take for garbage."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(fields))
    tmp.replace(path)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".tmp").unlink(missing_ok=True)  # one a kill left between writing and replacing
