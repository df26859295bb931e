"""Tables and versioned migrations. Add a migration; never edit an applied one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    Connection,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    inspect,
    select,
    text,
    update,
)

metadata = MetaData()

schema_version = Table("schema_version", metadata, Column("version", Integer, primary_key=True))

jobs = Table(
    "jobs",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("name", String(200), nullable=False, index=True),
    Column("kind", String(16), nullable=False),
    Column("state", String(32), nullable=False),
    Column("verdict", String(16), nullable=False),
    Column("placement", String(16), nullable=False),  # local | cloud | none
    Column("approved", Boolean, nullable=False, default=False),
    Column("spec", JSON, nullable=False),
    Column("decision", JSON, nullable=False),
    Column("reason", Text, nullable=True),
    Column("deadline_at", Float, nullable=False),  # unix seconds
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("record_path", Text, nullable=True),
    Column("checkpoint", Text, nullable=True),  # newest complete local checkpoint, if any
    # What the budget holds for the job, less what it has spent (`holds.held_by_plans` sums it in the database, not
    # by reading every queued job's decision): its spend when its decision was written and that decision's planned
    # rented cost (the cloud phases': the work left), kept with `decision` by the store; once an attempt of it is
    # written on a market, its spend then and the rest of its run at that market's rate (`budget.held_on_market`,
    # `Store.set_hold`).
    Column("rented_usd", Float, nullable=False, default=0.0, server_default="0"),
    # Unix seconds before which a queued job is not a candidate to start: its spot policy waits for spot, or a launch
    # failed a moment ago. Read in the query, so that such jobs do not fill the few candidates a tick reads.
    Column("wait_until", Float, nullable=True),
)
Index("ix_jobs_state", jobs.c.state)

attempts = Table(
    "attempts",
    metadata,
    Column("id", String(48), primary_key=True),  # <job>-a<n>
    Column("job_id", String(32), ForeignKey("jobs.id"), nullable=False, index=True),
    Column("n", Integer, nullable=False),
    Column("where", String(16), nullable=False),  # local | cloud
    Column("state", String(32), nullable=False),
    Column("provider", String(32), nullable=True),
    Column("instance_type", String(64), nullable=True),
    Column("region", String(64), nullable=True),
    Column("market", String(16), nullable=True),
    Column("idempotency_key", String(64), nullable=True, unique=True),
    Column("instance_id", String(128), nullable=True),
    Column("info", JSON, nullable=False),  # host, port, host key, pid, timings
    Column("reason", Text, nullable=True),
    Column("lost_work_h", Float, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("started_at", Float, nullable=True),
    Column("ended_at", Float, nullable=True),
)
Index("ix_attempts_state", attempts.c.state)

instances = Table(
    "instances",
    metadata,
    Column("provider", String(32), primary_key=True),
    Column("id", String(128), primary_key=True),
    Column("attempt_id", String(48), nullable=True, index=True),
    Column("state", String(32), nullable=False),
    Column("instance_type", String(64), nullable=True),
    Column("market", String(16), nullable=True),
    Column("rate_usd_h", Float, nullable=True),
    Column("host", String(128), nullable=True),
    Column("port", Integer, nullable=True),
    Column("host_key", Text, nullable=True),
    Column("launched_at", Float, nullable=True),
    Column("gone_at", Float, nullable=True),
    Column("verified_gone", Boolean, nullable=False, default=False),
    # Who confirmed it gone: its provider ("provider"), or the operator's word (`burstctl confirm-gone`: "operator")
    # for a provider that will never answer again. None while it is not confirmed gone.
    Column("gone_by", String(16), nullable=True),
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ts", Float, nullable=False),
    Column("type", String(64), nullable=False),
    Column("job_id", String(32), nullable=True),
    Column("attempt_id", String(48), nullable=True),
    Column("data", JSON, nullable=False),
)
Index("ix_events_job", events.c.job_id, events.c.id)
Index("ix_events_type", events.c.type, events.c.id)

ledger = Table(
    "ledger",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("month", String(7), nullable=False, index=True),  # YYYY-MM (UTC) the charge counts against
    Column("job_id", String(32), nullable=True),
    Column("attempt_id", String(48), nullable=True),
    Column("provider", String(32), nullable=False),
    Column("instance_id", String(128), nullable=True),
    Column("instance_type", String(64), nullable=True),
    Column("market", String(16), nullable=True),
    Column("rate_usd_h", Float, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("ended_at", Float, nullable=True),  # open while the instance runs
    Column("billed_seconds", Float, nullable=True),
    Column("cost_usd", Float, nullable=True),
)

settings = Table(
    "settings",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", JSON, nullable=False),
)

measurements = Table(
    "measurements",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ts", Float, nullable=False),
    Column("provider", String(32), nullable=False),
    Column("instance_type", String(64), nullable=False),
    Column("metric", String(32), nullable=False),  # boot_s | sync_s | teardown_s | throughput_units_h
    Column("value", Float, nullable=False),
)
Index("ix_measurements_key", measurements.c.provider, measurements.c.instance_type, measurements.c.metric)


spot_listings = Table(
    "spot_listings",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("provider", String(32), nullable=False),
    Column("instance_type", String(64), nullable=False),
    Column("at", Float, nullable=False),  # unix seconds
    Column("up", Boolean, nullable=False),  # the provider listed spot capacity (True) or none (False) from `at` on
)
Index("ix_spot_listings_key", spot_listings.c.provider, spot_listings.c.instance_type, spot_listings.c.at)

spot_region_listings = Table(
    "spot_region_listings",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("provider", String(32), nullable=False),
    Column("instance_type", String(64), nullable=False),
    Column("region", String(64), nullable=False),
    Column("at", Float, nullable=False),  # unix seconds
    Column("up", Boolean, nullable=False),  # this region listed spot capacity (True) or none (False) from `at` on
)
Index("ix_spot_region_listings_key", spot_region_listings.c.provider, spot_region_listings.c.instance_type,
      spot_region_listings.c.region, spot_region_listings.c.id)


def _v1(conn: Connection) -> None:
    metadata.create_all(conn)


def _v2(conn: Connection) -> None:
    # The tick reads queued jobs in deadline order and blocked jobs in updated order, LIMITed: with these
    # indexes that is a short index range scan, whatever the queue's length.
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_jobs_state_deadline ON jobs (state, deadline_at)"))
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_jobs_state_updated ON jobs (state, updated_at)"))


def _v3(conn: Connection) -> None:
    # The spot policy reads a month of one spot market's attempts (launches, preemptions, refusals) per launch.
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_attempts_market ON attempts "
                      "(provider, instance_type, market, created_at)"))


def _v4(conn: Connection) -> None:
    # Spot capacity as providers list it, changes only: what the spot policy learns outages from without launching.
    spot_listings.create(conn, checkfirst=True)


def _v5(conn: Connection) -> None:
    # The same per region: a spot launch tries first the region whose capacity has been listed longest.
    spot_region_listings.create(conn, checkfirst=True)


def _v6(conn: Connection) -> None:
    # Every decision reads the newest few of each t_ovh part, and a batch of re-decisions its jobs' measured s_R:
    # by metric, not by provider. Without these each read scanned the table, which grows with every run
    # (benchmarks/tick.py --measurements).
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_measurements_metric_id ON measurements (metric, id)"))
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_measurements_metric_type ON measurements "
                      "(metric, instance_type)"))


def planned_rented_usd(decision: dict[str, Any] | None) -> float:
    """A stored decision's planned rented cost: its cloud phases'."""
    return sum(float(p.get("cost_usd") or 0.0) for p in (decision or {}).get("plan") or [] if p.get("where") == "cloud")


def planned_launch_usd(decision: dict[str, Any] | None) -> float:
    """What a stored decision's launch needs of a month's budget (`Decision.launch_usd`: the plan's price, its
    billing minimum and its stop); its planned rented cost in a decision stored before it was kept."""
    launch = (decision or {}).get("launch_usd")
    return planned_rented_usd(decision) if launch is None else float(launch)


def _v7(conn: Connection) -> None:
    # Each job's planned rented cost, a column (`jobs.rented_usd`): the budget sums what admitted plans hold at every
    # decision, and reading 10,000 queued jobs' decisions for it took about 120 ms (benchmarks/tick.py).
    if "rented_usd" not in {c["name"] for c in inspect(conn).get_columns("jobs")}:  # a database v1 made has it
        conn.execute(text("ALTER TABLE jobs ADD COLUMN rented_usd FLOAT NOT NULL DEFAULT 0"))
    for job_id, decision in conn.execute(select(jobs.c.id, jobs.c.decision)).all():
        if rented := planned_rented_usd(decision):
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(rented_usd=rented))


def _v8(conn: Connection) -> None:
    # `jobs.wait_until`: the tick read the 24 earliest-deadline queued cloud jobs, and as many waiting for spot (or
    # backing off after a failed launch) kept every job behind them from starting.
    if "wait_until" not in {c["name"] for c in inspect(conn).get_columns("jobs")}:  # a database v1 made has it
        conn.execute(text("ALTER TABLE jobs ADD COLUMN wait_until FLOAT"))


def _v9(conn: Connection) -> None:
    # The ledger only grows (a charge per instance ever run, kept for the budget's meter), and only its month was
    # indexed: each read of one job's charges scanned all of it. A job's spend is read at every decision written
    # again, `show`, a launch's hold, a job's end and its notices (`Store.job_spend`), and by job for the budget's holds
    # and `report`. The charges still open (`ended_at IS NULL`: the budget's check, every tick and every launch; an
    # attempt's or an instance's charges closed when it ends) are a few, found through the second index.
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_ledger_job ON ledger (job_id)"))
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_ledger_ended ON ledger (ended_at)"))


def _v10(conn: Connection) -> None:
    # The ledger read by instance (provider, instance_id): the sweep's look at an orphan's charges (one open? the last
    # one's end: `orphans.last_charge`) and an instance's open charges closed when it is confirmed gone. The first
    # scanned the whole ledger (its max(ended_at) walked ix_ledger_ended from the newest charge, to the oldest for an
    # instance never charged). With ended_at in the index both of the sweep's reads are answered from it alone.
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_ledger_instance ON ledger (provider, instance_id, ended_at)"))


def _v11(conn: Connection) -> None:
    # `instances.gone_by`: an instance may be confirmed gone by the operator (`burstctl confirm-gone`) when its
    # provider will never answer again; what is said of its charge then names who confirmed it.
    if "gone_by" not in {c["name"] for c in inspect(conn).get_columns("instances")}:  # a database v1 made has it
        conn.execute(text("ALTER TABLE instances ADD COLUMN gone_by VARCHAR(16)"))
    conn.execute(update(instances).where(instances.c.verified_gone.is_(True)).values(gone_by="provider"))


# (version, migration). Each runs once, in order, inside a transaction.
MIGRATIONS: list[tuple[int, Callable[[Connection], None]]] = [
    (1, _v1),
    (2, _v2),
    (3, _v3),
    (4, _v4),
    (5, _v5),
    (6, _v6),
    (7, _v7),
    (8, _v8),
    (9, _v9),
    (10, _v10),
    (11, _v11),
]


def current_version(conn: Connection) -> int:
    schema_version.create(conn, checkfirst=True)
    v = conn.execute(text("SELECT MAX(version) FROM schema_version")).scalar()
    return int(v or 0)


LATEST = MIGRATIONS[-1][0]
