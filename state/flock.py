"""Whole-file flocks that say "one process does this": held for the holder's lifetime, and dropped by the kernel
when it dies, however it dies."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def try_flock(path: Path) -> int | None:
    """The open descriptor holding an exclusive flock on `path` (created 0600), or None if another process holds
    it. Closing the descriptor releases the lock."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def flock_held(path: Path) -> bool:
    """Whether some process holds `try_flock(path)` now, without taking it for longer than the question."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and a shared lock taken with it
    return False
