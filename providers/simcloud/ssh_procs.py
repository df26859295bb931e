"""Finding and killing every process of one simcloud instance, by scanning /proc.

An instance's processes are not all descendants of anything we hold: sshd forks a fresh session per
connection, and `nohup cmd &` leaves orphans reparented to init. So a process belongs to an instance when
any of these holds:

- its environment carries the instance's marker (`BURSTCTL_SIM_INSTANCE=<backend token>/<instance id>`),
  which sshd (started with it, and `SetEnv` for sessions) or the paramiko server puts into every process;
- its working directory is inside the instance's sandbox (catches a child that scrubbed its environment);
- its session's leader carries the marker (catches the rest of a job's session; a session whose leader is
  merely sitting in the sandbox, like an operator's shell, is left alone).

Killing freezes every match with SIGSTOP first (a stopped process cannot fork away), rescans until no new
process appears, then SIGKILLs them all. A process that scrubs its environment, leaves the sandbox *and*
calls setsid() escapes; nothing in simcloud's demo or tests does that.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

MARKER_VAR = "BURSTCTL_SIM_INSTANCE"
_PROC = Path("/proc")


def _read_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, parent pid, session id) of a process, or None if it is gone."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[3])


def _protected_pids() -> set[int]:
    """This process and its ancestors: never ours to kill, whatever their cwd or session."""
    protected = {0, 1}
    pid = os.getpid()
    while pid > 1 and pid not in protected:
        protected.add(pid)
        try:
            stat = (_PROC / str(pid) / "stat").read_text()
            pid = int(stat[stat.rfind(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return protected


def _in_dir(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def instance_pids(marker: str, sandbox: str | Path | None, roots: Iterable[int] = ()) -> set[int]:
    """Live (non-zombie) processes belonging to the instance with this marker and sandbox.

    `roots` (e.g. the instance's sshd listener) count with all their descendants: sshd retitles its
    per-connection processes, which overwrites the environment that /proc shows, so the marker alone
    does not find them.
    """
    needle = f"{MARKER_VAR}={marker}".encode()
    root = os.path.realpath(sandbox) if sandbox is not None else None
    protected = _protected_pids()
    own_session = os.getsid(0)
    in_sandbox: set[int] = set()  # by working directory
    marked: set[int] = set()  # by environment marker
    sessions: dict[int, int] = {}
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in protected:
            continue
        stat = _read_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            continue
        sessions[pid] = stat[2]
        children.setdefault(stat[1], []).append(pid)
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                marked.add(pid)
                continue
        except OSError:
            pass
        if root is not None:
            try:
                if _in_dir(os.readlink(entry / "cwd"), root):
                    in_sandbox.add(pid)
            except OSError:
                pass
    job_sessions = {sid for sid in sessions.values() if sid in marked} - {own_session, 0}
    found = in_sandbox | marked | {p for p, sid in sessions.items() if sid in job_sessions}
    descendants: set[int] = set()
    stack = [r for r in roots if r in sessions]
    while stack:
        pid = stack.pop()
        if pid not in descendants:
            descendants.add(pid)
            stack.extend(children.get(pid, ()))
    return found | descendants


def kill_instance(marker: str, sandbox: str | Path | None, roots: Iterable[int] = (), *,
                  timeout_s: float = 10.0) -> set[int]:
    """Kill every process of the instance; return the pids killed. Raises TimeoutError if some survive."""
    roots = set(roots)
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        frozen: set[int] = set()
        # Freeze until a rescan finds nothing new, so no process forks a child we have not seen.
        while True:
            found = instance_pids(marker, sandbox, roots) - frozen
            if not found:
                break
            for pid in found:
                _signal(pid, signal.SIGSTOP)
            frozen |= found
        if not frozen:
            return killed
        for pid in frozen:
            _signal(pid, signal.SIGKILL)
        killed |= frozen
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(frozen)} process(es) of instance marker {marker} survived SIGKILL")
        time.sleep(0.02)  # let the kernel turn them into zombies before the rescan


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
