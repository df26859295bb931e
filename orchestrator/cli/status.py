"""`burstctl status`: what runs, in which mode, and what is spent; without loading the daemon's machinery."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.markup import escape
from sqlalchemy import select

from orchestrator.app import CLOUD_REFUSED_KEY, CLOUD_THROTTLED_KEY, CLOUD_UNAVAILABLE_KEY, App, burst_enabled
from orchestrator.cli.base import cli, json_option, pass_app
from orchestrator.cli.output import out, print_json, table
from orchestrator.core.budget import Held, month_key, month_start
from orchestrator.core.release import utc
from orchestrator.daemon import CONFIG_SEEN_KEY, config_fingerprint, running_daemon
from orchestrator.holds import held_by_plans
from orchestrator.lifecycle.machine import (
    ACTIVE_ATTEMPT_STATES,
    LAUNCHING,
    AttemptState,
    confirmed_by_operator,
    launching,
)
from orchestrator.lifecycle.states import JobState
from orchestrator.records import fmt_usd
from state import schema as s

NO_PROVIDER = "no cloud provider is usable: `burstctl providers` says why"


def status_data(app: App, now: float | None = None) -> dict[str, Any]:
    daemon = running_daemon(app)
    now = time.time() if now is None else now
    settings = app.config_problem is None  # else the config file does not validate: its settings are not known
    with app.store.engine.connect() as c:
        attempts = [dict(r) for r in c.execute(select(s.attempts).where(
            s.attempts.c.state.in_(ACTIVE_ATTEMPT_STATES))).mappings()]
        instances = [dict(r) for r in c.execute(select(s.instances).where(
            s.instances.c.verified_gone.is_(False))).mappings()]
        launching_jobs = len(launching(c))
        # The month's spend ends their charges where the operator's word did, not their provider's (confirm-gone).
        by_operator = confirmed_by_operator(c, since=month_start(now))
    counts = app.store.count_jobs_by_state()
    held = held_by_plans(app, now) if settings else None
    active_states = (JobState.QUEUED, JobState.RUNNING, JobState.RESUMING, JobState.AWAITING_APPROVAL,
                     JobState.BLOCKED)
    return {
        "daemon": {"running": daemon is not None, "pid": daemon and daemon["pid"],
                   **({"host": daemon["host"]} if daemon and daemon.get("host") else {})},
        "mode": _mode(app, daemon is not None),
        # A file that does not validate is one the daemon rejects, not one it applies at its next tick.
        "config_changed_since_daemon_read_it": daemon is not None and settings and _config_changed(app),
        "config_restart_needed": _restart_needed(app) if daemon is not None else [],
        "cloud_health": app.store.get_setting("cloud_health") or {},
        "cloud_health_at": app.store.get_setting("cloud_health_at"),
        # Of the providers that did not answer with offers, those that answered with a refusal, and what it said.
        "cloud_refused": app.store.get_setting(CLOUD_REFUSED_KEY) or {},
        # Of those, the ones that throttled the daemon (HTTP 429: up, and asking to be left alone a while), and when
        # the daemon asks each again (unix seconds): the later of offers_ttl_s and the Retry-After it gave.
        "cloud_throttled": app.store.get_setting(CLOUD_THROTTLED_KEY) or {},
        # And those that answered they are unavailable (HTTP 5xx) and said when to ask again (Retry-After): when the
        # daemon asks each again, as for cloud_throttled.
        "cloud_unavailable": app.store.get_setting(CLOUD_UNAVAILABLE_KEY) or {},
        "jobs": {st.value: counts.get(st.value, 0) for st in JobState},
        # Of the running jobs, those whose launch no provider has confirmed yet: said as such (`machine.LAUNCHING`).
        "launching_jobs": launching_jobs,
        "active_jobs": sum(counts.get(st.value, 0) for st in active_states),
        "attempts": [{"id": a["id"], "job": a["job_id"], "where": a["where"], "state": a["state"],
                      "provider": a["provider"], "instance": a["instance_id"], "market": a["market"],
                      "probe_for": (a["info"] or {}).get("probe_for"),
                      "probe_kept": bool((a["info"] or {}).get("probe_for") and (a["info"] or {}).get("kept")),
                      "problem": _problem(a, now)}
                     for a in attempts],
        "instances": [{"provider": i["provider"], "id": i["id"], "attempt": i["attempt_id"], "state": i["state"],
                       "type": i["instance_type"], "market": i["market"]} for i in instances],
        "confirmed_gone_by_operator": [{"provider": g["provider"], "id": g["instance"], "attempt": g["attempt"],
                                        "job": g["job"], "gone_at": g["gone_at"]} for g in by_operator],
        "month": month_key(now),
        "month_to_date_usd": round(app.store.month_spend(month_key(now), now), 4),
        "budget_cap_usd": app.config.budget.monthly_cap_usd if settings else None,
        # What admitted jobs have still to spend, as `budget` says it: the same sum, so the two never disagree.
        "held_usd": None if held is None else round(held.usd, 4),
        "held_jobs": None if held is None else held.jobs,
        "local_hours": _local_hours(app, now) if settings else None,
        "schedules": _next_slots(app, now) if settings else [],
        "notify": _notifiers(app, now) if settings else [],
        "state_dir": str(app.config.state_dir),
        # The file this command read (None: no file, built-in defaults). A daemon started elsewhere (a service
        # manager's working directory and environment) may have read another.
        "config": str(Path(app.config.source).absolute()) if app.config.source else None,
        # The file the running daemon read, when it is not this command's: two configs on one state.
        "daemon_config": _daemon_config_elsewhere(app) if daemon is not None else None,
        "config_problem": None if settings else str(app.config_problem),
    }


def _daemon_config_elsewhere(app: App) -> str | None:
    """The config file the running daemon read ("" for none, built-in defaults), if not the one this command
    read; None when they are the same."""
    seen = app.store.get_setting(CONFIG_SEEN_KEY)
    if not seen:
        return None
    theirs, ours = seen.get("source"), app.config.source
    same = (theirs is None and ours is None) or (
        theirs is not None and ours is not None and Path(theirs).resolve() == Path(ours).resolve())
    return None if same else str(theirs or "")


def _local_hours(app: App, now: float) -> dict[str, Any] | None:
    """With `local.available_hours`: whether the local GPU may train now, and until when (None: always)."""
    if not app.config.local.available_hours:
        return None
    from orchestrator.queue import local_hours, local_time

    hours = local_hours(app.config, now)
    change = hours.until_change_h()
    until = None if change is None else now + change * 3600.0
    return {"open": hours.is_open(), "until": until,
            "until_local": None if until is None else local_time(app.config, until).isoformat(timespec="minutes"),
            "timezone": app.config.local.timezone or local_time(app.config, now).tzname(),
            "windows": [f"{w.start:%H:%M}-{w.end:%H:%M}" for w in app.config.local.available_hours]}


def _next_slots(app: App, now: float) -> list[dict[str, Any]]:
    """Each schedule's job file and next slot, soonest first (`burstctl schedules` has the rest)."""
    if not app.config.schedule:
        return []
    from orchestrator.schedules import next_slot, trigger  # only with a schedule: cron parsing

    rows = [{"job_file": str(app.config.schedule_job(sc)), "next_slot_at": next_slot(trigger(sc), now)}
            for sc in app.config.schedule]
    return sorted(rows, key=lambda r: r["next_slot_at"] or float("inf"))


def _config_changed(app: App) -> bool:
    """The running daemon read the same config file as this command, and the file has changed since it last read
    it (it reads it again at its next tick: a moment, unless the daemon is stuck)."""
    seen = app.store.get_setting(CONFIG_SEEN_KEY)
    now = config_fingerprint(app.config)
    return bool(seen) and seen.get("source") == now["source"] and seen.get("sha256") != now["sha256"]


def _restart_needed(app: App) -> list[str]:
    """Settings changed in the daemon's config file that it applies only at its next start (`[state]`,
    `orchestrator_id`)."""
    seen = app.store.get_setting(CONFIG_SEEN_KEY) or {}
    return list(seen.get("restart_needed") or [])


def _problem(att: dict[str, Any], now: float) -> str | None:
    """What keeps a live attempt from doing its job right now (a step failing, checkpoints not coming home), or
    None. A released one's (revert-local, its provider not answering the terminate) is its instance still billing,
    which keeps its job off the cloud (`core/release.relaunch_held`), and then why, if a step fails."""
    said = _step_problem(att["info"] or {}, now)
    if att["state"] != AttemptState.RELEASED.value:
        return said
    gone = (f"instance {att['instance_id']} from before revert-local is still being terminated (not confirmed gone: "
            "it bills until it is); its job is not launched in the cloud again until then; "
            f"`burstctl confirm-gone {att['provider']} {att['instance_id']}` once you have seen it gone in its "
            "provider's console")
    return gone if said is None else f"{gone}; {said}"


def _step_problem(info: dict[str, Any], now: float) -> str | None:
    """A live attempt's step failing, or its checkpoints not coming home, or None."""
    refused = info.get("provider_refused")  # its provider refuses to be asked (`reconcile.CANNOT_ASK`): what to do
    if isinstance(refused, dict) and refused.get("said"):
        return str(refused["said"])
    if info.get("errors") and info.get("last_error"):  # the reconciler's failure accounting (`_step_failed`)
        n = int(info["errors"])
        wait = max(0.0, float(info.get("retry_at") or now) - now)
        return f"{n} step{'s' if n != 1 else ''} failed in a row, next try in {wait:.0f} s: {info['last_error']}"
    if info.get("sync_error"):
        return f"{info.get('sync_failures', 1)} checkpoint pull(s) failed in a row: {info['sync_error']}"
    return None


def _mode(app: App, daemon_running: bool) -> str:
    """burst-enabled; local-only (the kill switch); or local-only because no cloud answered the running daemon
    lately (a stopped daemon's last answer says nothing about now)."""
    if not burst_enabled(app):
        return "local-only"
    health = app.store.get_setting("cloud_health")
    if daemon_running and health == {}:
        return f"local-only ({NO_PROVIDER})"
    if daemon_running and health and not any(health.values()):
        refused = app.store.get_setting(CLOUD_REFUSED_KEY) or {}
        throttled = app.store.get_setting(CLOUD_THROTTLED_KEY) or {}
        unavailable = app.store.get_setting(CLOUD_UNAVAILABLE_KEY) or {}
        if all(name in refused for name in health):  # they answer, and refuse: the key, not the network
            return "local-only (the cloud refuses the daemon's requests: see cloud)"
        if all(name in throttled for name in health):  # they answer, and ask to be left alone a while
            return "local-only (the cloud throttles the daemon's requests: see cloud)"
        if all(name in unavailable for name in health):  # they answer that they are down, and until when
            return "local-only (the cloud says it is unavailable: see cloud)"
        return "local-only (no cloud reachable)" if not refused and not throttled and not unavailable else \
            "local-only (no cloud usable: see cloud)"
    return "burst-enabled"


def _health_txt(answers: bool, refused: str | None, throttled_until: float | None, unavailable_until: float | None,
                now: float, asking: bool) -> str:
    """How a provider answered the daemon's last listing. Throttled (429), or unavailable (5xx) with a Retry-After:
    when it is asked again, while a daemon asks."""
    if answers:
        return "answers"
    if refused:
        return f"REFUSES: {escape(refused)}"
    for said, until in (("THROTTLED", throttled_until), ("UNAVAILABLE", unavailable_until)):
        if until is None:
            continue
        if not asking:
            return said
        wait = until - now
        return f"{said}: asked again in {_span(wait)}" if wait >= 1 else f"{said}: asked again at the next tick"
    return "UNREACHABLE"


def _span(s: float) -> str:
    """A length of time as status says it: "42 s", "5 min", "3 h"."""
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.0f} h"


def _market_txt(a: dict[str, Any]) -> str:
    """An attempt's market (none for a local one), and what a spot probe is for."""
    if not a.get("probe_for"):
        return a["market"] or "—"
    kept = ", kept to take over" if a["probe_kept"] else ""
    return f"{a['market']} (probe for {a['probe_for']}{kept})"


def _ago(ts: float, now: float) -> str:
    return f"{_span(max(now - ts, 0.0))} ago"


def _notifiers(app: App, now: float) -> list[dict[str, Any]]:
    if not app.config.notify:
        return []
    from orchestrator.notify import health

    return health(app, now)


def _notifier_txt(n: dict[str, Any], now: float) -> str:
    if not n["armed"]:
        return f"{escape(n['name'])} (not started: the daemon starts it)"
    if n["failing_since"] is not None:
        return (f"[yellow]{escape(n['name'])} FAILING for {_ago(n['failing_since'], now).removesuffix(' ago')}: "
                f"{escape(n['last_error'] or '')}; next try in {n['next_try_in_s']:.0f} s[/yellow]")
    last = f", last {_ago(n['last_delivered_at'], now)}" if n["last_delivered_at"] else ""
    return f"{escape(n['name'])} ok ({n['delivered']} delivered{last})"


@cli.command("status")
@json_option
@pass_app
def status_cmd(app: App, as_json: bool) -> None:
    """Whether the daemon runs, the config file read (this command's: a daemon started elsewhere may read another),
    the mode (burst enabled or local-only), active jobs and instances, spend."""
    d = status_data(app)
    if as_json:
        print_json(d)
        return
    dmn = d["daemon"]
    where = f" on {dmn['host']}" if dmn.get("host") else ""
    out.print(f"daemon: running (pid {dmn['pid']}{where})" if dmn["running"] else "daemon: not running")
    out.print(f"config: {escape(d['config'])}" if d["config"] else "config: no file (built-in defaults)")
    if d["daemon_config"] is not None:
        out.print(f"[yellow]the running daemon read {escape(d['daemon_config']) or 'no file (built-in defaults)'}, "
                  "not this file: it plans with those settings (README, Running it under systemd)[/yellow]")
    mode = d["mode"]
    out.print(f"mode: [bold]{mode}[/bold]" + ("  (revert-local is in force; `burstctl burst-enable` lifts it)"
                                              if mode == "local-only" else ""))
    if d["config_changed_since_daemon_read_it"]:
        out.print("[yellow]the config file has changed since the daemon last read it: it applies the change at its "
                  "next tick (`burstctl events` says config_reloaded, or config_rejected and why)[/yellow]")
    if d["config_restart_needed"]:
        out.print(f"[yellow]the daemon applies {', '.join(d['config_restart_needed'])} only when it starts: "
                  "restart it to apply the change (it runs on the file's other settings)[/yellow]")
    if d["cloud_health"]:
        asking, now = dmn["running"] and d["mode"] != "local-only", time.time()  # the kill switch: nothing is asked
        health = ", ".join(f"{k} " + _health_txt(v, d["cloud_refused"].get(k), d["cloud_throttled"].get(k),
                                                 d["cloud_unavailable"].get(k), now, asking)
                           for k, v in d["cloud_health"].items())
        at = d["cloud_health_at"]
        when = f"asked {_ago(at, now)}" if at is not None else "asked"
        if not dmn["running"]:
            when = f"last {when} by the daemon, which is not running"
        elif d["mode"] == "local-only":  # the kill switch: the daemon asks no cloud while bursting is off
            when = f"last {when}, before bursting was turned off: not asked until `burstctl burst-enable`"
        out.print(f"cloud ({when}): {health}")
    said: dict[str, int] = {}  # the running jobs whose launch is not confirmed yet as `list` says them: launching
    for k, v in d["jobs"].items():
        if k == JobState.RUNNING.value:
            said[LAUNCHING] = d["launching_jobs"]
            v -= d["launching_jobs"]
        said[k] = v
    out.print("jobs: " + ", ".join(f"{k} {v}" for k, v in said.items() if v) if d["active_jobs"] or any(
        d["jobs"].values()) else "jobs: none")
    cap = "an unknown cap (the config file is not valid)" if d["config_problem"] else \
        fmt_usd(d["budget_cap_usd"], as_set=True)
    held = f"; {fmt_usd(d['held_usd'])} held for {Held(d['held_usd'], d['held_jobs']).said()} (`burstctl budget`)" \
        if d["held_jobs"] else ""
    out.print(f"spend {d['month']}: {fmt_usd(d['month_to_date_usd'])} of {cap}{held}")
    if d["local_hours"]:
        hours = d["local_hours"]
        until = "" if hours["until_local"] is None else \
            f" until {datetime.fromisoformat(hours['until_local']).strftime('%a %H:%M')}"
        out.print(f"local GPU: {'open' if hours['open'] else 'closed'} to training{until} "
                  f"(local.available_hours {', '.join(hours['windows'])}, {hours['timezone']})")
    if d["schedules"]:
        soonest = d["schedules"][0]
        at = datetime.fromtimestamp(soonest["next_slot_at"]).astimezone().strftime("%Y-%m-%d %H:%M %Z") \
            if soonest["next_slot_at"] else "never"
        out.print(f"schedules: {len(d['schedules'])}; next slot {at} ({escape(Path(soonest['job_file']).name)}; "
                  "`burstctl schedules`)")
    if d["notify"]:
        out.print("notify: " + "; ".join(_notifier_txt(n, time.time()) for n in d["notify"]))
    if d["attempts"]:
        table("active attempts", ["attempt", "where", "state", "provider", "instance", "market"],
              [(a["id"], a["where"], a["state"], a["provider"], a["instance"], _market_txt(a)) for a in d["attempts"]])
        for a in d["attempts"]:
            if a["problem"]:
                out.print(f"[yellow]{escape(a['id'])}: {escape(a['problem'])}[/yellow]")
    if d["instances"]:
        table("cloud instances: up, or not yet confirmed gone",
              ["provider", "instance", "attempt", "state", "type", "market"],
              [(i["provider"], i["id"], i["attempt"], i["state"], i["type"], i["market"]) for i in d["instances"]])
    if d["confirmed_gone_by_operator"]:
        gone = ", ".join(f"{g['provider']} {g['id']} at {utc(g['gone_at'])}" for g in d["confirmed_gone_by_operator"])
        out.print(f"confirmed gone by the operator this month, not by their provider (`burstctl confirm-gone`): "
                  f"{escape(gone)}; their charges end then")
