"""What an operator's commands cost after months of events, against a baseline commit, same run (run by hand).

    .venv/bin/python benchmarks/history.py [--baseline REV] [--jobs 10000] [--events-per-job 130] [--repeat 3]

A state with a months-long history is built once, with the baseline's own schema: `--jobs` finished jobs spread
over 180 days (each an enqueue, a decision with its inputs, an attempt or two with their intent, launch, ready,
running, `checkpoint.synced` every few minutes, a few retried `provider.call`s, sometimes a preemption and a
resume, termination, done, measured), one ledger charge per attempt, plus daemon and provider events of no job,
and 3 jobs running now (open charges) and 20 queued. `--events-per-job 130` and 10,000 jobs make ~1.4 million
events (a ~0.9 GB SQLite file). The file is copied, one copy per tree; the baseline (checked out into a temporary
`git worktree`) runs its commands against its copy, this tree against the other (migrating it first, untimed).

Each command runs as its own process (`python -m orchestrator.cli --state-dir ...`), stdout counted and thrown
away; reported are the median wall seconds, the child's CPU seconds and peak RSS (`wait4`), and the bytes it
printed, for both trees, and the ratio this tree / baseline. One daemon tick is measured in a child too: three
cloud attempts running (a stub provider that says running, stub SSH status with a fresh heartbeat, nothing due to
sync), every cloud slot busy, so the tick reads what a steady tick reads (attempts, jobs, the budget's ledger, the
queue) and writes each attempt's info.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BASELINE = "c9d2ad6"  # the commit before retention and the events/ledger indexes
DAY = 86400.0


# --- building the history (raw SQL matching schema v6: fast, and the same rows for both trees) -----------------
def _templates(tree: str, tmp: Path) -> dict[str, Any]:
    """A real decision and job.decided event from the tree's own code: the rows' bulk is theirs."""
    sys.path.insert(0, tree)
    from orchestrator.app import App
    from orchestrator.queue import enqueue

    job = tmp / "job.toml"
    job.write_text('name = "grpo-qwen7b"\ncommand = ["python", "train.py"]\nworkdir = "."\ndeadline_hours = 12\n'
                   'work_units = 1\nlocal_throughput = 0.033\nrented_throughput = { H100 = 0.17 }\n'
                   '[checkpoint]\ndir = "checkpoints"\ninterval_minutes = 20\n[model]\npreset = "qwen2.5-7b"\n'
                   'method = "qlora"\n')
    app = App(state_dir_override=str(tmp / "tpl"))
    job_id, _, _ = enqueue(app, str(job))
    row = app.store.get_job(job_id)
    decided = next(e for e in app.store.events(job_id=job_id) if e["type"] == "job.decided")["data"]
    app.close()
    return {"spec": row["spec"], "decision": row["decision"], "decided": decided}


def build(tree: str, db: Path, jobs: int, per_job: int, seed: int) -> dict[str, int]:
    """Create the schema with `tree`'s Store, then fill it; returns rows per table."""
    sys.path.insert(0, tree)
    from state.store import Store

    tmp = db.parent
    tpl = _templates(tree, tmp)
    Store(f"sqlite:///{db}").close()
    rnd = random.Random(seed)
    now = time.time()
    start = now - 180 * DAY
    spec, decision, decided = (json.dumps(tpl[k]) for k in ("spec", "decision", "decided"))
    market_policy = json.dumps({"market": "spot", "price_usd_h": 2.1, "market_policy": {
        "choice": "spot", "slack_h": 3.2, "unsaved_h": 0.1, "lambda_per_h": 0.08, "outage_h": 0.5,
        "on_demand_usd_h": 3.0, "spot_usd_h": 1.0, "reasons": ["spot is listed", "slack covers a preemption"]}})
    con = sqlite3.connect(db)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=OFF")
    counts = {"jobs": 0, "attempts": 0, "instances": 0, "ledger": 0, "events": 0}
    ev: list[tuple[Any, ...]] = []

    def flush(force: bool = False) -> None:
        if ev and (force or len(ev) >= 50000):
            con.executemany("INSERT INTO events (ts, type, job_id, attempt_id, data) VALUES (?,?,?,?,?)", ev)
            counts["events"] += len(ev)
            ev.clear()

    def job_rows(i: int, t0: float, state: str, n_attempts: int, running: bool) -> None:
        jid = f"{i:012x}"
        con.execute("INSERT INTO jobs (id, name, kind, state, verdict, placement, approved, spec, decision, reason, "
                    "deadline_at, created_at, updated_at, record_path, checkpoint) VALUES "
                    "(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (jid, f"grpo-{i % 300}", "train", state, "burst", "cloud", 0, spec, decision, None,
                     t0 + 2 * DAY, t0, t0 + 6 * 3600, f"/state/decisions/{jid}.md", None))
        counts["jobs"] += 1
        ev.append((t0, "job.enqueued", jid, None, '{"name": "grpo"}'))
        ev.append((t0, "job.decided", jid, None, decided))
        t = t0 + 30
        syncs = max(1, per_job - 14 * n_attempts)
        for a in range(1, n_attempts + 1):
            aid, iid = f"{jid}-a{a}", f"i-{i:08x}{a}"
            last = a == n_attempts
            ended = None if (running and last) else t + 3600 * 5
            astate = "running" if (running and last) else ("done" if last else "lost")
            con.execute('INSERT INTO attempts (id, job_id, n, "where", state, provider, instance_type, region, '
                        "market, idempotency_key, instance_id, info, reason, lost_work_h, created_at, started_at, "
                        "ended_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                        (aid, jid, a, "cloud", astate, "sim", "gpu_1x_h100", "r1", "spot", f"k-{aid}", iid,
                         json.dumps({"host": "10.0.0.1", "port": 22, "last_seen_at": now, "last_sync_at": now,
                                     "market_checked_at": now}),
                         None, None, t, t + 60, ended))
            con.execute("INSERT INTO instances (provider, id, attempt_id, state, instance_type, market, rate_usd_h, "
                        "host, port, host_key, launched_at, gone_at, verified_gone) VALUES "
                        "(?,?,?,?,?,?,?,?,?,?,?,?,?)",
                        ("sim", iid, aid, "running" if ended is None else "terminated", "gpu_1x_h100", "spot",
                         2.1, "10.0.0.1", 22, None, t, ended, 0 if ended is None else 1))
            month = time.strftime("%Y-%m", time.gmtime(t))
            con.execute("INSERT INTO ledger (month, job_id, attempt_id, provider, instance_id, instance_type, market, "
                        "rate_usd_h, started_at, ended_at, billed_seconds, cost_usd) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                        (month, jid, aid, "sim", iid, "gpu_1x_h100", "spot", 2.1, t, ended,
                         None if ended is None else 18000.0, None if ended is None else 10.5))
            counts["attempts"] += 1
            counts["instances"] += 1
            counts["ledger"] += 1
            ev.append((t, "attempt.intent", jid, aid, market_policy))
            for typ in ("instance.launched", "instance.ready", "attempt.running"):
                t += 20
                ev.append((t, typ, jid, aid, json.dumps({"provider": "sim", "instance": iid, "seconds": 20.1})))
            for k in range(syncs // n_attempts):
                t += 150
                ev.append((t, "checkpoint.synced", jid, aid, json.dumps(
                    {"path": f"/state/checkpoints/{jid}/step-{k * 100:08d}", "bytes": 15_200_000_000,
                     "seconds": 41.2, "via": "rsync", "files": 12})))
                if rnd.random() < 0.05:
                    ev.append((t, "provider.call", jid, aid, json.dumps(
                        {"provider": "sim", "call": "describe", "outcome": "Throttled", "tries": 2})))
            if not last:
                ev.append((t, "instance.preempted", jid, aid, json.dumps({"instance": iid, "notice_s": 120})))
                ev.append((t, "job.resuming", jid, aid, "{}"))
            elif not running:
                for typ in ("instance.terminated", "job.done", "job.measured"):
                    t += 10
                    ev.append((t, typ, jid, aid, json.dumps({"instance": iid, "cost_usd": 10.5})))

    for k in range(5):  # rare: a few orphans swept in the first days, none since
        ev.append((start + k, "instance.orphan_terminated", None, None, '{"provider": "sim", "instance": "i-x"}'))
    span = 180 * DAY / max(jobs, 1)
    for i in range(jobs):
        t0 = start + i * span
        job_rows(i, t0, "done", 2 if rnd.random() < 0.3 else 1, running=False)
        if rnd.random() < 0.1:  # the daemon's own and provider events of no job
            for k in range(100):
                ev.append((t0 + k, "provider.unreachable" if k % 2 else "daemon.started", None, None,
                           '{"provider": "sim", "during": "sweep"}'))
        flush()
    for i in range(jobs, jobs + 3):
        job_rows(i, now - 3600, "running", 1, running=True)
    for i in range(jobs + 3, jobs + 23):
        con.execute("INSERT INTO jobs (id, name, kind, state, verdict, placement, approved, spec, decision, reason, "
                    "deadline_at, created_at, updated_at, record_path, checkpoint) VALUES "
                    "(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (f"{i:012x}", f"queued-{i}", "train", "queued", "burst", "cloud", 0, spec, decision, None,
                     now + 2 * DAY, now, now, None, None))
        counts["jobs"] += 1
    flush(force=True)
    con.commit()
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    return counts


# --- one daemon tick (child) -------------------------------------------------------------------------------------
def tick_child(tree: str, state: str, ticks: int) -> None:
    sys.path.insert(0, tree)
    from orchestrator.app import App
    from orchestrator.lifecycle.reconcile import Reconciler
    from providers.base import InstanceInfo, InstanceState, Market

    class Stub:
        name = "sim"

        def offers(self) -> list[Any]:
            return []

        def describe(self, ids: list[str]) -> dict[str, InstanceInfo]:
            return {i: InstanceInfo(i, InstanceState.RUNNING, "gpu_1x_h100", Market.SPOT) for i in ids}

    class Cloud:
        def status(self, att: dict[str, Any]) -> dict[str, Any]:
            return {"heartbeat": {"ts": 1.0}, "exit": None}

    cfg = Path(state).parent / "burstctl.toml"
    cfg.write_text("[daemon]\nlocal_concurrency = 0\nmax_cloud_attempts = 3\n[budget]\nmonthly_cap_usd = 1e9\n")
    app = App(config_path=str(cfg), state_dir_override=state)
    rec = Reconciler(app, {"sim": Stub()}, cloud=Cloud())  # type: ignore[dict-item]
    rec.tick()  # warm
    times = []
    for _ in range(ticks):
        t = time.perf_counter()
        rec.tick()
        times.append(time.perf_counter() - t)
    print(json.dumps({"tick_s": statistics.median(times)}))


# --- measuring -----------------------------------------------------------------------------------------------
def run(tree: Path, argv: list[str]) -> tuple[float, float, float, int]:
    """(wall s, CPU s, peak RSS MiB, stdout bytes) of one child."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=tree)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{argv}: exit {p.returncode}: {err.read().decode()}")
        size = out.seek(0, 2)
        out.seek(0)
        if argv[1:3] == [__file__, "--tick-child"]:
            wall = json.loads(out.read())["tick_s"]
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--events-per-job", type=int, default=130)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated command labels to run, or 'prune' (default: all)")
    ap.add_argument("--keep", default="", help="build into this directory and keep it (reused if present)")
    ap.add_argument("--tick-child", nargs=3, metavar=("TREE", "STATE", "TICKS"))
    ap.add_argument("--build-child", nargs=5, metavar=("TREE", "DB", "JOBS", "PER_JOB", "SEED"))
    a = ap.parse_args()
    if a.tick_child:
        tick_child(a.tick_child[0], a.tick_child[1], int(a.tick_child[2]))
        return
    if a.build_child:
        tree, db, jobs, per_job, seed = a.build_child
        print(json.dumps(build(tree, Path(db), int(jobs), int(per_job), int(seed))))
        return

    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="burstctl-history-"))
    base_tree = work / "baseline-tree"
    try:
        if not base_tree.exists():
            subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), a.baseline], cwd=REPO, check=True,
                           capture_output=True)
        dbs = {"baseline": work / "baseline" / "state" / "burstctl.db", "this": work / "this" / "state" / "burstctl.db"}
        if not dbs["this"].exists():
            dbs["baseline"].parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            made = subprocess.run([sys.executable, __file__, "--build-child", str(base_tree), str(dbs["baseline"]),
                                   str(a.jobs), str(a.events_per_job), str(a.seed)], check=True, capture_output=True,
                                  text=True, env={**os.environ, "PYTHONPATH": str(base_tree)})
            print(f"built {made.stdout.strip()} in {time.perf_counter() - t0:.0f} s, "
                  f"{dbs['baseline'].stat().st_size / 2**30:.2f} GiB")
            dbs["this"].parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(dbs["baseline"], dbs["this"])
        trees = {"baseline": base_tree, "this": REPO}
        py = sys.executable
        migrate = "import sys; from state.store import Store; Store(sys.argv[1]).close()"
        run(REPO, [py, "-c", migrate, f"sqlite:///{dbs['this']}"])  # this tree's migrations, untimed

        con = sqlite3.connect(dbs["baseline"])
        old_job = con.execute("SELECT id FROM jobs WHERE state = 'done' ORDER BY created_at LIMIT 1 OFFSET 100"
                              ).fetchone()[0]
        running_job = con.execute("SELECT id FROM jobs WHERE state = 'running' LIMIT 1").fetchone()[0]
        con.close()
        # (label, the command, the baseline's command if it differs)
        commands: list[tuple[str, list[str], list[str] | None]] = [
            ("events", ["events"], None),
            ("events --limit 50", ["events", "--limit", "50"], None),
            ("events --type instance.orphan --limit 20 (rare)",
             ["events", "--type", "instance.orphan", "--limit", "20"], None),
            ("events --job OLD", ["events", "--job", old_job], None),
            ("events --job RUNNING --limit 20", ["events", "--job", running_job, "--limit", "20"], None),
            ("events --type instance.preempted --limit 20",
             ["events", "--type", "instance.preempted", "--limit", "20"], None),
            ("events --type checkpoint --limit 20", ["events", "--type", "checkpoint", "--limit", "20"], None),
            ("status", ["status"], None),
            ("list", ["list"], None),
            ("list --state running", ["list", "--state", "running"], None),
            ("show OLD", ["show", old_job], None),
            ("show RUNNING --json", ["show", running_job, "--json"], None),
            ("budget", ["budget"], None),
            ("tick", [], None),
            ("every event: `events --all` (baseline: `events`)", ["events", "--all"], ["events"]),
        ]
        only = {x.strip() for x in a.only.split(",") if x.strip()}
        print("\n| command | baseline wall / CPU / RSS / out | this tree wall / CPU / RSS / out | wall ×, RSS × |")
        print("|---|---|---|---|")
        for label, this_args, base_args in commands:
            if only and label not in only:
                continue
            res = {}
            for name, tree in trees.items():
                state = str(dbs[name].parent)
                args = base_args if name == "baseline" and base_args is not None else this_args
                argv = ([py, __file__, "--tick-child", str(tree), state, "20"] if label == "tick"
                        else [py, "-m", "orchestrator.cli", "--state-dir", state, *args])
                reps = 1 if label.startswith("every event") or (label == "events" and name == "baseline") \
                    else a.repeat
                runs = [run(tree, argv) for _ in range(reps)]
                res[name] = tuple(statistics.median(r[k] for r in runs) for k in range(4))

            def fmt(r: tuple[float, ...], tick: bool = label == "tick") -> str:
                wall = f"{r[0] * 1000:.1f} ms" if tick else f"{r[0]:.2f} s"
                return f"{wall} / {r[1]:.2f} s / {r[2]:.0f} MiB / {_bytes(int(r[3]))}"

            b, t = res["baseline"], res["this"]
            print(f"| `{label}` | {fmt(b)} | {fmt(t)} | {t[0] / b[0]:.2f}×, {t[2] / b[2]:.2f}× |", flush=True)
        if not only or "prune" in only:  # retention, this tree only (the baseline has none)
            state = str(dbs["this"].parent)
            size0 = dbs["this"].stat().st_size
            for days, vacuum in ((90, False), (90, True)):
                argv = [py, "-m", "orchestrator.cli", "--state-dir", state, "prune-events", "--older-than", str(days),
                        "--json", *(["--vacuum"] if vacuum else [])]
                wall, cpu, rss, _ = run(REPO, argv)
                print(f"\nprune-events --older-than {days}{' --vacuum' if vacuum else ''}: {wall:.1f} s wall, "
                      f"{cpu:.1f} s CPU, {rss:.0f} MiB; file {size0 / 2**20:.0f} -> "
                      f"{dbs['this'].stat().st_size / 2**20:.0f} MiB")
    finally:
        if not a.keep:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO, capture_output=True)
            shutil.rmtree(work, ignore_errors=True)


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


if __name__ == "__main__":
    main()
