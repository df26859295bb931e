"""`burstctl simulate`: replay spot/on-demand policies against real spot availability traces."""

from __future__ import annotations

import math
import sys

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchestrator.cli.base import cli, json_option, print_json, table
from orchestrator.core.spot_policy import DEFAULT_POLICY, POLICIES
from orchestrator.errors import BadInput
from orchestrator.records import fmt_usd
from orchestrator.simulate import JobSetting, load_traces, simulate


def _non_negative(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise BadInput(f"must be a finite number >= 0, got {value}", field=name)


@cli.command("simulate")
@click.option("--trace", "trace_paths", multiple=True, required=True, type=str,
              help="Trace JSON file or a directory of them (repeatable).")
@click.option("--window", type=int, default=None, help="Use only the first TICKS ticks of each trace.")
@click.option("--job-hours", type=float, required=True, help="C: compute the job needs, hours.")
@click.option("--deadline-hours", type=float, required=True, help="R: deadline from the job's start, hours.")
@click.option("--changeover-hours", type=float, required=True, help="d: delay paid on every switch, hours.")
@click.option("--od-price", type=float, required=True, help="On-demand $/h.")
@click.option("--spot-price", type=float, required=True, help="Spot $/h.")
@click.option("--starts", type=int, default=300, show_default=True, help="Random start ticks per trace.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the start ticks.")
@click.option("--policy", "policy_names", multiple=True, type=str,
              help=f"Policy to replay (repeatable; default: all of {', '.join(POLICIES)}).")
@click.option("--nodes", type=int, default=1, show_default=True,
              help="Gang size: spot is usable in a tick only when the trace shows this many instances.")
@click.option("--may-move", is_flag=True,
              help="The job may move between the zones of one instance type (files <zone>_<device>_<count>.json "
                   "on one clock), as the daemon does between a provider's regions: spot is usable while any of "
                   "them has it, and a spot launch goes to the zone whose spot has been up longest.")
@click.option("--exact-offline", is_flag=True,
              help="Compute the exact offline optimum where the default settles for a lower bound (a changeover "
                   "that ends inside a tick counted as ending with it): about ten times the offline DP's CPU.")
@click.option("--workers", type=int, default=None, help="Processes to use (default: one per core).")
@json_option
def simulate_cmd(trace_paths: tuple[str, ...], window: int | None, job_hours: float, deadline_hours: float,
                 changeover_hours: float, od_price: float, spot_price: float, starts: int, seed: int,
                 policy_names: tuple[str, ...], nodes: int, may_move: bool, exact_offline: bool,
                 workers: int | None, as_json: bool) -> None:
    """Replay policies over random starts of real spot traces; report cost, hours, misses, ratio to optimum.

    Semantics and reference figures: Wu et al., "Can't Be Late", NSDI 2024 (see docs/simulate.md).
    """
    for name, value in (("--job-hours", job_hours), ("--deadline-hours", deadline_hours)):
        if not math.isfinite(value) or value <= 0:
            raise BadInput(f"must be a number > 0, got {value}", field=name)
    for name, value in (("--changeover-hours", changeover_hours), ("--od-price", od_price),
                        ("--spot-price", spot_price)):
        _non_negative(name, value)
    if deadline_hours < job_hours:
        raise BadInput(f"deadline {deadline_hours} h is shorter than the job's {job_hours} h: no policy can make it",
                       field="--deadline-hours")
    if spot_price > od_price:
        raise BadInput(f"spot at ${spot_price}/h costs more than on-demand at ${od_price}/h: spot never pays, and the "
                       "policies and the offline bound take it to be the cheaper market", field="--spot-price")
    if starts <= 0:
        raise BadInput(f"must be > 0, got {starts}", field="--starts")
    if seed < 0:
        raise BadInput(f"must be 0 or more, got {seed}", field="--seed")
    if nodes <= 0:
        raise BadInput(f"must be > 0, got {nodes}", field="--nodes")
    if workers is not None and workers <= 0:
        raise BadInput(f"must be > 0, got {workers}", field="--workers")
    names = list(dict.fromkeys(policy_names)) or list(POLICIES)
    for name in names:
        if name not in POLICIES:
            raise BadInput(f"unknown policy {name!r} (known: {', '.join(POLICIES)})", field="--policy")
    job = JobSetting(job_hours=job_hours, deadline_hours=deadline_hours, changeover_hours=changeover_hours,
                     od_price=od_price, spot_price=spot_price)
    try:
        traces = load_traces(trace_paths, nodes=nodes, window=window)
    except BadInput as exc:  # the library names its parameters; here they are flags
        if exc.field in ("nodes", "window", "trace"):
            raise BadInput(exc.detail, source=exc.source, field=f"--{exc.field}") from None
        raise

    batches = len(traces) * (len(names) + 1)
    # The bar goes to stderr, so --json's stdout stays pure JSON.
    with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(file=sys.stderr), transient=True,
                  disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("replay", total=batches)
        report = simulate(traces, names, job, starts=starts, seed=seed, workers=workers,
                          on_step=lambda: progress.advance(task), may_move=may_move, exact_offline=exact_offline)

    doc = report.as_json(DEFAULT_POLICY)
    if as_json:
        print_json(doc)
        return
    rows = []
    for name, p in doc["policies"].items():
        label = f"{name} (default)" if name == DEFAULT_POLICY else name
        rows.append((label, fmt_usd(p["mean_cost_usd"]), f"{p['mean_savings_vs_od']:.1%}",
                     f"{p['spot_work_hours']:.1f}", f"{p['od_work_hours']:.1f}",
                     f"{p['spot_hours']:.1f}", f"{p['od_hours']:.1f}",
                     f"{p['misses']}/{p['runs']}", f"{p['ratio_to_offline']:.3f}"))
    off = doc["offline"]
    moving = "; the job may move between zones" if may_move else ""
    table(f"{len(traces)} trace(s) × {starts} starts{moving}; C={job_hours} h, R={deadline_hours} h, "
          f"d={changeover_hours} h",
          ["policy", "mean cost", "savings vs OD", "spot work h", "OD work h", "spot billed h", "OD billed h",
           "misses", "÷ offline"], rows)
    kind = "exact" if off["exact"] else "lower bound" if exact_offline else "lower bound; --exact-offline for the exact"
    click.echo(f"offline optimum ({kind}): {fmt_usd(off['mean_cost_usd'])}/run; changeover-free bound "
               f"{fmt_usd(off['availability_bound_usd'])}; on-demand only {fmt_usd(doc['od_only_cost_usd'])}")
