"""Scheduler tick time against queue size: 100, 1,000 and 10,000 queued jobs (run by hand).

    .venv/bin/python benchmarks/tick.py [--sizes 100 1000 10000] [--ticks 30] [--postgres] [--measurements N]
                                        [--schedules N] [--local]

The scheduling half of a tick is what grows with the queue: it reads the queued jobs in deadline order (only as
many as there are free slots), and re-decides up to `daemon.redecide_per_tick` blocked jobs. Here every slot is
taken (the cloud slots by running attempts, the local slot is configured to 0), 10 % of the jobs are blocked, and
the rest are queued, the steady state of a long queue. Attempt steps are not included: they scale with the number
of *running* attempts (bounded by `max_cloud_attempts`), not with the queue.
Reported: median tick in ms per size, and the growth against the smallest size measured in the same run.
`--schedules N` configures N [[schedule]] tables and times the daemon's look at them before each tick
(`fire_due`), as a ratio to that tick. `--measurements N` keeps N measured throughputs of other job names first
(each cloud run keeps one), as after months of use. `--postgres` measures each size on PostgreSQL too (a private
server started as the tests start it, tests/postgres.py, on 127.0.0.1 with fsync off), as a ratio to SQLite's tick
in the same run. `--local` measures each size a second time with the queue placed on the local GPU instead (one
local run holds it, every queued job is 2 h of local work, all of them late in line and none that the cloud can
save), so every tick also looks at the local line (`_redecide_late_in_line`), as a ratio to the cloud queue's tick.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import insert

from orchestrator.app import App
from orchestrator.lifecycle.reconcile import Reconciler
from state import schema as s


def populate(app: App, n: int, measurements: int = 0, local: bool = False) -> None:
    now = time.time()
    # A burst planned at 1.5 h for $4.50: every queued cloud job holds that much of the budget (`held_by_plans`).
    decision = {"verdict": "burst", "action": "burst", "fits_locally": False, "t_rented_h": 1.0,
                "plan": [{"where": "cloud", "hours": 1.5, "cost_usd": 4.5}], "overhead_h": 0.5, "reasons": []}
    spec = {"name": "x", "kind": "train", "command": ["true"], "workdir": "/tmp", "deadline_hours": 48,
            "work_units": 1, "local_throughput": 0, "rented_throughput": {"H100": 1.0}, "gpus": 1,
            "checkpoint": {"dir": "checkpoints", "interval_minutes": 30}, "env": {}}
    # With `local`, the queued jobs are 2 h of local work each, that nothing rented can do (the blocked stay cloud's).
    local_decision = {"verdict": "local", "action": "run-local", "fits_locally": True, "t_local_h": 2.0,
                      "plan": [{"where": "local", "hours": 2.0, "cost_usd": 0.2}], "overhead_h": 0.5, "reasons": []}
    local_spec = {**spec, "work_units": 2, "local_throughput": 1.0, "rented_throughput": {"H100": 0.001}}
    rows = []
    for i in range(n):
        blocked = i % 10 == 0
        here = local and not blocked
        rows.append({"id": f"j{i:06d}", "name": f"job-{i}", "kind": "train",
                     "state": "blocked" if blocked else "queued", "verdict": "local" if here else "burst",
                     "placement": "local" if here else "cloud", "approved": False,
                     "spec": local_spec if here else spec, "decision": local_decision if here else decision,
                     "reason": None, "deadline_at": now + 3600 * (24 + i % 100), "created_at": now,
                     "updated_at": now, "rented_usd": 0.0 if here else 4.5})
    if local:  # the local GPU is held by a run
        rows[-1]["state"] = "running"
    with app.store.tx() as c:
        c.execute(insert(s.jobs), rows)
        if local:
            c.execute(insert(s.attempts).values(id=f"j{n - 1:06d}-a1", job_id=f"j{n - 1:06d}", n=1, where="local",
                                                state="running", info={}, created_at=now, started_at=now))
        if measurements:  # months of finished cloud runs: measured s_R of many job names
            c.execute(insert(s.measurements), [
                {"ts": now, "provider": "sim", "instance_type": f"H100:old-job-{i % 2000}",
                 "metric": "throughput_units_h", "value": 1.0} for i in range(measurements)])
        for k in range(app.config.daemon.max_cloud_attempts):  # every cloud slot busy
            c.execute(insert(s.attempts).values(id=f"j{k:06d}-a1", job_id=f"j{k:06d}", n=1, where="cloud",
                                                state="running", provider="sim", info={}, created_at=now))


def schedule_tables(folder: Path, count: int) -> str:
    """`count` [[schedule]] tables, each with its own job file, a daily slot apiece."""
    (folder / "work").mkdir()
    tables = []
    for k in range(count):
        (folder / f"cycle-{k}.toml").write_text(f'name = "cycle-{k}"\ncommand = ["true"]\nworkdir = "work"\n'
                                               'deadline_hours = 24\nlocal_throughput = 1.0\n')
        tables.append(f'[[schedule]]\njob = "cycle-{k}.toml"\ncron = "{k % 60} {k % 24} * * *"\n')
    return "\n".join(tables)


def measure(n: int, ticks: int, database_url: str | None = None, measurements: int = 0,
            schedules: int = 0, local: bool = False) -> tuple[float, float]:
    """Median of the scheduling half of a tick, and of the daemon's look at its schedules (`fire_due`) before it."""
    from orchestrator.schedules import fire_due

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "burstctl.toml"
        # The budget is spent, so blocked jobs stay blocked when re-decided: the steady state of a long queue.
        store = f'[state]\ndatabase_url = "{database_url}"\n' if database_url else ""
        cfg.write_text(f"[daemon]\nlocal_concurrency = {int(local)}\n[budget]\nmonthly_cap_usd = 0\n" + store + "\n"
                       + schedule_tables(Path(tmp), schedules))
        app = App(config_path=str(cfg), state_dir_override=str(Path(tmp) / "state"))
        populate(app, n, measurements, local)
        fire_due(app)  # arms them: each tick after looks for a slot that has come, as the daemon does all day
        rec = Reconciler(app, {}, cloud=None)
        times, looks = [], []
        for _ in range(ticks):
            t = time.perf_counter()
            fire_due(app)
            looks.append(time.perf_counter() - t)
            t = time.perf_counter()
            rec.admission.schedule()
            times.append(time.perf_counter() - t)
        app.close()
        return statistics.median(times), statistics.median(looks)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--ticks", type=int, default=30)
    p.add_argument("--postgres", action="store_true", help="also on a private PostgreSQL server")
    p.add_argument("--measurements", type=int, default=0, help="rows of measured s_R already kept (other jobs)")
    p.add_argument("--schedules", type=int, default=0, help="[[schedule]] tables configured (the daemon looks at "
                   "them every tick): their look is printed beside the tick")
    p.add_argument("--local", action="store_true", help="also with the queue on the local GPU, late in line")
    a = p.parse_args()
    both = {n: measure(n, a.ticks, measurements=a.measurements, schedules=a.schedules) for n in a.sizes}
    results = {n: tick for n, (tick, _) in both.items()}
    base = results[a.sizes[0]]
    on_pg: dict[int, float] = {}
    if a.postgres:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.postgres import PostgresServer, find_bin_dir

        bin_dir = find_bin_dir()
        if bin_dir is None:
            raise SystemExit("--postgres: PostgreSQL's initdb/pg_ctl not found")
        server = PostgresServer(bin_dir).start()
        try:
            on_pg = {n: measure(n, a.ticks, server.new_database(), a.measurements)[0] for n in a.sizes}
        finally:
            server.stop()
    head = f"{'queued jobs':>12} {'median tick':>12} {'vs ' + str(a.sizes[0]):>10}"
    print(head + (f" {'PostgreSQL':>12} {'vs SQLite':>10}" if on_pg else ""))
    for n, t in results.items():
        row = f"{n:>12,} {t * 1000:>10.2f} ms {t / base:>9.2f}×"
        if on_pg:
            row += f" {on_pg[n] * 1000:>10.2f} ms {on_pg[n] / t:>9.2f}×"
        print(row)
    if a.local:
        for n, tick in results.items():
            local_tick = measure(n, a.ticks, local=True)[0]
            print(f"{n:>12,} jobs on the local GPU, late in line: {local_tick * 1000:.2f} ms a tick, "
                  f"{local_tick / tick:.2f}× the cloud queue's")
    for n, (tick, look) in both.items():
        print(f"{n:>12,} jobs: the look at {a.schedules} schedule(s) before the tick {look * 1000:.2f} ms, "
              f"{look / tick:.2f}× the scheduling half of the tick")


if __name__ == "__main__":
    main()
