"""`burstctl decide`: the two gates for a job file, or for quick what-ifs by the seed script's flags."""

from __future__ import annotations

import math
import re
import time
from dataclasses import replace
from typing import Any

import click
from rich.markup import escape

from orchestrator.app import App
from orchestrator.cli.base import cli, json_option, pass_app
from orchestrator.cli.output import out, print_json
from orchestrator.config import NAME_EXPECTED, NAME_MAX, NAME_PATTERN
from orchestrator.core.decision import DecisionContext, GpuOffer, JobFacts, decide
from orchestrator.core.gates import (
    MAX_GPUS,
    MAX_LOCAL_USD_H,
    MAX_OVERHEAD_H,
    MAX_RATE_USD_GPU_H,
    GateResult,
    wait_words,
)
from orchestrator.errors import BadInput, shown_count
from orchestrator.jobspec import (
    DEADLINE_HOURS_EXPECTED,
    MAX_DEADLINE_HOURS,
    load_job,
    too_much_work,
    too_slow,
)
from orchestrator.lifecycle.states import JobState
from orchestrator.queue import context, job_facts, record_decision

FLAG_GPU = "rented"


# A flag's ceiling and what the flag is counted in (a larger figure is in the wrong unit, or no figure at all: a rate
# of 1e308 $/GPU-h made the plan's cost inf, and printed nothing but an internal error). The config's own ceilings
# for the same settings (core/gates.py).
CEILINGS = {
    "--rate": (MAX_RATE_USD_GPU_H, "dollars per GPU-hour (an H100 rents for $2 to $12)"),
    "--overhead-h": (MAX_OVERHEAD_H, "hours, not minutes (half an hour is 0.5), as policy.overhead_h"),
    "--local-usd-h": (MAX_LOCAL_USD_H, "dollars per hour, not cents (a 400 W GPU at $0.25/kWh costs 0.10), as "
                      "the local $/h local.board_power_w and local.electricity_usd_per_kwh can give"),
}


def _positive(name: str, v: float | None, allow_zero: bool = False) -> None:
    if v is None:
        return
    # click's float type takes "inf", "nan" and "1e999"; none of them is a figure the gates can work with.
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise BadInput(f"expected a finite {'non-negative' if allow_zero else 'positive'} number, got {v}",
                       field=name)
    if name in CEILINGS and v > CEILINGS[name][0]:
        limit, unit = CEILINGS[name]
        raise BadInput(f"{v:g} is more than {limit:g}: expected {unit}", field=name)


def _gpus(v: int | None) -> None:
    if v is not None and not 1 <= v <= MAX_GPUS:
        raise BadInput(f"expected an integer from 1 to {MAX_GPUS} (as a job file's gpus), got {shown_count(v)}",
                       field="--gpus")


def _deadline_hours(v: float | None) -> None:
    """--deadline-h within the same bound as a job file's deadline_hours."""
    if v is not None and not 0 < v <= MAX_DEADLINE_HOURS:  # nan fails every comparison
        raise BadInput(f"{DEADLINE_HOURS_EXPECTED}, got {v}", field="--deadline-h")


@cli.command("decide")
@click.argument("job_file", required=False)
@click.option("--work", type=float, default=None, help="W: work units (default 1).")
@click.option("--s-local", type=float, default=None, help="Local units/h; 0 means it does not fit locally.")
@click.option("--s-rented", type=float, default=None, help="Rented units/h per GPU (default 5).")
@click.option("--deadline-h", type=float, default=None, help="Hours from now until the result is needed.")
@click.option("--rate", type=float, default=None, help="Rented $/GPU-hour on the run date.")
@click.option("--gpus", type=int, default=None, help="Rented GPUs (default 1).")
@click.option("--overhead-h", type=float, default=None, help="Boot + sync + teardown hours (default 0.5).")
@click.option("--local-usd-h", type=float, default=None, help="Local $/h (default 0.10).")
@click.option("--name", default="what-if", show_default=True, help="Name for the decision record (flags mode).")
@click.option("--no-record", is_flag=True, help="Do not write a decision record.")
@json_option
@pass_app
def decide_cmd(app: App, job_file: str | None, work: float | None, s_local: float | None, s_rented: float | None,
               deadline_h: float | None, rate: float | None, gpus: int | None, overhead_h: float | None,
               local_usd_h: float | None, name: str, no_record: bool, as_json: bool) -> None:
    """Run the two gates and print the verdict; writes a decision record.

    JOB_FILE is a job spec (TOML). Without it, the seed script's flags describe the job:
    --s-local, --deadline-h and --rate are required.
    """
    now = time.time()
    flags = {"--work": work, "--s-local": s_local, "--s-rented": s_rented, "--deadline-h": deadline_h,
             "--rate": rate, "--gpus": gpus, "--overhead-h": overhead_h, "--local-usd-h": local_usd_h}
    if job_file:
        given = [k for k, v in flags.items() if v is not None and k not in ("--overhead-h", "--local-usd-h")]
        if given:
            raise BadInput(f"{', '.join(given)} cannot be combined with a job file; edit the file instead")
        spec, deadline_at = load_job(job_file, now)
        job = job_facts(app, spec, deadline_at, now, job_file)
        ctx = context(app, now)
        if overhead_h is not None:
            _positive("--overhead-h", overhead_h, allow_zero=True)
            ctx = replace(ctx, overhead_h=overhead_h)
        if local_usd_h is not None:
            _positive("--local-usd-h", local_usd_h, allow_zero=True)
            ctx = replace(ctx, local_usd_h=local_usd_h)
    else:
        missing = [k for k in ("--s-local", "--deadline-h", "--rate") if flags[k] is None]
        if missing:
            raise BadInput(f"expected a job file, or the flags {', '.join(missing)} (see --help)")
        _deadline_hours(deadline_h)
        for k in ("--work", "--s-rented", "--rate"):
            _positive(k, flags[k])
        for k in ("--s-local", "--overhead-h", "--local-usd-h"):
            _positive(k, flags[k], allow_zero=True)
        _gpus(gpus)
        why = too_much_work(work or 1.0, [s_local or 0.0, (s_rented or 5.0) * (gpus or 1)])
        if why:
            raise BadInput(why, field="--work")
        for k, s, g in (("--s-local", s_local or 0.0, 1), ("--s-rented", s_rented or 5.0, gpus or 1)):
            why = too_slow(work or 1.0, s, g, local=k == "--s-local")
            if why:
                raise BadInput(why, field=k)
        if not re.fullmatch(NAME_PATTERN, name) or len(name) > NAME_MAX:
            raise BadInput(f"expected {NAME_EXPECTED} characters", field="--name")
        job = JobFacts(name=name, kind="train", work=work or 1.0, s_local=s_local or 0.0,
                       rented={FLAG_GPU: s_rented or 5.0}, gpus=gpus or 1, deadline_h=deadline_h or 0.0,
                       market="on-demand")
        assert rate is not None
        ctx = DecisionContext(local_usd_h=0.10 if local_usd_h is None else local_usd_h,
                              offers={FLAG_GPU: GpuOffer(FLAG_GPU, rate, None, math.inf,
                                                        no_spot_why="on-demand at --rate: flags give no spot price")},
                              overhead_h=0.5 if overhead_h is None else overhead_h,
                              max_auto_delta_usd=app.config.policy.max_auto_delta_usd,
                              hybrid_margin_h=app.config.policy.hybrid_margin_h)
    decision = decide(job, ctx)
    d = decision.to_dict()
    record = None if no_record else record_decision(app, job, d, now, None)
    if as_json:
        print_json({"job": job.name, **d, "deadline_h": round(job.deadline_h, 4),
                    "record": str(record) if record else None})
        return
    _print_human(job, d, decision.gates)
    if job_file and (decision.gates.local_wait_h or 0.0) > 0:
        _note_same_name_queued(app, job.name)
    if record:
        out.print(f"[dim]decision record: {record}[/dim]")


def _note_same_name_queued(app: App, name: str) -> None:
    """`decide` on a file already queued weighs it as one more job, behind its own copy: say so, not in silence."""
    live = [j for j in app.store.find_jobs(name) if not JobState(j["state"]).final]
    if live:
        ids = ", ".join(f"{j['id']} ({j['state']})" for j in live)
        out.print(f"note: a job of this name is in the queue already ({ids}): this decision weighs the file as a new "
                  f"job beside it, so the local work queued ahead may be that job's own; `burstctl show {name}` has "
                  "its decision")


def _apart(a: float, b: float) -> tuple[str, str]:
    """Two hour figures, with their unit, with as many decimals (2 to 6) as it takes for them not to print alike: a
    local run of 12.0048 h misses a 12 h deadline, and "12.00 h > 12.00 h" would read as a contradiction. Closer
    than that (a deadline counted from a moment later), the first says by how much."""
    n = 2
    while n < 6 and a != b and f"{a:.{n}f}" == f"{b:.{n}f}":
        n += 1
    if f"{a:.{n}f}" == f"{b:.{n}f}" and a != b:
        ms = abs(a - b) * 3.6e6
        return f"{b:.2f} h {'+' if a > b else '-'} {f'{ms:.1f} ms' if ms >= 0.1 else 'under 0.1 ms'}", f"{b:.2f} h"
    return f"{a:.{n}f} h", f"{b:.{n}f} h"


def _print_human(job: JobFacts, d: dict[str, Any], gates: GateResult) -> None:
    """The seed script's wording, in the notation of the README and the decision records (ΔC, →, ≤, ≈, where the
    script printed dC, ->, <= and ~), then what burstctl adds (market, plan, budget, approval). Gate 2's comparison
    is made on the gates' own figures: `d`'s are rounded, and could print a miss the gates did not see."""
    p = out.print
    D = job.deadline_h
    if not d["fits_locally"]:
        # Where no rented GPU can run it either, gate 1 sends it nowhere: the verdict below says rethink.
        p("GATE 1: does NOT fit locally → " + ("BURST (no local option)." if d["t_rented_h"] is not None
                                                else "no local option, and no rented one (below)."))
        for r in d["reasons"]:  # why: memory, s_L = 0, the local GPU's hours, no local slot
            why = re.match(r"Gate 1: does not fit locally \((.*)\): burst", r)
            if why:
                p(f"  why: {escape(why.group(1))}.")
        if d["t_rented_h"] is not None:
            p(f"  rented wall-clock ≈ {d['t_rented_h']:.2f} h, cost ≈ ${d['c_rented_usd']:.2f} (on-demand; the plan "
              "below is the cheapest safe way it runs).")
    else:
        p(f"GATE 1: fits locally. local wall-clock ≈ {d['t_local_h']:.2f} h, cost ≈ ${d['c_local_usd']:.2f} "
          "(electricity).")
        # Gate 2 asks when local is done: after the local work queued ahead of it (w), then T_L.
        wait = gates.local_wait_h or 0.0
        finish = (gates.t_local_h or 0.0) + wait
        shown = "{}" + (f" ({wait_words(wait, gates.local_queued_h)} + {d['t_local_h']:.2f} h)" if wait > 0 else "")
        if d["verdict"] == "local" and finish <= D:
            f, dl = _apart(finish, D)
            p(f"GATE 2: local MAKES the deadline ({shown.format(f)} ≤ {dl}) → RUN LOCAL. Renting is waste.")
        elif d["verdict"] == "local":  # only the queue ahead makes it late, and renting misses too
            f, dl = _apart(finish, D)
            tr = d["t_rented_h"]
            rented = f"rented misses it too ({tr:.2f} h)" if tr is not None else "nothing rented can run it"
            p(f"GATE 2: local MISSES the deadline ({shown.format(f)} > {dl}), but {rented} → RUN LOCAL, late.")
        else:
            f, dl = _apart(finish, D)
            p(f"GATE 2: local MISSES the deadline ({shown.format(f)} > {dl}).")
            if d["verdict"] == "rethink":
                tr = d["t_rented_h"]
                p(f"  ...but rented also misses ({tr:.2f} h). Rethink scope, not hardware." if tr is not None
                  else "  ...and none of the rented GPU types it names can run it (why below).")
            else:
                p("  rented makes it: {} ≤ {}.".format(*_apart(gates.t_rented_h or 0.0, D)))
                if d["delta_cost_usd"] >= 0:
                    p(f"  price of the deadline: ΔC ≈ ${d['delta_cost_usd']:.2f} to save {d['hours_saved']:.2f} h "
                      "(all of it on-demand; approval weighs what the plan below, the cheapest safe way it runs, "
                      "costs more than local).")
                else:
                    p(f"  price of the deadline: none: renting, all of it on-demand, is ${-d['delta_cost_usd']:.2f} "
                      f"cheaper than local and saves {d['hours_saved']:.2f} h.")
    p(f"[bold]verdict: {d['verdict'].upper()}[/bold] → {d['action']}")
    if d.get("plan"):
        phases = "; ".join(f"{ph['where']}{' ' + ph['market'] if ph['market'] else ''} {ph['hours']:.2f} h "
                           f"(${ph['cost_usd']:.2f})" for ph in d["plan"])
        p(f"plan ({d['plan_kind']}): {phases}; total ${d['plan_cost_usd']:.2f}")
    for r in d["reasons"]:
        if not r.startswith("Gate"):
            p(f"  · {escape(r)}")  # reasons quote config tables such as [prices], which are not markup
