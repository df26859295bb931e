"""`burstctl simcloud serve | preempt | status`: run the simulated cloud and poke at it.

`serve` is its own foreground process (so it outlives a daemon that crashes): the Lambda-contract REST API
(`providers.simcloud.api`), instances that are real SSH endpoints (`providers.simcloud.ssh_backend`) and, if
asked, a preemption scheduler (`providers.simcloud.preemption`). SIGTERM/SIGINT stop every instance and
leave no process behind. `preempt` and `status` talk to a running server's admin routes over HTTP.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Literal

import click
import httpx

from orchestrator.app import App
from orchestrator.cli.base import FiniteFloat, cli, json_option, pass_app
from orchestrator.cli.output import out, print_json, table
from orchestrator.config import ENV_NAME_EXPECTED, check_env_name, toml_value
from orchestrator.errors import BadInput, OperationalError
from orchestrator.records import fmt_usd

DEFAULT_PORT = 8790
# An instance in these states at the reclaim was released by its client during the notice: the preemption's work
# is done, and there is nothing left to reclaim.
# simcloud's words, and EC2's (the simulated EC2's admin routes are the same)
GONE_BEFORE_RECLAIM = ("terminating", "terminated", "shutting-down")
# The simulated EC2's record of an instance it reclaimed: `terminated` too (as EC2 shows it), with this reason.
EC2_SPOT_TERMINATION = "Server.SpotInstanceTermination"


@cli.group("simcloud")
def simcloud() -> None:
    """The simulated cloud: a Lambda-compatible API whose instances are real SSH endpoints on 127.0.0.1."""


# --- serve ----------------------------------------------------------------------------------------------------
def _parse_capacity(values: tuple[str, ...], catalog: dict[str, Any], regions: tuple[str, ...],
                    per_region: int) -> dict[str, dict[str, int]]:
    capacity = {t: dict.fromkeys(regions, per_region) for t in catalog}
    for item in values:
        target, sep, count = item.partition("=")
        type_name, _, region = target.partition("@")
        if not sep or not count.isdigit():
            raise BadInput(f"expected TYPE=N or TYPE@REGION=N, got {item!r}", field="--capacity")
        if type_name not in catalog:
            raise BadInput(f"unknown instance type {type_name!r} (known: {', '.join(catalog)})", field="--capacity")
        for r in [region] if region else regions:
            capacity[type_name][r] = int(count)
    return capacity


def _check_loopback(host: str) -> None:
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise BadInput(f"simcloud serves on loopback only, not {host!r}", field="--host")


def _ssh_mode(openssh: bool, paramiko: bool) -> Literal["auto", "openssh", "paramiko"]:
    """The SSH server the machines run: --openssh or --paramiko, one of them at most (unset: OpenSSH when
    installed). Both had been taken, the last one given winning."""
    if openssh and paramiko:
        raise BadInput("give --openssh or --paramiko, not both", field="--openssh")
    return "openssh" if openssh else "paramiko" if paramiko else "auto"


@simcloud.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Loopback address to serve on.")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
              help="HTTP port (0 picks a free one; the URL is printed).")
@click.option("--state", "state", type=str, default=None,
              help="simcloud state dir: instance records and sandboxes (default <state-dir>/simcloud).")
@click.option("--api-key-env", default=None, metavar="NAME",
              help="Env var holding the API key clients must send (default: providers.sim.api_key_env).")
@click.option("--boot-delay", type=FiniteFloat(min=0), default=0.0, show_default=True,
              help="Seconds an instance spends booting before its machine starts.")
@click.option("--capacity", multiple=True, metavar="TYPE[@REGION]=N",
              help="Instances of TYPE that may run per region (repeatable).")
@click.option("--preempt-trace", type=click.Path(dir_okay=False), default=None,
              help="Spot-traces JSON file driving preemptions of running spot instances.")
@click.option("--time-scale", type=FiniteFloat(min=0, min_open=True), default=1.0, show_default=True,
              help="Speed-up of trace/rate time: 600 plays a 600 s tick (and a 120 s notice) 600x faster.")
@click.option("--preempt-per-hour", type=FiniteFloat(min=0), default=None,
              help="Seeded random preemptions per (scaled) instance-hour instead of a trace.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --preempt-per-hour.")
@click.option("--openssh", is_flag=True, help="Instances run OpenSSH's sshd (must be installed).")
@click.option("--paramiko", is_flag=True, help="Instances run the pure-Python SSH server (not with --openssh).")
@click.option("--contract", type=click.Path(dir_okay=False, exists=True), default=None,
              help="OpenAPI document to check every request against (violations answer 400).")
@json_option
@pass_app
def serve_cmd(app: App, host: str, port: int, state: str | None, api_key_env: str | None, boot_delay: float,
              capacity: tuple[str, ...], preempt_trace: str | None, time_scale: float,
              preempt_per_hour: float | None, seed: int, openssh: bool, paramiko: bool, contract: str | None,
              as_json: bool) -> None:
    """Run simcloud in the foreground until SIGTERM/SIGINT."""
    from providers.simcloud.api import DEFAULT_CAPACITY_PER_REGION, DEFAULT_CATALOG, DEFAULT_REGIONS, SimCloudServer
    from providers.simcloud.preemption import (
        EC2_NOTICE_S,
        PoissonPreemptions,
        PreemptionScheduler,
        PreemptionSource,
        TracePreemptions,
    )
    from providers.simcloud.ssh_backend import MachineStartError, SshBackend

    _check_loopback(host)
    ssh_mode = _ssh_mode(openssh, paramiko)
    if preempt_trace is not None and preempt_per_hour is not None:
        raise BadInput("give --preempt-trace or --preempt-per-hour, not both", field="--preempt-trace")
    if api_key_env is not None:
        try:  # as the config's api_key_env: a key pasted here may also be a valid name (sk_live_…, ghp_…)
            check_env_name(api_key_env)
        except ValueError:
            raise BadInput(ENV_NAME_EXPECTED, field="--api-key-env") from None  # never the value: it may be the key
    key_env = api_key_env or app.config.providers.sim.api_key_env
    api_key = os.environ.get(key_env, "")
    if not api_key:
        raise BadInput(f"environment variable {key_env} is not set (it holds the API key clients must send)",
                       field="--api-key-env")
    catalog = {t.name: t for t in DEFAULT_CATALOG}
    capacities = _parse_capacity(capacity, catalog, DEFAULT_REGIONS, DEFAULT_CAPACITY_PER_REGION)
    state_dir = Path(state).expanduser() if state else app.config.state_dir / "simcloud"
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)

    source: PreemptionSource | None = None
    started_at = time.time()
    if preempt_trace is not None:
        try:
            source = TracePreemptions.from_file(preempt_trace, time_scale=time_scale, started_at=started_at)
        except ValueError as exc:
            raise BadInput(str(exc), field="--preempt-trace") from exc
    elif preempt_per_hour is not None:
        source = PoissonPreemptions(preempt_per_hour, seed=seed, time_scale=time_scale)

    try:
        backend = SshBackend(state_dir, prefer=ssh_mode)
    except MachineStartError as exc:
        raise BadInput(str(exc), field="--openssh") from exc
    try:
        server = SimCloudServer(api_key=api_key, host=host, port=port, backend=backend, capacity=capacities,
                                boot_delay_s=boot_delay, contract_path=contract, state_dir=state_dir)
    except OSError as exc:
        backend.close()
        raise OperationalError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from exc

    def emit(kind: str, data: dict[str, Any]) -> None:
        if as_json:
            sys.stdout.write(json.dumps({"event": kind, **data}) + "\n")
        else:
            sys.stdout.write(f"{kind} " + " ".join(f"{k}={v}" for k, v in data.items()) + "\n")
        sys.stdout.flush()

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    scheduler = (PreemptionScheduler(server, source, notice_lead_s=EC2_NOTICE_S / time_scale, on_event=emit)
                 if source is not None else None)
    try:
        server.start()
        if scheduler is not None:
            scheduler.start()
        emit("serving", {"url": server.url, "api_url": server.api_url, "ssh": backend.mode,
                         "state": str(state_dir), "pid": os.getpid(),
                         "preemptions": type(source).__name__ if source is not None else None})
        while not stop.wait(0.5):
            pass
    finally:
        if scheduler is not None:
            scheduler.stop()
        server.stop()  # stops every instance through the backend: no sshd, no job process left
    emit("stopped", {"url": server.url})


# --- preempt / status -----------------------------------------------------------------------------------------
def _admin_root(app: App, url: str | None) -> str:
    root = (url or app.config.providers.sim.base_url).rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise BadInput(f"expected an http(s) URL, got {root!r}", field="--url")
    return root.removesuffix("/api/v1")


def _admin(method: str, root: str, path: str, body: dict[str, Any] | None = None, *, field: str = "--url") -> Any:
    """One admin-route call; 400/404 are the caller's input (`field`), anything else is operational."""
    try:
        resp = httpx.request(method, root + path, json=body, timeout=30.0)
    except httpx.HTTPError as exc:
        raise OperationalError(f"simcloud is not reachable at {root} ({type(exc).__name__})") from exc
    try:
        doc = resp.json()
    except ValueError:
        doc = None
    if resp.status_code >= 400:
        err = doc.get("error") if isinstance(doc, dict) else None
        # simcloud answers {"error": {"message": ...}}, the simulated EC2 {"error": "..."}
        message = (err.get("message") if isinstance(err, dict) else err) or f"HTTP {resp.status_code}"
        if resp.status_code in (400, 404):
            raise BadInput(message, field=field)
        raise OperationalError(f"simcloud at {root}: {message}")
    return doc.get("data") if isinstance(doc, dict) else doc


@simcloud.command("ec2")
@click.option("--state", "state", type=str, default=None,
              help="State dir of its machines (default <state-dir>/simcloud-ec2).")
@click.option("--s3-checkpoints", is_flag=True,
              help="Also make a checkpoint bucket and an instance profile, and print the settings that use them.")
@click.option("--openssh", is_flag=True, help="Instances run OpenSSH's sshd (must be installed).")
@click.option("--paramiko", is_flag=True, help="Instances run the pure-Python SSH server (not with --openssh).")
@json_option
@pass_app
def ec2_cmd(app: App, state: str | None, s3_checkpoints: bool, openssh: bool, paramiko: bool, as_json: bool) -> None:
    """Run the simulated EC2 (moto's server, real machines behind it) in the foreground until SIGTERM/SIGINT, and
    print the [providers.ec2] settings that point burstctl at it."""
    from providers.simcloud.ec2_sim import SimEc2
    from providers.simcloud.ssh_backend import MachineStartError

    ssh_mode = _ssh_mode(openssh, paramiko)
    state_dir = Path(state).expanduser() if state else app.config.state_dir / "simcloud-ec2"
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    try:
        sim = SimEc2(state_dir, prefer=ssh_mode).start()
    except MachineStartError as exc:
        raise BadInput(str(exc), field="--openssh") from exc
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        settings = {**sim.provider_config(), **(sim.setup_checkpoint_bucket() if s3_checkpoints else {})}
        if as_json:
            print_json({"providers.ec2": settings, "admin_url": sim.admin_url, "pid": os.getpid()})
        else:
            lines = ["[providers.ec2]", *(f"{k} = {toml_value(v)}" for k, v in settings.items())]
            click.echo("# the simulated EC2 is serving; put this in burstctl.toml, and any AWS credentials in the\n"
                       "# environment (AWS_ACCESS_KEY_ID=simulated AWS_SECRET_ACCESS_KEY=simulated):\n"
                       + "\n".join(lines)
                       + f"\n# preempt and status: burstctl simcloud preempt|status --url {sim.admin_url}")
        sys.stdout.flush()
        while not stop.wait(0.5):
            pass
    finally:
        sim.close()  # kills every machine and its processes


def _records(root: str) -> list[dict[str, Any]]:
    """Instance records merged with their billing, oldest first (no public keys: noise, not status)."""
    bills = {b["instance_id"]: b for b in _admin("GET", root, "/_sim/billing")}
    merged = []
    for inst in _admin("GET", root, "/_sim/instances"):
        inst.pop("public_key", None)
        bill = bills.get(inst["id"], {})
        merged.append({**inst, **{k: bill.get(k) for k in ("market", "rate_usd_h", "runtime_s", "billed_s",
                                                            "cost_usd")}})
    return merged


@simcloud.command("preempt")
@click.argument("instance_id", metavar="INSTANCE")
@click.option("--notice-seconds", type=FiniteFloat(min=0), default=10.0, show_default=True,
              help="Seconds between the interruption notice and the preemption (EC2 gives 120).")
@click.option("--url", default=None, help="simcloud's URL (default: providers.sim.base_url).")
@json_option
@pass_app
def preempt_cmd(app: App, instance_id: str, notice_seconds: float, url: str | None, as_json: bool) -> None:
    """Force a spot preemption: post the notice, wait it out, reclaim the instance (its processes die). An instance
    its client terminated during the notice (as burstctl's daemon does) is reported already gone: exit 0."""
    root = _admin_root(app, url)
    record = next((r for r in _records(root) if r["id"] == instance_id), None)
    if record is None or record["status"] == "terminated":
        raise BadInput(f"no instance {instance_id} at {root}", field="INSTANCE")
    if record["market"] != "spot":
        raise BadInput(f"instance {instance_id} is {record['market']}; only spot instances are preempted",
                       field="INSTANCE")
    if record["status"] == "preempted":
        raise BadInput(f"instance {instance_id} is already preempted", field="INSTANCE")
    notice = _admin("POST", root, f"/_sim/instances/{instance_id}/notice", {"seconds": notice_seconds},
                    field="INSTANCE")
    if not as_json:
        out.print(f"notice posted: {instance_id} will be reclaimed at {notice['time']}")
    time.sleep(notice_seconds)
    refused: BadInput | None = None
    try:
        _admin("POST", root, f"/_sim/instances/{instance_id}/preempt", {"reason": "spot-preempted (forced)"},
               field="INSTANCE")
    except BadInput as exc:
        # INSTANCE was checked above, so this is no longer the caller's input: most likely a client (burstctl's
        # daemon does) acted on the notice and terminated the instance, which is what a notice is for.
        refused = exc
    after = next((r for r in _records(root) if r["id"] == instance_id), None)
    # simcloud's record says `status_reason`, the simulated EC2's `reason`.
    reason = (after.get("status_reason") or after.get("reason") or None) if after is not None else None
    already_gone = (after is not None and after["status"] in GONE_BEFORE_RECLAIM
                    and reason != EC2_SPOT_TERMINATION)  # terminated by this reclaim: EC2's word for preempted
    if after is None or (refused is not None and not already_gone):
        why = refused.detail if refused is not None else "the instance's record vanished"
        raise OperationalError(f"simcloud at {root} did not reclaim {instance_id}: {why}")
    if as_json:
        print_json({"instance_id": instance_id, "notice_time": notice["time"], "status": after["status"],
                    "reason": reason, "already_gone": already_gone})
    elif already_gone:
        out.print(f"already gone: {instance_id} was terminated during the notice (its client acted on it); "
                  "nothing left to reclaim")
    else:
        out.print(f"preempted: {instance_id} ({after['status']})")


@simcloud.command("status")
@click.option("--url", default=None, help="simcloud's URL (default: providers.sim.base_url).")
@json_option
@pass_app
def status_cmd(app: App, url: str | None, as_json: bool) -> None:
    """Instances, their state and what simcloud bills for them."""
    records = _records(_admin_root(app, url))
    if as_json:
        print_json(records)
        return
    table(None, ["instance", "type", "market", "region", "status", "reason", "ssh", "runtime", "cost"], [
        (r["id"], r["instance_type"], r.get("market"), r.get("region"), r["status"],
         r.get("status_reason") or r.get("reason"),
         f"{r['ssh_user']}@{r['host']}:{r['ssh_port']}" if r.get("ssh_port") else None,
         f"{r['runtime_s']:.0f} s" if r.get("runtime_s") is not None else None,
         fmt_usd(r.get("cost_usd"))) for r in records])
