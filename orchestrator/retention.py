"""How long a finished job's history is kept: `burstctl prune-events` and `state.events_keep_days`.

The history is the events table, the trail of every decision, launch, sync and provider retry (some 130 rows per
cloud job, never read back by the daemon for a job that is over), and each attempt's logs in `<state>/runs/`
(a cloud run's stdout comes home whole: tens of MB for a chatty trainer). Months of both make gigabytes. What is
pruned is only the history of jobs finished (done, failed, cancelled, rethink) and last changed longer ago than the
limit, with nothing of theirs still live (an attempt not over, an instance not confirmed gone, an open ledger
charge), and the events of no job (daemon, provider, sweep) as old. The jobs, attempts, instances, the ledger (the
month's spend and the budget cap are computed from it alone), measurements, spot listings, decision records
(markdown files) and a job's `outputs` (its results) are never touched.

Checkpoints are pruned apart (`state.checkpoints_keep_days`, `prune-events --checkpoints`), and only those of jobs
done: a failed or cancelled job may still be retried from its own. A done job keeps only its newest one from the
moment it is done (`checkpoints.trim_done`); a weekly fine-tune of a 7B model still leaves one of ~15 GB a week.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Collection
from pathlib import Path
from typing import TypedDict

from orchestrator.app import App
from orchestrator.lifecycle import checkpoints
from orchestrator.lifecycle.homes import runs_dir
from orchestrator.lifecycle.machine import ACTIVE_ATTEMPT_STATES
from orchestrator.lifecycle.states import FINAL, JobState

DAY_S = 86400.0
PRUNED_AT = "events_pruned_at"  # settings key: when the daemon last pruned (it prunes at most once a day)
LOGS_PRUNED_AT = "logs_pruned_at"  # attempts.info key: when the attempt's logs were deleted (`burstctl logs` says)


class PruneCounts(TypedDict):
    """What a prune deleted."""

    finished_jobs: int  # the jobs whose history is gone now
    events: int  # events deleted
    run_dirs: int  # attempts' log directories deleted
    run_bytes: int  # what those held


def prune_events(app: App, older_than_days: float, now: float | None = None, *,
                 keep_logs: bool = False) -> PruneCounts:
    """Delete the events, and unless `keep_logs` the attempts' logs, of jobs over more than `older_than_days` ago."""
    now = time.time() if now is None else now
    cutoff = now - older_than_days * DAY_S
    job_ids = app.store.jobs_over_before(cutoff, final_states=sorted(st.value for st in FINAL),
                                         active_attempt_states=ACTIVE_ATTEMPT_STATES)
    done: PruneCounts = {"finished_jobs": len(job_ids),
                         "events": app.store.delete_events(job_ids, no_job_before=cutoff),
                         "run_dirs": 0, "run_bytes": 0}
    if not keep_logs:
        removed, done["run_bytes"] = _remove_run_dirs(runs_dir(app.config), set(job_ids))
        done["run_dirs"] = len(removed)
        app.store.mark_attempts(removed, LOGS_PRUNED_AT, now)
    app.store.set_setting(PRUNED_AT, now)
    return done


def _remove_run_dirs(runs: Path, job_ids: Collection[str]) -> tuple[list[str], int]:
    """Delete the run directories (`<job>-a<N>`) of these jobs: one listing of `runs`, however many jobs there are
    (each prune looks at every job ever over, and most have nothing left). Returns their attempt ids and bytes."""
    removed: list[str] = []
    freed = 0
    try:
        entries = list(os.scandir(runs))
    except FileNotFoundError:
        return removed, freed
    for entry in entries:
        job_id, sep, n = entry.name.rpartition("-a")
        if not (sep and n.isdigit() and job_id in job_ids and entry.is_dir(follow_symlinks=False)):
            continue
        freed += _tree_bytes(entry.path)
        shutil.rmtree(entry.path)
        removed.append(entry.name)
    return removed, freed


class CheckpointCounts(TypedDict):
    """What a prune of checkpoints deleted."""

    checkpoint_dirs: int  # done jobs whose checkpoints are gone now
    checkpoint_bytes: int  # what they held


def prune_checkpoints(app: App, older_than_days: float, now: float | None = None) -> CheckpointCounts:
    """Delete the checkpoints of jobs done more than `older_than_days` ago with nothing of theirs live."""
    now = time.time() if now is None else now
    job_ids = app.store.jobs_over_before(now - older_than_days * DAY_S, final_states=[JobState.DONE.value],
                                         active_attempt_states=ACTIVE_ATTEMPT_STATES)
    try:  # one listing, however many jobs were ever done (most have nothing left)
        present = set(os.listdir(app.config.state_dir / "checkpoints"))
    except FileNotFoundError:
        present = set()
    removed = freed = 0
    for job_id in present.intersection(job_ids):
        store = checkpoints.store_dir(app.config, job_id)
        with checkpoints.store_lock(app.config, job_id):
            freed += _tree_bytes(store)
            shutil.rmtree(store)
        removed += 1
    return {"checkpoint_dirs": removed, "checkpoint_bytes": freed}


def _tree_bytes(path: Path | str) -> int:
    return sum(os.lstat(os.path.join(root, f)).st_size for root, _, files in os.walk(path) for f in files)


def prune_if_due(app: App, now: float | None = None) -> PruneCounts | None:
    """The daemon's sweep: prune by `state.events_keep_days` and `state.checkpoints_keep_days` once a day (never with
    both unset)."""
    keep, keep_checkpoints = app.config.state.events_keep_days, app.config.state.checkpoints_keep_days
    now = time.time() if now is None else now
    if (keep is None and keep_checkpoints is None) or now - float(app.store.get_setting(PRUNED_AT, 0.0)) < DAY_S:
        return None
    done: PruneCounts = {"finished_jobs": 0, "events": 0, "run_dirs": 0, "run_bytes": 0}
    if keep is not None:
        done = prune_events(app, keep, now)
        if done["events"] or done["run_dirs"]:
            app.events.emit("state.events_pruned", older_than_days=keep, **done)
    if keep_checkpoints is not None:
        gone = prune_checkpoints(app, keep_checkpoints, now)
        if gone["checkpoint_dirs"]:
            app.events.emit("state.checkpoints_pruned", older_than_days=keep_checkpoints, **gone)
    app.store.set_setting(PRUNED_AT, now)
    return done
