"""`burstctl copy-state`: move this installation's state to another database (e.g. SQLite to PostgreSQL);
`burstctl prune-events`: drop the history of jobs finished long ago (orchestrator/retention.py)."""

from __future__ import annotations

from pathlib import Path

import click
from pydantic import ValidationError
from rich.markup import escape
from sqlalchemy import make_url

from orchestrator.app import App, open_store
from orchestrator.cli.base import FiniteFloat, cli, json_option, pass_app
from orchestrator.cli.output import out, print_json, table
from orchestrator.config import StateSettings
from orchestrator.daemon import running_daemon
from orchestrator.errors import BadInput, OperationalError, format_validation_error


@cli.command("copy-state")
@click.option("--to", "url", required=True, metavar="URL",
              help="SQLAlchemy URL of a database burstctl has not used, e.g. postgresql+psycopg://burst@db/burstctl "
                   "(no password: PGPASSWORD or ~/.pgpass).")
@json_option
@pass_app
def copy_state_cmd(app: App, url: str, as_json: bool) -> None:
    """Copy the whole state (jobs, attempts, instances, events, the ledger, measurements, spot listings, settings)
    into another database, ids kept, then point `[state] database_url` at it. The ledger comes along, so the month's
    spend and the budget cap carry over. The daemon must be stopped; the source is not changed."""
    try:
        StateSettings.model_validate({"database_url": url})
    except ValidationError as exc:
        raise format_validation_error(exc, "--to") from None
    if url == app.config.database_url:
        raise BadInput("is the database in use now: name another one", source="--to")
    daemon = running_daemon(app)
    if daemon is not None:
        pid = f" (pid {daemon['pid']})" if daemon["pid"] else ""
        raise OperationalError(f"a daemon is running{pid}: stop it first, so that nothing changes while the state is "
                               "copied")
    sqlite = make_url(url)
    if sqlite.get_backend_name() == "sqlite" and sqlite.database and not Path(sqlite.database).parent.is_dir():
        # A typo in the path would otherwise make the directories it names.
        raise BadInput(f"directory '{Path(sqlite.database).parent}' does not exist; expected a SQLite file in an "
                       "existing directory", source="--to")
    target = open_store(url, "--to")
    try:
        if target.holds_data():
            raise BadInput("the database already holds burstctl data: copy-state only fills an unused one",
                           source="--to")
        copied = app.store.copy_to(target)
    finally:
        target.close()
    if as_json:
        print_json({"copied": copied})
        return
    table("rows copied", ["table", "rows"], sorted(copied.items()))
    out.print(escape("now set [state] database_url to it in the config; the old database is unchanged"))


@cli.command("prune-events")
@click.option("--older-than", "days", required=True, type=FiniteFloat(min=0), metavar="DAYS",
              help="Delete the history of jobs finished (and last changed) more than DAYS days ago.")
@click.option("--keep-logs", is_flag=True, help="Delete only their events; keep their attempts' logs.")
@click.option("--checkpoints", is_flag=True, help="Also delete the checkpoints of the jobs among them that are done "
              "(a failed or cancelled job's stay: `burstctl retry` resumes from them).")
@click.option("--vacuum", is_flag=True, help="Then give the space back to the file system (SQLite VACUUM: the "
              "daemon must be stopped; needs as much free space as the database).")
@json_option
@pass_app
def prune_events_cmd(app: App, days: float, keep_logs: bool, checkpoints: bool, vacuum: bool, as_json: bool) -> None:
    """Delete the events and the attempts' logs (<state>/runs/) of jobs finished more than DAYS ago with nothing of
    theirs live (an attempt not over, an instance not confirmed gone, an open charge), and events of no job as
    old; with --checkpoints, the checkpoints of those done too. Jobs, attempts, the ledger (the month's spend and the
    budget cap), measurements, decision records and outputs stay. Safe beside a running daemon (short transactions);
    the freed space is reused by new events, or given back with --vacuum."""
    from orchestrator.retention import CheckpointCounts, prune_checkpoints, prune_events

    if vacuum:
        daemon = running_daemon(app)
        if daemon is not None:
            pid = f" (pid {daemon['pid']})" if daemon["pid"] else ""
            raise OperationalError(f"a daemon is running{pid}: stop it for --vacuum, which locks the database while "
                                   "it rewrites it (or prune without --vacuum: the space is reused)")
    done = prune_events(app, days, keep_logs=keep_logs)
    gone: CheckpointCounts | None = prune_checkpoints(app, days) if checkpoints else None
    if vacuum:
        app.store.compact()
    if as_json:
        print_json({**done, **(gone or {}), "vacuumed": vacuum and app.store.is_sqlite})
        return
    logs = "" if keep_logs else f", {done['run_dirs']} attempts' logs deleted ({done['run_bytes'] / 2**20:.1f} MiB)"
    if gone is not None:
        logs += (f", the checkpoints of {gone['checkpoint_dirs']} done jobs deleted "
                 f"({gone['checkpoint_bytes'] / 2**30:.2f} GiB)")
    out.print(f"{done['events']} events deleted{logs} ({done['finished_jobs']} jobs finished more than {days:g} days "
              "ago keep their job, attempts and ledger rows)" + ("; database compacted" if vacuum and
                                                                 app.store.is_sqlite else ""))
