"""`burstctl revert-local` and `burstctl burst-enable`: the kill switch, on and off."""

from __future__ import annotations

import click

from orchestrator.app import App
from orchestrator.cli.base import FiniteFloat, cli, json_option, pass_app
from orchestrator.cli.output import out, print_json, table
from orchestrator.daemon import running_daemon
from orchestrator.errors import OperationalError
from orchestrator.lifecycle.revert import held_for_released, restore_plans, revert_local, set_burst_enabled
from orchestrator.lifecycle.service import build_reconciler


def _named(app: App, job_ids: list[str]) -> str:
    """Jobs as a person knows them: "name (id)"."""
    jobs = {j: app.store.get_job(j) for j in job_ids}
    return ", ".join(f"{job['name']} ({j})" if job else j for j, job in jobs.items())


@cli.command("revert-local")
@click.option("--timeout", "timeout_s", type=FiniteFloat(min=1), default=None,
              help="Bound on waiting for the last checkpoints and terminations (a last pull under way then is let "
                   "finish, and its instance goes after it). Default: 180 s, or a running job's "
                   "checkpoint.stop_grace_s and 150 s when that is longer.")
@click.option("--resume-from-home", is_flag=True,
              help="A job whose cloud provider does not answer its terminate comes home anyway, from the newest "
                   "checkpoint home, even when its run there did not stop or its newest checkpoint is still there "
                   "(that work is given up). Without it such a job waits, saying so.")
@json_option
@pass_app
def revert_local_cmd(app: App, timeout_s: float | None, resume_from_home: bool, as_json: bool) -> None:
    """Go back to local-only in one command: stop launching, bring checkpoints home, terminate every owned
    instance (orphans too), requeue bursted jobs locally. A job whose provider cannot confirm its instance gone comes
    home once its run has stopped and its newest checkpoint is home; the instance is terminated in the background.
    Works with or without the daemon running: a running daemon winds its cloud attempts down itself at its next tick,
    and this waits for it.

    Exit 0 when every owned instance is confirmed gone, 1 otherwise (naming what is left, and every enabled provider
    this shell could not ask, e.g. without its API key)."""
    if app.config_problem is not None:
        _switch_only(app, as_json)
    reconciler = build_reconciler(app)
    daemon = running_daemon(app)
    try:
        report = revert_local(app, reconciler, timeout_s=timeout_s, daemon_running=daemon is not None,
                              resume_from_home=resume_from_home)
    finally:  # every last sync has been taken by now, unless revert_local failed: nothing is left running then
        reconciler.close(wait_s=0)
    if as_json:
        print_json(report.as_dict())
    else:
        out.print("[bold]mode: local-only[/bold] — nothing will be launched until `burstctl burst-enable`")
        if report.rows:
            table("instances", ["job", "checkpoint synced", "provider", "instance", "terminated"],
                  [(r.job or "—", r.checkpoint or "—", r.provider, r.instance or "—", r.terminated)
                   for r in report.rows])
        else:
            out.print("no instance was running" if not report.not_swept and not report.unreachable
                      else "no instance found on the providers that answered")
        if report.finished:
            out.print(f"finished (their run had ended; final checkpoint and outputs home): "
                      f"{_named(app, report.finished)}")
        if report.requeued_local:
            out.print(f"requeued locally: {_named(app, report.requeued_local)}")
        if report.already_local:
            out.print(f"queued locally by an earlier revert-local: {_named(app, report.already_local)}")
        if report.held:
            out.print(f"held until `burstctl burst-enable` (they do not fit locally): {_named(app, report.held)}")
        for job_id, why in report.not_home.items():
            out.print(f"not moved home: {_named(app, [job_id])}: its provider does not answer, and {why}")
        if report.daemon_winding_down:
            out.print(f"the running daemon is still winding down: {', '.join(report.daemon_winding_down)} "
                      "(`burstctl status`; run revert-local again to confirm)")
        for name, why in report.not_swept.items():
            out.print(f"{name}: not asked what runs there: {why}")
        for name, why in report.daemon_sweeps.items():
            out.print(f"{name}: not asked from here ({why}); the running daemon, which uses it, sweeps it")
        for name, why in report.nothing_there.items():
            out.print(f"{name}: not asked ({why}), and nothing of this installation's can run there")
        for name in report.unreachable:
            out.print(f"{name}: its sweep failed, so what runs there is not known (`burstctl events`: "
                      "provider.unreachable)")
    problems = [f"{r.provider}:{r.instance} ({r.terminated})" for r in report.left]
    problems += [f"{name} not swept ({why})" for name, why in report.not_swept.items()]
    problems += [f"{name} unreachable" for name in report.unreachable]
    if problems:
        raise OperationalError(f"not confirmed gone: {'; '.join(problems)}; a running daemon keeps sweeping with "
                               "its own credentials (`burstctl status`), or run revert-local where they are set; an "
                               "instance whose provider will never answer again and that you have seen gone in its "
                               "console: `burstctl confirm-gone PROVIDER INSTANCE_ID`")


def _switch_only(app: App, as_json: bool) -> None:
    """On a config file that does not validate: the kill switch alone. Which providers, credentials and instances
    are the user's is in that file, so nothing is wound down from here; a running daemon does it on the settings it
    last read, as it would for any revert-local."""
    set_burst_enabled(app, False, "revert-local")
    daemon = running_daemon(app)
    if as_json:
        print_json({"mode": "local-only", "switch_only": True, "config_problem": str(app.config_problem),
                    "daemon": daemon})
    where = f" on {daemon['host']}" if daemon and daemon.get("host") else ""
    who = (f"the running daemon (pid {daemon['pid']}{where}) brings its cloud attempts home on the settings it last "
           "read" if daemon else "no daemon is running to bring cloud attempts home")
    raise OperationalError(f"the kill switch is set: nothing will be launched; this shell wound nothing down and swept "
                           f"no provider, because {app.config_problem}; {who}: fix the file and run revert-local "
                           "again to confirm every instance is gone")


@cli.command("burst-enable")
@json_option
@pass_app
def burst_enable_cmd(app: App, as_json: bool) -> None:
    """Lift the kill switch: queued jobs may burst again, and those revert-local requeued locally that have not
    started there go back to their cloud or hybrid plan. A job whose instance from before revert-local is not yet
    confirmed gone (its provider did not answer the terminate) is not launched in the cloud again until it is: it
    runs here meanwhile, or waits, and goes back to its plan then."""
    changed = set_burst_enabled(app, True, "burst-enable")
    restored = restore_plans(app)
    held = held_for_released(app)
    if as_json:
        print_json({"mode": "burst-enabled", "changed": changed, "restored": restored,
                    "held_for_released_instance": held})
    else:
        out.print("mode: burst-enabled" + ("" if changed else " (it already was)"))
        if restored:
            out.print(f"back to their plans: {', '.join(restored)}")
        for job_id, why in held.items():
            out.print(f"not launched in the cloud yet: {_named(app, [job_id])}: {why}")
