"""Running attempts' periodic syncs, on threads beside the tick.

A checkpoint pull lasts as long as its bytes take: a 20 GB checkpoint about two minutes on a fast link. Run inside the
tick, it held up every other attempt's heartbeat check, interruption notice and stop for that long, and an EC2 notice
gives two minutes. So the tick only starts a sync that is due (`start`) and takes what has finished at its next start
(`finished`, `take`): the threads do the transfer into the state directory and nothing else, and everything written
to the database is written by the tick's thread.

What is in flight is held only here, in memory, and a daemon that stops loses nothing by it: a checkpoint becomes
visible only once verified (a pull cut short leaves a staging directory that the next pull resumes), and a restarted
daemon syncs each running attempt again at once. A run that has ended, or has been stopped, has its last sync here
too, taken by its own step once finished (`AttemptSyncs.final`); a spot notice starts one at once and another
each tick until the reclaim; those run at once, on threads of their own, never in line behind periodic ones. The
one step that still pulls inside the tick (a preemption whose checkpoints outlive the instance, in S3) first takes
the attempt's sync: one still queued is cancelled (the step pulls now itself), one under way is waited for, so that
what it brings home is counted.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Generic, TypeVar

from orchestrator.remote.sync import PulledCheckpoints

T = TypeVar("T")


@dataclass(frozen=True)
class SyncDone:
    """What one sync's transfers did (`AttemptSyncs.transfers`), for the tick to write down (`write_down`)."""

    at: float  # when it ended, on the reconciler's clock
    error: Exception | None = None  # the checkpoint pull failed (outputs were then not tried)
    pulled: PulledCheckpoints | None = None  # the checkpoints that came home (empty: none new)
    took_s: float = 0.0  # how long the checkpoint pull took
    outputs: list[str] | Exception | None = None  # with a new checkpoint: the outputs' paths, or their pull's failure
    logs: Exception | bool | None = None  # True: the logs came home; their failure; None: not tried
    s3_refused: str | None = None  # S3 refused the daemon's credentials: the checkpoint was pulled over SSH instead


def _do(future: Future[T], work: Callable[[], T]) -> None:
    if not future.set_running_or_notify_cancel():
        return  # cancelled while queued
    try:
        future.set_result(work())
    except BaseException as exc:  # the work returns its failures; this is a bug's, kept for the taker
        future.set_exception(exc)


class _Workers:
    """A fixed number of daemon threads taking work off a queue. Not concurrent.futures' pool: the interpreter joins
    its threads at exit, so a daemon stopping would wait for a multi-GB pull to end, past systemd's stop timeout."""

    def __init__(self, n: int):
        self._n = n
        self._queue: queue.SimpleQueue[tuple[Future[object], Callable[[], object]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, work: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((future, work))  # type: ignore[arg-type]
        if len(self._threads) < self._n:
            t = threading.Thread(target=self._run, name=f"burstctl-sync-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()
        return future

    def submit_now(self, work: Callable[[], T]) -> Future[T]:
        """`work` on a thread of its own, started now: not in line behind the queue's."""
        future: Future[T] = Future()
        threading.Thread(target=_do, args=(future, work), name="burstctl-sync-urgent", daemon=True).start()
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            _do(*item)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


class BackgroundSyncs(Generic[T]):
    """At most one sync per attempt in flight, `workers` at once; the work returns its failures, it never raises.
    Called from the tick's thread only (the futures are what the threads share)."""

    def __init__(self, workers: int):
        self.workers = workers
        self._pool = _Workers(workers) if workers else None
        self._running: dict[str, Future[T]] = {}

    def busy(self, attempt_id: str) -> bool:
        return attempt_id in self._running

    def free_for_urgent(self, attempt_id: str) -> bool:
        """Whether an urgent sync of the attempt may start now: none is in flight, or the one there was still queued
        behind other attempts' (cancelled: it had not begun, and the urgent one does its work)."""
        f = self._running.get(attempt_id)
        if f is not None and f.cancel():
            del self._running[attempt_id]
        return attempt_id not in self._running

    def start(self, attempt_id: str, work: Callable[[], T], *, urgent: bool = False) -> None:
        """Run `work` for the attempt: on a thread, or at once without workers (the caller's tick then waits).
        `urgent` (a notice's pull, a run's last one): on a thread of its own, not in line behind other attempts'
        periodic syncs, however many run."""
        if self._pool is not None:
            self._running[attempt_id] = self._pool.submit_now(work) if urgent else self._pool.submit(work)
            return
        done: Future[T] = Future()
        done.set_result(work())
        self._running[attempt_id] = done

    def finished_for(self, attempt_id: str) -> bool:
        """Whether the attempt's sync has finished (and not yet been taken)."""
        f = self._running.get(attempt_id)
        return f is not None and f.done()

    def finished(self) -> list[str]:
        """The attempts whose sync has finished and not yet been taken."""
        return [attempt_id for attempt_id, f in self._running.items() if f.done()]

    def take(self, attempt_id: str, *, wait: bool = False) -> T | None:
        """The attempt's finished sync, once. None: none in flight; or, without `wait`, not finished yet; or, with
        `wait`, one still queued behind others' (cancelled: the caller pulls now itself, not after them)."""
        f = self._running.get(attempt_id)
        if f is None or not (wait or f.done()):
            return None
        del self._running[attempt_id]
        if f.cancel():  # still queued behind other attempts' syncs
            return None
        return f.result()

    def wait_all(self, timeout_s: float | None = None) -> bool:
        """Cancel the syncs still queued, and wait for those under way to finish (at most `timeout_s`). True when
        none is under way any more."""
        for attempt_id, f in list(self._running.items()):
            if f.cancel():
                del self._running[attempt_id]
        return not wait(list(self._running.values()), timeout=timeout_s).not_done

    def adopt(self, before: BackgroundSyncs[T]) -> None:
        """Take over the syncs in flight of the reconciler this one replaces (a config reload); its threads finish
        them and then end."""
        self._running.update(before._running)
        before._running.clear()
        before.close()

    def close(self) -> None:
        """No new syncs; those in flight finish, or are cut short when the process exits."""
        if self._pool is not None:
            self._pool.shutdown()
