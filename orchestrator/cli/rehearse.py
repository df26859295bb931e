"""`burstctl rehearse JOB.toml`: check a job's checkpointing against injected spot preemptions on a private
simcloud, before paying for a real GPU."""

from __future__ import annotations

import sys

import click

from orchestrator.app import App
from orchestrator.cli.base import FiniteFloat, cli, json_option, pass_app
from orchestrator.cli.output import out, print_json, table
from orchestrator.errors import OperationalError
from orchestrator.records import fmt_usd
from orchestrator.rehearse import RehearsalOptions, rehearse


def _s(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f} s"


def _step(v: int | None) -> str:
    return "—" if v is None else str(v)


@cli.command("rehearse")
@click.argument("job_file", type=str)
@click.option("--preemptions", type=click.IntRange(1, 50), default=2, show_default=True,
              help="Preemptions to inject (each an interruption notice, then the reclaim).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the jitter of the preemption times.")
@click.option("--every-s", type=FiniteFloat(min=0, min_open=True), default=None,
              help="Seconds an attempt runs before it is preempted (±25 %, seeded). "
                   "Default: two checkpoint intervals, at least 3 s.")
@click.option("--timeout", "timeout_s", type=FiniteFloat(min=0, min_open=True), default=600.0,
              show_default=True, help="Give up (exit 1) if the job has not finished after this many seconds.")
@click.option("--notice-s", type=FiniteFloat(min=0), default=2.0, show_default=True,
              help="Lead time of each interruption notice (EC2 gives 120 s).")
@click.option("--keep", is_flag=True, help="Keep the throwaway directory (state, event log, logs) for reading.")
@json_option
@pass_app
def rehearse_cmd(app: App, job_file: str, preemptions: int, seed: int, every_s: float | None, timeout_s: float,
                 notice_s: float, keep: bool, as_json: bool) -> None:
    """Run JOB_FILE on a private simulated cloud, forced to spot, with injected preemptions; report whether it
    resumed correctly after each, the work each one lost, how long each resume took, attempts, cost, and that
    nothing was left running. Exit 0 only when the job resumes correctly and finishes."""

    def say(line: str) -> None:
        if as_json:
            print(line, file=sys.stderr)
        else:
            out.print(f"[dim]·[/dim] {line}")

    opts = RehearsalOptions(preemptions=preemptions, seed=seed, every_s=every_s, timeout_s=timeout_s,
                            notice_s=notice_s)
    res = rehearse(job_file, opts, say, keep=keep, config=app.config)
    if as_json:
        print_json(res.as_dict())
    else:
        table(f"{res.job}: {len(res.preemptions)} preemption(s)",
              ["#", "ran", "checkpoint before", "step reached", "resumed from", "step", "lost work", "resume took",
               "resumed correctly"],
              [(p.n, _s(p.notice_at - p.running_at), p.checkpoint_before or "none", _step(p.step_before),
                p.resumed_from or ("nothing (job finished)" if p.finished_before_reclaim else "nothing (started over)"),
                _step(p.resumed_step), _s(p.lost_work_s),
                _s(p.resumed_at - p.notice_at if p.resumed_at else None),
                {True: "yes", False: "no", None: "unknown"}[p.resumed_correctly]) for p in res.preemptions])
        out.print(f"finished: {'yes' if res.finished else 'no'} ({res.state}), attempts {res.attempts}, "
                  f"cost {fmt_usd(res.cost_usd)} (simcloud billed {fmt_usd(res.billed_usd)}), "
                  f"instances left {res.instances_left}, {res.seconds:.0f} s")
        for note in res.notes:
            out.print(f"note: {note}")
        if res.workdir:
            out.print(f"kept: {res.workdir}")
        out.print(f"verdict: {res.verdict}")
    if not res.ok:
        raise OperationalError(f"rehearse: {res.job}: {res.verdict}")
