"""The runbook steps of a cloud attempt, over SSH: bootstrap, push the workdir, push the newest checkpoint, start
the supervisor; then poll it, pull checkpoints and logs, and ask it for a last checkpoint. Each step is idempotent, so a
daemon that died midway simply runs it again.

Checkpoints travel over SSH, or through S3 when the provider has a checkpoint store (EC2 with
`checkpoint_bucket`): then the instance uploads them in-region (the supervisor's `--s3-uri`), the daemon downloads
them home from S3 (whether or not the instance still exists), and a resumed attempt downloads its starting point
in-region. An attempt whose instance cannot upload (no boto3, no credentials) falls back to SSH.

Remote layout, under the login directory of the instance:
    burst/runbooks/                 supervisor.py, burst_checkpoint.py (stdlib-only), burst_hf.py (for HF trainers)
    burst/<job>/work/               the job's workdir
    burst/<job>/setup/              the job's setup (spec `setup`): its lock, log and done record
    burst/<job>/checkpoints/<name>/ complete checkpoints (manifest last, atomic rename)
    burst/<job>/<attempt>/run/      supervisor files: pid, heartbeat, exit.json, logs, metrics.json
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from orchestrator.app import App
from orchestrator.jobspec import JobSpec, rsync_exclude
from orchestrator.lifecycle import checkpoints, passenv
from orchestrator.lifecycle.homes import attempt_run_dir, job_outputs_dir
from orchestrator.lifecycle.local import IN_TICK_STOP_MAX_S, stop_grace_s, work_units_env
from orchestrator.lifecycle.machine import AttemptState
from orchestrator.remote import ssh, sync
from providers.base import InstanceInfo, Provider
from runbooks import supervisor
from runbooks.checkpoint_transfer import PulledCheckpoints, TransferError, TransferStats
from runbooks.s3_checkpoints import S3CheckpointStore
from state import schema as s

RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
RUNBOOK_FILES = ("bootstrap.sh", "supervisor.py", "burst_checkpoint.py", "checkpoint_transfer.py",
                 "s3_checkpoints.py", "burst_hf.py")
EXCLUDE = (".git", "__pycache__", "*.pyc", ".venv")  # at any depth, whatever the job says


def push_exclude(spec: Mapping[str, Any]) -> list[str]:
    """What the push of a job's workdir to an instance leaves out, as rsync's patterns: EXCLUDE, the job's
    checkpoint.dir (that directory of the workdir, not one of the same name deeper), and the job's own `exclude`
    (none for a job queued before it existed)."""
    ckpt = posixpath.normpath(spec.get("checkpoint", {}).get("dir", "checkpoints"))
    literal = re.sub(r"([*?\[\\])", r"\\\1", ckpt) if re.search(r"[*?\[]", ckpt) else ckpt  # a name, not a pattern
    return [*EXCLUDE, f"/{literal}", *(rsync_exclude(p) for p in spec.get("exclude") or [])]


class DbHostKeyTrust:
    """Trust-on-first-use host keys, recorded per instance in the instances table. `attempt`: the attempt whose
    instance it is, whose job and attempt ids the `instance.host_key_recorded` event carries (`events --job`)."""

    def __init__(self, app: App, provider: str, attempt: Mapping[str, Any] | None = None):
        self.app = app
        self.provider = provider
        self.ids = {"job_id": attempt["job_id"], "attempt_id": attempt["id"]} if attempt is not None else {}

    def get(self, instance_id: str) -> str | None:
        with self.app.store.engine.connect() as c:
            return c.execute(select(s.instances.c.host_key).where(s.instances.c.provider == self.provider,
                                                                  s.instances.c.id == instance_id)).scalar()

    def put(self, instance_id: str, key: str) -> None:
        with self.app.store.tx() as c:
            c.execute(update(s.instances).where(s.instances.c.provider == self.provider,
                                                s.instances.c.id == instance_id).values(host_key=key))
        self.app.events.emit("instance.host_key_recorded", provider=self.provider, instance=instance_id,
                             key_type=key.split()[0], **self.ids)


def orchestrator_key(app: App) -> tuple[Path, str]:
    """The orchestrator's SSH key pair (<state>/ssh/id_ed25519, mode 0600), created on first use."""
    path = app.config.state_dir / "ssh" / "id_ed25519"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        ssh.generate_keypair(path)
    return path, Path(f"{path}.pub").read_text().strip()


def notice_url(provider: Provider, instance_id: str) -> str | None:
    """Where the instance polls for a spot interruption notice (EC2 semantics), if its cloud has one."""
    ask = getattr(provider, "spot_notice_url", None)  # optional capability
    return ask(instance_id) if ask is not None else None


def write_remote_env_file(conn: Any, path: str, env: Mapping[str, str]) -> None:
    """The run's env file on the instance, private (0600) from the moment it exists: created under umask 077 and
    moved into place, so no other user of the machine can open it even between creation and a chmod. The content
    goes over the session's stdin, never on a command line (which `ps` shows)."""
    ssh.run(conn, ["sh", "-c", 'umask 077 && rm -f -- "$1.tmp" && cat > "$1.tmp" && mv -f -- "$1.tmp" "$1"', "sh",
                   path], stdin="".join(f"{k}={v}\n" for k, v in env.items()), timeout=60)


@dataclass(frozen=True)
class RemoteJob:
    """Where a prepared attempt's files are on its instance, and the interpreter that runs the runbooks."""

    base: str  # burst/ under the login's home
    jobdir: str
    run_dir: str
    python: str

    @property
    def setup_dir(self) -> str:
        return f"{self.jobdir}/setup"

    def setup_args(self, spec: Mapping[str, Any]) -> list[str]:
        """The supervisor's options for the job's setup ([] without one)."""
        setup = spec.get("setup") or []
        if not setup:
            return []
        retries = spec.get("setup_retries", JobSpec.model_fields["setup_retries"].default)  # a job queued before it
        return ["--setup-json", json.dumps(setup), "--setup-dir", self.setup_dir, "--setup-retries", str(retries)]


LIST_OUTPUTS = (RUNBOOKS / "job_outputs.py").read_text()  # run on the instance through `python -c`
LOG_FILES = (supervisor.STDOUT_LOG, supervisor.STDERR_LOG, supervisor.SUPERVISOR_LOG)  # what pull_logs brings home


class CloudSteps:
    def __init__(self, app: App, providers: Mapping[str, Provider]):
        self.app = app
        self.providers = providers
        self.key_path, self.public_key = orchestrator_key(app)

    # --- targets ----------------------------------------------------------------------------------------------
    def target(self, att: dict[str, Any], inst: InstanceInfo | None = None) -> ssh.Target:
        if inst is not None:
            if inst.host is None:  # callers pass the instance once it has an address
                raise ValueError(f"instance {inst.id} has no address yet")
            host, port, user, pinned = inst.host, inst.ssh_port, inst.ssh_user, inst.host_key
        else:
            info = att["info"]
            host, port, user, pinned = info["host"], info["port"], info["user"], None
        if pinned is None:
            with self.app.store.engine.connect() as c:
                pinned = c.execute(select(s.instances.c.host_key).where(
                    s.instances.c.provider == att["provider"], s.instances.c.id == att["instance_id"])).scalar()
        return ssh.Target(host=host, port=int(port), user=user, key_path=self.key_path, host_key=pinned,
                          instance_id=att["instance_id"])

    def trust(self, att: dict[str, Any]) -> DbHostKeyTrust:
        return DbHostKeyTrust(self.app, att["provider"], att)

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

    # --- the checkpoint store in S3, when the provider has one ----------------------------------------------------
    def _checkpoint_store(self, att: dict[str, Any], job: dict[str, Any]) -> S3CheckpointStore | None:
        make = getattr(self.providers.get(att["provider"]), "checkpoint_store", None)  # optional capability
        return make(job["id"]) if make is not None else None

    def s3_store(self, att: dict[str, Any], job: dict[str, Any]) -> S3CheckpointStore | None:
        """The job's S3 checkpoint store, unless its provider has none or this attempt's instance cannot upload."""
        return None if att["info"].get("s3_unavailable") else self._checkpoint_store(att, job)

    def checkpoints_outlive_instance(self, att: dict[str, Any], job: dict[str, Any]) -> bool:
        """True when the instance's checkpoints can still be fetched after it is gone (they are in S3)."""
        return self.s3_store(att, job) is not None

    def release_s3(self, att: dict[str, Any], job: dict[str, Any]) -> list[str]:
        """Once a job's newest checkpoint is home for good (it finished, or revert-local took it back), drop the S3
        copies it supersedes. A failure is reported and left for a later release, never fatal."""
        store = self._checkpoint_store(att, job)  # the daemon's own credentials: whatever the instance could do
        if store is None:
            return []
        try:
            with checkpoints.store_lock(self.app.config, job["id"]):
                dropped = store.drop_superseded(checkpoints.store_dir(self.app.config, job["id"]))
        except TransferError as exc:
            self.app.events.emit("checkpoint.s3_release_failed", job_id=job["id"], attempt_id=att["id"],
                                 error=self.app.redactor.clip(str(exc), 300))
            return []
        if dropped:
            self.app.events.emit("checkpoint.s3_released", job_id=job["id"], attempt_id=att["id"],
                                 checkpoints=dropped, uri=store.uri)
        return dropped

    def _download_on_instance(self, conn: Any, att: dict[str, Any], store: S3CheckpointStore, name: str,
                              base: str, jobdir: str, python: str) -> str | None:
        """The resume checkpoint fetched in-region by the instance itself; None if it could not (then SSH)."""
        argv = [python, f"{base}/runbooks/s3_checkpoints.py", "download", "--uri", store.uri, "--name", name,
                "--dir", f"{jobdir}/checkpoints", "--region", store.region]
        res = ssh.run(conn, argv, timeout=1800, check=False)
        lines = res.stdout.strip().splitlines()
        try:
            out = json.loads(lines[-1]) if lines else {}
        except ValueError:
            out = {}
        if res.exit_code != 0 or out.get("downloaded") != name:
            said = out.get("error")  # else stderr's end: scrubbed before it is cut, whichever end is kept
            error = self.app.redactor.clip(str(said), 300) if said else self.app.redactor(res.stderr.strip())[-300:]
            self.app.events.emit("checkpoint.s3_download_failed", job_id=att["job_id"], attempt_id=att["id"],
                                 checkpoint=name, error=error)
            return None
        return f"{jobdir}/checkpoints/{name}"

    # --- bootstrap and start ------------------------------------------------------------------------------------
    def _prepare(self, conn: Any, att: dict[str, Any], job: dict[str, Any], timings: dict[str, float]) -> RemoteJob:
        """Everything the supervisor needs before it can start, over the open session: the job's directories, the
        runbooks, the interpreter, the run's env file, the workdir. Safe to run again (a successor prepared early
        is prepared again, cheaply, when it takes over)."""
        target, trust = self.target(att), self.trust(att)
        spec = job["spec"]
        t = time.monotonic()
        # Commands start in the login's home directory: make the job's directories there and learn its path.
        jobrel = f"burst/{job['id']}"
        home = ssh.run(conn, ["sh", "-c", 'mkdir -p -- "$@" && pwd', "sh", "burst/runbooks", f"{jobrel}/work",
                              f"{jobrel}/checkpoints", f"{jobrel}/{att['id']}/run"], timeout=60).stdout.strip()
        base = f"{home}/burst"
        jobdir = f"{base}/{job['id']}"
        for name in RUNBOOK_FILES:
            conn.put(str(RUNBOOKS / name), f"{base}/runbooks/{name}")
        # The interpreter bootstrap.sh picks ($BURST_PYTHON, python3, python; >= 3.8), asked once: every later
        # call runs it directly rather than paying a second Python start for the version check.
        python = ssh.run(conn, ["sh", f"{base}/runbooks/bootstrap.sh", "--which-python"],
                         timeout=60).stdout.strip().splitlines()[-1]
        remote = RemoteJob(base, jobdir, f"{jobdir}/{att['id']}/run", python)
        env = {**spec.get("env", {}), **passenv.values(spec, self.app.redactor), **work_units_env(spec),
               "PYTHONPATH": f"{base}/runbooks"}
        write_remote_env_file(conn, f"{remote.run_dir}/job.env", env)
        timings["bootstrap"] = time.monotonic() - t

        t = time.monotonic()
        sync.push_dir(target, trust, spec["workdir"], f"{jobdir}/work", exclude=push_exclude(spec), conn=conn)
        timings["push_workdir"] = time.monotonic() - t
        return remote

    def start_setup_early(self, att: dict[str, Any], job: dict[str, Any]) -> dict[str, float]:
        """For a successor waiting for its predecessor's end: prepare the instance and start the job's setup,
        detached, so that the takeover finds it done (or waits for what is left of it) instead of running it all
        then. Its timings."""
        timings: dict[str, float] = {}
        conn = ssh.connect(self.target(att), trust=self.trust(att))
        try:
            remote = self._prepare(conn, att, job, timings)
            t = time.monotonic()
            ssh.run(conn, [remote.python, f"{remote.base}/runbooks/supervisor.py", "setup",
                           *remote.setup_args(job["spec"]), "--workdir", f"{remote.jobdir}/work",
                           "--env-file", f"{remote.run_dir}/job.env", *passenv.secret_args(job["spec"]),
                           "--daemonize"], timeout=60)
            timings["start_setup"] = time.monotonic() - t
        finally:
            conn.close()
        return {k: round(v, 4) for k, v in timings.items()}

    def bootstrap_and_start(self, att: dict[str, Any], job: dict[str, Any], resume_from: Path | None
                            ) -> dict[str, float]:
        target, trust = self.target(att), self.trust(att)
        timings: dict[str, float] = {}
        spec = job["spec"]
        # One SSH session for every step: each new one is a key exchange and an authentication, a fixed cost that
        # does not shrink with the data and was most of a resume's runbook time (benchmarks/README.md).
        conn = ssh.connect(target, trust=trust)
        try:
            remote = self._prepare(conn, att, job, timings)
            base, jobdir, run_dir, python = remote.base, remote.jobdir, remote.run_dir, remote.python

            remote_resume = None
            s3 = self.s3_store(att, job)
            if resume_from is not None and s3 is not None:
                t = time.monotonic()
                try:
                    in_s3 = resume_from.name in s3.list_complete()
                except TransferError:
                    in_s3 = False
                if in_s3:
                    remote_resume = self._download_on_instance(conn, att, s3, resume_from.name, base, jobdir,
                                                               python)
                    if remote_resume is not None:
                        timings["s3_download_checkpoint"] = time.monotonic() - t
            if resume_from is not None and remote_resume is None:
                t = time.monotonic()
                # The one `latest` just hashed, not the store's newest again: hashed once, and the name the
                # trainer is told to resume from is the one that was sent, even if a pull landed a newer one since.
                pushed = sync.push_checkpoint(target, trust, checkpoints.store_dir(self.app.config, job["id"]),
                                              f"{jobdir}/checkpoints", conn=conn, checkpoint=resume_from,
                                              runbooks=sync.InstanceRunbooks(f"{base}/runbooks", python))
                timings["push_checkpoint"] = time.monotonic() - t
                if pushed is not None:
                    remote_resume = f"{jobdir}/checkpoints/{resume_from.name}"

            t = time.monotonic()
            argv = [python, f"{base}/runbooks/supervisor.py", "--run-dir", run_dir, "--job-id", job["id"],
                    "--attempt", str(att["n"]), "--checkpoint-dir", f"{jobdir}/checkpoints",
                    "--workdir", f"{jobdir}/work", "--env-file", f"{run_dir}/job.env", *passenv.secret_args(spec),
                    "--gpus", str(spec.get("gpus", 1)), "--grace-s", repr(stop_grace_s(spec)), "--daemonize"]
            if spec.get("torchrun"):
                argv.append("--torchrun")
            if remote_resume:
                argv += ["--resume-from", remote_resume]
            if s3 is not None:
                argv += ["--s3-uri", s3.uri, "--s3-region", s3.region]
            argv += remote.setup_args(spec)
            url = notice_url(self.providers[att["provider"]], att["instance_id"])
            if url:
                argv += ["--metadata-url", url]
            argv += ["--", *spec["command"]]
            ssh.run(conn, argv, timeout=120)
        finally:
            conn.close()
        timings["start"] = time.monotonic() - t
        att["info"] = {**att["info"], "remote_base": base, "remote_run": run_dir, "remote_python": python}
        self.app.store.set_attempt_info(att["id"], att["info"])
        return {k: round(v, 4) for k, v in timings.items()}

    # --- while running ------------------------------------------------------------------------------------------
    def _remote(self, att: dict[str, Any]) -> tuple[str, str]:
        base = att["info"]["remote_base"]
        return base, att["info"]["remote_run"]

    def _supervisor(self, att: dict[str, Any], command: str) -> list[str]:
        """`supervisor.py COMMAND --run-dir RUN` for the attempt's run, with the interpreter found at bootstrap."""
        base, run_dir = self._remote(att)
        # Attempts bootstrapped before the interpreter was recorded ran python3.
        python = att["info"].get("remote_python", "python3")
        return [python, f"{base}/runbooks/supervisor.py", command, "--run-dir", run_dir]

    def status(self, att: dict[str, Any]) -> dict[str, Any] | None:
        """The supervisor's status, or None when the instance cannot be reached over SSH."""
        try:
            conn = ssh.connect(self.target(att), trust=self.trust(att), timeout_s=5)
        except ssh.SshUnavailable:
            return None
        try:
            res = ssh.run(conn, self._supervisor(att, "status"), timeout=30)
        except ssh.SshUnavailable:
            return None
        finally:
            conn.close()
        return json.loads(res.stdout.strip().splitlines()[-1])

    def shared_ssh(self, att: dict[str, Any]) -> ssh.SharedConnection:
        """One connection for the steps of a sync (`pull`, then `pull_logs`), opened when the first needs it."""
        return ssh.SharedConnection(self.target(att), self.trust(att))

    def pull(self, att: dict[str, Any], job: dict[str, Any], shared: ssh.SharedConnection | None = None, *,
             over_ssh: bool = False) -> PulledCheckpoints:
        """The newest checkpoint home: from S3 when the instance uploads there (unless `over_ssh`), else from the
        instance over SSH (on `shared`'s connection when given). S3Refused when S3 refuses this daemon's
        credentials. A checkpoint the attempt's pulls from there rejected is not fetched again while its manifest is
        the same (`checkpoints.rejected_before`)."""
        store = checkpoints.store_dir(self.app.config, job["id"])
        s3 = None if over_ssh else self.s3_store(att, job)
        # The daemon and `revert-local` may pull the same job at once: one at a time per job's store.
        with checkpoints.store_lock(self.app.config, job["id"]):
            if self._released(att["id"]):
                # Its job went home and resumes there (`Reconciler.release_if_home`, under this lock): nothing of the
                # old instance may land in its store now, over what the local run writes.
                return PulledCheckpoints([], TransferStats(transport="none"), {})
            if s3 is not None:
                pulled = s3.pull_new(store, newest_only=True,
                                     rejected_before=checkpoints.rejected_before(att["info"], "s3"))
            else:
                base, _ = self._remote(att)
                pulled = sync.pull_checkpoints(self.target(att), self.trust(att),
                                               f"{base}/{job['id']}/checkpoints", store, newest_only=True,
                                               bwlimit_kib=self.app.config.daemon.pull_kib_s,
                                               conn=shared.get() if shared is not None else None,
                                               rejected_before=checkpoints.rejected_before(att["info"], "instance"))
            if pulled:
                checkpoints.prune_store(self.app.config, job["id"])  # multi-GB checkpoints: keep the newest few
                if s3 is not None:
                    s3.prune(keep=checkpoints.KEEP)  # what is home need not be paid for in S3 as well
        return pulled

    def _released(self, attempt_id: str) -> bool:
        with self.app.store.engine.connect() as c:
            state = c.execute(select(s.attempts.c.state).where(s.attempts.c.id == attempt_id)).scalar()
        return state == AttemptState.RELEASED.value

    def pull_logs(self, att: dict[str, Any], job: dict[str, Any],
                  shared: ssh.SharedConnection | None = None) -> sync.SyncStats:
        """The attempt's logs home, into <state>/runs/<attempt>/ where a local attempt's are: the command's stdout
        and stderr, the supervisor's notes, and the log of the job's setup on this instance. Only what they grew by
        crosses: a long run's log costs each sync its new lines.
        Over SFTP, whatever carries the checkpoints, on `shared`'s connection when given (the sync's): a log's new
        lines are kilobytes, and rsync's two runs (a process and an SSH handshake each) made a sync that finds no
        new checkpoint 5.8x as slow; SFTP on its own connection 2.0x, on the sync's 1.45x (benchmarks/sync_logs.py)."""
        target, trust = self.target(att), self.trust(att)
        base, run_dir = self._remote(att)
        local = attempt_run_dir(self.app.config, att["id"])
        with contextlib.ExitStack() as stack:
            conn = shared.get() if shared is not None else stack.enter_context(ssh.connect(target, trust=trust))
            stats = sync.pull_files(target, trust, run_dir, LOG_FILES, local, append=True, conn=conn,
                                    transport="sftp")
            if job["spec"].get("setup"):
                stats.add(sync.pull_files(target, trust, f"{base}/{job['id']}/setup", [supervisor.SETUP_LOG], local,
                                          append=True, conn=conn, transport="sftp"))
        return stats

    def pull_outputs(self, att: dict[str, Any], job: dict[str, Any],
                     shared: ssh.SharedConnection | None = None) -> list[str]:
        """The files the job's `outputs` name in its workdir on the instance that its run wrote (not one the workdir
        brought along), home into <state>/outputs/<job>/ under their paths relative to the workdir (on `shared`'s
        connection when given: a sync's). The globs are expanded on the instance, by its Python, so that rsync and
        SFTP bring the same files. Returns those paths."""
        target, trust = self.target(att), self.trust(att)
        base, run_dir = self._remote(att)
        work = f"{base}/{job['id']}/work"
        python = att["info"].get("remote_python", "python3")
        with contextlib.ExitStack() as stack:
            conn = shared.get() if shared is not None else stack.enter_context(ssh.connect(target, trust=trust))
            found = ssh.run(conn, [python, "-c", LIST_OUTPUTS, "--run-dir", run_dir, work, *job["spec"]["outputs"]],
                            timeout=120)
            names: list[str] = json.loads(found.stdout.strip().splitlines()[-1])
            if names:
                sync.pull_files(target, trust, work, names, job_outputs_dir(self.app.config, job["id"]), conn=conn)
        return names

    def request_checkpoint(self, att: dict[str, Any]) -> None:
        """SIGTERM through the supervisor: the trainer writes a last checkpoint and exits, SIGKILLed after the job's
        grace (checkpoint.stop_grace_s, given to the supervisor at its start). At once, unless the supervisor is
        gone: then `stop` signals the trainer itself and waits, inside the daemon's tick, at most
        IN_TICK_STOP_MAX_S."""
        spec = (self.app.store.get_job(att["job_id"]) or {}).get("spec") or {}
        conn = ssh.connect(self.target(att), trust=self.trust(att), timeout_s=10)
        try:
            ssh.run(conn, [*self._supervisor(att, "stop"), "--grace-s",
                           repr(min(stop_grace_s(spec), IN_TICK_STOP_MAX_S))], timeout=60)
        finally:
            conn.close()
