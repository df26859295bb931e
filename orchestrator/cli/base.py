"""The `burstctl` command group and the conventions every command follows.

- Human tables by default (rich, `output.table`), `--json` for scripts (`output.print_json`).
- Exit 0 on success, 1 on an operational failure, 2 on bad input: always one line on stderr, no traceback.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from orchestrator.errors import BadInput

if TYPE_CHECKING:
    from orchestrator.app import App

F = TypeVar("F", bound=Callable[..., Any])


# Each command's module, imported only when that command runs: a command then loads what it needs and no more.
# `burstctl list` or `status` starts in about 0.6 of the time it took to import every command's module, with the
# decision core, the simulator and the providers' SDKs (benchmarks/cli_start.py).
COMMAND_MODULES = {
    "approve": "jobs", "budget": "jobs", "cancel": "jobs", "enqueue": "jobs", "events": "jobs", "list": "jobs",
    "retry": "jobs", "show": "jobs", "decide": "decide", "size": "size", "simulate": "simulate", "daemon": "daemon",
    "status": "status", "providers": "providers", "revert-local": "revert", "burst-enable": "revert",
    "copy-state": "state", "prune-events": "state", "simcloud": "simcloud", "rehearse": "rehearse", "demo": "demo",
    "report": "report", "logs": "logs", "schedules": "schedules",
    "notify-test": "notify", "ssh": "shell", "confirm-gone": "gone",
}

# Each command's line in `burstctl --help`, so that listing them imports none (the docstring is the long help).
COMMAND_SUMMARIES = {
    "approve": "Approve the price of a job's deadline.",
    "budget": "Month-to-date spend and the cycles the budget has left.",
    "burst-enable": "Lift the kill switch: queued jobs may burst again.",
    "cancel": "Cancel a job that has not finished.",
    "confirm-gone": "Say an instance is gone when its provider never will.",
    "copy-state": "Copy the whole state into an unused database.",
    "daemon": "Run the orchestrator.",
    "decide": "Run the two gates on a job and print the verdict.",
    "demo": "Play the whole story on the simulated cloud.",
    "enqueue": "Validate, decide and queue a job.",
    "events": "Print the event log, or follow it.",
    "list": "List jobs, oldest first.",
    "logs": "Print a job's log, local or cloud (brought home).",
    "notify-test": "Send a test notice through the [[notify]] notifiers.",
    "prune-events": "Delete the events of jobs finished long ago.",
    "providers": "Configured providers: credentials, answering, offers.",
    "rehearse": "Run a job on a private simulated cloud with preemptions.",
    "report": "Finished jobs: what each was expected to cost and take, and did.",
    "retry": "Queue a failed, cancelled or rethink job again, from its newest checkpoint.",
    "revert-local": "Go back to local-only in one command.",
    "schedules": "Jobs queued on a schedule: next slot, last cycle.",
    "show": "Show one job: its decision, state and recent events.",
    "simcloud": "The embedded simulated cloud.",
    "simulate": "Replay spot/on-demand policies against real spot traces.",
    "size": "Estimate a job's training memory and the GPUs it fits.",
    "ssh": "Log in to the instance a job runs on, or run a command there.",
    "status": "Whether the daemon runs, the mode, active jobs and spend.",
}


class FiniteFloat(click.FloatRange):
    """A float option in a range that is a number: click's FloatRange lets nan (which compares false with every
    bound) and inf (unless a max is given) through."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        got = super().convert(value, param, ctx)
        if not math.isfinite(got):
            self.fail(f"expected a finite number, got {value}", param, ctx)
        return got


class LazyGroup(click.Group):
    """A group whose commands register themselves on it when their module (`COMMAND_MODULES`) is imported."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMAND_MODULES))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMAND_MODULES:
            importlib.import_module(f"orchestrator.cli.{COMMAND_MODULES[cmd_name]}")
        return super().get_command(ctx, cmd_name)

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        name = name or cmd.name
        if cmd.short_help is None and name in COMMAND_SUMMARIES:
            cmd.short_help = COMMAND_SUMMARIES[name]
        super().add_command(cmd, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMAND_SUMMARIES[name]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


# The commands that only read the state, and revert-local (which sets the kill switch): they still run on a config
# file that does not validate, and end with its problem (`App.state_only`).
STATE_READERS = {"status", "list", "show", "events", "logs", "revert-local"}


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--config", "config_path", type=str, default=None, help="Config file (else $BURSTCTL_CONFIG, "
              "./burstctl.toml, ~/.config/burstctl/config.toml, built-in defaults).")
@click.option("--state-dir", type=str, default=None, help="Override the state directory.")
@click.version_option(package_name="burstctl")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, state_dir: str | None) -> None:
    """burstctl: decide whether each training job runs locally or bursts to a rented GPU, then run it."""
    # Here, not at the top: the config's models and the database layer, which --version and --help never need.
    from orchestrator.app import App

    for flag, value in (("--config", config_path), ("--state-dir", state_dir)):
        if value is not None and not value.strip():  # a script's unset variable: not the defaults, said
            raise BadInput("is empty: expected a path", field=flag)
    app = App(config_path=config_path, state_dir_override=state_dir, says_notes=True,
              state_only=ctx.invoked_subcommand in STATE_READERS)
    ctx.obj = app
    ctx.call_on_close(app.close)


def say_config_problem_now(app: App) -> None:
    """Before a --follow, which ends only when interrupted: the config file's problem on stderr now too."""
    if app.config_problem is not None:
        click.echo(f"burstctl: note: {app.config_problem}; following the state alone", err=True)


@cli.result_callback()
@click.pass_context
def said_config_problem(ctx: click.Context, *_: Any, **__: Any) -> None:
    """A state reader that ran on a config file that does not validate ends with the file's problem (exit 2)."""
    app: App | None = ctx.obj
    problem = app.config_problem if app is not None and app.state_only else None
    if app is not None and problem is not None:
        raise BadInput(f"{problem.detail}; what is above was read from the state alone{_daemons_clause(app)}",
                       source=problem.source, field=problem.field)


def _daemons_clause(app: App) -> str:
    """What the daemon makes of the file: said only when one runs on this very file."""
    from orchestrator.daemon import CONFIG_SEEN_KEY, running_daemon

    seen = (app.store.get_setting(CONFIG_SEEN_KEY) or {}).get("source")
    same = bool(seen and app.config.source and Path(seen).resolve() == Path(app.config.source).resolve())
    return ", and the running daemon keeps the settings it last read" if same and running_daemon(app) else ""


# The group's App (`ctx.obj`, which every subcommand's context inherits).
pass_app = click.pass_obj


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")(f)
