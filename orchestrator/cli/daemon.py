"""`burstctl daemon`."""

from __future__ import annotations

import sys

import click

from orchestrator.app import App
from orchestrator.cli.base import FiniteFloat, cli, pass_app
from orchestrator.daemon import run_daemon
from orchestrator.errors import BadInput


@cli.command("daemon")
@click.option("--tick", "tick_s", type=FiniteFloat(min=0.05, max=600), default=None,
              help="Reconcile tick in seconds (default from config, 5).")
@click.option("--max-ticks", type=click.IntRange(min=1), default=None, help="Stop after this many ticks.")
@click.option("--exit-when-idle", is_flag=True, help="Stop once no job is queued or running.")
@click.option("--verbose", is_flag=True,
              help="Show on stderr every provider call, those that succeeded first time too (one a tick per running "
                   "instance); they are never kept in the trail.")
@pass_app
def daemon_cmd(app: App, tick_s: float | None, max_ticks: int | None, exit_when_idle: bool, verbose: bool) -> None:
    """Run the orchestrator: take queued jobs, run them locally or in the cloud, until SIGTERM.

    Logs go to stderr (readable) and to <state>/events.jsonl (JSON lines)."""
    if tick_s is not None and (too_close := app.config.schedule_slots_closer_than(tick_s, "--tick")) is not None:
        raise BadInput(str(too_close), source=app.config.source or "config", field=too_close.field)
    app.console = sys.stderr
    app.routine_calls = verbose
    run_daemon(app, tick_s=tick_s, max_ticks=max_ticks, exit_when_idle=exit_when_idle)
