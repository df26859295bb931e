"""`burstctl simulate`: replay spot/on-demand policies against real spot availability traces."""

from __future__ import annotations

import sys
import time
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchestrator.app import App
from orchestrator.cli.base import cli, json_option, pass_app
from orchestrator.cli.output import print_json, table
from orchestrator.core.gates import MAX_OVERHEAD_H
from orchestrator.core.spot_policy import DEFAULT_POLICY, POLICIES
from orchestrator.errors import BadInput, shown_count
from orchestrator.jobspec import MAX_DEADLINE_HOURS, MAX_DEADLINE_YEARS
from orchestrator.records import fmt_usd
from orchestrator.simulate import (
    MAX_NODES,
    MAX_PRICE_USD_H,
    MAX_STARTS,
    MIN_JOB_HOURS,
    JobSetting,
    load_traces,
    simulate,
)

# Each number flag's bounds and what it is counted in, said when a value is outside them. The ceilings keep every
# figure finite and the run's memory bounded: --od-price 1e308 printed NaN and Infinity in the JSON, --starts 1e11
# ended in a MemoryError, and a job of 1e-300 h in an internal error.
HOURS = (f"hours, at least 1 second ({MIN_JOB_HOURS:.3g} h) and at most {MAX_DEADLINE_HOURS:.0f} "
         f"({MAX_DEADLINE_YEARS} years)")
BOUNDS: dict[str, tuple[float, float, str]] = {
    "--job-hours": (MIN_JOB_HOURS, MAX_DEADLINE_HOURS, HOURS),
    "--deadline-hours": (MIN_JOB_HOURS, MAX_DEADLINE_HOURS, HOURS),
    "--changeover-hours": (0.0, MAX_OVERHEAD_H, f"hours from 0 to {MAX_OVERHEAD_H:g}, not minutes (12 minutes is "
                                                "0.2), as policy.overhead_h"),
    "--od-price": (0.0, MAX_PRICE_USD_H, f"dollars per hour from 0 to {MAX_PRICE_USD_H:g}"),
    "--spot-price": (0.0, MAX_PRICE_USD_H, f"dollars per hour from 0 to {MAX_PRICE_USD_H:g}"),
}
COUNTS: dict[str, tuple[int, int, str]] = {
    "--starts": (1, MAX_STARTS, "runs per trace"),
    "--nodes": (1, MAX_NODES, "instances in the gang"),
    "--workers": (1, 1024, "processes"),
}


def _within(name: str, value: float) -> None:
    low, high, expected = BOUNDS[name]
    if not low <= value <= high:  # nan fails every comparison
        raise BadInput(f"expected {expected}, got {value:g}", field=name)


def _count_within(name: str, value: int) -> None:
    low, high, expected = COUNTS[name]
    if not low <= value <= high:
        raise BadInput(f"expected a whole number of {expected} from {low} to {high}, got {shown_count(value)}",
                       field=name)


def as_flag(exc: BadInput) -> BadInput:
    """The library names its parameters (`trace`); here they are the flags the user typed (`--trace`)."""
    if exc.field in ("nodes", "window", "trace"):
        return BadInput(exc.detail, source=exc.source, field=f"--{exc.field}")
    return exc


def _ratio(value: float | None, spec: str) -> str:
    """A ratio of the report, or a dash where its denominator is $0 (prices of 0): no ratio to show."""
    return "—" if value is None else format(value, spec)


@cli.command("simulate")
@click.option("--trace", "trace_paths", multiple=True, required=True, type=str,
              help="Trace JSON file or a directory of them (repeatable).")
@click.option("--window", type=int, default=None, help="Use only the first TICKS ticks of each trace.")
@click.option("--job", "job_file", default=None,
              help="A job file: C, R, d and the prices are those of the rented run its decision plans (`burstctl "
                   "decide`), as the daemon would run it; any of the five flags below given beside it wins.")
@click.option("--job-hours", type=float, default=None, help="C: compute the job needs, hours.")
@click.option("--deadline-hours", type=float, default=None, help="R: deadline from the job's start, hours.")
@click.option("--changeover-hours", type=float, default=None, help="d: delay paid on every switch, hours.")
@click.option("--od-price", type=float, default=None, help="On-demand $/h.")
@click.option("--spot-price", type=float, default=None, help="Spot $/h.")
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
@pass_app
def simulate_cmd(app: App, trace_paths: tuple[str, ...], window: int | None, job_file: str | None,
                 job_hours: float | None, deadline_hours: float | None, changeover_hours: float | None,
                 od_price: float | None, spot_price: float | None, starts: int, seed: int,
                 policy_names: tuple[str, ...], nodes: int, may_move: bool, exact_offline: bool,
                 workers: int | None, as_json: bool) -> None:
    """Replay policies over random starts of real spot traces; report cost, hours, misses, ratio to optimum.

    The job is given by --job-hours, --deadline-hours, --changeover-hours, --od-price and --spot-price, or by --job
    FILE. Semantics and reference figures: Wu et al., "Can't Be Late", NSDI 2024 (see docs/simulate.md).
    """
    given = {"--job-hours": job_hours, "--deadline-hours": deadline_hours, "--changeover-hours": changeover_hours,
             "--od-price": od_price, "--spot-price": spot_price}
    from_job: dict[str, Any] | None = None
    if job_file is not None:
        from_job = job_setting(app, job_file)
        given = {flag: from_job[flag] if value is None else value for flag, value in given.items()}
    values = {flag: value for flag, value in given.items() if value is not None}
    if missing := [flag for flag in given if flag not in values]:
        raise BadInput(f"give {', '.join(missing)}, or a job file with --job (see --help)")
    for name, value in values.items():
        _within(name, value)
    job_hours, deadline_hours, changeover_hours, od_price, spot_price = values.values()
    if deadline_hours < job_hours:
        raise BadInput(f"deadline {deadline_hours:g} h is shorter than the job's {job_hours:g} h: no policy can make "
                       "it", field="--deadline-hours")
    if job_hours + changeover_hours > deadline_hours + 1e-9:
        # Not even the offline optimum makes it: it cost inf, printed as Infinity in the JSON.
        raise BadInput(f"deadline {deadline_hours:g} h is shorter than the job's {job_hours:g} h and the changeover "
                       f"of {changeover_hours:g} h its start pays: no policy can make it", field="--deadline-hours")
    if spot_price > od_price:
        raise BadInput(f"spot at ${spot_price:g}/h costs more than on-demand at ${od_price:g}/h: spot never pays, and "
                       "the policies and the offline bound take it to be the cheaper market", field="--spot-price")
    _count_within("--starts", starts)
    if seed < 0:
        raise BadInput(f"must be 0 or more, got {shown_count(seed)}", field="--seed")
    _count_within("--nodes", nodes)
    if workers is not None:
        _count_within("--workers", workers)
    names = list(dict.fromkeys(policy_names)) or list(POLICIES)
    for name in names:
        if name not in POLICIES:
            raise BadInput(f"unknown policy {name!r} (known: {', '.join(POLICIES)})", field="--policy")
    job = JobSetting(job_hours=job_hours, deadline_hours=deadline_hours, changeover_hours=changeover_hours,
                     od_price=od_price, spot_price=spot_price)
    try:
        traces = load_traces(trace_paths, nodes=nodes, window=window)
    except BadInput as exc:
        raise as_flag(exc) from None

    batches = len(traces) * (len(names) + 1)
    # The bar goes to stderr, so --json's stdout stays pure JSON.
    with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(file=sys.stderr), transient=True,
                  disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("replay", total=batches)
        try:
            report = simulate(traces, names, job, starts=starts, seed=seed, workers=workers,
                              on_step=lambda: progress.advance(task), may_move=may_move, exact_offline=exact_offline)
        except BadInput as exc:  # --may-move's zones on different clocks
            raise as_flag(exc) from None

    doc = report.as_json(DEFAULT_POLICY)
    if from_job is not None:  # what the file stood for, with the figures replayed (a flag beside it wins)
        doc["job"] = {"file": job_file, **from_job["said"], "job_hours": job_hours, "deadline_hours": deadline_hours,
                      "changeover_hours": changeover_hours, "od_price": od_price, "spot_price": spot_price}
    if as_json:
        print_json(doc)
        return
    rows = []
    for name, p in doc["policies"].items():
        label = f"{name} (default)" if name == DEFAULT_POLICY else name
        rows.append((label, fmt_usd(p["mean_cost_usd"]), _ratio(p["mean_savings_vs_od"], ".1%"),
                     f"{p['spot_work_hours']:.1f}", f"{p['od_work_hours']:.1f}",
                     f"{p['spot_hours']:.1f}", f"{p['od_hours']:.1f}",
                     f"{p['misses']}/{p['runs']}", _ratio(p["ratio_to_offline"], ".3f")))
    off = doc["offline"]
    moving = "; the job may move between zones" if may_move else ""
    if from_job is not None:
        click.echo(from_job["summary"])
    table(f"{len(traces)} trace(s) × {starts} starts{moving}; C={job_hours:g} h, R={deadline_hours:g} h, "
          f"d={changeover_hours:g} h",
          ["policy", "mean cost", "savings vs OD", "spot work h", "OD work h", "spot billed h", "OD billed h",
           "misses", "÷ offline"], rows)
    kind = "exact" if off["exact"] else "lower bound" if exact_offline else "lower bound; --exact-offline for the exact"
    click.echo(f"offline optimum ({kind}): {fmt_usd(off['mean_cost_usd'])}/run; changeover-free bound "
               f"{fmt_usd(off['availability_bound_usd'])}; on-demand only {fmt_usd(doc['od_only_cost_usd'])}")


def job_setting(app: App, job_file: str) -> dict[str, Any]:
    """The five flags a job file stands for: the rented run its decision plans now (`burstctl decide`). C is that
    run's compute (its work over its speed: what a replay's run must do, a preemption losing none of it), d its
    overhead (paid again at every switch), R the deadline less any local phase that comes first, and the prices
    its GPU's (per GPU, times the job's GPUs). Also what to say of it: `said` for the JSON, `summary` for the
    table."""
    from orchestrator.core.decision import as_listed, decide
    from orchestrator.core.plan import cloud_phase, planned_cloud_work_h
    from orchestrator.jobspec import load_job
    from orchestrator.queue import context, job_facts

    now = time.time()
    spec, deadline_at = load_job(job_file, now)
    job = job_facts(app, spec, deadline_at, now, job_file)
    ctx = context(app, now)
    d = decide(job, ctx).to_dict()
    overhead = float(d["overhead_h"] or 0.0)
    cloud = cloud_phase(d)
    # As the daemon asks the spot policy (`market_switch`): the compute of the rented run, which a hybrid's local
    # phase comes before; a local plan's is the all-rented run it was weighed against.
    C = planned_cloud_work_h(d)
    gpu, start_h = (cloud["gpu"], float(cloud["start_after_h"])) if cloud is not None else (d["gpu"], 0.0)
    if gpu is None or C <= 0:
        raise BadInput(f"no rented run to replay: {d['headline'] or d['verdict']}", source=job_file,
                       field="rented_throughput")
    # Priced as the decision priced it: at what a provider last listed the job's machine for, else [prices].
    offer, listed = as_listed(ctx, gpu, ctx.offers[gpu], job.gpus)
    if offer.spot_usd_per_gpu_h is None:
        raise BadInput(f"no spot price for {gpu} to replay: {offer.no_spot_why}", source=job_file,
                       field="rented_throughput")
    R = job.deadline_h - start_h
    if C + overhead > R + 1e-9:
        raise BadInput(f"its rented run ({C:.2f} h of work and {overhead:g} h of overhead on {job.gpus}×{gpu}) does "
                       f"not fit the {R:.2f} h it has: no policy can make it (`burstctl decide` says what to "
                       "rethink)", source=job_file, field="deadline_hours")
    setting = {"--job-hours": C, "--deadline-hours": R, "--changeover-hours": overhead,
               "--od-price": offer.od_usd_per_gpu_h * job.gpus, "--spot-price": offer.spot_usd_per_gpu_h * job.gpus}
    if cloud is None:
        run = f"the all-rented run its decision weighed (its plan is {d['plan_kind'] or 'none'})"
    else:
        run = "the rented run its decision plans" + (f", after a {start_h:.2f} h local phase" if start_h > 0 else "")
    priced = f"as {listed.seen} listed {job.gpus}×{gpu}" if listed is not None else f"[prices.{gpu}]"
    summary = (f"{spec.name} ({job_file}): {run}, on {job.gpus}×{gpu}; on-demand ${setting['--od-price']:.2f}/h, "
               f"spot ${setting['--spot-price']:.2f}/h, {priced}")
    said = {"name": spec.name, "gpu": gpu, "gpus": job.gpus, "plan_kind": d["plan_kind"], "start_after_h": start_h}
    return {**setting, "said": said, "summary": summary}
