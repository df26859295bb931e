"""`burstctl demo`: the whole story on the embedded simulated cloud, in under three minutes."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click
from rich.markup import escape

from orchestrator.app import App
from orchestrator.cli.base import cli, json_option
from orchestrator.cli.output import out, print_json, table
from orchestrator.demo import run_demo
from orchestrator.errors import OperationalError
from orchestrator.records import fmt_h, fmt_usd


def _this_burstctl() -> str:
    """How to type this burstctl again: its name where PATH finds this one, else its path (`make demo` runs the
    venv's, which is not on PATH until the venv is activated)."""
    here = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    found = shutil.which("burstctl")
    if found and (here is None or Path(found).resolve() == here):
        return "burstctl"
    if here is not None and here.name == "burstctl":
        return str(Path(sys.argv[0]))
    return f"{sys.executable} -m orchestrator.cli"


@cli.command("demo")
@click.option("--keep", is_flag=True, help="Keep simcloud's sandboxes and logs too (until the next demo).")
@json_option
def demo_cmd(keep: bool, as_json: bool) -> None:
    """Run the seed's candidates through the gates, burst a trainer to simulated spot, preempt and resume it,
    then bring everything home with revert-local. Real processes, real SSH, nothing left running. It runs in
    ~/.cache/burstctl/demo ($XDG_CACHE_HOME), which each demo empties and uses again."""

    def say(line: str) -> None:
        if as_json:
            print(line, file=sys.stderr)
        else:
            out.print(f"[dim]·[/dim] {line}")

    app = click.get_current_context().find_object(App)
    given = app.state_dir_override if app is not None else None
    res = run_demo(say, keep=keep, state_dir=Path(given).expanduser().resolve() if given else None)
    if as_json:
        print_json(res.as_dict())
    else:
        table("the seed's three candidates, examples/seed/<job>.toml (rate $3.00/GPU-h, t_ovh 0.5 h, local $0.10/h)",
              ["job", "verdict", "T_L", "T_R", "ΔC", "hours saved"],
              [(c["job"], c["verdict"], fmt_h(c["t_local_h"]), fmt_h(c["t_rented_h"]), fmt_usd(c["delta_cost_usd"]),
                fmt_h(c["hours_saved"])) for c in res.candidates])
        table("what ran", ["job", "verdict", "where it ran", "attempts", "preemptions", "cost", "state"],
              [(j["job"], j["verdict"], j["where"], j["attempts"], j["preemptions"], fmt_usd(j["cost_usd"]),
                j["state"]) for j in res.jobs])
        out.print(f"instances left: {res.instances_left}   ({res.seconds:.0f} s)")
        for j in res.jobs:
            out.print(f"{j['job']}'s result: {', '.join(j['outputs']) or '(none came home)'}")
        out.print(f"notices ({res.notices_log}):")
        for line in res.notices or ["(none)"]:
            out.print(f"  {line}")
        out.print(f"decision records: {res.records_dir}")
        out.print(f"event log:        {res.event_log}")
        out.print(f"look around:      {_this_burstctl()} --state-dir {res.state_dir} status   (or list, events, "
                  "show JOB, report)")
        if keep:
            out.print(f"simcloud's sandboxes and logs: {res.workdir}/sim")
        out.print(f"[dim]{escape(res.workdir)} is the demo's own: the next demo empties it and runs there again; "
                  "delete it whenever you like[/dim]")
    if res.instances_left != 0:
        raise OperationalError(f"{res.instances_left} simulated instance(s) were left running")
