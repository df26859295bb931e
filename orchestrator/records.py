"""Decision records: one markdown file per decision, expected figures before, measured ones after."""

from __future__ import annotations

import itertools
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from orchestrator.core.gates import wait_words

MEASURED_PLACEHOLDER = "- **Measured:** _(filled in after the run)_"
# A rethink job's: it does not run unless retried, and a retry's record is then where its run is measured.
MEASURED_RETHINK = ("- **Measured:** none: a rethink job does not run (`burstctl retry` with a later deadline "
                    "queues it again, and this line then names the retry's record)")
# A job cancelled before any attempt of it: it never ran, and nothing of it was rented. A retry's record is then where
# its run is measured.
MEASURED_CANCELLED = ("- **Measured:** none: cancelled before it ran (`burstctl retry` queues it again, and this "
                      "line then names the retry's record)")
# A `burstctl decide` of a job file: a what-if, queued nowhere, so never measured.
MEASURED_NEVER = "- **Measured:** never: a what-if (`burstctl decide`), not queued; `burstctl enqueue` runs it"


def fmt_h(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f} h"


def fmt_usd(v: float | None, *, as_set: bool = False) -> str:
    """Dollars with cents; a negative amount as −$1.00, not $-1.00. `as_set`: a figure the user set (a cap), shown
    with the fraction of a cent it has ($0.105, not a rounded $0.10)."""
    if v is None:
        return "—"
    text = f"{abs(v):,.2f}"
    if as_set and abs(float(text.replace(",", "")) - abs(v)) > 1e-9:
        text = f"{abs(v):,.6f}".rstrip("0")
    return f"${text}" if v >= 0 else f"−${text}"


def plan_name(decision: dict[str, Any]) -> str | None:
    """A decision's plan in a few words ("hybrid spot", "burst on-demand", "local"); None without a plan."""
    if not decision.get("plan_kind"):
        return None
    markets = "+".join(dict.fromkeys(p["market"] for p in decision.get("plan") or [] if p.get("market")))
    return f"{decision['plan_kind']}{' ' + markets if markets else ''}"


def plan_of(decision: dict[str, Any]) -> tuple[str, float | None, float | None]:
    """A decision's plan: its name ("hybrid spot"), cost and the hours it runs ("—", None, None without a plan).
    Those of a local phase are the share of its wall-clock hours the GPU is open (local.available_hours): the meter
    counts a run's hours, and a run paused while the GPU is closed has none."""
    name = plan_name(decision)
    if name is None:
        return "—", None, None
    share = float(decision.get("local_share") or 1.0)
    return name, decision.get("plan_cost_usd"), sum(
        float(p.get("hours") or 0.0) * (share if p.get("where") == "local" else 1.0) for p in decision["plan"] or [])


def supersede(before: dict[str, Any] | None, d: dict[str, Any]) -> dict[str, Any]:
    """`d`, a job's new decision, made to carry what its first one expected (`first_plan`: name, cost, hours) and
    how many it has had (`decisions`): the plan a job ends on is often not the one it was queued on (decided again
    late in line, re-planned while running, retried), and `report` puts both beside what the meter measured."""
    before = before or {}
    name, usd, hours = plan_of(before)
    d["first_plan"] = before.get("first_plan") or {"plan": name, "plan_cost_usd": usd, "hours": hours}
    d["decisions"] = int(before.get("decisions") or 1) + 1
    return d


def render(job_name: str, job_id: str | None, d: dict[str, Any], *, now: float, deadline_h: float,
           work: float, s_local: float, gpus: int, local_gpu: str) -> str:
    when = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d %H:%M UTC")
    plan = d.get("plan") or []
    plan_txt = "; ".join(
        f"{p['where']}{' ' + p['gpu'] if p.get('gpu') else ''}{' ' + p['market'] if p.get('market') else ''} "
        f"{p['hours']:.2f} h" for p in plan) or "—"
    gate1 = ("fits locally" if d["fits_locally"] else "does not fit locally → burst")
    wait = d.get("local_wait_h") or 0.0
    queued = f"w = {wait_words(wait, d.get('local_queued_h'))} + " if wait else ""  # before the GPU is free for it
    if d["verdict"] == "local" and wait:
        finish = wait + (d["t_local_h"] or 0.0)
        gate2 = (f"{queued}T_L = {fmt_h(d['t_local_h'])} = {finish:.2f} h "
                 + (f"≤ D = {deadline_h:.2f} h → local" if finish <= deadline_h + 1e-9 else
                    f"> D = {deadline_h:.2f} h, renting misses too → local, late"))
    elif d["verdict"] == "local":
        gate2 = f"T_L = {fmt_h(d['t_local_h'])} ≤ D = {deadline_h:.2f} h → local"
    elif d["verdict"] == "burst":
        gate2 = f"not reached (gate 1 decides); T_R = {fmt_h(d['t_rented_h'])}"
    elif d["verdict"] == "rethink":
        gate2 = (f"T_L = {fmt_h(d['t_local_h'])} and T_R = {fmt_h(d['t_rented_h'])} both exceed D = {deadline_h:.2f} h "
                 "→ rethink scope")
    else:
        gate2 = (f"{queued}T_L = {fmt_h(d['t_local_h'])} > D = {deadline_h:.2f} h; T_R = {fmt_h(d['t_rented_h'])} ≤ D; "
                 f"ΔC = {fmt_usd(d['delta_cost_usd'])} to save {fmt_h(d['hours_saved'])} "
                 "(all on-demand; approval weighs the plan's extra cost over local, below)")
    mc = d.get("market_costs") or {}
    lines = [
        f"# Decision: {job_name}" if job_id else f"# Decision (what-if, not queued): {job_name}",
        "",
        f"- **Job:** {job_name}{f' ({job_id})' if job_id else ''}, W = {work:g} units, s_L = {s_local:g} units/h "
        f"on {local_gpu}, {gpus} GPU(s), deadline {deadline_h:.2f} h; decided {when}",
        f"- **Gate 1 (feasibility):** {gate1}",
        f"- **Gate 2 (deadline):** {gate2}",
        f"- **Verdict:** {d['verdict']} → {d['action']}",
        f"- **Instance:** {d.get('gpu') or '—'} × {gpus}, market {d.get('market') or '—'}",
        f"- **Rate used:** {fmt_usd(d.get('rate_usd_per_gpu_h'))}/GPU-h"
        + (f" (the run in all: on-demand {fmt_usd(mc.get('on_demand_usd'))}, spot expected "
           f"{fmt_usd(mc.get('spot_expected_usd'))})" if mc else ""),
        f"- **Expected run time and overhead:** T_R = {fmt_h(d['t_rented_h'])} including "
        f"t_ovh = {d['overhead_h']:.2f} h;"
        f" plan: {plan_txt}; plan cost {fmt_usd(d.get('plan_cost_usd'))}",
        MEASURED_NEVER if not job_id else MEASURED_RETHINK if d["action"] == "rethink" else MEASURED_PLACEHOLDER,
        "",
        "## Rationale",
        "",
        *[f"- {r}" for r in d["reasons"]],
        "",
    ]
    return "\n".join(lines)


def write(state_dir: Path, job_name: str, job_id: str | None, text: str, now: float) -> Path:
    """A new record `decisions/<day>-<name>.md`, or, when that is taken, `-<job id>` or `-2`, `-3`, ... after the
    name: a record is never overwritten (a what-if `decide` of the same job must not wipe a run's Measured line)."""
    folder = state_dir / "decisions"
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.fromtimestamp(now, UTC).strftime('%Y-%m-%d')}-{job_name}"
    names = itertools.chain([stem], [f"{stem}-{job_id}"] if job_id else [], (f"{stem}-{n}" for n in itertools.count(2)))
    for name in names:
        path = folder / f"{name}.md"
        try:  # claim the name: O_EXCL, so two writers at once cannot both take it
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            continue
        tmp = path.with_suffix(".md.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        return path
    raise AssertionError("unreachable: the names never run out")


def fill_measured(path: Path, measured: str) -> None:
    """Replace the Measured line once the run is over (idempotent: the last measurement wins)."""
    text = path.read_text(encoding="utf-8")
    new = re.sub(r"^- \*\*Measured:\*\*.*$", f"- **Measured:** {measured}", text, count=1, flags=re.M)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(new, encoding="utf-8")
    tmp.replace(path)


def superseded(old: str | Path | None, new: Path, what: str, now: float) -> None:
    """The record a new decision of the same job replaces before its run was measured: its Measured line, still
    waiting, points at the new record (where the run will be measured) instead of waiting for ever."""
    if not old or Path(old) == new or not Path(old).exists():
        return
    text = Path(old).read_text(encoding="utf-8")
    if any(line in text for line in (MEASURED_PLACEHOLDER, MEASURED_RETHINK, MEASURED_CANCELLED)):
        when = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d %H:%M UTC")
        fill_measured(Path(old), f"{what}, {when}: see {new.name}")
