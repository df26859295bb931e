"""`burstctl ssh`: a shell, or one command, on the instance a job's cloud attempt runs on."""

from __future__ import annotations

import shlex
import subprocess
import sys
from typing import Any

import click
from sqlalchemy import select

from orchestrator.app import App
from orchestrator.cli.base import cli, pass_app
from orchestrator.cli.jobs import job_or_fail
from orchestrator.errors import OperationalError
from orchestrator.lifecycle.machine import AttemptState
from state import schema as s

A = AttemptState
# States in which an attempt's instance is up and bootstrapped far enough to log in to (its host and port known).
LOGGED_IN_STATES = (A.BOOTSTRAPPING.value, A.RUNNING.value, A.FINISHING.value)


@cli.command("ssh", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--job-env", is_flag=True,
              help="Set the job's environment in the session or for COMMAND: its env and pass_env values and "
                   "BURST_WORK_UNITS, as its trainer gets them (not the run's BURST_CHECKPOINT_DIR and the other "
                   "contract variables, so a trial run writes nothing the daemon takes for the job's).")
@click.argument("job")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@pass_app
def ssh_cmd(app: App, job_env: bool, job: str, command: tuple[str, ...]) -> None:
    """Log in to the instance JOB's cloud attempt runs on, in the job's workdir there; or run COMMAND there
    (`burstctl ssh JOB -- nvidia-smi`), exiting with its status. Its words arrive as given; one word with spaces
    is run by a shell, as ssh does (`burstctl ssh JOB -- 'nvidia-smi; df -h'`).

    The daemon's own key and the instance's pinned host key (a changed one is refused, never trusted). Without
    --job-env the job's env values are not set: they stay in the run's private env file on the instance.
    """
    if command[:1] == ("--job-env",):  # given after JOB, where click leaves everything to COMMAND
        job_env, command = True, command[1:]
    if command[:1] == ("--",):  # click passes it on to an argument that takes everything unprocessed
        command = command[1:]
    found = job_or_fail(app, job, newest=True)
    att = _logged_in_attempt(app, found)
    from orchestrator.lifecycle.cloud_steps import CloudSteps, DbHostKeyTrust
    from orchestrator.lifecycle.service import transfers_dir
    from orchestrator.remote.ssh import keep_known_hosts_in, pinned_ssh_argv

    target = CloudSteps(app, {}).target(att)
    workdir = f"burst/{found['id']}/work"  # under the login's home (cloud_steps' remote layout)
    wrap = _with_job_env(found, att) if job_env else ""
    if len(command) == 1 and any(c.isspace() for c in command[0]):
        # One word with spaces is a command line, as ssh runs it (`burstctl ssh JOB -- 'nvidia-smi; df -h'`): by a
        # shell, not as the name of a program with spaces in it.
        command = ("sh", "-c", command[0])
    if command:
        remote = f"cd {shlex.quote(workdir)} && {wrap}{shlex.join(command)}"
    else:
        remote = f'cd {shlex.quote(workdir)} 2>/dev/null; exec {wrap}"${{SHELL:-/bin/sh}}" -l'
    click.echo(f"# {found['name']} ({found['id']}), attempt {att['n']} on {att['provider']} "
               f"{att['instance_type']} ({att['market']}), instance {att['instance_id']}", err=True)
    keep_known_hosts_in(transfers_dir(app))  # the session's known_hosts file, where the next daemon finds it
    with pinned_ssh_argv(target, DbHostKeyTrust(app, att["provider"], att)) as argv:
        tty = ["-t"] if not command and sys.stdin.isatty() else []
        # Not exec: the known_hosts file is removed once ssh ends.
        code = subprocess.call([*argv, *tty, target.host, remote])
    raise click.exceptions.Exit(code)


def _with_job_env(job: dict[str, Any], att: dict[str, Any]) -> str:
    """The prefix that runs a command with the attempt's env file added (`supervisor.py with-env`, with the
    interpreter the bootstrap found), shell-quoted; why not, before the bootstrap has written that file."""
    info = att["info"]
    if not info.get("remote_run"):
        raise OperationalError(f"job {job['id']}'s attempt {att['n']} is {att['state']}: its env file is written "
                               "once the bootstrap has started the job; try --job-env again then")
    python = info.get("remote_python", "python3")  # attempts bootstrapped before it was recorded ran python3
    return shlex.join([python, f"{info['remote_base']}/runbooks/supervisor.py", "with-env",
                       "--env-file", f"{info['remote_run']}/job.env", "--"]) + " "


def _logged_in_attempt(app: App, job: dict[str, Any]) -> dict[str, Any]:
    """The job's cloud attempt whose instance can be logged in to: the one running it, else the newest that is up
    (a successor bootstrapping beside it waits to take over). Else why there is none."""
    with app.store.engine.connect() as c:
        rows = [dict(r) for r in c.execute(select(s.attempts).where(s.attempts.c.job_id == job["id"])
                                           .order_by(s.attempts.c.n.desc())).mappings()]
    up = [a for a in rows if a["where"] == "cloud" and a["state"] in LOGGED_IN_STATES and a["info"].get("host")]
    if up:
        return min(up, key=lambda a: (a["state"] != A.RUNNING.value, -a["n"]))
    local = next((a for a in rows if a["where"] == "local" and not A(a["state"]).final), None)
    if local is not None:
        raise OperationalError(f"job {job['id']} runs locally (attempt {local['n']}, {local['state']}): no instance "
                               f"to log in to; its workdir is {job['spec'].get('workdir')}")
    coming = next((a for a in rows if a["where"] == "cloud" and not A(a["state"]).final), None)
    if coming is not None:
        raise OperationalError(f"job {job['id']}'s attempt {coming['n']} on {coming['provider']} is "
                               f"{coming['state']}: its instance cannot be logged in to yet; try again once it is "
                               "bootstrapping or running")
    raise OperationalError(f"job {job['id']} ({job['state']}) has no cloud instance up")
