"""`burstctl notify-test`: send a test notice through the [[notify]] notifiers, now, and say what each did."""

from __future__ import annotations

import socket
import time

import click

from orchestrator.app import App
from orchestrator.cli.base import cli, json_option, pass_app
from orchestrator.cli.output import out, print_json, table
from orchestrator.errors import BadInput, OperationalError
from orchestrator.notify import DeliveryFailed, deliver, trial_notice


@cli.command("notify-test")
@click.option("--name", "names", multiple=True, help="Only this notifier (repeat for several); default: all.")
@json_option
@pass_app
def notify_test_cmd(app: App, names: tuple[str, ...], as_json: bool) -> None:
    """Send a test notice through each [[notify]] notifier, from this shell's environment (the daemon's may differ:
    a webhook's url_env must be set in both). No event is delivered or skipped by it.

    Exit 0 when every notifier delivered it, 1 otherwise."""
    targets = app.config.notify
    where = f"{app.config.source}: " if app.config.source else ""
    if not targets:
        raise BadInput(f"{where}no [[notify]] table: nothing to test")
    unknown = sorted(set(names) - {t.name for t in targets})
    if unknown:
        raise BadInput(f"no notifier named {', '.join(unknown)} (configured: {', '.join(t.name for t in targets)})",
                       field="--name")
    payload = trial_notice(socket.gethostname(), time.time())
    rows: list[dict[str, str | float]] = []
    for target in targets:
        if names and target.name not in names:
            continue
        started = time.monotonic()
        try:
            deliver(target, payload, app.redactor)
            result = "delivered"
        except DeliveryFailed as exc:
            result = f"failed: {exc}"
        rows.append({"name": target.name, "to": "webhook" if target.url_env else "command", "result": result,
                     "seconds": round(time.monotonic() - started, 2)})
    if as_json:
        print_json({"notifiers": rows})
    else:
        table(None, ["notifier", "to", "result", "s"], [(r["name"], r["to"], r["result"], r["seconds"]) for r in rows])
    failed = [str(r["name"]) for r in rows if r["result"] != "delivered"]
    if failed:
        raise OperationalError(f"not delivered by {', '.join(failed)}")
    if not as_json:
        out.print(f"{len(rows)} delivered")
