"""`burstctl providers`: what is configured, whether credentials are present, whether it answers, its offers."""

from __future__ import annotations

from typing import Any

import click

from orchestrator.app import App
from orchestrator.cli.base import cli, json_option, pass_app
from orchestrator.cli.output import out, print_json, table
from orchestrator.errors import BadInput, OperationalError
from providers.base import ProviderError
from providers.registry import build


@cli.command("providers")
@click.option("--only", type=click.Choice(["sim", "lambda", "ec2"]), default=None, help="Just this provider.")
@json_option
@pass_app
def providers_cmd(app: App, only: str | None, as_json: bool) -> None:
    """List configured providers, their credentials (by name), whether they answer, and their offers.

    Exit 2 when an enabled provider's credential is missing; 1 when one does not answer."""
    slots = build(app.config, orchestrator_id=app.orchestrator_id, sink=app.events.provider_sink)
    report: list[dict[str, Any]] = []
    missing: list[str] = []
    failing: list[str] = []
    unmatched: list[str] = []
    for name, slot in slots.items():
        if only and name != only:
            continue
        entry: dict[str, Any] = {"name": name, "enabled": slot.enabled, "credential": slot.credential,
                                 "credential_present": slot.credential_present, "answers": None, "offers": []}
        if slot.enabled and slot.provider is None:
            entry["problem"] = slot.problem
            missing.append(f"{name}: {slot.problem}")
        elif slot.provider is not None:
            try:
                offers = slot.provider.offers()
                entry["answers"] = True
                if problems := getattr(slot.provider, "config_problems", []):  # settings that name nothing there
                    entry["problem"] = "; ".join(problems)
                    unmatched.append(entry["problem"])
                entry["offers"] = [{"type": o.instance_type, "gpu": o.gpu_model, "gpus": o.gpu_count,
                                    "vram_gib": o.vram_gib, "on_demand_usd_h": o.on_demand_usd_h,
                                    "spot_usd_h": o.spot_usd_h, "regions": list(o.regions)} for o in offers]
            except ProviderError as exc:
                entry["answers"] = False
                entry["problem"] = f"{type(exc).__name__}: {app.redactor(str(exc))}"
                if name == "sim" and exc.code == "connection":  # on by default, and nothing serves it yet
                    entry["problem"] += ("; is simcloud running? `burstctl simcloud serve` starts it, or set "
                                         "enabled = false under [providers.sim]")
                failing.append(f"{name} ({entry['problem']})")
        report.append(entry)
    report = app.redactor(report)  # what a provider answered may hold the key it was sent (a buggy or hostile API)
    if as_json:
        print_json({"providers": report})
    else:
        table("providers", ["provider", "enabled", "credential", "present", "answers", "problem"],
              [(e["name"], "yes" if e["enabled"] else "no", e["credential"], "yes" if e["credential_present"] else "no",
                {True: "yes", False: "NO", None: "—"}[e["answers"]], e.get("problem", "")) for e in report])
        rows = [(e["name"], o["type"], o["gpu"], o["gpus"], o["vram_gib"], o["on_demand_usd_h"],
                 o["spot_usd_h"] if o["spot_usd_h"] is not None else "—", ", ".join(o["regions"]) or "none")
                for e in report for o in e["offers"]]
        if rows:
            table("offers", ["provider", "type", "GPU", "GPUs", "VRAM GiB", "on-demand $/h", "spot $/h",
                             "regions with capacity"], rows)
    if missing:
        if not as_json:
            out.print()
        raise BadInput("; ".join(missing))
    if failing:
        # It answered, but not with offers: a refused key, throttling, an outage, a wrong base_url (each said).
        raise OperationalError("no offers from " + "; ".join(failing))
    if unmatched:
        raise OperationalError(f"{app.config.source or 'the config'}: " + "; ".join(unmatched))
