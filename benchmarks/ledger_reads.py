"""One job's spend and the open charges, read from a ledger of months of charges, against a baseline commit.

Run by hand from the repo root: `.venv/bin/python benchmarks/ledger_reads.py [--baseline REV] [--charges 200000]
[--jobs 10000] [--rounds 3] [--postgres]`.

The ledger keeps a charge per cloud instance ever run, and nothing deletes them (the budget's meter). The state is
built once by the baseline tree's store (its schema), with `--charges` closed charges spread over `--jobs` jobs
and 180 days, and 3 open ones. Each round copies it for each tree (SQLite; `--postgres`: a database per tree and
round, on a private server started as the tests start one, tests/postgres.py), and each tree opens it in a child
process of its own, baseline first: opening is where this tree's store upgrades the schema (the migration's time is
printed). Then, the page cache warm, `Store.job_spend` for 200 jobs (the read behind every decision written again,
`show`, a launch's hold, a job's end) and `BudgetGuard.exposure` 50 times (the budget's check: every tick, every
launch and decision). Printed: the median of each (the fastest round's), and the ratios against the baseline.

The orphan sweep's look at an instance's charges (`orphans.last_charge`, by provider and instance id: one open? the
last one's end) is timed by this tree alone, for 100 instances charged and 100 never charged (a launch whose answer
was lost), then again in the same process once `ix_ledger_instance` is dropped (the schema of migration 9: the baseline
has neither the index nor the function); printed against that.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baseline import baseline_tree  # benchmarks/baseline.py, beside this script

REPO = Path(__file__).resolve().parents[1]
BASELINE = "8841b75"  # the last commit before the ledger was indexed by job and by its open charges


def populate(url: str, charges: int, jobs: int) -> None:
    """The baseline tree's schema (this process imports its `state`), then the charges, 10,000 rows a statement."""
    from sqlalchemy import insert

    from state import schema as s
    from state.store import Store

    store = Store(url)
    start = time.time() - 180 * 86400
    rng = random.Random(0)
    with store.tx() as c:
        for k0 in range(0, charges, 10_000):
            rows = []
            for k in range(k0, min(k0 + 10_000, charges)):
                began = start + k * (180 * 86400 / charges)
                hours = rng.uniform(0.2, 3.0)
                rows.append({"month": time.strftime("%Y-%m", time.gmtime(began)), "job_id": f"j{k % jobs:06d}",
                             "attempt_id": f"j{k % jobs:06d}-a{k // jobs + 1}", "provider": "lambda",
                             "instance_id": f"i-{k:07d}", "instance_type": "gpu_1x_h100_pcie", "market": "on-demand",
                             "rate_usd_h": 2.49, "started_at": began, "ended_at": began + hours * 3600,
                             "billed_seconds": hours * 3600, "cost_usd": 2.49 * hours})
            c.execute(insert(s.ledger), rows)
        now = time.time()
        c.execute(insert(s.ledger), [{"month": time.strftime("%Y-%m", time.gmtime(now)), "job_id": f"run{n}",
                                      "attempt_id": f"run{n}-a1", "provider": "lambda", "instance_id": f"i-run{n}",
                                      "rate_usd_h": 2.49, "started_at": now - 3600} for n in range(3)])
    store.close()


def child(tree: str, url: str, jobs: int, charges: int) -> None:
    """Open the state with `tree`'s store (its migrations run), then time the reads; print one JSON line."""
    sys.path.insert(0, tree)
    import os

    from orchestrator.app import App
    from orchestrator.lifecycle.budget_guard import BudgetGuard

    work = Path(tempfile.mkdtemp(prefix="ledger-reads-"))
    cfg = work / "burstctl.toml"
    cfg.write_text(f'[state]\ndatabase_url = "{url}"\n')
    os.environ["XDG_STATE_HOME"] = str(work / "xdg")
    t0 = time.perf_counter()
    app = App(config_path=str(cfg), state_dir_override=str(work / "state"))
    app.store.migrate()
    opened_s = time.perf_counter() - t0
    rng = random.Random(1)
    picks = [f"j{rng.randrange(jobs):06d}" for _ in range(200)]
    app.store.job_spend(picks[0])  # warm
    spend = []
    for job in picks:
        t = time.perf_counter()
        app.store.job_spend(job)
        spend.append(time.perf_counter() - t)
    guard = BudgetGuard(app, clock=time.time, tick_s=5.0)
    guard.exposure(time.time())
    exposure = []
    for _ in range(50):
        t = time.perf_counter()
        guard.exposure(time.time())
        exposure.append(time.perf_counter() - t)
    timings = {"open_s": opened_s, "spend_ms": statistics.median(spend) * 1e3,
               "exposure_ms": statistics.median(exposure) * 1e3}
    from orchestrator.lifecycle import orphans

    if hasattr(orphans, "last_charge"):
        charged = [f"i-{rng.randrange(charges):07d}" for _ in range(100)]
        never = [f"i-lost{n}" for n in range(100)]
        for indexed in (True, False):
            if not indexed:
                with app.store.tx() as c:
                    c.exec_driver_sql("DROP INDEX ix_ledger_instance")
            for name, ids in (("charged", charged), ("never", never)):
                took = []
                with app.store.engine.connect() as c:
                    orphans.last_charge(c, "lambda", ids[0])  # warm
                    for instance_id in ids:
                        t = time.perf_counter()
                        orphans.last_charge(c, "lambda", instance_id)
                        took.append(time.perf_counter() - t)
                timings[f"orphan_{name}_{'indexed' if indexed else 'unindexed'}_ms"] = statistics.median(took) * 1e3
    app.store.close()
    shutil.rmtree(work, ignore_errors=True)
    import state.store

    assert Path(state.store.__file__).resolve().is_relative_to(Path(tree).resolve()), state.store.__file__
    print(json.dumps(timings))


def measure(tree: Path, url: str, jobs: int, charges: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", str(tree), "--url", url, "--jobs", str(jobs),
                          "--charges", str(charges)], capture_output=True, text=True, check=True, cwd=tree)
    return dict(json.loads(out.stdout.splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=BASELINE, help="git revision to compare with")
    ap.add_argument("--charges", type=int, default=200_000)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--postgres", action="store_true", help="on PostgreSQL instead of SQLite")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--populate", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.url, args.jobs, args.charges)
        return
    if args.populate:
        sys.path.insert(0, args.populate)
        populate(args.url, args.charges, args.jobs)
        return
    server = None
    if args.postgres:
        sys.path.insert(0, str(REPO))
        from tests.postgres import PostgresServer, find_bin_dir

        bin_dir = find_bin_dir()
        if bin_dir is None:
            sys.exit("PostgreSQL's initdb/pg_ctl not found")
        server = PostgresServer(bin_dir).start()
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "now": []}
    try:
        with baseline_tree(args.baseline) as base, tempfile.TemporaryDirectory(prefix="ledger-reads-") as tmp:

            def built() -> str:
                url = server.new_database() if server is not None else f"sqlite:///{tmp}/built.db"
                subprocess.run([sys.executable, __file__, "--populate", str(base), "--url", url, "--charges",
                                str(args.charges), "--jobs", str(args.jobs)], check=True, cwd=base)
                return url

            if server is None:
                built()
            for r in range(args.rounds):
                for name, tree in (("baseline", base), ("now", REPO)):
                    if server is not None:
                        url = built()
                    else:
                        copy = Path(tmp) / f"{name}-{r}.db"
                        shutil.copyfile(Path(tmp) / "built.db", copy)
                        url = f"sqlite:///{copy}"
                    runs[name].append(measure(tree, url, args.jobs, args.charges))
                    if server is None:
                        copy.unlink()
    finally:
        if server is not None:
            server.stop()
    backend = "PostgreSQL" if args.postgres else "SQLite"
    print(f"{backend}, {args.charges:,} closed charges of {args.jobs:,} jobs, 3 open; medians, fastest of "
          f"{args.rounds} rounds\n")
    print(f"| read | baseline {args.baseline} | this tree | ratio |")
    print("|---|---|---|---|")
    for key, said, unit in (("spend_ms", "one job's spend (`Store.job_spend`)", "ms"),
                            ("exposure_ms", "the budget's check (`BudgetGuard.exposure`)", "ms"),
                            ("open_s", "opening the state (this tree: the upgrade)", "s")):
        b = min(x[key] for x in runs["baseline"])
        n = min(x[key] for x in runs["now"])
        print(f"| {said} | {b:.3f} {unit} | {n:.3f} {unit} | {n / b:.3f}× |")
    print("\n| read, this tree | without ix_ledger_instance | with it | ratio |")
    print("|---|---|---|---|")
    for name, said in (("charged", "an orphan's charges (`orphans.last_charge`), an instance charged"),
                       ("never", "the same, an instance never charged")):
        without = min(x[f"orphan_{name}_unindexed_ms"] for x in runs["now"])
        with_ = min(x[f"orphan_{name}_indexed_ms"] for x in runs["now"])
        print(f"| {said} | {without:.3f} ms | {with_:.3f} ms | {with_ / without:.3f}× |")


if __name__ == "__main__":
    main()
