"""`burstctl report`: the finished jobs' plans beside what they cost and took (orchestrator/report.py)."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

import click

from orchestrator.app import App
from orchestrator.cli.base import cli, json_option, pass_app
from orchestrator.cli.output import out, print_json, table
from orchestrator.core.budget import month_key
from orchestrator.errors import BadInput
from orchestrator.records import fmt_h, fmt_usd
from orchestrator.report import JobOutcome, outcomes, totals

MONTH = re.compile(r"^(\d{4})-(0[1-9]|1[0-2])$")
OPERATOR_MARK = "†"  # beside what a job cost when its charge ends where the operator's word did (confirm-gone)


def window(month: str | None, days: float | None, every: bool, now: float) -> tuple[str, float | None, float]:
    """What the flags select: a label, and [since, until) in unix seconds (since None: from the first job)."""
    if sum((month is not None, days is not None, every)) > 1:
        raise BadInput("give one of --month, --days and --all")
    if every:
        return "every finished job", None, now + 1
    if days is not None:
        if not days > 0 or days == float("inf"):
            raise BadInput(f"expected a number of days above 0, got {days:g}", field="--days")
        return f"the last {days:g} days", now - days * 86400.0, now + 1
    month = month or month_key(now)
    found = MONTH.match(month)
    if found is None:
        raise BadInput(f"expected a month as YYYY-MM, e.g. {month_key(now)}; got '{month}'", field="--month")
    year, mon = int(found[1]), int(found[2])
    if not 1970 <= year <= 9998:  # before the epoch nothing ran; past 9998 the month's end is no date
        raise BadInput(f"expected a month from 1970-01 to 9998-12; got '{month}'", field="--month")
    start = datetime(year, mon, 1, tzinfo=UTC)
    end = datetime(year + mon // 12, mon % 12 + 1, 1, tzinfo=UTC)
    return month, start.timestamp(), end.timestamp()


def _deadline(o: JobOutcome) -> str:
    if o.late_h is None:
        return "—"
    return f"missed by {fmt_h(o.late_h)}" if o.late_h > 0 else f"met, {fmt_h(-o.late_h)} to spare"


def _plan(o: JobOutcome) -> str:
    """The plan it ran on, the one it was queued on when it was decided again on the way, and revert-local's
    bringing it home against its plan."""
    plan = o.plan if o.first_plan is None else (
        f"{o.plan} (queued as {o.first_plan} {fmt_usd(o.first_expected_usd)}; {o.decisions} decisions)")
    return f"{plan} → local (revert-local)" if o.reverted_local else plan


def _ratio(r: dict[str, float] | None) -> str:
    if r is None:
        return "—"
    spread = f" (×{r['min']:.2f} to ×{r['max']:.2f})" if r["jobs"] > 1 else ""
    return f"×{r['median']:.2f}{spread} over {r['jobs']} job{'s' if r['jobs'] != 1 else ''}"


@cli.command("report")
@click.option("--month", default=None, metavar="YYYY-MM", help="The jobs finished in this month (UTC; default this "
              "month).")
@click.option("--days", type=float, default=None, help="The jobs finished in the last DAYS days instead.")
@click.option("--all", "every", is_flag=True, help="Every finished job.")
@click.option("--limit", type=click.IntRange(min=0), default=20, show_default=True,
              help="Jobs shown in the table, newest first (the totals and --json cover every one).")
@json_option
@pass_app
def report_cmd(app: App, month: str | None, days: float | None, every: bool, limit: int, as_json: bool) -> None:
    """What the finished jobs were expected to cost and take, beside what they did: per job, the plan it ran on
    against the meter (cloud charges, and local hours at local.board_power_w × local.electricity_usd_per_kwh, as the
    config gives them now) and whether its deadline held; in all, the spend by market, measured over expected (the
    done jobs), and what spot saved against on-demand at the rate each decision priced on-demand at."""
    now = time.time()
    label, since, until = window(month, days, every, now)
    found = outcomes(app, since, until, now)
    sums = totals(found)
    if as_json:
        print_json({"window": {"label": label, "since": since, "until": min(until, now)}, "totals": sums,
                    "jobs": [o.as_dict() for o in found]})
        return
    if not found:
        out.print(f"no job finished in {label}")
        return
    counts = ", ".join(f"{sums[st]} {st}" for st in ("done", "failed", "cancelled") if sums[st])
    table(f"{label}: {sums['jobs']} job{'s' if sums['jobs'] != 1 else ''} finished ({counts})",
          ["id", "name", "state", "plan", "expected", "measured", "hours planned → run", "preempted", "deadline"],
          [(o.id, o.name, o.state, _plan(o), fmt_usd(o.expected_usd),
            fmt_usd(o.measured_usd) + (OPERATOR_MARK if o.confirmed_by_operator else ""),
            f"{fmt_h(o.expected_h)} → {fmt_h(o.run_h)}", o.preemptions, _deadline(o)) for o in found[:limit]])
    if any(o.confirmed_by_operator for o in found[:limit]):
        out.print(f"[dim]{OPERATOR_MARK} an instance of it was confirmed gone by the operator, not its provider "
                  "(`burstctl confirm-gone`): its charge ends where the operator said[/dim]")
    if len(found) > limit:
        out.print(f"[dim]{len(found) - limit} older not shown (--limit, or --json for every one)[/dim]")
    met, missed = sums["deadlines_met"], sums["deadlines_missed"]
    table(None, ["", "value"], [
        ("spent", f"{fmt_usd(sums['spent_usd'])}: cloud {fmt_usd(sums['cloud_usd'])} (spot {fmt_usd(sums['spot_usd'])}"
                  f", on-demand {fmt_usd(sums['on_demand_usd'])}), local {fmt_usd(sums['local_usd'])}"),
        ("spot saved against on-demand", fmt_usd(sums["spot_saved_usd"])),
        ("done jobs: expected → measured", f"{fmt_usd(sums['done_expected_usd'])} → "
                                          f"{fmt_usd(sums['done_measured_usd'])}"),
        *([("done jobs: expected when queued", f"{fmt_usd(sums['done_first_expected_usd'])} ("
            f"{sums['decided_again']} job{'s' if sums['decided_again'] != 1 else ''} decided again on the way)")]
          if sums["decided_again"] else []),
        *([("brought home by revert-local", f"{sums['reverted_local']} (their runs are not set beside their "
            "plans in these figures)")] if sums["reverted_local"] else []),
        *([("confirmed gone by the operator", f"{sums['confirmed_by_operator']} job"
            f"{'s' if sums['confirmed_by_operator'] != 1 else ''}' instances, not by their provider (their charges end "
            "where the operator said)")] if sums["confirmed_by_operator"] else []),
        *([("decided again with work done", f"{sums['decided_midway']} (priced on what was left: not set beside "
            "their whole runs in these figures)")] if sums["decided_midway"] else []),
        ("cost, measured / expected", _ratio(sums["cost_ratio"])),
        ("hours, run / planned", _ratio(sums["hours_ratio"])),
        ("deadlines met", f"{met} of {met + missed}" if met + missed else "—"),
        ("attempts, preemptions", f"{sums['attempts']}, {sums['preemptions']}"),
    ])
