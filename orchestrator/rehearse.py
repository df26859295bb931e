"""`burstctl rehearse`: run a job on a private simcloud with injected spot preemptions, and say whether its
checkpointing survives them — before anyone pays for a real GPU.

The job is run as the daemon runs a burst: simcloud and `burstctl daemon` are child processes in a throwaway state
directory; the job's spec is rewritten so that it bursts to spot whatever its gates say (local throughput 0, market
spot, one GPU, a relaxed deadline), and what a rehearsal does not run is dropped (`setup`, `max_run_hours`: see
`rehearsal_spec` for each). Each preemption is EC2-style: an interruption notice, `notice_s` of lead time, then the
instance is reclaimed and its processes die.

What is observed, and where from:
- the daemon's events (attempt running, instance preempted/terminated, job resumed, done) in the rehearsal's
  database — the same record a real run leaves;
- the instance's own disk: simcloud's sandboxes are local directories, so the checkpoints the trainer wrote on the
  instance (manifest name, step, created_at) and the supervisor's exit.json are read while the instance lives.
  That is what tells a trainer that ignores BURST_RESUME_FROM (its first checkpoint after a resume is not past the
  checkpoint it was given) from one that resumes.

Each rehearsal is written down while it runs (`workspace`): $XDG_CACHE_HOME/burstctl/rehearsals/<pid>-<start ticks>-…/
names its directory (before it is made) and holds its children's records (each written before it starts:
`child_records`). One killed outright (SIGKILL, the OOM killer) runs no `finally`: its simcloud, daemon and simulated
instances ran on, and its directory, a new one each run, was found by nothing. The next rehearsal ends them and removes
its directory (`end_left_over_rehearsals`).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from orchestrator.child_records import end_left_over
from orchestrator.children import Children, cache_dir, free_port
from orchestrator.config import Config, toml_value
from orchestrator.errors import BadInput, OperationalError
from orchestrator.jobspec import JobSpec, _missing_script, load_job
from runbooks import burst_checkpoint, supervisor
from state import schema as s
from state.store import Store

FINAL_JOB_STATES = ("done", "failed", "cancelled", "rethink")
LIVE_SIM_STATUSES = ("booting", "active", "unhealthy", "terminating")  # statuses that hold (and bill) a machine
RELAXED_DEADLINE_H = 720.0  # a month: the rehearsal is about checkpoints, not about meeting the real deadline
REHEARSAL_GPU = "H100"  # simcloud sells H100 spot; the job's own GPU types may not exist there
JITTER = (0.75, 1.25)  # each preemption comes after this many times --every-s of running, seeded
POLL_S = 0.15  # the observation loop's period: well under the daemon's tick, so no event is seen late

# Every rehearsal's directory is a new temporary one with this prefix, marked from the start: a later rehearsal
# removes a left-over directory only when both say it is a rehearsal's.
DIR_PREFIX = "burstctl-rehearse-"
DIR_MARKER = ".burstctl-rehearsal"
OWNER = "rehearsal.json"  # in a rehearsal's registry entry: its directory, and whether --keep keeps it
CHILDREN = "children"  # in a rehearsal's registry entry: its simcloud's and daemon's pids and start ticks

VERDICT_OK = "resumes correctly"
VERDICT_NO_CHECKPOINT = "loses all work on preemption: no checkpoint"
VERDICT_IGNORES_RESUME = "ignores BURST_RESUME_FROM"


@dataclass(frozen=True)
class RehearsalOptions:
    preemptions: int = 2
    seed: int = 0
    every_s: float | None = None  # running time before each preemption; default from the checkpoint interval
    timeout_s: float = 600.0
    notice_s: float = 2.0  # the interruption notice's lead time (EC2 gives 120 s; a rehearsal need not wait)
    tick_s: float = 0.5  # the private daemon's reconcile tick
    boot_delay_s: float = 0.0  # simcloud's boot delay


@dataclass
class SeenCheckpoint:
    name: str
    step: int | None
    created_at: float | None


@dataclass
class AttemptWatch:
    """One cloud attempt as observed: when it ran, and every complete checkpoint seen on its instance."""

    attempt_id: str
    instance: str
    running_at: float
    resumed_from: str | None = None
    checkpoints: dict[str, SeenCheckpoint] = field(default_factory=dict)
    metrics_step: int | None = None
    exited_at: float | None = None  # the supervisor's exit.json ended_at: when work on the instance stopped


@dataclass
class Preemption:
    n: int
    attempt_id: str
    instance: str
    running_at: float
    notice_at: float
    reclaim_due: float
    reclaimed_at: float | None = None
    released_by_daemon: bool = False  # the daemon acted on the notice and terminated the instance before reclaim
    checkpoint_before: str | None = None  # newest complete checkpoint on the instance when it went
    step_before: int | None = None  # the furthest step the job had reached on that instance
    detected_at: float | None = None
    detected_by: str | None = None
    daemon_lost_work_s: float | None = None
    terminated_at: float | None = None
    timeline: dict[str, float] = field(default_factory=dict)  # event → seconds after the notice
    timings: dict[str, float] = field(default_factory=dict)  # the next attempt's runbook step timings
    next_attempt: str | None = None
    resumed_from: str | None = None
    resumed_step: int | None = None
    resumed_at: float | None = None
    lost_work_s: float | None = None
    lost_steps: int | None = None
    had_checkpoint: bool = False
    resumed_correctly: bool | None = None  # None: no checkpoint was written after resuming to tell
    first_checkpoint_after: str | None = None
    # The attempt succeeded: the job finished on that instance during the notice, so nothing was preempted.
    finished_before_reclaim: bool = False

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["resume_s"] = _r(self.resumed_at - self.notice_at) if self.resumed_at else None
        for k in ("running_at", "notice_at", "reclaim_due", "reclaimed_at", "detected_at", "terminated_at",
                  "resumed_at"):
            d.pop(k)
        d["lost_work_s"] = _r(self.lost_work_s)
        d["daemon_lost_work_s"] = _r(self.daemon_lost_work_s)
        d["ran_s"] = _r(self.notice_at - self.running_at)
        d["timeline"] = {k: _r(v) for k, v in self.timeline.items()}
        return d


@dataclass
class RehearsalResult:
    job: str
    spec: str
    verdict: str
    ok: bool
    preemptions_requested: int
    preemptions: list[Preemption]
    state: str
    finished: bool
    attempts: int
    cost_usd: float
    billed_usd: float
    instances_left: int
    seconds: float
    every_s: float
    seed: int
    notes: list[str]
    workdir: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"job": self.job, "spec": self.spec, "verdict": self.verdict, "ok": self.ok,
                "preemptions_requested": self.preemptions_requested,
                "preemptions_injected": len(self.preemptions),
                "preemptions": [p.as_dict() for p in self.preemptions], "state": self.state,
                "finished": self.finished, "attempts": self.attempts, "cost_usd": round(self.cost_usd, 6),
                "billed_usd": round(self.billed_usd, 6), "instances_left": self.instances_left,
                "seconds": _r(self.seconds), "every_s": _r(self.every_s), "seed": self.seed, "notes": self.notes,
                "workdir": self.workdir}


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def default_every_s(spec: JobSpec) -> float:
    """Long enough for two checkpoint intervals, so a job that checkpoints has written one before it is hit."""
    return max(3.0, 2.0 * spec.checkpoint.interval_minutes * 60.0)


def rehearsal_spec(spec: JobSpec, source: Path) -> str:
    """The job, forced to burst to spot on one simulated H100 with a relaxed deadline. Kept as they are: its command
    (under torchrun, with one process, when it asks for torchrun), workdir, what the push leaves out, outputs,
    checkpoint settings (grace included) and environment. Replaced: its kind (by train, which the rehearsal's
    config lets burst), market, GPUs and their types, throughputs and deadline. Dropped: `[model]` (gate 1's
    sizing), `deadline_critical` (it would forbid spot), `checkpoint.resumable` (whether the job resumes is what the
    rehearsal finds out), `setup` (the simulated instance is this machine, set up already: a pip install there
    would install into your environment) and `max_run_hours` (a guard sized for the real run; the rehearsal's own
    bound is its --timeout). docs/rehearse.md has the same, as a table."""
    rented = max(spec.rented_throughput.values())
    fields: dict[str, Any] = {
        "name": spec.name, "kind": "train", "command": list(spec.command),
        "workdir": str((source.parent / spec.workdir).resolve()), "deadline_hours": RELAXED_DEADLINE_H,
        "work_units": spec.work_units, "local_throughput": 0.0, "rented_throughput": {REHEARSAL_GPU: rented},
        "gpus": 1, "market": "spot",
    }
    if spec.torchrun:  # its command is the bare script, which only torchrun runs (with one process on one GPU)
        fields["torchrun"] = True
    for name in ("outputs", "exclude", "pass_env"):  # pass_env: looked up in this shell's environment, the daemon's
        if getattr(spec, name):
            fields[name] = list(getattr(spec, name))
    lines = [f"{k} = {toml_value(v)}" for k, v in fields.items()]
    lines += ["", "[checkpoint]", f"dir = {toml_value(spec.checkpoint.dir)}",
              f"interval_minutes = {toml_value(spec.checkpoint.interval_minutes)}",
              f"stop_grace_s = {toml_value(spec.checkpoint.stop_grace_s)}"]
    if spec.env:
        lines += ["", "[env]"] + [f"{json.dumps(k)} = {toml_value(v)}" for k, v in spec.env.items()]
    return "\n".join(lines) + "\n"


def check_rehearsable(spec: JobSpec, source: Path) -> None:
    """What a rehearsal cannot run, as bad input (exit 2) before anything is started."""
    if spec.torchrun and shutil.which("torchrun") is None:
        # The simulated instance runs its commands with this shell's PATH: without torchrun there, the bare script
        # the command names would fail on the instance, and the rehearsal would report a failed job.
        raise BadInput("a rehearsal of a torchrun job needs torch installed here: no torchrun on this shell's PATH, "
                       "which the simulated instance runs with (put the bin directory of an environment with torch "
                       "first on PATH)", source=source, field="torchrun")
    missing = _missing_script(spec.command, source.parent / spec.workdir) if spec.setup else None
    if missing is not None:
        raise BadInput(f"'{missing}' is not in the workdir '{spec.workdir}', and a rehearsal does not run the job's "
                       "setup, which may fetch it: expected the script in the workdir to rehearse the job",
                       source=source, field="setup")


def check_fits_the_timeout(spec: JobSpec, opts: RehearsalOptions, source: Path) -> None:
    """A first preemption due only after --timeout would rehearse nothing, after waiting it all out: bad input."""
    every = opts.every_s or default_every_s(spec)
    if every * JITTER[0] < opts.timeout_s:
        return
    if opts.every_s is not None:
        raise BadInput(f"the first preemption is due after about {every:g} s of running, past --timeout "
                       f"{opts.timeout_s:g} s: expected --every-s well under --timeout", field="--every-s")
    minutes = spec.checkpoint.interval_minutes
    said = "" if "checkpoint" in spec.model_fields_set else ", the default with no [checkpoint] table"
    runs = opts.preemptions * every * JITTER[1] + 120  # each preemption's running, and a boot each
    raise BadInput(f"the job checkpoints every {minutes:g} min{said}, so its first preemption is due after about "
                   f"{every:.0f} s of running (two intervals, for a checkpoint to be there), past --timeout "
                   f"{opts.timeout_s:g} s: expected a --timeout over {runs:.0f} s plus the job's own run, or a copy "
                   "of the job file with a shorter interval_minutes to rehearse", source=source,
                   field="checkpoint.interval_minutes")


def validate_options(opts: RehearsalOptions) -> None:
    if not 1 <= opts.preemptions <= 50:
        raise BadInput(f"must be between 1 and 50, got {opts.preemptions}", field="--preemptions")
    if opts.every_s is not None and opts.every_s <= 0:
        raise BadInput(f"must be a positive number of seconds, got {opts.every_s}", field="--every-s")
    if opts.timeout_s <= 0:
        raise BadInput(f"must be a positive number of seconds, got {opts.timeout_s}", field="--timeout")
    if opts.notice_s < 0:
        raise BadInput(f"must be zero or more seconds, got {opts.notice_s}", field="--notice-s")


class Rehearsal:
    """One rehearsal: its throwaway directory, its two child processes and what it observed."""

    def __init__(self, spec_path: Path, opts: RehearsalOptions, say: Callable[[str], None], workdir: Path,
                 keep: bool = False, records: Path | None = None):
        self.spec_path = spec_path
        self.keep = keep
        self.opts = opts
        self.say = say
        self.dir = workdir
        self.state = workdir / "state"
        self.sim_state = workdir / "sim"
        self.config = workdir / "burstctl.toml"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # simcloud's API key lives only in the children's environment; it is never printed.
        self.env = {**os.environ, "BURSTCTL_SIM_API_KEY": "rehearse-" + secrets.token_hex(12)}
        self.children = Children(self.dir, self.env, self.config, records=records)
        self.http = httpx.Client(timeout=10)
        self.store: Store | None = None
        self.attempts: dict[str, AttemptWatch] = {}
        self.preemptions: list[Preemption] = []
        self.notes: list[str] = []
        self.every_s = opts.every_s or 0.0  # the running time before each preemption, once the job is read

    # --- processes --------------------------------------------------------------------------------------------
    def stop_all(self) -> None:
        """The daemon first (so it does not see simcloud vanish), then simcloud, which stops every machine."""
        self.children.stop_all()
        if self.store is not None:
            self.store.close()
            self.store = None
        self.http.close()

    def _wait(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        # Without --keep the directory is gone by the time the message is read: point at it only when kept.
        where = f"logs in {self.dir}" if self.keep else "--keep keeps the logs"
        return self.children.wait(pred, timeout, f"{what} ({where})")

    def _sim_answers(self) -> bool:
        try:
            return self.http.get(f"{self.url}/_sim/instances", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    # --- setting up -------------------------------------------------------------------------------------------
    def _write_config(self) -> None:
        self.config.write_text("\n".join([
            "[providers.sim]", f'base_url = "{self.url}/api/v1"', "",
            "[daemon]", f"tick_s = {self.opts.tick_s!r}", "heartbeat_timeout_s = 20.0", "sweep_s = 10.0",
            "launch_backoff_s = 1.0", "",
            "[budget]", "monthly_cap_usd = 100000.0  # simulated money: the rehearsal must never be refused", "",
            "[policy]", "max_auto_delta_usd = 100000.0", "",
            "[state]", f"dir = {json.dumps(str(self.state))}", "",
        ]))

    def _enqueue(self, spec: JobSpec) -> str:
        from orchestrator.app import App
        from orchestrator.queue import enqueue

        forced = self.dir / f"{spec.name}.toml"
        forced.write_text(rehearsal_spec(spec, self.spec_path))
        app = App(config_path=str(self.config), state_dir_override=str(self.state))
        try:
            job_id, _, _ = enqueue(app, forced)
            job = app.store.get_job(job_id) or {}
        finally:
            app.close()
        if job.get("state") != "queued" or job.get("placement") != "cloud":
            raise OperationalError(f"rehearse: the forced burst was not queued for the cloud "
                                   f"({job.get('state')}: {job.get('reason')})")
        return job_id

    # --- observing --------------------------------------------------------------------------------------------
    def _sandbox_job_dir(self, instance: str, job_id: str) -> Path:
        return self.sim_state / "instances" / instance / "sandbox" / "burst" / job_id

    def _scan(self, watch: AttemptWatch, job_id: str) -> None:
        """Every complete checkpoint on the attempt's instance, and its supervisor's progress, while it exists."""
        jobdir = self._sandbox_job_dir(watch.instance, job_id)
        try:
            complete = burst_checkpoint.list_complete(jobdir / "checkpoints", deep=False)
        except OSError:
            return  # the instance's disk is gone (terminated) or not there yet
        for path in complete:
            seen = _seen(path)
            if seen is not None and watch.checkpoints.get(path.name) != seen:
                watch.checkpoints[path.name] = seen  # new, or written again under its name (a run started over)
        run = jobdir / watch.attempt_id / "run"
        metrics = _read_json(run / "metrics.json")
        if isinstance(metrics, dict) and isinstance(metrics.get("step"), int):
            watch.metrics_step = max(watch.metrics_step or 0, metrics["step"])
        ex = _read_json(run / "exit.json")
        if isinstance(ex, dict) and ex.get("ended_at") and watch.exited_at is None:
            watch.exited_at = float(ex["ended_at"])

    def _home_checkpoint(self, job_id: str, name: str) -> SeenCheckpoint | None:
        """A checkpoint the daemon brought home (the store keeps the newest three)."""
        return _seen(self.state / "checkpoints" / job_id / name)

    def _known(self, job_id: str, name: str) -> SeenCheckpoint | None:
        for w in self.attempts.values():
            if name in w.checkpoints:
                return w.checkpoints[name]
        return self._home_checkpoint(job_id, name)

    def _on_event(self, ev: dict[str, Any], job_id: str) -> None:
        kind, data, att = ev["type"], ev["data"], ev["attempt_id"]
        pre = next((p for p in self.preemptions if p.attempt_id == att), None)
        after = next((p for p in self.preemptions if p.next_attempt == att), None)
        if pre is None and after is None and kind in ("attempt.intent", "instance.launched"):
            after = next((p for p in reversed(self.preemptions) if p.next_attempt is None), None)
            if after is not None:
                after.next_attempt = att
        if pre is not None:
            if kind == "instance.interruption_notice":
                pre.timeline["notice_seen"] = ev["ts"] - pre.notice_at
            elif kind == "instance.preempted":
                pre.detected_at, pre.detected_by = ev["ts"], data.get("reason")
                pre.daemon_lost_work_s = float(data.get("lost_work_h") or 0.0) * 3600.0
                pre.timeline["detected"] = ev["ts"] - pre.notice_at
            elif kind == "instance.terminated":
                pre.terminated_at = ev["ts"]
                pre.timeline["terminated"] = ev["ts"] - pre.notice_at
        if after is not None:
            label = {"attempt.intent": "intent", "instance.launched": "launched", "instance.ready": "ready",
                     "job.resumed": "resumed", "attempt.running": "running"}.get(kind)
            if label:
                after.timeline[label] = ev["ts"] - after.notice_at
            if kind == "job.resumed":
                after.resumed_from = data.get("checkpoint")
            if kind == "attempt.running":
                after.resumed_at = ev["ts"]
                after.timings = dict(data.get("timings") or {})
        if kind == "attempt.running" and data.get("instance"):
            self.attempts[att] = AttemptWatch(att, data["instance"], ev["ts"],
                                              resumed_from=after.resumed_from if after else None)
            if after is not None and after.resumed_from:
                seen = self._known(job_id, after.resumed_from)
                after.resumed_step = seen.step if seen else None

    def _current(self) -> AttemptWatch | None:
        return max(self.attempts.values(), key=lambda w: w.running_at, default=None)

    # --- preempting -------------------------------------------------------------------------------------------
    def _notice(self, watch: AttemptWatch) -> None:
        now = time.time()
        self.http.post(f"{self.url}/_sim/instances/{watch.instance}/notice",
                       json={"seconds": self.opts.notice_s}).raise_for_status()
        p = Preemption(n=len(self.preemptions) + 1, attempt_id=watch.attempt_id, instance=watch.instance,
                       running_at=watch.running_at, notice_at=now, reclaim_due=now + self.opts.notice_s)
        self.preemptions.append(p)
        self.say(f"preemption {p.n}: interruption notice to {watch.instance[:12]}… "
                 f"after {now - watch.running_at:.1f} s running")

    def _reclaim(self, p: Preemption) -> None:
        r = self.http.post(f"{self.url}/_sim/instances/{p.instance}/preempt", json={})
        p.reclaimed_at = time.time()
        if r.status_code == 404:  # already terminated: the daemon acted on the notice first
            p.released_by_daemon = True
        else:
            r.raise_for_status()
        p.timeline["reclaimed"] = p.reclaimed_at - p.notice_at

    # --- the run ----------------------------------------------------------------------------------------------
    def run(self) -> RehearsalResult:
        started = time.monotonic()
        spec, _ = load_job(self.spec_path)
        every = self.every_s = self.opts.every_s or default_every_s(spec)
        rng = random.Random(self.opts.seed)
        # Seeded jitter, so the preemptions do not always land on the same phase of the checkpoint cycle.
        delays = [every * rng.uniform(*JITTER) for _ in range(self.opts.preemptions)]
        job_id = self.start(spec)
        assert job_id is not None and self.store is not None  # a job was given; the daemon's store is open
        self.say(f"{spec.name} forced to burst to simulated spot; {self.opts.preemptions} preemption(s), "
                 f"about every {every:.1f} s of running")

        deadline = time.monotonic() + self.opts.timeout_s
        after_id = 0
        pending: Preemption | None = None
        state = "queued"
        timed_out = False
        while True:
            self.children.check()  # a dead daemon or simcloud would otherwise only show as the timeout
            for ev in self.store.events(after_id=after_id, job_id=job_id):
                after_id = ev["id"]
                self._on_event(ev, job_id)
            current = self._current()
            if current is not None:
                self._scan(current, job_id)
            now = time.time()
            if pending is not None and now >= pending.reclaim_due:
                self._reclaim(pending)
                pending = None
            elif (pending is None and current is not None and len(self.preemptions) < self.opts.preemptions
                  and not any(p.attempt_id == current.attempt_id for p in self.preemptions)
                  and now - current.running_at >= delays[len(self.preemptions)] and self._running(current)):
                self._notice(current)
                pending = self.preemptions[-1]
            state = (self.store.get_job(job_id) or {}).get("state", "unknown")
            if state in FINAL_JOB_STATES and pending is None:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(POLL_S)
        for ev in self.store.events(after_id=after_id, job_id=job_id):
            self._on_event(ev, job_id)

        self._settle(job_id)
        left = self._instances_left()
        cost, attempts = self._ledger(job_id)
        billed = sum(float(b["cost_usd"]) for b in self.http.get(f"{self.url}/_sim/billing").json()["data"])
        verdict, ok = self._verdict(state, timed_out, left, (self.store.get_job(job_id) or {}).get("reason"))
        return RehearsalResult(
            job=spec.name, spec=str(self.spec_path), verdict=verdict, ok=ok,
            preemptions_requested=self.opts.preemptions, preemptions=self.preemptions, state=state,
            finished=state == "done", attempts=attempts, cost_usd=cost, billed_usd=billed, instances_left=left,
            seconds=time.monotonic() - started, every_s=every, seed=self.opts.seed, notes=self.notes,
            workdir=None)

    def start(self, spec: JobSpec | None) -> str | None:
        """Its config, simcloud, the job enqueued (None: no job, an idle daemon) and the daemon: started, and written
        down when the rehearsal is (`records`). The job's id."""
        self._write_config()
        self.say(f"starting a private simcloud and daemon in {self.dir}")
        self.children.spawn("simcloud", "simcloud", "serve", "--port", str(self.port), "--state", str(self.sim_state),
                            "--boot-delay", str(self.opts.boot_delay_s))
        self._wait(self._sim_answers, 60, "simcloud to answer")
        job_id = self._enqueue(spec) if spec is not None else None
        self.children.spawn("daemon", "--state-dir", str(self.state), "daemon")
        self.store = Store(f"sqlite:///{self.state / 'burstctl.db'}")
        return job_id

    def _attempt_state(self, attempt_id: str) -> str | None:
        assert self.store is not None
        with self.store.engine.connect() as c:
            return c.execute(select(s.attempts.c.state).where(s.attempts.c.id == attempt_id)).scalar()

    def _running(self, watch: AttemptWatch) -> bool:
        return self._attempt_state(watch.attempt_id) == "running"

    def _settle(self, job_id: str) -> None:
        """Per preemption: what was lost, what it resumed from, and whether the resumed run went forward."""
        home = self._home_checkpoints(job_id)
        for p in self.preemptions:
            old = self.attempts[p.attempt_id]
            p.finished_before_reclaim = p.next_attempt is None and self._attempt_state(p.attempt_id) == "succeeded"
            mine = self._written_by(old, home, job_id)
            p.had_checkpoint = bool(mine) or bool(old.resumed_from)
            on_disk = sorted({**{c.name: c for c in mine}, **old.checkpoints}.values(), key=lambda c: c.name)
            p.checkpoint_before = on_disk[-1].name if on_disk else None
            steps = [c.step for c in on_disk if c.step is not None] + [old.metrics_step or 0]
            p.step_before = max(steps) if on_disk or old.metrics_step else None
            resumed = self._known(job_id, p.resumed_from) if p.resumed_from else None
            p.resumed_step = resumed.step if resumed else None
            # Lost work: the time worked on that instance after the state the next attempt started from.
            stopped = old.exited_at or p.reclaimed_at or p.notice_at
            base = old.running_at
            if resumed is not None and resumed.created_at is not None:
                base = max(base, resumed.created_at)
            p.lost_work_s = max(0.0, stopped - base)
            if p.step_before is not None and p.resumed_step is not None:
                p.lost_steps = p.step_before - p.resumed_step
            elif p.step_before is not None and not p.resumed_from:
                p.lost_steps = p.step_before  # started over from nothing
            if p.finished_before_reclaim:  # it ended its work there: nothing to lose, nothing to resume
                p.lost_steps, p.lost_work_s = 0, 0.0
            new = self.attempts.get(p.next_attempt or "")
            if new is None or not p.resumed_from:
                continue
            written = self._written_by(new, home, job_id)
            if not written:
                continue
            first = min(written, key=lambda c: c.created_at or 0.0)
            p.first_checkpoint_after = first.name
            base_step = p.resumed_step
            if first.step is not None and base_step is not None:
                p.resumed_correctly = first.step > base_step
            else:  # no step in the manifests: checkpoint names sort by progress (the contract)
                p.resumed_correctly = first.name > p.resumed_from

    def _written_by(self, watch: AttemptWatch, home: list[SeenCheckpoint], job_id: str) -> list[SeenCheckpoint]:
        later = [w.running_at for w in self.attempts.values() if w.running_at > watch.running_at]
        pushed = self._known(job_id, watch.resumed_from) if watch.resumed_from else None
        return written_by(watch, home, min(later) if later else None, pushed)

    def _home_checkpoints(self, job_id: str) -> list[SeenCheckpoint]:
        folder = self.state / "checkpoints" / job_id
        try:
            paths = burst_checkpoint.list_complete(folder, deep=False)
        except OSError:
            return []
        return [c for c in (_seen(p) for p in paths) if c is not None]

    def _verdict(self, state: str, timed_out: bool, left: int, reason: str | None = None) -> tuple[str, bool]:
        finished = [p.n for p in self.preemptions if p.finished_before_reclaim]
        if finished:  # the notice came as the trainer was finishing: it ended (exit 0) with nothing to resume
            self.notes.append(f"the job finished on its instance during the notice of preemption(s) {finished}: "
                              "nothing was preempted there")
        preempted = [p for p in self.preemptions if not p.finished_before_reclaim]
        if state == "failed":  # the job's own failure first: "make it run longer" would hide it
            self.notes.append(f"the job failed: {reason or 'no reason recorded'}")
        elif not self.preemptions and timed_out:
            self.notes.append(f"no preemption within --timeout {self.opts.timeout_s:g} s: the first was due after "
                              f"about {self.every_s:.0f} s of running, once the job had started on its instance")
        elif not self.preemptions:
            self.notes.append("the job ended before the first preemption: make it run longer or lower --every-s")
        elif len(self.preemptions) < self.opts.preemptions:
            self.notes.append(f"only {len(self.preemptions)} of {self.opts.preemptions} preemptions were injected "
                              "before the job ended")
        if left:
            self.notes.append(f"{left} simulated instance(s) were still running at the end")
        if any(not p.had_checkpoint for p in preempted):
            return VERDICT_NO_CHECKPOINT, False
        if any(p.resumed_correctly is False for p in preempted):
            return VERDICT_IGNORES_RESUME, False
        if timed_out:
            return f"did not finish within {self.opts.timeout_s:.0f} s", False
        if state != "done":
            return f"did not finish: job {state}", False
        if not preempted:
            return "not rehearsed: no preemption happened", False
        stranded = [p for p in preempted if p.resumed_correctly is None and not p.resumed_from
                    and p.checkpoint_before]
        if stranded:  # written on the instance (often on the notice's SIGTERM) but never pulled home in time
            return (f"loses all work on preemption: {', '.join(p.checkpoint_before or '' for p in stranded)} "
                    f"did not come home before the reclaim (preemption(s) {[p.n for p in stranded]}); the next "
                    "attempt started over: checkpoint before the notice, or give a longer --notice-s"), False
        unknown = [p.n for p in preempted if p.resumed_correctly is None]
        if unknown:
            return f"resume not verified: no checkpoint written after preemption(s) {unknown}", False
        return VERDICT_OK, left == 0

    def _instances_left(self) -> int:
        """Instances still holding a machine; terminations in flight get a few seconds to finish."""
        deadline = time.monotonic() + 20
        while True:
            rows = self.http.get(f"{self.url}/_sim/instances").json()["data"]
            left = sum(1 for i in rows if i["status"] in LIVE_SIM_STATUSES)
            if left == 0 or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def _ledger(self, job_id: str) -> tuple[float, int]:
        assert self.store is not None
        with self.store.engine.connect() as c:
            cost = c.execute(select(func.coalesce(func.sum(s.ledger.c.cost_usd), 0.0))
                             .where(s.ledger.c.job_id == job_id)).scalar()
            n = c.execute(select(func.count()).select_from(s.attempts).where(s.attempts.c.job_id == job_id)).scalar()
        return float(cost or 0.0), int(n or 0)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def written_by(watch: AttemptWatch, home: list[SeenCheckpoint], next_running_at: float | None,
               pushed: SeenCheckpoint | None) -> list[SeenCheckpoint]:
    """The checkpoints an attempt's trainer wrote. Those seen on its instance's disk are its own whenever they were
    written (the disk is its alone), but the one pushed for it to resume from (`pushed`, as it was home). The daemon
    says an attempt runs only once its trainer has started: under load, seconds later, in which a fast trainer has
    written checkpoints already. Judged by that time alone, the first ones were not counted, and a trainer that
    started over from step 0 was seen to go past the step it was handed. Those seen only at home (written and pruned
    between two looks, or after the instance was gone) are its own when written from then to the next attempt's."""
    end = float("inf") if next_running_at is None else next_running_at
    found = {c.name: c for c in home
             if c.created_at is not None and watch.running_at <= c.created_at < end}
    found.update({c.name: c for c in watch.checkpoints.values() if c != pushed})
    return list(found.values())


def _seen(path: Path) -> SeenCheckpoint | None:
    try:
        m = burst_checkpoint.read_manifest(path)
    except (OSError, ValueError):
        return None
    step = m.get("step")
    created = m.get("created_at")
    return SeenCheckpoint(path.name, step if isinstance(step, int) else None,
                          float(created) if isinstance(created, int | float) else None)


def rehearse(spec_path: str | Path, opts: RehearsalOptions, say: Callable[[str], None] = lambda _: None,
             keep: bool = False, config: Config | None = None) -> RehearsalResult:
    """Rehearse the job in `spec_path` with `opts.preemptions` injected preemptions. Bad input raises BadInput
    before anything starts, that which `enqueue` would refuse under `config` too (a GPU type its [prices] lacks, an
    unknown model preset); then what rehearsals killed outright left is cleaned up (`end_left_over_rehearsals`, said
    on stderr); the children are always stopped; the throwaway directory is removed unless `keep`."""
    path = Path(spec_path)
    validate_options(opts)
    spec, deadline_at = load_job(path)  # bad input exits 2 before any process starts
    if config is not None:
        from orchestrator.queue import facts

        facts(spec, deadline_at, time.time(), config, path)
    check_rehearsable(spec, path)
    check_fits_the_timeout(spec, opts, path)
    for line in end_left_over_rehearsals():
        print(f"burstctl: note: {line}", file=sys.stderr)
    with workspace(keep) as (workdir, records):
        reh = Rehearsal(path, opts, say, workdir, keep=keep, records=records)
        try:
            res = reh.run()
        finally:
            reh.stop_all()
    res.workdir = str(workdir) if keep else None
    return res


def rehearsals_dir() -> Path:
    """$XDG_CACHE_HOME/burstctl/rehearsals, or ~/.cache/burstctl/rehearsals: every running rehearsal, written down."""
    return cache_dir() / "rehearsals"


@contextmanager
def workspace(keep: bool = False) -> Iterator[tuple[Path, Path | None]]:
    """A new temporary directory for one rehearsal, and where its children are to be written down (`Children`'s
    `records`; None where it cannot be written down): its entry in rehearsals_dir(), `<pid>-<start ticks>-<suffix of
    the directory's name>`, named after this process (so a later rehearsal knows when it is gone) and holding
    OWNER. The entry names the directory before the directory is made: a rehearsal killed in between leaves none
    that the next one does not find. The caller stops the children before the block ends; then the directory goes
    (unless `keep`) and the entry goes."""
    workdir = Path(tempfile.gettempdir()) / f"{DIR_PREFIX}{secrets.token_hex(6)}"
    entry = _register(workdir, keep)
    try:
        workdir.mkdir(mode=0o700)  # as mkdtemp's: a name taken already (never guessed) is an error, not reused
    except BaseException:
        if entry is not None:
            shutil.rmtree(entry, ignore_errors=True)
        raise
    try:
        (workdir / DIR_MARKER).write_text("Made by `burstctl rehearse`, which removes it when it ends (or, if it is "
                                          "killed, the next rehearsal does), unless given --keep.\n")
        yield workdir, None if entry is None else entry / CHILDREN
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        if entry is not None:
            shutil.rmtree(entry, ignore_errors=True)


def _register(workdir: Path, keep: bool) -> Path | None:
    """This rehearsal's entry in rehearsals_dir(), naming `workdir` (OWNER, whole or not there); None where it
    cannot be written: unregistered, a rehearsal still runs and stops its children."""
    start = supervisor.process_start_ticks(os.getpid())
    if start is None:  # without it (no /proc), no later rehearsal could tell this one from a reused pid
        return None
    entry = rehearsals_dir() / f"{os.getpid()}-{start}-{workdir.name.removeprefix(DIR_PREFIX)}"
    try:
        (entry / CHILDREN).mkdir(parents=True)
        tmp = entry / f".{OWNER}"
        tmp.write_text(json.dumps({"workdir": str(workdir), "keep": keep}))
        tmp.replace(entry / OWNER)  # whole or not there: read by a later rehearsal
    except OSError:
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return entry


def end_left_over_rehearsals() -> list[str]:
    """For every rehearsal in rehearsals_dir() whose process is gone (none runs with the pid and start ticks its
    entry is named after; a zombie is gone): end its children still running (`end_left_over`: the daemon, then
    simcloud, which stops its instances' processes), remove its directory (unless it was run with --keep, and only
    one that is a rehearsal's: its name's prefix and DIR_MARKER), and its entry. A rehearsal still running is left
    alone. One line per rehearsal cleaned up, saying what was done."""
    registry = rehearsals_dir()
    said: list[str] = []
    for entry in sorted(registry.iterdir()) if registry.is_dir() else []:
        try:
            pid, start = (int(part) for part in entry.name.split("-")[:2])
        except ValueError:
            continue  # not an entry a rehearsal wrote
        if entry.is_symlink() or not entry.is_dir() or supervisor.pid_alive(pid, start):
            continue
        ended = end_left_over(entry / CHILDREN)
        owner = _read_json(entry / OWNER)
        owner = owner if isinstance(owner, dict) else {}  # killed before it was written: no directory to remove
        workdir = Path(owner["workdir"]) if isinstance(owner.get("workdir"), str) else None
        removed = workdir is not None and not owner.get("keep") and _remove_rehearsal_dir(workdir, entry)
        shutil.rmtree(entry, ignore_errors=True)
        what = [f"ended the {' and '.join(reversed(ended))} it left running"] if ended else []
        if removed:
            what.append(f"removed its directory {workdir}")
        elif workdir is not None and workdir.is_dir():
            what.append(f"kept its directory {workdir}" + (" (--keep)" if owner.get("keep") else
                                                            ", which is not a rehearsal's"))
        if what:
            said.append(f"a rehearsal killed outright (pid {pid}): {', '.join(what)}")
    return said


def _remove_rehearsal_dir(path: Path, entry: Path) -> bool:
    """Remove a directory `workspace` made: a temporary one (its name's prefix) holding DIR_MARKER, or one still
    empty that `entry` is named after (its rehearsal was killed before it marked it). Nothing else is removed.
    Whether it was."""
    if not (path.is_absolute() and path.name.startswith(DIR_PREFIX) and path.is_dir() and not path.is_symlink()):
        return False
    if (path / DIR_MARKER).is_file():
        shutil.rmtree(path, ignore_errors=True)
        return True
    if entry.name.split("-", 2)[2:] != [path.name.removeprefix(DIR_PREFIX)]:
        return False
    try:
        path.rmdir()  # only an empty one
    except OSError:
        return False
    return True
