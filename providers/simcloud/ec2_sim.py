"""The simulated EC2: moto's EC2 server with real machines behind its instances.

moto answers the EC2 API faithfully but its instances are records only. This puts a machine behind each one, so
the daemon runs the whole lifecycle against boto3 and moto's server exactly as against AWS:

- A VPC of 127.0.0.0/16 with one subnet per zone, so every instance's private address is a loopback address
  (Linux routes all of 127/8 to lo). Each running instance gets an SSH endpoint (`SshBackend`) on
  `<private ip>:<ssh_port>` authorised for the key pair it was launched with; burstctl reaches it with
  `providers.ec2.ssh_address = "private"`, as it would through a VPN or bastion.
- A metadata service per instance (`$AWS_EC2_METADATA_SERVICE_ENDPOINT` in its sessions, the AWS SDKs' own
  override): 404 until a spot interruption notice, then the notice JSON; IMDSv2 tokens are handed out; an
  instance launched with an IAM instance profile gets its role's credentials there, as on EC2.
- The image: the sessions' `python3` is this process's interpreter (boto3 included, like a deep-learning AMI),
  and `$AWS_ENDPOINT_URL_S3` points boto3 on the instance at moto's S3 (the in-region endpoint).
  `setup_checkpoint_bucket()` does the account set-up S3 checkpoints need: a bucket, a role, a profile.
- A level-triggered loop compares moto's instances with the machines every `poll_s`: a running instance without a
  machine gets one; a machine whose instance stopped or terminated is killed with its processes and disk.
- Spot interruption (`preempt`): the notice, then the machine dies and moto's record becomes terminated with
  reason `Server.SpotInstanceTermination`, as AWS reports it.
- A billing record: per-second from the instance's launch to the moment its end was observed, 60 s minimum.
- A spot market for the instance types in `spot_prices` (moto quotes a flat $0.00001 for the types it knows
  and nothing for retired ones such as p3): DescribeSpotPriceHistory answers with those prices in every zone.
  Spot capacity (`set_spot_capacity`, or `POST /_sim/capacity`): unlimited unless set; once a type's spot
  instances in a zone reach it, RunInstances for spot there fails with `InsufficientInstanceCapacity`, as EC2's
  does (moto never refuses), so the daemon meets the real error code and not a stand-in.

It lives in the process that hosts moto's server (in-process access to moto's backend is how a spot
interruption is written into moto's records); the daemon is a separate process that sees only HTTP and SSH.
Admin routes on the metadata server (`/_sim/instances/<id>/notice`, `/preempt`, `/_sim/instances`,
`/_sim/billing`, `/_sim/capacity`) mirror simcloud's, so the same test helpers drive both clouds.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
from moto.core import DEFAULT_ACCOUNT_ID
from moto.core.responses import ActionResult
from moto.ec2.models import ec2_backends
from moto.ec2.models.instances import StateReason
from moto.ec2.responses.instances import InstanceResponse
from moto.ec2.responses.spot_instances import SpotInstances
from moto.server import ThreadedMotoServer
from werkzeug.exceptions import InternalServerError

from providers.ec2 import SPOT_TERMINATION
from providers.simcloud.ssh_backend import MachineStartError, Prefer, SshBackend

BILLING_MINIMUM_S = 60.0
LOOPBACK_VPC = "127.0.0.0/16"
IMDS_VAR = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
_ADMIN = re.compile(r"^/_sim/instances/(?P<id>[A-Za-z0-9-]+)/(?P<verb>notice|preempt)$")
_IMDS = re.compile(r"^/(?P<id>i-[0-9a-f]+)/latest/(?P<rest>.*)$")
_CREDENTIALS = "meta-data/iam/security-credentials/"
_MOTO_RUN_INSTANCES = InstanceResponse.run_instances
# A request's access key and service, from its SigV4 Authorization header.
_SIGNED_BY = re.compile(r"Credential=(?P<key>[^/,\s]+)/[^/]*/[^/]*/(?P<service>[^/,\s]+)/")


@dataclass
class _Record:
    instance_id: str
    instance_type: str
    market: str
    started_at: float  # wall clock, from moto's launch time
    ended_at: float | None = None
    preempted: bool = False


class SimEc2:
    """moto's EC2 server plus machines, metadata and billing. One per process (moto's backends are global)."""

    def __init__(self, state_dir: str | Path, *, region: str = "us-east-1",
                 zones: tuple[str, ...] = ("us-east-1a", "us-east-1b"), prefer: Prefer = "auto",
                 poll_s: float = 0.1, spot_prices: Mapping[str, float] | None = None,
                 on_demand_prices: Mapping[str, float] | None = None) -> None:
        self.state_dir = Path(state_dir)
        # The paper's p3.2xlarge prices (Wu et al., NSDI 2024), the instance type of `burstctl simulate`'s (a).
        self.spot_prices = dict(spot_prices if spot_prices is not None else {"p3.2xlarge": 0.9731})
        self.on_demand_prices = dict(on_demand_prices if on_demand_prices is not None else {"p3.2xlarge": 3.06})
        self.region = region
        self.zones = zones
        self.poll_s = poll_s
        self.machines = SshBackend(self.state_dir, prefer=prefer)
        self.ssh_port = _free_port_everywhere()
        self.subnet_ids: dict[str, str] = {}
        self.endpoint_url = ""
        self.admin_url = ""
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._http: ThreadingHTTPServer | None = None
        self._notices: dict[str, dict[str, str]] = {}
        self._spot_capacity: dict[tuple[str, str], int] = {}  # (instance type, zone) → spot instances it holds
        self._records: dict[str, _Record] = {}
        self._booted: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self.last_error: str | None = None  # of the reconcile loop, for whoever debugs a test
        self.refused_key: str | None = None  # `refuse_key`

    # --- life -------------------------------------------------------------------------------------------------
    def start(self) -> SimEc2:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request at INFO
        _quote_spot_prices(self.spot_prices, self.zones)
        _refuse_spot_beyond_capacity(self)
        self._moto.start()
        # moto's werkzeug server looks its app up at every request: wrapped, it can refuse a key (`refuse_key`).
        server = self._moto._server
        assert server is not None
        server.app = _refusing(server.app, self)
        host, port = self._moto.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        # moto's records outlive a server in this process: start from an empty account, as a fresh cloud would.
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST"),
                               timeout=30).close()
        ec2 = boto3.client("ec2", region_name=self.region, endpoint_url=self.endpoint_url,
                           aws_access_key_id="simulated", aws_secret_access_key="simulated")
        vpc = ec2.create_vpc(CidrBlock=LOOPBACK_VPC)["Vpc"]["VpcId"]
        for k, zone in enumerate(self.zones, start=1):
            subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=f"127.0.{k}.0/24", AvailabilityZone=zone)
            self.subnet_ids[zone] = subnet["Subnet"]["SubnetId"]
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.admin_url = f"http://127.0.0.1:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, name="sim-ec2-http", daemon=True).start()
        self._loop = threading.Thread(target=self._run, name="sim-ec2-machines", daemon=True)
        self._loop.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._loop is not None:
            self._loop.join(10)
        self.machines.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self._moto.stop()

    def refuse_key(self, access_key_id: str | None) -> None:
        """Refuse every request signed with `access_key_id` (None: refuse none), as AWS answers a key revoked or
        rotated, or a session's that expired: EC2 with AuthFailure (401), S3 with InvalidAccessKeyId (403). An
        instance role's credentials are other keys, and go on working."""
        self.refused_key = access_key_id

    def setup_checkpoint_bucket(self, bucket: str = "burstctl-checkpoints",
                                profile: str = "burstctl-checkpoints") -> dict[str, Any]:
        """What a user does once for S3 checkpoints: a bucket, and an instance profile whose role the instances
        get credentials of. Returns the `[providers.ec2]` settings that use them."""
        session = boto3.Session(aws_access_key_id="simulated", aws_secret_access_key="simulated",
                                region_name=self.region)
        session.client("s3", endpoint_url=self.endpoint_url).create_bucket(Bucket=bucket)
        iam = session.client("iam", endpoint_url=self.endpoint_url)
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                         "Principal": {"Service": "ec2.amazonaws.com"}}]}
        iam.create_role(RoleName=profile, AssumeRolePolicyDocument=json.dumps(trust))
        iam.create_instance_profile(InstanceProfileName=profile)
        iam.add_role_to_instance_profile(InstanceProfileName=profile, RoleName=profile)
        return {"checkpoint_bucket": bucket, "instance_profile": profile, "s3_endpoint_url": self.endpoint_url}

    def provider_config(self) -> dict[str, Any]:
        """The `[providers.ec2]` settings that point burstctl at this cloud."""
        return {"enabled": True, "region": self.region, "endpoint_url": self.endpoint_url,
                "zones": list(self.zones), "subnet_ids": dict(self.subnet_ids), "ssh_address": "private",
                "ssh_port": self.ssh_port, "ssh_user": self.machines.user}

    # --- the cloud's side ---------------------------------------------------------------------------------------
    def notice(self, instance_id: str, seconds: float = 120.0) -> dict[str, str]:
        """Post a spot interruption notice: the instance is reclaimed `seconds` from now (by `preempt`)."""
        self._instance(instance_id)  # KeyError for an unknown instance
        when = datetime.fromtimestamp(time.time() + seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        notice = {"action": "terminate", "time": when}
        with self._lock:
            self._notices[instance_id] = notice
        return notice

    def preempt(self, instance_id: str) -> bool:
        """Reclaim a spot instance now: its processes die, moto records a spot termination. False if already gone."""
        inst = self._instance(instance_id)
        if inst.lifecycle != "spot":
            raise ValueError(f"{instance_id} is an on-demand instance: EC2 never interrupts those")
        with self._lock:
            if inst._state.name == "terminated":
                return False
            record = self._records.get(instance_id)
            if record is not None:
                record.preempted = True
        self.machines.stop(instance_id)
        with self._lock:
            inst.terminate()
            inst.state_reason = StateReason(f"{SPOT_TERMINATION}: Spot instance termination", SPOT_TERMINATION)
            self._end(instance_id)
        return True

    def set_spot_capacity(self, instance_type: str, count: int | None, zone: str | None = None) -> None:
        """How many spot instances of this type a zone (every zone: None) holds; None: unlimited."""
        with self._lock:
            for z in (zone,) if zone else self.zones:
                if count is None:
                    self._spot_capacity.pop((instance_type, z), None)
                else:
                    self._spot_capacity[(instance_type, z)] = max(int(count), 0)

    def spot_refusal(self, instance_type: str, subnet_id: str | None, zone: str | None) -> str | None:
        """Why a spot launch of this type in this subnet or zone is refused now (EC2's message), else None."""
        zone = next((z for z, s in self.subnet_ids.items() if s == subnet_id), zone or f"{self.region}a")
        with self._lock:
            limit = self._spot_capacity.get((instance_type, zone))
            if limit is None:
                return None
            used = sum(1 for inst in self._backend().all_instances()
                       if inst.lifecycle == "spot" and inst.instance_type == instance_type
                       and inst.availability_zone == zone and inst._state.name in ("pending", "running"))
        if used < limit:
            return None
        return (f"We currently do not have sufficient {instance_type} capacity in the Availability Zone you "
                f"requested ({zone}). Our system will be working on provisioning additional capacity.")

    def instances(self) -> list[dict[str, Any]]:
        """moto's instances with their machines; `region` (the zone), `host`, `ssh_port` and `ssh_user` as simcloud's
        admin route names them, the SSH endpoint only while a machine is up."""
        with self._lock:
            out = []
            machines = set(self.machines.instance_ids())
            for inst in self._backend().all_instances():
                tags = [{"key": t["key"], "value": t["value"]} for t in inst.get_tags()]
                up = inst.id in machines
                out.append({"id": inst.id, "status": inst._state.name, "private_ip": inst.private_ip,
                            "name": next((t["value"] for t in tags if t["key"] == "Name"), ""),
                            "instance_type": inst.instance_type, "region": inst.availability_zone,
                            "reason": inst.state_reason.code if inst.state_reason else None,
                            "tags": tags, "machine": up,
                            "host": inst.private_ip if up else None, "ssh_port": self.ssh_port if up else None,
                            "ssh_user": self.machines.user if up else None})
            return out

    def billing(self) -> list[dict[str, Any]]:
        """Per instance: billed seconds (launch to observed end, 60 s minimum) so far, the rate and the cost."""
        now = time.time()
        with self._lock:
            rows = []
            for r in self._records.values():
                seconds = max(BILLING_MINIMUM_S, (r.ended_at or now) - r.started_at)
                prices = self.spot_prices if r.market == "spot" else self.on_demand_prices
                rate = prices.get(r.instance_type, 0.0)
                rows.append({"instance_id": r.instance_id, "instance_type": r.instance_type, "market": r.market,
                             "runtime_s": round(max(0.0, (r.ended_at or now) - r.started_at), 3),
                             "billed_s": round(seconds, 3), "rate_usd_h": rate,
                             "cost_usd": round(seconds * rate / 3600, 6), "open": r.ended_at is None,
                             "preempted": r.preempted})
            return rows

    # --- the reconcile loop: moto's records → machines ----------------------------------------------------------
    def _backend(self) -> Any:
        return ec2_backends[DEFAULT_ACCOUNT_ID][self.region]

    def _instance(self, instance_id: str) -> Any:
        inst = self._backend().get_instance_by_id(instance_id)
        if inst is None:
            raise KeyError(instance_id)
        return inst

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception as exc:  # a bad pass must not end the simulated cloud; the next one retries
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._stop.wait(self.poll_s)

    def reconcile(self) -> None:
        """One pass: boot machines for running instances, kill those of instances that are no longer running."""
        with self._lock:
            snapshot = [(inst.id, inst._state.name, inst.private_ip, inst.key_name, inst.instance_type,
                         inst.lifecycle, inst.launch_time) for inst in self._backend().all_instances()]
            keys = {name: kp.material_public.decode() for name, kp in self._backend().key_pairs.items()
                    if kp.material_public}
        for iid, state, ip, key_name, itype, lifecycle, launched in snapshot:
            with self._lock:
                record = self._records.setdefault(iid, _Record(iid, itype, "on-demand", _wall(launched)))
                # moto marks a spot instance after creating it: a pass can see it in between, so look every time.
                record.market = "spot" if lifecycle == "spot" else "on-demand"
            if state == "running" and iid not in self._booted and _loopback(ip) and key_name in keys:
                self._boot(iid, ip, keys[key_name])
            elif state != "running":
                if iid in self._booted:
                    self.machines.stop(iid)
                    self._booted.discard(iid)
                with self._lock:
                    self._end(iid)

    def _boot(self, instance_id: str, ip: str, public_key: str) -> None:
        try:
            self.machines.start(instance_id, public_key, host=ip, port=self.ssh_port, env=self._image_env(instance_id))
        except (MachineStartError, OSError, ValueError):
            return  # as an instance that never becomes reachable: the daemon's boot timeout handles it
        self._booted.add(instance_id)

    def _image_env(self, instance_id: str) -> dict[str, str]:
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")])
        return {IMDS_VAR: f"{self.admin_url}/{instance_id}", "AWS_ENDPOINT_URL_S3": self.endpoint_url,
                "AWS_DEFAULT_REGION": self.region, "PATH": path}

    def _role_of(self, instance_id: str) -> str | None:
        association = self._backend().iam_instance_profile_associations.get(instance_id)
        roles = association.iam_instance_profile.roles if association is not None else []
        return roles[0].name if roles else None

    def _end(self, instance_id: str) -> None:
        record = self._records.get(instance_id)
        if record is not None and record.ended_at is None:
            record.ended_at = time.time()

    # --- metadata and admin over HTTP ---------------------------------------------------------------------------
    def _credentials(self, instance_id: str, role: str) -> tuple[int, Any]:
        """The instance role's temporary credentials (moto's S3 accepts any), as EC2's metadata service shows."""
        with self._lock:
            actual = self._role_of(instance_id)
        if actual is None or role not in ("", actual):
            return 404, "Not Found"
        if role == "":
            return 200, actual
        expires = datetime.fromtimestamp(time.time() + 6 * 3600, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return 200, {"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": "ASIASIMULATEDROLE000",
                     "SecretAccessKey": "simulated-role-secret", "Token": "simulated-role-token",
                     "Expiration": expires, "LastUpdated": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}

    def handle(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if method == "GET" and (m := _IMDS.match(path)):
            rest = m.group("rest")
            if rest.startswith(_CREDENTIALS):
                return self._credentials(m.group("id"), rest[len(_CREDENTIALS):])
            if rest != "meta-data/spot/instance-action":
                return 404, "Not Found"
            with self._lock:
                notice = self._notices.get(m.group("id"))
            return (200, notice) if notice else (404, "Not Found")
        if method == "PUT" and (m := _IMDS.match(path)) and m.group("rest") == "api/token":
            return 200, "simulated-imds-token"
        if method == "GET" and path == "/_sim/instances":
            return 200, {"data": self.instances()}
        if method == "GET" and path == "/_sim/billing":
            return 200, {"data": self.billing()}
        if method == "POST" and path == "/_sim/capacity":
            count = body.get("count")
            if not isinstance(body.get("instance_type"), str) or not (count is None or isinstance(count, int)):
                return 400, {"error": "expected {\"instance_type\": str, \"count\": int or null, \"zone\": str}"}
            self.set_spot_capacity(body["instance_type"], count, body.get("zone"))
            return 200, {"data": {"instance_type": body["instance_type"], "count": count}}
        if method == "POST" and (m := _ADMIN.match(path)):
            try:
                if m.group("verb") == "notice":
                    return 200, {"data": self.notice(m.group("id"), float(body.get("seconds", 120.0)))}
                return (200, {"data": {"preempted": True}}) if self.preempt(m.group("id")) else (404, {"error": "gone"})
            except KeyError:
                return 404, {"error": f"no instance {m.group('id')}"}
            except ValueError as exc:
                return 409, {"error": str(exc)}
        return 404, {"error": "not found"}


def _handler(sim: SimEc2) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                body = {}
            code, payload = sim.handle(self.command, self.path, body if isinstance(body, dict) else {})
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PUT = do_POST = _serve

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def _quote_spot_prices(prices: Mapping[str, float], zones: tuple[str, ...]) -> None:
    """Make moto's DescribeSpotPriceHistory quote `prices` (per instance type, in every zone) as of now.

    moto's response hard-codes its price, so the response method is replaced; moto's backends are per process
    anyway, hence one simulated EC2 per process."""
    def describe_spot_price_history(self: SpotInstances) -> ActionResult:
        asked = self._get_param("InstanceTypes", []) or list(prices)
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        return ActionResult({"SpotPriceHistory": [
            {"InstanceType": t, "ProductDescription": "Linux/UNIX (Amazon VPC)", "SpotPrice": f"{prices[t]:.6f}",
             "AvailabilityZone": z, "Timestamp": stamp} for t in asked if t in prices for z in zones]})

    SpotInstances.describe_spot_price_history = describe_spot_price_history  # type: ignore[method-assign]


def _refuse_spot_beyond_capacity(sim: SimEc2) -> None:
    """Make moto's RunInstances refuse a spot launch beyond `sim`'s spot capacity, with EC2's own error code."""
    def run_instances(self: InstanceResponse) -> ActionResult:
        if self._get_param("InstanceMarketOptions.MarketType") == "spot":
            why = sim.spot_refusal(self._get_param("InstanceType", "m1.small"), self._get_param("SubnetId"),
                                   self._get_param("Placement.AvailabilityZone"))
            if why is not None:  # a server error on EC2 (HTTP 500), as `InsufficientInstanceCapacity` is there
                raise InternalServerError(description=(
                    '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>'
                    f"InsufficientInstanceCapacity</Code><Message>{why}</Message></Error></Errors>"
                    f"<RequestID>{uuid.uuid4()}</RequestID></Response>"))
        return _MOTO_RUN_INSTANCES(self)

    InstanceResponse.run_instances = run_instances  # type: ignore[method-assign]


def _refusing(app: Any, sim: SimEc2) -> Any:
    """moto's WSGI app, refusing the requests signed with `sim.refused_key` as AWS does."""
    def serve(environ: dict[str, Any], start_response: Any) -> Any:
        signed = _SIGNED_BY.search(environ.get("HTTP_AUTHORIZATION", ""))
        if sim.refused_key is None or signed is None or signed.group("key") != sim.refused_key:
            return app(environ, start_response)
        if signed.group("service") == "ec2":
            status, body = "401 Unauthorized", (
                "<Response><Errors><Error><Code>AuthFailure</Code><Message>AWS was not able to validate the provided "
                "access credentials</Message></Error></Errors><RequestID>refused</RequestID></Response>")
        else:
            status, body = "403 Forbidden", (
                "<Error><Code>InvalidAccessKeyId</Code><Message>The AWS Access Key Id you provided does not exist "
                "in our records.</Message><RequestId>refused</RequestId></Error>")
        data = ('<?xml version="1.0" encoding="UTF-8"?>' + body).encode()
        start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(data)))])
        return [data]
    return serve


def _loopback(ip: str | None) -> bool:
    if not ip:
        return False
    return ipaddress.ip_address(ip) in ipaddress.ip_network(LOOPBACK_VPC)


def _wall(launched: Any) -> float:
    if isinstance(launched, datetime):
        return (launched if launched.tzinfo else launched.replace(tzinfo=UTC)).timestamp()
    if isinstance(launched, str):
        return datetime.fromisoformat(launched.replace("Z", "+00:00")).timestamp()
    return time.time()


def _free_port_everywhere() -> int:
    """A port free on the wildcard address, hence on every 127.x address the instances will listen on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])
