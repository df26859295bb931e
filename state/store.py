"""Store: the one place that reads and writes burstctl's state.

SQLite in WAL mode lets the CLI and the daemon use the database at the same time; a busy timeout makes
writers wait for each other instead of failing. Any SQLAlchemy URL works (PostgreSQL in production).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Connection,
    CursorResult,
    Engine,
    Integer,
    create_engine,
    event,
    func,
    insert,
    inspect,
    select,
    text,
    true,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from state import schema as s
from state.flock import flock_held, try_flock

MIGRATION_LOCK_KEY = 7216019  # PostgreSQL advisory lock keys of this application
DAEMON_LOCK_KEY = 7216020


_BUSY_TIMEOUT_S = 10.0


def _inserted_id(result: CursorResult[Any]) -> int:
    """The id of the row a single-row INSERT just made (SQLAlchemy types the key Optional for other statements)."""
    key = result.inserted_primary_key
    if key is None:
        raise RuntimeError("the INSERT reported no primary key")
    return int(key[0])


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={int(_BUSY_TIMEOUT_S * 1000)}")
    # Switching a new file to WAL takes an exclusive lock, and SQLite can answer SQLITE_BUSY at once, without the
    # busy wait, while other processes open the same new file (seen in CI: the daemon and a CLI command starting
    # together). Retry for as long as the busy timeout would have waited. Once the file is WAL this is a no-op.
    deadline = time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


_SQLITE_HEADER = b"SQLite format 3\x00"


class NotADatabase(Exception):
    """A SQLite URL names a file that holds something else: left as it was, neither opened nor made private."""

    def __init__(self, filename: str):
        super().__init__(filename)
        self.filename = filename


def _ensure_private_file(path: Path) -> None:
    """Make the SQLite file, or make the one there private (0600: it holds the jobs' specs), but only when it is a
    SQLite database or empty: a URL naming another file (a typo, `/etc/passwd` as root) must not change its mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        with open(path, "rb") as f:  # a directory: IsADirectoryError, said as that
            head = f.read(len(_SQLITE_HEADER))
        if head and head != _SQLITE_HEADER:
            raise NotADatabase(str(path)) from None
    else:
        os.close(fd)
    os.chmod(path, 0o600)


@dataclass(frozen=True)
class DaemonLease:
    """What `Store.daemon_lock` yields: whether this daemon holds the database's lock, and (PostgreSQL) the server
    session that holds it for it."""

    ours: bool
    session: int | None = None


_AFTER_COMMIT = "burstctl_after_commit"


def after_commit(conn: Connection | None, action: Callable[[], None]) -> None:
    """Run `action` once `conn`'s transaction (a `Store.tx`) has committed; now when there is none of ours. What is
    said outside the database (events.jsonl, the console) must not tell of a transaction that then rolled back, or
    of one a kill cut short."""
    pending = conn.info.get(_AFTER_COMMIT) if conn is not None else None
    if pending is None:
        action()
    else:
        pending.append(action)


class Store:
    def __init__(self, url: str):
        self.url = url
        u = make_url(url)
        self.is_sqlite = u.get_backend_name() == "sqlite"
        # A SQLite file's daemon lock is an flock on a file beside it: the file may live outside the state directory
        # and be shared by several, whose own flocks cannot see each other.
        self._sqlite_daemon_lock: Path | None = None
        if self.is_sqlite and u.database and u.database != ":memory:":
            _ensure_private_file(Path(u.database))
            self._sqlite_daemon_lock = Path(u.database + "-daemon.lock")
        # hide_parameters: a failed statement's error never carries a job's spec (its env) or any other row's values
        self.engine: Engine = create_engine(url, future=True, hide_parameters=True)
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.migrate()

    # --- plumbing -------------------------------------------------------------------------------------
    @contextmanager
    def tx(self) -> Iterator[Connection]:
        """A transaction. What `after_commit` is given inside it runs once it has committed, in order, and not at all
        if it rolls back."""
        pending: list[Callable[[], None]] = []
        with self.engine.begin() as conn:
            conn.info[_AFTER_COMMIT] = pending
            try:
                yield conn
            finally:
                del conn.info[_AFTER_COMMIT]  # the DBAPI connection's dict: it outlives this transaction in the pool
        for action in pending:
            action()

    def migrate(self) -> int:
        """Bring the schema to the latest version. Processes that open a new database at once (the daemon and the
        first CLI command) take turns: the first migrates, the others find it done. Without the lock both read
        version 0 and both create the tables, and one fails ("table jobs already exists")."""
        with self.engine.connect() as conn:  # the common case, read-only: nothing to do
            if inspect(conn).has_table(s.schema_version.name):
                have = int(conn.execute(select(func.max(s.schema_version.c.version))).scalar() or 0)
                if have >= s.LATEST:
                    return have
        with self.engine.connect() as conn:
            if self.is_sqlite:
                # pysqlite runs DDL outside any transaction unless one is begun explicitly; IMMEDIATE takes the
                # write lock now (others wait on busy_timeout), so reading the version and migrating are one step.
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            elif self.engine.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")  # released at commit
            have = s.current_version(conn)
            for version, step in s.MIGRATIONS:
                if version > have:
                    step(conn)
                    conn.execute(insert(s.schema_version).values(version=version))
                    have = version
            conn.commit()
        return have

    def close(self) -> None:
        self.engine.dispose()

    # --- moving to another database ---------------------------------------------------------------------
    def holds_data(self) -> bool:
        """Whether any table but the schema version has a row (a database burstctl has been used with)."""
        with self.engine.connect() as c:
            return any(c.execute(select(t).limit(1)).first() is not None
                       for t in s.metadata.sorted_tables if t is not s.schema_version)

    def copy_to(self, target: Store, batch: int = 1000) -> dict[str, int]:
        """Every row of every table into `target` (migrated, with no data), ids kept, in one transaction on the
        target: a failure leaves it as it was. Rows are streamed `batch` at a time, so months of events fit in
        memory. Returns the rows copied per table."""
        tables = [t for t in s.metadata.sorted_tables if t is not s.schema_version]  # parents before children
        copied: dict[str, int] = {}
        with self.engine.connect() as src, target.engine.begin() as dst:
            for t in tables:
                rows = src.execution_options(stream_results=True).execute(select(t).order_by(*t.primary_key))
                copied[t.name] = 0
                for part in rows.mappings().partitions(batch):
                    dst.execute(insert(t), [dict(r) for r in part])
                    copied[t.name] += len(part)
            if target.engine.dialect.name == "postgresql":
                # Rows were inserted with their ids: move each id sequence past them, or the next insert collides.
                for t in tables:
                    pk = next(iter(t.primary_key.columns))
                    if len(t.primary_key.columns) == 1 and isinstance(pk.type, Integer):
                        dst.exec_driver_sql(
                            f"SELECT setval(pg_get_serial_sequence('{t.name}', '{pk.name}'), "
                            f"(SELECT COALESCE(MAX({pk.name}), 0) + 1 FROM {t.name}), false)")
        return copied

    # --- one daemon per database ----------------------------------------------------------------------
    @contextmanager
    def daemon_lock(self) -> Iterator[DaemonLease]:
        """Held for a daemon's lifetime; not `ours` if another daemon holds it. Two daemons on one database would
        both launch each queued job, and several state directories can point at one database, so the state
        directory's flock is not enough. PostgreSQL: a session advisory lock on a connection of its own, which the
        server drops with the connection. A SQLite file: an flock on `<file>-daemon.lock`, which the kernel drops
        with a dead daemon. An in-memory database has no other user: always ours."""
        if self.engine.dialect.name == "postgresql":
            with self._postgres_daemon_lock() as lease:
                yield lease
            return
        if self._sqlite_daemon_lock is None:
            yield DaemonLease(ours=True)
            return
        fd = try_flock(self._sqlite_daemon_lock)
        try:
            yield DaemonLease(ours=fd is not None)
        finally:
            if fd is not None:
                os.close(fd)  # and the flock with it

    @contextmanager
    def _postgres_daemon_lock(self) -> Iterator[DaemonLease]:
        with self.engine.connect() as conn:
            got = bool(conn.exec_driver_sql(f"SELECT pg_try_advisory_lock({DAEMON_LOCK_KEY})").scalar())
            session = int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar() or 0)
            conn.commit()  # a session lock outlives the transaction; nothing is left open on the server
            try:
                yield DaemonLease(ours=got, session=session if got else None)
            finally:
                if got and not conn.invalidated:
                    with contextlib.suppress(DBAPIError):  # the session is gone already, and the lock with it
                        conn.exec_driver_sql(f"SELECT pg_advisory_unlock({DAEMON_LOCK_KEY})")
                        conn.commit()

    def daemon_lock_held(self) -> bool:
        """Whether some daemon holds `daemon_lock` now, without taking it."""
        if self.engine.dialect.name == "postgresql":
            return self.daemon_lock_holder() is not None
        return self._sqlite_daemon_lock is not None and flock_held(self._sqlite_daemon_lock)

    def daemon_lock_holder(self) -> int | None:
        """PostgreSQL: the server session (backend pid) holding the daemon lock, None if no daemon holds it; always
        None on SQLite, whose lock has no session."""
        if self.engine.dialect.name != "postgresql":
            return None
        with self.engine.connect() as conn:
            pid = conn.exec_driver_sql(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = 0 "
                f"AND objid = {DAEMON_LOCK_KEY} AND objsubid = 1").scalar()
        return None if pid is None else int(pid)

    def still_holds(self, lease: DaemonLease) -> bool:
        """Whether the lease is still this daemon's: on PostgreSQL the server can end its session (a restart, an
        administrator), and with it the lock, while the daemon runs on. An flock stays while the process lives."""
        return lease.session is None or self.daemon_lock_holder() == lease.session

    # --- jobs -----------------------------------------------------------------------------------------
    def insert_job(self, row: dict[str, Any], conn: Connection | None = None) -> None:
        now = time.time()
        values = {"created_at": now, "updated_at": now, "approved": False, **row,
                  "rented_usd": s.planned_rented_usd(row.get("decision"))}
        if conn is not None:
            conn.execute(insert(s.jobs).values(**values))
            return
        with self.tx() as c:
            c.execute(insert(s.jobs).values(**values))

    def get_job(self, ref: str) -> dict[str, Any] | None:
        """By id, or by name (the newest of that name)."""
        found = self.find_jobs(ref)
        return found[0] if found else None

    def find_jobs(self, ref: str) -> list[dict[str, Any]]:
        """The job with id `ref`, else every job named `ref`, newest first."""
        with self.engine.connect() as c:
            row = c.execute(select(s.jobs).where(s.jobs.c.id == ref)).mappings().first()
            if row is not None:
                return [dict(row)]
            q = select(s.jobs).where(s.jobs.c.name == ref).order_by(s.jobs.c.created_at.desc())
            return [dict(r) for r in c.execute(q).mappings()]

    def list_jobs(self, states: Sequence[str] | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        q = select(s.jobs).order_by(s.jobs.c.created_at)
        if states:
            q = q.where(s.jobs.c.state.in_(list(states)))
        if limit:
            q = q.limit(limit)
        with self.engine.connect() as c:
            return [dict(r) for r in c.execute(q).mappings()]

    def newest_jobs(self, states: Sequence[str], limit: int) -> list[dict[str, Any]]:
        """The `limit` jobs in `states` updated last, newest first: each state's read walks its (state,
        updated_at) index from the end, whatever the number of jobs."""
        rows: list[dict[str, Any]] = []
        with self.engine.connect() as c:
            for st in states:
                q = (select(s.jobs).where(s.jobs.c.state == st).order_by(s.jobs.c.updated_at.desc(), s.jobs.c.id)
                     .limit(limit))
                rows.extend(dict(r) for r in c.execute(q).mappings())
        return sorted(rows, key=lambda r: r["updated_at"], reverse=True)[:limit]

    def update_job(self, job_id: str, conn: Connection | None = None, *, expect_state: str | None = None,
                   **fields: Any) -> bool:
        """Update a job; with expect_state, only if it is still in that state (compare-and-set)."""
        q = update(s.jobs).where(s.jobs.c.id == job_id)
        if expect_state is not None:
            q = q.where(s.jobs.c.state == expect_state)
        if "decision" in fields:  # the column summed for the budget goes with the decision it is read from
            # A decision made again plans the work left, and `holds.held_by_plans` takes off all the job has spent:
            # counted in, so that what was spent before it does not come off its new plan too.
            fields["rented_usd"] = s.planned_rented_usd(fields["decision"]) + self.job_spend(job_id, conn=conn)[0]
        q = q.values(updated_at=time.time(), **fields)
        if conn is not None:
            return conn.execute(q).rowcount == 1
        with self.tx() as c:
            return c.execute(q).rowcount == 1

    def set_hold(self, job_id: str, usd: float, conn: Connection) -> None:
        """Set what the budget holds for a job (`jobs.rented_usd`, less what it spends from here on), in the caller's
        transaction: the one that writes the attempt it holds it for. Not a change of the job's (`updated_at`)."""
        conn.execute(update(s.jobs).where(s.jobs.c.id == job_id).values(rented_usd=usd))

    def set_attempt_info(self, attempt_id: str, info: dict[str, Any], conn: Connection | None = None) -> None:
        """Replace an attempt's `info` (what the lifecycle remembers of it between ticks)."""
        q = update(s.attempts).where(s.attempts.c.id == attempt_id).values(info=info)
        if conn is not None:
            conn.execute(q)
            return
        with self.tx() as c:
            c.execute(q)

    def count_jobs_by_state(self) -> dict[str, int]:
        with self.engine.connect() as c:
            rows = c.execute(select(s.jobs.c.state, func.count()).group_by(s.jobs.c.state)).all()
        return {st: n for st, n in rows}

    # --- events ---------------------------------------------------------------------------------------
    def append_event(self, type_: str, data: dict[str, Any], *, job_id: str | None = None,
                     attempt_id: str | None = None, ts: float | None = None,
                     conn: Connection | None = None) -> int:
        values = {"ts": ts or time.time(), "type": type_, "job_id": job_id, "attempt_id": attempt_id,
                  "data": data}
        if conn is not None:
            return _inserted_id(conn.execute(insert(s.events).values(**values)))
        with self.tx() as c:
            return _inserted_id(c.execute(insert(s.events).values(**values)))

    def events(self, *, after_id: int = 0, job_id: str | None = None, type_prefix: str | None = None,
               limit: int | None = None, newest: int | None = None) -> list[dict[str, Any]]:
        """Events in id order: the first `limit` after `after_id`, or only the `newest` ones (read from the end,
        so months of events cost nothing).

        A type prefix without a job reads each matching type through its (type, id) index and merges them: a
        prefix match (LIKE) cannot use that index, so a rare type was a scan of the whole history."""
        if type_prefix and not job_id:
            return self._events_of_types(self.event_types(type_prefix), after_id, limit, newest)
        q = select(s.events).where(s.events.c.id > after_id)
        if job_id:  # the job's (job_id, id) index bounds the read; the type filters within the job's events
            q = q.where(s.events.c.job_id == job_id)
        if type_prefix:
            q = q.where(s.events.c.type.startswith(type_prefix))
        if newest:
            q = q.order_by(s.events.c.id.desc()).limit(newest)
        else:
            q = q.order_by(s.events.c.id)
            if limit:
                q = q.limit(limit)
        with self.engine.connect() as c:
            rows = [dict(r) for r in c.execute(q).mappings()]
        return rows[::-1] if newest else rows

    def event_types(self, prefix: str = "") -> list[str]:
        """The distinct event types that start with `prefix`, found by walking the (type, id) index from one type
        to the next (a seek per type: there are a few dozen, however many events there are)."""
        walk = text(
            "WITH RECURSIVE t(type) AS (SELECT MIN(type) FROM events UNION ALL "
            "SELECT (SELECT MIN(e.type) FROM events e WHERE e.type > t.type) FROM t WHERE t.type IS NOT NULL) "
            "SELECT type FROM t WHERE type IS NOT NULL")
        with self.engine.connect() as c:
            return [ty for (ty,) in c.execute(walk) if ty.startswith(prefix)]

    def _events_of_types(self, types: Sequence[str], after_id: int, limit: int | None,
                         newest: int | None) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        with self.engine.connect() as c:
            for ty in types:
                q = select(s.events).where(s.events.c.type == ty, s.events.c.id > after_id)
                if newest:
                    q = q.order_by(s.events.c.id.desc()).limit(newest)
                else:
                    q = q.order_by(s.events.c.id).limit(limit) if limit else q.order_by(s.events.c.id)
                rows.extend(dict(r) for r in c.execute(q).mappings())
        rows.sort(key=lambda r: r["id"])
        if newest:
            return rows[-newest:]
        return rows[:limit] if limit else rows

    def iter_events(self, *, after_id: int = 0, job_id: str | None = None, type_prefix: str | None = None,
                    batch: int = 1000) -> Iterator[dict[str, Any]]:
        """Every event after `after_id` (of the job, of the type prefix) in id order, streamed `batch` rows at a
        time, so the whole history is printed in constant memory."""
        q = select(s.events).where(s.events.c.id > after_id).order_by(s.events.c.id)
        if job_id:
            q = q.where(s.events.c.job_id == job_id)
        if type_prefix:
            q = q.where(s.events.c.type.startswith(type_prefix))
        with self.engine.connect() as c:
            for part in c.execution_options(stream_results=True).execute(q).mappings().partitions(batch):
                yield from (dict(r) for r in part)

    def last_event_id(self) -> int:
        with self.engine.connect() as c:
            return int(c.execute(select(func.max(s.events.c.id))).scalar() or 0)

    def jobs_over_before(self, cutoff: float, *, final_states: Sequence[str],
                         active_attempt_states: Sequence[str]) -> list[str]:
        """The jobs in `final_states` last changed before `cutoff` (unix seconds) with nothing of theirs live: no
        attempt in `active_attempt_states`, no instance not yet confirmed gone, no open ledger charge. Their history
        may go (`orchestrator/retention.py`)."""
        j, a, i, led = s.jobs, s.attempts, s.instances, s.ledger
        busy_attempt = select(a.c.id).where(a.c.job_id == j.c.id).where(
            a.c.state.in_(list(active_attempt_states)) | a.c.id.in_(
                select(i.c.attempt_id).where(i.c.verified_gone.is_(False), i.c.attempt_id.is_not(None))))
        open_charge = select(led.c.id).where(led.c.job_id == j.c.id, led.c.ended_at.is_(None))
        q = (select(j.c.id).where(j.c.state.in_(list(final_states)), j.c.updated_at < cutoff,
                                  ~busy_attempt.exists(), ~open_charge.exists()).order_by(j.c.id))
        with self.engine.connect() as c:
            return [r for (r,) in c.execute(q)]

    def delete_events(self, job_ids: Sequence[str], *, no_job_before: float, batch: int = 200) -> int:
        """Delete every event of `job_ids`, and the events of no job (daemon, provider, sweep) older than
        `no_job_before`. Nothing else: jobs, attempts, instances, the ledger (the budget's meter), measurements and
        spot listings stay. `batch` jobs (or 20 x `batch` events of no job) per transaction, so a daemon writing
        beside it waits milliseconds, not the whole prune. Returns the events deleted.

        The newest event is never deleted: SQLite numbers a new row one past the largest id there is, so a table
        emptied numbered from 1 again, and every reader that keeps its place by id (a notifier, `events --after`)
        saw nothing new for as long as the old ids lasted."""
        e = s.events
        deleted = 0
        with self.engine.connect() as c:
            newest = c.execute(select(func.max(e.c.id))).scalar()
        kept = e.c.id != newest if newest is not None else true()
        for k in range(0, len(job_ids), batch):
            with self.tx() as c:
                deleted += c.execute(e.delete().where(e.c.job_id.in_(job_ids[k:k + batch]), kept)).rowcount
        while True:  # no job's: read through the (job_id, id) index's NULL range, oldest first
            with self.tx() as c:
                ids = [r for (r,) in c.execute(select(e.c.id).where(e.c.job_id.is_(None), e.c.ts < no_job_before,
                                                                    kept)
                                               .order_by(e.c.id).limit(20 * batch))]
                if not ids:
                    break
                deleted += c.execute(e.delete().where(e.c.id.in_(ids))).rowcount
        return deleted

    def mark_attempts(self, attempt_ids: Sequence[str], key: str, value: Any, batch: int = 200) -> None:
        """Set `info[key] = value` on each of these attempts (finished ones: nothing else writes their info)."""
        a = s.attempts
        for k in range(0, len(attempt_ids), batch):
            with self.tx() as c:
                rows = c.execute(select(a.c.id, a.c.info).where(a.c.id.in_(attempt_ids[k:k + batch]))).all()
                for attempt_id, info in rows:
                    c.execute(update(a).where(a.c.id == attempt_id).values(info={**(info or {}), key: value}))

    def compact(self) -> None:
        """Give the space of deleted rows back to the file system: SQLite VACUUM (rewrites the file; needs as much
        free space again, and holds the write lock while it runs). PostgreSQL's autovacuum makes deleted rows'
        space reusable by itself; VACUUM FULL is left to its administrator."""
        if not self.is_sqlite:
            return
        with self.engine.connect() as c:
            c.exec_driver_sql("VACUUM")

    # --- settings -------------------------------------------------------------------------------------
    def settings_with_prefix(self, prefix: str) -> dict[str, Any]:
        """Every setting whose key starts with `prefix` (literally: % and _ are characters), in one read."""
        st = s.settings
        with self.engine.connect() as c:
            return {k: v for k, v in c.execute(select(st.c.key, st.c.value)
                                               .where(st.c.key.startswith(prefix, autoescape=True)))}

    def delete_setting(self, key: str) -> None:
        with self.tx() as c:
            c.execute(s.settings.delete().where(s.settings.c.key == key))

    def get_setting(self, key: str, default: Any = None) -> Any:
        with self.engine.connect() as c:
            v = c.execute(select(s.settings.c.value).where(s.settings.c.key == key)).scalar()
        return default if v is None else v

    def set_setting(self, key: str, value: Any, conn: Connection | None = None) -> None:
        def _do(c: Connection) -> None:
            if c.execute(update(s.settings).where(s.settings.c.key == key).values(value=value)).rowcount == 0:
                c.execute(insert(s.settings).values(key=key, value=value))

        if conn is not None:
            _do(conn)
            return
        with self.tx() as c:
            _do(c)

    # --- ledger ---------------------------------------------------------------------------------------
    def month_spend(self, month: str, now: float | None = None) -> float:
        """Closed charges plus open ones accrued up to now, for the month (YYYY-MM, UTC)."""
        now = now or time.time()
        led = s.ledger
        # Summed in the database: every decision asks, and a busy month holds thousands of closed charges.
        with self.engine.connect() as c:
            closed = c.execute(select(func.coalesce(func.sum(led.c.cost_usd), 0.0))
                               .where(led.c.month == month, led.c.cost_usd.is_not(None))).scalar()
            running = c.execute(select(led.c.rate_usd_h, led.c.started_at)
                                .where(led.c.month == month, led.c.cost_usd.is_(None))).all()
        return float(closed or 0.0) + sum(rate * max(0.0, now - started) / 3600.0 for rate, started in running)

    def job_spend(self, job_id: str, now: float | None = None, conn: Connection | None = None) -> tuple[float, float]:
        """What a job's cloud instances have cost (closed charges, open ones accrued up to now), and the $/h its open
        ones still accrue. `conn`: read in the caller's transaction."""
        now = now or time.time()
        led = s.ledger
        query = select(led.c.cost_usd, led.c.rate_usd_h, led.c.started_at).where(led.c.job_id == job_id)
        if conn is not None:
            charges = conn.execute(query).all()
        else:
            with self.engine.connect() as c:
                charges = c.execute(query).all()
        spent = sum(cost if cost is not None else rate * max(now - started, 0.0) / 3600.0
                    for cost, rate, started in charges)
        return spent, sum(rate for cost, rate, _ in charges if cost is None)

    def ledger_rows(self, month: str | None = None) -> list[dict[str, Any]]:
        q = select(s.ledger).order_by(s.ledger.c.id)
        if month:
            q = q.where(s.ledger.c.month == month)
        with self.engine.connect() as c:
            return [dict(r) for r in c.execute(q).mappings()]

    def open_charge(self, row: dict[str, Any], conn: Connection | None = None) -> int:
        if conn is not None:
            return _inserted_id(conn.execute(insert(s.ledger).values(**row)))
        with self.tx() as c:
            return _inserted_id(c.execute(insert(s.ledger).values(**row)))

    def instance_gone(self, conn: Connection, provider: str, instance_id: str, *, gone_at: float,
                      by: str = "provider") -> list[dict[str, Any]]:
        """The instance is confirmed gone, by its provider or (`by="operator"`, `burstctl confirm-gone`) by the
        operator's word: its row says so and who said it, and its open charges end at `gone_at`, each billed at least
        its attempt's billing minimum (the offer's, kept in the attempt's info when it launched). Returns the charges
        it closed, as closed."""
        where = (s.instances.c.provider == provider, s.instances.c.id == instance_id)
        conn.execute(update(s.instances).where(*where).values(state="terminated", gone_at=gone_at,  # InstanceState
                                                               verified_gone=True, gone_by=by))
        info = conn.execute(select(s.attempts.c.info).join(s.instances, s.instances.c.attempt_id == s.attempts.c.id)
                            .where(*where)).scalar()
        return self.close_open_charges(conn, ended_at=gone_at, instance=(provider, instance_id),
                                       minimum_s=float((info or {}).get("billing_minimum_s", 60.0)))

    def close_open_charges(self, conn: Connection, *, ended_at: float, minimum_s: float = 60.0,
                           attempt_id: str | None = None, instance: tuple[str, str] | None = None
                           ) -> list[dict[str, Any]]:
        """End the charges still open for an attempt, or for an instance (provider, id), at `ended_at`, each billed
        at least `minimum_s` (the provider's minimum). Returns them, as closed."""
        led = s.ledger
        q = select(led).where(led.c.ended_at.is_(None))
        if attempt_id is not None:
            q = q.where(led.c.attempt_id == attempt_id)
        if instance is not None:
            q = q.where(led.c.provider == instance[0], led.c.instance_id == instance[1])
        closed = []
        for r in conn.execute(q).mappings().all():
            billed = max(minimum_s, ended_at - r["started_at"])
            values = {"ended_at": max(ended_at, r["started_at"]), "billed_seconds": billed,
                      "cost_usd": r["rate_usd_h"] * billed / 3600.0}
            self.close_charge(r["id"], **values, conn=conn)
            closed.append({**r, **values})
        return closed

    def close_charge(self, charge_id: int, *, ended_at: float, billed_seconds: float, cost_usd: float,
                     conn: Connection | None = None) -> None:
        q = (
            update(s.ledger)
            .where(s.ledger.c.id == charge_id)
            .values(ended_at=ended_at, billed_seconds=billed_seconds, cost_usd=cost_usd)
        )
        if conn is not None:
            conn.execute(q)
            return
        with self.tx() as c:
            c.execute(q)

