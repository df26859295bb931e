"""`burstctl logs JOB`: what a job's command printed, on this machine or on a rented instance.

Every attempt's logs are in `<state>/runs/<attempt>/`: a local attempt writes them there; a cloud attempt's come home
at each checkpoint sync and at its end (`CloudSteps.pull_logs`), so they outlive the instance.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import click
from sqlalchemy import select

from orchestrator.app import App
from orchestrator.cli.base import cli, pass_app, say_config_problem_now
from orchestrator.cli.jobs import job_or_fail
from orchestrator.errors import BadInput, OperationalError
from orchestrator.lifecycle.homes import attempt_run_dir
from orchestrator.lifecycle.machine import AttemptState
from orchestrator.lifecycle.states import FINAL, JobState
from orchestrator.retention import LOGS_PRUNED_AT
from state import schema as s

FOLLOW_POLL_S = 0.5


def _attempts(app: App, job_id: str) -> list[dict[str, Any]]:
    with app.store.engine.connect() as c:
        return [dict(r) for r in c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id)
                                           .order_by(s.attempts.c.n)).mappings()]


def _tail(fh: BinaryIO, lines: int, size: int) -> int:
    """Where the last `lines` lines of a file of `size` bytes start, reading it backwards in blocks."""
    pos, found, block = size, 0, 64 * 1024
    while pos > 0:
        start = max(0, pos - block)
        fh.seek(start)
        chunk = fh.read(pos - start)
        # A final newline ends the last line, it does not start another.
        for i in range(len(chunk) - 1, -1, -1):
            if chunk[i] == 0x0A and start + i != size - 1:
                found += 1
                if found == lines:
                    return start + i + 1
        pos = start
    return 0


def _describe(att: dict[str, Any]) -> str:
    where = "local" if att["where"] == "local" else f"{att['provider']} {att['instance_type']} {att['market']}"
    return f"attempt {att['n']} ({where}, {att['state']})"


@cli.command("logs")
@click.argument("job")
@click.option("--attempt", "attempt_n", type=click.IntRange(min=1), default=None,
              help="The attempt's number (default: the newest that has run).")
@click.option("--stdout", "logs", flag_value="stdout.log", multiple=True, help="The command's stdout (the default).")
@click.option("--stderr", "logs", flag_value="stderr.log", multiple=True, help="The command's stderr.")
@click.option("--setup", "logs", flag_value="setup.log", multiple=True, help="The job's setup on the instance.")
@click.option("--supervisor", "logs", flag_value="supervisor.log", multiple=True,
              help="The supervisor's notes: start, stop, exit.")
@click.option("--tail", "lines", type=click.IntRange(min=0), default=None, help="Only the last N lines.")
@click.option("--follow", "-f", is_flag=True, help="Go on printing what the log gains until its attempt is over.")
@pass_app
def logs_cmd(app: App, job: str, attempt_n: int | None, logs: tuple[str, ...], lines: int | None,
             follow: bool) -> None:
    """Print a job's log: the newest attempt's stdout by default. A cloud attempt's logs are as they were at its
    last checkpoint sync while it runs, and whole once it has ended; they stay after the instance is gone."""
    if len(set(logs)) > 1:  # one log is printed: the others would be dropped without a word
        given = " and ".join(f"--{name.removesuffix('.log')}" for name in dict.fromkeys(logs))
        raise BadInput(f"{given} name {len(set(logs))} logs: expected one of --stdout, --stderr, --setup or "
                       "--supervisor")
    log = logs[0] if logs else "stdout.log"
    found = job_or_fail(app, job, newest=True)
    attempts = [a for a in _attempts(app, found["id"]) if a["started_at"] is not None]
    if attempt_n is not None:
        chosen = next((a for a in attempts if a["n"] == attempt_n), None)
        if chosen is None:
            ran = ", ".join(str(a["n"]) for a in attempts) or "none"
            raise BadInput(f"job {found['id']} has no attempt {attempt_n} that ran (attempts that ran: {ran})",
                           field="--attempt")
    elif attempts:
        chosen = attempts[-1]
    elif follow and JobState(found["state"]) not in FINAL:  # `enqueue` then `logs -f`: its first attempt is awaited
        click.echo(f"# {found['name']} ({found['id']}) is {found['state']}: waiting for its first attempt to start",
                   err=True)
        chosen = _first_attempt(app, found["id"])
    else:
        waits = " (`--follow` waits for its first attempt)" if JobState(found["state"]) not in FINAL else ""
        raise OperationalError(f"job {found['id']} ({found['state']}) has not run yet: no logs{waits}")
    path = attempt_run_dir(app.config, chosen["id"]) / log
    note = "" if chosen["where"] == "local" or AttemptState(chosen["state"]).final else \
        ", as of its last checkpoint sync"
    lost = (chosen["info"] or {}).get("checkpoint_lost")
    if lost:  # its log runs past the checkpoint the job went back to (`checkpoint.lost`)
        note += (f"; its checkpoint {lost['checkpoint']} was lost with its instance, the job went back to "
                 f"{lost.get('resumes_from') or 'the start'}")
    click.echo(f"# {found['name']} ({found['id']}), {_describe(chosen)}: {log}{note}", err=True)
    _print(app, chosen, path, lines, follow)


def _first_attempt(app: App, job_id: str) -> dict[str, Any]:
    """The job's first attempt once it has started; an error if the job ends without one."""
    while True:
        time.sleep(FOLLOW_POLL_S)
        started = [a for a in _attempts(app, job_id) if a["started_at"] is not None]
        if started:
            return started[0]
        job = app.store.get_job(job_id) or {"state": JobState.CANCELLED.value}
        if JobState(job["state"]) in FINAL:
            raise OperationalError(f"job {job_id} ended {job['state']} without running: no logs")


def _print(app: App, att: dict[str, Any], path: Path, lines: int | None, follow: bool) -> None:
    if path.exists():
        size = path.stat().st_size
        if lines is None:
            pos = 0
        elif lines == 0:
            pos = size
        else:
            with open(path, "rb") as fh:
                pos = _tail(fh, lines, size)
        pos = _copy_from(path, pos)
    elif not follow:
        pruned = (att["info"] or {}).get(LOGS_PRUNED_AT)
        click.echo(f"(no {path.name} for this attempt{' yet' if not AttemptState(att['state']).final else ''}"
                   + (f": its logs were deleted on {datetime.fromtimestamp(pruned).astimezone():%Y-%m-%d} with "
                      "the job's events (state.events_keep_days, or prune-events)"
                      if pruned else "") + ")", err=True)
        return
    else:
        pos = 0
    if not follow:
        return
    say_config_problem_now(app)
    try:
        while True:
            over = _over(app, att["id"])  # read before the file: what the attempt wrote before it ended is printed
            if path.exists() and path.stat().st_size > pos:
                pos = _copy_from(path, pos)
            if over:
                return
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return


def _copy_from(path: Path, pos: int) -> int:
    """The file's bytes from `pos` on, to stdout as they are; where it ended."""
    out = sys.stdout.buffer
    with open(path, "rb") as fh:
        fh.seek(pos)
        while block := fh.read(1 << 20):
            out.write(block)
            pos += len(block)
    out.flush()
    return pos


def _over(app: App, attempt_id: str) -> bool:
    with app.store.engine.connect() as c:
        state = c.execute(select(s.attempts.c.state).where(s.attempts.c.id == attempt_id)).scalar()
    return state is None or AttemptState(state).final
