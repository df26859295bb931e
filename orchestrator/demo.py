"""`burstctl demo`: the whole story on the embedded simulated cloud, with real processes and real SSH.

1. The seed's three candidate jobs get their verdicts (local, burst, priced with its ΔC).
2. A checkpointing trainer that does not fit locally bursts to simulated spot, is preempted (notice first), resumes
   on another instance from its checkpoint, finishes, and its instance is torn down.
3. A second trainer that fits locally but misses its deadline bursts within the auto-approve ceiling; then
   `burstctl revert-local` brings it home: last checkpoint synced, instance terminated, the job finishes locally.
4. A [[notify]] command tells of each job done (with its cloud cost), as it would tell your phone.
Everything runs in one well-known directory, $XDG_CACHE_HOME/burstctl/demo (~/.cache/burstctl/demo), which each
demo empties and runs in again: one run's state (records, event log) stays there to read until the next, and none
piles up. The demo marks it (DEMO_MARKER) and empties only a directory so marked. Its state goes to the empty
directory given with --state-dir instead. simcloud and the daemon are child processes stopped at the end, and
written down in the directory (CHILDREN): a demo killed outright leaves them running, and the next one ends them
before it empties the directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from orchestrator.child_records import end_left_over
from orchestrator.children import Children, cache_dir, free_port
from orchestrator.config import toml_value
from orchestrator.core.decision import DecisionContext, GpuOffer, JobFacts, decide
from orchestrator.errors import BadInput, OperationalError
from orchestrator.jobspec import load_job
from state import schema as s
from state.store import Store

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "examples" / "trainer.py"
# The demo's notifier: the notice's line appended to the file in $0. The text comes in the environment, never into
# the shell's script.
NOTICE_TO_FILE = 'printf "%s\\n" "$BURSTCTL_NOTICE_TEXT" >> "$0"'
# The demo's directory holds this file from the moment it makes it: the demo empties no directory without it.
DEMO_MARKER = ".burstctl-demo"
CHILDREN = "children"  # in the demo's directory: its simcloud's and daemon's pids and start ticks (`Children`)
DEMO_MARKER_TEXT = ("Made by `burstctl demo`, which empties this directory and runs in it again each time. Nothing "
                    "else uses it: delete it whenever you like.\n")
# The seed's three candidates are its job files, one name for each in the demo's table and in examples/seed/; the
# gates weigh them at the seed's lab figures (rate $3.00/GPU-h on-demand, t_ovh 0.5 h, local $0.10/h).
SEED_DIR = REPO / "examples" / "seed"
SEED_FILES = ("a-grpo-smoke.toml", "b-full-grpo-7b.toml", "c-big-local-deadline.toml")
SEED_GPU = "H100"


@dataclass
class DemoResult:
    candidates: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    instances_left: int = -1
    state_dir: str = ""
    records_dir: str = ""
    event_log: str = ""
    notices: list[str] = field(default_factory=list)
    notices_log: str = ""
    workdir: str = ""  # the demo's own files: its config, simcloud's sandboxes and logs (kept with --keep)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"candidates": self.candidates, "jobs": self.jobs, "instances_left": self.instances_left,
                "state_dir": self.state_dir, "decision_records": self.records_dir, "event_log": self.event_log,
                "notices": self.notices, "notices_log": self.notices_log, "workdir": self.workdir,
                "seconds": round(self.seconds, 1)}


class Demo:
    def __init__(self, workdir: Path, say: Callable[[str], None], state: Path | None = None):
        self.dir = workdir
        self.state = state or workdir / "state"
        self.say = say
        self.key = "demo-" + secrets.token_hex(12)  # simcloud's API key, only in the children's environment
        self.config = workdir / "burstctl.toml"
        self.children = Children(workdir, {**os.environ, "BURSTCTL_SIM_API_KEY": self.key}, self.config,
                                 records=workdir / CHILDREN)
        self.env = self.children.env  # without $BURSTCTL_CONFIG: the demo's commands read its config only
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.notices_log = self.state / "notices.log"

    # --- processes --------------------------------------------------------------------------------------------
    def _burstctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "--config", str(self.config), "--state-dir",
                            str(self.state), *args], env=self.env, capture_output=True, text=True, timeout=600)
        if check and r.returncode != 0:
            raise OperationalError(f"demo: burstctl {' '.join(args)} failed: {r.stderr.strip()}")
        return r

    def stop_all(self) -> None:
        self.children.stop_all()

    # --- the story --------------------------------------------------------------------------------------------
    def run(self) -> DemoResult:
        started = time.monotonic()
        res = DemoResult(state_dir=str(self.state), records_dir=str(self.state / "decisions"),
                         event_log=str(self.state / "events.jsonl"), notices_log=str(self.notices_log),
                         workdir=str(self.dir))
        res.candidates = self.candidates()

        def wait(pred: Callable[[], Any], timeout: float, what: str) -> Any:
            """Fails at once, with the child's own error, if simcloud or the daemon dies; or with the job's reason
            if one of the demo's jobs has failed (not after the wait's timeout)."""
            return self.children.wait(lambda: self._none_failed() and pred(), timeout, what)
        self.start()

        work = self.dir / "work"
        work.mkdir()
        shutil.copy(TRAINER, work / "trainer.py")
        spot_job = self._enqueue("spot-trainer", steps=150, s_local=0.0, deadline_h=10)
        self.say("spot-trainer does not fit locally: bursting to simulated spot")
        instance = wait(lambda: self._running_instance(spot_job), 120, "spot-trainer to run in the cloud")
        wait(lambda: self._count("checkpoint.synced", spot_job), 120, "a first checkpoint to come home")
        self.say(f"preempting {instance[:12]}… (an interruption notice first, as EC2 gives)")
        self._preempt(instance)
        wait(lambda: self._count("job.resumed", spot_job), 120, "spot-trainer to resume on another instance")
        self.say("resumed on a new instance from its newest complete checkpoint")
        wait(lambda: self._job(spot_job)["state"] == "done", 180, "spot-trainer to finish")
        self.say("spot-trainer finished; its instance is torn down")

        home_job = self._enqueue("deadline-trainer", steps=220, s_local=0.1, deadline_h=2)
        self.say("deadline-trainer misses its deadline locally; the deadline's price is within the ceiling: burst")
        wait(lambda: self._count("checkpoint.synced", home_job), 120, "deadline-trainer's first checkpoint")
        self.say("burstctl revert-local: everything back to local-only")
        revert = json.loads(self._burstctl("revert-local", "--json").stdout)
        for row in revert["instances"]:
            self.say(f"  {row['job']}: checkpoint {row['checkpoint_synced']}, instance {str(row['instance'])[:12]}… "
                     f"terminated: {row['terminated']}")
        wait(lambda: self._job(home_job)["state"] == "done", 180, "deadline-trainer to finish locally")
        self.say("deadline-trainer finished locally from its cloud checkpoint")

        res.instances_left = sum(1 for i in self._sim_instances() if i["status"] not in ("terminated", "preempted"))
        res.jobs = [self._summary(j) for j in (spot_job, home_job)]
        self.stop_all()  # the daemon sends what its last ticks did before it exits
        res.notices = self.notices_log.read_text().splitlines() if self.notices_log.exists() else []
        res.seconds = time.monotonic() - started
        return res

    def start(self) -> None:
        """Its config, then simcloud and the daemon, started and written down (`CHILDREN`)."""
        self._write_config()
        self.say("starting simcloud (real SSH endpoints on 127.0.0.1) and the daemon")
        self.children.spawn("simcloud", "simcloud", "serve", "--port", str(self.port), "--state", str(self.dir / "sim"))
        self.children.wait(self._sim_answers, 60, "simcloud to answer")
        self.children.spawn("daemon", "--state-dir", str(self.state), "daemon")

    def candidates(self) -> list[dict[str, Any]]:
        return seed_candidates()

    def _write_config(self) -> None:
        self.config.write_text("\n".join([
            "[providers.sim]", f'base_url = "{self.url}/api/v1"', "",
            "[daemon]", "tick_s = 0.5", "heartbeat_timeout_s = 20.0", "sweep_s = 10.0", "",
            "[policy]", "hybrid_margin_h = 5.0  # keep the demo's deadline job a plain burst", "",
            "[[notify]]  # each notice a line in <state>/notices.log; url_env would send it to a webhook",
            'name = "demo-log"',
            f"command = {toml_value(['sh', '-c', NOTICE_TO_FILE, str(self.notices_log)])}",
            'events = ["job.done", "job.failed"]', "",
        ]))

    def _enqueue(self, name: str, *, steps: int, s_local: float, deadline_h: float) -> str:
        spec = self.dir / f"{name}.toml"
        spec.write_text("\n".join([
            f'name = "{name}"',
            f'command = ["python3", "trainer.py", "--steps", "{steps}", "--checkpoint-every", "10", '
            '"--step-seconds", "0.1", "--out", "result.json"]',
            'outputs = ["result.json"]  # home into <state>/outputs/<job>/ wherever it finishes',
            'workdir = "work"', f"deadline_hours = {deadline_h}", f"local_throughput = {s_local}",
            "rented_throughput = { H100 = 10 }", "[checkpoint]", "interval_minutes = 0.02", ""]))
        return json.loads(self._burstctl("enqueue", str(spec), "--json").stdout)["id"]

    # --- observations -----------------------------------------------------------------------------------------
    def _store(self) -> Store:
        return Store(f"sqlite:///{self.state / 'burstctl.db'}")

    def _none_failed(self) -> bool:
        """True while no job of the demo has failed or been cancelled; else OperationalError with its reason."""
        st = self._store()
        try:
            ended = [j for j in st.list_jobs() if j["state"] in ("failed", "cancelled")]
        finally:
            st.close()
        if ended:
            j = ended[0]
            raise OperationalError(f"demo: {j['name']} {j['state']}: {j['reason']} (its events: burstctl --state-dir "
                                   f"{self.state} events --job {j['id']})")
        return True

    def _job(self, job_id: str) -> dict[str, Any]:
        st = self._store()
        try:
            return st.get_job(job_id) or {}
        finally:
            st.close()

    def _count(self, type_: str, job_id: str) -> int:
        st = self._store()
        try:
            with st.engine.connect() as c:
                return int(c.execute(select(func.count()).select_from(s.events).where(
                    s.events.c.type == type_, s.events.c.job_id == job_id)).scalar() or 0)
        finally:
            st.close()

    def _running_instance(self, job_id: str) -> str | None:
        st = self._store()
        try:
            evs = st.events(job_id=job_id, type_prefix="attempt.running")
        finally:
            st.close()
        return evs[-1]["data"].get("instance") if evs else None

    def _sim_answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/_sim/instances", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _sim_instances(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/_sim/instances", timeout=10).json()["data"]

    def _preempt(self, instance: str) -> None:
        httpx.post(f"{self.url}/_sim/instances/{instance}/notice", json={"seconds": 2}, timeout=10).raise_for_status()
        time.sleep(2)
        r = httpx.post(f"{self.url}/_sim/instances/{instance}/preempt", json={}, timeout=10)
        if r.status_code != 404:  # 404: on the notice, burstctl already took its checkpoint and let the instance go
            r.raise_for_status()

    def _summary(self, job_id: str) -> dict[str, Any]:
        st = self._store()
        try:
            job = st.get_job(job_id) or {}
            with st.engine.connect() as c:
                atts = [dict(r) for r in c.execute(select(s.attempts).where(s.attempts.c.job_id == job_id)
                                                   .order_by(s.attempts.c.n)).mappings()]
                cost = c.execute(select(func.coalesce(func.sum(s.ledger.c.cost_usd), 0.0))
                                 .where(s.ledger.c.job_id == job_id)).scalar()
        finally:
            st.close()
        where: list[str] = []
        for a in atts:
            w = "local" if a["where"] == "local" else f"{a['provider']} {a['market']}"
            if not where or where[-1] != w:
                where.append(w)
        return {"job": job.get("name"), "id": job_id, "verdict": job.get("verdict"), "state": job.get("state"),
                "where": " → ".join(where), "attempts": len(atts),
                "preemptions": sum(1 for a in atts if a["state"] == "preempted" and a["where"] == "cloud"),
                "cost_usd": round(float(cost or 0.0), 4),
                "outputs": sorted(str(f) for f in (self.state / "outputs" / job_id).rglob("*") if f.is_file())}


def seed_candidates() -> list[dict[str, Any]]:
    """The gates' verdicts on the seed's job files (examples/seed/), named as the files name them."""
    now = time.time()
    out = []
    for file in SEED_FILES:
        spec, deadline_at = load_job(SEED_DIR / file, now)
        job = JobFacts(name=spec.name, kind="train", work=spec.work_units, s_local=spec.local_throughput,
                       rented={SEED_GPU: spec.rented_throughput[SEED_GPU]}, gpus=1,
                       deadline_h=(deadline_at - now) / 3600.0, market="on-demand")
        ctx = DecisionContext(local_usd_h=0.10, offers={SEED_GPU: GpuOffer(SEED_GPU, 3.00, None, 85.9)},
                              overhead_h=0.5, hybrid_margin_h=0.25)
        d = decide(job, ctx).to_dict()
        out.append({"job": spec.name, "file": str(SEED_DIR / file), "verdict": d["verdict"],
                    "t_local_h": d["t_local_h"], "t_rented_h": d["t_rented_h"], "delta_cost_usd": d["delta_cost_usd"],
                    "hours_saved": d["hours_saved"], "plan_cost_usd": d["plan_cost_usd"]})
    return out


def demo_dir() -> Path:
    """$XDG_CACHE_HOME/burstctl/demo, or ~/.cache/burstctl/demo (`cache_dir`): the directory every demo runs in."""
    return cache_dir() / "demo"


@contextmanager
def claimed(workdir: Path) -> Iterator[Path]:
    """`workdir` for this demo alone, emptied of the last demo's files: an flock on `<workdir>.lock` beside it, held
    until the block ends (a second demo meanwhile is refused, rather than empty the first one's directory under
    it). A directory the demo did not make (no DEMO_MARKER in it) is never emptied: refused, unless it is empty."""
    try:
        workdir.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(workdir.parent / f"{workdir.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise OperationalError(f"cannot make the demo's directory {workdir}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OperationalError(f"another burstctl demo is running in {workdir}: wait for it to end (each demo "
                                   "runs in that directory)") from None
        _empty(workdir)
        yield workdir
    finally:
        os.close(fd)  # the lock goes with it


def _empty(workdir: Path) -> None:
    """Make `workdir` the demo's, empty but for its marker; remove only what a directory the demo marked holds. The
    simcloud and daemon of a demo killed outright are ended first: they would run on in the files removed under
    them (its flock went with it, so this demo holds it now)."""
    marker = workdir / DEMO_MARKER
    if workdir.is_symlink() or (workdir.exists() and not workdir.is_dir()):
        raise OperationalError(f"'{workdir}' is not a directory burstctl demo made (it is a "
                               f"{'symbolic link' if workdir.is_symlink() else 'file'}): move it away, and the demo "
                               "makes its directory there")
    if workdir.is_dir() and not (marker.is_file() and not marker.is_symlink()) and any(workdir.iterdir()):
        raise OperationalError(f"'{workdir}' holds files burstctl demo did not make (it has no {DEMO_MARKER}): move "
                               "them away, and the demo makes its directory there")
    end_left_over(workdir / CHILDREN)
    try:
        workdir.mkdir(mode=0o700, exist_ok=True)
        for entry in workdir.iterdir():
            if entry.name == DEMO_MARKER:
                continue  # kept: a removal that fails halfway leaves the directory marked, for the next demo
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        if not marker.exists():
            marker.write_text(DEMO_MARKER_TEXT)
    except OSError as exc:
        raise OperationalError(f"cannot empty the demo's directory {workdir} of the last demo's files: "
                               f"{exc.strerror or exc}: {exc.filename or workdir}") from None


def run_demo(say: Callable[[str], None], keep: bool = False, state_dir: Path | None = None,
             workdir: Path | None = None) -> DemoResult:
    """The story, in `workdir` (demo_dir() by default), emptied of the last demo's files first; its state (records,
    event log) in `state_dir` when given (new or empty), else in `workdir`/state, there until the next demo."""
    workdir = workdir or demo_dir()
    if state_dir is not None and state_dir.exists() and (not state_dir.is_dir() or any(state_dir.iterdir())):
        what = "is not empty" if state_dir.is_dir() else "is a file"
        raise BadInput(f"'{state_dir}' {what}: the demo keeps its state apart from yours; give a new directory, or "
                       "none", field="--state-dir")
    if state_dir is not None and state_dir.resolve().is_relative_to(workdir.resolve()):
        raise BadInput(f"'{state_dir}' is inside {workdir}, which each demo empties: give a directory elsewhere, or "
                       "none", field="--state-dir")
    with claimed(workdir):
        say(f"in {workdir} (each demo empties it and runs there again)")
        demo = Demo(workdir, say, state_dir)
        try:
            return demo.run()
        finally:
            demo.stop_all()
            if not keep:
                # The state (records, event log) stays for reading until the next demo; simcloud's sandboxes and
                # logs go.
                shutil.rmtree(workdir / "sim", ignore_errors=True)
