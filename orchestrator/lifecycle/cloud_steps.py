"""The runbook steps of a cloud attempt, over SSH: bootstrap, push the workdir, push the newest checkpoint, start
the supervisor; then poll it, pull checkpoints, and ask it for a last checkpoint. Each step is idempotent, so a
daemon that died midway simply runs it again.

Remote layout, under the login directory of the instance:
    burst/runbooks/                 supervisor.py, burst_checkpoint.py (stdlib-only)
    burst/<job>/work/               the job's workdir
    burst/<job>/checkpoints/<name>/ complete checkpoints (manifest last, atomic rename)
    burst/<job>/<attempt>/run/      supervisor files: pid, heartbeat, exit.json, logs, metrics.json
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from orchestrator.app import App
from orchestrator.lifecycle import checkpoints
from orchestrator.remote import ssh, sync
from providers.base import InstanceInfo, Provider
from runbooks import burst_checkpoint
from state import schema as s

RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
RUNBOOK_FILES = ("supervisor.py", "burst_checkpoint.py")
EXCLUDE = (".git", "__pycache__", "*.pyc", ".venv")


class DbHostKeyTrust:
    """Trust-on-first-use host keys, recorded per instance in the instances table."""

    def __init__(self, app: App, provider: str):
        self.app = app
        self.provider = provider

    def get(self, instance_id: str) -> str | None:
        with self.app.store.engine.connect() as c:
            return c.execute(select(s.instances.c.host_key).where(s.instances.c.provider == self.provider,
                                                                  s.instances.c.id == instance_id)).scalar()

    def put(self, instance_id: str, key: str) -> None:
        with self.app.store.tx() as c:
            c.execute(update(s.instances).where(s.instances.c.provider == self.provider,
                                                s.instances.c.id == instance_id).values(host_key=key))
        self.app.events.emit("instance.host_key_recorded", provider=self.provider, instance=instance_id,
                             key_type=key.split()[0])


def orchestrator_key(app: App) -> tuple[Path, str]:
    """The orchestrator's SSH key pair (<state>/ssh/id_ed25519, mode 0600), created on first use."""
    path = app.config.state_dir / "ssh" / "id_ed25519"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        ssh.generate_keypair(path)
    return path, Path(f"{path}.pub").read_text().strip()


def notice_url(provider: Provider, instance_id: str) -> str | None:
    """Where the instance polls for a spot interruption notice (EC2 semantics), if its cloud has one."""
    if provider.name == "ec2":
        return "http://169.254.169.254/latest/meta-data/spot/instance-action"
    if provider.name == "sim":
        root = provider.base_url.removesuffix("/").removesuffix("/api/v1")  # type: ignore[attr-defined]
        return f"{root}/_sim/instances/{instance_id}/latest/meta-data/spot/instance-action"
    return None


class CloudSteps:
    def __init__(self, app: App, providers: Mapping[str, Provider]):
        self.app = app
        self.providers = providers
        self.key_path, self.public_key = orchestrator_key(app)

    # --- targets ----------------------------------------------------------------------------------------------
    def target(self, att: dict[str, Any], inst: InstanceInfo | None = None) -> ssh.Target:
        info = att["info"]
        host = inst.host if inst else info["host"]
        port = inst.ssh_port if inst else info["port"]
        user = inst.ssh_user if inst else info["user"]
        pinned = inst.host_key if inst else None
        if pinned is None:
            with self.app.store.engine.connect() as c:
                pinned = c.execute(select(s.instances.c.host_key).where(
                    s.instances.c.provider == att["provider"], s.instances.c.id == att["instance_id"])).scalar()
        return ssh.Target(host=host, port=int(port), user=user, key_path=self.key_path, host_key=pinned,
                          instance_id=att["instance_id"])

    def trust(self, att: dict[str, Any]) -> DbHostKeyTrust:
        return DbHostKeyTrust(self.app, att["provider"])

    def reachable(self, att: dict[str, Any], target: ssh.Target) -> bool:
        """One connection attempt; a changed host key raises (the attempt is aborted), unreachable is False."""
        try:
            conn = ssh.connect(target, trust=self.trust(att), timeout_s=5)
        except ssh.SshUnavailable:
            return False
        conn.close()
        if target.host_key:  # pinned by the provider: record it, so later steps verify against the same key
            trust = self.trust(att)
            if trust.get(att["instance_id"]) is None:
                trust.put(att["instance_id"], target.host_key)
        return True

    # --- bootstrap and start ------------------------------------------------------------------------------------
    def bootstrap_and_start(self, att: dict[str, Any], job: dict[str, Any], resume_from: Path | None
                            ) -> dict[str, float]:
        target, trust = self.target(att), self.trust(att)
        timings: dict[str, float] = {}
        spec = job["spec"]
        conn = ssh.connect(target, trust=trust)
        try:
            t = time.monotonic()
            home = ssh.run(conn, ["python3", "-c", "import os; print(os.getcwd())"], timeout=60).stdout.strip()
            base = f"{home}/burst"
            jobdir = f"{base}/{job['id']}"
            run_dir = f"{jobdir}/{att['id']}/run"
            ssh.run(conn, ["mkdir", "-p", f"{base}/runbooks", f"{jobdir}/work", f"{jobdir}/checkpoints", run_dir])
            for name in RUNBOOK_FILES:
                conn.put(str(RUNBOOKS / name), f"{base}/runbooks/{name}")
            env = {**spec.get("env", {}), "PYTHONPATH": f"{base}/runbooks"}
            conn.put(io.StringIO("".join(f"{k}={v}\n" for k, v in env.items())), f"{run_dir}/job.env")
            timings["bootstrap"] = time.monotonic() - t
        finally:
            conn.close()

        t = time.monotonic()
        ckpt_rel = spec.get("checkpoint", {}).get("dir", "checkpoints")
        sync.push_dir(target, trust, spec["workdir"], f"{jobdir}/work", exclude=(*EXCLUDE, ckpt_rel))
        timings["push_workdir"] = time.monotonic() - t

        remote_resume = None
        if resume_from is not None:
            t = time.monotonic()
            pushed = sync.push_checkpoint(target, trust, checkpoints.store_dir(self.app.config, job["id"]),
                                          f"{jobdir}/checkpoints")
            timings["push_checkpoint"] = time.monotonic() - t
            if pushed is not None:
                remote_resume = f"{jobdir}/checkpoints/{resume_from.name}"

        t = time.monotonic()
        argv = ["python3", f"{base}/runbooks/supervisor.py", "--run-dir", run_dir, "--job-id", job["id"],
                "--attempt", str(att["n"]), "--checkpoint-dir", f"{jobdir}/checkpoints", "--workdir", f"{jobdir}/work",
                "--env-file", f"{run_dir}/job.env", "--gpus", str(spec.get("gpus", 1)), "--daemonize"]
        if spec.get("torchrun"):
            argv.append("--torchrun")
        if remote_resume:
            argv += ["--resume-from", remote_resume]
        url = notice_url(self.providers[att["provider"]], att["instance_id"])
        if url:
            argv += ["--metadata-url", url]
        argv += ["--", *spec["command"]]
        conn = ssh.connect(target, trust=trust)
        try:
            ssh.run(conn, argv, timeout=120)
        finally:
            conn.close()
        timings["start"] = time.monotonic() - t
        with self.app.store.tx() as c:
            c.execute(update(s.attempts).where(s.attempts.c.id == att["id"]).values(
                info={**att["info"], "remote_base": base, "remote_run": run_dir}))
        att["info"] = {**att["info"], "remote_base": base, "remote_run": run_dir}
        return {k: round(v, 4) for k, v in timings.items()}

    # --- while running ------------------------------------------------------------------------------------------
    def _remote(self, att: dict[str, Any]) -> tuple[str, str]:
        base = att["info"]["remote_base"]
        return base, att["info"]["remote_run"]

    def status(self, att: dict[str, Any]) -> dict[str, Any] | None:
        """The supervisor's status, or None when the instance cannot be reached over SSH."""
        base, run_dir = self._remote(att)
        try:
            conn = ssh.connect(self.target(att), trust=self.trust(att), timeout_s=5)
        except ssh.SshUnavailable:
            return None
        try:
            res = ssh.run(conn, ["python3", f"{base}/runbooks/supervisor.py", "status", "--run-dir", run_dir],
                          timeout=30)
        except ssh.SshUnavailable:
            return None
        finally:
            conn.close()
        return json.loads(res.stdout.strip().splitlines()[-1])

    def pull(self, att: dict[str, Any], job: dict[str, Any]) -> list[Path]:
        base, _ = self._remote(att)
        store = checkpoints.store_dir(self.app.config, job["id"])
        # The daemon and `revert-local` may pull the same job at once: one at a time per job's store.
        with checkpoints.store_lock(self.app.config, job["id"]):
            pulled = sync.pull_checkpoints(self.target(att), self.trust(att), f"{base}/{job['id']}/checkpoints",
                                           store, newest_only=True)
            if pulled:
                burst_checkpoint.prune(store, keep=checkpoints.KEEP)  # multi-GB checkpoints: keep the newest few
        return list(pulled)

    def request_checkpoint(self, att: dict[str, Any]) -> None:
        """SIGTERM through the supervisor: the trainer writes a last checkpoint and exits."""
        base, run_dir = self._remote(att)
        conn = ssh.connect(self.target(att), trust=self.trust(att), timeout_s=10)
        try:
            ssh.run(conn, ["python3", f"{base}/runbooks/supervisor.py", "stop", "--run-dir", run_dir], timeout=60)
        finally:
            conn.close()

    def wait_exit(self, att: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.status(att)
            if st is None or st.get("exit") is not None or not st.get("supervisor_alive"):
                return st
            time.sleep(0.5)
        return None
