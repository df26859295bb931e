"""`burstctl daemon`: APScheduler drives the reconcile tick and the periodic orphan sweep.

One daemon per state directory (an flock'd lock file holding its pid), and per database, which several state
directories can share (`Store.daemon_lock`: an advisory lock on PostgreSQL, an flock beside a SQLite file).
SIGTERM/SIGINT stop the ticking and leave instances and jobs as they are: everything is in the database, and the next
daemon adopts it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.app import App
from orchestrator.config import Config
from orchestrator.config_watch import ConfigWatch
from orchestrator.errors import OperationalError
from state.flock import flock_held, try_flock
from state.store import DaemonLease

if TYPE_CHECKING:
    from apscheduler.schedulers.blocking import BlockingScheduler

    from orchestrator.lifecycle.reconcile import Reconciler

LOCK_NAME = "daemon.lock"


class DaemonLock:
    """An exclusive flock on <state>/daemon.lock; released by the kernel if the daemon dies."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = try_flock(self.path)
        if fd is None:
            raise OperationalError(f"another daemon holds {self.path} (pid {read_lock_pid(self.path)})")
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "started_at": time.time()}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def read_lock_pid(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text() or "{}").get("pid") or 0) or None
    except (OSError, ValueError):
        return None


def daemon_running(state_dir: Path) -> tuple[bool, int | None]:
    """Whether some process holds the lock (and its pid), without taking it."""
    path = state_dir / LOCK_NAME
    return (True, read_lock_pid(path)) if flock_held(path) else (False, None)


CONFIG_SEEN_KEY = "daemon_config"


def config_fingerprint(cfg: Config) -> dict[str, Any]:
    """Which config file, and a digest of the settings read from it (names of secrets only, never values)."""
    # The state directory resolved too: `--state-dir x` here and `--state-dir /tmp/x` there are one setting.
    settled = cfg.model_copy(update={"state": cfg.state.model_copy(update={"dir": cfg.state_dir.resolve()})})
    digest = hashlib.sha256(settled.model_dump_json(exclude={"source"}).encode()).hexdigest()
    # Resolved: `status` in another directory compares it with the file it read itself.
    return {"source": str(Path(cfg.source).resolve()) if cfg.source else None, "sha256": digest}


def _record_tick(app: App, tick_s: float) -> None:
    """The tick this daemon runs at (`--tick`, else the config's), for `budget`'s allowance for stopping."""
    app.store.set_setting("daemon", {**app.store.get_setting("daemon", {}), "tick_s": tick_s})


def daemon_tick_s(app: App) -> float:
    """The running daemon's tick, which `daemon --tick` may set apart from the config's; the config's without one."""
    if running_daemon(app) is not None:
        return float(app.store.get_setting("daemon", {}).get("tick_s") or app.config.daemon.tick_s)
    return app.config.daemon.tick_s


def running_daemon(app: App) -> dict[str, Any] | None:
    """The daemon running on this installation, or None: by the state directory's flock (`pid`), else, on a
    database several state directories share, by the database's lock (`pid` and `host` as that daemon recorded
    them)."""
    running, pid = daemon_running(app.config.state_dir)
    if running:
        return {"pid": pid}
    if app.store.daemon_lock_held():
        seen = app.store.get_setting("daemon", {})
        return {"pid": seen.get("pid"), "host": seen.get("host")}
    return None


def run_daemon(app: App, *, tick_s: float | None = None, max_ticks: int | None = None,
               exit_when_idle: bool = False, on_tick: Callable[[int], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT (or `max_ticks`, or no active work with `exit_when_idle`). Returns ticks run."""
    lock = DaemonLock(app.config.state_dir)
    lock.acquire()
    try:
        with app.store.daemon_lock() as lease:
            if not lease.ours:
                raise OperationalError("another daemon holds this database's lock (its state directory is elsewhere):"
                                       " one daemon per database")
            app.store.set_setting("daemon", {"pid": os.getpid(), "host": socket.gethostname(),
                                             "started_at": time.time()})
            lost = threading.Event()
            ticks = _run(app, tick_s=tick_s, max_ticks=max_ticks, exit_when_idle=exit_when_idle, on_tick=on_tick,
                         lease=lease, lost=lost)
            if lost.is_set():
                raise OperationalError("lost this database's daemon lock (the server ended its session): stopped, "
                                       "so that two daemons never run on one database; start it again")
            return ticks
    finally:
        lock.release()


def _skipped_tick(record: logging.LogRecord) -> bool:
    """False for APScheduler's "skipped: maximum number of running instances reached": a tick that outlasts the
    interval makes the next one wait, by design (max_instances 1); it is not worth a log line each time."""
    return "maximum number of running instances reached" not in record.getMessage()


def _run(app: App, *, tick_s: float | None, max_ticks: int | None, exit_when_idle: bool,
         on_tick: Callable[[int], None] | None, lease: DaemonLease, lost: threading.Event) -> int:
    # Here, not at the top: `status`, `revert-local` and others read `running_daemon` without the scheduler.
    from apscheduler.executors.pool import ThreadPoolExecutor
    from apscheduler.schedulers.blocking import BlockingScheduler

    from orchestrator.lifecycle.service import build_reconciler

    stop = threading.Event()
    reread = threading.Event()  # SIGHUP: read the config file now, changed or not
    ticks = 0
    logging.getLogger("apscheduler.scheduler").addFilter(_skipped_tick)
    # Notices go out on a thread of their own: a webhook that hangs never holds up the tick.
    scheduler = BlockingScheduler(executors={"default": ThreadPoolExecutor(1), "notify": ThreadPoolExecutor(1)},
                                  job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None})

    shutting = threading.Lock()

    def shut_down(wait: bool) -> None:
        """Stop the scheduler, once, from a thread of its own (it may be called from inside a tick)."""
        if shutting.acquire(blocking=False):
            threading.Thread(target=scheduler.shutdown, kwargs={"wait": wait}, daemon=True).start()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()
        app.events.emit("daemon.stopping", signal=signal.Signals(signum).name)
        if scheduler.running:  # else its first tick shuts it down
            shut_down(wait=True)

    # Before anything that takes time: a stop asked for while the daemon starts is a clean stop, not a death by signal.
    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    old[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda _sig, _frame: reread.set())
    try:
        reconciler = build_reconciler(app)
        # Holding the lock, no other daemon runs: rsyncs a daemon killed outright left behind are ended before any
        # pull of this one writes where they still write.
        from orchestrator.lifecycle.service import transfers_dir
        from orchestrator.remote.sync import end_orphaned_transfers

        if ended := end_orphaned_transfers(transfers_dir(app)):
            app.events.emit("daemon.orphan_transfers_ended", transfers=ended)
        # What the daemon runs on, as read from the file: `status` compares it with the file as it is now.
        app.store.set_setting(CONFIG_SEEN_KEY, config_fingerprint(app.config))
        watch = ConfigWatch(app.config_path, app.state_dir_override, app.config)
        ticks_fixed = tick_s is not None  # `daemon --tick`: a config edit does not change it
        tick_s = tick_s or app.config.daemon.tick_s
        reconciler.tick_s = tick_s
        _record_tick(app, tick_s)
        app.events.emit("daemon.started", pid=os.getpid(), tick_s=tick_s,
                        providers=sorted(reconciler.providers), mode=reconciler.mode())

        def current() -> Reconciler:
            """The reconciler for this tick or sweep: built again when the config file has changed."""
            nonlocal reconciler
            force = reread.is_set()
            reread.clear()
            fresh = _reload(app, scheduler, reconciler, watch, force=force, ticks_fixed=ticks_fixed)
            if fresh is not reconciler:
                fresh.tick_s = tick_s if ticks_fixed else app.config.daemon.tick_s
            reconciler = fresh
            return reconciler

        notifying = threading.Lock()  # one pass at a time: the scheduler's, or the last one below
        ticks = _schedule(app, scheduler, shut_down, current, stop, tick_s, max_ticks, exit_when_idle, on_tick,
                          lease, lost, notifying)
        if lost.is_set():  # another daemon may own the state now: nothing is written down, and no rsync of ours
            reconciler.abandon()  # writes on into the staging directories its pulls use
        else:
            try:  # the syncs in flight end, and what they brought home is written down
                reconciler.close()
            except Exception as exc:
                print(f"daemon: the last syncs could not be written down: {app.redactor(str(exc))}", file=sys.stderr)
            with notifying:  # what the last ticks did (a job done just before an idle exit) is told before exit
                _notify(app)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    app.events.emit("daemon.stopped", ticks=ticks)
    return ticks


def _reload(app: App, scheduler: BlockingScheduler, reconciler: Reconciler, watch: ConfigWatch, *, force: bool,
            ticks_fixed: bool) -> Reconciler:
    """The reconciler to tick with: the same one, or one built from the config file as it is now when the file has
    changed (what a restart would do, without stopping). A file that does not validate changes nothing."""
    from orchestrator.lifecycle.service import build_reconciler

    change = watch.check(force=force)
    if change is None:
        return reconciler
    if change.config is None or change.read is None:
        app.events.emit("daemon.config_rejected", error=app.redactor(change.error or "unreadable"),
                        running_on="the settings read before")
        return reconciler
    before = app.config
    app.use_config(change.config)
    try:
        fresh = build_reconciler(app, before=reconciler)
    except Exception as exc:
        app.use_config(before)
        app.events.emit("daemon.config_rejected", error=app.redactor(f"{type(exc).__name__}: {exc}"),
                        running_on="the settings read before")
        return reconciler
    stranded = _stranded_providers(app, reconciler, fresh)
    if stranded:
        # Dropping a provider would leave its instances running and billed with no daemon to stop them.
        app.use_config(before)
        where = f"{change.config.source}: " if change.config.source else ""
        app.events.emit("daemon.config_rejected", running_on="the settings read before",
                        error=f"{where}provider(s) {', '.join(stranded)} would no longer be usable while attempts "
                              "run on them: `burstctl revert-local` (or cancel those jobs) first; the file is read "
                              "again when it next changes, or on SIGHUP")
        return reconciler
    fresh.carry_over(reconciler)
    for provider in reconciler.providers.values():  # the new reconciler has its own clients
        close = getattr(provider, "close", None)
        if close is not None:
            close()
    watch.running = change.config
    daemon = change.config.daemon
    if not ticks_fixed and daemon.tick_s != before.daemon.tick_s:
        for job_id in ("tick", "notify"):
            scheduler.reschedule_job(job_id, trigger="interval", seconds=daemon.tick_s)
        _record_tick(app, daemon.tick_s)
    if daemon.sweep_s != before.daemon.sweep_s:
        scheduler.reschedule_job("sweep", trigger="interval", seconds=daemon.sweep_s)
    app.store.set_setting(CONFIG_SEEN_KEY, {**config_fingerprint(change.read),
                                            "restart_needed": change.restart_needed})
    # `on_sighup`: asked for, so it was read and rebuilt even when nothing in it changed (`changed` then empty).
    app.events.emit("daemon.config_reloaded", source=change.config.source, changed=change.applied,
                    restart_needed=change.restart_needed, providers=sorted(fresh.providers), mode=fresh.mode(),
                    on_sighup=force)
    return fresh


def _stranded_providers(app: App, before: Reconciler, after: Reconciler) -> list[str]:
    """Providers the running reconciler has, live attempts are on, and the new one would not have."""
    from orchestrator.lifecycle.machine import active_attempts

    with app.store.tx() as conn:
        live = {a["provider"] for a in active_attempts(conn) if a["where"] != "local"}
    return sorted((live & set(before.providers)) - set(after.providers))


def _schedule(app: App, scheduler: BlockingScheduler, shut_down: Callable[[bool], None],
              reconciler_now: Callable[[], Reconciler],
              stop: threading.Event, tick_s: float, max_ticks: int | None, exit_when_idle: bool,
              on_tick: Callable[[int], None] | None, lease: DaemonLease, lost: threading.Event,
              notifying: threading.Lock) -> int:
    """Tick, sweep and notify on the scheduler until `stop`; returns ticks run."""
    from orchestrator.budget_alerts import alert_if_crossed
    from orchestrator.lifecycle.service import has_active_work
    from orchestrator.retention import prune_if_due
    from orchestrator.schedules import fire_due

    ticks = 0
    unrecorded: dict[str, str] = {}  # per kind of failure, the last said on stderr because it could not be recorded

    def failed(kind: str, exc: Exception) -> None:
        """A failure as an event; when even that cannot be written (a full disk, a database gone), one line on
        stderr, said again only when it changes: not a traceback a tick."""
        error = app.redactor(f"{type(exc).__name__}: {exc}")
        try:
            app.events.emit(kind, error=error)
            unrecorded.pop(kind, None)
        except Exception as again:
            said = f"{error} (not recorded: {app.redactor(f'{type(again).__name__}: {again}')})"
            if unrecorded.get(kind) != said:
                unrecorded[kind] = said
                print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {kind} {said}", file=sys.stderr, flush=True)

    def tick() -> None:
        nonlocal ticks
        if stop.is_set():  # stopping; or a signal came before the scheduler ran
            shut_down(False)
            return
        try:
            holds = app.store.still_holds(lease)
        except Exception as exc:  # the database cannot be asked: nothing is done until it can
            failed("daemon.tick_failed", exc)
            return
        if not holds:  # checked before acting: another daemon may hold it by now
            lost.set()
            app.events.emit("daemon.lock_lost")
            stop.set()
            shut_down(False)
            return
        try:
            reconciler = reconciler_now()  # the config as it is now: its [[schedule]] tables too
            if ticks == 0:
                # What happened while no daemon ran is stepped first (a cycle that ended meanwhile is over), so
                # that the schedules do not skip a slot for a previous cycle that only the state still calls running.
                reconciler.tick()
            try:
                fire_due(app)  # before the tick: a cycle queued now starts in it
            except Exception as exc:
                failed("daemon.schedule_failed", exc)
            reconciler.tick()
        except Exception as exc:  # the loop survives a bad tick; the next one starts from the database
            failed("daemon.tick_failed", exc)
        ticks += 1
        if on_tick is not None:
            on_tick(ticks)
        if (max_ticks is not None and ticks >= max_ticks) or (exit_when_idle and not has_active_work(app)):
            stop.set()
            shut_down(False)

    def sweep() -> None:
        if stop.is_set():
            return
        try:
            reconciler_now().sweep()
            prune_if_due(app)  # state.events_keep_days: once a day
            alert_if_crossed(app)  # budget.alert_at
        except Exception as exc:
            failed("daemon.sweep_failed", exc)

    def notify() -> None:
        if stop.is_set():
            return
        with notifying:
            try:
                _notify(app)
            except Exception as exc:
                failed("daemon.notify_failed", exc)

    scheduler.add_job(tick, "interval", seconds=tick_s, id="tick", next_run_time=_now_dt())
    scheduler.add_job(notify, "interval", seconds=tick_s, id="notify", executor="notify", next_run_time=_now_dt())
    scheduler.add_job(sweep, "interval", seconds=app.config.daemon.sweep_s, id="sweep",
                      next_run_time=_now_dt())
    scheduler.start()
    return ticks


def _notify(app: App) -> None:
    """Deliver what the [[notify]] notifiers are due; a failure is said, and the next pass starts afresh."""
    from orchestrator.notify import notify_due

    try:
        notify_due(app)
    except Exception as exc:
        app.events.emit("daemon.notify_failed", error=app.redactor(f"{type(exc).__name__}: {exc}"))


def _now_dt() -> Any:
    from datetime import datetime

    return datetime.now().astimezone()
