"""`BackgroundSyncs`: the syncs that run beside the tick, one per attempt, taken by the tick once finished."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.app import App
from orchestrator.lifecycle.background_sync import BackgroundSyncs
from orchestrator.lifecycle.reconcile import Reconciler
from orchestrator.remote.sync import end_orphaned_transfers, run_transfer, stop_transfers
from tests.conftest import owner_stopped_as_its_child_starts


def test_a_sync_runs_on_a_thread_and_is_taken_once_when_it_has_finished() -> None:
    syncs: BackgroundSyncs[str] = BackgroundSyncs(2)
    release = threading.Event()
    ran_on: list[str] = []

    def work() -> str:
        ran_on.append(threading.current_thread().name)
        release.wait(10)
        return "home"

    syncs.start("a1", work)
    assert syncs.busy("a1") and syncs.finished() == [] and syncs.take("a1") is None  # still under way
    release.set()
    assert syncs.take("a1", wait=True) == "home"
    assert ran_on[0].startswith("burstctl-sync") and ran_on[0] != threading.current_thread().name
    assert not syncs.busy("a1") and syncs.take("a1", wait=True) is None  # taken once
    syncs.close()


def test_an_urgent_sync_runs_at_once_however_many_periodic_ones_are_in_line() -> None:
    # Four jobs pulling multi-GB checkpoints fill the pool; a spot notice's pull (or a run's last one) queued behind
    # them would start after the reclaim. It runs on a thread of its own, and a periodic sync of the same attempt
    # still in line is dropped for it.
    syncs: BackgroundSyncs[str] = BackgroundSyncs(1)
    release = threading.Event()
    syncs.start("busy", lambda: "home" if release.wait(10) else "late")
    syncs.start("noticed", lambda: "periodic")  # in line behind "busy"
    assert syncs.busy("noticed") and not syncs.free_for_urgent("busy")  # under way: waited for, not dropped
    assert syncs.free_for_urgent("noticed")  # still in line: dropped
    syncs.start("noticed", lambda: "urgent", urgent=True)
    assert syncs.take("noticed", wait=True) == "urgent" and not release.is_set()
    release.set()
    assert syncs.take("busy", wait=True) == "home"
    syncs.close()


def test_syncs_of_several_attempts_run_at_once_and_finish_in_any_order() -> None:
    syncs: BackgroundSyncs[str] = BackgroundSyncs(2)
    slow, fast, fast_running = threading.Event(), threading.Event(), threading.Event()
    syncs.start("slow", lambda: "slow" if slow.wait(10) else "timeout")
    syncs.start("fast", lambda: "fast" if fast_running.set() or fast.wait(10) else "timeout")
    assert fast_running.wait(10)  # on the second thread (a take would cancel it while it is still queued)
    fast.set()
    assert syncs.take("fast", wait=True) == "fast"  # not behind the slow one
    assert syncs.busy("slow")
    slow.set()
    syncs.wait_all()
    assert syncs.finished() == ["slow"] and syncs.take("slow") == "slow"
    syncs.close()


def test_without_workers_a_sync_runs_at_once_in_the_callers_thread() -> None:
    syncs: BackgroundSyncs[str] = BackgroundSyncs(0)
    syncs.start("a1", lambda: threading.current_thread().name)
    assert syncs.finished() == ["a1"] and syncs.take("a1") == threading.current_thread().name


def test_a_reloaded_reconcilers_syncs_take_over_those_in_flight() -> None:
    before: BackgroundSyncs[str] = BackgroundSyncs(1)
    release = threading.Event()
    before.start("a1", lambda: "home" if release.wait(10) else "timeout")
    after: BackgroundSyncs[str] = BackgroundSyncs(3)
    after.adopt(before)
    assert after.busy("a1") and not before.busy("a1")
    release.set()
    assert after.take("a1", wait=True) == "home"
    after.close()


def test_a_sync_still_queued_behind_others_is_cancelled_when_its_attempt_must_pull_now() -> None:
    # One worker, busy with another attempt's long pull: the queued sync of an attempt that has just had its notice
    # is not waited for (its step pulls at once); the one under way is.
    syncs: BackgroundSyncs[str] = BackgroundSyncs(1)
    release = threading.Event()
    ran: list[str] = []
    syncs.start("long", lambda: ran.append("long") or ("long" if release.wait(10) else "timeout"))
    syncs.start("noticed", lambda: ran.append("noticed") or "noticed")
    assert syncs.take("noticed", wait=True) is None and not syncs.busy("noticed")
    release.set()
    assert syncs.take("long", wait=True) == "long"
    syncs.close()
    assert ran == ["long"]


def test_a_stopping_daemon_waits_a_bounded_time_for_the_syncs_under_way_and_drops_those_queued() -> None:
    syncs: BackgroundSyncs[str] = BackgroundSyncs(1)
    never = threading.Event()
    syncs.start("stuck", lambda: "stuck" if never.wait(30) else "timeout")
    syncs.start("queued", lambda: "queued")
    syncs.wait_all(timeout_s=0.2)
    assert syncs.busy("stuck") and not syncs.busy("queued")
    syncs.close()  # its thread is a daemon thread: the process may exit under it
    never.set()


def test_a_stopping_daemon_ends_the_transfers_still_running_and_the_processes_they_started(tmp_path: Path) -> None:
    # A plain SIGTERM let an rsync (and its ssh) outlive the daemon, writing on into a staging directory that the
    # next daemon's pull of the same checkpoint writes too. The stand-in transfer starts a child of its own, as rsync
    # starts ssh.
    pidfile = tmp_path / "child.pid"
    syncs: BackgroundSyncs[int] = BackgroundSyncs(1)
    syncs.start("a1", lambda: run_transfer(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"]).returncode)
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    child = int(pidfile.read_text())
    syncs.wait_all(timeout_s=0.1)
    assert syncs.busy("a1")
    assert stop_transfers() == 1
    assert syncs.take("a1", wait=True) == -15  # its thread is free at once, not in a minute
    deadline = time.monotonic() + 5
    while _alive(child):  # the child is in the transfer's process group: ended with it
        assert time.monotonic() < deadline, "the transfer's own child outlived it"
        time.sleep(0.02)
    assert stop_transfers() == 0
    syncs.close()


def test_a_transfer_interrupted_in_a_foreground_command_takes_its_processes_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In a session of its own, a transfer no longer gets the terminal's Ctrl-C: the one interrupted ends it.
    pidfile = tmp_path / "child.pid"
    real = subprocess.Popen.communicate

    def interrupted(self: subprocess.Popen[str], *args: object, **kwargs: object) -> object:
        deadline = time.monotonic() + 10
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_transfer(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"])
    monkeypatch.setattr(subprocess.Popen, "communicate", real)
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < deadline, "the interrupted transfer's child outlived it"
        time.sleep(0.02)
    assert stop_transfers() == 0  # and it is no longer counted as running


def test_a_stopping_reconciler_ends_the_transfers_its_syncs_still_run(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pidfile = tmp_path / "child.pid"
    app = App(state_dir_override=str(tmp_path / "state"))
    rec = Reconciler(app, {}, cloud=None)
    rec.syncs.pool.start("a1", lambda: run_transfer(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"]).returncode)
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    started = time.monotonic()
    rec.close(wait_s=0.2)
    assert time.monotonic() - started < 5
    child = int(pidfile.read_text())
    while _alive(child):
        assert time.monotonic() < deadline, "a transfer outlived the reconciler's close"
        time.sleep(0.02)
    app.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (ended, not yet reaped by init) is not running
        return stat.read().split(") ")[-1][0] != "Z"


def test_a_daemon_that_loses_its_database_lock_ends_its_transfers_and_writes_nothing_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # PostgreSQL can end the session that holds the lock while the daemon runs: it stops without writing to a
    # database another daemon may own now. Its rsyncs had been left running, into staging directories that the
    # other daemon's pulls write too.
    from orchestrator.daemon import run_daemon
    from orchestrator.errors import OperationalError

    pidfile = tmp_path / "child.pid"
    app = App(state_dir_override=str(tmp_path / "state"))

    def tick(self: Reconciler) -> None:
        if not self.syncs.pool.busy("a1"):
            self.syncs.pool.start("a1", lambda: run_transfer(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"]))

    def still_holds(lease: object) -> bool:  # until the transfer runs
        return not (pidfile.exists() and pidfile.read_text().strip())

    monkeypatch.setattr(Reconciler, "tick", tick)
    monkeypatch.setattr(app.store, "still_holds", still_holds)
    closed: list[bool] = []
    monkeypatch.setattr(Reconciler, "close", lambda self, wait_s=0.0: closed.append(True))
    with pytest.raises(OperationalError, match="lost this database's daemon lock"):
        run_daemon(app, tick_s=0.1, max_ticks=200)
    assert not closed  # nothing written down
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < deadline, "a transfer outlived the daemon that lost its lock"
        time.sleep(0.02)
    app.close()


def test_transfers_of_a_process_killed_outright_are_ended_by_the_next_daemon_and_a_live_ones_are_not(
        tmp_path: Path) -> None:
    # SIGKILL or the OOM killer: the daemon could not end its rsyncs, which wrote on into the staging directories
    # the next daemon's pulls write too (and a pull could move one into place while an orphan still wrote into it).
    records = tmp_path / "transfers"
    pidfiles = {name: tmp_path / f"{name}.pid" for name in ("killed", "alive")}
    starter = ("import sys, time; from pathlib import Path; from orchestrator.remote import sync; "
               "sync.record_transfers_in(Path(sys.argv[1])); "
               "sync.run_transfer(['sh', '-c', f'sleep 60 & echo $! > {sys.argv[2]}; wait'])")
    owners = {name: subprocess.Popen([sys.executable, "-c", starter, str(records), str(pidfile)])
              for name, pidfile in pidfiles.items()}
    _wait_until_both_transfers_are_written_down(records, pidfiles)
    children = {name: int(p.read_text()) for name, p in pidfiles.items()}
    owners["killed"].kill()
    owners["killed"].wait(10)
    assert _alive(children["killed"])  # its transfer outlived it, in a session of its own
    try:
        assert end_orphaned_transfers(records) == 1
        assert not _alive(children["killed"])  # ended, not only signalled, before the daemon's first pull
        assert _alive(children["alive"]) and len(list(records.glob("*.json"))) == 1  # a live process's own
    finally:
        owners["alive"].kill()
        owners["alive"].wait(10)
        end_orphaned_transfers(records)


def test_a_transfer_whose_daemon_was_killed_the_instant_it_started_it_is_ended_by_the_next_daemon(
        tmp_path: Path) -> None:
    # A daemon killed between starting an rsync and writing it down left that rsync written down nowhere, writing on
    # for ever into a staging directory the next daemon's pull writes too. Only what the killed daemon started is
    # ended: a transfer whose daemon is still starting it, and any other program's process, are left alone.
    records = tmp_path / "transfers"
    starter = ("import sys; from pathlib import Path; from orchestrator.remote import sync; "
               "sync.record_transfers_in(Path(sys.argv[1])); sync.run_transfer(['sleep', '60'])")
    unrelated = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        with owner_stopped_as_its_child_starts(starter, str(records)) as orphan, \
                owner_stopped_as_its_child_starts(starter, str(records), killed=False) as starting:
            assert _alive(orphan)  # its daemon is gone, it runs on
            assert end_orphaned_transfers(records) == 1
            assert not _alive(orphan)  # ended, not only signalled, before the daemon's first pull
            assert _alive(starting) and len(list(records.glob("*.json"))) == 1  # a live process's own
            assert unrelated.poll() is None
    finally:
        unrelated.kill()
        unrelated.wait()


def test_orphaned_transfers_slow_to_go_are_all_signalled_before_any_is_killed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # rsyncs that take their time over SIGTERM (a multi-GB file being closed) are each given the grace at once, not
    # one after another: a dozen of them held the next daemon's start for a dozen graces. Each notes, as it is told
    # to go, how many of them are still there: all, when they are told together.
    import orchestrator.remote.sync as sync

    monkeypatch.setattr(sync, "ORPHAN_END_WAIT_S", 1.0)
    records, said, pids = tmp_path / "transfers", tmp_path / "said", tmp_path / "pids"
    # Builtins only in the trap (a fork of it would be counted as one of them); a zombie is gone.
    slow = (f"echo $$ >> {pids}; trap 'n=0; while read p; do read -r _ _ st _ < /proc/$p/stat 2>/dev/null && "
            f"[ $st != Z ] && n=$((n+1)); done < {pids}; echo $n >> {said}' TERM; while :; do sleep 0.05; done")
    owner = ("import subprocess, sys, time; from pathlib import Path; from orchestrator import child_records\n"
             "for n in range(3):\n"
             "    record = child_records.write_down(Path(sys.argv[1]), f'rsync-{n}')\n"
             f"    child = subprocess.Popen(['bash', '-c', {slow!r}], env=record.env(), start_new_session=True)\n"
             "    record.started(child.pid)\n"
             f"while len(Path({str(pids)!r}).read_text().split() if Path({str(pids)!r}).exists() else []) < 3:\n"
             "    time.sleep(0.01)\n")
    subprocess.run([sys.executable, "-c", owner, str(records)], check=True, timeout=60)  # gone, its rsyncs not

    assert end_orphaned_transfers(records) == 3
    assert said.read_text().split() == ["3", "3", "3"]
    assert not any(_alive(int(pid)) for pid in pids.read_text().split())


def _wait_until_both_transfers_are_written_down(records: Path, pidfiles: dict[str, Path]) -> None:
    # Each transfer's child writes its pid file as it starts, and its owner writes the record once Popen returns: an
    # owner killed between the two leaves nothing to end (which failed this on a loaded machine).
    deadline = time.monotonic() + 30
    while not (all(p.exists() and p.read_text().strip() for p in pidfiles.values())
               and len(list(records.glob("*.json"))) == len(pidfiles)):
        assert time.monotonic() < deadline
        time.sleep(0.05)


_PINNED_TRANSFER = """
import sys
from pathlib import Path

from orchestrator.remote import sync
from orchestrator.remote.ssh import MemoryHostKeyTrust, Target, rsync_ssh_command

records, host_key, pidfile = Path(sys.argv[1]), Path(sys.argv[2]).read_text(), sys.argv[3]
sync.record_transfers_in(records)
target = Target("127.0.0.1", 2222, "ubuntu", Path(sys.argv[2]), host_key, "i-1")
with rsync_ssh_command(target, MemoryHostKeyTrust()):  # what `_rsync` holds while its rsync runs
    sync.run_transfer(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"])
"""


def test_a_transfer_killed_outright_leaves_no_known_hosts_file_once_the_next_daemon_has_started(
        tmp_path: Path) -> None:
    # Each rsync's ssh pins the host key through a private known_hosts file, removed when the transfer ends. A daemon
    # killed during one left it in the system's temporary directory for good (67 had piled up). They are written in
    # the state's transfers directory, named with their process: the next daemon removes a dead process's, and a live
    # one's (a revert-local beside it) stays while it is used.
    from orchestrator.remote.ssh import generate_keypair

    prefix = "burstctl-known-hosts-"

    records, systmp = tmp_path / "transfers", tmp_path / "systmp"
    systmp.mkdir()
    generate_keypair(tmp_path / "host")  # and host.pub, the line the transfers pin
    pidfiles = {name: tmp_path / f"{name}.pid" for name in ("killed", "alive")}
    owners = {name: subprocess.Popen([sys.executable, "-c", _PINNED_TRANSFER, str(records), str(tmp_path / "host.pub"),
                                      str(pidfile)], env={**os.environ, "TMPDIR": str(systmp)})
              for name, pidfile in pidfiles.items()}
    _wait_until_both_transfers_are_written_down(records, pidfiles)
    owners["killed"].kill()
    owners["killed"].wait(10)
    try:
        held = sorted(p.name for p in records.glob(f"{prefix}*"))
        assert len(held) == 2 and not list(systmp.iterdir())  # one each, in the state, none in the system's tmp
        assert end_orphaned_transfers(records) == 1  # what the daemon does as it starts
        (left,) = records.glob(f"{prefix}*")
        assert left.name.startswith(f"{prefix}{owners['alive'].pid}-")  # the live process's, in use
        assert left.read_text().startswith("[127.0.0.1]:2222 ssh-ed25519 ")
    finally:
        owners["alive"].kill()
        owners["alive"].wait(10)
        end_orphaned_transfers(records)
    assert not list(records.glob(f"{prefix}*")) and not list(systmp.iterdir())
