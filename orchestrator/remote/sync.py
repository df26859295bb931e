"""Moving a job's workdir and its checkpoints between this machine and a burst instance.

Transport: rsync over SSH when rsync exists on both sides (checked once per target), SFTP otherwise; either
can be forced with `transport=`. Both pin the host key exactly as `ssh.connect` does.

Checkpoints follow `runbooks.burst_checkpoint`: `CKPT/<name>/` is complete when its `manifest.json` (written
last) is present and every listed file matches its size and sha256. Pulling never makes a partial checkpoint
visible: each one is fetched into a hidden staging dir `CKPT/.incoming-<name>` on the same filesystem,
verified against the manifest, fsynced, then renamed into place in one step. A transfer killed midway leaves
only the staging dir, which the next pull resumes (rsync `--partial-dir`, SFTP appends from the last byte), or
removes when that checkpoint is no longer wanted (a newer one superseded it).
Files a new checkpoint shares with the newest local one (the basis) do not cross the wire and are not read on
either side: the remote manifest is fetched first and every file the basis's manifest lists with the same size and
sha256 is hard-linked into staging (`stage_from_basis`, for both transports); rsync is given only the rest (with
`--ignore-times`, the basis as `--copy-dest` for delta transfer), SFTP fetches only the rest. Verification does not
re-read a file hard-linked from the basis (see `verify_and_fsync`). Hard links are safe because a complete
checkpoint is never modified in place.
A push onto an instance that holds a complete checkpoint works the other way round: `checkpoint_transfer.py`
runs there (`stage_checked`), hard-links what that checkpoint's manifest lists with our sizes and sha256s, and
reads those files against the manifest, since nothing here vouches for the instance's bytes; only the rest is
sent, and nothing that is not sent is read here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import stat
import string
import subprocess
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import fabric
import paramiko

from orchestrator import child_records
from orchestrator.remote.ssh import (
    HostKeyMismatch,
    HostKeyTrust,
    RemoteError,
    SshUnavailable,
    Target,
    connect,
    keep_known_hosts_in,
    remove_orphaned_known_hosts,
    rsync_ssh_command,
    run,
)
from runbooks import burst_checkpoint
from runbooks.checkpoint_transfer import (
    RSYNC_PARTIAL_DIR,
    STAGING_PREFIX,
    PulledCheckpoints,
    TransferError,
    TransferStats,
    delta_basis,
    make_visible,
    manifest_digest,
    safe_relpath,
    stage_from_basis,
    to_pull,
    verify_and_fsync,
)

Transport = Literal["auto", "rsync", "sftp"]

MANIFEST = burst_checkpoint.MANIFEST
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_CHUNK = 1024 * 1024
# Each entry of a checkpoint dir holding a manifest, prefixed "C ", and each staging dir, prefixed "S ".
_LIST_SH = ('cd -- "$1" 2>/dev/null || exit 0; for d in * ' + STAGING_PREFIX + '*; do '
            'case "$d" in ' + STAGING_PREFIX + '*) [ -d "$d" ] && printf \'S %s\\n\' "$d";; '
            '*) [ -f "$d/manifest.json" ] && printf \'C %s\\n\' "$d";; esac; done; exit 0')


class SyncError(RemoteError, TransferError):
    """A sync did not complete (transfer failed, local disk full, ...). Nothing partial was made visible."""


SyncStats = TransferStats


@dataclass
class PushedCheckpoint:
    name: str
    local_path: Path
    remote_path: str
    stats: SyncStats
    already_there: bool = False


# --- transport choice ----------------------------------------------------------------------------------------
_transport_cache: dict[tuple[str, str, int], Literal["rsync", "sftp"]] = {}
_transport_lock = threading.Lock()


def choose_transport(target: Target, conn: fabric.Connection, transport: Transport = "auto"
                     ) -> Literal["rsync", "sftp"]:
    """rsync when both sides have it (asked once per target), else SFTP; a forced choice is returned as is."""
    if transport != "auto":
        return transport
    cache_key = (target.instance_id, target.host, target.port)
    with _transport_lock:
        cached = _transport_cache.get(cache_key)
    if cached is not None:
        return cached
    chosen: Literal["rsync", "sftp"] = "sftp"
    if shutil.which("rsync") is not None and shutil.which("ssh") is not None:
        probe = run(conn, ["sh", "-c", "command -v rsync"], check=False, timeout=30)
        if probe.exit_code == 0:
            chosen = "rsync"
    with _transport_lock:
        _transport_cache[cache_key] = chosen
    return chosen


# --- public operations ----------------------------------------------------------------------------------------
def push_dir(target: Target, trust: HostKeyTrust, local_dir: str | Path, remote_dir: str, *,
             exclude: Sequence[str] = (), transport: Transport = "auto",
             conn: fabric.Connection | None = None) -> SyncStats:
    """Copy `local_dir`'s contents into `remote_dir` on the instance (created if needed).

    `exclude` holds rsync's exclude patterns, relative to `local_dir` (a leading '/' anchors one there); SFTP's
    walker leaves out what rsync does (`pushed_paths`, and the rules above `compile_excludes`). Files already there
    with the same size and mtime are skipped; nothing remote is deleted. `conn`: an open connection to the instance
    to use (and leave open), instead of opening one. ValueError for a pattern rsync would never match.
    """
    local = Path(local_dir)
    if not local.is_dir():
        raise SyncError(f"workdir {local} is not a directory")
    rules = compile_excludes(exclude)  # before anything is sent, whichever transport sends it
    started = time.monotonic()
    with _connection(target, trust, conn) as conn:
        chosen = choose_transport(target, conn, transport)
        run(conn, ["mkdir", "-p", "--", remote_dir], timeout=60)
        if chosen == "rsync":
            extra = [f"--exclude={p}" for p in exclude]
            stats = _rsync(target, trust, [*extra, f"{local}/", _remote_spec(target, remote_dir) + "/"],
                           what=f"pushing {local}")
        else:
            stats = _sftp_push_tree(_sftp(conn), local, remote_dir, rules)
    stats.seconds = time.monotonic() - started
    return stats


@dataclass(frozen=True)
class InstanceRunbooks:
    """Where the instance holds the runbooks (`burst_checkpoint.py` and `checkpoint_transfer.py` at least, put there
    at bootstrap) and the interpreter that runs them."""

    directory: str
    python: str = "python3"


def push_checkpoint(target: Target, trust: HostKeyTrust, local_ckpt_dir: str | Path, remote_ckpt_dir: str, *,
                    transport: Transport = "auto", conn: fabric.Connection | None = None,
                    checkpoint: Path | None = None, runbooks: InstanceRunbooks | None = None
                    ) -> PushedCheckpoint | None:
    """Put the newest complete local checkpoint into `remote_ckpt_dir` (for resume); None if there is none.
    With `checkpoint`, that one instead: the caller has verified it in full (`checkpoints.latest`), so it is not
    hashed a second time (a multi-GB read).

    It lands in a hidden remote dir and is renamed into place, so the trainer never resumes from half of it.
    When the instance already holds a complete checkpoint (the basis) and `runbooks` says where the instance has
    `checkpoint_transfer.py`, that runs there (`stage_checked`): the files the basis's manifest lists with the same
    size and sha256 as ours are hard-linked from it, and are read there against the manifest (nothing on this side
    vouches for the instance's bytes); this side does not read them. Only the rest is sent. Without a basis (a
    fresh instance, the usual resume) every file is sent, read once here, except what an earlier push of the same
    checkpoint that was cut short left whole in staging, which the instance reads against the manifest and keeps
    (with `runbooks`). With a basis but no `runbooks`, rsync compares every file's contents on both sides
    (`--checksum`); SFTP sends every file. `conn` as for `push_dir`.
    """
    # deep: a corrupt local one must not spread
    newest = checkpoint if checkpoint is not None else burst_checkpoint.latest_complete(local_ckpt_dir)
    if newest is None:
        return None
    name = newest.name
    remote_final = f"{remote_ckpt_dir}/{name}"
    remote_staging = f"{remote_ckpt_dir}/{STAGING_PREFIX}{name}"
    started = time.monotonic()
    with _connection(target, trust, conn) as conn:
        chosen = choose_transport(target, conn, transport)
        remote_complete, staged = _remote_listing(conn, remote_ckpt_dir)
        if name in remote_complete:
            return PushedCheckpoint(name, newest, remote_final, SyncStats(chosen), already_there=True)
        what = f"pushing checkpoint {name}"
        # An earlier push of this checkpoint onto this instance that was cut short left what it sent in staging.
        leftover = f"{STAGING_PREFIX}{name}" in staged
        if (remote_complete or leftover) and runbooks is not None:
            basis = remote_complete[-1] if remote_complete else None
            todo, delta = _stage_on_instance(conn, runbooks, newest, remote_staging,
                                             f"{remote_ckpt_dir}/{basis}" if basis else None)
            if chosen == "rsync":
                stats = _rsync_files(target, trust, f"{newest}/", _remote_spec(target, remote_staging) + "/", todo,
                                     basis=f"../{basis}" if basis and delta else None, what=what)
            else:
                stats = SyncStats("sftp")
                sftp = _sftp(conn)
                for rel in todo:
                    _sftp_put_if_changed(sftp, newest / safe_relpath(rel), f"{remote_staging}/{rel}", stats)
        elif chosen == "rsync":
            # A fresh instance: every file is sent, each read once here. --ignore-times: a file an interrupted push
            # left whole in staging is a delta basis, never taken as is on its size and mtime (seconds). No
            # --checksum: with nothing on the instance to compare with, it only read every file here once more.
            # A basis but no runbooks to compare manifests with: rsync compares contents itself, reading both sides.
            compare = [f"--link-dest=../{remote_complete[-1]}", "--checksum"] if remote_complete else ["--ignore-times"]
            run(conn, ["mkdir", "-p", "--", remote_staging], timeout=60)
            stats = _rsync(target, trust, [*compare, "--delete", f"{newest}/",
                                           _remote_spec(target, remote_staging) + "/"], what=what)
        else:
            # Nothing on the instance reads a leftover against the manifest, and SFTP would take a file of the same
            # size and mtime as it is (the same name, written again by a run replayed from an older step): gone.
            run(conn, ["sh", "-c", 'rm -rf -- "$1"; mkdir -p -- "$1"', "sh", remote_staging], timeout=300)
            stats = _sftp_push_tree(_sftp(conn), newest, remote_staging, (), manifest_last=True)
        # The final name is free or holds an incomplete leftover (no manifest): replace it in one rename. Then the
        # staging dirs of pushes that never finished (superseded by this one) go: nothing resumes them.
        run(conn, ["sh", "-c", 'rm -rf -- "$1/$3"; if [ -e "$2" ]; then rm -rf -- "$2"; fi; mv -- "$1" "$2" && '
                   'for d in "$4"/$5*; do if [ -e "$d" ]; then rm -rf -- "$d"; fi; done', "sh",
                   remote_staging, remote_final, RSYNC_PARTIAL_DIR, remote_ckpt_dir, STAGING_PREFIX], timeout=300)
    stats.seconds = time.monotonic() - started
    return PushedCheckpoint(name, newest, remote_final, stats)


def _stage_on_instance(conn: fabric.Connection, runbooks: InstanceRunbooks, local: Path, remote_staging: str,
                       remote_basis: str | None) -> tuple[list[str], bool]:
    """`checkpoint_transfer.py stage` on the instance: the files still to send, and whether the basis is worth a
    delta transfer of them (`delta_basis`). Without a basis it only keeps what staging holds whole and intact."""
    manifest = (local / MANIFEST).read_bytes()
    res = run(conn, [runbooks.python, f"{runbooks.directory}/checkpoint_transfer.py", "stage", remote_staging,
                     remote_basis or "-"], stdin=manifest.decode(), timeout=3600)  # reads the shared files: GBs
    lines = res.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1])
        todo, delta = [safe_relpath(rel) for rel in out["todo"]], bool(out["delta"])
    except (IndexError, ValueError, KeyError, TypeError):
        raise SyncError(f"staging checkpoint {local.name} on instance {conn.host}: no answer from "
                        "checkpoint_transfer.py") from None
    return todo, delta


@contextlib.contextmanager
def _connection(target: Target, trust: HostKeyTrust, conn: fabric.Connection | None
                ) -> Iterator[fabric.Connection]:
    """`conn` as it is (the caller closes it), or a connection of our own, closed on the way out."""
    if conn is not None:
        yield conn
        return
    with connect(target, trust=trust) as own:
        yield own


def pull_checkpoints(target: Target, trust: HostKeyTrust, remote_ckpt_dir: str, local_ckpt_dir: str | Path, *,
                     transport: Transport = "auto", bwlimit_kib: int | None = None,
                     newest_only: bool = False, conn: fabric.Connection | None = None,
                     rejected_before: Collection[tuple[str, str]] = ()) -> PulledCheckpoints:
    """Bring back every complete remote checkpoint not yet complete locally; return the new local ones.

    With `newest_only`, just the newest that verifies: older ones are superseded, and a trainer pruning them while
    they are being copied would otherwise fail the whole pull. A newest one that fails verification is rejected and
    the one before it is tried in its place.

    Each is verified (sizes + sha256 against its manifest) before it becomes visible. One that fails
    verification stays invisible and is listed in `.rejected` (and, when it was fetched whole, in
    `.rejected_manifests` with its manifest's digest); transport failures raise SyncError (retry to resume) and a
    full local disk raises SyncError after removing that checkpoint's staging dir. A checkpoint whose (name,
    `manifest_digest`) is in `rejected_before` (an earlier pull's `.rejected_manifests`) is passed over with only
    its manifest read, listed in `.passed_over`: its files are what failed then. Written again under its name, its
    manifest differs and it is fetched.
    `bwlimit_kib` caps the transfer rate (KiB/s) so a pull does not starve the trainer's own traffic. `conn`: an
    open connection to use (the caller closes it), else one of its own.
    """
    local_root = Path(local_ckpt_dir)
    local_root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    pulled: list[Path] = []
    rejected: dict[str, str] = {}
    rejected_manifests: dict[str, str] = {}
    passed_over: list[str] = []
    with _connection(target, trust, conn) as conn:
        chosen = choose_transport(target, conn, transport)
        total = SyncStats(chosen)
        names = _remote_complete(conn, remote_ckpt_dir)
        _drop_stale_staging(local_root, names[-1:] if newest_only else names)
        for name in to_pull(names, local_root, newest_only):  # newest only: the newest that verifies
            final = local_root / name
            staging = local_root / f"{STAGING_PREFIX}{name}"
            remote_path = f"{remote_ckpt_dir}/{name}"
            try:
                manifest_bytes = _remote_manifest(conn, chosen, remote_path)
                digest = manifest_digest(manifest_bytes)
                if (name, digest) in rejected_before:
                    total.bytes_received += len(manifest_bytes)
                    passed_over.append(name)
                    continue
                basis = burst_checkpoint.latest_complete(local_root, deep=False)
                resumed = staging.is_dir() and any(staging.iterdir())
                staging.mkdir(exist_ok=True)
                if chosen == "rsync":
                    stats = _rsync_pull_checkpoint(target, trust, manifest_bytes, remote_path, staging, basis,
                                                   bwlimit_kib, what=f"pulling checkpoint {name} into {local_root}")
                else:
                    stats = _sftp_pull_checkpoint(_sftp(conn), manifest_bytes, remote_path, staging, basis,
                                                  bwlimit_kib)
                total.add(stats)
                problem = verify_and_fsync(staging, basis)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    shutil.rmtree(staging, ignore_errors=True)
                    raise SyncError(f"local disk full (No space left on device) while pulling checkpoint {name} "
                                    f"into {local_root}; nothing was made visible") from None
                raise SyncError(f"pulling checkpoint {name} into {local_root} failed: {e.strerror or e}") from None
            except (EOFError, paramiko.SSHException):
                raise SshUnavailable(f"instance {target.instance_id}: SSH dropped while pulling checkpoint "
                                     f"{name}; retry to resume") from None
            except SyncError as e:
                if "No space left on device" in str(e):
                    shutil.rmtree(staging, ignore_errors=True)
                raise
            if problem is not None:
                shutil.rmtree(staging, ignore_errors=True)  # a fresh attempt refetches everything
                rejected[name] = problem
                if not resumed:  # a file left whole in staging by a pull of what it was before may be the culprit
                    rejected_manifests[name] = digest
                continue
            pulled.append(make_visible(staging, final))
    total.seconds = time.monotonic() - started
    return PulledCheckpoints(pulled, total, rejected, rejected_manifests=rejected_manifests, passed_over=passed_over)


def pull_files(target: Target, trust: HostKeyTrust, remote_dir: str, names: Sequence[str], local_dir: str | Path, *,
               append: bool = False, transport: Transport = "auto", conn: fabric.Connection | None = None
               ) -> SyncStats:
    """Copy the files `names` (relative to `remote_dir`) home into `local_dir`, under the same relative paths.

    A file already home with the same size and time is not sent again; any other arrives under a temporary name,
    then replaces the one there. With `append` (logs, which the instance only appends to) a file not there (yet) is
    skipped, and what a file already home holds is not sent again: only the bytes after its end (rsync `--append`;
    SFTP reads from that offset), so a long run's log costs each sync what it grew by."""
    local = Path(local_dir)
    local.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    what = f"pulling {len(names)} file(s) into {local}"
    with _connection(target, trust, conn) as conn:
        chosen = choose_transport(target, conn, transport)
        try:
            if chosen == "rsync":
                how = ["--append", "--ignore-missing-args"] if append else []
                src = _remote_spec(target, remote_dir) + "/"
                stats = _rsync(target, trust, [*how, "--files-from=-", "--from0", src, f"{local}/"], what=what,
                               stdin="".join(f"{n}\0" for n in names), grows=local)
            elif append:
                stats = _sftp_append_files(_sftp(conn), remote_dir, names, local)
            else:
                stats = _sftp_get_files(_sftp(conn), remote_dir, names, local)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise SyncError(f"local disk full (No space left on device) while {what}") from None
            raise SyncError(f"{what} failed: {e.strerror or e}") from None
        except (EOFError, paramiko.SSHException):
            raise SshUnavailable(f"instance {target.instance_id}: SSH dropped while {what}") from None
    stats.seconds = time.monotonic() - started
    return stats


def _drop_stale_staging(local_root: Path, wanted: Sequence[str]) -> None:
    """Remove the staging dirs of checkpoints this pull will not fetch (superseded, or gone remotely): nothing
    resumes them, and each would otherwise keep the partial bytes of an interrupted multi-GB pull forever.
    Callers serialize pulls into one store (`checkpoints.store_lock`), so none of these is being written."""
    keep = {f"{STAGING_PREFIX}{name}" for name in wanted}
    for path in local_root.iterdir():
        if path.name.startswith(STAGING_PREFIX) and path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)


# --- remote listing ---------------------------------------------------------------------------------------------
def _remote_listing(conn: fabric.Connection, remote_ckpt_dir: str) -> tuple[list[str], set[str]]:
    """The checkpoints under remote_ckpt_dir holding a manifest, oldest first (hidden dirs are never among them),
    and the staging dirs there."""
    lines = run(conn, ["sh", "-c", _LIST_SH, "sh", remote_ckpt_dir], timeout=60).stdout.splitlines()
    return (sorted(n[2:] for n in lines if n.startswith("C ") and _NAME.match(n[2:])),
            {n[2:] for n in lines if n.startswith("S ")})


def _remote_complete(conn: fabric.Connection, remote_ckpt_dir: str) -> list[str]:
    """Names under remote_ckpt_dir holding a manifest, oldest first."""
    return _remote_listing(conn, remote_ckpt_dir)[0]


def _remote_spec(target: Target, path: str) -> str:
    host = f"[{target.host}]" if ":" in target.host else target.host
    return f"{target.user}@{host}:{path}"


# --- rsync --------------------------------------------------------------------------------------------------------
_STAT_LINE = re.compile(r"^(Total bytes sent|Total bytes received|Number of regular files transferred): (\d+)",
                        re.MULTILINE)


# The rsyncs running now, on any thread: a daemon that stops without waiting for them ends them
# (`stop_transfers`). A child process outlives its parent: one left running wrote on into a staging directory that
# the next daemon's pull of the same checkpoint writes too.
_RUNNING: set[subprocess.Popen[str]] = set()
_RUNNING_LOCK = threading.Lock()
# Where each running transfer is written down, with the process that started it (`record_transfers_in`): a daemon
# killed outright (SIGKILL, the OOM killer) cannot end its rsyncs, and the next one ends them from there.
_RECORDS: Path | None = None


def record_transfers_in(directory: Path) -> None:
    """Write each transfer this process starts under `directory` while it runs, and its ssh's private known_hosts
    file there too (`end_orphaned_transfers`)."""
    global _RECORDS
    directory.mkdir(parents=True, exist_ok=True)
    _RECORDS = directory
    keep_known_hosts_in(directory)


ORPHAN_END_WAIT_S = 10.0  # an orphaned transfer SIGTERMed is SIGKILLed after this long


def end_orphaned_transfers(directory: Path) -> int:
    """End the transfers written down under `directory` whose process is gone but which still run: left by a daemon
    or a revert-local killed outright, they wrote on into the staging directories this process's pulls of the same
    checkpoints write, and a pull could move one into place while an orphan still wrote into it. Each is written
    down before it starts (`child_records`), so one whose process was killed as it started it is ended too. The
    private known_hosts files such a process left there go too. A transfer of a process still alive (a revert-local
    beside this daemon) is left alone. Returns how many it ended, each gone before this process's first pull."""
    remove_orphaned_known_hosts(directory)
    return len(child_records.end_left_over(directory, grace_s=ORPHAN_END_WAIT_S, in_order=False))


class TransferStalled(SyncError):
    """A pull whose destination did not grow for its stall limit: ended, what it brought kept for the next pull."""


PULL_STALL_S = 600.0  # a pull whose files do not grow for this long is ended (at least; see `stall_limit_s`)
STALL_POLL_S = 5.0
BASIS_READ_B_S = 50e6  # the slowest a disk is assumed to read a basis file that rsync checksums before sending


def stall_limit_s(largest_file_bytes: int = 0) -> float:
    """How long a pull may bring nothing before it is taken for stalled. rsync reads a file's basis (its block
    checksums) before the file starts to arrive: a multi-GB shard may take minutes of that, at disk speed."""
    return max(PULL_STALL_S, largest_file_bytes / BASIS_READ_B_S)


def _bytes_under(folder: Path) -> int:
    """What the files under `folder` hold (rsync's temporary and partial files included): a pull's progress."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def run_transfer(argv: list[str], *, stdin: str | None = None, env: dict[str, str] | None = None,
                 grows: Path | None = None, stall_s: float | None = None) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(argv)` with its output captured, in a process group of its own (with the ssh it starts),
    known to `stop_transfers` until it ends. With `grows` (a pull's destination): ended, TransferStalled, once what
    is under it has not grown for `stall_s` (PULL_STALL_S unless given). ssh's keepalive ends a pull from an
    instance that is gone, and rsync's own --timeout counts its keep-alives as traffic: an instance whose rsync
    hangs while its sshd answers would otherwise hold the pull, and the checkpoint store's lock, for ever."""
    # Written down before it starts, and ssh's own process with it (its environment): see `child_records`.
    record = child_records.write_down(_RECORDS, "rsync", prefix=f"{os.getpid()}-")
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=record.env(env),
                                start_new_session=True)
    except BaseException:
        record.forget()
        raise
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    record.started(proc.pid)
    stall_s = PULL_STALL_S if stall_s is None else stall_s
    try:
        out, err, stalled = _communicate(proc, stdin, grows, stall_s)
    except BaseException:  # interrupted (Ctrl-C in a foreground command): its group does not outlive it
        _end(proc)
        proc.wait()
        raise
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)
        record.forget()
    if stalled:
        raise TransferStalled(f"nothing arrived for {stall_s:.0f} s (the instance's side stalled while its SSH "
                              "answered); ended, and the next pull resumes")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _communicate(proc: subprocess.Popen[str], stdin: str | None, grows: Path | None, stall_s: float
                 ) -> tuple[str, str, bool]:
    """The process's output once it ends; with `grows`, ended at once what is under it stops growing for
    `stall_s` (then True)."""
    if grows is None:
        out, err = proc.communicate(stdin)
        return out, err, False
    size, changed = _bytes_under(grows), time.monotonic()
    given: str | None = stdin
    while True:
        try:
            out, err = proc.communicate(given, timeout=min(STALL_POLL_S, stall_s))
            return out, err, False
        except subprocess.TimeoutExpired:
            given = None  # sent with the first call: a retry takes no input
        now = _bytes_under(grows)
        if now != size:
            size, changed = now, time.monotonic()
        elif time.monotonic() - changed >= stall_s:
            _end(proc)
            out, err = proc.communicate()
            return out, err, True


SFTP_STALL_S = 60.0  # an SFTP read or write that gets no answer this long fails (a reclaimed instance says nothing)


def _sftp(conn: fabric.Connection) -> paramiko.SFTPClient:
    """The connection's SFTP session, whose operations fail after SFTP_STALL_S without an answer: paramiko waits for
    ever by default, and a pull from an instance that vanished would hold its sync thread, and the attempt's end,
    for as long (rsync's ssh gives up after 60 s: ServerAliveInterval 15, CountMax 4)."""
    sftp = conn.sftp()
    sftp.get_channel().settimeout(SFTP_STALL_S)
    return sftp


def stop_transfers() -> int:
    """End the transfers still running (SIGTERM to each one's process group): what they brought is in staging
    directories, which the next pull resumes. Returns how many were running."""
    with _RUNNING_LOCK:
        running = [proc for proc in _RUNNING if proc.returncode is None]  # a reaped one's group may be another's
    for proc in running:
        _end(proc)
    return len(running)


def _end(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)


def _rsync(target: Target, trust: HostKeyTrust, args: list[str], *, what: str, stdin: str | None = None,
           grows: Path | None = None, stall_s: float | None = None) -> SyncStats:
    """rsync over the pinned SSH; a pull names its destination (`grows`), ended if that stops growing."""
    with rsync_ssh_command(target, trust) as rsh:
        argv = ["rsync", "-rlpt", "--stats", "--no-human-readable", "-e", rsh, *args]
        # C locale: --stats and error texts are parsed; no secrets are in this environment's use.
        try:
            proc = run_transfer(argv, stdin=stdin, env={**os.environ, "LC_ALL": "C"}, grows=grows, stall_s=stall_s)
        except TransferStalled as exc:
            raise TransferStalled(f"rsync while {what}: {exc}") from None
    if proc.returncode != 0:
        err = proc.stderr.strip()
        if "Host key verification failed" in err:
            raise HostKeyMismatch(f"instance {target.instance_id}: rsync's ssh refused the host key while {what}")
        if proc.returncode < 0:
            raise SyncError(f"rsync was killed by signal {-proc.returncode} while {what}; retry to resume")
        if proc.returncode == 255:
            raise SshUnavailable(f"instance {target.instance_id}: rsync's ssh connection failed while {what}")
        if "No space left on device" in err:
            raise SyncError(f"local disk full (No space left on device) while {what}")
        last = err.splitlines()[-1] if err else "no stderr"
        raise SyncError(f"rsync exited {proc.returncode} while {what}: {last}")
    found = {m.group(1): int(m.group(2)) for m in _STAT_LINE.finditer(proc.stdout)}
    return SyncStats("rsync", bytes_sent=found.get("Total bytes sent", 0),
                     bytes_received=found.get("Total bytes received", 0),
                     files_transferred=found.get("Number of regular files transferred", 0))


# --- what a push leaves out: rsync's exclude patterns, read the same way by the SFTP walker ---------------------
# rsync(1) "PATTERN MATCHING RULES", as exclude.c (`rule_matches`) and wildmatch.c apply them. Both transports must
# leave out the same files, so the walker below follows rsync's reading, byte for byte, not fnmatch's:
# - a trailing '/' matches directories only (a symlink to one is not one); a leading '/' anchors the pattern at the
#   top of the pushed directory;
# - a pattern with no '/' (besides a trailing one) and no '**' matches a name at any depth; one with a '/' inside
#   matches the end of a path, as many components as it has; one with '**' is tried after every '/' (from the start
#   only when it begins with '**', which then also matches at the top);
# - '*' matches within a name, '**' (or more) across '/', '?' one byte but '/', '[...]' one byte of a class ('!' or
#   '^' negates; ranges; [:alpha:] and the other C-locale classes) but never '/'; a backslash escapes the byte after
#   it, but only in a pattern with a wildcard (without one, the pattern is a literal name, backslashes included);
# - a trailing '/***' matches the directory and everything in it;
# - an excluded directory is not entered: nothing under it is sent.
_GRAPH = string.ascii_letters + string.digits + string.punctuation
_POSIX_CLASSES = {name.encode(): frozenset(map(ord, chars)) for name, chars in {
    "alnum": string.ascii_letters + string.digits, "alpha": string.ascii_letters, "blank": " \t",
    "cntrl": "".join(map(chr, [*range(32), 127])), "digit": string.digits, "graph": _GRAPH,
    "lower": string.ascii_lowercase, "print": _GRAPH + " ", "punct": string.punctuation, "space": " \t\n\v\f\r",
    "upper": string.ascii_uppercase, "xdigit": string.hexdigits}.items()}  # the C locale's: ASCII only
_SLASH, _BACKSLASH, _STAR, _LBRACKET, _RBRACKET = b"/"[0], b"\\"[0], b"*"[0], b"["[0], b"]"[0]


@dataclass(frozen=True)
class ExcludeRule:
    """One rsync `--exclude` pattern, compiled (`compile_excludes`)."""

    pattern: str
    regex: re.Pattern[bytes]  # the pattern's body (no leading or trailing '/'), matched against a whole text
    anchored: bool  # a leading '/'
    directory: bool  # a trailing '/': directories only
    slashes: int  # '/'s in the pattern (a leading one included), its trailing one not
    wild2: bool  # a '**' in it
    wild2_prefix: bool  # it begins with '**'
    wild3_suffix: bool  # it ends with '***'

    def matches(self, rel: bytes, is_dir: bool) -> bool:
        """Whether this rule leaves out the entry at `rel` (relative to the pushed directory), itself."""
        if self.directory and not is_dir:
            return False
        text = rel if self.slashes or self.wild2 else rel.rsplit(b"/", 1)[-1]
        if self.wild2_prefix:
            text = b"/" + text  # so that "**/x" matches x at the top too
        if is_dir and self.wild3_suffix:
            text += b"/"  # so that "d/***" matches d itself
        if self.anchored or self.wild2_prefix or not (self.slashes or self.wild2):
            starts = [0]
        elif not self.wild2:  # the last slashes + 1 components of the path, when it has that many
            cuts = [i + 1 for i, c in enumerate(text) if c == _SLASH]
            if len(cuts) < self.slashes:
                return False
            starts = [cuts[-self.slashes - 1] if len(cuts) > self.slashes else 0]
        else:  # after every '/'
            starts = [0, *(i + 1 for i, c in enumerate(text) if c == _SLASH)]
        return any(self.regex.fullmatch(text, start) for start in starts)


def compile_excludes(patterns: Sequence[str]) -> tuple[ExcludeRule, ...]:
    """The patterns as rsync reads them. ValueError, naming the pattern, for one rsync would never match (a '['
    not closed, an unknown [:class:], a lone trailing backslash)."""
    return tuple(_compile(p) for p in patterns)


def _compile(pattern: str) -> ExcludeRule:
    body = os.fsencode(pattern)
    directory = len(body) > 1 and body.endswith(b"/")
    body = body[:-1] if directory else body
    slashes, anchored = body.count(b"/"), body.startswith(b"/")
    wild = any(c in body for c in b"*?[")
    wild2 = wild and b"**" in body
    body = body[1:] if anchored else body
    try:
        regex = _wildmatch_regex(body) if wild else re.escape(body)
    except ValueError as exc:
        raise ValueError(f"'{pattern}': {exc}") from None
    return ExcludeRule(pattern, re.compile(regex, re.DOTALL), anchored, directory, slashes, wild2,
                       wild2 and not anchored and body.startswith(b"**"), wild2 and body.endswith(b"***"))


def _wildmatch_regex(p: bytes) -> bytes:
    out: list[bytes] = []
    i = 0
    while i < len(p):
        c = p[i]
        if c == _STAR:
            run = len(p[i:]) - len(p[i:].lstrip(b"*"))
            out.append(b".*" if run > 1 else b"[^/]*")
            i += run
            continue
        if c == _LBRACKET:
            members, i = _bracket(p, i)
            out.append(b"[" + b"".join(re.escape(bytes([m])) for m in sorted(members)) + b"]" if members else b"(?!)")
            continue
        if c == b"?"[0]:
            out.append(b"[^/]")
        elif c == _BACKSLASH:
            i += 1
            if i == len(p):
                raise ValueError("ends in a lone '\\', which rsync never matches")
            out.append(re.escape(p[i:i + 1]))
        else:
            out.append(re.escape(p[i:i + 1]))
        i += 1
    return b"".join(out)


def _bracket(p: bytes, i: int) -> tuple[set[int], int]:
    """The bytes the class opening at p[i] matches ('/' never), and the index after its ']': wildmatch.c's loop,
    collecting members instead of testing one byte. The first byte after '[' (or '[!') is a member even if ']'."""
    unclosed = ValueError("a '[' is not closed by a ']', and rsync never matches such a pattern")
    i += 1
    negated = i < len(p) and p[i] in b"!^"
    i += negated
    members: set[int] = set()
    prev = 0
    while True:
        if i >= len(p):
            raise unclosed
        c = p[i]
        if c == _BACKSLASH:
            i += 1
            if i >= len(p):
                raise unclosed
            c = p[i]
            members.add(c)
        elif c == b"-"[0] and prev and i + 1 < len(p) and p[i + 1] != _RBRACKET:
            i += 1
            if p[i] == _BACKSLASH:
                i += 1
                if i >= len(p):
                    raise unclosed
            members.update(range(prev, p[i] + 1))
            c = 0
        elif c == _LBRACKET and p[i + 1:i + 2] == b":":
            end = p.find(b"]", i + 2)
            if end < 0:
                raise unclosed
            if end - (i + 2) - 1 < 0 or p[end - 1] != b":"[0]:
                members.add(c)  # not a [:class:]: a '[' like any other byte
            else:
                name = p[i + 2:end - 1]
                if name not in _POSIX_CLASSES:
                    raise ValueError(f"[:{name.decode(errors='replace')}:] is not a character class rsync knows "
                                     "(alnum, alpha, blank, cntrl, digit, graph, lower, print, punct, space, upper, "
                                     "xdigit)")
                members.update(_POSIX_CLASSES[name])
                i, c = end, 0
        else:
            members.add(c)
        prev = c
        i += 1
        if i < len(p) and p[i] == _RBRACKET:
            if negated:
                members = set(range(256)) - members
            members.discard(_SLASH)
            return members, i + 1


def _pushed(local: Path, rules: Sequence[ExcludeRule]) -> Iterator[tuple[Path, str, bool]]:
    """What a push of `local` sends, as rsync -rl would with these rules: (path, path relative to `local`, whether it
    is a directory), each directory before what is in it. A symlink is sent as one, never followed (one to a
    directory is not a directory). What is neither a file, a directory nor a symlink (a socket) is listed too, and
    sent by neither transport (rsync without -D skips it, and so does `_sftp_put_if_changed`)."""
    for dirpath, dirnames, filenames in os.walk(local):
        base = Path(dirpath)
        prefix = base.relative_to(local).as_posix()
        prefix = "" if prefix == "." else prefix + "/"
        links = [d for d in dirnames if (base / d).is_symlink()]  # os.walk lists them with the directories
        kept = []
        for d in sorted(set(dirnames) - set(links)):
            if not _left_out(prefix + d, True, rules):
                kept.append(d)
                yield base / d, prefix + d, True
        dirnames[:] = kept
        for name in sorted([*filenames, *links]):
            if not _left_out(prefix + name, False, rules):
                yield base / name, prefix + name, False


def _left_out(rel: str, is_dir: bool, rules: Sequence[ExcludeRule]) -> bool:
    raw = os.fsencode(rel)
    return any(rule.matches(raw, is_dir) for rule in rules)


def pushed_paths(local_dir: str | Path, exclude: Sequence[str]) -> list[str]:
    """The paths, relative to `local_dir`, that `push_dir(local_dir, exclude=exclude)` sends (directories with a
    trailing '/'), by either transport. ValueError as `compile_excludes`."""
    return [rel + "/" if is_dir else rel for _, rel, is_dir in _pushed(Path(local_dir), compile_excludes(exclude))]


def left_out(rel: str, exclude: Sequence[str], *, is_dir: bool = False) -> bool:
    """Whether a push leaves out the path `rel` (relative to the pushed directory): it or a directory above it
    matches a pattern. ValueError as `compile_excludes`."""
    rules = compile_excludes(exclude)
    parts = PurePosixPath(rel).parts
    return any(_left_out("/".join(parts[:n]), n < len(parts) or is_dir, rules) for n in range(1, len(parts) + 1))


# --- SFTP ----------------------------------------------------------------------------------------------------------
class _RateLimit:
    """Sleeps so that bytes/elapsed stays under the cap (None: no cap)."""

    def __init__(self, kib_per_s: int | None) -> None:
        self.rate = kib_per_s * 1024 if kib_per_s else None
        self.started = time.monotonic()
        self.done = 0

    def account(self, n: int) -> None:
        if self.rate is None:
            return
        self.done += n
        ahead = self.done / self.rate - (time.monotonic() - self.started)
        if ahead > 0:
            time.sleep(ahead)


def _manifest_files(manifest_bytes: bytes, remote_path: str) -> dict[str, dict[str, Any]]:
    """The `files` table of the remote checkpoint's manifest."""
    try:
        files = json.loads(manifest_bytes)["files"]
        if not isinstance(files, dict) or not all(isinstance(e, dict) and "size" in e for e in files.values()):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise SyncError(f"{remote_path}/{MANIFEST} is not a checkpoint manifest") from None
    return files


def _remote_manifest(conn: fabric.Connection, chosen: Literal["rsync", "sftp"], remote_path: str) -> bytes:
    """The remote checkpoint's manifest, as bytes. For rsync a small JSON read over the session already open (the
    instance needs no SFTP server for that transport); else over SFTP."""
    if chosen == "rsync":
        return run(conn, ["cat", "--", f"{remote_path}/{MANIFEST}"], timeout=60).stdout.encode()
    with _sftp(conn).open(f"{remote_path}/{MANIFEST}", "rb") as f:
        return bytes(f.read())


def _rsync_pull_checkpoint(target: Target, trust: HostKeyTrust, manifest_bytes: bytes, remote_path: str,
                           staging: Path, basis: Path | None, bwlimit_kib: int | None, *, what: str) -> SyncStats:
    """Hard-link what the basis holds (`stage_from_basis`, by the two manifests' size and sha256), rsync the rest.

    rsync gets the list of files still to fetch and `--ignore-times`: its quick check (size + mtime) would take a
    shard the trainer rewrote at the same size within one second for the basis's and hard-link it, and
    `--checksum` (the earlier guard) read every file on both sides before sending. The basis stays a
    `--copy-dest`, for delta transfer only: with `--ignore-times` no file is "unchanged", so none is copied or
    linked from it (rsync(1): `--copy-dest` "... If a match is not found, a basis file from one of the DIRs will be
    selected to try to speed up the transfer"). A file already whole in staging is not listed (resume); a partial
    one in `--partial-dir` is rsync's basis. The manifest (`manifest_bytes`, read by `_remote_manifest`) is written
    last, the bytes compared above."""
    files = _manifest_files(manifest_bytes, remote_path)
    stats = SyncStats("rsync", bytes_received=len(manifest_bytes))
    todo = stage_from_basis(files, staging, basis)
    delta = delta_basis(files, basis)
    largest = max((int(files[rel]["size"]) for rel in todo), default=0)
    stats.add(_rsync_files(target, trust, _remote_spec(target, remote_path) + "/", f"{staging}/", todo,
                           basis=str(delta.resolve()) if delta is not None else None, bwlimit_kib=bwlimit_kib,
                           what=what, grows=staging, stall_s=stall_limit_s(largest)))
    (staging / MANIFEST).write_bytes(manifest_bytes)  # last, as the trainer wrote it
    return stats


def _rsync_files(target: Target, trust: HostKeyTrust, src: str, dest: str, todo: Sequence[str], *,
                 basis: str | None, bwlimit_kib: int | None = None, what: str, grows: Path | None = None,
                 stall_s: float | None = None) -> SyncStats:
    """rsync exactly `todo` (paths relative to `src`) into `dest`, each file sent whatever the one there (no quick
    check: `--ignore-times`), as a delta against the same file in `basis` when given (a `--copy-dest`, relative to
    `dest` or absolute), resuming from `--partial-dir`. Nothing to send: no rsync at all."""
    if not todo:
        return SyncStats("rsync")
    args = ["--ignore-times", f"--partial-dir={RSYNC_PARTIAL_DIR}", "--files-from=-", "--from0"]
    args += [f"--copy-dest={basis}"] if basis is not None else []
    args += [f"--bwlimit={bwlimit_kib}"] if bwlimit_kib else []
    return _rsync(target, trust, [*args, src, dest], what=what, stdin="".join(f"{rel}\0" for rel in todo),
                  grows=grows, stall_s=stall_s)


def _sftp_pull_checkpoint(sftp: paramiko.SFTPClient, manifest_bytes: bytes, remote_path: str, staging: Path,
                          basis: Path | None, bwlimit_kib: int | None) -> SyncStats:
    stats = SyncStats("sftp")
    limit = _RateLimit(bwlimit_kib)
    stats.bytes_received += len(manifest_bytes)
    files = _manifest_files(manifest_bytes, remote_path)
    for rel in stage_from_basis(files, staging, basis):
        dest = staging / safe_relpath(rel)
        size = int(files[rel]["size"])
        have = dest.stat().st_size if dest.exists() else 0
        offset = have if have < size else 0
        with sftp.open(f"{remote_path}/{rel}", "rb") as remote, open(dest, "ab" if offset else "wb") as local:
            remote.seek(offset)
            # Never past the file's end: a file torn after its manifest was written (shorter than listed) made
            # paramiko's read-ahead fail the whole pull; copied as it is, verification rejects it.
            remote.prefetch(min(size, remote.stat().st_size or 0))
            while True:
                block = remote.read(_CHUNK)
                if not block:
                    break
                local.write(block)
                stats.bytes_received += len(block)
                limit.account(len(block))
        stats.files_transferred += 1
    (staging / MANIFEST).write_bytes(manifest_bytes)  # last, as the trainer wrote it
    return stats


def _sftp_append_files(sftp: paramiko.SFTPClient, remote_dir: str, names: Sequence[str], local: Path) -> SyncStats:
    """Each file's bytes past the end of the copy home, appended to it (the whole file when none is home)."""
    stats = SyncStats("sftp")
    for name in names:
        try:
            size = sftp.stat(f"{remote_dir}/{name}").st_size or 0
        except FileNotFoundError:
            continue
        dest = local / safe_relpath(name)
        have = dest.stat().st_size if dest.exists() else 0
        if have >= size:
            continue
        with sftp.open(f"{remote_dir}/{name}", "rb") as remote, open(dest, "ab") as out:
            remote.seek(have)
            remote.prefetch(size)  # up to the end, from the offset sought
            while block := remote.read(_CHUNK):
                out.write(block)
                stats.bytes_received += len(block)
        stats.files_transferred += 1
    return stats


def _sftp_get_files(sftp: paramiko.SFTPClient, remote_dir: str, names: Sequence[str], local: Path) -> SyncStats:
    stats = SyncStats("sftp")
    for name in names:
        remote = f"{remote_dir}/{name}"
        attrs = sftp.stat(remote)
        dest = local / safe_relpath(name)
        if dest.exists() and dest.stat().st_size == attrs.st_size and int(dest.stat().st_mtime) == attrs.st_mtime:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(f".{dest.name}.partial")
        sftp.get(remote, str(partial))
        os.utime(partial, (attrs.st_atime or 0, attrs.st_mtime or 0))
        os.replace(partial, dest)
        stats.bytes_received += attrs.st_size or 0
        stats.files_transferred += 1
    return stats


def _sftp_push_tree(sftp: paramiko.SFTPClient, local: Path, remote_dir: str, rules: Sequence[ExcludeRule], *,
                    manifest_last: bool = False) -> SyncStats:
    stats = SyncStats("sftp")
    _sftp_makedirs(sftp, remote_dir)
    deferred: list[tuple[Path, str]] = []
    for path, rel, is_dir in _pushed(local, rules):
        if is_dir:
            _sftp_makedirs(sftp, f"{remote_dir}/{rel}")
        elif manifest_last and rel == MANIFEST:
            deferred.append((path, f"{remote_dir}/{rel}"))
        else:
            _sftp_put_if_changed(sftp, path, f"{remote_dir}/{rel}", stats)
    for src, dest in deferred:
        _sftp_put_if_changed(sftp, src, dest, stats)
    return stats


def _sftp_put_if_changed(sftp: paramiko.SFTPClient, src: Path, dest: str, stats: SyncStats) -> None:
    st = src.lstat()
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            sftp.remove(dest)
        sftp.symlink(os.readlink(src), dest)
        return
    if not stat.S_ISREG(st.st_mode):
        return
    try:
        there = sftp.stat(dest)
        if there.st_size == st.st_size and there.st_mtime == int(st.st_mtime):
            return  # rsync's quick check: same size and mtime
    except FileNotFoundError:
        pass
    sftp.put(str(src), dest)
    sftp.chmod(dest, stat.S_IMODE(st.st_mode))
    sftp.utime(dest, (int(st.st_atime), int(st.st_mtime)))
    stats.bytes_sent += st.st_size
    stats.files_transferred += 1


def _sftp_makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
    """`mkdir -p` over SFTP, from the deepest folder that exists down: a server confined to a folder (a chroot, an
    SFTP sandbox) refuses to stat the ancestors outside it, `/` first."""
    missing: list[str] = []
    folder = PurePosixPath(path)
    while True:
        try:
            sftp.stat(str(folder))
            break
        except FileNotFoundError:
            missing.append(str(folder))
            if folder.parent == folder:
                break
            folder = folder.parent
    for name in reversed(missing):
        sftp.mkdir(name)


__all__ = [
    "STAGING_PREFIX",
    "ExcludeRule",
    "InstanceRunbooks",
    "PulledCheckpoints",
    "PushedCheckpoint",
    "SyncError",
    "SyncStats",
    "Transport",
    "choose_transport",
    "compile_excludes",
    "left_out",
    "pull_checkpoints",
    "push_checkpoint",
    "push_dir",
    "pushed_paths",
]
