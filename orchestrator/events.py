"""The written trail: every event goes to the events table and, as a JSON line, to <state>/events.jsonl.

Secrets never reach either: the values of every credential environment variable the config names, and of every
variable a running job's pass_env names, are scrubbed from an event before it is stored or printed.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

from state.store import Store, after_commit

REDACTED = "***"


class Redactor:
    """Replaces known secret values anywhere inside nested event data."""

    def __init__(self, env_names: Iterable[str]):
        self.secrets: list[str] = []
        self.add_env_names(env_names)

    def add_env_names(self, env_names: Iterable[str]) -> None:
        """Scrub these variables' values too (a job's pass_env, known only once the job is read)."""
        self.add_values(v for n in env_names if (v := os.environ.get(n)))

    def add_values(self, values: Iterable[str]) -> None:
        """Scrub these secrets too (API keys read from files)."""
        # Each as given and trimmed: an environment's key is used trimmed (`read_api_key`), and an echo of it holds no
        # newline.
        new = {x for v in values for x in (v, v.strip()) if len(x) >= 4} - set(self.secrets)
        if new:
            # Longest first, so a secret that contains another is replaced whole.
            self.secrets = sorted({*self.secrets, *new}, key=len, reverse=True)

    def clip(self, text: str, limit: int) -> str:
        """`text` scrubbed, then cut to `limit` characters: cut first, a secret's first characters would stay."""
        return str(self(text))[:limit]

    def __call__(self, value: Any) -> Any:
        if not self.secrets:
            return value
        if isinstance(value, str):
            for s in self.secrets:
                if s in value:
                    value = value.replace(s, REDACTED)
            return value
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self(v) for v in value]
        return value


class JsonLines:
    """<state>/events.jsonl, a line per event, rotated to events.jsonl.1 (.1 to .2, ...) once past `max_bytes`,
    `kept` old files. structlog's logger interface (`msg`): one rendered event.

    Several processes append to one file (the daemon, and commands such as `cancel`). Each line is one unbuffered
    O_APPEND write, so lines never interleave. The process whose line takes the file past its size rotates it,
    under an flock; one that still holds the renamed file sees at its next line that the path is another file now,
    and reopens it. So a rotation never splits or loses a line.

    The file is a copy of the trail, not the trail: the events table is. A line that cannot be written (a full disk)
    is dropped with one warning on stderr, and the caller's transaction carries on."""

    def __init__(self, path: Path, *, max_bytes: int, kept: int):
        self.path, self.max_bytes, self.kept = path, max_bytes, kept
        self._fd = self._open()
        self._failing = False

    def msg(self, line: str) -> None:
        try:
            if not self._is_current():
                os.close(self._fd)
                self._fd = self._open()
            os.write(self._fd, (line + "\n").encode())
            if os.fstat(self._fd).st_size >= self.max_bytes:
                self._rotate()
        except OSError as exc:
            if not self._failing:
                print(f"burstctl: {self.path}: cannot write ({exc.strerror or exc}); events are still kept in the "
                      "database", file=sys.stderr)
            self._failing = True
        else:
            self._failing = False

    info = msg  # what structlog's bound logger calls for `msg`

    def close(self) -> None:
        os.close(self._fd)

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def _is_current(self) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return False

    def _rotate(self) -> None:
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._is_current():  # else another process rotated it meanwhile
                rotated = [self.path.with_name(f"{self.path.name}.{n}") for n in range(self.kept + 1)]  # [n]: .n
                rotated[self.kept].unlink(missing_ok=True)  # the oldest kept goes
                for n in range(self.kept - 1, 0, -1):
                    if rotated[n].exists():
                        rotated[n].rename(rotated[n + 1])
                self.path.rename(rotated[1])
            os.close(self._fd)
            self._fd = self._open()


class EventLog:
    """The trail: every event into the events table and, as a JSON line, into <state>/events.jsonl (`JsonLines`),
    and to the console log when there is one. An event emitted in a transaction reaches the file and the console once
    that commits (`state.store.after_commit`): they never tell of one that rolled back."""

    def __init__(self, store: Store, state_dir: Path, redactor: Redactor, console: TextIO | None = None, *,
                 max_bytes: int = 64 * 2**20, kept: int = 4, routine_calls: bool = False):
        self.store = store
        self.routine_calls = routine_calls  # the console shows provider calls that succeeded first time too
        self.redact = redactor
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "events.jsonl"
        self._lines = JsonLines(self.path, max_bytes=max_bytes, kept=kept)
        # Here, not at the top: structlog loads its console renderer and rich's tracebacks (~45 ms), which the
        # commands that only read the trail (`list`, `show`, `events`) never use.
        import structlog

        self._json = structlog.wrap_logger(
            self._lines,
            processors=[structlog.processors.JSONRenderer(sort_keys=False, default=str)],
        )
        self._console = (
            structlog.wrap_logger(
                structlog.PrintLogger(console),
                # Local time to the second: a daemon's stderr redirected to a file has no other clock on it.
                processors=[structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
                            structlog.dev.ConsoleRenderer(colors=console.isatty(), sort_keys=False)],
            )
            if console is not None
            else None
        )

    def provider_sink(self, type_: str, **data: Any) -> int | None:
        """Where provider adapters report. A call that succeeded on its first try is routine (the daemon makes one
        every tick per running instance: ~17,000 a day): it is kept nowhere, and shown on the console only with
        `routine_calls` (`daemon --verbose`), where it would bury what happens. Retries, failures and everything
        else are kept in the trail."""
        if type_ == "provider.call" and data.get("outcome") == "ok" and data.get("tries") == 1:
            if self.routine_calls:
                self.console(type_, **data)
            return None
        return self.emit(type_, **data)

    def console(self, type_: str, **data: Any) -> None:
        """To the console log only (not the events table, not events.jsonl)."""
        if self._console is not None:
            self._console.msg(type_, **self.redact(data))

    def emit(self, type_: str, *, job_id: str | None = None, attempt_id: str | None = None,
             conn: Any = None, **data: Any) -> int:
        data = self.redact(data)
        ts = time.time()
        event_id = self.store.append_event(type_, _jsonable(data), job_id=job_id, attempt_id=attempt_id,
                                           ts=ts, conn=conn)
        ids = {k: v for k, v in (("job", job_id), ("attempt", attempt_id)) if v}
        after_commit(conn, lambda: self._say(type_, event_id, ts, ids, data))  # not of a transaction rolled back
        return event_id

    def _say(self, type_: str, event_id: int, ts: float, ids: dict[str, str], data: dict[str, Any]) -> None:
        self._json.msg(event=type_, id=event_id, ts=ts, **ids, **data)
        if self._console is not None:
            self._console.msg(type_, **ids, **data)

    def close(self) -> None:
        self._lines.close()


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(data, default=str))


class EventTail:
    """New events since the last poll, for `burstctl events --follow`, on any store.

    Event ids come from the database in insert order, but transactions commit in their own order: on PostgreSQL
    an event can become visible after one with a higher id was already printed. Reading only `id > last printed`
    would skip it for good. So each poll re-reads the ids printed in the last `grace_s` seconds and prints only
    the ones not yet printed; an event whose transaction stayed open longer than that can still be missed
    (burstctl's transactions last milliseconds). SQLite serialises writers, so there the re-read finds nothing.
    """

    def __init__(self, store: Store, *, job_id: str | None = None, type_prefix: str | None = None,
                 after_id: int = 0, recent: dict[int, float] | None = None, grace_s: float = 10.0,
                 limit: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.store, self.job_id, self.type_prefix = store, job_id, type_prefix
        self.grace_s, self.limit, self.clock = grace_s, limit, clock
        self.settled = after_id  # every event at or below this id has been taken, or is given up on
        self.recent: dict[int, float] = dict(recent or {})  # ids above `settled` already taken -> when

    def poll(self) -> list[dict[str, Any]]:
        """The events not yet taken, taken."""
        new = self.peek()
        self.take(e["id"] for e in new)
        return new

    def peek(self) -> list[dict[str, Any]]:
        """The events not yet taken, oldest first (the first `limit` after `settled`, less those taken)."""
        return [e for e in self.store.events(after_id=self.settled, job_id=self.job_id, type_prefix=self.type_prefix,
                                             limit=self.limit)
                if e["id"] not in self.recent]

    def take(self, ids: Iterable[int]) -> None:
        """Mark these events handled: `peek` no longer returns them."""
        now = self.clock()
        for i in ids:
            self.recent[i] = now
        old = [i for i, seen in self.recent.items() if now - seen > self.grace_s]
        if old:
            self.settled = max(old)
            self.recent = {i: seen for i, seen in self.recent.items() if i > self.settled}
