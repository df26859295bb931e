"""`burstctl daemon`."""

from __future__ import annotations

import sys

import click

from orchestrator.app import App
from orchestrator.cli.base import FiniteFloat, cli, pass_app
from orchestrator.daemon import run_daemon


@cli.command("daemon")
@click.option("--tick", "tick_s", type=FiniteFloat(min=0.05), default=None,
              help="Reconcile tick in seconds (default from config, 5).")
@click.option("--max-ticks", type=click.IntRange(min=1), default=None, help="Stop after this many ticks.")
@click.option("--exit-when-idle", is_flag=True, help="Stop once no job is queued or running.")
@pass_app
def daemon_cmd(app: App, tick_s: float | None, max_ticks: int | None, exit_when_idle: bool) -> None:
    """Run the orchestrator: take queued jobs, run them locally or in the cloud, until SIGTERM.

    Logs go to stderr (readable) and to <state>/events.jsonl (JSON lines)."""
    app.console = sys.stderr
    run_daemon(app, tick_s=tick_s, max_ticks=max_ticks, exit_when_idle=exit_when_idle)
